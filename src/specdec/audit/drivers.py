"""Drivers of the real code path: speculative and plain decoding of toy requests through the real
`sample` and `verify`, with per-check request seeds. Every draw goes through those functions
(hence `specdec.rng`); nothing here patches the real code or creates randomness.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import torch

from specdec.audit.laws import MarkovToy, Processing
from specdec.rng import Stream
from specdec.sampling import sample
from specdec.verify import VerifyResult, verify


def trial_seeds(name: str, seed: int, num_trials: int) -> torch.Tensor:
    """[N] int64 distinct request seeds for one check: a fixed mix of its name and `seed`."""
    mixed = ((zlib.crc32(name.encode()) << 32) ^ (seed * 0x9E3779B97F4A7C15)) % 2**64
    offset = mixed - 2**64 if mixed >= 2**63 else mixed
    # int64 addition wraps around, so the N seeds stay distinct in all 64 bits.
    return torch.arange(num_trials, dtype=torch.int64) + offset


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

    RNG: the draft stream at (Q, step) for each sampled draft, then what `verify` draws.
    """
    stream, step_rule = draft_key or default_draft_key(method)
    step = anchors if step_rule == "anchor" else 0
    prev, draft_ids, draft_logits = last_tokens, [], []
    for i in range(num_draft):
        raw = toy.draft_logits[prev]  # [N, V]
        if drafts == "sampled":
            out = sample(raw, seeds, anchors + i, **processing.kwargs(), stream=stream, step=step)
            draft_logits.append(out.processed_logits)
        else:
            out = sample(raw, seeds, anchors + i, temperature=0.0)
        prev = out.token_ids
        draft_ids.append(prev)
    draft_token_ids = torch.stack(draft_ids, dim=1)  # [N, K]
    context = torch.cat([last_tokens[:, None], draft_token_ids], dim=1)  # [N, K+1]
    return verify(
        toy.target_logits[context],
        draft_token_ids,
        torch.stack(draft_logits, dim=1) if draft_logits else None,
        seeds,
        anchors,
        **processing.kwargs(),
        method=method,
    )


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
) -> SpecRun:
    """Speculative decoding of N independent requests until each has emitted `num_tokens`.

    Request n continues after `toy.start_token` with its first generated token at
    positions[n]; each round is anchored at the position after the last emitted token.

    Args:
        seeds: [N] int64 request seeds.
        positions: [N] int64 first generated position of each request.
        method, drafts, num_draft, draft_key: as in `speculative_round`.
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
    return SpecRun(tokens[:, :num_tokens], first_accepted, num_rounds)


def plain_decode(
    toy: MarkovToy,
    processing: Processing,
    seeds: torch.Tensor,
    positions: torch.Tensor,
    num_tokens: int,
) -> torch.Tensor:
    """[N, L] int64: L tokens per request from `sample` on the target alone (Stream.TARGET)."""
    prev = torch.full((seeds.shape[0],), toy.start_token, dtype=torch.int64)
    out = []
    for j in range(num_tokens):
        prev = sample(toy.target_logits[prev], seeds, positions + j, **processing.kwargs())
        prev = prev.token_ids
        out.append(prev)
    return torch.stack(out, dim=1)
