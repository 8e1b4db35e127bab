"""The engine end to end on a tiny random-weight Llama: speculation never changes what is emitted
where it must not (greedy, coupled), and seeded runs replay alone, in a batch, permuted and after
preemption."""

from __future__ import annotations

import pytest
import torch

from models_fixtures import make_hf_model, prompt_tokens, save_hf_model
from specdec.engine.llm import LLM
from specdec.models import load_model, prompt_logits
from specdec.sampling import SamplingParams

VOCAB = 97
LENGTHS = [5, 9, 14, 3]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_hf_model(make_hf_model("llama"), tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def prompts():
    return prompt_tokens(VOCAB, LENGTHS, seed=3)


def make_llm(model_dir, spec=None, **kwargs):
    args = {"max_model_len": 64, "block_size": 4, **kwargs}
    return LLM(str(model_dir), speculative_config=spec, **args)


def token_ids(outputs):
    return [o.outputs[0].token_ids for o in outputs]


GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
SAMPLED = SamplingParams(temperature=1.0, max_tokens=24, seed=11, ignore_eos=True)


@pytest.fixture(scope="module")
def plain_greedy(model_dir, prompts):
    return token_ids(make_llm(model_dir).generate(prompts, GREEDY, use_tqdm=False))


@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("drafter", ["ngram", "truncated:1", "truncated:2"])
@pytest.mark.parametrize("method", ["standard", "block"])
def test_greedy_speculation_equals_greedy_plain(
    model_dir, prompts, plain_greedy, k, drafter, method
):
    spec = {"num_speculative_tokens": k, "rejection_sample_method": method}
    if drafter == "ngram":
        spec["method"] = "ngram"
    else:
        spec.update(method="draft_model", model=drafter)
    llm = make_llm(model_dir, spec)
    assert token_ids(llm.generate(prompts, GREEDY, use_tqdm=False)) == plain_greedy
    assert llm.get_metrics()["num_drafts"] > 0


@pytest.mark.parametrize("drafter", ["ngram", "truncated:1"])
@pytest.mark.parametrize("draft_sample_method", ["probabilistic", "greedy"])
def test_coupled_sampling_equals_plain_sampling(model_dir, prompts, drafter, draft_sample_method):
    plain = token_ids(make_llm(model_dir).generate(prompts, SAMPLED, use_tqdm=False))
    spec = {
        "num_speculative_tokens": 4,
        "rejection_sample_method": "coupled",
        "draft_sample_method": draft_sample_method,
    }
    spec.update(method="ngram") if drafter == "ngram" else spec.update(
        method="draft_model", model=drafter
    )
    llm = make_llm(model_dir, spec)
    assert token_ids(llm.generate(prompts, SAMPLED, use_tqdm=False)) == plain
    metrics = llm.get_metrics()
    assert metrics["num_drafts"] > 0
    if drafter != "ngram":  # n-grams of a random tiny model rarely match its samples
        assert metrics["num_accepted_tokens"] > 0


@pytest.mark.parametrize("method", ["standard", "block"])
def test_seeded_runs_replay_alone_batched_permuted_and_preempted(model_dir, prompts, method):
    spec = {
        "method": "draft_model",
        "model": "truncated:2",
        "num_speculative_tokens": 4,
        "rejection_sample_method": method,
        "adaptive": False,  # standard/block replay with K pinned (the policy's K depends on timing)
    }
    llm = make_llm(model_dir, spec)
    batched = token_ids(llm.generate(prompts, SAMPLED, use_tqdm=False))
    assert token_ids(llm.generate(prompts, SAMPLED, use_tqdm=False)) == batched
    assert token_ids(llm.generate(prompts[::-1], SAMPLED, use_tqdm=False))[::-1] == batched
    for i, prompt in enumerate(prompts):
        assert token_ids(llm.generate(prompt, SAMPLED, use_tqdm=False)) == [batched[i]]
    # A cache of 12 blocks x 4 slots cannot hold the four requests at once: some are preempted
    # and recomputed, and must still emit the same tokens.
    small = make_llm(model_dir, spec, num_kv_blocks=12, max_model_len=48)
    assert token_ids(small.generate(prompts, SAMPLED, use_tqdm=False)) == batched
    assert small.engine.scheduler.allocator.num_free_blocks == 12


def test_preemption_happens_with_a_small_cache(model_dir, prompts):
    llm = make_llm(model_dir, num_kv_blocks=12, max_model_len=48)
    seen = []
    original = llm.engine.scheduler.schedule

    def spy():
        out = original()
        seen.extend(out.preempted)
        return out

    llm.engine.scheduler.schedule = spy
    plain = token_ids(make_llm(model_dir).generate(prompts, SAMPLED, use_tqdm=False))
    assert token_ids(llm.generate(prompts, SAMPLED, use_tqdm=False)) == plain
    assert seen, "the cache was meant to be too small for all requests at once"
    assert llm.engine.num_preemptions == len(seen)  # what /metrics exports


def test_rolled_back_cache_equals_a_cache_that_never_saw_the_drafts(model_dir, prompts):
    """After verification, the K/V kept for a request are exactly those of its committed tokens:
    running the committed sequence from scratch gives the same next-token logits."""
    spec = {"method": "draft_model", "model": "truncated:1", "num_speculative_tokens": 4}
    llm = make_llm(model_dir, spec)
    engine = llm.engine
    engine.add_request(prompts[2], SAMPLED)
    request = engine.groups["0"].samples[0]
    while len(request.output_token_ids) < 10 and not request.status.finished:
        engine.step()
    assert engine.stats.num_draft_tokens > engine.stats.num_accepted_tokens  # some rejections
    from specdec.runner.model_runner import StepInput

    tokens = request.all_token_ids
    cached = engine.runner.run(
        [StepInput([tokens[-1]], request.num_tokens - 1, request.block_ids, 1)]
    )[0]
    model = load_model(model_dir).model
    fresh = prompt_logits(model, [tokens])[0][-1:]
    torch.testing.assert_close(cached, fresh, rtol=0, atol=1e-5)


def test_stop_conditions_and_outputs(model_dir, prompts):
    llm = make_llm(model_dir)
    plain = token_ids(llm.generate(prompts[0], GREEDY, use_tqdm=False))[0]
    stop_at = plain[3]
    out = llm.generate(
        prompts[0],
        SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[stop_at], logprobs=2),
        use_tqdm=False,
    )[0]
    first = plain.index(stop_at)
    completion = out.outputs[0]
    assert completion.token_ids == plain[: first + 1]
    assert completion.finish_reason == "stop" and completion.stop_reason == stop_at
    assert len(completion.logprobs) == len(completion.token_ids)
    # vLLM's shape: the top 2 by rank, plus the generated token when it is not among them.
    for entry, token in zip(completion.logprobs, completion.token_ids, strict=True):
        assert token in entry and len(entry) == 2 + (entry[token].rank > 2)
        assert [e.rank for e in entry.values()][:2] == [1, 2]
    assert out.seed is not None
    n_out = llm.generate(prompts[0], SamplingParams(n=3, max_tokens=6, seed=5), use_tqdm=False)[0]
    assert len(n_out.outputs) == 3
    assert len({tuple(o.token_ids) for o in n_out.outputs}) > 1  # samples differ


@pytest.mark.parametrize("chunk", [64, 4])
def test_logprobs_and_prompt_logprobs_are_vllms_shape_and_values(model_dir, prompts, chunk):
    """Sample and prompt logprobs equal log-softmax of a fresh forward pass, with vLLM's ranks
    (1 + ids strictly more likely), whether the prompt is prefilled whole or in chunks of 4."""
    llm = make_llm(model_dir, max_num_batched_tokens=chunk)
    prompt = prompts[2]
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=5, logprobs=3, prompt_logprobs=2)
    out = llm.generate(prompt, params, use_tqdm=False)[0]
    completion = out.outputs[0]
    sequence = prompt + completion.token_ids
    model = load_model(model_dir).model
    logp = prompt_logits(model, [sequence])[0].log_softmax(-1)  # row i predicts token i + 1
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    entries = [(p, out.prompt_logprobs[p], 2) for p in range(1, len(prompt))]
    entries += [(len(prompt) + i, e, 3) for i, e in enumerate(completion.logprobs)]
    for position, entry, num_top in entries:
        row = logp[position - 1]
        token = sequence[position]
        top = row.topk(num_top)
        assert list(entry)[:num_top] == top.indices.tolist()
        assert entry[token].rank == int((row > row[token]).sum()) + 1
        for t, value in entry.items():
            assert value.logprob == pytest.approx(float(row[t]), abs=1e-4)
    total = sum(
        e[t].logprob for e, t in zip(completion.logprobs, completion.token_ids, strict=True)
    )
    assert completion.cumulative_logprob == pytest.approx(total)
    assert (
        llm.generate(prompt, SamplingParams(max_tokens=2), use_tqdm=False)[0].prompt_logprobs
        is None
    )


def test_unseeded_requests_record_a_seed_that_replays(model_dir, prompts):
    llm = make_llm(model_dir)
    params = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    first = llm.generate(prompts[1], params, use_tqdm=False)[0]
    replay = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True, seed=first.seed)
    assert llm.generate(prompts[1], replay, use_tqdm=False)[0].outputs[0].token_ids == (
        first.outputs[0].token_ids
    )


def test_bad_input_is_rejected_and_nothing_is_queued(model_dir, prompts):
    llm = make_llm(model_dir)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate([prompts[0], [VOCAB + 5]], GREEDY)
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([prompts[0], [1] * 64], GREEDY)
    with pytest.raises(ValueError, match="no speculative_config"):
        llm.generate(prompts[0], GREEDY, speculative={"enabled": True})
    assert llm.engine.tokenizer is None  # stop strings could never match: refused, not ignored
    with pytest.raises(ValueError, match="stop strings need the model's tokenizer"):
        llm.generate(prompts[0], SamplingParams(temperature=0, max_tokens=4, stop=["a"]))
    assert not llm.engine.has_unfinished
    assert llm.engine.allocator.num_free_blocks == llm.engine.allocator.num_blocks
    with pytest.raises(ValueError, match="unknown speculative_config keys"):
        make_llm(model_dir, {"method": "ngram", "num_spec": 3})
    spec = make_llm(model_dir, {"method": "ngram"})
    with pytest.raises(ValueError, match='the verifier is "rejection_sample_method"'):
        spec.generate(prompts[0], GREEDY, speculative={"method": "block"})


def test_per_request_speculation_in_one_batch(model_dir, prompts):
    spec = {"method": "draft_model", "model": "truncated:2", "num_speculative_tokens": 3}
    llm = make_llm(model_dir, spec)
    overrides = [
        None,
        {"enabled": False},
        {"num_speculative_tokens": 1, "rejection_sample_method": "block"},
        {"rejection_sample_method": "coupled"},
    ]
    out = llm.generate(prompts, SAMPLED, speculative=overrides, use_tqdm=False)
    assert out[1].spec_decode_stats["num_drafts"] == 0
    assert out[0].spec_decode_stats["num_drafts"] > 0
    assert (
        max(
            out[2].spec_decode_stats["num_draft_tokens"]
            / max(out[2].spec_decode_stats["num_drafts"], 1),
            0,
        )
        <= 1
    )
    plain = token_ids(make_llm(model_dir).generate(prompts, SAMPLED, use_tqdm=False))
    assert token_ids(out)[1] == plain[1]  # speculation off: plain sampling
    assert token_ids(out)[3] == plain[3]  # coupled: token-identical to plain sampling


def test_a_request_longer_than_the_cache_finishes_instead_of_hanging(model_dir, prompts):
    with pytest.warns(UserWarning, match="max_model_len lowered"):
        llm = make_llm(model_dir, num_kv_blocks=4)  # 16 slots
    params = SamplingParams(temperature=0, max_tokens=None, ignore_eos=True)
    out = llm.generate(prompts[1], params, use_tqdm=False)[0]
    assert out.outputs[0].finish_reason == "length"
    assert len(out.prompt_token_ids) + len(out.outputs[0].token_ids) == 16
    assert llm.engine.allocator.num_free_blocks == 4


def test_abort_frees_blocks_and_forgets_the_request(model_dir, prompts):
    llm = make_llm(model_dir, {"method": "draft_model", "model": "truncated:1"})
    engine = llm.engine
    request_id = engine.add_request(prompts[2], SamplingParams(max_tokens=20, n=2))
    engine.step()
    engine.step()
    engine.abort(request_id)
    assert not engine.has_unfinished and engine.groups == {} and engine.outputs.empty
    assert engine.allocator.num_free_blocks == engine.allocator.num_blocks
    assert engine.drafter.allocator.num_free_blocks == engine.drafter.allocator.num_blocks
    engine.abort(request_id)  # unknown ids are ignored


def test_sampled_drafts_reach_verify_with_their_log_normalisers(model_dir, prompts, monkeypatch):
    """The engine hands `verify` the draft log-normalisers the drafter recorded (exactly those of
    the draft logits it passes), and nothing for one-hot drafts."""
    from specdec.engine import emitter

    seen = []
    original = emitter.check_verify_inputs

    def spy(*args, **kwargs):
        inputs = original(*args, **kwargs)
        seen.append(inputs)
        return inputs

    monkeypatch.setattr(emitter, "check_verify_inputs", spy)
    spec = {"method": "draft_model", "model": "truncated:1", "num_speculative_tokens": 3}
    make_llm(model_dir, spec).generate(prompts[:2], SAMPLED, use_tqdm=False)
    assert seen
    for inputs in seen:
        assert inputs.draft_logsumexp is not None
        for b, n in enumerate(inputs.num_draft.tolist()):
            torch.testing.assert_close(
                inputs.draft_logsumexp[b, :n], inputs.draft_logits[b, :n].logsumexp(-1)
            )
    seen.clear()
    spec["draft_sample_method"] = "greedy"
    make_llm(model_dir, spec).generate(prompts[:2], SAMPLED, use_tqdm=False)
    assert seen and all(inputs.draft_logsumexp is None for inputs in seen)
