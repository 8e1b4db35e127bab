"""Drafters shipped inside the package: an EAGLE head distilled from the built-in default model
(SmolLM2-135M-Instruct) by `specdec train-drafter` (see BENCHMARKS.md for the command and its
acceptance figures). Data files only; nothing here runs a model."""

from __future__ import annotations

from pathlib import Path

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
