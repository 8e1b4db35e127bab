"""Engine and speculation settings, with vLLM's names; defaults are defined here once (the CLI and
server derive their flags from these dataclasses). Validation only: no tensors, no randomness.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from specdec.verify import VERIFY_METHODS

SPECULATIVE_METHODS = ("ngram", "draft_model", "eagle", "mtp", "dflash", "dspark")
# Methods whose drafter is loaded from `model` (a directory or file).
MODEL_METHODS = ("draft_model", "eagle", "mtp", "dflash", "dspark")
DRAFT_SAMPLE_METHODS = ("greedy", "probabilistic")


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """vLLM's `speculative_config` keys.

    Attributes:
        method: "ngram" (prompt lookup), "draft_model", "eagle" (alias "mtp": a head over
            the target's hidden features), "dflash" (a parallel block drafter over the target's
            features) or "dspark" (dflash + Markov head + confidence-scheduled verify length).
        model: the draft model (a Hugging Face directory or a GGUF file) for "draft_model";
            "truncated:N" uses the target's first N layers (with its embeddings and head). For
            "eagle"/"mtp": a head directory (config.json + model.safetensors, as written by
            `specdec train-drafter --kind eagle`). For "dflash"/"dspark": a block drafter
            directory (written by `specdec train-drafter --kind dflash|dspark`).
        num_speculative_tokens: drafts per round, K.
        draft_sample_method: "probabilistic" (drafts sampled from the draft distribution, which
            the verifier is given) or "greedy" (the draft's argmax, verified as a one-hot draft).
        rejection_sample_method: "standard", "block" or "coupled".
        prompt_lookup_min / prompt_lookup_max: n-gram sizes tried by "ngram".
    """

    method: str = "ngram"
    model: str | None = None
    num_speculative_tokens: int = 4
    draft_sample_method: str = "probabilistic"
    rejection_sample_method: str = "standard"
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(
                f"speculative_config.method must be one of {SPECULATIVE_METHODS}, "
                f"got {self.method!r}"
            )
        if self.method in MODEL_METHODS and not self.model:
            raise ValueError(f'speculative_config.method "{self.method}" needs "model"')
        if not isinstance(self.num_speculative_tokens, int) or not (
            1 <= self.num_speculative_tokens <= 32
        ):
            raise ValueError(
                "speculative_config.num_speculative_tokens must be an integer in [1, 32], got "
                f"{self.num_speculative_tokens!r}"
            )
        if self.draft_sample_method not in DRAFT_SAMPLE_METHODS:
            raise ValueError(
                f"speculative_config.draft_sample_method must be one of {DRAFT_SAMPLE_METHODS}, "
                f"got {self.draft_sample_method!r}"
            )
        if self.rejection_sample_method not in VERIFY_METHODS:
            raise ValueError(
                f"speculative_config.rejection_sample_method must be one of {VERIFY_METHODS}, "
                f"got {self.rejection_sample_method!r}"
            )
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(
                "speculative_config needs 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                f"{self.prompt_lookup_min}, {self.prompt_lookup_max}"
            )

    @staticmethod
    def from_dict(values: dict[str, Any] | SpeculativeConfig | None) -> SpeculativeConfig | None:
        """Builds a config from vLLM-style keys; unknown keys raise ValueError naming them."""
        if values is None or isinstance(values, SpeculativeConfig):
            return values
        if not isinstance(values, dict):
            raise ValueError(f"speculative_config must be a dict, got {type(values).__name__}")
        known = {f.name for f in dataclasses.fields(SpeculativeConfig)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(
                f"unknown speculative_config keys {unknown}; known keys: {sorted(known)}"
            )
        return SpeculativeConfig(**values)


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Engine arguments (vLLM's names).

    Attributes:
        model: a Hugging Face directory or a GGUF file; None = the built-in default.
        dtype: "auto" (bfloat16 on CUDA, float32 on CPU), "float32", "bfloat16" or "float16".
        device: "auto" (CUDA when available), "cpu" or "cuda".
        max_num_seqs: requests per step.
        max_num_batched_tokens: query tokens per step (prefill chunks included).
        max_model_len: tokens per request; None = the model's context length.
        block_size: tokens per KV-cache block.
        num_kv_blocks: KV-cache blocks; None = sized from gpu_memory_utilization (CUDA) or
            from max_num_seqs x max_model_len (CPU).
        gpu_memory_utilization: fraction of GPU memory the engine may use.
        enforce_eager: never capture CUDA graphs.
        async_scheduling: while a plain decode step runs on the device, schedule and launch the
            next one, feeding it the sampled tokens on the device, and read the earlier step's
            tokens meanwhile (host work overlaps the GPU; outputs are the same, reported one
            step later). Only steps in which every request decodes without speculation or
            logprobs are overlapped; the others run as usual. True / "on", False / "off", or
            "auto" (the default): on for CUDA, off on the CPU (where nothing runs beside the
            host, so there is nothing to overlap).
    """

    model: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    block_size: int = 16
    num_kv_blocks: int | None = None
    gpu_memory_utilization: float = 0.9
    enforce_eager: bool = False
    async_scheduling: bool | str = "auto"

    def __post_init__(self) -> None:
        choices = {"on": True, "true": True, "off": False, "false": False, "auto": "auto"}
        if isinstance(self.async_scheduling, str):
            if self.async_scheduling.lower() not in choices:
                raise ValueError(
                    f"async_scheduling must be auto, on or off, got {self.async_scheduling!r}"
                )
            object.__setattr__(self, "async_scheduling", choices[self.async_scheduling.lower()])
        elif not isinstance(self.async_scheduling, bool):
            raise ValueError(
                f"async_scheduling must be True, False or 'auto', got {self.async_scheduling!r}"
            )
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(
                f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}"
            )
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device must be auto, cpu or cuda, got {self.device!r}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )

    @staticmethod
    def from_kwargs(**kwargs: Any) -> EngineConfig:
        known = {f.name for f in dataclasses.fields(EngineConfig)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ValueError(f"unknown engine arguments {unknown}; known: {sorted(known)}")
        return EngineConfig(**kwargs)
