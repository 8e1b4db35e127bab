"""The speculation policy (`specdec.engine.spec_policy`): its arms (K = 0..max_k, and the plain
arm P with `plain_arm`), choosing the arm of most expected tokens per second once every arm is
measured, re-exploring the others, pinning K when not adaptive, and choosing from what was
already observed only (non-anticipating)."""

from __future__ import annotations

from specdec.engine.spec_policy import PLAIN, REQUEST_ACCEPTANCE_ROWS, SpeculationPolicy

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
    for _ in range(policy.ramp):  # a new visit: its first measured steps are not kept
        policy.observe(BUCKET, PLAIN, 7.0, [])
    policy.observe(BUCKET, PLAIN, 50.0, [])
    policy.observe(BUCKET, PLAIN, None, [])
    kept = policy.explore_run - policy.ramp
    assert policy.costs()[(BUCKET, PLAIN)] == (1.0, kept + 1)  # 1.0 (explored) ..., 50.0
    assert policy.choose(BUCKET) == PLAIN
    values = [1.0] * kept + [50.0]
    assert sum(values) / len(values) > seconds[2]  # a mean would have made PLAIN look worst


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


# --------------------------------------------------------------- a closed batch and its tail
def measured(policy: SpeculationPolicy, bucket: int, seconds: dict[int, float], a: float):
    """Explores every arm at `bucket` with the given costs, each round of K accepting draft i
    with chance `a` (as frequencies over 100 requests); returns the policy."""
    for _ in range(policy.explore_run * len(policy.arms)):
        k = policy.choose(bucket)
        outcomes = []
        if k > 0:  # 100 requests: 100 a^j of them accept j drafts or more
            reach = [round(100 * a**j) for j in range(k + 1)]
            outcomes = [
                (k, j)
                for j in range(k + 1)
                for _ in range(reach[j] - (reach[j + 1] if j < k else 0))
            ]
        policy.observe(bucket, k, seconds[k], outcomes)
    return policy


def test_expected_max_normal_matches_its_integral():
    from scipy import integrate, stats

    from specdec.engine.spec_policy import expected_max_normal

    for n in (1, 2, 3, 8, 20, 32, 64, 100, 256):
        exact = integrate.quad(
            lambda x, n=n: x * n * stats.norm.pdf(x) * stats.norm.cdf(x) ** (n - 1), -12, 12
        )[0]
        assert abs(expected_max_normal(n) - exact) < 0.03, (n, exact)


def test_round_tokens_mean_and_variance_of_the_accepted_run():
    """X = 1 + accepted drafts, P(X > i) = a^i (i <= K): mean and variance by enumeration."""
    policy = SpeculationPolicy(3)
    policy.observe(BUCKET, 3, None, [(3, 3)] * 6 + [(3, 2)] * 2 + [(3, 0)] * 2)
    a = [policy.acceptance(i) for i in range(3)]
    probs = [1 - a[0], a[0] * (1 - a[1]), a[0] * a[1] * (1 - a[2]), a[0] * a[1] * a[2]]
    mean = sum((j + 1) * p for j, p in enumerate(probs))
    var = sum((j + 1) ** 2 * p for j, p in enumerate(probs)) - mean**2
    got = policy.round_tokens(3)
    assert abs(got[0] - mean) < 1e-12 and abs(got[1] - var) < 1e-12
    assert policy.round_tokens(PLAIN) == (1.0, 0.0) and policy.round_tokens(0) == (1.0, 0.0)


def test_renewal_model_of_the_slowest_request_matches_simulation():
    """The expected rounds until the slowest of B requests has emitted n tokens (each round
    1 + accepted drafts, P(X > i) = a^i), against a simulation of 4,000 batches: within 4%."""
    import random

    rng = random.Random(5)
    policy = SpeculationPolicy(2)
    a = 0.6
    policy._offered, policy._accepted = [1.0, 1.0], [a, a]  # acceptance a at both positions
    for batch, n in ((1, 128), (8, 128), (32, 128), (32, 24), (64, 8)):
        total = 0
        for _ in range(4000):
            slowest = 0
            for _ in range(batch):
                emitted = rounds = 0
                while emitted < n:
                    x = 1
                    while x < 3 and rng.random() < a:
                        x += 1
                    emitted, rounds = emitted + x, rounds + 1
                slowest = max(slowest, rounds)
            total += slowest
        simulated = total / 4000
        predicted = policy.expected_steps(2, [n] * batch)
        assert abs(predicted - simulated) / simulated < 0.04, (batch, n, predicted, simulated)


def test_a_closed_large_batch_goes_plain_where_tokens_per_second_would_speculate():
    """Plain steps of 0.95 ms, K = 2 rounds of 1.52 ms and acceptance 0.4-0.5 a draft: a round
    brings ~1.66 tokens for 1.6x the cost, 1.04x plain in tokens per second, but a closed batch
    of 32 requests of 128 tokens waits for its slowest request and finishes sooner in plain
    steps; one request alone, or a batch whose freed slots are refilled (remaining unknown),
    speculates. Inside the rounds: no entry to pay."""
    seconds = {PLAIN: 0.95e-3, 0: 1.10e-3, 1: 1.36e-3, 2: 1.52e-3}
    policy = measured(SpeculationPolicy(2, plain_arm=True, explore_every=10**6), 32, seconds, 0.46)
    assert 1.6 < policy.expected_tokens(2) < 1.7
    assert policy.choose(32) == 2  # tokens per second
    assert policy.choose(32, [128] * 32) == PLAIN  # the closed batch's tail
    assert policy.choose(32, [128]) == 2  # one request: no tail
    steps = policy.expected_steps(2, [128] * 32)
    assert steps > 128 / policy.expected_tokens(2) + 4  # the tail is in the model


def test_entering_the_rounds_costs_what_was_measured():
    """Outside the rounds, a K pays the measured entry (the drafter's catch-up): a short batch
    stays plain when the entry eats the gain, and speculates once in the rounds (no entry) or
    when the batch is long enough to repay it."""
    seconds = {PLAIN: 1.0e-3, 0: 1.1e-3, 1: 1.2e-3, 2: 1.3e-3}
    policy = measured(SpeculationPolicy(2, plain_arm=True, explore_every=10**6), 1, seconds, 0.8)
    policy.observe_entry(1, 8e-3)
    assert policy.costs()[(1, "entry")] == (8e-3, 1)
    assert policy.choose(1, [16], in_rounds=True) == 2
    assert policy.choose(1, [16], in_rounds=False) == PLAIN
    assert policy.choose(1, [400], in_rounds=False) == 2


def test_exploring_across_the_rounds_border_costs_at_most_its_budget(monkeypatch):
    """In plain steps of 1 ms with an entry of 8 ms, rounds are re-explored only as the 1%
    budget pays for the way there and back: over 3,000 steps, the explorations' switches cost
    at most ~1% of the time, and some exploration happens. Negative control: the same policy
    with the budget check off explores every `explore_every` steps (10x more)."""
    seconds = {PLAIN: 1.0e-3, 0: 1.3e-3, 1: 1.5e-3, 2: 1.7e-3}

    def run(budget: bool) -> int:
        policy = measured(SpeculationPolicy(2, plain_arm=True), 32, seconds, 0.2)
        policy.observe_entry(32, 8e-3)
        if not budget:
            monkeypatch.setattr(SpeculationPolicy, "_may_explore", lambda *args: True)
        explorations, previous = 0, PLAIN
        for _ in range(3000):
            k = policy.choose(32, [500] * 32, in_rounds=previous != PLAIN)
            explorations += k != PLAIN and previous == PLAIN
            policy.observe(32, k, seconds[k], [] if k == PLAIN else [(k, 0)] * 32)
            previous = k
        return explorations

    with_budget, without = run(True), run(False)
    assert with_budget >= 1 and with_budget * 9e-3 <= 0.015 * 3000 * 1e-3
    assert without >= 10 * with_budget


def test_non_anticipating_with_a_horizon():
    """The budgets ahead are known before a step's drafts are drawn: the same observations and
    budgets give the same choice, and a choice made before a round is read does not depend on
    what the round then accepts."""
    seconds = {PLAIN: 0.95e-3, 0: 1.1e-3, 1: 1.2e-3, 2: 1.42e-3}
    a = measured(SpeculationPolicy(2, plain_arm=True, explore_every=10**6), 8, seconds, 0.7)
    b = measured(SpeculationPolicy(2, plain_arm=True, explore_every=10**6), 8, seconds, 0.7)
    horizon = [100, 90, 60, 100, 5, 77, 100, 100]
    assert a.choose(8, horizon) == b.choose(8, horizon) == 2
    for _ in range(30):
        a.observe(8, 2, seconds[2], [(2, 2)] * 8)
        b.observe(8, 2, seconds[2], [(2, 0)] * 8)
    assert a.choose(8, horizon) == 2 and b.choose(8, horizon) == PLAIN


def test_side_budget_keeps_the_cost_of_re_exploring_k_within_its_share():
    """Synchronous steps (the CPU): a K = 1 step costs 2.2 s for 1.5 tokens, a K = 0 step 1 s
    for 1, so exploring K = 1 for `explore_run` steps loses 5 x (2.2 - 1.5) = 3.5 s. With a 2%
    side budget over 2,000 steps (~2,000 s), the re-explorations lose at most ~2% of the time
    (and some happen); negative control: without the budget K = 1 is re-explored every
    `explore_every` steps, several times more."""
    seconds = {0: 1.0, 1: 2.2}

    def run(side_budget: float | None) -> int:
        policy = SpeculationPolicy(1, explore_every=20, side_budget=side_budget)
        explore(policy, seconds, accepted=0)  # every arm measured (K = 1: acceptance 0 so far)
        for _ in range(10):  # then acceptance 0.5: 1.5 tokens a K = 1 step
            policy.observe(BUCKET, 1, None, [(1, 1), (1, 0)])
        drafted = 0
        for _ in range(2000):
            k = policy.choose(BUCKET)
            drafted += k == 1
            policy.observe(BUCKET, k, seconds[k], [(1, 1), (1, 0)] if k else [])
        return drafted

    with_budget, without = run(0.02), run(None)
    loss_per_step = seconds[1] - 1.5 / 1.0
    assert with_budget >= 1 and with_budget * loss_per_step <= 0.025 * 2000
    assert without >= 5 * with_budget


def test_side_budget_a_new_bucket_starts_from_the_measured_ones():
    """Synchronous steps: batch 1 is explored arm by arm (K = 1 wins there: 1.6 tokens for 1.3 s
    against 1 for 1 s). At batch 8, where a K = 1 step costs 2.2x a K = 0 one, only K = 0 is
    measured first; K = 1 is then tried from batch 1's ratio, measured, and dropped: after the
    first 20 steps at batch 8 K = 0 runs (and K = 1 ran at most 5 + explore_run steps)."""
    policy = SpeculationPolicy(1, side_budget=0.02)
    small, large = {0: 1.0, 1: 1.3}, {0: 3.0, 1: 6.6}
    for _ in range(40):
        k = policy.choose(1)
        policy.observe(1, k, small[k], [(1, 1), (1, 1), (1, 0)] if k else [])
    assert policy.choose(1) == 1
    chosen = []
    for _ in range(60):
        k = policy.choose(8)
        chosen.append(k)
        policy.observe(8, k, large[k], [(1, 1), (1, 1), (1, 0)] if k else [])
    assert chosen[: policy.explore_run] == [0] * policy.explore_run  # the cheapest arm first
    assert 1 in chosen[:20]  # then K = 1 from batch 1's ratio
    assert chosen[20:] == [0] * 40
    assert chosen.count(1) <= 5 + policy.explore_run


def test_margin_keeps_k_0_unless_drafting_beats_it_by_more():
    """Synchronous steps (the CPU, `SYNC_SPEC_MARGIN`): K = 1 emits 1.5 tokens a step. At 1.45 s
    a step (3% more tokens per second than K = 0's 1 s) a 5% margin keeps K = 0, in the open
    and the closed-batch objectives; at 1.3 s (15% more) K = 1 is chosen. Negative control:
    without the margin K = 1 wins at 1.45 s too."""

    def choice(k1_seconds: float, margin: float, remaining: list[int] | None) -> int:
        policy = SpeculationPolicy(1, explore_every=10**6, side_budget=0.02, margin=margin)
        seconds = {0: 1.0, 1: k1_seconds}
        for _ in range(3 * policy.explore_run):  # every arm measured, acceptance 0.5
            k = policy.choose(BUCKET)
            policy.observe(BUCKET, k, seconds[k], [(1, 1), (1, 0)] if k else [])
        for _ in range(30):
            policy.observe(BUCKET, 1, None, [(1, 1), (1, 0)])
        return policy.choose(BUCKET, remaining)

    for remaining in (None, [200, 180]):
        assert choice(1.45, 0.05, remaining) == 0
        assert choice(1.30, 0.05, remaining) == 1
        assert choice(1.45, 0.0, remaining) == 1  # the negative control


def test_side_budget_counts_the_drafters_catch_up_after_k_0_steps(monkeypatch):
    """Synchronous steps (the CPU) with a drafter fed lazily: K = 1 emits 1.5 tokens for 1.6 s
    (K = 0: 1 token for 1 s, the best arm), and the first K = 1 step after K = 0 steps costs
    3 s more (the drafter's catch-up). Over 3,000 steps the time lost against K = 0 alone stays
    near the 2% side budget: the catch-up is measured and charged to each exploration. Negative
    control: with the catch-up not charged (as before s35), explorations are budgeted at what
    their steady steps lose and lose several times the budget."""
    seconds, catch_up = {0: 1.0, 1: 1.6}, 3.0

    def lost_share() -> float:
        policy = SpeculationPolicy(1, explore_every=20, side_budget=0.02)
        spent = emitted = 0.0
        last = 0
        for _ in range(3000):
            k = policy.choose(BUCKET)
            step = seconds[k] + (catch_up if k and not last else 0.0)
            spent += step
            emitted += 1.5 if k else 1.0
            policy.observe(BUCKET, k, step, [(1, 1), (1, 0)] if k else [])
            last = k
        return (spent - emitted * seconds[0]) / spent

    charged = lost_share()
    monkeypatch.setattr(SpeculationPolicy, "catch_up_seconds", lambda self, bucket, k: 0.0)
    uncharged = lost_share()
    assert charged <= 0.03, charged
    assert uncharged >= 3 * charged and uncharged > 0.05, (charged, uncharged)


def test_rounds_after_side_work_are_measured_within_their_visit():
    """A round launched after other device work (a joining request's prefill step) is measured
    by its interval less that work's span (`round_cost`) and stays in its visit: with such work
    before every round, each K's cost is still learned and the best K chosen (s42: such rounds
    were never measured, and with a step beside every round the policy kept K = 0 for 1,473 of
    1,664 rounds). Control: a span not measured (None) measures nothing."""
    from specdec.engine.device_round import round_cost

    assert round_cost(1.0, 2.0, [(1.25, 1.5), (1.5, 1.75)]) == 0.5
    assert round_cost(1.0, 2.0, []) == 1.0
    assert round_cost(None, 2.0, []) is None
    assert round_cost(1.0, 2.0, [(1.25, 1.5), None]) is None

    def run(policy: SpeculationPolicy, cost) -> None:
        previous = None
        for _ in range(policy.explore_run * len(policy.arms)):
            k = policy.choose(BUCKET)
            first = k != previous  # a visit's first round: no previous round, no cost
            seconds = None if first else cost(k)
            policy.observe(BUCKET, k, seconds, [(k, k)] * 4, interrupted=not first)
            previous = k

    policy = SpeculationPolicy(2, explore_every=1000)
    run(policy, lambda k: round_cost(0.0, 1.5 + 0.1 * k, [(0.2, 0.7)]))
    costs = policy.costs()
    assert all(abs(costs[(BUCKET, k)][0] - 1.0 - 0.1 * k) < 1e-9 for k in policy.arms), costs
    assert policy.choose(BUCKET) == 2  # every draft accepted: the longest pays
    blind = SpeculationPolicy(2, explore_every=1000)
    run(blind, lambda k: round_cost(0.0, 1.5 + 0.1 * k, [None]))
    assert not blind.costs()


def test_requests_beside_the_rounds_count_in_every_arms_tokens():
    """Rounds of K = 2 cost 1.3x a K = 0 round and bring 1.96 tokens a request (acceptance
    0.6): 8 requests alone speculate. Beside 56 requests that decode one token a cycle outside
    the rounds (their step part of both costs), the 8 requests' gain no longer pays for the
    dearer cycle: (1.96 + 7) / 1.3 < (1 + 7) / 1; beside 8, it still does. A closed batch
    waits for the longest request beside: 128 tokens left there take 128 cycles whatever K, so
    the cheapest cycle wins; 4 tokens left there do not hold the rounds' requests back."""
    seconds = {0: 1.0e-3, 1: 1.15e-3, 2: 1.3e-3}
    policy = measured(SpeculationPolicy(2, explore_every=10**6), BUCKET, seconds, 0.6)
    assert abs(policy.expected_tokens(2) - 1.96) < 0.02
    assert policy.choose(BUCKET) == 2
    assert policy.choose(BUCKET, beside=[100] * 8, rows=8) == 2
    assert policy.choose(BUCKET, beside=[100] * 56, rows=8) == 0
    assert policy.choose(BUCKET, [32] * 8) == 2
    assert policy.choose(BUCKET, [32] * 8, beside=[4] * 56, rows=8) == 2
    assert policy.choose(BUCKET, [32] * 8, beside=[128] * 56, rows=8) == 0
    assert policy.seconds_to_finish(BUCKET, 2, [32] * 8, True, 128) == 128 * seconds[2]


def test_a_step_weighs_the_acceptance_of_its_own_requests():
    """Two requests in turn at batch 1 (the CPU at c = 1): "a" accepts every draft, "b" none.
    K = 1 costs 1.6x a K = 0 step, so it pays for "a" (2 tokens) and loses for "b" (1 token).
    With each step's request named, the choice follows that request's own acceptance as soon as
    it has a few rounds; a new request starts from the pooled acceptance; a finished one is
    forgotten. Negative control: the same rounds recorded without their ids (the pooled
    acceptance only, which mixes both requests) deny "a" the drafts that pay for it."""

    def measured(requests_named: bool) -> SpeculationPolicy:
        policy = SpeculationPolicy(1, explore_every=10**6, side_budget=0.02, margin=0.05)
        seconds = {0: 1.0, 1: 1.6}
        for _ in range(2 * policy.explore_run):  # both arms measured on "a" and "b" in turn
            k = policy.choose(1)
            policy.observe(1, k, seconds[k], [])
        for _ in range(6):  # a few rounds of each (the pooled acceptance ends on "b"'s)
            for request_id, accepted in (("a", 1), ("b", 0)):
                ids = [request_id] if requests_named else None
                policy.observe(1, 1, None, [(1, accepted)], requests=ids)
        return policy

    policy = measured(requests_named=True)
    assert policy.request_acceptance("a")[0] > 0.8 and policy.request_acceptance("b")[0] < 0.2
    assert policy.choose(1, requests=["a"]) == 1
    assert policy.choose(1, requests=["b"]) == 0
    assert policy.choose(1, requests=["a", "b"]) == 0  # 1.5 tokens for 1.6x: not worth it
    pooled = policy.acceptance(0)  # outside a choice: pooled over both
    assert policy.request_acceptance("new") == [pooled]
    # Over REQUEST_ACCEPTANCE_ROWS requests a choice weighs the pooled acceptance (rows of "a"
    # stand for requests like it): up to that many, "a"'s; one more, the pooled.
    assert policy.choose(1, requests=["a"] * REQUEST_ACCEPTANCE_ROWS) == 1
    assert policy.choose(1, requests=["a"] * (REQUEST_ACCEPTANCE_ROWS + 1)) == 0
    policy.forget("a")
    assert policy.request_acceptance("a") == [pooled]
    # The negative control: the pooled acceptance alone.
    policy = measured(requests_named=False)
    assert policy.choose(1, requests=["a"]) == 0


def test_a_trees_arms_are_no_drafts_and_the_tree():
    """`tree`: the arms are K = 0 and the tree (K = its depth); a tree round's accepted path
    counts as a chain's accepted drafts, so the expected tokens a round follow its levels. The
    tree is chosen where its measured cost pays for its tokens, else no drafts."""
    policy = SpeculationPolicy(4, tree=True, explore_every=10**6)
    assert policy.arms == [0, 4]
    for _ in range(20):  # 100 requests a round, each accepting a path of 2 levels of 4
        policy.observe(1, 4, None, [(16, 2)] * 100)
    assert 2.8 < policy.expected_tokens(4) <= 3.0
    cheap = measured(SpeculationPolicy(4, tree=True, explore_every=10**6), 1, {0: 1.0, 4: 1.5}, 0)
    dear = measured(SpeculationPolicy(4, tree=True, explore_every=10**6), 1, {0: 1.0, 4: 3.5}, 0)
    for policy in (cheap, dear):
        for _ in range(20):
            policy.observe(1, 4, None, [(16, 2)] * 100)
    assert cheap.choose(1) == 4 and dear.choose(1) == 0
