"""Draft heads as a Proposer: the heads read the target's last hidden state.

The runner keeps the final hidden state of the row that sampled each
request's last token; the heads turn it and that token into k drafts
(Medusa heads in one batched matmul, the recurrent head as a chain of k
steps). No KV cache: the chain of drafts is verified like any other. Steps of
chained rounds draft on the device instead (``rounds.py``), with the same heads.

With ``heads_lookup`` (SpeculativeConfig) the proposer also keeps each
request's n-gram index, and where the request's last tokens occurred earlier
in its own tokens it proposes what followed there instead of the heads'
guesses, up to the step's draft count (which may then exceed the heads'):
small models repeat themselves, and a repeated run is a better guess than a
head's. The chained rounds do the same on the device (``rounds.prefer_lookup``).
"""

from __future__ import annotations

import torch

from executor_svc.packed_forward import to_device
from executor_svc.speculative.draft_heads import load_draft_heads
from executor_svc.speculative.ngram import NgramIndex
from executor_svc.speculative.proposer import MAX_DRAFT_TOKENS, DraftRequest, SpeculativeMode


class HeadsProposer:
    mode = SpeculativeMode.DRAFT_HEADS
    needs_hidden = True
    needs_lookahead_slots = False

    def __init__(self, heads, model, lookup: tuple[int, int] | None = None) -> None:
        self.heads = heads
        self.model = model
        weight = next(heads.parameters())
        self.hidden_device, self.hidden_dtype = weight.device, weight.dtype  # the engine's: heads load cast to it
        self.lookup = lookup  # (min_n, max_n) of the prompt lookup preferred where it matches; None: heads only
        self.indexes: dict[str, NgramIndex] = {}

    @classmethod
    def load(cls, engine) -> HeadsProposer:  # engine: executor_svc.engine.Engine
        spec = engine.speculative
        folder = spec.draft_heads_dir if spec.draft_heads_dir is not None else engine.engine_dir
        heads = load_draft_heads(folder, engine.model_config, engine.device, engine.dtype, spec.draft_vocab)
        return cls(heads, engine.model, (spec.heads_lookup, spec.ngram_max) if spec.heads_lookup else None)

    @property
    def max_draft_tokens(self) -> int:
        """The heads guess no further than they have heads; a lookup as far as a request's own tokens go."""
        return MAX_DRAFT_TOKENS if self.lookup else self.heads.num_heads

    def propose(self, requests: list[DraftRequest]) -> list[list[int]]:
        drafts: list[list[int]] = [[] for _ in requests]
        if self.lookup is not None:  # a request whose lookup finds a match takes its drafts; the heads draft the rest
            for i, r in enumerate(requests):
                index = self.indexes.get(r.request_id)
                if index is None:
                    index = self.indexes[r.request_id] = NgramIndex(*self.lookup)
                drafts[i] = index.propose(r.token_ids, r.num_drafts)
        rest = [i for i, found in enumerate(drafts) if not found]
        if not rest:
            return drafts
        want = min(max(requests[i].num_drafts for i in rest), self.heads.num_heads)
        hidden = torch.stack([requests[i].hidden for i in rest])  # [n, hidden]
        last = to_device([requests[i].token_ids[-1] for i in rest], torch.int64, hidden.device)
        table = self.heads.propose(hidden, self.model, want, last).tolist()  # the proposer's one wait for the device
        for i, row in zip(rest, table):
            drafts[i] = row[: requests[i].num_drafts]
        return drafts

    def device_chain(self, max_requests: int) -> HeadsChain:
        """The same heads, drafting between chained rounds on the device (``rounds.py``)."""
        return HeadsChain(self.heads, self.model, max_requests, self.hidden_device, self.hidden_dtype)

    def drop(self, request_id: str) -> None:
        self.indexes.pop(request_id, None)

    def reset(self) -> None:
        self.indexes.clear()


class HeadsChain:
    """The heads' drafts between chained verification rounds, on the device.

    After a round's verdict, each request's next drafts follow from the hidden
    state of the row that chose its newest token and that token: the verdict
    writes both indices into ``hidden_rows`` and ``last_tokens``, ``draft``
    gathers the states into a static buffer and runs the heads. On a GPU the
    heads run as one CUDA graph per (request-count bucket, draft length),
    captured at engine load (``capture``): a recurrent chain of k drafts is
    some ten kernels per draft, which launched one by one would cost the host
    more than the round itself.
    """

    def __init__(self, heads, model, max_requests: int, device: torch.device, dtype: torch.dtype) -> None:
        from executor_svc.cuda_graphs import batch_buckets

        self.heads, self.model = heads, model
        self.buckets = batch_buckets(max(1, max_requests))
        top = self.buckets[-1]
        self.hidden = torch.zeros((top, heads.hidden_size), dtype=dtype, device=device)
        self.last_tokens = torch.zeros(top, dtype=torch.int64, device=device)
        self.hidden_rows = torch.zeros(top, dtype=torch.int64, device=device)
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    @torch.inference_mode()
    def capture(self, draft_lengths) -> None:
        """Capture the chain for every request-count bucket and each draft length (GPU only)."""
        if self.hidden.device.type != "cuda":
            return
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.hidden.device)
        stream.wait_stream(torch.cuda.current_stream(self.hidden.device))
        with torch.cuda.stream(stream):
            for k in draft_lengths:
                for batch in reversed(self.buckets):
                    self._propose(batch, k)  # warm-up: compiles kernels, sizes workspaces
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=pool, stream=stream):
                        drafts = self._propose(batch, k)
                    self.graphs[(batch, k)] = (graph, drafts)
        torch.cuda.current_stream(self.hidden.device).wait_stream(stream)
        torch.cuda.synchronize(self.hidden.device)

    @property
    def max_drafts(self) -> int:
        """Most drafts one call makes: the heads' own limit."""
        return self.heads.max_drafts

    def _propose(self, batch: int, k: int) -> torch.Tensor:
        return self.heads.propose(self.hidden[:batch], self.model, k, self.last_tokens[:batch])

    def draft(self, hidden: torch.Tensor, num_requests: int, k: int) -> torch.Tensor:
        """[num_requests, k] drafts from rows ``hidden_rows`` of ``hidden`` and ``last_tokens`` (a view of a
        static buffer on the GPU: copy it before the next call)."""
        torch.index_select(hidden, 0, self.hidden_rows[:num_requests], out=self.hidden[:num_requests])
        bucket = next((b for b in self.buckets if b >= num_requests), None)
        entry = self.graphs.get((bucket, k)) if bucket is not None else None
        if entry is None:
            return self._propose(num_requests, k)
        graph, drafts = entry
        graph.replay()
        return drafts[:num_requests]
