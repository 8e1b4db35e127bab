"""Drafters shipped inside the package: an EAGLE head distilled from the built-in default model
(SmolLM2-135M-Instruct) by `specdec train-drafter` (see BENCHMARKS.md for the command and its
acceptance figures). Data files only; nothing here runs a model."""

from __future__ import annotations

from pathlib import Path

DEFAULT_EAGLE_DIR = Path(__file__).parent / "smollm2-135m-instruct-eagle"
# K = 2: the fastest K for this head on the CPU (1.28x at T = 0, 1.14x at T = 1; K = 4 is
# 0.98x / 0.81x). See BENCHMARKS.md.
DEFAULT_NUM_SPECULATIVE_TOKENS = 2


def default_speculative_config() -> dict | None:
    """The speculation used for the built-in model when none is asked for: the shipped EAGLE
    head at K = 2 (None if the head's files are missing from this installation)."""
    if not (DEFAULT_EAGLE_DIR / "model.safetensors").is_file():
        return None
    return {
        "method": "eagle",
        "model": str(DEFAULT_EAGLE_DIR),
        "num_speculative_tokens": DEFAULT_NUM_SPECULATIVE_TOKENS,
    }
