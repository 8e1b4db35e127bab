"""The FastAPI application: OpenAI's `/v1/models`, `/v1/completions` and `/v1/chat/completions`
(plain JSON and SSE), `/health`, `/version` and `/metrics`.

Turns HTTP into `AsyncEngine.add` calls and engine outputs into OpenAI's response shapes. Every
error leaves as an OpenAI error body; no traceback ever reaches a client.
"""

from __future__ import annotations

import asyncio
import hmac
import itertools
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from specdec import __version__
from specdec.engine.outputs import CompletionOutput, RequestOutput
from specdec.sampling import SamplingParams
from specdec.server.async_engine import AsyncEngine, EngineDeadError, RequestStream
from specdec.server.config import ServerConfig
from specdec.server.prometheus import ServerMetrics
from specdec.server.protocol import ChatCompletionRequest, CompletionRequest, ErrorResponse

logger = logging.getLogger(__name__)

# OpenAI's default `max_tokens` of /v1/completions.
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
# How often a non-streaming request checks whether its client is still connected.
DISCONNECT_POLL_S = 0.25


class APIError(Exception):
    """An error a client caused (or a server state it should know of), sent as OpenAI's body."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code


def error_response(
    status: int, message: str, type: str, param: str | None = None, code: str | None = None
) -> JSONResponse:
    body = ErrorResponse(error={"message": message, "type": type, "param": param, "code": code})
    return JSONResponse(body.model_dump(), status_code=status)


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


class OpenAIServer:
    """Request handling of one served model; `build_app` wires it into FastAPI routes."""

    def __init__(self, engine: AsyncEngine, config: ServerConfig) -> None:
        self.engine = engine
        self.config = config
        self.tokenizer = engine.engine.tokenizer
        self.max_model_len = engine.engine.max_model_len
        self.metrics = ServerMetrics(lambda: engine.snapshot, config.served_model_name)
        self._ids = itertools.count()

    # ------------------------------------------------------------- request parsing
    async def read_body(self, request: Request, model: type[BaseModel]) -> Any:
        """Reads at most `max_request_bytes` of JSON and validates it into `model`."""
        limit = self.config.max_request_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise APIError(413, f"the request body exceeds {limit} bytes", code="body_too_large")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise APIError(
                    413, f"the request body exceeds {limit} bytes", code="body_too_large"
                )
            chunks.append(chunk)
        try:
            return model.model_validate_json(b"".join(chunks))
        except ValidationError as err:
            raise _validation_error(err.errors()) from None

    def check_model(self, name: str | None) -> None:
        if not self.config.accepts_model(name):
            raise APIError(
                404,
                f"the model {name!r} does not exist; this server serves "
                f"{self.config.served_model_name!r} (also reachable as 'default')",
                param="model",
                code="model_not_found",
            )

    def sampling_params(
        self,
        body: CompletionRequest | ChatCompletionRequest,
        max_tokens: int | None,
        default_max_tokens: int,
        logprobs: int | None,
    ) -> SamplingParams:
        """SamplingParams from the request, after the server's limits (APIError 400 otherwise)."""
        limits = self.config
        if max_tokens is not None and max_tokens > limits.max_tokens_limit:
            raise APIError(
                400,
                f"max_tokens={max_tokens} exceeds this server's limit of {limits.max_tokens_limit}",
                param="max_tokens",
            )
        if body.n > limits.max_n:
            raise APIError(
                400, f"n={body.n} exceeds this server's limit of {limits.max_n}", param="n"
            )
        if logprobs is not None and logprobs > limits.max_logprobs:
            raise APIError(
                400,
                f"logprobs={logprobs} exceeds this server's limit of {limits.max_logprobs}",
                param="logprobs",
            )
        if body.stream_options is not None and not body.stream:
            raise APIError(400, "stream_options needs stream=true", param="stream_options")
        values: dict[str, Any] = {
            "n": body.n,
            "max_tokens": max_tokens if max_tokens is not None else default_max_tokens,
            "stop": body.stop,
            "seed": body.seed,
            "ignore_eos": body.ignore_eos,
            "logprobs": logprobs,
        }
        for name in ("temperature", "top_p", "top_k", "min_p"):
            if getattr(body, name) is not None:
                values[name] = getattr(body, name)
        try:
            return SamplingParams(**values)
        except ValueError as err:
            raise APIError(400, str(err)) from None

    def check_prompt(self, token_ids: list[int]) -> None:
        if len(token_ids) >= self.max_model_len:
            raise APIError(
                400,
                f"the prompt has {len(token_ids)} tokens, which leaves no room to generate within "
                f"this model's maximum context length of {self.max_model_len} tokens",
                param="prompt",
                code="context_length_exceeded",
            )

    def completion_prompt(self, body: CompletionRequest) -> list[int]:
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
            if len(prompt) != 1:
                raise APIError(400, "only one prompt per request is supported", param="prompt")
            prompt = prompt[0]
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise APIError(400, "this model has no tokenizer: send token ids", param="prompt")
            token_ids = self.tokenizer.encode(prompt)
        else:
            token_ids = list(prompt)
        if not token_ids:
            raise APIError(400, "the prompt is empty", param="prompt")
        self.check_prompt(token_ids)
        return token_ids

    def chat_prompt(self, body: ChatCompletionRequest) -> list[int]:
        if self.tokenizer is None or not self.tokenizer.chat_template:
            raise APIError(400, "this model has no chat template", param="messages")
        messages = [{"role": m.role, "content": _message_text(m.content)} for m in body.messages]
        try:
            token_ids = self.tokenizer.encode_chat(messages)
        except Exception:
            raise APIError(
                400, "the chat template rejected the messages", param="messages"
            ) from None
        self.check_prompt(token_ids)
        return token_ids

    async def submit(
        self, prefix: str, token_ids: list[int], params: SamplingParams, body: Any
    ) -> RequestStream:
        request_id = f"{prefix}-{next(self._ids)}"
        speculative = None if body.speculative is None else body.speculative.as_engine_dict()
        try:
            return await self.engine.add(request_id, token_ids, params, speculative)
        except ValueError as err:
            raise APIError(400, str(err)) from None
        except EngineDeadError:
            raise APIError(503, "the engine is not running", type="server_error") from None

    async def collect(
        self, stream: RequestStream, timing: _Timing, request: Request
    ) -> RequestOutput:
        """Waits for the request to finish; aborts it if the client goes away first."""
        done = asyncio.ensure_future(self._last_output(stream, timing))
        try:
            while True:
                finished, _ = await asyncio.wait({done}, timeout=DISCONNECT_POLL_S)
                if finished:
                    break
                if await request.is_disconnected():
                    done.cancel()
                    raise APIError(499, "the client closed the request", code="client_closed")
            last = done.result()
        except EngineDeadError:
            raise APIError(
                503, "the request was aborted: the engine stopped", type="server_error"
            ) from None
        finally:
            if stream.abort():
                self.metrics.aborts.inc()
        self.count_tokens(last)
        return last

    async def _last_output(self, stream: RequestStream, timing: _Timing) -> RequestOutput | None:
        last = None
        async for output in stream:
            timing.observe(self.metrics, output)
            last = output
        return last

    def count_tokens(self, output: RequestOutput | None) -> None:
        if output is None:
            return
        self.metrics.prompt_tokens.inc(len(output.prompt_token_ids))
        self.metrics.generation_tokens.inc(sum(len(c.token_ids) for c in output.outputs))

    # ----------------------------------------------------------------- responses
    def token_text(self, token_id: int) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def completion_logprobs(self, completion: CompletionOutput, start: int, offset: int) -> dict:
        entries = (completion.logprobs or [])[start:]
        tokens = [self.token_text(e.token_id) for e in entries]
        offsets, position = [], offset
        for text in tokens:
            offsets.append(position)
            position += len(text)
        return {
            "tokens": tokens,
            "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{self.token_text(t): lp for t, lp in e.top.items()} for e in entries],
            "text_offset": offsets,
        }

    def chat_logprobs(self, completion: CompletionOutput, start: int) -> dict:
        content = []
        for entry in (completion.logprobs or [])[start:]:
            text = self.token_text(entry.token_id)
            content.append(
                {
                    "token": text,
                    "logprob": entry.logprob,
                    "bytes": list(text.encode("utf-8")),
                    "top_logprobs": [
                        {
                            "token": self.token_text(t),
                            "logprob": lp,
                            "bytes": list(self.token_text(t).encode("utf-8")),
                        }
                        for t, lp in entry.top.items()
                    ],
                }
            )
        return {"content": content}


def usage(output: RequestOutput) -> dict:
    prompt = len(output.prompt_token_ids)
    completion = sum(len(c.token_ids) for c in output.outputs)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


def _full_response(head: dict, choices: list[dict], output) -> JSONResponse:
    """A non-streamed completion or chat body: the head, choices, usage, seed and stats."""
    return JSONResponse(
        {
            **head,
            "choices": choices,
            "usage": usage(output),
            "seed": output.seed,
            "spec_decode_stats": output.spec_decode_stats,
        }
    )


def _finish_reason(completion: CompletionOutput) -> str | None:
    return completion.finish_reason


def _message_text(content: str | list[dict] | None) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    parts = []
    for part in content:
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise APIError(400, "only text content parts are supported", param="messages")
        parts.append(part["text"])
    return "".join(parts)


def _validation_error(errors: list[dict]) -> APIError:
    first = errors[0] if errors else {}
    location = [str(part) for part in first.get("loc", ()) if part != "body"]
    param = ".".join(location) or None
    kind = first.get("type", "")
    if kind == "json_invalid":
        return APIError(400, "the request body is not valid JSON", code="invalid_json")
    message = first.get("msg", "invalid request")
    return APIError(400, f"{param}: {message}" if param else message, param=param)


def _sse(payload: dict | str) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


class _Deltas:
    """Text and token offsets already streamed for each of the n samples.

    Text that may still turn out to be the start of a stop string (or an incomplete UTF-8
    character) is held back until the sample finishes, so streamed text equals the final text.
    """

    def __init__(self, n: int, stop: list[str] | None) -> None:
        self.text = [0] * n
        self.tokens = [0] * n
        self.done = [False] * n
        self.hold = max((len(s) for s in stop or []), default=1) - 1

    def next(self, completion: CompletionOutput) -> tuple[str, int] | None:
        """(new text, token offset of the new logprobs), or None when nothing is to be sent."""
        index = completion.index
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


def build_app(engine: AsyncEngine, config: ServerConfig) -> FastAPI:
    """The FastAPI app serving `engine`; the engine thread starts and stops with the app.

    Args:
        engine: an `AsyncEngine` whose thread is not yet started.
        config: the server's settings.
    """
    server = OpenAIServer(engine, config)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine.start()
        yield
        engine.shutdown(config.shutdown_timeout_s)

    app = FastAPI(title="specdec", version=__version__, lifespan=lifespan)
    app.state.server = server

    @app.exception_handler(APIError)
    async def _api_error(request: Request, err: APIError) -> JSONResponse:
        return error_response(err.status, err.message, err.type, err.param, err.code)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, err: RequestValidationError) -> JSONResponse:
        error = _validation_error(list(err.errors()))
        return error_response(400, error.message, error.type, error.param, error.code)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, err: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if err.status_code == 404 else "invalid_request_error"
        return error_response(err.status_code, str(err.detail), kind)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, err: Exception) -> JSONResponse:
        logger.exception("unhandled error in %s %s", request.method, request.url.path)
        return error_response(500, "internal server error", "server_error")

    app.add_middleware(_GuardMiddleware, server=server)

    @app.get("/health")
    async def health() -> Response:
        if not engine.is_alive:
            return error_response(503, "the engine is not running", "server_error")
        return JSONResponse({"status": "ok"})

    @app.get("/version")
    async def version() -> JSONResponse:
        return JSONResponse({"version": __version__})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(server.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        card = {
            "id": config.served_model_name,
            "object": "model",
            "created": 0,
            "owned_by": "specdec",
            "max_model_len": server.max_model_len,
        }
        return JSONResponse({"object": "list", "data": [card]})

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body: CompletionRequest = await server.read_body(request, CompletionRequest)
        server.check_model(body.model)
        if body.echo:
            raise APIError(400, "echo is not supported", param="echo")
        params = server.sampling_params(
            body, body.max_tokens, COMPLETIONS_DEFAULT_MAX_TOKENS, body.logprobs
        )
        token_ids = server.completion_prompt(body)
        timing = _Timing()
        stream = await server.submit("cmpl", token_ids, params, body)
        created = int(time.time())
        head = {
            "id": stream.request_id,
            "object": "text_completion",
            "created": created,
            "model": config.served_model_name,
        }
        if body.stream:
            return _streaming(server, stream, timing, body, head, chat=False)
        output = await server.collect(stream, timing, request)
        choices = [
            {
                "index": c.index,
                "text": c.text,
                "logprobs": None if body.logprobs is None else server.completion_logprobs(c, 0, 0),
                "finish_reason": _finish_reason(c),
                "stop_reason": c.stop_reason,
            }
            for c in output.outputs
        ]
        return _full_response(head, choices, output)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        body: ChatCompletionRequest = await server.read_body(request, ChatCompletionRequest)
        server.check_model(body.model)
        if body.top_logprobs is not None and not body.logprobs:
            raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
        max_tokens = (
            body.max_completion_tokens
            if body.max_completion_tokens is not None
            else body.max_tokens
        )
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        params = server.sampling_params(body, max_tokens, config.max_tokens_limit, logprobs)
        token_ids = server.chat_prompt(body)
        timing = _Timing()
        stream = await server.submit("chatcmpl", token_ids, params, body)
        created = int(time.time())
        head = {
            "id": stream.request_id,
            "object": "chat.completion",
            "created": created,
            "model": config.served_model_name,
        }
        if body.stream:
            head["object"] = "chat.completion.chunk"
            return _streaming(server, stream, timing, body, head, chat=True)
        output = await server.collect(stream, timing, request)
        choices = [
            {
                "index": c.index,
                "message": {"role": "assistant", "content": c.text},
                "logprobs": server.chat_logprobs(c, 0) if body.logprobs else None,
                "finish_reason": _finish_reason(c),
                "stop_reason": c.stop_reason,
            }
            for c in output.outputs
        ]
        return _full_response(head, choices, output)

    return app


class _GuardMiddleware:
    """Pure ASGI (so that `Request.is_disconnected` sees the client leave): checks the API key
    on `/v1` routes and counts responses by route and status."""

    def __init__(self, app: Any, server: OpenAIServer) -> None:
        self.app = app
        self.server = server

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        route = path if path in _ROUTES else "other"
        counter = self.server.metrics.requests
        api_key = self.server.config.api_key
        if path.startswith("/v1") and api_key is not None and not _authorized(scope, api_key):
            counter.labels(route, "401").inc()
            response = error_response(
                401, "missing or invalid API key", "authentication_error", code="invalid_api_key"
            )
            await response(scope, receive, send)
            return

        async def counting_send(message: dict) -> None:
            if message["type"] == "http.response.start":
                counter.labels(route, str(message["status"])).inc()
            await send(message)

        await self.app(scope, receive, counting_send)


def _authorized(scope: dict, api_key: str) -> bool:
    headers = dict(scope.get("headers") or [])
    scheme, _, token = headers.get(b"authorization", b"").decode("latin-1").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(
        token.strip().encode(), api_key.encode()
    )


_ROUTES = frozenset(
    ("/health", "/version", "/metrics", "/v1/models", "/v1/completions", "/v1/chat/completions")
)


def _streaming(
    server: OpenAIServer,
    stream: RequestStream,
    timing: _Timing,
    body: CompletionRequest | ChatCompletionRequest,
    head: dict,
    *,
    chat: bool,
) -> StreamingResponse:
    """An SSE response of OpenAI chunks; the request is aborted if the client disconnects."""
    include_usage = body.stream_options is not None and body.stream_options.include_usage
    deltas = _Deltas(body.n, [body.stop] if isinstance(body.stop, str) else body.stop)
    wants_logprobs = bool(body.logprobs) if chat else body.logprobs is not None

    def choice(completion: CompletionOutput, text: str, start: int) -> dict:
        finish = _finish_reason(completion)
        if chat:
            delta = {"content": text}
            logprobs = server.chat_logprobs(completion, start) if wants_logprobs else None
            out = {"index": completion.index, "delta": delta, "logprobs": logprobs}
        else:
            offset = len(completion.text[: deltas.text[completion.index]]) - len(text)
            logprobs = (
                server.completion_logprobs(completion, start, offset) if wants_logprobs else None
            )
            out = {"index": completion.index, "text": text, "logprobs": logprobs}
        out["finish_reason"] = finish
        if finish is not None:
            out["stop_reason"] = completion.stop_reason
        return out

    async def events() -> AsyncIterator[bytes]:
        last = None
        try:
            if chat:
                for index in range(body.n):
                    role = {
                        "index": index,
                        "delta": {"role": "assistant", "content": ""},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                    yield _sse({**head, "choices": [role], "seed": None})
            async for output in stream:
                timing.observe(server.metrics, output)
                last = output
                choices = []
                for completion in output.outputs:
                    step = deltas.next(completion)
                    if step is not None:
                        choices.append(choice(completion, *step))
                if choices:
                    chunk = {**head, "choices": choices, "seed": output.seed}
                    if output.finished:
                        chunk["spec_decode_stats"] = output.spec_decode_stats
                    if include_usage:
                        chunk["usage"] = None
                    yield _sse(chunk)
            if include_usage and last is not None:
                yield _sse(
                    {
                        **head,
                        "choices": [],
                        "usage": usage(last),
                        "seed": last.seed,
                        "spec_decode_stats": last.spec_decode_stats,
                    }
                )
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
            if stream.abort():
                server.metrics.aborts.inc()
            server.count_tokens(last)

    return StreamingResponse(
        events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
    )
