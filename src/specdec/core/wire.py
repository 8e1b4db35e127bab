"""What the engine process and the HTTP process say to each other, and how it is encoded.

The HTTP process sends commands (`add`, `abort`, `drain`, `shutdown`) pickled: a few per
request, and `SamplingParams` travels whole. The engine process answers with msgpack frames
(msgspec): admissions, the step's outputs and the latest `EngineSnapshot`. A step's outputs go
as deltas against what was already sent for the request (the text and token ids appended, the
logprob entries added), so a frame's size follows the tokens of the step, not the length of the
outputs; `OutputAssembler` rebuilds the `RequestOutput`s the engine returned, field for field.
Never touches the model or randomness.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import msgspec

from specdec.core.snapshot import EngineSnapshot
from specdec.engine.outputs import CompletionOutput, Logprob, RequestOutput

# Frame kinds (engine -> HTTP process). Each frame is [kind, payload, snapshot | None].
ADMITTED = "admitted"  # payload: [[request_id, error message | None], ...]
OUTPUTS = "outputs"  # payload: [request delta, ...]
FAILED = "failed"  # payload: [[request_id, message], ...]: those streams end with an error
DEAD = "dead"  # payload: message; the engine process exits after sending it
SNAPSHOT = "snapshot"  # payload: None (the frame carries only the snapshot)

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder()


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


@dataclass(slots=True)
class _SentSample:
    text: str = ""
    num_tokens: int = 0
    num_logprobs: int = 0


@dataclass(slots=True)
class _SentRequest:
    samples: dict[int, _SentSample] = field(default_factory=dict)
    prompt_logprobs_sent: bool = False


class DeltaEncoder:
    """The engine side: turns each `RequestOutput` into the delta against what was sent for its
    request before (and forgets a request once its finished output is encoded)."""

    def __init__(self) -> None:
        self._sent: dict[str, _SentRequest] = {}

    def encode(self, output: RequestOutput) -> list:
        sent = self._sent.setdefault(output.request_id, _SentRequest())
        prompt_logprobs = None
        if output.prompt_logprobs is not None and not sent.prompt_logprobs_sent:
            prompt_logprobs = _logprob_rows(output.prompt_logprobs)
            sent.prompt_logprobs_sent = True
        samples = []
        for sample in output.outputs:
            before = sent.samples.setdefault(sample.index, _SentSample())
            # The text normally grows; if it does not (a stop string cut it), it is resent whole.
            keep = len(before.text) if sample.text.startswith(before.text) else 0
            num_logprobs = 0 if sample.logprobs is None else len(sample.logprobs)
            new_logprobs = None
            if sample.logprobs is not None:
                new_logprobs = _logprob_rows(sample.logprobs[before.num_logprobs :])
            samples.append(
                [
                    sample.index,
                    keep,
                    sample.text[keep:],
                    sample.token_ids[before.num_tokens :],
                    new_logprobs,
                    sample.finish_reason,
                    sample.stop_reason,
                    sample.cumulative_logprob,
                    sample.error,
                ]
            )
            before.text = sample.text
            before.num_tokens = len(sample.token_ids)
            before.num_logprobs = num_logprobs
        if output.finished:
            del self._sent[output.request_id]
        return [
            output.request_id,
            output.prompt,
            output.finished,
            output.seed,
            output.spec_decode_stats,
            prompt_logprobs,
            samples,
        ]

    def forget(self, request_id: str) -> None:
        self._sent.pop(request_id, None)


@dataclass(slots=True)
class _Assembled:
    prompt_token_ids: list[int]
    samples: dict[int, CompletionOutput] = field(default_factory=dict)
    prompt_logprobs: list | None = None


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
            list(state.prompt_token_ids),
            outputs,
            finished,
            seed,
            stats,
            None if state.prompt_logprobs is None else list(state.prompt_logprobs),
        )
