"""Structured outputs in the engine (CPU, the vocabulary-8 target with a byte-level tokenizer):
constrained outputs stay in the language; unconstrained requests of a mixed batch emit what they
emit alone; the overlapped / device-round loop gives the synchronous loop's tokens; draft trees
keep to the grammar (coupled: plain constrained decoding's tokens); n > 1, a
length limit before the grammar finishes, and bad constraints named before anything runs."""

from __future__ import annotations

import re

import pytest

from law_fixtures import GRAMMAR_TOKEN_TEXTS, PROMPT, save_vocab8_target, write_grammar_tokenizer
from specdec import LLM, SamplingParams, StructuredOutputsParams
from specdec.audit.laws import GRAMMAR_REGEX

CONSTRAINT = StructuredOutputsParams(regex=GRAMMAR_REGEX)
SPEC = {
    "method": "draft_model",
    "model": "truncated:1",
    "num_speculative_tokens": 2,
    "rejection_sample_method": "standard",
    "adaptive": False,  # K pinned: standard verification replays token for token
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = save_vocab8_target(tmp_path_factory.mktemp("vocab8-structured"))
    write_grammar_tokenizer(path)
    return path


def make(model_dir, **kwargs) -> LLM:
    return LLM(str(model_dir), max_model_len=32, block_size=4, **kwargs)


def text(token_ids) -> str:
    return b"".join(GRAMMAR_TOKEN_TEXTS[t] or b"?" for t in token_ids).decode()


def in_language_prefix(token_ids) -> bool:
    return re.fullmatch(r"(a|bc|cab)*(b|ca?)?", text(token_ids)) is not None


def params(seed: int, constrained: bool, max_tokens: int = 8, **kwargs) -> SamplingParams:
    return SamplingParams(
        temperature=1.0,
        seed=seed,
        max_tokens=max_tokens,
        ignore_eos=True,
        structured_outputs=CONSTRAINT if constrained else None,
        **kwargs,
    )


def test_mixed_batch_leaves_unconstrained_requests_alone(model_dir):
    llm = make(model_dir, speculative_config=SPEC)
    mixed = [params(s, s % 2 == 0) for s in range(8)]
    outs = llm.generate([PROMPT] * 8, mixed, use_tqdm=False)
    alone = llm.generate([PROMPT] * 4, [params(s, False) for s in (1, 3, 5, 7)], use_tqdm=False)
    for seed, out in enumerate(outs):
        tokens = out.outputs[0].token_ids
        assert len(tokens) == 8 and out.outputs[0].finish_reason == "length"
        if seed % 2 == 0:
            assert in_language_prefix(tokens), text(tokens)
    assert [outs[s].outputs[0].token_ids for s in (1, 3, 5, 7)] == [
        o.outputs[0].token_ids for o in alone
    ]
    assert any(not in_language_prefix(o.outputs[0].token_ids) for o in alone)  # the law differs


def test_overlapped_loop_equals_the_synchronous_loop(model_dir):
    batch = [params(s, s % 3 == 0) for s in range(6)]
    sync = make(model_dir, speculative_config=SPEC, async_scheduling=False)
    overlapped = make(model_dir, speculative_config=SPEC, async_scheduling=True)
    a = sync.generate([PROMPT] * 6, batch, use_tqdm=False)
    b = overlapped.generate([PROMPT] * 6, batch, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]
    plain = make(model_dir, speculative_config=None, async_scheduling=True)
    c = plain.generate([PROMPT] * 6, batch, use_tqdm=False)
    for out in c[::3]:
        assert in_language_prefix(out.outputs[0].token_ids)


@pytest.mark.parametrize("method", ["coupled", "standard"])
def test_tree_rounds_keep_to_the_grammar(model_dir, method):
    """Draft trees (synchronous path): each node's target row is masked by the grammar after
    its path; a coupled tree emits plain constrained decoding's tokens, a standard one stays
    in the language."""
    tree = {**SPEC, "rejection_sample_method": method, "tree": {"nodes": 6, "depth": 3, "topk": 2}}
    batch = [params(s, True, max_tokens=10) for s in range(6)]
    llm = make(model_dir, speculative_config=tree, async_scheduling=False)
    outs = [o.outputs[0].token_ids for o in llm.generate([PROMPT] * 6, batch, use_tqdm=False)]
    assert all(in_language_prefix(tokens) for tokens in outs), [text(t) for t in outs]
    assert llm.get_metrics()["num_accepted_tokens"] > 0
    if method == "coupled":
        plain = make(model_dir, speculative_config=None, async_scheduling=False)
        assert outs == [
            o.outputs[0].token_ids for o in plain.generate([PROMPT] * 6, batch, use_tqdm=False)
        ]


def test_n_samples_each_follow_the_grammar(model_dir):
    llm = make(model_dir, speculative_config=SPEC)
    out = llm.generate(PROMPT, params(3, True, n=3), use_tqdm=False)[0]
    assert len(out.outputs) == 3
    assert all(in_language_prefix(c.token_ids) for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1


def test_a_choice_finishes_with_stop_and_a_long_regex_with_length(model_dir):
    llm = make(model_dir, speculative_config=SPEC)
    choice = SamplingParams(
        temperature=1.0,
        seed=1,
        max_tokens=8,
        structured_outputs=StructuredOutputsParams(choice=["ab", "bcab"]),
    )
    out = llm.generate(PROMPT, choice, use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.text in ("ab", "bcab")
    limited = llm.generate(PROMPT, params(2, True), use_tqdm=False)[0].outputs[0]
    assert limited.finish_reason == "length" and len(limited.token_ids) == 8


@pytest.mark.parametrize(
    ("constraint", "words"),
    [
        ({"regex": "[a-"}, "invalid structured_outputs.regex"),
        ({"regex": "z+"}, "allows no output"),
        ({"json": {"type": "nope"}}, "invalid structured_outputs.json"),
    ],
)
def test_bad_constraints_raise_before_running(model_dir, constraint, words):
    llm = make(model_dir)
    bad = SamplingParams(structured_outputs=StructuredOutputsParams(**constraint))
    with pytest.raises(ValueError, match=words):
        llm.generate(PROMPT, bad, use_tqdm=False)
    assert not llm.engine.has_unfinished
    assert llm.generate(PROMPT, SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0]


@pytest.mark.parametrize("defer", ["after the read", "before it (negative control)"])
def test_constrained_requests_stay_on_the_overlapped_plain_loop(model_dir, monkeypatch, defer):
    """Plain decoding with async_scheduling: a batch of constrained and unconstrained requests
    runs every step overlapped (none synchronous); a step holding a constrained request is
    sampled once the step before it is read, so its mask follows the token in flight, and every
    request emits the synchronous loop's tokens. Negative control: sampled before that read
    (the grammar one token behind), the constrained requests leave the synchronous tokens."""
    from specdec.engine.overlapped_loop import OverlappedLoop

    if defer != "after the read":
        original = OverlappedLoop._launch_and_resolve

        def sample_first(self, scheduled, inflight, only_finished, measured=False):
            if not scheduled:
                return original(self, scheduled, inflight, only_finished, measured)
            forward = self._launch_forward(scheduled, inflight, measured)
            self._inflight = self._launch_sample(forward, True)  # the grammar a token behind
            return self._resolve(inflight, only_finished)

        monkeypatch.setattr(OverlappedLoop, "_launch_and_resolve", sample_first)
    batch = [params(s, s % 2 == 0) for s in range(6)]
    sync = make(model_dir, speculative_config=None, async_scheduling=False)
    overlapped = make(model_dir, speculative_config=None, async_scheduling=True)
    a = sync.generate([PROMPT] * 6, batch, use_tqdm=False)
    b = overlapped.generate([PROMPT] * 6, batch, use_tqdm=False)
    loop = overlapped.get_metrics()["loop"]
    assert loop["num_sync_steps"] == 0 and loop["num_overlapped_steps"] > 0
    same = [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]
    if defer == "after the read":
        assert same
        assert all(in_language_prefix(o.outputs[0].token_ids) for o in b[::2])
    else:
        assert not same


def test_constrained_requests_decode_beside_the_device_rounds(model_dir):
    """Under the CUDA engine's loop (device rounds op by op, the adaptive policy, coupled
    verification), constrained requests decode beside the rounds, one plain token a step
    between two rounds, while the unconstrained ones take the rounds (s43; a grammar used to
    keep the whole batch out of them). Every request emits plain decoding's tokens; the
    constrained ones stay in the language; no step is synchronous."""
    spec = {**SPEC, "rejection_sample_method": "coupled", "adaptive": True}
    batch = [params(s, s % 3 == 0, max_tokens=12) for s in range(9)]
    rounds = make(model_dir, speculative_config=spec, async_scheduling=True)
    got = rounds.generate([PROMPT] * 9, batch, use_tqdm=False)
    plain = make(model_dir, speculative_config=None, async_scheduling=True)
    expected = plain.generate([PROMPT] * 9, batch, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in expected]
    assert all(in_language_prefix(o.outputs[0].token_ids) for o in got[::3])
    loop = rounds.get_metrics()["loop"]
    assert loop["num_device_rounds"] > 0 and loop["num_sync_steps"] == 0
    assert loop["num_side_rows"] > 0  # the constrained ones decoded beside the rounds
    assert rounds.engine._rounds.num_rows < 9  # the constrained ones held no slot
