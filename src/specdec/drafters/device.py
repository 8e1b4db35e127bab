"""The device side of a drafter, for speculative rounds that run on the device without the host
(`specdec.engine.device_round`): the round's inputs as the drafter sees them (`RoundView`) and the
interface a drafter implements to draft inside such a round (`DeviceDrafting`).

A device round works on slots (rows of persistent buffers), one per running request. The host
calls `begin` once (host state -> device buffers), `prepare` before every launch (blocks for the
round's writes), and `end` once after the last round was read (device buffers -> host state).
`propose` and `observe` run inside the round: device work only, no host synchronisation and no
host-dependent shapes, so the round can be replayed from a CUDA graph. Never draws noise itself:
draws go through `Drafter.draw_on_device`.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass

import numpy as np
import torch

from specdec.runner.cuda_graph import StaticInputs
from specdec.sampling import SamplingTensors


@dataclass(frozen=True, slots=True)
class RoundView:
    """A round's state, as device tensors of its first `num_rows` slots (a batch bucket).

    Attributes:
        num_rows: S, the slots in the round (live ones and inert padding).
        k: drafts this round proposes per live slot (0: the round only samples).
        method: the verify method of every slot ("standard", "block" or "coupled").
        anchors: [S] int64 position of each slot's first draft (the round anchor); the round's
            input token sits at anchor - 1.
        last_tokens: [S] int64 the round's input tokens.
        live: [S] bool, False for padding and for requests that finished (inert rows: greedy,
            nothing drafted, nothing written to any cache).
        seeds: [S] int64 request seeds.
        params: [S] sampling tensors of the requests (temperature 0 on inert rows).
        max_draft: [S] int64 each request's own cap on drafts per round.
    """

    num_rows: int
    k: int
    method: str
    anchors: torch.Tensor
    last_tokens: torch.Tensor
    live: torch.Tensor
    seeds: torch.Tensor
    params: SamplingTensors
    max_draft: torch.Tensor


@dataclass(frozen=True, slots=True)
class DeviceSlot:
    """A request in a device round, as the host knows it.

    Attributes:
        slot: its row in the round's buffers.
        request_id: the request's id (the drafter's per-request state is keyed by it).
        token_ids: every committed token (prompt + output); the next round's anchor is
            len(token_ids).
    """

    slot: int
    request_id: str
    token_ids: list[int]


class DeviceDrafting(abc.ABC):
    """A drafter's buffers and steps for device rounds (see the module docstring).

    `width` (W) is the most tokens a round commits per slot (K_max + 1): between two rounds a
    slot gains at most W tokens, which `observe` hands on to the next `propose`.
    """

    width: int

    @abc.abstractmethod
    def begin(self, slots: list[DeviceSlot], num_rows: int) -> None:
        """Loads the state of the requests in `slots` into the device buffers (catching up on
        the host what exceeds one round's width). Called once, before the first launch."""

    admits: bool = False  # whether `admit` can take requests into running rounds

    def admit(self, slots: list[DeviceSlot], num_rows: int) -> None:
        """Loads the state of new requests into `slots` while rounds of the others run (some
        may still be in flight): writes only these slots' buffers, with device work ordered
        after the rounds launched before (so their writes to these rows, inert there, land
        first). Drafters that implement it set `admits`; the engine drains the rounds for the
        others."""
        raise NotImplementedError(f"{type(self).__name__} cannot take requests into running rounds")

    @abc.abstractmethod
    def prepare(self, slots: list[DeviceSlot], last_positions: list[int]) -> None:
        """Host work before a launch: room in the drafter's caches for every position up to
        `last_positions[i]` of slot i (the most the round may write), and the block tables sent
        to the device."""

    @abc.abstractmethod
    def propose(self, view: RoundView) -> tuple:
        """Drafts `view.k` tokens per live slot into the drafter's own proposal buffers (device
        only, graph-safe). Returns views of them: (draft_token_ids [S, k] int64, draft_logits
        [S, k, V] | None, draft_logsumexp [S, k] | None, num_draft [S] int64 | None (None: k for
        every slot))."""

    @abc.abstractmethod
    def observe(
        self,
        view: RoundView,
        features: torch.Tensor | None,
        token_ids: torch.Tensor,
        num_accepted: torch.Tensor,
    ) -> None:
        """Takes what the round committed (device only, graph-safe): the target features of the
        round's input token and drafts ([S * Q, F] in rows b * Q + j, Q = the round's K + 1, or
        None when the drafter reads none), the emitted tokens [S, W] (-1 padded; W = the
        widest round's K + 1) and num_accepted [S]."""

    @abc.abstractmethod
    def state(self) -> list[torch.Tensor]:
        """The device buffers `propose` reads and `observe` updates (saved and put back around
        a graph's warm-up run, so that a captured round runs once)."""

    @abc.abstractmethod
    def end(self, slots: list[DeviceSlot]) -> None:
        """Writes the device state of `slots` (each one's token_ids now covering everything the
        last read round committed) back to the drafter's host state. Called once, after the
        last round was read."""


class BlockTables:
    """The block tables of a drafter's own paged cache, one row per slot: written on the host
    before a launch and sent with one copy (`send`), read by the round on the device (`rows`)."""

    def __init__(self, num_slots: int, max_blocks: int, device: torch.device) -> None:
        self.max_blocks = max_blocks
        self._inputs = StaticInputs({"tables": num_slots * max_blocks}, device)

    def send(self, tables: list[tuple[int, list[int]]]) -> None:
        """(slot, block ids) of the slots in the next round."""
        self._inputs.begin()
        host = self._inputs.host("tables").reshape(-1, self.max_blocks)
        for slot, blocks in tables:
            if len(blocks) > self.max_blocks:
                raise RuntimeError(f"a block table of {len(blocks)} blocks (> {self.max_blocks})")
            host[slot, : len(blocks)] = np.asarray(blocks, dtype=np.int64)
        self._inputs.send("tables", host.shape[0] * self.max_blocks)

    def rows(self, num_rows: int) -> torch.Tensor:
        """[num_rows, max_blocks] int64 tables on the device."""
        return self._inputs["tables"][: num_rows * self.max_blocks].view(num_rows, self.max_blocks)
