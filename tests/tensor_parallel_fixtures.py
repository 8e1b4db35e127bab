"""Helpers for the tensor-parallel tests: a rank that computes prompt logits on its shard of the
built-in model (spawned, so it lives in an importable module), and near-tie detection."""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist

# Float32 logits of TP = 2 agree with TP = 1 to this (the row-parallel sums are added in
# another order; measured about 1e-4 on the built-in model, logits of magnitude ~30).
LOGITS_ATOL = 2e-3
# Two top logits closer than this are a near-tie: TP = 1 and TP = N may pick either.
NEAR_TIE = 2 * LOGITS_ATOL
# The prompts every TP = N against TP = 1 comparison runs.
PROMPTS = [
    "The capital of France is",
    "1, 2, 3, 4,",
    "Once upon a time",
    "def fibonacci(n):",
    "The quick brown fox",
    "Water boils at",
    "My favourite colour is",
    "To make a cake you need",
    "The largest planet in the solar system is",
    "Hello, my name is",
]


def shard_prompt_logits(rank: int, world_size: int, port: int, jobs, queue) -> None:
    """Joins a gloo group of `world_size` and, for each (model path, prompts) of `jobs`, loads
    this rank's float32 shard and computes `prompt_logits`; rank 0 puts the list of results
    (one list of [T_i, V] arrays per job) on `queue`. A path of None is the built-in model."""
    from specdec.models import default_model_path, load_model, prompt_logits
    from specdec.models.loader import read_model_config
    from specdec.models.tensor_parallel import Collectives, shard_layout

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size
    )
    try:
        results = []
        for path, prompts in jobs:
            path = path or default_model_path()
            layout = shard_layout(read_model_config(path), rank, world_size)
            model = load_model(path, quantization=None, shard=layout).model
            model.attach_collectives(Collectives(layout))
            # By value, not through shared memory (the rank exits before it is read).
            results.append([row.numpy().copy() for row in prompt_logits(model, prompts)])
        if rank == 0:
            queue.put(results)
    finally:
        dist.destroy_process_group()


def sharded_prompt_logits(jobs, world_size: int = 2) -> list[list[torch.Tensor]]:
    """`shard_prompt_logits` on `world_size` spawned ranks: per job, per prompt [T, V] logits."""
    import torch.multiprocessing as mp

    from specdec.runner.tensor_parallel import free_local_port

    context = mp.get_context("spawn")
    queue = context.Queue()
    port = free_local_port()
    ranks = [
        context.Process(target=shard_prompt_logits, args=(rank, world_size, port, jobs, queue))
        for rank in range(world_size)
    ]
    for process in ranks:
        process.start()
    try:
        results = queue.get(timeout=180)
    finally:
        for process in ranks:
            process.join(30)
            if process.exitcode is None:
                process.kill()
    return [[torch.from_numpy(rows) for rows in job] for job in results]


def top2_margin(logits: torch.Tensor) -> float:
    """The gap between the two largest entries of a [V] row."""
    top = torch.topk(logits.float(), 2).values
    return float(top[0] - top[1])


def _first_difference(a: list[int], b: list[int]) -> int | None:
    for index, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return index
    return None if len(a) == len(b) else min(len(a), len(b))


def check_tokens_equal(
    reference_model, outputs_1, outputs_n, params, what: str, near_tie: float = NEAR_TIE
) -> int:
    """Asserts that TP = N emitted TP = 1's tokens, except where TP = 1's scores at the first
    difference are a near-tie (top-2 within `near_tie`), which is warned about, not hidden.
    Sampled rows are judged on the plain sampler's scores (logits / T + the TARGET stream's
    Gumbel noise at that position): the rule of plain sampling and of `coupled` verification.
    A `standard` verifier's accept test (u < p / q) can flip where that rule sees no near-tie,
    so sampled speculative runs compared here verify with `coupled` unless the two runs' logits
    agree to float32 precision. Returns the number of near-ties found.

    Args: reference_model: TP = 1's (whole) model; outputs_1 / outputs_n: `RequestOutput`s of
    the same prompts in the same order; params: their SamplingParams."""
    from specdec.models import prompt_logits
    from specdec.rng import Stream, gumbel

    ties = 0
    for out_1, out_n in zip(outputs_1, outputs_n, strict=True):
        tokens_1, tokens_n = out_1.outputs[0].token_ids, out_n.outputs[0].token_ids
        index = _first_difference(tokens_1, tokens_n)
        if index is None:
            continue
        prefix = list(out_1.prompt_token_ids) + list(tokens_1[:index])
        scores = prompt_logits(reference_model, [prefix])[0][-1].float().cpu()  # [V]
        if params.temperature > 0:
            seeds, positions = torch.tensor([out_1.seed]), torch.tensor([len(prefix)])
            noise = gumbel(seeds, positions, Stream.TARGET, scores.numel())[0]
            scores = scores / params.temperature + noise
        margin = top2_margin(scores)
        assert margin < near_tie, (
            f"{what}: TP=N emitted {tokens_n[index:]} where TP=1 emitted {tokens_1[index:]} "
            f"(token {index}; top-2 margin {margin:.4g} is no near-tie)"
        )
        warnings.warn(
            f"{what}: near-tie at token {index} (top-2 margin {margin:.3g}): TP=1 and TP=N "
            "differ from there",
            stacklevel=2,
        )
        ties += 1
    return ties
