"""Paged attention: the per-step metadata, the paged KV cache, and causal attention over it.

A plain PyTorch path (the CPU; CUDA too when FLASH_PREFILL_ON_CUDA is off): new K/V are written to
their cache slots, then each sequence's context is gathered through its block table and attended
with an explicit mask. On CUDA attention runs the flash-style paged kernel instead
(`prefill_attention.py`). It never allocates blocks or decides which slots to use (the engine
does) and never draws randomness.
"""

from __future__ import annotations

import contextlib
import itertools
import mmap
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from specdec.models.prefill_attention import paged_prefill_attention
from specdec.transfer import to_device

# The largest finite float8 e4m3 value: an FP8 cache saturates there (no overflow to NaN).
FP8_E4M3_MAX = 448.0
# Whether the eager path attends through the flash-style prefill kernel on CUDA (no score matrix
# in memory); False keeps the masked SDPA path there too (the old path, for comparisons).
FLASH_PREFILL_ON_CUDA = True


def to_cache_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`x` in a KV cache's dtype. An FP8 (e4m3) cache holds values as they are (per-tensor
    scale 1.0) and saturates at +-448, as the Triton writes do; other dtypes are a plain cast."""
    if dtype == torch.float8_e4m3fn:
        return x.to(torch.float32).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(dtype)
    return x.to(dtype)


def cache_slots(block_ids, positions, block_size: int) -> np.ndarray:
    """Flat KV-cache slots of token positions: slot = block * block_size + offset, where the block
    is entry position // block_size of the sequence's block table. The one place this layout is
    written down.

    Args:
        block_ids: [..., W] int cache blocks of each sequence (a list for one sequence).
        positions: [..., Q] int token positions (same leading dims; each < W * block_size).

    Returns: [..., Q] int64 slots.
    """
    blocks = np.asarray(block_ids, dtype=np.int64)
    positions = np.asarray(positions, dtype=np.int64)
    owning = np.take_along_axis(blocks, positions // block_size, axis=-1)
    return owning * block_size + positions % block_size


@dataclass(frozen=True, slots=True)
class AttentionMetadata:
    """Where the T query tokens of one forward step come from and where their K/V go.

    The tokens of sequence b are `cu_seqlens_q[b]:cu_seqlens_q[b + 1]` of the flattened batch; query
    token j of a sequence with context length L and q_len new tokens sits at position
    L - q_len + j and attends to the cached positions 0..L - q_len + j.

    Attributes:
        cu_seqlens_q: [B + 1] int64 exclusive prefix sum of the query lengths.
        context_lens: [B] int64 tokens in the KV cache for each sequence after this step, the new
            ones included.
        block_tables: [B, max_blocks] int32/int64 cache block ids of each sequence, in order;
            entries past a sequence's last block are ignored (any value, e.g. -1).
        slot_mapping: [T] int64 flat cache slot (block * block_size + offset) each new token's K/V
            is written to; -1 means do not write.
        max_seqlen_q: max query length over the batch (a host int, so no device sync is needed).
        max_context_len: max context length over the batch (host int).
        all_written: True when no slot is -1, if known on the host (None: read from the device).
        tree_mask: [B, max_seqlen_q, W] bool or None (W >= max_seqlen_q). When given, the
            last W keys of each sequence's context are a draft tree's region: query token i of
            sequence b sees the keys before it and exactly the region's keys j with
            tree_mask[b, i, j] (its tree ancestors and itself, `draft_tree.verify_step_mask`),
            instead of the causal rule. A verify step's region is its new tokens (W = Q).
    """

    cu_seqlens_q: torch.Tensor
    context_lens: torch.Tensor
    block_tables: torch.Tensor
    slot_mapping: torch.Tensor
    max_seqlen_q: int
    max_context_len: int
    all_written: bool | None = None
    tree_mask: torch.Tensor | None = None

    @property
    def num_seqs(self) -> int:
        """B, the number of sequences in the step."""
        return self.context_lens.shape[0]

    @classmethod
    def build(
        cls,
        query_lens: Sequence[int],
        context_lens: Sequence[int],
        block_tables: Sequence[Sequence[int]],
        block_size: int,
        device: torch.device | str = "cpu",
    ) -> AttentionMetadata:
        """Builds the metadata of a step in which every new token's K/V is written.

        Args:
            query_lens: new tokens of each sequence (their positions are the last ones of the
                context).
            context_lens: tokens in the cache of each sequence after the step.
            block_tables: the cache blocks of each sequence, in order (ragged lists are padded
                with -1); each must cover its context.
            block_size: tokens per cache block.
            device: where the tensors live.

        Raises:
            ValueError: inconsistent lengths, or a block table too short for its context.
        """
        if not len(query_lens) == len(context_lens) == len(block_tables):
            raise ValueError(
                "query_lens, context_lens and block_tables must have one entry per sequence"
            )
        slots: list[int] = []
        for q_len, ctx_len, table in zip(query_lens, context_lens, block_tables, strict=True):
            if not 0 <= q_len <= ctx_len:
                raise ValueError(f"need 0 <= query_len <= context_len, got {q_len} and {ctx_len}")
            if len(table) * block_size < ctx_len:
                raise ValueError(
                    f"{len(table)} blocks of {block_size} tokens cannot hold a context of {ctx_len}"
                )
            if q_len:
                slots += cache_slots(table, range(ctx_len - q_len, ctx_len), block_size).tolist()
        max_blocks = max((len(t) for t in block_tables), default=0)
        padded_tables = [list(t) + [-1] * (max_blocks - len(t)) for t in block_tables]
        cu = [0]
        for q_len in query_lens:
            cu.append(cu[-1] + q_len)
        # One copy for all four (through reused pinned memory on CUDA: a copy from pageable
        # memory would first wait for the work already queued).
        num_seqs = len(block_tables)
        flat = list(itertools.chain(cu, context_lens, *padded_tables, slots))
        packed = to_device(flat, torch.int64, torch.device(device))
        cu_t, context_t, tables_t, slots_t = packed.split(
            [len(cu), num_seqs, num_seqs * max_blocks, len(slots)]
        )
        return cls(
            cu_seqlens_q=cu_t,
            context_lens=context_t,
            block_tables=tables_t.view(num_seqs, max_blocks),
            slot_mapping=slots_t,
            max_seqlen_q=max(query_lens, default=0),
            max_context_len=max(context_lens, default=0),
            all_written=True,
        )


@dataclass(frozen=True, slots=True)
class DecodeMetadata:
    """A step in which every sequence brings at most `query_per_seq` query tokens, laid out
    uniformly: token j of sequence b is row b * query_per_seq + j of the flattened batch.

    Query token j < query_lens[b] of sequence b sits at position context_lens[b] - query_lens[b] + j
    and sees cached positions up to its own. Rows j >= query_lens[b] are padding (their K/V are not
    written: slot -1); sequences with context_lens[b] == 0 are inert padding rows (no K/V read or
    written, output 0).

    Attributes:
        block_tables: [B, max_blocks] int32/int64 cache blocks of each sequence (entries past a
            sequence's context are never read).
        context_lens: [B] int32/int64 tokens in the cache after the step, the new ones included.
        query_lens: [B] int32/int64 live query tokens of each sequence (<= query_per_seq).
        slot_mapping: [B * query_per_seq] int64 cache slot of each query token's K/V (-1: skip).
        query_per_seq: Q, query rows per sequence in the flattened layout.
        num_partitions: 0 for the single-pass attention kernel; else the split-KV kernel
            (`models/split_kv.py`) over this many partitions per sequence, which must cover every
            context (fixed per CUDA graph: derived from max_model_len).
        tree_mask: [B, Q, W] bool or None (W >= Q): the last W keys of each context are a
            draft tree's region; query row i of sequence b sees the keys before it and the
            region's keys j with tree_mask[b, i, j] (its tree ancestors and itself) instead of
            the causal rule. bool, or an integer dtype read as nonzero = visible (the decode
            graphs' int64 static input). The twins, the single-pass and the split-KV kernels
            apply it.

    A layer's sliding window and score cap are not step metadata: each layer hands its own to
    the kernels (`fused.paged_decode_attention`), a tree step's rows' positions with them.
    """

    block_tables: torch.Tensor
    context_lens: torch.Tensor
    query_lens: torch.Tensor
    slot_mapping: torch.Tensor
    query_per_seq: int
    num_partitions: int = 0
    tree_mask: torch.Tensor | None = None


@dataclass(frozen=True, slots=True)
class KVCache:
    """The paged K/V cache of every layer (the holder is frozen; the tensors are written in place).

    Attributes:
        k_cache: [num_layers, num_blocks, block_size, num_kv_heads, head_dim]; `k_cache[i]` is
            layer i's [num_blocks, block_size, num_kv_heads, head_dim] view.
        v_cache: same shape as `k_cache`.
    """

    k_cache: torch.Tensor
    v_cache: torch.Tensor

    @classmethod
    def allocate(
        cls,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> KVCache:
        """A zero-filled cache. On the CPU its memory is an anonymous memory map, whose zero
        pages the OS commits only when first written: the resident cache is what requests have
        used, however many blocks it has."""
        shape = (num_layers, num_blocks, block_size, num_kv_heads, head_dim)
        if torch.device(device).type == "cpu":
            return cls(k_cache=_lazy_zeros(shape, dtype), v_cache=_lazy_zeros(shape, dtype))
        return cls(
            k_cache=torch.zeros(shape, dtype=dtype, device=device),
            v_cache=torch.zeros(shape, dtype=dtype, device=device),
        )

    @property
    def num_blocks(self) -> int:
        return self.k_cache.shape[1]

    @property
    def block_size(self) -> int:
        return self.k_cache.shape[2]


def _lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zero CPU tensor whose pages are committed on first write: an anonymous memory map (zero
    pages, lazily backed; not NumPy's allocator, which asks for 2 MB huge pages, so that the
    first token of each layer would commit 2 MB of K and of V)."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    size = max(int(np.prod(shape)) * itemsize, 1)
    region = mmap.mmap(-1, size)
    raw = np.frombuffer(region, dtype=np.uint8)  # keeps the map alive
    return torch.from_numpy(raw).view(dtype).view(shape)


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Writes the new tokens' K/V into their cache slots.

    Args:
        key: [T, H_kv, D] keys of the new tokens (after RoPE).
        value: [T, H_kv, D] values of the new tokens.
        k_cache: [num_blocks, block_size, H_kv, D] one layer's key cache.
        v_cache: [num_blocks, block_size, H_kv, D] one layer's value cache.
        slot_mapping: [T] int64 flat slot of each token; -1 skips the token.

    Mutates: the slots of `k_cache` and `v_cache` named by `slot_mapping`.
    """
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    keep = slot_mapping >= 0  # [T]
    slots = slot_mapping[keep]
    k_cache.view(-1, num_kv_heads, head_dim)[slots] = to_cache_dtype(key[keep], k_cache.dtype)
    v_cache.view(-1, num_kv_heads, head_dim)[slots] = to_cache_dtype(value[keep], v_cache.dtype)


@dataclass(frozen=True, slots=True)
class AttentionPlan:
    """The index work of one step, done once and shared by every layer.

    Attributes:
        seq_of_token: [T] int64 sequence of each query token (None on the flash path).
        index_in_seq: [T] int64 its index among its sequence's query tokens (None likewise).
        blocks: [B, ceil(max_context_len / block_size)] int64 block table (padding -> block 0;
            None on the flash path).
        mask: [B, 1, max_seqlen_q, max_context_len] bool, True where a query sees a key (None on
            the flash path, which never builds it).
        slot_mapping: [T] int64 cache slot of each token (-1 = do not write).
        all_written: whether every token is written (no -1 in slot_mapping).
        flash: attend through `prefill_attention.paged_prefill_attention` (CUDA), reading
            the cache through `attn`'s block tables; memory linear in the context.
        attn: the step's metadata (read by the flash path).
        sliding_window: the window the flash path applies (None: none).
    """

    seq_of_token: torch.Tensor | None
    index_in_seq: torch.Tensor | None
    blocks: torch.Tensor | None
    mask: torch.Tensor | None
    slot_mapping: torch.Tensor
    all_written: bool
    num_seqs: int
    max_seqlen_q: int
    max_context_len: int
    flash: bool = False
    attn: AttentionMetadata | None = None
    sliding_window: int | None = None

    @classmethod
    def build(
        cls,
        attn: AttentionMetadata,
        block_size: int,
        device: torch.device,
        sliding_window: int | None = None,
        positions: torch.Tensor | None = None,
    ) -> AttentionPlan:
        """The plan of one step. `sliding_window`: a query at position p sees the keys at
        positions > p - sliding_window; under a tree mask p is the token's own position
        (`positions`, [T] int64: a node sits at its depth, not at its index in the step), and
        every window must hold the tree's region (no ancestor falls out of it).

        Raises: ValueError: a tree step under a window without `positions`, or whose region
            is wider than the window."""
        num_tokens = attn.slot_mapping.shape[0]
        num_seqs = attn.num_seqs
        max_q, max_ctx = attn.max_seqlen_q, attn.max_context_len
        slot_mapping = attn.slot_mapping.to(device=device, dtype=torch.int64)
        all_written = (
            attn.all_written
            if attn.all_written is not None
            else bool((slot_mapping >= 0).all())
            if num_tokens
            else True
        )
        if device.type == "cuda" and FLASH_PREFILL_ON_CUDA and attn.tree_mask is None:
            return cls(
                seq_of_token=None,
                index_in_seq=None,
                blocks=None,
                mask=None,
                slot_mapping=slot_mapping,
                all_written=all_written,
                num_seqs=num_seqs,
                max_seqlen_q=max_q,
                max_context_len=max_ctx,
                flash=True,
                attn=attn,
                sliding_window=sliding_window,
            )
        cu = attn.cu_seqlens_q.to(device=device, dtype=torch.int64)
        query_lens = cu[1:] - cu[:-1]  # [B]
        context_lens = attn.context_lens.to(device=device, dtype=torch.int64)  # [B]
        seq_of_token = torch.repeat_interleave(
            torch.arange(num_seqs, device=device), query_lens, output_size=num_tokens
        )  # [T]
        index_in_seq = torch.arange(num_tokens, device=device) - cu[seq_of_token]  # [T]
        num_ctx_blocks = -(-max_ctx // block_size)
        blocks = attn.block_tables[:, :num_ctx_blocks].to(device=device, dtype=torch.int64)
        blocks = blocks.clamp(min=0)  # padding entries point at block 0; the mask hides them
        key_pos = torch.arange(max_ctx, device=device)  # [S]
        query_pos = (context_lens - query_lens)[:, None] + torch.arange(max_q, device=device)
        mask = (key_pos <= query_pos[:, :, None]) & (key_pos < context_lens[:, None, None])
        if attn.tree_mask is not None:
            tree_mask = attn.tree_mask.to(device)
            mask = _tree_visible(mask, tree_mask, context_lens - tree_mask.shape[2])
        if sliding_window is not None:
            if attn.tree_mask is not None:
                region = attn.tree_mask.shape[2]
                if positions is None or region > sliding_window:
                    raise ValueError(
                        f"a tree step under a sliding window of {sliding_window} needs its "
                        f"tokens' positions and a region of at most that many keys (got "
                        f"{region})"
                    )
                query_pos = query_pos.clone()
                query_pos[seq_of_token, index_in_seq] = positions.to(device, torch.int64)
            mask &= key_pos > query_pos[:, :, None] - sliding_window
        # Rows that see no key (padding of an empty sequence) would give NaN; let them see key 0.
        mask[:, :, 0] |= ~mask.any(dim=-1)
        return cls(
            seq_of_token=seq_of_token,
            index_in_seq=index_in_seq,
            blocks=blocks,
            mask=mask[:, None],
            slot_mapping=slot_mapping,
            all_written=all_written,
            num_seqs=num_seqs,
            max_seqlen_q=max_q,
            max_context_len=max_ctx,
        )


def _tree_visible(
    causal: torch.Tensor, tree_mask: torch.Tensor, prefix_lens: torch.Tensor
) -> torch.Tensor:
    """The causal mask [B, Q, S] with a tree region's keys replaced by a tree mask [B, Q, W]:
    key s in [prefix_lens[b], prefix_lens[b] + W) is region key j = s - prefix_lens[b], visible
    iff tree_mask[b, i, j]; keys before the region stay as they were (visible)."""
    num_queries, num_keys = causal.shape[1], causal.shape[2]
    width = tree_mask.shape[2]
    key_pos = torch.arange(num_keys, device=causal.device)
    region_index = key_pos[None, :] - prefix_lens[:, None]  # [B, S]
    in_region = (region_index >= 0) & (region_index < width)
    gathered = tree_mask.gather(
        2, region_index.clamp(0, width - 1)[:, None, :].expand(-1, num_queries, -1)
    )  # [B, Q, S]
    return torch.where(in_region[:, None, :], gathered, causal)


def move_kv(kv_cache: KVCache, source_slots: torch.Tensor, target_slots: torch.Tensor) -> None:
    """Copies the K/V of `source_slots` into `target_slots` in every layer (all sources are read
    before any target is written): how an accepted tree path's K/V are compacted into the
    consecutive slots of its positions.

    Args:
        kv_cache: the cache.
        source_slots: [M] int64 flat slots holding the K/V to keep.
        target_slots: [M] int64 flat slots they belong in.

    Mutates: the `target_slots` of every layer of `kv_cache`.
    """
    if source_slots.numel() == 0:
        return
    for cache in (kv_cache.k_cache, kv_cache.v_cache):
        flat = cache.view(cache.shape[0], -1, cache.shape[3], cache.shape[4])
        flat[:, target_slots] = flat[:, source_slots].clone()


def write_kv_planned(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: AttentionPlan,
) -> None:
    """`write_kv` with the step's plan (no per-layer mask work when every token is written)."""
    if not plan.all_written:
        write_kv(key, value, k_cache, v_cache, plan.slot_mapping)
        return
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    k_cache.view(-1, num_kv_heads, head_dim)[plan.slot_mapping] = to_cache_dtype(key, k_cache.dtype)
    v_cache.view(-1, num_kv_heads, head_dim)[plan.slot_mapping] = to_cache_dtype(
        value, v_cache.dtype
    )


def _eager_backends(device: torch.device):
    """SDPA backends for the eager path on CUDA: memory-efficient attention (or the math
    fallback), not cuDNN. cuDNN builds an execution plan for every new shape, and every new
    prompt length is one: on the H200 a prefill of a length not seen before took a median
    131 ms against 57 ms without cuDNN (SmolLM2 shape, 16 lengths; 38 and 35 ms once seen)."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


def softcap_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    scale: float,
    softcap: float,
    attn_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """`F.scaled_dot_product_attention` with soft-capped scores, as Gemma 2 attends: scores =
    softcap * tanh(q.k * scale / softcap), then the mask, a float32 softmax and the values.
    SDPA has no soft-capping, so this writes the score matrix out (the CPU's paths only).

    Args:
        query: [B, H_q, Q, D].
        key, value: [B, H_kv, S, D] (H_kv divides H_q: query head h reads KV head
            h // (H_q / H_kv), as SDPA's `enable_gqa`).
        scale: softmax scale.
        softcap: the cap (> 0).
        attn_mask: [B, 1, Q, S] bool, True where a query sees a key, or None.

    Returns: [B, H_q, Q, D] in query's dtype.
    """
    groups = query.shape[1] // key.shape[1]
    if groups > 1:
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    scores = torch.matmul(query, key.transpose(-1, -2)) * scale  # [B, H_q, Q, S]
    scores = torch.tanh(scores / softcap) * softcap
    if attn_mask is not None:
        scores = scores.masked_fill(~attn_mask, float("-inf"))
    weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    return torch.matmul(weights, value)


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    attn: AttentionMetadata | AttentionPlan,
    *,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Causal attention of the new tokens over their sequences' cached context.

    Sequences are padded to `max_seqlen_q` queries and `max_context_len` keys and run as one SDPA
    call with a boolean mask; GQA heads share K/V without copying them. A flash plan (CUDA) runs
    the paged flash-style kernel instead (`prefill_attention.py`): no mask, no gathered copy.

    Args:
        query: [T, H_q, D] queries of the new tokens (after RoPE).
        k_cache: [num_blocks, block_size, H_kv, D] one layer's key cache, already holding the new
            tokens' keys.
        v_cache: [num_blocks, block_size, H_kv, D] one layer's value cache, likewise.
        attn: the step's metadata, or its plan (built once per step by the model).
        scale: softmax scale (1 / sqrt(D) for the Llama family).
        sliding_window: if set, a query at position p sees keys at positions > p - sliding_window
            (ignored when `attn` is a plan: the plan carries its mask).
        softcap: soft-cap the scores (`softcap_attention`; the flash plan's kernel caps them
            as `attention_tiles.score_scales` states), or None.

    Returns:
        [T, H_q, D] attention output, in `query`'s dtype.
    """
    num_tokens, num_heads, head_dim = query.shape
    if num_tokens == 0:
        return query.new_empty(0, num_heads, head_dim)
    if isinstance(attn, AttentionMetadata):
        attn = AttentionPlan.build(attn, k_cache.shape[1], query.device, sliding_window)
    plan = attn
    if plan.flash and plan.attn is not None:
        meta = plan.attn
        return paged_prefill_attention(
            query,
            k_cache,
            v_cache,
            meta.cu_seqlens_q,
            meta.context_lens,
            meta.block_tables,
            meta.max_seqlen_q,
            scale=scale,
            sliding_window=plan.sliding_window,
            softcap=softcap,
        )
    max_ctx = plan.max_context_len
    keys = k_cache[plan.blocks].flatten(1, 2)[:, :max_ctx]  # [B, S, H_kv, D]
    values = v_cache[plan.blocks].flatten(1, 2)[:, :max_ctx]  # [B, S, H_kv, D]
    if plan.max_seqlen_q == 1 and plan.num_seqs == num_tokens:
        padded_query = query[:, None]  # [B, 1, H_q, D]: one query token per sequence
    else:
        padded_query = query.new_zeros(plan.num_seqs, plan.max_seqlen_q, num_heads, head_dim)
        padded_query[plan.seq_of_token, plan.index_in_seq] = query
    if softcap is not None:
        out = softcap_attention(
            padded_query.transpose(1, 2),
            keys.transpose(1, 2).to(query.dtype),
            values.transpose(1, 2).to(query.dtype),
            scale=scale,
            softcap=softcap,
            attn_mask=plan.mask,
        )  # [B, H_q, Q, D]
    else:
        with _eager_backends(query.device):
            out = F.scaled_dot_product_attention(
                padded_query.transpose(1, 2),  # [B, H_q, Q, D]
                keys.transpose(1, 2).to(query.dtype),  # [B, H_kv, S, D]
                values.transpose(1, 2).to(query.dtype),
                attn_mask=plan.mask,  # [B, 1, Q, S]
                scale=scale,
                enable_gqa=num_heads != keys.shape[2],
            )  # [B, H_q, Q, D]
    if plan.max_seqlen_q == 1 and plan.num_seqs == num_tokens:
        return out[:, :, 0]  # [T, H_q, D]
    return out.transpose(1, 2)[plan.seq_of_token, plan.index_in_seq]  # [T, H_q, D]
