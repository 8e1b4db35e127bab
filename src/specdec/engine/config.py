"""Engine settings with vLLM's names (`SpeculativeConfig`, defined beside the drafters, is
re-exported here); defaults are defined here once (the CLI and server derive their flags from these
dataclasses). Validation only: no tensors, no randomness.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from specdec.drafters.config import (  # noqa: F401 - re-exported: the engine's settings
    DRAFT_SAMPLE_METHODS,
    MODEL_METHODS,
    SPECULATIVE_METHODS,
    SpeculativeConfig,
)
from specdec.models.quant_formats import QUANTIZATIONS

DTYPES = ("auto", "float32", "bfloat16", "float16")
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")
DEVICES = ("auto", "cpu", "cuda")
# Graphed prefill: prompts of at most AUTO_PREFILL_GRAPH_TOKENS tokens (the "auto" default on
# CUDA, enforce_eager included) are prefilled on the decode path (its CUDA graphs),
# PREFILL_GRAPH_WIDTH tokens per sequence and step.
PREFILL_GRAPH_WIDTH = 16
AUTO_PREFILL_GRAPH_TOKENS = 128


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
        gpu_memory_utilization: fraction of the GPU's memory this engine may use, weights
            included (vLLM's meaning); other processes' memory is not shared out: start-up
            fails, saying what is free, when less than that is.
        enforce_eager: never capture CUDA graphs.
        quantization: what the linear layers run as: "auto" (the default: "gguf" for a GGUF
            file on the CPU, "fp8" for an FP8 checkpoint, float otherwise: a GGUF file on CUDA
            is dequantized), "gguf" (a GGUF file's own Q8_0/Q4_0/Q4_1/Q4_K/Q6_K tensors, kept
            quantized), "int8" (per channel), "int4" (group-wise), "fp8" (e4m3, per channel) or
            None / "none" (dequantize to `dtype`). `dtype` stays the activation dtype.
        async_scheduling: while a plain decode step runs on the device, schedule and launch the
            next one, feeding it the sampled tokens on the device, and read the earlier step's
            tokens meanwhile (host work overlaps the GPU; outputs are the same, reported one
            step later). Only steps in which every request decodes without speculation or
            logprobs are overlapped; the others run as usual. True / "on", False / "off", or
            "auto" (the default): on for CUDA, off on the CPU (where nothing runs beside the
            host, so there is nothing to overlap).
        seed: the engine's seed: requests without a seed of their own get seeds derived from
            it in the order they arrive, so a script run twice replays (None: a fresh seed per
            request, recorded in its output).
        tensor_parallel_size: processes (one GPU each on CUDA) the target is split over
            (tensor parallelism: heads, MLP columns and vocabulary; see
            docs/tensor-parallel.md). The scheduler, sampler, verifier and drafter run once,
            on rank 0. It must split the model's heads (checked at load).
        kv_cache_dtype: the target's KV cache: "auto" (the model's dtype) or "fp8" / "fp8_e4m3"
            (float8 e4m3, CUDA only: half the bytes of bfloat16; values are stored as they are,
            a per-tensor scale of 1.0 as vLLM uses without calibration, saturating at +-448).
            Drafters' own caches keep the model's dtype.
        prefill_graph_tokens: prompts (tokens still to prefill) of at most this many tokens are
            prefilled on the decode path's CUDA graphs, in chunks of PREFILL_GRAPH_WIDTH (16)
            tokens per sequence, instead of one eager step (whose kernel launches bound a
            short prompt's prefill: about 35 ms for a short prompt of SmolLM2-135M on an H200);
            longer prompts, and steps that want every row's logits (prompt logprobs), run
            eagerly. "auto" (the default): 128 on CUDA (with enforce_eager too, where the
            decode path runs the same chunks op by op, so that eager and graphed engines
            compute the same numbers), 0 on the CPU; 0 turns it off.
        warm_up: before the first request (`specdec serve`, whose /health answers 503 until
            it is done, and `specdec generate`), run every step shape the engine takes under
            traffic once on inert inputs (`LLMEngine.warm_up`), so that its CUDA graphs are
            captured at start-up instead of in the middle of traffic. Nothing to capture, so
            skipped, on the CPU and with enforce_eager. The engine never warms up by itself.
    """

    model: str | None = None
    dtype: str = field(default="auto", metadata={"choices": DTYPES})
    device: str = field(default="auto", metadata={"choices": DEVICES})
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    block_size: int = 16
    num_kv_blocks: int | None = None
    gpu_memory_utilization: float = 0.9
    enforce_eager: bool = False
    async_scheduling: bool | str = "auto"
    seed: int | None = None
    tensor_parallel_size: int = 1
    quantization: str | None = "auto"
    kv_cache_dtype: str = field(default="auto", metadata={"choices": KV_CACHE_DTYPES})
    prefill_graph_tokens: int | str = "auto"
    warm_up: bool = True

    def __post_init__(self) -> None:
        graphed = self.prefill_graph_tokens
        if isinstance(graphed, str) and graphed.strip().isdigit():  # the command line's text
            graphed = int(graphed)
            object.__setattr__(self, "prefill_graph_tokens", graphed)
        if graphed != "auto" and (
            not isinstance(graphed, int) or isinstance(graphed, bool) or graphed < 0
        ):
            raise ValueError(
                f"prefill_graph_tokens must be 'auto' or an integer >= 0, got {graphed!r}"
            )
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                f"got {self.kv_cache_dtype!r}"
            )
        if isinstance(self.quantization, str) and self.quantization.lower() == "none":
            object.__setattr__(self, "quantization", None)
        if self.quantization not in (None, "auto", *QUANTIZATIONS):
            raise ValueError(
                f"quantization must be auto, {', '.join(QUANTIZATIONS)} or None, "
                f"got {self.quantization!r}"
            )
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
        if self.dtype not in DTYPES:
            raise ValueError(
                f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}"
            )
        if self.device not in DEVICES:
            raise ValueError(f"device must be auto, cpu or cuda, got {self.device!r}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if self.seed is not None and (
            not isinstance(self.seed, int)
            or isinstance(self.seed, bool)
            or not -(2**63) <= self.seed < 2**64
        ):
            raise ValueError(f"seed must be an integer that fits in 64 bits, got {self.seed!r}")
        tp = self.tensor_parallel_size
        if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
            raise ValueError(f"tensor_parallel_size must be an integer >= 1, got {tp!r}")
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
