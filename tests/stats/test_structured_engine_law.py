"""Through the whole engine, on a tiny real model: constrained requests (a regex through the real
llguidance matcher) follow the target's constrained law norm(target x mask) under speculation,
for every drafter and verify method; coupled and greedy speculation emit plain constrained
decoding's tokens.

The target is the 3-layer vocabulary-8 Llama of `law_fixtures` with a byte-level tokenizer whose
tokens are the strings of `TOKENS`; the constraint is `specdec.audit.laws.GRAMMAR_REGEX`, whose
masks are also computed by the audit's hand-written automaton (the independent twin). N seeded
requests emit 3 tokens each; the joint law of those tokens (512 cells, most of them outside the
language) is compared with the exact law from the target's own logits.
"""

from __future__ import annotations

import contextlib
import itertools

import pytest
import torch

from block_drafter_fixtures import save_tiny_block_drafter
from law_fixtures import (
    GRAMMAR_EOS,
    GRAMMAR_TOKEN_TEXTS,
    PROMPT,
    VOCAB,
    save_vocab8_target,
    write_grammar_tokenizer,
)
from specdec.audit import chi_square, grammar_allowed_reference
from specdec.audit.laws import GRAMMAR_REGEX
from specdec.drafters.base import Drafter
from specdec.engine.llm import LLM
from specdec.models import load_model, prompt_logits
from specdec.sampling import SampleOutput, SamplingParams, StructuredOutputsParams, process_logits

pytestmark = pytest.mark.stats

NUM_TOKENS = 3
TEMPERATURE = 0.7
LOG10_ALPHA = -6.0  # reject at p < 1e-6
CONSTRAINT = StructuredOutputsParams(regex=GRAMMAR_REGEX)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = save_vocab8_target(tmp_path_factory.mktemp("vocab8-grammar"))
    write_grammar_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def exact_law(model_dir) -> torch.Tensor:
    """[V ** 3] float64: each continuation's probability under norm(target x mask), processed
    at TEMPERATURE, masks from the hand-written automaton."""
    model = load_model(model_dir).model
    prefixes = [
        list(p) for n in range(NUM_TOKENS) for p in itertools.product(range(VOCAB), repeat=n)
    ]
    logits = prompt_logits(model, [PROMPT + p for p in prefixes])
    probs = {}
    for prefix, row in zip(prefixes, logits, strict=True):
        last = row[-1].to(torch.float32).clone()
        with contextlib.suppress(ValueError):  # outside the language: probability 0 anyway
            last[~grammar_allowed_reference(prefix, GRAMMAR_TOKEN_TEXTS, GRAMMAR_EOS)] = float(
                "-inf"
            )
        processed = process_logits(last[None], torch.tensor([TEMPERATURE]))
        probs[tuple(prefix)] = processed.double().softmax(-1)[0]
    law = torch.zeros(VOCAB**NUM_TOKENS, dtype=torch.float64)
    for cell, seq in enumerate(itertools.product(range(VOCAB), repeat=NUM_TOKENS)):
        p = 1.0
        for i in range(NUM_TOKENS):
            p *= float(probs[seq[:i]][seq[i]])
        law[cell] = p
    return law


@pytest.fixture(scope="module")
def drafter_dirs(model_dir, tmp_path_factory):
    from specdec.train.kind import TrainOptions
    from specdec.train.kinds.eagle import EagleKind

    target = load_model(model_dir).model
    root = tmp_path_factory.mktemp("grammar-drafters")
    kind, options = EagleKind(), TrainOptions(seed=5)
    kind.prepare(target, torch.zeros(VOCAB, dtype=torch.int64), options)
    kind.save(kind.build(target, options), target, root / "eagle", options)
    return {
        "eagle": root / "eagle",
        "dflash": save_tiny_block_drafter(root / "dflash", "dflash", target, block_size=2),
        "dspark": save_tiny_block_drafter(root / "dspark", "dspark", target, block_size=2),
    }


def spec_config(drafter: str, method: str, dirs, sample_method="probabilistic") -> dict:
    spec = {"num_speculative_tokens": 2, "rejection_sample_method": method}
    if drafter == "ngram":
        return spec | {"method": "ngram", "prompt_lookup_max": 2, "prompt_lookup_min": 1}
    if drafter == "draft_model":
        return spec | {
            "method": "draft_model",
            "model": "truncated:1",
            "draft_sample_method": sample_method,
        }
    return spec | {"method": drafter, "model": str(dirs[drafter])}


def constrained_tokens(model_dir, spec, num_trials: int, temperature=TEMPERATURE, **extra):
    """(first NUM_TOKENS tokens of num_trials constrained requests seeded 0.., metrics)."""
    llm = LLM(
        str(model_dir),
        speculative_config=spec,
        max_model_len=32,
        block_size=4,
        max_num_seqs=256,
        max_num_batched_tokens=2048,
        **extra,
    )
    params = [
        SamplingParams(
            temperature=temperature,
            max_tokens=NUM_TOKENS + 2,  # the engine drafts at most (tokens left - 1)
            seed=s,
            structured_outputs=CONSTRAINT,
        )
        for s in range(num_trials)
    ]
    outputs = llm.generate([PROMPT] * num_trials, params, use_tqdm=False)
    tokens = torch.tensor([out.outputs[0].token_ids[:NUM_TOKENS] for out in outputs])
    return tokens, llm.get_metrics()


def counts_of(tokens: torch.Tensor) -> torch.Tensor:
    codes = torch.zeros(tokens.shape[0], dtype=torch.int64)
    for column in tokens.unbind(1):
        codes = codes * VOCAB + column
    return torch.bincount(codes, minlength=VOCAB**NUM_TOKENS)


def log10_p(model_dir, exact_law, spec, num_trials) -> float:
    tokens, metrics = constrained_tokens(model_dir, spec, num_trials)
    if spec is not None:
        assert metrics["num_draft_tokens"] > 0
    return chi_square(counts_of(tokens), exact_law).log10_p


# Not slow: draft-model drafts under every verify method (N = 2,000, a few seconds each).
@pytest.mark.parametrize("method", ["standard", "block", "coupled"])
def test_constrained_draft_model_follows_the_constrained_law(model_dir, exact_law, method):
    """H0: the first 3 tokens of constrained requests (draft model = the target's first layer,
    sampled drafts, K = 2) follow norm(target x mask) at every position. Statistic: Pearson
    chi-square over the 512 cells (bins expecting < 5 pooled; a token outside the language
    rejects outright), N = 2,000 seeded requests, temperature 0.7; reject at p < 1e-6
    (false-failure rate <= 1e-6 per case)."""
    spec = spec_config("draft_model", method, None)
    assert log10_p(model_dir, exact_law, spec, 2_000) > LOG10_ALPHA


@pytest.mark.slow
@pytest.mark.parametrize("method", ["standard", "block", "coupled"])
@pytest.mark.parametrize("drafter", ["ngram", "eagle", "dflash", "dspark", "draft_model/greedy"])
def test_every_drafter_follows_the_constrained_law(
    model_dir, exact_law, drafter_dirs, drafter, method
):
    """The same H0, statistic and threshold (false-failure rate <= 1e-6 per case, 15 cases) for
    the other drafters: prompt lookup (one-hot drafts, unmasked: a draft outside the grammar is
    rejected exactly), an EAGLE head, DFlash and DSpark block drafters, and greedy draft-model
    drafts; N = 4,000."""
    if drafter == "draft_model/greedy":
        spec = spec_config("draft_model", method, drafter_dirs, "greedy")
    else:
        spec = spec_config(drafter, method, drafter_dirs)
    assert log10_p(model_dir, exact_law, spec, 4_000) > LOG10_ALPHA


def test_plain_constrained_decoding_follows_the_constrained_law(model_dir, exact_law):
    """The law itself, without speculation (same statistic, N = 2,000, p < 1e-6)."""
    assert log10_p(model_dir, exact_law, None, 2_000) > LOG10_ALPHA


def test_negative_control_drafts_from_unmasked_logits(model_dir, exact_law, monkeypatch):
    """The test has power: an engine whose drafter samples from unmasked draft logits but hands
    the verifier the masked distribution (what it would have sampled from) must be rejected
    (p < 1e-6; same setup as the standard case, N = 2,000)."""
    real = Drafter.sample_draft

    def unmasked(self, logits, rows, positions, batch, prefix=None):
        masked = real(self, logits, rows, positions, batch, prefix=prefix)
        drawn = real(self, logits, rows, positions, _without_context(batch), prefix=None)
        return SampleOutput(drawn.token_ids, masked.processed_logits, masked.logsumexp)

    monkeypatch.setattr(Drafter, "sample_draft", unmasked)
    spec = spec_config("draft_model", "standard", None)
    assert log10_p(model_dir, exact_law, spec, 2_000) < LOG10_ALPHA


def _without_context(batch):
    import dataclasses

    return dataclasses.replace(batch, context=None)


@pytest.mark.parametrize(
    "method, temperature", [("coupled", 0.7), ("standard", 0.0), ("block", 0.0)]
)
def test_coupled_and_greedy_constrained_speculation_equal_plain(model_dir, method, temperature):
    """Coupled verification at temperature 0.7, and greedy decoding with any verifier, emit
    exactly the tokens of plain constrained decoding with the same seeds (200 requests,
    5 tokens each). Deterministic."""
    spec = spec_config("draft_model", method, None)
    plain, _ = constrained_tokens(model_dir, None, 200, temperature)
    spec_tokens, metrics = constrained_tokens(model_dir, spec, 200, temperature)
    assert metrics["num_draft_tokens"] > 0
    assert torch.equal(plain, spec_tokens)
