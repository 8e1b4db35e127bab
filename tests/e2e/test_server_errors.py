"""Errors that name the fix, through the server on the tiny character model: a non-text content
part, an unknown model name."""

from __future__ import annotations

from types import SimpleNamespace

import httpx
import pytest

from e2e.server_fixtures import ServerThread, make_tiny_model_dir
from specdec.engine.config import EngineConfig
from specdec.engine.llm_engine import LLMEngine
from specdec.server import AsyncEngine, ServerConfig, build_app
from specdec.server.app import OpenAIServer
from specdec.server.errors import APIError

pytestmark = pytest.mark.e2e

MODEL = "tiny"
TIMEOUT_S = 60.0
IMAGE_PART = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}


def start_server(model_dir, served_model_name: str = MODEL) -> ServerThread:
    engine = LLMEngine(EngineConfig(model=str(model_dir), max_model_len=256, max_num_seqs=4), None)
    config = ServerConfig(served_model_name=served_model_name)
    return ServerThread(build_app(AsyncEngine(engine), config)).start()


def post(server: ServerThread, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=TIMEOUT_S)


def error_of(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    return response.json()["error"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    thread = start_server(make_tiny_model_dir(tmp_path_factory.mktemp("tiny")))
    yield thread
    thread.stop()


def test_a_non_text_content_part_names_the_message_and_the_part(server):
    text = {"type": "text", "text": "look:"}
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [text, IMAGE_PART]},
    ]
    for path in ("/v1/chat/completions", "/tokenize"):
        error = error_of(post(server, path, {"messages": messages}), 400)
        assert error["param"] == "messages"
        assert error["message"].startswith(
            "this model takes text only: messages[1] has a content part of type 'image_url'"
        )
    untyped = [{"role": "user", "content": [{"text": "no type"}]}]
    error = error_of(post(server, "/v1/chat/completions", {"messages": untyped}), 400)
    assert "messages[0] has a content part of type None" in error["message"]


def test_text_content_parts_are_accepted(server):
    parts = [{"type": "text", "text": "hel"}, {"type": "text", "text": "lo"}]
    as_parts = post(server, "/tokenize", {"messages": [{"role": "user", "content": parts}]})
    as_string = post(server, "/tokenize", {"messages": [{"role": "user", "content": "hello"}]})
    assert as_parts.status_code == 200 and as_parts.json() == as_string.json()
    reply = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": parts}]})
    assert reply.status_code == 200, reply.text


def test_an_unknown_model_names_what_to_send(server):
    error = error_of(post(server, "/v1/completions", {"model": "gpt-4", "prompt": "x"}), 404)
    assert error["message"] == "model 'gpt-4' is not served here; use 'tiny' (or 'default')"
    assert error["code"] == "model_not_found" and error["param"] == "model"
    for name in ("tiny", "default"):
        assert post(server, "/v1/completions", {"model": name, "prompt": "x"}).status_code == 200


def test_a_server_named_default_names_it_once():
    stub = SimpleNamespace(tokenizer=object(), max_model_len=8, vocab_size=8, snapshot=None)
    server = OpenAIServer(stub, ServerConfig())
    with pytest.raises(APIError) as caught:
        server.check_model("gpt-4")
    assert caught.value.message == "model 'gpt-4' is not served here; use 'default'"
