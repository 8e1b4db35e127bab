"""Speculative-decoding statistics with vLLM's definitions (per request and per engine).

- num_drafts: verification rounds that carried at least one draft;
- num_draft_tokens / num_accepted_tokens: drafts proposed / accepted;
- accepted_per_position[i]: rounds whose accepted prefix is longer than i (unconditional);
- mean acceptance length = 1 + accepted / drafts (counts the bonus or recovered token);
- acceptance rate = accepted / draft tokens.
Pure bookkeeping: no tensors, no randomness.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class SpecDecodeStats:
    """Counters for one request or a whole engine; `observe` once per verification round."""

    num_spec_tokens: int = 0
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    def observe(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        """Records one round with `num_draft_tokens` drafts of which the first
        `num_accepted_tokens` were accepted. Rounds without drafts are not counted."""
        if not 0 <= num_accepted_tokens <= num_draft_tokens:
            raise ValueError(
                f"accepted ({num_accepted_tokens}) must lie in [0, drafts={num_draft_tokens}]"
            )
        if num_draft_tokens == 0:
            return
        if num_draft_tokens > len(self.accepted_per_position):
            grow = num_draft_tokens - len(self.accepted_per_position)
            self.accepted_per_position.extend([0] * grow)
            self.num_spec_tokens = len(self.accepted_per_position)
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted_tokens
        for i in range(num_accepted_tokens):
            self.accepted_per_position[i] += 1

    def merge(self, other: SpecDecodeStats) -> None:
        """Adds another set of counters into this one."""
        if len(other.accepted_per_position) > len(self.accepted_per_position):
            grow = len(other.accepted_per_position) - len(self.accepted_per_position)
            self.accepted_per_position.extend([0] * grow)
            self.num_spec_tokens = len(self.accepted_per_position)
        self.num_drafts += other.num_drafts
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_tokens += other.num_accepted_tokens
        for i, count in enumerate(other.accepted_per_position):
            self.accepted_per_position[i] += count

    @property
    def mean_acceptance_length(self) -> float:
        """1 + accepted / drafts (vLLM's definition, bonus token included); 1.0 with no drafts."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0

    @property
    def acceptance_rate(self) -> float:
        """accepted / draft tokens; 0.0 with no drafts."""
        if not self.num_draft_tokens:
            return 0.0
        return self.num_accepted_tokens / self.num_draft_tokens

    @property
    def acceptance_per_position(self) -> list[float]:
        """Unconditional rate P(accepted length > i) for each draft position i."""
        if not self.num_drafts:
            return [0.0] * len(self.accepted_per_position)
        return [count / self.num_drafts for count in self.accepted_per_position]

    def as_dict(self) -> dict:
        return {
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "accepted_per_position": list(self.accepted_per_position),
            "mean_acceptance_length": self.mean_acceptance_length,
            "acceptance_rate": self.acceptance_rate,
            "acceptance_per_position": self.acceptance_per_position,
        }


# The kinds of query rows `LoopStats.rows` counts.
ROW_KINDS = ("prefill", "plain", "speculative")


@dataclass(slots=True)
class LoopStats:
    """Which path served an engine's steps (so a user sees what ran):

    - num_overlapped_steps: plain steps launched before the previous step was read;
    - num_overlapped_prefill_steps: those of them that held prefill chunks (requests joining
      the overlapped loop without draining it);
    - num_device_rounds: speculative rounds run on the device, each launched before the
      previous one was read;
    - num_graph_rounds: those of them replayed from CUDA graphs;
    - num_round_joins: requests that joined running device rounds without draining them
      (their prefill in overlapped steps between two rounds, then a slot of the rounds);
    - num_side_rows: decode rows of requests the rounds cannot take (a grammar, a multi-token
      bad word, speculation off), run beside them in the overlapped steps between two rounds;
    - num_sync_steps: steps of the synchronous path;
    - num_graphed_prefill_steps: steps (synchronous or overlapped) that ran prefill chunks on
      the decode path's CUDA graphs (`EngineConfig.prefill_graph_tokens`);
    - num_plain_arm_steps: plain overlapped decode steps the speculation policy chose (its arm
      P) for speculative requests, counted in num_overlapped_steps too;
    - k_chosen: device rounds per K (the policy's choice; 0 = a round of no drafts; -1 = the
      plain arm's steps);
    - rows: the target's query rows by kind, over every path: "prefill" (prompt chunks and
      recomputed prefixes), "plain" (decode rows without drafts) and "speculative" (verify rows:
      a request's last token and its drafts).
    """

    num_overlapped_steps: int = 0
    num_overlapped_prefill_steps: int = 0
    num_device_rounds: int = 0
    num_graph_rounds: int = 0
    num_round_joins: int = 0
    num_side_rows: int = 0
    num_sync_steps: int = 0
    num_graphed_prefill_steps: int = 0
    num_plain_arm_steps: int = 0
    k_chosen: dict[int, int] = field(default_factory=dict)
    rows: dict[str, int] = field(default_factory=lambda: dict.fromkeys(ROW_KINDS, 0))

    def observe_round(self, k: int, graphed: bool, num_requests: int) -> None:
        """A device round of `k` drafts for `num_requests` live requests."""
        self.num_device_rounds += 1
        self.num_graph_rounds += int(graphed)
        self.k_chosen[k] = self.k_chosen.get(k, 0) + 1
        self.rows["speculative" if k > 0 else "plain"] += num_requests * (k + 1)

    def observe_rows(self, prefill: int = 0, plain: int = 0, speculative: int = 0) -> None:
        """Query rows a step gave the target, by kind."""
        self.rows["prefill"] += prefill
        self.rows["plain"] += plain
        self.rows["speculative"] += speculative

    def observe_plain_arm(self) -> None:
        self.num_plain_arm_steps += 1
        self.k_chosen[-1] = self.k_chosen.get(-1, 0) + 1

    def as_dict(self) -> dict:
        return {
            "num_overlapped_steps": self.num_overlapped_steps,
            "num_overlapped_prefill_steps": self.num_overlapped_prefill_steps,
            "num_device_rounds": self.num_device_rounds,
            "num_graph_rounds": self.num_graph_rounds,
            "num_round_joins": self.num_round_joins,
            "num_side_rows": self.num_side_rows,
            "num_sync_steps": self.num_sync_steps,
            "num_graphed_prefill_steps": self.num_graphed_prefill_steps,
            "num_plain_arm_steps": self.num_plain_arm_steps,
            "k_chosen": dict(sorted(self.k_chosen.items())),
            "rows": dict(self.rows),
        }
