"""The speculation policy's plain arm (`speculative_config.plain_arm`): when the policy picks P,
the engine leaves device rounds and decodes the speculative batch with plain overlapped steps
(sampled as plain decoding samples, keyed by (seed, position)), then re-enters rounds when
another arm is explored or wins. Forced decisions (a scripted policy, or injected costs) show:
greedy and coupled output equals plain decoding's; seeded standard/block output replays under
the same decisions; requests join and finish while in plain mode; the drafter catches up on what
it did not see (n-gram from the host tokens, EAGLE from the target features the plain steps
captured) and a negative control without that catch-up fails; `adaptive: false` changes nothing."""

from __future__ import annotations

import itertools

import pytest
import torch

from eagle_fixtures import trained_head
from models_fixtures import make_hf_model, prompt_tokens, save_hf_model
from specdec.engine import feature_log
from specdec.engine.config import EngineConfig, SpeculativeConfig
from specdec.engine.llm_engine import LLMEngine
from specdec.engine.spec_policy import PLAIN, SpeculationPolicy
from specdec.sampling import SamplingParams

VOCAB = 97


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_hf_model(make_hf_model("llama"), tmp_path_factory.mktemp("tiny-plain-arm"))


@pytest.fixture(scope="module")
def head_dir(model_dir, tmp_path_factory):
    return trained_head(model_dir, tmp_path_factory.mktemp("eagle-plain-arm"))


@pytest.fixture(scope="module")
def dflash_dir(model_dir, tmp_path_factory):
    from block_drafter_fixtures import save_tiny_block_drafter
    from specdec.models import load_model

    target = load_model(model_dir).model
    root = tmp_path_factory.mktemp("dflash-plain-arm")
    return save_tiny_block_drafter(root / "dflash", "dflash", target, block_size=4, noise=0.05)


@pytest.fixture(scope="module")
def prompts():
    return [p + p for p in prompt_tokens(VOCAB, [5, 9, 14, 3], seed=3)]


def spec_for(drafter, head_dir, method, adaptive=True, plain_arm=True):
    spec = {
        "num_speculative_tokens": 3,
        "rejection_sample_method": method,
        "adaptive": adaptive,
        "plain_arm": plain_arm,
    }
    if drafter == "eagle":
        spec.update(method="eagle", model=str(head_dir))
    elif drafter == "draft_model":
        spec.update(method="draft_model", model="truncated:1")
    else:
        spec["method"] = "ngram"
    return spec


class ScriptedPolicy(SpeculationPolicy):
    """A policy whose n-th choice is script(n) (observations still recorded)."""

    def __init__(self, max_k, script):
        super().__init__(max_k, plain_arm=True)
        self.script = script

    def _choose(self, bucket, remaining=None, in_rounds=True, *_beside):
        return self.script(self._rounds)


def alternate(n: int) -> int:
    """6 plain steps, then 6 rounds of K = 3, 0, 2, ...: in and out of plain mode."""
    return PLAIN if (n // 6) % 2 == 0 else (3, 0, 2)[n % 3]


def make_engine(model_dir, spec, async_scheduling=True, script=None, **kwargs):
    args = {"model": str(model_dir), "max_model_len": 96, "block_size": 4, **kwargs}
    config = EngineConfig(**args, async_scheduling=async_scheduling)
    spec = SpeculativeConfig.from_dict(spec) if spec is not None else None
    engine = LLMEngine(config, spec)
    if script is not None:
        engine.policy = ScriptedPolicy(spec.num_speculative_tokens, script)
    return engine


def drive(engine, requests, late=()):
    for prompt, params in requests:
        engine.add_request(prompt, params)
    finals, steps = {}, 0
    while engine.has_unfinished:
        outputs = engine.step(only_finished=True)
        steps += 1
        if steps == 5:
            for prompt, params in late:
                engine.add_request(prompt, params)
        for out in outputs:
            if out.finished:
                finals[out.request_id] = [(o.token_ids, o.finish_reason) for o in out.outputs]
    return finals


def params_for(temperature, seed, max_tokens=24, **kwargs):
    filters = {"top_k": 20, "top_p": 0.9} if temperature > 0 else {}
    return SamplingParams(
        temperature=temperature,
        max_tokens=max_tokens,
        ignore_eos=True,
        seed=seed,
        **filters,
        **kwargs,
    )


def plain_decoding(model_dir, requests, late=()):
    return drive(make_engine(model_dir, None, async_scheduling=False), requests, late)


@pytest.mark.parametrize("drafter", ["ngram", "eagle"])
@pytest.mark.parametrize("method, temperature", [("coupled", 1.0), ("standard", 0.0)])
def test_coupled_and_greedy_equal_plain_decoding_in_and_out_of_plain_mode(
    model_dir, head_dir, prompts, drafter, method, temperature
):
    requests = [(p, params_for(temperature, 50 + i)) for i, p in enumerate(prompts)]
    expected = plain_decoding(model_dir, requests)
    engine = make_engine(model_dir, spec_for(drafter, head_dir, method), script=alternate)
    assert drive(engine, requests) == expected
    loop = engine.loop_stats.as_dict()  # LLM.get_metrics()["loop"]
    assert loop["num_plain_arm_steps"] > 0 and loop["num_device_rounds"] > 0
    assert loop["k_chosen"][-1] == loop["num_plain_arm_steps"]


@pytest.mark.parametrize("drafter", ["ngram", "eagle"])
@pytest.mark.parametrize("method", ["standard", "block"])
def test_seeded_standard_and_block_replay_under_the_same_decisions(
    model_dir, head_dir, prompts, drafter, method
):
    requests = [(p, params_for(1.0, 70 + i)) for i, p in enumerate(prompts)]
    spec = spec_for(drafter, head_dir, method)
    first = drive(make_engine(model_dir, spec, script=alternate), requests)
    again = drive(make_engine(model_dir, spec, script=alternate), requests)
    assert first == again
    # A plain step samples as plain decoding does: all-plain output is plain decoding's.
    always_plain = drive(make_engine(model_dir, spec, script=lambda n: PLAIN), requests)
    assert always_plain == plain_decoding(model_dir, requests)


@pytest.mark.parametrize("drafter", ["ngram", "eagle"])
def test_not_adaptive_the_plain_arm_changes_nothing(model_dir, head_dir, prompts, drafter):
    requests = [(p, params_for(1.0, 90 + i)) for i, p in enumerate(prompts)]
    spec = spec_for(drafter, head_dir, "standard", adaptive=False)
    sync = drive(make_engine(model_dir, spec, async_scheduling=False), requests)
    engine = make_engine(model_dir, spec)
    assert drive(engine, requests) == sync
    assert engine.loop_stats.num_plain_arm_steps == 0


@pytest.mark.parametrize("drafter", ["ngram", "eagle"])
def test_requests_join_and_finish_in_plain_mode(model_dir, head_dir, prompts, drafter):
    """Different max_tokens and stop tokens end requests while plain steps are in flight; a
    late request makes the batch go back to the scheduler."""
    stop_ids = list(range(5, VOCAB, 7))
    requests = [
        (prompts[0], params_for(1.0, 3, max_tokens=30, stop_token_ids=stop_ids)),
        (prompts[1], params_for(1.0, 4, max_tokens=7)),
        (prompts[2], params_for(0.0, 5, max_tokens=13)),
        (prompts[3], params_for(1.0, 6, max_tokens=20)),
    ]
    late = [(prompts[1], params_for(0.7, 9, max_tokens=11))]
    expected = plain_decoding(model_dir, requests, late)
    mostly_plain = lambda n: PLAIN if n % 7 else 3  # noqa: E731
    engine = make_engine(model_dir, spec_for(drafter, head_dir, "coupled"), script=mostly_plain)
    assert drive(engine, requests, late) == expected
    assert any(final[0][1] == "stop" for final in expected.values())
    assert engine.loop_stats.num_plain_arm_steps > 0
    assert engine.allocator.num_free_blocks == engine.allocator.num_blocks


@pytest.mark.parametrize("mode", ["plain arm", "rounds (control)"])
def test_logprobs_are_kept_in_plain_mode(model_dir, head_dir, prompts, mode):
    """A request asking for logprobs keeps them through the plain arm's steps as through the
    rounds: every token has its entry, equal to plain decoding's (s40 and before, a plain-arm
    step computed them and read its tokens back without them). The control runs the same
    requests through the rounds only."""
    requests = [
        (p, params_for(1.0, 80 + i, max_tokens=12, logprobs=2)) for i, p in enumerate(prompts)
    ]

    def run(engine):
        for prompt, params in requests:
            engine.add_request(prompt, params)
        finals = {}
        while engine.has_unfinished:
            for out in engine.step(only_finished=True):
                if out.finished:
                    finals[out.request_id] = out.outputs[0]
        return finals

    expected = run(make_engine(model_dir, None, async_scheduling=False))
    script = (lambda n: PLAIN) if mode == "plain arm" else (lambda n: 2)
    engine = make_engine(model_dir, spec_for("eagle", head_dir, "coupled"), script=script)
    got = run(engine)
    assert (engine.loop_stats.num_plain_arm_steps > 0) == (mode == "plain arm")
    for request_id, output in expected.items():
        mine = got[request_id]
        assert mine.token_ids == output.token_ids
        assert mine.logprobs is not None and len(mine.logprobs) == len(output.token_ids)
        for entry, reference in zip(mine.logprobs, output.logprobs, strict=True):
            assert entry.keys() == reference.keys()
            for token, logprob in reference.items():
                assert abs(entry[token].logprob - logprob.logprob) < 1e-4


def test_injected_costs_make_the_real_policy_go_plain(model_dir, head_dir, prompts, monkeypatch):
    """The real policy, observing a plain step as 1 s and a round as 3 s (drafts accepted or
    not, a round then yields fewer tokens per second): it settles on P, re-exploring now and
    then, and coupled output stays plain decoding's."""
    original = SpeculationPolicy.observe

    def observe(self, bucket, k, seconds, outcomes, interrupted=False, requests=None):
        original(self, bucket, k, 1.0 if k == PLAIN else 3.0, outcomes, requests=requests)

    monkeypatch.setattr(SpeculationPolicy, "observe", observe)
    requests = [(p, params_for(1.0, 60 + i, max_tokens=40)) for i, p in enumerate(prompts)]
    expected = plain_decoding(model_dir, requests)
    engine = make_engine(model_dir, spec_for("eagle", head_dir, "coupled"))
    engine.policy.explore_every = 16
    engine.policy.explore_run, engine.policy.ramp = 3, 1  # explorations short beside 40 steps
    assert drive(engine, requests) == expected
    chosen = engine.policy.chosen
    assert chosen[PLAIN] > sum(n for k, n in chosen.items() if k != PLAIN)


@pytest.mark.parametrize("drafter", ["eagle", "dflash"])
def test_negative_control_without_the_plain_steps_features_the_drafter_cannot_draft(
    model_dir, head_dir, dflash_dir, prompts, monkeypatch, drafter
):
    """If the plain steps' target features were not delivered, the EAGLE head (DFlash) would
    have nothing to draft the next round from (its state stops before the plain steps' tokens):
    the engine refuses rather than drafting from stale state."""
    monkeypatch.setattr(feature_log.FeatureLog, "add_rows", lambda self, *args: None)
    requests = [(p, params_for(1.0, 50 + i)) for i, p in enumerate(prompts)]
    spec = spec_for(drafter, head_dir, "coupled")
    if drafter == "dflash":
        spec.update(method="dflash", model=str(dflash_dir))
    engine = make_engine(model_dir, spec, script=alternate)
    with pytest.raises(ValueError, match=r"no target features to draft from|has target features"):
        drive(engine, requests)


def target_features(model, tokens, layers):
    """[T, F] features of the whole sequence from one prefill of the target."""
    from specdec.models import AttentionMetadata

    kv = model.allocate_kv_cache(-(-len(tokens) // 4), 4)
    attn = AttentionMetadata.build([len(tokens)], [len(tokens)], [list(range(kv.num_blocks))], 4)
    with torch.inference_mode():
        _, out = model.forward_with_layers(
            torch.tensor(tokens), torch.arange(len(tokens)), attn, kv, layers
        )
    return torch.cat(out, dim=-1)


@pytest.mark.parametrize("corrupt", [False, True])
def test_eagle_gets_the_target_features_of_every_plain_step_token(
    model_dir, head_dir, prompts, monkeypatch, corrupt
):
    """Every feature handed to the EAGLE head (the prompt's, then each plain step's input
    token's) equals the target's own feature of that position in the final sequence. Negative
    control (`corrupt`): plain steps delivering zeros instead must fail the comparison."""
    if corrupt:
        original = feature_log.FeatureLog.add_rows

        def zeros(self, requests, starts, rows):
            original(self, requests, starts, torch.zeros_like(rows))

        monkeypatch.setattr(feature_log.FeatureLog, "add_rows", zeros)
    requests = [(p, params_for(1.0, 40 + i)) for i, p in enumerate(prompts)]
    engine = make_engine(model_dir, spec_for("eagle", head_dir, "coupled"), script=alternate)
    delivered = []
    observe = engine.drafter.observe

    def record(features):
        delivered.append(features)
        observe(features)

    engine.drafter.observe = record
    finals = drive(engine, requests)
    layers = engine.drafter.feature_layers
    worst, plain_rows = 0.0, 0
    for features in delivered:
        for request_id, start, rows in zip(
            features.request_ids, features.starts, features.features, strict=True
        ):
            index = int(request_id.split("#")[0])
            tokens = list(prompts[index]) + finals[str(index)][0][0]
            reference = target_features(engine.model, tokens, layers)[start : start + len(rows)]
            worst = max(worst, (rows.float() - reference.float()).abs().max().item())
            plain_rows += int(start >= len(prompts[index]))
    assert plain_rows > 0  # the plain steps delivered features
    assert (worst > 1e-3) == corrupt, worst


@pytest.mark.parametrize("drafter", ["draft_model", "dflash"])
def test_coupled_equals_plain_decoding_with_a_draft_model_and_dflash(
    model_dir, head_dir, dflash_dir, prompts, drafter
):
    """The draft model catches up on the plain steps' tokens from the host tokens; DFlash from
    the plain steps' target features (its device `begin` refuses a context that stops short)."""
    requests = [(p, params_for(1.0, 20 + i)) for i, p in enumerate(prompts)]
    expected = plain_decoding(model_dir, requests)
    spec = spec_for(drafter, head_dir, "coupled")
    if drafter == "dflash":
        spec.update(method="dflash", model=str(dflash_dir))
    engine = make_engine(model_dir, spec, script=alternate)
    assert drive(engine, requests) == expected
    loop = engine.loop_stats
    assert loop.num_plain_arm_steps > 0 and loop.num_device_rounds > 0


def test_a_batch_kept_plain_from_the_start_never_enters_the_rounds(
    model_dir, head_dir, prompts, monkeypatch
):
    """The policy is asked before the rounds are entered: a batch it keeps in the plain arm
    from its first decode step never pays the drafter's catch-up (`DeviceRounds.begin` is not
    called) and emits plain decoding's tokens. Control: a policy that picks a K first enters."""
    from specdec.engine.device_round import DeviceRounds

    begins = []
    original = DeviceRounds.begin
    monkeypatch.setattr(
        DeviceRounds, "begin", lambda self, reqs: begins.append(len(reqs)) or original(self, reqs)
    )
    requests = [(p, params_for(1.0, 30 + i)) for i, p in enumerate(prompts)]
    spec = spec_for("eagle", head_dir, "coupled")
    engine = make_engine(model_dir, spec, script=lambda n: PLAIN)
    assert drive(engine, requests) == plain_decoding(model_dir, requests)
    assert begins == [] and engine.loop_stats.num_plain_arm_steps > 0
    drive(make_engine(model_dir, spec, script=lambda n: 2), requests)
    assert begins


def test_the_policy_sees_each_requests_remaining_budget_when_nothing_waits(
    model_dir, head_dir, prompts
):
    """The horizon handed to the policy: per running request, max_tokens less what it emitted
    (the prefill's token at the first decision), and None while a request waits to join."""
    seen = []

    class Recording(ScriptedPolicy):
        def _choose(self, bucket, remaining=None, in_rounds=True, *_beside):
            seen.append((in_rounds, None if remaining is None else list(remaining)))
            return super()._choose(bucket, remaining, in_rounds, *_beside)

    requests = [(p, params_for(1.0, 30 + i, max_tokens=10 + i)) for i, p in enumerate(prompts)]
    engine = make_engine(model_dir, spec_for("eagle", head_dir, "coupled"))
    engine.policy = Recording(3, alternate)
    drive(engine, requests)
    assert seen[0] == (False, [9, 10, 11, 12])  # entering: one token emitted by the prefill
    assert all(r is None or max(r) <= 12 for _, r in seen) and any(i for i, _ in seen)
    budgets = [r for _, r in seen if r is not None]
    assert all(later[-1] <= earlier[-1] for earlier, later in itertools.pairwise(budgets))


def test_a_batch_that_shrinks_keeps_its_bucket(model_dir, head_dir, prompts):
    """When requests of a plain visit finish, the rest re-enter the policy at the batch's
    bucket (its measured costs and captured graphs), not at a smaller one it never measured;
    a new batch starts from its own size."""
    buckets = []

    class Recording(ScriptedPolicy):
        def _choose(self, bucket, remaining=None, in_rounds=True, *_beside):
            buckets.append(bucket)
            return PLAIN

    lengths = [6, 7, 20, 21]
    requests = [
        (p, params_for(1.0, 30 + i, max_tokens=n))
        for i, (p, n) in enumerate(zip(prompts, lengths, strict=True))
    ]
    engine = make_engine(model_dir, spec_for("eagle", head_dir, "coupled"))
    engine.policy = Recording(3, alternate)
    drive(engine, requests)
    assert set(buckets) == {4}, buckets  # 2 requests left: still bucket 4
    buckets.clear()
    drive(engine, requests[:1])
    assert set(buckets) == {1}, buckets


def test_abort_in_plain_mode_keeps_the_others_and_frees_everything(model_dir, head_dir, prompts):
    requests = [(p, params_for(1.0, 30 + i)) for i, p in enumerate(prompts)]
    expected = plain_decoding(model_dir, requests)
    engine = make_engine(model_dir, spec_for("eagle", head_dir, "coupled"), script=lambda n: PLAIN)
    for prompt, params in requests:
        engine.add_request(prompt, params)
    finals, steps = {}, 0
    while engine.has_unfinished:
        outputs = engine.step(only_finished=True)
        steps += 1
        if steps == 6:
            assert engine._plain_chosen and engine._inflight is not None  # plain steps in flight
            engine.abort("1")
        for out in outputs:
            if out.finished:
                finals[out.request_id] = [(o.token_ids, o.finish_reason) for o in out.outputs]
    assert finals == {rid: final for rid, final in expected.items() if rid != "1"}
    assert engine.allocator.num_free_blocks == engine.allocator.num_blocks


def test_plain_arm_must_be_a_bool():
    assert SpeculativeConfig.from_dict({"method": "ngram"}).plain_arm is False
    with pytest.raises(ValueError, match="plain_arm must be true or false"):
        SpeculativeConfig.from_dict({"method": "ngram", "plain_arm": "yes"})


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "rounds"])
def test_the_policy_keeps_each_running_requests_acceptance_and_forgets_it(
    model_dir, head_dir, prompts, async_scheduling, monkeypatch
):
    """The real policy learns each drafting request's own acceptance from its rounds (the
    synchronous step, and the device rounds with a request joining them) and drops it when the
    request finishes, aborted ones included: nothing is left once the engine is idle."""
    engine = make_engine(
        model_dir, spec_for("eagle", head_dir, "coupled", plain_arm=False), async_scheduling
    )
    held = []
    observe = SpeculationPolicy.observe

    def spy(self, *args, **kwargs):
        observe(self, *args, **kwargs)
        held.append(set(self._requests))

    monkeypatch.setattr(SpeculationPolicy, "observe", spy)
    requests = [(p, params_for(1.0, 70 + i, max_tokens=24)) for i, p in enumerate(prompts)]
    late = [(prompts[0], params_for(1.0, 80, max_tokens=24))]
    aborted = engine.add_request(prompts[1], params_for(1.0, 81, max_tokens=60))
    engine.step()
    engine.step()
    engine.abort(aborted)
    drive(engine, requests, late)
    assert max(len(ids) for ids in held) >= 2  # several requests' own acceptance at once
    assert engine.policy._requests == {}
