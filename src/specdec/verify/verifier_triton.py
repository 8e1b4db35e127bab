"""Fused Triton `verify`: the GPU twin of `specdec.verify.verifier.verify_checked_ref`. The launch
of the passes in `verifier_kernels.py` (their pipeline is described there): workspaces, the
top-k/top-p/min-p thresholds of the target rows, the tile plans and the grids. Never creates
noise itself.
"""

from __future__ import annotations

import torch
import triton

from specdec.sampling.processing import filter_threshold, scale_logits
from specdec.sampling.sampler_triton import chunk_plan
from specdec.verify.inputs import VerifyInputs, VerifyResult
from specdec.verify.verifier_kernels import (
    _verify_accept_kernel,
    _verify_block_mass_kernel,
    _verify_emit_kernel,
    _verify_final_kernel,
    _verify_rows_kernel,
)

# Tile shape of the residual pass (heavier per element than the row pass: keep fewer rows live).
FINAL_PLAN = {"rows_per_thread": 2, "num_warps": 4, "tiles": 4}

_WORKSPACES: dict[tuple, dict[str, torch.Tensor]] = {}
MAX_WORKSPACES = 16


def _carve(sizes: dict[str, tuple[int, int]], dtype: torch.dtype, device: torch.device):
    """Views of one uninitialised allocation, one per named 2-D shape.

    Reused by later calls with the same sizes on the same stream (the kernels write every
    workspace cell before reading it, and stream order keeps calls apart); a fresh one while a
    CUDA graph is being captured.
    """
    cached = device.type == "cuda" and not torch.cuda.is_current_stream_capturing()
    key = (device, dtype, torch.cuda.current_stream(device).cuda_stream if cached else None)
    key += tuple(sizes.items())
    if cached and key in _WORKSPACES:
        return _WORKSPACES[key]
    total = sum(a * b for a, b in sizes.values())
    flat = torch.empty(total, dtype=dtype, device=device)
    views, offset = {}, 0
    for name, (a, b) in sizes.items():
        views[name] = flat[offset : offset + a * b].view(a, b)
        offset += a * b
    if cached:
        if len(_WORKSPACES) >= MAX_WORKSPACES:
            _WORKSPACES.clear()
        _WORKSPACES[key] = views
    return views


def _filter_threshold_rows(inputs: VerifyInputs, active: int) -> torch.Tensor | None:
    """[A * (K+1)] thresholds of the processed target rows, or None when no row filters."""
    params = inputs.params
    if params.top_k is None and params.top_p is None and params.min_p is None:
        return None
    target = inputs.target_logits[:active]
    num_rows, vocab = target.shape[1], target.shape[2]
    if not torch.cuda.is_current_stream_capturing():  # a CUDA graph reads nothing back
        used = torch.zeros((), dtype=torch.bool, device=target.device)
        if params.top_k is not None:
            used = used | ((params.top_k[:active] > 0) & (params.top_k[:active] < vocab)).any()
        if params.top_p is not None:
            used = used | (params.top_p[:active] < 1).any()
        if params.min_p is not None:
            used = used | (params.min_p[:active] > 0).any()
        if not bool(used):
            return None

    def rep(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t[:active].repeat_interleave(num_rows)

    scaled = scale_logits(target.reshape(active * num_rows, vocab), rep(params.temperature))
    return filter_threshold(scaled, rep(params.top_k), rep(params.top_p), rep(params.min_p))


def verify_triton(inputs: VerifyInputs) -> VerifyResult:
    """`verify` on validated CUDA inputs: the same outputs as `verify_checked_ref`.

    Emitted tokens are identical to the reference on inputs without near-ties (log-normalisers
    and transcendental functions round differently on the GPU); uniforms are bit-identical.

    Args:
        inputs: validated `VerifyInputs` (see `check_verify_inputs`); tensors on one CUDA device.

    Returns:
        VerifyResult(token_ids [B, K+1] int64 padded with -1, num_accepted [B] int64); rows
        >= active_rows stay -1 / 0.

    RNG: ACCEPT at (Q, anchor) per draft; RESIDUAL at the first rejected Q; TARGET at the bonus
    position (and at every row for "coupled"). Padded rows draw nothing.
    """
    target = inputs.target_logits
    batch, num_rows, vocab = target.shape
    k = num_rows - 1
    device = target.device
    active = inputs.active_rows
    if active == 0:
        token_ids = torch.full((batch, num_rows), -1, dtype=torch.int64, device=device)
        return VerifyResult(token_ids, torch.zeros(batch, dtype=torch.int64, device=device))
    # The accept kernel writes every row of both outputs (padded rows: -1 and 0).
    token_ids = torch.empty((batch, num_rows), dtype=torch.int64, device=device)
    num_accepted = torch.empty(batch, dtype=torch.int64, device=device)

    coupled = inputs.method == "coupled"
    block = inputs.method == "block"
    has_draft = inputs.draft_logits is not None and not coupled and k > 0
    draft_stats = has_draft and inputs.draft_logsumexp is None
    excl_sum = block and not has_draft and k > 0
    if target.stride(2) != 1:
        target = target.contiguous()
    draft = inputs.draft_logits if has_draft else target
    if draft.stride(2) != 1:
        draft = draft.contiguous()
    draft_lse = inputs.draft_logsumexp if has_draft and not draft_stats else None
    draft_lse = draft_lse.to(torch.float32).contiguous() if draft_lse is not None else None
    draft_ids = inputs.draft_token_ids.contiguous() if k > 0 else num_accepted
    temperature = inputs.params.temperature.contiguous()
    seeds, anchors = inputs.seeds.contiguous(), inputs.positions.contiguous()
    num_draft = inputs.num_draft.contiguous()
    threshold = _filter_threshold_rows(inputs, active)
    has_threshold = threshold is not None
    if threshold is None:
        threshold = temperature

    num_target_rows = active * num_rows
    num_stat_rows = num_target_rows + (active * k if draft_stats else 0)
    rows, tiles, num_chunks, num_warps = chunk_plan(vocab)
    final_rows, final_tiles, final_chunks, final_warps = chunk_plan(vocab, FINAL_PLAN)
    need_mass = block and has_draft and k > 1
    # Every buffer below is written before it is read (see the kernels), so none is initialised.
    f32_sizes = {
        "row_max": (num_stat_rows, num_chunks),
        "row_sum": (num_stat_rows, num_chunks),
        "row_excl": (num_target_rows if excl_sum else 1, num_chunks),
        "row_best": (num_target_rows, num_chunks),
        "row_lse": (active, 2 * k + 1),
        "row_p": (active, k + 1),
        "log_weight": (active, 1),
        "mass": (active * k if need_mass else 1, final_chunks),
        "res_best": (active, final_chunks),
        "fallback_best": (active, final_chunks),
    }
    i32_sizes = {
        "row_idx": (num_target_rows, num_chunks),
        "final_row": (active, 1),
        "res_idx": (active, final_chunks),
        "fallback_idx": (active, final_chunks),
    }
    f32 = _carve(f32_sizes, torch.float32, device)
    i32 = _carve(i32_sizes, torch.int32, device)
    row_max, row_sum, row_excl = f32["row_max"], f32["row_sum"], f32["row_excl"]
    row_best, row_lse, row_p = f32["row_best"], f32["row_lse"], f32["row_p"]
    log_weight, mass = f32["log_weight"], f32["mass"]
    row_idx, final_row = i32["row_idx"], i32["final_row"]
    strides = (target.stride(0), target.stride(1), draft.stride(0), draft.stride(1))
    _verify_rows_kernel[(num_stat_rows, num_chunks)](
        target,
        draft,
        draft_ids,
        num_draft,
        temperature,
        threshold,
        seeds,
        anchors,
        row_max,
        row_sum,
        row_excl,
        row_best,
        row_idx,
        vocab,
        *strides,
        num_chunks,
        num_target_rows,
        K=k,
        ROWS=rows,
        TILES=tiles,
        HAS_THRESHOLD=has_threshold,
        COUPLED=coupled,
        DRAFT_STATS=draft_stats,
        EXCL_SUM=excl_sum,
        num_warps=num_warps,
    )

    accept_args = (
        target,
        draft,
        draft_lse if draft_lse is not None else temperature,
        draft_ids,
        num_draft,
        temperature,
        threshold,
        seeds,
        anchors,
        row_max,
        row_sum,
        row_excl,
        row_best,
        row_idx,
        mass,
        row_lse,
        row_p,
        final_row,
        log_weight,
        token_ids,
        num_accepted,
        *strides,
        num_chunks,
        final_chunks,
        num_target_rows,
        active,
        vocab,
    )
    accept_flags = {
        "K": k,
        "K1P": triton.next_power_of_2(k + 1),
        "CHUNKS": max(16, triton.next_power_of_2(num_chunks)),
        "MASS_CHUNKS": max(16, triton.next_power_of_2(final_chunks)),
        "HAS_THRESHOLD": has_threshold,
        "COUPLED": coupled,
        "BLOCK_METHOD": block,
        "HAS_DRAFT": has_draft,
        "HAS_DRAFT_LSE": draft_lse is not None,
        "EXCL_SUM": excl_sum,
        "num_warps": 4,
    }
    if need_mass:
        prepare_flags = {**accept_flags, "HAS_MASS": False}
        _verify_accept_kernel[(active,)](*accept_args, PREPARE=True, **prepare_flags)
        _verify_block_mass_kernel[(active * k, final_chunks)](
            target,
            draft,
            num_draft,
            temperature,
            threshold,
            row_lse,
            row_p,
            mass,
            vocab,
            *strides,
            final_chunks,
            K=k,
            ROWS=final_rows,
            TILES=final_tiles,
            HAS_THRESHOLD=has_threshold,
            num_warps=final_warps,
        )
    _verify_accept_kernel[(batch,)](*accept_args, HAS_MASS=need_mass, PREPARE=False, **accept_flags)
    if coupled:
        return VerifyResult(token_ids, num_accepted)

    res_best, fallback_best = f32["res_best"], f32["fallback_best"]
    res_idx, fallback_idx = i32["res_idx"], i32["fallback_idx"]
    _verify_final_kernel[(active, final_chunks)](
        target,
        draft,
        draft_ids,
        num_draft,
        temperature,
        threshold,
        seeds,
        anchors,
        row_lse,
        final_row,
        log_weight,
        res_best,
        res_idx,
        fallback_best,
        fallback_idx,
        vocab,
        *strides,
        final_chunks,
        K=k,
        ROWS=final_rows,
        TILES=final_tiles,
        HAS_THRESHOLD=has_threshold,
        HAS_DRAFT=has_draft,
        num_warps=final_warps,
    )
    _verify_emit_kernel[(active,)](
        final_row,
        res_best,
        res_idx,
        fallback_best,
        fallback_idx,
        token_ids,
        final_chunks,
        active,
        K=k,
        CHUNKS=max(16, triton.next_power_of_2(final_chunks)),
        num_warps=1,
    )
    return VerifyResult(token_ids, num_accepted)
