"""KV-cache block accounting: a free list of fixed-size blocks handed to whoever holds K/V (a
request, a drafter's per-request state), grown, rolled back and freed. Host bookkeeping only: it
never touches the cache tensors, runs a model or draws randomness.
"""

from __future__ import annotations

from collections import deque
from typing import Protocol

from specdec.models.attention import cache_slots


class BlockHolder(Protocol):
    """Anything that holds KV blocks (a request, a drafter's per-request state)."""

    block_ids: list[int]


class BlockAllocator:
    """A free list of `num_blocks` blocks of `block_size` token slots each, last freed first
    handed out: on the CPU the cache's pages are committed when first written
    (`KVCache.allocate`), so reusing warm blocks keeps the resident cache at what requests hold
    at once rather than growing over every block as requests come and go."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(
                f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}"
            )
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use."""
        return 1.0 - len(self._free) / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_grow(self, holder: BlockHolder, num_tokens: int) -> bool:
        """Whether `holder` can hold `num_tokens` slots in all."""
        extra = self.blocks_needed(num_tokens) - len(holder.block_ids)
        return extra <= len(self._free)

    def grow(self, holder: BlockHolder, num_tokens: int) -> None:
        """Gives `holder` enough blocks for `num_tokens` slots. Mutates: holder.block_ids."""
        extra = self.blocks_needed(num_tokens) - len(holder.block_ids)
        if extra > len(self._free):
            raise RuntimeError(f"out of KV blocks: need {extra}, have {len(self._free)}")
        for _ in range(max(extra, 0)):
            holder.block_ids.append(self._free.popleft())

    def rollback(self, holder: BlockHolder, num_tokens: int) -> None:
        """Keeps only the blocks needed for the first `num_tokens` slots (rejected draft slots
        beyond them are released). Mutates: holder.block_ids."""
        keep = self.blocks_needed(num_tokens)
        while len(holder.block_ids) > keep:
            self._free.appendleft(holder.block_ids.pop())

    def free(self, holder: BlockHolder) -> None:
        """Releases every block of `holder`. Mutates: holder.block_ids."""
        self._free.extendleft(reversed(holder.block_ids))  # its first block is next out
        holder.block_ids.clear()

    def slots(self, holder: BlockHolder, start: int, count: int) -> list[int]:
        """Cache slots of token positions start .. start+count-1 of `holder`."""
        positions = range(start, start + count)
        return cache_slots(holder.block_ids, positions, self.block_size).tolist() if count else []
