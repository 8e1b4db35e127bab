"""DSpark drafting (DeepSeek and PKU, 2026): the DFlash backbone, a low-rank Markov head sampled
sequentially, and a confidence head whose scheduler picks each request's verify length.

Rows are anchor-first: the block is [anchor at A-1, mask at A, ..., mask at A+K-2] and row i
predicts the token at Q = A + i. Draft i is drawn from base_i + W2 W1[x_{i-1}] (x_{-1} = the
anchor token) through `sample_draft` at Q, one batched call per i.

Why the scheduler keeps the output exact: whether draft i is admitted is decided from the
confidence c_i = sigmoid(w . [h_i; W1[x_{i-1}]]), which depends on the context and the drafts
already drawn, never on draft i itself; the decision is taken before draft i is drawn, and a
request that stops drafting draws nothing more. Verification then sees a draft chain whose length
is a stopping time of the draft process, which is the same as drafting a token the target never
emits (always rejected, its residual being the target itself), so every verifier stays valid
(DSpark, App. A: a length chosen after seeing the drawn token biases the output). Inside a device
round (`block/device.py`) the same decisions are masks over a fixed width: a stopped chain's
later drafts are still drawn there, at their own keys, but never verified.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from specdec.drafters.base import DraftBatch, Proposal, ProposalBuffer
from specdec.drafters.block.dflash import DFlashDrafter
from specdec.drafters.block.network import BlockDrafterModel
from specdec.models import LlamaForCausalLM
from specdec.transfer import to_device

if TYPE_CHECKING:
    from specdec.drafters.device import DeviceDrafting


@dataclass(frozen=True, slots=True)
class ConfidenceScheduler:
    """DSpark's prefix scheduler: admits draft i (0-based) while the survival probability
    c_0 * ... * c_i, the predicted chance that drafts 0..i are all accepted, stays at or above
    `min_survival_probability`; the first `min_draft` drafts are always admitted.

    Non-anticipating by its signature: it is given confidences, never draft tokens, and is asked
    about draft i before draft i is drawn. Deterministic: it draws no randomness.
    """

    min_survival_probability: float = 0.0
    min_draft: int = 1

    @property
    def enabled(self) -> bool:
        return self.min_survival_probability > 0.0

    def admit(self, index: int, survival: torch.Tensor, confidence: torch.Tensor) -> torch.Tensor:
        """Args:
            index: i, the draft about to be drawn.
            survival: [M] float32 product of the confidences of drafts 0..i-1 (1 for i = 0).
            confidence: [M] float32 c_i, from the context and drafts 0..i-1.

        Returns: [M] bool, True to draw draft i and send it to verification.
        """
        if index < self.min_draft:
            return torch.ones_like(confidence, dtype=torch.bool)
        return survival * confidence >= self.min_survival_probability


class DSparkDrafter(DFlashDrafter):
    """The `dspark` method: DFlash backbone + Markov head + confidence-scheduled verify length."""

    kind = "dspark"

    def __init__(
        self,
        model: BlockDrafterModel,
        target: LlamaForCausalLM,
        greedy: bool = False,
        scheduler: ConfidenceScheduler | None = None,
        *,
        num_blocks: int | None = None,
        block_size: int | None = None,
    ) -> None:
        """Args:
        model, target, greedy, num_blocks, block_size: as for `DFlashDrafter`.
        scheduler: the verify-length scheduler (default: the checkpoint config's settings).
        """
        super().__init__(model, target, greedy, num_blocks=num_blocks, block_size=block_size)
        config = model.config
        self.scheduler = scheduler or ConfidenceScheduler(
            config.min_survival_probability, config.min_draft
        )

    def device_drafting(
        self, num_slots: int, width: int, max_model_len: int, device: torch.device
    ) -> DeviceDrafting | None:
        from specdec.drafters.block.device import DSparkDeviceDrafting

        context = self.paged_context(num_slots, width, max_model_len)
        return DSparkDeviceDrafting(self, context, width)

    @torch.inference_mode()
    def propose(self, batch: DraftBatch) -> Proposal:
        """One block pass, then draft by draft: the scheduler admits draft i (or stops the
        request) from c_i, and only then is draft i drawn from base_i + W2 W1[x_{i-1}].

        Returns up to min(num_draft[b], block_size) drafts per request (as many as admitted);
        draft i is keyed at Q = anchors[b] + i.

        RNG: through `sample_draft` only, one call per draft index (none for greedy drafting);
        the scheduler draws nothing.
        """
        size = batch.batch_size
        wanted = self.num_draft_with_features(batch).clamp(max=self.model.config.block_size)
        k = int(wanted.max()) if size else 0
        num_draft = torch.zeros(size, dtype=torch.int64)
        if k == 0:
            return Proposal(torch.full((size, 0), -1, dtype=torch.int64), None, None, num_draft)
        hidden = self.block_hidden(batch)  # [B, R, D]; row i predicts Q = A + i
        device = hidden.device
        base = self.target.compute_logits(hidden[:, :k].flatten(0, 1)).view(size, k, -1)
        out = ProposalBuffer(size, k, self.target_vocab_size, device, self.greedy)
        previous = to_device([t[-1] for t in batch.token_ids], torch.int64, device)  # x_{-1}
        survival = torch.ones(size, device=device)
        live = torch.ones(size, dtype=torch.bool)
        for i in range(k):
            live &= wanted > i
            rows = live.nonzero().squeeze(1)  # [M] requests still drafting
            if not rows.numel():
                break
            on = rows.to(device)
            low_rank, markov = self.model.markov(previous[on])  # [M, r], [M, V]
            if self.scheduler.enabled:
                logit = self.model.confidence_logit(hidden[on, i], low_rank)
                confidence = torch.sigmoid(logit)
                admitted = self.scheduler.admit(i, survival[on], confidence).cpu()
                survival[on] = survival[on] * confidence
                live[rows[~admitted]] = False
                rows, markov = rows[admitted], markov[admitted.to(device)]
                if not rows.numel():
                    break
                on = rows.to(device)
            logits = base[on, i] + markov  # [M, V]
            positions = batch.anchors[rows] + i  # Q of the proposed tokens
            previous[on] = self.draw(logits, rows, positions, batch, out, (on, i))
            num_draft[rows] = i + 1
        return out.proposal(num_draft)
