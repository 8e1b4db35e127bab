"""verify() names the problem in bad input instead of emitting biased tokens."""

import pytest
import torch

from specdec.sampling import SamplingParams
from specdec.verify import verify

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
    with pytest.raises(ValueError, match=r"a target_logits row .* has no finite logit"):
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
