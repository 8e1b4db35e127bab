"""Drivers of the real code path: speculative and plain decoding of toy requests through the real
`sample` and `verify`, with per-check request seeds. Every draw goes through those functions
(hence `specdec.rng`); nothing here patches the real code or creates randomness.
"""

from __future__ import annotations

import functools
import zlib
from dataclasses import dataclass

import torch

from specdec.audit.laws import (
    GRAMMAR_EOS,
    GRAMMAR_REGEX,
    GRAMMAR_TOKENS,
    PROMPT,
    MarkovToy,
    Processing,
)
from specdec.rng import Stream
from specdec.sampling import LogitsContext, LogitsRules, sample
from specdec.sampling.grammar import GrammarCompiler, GrammarMatcher
from specdec.sampling.structured import StructuredOutputsParams
from specdec.verify import VerifyResult, check_verify_inputs, verify, verify_checked


def trial_seeds(name: str, seed: int, num_trials: int) -> torch.Tensor:
    """[N] int64 distinct request seeds for one check: a fixed mix of its name and `seed`."""
    mixed = ((zlib.crc32(name.encode()) << 32) ^ (seed * 0x9E3779B97F4A7C15)) % 2**64
    offset = mixed - 2**64 if mixed >= 2**63 else mixed
    # int64 addition wraps around, so the N seeds stay distinct in all 64 bits.
    return torch.arange(num_trials, dtype=torch.int64) + offset


@functools.cache
def _toy_grammar():
    compiler = GrammarCompiler.from_token_bytes(GRAMMAR_TOKENS, GRAMMAR_EOS)
    return compiler, compiler.compile(StructuredOutputsParams(regex=GRAMMAR_REGEX))


def toy_grammar_matchers(num_requests: int) -> list[GrammarMatcher]:
    """Fresh matchers of `laws.GRAMMAR_REGEX` over `laws.GRAMMAR_TOKENS`, compiled by the real
    grammar code (llguidance), one per request (no prefetch thread: the toys' steps are tiny)."""
    compiler, grammar = _toy_grammar()
    return [compiler.matcher(grammar, prefetch=False) for _ in range(num_requests)]


def start_positions(num_trials: int) -> torch.Tensor:
    """[N] int64 first generated position of each request (varied, so the keys vary too)."""
    return 1 + torch.arange(num_trials, dtype=torch.int64) % 1009


def default_draft_key(method: str) -> tuple[Stream, str]:
    """DESIGN.md's draft key: (TARGET, step 0) for coupled, else (DRAFT, step = round anchor)."""
    return (Stream.TARGET, "zero") if method == "coupled" else (Stream.DRAFT, "anchor")


def speculative_round(
    toy: MarkovToy,
    processing: Processing,
    seeds: torch.Tensor,
    anchors: torch.Tensor,
    last_tokens: torch.Tensor,
    *,
    method: str,
    drafts: str,
    num_draft: int,
    draft_key: tuple[Stream, str] | None = None,
    rules: LogitsRules | None = None,
    outputs: list[list[int]] | None = None,
    grammars: list[GrammarMatcher] | None = None,
    unmasked_drafts: bool = False,
) -> VerifyResult:
    """One round for every row: K drafts from `sample`, then `verify` on [last + drafts].

    Args:
        seeds: [N] int64 request seeds.
        anchors: [N] int64 position of each row's first draft (the round anchor).
        last_tokens: [N] int64 token before the anchor.
        method: "standard", "block" or "coupled".
        drafts: "sampled" (draft_logits = the processed logits `sample` drew them from) or
            "one_hot" (greedy drafts, draft_logits = None).
        draft_key: (stream, "anchor" | "zero") for draft noise; None = `default_draft_key`.
            Only negative controls override it.
        rules: penalties and bans of every row (prompt `laws.PROMPT`), or None; draft i is
            processed with drafts 0..i-1 as context, as `Drafter.draw` does, and `verify` gets
            the context.
        outputs: per row, the tokens it has emitted so far (with `rules` or `grammars`).
        grammars: per row, its grammar matcher at `outputs` (structured outputs), or None;
            drafts and verify rows are masked like the rules above.
        unmasked_drafts: a negative control: drafts sampled from logits without the context,
            while the processed logits given to `verify` are the masked ones.

    RNG: the draft stream at (Q, step) for each sampled draft, then what `verify` draws.
    """
    stream, step_rule = draft_key or default_draft_key(method)
    step = anchors if step_rule == "anchor" else 0
    rules_context = None
    if rules is not None or grammars is not None:
        num_rows = seeds.shape[0]
        rules_context = LogitsContext([rules] * num_rows, [PROMPT] * num_rows, outputs, grammars)
    prev, draft_ids, draft_logits = last_tokens, [], []
    for i in range(num_draft):
        raw = unprocessed = toy.draft_logits[prev]  # [N, V]
        if rules_context is not None:
            before = torch.stack(draft_ids, 1) if draft_ids else None
            raw = rules_context.apply(raw, prefix=before)
        if drafts == "sampled":
            drawn_from = unprocessed if unmasked_drafts else raw
            kwargs = {**processing.kwargs(), "stream": stream, "step": step}
            out = sample(drawn_from, seeds, anchors + i, **kwargs)
            if unmasked_drafts:
                recorded = sample(raw, seeds, anchors + i, **kwargs).processed_logits
                out = type(out)(out.token_ids, recorded, out.logsumexp)
            draft_logits.append(out.processed_logits)
        else:
            out = sample(raw, seeds, anchors + i, temperature=0.0)
        prev = out.token_ids
        draft_ids.append(prev)
    draft_token_ids = torch.stack(draft_ids, dim=1)  # [N, K]
    context = torch.cat([last_tokens[:, None], draft_token_ids], dim=1)  # [N, K+1]
    args = (
        toy.target_logits[context],
        draft_token_ids,
        torch.stack(draft_logits, dim=1) if draft_logits else None,
        seeds,
        anchors,
    )
    kwargs = {**processing.kwargs(), "method": method, "context": rules_context}
    if unmasked_drafts:  # the control's drafts may lie outside their recorded law: no checks
        return verify_checked(check_verify_inputs(*args, **kwargs, check_values=False))
    return verify(*args, **kwargs)


@dataclass(frozen=True, slots=True)
class SpecRun:
    """What `speculative_decode` returns.

    Attributes:
        tokens: [N, L] int64 the first L emitted tokens of each request.
        first_accepted: [N] int64 drafts accepted in each request's first round.
        num_rounds: rounds until every request had emitted L tokens.
    """

    tokens: torch.Tensor
    first_accepted: torch.Tensor
    num_rounds: int


def speculative_decode(
    toy: MarkovToy,
    processing: Processing,
    seeds: torch.Tensor,
    positions: torch.Tensor,
    *,
    method: str,
    drafts: str,
    num_draft: int,
    num_tokens: int,
    draft_key: tuple[Stream, str] | None = None,
    rules: LogitsRules | None = None,
    grammars: list[GrammarMatcher] | None = None,
    unmasked_drafts: bool = False,
) -> SpecRun:
    """Speculative decoding of N independent requests until each has emitted `num_tokens`.

    Request n continues after `toy.start_token` with its first generated token at
    positions[n]; each round is anchored at the position after the last emitted token.

    Args:
        seeds: [N] int64 request seeds.
        positions: [N] int64 first generated position of each request.
        method, drafts, num_draft, draft_key, rules, unmasked_drafts: as in
            `speculative_round`.
        grammars: per request, a fresh grammar matcher; each follows its request's output.
        num_tokens: L, tokens to emit per request.
    """
    num_trials = seeds.shape[0]
    tokens = torch.full((num_trials, num_tokens + num_draft), -1, dtype=torch.int64)
    count = torch.zeros(num_trials, dtype=torch.int64)
    last = torch.full((num_trials,), toy.start_token, dtype=torch.int64)
    anchors = positions.clone()
    first_accepted = torch.full((num_trials,), -1, dtype=torch.int64)
    num_rounds = 0
    columns = torch.arange(num_draft + 1)
    while bool((count < num_tokens).any()):
        live = (count < num_tokens).nonzero().squeeze(1)
        outputs = None
        if rules is not None or grammars is not None:
            emitted_so_far = zip(tokens[live].tolist(), count[live].tolist(), strict=True)
            outputs = [row[:n] for row, n in emitted_so_far]
        live_grammars = None if grammars is None else [grammars[n] for n in live.tolist()]
        result = speculative_round(
            toy,
            processing,
            seeds[live],
            anchors[live],
            last[live],
            method=method,
            drafts=drafts,
            num_draft=num_draft,
            draft_key=draft_key,
            rules=rules,
            outputs=outputs,
            grammars=live_grammars,
            unmasked_drafts=unmasked_drafts,
        )
        emitted = result.num_accepted + 1
        if num_rounds == 0:
            first_accepted[live] = result.num_accepted
        keep = columns[None, :] < emitted[:, None]  # [n, K+1]
        rows = live[:, None].expand_as(keep)
        tokens[rows[keep], (count[live, None] + columns)[keep]] = result.token_ids[keep]
        last[live] = result.token_ids.gather(1, result.num_accepted[:, None]).squeeze(1)
        anchors[live] += emitted
        count[live] += emitted
        num_rounds += 1
        if live_grammars is not None:
            for grammar, row, n in zip(
                live_grammars, tokens[live].tolist(), count[live].tolist(), strict=True
            ):
                grammar.commit(row[:n])
    return SpecRun(tokens[:, :num_tokens], first_accepted, num_rounds)


def plain_decode(
    toy: MarkovToy,
    processing: Processing,
    seeds: torch.Tensor,
    positions: torch.Tensor,
    num_tokens: int,
    rules: LogitsRules | None = None,
    grammars: list[GrammarMatcher] | None = None,
) -> torch.Tensor:
    """[N, L] int64: L tokens per request from `sample` on the target alone (Stream.TARGET),
    with `rules` (prompt `laws.PROMPT`) and `grammars` (per request, a fresh matcher) applied
    to each position with the tokens before it."""
    num_rows = seeds.shape[0]
    prev = torch.full((num_rows,), toy.start_token, dtype=torch.int64)
    out = []
    for j in range(num_tokens):
        context = None
        if rules is not None or grammars is not None:
            history = torch.stack(out, dim=1).tolist() if out else [[] for _ in range(num_rows)]
            if grammars is not None:
                for grammar, row in zip(grammars, history, strict=True):
                    grammar.commit(row)
            context = LogitsContext([rules] * num_rows, [PROMPT] * num_rows, history, grammars)
        prev = sample(
            toy.target_logits[prev], seeds, positions + j, **processing.kwargs(), context=context
        )
        prev = prev.token_ids
        out.append(prev)
    return torch.stack(out, dim=1)
