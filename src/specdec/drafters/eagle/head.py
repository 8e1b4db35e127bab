"""The EAGLE / MTP draft head: one decoder layer over [target feature, embedding of the next token].

Head entry t combines the feature of the token at position t with the embedding of the token at
t + 1 and predicts the token at t + 2 (EAGLE, Li et al. 2024, section 3; EAGLE-3's multi-layer
features, 2025, section 3.2). The head reuses the target's embedding and LM head (rows of a
reduced draft vocabulary), so its directory stores only the head. Public checkpoints whose head
is wired differently (EAGLE-1/2: `eagle.public`; MTP layers inside a target: `drafters.mtp`) load
into the same class through `HeadLayout`.
Never samples or draws randomness; parameters are created empty and filled by a loader or by
`specdec.train`.
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
from specdec.models.decoder_layers import LlamaDecoderLayer
from specdec.models.fused import add_rms_norm
from specdec.models.layers import Embedding, Linear, RMSNorm
from specdec.models.linear import batch_invariant_linear
from specdec.models.llama import LlamaForCausalLM
from specdec.models.loader import quantize_layer
from specdec.models.quant import QuantizedWeight, quant_linear
from specdec.models.quant_formats import quantize
from specdec.models.quant_rows import QuantizedRows, weight_rows
from specdec.models.rope import RotaryEmbedding
from specdec.models.weights import CheckpointError, assign_weights

EAGLE_ARCHITECTURE = "SpecdecEagleHead"
WEIGHTS_FILE = "model.safetensors"


@dataclass(frozen=True, slots=True)
class HeadLayout:
    """Where a head is wired differently from the heads trained here (the defaults). Loaders of
    public formats set it; a head directory of ours never stores it.

    Attributes:
        feature_fc: the normed feature passes through `fc` [D, F] (ours); False: it is the
            hidden input as it is (EAGLE-1/2, whose feature is the target's last hidden state
            after its final norm: `feature_norm` then holds that norm's weight, F = D).
        input_norms: `embed_norm` and `hidden_norm` before `in_proj` (ours, and HASS heads'
            `add_para_norm`); False: the two are joined as they are (EAGLE-1/2).
        in_proj_bias: `in_proj` has a bias (EAGLE-1/2's `fc.bias`, when stored).
        layer_input_norm: the decoder layer normalises its input (ours); EAGLE-1/2 skip layer
            0's `input_layernorm` (EAGLE's cnets1.py, vLLM's llama_eagle.py).
        output_norm: `norm` before the LM head (ours); EAGLE-1/2 give the layer's output to the
            target's LM head as it is (and feed it back as the next entry's hidden input).
        own_embedding: tokens are looked up in the head's `embed_tokens` [V, D] (a public
            checkpoint whose table is not the target's); False: the target's table.
        feature_norm: the feature passes through `feature_norm` (ours; EAGLE-1/2's and
            DeepSeek-V3 MTP's, then the target's final norm); False: it enters as it is (MiMo's
            MTP reads the target's last hidden state before its final norm).
        hidden_first: `in_proj` reads [hidden, embedding] (MiMo's `input_proj`); False:
            [embedding, hidden] (EAGLE's and DeepSeek-V3's `eh_proj` order).
        norm_fed_back: the output norm ends the layer (`final_norm`, MiMo's final_layernorm):
            the LM head and the next chained entry both read the normed output; False: the next
            entry reads the output before `norm`.
    """

    feature_fc: bool = True
    input_norms: bool = True
    in_proj_bias: bool = False
    layer_input_norm: bool = True
    output_norm: bool = True
    own_embedding: bool = False
    feature_norm: bool = True
    hidden_first: bool = False
    norm_fed_back: bool = False


# EagleConfig fields that only loaders of public formats set (never in a head directory of ours).
_PUBLIC_ONLY_FIELDS = ("layout", "layer")


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
        layout: how the head is wired (`HeadLayout`; the default for ours).
        layer: the decoder layer's own ModelConfig when a public checkpoint states more than
            the fields above (RoPE scaling, q/k/v biases); None: `layer_config` derives it.
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
    layout: HeadLayout = HeadLayout()
    layer: ModelConfig | None = None

    @property
    def feature_size(self) -> int:
        return len(self.feature_layers) * self.hidden_size

    def layer_config(self) -> ModelConfig:
        """The ModelConfig of the head's one decoder layer (Llama numerics)."""
        if self.layer is not None:
            return self.layer
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
        """The config.json of a head directory of ours.

        Raises:
            ValueError: a head loaded from another format (writing it as ours would lose its
                wiring; `eagle.export` writes an EAGLE-1/2 layout back in that format)."""
        if self.layout != HeadLayout() or self.layer is not None:
            raise ValueError("a head loaded from a public format cannot be written as ours")
        values = {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if f.name not in _PUBLIC_ONLY_FIELDS
        }
        values["feature_layers"] = list(self.feature_layers)
        return {"architectures": [EAGLE_ARCHITECTURE], **values}

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> EagleConfig:
        if values.get("architectures") != [EAGLE_ARCHITECTURE]:
            raise ValueError(
                f"not an EAGLE head config (architectures {values.get('architectures')!r}, "
                f"expected [{EAGLE_ARCHITECTURE!r}])"
            )
        names = {f.name for f in dataclasses.fields(cls)} - set(_PUBLIC_ONLY_FIELDS)
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
    `hidden_norm` [D], `in_proj` [D, 2D] (over [norm(embedding), norm(hidden)]; bias [D] with
    `layout.in_proj_bias`), `layer` (a Llama decoder layer), `norm` [D] (before the shared LM
    head), `embed_tokens` [V, D] (with `layout.own_embedding`). A `config.layout` without
    `feature_norm`, `feature_fc`, `input_norms` or `output_norm` has None for those modules;
    without `layer_input_norm`, `layer.input_layernorm` is the identity; with `norm_fed_back`
    the output norm is `final_norm` (applied by the forward passes) and `norm` is None.
    """

    def __init__(self, config: EagleConfig) -> None:
        super().__init__()
        self.config = config
        layout = config.layout
        dim, eps = config.hidden_size, config.rms_norm_eps
        layer_config = config.layer_config()
        self.feature_norm = (
            FeatureNorm(len(config.feature_layers), dim, eps) if layout.feature_norm else None
        )
        self.fc = Linear(config.feature_size, dim, bias=False) if layout.feature_fc else None
        self.embed_norm = RMSNorm(dim, eps) if layout.input_norms else None
        self.hidden_norm = RMSNorm(dim, eps) if layout.input_norms else None
        self.in_proj = Linear(2 * dim, dim, bias=layout.in_proj_bias)
        self.layer = LlamaDecoderLayer(layer_config)
        if not layout.layer_input_norm:
            self.layer.input_layernorm = nn.Identity()
        output_norm = RMSNorm(dim, eps) if layout.output_norm else None
        self.norm = None if layout.norm_fed_back else output_norm
        self.final_norm = output_norm if layout.norm_fed_back else None
        self.embed_tokens = (
            Embedding(config.target_vocab_size, dim) if layout.own_embedding else None
        )
        self.lm_head = None  # the target's LM head scores (`head_logits_weight`)
        self.rotary_emb = RotaryEmbedding(layer_config)

    def project_features(self, features: torch.Tensor) -> torch.Tensor:
        """[.., F] target features -> [.., D] hidden input of a head entry."""
        normed = features if self.feature_norm is None else self.feature_norm(features)
        return normed if self.fc is None else self.fc(normed)

    def layer_input(self, hidden: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor:
        """[.., D] hidden (fc(feature) or a previous head output), [.., D] token embeddings ->
        [.., D] input of the decoder layer (EAGLE's order: the embedding first, unless
        `layout.hidden_first`)."""
        if self.embed_norm is not None:
            embeds, hidden = self.embed_norm(embeds), self.hidden_norm(hidden)
        return self.in_proj(self._joined(embeds, hidden))

    def _joined(self, embeds: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """[.., 2D] the two inputs of `in_proj` in the layout's order."""
        pair = (hidden, embeds) if self.config.layout.hidden_first else (embeds, hidden)
        return torch.cat(pair, dim=-1)

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
            [T, D] head outputs (before `norm`; after `final_norm` where the layout has it).

        Mutates: the `kv_cache` slots in `attn.slot_mapping`.
        """
        plan = AttentionPlan.build(attn, kv_cache.block_size, hidden.device)
        if plan.flash:  # CUDA: the decode path's kernels, so an entry's bits never depend on
            # what else the step holds (a prompt's catch-up beside decode entries; s45)
            return self.forward_decode(hidden, embeds, positions, None, kv_cache, flash=plan)
        cos, sin = self.rotary_emb(positions)
        x = self.layer_input(hidden, embeds)
        out = self.layer(x, cos, sin, plan, kv_cache.k_cache[0], kv_cache.v_cache[0])
        return out if self.final_norm is None else self.final_norm(out)

    def forward_decode(
        self,
        hidden: torch.Tensor,
        embeds: torch.Tensor,
        positions: torch.Tensor,
        meta: DecodeMetadata | None,
        kv_cache: KVCache,
        flash: AttentionPlan | None = None,
    ) -> torch.Tensor:
        """`forward_paged` through the fused decode kernels, for steps in which each sequence
        brings at most `meta.query_per_seq` entries in the uniform layout of `DecodeMetadata`
        (a draft step: one entry per sequence). A fraction of `forward_paged`'s operations (about
        20), and no host sync. Same arguments and result (rows of padding entries are garbage).
        With `flash` (a CUDA step of any entries, `meta` None) attention runs the prefill
        kernel, whose rows are the decode kernel's bits.

        Mutates: the `kv_cache` slots in `meta.slot_mapping` (`flash.slot_mapping`).
        """
        layer = self.layer
        if self.embed_norm is not None:
            embeds, _ = add_rms_norm(embeds, None, self.embed_norm.weight, self.embed_norm.eps)
            hidden, _ = add_rms_norm(hidden, None, self.hidden_norm.weight, self.hidden_norm.eps)
        x = self.in_proj(self._joined(embeds, hidden))
        if self.config.layout.layer_input_norm:
            norm = layer.input_layernorm
            normed, residual = add_rms_norm(x, None, norm.weight, norm.eps)
        else:
            normed, residual = x, x
        out = layer.self_attn.forward_decode(
            normed,
            positions,
            self.rotary_emb.inv_freq,
            meta,
            kv_cache.k_cache[0],
            kv_cache.v_cache[0],
            flash=flash,
        )
        normed, residual = add_rms_norm(
            out, residual, layer.post_attention_layernorm.weight, layer.post_attention_layernorm.eps
        )
        out = layer.mlp.forward_decode(normed) + residual
        if self.final_norm is not None:
            out, _ = add_rms_norm(out, None, self.final_norm.weight, self.final_norm.eps)
        return out

    @property
    def dtype(self) -> torch.dtype:
        """The head's activation dtype (its norms stay float when its linears are quantized)."""
        return self.layer.post_attention_layernorm.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.layer.post_attention_layernorm.weight.device

    def allocate_kv_cache(self, num_blocks: int, block_size: int) -> KVCache:
        weight = self.layer.post_attention_layernorm.weight
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
    target: LlamaForCausalLM,
    draft_to_target: torch.Tensor | None,
    dtype: torch.dtype,
    head: nn.Module | None = None,
) -> torch.Tensor | QuantizedWeight | QuantizedRows:
    """[V_draft, D] the LM head `head` scores: its own `lm_head` (an EAGLE-3 head's) when it
    has one, else the rows of the target's LM head (all rows when not reduced), in `dtype`, or
    in the target's quantized format when its head is quantized."""
    own = None if head is None else head.lm_head
    if own is not None:
        return own.weight
    quantized = target.lm_head_quantized
    if quantized is not None:
        if draft_to_target is None:
            return quantized
        return weight_rows(quantized, draft_to_target)
    weight = target.lm_head_weight
    if draft_to_target is not None:
        weight = weight.index_select(0, draft_to_target.to(weight.device))
    return weight.to(dtype)


def head_logits(
    head: EagleHead, hidden: torch.Tensor, lm_weight: torch.Tensor | QuantizedWeight | QuantizedRows
) -> torch.Tensor:
    """[.., D] head outputs -> [.., V_draft] float32 draft logits."""
    inference = hidden.dim() == 2 and not torch.is_grad_enabled()
    if head.norm is None:  # (`HeadLayout.output_norm`)
        normed = hidden
    elif inference:  # one fused kernel on CUDA, the numerics of `head.norm` (it has no backward)
        normed, _ = add_rms_norm(hidden, None, head.norm.weight, head.norm.eps)
    else:
        normed = head.norm(hidden)
    if isinstance(lm_weight, QuantizedWeight):
        return quant_linear(normed, lm_weight).float()
    if isinstance(lm_weight, QuantizedRows):
        return lm_weight.matmul(normed).float()
    if inference:  # a row's draft logits never depend on how many rows the call holds
        return batch_invariant_linear(normed, lm_weight).float()
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


def quantize_head_int8(head: nn.Module) -> bool:
    """On the CPU, makes the head's linears (`fc`, `in_proj` where it has one, its decoder
    layer's; an `EagleHead` or an EAGLE-3 head) int8 weight-only, per output channel, through
    PyTorch's int8 kernel; the norms (and an EAGLE-3 head's own LM head) stay float. True when
    done; False, changing nothing, where that kernel is missing (a dequantizing fallback would
    be slower than the float head). Its drafts are then drawn from the quantized head's own
    distribution, which is what the verifier is given, so exactness does not depend on it.
    Half a round's host time on a 2-core AMD EPYC (the head's `propose` 8.1 -> 4.0 ms median,
    the held-out acceptance unchanged; BENCHMARKS.md area 4). A linear's weight kept in its
    file's dtype (`load_eagle_head`) gives the bits of a head loaded in `head.dtype`."""
    device, dtype = head.device, head.dtype
    if device.type != "cpu":
        return False
    linears = [getattr(head, name, None) for name in ("fc", "in_proj")]
    linears = [linear for linear in linears if linear is not None]
    weights = [
        QuantizedWeight(quantize(linear.weight.detach(), "int8", dtype), device)
        for linear in linears
    ]
    if any(weight.layout != "cpu_int8" for weight in weights):
        return False
    for linear, weight in zip(linears, weights, strict=True):
        linear.set_quantized(weight)
    quantize_layer(head.layer, "int8", device, dtype)
    return True


def _linear_weight_names(head: nn.Module) -> list[str]:
    """The parameter names of the weights of `head`'s `Linear`s (those `quantize_head_int8`
    quantizes, and an EAGLE-3 head's own LM head, which it keeps float)."""
    return [
        f"{name}.weight"
        for name, module in head.named_modules()
        if isinstance(module, Linear) and module.weight is not None
    ]


def _cast_parameters(module: nn.Module, dtype: torch.dtype) -> None:
    """Casts every parameter of `module` that is not in `dtype` (weights kept in their file's
    dtype that were not quantized). Mutates: those parameters (replaced)."""
    for owner in module.modules():
        for name, param in list(owner.named_parameters(recurse=False)):
            if param.dtype != dtype:
                setattr(owner, name, nn.Parameter(param.to(dtype), requires_grad=False))


def load_eagle_head(
    path: str | Path,
    target: ModelConfig,
    dtype: torch.dtype,
    device: torch.device | str,
    int8_linears: bool = False,
) -> tuple[EagleHead, torch.Tensor | None]:
    """Loads a head directory (config.json + model.safetensors); with `int8_linears`, its
    linears made int8 as `quantize_head_int8` makes them (where it can: on the CPU), each from
    the file's tensor: the head never holds its float linears all at once (the shipped head's
    would be 32 MiB in float32 beside the file's 16; at most one weight in float here).

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
        # A copy: `load_file`'s tensors are views of the file's memory map, which this one
        # alone would keep mapped (its read pages resident) for the drafter's lifetime.
        draft_to_target = draft_to_target.to(torch.int64, copy=True)
        if draft_to_target.shape != (config.draft_vocab_size,) or not (
            int(draft_to_target.min()) >= 0 and int(draft_to_target.max()) < target.vocab_size
        ):
            raise CheckpointError(f"{path}: draft_to_target is not a map into the target vocab")
    with torch.device("meta"):
        head = EagleHead(config)
    # With int8_linears, the linears' weights stay views of the file until quantized.
    keep = _linear_weight_names(head) if int8_linears else ()
    assign_weights(head, tensors.get, str(path), dtype, device, keep_dtype=keep)
    del tensors
    if keep:
        quantize_head_int8(head)
        _cast_parameters(head, dtype)  # none left where the head was quantized
    return head, draft_to_target
