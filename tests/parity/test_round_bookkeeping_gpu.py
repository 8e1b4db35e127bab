"""The Triton kernels of a device round's bookkeeping (the engine's, and the EAGLE head's inputs)
against their PyTorch twins, bit for bit, on random slots (live and inert, anchors across block
boundaries, every K of a round)."""

from __future__ import annotations

import pytest
import torch

from specdec.drafters.eagle.round_inputs import head_round_inputs, head_round_inputs_ref
from specdec.drafters.eagle.step_inputs import HeadRoundInputs
from specdec.engine.round_bookkeeping import (
    finish_round,
    finish_round_ref,
    round_inputs,
    round_inputs_ref,
)
from specdec.engine.round_buffers import RoundInputs, RoundResults, RoundSlots

pytestmark = pytest.mark.gpu

BLOCK_SIZE, MAX_BLOCKS = 16, 9


def random_slots(rows: int, seed: int) -> RoundSlots:
    g = torch.Generator().manual_seed(seed)
    live = (torch.rand(rows, generator=g) < 0.7).to(torch.int64)
    live[0] = 1
    anchors = torch.randint(1, BLOCK_SIZE * (MAX_BLOCKS - 1), (rows,), generator=g)
    anchors = torch.where(live.bool(), anchors, torch.randint(0, 3, (rows,), generator=g))
    return RoundSlots(
        anchors=anchors,
        last_tokens=torch.randint(0, 1000, (rows,), generator=g),
        live=live,
        draft_limit=anchors + torch.randint(-2, 6, (rows,), generator=g),
        max_draft=torch.randint(0, 6, (rows,), generator=g),
        temperature=torch.rand(rows, generator=g) * 2,
        tables=torch.randint(0, 500, (rows, MAX_BLOCKS), generator=g),
    )


def empty_inputs(rows: int, k: int, device: str) -> RoundInputs:
    flat = rows * (k + 1)

    def ints(n: int) -> torch.Tensor:
        return torch.full((n,), -7, dtype=torch.int64, device=device)  # unwritten: -7

    return RoundInputs(
        anchors=ints(rows),
        last_tokens=ints(rows),
        live=torch.zeros(rows, dtype=torch.bool, device=device),
        temperature=torch.full((rows,), -1.0, device=device),
        num_draft=ints(rows),
        input_ids=ints(flat),
        positions=ints(flat),
        slot_mapping=ints(flat),
        context_lens=ints(rows),
        query_lens=ints(rows),
        block_tables=ints(rows * MAX_BLOCKS).view(rows, MAX_BLOCKS),
    )


def to_cuda(slots: RoundSlots) -> RoundSlots:
    return RoundSlots(*(t.cuda() for t in (getattr(slots, f) for f in RoundSlots.__slots__)))


@pytest.mark.parametrize("rows", [1, 5, 32])
@pytest.mark.parametrize("k", [0, 1, 3, 4])
def test_round_inputs_kernel_matches_twin(rows, k):
    slots = random_slots(rows, seed=rows * 10 + k)
    want = empty_inputs(rows, k, "cpu")
    round_inputs_ref(slots, want, k, BLOCK_SIZE)
    got = empty_inputs(rows, k, "cuda")
    round_inputs(to_cuda(slots), got, k, BLOCK_SIZE)
    for field in RoundInputs.__slots__:
        mine, twin = getattr(got, field).cpu(), getattr(want, field)
        if field == "input_ids":  # only column 0 is written before drafting
            mine, twin = mine.view(rows, k + 1)[:, 0], twin.view(rows, k + 1)[:, 0]
        assert torch.equal(mine, twin), field
    # The case is not trivial: live slots write cache slots, inert ones -1 and 0.
    live = want.live
    assert (want.slot_mapping.view(rows, k + 1)[live] >= 0).all()
    assert (want.slot_mapping.view(rows, k + 1)[~live] == -1).all()


@pytest.mark.parametrize("rows", [1, 6, 32])
@pytest.mark.parametrize("k", [0, 2, 4])
def test_finish_round_kernel_matches_twin(rows, k):
    g = torch.Generator().manual_seed(rows + 100 * k)
    width, query = 6, k + 1
    accepted = torch.randint(0, k + 1, (rows,), generator=g)
    tokens = torch.randint(0, 1000, (rows, query), generator=g)
    tokens[torch.arange(query)[None, :] > accepted[:, None]] = -1
    live = torch.rand(rows, generator=g) < 0.7
    anchors = torch.randint(1, 100, (rows,), generator=g)
    last = torch.randint(0, 1000, (rows,), generator=g)
    outputs = {}
    for device, finish in (("cpu", finish_round_ref), ("cuda", finish_round)):
        results = RoundResults(
            emitted=torch.full((rows, width), -7, dtype=torch.int64, device=device),
            accepted=torch.full((rows,), -7, dtype=torch.int64, device=device),
        )
        mine_anchors, mine_last = anchors.clone().to(device), last.clone().to(device)
        finish(
            tokens.to(device),
            accepted.to(device),
            live.to(device),
            results,
            mine_anchors,
            mine_last,
        )
        outputs[device] = [results.emitted, results.accepted, mine_anchors, mine_last]
    for mine, twin in zip(outputs["cuda"], outputs["cpu"], strict=True):
        assert torch.equal(mine.cpu(), twin)
    assert not torch.equal(outputs["cpu"][2], anchors) or not live.any()  # slots moved on


def empty_head_inputs(rows: int, width: int, steps: int, device: str) -> HeadRoundInputs:
    def ints(*shape: int) -> torch.Tensor:
        return torch.full(shape, -7, dtype=torch.int64, device=device)  # unwritten: -7

    return HeadRoundInputs(
        catch_slots=ints(rows * width),
        catch_positions=ints(rows * width),
        catch_tokens=ints(rows * width),
        catch_context_lens=ints(rows),
        catch_query_lens=ints(rows),
        catch_ends=ints(rows),
        # (sliced from wider buffers, as the drafter's are: rows of the widest batch)
        chain_slots=ints(steps, rows + 3)[:, :rows],
        chain_positions=ints(steps, rows + 3)[:, :rows],
        chain_query_lens=ints(rows),
        draft_positions=ints(steps + 1, rows + 3)[:, :rows],
    )


@pytest.mark.parametrize("rows", [1, 5, 32])
@pytest.mark.parametrize("k", [0, 1, 2, 4])
def test_head_round_inputs_kernel_matches_twin(rows, k):
    width, steps = 5, max(k - 1, 0)
    assert k <= width - 1
    slots = random_slots(rows, seed=rows * 7 + k)
    g = torch.Generator().manual_seed(rows + k)
    live = slots.live.bool()
    counts = torch.randint(1, width + 1, (rows,), generator=g)
    anchors = torch.where(live, slots.anchors + width, slots.anchors)  # room for the entries
    tokens = torch.randint(0, 1000, (rows, width), generator=g)
    want = empty_head_inputs(rows, width, steps, "cpu")
    head_round_inputs_ref(anchors, live, counts, tokens, slots.tables, BLOCK_SIZE, want)
    got = empty_head_inputs(rows, width, steps, "cuda")
    args = (anchors, live, counts, tokens, slots.tables)
    head_round_inputs(*(t.cuda() for t in args), BLOCK_SIZE, got)
    for field in HeadRoundInputs.__slots__:
        assert torch.equal(getattr(got, field).cpu(), getattr(want, field)), field
    fed = want.catch_slots.view(rows, width) >= 0
    assert fed.any() and (~fed).any()  # the case is not trivial
