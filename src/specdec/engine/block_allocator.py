"""Paged KV-cache block accounting: which blocks a request holds, growth, and rollback.

Holds no tensors: the model runner owns the cache memory; this decides which slots are whose.
A slot is `block_id * block_size + offset`.
"""

from __future__ import annotations

from collections import deque

from specdec.engine.request import Request


class BlockAllocator:
    """A free list of `num_blocks` blocks of `block_size` token slots each."""

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

    def can_grow(self, request: Request, num_tokens: int) -> bool:
        """Whether `request` can hold `num_tokens` slots in all."""
        extra = self.blocks_needed(num_tokens) - len(request.block_ids)
        return extra <= len(self._free)

    def grow(self, request: Request, num_tokens: int) -> None:
        """Gives `request` enough blocks for `num_tokens` slots. Mutates: request.block_ids."""
        extra = self.blocks_needed(num_tokens) - len(request.block_ids)
        if extra > len(self._free):
            raise RuntimeError(f"out of KV blocks: need {extra}, have {len(self._free)}")
        for _ in range(max(extra, 0)):
            request.block_ids.append(self._free.popleft())

    def rollback(self, request: Request, num_tokens: int) -> None:
        """Keeps only the blocks needed for the first `num_tokens` slots (rejected draft slots
        beyond them are released). Mutates: request.block_ids."""
        keep = self.blocks_needed(num_tokens)
        while len(request.block_ids) > keep:
            self._free.append(request.block_ids.pop())

    def free(self, request: Request) -> None:
        """Releases every block of `request`. Mutates: request.block_ids."""
        self._free.extend(reversed(request.block_ids))
        request.block_ids.clear()

    def slots(self, request: Request, start: int, count: int) -> list[int]:
        """Cache slots of token positions start .. start+count-1 of `request`."""
        size = self.block_size
        return [request.block_ids[p // size] * size + p % size for p in range(start, start + count)]
