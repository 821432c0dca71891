"""Calibration: run the unquantized model over texts and record what each Linear sees.

Forward hooks on the Linear modules to be quantized collect, per layer and per
input channel, the largest |x| (SmoothQuant's migration factors) and the mean
|x| (AWQ's salience), the largest |x| over the whole tensor (static FP8
scales), a few input rows per text for the AWQ search to replay, and for GPTQ
the sum of x^T x over every row (``[in, in]`` float32 per layer: for a
Llama-3.1-8B about 1 GiB a decoder layer, most of it the down projection's). For a
quantized KV cache, the largest |k| (after RoPE) and |v| each decoder layer
wrote to the runner's 16-bit cache is read back after every text.

A pass may stop each text's forward after one module (``stop_after``): GPTQ's
sequential order calibrates one decoder layer at a time and needs nothing past it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn
from tqdm import tqdm

from executor_svc.quantization.forward import PromptForward
from executor_svc.quantization.kv_cache import KVAmax


@dataclass(slots=True)
class LayerStats:
    channel_absmax: torch.Tensor  # [in] float32
    channel_abssum: torch.Tensor  # [in] float32
    num_rows: int = 0
    tensor_absmax: float = 0.0
    samples: list[torch.Tensor] = field(default_factory=list)  # [rows, in] pieces, in the model dtype
    hessian: torch.Tensor | None = None  # [in, in] float32: sum of x^T x over every row (GPTQ); None if not kept

    @property
    def channel_absmean(self) -> torch.Tensor:
        return self.channel_abssum / max(self.num_rows, 1)

    def sample_matrix(self) -> torch.Tensor:
        """The kept input rows as one float32 [rows, in] matrix."""
        return torch.cat(self.samples).float()


@dataclass(slots=True)
class CalibrationStats:
    layers: dict[str, LayerStats]
    num_texts: int
    num_tokens: int
    kv_amax: torch.Tensor | None = None  # [decoder layers, 2]: max |k|, max |v| (float32); None if not measured


class _StopForward(Exception):
    """Raised by the ``stop_after`` hook: the rest of the forward is not needed."""


def _stop(module: nn.Module, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> None:
    raise _StopForward


def _recorder(stats: LayerStats, rows_per_text: int):
    def hook(module: nn.Module, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> None:
        x = inputs[0].detach()  # [tokens, in]
        ax = x.float().abs()
        stats.channel_absmax = torch.maximum(stats.channel_absmax, ax.amax(dim=0))
        stats.channel_abssum = stats.channel_abssum + ax.sum(dim=0)
        stats.num_rows += x.shape[0]
        stats.tensor_absmax = max(stats.tensor_absmax, float(ax.max()))
        if stats.hessian is not None:
            x32 = x.float()
            stats.hessian.addmm_(x32.t(), x32)
        if rows_per_text:  # evenly spaced rows: early and late positions of every text
            picks = torch.linspace(0, x.shape[0] - 1, min(rows_per_text, x.shape[0]), device=x.device).long()
            stats.samples.append(x.index_select(0, picks).clone())

    return hook


def calibrate(
    runner: PromptForward, modules: dict[str, nn.Module], token_lists: list[list[int]], max_samples: int = 0,
    progress: bool = True, kv_cache: bool = False, hessians: bool = False, stop_after: nn.Module | None = None,
) -> CalibrationStats:
    """Run every text through ``runner.model`` and gather the input statistics of ``modules`` (name -> Linear).

    ``max_samples`` input rows per layer are kept for replay (0: none), spread
    over the texts. ``kv_cache``: also measure each layer's largest |k| and |v|
    (``runner`` must have a 16-bit cache). ``hessians``: also sum each layer's x^T x (GPTQ).
    ``stop_after``: end each text's forward once this module has run (the modules must all run before it).
    """
    if not token_lists:
        raise ValueError("calibration needs at least one text of two or more tokens")
    if stop_after is not None and kv_cache:
        raise ValueError("a pass that stops early does not write every layer's keys and values")
    device = runner.device
    rows_per_text = -(-max_samples // len(token_lists)) if max_samples else 0
    stats = {}
    for name, m in modules.items():
        in_features = m.weight.shape[1]
        stats[name] = LayerStats(
            torch.zeros(in_features, device=device), torch.zeros(in_features, device=device),
            hessian=torch.zeros(in_features, in_features, device=device) if hessians else None,
        )
    handles = [m.register_forward_hook(_recorder(stats[name], rows_per_text)) for name, m in modules.items()]
    if stop_after is not None:
        handles.append(stop_after.register_forward_hook(_stop))
    needs_logits = stop_after is None and any(name == "lm_head" for name in modules)  # run in compute_logits
    kv_amax = KVAmax(runner.kv_cache.shape[0], device) if kv_cache else None
    try:
        for ids in tqdm(token_lists, desc="calibrate", unit="text", disable=not progress, leave=False):
            try:
                hidden = runner.hidden_states(ids)
            except _StopForward:
                continue
            if kv_amax is not None:
                kv_amax.update(runner.kv_cache, len(ids))
            if needs_logits:
                with torch.inference_mode():
                    runner.model.compute_logits(hidden)
    finally:
        for handle in handles:
            handle.remove()
    return CalibrationStats(
        stats, len(token_lists), sum(map(len, token_lists)), kv_amax.amax if kv_amax is not None else None
    )
