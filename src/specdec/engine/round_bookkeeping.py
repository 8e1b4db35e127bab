"""The integer bookkeeping of a speculative round on the device, before and after its target
step: the target's inputs from the slots' anchors (positions, cache slots, lengths, the input
token), the live mask, temperatures and draft counts the round's view holds, and after
verification the results the host reads and the next round's anchors and input tokens.

Each is one Triton kernel on CUDA (one program per slot), where the same work in PyTorch is some
thirty small kernels a round, each a launch in the round's CUDA graph; the PyTorch twins here run
elsewhere and define the values (integers, and a temperature passed through or zeroed: the
kernels match them bit for bit, `tests/parity/test_device_rounds_gpu.py`). Nothing here draws
randomness or allocates.
"""

from __future__ import annotations

import torch

from specdec.engine.round_buffers import RoundInputs, RoundResults, RoundSlots


def round_inputs(slots: RoundSlots, out: RoundInputs, k: int, block_size: int) -> None:
    """Writes a round's inputs (see `RoundInputs`) for K = k drafts (Q = k + 1 target rows a
    slot: the input token at anchor - 1, then the drafts). Mutates: `out`'s tensors."""
    if slots.anchors.is_cuda:
        from specdec.engine.round_bookkeeping_triton import round_inputs_triton

        round_inputs_triton(slots, out, k, block_size)
        return
    round_inputs_ref(slots, out, k, block_size)


def round_inputs_ref(slots: RoundSlots, out: RoundInputs, k: int, block_size: int) -> None:
    """The PyTorch twin of `round_inputs`."""
    rows, query = slots.anchors.shape[0], k + 1
    live = slots.live.bool()
    anchors = slots.anchors
    out.anchors.copy_(anchors)
    out.last_tokens.copy_(slots.last_tokens)
    out.live.copy_(live)
    out.temperature.copy_(torch.where(live, slots.temperature, 0.0))
    room = (slots.draft_limit - anchors).clamp_min(0)
    num_draft = torch.minimum(slots.max_draft, room).clamp_max(k)
    out.num_draft.copy_(torch.where(live, num_draft, 0))
    column = torch.arange(query, device=anchors.device)
    positions = anchors[:, None] - 1 + column  # [S, Q]
    max_blocks = slots.tables.shape[1]
    block = torch.div(positions, block_size, rounding_mode="floor").clamp(0, max_blocks - 1)
    cache_slots = slots.tables.gather(1, block) * block_size + positions % block_size
    fed = live[:, None]
    out.input_ids.view(rows, query)[:, 0] = slots.last_tokens
    out.positions.view(rows, query).copy_(torch.where(fed, positions, 0))
    out.slot_mapping.view(rows, query).copy_(torch.where(fed, cache_slots, -1))
    out.context_lens.copy_(torch.where(live, anchors + k, 0))
    out.query_lens.copy_(live.to(torch.int64) * query)
    out.block_tables.copy_(slots.tables)


def finish_round(
    token_ids: torch.Tensor,
    num_accepted: torch.Tensor,
    live: torch.Tensor,
    results: RoundResults,
    anchors: torch.Tensor,
    last_tokens: torch.Tensor,
) -> None:
    """After verification: writes `results` from the verifier's token_ids [S, Q] (-1 padded)
    and num_accepted [S], and moves each live slot on: its anchor past the accepted drafts and
    the emitted token, its input token the emitted one (inert slots keep theirs).

    Mutates: `results`' tensors, `anchors` [S], `last_tokens` [S] (the slots' own, not the
    round's copies the view reads)."""
    if token_ids.is_cuda:
        from specdec.engine.round_bookkeeping_triton import finish_round_triton

        finish_round_triton(token_ids, num_accepted, live, results, anchors, last_tokens)
        return
    finish_round_ref(token_ids, num_accepted, live, results, anchors, last_tokens)


def finish_round_ref(
    token_ids: torch.Tensor,
    num_accepted: torch.Tensor,
    live: torch.Tensor,
    results: RoundResults,
    anchors: torch.Tensor,
    last_tokens: torch.Tensor,
) -> None:
    """The PyTorch twin of `finish_round`."""
    query = token_ids.shape[1]
    emitted, accepted = results.emitted, results.accepted
    emitted[:, query:].fill_(-1)
    emitted[:, :query] = token_ids
    accepted.copy_(torch.where(live, num_accepted, 0))
    final = token_ids.gather(1, accepted[:, None]).squeeze(1)
    last_tokens.copy_(torch.where(live, final, last_tokens))
    anchors.copy_(torch.where(live, anchors + accepted + 1, anchors))
