"""The frames between the engine process and the HTTP process: the engine's deltas
(`LLMEngine.emit_deltas`), framed and rebuilt by `OutputAssembler`, give at every step the
`RequestOutput`s a twin engine returns (growing text, a text a stop string cut, n samples,
logprobs, prompt logprobs, an abort; the spec-decode counters arrive with the finished output),
frames carry only the step, and frames carry the snapshot. Commands (HTTP -> engine) are typed
msgpack: every kind round-trips with every `SamplingParams` field, and a malformed one fails at
decode."""

from __future__ import annotations

import dataclasses

import msgspec
import pytest

from models_fixtures import make_hf_model, prompt_tokens, save_hf_model
from specdec.core.snapshot import EngineSnapshot
from specdec.core.wire import (
    OUTPUTS,
    Abort,
    Add,
    Drain,
    OutputAssembler,
    Shutdown,
    decode_command,
    decode_frame,
    delta_row,
    encode_command,
    encode_frame,
)
from specdec.engine.config import EngineConfig
from specdec.engine.llm_engine import LLMEngine
from specdec.sampling import SamplingParams
from specdec.sampling.params import StructuredOutputsParams

VOCAB = 97


def word(token_id: int) -> str:
    """Token i's text: a letter (i mod 26), repeated 1 + i // 26 times."""
    return chr(ord("a") + token_id % 26) * (1 + token_id // 26)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """The tiny Llama with a word-level tokenizer (texts and stop strings exist)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    path = save_hf_model(make_hf_model("llama"), tmp_path_factory.mktemp("tiny-wire"))
    tokenizer = Tokenizer(models.WordLevel({word(i): i for i in range(VOCAB)}, unk_token="a"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(path / "tokenizer.json"))
    return path


def requests() -> list[tuple[list[int], SamplingParams, str]]:
    prompts = prompt_tokens(VOCAB, [5, 9, 14, 7], seed=4)

    def params(seed: int, **kwargs) -> SamplingParams:
        return SamplingParams(temperature=1.0, seed=seed, max_tokens=24, **kwargs)

    return [
        (prompts[0], params(1), "plain"),
        (prompts[1], params(2, n=3, logprobs=2, prompt_logprobs=1), "n3-logprobs"),
        (prompts[2], params(3, stop=["b", "c", "d"]), "stop"),
        (prompts[3], params(4, logprobs=1), "aborted"),
    ]


def engine(model_dir, deltas: bool) -> LLMEngine:
    config = EngineConfig(model=str(model_dir), max_model_len=96, block_size=4)
    built = LLMEngine(config, None)
    built.emit_deltas = deltas
    for prompt, params, request_id in requests():
        built.add_request(prompt, params, request_id=request_id)
    return built


def unfinished_without_counters(output):
    """A `RequestOutput` as the assembler rebuilds it: an unfinished one carries no
    spec-decode counters (they come with the finished output)."""
    if output.finished:
        return output
    return dataclasses.replace(output, spec_decode_stats={})


def run_both(model_dir, drop: int | None = None):
    """(outputs of the engine, outputs rebuilt from its twin's framed deltas) per step; `drop`:
    the index of a delta lost on the way (negative control)."""
    direct, twin = engine(model_dir, False), engine(model_dir, True)
    assembler = OutputAssembler()
    for prompt, _, request_id in requests():
        assembler.expect(request_id, prompt)
    steps, sizes, count = [], [], 0
    while direct.has_unfinished:
        expected = direct.step()
        deltas = twin.step()
        if len(steps) == 3:
            expected.append(direct.abort("aborted"))
            deltas.append(twin.abort("aborted"))
        rows = [delta_row(delta) for delta in deltas]
        frame = encode_frame(OUTPUTS, rows, EngineSnapshot(num_running=1))
        sizes.append(len(frame))
        kind, payload, snapshot = decode_frame(frame)
        assert kind == OUTPUTS and snapshot == EngineSnapshot(num_running=1)
        rebuilt = []
        for row in payload:
            if count != drop:
                rebuilt.append(assembler.assemble(row))
            count += 1
        steps.append(([unfinished_without_counters(o) for o in expected], rebuilt))
    assert not twin.has_unfinished
    return steps, sizes


def test_every_output_is_rebuilt_field_for_field(model_dir):
    steps, _ = run_both(model_dir)
    for expected, rebuilt in steps:
        assert rebuilt == expected
    finals = {o.request_id: o for expected, _ in steps for o in expected if o.finished}
    assert set(finals) == {"plain", "n3-logprobs", "stop", "aborted"}
    assert finals["stop"].outputs[0].stop_reason in ("b", "c", "d")  # a stop string cut it
    assert finals["aborted"].outputs[0].finish_reason == "abort"
    assert finals["n3-logprobs"].prompt_logprobs and finals["n3-logprobs"].outputs[2].logprobs
    assert finals["plain"].spec_decode_stats  # the counters came with the finished output


def test_deltas_carry_only_the_step_not_the_whole_output(model_dir):
    _, sizes = run_both(model_dir)
    assert max(sizes[8:-1]) < 2 * min(sizes[2:8]), sizes  # late steps no larger than early ones


def test_an_assembler_that_drops_a_delta_does_not_rebuild_the_output(model_dir):
    """Negative control: the comparison above sees a lost delta."""
    steps, _ = run_both(model_dir, drop=5)
    assert any(rebuilt != expected for expected, rebuilt in steps)


def test_the_snapshot_round_trips_with_its_tuples():
    snapshot = EngineSnapshot(
        num_waiting=2,
        kv_cache_usage=0.5,
        accepted_per_position=(3, 1),
        k_chosen=((1, 4), (2, 9)),
        rows=(("prefill", 12), ("plain", 3), ("speculative", 8)),
        policy_seconds=((1, "0", 0.01), (8, "catch_up", 0.03)),
        policy_acceptance=(0.5, 0.25),
    )
    assert decode_frame(encode_frame("snapshot", None, snapshot))[2] == snapshot


def test_between_sends_a_step_reports_a_requests_first_tokens_and_its_end_only(model_dir):
    """`step(only_finished=True)` with deltas, as the engine process steps between two sends
    (`STREAM_INTERVAL_S`): a request is reported at the step that emits its first tokens (its
    stream starts at once) and at its end, never between; the assembler rebuilds from those
    deltas the final outputs of a twin engine that reports every step."""
    direct, sparse = engine(model_dir, False), engine(model_dir, True)
    assembler = OutputAssembler()
    for prompt, _, request_id in requests():
        assembler.expect(request_id, prompt)
    first_step, last_step, finals, reported = {}, {}, {}, {}
    step = 0
    while direct.has_unfinished:
        for output in direct.step():
            first_step.setdefault(output.request_id, step)
            if output.finished:
                finals[output.request_id] = output
                last_step[output.request_id] = step
        for delta in sparse.step(only_finished=True):
            reported.setdefault(delta.request_id, []).append(step)
            rebuilt = assembler.assemble(delta_row(delta))
            if rebuilt.finished:
                assert rebuilt == finals[delta.request_id]
        step += 1
    assert not sparse.has_unfinished
    assert set(reported) == set(finals) == {r for _, _, r in requests()}
    samples = {request_id: params.n for _, params, request_id in requests()}
    for request_id, steps in reported.items():
        assert steps[0] == first_step[request_id], (request_id, steps)  # the first tokens at once
        assert steps[-1] == last_step[request_id] > steps[0], (request_id, steps)  # its end
        # between them, only the steps where another of its n samples emitted its first tokens
        assert len(steps) <= 1 + samples[request_id], (request_id, steps)


def test_commands_round_trip_with_every_sampling_field():
    """Each command kind decodes to what was sent; `SamplingParams` with every field set off its
    default (int-keyed logit_bias, stop lists, a JSON schema) comes back equal."""
    defaults = SamplingParams()
    params = SamplingParams(
        n=2,
        temperature=0.7,
        top_p=0.9,
        top_k=5,
        min_p=0.05,
        seed=11,
        max_tokens=9,
        min_tokens=2,
        stop=["x", "yz"],
        stop_token_ids=[3, 4],
        ignore_eos=True,
        logprobs=2,
        skip_special_tokens=False,
        include_stop_str_in_output=True,
        presence_penalty=0.5,
        frequency_penalty=0.25,
        repetition_penalty=1.1,
        logit_bias={5: -2.0, 7: 1.5},
        bad_words=["ab"],
        allowed_token_ids=[1, 2, 3, 5, 7],
        prompt_logprobs=1,
        best_of=2,
        structured_outputs=StructuredOutputsParams(json={"type": "object"}),
    )
    unchanged = [
        f.name
        for f in dataclasses.fields(SamplingParams)
        if getattr(params, f.name) == getattr(defaults, f.name)
    ]
    assert unchanged == []
    commands = [
        Add("r-1", [1, 2, 3], params, {"enabled": True, "num_speculative_tokens": 2}),
        Add("r-2", [4], SamplingParams(), None),
        Abort("r-1"),
        Drain(),
        Shutdown(),
    ]
    for command in commands:
        assert decode_command(encode_command(command)) == command
    assert isinstance(decode_command(encode_command(commands[0])).params, SamplingParams)


def test_a_malformed_command_fails_at_decode():
    """A command of an unknown kind, or parameters of the wrong type, raise on decode."""
    with pytest.raises(msgspec.ValidationError):
        decode_command(msgspec.msgpack.encode(["evict", "r-1"]))
    with pytest.raises(msgspec.ValidationError):
        decode_command(msgspec.msgpack.encode(["add", "r-1", [1], "temperature=2", None]))
