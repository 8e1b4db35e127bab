"""What the engine process and the HTTP process say to each other, and how it is encoded.

The HTTP process sends commands (`Add`, `Abort`, `Drain`, `Shutdown`) as typed msgpack (msgspec
structs, tagged by kind): `SamplingParams` travels whole and is decoded into its dataclass, so a
field the decoder does not know fails on the HTTP side's encode, not in the engine. The engine
process answers with msgpack frames: admissions, the step's outputs and the latest
`EngineSnapshot`. A step's outputs go
as the engine's `RequestDelta`s (`LLMEngine.emit_deltas`: the text and token ids appended, the
logprob entries added since the request's previous delta; the spec-decode counters with the
finished one), so neither a frame's size nor the engine's work per step follows the length of
the outputs; `OutputAssembler` rebuilds the `RequestOutput`s the engine would have returned,
field for field.
Never touches the model or randomness.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import msgspec

from specdec.core.snapshot import EngineSnapshot
from specdec.engine.outputs import CompletionOutput, Logprob, RequestDelta, RequestOutput
from specdec.sampling import SamplingParams

# Frame kinds (engine -> HTTP process). Each frame is [kind, payload, snapshot | None].
ADMITTED = "admitted"  # payload: [[request_id, error message | None], ...]
OUTPUTS = "outputs"  # payload: [request delta, ...]
FAILED = "failed"  # payload: [[request_id, message], ...]: those streams end with an error
DEAD = "dead"  # payload: message; the engine process exits after sending it
SNAPSHOT = "snapshot"  # payload: None (the frame carries only the snapshot)

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder()


# Commands (HTTP process -> engine process).
class Add(msgspec.Struct, tag="add", array_like=True):
    request_id: str
    prompt: list[int]
    params: SamplingParams
    speculative: dict[str, Any] | None  # the request's `speculative` field, as sent


class Abort(msgspec.Struct, tag="abort", array_like=True):
    request_id: str


class Drain(msgspec.Struct, tag="drain", array_like=True):
    """End every live request with a final output; admit nothing more."""


class Shutdown(msgspec.Struct, tag="shutdown", array_like=True):
    """Leave the loop (after `Drain`, or at once)."""


Command = Add | Abort | Drain | Shutdown
_command_decoder = msgspec.msgpack.Decoder(Command)


def encode_command(command: Command) -> bytes:
    return _encoder.encode(command)


def decode_command(data: bytes) -> Command:
    return _command_decoder.decode(data)


def encode_frame(kind: str, payload: Any, snapshot: EngineSnapshot | None = None) -> bytes:
    return _encoder.encode([kind, payload, None if snapshot is None else _snapshot_row(snapshot)])


def decode_frame(data: bytes) -> tuple[str, Any, EngineSnapshot | None]:
    kind, payload, snapshot = _decoder.decode(data)
    return kind, payload, None if snapshot is None else _snapshot_from_row(snapshot)


def _snapshot_row(snapshot: EngineSnapshot) -> list:
    return [getattr(snapshot, f.name) for f in dataclasses.fields(EngineSnapshot)]


def _snapshot_from_row(row: list) -> EngineSnapshot:
    values = dict(zip((f.name for f in dataclasses.fields(EngineSnapshot)), row, strict=True))
    values["accepted_per_position"] = tuple(values["accepted_per_position"])
    values["k_chosen"] = tuple(tuple(pair) for pair in values["k_chosen"])
    values["rows"] = tuple(tuple(pair) for pair in values["rows"])
    values["policy_seconds"] = tuple(tuple(row) for row in values["policy_seconds"])
    values["policy_acceptance"] = tuple(values["policy_acceptance"])
    return EngineSnapshot(**values)


def _logprob_rows(entries: list[dict[int, Logprob]] | list) -> list:
    return [
        None
        if entry is None
        else [[token, lp.logprob, lp.rank, lp.decoded_token] for token, lp in entry.items()]
        for entry in entries
    ]


def _logprob_entries(rows: list) -> list:
    return [
        None
        if row is None
        else {token: Logprob(logprob, rank, text) for token, logprob, rank, text in row}
        for row in rows
    ]


def delta_row(delta: RequestDelta) -> list:
    """A `RequestDelta` as the frame's row (what `OutputAssembler.assemble` reads)."""
    prompt_logprobs = delta.prompt_logprobs
    return [
        delta.request_id,
        delta.prompt,
        delta.finished,
        delta.seed,
        delta.spec_decode_stats,
        None if prompt_logprobs is None else _logprob_rows(prompt_logprobs),
        [
            [
                s.index,
                s.keep,
                s.text,
                s.token_ids,
                None if s.logprobs is None else _logprob_rows(s.logprobs),
                s.finish_reason,
                s.stop_reason,
                s.cumulative_logprob,
                s.error,
            ]
            for s in delta.samples
        ],
    ]


@dataclass(slots=True)
class _Assembled:
    prompt_token_ids: list[int]
    samples: dict[int, CompletionOutput] = field(default_factory=dict)
    prompt_logprobs: list | None = None
    stats: dict = field(default_factory=dict)  # the spec-decode counters (the final delta's)


class OutputAssembler:
    """The HTTP side: rebuilds each request's `RequestOutput` from its deltas (a new object per
    step, as the engine returns; the lists are not shared between steps)."""

    def __init__(self) -> None:
        self._requests: dict[str, _Assembled] = {}

    def expect(self, request_id: str, prompt_token_ids: list[int]) -> None:
        self._requests[request_id] = _Assembled(list(prompt_token_ids))

    def forget(self, request_id: str) -> None:
        self._requests.pop(request_id, None)

    def assemble(self, delta: list) -> RequestOutput | None:
        """The request's output after `delta`, or None for a request not expected (aborted)."""
        request_id, prompt, finished, seed, stats, prompt_logprobs, samples = delta
        state = self._requests.get(request_id)
        if state is None:
            return None
        if prompt_logprobs is not None:
            state.prompt_logprobs = _logprob_entries(prompt_logprobs)
        if stats is not None:
            state.stats = stats
        for index, keep, text, tokens, logprobs, reason, stop, cumulative, error in samples:
            sample = state.samples.get(index)
            if sample is None:
                sample = state.samples[index] = CompletionOutput(index, "", [])
            sample.text = sample.text[:keep] + text
            sample.token_ids.extend(tokens)
            if logprobs is not None:
                if sample.logprobs is None:
                    sample.logprobs = []
                sample.logprobs.extend(_logprob_entries(logprobs))
            sample.finish_reason, sample.stop_reason = reason, stop
            sample.cumulative_logprob, sample.error = cumulative, error
        if finished:
            del self._requests[request_id]
        outputs = [
            CompletionOutput(
                s.index,
                s.text,
                list(s.token_ids),
                s.finish_reason,
                s.stop_reason,
                None if s.logprobs is None else list(s.logprobs),
                s.cumulative_logprob,
                s.error,
            )
            for s in state.samples.values()
        ]
        return RequestOutput(
            request_id,
            prompt,
            state.prompt_token_ids,  # shared between steps, as the engine's own outputs do
            outputs,
            finished,
            seed,
            state.stats,
            None if state.prompt_logprobs is None else list(state.prompt_logprobs),
        )
