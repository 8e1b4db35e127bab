"""Unit tests of specdec.sampling.context: penalties, biases and bans (vLLM's definitions), their
context (a prefix of drafts counts as output), and their use by `sample` and `verify`.

The reference is `specdec.audit.laws.rules_logits_reference`, an independent token-by-token
float64 twin of the rules; random logits come from a seeded generator of the test's own.
"""

from __future__ import annotations

import pytest
import torch

from specdec.audit.laws import rules_logits_reference
from specdec.sampling import LogitsContext, LogitsRules, SamplingParams, sample
from specdec.sampling.context import bad_words_token_ids
from specdec.verify import verify
from specdec.verify.inputs import context_target_logits

VOCAB = 12


def random_logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 2


RULES = {
    "penalties": LogitsRules(repetition_penalty=1.7, presence_penalty=0.6, frequency_penalty=0.4),
    "negative": LogitsRules(repetition_penalty=0.7, presence_penalty=-1.5, frequency_penalty=-0.5),
    "bias": LogitsRules(logit_bias=((3, 2.5), (4, -100.0))),
    "allowed": LogitsRules(allowed_token_ids=(1, 3, 5, 7)),
    "bad_words": LogitsRules(bad_words_token_ids=((6,), (2, 9), (1, 2, 3))),
    "min_tokens": LogitsRules(min_tokens=4, min_tokens_banned=(0, 11)),
    "all": LogitsRules(
        repetition_penalty=1.3,
        presence_penalty=0.5,
        frequency_penalty=0.2,
        logit_bias=((5, 1.0),),
        allowed_token_ids=tuple(range(10)),
        bad_words_token_ids=((8,), (1, 2)),
        min_tokens=3,
        min_tokens_banned=(0,),
    ),
}
PROMPT = [4, 5, 5, 9]
OUTPUTS = [[], [2], [1, 2], [3, 3, 7, 1, 2]]


@pytest.mark.parametrize("name", RULES)
def test_apply_matches_the_token_by_token_reference(name):
    rules = RULES[name]
    logits = random_logits(len(OUTPUTS))
    context = LogitsContext([rules] * len(OUTPUTS), [PROMPT] * len(OUTPUTS), OUTPUTS)
    out = context.apply(logits)
    for row, output in enumerate(OUTPUTS):
        expected = rules_logits_reference(logits[row], rules, PROMPT, output).float()
        torch.testing.assert_close(out[row], expected, rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("name", RULES)
def test_a_prefix_counts_exactly_as_output(name):
    """apply(rows, prefix) is bit-identical to apply on contexts whose outputs end with the
    prefix: what makes verify row j equal plain decoding once drafts 0..j-1 are accepted."""
    rules = RULES[name]
    logits = random_logits(6, seed=1)
    base = [[3], [1], [], [2, 2]]
    context = LogitsContext([rules, None, rules, rules], [PROMPT] * 4, base)
    rows = torch.tensor([0, 0, 2, 3, 1, 3])
    prefix = torch.tensor([[-1, -1, -1], [1, 2, -1], [1, 2, 3], [9, -1, -1], [5, 5, -1], [1, 1, 2]])
    got = context.apply(logits, rows, prefix)
    for n in range(6):
        b = int(rows[n])
        tokens = [t for t in prefix[n].tolist() if t >= 0]
        alone = LogitsContext([context.rules[b]], [PROMPT], [base[b] + tokens])
        assert torch.equal(got[n], alone.apply(logits[n : n + 1])[0]), n


def test_rows_without_rules_are_unchanged_bit_for_bit():
    logits = random_logits(3).to(torch.bfloat16)
    context = LogitsContext([None, RULES["all"], None], [PROMPT] * 3, [[1], [1], [2]])
    out = context.apply(logits)
    assert out.dtype == torch.float32
    assert torch.equal(out[0], logits[0].float()) and torch.equal(out[2], logits[2].float())
    assert not torch.equal(out[1], logits[1].float())
    assert LogitsContext.build([None, None], [[1], [2]], [[], []]) is None


def test_min_tokens_counts_the_prefix():
    rules = LogitsRules(min_tokens=2, min_tokens_banned=(0,))
    context = LogitsContext([rules], [PROMPT], [[5]])
    logits = torch.zeros(3, VOCAB)
    rows = torch.zeros(3, dtype=torch.int64)
    out = context.apply(logits, rows, torch.tensor([[-1], [7], [-1]]))
    assert torch.isneginf(out[0, 0]) and out[1, 0] == 0 and torch.isneginf(out[2, 0])


def test_a_row_left_without_any_token_is_returned_unprocessed():
    rules = LogitsRules(allowed_token_ids=(3,), bad_words_token_ids=((3,),))
    logits = random_logits(1)
    out = LogitsContext([rules], [PROMPT], [[]]).apply(logits)
    assert torch.equal(out, logits)


def test_bad_words_are_tokenized_as_vllm_does():
    table = {"bad": [7], " bad": [8], "two words": [1, 2], " two words": [3, 2], "x y": [4, 5]}
    table[" x y"] = [4, 6]  # same first token with a space: the spaced form is not added
    encode = table.__getitem__
    assert bad_words_token_ids(["bad", "  two words", "x y"], encode) == [
        (7,),
        (8,),
        (1, 2),
        (3, 2),
        (4, 5),
    ]


def test_rules_from_params_resolve_ids_and_name_bad_fields():
    params = SamplingParams(min_tokens=2, stop_token_ids=[3], logit_bias={"5": 300})
    rules = LogitsRules.from_params(params, vocab_size=VOCAB, eos_token_id=11)
    assert rules.min_tokens_banned == (3, 11) and rules.logit_bias == ((5, 100.0),)
    ignoring = SamplingParams(min_tokens=2, ignore_eos=True)
    assert LogitsRules.from_params(ignoring, vocab_size=VOCAB, eos_token_id=11) is None
    assert LogitsRules.from_params(SamplingParams(), vocab_size=VOCAB, eos_token_id=11) is None
    with pytest.raises(ValueError, match="logit_bias"):
        LogitsRules.from_params(
            SamplingParams(logit_bias={VOCAB: 1.0}), vocab_size=VOCAB, eos_token_id=None
        )
    with pytest.raises(ValueError, match="allowed_token_ids"):
        LogitsRules.from_params(
            SamplingParams(allowed_token_ids=[0, 99]), vocab_size=VOCAB, eos_token_id=None
        )
    with pytest.raises(ValueError, match="bad_words needs a tokenizer"):
        LogitsRules.from_params(
            SamplingParams(bad_words=["x"]), vocab_size=VOCAB, eos_token_id=None
        )


@pytest.mark.parametrize(
    "kwargs",
    [
        {"presence_penalty": 2.5},
        {"frequency_penalty": -2.1},
        {"repetition_penalty": 0.0},
        {"repetition_penalty": float("inf")},
        {"logit_bias": {-1: 1.0}},
        {"logit_bias": {1: float("nan")}},
        {"logit_bias": [1, 2]},
        {"bad_words": [""]},
        {"allowed_token_ids": []},
        {"allowed_token_ids": [-1]},
        {"prompt_logprobs": -1},
        {"best_of": 3},
    ],
)
def test_sampling_params_rejects_invalid_rules(kwargs):
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        SamplingParams(**kwargs)


def test_sample_with_a_context_equals_sample_of_the_processed_logits():
    logits = random_logits(4, seed=2)
    seeds = torch.arange(4, dtype=torch.int64) + 100
    positions = torch.tensor([3, 9, 4, 6])
    context = LogitsContext([RULES["all"]] * 4, [PROMPT] * 4, OUTPUTS)
    a = sample(logits, seeds, positions, temperature=0.8, top_k=5, context=context)
    b = sample(context.apply(logits), seeds, positions, temperature=0.8, top_k=5)
    assert torch.equal(a.token_ids, b.token_ids)
    assert torch.equal(a.processed_logits, b.processed_logits)


def test_verify_row_j_is_processed_with_drafts_before_it():
    batch, k = 3, 3
    target = random_logits(batch * (k + 1), seed=3).view(batch, k + 1, VOCAB)
    drafts = torch.tensor([[1, 2, 3], [4, 4, -1], [7, 0, 0]])
    num_draft = torch.tensor([3, 2, 1])
    context = LogitsContext([RULES["all"], RULES["penalties"], None], [PROMPT] * 3, OUTPUTS[:3])
    out = context_target_logits(target, drafts, num_draft, context)
    for b in range(batch):
        for j in range(k + 1):
            before = drafts[b, : min(j, int(num_draft[b]))].tolist()
            alone = LogitsContext([context.rules[b]], [PROMPT], [OUTPUTS[b] + before])
            assert torch.equal(out[b, j], alone.apply(target[b, j : j + 1])[0]), (b, j)


def test_coupled_verify_with_a_context_emits_plain_decoding_s_tokens():
    """The accepted drafts and the final token of a coupled round are what `sample` with the
    same context draws at those positions (drafts drawn as the drafter draws them)."""
    batch, k = 64, 3
    target_table = random_logits(VOCAB, seed=4)  # bigram target: row a = logits after a
    draft_table = target_table + 0.5 * random_logits(VOCAB, seed=5)
    rules = RULES["all"]
    seeds = torch.arange(batch, dtype=torch.int64) * 7 + 1
    anchors = torch.full((batch,), 5, dtype=torch.int64)
    last = torch.full((batch,), 4, dtype=torch.int64)
    context = LogitsContext([rules] * batch, [PROMPT] * batch, [[4]] * batch)
    drafts, prev = [], last
    for i in range(k):
        before = torch.stack(drafts, 1) if drafts else None
        raw = context.apply(draft_table[prev], prefix=before)
        prev = sample(raw, seeds, anchors + i, temperature=1.0).token_ids
        drafts.append(prev)
    drafts = torch.stack(drafts, 1)
    tokens = torch.cat([last[:, None], drafts], 1)
    result = verify(
        target_table[tokens],
        drafts,
        None,
        seeds,
        anchors,
        temperature=1.0,
        method="coupled",
        context=context,
    )
    history = [[4] for _ in range(batch)]
    prev = last
    for j in range(k + 1):
        step = LogitsContext([rules] * batch, [PROMPT] * batch, history)
        prev = sample(target_table[prev], seeds, anchors + j, temperature=1.0, context=step)
        for b, t in enumerate(prev.token_ids.tolist()):
            if j <= int(result.num_accepted[b]):
                assert result.token_ids[b, j] == t
            history[b] = history[b] + [t]
        prev = prev.token_ids
