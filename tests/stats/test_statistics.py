"""The statistics under the conformance checks: p-values, pooling, calibration, exact laws.

A conformance check is only as good as its p-values and its "exact" probabilities, so these are
checked against scipy, against brute-force integration, and for calibration under H0.
"""

from __future__ import annotations

import math

import pytest
import torch
from scipy import integrate, stats

from specdec import audit as c

pytestmark = pytest.mark.stats


@pytest.mark.parametrize("df", [1, 4, 15, 63, 307, 545])
def test_chi2_p_values_match_scipy(df):
    """Deterministic: our chi-square tail (torch.special, no scipy at run time) matches scipy."""
    for statistic in (0.3 * df, df, df + 5 * math.sqrt(2 * df), df + 40 * math.sqrt(2 * df)):
        expected = stats.chi2.logsf(statistic, df) / math.log(10)
        assert c.chi2_log10_sf(statistic, df) == pytest.approx(expected, rel=1e-6, abs=1e-6)


def test_chi2_underflow_falls_back_to_a_finite_log():
    """Beyond p = 1e-300 the Wilson-Hilferty tail keeps negative controls' statistics finite."""
    value = c.chi2_log10_sf(20_000.0, 300)
    assert math.isfinite(value) and value < -300


@pytest.mark.parametrize("expected", [0.5, 4.1, 9.7, 80.0])
def test_poisson_p_values_match_scipy(expected):
    """Deterministic: the two-sided exact Poisson p-value matches scipy's tails."""
    for observed in range(0, int(3 * expected) + 12):
        lower, upper = (
            stats.poisson.cdf(observed, expected),
            stats.poisson.sf(observed - 1, expected),
        )
        reference = math.log10(min(1.0, 2 * min(lower, upper)))
        assert c.poisson_log10_p(observed, expected) == pytest.approx(reference, abs=1e-6)


def test_chi_square_pools_small_bins_and_rejects_impossible_cells():
    """Deterministic: bins expecting < 5 are pooled (or merged), zero-probability hits reject."""
    probs = torch.tensor([0.5, 0.3, 0.19, 0.005, 0.005, 0.0], dtype=torch.float64)
    exact = torch.tensor([500, 300, 190, 5, 5, 0])
    result = c.chi_square(exact, probs)
    assert result.statistic == pytest.approx(0.0, abs=1e-12)
    assert result.df == 4  # 5 positive bins, each expecting >= 5: nothing pooled
    pooled = c.chi_square(exact // 10, probs)  # 0.5 + 0.5 expected: pooled, then merged
    assert pooled.df == 2
    assert c.chi_square(torch.tensor([500, 300, 190, 5, 4, 1]), probs).log10_p == -math.inf


def test_chi_square_is_calibrated_under_h0():
    """Under H0 (multinomial counts from the exact law, 20% of the bins expecting < 5), the
    p-values are uniform: a KS test of 2,000 of them must not reject at 1e-6."""
    generator = torch.Generator().manual_seed(0)
    probs = torch.distributions.Dirichlet(torch.full((60,), 0.4)).sample()  # test-side RNG
    probs = (probs / probs.sum()).double()
    p_values = []
    for _ in range(2000):
        draws = torch.multinomial(probs, 1500, replacement=True, generator=generator)
        result = c.chi_square(torch.bincount(draws, minlength=60), probs)
        p_values.append(10**result.log10_p)
    assert stats.kstest(p_values, "uniform").pvalue > 1e-6


def test_coupled_match_probability_by_integration():
    """P(both Gumbel-max argmaxes = x) = 1 / sum_v max(t_v / t_x, d_v / d_x), checked against
    the integral over the shared noise of lane x of the joint event."""
    target = torch.tensor([0.5, 0.3, 0.15, 0.05], dtype=torch.float64)
    draft = torch.tensor([0.1, 0.2, 0.3, 0.4], dtype=torch.float64)
    formula = c.coupled_match_probs(target, draft)
    for x in range(4):
        gaps = [
            min(math.log(target[x] / target[v]), math.log(draft[x] / draft[v]))
            for v in range(4)
            if v != x
        ]

        def density(t, gaps=gaps):
            # lane x's Gumbel at t, every other lane below t + gap
            return math.exp(-t - math.exp(-t)) * math.prod(
                math.exp(-math.exp(-(t + g))) for g in gaps
            )

        value, _ = integrate.quad(density, -20, 40, limit=200)
        assert float(formula[x]) == pytest.approx(value, rel=1e-7)
    assert float(c.coupled_match_probs(target, target).sum()) == pytest.approx(1.0)
    one_hot = torch.tensor([0.0, 1.0, 0.0, 0.0], dtype=torch.float64)
    assert torch.allclose(c.coupled_match_probs(target, one_hot), target * one_hot)


def test_acceptance_laws_are_laws_and_block_dominates():
    """Deterministic: every exact acceptance law sums to 1; block's mean >= standard's (Sun et
    al.); with one-hot drafts coupled accepts exactly like standard."""
    toy = c.matrix_toy()
    for processing in c.PROCESSINGS:
        for drafts in c.DRAFT_KINDS:
            means = {}
            for method in c.METHODS:
                law = c.acceptance_law(toy, processing, method=method, drafts=drafts, num_draft=3)
                assert float(law.sum()) == pytest.approx(1.0, abs=1e-12)
                assert bool((law >= -1e-15).all())
                means[method] = float((law * torch.arange(4)).sum())
            assert means["block"] >= means["standard"] - 1e-12
            if drafts == "one_hot":  # deterministic drafts: coupled accepts like standard
                assert means["coupled"] == pytest.approx(means["standard"], abs=1e-12)


def test_standard_acceptance_is_the_overlap_for_context_free_laws():
    """For context-free tables, P(accept first draft) = sum_x min(target(x), draft(x))."""
    toy = c.markov_toy(6, 1, context_free=True)
    target = c.processed_probs(toy.target_logits[:1], c.PROCESSINGS[0])[0]
    draft = c.processed_probs(toy.draft_logits[:1], c.PROCESSINGS[0])[0]
    overlap = float(torch.minimum(target, draft).sum())
    law = c.acceptance_law(toy, c.PROCESSINGS[0], method="standard", drafts="sampled", num_draft=2)
    assert float(law[1:].sum()) == pytest.approx(overlap, rel=1e-12)
    assert float(law[2]) == pytest.approx(overlap**2, rel=1e-12)


def test_filters_are_not_vacuous_on_the_matrix_toy():
    """Each filtered processing of the matrix changes the support of some rows."""
    toy = c.matrix_toy()
    for processing in c.PROCESSINGS[1:]:
        kept = (c.processed_probs(toy.target_logits, processing) > 0).sum(-1)
        assert int(kept.min()) < c.MATRIX_VOCAB, processing.name
