"""A benchmark-only drafter whose acceptance is set by hand: it proposes the target's own greedy
continuation (recorded by a plain greedy run), each draft replaced by another token with
probability 1 - a, so that at temperature 0 a draft is accepted with probability a given the
drafts before it were. It lets the speculative round be measured on random-weight models of real
shapes, where no trained drafter exists. Not in the shipped drafter table; never imported by
tests of the package.

The replacement decision is a keyed uniform (specdec.rng, `Stream.DRAFT` at (Q, round anchor):
the stream a sampled draft would use, free here since the drafts are one-hot), so the host
and device paths propose the same drafts.
"""

from __future__ import annotations

import torch

from specdec.drafters.base import DraftBatch, Drafter, Proposal
from specdec.drafters.device import DeviceDrafting, DeviceSlot, RoundView
from specdec.rng import Stream, uniform


class OracleDrafter(Drafter):
    """Drafts the recorded token at position Q (a replaced draft: that token + 1 mod V).

    Args:
        vocab_size: the target's V.
        acceptance: a, the chance a draft is left as recorded.
        sequences: prompt + recorded greedy continuation (the target's own tokens at every
            position) of each request, found by its first `key_len` tokens (prompts of the
            benchmark differ there); positions past a sequence's end propose nothing.
    """

    def __init__(
        self, vocab_size: int, acceptance: float, sequences: list[list[int]], key_len: int
    ) -> None:
        super().__init__(vocab_size)
        self.acceptance = acceptance
        self.key_len = key_len
        self.sequences = {tuple(s[:key_len]): list(s) for s in sequences}

    def drafts(self, seeds, anchors, k, known, device) -> tuple[torch.Tensor, torch.Tensor]:
        """[B, k] drafts and [B] counts from [B, L] recorded tokens `known` (-1 past the end)."""
        column = torch.arange(k, device=device)
        positions = anchors[:, None] + column  # [B, k]
        span = known.shape[1]
        recorded = known.gather(1, positions.clamp(0, span - 1))
        recorded = torch.where(positions < span, recorded, -1)
        flat_seeds = seeds[:, None].expand(-1, k).reshape(-1)
        flat_anchors = anchors[:, None].expand(-1, k).reshape(-1)
        keys = (flat_seeds, positions.reshape(-1), Stream.DRAFT, 1)
        if flat_seeds.is_cuda:  # the Triton twin: one kernel (bit-identical uniforms)
            from specdec.rng.philox_triton import uniform_triton

            u = uniform_triton(*keys, step=flat_anchors)
        else:
            u = uniform(*keys, step=flat_anchors)
        replaced = (u.view(-1, k) > self.acceptance) & (recorded >= 0)
        drafts = torch.where(replaced, (recorded + 1) % self.target_vocab_size, recorded)
        present = (recorded >= 0).to(torch.int64).cumprod(dim=1)
        return torch.where(present.bool(), drafts, -1), present.sum(dim=1)

    def _known(self, token_lists: list[list[int]], length: int, device) -> torch.Tensor:
        """[B, length] recorded tokens of the requests whose tokens so far are `token_lists`."""
        known = torch.full((len(token_lists), length), -1, dtype=torch.int64)
        for b, tokens in enumerate(token_lists):
            recorded = self.sequences.get(tuple(tokens[: self.key_len]), [])[:length]
            known[b, : len(recorded)] = torch.tensor(recorded, dtype=torch.int64)
        return known.to(device)

    def propose(self, batch: DraftBatch) -> Proposal:
        k = batch.max_draft
        length = max(len(s) for s in self.sequences.values()) + k + 1
        known = self._known(batch.token_ids, length, batch.seeds.device)
        drafts, counts = self.drafts(batch.seeds, batch.anchors, k, known, batch.seeds.device)
        counts = torch.minimum(counts, batch.num_draft)
        return Proposal(drafts, None, None, counts)

    def device_drafting(self, num_slots, width, max_model_len, device) -> DeviceDrafting:
        return OracleDeviceDrafting(self, num_slots, max_model_len + width, device)


class OracleDeviceDrafting(DeviceDrafting):
    """The recorded tokens of every slot in a device buffer; drafts are gathered from it."""

    def __init__(self, drafter: OracleDrafter, num_slots: int, length: int, device) -> None:
        self.drafter, self.length = drafter, length
        self.known = torch.full((num_slots, length), -1, dtype=torch.int64, device=device)
        self.width = 0  # reads nothing the round commits

    def begin(self, slots: list[DeviceSlot], num_rows: int) -> None:
        rows = self.drafter._known([s.token_ids for s in slots], self.length, self.known.device)
        self.known.fill_(-1)
        for row, slot in zip(rows, slots, strict=True):
            self.known[slot.slot].copy_(row)

    def prepare(self, slots, last_positions) -> None:
        return None

    def propose(self, view: RoundView) -> tuple:
        rows = view.num_rows
        drafts, counts = self.drafter.drafts(
            view.seeds, view.anchors, view.k, self.known[:rows], self.known.device
        )
        return drafts, None, None, counts

    def observe(self, view, features, token_ids, num_accepted) -> None:
        return None

    def state(self) -> list[torch.Tensor]:
        return []

    def end(self, slots) -> None:
        return None
