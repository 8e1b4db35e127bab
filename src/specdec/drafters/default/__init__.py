"""Drafters shipped inside the package: an EAGLE head distilled from the built-in default model
(SmolLM2-135M-Instruct) by `specdec train-drafter` (trained in session 14 on 8.1M self-distilled
tokens; BENCHMARKS.md has the command, [D11], and its acceptance figures). Data files only;
nothing here runs a model."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from specdec.drafters.config import SHIPPED_HEAD_METHODS, SpeculativeConfig
from specdec.models.registry import is_builtin_model

DEFAULT_EAGLE_DIR = Path(__file__).parent / "smollm2-135m-instruct-eagle"
# The shipped head's K by device type. The CPU: 1, because the kept-quantized target's int4
# kernel costs about as much for 2 rows as for 1 but ~1.9x for 3 (a K = 2 verify step is ~1.9
# plain steps): K = 1 1.17x / 0.93x plain at T = 0 / 1 against 1.01x / 0.65x for K = 2 (session
# 10; K = 2 was the fastest against the float target, session 6). CUDA: 4, the most the adaptive
# policy picks from: at batch 1 it beat K <= 2 for the s3 and the s13 heads at both temperatures
# (session 13), and the session 12 figures at batches 8-64 were taken with it. See BENCHMARKS.md
# areas 2b and 4.
DEFAULT_NUM_SPECULATIVE_TOKENS = {"cpu": 1, "cuda": 4}


def default_speculative_config(model: str | None, device_type: str) -> dict | None:
    """The speculation used when none is asked for (the one rule, for `LLM` and the commands):
    the shipped EAGLE head for the built-in model (`model` None or its file), at the K of
    `DEFAULT_NUM_SPECULATIVE_TOKENS` for `device_type` ("cpu" or "cuda": the engine's resolved
    device), if its files are in this installation; None otherwise."""
    if not is_builtin_model(model) or not (DEFAULT_EAGLE_DIR / "model.safetensors").is_file():
        return None
    if device_type not in DEFAULT_NUM_SPECULATIVE_TOKENS:
        raise ValueError(f"no default speculation for device type {device_type!r}")
    return {
        "method": "eagle",
        "model": str(DEFAULT_EAGLE_DIR),
        "num_speculative_tokens": DEFAULT_NUM_SPECULATIVE_TOKENS[device_type],
    }


def complete_speculative_config(
    values: dict | None, model: str | None, device_type: str
) -> dict | None:
    """A `speculative_config` dict that sets only some keys, with the default speculation's
    values for the rest when it keeps the default's drafter: for the built-in model,
    `{"rejection_sample_method": "block"}` or `{"method": "eagle"}` keep the shipped head at
    this device's K. A dict naming another method or drafter model (or any dict for another
    target) is returned as it is (`SpeculativeConfig`'s own defaults fill it).

    Args:
        values: the caller's keys (None: no speculation, returned as it is).
        model, device_type: as in `default_speculative_config`.
    """
    if not isinstance(values, dict):
        return values
    default = default_speculative_config(model, device_type)
    if default is None:
        return values
    if values.get("method", default["method"]) not in SHIPPED_HEAD_METHODS:
        return values
    if values.get("model", default["model"]) != default["model"]:
        return values
    return {**default, **values}


def with_shipped_head(
    spec: SpeculativeConfig | None, builtin_target: bool, target_path: str | None = None
) -> SpeculativeConfig | None:
    """`spec`, with the shipped EAGLE head as its `model` when it asks for "eagle" / "mtp"
    without one on the built-in target. "mtp" without one on another target reads the MTP
    layers of the target's own checkpoint, `target_path` (left unset when None: a check made
    before the target is known).

    Raises:
        ValueError: such a spec for another target (it has no shipped head), or an
            installation without the head's files.
    """
    if spec is None or spec.model or spec.method not in SHIPPED_HEAD_METHODS:
        return spec
    if not builtin_target:
        if spec.method == "mtp":
            return spec if target_path is None else dataclasses.replace(spec, model=target_path)
        raise ValueError(
            f'speculative_config.method "{spec.method}" needs "model" (a head directory '
            "written by `specdec train-drafter --kind eagle`); only the built-in model has a "
            "shipped head"
        )
    if not (DEFAULT_EAGLE_DIR / "model.safetensors").is_file():
        raise ValueError(f"the shipped EAGLE head is missing from {DEFAULT_EAGLE_DIR}")
    return dataclasses.replace(spec, model=str(DEFAULT_EAGLE_DIR))
