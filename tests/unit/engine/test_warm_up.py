"""The engine's warm-up (`LLMEngine.warm_up`): after it, a load that walks every batch bucket
(requests arriving one per step so the batch grows to max_num_seqs, then finishing one by one;
plain and speculative, graphed prefill on) makes no graph cache see a key it has not seen, on the
CPU with the CUDA engine's padding (`GraphCache.keys` records the keys a CUDA engine captures).
Negative controls: without the warm-up, and with a warm-up that skips the largest bucket, the
same load brings new keys. The warm-up leaves every KV block free, no request, no drafter state
and no counter moved, and seeded requests emit what they emit on an engine never warmed up.
Skipped (one line) where nothing is captured, unless forced."""

from __future__ import annotations

import pytest

from eagle_fixtures import trained_head
from models_fixtures import make_hf_model, save_hf_model
from specdec.engine import warm_up as warm_up_module
from specdec.engine.config import EngineConfig, SpeculativeConfig
from specdec.engine.llm_engine import LLMEngine
from specdec.runner.cuda_graph import batch_buckets
from specdec.sampling import SamplingParams
from warm_up_fixtures import graph_keys, run_load

MAX_NUM_SEQS = 8  # buckets 1, 2, 4, 8
K = 3


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_hf_model(make_hf_model("llama"), tmp_path_factory.mktemp("tiny-warm-up"))


@pytest.fixture(scope="module")
def head_dir(model_dir, tmp_path_factory):
    return trained_head(model_dir, tmp_path_factory.mktemp("eagle-warm-up"))


def make_engine(model_dir, head_dir, **kwargs) -> LLMEngine:
    """The CUDA engine's settings on the CPU: device rounds (async scheduling with an EAGLE
    head, K chosen per round by the adaptive policy), graphed prefill, and the decode path's
    steps padded to the batch buckets as graphs pad them."""
    config = EngineConfig(
        model=str(model_dir),
        max_model_len=96,
        block_size=4,
        max_num_seqs=MAX_NUM_SEQS,
        async_scheduling=True,
        prefill_graph_tokens=128,
        **kwargs,
    )
    spec = None
    if head_dir is not None:
        spec = SpeculativeConfig.from_dict(
            {"method": "eagle", "model": str(head_dir), "num_speculative_tokens": K}
        )
    engine = LLMEngine(config, spec)
    engine.runner.graphs.pad_batches = True
    return engine


def walk(engine: LLMEngine) -> None:
    run_load(engine, speculative=True, penalty_every=3)
    run_load(engine, speculative=False, seed=1)


def test_after_warm_up_the_load_adds_no_graph_key(model_dir, head_dir):
    engine = make_engine(model_dir, head_dir)
    report = engine.warm_up(force=True, progress=False)
    assert report.skipped is None and report.num_graphs == 0  # the CPU captures nothing
    warmed = graph_keys(engine)
    walk(engine)
    assert engine.loop_stats.num_device_rounds > 0  # the load did take device rounds
    assert engine.loop_stats.num_graphed_prefill_steps > 0  # and graphed prefill
    new = graph_keys(engine) - warmed
    assert not new, f"keys first run under traffic: {sorted(map(str, new))}"
    # The load reached every bucket of each kind of graph (so the check above means something).
    used = graph_keys(engine)
    for name, key in (("decode", lambda k: k[0]), ("head", lambda k: k[1])):
        assert {key(k) for n, k in used if n == name} == set(batch_buckets(MAX_NUM_SEQS))
    # and rounds with the slots' rules (penalised requests) and without
    assert {k[-1] for n, k in used if n == "rounds"} == {False, True}
    # Negative control 1: on an engine never warmed up, the same load runs keys first (every
    # one of them a key the warm-up runs).
    cold = make_engine(model_dir, head_dir)
    assert not graph_keys(cold)
    walk(cold)
    assert graph_keys(cold) and graph_keys(cold) <= warmed


def test_plain_engine_after_warm_up_adds_no_graph_key(model_dir):
    """An engine without speculation: the overlapped plain loop's decode steps (no feature
    layers) and graphed prefill; int8 weights give the CPU a decode path."""
    engine = make_engine(model_dir, None, quantization="int8")
    engine.warm_up(force=True, progress=False)
    warmed = graph_keys(engine)
    run_load(engine, speculative=False)
    assert engine.loop_stats.num_overlapped_steps > 0
    assert not graph_keys(engine) - warmed
    cold = make_engine(model_dir, None, quantization="int8")  # negative control
    run_load(cold, speculative=False)
    assert graph_keys(cold) and graph_keys(cold) <= warmed


def test_a_warm_up_missing_a_bucket_is_caught(model_dir, head_dir, monkeypatch):
    """Negative control 2: a warm-up that skips the largest bucket leaves keys for the load."""
    monkeypatch.setattr(warm_up_module, "batch_buckets", lambda n: batch_buckets(n)[:-1])
    engine = make_engine(model_dir, head_dir)
    engine.warm_up(force=True, progress=False)
    warmed = graph_keys(engine)
    walk(engine)
    new = graph_keys(engine) - warmed
    assert new and all(MAX_NUM_SEQS in _flat(key) for key in new)


def _flat(key) -> list:
    out = []
    for part in key if isinstance(key, tuple) else (key,):
        out.extend(_flat(part) if isinstance(part, tuple) else [part])
    return out


def test_warm_up_leaves_no_trace(model_dir, head_dir):
    engine = make_engine(model_dir, head_dir)
    free = engine.allocator.num_free_blocks
    order = list(engine.allocator._free)
    engine.warm_up(force=True, progress=False)
    assert engine.allocator.num_free_blocks == free == engine.allocator.num_blocks
    assert list(engine.allocator._free) == order  # not even the free list's order moved
    assert engine.drafter.allocator.num_free_blocks == engine.drafter.allocator.num_blocks
    assert not engine.has_unfinished and not engine.groups and not engine.drafter._states
    assert engine.stats.num_draft_tokens == 0 and engine.loop_stats.num_device_rounds == 0
    assert engine.loop_stats.num_graphed_prefill_steps == 0
    assert engine.num_preemptions == 0
    # Seeded requests replay what an engine never warmed up emits (plain and speculative).
    warmed = run_load(engine, True) | run_load(engine, False, seed=1)
    cold = make_engine(model_dir, head_dir)
    never = run_load(cold, True) | run_load(cold, False, seed=1)
    assert warmed == never
    # Negative control: other seeds give other tokens (the comparison can tell them apart).
    other = run_load(make_engine(model_dir, head_dir), True, seed=5)
    assert list(other.values()) != [never[f"s0-{i}"] for i in range(MAX_NUM_SEQS)]


def test_warm_up_is_skipped_where_nothing_is_captured(model_dir, head_dir):
    engine = make_engine(model_dir, head_dir)
    report = engine.warm_up(progress=False)
    assert report.skipped is not None and report.num_steps == 0
    assert report.line() == f"warm-up: skipped ({report.skipped})"
    assert not graph_keys(engine)  # nothing ran


def test_warm_up_refuses_an_engine_with_requests(model_dir, head_dir):
    engine = make_engine(model_dir, head_dir)
    engine.add_request([3, 4, 5], SamplingParams(max_tokens=2))
    with pytest.raises(RuntimeError, match="holds no request"):
        engine.warm_up(force=True, progress=False)


def test_warm_up_runs_the_eager_prefill_and_catch_up_at_every_row_class(
    model_dir, head_dir, monkeypatch
):
    """The target's eager prefill and the head's prompt catch-up run at a row count of every
    tier and value class their Triton kernels compile a variant for (`models.row_classes`), up
    to the longest chunk (max_num_batched_tokens) or context (here): one sequence and two,
    last-row and every-row logits (the eager kernels never see a count class first under
    traffic; on CUDA `triton_compiles_after_warm_up` counts what is left)."""
    config = EngineConfig(
        model=str(model_dir),
        max_model_len=256,  # the tiny model's context
        max_num_batched_tokens=600,
        block_size=4,
        max_num_seqs=MAX_NUM_SEQS,
        async_scheduling=True,
        prefill_graph_tokens=128,
    )
    spec = SpeculativeConfig.from_dict(
        {"method": "eagle", "model": str(head_dir), "num_speculative_tokens": K}
    )
    engine = LLMEngine(config, spec)
    eager, caught_up = [], []
    run_eager, catch_up = engine.runner._run_eager, engine.drafter._catch_up

    def recorded_eager(inputs, *args):
        eager.append(tuple((len(s.token_ids), s.num_logit_rows) for s in inputs))
        return run_eager(inputs, *args)

    def recorded_catch_up(features, tokens, firsts, query_lens, states):
        caught_up.append(tuple(query_lens))
        return catch_up(features, tokens, firsts, query_lens, states)

    monkeypatch.setattr(engine.runner, "_run_eager", recorded_eager)
    monkeypatch.setattr(engine.drafter, "_catch_up", recorded_catch_up)
    engine.warm_up(force=True, progress=False)
    singles = [17, 32, 129, 144]  # past the graphed prefill's 16 tokens, <= max_model_len
    pairs = [(65, 64), (72, 72)]  # both halves past 16
    expected = set()
    for split in [(n,) for n in singles] + pairs:
        expected |= {tuple((n, 1) for n in split), tuple((n, n) for n in split)}
    assert set(eager) == expected
    # the head: every class from 1 (its decode path up to 16 entries), to max_model_len
    assert set(caught_up) == {(n,) for n in [1, 2, 16, *singles]} | set(pairs)
    assert engine.drafter.allocator.num_free_blocks == engine.drafter.allocator.num_blocks
    assert not engine.drafter._states


@pytest.mark.parametrize("max_model_len", [4096, 2048 + 1 + 17 - 1])
def test_warm_up_prefills_a_chunk_past_one_split_kv_partition(max_model_len):
    """Each eager row tier once more as a chunk continuing a prompt past one split-KV
    partition (its block table wider than a partition: the prefill kernel's partitioned
    variant, a constexpr, compiles at warm-up; s40 on an H100 saw it compile for the first long
    prompt under traffic), where max_model_len holds it. Control: where it does not (here the
    17-row chunk would end one token past max_model_len), no such chunk."""
    from types import SimpleNamespace

    from specdec.models.attention_tiles import SPLIT_KV_PARTITION
    from specdec.models.row_classes import eager_row_counts

    engine = SimpleNamespace(
        runner=SimpleNamespace(graphs=SimpleNamespace(prefill_width=16, max_query_len=4)),
        config=SimpleNamespace(max_num_batched_tokens=512, block_size=16),
        max_model_len=max_model_len,
    )
    steps = warm_up_module.eager_inputs(engine)
    long = [inputs for inputs in steps if inputs[0].start > 0]
    fits = [
        n for n in eager_row_counts(512) if n > 16 and SPLIT_KV_PARTITION + 1 + n <= max_model_len
    ]
    assert [len(inputs[0].token_ids) for inputs in long] == fits
    for (row,) in long:
        end = row.start + len(row.token_ids)
        assert row.start > SPLIT_KV_PARTITION and len(row.block_ids) * 16 >= end
    assert bool(long) == (max_model_len == 4096)
    # the short chunks stay as they were: every step but these starts at 0
    assert len(steps) - len(long) == sum(
        4 if n // 2 > 16 else 2 for n in eager_row_counts(512) if n > 16
    )
