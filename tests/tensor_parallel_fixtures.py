"""Helpers for the tensor-parallel tests: a rank that computes prompt logits on its shard of the
built-in model (spawned, so it lives in an importable module), and near-tie detection."""

from __future__ import annotations

import torch
import torch.distributed as dist

# Float32 logits of TP = 2 agree with TP = 1 to this (the row-parallel sums are added in
# another order; measured about 1e-4 on the built-in model, logits of magnitude ~30).
LOGITS_ATOL = 2e-3
# Two top logits closer than this are a near-tie: TP = 1 and TP = N may pick either.
NEAR_TIE = 2 * LOGITS_ATOL


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

    from specdec.runner.tensor_parallel import _free_port

    context = mp.get_context("spawn")
    queue = context.Queue()
    port = _free_port()
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
