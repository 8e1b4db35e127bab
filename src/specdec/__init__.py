"""specdec: an LLM inference engine whose speculative decoding is exact and reproducible."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:
    from specdec.engine.llm import LLM
    from specdec.sampling import SamplingParams, StructuredOutputsParams

__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "__version__"]


def __getattr__(name: str) -> Any:
    # Lazy, so that `import specdec` (and the CLI's --help) does not load the engine.
    if name == "LLM":
        from specdec.engine.llm import LLM

        return LLM
    if name == "SamplingParams":
        from specdec.sampling import SamplingParams

        return SamplingParams
    if name == "StructuredOutputsParams":
        from specdec.sampling import StructuredOutputsParams

        return StructuredOutputsParams
    raise AttributeError(f"module 'specdec' has no attribute {name!r}")
