"""The block drafter network of DFlash and DSpark and its config (files: `checkpoint.py`).

A few decoder layers run over one block of query rows ([anchor token, mask, mask, ...]); the rows
attend to each other without a causal mask and to the context's target features, projected once
into every layer's keys and values (dense with a mask here; device rounds read them from paged
pools, `paged_context`). DSpark adds a low-rank Markov head and a confidence head.
The target's embedding table and LM head are borrowed, never stored. Nothing here samples or
draws randomness: weights come from a checkpoint or from deterministic copies of the target's.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from specdec.drafters.config import MAX_NUM_SPECULATIVE_TOKENS
from specdec.models import LlamaForCausalLM, ModelConfig
from specdec.models.decoder_layers import LlamaAttention, LlamaMLP, rms_norm
from specdec.models.layers import Embedding, Linear, RMSNorm
from specdec.models.moe import SparseMoeBlock
from specdec.models.rope import RotaryEmbedding, apply_rotary

BLOCK_DRAFTER_KINDS = ("dflash", "dspark")
# Row offset of the first predicting row in a block, and its lag: DFlash mask rows predict their
# own position (rows 1..K, anchor not predicting); DSpark rows predict the next position (rows
# 0..K-1, anchor included). See the vLLM notes, section 2.2.
FIRST_PREDICTING_ROW = {"dflash": 1, "dspark": 0}


def default_feature_layers(num_layers: int) -> tuple[int, ...]:
    """Low, middle and high target layers (as EAGLE-3 picks them); all layers of a shallow one."""
    if num_layers < 6:
        return tuple(range(num_layers))
    return (2, num_layers // 2, num_layers - 3)


@dataclass(frozen=True, slots=True)
class BlockDrafterConfig:
    """What a DFlash / DSpark checkpoint's config.json holds.

    Attributes:
        kind: "dflash" or "dspark".
        feature_layers: 0-based target decoder layers whose outputs make a token's feature.
        block_size: most drafts per round (K <= block_size); the block always has this many
            predicting rows, as in training, so a row's output never depends on the K asked for.
        num_hidden_layers: decoder layers of the drafter (shaped like the target's).
        markov_rank: rank r of DSpark's Markov head (0 for DFlash).
        min_survival_probability: DSpark's scheduler admits draft k while the product of the
            confidences c_1..c_k stays at or above this (0 = admit every draft asked for).
        min_draft: DSpark's scheduler always admits at least this many drafts.
        target_hidden_size, target_vocab_size, target_num_hidden_layers: the target the drafter
            was built for (checked at load time).
    """

    kind: str
    feature_layers: tuple[int, ...]
    target_hidden_size: int
    target_vocab_size: int
    target_num_hidden_layers: int
    block_size: int = 8
    num_hidden_layers: int = 1
    markov_rank: int = 0
    min_survival_probability: float = 0.0
    min_draft: int = 1

    def __post_init__(self) -> None:
        if self.kind not in BLOCK_DRAFTER_KINDS:
            raise ValueError(f"kind must be one of {BLOCK_DRAFTER_KINDS}, got {self.kind!r}")
        if not self.feature_layers:
            raise ValueError("feature_layers must name at least one target layer")
        bad = [i for i in self.feature_layers if not 0 <= i < self.target_num_hidden_layers]
        if bad:
            raise ValueError(
                f"feature_layers {bad} out of range for {self.target_num_hidden_layers} layers"
            )
        if not 1 <= self.num_hidden_layers <= self.target_num_hidden_layers:
            raise ValueError(
                f"num_hidden_layers must be in [1, {self.target_num_hidden_layers}], "
                f"got {self.num_hidden_layers}"
            )
        if not 1 <= self.block_size <= MAX_NUM_SPECULATIVE_TOKENS:
            raise ValueError(
                f"block_size must be in [1, {MAX_NUM_SPECULATIVE_TOKENS}], got {self.block_size}"
            )
        if self.kind == "dspark" and not 1 <= self.markov_rank <= self.target_hidden_size:
            raise ValueError(
                f"a dspark drafter needs 1 <= markov_rank <= {self.target_hidden_size}, "
                f"got {self.markov_rank}"
            )
        if self.kind == "dflash" and self.markov_rank:
            raise ValueError("a dflash drafter has no Markov head: markov_rank must be 0")
        if not 0.0 <= self.min_survival_probability <= 1.0:
            raise ValueError(
                f"min_survival_probability must be in [0, 1], got {self.min_survival_probability}"
            )
        if not 0 <= self.min_draft <= self.block_size:
            raise ValueError(f"min_draft must be in [0, block_size], got {self.min_draft}")

    @property
    def first_predicting_row(self) -> int:
        return FIRST_PREDICTING_ROW[self.kind]

    @property
    def num_rows(self) -> int:
        """Query rows of one block: the anchor, then masks."""
        return self.block_size + self.first_predicting_row

    def to_dict(self) -> dict[str, Any]:
        values = dataclasses.asdict(self)
        values["feature_layers"] = list(self.feature_layers)
        return {"specdec_drafter": self.kind, **values}

    @staticmethod
    def from_dict(values: dict[str, Any]) -> BlockDrafterConfig:
        known = {f.name for f in dataclasses.fields(BlockDrafterConfig)}
        fields = {k: v for k, v in values.items() if k in known}
        fields["feature_layers"] = tuple(fields.get("feature_layers", ()))
        return BlockDrafterConfig(**fields)


def layer_config(config: BlockDrafterConfig, target_config: ModelConfig) -> ModelConfig:
    """The drafter's decoder layers are shaped like the target's (so they can start as copies),
    with a dense MLP of the target's `intermediate_size` over a mixture-of-experts target (as
    DFlash's drafters for Qwen3-MoE targets are built). Every layer attends to its whole
    context and block with the target's global RoPE (no sliding window, no per-layer kinds)."""
    return dataclasses.replace(
        target_config,
        num_hidden_layers=config.num_hidden_layers,
        layer_types=(),
        local_rope_theta=None,
        sliding_window=None,
        num_experts=0,
        num_experts_per_tok=0,
        moe_intermediate_size=0,
        moe_layers=(),
    )


class BlockAttention(LlamaAttention):
    """Attention of block rows over [context keys/values, the block's own rows], no causal mask.

    The projections are `LlamaAttention`'s (same parameter names), so a target layer's weights
    load as they are; `forward` attends over the block instead of the paged cache.
    """

    def _normed(self, projected: torch.Tensor, norm: RMSNorm | None) -> torch.Tensor:
        """[N, S, H D] queries or keys through their RMSNorm (over each head: Qwen3's; over the
        whole projection: OLMo 2's), or as they are without one."""
        if norm is None:
            return projected
        if self.qk_norm_per_head:
            return norm(projected.unflatten(-1, (-1, self.head_dim))).flatten(-2)
        return norm(projected)

    def keys_values(
        self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Args: hidden [N, S, D]; cos, sin [N, S, head_dim] float32 of the rows' positions.

        Returns: (keys [N, S, H_kv, head_dim] rotated, values [N, S, H_kv, head_dim])."""
        n, s, _ = hidden.shape
        key = self._normed(self.k_proj(hidden), self.k_norm).view(n, s, self.num_kv_heads, -1)
        value = self.v_proj(hidden).view(n, s, self.num_kv_heads, self.head_dim)
        key = apply_rotary(key.flatten(0, 1), cos.flatten(0, 1), sin.flatten(0, 1))
        return key.view(n, s, self.num_kv_heads, self.head_dim), value

    def forward(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        context,
        mask: torch.Tensor | None,
    ) -> torch.Tensor:
        """Args:
            hidden: [N, R, D] normed block rows.
            cos, sin: [N, R, head_dim] float32 of the rows' positions.
            context: (keys, values) [N, S, H_kv, head_dim] of the context (from `keys_values`),
                attended with `mask`; or a context that attends itself (`attend(query, key,
                value, scale)`, as `paged_context.PagedLayerContext`: mask None).
            mask: [N, R, S + R] bool, True where row r may attend to key j (context, then rows).

        Returns: [N, R, D].
        """
        n, r, _ = hidden.shape
        query = self._normed(self.q_proj(hidden), self.q_norm).view(n, r, self.num_heads, -1)
        query = apply_rotary(query.flatten(0, 1), cos.flatten(0, 1), sin.flatten(0, 1))
        query = query.view(n, r, self.num_heads, self.head_dim)
        key, value = self.keys_values(hidden, cos, sin)  # [N, R, H_kv, head_dim] each
        if not isinstance(context, tuple):
            out = context.attend(query, key, value, self.scale, self.softcap)  # [N, R, H, hd]
            return self.o_proj(out.reshape(n, r, self.num_heads * self.head_dim))
        keys = torch.cat([context[0], key], dim=1).transpose(1, 2)  # [N, H_kv, S + R, head_dim]
        values = torch.cat([context[1], value], dim=1).transpose(1, 2)
        if self.softcap is None:
            out = F.scaled_dot_product_attention(
                query.transpose(1, 2),  # [N, H, R, head_dim]
                keys,
                values,
                attn_mask=mask[:, None],  # [N, 1, R, S + R]
                scale=self.scale,
                enable_gqa=True,
            )  # [N, H, R, head_dim]
        else:  # Gemma 2's soft-capped scores, which SDPA cannot compute
            out = capped_attention(
                query.transpose(1, 2), keys, values, mask, self.scale, self.softcap
            )
        return self.o_proj(out.transpose(1, 2).reshape(n, r, self.num_heads * self.head_dim))


class BlockDecoderLayer(nn.Module):
    """Pre-norm block: x + attn(norm(x), context), then x + mlp(norm(x)) (Llama's names)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.self_attn = BlockAttention(config)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = rms_norm(config)
        self.post_attention_layernorm = rms_norm(config)

    def forward(self, hidden, cos, sin, context, mask) -> torch.Tensor:
        normed = self.input_layernorm(hidden)
        hidden = hidden + self.self_attn(normed, cos, sin, context, mask)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class BlockPostNormLayer(nn.Module):
    """OLMo 2's block: x + norm(attn(x, context)), then x + norm(mlp(x)) (its names)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.self_attn = BlockAttention(config)
        self.mlp = LlamaMLP(config)
        self.post_attention_layernorm = rms_norm(config)
        self.post_feedforward_layernorm = rms_norm(config)

    def forward(self, hidden, cos, sin, context, mask) -> torch.Tensor:
        attended = self.self_attn(hidden, cos, sin, context, mask)
        hidden = hidden + self.post_attention_layernorm(attended)
        return hidden + self.post_feedforward_layernorm(self.mlp(hidden))


class BlockSandwichLayer(nn.Module):
    """Gemma's block: x + norm(attn(norm(x), context)), then x + norm(mlp(norm(x)))."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.self_attn = BlockAttention(config)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = rms_norm(config)
        self.post_attention_layernorm = rms_norm(config)
        self.pre_feedforward_layernorm = rms_norm(config)
        self.post_feedforward_layernorm = rms_norm(config)

    def forward(self, hidden, cos, sin, context, mask) -> torch.Tensor:
        attended = self.self_attn(self.input_layernorm(hidden), cos, sin, context, mask)
        hidden = hidden + self.post_attention_layernorm(attended)
        fed = self.mlp(self.pre_feedforward_layernorm(hidden))
        return hidden + self.post_feedforward_layernorm(fed)


# The drafter's layers by the target's norm placement (`ModelConfig.norm_placement`), each with
# the parameter names of the target's layer of that placement (so a target layer loads as is).
BLOCK_LAYERS = {
    "pre": BlockDecoderLayer,
    "post": BlockPostNormLayer,
    "sandwich": BlockSandwichLayer,
}


def capped_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    softcap: float,
) -> torch.Tensor:
    """Softmax attention over cap * tanh(scale q.k / cap) scores (Gemma 2), in float32.

    Args: query [N, H, R, D]; keys, values [N, H_kv, S + R, D]; mask [N, R, S + R] bool.

    Returns: [N, H, R, D] in query's dtype."""
    group = query.shape[1] // keys.shape[1]
    keys = keys.float().repeat_interleave(group, dim=1)
    values = values.float().repeat_interleave(group, dim=1)
    scores = torch.tanh(query.float() @ keys.transpose(-1, -2) * scale / softcap) * softcap
    scores = scores.masked_fill(~mask[:, None], -torch.inf)
    return (scores.softmax(-1) @ values).to(query.dtype)


class BlockDrafterModel(nn.Module):
    """The DFlash backbone (and DSpark heads); parameters are empty until loaded or initialised.

    Context path: target features [S, F] -> fc -> context_norm -> each layer's k/v projections.
    Block path: [embed(anchor), mask_embedding, ...] -> layers (attending to context + block) ->
    norm -> the target's LM head. DSpark: logits_i = base_i + W2 W1[x_{i-1}] with W1 =
    `markov_in` [V, r] and W2 = `markov_out` [V, r]; confidence
    c_i = sigmoid(w . [h_i; W1[x_{i-1}]]).
    """

    def __init__(self, config: BlockDrafterConfig, target_config: ModelConfig) -> None:
        super().__init__()
        if target_config.hidden_size != config.target_hidden_size:
            raise ValueError(
                f"the drafter was built for a target of hidden size {config.target_hidden_size}, "
                f"this target has {target_config.hidden_size}"
            )
        if target_config.vocab_size != config.target_vocab_size:
            raise ValueError(
                f"the drafter was built for a vocabulary of {config.target_vocab_size} ids, "
                f"this target has {target_config.vocab_size}"
            )
        if target_config.num_hidden_layers != config.target_num_hidden_layers:
            raise ValueError(
                f"the drafter was built for a target of {config.target_num_hidden_layers} "
                f"layers, this target has {target_config.num_hidden_layers}"
            )
        self.config = config
        layers = layer_config(config, target_config)
        hidden = target_config.hidden_size
        self.fc = Linear(len(config.feature_layers) * hidden, hidden, bias=False)
        self.context_norm = rms_norm(target_config)
        self.mask_embedding = nn.Parameter(torch.empty(hidden))  # [D]
        layer_class = BLOCK_LAYERS[layers.norm_placement]
        self.layers = nn.ModuleList(layer_class(layers) for _ in range(layers.num_hidden_layers))
        self.norm = rms_norm(target_config)
        self.rotary_emb = RotaryEmbedding(layers)
        self.markov_in = self.markov_out = self.confidence = None
        if config.kind == "dspark":
            self.markov_in = Embedding(target_config.vocab_size, config.markov_rank)  # W1 [V, r]
            self.markov_out = Linear(config.markov_rank, target_config.vocab_size, bias=False)
            self.confidence = Linear(hidden + config.markov_rank, 1, bias=True)

    def context_keys_values(
        self, features: torch.Tensor, positions: torch.Tensor
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Projects target features into every layer's context keys and values.

        Args:
            features: [N, S, F] target features (the `feature_layers` outputs, concatenated).
            positions: [N, S] int64 positions of those tokens.

        Returns: per layer, (keys, values) [N, S, H_kv, head_dim].
        """
        weight = self.fc.weight
        context = self.context_norm(self.fc(features.to(weight.dtype)))  # [N, S, D]
        cos, sin = self.rotary_emb(positions.flatten())
        shape = (*positions.shape, cos.shape[-1])
        cos, sin = cos.view(shape), sin.view(shape)
        return [layer.self_attn.keys_values(context, cos, sin) for layer in self.layers]

    def forward(
        self,
        rows: torch.Tensor,
        positions: torch.Tensor,
        context: list,
        mask: torch.Tensor | None,
    ) -> torch.Tensor:
        """Runs the block rows through the layers.

        Args:
            rows: [N, R, D] input rows (anchor embeddings and `mask_embedding`).
            positions: [N, R] int64 positions of the rows.
            context: per layer, (keys, values) [N, S, H_kv, head_dim] from `context_keys_values`,
                or a paged context (`paged_context.PagedLayerContext`; then mask is None).
            mask: [N, R, S + R] bool, True where a row may attend (context keys, then rows).

        Returns: [N, R, D] final hidden states (after the final norm).
        """
        cos, sin = self.rotary_emb(positions.flatten())
        shape = (*positions.shape, cos.shape[-1])
        cos, sin = cos.view(shape), sin.view(shape)
        hidden = rows
        for layer, layer_context in zip(self.layers, context, strict=True):
            hidden = layer(hidden, cos, sin, layer_context, mask)
        return self.norm(hidden)

    def markov(self, previous: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """DSpark's Markov head. Args: previous [M] int64 previous tokens x_{i-1}.

        Returns: (W1[x_{i-1}] [M, r], bias W2 W1[x_{i-1}] [M, V] float32)."""
        if self.markov_in is None or self.markov_out is None:
            raise ValueError("a dflash drafter has no Markov head")
        low_rank = self.markov_in(previous)
        return low_rank, self.markov_out(low_rank).float()

    def confidence_logit(self, hidden: torch.Tensor, low_rank: torch.Tensor) -> torch.Tensor:
        """DSpark's confidence head before the sigmoid.

        Args: hidden [M, D] the row's final hidden state h_i; low_rank [M, r] W1[x_{i-1}].
        Returns: [M] float32 logit of c_i, the chance that draft i is accepted given the
        earlier drafts were.
        """
        if self.confidence is None:
            raise ValueError("a dflash drafter has no confidence head")
        return self.confidence(torch.cat([hidden, low_rank], dim=-1)).squeeze(-1).float()


def block_mask(context_lens: torch.Tensor, num_context: int, num_rows: int) -> torch.Tensor:
    """[B, R, S + R] bool: each request's rows see its first context_lens[b] context keys and
    every row of its own block."""
    context = torch.arange(num_context, device=context_lens.device)[None, :] < context_lens[:, None]
    rows = torch.ones(context_lens.shape[0], num_rows, dtype=torch.bool, device=context.device)
    return torch.cat([context, rows], dim=1)[:, None, :].expand(-1, num_rows, -1)


@torch.no_grad()
def init_from_target(config: BlockDrafterConfig, target: LlamaForCausalLM) -> BlockDrafterModel:
    """A drafter whose weights are deterministic functions of the target's (the start of training).

    fc averages the feature layers; the decoder layers copy the target's last ones; the final norm
    copies the target's; the mask embedding is the mean token embedding; W1 starts as the first r
    embedding columns and W2 and the confidence head at zero (so DSpark starts as DFlash, c = 1/2).
    """
    target_config = target.config
    weight = target.model.embed_tokens.weight
    model = BlockDrafterModel(config, target_config).to(weight.device)
    for param in model.parameters():  # the RoPE buffer stays float32
        param.data = param.data.to(weight.dtype)
    hidden = target_config.hidden_size
    num_features = len(config.feature_layers)
    eye = torch.eye(hidden, dtype=weight.dtype, device=weight.device) / num_features
    model.fc.weight.copy_(eye.repeat(1, num_features))
    model.context_norm.weight.fill_(0.0 if target_config.norm_unit_offset else 1.0)  # identity
    model.norm.weight.copy_(target.model.norm.weight)
    model.mask_embedding.copy_(weight.mean(dim=0))
    first = target_config.num_hidden_layers - config.num_hidden_layers
    for index, layer in enumerate(model.layers):
        source = target.model.layers[first + index]
        state = source.state_dict()
        if isinstance(source.mlp, SparseMoeBlock):
            state = {k: v for k, v in state.items() if not k.startswith("mlp.")}
            state |= {f"mlp.{k}": v for k, v in experts_as_dense(source.mlp, layer.mlp).items()}
        layer.load_state_dict(state)
    if model.markov_in is not None:
        model.markov_in.weight.copy_(weight[:, : config.markov_rank])
        model.markov_out.weight.zero_()
        model.confidence.weight.zero_()
        model.confidence.bias.zero_()
    return model


def experts_as_dense(block: SparseMoeBlock, mlp: LlamaMLP) -> dict[str, torch.Tensor]:
    """Weights for the dense `mlp` that compute the mean of a sparse block's first n experts'
    outputs, n being as many whole experts as `mlp`'s width holds (at least 1: an expert wider
    than `mlp` gives its first rows); the rows past them are zero. The deterministic start of a
    block drafter's layer copied from a sparse one (the router is dropped)."""
    expert_width = block.experts[0].down_proj.weight.shape[1]
    dense_width = mlp.down_proj.weight.shape[1]
    count = max(1, min(len(block.experts), dense_width // expert_width))
    width = min(expert_width, dense_width)
    reference = block.experts[0].down_proj.weight  # [D, F]
    gate = reference.new_zeros(dense_width, reference.shape[0])
    up = reference.new_zeros(dense_width, reference.shape[0])
    down = reference.new_zeros(reference.shape[0], dense_width)
    for index, expert in enumerate(block.experts[:count]):
        rows = slice(index * width, (index + 1) * width)
        gate[rows] = expert.gate_proj.weight[:width]
        up[rows] = expert.up_proj.weight[:width]
        down[:, rows] = expert.down_proj.weight[:, :width] / count
    return {"gate_proj.weight": gate, "up_proj.weight": up, "down_proj.weight": down}
