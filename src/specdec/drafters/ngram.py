"""Prompt-lookup (n-gram) drafting: propose the tokens that followed the latest earlier occurrence
of the sequence's trailing n-gram. Deterministic (one-hot) drafts: no noise, no logits."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from specdec.drafters.base import DraftBatch, Drafter, DrafterSetup, Proposal
from specdec.drafters.config import SpeculativeConfig

if TYPE_CHECKING:
    from specdec.drafters.device import DeviceDrafting
    from specdec.models import LlamaForCausalLM


def ngram_lookup(tokens: list[int], num_draft: int, min_n: int, max_n: int) -> list[int]:
    """Up to `num_draft` tokens that followed the latest earlier match of the trailing n-gram,
    trying n = max_n down to min_n; [] when nothing matches."""
    if num_draft <= 0:
        return []
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = tokens[length - n :]
        for start in range(length - n - 1, -1, -1):
            if tokens[start : start + n] == suffix:
                follow = tokens[start + n : start + n + num_draft]
                if follow:
                    return follow
    return []


class NgramDrafter(Drafter):
    """vLLM's `ngram` method (prompt lookup) with `prompt_lookup_min` / `prompt_lookup_max`."""

    def __init__(
        self, target_vocab_size: int, prompt_lookup_min: int = 1, prompt_lookup_max: int = 4
    ):
        super().__init__(target_vocab_size)
        if not 1 <= prompt_lookup_min <= prompt_lookup_max:
            raise ValueError(
                "need 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                f"{prompt_lookup_min}, {prompt_lookup_max}"
            )
        self.prompt_lookup_min = prompt_lookup_min
        self.prompt_lookup_max = prompt_lookup_max

    def device_drafting(
        self, num_slots: int, width: int, max_model_len: int, device: torch.device
    ) -> DeviceDrafting:
        from specdec.drafters.ngram_device import NgramDeviceDrafting

        return NgramDeviceDrafting(self, num_slots, width, max_model_len).to(device)

    @classmethod
    def from_config(
        cls, spec: SpeculativeConfig, target: LlamaForCausalLM, setup: DrafterSetup | None = None
    ) -> NgramDrafter:
        """Prompt lookup with the config's n-gram sizes (no model, no cache: `setup` unused)."""
        return cls(target.config.vocab_size, spec.prompt_lookup_min, spec.prompt_lookup_max)

    def propose(self, batch: DraftBatch) -> Proposal:
        k = batch.max_draft
        drafts = torch.full((batch.batch_size, k), -1, dtype=torch.int64)
        found = torch.zeros(batch.batch_size, dtype=torch.int64)
        for b, tokens in enumerate(batch.token_ids):
            follow = ngram_lookup(
                tokens, int(batch.num_draft[b]), self.prompt_lookup_min, self.prompt_lookup_max
            )
            drafts[b, : len(follow)] = torch.tensor(follow, dtype=torch.int64)
            found[b] = len(follow)
        device = batch.seeds.device
        return Proposal(drafts.to(device), None, None, found.to(device))
