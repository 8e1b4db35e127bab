"""The block drafters' paged device context (`drafters/block/paged_context.py`) on the CPU.

- `paged_block_attention` (split-KV twin over the pool + the block's own rows, merged by LSE) is
  softmax attention over [context, own rows] (naive float32 reference; paged layouts with holes,
  contexts 0, 1, block and partition boundaries, 5000; several slots; GQA), and the twin's LSE is
  the scores' logsumexp. Under TRITON_INTERPRET=1 the Triton LSE kernels match the twin.
- Device drafts read through the pool's tables (contexts over several blocks, non-contiguous ids)
  are the host drafts; a table entry pointing at another request's block changes them (negative
  control: an entry swapped within a row would not, the context attention being a permutation-
  invariant set of rotated keys and values).
- Pool bookkeeping: `begin`/`prepare` refuse what the pool cannot hold ("out of KV blocks") with
  no block handed out; `end` and `release` give every block back.
- Through the engine: device rounds with the paged context emit the synchronous step's tokens
  while requests grow across blocks, finish and hand their blocks to new ones; every block comes
  back; rounds reading another slot's table (negative control) do not.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from block_drafter_fixtures import observe_context, save_tiny_block_drafter, tiny_block_drafter
from models_fixtures import make_hf_model, prompt_tokens, save_hf_model
from paged_block_fixtures import context_meta, naive_block_attention, paged_layout, randn
from specdec.drafters import DraftBatch
from specdec.drafters.block import paged_context
from specdec.drafters.block.dflash import DFlashDrafter
from specdec.drafters.block.dspark import DSparkDrafter
from specdec.drafters.device import DeviceSlot, RoundView
from specdec.engine.config import EngineConfig, SpeculativeConfig
from specdec.engine.llm_engine import LLMEngine
from specdec.models import load_model, split_kv
from specdec.sampling import SamplingParams, SamplingTensors

FP32_TOL = {"atol": 2e-5, "rtol": 2e-5}
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1" and importlib.util.find_spec("triton")
interpret = pytest.mark.skipif(not INTERPRET, reason="needs TRITON_INTERPRET=1 and Triton")
# Contexts: empty, one key, at and past a block (16) and a partition (2048) edge, long.
CONTEXTS = [0, 1, 16, 17, 2048, 2049, 5000, 3]


@pytest.mark.parametrize("heads", [(4, 1, 16), (4, 4, 8), (6, 2, 24)])
@pytest.mark.parametrize("num_rows", [1, 5])
def test_paged_block_attention_is_softmax_over_context_and_own_rows(heads, num_rows) -> None:
    num_heads, num_kv_heads, head_dim = heads
    k_pool, v_pool, tables, lens = paged_layout(CONTEXTS, num_kv_heads, head_dim, seed=3)
    n = len(CONTEXTS)
    query = randn(n, num_rows, num_heads, head_dim, seed=5)
    key = randn(n, num_rows, num_kv_heads, head_dim, seed=6)
    value = randn(n, num_rows, num_kv_heads, head_dim, seed=7)
    parts = split_kv.num_partitions(tables.shape[1] * 16)
    args = (k_pool, v_pool, tables, lens)
    got = paged_context.paged_block_attention(query, key, value, *args, parts, 0.3)
    want = naive_block_attention(query, key, value, *args, 0.3)
    torch.testing.assert_close(got, want, **FP32_TOL)


@pytest.mark.parametrize("softcap", [2.0, 0.5])
def test_paged_block_attention_soft_caps_context_and_own_rows(softcap) -> None:
    """Gemma 2's soft-capped scores on both partial attentions (the context's split-KV twin and
    the block's own rows), merged; control: without the cap the output differs."""
    k_pool, v_pool, tables, lens = paged_layout(CONTEXTS, 2, 16, seed=13)
    n, rows = len(CONTEXTS), 3
    query = randn(n, rows, 4, 16, seed=14) * 3.0  # scores large enough for the cap to bind
    key, value = randn(n, rows, 2, 16, seed=15), randn(n, rows, 2, 16, seed=16)
    parts = split_kv.num_partitions(tables.shape[1] * 16)
    args = (k_pool, v_pool, tables, lens)
    got = paged_context.paged_block_attention(query, key, value, *args, parts, 0.3, softcap)
    want = naive_block_attention(query, key, value, *args, 0.3, softcap)
    torch.testing.assert_close(got, want, **FP32_TOL)
    uncapped = naive_block_attention(query, key, value, *args, 0.3)
    assert (got - uncapped).abs().max() > 1e-2


def test_context_lse_is_the_scores_logsumexp() -> None:
    k_pool, v_pool, tables, lens = paged_layout(CONTEXTS, 2, 16, seed=11)
    rows = 3
    query = randn(len(CONTEXTS) * rows, 4, 16, seed=12)
    meta = context_meta(tables, lens, rows)
    out, lse = split_kv.split_kv_attention_lse_ref(query, k_pool, v_pool, meta, 0.3)
    for b, length in enumerate(CONTEXTS):
        at = slice(b * rows, (b + 1) * rows)
        if length == 0:
            assert (out[at] == 0).all() and torch.isneginf(lse[at]).all()
            continue
        keys = k_pool[tables[b]].flatten(0, 1)[:length].repeat_interleave(2, dim=1)
        scores = torch.einsum("rhd,khd->rhk", query[at], keys) * 0.3
        torch.testing.assert_close(lse[at], scores.logsumexp(-1), **FP32_TOL)


@interpret
@pytest.mark.parametrize("softcap", [None, 2.0])
def test_lse_kernels_interpreted_match_twin(monkeypatch, softcap) -> None:
    from specdec.models import attention_tiles, split_kv_triton

    # partitions of 128 keys: several per context
    monkeypatch.setattr(attention_tiles, "SPLIT_KV_PARTITION", 128)
    contexts = [0, 1, 16, 129, 300]
    k_pool, v_pool, tables, lens = paged_layout(contexts, 2, 16, seed=21)
    rows = 5
    query = randn(len(contexts) * rows, 8, 16, seed=22)
    args = (query, k_pool, v_pool, context_meta(tables, lens, rows, num_partitions=4), 0.3)
    got_out, got_lse = split_kv_triton.split_kv_attention_lse_triton(*args, softcap)
    want_out, want_lse = split_kv.split_kv_attention_lse_ref(*args, softcap=softcap)
    torch.testing.assert_close(got_out, want_out, **FP32_TOL)
    torch.testing.assert_close(got_lse, want_lse, **FP32_TOL)


# ----------------------------------------------------------------- drafting through the pool
TOKENS = [[5, 6, 7, 8, 5, 6, 9, 10, 11], [9, 10, 11], [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5]]
SEEDS = [11, -22, 33]
IDS = ["a", "b", "c"]
K = 3
DRAFTERS = {"dflash": DFlashDrafter, "dspark": DSparkDrafter}


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return load_model(save_hf_model(make_hf_model("llama"), tmp_path_factory.mktemp("t"))).model


def make_drafter(kind, target, num_blocks=64, block_size=2):
    model = tiny_block_drafter(kind, target, block_size=4)
    return DRAFTERS[kind](model, target, num_blocks=num_blocks, block_size=block_size)


def host_batch():
    size = len(TOKENS)
    return DraftBatch(
        token_ids=TOKENS,
        seeds=torch.tensor(SEEDS),
        anchors=torch.tensor([len(t) for t in TOKENS]),
        num_draft=torch.full((size,), K),
        methods=["standard"] * size,
        params=SamplingTensors.build(size, torch.device("cpu"), 0.9),
        request_ids=IDS,
    )


def round_view() -> RoundView:
    size = len(TOKENS) + 1  # and an inert slot
    live = torch.tensor([True] * len(TOKENS) + [False])
    return RoundView(
        num_rows=size,
        k=K,
        method="standard",
        anchors=torch.tensor([len(t) for t in TOKENS] + [1]),
        last_tokens=torch.tensor([t[-1] for t in TOKENS] + [0]),
        live=live,
        seeds=torch.tensor([*SEEDS, 0]),
        params=SamplingTensors(torch.where(live, 0.9, 0.0).float(), None, None, None),
        max_draft=torch.full((size,), K),
    )


def slots(token_lists=TOKENS) -> list[DeviceSlot]:
    return [
        DeviceSlot(b, rid, list(t)) for b, (rid, t) in enumerate(zip(IDS, token_lists, strict=True))
    ]


def reverse_free_list(paged) -> None:
    """Hands every block out, one holder each, and back in ascending order: the allocator hands
    out the last freed first, so the free list is then in reverse order and requests get
    descending, non-contiguous block ids."""
    holders = [f"one{i}" for i in range(paged.allocator.num_blocks)]
    for holder in holders:
        paged.grow({holder: paged.block_size})
    for holder in holders:
        paged.free(holder)


@pytest.mark.parametrize("kind", ["dflash", "dspark"])
def test_drafts_through_the_pool_are_the_host_drafts(target, kind):
    drafter = make_drafter(kind, target)
    observe_context(drafter, IDS, TOKENS)
    host = drafter.propose(host_batch())
    drafting = drafter.device_drafting(4, K + 1, 64, torch.device("cpu"))
    paged = drafting.context
    assert paged is drafter.device_context and paged.block_size == 2
    reverse_free_list(paged)
    drafting.begin(slots(), 4)
    assert len(paged.block_ids("c")) == 5  # 10 context positions in blocks of 2
    assert paged.block_ids("c") != sorted(paged.block_ids("c"))
    ids, logits, _, _ = drafting.propose(round_view())
    num_draft = host.num_draft.tolist()
    for b, n in enumerate(num_draft):
        assert ids[b, :n].tolist() == host.draft_token_ids[b, :n].tolist()
        torch.testing.assert_close(logits[b, :n], host.draft_logits[b, :n], atol=1e-5, rtol=1e-5)
    # Negative control: request c's first entry names request a's first block.
    tables = paged.tables.rows(4)
    tables[2, 0] = tables[0, 0]
    _, wrong, _, _ = drafting.propose(round_view())
    n = num_draft[2]
    assert not torch.allclose(wrong[2, :n], host.draft_logits[2, :n], atol=1e-3, rtol=1e-3)


def test_the_pool_refuses_what_it_cannot_hold_and_gets_everything_back(target):
    drafter = make_drafter("dflash", target, num_blocks=16, block_size=2)
    observe_context(drafter, IDS, TOKENS)
    drafting = drafter.device_drafting(4, K + 1, 64, torch.device("cpu"))
    paged = drafting.context
    needs = [4, 1, 5]  # blocks of 2 for 8, 2 and 10 context positions
    small = make_drafter("dflash", target, num_blocks=sum(needs) - 1, block_size=2)
    observe_context(small, IDS, TOKENS)
    refused = small.device_drafting(4, K + 1, 64, torch.device("cpu"))
    with pytest.raises(RuntimeError, match="out of KV blocks"):
        refused.begin(slots(), 4)
    assert refused.context.num_free_blocks == sum(needs) - 1  # nothing handed out
    assert all(refused.context.block_ids(rid) == [] for rid in IDS)
    drafting.begin(slots(), 4)
    assert paged.num_free_blocks == 16 - sum(needs)
    held = {rid: paged.block_ids(rid) for rid in IDS}
    # Rounds writing up to position 20 of every request would need 7 + 10 + 6 blocks more.
    with pytest.raises(RuntimeError, match="out of KV blocks"):
        drafting.prepare(slots(), [20, 20, 20])
    assert {rid: paged.block_ids(rid) for rid in IDS} == held
    assert paged.num_free_blocks == 16 - sum(needs)
    drafting.prepare(slots(), [len(t) - 1 + K for t in TOKENS])  # what a round of K writes
    assert paged.num_free_blocks == 0
    drafter.release("b")  # a request that finished inside the rounds
    drafting.end([slot for slot in slots() if slot.request_id != "b"])
    assert paged.num_free_blocks == 16


# ----------------------------------------------------------------- through the engine
@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_hf_model(make_hf_model("llama"), tmp_path_factory.mktemp("tiny-paged"))


@pytest.fixture(scope="module")
def drafter_dirs(model_dir, tmp_path_factory):
    target = load_model(model_dir).model
    root = tmp_path_factory.mktemp("paged-block")
    dspark = {"confidence_scale": 10.0, "confidence_bias": -0.5, "min_survival_probability": 0.3}
    return {
        kind: save_tiny_block_drafter(
            root / kind,
            kind,
            target,
            block_size=4,
            noise=0.05,
            **(dspark if kind == "dspark" else {}),
        )
        for kind in ("dflash", "dspark")
    }


def run_engine(model_dir, spec, async_scheduling, requests):
    config = EngineConfig(
        model=str(model_dir),
        max_model_len=96,
        block_size=4,
        max_num_seqs=2,
        async_scheduling=async_scheduling,
    )
    engine = LLMEngine(config, SpeculativeConfig.from_dict(spec))
    for prompt, params in requests:
        engine.add_request(prompt, params)
    finals = {}
    while engine.has_unfinished:
        for out in engine.step(only_finished=True):
            if out.finished:
                finals[out.request_id] = [o.token_ids for o in out.outputs]
    return finals, engine


def engine_case(drafter_dirs, kind):
    spec = {
        "method": kind,
        "model": str(drafter_dirs[kind]),
        "num_speculative_tokens": 3,
        "rejection_sample_method": "standard",
        "adaptive": False,  # K pinned: the two loops then verify the same drafts
    }
    prompts = prompt_tokens(97, [5, 9, 14, 3, 7, 11], seed=4)
    params = [
        SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True, seed=40 + i)
        for i in range(len(prompts))
    ]
    return spec, list(zip(prompts, params, strict=True))


@pytest.mark.parametrize("kind", ["dflash", "dspark"])
def test_rounds_over_the_pool_emit_the_synchronous_tokens_and_free_every_block(
    model_dir, drafter_dirs, kind, monkeypatch
):
    spec, requests = engine_case(drafter_dirs, kind)
    sync, _ = run_engine(model_dir, spec, False, requests)
    most_held = []
    original = paged_context.PagedBlockContext.grow

    def grow(self, wanted):
        original(self, wanted)
        most_held.append(max((len(self.block_ids(rid)) for rid in wanted), default=0))

    monkeypatch.setattr(paged_context.PagedBlockContext, "grow", grow)
    rounds, engine = run_engine(model_dir, spec, True, requests)
    assert rounds == sync
    paged = engine.drafter.device_context
    assert engine.loop_stats.num_device_rounds > 0 and paged is not None
    assert paged.allocator.num_blocks == engine.allocator.num_blocks  # the engine's geometry
    assert paged.block_size == 4
    assert max(most_held) >= 6  # requests grew across several blocks
    assert paged.num_free_blocks == paged.allocator.num_blocks  # every block given back


def test_negative_control_rounds_reading_another_slots_table(model_dir, drafter_dirs, monkeypatch):
    spec, requests = engine_case(drafter_dirs, "dflash")
    sync, _ = run_engine(model_dir, spec, False, requests)
    original = paged_context.PagedBlockContext.send_tables

    def swapped(self, slot_ids):
        ids = [request_id for _, request_id in slot_ids]
        original(self, list(zip([slot for slot, _ in slot_ids], ids[::-1], strict=True)))

    monkeypatch.setattr(paged_context.PagedBlockContext, "send_tables", swapped)
    rounds, _ = run_engine(model_dir, spec, True, requests)
    assert rounds != sync


def test_the_pools_layers_count_in_the_kv_memory(model_dir, drafter_dirs):
    """The engine sizes its KV cache with the block drafter's layers counted (its device rounds'
    pools have as many blocks as the target's cache)."""
    from specdec.engine.setup import draft_cache_layers

    target = load_model(model_dir).model
    for kind in ("dflash", "dspark"):
        spec = SpeculativeConfig.from_dict({"method": kind, "model": str(drafter_dirs[kind])})
        assert draft_cache_layers(spec, target) == 1  # the tiny drafters' one layer
