"""The audit: its sample sizes (FULL_SIZES, QUICK_SIZES), the list of checks (audit_checks) and
run_audit, which runs them in order and reports each result as it completes. It times checks
and nothing else: no statistics, draws or patches of its own.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

from specdec.audit.checks import (
    CheckResult,
    check_adversarial,
    check_block_beats_standard,
    check_block_rounds,
    check_coupled_identity,
    check_far_tail_resolution,
    check_far_tail_sampling,
    check_invariance,
    check_matrix_case,
)
from specdec.audit.checks_constraints import (
    check_coupled_identity_rules,
    check_grammar_case,
    check_identity_grammar,
    check_rules_case,
)
from specdec.audit.laws import DRAFT_KINDS, GREEDY, METHODS, PROCESSINGS, RULE_SETS


@dataclass(frozen=True, slots=True)
class AuditSizes:
    """Sample sizes of one audit run (thresholds do not change with them, only power)."""

    matrix_trials: int
    adversarial_trials: int
    block_rounds_trials: int
    identity_trials: int
    far_tail_rows: dict[str, int]
    grammar_trials: int = 4_000


FULL_SIZES = AuditSizes(
    matrix_trials=200_000,
    adversarial_trials=400_000,
    block_rounds_trials=100_000,
    identity_trials=500,
    far_tail_rows={"TARGET": 1024, "DRAFT": 1024, "RESIDUAL": 384},
    grammar_trials=20_000,
)
QUICK_SIZES = AuditSizes(
    matrix_trials=40_000,
    adversarial_trials=200_000,
    block_rounds_trials=20_000,
    identity_trials=100,
    far_tail_rows={"TARGET": 256, "DRAFT": 256, "RESIDUAL": 64},
    grammar_trials=4_000,
)

# Negative controls of the joint-law check: (method, draft kind, control).
MATRIX_CONTROLS = (
    ("standard", "sampled", "shared_noise"),
    ("standard", "one_hot", "residual_from_target"),
    ("block", "one_hot", "position_keyed"),
)
# Negative controls of the penalty checks: (method, draft kind, rule set, control).
RULES_CONTROLS = (
    ("standard", "sampled", "penalties", "no_draft_prefix"),
    ("block", "one_hot", "bans", "no_draft_prefix"),
)
# Structured outputs: the processings checked beyond plain (method, draft kind, processing),
# and the negative controls (method, draft kind, control).
GRAMMAR_EXTRA_CASES = (
    ("standard", "sampled", PROCESSINGS[1]),
    ("block", "sampled", PROCESSINGS[2]),
    ("coupled", "sampled", PROCESSINGS[3]),
    ("standard", "one_hot", GREEDY),
)
GRAMMAR_CONTROLS = (
    ("standard", "sampled", "no_draft_prefix"),
    ("block", "sampled", "unmasked_drafts"),
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
    checks += [
        partial(check_rules_case, method, drafts, rules, PROCESSINGS[0], matrix, seed)
        for method in METHODS
        for drafts in DRAFT_KINDS
        for rules in RULE_SETS
    ]
    checks += [
        partial(check_rules_case, "standard", "sampled", rules, PROCESSINGS[1], matrix, seed)
        for rules in RULE_SETS
    ]
    checks += [
        partial(check_rules_case, method, drafts, rules, PROCESSINGS[0], matrix, seed, control=c)
        for method, drafts, rules, c in RULES_CONTROLS
    ]
    grammar = sizes.grammar_trials
    checks += [
        partial(check_grammar_case, method, drafts, PROCESSINGS[0], grammar, seed)
        for method in METHODS
        for drafts in DRAFT_KINDS
    ]
    checks += [
        partial(check_grammar_case, method, drafts, processing, grammar, seed)
        for method, drafts, processing in GRAMMAR_EXTRA_CASES
    ]
    checks += [
        partial(check_grammar_case, method, drafts, PROCESSINGS[0], grammar, seed, control=c)
        for method, drafts, c in GRAMMAR_CONTROLS
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
        partial(check_coupled_identity_rules, sizes.identity_trials, seed),
        partial(check_identity_grammar, sizes.identity_trials // 2, seed),
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
