"""Prompt lookup inside a device round: each slot's token history lives in a device buffer, and
the suffix match (the latest earlier occurrence of the trailing n-gram, n = max .. min, and the
tokens that followed it) runs as tensor operations over it, so the host never reads a token to
draft. Deterministic (one-hot) drafts: no noise, no logits.
"""

from __future__ import annotations

import torch

from specdec.drafters.base import Drafter
from specdec.drafters.device import DeviceDrafting, DeviceSlot, RoundView


class NgramDeviceDrafting(DeviceDrafting):
    """history[b, :anchor] holds slot b's committed tokens (the round appends what it emitted)."""

    def __init__(self, drafter: Drafter, num_slots: int, width: int, max_model_len: int) -> None:
        self.drafter, self.width = drafter, width
        self.max_len = max_model_len + width  # a round may append up to `width` past the limit
        self.history = torch.zeros(num_slots, self.max_len, dtype=torch.int64)
        self.drafts = torch.full((num_slots, width - 1), -1, dtype=torch.int64)
        self.num_draft = torch.zeros(num_slots, dtype=torch.int64)

    def to(self, device: torch.device) -> NgramDeviceDrafting:
        self.history = self.history.to(device)
        self.drafts = self.drafts.to(device)
        self.num_draft = self.num_draft.to(device)
        return self

    admits = True

    def begin(self, slots: list[DeviceSlot], num_rows: int) -> None:
        self.admit(slots, num_rows)

    def admit(self, slots: list[DeviceSlot], num_rows: int) -> None:
        for slot in slots:
            tokens = torch.tensor(slot.token_ids, dtype=torch.int64)
            self.history[slot.slot, : len(tokens)].copy_(tokens)

    def prepare(self, slots: list[DeviceSlot], last_positions: list[int]) -> None:
        return None  # no cache of its own

    def propose(self, view: RoundView) -> tuple:
        rows, k = view.num_rows, view.k
        drafts, counts = self.drafts[:rows], self.num_draft[:rows]
        drafts.fill_(-1)
        counts.zero_()
        if k == 0:
            return drafts[:, :0], None, None, counts
        history = self.history[:rows]
        length = view.anchors  # tokens 0 .. anchor - 1 are known
        device = history.device
        found = torch.zeros(rows, dtype=torch.bool, device=device)
        follow_start = torch.zeros(rows, dtype=torch.int64, device=device)
        span = self.max_len
        starts = torch.arange(span, device=device)
        low, high = self.drafter.prompt_lookup_min, self.drafter.prompt_lookup_max
        for n in range(high, low - 1, -1):  # the longest n-gram that matches wins
            if n >= span:
                continue
            offsets = torch.arange(n, device=device)
            suffix = history.gather(1, (length[:, None] - n + offsets).clamp(0, span - 1))
            windows = history.unfold(1, n, 1)  # [S, span - n + 1, n]
            match = (windows == suffix[:, None, :]).all(dim=-1)
            # Windows that start at or before anchor - n - 1 (a token follows them) and an
            # n-gram that fits before the suffix's last token (n <= anchor - 1).
            start_ok = starts[: span - n + 1][None, :] <= (length - n - 1)[:, None]
            match &= start_ok & (length >= n + 1)[:, None]
            latest = torch.where(match, starts[: span - n + 1][None, :], -1).amax(dim=1)
            new = (latest >= 0) & ~found
            follow_start = torch.where(new, latest + n, follow_start)
            found |= new
        column = torch.arange(k, device=device)
        positions = follow_start[:, None] + column  # [S, k]
        available = found[:, None] & (positions < length[:, None]) & view.live[:, None]
        tokens = history.gather(1, positions.clamp(0, span - 1))
        drafts[:, :k].copy_(torch.where(available, tokens, -1))
        counts.copy_(available.sum(dim=1))
        return drafts[:, :k], None, None, counts

    def observe(self, view, features, token_ids, num_accepted) -> None:
        rows, width = view.num_rows, self.width
        # The round's tokens land at positions anchor .. anchor + accepted (anchor: the round's).
        column = torch.arange(width, device=token_ids.device)
        positions = (view.anchors[:, None] + column).clamp(max=self.max_len - 1)
        keep = view.live[:, None] & (column <= num_accepted[:, None])
        current = self.history[:rows].gather(1, positions)
        self.history[:rows].scatter_(1, positions, torch.where(keep, token_ids, current))

    def state(self) -> list[torch.Tensor]:
        return [self.history]

    def end(self, slots: list[DeviceSlot]) -> None:
        return None  # the host drafter keeps no state
