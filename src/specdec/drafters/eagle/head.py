"""The EAGLE / MTP draft head: one decoder layer over [target feature, embedding of the next token].

Head entry t combines the feature of the token at position t with the embedding of the token at
t + 1 and predicts the token at t + 2 (EAGLE, Li et al. 2024, section 3; EAGLE-3's multi-layer
features, 2025, section 3.2). The head reuses the target's embedding and LM head (rows of a
reduced draft vocabulary), so its directory stores only the head. Never samples or draws
randomness; parameters are created empty and filled by a loader or by `specdec.train`.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from specdec.models.attention import AttentionMetadata, AttentionPlan, DecodeMetadata, KVCache
from specdec.models.config import ModelConfig
from specdec.models.fused import add_rms_norm
from specdec.models.layers import Linear, RMSNorm
from specdec.models.llama import LlamaDecoderLayer, LlamaForCausalLM
from specdec.models.loader import quantize_layer
from specdec.models.quant import QuantizedWeight, quant_linear
from specdec.models.quant_formats import quantize
from specdec.models.rope import RotaryEmbedding
from specdec.models.weights import CheckpointError, assign_weights

EAGLE_ARCHITECTURE = "SpecdecEagleHead"
WEIGHTS_FILE = "model.safetensors"


@dataclass(frozen=True, slots=True)
class EagleConfig:
    """The shape of an EAGLE head and the target it was trained for.

    Attributes:
        hidden_size: D, the target's hidden size (the head works in the same width).
        feature_layers: 0-based target layers whose outputs make a feature (F = len * D).
        intermediate_size: the head layer's SwiGLU width.
        num_attention_heads, num_key_value_heads, head_dim: the head layer's attention.
        rms_norm_eps: epsilon of the head's norms.
        rope_theta: RoPE base of the head layer.
        max_position_embeddings: longest sequence the head is used for.
        target_vocab_size: V of the target.
        target_num_hidden_layers: layers of the target (a check at load time).
        draft_vocab_size: V_draft when the head drafts over a reduced vocabulary (the
            `draft_to_target` tensor stored beside the weights maps it), or None for the full one.
    """

    hidden_size: int
    feature_layers: tuple[int, ...]
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    target_vocab_size: int
    target_num_hidden_layers: int
    draft_vocab_size: int | None = None

    @property
    def feature_size(self) -> int:
        return len(self.feature_layers) * self.hidden_size

    def layer_config(self) -> ModelConfig:
        """The ModelConfig of the head's one decoder layer (Llama numerics)."""
        return ModelConfig(
            architecture="LlamaForCausalLM",
            vocab_size=self.target_vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=1,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            rms_norm_eps=self.rms_norm_eps,
            rope_theta=self.rope_theta,
            max_position_embeddings=self.max_position_embeddings,
        )

    def to_dict(self) -> dict[str, Any]:
        values = dataclasses.asdict(self)
        values["feature_layers"] = list(self.feature_layers)
        return {"architectures": [EAGLE_ARCHITECTURE], **values}

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> EagleConfig:
        if values.get("architectures") != [EAGLE_ARCHITECTURE]:
            raise ValueError(
                f"not an EAGLE head config (architectures {values.get('architectures')!r}, "
                f"expected [{EAGLE_ARCHITECTURE!r}])"
            )
        names = {f.name for f in dataclasses.fields(cls)}
        kwargs = {k: v for k, v in values.items() if k in names}
        kwargs["feature_layers"] = tuple(kwargs["feature_layers"])
        return cls(**kwargs)

    @classmethod
    def for_target(
        cls,
        target: ModelConfig,
        feature_layers: tuple[int, ...] | None = None,
        draft_vocab_size: int | None = None,
        intermediate_size: int | None = None,
    ) -> EagleConfig:
        """A head shaped like one layer of `target` (default features: its last layer)."""
        layers = feature_layers or (target.num_hidden_layers - 1,)
        return cls(
            hidden_size=target.hidden_size,
            feature_layers=tuple(layers),
            intermediate_size=intermediate_size or target.intermediate_size,
            num_attention_heads=target.num_attention_heads,
            num_key_value_heads=target.num_key_value_heads,
            head_dim=target.head_dim,
            rms_norm_eps=target.rms_norm_eps,
            rope_theta=target.rope_theta,
            max_position_embeddings=target.max_position_embeddings,
            target_vocab_size=target.vocab_size,
            target_num_hidden_layers=target.num_hidden_layers,
            draft_vocab_size=draft_vocab_size,
        )


class FeatureNorm(nn.Module):
    """RMSNorm of each layer's D-wide part of a concatenated feature, with weight [F].

    The residual stream before the final norm carries a few channels hundreds of times larger
    than the rest; normalising each part first (initialised with the target's final-norm weight,
    so the last layer's part is exactly what the target's LM head reads) keeps them from drowning
    the others."""

    def __init__(self, num_parts: int, dim: int, eps: float) -> None:
        super().__init__()
        self.num_parts, self.dim, self.eps = num_parts, dim, eps
        self.weight = nn.Parameter(torch.empty(num_parts * dim))  # [F]

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        """[.., F] -> [.., F] in the input's dtype."""
        shape = features.shape
        if features.is_cuda and features.dim() == 2 and not torch.is_grad_enabled():
            # Inference on CUDA: the norm in one fused kernel (no backward), its weight after.
            parts = features.reshape(-1, self.dim)
            normed, _ = add_rms_norm(parts, None, self._unit_weight(parts), self.eps)
            return self.weight * normed.view(shape)
        x = features.to(torch.float32).view(*shape[:-1], self.num_parts, self.dim)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.view(shape).to(features.dtype)

    def _unit_weight(self, like: torch.Tensor) -> torch.Tensor:
        """[D] ones in `like`'s dtype and device, made once (before any graph capture: the
        head's first step runs eagerly)."""
        ones = getattr(self, "_ones", None)
        if ones is None or ones.dtype != like.dtype or ones.device != like.device:
            ones = self._ones = torch.ones(self.dim, dtype=like.dtype, device=like.device)
        return ones


class EagleHead(nn.Module):
    """fc(norm(target feature)) or the head's previous output -> one decoder layer -> [.., D].

    Parameters: `feature_norm` [F], `fc` [D, F] (target features -> D), `embed_norm`,
    `hidden_norm` [D],
    `in_proj` [D, 2D] (over [norm(embedding), norm(hidden)]), `layer` (a Llama decoder layer),
    `norm` [D] (before the shared LM head). Buffer `draft_to_target` [V_draft] int64 when the
    vocabulary is reduced.
    """

    def __init__(self, config: EagleConfig) -> None:
        super().__init__()
        self.config = config
        dim = config.hidden_size
        layer_config = config.layer_config()
        self.feature_norm = FeatureNorm(len(config.feature_layers), dim, config.rms_norm_eps)
        self.fc = Linear(config.feature_size, dim, bias=False)
        self.embed_norm = RMSNorm(dim, config.rms_norm_eps)
        self.hidden_norm = RMSNorm(dim, config.rms_norm_eps)
        self.in_proj = Linear(2 * dim, dim, bias=False)
        self.layer = LlamaDecoderLayer(layer_config)
        self.norm = RMSNorm(dim, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(layer_config)

    def project_features(self, features: torch.Tensor) -> torch.Tensor:
        """[.., F] target features -> [.., D] hidden input of a head entry."""
        return self.fc(self.feature_norm(features))

    def layer_input(self, hidden: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor:
        """[.., D] hidden (fc(feature) or a previous head output), [.., D] token embeddings ->
        [.., D] input of the decoder layer."""
        joined = torch.cat((self.embed_norm(embeds), self.hidden_norm(hidden)), dim=-1)
        return self.in_proj(joined)

    def forward_paged(
        self,
        hidden: torch.Tensor,
        embeds: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionMetadata,
        kv_cache: KVCache,
    ) -> torch.Tensor:
        """One step of head entries over the head's paged cache (inference).

        Args:
            hidden: [T, D] `project_features` of each entry's target feature, or the previous
                head output.
            embeds: [T, D] embedding of the token at each entry's position.
            positions: [T] int64 position of that token (entry t sits at t + 1).
            attn: the step's metadata over the head's cache (entry t in slot t).
            kv_cache: the head's one-layer cache.

        Returns:
            [T, D] head outputs (before `norm`).

        Mutates: the `kv_cache` slots in `attn.slot_mapping`.
        """
        cos, sin = self.rotary_emb(positions)
        plan = AttentionPlan.build(attn, kv_cache.block_size, hidden.device)
        x = self.layer_input(hidden, embeds)
        return self.layer(x, cos, sin, plan, kv_cache.k_cache[0], kv_cache.v_cache[0])

    def forward_decode(
        self,
        hidden: torch.Tensor,
        embeds: torch.Tensor,
        positions: torch.Tensor,
        meta: DecodeMetadata,
        kv_cache: KVCache,
    ) -> torch.Tensor:
        """`forward_paged` through the fused decode kernels, for steps in which each sequence
        brings at most `meta.query_per_seq` entries in the uniform layout of `DecodeMetadata`
        (a draft step: one entry per sequence). A fraction of `forward_paged`'s operations (about
        20), and no host sync. Same arguments and result (rows of padding entries are garbage).

        Mutates: the `kv_cache` slots in `meta.slot_mapping`.
        """
        layer = self.layer
        embeds, _ = add_rms_norm(embeds, None, self.embed_norm.weight, self.embed_norm.eps)
        hidden, _ = add_rms_norm(hidden, None, self.hidden_norm.weight, self.hidden_norm.eps)
        x = self.in_proj(torch.cat((embeds, hidden), dim=-1))
        normed, residual = add_rms_norm(
            x, None, layer.input_layernorm.weight, layer.input_layernorm.eps
        )
        out = layer.self_attn.forward_decode(
            normed,
            positions,
            self.rotary_emb.inv_freq,
            meta,
            kv_cache.k_cache[0],
            kv_cache.v_cache[0],
        )
        normed, residual = add_rms_norm(
            out, residual, layer.post_attention_layernorm.weight, layer.post_attention_layernorm.eps
        )
        return layer.mlp.forward_decode(normed) + residual

    @property
    def dtype(self) -> torch.dtype:
        """The head's activation dtype (its norms stay float when its linears are quantized)."""
        return self.norm.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.norm.weight.device

    def allocate_kv_cache(self, num_blocks: int, block_size: int) -> KVCache:
        weight = self.norm.weight
        return KVCache.allocate(
            1,
            num_blocks,
            block_size,
            self.config.num_key_value_heads,
            self.config.head_dim,
            dtype=weight.dtype,
            device=weight.device,
        )


def head_logits_weight(
    target: LlamaForCausalLM, draft_to_target: torch.Tensor | None, dtype: torch.dtype
) -> torch.Tensor | QuantizedWeight:
    """[V_draft, D] rows of the target's LM head the head scores (all rows when not reduced),
    in `dtype`, or in the target's quantized format when its head is quantized."""
    quantized = target.lm_head_quantized
    if quantized is not None:
        if draft_to_target is None:
            return quantized
        return quantized.select_rows(draft_to_target)
    weight = target.lm_head_weight
    if draft_to_target is not None:
        weight = weight.index_select(0, draft_to_target.to(weight.device))
    return weight.to(dtype)


def head_logits(
    head: EagleHead, hidden: torch.Tensor, lm_weight: torch.Tensor | QuantizedWeight
) -> torch.Tensor:
    """[.., D] head outputs -> [.., V_draft] float32 draft logits."""
    inference = hidden.dim() == 2 and not torch.is_grad_enabled()
    if inference:  # one fused kernel on CUDA, the numerics of `head.norm` (it has no backward)
        normed, _ = add_rms_norm(hidden, None, head.norm.weight, head.norm.eps)
    else:
        normed = head.norm(hidden)
    if isinstance(lm_weight, QuantizedWeight):
        return quant_linear(normed, lm_weight).float()
    return F.linear(normed, lm_weight).float()


def check_target(config: EagleConfig, target: ModelConfig, source: str) -> None:
    """Raises ValueError when the head was trained for a target of another shape."""
    mismatches = [
        f"{name} {mine} vs the target's {theirs}"
        for name, mine, theirs in (
            ("hidden_size", config.hidden_size, target.hidden_size),
            ("vocab_size", config.target_vocab_size, target.vocab_size),
            ("num_hidden_layers", config.target_num_hidden_layers, target.num_hidden_layers),
        )
        if mine != theirs
    ]
    if mismatches:
        raise ValueError(f"{source}: this EAGLE head does not fit the target: {mismatches}")


def quantize_head_int8(head: EagleHead) -> bool:
    """On the CPU, makes the head's linears (fc, in_proj, its decoder layer's) int8 weight-only,
    per output channel, through PyTorch's int8 kernel; the norms stay float. True when done;
    False, changing nothing, where that kernel is missing (a dequantizing fallback would be
    slower than the float head). Its drafts are then drawn from the quantized head's own
    distribution, which is what the verifier is given, so exactness does not depend on it.
    Half a round's host time on a 2-core AMD EPYC (the head's `propose` 8.1 -> 4.0 ms median,
    the held-out acceptance unchanged; BENCHMARKS.md area 4)."""
    device = head.device
    if device.type != "cpu":
        return False
    probe = QuantizedWeight(quantize(head.fc.weight.detach(), "int8"), device)
    if probe.layout != "cpu_int8":
        return False
    head.fc.set_quantized(probe)
    in_proj = quantize(head.in_proj.weight.detach(), "int8")
    head.in_proj.set_quantized(QuantizedWeight(in_proj, device))
    quantize_layer(head.layer, "int8", device, head.dtype)
    return True


def load_eagle_head(
    path: str | Path, target: ModelConfig, dtype: torch.dtype, device: torch.device | str
) -> tuple[EagleHead, torch.Tensor | None]:
    """Loads a head directory (config.json + model.safetensors).

    Returns:
        (head in eval mode without grads, draft_to_target [V_draft] int64 or None).

    Raises:
        FileNotFoundError, CheckpointError, ValueError: a missing file or tensor, a wrong shape,
        a head made for another target.
    """
    path = Path(path)
    config_file, weights_file = path / "config.json", path / WEIGHTS_FILE
    for file in (config_file, weights_file):
        if not file.is_file():
            raise FileNotFoundError(f"no {file.name} in {path} (an EAGLE head directory)")
    config = EagleConfig.from_dict(json.loads(config_file.read_text(encoding="utf-8")))
    check_target(config, target, str(path))
    from safetensors.torch import load_file

    tensors = load_file(str(weights_file))
    draft_to_target = tensors.pop("draft_to_target", None)
    if (draft_to_target is None) != (config.draft_vocab_size is None):
        raise CheckpointError(f"{path}: draft_vocab_size and the draft_to_target tensor disagree")
    if draft_to_target is not None:
        draft_to_target = draft_to_target.to(torch.int64)
        if draft_to_target.shape != (config.draft_vocab_size,) or not (
            int(draft_to_target.min()) >= 0 and int(draft_to_target.max()) < target.vocab_size
        ):
            raise CheckpointError(f"{path}: draft_to_target is not a map into the target vocab")
    with torch.device("meta"):
        head = EagleHead(config)
    assign_weights(head, tensors.get, str(path), dtype, device)
    return head, draft_to_target
