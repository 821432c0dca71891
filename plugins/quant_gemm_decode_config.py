"""Launch settings of the small-M quantized GEMMs (plugins/quant_gemm_decode.py): the knobs to tune per GPU.

``decode_config`` is a small function of (format, rows, N, K, SM count):

* up to ``FMA_MAX_ROWS[format]`` rows the kernel is a GEMV (FMA + ``tl.sum``
  over K): its arithmetic grows with the rows, but at one row (two for INT4)
  it is cheaper than building ``tl.dot`` operands, and reading the weights
  is all that should cost;
* above that, a ``tl.dot`` kernel on 16-row tiles, whose cost barely depends
  on the rows;
* either way K is split when the output tiles alone would leave SMs idle:
  a decode GEMM has few output tiles (N / BLOCK_N) but a long K, and only a
  GPU whose every SM streams weights reaches HBM bandwidth.

bench/quant_gemm_kernels.py times variants of these tiles on Llama-3.1-8B's
shapes on a GPU and reports the fastest per case; the tables below are what
to update from its results.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

FORMATS = ("int8", "int4", "fp8")


# Split-K: aim for PROGRAMS_PER_SM programs per SM, never below MIN_SPLIT_STEPS
# loop steps per split (each split costs a partial write and a read back), and
# never more than MAX_SPLIT splits.
PROGRAMS_PER_SM = 4
MIN_SPLIT_STEPS = 4
MAX_SPLIT = 16


DOT_BLOCK_M = 16  # rows per tl.dot tile: the smallest M side of a tensor-core MMA
# The most rows one tl.dot program takes past 16 rows. On an H100 with Llama-3.1-8B's projections, tiles
# of 32 and 64 rows beat 16-row tiles and the dequantized weight on every INT4 projection at 32 to 128
# rows, and on every INT8 one but o at 128 (bench/results/h100_quant_gemm_int4_int8_row_block_llama8b.json).
MAX_ROW_BLOCK = 64


@dataclass(frozen=True, slots=True)
class DecodeConfig:
    """One launch of a small-M kernel."""

    fma: bool  # True: GEMV with FMA and tl.sum over K; False: tl.dot on 16-row tiles
    block_n: int  # output channels per program
    block_k: int  # input channels per loop step (INT4 on tl.dot: at most the group size)
    split_k: int = 0  # programs along K per output tile; 0: chosen from the SM count (``split_k_for``)
    num_warps: int = 4
    # tl.dot kernels: Triton's software pipeline depth. GEMV kernels (whose loads Triton does not
    # pipeline): 2 or more requests the next step's weights into registers ahead, 1 does not.
    num_stages: int = 2
    # GEMVs: channels whose products a thread adds in registers before its accumulator (one 16-byte
    # load's worth: 8 16-bit, 16 FP8 or 32 INT4 weights), so it keeps BLOCK_K / thread_k float32
    # accumulators per row instead of one per weight; 0 keeps one per weight. Fewer registers let more
    # programs (and their loads) stay resident on an SM.
    thread_k: int = 0
    # tl.dot kernels: rows per program (a power of two, at least DOT_BLOCK_M); 0 is DOT_BLOCK_M. A
    # batch past one tile reads the weights once per tile of rows, so larger tiles read them less often.
    block_m: int = 0
    # INT4 tl.dot kernel: build each step's whole [block_k, block_n] tile of codes in channel order for one
    # dot, instead of eight dots of one nibble plane each (which Hopper runs one wgmma at a time).
    one_dot: bool = False

    def __post_init__(self) -> None:
        if self.thread_k and (self.thread_k & (self.thread_k - 1) or self.block_k % self.thread_k):
            raise ValueError(f"thread_k {self.thread_k} must be a power of two dividing block_k {self.block_k}")
        if self.block_m and (self.fma or self.block_m < DOT_BLOCK_M or self.block_m & (self.block_m - 1)):
            raise ValueError(f"block_m {self.block_m}: tl.dot tiles only, a power of two of at least {DOT_BLOCK_M}")
        if self.one_dot and self.fma:
            raise ValueError("one_dot is a setting of the tl.dot kernel, not of the GEMV")

    @property
    def rows_per_tile(self) -> int:
        """Rows one tl.dot program covers."""
        return self.block_m or DOT_BLOCK_M

    def describe(self) -> dict[str, int | bool]:
        described = {"fma": self.fma, "block_n": self.block_n, "block_k": self.block_k, "split_k": self.split_k,
                     "num_warps": self.num_warps, "num_stages": self.num_stages, "thread_k": self.thread_k}
        return described | ({"block_m": self.block_m} if self.block_m else {}) | (
            {"one_dot": True} if self.one_dot else {})


# Rows up to which the GEMV (FMA) kernel is used. The defaults come from the
# compiled kernels' inner loops on sm_90 (instructions per weight read): the
# INT4 GEMV costs about 3.4-3.6 at one row (4.6 before its codes were read as
# subnormal floats), its tl.dot kernel about 6.4 (10 with
# the AWQ input scale); the INT8 and FP8 GEMVs about 5.5 and 3.2 at one row,
# their tl.dot kernels about 4.2-4.4 at any row count. At HBM speed an H200
# can spend about 3.9 per INT4 weight and 7.8 per INT8/FP8 weight, so INT8 and
# FP8 are bandwidth-bound either way. The INT4 GEMV is not: on an H200 its
# gate_up projection streams at about half the copy bandwidth (2.1 TB/s), its
# arithmetic, its reads of x and its loop's loads each taking a share.
# bench/quant_gemm_kernels.py measures both.
FMA_MAX_ROWS = {"int8": 1, "int4": 2, "fp8": 1}

# GEMV tiles: 8 KiB of weights per program and step, 64 bytes per thread (four 16-byte loads).
# FP8 does not prefetch: carrying FP8 bytes across the loop costs byte shuffles.
FMA_TILES = {
    "int8": DecodeConfig(fma=True, block_n=32, block_k=256),
    "int4": DecodeConfig(fma=True, block_n=64, block_k=256),
    "fp8": DecodeConfig(fma=True, block_n=32, block_k=256, num_stages=1),
}
FMA_MULTI_ROW_BLOCK_N = 32  # every extra row adds registers (its x phases, its FMA chains)

# tl.dot tiles (16 rows): INT4 steps one group (or a divisor of it) at a time.
DOT_TILES = {
    "int8": DecodeConfig(fma=False, block_n=64, block_k=128, num_stages=3),
    "int4": DecodeConfig(fma=False, block_n=64, block_k=128, num_stages=3),
    "fp8": DecodeConfig(fma=False, block_n=64, block_k=128, num_stages=3),
}


def split_k_for(tiles: int, k_steps: int, num_sms: int) -> int:
    """Splits of K (a power of two) so that ``tiles`` output tiles keep ``num_sms`` SMs busy."""
    split = 1
    while (
        tiles * split < PROGRAMS_PER_SM * num_sms
        and split * 2 <= MAX_SPLIT
        and k_steps // (split * 2) >= MIN_SPLIT_STEPS
    ):
        split *= 2
    return split


def decode_config(fmt: str, rows: int, n: int, k: int, num_sms: int, group_size: int = 128) -> DecodeConfig:
    """The launch for ``rows`` x ``k`` activations times an ``n`` x ``k`` weight in ``fmt`` (int8, int4, fp8).

    ``split_k`` is always resolved (never 0) in the result.
    """
    if fmt not in FORMATS:
        raise ValueError(f"unknown weight format {fmt!r}; expected one of {FORMATS}")
    if rows > FMA_MAX_ROWS[fmt]:
        return dot_config(fmt, rows, n, k, num_sms, group_size)
    config = FMA_TILES[fmt]
    if rows > 1:
        config = replace(config, block_n=min(config.block_n, FMA_MULTI_ROW_BLOCK_N))
    return resolve_split(config, rows, n, k, num_sms)


def dot_config(
    fmt: str, rows: int, n: int, k: int, num_sms: int, group_size: int = 128, block_m: int = 0,
) -> DecodeConfig:
    """The tl.dot launch for the shape (also where a GEMV cannot read the weight as words), in programs of
    ``block_m`` rows (0: DOT_BLOCK_M)."""
    config = replace(DOT_TILES[fmt], block_m=block_m)
    if fmt == "int4":
        config = replace(config, block_k=min(config.block_k, group_size))
    return resolve_split(config, rows, n, k, num_sms)


def row_block(rows: int) -> int:
    """Rows per tl.dot program for a batch past the GEMV kernels' 16 rows: the batch in one tile of rows up
    to MAX_ROW_BLOCK (each tile reads the weights once), in tiles of MAX_ROW_BLOCK past that."""
    return min(MAX_ROW_BLOCK, max(DOT_BLOCK_M, 1 << (rows - 1).bit_length()))


def resolve_split(config: DecodeConfig, rows: int, n: int, k: int, num_sms: int) -> DecodeConfig:
    """``config`` with ``split_k`` 0 replaced by the SM-count choice."""
    if config.split_k:
        return config
    row_tiles = 1 if config.fma else -(-rows // config.rows_per_tile)
    tiles = -(-n // config.block_n) * row_tiles
    return replace(config, split_k=split_k_for(tiles, -(-k // config.block_k), num_sms))
