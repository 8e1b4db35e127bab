"""Drafters shipped inside the package: an EAGLE head distilled from the built-in default model
(SmolLM2-135M-Instruct) by `specdec train-drafter` (see BENCHMARKS.md for the command and its
acceptance figures). Data files only; nothing here runs a model."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from specdec.drafters.config import SHIPPED_HEAD_METHODS, SpeculativeConfig

DEFAULT_EAGLE_DIR = Path(__file__).parent / "smollm2-135m-instruct-eagle"
# K = 2: the fastest K for this head on the CPU (1.21x at T = 0, 1.13x at T = 1; K = 4 is
# 0.97x / 0.81x; session 6). See BENCHMARKS.md.
DEFAULT_NUM_SPECULATIVE_TOKENS = 2


def default_speculative_config(model: str | None) -> dict | None:
    """The speculation used when none is asked for (the one rule, for `LLM` and the commands):
    the shipped EAGLE head at K = 2 for the built-in model (`model` None), if its files are in
    this installation; None otherwise."""
    if model is not None or not (DEFAULT_EAGLE_DIR / "model.safetensors").is_file():
        return None
    return {
        "method": "eagle",
        "model": str(DEFAULT_EAGLE_DIR),
        "num_speculative_tokens": DEFAULT_NUM_SPECULATIVE_TOKENS,
    }


def with_shipped_head(
    spec: SpeculativeConfig | None, builtin_target: bool
) -> SpeculativeConfig | None:
    """`spec`, with the shipped EAGLE head as its `model` when it asks for "eagle" / "mtp"
    without one on the built-in target.

    Raises:
        ValueError: such a spec for another target (it has no shipped head), or an
            installation without the head's files.
    """
    if spec is None or spec.model or spec.method not in SHIPPED_HEAD_METHODS:
        return spec
    if not builtin_target:
        raise ValueError(
            f'speculative_config.method "{spec.method}" needs "model" (a head directory '
            "written by `specdec train-drafter --kind eagle`); only the built-in model has a "
            "shipped head"
        )
    if not (DEFAULT_EAGLE_DIR / "model.safetensors").is_file():
        raise ValueError(f"the shipped EAGLE head is missing from {DEFAULT_EAGLE_DIR}")
    return dataclasses.replace(spec, model=str(DEFAULT_EAGLE_DIR))
