"""OpenAI response pieces built from engine outputs: usage, spec-decode statistics, prompt
logprobs, finish reasons (and the error of a choice the engine ended), SSE framing, the text
deltas of streamed choices, and the merge of several request streams."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import msgspec
from fastapi.responses import JSONResponse

from specdec.engine.outputs import CompletionOutput, RequestOutput
from specdec.metrics import SpecDecodeStats
from specdec.server.async_engine import RequestStream


def _top(entry: dict, num_top: int) -> list:
    """The top `num_top` (token id, Logprob) of a vLLM logprob dict (its first entries)."""
    return list(entry.items())[:num_top]


def prompt_logprobs_json(prompt_logprobs: list | None) -> list | None:
    """vLLM's `prompt_logprobs` in a response: per prompt token None or {id: {"logprob", "rank",
    "decoded_token"}}."""
    if prompt_logprobs is None:
        return None
    return [
        None
        if entry is None
        else {
            str(t): {"logprob": v.logprob, "rank": v.rank, "decoded_token": v.decoded_token}
            for t, v in entry.items()
        }
        for entry in prompt_logprobs
    ]


def usage(outputs: list[RequestOutput]) -> dict:
    """OpenAI's usage summed over the prompts (each prompt counted once, whatever n)."""
    prompt = sum(len(output.prompt_token_ids) for output in outputs)
    completion = sum(len(c.token_ids) for output in outputs for c in output.outputs)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


def spec_decode_stats(outputs: list[RequestOutput]) -> dict:
    """The per-request spec-decode counters summed over the prompts."""
    if len(outputs) == 1:
        return outputs[0].spec_decode_stats
    total = SpecDecodeStats()
    for output in outputs:
        stats = output.spec_decode_stats
        per_position = list(stats.get("accepted_per_position", []))
        total.merge(
            SpecDecodeStats(
                num_spec_tokens=len(per_position),
                num_drafts=stats.get("num_drafts", 0),
                num_draft_tokens=stats.get("num_draft_tokens", 0),
                num_accepted_tokens=stats.get("num_accepted_tokens", 0),
                accepted_per_position=per_position,
            )
        )
    return total.as_dict()


def _tail(outputs: list[RequestOutput]) -> dict:
    """What closes a response body: usage, the seed (shared by every prompt) and stats."""
    return {
        "usage": usage(outputs),
        "seed": outputs[0].seed,
        "spec_decode_stats": spec_decode_stats(outputs),
    }


def _full_response(head: dict, choices: list[dict], outputs: list[RequestOutput]) -> JSONResponse:
    """A non-streamed completion or chat body: the head, choices, usage, seed and stats."""
    return JSONResponse({**head, "choices": choices, **_tail(outputs)})


async def _merged(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(stream index, output) from several request streams as the outputs arrive.

    Close it (`aclosing`) when stopping early: closing cancels the readers of the streams.
    """
    if len(streams) == 1:
        async for output in streams[0]:
            yield 0, output
        return
    arrivals: asyncio.Queue = asyncio.Queue()

    async def read(index: int, stream: RequestStream) -> None:
        try:
            async for output in stream:
                arrivals.put_nowait((index, output))
        except Exception as err:
            arrivals.put_nowait((index, err))
        else:
            arrivals.put_nowait((index, None))

    readers = [asyncio.ensure_future(read(i, stream)) for i, stream in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            index, item = await arrivals.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, item
    finally:
        for reader in readers:
            reader.cancel()


def _finish_reason(completion: CompletionOutput) -> str | None:
    return completion.finish_reason


def _error_field(completion: CompletionOutput) -> dict:
    """{"error": the one-line message} for a choice that ended with finish_reason "error" (the
    engine stopped that request alone: its text so far stays), else {}."""
    return {} if completion.error is None else {"error": completion.error}


_json = msgspec.json.Encoder()


def _sse(payload: dict | str) -> bytes:
    """One server-sent event: the payload as compact JSON (msgspec: about a tenth of
    `json.dumps`' time per chunk; non-ASCII text as UTF-8, not escaped), or a bare string."""
    data = payload.encode() if isinstance(payload, str) else _json.encode(payload)
    return b"data: " + data + b"\n\n"


class _Deltas:
    """Text and token offsets already streamed for each choice (prompt-major, then sample).

    Text that may still turn out to be the start of a stop string (or an incomplete UTF-8
    character) is held back until the sample finishes, so streamed text equals the final text.
    """

    def __init__(self, num_choices: int, stop: list[str] | None) -> None:
        self.text = [0] * num_choices
        self.tokens = [0] * num_choices
        self.done = [False] * num_choices
        self.hold = max((len(s) for s in stop or []), default=1) - 1

    def next(self, completion: CompletionOutput, index: int) -> tuple[str, int] | None:
        """(new text, token offset of the new logprobs) of choice `index`, or None when nothing
        is to be sent."""
        if self.done[index]:
            return None
        text = completion.text
        end = len(text)
        if completion.finish_reason is None:
            end = max(self.text[index], end - self.hold)
            while end > self.text[index] and text[end - 1] == "\ufffd":
                end -= 1
        delta = text[self.text[index] : end]
        start = self.tokens[index]
        if not delta and completion.finish_reason is None:
            return None
        self.text[index] = end
        self.tokens[index] = len(completion.token_ids)
        self.done[index] = completion.finish_reason is not None
        return delta, start
