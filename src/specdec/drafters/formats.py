"""Drafter checkpoints in public formats: a Hugging Face-style directory (config.json and
safetensors files, sharded through `model.safetensors.index.json` or not), its tensors read one at
a time by name, and which format it holds, recognised from its config and tensor names (never
from a flag the user must guess). Reads files only: builds no model and draws no randomness.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from specdec.models.weights import CheckpointError

INDEX_FILE = "model.safetensors.index.json"

# Formats `recognise_eagle` tells apart.
SPECDEC_EAGLE = "specdec-eagle"  # a head trained here (`specdec train-drafter --kind eagle`)
EAGLE1 = "eagle-1"  # EAGLE-1/2 (SafeAILab's cnets1.py; vLLM's "eagle" with a Llama head)
EAGLE3 = "eagle-3"  # EAGLE-3 (vLLM's "eagle3", SGLang, SpecForge, speculators)


class DrafterCheckpoint:
    """The config and tensors of a drafter directory; tensors are read lazily, by name.

    Attributes:
        path: the directory.
        config: its config.json.
        names: every stored tensor name.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = path = Path(path)
        self._handles: dict[Path, Any] = {}
        if not path.is_dir():
            raise FileNotFoundError(
                f"{path} is not a drafter directory (config.json and safetensors files)"
            )
        self.config = _read_json(path / "config.json")
        index = path / INDEX_FILE
        if index.is_file():
            weight_map = _read_json(index).get("weight_map") or {}
            files = {name: path / file for name, file in weight_map.items()}
            for file in sorted(set(files.values())):
                if not file.is_file():
                    raise FileNotFoundError(f"{index} lists {file.name}, which is missing")
        else:
            files = {}
            stored = sorted(path.glob("*.safetensors"))
            if not stored:
                raise FileNotFoundError(
                    f"no *.safetensors file in {path} (drafter checkpoints are read from "
                    "safetensors only; convert a pytorch_model.bin first)"
                )
            for file in stored:
                for name in self._open(file).keys():  # noqa: SIM118 (safe_open is not a dict)
                    files[name] = file
        self._file_of = files
        self.names = frozenset(files)

    def _open(self, file: Path) -> Any:
        from safetensors import safe_open

        if file not in self._handles:
            try:
                self._handles[file] = safe_open(str(file), framework="pt", device="cpu")
            except Exception as err:
                raise CheckpointError(f"cannot read {file}: {err}") from err
        return self._handles[file]

    def read(self, name: str) -> torch.Tensor | None:
        """The tensor stored as `name`, or None when absent."""
        file = self._file_of.get(name)
        if file is None:
            return None
        try:
            return self._open(file).get_tensor(name)
        except CheckpointError:
            raise
        except Exception as err:
            raise CheckpointError(f"cannot read tensor {name!r} from {file}: {err}") from err

    def require(self, name: str, shape: Sequence[int]) -> torch.Tensor:
        """The tensor stored as `name`, checked to have `shape` (as `check`)."""
        return self.check(name, self.read(name), shape)

    def check(self, name: str, tensor: torch.Tensor | None, shape: Sequence[int]) -> torch.Tensor:
        """`tensor` (read as `name`, or None when absent), checked to have `shape`.

        Raises:
            CheckpointError: naming the tensor when it is missing or has another shape."""
        if tensor is None:
            raise CheckpointError(
                f"{self.path}: missing tensor {name!r} (expected shape {list(shape)})"
            )
        if tuple(tensor.shape) != tuple(shape):
            raise CheckpointError(
                f"{self.path}: tensor {name!r} has shape {list(tensor.shape)}, "
                f"expected {list(shape)}"
            )
        return tensor

    def stores_other(self, name: str, shared: torch.Tensor | None) -> bool:
        """Whether tensor `name` is stored with other values than `shared` (a table the
        drafter would otherwise share with the target; compared in `shared`'s dtype, a shape
        that differs or a `shared` of None, e.g. quantized, counting as other); False when
        absent."""
        stored = self.read(name)
        if stored is None:
            return False
        if shared is None or tuple(stored.shape) != tuple(shared.shape):
            return True  # (a wrong shape is then named when the drafter's own table is loaded)
        return not torch.equal(stored.to(device=shared.device, dtype=shared.dtype), shared)

    def refuse_unused(self, used: set[str], what: str) -> None:
        """Raises CheckpointError naming the stored tensors outside `used`: a tensor the format
        does not define changes the math in a way this loader would silently drop."""
        unused = sorted(self.names - used)
        if unused:
            shown = ", ".join(repr(n) for n in unused[:8])
            more = f" and {len(unused) - 8} more" if len(unused) > 8 else ""
            raise CheckpointError(
                f"{self.path}: tensors that {what} does not define: {shown}{more}"
            )


def _read_json(file: Path) -> dict[str, Any]:
    if not file.is_file():
        raise FileNotFoundError(f"no {file.name} in {file.parent} (a drafter directory)")
    try:
        values = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise CheckpointError(f"cannot read {file}: {err}") from err
    if not isinstance(values, dict):
        raise CheckpointError(f"{file} does not hold a JSON object")
    return values


def strip_prefix(names: frozenset[str], prefix: str) -> str:
    """`prefix` when every name starts with it (a checkpoint saved from a wrapping module),
    else ""."""
    return prefix if names and all(n.startswith(prefix) for n in names) else ""


# EAGLE-3: the midlayer's name (EAGLE's, SpecForge's, SGLang's), its hidden_norm (under
# `layers.0.` too, as speculators names it: EAGLE-1/2 layers have none), the vocabulary maps.
_EAGLE3_NAMES = re.compile(r"(^|\.)(midlayer\.|layers\.0\.hidden_norm\.|d2t$|t2d$)")
_EAGLE3_ARCHITECTURES = (
    "LlamaForCausalLMEagle3",  # SpecForge, SGLang
    "Eagle3LlamaForCausalLM",  # vLLM
    "Eagle3Speculator",  # speculators
    "Eagle3DraftModel",  # speculators
)


def recognise_eagle(checkpoint: DrafterCheckpoint) -> str:
    """Which EAGLE head format a directory holds, from its config and tensor names.

    Returns:
        SPECDEC_EAGLE (config architectures ["SpecdecEagleHead"]); EAGLE3 (config
        `speculators_model_type: "eagle3"` or an EAGLE-3 architecture, or tensors `midlayer.*`,
        `layers.0.hidden_norm.*`, `d2t`, `t2d`); or EAGLE1 (`fc.weight` and `layers.0.*`
        tensors, optionally under `model.`).

    Raises:
        CheckpointError: a directory of none of these kinds, naming what was looked for.
    """
    from specdec.drafters.eagle.head import EAGLE_ARCHITECTURE

    config = checkpoint.config
    architectures = config.get("architectures") or []
    if architectures == [EAGLE_ARCHITECTURE]:
        return SPECDEC_EAGLE
    names = checkpoint.names
    if (
        config.get("speculators_model_type") == "eagle3"
        or any(a in _EAGLE3_ARCHITECTURES for a in architectures)
        or any(_EAGLE3_NAMES.search(name) for name in names)
    ):
        return EAGLE3
    prefix = strip_prefix(names, "model.")
    if f"{prefix}fc.weight" in names and any(n.startswith(f"{prefix}layers.0.") for n in names):
        return EAGLE1
    raise CheckpointError(
        f"{checkpoint.path} is not an EAGLE head this engine loads: expected a config.json "
        f'with architectures ["{EAGLE_ARCHITECTURE}"] (a head trained here), EAGLE-3 tensors '
        "(midlayer.* or layers.0.hidden_norm.*, d2t) or EAGLE-1/2 tensors fc.weight and "
        "layers.0.* (SafeAILab's format)"
    )


# Tensor namings `recognise_medusa` tells apart.
MEDUSA_FASTERDECODING = "medusa-fasterdecoding"  # {i}.{j}.linear.*, {i}.{layers}.weight
MEDUSA_VLLM = "medusa-vllm"  # blocks.{i}.layers.{j}.*, lm_heads.{i}.weight

_FASTERDECODING_NAME = re.compile(r"^(medusa_head\.)?\d+\.\d+\.(linear\.)?(weight|bias)$")
_VLLM_NAME = re.compile(r"^(medusa_heads\.)?(blocks|lm_heads)\.")


def recognise_medusa(checkpoint: DrafterCheckpoint) -> tuple[str, str]:
    """Which Medusa naming a directory's tensors follow, and their common prefix.

    Returns:
        (MEDUSA_FASTERDECODING, "medusa_head." or "") for FasterDecoding's names (the prefix
        when the heads were saved inside a whole model, as Medusa-2 does; none in
        medusa_lm_head.*), or (MEDUSA_VLLM, "medusa_heads." or "") for vLLM's.

    Raises:
        CheckpointError: no tensor named either way (the names looked for are given).
    """
    names = checkpoint.names
    if any(_VLLM_NAME.match(name) for name in names):
        prefix = "medusa_heads." if any(n.startswith("medusa_heads.") for n in names) else ""
        return MEDUSA_VLLM, prefix
    matched = [name for name in names if _FASTERDECODING_NAME.match(name)]
    if matched:
        prefix = "medusa_head." if matched[0].startswith("medusa_head.") else ""
        return MEDUSA_FASTERDECODING, prefix
    raise CheckpointError(
        f"{checkpoint.path} holds no Medusa heads: expected FasterDecoding's tensors "
        "([medusa_head.]{i}.{j}.linear.weight, [medusa_head.]{i}.{layers}.weight) or vLLM's "
        "(blocks.{i}.layers.{j}.weight, lm_heads.{i}.weight)"
    )
