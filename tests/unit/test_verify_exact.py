"""The exact law of one verification round, by enumeration: no sampling noise at all.

For small V and K, every draft chain is enumerated with its draft probability. A round's outcome
depends on its acceptance uniforms only through which side of each threshold they fall, so the
uniforms are integrated analytically: one representative uniform vector per cell, weighted by the
cell's probability (Leviathan et al.'s ratios, Sun et al.'s block thresholds, in float64 from
`specdec.audit.laws`). The real `verify` runs on every (chain, cell) with the ACCEPT uniforms
patched to the representatives and the final Gumbel-max draw intercepted, so the decisions and
the recovered/bonus token's distribution come from the code under test. Composed with the
target's continuation, the emitted tokens must have exactly the target's joint law.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator
from unittest import mock

import pytest
import torch

import specdec.verify.verifier as verify_reference
from specdec import audit as c
from specdec.rng import Stream
from specdec.sampling import sample
from specdec.verify import verify

PROCESSINGS = (
    c.Processing("plain"),
    c.Processing("t0.7+top_k", 0.7, top_k=2),
    c.Processing("t0.7+top_p", 0.7, top_p=0.75),
    c.Processing("t1.3+min_p", 1.3, min_p=0.2),
)
ANCHOR = 40
ATOL = 3e-6  # float32 rounding inside the verifier


def toy(vocab: int, seed: int) -> c.MarkovToy:
    generator = torch.Generator().manual_seed(seed)
    target = 1.5 * torch.randn(vocab, vocab, generator=generator)
    draft = target + torch.randn(vocab, vocab, generator=generator)
    return c.MarkovToy(target, draft, start_token=1)


@contextlib.contextmanager
def scripted_noise(accept_u: torch.Tensor, anchors: torch.Tensor) -> Iterator[list[dict]]:
    """ACCEPT uniforms come from `accept_u` [B, K]; final draws are recorded and return argmax.

    Also checks the keys the verifier asks for: ACCEPT at Q = anchor + i with step = anchor.
    """
    calls: list[dict] = []
    k = accept_u.shape[1]

    def uniform(seeds, positions, stream, num_lanes, *, step=0, dtype=torch.float32):
        assert stream == Stream.ACCEPT and num_lanes == 1
        expected_q = (anchors[:, None] + torch.arange(k)).flatten()
        assert torch.equal(positions, expected_q)
        assert torch.equal(step, anchors.repeat_interleave(k))
        return accept_u.reshape(-1, 1).to(dtype)

    def gumbel_argmax_ref(processed, greedy, seeds, positions, stream, step=0):
        assert not bool(greedy.any())
        calls.append({"weights": processed.clone(), "positions": positions, "stream": stream})
        return processed.argmax(dim=-1)

    with (
        mock.patch.object(verify_reference, "uniform", uniform),
        mock.patch.object(verify_reference, "gumbel_argmax_ref", gumbel_argmax_ref),
    ):
        yield calls


def chain_rows(toy_model, processing, drafts, num_draft, k):
    """Chains (padded to K with token 0), their probabilities, and the laws along them."""
    chains, chain_probs = c.draft_chains(toy_model, processing, drafts, num_draft)
    chains = torch.cat([chains, torch.zeros(len(chains), k - num_draft, dtype=torch.int64)], 1)
    context = torch.cat([torch.full((len(chains), 1), toy_model.start_token), chains], dim=1)
    target_law = c.processed_probs(toy_model.target_logits, processing)
    draft_law = c.draft_probs(toy_model, processing, drafts)
    return chains, chain_probs, context, target_law[context], draft_law[context[:, :-1]]


def accept_model(method, target_rows, draft_rows, chains, num_draft):
    """(per-column thresholds [P, n] in the code's column order, tau law [P, n+1])."""
    chains, draft_rows = chains[:, :num_draft], draft_rows[:, :num_draft]
    target_rows = target_rows[:, : num_draft + 1]
    if method == "standard":
        ratios = c.standard_accept_ratios(target_rows, draft_rows, chains)
        return ratios, c.accepted_count_law("standard", ratios)
    _, thresholds = c.block_accept_thresholds(target_rows, draft_rows, chains)
    return thresholds[:, 1:], c.accepted_count_law("block", thresholds)


def representative_uniforms(method: str, thresholds: torch.Tensor, tau: int) -> torch.Tensor:
    """[n] float64 uniforms inside the cell where exactly `tau` drafts are accepted.

    Column j's draft is accepted iff u_j < thresholds[j] (standard: for all j < tau, and the
    chain stops at tau; block: tau = the last accepted column + 1).
    """
    num_draft = thresholds.shape[0]
    u = torch.full((num_draft,), 0.5, dtype=torch.float64)
    if method == "standard":
        u[:tau] = thresholds[:tau] / 2
        if tau < num_draft:
            u[tau] = (1 + thresholds[tau]) / 2
    else:
        if tau:
            u[tau - 1] = thresholds[tau - 1] / 2
        u[tau:] = (1 + thresholds[tau:]) / 2
    return u


def run_scripted(toy_model, processing, method, drafts, chains, accept_u, num_draft):
    """`verify` on each chain with scripted ACCEPT uniforms; returns (result, final laws [B, V])."""
    batch = chains.shape[0]
    context = torch.cat([torch.full((batch, 1), toy_model.start_token), chains], dim=1)
    draft_logits = None
    if drafts == "sampled":
        draft_logits = processing.apply(toy_model.draft_logits)[context[:, :-1]]
    anchors = torch.full((batch,), ANCHOR, dtype=torch.int64)
    num_drafts = torch.full((batch,), num_draft, dtype=torch.int64)
    with scripted_noise(accept_u, anchors) as calls:
        result = verify(
            toy_model.target_logits[context],
            chains,
            draft_logits,
            torch.arange(batch, dtype=torch.int64),
            anchors,
            **processing.kwargs(),
            num_draft=num_drafts,
            method=method,
        )
    accepted = result.num_accepted
    rejected = (accepted < num_draft).nonzero().squeeze(1)
    bonus = (accepted == num_draft).nonzero().squeeze(1)
    by_stream = {call["stream"]: call for call in calls}
    assert len(by_stream) == len(calls)  # one draw per stream, never a wasted one
    final = torch.empty(len(accepted), calls[0]["weights"].shape[-1], dtype=torch.float64)
    if bonus.numel():
        bonus_call = by_stream[Stream.TARGET]
        assert torch.equal(bonus_call["positions"], ANCHOR + accepted[bonus])
        final[bonus] = bonus_call["weights"].double().softmax(-1)
    else:
        assert Stream.TARGET not in by_stream
    if rejected.numel():
        residual_call = by_stream[Stream.RESIDUAL]
        assert torch.equal(residual_call["positions"], ANCHOR + accepted[rejected])
        final[rejected] = residual_call["weights"].double().softmax(-1)
    else:
        assert Stream.RESIDUAL not in by_stream
    return result, final


def round_law(toy_model, processing, method, drafts, k, num_draft):
    """The exact law of the first num_draft + 1 tokens: emitted tokens, then target continuation.

    Returns:
        (law, expected): [V**(n+1)] float64 each; `expected` is the target's exact joint law.
    """
    vocab = toy_model.vocab_size
    target_law = c.processed_probs(toy_model.target_logits, processing)
    chains, chain_probs, _, target_rows, draft_rows = chain_rows(
        toy_model, processing, drafts, num_draft, k
    )
    if num_draft:
        thresholds, tau_law = accept_model(method, target_rows, draft_rows, chains, num_draft)
    else:
        thresholds = torch.zeros(len(chains), 0, dtype=torch.float64)
        tau_law = torch.ones(len(chains), 1, dtype=torch.float64)
    rows, weights, taus, uniforms = [], [], [], []
    for index, tau in itertools.product(range(len(chains)), range(num_draft + 1)):
        weight = float(chain_probs[index] * tau_law[index, tau])
        if weight == 0:
            continue
        rows.append(index)
        weights.append(weight)
        taus.append(tau)
        u = torch.full((k,), 0.5, dtype=torch.float64)
        u[:num_draft] = representative_uniforms(method, thresholds[index], tau)
        uniforms.append(u)
    rows_t = torch.tensor(rows)
    result, final = run_scripted(
        toy_model, processing, method, drafts, chains[rows_t], torch.stack(uniforms), num_draft
    )
    assert torch.equal(result.num_accepted, torch.tensor(taus)), "decisions differ from the cells"

    length = num_draft + 1
    law = torch.zeros(vocab**length, dtype=torch.float64)
    for row, (index, weight, tau) in enumerate(zip(rows, weights, taus, strict=True)):
        prefix = chains[index, :tau].tolist()
        # the tokens after the emitted ones: the target's own continuation from the final token
        for y in range(vocab):
            mass = weight * float(final[row, y])
            if mass == 0:
                continue
            rest = length - tau - 1
            if rest == 0:
                law[c.sequence_codes(torch.tensor([[*prefix, y]]), vocab)] += mass
                continue
            continuation = c.joint_probs(target_law, y, rest)
            tails = c.all_sequences(vocab, rest)
            heads = torch.tensor([*prefix, y]).expand(len(tails), -1)
            codes = c.sequence_codes(torch.cat([heads, tails], dim=1), vocab)
            law.index_add_(0, codes, mass * continuation)
    expected = c.joint_probs(target_law, toy_model.start_token, length)
    return law, expected


SHAPES = [(3, 1, 1), (3, 2, 2), (4, 2, 2), (3, 3, 3), (4, 3, 3), (4, 3, 1), (3, 2, 0)]  # V, K, n
CASES = [pytest.param(*shape, id="V{}-K{}-n{}".format(*shape)) for shape in SHAPES]


@pytest.mark.parametrize("processing", PROCESSINGS, ids=lambda p: p.name)
@pytest.mark.parametrize("drafts", c.DRAFT_KINDS)
@pytest.mark.parametrize("method", ["standard", "block"])
@pytest.mark.parametrize("vocab, k, num_draft", CASES)
def test_round_has_the_exact_target_law(vocab, k, num_draft, method, drafts, processing):
    """Emitted tokens + target continuation == the target's joint law, to float32 rounding."""
    toy_model = toy(vocab, seed=vocab * 100 + k * 10 + num_draft)
    law, expected = round_law(toy_model, processing, method, drafts, k, num_draft)
    assert float(law.sum()) == pytest.approx(1.0, abs=1e-9)
    torch.testing.assert_close(law, expected, rtol=0, atol=ATOL)


def test_exact_check_rejects_a_broken_residual():
    """Negative control: the same enumeration rejects recovery from the target itself."""
    toy_model = toy(3, seed=7)
    with c.residual_from_target():
        law, expected = round_law(toy_model, PROCESSINGS[0], "standard", "sampled", 2, 2)
    assert float((law - expected).abs().max()) > 100 * ATOL


def test_exact_check_rejects_an_unweighted_block_residual(monkeypatch):
    """Negative control: block verification with token-level residual weights (p_tau forced to
    1, a plausible slip) breaks the exact law, and the enumeration sees it."""
    original = verify_reference.residual_log_weights

    def unweighted(target_logp, draft_logp, log_weight):
        return original(target_logp, draft_logp, torch.zeros_like(log_weight))

    toy_model = toy(3, seed=11)
    monkeypatch.setattr(verify_reference, "residual_log_weights", unweighted)
    law, expected = round_law(toy_model, PROCESSINGS[0], "block", "sampled", 3, 3)
    assert float((law - expected).abs().max()) > 100 * ATOL


@pytest.mark.parametrize("method", ["standard", "block"])
@pytest.mark.parametrize("drafts", c.DRAFT_KINDS)
def test_thresholds_match_the_papers_formulas(method, drafts):
    """The verifier's acceptance thresholds equal the float64 formulas to 1e-5 (relative):
    each column is probed just below and just above its threshold."""
    toy_model, processing, k = toy(4, seed=5), PROCESSINGS[0], 3
    chains, _, _, target_rows, draft_rows = chain_rows(toy_model, processing, drafts, k, k)
    thresholds, _ = accept_model(method, target_rows, draft_rows, chains, k)
    probes, expected, rows = [], [], []
    for index, column, side in itertools.product(range(len(chains)), range(k), (-1, 1)):
        h = thresholds[index]
        if not 1e-30 < float(h[column]) < 1 - 1e-4:
            continue
        u = torch.full((k,), 1 - 2.0**-24, dtype=torch.float64)  # reject unless h = 1
        u[:column] = h[:column] / 2  # accept every earlier column
        u[column] = h[column] * (1 + side * 1e-5)
        accept = (u < h).tolist()
        if method == "standard":  # the chain stops at its first rejection
            tau = accept.index(False) if False in accept else k
        else:  # tau is the last accepted column + 1
            tau = max((j + 1 for j in range(k) if accept[j]), default=0)
        probes.append(u)
        expected.append(tau)
        rows.append(index)
    assert probes
    result, _ = run_scripted(
        toy_model, processing, method, drafts, chains[torch.tensor(rows)], torch.stack(probes), k
    )
    assert result.num_accepted.tolist() == expected


@pytest.mark.parametrize("processing", PROCESSINGS, ids=lambda p: p.name)
def test_coupled_accepts_iff_the_draft_is_the_targets_own_sample(processing):
    """Coupled: num_accepted is the matching prefix of drafts and `sample` on the target rows
    (Stream.TARGET at each Q), and the final token is that sample at the first mismatch."""
    generator = torch.Generator().manual_seed(3)
    batch, k, vocab = 64, 3, 6
    target_logits = torch.randn(batch, k + 1, vocab, generator=generator)
    seeds = torch.randint(-(2**62), 2**62, (batch,), generator=generator)
    anchors = torch.randint(0, 1000, (batch,), generator=generator)
    positions = anchors[:, None] + torch.arange(k + 1)
    own = sample(
        target_logits.reshape(-1, vocab),
        seeds.repeat_interleave(k + 1),
        positions.flatten(),
        **processing.kwargs(),
    ).token_ids.view(batch, k + 1)
    # drafts equal the target's samples for a random prefix, then differ
    match = torch.randint(0, k + 1, (batch,), generator=generator)
    drafts = torch.where(torch.arange(k) < match[:, None], own[:, :k], (own[:, :k] + 1) % vocab)
    result = verify(
        target_logits, drafts, None, seeds, anchors, **processing.kwargs(), method="coupled"
    )
    assert torch.equal(result.num_accepted, match)
    assert torch.equal(
        result.token_ids.gather(1, match[:, None]).squeeze(1),
        own.gather(1, match[:, None]).squeeze(1),
    )


@pytest.mark.parametrize("method", c.METHODS)
def test_temperature_zero_verifies_greedily(method):
    """Greedy rows accept iff draft == argmax and emit the argmax at the first mismatch."""
    generator = torch.Generator().manual_seed(4)
    batch, k, vocab = 32, 3, 5
    target_logits = torch.randn(batch, k + 1, vocab, generator=generator)
    argmax = target_logits.argmax(-1)
    match = torch.randint(0, k + 1, (batch,), generator=generator)
    drafts = torch.where(torch.arange(k) < match[:, None], argmax[:, :k], (argmax[:, :k] + 2) % 5)
    draft_logits = torch.randn(batch, k, vocab, generator=generator)
    result = verify(
        target_logits,
        drafts,
        draft_logits,
        torch.arange(batch),
        torch.zeros(batch, dtype=torch.int64),
        temperature=0.0,
        method=method,
    )
    assert torch.equal(result.num_accepted, match)
    expected = torch.where(torch.arange(k + 1) < match[:, None], argmax, -1)
    expected.scatter_(1, match[:, None], argmax.gather(1, match[:, None]))
    assert torch.equal(result.token_ids, expected)


@pytest.mark.parametrize("method", c.METHODS)
def test_an_all_greedy_batch_emits_what_its_rows_emit_beside_a_sampled_one(method):
    """A batch of greedy rows only takes the verifier's greedy shortcut on the CPU; each row
    emits what it emits in a batch that also holds a sampled row (the general path), with
    top-k / top-p and short chains."""
    generator = torch.Generator().manual_seed(9)
    batch, k, vocab = 24, 4, 11
    target_logits = torch.randn(batch + 1, k + 1, vocab, generator=generator)
    argmax = target_logits.argmax(-1)
    match = torch.randint(0, k + 1, (batch + 1,), generator=generator)
    drafts = torch.where(torch.arange(k) < match[:, None], argmax[:, :k], (argmax[:, :k] + 3) % 11)
    draft_logits = torch.randn(batch + 1, k, vocab, generator=generator)
    num_draft = torch.randint(0, k + 1, (batch + 1,), generator=generator)
    temperature = torch.zeros(batch + 1)
    temperature[-1] = 1.0
    top_k = torch.randint(0, 6, (batch + 1,), generator=generator)
    top_p = torch.full((batch + 1,), 0.9)

    def run(rows: int):
        return verify(
            target_logits[:rows],
            drafts[:rows],
            draft_logits[:rows],
            torch.arange(rows),
            torch.full((rows,), 7, dtype=torch.int64),
            temperature=temperature[:rows],
            top_k=top_k[:rows],
            top_p=top_p[:rows],
            num_draft=num_draft[:rows],
            method=method,
        )

    greedy_only, mixed = run(batch), run(batch + 1)
    assert torch.equal(greedy_only.num_accepted, mixed.num_accepted[:batch])
    assert torch.equal(greedy_only.token_ids, mixed.token_ids[:batch])
    assert int(greedy_only.num_accepted.sum()) > 0


@pytest.mark.parametrize("method", ["standard", "block"])
def test_bonus_and_empty_rounds_are_the_plain_sample(method):
    """A fully accepted chain's bonus token, and a round with num_draft = 0, are exactly the
    token `sample` draws from the same row at that position (Stream.TARGET)."""
    generator = torch.Generator().manual_seed(6)
    batch, k, vocab = 16, 2, 6
    target_logits = torch.randn(batch, k + 1, vocab, generator=generator)
    seeds = torch.randint(0, 2**62, (batch,), generator=generator)
    anchors = torch.randint(0, 500, (batch,), generator=generator)
    drafts = torch.randint(0, vocab, (batch, k), generator=generator)
    draft_logits = target_logits[:, :k].clone()  # draft == target: every draft is accepted
    result = verify(
        target_logits, drafts, draft_logits, seeds, anchors, temperature=1.0, method=method
    )
    assert torch.equal(result.num_accepted, torch.full((batch,), k))
    bonus = sample(target_logits[:, k], seeds, anchors + k, temperature=1.0).token_ids
    assert torch.equal(result.token_ids[:, k], bonus)
    empty = verify(
        target_logits,
        drafts,
        draft_logits,
        seeds,
        anchors,
        temperature=1.0,
        num_draft=torch.zeros(batch, dtype=torch.int64),
        method=method,
    )
    first = sample(target_logits[:, 0], seeds, anchors, temperature=1.0).token_ids
    assert torch.equal(empty.token_ids[:, 0], first)
    assert bool((empty.token_ids[:, 1:] == -1).all())


def test_verify_rejects_bad_inputs():
    target = torch.zeros(2, 3, 5)
    drafts = torch.zeros(2, 2, dtype=torch.int64)
    seeds = positions = torch.zeros(2, dtype=torch.int64)
    with pytest.raises(ValueError, match="method"):
        verify(target, drafts, None, seeds, positions, temperature=1.0, method="tree")
    with pytest.raises(ValueError, match="draft_token_ids"):
        verify(target, drafts[:, :1], None, seeds, positions, temperature=1.0)
    with pytest.raises(ValueError, match="draft_logits"):
        verify(target, drafts, torch.zeros(2, 2, 4), seeds, positions, temperature=1.0)
    with pytest.raises(ValueError, match="draft_token_ids must lie"):
        verify(target, drafts + 5, None, seeds, positions, temperature=1.0)
    with pytest.raises(ValueError, match="num_draft"):
        verify(
            target, drafts, None, seeds, positions, temperature=1.0, num_draft=torch.tensor([3, 0])
        )
    with pytest.raises(ValueError, match="positions"):
        verify(target, drafts, None, seeds, positions - 1, temperature=1.0)
    with pytest.raises(ValueError, match="active_rows"):
        verify(target, drafts, None, seeds, positions, temperature=1.0, active_rows=3)
    with pytest.raises(ValueError, match="temperature"):
        verify(target, drafts, None, seeds, positions, temperature=-1.0)
