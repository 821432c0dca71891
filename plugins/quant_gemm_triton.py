"""Weight-only GEMMs in Triton: the weights are dequantized inside the GEMM.

A decode step is bound by the bytes of weights it reads; these kernels read
INT8 (half of bf16) or packed INT4 (a quarter) from memory and widen each
tile in registers right before ``tl.dot``, so the 16-bit weight never exists
in memory. One program computes a [BLOCK_M, BLOCK_N] tile of ``x @ W.T``.

INT4: a packed byte holds input channels 2i (low nibble) and 2i+1 (high), so
a K-tile is loaded as BLOCK_K/2 bytes per output channel and split into the
even and odd halves, each multiplied with the matching even/odd columns of x:
``x @ W.T = x[:, 0::2] @ W_even.T + x[:, 1::2] @ W_odd.T``. BLOCK_K divides
the group size, so a tile lies in one group and needs one scale and one zero
per output channel. AWQ's per-input-channel ``pre_quant_scale`` is applied to
the x tile as it is loaded.

Registered for CUDA; tests also run them on the CPU through Triton's
interpreter (TRITON_INTERPRET=1) on small shapes.
"""

from __future__ import annotations

import torch

from plugins.registry import register_kernel

try:
    import triton
    import triton.language as tl
except ImportError:  # no triton: the kernels are simply not registered
    triton = None


def _config(rows: int, group_size: int = 128) -> dict[str, int]:
    """Tile sizes: a decode step (few rows) is a matrix-vector product bound by weight bytes, so it
    uses narrow N tiles (more programs to spread the weight stream over the SMs) and long K tiles
    with a deep pipeline; a context step uses wide tiles for tensor-core throughput."""
    if rows <= 16:
        return {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": min(128, group_size), "num_warps": 4, "num_stages": 4}
    return {"BLOCK_M": 32 if rows <= 32 else 64, "BLOCK_N": 128, "BLOCK_K": min(64, group_size), "num_warps": 4,
            "num_stages": 3}


def _precision(dtype: torch.dtype) -> str:
    # float32 inputs would otherwise be multiplied in TF32 on the tensor cores (10-bit mantissa).
    return "ieee" if dtype == torch.float32 else "tf32"


if triton is not None:

    @triton.jit
    def _w8a16_kernel(
        x_ptr, w_ptr, scale_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_om,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
    ):
        rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + rk
            x_mask = (rm[:, None] < M) & (k[None, :] < K)
            x = tl.load(x_ptr + rm[:, None] * stride_xm + k[None, :], mask=x_mask, other=0.0)
            # w tile [BLOCK_K, BLOCK_N]: column n is output channel n's weights.
            w_mask = (rn[None, :] < N) & (k[:, None] < K)
            w = tl.load(w_ptr + rn[None, :] * stride_wn + k[:, None], mask=w_mask, other=0)
            acc += tl.dot(x, w.to(x.dtype), input_precision=PRECISION)
        scale = tl.load(scale_ptr + rn, mask=rn < N, other=0.0)  # per output channel: applied once, after the sum
        out = acc * scale[None, :]
        tl.store(out_ptr + rm[:, None] * stride_om + rn[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=(rm[:, None] < M) & (rn[None, :] < N))

    @triton.jit
    def _w4a16_kernel(
        x_ptr, w_ptr, scale_ptr, zero_ptr, pqs_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_sn, stride_sg,
        stride_om, GROUP: tl.constexpr, HAS_PQS: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
    ):
        rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        rb = tl.arange(0, BLOCK_K // 2)  # packed bytes of one K-tile
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k_even = k0 + 2 * rb
            k_odd = k_even + 1
            x_rows = x_ptr + rm[:, None] * stride_xm
            x_mask = rm[:, None] < M
            x_even = tl.load(x_rows + k_even[None, :], mask=x_mask & (k_even[None, :] < K), other=0.0)
            x_odd = tl.load(x_rows + k_odd[None, :], mask=x_mask & (k_odd[None, :] < K), other=0.0)
            if HAS_PQS:
                x_even = (x_even * tl.load(pqs_ptr + k_even, mask=k_even < K, other=0.0)[None, :]).to(x_even.dtype)
                x_odd = (x_odd * tl.load(pqs_ptr + k_odd, mask=k_odd < K, other=0.0)[None, :]).to(x_odd.dtype)
            packed = tl.load(
                w_ptr + rn[None, :] * stride_wn + (k0 // 2 + rb)[:, None],
                mask=(rn[None, :] < N) & (k_even[:, None] < K), other=0,
            )  # [BLOCK_K / 2, BLOCK_N] uint8
            group = k0 // GROUP
            scale = tl.load(scale_ptr + rn * stride_sn + group * stride_sg, mask=rn < N, other=0.0).to(tl.float32)[None, :]
            zero = tl.load(zero_ptr + rn * stride_sn + group * stride_sg, mask=rn < N, other=0.0).to(tl.float32)[None, :]
            w_even = ((packed & 0xF).to(tl.float32) - zero) * scale
            w_odd = ((packed >> 4).to(tl.float32) - zero) * scale
            acc += tl.dot(x_even, w_even.to(x_even.dtype), input_precision=PRECISION)
            acc += tl.dot(x_odd, w_odd.to(x_odd.dtype), input_precision=PRECISION)
        tl.store(out_ptr + rm[:, None] * stride_om + rn[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=(rm[:, None] < M) & (rn[None, :] < N))

    @register_kernel(
        "gemm_w8a16", "triton", device_types=frozenset({"cuda"}),
        description="Triton: INT8 weights widened in registers inside the GEMM, per-channel scale after",
    )
    def gemm_w8a16_triton(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        # x: [M, K], qweight: [N, K] int8, scales: [N] float32 -> [M, N]
        x = x if x.stride(-1) == 1 else x.contiguous()
        (m, k), n = x.shape, qweight.shape[0]
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
        config = _config(m)
        grid = (triton.cdiv(m, config["BLOCK_M"]), triton.cdiv(n, config["BLOCK_N"]))
        _w8a16_kernel[grid](x, qweight, scales, out, m, n, k, x.stride(0), qweight.stride(0), out.stride(0),
                            PRECISION=_precision(x.dtype), **config)
        return out

    @register_kernel(
        "gemm_w4a16", "triton", device_types=frozenset({"cuda"}),
        description="Triton: packed INT4 group weights dequantized inside the GEMM (+ AWQ pre-quant scale)",
    )
    def gemm_w4a16_triton(
        x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
        pre_quant_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        # x: [M, K], qweight: [N, K/2] uint8, scales/zeros: [N, groups] of any (shared) layout -> [M, N]
        x = x if x.stride(-1) == 1 else x.contiguous()
        if scales.stride() != zeros.stride():
            raise ValueError("INT4 scales and zeros must share one layout")
        (m, k), n = x.shape, qweight.shape[0]
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
        config = _config(m, group_size)
        grid = (triton.cdiv(m, config["BLOCK_M"]), triton.cdiv(n, config["BLOCK_N"]))
        _w4a16_kernel[grid](
            x, qweight, scales, zeros, pre_quant_scale if pre_quant_scale is not None else scales, out,
            m, n, k, x.stride(0), qweight.stride(0), *scales.stride(), out.stride(0),
            GROUP=group_size, HAS_PQS=pre_quant_scale is not None, PRECISION=_precision(x.dtype), **config,
        )
        return out

    @triton.jit
    def _int4_dequant_kernel(
        w_ptr, scale_ptr, zero_ptr, pqs_ptr, out_ptr, N, K, stride_wn, stride_sn, stride_sg, stride_on,
        GROUP: tl.constexpr, HAS_PQS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):
        # Shaped like the INT8 pass: a program's K block lies in one group, so its scales and zeros are one
        # vector over its output channels, and each weight reads its own byte (two neighbours share one,
        # within a load) and shifts its nibble out, so loads and stores share one layout.
        rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        k0 = tl.program_id(1) * BLOCK_K
        rk = k0 + tl.arange(0, BLOCK_K)
        n_mask = rn < N
        mask = n_mask[:, None] & (rk < K)[None, :]
        packed = tl.load(w_ptr + rn[:, None] * stride_wn + (rk // 2)[None, :], mask=mask, other=0)
        codes = ((packed >> ((rk & 1) * 4).to(tl.uint8)[None, :]) & 0xF).to(tl.float32)  # 2i low nibble, 2i+1 high
        group_offs = rn * stride_sn + (k0 // GROUP) * stride_sg
        scale = tl.load(scale_ptr + group_offs, mask=n_mask, other=0.0).to(tl.float32)
        zero = tl.load(zero_ptr + group_offs, mask=n_mask, other=0.0).to(tl.float32)
        w = (codes - zero[:, None]) * scale[:, None]
        if HAS_PQS:  # x * s @ W.T = x @ (W * s).T: AWQ's input scale folded into the weight
            w *= tl.load(pqs_ptr + rk, mask=rk < K, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + rn[:, None] * stride_on + rk[None, :], w.to(out_ptr.dtype.element_ty), mask=mask)

    def dequantize_int4_triton(
        qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int, k: int,
        pre_quant_scale: torch.Tensor | None, dtype: torch.dtype,
    ) -> torch.Tensor:
        """The [N, k] weight in ``dtype`` from packed INT4 codes [N, k/2] and per-group scales/zeros [N, groups]
        (any shared layout), times AWQ's per-input-channel ``pre_quant_scale`` when given.

        For batches past the decode kernels' rows: one pass that reads the codes and writes the 16-bit
        weight, after which a tensor-core GEMM library multiplies at its full rate (vLLM does the same for
        AWQ from 256 tokens); the weight exists only for that call (from the caching allocator, reused layer
        to layer).
        """
        if scales.stride() != zeros.stride():
            raise ValueError("INT4 scales and zeros must share one layout")
        n = qweight.shape[0]
        out = torch.empty((n, k), dtype=dtype, device=qweight.device)
        block_n, block_k = 32, min(128, group_size)
        if group_size % block_k or block_k & (block_k - 1):
            raise ValueError(f"INT4 group size {group_size} must be a power of two up to 128 or a multiple of 128")
        grid = (triton.cdiv(n, block_n), triton.cdiv(k, block_k))
        _int4_dequant_kernel[grid](
            qweight, scales, zeros, pre_quant_scale if pre_quant_scale is not None else scales, out,
            n, k, qweight.stride(0), *scales.stride(), out.stride(0),
            GROUP=group_size, HAS_PQS=pre_quant_scale is not None, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4,
        )
        return out

    @triton.jit
    def _int8_dequant_kernel(w_ptr, scale_ptr, out_ptr, N, K, stride_wn, stride_on,
                             BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
        mask = (rn[:, None] < N) & (rk[None, :] < K)
        q = tl.load(w_ptr + rn[:, None] * stride_wn + rk[None, :], mask=mask, other=0)
        scale = tl.load(scale_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)
        tl.store(out_ptr + rn[:, None] * stride_on + rk[None, :], (q.to(tl.float32) * scale[:, None]).to(
            out_ptr.dtype.element_ty), mask=mask)

    def dequantize_int8_triton(qweight: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The [N, K] weight in ``dtype`` from INT8 codes [N, K] and per-output-channel scales [N], rounded
        once (as the reference rounds it), for a prompt step's cuBLAS GEMM (see ``dequantize_int4_triton``)."""
        n, k = qweight.shape
        out = torch.empty((n, k), dtype=dtype, device=qweight.device)
        block_n, block_k = 32, 128
        _int8_dequant_kernel[(triton.cdiv(n, block_n), triton.cdiv(k, block_k))](
            qweight, scales, out, n, k, qweight.stride(0), out.stride(0), BLOCK_N=block_n, BLOCK_K=block_k,
            num_warps=4,
        )
        return out
