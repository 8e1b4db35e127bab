"""A step's drafts: asking the drafter for them (`propose`), feeding them to the target with each
share's input token (`step_inputs`), and handing the drafter the target features of what was
committed (`deliver_features`). Never samples: draft noise is the drafter's (`Drafter.draw`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from specdec.drafters import DraftBatch, Drafter, Proposal, TargetFeatures
from specdec.engine.batch_constants import ConstantsCache
from specdec.engine.request import Request, logits_context
from specdec.engine.scheduler import ScheduledRequest
from specdec.models.attention import KVCache, cache_slots, move_kv
from specdec.runner import StepInput

_CPU = torch.device("cpu")


@dataclass(frozen=True, slots=True)
class StepDrafts:
    """One step's proposal, and for each request that got drafts (keyed by id(request)): its
    row of the proposal and its draft ids; for a tree proposal also each such request's parent
    list (`specdec.draft_tree`)."""

    proposal: Proposal
    rows: dict[int, tuple[int, list[int]]]
    parents: dict[int, list[int]] | None = None


def propose(
    drafter: Drafter | None, constants: ConstantsCache, scheduled: list[ScheduledRequest]
) -> StepDrafts | None:
    """Drafts for the decode shares with num_draft > 0 (None: no request got drafts)."""
    if drafter is None:
        return None
    shares = [s for s in scheduled if s.num_draft > 0]
    if not shares:
        return None
    requests = [s.request for s in shares]
    batch_constants = constants.get("draft", requests, _CPU)
    batch = DraftBatch(
        token_ids=[r.all_token_ids for r in requests],
        seeds=batch_constants.seeds,
        anchors=torch.tensor([r.num_tokens for r in requests], dtype=torch.int64),
        num_draft=torch.tensor([s.num_draft for s in shares], dtype=torch.int64),
        methods=[r.spec.method for r in requests],
        params=batch_constants.params,
        request_ids=[r.request_id for r in requests],
        context=logits_context(requests),
    )
    proposal = drafter.propose(batch)
    counts = proposal.num_draft.tolist()  # one device sync each for the whole batch
    draft_ids = proposal.draft_token_ids.tolist()
    rows = {
        id(request): (b, draft_ids[b][:n])
        for b, (request, n) in enumerate(zip(requests, counts, strict=True))
        if n
    }
    if not rows:
        return None
    parents = None
    if proposal.tree_parents is not None:
        table = proposal.tree_parents.tolist()
        parents = {key: table[b][: len(ids)] for key, (b, ids) in rows.items()}
    return StepDrafts(proposal, rows, parents)


def step_inputs(
    scheduled: list[ScheduledRequest],
    drafts: StepDrafts | None,
    all_rows: Callable[[Request, int], bool] | None = None,
) -> list[StepInput]:
    """The runner's input of every share: a decode round feeds the last token and its drafts
    (logits for all of them); a prefill chunk feeds its slice of the tokens (logits for the
    last one when the chunk completes the prompt, for all of them when `all_rows(request,
    start)` says so: prompt logprobs)."""
    draft_rows = drafts.rows if drafts is not None else {}
    inputs = []
    for share in scheduled:
        request = share.request
        last = request.num_tokens - 1
        if share.emits and request.num_computed_tokens >= last:  # not request.in_prefill
            tokens = [request.last_token_id]
            parents = None
            if draft_rows:
                entry = draft_rows.get(id(request))
                if entry is not None:
                    tokens += entry[1]
                    if drafts.parents is not None:
                        parents = drafts.parents[id(request)]
            inputs.append(StepInput(tokens, last, request.block_ids, len(tokens), parents))
        else:
            start = request.num_computed_tokens
            tokens = request.all_token_ids[start : start + share.num_query_tokens]
            rows = int(share.emits)
            if all_rows is not None and all_rows(request, start):
                rows = len(tokens)
            inputs.append(StepInput(tokens, start, request.block_ids, rows))
    return inputs


def deliver_features(
    drafter: Drafter,
    scheduled: list[ScheduledRequest],
    inputs: list[StepInput],
    features: list[torch.Tensor],
    num_rejected: list[int],
    paths: list[list[int] | None] | None = None,
) -> None:
    """Hands the drafter the target features of this step's committed query tokens (a prefill
    chunk; a round's input token and accepted drafts), never those of rejected drafts
    (`num_rejected[i]`: the rejected drafts of share i; for a tree round, `paths[i]` lists the
    accepted nodes, whose rows are 1 + node)."""
    request_ids, starts, kept = [], [], []
    for i, (share, step_input, rows, rejected) in enumerate(
        zip(scheduled, inputs, features, num_rejected, strict=True)
    ):
        if share.request.spec is None:
            continue
        request_ids.append(share.request.request_id)
        starts.append(step_input.start)
        if step_input.tree_parents is not None:
            path = paths[i] if paths is not None else None
            keep = [0] + [1 + node for node in (path or [])]
            kept.append(rows[torch.tensor(keep, device=rows.device)])
        else:
            kept.append(rows[: len(step_input.token_ids) - rejected])
    if request_ids:
        drafter.observe(TargetFeatures(request_ids, starts, kept))


def compact_path(
    kv_cache: KVCache, step_input: StepInput, path: list[int], block_size: int
) -> None:
    """Moves the K/V of a tree round's accepted nodes (verify-step tokens 1 + node, at cache
    positions start + 1 + node) into the consecutive positions start + 1 + i they now hold; the
    slots after them are rolled back by the commit like a chain's rejected drafts.

    Mutates: `kv_cache` at the target slots (every layer)."""
    moves = [(1 + node, 1 + i) for i, node in enumerate(path) if node != i]
    if not moves:
        return
    start, blocks = step_input.start, step_input.block_ids
    sources = cache_slots(blocks, [start + a for a, _ in moves], block_size)
    targets = cache_slots(blocks, [start + b for _, b in moves], block_size)
    device = kv_cache.k_cache.device
    move_kv(kv_cache, torch.from_numpy(sources).to(device), torch.from_numpy(targets).to(device))
