"""specdec: an LLM inference engine whose speculative decoding is exact and reproducible."""

__version__ = "0.1.0"
