"""Tensor-parallel layout of a Llama-family model: which heads, MLP columns and vocabulary rows
a rank holds (`ShardLayout`), and the two collectives its forward pass runs (`Collectives`).

Megatron-style: q/k/v and gate/up are column-parallel (a rank holds whole heads / a slice of the
intermediate), o and down are row-parallel (partial products summed by one all-reduce each), the
embedding and LM head are split by vocabulary rows (the lookup all-reduced, the logits
all-gathered). A mixture of experts splits every expert as the dense MLP (a slice of each
expert's intermediate: its gate/up rows, its down columns), the router whole on every rank, and
sums the routed outputs with one all-reduce. Nothing here reads files, spawns processes or
draws randomness; the collectives never synchronise with the host (CUDA-graph capture safe).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
import torch.distributed as dist

from specdec.models.config import ModelConfig

# Column boundaries of the row-parallel MLP shard fall on multiples of this when the
# intermediate size allows it (the largest GGUF quant block: K-quant super-blocks).
MLP_SPLIT_ALIGN = 256


@dataclass(frozen=True, slots=True)
class ShardLayout:
    """What one rank of a tensor-parallel group holds (global index ranges, end exclusive).

    Attributes:
        rank, world_size: this rank and the group size.
        q_heads: the query heads this rank attends with.
        kv_heads: the key/value heads it holds (those its query heads read; a KV head is
            replicated on several ranks when there are fewer KV heads than ranks).
        intermediate: the MLP columns (gate/up rows, down columns) it holds.
        expert_intermediate: the columns of every expert's MLP it holds (a mixture of experts'
            `moe_intermediate_size` split as `intermediate`; (0, 0) for a dense model).
        vocab: the vocabulary rows of the embedding / LM head it holds.
        vocab_shard: rows of every rank's vocabulary shard once padded (the gather's width).
        total_vocab: the whole vocabulary (V).
    """

    rank: int
    world_size: int
    q_heads: tuple[int, int]
    kv_heads: tuple[int, int]
    intermediate: tuple[int, int]
    vocab: tuple[int, int]
    vocab_shard: int
    total_vocab: int
    expert_intermediate: tuple[int, int] = (0, 0)

    @property
    def num_q_heads(self) -> int:
        return self.q_heads[1] - self.q_heads[0]

    @property
    def num_kv_heads(self) -> int:
        return self.kv_heads[1] - self.kv_heads[0]

    @property
    def intermediate_size(self) -> int:
        return self.intermediate[1] - self.intermediate[0]

    @property
    def expert_intermediate_size(self) -> int:
        return self.expert_intermediate[1] - self.expert_intermediate[0]

    @property
    def vocab_size(self) -> int:
        return self.vocab[1] - self.vocab[0]


def check_tensor_parallel_size(config: ModelConfig, world_size: int) -> None:
    """Raises ValueError (one line) when `world_size` ranks cannot split `config`'s heads.

    KV heads are split in whole GQA groups (as evenly as possible, so 3 KV heads over 2 ranks
    give 2 + 1); with fewer KV heads than ranks, `world_size` must be a multiple of the KV heads
    and each group's query heads must split evenly over the ranks sharing its KV head.
    """
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"tensor_parallel_size must be an integer >= 1, got {world_size!r}")
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    if world_size <= kv_heads:
        return
    group = heads // kv_heads
    if world_size % kv_heads or group % (world_size // kv_heads):
        raise ValueError(
            f"tensor_parallel_size={world_size} cannot split {heads} attention heads with "
            f"{kv_heads} KV heads (use at most {kv_heads}, or a multiple of {kv_heads} whose "
            f"quotient divides {group})"
        )
    if (
        config.intermediate_size < world_size
        or config.vocab_size < world_size
        or (config.is_moe and config.moe_intermediate_size < world_size)
    ):
        raise ValueError(f"tensor_parallel_size={world_size} exceeds the model's MLP or vocabulary")


def shard_layout(config: ModelConfig, rank: int, world_size: int) -> ShardLayout:
    """The layout of `rank` in a group of `world_size` (see `check_tensor_parallel_size`)."""
    check_tensor_parallel_size(config, world_size)
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} outside a tensor-parallel group of {world_size}")
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    group = heads // kv_heads
    if world_size <= kv_heads:  # whole GQA groups per rank
        kv = (rank * kv_heads // world_size, (rank + 1) * kv_heads // world_size)
        q = (kv[0] * group, kv[1] * group)
    else:  # a KV head replicated on `per_head` ranks, its query heads split between them
        per_head = world_size // kv_heads
        head = rank // per_head
        share = group // per_head
        kv = (head, head + 1)
        first = head * group + (rank % per_head) * share
        q = (first, first + share)
    intermediate = _column_split(config.intermediate_size, rank, world_size)
    experts = (
        _column_split(config.moe_intermediate_size, rank, world_size) if config.is_moe else (0, 0)
    )
    vocab_shard = -(-config.vocab_size // world_size)
    vocab = (
        min(rank * vocab_shard, config.vocab_size),
        min((rank + 1) * vocab_shard, config.vocab_size),
    )
    return ShardLayout(
        rank, world_size, q, kv, intermediate, vocab, vocab_shard, config.vocab_size, experts
    )


def _column_split(size: int, rank: int, world_size: int) -> tuple[int, int]:
    """`rank`'s share of an MLP's `size` columns: as even as the alignment allows, boundaries on
    multiples of MLP_SPLIT_ALIGN (or 32) where `size` splits so, the last rank taking the rest."""
    align = MLP_SPLIT_ALIGN if size % (MLP_SPLIT_ALIGN * world_size) == 0 else 1
    if align == 1 and size % (32 * world_size) == 0:
        align = 32
    units = size // align
    columns = (rank * units // world_size * align, (rank + 1) * units // world_size * align)
    return (columns[0], size) if rank == world_size - 1 else columns


# One tensor in, ranks x that tensor out: PyTorch's newer name, or the older one it replaces.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class Collectives:
    """The forward pass's collectives over one process group (the model holds one per rank).

    `all_reduce` sums partial products of the row-parallel projections; `gather_vocab` joins
    the ranks' vocabulary shards of the logits. Both are device work only (no host sync).
    """

    def __init__(self, layout: ShardLayout, group: dist.ProcessGroup | None = None) -> None:
        self.layout = layout
        self.group = group

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sums `x` over the ranks in place and returns it. Mutates: `x`."""
        dist.all_reduce(x, group=self.group)
        return x

    def gather_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """[N, V_local] logits of this rank's vocabulary rows -> [N, V] of every rank's."""
        layout = self.layout
        pad = layout.vocab_shard - logits.shape[-1]
        if pad:
            logits = torch.nn.functional.pad(logits, (0, pad))
        num_rows = logits.shape[0]
        gathered = logits.new_empty(layout.world_size * num_rows, layout.vocab_shard)
        _all_gather_single(gathered, logits.contiguous(), group=self.group)
        # [ranks * N, V_shard] rank after rank -> [N, ranks * V_shard], shards in vocabulary order
        full = gathered.view(layout.world_size, num_rows, -1).transpose(0, 1).reshape(num_rows, -1)
        return full[:, : layout.total_vocab]  # [N, V]


@dataclass(frozen=True, slots=True)
class TensorSlice:
    """The part of a checkpoint tensor one rank loads: rows (`dim` 0) or columns (`dim` 1)
    start..end-1; `zeros` for a row-parallel bias on ranks other than 0 (added once)."""

    dim: int
    start: int
    end: int
    zeros: bool = False

    def take(self, tensor: torch.Tensor) -> torch.Tensor:
        """This slice of a whole `tensor` (a zero tensor of its shape for `zeros`)."""
        if self.zeros:
            return torch.zeros_like(tensor)
        return tensor.narrow(self.dim, self.start, self.end - self.start).contiguous()


_ROW_PARALLEL = (".self_attn.o_proj.", ".mlp.down_proj.")
# An expert's projections under our names (`models/moe.py`): model.layers.L.mlp.experts.E.*
_EXPERT_PART = re.compile(r"\.mlp\.experts\.\d+\.(gate_proj|up_proj|down_proj)\.")


def tensor_slice(name: str, config: ModelConfig, layout: ShardLayout) -> TensorSlice | None:
    """What `layout`'s rank loads of the checkpoint tensor `name` (an HF parameter name), or
    None when every rank loads it whole (norms, per-head q/k norms, RoPE factors)."""
    head_dim = config.head_dim
    q_rows = TensorSlice(0, layout.q_heads[0] * head_dim, layout.q_heads[1] * head_dim)
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        return TensorSlice(0, *layout.vocab)
    expert = _EXPERT_PART.search(name)
    if expert is not None:  # the router (`mlp.gate`) stays whole
        return TensorSlice(int(expert[1] == "down_proj"), *layout.expert_intermediate)
    if ".self_attn.q_proj." in name:
        return q_rows
    kv_rows = TensorSlice(0, layout.kv_heads[0] * head_dim, layout.kv_heads[1] * head_dim)
    if ".self_attn.k_proj." in name or ".self_attn.v_proj." in name:
        return kv_rows
    if config.qk_norm and config.qk_norm_scope == "full":  # OLMo 2's norms over q / k whole
        if ".self_attn.q_norm." in name:
            return q_rows
        if ".self_attn.k_norm." in name:
            return kv_rows
    if ".mlp.gate_proj." in name or ".mlp.up_proj." in name:
        return TensorSlice(0, *layout.intermediate)
    if any(part in name for part in _ROW_PARALLEL):
        if name.endswith(".bias"):
            return None if layout.rank == 0 else TensorSlice(0, 0, 0, zeros=True)
        if ".self_attn.o_proj." in name:
            return TensorSlice(1, q_rows.start, q_rows.end)
        return TensorSlice(1, *layout.intermediate)
    return None
