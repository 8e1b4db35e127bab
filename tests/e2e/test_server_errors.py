"""Errors that name the fix, through the server on the tiny character model: a non-text content
part, an unknown model name; and a checkpoint without a tokenizer, which warns at load (server and
`LLM`) and takes the token-id prompt form the warning names.
"""

from __future__ import annotations

import warnings
from types import SimpleNamespace

import httpx
import pytest

from e2e.server_fixtures import ServerThread, make_tiny_model_dir
from models_fixtures import make_hf_model, save_hf_model
from specdec import LLM, SamplingParams
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


@pytest.fixture(scope="module")
def untokenized_dir(tmp_path_factory):
    """A tiny checkpoint with weights and config.json but no tokenizer files."""
    return save_hf_model(make_hf_model("llama"), tmp_path_factory.mktemp("no-tokenizer"))


def test_a_server_without_tokenizer_warns_and_takes_token_ids(untokenized_dir):
    with pytest.warns(UserWarning, match=r'no tokenizer: send /v1/completions .*"prompt": \['):
        server = start_server(untokenized_dir)
    try:
        body = {"prompt": [5, 6, 7], "max_tokens": 3, "ignore_eos": True}
        assert post(server, "/v1/completions", body).status_code == 200
        error = error_of(post(server, "/v1/completions", {"prompt": "text"}), 400)
        assert "no tokenizer" in error["message"]
    finally:
        server.stop()


def test_llm_without_tokenizer_warns_and_generates_from_token_ids(untokenized_dir):
    with pytest.warns(UserWarning, match=r'no tokenizer: .*\{"prompt_token_ids": \['):
        llm = LLM(str(untokenized_dir), speculative_config=None, max_model_len=256)
    params = SamplingParams(max_tokens=3, ignore_eos=True, seed=0)
    (out,) = llm.generate({"prompt_token_ids": [5, 6, 7]}, params, use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 3 and out.outputs[0].text == ""
    with pytest.raises(ValueError, match="no tokenizer"):
        llm.generate("text", params, use_tqdm=False)


def test_a_model_with_a_tokenizer_loads_without_that_warning(tmp_path):
    model_dir = make_tiny_model_dir(tmp_path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        LLM(str(model_dir), speculative_config=None, max_model_len=256)
        engine = LLMEngine(EngineConfig(model=str(model_dir), max_model_len=256), None)
        build_app(AsyncEngine(engine), ServerConfig())
    assert not [w for w in caught if "no tokenizer" in str(w.message)]
