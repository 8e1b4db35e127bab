"""The PyTorch twins of a device round's bookkeeping (which define the values the Triton kernels
must match) against a slot-by-slot Python reading of their contracts."""

from __future__ import annotations

import pytest
import torch

from specdec.drafters.eagle.round_inputs import head_round_inputs_ref
from specdec.drafters.eagle.step_inputs import HeadRoundInputs
from specdec.engine.round_bookkeeping import finish_round_ref, round_inputs_ref
from specdec.engine.round_buffers import RoundInputs, RoundResults, RoundSlots

BLOCK, MAX_BLOCKS = 4, 6


def slots_for(rows: int, seed: int) -> RoundSlots:
    g = torch.Generator().manual_seed(seed)
    live = (torch.rand(rows, generator=g) < 0.6).to(torch.int64)
    anchors = torch.where(
        live.bool(), torch.randint(1, BLOCK * (MAX_BLOCKS - 2), (rows,), generator=g), 0
    )
    return RoundSlots(
        anchors=anchors,
        last_tokens=torch.randint(0, 50, (rows,), generator=g),
        live=live,
        draft_limit=anchors + torch.randint(-1, 5, (rows,), generator=g),
        max_draft=torch.randint(0, 5, (rows,), generator=g),
        temperature=torch.rand(rows, generator=g),
        tables=torch.randint(0, 100, (rows, MAX_BLOCKS), generator=g),
    )


def slot_of(tables: torch.Tensor, b: int, position: int) -> int:
    return int(tables[b, position // BLOCK]) * BLOCK + position % BLOCK


@pytest.mark.parametrize("k", [0, 1, 3])
def test_round_inputs_follow_the_contract(k):
    rows, query = 7, k + 1
    slots = slots_for(rows, seed=k)
    out = RoundInputs(
        anchors=torch.zeros(rows, dtype=torch.int64),
        last_tokens=torch.zeros(rows, dtype=torch.int64),
        live=torch.zeros(rows, dtype=torch.bool),
        temperature=torch.zeros(rows),
        num_draft=torch.zeros(rows, dtype=torch.int64),
        input_ids=torch.full((rows * query,), -5, dtype=torch.int64),
        positions=torch.zeros(rows * query, dtype=torch.int64),
        slot_mapping=torch.zeros(rows * query, dtype=torch.int64),
        context_lens=torch.zeros(rows, dtype=torch.int64),
        query_lens=torch.zeros(rows, dtype=torch.int64),
        block_tables=torch.zeros(rows, MAX_BLOCKS, dtype=torch.int64),
    )
    round_inputs_ref(slots, out, k, BLOCK)
    assert torch.equal(out.block_tables, slots.tables)
    for b in range(rows):
        live, anchor = bool(slots.live[b]), int(slots.anchors[b])
        assert bool(out.live[b]) == live and int(out.anchors[b]) == anchor
        assert int(out.last_tokens[b]) == int(slots.last_tokens[b])
        assert float(out.temperature[b]) == (float(slots.temperature[b]) if live else 0.0)
        room = max(int(slots.draft_limit[b]) - anchor, 0)
        want = min(k, int(slots.max_draft[b]), room) if live else 0
        assert int(out.num_draft[b]) == want
        assert int(out.input_ids[b * query]) == int(slots.last_tokens[b])
        assert (out.input_ids[b * query + 1 : (b + 1) * query] == -5).all()  # drafts: later
        assert int(out.context_lens[b]) == (anchor + k if live else 0)
        assert int(out.query_lens[b]) == (query if live else 0)
        for j in range(query):
            position = anchor - 1 + j
            assert int(out.positions[b * query + j]) == (position if live else 0)
            want_slot = slot_of(slots.tables, b, position) if live else -1
            assert int(out.slot_mapping[b * query + j]) == want_slot


def test_finish_round_follows_the_contract():
    rows, width, query = 6, 5, 3
    g = torch.Generator().manual_seed(1)
    accepted = torch.randint(0, query, (rows,), generator=g)
    tokens = torch.randint(0, 50, (rows, query), generator=g)
    tokens[torch.arange(query)[None, :] > accepted[:, None]] = -1
    live = torch.tensor([True, False, True, True, False, True])
    anchors, last = torch.arange(10, 10 + rows), torch.arange(100, 100 + rows)
    results = RoundResults(
        emitted=torch.zeros(rows, width, dtype=torch.int64),
        accepted=torch.zeros(rows, dtype=torch.int64),
    )
    new_anchors, new_last = anchors.clone(), last.clone()
    finish_round_ref(tokens, accepted, live, results, new_anchors, new_last)
    for b in range(rows):
        n = int(accepted[b]) if live[b] else 0
        assert int(results.accepted[b]) == n
        assert results.emitted[b].tolist() == tokens[b].tolist() + [-1] * (width - query)
        if live[b]:
            assert int(new_anchors[b]) == int(anchors[b]) + n + 1
            assert int(new_last[b]) == int(tokens[b, n])
        else:
            assert int(new_anchors[b]) == int(anchors[b]) and int(new_last[b]) == int(last[b])


@pytest.mark.parametrize("k", [0, 1, 3])
def test_head_round_inputs_follow_the_contract(k):
    rows, width, steps = 7, 4, max(k - 1, 0)
    slots = slots_for(rows, seed=10 + k)
    live = slots.live.bool()
    g = torch.Generator().manual_seed(k)
    counts = torch.randint(1, width + 1, (rows,), generator=g)
    anchors = torch.where(live, slots.anchors + width, 0)
    entry_tokens = torch.randint(0, 50, (rows, width), generator=g)

    def ints(*shape: int) -> torch.Tensor:
        return torch.full(shape, -9, dtype=torch.int64)

    out = HeadRoundInputs(
        catch_slots=ints(rows * width),
        catch_positions=ints(rows * width),
        catch_tokens=ints(rows * width),
        catch_context_lens=ints(rows),
        catch_query_lens=ints(rows),
        catch_ends=ints(rows),
        chain_slots=ints(steps, rows),
        chain_positions=ints(steps, rows),
        chain_query_lens=ints(rows),
        draft_positions=ints(k, rows),
    )
    head_round_inputs_ref(anchors, live, counts, entry_tokens, slots.tables, BLOCK, out)
    for b in range(rows):
        on, anchor, count = bool(live[b]), int(anchors[b]), int(counts[b])
        assert int(out.catch_context_lens[b]) == (anchor - 1 if on else 0)
        assert int(out.catch_query_lens[b]) == (count if on else 0)
        assert int(out.catch_ends[b]) == b * width + count - 1
        assert int(out.chain_query_lens[b]) == int(on)
        for c in range(width):
            entry, row = anchor - 1 - count + c, b * width + c
            fed = on and c < count
            assert int(out.catch_slots[row]) == (slot_of(slots.tables, b, entry) if fed else -1)
            assert int(out.catch_positions[row]) == (entry + 1 if fed else 0)
            assert int(out.catch_tokens[row]) == (int(entry_tokens[b, c]) if fed else 0)
        for i in range(steps):
            entry = anchor - 1 + i
            assert int(out.chain_slots[i, b]) == (slot_of(slots.tables, b, entry) if on else -1)
            assert int(out.chain_positions[i, b]) == (entry + 1 if on else 0)
        for i in range(k):
            assert int(out.draft_positions[i, b]) == anchor + i
