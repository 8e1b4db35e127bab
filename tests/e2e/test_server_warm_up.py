"""The server while its engine warms up: /health and /ping answer 503 ("warming up") until the
warm-up is done and 200 after; a request sent meanwhile waits and completes. The warm-up is held
open by a gate (the CPU's real one is skipped at once). Negative control: with `warm_up` off the
engine never warms up and /health is 200 at once. For the engine's own process, `is_ready`
turns true with its loop's first frame."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from e2e.server_fixtures import ServerThread, make_tiny_model_dir
from specdec.core.snapshot import EngineSnapshot
from specdec.core.wire import SNAPSHOT, encode_frame
from specdec.engine.config import EngineConfig
from specdec.engine.llm_engine import LLMEngine
from specdec.engine.warm_up import WarmUpReport
from specdec.server import AsyncEngine, EngineClient, ServerConfig, build_app

pytestmark = pytest.mark.e2e

TIMEOUT_S = 60.0


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny-warm-up-server"))


def gated_server(model_dir, warm_up: bool) -> tuple[ServerThread, threading.Event, list]:
    """A server whose engine's warm-up waits for the returned gate (and records its calls)."""
    engine = LLMEngine(EngineConfig(model=str(model_dir), max_model_len=128, warm_up=warm_up))
    gate, calls = threading.Event(), []

    def held_warm_up(**kwargs) -> WarmUpReport:
        calls.append(kwargs)
        gate.wait(TIMEOUT_S)
        return WarmUpReport(0, 0, 0.0, skipped="held by the test")

    engine.warm_up = held_warm_up
    server = ServerThread(build_app(AsyncEngine(engine), ServerConfig(served_model_name="tiny")))
    server.thread.start()  # (not `start()`: it waits for a 200)
    return server, gate, calls


def health(server: ServerThread, path: str = "/health") -> httpx.Response:
    deadline = time.monotonic() + TIMEOUT_S
    while True:
        try:
            return httpx.get(f"{server.url}{path}", timeout=5.0)
        except httpx.TransportError:  # the port is not up yet
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def test_health_is_503_while_warming_up_then_200(model_dir):
    server, gate, calls = gated_server(model_dir, warm_up=True)
    try:
        for path in ("/health", "/ping"):
            response = health(server, path)
            assert response.status_code == 503
            assert "warming up" in response.json()["error"]["message"]
        assert len(calls) == 1
        body = {"model": "tiny", "prompt": "hello", "max_tokens": 4, "seed": 1}
        result: list[httpx.Response] = []
        sender = threading.Thread(
            target=lambda: result.append(
                httpx.post(f"{server.url}/v1/completions", json=body, timeout=TIMEOUT_S)
            )
        )
        sender.start()
        time.sleep(0.3)
        assert not result  # the request waits for the warm-up
        gate.set()
        sender.join(TIMEOUT_S)
        assert result and result[0].status_code == 200
        assert health(server).status_code == 200
        assert health(server, "/ping").json() == {"status": "ok"}
        assert len(calls) == 1  # once
    finally:
        gate.set()
        server.stop()


def test_without_warm_up_health_is_200_at_once(model_dir):
    server, gate, calls = gated_server(model_dir, warm_up=False)
    try:
        assert health(server).status_code == 200
        assert not calls
    finally:
        gate.set()
        server.stop()


def test_engine_client_is_ready_with_the_first_frame():
    client = EngineClient(process=None, info=_Info(), directory="/nonexistent")
    assert not client.is_ready
    client._take(encode_frame(SNAPSHOT, None, EngineSnapshot()))
    assert client.is_ready


class _Info:
    tokenizer = None
    max_model_len = 16
    vocab_size = 97
    seed = None
