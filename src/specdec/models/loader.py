"""load_model: a Llama-family model, its config and tokenizer from a HF directory or a GGUF file.

HF directories hold config.json, `*.safetensors` (one file or shards listed in
model.safetensors.index.json) and tokenizer files. The model is built on the meta device and its
parameters are assigned from the files, so nothing is ever initialised randomly.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, NamedTuple

import torch

from specdec.models.config import ModelConfig
from specdec.models.gguf_file import GGUFFile
from specdec.models.llama import LlamaForCausalLM
from specdec.models.tokenizer import Tokenizer
from specdec.models.weights import CheckpointError, assign_weights

GGUF_MAGIC = b"GGUF"


class LoadedModel(NamedTuple):
    """What `load_model` returns (unpacks as `model, config, tokenizer = load_model(path)`)."""

    model: LlamaForCausalLM
    config: ModelConfig
    tokenizer: Tokenizer | None


def load_model(
    path: str | Path, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"
) -> LoadedModel:
    """Loads a model from a HF directory or a `.gguf` file.

    Args:
        path: a directory with config.json + safetensors, or a GGUF file.
        dtype: dtype of the parameters (GGUF tensors are dequantized to float32 first).
        device: where the parameters live.

    Returns:
        LoadedModel(model in eval mode without grads, its ModelConfig, its Tokenizer or None when
        the checkpoint has no tokenizer).

    Raises:
        FileNotFoundError: no such path, no config.json, no safetensors file, a missing shard.
        CheckpointError: an unreadable file, a missing tensor or a shape mismatch (named).
        ValueError: an unsupported architecture or setting.
    """
    path = Path(path)
    if path.is_dir():
        return _load_hf_dir(path, dtype, device)
    if not path.exists():
        raise FileNotFoundError(f"no such model path: {path}")
    with path.open("rb") as file:
        magic = file.read(4)
    if magic != GGUF_MAGIC:
        raise CheckpointError(
            f"{path} is neither a directory nor a GGUF file (expected a HF model directory with "
            "config.json and *.safetensors, or a .gguf file)"
        )
    return _load_gguf(path, dtype, device)


def _load_gguf(path: Path, dtype: torch.dtype, device: torch.device | str) -> LoadedModel:
    gguf_file = GGUFFile(path)
    config = gguf_file.model_config()
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    assign_weights(
        model, lambda name: gguf_file.read_hf_tensor(name, config), str(path), dtype, device
    )
    return LoadedModel(model, config, gguf_file.tokenizer())


def _load_hf_dir(path: Path, dtype: torch.dtype, device: torch.device | str) -> LoadedModel:
    config = ModelConfig.from_hf_config(_read_json(path / "config.json", "config.json"))
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    with _SafetensorsCheckpoint(path) as checkpoint:
        assign_weights(model, checkpoint.read, str(path), dtype, device)
    tokenizer = None
    if (path / "tokenizer.json").is_file():
        tokenizer = Tokenizer.from_hf_dir(path)
        # tokenizer_config.json may omit the special tokens; config.json names them by id.
        if tokenizer.eos_token is None and config.eos_token_ids:
            tokenizer.eos_token = tokenizer.backend.id_to_token(config.eos_token_ids[0])
        if tokenizer.bos_token is None and config.bos_token_id is not None:
            tokenizer.bos_token = tokenizer.backend.id_to_token(config.bos_token_id)
    return LoadedModel(model, config, tokenizer)


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

    def read(self, name: str) -> torch.Tensor | None:
        file = self._file_of.get(name)
        if file is None:
            return None
        try:
            return self._open(file).get_tensor(name)
        except CheckpointError:
            raise
        except Exception as err:
            raise CheckpointError(f"cannot read tensor {name!r} from {file}: {err}") from err

    def __enter__(self) -> _SafetensorsCheckpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self._handles.clear()
