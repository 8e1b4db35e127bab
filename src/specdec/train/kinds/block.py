"""Training the block drafters, `dflash` and `dspark`: distillation of the target's next-token
distributions from its hidden features, over many blocks of each sequence in one pass.

A block anchored at position p sees the target features of positions 0..p-1 and the token at
p; its draft i (0-based) proposes the token at p + 1 + i and learns the target's distribution
there (computed from the target's own last hidden state at p + i). DSpark's Markov head is
teacher-forced with the real token at p + i, and its confidence head learns the chance that
token-level verification accepts draft i, sum_x min(target(x), draft(x)), a soft label.

Options (`--option key=value`): block_size (default 8), num_layers (1), feature_layers
(comma-separated target layers; default low/middle/high), anchor_stride (default block_size),
position_decay (0.8: weight of draft i is decay ** i), min_draft (1), save_dtype (float16 |
float32); dspark only: markov_rank (32, at most the hidden size), min_survival_probability
(0.2), confidence_weight (1.0).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from specdec.drafters.block.checkpoint import load_block_drafter, save_block_drafter
from specdec.drafters.block.network import (
    BlockDrafterConfig,
    BlockDrafterModel,
    default_feature_layers,
    init_from_target,
)
from specdec.models import LlamaForCausalLM
from specdec.train.kind import DrafterKind, TrainBatch, TrainOptions, target_logits

_BLOCK_OPTIONS = frozenset(
    {
        "block_size",
        "num_layers",
        "feature_layers",
        "anchor_stride",
        "position_decay",
        "min_draft",
        "save_dtype",
    }
)


class DFlashKind(DrafterKind):
    name = "dflash"
    option_names = _BLOCK_OPTIONS

    def feature_layers(self, target: LlamaForCausalLM, options: TrainOptions) -> tuple[int, ...]:
        text = options.get("feature_layers", "")
        if not text:
            return default_feature_layers(target.config.num_hidden_layers)
        return tuple(int(part) for part in text.split(","))

    def config(self, target: LlamaForCausalLM, options: TrainOptions) -> BlockDrafterConfig:
        target_config = target.config
        dspark = self.name == "dspark"
        return BlockDrafterConfig(
            kind=self.name,
            feature_layers=self.feature_layers(target, options),
            target_hidden_size=target_config.hidden_size,
            target_vocab_size=target_config.vocab_size,
            target_num_hidden_layers=target_config.num_hidden_layers,
            block_size=options.get("block_size", 8, int),
            num_hidden_layers=options.get("num_layers", 1, int),
            markov_rank=min(options.get("markov_rank", 32, int), target_config.hidden_size)
            if dspark
            else 0,
            min_survival_probability=options.get("min_survival_probability", 0.2, float)
            if dspark
            else 0.0,
            min_draft=options.get("min_draft", 1, int),
        )

    def build(self, target: LlamaForCausalLM, options: TrainOptions) -> nn.Module:
        """Deterministic start: copies of the target's last layers (`init_from_target`)."""
        model = init_from_target(self.config(target, options), target).float()
        model.requires_grad_(True)
        return model.train()

    def loss(
        self, draft: nn.Module, target: LlamaForCausalLM, batch: TrainBatch, options: TrainOptions
    ) -> tuple[torch.Tensor, dict[str, float]]:
        return block_loss(draft, target, batch, options)

    def save(
        self, draft: nn.Module, target: LlamaForCausalLM, out_dir: Path, options: TrainOptions
    ) -> None:
        dtype = getattr(torch, options.get("save_dtype", "float16"))
        save_block_drafter(draft, out_dir, dtype=dtype)

    def load(self, out_dir: Path, target: LlamaForCausalLM, options: TrainOptions) -> nn.Module:
        model = load_block_drafter(out_dir, target).float()
        model.requires_grad_(True)
        return model.train()


class DSparkKind(DFlashKind):
    name = "dspark"
    option_names = _BLOCK_OPTIONS | {
        "markov_rank",
        "min_survival_probability",
        "confidence_weight",
    }


def block_anchors(batch: TrainBatch, stride: int) -> torch.Tensor:
    """[B, M] int64 anchor positions p of each sequence's blocks: 1 + (b mod stride) + j stride,
    so the sequences of a batch (and a window over epochs) cover every offset; anchors past the
    end are kept as padding and masked out of the loss."""
    size, length = batch.token_ids.shape
    num_anchors = max(-(-(length - 1) // stride), 1)
    offsets = 1 + torch.arange(size) % stride
    return offsets[:, None] + stride * torch.arange(num_anchors)[None, :]


def drafting_rows(
    model: BlockDrafterModel,
    target: LlamaForCausalLM,
    tokens: torch.Tensor,
    features: torch.Tensor,
    anchors: torch.Tensor,
) -> torch.Tensor:
    """The final hidden states of the predicting rows of many blocks per sequence, in one pass:
    the training layout of what `DFlashDrafter.block_hidden` computes one block at a time.

    Args:
        model: the drafter.
        target: the target (its embedding table embeds the anchors).
        tokens: [B, T] int64 tokens.
        features: [B, T, F] target features of those tokens.
        anchors: [B, M] int64 anchor positions p (>= T marks padding blocks).

    Returns: [B, M, K, D]; [b, j, i] is the row that proposes the token at anchors[b, j] + 1 + i.
    """
    config = model.config
    device = tokens.device
    k, num_rows, first = config.block_size, config.num_rows, config.first_predicting_row
    size, length = tokens.shape
    num_blocks = anchors.shape[1]
    row_pos = anchors[:, :, None] + torch.arange(num_rows, device=device)  # [B, M, R]
    positions = torch.arange(length, device=device).expand(size, -1)
    context = model.context_keys_values(features, positions)
    with torch.no_grad():
        anchor_embed = target.model.embed_tokens(tokens.gather(1, anchors.clamp(max=length - 1)))
    rows = model.mask_embedding.expand(size, num_blocks, num_rows, -1)
    rows = torch.cat([anchor_embed[:, :, None].to(rows.dtype), rows[:, :, 1:]], dim=2)
    # Block j sees context positions < p_j and only its own rows.
    sees_context = positions[:, None, :] < anchors[:, :, None]  # [B, M, T]
    block_of_key = torch.arange(num_blocks, device=device).repeat_interleave(num_rows)
    same_block = torch.arange(num_blocks, device=device)[:, None] == block_of_key[None, :]
    mask = torch.cat(
        [
            sees_context[:, :, None, :].expand(-1, -1, num_rows, -1),
            same_block[None, :, None, :].expand(size, -1, num_rows, -1),
        ],
        dim=-1,
    ).flatten(1, 2)  # [B, M R, T + M R]
    out = model(rows.flatten(1, 2), row_pos.flatten(1), context, mask)  # [B, M R, D]
    return out.view(size, num_blocks, num_rows, -1)[:, :, first : first + k]


def block_loss(
    model: BlockDrafterModel, target: LlamaForCausalLM, batch: TrainBatch, options: TrainOptions
) -> tuple[torch.Tensor, dict[str, float]]:
    """The distillation loss of a block drafter on one batch (every block of every sequence).

    Returns: (loss, {"acc1", "acc<K>": top-1 agreement of draft 1 and K with the target,
    "conf": mean confidence (dspark)}).
    """
    config = model.config
    device = model.fc.weight.device
    k = config.block_size
    tokens = batch.token_ids.to(device)  # [B, T]
    length = tokens.shape[1]
    anchors = block_anchors(batch, options.get("anchor_stride", k, int)).to(device)  # [B, M]
    label_pos = anchors[:, :, None] + torch.arange(k, device=device)  # [B, M, K] t = p + i
    loss_mask = batch.loss_mask.to(device)
    valid = (label_pos < length) & (anchors[:, :, None] < length - 1)
    safe_labels = label_pos.clamp(max=length - 1)
    valid &= loss_mask.gather(1, safe_labels.flatten(1)).view_as(valid)
    hidden = drafting_rows(model, target, tokens, batch.features.to(device), anchors)

    picked = valid.nonzero(as_tuple=True)  # the rows that carry a label
    hidden = hidden[picked]  # [N, D]
    label_at = label_pos[picked]
    with torch.no_grad():
        teacher = target_logits(target, batch.last_hidden.to(device)[picked[0], label_at])
        teacher = teacher.softmax(-1)  # [N, V]
    weight = target.model.embed_tokens.weight if target.lm_head is None else target.lm_head.weight
    logits = F.linear(hidden, weight.to(hidden.dtype)).float()  # [N, V]
    low_rank = None
    if model.markov_in is not None:
        previous = tokens[picked[0], label_at]  # x_{i-1}: the real token at p + i
        low_rank, markov = model.markov(previous)
        logits = logits + markov
    log_draft = logits.log_softmax(-1)
    index = picked[2]
    decay = options.get("position_decay", 0.8, float) ** index.float()
    ce = -(teacher * log_draft).sum(-1)  # [N]
    loss = (decay * ce).sum() / decay.sum().clamp_min(1e-9)
    agree = log_draft.argmax(-1) == teacher.argmax(-1)
    figures = {
        "acc1": float(agree[index == 0].float().mean()) if bool((index == 0).any()) else 0.0,
        f"acc{k}": float(agree[index == k - 1].float().mean())
        if bool((index == k - 1).any())
        else 0.0,
    }
    if low_rank is not None:
        with torch.no_grad():
            accept = torch.minimum(teacher, log_draft.exp()).sum(-1).clamp(0.0, 1.0)
        confidence = model.confidence_logit(hidden.detach(), low_rank.detach())
        bce = F.binary_cross_entropy_with_logits(confidence, accept)
        loss = loss + options.get("confidence_weight", 1.0, float) * bce
        figures["conf"] = float(torch.sigmoid(confidence.detach()).mean())
    return loss, figures
