"""The audit's checks of constrained sampling (check_*): penalties, biases and bans (`RULE_SETS`)
and grammars, speculative against plain decoding and the exact constrained laws, on the matrix
toy of `checks.py`. It never patches code itself or creates randomness.
"""

from __future__ import annotations

import torch

from specdec.audit.checks import (
    LOG10_ALPHA,
    MATRIX_KEY,
    MATRIX_VOCAB,
    CheckResult,
    _minus_log10,
    _result,
    matrix_toy,
)
from specdec.audit.controls import control_setup
from specdec.audit.drivers import (
    plain_decode,
    speculative_decode,
    start_positions,
    toy_grammar_matchers,
    trial_seeds,
)
from specdec.audit.laws import (
    DRAFT_KINDS,
    GRAMMAR_TOKENS,
    GREEDY,
    METHODS,
    PROCESSINGS,
    RULE_SETS,
    MarkovToy,
    Processing,
    grammar_joint_probs,
    markov_toy,
    rules_joint_probs,
    sequence_codes,
)
from specdec.audit.statistics import chi_square

RULES_NUM_DRAFT = 2
RULES_LENGTH = 4  # with K = 2, the first 4 tokens always span two rounds or more


def check_rules_case(
    method: str,
    drafts: str,
    rules_name: str,
    processing: Processing,
    num_trials: int,
    seed: int,
    *,
    control: str | None = None,
) -> CheckResult:
    """Penalties and bans under speculation: the joint law of emitted sequences.

    Setup: the matrix's V = 5 bigram toy (near drafter), prompt `laws.PROMPT`, the rule set
    `rules_name` of `laws.RULE_SETS` on every request (penalties and a logit bias; or
    allowed_token_ids, multi-token bad words, min_tokens and a negative presence penalty),
    K = 2, N requests run until each has emitted 4 tokens (two rounds or more). Draft i is
    processed with drafts 0..i-1 as context and verify row j with drafts 0..j-1, as the engine
    does. H0: the first 4 tokens follow plain penalised sampling's exact law
    (`rules_joint_probs`, from an independent float64 twin of the rules; 625 sequences).
    Statistic: Pearson chi-square (bins expecting < 5 pooled), as -log10 p; rejected iff
    p < 1e-6 (false-failure rate 1e-6).

    Args:
        control: None or "no_draft_prefix" (verify rows processed without the drafts before
            them), which must be rejected.
    """
    toy = matrix_toy()
    rules = RULE_SETS[rules_name]
    name = f"rules/{rules_name}/{method}/{drafts}/{processing.name}"
    seeds = trial_seeds(f"{name}/{control}", seed, num_trials)
    patch, draft_key = control_setup(control, method)
    with patch:
        run = speculative_decode(
            toy,
            processing,
            seeds,
            start_positions(num_trials),
            method=method,
            drafts=drafts,
            num_draft=RULES_NUM_DRAFT,
            num_tokens=RULES_LENGTH,
            draft_key=draft_key,
            rules=rules,
        )
    law = rules_joint_probs(toy, processing, rules, RULES_LENGTH)
    test = chi_square(
        torch.bincount(sequence_codes(run.tokens, MATRIX_VOCAB), minlength=law.numel()), law
    )
    return _result(
        name,
        _minus_log10(test.log10_p),
        LOG10_ALPHA,
        f"-log10 p; {test.describe()}, {run.num_rounds} rounds",
        control=control,
    )


def check_coupled_identity_rules(num_trials: int, seed: int) -> CheckResult:
    """Coupled verification with penalties and bans equals plain penalised decoding token for
    token: every rule set of `laws.RULE_SETS`, drafters near / adversarial, draft kinds sampled
    / one-hot, processings plain and t0.7+top_k; V = 5 toy, K = 3, 8 tokens per request over
    several rounds, against `sample` with the same rules, seeds and positions. Deterministic:
    the statistic counts mismatched tokens and must be 0.
    """
    mismatches, compared = 0, 0
    positions = start_positions(num_trials)
    for drafter in ("near", "adversarial"):
        toy = markov_toy(MATRIX_VOCAB, MATRIX_KEY, draft=drafter)
        for rules_name, rules in RULE_SETS.items():
            for processing in PROCESSINGS[:2]:
                key = f"identity-rules/{drafter}/{rules_name}/{processing.name}"
                seeds = trial_seeds(key, seed, num_trials)
                plain = plain_decode(toy, processing, seeds, positions, 8, rules=rules)
                for drafts in DRAFT_KINDS:
                    spec = speculative_decode(
                        toy,
                        processing,
                        seeds,
                        positions,
                        method="coupled",
                        drafts=drafts,
                        num_draft=3,
                        num_tokens=8,
                        rules=rules,
                    )
                    mismatches += int((spec.tokens != plain).sum())
                    compared += plain.numel()
    return _result(
        "identity/coupled==plain/rules",
        mismatches,
        0,
        f"mismatched tokens; out of {compared} (2 rule sets x 2 processings x 2 drafters x 2 "
        "draft kinds)",
    )


GRAMMAR_NUM_DRAFT = 2
GRAMMAR_LENGTH = 4  # with K = 2, the first 4 tokens always span two rounds or more
GRAMMAR_KEY = 20261201


def grammar_toy(draft: str = "near") -> MarkovToy:
    """The bigram toy over `laws.GRAMMAR_TOKENS` (V = 6) of the structured-output checks."""
    return markov_toy(len(GRAMMAR_TOKENS), GRAMMAR_KEY, draft=draft)


def check_grammar_case(
    method: str,
    drafts: str,
    processing: Processing,
    num_trials: int,
    seed: int,
    *,
    control: str | None = None,
) -> CheckResult:
    """Structured outputs under speculation: the joint law of emitted sequences.

    Setup: the V = 6 bigram toy over `laws.GRAMMAR_TOKENS` (near drafter), every request
    constrained by `laws.GRAMMAR_REGEX` through the real grammar code (an llguidance matcher per
    request in the `LogitsContext`), K = 2, N requests run until each has emitted 4 tokens (two
    rounds or more; the matcher follows each round's emitted tokens). Draft i is masked after
    drafts 0..i-1 and verify row j after drafts 0..j-1. H0: the first 4 tokens follow
    norm(target x mask) at every position (`grammar_joint_probs`, masks from a hand-written
    automaton; 1296 sequences). Statistic: Pearson chi-square (bins expecting < 5 pooled; a
    token outside the language rejects outright), as -log10 p; rejected iff p < 1e-6
    (false-failure rate 1e-6).

    Args:
        control: None, "no_draft_prefix" (verify rows masked at the output alone: the matcher
            not advanced over the drafts) or "unmasked_drafts" (drafts sampled from unmasked
            draft logits, verified with the masked ones as their law); both must be rejected.
    """
    toy = grammar_toy()
    name = f"grammar/{method}/{drafts}/{processing.name}"
    seeds = trial_seeds(f"{name}/{control}", seed, num_trials)
    patch, draft_key = control_setup(None if control == "unmasked_drafts" else control, method)
    with patch:
        run = speculative_decode(
            toy,
            processing,
            seeds,
            start_positions(num_trials),
            method=method,
            drafts=drafts,
            num_draft=GRAMMAR_NUM_DRAFT,
            num_tokens=GRAMMAR_LENGTH,
            draft_key=draft_key,
            grammars=toy_grammar_matchers(num_trials),
            unmasked_drafts=control == "unmasked_drafts",
        )
    law = grammar_joint_probs(toy, processing, GRAMMAR_LENGTH)
    test = chi_square(
        torch.bincount(sequence_codes(run.tokens, toy.vocab_size), minlength=law.numel()), law
    )
    return _result(
        name,
        _minus_log10(test.log10_p),
        LOG10_ALPHA,
        f"-log10 p; {test.describe()}, {run.num_rounds} rounds",
        control=control,
    )


def check_identity_grammar(num_trials: int, seed: int) -> CheckResult:
    """Constrained speculation against constrained plain decoding, token for token: coupled
    verification (processings plain and t0.7+top_k) and greedy decoding (every method), with
    drafters near / adversarial and draft kinds sampled / one-hot; the grammar toy, K = 3,
    8 tokens per request over several rounds, the same seeds and positions. Deterministic: the
    statistic counts mismatched tokens and must be 0.
    """
    mismatches, compared = 0, 0
    positions = start_positions(num_trials)
    cases = [("coupled", p) for p in PROCESSINGS[:2]] + [(m, GREEDY) for m in METHODS]
    for drafter in ("near", "adversarial"):
        toy = grammar_toy(drafter)
        for method, processing in cases:
            key = f"identity-grammar/{drafter}/{method}/{processing.name}"
            seeds = trial_seeds(key, seed, num_trials)
            plain = plain_decode(
                toy, processing, seeds, positions, 8, grammars=toy_grammar_matchers(num_trials)
            )
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
                    grammars=toy_grammar_matchers(num_trials),
                )
                mismatches += int((spec.tokens != plain).sum())
                compared += plain.numel()
    return _result(
        "identity/constrained-spec==plain",
        mismatches,
        0,
        f"mismatched tokens; out of {compared} (coupled x 2 processings and greedy x 3 methods, "
        "2 drafters x 2 draft kinds)",
    )
