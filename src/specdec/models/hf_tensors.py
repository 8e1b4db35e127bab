"""A Hugging Face checkpoint's tensors read under our parameter names: Phi-3's fused q/k/v and
gate/up split into our projections, the q/k rows of partial rotary reordered
(`rope.partial_rotary_layout`), and mixture-of-experts routers and experts under the names of
`models/moe.py` (Mixtral's `block_sparse_moe.*.w1/w3/w2`, Qwen3-MoE's per-expert tensors, or
transformers 5's stacked 3D ones). Reads through a `ReadTensor` it is given; never opens files.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from typing import TypeVar

import torch

from specdec.models.config import ModelConfig
from specdec.models.quant_formats import GroupQuantized
from specdec.models.rope import partial_rotary_layout
from specdec.models.tensor_parallel import TensorSlice
from specdec.models.weights import CheckpointError

ReadTensor = Callable[[str, TensorSlice | None], torch.Tensor | None]
Rows = TypeVar("Rows", torch.Tensor, GroupQuantized)
# Phi-3's checkpoint stores q/k/v as one `qkv_proj` and gate/up as one `gate_up_proj`: our
# projection -> (the stored one, the part's index in it).
_PHI3_FUSED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}
_LAYER_LINEAR = re.compile(r"(?P<block>model\.layers\.\d+\.\w+)\.(?P<part>\w+)\.weight")


def hf_tensors(config: ModelConfig, read: ReadTensor) -> ReadTensor:
    """`read` (a HF checkpoint's tensor by name, whole or a rank's piece) under our parameter
    names: Phi-3's fused projections split into ours, and under partial rotary the q/k rows of
    every head reordered (`rope.partial_rotary_layout`)."""
    if config.architecture == "Phi3ForCausalLM":
        read = _split_fused(config, read)
    if config.rotary_dim < config.head_dim:
        read = _partial_rotary_rows(config, read)
    if config.is_moe:
        read = _moe_tensors(config, read)
    return read


# Mixtral's expert names on the Hub: ours -> its.
_MIXTRAL_EXPERT = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
_EXPERT_LINEAR = re.compile(
    r"(?P<layer>model\.layers\.\d+)\.mlp\.(?P<rest>gate\.weight|experts\.(?P<expert>\d+)\."
    r"(?P<part>gate_proj|up_proj|down_proj)\.weight)"
)


def _moe_tensors(config: ModelConfig, read: ReadTensor) -> ReadTensor:
    """Our router and per-expert names (`mlp.gate`, `mlp.experts.E.gate_proj`, ...) read from
    a checkpoint's: per-expert tensors as the Hub stores them (Mixtral's
    `block_sparse_moe.experts.E.w1/w3/w2`, Qwen3-MoE's `mlp.experts.E.gate_proj/...`), else
    the 3D tensors of transformers 5's modules (`mlp.experts.gate_up_proj` [E, 2F, D], gate
    rows first, and `mlp.experts.down_proj` [E, D, F]); one layer's 3D tensors are kept while
    its experts are read."""
    mixtral = config.architecture == "MixtralForCausalLM"
    blocks = ("block_sparse_moe", "mlp") if mixtral else ("mlp",)
    width = config.moe_intermediate_size
    stacked: dict[str, torch.Tensor | None] = {}

    def read_stacked(name: str) -> torch.Tensor | None:
        layer = name.split(".experts.")[0]
        if not all(key.startswith(f"{layer}.") for key in stacked):
            stacked.clear()
        if name not in stacked:
            stacked[name] = read(name, None)
            whole = stacked[name]
            if whole is not None and whole.shape[0] != config.num_experts:
                raise CheckpointError(
                    f"{name} holds {whole.shape[0]} experts, the config {config.num_experts}"
                )
        return stacked[name]

    def read_expert(name: str, piece: TensorSlice | None) -> torch.Tensor | None:
        match = _EXPERT_LINEAR.fullmatch(name)
        if match is None:
            return read(name, piece)
        layer = match["layer"]
        if match["expert"] is None:
            for block in blocks:
                tensor = read(f"{layer}.{block}.gate.weight", piece)
                if tensor is not None:
                    return tensor
            return None
        expert, part = int(match["expert"]), match["part"]
        for block in blocks:
            stored = _MIXTRAL_EXPERT[part] if block == "block_sparse_moe" else part
            tensor = read(f"{layer}.{block}.experts.{expert}.{stored}.weight", piece)
            if tensor is not None:
                return tensor
        fused = "down_proj" if part == "down_proj" else "gate_up_proj"
        whole = read_stacked(f"{layer}.mlp.experts.{fused}")
        if whole is None:
            return None
        tensor = whole[expert]
        if part != "down_proj":
            tensor = tensor[:width] if part == "gate_proj" else tensor[width:]
        return tensor.contiguous() if piece is None else piece.take(tensor)

    return read_expert


def _split_fused(config: ModelConfig, read: ReadTensor) -> ReadTensor:
    """Phi-3's q/k/v and gate/up as parts of its fused tensors (gate first, as its MLP chunks
    them); the last fused tensor read is kept for its other parts."""
    q_size = config.num_attention_heads * config.head_dim
    kv_size = config.num_key_value_heads * config.head_dim
    sizes = {"qkv_proj": [q_size, kv_size, kv_size], "gate_up_proj": [config.intermediate_size] * 2}
    last: dict[str, torch.Tensor | None] = {}

    def read_part(name: str, piece: TensorSlice | None) -> torch.Tensor | None:
        match = _LAYER_LINEAR.fullmatch(name)
        if match is None or match["part"] not in _PHI3_FUSED:
            return read(name, piece)
        fused, index = _PHI3_FUSED[match["part"]]
        fused_name = f"{match['block']}.{fused}.weight"
        if fused_name not in last:
            last.clear()
            last[fused_name] = read(fused_name, None)
        whole = last[fused_name]
        if whole is None or whole.shape[0] != sum(sizes[fused]):
            found = "missing" if whole is None else f"of {whole.shape[0]} rows"
            raise CheckpointError(
                f"Phi-3 tensor {fused_name!r} {found} (expected {sum(sizes[fused])} rows: "
                f"{' + '.join(map(str, sizes[fused]))})"
            )
        part = whole.split(sizes[fused])[index]
        return part.contiguous() if piece is None else piece.take(part)

    return read_part


def _partial_rotary_rows(config: ModelConfig, read: ReadTensor) -> ReadTensor:
    """q/k rows of each head in `partial_rotary_layout`'s order (`partial_rotary_rows`)."""

    def read_rows(name: str, piece: TensorSlice | None) -> torch.Tensor | None:
        tensor = read(name, piece)
        match = _LAYER_LINEAR.fullmatch(name)
        if tensor is None or match is None or match["part"] not in ("q_proj", "k_proj"):
            return tensor
        return partial_rotary_rows(config, tensor, query=match["part"] == "q_proj")

    return read_rows


def partial_rotary_rows(config: ModelConfig, weight: Rows, query: bool) -> Rows:
    """A q (`query`) or k projection's rows, whole heads (a rank's piece holds whole heads, so
    the order applies to it as to the whole), float or group-quantized, in
    `partial_rotary_layout`'s order; a query's unrotated rows divided by the square of the RoPE
    attention factor m, which `transformers` applies to the rotated dimensions alone and
    `attention_scale` to all (a float weight in float32: it is rounded once, to the model's
    dtype, so in bfloat16 those scores carry one more rounding than `transformers`'; a
    quantized one's row scales)."""
    head_dim = config.head_dim
    layout = partial_rotary_layout(head_dim, config.rotary_dim)
    scaling = config.rope_scaling
    factor = 1.0 if scaling is None else scaling.attention_factor
    unrotated = torch.ones(head_dim)  # [D] in the new order
    unrotated[config.rotary_dim // 2 : head_dim // 2] = factor**-2
    unrotated[(head_dim + config.rotary_dim) // 2 :] = factor**-2

    def reorder(rows: torch.Tensor) -> torch.Tensor:
        return rows.unflatten(0, (-1, head_dim))[:, layout].flatten(0, 1)

    if isinstance(weight, GroupQuantized):
        weight = weight.map_rows(reorder)
        if not query or factor == 1.0:
            return weight
        rows = unrotated.repeat(weight.shape[0] // head_dim)[:, None]  # [N, 1]
        zero = None if weight.zero is None else weight.zero * rows
        return dataclasses.replace(weight, scale=weight.scale * rows, zero=zero)
    heads = weight.unflatten(0, (-1, head_dim))[:, layout]  # [H, D, hidden]
    if query and factor != 1.0:
        heads = heads.float() * unrotated[:, None]
    return heads.flatten(0, 1)
