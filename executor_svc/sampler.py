"""Next-token selection for the executor: penalties, filters and seeded per-request draws.

Per row the order is: min_tokens blocking -> repetition penalty -> presence/frequency
penalty -> (greedy rows: argmax) -> temperature -> top_k -> top_p -> min_p -> draw.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence

import torch

from executor_svc.packed_forward import to_device
from plugins.argmax_torch import row_argmax
from protos.plan import SamplingConfig

_NEG_INF = float("-inf")


class _DeviceIds:
    """A growing host list of token ids, mirrored to the device by copying only new ids."""

    __slots__ = ("ids", "_tensor", "_synced")

    def __init__(self, ids: Sequence[int] = ()) -> None:
        self.ids = list(ids)
        self._tensor: torch.Tensor | None = None
        self._synced = 0

    def tensor(self, device: torch.device) -> torch.Tensor:
        if self._tensor is None or self._synced < len(self.ids):
            new = to_device(self.ids[self._synced :], torch.long, device)
            self._tensor = new if self._tensor is None else torch.cat([self._tensor, new])
            self._synced = len(self.ids)
        return self._tensor


class RequestSamplingState:
    """Per-request sampling state the executor keeps between steps.

    Holds the request's own ``torch.Generator`` (seeded with ``config.seed``) and only
    the penalty bookkeeping its config needs. The caller reports every token it emits
    with :meth:`append_output`; the sampler itself never mutates the state's counts.

    For a resumed request pass the prompt and the output produced so far separately.
    The generator is then fast-forwarded past the draws those outputs consumed (one
    per token, done lazily at the first sample, when the vocab size is known), so a
    seeded request continues exactly as it would have without the interruption.
    """

    __slots__ = ("config", "device", "generator", "_num_output", "_pending_draws",
                 "_seen", "_seen_ids", "_counts", "_out_unique", "_out_all", "_blocked")

    def __init__(self, config: SamplingConfig, prompt_token_ids: Sequence[int],
                 device: torch.device | str, output_token_ids: Sequence[int] = ()) -> None:
        self.config = config
        self.device = torch.device(device)
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(config.seed)
        self._num_output = 0
        self._pending_draws = 0 if config.is_greedy else len(output_token_ids)
        # Penalty state exists only when that penalty is on: most requests pay nothing.
        self._seen: set[int] | None = None  # prompt | output, for repetition penalty
        self._seen_ids: _DeviceIds | None = None
        if config.repetition_penalty != 1.0:
            self._seen = set(prompt_token_ids)
            self._seen_ids = _DeviceIds(self._seen)
        self._counts: Counter[int] | None = None  # output only, for presence/frequency
        self._out_unique: _DeviceIds | None = None
        self._out_all: _DeviceIds | None = None
        if config.presence_penalty != 0.0 or config.frequency_penalty != 0.0:
            self._counts = Counter()
            self._out_unique, self._out_all = _DeviceIds(), _DeviceIds()
        self._blocked: torch.Tensor | None = None
        self.append_output(list(output_token_ids))

    @classmethod
    def from_token_ids(cls, config: SamplingConfig, token_ids: Sequence[int],
                       num_prompt_tokens: int, device: torch.device | str) -> RequestSamplingState:
        """Build from a NewRequest-style ``token_ids`` (prompt + output already produced)."""
        return cls(config, token_ids[:num_prompt_tokens], device, token_ids[num_prompt_tokens:])

    @property
    def num_output_tokens(self) -> int:
        """Output tokens produced so far (including those given when resumed)."""
        return self._num_output

    @property
    def output_counts(self) -> dict[int, int]:
        """token id -> occurrences in the output (empty unless presence/frequency is on)."""
        return dict(self._counts) if self._counts is not None else {}

    @property
    def adjusts_logits(self) -> bool:
        """Whether ``_adjust_logits`` may change a row (penalties, or min_tokens still blocking)."""
        blocking = self._num_output < self.config.min_tokens and bool(self.config.min_tokens_blocked_ids)
        return self._seen is not None or self._counts is not None or blocking

    @property
    def needs_output_history(self) -> bool:
        """Whether sampling the next token reads the tokens emitted so far (penalties, min_tokens)."""
        blocking = self.config.min_tokens > 0 and bool(self.config.min_tokens_blocked_ids)
        return self._seen is not None or self._counts is not None or blocking

    def append_output(self, token_ids: Sequence[int]) -> None:
        """Record tokens the request emitted (call once per sampled token, in order)."""
        self._num_output += len(token_ids)
        if self._seen is not None:
            for t in token_ids:
                if t not in self._seen:
                    self._seen.add(t)
                    self._seen_ids.ids.append(t)
        if self._counts is not None:
            for t in token_ids:
                if t not in self._counts:
                    self._out_unique.ids.append(t)
                self._counts[t] += 1
            self._out_all.ids.extend(token_ids)

    def _adjust_logits(self, row: torch.Tensor) -> None:
        """In place on one float32 row: min_tokens blocking, then the penalties."""
        cfg = self.config
        if self._num_output < cfg.min_tokens and cfg.min_tokens_blocked_ids:
            if self._blocked is None:
                self._blocked = to_device(list(cfg.min_tokens_blocked_ids), torch.long, self.device)
            row.index_fill_(0, self._blocked, _NEG_INF)
        if self._seen_ids is not None:
            # HF semantics: shrink towards "less likely" whatever the logit's sign.
            ids = self._seen_ids.tensor(self.device)
            vals = row[ids]
            p = cfg.repetition_penalty
            row[ids] = torch.where(vals > 0, vals / p, vals * p)
        if self._counts is not None and self._out_all.ids:
            # index_put_ with accumulate adds once per duplicate: count * frequency_penalty.
            all_ids = self._out_all.tensor(self.device)
            uniq = self._out_unique.tensor(self.device)
            if cfg.frequency_penalty != 0.0:
                row.index_put_((all_ids,), row.new_full(all_ids.shape, -cfg.frequency_penalty),
                               accumulate=True)
            if cfg.presence_penalty != 0.0:
                row.index_put_((uniq,), row.new_full(uniq.shape, -cfg.presence_penalty),
                               accumulate=True)

    def _catch_up(self, vocab_size: int, device: torch.device) -> None:
        """Replay the draws of outputs given at construction (see class docstring)."""
        if self._pending_draws:
            buf = torch.empty(vocab_size, dtype=torch.float32, device=device)
            for _ in range(self._pending_draws):
                buf.exponential_(generator=self.generator)
            self._pending_draws = 0


def filtered_probs(logits: torch.Tensor, temperature: torch.Tensor,
                   top_k: torch.Tensor | None = None, top_p: torch.Tensor | None = None,
                   min_p: torch.Tensor | None = None) -> torch.Tensor:
    """The distribution each row samples from, as float32 probs ``[rows, vocab]``.

    All parameters are per-row tensors on the logits' device; ``None`` means "off for
    every row" and skips the work (``top_k`` 0 and ``top_p`` >= 1 and ``min_p`` 0 are off
    per row). ``temperature`` must be > 0 (greedy rows never come here).

    Order (the Hugging Face warper order): temperature -> top_k -> top_p -> min_p.
      * top_k keeps every logit >= the k-th largest (ties at the boundary all kept).
      * top_p keeps the smallest most-likely prefix whose mass >= top_p, computed on the
        probs renormalised after top_k; at least one token always survives.
      * min_p drops tokens with prob < min_p * max_prob. The ratio to the max is the same
        before or after renormalising, so this equals min_p on the temperature-scaled
        full-vocab probs (as vLLM does), restricted to the top_k/top_p survivors.
    """
    scaled = logits.float() / temperature.to(torch.float32).unsqueeze(1)
    if top_k is not None or top_p is not None:
        sorted_logits, order = scaled.sort(dim=-1, descending=True, stable=True)
        drop = torch.zeros_like(sorted_logits, dtype=torch.bool)
        if top_k is not None:
            vocab = scaled.shape[-1]
            k = torch.where(top_k > 0, top_k, vocab).clamp(max=vocab).to(torch.long)
            drop |= sorted_logits < sorted_logits.gather(1, (k - 1).unsqueeze(1))
        if top_p is not None:
            p = top_p.to(torch.float32).unsqueeze(1)
            probs = sorted_logits.masked_fill(drop, _NEG_INF).softmax(-1)
            mass_before = probs.cumsum(-1) - probs  # mass of strictly more likely tokens
            # p >= 1 is "off": without this, cumsum rounding could cut a tiny tail.
            drop |= (mass_before >= p) & (p < 1.0)
            drop[:, 0] = False
        scaled = scaled.masked_fill(torch.empty_like(drop).scatter_(1, order, drop), _NEG_INF)
    if min_p is not None:
        # prob_i / prob_max == exp(l_i - l_max): compare in log space, no softmax needed.
        top = scaled.max(dim=-1, keepdim=True).values
        scaled = scaled.masked_fill(scaled - top < min_p.to(torch.float32).log().unsqueeze(1),
                                    _NEG_INF)
    return scaled.softmax(-1)


def config_probs(logits: torch.Tensor, configs: Sequence[SamplingConfig]) -> torch.Tensor:
    """``filtered_probs`` with each row's parameters taken from ``configs[row]`` (all sampled, none greedy)."""
    device = logits.device
    return filtered_probs(
        logits,
        to_device([c.temperature for c in configs], torch.float32, device),
        to_device([c.top_k for c in configs], torch.long, device) if any(c.top_k > 0 for c in configs) else None,
        to_device([c.top_p for c in configs], torch.float32, device) if any(c.top_p < 1.0 for c in configs) else None,
        to_device([c.min_p for c in configs], torch.float32, device) if any(c.min_p > 0.0 for c in configs) else None,
    )


class Sampler:
    """Picks one token per row of a logits batch, each row by its own request's state.

    ``argmax`` takes the lowest index of each row's maximum ([rows, vocab] -> [rows]); the engine passes
    the implementation its build chose (``plugins/argmax_torch.py``), every one equal to ``torch.argmax``.
    """

    def __init__(self, argmax: Callable[[torch.Tensor], torch.Tensor] = row_argmax) -> None:
        self.argmax = argmax

    def process_logits(self, logits: torch.Tensor,
                       states: Sequence[RequestSamplingState]) -> torch.Tensor:
        """float32 copy of ``logits`` with min_tokens blocking and penalties applied."""
        if logits.dim() != 2 or logits.shape[0] != len(states):
            raise ValueError(f"logits {tuple(logits.shape)} do not match {len(states)} states")
        # Always a copy: the penalties write in place and the caller's tensor stays intact.
        out = logits.to(torch.float32, copy=True)
        for i, state in enumerate(states):
            state._adjust_logits(out[i])
        return out

    def sample(self, logits: torch.Tensor, states: Sequence[RequestSamplingState]) -> list[int]:
        """The chosen token id for each row, on the host (the step's one device sync)."""
        return self.sample_on_device(logits, states).tolist()

    def sample_on_device(self, logits: torch.Tensor, states: Sequence[RequestSamplingState]) -> torch.Tensor:
        """The chosen token id for each row (``states[i]`` owns row ``i``), as a device tensor.

        Greedy rows take the lowest-index argmax of the penalised logits (as HF
        ``generate`` does). Sampled rows draw with the exponential race
        ``argmax(probs / Exp(1))``, whose noise comes from the row's own generator, so a
        request's tokens depend only on its seed and its own logits, never on the batch.
        Nothing here waits for the device.
        """
        greedy = [i for i, s in enumerate(states) if s.config.is_greedy]
        sampled = [i for i, s in enumerate(states) if not s.config.is_greedy]
        if not sampled and not any(s.adjusts_logits for s in states):
            return self.argmax(logits)  # the common greedy batch: no copy, no per-row work
        logits = self.process_logits(logits, states)
        device = logits.device
        if not sampled:
            return self.argmax(logits)
        chosen = torch.empty(len(states), dtype=torch.long, device=device)
        if greedy:
            rows = to_device(greedy, torch.long, device)
            chosen[rows] = self.argmax(logits[rows])
        rows = to_device(sampled, torch.long, device) if greedy else None
        probs = config_probs(logits if rows is None else logits[rows], [states[i].config for i in sampled])
        noise = torch.empty_like(probs)
        for j, i in enumerate(sampled):
            states[i]._catch_up(probs.shape[1], device)
            noise[j].exponential_(generator=states[i].generator)
        # A zero draw would turn a filtered (prob 0) token into 0/0 = NaN, which argmax picks.
        picks = self.argmax(probs / noise.clamp_min_(torch.finfo(torch.float32).tiny))
        if rows is None:
            return picks
        chosen[rows] = picks
        return chosen
