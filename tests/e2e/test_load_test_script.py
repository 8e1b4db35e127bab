"""benchmarks/load_test_serve.py on the tiny model: concurrent seeded streams with clients that
leave early, the server idle afterwards, streams equal to their solo runs, and SIGTERM with long
streams open (the GPU run of the same script is issue 35's 256-stream load test)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from e2e.server_fixtures import make_tiny_model_dir

pytestmark = pytest.mark.e2e

SCRIPT = Path(__file__).parents[2] / "benchmarks" / "load_test_serve.py"


def test_the_load_test_passes_on_the_tiny_model(tmp_path):
    model_dir = make_tiny_model_dir(tmp_path / "tiny")
    config = json.loads((model_dir / "config.json").read_text())
    config["max_position_embeddings"] = 20_000  # long streams are still open at the SIGTERM
    (model_dir / "config.json").write_text(json.dumps(config))
    out = tmp_path / "load.json"
    command = [sys.executable, str(SCRIPT), "--serve", str(model_dir), "--out", str(out)]
    command += ["--serve-arg=--num-kv-blocks=2000", "--serve-arg=--max-tokens-limit=20000"]
    command += ["--streams", "24", "--disconnects", "4", "--max-tokens", "16", "--solo", "6"]
    command += ["--sigterm-streams", "4", "--sigterm-max-tokens", "15000"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(out.read_text())
    load = report["load"]
    assert load["completed"] == 20 and load["disconnects"] == 4
    assert load["solo_equal"] == load["solo_compared"] == 6
    assert load["idle_after"] == {
        "vllm:num_requests_running": 0.0,
        "vllm:num_requests_waiting": 0.0,
        "vllm:kv_cache_usage_perc": 0.0,
    }
    assert report["sigterm"]["ended_with_abort_and_done"] == 4
