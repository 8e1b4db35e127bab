"""What `specdec generate` and `specdec serve` tell the user, as processes on a tiny random-weight
model: the model named as `generate MODEL PROMPT` and `serve --model MODEL`; a bad argument
refused before anything loads; the start-up line naming the weight format and the speculation
(K pinned or adapting); the end of `generate` saying what speculation bought (tokens per
target forward) and, with --compare, both speeds from the same seed with the same tokens."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from e2e.server_fixtures import free_port, make_tiny_model_dir

pytestmark = pytest.mark.e2e

PER_FORWARD = re.compile(
    r"([\d.]+) tokens per target forward \(plain decoding: 1; (\d+) tokens in (\d+) forwards\)"
)
COMPARE = re.compile(r"speculation: ([\d.]+) tok/s, plain: ([\d.]+) tok/s \(([\d.]+)x\)")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny-generate"))


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "specdec.cli", *args, "--threads", "1"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def test_a_bad_regex_is_one_line_before_loading(model_dir):
    done = run_cli("generate", str(model_dir), "hi", "--regex", "[0-9")
    assert done.returncode == 2
    assert done.stderr == (
        "specdec generate: error: invalid --regex '[0-9': unclosed character class\n"
    )
    assert done.stdout == ""


def test_generate_model_prompt_says_what_runs_and_what_speculation_bought(model_dir):
    done = run_cli(
        "generate",
        str(model_dir),
        "abcabcabcabc",
        "--no-chat",
        "--max-tokens",
        "24",
        "--ignore-eos",
        "--temperature",
        "0",
        "--speculative-config",
        '{"num_speculative_tokens": 3}',
    )
    assert done.returncode == 0, done.stderr
    loading = done.stderr.splitlines()[0]
    assert loading.startswith(f"loading {model_dir} with ngram speculation ... done in"), loading
    assert "weights float32" in loading, loading
    assert "speculation ngram, K chosen per step in 0..3, coupled verification" in loading
    figures = PER_FORWARD.search(done.stderr)
    assert figures is not None, done.stderr
    per_forward, tokens, forwards = float(figures[1]), int(figures[2]), int(figures[3])
    assert tokens == 24 and 1 <= forwards <= tokens
    assert per_forward == pytest.approx(tokens / forwards, abs=0.005)
    assert "mean acceptance length" in done.stderr


def test_a_pinned_k_and_no_speculation_are_said_too(model_dir):
    done = run_cli(
        "generate",
        str(model_dir),
        "hi",
        "--max-tokens",
        "4",
        "--speculative-config",
        '{"adaptive": false, "rejection_sample_method": "standard"}',
    )
    assert done.returncode == 0, done.stderr
    assert "speculation ngram, K=4 fixed, standard verification)" in done.stderr.splitlines()[0]
    done = run_cli("generate", "--model", str(model_dir), "hi", "--max-tokens", "4", "--no-spec")
    assert done.returncode == 0, done.stderr
    assert done.stderr.splitlines()[0].endswith(
        "weights float32, max_model_len 256, speculation off)"
    )
    assert "tokens per target forward" not in done.stderr


def test_compare_runs_plain_decoding_with_the_same_seed(model_dir):
    """Coupled verification emits plain sampling's tokens, so at temperature 1 the plain run
    gives the same tokens only if it ran with the speculative run's seed."""
    done = run_cli(
        "generate",
        str(model_dir),
        "hello",
        "--max-tokens",
        "32",
        "--ignore-eos",
        "--temperature",
        "1",
        "--compare",
    )
    assert done.returncode == 0, done.stderr
    speeds = COMPARE.search(done.stderr)
    assert speeds is not None, done.stderr
    spec_speed, plain_speed, ratio = (float(x) for x in speeds.groups())
    assert spec_speed > 0 and plain_speed > 0
    assert ratio == pytest.approx(spec_speed / plain_speed, rel=0.01, abs=0.01)
    assert "plain ran 32 tokens in" in done.stderr and "the same tokens" in done.stderr


def test_serve_takes_model_as_a_flag_and_says_what_it_serves(model_dir):
    port = free_port()
    process = subprocess.Popen(
        [
            *(sys.executable, "-m", "specdec.cli", "serve", "--model", str(model_dir)),
            *("--port", str(port), "--num-kv-blocks", "64", "--threads", "1"),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    lines = []
    try:
        while True:
            line = process.stderr.readline()
            lines.append(line)
            if not line or line.startswith("serving"):
                break
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    startup = lines[-1]
    assert startup.startswith(f"serving {model_dir.name!r} on http://127.0.0.1:{port}"), lines
    for words in (
        f"model {model_dir}",
        "dtype float32, weights float32, device cpu",
        "64 KV blocks of 16 tokens",
        "speculation ngram, K chosen per step in 0..4, coupled verification",
    ):
        assert words in startup, startup
