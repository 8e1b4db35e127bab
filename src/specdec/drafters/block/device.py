"""DFlash and DSpark drafting inside a device round: each slot's context (every drafter layer's
keys and values of the positions the target has features for) lives in paged pools
(`paged_context`: blocks held per request, grown ahead by `prepare`, given back at `end` or when
the request is released), the block pass attends over it through the slot's block table, and
`observe` projects the features of what a round committed into it, so the host never reads a
token or a length. DSpark's confidence scheduler runs as masks: its verify length per slot is a
device tensor. Draft noise only through `Drafter.draw_on_device`.
"""

from __future__ import annotations

import torch

from specdec.drafters.base import Drafter, ProposalBuffer
from specdec.drafters.block.context import store_context
from specdec.drafters.block.paged_context import PagedBlockContext
from specdec.drafters.device import DeviceDrafting, DeviceSlot, RoundView


class BlockDeviceDrafting(DeviceDrafting):
    """Per request in the rounds: its context keys/values in `context`'s pools, valid below the
    round anchor - 1 (the positions whose features the target has delivered), copied in from the
    host context at `begin` and back at `end`. DFlash drafting; `DSparkDeviceDrafting` overrides
    `_draw`.

    A round reads the context below its anchor - 1 and writes positions from there on (into
    blocks `prepare` allocated before the launch), with values computed from the round's inputs
    only: run twice around the round's saved state (a graph's warm-up), it writes the same values
    again, so the context is not part of `state`.
    """

    def __init__(self, drafter: Drafter, context: PagedBlockContext, width: int) -> None:
        self.drafter, self.context, self.width = drafter, context, width
        model = drafter.model
        self.block_size = model.config.block_size  # drafts per block (not the pool's blocks)
        device = model.mask_embedding.device
        self.out = ProposalBuffer(
            context.num_slots, width - 1, drafter.target_vocab_size, device, drafter.greedy
        )
        self._loaded: dict[str, int] = {}  # request id -> context positions copied at `begin`

    @torch.inference_mode()  # the host contexts are inference tensors (`DFlashDrafter.observe`)
    def begin(self, slots: list[DeviceSlot], num_rows: int) -> None:
        self._loaded = {}
        needs = {}
        for slot in slots:
            needed = len(slot.token_ids) - 1  # features of positions 0..anchor-2
            context = self.drafter._contexts.get(slot.request_id)
            have = 0 if context is None else context.length
            if context is None or have < needed:
                raise ValueError(
                    f"request {slot.request_id}: the drafter has target features for {have} "
                    f"positions, its round at anchor {needed + 1} needs {needed}"
                )
            needs[slot.request_id] = needed
        paged = self.context
        paged.grow(needs)
        for slot in slots:
            needed = needs[slot.request_id]
            context = self.drafter._contexts[slot.request_id]
            at = paged.slots(slot.request_id, 0, needed)
            for layer in range(len(context.keys) if needed else 0):
                keys, values = paged.flat(layer)
                keys.index_copy_(0, at, context.keys[layer][:needed])
                values.index_copy_(0, at, context.values[layer][:needed])
            self._loaded[slot.request_id] = needed
        paged.send_tables([(slot.slot, slot.request_id) for slot in slots])

    def prepare(self, slots: list[DeviceSlot], last_positions: list[int]) -> None:
        # A round writes the context at positions up to its last target position.
        self.context.grow(
            {slot.request_id: last + 1 for slot, last in zip(slots, last_positions, strict=True)}
        )
        self.context.send_tables([(slot.slot, slot.request_id) for slot in slots])

    def propose(self, view: RoundView) -> tuple:
        rows, k = view.num_rows, view.k
        out = self.out
        if k == 0:
            return out.draft_token_ids[:rows, :0], None, None, None
        live, anchors = view.live, view.anchors
        context_lens = torch.where(live, anchors - 1, 0)  # inert slots see their block only
        layer_context = self.context.layers(rows, context_lens)
        hidden = self.drafter.run_block(view.last_tokens, anchors, layer_context, None)
        drafted = self._draw(view, hidden, min(k, self.block_size))  # [S] int64
        draft_logits = None if out.draft_logits is None else out.draft_logits[:rows, :k]
        draft_lse = None if out.draft_logsumexp is None else out.draft_logsumexp[:rows, :k]
        return out.draft_token_ids[:rows, :k], draft_logits, draft_lse, drafted

    def _draw(self, view: RoundView, hidden: torch.Tensor, k: int) -> torch.Tensor:
        """DFlash: mask row i of the block predicts Q = A + i; draws k drafts per slot into
        `out`. Returns [S] int64 drafts per slot (k: the block has no scheduler).

        RNG: through `draw_on_device` only, one call per draft index."""
        rows = view.num_rows
        first = self.drafter.model.config.first_predicting_row
        logits = self.drafter.target.compute_logits(hidden[:, first : first + k].flatten(0, 1))
        logits = logits.view(rows, k, -1)  # [S, k, V]
        for i in range(k):
            self.drafter.draw_on_device(logits[:, i], view.anchors + i, view, self.out, i)
        return torch.full((rows,), k, dtype=torch.int64, device=hidden.device)

    def observe(self, view, features, token_ids, num_accepted) -> None:
        rows, query = view.num_rows, view.k + 1
        device = token_ids.device
        column = torch.arange(query, device=device)
        positions = view.anchors[:, None] - 1 + column  # [S, Q]: the input token, then drafts
        layers = self.drafter.model.context_keys_values(features.view(rows, query, -1), positions)
        # The input token and the accepted drafts are committed; the rest goes to scratch.
        keep = view.live[:, None] & (column <= num_accepted[:, None])
        paged = self.context
        at = paged.round_slots(paged.tables.rows(rows), positions, keep).view(-1)
        for layer, (new_keys, new_values) in enumerate(layers):
            keys, values = paged.flat(layer)
            keys[at] = new_keys.flatten(0, 1)
            values[at] = new_values.flatten(0, 1)

    def state(self) -> list[torch.Tensor]:
        return []  # see the class docstring

    @torch.inference_mode()
    def end(self, slots: list[DeviceSlot]) -> None:
        paged = self.context
        for slot in slots:
            needed = len(slot.token_ids) - 1
            context = self.drafter._contexts[slot.request_id]
            start = min(self._loaded.get(slot.request_id, 0), context.length)
            at = paged.slots(slot.request_id, start, needed)
            for layer in range(paged.num_layers):
                keys, values = paged.flat(layer)
                store_context(context, layer, start, keys[at], values[at])
            context.length = needed
            paged.free(slot.request_id)


class DSparkDeviceDrafting(BlockDeviceDrafting):
    """DSpark: row i of the block predicts Q = A + i; the Markov head is sampled draft by draft
    and the confidence scheduler's admissions are masks, so each slot's verify length is a
    device tensor (the round keeps its fixed width K; verification ignores drafts past it)."""

    def _draw(self, view: RoundView, hidden: torch.Tensor, k: int) -> torch.Tensor:
        """Draws k drafts per slot, draft i from base_i + W2 W1[x_{i-1}]; the scheduler decides
        on draft i from c_i before it is drawn, as on the host. A slot whose chain the scheduler
        stopped still has its later drafts drawn (a fixed shape), but they are never verified:
        keys are per position, so those draws change no other value.

        Returns: [S] int64 drafts admitted per slot.

        RNG: through `draw_on_device` only, one call per draft index; the scheduler draws
        nothing."""
        drafter, rows = self.drafter, view.num_rows
        model, scheduler = drafter.model, drafter.scheduler
        base = drafter.target.compute_logits(hidden[:, :k].flatten(0, 1)).view(rows, k, -1)
        previous = view.last_tokens  # x_{-1}: the anchor token
        survival = torch.ones(rows, device=hidden.device)
        drafting = view.live.clone()
        admitted_count = torch.zeros(rows, dtype=torch.int64, device=hidden.device)
        for i in range(k):
            low_rank, markov = model.markov(previous)  # [S, r], [S, V]
            if scheduler.enabled:
                confidence = torch.sigmoid(model.confidence_logit(hidden[:, i], low_rank))
                admitted = scheduler.admit(i, survival, confidence)
                survival = torch.where(drafting, survival * confidence, survival)
                drafting = drafting & admitted
            admitted_count += drafting
            previous = drafter.draw_on_device(
                base[:, i] + markov, view.anchors + i, view, self.out, i
            )
        return admitted_count
