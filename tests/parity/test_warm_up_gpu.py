"""The warm-up on a CUDA engine: after `LLMEngine.warm_up`, a load that walks every batch bucket
(plain and speculative, graphed prefill, device rounds with the adaptive policy, and one request
past a split-KV partition) captures no CUDA graph and compiles no Triton kernel variant; on the
built-in model with its shipped EAGLE head and on a tiny model with a trained head. Negative
control: the same load on an engine never warmed up captures graphs (every one of a key the
warm-up captured). (Compiles have no such control: Triton keeps a kernel's variants for the
process, so a second engine compiles none; `test_triton_compiles.py` checks the counter.)
`specdec generate` on CUDA warms up once, before its first token, and says so in one line."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from e2e.server_fixtures import make_tiny_model_dir
from eagle_fixtures import trained_head
from models_fixtures import make_hf_model, prompt_tokens, save_hf_model
from specdec.drafters.default import default_speculative_config
from specdec.engine.config import EngineConfig, SpeculativeConfig
from specdec.engine.llm_engine import LLMEngine
from specdec.models.attention_tiles import SPLIT_KV_PARTITION
from warm_up_fixtures import graph_caches, graph_keys, run_load

pytestmark = pytest.mark.gpu

MAX_NUM_SEQS = 16  # buckets 1, 2, 4, 8, 16


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    model_dir = save_hf_model(make_hf_model("llama"), tmp_path_factory.mktemp("tiny-warm-gpu"))
    head_dir = trained_head(model_dir, tmp_path_factory.mktemp("eagle-warm-gpu"))
    spec = {"method": "eagle", "model": str(head_dir), "num_speculative_tokens": 3}
    return str(model_dir), spec, 97, 256


def engine_for(target: str, tiny) -> tuple[LLMEngine, int, int]:
    """(engine, vocabulary size, max_model_len) of `target`, built as `specdec serve` builds it
    (default settings on CUDA, max_num_seqs = MAX_NUM_SEQS)."""
    if target == "builtin":
        spec = default_speculative_config(None, "cuda")
        if spec is None:
            pytest.skip("the built-in model or its shipped head is not installed")
        model, max_model_len = None, 4096
    else:
        model, spec, _, max_model_len = tiny
    config = EngineConfig(model=model, max_num_seqs=MAX_NUM_SEQS, max_model_len=max_model_len)
    engine = LLMEngine(config, SpeculativeConfig.from_dict(spec))
    return engine, engine.model_config.vocab_size, max_model_len


def captured(engine: LLMEngine) -> dict[str, int]:
    return {name: len(cache.graphs) for name, cache in graph_caches(engine).items()}


def walk(engine: LLMEngine, vocab_size: int, max_model_len: int) -> None:
    long = []  # a context past one split-KV partition, where max_model_len holds one
    if max_model_len > SPLIT_KV_PARTITION + 200:
        long = prompt_tokens(vocab_size, [SPLIT_KV_PARTITION + 50], seed=9)
    run_load(engine, True, vocab_size=vocab_size, extra=long, penalty_every=3)
    run_load(engine, False, seed=1, vocab_size=vocab_size)


@pytest.mark.parametrize("target", ["builtin", "tiny"])
def test_no_graph_is_captured_after_warm_up(target, tiny):
    engine, vocab_size, max_model_len = engine_for(target, tiny)
    report = engine.warm_up(progress=False)
    assert report.skipped is None and report.num_graphs > 0, report.line()
    assert engine.allocator.num_free_blocks == engine.allocator.num_blocks
    before, warmed = captured(engine), graph_keys(engine)
    walk(engine, vocab_size, max_model_len)
    assert engine.loop_stats.num_graph_rounds > 0  # rounds replayed from graphs
    assert captured(engine) == before, sorted(map(str, graph_keys(engine) - warmed))
    assert engine.graphs_after_warm_up == 0  # what /metrics reports
    assert engine.triton_compiles_after_warm_up == {}  # counted (Triton 3.5+ has the hook)
    del engine
    # Negative control: never warmed up, the same load captures graphs (of warmed-up keys).
    cold, _, _ = engine_for(target, tiny)
    walk(cold, vocab_size, max_model_len)
    assert sum(captured(cold).values()) > 0
    assert cold.graphs_after_warm_up > 0
    assert graph_keys(cold) <= warmed


def test_a_grammar_compiles_nothing_after_warm_up(tiny):
    """The built-in model as `specdec serve` builds it: after the warm-up, requests with a JSON
    schema (plain and speculative) compile no Triton kernel variant: the grammar bitmask
    kernel's variant for the vocabulary is compiled by the warm-up (s31 found it compiled under
    traffic). (Vacuous if an earlier test of this process compiled that variant: Triton keeps
    it for the process; run this file alone to make it count.)"""
    from specdec.sampling import SamplingParams
    from specdec.sampling.structured import StructuredOutputsParams

    engine, vocab_size, _ = engine_for("builtin", tiny)
    engine.warm_up(progress=False)
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    for i, speculative in enumerate((None, {"enabled": False})):
        params = SamplingParams(
            max_tokens=16, seed=i, structured_outputs=StructuredOutputsParams(json=schema)
        )
        prompt = prompt_tokens(vocab_size, [12], seed=i)[0]
        engine.add_request(prompt, params, request_id=f"g{i}", speculative=speculative)
    while engine.has_unfinished:
        engine.step()
    assert engine.triton_compiles_after_warm_up == {}


def test_a_plain_engine_compiles_nothing_after_warm_up(tiny):
    """An engine without speculation (`specdec serve --no-spec`): after the warm-up, sampled
    requests (a temperature alone, and with top-k / top-p) compile no Triton kernel variant:
    the sampler's kernels are compiled by the warm-up (s32 found a `--no-spec` server compiling
    them on its first request). (Vacuous if an earlier test of this process compiled those
    variants: Triton keeps them for the process; run this test alone to make it count.)"""
    from specdec.sampling import SamplingParams

    model, _, vocab_size, max_model_len = tiny
    config = EngineConfig(model=model, max_num_seqs=MAX_NUM_SEQS, max_model_len=max_model_len)
    engine = LLMEngine(config, None)
    report = engine.warm_up(progress=False)
    assert report.skipped is None, report.line()
    filters = ({}, {"top_k": 20, "top_p": 0.9})
    for i, extra in enumerate(filters):
        params = SamplingParams(max_tokens=8, temperature=0.8, seed=i, **extra)
        engine.add_request(prompt_tokens(vocab_size, [12], seed=i)[0], params)
    while engine.has_unfinished:
        engine.step()
    assert engine.triton_compiles_after_warm_up == {}


def test_generate_warms_up_once_and_says_so(tmp_path):
    """`specdec generate` on CUDA: one warm-up line naming the graphs captured and the time,
    then the tokens (the default n-gram speculation of a model without a shipped head)."""
    model_dir = make_tiny_model_dir(tmp_path / "tiny")
    command = [sys.executable, "-m", "specdec.cli", "generate", str(model_dir), "abcabc abc"]
    command += ["--device", "cuda", "--max-tokens", "8", "--temperature", "0"]
    # A small share of the card: this test process may still hold the earlier tests' engines
    # (s40, H100: in the whole file, "only 5.3 GiB are free" refused the default 0.9)
    command += ["--gpu-memory-utilization", "0.04"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = re.findall(r"warm-up: captured (\d+) graphs in ([\d.]+) s", done.stderr)
    assert len(lines) == 1, done.stderr[-2000:]
    assert int(lines[0][0]) > 0
    assert done.stdout.strip()
