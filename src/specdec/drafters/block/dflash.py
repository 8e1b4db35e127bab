"""DFlash drafting (Chen, Liang, Liu 2026): one parallel pass of a small block drafter
conditioned on the target's hidden features yields all K drafts of a round.

The block is [anchor token at A-1, mask at A, ..., mask at A+K-1] (A = the round anchor); each mask
row predicts the token at its own position Q = A + i, without seeing the other drafts. The K
drafts are drawn in one batched `sample_draft` call, each row keyed at its Q. Target features
arrive through `observe` and are kept per request as every drafter layer's context keys/values.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from specdec.drafters.base import (
    DraftBatch,
    Drafter,
    DrafterSetup,
    Proposal,
    ProposalBuffer,
    TargetFeatures,
)
from specdec.drafters.block.checkpoint import load_block_drafter
from specdec.drafters.block.context import RequestContext, store_context
from specdec.drafters.block.network import BlockDrafterModel, block_mask
from specdec.drafters.block.paged_context import FALLBACK_BLOCK_SIZE, PagedBlockContext
from specdec.drafters.config import SpeculativeConfig
from specdec.models import LlamaForCausalLM
from specdec.transfer import to_device

if TYPE_CHECKING:
    from specdec.drafters.device import DeviceDrafting


class DFlashDrafter(Drafter):
    """vLLM's `dflash` method: a block drafter reading the target's features."""

    kind = "dflash"

    def __init__(
        self,
        model: BlockDrafterModel,
        target: LlamaForCausalLM,
        greedy: bool = False,
        *,
        num_blocks: int | None = None,
        block_size: int | None = None,
    ) -> None:
        """Args:
        model: the block drafter (its config names the feature layers and block size).
        target: the target; its embedding table and LM head are shared with the drafter.
        greedy: propose the drafter's argmax (one-hot drafts) instead of sampling.
        num_blocks, block_size: the geometry of device rounds' paged context (the engine's,
            `DrafterSetup`); None: room for every slot at full length, in blocks of
            `paged_context.FALLBACK_BLOCK_SIZE`.
        """
        super().__init__(target.config.vocab_size, greedy=greedy)
        self.model = model
        self.target = target
        self.feature_layers = tuple(model.config.feature_layers)
        self._contexts: dict[str, RequestContext] = {}
        self._geometry = None if num_blocks is None else (num_blocks, block_size)
        self.device_context: PagedBlockContext | None = None  # device rounds' pools

    @classmethod
    def from_config(
        cls, spec: SpeculativeConfig, target: LlamaForCausalLM, setup: DrafterSetup | None = None
    ) -> DFlashDrafter:
        """Loads the drafter of a SpeculativeConfig (`model` is its checkpoint directory). The
        host path keeps each request's context in buffers of its own; device rounds page it in a
        pool of `setup`'s geometry."""
        model = load_block_drafter(spec.model, target)
        if model.config.kind != cls.kind:
            raise ValueError(
                f'{spec.model} holds a "{model.config.kind}" drafter, not "{cls.kind}"'
            )
        geometry = {}
        if setup is not None:
            geometry = {"num_blocks": setup.num_blocks, "block_size": setup.block_size}
        return cls(model, target, greedy=spec.draft_sample_method == "greedy", **geometry)

    def device_drafting(
        self, num_slots: int, width: int, max_model_len: int, device: torch.device
    ) -> DeviceDrafting | None:
        from specdec.drafters.block.device import BlockDeviceDrafting

        return BlockDeviceDrafting(self, self.paged_context(num_slots, width, max_model_len), width)

    def paged_context(self, num_slots: int, width: int, max_model_len: int) -> PagedBlockContext:
        """A new pool for device rounds (the drafter's `device_context` from now on: `release`
        gives back a request's blocks there)."""
        # A round writes positions up to anchor - 1 + width - 1 <= max_model_len + width.
        max_positions = max_model_len + width
        num_blocks, block_size = self._geometry or (
            num_slots * -(-max_positions // FALLBACK_BLOCK_SIZE),
            FALLBACK_BLOCK_SIZE,
        )
        attention = self.model.layers[0].self_attn
        self.device_context = PagedBlockContext(
            len(self.model.layers),
            attention.num_kv_heads,
            attention.head_dim,
            self.model.fc.weight.dtype,
            self.model.mask_embedding.device,
            num_blocks=num_blocks,
            block_size=block_size,
            num_slots=num_slots,
            max_positions=max_positions,
        )
        return self.device_context

    # ---------------------------------------------------------------- context
    def release(self, request_id: str) -> None:
        self._contexts.pop(request_id, None)
        if self.device_context is not None:
            self.device_context.free(request_id)

    @torch.inference_mode()
    def observe(self, features: TargetFeatures) -> None:
        """Projects the new tokens' features into every layer's context keys and values (one
        batched projection for all requests).

        Mutates: the per-request contexts (a start before a context's end rewinds it first)."""
        if not features.request_ids:
            return
        counts = [rows.shape[0] for rows in features.features]
        sizes = torch.tensor(counts)
        firsts = torch.tensor(features.starts) - (sizes.cumsum(0) - sizes)  # start - row offset
        positions = firsts.repeat_interleave(sizes) + torch.arange(int(sizes.sum()))  # [T]
        joined = torch.cat(features.features)[None]  # [1, T, F]
        layers = self.model.context_keys_values(joined, positions[None].to(joined.device))
        split = [(keys[0].split(counts), values[0].split(counts)) for keys, values in layers]
        for b, (request_id, start) in enumerate(
            zip(features.request_ids, features.starts, strict=True)
        ):
            context = self._contexts.setdefault(request_id, RequestContext())
            if start > context.length:
                raise ValueError(
                    f"request {request_id}: features start at position {start} but only "
                    f"{context.length} positions are known"
                )
            for index, (keys, values) in enumerate(split):
                store_context(context, index, start, keys[b], values[b])
            context.length = start + counts[b]

    # ---------------------------------------------------------------- drafting
    def block_hidden(self, batch: DraftBatch) -> torch.Tensor:
        """Runs every request's block: [B, R, D] final hidden states of rows at positions
        A-1 .. A-1+R-1 (R = the config's `num_rows`)."""
        if batch.request_ids is None:
            raise ValueError(f"the {self.kind} drafter needs request_ids in its DraftBatch")
        model = self.model
        device = model.mask_embedding.device
        context_lens = batch.anchors - 1  # features are known for positions 0..A-2
        contexts = []
        for b, request_id in enumerate(batch.request_ids):
            context = self._contexts.get(request_id)
            needed = int(context_lens[b])
            if context is None and needed == 0:
                # A first round of a one-token prompt: no feature yet; the caller drafts
                # nothing for this row, which attends to its block only.
                contexts.append(None)
                continue
            if context is None or context.length < needed:
                have = 0 if context is None else context.length
                raise ValueError(
                    f"request {request_id}: the drafter has target features for {have} "
                    f"positions, the round at anchor {needed + 1} needs {needed}"
                )
            contexts.append(context)
        num_context = int(context_lens.max())
        layer_context = [
            self._layer_context(index, contexts, context_lens, num_context)
            for index in range(len(model.layers))
        ]
        anchor_tokens = to_device([t[-1] for t in batch.token_ids], torch.int64, device)
        mask = block_mask(context_lens.to(device), num_context, model.config.num_rows)
        return self.run_block(anchor_tokens, batch.anchors.to(device), layer_context, mask)

    def run_block(
        self,
        anchor_tokens: torch.Tensor,
        anchors: torch.Tensor,
        layer_context: list,
        mask: torch.Tensor | None,
    ) -> torch.Tensor:
        """The block pass itself (device work only; the host and device paths share it).

        Args:
            anchor_tokens: [B] int64 each block's anchor token (the round's input token).
            anchors: [B] int64 round anchors A (the block's rows sit at A-1 .. A-1+R-1).
            layer_context: per drafter layer, (keys, values) [B, S, H_kv, D_head] of positions
                0..S-1 attended through `mask` [B, R, S + R] (`block_mask`), or a paged context
                (`paged_context.PagedLayerContext`, mask None).
            mask: see layer_context.

        Returns: [B, R, D] final hidden states of the block's rows.
        """
        model = self.model
        num_rows = model.config.num_rows
        rows = model.mask_embedding.expand(anchor_tokens.shape[0], num_rows, -1).clone()
        rows[:, 0] = self.target.model.embed(anchor_tokens)  # Gemma's scaled
        positions = (anchors - 1)[:, None] + torch.arange(num_rows, device=anchors.device)
        return model(rows, positions, layer_context, mask)  # [B, R, D]

    @staticmethod
    def _layer_context(
        index: int, contexts: list, context_lens: torch.Tensor, num_context: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `index`'s context (keys, values) [B, S, H_kv, D_head] of a round: views of the
        request's buffers for one request (no O(context) copy per round), else padded copies."""
        template = next(context for context in contexts if context is not None)
        if len(contexts) == 1:
            keys, values = template.keys[index], template.values[index]
            return keys[None, :num_context], values[None, :num_context]
        keys = template.keys[index]
        shape = (len(contexts), num_context, *keys.shape[1:])
        padded_keys = keys.new_zeros(shape)  # [B, S, H_kv, D_head]
        padded_values = keys.new_zeros(shape)
        for b, context in enumerate(contexts):
            if context is None:
                continue
            n = int(context_lens[b])
            padded_keys[b, :n] = context.keys[index][:n]
            padded_values[b, :n] = context.values[index][:n]
        return padded_keys, padded_values

    @torch.inference_mode()
    def propose(self, batch: DraftBatch) -> Proposal:
        """One block pass for the whole batch, then one `sample_draft` call for every draft.

        Returns min(num_draft[b], block_size) drafts per request; draft i is keyed at
        Q = anchors[b] + i.

        RNG: through `sample_draft` only (none for greedy drafting).
        """
        size = batch.batch_size
        num_draft = self.num_draft_with_features(batch).clamp(max=self.model.config.block_size)
        k = int(num_draft.max()) if size else 0
        if k == 0:
            return Proposal(torch.full((size, 0), -1, dtype=torch.int64), None, None, num_draft)
        hidden = self.block_hidden(batch)  # [B, R, D]
        first = self.model.config.first_predicting_row
        rows = torch.arange(size).repeat_interleave(num_draft)  # [N] request of each draft
        index = torch.cat([torch.arange(int(n)) for n in num_draft])  # [N] draft i of its request
        device = hidden.device
        at = (rows.to(device), index.to(device))
        logits = self.target.compute_logits(hidden[at[0], first + at[1]])
        positions = batch.anchors[rows] + index  # Q of each proposed token
        out = ProposalBuffer(size, k, self.target_vocab_size, device, self.greedy)
        self.draw(logits, rows, positions, batch, out, at)
        return out.proposal(num_draft)
