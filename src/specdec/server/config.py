"""Server settings (host, port, API key and request limits); defaults are defined here once and the
`serve` command derives its flags from them. Validation only.
"""

from __future__ import annotations

from dataclasses import dataclass

# The model name every request may use in addition to the served name.
DEFAULT_MODEL_ALIAS = "default"


@dataclass(frozen=True, slots=True)
class ServerConfig:
    """How the server listens and what it accepts.

    Attributes:
        served_model_name: the `model` requests must name (or "default"); `/v1/models` lists it.
        host: the interface to bind (loopback unless told otherwise).
        port: the TCP port.
        api_key: when set, every `/v1` route needs `Authorization: Bearer <api_key>`.
        max_request_bytes: larger request bodies get 413.
        max_tokens_limit: largest `max_tokens` a request may ask for; also the default of chat
            requests that give none.
        max_n: largest `n` (samples per prompt).
        max_prompts: most prompts one `/v1/completions` request may batch.
        max_logprobs: largest `logprobs` / `top_logprobs`.
        shutdown_timeout_s: how long shutdown waits for the engine thread.
    """

    served_model_name: str = DEFAULT_MODEL_ALIAS
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    max_request_bytes: int = 1 << 20
    max_tokens_limit: int = 4096
    max_n: int = 16
    max_prompts: int = 64
    max_logprobs: int = 20
    shutdown_timeout_s: float = 10.0

    def __post_init__(self) -> None:
        for name in ("max_request_bytes", "max_tokens_limit", "max_n", "max_prompts"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.max_logprobs < 0:
            raise ValueError(f"max_logprobs must be >= 0, got {self.max_logprobs}")

    def accepts_model(self, name: str | None) -> bool:
        """Whether a request's `model` names this server's model (None is accepted)."""
        return name is None or name in (self.served_model_name, DEFAULT_MODEL_ALIAS)
