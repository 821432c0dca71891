"""Kernel registry: every layer kind (attention, norm, rope, activation, gemm)
has a torch reference implementation, and faster implementations register
beside it. Imports neither service."""

from plugins.registry import KernelSpec, get_kernel, list_kernels, register_kernel

# Importing the implementation modules registers them.
from plugins import attention_torch as _attention_torch  # noqa: F401,E402

__all__ = ["KernelSpec", "get_kernel", "list_kernels", "register_kernel"]
