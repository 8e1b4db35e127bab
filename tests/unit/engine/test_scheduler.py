"""Scheduler and block accounting: chunked prefill, speculative shares, rollback, preemption."""

import pytest

from specdec.engine.config import EngineConfig
from specdec.engine.request import Request, RequestStatus, SpecSettings
from specdec.engine.scheduler import Scheduler, SchedulerConfig
from specdec.runner.kv_cache import BlockAllocator
from specdec.sampling.params import SamplingParams


def config(**overrides) -> SchedulerConfig:
    """The scheduler settings of an engine with EngineConfig's defaults, with `overrides`."""
    engine = EngineConfig()
    values = {
        "max_num_seqs": engine.max_num_seqs,
        "max_num_batched_tokens": engine.max_num_batched_tokens,
        "max_model_len": 2048,
        "prefill_graph_tokens": 0,
        "prefill_graph_width": 16,
    }
    return SchedulerConfig(**{**values, **overrides})


def make_request(rid: str, prompt_len: int, k: int | None = None, max_tokens: int = 50):
    spec = SpecSettings(k) if k else None
    params = SamplingParams(max_tokens=max_tokens)
    return Request(rid, list(range(prompt_len)), params, seed=1, spec=spec)


def run_step(scheduler: Scheduler, accepted: int = 0):
    """Plays one engine step: every emitting request gets accepted drafts + 1 token."""
    out = scheduler.schedule()
    for share in out.scheduled:
        request = share.request
        num_computed = request.num_computed_tokens + share.num_query_tokens
        if share.emits:
            num_accepted = min(accepted, share.num_draft)
            request.output_token_ids.extend([7] * (num_accepted + 1))
            num_computed -= share.num_draft - num_accepted
        scheduler.commit(request, num_computed)
    return out


def test_chunked_prefill_then_decode_with_drafts():
    allocator = BlockAllocator(num_blocks=64, block_size=4)
    scheduler = Scheduler(config(max_num_batched_tokens=8, max_model_len=64), allocator)
    request = make_request("a", 20, k=3)
    scheduler.add(request)
    shares = [run_step(scheduler).scheduled[0] for _ in range(3)]
    assert [s.num_query_tokens for s in shares] == [8, 8, 4]
    assert [s.emits for s in shares] == [False, False, True]
    assert request.num_computed_tokens == 20 and len(request.output_token_ids) == 1
    share = run_step(scheduler, accepted=2).scheduled[0]
    assert (share.num_query_tokens, share.num_draft) == (4, 3)
    # last token + 2 accepted drafts now have K/V; the rejected draft's slot is rolled back.
    assert request.num_computed_tokens == 23 and request.num_tokens == 24
    assert len(request.block_ids) == allocator.blocks_needed(23)


def test_drafts_capped_by_max_tokens_and_model_len():
    allocator = BlockAllocator(num_blocks=64, block_size=4)
    scheduler = Scheduler(config(max_model_len=12), allocator)
    request = make_request("a", 8, k=5, max_tokens=3)
    scheduler.add(request)
    run_step(scheduler)  # prefill emits 1 token: 9 tokens, 2 left to generate
    share = run_step(scheduler).scheduled[0]
    assert share.num_draft == 1  # two tokens left -> at most one draft + one bonus
    request.output_token_ids.clear()  # now 8 tokens, room for 3 more within max_model_len=12
    request.num_computed_tokens = 7
    request.params.max_tokens = 100
    assert scheduler.schedule().scheduled[0].num_draft == 3


def test_rejects_prompts_that_cannot_fit():
    scheduler = Scheduler(config(max_model_len=16), BlockAllocator(2, 4))
    with pytest.raises(ValueError, match="max_model_len"):
        scheduler.add(make_request("long", 16))
    with pytest.raises(ValueError, match="whole KV cache"):
        scheduler.add(make_request("big", 12))
    with pytest.raises(ValueError, match="empty"):
        scheduler.add(make_request("empty", 0))


def test_preemption_frees_blocks_and_requeues_first():
    allocator = BlockAllocator(num_blocks=6, block_size=4)
    scheduler = Scheduler(config(max_model_len=64), allocator)
    first, second = make_request("first", 8), make_request("second", 8)
    scheduler.add(first)
    scheduler.add(second)
    run_step(scheduler)  # both prefilled: 2 blocks each; decoding grows them to 3, then 4
    assert len(scheduler.running) == 2
    for _ in range(10):
        out = run_step(scheduler)
        if out.preempted:
            break
    assert out.preempted == [second]
    assert second.status is RequestStatus.WAITING and second.block_ids == []
    assert second.num_computed_tokens == 0 and second.num_preemptions == 1
    assert scheduler.waiting[0] is second
    # After the first finishes, the second recomputes the K/V of all but its last token without
    # emitting, then resumes with the decode round it would have run.
    scheduler.finish(first, RequestStatus.FINISHED_LENGTH)
    share = run_step(scheduler).scheduled[0]
    assert share.request is second and share.num_query_tokens == second.num_tokens - 1
    assert not share.emits and not second.in_prefill
    share = scheduler.schedule().scheduled[0]
    assert share.emits and share.num_query_tokens == 1


def test_block_allocator_rollback_and_slots():
    allocator = BlockAllocator(num_blocks=8, block_size=4)
    request = make_request("a", 3)
    allocator.grow(request, 10)
    assert len(request.block_ids) == 3
    assert allocator.slots(request, 3, 3) == [
        request.block_ids[0] * 4 + 3,
        request.block_ids[1] * 4,
        request.block_ids[1] * 4 + 1,
    ]
    allocator.rollback(request, 5)
    assert len(request.block_ids) == 2 and allocator.num_free_blocks == 6
    allocator.free(request)
    assert allocator.num_free_blocks == 8
    with pytest.raises(RuntimeError, match="out of KV blocks"):
        allocator.grow(request, 100)


def test_short_prefills_are_chunked_at_the_graph_width():
    """A prefill of at most prefill_graph_tokens tokens still to compute runs in chunks of
    prefill_graph_width (the runner's graphed prefill); a longer one in one chunk; a request
    emits only with its last chunk."""
    cfg = config(prefill_graph_tokens=48, prefill_graph_width=16)
    scheduler = Scheduler(cfg, BlockAllocator(256, 16))
    short, long = make_request("short", 40), make_request("long", 100)
    scheduler.add(short)
    scheduler.add(long)
    chunks = {"short": [], "long": []}
    for _ in range(4):
        out = scheduler.schedule()
        for share in out.scheduled:
            request = share.request
            if request.num_computed_tokens < request.num_tokens - 1 or not share.emits:
                chunks[request.request_id].append((share.num_query_tokens, share.emits))
            scheduler.commit(request, request.num_computed_tokens + share.num_query_tokens)
    assert chunks["short"] == [(16, False), (16, False), (8, True)]
    assert chunks["long"] == [(100, True)]
    off = Scheduler(config(prefill_graph_tokens=0), BlockAllocator(256, 16))
    off.add(make_request("short", 40))
    assert [s.num_query_tokens for s in off.schedule().scheduled] == [40]


def test_schedule_ahead_holds_requests_admits_and_never_preempts():
    """A step scheduled ahead of reading the one in flight: held requests get no share,
    waiting ones are admitted as `schedule` admits them, and where a running request's share
    does not fit the free blocks it returns None with nothing changed (where `schedule` would
    preempt)."""
    allocator = BlockAllocator(num_blocks=8, block_size=4)
    scheduler = Scheduler(config(max_model_len=64), allocator)
    first, second = make_request("a", 4), make_request("b", 3)
    for request in (first, second):
        scheduler.add(request)
    run_step(scheduler)  # both prefilled, one output token each
    late = make_request("c", 6)
    scheduler.add(late)
    shares = scheduler.schedule_ahead(hold={id(first)})
    assert [(s.request.request_id, s.num_query_tokens) for s in shares] == [("b", 1), ("c", 6)]
    assert late.status is RequestStatus.RUNNING and list(scheduler.waiting) == []

    allocator = BlockAllocator(num_blocks=2, block_size=4)
    scheduler = Scheduler(config(max_model_len=64), allocator)
    first, second = make_request("a", 4), make_request("b", 4)
    for request in (first, second):
        scheduler.add(request)
    run_step(scheduler)  # a block each, none free; each next token needs a second block
    assert allocator.num_free_blocks == 0
    assert scheduler.schedule_ahead(hold=set()) is None
    assert [len(r.block_ids) for r in (first, second)] == [1, 1]
    assert scheduler.running == [first, second]
    assert scheduler.schedule_ahead(hold={id(second)}) is None  # a alone still needs a block
    assert scheduler.schedule().preempted == [second]  # the usual schedule preempts instead
