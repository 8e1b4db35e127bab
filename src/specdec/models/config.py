"""ModelConfig: the shape and numerics of a Llama-family model, parsed from a HF `config.json`.

Validates what the forward pass in `llama.py` can run and rejects the rest with a clear error.
Families beyond Llama are a few named options (`norm_placement`, `qk_norm_scope`,
`partial_rotary_factor`, `layer_types`, ...), read here from their config.json and nowhere else.
It never reads files or touches tensors (the loaders hand it dictionaries).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from specdec.models.rope import LONGROPE, PlainRope, RopeScaling, parse_rope_scaling

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Phi3ForCausalLM",
    "Olmo2ForCausalLM",
    "Gemma2ForCausalLM",
    "Gemma3ForCausalLM",
    "MixtralForCausalLM",
    "Qwen3MoeForCausalLM",
)
GEMMA_ARCHITECTURES = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
MOE_ARCHITECTURES = ("MixtralForCausalLM", "Qwen3MoeForCausalLM")
# Router settings of other MoE families (DeepSeek's grouped / sigmoid routers and shared
# experts, Qwen2-MoE's shared expert) that the softmax-top-k router here does not implement.
_UNSUPPORTED_MOE_KEYS = (
    "shared_expert_intermediate_size",
    "n_shared_experts",
    "scoring_func",
    "topk_method",
    "n_group",
    "topk_group",
    "routed_scaling_factor",
)
NORM_PLACEMENTS = ("pre", "post", "sandwich")
QK_NORM_SCOPES = ("head", "full")
HIDDEN_ACTS = ("silu", "gelu_pytorch_tanh")
# The families whose config.json `sliding_window` binds every layer (or Gemma's sliding ones).
_WINDOWED_ARCHITECTURES = (
    "MistralForCausalLM",
    "MixtralForCausalLM",
    "Phi3ForCausalLM",
    "Gemma2ForCausalLM",
    "Gemma3ForCausalLM",
)
SLIDING, FULL = "sliding_attention", "full_attention"  # the kinds of `layer_types`
# Gemma 2's soft-capping when its config.json does not name it (Gemma2Config's defaults).
_GEMMA2_SOFTCAPPING = {"attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0}
# Gemma 3's RoPE types on its full-attention layers: those without an attention factor (a
# YaRN-like m would apply to those layers alone, and the attention scale is one per model).
_GEMMA3_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """The architecture hyper-parameters of one Llama-family checkpoint.

    Attributes:
        architecture: the HF class name, one of `SUPPORTED_ARCHITECTURES`.
        vocab_size: rows of the embedding and of the LM head.
        hidden_size: model width D.
        intermediate_size: SwiGLU inner width.
        num_hidden_layers: number of decoder layers.
        num_attention_heads: query heads.
        num_key_value_heads: key/value heads (GQA groups); divides `num_attention_heads`.
        head_dim: per-head width (defaults to hidden_size // num_attention_heads).
        rms_norm_eps: epsilon of every RMSNorm.
        rope_theta: RoPE base.
        rope_scaling: the checkpoint's RoPE scaling (`models/rope.py`), or None for plain RoPE.
        rope_freq_factors: per-frequency divisors of the RoPE inverse frequencies ([head_dim // 2]
            values), as GGUF files store Llama 3.1 scaling (`rope_freqs.weight`); None for none.
        max_position_embeddings: the config's `max_position_embeddings` (for linear, dynamic
            and yarn scaling the declared context is longer: `context_length`).
        tie_word_embeddings: the LM head reuses the embedding matrix.
        attention_bias: q/k/v projections have a bias (Qwen2; Llama's and OLMo 2's
            `attention_bias`).
        attention_out_bias: the output projection has a bias (Llama's and OLMo 2's
            `attention_bias` only).
        mlp_bias: the MLP projections have biases (Llama's `mlp_bias`).
        qk_norm: RMSNorm over q and k before RoPE (Qwen3, OLMo 2).
        qk_norm_scope: what that RMSNorm spans: "head" (each head's head_dim values, Qwen3) or
            "full" (the whole projection, heads x head_dim values, OLMo 2).
        norm_placement: "pre" (x + f(norm(x)), Llama), "post" (x + norm(f(x)) for attention
            and MLP alike, no norm before either: OLMo 2) or "sandwich" (x + norm(f(norm(x))),
            four norms per layer: Gemma 2 and 3).
        norm_weight_in_float32: RMSNorm multiplies by its weight in float32 before casting
            back (OLMo 2), not after (Llama).
        norm_unit_offset: RMSNorm scales by (1 + weight), in float32 before casting back
            (Gemma's zero-centred norm weights), q/k norms included.
        hidden_act: the MLP's gate activation: "silu" (SwiGLU) or "gelu_pytorch_tanh"
            (GeGLU with GELU's tanh approximation: Gemma).
        scale_embeddings: the embeddings are multiplied by sqrt(hidden_size), rounded to the
            activation dtype as `transformers` rounds it (Gemma).
        query_pre_attn_scalar: the softmax scale is query_pre_attn_scalar^-1/2 instead of
            head_dim^-1/2 (Gemma), or None.
        attn_logit_softcapping: attention scores (after the softmax scale, before the mask)
            become cap * tanh(scores / cap) (Gemma 2), or None.
        final_logit_softcapping: logits become cap * tanh(logits / cap) (Gemma 2; Gemma 3
            where config.json sets it), or None.
        partial_rotary_factor: the fraction of each head's dimensions RoPE rotates (Phi-3's
            `partial_rotary_factor`; 1.0: all), see `rotary_dim`.
        sliding_window: attend only to the last `sliding_window` positions (Mistral, Phi-3; with
            `layer_types`, its sliding layers alone), or None.
        layer_types: per layer, "sliding_attention" (attends within `sliding_window`) or
            "full_attention" (Gemma 3's interleaving); empty: every layer alike (windowed when
            `sliding_window` is set).
        local_rope_theta: the RoPE base of the sliding layers, which rotate without
            `rope_scaling` (Gemma 3's `rope_local_base_freq`); None: every layer rotates with
            `rope_theta` and `rope_scaling`.
        bos_token_id: beginning-of-sequence id, or None.
        eos_token_ids: the ids that end generation (a config may list several).
        torch_dtype: the dtype the checkpoint was saved in ("bfloat16", ...), or None.
        num_experts: experts of each sparse MLP (Mixtral's `num_local_experts`, Qwen3-MoE's
            `num_experts`); 0: a dense model.
        num_experts_per_tok: experts each token is routed to (top-k).
        moe_intermediate_size: each expert's inner width (Mixtral: `intermediate_size`).
        norm_topk_prob: the top-k router probabilities are divided by their sum (Mixtral
            always; Qwen3-MoE's `norm_topk_prob`).
        moe_layers: the indices of the layers whose MLP is sparse (Qwen3-MoE's
            `decoder_sparse_step` and `mlp_only_layers`; the others are dense, of
            `intermediate_size`).
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    rope_scaling: RopeScaling | None = None
    rope_freq_factors: tuple[float, ...] | None = None
    attention_bias: bool = False
    attention_out_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    qk_norm_scope: str = "head"
    norm_placement: str = "pre"
    norm_weight_in_float32: bool = False
    norm_unit_offset: bool = False
    hidden_act: str = "silu"
    scale_embeddings: bool = False
    query_pre_attn_scalar: float | None = None
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    partial_rotary_factor: float = 1.0
    sliding_window: int | None = None
    layer_types: tuple[str, ...] = ()
    local_rope_theta: float | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str | None = None
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    moe_layers: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {self.architecture!r}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim % 2 != 0:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.rope_freq_factors is not None and len(self.rope_freq_factors) != self.head_dim // 2:
            raise ValueError(
                f"rope_freq_factors has {len(self.rope_freq_factors)} values, "
                f"expected head_dim // 2 = {self.head_dim // 2}"
            )
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1 or None, got {self.sliding_window}")
        if self.norm_placement not in NORM_PLACEMENTS:
            raise ValueError(f"norm_placement must be one of {NORM_PLACEMENTS}")
        if self.qk_norm_scope not in QK_NORM_SCOPES:
            raise ValueError(f"qk_norm_scope must be one of {QK_NORM_SCOPES}")
        if self.hidden_act not in HIDDEN_ACTS:
            raise ValueError(f"unsupported hidden_act {self.hidden_act!r} (one of {HIDDEN_ACTS})")
        for name in ("attn_logit_softcapping", "final_logit_softcapping"):
            cap = getattr(self, name)
            if cap is not None and not cap > 0:
                raise ValueError(f"{name} must be > 0 or None, got {cap!r}")
        self._check_layer_types()
        self._check_moe()
        rotary_dim = self.rotary_dim
        if not 0 < self.partial_rotary_factor <= 1 or rotary_dim < 2 or rotary_dim % 2:
            raise ValueError(
                f"partial_rotary_factor={self.partial_rotary_factor} rotates {rotary_dim} of "
                f"{self.head_dim} dimensions (must be an even number >= 2)"
            )
        scaling = self.rope_scaling
        if scaling is not None and scaling.rope_type == LONGROPE:
            for name in ("short_factor", "long_factor"):
                if len(getattr(scaling, name)) != rotary_dim // 2:
                    raise ValueError(
                        f"longrope {name} has {len(getattr(scaling, name))} values, expected "
                        f"rotary_dim // 2 = {rotary_dim // 2}"
                    )

    def _check_layer_types(self) -> None:
        if not self.layer_types:
            if self.local_rope_theta is not None:
                raise ValueError("local_rope_theta needs layer_types (which layers are local)")
            return
        if len(self.layer_types) != self.num_hidden_layers:
            # (a model cut to its first layers, such as a `truncated:N` draft, lands here too)
            raise ValueError(
                f"{self.architecture}: layer_types names {len(self.layer_types)} layers, the "
                f"model has {self.num_hidden_layers} (per-layer attention kinds cannot be cut "
                "to fewer layers)"
            )
        unknown = sorted(set(self.layer_types) - {SLIDING, FULL})
        if unknown:
            raise ValueError(f"unsupported layer_types {unknown} (only {SLIDING}, {FULL})")
        if SLIDING in self.layer_types and self.sliding_window is None:
            raise ValueError("layer_types has sliding_attention layers but no sliding_window")

    def _check_moe(self) -> None:
        if not self.moe_layers:
            return
        if not 0 < self.num_experts_per_tok <= self.num_experts or self.moe_intermediate_size < 1:
            raise ValueError(
                f"{self.architecture}: {self.num_experts_per_tok} experts per token of "
                f"{self.num_experts}, expert width {self.moe_intermediate_size}"
            )
        if any(not 0 <= index < self.num_hidden_layers for index in self.moe_layers):
            raise ValueError(
                f"{self.architecture}: sparse layers {list(self.moe_layers)} outside the "
                f"model's {self.num_hidden_layers} layers (a mixture-of-experts model cannot "
                "be cut to fewer layers)"
            )
        if self.norm_placement != "pre":
            raise ValueError("mixture-of-experts layers are pre-norm only")

    @property
    def is_moe(self) -> bool:
        """Whether any layer's MLP is a sparse mixture of experts."""
        return bool(self.moe_layers)

    def layer_window(self, index: int) -> int | None:
        """The attention window of layer `index` (None: it sees its whole context)."""
        if self.layer_types and self.layer_types[index] != SLIDING:
            return None
        return self.sliding_window

    def layer_rotates_locally(self, index: int) -> bool:
        """Whether layer `index` rotates with `local_rope` (a sliding layer of Gemma 3)."""
        return self.local_rope_theta is not None and self.layer_types[index] == SLIDING

    @property
    def local_rope(self) -> PlainRope | None:
        """The RoPE of the sliding layers when it is their own (`local_rope_theta`), else None."""
        if self.local_rope_theta is None:
            return None
        return PlainRope(self.head_dim, self.local_rope_theta, self.rotary_dim)

    @property
    def has_sliding_window(self) -> bool:
        """Whether any layer attends within a window."""
        return any(self.layer_window(i) is not None for i in range(self.num_hidden_layers))

    @property
    def rotary_dim(self) -> int:
        """The dimensions of a head that RoPE rotates: int(head_dim x partial_rotary_factor),
        as `transformers` rounds it."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def context_length(self) -> int:
        """The context the checkpoint declares: `max_position_embeddings`, extended by its
        RoPE scaling as vLLM derives it (`RopeScaling.context_length`)."""
        if self.rope_scaling is None:
            return self.max_position_embeddings
        return self.rope_scaling.context_length(self.max_position_embeddings)

    def device_reason(self, device_type: str) -> str | None:
        """Why no path (eager or decode) can run this model on `device_type` ("cpu",
        "cuda"), or None when one can: every supported model runs on both (CUDA's attention
        kernels, flash prefill, decode and split-KV, have sliding windows and attention logit
        soft-capping, as the CPU's paths do)."""
        del device_type
        return None

    def decode_path_reason(self, device_type: str) -> str | None:
        """Why the fused decode path cannot run this model on `device_type` ("cpu", "cuda"),
        or None when it can. Both take a token's frequencies from its position alone (a table
        per layer, or longrope's short or long one: no dynamic NTK); CUDA's kernels have
        windows, soft-capping and GeGLU (a mixture of experts takes its grouped kernel, unless
        switched off), the CPU's plan (`DecodePlanCPU`) has windows and soft-capping and the
        CPU runs every twin."""
        if self.rope_scaling is not None and self.rope_scaling.is_dynamic:
            return "dynamic NTK rope scaling (frequencies that depend on the position)"
        device_reason = self.device_reason(device_type)
        if device_reason is not None:
            return device_reason
        grouped = os.getenv("SPECDEC_MOE_GROUPED_KERNEL", "1") != "0"  # `moe.GROUPED_KERNEL_ENV`
        if device_type != "cpu" and self.is_moe and not grouped:
            return (
                "mixture-of-experts MLP with the grouped expert kernel switched off "
                "(SPECDEC_MOE_GROUPED_KERNEL=0)"
            )
        return None

    @property
    def eager_only_reason(self) -> str | None:
        """Why the fused decode path cannot run this model on every device (CUDA's reason,
        the stricter), or None when it can: what a caller that does not name the device
        checks (`decode_path_reason` names it)."""
        return self.decode_path_reason("cuda")

    @classmethod
    def from_hf_config(cls, hf_config: dict[str, Any]) -> ModelConfig:
        """Parses a Hugging Face `config.json` dictionary.

        Accepts both spellings of RoPE settings: `rope_theta` + `rope_scaling` (transformers 4)
        and `rope_parameters` (transformers 5).

        Raises:
            ValueError: unsupported architecture (named, with the supported list), activation,
                RoPE type or sliding-window layout; a missing or invalid field.
        """
        architectures = hf_config.get("architectures") or []
        if len(architectures) != 1:
            raise ValueError(
                f"config.json must name exactly one architecture, got {architectures!r}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        architecture = architectures[0]
        # MiMo is Qwen2's layout plus MTP layers (`model.mtp_layers.*`, read by drafters.mtp).
        architecture = {"MiMoForCausalLM": "Qwen2ForCausalLM"}.get(architecture, architecture)
        if architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {architecture!r}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        is_gemma3 = architecture == "Gemma3ForCausalLM"
        is_gemma = architecture in GEMMA_ARCHITECTURES
        if is_gemma:
            _check_gemma(hf_config, architecture)
            hidden_act = hf_config.get("hidden_activation") or "gelu_pytorch_tanh"
            if hidden_act != "gelu_pytorch_tanh":
                raise ValueError(
                    f"{architecture}: unsupported hidden_activation {hidden_act!r} "
                    "(only 'gelu_pytorch_tanh')"
                )
        else:
            hidden_act = hf_config.get("hidden_act", "silu")
            if hidden_act != "silu":
                raise ValueError(f"unsupported hidden_act {hidden_act!r} (only 'silu')")

        def required(name: str) -> Any:
            if hf_config.get(name) is None:
                raise ValueError(f"config.json for {architecture} lacks {name!r}")
            return hf_config[name]

        hidden_size = int(required("hidden_size"))
        num_heads = int(required("num_attention_heads"))
        num_kv_heads = hf_config.get("num_key_value_heads")
        head_dim = hf_config.get("head_dim")
        max_position_embeddings = int(hf_config.get("max_position_embeddings", 2048))
        local_rope_theta = None
        if is_gemma3:
            rope_theta, rope_scaling, local_rope_theta = _parse_gemma3_rope(
                hf_config, max_position_embeddings
            )
            partial_rotary_factor = 1.0
        else:
            rope_theta, rope_scaling, partial_rotary_factor = _parse_rope(
                hf_config, max_position_embeddings, architecture
            )
        is_phi3 = architecture == "Phi3ForCausalLM"
        is_olmo2 = architecture == "Olmo2ForCausalLM"

        is_qwen = architecture.startswith("Qwen")
        if is_qwen and hf_config.get("use_sliding_window"):
            raise ValueError(f"{architecture} with use_sliding_window=true is not supported")
        sliding_window = (
            hf_config.get("sliding_window") if architecture in _WINDOWED_ARCHITECTURES else None
        )
        layer_types = _gemma_layer_types(hf_config, architecture) if is_gemma else ()
        context = (
            max_position_embeddings
            if rope_scaling is None
            else rope_scaling.context_length(max_position_embeddings)
        )
        if is_phi3 and sliding_window is not None and sliding_window >= context:
            sliding_window = None  # a window as long as the context never binds (Phi-3.5's)
        if architecture == "Qwen2ForCausalLM":
            attention_bias, attention_out_bias = True, False
        elif is_phi3:  # transformers' Phi-3 has no biases, whatever config.json says
            attention_bias = attention_out_bias = False
        else:
            attention_bias = attention_out_bias = bool(hf_config.get("attention_bias", False))
        mlp_bias = bool(hf_config.get("mlp_bias", False)) and not (is_phi3 or is_olmo2 or is_gemma)
        # Gemma's configs default to 256 (and tie the embeddings); the others do not.
        query_pre_attn_scalar = hf_config.get("query_pre_attn_scalar", 256) if is_gemma else None
        tie_word_embeddings = bool(hf_config.get("tie_word_embeddings", is_gemma))
        softcapping = {
            name: None if value is None else float(value)
            for name, default in _GEMMA2_SOFTCAPPING.items()
            for value in [hf_config.get(name, default)]
        }
        if is_gemma3:
            # Its final logits are capped where config.json says so (Gemma3TextConfig's
            # default: not), its attention never: `transformers` and vLLM keep
            # `attn_logit_softcapping` out of Gemma 3's attention whatever config.json says.
            final = hf_config.get("final_logit_softcapping")
            softcapping = {"final_logit_softcapping": None if final is None else float(final)}
        elif architecture != "Gemma2ForCausalLM":
            softcapping = {}

        eos = hf_config.get("eos_token_id")
        eos_token_ids = () if eos is None else tuple(eos) if isinstance(eos, list) else (int(eos),)
        return cls(
            architecture=architecture,
            vocab_size=int(required("vocab_size")),
            hidden_size=hidden_size,
            intermediate_size=int(required("intermediate_size")),
            num_hidden_layers=int(required("num_hidden_layers")),
            num_attention_heads=num_heads,
            num_key_value_heads=int(num_kv_heads) if num_kv_heads is not None else num_heads,
            head_dim=int(head_dim) if head_dim is not None else hidden_size // num_heads,
            rms_norm_eps=float(hf_config.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=max_position_embeddings,
            tie_word_embeddings=tie_word_embeddings,
            attention_bias=attention_bias,
            attention_out_bias=attention_out_bias,
            mlp_bias=mlp_bias,
            qk_norm=architecture
            in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Olmo2ForCausalLM", "Gemma3ForCausalLM"),
            qk_norm_scope="full" if is_olmo2 else "head",
            norm_placement="post" if is_olmo2 else "sandwich" if is_gemma else "pre",
            norm_weight_in_float32=is_olmo2,
            norm_unit_offset=is_gemma,
            hidden_act=hidden_act,
            scale_embeddings=is_gemma,
            query_pre_attn_scalar=(
                float(query_pre_attn_scalar) if query_pre_attn_scalar is not None else None
            ),
            partial_rotary_factor=partial_rotary_factor,
            sliding_window=int(sliding_window) if sliding_window is not None else None,
            layer_types=layer_types,
            local_rope_theta=local_rope_theta,
            bos_token_id=hf_config.get("bos_token_id"),
            eos_token_ids=eos_token_ids,
            torch_dtype=hf_config.get("torch_dtype") or hf_config.get("dtype"),
            **softcapping,
            **_parse_moe(hf_config, architecture),
        )


def _parse_moe(hf_config: dict[str, Any], architecture: str) -> dict[str, Any]:
    """The MoE fields of a Mixtral / Qwen3-MoE config.json (empty for a dense family);
    router variants and shared experts are refused by name."""
    if architecture not in MOE_ARCHITECTURES:
        return {}
    for key in _UNSUPPORTED_MOE_KEYS:
        if hf_config.get(key):
            raise ValueError(
                f"{architecture} with {key}={hf_config[key]!r} is not supported (only the "
                "softmax top-k router without shared experts)"
            )
    num_layers = int(hf_config.get("num_hidden_layers") or 0)
    # transformers 5 saves Qwen3-MoE's `num_experts` as `num_local_experts`.
    num_experts = int(hf_config.get("num_local_experts") or hf_config.get("num_experts") or 0)
    if architecture == "MixtralForCausalLM":
        return {
            "num_experts": num_experts,
            "num_experts_per_tok": int(hf_config.get("num_experts_per_tok", 2)),
            "moe_intermediate_size": int(hf_config.get("intermediate_size") or 0),
            "norm_topk_prob": True,
            "moe_layers": tuple(range(num_layers)),
        }
    dense = set(hf_config.get("mlp_only_layers") or ())
    step = int(hf_config.get("decoder_sparse_step") or 1)
    sparse = tuple(
        index
        for index in range(num_layers)
        if index not in dense and num_experts > 0 and (index + 1) % step == 0
    )
    return {
        "num_experts": num_experts,
        "num_experts_per_tok": int(hf_config.get("num_experts_per_tok", 8)),
        "moe_intermediate_size": int(hf_config.get("moe_intermediate_size") or 0),
        "norm_topk_prob": bool(hf_config.get("norm_topk_prob", False)),
        "moe_layers": sparse,
    }


def _parse_rope(
    hf_config: dict[str, Any], max_position_embeddings: int, architecture: str
) -> tuple[float, RopeScaling | None, float]:
    """Returns (rope_theta, rope_scaling, partial_rotary_factor) from either spelling of the
    RoPE settings."""
    params = hf_config.get("rope_parameters")
    if isinstance(params, dict) and params:
        scaling: dict[str, Any] | None = params
        theta = params.get("rope_theta", hf_config.get("rope_theta", 10000.0))
    else:
        scaling = hf_config.get("rope_scaling")
        theta = hf_config.get("rope_theta", 10000.0)
    partial_rotary_factor = 1.0
    is_phi3 = architecture == "Phi3ForCausalLM"
    if is_phi3:
        # As transformers' Phi3Config reads them: partial rotary inside the RoPE settings or
        # beside them; "su" and "yarn" are older names of its longrope.
        scaling = dict(scaling or {})
        partial = scaling.pop("partial_rotary_factor", hf_config.get("partial_rotary_factor"))
        partial_rotary_factor = 1.0 if partial is None else float(partial)
        if scaling.get("rope_type", scaling.get("type")) in ("su", "yarn"):
            scaling["rope_type"] = LONGROPE
    if not scaling:
        return float(theta), None, partial_rotary_factor
    rope_type = scaling.get("rope_type", scaling.get("type"))
    original_at_top = "original_max_position_embeddings" in hf_config
    if rope_type in ("llama3", "yarn", LONGROPE) and original_at_top:
        # A top-level value wins, as `transformers` reads it (Phi-3's spelling).
        original = hf_config["original_max_position_embeddings"]
        scaling = {**scaling, "original_max_position_embeddings": original}
    rope_scaling = parse_rope_scaling(scaling, max_position_embeddings, longrope=is_phi3)
    return float(theta), rope_scaling, partial_rotary_factor


def _check_gemma(hf_config: dict[str, Any], architecture: str) -> None:
    """Refuses, by name, what a Gemma config.json may ask for that the forward pass lacks
    (the bidirectional attention of the embedding models)."""
    if hf_config.get("use_bidirectional_attention"):
        raise ValueError(f"{architecture} with use_bidirectional_attention is not supported")


def _gemma_layer_types(hf_config: dict[str, Any], architecture: str) -> tuple[str, ...]:
    """Each layer's attention kind: config.json's `layer_types`, else every
    `sliding_window_pattern`-th layer full and the others sliding (transformers' rule;
    pattern 6 when unset on Gemma 3, 2 on Gemma 2: sliding and full alternate)."""
    num_layers = int(hf_config.get("num_hidden_layers") or 0)
    layer_types = hf_config.get("layer_types")
    if layer_types is not None:
        return tuple(str(kind) for kind in layer_types)
    pattern = hf_config.get("sliding_window_pattern") or hf_config.get("_sliding_window_pattern")
    pattern = int(pattern or (6 if architecture == "Gemma3ForCausalLM" else 2))
    return tuple(FULL if (i + 1) % pattern == 0 else SLIDING for i in range(num_layers))


def _parse_gemma3_rope(
    hf_config: dict[str, Any], max_position_embeddings: int
) -> tuple[float, RopeScaling | None, float]:
    """Gemma 3's RoPE as (rope_theta, rope_scaling, local_rope_theta): the full-attention
    layers' base and scaling, and the sliding layers' base (they rotate unscaled), from either
    spelling: `rope_parameters` per layer kind (transformers 5), or `rope_theta`,
    `rope_scaling` and `rope_local_base_freq` (transformers 4; the scaling is the full
    layers')."""
    params = hf_config.get("rope_parameters")
    if isinstance(params, dict) and (FULL in params or SLIDING in params):
        full = dict(params.get(FULL) or {})
        local = dict(params.get(SLIDING) or {})
    else:
        full = dict(hf_config.get("rope_scaling") or {})
        full.setdefault("rope_theta", hf_config.get("rope_theta", 1_000_000.0))
        local = {"rope_theta": hf_config.get("rope_local_base_freq", 10_000.0)}
    for kind, values in ((FULL, full), (SLIDING, local)):
        rope_type = values.get("rope_type", values.get("type", "default"))
        allowed = _GEMMA3_ROPE_TYPES if kind == FULL else ("default",)
        if rope_type not in allowed:
            raise ValueError(
                f"Gemma3ForCausalLM: rope type {rope_type!r} on {kind} layers is not "
                f"supported (only {', '.join(allowed)})"
            )
    theta = float(full.get("rope_theta", 1_000_000.0))
    local_theta = float(local.get("rope_theta", 10_000.0))
    return theta, parse_rope_scaling(full, max_position_embeddings), local_theta
