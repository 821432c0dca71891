"""inflight: an LLM inference server with inflight batching over a paged KV cache.

The offline API: ``LLM``, ``BuildConfig``, ``QuantConfig``, ``SamplingParams``,
``SpeculativeConfig`` and ``SpeculativeMode``.
The gRPC client: ``inflight.client``. The command line: ``inflight --help``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from executor_svc.build_config import BuildConfig, QuantConfig
    from executor_svc.speculative.proposer import SpeculativeConfig, SpeculativeMode
    from inflight.llm import LLM, RequestOutput, SamplingParams

__all__ = ["LLM", "BuildConfig", "QuantConfig", "RequestOutput", "SamplingParams", "SpeculativeConfig", "SpeculativeMode"]


def __getattr__(name: str) -> Any:
    # Loaded on first use, so `inflight generate` and the client start without torch.
    if name in ("BuildConfig", "QuantConfig"):
        from executor_svc import build_config

        return getattr(build_config, name)
    if name in ("SpeculativeConfig", "SpeculativeMode"):
        from executor_svc.speculative import proposer

        return getattr(proposer, name)
    if name in ("LLM", "RequestOutput", "SamplingParams"):
        from inflight import llm

        return getattr(llm, name)
    raise AttributeError(f"module 'inflight' has no attribute {name!r}")
