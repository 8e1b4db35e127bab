"""The speculation policy (`specdec.engine.spec_policy`): its arms (K = 0..max_k, and the plain
arm P with `plain_arm`), choosing the arm of most expected tokens per second once every arm is
measured, re-exploring the others, pinning K when not adaptive, and choosing from what was
already observed only (non-anticipating)."""

from __future__ import annotations

from specdec.engine.spec_policy import PLAIN, SpeculationPolicy

BUCKET = 8


def explore(policy: SpeculationPolicy, seconds: dict[int, float], accepted: int) -> list[int]:
    """Runs the policy's first rounds (every arm `explore_run` times in a row), observing each
    with its cost and, for K > 0, `accepted` drafts accepted per request (of 4 requests)."""
    chosen = []
    for _ in range(policy.explore_run * len(policy.arms)):
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
    policy = SpeculationPolicy(3, plain_arm=True, explore_every=20)
    seconds = {PLAIN: 1.0, 0: 1.3, 1: 1.5, 2: 1.7, 3: 1.9}
    chosen = explore(policy, seconds, accepted=0)
    assert sorted(set(chosen)) == [PLAIN, 0, 1, 2, 3]  # each arm measured
    assert policy.expected_tokens(PLAIN) == 1.0
    after = []
    for _ in range(40):
        k = policy.choose(BUCKET)
        after.append(k)
        policy.observe(BUCKET, k, seconds[k], [] if k == PLAIN else [(k, 0)] * 4)
    assert after.count(PLAIN) >= 40 - 2 * policy.explore_run
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


def test_an_explored_arm_runs_explore_run_rounds_in_a_row():
    policy = SpeculationPolicy(3, plain_arm=True, explore_every=10)
    seconds = {PLAIN: 1.0, 0: 1.3, 1: 1.5, 2: 1.7, 3: 1.9}
    chosen = explore(policy, seconds, accepted=0)
    runs = [chosen[i : i + policy.explore_run] for i in range(0, len(chosen), policy.explore_run)]
    assert [set(run) for run in runs] == [{k} for k in policy.arms]
    later = []
    for _ in range(30):
        k = policy.choose(BUCKET)
        later.append(k)
        policy.observe(BUCKET, k, seconds[k], [] if k == PLAIN else [(k, 0)] * 4)
    explored = [i for i, k in enumerate(later) if k != PLAIN]
    assert explored  # a re-exploration happened, as a run of explore_run rounds
    first = explored[0]
    assert later[first : first + policy.explore_run] == [later[first]] * policy.explore_run


def test_a_cost_is_the_median_of_recent_measurements_and_unmeasured_rounds_do_not_count():
    """One measurement that holds a graph capture or a pause (50x) does not change the choice;
    rounds observed without a cost (the first of a visit) leave the cost alone. Negative
    control: the same outlier in a running mean (the estimate before) would flip it."""
    policy = SpeculationPolicy(2, plain_arm=True, explore_every=1000)
    seconds = {PLAIN: 1.0, 0: 1.3, 1: 1.4, 2: 1.5}
    explore(policy, seconds, accepted=0)
    assert policy.choose(BUCKET) == PLAIN
    policy.observe(BUCKET, PLAIN, 50.0, [])
    policy.observe(BUCKET, PLAIN, None, [])
    assert policy.costs()[(BUCKET, PLAIN)] == (1.0, 3)  # kept: 1.0, 1.0 (explored), 50.0
    assert policy.choose(BUCKET) == PLAIN
    kept = [1.0, 1.0, 50.0]
    assert sum(kept) / len(kept) > seconds[2]  # a mean would have made PLAIN look worst


def test_acceptance_weighs_every_request_of_a_round_alike():
    """A round of 32 requests, the first 20 accepting their draft and the last 12 not: the
    acceptance of draft 0 is 20/32 whatever the order of the rows. Negative control: a running
    average over requests (decay per row, as before) is led by the last rows and reads < 0.3."""
    policy = SpeculationPolicy(2)
    outcomes = [(2, 1)] * 20 + [(2, 0)] * 12
    policy.observe(BUCKET, 2, 1.0, outcomes)
    assert abs(policy.acceptance(0) - 20 / 32) < 1e-12
    assert policy.acceptance(1) == 0.0  # the 20 that reached draft 1 all rejected it
    reversed_order = SpeculationPolicy(2)
    reversed_order.observe(BUCKET, 2, 1.0, outcomes[::-1])
    assert reversed_order.acceptance(0) == policy.acceptance(0)
    offered = accepted = 0.0
    for _, hit in outcomes:  # the per-row running average
        offered, accepted = 0.9 * offered + 0.1, 0.9 * accepted + 0.1 * hit
    assert accepted / offered < 0.3
