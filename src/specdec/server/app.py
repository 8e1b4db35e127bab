"""The FastAPI application: OpenAI's `/v1/models` (and `/v1/models/{id}`), `/v1/completions` and
`/v1/chat/completions` (plain JSON and SSE); vLLM's `/tokenize` and `/detokenize`; `/health`,
`/ping`, `/version` and `/metrics`.

Turns HTTP into `add` calls of the engine (`EngineClient`: the engine's own process; or
`AsyncEngine`: its thread in this process) and engine outputs into OpenAI's response shapes.
Every error leaves as an OpenAI error body; no traceback ever reaches a client.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import warnings
from collections.abc import AsyncIterator
from contextlib import aclosing, asynccontextmanager
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from specdec import __version__
from specdec.engine.outputs import CompletionOutput, RequestOutput
from specdec.rng.seeds import fresh_request_id
from specdec.sampling import SamplingParams
from specdec.server.async_engine import AsyncEngine, EngineDeadError, RequestStream
from specdec.server.chat_messages import chat_messages
from specdec.server.config import DEFAULT_MODEL_ALIAS, ServerConfig
from specdec.server.errors import APIError, _validation_error, error_response
from specdec.server.guard import _GuardMiddleware
from specdec.server.prometheus import ServerMetrics
from specdec.server.protocol import (
    CONSTRAINT_FIELDS,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from specdec.server.responses import (
    _error_field,
    _finish_reason,
    _full_response,
    _merged,
    _top,
    prompt_logprobs_json,
)
from specdec.server.streaming import _streaming, _Timing

if TYPE_CHECKING:
    from specdec.server.engine_client import EngineClient

logger = logging.getLogger(__name__)

# OpenAI's default `max_tokens` of /v1/completions.
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
# How often a non-streaming request checks whether its client is still connected.
DISCONNECT_POLL_S = 0.25


class OpenAIServer:
    """Request handling of one served model; `build_app` wires it into FastAPI routes."""

    def __init__(self, engine: AsyncEngine | EngineClient, config: ServerConfig) -> None:
        self.engine = engine
        self.config = config
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.max_model_len
        self.vocab_size = engine.vocab_size
        self.metrics = ServerMetrics(lambda: engine.snapshot, config.served_model_name)
        self.created = int(time.time())
        if self.tokenizer is None:
            warnings.warn(
                "this model has no tokenizer: send /v1/completions prompts as token ids "
                '({"prompt": [1, 2, 3]}); text prompts and chat are refused',
                stacklevel=2,
            )

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
            served = self.config.served_model_name
            also = "" if served == DEFAULT_MODEL_ALIAS else f" (or {DEFAULT_MODEL_ALIAS!r})"
            raise APIError(
                404,
                f"model {name!r} is not served here; use {served!r}{also}",
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
        prompt_logprobs = body.prompt_logprobs
        if prompt_logprobs is not None and prompt_logprobs > limits.max_logprobs:
            raise APIError(
                400,
                f"prompt_logprobs={prompt_logprobs} exceeds this server's limit of "
                f"{limits.max_logprobs}",
                param="prompt_logprobs",
            )
        values: dict[str, Any] = {
            "n": body.n,
            "max_tokens": max_tokens if max_tokens is not None else default_max_tokens,
            "stop": body.stop,
            "seed": body.seed,
            "ignore_eos": body.ignore_eos,
            "logprobs": logprobs,
        }
        for name in SAMPLING_FIELDS:
            if getattr(body, name, None) is not None:
                values[name] = getattr(body, name)
        try:
            values["structured_outputs"], _ = body.constraint()
        except (ValueError, TypeError) as err:
            given = [name for name in CONSTRAINT_FIELDS if getattr(body, name) is not None]
            raise APIError(400, str(err), param=given[0] if given else None) from None
        try:
            return SamplingParams(**values)
        except ValueError as err:
            message = str(err)
            param = next((name for name in values if message.startswith(name)), None)
            raise APIError(400, message, param=param) from None

    def check_prompt(self, token_ids: list[int], name: str = "the prompt") -> None:
        if not token_ids:
            raise APIError(400, f"{name} is empty", param="prompt")
        bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise APIError(
                400,
                f"{name} has token ids {bad[:5]} outside the vocabulary [0, {self.vocab_size})",
                param="prompt",
            )
        if len(token_ids) >= self.max_model_len:
            raise APIError(
                400,
                f"{name} has {len(token_ids)} tokens, which leaves no room to generate within "
                f"this model's maximum context length of {self.max_model_len} tokens",
                param="prompt",
                code="context_length_exceeded",
            )

    def completion_prompts(self, body: CompletionRequest) -> list[list[int]]:
        """The token ids of each prompt, all checked before any is submitted."""
        if len(body.prompt) > self.config.max_prompts:
            raise APIError(
                400,
                f"{len(body.prompt)} prompts exceed this server's limit of "
                f"{self.config.max_prompts} per request",
                param="prompt",
            )
        prompts = []
        for index, prompt in enumerate(body.prompt):
            name = "the prompt" if len(body.prompt) == 1 else f"prompt[{index}]"
            if isinstance(prompt, str):
                if self.tokenizer is None:
                    raise APIError(
                        400, "this model has no tokenizer: send token ids", param="prompt"
                    )
                token_ids = self.tokenizer.encode(prompt)
            else:
                token_ids = list(prompt)
            self.check_prompt(token_ids, name)
            prompts.append(token_ids)
        return prompts

    def echo_text(self, prompt: str | list[int]) -> str:
        """The prompt as `echo` returns it: the text sent, or the decoded token ids."""
        if isinstance(prompt, str):
            return prompt
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(prompt, skip_special_tokens=False)

    def chat_prompt(
        self, body: ChatCompletionRequest | TokenizeRequest, check: bool = True
    ) -> list[int]:
        """The rendered conversation's token ids (APIError 400 when it cannot be rendered)."""
        messages = chat_messages(body.messages)
        if self.tokenizer is None or not (self.tokenizer.chat_template or body.chat_template):
            raise APIError(400, "this model has no chat template", param="messages")
        try:
            token_ids = self.tokenizer.encode_chat(
                messages,
                add_generation_prompt=body.add_generation_prompt,
                continue_final_message=body.continue_final_message,
                chat_template=body.chat_template,
            )
        except ValueError as err:
            raise APIError(400, str(err), param="messages") from None
        except Exception:
            raise APIError(
                400, "the chat template rejected the messages", param="messages"
            ) from None
        if check:
            self.check_prompt(token_ids)
        return token_ids

    def new_id(self, prefix: str) -> str:
        """A fresh response id, OpenAI's form (`chatcmpl-<32 hex digits>`)."""
        return f"{prefix}-{fresh_request_id()}"

    async def submit(
        self, request_id: str, prompts: list[list[int]], params: SamplingParams, body: Any
    ) -> list[RequestStream]:
        """Admits one engine request per prompt (`request_id`, or `request_id-i` for several);
        if any is refused, the others are aborted and the error is raised as an APIError."""
        speculative = None if body.speculative is None else body.speculative.as_engine_dict()
        ids = [request_id]
        if len(prompts) > 1:
            ids = [f"{request_id}-{i}" for i in range(len(prompts))]
        # Queued together, so that the engine thread admits them all between two steps.
        results = await asyncio.gather(
            *[
                self.engine.add(engine_id, token_ids, params, speculative)
                for engine_id, token_ids in zip(ids, prompts, strict=True)
            ],
            return_exceptions=True,
        )
        streams = [r for r in results if isinstance(r, RequestStream)]
        errors = [r for r in results if not isinstance(r, RequestStream)]
        if not errors:
            return streams
        for stream in streams:
            stream.abort()
        error = errors[0]
        if isinstance(error, ValueError):
            raise APIError(400, str(error)) from None
        if isinstance(error, EngineDeadError):
            raise APIError(503, "the engine is not running", type="server_error") from None
        raise error

    async def collect(
        self, streams: list[RequestStream], timings: list[_Timing], request: Request
    ) -> list[RequestOutput]:
        """Waits for every request to finish; aborts them all if the client goes away first."""
        last: list[RequestOutput | None] = [None] * len(streams)

        async def drain() -> None:
            async with aclosing(_merged(streams)) as outputs:
                async for index, output in outputs:
                    timings[index].observe(self.metrics, output)
                    last[index] = output

        done = asyncio.ensure_future(drain())
        try:
            while True:
                finished, _ = await asyncio.wait({done}, timeout=DISCONNECT_POLL_S)
                if finished:
                    break
                if await request.is_disconnected():
                    done.cancel()
                    raise APIError(499, "the client closed the request", code="client_closed")
            done.result()
        except EngineDeadError:
            raise APIError(
                503, "the request was aborted: the engine stopped", type="server_error"
            ) from None
        finally:
            for stream in streams:
                if stream.abort():
                    self.metrics.aborts.inc()
            for output in last:
                self.count_output(output)
        outputs = [output for output in last if output is not None and output.finished]
        if len(outputs) != len(streams):
            raise APIError(503, "the request was aborted", type="server_error")
        return outputs

    def count_output(self, output: RequestOutput | None) -> None:
        """Counts a request's last output: its tokens, and its samples that ended in error."""
        if output is None:
            return
        self.metrics.prompt_tokens.inc(len(output.prompt_token_ids))
        self.metrics.generation_tokens.inc(sum(len(c.token_ids) for c in output.outputs))
        errors = sum(c.finish_reason == "error" for c in output.outputs)
        if errors:
            self.metrics.request_errors.inc(errors)

    # ----------------------------------------------------------------- responses
    def token_text(self, token_id: int) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def logprob_bytes(self, token_id: int) -> list[int]:
        """OpenAI's logprob `bytes`: the token's own bytes, so that a client can join a character
        split over tokens (its text alone reads U+FFFD)."""
        if self.tokenizer is None:
            return []
        return list(self.tokenizer.bytes_of(token_id))

    def completion_logprobs(
        self,
        completion: CompletionOutput,
        start: int,
        offset: int,
        num_top: int,
        prompt: tuple[list[int], list] | None = None,
    ) -> dict:
        """OpenAI's legacy completions `logprobs` of the generated tokens from `start` on,
        after the prompt's (`prompt`: its token ids and prompt logprobs, for `echo`)."""
        pairs = []
        if prompt is not None:
            pairs += list(zip(*prompt, strict=True))
        pairs += list(
            zip(completion.token_ids[start:], (completion.logprobs or [])[start:], strict=False)
        )
        tokens = [self.token_text(token) for token, _ in pairs]
        offsets, position = [], offset
        for text in tokens:
            offsets.append(position)
            position += len(text)
        return {
            "tokens": tokens,
            "token_logprobs": [None if e is None else e[t].logprob for t, e in pairs],
            "top_logprobs": [
                None if e is None else {self.token_text(t): v.logprob for t, v in _top(e, num_top)}
                for _, e in pairs
            ],
            "text_offset": offsets,
        }

    def chat_logprobs(self, completion: CompletionOutput, start: int, num_top: int) -> dict:
        content = []
        entries = (completion.logprobs or [])[start:]
        for token, entry in zip(completion.token_ids[start:], entries, strict=False):
            content.append(
                {
                    "token": self.token_text(token),
                    "logprob": entry[token].logprob,
                    "bytes": self.logprob_bytes(token),
                    "top_logprobs": [
                        {
                            "token": self.token_text(t),
                            "logprob": value.logprob,
                            "bytes": self.logprob_bytes(t),
                        }
                        for t, value in _top(entry, num_top)
                    ],
                }
            )
        return {"content": content}


# Request fields passed to SamplingParams as they are, when given.
SAMPLING_FIELDS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logit_bias",
    "min_tokens",
    "bad_words",
    "allowed_token_ids",
    "stop_token_ids",
    "include_stop_str_in_output",
    "skip_special_tokens",
    "prompt_logprobs",
    "best_of",
)


def build_app(engine: AsyncEngine | EngineClient, config: ServerConfig) -> FastAPI:
    """The FastAPI app serving `engine`; the engine thread starts and stops with the app.

    Args:
        engine: an `EngineClient` (the engine's own process) or an `AsyncEngine` (its thread),
            not yet started: the app starts and stops it.
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
        if not engine.is_ready:
            return error_response(
                503, "the engine is warming up (capturing its CUDA graphs)", "server_error"
            )
        return JSONResponse({"status": "ok"})

    @app.get("/version")
    async def version() -> JSONResponse:
        return JSONResponse({"version": __version__})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(server.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.api_route("/ping", methods=["GET", "POST"])
    async def ping() -> Response:
        return await health()

    def model_card(name: str) -> dict:
        return {
            "id": name,
            "object": "model",
            "created": server.created,
            "owned_by": "specdec",
            "max_model_len": server.max_model_len,
        }

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse({"object": "list", "data": [model_card(config.served_model_name)]})

    @app.get("/v1/models/{name:path}")
    async def model(name: str) -> JSONResponse:
        server.check_model(name)
        return JSONResponse(model_card(name))

    @app.post("/tokenize")
    async def tokenize(request: Request) -> JSONResponse:
        body: TokenizeRequest = await server.read_body(request, TokenizeRequest)
        server.check_model(body.model)
        if server.tokenizer is None:
            raise APIError(400, "this model has no tokenizer")
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, 'give exactly one of "prompt" and "messages"', param="prompt")
        if body.messages is not None:
            token_ids = server.chat_prompt(body, check=False)
        else:
            token_ids = server.tokenizer.encode(
                body.prompt, add_special_tokens=body.add_special_tokens
            )
        out: dict[str, Any] = {
            "count": len(token_ids),
            "max_model_len": server.max_model_len,
            "tokens": token_ids,
        }
        if body.return_token_strs:
            out["token_strs"] = [server.token_text(t) for t in token_ids]
        return JSONResponse(out)

    @app.post("/detokenize")
    async def detokenize(request: Request) -> JSONResponse:
        body: DetokenizeRequest = await server.read_body(request, DetokenizeRequest)
        server.check_model(body.model)
        if server.tokenizer is None:
            raise APIError(400, "this model has no tokenizer")
        bad = [t for t in body.tokens if not 0 <= t < server.vocab_size]
        if bad:
            raise APIError(
                400,
                f"tokens {bad[:5]} lie outside the vocabulary [0, {server.vocab_size})",
                param="tokens",
            )
        return JSONResponse({"prompt": server.tokenizer.decode(body.tokens)})

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body: CompletionRequest = await server.read_body(request, CompletionRequest)
        server.check_model(body.model)
        echo_logprobs = body.echo and body.logprobs is not None
        if echo_logprobs and body.stream:
            raise APIError(
                400,
                "echo with logprobs is not supported when streaming (drop stream, or logprobs)",
                param="echo",
            )
        params = server.sampling_params(
            body, body.max_tokens, COMPLETIONS_DEFAULT_MAX_TOKENS, body.logprobs
        )
        if echo_logprobs and params.prompt_logprobs is None:
            params = dataclasses.replace(params, prompt_logprobs=body.logprobs)
        prompts = server.completion_prompts(body)
        if params.seed is None:  # one seed for every prompt, so the response replays whole
            params = dataclasses.replace(params, seed=server.engine.new_request_seed())
        echoes = [server.echo_text(p) for p in body.prompt] if body.echo else None
        timings = [_Timing() for _ in prompts]
        request_id = server.new_id("cmpl")
        streams = await server.submit(request_id, prompts, params, body)
        head = {
            "id": request_id,
            "object": "text_completion",
            "created": int(time.time()),
            "model": config.served_model_name,
        }
        if body.stream:
            return _streaming(server, streams, timings, body, head, chat=False, echoes=echoes)
        outputs = await server.collect(streams, timings, request)

        def logprobs(output: RequestOutput, c: CompletionOutput) -> dict | None:
            if body.logprobs is None:
                return None
            prompt = None
            if echo_logprobs:
                prompt = (output.prompt_token_ids, output.prompt_logprobs)
            return server.completion_logprobs(c, 0, 0, body.logprobs, prompt)

        choices = []
        for prompt_index, output in enumerate(outputs):
            for c in output.outputs:
                choice = {
                    "index": prompt_index * body.n + c.index,
                    "text": c.text if echoes is None else echoes[prompt_index] + c.text,
                    "logprobs": logprobs(output, c),
                    "finish_reason": _finish_reason(c),
                    "stop_reason": c.stop_reason,
                    **_error_field(c),
                }
                if body.prompt_logprobs is not None:
                    choice["prompt_logprobs"] = prompt_logprobs_json(output.prompt_logprobs)
                choices.append(choice)
        return _full_response(head, choices, outputs)

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
        timings = [_Timing()]
        request_id = server.new_id("chatcmpl")
        streams = await server.submit(request_id, [token_ids], params, body)
        head = {
            "id": request_id,
            "object": "chat.completion",
            "created": int(time.time()),
            "model": config.served_model_name,
        }
        if body.stream:
            head["object"] = "chat.completion.chunk"
            return _streaming(server, streams, timings, body, head, chat=True)
        (output,) = await server.collect(streams, timings, request)
        choices = [
            {
                "index": c.index,
                "message": {"role": "assistant", "content": c.text},
                "logprobs": server.chat_logprobs(c, 0, logprobs) if body.logprobs else None,
                "finish_reason": _finish_reason(c),
                "stop_reason": c.stop_reason,
                **_error_field(c),
            }
            for c in output.outputs
        ]
        if body.prompt_logprobs is not None:
            head = {**head, "prompt_logprobs": prompt_logprobs_json(output.prompt_logprobs)}
        return _full_response(head, choices, [output])

    return app
