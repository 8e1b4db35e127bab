"""The value rules of `verify` and `sample`, evaluated on the GPU by one small kernel each.

`ValueCheck` on CUDA launches `_value_rules_kernel` ahead of the verify kernels: each program reads
the values the rules need for 256 rows (positions, num_draft, the live drafts, the sampling
parameters, each live draft's logit under its draft_logits) and writes one int32 whose bit r is
set when rule r of `specdec.verify.inputs.value_rule_messages` is violated by one of its rows.
One asynchronous copy brings those words to pinned host memory; the host waits for the copy only,
ORs the words and raises the message of the lowest set bit, which is the message the PyTorch
rules raise on the CPU. The rules are the CPU's (`ValueCheck` there) written out element-wise; a
GPU test compares the two on every rule. `sample`'s rules (`SampleRuleBits`) work the same way
with a single bit: set, `sample` hands the call to its reference, which raises the error.
"""

from __future__ import annotations

import threading

import numpy
import torch
import triton
import triton.language as tl

from specdec.triton_specialization import unspecialized

FLT_MAX: tl.constexpr = tl.constexpr(3.4028234663852886e38)
ROW_BLOCK = 256


@triton.jit
def _or(a, b):
    return a | b


# K (the drafts a row may have: a tree's node count varies from round to round) is a runtime
# value under its power-of-two tile KP, so a new K reuses its KP's compiled variant.
@triton.jit(**unspecialized(ints=("K",)))
def _value_rules_kernel(
    positions_ptr,  # [B] int64
    num_draft_ptr,  # [B] int64
    drafts_ptr,  # [B, K] int64 (contiguous rows)
    temperature_ptr,  # [B] float32
    top_k_ptr,  # [B] int64 (HAS_TOP_K)
    top_p_ptr,  # [B] float32 (HAS_TOP_P)
    min_p_ptr,  # [B] float32 (HAS_MIN_P)
    draft_ptr,  # [B, K, V] draft logits (AT_DRAFT)
    out_ptr,  # [cdiv(B, BLOCK)] int32 rule bits, one word per program
    batch,
    active,
    vocab,
    max_position,
    drafts_stride,
    draft_stride0,
    draft_stride1,
    K,
    KP: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_TOP_K: tl.constexpr,
    HAS_TOP_P: tl.constexpr,
    HAS_MIN_P: tl.constexpr,
    AT_DRAFT: tl.constexpr,
):
    flags = tl.zeros([BLOCK], dtype=tl.int32)
    j = tl.arange(0, KP)[None, :]
    b = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    in_batch = b < batch
    position = tl.load(positions_ptr + b, mask=in_batch, other=0)
    bad = in_batch & ((position < 0) | (position > max_position))
    flags |= tl.where(bad, 1, 0)
    num_draft = tl.load(num_draft_ptr + b, mask=in_batch, other=0)
    bad = in_batch & ((num_draft < 0) | (num_draft > K))
    flags |= tl.where(bad, 2, 0)
    live = (b[:, None] < active) & (j < K) & (j < num_draft[:, None])
    drafts = tl.load(drafts_ptr + b[:, None] * drafts_stride + j, mask=live, other=0)
    bad = tl.max((live & ((drafts < 0) | (drafts >= vocab))).to(tl.int32), axis=1)
    flags |= tl.where(bad != 0, 4, 0)
    temperature = tl.load(temperature_ptr + b, mask=in_batch, other=1.0)
    bad = in_batch & ~((temperature >= 0.0) & (temperature <= FLT_MAX))
    flags |= tl.where(bad, 8, 0)
    if HAS_TOP_K:
        top_k = tl.load(top_k_ptr + b, mask=in_batch, other=0)
        flags |= tl.where(in_batch & (top_k < 0), 16, 0)
    if HAS_TOP_P:
        top_p = tl.load(top_p_ptr + b, mask=in_batch, other=1.0)
        flags |= tl.where(in_batch & ~((top_p > 0.0) & (top_p <= 1.0)), 32, 0)
    if HAS_MIN_P:
        min_p = tl.load(min_p_ptr + b, mask=in_batch, other=0.0)
        flags |= tl.where(in_batch & ~((min_p >= 0.0) & (min_p <= 1.0)), 64, 0)
    if AT_DRAFT:
        ids = tl.minimum(tl.maximum(drafts, 0), vocab - 1)
        offsets = b[:, None].to(tl.int64) * draft_stride0 + j * draft_stride1 + ids
        logit = tl.load(draft_ptr + offsets, mask=live, other=0.0).to(tl.float32)
        # -inf or NaN: the draft could not have been sampled from these logits.
        bad = tl.max((live & ~(logit >= -FLT_MAX)).to(tl.int32), axis=1)
        flags |= tl.where(bad != 0, 128, 0)
    tl.store(out_ptr + tl.program_id(0), tl.reduce(flags, 0, _or))


class _Buffers(threading.local):
    """Per-thread reusable buffers: (device, stream) -> (device word, pinned word, event)."""

    def __init__(self) -> None:
        self.by_stream: dict[tuple, tuple[torch.Tensor, torch.Tensor, torch.cuda.Event]] = {}


_BUFFERS = _Buffers()


def _buffers(
    kind: str, device: torch.device, words: int
) -> tuple[torch.Tensor, torch.Tensor, torch.cuda.Event]:
    """Reused buffers for `words` rule words: a call waits for its read-back before returning,
    so the next call on the same thread and stream may overwrite them."""
    key = (kind, device, torch.cuda.current_stream(device).cuda_stream, words)
    found = _BUFFERS.by_stream.get(key)
    if found is None:
        found = (
            torch.empty(words, dtype=torch.int32, device=device),
            torch.empty(words, dtype=torch.int32, device="cpu", pin_memory=True),
            torch.cuda.Event(),
        )
        _BUFFERS.by_stream[key] = found
    return found


def _fields(params) -> tuple:
    """A `SamplingTensors`' tensors in field order (temperature, top_k, top_p, min_p)."""
    return (params.temperature, params.top_k, params.top_p, params.min_p)


class DeviceRuleBits:
    """The rule bits of one `verify` call, computed on the GPU and read back asynchronously.

    Args: as `ValueCheck` (CUDA tensors); `at_draft` says whether the drafts' logits are checked.
    """

    def __init__(
        self,
        draft_token_ids: torch.Tensor,
        draft_logits: torch.Tensor | None,
        positions: torch.Tensor,
        num_draft: torch.Tensor,
        params,
        active_rows: int,
        vocab: int,
        max_position: int,
        at_draft: bool,
    ) -> None:
        device = positions.device
        batch, k = draft_token_ids.shape
        self._empty = batch == 0
        if self._empty:
            return
        words = triton.cdiv(batch, ROW_BLOCK)
        word, self._host, self._event = _buffers("verify", device, words)
        # The kernel indexes every [B] tensor with unit stride.
        positions, num_draft = positions.contiguous(), num_draft.contiguous()
        params = type(params)(*(None if t is None else t.contiguous() for t in _fields(params)))
        drafts = (
            draft_token_ids if draft_token_ids.stride(-1) == 1 else draft_token_ids.contiguous()
        )
        draft = draft_logits if at_draft else positions
        strides = (draft.stride(0), draft.stride(1)) if at_draft else (0, 0)
        if at_draft and draft.stride(2) != 1:
            draft = draft.contiguous()
            strides = (draft.stride(0), draft.stride(1))
        temperature = params.temperature
        _value_rules_kernel[(words,)](
            positions,
            num_draft,
            drafts,
            temperature,
            params.top_k if params.top_k is not None else positions,
            params.top_p if params.top_p is not None else temperature,
            params.min_p if params.min_p is not None else temperature,
            draft,
            word,
            batch,
            active_rows,
            vocab,
            max_position,
            drafts.stride(0) if k else 0,
            *strides,
            k,
            KP=triton.next_power_of_2(max(k, 1)),
            BLOCK=ROW_BLOCK,
            HAS_TOP_K=params.top_k is not None,
            HAS_TOP_P=params.top_p is not None,
            HAS_MIN_P=params.min_p is not None,
            AT_DRAFT=at_draft,
            num_warps=4,
        )
        self._host.copy_(word, non_blocking=True)
        self._event.record()

    def bits(self) -> int:
        """Waits for the copy of the rule word (not for later work) and returns it."""
        if self._empty:
            return 0
        self._event.synchronize()
        return int(numpy.bitwise_or.reduce(self._host.numpy()))


@triton.jit
def _sample_rules_kernel(
    positions_ptr,  # [N] int64
    temperature_ptr,  # [N] float32 (PER_ROW_TEMPERATURE)
    stream_ptr,  # [N] int64 (PER_ROW_STREAM)
    step_ptr,  # [N] int64 (PER_ROW_STEP)
    top_k_ptr,  # [N] int64 (HAS_TOP_K)
    top_p_ptr,  # [N] float32 (HAS_TOP_P)
    min_p_ptr,  # [N] float32 (HAS_MIN_P)
    out_ptr,  # [cdiv(N, BLOCK)] int32: 1 where a row of the block breaks a rule
    num_rows,
    temperature_value,
    stream_value,
    step_value,
    max_counter,
    BLOCK: tl.constexpr,
    PER_ROW_TEMPERATURE: tl.constexpr,
    PER_ROW_STREAM: tl.constexpr,
    PER_ROW_STEP: tl.constexpr,
    HAS_TOP_K: tl.constexpr,
    HAS_TOP_P: tl.constexpr,
    HAS_MIN_P: tl.constexpr,
):
    n = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    rows = n < num_rows
    position = tl.load(positions_ptr + n, mask=rows, other=0)
    temperature = tl.zeros([BLOCK], tl.float32) + temperature_value
    if PER_ROW_TEMPERATURE:
        temperature = tl.load(temperature_ptr + n, mask=rows, other=1.0)
    stream = tl.zeros([BLOCK], tl.int64) + stream_value
    if PER_ROW_STREAM:
        stream = tl.load(stream_ptr + n, mask=rows, other=0)
    step = tl.zeros([BLOCK], tl.int64) + step_value
    if PER_ROW_STEP:
        step = tl.load(step_ptr + n, mask=rows, other=0)
    # Counter words are checked only where the row draws noise (T > 0), as the reference does.
    out_of_range = (position > max_counter) | (stream < 0) | (stream > max_counter)
    out_of_range = out_of_range | (step < 0) | (step > max_counter)
    bad = (position < 0) | ((temperature > 0.0) & out_of_range)
    bad = bad | ~((temperature >= 0.0) & (temperature <= FLT_MAX))
    if HAS_TOP_K:
        bad = bad | (tl.load(top_k_ptr + n, mask=rows, other=0) < 0)
    if HAS_TOP_P:
        top_p = tl.load(top_p_ptr + n, mask=rows, other=1.0)
        bad = bad | ~((top_p > 0.0) & (top_p <= 1.0))
    if HAS_MIN_P:
        min_p = tl.load(min_p_ptr + n, mask=rows, other=0.0)
        bad = bad | ~((min_p >= 0.0) & (min_p <= 1.0))
    tl.store(out_ptr + tl.program_id(0), tl.max((rows & bad).to(tl.int32), axis=0))


class SampleRuleBits:
    """Whether some row of one `sample` call breaks an argument rule, computed on the GPU and
    read back asynchronously (scalar parameters are passed as *_value, checked on the host)."""

    def __init__(
        self,
        positions: torch.Tensor,
        temperature: torch.Tensor | None,
        stream: torch.Tensor | None,
        step: torch.Tensor | None,
        top_k: torch.Tensor | None,
        top_p: torch.Tensor | None,
        min_p: torch.Tensor | None,
        scalars: tuple[float, int, int],
        max_counter: int,
    ) -> None:
        num_rows = positions.shape[0]
        words = triton.cdiv(num_rows, ROW_BLOCK)
        # The kernel indexes every [N] tensor with unit stride.
        positions = positions.contiguous()
        temperature, stream, step, top_k, top_p, min_p = (
            None if t is None else t.contiguous()
            for t in (temperature, stream, step, top_k, top_p, min_p)
        )
        word, self._host, self._event = _buffers("sample", positions.device, words)

        def given(t: torch.Tensor | None) -> torch.Tensor:
            return positions if t is None else t

        _sample_rules_kernel[(words,)](
            positions,
            given(temperature),
            given(stream),
            given(step),
            given(top_k),
            given(top_p),
            given(min_p),
            word,
            num_rows,
            *scalars,
            max_counter,
            BLOCK=ROW_BLOCK,
            PER_ROW_TEMPERATURE=temperature is not None,
            PER_ROW_STREAM=stream is not None,
            PER_ROW_STEP=step is not None,
            HAS_TOP_K=top_k is not None,
            HAS_TOP_P=top_p is not None,
            HAS_MIN_P=min_p is not None,
            num_warps=4,
        )
        self._host.copy_(word, non_blocking=True)
        self._event.record()

    def violated(self) -> bool:
        """Waits for the copy of the rule words (not for later work)."""
        self._event.synchronize()
        return bool(self._host.numpy().any())
