"""`BlockAllocator`: the last freed blocks are handed out first, so that on the CPU, whose
cache pages are committed on first write, requests that come and go keep reusing the same
blocks instead of walking over the whole cache.

Negative control: the first-in-first-out order the allocator had (freed blocks at the back)
walks over every block in the same loop, so the bound on touched blocks has power."""

from __future__ import annotations

from dataclasses import dataclass, field

from specdec.runner import BlockAllocator


@dataclass
class _Holder:
    block_ids: list[int] = field(default_factory=list)


class _FirstInFirstOut(BlockAllocator):
    """The previous order: freed and rolled-back blocks go to the back of the free list."""

    def rollback(self, holder: _Holder, num_tokens: int) -> None:
        keep = self.blocks_needed(num_tokens)
        while len(holder.block_ids) > keep:
            self._free.append(holder.block_ids.pop())

    def free(self, holder: _Holder) -> None:
        self._free.extend(reversed(holder.block_ids))
        holder.block_ids.clear()


def _touched_blocks(allocator: BlockAllocator) -> set[int]:
    """Every block handed out over 50 requests of 40-70 tokens, one after another, each with
    rejected draft slots rolled back once, beside one request that stays."""
    touched: set[int] = set()
    staying, holder = _Holder(), _Holder()
    allocator.grow(staying, 20)
    touched.update(staying.block_ids)
    for request in range(50):
        length = 40 + (request * 7) % 31
        allocator.grow(holder, length + 5)
        allocator.rollback(holder, length)
        allocator.grow(holder, length + 3)
        touched.update(holder.block_ids)
        allocator.free(holder)
    return touched


def test_freed_blocks_are_handed_out_first() -> None:
    allocator = BlockAllocator(num_blocks=8, block_size=4)
    first, second = _Holder(), _Holder()
    allocator.grow(first, 12)  # blocks 0, 1, 2
    allocator.grow(second, 4)  # block 3
    allocator.free(first)
    allocator.grow(second, 12)  # two more: the first two of those freed, in order
    assert second.block_ids == [3, 0, 1]
    allocator.rollback(second, 4)
    again = _Holder()
    allocator.grow(again, 8)  # the rolled-back blocks come back first too
    assert again.block_ids == [0, 1]
    assert allocator.num_free_blocks == 8 - 3


def test_requests_that_come_and_go_reuse_the_same_blocks() -> None:
    # The two requests hold at most ceil(20 / 16) + ceil(75 / 16) = 2 + 5 blocks at once.
    assert len(_touched_blocks(BlockAllocator(num_blocks=256, block_size=16))) <= 7
    assert len(_touched_blocks(_FirstInFirstOut(num_blocks=256, block_size=16))) > 100
