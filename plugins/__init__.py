"""Kernel registry: every layer kind (attention, norm, rope, activation, gemm)
has a torch reference implementation, and faster implementations register
beside it. Imports neither service."""

from plugins.registry import KernelSpec, get_kernel, list_kernels, register_kernel

# Importing the implementation modules registers them: adding a kernel is one
# file plus one line here.
from plugins import activation_torch as _activation_torch  # noqa: F401,E402
from plugins import activation_triton as _activation_triton  # noqa: F401,E402
from plugins import argmax_torch as _argmax_torch  # noqa: F401,E402
from plugins import attention_torch as _attention_torch  # noqa: F401,E402
from plugins import attention_triton as _attention_triton  # noqa: F401,E402
from plugins import gemm_torch as _gemm_torch  # noqa: F401,E402
from plugins import norm_torch as _norm_torch  # noqa: F401,E402
from plugins import norm_triton as _norm_triton  # noqa: F401,E402
from plugins import quant_gemm_int_mm as _quant_gemm_int_mm  # noqa: F401,E402
from plugins import quant_gemm_scaled_mm as _quant_gemm_scaled_mm  # noqa: F401,E402
from plugins import quant_gemm_torch as _quant_gemm_torch  # noqa: F401,E402
from plugins import quant_gemm_triton as _quant_gemm_triton  # noqa: F401,E402
from plugins import rope_torch as _rope_torch  # noqa: F401,E402
from plugins import rope_triton as _rope_triton  # noqa: F401,E402

try:  # the small-M GEMMs (16-bit and quantized) are Triton throughout: without it they are simply not registered
    import triton as _triton  # noqa: F401
except ImportError:
    _triton = None
if _triton is not None:
    from plugins import gemm_decode as _gemm_decode  # noqa: F401,E402
    from plugins import quant_gemm_decode as _quant_gemm_decode  # noqa: F401,E402

__all__ = ["KernelSpec", "get_kernel", "list_kernels", "register_kernel"]
