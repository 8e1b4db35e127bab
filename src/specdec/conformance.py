"""Statistical conformance of sampling and verification: the checks behind `specdec audit`.

Toy Markov models drive the real `sample` and `verify` over many seeded requests; each check
compares what they emit with exact probabilities computed from the toy's tables. A check that must
pass fails by chance with probability at most ALPHA = 1e-6; negative controls (deliberately broken
variants) show that the same checks have power. Nothing here creates randomness: toy tables come
from `specdec.rng.uniform` under fixed keys, and every draw goes through `specdec.rng`.
"""

from __future__ import annotations

import contextlib
import math
import time
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

import specdec.sampling.sampler as sampler_module
import specdec.verify.verifier as verify_reference
from specdec.rng import Stream, gumbel, random_words, uniform, uniform_to_gumbel, words_to_uniform32
from specdec.sampling import process_logits, sample
from specdec.verify import VerifyResult, verify

ALPHA = 1e-6  # false-failure probability of every check that must pass
LOG10_ALPHA = -math.log10(ALPHA)  # threshold on -log10 p
Z_MAX = 5.3  # |z| threshold: two-sided normal tail 1.2e-7
MIN_EXPECTED = 5.0  # chi-square bins expecting fewer counts are pooled
METHODS = ("standard", "block", "coupled")
DRAFT_KINDS = ("sampled", "one_hot")
CONTROLS = ("shared_noise", "residual_from_target", "position_keyed")


@dataclass(frozen=True, slots=True)
class CheckResult:
    """The outcome of one check; it passes iff `statistic <= threshold`.

    Attributes:
        name: what was checked, e.g. "joint/standard/sampled/plain".
        statistic: -log10 p for chi-square and exact tests (threshold 6: p = 1e-6); |z| or a
            one-sided z for z-tests (5.3); mismatches for identity checks (0); a relative error
            for exact computations. `detail` starts with which one it is.
        threshold: the largest passing statistic.
        passed: statistic <= threshold.
        expected_to_pass: False for negative controls, which must be rejected.
        detail: the numbers behind the statistic (counts, degrees of freedom, sample size).
    """

    name: str
    statistic: float
    threshold: float
    passed: bool
    expected_to_pass: bool
    detail: str

    @property
    def ok(self) -> bool:
        """True when the verdict is the expected one (a pass, or a rejected negative control)."""
        return self.passed == self.expected_to_pass


def _result(
    name: str, statistic: float, threshold: float, detail: str, *, control: str | None = None
) -> CheckResult:
    passed = bool(statistic <= threshold)
    if control is not None:
        name = f"{name}/{control}"
    return CheckResult(name, float(statistic), float(threshold), passed, control is None, detail)


# ---------------------------------------------------------------------------------------------
# Toy models and exact laws
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class MarkovToy:
    """Bigram target and draft models: row a of a table holds the logits of the token after a.

    Attributes:
        target_logits: [V, V] float32 raw target logits.
        draft_logits: [V, V] float32 raw draft logits (same vocabulary).
        start_token: the last prompt token of every request.
    """

    target_logits: torch.Tensor
    draft_logits: torch.Tensor
    start_token: int = 0

    @property
    def vocab_size(self) -> int:
        return self.target_logits.shape[-1]


def toy_logits(
    vocab_size: int, key: int, *, step: int, spread: float = 1.0, context_free: bool = False
) -> torch.Tensor:
    """[V, V] float32 logits: `spread` times keyed Gumbel noise, one row per previous token.

    The values come from `specdec.rng.uniform` (stream TARGET, seed `key`, position = row,
    `step`), so a table is a fixed function of its key. Context-free tables repeat row 0.
    """
    num_rows = 1 if context_free else vocab_size
    u = uniform(
        torch.full((num_rows,), key, dtype=torch.int64),
        torch.arange(num_rows),
        Stream.TARGET,
        vocab_size,
        step=step,
        dtype=torch.float64,
    )
    logits = (spread * uniform_to_gumbel(u)).to(torch.float32)
    return logits.expand(vocab_size, vocab_size).contiguous()


def markov_toy(
    vocab_size: int,
    key: int,
    *,
    draft: str = "near",
    context_free: bool = False,
    spread: float = 1.0,
) -> MarkovToy:
    """A toy model built from `key`.

    Args:
        vocab_size: V.
        key: table seed.
        draft: "near" (target plus keyed noise: a decent drafter), "adversarial" (-target: most
            drafts are rejected, so most requests reach the residual) or "independent".
        context_free: every row of both tables is the same (the law does not depend on context).
        spread: scale of the target logits (larger = more peaked).
    """
    target = toy_logits(vocab_size, key, step=0, spread=spread, context_free=context_free)
    if draft == "near":
        noise = toy_logits(vocab_size, key, step=1, spread=0.8, context_free=context_free)
        draft_logits = target + noise
    elif draft == "adversarial":
        draft_logits = -target
    elif draft == "independent":
        draft_logits = toy_logits(vocab_size, key, step=1, context_free=context_free)
    else:
        raise ValueError(f"draft must be 'near', 'adversarial' or 'independent', got {draft!r}")
    return MarkovToy(target, draft_logits)


@dataclass(frozen=True, slots=True)
class Processing:
    """Sampling parameters shared by the target and the drafter (None = filter off)."""

    name: str
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None

    def kwargs(self) -> dict[str, float | int | None]:
        """The keyword arguments of `sample` and `verify`."""
        return {
            "temperature": self.temperature,
            "top_k": self.top_k,
            "top_p": self.top_p,
            "min_p": self.min_p,
        }

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """[R, V] raw logits -> [R, V] float32 processed logits, by `process_logits` itself
        (what `sample` returns as processed_logits and `verify` applies to the target)."""
        num_rows = logits.shape[0]

        def per_row(value: float | int | None) -> torch.Tensor | None:
            return None if value is None else torch.full((num_rows,), value)

        temperature = per_row(float(self.temperature)).float()
        return process_logits(
            logits, temperature, per_row(self.top_k), per_row(self.top_p), per_row(self.min_p)
        )


PROCESSINGS = (
    Processing("plain"),
    Processing("t0.7+top_k", 0.7, top_k=3),
    Processing("t0.7+top_p", 0.7, top_p=0.8),
    Processing("t0.7+min_p", 0.7, min_p=0.1),
)
GREEDY = Processing("greedy", 0.0)


def processed_probs(logits: torch.Tensor, processing: Processing) -> torch.Tensor:
    """[R, V] raw logits -> [R, V] float64 probabilities of what `sample` draws from.

    The processing is `specdec.sampling.process_logits` itself (what `sample` and `verify` run),
    and the softmax of its float32 output is taken in float64: the law Gumbel-max sampling on
    those logits has exactly. Greedy processing gives one-hot rows.
    """
    if processing.temperature == 0:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).to(torch.float64)
    processed = processing.apply(logits)
    return processed.to(torch.float64).softmax(dim=-1)


def draft_probs(toy: MarkovToy, processing: Processing, drafts: str) -> torch.Tensor:
    """[V, V] float64 law of the draft after each token: processed ("sampled") or argmax."""
    return processed_probs(toy.draft_logits, GREEDY if drafts == "one_hot" else processing)


def joint_probs(target_probs: torch.Tensor, start_token: int, length: int) -> torch.Tensor:
    """Exact law of the first `length` tokens after `start_token` under a bigram table.

    Args:
        target_probs: [V, V] float64 transition probabilities.

    Returns:
        [V**length] float64, indexed by the base-V code of (x_1, ..., x_length), x_1 most
        significant (as `sequence_codes` encodes).
    """
    vocab = target_probs.shape[0]
    law = target_probs[start_token]
    for _ in range(length - 1):
        last = torch.arange(law.shape[0]) % vocab
        law = (law[:, None] * target_probs[last]).reshape(-1)
    return law


def sequence_codes(tokens: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[N, L] int64 tokens -> [N] int64 base-V codes (first token most significant)."""
    codes = torch.zeros(tokens.shape[0], dtype=torch.int64)
    for column in tokens.unbind(dim=1):
        codes = codes * vocab_size + column
    return codes


def all_sequences(vocab_size: int, length: int) -> torch.Tensor:
    """[V**length, length] int64: every sequence, in `sequence_codes` order."""
    codes = torch.arange(vocab_size**length)
    powers = vocab_size ** torch.arange(length - 1, -1, -1)
    return codes[:, None] // powers % vocab_size


def standard_accept_ratios(
    target_rows: torch.Tensor, draft_rows: torch.Tensor, chains: torch.Tensor
) -> torch.Tensor:
    """Token-level acceptance probabilities min(1, target(x_i) / draft(x_i)) (Leviathan et al.).

    Args:
        target_rows: [P, >=K, V] float64: row i is the target law of the token at draft i.
        draft_rows: [P, K, V] float64: the draft law draft i was sampled from.
        chains: [P, K] int64 drafts.

    Returns:
        [P, K] float64 (1 where draft(x_i) = 0: such a chain has probability 0 anyway).
    """
    return _likelihood_ratios(target_rows, draft_rows, chains).clamp_max(1.0)


def _likelihood_ratios(target_rows, draft_rows, chains) -> torch.Tensor:
    at_target = target_rows[:, : chains.shape[1]].gather(-1, chains[..., None]).squeeze(-1)
    at_draft = draft_rows.gather(-1, chains[..., None]).squeeze(-1)
    safe = torch.where(at_draft > 0, at_draft, torch.ones_like(at_draft))
    return torch.where(at_draft > 0, at_target / safe, torch.ones_like(at_draft))


def block_accept_thresholds(
    target_rows: torch.Tensor, draft_rows: torch.Tensor, chains: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Block verification's weights and thresholds (Sun et al. 2024, Alg. 2), in float64.

    p_0 = 1, p_i = min(p_{i-1} target(x_i) / draft(x_i), 1); for 0 < i < K,
    h_i = S_i / (S_i + 1 - p_i) with S_i = sum_x max(p_i target_i(x) - draft_i(x), 0) over row
    i (the laws after x_1..x_i); h_K = p_K; h_0 = 1. Then tau = max{i : eta_i <= h_i}, and a
    rejected chain's token is drawn from max(p_tau target_tau - draft_tau, 0), renormalised.

    Args:
        target_rows: [P, K+1, V] float64 target laws along the chain (row i after x_1..x_i).
        draft_rows: [P, K, V] float64 draft laws along the chain.
        chains: [P, K] int64 drafts.

    Returns:
        (weights p [P, K+1], thresholds h [P, K+1]), float64.
    """
    num_chains, k = chains.shape
    ratios = _likelihood_ratios(target_rows, draft_rows, chains)
    weights = torch.ones(num_chains, k + 1, dtype=torch.float64)
    for i in range(1, k + 1):
        weights[:, i] = (weights[:, i - 1] * ratios[:, i - 1]).clamp_max(1.0)
    thresholds = torch.ones(num_chains, k + 1, dtype=torch.float64)
    for i in range(1, k):
        mass = (weights[:, i, None] * target_rows[:, i] - draft_rows[:, i]).clamp_min(0).sum(-1)
        below_one = weights[:, i] < 1
        ratio = mass / torch.where(below_one, mass + 1 - weights[:, i], torch.ones_like(mass))
        thresholds[:, i] = torch.where(below_one, ratio, torch.ones_like(mass))
    if k:
        thresholds[:, k] = weights[:, k]
    return weights, thresholds


def accepted_count_law(method: str, accept_probs: torch.Tensor) -> torch.Tensor:
    """P(num_accepted = i | chain) for i = 0..K.

    Args:
        method: "standard": accept_probs = [P, K] ratios, the chain stops at its first
            rejection. "block": accept_probs = [P, K+1] thresholds h, tau = max{i : eta_i <= h_i}.

    Returns:
        [P, K+1] float64.
    """
    ones = torch.ones(accept_probs.shape[0], 1, dtype=torch.float64)
    if method == "standard":
        survive = torch.cumprod(torch.cat([ones, accept_probs], dim=1), dim=1)
        return survive * torch.cat([1 - accept_probs, ones], dim=1)
    # P(tau = i) = h_i prod_{j > i} (1 - h_j)
    after = torch.cumprod((1 - accept_probs[:, 1:]).flip(1), dim=1).flip(1)  # prod_{j >= i+1}
    return accept_probs * torch.cat([after, ones], dim=1)


def coupled_match_probs(target_law: torch.Tensor, draft_law: torch.Tensor) -> torch.Tensor:
    """P(argmax(log target + G) = x = argmax(log draft + G)) for one shared Gumbel vector G.

    Equals 1 / sum_v max(target(v) / target(x), draft(v) / draft(x)), and 0 where either law is
    0: given G_x = t, every other lane must stay below t + min of the two log-ratios, and
    integrating over t gives the formula (the coupling of Daliri et al. 2024).

    Args:
        target_law, draft_law: [..., V] float64 probabilities.

    Returns:
        [..., V] float64.
    """
    both = (target_law > 0) & (draft_law > 0)
    target_safe = torch.where(both, target_law, torch.ones_like(target_law))
    draft_safe = torch.where(both, draft_law, torch.ones_like(draft_law))
    ratios = torch.maximum(
        target_law[..., None, :] / target_safe[..., :, None],
        draft_law[..., None, :] / draft_safe[..., :, None],
    )  # [..., x, v]
    return torch.where(both, 1 / ratios.sum(-1), torch.zeros_like(target_law))


def draft_chains(
    toy: MarkovToy, processing: Processing, drafts: str, num_draft: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every draft chain of length K from the start token, with its probability.

    Returns:
        (chains [P, K] int64, chain_probs [P] float64): all V**K chains for sampled drafts
        (some of probability 0), the single greedy chain for one-hot drafts.
    """
    law = draft_probs(toy, processing, drafts)
    if drafts == "one_hot":
        chain, prev = [], toy.start_token
        for _ in range(num_draft):
            prev = int(law[prev].argmax())
            chain.append(prev)
        return torch.tensor(chain, dtype=torch.int64).view(1, num_draft), torch.ones(1).double()
    chains = all_sequences(toy.vocab_size, num_draft)
    context = torch.cat([torch.full((len(chains), 1), toy.start_token), chains], dim=1)
    return chains, law[context[:, :-1], context[:, 1:]].prod(dim=1)


def acceptance_law(
    toy: MarkovToy, processing: Processing, *, method: str, drafts: str, num_draft: int
) -> torch.Tensor:
    """[K+1] float64: the exact law of num_accepted in a request's first round."""
    target_law = processed_probs(toy.target_logits, processing)
    draft_law = draft_probs(toy, processing, drafts)
    if method == "coupled":
        # Drafts and target samples share each position's noise: match[a, x] is the
        # probability that both pick x after token a; positions draw independent noise.
        match = coupled_match_probs(target_law, draft_law)
        state = torch.nn.functional.one_hot(torch.tensor(toy.start_token), toy.vocab_size)
        survive = [state.to(torch.float64)]
        for _ in range(num_draft):
            survive.append(survive[-1] @ match)
        mass = torch.stack([s.sum() for s in survive] + [torch.zeros((), dtype=torch.float64)])
        return mass[:-1] - mass[1:]
    chains, chain_probs = draft_chains(toy, processing, drafts, num_draft)
    context = torch.cat([torch.full((len(chains), 1), toy.start_token), chains], dim=1)
    target_rows, draft_rows = target_law[context], draft_law[context[:, :-1]]
    if method == "standard":
        accept = standard_accept_ratios(target_rows, draft_rows, chains)
    else:
        accept = block_accept_thresholds(target_rows, draft_rows, chains)[1]
    return (chain_probs[:, None] * accepted_count_law(method, accept)).sum(0)


# ---------------------------------------------------------------------------------------------
# Statistics
# ---------------------------------------------------------------------------------------------


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


def _minus_log10(log10_p: float) -> float:
    return max(0.0, -log10_p)


def _mean_z(values: torch.Tensor, law: torch.Tensor) -> tuple[float, float, float]:
    """(sample mean, exact mean, z) for i.i.d. values in 0..len(law)-1 with exact law `law`."""
    support = torch.arange(law.shape[0], dtype=torch.float64)
    mean = float((law * support).sum())
    variance = float((law * support**2).sum()) - mean**2
    observed = float(values.to(torch.float64).mean())
    return observed, mean, (observed - mean) / math.sqrt(max(variance, 1e-300) / values.numel())


# ---------------------------------------------------------------------------------------------
# Driving the real code path
# ---------------------------------------------------------------------------------------------


def trial_seeds(name: str, seed: int, num_trials: int) -> torch.Tensor:
    """[N] int64 distinct request seeds for one check: a fixed mix of its name and `seed`."""
    mixed = ((zlib.crc32(name.encode()) << 32) ^ (seed * 0x9E3779B97F4A7C15)) % 2**64
    offset = mixed - 2**64 if mixed >= 2**63 else mixed
    # int64 addition wraps around, so the N seeds stay distinct in all 64 bits.
    return torch.arange(num_trials, dtype=torch.int64) + offset


def start_positions(num_trials: int) -> torch.Tensor:
    """[N] int64 first generated position of each request (varied, so the keys vary too)."""
    return 1 + torch.arange(num_trials, dtype=torch.int64) % 1009


def default_draft_key(method: str) -> tuple[Stream, str]:
    """DESIGN.md's draft key: (TARGET, step 0) for coupled, else (DRAFT, step = round anchor)."""
    return (Stream.TARGET, "zero") if method == "coupled" else (Stream.DRAFT, "anchor")


def speculative_round(
    toy: MarkovToy,
    processing: Processing,
    seeds: torch.Tensor,
    anchors: torch.Tensor,
    last_tokens: torch.Tensor,
    *,
    method: str,
    drafts: str,
    num_draft: int,
    draft_key: tuple[Stream, str] | None = None,
) -> VerifyResult:
    """One round for every row: K drafts from `sample`, then `verify` on [last + drafts].

    Args:
        seeds: [N] int64 request seeds.
        anchors: [N] int64 position of each row's first draft (the round anchor).
        last_tokens: [N] int64 token before the anchor.
        method: "standard", "block" or "coupled".
        drafts: "sampled" (draft_logits = the processed logits `sample` drew them from) or
            "one_hot" (greedy drafts, draft_logits = None).
        draft_key: (stream, "anchor" | "zero") for draft noise; None = `default_draft_key`.
            Only negative controls override it.

    RNG: the draft stream at (Q, step) for each sampled draft, then what `verify` draws.
    """
    stream, step_rule = draft_key or default_draft_key(method)
    step = anchors if step_rule == "anchor" else 0
    prev, draft_ids, draft_logits = last_tokens, [], []
    for i in range(num_draft):
        raw = toy.draft_logits[prev]  # [N, V]
        if drafts == "sampled":
            out = sample(raw, seeds, anchors + i, **processing.kwargs(), stream=stream, step=step)
            draft_logits.append(out.processed_logits)
        else:
            out = sample(raw, seeds, anchors + i, temperature=0.0)
        prev = out.token_ids
        draft_ids.append(prev)
    draft_token_ids = torch.stack(draft_ids, dim=1)  # [N, K]
    context = torch.cat([last_tokens[:, None], draft_token_ids], dim=1)  # [N, K+1]
    return verify(
        toy.target_logits[context],
        draft_token_ids,
        torch.stack(draft_logits, dim=1) if draft_logits else None,
        seeds,
        anchors,
        **processing.kwargs(),
        method=method,
    )


@dataclass(frozen=True, slots=True)
class SpecRun:
    """What `speculative_decode` returns.

    Attributes:
        tokens: [N, L] int64 the first L emitted tokens of each request.
        first_accepted: [N] int64 drafts accepted in each request's first round.
        num_rounds: rounds until every request had emitted L tokens.
    """

    tokens: torch.Tensor
    first_accepted: torch.Tensor
    num_rounds: int


def speculative_decode(
    toy: MarkovToy,
    processing: Processing,
    seeds: torch.Tensor,
    positions: torch.Tensor,
    *,
    method: str,
    drafts: str,
    num_draft: int,
    num_tokens: int,
    draft_key: tuple[Stream, str] | None = None,
) -> SpecRun:
    """Speculative decoding of N independent requests until each has emitted `num_tokens`.

    Request n continues after `toy.start_token` with its first generated token at
    positions[n]; each round is anchored at the position after the last emitted token.

    Args:
        seeds: [N] int64 request seeds.
        positions: [N] int64 first generated position of each request.
        method, drafts, num_draft, draft_key: as in `speculative_round`.
        num_tokens: L, tokens to emit per request.
    """
    num_trials = seeds.shape[0]
    tokens = torch.full((num_trials, num_tokens + num_draft), -1, dtype=torch.int64)
    count = torch.zeros(num_trials, dtype=torch.int64)
    last = torch.full((num_trials,), toy.start_token, dtype=torch.int64)
    anchors = positions.clone()
    first_accepted = torch.full((num_trials,), -1, dtype=torch.int64)
    num_rounds = 0
    columns = torch.arange(num_draft + 1)
    while bool((count < num_tokens).any()):
        live = (count < num_tokens).nonzero().squeeze(1)
        result = speculative_round(
            toy,
            processing,
            seeds[live],
            anchors[live],
            last[live],
            method=method,
            drafts=drafts,
            num_draft=num_draft,
            draft_key=draft_key,
        )
        emitted = result.num_accepted + 1
        if num_rounds == 0:
            first_accepted[live] = result.num_accepted
        keep = columns[None, :] < emitted[:, None]  # [n, K+1]
        rows = live[:, None].expand_as(keep)
        tokens[rows[keep], (count[live, None] + columns)[keep]] = result.token_ids[keep]
        last[live] = result.token_ids.gather(1, result.num_accepted[:, None]).squeeze(1)
        anchors[live] += emitted
        count[live] += emitted
        num_rounds += 1
    return SpecRun(tokens[:, :num_tokens], first_accepted, num_rounds)


def plain_decode(
    toy: MarkovToy,
    processing: Processing,
    seeds: torch.Tensor,
    positions: torch.Tensor,
    num_tokens: int,
) -> torch.Tensor:
    """[N, L] int64: L tokens per request from `sample` on the target alone (Stream.TARGET)."""
    prev = torch.full((seeds.shape[0],), toy.start_token, dtype=torch.int64)
    out = []
    for j in range(num_tokens):
        prev = sample(toy.target_logits[prev], seeds, positions + j, **processing.kwargs())
        prev = prev.token_ids
        out.append(prev)
    return torch.stack(out, dim=1)


# ---------------------------------------------------------------------------------------------
# Negative controls: deliberately broken variants; every patch is restored on exit
# ---------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _patched(module: object, name: str, replacement: object) -> Iterator[None]:
    original = getattr(module, name)
    setattr(module, name, replacement)
    try:
        yield
    finally:
        setattr(module, name, original)


@contextlib.contextmanager
def residual_from_target() -> Iterator[None]:
    """Broken verifier: every recovered token is drawn from the target itself.

    A Gumbel-max sampler needs no normalisation, so a Gumbel-max verifier cannot literally forget
    to renormalise max(target - draft, 0). The plausible way to get it wrong is the fallback for
    residuals that rounding leaves empty: testing emptiness with `any` instead of `all` fires on
    every row (the rejected token's residual weight is always -inf), so the recovered token comes
    from the whole target and the rejected draft's mass is never removed.
    """
    original = verify_reference.residual_log_weights

    def broken(target_logp, draft_logp, log_weight):
        log_res = original(target_logp, draft_logp, log_weight)
        empty = torch.isneginf(log_res).any(dim=-1)  # the bug: any instead of all
        log_res[empty] = target_logp[empty]
        return log_res

    with _patched(verify_reference, "residual_log_weights", broken):
        yield


@contextlib.contextmanager
def position_keyed_accept() -> Iterator[None]:
    """Broken verifier: ACCEPT uniforms keyed by position only (their step forced to 0).

    Block verification reads acceptance uniforms past the accepted prefix and the next round
    re-verifies those positions, so position-only keys reuse values already conditioned on a
    decision (DESIGN.md, "RNG contract"). Pair it with drafts keyed at step 0.
    """
    original = verify_reference.uniform

    def broken(seeds, positions, stream, num_lanes, *, step=0, dtype=torch.float32):
        step = 0 if stream == Stream.ACCEPT else step
        return original(seeds, positions, stream, num_lanes, step=step, dtype=dtype)

    with _patched(verify_reference, "uniform", broken):
        yield


def control_setup(
    control: str | None, method: str
) -> tuple[contextlib.AbstractContextManager, tuple[Stream, str] | None]:
    """(patch, draft_key) that turn the real code path into a negative control.

    - "shared_noise": drafts drawn from Stream.RESIDUAL at step 0, so a recovered token reuses
      the Gumbel field that picked the rejected draft (the vLLM bug, upstream #47386/#54282).
    - "residual_from_target": `residual_from_target`.
    - "position_keyed": `position_keyed_accept`, drafts keyed by position only too.
    """
    if control is None:
        return contextlib.nullcontext(), None
    if control == "shared_noise":
        return contextlib.nullcontext(), (Stream.RESIDUAL, "zero")
    if control == "residual_from_target":
        return residual_from_target(), None
    if control == "position_keyed":
        return position_keyed_accept(), (default_draft_key(method)[0], "zero")
    raise ValueError(f"control must be one of {CONTROLS} or None, got {control!r}")


# ---------------------------------------------------------------------------------------------
# Checks
# ---------------------------------------------------------------------------------------------

MATRIX_VOCAB = 5
MATRIX_NUM_DRAFT = 2
MATRIX_LENGTH = 4  # with K = 2, the first 4 tokens always span two rounds or more
MATRIX_KEY = 20261130


def matrix_toy() -> MarkovToy:
    """The V = 5 bigram toy of the cases matrix (target and a "near" drafter)."""
    return markov_toy(MATRIX_VOCAB, MATRIX_KEY)


def check_matrix_case(
    method: str,
    drafts: str,
    processing: Processing,
    num_trials: int,
    seed: int,
    *,
    control: str | None = None,
) -> list[CheckResult]:
    """One case of the matrix: the joint law of emitted sequences, and first-round acceptance.

    Setup: V = 5 bigram toy, K = 2 drafts per round, N requests with distinct seeds, run until
    each has emitted 4 tokens (so every request goes through two rounds or more).
    1. H0: the first 4 emitted tokens follow the target's processed law (625 sequences).
       Statistic: Pearson chi-square (bins expecting < 5 pooled), reported as -log10 p;
       rejected iff p < 1e-6 (false-failure rate 1e-6). Power: at N = 200k it rejects with
       probability 0.99 any emitted law whose sum (law - exact)^2 / exact is >= 1.1e-3 (df
       ~300, plain) or >= 4.4e-4 (df ~20, top-p); five times those at N = 40k.
    2. H0: the mean number of drafts accepted in the first round equals its exact value
       (`acceptance_law`). Statistic: |z| of the sample mean with the exact variance;
       rejected iff |z| > 5.3 (false-failure rate 1.2e-7).

    Args:
        control: a negative control (see `control_setup`); then only check 1 is run.
    """
    toy = matrix_toy()
    name = f"{method}/{drafts}/{processing.name}"
    seeds = trial_seeds(f"matrix/{name}/{control}", seed, num_trials)
    patch, draft_key = control_setup(control, method)
    with patch:
        run = speculative_decode(
            toy,
            processing,
            seeds,
            start_positions(num_trials),
            method=method,
            drafts=drafts,
            num_draft=MATRIX_NUM_DRAFT,
            num_tokens=MATRIX_LENGTH,
            draft_key=draft_key,
        )
    target_law = processed_probs(toy.target_logits, processing)
    law = joint_probs(target_law, toy.start_token, MATRIX_LENGTH)
    test = chi_square(
        torch.bincount(sequence_codes(run.tokens, MATRIX_VOCAB), minlength=law.numel()), law
    )
    joint = _result(
        f"joint/{name}",
        _minus_log10(test.log10_p),
        LOG10_ALPHA,
        f"-log10 p; {test.describe()}, {run.num_rounds} rounds",
        control=control,
    )
    if control is not None:
        return [joint]
    exact_law = acceptance_law(
        toy, processing, method=method, drafts=drafts, num_draft=MATRIX_NUM_DRAFT
    )
    observed, exact, z = _mean_z(run.first_accepted, exact_law)
    acceptance = _result(
        f"accept/{name}",
        abs(z),
        Z_MAX,
        f"|z|; mean accepted {observed:.4f} vs exact {exact:.4f}, n {num_trials}",
    )
    return [joint, acceptance]


def check_block_beats_standard(drafts: str, num_trials: int, seed: int) -> CheckResult:
    """H0 (one-sided): block verification accepts at least as many drafts as token-level.

    Same toy as the matrix (plain processing, K = 2, first round), independent runs of N
    requests each. Statistic: z = (mean_standard - mean_block) / SE with sample variances;
    rejected iff z > 5.3 (false-failure rate 6e-8 when the means are equal, less when block's
    is larger, as Sun et al. prove it is; both exact means are in the detail).
    """
    toy, processing, means, variances = matrix_toy(), PROCESSINGS[0], {}, {}
    for method in ("standard", "block"):
        seeds = trial_seeds(f"block>=standard/{method}/{drafts}", seed, num_trials)
        run = speculative_decode(
            toy,
            processing,
            seeds,
            start_positions(num_trials),
            method=method,
            drafts=drafts,
            num_draft=MATRIX_NUM_DRAFT,
            num_tokens=1,
        )
        values = run.first_accepted.to(torch.float64)
        means[method], variances[method] = float(values.mean()), float(values.var())
    se = math.sqrt((variances["standard"] + variances["block"]) / num_trials)
    z = (means["standard"] - means["block"]) / max(se, 1e-300)
    exact = {}
    for method in ("standard", "block"):
        law = acceptance_law(
            toy, processing, method=method, drafts=drafts, num_draft=MATRIX_NUM_DRAFT
        )
        exact[method] = float((law * torch.arange(MATRIX_NUM_DRAFT + 1)).sum())
    return _result(
        f"accept/block>=standard/{drafts}",
        z,
        Z_MAX,
        f"z (one-sided); mean accepted block {means['block']:.4f} (exact {exact['block']:.4f}) "
        f"vs standard {means['standard']:.4f} (exact {exact['standard']:.4f}), n {num_trials} each",
    )


ADVERSARIAL_VOCAB = 16
ADVERSARIAL_KEY = 54282


def check_adversarial(
    num_draft: int,
    num_trials: int,
    seed: int,
    *,
    method: str = "standard",
    control: str | None = None,
) -> CheckResult:
    """The narrow adversarial case: each emitted position against the target, where reached.

    Setup: V = 16 context-free target, draft logits = -target logits (a third of the drafts are
    accepted, so most requests draw a recovered token), one round of K drafts, N requests.
    H0: the token at position i of the round, over the requests that emitted more than i tokens,
    follows the target law (token-level and coupled verification are exact conditionally on each
    accepted prefix). Statistic: a Pearson chi-square per position (bins expecting < 5 pooled);
    the check's p is the smallest over the K+1 positions times K+1 (Bonferroni), reported as
    -log10 p and rejected iff p < 1e-6 (false-failure rate <= 1e-6).

    Args:
        control: None, "shared_noise" or "residual_from_target" (see `control_setup`).
    """
    toy = markov_toy(
        ADVERSARIAL_VOCAB, ADVERSARIAL_KEY, draft="adversarial", context_free=True, spread=0.5
    )
    processing = PROCESSINGS[0]
    name = f"adversarial/{method}/K={num_draft}"
    seeds = trial_seeds(f"{name}/{control}", seed, num_trials)
    patch, draft_key = control_setup(control, method)
    with patch:
        result = speculative_round(
            toy,
            processing,
            seeds,
            start_positions(num_trials),
            torch.full((num_trials,), toy.start_token),
            method=method,
            drafts="sampled",
            num_draft=num_draft,
            draft_key=draft_key,
        )
    target_law = processed_probs(toy.target_logits[:1], processing)[0]
    worst, parts = 0.0, []
    for i in range(num_draft + 1):
        reached = result.num_accepted >= i
        counts = torch.bincount(result.token_ids[reached, i], minlength=ADVERSARIAL_VOCAB)
        test = chi_square(counts, target_law)
        worst = max(worst, _minus_log10(test.log10_p))
        parts.append(f"pos {i}: {test.describe()}")
    rate = float(result.num_accepted.double().mean()) / num_draft
    return _result(
        name,
        max(0.0, worst - math.log10(num_draft + 1)),
        LOG10_ALPHA,
        f"-log10 (min p x positions); {'; '.join(parts)}; acceptance rate {rate:.3f}",
        control=control,
    )


BLOCK_TOY_NUM_DRAFT = 3
BLOCK_TOY_LENGTH = 6


def block_toy() -> MarkovToy:
    """peers-and-papers.md 5.3: context-free target (0.3, 0.7) and draft (0.8, 0.2)."""
    target = torch.tensor([0.3, 0.7]).log().expand(2, 2).contiguous()
    draft = torch.tensor([0.8, 0.2]).log().expand(2, 2).contiguous()
    return MarkovToy(target, draft)


def check_block_rounds(num_trials: int, seed: int, *, control: str | None = None) -> CheckResult:
    """Block verification with greedy drafts over rounds: the joint law of 6 emitted tokens.

    Setup (peers-and-papers.md 5.3): context-free target (0.3, 0.7) and draft (0.8, 0.2), so
    the greedy draft is always token 0; K = 3; N requests. H0: the first 6 emitted tokens are
    i.i.d. (0.3, 0.7). Statistic: Pearson chi-square over the 64 sequences, as -log10 p;
    rejected iff p < 1e-6 (false-failure rate 1e-6).

    Args:
        control: None or "position_keyed" (peers-and-papers.md measured P(token 0) falling from
            0.300 to 0.253 after the first position).
    """
    toy = block_toy()
    seeds = trial_seeds(f"rounds/block/{control}", seed, num_trials)
    patch, draft_key = control_setup(control, "block")
    with patch:
        run = speculative_decode(
            toy,
            PROCESSINGS[0],
            seeds,
            start_positions(num_trials),
            method="block",
            drafts="one_hot",
            num_draft=BLOCK_TOY_NUM_DRAFT,
            num_tokens=BLOCK_TOY_LENGTH,
            draft_key=draft_key,
        )
    law = joint_probs(processed_probs(toy.target_logits, PROCESSINGS[0]), 0, BLOCK_TOY_LENGTH)
    test = chi_square(torch.bincount(sequence_codes(run.tokens, 2), minlength=law.numel()), law)
    freq = ", ".join(f"{float((column == 0).double().mean()):.3f}" for column in run.tokens.T)
    return _result(
        "rounds/block/one_hot/(0.3,0.7)",
        _minus_log10(test.log10_p),
        LOG10_ALPHA,
        f"-log10 p; {test.describe()}; P(token 0) by position: {freq}",
        control=control,
    )


def check_coupled_identity(num_trials: int, seed: int) -> CheckResult:
    """Coupled verification equals plain decoding token for token, whatever the drafter.

    For every processing (plain, the three filtered ones, greedy), drafter (near, adversarial =
    -target, independent) and draft kind (sampled, one-hot): V = 8 bigram toy, K = 3, 8 tokens
    per request over several rounds, against `sample` on the target alone with the same seeds
    and positions. At temperature 0, standard and block must equal greedy decoding too.
    Deterministic: the statistic counts mismatched tokens and must be 0.
    """
    mismatches, compared = 0, 0
    positions = start_positions(num_trials)
    for drafter in ("near", "adversarial", "independent"):
        toy = markov_toy(8, 777, draft=drafter)
        for processing in (*PROCESSINGS, GREEDY):
            seeds = trial_seeds(f"identity/{drafter}/{processing.name}", seed, num_trials)
            plain = plain_decode(toy, processing, seeds, positions, 8)
            methods = METHODS if processing is GREEDY else ("coupled",)
            for method in methods:
                for drafts in DRAFT_KINDS:
                    spec = speculative_decode(
                        toy,
                        processing,
                        seeds,
                        positions,
                        method=method,
                        drafts=drafts,
                        num_draft=3,
                        num_tokens=8,
                    )
                    mismatches += int((spec.tokens != plain).sum())
                    compared += plain.numel()
    return _result(
        "identity/coupled==plain",
        mismatches,
        0,
        f"mismatched tokens; out of {compared} (coupled: 5 processings x 3 drafters x 2 draft "
        "kinds; standard and block at temperature 0)",
    )


SENTINEL_SEED = -777


@contextlib.contextmanager
def _seeds_reaching_rng() -> Iterator[set[int]]:
    """Records every seed that the verifier hands to `specdec.rng`."""
    seen: set[int] = set()
    original_uniform, original_gumbel = verify_reference.uniform, sampler_module.gumbel

    def uniform_spy(seeds, *args, **kwargs):
        seen.update(seeds.tolist())
        return original_uniform(seeds, *args, **kwargs)

    def gumbel_spy(seeds, *args, **kwargs):
        seen.update(seeds.tolist())
        return original_gumbel(seeds, *args, **kwargs)

    with (
        _patched(verify_reference, "uniform", uniform_spy),
        _patched(sampler_module, "gumbel", gumbel_spy),
    ):
        yield seen


PAD_FILL = {"seeds": SENTINEL_SEED, "temperature": 1.0, "top_p": 1.0, "num_draft": 1}


def _verify_rows(
    inputs: dict[str, torch.Tensor | None], rows: torch.Tensor, method: str, num_pad: int = 0
) -> VerifyResult:
    """`verify` on rows `rows` of `inputs`, then `num_pad` padding rows (seed SENTINEL_SEED)."""

    def select(name: str, t: torch.Tensor | None) -> torch.Tensor | None:
        if t is None:
            return None
        pad = torch.full((num_pad, *t.shape[1:]), PAD_FILL.get(name, 0)).to(t)
        return torch.cat([t[rows], pad])

    selected = {name: select(name, t) for name, t in inputs.items()}
    return verify(**selected, method=method, active_rows=len(rows))


def check_invariance(seed: int) -> CheckResult:
    """A request alone == in a batch == permuted == with padded rows == replayed, bit for bit.

    `sample`: token ids and processed logits of 12 rows with mixed temperatures (greedy
    included) and filters. `verify`, for each method and draft kind: token ids and
    num_accepted with mixed num_draft; padded rows (>= active_rows) must emit -1, accept nothing
    and draw no noise (their sentinel seed must never reach `specdec.rng`). Deterministic: the
    statistic counts failed comparisons and must be 0.
    """
    failures, comparisons = 0, 0

    def compare(a: torch.Tensor, b: torch.Tensor) -> None:
        nonlocal failures, comparisons
        comparisons += 1
        failures += int(not torch.equal(a, b))

    batch, vocab, k, pad = 12, 16, 3, 4
    every, perm = torch.arange(batch), torch.arange(batch).flip(0).roll(5)
    seeds = trial_seeds("invariance", seed, batch)
    positions = 3 + 7 * torch.arange(batch, dtype=torch.int64)
    params = {
        "temperature": torch.tensor([1.0, 0.7, 0.0, 1.3] * 3),
        "top_k": torch.tensor([0, 3, 0, 5] * 3),
        "top_p": torch.tensor([1.0, 1.0, 0.8, 0.9] * 3),
        "min_p": torch.tensor([0.0, 0.1, 0.0, 0.05] * 3),
    }
    raw = 2 * toy_logits(vocab, 4242, step=0).repeat(2, 1)[:batch]  # [B, V]

    def sample_rows(rows: torch.Tensor, shift: int = 0, key=(Stream.DRAFT, "anchor")):
        step = positions[rows] + shift if key[1] == "anchor" else 0
        return sample(
            raw.roll(shift, 0)[rows],
            seeds[rows],
            positions[rows] + shift,
            **{name: value[rows] for name, value in params.items()},
            stream=key[0],
            step=step,
        )

    full = sample_rows(every)
    for rows, run in ((every, sample_rows(every)), (perm, sample_rows(perm))):
        compare(run.token_ids, full.token_ids[rows])
        compare(run.processed_logits, full.processed_logits[rows])
    for b in range(batch):
        alone = sample_rows(torch.tensor([b]))
        compare(alone.token_ids, full.token_ids[b : b + 1])
        compare(alone.processed_logits, full.processed_logits[b : b + 1])

    target = 1.5 * toy_logits(vocab, 4343, step=0).repeat(4, 1)[: batch * (k + 1)]
    for method in METHODS:
        outs = [sample_rows(every, i, default_draft_key(method)) for i in range(k)]
        for drafts in DRAFT_KINDS:
            inputs = {
                "target_logits": target.view(batch, k + 1, vocab),
                "draft_token_ids": torch.stack([out.token_ids for out in outs], dim=1),
                "draft_logits": None,
                "seeds": seeds,
                "positions": positions,
                "num_draft": torch.tensor([3, 2, 0, 1] * 3),
                **params,
            }
            if drafts == "sampled":
                inputs["draft_logits"] = torch.stack([out.processed_logits for out in outs], 1)
            full_v = _verify_rows(inputs, every, method)
            with _seeds_reaching_rng() as seen:
                padded = _verify_rows(inputs, every, method, num_pad=pad)
            compare(padded.token_ids, torch.cat([full_v.token_ids, torch.full((pad, k + 1), -1)]))
            compare(padded.num_accepted, torch.cat([full_v.num_accepted, torch.zeros(pad).long()]))
            compare(torch.tensor([SENTINEL_SEED in seen, not seen]), torch.zeros(2).bool())
            for rows in (every, perm):  # replayed, permuted
                run = _verify_rows(inputs, rows, method)
                compare(run.token_ids, full_v.token_ids[rows])
                compare(run.num_accepted, full_v.num_accepted[rows])
            for b in range(batch):
                alone = _verify_rows(inputs, torch.tensor([b]), method)
                compare(alone.token_ids, full_v.token_ids[b : b + 1])
    return _result(
        "invariance/alone==batch==permuted==padded==replayed",
        failures,
        0,
        f"failed comparisons; out of {comparisons} (sample; verify: 3 methods x 2 draft kinds)",
    )


# ---------------------------------------------------------------------------------------------
# The far tail
# ---------------------------------------------------------------------------------------------

FAR_TAIL_GAP = 18.0  # logits between the head token and every tail token
FAR_TAIL_VOCAB = 131072


def ideal_tail_mass(num_tail: int, gap: float = FAR_TAIL_GAP) -> float:
    """Mass of `num_tail` tokens `gap` logits below one head token: n e^-gap / (1 + n e^-gap)."""
    tail = num_tail * math.exp(-gap)
    return tail / (1 + tail)


def noise_tail_mass(
    word_to_noise: Callable[[torch.Tensor], torch.Tensor],
    num_tail: int,
    gap: float = FAR_TAIL_GAP,
    num_words: int = 2**21,
) -> float:
    """The exact tail mass that Gumbel-max sampling gets from a 32-bit word -> noise map.

    A tail token wins iff its noise exceeds the head's by `gap`. With Philox words uniform on
    [0, 2**32) and the map non-increasing in the word (small words give the largest noise),
    P(one lane's noise > s) = N(s) / 2**32, where N(s) counts the words mapped above s; only the
    `num_words` smallest words can matter. The head's noise is taken as exactly Gumbel (its own
    resolution moves the result by < 1e-9), so with intervals I_k of head noise on which
    N(noise + gap) = k: P(tail) = 1 - sum_k P(head in I_k) (1 - k / 2**32)**num_tail.

    Args:
        word_to_noise: [n] int64 words -> [n] float32 noise (e.g. `sampler_word_noise`).
    """
    noise = word_to_noise(torch.arange(num_words, dtype=torch.int64)).to(torch.float64)
    if bool((noise[1:] > noise[:-1]).any()):
        raise ValueError("word_to_noise must be non-increasing in the word")
    # N(t + gap) = k exactly for head noise t in I_k = [noise[k] - gap, noise[k-1] - gap).
    edges = torch.cat([torch.tensor([math.inf], dtype=torch.float64), noise - gap])
    head_cdf = torch.exp(-torch.exp(-edges))
    interval_mass = head_cdf[:-1] - head_cdf[1:]
    k = torch.arange(num_words, dtype=torch.float64)
    return 1.0 - float((interval_mass * torch.exp(num_tail * torch.log1p(-k / 2**32))).sum())


def sampler_word_noise(words: torch.Tensor) -> torch.Tensor:
    """The sampler's own word -> noise map: `uniform_to_gumbel(words_to_uniform32(words))`."""
    return uniform_to_gumbel(words_to_uniform32(words))


def mantissa24_word_noise(words: torch.Tensor) -> torch.Tensor:
    """A plausible but too coarse map, 24 random bits as `torch.rand` keeps for float32:
    u = ((word >> 8) + 0.5) 2**-24. Its largest noise is 17.3, below the gap of 18."""
    return uniform_to_gumbel((((words >> 8).to(torch.float64) + 0.5) * 2.0**-24).float())


def check_far_tail_resolution(*, control: str | None = None) -> CheckResult:
    """The exact far-tail mass implied by the noise's resolution (no sampling error).

    H0: the tail mass that Gumbel-max gives 131,071 tokens 18 logits below one head token,
    computed exactly from the sampler's word -> uniform -> Gumbel map (`noise_tail_mass`), is
    within 1e-4 (relative) of (V-1) e^-18 / (1 + (V-1) e^-18). The map is first checked bit for
    bit against `specdec.rng.gumbel` on 4,096 keys x 64 lanes, so it is the one sampling uses.
    It assumes only that Philox words are uniform (the KAT vectors pin the generator).

    Args:
        control: None, or "24-bit" (the negative control: `mantissa24_word_noise`).
    """
    keys = torch.arange(4096, dtype=torch.int64)
    words = random_words(keys * 1000003, keys, Stream.TARGET, 16).reshape(4096, 64)
    same = torch.equal(sampler_word_noise(words), gumbel(keys * 1000003, keys, Stream.TARGET, 64))
    word_to_noise = mantissa24_word_noise if control else sampler_word_noise
    mass = noise_tail_mass(word_to_noise, FAR_TAIL_VOCAB - 1)
    ideal = ideal_tail_mass(FAR_TAIL_VOCAB - 1)
    error = abs(mass / ideal - 1) if same else math.inf
    return _result(
        "far-tail/resolution",
        error,
        1e-4,
        f"relative error; exact tail mass {mass:.6e} vs ideal {ideal:.6e} (gap 18, V "
        f"{FAR_TAIL_VOCAB}); map == gumbel(): {same}",
        control=control,
    )


def check_far_tail_sampling(num_rows: dict[str, int], seed: int, chunk: int = 1) -> CheckResult:
    """End-to-end far tail: tokens 18 logits below the top are sampled at their true rate.

    Setup: V = 131,072, head token 0 at logit 0, every other token at -18; each row has its
    own (seed, position) key. TARGET and DRAFT rows go through `sample`; RESIDUAL rows through
    `verify` (K = 1, a one-hot draft on a tail token, rejected with probability 1 - 1.5e-8, so
    the recovered token is drawn from the residual: the target without that token).
    H0: the pooled count of tail tokens has mean sum of the rows' exact tail masses (2.0e-3 per
    row). Statistic: two-sided exact Poisson p (the count is far too small for a z-test), as
    -log10 p; rejected iff p < 1e-6 (false-failure rate <= 1e-6).
    Power is bounded by the CPU: a row costs 131,072 noise draws and a tail event needs e^18 =
    6.6e7 of them. The full audit (2,432 rows, ~30 s on one core) expects 4.8 tail events and
    rejects only a 4-fold excess or worse; no count can reject a total loss of the tail there
    (P(0) = 8e-3). It is a smoke test of the whole path; `check_far_tail_resolution` carries
    the power against a too coarse noise map.
    """
    vocab, head, gap = FAR_TAIL_VOCAB, 0, FAR_TAIL_GAP
    logits = torch.full((chunk, vocab), -gap)
    logits[:, head] = 0.0
    observed, expected, parts = 0, 0.0, []
    for stream_name, rows in num_rows.items():
        seeds = trial_seeds(f"far-tail/{stream_name}", seed, rows)
        hits = 0
        for start in range(0, rows, chunk):
            s = seeds[start : start + chunk]
            n = s.shape[0]
            positions = 11 + start + torch.arange(n, dtype=torch.int64)
            if stream_name == "RESIDUAL":
                target = logits[:n, None, :].expand(n, 2, vocab)
                tail_draft = torch.ones(n, 1, dtype=torch.int64)
                result = verify(target, tail_draft, None, s, positions, temperature=1.0)
                hits += int((result.token_ids[result.num_accepted == 0, 0] != head).sum())
            else:
                stream = Stream[stream_name]
                step = positions if stream == Stream.DRAFT else 0
                out = sample(logits[:n], s, positions, temperature=1.0, stream=stream, step=step)
                hits += int((out.token_ids != head).sum())
        num_tail = vocab - 2 if stream_name == "RESIDUAL" else vocab - 1
        mean = rows * ideal_tail_mass(num_tail, gap)
        observed, expected = observed + hits, expected + mean
        parts.append(f"{stream_name} {hits} in {rows} rows (expected {mean:.2f})")
    z = (observed - expected) / math.sqrt(expected)
    return _result(
        "far-tail/sampling",
        _minus_log10(poisson_log10_p(observed, expected)),
        LOG10_ALPHA,
        f"-log10 exact Poisson p; {observed} tail tokens vs {expected:.2f} expected "
        f"(z {z:.2f}); " + ", ".join(parts),
    )


# ---------------------------------------------------------------------------------------------
# The audit
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class AuditSizes:
    """Sample sizes of one audit run (thresholds do not change with them, only power)."""

    matrix_trials: int
    adversarial_trials: int
    block_rounds_trials: int
    identity_trials: int
    far_tail_rows: dict[str, int]


FULL_SIZES = AuditSizes(
    matrix_trials=200_000,
    adversarial_trials=400_000,
    block_rounds_trials=100_000,
    identity_trials=500,
    far_tail_rows={"TARGET": 1024, "DRAFT": 1024, "RESIDUAL": 384},
)
QUICK_SIZES = AuditSizes(
    matrix_trials=40_000,
    adversarial_trials=200_000,
    block_rounds_trials=20_000,
    identity_trials=100,
    far_tail_rows={"TARGET": 256, "DRAFT": 256, "RESIDUAL": 64},
)

# Negative controls of the joint-law check: (method, draft kind, control).
MATRIX_CONTROLS = (
    ("standard", "sampled", "shared_noise"),
    ("standard", "one_hot", "residual_from_target"),
    ("block", "one_hot", "position_keyed"),
)


def audit_checks(sizes: AuditSizes, seed: int) -> list[Callable[[], Any]]:
    """The audit as a list of calls, each returning a CheckResult or a list of them."""
    matrix, adversarial = sizes.matrix_trials, sizes.adversarial_trials
    checks = [
        partial(check_matrix_case, method, drafts, processing, matrix, seed)
        for method in METHODS
        for drafts in DRAFT_KINDS
        for processing in PROCESSINGS
    ]
    checks += [
        partial(check_matrix_case, method, drafts, PROCESSINGS[0], matrix, seed, control=control)
        for method, drafts, control in MATRIX_CONTROLS
    ]
    checks += [partial(check_block_beats_standard, d, matrix, seed) for d in DRAFT_KINDS]
    for k in (1, 3):
        checks += [
            partial(check_adversarial, k, adversarial, seed, method="standard"),
            partial(check_adversarial, k, adversarial, seed, method="coupled"),
            partial(check_adversarial, k, adversarial, seed, control="shared_noise"),
            partial(check_adversarial, k, adversarial, seed, control="residual_from_target"),
        ]
    checks += [
        partial(check_block_rounds, sizes.block_rounds_trials, seed),
        partial(check_block_rounds, sizes.block_rounds_trials, seed, control="position_keyed"),
        partial(check_coupled_identity, sizes.identity_trials, seed),
        partial(check_invariance, seed),
        partial(check_far_tail_resolution),
        partial(check_far_tail_resolution, control="24-bit"),
        partial(check_far_tail_sampling, sizes.far_tail_rows, seed),
    ]
    return checks


def run_audit(
    quick: bool,
    *,
    seed: int = 0,
    on_result: Callable[[CheckResult, float], None] | None = None,
) -> list[CheckResult]:
    """Runs every conformance check.

    Args:
        quick: smaller samples (same thresholds, less power); about a minute on 2 CPU cores.
        seed: mixed into every request seed (the toy tables do not depend on it).
        on_result: called with each result and the seconds its check took, as it completes.

    Returns:
        Every result, in order. The audit passes iff every result is `ok`.
    """
    results: list[CheckResult] = []
    for check in audit_checks(QUICK_SIZES if quick else FULL_SIZES, seed):
        started = time.perf_counter()
        outcome = check()
        batch = outcome if isinstance(outcome, list) else [outcome]
        elapsed = (time.perf_counter() - started) / len(batch)
        for result in batch:
            results.append(result)
            if on_result is not None:
                on_result(result, elapsed)
    return results
