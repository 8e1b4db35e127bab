"""Log-probabilities of sampled tokens and the top-n alternatives, from raw or processed logits.

Raw logprobs describe the model; processed logprobs describe the distribution actually sampled
from (after temperature and filters). Nothing here draws randomness.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class Logprobs:
    """Attributes:
    token_logprobs: [N] float32 log-probability of each row's token.
    top_ids: [N, n] int64 the n most likely ids, most likely first.
    top_logprobs: [N, n] float32 their log-probabilities.
    token_ranks: [N] int64 rank of each row's token: 1 + the number of ids strictly more
        likely (vLLM's definition; the top ids have ranks 1..n by position).
    """

    token_logprobs: torch.Tensor
    top_ids: torch.Tensor
    top_logprobs: torch.Tensor
    token_ranks: torch.Tensor


def compute_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, num_top: int = 0) -> Logprobs:
    """Log-softmax of `logits` at `token_ids`, plus the top `num_top` entries of each row.

    Args:
        logits: [N, V] raw logits, or processed logits (-inf outside the support).
        token_ids: [N] int64 tokens whose log-probability is wanted.
        num_top: how many top alternatives to return (0 for none).

    Returns:
        Logprobs with float32 values (-inf for tokens outside a processed support).
    """
    if num_top < 0:
        raise ValueError(f"num_top must be >= 0, got {num_top}")
    logp = logits.to(torch.float32).log_softmax(dim=-1)
    token_logprobs = logp.gather(1, token_ids[:, None]).squeeze(1)
    token_ranks = (logp > token_logprobs[:, None]).sum(dim=-1) + 1
    num_top = min(num_top, logits.shape[-1])
    top = logp.topk(num_top, dim=-1) if num_top else None
    empty_ids = torch.empty(logits.shape[0], 0, dtype=torch.int64, device=logits.device)
    empty_values = torch.empty(logits.shape[0], 0, dtype=torch.float32, device=logits.device)
    return Logprobs(
        token_logprobs=token_logprobs,
        top_ids=top.indices if top is not None else empty_ids,
        top_logprobs=top.values if top is not None else empty_values,
        token_ranks=token_ranks,
    )
