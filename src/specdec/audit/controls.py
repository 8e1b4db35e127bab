"""Negative controls (deliberately broken variants) and the one spy: context managers that patch
attributes of `specdec.verify.verifier` / `specdec.sampling.sampler` and restore them on exit.
The only place the audit patches real code; it never creates randomness.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

import specdec.sampling.sampler as sampler_module
import specdec.verify.inputs as verify_inputs
import specdec.verify.verifier as verify_reference
from specdec.audit.drivers import default_draft_key
from specdec.rng import Stream, uniform_to_gumbel

CONTROLS = ("shared_noise", "residual_from_target", "position_keyed", "no_draft_prefix")


@contextlib.contextmanager
def _patched(module: object, name: str, replacement: object) -> Iterator[None]:
    original = getattr(module, name)
    setattr(module, name, replacement)
    try:
        yield
    finally:
        setattr(module, name, original)


@contextlib.contextmanager
def residual_from_target() -> Iterator[None]:
    """Broken verifier: every recovered token is drawn from the target itself.

    A Gumbel-max sampler needs no normalisation, so a Gumbel-max verifier cannot literally forget
    to renormalise max(target - draft, 0). The plausible way to get it wrong is the fallback for
    residuals that rounding leaves empty: testing emptiness with `any` instead of `all` fires on
    every row (the rejected token's residual weight is always -inf), so the recovered token comes
    from the whole target and the rejected draft's mass is never removed.
    """
    original = verify_reference.residual_log_weights

    def broken(target_logp, draft_logp, log_weight):
        log_res = original(target_logp, draft_logp, log_weight)
        empty = torch.isneginf(log_res).any(dim=-1)  # the bug: any instead of all
        log_res[empty] = target_logp[empty]
        return log_res

    with _patched(verify_reference, "residual_log_weights", broken):
        yield


@contextlib.contextmanager
def position_keyed_accept() -> Iterator[None]:
    """Broken verifier: ACCEPT uniforms keyed by position only (their step forced to 0).

    Block verification reads acceptance uniforms past the accepted prefix and the next round
    re-verifies those positions, so position-only keys reuse values already conditioned on a
    decision (DESIGN.md, "RNG contract"). Pair it with drafts keyed at step 0.
    """
    original = verify_reference.uniform

    def broken(seeds, positions, stream, num_lanes, *, step=0, dtype=torch.float32):
        step = 0 if stream == Stream.ACCEPT else step
        return original(seeds, positions, stream, num_lanes, step=step, dtype=dtype)

    with _patched(verify_reference, "uniform", broken):
        yield


@contextlib.contextmanager
def no_draft_prefix() -> Iterator[None]:
    """Broken verifier: every verify row is processed with the request's output alone, as if
    penalties and bans did not see the drafts before the row (the context a batched verifier
    has when it reuses the step's output counts for all K+1 rows)."""

    def broken(target_logits, draft_token_ids, num_draft, context):
        batch, num_rows, vocab = target_logits.shape
        rows = torch.arange(batch, device=target_logits.device).repeat_interleave(num_rows)
        flat = target_logits.reshape(batch * num_rows, vocab)
        return context.apply(flat, rows).view(batch, num_rows, vocab)

    with _patched(verify_inputs, "context_target_logits", broken):
        yield


def control_setup(
    control: str | None, method: str
) -> tuple[contextlib.AbstractContextManager, tuple[Stream, str] | None]:
    """(patch, draft_key) that turn the real code path into a negative control.

    - "shared_noise": drafts drawn from Stream.RESIDUAL at step 0, so a recovered token reuses
      the Gumbel field that picked the rejected draft (the vLLM bug, upstream #47386/#54282).
    - "residual_from_target": `residual_from_target`.
    - "position_keyed": `position_keyed_accept`, drafts keyed by position only too.
    - "no_draft_prefix": `no_draft_prefix` (penalty checks only).
    """
    if control is None:
        return contextlib.nullcontext(), None
    if control == "shared_noise":
        return contextlib.nullcontext(), (Stream.RESIDUAL, "zero")
    if control == "residual_from_target":
        return residual_from_target(), None
    if control == "position_keyed":
        return position_keyed_accept(), (default_draft_key(method)[0], "zero")
    if control == "no_draft_prefix":
        return no_draft_prefix(), None
    raise ValueError(f"control must be one of {CONTROLS} or None, got {control!r}")


@contextlib.contextmanager
def _seeds_reaching_rng() -> Iterator[set[int]]:
    """Records every seed that the verifier hands to `specdec.rng`."""
    seen: set[int] = set()
    original_uniform, original_gumbel = verify_reference.uniform, sampler_module.gumbel

    def uniform_spy(seeds, *args, **kwargs):
        seen.update(seeds.tolist())
        return original_uniform(seeds, *args, **kwargs)

    def gumbel_spy(seeds, *args, **kwargs):
        seen.update(seeds.tolist())
        return original_gumbel(seeds, *args, **kwargs)

    with (
        _patched(verify_reference, "uniform", uniform_spy),
        _patched(sampler_module, "gumbel", gumbel_spy),
    ):
        yield seen


def mantissa24_word_noise(words: torch.Tensor) -> torch.Tensor:
    """A plausible but too coarse map, 24 random bits as `torch.rand` keeps for float32:
    u = ((word >> 8) + 0.5) 2**-24. Its largest noise is 17.3, below the gap of 18."""
    return uniform_to_gumbel((((words >> 8).to(torch.float64) + 0.5) * 2.0**-24).float())
