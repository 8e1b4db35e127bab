"""Through the whole engine, on a tiny real model: the first emitted tokens of speculative decoding
follow plain sampling's distribution exactly.

A 3-layer Llama with an 8-token vocabulary (seeded random weights) is the target; the draft is the
target truncated to its first layer. For each (method, draft sampling), N independent seeded
requests emit 3 tokens each; the joint law of those 3 tokens (512 cells) is compared with the exact
law computed from the target's own logits.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from scipy import stats as scipy_stats

from law_fixtures import (
    RULES,
    VOCAB,
    exact_continuation_law,
    first_token_counts,
    rules_law,
    save_vocab8_target,
)
from specdec.drafters.base import Drafter
from specdec.models import load_model
from specdec.sampling import SampleOutput

pytestmark = pytest.mark.stats

NUM_TOKENS = 3
NUM_TRIALS = 12_000
ALPHA = 1e-6


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_vocab8_target(tmp_path_factory.mktemp("vocab8"))


def exact_law(model_dir, temperature: float) -> torch.Tensor:
    """[V ** 3] float64 probability of each 3-token continuation under the processed target."""
    return exact_continuation_law(model_dir, temperature, NUM_TOKENS)


def emitted_counts(
    model_dir, spec, temperature: float, max_tokens: int = NUM_TOKENS, **engine_args
) -> torch.Tensor:
    counts, metrics = first_token_counts(
        model_dir, spec, temperature, max_tokens, NUM_TOKENS, NUM_TRIALS, engine_args
    )
    assert metrics["num_accepted_tokens"] > 0
    if engine_args.get("async_scheduling"):
        assert metrics["loop"]["num_device_rounds"] > 0  # the rounds ran on the device path
    return counts


def chi_square_pvalue(counts: torch.Tensor, law: torch.Tensor) -> float:
    """Pearson chi-square p-value after merging cells with expected count < 5 into one."""
    expected = law * counts.sum()
    small = expected < 5
    obs = torch.cat([counts[~small], counts[small].sum().reshape(1)])
    exp = torch.cat([expected[~small], expected[small].sum().reshape(1)])
    keep = exp > 0
    return float(
        scipy_stats.chisquare(obs[keep], exp[keep] * obs[keep].sum() / exp[keep].sum()).pvalue
    )


def spec_config(method: str, draft_sample_method: str) -> dict:
    return {
        "method": "draft_model",
        "model": "truncated:1",
        "num_speculative_tokens": 2,
        "rejection_sample_method": method,
        "draft_sample_method": draft_sample_method,
    }


SLOW = pytest.mark.slow  # a case whose verifier or drafter the default CI run checks elsewhere


@pytest.mark.parametrize(
    ("method", "draft_sample_method"),
    [
        ("standard", "probabilistic"),
        ("block", "probabilistic"),
        ("coupled", "probabilistic"),
        pytest.param("standard", "greedy", marks=SLOW),
        pytest.param("block", "greedy", marks=SLOW),
        ("coupled", "greedy"),
    ],
)
def test_first_tokens_follow_the_target(model_dir, method, draft_sample_method):
    """H0: the engine's first 3 emitted tokens have the target's exact joint law.
    Statistic: Pearson chi-square over the 512 cells (cells with expected count < 5 merged),
    N = 12,000 seeded requests, temperature 0.7; reject at p < 1e-6, so the false-failure rate
    is <= 1e-6 per case (6 cases; two greedy-draft ones run with the slow tests)."""
    law = exact_law(model_dir, 0.7)
    counts = emitted_counts(model_dir, spec_config(method, draft_sample_method), 0.7)
    assert chi_square_pvalue(counts, law) > ALPHA


def test_negative_control_verifier_given_the_raw_draft_distribution(model_dir, monkeypatch):
    """The same test must reject an engine whose verifier is given the draft's raw logits rather
    than the temperature-processed logits the draft was sampled from (the bug of HF #47932).

    Run at temperature 1.6, where raw and processed draft distributions of this model differ
    most; at that temperature the correct engine passes the same check first (p > 1e-6) and the
    broken one must give p < 1e-6 (seen: p underflows to 0)."""
    law = exact_law(model_dir, 1.6)
    spec = spec_config("standard", "probabilistic")
    assert chi_square_pvalue(emitted_counts(model_dir, spec, 1.6), law) > ALPHA
    real = Drafter.sample_draft

    def wrong_distribution(self, logits, rows, positions, batch):
        out = real(self, logits, rows, positions, batch)
        raw = self.to_target_vocab(logits)
        return SampleOutput(out.token_ids, raw, raw.logsumexp(dim=-1))

    monkeypatch.setattr(Drafter, "sample_draft", wrong_distribution)
    assert chi_square_pvalue(emitted_counts(model_dir, spec, 1.6), law) < ALPHA


@pytest.fixture(scope="module")
def eagle_dir(model_dir, tmp_path_factory):
    """An untrained EAGLE head (keyed init) over the target's last layer: its drafts differ from
    the target's, so rounds both accept and reject."""
    from specdec.train.kind import TrainOptions
    from specdec.train.kinds.eagle import EagleKind

    target = load_model(model_dir).model
    kind, options = EagleKind(), TrainOptions(seed=5)
    kind.prepare(target, torch.zeros(VOCAB, dtype=torch.int64), options)
    out = tmp_path_factory.mktemp("eagle-vocab8")
    kind.save(kind.build(target, options), target, out, options)
    return out


def eagle_config(eagle_dir, method: str) -> dict:
    return {
        "method": "eagle",
        "model": str(eagle_dir),
        "num_speculative_tokens": 2,
        "rejection_sample_method": method,
    }


@pytest.mark.parametrize("method", ["standard", pytest.param("block", marks=SLOW), "coupled"])
def test_eagle_first_tokens_follow_the_target(model_dir, eagle_dir, method):
    """H0: with the EAGLE drafter (probabilistic drafts), the engine's first 3 emitted tokens have
    the target's exact joint law. Same statistic, N = 12,000 and threshold as above: Pearson
    chi-square over 512 cells at temperature 0.7, reject at p < 1e-6 (false-failure rate
    <= 1e-6 per case, 3 cases; block runs with the slow tests)."""
    law = exact_law(model_dir, 0.7)
    counts = emitted_counts(model_dir, eagle_config(eagle_dir, method), 0.7)
    assert chi_square_pvalue(counts, law) > ALPHA


def test_negative_control_eagle_verifier_given_the_raw_draft_distribution(
    model_dir, eagle_dir, monkeypatch
):
    """The EAGLE test has power: it rejects (p < 1e-6) an engine whose verifier gets the head's
    raw logits instead of the temperature-processed ones it sampled from (temperature 1.6)."""
    law = exact_law(model_dir, 1.6)
    real = Drafter.sample_draft

    def wrong_distribution(self, logits, rows, positions, batch):
        out = real(self, logits, rows, positions, batch)
        raw = self.to_target_vocab(logits)
        return SampleOutput(out.token_ids, raw, raw.logsumexp(dim=-1))

    monkeypatch.setattr(Drafter, "sample_draft", wrong_distribution)
    counts = emitted_counts(model_dir, eagle_config(eagle_dir, "standard"), 1.6)
    assert chi_square_pvalue(counts, law) < ALPHA


@pytest.mark.parametrize(
    ("drafter", "method"),
    [
        pytest.param("draft_model", "standard", marks=SLOW),
        pytest.param("eagle", "block", marks=SLOW),
        ("eagle", "coupled"),
    ],
)
def test_device_rounds_with_adaptive_k_follow_the_target(model_dir, eagle_dir, drafter, method):
    """H0: through speculative rounds on the device (asynchronous scheduling; op by op on the
    CPU) with the adaptive policy choosing K in [0, 2] round by round, the first 3 emitted tokens
    still have the target's exact joint law (requests run to 6 tokens, so that rounds past the
    first decide some of the 3). Same statistic, N and threshold as above (Pearson chi-square,
    512 cells, temperature 0.7, reject at p < 1e-6: false-failure rate <= 1e-6 per case, 3
    cases; the draft model with standard and EAGLE with block run with the slow tests)."""
    if drafter == "eagle":
        spec = eagle_config(eagle_dir, method)
    else:
        spec = spec_config(method, "probabilistic")
    spec["adaptive"] = True
    law = exact_law(model_dir, 0.7)
    counts = emitted_counts(model_dir, spec, 0.7, 6, async_scheduling=True)
    assert chi_square_pvalue(counts, law) > ALPHA


def test_negative_control_device_rounds_reading_a_stale_anchor(model_dir, monkeypatch):
    """The device-round test has power: it rejects (p < 1e-6; seen: 1e-87) rounds whose next
    round reads the previous round's anchor instead of advancing it past the emitted tokens
    (positions, cache slots and keys then repeat). Temperature 0.7, requests of 6 tokens.
    (Reading a stale input token instead barely moves this model's law, p = 0.12: the equality
    test in tests/unit/engine/test_device_rounds.py is the control for that one.)"""
    from specdec.engine import device_round

    finish_round = device_round.finish_round

    def stale_anchor(token_ids, num_accepted, live, results, anchors, last_tokens):
        before = anchors.clone()
        finish_round(token_ids, num_accepted, live, results, anchors, last_tokens)
        anchors.copy_(before)

    monkeypatch.setattr(device_round, "finish_round", stale_anchor)
    law = exact_law(model_dir, 0.7)
    spec = {**spec_config("standard", "probabilistic"), "adaptive": False}
    counts = emitted_counts(model_dir, spec, 0.7, 6, async_scheduling=True)
    assert chi_square_pvalue(counts, law) < ALPHA


def rules_counts(
    model_dir, spec, temperature: float, max_tokens: int = NUM_TOKENS, **engine_args
) -> torch.Tensor:
    counts, metrics = first_token_counts(
        model_dir, spec, temperature, max_tokens, NUM_TOKENS, NUM_TRIALS, engine_args, **RULES
    )
    assert metrics["num_accepted_tokens"] > 0
    if engine_args.get("async_scheduling"):
        assert metrics["loop"]["num_device_rounds"] > 0  # the rounds ran on the device path
    return counts


@pytest.mark.parametrize(
    "method, draft_sample_method",
    [
        ("standard", "probabilistic"),
        pytest.param("block", "probabilistic", marks=SLOW),
        ("coupled", "probabilistic"),
        pytest.param("standard", "greedy", marks=SLOW),
    ],
)
def test_penalised_first_tokens_follow_plain_penalised_sampling(
    model_dir, method, draft_sample_method
):
    """H0: with repetition/presence/frequency penalties, a logit bias, allowed_token_ids and
    min_tokens on every request, the engine's first 3 emitted tokens (K = 2, two rounds or
    more) have plain penalised sampling's exact joint law (from the audit's independent float64
    twin of the rules). Statistic: Pearson chi-square over the 512 cells (expected < 5 merged),
    N = 12,000, temperature 0.7; reject at p < 1e-6 (false-failure rate <= 1e-6 per case, 4
    cases; two run with the slow tests)."""
    law = rules_law(model_dir, 0.7, NUM_TOKENS)
    counts = rules_counts(model_dir, spec_config(method, draft_sample_method), 0.7)
    assert chi_square_pvalue(counts, law) > ALPHA


@pytest.mark.parametrize("method", ["standard", pytest.param("block", marks=pytest.mark.slow)])
def test_penalised_device_rounds_follow_plain_penalised_sampling(model_dir, method):
    """H0: through speculative rounds on the device (op by op on the CPU; adaptive K in
    [0, 2]), whose slots hold the same penalties, bias and bans on the device (`SlotRules`: the
    output counts advanced by each round) while the drafts are sampled without them, the first
    3 emitted tokens have plain penalised sampling's exact joint law (requests run to 6 tokens,
    so that rounds past the first decide some of the 3). Same statistic, N and threshold as
    above (false-failure rate <= 1e-6 per case, 2 cases; block runs with the slow tests)."""
    spec = {**spec_config(method, "probabilistic"), "adaptive": True}
    counts = rules_counts(model_dir, spec, 0.7, 6, async_scheduling=True)
    assert chi_square_pvalue(counts, rules_law(model_dir, 0.7, NUM_TOKENS)) > ALPHA


def test_negative_control_device_rounds_blind_to_their_own_tokens(model_dir, monkeypatch):
    """The penalised device-round test has power: it rejects (p < 1e-6) rounds whose slots
    never count the tokens the rounds emitted (`SlotRules.observe` a no-op: the penalties and
    min_tokens of later rounds see the output as it was when the request took its slot)."""
    from specdec.sampling.slot_rules import SlotRules

    monkeypatch.setattr(SlotRules, "observe", lambda self, emitted, accepted, live: None)
    spec = {**spec_config("standard", "probabilistic"), "adaptive": True}
    counts = rules_counts(model_dir, spec, 0.7, 6, async_scheduling=True)
    assert chi_square_pvalue(counts, rules_law(model_dir, 0.7, NUM_TOKENS)) < ALPHA


def test_negative_control_draft_recorded_without_its_rules(model_dir, monkeypatch):
    """The penalised test has power over the drafter's side: it rejects (p < 1e-6) an engine
    whose drafter samples from rules-processed logits but records for the verifier the
    distribution without the rules (a drafter that does not process its own logits the way it
    samples them)."""
    law = rules_law(model_dir, 0.7, NUM_TOKENS)
    spec = spec_config("standard", "probabilistic")
    real = Drafter.sample_draft

    def unprocessed_record(self, logits, rows, positions, batch, **kwargs):
        out = real(self, logits, rows, positions, batch, **kwargs)
        plain = real(self, logits, rows, positions, dataclasses.replace(batch, context=None))
        return SampleOutput(out.token_ids, plain.processed_logits, plain.logsumexp)

    monkeypatch.setattr(Drafter, "sample_draft", unprocessed_record)
    assert chi_square_pvalue(rules_counts(model_dir, spec, 0.7), law) < ALPHA


@pytest.mark.parametrize(("quantization", "method"), [("int4", "block"), ("fp8", "standard")])
def test_first_tokens_follow_the_quantized_target(model_dir, quantization, method):
    """Exactness is relative to the target as it runs. H0: with the target quantized at load
    (int4 group-wise, FP8 per channel), the engine's first 3 emitted tokens have the exact joint
    law computed from the quantized target's own logits. Same statistic, N = 12,000 and
    threshold as above (probabilistic drafts, temperature 0.7): false-failure rate <= 1e-6 per
    case (2 cases). Negative control: the same counts against the float target's law must be
    rejected (p < 1e-6), so the test tells the formats apart."""
    law = exact_continuation_law(model_dir, 0.7, NUM_TOKENS, quantization=quantization)
    counts, metrics = first_token_counts(
        model_dir,
        spec_config(method, "probabilistic"),
        0.7,
        NUM_TOKENS,
        NUM_TOKENS,
        NUM_TRIALS,
        {"quantization": quantization},
    )
    assert metrics["num_accepted_tokens"] > 0
    assert chi_square_pvalue(counts, law) > ALPHA
    assert chi_square_pvalue(counts, exact_law(model_dir, 0.7)) < ALPHA
