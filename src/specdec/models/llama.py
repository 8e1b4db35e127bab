"""The Llama-family forward pass (Llama 2/3, Mistral, Qwen2, Qwen3, SmolLM2, Phi-3, OLMo 2,
Gemma 2, Gemma 3 text, Mixtral, Qwen3-MoE), written once; the families differ by the options of
their `ModelConfig` (OLMo 2's norms after each sublayer: `PostNormDecoderLayer`; Gemma's before
and after: `SandwichNormDecoderLayer`; Mixtral's and Qwen3-MoE's sparse MLPs:
`moe.SparseMoeBlock`; Gemma 2's soft-capped attention scores and logits).
Layers may differ in their attention window and RoPE table (Gemma 3's sliding and full layers):
the model hands each layer its kind's plan and table.

Token-flattened ([T, ...]) and paged-KV throughout; numerics follow `transformers`, the reference.
Parameters are created empty and only ever filled from checkpoint files (never initialised
randomly); nothing here reads files or samples. Under tensor parallelism (a `ShardLayout`) each
rank's model holds its heads, MLP columns and vocabulary rows, and its forward pass runs the
`Collectives` attached to it (`attach_collectives`) at the row-parallel outputs and the logits.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from specdec.models import cpu_extension, decode_cpu_native
from specdec.models.attention import (
    AttentionMetadata,
    AttentionPlan,
    DecodeMetadata,
    KVCache,
)
from specdec.models.config import ModelConfig
from specdec.models.decode_cpu import DecodePlanCPU
from specdec.models.decoder_layers import (
    DECODER_LAYERS,
    LlamaDecoderLayer,
    LlamaMLP,
    add_norm,
    rms_norm,
)
from specdec.models.layers import Embedding, Linear
from specdec.models.linear import batch_invariant_linear
from specdec.models.quant import QuantizedWeight, quant_linear
from specdec.models.rope import RotaryEmbedding
from specdec.models.tensor_parallel import Collectives, ShardLayout


class LlamaModel(nn.Module):
    """Embedding, decoder layers and final norm (parameter names match HF's `model.*`).

    Each layer has a kind, (window, rotates locally): its attention window (None: its whole
    context) and whether it rotates with `local_rotary_emb` rather than `rotary_emb` (Gemma 3's
    sliding layers); a step makes one attention plan per window and one RoPE table per kind.
    """

    def __init__(self, config: ModelConfig, shard: ShardLayout | None = None) -> None:
        super().__init__()
        if shard is None:
            self.embed_tokens = Embedding(config.vocab_size, config.hidden_size)
        else:
            self.embed_tokens = Embedding(shard.vocab_size, config.hidden_size, shard.vocab[0])
        layer = DECODER_LAYERS[config.norm_placement]
        if config.is_moe:  # pre-norm (ModelConfig checks it)
            self.layers = nn.ModuleList(
                LlamaDecoderLayer(config, shard, sparse=index in config.moe_layers)
                for index in range(config.num_hidden_layers)
            )
        else:
            self.layers = nn.ModuleList(
                layer(config, shard) for _ in range(config.num_hidden_layers)
            )
        self.norm = rms_norm(config)
        self.rotary_emb = RotaryEmbedding(config)
        local = config.local_rope
        self.local_rotary_emb = RotaryEmbedding(local) if local is not None else None
        self.layer_kinds = tuple(
            (config.layer_window(index), config.layer_rotates_locally(index))
            for index in range(config.num_hidden_layers)
        )
        for layer, (window, _) in zip(self.layers, self.layer_kinds, strict=True):
            layer.self_attn.sliding_window = window  # the fused path's kernels take it
        self.embed_scale = config.hidden_size**0.5 if config.scale_embeddings else None
        self.eager_only_reason = config.eager_only_reason  # CUDA's
        self.cpu_decode_reason = config.decode_path_reason("cpu")
        # (extension, operands) of the C++ decode loop, False where it cannot run, None before
        # the first planned step (`_native_layers`)
        self._native: tuple[Any, tuple[list[torch.Tensor], list[int]]] | bool | None = None

    @property
    def is_quantized(self) -> bool:
        """Whether the layers' products are quantized (the loader quantizes all or none;
        never a mixture of experts)."""
        mlp = self.layers[0].mlp if len(self.layers) else None
        return isinstance(mlp, LlamaMLP) and (
            mlp.down_proj.quantized is not None
            or (mlp.gate_up_proj is not None and mlp.gate_up_proj.quantized is not None)
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionMetadata | DecodeMetadata,
        kv_cache: KVCache,
        return_layers: Sequence[int] = (),
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Returns the normed final hidden [T, D] and the outputs of the `return_layers` layers."""
        if isinstance(attn, DecodeMetadata):
            return self._forward_decode(input_ids, positions, attn, kv_cache, return_layers)
        if self._plans_rows(input_ids):
            # Every row as a decode row of the same token, a tree's node rows too (the CPU's one
            # numerics: see `DecodePlanCPU.from_attention`).
            plan = DecodePlanCPU.from_attention(
                attn, positions, self.rotary_emb.inv_freq_at(positions), kv_cache.block_size
            )
            return self._forward_decode(input_ids, positions, None, kv_cache, return_layers, plan)
        if input_ids.is_cuda and self.eager_only_reason is None and attn.tree_mask is None:
            # The decode step's kernels for every row (prefill chunks beside decode rows), with
            # the prefill kernel's attention, whose rows are the decode kernel's bits: a
            # token's row never depends on the path its step takes.
            flash = AttentionPlan.build(attn, kv_cache.block_size, input_ids.device)
            if flash.flash:
                return self._forward_decode(
                    input_ids, positions, None, kv_cache, return_layers, flash=flash
                )
        wanted = set(return_layers)
        captured: dict[int, torch.Tensor] = {}
        tables = {False: self.rotary_emb(positions)}  # (cos, sin), [T, D_head] each
        if self.local_rotary_emb is not None:
            tables[True] = self.local_rotary_emb(positions)
        hidden = self.embed(input_ids)  # [T, D]
        plans = {
            window: AttentionPlan.build(
                attn, kv_cache.block_size, hidden.device, window, positions=positions
            )
            for window, _ in set(self.layer_kinds)
        }
        for index, layer in enumerate(self.layers):
            window, local = self.layer_kinds[index]
            cos, sin = tables[local]
            k_cache, v_cache = kv_cache.k_cache[index], kv_cache.v_cache[index]
            hidden = layer(hidden, cos, sin, plans[window], k_cache, v_cache)
            if index in wanted:
                captured[index] = hidden
        return self.norm(hidden), [captured[index] for index in return_layers]

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[T] token ids -> [T, D] embeddings; with `scale_embeddings` times sqrt(D) rounded to
        their dtype first, as `transformers` scales Gemma's (55.5, not 55.43, in bfloat16)."""
        hidden = self.embed_tokens(input_ids)
        if self.embed_scale is None:
            return hidden
        return hidden * torch.tensor(self.embed_scale).to(hidden.dtype).item()

    def _plans_rows(self, input_ids: torch.Tensor) -> bool:
        """Whether a step runs through a `DecodePlanCPU`: every model on the CPU that the plan
        can run (not dynamic NTK, whose frequencies depend on the sequence length; longrope's
        per-row tables it takes as one table: position x frequency; windows it applies per
        layer), so that every row takes the same operations whatever else the step holds (and
        a quantized model's step, bound by per-operation overhead, does its index work once)."""
        return not input_ids.is_cuda and self.cpu_decode_reason is None

    def prepare_native_layers(self) -> bool:
        """Builds or loads the C++ decode loop now (an engine's warm-up) where this model on
        the CPU would take it at its first planned step; whether it will."""
        if self.norm.weight.is_cuda or self.cpu_decode_reason is not None:
            return False
        return self._native_layers() is not None

    def _native_layers(self) -> tuple[Any, tuple[list[torch.Tensor], list[int]]] | None:
        """(the C++ loop, its operands) when it runs this model's layers (checked, and the
        extension built, at the first planned step), else None (the Python loop)."""
        if self._native is None:
            reason = decode_cpu_native.native_reason(self)
            extension = None if reason is not None else cpu_extension.load_extension()
            self._native = (
                (extension, decode_cpu_native.layer_operands(self)) if extension else False
            )
        return self._native or None

    def _layer_plans(
        self,
        plan: DecodePlanCPU,
        positions: torch.Tensor,
        local_inv_freq: torch.Tensor | None,
    ) -> dict[tuple[int | None, bool], DecodePlanCPU]:
        """The step's CPU plan (made with `rotary_emb`'s table, no window) for each kind of
        layer: its window, and `local_inv_freq`'s table for the layers that rotate locally."""
        return {
            kind: plan
            if kind == (None, False)
            else plan.for_layers(positions, local_inv_freq if kind[1] else None, kind[0])
            for kind in set(self.layer_kinds)
        }

    def _forward_decode(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: DecodeMetadata | None,
        kv_cache: KVCache,
        return_layers: Sequence[int],
        plan: DecodePlanCPU | None = None,
        flash: AttentionPlan | None = None,
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The decode/verify step through the fused kernels (no host sync: CUDA-graph safe).
        Each residual add is fused into the next RMSNorm. `plan`: the step's CPU plan, made
        from `meta` when None and the model plans its rows; `flash`: a CUDA step of any rows
        (no `meta`), attending through the prefill kernel."""
        wanted = set(return_layers)
        captured: dict[int, torch.Tensor] = {}
        reason = self.eager_only_reason if input_ids.is_cuda else self.cpu_decode_reason
        if reason is not None:
            device = "CUDA" if input_ids.is_cuda else "the CPU"
            raise ValueError(f"the decode path on {device} has no {reason}; run eagerly")
        # [D / 2], or [T, D / 2] (longrope), which the CPU plan, the RoPE twin and the CUDA
        # kernel take alike (position x frequency, a token's own row where there are rows).
        inv_freq = self.rotary_emb.inv_freq_at(positions)
        local = self.local_rotary_emb
        inv_freqs = {False: inv_freq, True: None if local is None else local.inv_freq_at(positions)}
        planned = meta is not None and meta.tree_mask is None  # tree steps: the twins instead
        if plan is None and planned and self._plans_rows(input_ids):
            # index work once for every layer
            plan = DecodePlanCPU.build(meta, positions, inv_freq, kv_cache.block_size)
        plans = None if plan is None else self._layer_plans(plan, positions, inv_freqs[True])
        out = self.embed(input_ids)  # [T, D]
        residual: torch.Tensor | None = None  # the residual stream is out + residual
        native = None if plan is None or flash is not None else self._native_layers()
        if native is not None:  # the same operations in one C++ call (`decode_cpu_native`)
            out, residual, layers = decode_cpu_native.run_layers(
                *native, self, out, plan, kv_cache, list(return_layers)
            )
            captured = dict(zip(return_layers, layers, strict=True))
        for index, layer in enumerate(self.layers if native is None else ()):
            kind = self.layer_kinds[index]
            out, residual = layer.forward_decode(
                out,
                residual,
                positions,
                inv_freqs[kind[1]],
                meta,
                kv_cache.k_cache[index],
                kv_cache.v_cache[index],
                None if plans is None else plans[kind],
                flash,
            )
            if index in wanted:
                captured[index] = out + residual
        normed, _ = add_norm(out, residual, self.norm)
        return normed, [captured[index] for index in return_layers]


class LlamaForCausalLM(nn.Module):
    """A Llama-family causal LM over a paged KV cache (one step = any mix of prefill and decode).

    Parameter names are HF's (`model.layers.N.self_attn.q_proj.weight`, ..., `lm_head.weight`),
    so a HF state dict loads as is; with tied embeddings there is no `lm_head`. With a `shard`
    the parameters are this rank's slices (same names, smaller shapes; see `ShardLayout`).
    """

    def __init__(self, config: ModelConfig, shard: ShardLayout | None = None) -> None:
        super().__init__()
        self.config = config
        self.shard = shard
        self.tp: Collectives | None = None  # set by `attach_collectives`
        self.model = LlamaModel(config, shard)
        self.lm_head = None
        if not config.tie_word_embeddings:
            vocab = config.vocab_size if shard is None else shard.vocab_size
            self.lm_head = Linear(config.hidden_size, vocab, bias=False)
        # A tied LM head whose table is quantized for the product (the loader sets it).
        self.tied_head: QuantizedWeight | None = None
        self.quantization: str | None = None  # what the linears run as (set by the loader)
        self.final_softcap = config.final_logit_softcapping  # logits -> cap * tanh(logits / cap)

    @property
    def device(self) -> torch.device:
        """Where the model runs (its final norm's device)."""
        return self.model.norm.weight.device

    @property
    def dtype(self) -> torch.dtype:
        """The activation dtype (its final norm's dtype; quantized weights keep their own)."""
        return self.model.norm.weight.dtype

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionMetadata | DecodeMetadata,
        kv_cache: KVCache,
    ) -> torch.Tensor:
        """Runs one step over the flattened new tokens of B sequences.

        Args:
            input_ids: [T] int64 new tokens, sequence after sequence as in `attn.cu_seqlens_q`.
            positions: [T] int64 absolute position of each token (L - q_len + j, see
                `AttentionMetadata`).
            attn: the step's metadata.
            kv_cache: the cache the new K/V are written to and the context read from.

        Returns:
            [T, D] final hidden states (after the final norm); see `compute_logits`.

        Mutates: the `kv_cache` slots in `attn.slot_mapping`.
        """
        hidden, _ = self.model(input_ids, positions, attn, kv_cache)
        return hidden

    def forward_with_layers(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionMetadata | DecodeMetadata,
        kv_cache: KVCache,
        return_layers: Sequence[int],
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """`forward`, also returning the outputs of chosen decoder layers (for EAGLE drafters).

        Args:
            input_ids, positions, attn, kv_cache: as in `forward`.
            return_layers: 0-based decoder layer indices; layer i's output is the residual stream
                after it, before the final norm (HF's `hidden_states[i + 1]` for i < L - 1).

        Returns:
            (hidden [T, D] after the final norm, [one [T, D] tensor per entry of return_layers]).

        Mutates: the `kv_cache` slots in `attn.slot_mapping`.
        """
        num_layers = self.config.num_hidden_layers
        bad = [index for index in return_layers if not 0 <= index < num_layers]
        if bad:
            raise ValueError(f"return_layers {bad} out of range for {num_layers} layers")
        return self.model(input_ids, positions, attn, kv_cache, return_layers)

    def attach_collectives(self, collectives: Collectives) -> None:
        """Makes this rank's shard run `collectives` (the group every rank's shard joins).

        Mutates: the embedding, every attention and MLP block (their `tp`), `self.tp`."""
        if self.shard is None:
            raise ValueError("collectives attach to a sharded model (load it with a ShardLayout)")
        self.tp = collectives
        self.model.embed_tokens.tp = collectives
        for layer in self.model.layers:
            layer.self_attn.tp = collectives
            layer.mlp.tp = collectives

    def fuse_projections(self) -> None:
        """Concatenates q/k/v and gate/up weights for the decode path (the per-projection
        parameters become views of the fused tensors: no extra memory)."""
        for layer in self.model.layers:
            layer.self_attn.fuse()
            layer.mlp.fuse()

    def float_product_weights(self) -> list[torch.Tensor]:
        """The float [N, K] weights of every product the forward pass runs through
        `batch_invariant_linear` (the layers' projections, fused or not, and a float LM head)."""
        linears = [module for module in self.modules() if isinstance(module, Linear)]
        for layer in self.model.layers:  # fused projections are not registered submodules
            linears += [layer.self_attn.qkv_proj, getattr(layer.mlp, "gate_up_proj", None)]
        weights = [
            linear.weight
            for linear in linears
            if linear is not None and linear.quantized is None and linear.weight is not None
        ]
        if self.lm_head_quantized is None:
            weights.append(self.lm_head_weight)
        return weights

    @property
    def lm_head_quantized(self) -> QuantizedWeight | None:
        """The LM head's quantized [V, D] weight, or None when it is a float tensor."""
        return self.tied_head if self.lm_head is None else self.lm_head.quantized

    @property
    def lm_head_weight(self) -> torch.Tensor:
        """[V, D] output projection (the embedding table when they are tied).

        Raises: ValueError when the head is quantized (use `compute_logits`)."""
        if self.lm_head_quantized is not None:
            raise ValueError("the LM head is quantized: it has no float weight")
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Args: hidden: [N, D] final hidden states (a row's logits never depend on how many
        rows there are: a quantized head's weight-only kernel, `batch_invariant_linear` for a
        float one); out: a float32 [N, V] buffer to write them into (a graphed step's), cast in
        the copy.

        Returns: [N, V] float32 logits (`out` if given; under tensor parallelism every rank's
        vocabulary rows, gathered), soft-capped in float32 when the model caps them (Gemma 2's
        `final_logit_softcapping`)."""
        head = self.lm_head_quantized
        if head is not None:
            logits = quant_linear(hidden, head)
        else:
            logits = batch_invariant_linear(hidden, self.lm_head_weight)
        if self.tp is not None:
            logits = self.tp.gather_vocab(logits.float())
        logits = logits.float() if out is None else out.copy_(logits)  # a tensor of its own
        if self.final_softcap is not None:
            logits.div_(self.final_softcap).tanh_().mul_(self.final_softcap)
        return logits

    def allocate_kv_cache(
        self, num_blocks: int, block_size: int, dtype: torch.dtype | None = None
    ) -> KVCache:
        """A zero-filled cache for this model on its device, in `dtype` (None: its activation
        dtype; float8 e4m3 on CUDA halves it); a shard caches its own KV heads."""
        return KVCache.allocate(
            self.config.num_hidden_layers,
            num_blocks,
            block_size,
            self.config.num_key_value_heads if self.shard is None else self.shard.num_kv_heads,
            self.config.head_dim,
            dtype=self.dtype if dtype is None else dtype,
            device=self.device,
        )


@torch.inference_mode()
def prompt_logits(
    model: LlamaForCausalLM, prompts: Sequence[Sequence[int] | torch.Tensor], block_size: int = 16
) -> list[torch.Tensor]:
    """Logits of whole prompts with a temporary cache (tests and one-off scoring; no engine).

    All prompts run as one batched prefill step.

    Args:
        model: the model.
        prompts: token ids of each prompt (lists or [T_i] int64 tensors).
        block_size: cache block size of the temporary cache.

    Returns:
        One [T_i, V] float32 tensor per prompt: the logits predicting each next token.
    """
    lengths = [len(prompt) for prompt in prompts]
    tables, next_block = [], 0
    for length in lengths:
        num_blocks = -(-length // block_size)
        tables.append(list(range(next_block, next_block + num_blocks)))
        next_block += num_blocks
    device = model.device
    kv_cache = model.allocate_kv_cache(max(next_block, 1), block_size)
    attn = AttentionMetadata.build(lengths, lengths, tables, block_size, device)
    input_ids = torch.cat([torch.as_tensor(prompt, dtype=torch.int64) for prompt in prompts])
    positions = torch.cat([torch.arange(length, dtype=torch.int64) for length in lengths])
    input_ids, positions = input_ids.to(device), positions.to(device)
    logits = model.compute_logits(model(input_ids, positions, attn, kv_cache))  # [T, V]
    return list(logits.split(lengths))
