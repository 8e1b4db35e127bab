"""`specdec serve`: the OpenAI-compatible HTTP server."""

from __future__ import annotations

import argparse
import sys

from specdec.cli.flags import add_config_flags, config_values, default_spec_help
from specdec.server.config import ServerConfig

# ServerConfig fields that are flags of `serve` (served_model_name and api_key have their own).
SERVER_FLAGS = (
    "host",
    "port",
    "max_request_bytes",
    "max_tokens_limit",
    "max_n",
    "max_prompts",
    "max_logprobs",
    "shutdown_timeout_s",
)


def add_serve(commands) -> None:
    from specdec.cli.flags import add_engine_arguments, add_model_arguments, add_threads_flag

    serve = commands.add_parser(
        "serve",
        help="an OpenAI-compatible HTTP server (completions, chat, SSE streaming, /metrics)",
        description="Serve MODEL (given as the positional or as --model, as vLLM takes it; "
        "default: the built-in SmolLM2-135M-Instruct) over OpenAI's "
        "/v1/completions and /v1/chat/completions (and vLLM's /tokenize, /detokenize). "
        "Requests must name the model as the served name (--served-model-name; default: the "
        "model path's last component without its suffix, or 'default' for the built-in model) "
        f"or as 'default'. Default speculation, as `generate`'s: {default_spec_help()} "
        '(--no-spec: none). Each request may set "speculative": {"enabled", '
        '"num_speculative_tokens", "rejection_sample_method"}. The engine runs in a process of '
        "its own, loaded before the port answers; on CUDA it then captures the CUDA graph of "
        "every step shape it may take (one log line), while /health and /ping answer 503 "
        "(requests sent meanwhile wait; --no-warm-up: capture each on first use instead). "
        "The port is taken before the model loads; "
        "SIGTERM or Ctrl-C ends every open stream with a last chunk (finish_reason abort) and "
        "[DONE].",
    )
    add_model_arguments(serve)
    serve.add_argument("--served-model-name", default=None, help="the model name requests use")
    serve.add_argument(
        "--api-key", default=None, help="require 'Authorization: Bearer KEY' on every /v1 route"
    )
    serve.add_argument("--no-spec", action="store_true", help="serve without speculation")
    serve.add_argument(
        "--engine-thread",
        action="store_true",
        help="run the engine in a thread of the HTTP process instead of its own process (the "
        "server before 2026-12-05: for debugging, and to measure what the process saves)",
    )
    serve.add_argument(
        "--disable-log-stats",
        action="store_true",
        help="do not write the engine's line of figures every 5 s while busy (running and "
        "waiting requests, tokens/s, KV use, acceptance length, K per step)",
    )
    add_config_flags(serve, ServerConfig, SERVER_FLAGS)
    add_engine_arguments(serve, seed=True)
    add_threads_flag(serve)
    serve.set_defaults(handler=_serve)


def _serve(args: argparse.Namespace) -> int:
    import functools
    from pathlib import Path

    import uvicorn

    from specdec.cli.flags import (
        check_before_loading,
        default_spec,
        engine_kwargs,
        speculative_config,
    )
    from specdec.engine.config import EngineConfig
    from specdec.engine.llm_engine import LLMEngine
    from specdec.runner.tensor_parallel import external_launch
    from specdec.server import AsyncEngine, EngineClient, ServerConfig, build_app
    from specdec.server.lifecycle import DrainingServer, bind_socket

    name = args.served_model_name or (Path(args.model).stem if args.model else "default")
    config = ServerConfig(
        served_model_name=name,
        api_key=args.api_key,
        **config_values(args, ServerConfig, SERVER_FLAGS),
    )
    engine_config = EngineConfig(model=args.model, **engine_kwargs(args, seed=True))
    spec = None if args.no_spec else speculative_config(args, default_spec(args.model, args.device))
    check_before_loading(engine_config, spec)
    launched = external_launch()
    if launched is not None and launched[0] != 0:  # a launcher's worker rank: no server
        LLMEngine(engine_config, spec)  # serves rank 0's steps, then exits the process
        return 0
    sock = bind_socket(config.host, config.port)  # a busy port fails now, not after loading
    engine = None
    try:
        sys.stderr.write(f"loading {args.model or 'the built-in SmolLM2-135M-Instruct'} ...\n")
        if launched is None and not args.engine_thread:  # its own process (spawns TP workers)
            describe = functools.partial(startup_line, name=name, config=config)
            engine = EngineClient.launch(
                engine_config, spec, args.threads, describe, log_stats=not args.disable_log_stats
            )
            print(engine.info.startup, file=sys.stderr, flush=True)
        else:  # in this process: asked for, or rank 0 of a torchrun launch (with its group)
            local = LLMEngine(engine_config, spec)
            print(startup_line(local, name, config), file=sys.stderr, flush=True)
            engine = AsyncEngine(local)
        server = DrainingServer(
            uvicorn.Config(
                build_app(engine, config),
                host=config.host,
                port=config.port,
                timeout_graceful_shutdown=config.shutdown_timeout_s,
            ),
            on_exit=engine.drain,
        )
        server.run(sockets=[sock])
    finally:
        sock.close()
        if engine is not None:
            engine.close()  # the engine process (or tensor-parallel workers) stops with the server
    return 0


def startup_line(engine, name: str, config: ServerConfig) -> str:
    """What the server runs, in one line: model, dtype, weight format (GGUF formats kept
    quantized, or float), device, max_model_len, KV cache and speculation (K pinned or chosen
    per step)."""
    from specdec.cli.describe import speculation_note, weights_note
    from specdec.engine.setup import max_model_len_note

    model = engine.config.model or "the built-in SmolLM2-135M-Instruct"
    dtype = str(engine.model.dtype).removeprefix("torch.")
    blocks = engine.allocator.num_blocks
    return (
        f"serving {name!r} on http://{config.host}:{config.port}: model {model}, dtype {dtype}, "
        f"{weights_note(engine.model, engine.config.model)}, device {engine.device}"
        + (f" x {tp} (tensor parallel)" if (tp := engine.config.tensor_parallel_size) > 1 else "")
        + ", max_model_len "
        f"{max_model_len_note(engine.config, engine.model, engine.max_model_len)}, "
        f"{blocks} KV blocks of {engine.config.block_size} tokens, "
        f"speculation {speculation_note(engine.speculative_config)}"
    )
