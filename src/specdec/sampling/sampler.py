"""Gumbel-max sampling from keyed noise: `sample` (dispatch) and `sample_ref` (the PyTorch twin).

The sampled token of a row is argmax(processed_logits + gumbel(seed, position, stream, step)):
a pure function of the logits and the key. Greedy rows (temperature 0) take the argmax with no
noise. Ties go to the lowest token id.
"""

from __future__ import annotations

import collections
import threading

import torch

from specdec.rng import Stream, gumbel
from specdec.sampling.context import LogitsContext
from specdec.sampling.processing import (
    UNUSABLE_ROW_MESSAGE,
    RowParam,
    filter_threshold,
    scale_logits,
    unusable_rows,
)
from specdec.sampling.tensors import SampleOutput, SamplingTensors


def check_logits_and_keys(logits: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor):
    if logits.dim() != 2:
        raise ValueError(f"logits must have shape [N, V], got {list(logits.shape)}")
    if not logits.is_floating_point():
        raise TypeError(f"logits must be a float tensor, got {logits.dtype}")
    num_rows = logits.shape[0]
    for name, t in (("seeds", seeds), ("positions", positions)):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.int64:
            raise TypeError(f"{name} must be an int64 tensor")
        if t.shape != (num_rows,):
            raise ValueError(f"{name} must have shape [{num_rows}], got {list(t.shape)}")
    if num_rows and int(positions.min()) < 0:
        raise ValueError("positions must be >= 0")


def apply_context(logits: torch.Tensor, context: LogitsContext | None) -> torch.Tensor:
    """[N, V] logits after `context` (the logits themselves when None)."""
    if context is None:
        return logits
    if context.num_rows != logits.shape[0]:
        raise ValueError(
            f"context has {context.num_rows} requests for {logits.shape[0]} rows of logits"
        )
    return context.apply(logits)


def gumbel_argmax_ref(
    processed: torch.Tensor,
    greedy: torch.Tensor,
    seeds: torch.Tensor,
    positions: torch.Tensor,
    stream: Stream | int | torch.Tensor,
    step: int | torch.Tensor = 0,
) -> torch.Tensor:
    """argmax(processed + keyed Gumbel noise) per row; greedy rows take argmax(processed).

    Args:
        processed: [N, V] float32 processed logits (or any log-weights with -inf = excluded).
        greedy: [N] bool, rows that take no noise.
        seeds, positions: [N] int64 keys; stream, step as in `specdec.rng.gumbel`.

    Returns:
        [N] int64 token ids.

    RNG: `stream` at (position, step), V lanes per sampled row; greedy rows draw nothing. On the
    CPU, rows of `Stream.TARGET` come from `target_noise_memo` (the same values: a coupled
    draft at Q and the target's sample at Q read one row).
    """
    num_rows = processed.shape[0]
    if processed.device.type == "cpu":
        # Asking costs no device sync here: skip the greedy argmax and the gathers when unused.
        sampled_list = (~greedy).nonzero().squeeze(1).tolist()
        if not sampled_list:
            return processed.argmax(dim=-1)
        whole = len(sampled_list) == num_rows
        tokens = None if whole else processed.argmax(dim=-1)
        sampled = None if whole else torch.tensor(sampled_list, dtype=torch.int64)
    else:
        tokens = processed.argmax(dim=-1)
        sampled = (~greedy).nonzero().squeeze(1)
        if not sampled.numel():
            return tokens
        whole = False
    steps = step[sampled] if isinstance(step, torch.Tensor) and step.dim() and not whole else step
    streams = stream
    if isinstance(stream, torch.Tensor) and stream.dim() and not whole:
        streams = stream[sampled]
    row_seeds = seeds if whole else seeds[sampled]
    row_positions = positions if whole else positions[sampled]
    vocab = processed.shape[1]
    noise = None
    if processed.device.type == "cpu":
        noise = target_noise_memo(row_seeds, row_positions, streams, vocab, steps)
    if noise is None:
        noise = gumbel(row_seeds, row_positions, streams, vocab, step=steps)
    rows = processed if whole else processed[sampled]
    if whole:
        tokens = (rows + noise).argmax(dim=-1)
    else:
        tokens[sampled] = (rows + noise).argmax(dim=-1)
    return tokens


class _NoiseMemo(threading.local):
    """The last `Stream.TARGET` Gumbel rows drawn on the CPU by this thread, by key."""

    def __init__(self) -> None:
        self.rows: collections.OrderedDict[tuple[int, int, int], torch.Tensor] = (
            collections.OrderedDict()
        )
        self.bytes = 0
        self.source = None  # the `gumbel` that drew the rows


_NOISE_MEMO = _NoiseMemo()
# The memo's bound per thread: 21 rows of a 49,152-token vocabulary, the rows a step of up to
# about 8 requests at K = 1 reads twice (a bigger batch draws some of them again: the same bits,
# at the old cost). Its rows stay resident, so it is kept small (the CPU's peak-memory target).
NOISE_MEMO_BYTES = 4 << 20


def target_noise_memo(
    seeds: torch.Tensor,
    positions: torch.Tensor,
    stream: Stream | int | torch.Tensor,
    vocab: int,
    step: int | torch.Tensor = 0,
) -> torch.Tensor | None:
    """[N, vocab] `gumbel(seeds, positions, Stream.TARGET, vocab)` on the CPU, each row drawn
    at most once while it stays in this thread's memo (a pure function of its key, so a memo
    row is exactly a fresh draw). None (draw it yourself) for other streams, a step other than
    0, or tensors not on the CPU.

    A speculative step samples the target's token at Q with the noise the coupled draft at Q
    was drawn with, and a rejected round's next draft with the noise of the row after the
    rejection: each is a row of `Stream.TARGET` at (Q), drawn once here. Callers must not
    write into the returned rows. The memo is emptied whenever the module's `gumbel` is not
    the one that drew its rows (an audit's spy or control noise sees every draw it makes).
    """
    if isinstance(stream, torch.Tensor) or int(stream) != Stream.TARGET:
        return None
    if isinstance(step, torch.Tensor) or step != 0 or seeds.device.type != "cpu":
        return None
    memo = _NOISE_MEMO.rows
    if _NOISE_MEMO.source is not gumbel:  # rows of another draw function (a test's spy)
        memo.clear()
        _NOISE_MEMO.bytes = 0
        _NOISE_MEMO.source = gumbel
    keys = [
        (seed, position, vocab)
        for seed, position in zip(seeds.tolist(), positions.tolist(), strict=True)
    ]
    missing = [i for i, key in enumerate(keys) if key not in memo]
    if missing:
        index = torch.tensor(missing, dtype=torch.int64)
        fresh = gumbel(seeds[index], positions[index], Stream.TARGET, vocab)
        row_bytes = fresh.shape[1] * fresh.element_size()
        for i, row in zip(missing, fresh, strict=True):
            memo[keys[i]] = row if len(missing) == 1 else row.clone()  # not a view of all
            _NOISE_MEMO.bytes += row_bytes
    rows = []
    for key in keys:
        memo.move_to_end(key)
        rows.append(memo[key])
    while _NOISE_MEMO.bytes > NOISE_MEMO_BYTES and memo:  # oldest first; `rows` holds ours
        _, old = memo.popitem(last=False)
        _NOISE_MEMO.bytes -= old.numel() * old.element_size()
    if len(rows) == 1:
        return rows[0][None]
    return torch.stack(rows)


def sample_ref(
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
    context: LogitsContext | None = None,
) -> SampleOutput:
    """The PyTorch twin of `sample` (same arguments and results); runs on any device."""
    check_logits_and_keys(logits, seeds, positions)
    logits = apply_context(logits, context)
    bad = unusable_rows(logits)
    if logits.shape[0] and bool(bad.any()):
        raise ValueError(f"logits row {int(bad.nonzero()[0])} {UNUSABLE_ROW_MESSAGE}")
    params = SamplingTensors.build(logits.shape[0], logits.device, temperature, top_k, top_p, min_p)
    scaled = scale_logits(logits, params.temperature)
    threshold = filter_threshold(scaled, params.top_k, params.top_p, params.min_p)
    processed = scaled
    if threshold is not None:
        processed = scaled.masked_fill_(scaled < threshold[:, None], float("-inf"))
    token_ids = gumbel_argmax_ref(
        processed, params.temperature == 0, seeds, positions, stream, step
    )
    return SampleOutput(token_ids, processed, processed.logsumexp(dim=-1))


def sample(
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
    context: LogitsContext | None = None,
    out: SampleOutput | None = None,
) -> SampleOutput:
    """Samples one token per row by Gumbel-max on keyed noise.

    Args:
        logits: [N, V] raw logits (float32, bfloat16 or float16). NaN counts as -inf; a row
            with no finite logit, or with a +inf one, is refused (ValueError) unless
            `check_values` is False on CUDA, where it is not looked for.
        seeds: [N] int64 request seeds.
        positions: [N] int64 position Q of the token being sampled.
        temperature: float or [N]; 0 = greedy (argmax, no noise).
        top_k: int or [N] int64, 0 = off.
        top_p: float or [N], 1 = off.
        min_p: float or [N], 0 = off.
        stream: `Stream.TARGET` for plain sampling (and coupled drafts); `Stream.DRAFT` for
            drafts verified by "standard"/"block".
        step: 0, or the round anchor (int or [N] int64) for round-keyed streams.
        check_values: on CUDA, False skips the per-row value checks and their read-back to the
            host, for callers whose arguments are valid by construction (the engine, the
            drafters): the call then never waits for the device. Shapes are always checked.
        context: the rows' penalties, biases and bans (`LogitsContext` of N requests, row n is
            request n), applied to the raw logits before temperature; None: none.
        out: where to write the results (tensors of the returned shapes and dtypes on the
            logits' device, processed_logits with unit stride along V; rows may be strided,
            such as one column of a [N, K, V] proposal): the same values as without it,
            written in place (on CUDA by the kernels themselves, not copied in after).

    Returns:
        SampleOutput(token_ids [N] int64, processed_logits [N, V] float32, logsumexp [N] float32):
        `out` when given.

    RNG: `stream` at (position, step), one Gumbel value per vocabulary id for each sampled row.
    """
    if context is not None:
        check_logits_and_keys(logits, seeds, positions)
        logits = apply_context(logits, context)
    if out is not None:
        check_sample_out(out, logits)
    if logits.is_cuda:
        from specdec.sampling.sampler_triton import sample_triton

        result = sample_triton(
            logits,
            seeds,
            positions,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            min_p=min_p,
            stream=stream,
            step=step,
            check_values=check_values,
            out=out,
        )
        if result is not None and check_values and not bool(torch.isfinite(result.logsumexp).all()):
            result = None  # a row without a distribution: the reference raises the error
        if result is not None:
            return result if out is None else out
    result = sample_ref(
        logits,
        seeds,
        positions,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        min_p=min_p,
        stream=stream,
        step=step,
    )
    if out is None:
        return result
    out.token_ids.copy_(result.token_ids)
    out.processed_logits.copy_(result.processed_logits)
    out.logsumexp.copy_(result.logsumexp)
    return out


def check_sample_out(out: SampleOutput, logits: torch.Tensor) -> None:
    """Raises ValueError unless `out` can take `sample`'s results for `logits` [N, V]."""
    num_rows, vocab = logits.shape
    expected = (
        ("token_ids", out.token_ids, (num_rows,), torch.int64),
        ("processed_logits", out.processed_logits, (num_rows, vocab), torch.float32),
        ("logsumexp", out.logsumexp, (num_rows,), torch.float32),
    )
    for name, tensor, shape, dtype in expected:
        if tensor.shape != shape or tensor.dtype != dtype or tensor.device != logits.device:
            raise ValueError(
                f"out.{name} must be {dtype} {list(shape)} on {logits.device}, got "
                f"{tensor.dtype} {list(tensor.shape)} on {tensor.device}"
            )
    if vocab > 1 and out.processed_logits.stride(1) != 1:
        raise ValueError("out.processed_logits must have unit stride along the vocabulary")
