"""The frames between the engine process and the HTTP process: every `RequestOutput` the engine
returns is rebuilt on the other side field for field from its deltas (growing text, a text a
stop string cut, n samples, logprobs, prompt logprobs), and frames carry the snapshot."""

from __future__ import annotations

import random

import pytest

from specdec.core.snapshot import EngineSnapshot
from specdec.core.wire import (
    OUTPUTS,
    DeltaEncoder,
    OutputAssembler,
    decode_frame,
    encode_frame,
)
from specdec.engine.outputs import CompletionOutput, Logprob, RequestOutput


def _entry(rng: random.Random, token: int) -> dict[int, Logprob]:
    top = {rng.randrange(100): Logprob(-rng.random() * 5, r + 1, f"t{r}") for r in range(2)}
    top[token] = Logprob(-rng.random(), None, None)
    return top


def _outputs(rng: random.Random, n: int, steps: int, logprobs: bool) -> list[RequestOutput]:
    """A request's successive outputs as the engine returns them (cumulative)."""
    texts = [""] * n
    tokens: list[list[int]] = [[] for _ in range(n)]
    entries: list[list] = [[] for _ in range(n)]
    prompt_logprobs = [None, _entry(rng, 5), _entry(rng, 6)]
    result = []
    for step in range(steps):
        last = step == steps - 1
        samples = []
        for i in range(n):
            new = [rng.randrange(100) for _ in range(rng.randrange(0, 4))]
            tokens[i] += new
            entries[i] += [_entry(rng, t) for t in new]
            texts[i] += "".join(chr(97 + t % 26) for t in new) + ("é" if rng.random() < 0.2 else "")
            if last and i == 0 and len(texts[i]) > 2:
                texts[i] = texts[i][:-2]  # a stop string cut the text back
            samples.append(
                CompletionOutput(
                    i,
                    texts[i],
                    list(tokens[i]),
                    "stop" if last else None,
                    "xy" if last and i == 0 else None,
                    [dict(e) for e in entries[i]] if logprobs else None,
                    -rng.random() * 10 if logprobs else None,
                    None,
                )
            )
        result.append(
            RequestOutput(
                "req-1",
                None,
                [5, 6, 7],
                samples,
                last,
                -42,
                {"num_drafts": step},
                list(prompt_logprobs) if logprobs else None,
            )
        )
    return result


@pytest.mark.parametrize("n,logprobs", [(1, False), (1, True), (3, True)])
def test_every_output_is_rebuilt_field_for_field(n, logprobs):
    rng = random.Random(n * 10 + logprobs)
    encoder, assembler = DeltaEncoder(), OutputAssembler()
    assembler.expect("req-1", [5, 6, 7])
    sent = _outputs(rng, n, 12, logprobs)
    for output in sent:
        frame = encode_frame(OUTPUTS, [encoder.encode(output)], EngineSnapshot(num_running=1))
        kind, payload, snapshot = decode_frame(frame)
        assert kind == OUTPUTS and snapshot == EngineSnapshot(num_running=1)
        assert assembler.assemble(payload[0]) == output
    assert assembler.assemble(encoder.encode(sent[-1])) is None  # finished: forgotten


def test_deltas_carry_only_the_step_not_the_whole_output():
    rng = random.Random(3)
    encoder = DeltaEncoder()
    sent = _outputs(rng, 1, 40, True)
    sizes = [len(encode_frame(OUTPUTS, [encoder.encode(output)])) for output in sent[:-1]]
    whole = len(encode_frame(OUTPUTS, [DeltaEncoder().encode(sent[-2])]))
    assert max(sizes[20:]) < whole / 4, (sizes, whole)


def test_an_assembler_that_drops_a_delta_does_not_rebuild_the_output():
    """Negative control: the comparison above sees a lost frame."""
    rng = random.Random(5)
    encoder, assembler = DeltaEncoder(), OutputAssembler()
    assembler.expect("req-1", [5, 6, 7])
    sent = _outputs(rng, 1, 6, True)
    deltas = [encoder.encode(output) for output in sent]
    lost = next(i for i, delta in enumerate(deltas) if i > 0 and delta[6][0][3])  # added tokens
    rebuilt = [assembler.assemble(delta) for i, delta in enumerate(deltas) if i != lost]
    assert rebuilt[-1] != sent[-1]


def test_the_snapshot_round_trips_with_its_tuples():
    snapshot = EngineSnapshot(
        num_waiting=2,
        kv_cache_usage=0.5,
        accepted_per_position=(3, 1),
        k_chosen=((1, 4), (2, 9)),
        rows=(("prefill", 12), ("plain", 3), ("speculative", 8)),
    )
    assert decode_frame(encode_frame("snapshot", None, snapshot))[2] == snapshot
