"""The arguments of `verify`: their shapes and types (`check_verify_inputs`), their value rules
(`ValueCheck`: checked on the host on the CPU, by one small kernel on CUDA), the target rows a
round reads (`rows_read`, `first_unusable_read_row`), and the result type.
Never creates noise and never verifies.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdec.sampling.context import LogitsContext
from specdec.sampling.processing import (
    SAMPLING_RULE_MESSAGES,
    UNUSABLE_ROW_MESSAGE,
    RowParam,
    sampling_rule_flags,
    unusable_rows,
)
from specdec.sampling.slot_rules import SlotRulesView
from specdec.sampling.tensors import SamplingTensors
from specdec.transfer import Readback

VERIFY_METHODS = ("standard", "block", "coupled")
# The largest position a draw may be keyed by (a 32-bit counter word). A round keys positions
# positions[b] .. positions[b] + K, so verify needs positions[b] <= MAX_POSITION - K, on the CPU
# and on the GPU alike.
MAX_POSITION = 2**32 - 1


@dataclass(frozen=True, slots=True)
class VerifyResult:
    """Attributes:
    token_ids: [B, K+1] int64 emitted tokens (accepted drafts, then the recovered or bonus
        token), padded with -1.
    num_accepted: [B] int64 accepted drafts per row; the row emits num_accepted + 1 tokens.
    """

    token_ids: torch.Tensor
    num_accepted: torch.Tensor


@dataclass(frozen=True, slots=True)
class VerifyInputs:
    """Validated `verify` arguments (see `check_verify_inputs`)."""

    target_logits: torch.Tensor  # [B, K+1, V]
    draft_token_ids: torch.Tensor  # [B, K] int64
    draft_logits: torch.Tensor | None  # [B, K, V]
    draft_logsumexp: torch.Tensor | None  # [B, K] float32
    seeds: torch.Tensor  # [B] int64
    positions: torch.Tensor  # [B] int64
    params: SamplingTensors  # [B] each
    num_draft: torch.Tensor  # [B] int64 in [0, K]
    method: str
    active_rows: int


def check_verify_inputs(
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
    check_values: bool = True,
    context: LogitsContext | SlotRulesView | None = None,
) -> VerifyInputs:
    """Checks shapes, dtypes and values; raises ValueError/TypeError naming the problem.

    `check_values=False` skips the value checks (the one host round trip) for callers that build
    their inputs valid by construction (the engine); shapes and dtypes are always checked.
    Checked here, every live target row (0..num_draft[b]) must have a distribution, as if every
    bonus row were read (`verify_tree` relies on this); `verify` itself refuses a bonus row only
    when its outcome reads it (`ValueCheck.wait_read`).
    With a `context`, the returned target logits are the context-processed ones
    (`context_target_logits`)."""
    if method not in VERIFY_METHODS:
        raise ValueError(f"method must be one of {VERIFY_METHODS}, got {method!r}")
    if target_logits.dim() != 3 or not target_logits.is_floating_point():
        raise ValueError(
            f"target_logits must be a float tensor [B, K+1, V], got {list(target_logits.shape)}"
        )
    batch, num_rows, vocab = target_logits.shape
    k = num_rows - 1
    if k < 0:
        raise ValueError("target_logits must have K+1 >= 1 rows per request")
    device = target_logits.device
    if draft_token_ids.dtype != torch.int64 or draft_token_ids.shape != (batch, k):
        raise ValueError(
            f"draft_token_ids must be int64 [B={batch}, K={k}], got "
            f"{draft_token_ids.dtype} {list(draft_token_ids.shape)}"
        )
    if draft_logits is not None and draft_logits.shape != (batch, k, vocab):
        raise ValueError(
            f"draft_logits must have shape [B={batch}, K={k}, V={vocab}] (target vocabulary), "
            f"got {list(draft_logits.shape)}"
        )
    if draft_logsumexp is not None:
        if draft_logits is None:
            raise ValueError("draft_logsumexp is given without draft_logits")
        if draft_logsumexp.shape != (batch, k):
            raise ValueError(f"draft_logsumexp must have shape [{batch}, {k}]")
    for name, t in (("seeds", seeds), ("positions", positions)):
        if t.dtype != torch.int64 or t.shape != (batch,):
            raise ValueError(f"{name} must be int64 [B={batch}], got {t.dtype} {list(t.shape)}")
    if num_draft is None:
        num_draft = torch.full((batch,), k, dtype=torch.int64, device=device)
    elif num_draft.dtype != torch.int64 or num_draft.shape != (batch,):
        raise ValueError(f"num_draft must be int64 [B={batch}], got {list(num_draft.shape)}")
    if active_rows is None:
        active_rows = batch
    if not 0 <= int(active_rows) <= batch:
        raise ValueError(f"active_rows must lie in [0, B={batch}], got {active_rows}")
    active_rows = int(active_rows)
    params = SamplingTensors.build(batch, device, temperature, top_k, top_p, min_p, check=False)
    if context is not None:
        if context.num_rows != batch:
            raise ValueError(f"context has {context.num_rows} requests for B={batch}")
        target_logits = context_target_logits(target_logits, draft_token_ids, num_draft, context)
    if check_values:
        check = ValueCheck(
            draft_token_ids,
            draft_logits,
            positions,
            num_draft,
            params,
            method,
            active_rows,
            vocab,
            target_logits,
        )
        check.wait()
        check.wait_read(None)
    return VerifyInputs(
        target_logits,
        draft_token_ids,
        draft_logits,
        draft_logsumexp,
        seeds,
        positions,
        params,
        num_draft,
        method,
        active_rows,
    )


def context_target_logits(
    target_logits: torch.Tensor,
    draft_token_ids: torch.Tensor,
    num_draft: torch.Tensor,
    context: LogitsContext | SlotRulesView,
) -> torch.Tensor:
    """Target logits processed by each request's context, row j as if drafts 0..j-1 had been
    accepted: verify row j of request b is processed with drafts b, 0..min(j, num_draft[b])-1
    appended to the request's output, which is how plain decoding processes that position
    once they are (so verification stays exact for penalties and context-dependent bans).

    Args:
        target_logits: [B, K+1, V] raw target logits.
        draft_token_ids: [B, K] int64 drafts (entries at or beyond num_draft[b] are ignored).
        num_draft: [B] int64.
        context: the B requests' `LogitsContext` (or the rules of B device-round slots).

    Returns:
        [B, K+1, V] float32.
    """
    batch, num_rows, vocab = target_logits.shape
    k = num_rows - 1
    device = target_logits.device
    columns = torch.arange(k, device=device)
    before = columns[None, None, :] < torch.arange(num_rows, device=device)[None, :, None]
    live = columns[None, :] < num_draft[:, None]  # [B, K]
    # [B, K+1, K]: draft i counts in row j's context iff i < j and i < num_draft.
    valid = before & live[:, None, :]
    prefix = torch.where(valid, draft_token_ids[:, None, :], -1).reshape(batch * num_rows, k)
    rows = torch.arange(batch, device=device).repeat_interleave(num_rows)
    flat = target_logits.reshape(batch * num_rows, vocab)
    return context.apply(flat, rows, prefix).view(batch, num_rows, vocab)


def rows_read(num_draft: torch.Tensor, num_accepted: torch.Tensor, num_rows: int) -> torch.Tensor:
    """The target rows a verified round read: rows 0..n-1 (n = num_draft[b]) whatever the
    outcome, and the bonus row n when all n drafts were accepted. Rows past n are never read.

    Rows 0..n-1 count as read even past the first rejection: block verification reads every one
    of them (its h_i, Sun et al. 2024, Alg. 2) and the other methods evaluate their acceptance
    tests together, so whether such a row is refused never depends on the round's draws. A
    rejection draws the recovered token from row `num_accepted` (< n), which is one of them.

    Args:
        num_draft: [B] int64 in [0, K].
        num_accepted: [B] int64 in [0, num_draft].
        num_rows: K + 1.

    Returns:
        [B, K+1] bool.
    """
    rows = torch.arange(num_rows, device=num_draft.device)[None, :]
    bonus = (rows == num_draft[:, None]) & (num_accepted == num_draft)[:, None]
    return (rows < num_draft[:, None]) | bonus


def first_unusable_read_row(
    target_logits: torch.Tensor, num_draft: torch.Tensor, num_accepted: torch.Tensor
) -> torch.Tensor:
    """Per request, the first row its verified round read (`rows_read`) that has no distribution
    (`unusable_rows`), or -1. Device ops only, no host sync (CUDA-graph safe): the engine reads
    it back with the round's tokens and ends such a request instead of emitting.

    Args:
        target_logits: [B, K+1, V] the target logits verify read (context-processed, if any).
        num_draft: [B] int64 in [0, K].
        num_accepted: [B] int64, verify's result.

    Returns:
        [B] int64 row index in [0, K], or -1.
    """
    num_rows = target_logits.shape[1]
    bad = unusable_rows(target_logits) & rows_read(num_draft, num_accepted, num_rows)
    rows = torch.arange(num_rows, device=bad.device)[None, :]
    first = torch.where(bad, rows, num_rows).amin(dim=-1)
    return torch.where(first < num_rows, first, -1)


def value_rule_messages(k: int, vocab: int) -> list[str]:
    """The messages of `verify`'s value rules, in the order they are checked (rule r is bit r of
    the GPU's rule word, `specdec.sampling.checks_triton`). The target rows' own rule (a row
    read without a distribution) is checked after them (`ValueCheck`)."""
    return [
        f"positions must lie in [0, 2**32 - 1 - K] = [0, {MAX_POSITION - k}] for K={k}: a "
        "round keys its draws by positions[b] .. positions[b] + K, 32-bit counter words",
        f"num_draft must lie in [0, K={k}]",
        f"draft_token_ids must lie in [0, V={vocab}) within num_draft",
        *SAMPLING_RULE_MESSAGES,
        "a draft token has zero probability under its draft_logits: draft_logits "
        "must be the processed logits the drafts were sampled from",
    ]


def unusable_draft_row_message(b: int, j: int) -> str:
    """The error of a draft row (j < num_draft[b]) without a distribution."""
    return (
        f"target_logits[{b}, {j}] {UNUSABLE_ROW_MESSAGE}; request {b} reads it to test its "
        f"draft {j}"
    )


def unusable_bonus_row_message(b: int, n: int, outcome_known: bool) -> str:
    """The error of a bonus row (n = num_draft[b]) without a distribution: read after a full
    chain (`outcome_known`), or counted as read before any outcome is known."""
    if not outcome_known:
        return f"target_logits[{b}, {n}] {UNUSABLE_ROW_MESSAGE}; every live row must have one"
    return (
        f"target_logits[{b}, {n}] {UNUSABLE_ROW_MESSAGE}; request {b} accepted all {n} drafts "
        "and draws its bonus token from it"
    )


class ValueCheck:
    """The value checks of one `verify` call, made without stalling the device.

    On CUDA one small kernel evaluates the argument rules (`specdec.sampling.checks_triton`)
    ahead of the verify kernels and one asynchronous copy brings the rule word to pinned host
    memory; `wait()` waits for that copy only (not for work queued after it, such as the verify
    kernels) and raises ValueError naming the first violated rule. Elsewhere the same rules run
    as PyTorch ops.

    The target rows (given `target_logits`) are checked against what the round reads
    (`rows_read`), by PyTorch reductions on every device read back by a copy of their own:
    `wait()` refuses a draft row (j < num_draft[b]) without a distribution, which every outcome
    reads; `wait_read(num_accepted)`, once the result is known, refuses a bonus row without one
    only if its request accepted every draft. The bonus rule costs nothing more unless some
    live bonus row is unusable: only then does `wait_read` read the result (one more sync).
    """

    def __init__(
        self,
        draft_token_ids: torch.Tensor,
        draft_logits: torch.Tensor | None,
        positions: torch.Tensor,
        num_draft: torch.Tensor,
        params: SamplingTensors,
        method: str,
        active_rows: int,
        vocab: int,
        target_logits: torch.Tensor | None = None,
    ) -> None:
        k = draft_token_ids.shape[1]
        at_draft = draft_logits is not None and method != "coupled" and k > 0 and active_rows > 0
        self._layout = (k, vocab)
        self._checked = False
        self._device_bits = None
        self._rows = None  # the read-back of the target rows' rule
        self._bonus_bad = None  # [A] bool on the device: the live bonus row has no distribution
        self._num_draft = num_draft[:active_rows]
        if target_logits is not None and active_rows > 0:
            self._read_target_rows(target_logits[:active_rows], self._num_draft, k)
        if positions.is_cuda:
            from specdec.sampling.checks_triton import DeviceRuleBits

            self._device_bits = DeviceRuleBits(
                draft_token_ids,
                draft_logits,
                positions,
                num_draft,
                params,
                active_rows,
                vocab,
                MAX_POSITION - k,
                at_draft,
            )
            return
        drafts = draft_token_ids[:active_rows]  # [A, K]
        live = torch.arange(k, device=positions.device)[None, :] < num_draft[:active_rows, None]
        none = torch.zeros((), dtype=torch.bool, device=positions.device)
        flags = [
            ((positions < 0) | (positions > MAX_POSITION - k)).any(),
            ((num_draft < 0) | (num_draft > k)).any(),
            (live & ((drafts < 0) | (drafts >= vocab))).any(),
            *(
                none if flag is None else flag
                for flag in sampling_rule_flags(
                    params.temperature, params.top_k, params.top_p, params.min_p
                )
            ),
        ]
        if at_draft:
            logit = draft_logits[:active_rows].gather(-1, drafts.clamp(0, vocab - 1)[..., None])
            logit = logit[..., 0]
            flags.append((live & (torch.isneginf(logit) | torch.isnan(logit))).any())
        else:
            flags.append(none)
        self._flags = torch.stack(flags).tolist()

    def _read_target_rows(self, target: torch.Tensor, num_draft: torch.Tensor, k: int) -> None:
        """Starts the read-back of the first unusable draft row (flat index into [A, K], or -1)
        and of whether some live bonus row is unusable; keeps the bonus rows' flags."""
        bad = unusable_rows(target)  # [A, K+1]
        rows = torch.arange(k, device=target.device)[None, :]
        draft_bad = (bad[:, :k] & (rows < num_draft[:, None])).flatten()
        first = torch.full((), -1, dtype=torch.int64, device=target.device)
        if draft_bad.numel():
            first = torch.where(draft_bad.any(), draft_bad.to(torch.int8).argmax(), first)
        # Clamped so that an invalid num_draft (refused by the rule word) still indexes in range.
        self._bonus_bad = bad.gather(1, num_draft.clamp(0, k)[:, None])[:, 0]
        # Read back by an asynchronous copy of its own: waiting for it waits for these
        # reductions only, not for the verify kernels queued after them.
        self._rows = Readback(
            {"first": first.reshape(1), "bonus": self._bonus_bad.any().reshape(1)}, {}
        )

    def bits(self) -> int:
        """The rule word: bit r set when rule r of `value_rule_messages` is violated (waits for
        the device's copy on CUDA). The target rows' rule is not part of it."""
        if self._device_bits is not None:
            return self._device_bits.bits()
        return sum(1 << r for r, violated in enumerate(self._flags) if violated)

    def wait(self) -> None:
        """Waits for the values and raises ValueError naming the first violated rule, then a
        draft row without a distribution (`target_logits[b, j]`)."""
        if self._checked:
            return
        bits = self.bits()
        if bits:
            first = (bits & -bits).bit_length() - 1
            raise ValueError(value_rule_messages(*self._layout)[first])
        if self._rows is not None:
            first = int(self._rows.values()["first"][0])
            if first >= 0:
                k = self._layout[0]
                raise ValueError(unusable_draft_row_message(first // k, first % k))
        self._checked = True

    def wait_read(self, num_accepted: torch.Tensor | None) -> None:
        """Raises ValueError when a request's bonus row has no distribution and its outcome
        reads it: it accepted all its drafts (`num_accepted`, [B] int64: verify's result), or
        always when `num_accepted` is None (every bonus row counts as read). Call after
        `wait()`. Reads the result back only when some live bonus row is unusable."""
        if self._rows is None or not bool(self._rows.values()["bonus"][0]):
            return
        read = self._bonus_bad
        if num_accepted is not None:
            read = read & (num_accepted[: read.shape[0]] == self._num_draft)
        hit = read.nonzero()
        if hit.numel():
            b = int(hit[0, 0])
            n = int(self._num_draft[b])
            raise ValueError(unusable_bonus_row_message(b, n, num_accepted is not None))
