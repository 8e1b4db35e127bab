"""The decode/verify step's attention on the CPU, with few PyTorch operations per layer.

Once the weights are quantized, a CPU decode step is bound by per-operation overhead, not by
arithmetic. `DecodePlanCPU` does a step's index work once (RoPE angles, K/V slots, each
sequence's keys as a view of the cache or a slot list, from a `DecodeMetadata`) and every layer
reuses it: RoPE for q and k in one pass, K/V written with `index_copy_`, attention of each query
row over exactly its keys (its window's, in a sliding-window layer: so rows do not depend on the
step's shape), the whole step in one `cpu_extension.row_attention` call where it is built, else
one SDPA call per row (two kernels of other bits, each the same for every row;
`attention.softcap_attention` for Gemma 2's capped scores). Layers of another RoPE table or
window (Gemma 3's sliding and full layers) share the step's index work through `for_layers`.
The CPU counterpart of `fused_triton.py`'s RoPE and attention kernels, with the same twins
(`fused.rope_write_kv_ref`, `fused.paged_decode_attention_ref`; tests compare them).
Never allocates cache blocks or draws randomness.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from specdec.models import cpu_extension
from specdec.models.attention import (
    AttentionMetadata,
    DecodeMetadata,
    cache_slots,
    softcap_attention,
)


@dataclass(frozen=True, slots=True)
class DecodePlanCPU:
    """A decode/verify step's index work, shared by every layer.

    Attention is planned row by row: each live query row attends over exactly its own keys
    (positions 0 .. its position p, or p - sliding_window + 1 .. p in a layer with a window)
    with no mask, the very call a plain decode step makes for
    the same token, so a verify row equals the decode row and a request's rows do not depend
    on the rest of the batch (greedy speculative decoding emits what greedy plain decoding
    emits, within a quantized format whose kernels round to bfloat16).

    Attributes:
        cos: [T, 1, D] float32 RoPE cosines ("rotate half" layout) of the query rows.
        sin: [T, 1, D] float32 sines with the first half negated, and `half_swap` the [D]
            int64 index that swaps the halves: x * cos + x[half_swap] * sin is the rotation
            (each product as the twin computes it).
        slots: [T_w] int64 cache slots of the rows whose K/V are written.
        write_rows: [T_w] int64 rows written, or None when every row is (slots[i] is row i's).
        sequences: per sequence with a context, (first row, its rows' key counts, and either
            the first cache slot of its consecutive context (an int: keys are a view) or the
            [context] int64 slots to gather).
        all_live: every row is a live query row (no padding rows to zero).
        sliding_window: a query at position p sees the keys at positions > p - sliding_window
            (None: all up to p).
    """

    cos: torch.Tensor
    sin: torch.Tensor
    half_swap: torch.Tensor
    slots: torch.Tensor
    write_rows: torch.Tensor | None
    sequences: list[tuple[int, list[int], int | torch.Tensor]]
    all_live: bool
    sliding_window: int | None = None

    @classmethod
    def build(
        cls,
        meta: DecodeMetadata,
        positions: torch.Tensor,
        inv_freq: torch.Tensor,
        block_size: int,
    ) -> DecodePlanCPU:
        """The plan of one decode/verify step (host work: the metadata is read into NumPy).

        Args:
            meta: the step's decode metadata (on the CPU).
            positions: [B * Q] int64 position of each query row.
            inv_freq: [D / 2] float32 RoPE inverse frequencies.
            block_size: tokens per cache block.
        """
        per_seq = meta.query_per_seq
        query_lens = meta.query_lens.numpy().astype(np.int64)  # [B]
        first_rows = np.arange(len(query_lens), dtype=np.int64) * per_seq
        return cls._build(
            first_rows,
            query_lens,
            meta.context_lens.numpy().astype(np.int64),
            meta.block_tables.numpy(),
            meta.slot_mapping,
            positions,
            inv_freq,
            block_size,
            all_live=bool((query_lens == per_seq).all()),
        )

    @classmethod
    def from_attention(
        cls,
        attn: AttentionMetadata,
        positions: torch.Tensor,
        inv_freq: torch.Tensor,
        block_size: int,
    ) -> DecodePlanCPU:
        """The plan of any step (prefill chunks beside decode, verify and tree verify rows, in
        the ragged layout of `AttentionMetadata`): every query row attends exactly as a decode
        row of the same token would, so a row's values never depend on what shares its step,
        on the chunk its prompt was split into, on a prefix recomputed after preemption, or on
        the tree it was drafted in. A tree step's node row sees the keys before the tree's
        region and then those of its path (its ancestors, root side first, then itself): the
        keys, in the order, that the decode row of the same token sees once the path is
        accepted and compacted (`attn.tree_mask`; node order is topological, so the region's
        order is the path's).

        Args:
            attn: the step's metadata (on the CPU).
            positions: [T] int64 position of each query row.
            inv_freq, block_size: as in `build`.
        """
        cu = attn.cu_seqlens_q.numpy().astype(np.int64)  # [B + 1]
        return cls._build(
            cu[:-1],
            cu[1:] - cu[:-1],
            attn.context_lens.numpy().astype(np.int64),
            attn.block_tables.numpy(),
            attn.slot_mapping,
            positions,
            inv_freq,
            block_size,
            all_live=True,
            tree_mask=None if attn.tree_mask is None else attn.tree_mask.numpy(),
        )

    @classmethod
    def _build(
        cls,
        first_rows: np.ndarray,
        query_lens: np.ndarray,
        context: np.ndarray,
        tables: np.ndarray,
        slot_mapping: torch.Tensor,
        positions: torch.Tensor,
        inv_freq: torch.Tensor,
        block_size: int,
        all_live: bool,
        tree_mask: np.ndarray | None = None,
    ) -> DecodePlanCPU:
        """`build`'s work over per-sequence first rows ([B] int64), query and context lengths
        ([B] int64), block tables ([B, W]) and the [T] slot of each row (-1: not written); a
        tree step's [B, Q, R] region mask (the last R keys of each context) gives its rows
        that do not see a prefix of the keys their own entries (`_tree_rows`)."""
        keep = slot_mapping.numpy() >= 0
        if keep.all():
            slots, write_rows = slot_mapping, None
        else:
            write_rows = torch.from_numpy(np.flatnonzero(keep))
            slots = slot_mapping[write_rows]
        sequences: list[tuple[int, list[int], int | torch.Tensor]] = []
        for b, (first_row, length, count, table) in enumerate(
            zip(first_rows.tolist(), context.tolist(), query_lens.tolist(), tables, strict=True)
        ):
            if length == 0 or count == 0:
                continue  # an inert padding sequence (its rows stay 0), or no query row
            width = -(-length // block_size)
            blocks = table[:width].astype(np.int64)
            keys: int | torch.Tensor = int(blocks[0]) * block_size
            if (np.diff(blocks) != 1).any():  # blocks not consecutive: gather the slots
                keys = torch.from_numpy(cache_slots(blocks, np.arange(length), block_size))
            counts = list(range(length - count + 1, length + 1))  # row j sees its prefix
            if tree_mask is not None:
                sequences += _tree_rows(first_row, counts, keys, tree_mask[b], blocks, block_size)
            else:
                sequences.append((first_row, counts, keys))
        cos, sin = _rope_tables(positions, inv_freq)
        half = cos.shape[-1] // 2
        half_swap = torch.cat((torch.arange(half, 2 * half), torch.arange(half)))
        return cls(
            cos=cos,
            sin=sin,
            half_swap=half_swap,
            slots=slots,
            write_rows=write_rows,
            sequences=sequences,
            all_live=all_live,
        )

    def for_layers(
        self,
        positions: torch.Tensor,
        inv_freq: torch.Tensor | None,
        sliding_window: int | None,
    ) -> DecodePlanCPU:
        """The plan of the same step for layers that rotate with `inv_freq` (None: this
        plan's table) and attend within `sliding_window` (None: no window): the index work
        is shared, only the RoPE tables are made anew.

        Args:
            positions: [T] int64 position of each query row (as given to `build`).
            inv_freq: [D / 2] or [T, D / 2] float32 inverse frequencies, or None.
            sliding_window: the layers' window, or None.
        """
        if inv_freq is None:
            return dataclasses.replace(self, sliding_window=sliding_window)
        cos, sin = _rope_tables(positions, inv_freq)
        return dataclasses.replace(self, cos=cos, sin=sin, sliding_window=sliding_window)


def _tree_rows(
    first_row: int,
    counts: list[int],
    keys: int | torch.Tensor,
    region: np.ndarray,
    blocks: np.ndarray,
    block_size: int,
) -> list[tuple[int, list[int], int | torch.Tensor]]:
    """One sequence's entries of a tree step's plan: its rows that see a prefix of its keys (the
    causal rule: a tree's root, a first child of a first child ..., a chain or a prefill chunk
    beside the tree) in runs over `keys` as a plain step's rows; every other row (a node off
    the first path) an entry of its own over its keys gathered in order: those before the
    region, then the region's keys it sees (its ancestors and itself).

    Args:
        first_row: the sequence's first query row; counts: each row's causal key count.
        keys: the sequence's keys as `_build` holds them (a first slot, or every slot).
        region: [Q, R] bool the sequence's rows in the step's tree region (the last R keys).
        blocks, block_size: the sequence's cache blocks.
    """
    length = counts[-1]
    start = length - region.shape[1]  # the region's first key (< 0: its first columns are none)
    slots = None
    entries: list[tuple[int, list[int], int | torch.Tensor]] = []
    run: list[int] = []  # counts of the run of causal rows that ends at the row before

    def close(end_row: int) -> None:
        if run:
            entries.append((first_row + end_row - len(run), list(run), keys))
            run.clear()

    for j, count in enumerate(counts):
        seen = [start + r for r in np.flatnonzero(region[j]).tolist() if start + r >= 0]
        visible = list(range(min(max(start, 0), count))) + seen
        if visible == list(range(count)):
            run.append(count)
            continue
        close(j)
        if slots is None:
            slots = cache_slots(blocks, np.arange(length), block_size)
        entries.append((first_row + j, [len(visible)], torch.from_numpy(slots[visible])))
    close(len(counts))
    return entries


def _rope_tables(
    positions: torch.Tensor, inv_freq: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """([T, 1, D] cosines, [T, 1, D] sines with the first half negated) of the rows at
    `positions` ([T] int64) for `inv_freq` ([D / 2] or [T, D / 2]), in float32."""
    freqs = positions.to(torch.float32)[:, None] * inv_freq.to(torch.float32)  # [T, D / 2]
    cos, sin = freqs.cos(), freqs.sin()
    return torch.cat((cos, cos), dim=-1)[:, None], torch.cat((-sin, sin), dim=-1)[:, None]


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
    rotated = qk * plan.cos + qk.index_select(-1, plan.half_swap) * plan.sin
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
    softcap: float | None = None,
) -> torch.Tensor:
    """`fused.paged_decode_attention_ref` row by row: each live query row over its own keys
    (those inside `plan.sliding_window` of it when the plan has a window), through
    `cpu_extension.row_attention` (the same arithmetic for every row, all rows in one call)
    where it applies, else one SDPA call per row; with `softcap`,
    `attention.softcap_attention` per row instead (Gemma 2's soft-capped scores).

    Args:
        query: [B * Q, H_q, D] rotated queries in the plan's uniform layout.
        k_cache, v_cache: [num_blocks, block_size, H_kv, D] one layer's caches (holding the
            step's keys and values).
        plan: the step's plan.
        scale: softmax scale.
        softcap: the score cap, or None.

    Returns: [B * Q, H_q, D] in query's dtype; padding rows (and inert sequences) are 0.
    """
    num_rows, num_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[2]
    flat_k = k_cache.view(-1, num_kv_heads, head_dim)
    flat_v = v_cache.view(-1, num_kv_heads, head_dim)
    rows = query.transpose(0, 1)[None]  # [1, H_q, B * Q, D]
    window = plan.sliding_window
    seen_keys: list[tuple[int, torch.Tensor, torch.Tensor, list[int], list[int]]] = []
    for first_row, counts, keys_at in plan.sequences:
        # Row j (at position counts[j] - 1) sees the keys at max(counts[j] - window, 0) ..
        # counts[j] - 1; only keys some row sees are read (from `first` on).
        first = 0 if window is None else max(counts[0] - window, 0)
        if isinstance(keys_at, int):  # consecutive slots: views of the cache
            keys = flat_k[keys_at + first : keys_at + counts[-1]]
            values = flat_v[keys_at + first : keys_at + counts[-1]]
        else:
            seen = keys_at[first:]
            keys, values = flat_k.index_select(0, seen), flat_v.index_select(0, seen)
        if keys.dtype != query.dtype:
            keys, values = keys.to(query.dtype), values.to(query.dtype)
        begins = [0 if window is None else max(count - window, 0) - first for count in counts]
        seen_keys.append((first_row, keys, values, begins, [count - first for count in counts]))
    if softcap is None:
        result = query.new_zeros(num_rows, num_heads, head_dim)
        if cpu_extension.row_attention(query, seen_keys, scale, result):
            return result
    outputs: list[tuple[int, torch.Tensor]] = []
    for first_row, keys, values, begins, ends in seen_keys:
        keys, values = keys.transpose(0, 1)[None], values.transpose(0, 1)[None]  # [1, H_kv, S, D]
        for j, (begin, end) in enumerate(zip(begins, ends, strict=True)):
            row = first_row + j
            if softcap is None:
                out = F.scaled_dot_product_attention(
                    rows[:, :, row : row + 1],
                    keys[:, :, begin:end],
                    values[:, :, begin:end],
                    scale=scale,
                    enable_gqa=num_heads != num_kv_heads,
                )  # [1, H_q, 1, D]
            else:
                out = softcap_attention(
                    rows[:, :, row : row + 1],
                    keys[:, :, begin:end],
                    values[:, :, begin:end],
                    scale=scale,
                    softcap=softcap,
                )
            outputs.append((row, out[0, :, 0]))
    if len(outputs) == num_rows and plan.all_live:
        return torch.stack([out for _, out in outputs])  # rows in order: [B * Q, H_q, D]
    result = query.new_zeros(num_rows, num_heads, head_dim)
    for row, out in outputs:
        result[row] = out
    return result
