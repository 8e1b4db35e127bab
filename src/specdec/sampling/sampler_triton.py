"""Fused Triton `sample`: the GPU twin of `specdec.sampling.sampler.sample_ref`.

Pipeline (one pass over the logits, grid over (row, vocabulary chunk) so one row fills the GPU):
1. top-k / top-p / min-p thresholds from the torch `filter_threshold`, only when a row filters;
2. `_sample_chunk_kernel`: scale (IEEE division, bit-identical to `logits.float() / T`), mask
   below the threshold, write the processed logits, online max / sum-exp, add keyed Gumbel noise
   (times 0 on greedy rows), per-chunk argmax (ties -> lowest id);
3. `_sample_reduce_kernel`: combine the chunks into the token and the log-normaliser.
The per-row argument rules are evaluated by one small kernel queued before these
(`checks_triton.SampleRuleBits`) and its word is read back by an asynchronous copy, so the host
waits for that copy only; for invalid arguments it returns None and `sample` hands them to
`sample_ref`, which raises its error.
Never creates noise itself: it evaluates `specdec.rng` keys through `philox_triton`.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from specdec.rng import Stream
from specdec.rng.draws import MAX_COUNTER_WORD, _key_tensor
from specdec.rng.philox_triton import gumbel_tile
from specdec.sampling.checks_triton import SampleRuleBits
from specdec.sampling.processing import (
    RowParam,
    check_sampling_tensors,
    filter_threshold,
    row_param,
    scale_logits,
)
from specdec.sampling.tensors import SampleOutput
from specdec.triton_specialization import unspecialized

NEG_INF: tl.constexpr = tl.constexpr(float("-inf"))
INT32_MAX: tl.constexpr = tl.constexpr(2**31 - 1)


# ----------------------------------------------------------------------------------------------
# Device helpers shared with the verifier kernels.


@triton.jit
def processed_tile(row_ptr, lanes, vocab, divisor, threshold, HAS_THRESHOLD: tl.constexpr):
    """Processed logits of one tile: where(x / divisor < threshold, -inf, x / divisor) in float32,
    NaN read as -inf (as `scale_logits` does).

    Args:
        row_ptr: pointer to one row of raw logits (any float dtype, unit stride).
        lanes: [R, 4] int32 vocabulary ids of the tile (>= vocab: padding, read as -inf).
        vocab: V. divisor: float32 scalar (T, or 1 for greedy rows). threshold: float32 scalar.
    """
    x = tl.load(row_ptr + lanes, mask=lanes < vocab, other=float("-inf")).to(tl.float32)
    x = tl.where(x != x, float("-inf"), x)  # NaN -> -inf
    if divisor != 1.0:
        x = tl.math.div_rn(x, divisor)
    if HAS_THRESHOLD:
        x = tl.where(x < threshold, float("-inf"), x)
    return x


# Running reductions keep one accumulator per tile row (a thread's own lanes), so a tile costs
# no cross-thread traffic; `*_finish` reduces a chunk's accumulators once.


@triton.jit
def lse_update(run_max, run_sum, x):
    """Folds tile `x` [R, 4] into per-row (max, sum of exp(x - max)) accumulators [R]."""
    new_max = tl.maximum(run_max, tl.max(x, axis=1))
    ref = tl.where(new_max == float("-inf"), 0.0, new_max)
    run_sum = run_sum * tl.exp(run_max - ref) + tl.sum(tl.exp(x - ref[:, None]), axis=1)
    return new_max, run_sum


@triton.jit
def lse_finish(run_max, run_sum):
    """(max, sum of exp(x - max)) of a chunk from its [R] accumulators; -inf-safe."""
    chunk_max = tl.max(run_max)
    ref = tl.where(chunk_max == float("-inf"), 0.0, chunk_max)
    return chunk_max, tl.sum(run_sum * tl.exp(run_max - ref))


@triton.jit
def argmax_update(best, best_idx, val, lanes):
    """Folds tile `val` [R, 4] into per-row (max, lowest argmax) accumulators [R]; tiles ascend,
    so a later tile replaces a row's best only when strictly greater."""
    tile_best = tl.max(val, axis=1)
    tile_idx = tl.min(tl.where(val == tile_best[:, None], lanes, INT32_MAX), axis=1)
    better = tile_best > best
    return tl.where(better, tile_best, best), tl.where(better, tile_idx, best_idx)


@triton.jit
def argmax_finish(best, best_idx):
    """(max, lowest id attaining it) of a chunk from its [R] accumulators."""
    top = tl.max(best)
    return top, tl.min(tl.where(best == top, best_idx, INT32_MAX))


@triton.jit
def tile_lanes(first_lane, ROWS: tl.constexpr):
    """[ROWS, 4] int32 lanes first_lane + 4 r + j: a tile in the Philox lane layout."""
    return first_lane + tl.arange(0, ROWS)[:, None] * 4 + tl.arange(0, 4)[None, :]


# ----------------------------------------------------------------------------------------------
# Kernels.


@triton.jit
def row_value(ptr, value, row, PER_ROW: tl.constexpr):
    """A per-row parameter: ptr[row] when PER_ROW, else the scalar `value`."""
    if PER_ROW:
        value = tl.load(ptr + row)
    return value


@triton.jit
def _sample_chunk_kernel(
    logits_ptr,  # [N, V] raw logits, unit stride along V
    temperature_ptr,  # [N] float32 (read when PER_ROW_TEMPERATURE)
    threshold_ptr,  # [N] float32 (read when HAS_THRESHOLD)
    seeds_ptr,  # [N] int64
    positions_ptr,  # [N] int64
    streams_ptr,  # [N] int64 (read when PER_ROW_STREAM)
    steps_ptr,  # [N] int64 (read when PER_ROW_STEP)
    processed_ptr,  # [N, V] float32 out, unit stride along V
    chunk_max_ptr,  # [N, C] float32 out: max of the chunk's processed logits
    chunk_sum_ptr,  # [N, C] float32 out: sum of exp(processed - chunk max)
    chunk_best_ptr,  # [N, C] float32 out: max of processed + noise
    chunk_idx_ptr,  # [N, C] int32 out: its lowest id
    temperature_value,
    stream_value,
    step_value,
    vocab,
    stride_row,
    processed_stride_row,
    num_chunks,
    ROWS: tl.constexpr,
    TILES: tl.constexpr,  # tiles per chunk
    HAS_THRESHOLD: tl.constexpr,
    PER_ROW_TEMPERATURE: tl.constexpr,
    PER_ROW_STREAM: tl.constexpr,
    PER_ROW_STEP: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    temperature = row_value(temperature_ptr, temperature_value, row, PER_ROW_TEMPERATURE)
    sampled = temperature > 0.0
    divisor = tl.where(sampled, temperature, 1.0)
    threshold = float("-inf")
    if HAS_THRESHOLD:
        threshold = tl.load(threshold_ptr + row)
    seed = tl.load(seeds_ptr + row)
    position = tl.load(positions_ptr + row)
    stream = row_value(streams_ptr, stream_value, row, PER_ROW_STREAM)
    step = row_value(steps_ptr, step_value, row, PER_ROW_STEP)
    logits_row = logits_ptr + row * stride_row
    processed_row = processed_ptr + row * processed_stride_row

    chunk_first = chunk * TILES * (4 * ROWS)
    run_max = tl.full([ROWS], float("-inf"), tl.float32)
    run_sum = tl.zeros([ROWS], tl.float32)
    best = tl.full([ROWS], float("-inf"), tl.float32)
    best_idx = chunk_first + 4 * tl.arange(0, ROWS)
    # No runtime branch inside the tile loop (measured: branching on `sampled` and on the
    # divisor made the kernel ~1.5x slower); greedy rows compute the noise and add zero.
    noise_scale = tl.where(sampled, 1.0, 0.0)
    for t in tl.static_range(TILES):
        first_lane = chunk_first + t * (4 * ROWS)
        lanes = tile_lanes(first_lane, ROWS)
        in_vocab = lanes < vocab
        x = tl.load(logits_row + lanes, mask=in_vocab, other=float("-inf")).to(tl.float32)
        x = tl.where(x != x, float("-inf"), x)  # NaN -> -inf, as `scale_logits`
        x = tl.math.div_rn(x, divisor)
        if HAS_THRESHOLD:
            x = tl.where(x < threshold, float("-inf"), x)
        tl.store(processed_row + lanes, x, mask=in_vocab)
        run_max, run_sum = lse_update(run_max, run_sum, x)
        noise = gumbel_tile(seed, position, stream, step, first_lane // 4, ROWS)
        best, best_idx = argmax_update(best, best_idx, x + noise * noise_scale, lanes)
    chunk_max, chunk_sum = lse_finish(run_max, run_sum)
    top, top_idx = argmax_finish(best, best_idx)
    out = row * num_chunks + chunk
    tl.store(chunk_max_ptr + out, chunk_max)
    tl.store(chunk_sum_ptr + out, chunk_sum)
    tl.store(chunk_best_ptr + out, top)
    tl.store(chunk_idx_ptr + out, top_idx)


# (the per-row outputs' strides: 1 for a [N] tensor, K + 1 for a column of drafts; the
# warm-up cannot know which a step passes, and a specialisation gains nothing here)
@triton.jit(**unspecialized(ints=("token_stride", "logsumexp_stride")))
def _sample_reduce_kernel(
    chunk_max_ptr,  # [N, C] float32
    chunk_sum_ptr,  # [N, C] float32
    chunk_best_ptr,  # [N, C] float32
    chunk_idx_ptr,  # [N, C] int32
    token_ids_ptr,  # [N] int64 out
    logsumexp_ptr,  # [N] float32 out
    num_chunks,
    token_stride,
    logsumexp_stride,
    CHUNKS: tl.constexpr,  # power of two >= num_chunks
):
    row = tl.program_id(0).to(tl.int64)
    chunks = tl.arange(0, CHUNKS)
    mask = chunks < num_chunks
    base = row * num_chunks
    chunk_max = tl.load(chunk_max_ptr + base + chunks, mask=mask, other=float("-inf"))
    chunk_sum = tl.load(chunk_sum_ptr + base + chunks, mask=mask, other=0.0)
    row_max = tl.max(chunk_max)
    ref = tl.where(row_max == float("-inf"), 0.0, row_max)
    total = tl.sum(chunk_sum * tl.exp(chunk_max - ref))
    tl.store(logsumexp_ptr + row * logsumexp_stride, ref + tl.log(total))
    chunk_best = tl.load(chunk_best_ptr + base + chunks, mask=mask, other=float("-inf"))
    best = tl.max(chunk_best)
    first = tl.min(tl.where((chunk_best == best) & mask, chunks, CHUNKS))
    first = tl.minimum(first, num_chunks - 1)
    token = tl.load(chunk_idx_ptr + base + first)
    tl.store(token_ids_ptr + row * token_stride, token.to(tl.int64))


# ----------------------------------------------------------------------------------------------
# Launch planning.


# Tile shape of the streaming passes: rows of 4 lanes per thread, warps, tiles per program. Few
# rows per thread keep registers low, so several programs per SM keep loads in flight.
STREAM_PLAN = {"rows_per_thread": 2, "num_warps": 4, "tiles": 4}
# `sample`'s pass adds keyed noise to every element: one row of lanes per thread (measured on the
# H200 at B=256, V=151,936 fp32: 0.115 ms against 0.140 ms with two rows per thread). By the
# logits' element size: a plan may differ per dtype (still never per number of rows).
SAMPLE_PLANS = {
    4: {"rows_per_thread": 1, "num_warps": 4, "tiles": 4},
    2: {"rows_per_thread": 1, "num_warps": 4, "tiles": 4},
}


def chunk_plan(vocab: int, plan: dict[str, int] | None = None) -> tuple[int, int, int, int]:
    """Tile and chunk sizes of a pass over rows of `vocab` lanes.

    The plan depends on the vocabulary size only, never on the number of rows: a row's chunks and
    reduction order, and so every bit of its result, are the same alone and in any batch.

    Returns:
        (rows, tiles, num_chunks, num_warps): a tile is rows x 4 lanes; a program (one chunk of a
        row) handles `tiles` consecutive tiles.
    """
    plan = STREAM_PLAN if plan is None else plan
    num_warps = plan["num_warps"]
    rows = 32 * num_warps * plan["rows_per_thread"]
    while rows > 32 and 4 * rows > vocab:
        rows //= 2
    tiles = plan["tiles"]
    while tiles > 1 and 4 * rows * tiles > vocab:
        tiles //= 2
    num_warps = max(1, min(num_warps, rows // 32))
    return rows, tiles, triton.cdiv(vocab, 4 * rows * tiles), num_warps


def _is_tensor(value: object) -> bool:
    return isinstance(value, torch.Tensor)


def _per_row(
    value: RowParam, num_rows: int, dtype: torch.dtype, device: torch.device, name: str
) -> torch.Tensor | None:
    """`row_param` for tensors (contiguous [N]); None for a Python scalar."""
    if not _is_tensor(value):
        return None
    return row_param(value, num_rows, dtype, device, name).contiguous()


def _host_checks_pass(logits: torch.Tensor, seeds: object, positions: object) -> bool:
    """The host-side part of `check_logits_and_keys` (shapes and dtypes), as a bool."""
    if logits.dim() != 2 or not logits.is_floating_point():
        return False
    for t in (seeds, positions):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.int64:
            return False
        if t.shape != (logits.shape[0],) or t.device != logits.device:
            return False
    return logits.shape[0] > 0 and logits.shape[1] > 0


def sample_triton(
    logits: torch.Tensor,
    seeds: torch.Tensor,
    positions: torch.Tensor,
    *,
    temperature: RowParam,
    top_k: RowParam = None,
    top_p: RowParam = None,
    min_p: RowParam = None,
    stream: Stream | int = Stream.TARGET,
    step: int | torch.Tensor = 0,
    check_values: bool = True,
    out: SampleOutput | None = None,
) -> SampleOutput | None:
    """`sample` on CUDA tensors: same arguments, same results as `sample_ref` (written into
    `out` when given, checked by the caller).

    processed_logits are bit-identical to `sample_ref`'s; token_ids are identical on inputs
    without near-ties (the Gumbel transform's log / log1p may differ from the CPU's by an ulp);
    logsumexp agrees to float32 rounding. Returns None for arguments it cannot take (invalid
    ones, or keys out of range), which the caller hands to `sample_ref`: it raises exactly its
    own error, or samples a greedy batch whose keys are never used.

    Args:
        logits: [N, V] raw logits (float32, bfloat16 or float16), CUDA.
        seeds: [N] int64 request seeds.
        positions: [N] int64 position Q of the token being sampled.
        temperature: float or [N]; 0 = greedy (argmax, no noise).
        top_k: int or [N] int64, 0 = off.
        top_p: float or [N], 1 = off.
        min_p: float or [N], 0 = off.
        stream: the `Stream` (or [N] int64 stream ids).
        step: 0, or the round anchor (int or [N] int64) for round-keyed streams.
        check_values: False skips the per-row value checks (inputs valid by construction).

    Returns:
        SampleOutput(token_ids [N] int64, processed_logits [N, V] float32, logsumexp [N] float32).

    RNG: `stream` at (position, step), one Gumbel value per vocabulary id for each sampled row.
    """

    if temperature is None or not _host_checks_pass(logits, seeds, positions):
        return None
    num_rows, vocab = logits.shape
    device = logits.device
    # Per-row parameters travel as tensors, scalar ones as kernel arguments (no fill launches).
    try:
        temperature_t = _per_row(temperature, num_rows, torch.float32, device, "temperature")
        top_k_t = row_param(top_k, num_rows, torch.int64, device, "top_k")
        top_p_t = row_param(top_p, num_rows, torch.float32, device, "top_p")
        min_p_t = row_param(min_p, num_rows, torch.float32, device, "min_p")
        stream_t = _key_tensor("stream", stream, num_rows, device) if _is_tensor(stream) else None
        step_t = _key_tensor("step", step, num_rows, device) if _is_tensor(step) else None
    except (TypeError, ValueError):
        return None
    temperature_value = 1.0
    if temperature_t is None:
        temperature_value = float(
            torch.tensor(float(temperature), dtype=torch.float32, device="cpu")
        )
        if not 0.0 <= temperature_value < math.inf:
            return None
    stream_value = 0 if stream_t is not None else int(stream)
    step_value = 0 if step_t is not None else int(step)
    if not (0 <= stream_value <= MAX_COUNTER_WORD and 0 <= step_value <= MAX_COUNTER_WORD):
        return None  # the reference raises if a row draws noise, else samples greedily

    if logits.stride(1) != 1:
        logits = logits.contiguous()
    # The kernels index the per-row tensors with unit stride (a 0-d stream or step tensor
    # arrives expanded, with stride 0).
    seeds, positions = seeds.contiguous(), positions.contiguous()
    stream_t = stream_t.contiguous() if stream_t is not None else None
    step_t = step_t.contiguous() if step_t is not None else None
    # The per-row argument checks read their values back while the kernels run (the kernels
    # never index memory by them); nothing is returned before they pass.
    checks = None
    if check_values:
        checks = SampleRuleBits(
            positions,
            temperature_t,
            stream_t,
            step_t,
            top_k_t,
            top_p_t,
            min_p_t,
            (temperature_value, stream_value, step_value),
            MAX_COUNTER_WORD,
        )
    threshold = None
    if top_k_t is not None or top_p_t is not None or min_p_t is not None:
        rows_temperature = temperature_t
        if rows_temperature is None:
            rows_temperature = torch.full((num_rows,), temperature_value, device=device)
        if check_values:
            try:
                check_sampling_tensors(rows_temperature, top_k_t, top_p_t, min_p_t)
            except ValueError:
                return None
        scaled = scale_logits(logits, rows_temperature)
        threshold = filter_threshold(scaled, top_k_t, top_p_t, min_p_t)
    if out is None:
        processed = torch.empty(num_rows, vocab, dtype=torch.float32, device=device)
        token_ids = torch.empty(num_rows, dtype=torch.int64, device=device)
        logsumexp = torch.empty(num_rows, dtype=torch.float32, device=device)
    else:
        token_ids, processed, logsumexp = out.token_ids, out.processed_logits, out.logsumexp
    plan = SAMPLE_PLANS.get(logits.element_size(), SAMPLE_PLANS[4])
    rows, tiles, num_chunks, num_warps = chunk_plan(vocab, plan)
    chunk_f32 = torch.empty(3, num_rows, num_chunks, dtype=torch.float32, device=device)
    chunk_idx = torch.empty(num_rows, num_chunks, dtype=torch.int32, device=device)
    per_row = {
        "PER_ROW_TEMPERATURE": temperature_t is not None,
        "PER_ROW_STREAM": stream_t is not None,
        "PER_ROW_STEP": step_t is not None,
    }
    scalars = (temperature_value, stream_value, step_value)
    _sample_chunk_kernel[(num_rows, num_chunks)](
        logits,
        positions if temperature_t is None else temperature_t,
        threshold if threshold is not None else positions,
        seeds,
        positions,
        positions if stream_t is None else stream_t,
        positions if step_t is None else step_t,
        processed,
        chunk_f32[0],
        chunk_f32[1],
        chunk_f32[2],
        chunk_idx,
        *scalars,
        vocab,
        logits.stride(0),
        processed.stride(0),
        num_chunks,
        ROWS=rows,
        TILES=tiles,
        HAS_THRESHOLD=threshold is not None,
        num_warps=num_warps,
        **per_row,
    )
    _sample_reduce_kernel[(num_rows,)](
        chunk_f32[0],
        chunk_f32[1],
        chunk_f32[2],
        chunk_idx,
        token_ids,
        logsumexp,
        num_chunks,
        token_ids.stride(0),
        logsumexp.stride(0),
        CHUNKS=max(16, triton.next_power_of_2(num_chunks)),
        num_warps=1 if num_chunks <= 256 else 4,
    )
    if checks is not None and checks.violated():
        return None  # invalid arguments: the reference raises its error
    return SampleOutput(token_ids, processed, logsumexp)
