"""Verifiers: token-level ("standard"), block, and coupled; temperature-0 rows verify greedily.

`verify` dispatches to the fused Triton kernels on CUDA and to `verify_ref` elsewhere; both take
the same arguments and return the same result (tokens identical on inputs without near-ties).
"""

from __future__ import annotations

import torch

from specdec.sampling.processing import RowParam
from specdec.verify.reference import (
    VERIFY_METHODS,
    ValueCheck,
    VerifyInputs,
    VerifyResult,
    check_verify_inputs,
    verify_checked_ref,
    verify_ref,
)


def verify(
    target_logits: torch.Tensor,
    draft_token_ids: torch.Tensor,
    draft_logits: torch.Tensor | None,
    seeds: torch.Tensor,
    positions: torch.Tensor,
    *,
    temperature: RowParam,
    top_k: RowParam = None,
    top_p: RowParam = None,
    min_p: RowParam = None,
    num_draft: torch.Tensor | None = None,
    method: str = "standard",
    draft_logsumexp: torch.Tensor | None = None,
    active_rows: int | None = None,
) -> VerifyResult:
    """Verifies one round of drafts per request and emits the accepted prefix plus one token.

    Args:
        target_logits: [B, K+1, V] raw target logits; row i is the distribution of the token at
            positions[b] + i (row K is the bonus row).
        draft_token_ids: [B, K] int64 drafts; entries at or beyond num_draft[b] are ignored.
        draft_logits: [B, K, V] processed logits the drafts were sampled from (what `sample`
            returned; -inf where the draft cannot go), or None for deterministic (one-hot) drafts.
        seeds: [B] int64 request seeds.
        positions: [B] int64 position of draft_token_ids[b, 0]; also the round anchor.
        temperature, top_k, top_p, min_p: scalars or [B]; processed exactly as `sample` does.
        num_draft: [B] int64 in [0, K] drafts per row (None = K); 0 means one plain sample.
        method: "standard" (Leviathan et al. 2023), "block" (Sun et al. 2024) or "coupled"
            (Daliri et al. 2024: drafts sampled with Stream.TARGET; accept iff equal).
        draft_logsumexp: optional [B, K] float32 log-normaliser of draft_logits (what `sample`
            returned as `logsumexp`); it must be exactly that, and saves a pass over the drafts.
        active_rows: rows >= active_rows are padding: they emit -1, accept nothing and draw no
            noise (None = all rows are live).

    Returns:
        VerifyResult(token_ids [B, K+1] int64 padded with -1, num_accepted [B] int64).

    RNG: ACCEPT at (Q, anchor) per draft; RESIDUAL at the first rejected Q; TARGET at the bonus
    position (and at every row for "coupled"). Keys never depend on the batch row.
    """
    inputs = check_verify_inputs(
        target_logits,
        draft_token_ids,
        draft_logits,
        seeds,
        positions,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        min_p=min_p,
        num_draft=num_draft,
        method=method,
        draft_logsumexp=draft_logsumexp,
        active_rows=active_rows,
        check_values=False,
    )
    # The value checks read their values back while the kernels run: the kernels are memory-safe
    # on any values (they clamp ids and counts), and nothing is returned before the checks pass.
    # Filtering rows first compute thresholds from the parameters, so those wait for the checks.
    check = ValueCheck(
        draft_token_ids,
        draft_logits,
        positions,
        inputs.num_draft,
        inputs.params,
        method,
        inputs.active_rows,
        target_logits.shape[-1],
    )
    params = inputs.params
    if not target_logits.is_cuda or any(
        t is not None for t in (params.top_k, params.top_p, params.min_p)
    ):
        check.wait()
    result = verify_checked(inputs)
    check.wait()
    return result


def verify_checked(inputs: VerifyInputs) -> VerifyResult:
    """`verify` on inputs already built by `check_verify_inputs`: the fused Triton kernels on
    CUDA, the PyTorch twin elsewhere."""
    if inputs.target_logits.is_cuda:
        from specdec.verify.triton_verify import verify_triton

        return verify_triton(inputs)
    return verify_checked_ref(inputs)


__all__ = [
    "VERIFY_METHODS",
    "ValueCheck",
    "VerifyInputs",
    "VerifyResult",
    "check_verify_inputs",
    "verify",
    "verify_checked",
    "verify_checked_ref",
    "verify_ref",
]
