"""Logits rules held on the device, a row per slot of the speculative rounds: a request's
penalties, logit bias, allowed tokens, single-token bad words and min_tokens, with its output
counts kept current by each round on the device (`observe`), so that a round processes its
verify rows with no host in the loop (and a CUDA graph can capture it).

The processing is the host's own (`context.process_rules`): a slot's row is processed bit for bit
as `LogitsContext.apply` processes its request's row with the same output and drafts before it.
A slot without rules holds neutral values (bias 0, repetition 1, presence and frequency 0,
min_tokens 0), under which a row comes out as its raw float32 logits exactly (x + 0, x * 1,
x - 0). Multi-token bad words (they read the output's last tokens) and grammars (a matcher on
the host) are not held here (`supports`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specdec.sampling.context import LogitsContext, LogitsRules, RuleTensors, process_rules
from specdec.transfer import to_device

# Each per-slot field with the value of a slot without rules.
_NEUTRAL = {
    "bias": 0.0,
    "prompt_seen": False,
    "output_counts": 0.0,
    "repetition": 1.0,
    "presence": 0.0,
    "frequency": 0.0,
    "num_output": 0,
    "min_tokens": 0,
    "min_banned": False,
}


class SlotRules:
    """The rules of `num_slots` slots over a vocabulary of `vocab_size` ([S, V] float32 bias and
    output counts, [S, V] bool prompt tokens and min_tokens bans, [S] parameters)."""

    def __init__(self, num_slots: int, vocab_size: int, device: torch.device) -> None:
        def rows(dtype: torch.dtype, value) -> torch.Tensor:
            return torch.full((num_slots, vocab_size), value, dtype=dtype, device=device)

        def column(dtype: torch.dtype, value) -> torch.Tensor:
            return torch.full((num_slots,), value, dtype=dtype, device=device)

        n = _NEUTRAL
        self.vocab_size, self.device = vocab_size, device
        self.tensors = RuleTensors(
            bias=rows(torch.float32, n["bias"]),
            prompt_seen=rows(torch.bool, n["prompt_seen"]),
            output_counts=rows(torch.float32, n["output_counts"]),
            repetition=column(torch.float32, n["repetition"]),
            presence=column(torch.float32, n["presence"]),
            frequency=column(torch.float32, n["frequency"]),
            num_output=column(torch.int64, n["num_output"]),
            min_tokens=column(torch.int64, n["min_tokens"]),
            min_banned=rows(torch.bool, n["min_banned"]),
            bad_prefix=None,
            bad_last=None,
            output_tail=None,
        )

    @staticmethod
    def supports(rules: LogitsRules | None) -> bool:
        """Whether a request's rules can be held in a slot (no multi-token bad word)."""
        return rules is None or all(len(word) == 1 for word in rules.bad_words_token_ids)

    def write(
        self,
        slots: Sequence[int],
        rules: Sequence[LogitsRules | None],
        prompts: Sequence[Sequence[int]],
        outputs: Sequence[Sequence[int]],
    ) -> None:
        """Sets the given slots to these requests' rules and contexts (prompts, outputs so
        far); neutral values for a request without rules.

        Raises:
            ValueError: rules this class does not hold (`supports`), or lengths that differ.
        """
        if not len(slots) == len(rules) == len(prompts) == len(outputs):
            raise ValueError("slots, rules, prompts and outputs must have one entry per slot")
        if not all(self.supports(r) for r in rules):
            raise ValueError("multi-token bad_words cannot be held in a slot's rules")
        if not slots:
            return
        index = to_device(list(slots), torch.int64, self.device)
        context = LogitsContext.build(rules, prompts, outputs)
        built = None if context is None else context.tensors(self.device, self.vocab_size)
        for name, neutral in _NEUTRAL.items():
            buffer = getattr(self.tensors, name)
            value = None if built is None else getattr(built, name)
            if value is None:
                buffer.index_fill_(0, index, neutral)
            else:
                buffer.index_copy_(0, index, value.to(buffer.dtype))

    def apply(
        self, logits: torch.Tensor, rows: torch.Tensor, prefix: torch.Tensor | None = None
    ) -> torch.Tensor:
        """[N, V] float32: raw logits ([N, V], any float dtype) processed by the rules of each
        row's slot (`rows`, [N] int64), with `prefix` ([N, J] int64, -1 from the first absent
        entry on) counted as output after the slot's (`LogitsContext.apply`). Device work only."""
        return process_rules(logits.to(torch.float32), self.tensors, rows, prefix)

    def observe(self, emitted: torch.Tensor, accepted: torch.Tensor, live: torch.Tensor) -> None:
        """A round's emitted tokens to the output counts of the first R slots: slot b's
        `emitted[b, :accepted[b] + 1]` ([R, W] int64, [R] int64) where `live[b]` ([R] bool).
        Device work only."""
        num_rows, width = emitted.shape
        t = self.tensors
        columns = torch.arange(width, device=emitted.device)
        valid = (columns[None, :] <= accepted[:, None]) & live[:, None]
        tokens = emitted.clamp(0, self.vocab_size - 1)
        t.output_counts[:num_rows].scatter_add_(1, tokens, valid.to(torch.float32))
        t.num_output[:num_rows] += valid.sum(dim=1)

    def state(self) -> list[torch.Tensor]:
        """The buffers a round both reads and updates (`observe`)."""
        return [self.tensors.output_counts, self.tensors.num_output]

    def view(self, num_rows: int) -> SlotRulesView:
        """The first `num_rows` slots as a verifier's context (`check_verify_inputs`)."""
        return SlotRulesView(self, num_rows)


class SlotRulesView:
    """The first `num_rows` slots of a `SlotRules`, used where a `LogitsContext` of as many
    requests is (`num_rows`, `apply`)."""

    def __init__(self, rules: SlotRules, num_rows: int) -> None:
        self.rules, self.num_rows = rules, num_rows

    def apply(
        self,
        logits: torch.Tensor,
        rows: torch.Tensor | None = None,
        prefix: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if rows is None:
            if logits.shape[0] != self.num_rows:
                raise ValueError(f"logits have {logits.shape[0]} rows for {self.num_rows} slots")
            rows = torch.arange(self.num_rows, device=logits.device)
        return self.rules.apply(logits, rows, prefix)
