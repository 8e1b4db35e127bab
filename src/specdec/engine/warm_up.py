"""The engine's warm-up: every step shape it takes under traffic, run once at start-up on inert
inputs, so that each CUDA graph is captured before the first request rather than in its middle.

Design: the shapes are run through the calls traffic makes, so that each `GraphCache` builds the
key traffic would build (a key is never spelled out here):
- the target's decode path (`PagedModelRunner.run_with_features`, tensor-parallel workers
  included) at every batch bucket: plain decode (Q = 1), verify (Q = K + 1, a tree's N + 1 under
  its mask) and graphed-prefill last-row steps, each with the feature layers the drafter reads,
  and again over a context past one split-KV partition where max_model_len allows one (the
  split-KV variant a step picks at long context). Every row is live (the step's own padding
  adds the rest) and writes K/V of token 0 into block 0, a free block: the engine must be idle,
  and the allocator is never touched, so no block stays allocated and no request sees those
  slots (a request reads only slots it wrote);
- device rounds (`DeviceRounds.warm_up`) at every bucket and every K the speculation policy
  may choose, for the default verify method without top-k / top-p / min-p (requests asking for
  another method or those filters capture their round on first use), without and with the
  slots' logits rules (penalties, biases, bans: a batch holding such a request runs the
  second), over slots none of which is live;
- the target's eager prefill (chunks longer than the graphed prefill's width, or wanting every
  row's logits: prompt logprobs), at a row count of every tier and value class its kernels
  compile a variant for (`models.row_classes`), one sequence and two, and as a chunk past one
  split-KV partition where max_model_len allows one, into the same free block:
  nothing is captured there, but each Triton variant compiles now rather than under traffic
  (counted after the warm-up by `specdec:triton_compiles_after_warm_up`);
- the drafter's own graphs and eager steps (`Drafter.warm_up`: the EAGLE head's steps and its
  prompt catch-up; a draft model's own runner still captures on first use);
- on CUDA, the grammar bitmask kernel once over one row of the vocabulary (its one variant for
  this vocabulary: the first request with a grammar compiled it under traffic, s31), and the
  sampler's kernels as a plain step calls them (a `--no-spec` server compiled them on its first
  request, s32).
Dummy requests through the scheduler were the other way; they were not taken because the
speculation policy would then measure capture times as step costs, and would pick the Ks it
visits. No request, request state, seed or stream exists during the warm-up, so no request's
randomness is drawn (the RNG is keyed by request seed and position), and the request counters
and the policy see nothing. It samples inert rows only (`_sample_steps`). Where nothing is
captured (the CPU, enforce_eager) it is skipped unless asked for (tests check the keys it
visits through `GraphCache.keys`).
On the CPU the one thing done is to build (once per machine) or load the decode step's C++ loop
(`models.decode_cpu_native`), which its first step would otherwise do.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any  # the engine: an `LLMEngine` (not imported: it imports this module)

import torch

from specdec.models.attention_tiles import SPLIT_KV_PARTITION
from specdec.models.row_classes import eager_row_counts
from specdec.models.split_kv import split_when_seen
from specdec.runner import StepInput
from specdec.runner.cuda_graph import GraphCache, batch_buckets
from specdec.sampling import sample
from specdec.sampling.bitmask import apply_bitmask
from specdec.sampling.grammar import bitmask_words

# The block every warm-up row writes its K/V into (any block will do: all are free).
WARM_UP_BLOCK = 0


@dataclass(frozen=True, slots=True)
class WarmUpReport:
    """What a warm-up did.

    Attributes:
        num_graphs: CUDA graphs captured.
        num_steps: step shapes run (graphed or not).
        seconds: wall time.
        skipped: why nothing ran (None: it ran).
    """

    num_graphs: int
    num_steps: int
    seconds: float
    skipped: str | None = None

    def line(self) -> str:
        """The one log line of a warm-up."""
        if self.skipped is not None:
            return f"warm-up: skipped ({self.skipped})"
        if self.num_graphs:
            return f"warm-up: captured {self.num_graphs} graphs in {self.seconds:.1f} s"
        return (
            f"warm-up: ran {self.num_steps} step shapes in {self.seconds:.1f} s (no CUDA graphs "
            "captured)"
        )


def nothing_to_capture(engine: Any) -> str | None:
    """Why the engine has no CUDA graph to capture (None: it has)."""
    if engine.config.enforce_eager:
        return "enforce_eager: no CUDA graphs to capture"
    if engine.device.type != "cuda":
        return f"no CUDA graphs to capture on the {engine.device.type.upper()}"
    if engine.runner.graphs is None:
        return "this model has no decode path: every step runs eagerly"
    return None


def warm_up(engine: Any, *, force: bool = False, progress: bool | None = None) -> WarmUpReport:
    """Runs every step shape `engine` takes under traffic once (see the module docstring).

    Args:
        engine: an idle engine (no request added or unfinished).
        force: run the shapes where nothing is captured too (the CPU, enforce_eager: each
            step then runs op by op, at its full cost).
        progress: a progress bar on stderr (None: when stderr is a terminal).

    Returns: what was done (`WarmUpReport.line()` says it in one line).

    Mutates: K/V slots of a free block; the decode path's, the rounds' and the drafter's
    static buffers (rewritten by every later step) and their graph caches; the runner's own
    step counters (the engine's counters, its deltas around its own steps, see nothing).

    Raises:
        RuntimeError: the engine holds requests.
    """
    if engine.has_unfinished or engine.groups:
        raise RuntimeError("the engine warms up only while it holds no request")
    if engine.device.type == "cpu" and engine.config.tensor_parallel_size == 1:
        # The CPU decode step's C++ loop, built (once per machine) or loaded now rather than
        # at the first request's first step (`models.decode_cpu_native`).
        engine.model.model.prepare_native_layers()
    reason = nothing_to_capture(engine)
    if reason is not None and not (force and engine.runner.graphs is not None):
        return WarmUpReport(0, 0, 0.0, skipped=reason)
    started = time.perf_counter()
    steps = _decode_steps(engine) + _round_steps(engine) + _eager_steps(engine)
    steps += _mask_steps(engine) + _sample_steps(engine)
    caches = _caches(engine)
    before = sum(len(cache.graphs) for cache in caches)
    if progress is None:
        progress = sys.stderr.isatty()
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(steps) + 1, desc="warm-up", unit="shape", file=sys.stderr)
    drafter_graphs = 0
    try:
        for step in steps:
            step()
            if bar is not None:
                bar.update()
        if engine.drafter is not None:
            drafter_graphs = engine.drafter.warm_up()
        if bar is not None:
            bar.update()
        if engine.device.type == "cuda":
            torch.cuda.synchronize(engine.device)
    finally:
        if bar is not None:
            bar.close()
    captured = sum(len(cache.graphs) for cache in _caches(engine)) - before + drafter_graphs
    return WarmUpReport(captured, len(steps) + 1, time.perf_counter() - started)


def count_graphs(engine: Any) -> int:
    """The CUDA graphs `engine` holds now: its decode path's, its device rounds', its drafter's."""
    drafter = engine.drafter
    own = drafter.num_graphs() if drafter is not None else 0
    return sum(len(cache.graphs) for cache in _caches(engine)) + own


def _caches(engine: Any) -> list[GraphCache]:
    """The engine's own graph caches (the drafter counts its own; none on the CPU)."""
    graphs = getattr(engine.runner, "graphs", None)
    caches = [] if graphs is None else [graphs.graph_cache]
    if engine._rounds is not None:
        caches.append(engine._rounds.graph_cache)
    return caches


def _decode_steps(engine: Any) -> list[Callable[[], None]]:
    """One call per (bucket, shape, split-KV or not) of the target's decode path."""
    graphs, runner = engine.runner.graphs, engine.runner
    drafter = engine.drafter
    layers = tuple(drafter.feature_layers) if drafter is not None else ()
    tree = engine.speculative_config is not None and engine.speculative_config.tree is not None
    # (query tokens a row, logit rows wanted, tree parents): plain decode, verify, last rows
    shapes: list[tuple[int, int, list[int] | None]] = [(1, 1, None)]
    width = graphs.max_query_len
    if width > 1:
        parents = list(range(-1, width - 2)) if tree else None  # a chain, as a tree
        shapes.append((width, width, parents))
    if graphs.prefill_width > 1 and engine.scheduler.config.prefill_graph_tokens:
        shapes.append((graphs.prefill_width, 1, None))
    # Contexts a step may hold: short, and past one split-KV partition where that fits.
    longest = SPLIT_KV_PARTITION + 1
    long_fits = longest <= engine.max_model_len
    contexts = (
        [None, longest] if long_fits and split_when_seen(longest, graphs.num_partitions) else [None]
    )
    block_size = engine.config.block_size
    steps = []
    for bucket in batch_buckets(engine.config.max_num_seqs):
        for count, logit_rows, parents in shapes:
            for context in contexts:
                end = count if context is None else context
                row = StepInput(
                    [0] * count,
                    end - count,
                    [WARM_UP_BLOCK] * -(-end // block_size),
                    logit_rows,
                    parents,
                )
                inputs = [row] * bucket
                steps.append(lambda inputs=inputs: runner.run_with_features(inputs, layers))
    return steps


def _eager_steps(engine: Any) -> list[Callable[[], None]]:
    """One call per step of `eager_inputs`."""
    runner, drafter = engine.runner, engine.drafter
    layers = tuple(drafter.feature_layers) if drafter is not None else ()
    return [
        lambda inputs=inputs: runner.run_with_features(inputs, layers)
        for inputs in eager_inputs(engine)
    ]


def eager_inputs(engine: Any) -> list[list[StepInput]]:
    """The steps of the target's eager prefill the warm-up runs: a sample of every row tier and
    value class up to the longest chunk a step may hold (`row_classes`), in one sequence and
    split over two, wanting the last row's logits or every row's; and each tier once more as a
    chunk that continues a prompt past one split-KV partition, where max_model_len allows one.
    Its block table is then wider than a partition, so the prefill attention kernel runs its
    partitioned variant (`attention_tiles.kernel_partition`, a constexpr): without this step,
    Triton compiled that variant for the first long prompt under traffic (s40, H100)."""
    graphs = engine.runner.graphs
    longest = min(engine.config.max_num_batched_tokens, engine.max_model_len)
    block_size = engine.config.block_size
    # A sequence this long never takes the decode path's graphs (plain, verify or prefill).
    shortest = max(graphs.prefill_width, graphs.max_query_len) + 1

    def row(count: int, logit_rows: int, start: int = 0) -> StepInput:
        blocks = [WARM_UP_BLOCK] * -(-(start + count) // block_size)
        return StepInput([0] * count, start, blocks, logit_rows, None)

    steps = []
    for count in eager_row_counts(longest):
        if count < shortest:
            continue
        splits = [[count]]
        if count // 2 >= shortest:
            splits.append([count - count // 2, count // 2])
        for split in splits:
            for all_rows in (False, True):
                steps.append([row(n, n if all_rows else 1) for n in split])
        if SPLIT_KV_PARTITION + 1 + count <= engine.max_model_len:
            steps.append([row(count, 1, start=SPLIT_KV_PARTITION + 1)])
    return steps


def _mask_steps(engine: Any) -> list[Callable[[], None]]:
    """On CUDA, one call of the grammar bitmask kernel as a constrained step makes it (float32
    rows of the vocabulary, one int32 mask word per 32 tokens), every token allowed; none
    elsewhere (the CPU masks in PyTorch)."""
    device = engine.device
    if device.type != "cuda":
        return []
    vocab = engine.model_config.vocab_size

    def step() -> None:
        logits = torch.zeros(1, vocab, dtype=torch.float32, device=device)
        bitmask = torch.full((1, bitmask_words(vocab)), -1, dtype=torch.int32, device=device)
        apply_bitmask(logits, bitmask, torch.zeros(1, dtype=torch.int64, device=device))

    return [step]


def _sample_steps(engine: Any) -> list[Callable[[], None]]:
    """On CUDA, the sampler's Triton kernels as a plain step calls them (`Emitter.sample_rows`:
    float32 rows of the vocabulary, a per-row temperature, without filters and with top-k and
    top-p), over zero logits keyed by seed 0; none elsewhere. A `--no-spec` server compiled
    them on its first request (s32: `_sample_chunk_kernel`, `_sample_reduce_kernel`); an engine
    with device rounds compiles them in its rounds' capture too. The RNG is counter-based
    (keyed by seed and position), so this computes a draw and consumes none."""
    device = engine.device
    if device.type != "cuda":
        return []
    vocab = engine.model_config.vocab_size
    rows = 2

    def step(filtered: bool) -> None:
        logits = torch.zeros(rows, vocab, dtype=torch.float32, device=device)
        keys = torch.zeros(rows, dtype=torch.int64, device=device)
        filters = {}
        if filtered:
            filters = {
                "top_k": torch.full((rows,), 20, dtype=torch.int64, device=device),
                "top_p": torch.full((rows,), 0.9, dtype=torch.float32, device=device),
            }
        temperature = torch.ones(rows, dtype=torch.float32, device=device)
        sample(logits, keys, keys + 1, temperature=temperature, check_values=False, **filters)

    return [lambda: step(False), lambda: step(True)]


def _round_steps(engine: Any) -> list[Callable[[], None]]:
    """One call per (bucket, K) of device rounds (none without them)."""
    if not engine.device_rounds:
        return []
    rounds = engine._device_round_runner()
    if rounds is None:  # this drafter drafts on the host only
        return []
    policy = engine.policy
    ks = range(policy.max_k + 1) if policy.adaptive else [policy.max_k]
    method = engine.speculative_config.rejection_sample_method
    return [
        lambda bucket=bucket, k=k, ruled=ruled: rounds.warm_up(bucket, k, method, ruled=ruled)
        for bucket in batch_buckets(engine.config.max_num_seqs)
        for k in ks
        for ruled in (False, True)
    ]
