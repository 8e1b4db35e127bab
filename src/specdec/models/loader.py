"""load_model: a Llama-family model, its config and tokenizer from a HF directory or a GGUF file.

HF directories hold config.json, `*.safetensors` (one file or shards listed in
model.safetensors.index.json; FP8 checkpoints with `weight_scale` tensors too) and tokenizer
files; a family's own tensors are read under our names (`hf_tensors`: Phi-3's fused q/k/v and
gate/up, partial rotary's q/k layout). The model is built on the meta device and its parameters
are assigned from the files, so nothing is ever initialised randomly. With a `quantization`, the
linear layers (q/k/v and gate/up fused) and the LM head are packed for their kernels (`quant.py`)
and never held as floats.
"""

from __future__ import annotations

import json
import re
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import torch

from specdec.models.config import ModelConfig
from specdec.models.gguf_file import GGUFFile
from specdec.models.hf_tensors import hf_tensors
from specdec.models.layers import Linear, fused_quantized, set_fused
from specdec.models.llama import LlamaForCausalLM
from specdec.models.moe import SparseMoeBlock
from specdec.models.quant import QuantizedWeight
from specdec.models.quant_formats import (
    Fp8Quantized,
    GroupQuantized,
    Quantized,
    check_quantization,
    concat_quantized,
    quantize,
)
from specdec.models.tensor_parallel import ShardLayout, TensorSlice, tensor_slice
from specdec.models.tokenizer import Tokenizer
from specdec.models.weights import CheckpointError, assign_weights

GGUF_MAGIC = b"GGUF"


class LoadedModel(NamedTuple):
    """What `load_model` returns (unpacks as `model, config, tokenizer = load_model(path)`)."""

    model: LlamaForCausalLM
    config: ModelConfig
    tokenizer: Tokenizer | None


def is_gguf(path: str | Path) -> bool:
    """Whether `path` is a file starting with the GGUF magic."""
    path = Path(path)
    if not path.is_file():
        return False
    with path.open("rb") as file:
        return file.read(4) == GGUF_MAGIC


def missing_model_message(path: str | Path) -> str:
    """The error for a model path that does not exist; a Hub id (`owner/name`) is told that
    nothing is downloaded here."""
    message = f"no such model path: {path}"
    if _looks_like_hub_id(str(path)):
        message += " (models are not downloaded here: pass a local HF directory or a GGUF file)"
    return message


def _looks_like_hub_id(path: str) -> bool:
    """Whether `path` reads as a Hugging Face Hub repository id: `owner/name`, relative, one
    slash, and nothing of that name here."""
    owner, _, name = path.partition("/")
    return (
        re.fullmatch(r"[\w.-]+/[\w.-]+", path) is not None
        and owner not in (".", "..")
        and name not in (".", "..")
        and not Path(path).exists()
    )


def resolve_quantization(
    path: str | Path, quantization: str | None, device: torch.device | str = "cpu"
) -> str | None:
    """What a model's linear layers run as: "auto" is "gguf" for a GGUF file on the CPU (its
    tensors kept quantized), "fp8" for an FP8 checkpoint, and None (float) otherwise (a GGUF
    file on CUDA is dequantized at load); other values are checked.

    On the CPU every quantized product takes the weight-only kernel, whose rows do not depend
    on the batch, so a request alone emits what it emits in a batch under "gguf" as under float.

    Raises: ValueError: an unknown quantization, or "gguf" for a HF directory.
    """
    gguf = is_gguf(path)
    if quantization == "auto":
        if gguf:
            return "gguf" if torch.device(device).type == "cpu" else None
        return "fp8" if Path(path).is_dir() and _has_fp8_weights(Path(path)) else None
    check_quantization(quantization)
    if quantization == "gguf" and not gguf:
        raise ValueError(
            f"quantization='gguf' runs a GGUF file's own formats, but {path} is not a GGUF file "
            "(choose int8, int4, fp8 or None)"
        )
    return quantization


def default_quantization(path: str | Path, like: str | None) -> str | None:
    """The quantization of a model at `path` loaded beside one quantized as `like` (a drafter
    beside its target): `like` itself, except that "gguf" means "each file's own formats"
    ("auto") for a file that is not GGUF."""
    if like == "gguf" and not is_gguf(path):
        return "auto"
    return like


def load_model(
    path: str | Path,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    quantization: str | None = None,
    shard: ShardLayout | None = None,
) -> LoadedModel:
    """Loads a model from a HF directory or a `.gguf` file (or one tensor-parallel rank's shard
    of it: only that rank's slices of each tensor are read).

    Args:
        path: a directory with config.json + safetensors, or a GGUF file.
        dtype: the activation dtype, and that of every float parameter (norms, biases, float
            weights; GGUF tensors are dequantized to float32 first).
        device: where the parameters live.
        quantization: what the linear layers run as (see `resolve_quantization`): None
            dequantizes everything to `dtype`; "gguf" keeps a GGUF file's Q8_0, Q4_0, Q4_1,
            Q4_K and Q6_K tensors as they are (other types are dequantized); "int8"
            (per channel), "int4" (group-wise; GGUF 4-bit tensors as they are) and "fp8" (e4m3,
            per channel; an FP8 checkpoint's own scales) quantize at load; "auto" picks
            ("gguf" for a GGUF file on the CPU).
        shard: load only this rank's slices (`tensor_parallel.ShardLayout`; None: the whole
            model). GGUF blocks stay quantized: rows split anywhere, columns of the
            row-parallel o/down projections on block boundaries (a tensor whose boundary falls
            inside a block is dequantized, with a warning). "int8"/"int4"/"fp8" quantize each
            rank's slice.

    Returns:
        LoadedModel(model in eval mode without grads, its ModelConfig, its Tokenizer or None when
        the checkpoint has no tokenizer).

    Raises:
        FileNotFoundError: no such path, no config.json, no safetensors file, a missing shard.
        CheckpointError: an unreadable file, a missing tensor or a shape mismatch (named).
        ValueError: an unsupported architecture, setting or quantization.
    """
    path = Path(path)
    if path.is_dir():
        loaded = _load_hf_dir(
            path, dtype, device, resolve_quantization(path, quantization, device), shard
        )
    elif not path.exists():
        raise FileNotFoundError(missing_model_message(path))
    elif not is_gguf(path):
        raise CheckpointError(
            f"{path} is neither a directory nor a GGUF file (expected a HF model directory with "
            "config.json and *.safetensors, or a .gguf file)"
        )
    else:
        loaded = _load_gguf(
            path, dtype, device, resolve_quantization(path, quantization, device), shard
        )
    _release_freed_memory()
    return loaded


def _release_freed_memory() -> None:
    """Returns the heap that loading freed (file bytes, unpacked integers) to the OS: glibc
    keeps freed chunks of this size for reuse, which would stay in the resident set."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to do
        pass


def _empty_model(
    config: ModelConfig,
    shard: ShardLayout | None,
    without_layers: bool,
    device: torch.device | str,
) -> LlamaForCausalLM:
    """The model to fill, on the meta device (with no decoder layers when `without_layers`).

    Raises: ValueError: no path runs the model on `device` (`ModelConfig.device_reason`)."""
    device_type = torch.device(device).type
    reason = config.device_reason(device_type)
    if reason is not None:
        raise ValueError(
            f"{config.architecture} on {device_type}: {reason} is not supported by its "
            "attention kernels; load it on the CPU"
        )
    with torch.device("meta"):
        model = LlamaForCausalLM(config, shard)
    if without_layers:
        model.model.layers = torch.nn.ModuleList()
    return model


def _piece_of(
    config: ModelConfig, shard: ShardLayout | None
) -> Callable[[str], TensorSlice | None]:
    """The slice of each tensor a rank loads (always None without a shard)."""
    if shard is None:
        return lambda name: None
    return lambda name: tensor_slice(name, config, shard)


def _load_gguf(
    path: Path,
    dtype: torch.dtype,
    device: torch.device | str,
    quantization: str | None,
    shard: ShardLayout | None = None,
    without_layers: bool = False,
) -> LoadedModel:
    gguf_file = GGUFFile(path)
    config = gguf_file.model_config()
    model = _empty_model(config, shard, without_layers, device)
    piece_of = _piece_of(config, shard)

    def read_float(name: str) -> torch.Tensor | None:
        return gguf_file.read_hf_tensor(name, config, piece_of(name))

    def read_quantized(name: str) -> Quantized | None:
        piece = piece_of(name)
        if piece is not None and not gguf_file.is_block_aligned(name, piece):
            warnings.warn(
                f"{name}: rank {shard.rank}'s columns {piece.start}..{piece.end} cut "  # type: ignore[union-attr]
                f"{gguf_file.hf_tensor_type(name)} blocks: this tensor is dequantized",
                stacklevel=2,
            )
            return None
        if quantization in ("gguf", "int4"):
            stored = gguf_file.read_hf_quantized(name, config, piece)
            if stored is not None and (quantization == "gguf" or stored.bits == 4):
                return stored
            if quantization == "gguf":
                return None  # a float (or only-dequantized) tensor stays float
        tensor = read_float(name)
        return None if tensor is None else quantize(tensor, quantization)  # type: ignore[arg-type]

    table = None
    if quantization == "gguf":
        embed = "model.embed_tokens.weight"
        table = gguf_file.read_hf_quantized(embed, config, piece_of(embed))
    _load_weights(model, read_float, read_quantized, str(path), dtype, device, quantization, table)
    _release_freed_memory()  # before the tokenizer's own transient tables
    return LoadedModel(model, config, gguf_file.tokenizer())


def _load_hf_dir(
    path: Path,
    dtype: torch.dtype,
    device: torch.device | str,
    quantization: str | None,
    shard: ShardLayout | None = None,
    without_layers: bool = False,
) -> LoadedModel:
    config = ModelConfig.from_hf_config(_read_json(path / "config.json", "config.json"))
    model = _empty_model(config, shard, without_layers, device)
    piece_of = _piece_of(config, shard)
    with _SafetensorsCheckpoint(path) as checkpoint:
        read = hf_tensors(config, checkpoint.read)

        def read_float(name: str) -> torch.Tensor | None:
            return read(name, piece_of(name))

        def read_quantized(name: str) -> Quantized | None:
            stored = checkpoint.read_fp8(name, piece_of(name))
            if stored is not None and quantization == "fp8":
                return stored
            tensor = read_float(name)
            return None if tensor is None else quantize(tensor, quantization)  # type: ignore[arg-type]

        _load_weights(
            model, read_float, read_quantized, str(path), dtype, device, quantization, None
        )
    tokenizer = None
    if (path / "tokenizer.json").is_file():
        tokenizer = Tokenizer.from_hf_dir(path)
        # tokenizer_config.json may omit the special tokens; config.json names them by id.
        if tokenizer.eos_token is None and config.eos_token_ids:
            tokenizer.eos_token = tokenizer.backend.id_to_token(config.eos_token_ids[0])
        if tokenizer.bos_token is None and config.bos_token_id is not None:
            tokenizer.bos_token = tokenizer.backend.id_to_token(config.bos_token_id)
    return LoadedModel(model, config, tokenizer)


def check_moe_quantization(
    config: ModelConfig, quantization: str | None, device: torch.device | str
) -> None:
    """Quantized experts run on the CPU only (each expert's products through the weight-only
    kernels, the router in float): on CUDA the experts' grouped kernel takes float weights.

    Raises: ValueError: a quantized mixture of experts on CUDA."""
    if quantization is not None and config.is_moe and torch.device(device).type != "cpu":
        raise ValueError(
            f"{config.architecture}: quantization={quantization!r} is not supported for "
            "mixture-of-experts models on CUDA yet (the grouped expert kernel takes float "
            "weights): load it in float, or run it on the CPU"
        )


# Linears that read the same input, fused into one product when their formats agree.
_FUSED_GROUPS = (
    ("self_attn", "qkv_proj", ("q_proj", "k_proj", "v_proj")),
    ("mlp", "gate_up_proj", ("gate_proj", "up_proj")),
)
_SINGLE_LINEARS = (("self_attn", "o_proj"), ("mlp", "down_proj"))


def _load_weights(
    model: LlamaForCausalLM,
    read_float: Callable[[str], torch.Tensor | None],
    read_quantized: Callable[[str], Quantized | None],
    source: str,
    dtype: torch.dtype,
    device: torch.device | str,
    quantization: str | None,
    table: GroupQuantized | None,
) -> None:
    """Fills `model`: with a quantization, the linears and LM head from `read_quantized`
    (packed at once, one layer at a time; a linear it has no quantized tensor for stays float),
    a quantized embedding `table` if given; every other parameter from `read_float`.

    Mutates: `model` (parameters assigned, quantized weights set, `model.quantization`)."""
    model.quantization = quantization
    check_moe_quantization(model.config, quantization, device)
    if quantization is None:
        assign_weights(model, read_float, source, dtype, device)
        return
    device = torch.device(device)
    for index, layer in enumerate(model.model.layers):
        if index:  # the previous layer's file bytes and unpacked integers
            _release_freed_memory()
        prefix = f"model.layers.{index}"
        sparse = isinstance(layer.mlp, SparseMoeBlock)
        if sparse:  # each expert's three products (the router stays float); attention's below
            for number, expert in enumerate(layer.mlp.experts):
                for name in ("gate_proj", "up_proj", "down_proj"):
                    weight = read_quantized(f"{prefix}.mlp.experts.{number}.{name}.weight")
                    if weight is not None:
                        getattr(expert, name).set_quantized(QuantizedWeight(weight, device))
        for block_name, fused_name, names in _FUSED_GROUPS:
            if sparse and block_name == "mlp":  # the experts' products: above
                continue
            block = getattr(layer, block_name)
            linears = [getattr(block, name) for name in names]
            weights = [read_quantized(f"{prefix}.{block_name}.{name}.weight") for name in names]
            fused = _fuse(linears, weights, device)
            if fused is not None:
                bias = None
                if linears[0].bias is not None:
                    parts = [read_float(f"{prefix}.{block_name}.{name}.bias") for name in names]
                    if any(part is None for part in parts):
                        raise CheckpointError(f"{source}: missing a bias of {prefix}.{block_name}")
                    bias = torch.cat(parts).to(device=device, dtype=dtype)  # type: ignore[arg-type]
                set_fused(block, fused_name, fused_quantized(linears, fused, bias))
                continue
            for linear, weight in zip(linears, weights, strict=True):
                if weight is not None:
                    linear.set_quantized(QuantizedWeight(weight, device))
        for block_name, name in _SINGLE_LINEARS:
            if sparse and block_name == "mlp":
                continue
            weight = read_quantized(f"{prefix}.{block_name}.{name}.weight")
            if weight is not None:
                getattr(getattr(layer, block_name), name).set_quantized(
                    QuantizedWeight(weight, device)
                )
    if model.lm_head is not None:
        head = read_quantized("lm_head.weight")
        if head is not None:  # rows kept for drafters that score a reduced vocabulary
            model.lm_head.set_quantized(QuantizedWeight(head, device, keep_source=True))
    embed = model.model.embed_tokens
    if table is not None:
        table = table.to(device)
        embed.set_quantized(table, dtype)
        if model.lm_head is None:
            model.tied_head = QuantizedWeight(table, device, keep_source=True)
    assign_weights(model, read_float, source, dtype, device)
    if model.lm_head is None and model.tied_head is None and quantization != "gguf":
        model.tied_head = QuantizedWeight(
            quantize(embed.weight, quantization), device, keep_source=True
        )


def quantize_model(model: LlamaForCausalLM, quantization: str) -> LlamaForCausalLM:
    """Quantizes a loaded float model in place ("int8", "int4" or "fp8"), as `load_model` would
    have: each layer's linears (q/k/v and gate/up fused) and the LM head, one weight at a time.

    Raises: ValueError: an unknown quantization, "gguf", or a model already quantized.

    Mutates: `model` (its float weights are dropped). Returns: `model`.
    """
    check_quantization(quantization)
    if quantization == "gguf":
        raise ValueError("quantization='gguf' is a GGUF file's own formats: load the file")
    if model.config.is_moe:
        raise ValueError(
            f"{model.config.architecture}: quantization={quantization!r} is not supported for "
            "mixture-of-experts models yet"
        )
    if model.quantization is not None:
        raise ValueError(f"the model is already quantized ({model.quantization})")
    device, dtype = model.device, model.dtype
    for layer in model.model.layers:
        quantize_layer(layer, quantization, device, dtype)
    if model.lm_head is not None:
        head = quantize(model.lm_head.weight.detach(), quantization)
        model.lm_head.set_quantized(QuantizedWeight(head, device, keep_source=True))
    else:
        table = quantize(model.model.embed_tokens.weight.detach(), quantization)
        model.tied_head = QuantizedWeight(table, device, keep_source=True)
    model.quantization = quantization
    return model


def quantize_layer(
    layer: torch.nn.Module, quantization: str, device: torch.device, dtype: torch.dtype
) -> None:
    """Quantizes one decoder layer's linears in place (q/k/v and gate/up fused), then hands the
    memory of their float weights back to the OS. A weight kept in its file's dtype
    (`eagle.head.load_eagle_head`) gives the bits of one loaded in `dtype` (`quantize`)."""
    for block_name, fused_name, names in _FUSED_GROUPS:
        block = getattr(layer, block_name)
        linears = [getattr(block, name) for name in names]
        weights = [quantize(linear.weight.detach(), quantization, dtype) for linear in linears]
        fused = _fuse(linears, weights, device)
        assert fused is not None  # one format for all
        biases = [linear.bias for linear in linears]
        bias = None
        if all(b is not None for b in biases):
            parts = [b.detach() for b in biases if b is not None]
            bias = torch.cat(parts).to(device=device, dtype=dtype)
        set_fused(block, fused_name, fused_quantized(linears, fused, bias))
    for block_name, name in _SINGLE_LINEARS:
        linear = getattr(getattr(layer, block_name), name)
        weight = quantize(linear.weight.detach(), quantization, dtype)
        linear.set_quantized(QuantizedWeight(weight, device))
    _release_freed_memory()


def _fuse(
    linears: list[Linear], weights: list[Quantized | None], device: torch.device
) -> QuantizedWeight | None:
    """One packed weight for `linears` when all are quantized in one format, else None."""
    if any(weight is None for weight in weights):
        return None
    first = weights[0]
    for weight in weights:
        if type(weight) is not type(first):
            return None
        if isinstance(weight, GroupQuantized) and isinstance(first, GroupQuantized):
            same = (
                weight.group_size == first.group_size
                and weight.value_range == first.value_range
                and (weight.zero is None) == (first.zero is None)
            )
            if not same:
                return None
    return QuantizedWeight(concat_quantized(weights), device)  # type: ignore[arg-type]


def _has_fp8_weights(path: Path) -> bool:
    """Whether a HF directory's config declares FP8 weights (`quantization_config`)."""
    config_file = path / "config.json"
    if not config_file.is_file():
        return False
    config = _read_json(config_file, "config.json")
    quant = config.get("quantization_config") or {}
    return str(quant.get("quant_method", "")).lower() in ("fp8", "fbgemm_fp8")


def _read_json(file: Path, what: str) -> dict[str, Any]:
    if not file.is_file():
        raise FileNotFoundError(f"no {what} in {file.parent}")
    try:
        return json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise CheckpointError(f"cannot read {file}: {err}") from err


class _SafetensorsCheckpoint:
    """The tensors of a HF directory's safetensors files, opened lazily, read one at a time."""

    def __init__(self, path: Path) -> None:
        self._handles: dict[Path, Any] = {}
        index_file = path / "model.safetensors.index.json"
        if index_file.is_file():
            weight_map = _read_json(index_file, index_file.name).get("weight_map", {})
            self._file_of = {name: path / file for name, file in weight_map.items()}
            for file in sorted(set(self._file_of.values())):
                if not file.is_file():
                    raise FileNotFoundError(f"{index_file} lists {file.name}, which is missing")
        else:
            files = sorted(path.glob("*.safetensors"))
            if not files:
                raise FileNotFoundError(
                    f"no *.safetensors file in {path} (only safetensors checkpoints are supported)"
                )
            self._file_of = {}
            for file in files:
                for name in self._open(file).keys():  # noqa: SIM118 (safe_open is not a dict)
                    self._file_of[name] = file

    def _open(self, file: Path) -> Any:
        from safetensors import safe_open

        if file not in self._handles:
            try:
                self._handles[file] = safe_open(str(file), framework="pt", device="cpu")
            except Exception as err:
                raise CheckpointError(f"cannot read {file}: {err}") from err
        return self._handles[file]

    def _get(self, name: str, piece: TensorSlice | None = None) -> torch.Tensor | None:
        """The tensor stored as `name`, or only its `piece` (read alone), or None if absent."""
        file = self._file_of.get(name)
        if file is None:
            return None
        try:
            if piece is None or piece.zeros:
                tensor = self._open(file).get_tensor(name)
                return tensor if piece is None else piece.take(tensor)
            part = self._open(file).get_slice(name)
            if piece.dim == 0:
                return part[piece.start : piece.end]
            return part[:, piece.start : piece.end]
        except CheckpointError:
            raise
        except Exception as err:
            raise CheckpointError(f"cannot read tensor {name!r} from {file}: {err}") from err

    def read_fp8(self, name: str, piece: TensorSlice | None = None) -> Fp8Quantized | None:
        """An FP8 (e4m3) weight with its `<name>_scale` (per tensor or per row), or None when
        `name` is not stored in FP8; only its `piece` when given.

        Raises: CheckpointError: an FP8 weight without a scale, or with block-wise scales."""
        tensor = self._get(name, piece)
        if tensor is None or tensor.dtype != torch.float8_e4m3fn:
            return None
        scale = self._get(name + "_scale")
        if scale is not None and piece is not None and piece.dim == 0 and scale.numel() > 1:
            scale = scale.reshape(-1)[piece.start : piece.end]
        if scale is None:
            raise CheckpointError(f"FP8 tensor {name!r} has no {name}_scale")
        rows = tensor.shape[0]
        scale = scale.to(torch.float32)
        if scale.numel() == 1:
            scale = scale.reshape(1).expand(rows)
        elif scale.numel() == rows:
            scale = scale.reshape(rows)
        else:
            raise CheckpointError(
                f"{name}_scale has shape {list(scale.shape)}: only per-tensor and per-channel "
                "FP8 scales are supported (not block-wise)"
            )
        return Fp8Quantized(tensor, scale.contiguous())

    def read(self, name: str, piece: TensorSlice | None = None) -> torch.Tensor | None:
        """A float tensor (an FP8 weight dequantized with its scale), or None if absent; only
        its `piece` when given."""
        fp8 = self.read_fp8(name, piece)
        if fp8 is not None:
            return fp8.dequantize()
        return self._get(name, piece)

    def __enter__(self) -> _SafetensorsCheckpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self._handles.clear()


def read_model_config(path: str | Path) -> ModelConfig:
    """The ModelConfig of a HF directory or GGUF file, without loading any tensor.

    Raises: FileNotFoundError, CheckpointError: as `load_model`."""
    path = Path(path)
    if path.is_dir():
        return ModelConfig.from_hf_config(_read_json(path / "config.json", "config.json"))
    if not path.exists():
        raise FileNotFoundError(missing_model_message(path))
    if not is_gguf(path):
        raise CheckpointError(f"{path} is neither a directory nor a GGUF file")
    return GGUFFile(path).model_config()


def load_vocabulary_layers(
    path: str | Path,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    quantization: str | None = None,
) -> LlamaForCausalLM:
    """The whole-vocabulary embedding, final norm and LM head of a model, with no decoder
    layers (what a drafter beside a tensor-parallel target shares with it on the driver);
    its `config` is the whole model's."""
    path = Path(path)
    quantization = resolve_quantization(path, quantization, device)
    load = _load_hf_dir if path.is_dir() else _load_gguf
    return load(path, dtype, device, quantization, None, without_layers=True).model
