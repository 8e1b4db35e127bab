"""Speculative rounds on the GPU: the whole round replayed from a CUDA graph (capture itself
proves there is no host synchronisation inside), overlapped with the host, emitting token for
token what the synchronous step emits with K pinned, graphs == op by op (enforce_eager), and the
adaptive policy keeping coupled and greedy output identical to plain decoding."""

from __future__ import annotations

import pytest

from block_drafter_fixtures import save_tiny_block_drafter
from eagle_fixtures import trained_head
from models_fixtures import make_hf_model, prompt_tokens, save_hf_model
from specdec.engine.llm import LLM
from specdec.models import load_model
from specdec.sampling import SamplingParams

pytestmark = pytest.mark.gpu

VOCAB = 97


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_hf_model(make_hf_model("llama"), tmp_path_factory.mktemp("tiny-rounds-gpu"))


@pytest.fixture(scope="module")
def head_dir(model_dir, tmp_path_factory):
    return trained_head(model_dir, tmp_path_factory.mktemp("eagle-rounds-gpu"))


@pytest.fixture(scope="module")
def dirs(model_dir, head_dir, tmp_path_factory):
    """The EAGLE head, and block drafters close to the target (DSpark with its confidence
    scheduler on, so that each slot's verify length varies inside the graphed round)."""
    target = load_model(model_dir).model
    root = tmp_path_factory.mktemp("block-rounds-gpu")
    dspark = {"confidence_scale": 10.0, "confidence_bias": -0.5, "min_survival_probability": 0.3}
    return {
        "eagle": head_dir,
        "dflash": save_tiny_block_drafter(
            root / "dflash", "dflash", target, block_size=4, noise=0.05
        ),
        "dspark": save_tiny_block_drafter(
            root / "dspark", "dspark", target, block_size=4, noise=0.05, **dspark
        ),
    }


@pytest.fixture(scope="module")
def prompts():
    return [p + p for p in prompt_tokens(VOCAB, [5, 9, 14, 3, 7, 11], seed=3)]


def spec_for(drafter, dirs, method, adaptive=False):
    spec = {"num_speculative_tokens": 3, "rejection_sample_method": method, "adaptive": adaptive}
    if drafter == "ngram":
        spec["method"] = "ngram"
    elif drafter in dirs:
        spec.update(method=drafter, model=str(dirs[drafter]))
    else:
        spec.update(method="draft_model", model="truncated:1")
    return spec


def generate(model_dir, prompts, params, spec, **kwargs):
    args = {"max_model_len": 96, "block_size": 4, "num_kv_blocks": 512, **kwargs}
    llm = LLM(str(model_dir), speculative_config=spec, device="cuda", dtype="float32", **args)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs], llm


@pytest.mark.parametrize("drafter", ["ngram", "draft_model", "eagle", "dflash", "dspark"])
@pytest.mark.parametrize("method", ["standard", "block", "coupled"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_graphed_rounds_emit_what_the_synchronous_step_emits(
    model_dir, dirs, prompts, drafter, method, temperature
):
    spec = spec_for(drafter, dirs, method)
    filters = {"top_p": 0.9, "top_k": 30} if temperature else {}
    params = [
        SamplingParams(
            temperature=temperature, max_tokens=24, ignore_eos=True, seed=9 + i, **filters
        )
        for i in range(len(prompts))
    ]
    sync, _ = generate(model_dir, prompts, params, spec, async_scheduling=False)
    graphed, llm = generate(model_dir, prompts, params, spec, async_scheduling=True)
    eager, _ = generate(model_dir, prompts, params, spec, async_scheduling=True, enforce_eager=True)
    assert graphed == sync
    assert eager == sync
    loop = llm.get_metrics()["loop"]
    assert loop["num_device_rounds"] > 0 and loop["num_graph_rounds"] == loop["num_device_rounds"]
    rounds = llm.engine._rounds
    assert rounds.graph_cache.graphs and rounds.num_overlapped_reads > 0


@pytest.mark.parametrize("drafter", ["ngram", "draft_model", "eagle"])
@pytest.mark.parametrize(("method", "temperature"), [("coupled", 1.0), ("standard", 0.0)])
def test_requests_join_graphed_rounds_without_a_drain(
    model_dir, dirs, prompts, drafter, method, temperature
):
    """Six requests through two slots (max_num_seqs = 2, prompts chunked at 8 tokens): later
    ones join the running graphed rounds (their prefill in overlapped steps between two rounds,
    then a finished request's slot) while at least as many wait as the rounds run (the burst
    rule: fewer take a joining visit), and the tokens are the synchronous step's, and plain
    decoding's for coupled and greedy. (How many join depends on when requests finish: 2 to 4
    on an H100 in s31.)"""
    spec = spec_for(drafter, dirs, method)
    params = [
        SamplingParams(temperature=temperature, max_tokens=16 + 2 * i, ignore_eos=True, seed=40 + i)
        for i in range(len(prompts))
    ]
    args = {"max_num_seqs": 2, "max_num_batched_tokens": 16}
    plain, _ = generate(model_dir, prompts, params, None, **args)
    sync, _ = generate(model_dir, prompts, params, spec, async_scheduling=False, **args)
    graphed, llm = generate(model_dir, prompts, params, spec, async_scheduling=True, **args)
    assert graphed == sync == plain
    loop = llm.get_metrics()["loop"]
    assert loop["num_round_joins"] >= 1 and loop["num_graph_rounds"] == loop["num_device_rounds"]


RULED = [
    {"repetition_penalty": 1.6, "presence_penalty": 0.7, "frequency_penalty": 0.5},
    {"logit_bias": {3: 2.0, 10: -50.0}, "allowed_token_ids": list(range(60))},
    {"min_tokens": 6, "stop_token_ids": [4, 11], "frequency_penalty": 1.2},
    {},
]


@pytest.mark.parametrize("drafter", ["eagle", "draft_model"])
@pytest.mark.parametrize(("method", "temperature"), [("coupled", 1.0), ("standard", 0.0)])
def test_penalised_requests_ride_graphed_rounds(
    model_dir, dirs, prompts, drafter, method, temperature
):
    """Requests with penalties, a logit bias, allowed_token_ids and min_tokens beside one
    without decode in graphed rounds (their rules in their slots on the device, the output
    counts advanced inside the graph) and emit plain decoding's tokens (coupled at T = 1,
    greedy), and the op-by-op rounds' (enforce_eager): the rules' graph == op by op, bit for
    bit in the tokens."""
    params = [
        SamplingParams(
            temperature=temperature, max_tokens=32, ignore_eos=True, seed=60 + i, **RULED[i % 4]
        )
        for i in range(len(prompts))
    ]
    spec = spec_for(drafter, dirs, method, adaptive=True)
    plain, _ = generate(model_dir, prompts, params, None)
    graphed, llm = generate(model_dir, prompts, params, spec, async_scheduling=True)
    eager, _ = generate(model_dir, prompts, params, spec, async_scheduling=True, enforce_eager=True)
    assert graphed == plain and eager == plain
    loop = llm.get_metrics()["loop"]
    assert loop["num_graph_rounds"] > 0 and loop["num_sync_steps"] == 0
    assert any(key[-1] for key in llm.engine._rounds.graph_cache.graphs)  # a ruled graph ran


@pytest.mark.parametrize(("method", "temperature"), [("coupled", 1.0), ("standard", 0.0)])
def test_requests_the_rounds_cannot_take_decode_beside_graphed_rounds(
    model_dir, dirs, prompts, method, temperature, tmp_path
):
    """Requests with a multi-token bad word (its state on the host) decode beside the graphed
    rounds, one plain token each in the overlapped steps between two rounds, while the others
    take the rounds: every request emits plain decoding's tokens (coupled at T = 1, greedy),
    graphed and op by op (enforce_eager); no step is synchronous."""
    import shutil

    from tokenizers import Tokenizer, models, pre_tokenizers

    worded = tmp_path / "worded"  # the tiny Llama with a word-level tokenizer ("b c": two words)
    shutil.copytree(model_dir, worded)
    vocab = {chr(ord("a") + i % 26) * (1 + i // 26): i for i in range(VOCAB)}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="a"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(worded / "tokenizer.json"))
    params = [
        SamplingParams(
            temperature=temperature,
            max_tokens=32,
            ignore_eos=True,
            seed=80 + i,
            bad_words=["b c"] if i % 3 == 0 else None,
        )
        for i in range(len(prompts))
    ]
    spec = spec_for("eagle", dirs, method, adaptive=True)
    plain, _ = generate(worded, prompts, params, None)
    graphed, llm = generate(worded, prompts, params, spec, async_scheduling=True)
    eager, _ = generate(worded, prompts, params, spec, async_scheduling=True, enforce_eager=True)
    assert graphed == plain and eager == plain
    loop = llm.get_metrics()["loop"]
    assert loop["num_graph_rounds"] > 0 and loop["num_sync_steps"] == 0
    assert loop["num_side_rows"] > 0  # the bad words' requests decoded beside the rounds


@pytest.mark.parametrize("drafter", ["eagle", "dspark"])
def test_adaptive_rounds_keep_coupled_and_greedy_exact(model_dir, dirs, prompts, drafter):
    for method, temperature in (("coupled", 1.0), ("standard", 0.0)):
        params = SamplingParams(temperature=temperature, max_tokens=40, ignore_eos=True, seed=3)
        plain, _ = generate(model_dir, prompts, params, None)
        spec = spec_for(drafter, dirs, method, adaptive=True)
        got, llm = generate(model_dir, prompts, params, spec)
        assert got == plain
        assert llm.get_metrics()["loop"]["num_graph_rounds"] > 0


@pytest.mark.parametrize("drafter", ["ngram", "eagle", "dflash"])
def test_the_plain_arm_keeps_coupled_and_greedy_exact(model_dir, dirs, prompts, drafter):
    """The policy forced in and out of its plain arm (6 plain overlapped steps, 6 graphed
    rounds, ...; the plain steps of EAGLE/DFlash capture the target's features in their decode
    graph): coupled and greedy output equals plain decoding's, and the drafter keeps up."""
    from specdec.engine.spec_policy import PLAIN, SpeculationPolicy

    class Scripted(SpeculationPolicy):
        def _choose(self, bucket, remaining=None, in_rounds=True, *_beside):
            return PLAIN if (self._rounds // 6) % 2 == 0 else (3, 0, 2)[self._rounds % 3]

    for method, temperature in (("coupled", 1.0), ("standard", 0.0)):
        params = SamplingParams(temperature=temperature, max_tokens=40, ignore_eos=True, seed=3)
        plain, _ = generate(model_dir, prompts, params, None)
        spec = {**spec_for(drafter, dirs, method, adaptive=True), "plain_arm": True}
        args = {"max_model_len": 96, "block_size": 4, "num_kv_blocks": 512}
        llm = LLM(str(model_dir), speculative_config=spec, device="cuda", dtype="float32", **args)
        llm.engine.policy = Scripted(3, plain_arm=True)
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert got == plain
        loop = llm.get_metrics()["loop"]
        assert loop["num_plain_arm_steps"] > 0 and loop["num_graph_rounds"] > 0


def test_eagle_rounds_past_split_kv_length_emit_the_synchronous_tokens(
    model_dir, head_dir, tmp_path
):
    """With a cache of long contexts (max_model_len >= SPLIT_KV_ROUNDS_FROM) the head attends
    with split-KV, as the target does, in its eager steps and its graphs alike: on a
    2,500-token prompt (three partitions) the graphed rounds, the op-by-op rounds and the
    synchronous step emit the same tokens, greedy and sampled."""
    import gc
    import json
    import shutil

    import torch

    from specdec.models.split_kv import SPLIT_KV_ROUNDS_FROM

    long_dir = tmp_path / "long-target"
    shutil.copytree(model_dir, long_dir)
    config = json.loads((long_dir / "config.json").read_text())
    config["max_position_embeddings"] = SPLIT_KV_ROUNDS_FROM + 4096
    (long_dir / "config.json").write_text(json.dumps(config))
    prompt = prompt_tokens(VOCAB, [2500], seed=5)
    spec = {"method": "eagle", "model": str(head_dir), "num_speculative_tokens": 3}
    spec["adaptive"] = False
    args = {"max_model_len": config["max_position_embeddings"], "block_size": 16}
    for params in (
        SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
        SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True, seed=4),
    ):
        runs = {}
        for name, extra in (
            ("sync", {"async_scheduling": False}),
            ("graphed", {"async_scheduling": True}),
            ("eager", {"async_scheduling": True, "enforce_eager": True}),
        ):
            llm = LLM(
                str(long_dir), speculative_config=spec, device="cuda", dtype="float32",
                gpu_memory_utilization=0.3, **args, **extra,
            )  # fmt: skip
            assert llm.engine.drafter.num_partitions > 1
            runs[name] = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
            if name != "sync":
                assert llm.get_metrics()["loop"]["num_device_rounds"] > 0
            del llm
            gc.collect()
            torch.cuda.empty_cache()
        assert runs["graphed"] == runs["sync"], params
        assert runs["eager"] == runs["sync"], params


@pytest.mark.parametrize("drafter", ["eagle", "ngram"])
@pytest.mark.parametrize("adaptive", [False, True])
def test_graphed_rounds_carry_logprobs(model_dir, prompts, request, drafter, adaptive):
    """Requests that ask for logprobs (0, 1, 3 top entries; one asks for none) ride the graphed
    rounds: coupled tokens, logprob ids and ranks equal plain decoding's exactly; logprob values
    within 1e-5 (the tiny float model's cuBLAS products may give a row's logits other last bits
    on this path: BENCHMARKS area 0, the float-bursts gap)."""
    tops = [0, 1, 3, None, 2, 0]
    params = [
        SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True, seed=60 + i, logprobs=n)
        for i, n in enumerate(tops)
    ]
    dirs = request.getfixturevalue("dirs") if drafter == "eagle" else {}  # trains a head
    spec = spec_for(drafter, dirs, "coupled", adaptive=adaptive)

    def run(spec, **kwargs):
        args = {"max_model_len": 96, "block_size": 4, "num_kv_blocks": 512, **kwargs}
        llm = LLM(str(model_dir), speculative_config=spec, device="cuda", dtype="float32", **args)
        outputs = llm.generate(prompts, params, use_tqdm=False)
        return [o.outputs[0] for o in outputs], llm

    plain, _ = run(None)
    graphed, llm = run(spec, async_scheduling=True)
    loop = llm.get_metrics()["loop"]
    assert loop["num_graph_rounds"] > 0 and loop["num_graph_rounds"] == loop["num_device_rounds"]
    for want, got, n in zip(plain, graphed, tops, strict=True):
        assert got.token_ids == want.token_ids
        if n is None:
            assert got.logprobs is None
            continue
        assert len(got.logprobs) == len(want.token_ids)
        for a, b in zip(want.logprobs, got.logprobs, strict=True):
            assert list(a) == list(b)  # the same ids, in rank order
            for token, entry in a.items():
                assert b[token].rank == entry.rank
                assert b[token].logprob == pytest.approx(entry.logprob, abs=1e-5)
