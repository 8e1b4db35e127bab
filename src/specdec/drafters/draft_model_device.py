"""Draft-model drafting inside a device round: the draft model re-reads the tokens the last
round committed (at most `width`) on its own paged cache, then drafts K tokens step by step
through its decode path's static buffers, every input computed on the device. Draft noise only
through `Drafter.draw_on_device`.
"""

from __future__ import annotations

import torch

from specdec.drafters.base import Drafter, ProposalBuffer
from specdec.drafters.device import BlockTables, DeviceDrafting, DeviceSlot, RoundView
from specdec.runner import StepInput


class DraftModelDeviceDrafting(DeviceDrafting):
    """Per slot: the tokens the next round feeds first (`entry_*`, at most `width`: what the last
    round committed) and the draft cache's block table."""

    def __init__(self, drafter: Drafter, num_slots: int, width: int) -> None:
        graphs = drafter.runner.graphs
        if graphs is None or graphs.max_query_len != width:
            raise ValueError("the draft model's runner needs its decode path at width K + 1")
        self.drafter, self.graphs, self.width = drafter, graphs, width
        device = drafter.runner.device
        self.entry_tokens = torch.zeros(num_slots, width, dtype=torch.int64, device=device)
        self.entry_count = torch.zeros(num_slots, dtype=torch.int64, device=device)
        self.max_blocks = graphs.block_tables.shape[1]
        self.tables = BlockTables(num_slots, self.max_blocks, device)
        self.out = ProposalBuffer(
            num_slots, width - 1, drafter.target_vocab_size, device, drafter.greedy
        )

    admits = True

    def begin(self, slots: list[DeviceSlot], num_rows: int) -> None:
        self.entry_count.zero_()
        self.admit(slots, num_rows)

    def admit(self, slots: list[DeviceSlot], num_rows: int) -> None:
        drafter, width = self.drafter, self.width
        behind = []  # one draft-model pass for every request behind (a new batch: its prompts)
        for slot in slots:
            tokens = slot.token_ids
            state = drafter._sync(slot.request_id, tokens)  # keeps a valid prefix, never all
            start = len(state.token_ids)
            if len(tokens) - start > width:  # feed on the host all but the last `width` tokens
                end = len(tokens) - width
                drafter.allocator.grow(state, end)
                behind.append(StepInput(tokens[start:end], start, state.block_ids, 1))
                start = end
            n = len(tokens) - start
            state.token_ids = list(tokens[:start])
            self.entry_tokens[slot.slot, :n].copy_(torch.tensor(tokens[start:], dtype=torch.int64))
            self.entry_count[slot.slot] = n
        if behind:
            drafter.runner.run(behind)

    def prepare(self, slots: list[DeviceSlot], last_positions: list[int]) -> None:
        # The draft cache holds the round's first step (up to anchor - 1) and the drafts it feeds
        # (up to anchor + k - 2 = P - 1 for a round whose target writes up to position P).
        drafter, tables = self.drafter, []
        for slot, last in zip(slots, last_positions, strict=True):
            state = drafter._states[slot.request_id]
            drafter.allocator.grow(state, last)
            tables.append((slot.slot, state.block_ids))
        self.tables.send(tables)

    def propose(self, view: RoundView) -> tuple:
        graphs, drafter = self.graphs, self.drafter
        rows, width, k = view.num_rows, self.width, view.k
        device = self.entry_count.device
        live, anchors = view.live, view.anchors
        size = drafter.runner.block_size
        tables = self.tables.rows(rows)
        count = self.entry_count[:rows]
        out = self.out
        # The first step (also when k = 0: the cache must not fall behind): tokens at
        # anchor - n .. anchor - 1; the last one's logits give draft 0.
        column = torch.arange(width, device=device)
        positions = anchors[:, None] - count[:, None] + column  # [S, W]
        valid = live[:, None] & (column < count[:, None])
        safe = positions.clamp_min(0)
        block = (safe // size).clamp_max(self.max_blocks - 1)
        slots = tables.gather(1, block) * size + safe % size
        graphs.input_ids[: rows * width].copy_(
            torch.where(valid, self.entry_tokens[:rows], 0).view(-1)
        )
        graphs.positions[: rows * width].copy_(torch.where(valid, positions, 0).view(-1))
        graphs.slot_mapping[: rows * width].copy_(torch.where(valid, slots, -1).view(-1))
        graphs.context_lens[:rows].copy_(torch.where(live, anchors, 0))
        graphs.query_lens[:rows].copy_(torch.where(live, count, 0))
        graphs.block_tables[:rows].copy_(tables)
        graphs.forward(rows, width, ())
        if k == 0:
            return out.draft_token_ids[:rows, :0], None, None, None
        last_rows = torch.arange(rows, device=device) * width + (count - 1).clamp_min(0)
        logits = graphs.logits.index_select(0, last_rows)  # [S, V]
        for i in range(k):
            tokens = drafter.draw_on_device(logits, anchors + i, view, out, i)
            if i + 1 == k:
                break
            # Draft i, fed at position anchor + i, gives the logits of draft i + 1.
            position = anchors + i
            block = (position // size).clamp(0, self.max_blocks - 1)
            slot = tables.gather(1, block[:, None]).squeeze(1) * size + position % size
            graphs.input_ids[:rows].copy_(tokens)
            graphs.positions[:rows].copy_(torch.where(live, position, 0))
            graphs.slot_mapping[:rows].copy_(torch.where(live, slot, -1))
            graphs.context_lens[:rows].copy_(torch.where(live, position + 1, 0))
            graphs.query_lens[:rows].copy_(live.to(torch.int64))
            graphs.forward(rows, 1, ())
            logits = graphs.logits[:rows]
        draft_logits = None if out.draft_logits is None else out.draft_logits[:rows, :k]
        draft_lse = None if out.draft_logsumexp is None else out.draft_logsumexp[:rows, :k]
        return out.draft_token_ids[:rows, :k], draft_logits, draft_lse, None

    def observe(self, view, features, token_ids, num_accepted) -> None:
        rows = view.num_rows
        self.entry_tokens[:rows].copy_(token_ids.clamp_min(0))
        self.entry_count[:rows].copy_(num_accepted + 1)

    def state(self) -> list[torch.Tensor]:
        return [self.entry_tokens, self.entry_count]

    def end(self, slots: list[DeviceSlot]) -> None:
        counts = self.entry_count.tolist()
        for slot in slots:
            state = self.drafter._states[slot.request_id]
            state.token_ids = list(slot.token_ids[: len(slot.token_ids) - counts[slot.slot]])
