"""The block drafters' context inside device rounds, paged: per drafter layer a pool of keys and
values in blocks, a block table per slot, blocks held per request (so memory grows with the
requests, not with slots x max_model_len), and the attention of a block's rows over it.

A block row attends to its request's context positions [0, context_len) and to every row of its
own block (no causal mask), as two partial attentions merged by their log-sum-exp: the context
through the split-KV kernels (`models/split_kv.py`: their PyTorch twin on the CPU, Triton on
CUDA reading only a slot's live blocks, a fixed grid), the block's own rows dense. The block rows
are never written to the pool. Host bookkeeping (allocation, tables) happens outside rounds; the
attention is device work only. Never draws randomness.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specdec.drafters.device import BlockTables
from specdec.models.attention import DecodeMetadata, KVCache, cache_slots
from specdec.models.split_kv import num_partitions, split_kv_attention_lse
from specdec.runner.kv_cache import BlockAllocator
from specdec.transfer import to_device

# Block size of a pool whose drafter was built without the engine's geometry (`DrafterSetup`).
FALLBACK_BLOCK_SIZE = 16


@dataclass(slots=True, eq=False)
class _Blocks:
    """The pool blocks one request holds (a `BlockHolder`)."""

    block_ids: list[int] = field(default_factory=list)


class PagedBlockContext:
    """Per drafter layer, keys and values [num_blocks + 1, block_size, H_kv, D]; block
    `num_blocks` is scratch (never handed out, never read): writes that must not land (drafts not
    committed, inert slots) go there. Slot tables [num_slots, max_blocks] name the scratch block
    past a request's blocks, so a stray write never reaches another request's block.

    Args:
        num_layers, num_kv_heads, head_dim, dtype, device: the drafter layers' K/V shape.
        num_blocks, block_size: the pool's geometry (the blocks requests may hold).
        num_slots: rows of the block tables (a device round's slots).
        max_positions: the most positions a request may hold (max_model_len + the round width).
    """

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        *,
        num_blocks: int,
        block_size: int,
        num_slots: int,
        max_positions: int,
    ) -> None:
        self.cache = KVCache.allocate(
            num_layers, num_blocks + 1, block_size, num_kv_heads, head_dim, dtype, device
        )
        self.allocator = BlockAllocator(num_blocks, block_size)
        self.block_size = block_size
        self.num_slots = num_slots
        self.scratch = num_blocks
        self.max_blocks = -(-max_positions // block_size)
        self.tables = BlockTables(num_slots, self.max_blocks, device)
        # The split-KV launch covers every context a request may hold (fixed per pool: graphs).
        self.num_partitions = num_partitions(self.max_blocks * block_size)
        self._held: dict[str, _Blocks] = {}

    @property
    def num_layers(self) -> int:
        return self.cache.k_cache.shape[0]

    @property
    def num_free_blocks(self) -> int:
        return self.allocator.num_free_blocks

    def grow(self, wanted: dict[str, int]) -> None:
        """Gives each request blocks for its first `wanted[request_id]` positions, all or none.

        Raises: RuntimeError ("out of KV blocks") when the pool cannot hold them all; then no
        request got a block.
        Mutates: the requests' blocks."""
        holders = {request_id: self._held.get(request_id, _Blocks()) for request_id in wanted}
        extra = sum(
            max(self.allocator.blocks_needed(n) - len(holders[rid].block_ids), 0)
            for rid, n in wanted.items()
        )
        if extra > self.allocator.num_free_blocks:
            raise RuntimeError(
                f"out of KV blocks for the drafter's context: need {extra}, have "
                f"{self.allocator.num_free_blocks}"
            )
        for request_id, num_positions in wanted.items():
            self.allocator.grow(holders[request_id], num_positions)
            self._held[request_id] = holders[request_id]

    def free(self, request_id: str) -> None:
        """Gives back every block of the request (nothing if it holds none)."""
        holder = self._held.pop(request_id, None)
        if holder is not None:
            self.allocator.free(holder)

    def block_ids(self, request_id: str) -> list[int]:
        return list(self._held[request_id].block_ids) if request_id in self._held else []

    def send_tables(self, slots: list[tuple[int, str]]) -> None:
        """Sends the block tables of (slot, request id) for the next round (one copy); entries
        past a request's blocks name the scratch block."""
        rows = []
        for slot, request_id in slots:
            blocks = self.block_ids(request_id)
            rows.append((slot, blocks + [self.scratch] * (self.max_blocks - len(blocks))))
        self.tables.send(rows)

    def slots(self, request_id: str, start: int, end: int) -> torch.Tensor:
        """[end - start] int64 flat pool slots of the request's positions start..end-1 (held)."""
        blocks = self._held[request_id].block_ids
        flat = (
            cache_slots(blocks, range(start, end), self.block_size).tolist() if end > start else []
        )
        return to_device(flat, torch.int64, self.cache.k_cache.device)

    def flat(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `layer`'s keys and values as [slots, H_kv, D] views."""
        k_cache, v_cache = self.cache.k_cache[layer], self.cache.v_cache[layer]
        return k_cache.flatten(0, 1), v_cache.flatten(0, 1)

    def round_slots(
        self, tables: torch.Tensor, positions: torch.Tensor, keep: torch.Tensor
    ) -> torch.Tensor:
        """Device work: [S, W] int64 flat slots of positions [S, W] through the slots' tables
        [S, max_blocks], the scratch block's first slot where `keep` [S, W] is False."""
        size = self.block_size
        safe = positions.clamp_min(0)
        block = (safe // size).clamp_max(self.max_blocks - 1)
        slots = tables.gather(1, block) * size + safe % size
        return torch.where(keep, slots, self.scratch * size)

    def layers(self, num_rows: int, context_lens: torch.Tensor) -> list[PagedLayerContext]:
        """Every layer's context for a round over the first `num_rows` slots, each slot seeing
        its positions [0, context_lens[s]) ([S] int64)."""
        tables = self.tables.rows(num_rows)
        return [
            PagedLayerContext(
                self.cache.k_cache[layer],
                self.cache.v_cache[layer],
                tables,
                context_lens,
                self.num_partitions,
            )
            for layer in range(self.num_layers)
        ]


@dataclass(frozen=True, slots=True)
class PagedLayerContext:
    """One drafter layer's paged context for a round: what `BlockAttention` attends through.

    Attributes:
        k_pool, v_pool: [num_blocks, block_size, H_kv, D] the layer's pools.
        block_tables: [S, max_blocks] int64 each slot's blocks.
        context_lens: [S] int64 context positions each slot's block sees.
        num_partitions: split-KV partitions of a launch (they cover every context).
    """

    k_pool: torch.Tensor
    v_pool: torch.Tensor
    block_tables: torch.Tensor
    context_lens: torch.Tensor
    num_partitions: int

    def attend(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        scale: float,
        softcap: float | None = None,
    ) -> torch.Tensor:
        """See `paged_block_attention`."""
        return paged_block_attention(
            query,
            key,
            value,
            self.k_pool,
            self.v_pool,
            self.block_tables,
            self.context_lens,
            self.num_partitions,
            scale,
            softcap,
        )


def paged_block_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    num_partitions: int,
    scale: float,
    softcap: float | None = None,
) -> torch.Tensor:
    """Attention of each block's rows over its paged context and its own rows, no causal mask:
    softmax over [context keys 0..context_lens[n]-1, the block's R keys], computed as the two
    partial attentions merged by their log-sum-exps (device work only, graph-safe on CUDA).

    Args:
        query: [N, R, H_q, D] the block rows' rotated queries.
        key, value: [N, R, H_kv, D] the block rows' own keys (rotated) and values.
        k_pool, v_pool: [num_blocks, block_size, H_kv, D] one layer's context pools.
        block_tables: [N, max_blocks] int64 each block's context blocks.
        context_lens: [N] int64 context positions each block sees (0: its own rows only).
        num_partitions: split-KV partitions a launch covers (>= every context's).
        scale: softmax scale.
        softcap: if set, scores cap * tanh(scale q.k / cap) (Gemma 2's soft-capping).

    Returns: [N, R, H_q, D] in query's dtype.
    """
    n, r, num_heads, head_dim = query.shape
    meta = DecodeMetadata(
        block_tables=block_tables,
        context_lens=context_lens,
        query_lens=torch.zeros_like(context_lens),  # no row is causal: each sees its context
        slot_mapping=context_lens[:0],  # nothing is written
        query_per_seq=r,
        num_partitions=num_partitions,
    )
    context_out, context_lse = split_kv_attention_lse(
        query.reshape(n * r, num_heads, head_dim), k_pool, v_pool, meta, scale, softcap
    )
    own_out, own_lse = own_rows_attention(query, key, value, scale, softcap)
    return merge_partials(
        context_out.view(n, r, num_heads, head_dim),
        context_lse.view(n, r, num_heads),
        own_out,
        own_lse,
    ).to(query.dtype)


def own_rows_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scale: float,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense attention of each block's R rows over its own R rows, in float32.

    Args: query [N, R, H_q, D]; key, value [N, R, H_kv, D] (H_q a multiple of H_kv); softcap
    as `paged_block_attention`'s.

    Returns: (out [N, R, H_q, D] float32, lse [N, R, H_q] float32 of the scaled scores)."""
    group = query.shape[2] // key.shape[2]
    queries = query.float().transpose(1, 2)  # [N, H_q, R, D]
    keys = key.float().repeat_interleave(group, dim=2).transpose(1, 2)
    values = value.float().repeat_interleave(group, dim=2).transpose(1, 2)
    scores = (queries @ keys.transpose(-1, -2)) * scale  # [N, H_q, R, R]
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    lse = torch.logsumexp(scores, dim=-1)  # [N, H_q, R]
    out = torch.exp(scores - lse[..., None]) @ values  # [N, H_q, R, D]
    return out.transpose(1, 2), lse.transpose(1, 2)


def merge_partials(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> torch.Tensor:
    """Two partial attentions of the same rows over disjoint keys, as one: [..., D] float32
    outputs with their [...] log-sum-exps; `lse_b` must be finite (a side with no key, lse -inf,
    then weighs 0)."""
    top = torch.maximum(lse_a, lse_b)
    weight_a, weight_b = torch.exp(lse_a - top), torch.exp(lse_b - top)
    total = weight_a + weight_b
    return (out_a * (weight_a / total)[..., None]) + (out_b * (weight_b / total)[..., None])
