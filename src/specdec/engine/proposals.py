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
from specdec.runner import StepInput

_CPU = torch.device("cpu")


@dataclass(frozen=True, slots=True)
class StepDrafts:
    """One step's proposal, and for each request that got drafts (keyed by id(request)): its
    row of the proposal and its draft ids."""

    proposal: Proposal
    rows: dict[int, tuple[int, list[int]]]


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
    return StepDrafts(proposal, rows) if rows else None


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
            if draft_rows:
                entry = draft_rows.get(id(request))
                if entry is not None:
                    tokens += entry[1]
            inputs.append(StepInput(tokens, last, request.block_ids, len(tokens)))
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
) -> None:
    """Hands the drafter the target features of this step's committed query tokens (a prefill
    chunk; a round's input token and accepted drafts), never those of rejected drafts
    (`num_rejected[i]`: the rejected drafts of share i)."""
    request_ids, starts, kept = [], [], []
    for share, step_input, rows, rejected in zip(
        scheduled, inputs, features, num_rejected, strict=True
    ):
        if share.request.spec is None:
            continue
        request_ids.append(share.request.request_id)
        starts.append(step_input.start)
        kept.append(rows[: len(step_input.token_ids) - rejected])
    if request_ids:
        drafter.observe(TargetFeatures(request_ids, starts, kept))
