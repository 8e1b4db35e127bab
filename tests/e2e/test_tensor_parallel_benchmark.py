"""benchmarks/bench_tensor_parallel.py end to end on the CPU at its toy shape (a subprocess; no
timing is asserted): it writes its JSON with a TP = 1 and a TP = 2 run and their ratios."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

SCRIPT = Path(__file__).parents[2] / "benchmarks" / "bench_tensor_parallel.py"


def test_the_step_part_runs_on_the_tiny_shape(tmp_path):
    args = ["--out", str(tmp_path), "--device", "cpu", "--shapes", "tiny", "--steps", "2"]
    done = subprocess.run(
        [sys.executable, str(SCRIPT), *args, "--batches", "1,2"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    report = json.loads((tmp_path / "tensor_parallel.json").read_text())
    runs = {(run["shape"], run["tp"]): run for run in report["step"]}
    assert set(runs) == {("tiny", 1), ("tiny", 2)}
    two = runs["tiny", 2]
    assert two["weight_bytes_per_rank"] < runs["tiny", 1]["weight_bytes_per_rank"]
    assert set(two["tp2_over_tp1"]) == {"1", "2"}  # JSON keys: the batch sizes
    for entry in two["batches"]:
        assert {"step_ms", "all_reduce_eager_ms_per_step", "control_broadcast_ms"} <= set(entry)
