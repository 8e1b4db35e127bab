"""The tensors a device round's bookkeeping reads and writes (`engine/round_bookkeeping.py` and
its Triton kernels), [S] each unless said, S = the round's rows."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class RoundSlots:
    """The slots' state a round starts from, [S] each (S = the round's rows): `anchors` (the
    position of each slot's first draft), `last_tokens` (the round's input tokens), `live` (int64
    0/1: 0 for padding and finished requests), `draft_limit` (the anchor from which the slot may
    draft nothing more), `max_draft` (its own cap on drafts a round), `temperature`, and the
    target's block tables [S, max_blocks]."""

    anchors: torch.Tensor
    last_tokens: torch.Tensor
    live: torch.Tensor
    draft_limit: torch.Tensor
    max_draft: torch.Tensor
    temperature: torch.Tensor
    tables: torch.Tensor


@dataclass(frozen=True, slots=True)
class RoundInputs:
    """Where `round_inputs` writes, [S] each unless said: the round's copies of the anchors and
    input tokens (the view's, unchanged while `finish_round` moves the slots' own), `live` bool,
    `temperature` (0 on inert slots: greedy), `num_draft` (min(K, max_draft, room) on live slots,
    else 0), and the target step's `input_ids` [S * Q] (column 0 per slot: the input token; the
    drafts are written after drafting), `positions`, `slot_mapping` [S * Q], `context_lens`,
    `query_lens` and `block_tables` [S, max_blocks]."""

    anchors: torch.Tensor
    last_tokens: torch.Tensor
    live: torch.Tensor
    temperature: torch.Tensor
    num_draft: torch.Tensor
    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    context_lens: torch.Tensor
    query_lens: torch.Tensor
    block_tables: torch.Tensor


@dataclass(frozen=True, slots=True)
class RoundResults:
    """Where `finish_round` writes what the host reads: `emitted` [S, W] (a row's tokens, -1
    after them), `accepted` [S] (0 on inert slots)."""

    emitted: torch.Tensor
    accepted: torch.Tensor
