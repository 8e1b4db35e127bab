"""Test helpers that make the target produce unusable logits for chosen requests: the target's
final hidden state of a chosen (request, position) row is overwritten after the forward pass, so
its logits row is NaN while its K/V, every other request's rows and the drafters'
models are untouched. Works on every engine path: the eager step, the decode graphs' step and
device rounds all run the target's `LlamaModel` forward.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch

from specdec.engine.llm_engine import LLMEngine
from specdec.engine.request import Request


@contextlib.contextmanager
def unusable_logits(
    engine: LLMEngine, position_of: Callable[[Request], int | None]
) -> Iterator[list[int]]:
    """While active, the logits row of the token at `position_of(request)` (None: none) is all
    NaN (its hidden state is). Yields a list of the rows spoiled per forward call that spoiled
    some.

    The request's rows are found by their cache slots (its blocks) and positions: the hidden row
    at position Q - 1 gives the logits of the token at Q.
    """
    inner = engine.model.model
    original = inner.forward
    block_size = engine.config.block_size
    spoiled: list[int] = []

    def forward(input_ids, positions, attn, kv_cache, return_layers=()):
        hidden, layers = original(input_ids, positions, attn, kv_cache, return_layers)
        blocks_of_slots = torch.div(attn.slot_mapping, block_size, rounding_mode="floor")
        hit = torch.zeros(positions.shape[0], dtype=torch.bool, device=positions.device)
        for request in list(engine.scheduler.running):
            position = position_of(request)
            if position is None or not request.block_ids:
                continue
            blocks = torch.tensor(request.block_ids, device=positions.device)
            mine = torch.isin(blocks_of_slots, blocks) & (attn.slot_mapping >= 0)
            hit |= mine & (positions == position - 1)
        if bool(hit.any()):
            spoiled.append(int(hit.sum()))
            hidden = hidden.masked_fill(hit[:, None], float("nan"))
        return hidden, layers

    inner.forward = forward
    try:
        yield spoiled
    finally:
        del inner.forward  # the class's forward again
