"""How many draft tokens each request verifies: load-aware speculation.

Verifying k drafts makes a request's step k tokens longer. While the GPU is
memory-bound (small batches) those tokens are nearly free, and every accepted
draft is a step saved; once the batch is compute-bound they cost what they
weigh, and a rejected draft is pure loss. So each step the scheduler picks the
draft length K that maximises expected tokens per second:

    goodput(K) = sum_i (1 + E_i(min(K, drafts_i))) / cost(tokens + sum_i min(K, drafts_i))

where E_i(k) = f_i (1 + c_i + c_i^2 + ... + c_i^(k-1)) is the expected number
of accepted drafts when request i accepts its first draft with probability f_i
and each later one, given the one before it was accepted, with probability c_i
(both measured per request, as decayed counts). Drafts are accepted in runs
rather than one by one: a prompt-lookup draft is right for as long as the
output goes on copying the text it was found in. On SmolLM2 with the grounded
prompts, the share of drafts accepted at each position fell from 44% at the
first to 27% at the second and then stayed at 27-50% up to the fifteenth
(bench/results/h200_spec_ngram_defaults_smollm2.json): past the second draft,
nearly every draft whose predecessor stood was accepted too. One rate fitted
to every draft (a_i + a_i^2 + ... + a_i^k) cannot be both a first draft's
chance and a draft's chance inside a run: fitted to these it rated the first
draft too high and the rest of a run too low, so a long draft seemed worth
little more than a short one, and drafts stayed short where a long one costs
no more to verify. cost(T) is the measured wall time of a
generation step of T tokens, as the step loop sees it: drafting for the next
step included, and so is what one step at a time loses against overlapped
steps. Only generation steps are measured: a step with context chunks costs
what its prompts weigh, not what its drafts do. K = 0 lets steps overlap
again, so its cost comes from overlapped steps when there are measurements of
them, and otherwise from the executor's own time per step (what overlapping
hides the rest behind); K > 0 costs what steps run one at a time cost.

Costs are learned per power-of-two bucket of T, each bucket keeping its last
few measurements and using their median (one slow step, a compilation, does
not stick; a host that is often slow counts), and interpolated between
buckets. A bucket counts once it has a few measurements: until then its size
costs what the measured buckets around it say, so a first step that happened
to be slow (a kernel loading, a pinned buffer allocated) does not rule its
size out; the size gets tried again and its median takes over (while no
bucket has enough, each counts its fastest step). Step sizes past the
largest measured one are assumed to cost what it did, which is optimistic,
so a larger K gets tried and then judged by its real cost. The other way
round, a plain step's cost is never read off drafted steps: until a step
without drafts has been measured at the current size, the policy runs one
(K = 0) before it compares. Otherwise, where verification is slow (more rows
than the CUDA graphs hold, on an executor built for small batches), K = 0
would be priced like the drafted steps and speculation would run at a loss.

What is maximised depends on the queue. While requests wait, finished
requests are replaced at once, so the batch's total tokens per second is
what serves them soonest: the sum above. When none waits, the batch only
drains, and it is done when its slowest request is; a longer step that helps
the requests whose drafts are accepted slows the ones without drafts (or
with poor ones). Then K maximises the rate of the request that gains least,
min_i (1 + E_i(min(K, drafts_i))) / cost, counting every request in the step
without drafts as gaining nothing: no running request gets slower.

K = 0 turns speculation off; while it stays off, steps overlap again (the
scheduler plans the next step before the last result is back), and a short
probe every few dozen steps goes back to one step at a time, asks for drafts
and verifies one each, so the choice is re-measured and can come back when
the load drops. A probe costs a few serial steps, so each one that leaves
speculation off doubles the interval to the next (up to a few hundred steps);
speculation turning on resets it. A probe never grows a step past
``max_step_tokens`` (the executor's batch size: past it, single-token rows
leave the CUDA graphs and a step costs several times more): only as many
requests verify a draft as there is room for, and a full batch is not probed.
Speculation also turns off when it is on but the drafts asked for do not come
(the proposer finds none for any request, ``DRY_STEPS`` steps in a row): else
the scheduler would keep waiting for every result, for nothing to verify.

Steps that chain verification rounds on the device (see ``scheduler.py``)
have no host round trip between rounds, so a round costs less than a single
verification step of the same size. Their per-round cost is learned apart
(``chained_costs``) and prices K > 0 whenever the step may chain; a K that
is a guess (no cost of its kind measured yet, a chain longer than any
measured one, whose price is extrapolated, or a probe) is a ``trial``,
which the scheduler chains over only ``TRIAL_ROUNDS`` rounds: enough to
measure a chained round, and a wrong guess costs two rounds, not eight. A
step's host work is fitted apart from its rounds' cost (``ChainedCosts``),
so steps of few rounds (trials, a request's last step) do not make their
size look dear.

A request's expected accepted drafts at K come from its record at each
draft position: of the verifications that reached position j (every draft
before it accepted, and a slot for it), how many accepted it, drawn toward
the position before it when a position is seldom reached. Drafts of mixed
origin are not alike by position: with draft heads and prompt lookup on
SmolLM2's chat answers, the heads' four drafts were accepted at 44%, 25%,
19% and 19% of the times they were verified, and the lookup's drafts past
them at 58-80% (``h100_spec_heads_lookup_policy_rounds_smollm2.json``); and
where no lookup matches, the slots past the heads' four are padding, which a
longer K verifies for nothing. The first draft's rate and one continuation
for the rest (what the policy used before) cannot tell those apart, and a
padded slot never counted as a rejection there.

What the policy knows of a K it does not choose goes stale: a size's round
cost may rest on short steps (trials, a request's last step) and a request's
acceptance past the chosen K is never observed again. On an H100 at batch 1
it priced rounds of 9 tokens 10% above rounds of 5 from such steps, chose 3-5
drafts in 68 of 80 steps, and trailed always verifying 8 by 3-7%, where long
steps cost 0.88-0.93 ms a round from 4 to 9 tokens
(``h100_spec_heads_chat_1848_e5_policy_trace_smollm2.json``). So every
``REFRESH_EVERY`` steps at most, the longest K whose expected goodput is
within ``REFRESH_MARGIN`` of the best, above K = 0's, and that no step chose
in the last ``REFRESH_EVERY`` runs once, chaining every round: its cost and the
acceptance of its later drafts are measured again, and if the guess was
wrong the next steps choose it on their own. A refresh costs at most a tenth
of one step in sixteen, and none while speculation is off.
"""

from __future__ import annotations

import logging
from collections import Counter, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from itertools import accumulate
from operator import mul

log = logging.getLogger("inflight.scheduler")

# Prior belief about a request's acceptance rate, worth this many observations.
PRIOR_ACCEPTANCE = 0.6
PRIOR_WEIGHT = 2.0
DECAY = 0.9  # per verification: recent acceptance counts most
POSITION_PRIOR_WEIGHT = 0.5  # observations a later draft position's prior is worth (``Acceptance.position_rates``)
RECENT = 8  # measurements each step-size bucket keeps
OUTLIER_FACTOR = 3.0  # a chained step over this many times its size's cheapest round is left out of the fit
TRUSTED = 3  # measurements after which a bucket counts (its median)
TRIAL_ROUNDS = 2  # chained rounds of a trial K (see the module docstring)
PROBE_EVERY = 32  # steps between probes while speculation is off ...
MAX_PROBE_EVERY = 512  # ... doubling after each probe that did not turn it back on, up to this
PROBE_STEPS = 3  # a probe: ask for drafts, get them, verify them
DRY_STEPS = 8  # steps in a row that asked for drafts and got none for any request: speculation turns off
REFRESH_EVERY = 16  # steps: a longer K priced near the best and not run for this long runs once ...
REFRESH_MARGIN = 0.10  # ... when its expected goodput is within this share of the best's


@dataclass(slots=True)
class DraftStats:
    """Speculative decoding since start: drafts verified and accepted, by chain position."""

    num_draft_tokens: int = 0
    num_accepted: int = 0
    by_position: list[int] = field(default_factory=list)  # drafts verified at chain position i
    accepted_by_position: list[int] = field(default_factory=list)


@dataclass(slots=True)
class Acceptance:
    """A request's acceptance of its first draft and of a draft after an accepted one, as decayed counts, and of
    each draft position apart (``position_rates``)."""

    first_accepted: float = PRIOR_ACCEPTANCE * PRIOR_WEIGHT
    first_rejected: float = (1.0 - PRIOR_ACCEPTANCE) * PRIOR_WEIGHT
    later_accepted: float = PRIOR_ACCEPTANCE * PRIOR_WEIGHT
    later_rejected: float = (1.0 - PRIOR_ACCEPTANCE) * PRIOR_WEIGHT
    # Per position j past the first: of the verifications that reached it (a slot for it, every draft before it
    # accepted), the decayed count that accepted it, and the decayed count that reached it.
    reached_accepted: list[float] = field(default_factory=list)
    reached: list[float] = field(default_factory=list)

    @property
    def rate(self) -> float:
        """How often the first draft is accepted."""
        return self.first_accepted / (self.first_accepted + self.first_rejected)

    @property
    def continuation(self) -> float:
        """How often a draft is accepted when the one before it was."""
        return self.later_accepted / (self.later_accepted + self.later_rejected)

    def observe(self, num_drafts: int, num_accepted: int, num_slots: int | None = None) -> None:
        """A verification of ``num_drafts`` drafts accepted the first ``num_accepted``; ``num_slots`` (at least
        ``num_drafts``): the positions it verified, the ones past the drafts padding that no guess filled."""
        if num_drafts <= 0:
            return
        self.first_accepted = self.first_accepted * DECAY + (num_accepted > 0)
        self.first_rejected = self.first_rejected * DECAY + (num_accepted == 0)
        # Drafts after the first are judged only while the one before stood: the accepted ones past the first,
        # then one rejection, unless every draft was accepted (or the first already failed).
        self.later_accepted = self.later_accepted * DECAY + max(num_accepted - 1, 0)
        self.later_rejected = self.later_rejected * DECAY + (0 < num_accepted < num_drafts)
        # Each later position that this verification reached: accepted, or the one where it stopped (a padded
        # slot counts as rejected: a longer K verifies it whether or not a guess fills it).
        slots = max(num_slots or num_drafts, num_drafts)
        reached_up_to = min(num_accepted + 1, slots)  # positions 1 .. reached_up_to (1-based)
        if len(self.reached) < reached_up_to - 1:
            grow = reached_up_to - 1 - len(self.reached)
            self.reached.extend([0.0] * grow)
            self.reached_accepted.extend([0.0] * grow)
        for j in range(1, reached_up_to):  # 0-based index j - 1 holds position j + 1
            self.reached[j - 1] = self.reached[j - 1] * DECAY + 1.0
            self.reached_accepted[j - 1] = self.reached_accepted[j - 1] * DECAY + (num_accepted > j)

    def position_rates(self, k: int) -> list[float]:
        """Chance of accepting draft j (j = 1..k) when every draft before it was accepted: the first draft's
        rate, then each later position's own record, drawn by POSITION_PRIOR_WEIGHT observations toward the
        position before it (the second toward the pooled ``continuation``): a position seldom or never reached
        goes on as the chain before it did."""
        rates = [self.rate]
        prior = self.continuation
        for j in range(1, k):
            known = j - 1 < len(self.reached)
            seen, hits = (self.reached[j - 1], self.reached_accepted[j - 1]) if known else (0.0, 0.0)
            rates.append((hits + POSITION_PRIOR_WEIGHT * prior) / (seen + POSITION_PRIOR_WEIGHT))
            prior = rates[-1]
        return rates


def expected_accepted(rate: float, k: int, continuation: float | None = None,
                      position_rates: list[float] | None = None) -> float:
    """Expected accepted drafts of a chain of k: the first accepted with ``rate``, each later one with
    ``continuation`` given the one before (``rate`` again when None: every draft alike); or, given
    ``position_rates``, draft j with its own conditional chance (``Acceptance.position_rates``)."""
    if position_rates is not None:
        total, chain = 0.0, 1.0
        for j in range(k):
            chain *= position_rates[min(j, len(position_rates) - 1)]
            total += chain
        return total
    later = rate if continuation is None else continuation
    return rate * sum(later**j for j in range(k))


def accepted_curve(rate: float, k: int, continuation: float | None = None,
                   position_rates: list[float] | None = None, length: int | None = None) -> list[float]:
    """``expected_accepted`` at every chain length 0..k in one pass: ``[0, E(1), ..., E(k)]``, held at E(k) up to
    ``length`` + 1 entries when given (a request that verifies at most k drafts whatever K)."""
    if position_rates is not None:
        rates = position_rates[:k] + position_rates[-1:] * (k - len(position_rates))
    else:
        rates = [rate] + [rate if continuation is None else continuation] * (k - 1) if k else []
    curve = [0.0, *accumulate(accumulate(rates, mul))]
    return curve + curve[-1:] * ((length or k) - k)


def _bucket(num_tokens: int) -> int:
    return max(num_tokens, 1).bit_length()  # powers of two: 1, 2-3, 4-7, ...


def _counted(windows: Iterable[deque], seconds: Callable[[tuple], float]) -> list[list]:
    """The buckets' windows that count: those measured ``TRUSTED`` times once any is, else each bucket's
    cheapest measurement alone (``seconds`` of a measurement). See the module docstring."""
    trusted = [list(window) for window in windows if len(window) >= TRUSTED]
    return trusted or [[min(window, key=seconds)] for window in windows]


@dataclass(slots=True)
class StepCosts:
    """Measured seconds of a generation step by the tokens in it (see the module docstring)."""

    recent: dict[int, deque] = field(default_factory=dict)  # bucket -> last (tokens, seconds)
    # ``points()`` until the next observation: the policy prices every draft length from them each step.
    _points: list[tuple[int, float]] | None = field(default=None, repr=False)

    def observe(self, num_tokens: int, seconds: float) -> None:
        self.recent.setdefault(_bucket(num_tokens), deque(maxlen=RECENT)).append((num_tokens, seconds))
        self._points = None

    def points(self) -> list[tuple[int, float]]:
        """(tokens, seconds) per bucket with enough measurements: its median recent step.
        While no bucket has enough, every bucket's fastest step."""
        if self._points is None:
            ranked = [sorted(window, key=lambda p: p[1]) for window in _counted(self.recent.values(), lambda p: p[1])]
            self._points = sorted(r[len(r) // 2] for r in ranked)
        return self._points

    def covers(self, num_tokens: int) -> bool:
        """Whether a step of ``num_tokens`` is within the measured sizes (its bucket or a larger one)."""
        return any(bucket >= _bucket(num_tokens) for bucket in self.recent)

    def step_seconds(self, num_tokens: int) -> float | None:
        points = self.points()
        return _interpolate(points, num_tokens) if points else None


@dataclass(slots=True)
class ChainedCosts:
    """Measured cost of steps that chained verification rounds: a share of host work per step (planning,
    launching, reading the result back) and a per-round cost by the tokens in a round.

    A step of R rounds of T tokens takes about ``host + R * round(T)``. Its wall time divided by R, what the
    policy once priced rounds by, makes a step of few rounds (a trial's two, a request's last step stopped by
    its end) look dear: on an H100 with SmolLM2, heads with prompt lookup, steps of 16 rounds cost 1.05-1.18 ms a
    round at 2 to 9 tokens, steps of 2 rounds 2.0 ms, and a size seen mostly near requests' ends was priced
    at 2.0 (``h100_spec_heads_lookup_policy_trace_smollm2.json``). So ``host`` and each size's ``round`` are
    fitted together by least squares over every size's recent steps (one ``host`` for all), and a round is
    priced as ``round(T) + host / R`` for the rounds R a step chains. Where every step of a size ran the same
    number of rounds, ``host`` is not told apart from the rounds, and the price is their share, as before.
    As with single steps, a size counts once measured ``TRUSTED`` times; until then it is a trial, priced by
    the sizes that count.
    In the next traced H100 run it fitted 1.55 ms a step and 0.85-0.92 ms a round from 2 to 9 tokens, chose 8
    drafts in 53 of 108 steps (24 of 104 before) and ran within 2% of always verifying 8 at batch 1
    (``h100_spec_heads_draft_vocab_{cost_fit,cycles4}_smollm2.json``).
    """

    recent: dict[int, deque] = field(default_factory=dict)  # bucket -> last (tokens, step seconds, rounds)
    # ``fit()`` until the next observation: the policy prices every draft length from it each step.
    _fit: tuple[float, list[tuple[int, float]]] | None = field(default=None, repr=False)

    def observe(self, num_tokens: int, round_seconds: float, rounds: int) -> None:
        """A step of ``rounds`` rounds of ``num_tokens`` tokens took ``round_seconds`` a round."""
        window = self.recent.setdefault(_bucket(num_tokens), deque(maxlen=RECENT))
        window.append((num_tokens, round_seconds * rounds, max(rounds, 1)))
        self._fit = None

    def covers(self, num_tokens: int) -> bool:
        """Whether a round of ``num_tokens`` is within the measured sizes (its bucket or a larger one, with
        ``TRUSTED`` measurements: a size measured fewer times is priced by a guess)."""
        return any(bucket >= _bucket(num_tokens) and len(window) >= TRUSTED for bucket, window in self.recent.items())

    def fit(self) -> tuple[float, list[tuple[int, float]]]:
        """(host seconds a step, [(tokens, seconds a round)] per bucket, by tokens)."""
        if self._fit is None:
            self._fit = self._least_squares()
        return self._fit

    def _least_squares(self) -> tuple[float, list[tuple[int, float]]]:
        # As with single steps (``StepCosts.points``), only sizes measured TRUSTED times count once some
        # are: a size's first chained step may pay for what warms up (pinned buffers, a kernel's first
        # specialisation), and a size priced off that one step alone would never be chosen, so never be
        # measured again. Without it, the first steps of a fresh process at batch 1 priced rounds of 9 tokens
        # too dear and chose one draft in 223 of 229 steps. Sizes measured fewer times are priced from
        # the counted ones around them until they count. While none counts, each size's cheapest step.
        windows = []
        for window in _counted(self.recent.values(), lambda step: step[1] / step[2]):
            cheapest = min(sec / rounds for _, sec, rounds in window)
            # A step costing over three times the cheapest round of its size (a kernel compiling, a pause) is
            # no measure of either part.
            kept = [(t, sec, r) for t, sec, r in window if sec / r <= OUTLIER_FACTOR * cheapest]
            windows.append(kept)
        # For a given host h, a size's round is sum(R (S - h)) / sum(R^2); h minimises what is left over.
        num = den = 0.0
        for kept in windows:
            rr = sum(r * r for _, _, r in kept)
            rs = sum(r * sec for _, sec, r in kept)
            rc = sum(r for _, _, r in kept)
            for _, sec, r in kept:
                u, v = sec - r * rs / rr, 1.0 - r * rc / rr
                num, den = num + u * v, den + v * v
        host = max(num / den, 0.0) if den > 1e-9 else 0.0
        host = min(host, min(sec for kept in windows for _, sec, _ in kept))  # never more than a whole step
        points = []
        for kept in windows:
            rr = sum(r * r for _, _, r in kept)
            per_round = sum(r * (sec - host) for _, sec, r in kept) / rr
            tokens = sorted(t for t, _, _ in kept)[len(kept) // 2]
            points.append((tokens, max(per_round, 0.0)))
        return host, sorted(points)

    def points(self) -> list[tuple[int, float]]:
        """(tokens, seconds a round without the host's share) per bucket (reports)."""
        return self.fit()[1] if self.recent else []

    def rounds_within(self, num_tokens: int, max_rounds: int, seconds: float) -> int:
        """The most rounds of ``num_tokens`` (up to ``max_rounds``) a step may chain and still take at most
        ``seconds``, host share included, at the measured costs; at least 1. ``max_rounds`` while nothing is
        measured or ``seconds`` is 0 (no limit)."""
        if seconds <= 0 or not self.recent:
            return max_rounds
        host, points = self.fit()
        per_round = _interpolate(points, num_tokens)
        if per_round <= 0:
            return max_rounds
        return max(1, min(max_rounds, int((seconds - host) / per_round)))

    def round_seconds(self, num_tokens: int, rounds: int) -> float | None:
        """What a round of ``num_tokens`` costs in a step of ``rounds`` rounds (interpolated between sizes)."""
        if not self.recent:
            return None
        host, points = self.fit()
        return _interpolate(points, num_tokens) + host / max(rounds, 1)


def _interpolate(points: list[tuple[int, float]], num_tokens: int) -> float:
    """``points`` (by tokens) read at ``num_tokens``: linear between them, flat past either end."""
    if num_tokens <= points[0][0]:
        return points[0][1]
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if num_tokens <= x1:
            return y0 + (y1 - y0) * (num_tokens - x0) / max(x1 - x0, 1)
    return points[-1][1]


@dataclass(slots=True)
class Candidate:
    """One request that could verify drafts this step."""

    request_id: str
    num_drafts: int  # drafts it has, already cut to what its limits allow
    rate: float  # how often its first draft is accepted
    continuation: float | None = None  # how often a draft after an accepted one is (None: ``rate``)
    position_rates: list[float] | None = None  # each draft's chance given the ones before (overrides the two above)


class DraftLengthPolicy:
    """Picks the step's draft length K (see the module docstring)."""

    def __init__(self, max_draft_tokens: int, adaptive: bool = True, max_step_tokens: int = 0,
                 max_rounds: int = 8, max_chained_step_seconds: float = 0.0) -> None:
        self.max_draft_tokens = max_draft_tokens
        self.adaptive = adaptive
        self.max_step_tokens = max_step_tokens  # probes stay within it (0 = no limit)
        self.max_rounds = max_rounds  # rounds a chained step runs: its host share is spread over them
        # A chained step runs no more rounds than fit in this (0 = no limit): its tokens stream when it ends.
        self.max_chained_step_seconds = max_chained_step_seconds
        self.verify_limit: int | None = None  # this step's most requests that verify drafts (None = all)
        # This step's K is a trial (priced by a guess, or a probe of speculation that was off): the
        # scheduler chains it over at most TRIAL_ROUNDS rounds, so a wrong guess costs few rounds.
        self.trial = False
        self._last_tokens = 0  # tokens of the last generation step measured
        self.overlap_available = True  # whether the step loop overlaps steps when speculation is off
        self.costs = StepCosts()  # wall time of steps run one at a time
        self.overlapped_costs = StepCosts()  # wall time of overlapped steps
        self.executor_costs = StepCosts()  # the executor's own time per step
        self.chained_costs = ChainedCosts()  # steps that chained verification rounds: host share and rounds
        self._chainable = False  # this step may chain rounds: K > 0 is priced by chained_costs
        self.last_k = max_draft_tokens
        self._dry_steps = 0  # steps in a row whose drafts were asked for and none came
        self._steps = 0
        self._probe_every = PROBE_EVERY
        self._probe_start = PROBE_EVERY  # the step (as counted by choose) where the next probe begins
        self.choices: Counter[int] = Counter()  # K chosen, over steps that had drafts to verify
        self._plain_sizes: set[int] = set()  # step-size buckets where a step without drafts was measured
        self._plain_tried: set[int] = set()  # ... and where one was run to be measured
        self.refresh = True  # re-measure a longer K priced near the best now and then (see the module docstring)
        self._chosen_at: dict[int, int] = {}  # K -> the last step (as counted by choose) that chose it, not a trial
        self._next_refresh = REFRESH_EVERY  # the first step where a refresh may run
        self.refreshes = 0  # steps that ran a K to measure it again

    def choose(
        self, candidates: list[Candidate], other_tokens: int, draining: bool = False, chainable: bool = False,
        asked: bool = False,
    ) -> int:
        """K for this step: ``candidates`` may verify drafts, ``other_tokens`` are the step's other tokens;
        ``draining``: no request waits, so no running request may get slower (see the module docstring);
        ``chainable``: the step may chain verification rounds; ``asked``: the last step asked for drafts."""
        self._steps += 1
        self._chainable = chainable
        self.verify_limit = None
        self.trial = False
        if not candidates:
            if self.last_k > 0 and asked:  # on, but the drafts asked for did not come
                self._dry_steps += 1
                if self._dry_steps >= DRY_STEPS:
                    self.last_k, self._dry_steps = 0, 0
                    self._probe_start = self._steps + self._probe_every
            if self.last_k == 0:  # off, and no request asked for drafts: a probe window may pass unused
                self._schedule_probes(0)
            return self.last_k
        self._dry_steps = 0
        if not self.adaptive:
            self.last_k = self.max_draft_tokens
            return self.last_k
        base = other_tokens + len(candidates)
        size = _bucket(base)
        drafted = self.costs.recent or self.chained_costs.recent
        if drafted and size not in self._plain_sizes and size not in self._plain_tried:
            # Steps with drafts were measured but a plain step of this size never was: its cost would be
            # read off the longer, drafted steps (no cheaper, so speculation would look free), or, where every
            # step chained rounds, not be known at all (each step a two-round trial, for good). Run one
            # plain step to learn it, as K > 0 was once tried unmeasured; once per size (a step that
            # also carries prompt chunks is not measured, and must not hold speculation off). last_k
            # stays: drafts keep coming, so the next step speculates again at once if that pays.
            self._plain_tried.add(size)
            self.choices[0] += 1
            return 0
        best_k, best, best_tokens = 0, -1.0, base
        rated: list[tuple[float, int]] = []  # (goodput, step tokens) at each K priced
        estimates, debug = [], log.isEnabledFor(logging.DEBUG)
        # Each candidate's expected accepted drafts at every K, computed once and summed by K: pricing every K
        # from scratch cost O(candidates x K^2) a step (5.8 ms for 256 candidates and K = 15 on a CPU core).
        top = self.max_draft_tokens
        caps = [min(c.num_drafts, top) for c in candidates]
        by_k = list(zip(*(accepted_curve(c.rate, cap, c.continuation, c.position_rates, top)
                          for c, cap in zip(candidates, caps))))  # [K + 1] tuples of every candidate's E(min(K, cap))
        cap_counts = Counter(caps)
        drafts, reaching = 0, len(caps)  # drafts verified at K = k; candidates that verify a k-th draft
        for k in range(top + 1):
            if k:
                reaching -= cap_counts[k - 1]
                drafts += reaching
            seconds = self._cost(k, base + drafts)
            if seconds is None:  # nothing measured yet: speculate fully once and learn
                best_k, self.trial = self.max_draft_tokens, True
                break
            if draining:  # the request that gains least; one without drafts gains one token a step
                tokens = 1.0 if other_tokens else 1 + min(by_k[k])
            else:
                tokens = len(candidates) + sum(by_k[k])
            goodput = tokens / max(seconds, 1e-9)
            rated.append((goodput, base + drafts))
            if debug:
                estimates.append(f"K={k}: {goodput:.0f} tok/s")
            if goodput > best * 1.01:  # a longer chain must pay for itself clearly
                best_k, best, best_tokens = k, goodput, base + drafts
        if best_k > 0 and self._chainable and not self.trial:
            best_k, best_tokens = self._refreshed(best_k, best_tokens, best, rated)
        if best_k > 0 and self._chainable:  # a chain of a size past every measured one is priced by a guess
            self.trial = self.trial or not self.chained_costs.covers(best_tokens)
        if best_k > 0 and not self.trial:
            self._chosen_at[best_k] = self._steps
        self._schedule_probes(best_k)
        if best_k == 0 and self._probing():
            room = self._room(base)
            if room > 0:  # off, but probing: verify one draft so the cost of speculating is measured again
                best_k, self.trial = 1, True
                self.verify_limit = room if room < len(candidates) else None
        if debug:
            log.debug("draft length %d for %d requests with drafts (%s)", best_k, len(candidates), ", ".join(estimates))
        self.last_k = best_k
        self.choices[best_k] += 1
        return best_k

    def observe(
        self, num_tokens: int, wall_seconds: float, overlapped: bool, executor_seconds: float, plain: bool = True,
        chained: bool = False, rounds: int = 1,
    ) -> None:
        """A generation step of ``num_tokens`` tokens took ``wall_seconds`` as the step loop saw it;
        ``plain``: it verified no drafts; ``chained``: it was one round's share of ``rounds`` chained rounds."""
        if chained:
            self.chained_costs.observe(num_tokens, wall_seconds, rounds)
            self._last_tokens = num_tokens
            return
        (self.overlapped_costs if overlapped else self.costs).observe(num_tokens, wall_seconds)
        if plain:
            self._plain_sizes.add(_bucket(num_tokens))
        self._last_tokens = num_tokens
        if executor_seconds > 0:
            self.executor_costs.observe(num_tokens, executor_seconds)

    def _refreshed(self, best_k: int, best_tokens: int, best: float, rated: list[tuple[float, int]]) -> tuple[int, int]:
        """(K, step tokens) for this step: the best, or a longer K to measure again (see the module docstring)."""
        if not self.refresh or self._steps < self._next_refresh:
            return best_k, best_tokens
        stale_before = self._steps - REFRESH_EVERY
        # Within the margin of the best, and never priced below no speculation: a refresh is still a K that pays.
        floor = max(best * (1.0 - REFRESH_MARGIN), rated[0][0])
        last_deeper = -1  # the last step that chose a K at least as long as k
        for k in range(len(rated) - 1, best_k, -1):
            last_deeper = max(last_deeper, self._chosen_at.get(k, -1))
            goodput, tokens = rated[k]
            adds_drafts = tokens > rated[k - 1][1]  # else no candidate has a k-th draft: K = k - 1 is the same step
            if adds_drafts and last_deeper < stale_before and goodput >= floor:
                self._next_refresh = self._steps + REFRESH_EVERY
                self.refreshes += 1
                return k, tokens
        return best_k, best_tokens

    def _cost(self, k: int, num_tokens: int) -> float | None:
        if k > 0 and self._chainable:
            rounds = self.chained_rounds(num_tokens)
            return self.chained_costs.round_seconds(num_tokens, rounds)
        if k == 0 and self.overlap_available:
            for costs in (self.overlapped_costs, self.executor_costs):
                seconds = costs.step_seconds(num_tokens)
                if seconds is not None:
                    return seconds
        return self.costs.step_seconds(num_tokens)

    def chained_rounds(self, num_tokens: int) -> int:
        """Rounds a chained step of ``num_tokens`` a round may run: ``max_rounds``, fewer where the measured
        costs say they would take longer than ``max_chained_step_seconds``."""
        return self.chained_costs.rounds_within(num_tokens, self.max_rounds, self.max_chained_step_seconds)

    def _schedule_probes(self, best_k: int) -> None:
        if best_k > 0:  # speculation pays: probe soon again once it stops paying
            self._probe_every = PROBE_EVERY
            self._probe_start = self._steps + self._probe_every
        elif self._steps >= self._probe_start + PROBE_STEPS:  # a probe ended and left it off: wait longer
            self._probe_every = min(2 * self._probe_every, MAX_PROBE_EVERY)
            self._probe_start = self._steps + self._probe_every

    def _room(self, num_tokens: int) -> int:
        """Tokens a probe may add to a step of ``num_tokens`` and stay within ``max_step_tokens``."""
        return self.max_step_tokens - num_tokens if self.max_step_tokens else 1 << 30

    def _probing(self) -> bool:
        """Whether this step is part of a probe: its window, and room for it past the last step's tokens."""
        return self._probe_start <= self._steps < self._probe_start + PROBE_STEPS and self._room(self._last_tokens) > 0

    def drafts_to_propose(self) -> int:
        """Drafts to ask for the next step: room to grow by one, and occasional probes when off."""
        if not self.adaptive:
            return self.max_draft_tokens
        if self.last_k > 0:
            return min(self.max_draft_tokens, self.last_k + 1)
        return 1 if self._probing() else 0

    def allows_overlap(self) -> bool:
        """Whether the next step may be planned before the last result: speculation is off and not probing."""
        return self.adaptive and self.last_k == 0 and not self._probing()
