"""GGUF files (llama.cpp's format): model config, weights (dequantized, or as group-quantized
integers) and tokenizer from one file.

Maps llama.cpp tensor and metadata names to HF ones and undoes what llama.cpp's converter does
to the tensors: the Q/K row permutation of Llama-architecture checkpoints, the 1 it adds to
Gemma's norm weights; Phi-3's fused q/k/v and gate/up are read as our projections' rows, laid
out as a Phi-3 directory's (`hf_tensors`). Where llama.cpp fixes a Gemma setting in code rather
than in the file (sliding-window pattern, the sliding layers' RoPE base, the attention scale),
the config is llama.cpp's. Metadata parsing and float dequantization use the `gguf` package;
tensor bytes are read one tensor at a time (not through the memory map, so a
loaded model does not keep the file's pages resident). Never builds the model itself.
"""

from __future__ import annotations

import math
import os
import re
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch

from specdec.models.config import FULL, SLIDING, ModelConfig
from specdec.models.gguf_blocks import GGUF_QUANT_TYPES, decode_blocks
from specdec.models.gguf_header import GGUFHeaderError, read_header
from specdec.models.gguf_names import (
    _SHIFTED_NORM_ARCHITECTURES,
    hf_tensor_name,
    phi3_fused_rows,
    reverse_permute_qk,
)
from specdec.models.gguf_rope import PHI3_ROPE_FACTORS, ROPE_FREQS_TENSOR, phi3_rope, rope_scaling
from specdec.models.hf_tensors import Rows, partial_rotary_rows
from specdec.models.quant_formats import GroupQuantized
from specdec.models.rope import RopeScaling
from specdec.models.tensor_parallel import TensorSlice
from specdec.models.tokenizer import Tokenizer
from specdec.models.weights import CheckpointError

# `general.architecture` -> our architecture name.
GGUF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "olmo2": "Olmo2ForCausalLM",
    "phi3": "Phi3ForCausalLM",
}
# llama.cpp stores Q/K of these architectures with rows permuted for its interleaved RoPE.
_PERMUTED_QK_ARCHITECTURES = ("llama",)
_GEMMA_SWA_PATTERN = {"gemma2": 2, "gemma3": 6}
_GEMMA2_DEFAULT_WINDOW = 4096
_GEMMA3_SWA_ROPE_BASE = 10000.0
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
# A mixture of experts' weights: every expert's in one 3D tensor ([E, F, D] gate / up, [E, D, F]
# down in torch's order), or (older Mixtral files) one tensor per expert.
_STACKED_EXPERTS = re.compile(r"blk\.(\d+)\.ffn_(gate|up|down)_exps\.weight")
_ONE_EXPERT = re.compile(r"blk\.(\d+)\.ffn_(gate|up|down)\.(\d+)\.weight")


class _Tensor(NamedTuple):
    """A tensor of the directory: GGML type, ggml dimensions, size and absolute offset."""

    tensor_type: Any  # gguf.GGMLQuantizationType
    dims: tuple[int, ...]
    n_bytes: int
    data_offset: int


class GGUFFile:
    """One opened GGUF file: its metadata, config, tokenizer and tensors.

    Attributes:
        path: the file.
        metadata: every key/value pair, decoded (strings, numbers, lists).
        architecture: `general.architecture` ("llama", "qwen2", ...).
    """

    def __init__(self, path: str | Path) -> None:
        """Reads the file's header (metadata and tensor directory; tensors are read on demand).

        Raises:
            FileNotFoundError: no such file.
            CheckpointError: not a readable GGUF file (a bad or truncated header, a tensor
                type or a tensor extent the file cannot hold).
        """
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"no such GGUF file: {self.path}")
        size = self.path.stat().st_size
        size = self.path.stat().st_size
        try:
            self.metadata, infos = read_header(self.path)
        except (GGUFHeaderError, OSError) as err:
            raise CheckpointError(
                f"cannot read GGUF file {self.path}: the file is {size:,} bytes and its header "
                f"does not parse within them (truncated or corrupt: {err})"
            ) from err
        self._tensors: dict[str, _Tensor] = {}
        declared = 0
        for info in infos:
            try:
                ggml_type = GGMLQuantizationType(info.type_id)
            except ValueError as err:
                raise CheckpointError(
                    f"{self.path}: tensor {info.name!r} has unknown GGML type {info.type_id}"
                ) from err
            block_values, block_bytes = GGML_QUANT_SIZES[ggml_type]
            num_bytes = math.prod(info.dims) * block_bytes // block_values
            declared = max(declared, info.data_offset + num_bytes)
            self._tensors[info.name] = _Tensor(ggml_type, info.dims, num_bytes, info.data_offset)
        if declared > size:
            raise CheckpointError(
                f"{self.path} is truncated or corrupt: the file is {size:,} bytes; its header "
                f"declares {declared:,}"
            )
        self.architecture = str(self.metadata.get("general.architecture", ""))
        self._hf_names = {
            hf_name: gguf_name
            for gguf_name in self._tensors
            if (hf_name := hf_tensor_name(gguf_name, self.architecture)) is not None
        }
        # An expert's HF-style name -> (its layer's stacked tensor, the expert's index in it).
        self._expert_parts: dict[str, tuple[str, int]] = {}
        for gguf_name, tensor in self._tensors.items():
            if stacked := _STACKED_EXPERTS.fullmatch(gguf_name):
                layer, part = stacked.groups()
                for expert in range(int(tensor.dims[-1])):
                    name = f"model.layers.{layer}.mlp.experts.{expert}.{part}_proj.weight"
                    self._expert_parts[name] = (gguf_name, expert)
            elif single := _ONE_EXPERT.fullmatch(gguf_name):
                layer, part, expert = single.groups()
                self._hf_names[f"model.layers.{layer}.mlp.experts.{expert}.{part}_proj.weight"] = (
                    gguf_name
                )
        self._stacked: dict[str, torch.Tensor] = {}  # one layer's stacked experts, dequantized

    def tensor_names(self) -> list[str]:
        return list(self._tensors)

    def _arch_key(self, name: str, default: Any = None) -> Any:
        return self.metadata.get(f"{self.architecture}.{name}", default)

    def model_config(self) -> ModelConfig:
        """The ModelConfig the metadata (and the set of tensors) describe.

        Raises:
            ValueError: an unsupported architecture (named, with the supported list) or RoPE
                scaling type, or missing metadata.
        """
        if self.architecture not in GGUF_ARCHITECTURES:
            raise ValueError(
                f"{self.path}: unsupported GGUF architecture {self.architecture!r}; "
                f"supported: {', '.join(GGUF_ARCHITECTURES)}"
            )

        def required(name: str) -> Any:
            value = self._arch_key(name)
            if value is None:
                raise ValueError(f"{self.path}: GGUF metadata lacks {self.architecture}.{name}")
            return value

        hidden_size = int(required("embedding_length"))
        num_heads = int(required("attention.head_count"))
        num_kv_heads = self._arch_key("attention.head_count_kv", num_heads)
        if isinstance(num_kv_heads, list):  # per-layer counts: fine only if all equal
            if len(set(num_kv_heads)) != 1:
                raise ValueError(f"{self.path}: per-layer KV head counts are not supported")
            num_kv_heads = num_kv_heads[0]
        head_dim = int(self._arch_key("attention.key_length", hidden_size // num_heads))
        context = int(self._arch_key("context_length", 2048))
        scaling = rope_scaling(self.metadata, self.architecture, self.path)
        vocab_size = self._arch_key("vocab_size")
        if vocab_size is None:
            tokens = self.metadata.get("tokenizer.ggml.tokens")
            vocab_size = len(tokens) if tokens else int(self._tensors["token_embd.weight"].dims[1])
        rope_freq_factors = None
        if ROPE_FREQS_TENSOR in self._tensors:
            factors = self.read_tensor(ROPE_FREQS_TENSOR)
            rope_freq_factors = tuple(float(x) for x in factors.tolist())
        eos = self.metadata.get("tokenizer.ggml.eos_token_id")
        architecture = GGUF_ARCHITECTURES[self.architecture]
        gemma = self._gemma_options(hidden_size // num_heads)
        olmo2 = (
            {"qk_norm_scope": "full", "norm_placement": "post", "norm_weight_in_float32": True}
            if architecture == "Olmo2ForCausalLM"
            else {}
        )
        phi3: dict[str, Any] = {}
        if architecture == "Phi3ForCausalLM":
            phi3 = self._phi3_options(head_dim, context, scaling)
            scaling = phi3.pop("rope_scaling")
        experts = self._moe_options(int(required("block_count")))
        if experts and architecture == "LlamaForCausalLM":  # llama.cpp's Mixtral
            architecture = "MixtralForCausalLM"
        return ModelConfig(
            architecture=architecture,
            vocab_size=int(vocab_size),
            hidden_size=hidden_size,
            intermediate_size=int(required("feed_forward_length")),
            num_hidden_layers=int(required("block_count")),
            num_attention_heads=num_heads,
            num_key_value_heads=int(num_kv_heads),
            head_dim=head_dim,
            rms_norm_eps=float(required("attention.layer_norm_rms_epsilon")),
            rope_theta=float(self._arch_key("rope.freq_base", 10000.0)),
            rope_scaling=scaling,
            rope_freq_factors=rope_freq_factors,
            max_position_embeddings=context,
            tie_word_embeddings="output.weight" not in self._tensors,
            attention_bias="blk.0.attn_q.bias" in self._tensors,
            attention_out_bias="blk.0.attn_output.bias" in self._tensors,
            mlp_bias="blk.0.ffn_up.bias" in self._tensors,
            qk_norm=architecture
            in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Gemma3ForCausalLM", "Olmo2ForCausalLM"),
            bos_token_id=self.metadata.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=() if eos is None else (int(eos),),
            **gemma,
            **olmo2,
            **phi3,
            **experts,
        )

    def _phi3_options(
        self, head_dim: int, context: int, scaling: RopeScaling | None
    ) -> dict[str, Any]:
        """A Phi-3 file's ModelConfig options: partial rotary and LongRoPE (`phi3_rope`), and
        its window (0: none; one as long as the context never binds, as config.json's is
        read). llama.cpp runs Phi-3 files without their window ("Phi SWA is currently
        disabled"); it is kept here, as `transformers` runs the checkpoint."""
        factors = {
            key: self.read_tensor(name).tolist()
            for key, name in PHI3_ROPE_FACTORS.items()
            if name in self._tensors
        }
        options = phi3_rope(self.metadata, self.path, head_dim, factors, scaling)
        longrope = options["rope_scaling"]
        limit = context if longrope is None else longrope.context_length(context)
        window = int(self._arch_key("attention.sliding_window", 0) or 0)
        options["sliding_window"] = window if 0 < window < limit else None
        return options

    def _moe_options(self, num_layers: int) -> dict[str, Any]:
        """A mixture of experts' ModelConfig options as llama.cpp runs the file (empty without
        `{arch}.expert_count`): the softmax top-`expert_used_count` router, its weights
        renormalised (llama.cpp does for Mixtral and Qwen3-MoE; `expert_weights_norm` where a
        file says), each expert `expert_feed_forward_length` wide (Mixtral's files:
        `feed_forward_length`), sparse the layers that have a router (`ffn_gate_inp`)."""
        num_experts = int(self._arch_key("expert_count", 0) or 0)
        if not num_experts:
            return {}
        used = self._arch_key("expert_used_count")
        width = self._arch_key("expert_feed_forward_length") or self._arch_key(
            "feed_forward_length"
        )
        if used is None or width is None:
            raise ValueError(
                f"{self.path}: GGUF metadata lacks {self.architecture}.expert_used_count or the "
                "experts' feed_forward_length"
            )
        return {
            "num_experts": num_experts,
            "num_experts_per_tok": int(used),
            "moe_intermediate_size": int(width),
            "norm_topk_prob": bool(self._arch_key("expert_weights_norm", True)),
            "moe_layers": tuple(
                index
                for index in range(num_layers)
                if f"blk.{index}.ffn_gate_inp.weight" in self._tensors
            ),
        }

    def _gemma_options(self, hidden_per_head: int) -> dict[str, Any]:
        """The ModelConfig options of a Gemma file as llama.cpp runs it (empty for other
        architectures): the sandwich norms, GeGLU and scaled embeddings of the family; the
        window and soft-capping from the metadata; the layer pattern, the sliding layers'
        RoPE base and the attention scale as llama.cpp fixes them (`_GEMMA_SWA_PATTERN`, ...);
        Gemma 3's final logit soft-capping where the metadata sets it."""
        arch = self.architecture
        if arch not in _SHIFTED_NORM_ARCHITECTURES:
            return {}
        num_layers = int(self._arch_key("block_count", 0))
        head_dim = int(self._arch_key("attention.key_length", hidden_per_head))
        window = self._arch_key(
            "attention.sliding_window", _GEMMA2_DEFAULT_WINDOW if arch == "gemma2" else None
        )
        window = int(window) if window else None  # 0: none (llama.cpp's Gemma 3 reading)
        pattern = _GEMMA_SWA_PATTERN[arch]
        layer_types = ()
        if window is not None:
            layer_types = tuple(
                FULL if (i + 1) % pattern == 0 else SLIDING for i in range(num_layers)
            )
        options: dict[str, Any] = {
            "norm_placement": "sandwich",
            "norm_unit_offset": True,
            "hidden_act": "gelu_pytorch_tanh",
            "scale_embeddings": True,
            "sliding_window": window,
            "layer_types": layer_types,
            "query_pre_attn_scalar": float(
                hidden_per_head if num_layers == _GEMMA_27B_LAYERS[arch] else head_dim
            ),
        }
        if arch == "gemma2":
            options["attn_logit_softcapping"] = float(self._arch_key("attn_logit_softcapping", 50))
            options["final_logit_softcapping"] = float(
                self._arch_key("final_logit_softcapping", 30)
            )
            return options
        final_cap = self._arch_key("final_logit_softcapping")
        if final_cap:  # absent or 0: none
            options["final_logit_softcapping"] = float(final_cap)
        if window is not None:
            options["local_rope_theta"] = _GEMMA3_SWA_ROPE_BASE
        return options

    def _raw(self, gguf_name: str) -> np.ndarray:
        """The stored bytes of one tensor, read from the file (a fresh buffer, not the map).

        Raises: CheckpointError: the file ends inside the tensor."""
        tensor = self._tensors[gguf_name]
        with self.path.open("rb") as file:
            data = os.pread(file.fileno(), tensor.n_bytes, tensor.data_offset)
        if len(data) != tensor.n_bytes:
            raise CheckpointError(
                f"{self.path}: truncated file: tensor {gguf_name!r} needs {tensor.n_bytes} bytes "
                f"at offset {tensor.data_offset}, the file has {len(data)}"
            )
        return np.frombuffer(data, dtype=np.uint8)

    def tensor_type(self, gguf_name: str) -> str:
        """The GGML type name of a tensor ("F32", "Q4_1", ...)."""
        return self._tensors[gguf_name].tensor_type.name

    def _shape(self, gguf_name: str) -> list[int]:
        return [int(n) for n in reversed(self._tensors[gguf_name].dims)]

    def read_tensor(self, gguf_name: str) -> torch.Tensor:
        """Dequantizes one tensor to float32, in torch's [rows, cols] order (ggml's reversed).

        Raises:
            KeyError: no such tensor.
            CheckpointError: a quantization type `gguf` cannot dequantize, or a truncated file.
        """
        return self._dequantize(gguf_name, self._raw(gguf_name), self._shape(gguf_name))

    def _dequantize(self, gguf_name: str, raw: np.ndarray, shape: list[int]) -> torch.Tensor:
        """Stored bytes `raw` of (part of) a tensor -> float32 of `shape`."""
        from gguf.quants import dequantize

        tensor = self._tensors[gguf_name]
        if tensor.tensor_type.name in ("F32", "F16"):  # `dequantize` reads these as values
            raw = raw.view(np.float32 if tensor.tensor_type.name == "F32" else np.float16)
        try:
            values = dequantize(raw, tensor.tensor_type)
        except NotImplementedError as err:
            raise CheckpointError(
                f"{self.path}: tensor {gguf_name!r} has unsupported type {tensor.tensor_type.name}"
            ) from err
        return torch.from_numpy(np.array(values, dtype=np.float32).reshape(shape))

    def _raw_slice(self, gguf_name: str, piece: TensorSlice) -> tuple[np.ndarray, list[int]] | None:
        """The stored bytes of a slice of one tensor and its shape: rows are read alone (they
        are contiguous); columns are cut out of each row, and only on block boundaries (None
        when the slice's edges fall inside a quantization block).

        Raises: CheckpointError: the file ends inside the tensor."""
        from gguf import GGML_QUANT_SIZES

        tensor = self._tensors[gguf_name]
        shape = self._shape(gguf_name)
        block_values, block_bytes = GGML_QUANT_SIZES[tensor.tensor_type]
        row_values = shape[1] if len(shape) == 2 else 1
        row_bytes = row_values * block_bytes // block_values
        if piece.dim == 0:
            count = piece.end - piece.start
            offset = tensor.data_offset + piece.start * row_bytes
            with self.path.open("rb") as file:
                data = os.pread(file.fileno(), count * row_bytes, offset)
            if len(data) != count * row_bytes:
                raise CheckpointError(f"{self.path}: truncated file inside tensor {gguf_name!r}")
            return np.frombuffer(data, dtype=np.uint8), [count, *shape[1:]]
        if piece.start % block_values or piece.end % block_values:
            return None
        rows = self._raw(gguf_name).reshape(shape[0], row_bytes)
        first, last = (edge // block_values * block_bytes for edge in (piece.start, piece.end))
        return np.ascontiguousarray(rows[:, first:last]).reshape(-1), [
            shape[0],
            piece.end - piece.start,
        ]

    def read_quantized(self, gguf_name: str) -> GroupQuantized | None:
        """One tensor as group-quantized integers (exactly its dequantization, see
        `gguf_blocks`), or None when its type is not one of GGUF_QUANT_TYPES (float types,
        and the quantizations we only dequantize).

        Raises: KeyError: no such tensor. CheckpointError: a truncated file.
        """
        type_name = self.tensor_type(gguf_name)
        if type_name not in GGUF_QUANT_TYPES:
            return None
        shape = self._shape(gguf_name)
        if len(shape) != 2:
            return None
        return decode_blocks(self._raw(gguf_name), type_name, (shape[0], shape[1]))

    def hf_tensor_type(self, hf_name: str) -> str | None:
        """The GGML type of the tensor stored for an HF name, or None if absent."""
        gguf_name = self._hf_names.get(hf_name)
        return None if gguf_name is None else self.tensor_type(gguf_name)

    def _restore_rows(self, gguf_name: str, config: ModelConfig, num_rows: int | None = None):
        """The row permutation that undoes llama.cpp's Q/K reordering of this tensor (or of
        `num_rows` of its rows, whole heads), or None."""
        if self.architecture in _PERMUTED_QK_ARCHITECTURES:
            for part, heads in (
                (".attn_q.", config.num_attention_heads),
                (".attn_k.", config.num_key_value_heads),
            ):
                if part in gguf_name:
                    if num_rows is not None:  # the permutation is within each head
                        heads = num_rows // config.head_dim
                    return lambda t, heads=heads: reverse_permute_qk(t, heads)
        return None

    def _fused_rows(
        self, hf_name: str, config: ModelConfig, piece: TensorSlice | None
    ) -> tuple[str, TensorSlice] | None:
        """For our q/k/v and gate/up projections in a Phi-3 file: its fused tensor and the rows
        of it that hold `hf_name` (of those, its `piece`'s rows), read alone; else None."""
        fused = phi3_fused_rows(hf_name, config) if self.architecture == "phi3" else None
        if fused is None or fused[0] not in self._tensors:
            return None
        gguf_name, first, count = fused
        if piece is not None and piece.dim == 0:
            first, count = first + piece.start, piece.end - piece.start
        return gguf_name, TensorSlice(0, first, first + count)

    def _read_expert(self, hf_name: str, piece: TensorSlice | None) -> torch.Tensor:
        """One expert's weight out of its layer's stacked tensor (float32; its `piece` when
        given). The layer's three stacked tensors are dequantized once and kept while its
        experts are read (the next layer's first read drops them)."""
        gguf_name, expert = self._expert_parts[hf_name]
        if gguf_name not in self._stacked:
            layer = gguf_name.split(".")[1]
            if any(name.split(".")[1] != layer for name in self._stacked):
                self._stacked.clear()
            self._stacked[gguf_name] = self.read_tensor(gguf_name)
        tensor = self._stacked[gguf_name][expert]
        return tensor.clone() if piece is None else piece.take(tensor)

    def read_hf_tensor(
        self, hf_name: str, config: ModelConfig, piece: TensorSlice | None = None
    ) -> torch.Tensor | None:
        """The float32 tensor for an HF parameter name (Q/K rows restored), or None if absent;
        only its `piece` when given (a tensor-parallel rank's slice: only those rows are read;
        columns that do not start on a block boundary are cut from the dequantized tensor)."""
        if hf_name in self._expert_parts:
            return self._read_expert(hf_name, piece)
        fused = self._fused_rows(hf_name, config, piece)
        if fused is not None:
            tensor = self._dequantize(fused[0], *self._raw_slice(*fused))  # type: ignore[misc]
            if piece is not None and piece.dim == 1:
                tensor = piece.take(tensor)
            return _partial_rotary(hf_name, config, tensor)
        gguf_name = self._hf_names.get(hf_name)
        if gguf_name is None:
            return None
        if self.architecture in _SHIFTED_NORM_ARCHITECTURES and gguf_name.endswith("norm.weight"):
            tensor = self.read_tensor(gguf_name) - 1.0  # stored as 1 + w
            return tensor if piece is None else piece.take(tensor)
        if piece is None or piece.zeros:
            tensor = self.read_tensor(gguf_name)
            restore = self._restore_rows(gguf_name, config)
            tensor = tensor if restore is None else restore(tensor)
            return tensor if piece is None else piece.take(tensor)
        sliced = self._raw_slice(gguf_name, piece)
        if sliced is None:
            tensor = piece.take(self.read_tensor(gguf_name))
        else:
            tensor = self._dequantize(gguf_name, *sliced)
        restore = self._restore_rows(gguf_name, config, tensor.shape[0])
        return tensor if restore is None else restore(tensor)

    def _read_expert_quantized(
        self, hf_name: str, piece: TensorSlice | None
    ) -> GroupQuantized | None:
        """One expert's blocks out of its layer's stacked tensor (its rows are contiguous), or
        None as `read_hf_quantized`; a `piece` of rows is read, columns on block boundaries."""
        from gguf import GGML_QUANT_SIZES

        gguf_name, expert = self._expert_parts[hf_name]
        tensor = self._tensors[gguf_name]
        type_name = tensor.tensor_type.name
        if type_name not in GGUF_QUANT_TYPES:
            return None
        _, rows, cols = self._shape(gguf_name)
        block_values, block_bytes = GGML_QUANT_SIZES[tensor.tensor_type]
        row_bytes = cols * block_bytes // block_values
        first, count = expert * rows, rows
        if piece is not None and piece.dim == 0:
            first, count = first + piece.start, piece.end - piece.start
        with self.path.open("rb") as file:
            data = os.pread(
                file.fileno(), count * row_bytes, tensor.data_offset + first * row_bytes
            )
        if len(data) != count * row_bytes:
            raise CheckpointError(f"{self.path}: truncated file inside tensor {gguf_name!r}")
        raw = np.frombuffer(data, dtype=np.uint8)
        if piece is not None and piece.dim == 1:
            if piece.start % block_values or piece.end % block_values:
                return None
            start, end = (edge // block_values * block_bytes for edge in (piece.start, piece.end))
            raw = np.ascontiguousarray(raw.reshape(count, row_bytes)[:, start:end]).reshape(-1)
            cols = piece.end - piece.start
        return decode_blocks(raw, type_name, (count, cols))

    def read_hf_quantized(
        self, hf_name: str, config: ModelConfig, piece: TensorSlice | None = None
    ) -> GroupQuantized | None:
        """`read_quantized` for an HF parameter name (Q/K rows restored); None if absent or not
        stored in one of GGUF_QUANT_TYPES, or when `piece` (a rank's slice, as in
        `read_hf_tensor`) cuts columns inside a quantization block."""
        if hf_name in self._expert_parts:
            return self._read_expert_quantized(hf_name, piece)
        fused = self._fused_rows(hf_name, config, piece)
        if fused is not None:
            type_name = self.tensor_type(fused[0])
            if type_name not in GGUF_QUANT_TYPES or (piece is not None and piece.dim == 1):
                return None
            raw, shape = self._raw_slice(*fused)  # type: ignore[misc]
            quantized = decode_blocks(raw, type_name, (shape[0], shape[1]))
            return _partial_rotary(hf_name, config, quantized)
        gguf_name = self._hf_names.get(hf_name)
        if gguf_name is None:
            return None
        if piece is None:
            quantized = self.read_quantized(gguf_name)
        else:
            type_name = self.tensor_type(gguf_name)
            if type_name not in GGUF_QUANT_TYPES or len(self._shape(gguf_name)) != 2:
                return None
            sliced = self._raw_slice(gguf_name, piece)
            if sliced is None:
                return None
            raw, shape = sliced
            quantized = decode_blocks(raw, type_name, (shape[0], shape[1]))
        if quantized is None:
            return None
        restore = self._restore_rows(
            gguf_name, config, None if piece is None else quantized.shape[0]
        )
        return quantized if restore is None else quantized.map_rows(restore)

    def is_block_aligned(self, hf_name: str, piece: TensorSlice) -> bool:
        """Whether `piece` of the tensor stored for `hf_name` keeps whole quantization blocks."""
        from gguf import GGML_QUANT_SIZES

        expert = self._expert_parts.get(hf_name)
        gguf_name = expert[0] if expert is not None else self._hf_names.get(hf_name)
        if gguf_name is None or piece.dim == 0:
            return True
        block_values, _ = GGML_QUANT_SIZES[self._tensors[gguf_name].tensor_type]
        return piece.start % block_values == 0 and piece.end % block_values == 0

    def tokenizer(self) -> Tokenizer | None:
        """The tokenizer described by `tokenizer.ggml.*`, or None if the file has no vocabulary.

        Flags the file leaves out take llama.cpp's defaults (`Tokenizer.from_gguf_vocab`).

        Raises:
            ValueError: a tokenizer model other than byte-level BPE ("gpt2") and SentencePiece
                ("llama"), or a SentencePiece vocabulary without its scores.
        """
        meta = self.metadata
        if "tokenizer.ggml.tokens" not in meta:
            return None
        add_bos_token = meta.get("tokenizer.ggml.add_bos_token")
        return Tokenizer.from_gguf_vocab(
            model=str(meta.get("tokenizer.ggml.model", "")),
            pre=meta.get("tokenizer.ggml.pre"),
            tokens=meta["tokenizer.ggml.tokens"],
            token_types=meta.get("tokenizer.ggml.token_type"),
            merges=meta.get("tokenizer.ggml.merges", []),
            bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
            eos_token_id=meta.get("tokenizer.ggml.eos_token_id"),
            scores=meta.get("tokenizer.ggml.scores"),
            unknown_token_id=meta.get("tokenizer.ggml.unknown_token_id"),
            add_bos_token=None if add_bos_token is None else bool(add_bos_token),
            add_eos_token=bool(meta.get("tokenizer.ggml.add_eos_token", False)),
            add_space_prefix=bool(meta.get("tokenizer.ggml.add_space_prefix", True)),
            chat_template=meta.get("tokenizer.chat_template"),
        )


def _partial_rotary(hf_name: str, config: ModelConfig, weight: Rows) -> Rows:
    """A q/k projection's rows as `hf_tensors` lays them out under partial rotary (Phi-3)."""
    if config.rotary_dim == config.head_dim or not hf_name.endswith(
        ("q_proj.weight", "k_proj.weight")
    ):
        return weight
    return partial_rotary_rows(config, weight, query=hf_name.endswith("q_proj.weight"))
