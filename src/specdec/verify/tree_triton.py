"""Triton tree verification: the GPU twin of `specdec.verify.tree.verify_tree_ref`.

One program per request walks its tree (the inputs are `tree.prepare_tree`'s, built in PyTorch
so that both twins start from the same bits): per visited depth it tests the children of the
current node in sibling order (ACCEPT uniform of lane = rank; standard), keeps the residual of
the rejected siblings in a [B, V] scratch row (updated by a pass over the vocabulary after each
rejection, with its log-normaliser), and ends with one Gumbel-max pass (RESIDUAL or TARGET
noise) or the argmax. Tokens equal the twin's on inputs without near-ties (the float32 exp/log
differ by ulps). Padded or dead nodes are never read. Never creates noise itself.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from specdec.rng import Stream
from specdec.rng.philox_triton import (
    exp_f32,
    gumbel_tile,
    key_words,
    log_f32,
    neg_log1p_neg,
    philox4x32_10,
    words_to_uniform32,
)
from specdec.sampling.sampler_triton import argmax_finish, argmax_update, tile_lanes
from specdec.triton_specialization import unspecialized
from specdec.verify.tree_inputs import PreparedTree, TreeVerifyResult

STREAM_TARGET: tl.constexpr = tl.constexpr(int(Stream.TARGET))
STREAM_ACCEPT: tl.constexpr = tl.constexpr(int(Stream.ACCEPT))
STREAM_RESIDUAL: tl.constexpr = tl.constexpr(int(Stream.RESIDUAL))
TILE_ROWS = 256  # a tile is TILE_ROWS x 4 lanes (the Philox lane layout)


@triton.jit
def _accept_uniform(seed, position, step, lane):
    """float32 uniform of `lane` (word lane % 4 of block lane // 4) under (seed, position,
    ACCEPT, step): `uniform(seed, position, ACCEPT, C, step=step)[:, lane]`."""
    k0, k1 = key_words(seed)
    block = tl.cast(lane // 4, tl.uint32)
    w0, w1, w2, w3 = philox4x32_10(
        block,
        tl.cast(position, tl.uint32),
        tl.cast(STREAM_ACCEPT, tl.uint32),
        tl.cast(step, tl.uint32),
        k0,
        k1,
    )
    word = lane % 4
    w = tl.where(word == 0, w0, tl.where(word == 1, w1, tl.where(word == 2, w2, w3)))
    return words_to_uniform32(w)


@triton.jit
def _noisy_argmax(
    row_ptr, vocab: tl.constexpr, seed, position, stream, NOISE: tl.constexpr, ROWS: tl.constexpr
):
    """argmax over a [V] float32 row (+ keyed Gumbel noise of `stream` at `position` when
    NOISE), lowest id on ties."""
    best = tl.full([ROWS], float("-inf"), tl.float32)
    best_idx = 4 * tl.arange(0, ROWS)
    for first_lane in range(0, vocab, 4 * ROWS):
        lanes = tile_lanes(first_lane, ROWS)
        x = tl.load(row_ptr + lanes, mask=lanes < vocab, other=float("-inf"))
        if NOISE:
            x = x + gumbel_tile(seed, position, stream, 0, first_lane // 4, ROWS)
        best, best_idx = argmax_update(best, best_idx, x, lanes)
    _, top_idx = argmax_finish(best, best_idx)
    return top_idx.to(tl.int64)


# The tree's size and children-table width vary from round to round (a shorter tree near a
# request's length limit, best-first trees' widest node): runtime bounds, so that one compiled
# variant serves every tree instead of one compile (0.2-0.5 s) per new (N, C).
@triton.jit(**unspecialized(ints=("N", "C")))
def _tree_walk_kernel(
    target_ptr,  # [B, N+1, V] float32 processed target logits, contiguous
    logp_ptr,  # [B, N+1, V] float32 target log-probabilities, contiguous
    draft_ptr,  # [B, N, V] float32 processed draft logits, contiguous (read when DRAFT_LOGITS)
    draft_lse_ptr,  # [B, N] float32 their log-normalisers (read when DRAFT_LOGITS)
    tokens_ptr,  # [B, N] int64 node tokens
    children_ptr,  # [B, N+1, C] int64 children table, -1 padded
    greedy_ptr,  # [B] int8 rows at temperature 0
    seeds_ptr,  # [B] int64
    anchors_ptr,  # [B] int64 round anchors
    residual_ptr,  # [B, V] float32 scratch: the residual's log-weights
    out_tokens_ptr,  # [B, N+1] int64 out, pre-filled with -1
    out_nodes_ptr,  # [B, N] int64 out, pre-filled with -1
    out_accepted_ptr,  # [B] int64 out
    N,  # nodes (runtime)
    C,  # children-table width (runtime)
    vocab: tl.constexpr,
    COUPLED: tl.constexpr,
    DRAFT_LOGITS: tl.constexpr,
    ROWS: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    seed = tl.load(seeds_ptr + b)
    anchor = tl.load(anchors_ptr + b)
    greedy = tl.load(greedy_ptr + b).to(tl.int32)
    res_row = residual_ptr + b * vocab
    staged = residual_ptr + (tl.num_programs(0) + b) * vocab  # the next residual, staged
    current = b * 0  # int64 table row of the visited node (0 = the round's input token)
    accepted = 0
    walking = 1
    # While loops: runtime bounds (Triton's interpreter cannot take a runtime `range` bound);
    # the walk stops at its first node without an accepted child.
    depth = 0
    while (depth <= N) & (walking != 0):
        position = anchor + depth
        node_off = (b * (N + 1) + current) * vocab
        if COUPLED:
            if greedy != 0:
                choice = _noisy_argmax(target_ptr + node_off, vocab, seed, position, 0, False, ROWS)
            else:
                choice = _noisy_argmax(
                    target_ptr + node_off, vocab, seed, position, STREAM_TARGET, True, ROWS
                )
        else:
            choice = _noisy_argmax(logp_ptr + node_off, vocab, seed, position, 0, False, ROWS)
        log_norm = 0.0
        in_scratch = 0  # the residual is still the target row (no scratch copy yet)
        rejected_any = 0
        moved = 0
        next_row = current
        rank = 0
        while rank < C:
            child = tl.load(children_ptr + (b * (N + 1) + current) * C + rank)
            if (moved == 0) & (child >= 0):
                token = tl.load(tokens_ptr + b * N + child)
                accept = (token == choice).to(tl.int32)  # coupled and greedy rows
                if not COUPLED:  # noqa: SIM102 - a compile-time branch around a runtime one
                    if greedy == 0:
                        accept, log_norm, in_scratch = _try_child(
                            logp_ptr + node_off,
                            draft_ptr,
                            draft_lse_ptr,
                            res_row,
                            staged,
                            b * N + child,
                            token,
                            seed,
                            position,
                            anchor,
                            rank,
                            log_norm,
                            in_scratch,
                            vocab,
                            DRAFT_LOGITS,
                            ROWS,
                        )
                        if accept == 0:
                            rejected_any = 1
                if accept != 0:
                    moved = 1
                    next_row = child + 1
            rank += 1
        if moved != 0:
            node = next_row - 1
            token = tl.load(tokens_ptr + b * N + node)
            tl.store(out_tokens_ptr + b * (N + 1) + accepted, token)
            tl.store(out_nodes_ptr + b * N + accepted, node.to(tl.int64))
            accepted += 1
            current = next_row
        else:
            final = choice
            if not COUPLED:  # noqa: SIM102 - a compile-time branch around a runtime one
                if greedy == 0:
                    if rejected_any != 0:
                        final = _noisy_argmax(
                            res_row, vocab, seed, position, STREAM_RESIDUAL, True, ROWS
                        )
                    else:
                        final = _noisy_argmax(
                            target_ptr + node_off,
                            vocab,
                            seed,
                            position,
                            STREAM_TARGET,
                            True,
                            ROWS,
                        )
            tl.store(out_tokens_ptr + b * (N + 1) + accepted, final)
            walking = 0
        depth += 1
    tl.store(out_accepted_ptr + b, accepted)


@triton.jit
def _try_child(
    node_logp_ptr,  # [V] the visited node's target log-probabilities
    draft_ptr,
    draft_lse_ptr,
    res_row,  # [V] scratch: the residual's log-weights once in_scratch
    staged,  # [V] scratch for the next residual
    draft_index,  # b * N + child
    token,
    seed,
    position,
    anchor,
    rank,
    log_norm,
    in_scratch,
    vocab: tl.constexpr,
    DRAFT_LOGITS: tl.constexpr,
    ROWS: tl.constexpr,
):
    """Recursive rejection of one child: accept with prob. min(1, r(x) / draft(x)) (ACCEPT
    uniform of lane `rank`); on rejection r <- max(r - draft, 0) with its log-normaliser (an
    empty result, rounding only, keeps the old r as the twin does). Returns (accept as int32,
    log_norm, in_scratch)."""
    if in_scratch != 0:  # noqa: SIM108 - Triton branches, not a ternary
        at = tl.load(res_row + token)
    else:
        at = tl.load(node_logp_ptr + token)
    target_at = at - log_norm
    draft_at = 0.0
    lse = 0.0
    if DRAFT_LOGITS:
        lse = tl.load(draft_lse_ptr + draft_index)
        draft_at = tl.load(draft_ptr + draft_index * vocab + token) - lse
    u = _accept_uniform(seed, position, anchor, rank)
    accept = (log_f32(u) + draft_at < target_at).to(tl.int32)
    if accept == 0:
        run_max = tl.full([ROWS], float("-inf"), tl.float32)
        run_sum = tl.zeros([ROWS], tl.float32)
        for first_lane in range(0, vocab, 4 * ROWS):
            lanes = tile_lanes(first_lane, ROWS)
            valid = lanes < vocab
            if in_scratch != 0:
                r = tl.load(res_row + lanes, mask=valid, other=float("-inf"))
            else:
                r = tl.load(node_logp_ptr + lanes, mask=valid, other=float("-inf"))
            if DRAFT_LOGITS:
                d = tl.load(
                    draft_ptr + draft_index * vocab + lanes, mask=valid, other=float("-inf")
                )
                d = d - lse
            else:
                d = tl.where(lanes == token, 0.0, float("-inf"))
            lifted = r - log_norm
            ratio = exp_f32(d - lifted)
            new = tl.where(d < lifted, lifted - neg_log1p_neg(ratio), float("-inf"))
            tl.store(staged + lanes, new, mask=valid)
            new_max = tl.maximum(run_max, tl.max(new, axis=1))
            ref = tl.where(new_max == float("-inf"), 0.0, new_max)
            run_sum = run_sum * exp_f32(run_max - ref) + tl.sum(exp_f32(new - ref[:, None]), axis=1)
            run_max = new_max
        row_max = tl.max(run_max)
        if row_max != float("-inf"):
            for first_lane in range(0, vocab, 4 * ROWS):
                lanes = tile_lanes(first_lane, ROWS)
                valid = lanes < vocab
                tl.store(res_row + lanes, tl.load(staged + lanes, mask=valid), mask=valid)
            log_norm = _row_lse(res_row, vocab, ROWS)
        else:
            if in_scratch == 0:  # keep the target row as the residual, in the scratch
                for first_lane in range(0, vocab, 4 * ROWS):
                    lanes = tile_lanes(first_lane, ROWS)
                    valid = lanes < vocab
                    tl.store(
                        res_row + lanes, tl.load(node_logp_ptr + lanes, mask=valid), mask=valid
                    )
            log_norm = _row_lse(res_row, vocab, ROWS)
        in_scratch = 1
    return accept, log_norm, in_scratch


@triton.jit
def _row_lse(row_ptr, vocab: tl.constexpr, ROWS: tl.constexpr):
    """log sum exp of a [V] float32 row (-inf rows give -inf)."""
    run_max = tl.full([ROWS], float("-inf"), tl.float32)
    run_sum = tl.zeros([ROWS], tl.float32)
    for first_lane in range(0, vocab, 4 * ROWS):
        lanes = tile_lanes(first_lane, ROWS)
        x = tl.load(row_ptr + lanes, mask=lanes < vocab, other=float("-inf"))
        new_max = tl.maximum(run_max, tl.max(x, axis=1))
        ref = tl.where(new_max == float("-inf"), 0.0, new_max)
        run_sum = run_sum * exp_f32(run_max - ref) + tl.sum(exp_f32(x - ref[:, None]), axis=1)
        run_max = new_max
    row_max = tl.max(run_max)
    ref = tl.where(row_max == float("-inf"), 0.0, row_max)
    return ref + log_f32(tl.sum(run_sum * exp_f32(run_max - ref)))


def verify_tree_triton(prepared: PreparedTree) -> TreeVerifyResult:
    """`verify_tree_ref` on the GPU: one program per request (same inputs, same result)."""
    target = prepared.target.contiguous()
    batch, num_rows, vocab = target.shape
    n = num_rows - 1
    device = target.device
    out_tokens = torch.full((batch, n + 1), -1, dtype=torch.int64, device=device)
    out_nodes = torch.full((batch, max(n, 0)), -1, dtype=torch.int64, device=device)
    out_accepted = torch.zeros(batch, dtype=torch.int64, device=device)
    if batch == 0:
        return TreeVerifyResult(out_tokens, out_accepted, out_nodes)
    residual = torch.empty(2 * batch, vocab, dtype=torch.float32, device=device)
    has_draft = prepared.draft_logits is not None
    draft = prepared.draft_logits.contiguous() if has_draft else target
    draft_lse = prepared.draft_lse.contiguous() if has_draft else prepared.seeds
    rows = TILE_ROWS
    while rows > 32 and 4 * rows > vocab:
        rows //= 2
    _tree_walk_kernel[(batch,)](
        target,
        prepared.target_logp.contiguous(),
        draft,
        draft_lse,
        prepared.tokens.contiguous(),
        prepared.children.contiguous(),
        prepared.greedy.to(torch.int8),
        prepared.seeds,
        prepared.anchors,
        residual,
        out_tokens,
        out_nodes,
        out_accepted,
        n,
        prepared.children.shape[2],
        vocab=vocab,
        COUPLED=prepared.method == "coupled",
        DRAFT_LOGITS=has_draft,
        ROWS=rows,
        num_warps=4,
    )
    return TreeVerifyResult(out_tokens, out_accepted, out_nodes)
