"""Structured outputs, unit level: StructuredOutputsParams' validation, the grammar compiler's
cache and errors, the matcher's masks over draft prefixes and its rollback on commit, the
bitmask apply (CPU twin), and `LogitsContext` with grammars (unconstrained rows untouched)."""

from __future__ import annotations

import itertools

import pytest
import torch

from specdec import StructuredOutputsParams as TopLevel
from specdec.audit import grammar_allowed_reference, toy_grammar_matchers
from specdec.audit.laws import GRAMMAR_EOS, GRAMMAR_TOKENS
from specdec.sampling import LogitsContext, LogitsRules, SamplingParams, StructuredOutputsParams
from specdec.sampling.bitmask import apply_bitmask, apply_bitmask_ref, unpack_bitmask
from specdec.sampling.grammar import GrammarCompiler

V = len(GRAMMAR_TOKENS)


def allowed(mask: torch.Tensor, vocab: int = V) -> list[int]:
    return unpack_bitmask(mask[None], vocab)[0].nonzero().flatten().tolist()


@pytest.fixture(scope="module")
def compiler() -> GrammarCompiler:
    return GrammarCompiler.from_token_bytes(GRAMMAR_TOKENS, GRAMMAR_EOS)


def test_params_take_exactly_one_constraint():
    assert TopLevel is StructuredOutputsParams
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(regex="a", choice=["b"])
    with pytest.raises(ValueError, match="not valid JSON"):
        StructuredOutputsParams(json="{nope")
    with pytest.raises(ValueError, match="non-empty strings"):
        StructuredOutputsParams(choice=["a", ""])
    with pytest.raises(ValueError, match="structural_tag"):
        StructuredOutputsParams.from_dict({"structural_tag": "x"})
    with pytest.raises(ValueError, match="bogus"):
        StructuredOutputsParams.from_dict({"regex": "a", "bogus": 1})
    assert StructuredOutputsParams(json='{"type": "object"}').json == {"type": "object"}
    with pytest.raises(ValueError, match="StructuredOutputsParams"):
        SamplingParams(structured_outputs={"regex": "a"})


def test_cache_keys_by_the_constraint(compiler):
    a = compiler.compile(StructuredOutputsParams(json={"b": 1, "type": "object"}))
    b = compiler.compile(StructuredOutputsParams(json={"type": "object", "b": 1}))
    assert a is b
    assert compiler.compile(StructuredOutputsParams(regex="a+")) is not a


@pytest.mark.parametrize(
    ("constraint", "words"),
    [
        ({"regex": "[a-"}, "invalid structured_outputs.regex"),
        ({"json": {"type": "foo"}}, "invalid structured_outputs.json"),
        ({"grammar": "start: nothing_defined"}, "invalid structured_outputs.grammar"),
    ],
)
def test_bad_constraints_are_named(compiler, constraint, words):
    with pytest.raises(ValueError, match=words):
        compiler.compile(StructuredOutputsParams(**constraint))


def test_a_constraint_no_token_can_start_is_refused(compiler):
    grammar = compiler.compile(StructuredOutputsParams(regex="z+"))
    with pytest.raises(ValueError, match="allows no output"):
        compiler.matcher(grammar)


def test_masks_match_the_hand_written_automaton_for_every_prefix():
    """Every grammatical prefix of up to 5 tokens (and the masks the matcher reaches by rolling
    back and re-advancing between them, in lexicographic order)."""
    (matcher,) = toy_grammar_matchers(1)
    checked = 0
    for n in range(6):
        for prefix in itertools.product(range(V), repeat=n):
            try:
                want = grammar_allowed_reference(list(prefix))
            except ValueError:
                continue
            assert allowed(matcher.mask(prefix)) == want.nonzero().flatten().tolist(), prefix
            checked += 1
    assert checked > 100


def test_a_rejected_draft_freezes_the_mask_and_commit_rolls_back():
    (matcher,) = toy_grammar_matchers(1)
    after_b = matcher.mask((1,))
    assert allowed(after_b) == [2]  # "b" must be followed by "c"
    # Draft 1 ("a" after "b") breaks the grammar: rows after it keep the mask reached before it.
    assert torch.equal(matcher.mask((1, 0)), after_b)
    assert torch.equal(matcher.mask((1, 0, 2)), after_b)
    # Accepted: "b" then the recovered "c": the matcher follows exactly that output.
    matcher.commit([1, 2])
    assert matcher.num_committed == 2
    assert allowed(matcher.mask(())) == grammar_allowed_reference([1, 2]).nonzero()[:, 0].tolist()
    matcher.commit([1, 2, 3, 0])  # "bc", "ab", then "a" where "b" needs "c": rejected
    assert matcher.failure is not None
    assert allowed(matcher.mask(())) == [GRAMMAR_EOS]  # a failed matcher ends the request


def test_a_completed_grammar_allows_only_eos(compiler):
    matcher = compiler.matcher(compiler.compile(StructuredOutputsParams(choice=["ab"])))
    assert 3 in allowed(matcher.mask(()))
    matcher.commit([3])
    assert allowed(matcher.mask(())) == [GRAMMAR_EOS]
    assert matcher.stopped


def test_bitmask_apply_touches_only_named_rows():
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 70, generator=generator)
    words = torch.randint(-(2**31), 2**31 - 1, (2, 3), dtype=torch.int64, generator=generator)
    bitmask = words.to(torch.int32)
    rows = torch.tensor([2, 0])
    out = logits.clone()
    apply_bitmask(out, bitmask, rows)
    reference = logits.clone()
    apply_bitmask_ref(reference, bitmask, rows)
    assert torch.equal(out, reference)
    assert torch.equal(out[[1, 3]], logits[[1, 3]])
    for m, row in enumerate(rows.tolist()):
        for t in range(70):
            bit = (int(words[m, t // 32]) >> (t % 32)) & 1
            assert (out[row, t] == logits[row, t]) if bit else torch.isneginf(out[row, t])


def test_context_masks_constrained_rows_only_and_uses_each_rows_prefix():
    matchers = toy_grammar_matchers(2)
    raw = torch.randn(4, V, generator=torch.Generator().manual_seed(1))
    context = LogitsContext(
        [None, LogitsRules(logit_bias=((0, 1.0),)), None],
        [[0]] * 3,
        [[], [], []],
        [matchers[0], None, matchers[1]],
    )
    rows = torch.tensor([0, 1, 2, 2])
    prefix = torch.tensor([[1, -1], [1, 2], [-1, -1], [2, 3]])
    out = context.apply(raw, rows, prefix)
    for n, tokens in enumerate([[1], None, [], [2, 3]]):
        if tokens is None:  # unconstrained: its rules only
            assert torch.equal(out[n], raw[n] + torch.tensor([1.0] + [0.0] * (V - 1)))
            continue
        mask = grammar_allowed_reference(tokens)
        assert torch.equal(out[n][mask], raw[n][mask]), n
        assert bool(torch.isneginf(out[n][~mask]).all()), n
    assert LogitsContext.build([None], [[0]], [[]], [None]) is None


def test_a_grammar_wins_over_bans_that_would_empty_the_row(compiler):
    matcher = compiler.matcher(compiler.compile(StructuredOutputsParams(regex="b")))
    rules = LogitsRules(allowed_token_ids=(0,))  # bans "b", the only token the grammar allows
    out = LogitsContext([rules], [[0]], [[]], [matcher]).apply(torch.zeros(1, V))
    assert torch.isfinite(out[0]).nonzero().flatten().tolist() == [1]


def test_an_invalid_regex_is_one_readable_line(compiler):
    """The engine's (and so the server's) message: llguidance's reason, not its echo of the
    regex with carets over several lines."""
    with pytest.raises(ValueError) as error:
        compiler.compile(StructuredOutputsParams(regex="[0-9"))
    message = str(error.value)
    assert message == "invalid structured_outputs.regex: unclosed character class", message
