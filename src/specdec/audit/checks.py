"""The checks behind `specdec audit` (check_*) and their CheckResult: each drives the real code
through `drivers` (broken by a `controls` patch for a negative control) and tests what it emits
against the exact `laws` with `statistics`. It never patches code itself or creates randomness.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from specdec.audit.controls import _seeds_reaching_rng, control_setup, mantissa24_word_noise
from specdec.audit.drivers import (
    default_draft_key,
    plain_decode,
    speculative_decode,
    speculative_round,
    start_positions,
    trial_seeds,
)
from specdec.audit.laws import (
    DRAFT_KINDS,
    FAR_TAIL_GAP,
    GREEDY,
    METHODS,
    PROCESSINGS,
    MarkovToy,
    Processing,
    acceptance_law,
    ideal_tail_mass,
    joint_probs,
    markov_toy,
    noise_tail_mass,
    processed_probs,
    sampler_word_noise,
    sequence_codes,
    toy_logits,
)
from specdec.audit.statistics import _mean_z, chi_square, poisson_log10_p
from specdec.rng import Stream, gumbel, random_words
from specdec.sampling import sample
from specdec.verify import VerifyResult, verify

ALPHA = 1e-6  # false-failure probability of every check that must pass
LOG10_ALPHA = -math.log10(ALPHA)  # threshold on -log10 p
Z_MAX = 5.3  # |z| threshold: two-sided normal tail 1.2e-7


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


def _minus_log10(log10_p: float) -> float:
    return max(0.0, -log10_p)


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

FAR_TAIL_VOCAB = 131072


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
