"""The logits rules of the requests a plain step samples, kept on the device between steps.

Each request with penalties, a bias, allowed tokens, single-token bad words or min_tokens gets
a row of a `SlotRules` at its first plain sample, written once from its prompt and output; its
committed tokens are then added to the row's output counts (one scatter a step for every
request, `flush`). A plain step processes its rows from those rows instead of rebuilding the
rules' [B, V] tensors from the host's token lists every step (`LogitsContext`, which the H100
measured at about half the tokens/s of plain decoding without rules, s42). The processing is the
same function on the same values, so tokens are unchanged bit for bit. Requests without rules
read row 0, which stays neutral. A batch holding a grammar or a multi-token bad word, or more
ruled requests than rows, takes `LogitsContext` as before (`rows_for` returns None).
"""

from __future__ import annotations

import dataclasses

import torch

from specdec.engine.request import Request
from specdec.sampling.context import LogitsRules, RuleTensors, process_rules
from specdec.sampling.slot_rules import SlotRules
from specdec.transfer import to_device


class RequestRules:
    """Rows of rules for up to `capacity - 1` requests at once (row 0: no rules)."""

    def __init__(self, capacity: int, vocab_size: int, device: torch.device) -> None:
        self.rules = SlotRules(capacity, vocab_size, device)
        self.device = device
        self._row: dict[int, tuple[Request, int]] = {}  # id(request) -> (request, its row)
        self._free = list(range(capacity - 1, 0, -1))
        self._pending: list[tuple[int, int]] = []  # (row, token) committed, not yet counted
        self.num_steps = 0  # steps whose rows were processed from here
        self._used = self.rules.tensors  # the fields the last `rows_for` batch uses

    def rows_for(self, requests: list[Request]) -> torch.Tensor | None:
        """[B] int64 on the device: each request's row (written on its first use; 0 without
        rules), or None where this batch takes `LogitsContext` instead."""
        if any(r.grammar is not None or not SlotRules.supports(r.rules) for r in requests):
            return None
        new = [r for r in requests if r.rules is not None and id(r) not in self._row]
        if len(new) > len(self._free):
            self._reclaim(requests)
            if len(new) > len(self._free):
                return None
        if new:
            rows = [self._free.pop() for _ in new]
            for request, row in zip(new, rows, strict=True):
                self._row[id(request)] = (request, row)
            self.rules.write(
                rows,
                [r.rules for r in new],
                [r.prompt_token_ids for r in new],
                [r.output_token_ids for r in new],
            )
        self.flush()
        index = [self._row[id(r)][1] if r.rules is not None else 0 for r in requests]
        self.num_steps += 1
        self._used = _used_tensors(self.rules.tensors, [r.rules for r in requests])
        return to_device(index, torch.int64, self.device)

    def apply(
        self, logits: torch.Tensor, rows: torch.Tensor, prefix: torch.Tensor | None
    ) -> torch.Tensor:
        """The rows `rows_for` gave processed as `SlotRules.apply` processes them, skipping
        the rules no request of that batch has (each is the identity on a neutral row)."""
        return process_rules(logits.to(torch.float32), self._used, rows, prefix)

    def committed(self, request: Request, tokens: list[int]) -> None:
        """Tokens appended to a request's output (counted at the next `flush`); a finished
        request's row is given back."""
        entry = self._row.get(id(request))
        if entry is None:
            return
        if request.status.finished:
            self.release(request)
            return
        row = entry[1]
        self._pending += [(row, t) for t in tokens]

    def release(self, request: Request) -> None:
        entry = self._row.pop(id(request), None)
        if entry is not None:
            row = entry[1]
            self._pending = [(r, t) for r, t in self._pending if r != row]
            self._free.append(row)

    def flush(self) -> None:
        """The committed tokens into their rows' output counts, in one scatter."""
        if not self._pending:
            return
        rows = [row for row, _ in self._pending]
        tokens = [token for _, token in self._pending]
        self._pending = []
        packed = to_device(rows + tokens, torch.int64, self.device)
        rows_t, tokens_t = packed.split([len(rows), len(tokens)])
        t = self.rules.tensors
        ones = torch.ones(len(rows), dtype=torch.float32, device=self.device)
        t.output_counts.index_put_((rows_t, tokens_t), ones, accumulate=True)
        t.num_output.index_add_(0, rows_t, torch.ones_like(rows_t))

    def _reclaim(self, batch: list[Request]) -> None:
        """Rows of requests outside `batch` (finished, aborted or preempted since their last
        commit: one that comes back is written again)."""
        keep = {id(r) for r in batch}
        for request, _ in list(self._row.values()):
            if id(request) not in keep:
                self.release(request)


def _used_tensors(t: RuleTensors, rules: list[LogitsRules | None]) -> RuleTensors:
    """`t` without the fields no rules of `rules` use (None: the step skips them)."""
    present = [r for r in rules if r is not None]
    biased = any(
        r.logit_bias or r.allowed_token_ids is not None or r.bad_words_token_ids for r in present
    )
    repetition = any(r.repetition_penalty != 1.0 for r in present)
    presence = any(r.presence_penalty != 0.0 for r in present)
    frequency = any(r.frequency_penalty != 0.0 for r in present)
    minimum = any(r.min_tokens for r in present)
    counted = repetition or presence or frequency
    return dataclasses.replace(
        t,
        bias=t.bias if biased else None,
        prompt_seen=t.prompt_seen if repetition else None,
        output_counts=t.output_counts if counted else None,
        repetition=t.repetition if repetition else None,
        presence=t.presence if presence else None,
        frequency=t.frequency if frequency else None,
        num_output=t.num_output if minimum else None,
        min_tokens=t.min_tokens if minimum else None,
        min_banned=t.min_banned if minimum else None,
    )
