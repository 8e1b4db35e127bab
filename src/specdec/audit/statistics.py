"""Statistics of the checks: chi-square goodness of fit, exact p-values, the z of a mean.

Deterministic functions of counts and probabilities; they never draw, run or patch anything.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

MIN_EXPECTED = 5.0  # chi-square bins expecting fewer counts are pooled


@dataclass(frozen=True, slots=True)
class ChiSquare:
    """A chi-square goodness-of-fit result (log10_p = -inf when a zero-probability cell is hit)."""

    statistic: float
    df: int
    log10_p: float
    num_samples: int
    impossible: int  # observations in cells of probability 0

    def describe(self) -> str:
        text = f"chi2 {self.statistic:.1f}, df {self.df}, n {self.num_samples}"
        return text + (f", {self.impossible} in zero-probability cells" if self.impossible else "")


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> ChiSquare:
    """Pearson chi-square of `counts` against `probs`, pooling bins expecting < 5 counts.

    Bins expecting fewer than MIN_EXPECTED counts are pooled into one bin, which joins the
    smallest other bin if it still expects fewer. Any count in a cell of probability 0 rejects
    outright (log10_p = -inf). p = chi2.sf(statistic, bins - 1).

    Args:
        counts: [C] int64 observed counts.
        probs: [C] float64 exact probabilities (summing to 1).
    """
    counts = counts.to(torch.float64)
    num_samples = int(counts.sum())
    support = probs > 0
    impossible = int(counts[~support].sum())
    observed, expected = counts[support], probs[support] / probs[support].sum() * num_samples
    small = expected < MIN_EXPECTED
    if bool(small.any()):
        pooled_observed, pooled_expected = observed[small].sum(), expected[small].sum()
        observed, expected = observed[~small], expected[~small]
        if pooled_expected >= MIN_EXPECTED or observed.numel() == 0:
            observed = torch.cat([observed, pooled_observed[None]])
            expected = torch.cat([expected, pooled_expected[None]])
        else:
            smallest = int(expected.argmin())
            observed[smallest] += pooled_observed
            expected[smallest] += pooled_expected
    df = observed.numel() - 1
    statistic = float(((observed - expected) ** 2 / expected).sum()) if num_samples else 0.0
    if impossible:
        log10_p = -math.inf
    elif df <= 0 or num_samples == 0:
        log10_p = 0.0
    else:
        log10_p = chi2_log10_sf(statistic, df)
    return ChiSquare(statistic, df, log10_p, num_samples, impossible)


def chi2_log10_sf(statistic: float, df: int) -> float:
    """log10 P(chi2 with df degrees of freedom >= statistic).

    The regularised upper incomplete gamma Q(df / 2, statistic / 2) in float64 (within 2e-5
    relative of scipy.stats.chi2.sf; tests/stats checks it). Below 1e-300, where it underflows,
    the log of the Wilson-Hilferty normal tail (only negative controls get there).
    """
    p = float(_gammaincc(df / 2, statistic / 2))
    if p > 1e-300:
        return math.log10(p)
    spread = 2 / (9 * df)
    z = ((statistic / df) ** (1 / 3) - (1 - spread)) / math.sqrt(spread)
    return (-z * z / 2 - math.log(z * math.sqrt(2 * math.pi))) / math.log(10)


def poisson_log10_p(observed: int, expected: float) -> float:
    """log10 of the two-sided exact Poisson p-value 2 min(P(X <= obs), P(X >= obs)), capped at 1."""
    at_most = _gammaincc(observed + 1, expected)  # P(X <= observed)
    at_least = _gammainc(observed, expected) if observed > 0 else 1.0  # P(X >= observed)
    p = min(1.0, 2 * min(at_most, at_least))
    return math.log10(p) if p > 0 else -math.inf


def _gammaincc(a: float, x: float) -> float:
    return float(torch.special.gammaincc(torch.tensor(a).double(), torch.tensor(x).double()))


def _gammainc(a: float, x: float) -> float:
    return float(torch.special.gammainc(torch.tensor(a).double(), torch.tensor(x).double()))


def _mean_z(values: torch.Tensor, law: torch.Tensor) -> tuple[float, float, float]:
    """(sample mean, exact mean, z) for i.i.d. values in 0..len(law)-1 with exact law `law`."""
    support = torch.arange(law.shape[0], dtype=torch.float64)
    mean = float((law * support).sum())
    variance = float((law * support**2).sum()) - mean**2
    observed = float(values.to(torch.float64).mean())
    return observed, mean, (observed - mean) / math.sqrt(max(variance, 1e-300) / values.numel())
