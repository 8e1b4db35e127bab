"""Statistical conformance of tree verification (`verify_tree`) over whole requests.

Requests run round by round on the audit's V = 5 bigram toy (near drafter): each round drafts a
tree through the real `Drafter.sample_draft` (tree keys, siblings without replacement unless
stated) and verifies it with `verify_tree`; the first 4 emitted tokens of each request (two
rounds or more) are compared with the target's exact processed law over the 625 sequences.
Draws are keyed, so each test is deterministic: its false-failure rate is the probability that a
fresh seed would fail it. Each check has negative controls that must fail with a wide margin.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from specdec.audit.laws import (
    PROCESSINGS,
    Processing,
    joint_probs,
    markov_toy,
    processed_probs,
    sequence_codes,
)
from specdec.audit.statistics import chi_square
from specdec.drafters import base as drafter_base
from specdec.verify import tree as tree_module
from tree_fixtures import DEEP_TREE, WIDE_TREE, run_tree_requests

pytestmark = pytest.mark.stats

VOCAB = 5
LENGTH = 4
NUM_REQUESTS = 40_000
THRESHOLD = 1e-6  # fail iff p < 1e-6: the false-failure rate of each test
CONTROL_LOG10_P = -18.0  # a negative control must reach p < 1e-18
CASES = [p for p in PROCESSINGS if p.name in ("plain", "t0.7+top_k", "t0.7+top_p")]


def joint_law_p(tokens: torch.Tensor, toy, processing: Processing):
    law = joint_probs(processed_probs(toy.target_logits, processing), toy.start_token, LENGTH)
    codes = sequence_codes(tokens, VOCAB)
    counts = torch.bincount(codes, minlength=VOCAB**LENGTH)
    return chi_square(counts, law)


@pytest.mark.parametrize("processing", CASES, ids=lambda p: p.name)
@pytest.mark.parametrize("shape", [WIDE_TREE, DEEP_TREE], ids=["wide", "deep"])
@pytest.mark.parametrize("method", ["standard", "coupled"])
def test_tree_joint_law(method, shape, processing):
    """H0: the first 4 tokens of requests verified tree by tree follow the target's processed
    law (625 sequences). N = 40,000 requests with distinct seeds; statistic: Pearson
    chi-square, bins expecting < 5 pooled; fail iff p < 1e-6 (false-failure rate 1e-6).
    """
    toy = markov_toy(VOCAB, key=3)
    tokens, accepted, _ = run_tree_requests(
        toy, processing, shape, method, NUM_REQUESTS, LENGTH, seed=1
    )
    result = joint_law_p(tokens, toy, processing)
    assert result.log10_p > -6, result.describe()
    assert float(accepted.float().mean()) > 0.5  # the trees are accepted often enough to matter


@pytest.mark.parametrize("processing", CASES[:2], ids=lambda p: p.name)
def test_tree_joint_law_children_with_replacement(processing):
    """Same H0, statistic and threshold (false-failure rate 1e-6), standard method, the wide
    tree whose children are drawn independently (each its own key, duplicates allowed)."""
    toy = markov_toy(VOCAB, key=3)
    tokens, _, _ = run_tree_requests(
        toy,
        processing,
        WIDE_TREE,
        "standard",
        NUM_REQUESTS,
        LENGTH,
        seed=2,
        with_replacement=True,
    )
    result = joint_law_p(tokens, toy, processing)
    assert result.log10_p > -6, result.describe()


@contextlib.contextmanager
def shared_child_key():
    """Negative control: every tree node drafts with one key (node 0's)."""
    real = drafter_base.tree_draft_stream
    drafter_base.tree_draft_stream = lambda nodes: real(torch.zeros_like(nodes))
    try:
        yield
    finally:
        drafter_base.tree_draft_stream = real


@contextlib.contextmanager
def residual_not_updated():
    """Negative control: the residual stays the target after a rejected child."""
    real = tree_module.residual_log_weights
    tree_module.residual_log_weights = lambda residual, draft, log_weight: residual.clone()
    try:
        yield
    finally:
        tree_module.residual_log_weights = real


def test_tree_law_rejects_children_with_one_shared_key():
    """Negative control of the joint-law check (same setup, N = 40,000, plain processing, the
    wide tree, children drawn independently): with one key for every child the siblings are
    copies of each other, not independent draws. Must give p < 1e-18."""
    toy = markov_toy(VOCAB, key=3)
    with shared_child_key():
        tokens, _, _ = run_tree_requests(
            toy,
            CASES[0],
            WIDE_TREE,
            "standard",
            NUM_REQUESTS,
            LENGTH,
            seed=2,
            with_replacement=True,
        )
    result = joint_law_p(tokens, toy, CASES[0])
    assert result.log10_p < CONTROL_LOG10_P, result.describe()


@pytest.mark.parametrize("replacement", [False, True], ids=["distinct", "independent"])
def test_tree_law_rejects_residual_not_updated(replacement):
    """Negative control (same setup, N = 40,000, plain processing, the wide tree): a verifier
    that tests every child, and draws the recovered token, against the target instead of the
    residual left by the rejected children. Must give p < 1e-18."""
    toy = markov_toy(VOCAB, key=3)
    with residual_not_updated():
        tokens, _, _ = run_tree_requests(
            toy,
            CASES[0],
            WIDE_TREE,
            "standard",
            NUM_REQUESTS,
            LENGTH,
            seed=2,
            with_replacement=replacement,
        )
    result = joint_law_p(tokens, toy, CASES[0])
    assert result.log10_p < CONTROL_LOG10_P, result.describe()
