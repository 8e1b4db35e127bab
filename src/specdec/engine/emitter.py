"""Turns a step's logits into emitted tokens: one sampler call for the shares without drafts, one
verifier call per verify method for the shares with drafts. Every emitted token comes from
`specdec.sampling.sample` or `specdec.verify.verify`; nothing here draws randomness itself.

A share whose step read a logits row without a distribution (all NaN or -inf, or a +inf: a
failed forward pass) emits nothing: its `Emission` names the position instead, read back with
the step's tokens, and the engine ends that request alone (finish_reason "error").
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
from torch.nn.utils.rnn import pad_sequence

from specdec.engine.batch_constants import ConstantsCache
from specdec.engine.proposals import StepDrafts
from specdec.engine.request import Request, logits_context
from specdec.engine.request_rules import RequestRules
from specdec.engine.scheduler import ScheduledRequest
from specdec.sampling import sample
from specdec.sampling.processing import unusable_rows
from specdec.transfer import to_device
from specdec.verify import (
    VERIFY_METHODS,
    check_verify_inputs,
    first_unusable_read_depth,
    first_unusable_read_row,
    verify_checked,
)
from specdec.verify.tree import verify_tree
from specdec.verify.tree_inputs import tree_context_target_logits


@dataclass(frozen=True, slots=True)
class Emission:
    """One share's result of a step.

    Attributes:
        tokens: the emitted tokens (accepted drafts, then the sampled, recovered or bonus one).
        num_draft: drafts verified (0: plain sampling).
        num_accepted: drafts accepted.
        rows: the share's raw target logits [num_draft + 1, V]; the first len(tokens) rows are the
            emitted tokens' distributions (None when the step's logits were not kept).
        path: for a tree round, the accepted nodes (root side first); None for a chain.
        unusable_position: the position Q of the first token whose logits row the step read
            had no distribution (then `tokens` is empty, `num_accepted` 0, and the request
            ends with an error); None otherwise.
        logprobs: the emitted tokens' logprob entries when they were computed on the device
            and read with the tokens (the overlapped loop; `rows` is None then).
    """

    tokens: list[int]
    num_draft: int
    num_accepted: int
    rows: torch.Tensor | None
    path: list[int] | None = None
    unusable_position: int | None = None
    logprobs: list[dict] | None = None

    @property
    def num_rejected(self) -> int:
        return self.num_draft - self.num_accepted


class Emitter:
    """Samples or verifies the emitting shares of a step, keeping the batches' constants."""

    def __init__(self, rule_rows: int = 0) -> None:
        """`rule_rows`: rows of device-held logits rules for plain steps (`RequestRules`,
        built on first use; 0: none, every step builds a `LogitsContext`)."""
        self.constants = ConstantsCache()
        self._rule_rows = rule_rows
        self.request_rules: RequestRules | None = None

    def emit(
        self,
        scheduled: list[ScheduledRequest],
        logits: list[torch.Tensor],
        drafts: StepDrafts | None,
    ) -> list[Emission | None]:
        """Per share, its `Emission` (None for a prefill chunk that emits nothing)."""
        emitted: list[Emission | None] = [None] * len(scheduled)
        plain: list[int] = []
        spec: dict[str, list[int]] = {}
        draft_rows = drafts.rows if drafts is not None else {}
        trees = drafts.parents if drafts is not None and drafts.parents is not None else {}
        tree_groups: dict[str, list[int]] = {}
        for i, share in enumerate(scheduled):
            if not share.emits:
                continue
            if id(share.request) in trees:
                tree_groups.setdefault(share.request.spec.method, []).append(i)
            elif draft_rows and id(share.request) in draft_rows:
                spec.setdefault(share.request.spec.method, []).append(i)
            else:
                plain.append(i)
        if plain:
            self._sample_plain(plain, scheduled, logits, emitted)
        for method in VERIFY_METHODS:
            if method in spec:
                self._verify_group(spec[method], scheduled, logits, drafts, method, emitted)
            if method in tree_groups:
                self._verify_tree_group(
                    tree_groups[method], scheduled, logits, drafts, method, emitted
                )
        return emitted

    def _verify_tree_group(
        self,
        indices: list[int],
        scheduled: list[ScheduledRequest],
        logits: list[torch.Tensor],
        drafts: StepDrafts,
        method: str,
        emitted: list[Emission | None],
    ) -> None:
        """Verifies the draft trees of the shares in `indices` (all of `method`) with one
        `verify_tree` call; sets their entries of `emitted` (with their accepted paths)."""
        requests = [scheduled[i].request for i in indices]
        entries = [drafts.rows[id(r)] for r in requests]
        counts = [len(ids) for _, ids in entries]
        n = max(counts)
        target_rows = [logits[i] for i in indices]
        target = pad_sequence(target_rows, batch_first=True)  # [B, N+1, V]
        device = target.device
        context = logits_context(requests)
        if context is not None:  # each node's row by its path's rules (the walk reads these)
            tree_parents = [drafts.parents[id(r)] for r in requests]
            target = tree_context_target_logits(
                target, [ids for _, ids in entries], tree_parents, context
            )
        parents = [
            drafts.parents[id(r)] + [-1] * (n - c) for r, c in zip(requests, counts, strict=True)
        ]
        positions, num_nodes, flat_ids, flat_parents = _device_int64(
            [r.num_tokens for r in requests],
            counts,
            [t for _, ids in entries for t in ids + [0] * (n - len(ids))],
            [p for row in parents for p in row],
            device=device,
        )
        draft_logits = None
        if drafts.proposal.draft_logits is not None:
            rows = [b for b, _ in entries]
            draft_logits = _draft_rows(drafts.proposal.draft_logits, rows, counts, n).to(device)
            for b, c in enumerate(counts):
                if c < n:
                    draft_logits[b, c:] = float("-inf")
        constants = self.constants.get(method, requests, device)
        params = constants.params
        out = verify_tree(
            target,
            flat_parents.view(len(requests), n),
            flat_ids.view(len(requests), n),
            draft_logits,
            constants.seeds,
            positions,
            temperature=params.temperature,
            top_k=params.top_k,
            top_p=params.top_p,
            min_p=params.min_p,
            num_nodes=num_nodes,
            method=method,
            check_values=False,  # valid by construction; unusable rows are looked for below
        )
        bad_depth = first_unusable_read_depth(target, out)
        batch = len(requests)
        # One device sync for the group: accepted counts, bad depths, tokens, paths.
        host = torch.cat(
            [out.num_accepted, bad_depth, out.token_ids.flatten(), out.accepted_nodes.flatten()]
        ).tolist()
        host_accepted, host_bad = host[:batch], host[batch : 2 * batch]
        host_tokens = _split_rows(host[2 * batch :], batch, n + 1)
        host_paths = _split_rows(host[2 * batch + batch * (n + 1) :], batch, n)
        for i, request, tokens, accepted, bad, path, c in zip(
            indices, requests, host_tokens, host_accepted, host_bad, host_paths, counts,
            strict=True,
        ):  # fmt: skip
            if bad >= 0:
                emitted[i] = Emission([], c, 0, None, unusable_position=request.num_tokens + bad)
                continue
            path = path[:accepted]
            rows = logits[i][torch.tensor([0] + [1 + node for node in path])]
            emitted[i] = Emission(tokens[: accepted + 1], c, accepted, rows, path)

    def _sample_plain(
        self,
        indices: list[int],
        scheduled: list[ScheduledRequest],
        logits: list[torch.Tensor],
        emitted: list[Emission | None],
    ) -> None:
        """Samples one token for each share in `indices` (no drafts) with one sampler call; sets
        their entries of `emitted`."""
        requests = [scheduled[i].request for i in indices]
        row_logits = [logits[i] for i in indices]  # [1, V] each: one logit row was asked for
        rows = row_logits[0] if len(row_logits) == 1 else torch.cat(row_logits)  # [B, V]
        tokens, unusable = self.sample_rows(requests, rows)
        # One device sync for the batch: the tokens and the unusable flags together.
        sampled, bad = torch.stack([tokens, unusable.to(torch.int64)]).tolist()
        for i, request, token, row, unusable_row in zip(
            indices, requests, sampled, row_logits, bad, strict=True
        ):
            if unusable_row:
                emitted[i] = Emission([], 0, 0, row, unusable_position=request.num_tokens)
            else:
                emitted[i] = Emission([token], 0, 0, row)

    def sample_rows(
        self, requests: list[Request], rows: torch.Tensor, prefix: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Samples one token per [B, V] logit row at each request's next position.

        `prefix` ([B, 1] int64 on the device, -1 where none): a token each row's request has
        emitted after its output as the host knows it (sampled by a step not read yet: the
        overlapped loop), which its logits rules count as output (`LogitsContext.apply`).

        Returns:
            ([B] int64 tokens, [B] bool unusable), both on the device, not read by the host.
            An unusable row (no finite logit or a +inf one, after the requests' logits rules;
            or a processed row without a finite log-normaliser) has no distribution: its token
            is a valid id that must never be emitted.
        """
        constants = self.constants.get("plain", requests, rows.device)
        index = self._rule_rows_of(requests, rows)
        if index is not None:
            rows = self.request_rules.apply(rows, index, prefix)
        else:
            context = logits_context(requests)
            if context is not None:
                rows = context.apply(rows, prefix=prefix)
        if constants.greedy:
            # All greedy: `sample` would take the first maximum with NaN as -inf and no noise
            # (the filters never remove the maximum). Two kernels instead of the sampler's
            # setup; the maximum also says whether the row has a distribution.
            inf = float("inf")
            top, tokens = rows.nan_to_num(nan=-inf, posinf=inf, neginf=-inf).max(dim=-1)
            return tokens, ~torch.isfinite(top)
        unusable = None
        if not rows.is_cuda:
            # The PyTorch sampler refuses such rows: they draw from a harmless row instead
            # (asking costs no device sync here). The CUDA sampler takes them as they are
            # (check_values=False) and gives them a non-finite log-normaliser.
            unusable = unusable_rows(rows)
            if bool(unusable.any()):
                rows = rows.masked_fill(unusable[:, None], 0.0)
        params = constants.params
        out = sample(
            rows,
            constants.seeds,
            to_device([r.num_tokens for r in requests], torch.int64, rows.device),
            temperature=params.temperature,
            top_k=params.top_k,
            top_p=params.top_p,
            min_p=params.min_p,
            check_values=False,  # parameters validated by SamplingParams, keys by the engine
        )
        no_distribution = ~torch.isfinite(out.logsumexp)
        if unusable is not None:
            no_distribution |= unusable
        return out.token_ids, no_distribution

    def _rule_rows_of(self, requests: list[Request], rows: torch.Tensor) -> torch.Tensor | None:
        """The requests' rows of device-held rules (`RequestRules.rows_for`), or None where
        the step builds a `LogitsContext` (no request has rules, none are kept, or the batch
        holds what the rows cannot: a grammar, a multi-token bad word)."""
        if not self._rule_rows or not any(r.rules is not None for r in requests):
            return None
        if self.request_rules is None:
            self.request_rules = RequestRules(self._rule_rows, rows.shape[-1], rows.device)
        return self.request_rules.rows_for(requests)

    def _verify_group(
        self,
        indices: list[int],
        scheduled: list[ScheduledRequest],
        logits: list[torch.Tensor],
        drafts: StepDrafts,
        method: str,
        emitted: list[Emission | None],
    ) -> None:
        """Verifies the drafts of the shares in `indices` (all of `method`) with one verifier
        call; sets their entries of `emitted`."""
        requests = [scheduled[i].request for i in indices]
        entries = [drafts.rows[id(r)] for r in requests]  # (proposal row, draft ids)
        counts = [len(ids) for _, ids in entries]
        k = max(counts)
        # [B, K+1, V], zero-padded past each request's drafts (one copy: pad_sequence copies
        # row by row, so it is kept for ragged groups only).
        target_rows = [logits[i] for i in indices]
        if min(counts) == k:
            target = torch.stack(target_rows)
        else:
            target = pad_sequence(target_rows, batch_first=True)
        device = target.device
        positions, num_draft, flat_ids = _device_int64(
            [r.num_tokens for r in requests],
            counts,
            [t for _, ids in entries for t in ids + [-1] * (k - len(ids))],
            device=device,
        )
        draft_logits = draft_logsumexp = None
        proposal = drafts.proposal
        if proposal.draft_logits is not None:
            rows = [b for b, _ in entries]
            draft_logits = _draft_rows(proposal.draft_logits, rows, counts, k).to(device)
            if proposal.draft_logsumexp is not None:
                draft_logsumexp = _draft_rows(proposal.draft_logsumexp, rows, counts, k).to(device)
        constants = self.constants.get(method, requests, device)
        params = constants.params
        # Valid by construction (ids from the drafter, params from SamplingParams): skip the
        # value checks' host round trip.
        inputs = check_verify_inputs(
            target,
            flat_ids.view(len(requests), k),
            draft_logits,
            constants.seeds,
            positions,
            temperature=params.temperature,
            top_k=params.top_k,
            top_p=params.top_p,
            min_p=params.min_p,
            num_draft=num_draft,
            method=method,
            draft_logsumexp=draft_logsumexp,
            check_values=False,
            context=logits_context(requests),
        )
        out = verify_checked(inputs)
        bad_row = first_unusable_read_row(inputs.target_logits, num_draft, out.num_accepted)
        batch = len(requests)
        # One device sync for the whole group: accepted counts, bad rows, tokens.
        host = torch.cat([out.num_accepted, bad_row, out.token_ids.flatten()]).tolist()
        host_accepted, host_bad = host[:batch], host[batch : 2 * batch]
        host_tokens = _split_rows(host[2 * batch :], batch, k + 1)
        for i, request, tokens, accepted, bad, n in zip(
            indices, requests, host_tokens, host_accepted, host_bad, counts, strict=True
        ):
            if bad >= 0:
                position = request.num_tokens + bad
                emitted[i] = Emission([], n, 0, logits[i], unusable_position=position)
            else:
                emitted[i] = Emission(tokens[: accepted + 1], n, accepted, logits[i])


def _split_rows(values: list[int], num_rows: int, width: int) -> list[list[int]]:
    """A flat host list as `num_rows` rows of `width` values."""
    return [values[row * width : (row + 1) * width] for row in range(num_rows)]


def _device_int64(*columns: list[int], device: torch.device) -> list[torch.Tensor]:
    """int64 tensors of host columns on `device`, sent with one copy."""
    packed = to_device(list(itertools.chain.from_iterable(columns)), torch.int64, device)
    return list(packed.split_with_sizes([len(column) for column in columns]))


def _draft_rows(values: torch.Tensor, rows: list[int], counts: list[int], k: int) -> torch.Tensor:
    """[len(rows), k, ...] entries of the given rows of a proposal's [B, K, ...] draft tensor
    (draft logits or their log-normalisers), zero past each row's `counts` drafts (what padding
    each row's own drafts to k gives)."""
    if min(counts) == k and rows == list(range(values.shape[0])):
        return values[:, :k].contiguous()  # the whole proposal: no gather
    picked = values[to_device(rows, torch.int64, values.device), :k]  # a copy
    for b, n in enumerate(counts):
        if n < k:
            picked[b, n:] = 0
    return picked
