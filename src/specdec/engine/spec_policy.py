"""How many drafts each device round (CUDA) or synchronous step (the CPU) proposes: a cost model
that never lets speculation lose.

For each arm — K = 0..max_k drafts a round, and P (`PLAIN`, recorded as K = -1: a step of the
plain overlapped decode loop, no drafter work) with `plain_arm` — the policy keeps the measured
cost of a step at each batch bucket, the running acceptance of draft position i (the rate at
which draft i is accepted given drafts before it were), and the measured cost of entering device
rounds (the drafter's catch-up on what it has not seen).

Two objectives, by what the engine knows of the work ahead:
- A closed batch (no request waits to join; each request's remaining token budget given): the
  arm that finishes the batch soonest. A batch ends with its slowest request, and the number of
  rounds a request needs to emit n tokens varies with its draws: by renewal theory it is about
  normal, with mean n / mu + (E[X^2] / mu^2 - 1) / 2 and variance n sigma^2 / mu^3 (X the tokens
  a round emits: mu = 1 + a_1 + a_1 a_2 + ..., sigma^2 its variance), and the slowest of B such
  requests needs about z_B standard deviations more than the mean (z_B: the expected maximum of
  B standard normals). Plain steps emit one token each: n steps, no spread. Entering rounds adds
  its measured cost; leaving them, one plain step (the overlap lost while they drain).
- Otherwise (requests wait: a finished request's slot is refilled, the tail costs nothing):
  the arm of most expected tokens per second, (1 + a_1 + a_1 a_2 + ... + a_1...a_K) / cost(K).
Requests the rounds cannot take decode beside them, one token a cycle whatever K, and their
step is part of each arm's measured cost: their tokens count in every arm's tokens per second
(s per request of the rounds: (E(K) + s) / cost(K)), and a closed batch takes at least as many
steps as the longest of them has tokens left. Without that, a few requests in the rounds beside
many outside them would pay a dearer round for the few's gain alone.

Acceptance is kept per request too: a choice for a step of at most `REQUEST_ACCEPTANCE_ROWS`
requests weighs their acceptance (the mean of each one's running acceptance, which counts the
pooled acceptance of every request as `REQUEST_PRIOR_ROUNDS` rounds of its own; over more
requests that mean is about the pooled one), so that a step follows its own requests,
not whichever request drafted most lately (s44, the CPU at c = 1: the pooled acceptance of a
request that accepted well made the next one draft where it lost).

Costs are measured in steady state: a step's cost runs from the previous step's end to its own
(the first step of a visit to an arm has no previous one and is not measured), the next `ramp`
measured steps of a visit are dropped too (a graph capture, the loop settling after a switch),
and an estimate is the median of the last `window` measurements. Each arm is tried at the start
and re-explored now and then: an arm on the same side of the rounds every `explore_every` steps,
for `explore_run` steps in a row; an arm that needs entering or leaving the rounds only once the
time spent since its last exploration, times `explore_budget`, pays for the switch, so that
exploring costs at most about that share of the time. On an engine of synchronous steps (the
CPU, `side_budget`), where a drafted step costs up to twice a plain one, re-exploring any arm is
budgeted the same way (by its expected loss against the best arm), the first bucket tries the
largest K first, and a new bucket measures its cheapest arm and estimates the others from the
nearest fully measured bucket's cost ratios. There the drafter is fed lazily: the first drafted
step after K = 0 steps first catches up on every entry they left it (s34, CPU, c = 8: backlogs to
90 positions, that step up to 91.6 ms against a 54 ms plain one). The policy measures that step's
cost over the arm's own, as a share of it (`catch_up_seconds`), and charges it to a move between
K = 0 and drafting: in an exploration's expected loss, in the seconds to finish a closed batch,
and spread over `explore_every` steps in the tokens per second of a drafting arm chosen from
K = 0.

Non-anticipating: a step's arm is chosen at its launch from steps already read and from the
remaining budgets (known before any of the step's tokens is drawn), so it depends only on tokens
emitted before the step's drafts are drawn; each round is an exact speculative step whatever its
K. Deterministic given its measurements; draws no randomness.
"""

from __future__ import annotations

import bisect
import math
import statistics
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

PLAIN = -1  # the plain arm: a plain overlapped decode step, outside device rounds
# The share of the time that re-exploring K on an engine of synchronous steps (the CPU) may
# cost (`SpeculationPolicy.side_budget`). Where drafting loses (the 2-core CPU at batch 8: a K = 1
# step 1.7-1.9x a K = 0 one for 1.54x its tokens) the budget is all speculation costs: s35, in
# process, 64 chats through 8 slots, 2% of the time (27.6 s against 27.05 plain; K = 0 pinned
# 27.1-27.3). At 0.5% an exploration of K = 1 (about 0.2 s with the drafter's catch-up) comes
# about once in 40 s of steps.
SYNC_EXPLORE_BUDGET = 0.005
# How much better than K = 0 a drafting arm must look on the synchronous step (the CPU) to be
# chosen (`SpeculationPolicy.margin`): a few times the spread of its cost medians from run to
# run on the 2-core machine (s24: K = 1 at batch 1 measured 1.47 tokens for 15.1 ms against
# 1 for 9.8, within a few percent of each other from one server run to the next).
SYNC_SPEC_MARGIN = 0.05

# How many rounds of a request's own the pooled acceptance counts as in that request's running
# acceptance: a new request starts from the pooled one and follows its own after a few rounds.
REQUEST_PRIOR_ROUNDS = 2.0
# The most requests a step may run for its choice to weigh their own acceptance (and a round
# to record it): over more, the mean of their own is about the pooled acceptance, and keeping
# it for 64 requests cost the host about 0.14 ms a round (s45, this 2-core machine while other
# work ran), a tenth of an H100 round at that batch; at 16 about 0.02 ms.
REQUEST_ACCEPTANCE_ROWS = 16

# The expected maximum of 2^i independent standard normals, i = 0..10.
_EXPECTED_MAX_NORMAL = (0.0, 0.5642, 1.0294, 1.4236, 1.7660, 2.0697, 2.3437, 2.5946, 2.8269,
                        3.0439, 3.2482)  # fmt: skip


def expected_max_normal(count: int) -> float:
    """The expected maximum of `count` independent standard normals (interpolated in log2 of
    `count` between the tabled powers of two; 0 for one)."""
    if count <= 1:
        return 0.0
    x = min(math.log2(count), len(_EXPECTED_MAX_NORMAL) - 1)
    i = min(int(x), len(_EXPECTED_MAX_NORMAL) - 2)
    lo, hi = _EXPECTED_MAX_NORMAL[i], _EXPECTED_MAX_NORMAL[i + 1]
    return lo + (hi - lo) * (x - i)


@dataclass(slots=True)
class _Cost:
    """An arm's cost at one bucket: the `recent` kept measurements and their median."""

    recent: deque[float]
    _median: float | None = None

    def add(self, seconds: float) -> None:
        self.recent.append(seconds)
        self._median = None

    @property
    def seconds(self) -> float:
        if self._median is None:  # asked before every step: computed once per measurement
            self._median = statistics.median(self.recent)
        return self._median


@dataclass(slots=True)
class SpeculationPolicy:
    """Chooses K in [0, max_k] (or PLAIN, with `plain_arm`) per step (or always max_k when
    not `adaptive`).

    Attributes:
        max_k: the largest K (the configured num_speculative_tokens).
        adaptive: False pins K to max_k (and never offers PLAIN).
        plain_arm: offer the arm PLAIN (a plain decode step) beside K = 0..max_k.
        explore_every: steps between two re-measurements of an arm other than the best.
        explore_run: steps in a row an arm runs when it is explored.
        explore_budget: the share of the time that exploring an arm across the rounds' border
            (entering or leaving them) may cost.
        ramp: measured steps at the start of each visit to an arm that are not kept.
        window: measurements of a cost kept (its estimate is their median).
        decay: weight of the newest round in the running acceptance.
        side_budget: None: an arm on the batch's side of the rounds' border is re-explored
            every `explore_every` steps. A share (the synchronous step of the CPU, where a
            drafted step costs twice a plain one): only once that share of the time since pays
            for what exploring it is expected to lose against the best arm.
        margin: a drafting arm (K > 0) is chosen over a measured K = 0 only when it is
            expected to beat it by more than this share (of tokens per second, or of the
            seconds to finish a closed batch). The synchronous step (`SYNC_SPEC_MARGIN`):
            where the two are within the noise of their medians, a drafting step also pays
            what its cost does not show (the drafter's catch-up on the entries a K = 0 stretch
            left it), so K = 0 is the safe side.
        tree: the arms are K = 0 and max_k only: a step drafting nothing, or the draft tree of
            max_k levels (`speculative_config.tree`, on the synchronous step). A tree round's
            accepted path counts as a chain's accepted drafts, so the running acceptance of
            position i is that of the tree's level i given the levels before, and
            1 + a_1 + a_1 a_2 + ... the tree's expected tokens a round.
    """

    max_k: int
    adaptive: bool = True
    plain_arm: bool = False
    tree: bool = False
    explore_every: int = 48
    explore_run: int = 5
    explore_budget: float = 0.01
    ramp: int = 2
    window: int = 8
    decay: float = 0.1
    side_budget: float | None = None
    margin: float = 0.0
    _costs: dict[tuple[int, int], _Cost] = field(default_factory=dict)
    _entry: dict[int, deque[float]] = field(default_factory=dict)  # bucket -> entry costs
    _tried: dict[tuple[int, int], int] = field(default_factory=dict)
    _offered: list[float] = field(default_factory=list)  # rows that reached draft i
    _accepted: list[float] = field(default_factory=list)  # ... and accepted it
    # Per request: its own decayed counts of drafts offered and accepted, by position.
    _requests: dict[str, tuple[list[float], list[float]]] = field(default_factory=dict)
    _view: list[float] | None = None  # the acceptance a choice weighs (its requests')
    _rounds: int = 0
    _hold: list[int] = field(default_factory=list)  # [arm, choices left] of an exploration
    _visit: tuple[int, int] = (0, PLAIN - 1)  # (bucket, arm) of the visit going on
    _visit_measured: int = 0  # its steps measured so far
    _credit: float = 0.0  # seconds of exploration across the rounds' border earned so far
    _side_credit: float = 0.0  # seconds of exploration on the batch's side (`side_budget`)
    # `side_budget`: whether the drafter was left behind (the last step drafted nothing), and
    # the (bucket, K, seconds) of the last drafted steps that caught up on such a stretch.
    _behind: bool = True
    _catch_ups: deque[tuple[int, int, float]] = field(default_factory=deque)
    chosen: dict[int, int] = field(default_factory=dict)  # K (PLAIN: -1) -> times chosen

    def __post_init__(self) -> None:
        self._offered = [0.0] * self.max_k
        self._accepted = [0.0] * self.max_k
        self._catch_ups = deque(maxlen=self.window)

    @property
    def arms(self) -> list[int]:
        """The candidates: K = 0..max_k (`tree`: 0 and max_k), and PLAIN first with
        `plain_arm`."""
        plain = [PLAIN] if self.plain_arm and self.adaptive else []
        drafting = [0, self.max_k] if self.tree else list(range(self.max_k + 1))
        return plain + drafting

    def choose(
        self,
        bucket: int,
        remaining: Sequence[int] | None = None,
        in_rounds: bool = True,
        beside: Sequence[int] = (),
        rows: int | None = None,
        requests: Sequence[str] | None = None,
    ) -> int:
        """The arm of the next step of `bucket` slots.

        Args:
            bucket: the batch bucket the step runs at.
            remaining: per running request, the tokens it may still emit (its budget less what
                it emitted), when no request waits to join the batch; None otherwise.
            in_rounds: whether the batch is in device rounds now (K >= 0 needs no entry).
            beside: per request decoding beside the rounds (one plain token a cycle whatever
                the arm, at a cost that is part of every arm's measured step), the tokens it
                may still emit. Their tokens count in every arm's tokens per second, and in a
                closed batch none finishes before the longest of them has emitted its last.
            rows: the requests the step runs (default: `bucket`), against which `beside` is
                weighed.
            requests: the ids of the requests that would draft in the step: the acceptance
                weighed is the mean of theirs (`request_acceptance`) when they are at most
                `REQUEST_ACCEPTANCE_ROWS`; None, or more: the pooled one.
        """
        share = len(beside) / max(rows or bucket, 1)
        if requests and len(requests) <= REQUEST_ACCEPTANCE_ROWS:
            self._view = self._mean_acceptance(requests)
        try:
            k = self._choose(bucket, remaining, in_rounds, beside, share)
        finally:
            self._view = None
        self.chosen[k] = self.chosen.get(k, 0) + 1
        self._rounds += 1
        return k

    def _choose(
        self,
        bucket: int,
        remaining: Sequence[int] | None,
        in_rounds: bool,
        beside: Sequence[int],
        share: float,
    ) -> int:
        if not self.adaptive:
            return self.max_k
        if self._hold and self._hold[1] > 0:
            self._hold[1] -= 1
            return self._hold[0]
        # Every arm runs `explore_run` steps in a row first, then again in turn now and then.
        arms = self.arms
        # Synchronous steps (`side_budget`) try the largest K first, so that the first steps of
        # short requests draft (device rounds start cheap, from K = 0); once one bucket has
        # every arm measured, another bucket measures only its cheapest arm first and
        # estimates the others from that bucket's cost ratios (`step_seconds`) until the one
        # chosen is measured.
        initial = arms if self.side_budget is None else arms[::-1]
        if self.side_budget is not None and self._reference(bucket) is not None:
            initial = arms[:1]
        for k in initial:
            if self._tried.get((bucket, k), 0) < self.explore_run:
                self._tried[(bucket, k)] = self._tried.get((bucket, k), 0) + 1
                return k
        # From K = 0 on synchronous steps, a drafting arm first pays the drafter's catch-up.
        entry = {k: self.catch_up_seconds(bucket, k) if self._behind else 0.0 for k in arms}
        if remaining:
            ordered, floor = sorted(remaining), max(beside, default=0)
            finish = {
                k: self._seconds_to_finish(bucket, k, ordered, in_rounds, floor) + entry[k]
                for k in arms
            }
            best = min(arms, key=finish.__getitem__)
            drafts_pay = finish[best] < (1 - self.margin) * finish.get(0, finish[best])
        else:
            rates = {
                k: self.tokens_per_second(bucket, k, entry[k] / self.explore_every, share)
                for k in arms
            }
            best = max(arms, key=rates.__getitem__)
            drafts_pay = rates[best] > (1 + self.margin) * rates.get(0, rates[best])
        if best > 0 and self.margin and self._measured(bucket, 0) is not None and not drafts_pay:
            best = 0  # within the margin of K = 0: not worth a draft (see `margin`)
        if self._rounds % self.explore_every == 0:
            others = [k for k in arms if k != best and self._may_explore(bucket, k, in_rounds)]
            if others:
                k = others[(self._rounds // self.explore_every) % len(others)]
                if (k == PLAIN) == in_rounds:
                    self._credit -= self.round_trip_seconds(bucket)
                elif self.side_budget is not None:
                    self._side_credit -= self.exploration_loss(bucket, k, best)
                self._hold = [k, self.explore_run - 1]
                return k
        return best

    def _may_explore(self, bucket: int, k: int, in_rounds: bool) -> bool:
        """Whether arm k may be explored now: on the batch's side of the rounds' border always;
        across it once the exploration credit covers the way there and back."""
        if (k == PLAIN) == in_rounds:
            return self._credit >= self.round_trip_seconds(bucket)
        if self.side_budget is None:
            return True
        loss = self.exploration_loss(bucket, k, self._best(bucket))
        self._side_credit = min(self._side_credit, 2 * loss)  # at most two explorations banked
        return self._side_credit >= loss

    def _best(self, bucket: int) -> int:
        """The arm of most expected tokens per second at `bucket` (unmeasured arms first)."""
        return max(self.arms, key=lambda k: self.tokens_per_second(bucket, k))

    def exploration_loss(self, bucket: int, k: int, best: int) -> float:
        """The seconds that `explore_run` steps of arm k are expected to lose against arm
        `best`: their cost less the time `best` takes to emit their expected tokens (0 when
        either has no estimate at `bucket`)."""
        cost, rate = self.step_seconds(bucket, k), self.tokens_per_second(bucket, best)
        if cost is None or math.isinf(rate):
            return 0.0
        loss = self.explore_run * max(cost - self.expected_tokens(k) / rate, 0.0)
        if (k > 0) != (best > 0):  # one catch-up: entering k, or going back to best
            loss += self.catch_up_seconds(bucket, max(k, best))
        return loss

    def catch_up_seconds(self, bucket: int, k: int) -> float:
        """`side_budget` only: the expected extra cost of a step of arm k > 0 at `bucket` that
        drafts after K = 0 steps (the drafter's catch-up on the entries they left it): the
        median of such steps' measured cost over their arm's, as a share of it, times the cost
        of k here (0 before any is measured)."""
        if k <= 0 or self.side_budget is None:
            return 0.0
        cost = self.step_seconds(bucket, k)
        shares = [
            seconds / base - 1.0
            for (b, j, seconds) in self._catch_ups
            if (base := self.step_seconds(b, j))
        ]
        if cost is None or not shares:
            return 0.0
        return max(statistics.median(shares), 0.0) * cost

    def _measured(self, bucket: int, k: int) -> float | None:
        cost = self._costs.get((bucket, k))
        return cost.seconds if cost is not None and cost.recent else None

    def _reference(self, bucket: int) -> int | None:
        """`side_budget` only: the bucket nearest `bucket` (in ratio) other than it with every
        arm measured, whose cost ratios stand in for arms not measured at `bucket`."""
        complete = {
            b
            for (b, _) in self._costs
            if b != bucket and all(self._measured(b, k) for k in self.arms)
        }
        return min(complete, key=lambda b: abs(math.log(b / bucket)), default=None)

    def step_seconds(self, bucket: int, k: int) -> float | None:
        """The cost of a step of arm k at `bucket`: measured there, or (`side_budget`) the
        reference bucket's cost of k scaled by the ratio of an arm measured at both (1 when
        none is measured here yet: only ratios between arms matter); None: no estimate."""
        measured = self._measured(bucket, k)
        if measured is not None or self.side_budget is None:
            return measured
        reference = self._reference(bucket)
        if reference is None:
            return None
        ratios = [
            here / self._measured(reference, j)
            for j in self.arms
            if (here := self._measured(bucket, j)) is not None
        ]
        scale = statistics.median(ratios) if ratios else 1.0
        return self._measured(reference, k) * scale

    # ------------------------------------------------------------------ the model
    def acceptance(self, i: int) -> float:
        """The running acceptance of draft i (0-based) given drafts before it were accepted:
        within `choose` with its requests, theirs (`request_acceptance`, averaged); otherwise
        pooled over every request (optimistic 1 before any round has offered it, so that
        speculation is tried)."""
        if self._view is not None:
            return self._view[i]
        return self._pooled(i)

    def _pooled(self, i: int) -> float:
        if self._offered[i] <= 0:
            return 1.0
        return self._accepted[i] / self._offered[i]

    def request_acceptance(self, request_id: str) -> list[float]:
        """Request `request_id`'s running acceptance of drafts 0..max_k - 1: its own decayed
        counts with the pooled acceptance as `REQUEST_PRIOR_ROUNDS` rounds of prior."""
        return self._mean_acceptance([request_id])

    def _mean_acceptance(self, requests: Sequence[str]) -> list[float]:
        """The mean of `requests`' running acceptance (`request_acceptance`) by position."""
        pooled = [self._pooled(i) for i in range(self.max_k)]
        prior = REQUEST_PRIOR_ROUNDS
        sums, alone = [0.0] * self.max_k, 0
        for request_id in requests:
            own = self._requests.get(request_id)
            if own is None:
                alone += 1
                continue
            offered, accepted = own
            for i, share in enumerate(pooled):
                sums[i] += (accepted[i] + prior * share) / (offered[i] + prior)
        count = len(requests)
        return [(total + alone * share) / count for total, share in zip(sums, pooled, strict=True)]

    def forget(self, request_id: str) -> None:
        """Drops a finished request's own acceptance."""
        self._requests.pop(request_id, None)

    def round_tokens(self, k: int) -> tuple[float, float]:
        """(mean, variance) of the tokens a step of arm k emits per request: 1 + the accepted
        drafts (P(X > i) = a_1 ... a_i); PLAIN: exactly 1."""
        mean, second, survive = 1.0, 1.0, 1.0
        for i in range(max(k, 0)):
            survive *= self.acceptance(i)
            mean += survive
            second += (2 * i + 3) * survive  # E[X^2] = sum over j >= 1 of (2j - 1) P(X >= j)
        return mean, max(second - mean * mean, 0.0)

    def expected_tokens(self, k: int) -> float:
        """1 + sum over i <= k of the chance that drafts 1..i are all accepted (PLAIN: 1)."""
        return self.round_tokens(k)[0]

    def expected_steps(self, k: int, remaining: Sequence[int]) -> float:
        """The expected number of steps of arm k until the last of the requests with
        `remaining` tokens to emit has emitted them (see the module docstring)."""
        return self._expected_steps(k, sorted(remaining))

    def _expected_steps(self, k: int, ordered: list[int]) -> float:
        longest = ordered[-1]
        mean, variance = self.round_tokens(k)
        if variance <= 0.0:
            return float(longest) / mean
        spread = math.sqrt(longest * variance / mean**3)  # standard deviation of the rounds
        contenders = len(ordered) - bisect.bisect_left(ordered, longest - 2 * mean * spread)
        steps = longest / mean + (variance / mean**2) / 2  # renewal: the last round's overshoot
        if contenders > 1:  # the largest of whole numbers of rounds: half a round above
            steps += 0.5 + expected_max_normal(contenders) * spread
        return steps

    def switch_seconds(self, bucket: int, k: int, in_rounds: bool) -> float:
        """The measured cost of moving to arm k: entering the rounds (from outside), or
        leaving them for PLAIN (about one plain step of overlap lost); 0 when on its side."""
        if k != PLAIN and not in_rounds:
            entries = self._entry.get(bucket)
            return statistics.median(entries) if entries else 0.0
        if k == PLAIN and in_rounds:
            cost = self._costs.get((bucket, PLAIN))
            return cost.seconds if cost is not None and cost.recent else 0.0
        return 0.0

    def round_trip_seconds(self, bucket: int) -> float:
        """The measured cost of leaving the rounds for PLAIN and entering them again."""
        return self.switch_seconds(bucket, 0, False) + self.switch_seconds(bucket, PLAIN, True)

    def seconds_to_finish(
        self, bucket: int, k: int, remaining: Sequence[int], in_rounds: bool, floor: int = 0
    ) -> float:
        """The expected seconds until the batch has emitted `remaining` with arm k from now on,
        in at least `floor` steps (a request beside the rounds emits one token a step; 0 when
        k was never measured here: worth measuring)."""
        return self._seconds_to_finish(bucket, k, sorted(remaining), in_rounds, floor)

    def _seconds_to_finish(
        self, bucket: int, k: int, ordered: list[int], in_rounds: bool, floor: int = 0
    ) -> float:
        cost = self.step_seconds(bucket, k)
        if cost is None:
            return 0.0
        steps = max(self._expected_steps(k, ordered), floor)
        return self.switch_seconds(bucket, k, in_rounds) + steps * cost

    def tokens_per_second(
        self, bucket: int, k: int, extra: float = 0.0, beside: float = 0.0
    ) -> float:
        """Expected tokens a step of arm k emits per second of it (plus `extra` seconds), per
        request of the step; `beside`: rows decoding beside it per request, one token each."""
        cost = self.step_seconds(bucket, k)
        if cost is None:
            return float("inf")  # not measured yet: worth measuring
        return (self.expected_tokens(k) + beside) / max(cost + extra, 1e-9)

    def costs(self) -> dict[tuple[int, int], tuple[float, int]]:
        """(bucket, K) -> (estimated seconds of a step, measurements kept); (bucket, "entry")
        -> the estimated seconds of entering device rounds; (bucket, "catch_up") -> the
        estimated extra seconds of a max_k step after K = 0 steps (`catch_up_seconds`)."""
        out: dict = {key: (c.seconds, len(c.recent)) for key, c in self._costs.items() if c.recent}
        for bucket, entries in self._entry.items():
            out[(bucket, "entry")] = (statistics.median(entries), len(entries))
        if self._catch_ups:
            for bucket in {b for (b, k) in self._costs if k == self.max_k}:
                seconds = self.catch_up_seconds(bucket, self.max_k)
                out[(bucket, "catch_up")] = (seconds, len(self._catch_ups))
        return out

    # ------------------------------------------------------------------ measurements
    def observe_unmeasured(self, k: int) -> None:
        """`side_budget`: a synchronous step of arm k that is not measured (a prefill chunk in
        it) ran: a drafting one caught the drafter up, a K = 0 one left it behind."""
        self._behind = k <= 0

    def observe_entry(self, bucket: int, seconds: float) -> None:
        """Records the cost of one entry into device rounds at `bucket` (the drafter's
        catch-up on the tokens it has not seen)."""
        self._entry.setdefault(bucket, deque(maxlen=self.window)).append(seconds)

    def observe(
        self,
        bucket: int,
        k: int,
        seconds: float | None,
        outcomes: list[tuple[int, int]],
        interrupted: bool = False,
        requests: Sequence[str] | None = None,
    ) -> None:
        """Records a read step: its arm, its measured cost (None: not measured, the first step
        of a visit, or `interrupted`: other device work ran before it, inside the visit) and,
        for a round, per live request (drafts verified, drafts accepted), whose ids
        `requests` gives in the same order (None, or a round of more than
        `REQUEST_ACCEPTANCE_ROWS`: the pooled acceptance only)."""
        if self.side_budget is not None:
            if k > 0 and self._behind and seconds is not None:
                self._catch_ups.append((bucket, k, seconds))
            self._behind = k <= 0
        if (bucket, k) != self._visit or (seconds is None and not interrupted):
            self._visit, self._visit_measured = (bucket, k), 0  # a new visit to arm k
        if seconds is not None:  # credit for exploring, up to two round trips' worth
            cap = 2 * self.round_trip_seconds(bucket)
            self._credit = min(self._credit + self.explore_budget * seconds, cap)
            if self.side_budget is not None:
                self._side_credit += self.side_budget * seconds
            self._visit_measured += 1
            cost = self._costs.setdefault((bucket, k), _Cost(deque(maxlen=self.window)))
            if self._visit_measured > self.ramp:
                cost.add(seconds)
        if not outcomes:
            return
        # The round's counts per draft position (over its requests) enter the running sums
        # once: the acceptance follows the last rounds, not the last few rows of one batch.
        offered = [0] * self.max_k
        accepted_at = [0] * self.max_k
        decay = self.decay
        own = requests is not None and len(outcomes) <= REQUEST_ACCEPTANCE_ROWS
        ids = requests if own else [None] * len(outcomes)
        for request_id, (num_draft, accepted) in zip(ids, outcomes, strict=True):
            reached = min(num_draft, accepted + 1, self.max_k)
            for i in range(reached):
                offered[i] += 1
                accepted_at[i] += i < accepted
            if request_id is not None and reached:  # its own counts, decayed by its own rounds
                own_offered, own_accepted = self._requests.setdefault(
                    request_id, ([0.0] * self.max_k, [0.0] * self.max_k)
                )
                for i in range(reached):
                    own_offered[i] = (1 - decay) * own_offered[i] + 1
                    own_accepted[i] = (1 - decay) * own_accepted[i] + (i < accepted)
        for i in range(self.max_k):
            if offered[i]:
                self._offered[i] = (1 - decay) * self._offered[i] + decay * offered[i]
                self._accepted[i] = (1 - decay) * self._accepted[i] + decay * accepted_at[i]
