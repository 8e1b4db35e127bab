"""The target features of the overlapped loop's steps, kept for the drafter until it drafts.

A speculative request decoding in the overlapped loop (its prefill, its plain rows while the
policy keeps the batch out of the device rounds) drafts nothing, but its drafter must see the
target features of every token before it drafts again. Handing them over at each step's read
costs the host a call and a copy per step; the log keeps them on the device instead (each
step's decode rows as one [B, F] tensor, each prefill chunk's rows as they came) and hands them
over in one call, per request in position order, when the drafter is about to read them
(`flush`: entering the rounds, seating requests in them) or when it has held `MAX_STEPS` steps.
"""

from __future__ import annotations

import torch

from specdec.drafters import Drafter, TargetFeatures
from specdec.engine.request import Request

# Steps held before the log hands them over unasked (bounds its device memory: [B, F] a step).
MAX_STEPS = 64


class FeatureLog:
    """Target features of read overlapped steps, not yet handed to the drafter, in read order.

    Entries are of two kinds: a decode step's rows ([B, F], row b the feature of requests[b]'s
    token at starts[b]) and a mixed step's chunks (per request, its first position and [n, F]).
    Requests that finished by the time of `flush` are skipped (their drafter state is gone), as
    are requests that do not speculate; what a released request (`drop`: preempted) had logged is
    forgotten at once, what it logs after (its recomputed prefix) is kept."""

    def __init__(self, drafter: Drafter | None) -> None:
        self.drafter = drafter
        self._entries: list[tuple[list[Request], list[int], torch.Tensor | list[torch.Tensor]]] = []

    def __len__(self) -> int:
        return len(self._entries)

    def add_rows(self, requests: list[Request], starts: list[int], rows: torch.Tensor) -> None:
        """A decode step's features: rows[b] is requests[b]'s token at starts[b]."""
        self._entries.append((requests, starts, rows))
        if len(self._entries) >= MAX_STEPS:
            self.flush()

    def add_chunks(self, chunks: list[tuple[Request, int, torch.Tensor]]) -> None:
        """A mixed step's features: per request, (request, first position, [n, F])."""
        if chunks:
            self._entries.append(
                ([c[0] for c in chunks], [c[1] for c in chunks], [c[2] for c in chunks])
            )
            if len(self._entries) >= MAX_STEPS:
                self.flush()

    def drop(self, request: Request) -> None:
        """Forgets what the log holds of `request` (released by the drafter: preempted). Only
        the entries logged so far: once resumed, the features of its recomputed prefix are the
        drafter's again (until s43 a mark kept until the next flush dropped them too, and a
        request preempted and resumed between two flushes reached the rounds with none)."""
        kept = []
        for requests, starts, rows in self._entries:
            keep = [i for i, r in enumerate(requests) if r is not request]
            if len(keep) == len(requests):
                kept.append((requests, starts, rows))
            elif keep and isinstance(rows, list):
                kept.append(
                    (
                        [requests[i] for i in keep],
                        [starts[i] for i in keep],
                        [rows[i] for i in keep],
                    )
                )
            elif keep:
                index = torch.tensor(keep, device=rows.device)
                kept.append(([requests[i] for i in keep], [starts[i] for i in keep], rows[index]))
        self._entries = kept

    def flush(self) -> None:
        """Hands every held feature to the drafter: one `observe` call, each request's rows
        joined in position order. Consecutive decode steps of one batch are stacked first (one
        copy for the run, not one a step)."""
        entries, self._entries = self._entries, []
        if not entries:
            return
        pieces: dict[int, tuple[Request, int, list[torch.Tensor]]] = {}

        def take(request: Request, start: int, rows: torch.Tensor) -> None:
            if request.spec is None or request.status.finished:
                return
            held = pieces.get(id(request))
            if held is None:
                pieces[id(request)] = (request, start, [rows])
            else:
                held[2].append(rows)

        i = 0
        while i < len(entries):
            requests, starts, rows = entries[i]
            if isinstance(rows, list):
                for request, start, chunk in zip(requests, starts, rows, strict=True):
                    take(request, start, chunk)
                i += 1
                continue
            j = i + 1  # the run of decode steps over the same batch
            while (
                j < len(entries)
                and not isinstance(entries[j][2], list)
                and entries[j][0] == requests
            ):
                j += 1
            stacked = torch.stack([e[2] for e in entries[i:j]], dim=1)  # [B, steps, F]
            for b, (request, start) in enumerate(zip(requests, starts, strict=True)):
                take(request, start, stacked[b])
            i = j
        if not pieces:
            return
        ids, firsts, rows = [], [], []
        for request, start, parts in pieces.values():
            ids.append(request.request_id)
            firsts.append(start)
            rows.append(parts[0] if len(parts) == 1 else torch.cat(parts))
        self.drafter.observe(TargetFeatures(ids, firsts, rows))
