"""The decode/verify step's attention on the CPU, with few PyTorch operations per layer.

Once the weights are quantized, a CPU decode step is bound by per-operation overhead, not by
arithmetic. `DecodePlanCPU` does a step's index work once (RoPE angles, K/V slots, the key
gather and the mask, from a `DecodeMetadata`) and every layer reuses it: RoPE for q and k in one
pass, K/V written with `index_copy_`, attention as one SDPA call over the gathered context (a
view of the cache when it is contiguous). The CPU counterpart of `fused_triton.py`'s RoPE and
attention kernels, with the same twins (`fused.rope_write_kv_ref`,
`fused.paged_decode_attention_ref`; tests compare them). Never allocates cache blocks or draws
randomness.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from specdec.models.attention import DecodeMetadata, cache_slots


@dataclass(frozen=True, slots=True)
class DecodePlanCPU:
    """A decode/verify step's index work, shared by every layer.

    Attributes:
        cos, sin: [T, 1, D] float32 RoPE tables ("rotate half" layout) of the query rows.
        slots: [T_w] int64 cache slots of the rows whose K/V are written.
        write_rows: [T_w] int64 rows written, or None when every row is (slots[i] is row i's).
        gather: [B, S] int64 cache slot of each key position of each sequence (S: the longest
            context; positions past a sequence's context read its position 0, masked).
        span: (first slot, S) when one sequence's context occupies consecutive slots (then the
            keys are a view of the cache, not a gathered copy), else None.
        mask: [B, 1, Q, S] bool (True: the query sees the key), or None when every query sees
            every key (one sequence, one query token).
        live: [B * Q, 1, 1] bool, the query rows of sequences with a context (inert padding
            sequences attend to nothing: their rows are 0), or None when all are.
        num_seqs, query_per_seq: B and Q of the uniform layout.
    """

    cos: torch.Tensor
    sin: torch.Tensor
    slots: torch.Tensor
    write_rows: torch.Tensor | None
    gather: torch.Tensor
    span: tuple[int, int] | None
    mask: torch.Tensor | None
    live: torch.Tensor | None
    num_seqs: int
    query_per_seq: int

    @classmethod
    def build(
        cls,
        meta: DecodeMetadata,
        positions: torch.Tensor,
        inv_freq: torch.Tensor,
        block_size: int,
    ) -> DecodePlanCPU:
        """The plan of one step (host work: the metadata is read into NumPy).

        Args:
            meta: the step's decode metadata (on the CPU).
            positions: [B * Q] int64 position of each query row.
            inv_freq: [D / 2] float32 RoPE inverse frequencies.
            block_size: tokens per cache block.
        """
        num_seqs, per_seq = meta.context_lens.shape[0], meta.query_per_seq
        context = meta.context_lens.numpy().astype(np.int64)  # [B]
        query_lens = meta.query_lens.numpy().astype(np.int64)  # [B]
        slot_mapping = meta.slot_mapping
        keep = slot_mapping.numpy() >= 0
        if keep.all():
            slots, write_rows = slot_mapping, None
        else:
            write_rows = torch.from_numpy(np.flatnonzero(keep))
            slots = slot_mapping[write_rows]
        longest = max(int(context.max()), 1)
        width = -(-longest // block_size)
        tables = meta.block_tables[:, :width].numpy().astype(np.int64).clip(min=0)  # [B, W]
        key_pos = np.arange(longest)
        # Positions past a sequence's context read its position 0 (written, so finite) and are
        # masked: another sequence's blocks are never read.
        own = np.where(key_pos[None] < context[:, None], key_pos[None], 0)  # [B, S]
        gather_np = cache_slots(tables, own, block_size)  # [B, S]
        span = None
        if num_seqs == 1 and (np.diff(gather_np[0]) == 1).all():
            span = (int(gather_np[0, 0]), longest)
        gather = torch.from_numpy(gather_np)
        mask = live = None
        if not (num_seqs == 1 and per_seq == 1 and context[0] > 0):
            query_pos = (context - query_lens)[:, None] + np.arange(per_seq)  # [B, Q]
            visible = (key_pos[None, None] <= query_pos[:, :, None]) & (
                key_pos[None, None] < context[:, None, None]
            )  # [B, Q, S]
            visible[:, :, 0] |= ~visible.any(axis=-1)  # a row that sees nothing sees key 0
            mask = torch.from_numpy(visible[:, None])
            if (context == 0).any():
                live = torch.from_numpy(np.repeat(context > 0, per_seq)).view(-1, 1, 1)
        freqs = positions.to(torch.float32)[:, None] * inv_freq.to(torch.float32)  # [T, D / 2]
        angles = torch.cat((freqs, freqs), dim=-1)[:, None]  # [T, 1, D]
        return cls(
            cos=angles.cos(),
            sin=angles.sin(),
            slots=slots,
            write_rows=write_rows,
            gather=gather,
            span=span,
            mask=mask,
            live=live,
            num_seqs=num_seqs,
            query_per_seq=per_seq,
        )


def rope_write_kv_cpu(
    qkv: torch.Tensor,
    plan: DecodePlanCPU,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
) -> torch.Tensor:
    """`fused.rope_write_kv_ref` with the step's plan: q and k rotated together (in float32,
    the same products as the twin), keys and values written to their slots.

    Args:
        qkv: [T, (H_q + 2 H_kv) * D] fused projections.
        plan: the step's plan.
        k_cache, v_cache: [num_blocks, block_size, H_kv, D] one layer's caches.
        num_heads, num_kv_heads: H_q, H_kv.

    Returns: [T, H_q, D] rotated queries in qkv's dtype.

    Mutates: the `k_cache` / `v_cache` slots of `plan.slots`.
    """
    num_tokens = qkv.shape[0]
    head_dim = k_cache.shape[-1]
    heads = qkv.view(num_tokens, num_heads + 2 * num_kv_heads, head_dim)
    qk = heads[:, : num_heads + num_kv_heads]
    if qk.dtype != torch.float32:
        qk = qk.to(torch.float32)
    half = head_dim // 2
    rotated = qk * plan.cos + torch.cat((-qk[..., half:], qk[..., :half]), dim=-1) * plan.sin
    if rotated.dtype != qkv.dtype:
        rotated = rotated.to(qkv.dtype)
    key, value = rotated[:, num_heads:], heads[:, num_heads + num_kv_heads :]
    if plan.write_rows is not None:
        key, value = key[plan.write_rows], value[plan.write_rows]
    if key.dtype != k_cache.dtype:
        key, value = key.to(k_cache.dtype), value.to(v_cache.dtype)
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, plan.slots, key)
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, plan.slots, value)
    return rotated[:, :num_heads]


def decode_attention_cpu(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: DecodePlanCPU,
    scale: float,
) -> torch.Tensor:
    """`fused.paged_decode_attention_ref` over the gathered contexts, all sequences at once.

    Args:
        query: [B * Q, H_q, D] rotated queries in the plan's uniform layout.
        k_cache, v_cache: [num_blocks, block_size, H_kv, D] one layer's caches (holding the
            step's keys and values).
        plan: the step's plan.
        scale: softmax scale.

    Returns: [B * Q, H_q, D] in query's dtype; rows of inert sequences are 0.
    """
    num_rows, num_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[2]
    flat_k = k_cache.view(-1, num_kv_heads, head_dim)
    flat_v = v_cache.view(-1, num_kv_heads, head_dim)
    if plan.span is not None:  # one sequence in consecutive slots: views, no gather
        start, length = plan.span
        keys = flat_k[start : start + length][None]  # [1, S, H_kv, D]
        values = flat_v[start : start + length][None]
    else:
        index = plan.gather.view(-1)
        shape = (*plan.gather.shape, num_kv_heads, head_dim)
        keys = flat_k.index_select(0, index).view(shape)  # [B, S, H_kv, D]
        values = flat_v.index_select(0, index).view(shape)
    if keys.dtype != query.dtype:
        keys, values = keys.to(query.dtype), values.to(query.dtype)
    batched = query.view(plan.num_seqs, plan.query_per_seq, num_heads, head_dim)
    out = F.scaled_dot_product_attention(
        batched.transpose(1, 2),  # [B, H_q, Q, D]
        keys.transpose(1, 2),  # [B, H_kv, S, D]
        values.transpose(1, 2),
        attn_mask=plan.mask,
        scale=scale,
        enable_gqa=num_heads != num_kv_heads,
    )  # [B, H_q, Q, D]
    out = out.transpose(1, 2).reshape(num_rows, num_heads, head_dim)
    return out if plan.live is None else torch.where(plan.live, out, 0.0)
