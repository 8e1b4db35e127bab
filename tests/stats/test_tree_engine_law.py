"""Through the whole engine, on a tiny real model: tree rounds (EAGLE head, or a draft model;
synchronous path) emit tokens whose joint law is plain sampling's exactly.

The vocabulary-8 Llama of `law_fixtures` is the target and an untrained (keyed-init) EAGLE head
over its last layer drafts trees of 6 nodes (depth 3, top-2). N seeded requests run to 6 tokens
(two rounds or more); the joint law of their first 3 tokens (512 cells) is compared with the
exact law computed from the target's logits; with logits rules (penalties, a bias, allowed
tokens, min_tokens, a stop token) on every request, with plain penalised sampling's law (the
audit's independent float64 twin of the rules).
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from law_fixtures import (
    RULES,
    VOCAB,
    exact_continuation_law,
    first_token_counts,
    rules_law,
    save_vocab8_target,
)
from specdec.audit.statistics import chi_square
from specdec.models import load_model
from specdec.verify import tree as tree_module

pytestmark = pytest.mark.stats

NUM_TOKENS = 3
NUM_TRIALS = 12_000
TREE = {"nodes": 6, "depth": 3, "topk": 2}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_vocab8_target(tmp_path_factory.mktemp("vocab8"))


@pytest.fixture(scope="module")
def eagle_dir(model_dir, tmp_path_factory):
    """An untrained EAGLE head (keyed init): its drafts differ from the target's, so tree rounds
    both accept and reject."""
    from specdec.train.kind import TrainOptions
    from specdec.train.kinds.eagle import EagleKind

    target = load_model(model_dir).model
    kind, options = EagleKind(), TrainOptions(seed=5)
    kind.prepare(target, torch.zeros(VOCAB, dtype=torch.int64), options)
    out = tmp_path_factory.mktemp("eagle-vocab8")
    kind.save(kind.build(target, options), target, out, options)
    return out


def tree_counts(model_dir, eagle_dir, method, temperature, **sampling):
    spec = {"method": "eagle", "model": str(eagle_dir), "rejection_sample_method": method}
    counts, metrics = first_token_counts(
        model_dir,
        {**spec, "tree": TREE, "adaptive": False},
        temperature,
        6,
        NUM_TOKENS,
        NUM_TRIALS,
        **sampling,
    )
    assert metrics["num_accepted_tokens"] > 0
    return counts


@pytest.mark.slow
@pytest.mark.parametrize("method", ["standard", "coupled"])
@pytest.mark.parametrize("sampling", [{}, {"top_k": 4}], ids=["t0.7", "t0.7+top_k"])
def test_tree_rounds_follow_the_target(model_dir, eagle_dir, method, sampling):
    """H0: the engine's first 3 emitted tokens with tree rounds have the target's exact joint
    law. Statistic: Pearson chi-square over the 512 cells (bins expecting < 5 pooled),
    N = 12,000 seeded requests, temperature 0.7; fail iff p < 1e-6 (false-failure rate <= 1e-6
    per case, 4 cases)."""
    law = processed_law(model_dir, 0.7, sampling.get("top_k", 0))
    counts = tree_counts(model_dir, eagle_dir, method, 0.7, **sampling)
    result = chi_square(counts.to(torch.int64), law)
    assert result.log10_p > -6, result.describe()


@pytest.mark.slow
@pytest.mark.parametrize("method", ["standard", "coupled"])
def test_draft_model_tree_rounds_follow_the_target(model_dir, method):
    """H0: as above, with draft-model trees (the target's first layer as the draft model:
    `truncated:1`, whose drafts both match and miss). Pearson chi-square over the 512 cells,
    N = 12,000, temperature 0.7; fail iff p < 1e-6 (false-failure rate <= 1e-6 per case, 2
    cases)."""
    law = processed_law(model_dir, 0.7, 0)
    result = chi_square(draft_model_counts(model_dir, method, 0.7).to(torch.int64), law)
    assert result.log10_p > -6, result.describe()


@pytest.mark.slow
def test_draft_model_negative_control_residual_not_updated(model_dir):
    """The draft-model case has power too: the residual not updated after a rejected child
    must give p < 1e-6 (temperature 1.0, N = 12,000)."""
    law = exact_continuation_law(model_dir, 1.0, NUM_TOKENS)
    with residual_not_updated():
        counts = draft_model_counts(model_dir, "standard", 1.0)
    result = chi_square(counts.to(torch.int64), law)
    assert result.log10_p < -6, result.describe()


def draft_model_counts(model_dir, method, temperature):
    spec = {"method": "draft_model", "model": "truncated:1", "rejection_sample_method": method}
    counts, metrics = first_token_counts(
        model_dir, {**spec, "tree": TREE, "adaptive": False}, temperature, 6, NUM_TOKENS, NUM_TRIALS
    )
    assert metrics["num_accepted_tokens"] > 0
    return counts


@pytest.mark.slow
def test_negative_control_residual_not_updated(model_dir, eagle_dir):
    """The same test has power: an engine whose tree verifier tests every child, and draws the
    recovered token, against the target rather than the residual of the rejected siblings must
    give p < 1e-6 (temperature 1.0, N = 12,000)."""
    law = exact_continuation_law(model_dir, 1.0, NUM_TOKENS)
    with residual_not_updated():
        counts = tree_counts(model_dir, eagle_dir, "standard", 1.0)
    result = chi_square(counts.to(torch.int64), law)
    assert result.log10_p < -6, result.describe()


@pytest.mark.slow
@pytest.mark.parametrize("method", ["standard", "coupled"])
def test_penalised_tree_rounds_follow_plain_penalised_sampling(model_dir, eagle_dir, method):
    """H0: with `RULES` on every request, tree rounds (each node's row processed after its
    path, the drafts drawn under the rules after their parent's path) emit first 3 tokens with
    plain penalised sampling's exact joint law. Pearson chi-square over the 512 cells (bins
    expecting < 5 pooled), N = 12,000, temperature 0.7, requests of 6 tokens; fail iff
    p < 1e-6 (false-failure rate <= 1e-6 per case, 2 cases; with the slow tests, as the other
    tree law tests: the default run checks trees under rules token for token against plain
    decoding, `tests/unit/engine/test_tree_engine.py -k rules`)."""
    law = rules_law(model_dir, 0.7, NUM_TOKENS)
    counts = tree_counts(model_dir, eagle_dir, method, 0.7, **RULES)
    result = chi_square(counts.to(torch.int64), law)
    assert result.log10_p > -6, result.describe()


@pytest.mark.slow
def test_negative_control_penalised_tree_rows_blind_to_their_paths(
    model_dir, eagle_dir, monkeypatch
):
    """The penalised tree test has power: a walk whose node rows are processed with the
    request's output alone (the node's path left out of its penalties and min_tokens) must give
    p < 1e-6 (same setup)."""
    from specdec.engine import emitter
    from specdec.verify.tree_inputs import tree_context_target_logits

    def blind(target, draft_token_ids, parents, context):
        return tree_context_target_logits(target, [[]] * len(parents), [[]] * len(parents), context)

    monkeypatch.setattr(emitter, "tree_context_target_logits", blind)
    law = rules_law(model_dir, 0.7, NUM_TOKENS)
    counts = tree_counts(model_dir, eagle_dir, "standard", 0.7, **RULES)
    result = chi_square(counts.to(torch.int64), law)
    assert result.log10_p < -6, result.describe()


@contextlib.contextmanager
def residual_not_updated():
    real = tree_module.residual_log_weights
    tree_module.residual_log_weights = lambda residual, draft, log_weight: residual.clone()
    try:
        yield
    finally:
        tree_module.residual_log_weights = real


def processed_law(model_dir, temperature: float, top_k: int) -> torch.Tensor:
    """[V ** 3] float64 exact law of the first 3 tokens under temperature and top-k (0: off),
    processed by `process_logits` itself from the target's float64 logits."""
    import itertools

    from law_fixtures import PROMPT
    from specdec.models import prompt_logits
    from specdec.sampling import process_logits

    model = load_model(model_dir).model
    prefixes = [
        list(p) for n in range(NUM_TOKENS) for p in itertools.product(range(VOCAB), repeat=n)
    ]
    logits = prompt_logits(model, [PROMPT + p for p in prefixes])
    probs = {}
    for prefix, row in zip(prefixes, logits, strict=True):
        processed = process_logits(
            row[-1:].double(), torch.tensor([temperature]), torch.tensor([top_k])
        )
        probs[tuple(prefix)] = processed.softmax(-1)[0]
    law = torch.zeros(VOCAB**NUM_TOKENS, dtype=torch.float64)
    for cell, seq in enumerate(itertools.product(range(VOCAB), repeat=NUM_TOKENS)):
        p = 1.0
        for i in range(NUM_TOKENS):
            p *= float(probs[seq[:i]][seq[i]])
        law[cell] = p
    return law
