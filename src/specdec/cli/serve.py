"""`specdec serve`: the OpenAI-compatible HTTP server."""

from __future__ import annotations

import argparse
import sys

from specdec.cli.flags import add_config_flags, config_values
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
)


def add_serve(commands) -> None:
    from specdec.cli.flags import add_engine_arguments

    serve = commands.add_parser(
        "serve",
        help="an OpenAI-compatible HTTP server (completions, chat, SSE streaming, /metrics)",
        description="Serve MODEL (default: the built-in SmolLM2-135M-Instruct) over OpenAI's "
        "/v1/completions and /v1/chat/completions. Requests must name the model as the served "
        "name (--served-model-name; default: the model path's last component without its "
        "suffix, or 'default' for the built-in model) or as 'default'. Each request may set "
        '"speculative": {"enabled", "num_speculative_tokens", "method"}; without '
        "--speculative-config the server has no drafter and speculation requests are refused.",
    )
    serve.add_argument("model", nargs="?", default=None, help="HF directory or GGUF file")
    serve.add_argument("--served-model-name", default=None, help="the model name requests use")
    serve.add_argument(
        "--api-key", default=None, help="require 'Authorization: Bearer KEY' on every /v1 route"
    )
    add_config_flags(serve, ServerConfig, SERVER_FLAGS)
    add_engine_arguments(serve)
    serve.set_defaults(handler=_serve)


def _serve(args: argparse.Namespace) -> int:
    from pathlib import Path

    import uvicorn

    from specdec.cli.flags import engine_kwargs, speculative_config
    from specdec.engine.config import EngineConfig
    from specdec.engine.llm_engine import LLMEngine
    from specdec.server import AsyncEngine, ServerConfig, build_app

    name = args.served_model_name or (Path(args.model).stem if args.model else "default")
    config = ServerConfig(
        served_model_name=name,
        api_key=args.api_key,
        **config_values(args, ServerConfig, SERVER_FLAGS),
    )
    engine = LLMEngine(
        EngineConfig(model=args.model, **engine_kwargs(args)), speculative_config(args, None)
    )
    print(f"serving {name!r} on http://{config.host}:{config.port}", file=sys.stderr)
    uvicorn.run(
        build_app(AsyncEngine(engine), config),
        host=config.host,
        port=config.port,
        timeout_graceful_shutdown=config.shutdown_timeout_s,
    )
    return 0
