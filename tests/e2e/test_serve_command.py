"""`specdec serve` as a process on a tiny random-weight model: the port is checked before the
model loads, the start-up line says what runs, and SIGTERM ends open streams with a last chunk
(finish_reason "abort") and [DONE] before the process exits."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

from e2e.server_fixtures import free_port, make_tiny_model_dir

pytestmark = pytest.mark.e2e

# Long enough that a stream is still open when the signal comes (the tiny model takes
# milliseconds per token on the CPU, so 19,000 tokens run for a minute or more).
LONG = 19_000


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = make_tiny_model_dir(tmp_path_factory.mktemp("tiny-serve"))
    config = json.loads((path / "config.json").read_text())
    config["max_position_embeddings"] = 20_000
    (path / "config.json").write_text(json.dumps(config))
    return path


def serve(model_dir, port: int, *extra: str) -> subprocess.Popen:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "specdec.cli",
            "serve",
            str(model_dir),
            "--port",
            str(port),
            "--no-spec",
            "--num-kv-blocks",
            "1300",
            "--max-tokens-limit",
            str(LONG),
            "--threads",
            "1",
            *extra,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_a_busy_port_is_one_line_before_the_model_loads(model_dir):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        done = subprocess.run(
            [sys.executable, "-m", "specdec.cli", "serve", str(model_dir), "--port", str(port)],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
    assert done.returncode == 2
    assert done.stderr == (
        f"specdec serve: error: cannot listen on 127.0.0.1:{port}: the port is in use\n"
    )


def test_sigterm_ends_open_streams_with_a_last_chunk_and_exits(model_dir):
    port = free_port()
    process = serve(model_dir, port)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{url}/health", timeout=1.0).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
        else:
            pytest.fail("the server did not come up: " + process.stderr.read())
        body = {
            "model": "default",
            "prompt": "tell me everything",
            "max_tokens": LONG,
            "ignore_eos": True,
            "stream": True,
        }
        lines = []
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
            stream = response.iter_lines()
            lines.append(next(line for line in stream if line.startswith("data: ")))
            process.send_signal(signal.SIGTERM)
            signalled = time.monotonic()
            lines += [line for line in stream if line.startswith("data: ")]
        process.wait(timeout=30)
        exited = time.monotonic() - signalled
    finally:
        if process.poll() is None:
            process.kill()
    assert lines[-1] == "data: [DONE]"
    last = json.loads(lines[-2][len("data: ") :])
    assert last["choices"][0]["finish_reason"] == "abort"
    assert exited < 8.0, f"exit took {exited:.1f} s after SIGTERM"
    # uvicorn re-raises the signal once its graceful shutdown is done, so the status says
    # "terminated by SIGTERM", as process managers expect.
    assert process.returncode == -signal.SIGTERM
    stderr = process.stderr.read()
    startup = next(line for line in stderr.splitlines() if line.startswith("serving"))
    for words in (
        f"on http://127.0.0.1:{port}",
        f"model {model_dir}",
        "dtype float32",
        "device cpu",
        "max_model_len 20000 (the model's context)",
        "1300 KV blocks of 16 tokens",
        "speculation off",
    ):
        assert words in startup, startup
