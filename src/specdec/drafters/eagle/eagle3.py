"""EAGLE-3 heads from public checkpoints (Li et al. 2025, EAGLE-3, section 3): `Eagle3Head` and its
loader, wired as vLLM's llama_eagle3.py, SGLang's llama_eagle3.py and `speculators` define it.

Head entry t (the token at t + 1 with the hidden input of position t) computes

    g_t = fc(cat(a_1(t), a_2(t), a_3(t)))      (+ fc.bias when stored)   [3 D] -> [D]
    u   = cat(input_layernorm(embed(x_{t+1})), hidden_norm(h_t))                  [2 D]
    r   = h_t                    (hidden_norm(h_t) with `norm_before_residual`)
    y   = r + o_proj(attention(q_proj(u), k_proj(u), v_proj(u)))   q/k/v: 2 D wide
    o_t = y + mlp(post_attention_layernorm(y))                     the midlayer's output
    draft logits = lm_head(norm(o_t))                              [V_draft]

where h_t = g_t for an entry fed from the target (a_i(t): the target's residual stream after
the captured layers, before its final norm, concatenated in ascending layer order) and
h_t = o_{t-1} for a chained draft step (the midlayer's output before `norm`; `fc` is skipped,
as vLLM does when the hidden input is D wide). Draft id i is target id i + d2t[i]; t2d marks
those target ids. The head's embedding is the target's unless the checkpoint stores
`embed_tokens.weight` with other values. Reads files and builds the head; never samples.

Captured layers. vLLM captures "layer id k" as the input of decoder layer k (the output of
layer k - 1); SGLang adds 1 to the ids it reads, so there id k is the output of layer k. Each
reads its own key, and this loader reads each key as the engine that defines it does:

- top-level `eagle_aux_hidden_state_layer_ids` (vLLM's key, the `speculators` config's): the
  output of layer k - 1 (k = 0, the embedding, is refused: the target does not capture it);
- `eagle_config.eagle_aux_hidden_state_layer_ids` (SGLang's and SpecForge's key): the output
  of layer k;
- neither: vLLM's and SGLang's default, the inputs of layers (2, N // 2, N - 3) = the outputs
  of layers (1, N // 2 - 1, N - 4) of an N-layer target.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from specdec.drafters.formats import DrafterCheckpoint
from specdec.models import LlamaForCausalLM
from specdec.models.attention import AttentionMetadata, AttentionPlan, DecodeMetadata, KVCache
from specdec.models.config import ModelConfig
from specdec.models.decoder_layers import LlamaAttention, LlamaMLP, rms_norm
from specdec.models.fused import add_rms_norm
from specdec.models.layers import Embedding, Linear, RMSNorm
from specdec.models.rope import RotaryEmbedding
from specdec.models.weights import CheckpointError, assign_weights

# config.json styles `eagle3_config` reads.
SPECULATORS_STYLE = "speculators"  # `speculators_model_type: "eagle3"`, transformer_layer_config
HF_STYLE = "hf"  # a Llama config of one layer (SpecForge / SGLang / vLLM), draft_vocab_size

# Layer tensor prefixes: EAGLE's, SpecForge's and SGLang's `midlayer.`; speculators' (and vLLM's
# other spelling) `layers.0.`.
LAYER_PREFIXES = ("midlayer.", "layers.0.")
# Options of newer `speculators` heads this loader does not wire (each changes the math).
_REFUSED_OPTIONS = ("norm_before_fc", "fc_norm", "norm_output")


@dataclass(frozen=True, slots=True)
class Eagle3Config:
    """The shape of an EAGLE-3 head and how it is wired.

    Attributes:
        feature_layers: 0-based target layers whose outputs (ascending) make the feature.
        layer: the midlayer's ModelConfig (Llama numerics: D, heads, MLP, RoPE, its vocabulary
            size is the target's).
        draft_vocab_size: V_draft, the rows of `lm_head`.
        norm_before_residual: the residual is hidden_norm(h) instead of h.
        fc_bias: `fc` has a bias.
        own_embedding: tokens are looked up in the head's `embed_tokens`; False: the target's.
        own_lm_head: the head has its own `lm_head` [V_draft, D]; False: the target's LM head
            (a full draft vocabulary only).
    """

    feature_layers: tuple[int, ...]
    layer: ModelConfig
    draft_vocab_size: int
    norm_before_residual: bool = False
    fc_bias: bool = False
    own_embedding: bool = False
    own_lm_head: bool = True

    @property
    def hidden_size(self) -> int:
        return self.layer.hidden_size

    @property
    def feature_size(self) -> int:
        return len(self.feature_layers) * self.hidden_size

    @property
    def num_key_value_heads(self) -> int:
        return self.layer.num_key_value_heads

    @property
    def head_dim(self) -> int:
        return self.layer.head_dim


class Eagle3Layer(nn.Module):
    """EAGLE-3's midlayer: attention over [input_layernorm(embedding), hidden_norm(hidden)]
    (q/k/v 2D wide) with the hidden as the residual, then the Llama MLP block."""

    def __init__(self, config: ModelConfig, norm_before_residual: bool) -> None:
        super().__init__()
        self.norm_before_residual = norm_before_residual
        self.self_attn = attn = LlamaAttention(config)
        wide = 2 * config.hidden_size
        q_size, kv_size = attn.num_heads * attn.head_dim, attn.num_kv_heads * attn.head_dim
        attn.q_proj = Linear(wide, q_size, config.attention_bias)
        attn.k_proj = Linear(wide, kv_size, config.attention_bias)
        attn.v_proj = Linear(wide, kv_size, config.attention_bias)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = rms_norm(config)  # of the token embedding
        self.hidden_norm = rms_norm(config)
        self.post_attention_layernorm = rms_norm(config)

    def attention_input(
        self, hidden: torch.Tensor, embeds: torch.Tensor, fused: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """[.., D] hidden, [.., D] embeddings -> ([.., 2D] attention input, [.., D] residual);
        `fused`: the norms through the fused kernel (the decode path), else the modules."""
        embeds = _norm(self.input_layernorm, embeds, fused)
        normed = _norm(self.hidden_norm, hidden, fused)
        residual = normed if self.norm_before_residual else hidden
        return torch.cat((embeds, normed), dim=-1), residual


def _norm(norm: RMSNorm, x: torch.Tensor, fused: bool) -> torch.Tensor:
    if fused:
        return add_rms_norm(x, None, norm.weight, norm.eps)[0]
    return norm(x)


class Eagle3Head(nn.Module):
    """fc(target features) or the head's previous output -> the midlayer -> [.., D] (before
    `norm`); `head_logits` applies `norm` and the LM head. The same interface as `EagleHead`
    (`project_features`, `forward_paged`, `forward_decode`, `layer`, `norm`, `lm_head`,
    `embed_tokens`), so `EagleDrafter` runs either.

    Parameters: `fc` [D, F] (bias [D] with `config.fc_bias`), `layer` (an `Eagle3Layer`),
    `norm` [D], `lm_head` [V_draft, D] (with `config.own_lm_head`), `embed_tokens` [V, D]
    (with `config.own_embedding`).
    """

    def __init__(self, config: Eagle3Config) -> None:
        super().__init__()
        self.config = config
        layer_config, dim = config.layer, config.hidden_size
        self.fc = Linear(config.feature_size, dim, bias=config.fc_bias)
        self.layer = Eagle3Layer(layer_config, config.norm_before_residual)
        self.norm = rms_norm(layer_config)
        self.lm_head = (
            Linear(dim, config.draft_vocab_size, bias=False) if config.own_lm_head else None
        )
        self.embed_tokens = (
            Embedding(layer_config.vocab_size, dim) if config.own_embedding else None
        )
        self.rotary_emb = RotaryEmbedding(layer_config)

    def project_features(self, features: torch.Tensor) -> torch.Tensor:
        """[.., F] target features -> [.., D] hidden input of a head entry (`fc`)."""
        return self.fc(features)

    def forward_paged(
        self,
        hidden: torch.Tensor,
        embeds: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionMetadata,
        kv_cache: KVCache,
    ) -> torch.Tensor:
        """One step of head entries over the head's paged cache: [T, D] hidden (`fc` of the
        target features, or previous head outputs), [T, D] token embeddings, [T] int64
        positions -> [T, D] midlayer outputs (before `norm`), as `EagleHead.forward_paged`.

        Mutates: the `kv_cache` slots in `attn.slot_mapping`.
        """
        layer = self.layer
        plan = AttentionPlan.build(attn, kv_cache.block_size, hidden.device)
        if plan.flash:  # CUDA: the decode path's kernels (`EagleHead.forward_paged`)
            return self.forward_decode(hidden, embeds, positions, None, kv_cache, flash=plan)
        cos, sin = self.rotary_emb(positions)
        x, residual = layer.attention_input(hidden, embeds, fused=False)
        k_cache, v_cache = kv_cache.k_cache[0], kv_cache.v_cache[0]
        y = residual + layer.self_attn(x, cos, sin, plan, k_cache, v_cache)
        return y + layer.mlp(layer.post_attention_layernorm(y))

    def forward_decode(
        self,
        hidden: torch.Tensor,
        embeds: torch.Tensor,
        positions: torch.Tensor,
        meta: DecodeMetadata | None,
        kv_cache: KVCache,
        flash: AttentionPlan | None = None,
    ) -> torch.Tensor:
        """`forward_paged` through the fused decode kernels (see `EagleHead.forward_decode`):
        the same arguments and result (rows of padding entries are garbage); with `flash`
        (`meta` None) attention through the prefill kernel.

        Mutates: the `kv_cache` slots in `meta.slot_mapping` (`flash.slot_mapping`).
        """
        layer = self.layer
        x, residual = layer.attention_input(hidden, embeds, fused=True)
        k_cache, v_cache = kv_cache.k_cache[0], kv_cache.v_cache[0]
        inv_freq = self.rotary_emb.inv_freq
        out = layer.self_attn.forward_decode(
            x, positions, inv_freq, meta, k_cache, v_cache, flash=flash
        )
        post = layer.post_attention_layernorm
        normed, residual = add_rms_norm(out, residual, post.weight, post.eps)
        return layer.mlp.forward_decode(normed) + residual

    @property
    def dtype(self) -> torch.dtype:
        """The head's activation dtype (its norms stay float when its linears are quantized)."""
        return self.layer.hidden_norm.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.layer.hidden_norm.weight.device

    def allocate_kv_cache(self, num_blocks: int, block_size: int) -> KVCache:
        weight = self.layer.hidden_norm.weight
        return KVCache.allocate(
            1,
            num_blocks,
            block_size,
            self.config.num_key_value_heads,
            self.config.head_dim,
            dtype=weight.dtype,
            device=weight.device,
        )


# --- Loading -------------------------------------------------------------------------------------


def eagle3_style(values: dict[str, Any]) -> str:
    """SPECULATORS_STYLE for a `speculators` config (`speculators_model_type`), else HF_STYLE."""
    return SPECULATORS_STYLE if "speculators_model_type" in values else HF_STYLE


def capture_layers(values: dict[str, Any], num_layers: int, source: str) -> tuple[int, ...]:
    """The 0-based target layers whose outputs make an EAGLE-3 feature, ascending, read from a
    config.json as the module docstring says (`values`: the whole config; `num_layers`: the
    target's).

    Raises:
        ValueError: both keys naming other layers; an id naming the embedding or a layer the
            target lacks; two ids naming one layer (vLLM and SGLang would then capture fewer
            states than `fc` reads).
    """
    vllm_ids = values.get("eagle_aux_hidden_state_layer_ids")
    nested = (values.get("eagle_config") or {}) if eagle3_style(values) == HF_STYLE else {}
    sglang_ids = nested.get("eagle_aux_hidden_state_layer_ids")
    readings = []  # (what was read, the target layers it names)
    if vllm_ids:
        readings.append(
            (f"eagle_aux_hidden_state_layer_ids {list(vllm_ids)}", [k - 1 for k in vllm_ids])
        )
    if sglang_ids:
        readings.append(
            (f"eagle_config.eagle_aux_hidden_state_layer_ids {list(sglang_ids)}", list(sglang_ids))
        )
    if not readings:
        inputs = [2, num_layers // 2, num_layers - 3]
        readings.append((f"the default ids {inputs}", [k - 1 for k in inputs]))
    (key, layers), *other = readings
    if other and sorted(layers) != sorted(other[0][1]):
        raise ValueError(
            f"{source}: {key} (vLLM's reading: the outputs of layers {layers}) and "
            f"{other[0][0]} (SGLang's: layers {other[0][1]}) name different target layers"
        )
    if -1 in layers:
        raise ValueError(
            f"{source}: {key} names layer 0's input (the embedding output), which the target "
            "does not capture for drafters"
        )
    bad = [i for i in layers if not 0 <= i < num_layers]
    if bad:
        raise ValueError(
            f"{source}: {key} read as the outputs of target layers {layers}: {bad} out of "
            f"range for a target of {num_layers} layers"
        )
    if len(set(layers)) != len(layers):
        raise ValueError(f"{source}: {key}: two ids name one layer ({layers})")
    return tuple(sorted(layers))


def eagle3_config(
    checkpoint: DrafterCheckpoint,
    target: ModelConfig,
    *,
    own_embedding: bool,
    own_lm_head: bool,
    fc_bias: bool,
) -> Eagle3Config:
    """The Eagle3Config of a checkpoint's config.json, in either style.

    Raises:
        ValueError: a head of more than one layer, of another width or vocabulary than the
            target's, without aux hidden states, with an option this loader does not wire
            (`norm_before_fc`, `fc_norm`, `norm_output`, `tie_word_embeddings`), dynamic NTK or
            sliding-window attention; what `capture_layers` and `ModelConfig.from_hf_config`
            refuse.
    """
    values, source = checkpoint.config, str(checkpoint.path)
    if eagle3_style(values) == SPECULATORS_STYLE:
        kind = values.get("speculators_model_type")
        if kind != "eagle3":
            raise ValueError(f"{source}: a speculators {kind!r} model, not an EAGLE-3 head")
        layer_values = dict(values.get("transformer_layer_config") or {})
        # vLLM's reading of a speculators config (its `update_eagle3` default).
        norm_before_residual = bool(values.get("norm_before_residual", True))
    else:
        layer_values = dict(values)
        norm_before_residual = bool(values.get("norm_before_residual", False))
        if layer_values.get("tie_word_embeddings"):
            raise ValueError(
                f"{source}: an EAGLE-3 head with tie_word_embeddings (vLLM reads lm_head, SGLang "
                "the embedding table) is not loaded"
            )
        if (values.get("eagle_config") or {}).get("use_aux_hidden_state") is False:
            raise ValueError(
                f"{source}: an EAGLE-3 head without aux hidden states "
                "(eagle_config.use_aux_hidden_state false) is not loaded"
            )
    refused = [key for key in _REFUSED_OPTIONS if values.get(key)]
    if refused:
        raise ValueError(f"{source}: an EAGLE-3 head with {refused} is not loaded")
    num_layers = layer_values.get("num_hidden_layers", 1)
    if num_layers != 1:
        raise ValueError(f"{source}: an EAGLE-3 head of {num_layers} layers (only 1 is loaded)")
    layer_values.setdefault("vocab_size", target.vocab_size)
    layer = ModelConfig.from_hf_config({**layer_values, "architectures": ["LlamaForCausalLM"]})
    if layer.eager_only_reason is not None:  # the head's decode path has one frequency table
        raise ValueError(f"{source}: an EAGLE-3 head with {layer.eager_only_reason}")
    target_hidden = values.get("target_hidden_size") or layer.hidden_size
    mismatches = [
        f"{name} {mine} vs the target's {theirs}"
        for name, mine, theirs in (
            ("hidden_size", layer.hidden_size, target.hidden_size),
            ("target_hidden_size", target_hidden, target.hidden_size),
            ("vocab_size", layer.vocab_size, target.vocab_size),
        )
        if mine != theirs
    ]
    if mismatches:
        raise ValueError(f"{source}: this EAGLE-3 head does not fit the target: {mismatches}")
    draft_vocab_size = int(values.get("draft_vocab_size") or layer.vocab_size)
    if not 1 <= draft_vocab_size <= layer.vocab_size:
        raise ValueError(f"{source}: draft_vocab_size {draft_vocab_size} out of range")
    return Eagle3Config(
        feature_layers=capture_layers(values, target.num_hidden_layers, source),
        layer=layer,
        draft_vocab_size=draft_vocab_size,
        norm_before_residual=norm_before_residual,
        fc_bias=fc_bias,
        own_embedding=own_embedding,
        own_lm_head=own_lm_head,
    )


def layer_prefix(checkpoint: DrafterCheckpoint) -> str:
    """`midlayer.` or `layers.0.`, whichever names the checkpoint's midlayer tensors.

    Raises:
        CheckpointError: both, or neither."""
    found = [p for p in LAYER_PREFIXES if any(n.startswith(p) for n in checkpoint.names)]
    if len(found) != 1:
        what = "both midlayer.* and layers.0.*" if found else "neither midlayer.* nor layers.0.*"
        raise CheckpointError(f"{checkpoint.path}: an EAGLE-3 head with {what} tensors")
    return found[0]


def draft_to_target_map(
    checkpoint: DrafterCheckpoint, draft_vocab_size: int, vocab_size: int
) -> torch.Tensor | None:
    """[V_draft] int64 target id of each draft id (i + d2t[i]), or None for the full
    vocabulary in order.

    Raises:
        CheckpointError: `d2t` missing for a reduced vocabulary, or mis-shaped, or not a
            one-to-one map into the target vocabulary; `t2d` mis-shaped or not marking exactly
            the target ids of `d2t` (each named)."""
    d2t, t2d = checkpoint.read("d2t"), checkpoint.read("t2d")
    if d2t is None:
        if draft_vocab_size != vocab_size:
            checkpoint.check("d2t", None, (draft_vocab_size,))
        ids = torch.arange(vocab_size)
    else:
        d2t = checkpoint.check("d2t", d2t, (draft_vocab_size,))
        ids = torch.arange(draft_vocab_size) + d2t.to(torch.int64)
        inside = bool(((ids >= 0) & (ids < vocab_size)).all())
        if not inside or ids.unique().numel() != draft_vocab_size:
            raise CheckpointError(
                f"{checkpoint.path}: tensor 'd2t' is not a one-to-one map of the "
                f"{draft_vocab_size} draft ids into the target's {vocab_size} (i + d2t[i])"
            )
    if t2d is not None:
        t2d = checkpoint.check("t2d", t2d, (vocab_size,))
        marked = torch.zeros(vocab_size, dtype=torch.bool)
        marked[ids] = True
        if not torch.equal(t2d.to(torch.bool), marked):
            raise CheckpointError(
                f"{checkpoint.path}: tensor 't2d' does not mark the target ids of 'd2t'"
            )
    if draft_vocab_size == vocab_size and torch.equal(ids, torch.arange(vocab_size)):
        return None
    return ids


def load_eagle3_head(
    checkpoint: DrafterCheckpoint,
    target: LlamaForCausalLM,
    dtype: torch.dtype,
    device: torch.device | str,
) -> tuple[Eagle3Head, torch.Tensor | None]:
    """Loads an EAGLE-3 checkpoint into an `Eagle3Head` wired as the module docstring says.

    Returns:
        (head in eval mode without grads, draft_to_target [V_draft] int64 or None).

    Raises:
        CheckpointError: a missing or mis-shaped tensor, a tensor the format does not define,
            a bad `d2t` / `t2d` (each named by its name in the checkpoint).
        ValueError: as `eagle3_config`.
    """
    names = checkpoint.names
    prefix = layer_prefix(checkpoint)
    config = eagle3_config(
        checkpoint,
        target.config,
        own_embedding=checkpoint.stores_other(
            "embed_tokens.weight", target.model.embed_tokens.weight
        ),
        own_lm_head="lm_head.weight" in names,
        fc_bias="fc.bias" in names,
    )
    vocab_size = target.config.vocab_size
    if not config.own_lm_head and config.draft_vocab_size != vocab_size:
        checkpoint.check("lm_head.weight", None, (config.draft_vocab_size, config.hidden_size))
    with torch.device("meta"):
        head = Eagle3Head(config)
    # Read whether or not it is the head's own: the target's table when equal to it.
    used = {"embed_tokens.weight", "d2t", "t2d"}
    tensors = {}
    for name, param in head.named_parameters():
        stored = prefix + name.removeprefix("layer.") if name.startswith("layer.") else name
        tensors[name] = checkpoint.require(stored, param.shape)
        used.add(stored)
    draft_to_target = draft_to_target_map(checkpoint, config.draft_vocab_size, vocab_size)
    checkpoint.refuse_unused(used, "EAGLE-3")
    assign_weights(head, tensors.get, str(checkpoint.path), dtype, device)
    return head, draft_to_target
