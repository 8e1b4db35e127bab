"""The OpenAI-compatible HTTP server: `build_app(engine, config)` and `ServerConfig`.

HTTP, JSON and Prometheus only; every token comes from `specdec.engine.LLMEngine`, which runs
in its own process (`EngineClient`, what `specdec serve` starts) or in a background thread of
this one (`AsyncEngine`: tests, and rank 0 of a `torchrun` launch). The web framework is
imported on first use of `build_app`, so the CLI's other commands run where it is not installed.
"""

from specdec.server.async_engine import AsyncEngine
from specdec.server.config import ServerConfig


def __getattr__(name: str):
    if name == "build_app":
        from specdec.server.app import build_app

        return build_app
    if name == "EngineClient":  # pyzmq and msgspec are imported with it, when serving
        from specdec.server.engine_client import EngineClient

        return EngineClient
    raise AttributeError(f"module 'specdec.server' has no attribute {name!r}")


__all__ = ["AsyncEngine", "EngineClient", "ServerConfig", "build_app"]
