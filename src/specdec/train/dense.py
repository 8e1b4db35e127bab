"""Dense (unpaged, batched [B, N, ..]) forward passes of Llama decoder layers for training, with
the same parameters and numerics as the paged inference path in `specdec.models.llama`."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specdec.models.decoder_layers import LlamaDecoderLayer
from specdec.models.rope import apply_rotary


def project_qkv(layer: LlamaDecoderLayer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """[B, N, D] layer input -> (q [B, H_q, N, d], k [B, H_kv, N, d], v [B, H_kv, N, d]) after the
    input norm, the projections and RoPE. cos, sin: [N, d] float32 of the rows' positions."""
    attn = layer.self_attn
    size, length, _ = x.shape
    h = layer.input_layernorm(x)
    q = attn.q_proj(h).view(size * length, attn.num_heads, attn.head_dim)
    k = attn.k_proj(h).view(size * length, attn.num_kv_heads, attn.head_dim)
    v = attn.v_proj(h).view(size, length, attn.num_kv_heads, attn.head_dim)
    if attn.q_norm is not None and attn.k_norm is not None:
        q, k = attn.q_norm(q), attn.k_norm(k)
    cos_rows, sin_rows = cos.repeat(size, 1), sin.repeat(size, 1)  # [B * N, d]
    q = apply_rotary(q, cos_rows, sin_rows).view(size, length, attn.num_heads, attn.head_dim)
    k = apply_rotary(k, cos_rows, sin_rows).view(size, length, attn.num_kv_heads, attn.head_dim)
    return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)


def finish_layer(layer: LlamaDecoderLayer, x: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
    """x [B, N, D] + o_proj(attended [B, H_q, N, d]), then the MLP block."""
    size, heads, length, dim = attended.shape
    x = x + layer.self_attn.o_proj(attended.transpose(1, 2).reshape(size, length, heads * dim))
    return x + layer.mlp(layer.post_attention_layernorm(x))


def causal_layer(
    layer: LlamaDecoderLayer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """One causal decoder layer over [B, N, D].

    Returns: (output [B, N, D], (k, v) each [B, H_kv, N, d]).
    """
    q, k, v = project_qkv(layer, x, cos, sin)
    out = F.scaled_dot_product_attention(
        q, k, v, is_causal=True, scale=layer.self_attn.scale, enable_gqa=True
    )
    return finish_layer(layer, x, out), (k, v)


def chain_layer(
    layer: LlamaDecoderLayer,
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    prefix: tuple[torch.Tensor, torch.Tensor],
    chain: list[tuple[torch.Tensor, torch.Tensor]],
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """A decoder layer for draft step j >= 2 of every entry at once (training-time test).

    Row t attends to the prefix keys of entries 0..t (the first step's, computed from target
    features) and to its own keys of steps 2..j (`chain`, then itself): what the head's paged
    cache holds when it drafts the j-th token from entry t.

    Args:
        x: [B, N, D] step-j inputs.
        cos, sin: [N, d] RoPE of the step-j positions.
        prefix: (k, v) [B, H_kv, N, d] of the first step.
        chain: (k, v) of the steps 2..j-1, each [B, H_kv, N, d].

    Returns:
        (output [B, N, D], this step's (k, v)).
    """
    q, k, v = project_qkv(layer, x, cos, sin)
    group = q.shape[1] // k.shape[1]
    scale = layer.self_attn.scale

    def widen(t: torch.Tensor) -> torch.Tensor:
        return t.repeat_interleave(group, dim=1)  # [B, H_q, N, d]

    length = x.shape[1]
    prefix_k, prefix_v = widen(prefix[0]), widen(prefix[1])
    scores = q @ prefix_k.transpose(-1, -2) * scale  # [B, H_q, N, N]
    causal = torch.ones(length, length, dtype=torch.bool, device=x.device).tril()
    scores = scores.masked_fill(~causal, float("-inf"))
    own = [*chain, (k, v)]
    diag = [(q * widen(ck)).sum(-1, keepdim=True) * scale for ck, _ in own]  # [B, H_q, N, 1]
    probs = torch.cat([scores, *diag], dim=-1).softmax(dim=-1)
    out = probs[..., :length] @ prefix_v
    for i, (_, cv) in enumerate(own):
        out = out + probs[..., length + i : length + i + 1] * widen(cv)
    return finish_layer(layer, x, out), (k, v)
