"""verify() names the problem in bad input instead of emitting biased tokens."""

import pytest
import torch

from specdec.sampling import SamplingParams
from specdec.verify import verify, verify_ref

B, K, V = 2, 3, 6


def inputs():
    gen = torch.Generator().manual_seed(0)
    target = torch.randn(B, K + 1, V, generator=gen)
    draft_logits = torch.randn(B, K, V, generator=gen)
    drafts = draft_logits.argmax(-1)
    return target, drafts, draft_logits, torch.tensor([1, 2]), torch.tensor([5, 9])


def test_a_draft_outside_its_own_distribution_is_rejected():
    target, drafts, draft_logits, seeds, positions = inputs()
    draft_logits[1, 2, drafts[1, 2]] = float("-inf")
    with pytest.raises(ValueError, match="zero probability under its draft_logits"):
        verify(target, drafts, draft_logits, seeds, positions, temperature=1.0)
    # Beyond num_draft the entry is ignored.
    verify(
        target,
        drafts,
        draft_logits,
        seeds,
        positions,
        temperature=1.0,
        num_draft=torch.tensor([3, 2]),
    )


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"method": "tree"}, "method must be one of"),
        ({"num_draft": torch.tensor([4, 0])}, "num_draft must lie"),
        ({"active_rows": 3}, "active_rows"),
        ({"temperature": -1.0}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
    ],
)
def test_invalid_arguments_name_the_problem(change, message):
    target, drafts, draft_logits, seeds, positions = inputs()
    kwargs = {"temperature": 1.0, **change}
    with pytest.raises(ValueError, match=message):
        verify(target, drafts, draft_logits, seeds, positions, **kwargs)


def test_shapes_are_checked():
    target, drafts, draft_logits, seeds, positions = inputs()
    with pytest.raises(ValueError, match="draft_logits must have shape"):
        verify(target, drafts, draft_logits[:, :, :4], seeds, positions, temperature=1.0)
    with pytest.raises(ValueError, match="draft_token_ids"):
        verify(target, drafts[:, :2], draft_logits, seeds, positions, temperature=1.0)
    with pytest.raises(ValueError, match="draft_token_ids must lie"):
        verify(target, drafts + V, None, seeds, positions, temperature=1.0)


@pytest.mark.parametrize("field", ["n", "max_tokens", "min_tokens", "logprobs"])
def test_sampling_params_reject_booleans(field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: True})


@pytest.mark.parametrize("method", ["standard", "block", "coupled"])
def test_zero_drafts_is_one_plain_sample(method):
    from specdec.sampling import sample

    target, _, _, seeds, positions = inputs()
    no_drafts = torch.empty(B, 0, dtype=torch.int64)
    out = verify(target[:, :1], no_drafts, None, seeds, positions, temperature=0.8, method=method)
    plain = sample(target[:, 0], seeds, positions, temperature=0.8)
    assert out.token_ids[:, 0].tolist() == plain.token_ids.tolist()
    assert out.num_accepted.tolist() == [0] * B


# ---------------------------------------------------------------------------------------------
# Edges: positions near 2**32, NaN and unusable rows (the GPU twins: tests/parity/test_edges_gpu)
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["standard", "block", "coupled"])
def test_the_last_round_that_fits_in_32_bit_positions(method):
    """A round keys positions .. positions + K: positions up to 2**32 - 1 - K verify, one more
    is refused with a message naming the limit (not a position the caller never passed)."""
    target, drafts, draft_logits, seeds, _ = inputs()
    draft_logits = None if method == "coupled" else draft_logits
    last = torch.tensor([2**32 - 1 - K, 7])
    verify(target, drafts, draft_logits, seeds, last, temperature=1.0, method=method)
    with pytest.raises(ValueError, match=r"positions must lie in \[0, 2\*\*32 - 1 - K\]"):
        verify(target, drafts, draft_logits, seeds, last + 1, temperature=1.0, method=method)


def test_nan_logits_count_as_minus_infinity():
    from specdec.sampling import sample

    logits = torch.tensor([[float("nan"), 0.0, 1.0], [2.0, float("nan"), -1.0]])
    seeds, positions = torch.tensor([1, 2]), torch.tensor([3, 4])
    greedy = sample(logits, seeds, positions, temperature=0.0)
    assert greedy.token_ids.tolist() == [2, 0]  # argmax would pick the NaN
    assert torch.isneginf(greedy.processed_logits[0, 0])
    many = sample(
        logits.repeat(500, 1),
        torch.arange(1000, dtype=torch.int64),
        torch.arange(1000, dtype=torch.int64),
        temperature=1.0,
    )
    drawn = many.token_ids.view(500, 2)
    assert (drawn[:, 0] != 0).all() and (drawn[:, 1] != 1).all()
    assert torch.isfinite(many.logsumexp).all()
    target, drafts, _, seeds, positions = inputs()
    target[:, :, 0] = float("nan")
    out = verify(target, drafts.clamp(1), None, seeds, positions, temperature=1.0)
    assert (out.token_ids != 0).all()


@pytest.mark.parametrize("fill", [float("nan"), float("-inf"), float("inf")])
def test_rows_without_a_distribution_are_refused(fill):
    from specdec.sampling import sample

    logits = torch.zeros(3, V)
    logits[1] = fill if fill != float("inf") else logits[1]
    logits[1, 2] = fill
    with pytest.raises(ValueError, match="logits row 1 has no finite logit"):
        sample(logits, torch.tensor([1, 2, 3]), torch.tensor([1, 2, 3]), temperature=1.0)
    target, drafts, draft_logits, seeds, positions = inputs()
    target[1, 2] = fill if fill != float("inf") else target[1, 2]
    target[1, 2, 0] = fill
    with pytest.raises(ValueError, match=r"target_logits\[1, 2\] has no finite logit"):
        verify(target, drafts, draft_logits, seeds, positions, temperature=1.0)
    # A row past num_draft is never drawn from: it is not checked.
    verify(
        target,
        drafts,
        draft_logits,
        seeds,
        positions,
        temperature=1.0,
        num_draft=torch.tensor([3, 1]),
    )


# ---------------------------------------------------------------------------------------------
# Rows the outcome never reads (the GPU twin: tests/parity/test_edges_gpu)
# ---------------------------------------------------------------------------------------------

FILLS = [float("nan"), float("-inf"), float("inf")]


def peaked_round(accept_all: bool):
    """Two requests, K = 3, target rows that put all but ~1e-8 of their mass on one token each
    (row j on token j + 1), so that each draft's fate is certain: request 0 drafts [1, 2, 0]
    (its draft 2 is rejected: target(0) ~ e**-20 at row 2) unless `accept_all`, which makes it
    [1, 2, 3]; request 1 drafts [1, 2] of num_draft 2 (both accepted: its bonus is row 2).
    One-hot drafts (draft_logits None), as an n-gram drafter's."""
    target = torch.full((2, K + 1, V), -10.0)
    for j in range(K + 1):
        target[:, j, j + 1] = 10.0
    drafts = torch.tensor([[1, 2, 3 if accept_all else 0], [1, 2, 5]])
    return target, drafts, torch.tensor([11, 12]), torch.tensor([40, 60]), torch.tensor([3, 2])


def garbage(row: torch.Tensor, fill: float) -> None:
    """Makes a [V] row unusable: all `fill` (NaN, -inf), or one +inf among finite values."""
    if fill == float("inf"):
        row[4] = fill
    else:
        row.fill_(fill)


@pytest.mark.parametrize("fill", FILLS)
@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("method", ["standard", "block", "coupled"])
def test_an_unread_bonus_row_may_hold_anything(method, temperature, fill):
    """HF transformers' own speculative-sampling test passes an all -inf bonus row after a
    rejection. The outcome never reads it (the recovered token comes from the rejected row), so
    verify accepts it and emits exactly what it emits with a finite bonus row; rows past
    num_draft are not read either."""
    target, drafts, seeds, positions, num_draft = peaked_round(accept_all=False)
    args = (drafts, None, seeds, positions)
    kwargs = {"temperature": temperature, "method": method, "num_draft": num_draft}
    clean = verify(target, *args, **kwargs)
    assert clean.num_accepted.tolist() == [2, 2]  # request 0 rejects its draft 2
    garbage(target[0, 3], fill)  # request 0's bonus row: never read after its rejection
    garbage(target[1, 3], fill)  # request 1's row past num_draft: never read
    out = verify(target, *args, **kwargs)
    assert torch.equal(out.token_ids, clean.token_ids)
    assert torch.equal(out.num_accepted, clean.num_accepted)
    ref = verify_ref(target, *args, **kwargs)
    assert torch.equal(ref.token_ids, clean.token_ids)


@pytest.mark.parametrize("fill", FILLS)
@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("method", ["standard", "block", "coupled"])
def test_a_read_row_without_a_distribution_is_refused(method, temperature, fill):
    """The negative control of the test above: the same garbage row once the outcome reads it
    is refused, naming the request's row. A bonus row is read after a full chain; a draft row
    (j < num_draft) always, even past the first rejection (block reads every one)."""
    kwargs = {"temperature": temperature, "method": method}
    target, drafts, seeds, positions, num_draft = peaked_round(accept_all=True)
    garbage(target[0, 3], fill)
    with pytest.raises(ValueError, match=r"target_logits\[0, 3\] has no finite logit.*all 3"):
        verify(target, drafts, None, seeds, positions, num_draft=num_draft, **kwargs)
    with pytest.raises(ValueError, match=r"target_logits\[0, 3\]"):
        verify_ref(target, drafts, None, seeds, positions, num_draft=num_draft, **kwargs)
    # Request 1's bonus row is row 2 (num_draft 2, both accepted).
    target, drafts, seeds, positions, num_draft = peaked_round(accept_all=False)
    garbage(target[1, 2], fill)
    with pytest.raises(ValueError, match=r"target_logits\[1, 2\] .*all 2 drafts"):
        verify(target, drafts, None, seeds, positions, num_draft=num_draft, **kwargs)
    # Request 0 rejects its draft 2 at row 2; its draft rows are read whatever the outcome.
    for row in (1, 2):
        target, drafts, seeds, positions, num_draft = peaked_round(accept_all=False)
        garbage(target[0, row], fill)
        with pytest.raises(ValueError, match=rf"target_logits\[0, {row}\] .*its draft {row}"):
            verify(target, drafts, None, seeds, positions, num_draft=num_draft, **kwargs)
    # No drafts: row 0 is the bonus row, always read.
    target, _, seeds, positions, _ = peaked_round(accept_all=False)
    garbage(target[1, 0], fill)
    no_drafts = torch.empty(2, 0, dtype=torch.int64)
    with pytest.raises(ValueError, match=r"target_logits\[1, 0\]"):
        verify(target[:, :1], no_drafts, None, seeds, positions, **kwargs)


def test_checked_inputs_count_every_live_row_as_read():
    """`check_verify_inputs` with its value checks (what `verify_tree` runs) does not know the
    outcome: every live row, the bonus row included, must have a distribution."""
    from specdec.verify import check_verify_inputs

    target, drafts, seeds, positions, num_draft = peaked_round(accept_all=False)
    target[0, 3] = float("nan")
    with pytest.raises(ValueError, match=r"target_logits\[0, 3\]"):
        check_verify_inputs(
            target, drafts, None, seeds, positions, temperature=1.0, num_draft=num_draft
        )
