"""Runs StepPlans: packs the scheduled tokens, runs the model, samples.

The runner holds per-request state between steps, because plans are diffs:
the tokens a request holds (prompt plus what was sampled here), its block
table and its sampling state. It never allocates KV blocks; it writes where
the plan's block ids say.

A step is launched (``launch``: inputs copied, kernels queued, sampled ids on
their way to the host) and later finished (``finish``: wait for those ids).
Between the two the next plan may be launched already: a request whose last
token is still on its way reads it straight from the previous step's device
tensor, so the GPU never waits for the host to learn it. ``execute`` does both
halves back to back.

Speculative decoding: a plan may give a request draft tokens to verify after
its last token. The chain (last token + k drafts) runs as k + 1 single-token
attention rows (``packed_forward``), every row's logits judge the draft after
it (``speculative.verify``), and ``finish`` emits the accepted prefix plus one
token of the target's, rolls the request's computed count back past the
rejected drafts (their KV slots are simply overwritten later), and asks the
proposer for the next step's drafts. A plan may also ask for several
verification rounds, drafted on the device between them
(``speculative/rounds.py``): the step then verifies and emits each round in
turn, and ``finish`` reads them all at once.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from executor_svc.engine import Engine
from executor_svc.packed_forward import MAX_ROWS_PER_CHUNK, Segment, pack, run_packed, short_chunks_as_rows, to_device
from executor_svc.sampler import RequestSamplingState, Sampler
from executor_svc.speculative.draft_tree import DraftTree
from executor_svc.speculative.proposer import MAX_DRAFT_TOKENS, DraftRequest, NgramLookup, build_proposer
from executor_svc.speculative.rounds import RoundsOutput, RoundsRequest, RoundsRunner, emitted_tokens
from executor_svc.speculative.verify import NO_DRAFT, accepted_prefix, verify_drafts
from executor_svc.step_timeline import StepTimeline
from kvcache.layout import scratch_block
from kvcache.manager import blocks_for_tokens
from plugins.registry import get_kernel
from protos.plan import CachedRequest, NewRequest, RequestOutput, SamplingConfig, StepPlan, StepResult


log = logging.getLogger("inflight.executor")


@dataclass(slots=True)
class RequestState:
    token_ids: list[int]  # known on the host
    num_prompt_tokens: int
    block_table: list[int]
    num_computed_tokens: int
    sampling: RequestSamplingState
    # Tokens sampled by launched steps whose results are not on the host yet, in
    # order: (that step, the row of this request among its sampled ids).
    pending: list[tuple[LaunchedStep, int]] = field(default_factory=list)
    num_drafts_to_propose: int = 0  # after its next sampled token (from the latest plan)
    # What finishes it (NewRequest.stop_token_ids / max_num_tokens): lets chained rounds end early.
    stop_token_ids: list[int] = field(default_factory=list)
    max_num_tokens: int = 0
    verifying: bool = False  # a launched step verifies drafts for it: its length is unknown until it finishes

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids) + len(self.pending)


Scheduled = tuple[str, RequestState, int]  # (request id, state, tokens to compute)


def _rounds_end(state: RequestState, rounds: int, k: int, rows: int) -> int:
    """The KV slots up to which a request's chained rounds of k drafts and ``rows`` rows each may write: every
    round but the last moves on by at most 1 + k tokens; the last writes all its rows (a tree's every node)."""
    return state.num_computed_tokens + (rounds - 1) * (1 + k) + rows


@dataclass(slots=True)
class Verification:
    """One request's chain of drafts in a launched step."""

    request_id: str
    state: RequestState
    drafts: list[int]
    first_row: int  # its first row among the step's verification rows


@dataclass(slots=True)
class LaunchedStep:
    """A step whose kernels are queued; ``finish`` turns it into a StepResult."""

    result: StepResult
    scheduled: list[Scheduled] = field(default_factory=list)
    sampling_requests: list[tuple[str, RequestState]] = field(default_factory=list)
    sampled: torch.Tensor | None = None  # [len(sampling_requests)] int64 on the device
    verifications: list[Verification] = field(default_factory=list)
    rounds: RoundsOutput | None = None  # chained verification rounds (then every scheduled request runs them)
    num_rounds: int = 0
    num_drafts: int = 0  # per round, with chained rounds
    # What the host reads: sampled ids, then the verification rows' tokens and accept flags.
    host_values: torch.Tensor | None = None  # on the device until copied
    sampled_host: torch.Tensor | None = None  # pinned copy of host_values, valid once `done` has completed
    hidden: torch.Tensor | None = None  # [sampled + verification rows, hidden] when the proposer wants it
    done: torch.cuda.Event | None = None
    marks: tuple[torch.cuda.Event, torch.cuda.Event] | None = None  # for the GPU timeline
    started: float = 0.0
    num_tokens: int = 0  # tokens computed
    error: str = ""  # the forward failed: every scheduled request fails

    def is_done(self) -> bool:
        return self.done is None or self.done.query()


class PlanError(ValueError):
    """A plan entry that contradicts the executor's state or limits."""


class ModelRunner:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.device = engine.device
        self.tokens_per_block = engine.tokens_per_block
        self.vocab_size = engine.model_config.vocab_size
        argmax = engine.manifest.plugins.get("argmax")  # engines built before argmax was a kind: the reference
        self.sampler = Sampler(get_kernel("argmax", argmax.name if argmax else "torch", self.device, engine.dtype).fn)
        self.requests: dict[str, RequestState] = {}
        self.proposer = build_proposer(engine.speculative, engine)
        self.max_draft_tokens = 0
        if self.proposer is not None:  # draft heads alone guess no further than they have heads
            self.max_draft_tokens = min(
                engine.speculative.num_draft_tokens, getattr(self.proposer, "max_draft_tokens", MAX_DRAFT_TOKENS)
            )
        # Verification rounds one step may chain: they draft on the device, which prompt lookup and draft heads can.
        self.max_rounds = engine.speculative.device_rounds if self.proposer is not None else 1
        tree = self._draft_tree(engine)
        if tree is not None:  # a tree of depth d verifies at most d drafts in a row
            self.max_draft_tokens = min(self.max_draft_tokens, tree.depth)
        self.rounds = None
        if self.max_rounds > 1:
            chain, ngram_sizes, heads_lookup = None, (1, 1), False
            if isinstance(self.proposer, NgramLookup):
                ngram_sizes = (self.proposer.min_n, self.proposer.max_n)
            else:  # draft heads; a chained step holds at most max_batch_size / (1 + k) requests
                chain = self.proposer.device_chain(engine.max_batch_size // 2)
                if self.proposer.lookup is not None:
                    ngram_sizes, heads_lookup = self.proposer.lookup, True
            self.rounds = RoundsRunner(engine.model, engine.kv_cache, engine.decode_graphs, self.tokens_per_block,
                                       ngram_sizes, chain, tree, end_early=engine.speculative.end_rounds_early,
                                       heads_lookup=heads_lookup, argmax=self.sampler.argmax)
            self.rounds.warm_up(range(1, self.max_draft_tokens + 1))
        # Tree drafts: tokens per request of a chained round of k drafts, k = 1.. (what the scheduler plans with).
        self.draft_tree_rows = [self.rounds.round_rows(k) for k in range(1, self.max_draft_tokens + 1)] if tree else []
        # Short context chunks run as single-token rows when that makes the step a graph replay
        # (packed_forward.short_chunks_as_rows); 0 keeps every chunk a tile set.
        self.max_rows_per_chunk = MAX_ROWS_PER_CHUNK
        # GPU busy/idle per step, for the benchmarks' idle-time figure.
        self.timeline = StepTimeline(self.device) if self.device.type == "cuda" else None
        # Host seconds spent launching steps (inputs, kernel launches) and finishing them
        # (apart from waiting for the GPU): the executor's share of the time between steps.
        # Wall time, and this thread's CPU time (the difference: waits for the interpreter lock).
        self.host_seconds = {"launch": 0.0, "finish": 0.0, "draft": 0.0}
        self.host_cpu_seconds = dict.fromkeys(self.host_seconds, 0.0)
        # The step whose chained rounds the scheduler asked to end early (``end_rounds``); set from another thread.
        self._end_rounds_of: int | None = None
        if self.device.type == "cuda":
            self.warm_up_verification()

    def warm_up_verification(self) -> int:
        """Run, at load, the steps a speculative server first meets when requests overlap: a prompt beside a
        request verifying drafts one step at a time, then two requests verifying at once, one greedy and one
        sampled. At batch 1 with chained rounds a server otherwise first runs these when a second request
        arrives, in that request's wait for its first token: on an H100 the first such arrival of a process
        waited 26-27 ms without the warm-up and 3.8-3.9 ms with it, later ones 3.3-6.8 ms either way
        (bench/results/h100_spec_heads_first_arrival_{before,after}{1,2}_smollm2.json). Returns the drafts
        verified (0: nothing to warm, or the KV pool is too small).

        Like the prompt warm-up (``warm_up.py``) it writes KV entries into the pool's first blocks, which no
        request owns at load. Its requests are dropped and the host-time counters reset afterwards."""
        if self.proposer is None or not self.max_draft_tokens or self.draft_tree_rows or self.requests:
            return 0
        k, block = self.max_draft_tokens, self.tokens_per_block
        # Prompts that repeat themselves, so that prompt lookup finds drafts in them too.
        prompts = {"warm-up-a": [(7 * i + 3) % 50 + 10 for i in range(8)] * 4,
                   "warm-up-b": [(11 * i + 5) % 60 + 10 for i in range(6)] * 4}
        if any(not 0 <= t < self.vocab_size for ids in prompts.values() for t in ids):
            return 0
        tables, first = {}, 0
        for request_id, ids in prompts.items():
            count = blocks_for_tokens(len(ids) + 3 * (k + 1), block)
            tables[request_id], first = list(range(first, first + count)), first + count
        if first > self.engine.num_kv_blocks or len(prompts["warm-up-a"]) + 3 * (k + 1) > self.engine.max_seq_len:
            return 0
        greedy, sampled = SamplingConfig(temperature=0.0), SamplingConfig(temperature=0.8, top_p=0.95, seed=1)

        def new(request_id: str, sampling: SamplingConfig) -> NewRequest:
            ids = prompts[request_id]
            return NewRequest(request_id, ids, len(ids), 0, len(ids), tables[request_id], sampling,
                              num_drafts_to_propose=k)

        def verify(request_id: str, drafts: list[int]) -> CachedRequest:
            computed = self.requests[request_id].num_computed_tokens
            return CachedRequest(request_id, computed, 1 + len(drafts), [], drafts, num_drafts_to_propose=k)

        started, verified = time.perf_counter(), 0

        def run(plan: StepPlan) -> dict[str, list[int]]:
            """Run ``plan``; the drafts it proposed, by request."""
            nonlocal verified
            verified += sum(len(cached.draft_token_ids) for cached in plan.cached_requests)
            result = self.execute(plan)
            if result.request_errors:
                raise RuntimeError(f"a warm-up step failed: {result.request_errors}")
            return {output.request_id: output.next_draft_token_ids for output in result.outputs}

        try:
            drafts = run(StepPlan(-1, new_requests=[new("warm-up-a", greedy)]))
            drafts = run(StepPlan(-2, new_requests=[new("warm-up-b", sampled)],
                                  cached_requests=[verify("warm-up-a", drafts.get("warm-up-a", []))]))
            run(StepPlan(-3, cached_requests=[verify(request_id, drafts.get(request_id, [])) for request_id in prompts]))
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
        except Exception:  # noqa: BLE001 - a warm-up is an optimisation: the first real step pays instead
            log.exception("warming up the verification steps failed; the first overlapping requests pay for it")
            verified = 0
        finally:
            for request_id in prompts:
                self._drop(request_id)
            self.host_seconds = dict.fromkeys(self.host_seconds, 0.0)
            self.host_cpu_seconds = dict.fromkeys(self.host_seconds, 0.0)
            if self.timeline is not None:  # the benchmarks' idle-time figure starts with the first real step
                self.timeline = StepTimeline(self.device)
        log.info("warmed the verification steps: %d drafts in %.2f s", verified, time.perf_counter() - started)
        return verified

    def end_rounds(self, step_id: int) -> None:
        """Ask step ``step_id`` to end its chained verification rounds after the round in flight (or after its
        first round, when it has not started): the scheduler has a request waiting that should not wait for every
        planned round. Its result then holds the rounds that ran, and the next step's drafts. Safe to call from
        any thread, before, during or after the step; a step of one round, or one already done, ignores it."""
        self._end_rounds_of = step_id

    # -- state ---------------------------------------------------------------

    def reset(self) -> None:
        """Forget every request (the scheduler that owned them went away)."""
        self.requests.clear()
        self._end_rounds_of = None  # a new scheduler numbers its steps afresh
        if self.proposer is not None:
            self.proposer.reset()

    def _drop(self, request_id: str) -> None:
        self.requests.pop(request_id, None)
        if self.proposer is not None:
            self.proposer.drop(request_id)

    def _add(self, new: NewRequest) -> None:
        if new.request_id in self.requests:
            raise PlanError(f"request {new.request_id!r} is already running")
        if any(t < 0 or t >= self.vocab_size for t in new.token_ids):
            raise PlanError(f"request {new.request_id!r}: token id outside [0, {self.vocab_size})")
        # A resumed request brings its output too: penalties and the random stream pick up where they were.
        sampling = RequestSamplingState.from_token_ids(new.sampling, new.token_ids, new.num_prompt_tokens, self.device)
        self.requests[new.request_id] = RequestState(
            token_ids=list(new.token_ids),
            num_prompt_tokens=new.num_prompt_tokens,
            block_table=list(new.block_ids),
            num_computed_tokens=new.num_computed_tokens,
            sampling=sampling,
            num_drafts_to_propose=min(new.num_drafts_to_propose, self.max_draft_tokens),
            stop_token_ids=list(new.stop_token_ids),
            max_num_tokens=new.max_num_tokens,
        )

    # -- one step ------------------------------------------------------------

    def execute(self, plan: StepPlan) -> StepResult:
        """Run one plan to completion."""
        return self.finish(self.launch(plan))

    def needs_host_history(self, plan: StepPlan) -> bool:
        """Whether ``plan`` needs the previous step finished first: penalties that read a
        token still on its way, or drafts (verified against, and proposed from, known tokens)."""
        for cached in plan.cached_requests:
            if cached.draft_token_ids or cached.num_drafts_to_propose or cached.num_rounds != 1:
                return True
            state = self.requests.get(cached.request_id)
            if state is not None and state.pending and state.sampling.needs_output_history:
                return True
        return False

    def feeds_next_plan(self, step: LaunchedStep) -> bool:
        """Whether the next plan waits for ``step``'s result: it verifies drafts or proposes the next ones,
        so its scheduler plans one step at a time and nothing can be launched behind it."""
        if self.proposer is None:
            return False
        return (
            bool(step.verifications) or step.rounds is not None
            or any(state.num_drafts_to_propose for _, state in step.sampling_requests)
        )

    def _spent(self, phase: str, started: float, cpu: float) -> float:
        spent = time.perf_counter() - started
        self.host_seconds[phase] += spent
        self.host_cpu_seconds[phase] += time.thread_time() - cpu
        return spent

    def _draft_tree(self, engine: Engine) -> DraftTree | None:
        """The draft tree the speculative config asks for, checked against this engine (None: chains)."""
        shape = engine.speculative.draft_tree
        if shape is None or self.proposer is None:
            return None
        tree = DraftTree(shape)
        if self.max_rounds <= 1:
            raise ValueError("tree drafts are verified in chained rounds: allow more than one (--speculative-rounds)")
        if engine.model_config.sliding_window:
            raise ValueError(f"tree drafts are not supported for {engine.model_config.name}, which has sliding-window "
                             "attention (a tree row's window would be counted in node slots, not positions)")
        if engine.decode_graphs is not None and engine.decode_graphs.tree_masks is None:
            raise ValueError("tree drafts need CUDA graphs captured with tree masks (load the engine with the tree)")
        return tree

    def _draft_length_of(self, rows: int) -> int:
        """The draft length of a chained round with ``rows`` tokens per request (tree rounds have more than 1 + k);
        0 when no draft length has that many."""
        if self.draft_tree_rows:
            return self.draft_tree_rows.index(rows) + 1 if rows in self.draft_tree_rows else 0
        return rows - 1

    def launch(self, plan: StepPlan) -> LaunchedStep:
        started, cpu = time.perf_counter(), time.thread_time()
        if plan.swap_out or plan.swap_in:  # host-tier copies, before this step writes or reads those blocks
            self.engine.kv_offload.copy_blocks(plan.swap_out, plan.swap_in)
        for request_id in plan.finished_request_ids:
            self._drop(request_id)
        errors: dict[str, str] = {}
        scheduled: list[Scheduled] = []
        drafts: dict[str, list[int]] = {}
        chained: dict[str, tuple[int, int]] = {}  # request id -> (rounds, drafts per round)
        for new in plan.new_requests:
            try:
                self._add(new)
            except PlanError as exc:
                errors[new.request_id] = str(exc)
                continue
            state = self.requests[new.request_id]
            problem = self._check_range(state, new.num_scheduled_tokens, 0, self.tokens_per_block, self.engine.max_seq_len)
            if problem:
                errors[new.request_id] = problem
                continue
            scheduled.append((new.request_id, state, new.num_scheduled_tokens))
        requests, tokens_per_block, max_seq_len = self.requests, self.tokens_per_block, self.engine.max_seq_len
        for cached in plan.cached_requests:
            request_id = cached.request_id
            state = requests.get(request_id)
            if state is None:
                errors[request_id] = f"request {request_id!r} is unknown to the executor"
                continue
            if cached.new_block_ids:
                state.block_table.extend(cached.new_block_ids)
            state.num_drafts_to_propose = min(cached.num_drafts_to_propose, self.max_draft_tokens)
            if cached.num_computed_tokens != state.num_computed_tokens or state.verifying:
                errors[request_id] = (
                    f"plan says {cached.num_computed_tokens} computed tokens, executor has {state.num_computed_tokens}"
                    + (" and a verification in flight" if state.verifying else "")
                )
                continue
            count = cached.num_scheduled_tokens
            if cached.num_rounds != 1:
                problem = self._check_rounds(state, cached)
                if problem:
                    errors[request_id] = problem
                    continue
                drafts[request_id] = list(cached.draft_token_ids)
                chained[request_id] = (cached.num_rounds, self._draft_length_of(count // cached.num_rounds))
                scheduled.append((request_id, state, count))
                continue
            if cached.draft_token_ids:
                problem = self._check_drafts(state, cached.draft_token_ids, count)
                if problem:
                    errors[request_id] = problem
                    continue
                drafts[request_id] = list(cached.draft_token_ids)
            problem = self._check_range(state, count, len(cached.draft_token_ids), tokens_per_block, max_seq_len)
            if problem:
                errors[request_id] = problem
                continue
            scheduled.append((request_id, state, count))
        if chained and (len(chained) != len(scheduled) or len(set(chained.values())) != 1):
            problem = "chained verification rounds must make up the whole step, with one round count and draft length"
            for request_id in chained:
                errors[request_id] = problem
            scheduled = [item for item in scheduled if item[0] not in chained]
            chained = {}
        for request_id in errors:
            self._drop(request_id)

        step = LaunchedStep(result=StepResult(step_id=plan.step_id, request_errors=errors), started=started)
        if chained:
            step.num_rounds, step.num_drafts = next(iter(chained.values()))
        elif drafts or any(item[2] != 1 for item in scheduled):
            # Context work (several tokens of one query) is packed before generation work and draft chains.
            scheduled.sort(key=lambda item: item[2] == 1 or item[0] in drafts)
        step.scheduled = scheduled
        if scheduled:
            try:
                (self._launch_rounds if chained else self._launch)(step, drafts)
            except Exception as exc:  # a failed forward fails its batch, not the executor
                step.error = f"step failed: {type(exc).__name__}: {exc}"
        self._spent("launch", started, cpu)
        return step

    @staticmethod
    def _check_range(state: RequestState, count: int, num_drafts: int, tokens_per_block: int, max_seq_len: int) -> str:
        """Why ``count`` more tokens cannot be computed for ``state`` ('' when they can)."""
        end = state.num_computed_tokens + count
        capacity = len(state.block_table) * tokens_per_block
        held = len(state.token_ids) + len(state.pending) + num_drafts
        if count <= 0 or end > held or end > capacity or end > max_seq_len:
            return (
                f"cannot compute tokens [{state.num_computed_tokens}, {end}): request holds "
                f"{held} tokens, its blocks hold {capacity}, max_seq_len is {max_seq_len}"
            )
        return ""

    def _check_drafts(self, state: RequestState, draft_ids: list[int], count: int) -> str:
        """Why ``draft_ids`` cannot be verified for ``state`` this step ('' when they can)."""
        if self.proposer is None:
            return "draft tokens given, but this executor runs without speculative decoding"
        if count != 1 + len(draft_ids) or state.pending or state.num_computed_tokens != len(state.token_ids) - 1:
            return (
                f"{len(draft_ids)} drafts need a generation step of {1 + len(draft_ids)} tokens after the last one "
                f"(plan schedules {count}; the request holds {state.num_tokens} tokens, {state.num_computed_tokens} computed)"
            )
        if len(draft_ids) > self.max_draft_tokens:
            return f"{len(draft_ids)} drafts, more than this executor's {self.max_draft_tokens}"
        if any(t < 0 or t >= self.vocab_size for t in draft_ids):
            return f"draft token id outside [0, {self.vocab_size})"
        if state.sampling.needs_output_history:
            return "drafts cannot be verified for a request with penalties or min_tokens"
        return ""

    def _check_rounds(self, state: RequestState, cached) -> str:
        """Why ``cached`` (a CachedRequest) cannot run its chained verification rounds ('' when it can)."""
        rounds, count, drafts = cached.num_rounds, cached.num_scheduled_tokens, cached.draft_token_ids
        if not 1 < rounds <= self.max_rounds:
            return f"{rounds} verification rounds asked; this executor chains at most {self.max_rounds}"
        k = self._draft_length_of(count // rounds)
        if count % rounds or not 1 <= k <= self.max_draft_tokens:
            per_round = f"one of {self.draft_tree_rows}" if self.draft_tree_rows else "1 + k"
            return (
                f"{rounds} rounds need num_scheduled_tokens = rounds * ({per_round}) with 1 <= k <= "
                f"{self.max_draft_tokens}, got {count}"
            )
        if len(drafts) > k or any(t < 0 or t >= self.vocab_size for t in drafts):
            return f"{len(drafts)} drafts for rounds of {k}, or a draft id outside [0, {self.vocab_size})"
        if state.pending or state.num_computed_tokens != len(state.token_ids) - 1:
            return (
                f"verification rounds start after the last token: the request holds {state.num_tokens} tokens, "
                f"{state.num_computed_tokens} computed"
            )
        if state.sampling.needs_output_history:
            return "drafts cannot be verified for a request with penalties or min_tokens"
        end = _rounds_end(state, rounds, k, count // rounds)
        # Slots past what the request may ever hold need no block of its own: those rows write the scratch block.
        kept = min(end, state.max_num_tokens) if state.max_num_tokens else end
        if kept > len(state.block_table) * self.tokens_per_block or end > self.engine.max_seq_len:
            return (
                f"{rounds} rounds of {count // rounds} tokens need {kept} KV slots: the blocks hold "
                f"{len(state.block_table) * self.tokens_per_block}, max_seq_len is {self.engine.max_seq_len}"
            )
        return ""

    @torch.inference_mode()
    def _launch_rounds(self, step: LaunchedStep, drafts: dict[str, list[int]]) -> None:
        """Queue a step of chained verification rounds (``speculative/rounds.py``) and the copy of their tokens."""
        start_mark = self.timeline.mark() if self.timeline is not None else None
        scratch, rounds = scratch_block(self.engine.kv_cache), step.num_rounds
        requests = []
        for request_id, state, count in step.scheduled:
            # Rounds may run past the request's length limit: its table goes on with the scratch block there.
            end = _rounds_end(state, rounds, step.num_drafts, count // rounds)
            blocks = blocks_for_tokens(end, self.tokens_per_block)
            table = state.block_table + [scratch] * (blocks - len(state.block_table))
            requests.append(RoundsRequest(state.token_ids, table, drafts[request_id], state.sampling,
                                          state.stop_token_ids, state.max_num_tokens))
        forward_start = time.perf_counter()
        # Draft heads also draft the next step's first round here: as many as any request will ask for.
        next_drafts = 0
        if self.rounds.chain is not None:
            next_drafts = min(self.max_draft_tokens, max(state.num_drafts_to_propose for _, state, _ in step.scheduled))
        step_id = step.result.step_id
        step.rounds = self.rounds.run(requests, step.num_drafts, step.num_rounds, next_drafts,
                                      end_requested=lambda: self._end_rounds_of == step_id)
        rounds = step.rounds
        step.num_rounds = rounds.num_rounds  # fewer than planned when every request finished, or when asked to end
        parts = [rounds.tokens.flatten(), rounds.accepted.flatten(), rounds.drafted[:-1].flatten()]
        if rounds.next_drafts is not None:
            parts.append(rounds.next_drafts.flatten())
        step.host_values = torch.cat(parts)
        if self.device.type == "cuda":
            step.sampled_host = torch.empty(step.host_values.shape, dtype=torch.int64, pin_memory=True)
            step.sampled_host.copy_(step.host_values, non_blocking=True)
            step.done = torch.cuda.Event()
            step.done.record()
        if start_mark is not None:
            step.marks = (start_mark, self.timeline.mark())
        step.result.forward_us = int((time.perf_counter() - forward_start) * 1e6)
        step.num_tokens = sum(count for _, _, count in step.scheduled)
        for _, state, count in step.scheduled:
            state.num_computed_tokens += count
            state.verifying = True

    def _finish_rounds(
        self, step: LaunchedStep, values: list[int], to_draft: list[tuple[RequestOutput, RequestState, int]],
    ) -> None:
        """Emit every request's tokens of a step of chained rounds."""
        rounds, batch, rows = step.num_rounds, len(step.scheduled), step.num_drafts + 1
        split = rounds * batch * rows
        tokens = [[values[(r * batch + b) * rows : (r * batch + b + 1) * rows] for b in range(batch)] for r in range(rounds)]
        accepted = [values[split + r * batch : split + (r + 1) * batch] for r in range(rounds)]
        drafted = values[split + rounds * batch : split + 2 * rounds * batch]  # [rounds, B] flattened
        next_drafts = values[split + 2 * rounds * batch :]  # [B, k'] flattened: the heads' drafts for the next step
        width = len(next_drafts) // batch
        for b, (request_id, state, count) in enumerate(step.scheduled):
            emitted, per_round = emitted_tokens(tokens, accepted, b)
            state.num_computed_tokens -= count - len(emitted)  # the rejected rows' KV is stale
            state.verifying = False
            self._emit(request_id, state, emitted, sum(per_round), 0, step.result.outputs, to_draft)
            output = step.result.outputs[-1]
            output.round_accepted = per_round
            output.round_drafted = drafted[b::batch]
            if width and to_draft and to_draft[-1][0] is output:  # drafted on the device already
                to_draft.pop()
                output.next_draft_token_ids = next_drafts[b * width : b * width + state.num_drafts_to_propose]
        if step.rounds.finished_early:
            to_draft.clear()  # every request has finished: none has a next step to draft for

    def finish(self, step: LaunchedStep) -> StepResult:
        """Wait for ``step``'s sampled ids and apply them; returns its result."""
        result = step.result
        values: list[int] = []
        finish_started, cpu = time.perf_counter(), time.thread_time()
        if not step.error and step.host_values is not None:
            try:
                if step.done is not None:
                    step.done.synchronize()  # the step's one wait for the device
                    finish_started, cpu = time.perf_counter(), time.thread_time()
                    values = step.sampled_host.tolist()
                else:
                    values = step.host_values.tolist()
            except Exception as exc:
                step.error = f"step failed: {type(exc).__name__}: {exc}"
        if step.error:
            return self._fail(step)
        try:
            return self._apply(step, values, finish_started, cpu)
        except Exception as exc:  # noqa: BLE001 - a fault here fails this step's requests, not every one held
            log.exception("applying step %d's results failed; its requests fail", result.step_id)
            step.error = f"step failed: {type(exc).__name__}: {exc}"
            return self._fail(step)

    def _fail(self, step: LaunchedStep) -> StepResult:
        """``step``'s result when it failed (``step.error``): each of its requests gets the error and is dropped;
        the scheduler frees their blocks. Requests outside the step keep running."""
        result = step.result
        result.outputs.clear()
        for request_id, state, _ in step.scheduled:
            result.request_errors[request_id] = step.error
            self._drop(request_id)
            state.pending.clear()
            state.verifying = False
        if self.timeline is not None:
            self.timeline.discard()
        result.step_us = int((time.perf_counter() - step.started) * 1e6)
        return result

    def _apply(self, step: LaunchedStep, values: list[int], finish_started: float, cpu: float) -> StepResult:
        """Apply a finished step's sampled ids (``values``) to its requests: their new tokens, outputs and drafts."""
        result = step.result
        if self.timeline is not None:
            if step.marks is not None and step.done is not None:
                self.timeline.collect(*step.marks, len(step.scheduled), step.num_tokens)
            else:  # nothing waited for the GPU (a context chunk with no token to sample): no reading
                self.timeline.discard()
        num_plain = len(step.sampling_requests)
        outputs = result.outputs
        to_draft: list[tuple[RequestOutput, RequestState, int]] = []  # (output, state, its hidden row)
        if step.rounds is not None:
            self._finish_rounds(step, values, to_draft)
        for row, ((request_id, state), token) in enumerate(zip(step.sampling_requests, values)):
            assert state.pending[0][0] is step, "steps finish in launch order"
            del state.pending[0]
            self._emit(request_id, state, [token], 0, row, outputs, to_draft)
        if step.verifications:
            num_rows = (len(values) - num_plain) // 2
            row_tokens, row_accepted = values[num_plain : num_plain + num_rows], values[num_plain + num_rows :]
            for chain in step.verifications:
                rows = slice(chain.first_row, chain.first_row + len(chain.drafts) + 1)
                tokens = accepted_prefix(row_tokens[rows], row_accepted[rows])
                accepted = len(tokens) - 1
                chain.state.num_computed_tokens -= len(chain.drafts) - accepted  # rejected drafts' KV is stale
                chain.state.verifying = False
                self._emit(chain.request_id, chain.state, tokens, accepted, num_plain + chain.first_row + accepted,
                           outputs, to_draft)
        if len(step.scheduled) > num_plain + len(step.verifications):  # context chunks that sample nothing yet
            answered = {output.request_id for output in outputs}
            outputs.extend(RequestOutput(request_id, []) for request_id, _, _ in step.scheduled if request_id not in answered)
        if to_draft:
            self._propose(step, to_draft)
        result.step_us = int((time.perf_counter() - step.started) * 1e6)
        self._spent("finish", finish_started, cpu)
        return result

    @staticmethod
    def _emit(
        request_id: str, state: RequestState, tokens: list[int], accepted: int, hidden_row: int,
        outputs: list[RequestOutput], to_draft: list[tuple[RequestOutput, RequestState, int]],
    ) -> None:
        """Record a request's new tokens and add its output (and, when it wants drafts next, its hidden row)."""
        state.token_ids.extend(tokens)
        state.sampling.append_output(tokens)
        output = RequestOutput(request_id, tokens, num_accepted_drafts=accepted)
        outputs.append(output)
        if state.num_drafts_to_propose and not state.pending and not state.sampling.needs_output_history:
            to_draft.append((output, state, hidden_row))

    def _propose(self, step: LaunchedStep, to_draft: list[tuple[RequestOutput, RequestState, int]]) -> None:
        """Drafts for the next step of every request that asked for them."""
        started, cpu = time.perf_counter(), time.thread_time()
        hidden = None
        if self.proposer.needs_hidden and step.hidden is not None:
            hidden = step.hidden.index_select(0, to_device([row for _, _, row in to_draft], torch.int64, self.device))
        requests = [
            DraftRequest(output.request_id, state.token_ids, state.block_table, state.num_drafts_to_propose,
                         None if hidden is None else hidden[i])
            for i, (output, state, _) in enumerate(to_draft)
        ]
        try:
            proposals = self.proposer.propose(requests)
        except Exception:  # noqa: BLE001 - drafting is an optimisation: a failure costs drafts, not the step
            log.exception("draft proposer failed; the step's requests get no drafts")
            proposals = [[] for _ in requests]
        for (output, _, _), proposal in zip(to_draft, proposals):
            output.next_draft_token_ids = proposal
        step.result.draft_us = int(self._spent("draft", started, cpu) * 1e6)

    @torch.inference_mode()
    def _launch(self, step: LaunchedStep, drafts: dict[str, list[int]]) -> None:
        start_mark = self.timeline.mark() if self.timeline is not None else None
        segments: list[Segment] = []
        tokens: list[int] = []
        plain_tokens: list[int] = []  # token index whose logits pick a request's next token
        chain_tokens: list[int] = []  # token indices of every draft chain's rows
        chain_drafts: list[int] = []  # per chain row: the draft it judges (NO_DRAFT on a chain's last row)
        chain_states: list[RequestSamplingState] = []
        # Input tokens still on their way from an earlier step: (token index, that step, its row).
        from_device: list[tuple[int, LaunchedStep, int]] = []
        for request_id, state, count in step.scheduled:
            start, end = state.num_computed_tokens, state.num_computed_tokens + count
            chain = drafts.get(request_id)
            if chain is not None:  # the last token, then the drafts: one attention row each
                step.verifications.append(Verification(request_id, state, chain, len(chain_tokens)))
                chain_tokens.extend(range(len(tokens), len(tokens) + count))
                tokens.append(state.token_ids[-1])
                tokens.extend(chain)
                chain_drafts.extend(chain + [NO_DRAFT])
                chain_states.extend([state.sampling] * count)
                segments.append(Segment(state.block_table, start, count, as_rows=True))
                continue
            known = len(state.token_ids)
            tokens.extend(state.token_ids[start:min(end, known)])
            for pos in range(max(start, known), end):
                earlier, earlier_row = state.pending[pos - known]
                from_device.append((len(tokens), earlier, earlier_row))
                tokens.append(0)  # placeholder, overwritten on the device
            segments.append(Segment(state.block_table, start, count, as_rows=False))
            if end == state.num_tokens:  # reached the last token: sample the next
                plain_tokens.append(len(tokens) - 1)
                step.sampling_requests.append((request_id, state))
        step.num_tokens = len(tokens)
        if self.engine.decode_graphs is not None:
            short_chunks_as_rows(segments, self.engine.decode_graphs.fits, self.max_rows_per_chunk)
        packed = pack(segments, self.tokens_per_block)
        patch = self._device_tokens(from_device)

        forward_start = time.perf_counter()
        # Hidden rows feed only next drafts: a step where no request is asked for any (the load-aware policy
        # drafting nothing in a large batch) skips selecting and copying them.
        want_hidden = (
            self.proposer is not None and self.proposer.needs_hidden
            and any(state.num_drafts_to_propose for _, state, _ in step.scheduled)
        )
        logits, hidden = run_packed(
            self.engine.model, self.engine.kv_cache, self.engine.decode_graphs, packed, tokens,
            plain_tokens + chain_tokens, patch, want_hidden,
        )
        sample_start = time.perf_counter()
        parts: list[torch.Tensor] = []
        num_plain = len(plain_tokens)
        if step.sampling_requests:
            step.sampled = self.sampler.sample_on_device(logits[:num_plain], [s.sampling for _, s in step.sampling_requests])
            parts.append(step.sampled)
        if step.verifications:
            row_tokens, row_accepted = verify_drafts(
                logits[num_plain:], to_device(chain_drafts, torch.int64, self.device), chain_states,
                self.sampler.argmax,
            )
            parts += [row_tokens, row_accepted.to(torch.int64)]
        if parts:
            step.host_values = torch.cat(parts) if len(parts) > 1 else parts[0]
            if self.device.type == "cuda":
                step.sampled_host = torch.empty(step.host_values.shape, dtype=torch.int64, pin_memory=True)
                step.sampled_host.copy_(step.host_values, non_blocking=True)
                step.done = torch.cuda.Event()
                step.done.record()
        if want_hidden:
            step.hidden = hidden.clone() if hidden is not None else None  # graph outputs are overwritten by the next replay
        if start_mark is not None:
            step.marks = (start_mark, self.timeline.mark())
        step.result.forward_us = int((sample_start - forward_start) * 1e6)
        step.result.sample_us = int((time.perf_counter() - sample_start) * 1e6)
        # Bookkeeping only once everything is queued: a failure above leaves the states as they were.
        for request_id, state, count in step.scheduled:
            state.num_computed_tokens += count
        for row, (_, state) in enumerate(step.sampling_requests):
            state.pending.append((step, row))
        for chain in step.verifications:
            chain.state.verifying = True

    def _device_tokens(self, from_device: list[tuple[int, LaunchedStep, int]]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(token indices, their ids on the device) for input tokens an earlier step sampled."""
        if not from_device:
            return None
        index = to_device([i for i, _, _ in from_device], torch.int64, self.device)
        by_step: dict[int, tuple[LaunchedStep, list[int]]] = {}
        for _, earlier, row in from_device:
            by_step.setdefault(id(earlier), (earlier, []))[1].append(row)
        if len(by_step) == 1:
            earlier, rows = next(iter(by_step.values()))
            values = earlier.sampled.index_select(0, to_device(rows, torch.int64, self.device))
        else:  # tokens from several earlier steps, in from_device order
            values = torch.cat([e.sampled[r : r + 1] for _, e, r in from_device])
        return index, values
