"""How many drafts each device round proposes: a cost model that never lets speculation lose.

For each candidate K (0 = plain decoding) the policy keeps the measured cost of a round at each
batch bucket and the running acceptance of draft position i (the rate at which draft i is
accepted given drafts before it were), and picks the K that maximises expected tokens per
second: (1 + a_1 + a_1 a_2 + ... + a_1...a_K) / cost(K). Costs are measured on the rounds
themselves, in steady state (a round's cost runs from the previous round's end to its own, so
the first round of a visit, which has no previous one, is not measured), as the median of the
last `window` measurements (robust to a graph capture or a pause inside one); each candidate is
tried at the start and again now and then (`explore_every`) for `explore_run` rounds in a row,
so that it is measured in steady state and the choice follows the acceptance and the context
length as they change.

With `plain_arm`, one more arm, P (`PLAIN`, recorded as K = -1), stands beside K = 0..max_k: a
step of the plain overlapped decode loop (no drafter work at all), whose cost is measured on those
steps and whose expected tokens are 1. While P is best the engine leaves device rounds; the
policy is then asked before every plain step, so the other arms are still re-explored.

Non-anticipating: a round's K is chosen at its launch from rounds already read, so it depends
only on tokens emitted before the round's drafts are drawn; each round is an exact speculative
step whatever its K. Deterministic given its measurements; draws no randomness.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field

PLAIN = -1  # the plain arm: a plain overlapped decode step, outside device rounds


@dataclass(slots=True)
class _Cost:
    """A K's cost at one bucket: the `recent` kept measurements (of `observed` read)."""

    recent: deque[float]
    observed: int = 0

    @property
    def seconds(self) -> float:
        return statistics.median(self.recent)


@dataclass(slots=True)
class SpeculationPolicy:
    """Chooses K in [0, max_k] (or PLAIN, with `plain_arm`) per round (or always max_k when
    not `adaptive`).

    Attributes:
        max_k: the largest K (the configured num_speculative_tokens).
        adaptive: False pins K to max_k (and never offers PLAIN).
        plain_arm: offer the arm PLAIN (a plain decode step) beside K = 0..max_k.
        explore_every: rounds between two re-measurements of a K other than the best.
        explore_run: rounds in a row an arm runs when it is explored.
        window: measurements of a cost kept (its estimate is their median).
        decay: weight of the newest round in the running acceptance.
    """

    max_k: int
    adaptive: bool = True
    plain_arm: bool = False
    explore_every: int = 48
    explore_run: int = 3
    window: int = 8
    decay: float = 0.1
    _costs: dict[tuple[int, int], _Cost] = field(default_factory=dict)
    _tried: dict[tuple[int, int], int] = field(default_factory=dict)
    _offered: list[float] = field(default_factory=list)  # rows that reached draft i
    _accepted: list[float] = field(default_factory=list)  # ... and accepted it
    _rounds: int = 0
    _hold: list[int] = field(default_factory=list)  # [arm, choices left] of an exploration
    chosen: dict[int, int] = field(default_factory=dict)  # K (PLAIN: -1) -> times chosen

    def __post_init__(self) -> None:
        self._offered = [0.0] * self.max_k
        self._accepted = [0.0] * self.max_k

    @property
    def arms(self) -> list[int]:
        """The candidates: K = 0..max_k, and PLAIN first with `plain_arm`."""
        plain = [PLAIN] if self.plain_arm and self.adaptive else []
        return plain + list(range(self.max_k + 1))

    def choose(self, bucket: int) -> int:
        """The K of the next round (or step, PLAIN) of `bucket` slots."""
        k = self._choose(bucket)
        self.chosen[k] = self.chosen.get(k, 0) + 1
        self._rounds += 1
        return k

    def _choose(self, bucket: int) -> int:
        if not self.adaptive:
            return self.max_k
        if self._hold and self._hold[1] > 0:
            self._hold[1] -= 1
            return self._hold[0]
        # Every arm runs `explore_run` rounds in a row first (the first measurement of a graph
        # includes its capture, so it is not kept), then again in turn every `explore_every`.
        arms = self.arms
        for k in arms:
            if self._tried.get((bucket, k), 0) < self.explore_run:
                self._tried[(bucket, k)] = self._tried.get((bucket, k), 0) + 1
                return k
        best = max(arms, key=lambda k: self.tokens_per_second(bucket, k))
        if self._rounds % self.explore_every == 0:
            others = [k for k in arms if k != best]
            if others:
                k = others[(self._rounds // self.explore_every) % len(others)]
                self._hold = [k, self.explore_run - 1]
                return k
        return best

    def expected_tokens(self, k: int) -> float:
        """1 + sum over i <= k of the chance that drafts 1..i are all accepted (PLAIN: 1)."""
        total, survive = 1.0, 1.0
        for i in range(max(k, 0)):
            survive *= self.acceptance(i)
            total += survive
        return total

    def acceptance(self, i: int) -> float:
        """The running acceptance of draft i (0-based) given drafts before it were accepted
        (optimistic 1 before any round has offered it, so that speculation is tried)."""
        if self._offered[i] <= 0:
            return 1.0
        return self._accepted[i] / self._offered[i]

    def tokens_per_second(self, bucket: int, k: int) -> float:
        cost = self._costs.get((bucket, k))
        if cost is None or not cost.recent:
            return float("inf")  # not measured yet: worth measuring
        return self.expected_tokens(k) / max(cost.seconds, 1e-9)

    def costs(self) -> dict[tuple[int, int], tuple[float, int]]:
        """(bucket, K) -> (estimated seconds of a round, measurements kept)."""
        return {key: (c.seconds, len(c.recent)) for key, c in self._costs.items() if c.recent}

    def observe(
        self, bucket: int, k: int, seconds: float | None, outcomes: list[tuple[int, int]]
    ) -> None:
        """Records a read round: its K, its measured cost (None: not measured, e.g. the first
        round of a visit) and per live request (drafts verified, drafts accepted); a read plain
        step: K = PLAIN, its cost, no outcomes."""
        cost = self._costs.setdefault((bucket, k), _Cost(deque(maxlen=self.window)))
        if seconds is not None:
            cost.observed += 1
            if cost.observed > 1:  # the first one includes the capture
                cost.recent.append(seconds)
        if not outcomes:
            return
        # The round's counts per draft position (over its requests) enter the running sums
        # once: the acceptance follows the last rounds, not the last few rows of one batch.
        offered = [0] * self.max_k
        accepted_at = [0] * self.max_k
        for num_draft, accepted in outcomes:
            for i in range(min(num_draft, accepted + 1, self.max_k)):
                offered[i] += 1
                accepted_at[i] += i < accepted
        decay = self.decay
        for i in range(self.max_k):
            if offered[i]:
                self._offered[i] = (1 - decay) * self._offered[i] + decay * offered[i]
                self._accepted[i] = (1 - decay) * self._accepted[i] + decay * accepted_at[i]
