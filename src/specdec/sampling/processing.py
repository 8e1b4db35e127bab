"""Logits processing shared by the target and the draft: temperature, min-p, top-k, top-p.

Every filter keeps the tokens whose scaled logit is at least a per-row threshold, so processing is
`scaled = logits / T` followed by `where(scaled >= threshold, scaled, -inf)`; the GPU kernels take
the same threshold and apply the same two steps. Nothing here draws randomness.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

RowParam = torch.Tensor | float | int | None


def row_param(
    value: RowParam, num_rows: int, dtype: torch.dtype, device: torch.device, name: str
) -> torch.Tensor | None:
    """Returns `value` as a [num_rows] tensor of `dtype` (None stays None)."""
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        if value.dim() == 0:
            value = value.expand(num_rows)
        if value.shape != (num_rows,):
            raise ValueError(
                f"{name} must be a scalar or have shape [{num_rows}], got {list(value.shape)}"
            )
        return value.to(device=device, dtype=dtype)
    return torch.full((num_rows,), value, dtype=dtype, device=device)


SAMPLING_RULE_MESSAGES = (
    "temperature must be finite and >= 0",
    "top_k must be >= 0 (0 disables)",
    "top_p must be in (0, 1]",
    "min_p must be in [0, 1]",
)


def sampling_rule_flags(
    temperature: torch.Tensor,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
    min_p: torch.Tensor | None,
) -> list[torch.Tensor | None]:
    """0-d bool tensors, True when the rule of `SAMPLING_RULE_MESSAGES` with the same index is
    violated by some row (None for a parameter not given)."""
    return [
        ~torch.isfinite(temperature).all() | (temperature < 0).any(),
        None if top_k is None else (top_k < 0).any(),
        None if top_p is None else ((top_p <= 0) | (top_p > 1) | top_p.isnan()).any(),
        None if min_p is None else ((min_p < 0) | (min_p > 1) | min_p.isnan()).any(),
    ]


def sampling_violations(
    temperature: torch.Tensor,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
    min_p: torch.Tensor | None,
) -> list[tuple[torch.Tensor, str]]:
    """(0-d bool tensor that is True when violated, message) for each per-row parameter rule;
    the caller reads them all with one device sync (`raise_first_violation`)."""
    flags = sampling_rule_flags(temperature, top_k, top_p, min_p)
    return [
        (flag, message)
        for flag, message in zip(flags, SAMPLING_RULE_MESSAGES, strict=True)
        if flag is not None
    ]


def raise_first_violation(rules: list[tuple[torch.Tensor, str]]) -> None:
    """Raises ValueError with the message of the first violated rule (one device sync)."""
    if not rules:
        return
    flags = torch.stack([flag.reshape(()) for flag, _ in rules]).tolist()
    for violated, (_, message) in zip(flags, rules, strict=True):
        if violated:
            raise ValueError(message)


def check_sampling_tensors(
    temperature: torch.Tensor,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
    min_p: torch.Tensor | None,
) -> None:
    """Raises ValueError naming the first invalid per-row sampling parameter."""
    raise_first_violation(sampling_violations(temperature, top_k, top_p, min_p))


def scale_logits(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """logits / T in float32; greedy rows (T = 0) are divided by 1. NaN logits become -inf
    (such a token is never drawn), as in the GPU kernels.

    Args:
        logits: [N, V] any float dtype.
        temperature: [N] float32.

    Returns:
        [N, V] float32 (a new tensor).
    """
    divisor = torch.where(temperature > 0, temperature, torch.ones_like(temperature))
    scaled = logits.to(torch.float32) / divisor[:, None]
    return scaled.masked_fill_(scaled.isnan(), float("-inf"))


# The CPU extension's `unusable_rows_f32` ([N, V] float32 -> [N] bool, one pass over the
# logits instead of four), once the engine hands it over (`use_native_row_checks`).
_native_unusable: Callable[[torch.Tensor], torch.Tensor] | None = None


def use_native_row_checks(unusable: Callable[[torch.Tensor], torch.Tensor] | None) -> None:
    """Hands `unusable_rows` a compiled twin for [N, V] float32 CPU logits (None: PyTorch's)."""
    global _native_unusable
    _native_unusable = unusable


def unusable_rows(logits: torch.Tensor) -> torch.Tensor:
    """[...] bool: rows of [..., V] logits with no finite value (all NaN or -inf: nothing can be
    drawn) or with a +inf (no distribution); a failed forward pass, never valid input."""
    native = _native_unusable
    if (
        native is not None
        and logits.dim() == 2
        and logits.dtype == torch.float32
        and logits.device.type == "cpu"
    ):
        return native(logits)
    return ~torch.isfinite(logits).any(dim=-1) | torch.isposinf(logits).any(dim=-1)


UNUSABLE_ROW_MESSAGE = (
    "has no finite logit (all NaN or -inf) or a +inf one: there is no distribution to draw "
    "from (NaN logits count as -inf)"
)


def filter_threshold(
    scaled: torch.Tensor,
    top_k: torch.Tensor | None = None,
    top_p: torch.Tensor | None = None,
    min_p: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """The per-row logit threshold that min-p, then top-k, then top-p impose on scaled logits
    (vLLM's order).

    A row keeps token v iff scaled[v] >= threshold. Ties at a threshold are all kept, so the result
    does not depend on how a sort orders equal values.

    Args:
        scaled: [N, V] float32 temperature-scaled logits.
        top_k: [N] int64, 0 = off (k >= V is off too).
        top_p: [N] float32, 1 = off. Applied to the distribution left by min-p and top-k.
        min_p: [N] float32, 0 = off: keep p >= min_p * max p, i.e. scaled >= max + log(min_p).

    Returns:
        [N] float32 thresholds (-inf where no filter applies), or None when no row filters.
    """
    num_rows, vocab_size = scaled.shape
    if scaled.is_cuda and torch.cuda.is_current_stream_capturing():
        # Inside a CUDA graph nothing may be read back: apply every filter that is given (rows
        # where it is off get a -inf threshold from it, as below) and take the top-k over the
        # whole vocabulary. The thresholds are the same; only the work differs.
        use_k, use_p, use_min_p = top_k is not None, top_p is not None, min_p is not None
        max_k = vocab_size
    else:
        use_k = top_k is not None and bool(((top_k > 0) & (top_k < vocab_size)).any())
        use_p = top_p is not None and bool((top_p < 1).any())
        use_min_p = min_p is not None and bool((min_p > 0).any())
        max_k = int(top_k.clamp(0, vocab_size).max()) if use_k else 0
    if not (use_k or use_p or use_min_p):
        return None
    threshold = torch.full((num_rows,), float("-inf"), dtype=torch.float32, device=scaled.device)
    if use_min_p:
        row_max = scaled.amax(dim=-1)
        floor = row_max + torch.log(min_p.clamp_min(1e-38))
        threshold = torch.where(min_p > 0, floor, threshold)
    if use_k:
        k = top_k.clamp(0, vocab_size)
        top_values = scaled.topk(max(max_k, 1), dim=-1).values
        kth = top_values.gather(1, (k - 1).clamp_min(0)[:, None]).squeeze(1)
        on = (k > 0) & (k < vocab_size)
        threshold = torch.where(on, torch.maximum(threshold, kth), threshold)
    if use_p:
        masked = torch.where(scaled >= threshold[:, None], scaled, float("-inf"))
        sorted_desc = masked.sort(dim=-1, descending=True).values
        probs = sorted_desc.softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        num_kept = (mass_before < top_p[:, None]).sum(dim=-1).clamp_min(1)
        last_kept = sorted_desc.gather(1, (num_kept - 1)[:, None]).squeeze(1)
        threshold = torch.where(top_p < 1, torch.maximum(threshold, last_kept), threshold)
    return threshold


def process_logits(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor | None = None,
    top_p: torch.Tensor | None = None,
    min_p: torch.Tensor | None = None,
) -> torch.Tensor:
    """Processed logits: what is actually sampled from (-inf outside the support).

    Args:
        logits: [N, V] raw logits, any float dtype.
        temperature: [N] float32 (0 = greedy: the row is only scaled by 1).
        top_k, top_p, min_p: per-row filters as in `filter_threshold`.

    Returns:
        [N, V] float32.
    """
    scaled = scale_logits(logits, temperature)
    threshold = filter_threshold(scaled, top_k, top_p, min_p)
    if threshold is None:
        return scaled
    return scaled.masked_fill_(scaled < threshold[:, None], float("-inf"))
