"""A registry of kernel implementations by layer kind.

Each implementation says what it can run on (devices, dtypes); callers ask for
a kind and a name, and a request for an implementation that cannot run where
it is asked to is an error, never a silent fallback.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class KernelSpec:
    kind: str  # e.g. "attention"
    name: str  # e.g. "torch", "triton"
    fn: Callable[..., object]
    device_types: frozenset[str] = frozenset({"cpu", "cuda"})
    dtypes: frozenset[torch.dtype] = frozenset({torch.float32, torch.float16, torch.bfloat16})
    description: str = ""

    def supports(self, device: torch.device, dtype: torch.dtype) -> bool:
        return device.type in self.device_types and dtype in self.dtypes


# The registry is filled at import time by the implementation modules and
# never changed afterwards.
_REGISTRY: dict[str, dict[str, KernelSpec]] = {}


def register_kernel(kind: str, name: str, **spec_fields: object) -> Callable[[Callable[..., object]], Callable[..., object]]:
    """Decorator: ``@register_kernel("attention", "torch", description=...)``."""

    def wrap(fn: Callable[..., object]) -> Callable[..., object]:
        by_name = _REGISTRY.setdefault(kind, {})
        if name in by_name:
            raise ValueError(f"kernel {kind}/{name} registered twice")
        by_name[name] = KernelSpec(kind=kind, name=name, fn=fn, **spec_fields)  # type: ignore[arg-type]
        return fn

    return wrap


def get_kernel(kind: str, name: str, device: torch.device, dtype: torch.dtype) -> KernelSpec:
    """The implementation ``name`` of ``kind``; raises if it cannot run on device/dtype."""
    by_name = _REGISTRY.get(kind)
    if not by_name:
        raise KeyError(f"no kernels registered for kind {kind!r}")
    spec = by_name.get(name)
    if spec is None:
        raise KeyError(f"no {kind} kernel named {name!r}; registered: {sorted(by_name)}")
    if not spec.supports(device, dtype):
        raise ValueError(
            f"{kind} kernel {name!r} cannot run on {device.type} with {dtype}; "
            f"it supports devices {sorted(spec.device_types)} and dtypes {sorted(map(str, spec.dtypes))}"
        )
    return spec


def list_kernels() -> list[KernelSpec]:
    return [spec for by_name in _REGISTRY.values() for spec in by_name.values()]
