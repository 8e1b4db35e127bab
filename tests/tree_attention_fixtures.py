"""Tree-masked paged decode attention cases (tests only): sequences of a decode/verify step, each a
tree verify share (its draft tree's parents), a chain share or an inert row, over scattered cache
blocks, with the [B, Q, W] `DecodeMetadata.tree_mask` built from `draft_tree` the way the runner
builds it. Shared by the Triton-interpreter test on the CPU and the GPU parity test."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from specdec.draft_tree import chain_parents, region_rows, verify_step_mask
from specdec.models.attention import DecodeMetadata

# Tree shapes (parents per node, topological order).
SHAPES = {
    "chain": tuple(chain_parents(1, 7)[0].tolist()),
    "wide": (-1,) * 9,
    "deep": (-1, -1, 0, 0, 1, 2, 2, 5, 7, 8, 9, 9, 11, 12, 13),  # 15 nodes: Q = 16
    "bushy": (-1, -1, -1, 0, 0, 1, 3),
}


@dataclass(frozen=True)
class Share:
    """One sequence of the step: `parents` (None: a causal chain of `count` tokens) and the
    context length after the step (0: an inert row)."""

    context_len: int
    parents: tuple[int, ...] | None = None
    count: int = 1

    @property
    def num_tokens(self) -> int:
        if self.context_len == 0:
            return 0
        return self.count if self.parents is None else 1 + len(self.parents)


def random_parents(generator: torch.Generator, num_nodes: int) -> tuple[int, ...]:
    """A random tree: each node's parent is ROOT or any earlier node."""
    return tuple(
        int(torch.randint(-1, node, (), generator=generator)) if node else -1
        for node in range(num_nodes)
    )


def tree_case(
    shares: list[Share],
    *,
    query_per_seq: int,
    width: int | None = None,
    num_kv_heads: int = 2,
    group: int = 4,
    head_dim: int = 64,
    block_size: int = 16,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
):
    """(query [B * Q, H_q, D], k_cache, v_cache, meta with tree_mask) on the CPU.

    The region is the last `width` keys (default Q) of each context: a tree share's rows see the
    prefix and their ancestors, a chain share's rows the causal rule, padding rows every key
    (as `DecodeGraphs` fills them)."""
    width = query_per_seq if width is None else width
    generator = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-share.context_len // block_size) for share in shares]
    max_blocks = max(max(blocks_per_seq), 1)
    num_blocks = sum(blocks_per_seq) + 5
    order = torch.randperm(num_blocks, generator=generator).tolist()
    tables = torch.zeros(len(shares), max_blocks, dtype=torch.int32)
    used = 0
    for b, count in enumerate(blocks_per_seq):
        tables[b, :count] = torch.tensor(order[used : used + count], dtype=torch.int32)
        used += count
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(*shape, generator=generator).to(dtype)
    v_cache = torch.randn(*shape, generator=generator).to(dtype)
    num_heads = num_kv_heads * group
    query = torch.randn(len(shares) * query_per_seq, num_heads, head_dim, generator=generator)
    mask = torch.ones(len(shares), query_per_seq, width, dtype=torch.bool)
    for b, share in enumerate(shares):
        n = share.num_tokens
        if not n:
            continue
        assert n <= query_per_seq and n <= share.context_len, share
        step_mask = None
        if share.parents is not None:
            step_mask = verify_step_mask(torch.tensor([share.parents], dtype=torch.int64))[0]
        mask[b, :n] = region_rows(step_mask, n, width)
    meta = DecodeMetadata(
        block_tables=tables,
        context_lens=torch.tensor([s.context_len for s in shares], dtype=torch.int32),
        query_lens=torch.tensor([s.num_tokens for s in shares], dtype=torch.int32),
        slot_mapping=torch.full((len(shares) * query_per_seq,), -1),
        query_per_seq=query_per_seq,
        tree_mask=mask,
    )
    return query.to(dtype), k_cache, v_cache, meta


def live_rows(meta: DecodeMetadata) -> torch.Tensor:
    """[B * Q] bool: the rows of live query tokens (padding rows and inert rows excluded)."""
    q = meta.query_per_seq
    token = torch.arange(q)[None, :]
    return (token < meta.query_lens.to(torch.int64)[:, None].cpu()).flatten()


def to_device(meta: DecodeMetadata, device: str) -> DecodeMetadata:
    return replace(
        meta,
        block_tables=meta.block_tables.to(device),
        context_lens=meta.context_lens.to(device),
        query_lens=meta.query_lens.to(device),
        slot_mapping=meta.slot_mapping.to(device),
        tree_mask=None if meta.tree_mask is None else meta.tree_mask.to(device),
    )


def wrong_ancestor(meta: DecodeMetadata) -> DecodeMetadata:
    """The same metadata with one live row seeing an existing key it should not (the negative
    control): of the rows that hide a key, the one that sees the fewest keys (where one more
    key moves its output most) gets its first hidden key."""
    mask = meta.tree_mask.clone()
    width = mask.shape[2]
    best = None
    for b, (ctx, q_len) in enumerate(
        zip(meta.context_lens.tolist(), meta.query_lens.tolist(), strict=True)
    ):
        first = max(width - ctx, 0)  # region columns before the context do not exist
        for i in range(q_len):
            row = mask[b, i, first:]
            hidden = (~row).nonzero()
            if len(hidden):
                seen = max(ctx - width, 0) + int(row.sum())
                if best is None or seen < best[0]:
                    best = (seen, b, i, first + int(hidden[0]))
    assert best is not None, "no row hides a key"
    _, b, i, j = best
    mask[b, i, j] = True
    return replace(meta, tree_mask=mask)


def standard_cases(generator: torch.Generator) -> dict[str, tuple[list[Share], int, int | None]]:
    """name -> (shares, Q, W or None): chains, wide, deep, random trees; context lengths across
    cache-block and 64-key chunk boundaries; a context shorter than the region; inert rows;
    chain shares beside tree shares; Q up to 16."""
    shapes = SHAPES
    rand = random_parents(generator, 12)
    return {
        "mixed": (
            [
                Share(40, shapes["bushy"]),
                Share(0),  # inert
                Share(5, shapes["bushy"][:4]),  # context 5 < region 8
                Share(64, shapes["chain"]),  # ends on a chunk boundary
                Share(17, count=3),  # a chain share in a tree step
                Share(130, rand[:7]),
            ],
            8,
            None,
        ),
        "deep16": (
            [Share(16, shapes["deep"]), Share(65, shapes["deep"]), Share(200, (*rand, 11, 3, 0))],
            16,
            None,
        ),
        "wide": ([Share(10, shapes["wide"]), Share(33, shapes["wide"][:3])], 10, None),
        "short": ([Share(3, (-1, -1)), Share(1, ())], 4, None),  # whole contexts in the region
        "wider_region": ([Share(12, shapes["bushy"]), Share(6, (-1, -1))], 8, 11),
    }
