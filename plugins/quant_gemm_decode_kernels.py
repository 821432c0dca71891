"""Triton kernels of the small-M weight-only GEMMs (launched from plugins/quant_gemm_decode.py).

Every kernel computes ``out[M, N] = x[M, K] @ dequant(W)[N, K].T`` for one
tile of output channels and one split of K; the grid is
(N tiles, K splits, M tiles).

GEMV kernels (``*_gemv_kernel``, FMA + ``tl.sum`` over K, every row of x in
one program): a decode step at batch 1 or 2 does two FLOPs per weight, so
the only cost that should show is reading the weights, and the per-weight
work between a load and its FMA is what decides whether it does.

* INT8 and INT4 weights are read as int32 words (4 bytes, or 8 nibbles, per
  load element) and turned into floats by bit operations, with no
  int-to-float conversion (a quarter-rate instruction). An INT8 code is
  moved by one shift and one mask into the mantissa of a float near 1.0,
  ``1.5 + q/256``, exactly, and the offset is taken out through the sum of x.
  An INT4 code is masked out in place and read as a subnormal float, exactly
  (one AND per weight, one shift per word; see ``_int4_dot_words``), against
  x's phases scaled by powers of two; the zero is taken out through the sum
  of x, ``sum x (q - z) = 2^85 dots - z sum x``, per word (its 8 products in
  one FMA chain, then its group's scale and zero in two FMAs). On an H200 that
  made every Llama-3.1-8B INT4 GEMV 7-21% faster than writing the code under
  1.0's exponent (one shift and one mask-and-set per weight, 4.5 instructions
  per weight in the compiled loop against 3.4-3.6).
* FP8 weights are converted by the hardware (E4M3 pairs to half pairs) and
  share the 16-bit weights' kernel.
* The 16-bit, FP8 and INT4 GEMVs keep a float32 accumulator per weight (per
  word for INT4) that a thread reads, and sum across threads once, after the
  loop: a sum every step costs shuffles and barriers in the loop, which on an
  H200 left the INT4 GEMV at about a third of HBM bandwidth.
* Triton does not pipeline loads that feed no ``tl.dot``; with PREFETCH the
  next step's weights are requested into registers before the current
  step's are used, doubling the bytes in flight per thread (for registers).

tl.dot kernels (``*_dot_kernel``, 16-row tiles): for 3 to 16 rows, where the
GEMV's per-row FMAs would cost more than tensor-core tiles. INT4 codes become
``16 + q`` in x's dtype by setting the exponent bits (exact in bfloat16,
float16 and float32), the group's zero is taken out through the row sums of
x, and its scale multiplies the group's partial product.

Split-K without a second kernel: each split stores its float32 partial tile,
then counts itself in on a per-tile counter (an acq_rel atomic); the split
that arrives last adds all partials in split order (the result does not
depend on which split finished last), writes the output and resets the
counter to 0 for the next launch.
"""

from __future__ import annotations

import triton
import triton.language as tl

from plugins.pdl import enter


@triton.jit
def _write_tile(acc, rm, rn, M, N, out_ptr, stride_om, part_ptr, lock_ptr, SPLIT_K: tl.constexpr):
    """Store float32 ``acc`` [BLOCK_M, BLOCK_N] (rows ``rm``, columns ``rn``), reducing over K splits."""
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    out_ptrs = out_ptr + rm[:, None] * stride_om + rn[None, :]
    if SPLIT_K == 1:
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        offs = rm[:, None] * N + rn[None, :]
        tl.store(part_ptr + tl.program_id(1) * M * N + offs, acc, mask=mask)
        # Every thread's partial is written before the program counts itself in (the atomic is
        # issued by one thread; its release covers what the barrier ordered before it).
        tl.debug_barrier()
        lock = lock_ptr + tl.program_id(2) * tl.num_programs(0) + tl.program_id(0)
        if tl.atomic_add(lock, 1, sem="acq_rel") == SPLIT_K - 1:
            total = tl.zeros_like(acc)
            for split in tl.static_range(SPLIT_K):
                # .cg: read from L2, where the other SMs' partials are, never a stale L1 line.
                total += tl.load(part_ptr + split * M * N + offs, mask=mask, other=0.0, cache_modifier=".cg")
            tl.store(out_ptrs, total.to(out_ptr.dtype.element_ty), mask=mask)
            tl.atomic_xchg(lock, 0)


@triton.jit
def _load_x(row_ptr, k, K, EVEN_K: tl.constexpr):
    """Channels ``k`` of one row of x (or of the AWQ scale) as float32; 0 past K."""
    if EVEN_K:
        return tl.load(row_ptr + k).to(tl.float32)
    return tl.load(row_ptr + k, mask=k < K, other=0.0).to(tl.float32)


@triton.jit
def _load_words(row_ptrs, offset, row_mask, index, length, EVEN_K: tl.constexpr):
    """Weight elements ``offset + index`` of the rows ``row_ptrs`` (already offset by ``index``); 0 past
    ``length`` elements per row."""
    zero = tl.zeros((1,), dtype=row_ptrs.dtype.element_ty)  # in the weight's own type (int32 words or FP8)
    if EVEN_K:  # no mask along K: one that varies along K would stop the loads from being vectorized
        return tl.load(row_ptrs + offset, mask=row_mask, other=zero)
    return tl.load(row_ptrs + offset, mask=row_mask & (offset + index < length), other=zero)


@triton.jit
def _float_gemv_tile(w_ptr, N, K, stride_wn, steps_per_split, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     EVEN_K: tl.constexpr):
    """A GEMV program's tile of a weight read element by element (16-bit or FP8): (output channels
    ``rn``, their mask, the rows' pointers, channel offsets ``rk``, its first and last K step, and the
    first step's weights, already requested)."""
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    first = tl.program_id(1) * steps_per_split
    last = tl.minimum(first + steps_per_split, tl.cdiv(K, BLOCK_K))
    n_mask = rn < N
    w_rows = w_ptr + rn[:, None] * stride_wn + rk[None, :]
    w = _load_words(w_rows, first * BLOCK_K, n_mask[:, None], rk[None, :], K, EVEN_K)
    return rn, n_mask, w_rows, rk, first, last, w


@triton.jit
def _float_gemv_step(w, w_rows, n_mask, rk, step, last, K, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                     PREFETCH: tl.constexpr):
    """(this step's weights as float32, the weights to carry to the next step). With PREFETCH the next
    step's are requested before this step's are used (the last step re-requests its own)."""
    if PREFETCH:
        current = w
        w = _load_words(w_rows, tl.minimum(step + 1, last - 1) * BLOCK_K, n_mask[:, None], rk[None, :], K, EVEN_K)
    else:
        current = _load_words(w_rows, step * BLOCK_K, n_mask[:, None], rk[None, :], K, EVEN_K)
    return current.to(tl.float32), w  # FP8: E4M3 pairs to half pairs in hardware, then to float32


# -- dequantization in registers ----------------------------------------------------


@triton.jit
def _byte_as_float(v):
    """Bits 15..22 of ``v`` as a signed byte q, flipped to q + 128 under 1.0's exponent: 1.5 + q / 256."""
    return ((v & 0x7F8000) ^ 0x3FC00000).to(tl.float32, bitcast=True)


@triton.jit
def _int8_dot_words(w, x):
    """sum over each word's 4 channels of (1.5 + q/256) x: int32 words ``w`` [..., W], float32 ``x`` [..., W, 2, 2].

    Word i holds channel 4i+j in byte j, and x[..., i, a, b] is channel 4i + 2a + b.
    """
    x_even, x_odd = tl.split(x)
    x0, x2 = tl.split(x_even)
    x1, x3 = tl.split(x_odd)
    acc = _byte_as_float(w << 15) * x0
    acc += _byte_as_float(w << 7) * x1
    acc += _byte_as_float(w >> 1) * x2
    acc += _byte_as_float(w >> 9) * x3
    return acc


@triton.jit
def _int4_codes(c, dtype: tl.constexpr):
    """uint8 codes 0..15 -> 16 + q in ``dtype``, by writing q under the exponent of 16 (exact)."""
    if dtype == tl.bfloat16:
        return ((c.to(tl.int16) << 3) | 0x4180).to(tl.bfloat16, bitcast=True)
    elif dtype == tl.float16:
        return ((c.to(tl.int16) << 6) | 0x4C00).to(tl.float16, bitcast=True)
    else:
        return ((c.to(tl.int32) << 19) | 0x41800000).to(tl.float32, bitcast=True)


@triton.jit
def _int4_plane_codes(w, J: tl.constexpr, dtype: tl.constexpr):
    """Nibble J of int32 words ``w`` -> 16 + q in ``dtype``: one shift and one mask-and-set per value."""
    SHIFT: tl.constexpr = 3 if dtype == tl.bfloat16 else (6 if dtype == tl.float16 else 19)
    MAGIC: tl.constexpr = 0x4180 if dtype == tl.bfloat16 else (0x4C00 if dtype == tl.float16 else 0x41800000)
    if 4 * J > SHIFT:
        v = w >> (4 * J - SHIFT)
    else:
        v = w << (SHIFT - 4 * J)
    v = (v & (0xF << SHIFT)) | MAGIC
    if dtype == tl.float32:
        return v.to(tl.float32, bitcast=True)
    return v.to(tl.int16).to(dtype, bitcast=True)


@triton.jit
def _int4_word_codes(w, dtype: tl.constexpr):
    """int32 words ``w`` [..., W] -> codes [..., W, 2, 2, 2] in ``dtype`` (as ``_int4_plane_codes``), where
    [..., i, a, b, c] is nibble 4a + 2b + c of word i: joined plane by plane, so each thread holds its words'
    eight codes in order (the inverse of ``_phases``), ready for wide stores."""
    t00 = tl.join(_int4_plane_codes(w, 0, dtype), _int4_plane_codes(w, 4, dtype))  # [..., a]
    t01 = tl.join(_int4_plane_codes(w, 1, dtype), _int4_plane_codes(w, 5, dtype))
    t10 = tl.join(_int4_plane_codes(w, 2, dtype), _int4_plane_codes(w, 6, dtype))
    t11 = tl.join(_int4_plane_codes(w, 3, dtype), _int4_plane_codes(w, 7, dtype))
    return tl.join(tl.join(t00, t10), tl.join(t01, t11))  # [..., a, b], then [..., a, b, c]


# -- INT8 per output channel -----------------------------------------------------------
# Loops run over step indices so that k0 = step * BLOCK_K is known to be a multiple of
# BLOCK_K, which lets the loads be vectorized (k0 from a range() with a runtime start is not).


@triton.jit
def _w8a16_gemv_kernel(
    x_ptr, w_ptr, scale_ptr, out_ptr, part_ptr, lock_ptr, M, N, K, stride_xm, stride_wn, stride_om, steps_per_split,
    ROWS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    EVEN_K: tl.constexpr, PREFETCH: tl.constexpr, PDL: tl.constexpr,
):
    # w_ptr: the INT8 weight as int32 words [N, K / 4]; stride_wn in words.
    WORDS: tl.constexpr = BLOCK_K // 4
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, BLOCK_M)
    rw = tl.arange(0, WORDS)
    rk = tl.arange(0, BLOCK_K)
    first = tl.program_id(1) * steps_per_split
    last = tl.minimum(first + steps_per_split, tl.cdiv(K, BLOCK_K))
    n_mask = rn < N
    w_rows = w_ptr + rn[:, None] * stride_wn + rw[None, :]
    words = _load_words(w_rows, first * WORDS, n_mask[:, None], rw[None, :], K // 4, EVEN_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    enter(PDL)  # activations are read only after this
    for step in range(first, last):
        if PREFETCH:  # request the next step's words before using this step's (the last re-requests its own)
            current = words
            words = _load_words(w_rows, tl.minimum(step + 1, last - 1) * WORDS, n_mask[:, None], rw[None, :], K // 4,
                                EVEN_K)
        else:
            current = _load_words(w_rows, step * WORDS, n_mask[:, None], rw[None, :], K // 4, EVEN_K)
        k = step * BLOCK_K + rk
        for m in tl.static_range(ROWS):
            x = _load_x(x_ptr + m * stride_xm, k, K, EVEN_K)
            dots = tl.sum(_int8_dot_words(current, tl.reshape(x, (WORDS, 2, 2))[None, :, :, :]), axis=1)
            # sum x q = 256 sum x (1.5 + q/256) - 384 sum x (masked weights meet x = 0)
            part = 256.0 * dots - 384.0 * tl.sum(x, axis=0)
            acc += tl.where(rm[:, None] == m, part[None, :], 0.0)
    scale = tl.load(scale_ptr + rn, mask=n_mask, other=0.0)  # per output channel: once, after the sum
    _write_tile(acc * scale[None, :], rm, rn, M, N, out_ptr, stride_om, part_ptr, lock_ptr, SPLIT_K)


@triton.jit
def _weight_dot_kernel(
    x_ptr, w_ptr, scale_ptr, out_ptr, part_ptr, lock_ptr, M, N, K, stride_xm, stride_wn, stride_om, steps_per_split,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    PRECISION: tl.constexpr, PER_CHANNEL: tl.constexpr, PDL: tl.constexpr,
):
    """INT8 (per-channel scale) or FP8 (per-tensor scale) weights widened to x's dtype, exactly, then
    tl.dot on 16-row tiles; the scale is applied once, after the sum."""
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
    rk = tl.arange(0, BLOCK_K)
    first = tl.program_id(1) * steps_per_split
    last = tl.minimum(first + steps_per_split, tl.cdiv(K, BLOCK_K))
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    enter(PDL)  # activations are read only after this
    for step in range(first, last):
        k = step * BLOCK_K + rk
        x = tl.load(x_ptr + rm[:, None] * stride_xm + k[None, :], mask=(rm[:, None] < M) & (k[None, :] < K), other=0.0)
        w = tl.load(w_ptr + rn[None, :] * stride_wn + k[:, None], mask=(rn[None, :] < N) & (k[:, None] < K), other=0.0)
        acc = tl.dot(x, w.to(x.dtype), acc, input_precision=PRECISION)
    if PER_CHANNEL:
        scaled = acc * tl.load(scale_ptr + rn, mask=rn < N, other=0.0)[None, :]
    else:
        scaled = acc * tl.load(scale_ptr)
    _write_tile(scaled, rm, rn, M, N, out_ptr, stride_om, part_ptr, lock_ptr, SPLIT_K)


# -- INT4, asymmetric per group, AWQ input scale ---------------------------------------


# INT4 codes as subnormal floats: nibble j of a word, at bits 4j..4j+3 below bit 23 and masked out, is
# read as float32 bits q 2^(4j - 149), exactly (exponent field 0; Triton's FMAs keep subnormals);
# nibbles 5..7 are read the same way at bits 8..19 of the word shifted right by 12. So a weight costs
# one AND and one FMA, a word one shift, and there is no constant to take out again. x's phases are
# multiplied by 2^(64 - 4j) (2^(56 - 4(j - 5)) for 5..7) so that every product is q x 2^-85, a normal
# float32 for 2^-41 < |x| < 2^63; the group's scale times 2^85 scales the sum back.


@triton.jit
def _int4_dot_words(w, x0, x1, x2, x3, x4, x5, x6, x7):
    """sum over each word's 8 channels of its code read as a subnormal float times x'_j (see above): int32
    words ``w`` [BLOCK_N, C, W], phases ``x'_j`` [C, W] already scaled; one FMA chain per word."""
    acc = (w & 0xF).to(tl.float32, bitcast=True) * x0[None, :, :]
    acc += (w & 0xF0).to(tl.float32, bitcast=True) * x1[None, :, :]
    acc += (w & 0xF00).to(tl.float32, bitcast=True) * x2[None, :, :]
    acc += (w & 0xF000).to(tl.float32, bitcast=True) * x3[None, :, :]
    acc += (w & 0xF0000).to(tl.float32, bitcast=True) * x4[None, :, :]
    high = w >> 12  # nibbles 5..7 at bits 8..19 (what the shift brings in above them is masked off)
    acc += (high & 0xF00).to(tl.float32, bitcast=True) * x5[None, :, :]
    acc += (high & 0xF000).to(tl.float32, bitcast=True) * x6[None, :, :]
    acc += (high & 0xF0000).to(tl.float32, bitcast=True) * x7[None, :, :]
    return acc


@triton.jit
def _int4_x(x_row, pqs_ptr, word_k, K, HAS_PQS: tl.constexpr, EVEN_K: tl.constexpr):
    """One row of x at the channels of words starting at ``word_k`` [C, W]: [C, W, 8] float32, one 16-byte
    load per word, times the AWQ input scale."""
    channels = word_k[:, :, None] + tl.arange(0, 8)[None, None, :]
    x = _load_x(x_row, channels, K, EVEN_K)
    if HAS_PQS:
        x *= _load_x(pqs_ptr, channels, K, EVEN_K)
    return x


@triton.jit
def _int4_x_rows(x_ptr, stride_xm, pqs_ptr, word_k, K, ROWS: tl.constexpr, HAS_PQS: tl.constexpr,
                 EVEN_K: tl.constexpr):
    """Rows 0 and 1 of x as ``_int4_x`` reads them (row 1 repeats row 0 when there is one row)."""
    x0 = _int4_x(x_ptr, pqs_ptr, word_k, K, HAS_PQS, EVEN_K)
    x1 = x0
    if ROWS >= 2:
        x1 = _int4_x(x_ptr + stride_xm, pqs_ptr, word_k, K, HAS_PQS, EVEN_K)
    return x0, x1


@triton.jit
def _phases(x):
    """x [..., W, 2, 2, 2], where [..., i, a, b, c] is channel 8i + 4a + 2b + c, as its eight phases
    [..., W] (phase j: channel 8i + j of every word i); free when each thread holds whole words."""
    x_even, x_odd = tl.split(x)
    x_0_4, x_2_6 = tl.split(x_even)
    x_1_5, x_3_7 = tl.split(x_odd)
    x0, x4 = tl.split(x_0_4)
    x2, x6 = tl.split(x_2_6)
    x1, x5 = tl.split(x_1_5)
    x3, x7 = tl.split(x_3_7)
    return x0, x1, x2, x3, x4, x5, x6, x7


@triton.jit
def _int4_row_step(acc, words, x, a, b, THREAD_WORDS: tl.constexpr):
    """``acc`` [BLOCK_N, C, W / THREAD_WORDS] plus one step's INT4 products with one row of x ([C, W, 8]).

    Per word, ``sum x (q - z) s = a dots - b sum x`` with ``a = 2^85 s`` and ``b = z s`` of the word's group
    ([BLOCK_N, C, 1]); with THREAD_WORDS > 1 the sums of each run of that many words (one 16-byte load,
    in one thread and one group) are added in registers before the scale is applied.
    """
    x0, x1, x2, x3, x4, x5, x6, x7 = _phases(tl.reshape(x, (x.shape[0], x.shape[1], 2, 2, 2)))
    x_sum = ((x0 + x1) + (x2 + x3)) + ((x4 + x5) + (x6 + x7))
    # the powers of two: 2^64, 2^60, 2^56, 2^52, 2^48, then 2^56, 2^52, 2^48
    dots = _int4_dot_words(words, x0 * 1.8446744073709552e19, x1 * 1.152921504606847e18, x2 * 7.205759403792794e16,
                           x3 * 4503599627370496.0, x4 * 281474976710656.0, x5 * 7.205759403792794e16,
                           x6 * 4503599627370496.0, x7 * 281474976710656.0)
    if THREAD_WORDS > 1:  # runs never cross a chunk: W is a multiple of THREAD_WORDS
        rows: tl.constexpr = dots.shape[0]
        chunks: tl.constexpr = dots.shape[1]
        words_per_chunk: tl.constexpr = dots.shape[2]
        dots = tl.reshape(_thread_sums(tl.reshape(dots, (rows, chunks * words_per_chunk)), THREAD_WORDS),
                          (rows, chunks, words_per_chunk // THREAD_WORDS))
        x_sum = _thread_sums(x_sum, THREAD_WORDS)
    return acc + a * dots - b * x_sum[None, :, :]


@triton.jit
def _int4_groups(scale_ptr, zero_ptr, group_rows, stride_sg: tl.constexpr, step, n_mask, rc, K, BLOCK_K: tl.constexpr,
                 CHUNK: tl.constexpr, GROUP: tl.constexpr, EVEN_K: tl.constexpr):
    """The scales and zeros [BLOCK_N, C] of step ``step``'s chunks, as stored."""
    group_offs = group_rows + ((step * BLOCK_K) // GROUP) * stride_sg
    if EVEN_K:
        group_mask = n_mask[:, None]
    else:
        group_mask = n_mask[:, None] & (step * BLOCK_K + rc * CHUNK < K)[None, :]
    scale = tl.load(scale_ptr + group_offs, mask=group_mask, other=0.0)
    zero = tl.load(zero_ptr + group_offs, mask=group_mask, other=0.0)
    return scale, zero


@triton.jit
def _w4a16_gemv_kernel(
    x_ptr, w_ptr, scale_ptr, zero_ptr, pqs_ptr, out_ptr, part_ptr, lock_ptr,
    M, N, K, stride_xm, stride_wn, stride_sn, stride_sg: tl.constexpr, stride_om, steps_per_split,
    GROUP: tl.constexpr, HAS_PQS: tl.constexpr, CHUNK: tl.constexpr,
    ROWS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    EVEN_K: tl.constexpr, PREFETCH: tl.constexpr, PDL: tl.constexpr, THREAD_K: tl.constexpr,
):
    # w_ptr: the packed weight as int32 words [N, K / 8]; stride_wn in words. A step of BLOCK_K channels
    # is C = BLOCK_K / CHUNK chunks of CHUNK = min(GROUP, BLOCK_K) channels, each in one group, of W words.
    # Each thread keeps a float32 accumulator per word it reads, so the sum across threads happens once,
    # after the loop (as in the 16-bit GEMV); a chunk's group scale and zero are read once per row.
    # With PREFETCH everything a step reads (words, scales and zeros, the first two rows of x) is
    # requested a step ahead: a step's few loads otherwise wait out a round trip to L2 each.
    C: tl.constexpr = BLOCK_K // CHUNK
    W: tl.constexpr = CHUNK // 8
    THREAD_WORDS: tl.constexpr = 1 if THREAD_K == 0 else THREAD_K // 8
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, BLOCK_M)
    rc = tl.arange(0, C)
    rw = tl.arange(0, W)
    first = tl.program_id(1) * steps_per_split
    last = tl.minimum(first + steps_per_split, tl.cdiv(K, BLOCK_K))
    n_mask = rn < N
    step_words = (rc[:, None] * W + rw[None, :])[None, :, :]  # [1, C, W] within a step
    w_rows = w_ptr + rn[:, None, None] * stride_wn + step_words
    row_mask = n_mask[:, None, None]
    group_rows = rn[:, None] * stride_sn + rc[None, :] * stride_sg  # a chunk is a whole group when C > 1
    chunk_words = rc[:, None] * CHUNK + rw[None, :] * 8  # [C, W]: each word's first channel within a step
    words = _load_words(w_rows, first * (BLOCK_K // 8), row_mask, step_words, K // 8, EVEN_K)
    scale, zero = _int4_groups(scale_ptr, zero_ptr, group_rows, stride_sg, first, n_mask, rc, K, BLOCK_K, CHUNK, GROUP, EVEN_K)
    acc0 = tl.zeros((BLOCK_N, C, W // THREAD_WORDS), dtype=tl.float32)
    acc1 = tl.zeros((BLOCK_N, C, W // THREAD_WORDS), dtype=tl.float32)
    acc_rows = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    enter(PDL)  # activations are read only after this; the first step's weights are already on their way
    x0, x1 = _int4_x_rows(x_ptr, stride_xm, pqs_ptr, first * BLOCK_K + chunk_words, K, ROWS, HAS_PQS, EVEN_K)
    for step in range(first, last):
        word_k = step * BLOCK_K + chunk_words
        if PREFETCH:  # the next step's inputs before this step's are used (the last re-requests its own)
            ahead = tl.minimum(step + 1, last - 1)
            current, cur_scale, cur_zero, cur_x0, cur_x1 = words, scale, zero, x0, x1
            words = _load_words(w_rows, ahead * (BLOCK_K // 8), row_mask, step_words, K // 8, EVEN_K)
            scale, zero = _int4_groups(scale_ptr, zero_ptr, group_rows, stride_sg, ahead, n_mask, rc, K, BLOCK_K, CHUNK, GROUP,
                                       EVEN_K)
            x0, x1 = _int4_x_rows(x_ptr, stride_xm, pqs_ptr, ahead * BLOCK_K + chunk_words, K, ROWS, HAS_PQS,
                                  EVEN_K)
        elif step == first:
            current, cur_scale, cur_zero, cur_x0, cur_x1 = words, scale, zero, x0, x1
        else:
            current = _load_words(w_rows, step * (BLOCK_K // 8), row_mask, step_words, K // 8, EVEN_K)
            cur_scale, cur_zero = _int4_groups(scale_ptr, zero_ptr, group_rows, stride_sg, step, n_mask, rc, K, BLOCK_K, CHUNK,
                                               GROUP, EVEN_K)
            cur_x0, cur_x1 = _int4_x_rows(x_ptr, stride_xm, pqs_ptr, word_k, K, ROWS, HAS_PQS, EVEN_K)
        scale32 = cur_scale.to(tl.float32)
        a = (3.8685626227668134e25 * scale32)[:, :, None]  # 2^85 s
        b = (cur_zero.to(tl.float32) * scale32)[:, :, None]
        acc0 = _int4_row_step(acc0, current, cur_x0, a, b, THREAD_WORDS)
        if ROWS >= 2:
            acc1 = _int4_row_step(acc1, current, cur_x1, a, b, THREAD_WORDS)
        for m in tl.static_range(2, ROWS):  # rows past two: summed every step (registers stay bounded)
            x_m = _int4_x(x_ptr + m * stride_xm, pqs_ptr, word_k, K, HAS_PQS, EVEN_K)
            part = _int4_row_step(tl.zeros_like(acc0), current, x_m, a, b, THREAD_WORDS)
            acc_rows += tl.where(rm[:, None] == m, tl.sum(tl.sum(part, axis=2), axis=1)[None, :], 0.0)
    acc = acc_rows + tl.where(rm[:, None] == 0, tl.sum(tl.sum(acc0, axis=2), axis=1)[None, :], 0.0)
    if ROWS >= 2:
        acc += tl.where(rm[:, None] == 1, tl.sum(tl.sum(acc1, axis=2), axis=1)[None, :], 0.0)
    _write_tile(acc, rm, rn, M, N, out_ptr, stride_om, part_ptr, lock_ptr, SPLIT_K)


@triton.jit
def _w4a16_dot_bytes_kernel(
    x_ptr, w_ptr, scale_ptr, zero_ptr, pqs_ptr, out_ptr, part_ptr, lock_ptr,
    M, N, K, stride_xm, stride_wn, stride_sn, stride_sg: tl.constexpr, stride_om, steps_per_split,
    GROUP: tl.constexpr, HAS_PQS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    PRECISION: tl.constexpr, PDL: tl.constexpr,
):
    # Bytes, for groups too small for the word planes: BLOCK_K divides GROUP, so a step lies in one
    # group, with one scale and one zero per output channel; even and odd channels are two dots.
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
    rk = tl.arange(0, BLOCK_K)
    rb = tl.arange(0, BLOCK_K // 2)
    first = tl.program_id(1) * steps_per_split
    last = tl.minimum(first + steps_per_split, tl.cdiv(K, BLOCK_K))
    n_mask = rn < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    enter(PDL)  # activations are read only after this
    for step in range(first, last):
        k0 = step * BLOCK_K
        k = k0 + rk
        x = tl.load(x_ptr + rm[:, None] * stride_xm + k[None, :], mask=(rm[:, None] < M) & (k[None, :] < K), other=0.0)
        if HAS_PQS:
            x = (x.to(tl.float32) * tl.load(pqs_ptr + k, mask=k < K, other=0.0)[None, :]).to(x_ptr.dtype.element_ty)
        x_even, x_odd = tl.split(tl.reshape(x, (BLOCK_M, BLOCK_K // 2, 2)))
        packed = tl.load(w_ptr + rn[None, :] * stride_wn + (k0 // 2 + rb)[:, None],
                         mask=n_mask[None, :] & ((k0 + 2 * rb) < K)[:, None], other=0)  # [BLOCK_K / 2, BLOCK_N]
        dots = tl.dot(x_even, _int4_codes(packed & 0xF, x.dtype), input_precision=PRECISION)
        dots = tl.dot(x_odd, _int4_codes(packed >> 4, x.dtype), dots, input_precision=PRECISION)
        x_sum = tl.sum(x.to(tl.float32), axis=1)
        group_offs = rn * stride_sn + (k0 // GROUP) * stride_sg
        scale = tl.load(scale_ptr + group_offs, mask=n_mask, other=0.0).to(tl.float32)
        zero = tl.load(zero_ptr + group_offs, mask=n_mask, other=0.0).to(tl.float32)
        # the codes were 16 + q: sum x (q - z) = dots - (16 + z) sum x
        acc += (dots - (16.0 + zero)[None, :] * x_sum[:, None]) * scale[None, :]
    _write_tile(acc, rm, rn, M, N, out_ptr, stride_om, part_ptr, lock_ptr, SPLIT_K)


@triton.jit
def _w4a16_dot_kernel(
    x_ptr, w_ptr, scale_ptr, zero_ptr, pqs_ptr, out_ptr, part_ptr, lock_ptr,
    M, N, K, stride_xm, stride_wn, stride_sn, stride_sg: tl.constexpr, stride_om, steps_per_split,
    GROUP: tl.constexpr, HAS_PQS: tl.constexpr, EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    PRECISION: tl.constexpr, PDL: tl.constexpr, ONE_DOT: tl.constexpr = False,
):
    # w_ptr: the packed weight as int32 words [N, K / 8]. A step of BLOCK_K channels (dividing GROUP,
    # at least 128) is BLOCK_K / 8 words per output channel; nibble j of every word is one "plane"
    # [BLOCK_K / 8, BLOCK_N], multiplied by x's channels 8i + j: eight dots of K = BLOCK_K / 8.
    # ONE_DOT instead joins each word's eight codes along new last axes and reshapes them into the
    # step's whole tile in channel order, for one dot of K = BLOCK_K: on Hopper the eight small dots
    # each store their plane to shared memory and wait for their own wgmma before the next starts;
    # one dot issues its K / 16 wgmma instructions back to back.
    WORDS: tl.constexpr = BLOCK_K // 8
    DTYPE: tl.constexpr = x_ptr.dtype.element_ty
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
    rk = tl.arange(0, BLOCK_K)
    rw = tl.arange(0, WORDS)
    first = tl.program_id(1) * steps_per_split
    last = tl.minimum(first + steps_per_split, tl.cdiv(K, BLOCK_K))
    n_mask = rn < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    enter(PDL)  # activations are read only after this
    for step in range(first, last):
        k0 = step * BLOCK_K
        k = k0 + rk
        x = tl.load(x_ptr + rm[:, None] * stride_xm + k[None, :], mask=(rm[:, None] < M) & (k[None, :] < K), other=0.0)
        if HAS_PQS:
            x = (x.to(tl.float32) * tl.load(pqs_ptr + k, mask=k < K, other=0.0)[None, :]).to(DTYPE)
        word = k0 // 8 + rw
        if ONE_DOT:
            # Words [BLOCK_N, WORDS], each output channel's run of words contiguous, joined to codes
            # [BLOCK_N, WORDS, 2, 2, 2] (so column 8i + j = nibble j of word i): a thread holds whole words'
            # codes in channel order, so they reach shared memory in wide stores; the dot reads them transposed.
            w_ptrs = w_ptr + rn[:, None] * stride_wn + word[None, :]
            if EVEN_K:
                w = tl.load(w_ptrs, mask=n_mask[:, None], other=0)
            else:
                w = tl.load(w_ptrs, mask=n_mask[:, None] & (word * 8 < K)[None, :], other=0)
            codes = tl.reshape(_int4_word_codes(w, DTYPE), (BLOCK_N, BLOCK_K))
            dots = tl.dot(x, tl.trans(codes), input_precision=PRECISION)
        else:
            w_ptrs = w_ptr + rn[None, :] * stride_wn + word[:, None]  # [WORDS, BLOCK_N]
            if EVEN_K:
                w = tl.load(w_ptrs, mask=n_mask[None, :], other=0)
            else:
                w = tl.load(w_ptrs, mask=n_mask[None, :] & (word * 8 < K)[:, None], other=0)
            # x[:, 8i + 4a + 2b + c] -> the eight phases [BLOCK_M, WORDS]
            x0, x1, x2, x3, x4, x5, x6, x7 = _phases(tl.reshape(x, (BLOCK_M, WORDS, 2, 2, 2)))
            dots = tl.dot(x0, _int4_plane_codes(w, 0, DTYPE), input_precision=PRECISION)
            dots = tl.dot(x1, _int4_plane_codes(w, 1, DTYPE), dots, input_precision=PRECISION)
            dots = tl.dot(x2, _int4_plane_codes(w, 2, DTYPE), dots, input_precision=PRECISION)
            dots = tl.dot(x3, _int4_plane_codes(w, 3, DTYPE), dots, input_precision=PRECISION)
            dots = tl.dot(x4, _int4_plane_codes(w, 4, DTYPE), dots, input_precision=PRECISION)
            dots = tl.dot(x5, _int4_plane_codes(w, 5, DTYPE), dots, input_precision=PRECISION)
            dots = tl.dot(x6, _int4_plane_codes(w, 6, DTYPE), dots, input_precision=PRECISION)
            dots = tl.dot(x7, _int4_plane_codes(w, 7, DTYPE), dots, input_precision=PRECISION)
        x_sum = tl.sum(x.to(tl.float32), axis=1)
        group_offs = rn * stride_sn + (k0 // GROUP) * stride_sg
        scale = tl.load(scale_ptr + group_offs, mask=n_mask, other=0.0).to(tl.float32)
        zero = tl.load(zero_ptr + group_offs, mask=n_mask, other=0.0).to(tl.float32)
        # the codes were 16 + q: sum x (q - z) = dots - (16 + z) sum x
        acc += (dots - (16.0 + zero)[None, :] * x_sum[:, None]) * scale[None, :]
    _write_tile(acc, rm, rn, M, N, out_ptr, stride_om, part_ptr, lock_ptr, SPLIT_K)


# -- 16-bit or FP8 E4M3 weights (FP8: one scale per tensor), 16-bit activations ------------


@triton.jit
def _thread_sums(products, THREAD_K: tl.constexpr):
    """``products`` [BLOCK_N, BLOCK_K] as they are (THREAD_K 0) or summed over runs of THREAD_K channels
    [BLOCK_N, BLOCK_K / THREAD_K]: the run of one 16-byte load, which a thread holds whole, so the sum
    stays in its registers (no shuffles)."""
    if THREAD_K == 0:
        sums = products
    else:
        sums = tl.sum(tl.reshape(products, (products.shape[0], products.shape[1] // THREAD_K, THREAD_K)), axis=2)
    return sums


@triton.jit
def _float_rows_step(acc0, acc1, acc_rows, w32, x_ptr, stride_xm, k, K, rm, ROWS: tl.constexpr, EVEN_K: tl.constexpr,
                     THREAD_K: tl.constexpr):
    """One step's products of float32 weights ``w32`` [BLOCK_N, BLOCK_K] (channels ``k``) with each row of x:
    rows 0 and 1 into their accumulators (``_thread_sums``' shape), later rows summed into ``acc_rows``
    [BLOCK_M, BLOCK_N]."""
    acc0 += _thread_sums(w32 * _load_x(x_ptr, k, K, EVEN_K)[None, :], THREAD_K)
    if ROWS >= 2:
        acc1 += _thread_sums(w32 * _load_x(x_ptr + stride_xm, k, K, EVEN_K)[None, :], THREAD_K)
    for m in tl.static_range(2, ROWS):
        part = tl.sum(w32 * _load_x(x_ptr + m * stride_xm, k, K, EVEN_K)[None, :], axis=1)
        acc_rows += tl.where(rm[:, None] == m, part[None, :], 0.0)
    return acc0, acc1, acc_rows


@triton.jit
def _float_gemv_kernel(
    x_ptr, w_ptr, scale_ptr, out_ptr, part_ptr, lock_ptr, M, N, K, stride_xm, stride_wn, stride_om, steps_per_split,
    ROWS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    EVEN_K: tl.constexpr, PREFETCH: tl.constexpr, PDL: tl.constexpr, SCALED: tl.constexpr, THREAD_K: tl.constexpr,
):
    """Weights read element by element (16-bit, or FP8 converted by the hardware) times rows of x; with
    SCALED the sum is multiplied by the per-tensor scale at ``scale_ptr``."""
    rm = tl.arange(0, BLOCK_M)
    rn, n_mask, w_rows, rk, first, last, w = _float_gemv_tile(w_ptr, N, K, stride_wn, steps_per_split, BLOCK_N,
                                                              BLOCK_K, EVEN_K)
    # Rows 0 and 1 keep float32 accumulators of the tile's shape (or per THREAD_K channels), summed
    # over K once, after the loop; rows past two (only on request: decode_config sends them to tl.dot)
    # are summed every step.
    ACC_K: tl.constexpr = BLOCK_K if THREAD_K == 0 else BLOCK_K // THREAD_K
    acc0 = tl.zeros((BLOCK_N, ACC_K), dtype=tl.float32)
    acc1 = tl.zeros((BLOCK_N, ACC_K), dtype=tl.float32)
    acc_rows = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if PDL and not PREFETCH:
        # The first step's weights were requested before the wait, so they stream in while the previous
        # kernel finishes; that step is done here and the loop starts at the second.
        enter(PDL)
        acc0, acc1, acc_rows = _float_rows_step(acc0, acc1, acc_rows, w.to(tl.float32), x_ptr, stride_xm,
                                                first * BLOCK_K + rk, K, rm, ROWS, EVEN_K, THREAD_K)
        first += 1
    else:
        enter(PDL)
    for step in range(first, last):
        w32, w = _float_gemv_step(w, w_rows, n_mask, rk, step, last, K, BLOCK_K, EVEN_K, PREFETCH)
        acc0, acc1, acc_rows = _float_rows_step(acc0, acc1, acc_rows, w32, x_ptr, stride_xm, step * BLOCK_K + rk, K,
                                                rm, ROWS, EVEN_K, THREAD_K)
    acc = acc_rows + tl.where(rm[:, None] == 0, tl.sum(acc0, axis=1)[None, :], 0.0)
    if ROWS >= 2:
        acc += tl.where(rm[:, None] == 1, tl.sum(acc1, axis=1)[None, :], 0.0)
    if SCALED:
        acc = acc * tl.load(scale_ptr)
    _write_tile(acc, rm, rn, M, N, out_ptr, stride_om, part_ptr, lock_ptr, SPLIT_K)
