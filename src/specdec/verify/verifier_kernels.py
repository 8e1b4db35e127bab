"""The Triton kernels of the fused `verify` (launched by `verifier_triton.verify_triton`, the GPU
twin of `specdec.verify.verifier.verify_checked_ref`).

Pipeline (each pass is a grid over (row or request, vocabulary chunk), so B = 1 fills the GPU):
1. `_verify_rows_kernel`, one read of every live row: per-chunk max / sum-exp of the processed
   target rows 0..n-1 of sampled requests and of their draft rows (skipped when
   `draft_logsumexp` is given); per-chunk argmax of greedy rows and per-chunk Gumbel argmax
   (Stream.TARGET) of coupled rows;
2. `_verify_accept_kernel`, one program per request: log-normalisers, target / draft at the
   drafts, ACCEPT uniforms, the sequential decisions, emitted drafts; block verification with
   sampled drafts first needs `_verify_block_mass_kernel` (the residual masses S_i: one more pass
   over rows 1..n-1);
3. `_verify_final_kernel`, sampled standard / block requests only: Gumbel argmax over the residual
   row (Stream.RESIDUAL) at a rejection, or over the bonus row (Stream.TARGET) after a full chain;
4. `_verify_emit_kernel`: reduce it and write the final token.
Padded requests (>= active_rows) are never read or written. Never creates noise itself.
"""

from __future__ import annotations

import triton
import triton.language as tl

from specdec.rng import Stream
from specdec.rng.philox_triton import exp_f32, gumbel_tile, lane0_uniform, log_f32, neg_log1p_neg
from specdec.sampling.sampler_triton import (
    argmax_finish,
    argmax_update,
    lse_finish,
    lse_update,
    processed_tile,
    tile_lanes,
)

STREAM_TARGET: tl.constexpr = tl.constexpr(int(Stream.TARGET))
STREAM_ACCEPT: tl.constexpr = tl.constexpr(int(Stream.ACCEPT))
STREAM_RESIDUAL: tl.constexpr = tl.constexpr(int(Stream.RESIDUAL))


@triton.jit
def combine_chunks(chunk_max, chunk_sum, AXIS: tl.constexpr):
    """log(sum_c chunk_sum[c] * exp(chunk_max[c])) along AXIS (-inf for an all -inf row)."""
    row_max = tl.max(chunk_max, axis=AXIS)
    ref = tl.where(row_max == float("-inf"), 0.0, row_max)
    total = tl.sum(chunk_sum * tl.exp(chunk_max - tl.expand_dims(ref, AXIS)), axis=AXIS)
    return ref + tl.log(total)


@triton.jit
def load_num_draft(num_draft_ptr, b, K: tl.constexpr):
    """num_draft[b] clamped to [0, K]: with the drafts clamped to [0, V), the kernels stay in
    bounds on values not yet checked (`verify` checks them while the kernels run)."""
    return tl.minimum(tl.maximum(tl.load(num_draft_ptr + b), 0), K)


@triton.jit
def _verify_rows_kernel(
    target_ptr,  # [B, K+1, V] raw target logits, unit stride along V
    draft_ptr,  # [B, K, V] processed draft logits, unit stride along V (read when DRAFT_STATS)
    draft_ids_ptr,  # [B, K] int64
    num_draft_ptr,  # [B] int64
    temperature_ptr,  # [B] float32
    threshold_ptr,  # [A * (K+1)] float32 (read when HAS_THRESHOLD)
    seeds_ptr,  # [B] int64
    positions_ptr,  # [B] int64 round anchors
    row_max_ptr,  # [A * (K+1) + A * K, C] float32 out: chunk max (target rows, then draft rows)
    row_sum_ptr,  # [A * (K+1) + A * K, C] float32 out: chunk sum of exp(x - chunk max)
    row_excl_ptr,  # [A * (K+1), C] float32 out: the same sum without the row's draft (EXCL_SUM)
    row_best_ptr,  # [A * (K+1), C] float32 out: chunk max of processed (+ TARGET noise)
    row_idx_ptr,  # [A * (K+1), C] int32 out: its lowest id
    vocab,
    target_stride_b,
    target_stride_i,
    draft_stride_b,
    draft_stride_i,
    num_chunks,
    num_target_rows,
    K: tl.constexpr,
    ROWS: tl.constexpr,
    TILES: tl.constexpr,
    HAS_THRESHOLD: tl.constexpr,
    COUPLED: tl.constexpr,
    DRAFT_STATS: tl.constexpr,
    EXCL_SUM: tl.constexpr,
):
    r = tl.program_id(0)
    chunk = tl.program_id(1)
    chunk_first = chunk * TILES * (4 * ROWS)
    out = r.to(tl.int64) * num_chunks + chunk
    if r < num_target_rows:
        b = (r // (K + 1)).to(tl.int64)
        i = r % (K + 1)
        n = load_num_draft(num_draft_ptr, b, K)
        temperature = tl.load(temperature_ptr + b)
        sampled = temperature > 0.0
        divisor = tl.where(sampled, temperature, 1.0)
        threshold = float("-inf")
        if HAS_THRESHOLD:
            threshold = tl.load(threshold_ptr + r)
        row_ptr = target_ptr + b * target_stride_b + i * target_stride_i
        if sampled & (i < n) & (not COUPLED):
            # Rows 0..n-1 of a sampled request: chunk statistics of the log-normaliser.
            draft_id = -1
            if EXCL_SUM:
                draft_id = tl.load(draft_ids_ptr + b * K + i).to(tl.int32)
            run_max = tl.full([ROWS], float("-inf"), tl.float32)
            run_sum = tl.zeros([ROWS], tl.float32)
            run_excl = tl.zeros([ROWS], tl.float32)
            for t in tl.static_range(TILES):
                lanes = tile_lanes(chunk_first + t * (4 * ROWS), ROWS)
                x = processed_tile(row_ptr, lanes, vocab, divisor, threshold, HAS_THRESHOLD)
                new_max = tl.maximum(run_max, tl.max(x, axis=1))
                ref = tl.where(new_max == float("-inf"), 0.0, new_max)
                scale = tl.exp(run_max - ref)
                e = tl.exp(x - ref[:, None])
                run_sum = run_sum * scale + tl.sum(e, axis=1)
                if EXCL_SUM:
                    excl = tl.sum(tl.where(lanes == draft_id, 0.0, e), axis=1)
                    run_excl = run_excl * scale + excl
                run_max = new_max
            chunk_max, chunk_sum = lse_finish(run_max, run_sum)
            tl.store(row_max_ptr + out, chunk_max)
            tl.store(row_sum_ptr + out, chunk_sum)
            if EXCL_SUM:
                _, chunk_excl = lse_finish(run_max, run_excl)
                tl.store(row_excl_ptr + out, chunk_excl)
        argmax_request = temperature == 0.0  # greedy; coupled requests take every row's argmax
        if COUPLED:
            argmax_request = temperature >= 0.0
        if (i <= n) & argmax_request:
            # Rows 0..n of greedy requests (argmax) and of coupled ones (TARGET Gumbel argmax).
            seed = tl.load(seeds_ptr + b)
            position = tl.load(positions_ptr + b) + i
            best = tl.full([ROWS], float("-inf"), tl.float32)
            best_idx = chunk_first + 4 * tl.arange(0, ROWS)
            for t in tl.static_range(TILES):
                first_lane = chunk_first + t * (4 * ROWS)
                lanes = tile_lanes(first_lane, ROWS)
                x = processed_tile(row_ptr, lanes, vocab, divisor, threshold, HAS_THRESHOLD)
                if sampled:
                    x += gumbel_tile(seed, position, STREAM_TARGET, 0, first_lane // 4, ROWS)
                best, best_idx = argmax_update(best, best_idx, x, lanes)
            top, top_idx = argmax_finish(best, best_idx)
            tl.store(row_best_ptr + out, top)
            tl.store(row_idx_ptr + out, top_idx)
    else:
        if DRAFT_STATS:
            rd = r - num_target_rows
            b = (rd // K).to(tl.int64)
            i = rd % K
            n = load_num_draft(num_draft_ptr, b, K)
            temperature = tl.load(temperature_ptr + b)
            if (temperature > 0.0) & (i < n):
                row_ptr = draft_ptr + b * draft_stride_b + i * draft_stride_i
                run_max = tl.full([ROWS], float("-inf"), tl.float32)
                run_sum = tl.zeros([ROWS], tl.float32)
                for t in tl.static_range(TILES):
                    lanes = tile_lanes(chunk_first + t * (4 * ROWS), ROWS)
                    x = tl.load(row_ptr + lanes, mask=lanes < vocab, other=float("-inf"))
                    run_max, run_sum = lse_update(run_max, run_sum, x.to(tl.float32))
                chunk_max, chunk_sum = lse_finish(run_max, run_sum)
                tl.store(row_max_ptr + out, chunk_max)
                tl.store(row_sum_ptr + out, chunk_sum)


@triton.jit
def _verify_accept_kernel(
    target_ptr,  # [B, K+1, V] raw target logits
    draft_ptr,  # [B, K, V] processed draft logits (read when HAS_DRAFT)
    draft_lse_ptr,  # [B, K] float32 draft log-normalisers (read when HAS_DRAFT_LSE)
    draft_ids_ptr,  # [B, K] int64
    num_draft_ptr,  # [B] int64
    temperature_ptr,  # [B] float32
    threshold_ptr,  # [A * (K+1)] float32 (read when HAS_THRESHOLD)
    seeds_ptr,  # [B] int64
    positions_ptr,  # [B] int64 round anchors
    row_max_ptr,  # [A * (K+1) + A * K, C1] float32 (from _verify_rows_kernel)
    row_sum_ptr,  # [A * (K+1) + A * K, C1] float32
    row_excl_ptr,  # [A * (K+1), C1] float32 (EXCL_SUM)
    row_best_ptr,  # [A * (K+1), C1] float32
    row_idx_ptr,  # [A * (K+1), C1] int32
    mass_ptr,  # [A * K, C2] float32 block residual masses per chunk (HAS_MASS)
    row_lse_ptr,  # [A, 2K+1] float32 out: target log-normalisers, then draft ones
    row_p_ptr,  # [A, K+1] float32 out: block p_i (PREPARE)
    final_row_ptr,  # [A] int32 out: row of the residual still to sample, or -1
    log_weight_ptr,  # [A] float32 out: log p_tau of that residual (0 for standard)
    token_ids_ptr,  # [B, K+1] int64 out
    num_accepted_ptr,  # [B] int64 out
    target_stride_b,
    target_stride_i,
    draft_stride_b,
    draft_stride_i,
    num_chunks,
    num_mass_chunks,
    num_target_rows,
    active_rows,
    vocab,
    K: tl.constexpr,
    K1P: tl.constexpr,  # power of two > K
    CHUNKS: tl.constexpr,  # power of two >= num_chunks
    MASS_CHUNKS: tl.constexpr,  # power of two >= num_mass_chunks
    HAS_THRESHOLD: tl.constexpr,
    COUPLED: tl.constexpr,
    BLOCK_METHOD: tl.constexpr,
    HAS_DRAFT: tl.constexpr,
    HAS_DRAFT_LSE: tl.constexpr,
    EXCL_SUM: tl.constexpr,
    HAS_MASS: tl.constexpr,
    PREPARE: tl.constexpr,  # block with sampled drafts, first call: write p_i and stop
):
    b = tl.program_id(0).to(tl.int64)
    if b >= active_rows:
        if not PREPARE:  # a padded row: emits nothing (its outputs are not initialised)
            pad = tl.arange(0, K1P)
            tl.store(token_ids_ptr + b * (K + 1) + pad, tl.full([K1P], -1, tl.int64), pad <= K)
            tl.store(num_accepted_ptr + b, b * 0)
        return
    n = load_num_draft(num_draft_ptr, b, K)
    temperature = tl.load(temperature_ptr + b)
    sampled = temperature > 0.0
    seed = tl.load(seeds_ptr + b)
    anchor = tl.load(positions_ptr + b)
    rows = tl.arange(0, K1P)  # row i of the round (draft i for i < K, bonus row K)
    in_chain = rows < n
    chunks = tl.arange(0, CHUNKS)
    chunk_mask = chunks[None, :] < num_chunks
    target_rows = b * (K + 1) + rows
    drafts = tl.load(draft_ids_ptr + b * K + rows, mask=in_chain, other=0)
    drafts = tl.minimum(tl.maximum(drafts, 0), vocab - 1)

    # Argmax rows (greedy rows, coupled rows, the bonus row): combine the chunks; ties -> low id.
    argmax_request = temperature == 0.0  # greedy; coupled requests take every row's argmax
    if COUPLED:
        argmax_request = temperature >= 0.0
    argmax_rows = rows <= tl.where(argmax_request, n, -1)
    live = argmax_rows[:, None] & chunk_mask
    cells = target_rows[:, None] * num_chunks + chunks[None, :]
    best = tl.load(row_best_ptr + cells, mask=live, other=float("-inf"))
    row_top = tl.max(best, axis=1)
    first = tl.min(tl.where((best == row_top[:, None]) & chunk_mask, chunks[None, :], CHUNKS), 1)
    first = tl.minimum(first, num_chunks - 1)
    row_token = tl.load(row_idx_ptr + target_rows * num_chunks + first, mask=argmax_rows, other=-1)
    matched = (drafts == row_token) & in_chain
    accepted = tl.min(tl.where(matched, K1P, rows))  # leading matches (greedy and coupled)
    log_weight = temperature * 0.0
    if not COUPLED:  # noqa: SIM102 (compile-time branch around a runtime one)
        if sampled:
            # Log-probabilities of the target (and draft) at the drafts.
            stat_mask = in_chain[:, None] & chunk_mask
            cells = target_rows[:, None] * num_chunks + chunks[None, :]
            t_max = tl.load(row_max_ptr + cells, mask=stat_mask, other=float("-inf"))
            t_sum = tl.load(row_sum_ptr + cells, mask=stat_mask, other=0.0)
            target_lse = combine_chunks(t_max, t_sum, 1)
            divisor = tl.where(sampled, temperature, 1.0)
            target_at = tl.load(
                target_ptr + b * target_stride_b + rows * target_stride_i + drafts,
                mask=in_chain,
                other=0.0,
            ).to(tl.float32)
            target_at = tl.math.div_rn(target_at, divisor)
            if HAS_THRESHOLD:
                threshold = tl.load(threshold_ptr + target_rows, mask=in_chain, other=0.0)
                target_at = tl.where(target_at < threshold, float("-inf"), target_at)
            target_logp = tl.where(in_chain, target_at - target_lse, 0.0)
            draft_lse = tl.zeros([K1P], dtype=tl.float32)
            draft_logp = tl.zeros([K1P], dtype=tl.float32)
            if HAS_DRAFT:
                if HAS_DRAFT_LSE:
                    draft_lse = tl.load(draft_lse_ptr + b * K + rows, mask=in_chain, other=0.0)
                else:
                    draft_cells = (num_target_rows + b * K + rows)[:, None] * num_chunks
                    d_max = tl.load(
                        row_max_ptr + draft_cells + chunks[None, :],
                        mask=stat_mask,
                        other=float("-inf"),
                    )
                    d_sum = tl.load(
                        row_sum_ptr + draft_cells + chunks[None, :], mask=stat_mask, other=0.0
                    )
                    draft_lse = combine_chunks(d_max, d_sum, 1)
                draft_at = tl.load(
                    draft_ptr + b * draft_stride_b + rows * draft_stride_i + drafts,
                    mask=in_chain,
                    other=0.0,
                ).to(tl.float32)
                draft_logp = tl.where(in_chain, draft_at - draft_lse, 0.0)
            base = b * (2 * K + 1)
            tl.store(row_lse_ptr + base + rows, target_lse, mask=rows < K)
            tl.store(row_lse_ptr + base + K + 1 + rows, draft_lse, mask=rows < K)
            if BLOCK_METHOD:
                # Sun et al. 2024, Alg. 2: p_i = min(p_{i-1} target(X_i) / draft(X_i), 1).
                step = tl.where(in_chain, target_logp - draft_logp, 0.0)
                log_p = 0.0
                log_p_rows = tl.zeros([K1P], dtype=tl.float32)
                for i in tl.static_range(K):
                    log_p = tl.minimum(log_p + tl.sum(tl.where(rows == i, step, 0.0)), 0.0)
                    log_p_rows = tl.where(rows == i + 1, log_p, log_p_rows)
                p_rows = exp_f32(log_p_rows)
                if PREPARE:
                    tl.store(row_p_ptr + b * (K + 1) + rows, p_rows, mask=rows < K + 1)
                else:
                    # S_i = sum_x max(p_i target_i(x) - draft_i(x), 0) for 1 <= i < n.
                    if HAS_MASS:
                        mass_chunks = tl.arange(0, MASS_CHUNKS)
                        mass_cells = (b * K + rows)[:, None] * num_mass_chunks + mass_chunks[
                            None, :
                        ]
                        mass_mask = in_chain[:, None] & (mass_chunks[None, :] < num_mass_chunks)
                        mass = tl.sum(tl.load(mass_ptr + mass_cells, mask=mass_mask, other=0.0), 1)
                    else:
                        # One-hot drafts: S_i = p_i (1 - target_i(X_{i+1})), the complement summed
                        # directly (over ids != the draft) so that it stays exact when small.
                        t_excl = tl.load(row_excl_ptr + cells, mask=stat_mask, other=0.0)
                        complement = tl.exp(combine_chunks(t_max, t_excl, 1) - target_lse)
                        mass = p_rows * tl.where(in_chain, complement, 0.0)
                    h = tl.where(p_rows >= 1.0, 1.0, mass / (mass + 1.0 - p_rows))
                    h = tl.where(rows < n, h, p_rows)
                    eta = lane0_uniform(seed, anchor + rows - 1, STREAM_ACCEPT, anchor)
                    ok = (eta < h) & (rows >= 1) & (rows <= n)
                    tau = tl.max(tl.where(ok, rows, 0))
                    log_weight = tl.sum(tl.where(rows == tau, log_p_rows, 0.0))
                    accepted = tau
            else:
                # Leviathan et al. 2023, Alg. 1: accept draft i iff u_i draft(x_i) < target(x_i).
                u = lane0_uniform(seed, anchor + rows, STREAM_ACCEPT, anchor)
                accept = (log_f32(u) + draft_logp < target_logp) & in_chain
                accepted = tl.min(tl.where(accept, K1P, rows))
    if not PREPARE:
        # A sampled request samples its final token in the next pass (the residual at a
        # rejection, the bonus row after a full chain); greedy and coupled ones know it already.
        final_row = tl.where(sampled & (not COUPLED), accepted, -1)
        final = tl.sum(tl.where(rows == accepted, row_token, 0))
        tokens = tl.where(rows < accepted, drafts, -1)
        tokens = tl.where((rows == accepted) & (final_row < 0), final, tokens)
        tl.store(token_ids_ptr + b * (K + 1) + rows, tokens, mask=rows < K + 1)
        tl.store(num_accepted_ptr + b, accepted.to(tl.int64))
        tl.store(final_row_ptr + b, final_row)
        tl.store(log_weight_ptr + b, log_weight)


@triton.jit
def _verify_block_mass_kernel(
    target_ptr,  # [B, K+1, V] raw target logits
    draft_ptr,  # [B, K, V] processed draft logits
    num_draft_ptr,  # [B] int64
    temperature_ptr,  # [B] float32
    threshold_ptr,  # [A * (K+1)] float32 (read when HAS_THRESHOLD)
    row_lse_ptr,  # [A, 2K+1] float32 target then draft log-normalisers
    row_p_ptr,  # [A, K+1] float32 block p_i
    mass_ptr,  # [A * K, C] float32 out: chunk sums of max(p_i target_i - draft_i, 0)
    vocab,
    target_stride_b,
    target_stride_i,
    draft_stride_b,
    draft_stride_i,
    num_chunks,
    K: tl.constexpr,
    ROWS: tl.constexpr,
    TILES: tl.constexpr,
    HAS_THRESHOLD: tl.constexpr,
):
    r = tl.program_id(0)
    chunk = tl.program_id(1)
    b = (r // K).to(tl.int64)
    i = r % K
    n = load_num_draft(num_draft_ptr, b, K)
    temperature = tl.load(temperature_ptr + b)
    if (temperature > 0.0) & (i >= 1) & (i < n):
        p = tl.load(row_p_ptr + b * (K + 1) + i)
        target_lse = tl.load(row_lse_ptr + b * (2 * K + 1) + i)
        draft_lse = tl.load(row_lse_ptr + b * (2 * K + 1) + K + 1 + i)
        threshold = float("-inf")
        if HAS_THRESHOLD:
            threshold = tl.load(threshold_ptr + b * (K + 1) + i)
        target_row = target_ptr + b * target_stride_b + i * target_stride_i
        draft_row = draft_ptr + b * draft_stride_b + i * draft_stride_i
        chunk_first = chunk * TILES * (4 * ROWS)
        mass = tl.zeros([ROWS], tl.float32)
        for t in tl.static_range(TILES):
            lanes = tile_lanes(chunk_first + t * (4 * ROWS), ROWS)
            x = processed_tile(target_row, lanes, vocab, temperature, threshold, HAS_THRESHOLD)
            d = tl.load(draft_row + lanes, mask=lanes < vocab, other=float("-inf"))
            excess = p * tl.exp(x - target_lse) - tl.exp(d.to(tl.float32) - draft_lse)
            mass += tl.sum(tl.maximum(excess, 0.0), axis=1)
        tl.store(mass_ptr + r.to(tl.int64) * num_chunks + chunk, tl.sum(mass))


@triton.jit
def _verify_final_kernel(
    target_ptr,  # [B, K+1, V] raw target logits
    draft_ptr,  # [B, K, V] processed draft logits (read when HAS_DRAFT)
    draft_ids_ptr,  # [B, K] int64
    num_draft_ptr,  # [B] int64
    temperature_ptr,  # [B] float32
    threshold_ptr,  # [A * (K+1)] float32 (read when HAS_THRESHOLD)
    seeds_ptr,  # [B] int64
    positions_ptr,  # [B] int64 round anchors
    row_lse_ptr,  # [A, 2K+1] float32
    final_row_ptr,  # [A] int32 row of the final token (residual if < num_draft, else bonus), or -1
    log_weight_ptr,  # [A] float32
    res_best_ptr,  # [A, C] float32 out: chunk max of log residual + RESIDUAL noise (or bonus)
    res_idx_ptr,  # [A, C] int32 out
    fallback_best_ptr,  # [A, C] float32 out: chunk max of target log-prob + the same noise
    fallback_idx_ptr,  # [A, C] int32 out
    vocab,
    target_stride_b,
    target_stride_i,
    draft_stride_b,
    draft_stride_i,
    num_chunks,
    K: tl.constexpr,
    ROWS: tl.constexpr,
    TILES: tl.constexpr,
    HAS_THRESHOLD: tl.constexpr,
    HAS_DRAFT: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    j = tl.load(final_row_ptr + b)
    if j >= 0:
        n = load_num_draft(num_draft_ptr, b, K)
        temperature = tl.load(temperature_ptr + b)
        seed = tl.load(seeds_ptr + b)
        position = tl.load(positions_ptr + b) + j
        threshold = float("-inf")
        if HAS_THRESHOLD:
            threshold = tl.load(threshold_ptr + b * (K + 1) + j)
        target_row = target_ptr + b * target_stride_b + j * target_stride_i
        chunk_first = chunk * TILES * (4 * ROWS)
        out = b * num_chunks + chunk
        best = tl.full([ROWS], float("-inf"), tl.float32)
        best_idx = chunk_first + 4 * tl.arange(0, ROWS)
        if j < n:
            # The first rejection: log max(w target - draft, 0) + RESIDUAL noise, plus the
            # reference's fallback (target + the same noise) for a residual empty by rounding.
            log_weight = tl.load(log_weight_ptr + b)
            target_lse = tl.load(row_lse_ptr + b * (2 * K + 1) + j)
            draft_lse = tl.load(row_lse_ptr + b * (2 * K + 1) + K + 1 + j)
            draft_id = tl.load(draft_ids_ptr + b * K + j).to(tl.int32)
            draft_row = draft_ptr + b * draft_stride_b + j * draft_stride_i
            fallback = tl.full([ROWS], float("-inf"), tl.float32)
            fallback_idx = chunk_first + 4 * tl.arange(0, ROWS)
            for t in tl.static_range(TILES):
                first_lane = chunk_first + t * (4 * ROWS)
                lanes = tile_lanes(first_lane, ROWS)
                x = processed_tile(target_row, lanes, vocab, temperature, threshold, HAS_THRESHOLD)
                target_logp = x - target_lse
                if HAS_DRAFT:
                    d = tl.load(draft_row + lanes, mask=lanes < vocab, other=float("-inf"))
                    draft_logp = d.to(tl.float32) - draft_lse
                else:
                    draft_logp = tl.where(lanes == draft_id, 0.0, float("-inf"))
                # log(w target - draft) = a + log1p(-exp(draft - a)), a = log w + log target.
                lifted = target_logp + log_weight
                ratio = exp_f32(draft_logp - lifted)
                log_res = tl.where(
                    draft_logp < lifted, lifted - neg_log1p_neg(ratio), float("-inf")
                )
                noise = gumbel_tile(seed, position, STREAM_RESIDUAL, 0, first_lane // 4, ROWS)
                best, best_idx = argmax_update(best, best_idx, log_res + noise, lanes)
                fallback, fallback_idx = argmax_update(
                    fallback, fallback_idx, target_logp + noise, lanes
                )
            top, top_idx = argmax_finish(best, best_idx)
            fallback_top, fallback_top_idx = argmax_finish(fallback, fallback_idx)
            tl.store(res_best_ptr + out, top)
            tl.store(res_idx_ptr + out, top_idx)
            tl.store(fallback_best_ptr + out, fallback_top)
            tl.store(fallback_idx_ptr + out, fallback_top_idx)
        else:
            # A fully accepted chain: the bonus token, TARGET noise (the plain sampler's draw).
            for t in tl.static_range(TILES):
                first_lane = chunk_first + t * (4 * ROWS)
                lanes = tile_lanes(first_lane, ROWS)
                x = processed_tile(target_row, lanes, vocab, temperature, threshold, HAS_THRESHOLD)
                x += gumbel_tile(seed, position, STREAM_TARGET, 0, first_lane // 4, ROWS)
                best, best_idx = argmax_update(best, best_idx, x, lanes)
            top, top_idx = argmax_finish(best, best_idx)
            tl.store(res_best_ptr + out, top)
            tl.store(res_idx_ptr + out, top_idx)
            tl.store(fallback_best_ptr + out, top)
            tl.store(fallback_idx_ptr + out, top_idx)


@triton.jit
def _verify_emit_kernel(
    final_row_ptr,  # [A] int32 residual row, or -1
    res_best_ptr,  # [A, C] float32
    res_idx_ptr,  # [A, C] int32
    fallback_best_ptr,  # [A, C] float32
    fallback_idx_ptr,  # [A, C] int32
    token_ids_ptr,  # [B, K+1] int64 out
    num_chunks,
    active_rows,
    K: tl.constexpr,
    CHUNKS: tl.constexpr,  # power of two >= num_chunks
):
    b = tl.program_id(0).to(tl.int64)
    j = tl.load(final_row_ptr + b)
    if (j >= 0) & (b < active_rows):
        chunks = tl.arange(0, CHUNKS)
        mask = chunks < num_chunks
        res = tl.load(res_best_ptr + b * num_chunks + chunks, mask=mask, other=float("-inf"))
        top = tl.max(res)
        idx_ptr = res_idx_ptr
        if top == float("-inf"):
            # Empty residual (rounding only): the reference falls back to the target row.
            res = tl.load(
                fallback_best_ptr + b * num_chunks + chunks, mask=mask, other=float("-inf")
            )
            top = tl.max(res)
            idx_ptr = fallback_idx_ptr
        first = tl.min(tl.where((res == top) & mask, chunks, CHUNKS))
        first = tl.minimum(first, num_chunks - 1)
        token = tl.load(idx_ptr + b * num_chunks + first)
        tl.store(token_ids_ptr + b * (K + 1) + j, token.to(tl.int64))
