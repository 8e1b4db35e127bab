"""Test helpers for the server: a tiny random-weight model with a character-level tokenizer, and a
server started on a free loopback port in a background thread.

Random weights come from the seeded generator of `models_fixtures`; nothing is downloaded.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from pathlib import Path

import httpx
import tokenizers
from tokenizers import decoders, models

from models_fixtures import make_hf_model, save_hf_model

# Ids 0..2 are <unk>, <s>, </s> (the tiny config's bos 1 / eos 2); 3..96 are the characters
# ' '..'}' (94 of them), one token each, so any ASCII text round-trips.
SPECIAL_TOKENS = ("<unk>", "<s>", "</s>")
CHARACTERS = [chr(c) for c in range(32, 32 + 94)]
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


def write_char_tokenizer(path: Path) -> None:
    """Writes tokenizer.json and tokenizer_config.json (with a chat template) into `path`."""
    vocab = {token: i for i, token in enumerate([*SPECIAL_TOKENS, *CHARACTERS])}
    backend = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    backend.add_special_tokens(list(SPECIAL_TOKENS))
    backend.decoder = decoders.Fuse()
    backend.save(str(path / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": "</s>", "chat_template": CHAT_TEMPLATE}
    (path / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")


def make_tiny_model_dir(path: Path) -> Path:
    """A tiny Llama checkpoint (vocab 97, context 256) with the character tokenizer in `path`."""
    save_hf_model(make_hf_model("llama"), path)
    write_char_tokenizer(path)
    return path


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ServerThread:
    """Runs a uvicorn server for `app` on 127.0.0.1 in a daemon thread."""

    def __init__(self, app, port: int | None = None) -> None:
        import uvicorn

        self.port = port or free_port()
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 60.0) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{self.url}/health", timeout=1.0).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        raise TimeoutError(f"the server did not come up within {timeout_s} s")

    def stop(self, timeout_s: float = 30.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout_s)
