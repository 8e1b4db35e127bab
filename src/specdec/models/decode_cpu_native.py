"""The CPU decode step's decoder layers as one C++ call (`csrc/decode_layers.cpp`).

On the CPU a quantized model's decode step is bound by the work between its operations, not
by arithmetic (BENCHMARKS area 6: a few thousand small operations a token). The C++ loop runs
the very ATen operations of the Python loop (`LlamaModel._forward_decode` over
`LlamaDecoderLayer.forward_decode` with a `DecodePlanCPU`), in the same order on the same
views, so a step's logits, K/V and captured layers are the Python loop's bit for bit (tests
compare them): the Python loop is its twin, and the fallback wherever the C++ cannot run.

It runs models whose layers are all the plain Llama kind: RMSNorm before attention and MLP
(float32), fused q/k/v and gate/up products in PyTorch's CPU int4 layout with no bias, no q/k
norm, SiLU, no sliding window, soft-capping, local RoPE table, tensor parallelism or experts
(`native_reason` names what a model has instead).

The same extension holds `q8_linear`, the product of a symmetric 8-bit group-quantized weight
(GGUF Q8_0, Q6_K: the built-in model's tied LM head) in float32 in one pass over its bytes,
where PyTorch's int4 kernel needs the weight split in two nibbles (twice the products); its
twin `q8_linear_ref` repeats its sums with PyTorch operations, bit for bit.

The extension is compiled once per machine and PyTorch version on first use (about a minute;
PyTorch caches it under `~/.cache/torch_extensions`); without a C++ compiler, or with
`SPECDEC_CPU_NATIVE=0`, the Python loop and PyTorch's kernels run, after one log line saying
why.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from specdec.models.decode_cpu import DecodePlanCPU

if TYPE_CHECKING:
    from specdec.models.attention import KVCache

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "decode_layers.cpp"
NAME = "specdec_decode_layers"
ENV_SWITCH = "SPECDEC_CPU_NATIVE"  # "0": never build or use the C++ loop


@functools.cache
def load_extension() -> Any | None:
    """The compiled extension, or None (with one log line) when it cannot be built here."""
    if os.environ.get(ENV_SWITCH, "1") == "0":
        logger.info("CPU decode step: the Python loop (%s=0)", ENV_SWITCH)
        return None
    try:
        from torch.utils.cpp_extension import _get_build_directory, load

        if not (Path(_get_build_directory(NAME, verbose=False)) / f"{NAME}.so").exists():
            logger.warning("CPU decode step: building its C++ loop (once per machine, ~1 min)")
        start = time.perf_counter()
        module = load(
            name=NAME,
            sources=[str(SOURCE)],
            # -march=native: built on the machine it runs on; no FMA contraction, so that
            # q8_linear's sums are the ones its twin makes with PyTorch operations.
            # -fopenmp: q8_linear's at::parallel_for runs in PyTorch's OpenMP pool (the
            # process's one libgomp), not serially and not in threads of its own that would
            # compete with that pool's spinning workers.
            extra_cflags=["-O3", "-march=native", "-ffp-contract=off", "-fopenmp"],
            extra_ldflags=["-fopenmp"],
            verbose=False,
        )
    except Exception as err:  # no compiler, no ninja, a build error: run the twin
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        logger.warning(
            "CPU decode step: running the Python loop (same results, slower): its C++ loop "
            "could not be built (%s)",
            first[:200],
        )
        return None
    elapsed = time.perf_counter() - start
    if elapsed > 2.0:  # a build, not a cache hit
        logger.info("CPU decode step: built its C++ loop in %.0f s (once per machine)", elapsed)
    return module


def q8_linear_ref(
    x: torch.Tensor, values: torch.Tensor, scale: torch.Tensor, group: int
) -> torch.Tensor:
    """The C++ `q8_linear`'s twin: x @ W^T for W = values * scale per group (symmetric 8-bit),
    with its sums in its order (see csrc/decode_layers.cpp), so that the two agree bit for bit.

    Args:
        x: [M, K] float32. values: [N, K] int8. scale: [N, K / group] float32.
        group: a multiple of 16 dividing K.

    Returns: [M, N] float32."""
    rows, cols = x.shape
    groups, chunks = cols // group, group // 16
    xs = x.view(rows, 1, groups, chunks, 16)
    qs = values.to(torch.float32).view(1, values.shape[0], groups, chunks, 16)
    lanes = torch.zeros(rows, values.shape[0], 16)
    for g in range(groups):
        sums = torch.zeros_like(lanes)
        for c in range(chunks):
            sums = sums + xs[:, :, g, c] * qs[:, :, g, c]
        lanes = lanes + sums * scale[None, :, g, None]
    v8 = lanes[..., :8] + lanes[..., 8:]
    v4 = v8[..., :4] + v8[..., 4:]
    return (v4[..., 0] + v4[..., 2]) + (v4[..., 1] + v4[..., 3])


def q8_linear(x: torch.Tensor, weight: Any) -> torch.Tensor | None:
    """x @ W^T through the C++ `q8_linear` for a symmetric 8-bit group-quantized W (a
    `GroupQuantized`: GGUF Q8_0, Q6_K) and float32 x on the CPU; None where it does not apply
    or the extension is not built here (the caller's kernel then runs). One pass over W's
    bytes, float32 throughout: against PyTorch's int4 kernel over the weight split in two
    nibbles (twice the products, x and the result rounded to bfloat16), half the work."""
    if (
        x.dtype != torch.float32
        or x.dim() != 2
        or x.is_cuda
        or weight.bits != 8
        or weight.zero is not None
        or weight.group_size % 16
        or weight.values.dtype != torch.int8
    ):
        return None
    extension = load_extension()
    if extension is None:
        return None
    return extension.q8_linear(x, weight.values, weight.scale, weight.group_size)


def native_reason(model: torch.nn.Module) -> str | None:
    """Why the C++ loop cannot run `model`'s layers (a `LlamaModel`), or None when it can."""
    from specdec.models.decoder_layers import LlamaDecoderLayer, LlamaMLP

    if any(kind != (None, False) for kind in model.layer_kinds):
        return "sliding-window or local-RoPE layers"
    for layer in model.layers:
        if type(layer) is not LlamaDecoderLayer or not isinstance(layer.mlp, LlamaMLP):
            return "a layer other than Llama's (post-norm, experts)"
        attn, mlp = layer.self_attn, layer.mlp
        if attn.tp is not None or mlp.tp is not None:
            return "tensor parallelism"
        if attn.q_norm is not None or attn.softcap is not None or mlp.gelu:
            return "q/k norms, soft-capping or a GeGLU MLP"
        for norm in (layer.input_layernorm, layer.post_attention_layernorm):
            if not norm.is_llama or norm.weight.dtype != torch.float32:
                return "a norm other than Llama's in float32"
            if norm.eps != model.layers[0].input_layernorm.eps:
                return "norms of different epsilons"
        for linear in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj):
            if linear is None or linear.bias is not None or linear.quantized is None:
                return "unfused, biased or float products"
            if linear.quantized.layout != "cpu_int4":
                return f"{linear.quantized.layout} weights"
    return None


def layer_operands(model: torch.nn.Module) -> tuple[list[torch.Tensor], list[int]]:
    """Per layer its two norm weights and four (packed, scale_zero) pairs; per layer and
    linear (group size, source group or 0): the C++ loop's `weights` and `meta`."""
    weights: list[torch.Tensor] = []
    meta: list[int] = []
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        weights += [layer.input_layernorm.weight, layer.post_attention_layernorm.weight]
        for linear in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj):
            quantized = linear.quantized
            weights += [quantized._tensors["packed"], quantized._tensors["scale_zero"]]
            meta += [quantized._meta["group_size"], quantized._meta["source_group"] or 0]
    return weights, meta


def run_layers(
    extension: Any,
    operands: tuple[list[torch.Tensor], list[int]],
    model: torch.nn.Module,
    out: torch.Tensor,
    plan: DecodePlanCPU,
    kv_cache: KVCache,
    return_layers: list[int],
) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """Every decoder layer of `model` over the embeddings `out` ([T, D]) as the Python loop
    runs them with `plan`: (out, residual, the residual stream after each of `return_layers`).

    Mutates: writes the step's K/V into `kv_cache`."""
    first_rows: list[int] = []
    counts: list[int] = []
    offsets = [0]
    key_starts: list[int] = []
    key_slots: list[torch.Tensor] = []
    empty = torch.empty(0, dtype=torch.int64)
    for first_row, row_counts, keys in plan.sequences:
        first_rows.append(first_row)
        counts += row_counts
        offsets.append(len(counts))
        if isinstance(keys, int):
            key_starts.append(keys)
            key_slots.append(empty)
        else:
            key_starts.append(-1)
            key_slots.append(keys)
    attn = model.layers[0].self_attn
    weights, meta = operands
    return extension.decode_layers(
        out,
        weights,
        meta,
        plan.cos,
        plan.sin,
        plan.half_swap,
        plan.slots,
        plan.write_rows,
        first_rows,
        counts,
        offsets,
        key_starts,
        key_slots,
        plan.all_live,
        kv_cache.k_cache,
        kv_cache.v_cache,
        attn.num_heads,
        attn.num_kv_heads,
        attn.scale,
        model.layers[0].input_layernorm.eps,
        return_layers,
    )
