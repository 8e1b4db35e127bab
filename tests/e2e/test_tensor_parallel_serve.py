"""`specdec serve --tensor-parallel-size 2` on a tiny random-weight HF checkpoint (its
safetensors read shard by shard): it serves, and when a worker is killed the next request gets
503 and the server exits within seconds."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from e2e.server_fixtures import free_port, make_tiny_model_dir

pytestmark = pytest.mark.e2e


def _spawned_workers(pid: int) -> list[int]:
    """Child processes of `pid` started by multiprocessing's spawn (not its resource tracker)."""
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    workers = []
    for child in children:
        cmdline = Path(f"/proc/{child}/cmdline").read_bytes().replace(b"\0", b" ")
        if b"spawn_main" in cmdline:
            workers.append(int(child))
    return workers


def test_killed_worker_gives_503_and_the_server_exits(tmp_path):
    model_dir = make_tiny_model_dir(tmp_path)
    port = free_port()
    process = subprocess.Popen(
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
            "64",
            "--threads",
            "1",
            "--tensor-parallel-size",
            "2",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    url = f"http://127.0.0.1:{port}"
    body = {"model": "default", "prompt": "hello", "max_tokens": 8, "temperature": 0}
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{url}/health", timeout=1.0).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        else:
            pytest.fail("the server did not come up: " + process.stderr.read())
        assert httpx.post(f"{url}/v1/completions", json=body, timeout=60).status_code == 200
        (engine,) = _spawned_workers(process.pid)  # the engine process, which spawned the worker
        (worker,) = _spawned_workers(engine)
        os.kill(worker, signal.SIGKILL)
        time.sleep(0.5)
        killed = time.monotonic()
        response = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        assert response.status_code == 503, response.text
        process.wait(timeout=20)
        exited = time.monotonic() - killed
    finally:
        if process.poll() is None:
            process.kill()
    assert exited < 20.0
    stderr = process.stderr.read()
    assert "tensor-parallel worker rank 1" in stderr
    assert "device cpu x 2 (tensor parallel)" in stderr


def test_an_env_var_launch_runs_the_same_script_on_every_rank(tmp_path):
    """torchrun's contract on one machine: two processes with RANK / WORLD_SIZE / MASTER_ADDR /
    MASTER_PORT run one script; rank 0 drives, rank 1 serves; tokens equal TP = 1."""
    import json

    from models_fixtures import prompt_tokens
    from specdec import LLM, SamplingParams

    model_dir = make_tiny_model_dir(tmp_path)
    prompts = prompt_tokens(97, [4, 7])
    script = Path(__file__).parent.parent / "tensor_parallel_launch.py"
    port = free_port()
    env = {**os.environ, "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    ranks = [
        subprocess.Popen(
            [sys.executable, str(script), str(model_dir), json.dumps(prompts)],
            env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(2)
    ]
    try:
        results = [process.communicate(timeout=120) for process in ranks]
    finally:
        for process in ranks:
            if process.poll() is None:
                process.kill()
    assert [process.returncode for process in ranks] == [0, 0], results[0][1] + results[1][1]
    assert results[1][0] == ""  # the worker prints nothing
    reference = LLM(
        str(model_dir), speculative_config=None, quantization=None, max_num_seqs=4, num_kv_blocks=64
    ).generate(prompts, SamplingParams(max_tokens=8, temperature=0.0), use_tqdm=False)
    assert json.loads(results[0][0]) == [out.outputs[0].token_ids for out in reference]


@pytest.mark.skipif(shutil.which("torchrun") is None, reason="needs PyTorch's torchrun")
def test_torchrun_generate_prints_what_tp1_prints(tmp_path):
    """torchrun itself (two ranks on this machine, gloo): `specdec generate` prints the tokens
    TP = 1 prints, and nothing else reaches stdout (the worker's notes go to stderr)."""
    model_dir = make_tiny_model_dir(tmp_path)
    args = ["generate", "--model", str(model_dir), "--no-spec", "--no-chat", "--temperature", "0"]
    args += ["--max-tokens", "8", "--ignore-eos", "--threads", "1", "hello there"]
    run = dict(capture_output=True, text=True, timeout=180)
    alone = subprocess.run([sys.executable, "-m", "specdec", *args], **run)
    assert alone.returncode == 0, alone.stderr
    port = str(free_port())
    launcher = ["torchrun", "--nproc-per-node", "2", "--master-addr", "127.0.0.1"]
    launcher += ["--master-port", port, "-m", "specdec.cli"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    both = subprocess.run([*launcher, *args, "--tensor-parallel-size", "2"], env=env, **run)
    assert both.returncode == 0, both.stderr
    assert alone.stdout.strip() and both.stdout == alone.stdout


def test_an_env_var_launch_of_serve_serves_from_rank_0_and_stops_both(tmp_path):
    """`specdec serve` under torchrun's variables on two ranks: rank 0 binds the port and
    serves, rank 1 only replays steps; SIGTERM to rank 0 stops both."""
    model_dir = make_tiny_model_dir(tmp_path)
    port, rendezvous = free_port(), free_port()
    env = {**os.environ, "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1"}
    env["MASTER_PORT"] = str(rendezvous)
    command = [sys.executable, "-m", "specdec.cli", "serve", str(model_dir), "--port", str(port)]
    command += ["--no-spec", "--num-kv-blocks", "64", "--threads", "1"]
    command += ["--tensor-parallel-size", "2"]
    ranks = [
        subprocess.Popen(
            command,
            env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(2)
    ]
    url = f"http://127.0.0.1:{port}"
    body = {"model": "default", "prompt": "hello", "max_tokens": 8, "temperature": 0}
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{url}/health", timeout=1.0).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        else:
            pytest.fail("the server did not come up: " + ranks[0].stderr.read())
        response = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        assert response.status_code == 200, response.text
        ranks[0].send_signal(signal.SIGTERM)
        ranks[0].wait(timeout=30)
        ranks[1].wait(timeout=30)
    finally:
        for process in ranks:
            if process.poll() is None:
                process.kill()
    assert ranks[1].returncode == 0, ranks[1].stderr.read()
    assert "device cpu x 2 (tensor parallel)" in ranks[0].stderr.read()
