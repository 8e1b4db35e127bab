"""Server-sent events of OpenAI chunks (`_streaming`), and the per-request timing behind the TTFT
and TPOT histograms (`_Timing`)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

from fastapi.responses import StreamingResponse

from specdec.engine.outputs import CompletionOutput, RequestOutput
from specdec.server.async_engine import EngineDeadError, RequestStream
from specdec.server.prometheus import ServerMetrics
from specdec.server.protocol import ChatCompletionRequest, CompletionRequest
from specdec.server.responses import (
    _Deltas,
    _error_field,
    _finish_reason,
    _merged,
    _sse,
    _tail,
)


@dataclass(slots=True)
class _Timing:
    """Per-request timing for the TTFT and TPOT histograms."""

    started: float = field(default_factory=time.perf_counter)
    first_token: float | None = None

    def observe(self, metrics: ServerMetrics, output: RequestOutput) -> None:
        now = time.perf_counter()
        if self.first_token is None and any(c.token_ids for c in output.outputs):
            self.first_token = now
            metrics.ttft.observe(now - self.started)
        if output.finished and self.first_token is not None:
            num_tokens = max(len(c.token_ids) for c in output.outputs)
            if num_tokens > 1:
                metrics.tpot.observe((now - self.first_token) / (num_tokens - 1))


def _streaming(
    server: Any,  # the app's OpenAIServer (its metrics, logprobs and token counts)
    streams: list[RequestStream],
    timings: list[_Timing],
    body: CompletionRequest | ChatCompletionRequest,
    head: dict,
    *,
    chat: bool,
    echoes: list[str] | None = None,
) -> StreamingResponse:
    """An SSE response of OpenAI chunks for one or more prompts (choices numbered prompt-major);
    every request is aborted if the client disconnects. `echoes` (completions only): each
    prompt's text, sent as the first text of its choices."""
    include_usage = body.stream_options is not None and body.stream_options.include_usage
    n = body.n
    deltas = _Deltas(len(streams) * n, [body.stop] if isinstance(body.stop, str) else body.stop)
    wants_logprobs = bool(body.logprobs) if chat else body.logprobs is not None
    num_top = (body.top_logprobs or 0) if chat else body.logprobs

    def choice(completion: CompletionOutput, index: int, text: str, start: int) -> dict:
        finish = _finish_reason(completion)
        if chat:
            delta = {"content": text}
            logprobs = server.chat_logprobs(completion, start, num_top) if wants_logprobs else None
            out = {"index": index, "delta": delta, "logprobs": logprobs}
        else:
            offset = len(completion.text[: deltas.text[index]]) - len(text)
            logprobs = (
                server.completion_logprobs(completion, start, offset, num_top)
                if wants_logprobs
                else None
            )
            out = {"index": index, "text": text, "logprobs": logprobs}
        out["finish_reason"] = finish
        if finish is not None:
            out["stop_reason"] = completion.stop_reason
            out.update(_error_field(completion))
        return out

    def opening(index: int) -> dict:
        """The first choice chunk of choice `index`: the assistant role, or the echoed prompt."""
        if chat:
            return {
                "index": index,
                "delta": {"role": "assistant", "content": ""},
                "logprobs": None,
                "finish_reason": None,
            }
        text = echoes[index // n] if echoes is not None else ""
        return {"index": index, "text": text, "logprobs": None, "finish_reason": None}

    async def events() -> AsyncIterator[bytes]:
        last: list[RequestOutput | None] = [None] * len(streams)
        try:
            if chat or echoes is not None:
                for index in range(len(streams) * n):
                    yield _sse({**head, "choices": [opening(index)], "seed": None})
            async with aclosing(_merged(streams)) as arrivals:
                async for prompt_index, output in arrivals:
                    timings[prompt_index].observe(server.metrics, output)
                    last[prompt_index] = output
                    choices = []
                    for completion in output.outputs:
                        index = prompt_index * n + completion.index
                        step = deltas.next(completion, index)
                        if step is not None:
                            choices.append(choice(completion, index, *step))
                    if choices:
                        chunk = {**head, "choices": choices, "seed": output.seed}
                        if output.finished:
                            chunk["spec_decode_stats"] = output.spec_decode_stats
                        if include_usage:
                            chunk["usage"] = None
                        yield _sse(chunk)
            finished = [output for output in last if output is not None]
            if include_usage and len(finished) == len(streams):
                yield _sse({**head, "choices": [], **_tail(finished)})
            yield _sse("[DONE]")
        except EngineDeadError:
            error = {
                "message": "the request was aborted: the engine stopped",
                "type": "server_error",
                "param": None,
                "code": None,
            }
            yield _sse({"error": error})
        finally:
            for stream in streams:
                if stream.abort():
                    server.metrics.aborts.inc()
                if stream.coalesced:
                    server.metrics.coalesced_outputs.inc(stream.coalesced)
            for output in last:
                server.count_output(output)

    return StreamingResponse(
        events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
    )
