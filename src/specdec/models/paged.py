"""Paged execution of a model: KV-cache block accounting and one eager forward step over a mixed
batch (prefill chunks and decode/verify rows). Used by the engine for the target and by drafters
for their own models. Never samples or draws randomness.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Protocol

import torch

from specdec.models.attention import AttentionMetadata
from specdec.models.llama import LlamaForCausalLM


class BlockHolder(Protocol):
    """Anything that holds KV blocks (a request, a drafter's per-request state)."""

    block_ids: list[int]


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
            self._free.append(holder.block_ids.pop())

    def free(self, holder: BlockHolder) -> None:
        """Releases every block of `holder`. Mutates: holder.block_ids."""
        self._free.extend(reversed(holder.block_ids))
        holder.block_ids.clear()

    def slots(self, holder: BlockHolder, start: int, count: int) -> list[int]:
        """Cache slots of token positions start .. start+count-1 of `holder`."""
        size = self.block_size
        return [holder.block_ids[p // size] * size + p % size for p in range(start, start + count)]


@dataclass(frozen=True, slots=True)
class StepInput:
    """One sequence's share of a forward step.

    Attributes:
        token_ids: the query tokens fed this step.
        start: position of token_ids[0] (tokens 0..start-1 already have K/V in the cache).
        block_ids: the sequence's cache blocks, covering start + len(token_ids) slots.
        num_logit_rows: logits are wanted for the last `num_logit_rows` query tokens.
    """

    token_ids: list[int]
    start: int
    block_ids: list[int]
    num_logit_rows: int


class PagedModelRunner:
    """Owns a model and its KV cache (`num_blocks` x `block_size` slots)."""

    def __init__(self, model: LlamaForCausalLM, num_blocks: int, block_size: int) -> None:
        self.model = model
        self.block_size = block_size
        self.kv_cache = model.allocate_kv_cache(num_blocks, block_size)
        self.device = model.model.embed_tokens.weight.device

    @torch.inference_mode()
    def run(self, inputs: list[StepInput]) -> list[torch.Tensor]:
        """One forward step over every input; K/V of all query tokens are written.

        Returns:
            Per input, [num_logit_rows, V] float32 logits predicting the token after each of its
            last num_logit_rows query tokens.

        Mutates: the KV cache slots of the query tokens.
        """
        if not inputs:
            return []
        token_ids: list[int] = []
        positions: list[int] = []
        logit_rows: list[int] = []
        for step_input in inputs:
            n = len(step_input.token_ids)
            offset = len(token_ids)
            token_ids.extend(step_input.token_ids)
            positions.extend(range(step_input.start, step_input.start + n))
            logit_rows.extend(range(offset + n - step_input.num_logit_rows, offset + n))
        attn = AttentionMetadata.build(
            query_lens=[len(s.token_ids) for s in inputs],
            context_lens=[s.start + len(s.token_ids) for s in inputs],
            block_tables=[s.block_ids for s in inputs],
            block_size=self.block_size,
            device=self.device,
        )
        input_ids = torch.tensor(token_ids, dtype=torch.int64, device=self.device)
        position_ids = torch.tensor(positions, dtype=torch.int64, device=self.device)
        hidden = self.model(input_ids, position_ids, attn, self.kv_cache)  # [T, D]
        rows = torch.tensor(logit_rows, dtype=torch.int64, device=self.device)
        logits = self.model.compute_logits(hidden[rows])  # [N, V]
        return list(logits.split([s.num_logit_rows for s in inputs]))
