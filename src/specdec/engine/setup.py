"""Engine set-up, run once at start-up: the device and dtype an `EngineConfig` resolves to, the
longest request it allows, and the KV cache's size. Never steps, samples or draws randomness.
"""

from __future__ import annotations

import gc
import warnings

import torch

from specdec.drafters.block.checkpoint import read_block_drafter_config
from specdec.drafters.block.network import BLOCK_DRAFTER_KINDS
from specdec.drafters.config import EAGLE_HEAD_METHODS
from specdec.drafters.mtp import mtp_cache_layers
from specdec.engine.config import EngineConfig
from specdec.models import LlamaForCausalLM, cpu_extension
from specdec.models.linear import check_cublas_rows
from specdec.rng import use_native_rows
from specdec.sampling.processing import use_native_row_checks

CPU_KV_CACHE_BYTES = 1 << 30
# max_model_len of a model whose config declares no context length.
DEFAULT_MAX_MODEL_LEN = 4096


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' was asked for but no CUDA device is available")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, dtype)


def resolve_kv_cache_dtype(
    kv_cache_dtype: str, model_dtype: torch.dtype, device: torch.device
) -> torch.dtype:
    """The target KV cache's torch dtype: the model's for "auto", float8 e4m3 for "fp8" /
    "fp8_e4m3" (CUDA only).

    Raises:
        ValueError: FP8 asked for off CUDA, or an unknown name.
    """
    check_kv_cache_dtype(kv_cache_dtype, device)
    return model_dtype if kv_cache_dtype == "auto" else torch.float8_e4m3fn


def check_kv_cache_dtype(kv_cache_dtype: str, device: torch.device) -> None:
    """Refuses an unknown KV-cache dtype, and FP8 off CUDA (before any model loads)."""
    if kv_cache_dtype not in ("auto", "fp8", "fp8_e4m3"):
        raise ValueError(f"kv_cache_dtype must be auto, fp8 or fp8_e4m3, got {kv_cache_dtype!r}")
    if kv_cache_dtype != "auto" and device.type != "cuda":
        raise ValueError(
            f"kv_cache_dtype={kv_cache_dtype!r} needs CUDA (the CPU path keeps the model's "
            "dtype; use kv_cache_dtype='auto')"
        )


def resolve_max_model_len(config: EngineConfig, model: LlamaForCausalLM) -> int:
    """max_model_len: the configured one, else the model's declared context (its
    `max_position_embeddings`, extended by linear, dynamic or yarn RoPE scaling; `size_kv_cache`
    may lower it, saying why, when the KV cache cannot hold it).

    Raises:
        ValueError: the configured one exceeds the model's context.
    """
    context = model.config.context_length or DEFAULT_MAX_MODEL_LEN
    max_model_len = config.max_model_len or context
    if max_model_len > context:
        raise ValueError(f"max_model_len={max_model_len} exceeds the model's context of {context}")
    return max_model_len


def size_kv_cache(
    config: EngineConfig,
    model: LlamaForCausalLM,
    max_model_len: int,
    device: torch.device,
    draft_layers: int = 0,
) -> tuple[int, int]:
    """(KV-cache blocks, max_model_len): `num_kv_blocks` or what memory allows (the free GPU
    memory under gpu_memory_utilization on CUDA; max_num_seqs x max_model_len tokens, at most
    CPU_KV_CACHE_BYTES, on the CPU, where that is an address range: its pages are committed as
    requests write them, so the resident cache is what the requests need), and max_model_len
    lowered (with a warning) to what the cache holds, since a request alone must always fit.
    `draft_layers`: layers of a drafter's own paged cache with as many blocks as the target's
    (an EAGLE head, a draft model), counted in what memory must hold.

    Raises:
        ValueError: the cache would not hold one request of max_model_len.
    """
    num_blocks = config.num_kv_blocks or _default_num_blocks(
        config, model, max_model_len, device, draft_layers
    )
    if num_blocks * config.block_size < max_model_len:
        # A request alone must always fit, or it could neither run nor be preempted for.
        warnings.warn(
            f"max_model_len lowered from {max_model_len} to the KV cache's "
            f"{num_blocks * config.block_size} slots ({num_blocks} blocks of "
            f"{config.block_size}: "
            + ("num_kv_blocks" if config.num_kv_blocks else "what memory allows")
            + "), since one request must always fit",
            stacklevel=3,
        )
        max_model_len = num_blocks * config.block_size
    return num_blocks, max_model_len


def max_model_len_note(config: EngineConfig, model: LlamaForCausalLM, max_model_len: int) -> str:
    """Where the engine's max_model_len comes from, for the start-up log."""
    context = model.config.context_length or DEFAULT_MAX_MODEL_LEN
    wanted = config.max_model_len or context
    if max_model_len < wanted:
        return f"{max_model_len} (lowered from {wanted}: the KV cache holds {max_model_len} tokens)"
    if config.max_model_len:
        return f"{max_model_len} (as configured; the model's context is {context})"
    return f"{max_model_len} (the model's context)"


def kv_bytes_per_token(
    model: LlamaForCausalLM, kv_dtype: torch.dtype, draft_layers: int = 0
) -> int:
    """Bytes of K and V one token takes: the target's layers in the cache's `kv_dtype` (FP8:
    half of bfloat16), a drafter's `draft_layers` in the model's dtype (their caches keep it)."""
    cfg = model.config
    kv_itemsize = torch.empty((), dtype=kv_dtype).element_size()
    itemsize = torch.empty((), dtype=model.dtype).element_size()
    kv_heads = cfg.num_key_value_heads if model.shard is None else model.shard.num_kv_heads
    per_head = kv_heads * cfg.head_dim  # a tensor-parallel rank caches its own KV heads
    return 2 * per_head * (cfg.num_hidden_layers * kv_itemsize + draft_layers * itemsize)


GIB = 1 << 30


def cuda_kv_budget(utilization: float, free: int, total: int, held: int) -> float:
    """Bytes the KV cache may take on a GPU (vLLM's meaning of gpu_memory_utilization): that
    fraction of the device's memory, less what this process already holds (weights, buffers).
    Memory other processes hold is not shared out: when less is free than the budget, this
    says so instead of sizing a cache that would not fit.

    Args:
        utilization: gpu_memory_utilization.
        free, total: `torch.cuda.mem_get_info` (bytes).
        held: what this process's allocator holds (`torch.cuda.memory_reserved`).

    Raises:
        ValueError: the budget is not free (naming what is, and the utilization that fits), or
            this process already holds the whole budget.
    """
    wanted = utilization * total
    budget = wanted - held
    if budget <= 0:
        raise ValueError(
            f"this process already holds {held / GIB:.1f} GiB of the GPU (the model and its "
            f"buffers), all that gpu_memory_utilization={utilization} allows of its "
            f"{total / GIB:.1f} GiB, and the KV cache needs more: raise gpu_memory_utilization "
            "or load a smaller or quantized model"
        )
    if budget > free:
        others = total - free - held
        fits = int((free + held) / total * 100) / 100
        raise ValueError(
            f"gpu_memory_utilization={utilization} asks for {wanted / GIB:.1f} GiB of the "
            f"GPU's {total / GIB:.1f} GiB, but only {free / GIB:.1f} GiB are free (other "
            f"processes and the CUDA context hold {others / GIB:.1f} GiB, this process "
            f"{held / GIB:.1f} GiB): lower gpu_memory_utilization to {fits:.2f} or less, or "
            "free GPU memory"
        )
    return budget


def _default_num_blocks(
    config: EngineConfig,
    model: LlamaForCausalLM,
    max_model_len: int,
    device: torch.device,
    draft_layers: int = 0,
) -> int:
    kv_dtype = resolve_kv_cache_dtype(config.kv_cache_dtype, model.dtype, device)
    per_token = kv_bytes_per_token(model, kv_dtype, draft_layers)
    if device.type == "cuda":
        # Memory of engines that are gone (e.g. an earlier one in this process) is garbage
        # or cached by the allocator: give it back before measuring what is free.
        gc.collect()
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(device)
        held = torch.cuda.memory_reserved(device)
        budget = cuda_kv_budget(config.gpu_memory_utilization, free, total, held)
    else:
        needed = config.max_num_seqs * max_model_len * per_token
        budget = min(CPU_KV_CACHE_BYTES, needed)
    num_blocks = int(budget // (per_token * config.block_size))
    minimum = -(-max_model_len // config.block_size)
    if num_blocks < minimum and (config.max_model_len is not None or num_blocks < 1):
        raise ValueError(
            f"the KV cache fits {num_blocks} blocks, fewer than one request of "
            f"max_model_len={max_model_len} needs ({minimum}); lower max_model_len"
        )
    return num_blocks


def choose_products(model: LlamaForCausalLM, config: EngineConfig, max_query_len: int) -> None:
    """On CUDA, which of the model's float weights keep cuBLAS: those whose rows do not depend
    on the row count up to the most rows one of the engine's products can have (a step's token
    budget, or a decode step's rows); the rest take the row-invariant Triton GEMM
    (`models/linear.py`). Nothing on the CPU."""
    if model.device.type != "cuda":
        return
    max_rows = max(config.max_num_batched_tokens, config.max_num_seqs * max_query_len)
    check_cublas_rows(model.float_product_weights(), max_rows)


def draft_cache_layers(spec, model: LlamaForCausalLM) -> int:
    """Layers of the paged cache a drafter keeps beside the target's (same blocks): an EAGLE
    head's one layer, an MTP chain's one per layer, a truncated draft's N, another draft model
    counted as large as the target (its config is read only when it loads), a DFlash / DSpark
    drafter's layers (its device rounds' context pools); none for the other methods."""
    if spec is None:
        return 0
    if spec.method == "mtp":  # one cache layer per chained MTP layer
        return mtp_cache_layers(spec.model, spec.mtp_layers)
    if spec.method in EAGLE_HEAD_METHODS:
        return 1
    if spec.method in BLOCK_DRAFTER_KINDS and spec.model:
        return read_block_drafter_config(spec.model).num_hidden_layers
    if spec.method == "draft_model":
        prefix = "truncated:"
        if spec.model and spec.model.startswith(prefix) and spec.model[len(prefix) :].isdigit():
            return int(spec.model[len(prefix) :])
        return model.config.num_hidden_layers
    return 0


def check_gpu_count(tensor_parallel_size: int, device: torch.device) -> None:
    """Raises ValueError when CUDA has fewer devices than tensor-parallel ranks (one GPU each)."""
    if device.type == "cuda" and tensor_parallel_size > torch.cuda.device_count():
        raise ValueError(
            f"tensor_parallel_size={tensor_parallel_size} needs {tensor_parallel_size} CUDA "
            f"devices; this machine has {torch.cuda.device_count()}"
        )


def check_tensor_parallel(
    config: EngineConfig, device: torch.device, model: LlamaForCausalLM | None, spec
) -> None:
    """Refuses, in one line each, what tensor parallelism (tensor_parallel_size > 1) does not
    run: a model passed in already loaded, more ranks than CUDA devices, and a draft model
    made of the target's own layers."""
    size = config.tensor_parallel_size
    if model is not None:
        raise ValueError(
            f"tensor_parallel_size={size} loads each rank's shard from config.model: pass no "
            "loaded model"
        )
    check_gpu_count(size, device)
    if (
        spec is not None
        and spec.method == "draft_model"
        and str(spec.model).startswith("truncated:")
    ):
        raise ValueError(
            "a truncated draft model shares the target's layers, which are split over "
            f"tensor_parallel_size={size} ranks: use an EAGLE head, n-gram or another draft model"
        )


def use_native_sampling() -> None:
    """Hands `specdec.rng` the CPU extension's Philox rounds and float32 lanes, and the sampler its
    one-pass check of unusable logits rows (built or loaded now): the same words, uniforms and
    answers as their Python twins, for a fraction of their time (a full-vocabulary draw and
    check every sampled token). Nothing changes where the extension is not built."""
    extension = cpu_extension.load_extension()
    if extension is not None:
        use_native_rows(extension.philox_rows, extension.philox_uniform32_rows)
        use_native_row_checks(extension.unusable_rows_f32)
