"""Seeded completions replay through the server: 24 concurrent requests (streaming and not) each
return, token for token, what the same request returns sent alone to the idle server, with the
speculation `specdec serve` uses for a model of its own (prompt lookup, the default coupled
verifier) and without (`--no-spec`); the two agree with each other. A negative control (logits
that depend on the step's batch) must fail the same comparison.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
import torch

from e2e.server_fixtures import ServerThread, make_tiny_model_dir
from replay_fixtures import make_batch_dependent, replay_requests, spy_schedule
from specdec.cli.flags import DEFAULT_SPECULATIVE_CONFIG, default_spec
from specdec.engine.config import EngineConfig, SpeculativeConfig
from specdec.engine.llm_engine import LLMEngine
from specdec.server import AsyncEngine, ServerConfig, build_app

pytestmark = pytest.mark.e2e

MODEL = "tiny"
TIMEOUT_S = 120.0
NUM_REQUESTS = 24


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """One torch thread (the server's engine thread, started after it, too): the tiny model's
    products are small, and on a busy 2-core machine two OpenMP threads spin-waiting
    for each other make a step 20x slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny-replay"))


@pytest.fixture(
    scope="module",
    params=["no-spec", "no-spec-overlapped", "default-spec", "default-spec-overlapped"],
)
def server(request, model_dir):
    """A server as `specdec serve MODEL_DIR [--no-spec]` builds it (engine defaults, the
    commands' default speculation for a model other than the built-in one; or with
    `--async-scheduling on`, CUDA's default paths: requests join steps launched ahead, and with
    speculation the one overlapped loop hands the batch to device rounds, run op by op here),
    and its engine's step log."""
    spec = None
    overlapped = request.param.endswith("-overlapped")
    if request.param.startswith("default-spec"):
        values = default_spec(str(model_dir), "auto")
        assert values == DEFAULT_SPECULATIVE_CONFIG  # prompt lookup
        spec = SpeculativeConfig.from_dict(values)
        assert spec.rejection_sample_method == "coupled"  # the default verifier
    engine = LLMEngine(EngineConfig(model=str(model_dir), async_scheduling=overlapped), spec)
    log = spy_schedule(engine)
    thread = ServerThread(build_app(AsyncEngine(engine), ServerConfig(MODEL))).start()
    yield request.param, thread, engine, log
    thread.stop()


def bodies() -> list[dict]:
    """24 seeded completions (token-id prompts of 4-70 tokens, temperature 0.8 with top_p 0.95
    or greedy, 24-40 tokens, ignore_eos), every other one streamed. Special tokens are kept in
    the text, so that the text names every token (one character per token otherwise)."""
    out = []
    for index in range(NUM_REQUESTS):
        request = replay_requests(seed=index // 6)[index % 6]
        params = request.params
        out.append(
            {
                "model": MODEL,
                "prompt": request.prompt,
                "max_tokens": params.max_tokens,
                "temperature": params.temperature,
                "top_p": params.top_p,
                "seed": params.seed,
                "ignore_eos": True,
                "skip_special_tokens": False,
                "stream": index % 2 == 0,
                **({"stream_options": {"include_usage": True}} if index % 2 == 0 else {}),
            }
        )
    return out


async def send(http: httpx.AsyncClient, body: dict) -> tuple[str, int]:
    """(text, completion tokens) of one completion, streamed or not."""
    if not body["stream"]:
        response = await http.post("/v1/completions", json=body)
        assert response.status_code == 200, response.text
        data = response.json()
        return data["choices"][0]["text"], data["usage"]["completion_tokens"]
    text, tokens, done = "", 0, 0
    async with http.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line == "data: [DONE]":
                done += 1
            elif line.startswith("data: "):
                chunk = json.loads(line[6:])
                text += "".join(choice["text"] for choice in chunk["choices"])
                tokens += (chunk.get("usage") or {}).get("completion_tokens", 0)
    assert done == 1
    return text, tokens


def alone_and_together(url: str) -> tuple[list[tuple[str, int]], list[tuple[str, int]]]:
    """Every request sent alone (one after another, the server idle between them), then all
    of them at once."""

    async def run():
        limits = httpx.Limits(max_connections=NUM_REQUESTS)
        async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT_S, limits=limits) as http:
            alone = [await send(http, body) for body in bodies()]
            together = await asyncio.gather(*[send(http, body) for body in bodies()])
        return alone, list(together)

    return asyncio.run(run())


def differences(want: list[tuple[str, int]], got: list[tuple[str, int]]) -> list[str]:
    lines = []
    for index, ((want_text, want_tokens), (got_text, got_tokens)) in enumerate(
        zip(want, got, strict=True)
    ):
        expected = bodies()[index]["max_tokens"]
        if want_tokens != expected or got_tokens != expected:
            lines.append(f"request {index}: {want_tokens} / {got_tokens} tokens, not {expected}")
        elif want_text != got_text:
            first = next(
                (j for j, (a, b) in enumerate(zip(want_text, got_text, strict=False)) if a != b),
                min(len(want_text), len(got_text)),
            )
            lines.append(f"request {index}: the texts differ from character {first}")
    return lines


TEXTS: dict[str, list[tuple[str, int]]] = {}  # per server: the requests sent alone


def test_concurrent_completions_replay_each_alone(server):
    """24 concurrent completions, streamed and not, against each sent alone: fails if a
    request's tokens depend on the requests it shares the engine's steps with. The two
    servers' texts are equal too (fails if coupled speculation leaves plain sampling)."""
    name, thread, engine, log = server
    alone, together = alone_and_together(thread.url)
    diff = differences(alone, together)
    assert not diff, diff
    if name != "default-spec-overlapped":  # (the rounds' joiners prefill in steps of their own)
        assert log.num_mixed_steps > 0  # prompts were prefilled beside other requests' decode rows
    TEXTS[name] = alone
    if name == "no-spec-overlapped":
        assert engine.loop_stats.num_overlapped_steps > 0
        assert not differences(TEXTS.get("no-spec", alone), alone)
    if name.startswith("default-spec"):
        assert engine.stats.num_drafts > 0
        if "no-spec" in TEXTS:
            assert not differences(TEXTS["no-spec"], alone)
    if name == "default-spec-overlapped":
        loop = engine.loop_stats
        # prefill in the overlapped loop, then rounds (requests sent together all start in
        # the loop; `test_replay.py` has arrivals joining running rounds)
        assert loop.num_device_rounds > 0 and loop.num_overlapped_prefill_steps > 0


def test_negative_control_batch_dependent_logits_fail_the_comparison(server, monkeypatch):
    """The same comparison with logits that gain a term depending on the step's rows (patched
    while the server runs): it must find differences, else it has no power."""
    _, thread, _, _ = server
    make_batch_dependent(monkeypatch)
    alone, together = alone_and_together(thread.url)
    assert differences(alone, together)
