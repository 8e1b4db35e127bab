"""`specdec serve` runs its engine in a process of its own (`EngineClient`): seeded streams sent
together replay their solo runs through it, and with speculation off; a request without a seed
gets a fresh one; a killed engine process ends the open streams with an error and the server
exits; a checkpoint the engine cannot load is one line before anything is served."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from e2e.server_fixtures import free_port, make_tiny_model_dir

pytestmark = pytest.mark.e2e


def _serve(model_dir: Path, port: int, *extra: str) -> subprocess.Popen:
    command = [sys.executable, "-m", "specdec.cli", "serve", str(model_dir), "--port", str(port)]
    command += ["--num-kv-blocks", "256", "--threads", "1", *extra]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_ready(process: subprocess.Popen, url: str) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError:
            time.sleep(0.2)
        if process.poll() is not None:
            break
    pytest.fail("the server did not come up: " + process.stderr.read())


def _engine_pid(server_pid: int) -> int:
    """The engine process: the one child of the server that multiprocessing spawned."""
    children = Path(f"/proc/{server_pid}/task/{server_pid}/children").read_text().split()
    spawned = [
        int(child)
        for child in children
        if b"spawn_main" in Path(f"/proc/{child}/cmdline").read_bytes()
    ]
    (engine,) = spawned
    return engine


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny-engine-process"))


@pytest.fixture(scope="module")
def server(model_dir):
    """The server with its default speculation (n-gram, the default verifier)."""
    port = free_port()
    process = _serve(model_dir, port)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_ready(process, url)
        yield process, url
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()


def _body(seed: int | None, speculative: dict | None = None, stream: bool = False) -> dict:
    body = {
        "model": "default",
        "prompt": f"abcabc {seed} abcabc",
        "max_tokens": 24,
        "temperature": 0.8,
        "ignore_eos": True,
        "stream": stream,
    }
    if seed is not None:
        body["seed"] = seed
    if speculative is not None:
        body["speculative"] = speculative
    return body


async def _stream_pieces(http: httpx.AsyncClient, body: dict) -> list[str]:
    """A stream's text, chunk by chunk (empty pieces left out)."""
    pieces = []
    async with http.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[len("data: ") :])
                pieces += [choice["text"] for choice in chunk["choices"] if choice["text"]]
    return pieces


async def _stream_text(http: httpx.AsyncClient, body: dict) -> str:
    return "".join(await _stream_pieces(http, body))


def _cpu_ticks(pid: int) -> int:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime + stime


def test_the_engine_runs_in_its_own_process(server):
    """The steps run in the engine process: its CPU time grows with the tokens generated."""
    process, url = server
    engine = _engine_pid(process.pid)
    before = _cpu_ticks(engine)
    body = {**_body(1), "max_tokens": 200}
    for _ in range(3):
        assert httpx.post(f"{url}/v1/completions", json=body, timeout=60).status_code == 200
    assert _cpu_ticks(engine) > before


def test_seeded_streams_sent_together_replay_their_solo_runs(server):
    _, url = server
    seeds = list(range(12))
    alone = [
        httpx.post(f"{url}/v1/completions", json=_body(s), timeout=60).json()["choices"][0]["text"]
        for s in seeds
    ]

    async def together(speculative: dict | None) -> list[str]:
        async with httpx.AsyncClient(base_url=url, timeout=60) as http:
            return await asyncio.gather(
                *[_stream_text(http, _body(s, speculative, stream=True)) for s in seeds]
            )

    assert asyncio.run(together(None)) == alone
    assert asyncio.run(together({"enabled": False})) == alone  # the default verifier's law
    assert len(set(alone)) == len(alone)  # the seeds matter (else the check above is empty)


def test_requests_without_a_seed_get_distinct_seeds(server):
    _, url = server
    seeds = [
        httpx.post(f"{url}/v1/completions", json=_body(None), timeout=60).json()["seed"]
        for _ in range(3)
    ]
    assert len(set(seeds)) == 3


def test_a_killed_engine_process_ends_open_streams_and_the_server_exits(model_dir):
    port = free_port()
    process = _serve(model_dir, port, "--no-spec", "--max-tokens-limit", "20000")
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_ready(process, url)
        body = {"model": "default", "prompt": "go", "max_tokens": 200, "ignore_eos": True}
        lines = []
        with httpx.stream(
            "POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=60
        ) as response:
            stream = response.iter_lines()
            lines.append(next(line for line in stream if line.startswith("data: ")))
            os.kill(_engine_pid(process.pid), signal.SIGKILL)
            killed = time.monotonic()
            lines += [line for line in stream if line.startswith("data: ")]
        process.wait(timeout=20)
        exited = time.monotonic() - killed
    finally:
        if process.poll() is None:
            process.kill()
    last = json.loads(lines[-1][len("data: ") :])
    assert last["error"]["message"] == "the request was aborted: the engine stopped"
    assert exited < 10.0
    assert "the engine process exited" in process.stderr.read()


def test_a_checkpoint_the_engine_cannot_load_is_one_line(tmp_path):
    model_dir = make_tiny_model_dir(tmp_path)
    weights = model_dir / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    done = subprocess.run(
        [sys.executable, "-m", "specdec.cli", "serve", str(model_dir), "--port", str(free_port())],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("specdec serve: error")]
    assert len(errors) == 1, done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize("disabled", [False, True])
def test_a_busy_engine_writes_its_line_of_figures(model_dir, disabled):
    port = free_port()
    extra = ["--no-spec", "--max-tokens-limit", "4000"] + (["--disable-log-stats"] * disabled)
    command = [sys.executable, "-m", "specdec.cli", "serve", str(model_dir), "--port", str(port)]
    command += ["--num-kv-blocks", "256", "--threads", "1", *extra]
    env = {**os.environ, "SPECDEC_LOG_STATS_INTERVAL": "0.2"}
    process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_ready(process, url)
        body = {"model": "default", "prompt": "go", "max_tokens": 200, "ignore_eos": True}
        for _ in range(3):
            assert httpx.post(f"{url}/v1/completions", json=body, timeout=60).status_code == 200
    finally:
        process.send_signal(signal.SIGTERM)
        stderr = process.communicate(timeout=30)[1]
    lines = [line for line in stderr.splitlines() if line.startswith("engine: running")]
    if disabled:
        assert lines == []
    else:
        assert lines, stderr[-2000:]
        assert "generation" in lines[0] and "KV cache" in lines[0]


async def _stream_chunks(url: str, bodies: list[dict]) -> list[list[str]]:
    async with httpx.AsyncClient(base_url=url, timeout=60) as http:
        return await asyncio.gather(*[_stream_pieces(http, body) for body in bodies])


def test_the_stream_interval_gathers_a_streams_tokens_and_changes_none(model_dir):
    """With `STREAM_GATHER_FROM` (16) streams running, the engine process builds their outputs
    every `STREAM_INTERVAL_S` (`SPECDEC_STREAM_INTERVAL_MS`), each send carrying every token
    since the last: at 300 ms, 16 plain 40-token streams of the tiny model come in a few chunks
    each; at 0 (every step, the negative control) in about one chunk a token. Each stream's
    text is the same either way, and is its non-streamed completion's."""
    bodies = [
        {**_body(seed), "max_tokens": 40, "speculative": {"enabled": False}} for seed in range(16)
    ]
    texts, counts = [], []
    for interval_ms in ("0", "300"):
        port = free_port()
        command = [sys.executable, "-m", "specdec.cli", "serve", str(model_dir), "--port"]
        command += [str(port), "--num-kv-blocks", "256", "--threads", "1"]
        env = {**os.environ, "SPECDEC_STREAM_INTERVAL_MS": interval_ms}
        process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, env=env)
        url = f"http://127.0.0.1:{port}"
        try:
            _wait_ready(process, url)
            whole = [
                httpx.post(f"{url}/v1/completions", json=body, timeout=60).json() for body in bodies
            ]
            streams = asyncio.run(_stream_chunks(url, [{**b, "stream": True} for b in bodies]))
        finally:
            process.send_signal(signal.SIGTERM)
            process.communicate(timeout=30)
        alone = [w["choices"][0]["text"] for w in whole]
        assert ["".join(chunks) for chunks in streams] == alone
        texts.append(alone)
        counts.append(max(len(chunks) for chunks in streams))
    assert texts[0] == texts[1]
    every_step, gathered = counts
    assert every_step >= 20, counts  # the control: about one chunk a token
    assert gathered <= every_step // 3, counts
