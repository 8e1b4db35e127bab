"""The speculation policy (`specdec.engine.spec_policy`): its arms (K = 0..max_k, and the plain
arm P with `plain_arm`), choosing the arm of most expected tokens per second once every arm is
measured, re-exploring the others, pinning K when not adaptive, and choosing from what was
already observed only (non-anticipating)."""

from __future__ import annotations

from specdec.engine.spec_policy import PLAIN, SpeculationPolicy

BUCKET = 8


def explore(policy: SpeculationPolicy, seconds: dict[int, float], accepted: int) -> list[int]:
    """Runs the policy's first rounds (every arm twice), observing each with its cost and, for
    K > 0, `accepted` drafts accepted per request (of 4 requests)."""
    chosen = []
    for _ in range(2 * len(policy.arms)):
        k = policy.choose(BUCKET)
        chosen.append(k)
        outcomes = [] if k == PLAIN else [(k, min(accepted, k))] * 4
        policy.observe(BUCKET, k, seconds[k], outcomes)
    return chosen


def test_arms():
    assert SpeculationPolicy(3).arms == [0, 1, 2, 3]
    assert SpeculationPolicy(3, plain_arm=True).arms == [PLAIN, 0, 1, 2, 3]
    assert SpeculationPolicy(3, adaptive=False, plain_arm=True).arms == [0, 1, 2, 3]


def test_not_adaptive_pins_k_and_never_goes_plain():
    policy = SpeculationPolicy(3, adaptive=False, plain_arm=True)
    for _ in range(100):
        k = policy.choose(BUCKET)
        assert k == 3
        policy.observe(BUCKET, k, 1.0, [(3, 0)] * 4)
    assert policy.chosen == {3: 100}


def test_plain_arm_wins_when_rounds_cost_more_than_plain_steps_and_drafts_fail():
    # A K = 0 round costs more than a plain step (as measured on the H200 at batch >= 8).
    policy = SpeculationPolicy(3, plain_arm=True, explore_every=10)
    seconds = {PLAIN: 1.0, 0: 1.3, 1: 1.5, 2: 1.7, 3: 1.9}
    chosen = explore(policy, seconds, accepted=0)
    assert sorted(set(chosen)) == [PLAIN, 0, 1, 2, 3]  # each arm measured
    assert policy.expected_tokens(PLAIN) == 1.0
    after = []
    for _ in range(40):
        k = policy.choose(BUCKET)
        after.append(k)
        policy.observe(BUCKET, k, seconds[k], [] if k == PLAIN else [(k, 0)] * 4)
    assert after.count(PLAIN) >= 35
    assert set(after) - {PLAIN}  # the other arms are re-explored now and then


def test_speculation_wins_when_drafts_are_accepted():
    policy = SpeculationPolicy(3, plain_arm=True)
    seconds = {PLAIN: 1.0, 0: 1.3, 1: 1.35, 2: 1.4, 3: 1.45}
    explore(policy, seconds, accepted=3)
    assert policy.choose(BUCKET) == 3


def test_without_the_plain_arm_p_is_never_chosen():
    policy = SpeculationPolicy(3)
    seconds = {0: 1.3, 1: 1.5, 2: 1.7, 3: 1.9}
    chosen = explore(policy, seconds, accepted=0)
    assert PLAIN not in chosen and policy.choose(BUCKET) == 0


def test_non_anticipating_a_choice_depends_only_on_what_was_observed_before_it():
    """Two policies fed the same observations choose the same arms up to the first
    observation where they differ, whatever comes after it; the choice made before a round is
    observed is the same whether that round then accepts everything or nothing."""
    seconds = {PLAIN: 1.0, 0: 1.3, 1: 1.35, 2: 1.4, 3: 1.45}
    a, b = SpeculationPolicy(3, plain_arm=True), SpeculationPolicy(3, plain_arm=True)
    explore(a, seconds, accepted=1)
    explore(b, seconds, accepted=1)
    assert a.choose(BUCKET) == b.choose(BUCKET)  # made before the rounds below are observed
    for _ in range(20):  # then a's rounds accept everything, b's nothing
        a.observe(BUCKET, 3, seconds[3], [(3, 3)] * 4)
        b.observe(BUCKET, 3, seconds[3], [(3, 0)] * 4)
    # Only now may they differ, and they do (the test could fail).
    assert a.choose(BUCKET) == 3 and b.choose(BUCKET) == PLAIN
