"""The OpenAI-compatible server end to end, through the official `openai` client and raw httpx,
on a tiny random-weight model with a character tokenizer (CPU, loopback only).

The tests on the module's `server` run twice: with the engine in a thread of the server's process
(`AsyncEngine`) and in a process of its own (`EngineClient`, what `specdec serve` runs), so the
routes, the API key, /metrics, /tokenize, aborts and disconnects are checked on both.

Replay checks are exact (same seed -> same text); no statistical assertion is made here.
"""

from __future__ import annotations

import asyncio
import functools
import json
import re

import httpx
import openai
import pytest

from bad_logits_fixtures import unusable_logits
from e2e.server_fixtures import ServerThread, make_tiny_model_dir
from specdec.cli.serve import startup_line
from specdec.core.snapshot import EngineDeadError, snapshot_of
from specdec.engine.config import EngineConfig, SpeculativeConfig
from specdec.engine.llm_engine import LLMEngine
from specdec.sampling import SamplingParams
from specdec.server import AsyncEngine, EngineClient, ServerConfig, build_app

pytestmark = pytest.mark.e2e

API_KEY = "test-key"
MODEL = "tiny"
MAX_MODEL_LEN = 256
MAX_PROMPTS = 8
TIMEOUT_S = 60.0
# K pinned: the policy may choose K = 0 for a lone request on a busy machine, and these tests
# check that a request's speculation runs (the policy has its own tests).
SPECULATIVE = {
    "method": "ngram",
    "num_speculative_tokens": 3,
    "rejection_sample_method": "coupled",
    "adaptive": False,
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module", params=["engine_thread", "engine_process"])
def server(model_dir, request):
    engine_config = EngineConfig(model=str(model_dir), max_model_len=MAX_MODEL_LEN, max_num_seqs=64)
    config = ServerConfig(
        served_model_name=MODEL,
        api_key=API_KEY,
        max_request_bytes=1 << 16,
        max_tokens_limit=200,
        max_n=4,
        max_prompts=MAX_PROMPTS,
    )
    if request.param == "engine_thread":
        engine = AsyncEngine(LLMEngine(engine_config, SpeculativeConfig.from_dict(SPECULATIVE)))
    else:
        describe = functools.partial(startup_line, name=MODEL, config=config)
        spec = SpeculativeConfig.from_dict(SPECULATIVE)
        engine = EngineClient.launch(engine_config, spec, 1, describe, log_stats=False)
    thread = ServerThread(build_app(engine, config)).start()
    yield thread
    thread.stop()
    if request.param == "engine_process":
        engine.close()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(
        base_url=f"{server.url}/v1", api_key=API_KEY, timeout=TIMEOUT_S, max_retries=0
    )


def post(server, path: str, body, *, key: str | None = API_KEY, **kwargs) -> httpx.Response:
    headers = {} if key is None else {"Authorization": f"Bearer {key}"}
    headers.update(kwargs.pop("headers", {}))
    if isinstance(body, dict):
        kwargs["json"] = body
    else:
        kwargs["content"] = body
        headers.setdefault("Content-Type", "application/json")
    kwargs.setdefault("timeout", TIMEOUT_S)
    return httpx.post(f"{server.url}{path}", headers=headers, **kwargs)


def metric(server, name: str) -> float:
    text = httpx.get(f"{server.url}/metrics", timeout=TIMEOUT_S).text
    match = re.search(rf"^{re.escape(name)}(\{{[^}}]*\}})? (\S+)$", text, re.MULTILINE)
    assert match, f"{name} not in /metrics"
    return float(match.group(2))


def complete(client, **kwargs):
    kwargs.setdefault("model", MODEL)
    kwargs.setdefault("prompt", "hello there")
    kwargs.setdefault("max_tokens", 12)
    return client.completions.create(**kwargs)


# ------------------------------------------------------------------ happy paths
def test_models_health_version(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(f"{server.url}/health", timeout=TIMEOUT_S).json() == {"status": "ok"}
    assert "version" in httpx.get(f"{server.url}/version", timeout=TIMEOUT_S).json()


def test_completion_has_usage_seed_and_spec_stats(client):
    out = complete(client, seed=5, extra_body={"ignore_eos": True})
    choice = out.choices[0]
    assert choice.finish_reason == "length" and choice.text
    assert out.usage.prompt_tokens == len("hello there")  # one token per character
    assert out.usage.completion_tokens == 12
    assert out.usage.total_tokens == out.usage.prompt_tokens + 12
    extra = out.model_extra
    assert extra["seed"] == 5
    assert set(extra["spec_decode_stats"]) >= {"num_drafts", "num_accepted_tokens"}


def test_streaming_completion_equals_plain_one(client):
    plain = complete(client, seed=11, extra_body={"ignore_eos": True})
    chunks = list(
        complete(
            client,
            seed=11,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == plain.choices[0].text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length" and set(finishes[:-1]) <= {None}


def test_chat_plain_and_streaming(client):
    messages = [{"role": "user", "content": "hi"}]
    kwargs = {"model": MODEL, "messages": messages, "max_tokens": 10, "seed": 3}
    plain = client.chat.completions.create(**kwargs, extra_body={"ignore_eos": True})
    assert plain.choices[0].message.role == "assistant"
    assert plain.usage.completion_tokens == 10
    chunks = list(
        client.chat.completions.create(
            **kwargs,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == plain.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].usage.total_tokens == plain.usage.total_tokens


def test_n_samples_differ_and_replay(client):
    first = complete(client, n=3, seed=7, extra_body={"ignore_eos": True})
    again = complete(client, n=3, seed=7, extra_body={"ignore_eos": True})
    texts = [c.text for c in sorted(first.choices, key=lambda c: c.index)]
    assert texts == [c.text for c in sorted(again.choices, key=lambda c: c.index)]
    assert len(set(texts)) == 3  # 12 characters over 94: a collision is vanishingly unlikely
    assert first.usage.completion_tokens == 36


def test_stop_sequence_cuts_the_text(client):
    base = complete(client, seed=21, max_tokens=20, extra_body={"ignore_eos": True})
    text = base.choices[0].text
    stop = text[8:10]
    cut = text[: text.find(stop)]
    out = complete(client, seed=21, max_tokens=20, stop=[stop], extra_body={"ignore_eos": True})
    assert out.choices[0].text == cut and out.choices[0].finish_reason == "stop"
    streamed = complete(
        client, seed=21, max_tokens=20, stop=[stop], stream=True, extra_body={"ignore_eos": True}
    )
    assert "".join(c.choices[0].text for c in streamed if c.choices) == cut


def test_logprobs_completion_and_chat(client):
    out = complete(client, seed=2, max_tokens=6, logprobs=3, extra_body={"ignore_eos": True})
    logprobs = out.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == 6
    assert re.sub("<unk>|<s>|</s>", "", "".join(logprobs.tokens)) == out.choices[0].text
    assert all(lp <= 0 for lp in logprobs.token_logprobs)
    assert all(len(top) == 3 for top in logprobs.top_logprobs)
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=5,
        logprobs=True,
        top_logprobs=2,
        extra_body={"ignore_eos": True},
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == 5 and all(len(t.top_logprobs) == 2 for t in content)


def char_ids(text: str) -> list[int]:
    """Token ids of `text` under the character tokenizer (3 + position in ' '..'}')."""
    return [3 + ord(c) - 32 for c in text]


def texts_of(out) -> list[str]:
    return [c.text for c in sorted(out.choices, key=lambda c: c.index)]


def test_prompt_lists_are_prompt_major_with_summed_usage(client):
    """Strings, token ids and token-id lists give the texts of the same prompts sent alone
    (one seed for all), numbered prompt * n + sample; usage counts each prompt once."""
    prompts = ["first prompt", "the second", "3rd"]
    extra = {"ignore_eos": True}
    alone = [texts_of(complete(client, prompt=p, n=2, seed=9, extra_body=extra)) for p in prompts]
    together = complete(client, prompt=prompts, n=2, seed=9, extra_body=extra)
    assert [c.index for c in together.choices] == list(range(6))
    assert texts_of(together) == [text for texts in alone for text in texts]
    assert together.usage.prompt_tokens == sum(len(p) for p in prompts)
    assert together.usage.completion_tokens == 6 * 12
    assert together.model_extra["seed"] == 9
    ids = complete(client, prompt=[char_ids(p) for p in prompts], n=2, seed=9, extra_body=extra)
    assert texts_of(ids) == texts_of(together)
    one = complete(client, prompt=char_ids(prompts[1]), n=2, seed=9, extra_body=extra)
    assert texts_of(one) == alone[1]
    unseeded = complete(client, prompt=prompts[:2], extra_body=extra)
    replay = complete(
        client, prompt=prompts[:2], seed=unseeded.model_extra["seed"], extra_body=extra
    )
    assert texts_of(replay) == texts_of(unseeded)


def test_prompt_lists_stream_like_the_plain_response(client):
    prompts = ["abc", "defgh"]
    kwargs = {"prompt": prompts, "n": 2, "seed": 4, "extra_body": {"ignore_eos": True}}
    plain = complete(client, **kwargs)
    chunks = list(complete(client, **kwargs, stream=True, stream_options={"include_usage": True}))
    streamed = [""] * 4
    for chunk in chunks:
        for c in chunk.choices:
            streamed[c.index] += c.text
    assert streamed == texts_of(plain)
    assert chunks[-1].usage.total_tokens == plain.usage.total_tokens == 8 + 4 * 12
    finishes = [c.index for chunk in chunks for c in chunk.choices if c.finish_reason]
    assert sorted(finishes) == [0, 1, 2, 3]


def test_echo_prepends_the_prompt(client):
    extra = {"ignore_eos": True}
    plain = complete(client, prompt=["echo me", "too"], seed=6, extra_body=extra)
    echoed = complete(client, prompt=["echo me", "too"], seed=6, echo=True, extra_body=extra)
    assert texts_of(echoed) == ["echo me" + plain.choices[0].text, "too" + plain.choices[1].text]
    ids = complete(client, prompt=char_ids("echo me"), seed=6, echo=True, extra_body=extra)
    assert ids.choices[0].text == echoed.choices[0].text  # token ids are echoed decoded
    streamed = complete(client, prompt="echo me", seed=6, echo=True, stream=True, extra_body=extra)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == echoed.choices[0].text


@pytest.mark.parametrize(
    ("prompt", "words"),
    [
        ([], "empty list"),
        ([[]], "empty"),
        ([""], "empty"),
        (["ok", ""], "prompt[1] is empty"),
        (["a", [5, 6]], "mix"),
        ([5, "a"], "mix"),
        ([[5], [6, "a"]], "prompt[1]"),
        ([True], "mix"),
        ({"text": "a"}, "dict"),
        (None, "NoneType"),
        (["x", "x" * MAX_MODEL_LEN], "prompt[1] has 256 tokens"),
        (["x"] * (MAX_PROMPTS + 1), "limit of 8"),
        ([[5], [500]], "outside the vocabulary"),
    ],
)
def test_bad_prompts_get_400(server, prompt, words):
    error = assert_error(
        post(server, "/v1/completions", {"model": MODEL, "prompt": prompt}), 400, "prompt"
    )
    assert words in error["message"], error["message"]


def test_echo_with_logprobs_scores_the_prompt_too(client):
    prompt = "score me"
    out = complete(
        client, prompt=prompt, echo=True, logprobs=2, seed=3, extra_body={"ignore_eos": True}
    )
    logprobs = out.choices[0].logprobs
    assert len(logprobs.tokens) == len(prompt) + 12
    assert "".join(logprobs.tokens) == out.choices[0].text
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    assert all(lp <= 0 for lp in logprobs.token_logprobs[1:])
    assert all(len(top) <= 2 for top in logprobs.top_logprobs[1:])
    assert logprobs.text_offset[: len(prompt)] == list(range(len(prompt)))
    with pytest.raises(openai.BadRequestError, match=r"echo with logprobs .* streaming"):
        list(complete(client, echo=True, logprobs=1, stream=True))


# ----------------------------------------------------------------------- replay
def test_replay_across_concurrency_and_speculation(server, client):
    """Same seed -> same text alone, among 16 concurrent requests, and with coupled speculation
    on vs off (coupled verification emits the plain sampler's tokens)."""

    def body(seed: int, speculative: dict) -> dict:
        return {
            "model": MODEL,
            "prompt": "abcabcabcabc",
            "max_tokens": 16,
            "seed": seed,
            "ignore_eos": True,
            "speculative": speculative,
        }

    plain = {"enabled": False}
    coupled = {"rejection_sample_method": "coupled"}
    alone = [post(server, "/v1/completions", body(s, plain)).json() for s in range(4)]

    async def together(speculative: dict) -> list[dict]:
        headers = {"Authorization": f"Bearer {API_KEY}"}
        async with httpx.AsyncClient(base_url=server.url, timeout=TIMEOUT_S) as http:
            responses = await asyncio.gather(
                *[
                    http.post("/v1/completions", json=body(s % 4, speculative), headers=headers)
                    for s in range(16)
                ]
            )
        return [r.json() for r in responses]

    texts = [r["choices"][0]["text"] for r in alone]
    for speculative in (plain, coupled):
        batch = asyncio.run(together(speculative))
        assert [r["choices"][0]["text"] for r in batch] == [texts[s % 4] for s in range(16)]
    spec = post(server, "/v1/completions", body(0, coupled)).json()
    assert spec["choices"][0]["text"] == texts[0]
    assert spec["spec_decode_stats"]["num_drafts"] > 0


# ------------------------------------------------------------------------- load
def test_64_concurrent_streams_complete_once_each(server, client):
    async def one(http: httpx.AsyncClient, i: int) -> tuple[int, str, int, int]:
        body = {
            "model": MODEL,
            "prompt": f"request {i}",
            "max_tokens": 8,
            "seed": i,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        text, done, tokens = "", 0, 0
        headers = {"Authorization": f"Bearer {API_KEY}"}
        async with http.stream("POST", "/v1/completions", json=body, headers=headers) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done += 1
                    continue
                chunk = json.loads(line[6:])
                text += "".join(c["text"] for c in chunk["choices"])
                tokens += (chunk.get("usage") or {}).get("completion_tokens", 0)
        return i, text, done, tokens

    async def run() -> list[tuple[int, str, int, int]]:
        limits = httpx.Limits(max_connections=64)
        async with httpx.AsyncClient(base_url=server.url, timeout=TIMEOUT_S, limits=limits) as h:
            return await asyncio.wait_for(
                asyncio.gather(*[one(h, i) for i in range(64)]), TIMEOUT_S
            )

    results = asyncio.run(run())
    assert sorted(i for i, _, _, _ in results) == list(range(64))
    assert all(done == 1 and tokens == 8 for _, _, done, tokens in results)
    assert complete(client, max_tokens=2).choices[0].text is not None


# ----------------------------------------------------------------- bad requests
def assert_error(response: httpx.Response, status: int, param: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert "Traceback" not in error["message"]
    if param is not None:
        assert error["param"] == param
    return error


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": MODEL, "prompt": "x", "max_tokens": "5"}, "max_tokens"),
        ({"model": MODEL, "prompt": 5}, None),
        ({"model": MODEL, "prompt": "x", "temperature": -1}, "temperature"),
        ({"model": MODEL, "prompt": "x", "top_p": 0}, "top_p"),
        ({"model": MODEL, "prompt": "x", "max_tokens": 201}, "max_tokens"),
        ({"model": MODEL, "prompt": "x", "n": 5}, "n"),
        ({"model": MODEL, "prompt": "x", "logprobs": 21}, "logprobs"),
        ({"model": MODEL, "prompt": "x", "speculative": {"num_speculative_tokens": 0}}, None),
        ({"model": MODEL, "prompt": "x", "speculative": {"bogus": 1}}, None),
        ({"model": MODEL}, "prompt"),
        ({"model": MODEL, "prompt": "x" * MAX_MODEL_LEN}, "prompt"),
        ({"model": MODEL, "prompt": [500]}, None),
    ],
)
def test_bad_parameters_get_400(server, body, param):
    assert_error(post(server, "/v1/completions", body), 400, param)


def test_faults_get_the_right_status(server, client):
    assert_error(post(server, "/v1/completions", b'{"prompt": "x",'), 400)
    assert_error(post(server, "/v1/completions", b"[1, 2]"), 400)
    missing = post(server, "/v1/completions", {"model": "gpt-4", "prompt": "x"})
    assert assert_error(missing, 404, "model")["code"] == "model_not_found"
    assert_error(post(server, "/v1/completions", {"prompt": "x"}, key=None), 401)
    assert_error(post(server, "/v1/completions", {"prompt": "x"}, key="wrong"), 401)
    assert_error(httpx.get(f"{server.url}/v1/models", timeout=TIMEOUT_S), 401)
    big = {"model": MODEL, "prompt": "x" * (1 << 17)}
    assert_error(post(server, "/v1/completions", big), 413)
    chat = {"model": MODEL, "messages": [{"role": "user", "content": 3}]}
    assert_error(post(server, "/v1/chat/completions", chat), 400)
    assert_error(httpx.get(f"{server.url}/nowhere", timeout=TIMEOUT_S), 404)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x")
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="x", max_tokens=10_000)
    assert complete(client, max_tokens=2).choices[0].text is not None


def _wait_for_aborts_and_idle(server, aborts: int) -> None:
    """Waits (10 s at most) until the server counted `aborts` aborts and every KV block is free
    again: the abort is counted when the engine receives it, the blocks freed at its next step."""
    for _ in range(200):
        if metric(server, "specdec:request_aborts_total") == aborts and metric(
            server, "specdec:kv_cache_free_blocks"
        ) == metric(server, "specdec:kv_cache_num_blocks"):
            return
        asyncio.run(asyncio.sleep(0.05))


def test_disconnect_aborts_and_frees_every_block(server, client):
    body = {
        "model": MODEL,
        "prompt": "a long one",
        "max_tokens": 200,
        "n": 4,
        "ignore_eos": True,
        "stream": True,
    }
    headers = {"Authorization": f"Bearer {API_KEY}"}
    aborts = metric(server, "specdec:request_aborts_total")
    for _ in range(3):
        with httpx.stream(
            "POST", f"{server.url}/v1/completions", json=body, headers=headers, timeout=TIMEOUT_S
        ) as response:
            lines = response.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))
        # leaving the block closes the connection mid-stream
    for _ in range(200):  # the abort reaches the engine thread within a few steps
        if (
            metric(server, "specdec:kv_cache_free_blocks")
            == metric(server, "specdec:kv_cache_num_blocks")
            and metric(server, "vllm:num_requests_running") == 0
        ):
            break
        asyncio.run(asyncio.sleep(0.05))
    assert metric(server, "specdec:kv_cache_free_blocks") == metric(
        server, "specdec:kv_cache_num_blocks"
    )
    assert metric(server, "vllm:num_requests_running") == 0
    assert metric(server, "vllm:num_requests_waiting") == 0
    assert metric(server, "specdec:request_aborts_total") == aborts + 3
    with pytest.raises(httpx.ReadTimeout):  # a non-streaming client that gives up is aborted too
        post(server, "/v1/completions", {**body, "stream": False}, timeout=0.3)
    _wait_for_aborts_and_idle(server, aborts + 4)
    assert metric(server, "specdec:request_aborts_total") == aborts + 4
    assert metric(server, "specdec:kv_cache_free_blocks") == metric(
        server, "specdec:kv_cache_num_blocks"
    )
    several = {**body, "prompt": ["one", "two", "three"], "n": 2}
    with httpx.stream(  # every prompt's request is aborted
        "POST", f"{server.url}/v1/completions", json=several, headers=headers, timeout=TIMEOUT_S
    ) as response:
        assert next(line for line in response.iter_lines() if line.startswith("data: "))
    _wait_for_aborts_and_idle(server, aborts + 7)
    assert metric(server, "specdec:request_aborts_total") == aborts + 7
    assert metric(server, "specdec:kv_cache_free_blocks") == metric(
        server, "specdec:kv_cache_num_blocks"
    )
    assert complete(client, max_tokens=2).choices[0].text is not None


def test_metrics_expose_vllm_names(server, client):
    complete(client, max_tokens=2)  # one completion of its own: the route's counter exists
    text = httpx.get(f"{server.url}/metrics", timeout=TIMEOUT_S).text
    for name in (
        "vllm:spec_decode_num_drafts_total",
        "vllm:spec_decode_num_draft_tokens_total",
        "vllm:spec_decode_num_accepted_tokens_total",
        "vllm:spec_decode_num_accepted_tokens_per_pos_total",
        "vllm:time_to_first_token_seconds_bucket",
        "vllm:time_per_output_token_seconds_bucket",
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
        'specdec:http_requests_total{route="/v1/completions",status="200"}',
        "specdec:num_device_rounds_total",
        "specdec:num_graph_rounds_total",
        "specdec:num_round_joins_total",
        "specdec:num_side_rows_total",
        "specdec:num_overlapped_steps_total",
        "specdec:num_overlapped_prefill_steps_total",
        "specdec:num_sync_steps_total",
        "specdec:num_graphed_prefill_steps_total",
        "specdec:num_plain_arm_steps_total",
        "specdec:cuda_graphs_after_warm_up_total",
        "specdec:stream_outputs_coalesced_total",
    ):
        assert name in text, name
    rows = [line for line in text.splitlines() if line.startswith("specdec:num_rows_total{")]
    for kind in ("prefill", "plain", "speculative"):
        assert any(f'kind="{kind}"' in line for line in rows), (kind, rows)
    assert any('kind="prefill"' in line and not line.endswith(" 0.0") for line in rows), rows
    late = [line for line in text.splitlines() if line.startswith("specdec:cuda_graphs_after")]
    assert len(late) == 1 and late[0].endswith(" 0.0"), late  # the CPU captures none


def test_shutdown_aborts_requests_in_flight(model_dir):
    engine = LLMEngine(EngineConfig(model=str(model_dir), max_model_len=MAX_MODEL_LEN))
    async_engine = AsyncEngine(engine)
    async_engine.start()
    params = SamplingParams(n=4, max_tokens=200, ignore_eos=True, seed=1)

    async def run() -> None:
        stream = await async_engine.add("r", [5, 6, 7], params, None)
        outputs = aiter(stream)
        await asyncio.wait_for(anext(outputs), TIMEOUT_S)
        await asyncio.to_thread(async_engine.shutdown, TIMEOUT_S)
        with pytest.raises(EngineDeadError):
            async with asyncio.timeout(TIMEOUT_S):
                async for output in outputs:
                    assert not output.finished
        with pytest.raises(EngineDeadError):
            await async_engine.add("late", [5], params, None)

    asyncio.run(run())
    assert not async_engine.is_alive
    assert engine.allocator.num_free_blocks == engine.allocator.num_blocks
    assert not engine.has_unfinished


# ------------------------------------------------- penalties, bias and bans
def test_logit_bias_bans_and_penalties_apply(client):
    z = char_ids("z")[0]
    biased = complete(client, logit_bias={str(z): 100}, seed=1, extra_body={"ignore_eos": True})
    assert biased.choices[0].text == "z" * 12
    allowed = complete(
        client, seed=1, extra_body={"ignore_eos": True, "allowed_token_ids": char_ids("ab")}
    )
    assert set(allowed.choices[0].text) <= {"a", "b"}
    banned = complete(
        client,
        seed=1,
        max_tokens=30,
        extra_body={"ignore_eos": True, "allowed_token_ids": char_ids("ab"), "bad_words": ["a"]},
    )
    assert banned.choices[0].text == "b" * 30
    plain = complete(client, seed=4, max_tokens=30, extra_body={"ignore_eos": True})
    penalised = complete(
        client,
        seed=4,
        max_tokens=30,
        presence_penalty=2.0,
        frequency_penalty=2.0,
        extra_body={"ignore_eos": True},
    )
    assert penalised.choices[0].text != plain.choices[0].text
    assert len(set(penalised.choices[0].text)) >= len(set(plain.choices[0].text))


def test_penalised_coupled_speculation_replays_plain_sampling(server):
    """Coupled verification with penalties, a bias and bans emits plain penalised sampling's
    tokens exactly (the drafts are processed with the drafts before them, as verify is)."""

    def text(speculative: dict) -> dict:
        body = {
            "model": MODEL,
            "prompt": "abcabcabcabc",
            "max_tokens": 24,
            "seed": 8,
            "ignore_eos": True,
            "presence_penalty": 0.5,
            "frequency_penalty": 0.3,
            "repetition_penalty": 1.2,
            "logit_bias": {str(char_ids("c")[0]): 3.0},
            "bad_words": ["ca"],
            "speculative": speculative,
        }
        return post(server, "/v1/completions", body).json()

    plain = text({"enabled": False})
    coupled = text({"rejection_sample_method": "coupled"})
    assert coupled["choices"][0]["text"] == plain["choices"][0]["text"]
    assert "ca" not in plain["choices"][0]["text"]
    assert coupled["spec_decode_stats"]["num_drafts"] > 0


# ------------------------------------------------- fields we do not implement
@pytest.mark.parametrize(
    ("path", "extra", "param", "words"),
    [
        ("/v1/chat/completions", {"tools": [{"type": "function"}]}, "tools", "not supported"),
        ("/v1/chat/completions", {"tool_choice": "auto"}, "tool_choice", "not supported"),
        ("/v1/chat/completions", {"functions": []}, "functions", "not supported"),
        (
            "/v1/chat/completions",
            {"response_format": {"type": "structural_tag"}},
            "response_format.type",
            "structural_tag",
        ),
        (
            "/v1/completions",
            {"response_format": {"type": "json_schema"}},
            "response_format",
            "json_schema",
        ),
        ("/v1/completions", {"suffix": "x"}, "suffix", "not supported"),
        ("/v1/completions", {"best_of": 3}, "best_of", "best_of=3 is not supported"),
        ("/v1/completions", {"bogus": 1}, "bogus", "not supported"),
        ("/v1/completions", {"logit_bias": {"abc": 1}}, "logit_bias", "token ids"),
        ("/v1/completions", {"logit_bias": {"500": 1}}, None, "logit_bias"),
        ("/v1/completions", {"presence_penalty": 3}, "presence_penalty", None),
        (
            "/v1/completions",
            {"speculative": {"method": "block"}},
            "speculative",
            "rejection_sample_method",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x", "tool_call_id": "1"}]},
            "messages.0.tool_call_id",
            "not supported",
        ),
    ],
)
def test_unimplemented_fields_get_400_naming_them(server, path, extra, param, words):
    body = {"model": MODEL, "max_tokens": 2}
    body.update({"messages": [{"role": "user", "content": "hi"}]} if "chat" in path else {})
    body.update({"prompt": "hi"} if "chat" not in path else {})
    error = assert_error(post(server, path, {**body, **extra}), 400, param)
    if words is not None:
        assert words in error["message"], error["message"]


def test_text_response_format_and_user_are_accepted(client):
    out = complete(
        client, max_tokens=2, user="someone", extra_body={"response_format": {"type": "text"}}
    )
    assert out.choices[0].text is not None
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi", "name": "ann"}],
        max_tokens=2,
        response_format={"type": "text"},
    )
    assert chat.choices[0].message.content is not None


# ------------------------------------------------- vLLM's extra routes and fields
def test_tokenize_detokenize_ping_and_model_card(server, client):
    tokens = post(server, "/tokenize", {"model": MODEL, "prompt": "hello"}).json()
    assert tokens["tokens"] == char_ids("hello") and tokens["count"] == 5
    assert tokens["max_model_len"] == MAX_MODEL_LEN
    chat = post(
        server,
        "/tokenize",
        {"messages": [{"role": "user", "content": "hi"}], "return_token_strs": True},
    ).json()
    rendered = "".join(chat["token_strs"])  # (the character tokenizer has no newline)
    assert rendered.startswith("user: hi") and rendered.endswith("assistant: ")
    text = post(server, "/detokenize", {"tokens": char_ids("hello")}).json()
    assert text == {"prompt": "hello"}
    assert_error(post(server, "/detokenize", {"tokens": [500]}), 400, "tokens")
    assert_error(post(server, "/tokenize", {"prompt": "x", "messages": []}), 400)
    for method in (httpx.get, httpx.post):
        assert method(f"{server.url}/ping", timeout=TIMEOUT_S).status_code == 200
    card = client.models.retrieve(MODEL)
    assert card.id == MODEL and card.created > 1_700_000_000
    assert client.models.retrieve("default").id == "default"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("nope")


def test_response_ids_are_random_and_created_is_the_time(client):
    import time

    kwargs = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    first = client.chat.completions.create(**kwargs)
    second = client.chat.completions.create(**kwargs)
    assert re.fullmatch(r"chatcmpl-[0-9a-f]{32}", first.id) and first.id != second.id
    assert re.fullmatch(r"cmpl-[0-9a-f]{32}", complete(client, max_tokens=1).id)
    assert abs(first.created - time.time()) < 120


def test_prompt_logprobs_and_chat_continuation(client):
    out = complete(client, prompt="abcd", max_tokens=2, extra_body={"prompt_logprobs": 1})
    entries = out.choices[0].model_extra["prompt_logprobs"]
    assert entries[0] is None and len(entries) == 4
    assert all(
        str(t) in e and e[str(t)]["rank"] >= 1
        for t, e in zip(char_ids("abcd")[1:], entries[1:], strict=True)
    )
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hel"}]
    chat = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=3,
        extra_body={"add_generation_prompt": False, "continue_final_message": True},
    )
    assert chat.choices[0].message.content is not None
    with pytest.raises(openai.BadRequestError, match="continue_final_message"):
        client.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=3,
            extra_body={"continue_final_message": True},
        )


def test_metrics_count_preemptions(model_dir):
    """vllm:num_preemptions_total is the engine's count: 0 at start, then the preemptions of a
    cache too small for its requests."""
    from specdec.server.prometheus import ServerMetrics

    engine = LLMEngine(
        EngineConfig(model=str(model_dir), max_model_len=48, num_kv_blocks=12, block_size=4)
    )
    async_engine = AsyncEngine(engine)
    metrics = ServerMetrics(lambda: async_engine.snapshot, MODEL)
    assert 'vllm:num_preemptions_total{model_name="tiny"} 0.0' in metrics.render().decode()
    params = SamplingParams(max_tokens=40, ignore_eos=True, seed=1)
    for i in range(4):
        engine.add_request([5 + i] * 6, params)
    while engine.has_unfinished:
        engine.step()
    async_engine.snapshot = snapshot_of(engine)
    assert engine.num_preemptions > 0
    line = f'vllm:num_preemptions_total{{model_name="tiny"}} {float(engine.num_preemptions)}'
    assert line in metrics.render().decode()


def test_metrics_show_the_speculation_policys_estimates(model_dir):
    """specdec:spec_policy_step_seconds and _acceptance are the adaptive policy's own estimates
    after an engine's speculative steps (none before: no step measured)."""
    from specdec.server.prometheus import ServerMetrics

    spec = SpeculativeConfig.from_dict({**SPECULATIVE, "adaptive": True})
    engine = LLMEngine(EngineConfig(model=str(model_dir), max_model_len=MAX_MODEL_LEN), spec)
    async_engine = AsyncEngine(engine)
    metrics = ServerMetrics(lambda: async_engine.snapshot, MODEL)
    assert "specdec:spec_policy_step_seconds{" not in metrics.render().decode()
    for i in range(2):
        engine.add_request([5 + i] * 6, SamplingParams(max_tokens=60, ignore_eos=True, seed=i))
    while engine.has_unfinished:
        engine.step()
    async_engine.snapshot = snapshot_of(engine)
    text = metrics.render().decode()
    for (bucket, arm), (seconds, _) in engine.policy.costs().items():
        line = f'specdec:spec_policy_step_seconds{{bucket="{bucket}",k="{arm}",model_name="tiny"}}'
        assert f"{line} {seconds}" in text, line
    assert engine.policy.costs()
    rate = engine.policy.acceptance(0)
    assert f'specdec:spec_policy_acceptance{{model_name="tiny",position="0"}} {rate}' in text


def test_drain_ends_open_requests_with_a_final_abort_output(model_dir):
    """A graceful shutdown (SIGTERM) first drains the engine: each request in flight gets a
    final output with finish_reason "abort", and later requests are refused."""
    engine = LLMEngine(EngineConfig(model=str(model_dir), max_model_len=MAX_MODEL_LEN))
    async_engine = AsyncEngine(engine)
    async_engine.start()
    params = SamplingParams(n=2, max_tokens=200, ignore_eos=True, seed=1)

    async def run() -> list:
        stream = await async_engine.add("r", [5, 6, 7], params, None)
        outputs = aiter(stream)
        await asyncio.wait_for(anext(outputs), TIMEOUT_S)
        async_engine.drain()
        async with asyncio.timeout(TIMEOUT_S):
            last = [output async for output in outputs]
        with pytest.raises(EngineDeadError, match="shutting down"):
            await async_engine.add("late", [5], params, None)
        return last

    last = asyncio.run(run())
    assert last[-1].finished
    assert {c.finish_reason for c in last[-1].outputs} == {"abort"}
    async_engine.shutdown(TIMEOUT_S)
    assert engine.allocator.num_free_blocks == engine.allocator.num_blocks


def test_a_request_without_usable_logits_ends_in_error_alone(model_dir):
    """A request whose logits row goes NaN mid-generation ends with finish_reason "error" and the
    engine's message in its choice (non-streaming, and as the last chunk of a stream, completion
    and chat), keeping the text it had; a prompt batched beside it gets the text it gets alone;
    specdec:request_errors_total counts it."""
    engine = LLMEngine(
        EngineConfig(model=str(model_dir), max_model_len=MAX_MODEL_LEN),
        SpeculativeConfig.from_dict(SPECULATIVE),
    )
    marker = char_ids("NaN?")
    spoiling = [True]

    def position_of(request) -> int | None:
        ids = request.prompt_token_ids
        marked = any(ids[i : i + len(marker)] == marker for i in range(len(ids)))
        return request.num_prompt_tokens + 3 if marked and spoiling[0] else None

    config = ServerConfig(served_model_name=MODEL, api_key=API_KEY)
    with unusable_logits(engine, position_of):
        server = ServerThread(build_app(AsyncEngine(engine), config)).start()
        try:
            client = openai.OpenAI(
                base_url=f"{server.url}/v1", api_key=API_KEY, timeout=TIMEOUT_S, max_retries=0
            )
            extra = {"ignore_eos": True}
            prompts = ["NaN? hello", "hello there"]
            good_alone = complete(client, prompt=prompts[1], seed=4, extra_body=extra)
            out = complete(client, prompt=prompts, seed=4, extra_body=extra)
            bad, good = sorted(out.choices, key=lambda c: c.index)
            message = (
                f"the model produced no usable logits for the token at position "
                f"{len(prompts[0]) + 3} (NaN or -inf everywhere, or a +inf): the request was "
                "stopped"
            )
            assert bad.finish_reason == "error" and bad.model_extra["error"] == message
            assert good.finish_reason == "length" and "error" not in good.model_extra
            assert good.text == good_alone.choices[0].text
            assert out.usage.completion_tokens == 3 + 12  # the tokens before the bad row stay
            assert metric(server, "specdec:request_errors_total") == 1

            chunks = list(complete(client, prompt=prompts, seed=4, stream=True, extra_body=extra))
            streamed, last = ["", ""], [None, None]
            for chunk in chunks:
                for c in chunk.choices:
                    streamed[c.index] += c.text
                    last[c.index] = c
            assert streamed == [bad.text, good.text]
            assert last[0].finish_reason == "error" and last[0].model_extra["error"] == message
            assert last[1].finish_reason == "length"

            chat = {"model": MODEL, "messages": [{"role": "user", "content": "NaN? hi"}]}
            reply = client.chat.completions.create(**chat, max_tokens=10, seed=3)
            assert reply.choices[0].finish_reason == "error"
            assert "no usable logits" in reply.choices[0].model_extra["error"]
            stream = client.chat.completions.create(**chat, max_tokens=10, seed=3, stream=True)
            finishes = [c.choices[0] for c in stream if c.choices]
            assert finishes[-1].finish_reason == "error"
            assert finishes[-1].model_extra["error"] == reply.choices[0].model_extra["error"]
            assert metric(server, "specdec:request_errors_total") == 4

            spoiling[0] = False  # the same request with usable logits: the text it cut short
            clean = complete(client, prompt=prompts[0], seed=4, extra_body=extra)
            assert clean.choices[0].finish_reason == "length"
            assert clean.choices[0].text.startswith(bad.text)
            assert engine.allocator.num_free_blocks == engine.allocator.num_blocks
        finally:
            server.stop()


def test_the_openai_client_reads_logprob_bytes_and_the_named_errors(client):
    """Through the official client: each chat logprob's `bytes` is its token's own bytes (the
    tiny tokenizer's tokens are ASCII characters); an image part and an unknown model are errors
    that say what to send."""
    reply = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "abc"}],
        max_tokens=6,
        temperature=0.0,
        logprobs=True,
        top_logprobs=2,
    )
    entries = reply.choices[0].logprobs.content
    assert entries
    for entry in entries:
        assert entry.bytes == list(entry.token.encode())
        assert all(top.bytes == list(top.token.encode()) for top in entry.top_logprobs)
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    with pytest.raises(openai.BadRequestError, match="this model takes text only"):
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": [{"type": "text", "text": "hi"}, image]}],
            max_tokens=2,
        )
    with pytest.raises(openai.NotFoundError, match="'gpt-4' is not served here; use 'tiny'"):
        client.chat.completions.create(
            model="gpt-4", messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )
