"""Unit tests of specdec.sampling.slot_rules: the rules of device-round slots process a row bit
for bit as `LogitsContext.apply` processes its request's row with the same output and prefix,
after writes and after rounds observed on the device; slots without rules pass their raw logits
through exactly. A negative control (a round observed past its accepted tokens) must differ."""

from __future__ import annotations

import pytest
import torch

from specdec.sampling import LogitsContext, LogitsRules
from specdec.sampling.slot_rules import SlotRules
from specdec.verify.inputs import context_target_logits

VOCAB = 12
SLOTS = 6
RULES = [
    LogitsRules(repetition_penalty=1.7, presence_penalty=0.6, frequency_penalty=0.4),
    None,
    LogitsRules(logit_bias=((3, 2.5), (4, -100.0)), allowed_token_ids=(1, 3, 4, 5, 7)),
    LogitsRules(
        repetition_penalty=0.7,
        presence_penalty=-1.5,
        frequency_penalty=-0.5,
        bad_words_token_ids=((6,),),
        min_tokens=4,
        min_tokens_banned=(0, 11),
    ),
    LogitsRules(min_tokens=2, min_tokens_banned=(5,), frequency_penalty=0.3),
]
PROMPTS = [[4, 5, 5, 9], [1], [2, 2], [7, 8, 0], [3]]
OUTPUTS = [[2, 2], [], [1, 2], [3, 3, 7], [5]]


def random_logits(rows: int, seed: int) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 2


def held(slots: list[int]) -> SlotRules:
    rules = SlotRules(SLOTS, VOCAB, torch.device("cpu"))
    # stale rules in every slot first: a write must replace them, neutral values included
    rules.write(list(range(SLOTS)), [RULES[0]] * SLOTS, [[1, 2]] * SLOTS, [[3, 3, 3]] * SLOTS)
    rules.write(slots, RULES, PROMPTS, OUTPUTS)
    return rules


def round_prefix(drafts: torch.Tensor, num_draft: torch.Tensor) -> tuple:
    """The verify rows' layout of `context_target_logits` for B slots of K drafts."""
    batch, k = drafts.shape
    columns = torch.arange(k)
    valid = (columns[None, None, :] < torch.arange(k + 1)[None, :, None]) & (
        columns[None, :] < num_draft[:, None]
    )[:, None, :]
    prefix = torch.where(valid, drafts[:, None, :], -1).reshape(batch * (k + 1), k)
    return torch.arange(batch).repeat_interleave(k + 1), prefix


def test_a_slot_processes_as_the_host_context_does():
    slots = [4, 0, 5, 2, 1]  # the requests in slots out of order
    rules = held(slots)
    context = LogitsContext(RULES, PROMPTS, OUTPUTS)
    drafts = torch.tensor([[2, 6, 2], [0, 1, 1], [3, 3, 4], [11, 0, 6], [5, 5, 2]])
    num_draft = torch.tensor([3, 1, 2, 3, 0])
    logits = random_logits(len(RULES) * 4, seed=1).view(len(RULES), 4, VOCAB)
    expected = context_target_logits(logits, drafts, num_draft, context)
    rows, prefix = round_prefix(drafts, num_draft)
    slot_rows = torch.tensor(slots)[rows]
    got = rules.apply(logits.reshape(-1, VOCAB), slot_rows, prefix).view(expected.shape)
    assert torch.equal(got, expected)
    assert torch.equal(got[1], logits[1])  # no rules: the raw logits, bit for bit


@pytest.mark.parametrize("control", [False, True])
def test_observed_rounds_keep_the_counts_current(control):
    """Two rounds observed on the device, then a row processed as the host context with the
    outputs grown by what each round emitted (its accepted drafts and one more token).
    Control: counting every emitted column, past the accepted ones, must change the rows."""
    slots = list(range(len(RULES)))
    rules = held(slots)
    outputs = [list(o) for o in OUTPUTS]
    generator = torch.Generator().manual_seed(5)
    for _ in range(2):
        emitted = torch.randint(0, VOCAB, (len(RULES), 4), generator=generator)
        accepted = torch.randint(0, 4, (len(RULES),), generator=generator)
        live = torch.tensor([True, True, True, True, False])
        if control:
            rules.observe(emitted, torch.full_like(accepted, 3), live)
        else:
            rules.observe(emitted, accepted, live)
        for b in slots:
            if live[b]:
                outputs[b] += emitted[b, : int(accepted[b]) + 1].tolist()
    logits = random_logits(len(RULES), seed=2)
    expected = LogitsContext(RULES, PROMPTS, outputs).apply(logits)
    got = rules.apply(logits, torch.tensor(slots))
    assert torch.equal(got, expected) != control


def test_multi_token_bad_words_are_refused_by_name():
    rules = SlotRules(2, VOCAB, torch.device("cpu"))
    word = LogitsRules(bad_words_token_ids=((1, 2),))
    assert not SlotRules.supports(word) and SlotRules.supports(None)
    with pytest.raises(ValueError, match="multi-token bad_words"):
        rules.write([0], [word], [[1]], [[]])
