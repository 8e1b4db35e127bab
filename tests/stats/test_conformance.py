"""Statistical conformance of sampling and verification: the checks `specdec audit` runs.

Each test drives the real `sample` and `verify` through `specdec.audit` and states H0, the
statistic, the sample count, the threshold and the false-failure rate. Draws are keyed (Philox),
so a test is deterministic: the false-failure rate is the probability that a fresh seed would
fail it. Every check has a negative control, a deliberately broken variant the same check must
reject with a wide margin. Full-size runs are behind `slow`.
"""

from __future__ import annotations

import pytest

from specdec import audit as c

pytestmark = pytest.mark.stats

SEED = 0
SIZES = c.QUICK_SIZES
# A rejected negative control must miss the threshold by this factor at least (p < 1e-18).
MARGIN = 3.0


def assert_rejected(result: c.CheckResult, margin: float = MARGIN) -> None:
    assert not result.expected_to_pass
    assert result.statistic > margin * result.threshold, (result.name, result.detail)


@pytest.mark.parametrize("processing", c.PROCESSINGS, ids=lambda p: p.name)
@pytest.mark.parametrize("drafts", c.DRAFT_KINDS)
@pytest.mark.parametrize("method", c.METHODS)
def test_joint_law_and_acceptance(method, drafts, processing):
    """Joint law of emitted sequences over rounds, and the first round's acceptance.

    V = 5 bigram toy (near drafter), K = 2, N = 40,000 requests with distinct seeds, each run
    until it has emitted 4 tokens (two rounds or more).
    H0 (joint): the first 4 tokens follow the target's processed law over the 625 sequences.
    Statistic: Pearson chi-square, bins expecting < 5 pooled; fail iff p < 1e-6 (false-failure
    rate 1e-6).
    H0 (acceptance): E[drafts accepted in round 1] equals its exact value. Statistic: z with the
    exact variance; fail iff |z| > 5.3 (false-failure rate 1.2e-7).
    """
    joint, acceptance = c.check_matrix_case(method, drafts, processing, SIZES.matrix_trials, SEED)
    assert joint.passed, joint.detail
    assert acceptance.passed, acceptance.detail


@pytest.mark.parametrize("method, drafts, control", c.MATRIX_CONTROLS)
def test_joint_law_rejects_broken_verifiers(method, drafts, control):
    """Negative controls of the joint-law check (same setup, N = 40,000): drafts sharing the
    residual's noise, residuals drawn from the target, position-keyed block uniforms. Each must
    give p < 1e-18."""
    (joint,) = c.check_matrix_case(
        method, drafts, c.PROCESSINGS[0], SIZES.matrix_trials, SEED, control=control
    )
    assert_rejected(joint)


@pytest.mark.parametrize("drafts", c.DRAFT_KINDS)
def test_block_accepts_at_least_as_much_as_standard(drafts):
    """H0: E[accepted, block] >= E[accepted, standard] (Sun et al.: block is optimal).

    Same toy, plain processing, K = 2, N = 40,000 requests per method. Statistic: one-sided z of
    the difference of means; fail iff z > 5.3 (false-failure rate <= 6e-8).
    """
    result = c.check_block_beats_standard(drafts, SIZES.matrix_trials, SEED)
    assert result.passed, result.detail


@pytest.mark.parametrize("num_draft", [1, 3])
@pytest.mark.parametrize("method", ["standard", "coupled"])
def test_adversarial_positions(method, num_draft):
    """The narrow adversarial case, per position, conditioned on reaching it.

    V = 16 context-free target, draft logits = -target logits (a third of drafts accepted),
    one round of K drafts, N = 200,000 requests. H0: the token at each position i of the round,
    over requests that emitted more than i tokens, follows the target law. Statistic: per-position
    chi-square (bins expecting < 5 pooled); fail iff min p x (K+1) < 1e-6 (false-failure rate
    <= 1e-6).
    """
    result = c.check_adversarial(num_draft, SIZES.adversarial_trials, SEED, method=method)
    assert result.passed, result.detail


@pytest.mark.parametrize("num_draft", [1, 3])
@pytest.mark.parametrize("control", ["shared_noise", "residual_from_target"])
def test_adversarial_rejects_broken_verifiers(control, num_draft):
    """Negative controls of the adversarial check (standard, N = 200,000): drafts drawn from
    the RESIDUAL stream at step 0 (the recovered token reuses the rejected draft's noise), and
    recovered tokens drawn from the target. Each must give p < 1e-18."""
    result = c.check_adversarial(num_draft, SIZES.adversarial_trials, SEED, control=control)
    assert_rejected(result)


def test_block_over_rounds():
    """Block verification re-reads positions across rounds (peers-and-papers.md 5.3).

    Context-free target (0.3, 0.7), draft (0.8, 0.2), greedy drafts, K = 3, N = 20,000
    requests. H0: the first 6 emitted tokens are i.i.d. (0.3, 0.7). Statistic: chi-square over
    the 64 sequences; fail iff p < 1e-6 (false-failure rate 1e-6).
    """
    result = c.check_block_rounds(SIZES.block_rounds_trials, SEED)
    assert result.passed, result.detail


def test_block_over_rounds_rejects_position_keyed_uniforms():
    """Negative control: ACCEPT uniforms (and drafts) keyed by position only; P(token 0) drops
    from 0.300 to about 0.255 after the first position. Must give p < 1e-18."""
    assert_rejected(c.check_block_rounds(SIZES.block_rounds_trials, SEED, control="position_keyed"))


def test_coupled_is_plain_decoding():
    """Deterministic: coupled verification emits exactly the tokens of plain `sample` decoding
    with the same seeds (5 processings x 3 drafters, bad ones included, x 2 draft kinds, 100
    requests x 8 tokens each); at temperature 0 standard and block do too. Threshold: 0
    mismatches (no false failures)."""
    result = c.check_coupled_identity(SIZES.identity_trials, SEED)
    assert result.passed, result.detail


@pytest.mark.parametrize("rules", list(c.RULE_SETS))
@pytest.mark.parametrize("drafts", c.DRAFT_KINDS)
@pytest.mark.parametrize("method", c.METHODS)
def test_penalties_and_bans_keep_the_joint_law(method, drafts, rules):
    """Penalties and bans under speculation: draft i processed with drafts 0..i-1 as context,
    verify row j with drafts 0..j-1.

    V = 5 bigram toy (near drafter), prompt (2, 0), K = 2, N = 40,000 requests each run until
    it has emitted 4 tokens; rule sets "penalties" (repetition 1.6, presence 0.9, frequency 0.7,
    a logit bias) and "bans" (allowed_token_ids, two multi-token bad words, min_tokens, presence
    -0.8). H0: the first 4 tokens follow plain penalised sampling's exact law, computed from an
    independent float64 twin of the rules (625 sequences). Statistic: Pearson chi-square, bins
    expecting < 5 pooled; fail iff p < 1e-6 (false-failure rate 1e-6 per case, 12 cases).
    """
    result = c.check_rules_case(method, drafts, rules, c.PROCESSINGS[0], SIZES.matrix_trials, SEED)
    assert result.passed, result.detail


@pytest.mark.parametrize("rules", list(c.RULE_SETS))
def test_penalties_with_top_k_keep_the_joint_law(rules):
    """The same H0, statistic, N and threshold (false-failure rate 1e-6 per case) with
    temperature 0.7 and top-k 3 after the rules (standard verification, sampled drafts)."""
    result = c.check_rules_case(
        "standard", "sampled", rules, c.PROCESSINGS[1], SIZES.matrix_trials, SEED
    )
    assert result.passed, result.detail


@pytest.mark.parametrize("method, drafts, rules, control", c.RULES_CONTROLS)
def test_penalty_law_rejects_a_verifier_blind_to_the_drafts(method, drafts, rules, control):
    """Negative control of the penalty checks (same setup, N = 40,000): every verify row is
    processed with the request's output alone, not with the drafts before it. Must give
    p < 1e-18."""
    result = c.check_rules_case(
        method, drafts, rules, c.PROCESSINGS[0], SIZES.matrix_trials, SEED, control=control
    )
    assert_rejected(result)


def test_coupled_with_penalties_is_plain_penalised_decoding():
    """Deterministic: coupled verification with penalties and bans emits exactly the tokens of
    plain penalised `sample` decoding with the same seeds (2 rule sets x 2 processings x 2
    drafters x 2 draft kinds, 100 requests x 8 tokens each). Threshold: 0 mismatches."""
    result = c.check_coupled_identity_rules(SIZES.identity_trials, SEED)
    assert result.passed, result.detail


def test_requests_are_invariant_to_batching():
    """Deterministic: alone == in a batch == permuted == padded (active_rows) == replayed, bit
    for bit, for `sample` (tokens and processed logits) and `verify` (3 methods x 2 draft
    kinds); padded rows draw no noise. Threshold: 0 failed comparisons."""
    result = c.check_invariance(SEED)
    assert result.passed, result.detail


def test_far_tail_resolution():
    """Exact, no sampling error: the tail mass that the sampler's word -> uniform -> Gumbel map
    gives 131,071 tokens 18 logits below the head is within 1e-4 (relative) of
    (V-1) e^-18 / (1 + (V-1) e^-18); its negative control, a 24-bit uniform map, is off by 44%."""
    result = c.check_far_tail_resolution()
    assert result.passed, result.detail
    assert_rejected(c.check_far_tail_resolution(control="24-bit"), margin=1000)


def test_far_tail_sampling_smoke():
    """End to end through `sample` (TARGET, DRAFT) and `verify` (RESIDUAL) at V = 131,072 with
    one head token and the rest 18 logits below; 576 rows, 1.15 tail tokens expected.
    H0: the tail count is Poisson with that mean; fail iff the exact two-sided p < 1e-6
    (false-failure rate <= 1e-6). Power is small at this size (it catches a gross excess only);
    `test_far_tail_resolution` carries the power for the resolution, the slow test more rows."""
    result = c.check_far_tail_sampling(SIZES.far_tail_rows, SEED)
    assert result.passed, result.detail


def test_check_results_report_their_verdicts():
    """Deterministic: a rejected negative control reads as passed=False, expected_to_pass=False,
    ok=True, and carries its control's name."""
    result = c.check_far_tail_resolution(control="24-bit")
    assert (result.passed, result.expected_to_pass, result.ok) == (False, False, True)
    assert result.name == "far-tail/resolution/24-bit"


@pytest.mark.slow
def test_full_audit():
    """The full `specdec audit` (N = 200,000 per matrix and penalty case, 400,000 adversarial,
    2,432 far-tail rows; 74 checks at false-failure rate <= 1e-6 each, so <= 7.4e-5 in all; 11
    negative controls that must all be rejected). About 3 minutes on one core."""
    results = c.run_audit(quick=False, seed=SEED)
    assert all(r.ok for r in results), [r.name for r in results if not r.ok]


@pytest.mark.slow
def test_far_tail_sampling_large():
    """The end-to-end far tail with 20,000 TARGET and 20,000 DRAFT rows (80 tail tokens
    expected, about 6 minutes on one core). H0: Poisson with that mean; fail iff the exact
    two-sided p < 1e-6 (false-failure rate <= 1e-6). Power: a total loss of the tail is always
    rejected, a doubled tail with probability 0.995, a halved one with probability 0.49."""
    result = c.check_far_tail_sampling({"TARGET": 20_000, "DRAFT": 20_000}, SEED)
    assert result.passed, result.detail


@pytest.mark.parametrize("drafts", c.DRAFT_KINDS)
@pytest.mark.parametrize("method", c.METHODS)
def test_structured_outputs_keep_the_constrained_law(method, drafts):
    """Structured outputs under speculation: V = 6 toy over byte-string tokens, every request
    constrained by a regex through the real llguidance matcher, K = 2, N = 4,000 requests run
    until each has emitted 4 tokens (two rounds or more). H0: the first 4 tokens follow
    norm(target x mask) at every position, masks from a hand-written automaton (1296
    sequences). Statistic: Pearson chi-square, bins expecting < 5 pooled, a token outside the
    language rejects; fail iff p < 1e-6 (false-failure rate 1e-6 per case, 6 cases)."""
    result = c.check_grammar_case(method, drafts, c.PROCESSINGS[0], SIZES.grammar_trials, SEED)
    assert result.passed, result.detail


@pytest.mark.parametrize("method, drafts, processing", c.GRAMMAR_EXTRA_CASES)
def test_structured_outputs_with_filters_keep_the_constrained_law(method, drafts, processing):
    """The same check (N = 4,000, p < 1e-6) with temperature and top-k / top-p / min-p after
    the mask, and greedy decoding."""
    result = c.check_grammar_case(method, drafts, processing, SIZES.grammar_trials, SEED)
    assert result.passed, result.detail


@pytest.mark.parametrize("method, drafts, control", c.GRAMMAR_CONTROLS)
def test_structured_output_law_rejects_broken_masking(method, drafts, control):
    """Negative controls (same setup, N = 4,000): verify rows masked at the output alone (the
    matcher not advanced over the drafts); drafts sampled from unmasked draft logits but
    verified with the masked law. Each must give p < 1e-18."""
    result = c.check_grammar_case(
        method, drafts, c.PROCESSINGS[0], SIZES.grammar_trials, SEED, control=control
    )
    assert_rejected(result)


def test_constrained_speculation_is_token_identical_to_constrained_plain():
    """Coupled verification (plain, t0.7+top_k) and greedy decoding (every method) under the
    regex constraint emit exactly plain constrained decoding's tokens with the same seeds
    (50 requests x 8 tokens per case, drafters near / adversarial, sampled / one-hot drafts).
    Deterministic: mismatches must be 0."""
    result = c.check_identity_grammar(SIZES.identity_trials // 2, SEED)
    assert result.passed, result.detail
