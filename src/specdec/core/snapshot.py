"""What the server reports of an engine (`EngineSnapshot`, taken by `snapshot_of` after each
iteration of the engine's loop) and `EngineDeadError`. Plain data; never touches requests."""

from __future__ import annotations

from dataclasses import dataclass, field


class EngineDeadError(RuntimeError):
    """The engine failed in `step()`; the requests in flight were aborted."""


@dataclass(frozen=True, slots=True)
class EngineSnapshot:
    """Engine figures read by `/metrics`, taken by the engine thread after each iteration."""

    num_waiting: int = 0
    num_running: int = 0
    num_blocks: int = 0
    num_free_blocks: int = 0
    kv_cache_usage: float = 0.0
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: tuple[int, ...] = field(default_factory=tuple)
    num_preemptions: int = 0
    num_overlapped_steps: int = 0
    num_overlapped_prefill_steps: int = 0
    num_plain_arm_steps: int = 0
    num_device_rounds: int = 0
    num_graph_rounds: int = 0
    num_round_joins: int = 0
    num_side_rows: int = 0
    num_sync_steps: int = 0
    num_graphed_prefill_steps: int = 0
    k_chosen: tuple[tuple[int, int], ...] = field(default_factory=tuple)  # (K, rounds)
    rows: tuple[tuple[str, int], ...] = field(default_factory=tuple)  # (kind, query rows)
    graphs_after_warm_up: int = 0
    # (kernel, variants) compiled after the warm-up; None: not counted (no Triton hook)
    triton_compiles_after_warm_up: tuple[tuple[str, int], ...] | None = None
    # the speculation policy's estimates: (batch bucket, arm, seconds) per step cost ("entry":
    # entering device rounds; "catch_up": a drafted step's extra cost after K = 0 steps), and
    # the running acceptance per draft position
    policy_seconds: tuple[tuple[int, str, float], ...] = field(default_factory=tuple)
    policy_acceptance: tuple[float, ...] = field(default_factory=tuple)


def snapshot_of(engine) -> EngineSnapshot:
    """The `/metrics` figures of `engine` now."""
    stats = engine.stats
    allocator = engine.allocator
    loop = engine.loop_stats
    compiles = engine.triton_compiles_after_warm_up
    return EngineSnapshot(
        num_waiting=len(engine.scheduler.waiting),
        num_running=len(engine.scheduler.running),
        num_blocks=allocator.num_blocks,
        num_free_blocks=allocator.num_free_blocks,
        kv_cache_usage=float(allocator.usage),
        num_drafts=stats.num_drafts,
        num_draft_tokens=stats.num_draft_tokens,
        num_accepted_tokens=stats.num_accepted_tokens,
        accepted_per_position=tuple(stats.accepted_per_position),
        num_preemptions=engine.num_preemptions,
        num_overlapped_steps=loop.num_overlapped_steps,
        num_overlapped_prefill_steps=loop.num_overlapped_prefill_steps,
        num_plain_arm_steps=loop.num_plain_arm_steps,
        num_device_rounds=loop.num_device_rounds,
        num_graph_rounds=loop.num_graph_rounds,
        num_round_joins=loop.num_round_joins,
        num_side_rows=loop.num_side_rows,
        num_sync_steps=loop.num_sync_steps,
        num_graphed_prefill_steps=loop.num_graphed_prefill_steps,
        k_chosen=tuple(sorted(loop.k_chosen.items())),
        rows=tuple(loop.rows.items()),
        graphs_after_warm_up=engine.graphs_after_warm_up,
        triton_compiles_after_warm_up=None if compiles is None else tuple(sorted(compiles.items())),
        policy_seconds=policy_seconds(engine.policy),
        policy_acceptance=policy_acceptance(engine.policy),
    )


def policy_seconds(policy) -> tuple[tuple[int, str, float], ...]:
    """The policy's cost estimates, (bucket, arm, seconds), sorted (none without a policy)."""
    if policy is None:
        return ()
    return tuple(
        sorted(
            (bucket, str(arm), seconds) for (bucket, arm), (seconds, _) in policy.costs().items()
        )
    )


def policy_acceptance(policy) -> tuple[float, ...]:
    """The policy's running acceptance of each draft position (none without a policy)."""
    if policy is None:
        return ()
    return tuple(policy.acceptance(i) for i in range(policy.max_k))
