"""The OpenAI-compatible HTTP server: `build_app(engine, config)` and `ServerConfig`.

HTTP, JSON and Prometheus only; every token comes from `specdec.engine.LLMEngine`, which one
background thread owns (`AsyncEngine`).
"""

from specdec.server.app import build_app
from specdec.server.async_engine import AsyncEngine
from specdec.server.config import ServerConfig

__all__ = ["AsyncEngine", "ServerConfig", "build_app"]
