"""Structured outputs through the OpenAI-compatible server: `response_format` (json_object,
json_schema) and vLLM's `structured_outputs` / `guided_*` extras, with the official `openai`
client, streaming included, on the tiny character-tokenizer model (speculation on, coupled, so a
constrained request is token-identical with speculation off); and bad constraints as 400s that
name the problem while the rest of the batch is unaffected.
"""

from __future__ import annotations

import asyncio
import json
import re

import httpx
import jsonschema
import openai
import pytest

from e2e.server_fixtures import ServerThread, make_tiny_model_dir
from specdec.engine.config import EngineConfig, SpeculativeConfig
from specdec.engine.llm_engine import LLMEngine
from specdec.server import AsyncEngine, ServerConfig, build_app

pytestmark = pytest.mark.e2e

MODEL = "tiny"
TIMEOUT_S = 60.0
SPECULATIVE = {"method": "ngram", "num_speculative_tokens": 3, "rejection_sample_method": "coupled"}
# Bounded values and no free whitespace (llguidance's schema option), so that even a
# random-weight model closes the object within max_tokens.
SCHEMA = {
    "x-guidance": {"whitespace_flexible": False},
    "type": "object",
    "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "size": {"type": "integer", "minimum": 0, "maximum": 99},
        "ok": {"type": "boolean"},
    },
    "required": ["color", "size", "ok"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model_dir = make_tiny_model_dir(tmp_path_factory.mktemp("tiny-structured"))
    engine = LLMEngine(
        EngineConfig(model=str(model_dir), max_model_len=256, max_num_seqs=16),
        SpeculativeConfig.from_dict(SPECULATIVE),
    )
    config = ServerConfig(served_model_name=MODEL, max_tokens_limit=200, max_n=4)
    thread = ServerThread(build_app(AsyncEngine(engine), config)).start()
    yield thread
    thread.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(
        base_url=f"{server.url}/v1", api_key="none", timeout=TIMEOUT_S, max_retries=0
    )


def schema_format() -> dict:
    return {
        "type": "json_schema",
        "json_schema": {"name": "thing", "schema": SCHEMA, "strict": True},
    }


def test_json_schema_response_format_validates(client):
    for seed in range(4):
        chat = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "describe a thing"}],
            max_tokens=80,
            seed=seed,
            temperature=1.0,
            response_format=schema_format(),
        )
        choice = chat.choices[0]
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)
        assert " " not in choice.message.content


def test_json_schema_streaming_and_speculation_off_agree(client):
    kwargs = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "describe a thing"}],
        "max_tokens": 80,
        "seed": 11,
        "temperature": 0.8,
        "response_format": schema_format(),
    }
    whole = client.chat.completions.create(**kwargs).choices[0].message.content
    stream = client.chat.completions.create(**kwargs, stream=True)
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert streamed == whole
    off = client.chat.completions.create(**kwargs, extra_body={"speculative": {"enabled": False}})
    assert off.choices[0].message.content == whole  # coupled: token-identical
    jsonschema.validate(json.loads(whole), SCHEMA)


def test_json_object_and_vllm_extras(client):
    text = client.completions.create(
        model=MODEL,
        prompt="x",
        max_tokens=120,
        seed=3,
        extra_body={"structured_outputs": {"json_object": True, "disable_any_whitespace": True}},
    ).choices[0]
    if text.finish_reason == "stop":
        assert isinstance(json.loads(text.text), dict)
    else:  # max_tokens reached first: a prefix of an object, cut at the limit
        assert text.finish_reason == "length" and text.text.startswith("{")
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "x"}],
        max_tokens=60,
        seed=2,
        response_format={"type": "json_object"},
    ).choices[0]
    assert chat.message.content.lstrip().startswith("{")
    if chat.finish_reason == "stop":
        assert isinstance(json.loads(chat.message.content), dict)
    choice = client.completions.create(
        model=MODEL, prompt="x", max_tokens=20, seed=1, extra_body={"guided_choice": ["yes", "no"]}
    ).choices[0]
    assert choice.text in ("yes", "no")
    regex = client.completions.create(
        model=MODEL, prompt="x", max_tokens=20, extra_body={"guided_regex": "[a-c]{4}"}
    ).choices[0]
    assert re.fullmatch("[a-c]{4}", regex.text)
    so = client.completions.create(
        model=MODEL,
        prompt="x",
        max_tokens=20,
        extra_body={"structured_outputs": {"regex": "(ab)+c", "choice": None}},
    ).choices[0]
    assert re.fullmatch("(ab)+c", so.text) or so.finish_reason == "length"
    grammar = client.completions.create(
        model=MODEL,
        prompt="x",
        max_tokens=20,
        extra_body={"guided_grammar": 'start: "A" ("-" "B")*'},
    ).choices[0]
    assert re.fullmatch("A(-B)*", grammar.text) or grammar.finish_reason == "length"


def test_max_tokens_before_the_grammar_finishes_gives_length(client):
    out = client.completions.create(
        model=MODEL, prompt="x", max_tokens=3, extra_body={"guided_regex": "[a-c]{10}"}
    ).choices[0]
    assert out.finish_reason == "length" and re.fullmatch("[a-c]{3}", out.text)


@pytest.mark.parametrize(
    ("extra", "param", "words"),
    [
        ({"guided_regex": "[a-"}, None, "invalid structured_outputs.regex"),
        ({"guided_json": {"type": "foo"}}, None, "invalid structured_outputs.json"),
        ({"guided_grammar": "start: x"}, None, "invalid structured_outputs.grammar"),
        ({"guided_regex": "\u00e9+"}, None, "allows no output"),
        ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_regex", "several"),
        ({"structured_outputs": {"regex": "a", "bogus": 1}}, "structured_outputs", "bogus"),
        ({"structured_outputs": {"structural_tag": "x"}}, "structured_outputs", "not supported"),
        ({"structured_outputs": {}}, "structured_outputs", "exactly one"),
        ({"guided_json": "{not json"}, "guided_json", "not valid JSON"),
    ],
)
def test_bad_constraints_get_400_naming_the_problem(server, extra, param, words):
    body = {"model": MODEL, "prompt": "x", "max_tokens": 4, **extra}
    response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=TIMEOUT_S)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert words in error["message"], error["message"]
    if param is not None:
        assert error["param"] == param


def test_a_bad_constraint_leaves_the_batch_alone(server):
    async def run() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=TIMEOUT_S) as http:
            url = f"{server.url}/v1/completions"
            good = {"model": MODEL, "prompt": "x", "max_tokens": 8, "seed": 5}
            bodies = [
                {**good, "guided_regex": "[ab]{6}"},
                {**good, "guided_regex": "[a-"},
                good,
            ]
            return await asyncio.gather(*[http.post(url, json=b) for b in bodies])

    constrained, bad, plain = asyncio.run(run())
    assert bad.status_code == 400
    assert re.fullmatch("[ab]{6}", constrained.json()["choices"][0]["text"])
    assert plain.status_code == 200


def test_tool_calls_are_refused_by_name(server):
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "x"}],
        "tools": [{"type": "function", "function": {"name": "f"}}],
    }
    response = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=TIMEOUT_S)
    assert response.status_code == 400 and "tools" in response.text
