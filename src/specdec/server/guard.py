"""The server's ASGI guard: the API key on `/v1` routes, and responses counted by route and
status."""

from __future__ import annotations

import hmac
from collections.abc import Callable
from typing import Any

from specdec.server.errors import error_response


class _GuardMiddleware:
    """Pure ASGI (so that `Request.is_disconnected` sees the client leave): checks the API key
    on `/v1` routes and counts responses by route and status."""

    def __init__(self, app: Any, server: Any) -> None:  # server: the app's OpenAIServer
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
    (
        "/health",
        "/ping",
        "/version",
        "/metrics",
        "/tokenize",
        "/detokenize",
        "/v1/models",
        "/v1/completions",
        "/v1/chat/completions",
    )
)
