"""A block drafter's checkpoint directory: `save_block_drafter` writes ours (config.json and
model.safetensors), `read_block_drafter_config` and `load_block_drafter` read ours or z-lab's
public DFlash format (`dflash_format`). Reads and writes files only."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from specdec.drafters.block.dflash_format import (
    is_zlab_dflash,
    load_zlab_dflash,
    zlab_config_alone,
)
from specdec.drafters.block.network import (
    BLOCK_DRAFTER_KINDS,
    BlockDrafterConfig,
    BlockDrafterModel,
)
from specdec.models import LlamaForCausalLM
from specdec.models.weights import CheckpointError, assign_weights

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"


def save_block_drafter(
    model: BlockDrafterModel, path: str | Path, dtype: torch.dtype | None = None
) -> Path:
    """Writes config.json and model.safetensors (the drafter's own weights, not the target's),
    in `dtype` (None: as they are)."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / CONFIG_FILE).write_text(json.dumps(model.config.to_dict(), indent=2) + "\n")
    state = {
        name: t.detach().to("cpu", dtype or t.dtype).contiguous()
        for name, t in model.state_dict().items()
    }
    save_file(state, str(path / WEIGHTS_FILE))
    return path


def read_block_drafter_config(path: str | Path) -> BlockDrafterConfig:
    """The BlockDrafterConfig of a checkpoint directory (ours, or z-lab's DFlash format read
    without its target: `dflash_format.zlab_config_alone`)."""
    file = Path(path) / CONFIG_FILE
    if not file.is_file():
        raise FileNotFoundError(f"no {CONFIG_FILE} in {path}")
    try:
        values = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise CheckpointError(f"cannot read {file}: {err}") from err
    if isinstance(values, dict) and is_zlab_dflash(values):
        return zlab_config_alone(values, file)
    if values.get("specdec_drafter") not in BLOCK_DRAFTER_KINDS:
        raise CheckpointError(
            f'{file} is not a dflash/dspark drafter config (its "specdec_drafter" is '
            f"{values.get('specdec_drafter')!r})"
        )
    return BlockDrafterConfig.from_dict(values)


def load_block_drafter(path: str | Path, target: LlamaForCausalLM) -> BlockDrafterModel:
    """Loads a checkpoint written by `save_block_drafter`, or z-lab's public DFlash format
    (`dflash_format.load_zlab_dflash`), in the target's dtype and device.

    Raises:
        FileNotFoundError: no config.json or weights file.
        CheckpointError: an unreadable file, a missing tensor or a shape mismatch.
        ValueError: a checkpoint built for another target.
    """
    from safetensors import safe_open

    config = read_block_drafter_config(path)
    if is_zlab_dflash(json.loads((Path(path) / CONFIG_FILE).read_text(encoding="utf-8"))):
        return load_zlab_dflash(path, target)
    weights = Path(path) / WEIGHTS_FILE
    if not weights.is_file():
        raise FileNotFoundError(f"no {WEIGHTS_FILE} in {path}")
    with torch.device("meta"):
        model = BlockDrafterModel(config, target.config)
    with safe_open(str(weights), framework="pt", device="cpu") as file:
        names = set(file.keys())
        assign_weights(
            model,
            lambda name: file.get_tensor(name) if name in names else None,
            str(weights),
            target.dtype,
            target.device,
        )
    return model
