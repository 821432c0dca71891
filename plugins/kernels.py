"""The set of kernel functions one engine runs with, one per layer kind."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from plugins.registry import get_kernel


@dataclass(frozen=True, slots=True)
class Kernels:
    attention: Callable[..., torch.Tensor]  # plugins/attention_torch.py: paged_attention
    rmsnorm: Callable[..., tuple[torch.Tensor, torch.Tensor | None]]  # norm_torch.py: rms_norm
    rope: Callable[..., torch.Tensor]  # rope_torch.py: rope_and_write_kv (rotate q and k, write k and v)
    activation: Callable[..., torch.Tensor]  # activation_torch.py: act_and_mul
    gemm: Callable[..., torch.Tensor]  # gemm_torch.py: linear

    @classmethod
    def from_names(cls, names: dict[str, str], device: torch.device, dtype: torch.dtype) -> Kernels:
        """Look up each layer kind's chosen implementation; kinds not named use the reference. (The engine's
        other kind, ``argmax``, is the sampler's: executor_svc/runner.py looks it up.)"""
        return cls(**{kind: get_kernel(kind, names.get(kind, "torch"), device, dtype).fn for kind in cls.__slots__})

    @classmethod
    def reference(cls, device: torch.device, dtype: torch.dtype) -> Kernels:
        return cls.from_names({}, device, dtype)
