"""A device round's logprobs on their way to the host (`DeviceRounds`): the rows of the slots
whose requests ask for them, computed on the device after the round (`RoundLogprobs`), then read
back as host lists and cut to each request's own count (`ReadLogprobs`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(slots=True)
class RoundLogprobs:
    """A launched round's logprobs, on their way to the host: for each slot in `slots` (in
    order), its k + 1 rows (anchor, then each draft position), the top entries of the most any
    of them asked for (each request's own count is cut when read, `ReadLogprobs`)."""

    slots: list[int]
    values: torch.Tensor  # [len(slots) x (k + 1)] float32: each row's token's logprob
    ranks: torch.Tensor  # [len(slots) x (k + 1)] int64
    top_ids: torch.Tensor  # [len(slots) x (k + 1), num_top] int64
    top_values: torch.Tensor  # [len(slots) x (k + 1), num_top] float32


# (tokens, top ids, top logprobs, token logprobs, token ranks) -> vLLM's logprob entries
# (`OutputProcessor.logprob_entries_from`).
LogprobEntries = Callable[
    [list[int], list[list[int]], list[list[float]], list[float], list[int]], list[dict]
]


@dataclass(slots=True)
class ReadLogprobs:
    """A read round's logprobs as host lists; called with (slot, its emitted tokens), the
    entries of those tokens (its first rows)."""

    rows: dict[int, int]  # slot -> its first row
    values: list[float]
    ranks: list[int]
    top_ids: list[list[int]]
    top_values: list[list[float]]
    entries: LogprobEntries | None
    num_top: dict[int, int]  # slot -> the top entries its request asked for

    def __call__(self, b: int, tokens: list[int]) -> list[dict]:
        first, n = self.rows[b], self.num_top[b]
        last = first + len(tokens)
        return self.entries(
            tokens,
            [ids[:n] for ids in self.top_ids[first:last]],
            [values[:n] for values in self.top_values[first:last]],
            self.values[first:last],
            self.ranks[first:last],
        )
