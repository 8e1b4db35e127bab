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


def shard_prompt_logits(rank: int, world_size: int, port: int, prompts, queue) -> None:
    """Joins a gloo group of `world_size`, loads this rank's float32 shard of the built-in model
    and computes `prompt_logits`; rank 0 puts them on `queue`."""
    from specdec.models import default_model_path, load_model, prompt_logits
    from specdec.models.loader import read_model_config
    from specdec.models.tensor_parallel import Collectives, shard_layout

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size
    )
    try:
        path = default_model_path()
        layout = shard_layout(read_model_config(path), rank, world_size)
        model = load_model(path, quantization=None, shard=layout).model
        model.attach_collectives(Collectives(layout))
        logits = prompt_logits(model, prompts)
        if rank == 0:
            queue.put([row.numpy().copy() for row in logits])  # by value, not shared memory
    finally:
        dist.destroy_process_group()


def top2_margin(logits: torch.Tensor) -> float:
    """The gap between the two largest entries of a [V] row."""
    top = torch.topk(logits.float(), 2).values
    return float(top[0] - top[1])
