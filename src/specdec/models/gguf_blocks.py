"""GGUF block formats decoded into group-quantized integers: Q8_0, Q4_0, Q4_1, Q4_K and Q6_K.

A block's bytes become integer values with one scale (and zero) per group, such that
`values * scale + zero` in float32 is bit for bit what llama.cpp's `gguf` package dequantizes
(the same products and sums, rounded the same way). This is the twin every quantized kernel is
tested against. Never builds kernels' layouts (`quant.py` does) and never touches the model.
"""

from __future__ import annotations

import numpy as np
import torch

from specdec.models.quant_formats import GroupQuantized

QK_K = 256  # values per K-quant super-block

# GGML type name -> (values per block, bytes per block)
BLOCK_SIZES = {
    "Q8_0": (32, 34),
    "Q4_0": (32, 18),
    "Q4_1": (32, 20),
    "Q4_K": (QK_K, 144),
    "Q6_K": (QK_K, 210),
}
GGUF_QUANT_TYPES = tuple(BLOCK_SIZES)


def _f16(raw: np.ndarray) -> np.ndarray:
    """[n, 2] uint8 -> [n, 1] float32 (an fp16 field of each block)."""
    return np.ascontiguousarray(raw).view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray, width: int) -> np.ndarray:
    """[n, c * width] uint8 -> [n, c, 2 * width] uint8: each run of `width` bytes holds `width`
    values in its low nibbles followed by `width` values in its high nibbles."""
    n = qs.shape[0]
    runs = qs.reshape(n, -1, 1, width) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    return (runs & np.uint8(0x0F)).reshape(n, -1, 2 * width)


def _q8_0(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, None]:
    d, qs = blocks[:, :2], blocks[:, 2:]
    return np.ascontiguousarray(qs).view(np.int8).reshape(-1, 1, 32), _f16(d), None


def _q4_0(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, None]:
    d, qs = blocks[:, :2], blocks[:, 2:]
    values = _nibbles(qs, 16).astype(np.int8) - np.int8(8)  # [n, 1, 32] in [-8, 7]
    return values, _f16(d), None


def _q4_1(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    d, m, qs = blocks[:, :2], blocks[:, 2:4], blocks[:, 4:]
    return _nibbles(qs, 16).astype(np.int8), _f16(d), _f16(m)  # values in [0, 15]


def _q4_k_scales(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 12 packed bytes of a Q4_K super-block -> 8 six-bit scales and 8 six-bit mins."""
    n = scales.shape[0]
    scales = scales.reshape(n, 3, 4)
    d, m, m_d = scales[:, 0], scales[:, 1], scales[:, 2]
    sc = np.concatenate([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mins = np.concatenate([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc, mins  # [n, 8] each


def _q4_k(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    d, dmin = _f16(blocks[:, :2]), _f16(blocks[:, 2:4])
    sc, mins = _q4_k_scales(blocks[:, 4:16])
    values = _nibbles(blocks[:, 16:], 32).astype(np.int8)  # [n, 8, 32] in [0, 15]
    scale = d * sc.astype(np.float32)  # [n, 8]
    # gguf computes d * q - dmin * m; q * scale + (-(dmin * m)) rounds identically.
    zero = -(dmin * mins.astype(np.float32))
    return values, scale, zero


def _q6_k(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, None]:
    n = blocks.shape[0]
    ql, qh = blocks[:, : QK_K // 2], blocks[:, QK_K // 2 : QK_K // 2 + QK_K // 4]
    sc = np.ascontiguousarray(blocks[:, QK_K // 2 + QK_K // 4 : -2]).view(np.int8)  # [n, 16]
    d = _f16(blocks[:, -2:])
    low = _nibbles(ql, 64).reshape(n, -1, 32)  # [n, 8, 32]
    shifts = np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
    high = ((qh.reshape(n, -1, 1, 32) >> shifts) & np.uint8(0x03)).reshape(n, -1, 32)
    values = (low | (high << np.uint8(4))).astype(np.int8) - np.int8(32)  # [-32, 31]
    return values.reshape(n, QK_K // 16, 16), d * sc.astype(np.float32), None


_DECODERS = {"Q8_0": _q8_0, "Q4_0": _q4_0, "Q4_1": _q4_1, "Q4_K": _q4_k, "Q6_K": _q6_k}
_GROUP_SIZES = {"Q8_0": 32, "Q4_0": 32, "Q4_1": 32, "Q4_K": 32, "Q6_K": 16}
_VALUE_RANGES = {
    "Q8_0": (-128, 127),
    "Q4_0": (-8, 7),
    "Q4_1": (0, 15),
    "Q4_K": (0, 15),
    "Q6_K": (-32, 31),
}


def decode_blocks(raw: np.ndarray, type_name: str, shape: tuple[int, int]) -> GroupQuantized:
    """The group-quantized integers of one GGUF tensor.

    Args:
        raw: the tensor's bytes as stored, uint8 (any shape; rows of whole blocks).
        type_name: the GGML type ("Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K").
        shape: (rows, columns) in torch order (ggml's reversed); columns are whole blocks.

    Returns:
        GroupQuantized with values [rows, columns] int8, scale [rows, columns / group] float32
        and zero (same shape, or None), so that values * scale + zero equals `gguf`'s
        dequantization exactly.

    Raises:
        ValueError: an unsupported type, or a byte count that does not match the shape.
    """
    if type_name not in _DECODERS:
        raise ValueError(f"no integer decoding for GGUF type {type_name}")
    rows, cols = shape
    block_values, block_bytes = BLOCK_SIZES[type_name]
    if cols % block_values or raw.size != rows * cols // block_values * block_bytes:
        raise ValueError(
            f"{raw.size} bytes of {type_name} cannot hold a [{rows}, {cols}] tensor "
            f"({block_values} values in {block_bytes} bytes per block)"
        )
    blocks = np.asarray(raw, dtype=np.uint8).reshape(-1, block_bytes)
    values, scale, zero = _DECODERS[type_name](blocks)
    group = _GROUP_SIZES[type_name]
    groups = cols // group
    return GroupQuantized(
        values=torch.from_numpy(np.ascontiguousarray(values).reshape(rows, cols)),
        scale=torch.from_numpy(np.ascontiguousarray(scale, dtype=np.float32)).view(rows, groups),
        zero=(
            None
            if zero is None
            else torch.from_numpy(np.ascontiguousarray(zero, dtype=np.float32)).view(rows, groups)
        ),
        group_size=group,
        value_range=_VALUE_RANGES[type_name],
    )
