"""The Llama family's decoder layers: GQA attention with RoPE (`LlamaAttention`), the gated MLP
(`LlamaMLP`), and the three norm placements around them (`LlamaDecoderLayer`: before each
sublayer; `PostNormDecoderLayer`: after, OLMo 2; `SandwichNormDecoderLayer`: both, Gemma),
each with the eager `forward` and the fused `forward_decode` of every CUDA step and the CPU plan.
`llama.LlamaModel` stacks them (`DECODER_LAYERS` by `ModelConfig.norm_placement`).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from specdec.models.attention import (
    AttentionPlan,
    DecodeMetadata,
    paged_attention,
    write_kv_planned,
)
from specdec.models.config import ModelConfig
from specdec.models.decode_cpu import DecodePlanCPU, decode_attention_cpu, rope_write_kv_cpu
from specdec.models.fused import (
    add_rms_norm,
    gelu_tanh_mul,
    paged_decode_attention,
    qk_norm,
    rope_write_kv,
    silu_mul,
)
from specdec.models.layers import Linear, RMSNorm, fuse_linears, set_fused
from specdec.models.moe import SparseMoeBlock
from specdec.models.rms_norm import rms_norm_values
from specdec.models.rope import apply_rotary, attention_scale
from specdec.models.tensor_parallel import Collectives, ShardLayout


def rms_norm(config: ModelConfig, dim: int | None = None) -> RMSNorm:
    """An RMSNorm over `dim` values (None: hidden_size) with the family's numerics."""
    dim = config.hidden_size if dim is None else dim
    return RMSNorm(dim, config.rms_norm_eps, config.norm_weight_in_float32, config.norm_unit_offset)


class LlamaAttention(nn.Module):
    """GQA self-attention with RoPE (and q/k RMSNorm: Qwen3's per head, OLMo 2's over the whole
    projection; Gemma 2's soft-capped scores) over the paged cache."""

    def __init__(self, config: ModelConfig, shard: ShardLayout | None = None) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads if shard is None else shard.num_q_heads
        self.num_kv_heads = config.num_key_value_heads if shard is None else shard.num_kv_heads
        self.tp: Collectives | None = None  # the o_proj all-reduce under tensor parallelism
        self.head_dim = config.head_dim
        # 1 / sqrt(head_dim) (Gemma 3: 1 / sqrt(query_pre_attn_scalar)), times YaRN's m^2
        self.scale = attention_scale(config, config.query_pre_attn_scalar)
        self.softcap = config.attn_logit_softcapping  # scores -> cap * tanh(scores / cap)
        # This layer's window (`ModelConfig.layer_window`; the model that stacks the layers
        # sets each one's): the fused path's kernels take it per layer (the eager path's
        # plans carry it).
        self.sliding_window = None if config.layer_types else config.sliding_window
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.q_proj = Linear(config.hidden_size, q_size, config.attention_bias)
        self.k_proj = Linear(config.hidden_size, kv_size, config.attention_bias)
        self.v_proj = Linear(config.hidden_size, kv_size, config.attention_bias)
        self.o_proj = Linear(q_size, config.hidden_size, config.attention_out_bias)
        self.qk_norm_per_head = config.qk_norm_scope == "head"
        # OLMo 2's q/k norms span every head: under tensor parallelism each rank normalises
        # its heads' slice by the mean square over all ranks (`_norm_across_ranks`); a KV head
        # held by several ranks counts once.
        self.qk_sizes = (
            config.num_attention_heads * self.head_dim,
            config.num_key_value_heads * self.head_dim,
        )
        world, kv_heads = (1 if shard is None else shard.world_size), config.num_key_value_heads
        self.kv_replicas = max(1, world // kv_heads)
        if config.qk_norm:
            per_head = self.qk_norm_per_head
            self.q_norm = rms_norm(config, self.head_dim if per_head else q_size)
            self.k_norm = rms_norm(config, self.head_dim if per_head else kv_size)
        else:
            self.q_norm = self.k_norm = None
        # One [(H_q + 2 H_kv) D, hidden] projection: float weights shared with q/k/v_proj
        # (`fuse`), or the only copy of quantized ones (set by the loader).
        self.qkv_proj: Linear | None = None

    def fuse(self) -> None:
        """One [(H_q + 2 H_kv) D, hidden] projection for the decode path (weights shared);
        quantized parts are fused at load, or stay apart when their formats differ."""
        parts = [self.q_proj, self.k_proj, self.v_proj]
        if self.qkv_proj is None and all(part.quantized is None for part in parts):
            set_fused(self, "qkv_proj", fuse_linears(parts))

    def norm_qk(self, query: torch.Tensor, key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[T, H_q D] queries and [T, H_kv D] keys through the q/k RMSNorms (over each head, or
        over the whole projection), or as they are without them."""
        if self.q_norm is None or self.k_norm is None:
            return query, key
        if self.qk_norm_per_head:
            heads = (-1, self.head_dim)
            query = self.q_norm(query.unflatten(-1, heads)).flatten(-2)
            return query, self.k_norm(key.unflatten(-1, heads)).flatten(-2)
        if self.tp is not None:
            return self._norm_across_ranks(query, key)
        return self.q_norm(query), self.k_norm(key)

    def _norm_across_ranks(
        self, query: torch.Tensor, key: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole-projection q/k RMSNorms of a rank's slices: each slice's sum of squares
        (a replicated KV head's share divided by its replicas), summed over the ranks by one
        all-reduce, over the whole projection's size is the mean square every rank divides by.
        """
        sums = torch.cat(
            [
                query.float().pow(2).sum(-1, keepdim=True),
                key.float().pow(2).sum(-1, keepdim=True) / self.kv_replicas,
            ],
            dim=-1,
        )  # [T, 2]
        sums = self.tp.all_reduce(sums)
        (q_size, kv_size), q_norm, k_norm = self.qk_sizes, self.q_norm, self.k_norm
        q_mean, kv_mean = sums[:, :1] / q_size, sums[:, 1:] / kv_size
        query = rms_norm_values(query, q_norm.weight, q_norm.eps, q_norm.numerics, q_mean)
        return query, rms_norm_values(key, k_norm.weight, k_norm.eps, k_norm.numerics, kv_mean)

    def project_qkv(self, hidden: torch.Tensor) -> torch.Tensor:
        """[T, hidden] -> [T, (H_q + 2 H_kv) D]: q, k and v side by side (decode products)."""
        if self.qkv_proj is not None:
            return self.qkv_proj.decode(hidden)
        parts = (self.q_proj, self.k_proj, self.v_proj)
        return torch.cat([part.decode(hidden) for part in parts], -1)

    def forward_decode(
        self,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        inv_freq: torch.Tensor,
        meta: DecodeMetadata | None,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        plan: DecodePlanCPU | None = None,
        flash: AttentionPlan | None = None,
    ) -> torch.Tensor:
        """`forward` for a decode/verify step through the fused kernels: [T, D] -> [T, D].
        With a `plan` (the CPU step of a quantized model, shared by its layers) RoPE and
        attention run as it plans; with `flash` (a CUDA step of prefill chunks and any other
        rows) RoPE and the K/V write through `fused.py` and attention through the prefill
        kernel; otherwise through `fused.py` (Triton on CUDA, the twins on the CPU). The
        kernels apply this layer's `sliding_window` and `softcap`.

        Mutates: writes the live query tokens' K/V into `k_cache`/`v_cache`.
        """
        num_tokens = hidden.shape[0]
        qkv = self.project_qkv(hidden)
        if self.q_norm is not None and self.qk_norm_per_head:  # one kernel on CUDA
            q_norm, k_norm = self.q_norm, self.k_norm
            qkv = qk_norm(
                qkv,
                q_norm.weight,
                k_norm.weight,
                q_norm.eps,
                q_norm.numerics,
                self.num_heads,
                self.num_kv_heads,
            )
        elif self.q_norm is not None:
            q_size = self.num_heads * self.head_dim
            kv_size = self.num_kv_heads * self.head_dim
            query, key, value = qkv.split([q_size, kv_size, kv_size], dim=-1)
            query, key = self.norm_qk(query, key)
            qkv = torch.cat([query, key, value], dim=-1)
        if plan is not None:  # the CPU step of a quantized model
            query = rope_write_kv_cpu(
                qkv, plan, k_cache, v_cache, self.num_heads, self.num_kv_heads
            )
            out = decode_attention_cpu(query, k_cache, v_cache, plan, self.scale, self.softcap)
            return self._reduce(
                self.o_proj.decode(out.reshape(num_tokens, self.num_heads * self.head_dim))
            )
        query = rope_write_kv(
            qkv,
            positions,
            inv_freq,
            k_cache,
            v_cache,
            meta.slot_mapping if flash is None else flash.slot_mapping,
            self.num_heads,
            self.num_kv_heads,
        )  # [T, H_q, D_head]
        if flash is not None:
            if flash.sliding_window != self.sliding_window:  # the step's plan, this layer's window
                flash = dataclasses.replace(flash, sliding_window=self.sliding_window)
            out = paged_attention(
                query, k_cache, v_cache, flash, scale=self.scale, softcap=self.softcap
            )
        else:
            out = paged_decode_attention(
                query,
                k_cache,
                v_cache,
                meta,
                self.scale,
                sliding_window=self.sliding_window,
                softcap=self.softcap,
                positions=positions,  # a tree step's windows count from its nodes' depths
            )
        return self._reduce(
            self.o_proj.decode(out.reshape(num_tokens, self.num_heads * self.head_dim))
        )

    def _reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """The row-parallel o_proj's partial products summed over the ranks (as is at TP 1)."""
        return partial if self.tp is None else self.tp.all_reduce(partial)

    def forward(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        plan: AttentionPlan,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
    ) -> torch.Tensor:
        """[T, D] -> [T, D]. Mutates: writes the new tokens' K/V into `k_cache`/`v_cache`."""
        num_tokens = hidden.shape[0]
        if self.qkv_proj is not None and self.qkv_proj.quantized is not None:
            q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
            query, key, value = self.qkv_proj(hidden).split([q_size, kv_size, kv_size], dim=-1)
        else:  # float weights: the separate products, as `transformers` computes them
            query, key, value = self.q_proj(hidden), self.k_proj(hidden), self.v_proj(hidden)
        query, key = self.norm_qk(query, key)
        query = query.reshape(num_tokens, self.num_heads, self.head_dim)
        key = key.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        value = value.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        query, key = apply_rotary(query, cos, sin), apply_rotary(key, cos, sin)
        write_kv_planned(key, value, k_cache, v_cache, plan)
        out = paged_attention(query, k_cache, v_cache, plan, scale=self.scale, softcap=self.softcap)
        # [T, H_q, D_head]
        return self._reduce(self.o_proj(out.reshape(num_tokens, self.num_heads * self.head_dim)))


class LlamaMLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)); GeGLU (Gemma): down(gelu_tanh(gate(x)) * up(x))."""

    def __init__(self, config: ModelConfig, shard: ShardLayout | None = None) -> None:
        super().__init__()
        size = config.intermediate_size if shard is None else shard.intermediate_size
        self.gate_proj = Linear(config.hidden_size, size, config.mlp_bias)
        self.up_proj = Linear(config.hidden_size, size, config.mlp_bias)
        self.down_proj = Linear(size, config.hidden_size, config.mlp_bias)
        self.tp: Collectives | None = None  # the down_proj all-reduce under tensor parallelism
        self.gelu = config.hidden_act == "gelu_pytorch_tanh"
        # One [2 F, hidden] gate/up projection (as `LlamaAttention.qkv_proj`).
        self.gate_up_proj: Linear | None = None

    def fuse(self) -> None:
        """One [2 F, hidden] gate/up projection for the decode path (weights shared)."""
        parts = [self.gate_proj, self.up_proj]
        if self.gate_up_proj is None and all(part.quantized is None for part in parts):
            set_fused(self, "gate_up_proj", fuse_linears(parts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_proj is not None and self.gate_up_proj.quantized is not None:
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        gated = (F.gelu(gate, approximate="tanh") if self.gelu else F.silu(gate)) * up
        return self._reduce(self.down_proj(gated))

    def _reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """The row-parallel down_proj's partial products summed over the ranks."""
        return partial if self.tp is None else self.tp.all_reduce(partial)

    def forward_decode(self, x: torch.Tensor) -> torch.Tensor:
        """`forward` through one gate/up GEMM and the fused silu * up kernel (GeGLU: the
        gelu_tanh * up kernel; the twins on the CPU)."""
        if self.gate_up_proj is not None:
            gate_up = self.gate_up_proj.decode(x)
        else:
            gate_up = torch.cat([self.gate_proj.decode(x), self.up_proj.decode(x)], dim=-1)
        gated = gelu_tanh_mul(gate_up) if self.gelu else silu_mul(gate_up)
        return self._reduce(self.down_proj.decode(gated))


def add_norm(
    out: torch.Tensor, residual: torch.Tensor | None, norm: RMSNorm
) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(out + residual), out + residual), [T, D] each (residual None: out alone), through
    the fused kernel (with the norm's numerics)."""
    return add_rms_norm(out, residual, norm.weight, norm.eps, norm.numerics)


def normed(x: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
    """norm(x) for [T, D] rows, through the fused kernel (one launch on CUDA)."""
    return add_rms_norm(x, None, norm.weight, norm.eps, norm.numerics)[0]


class LlamaDecoderLayer(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then x + mlp(norm(x)) (`post_attention_layernorm`
    is the norm before the MLP); with `sparse` the MLP is a mixture of experts (Mixtral,
    Qwen3-MoE: `SparseMoeBlock`)."""

    def __init__(
        self, config: ModelConfig, shard: ShardLayout | None = None, sparse: bool = False
    ) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, shard)
        self.mlp: LlamaMLP | SparseMoeBlock = (
            SparseMoeBlock(
                config.hidden_size,
                config.moe_intermediate_size if shard is None else shard.expert_intermediate_size,
                config.num_experts,
                config.num_experts_per_tok,
                config.norm_topk_prob,
            )
            if sparse
            else LlamaMLP(config, shard)
        )
        self.input_layernorm = rms_norm(config)
        self.post_attention_layernorm = rms_norm(config)

    def forward(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        plan: AttentionPlan,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
    ) -> torch.Tensor:
        hidden = hidden + self.self_attn(
            self.input_layernorm(hidden), cos, sin, plan, k_cache, v_cache
        )
        return hidden + self.mlp(self.post_attention_layernorm(hidden))

    def forward_decode(
        self,
        out: torch.Tensor,
        residual: torch.Tensor | None,
        positions: torch.Tensor,
        inv_freq: torch.Tensor,
        meta: DecodeMetadata | None,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        plan: DecodePlanCPU | None,
        flash: AttentionPlan | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward` through the fused kernels (see `LlamaAttention.forward_decode`) on the
        residual stream carried as (out, residual), [T, D] each, whose sum it is (residual
        None: out alone); each add is fused into the norm after it. Returns the next pair.

        Mutates: writes the live query tokens' K/V into `k_cache`/`v_cache`."""
        normed, residual = add_norm(out, residual, self.input_layernorm)
        out = self.self_attn.forward_decode(
            normed, positions, inv_freq, meta, k_cache, v_cache, plan, flash
        )
        normed, residual = add_norm(out, residual, self.post_attention_layernorm)
        return self.mlp.forward_decode(normed), residual


class PostNormDecoderLayer(nn.Module):
    """OLMo 2's block: x + norm(attn(x)), then x + norm(mlp(x)); no norm before either
    (`post_attention_layernorm` after attention, `post_feedforward_layernorm` after the MLP)."""

    def __init__(self, config: ModelConfig, shard: ShardLayout | None = None) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, shard)
        self.mlp = LlamaMLP(config, shard)
        self.post_attention_layernorm = rms_norm(config)
        self.post_feedforward_layernorm = rms_norm(config)

    def forward(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        plan: AttentionPlan,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
    ) -> torch.Tensor:
        attended = self.self_attn(hidden, cos, sin, plan, k_cache, v_cache)
        hidden = hidden + self.post_attention_layernorm(attended)
        return hidden + self.post_feedforward_layernorm(self.mlp(hidden))

    def forward_decode(
        self,
        out: torch.Tensor,
        residual: torch.Tensor | None,
        positions: torch.Tensor,
        inv_freq: torch.Tensor,
        meta: DecodeMetadata | None,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        plan: DecodePlanCPU | None,
        flash: AttentionPlan | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`LlamaDecoderLayer.forward_decode` for this block: the same (out, residual) pair in
        and out (the MLP's normed output and the stream before it).

        Mutates: writes the live query tokens' K/V into `k_cache`/`v_cache`."""
        hidden = out if residual is None else out + residual
        attended = self.self_attn.forward_decode(
            hidden, positions, inv_freq, meta, k_cache, v_cache, plan, flash
        )
        hidden = hidden + self.post_attention_layernorm(attended)
        return self.post_feedforward_layernorm(self.mlp.forward_decode(hidden)), hidden


class SandwichNormDecoderLayer(nn.Module):
    """Gemma 2's and 3's block: x + norm(attn(norm(x))), then x + norm(mlp(norm(x))) (four norms:
    `input_layernorm` and `post_attention_layernorm` around attention,
    `pre_feedforward_layernorm` and `post_feedforward_layernorm` around the MLP)."""

    def __init__(self, config: ModelConfig, shard: ShardLayout | None = None) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, shard)
        self.mlp = LlamaMLP(config, shard)
        self.input_layernorm = rms_norm(config)
        self.post_attention_layernorm = rms_norm(config)
        self.pre_feedforward_layernorm = rms_norm(config)
        self.post_feedforward_layernorm = rms_norm(config)

    def forward(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        plan: AttentionPlan,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
    ) -> torch.Tensor:
        attended = self.self_attn(self.input_layernorm(hidden), cos, sin, plan, k_cache, v_cache)
        hidden = hidden + self.post_attention_layernorm(attended)
        fed = self.mlp(self.pre_feedforward_layernorm(hidden))
        return hidden + self.post_feedforward_layernorm(fed)

    def forward_decode(
        self,
        out: torch.Tensor,
        residual: torch.Tensor | None,
        positions: torch.Tensor,
        inv_freq: torch.Tensor,
        meta: DecodeMetadata | None,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        plan: DecodePlanCPU | None,
        flash: AttentionPlan | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`LlamaDecoderLayer.forward_decode` for this block: the same (out, residual) pair in
        and out (the MLP's normed output and the stream before it).

        Mutates: writes the live query tokens' K/V into `k_cache`/`v_cache`."""
        # Each add fused into the norm after it, each norm one kernel on CUDA (s28: the four
        # norms in PyTorch ops were ~30 launches a layer, 1.56x Llama-3-8B's TPOT per byte).
        normed_in, hidden = add_norm(out, residual, self.input_layernorm)
        attended = self.self_attn.forward_decode(
            normed_in, positions, inv_freq, meta, k_cache, v_cache, plan, flash
        )
        post = normed(attended, self.post_attention_layernorm)
        fed, hidden = add_norm(post, hidden, self.pre_feedforward_layernorm)
        out = self.mlp.forward_decode(fed)
        return normed(out, self.post_feedforward_layernorm), hidden


DECODER_LAYERS = {
    "pre": LlamaDecoderLayer,
    "post": PostNormDecoderLayer,
    "sandwich": SandwichNormDecoderLayer,
}
