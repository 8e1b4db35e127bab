"""Seeded requests replay: each request emits, token for token, what it emits alone on an idle
engine, whatever the engine does around it: requests joining a running engine at random steps or
in bursts, a closed batch in any order, preemption and recompute, chunked prefill beside decode
rows, the overlapped loop and device rounds (the adaptive policy changing K), and speculation by
every drafter with the default (coupled) verifier, whose tokens are plain decoding's; where the
requests ask for logprobs, each emitted token's log-probability too, bit for bit. On the tiny
Llama kept quantized (GGUF: the CPU's per-row plan) and as a float model (the eager runner).
Negative controls (logits that depend on the step's batch) must fail the same comparisons.
"""

from __future__ import annotations

import pytest
import torch

from replay_fixtures import (
    ARRIVAL_PATTERNS,
    DRAFTERS,
    AloneOutputs,
    arrivals,
    drafter_dirs,
    drafter_spec,
    drive,
    engine_factory,
    float_model_dir,
    gguf_model_file,
    make_batch_dependent,
    mismatches,
    replay,
    replay_requests,
    run_alone,
    spy_schedule,
    with_logprobs,
)

pytest.importorskip("gguf", reason="gguf (runtime dependency) writes the kept-quantized model")
pytest.importorskip("transformers", reason="transformers (test extra) builds the tiny models")

MODELS = ("gguf", "float")


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """One torch thread: the tiny models' products are small, and on a busy 2-core machine two
    OpenMP threads spin-waiting for each other make a step 20x slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def model_paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("replay-models")
    return {"float": float_model_dir(root / "float"), "gguf": gguf_model_file(root)}


@pytest.fixture(scope="module")
def dirs(model_paths, tmp_path_factory):
    return drafter_dirs(model_paths["float"], tmp_path_factory.mktemp("replay-drafters"))


@pytest.fixture(scope="module")
def requests():
    return replay_requests()


@pytest.fixture(scope="module")
def alone(model_paths, requests):
    """Per model: each request alone on an idle plain (speculation off) engine."""
    factories = {model: engine_factory(path) for model, path in model_paths.items()}
    for model, make in factories.items():
        quantization = make().model.quantization
        assert quantization == ("gguf" if model == "gguf" else None)  # kept quantized or float
    return AloneOutputs(factories, requests)


@pytest.mark.parametrize("pattern", ARRIVAL_PATTERNS)
@pytest.mark.parametrize("model", MODELS)
def test_plain_requests_replay_whatever_their_arrival(model_paths, requests, alone, model, pattern):
    """Plain decoding, requests added all at once (in order or permuted), at uniformly random
    steps of a running engine, or in bursts: fails if a row's tokens depend on the rows (prefill
    chunks, decode rows) it shares a step with."""
    make = engine_factory(model_paths[model])
    _, log, diff = replay(make, requests, alone(model), pattern)
    assert not diff, diff
    if pattern in ("uniform", "bursts"):
        assert log.num_mixed_steps > 0  # prompts were prefilled beside decode rows


@pytest.mark.parametrize("chunk", [8, 16, 64])
@pytest.mark.parametrize("model", MODELS)
def test_chunked_prefill_replays(model_paths, requests, alone, model, chunk):
    """Prompts longer than `max_num_batched_tokens` are split into chunks that share steps
    with decode rows: fails if a token depends on the chunk size or on what shares the step."""
    make = engine_factory(model_paths[model])
    _, log, diff = replay(make, requests, alone(model), "uniform", max_num_batched_tokens=chunk)
    assert not diff, diff
    assert log.num_split_prompts > 0 and log.num_mixed_steps > 0
    assert max(log.chunk_sizes) <= chunk


@pytest.mark.parametrize("spec", [None, "draft_model"])
@pytest.mark.parametrize("model", MODELS)
def test_preempted_requests_replay(model_paths, dirs, requests, alone, model, spec):
    """A KV cache too small for the batch: requests are preempted, recompute their prefix
    (prompt and output, in chunks beside other rows) and resume: fails if a resumed request
    emits other tokens than it would have."""
    make = engine_factory(model_paths[model])
    spec = None if spec is None else drafter_spec(spec, dirs)
    engine, _, diff = replay(
        make, requests, alone(model), "closed", spec, num_kv_blocks=14, max_num_batched_tokens=32
    )
    assert not diff, diff
    assert engine.num_preemptions > 0


@pytest.mark.parametrize("spec", [None, *DRAFTERS])
@pytest.mark.parametrize("model", MODELS)
def test_overlapped_loop_and_device_rounds_replay(model_paths, dirs, requests, alone, model, spec):
    """async_scheduling on the CPU: the overlapped plain loop, or speculative rounds on the
    device (run op by op) with the adaptive policy choosing each round's K, requests joining
    (the rounds drain, a joining visit prefills them beside undrafted decode rows, the rounds
    resume): fails if a token depends on the loop, on K, or on the batch."""
    make = engine_factory(model_paths[model])
    spec = None if spec is None else drafter_spec(spec, dirs)
    engine, _, diff = replay(make, requests, alone(model), "uniform", spec, async_scheduling=True)
    assert not diff, diff
    if spec is None:
        assert engine.loop_stats.num_overlapped_steps > 0
    else:
        assert engine.loop_stats.num_device_rounds > 0
        assert len(engine.loop_stats.k_chosen) > 1  # the policy changed K between rounds
        assert engine.loop_stats.num_overlapped_prefill_steps > 0  # the overlapped loop ran


@pytest.mark.parametrize("rule", ["every arrival", "beside", "drained"])
@pytest.mark.parametrize("spec", ["ngram", "draft_model", "eagle"])
@pytest.mark.parametrize("model", MODELS)
def test_arrivals_joining_running_rounds_replay(
    model_paths, dirs, requests, alone, model, spec, rule, monkeypatch
):
    """Device rounds (op by op on the CPU) taking arrivals without a drain: their prefill in
    overlapped steps between two rounds, then a free slot (`DeviceRounds.admit`), with prompts
    split at 16 tokens a step. "every arrival": the engine's rule (since s41 each arrival the
    rounds can take joins so); "beside": two requests do not speculate (the rounds cannot take
    them) and decode beside the rounds, one token in each step between two rounds (s43);
    "drained": arrivals drain the rounds into the overlapped loop instead (`_joins_rounds`
    forced off). Fails if a token depends on when or how its request joined."""
    from specdec.engine.speculative_loops import SpeculativeLoops

    if rule == "drained":
        monkeypatch.setattr(SpeculativeLoops, "_joins_rounds", lambda self: False)
    overrides = {0: {"enabled": False}, 3: {"enabled": False}} if rule == "beside" else None
    make = engine_factory(model_paths[model])
    options = {"max_num_batched_tokens": 16, "async_scheduling": True}
    engine, _, diff = replay(
        make, requests, alone(model), "bursts", drafter_spec(spec, dirs), overrides, **options
    )
    assert not diff, diff
    if rule == "beside":
        assert engine.loop_stats.num_side_rows > 0 and engine.loop_stats.num_round_joins > 0
    elif rule == "every arrival":
        assert engine.loop_stats.num_round_joins > 0
    elif rule == "drained":
        assert engine.loop_stats.num_round_joins == 0
        assert engine.loop_stats.num_overlapped_prefill_steps > 0


@pytest.mark.parametrize("case", ["chunked", "preempted"])
@pytest.mark.parametrize("model", MODELS)
def test_overlapped_joins_replay(model_paths, requests, alone, model, case):
    """The overlapped plain loop with requests joining in bursts while steps are in flight
    (their prefill chunks launched ahead beside the decode rows): prompts split at 16 tokens a
    step, or a cache small enough to preempt (the loop then reads the step in flight and
    preempts as usual): fails if a token depends on the step it was launched in."""
    make = engine_factory(model_paths[model])
    options = {"max_num_batched_tokens": 16}
    if case == "preempted":
        options = {"num_kv_blocks": 14, "max_num_batched_tokens": 32}
    engine, log, diff = replay(
        make, requests, alone(model), "bursts", None, async_scheduling=True, **options
    )
    assert not diff, diff
    assert engine.loop_stats.num_overlapped_steps > 0 and log.num_mixed_steps > 0
    if case == "preempted":
        assert engine.num_preemptions > 0


@pytest.mark.parametrize(("spec", "control"), [(None, False), ("ngram", False), (None, True)])
def test_graphed_prefill_beside_decode_rows_replays(
    model_paths, dirs, requests, monkeypatch, spec, control
):
    """Graphed prefill (CUDA's default, here on the kept-quantized model's decode path, op by
    op): prompt chunks of 16 tokens share steps with decode rows (the overlapped plain loop) or
    verify rows (n-gram drafts, the synchronous step); such a step runs the rows and the chunks
    as two steps of the decode path. Every request, and each emitted token's log-probability,
    equals its run alone on an idle plain engine of the same prefill: fails if a row depends
    on the chunks beside it. The control (logits that depend on the step's rows) must fail."""
    if control:
        make_batch_dependent(monkeypatch)
    make = engine_factory(model_paths["gguf"], prefill_graph_tokens=64)
    batch = with_logprobs(requests)
    own = run_alone(make(), batch)
    spec = None if spec is None else drafter_spec(spec, dirs, adaptive=False)
    engine = make(spec, async_scheduling=spec is None)
    runner, calls, steps = engine.runner, [], []
    graphs_run, run_with_features = runner.graphs.run, runner.run_with_features

    def graph(*args, **kwargs):
        calls.append(kwargs.get("last_rows", False))
        return graphs_run(*args, **kwargs)

    def step(*args, **kwargs):  # the graphs each runner step ran
        del calls[:]
        out = run_with_features(*args, **kwargs)
        steps.append(tuple(calls))
        return out

    runner.graphs.run, runner.run_with_features = graph, step
    log = spy_schedule(engine)
    got = drive(engine, batch, arrivals("bursts", len(batch)).schedule)
    diff = mismatches(own, got, batch)
    # steps of rows and chunks: the rows' graph, then the chunks'
    assert log.num_mixed_steps > 0 and steps.count((False, True)) > 0
    if control:
        assert diff
        return
    assert not diff, diff
    if spec is not None:
        assert engine.stats.num_accepted_tokens > 0


@pytest.mark.parametrize("drafter", DRAFTERS)
@pytest.mark.parametrize("model", MODELS)
def test_speculation_replays_plain_decoding(model_paths, dirs, requests, alone, model, drafter):
    """Every drafter with the default verifier: each request alone, then the requests joining
    at random steps with prompts chunked (16 tokens a step), emit plain decoding's tokens: fails
    if the verifier's output depends on the drafts, or a row on its batch."""
    make = engine_factory(model_paths[model])
    # K pinned, so that every run drafts (the policy's K per step: the test below)
    spec = drafter_spec(drafter, dirs, adaptive=False)
    engine = make(spec, max_num_batched_tokens=16)
    assert engine.speculative_config.rejection_sample_method == "coupled"  # the default
    spec_alone = run_alone(engine, requests)
    assert not mismatches(alone(model), spec_alone, requests)
    log = spy_schedule(engine)
    got = drive(engine, requests, arrivals("uniform", len(requests)).schedule)
    diff = mismatches(alone(model), got, requests)
    assert not diff, diff
    assert log.num_mixed_steps > 0
    assert engine.stats.num_accepted_tokens > 0  # drafts were verified and accepted


@pytest.mark.parametrize("method", ["coupled", "standard"])
def test_the_policys_k_per_step_replays_plain_decoding(
    model_paths, dirs, requests, alone, monkeypatch, method
):
    """The synchronous step's K comes from the speculation policy (`_sync_step_k`): here a
    seeded random K in 0..3 per step, the requests joining at random steps. With the default
    verifier each request emits plain decoding's tokens whatever the K; the negative control,
    `standard` under the same K sequence, must not (its tokens depend on the drafts)."""
    import random

    from specdec.engine.spec_policy import SpeculationPolicy

    make = engine_factory(model_paths["float"])
    engine = make(
        drafter_spec("draft_model", dirs, num_speculative_tokens=3, rejection_sample_method=method)
    )
    assert engine.policy.adaptive and not engine.device_rounds  # the CPU's synchronous path
    draws = random.Random(7)
    monkeypatch.setattr(SpeculationPolicy, "choose", lambda self, *a, **k: draws.randint(0, 3))
    got = drive(engine, requests, arrivals("uniform", len(requests)).schedule)
    assert set(engine.loop_stats.k_chosen) == {0, 1, 2, 3}  # the steps took every K
    assert engine.stats.num_accepted_tokens > 0
    diff = mismatches(alone("float"), got, requests)
    if method == "coupled":
        assert not diff, diff
    else:
        assert diff  # K changed standard's tokens: the comparison can fail


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("model", MODELS)
def test_per_request_k_above_the_engines_replays(
    model_paths, requests, alone, model, async_scheduling
):
    """Half the requests ask for K = 3 on an engine of K = 1 (their rounds are wider than the
    engine's decode path takes): fails if their tokens, or the others', leave plain decoding's."""
    make = engine_factory(model_paths[model])
    # K pinned: the policy may choose K = 0 (then no round is wider than the engine's)
    spec = drafter_spec("draft_model", {}, num_speculative_tokens=1, adaptive=False)
    overrides = {index: {"num_speculative_tokens": 3} for index in range(0, len(requests), 2)}
    engine, _, diff = replay(
        make, requests, alone(model), "bursts", spec, overrides, async_scheduling=async_scheduling
    )
    assert not diff, diff
    assert engine.stats.num_accepted_tokens > 0


@pytest.mark.parametrize(
    ("pattern", "spec", "engine_args"),
    [
        ("closed", None, {}),
        ("bursts", None, {"max_num_batched_tokens": 16}),
        ("uniform", "draft_model", {}),
        ("closed", None, {"num_kv_blocks": 14, "max_num_batched_tokens": 32}),
    ],
    ids=["closed", "chunked", "draft_model", "preempted"],
)
@pytest.mark.parametrize(
    "model",
    [
        "gguf",
        "float",
    ],
)
def test_values_replay_bit_for_bit(
    model_paths, dirs, requests, alone, model, pattern, spec, engine_args
):
    """The requests ask for their tokens' log-probabilities (so the synchronous step serves
    them): each emitted token's log-probability must equal, bit for bit, the one it has alone
    on an idle plain engine, in a closed batch, chunked beside decode rows, as a speculative
    verify row (coupled: plain decoding's tokens and logits) and after preemption. Fails if a
    row's logits depend on the step by an ulp, which tokens reveal only at near-ties."""
    make = engine_factory(model_paths[model])
    spec = None if spec is None else drafter_spec(spec, dirs)
    batch = with_logprobs(requests)
    engine, _, diff = replay(make, batch, alone(model, values=True), pattern, spec, **engine_args)
    assert not diff, diff
    if "num_kv_blocks" in engine_args:
        assert engine.num_preemptions > 0


@pytest.mark.parametrize(
    ("pattern", "spec", "engine_args"),
    [
        ("closed", None, {}),
        ("uniform", None, {"max_num_batched_tokens": 16}),
        ("bursts", "draft_model", {}),
        ("uniform", "eagle", {"async_scheduling": True}),
    ],
    ids=["closed", "chunked", "draft_model", "eagle-rounds"],
)
@pytest.mark.parametrize("model", MODELS)
def test_negative_control_batch_dependent_logits_fail_the_comparison(
    model_paths, dirs, requests, monkeypatch, model, pattern, spec, engine_args
):
    """The same comparison (alone on an idle engine vs. in the case's batch) with logits that
    gain a term depending on the step's rows: it must find mismatches, else it has no power."""
    make_batch_dependent(monkeypatch)
    make = engine_factory(model_paths[model])
    want = run_alone(make(), requests)
    spec = None if spec is None else drafter_spec(spec, dirs)
    _, _, diff = replay(make, requests, want, pattern, spec, **engine_args)
    assert diff


@pytest.mark.parametrize("model", MODELS)
def test_negative_control_values_catch_a_batch_dependence_tokens_miss(
    model_paths, requests, monkeypatch, model
):
    """The values comparison (`test_values_replay_bit_for_bit`) with a batch-dependent term
    50,000 times smaller than the token tests' control (1e-6 of the step's mean logits row,
    which no token here reveals): it must find the log-probabilities differ."""
    make_batch_dependent(monkeypatch, scale=1e-6)
    make = engine_factory(model_paths[model])
    batch = with_logprobs(requests)
    want = run_alone(make(), batch)
    _, _, diff = replay(make, batch, want, "closed")
    assert diff
    assert all("same tokens" in line for line in diff)
