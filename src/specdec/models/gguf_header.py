"""The header of a GGUF file: its metadata key/value pairs and its tensor directory.

A direct reading of the format (version 2 and 3, little-endian): a GGUF file opens with its
metadata and tensor infos, then aligned tensor data. `gguf.GGUFReader` builds a NumPy view for
every element of every array (the tokenizer's vocabulary and merges: a million objects, seconds
and hundreds of MB for a small model); this reads the same values as Python lists in a fraction
of that. Never reads tensor data and never touches torch.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32

# GGUF value types -> (struct format, NumPy dtype) of the scalar types.
_SCALARS = {
    0: ("<B", np.uint8),
    1: ("<b", np.int8),
    2: ("<H", np.uint16),
    3: ("<h", np.int16),
    4: ("<I", np.uint32),
    5: ("<i", np.int32),
    6: ("<f", np.float32),
    7: ("<?", np.bool_),
    10: ("<Q", np.uint64),
    11: ("<q", np.int64),
    12: ("<d", np.float64),
}
_STRING, _ARRAY = 8, 9


class GGUFHeaderError(ValueError):
    """A file whose header is not a readable GGUF header (named where it breaks)."""


@dataclass(frozen=True, slots=True)
class TensorInfo:
    """One entry of the tensor directory.

    Attributes:
        name: llama.cpp's tensor name.
        type_id: the GGML type number (`gguf.GGMLQuantizationType`).
        dims: ggml's dimensions (innermost first: [cols, rows] for a matrix).
        data_offset: absolute byte offset of the tensor's data in the file.
    """

    name: str
    type_id: int
    dims: tuple[int, ...]
    data_offset: int


class _Cursor:
    def __init__(self, data: bytes) -> None:
        self.data, self.pos = data, 0

    def take(self, size: int) -> bytes:
        if self.pos + size > len(self.data):
            raise GGUFHeaderError(f"the header ends early (at byte {len(self.data)})")
        chunk = self.data[self.pos : self.pos + size]
        self.pos += size
        return chunk

    def unpack(self, fmt: str) -> Any:
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        return self.take(self.unpack("<Q")).decode("utf-8", errors="replace")

    def strings(self, count: int) -> list[str]:
        """`count` strings in a row (a vocabulary: the loop that dominates a header)."""
        data, pos, end = self.data, self.pos, len(self.data)
        out = []
        for _ in range(count):
            length = int.from_bytes(data[pos : pos + 8], "little")
            pos += 8
            if pos + length > end:
                raise GGUFHeaderError(f"the header ends early (at byte {end})")
            out.append(data[pos : pos + length].decode("utf-8", errors="replace"))
            pos += length
        self.pos = pos
        return out

    def value(self, type_id: int) -> Any:
        if type_id in _SCALARS:
            return self.unpack(_SCALARS[type_id][0])
        if type_id == _STRING:
            return self.string()
        if type_id == _ARRAY:
            item_type, count = self.unpack("<I"), self.unpack("<Q")
            if item_type in _SCALARS:
                dtype = np.dtype(_SCALARS[item_type][1]).newbyteorder("<")
                raw = self.take(count * dtype.itemsize)
                return np.frombuffer(raw, dtype=dtype).tolist()
            if item_type == _STRING:
                return self.strings(count)
            return [self.value(item_type) for _ in range(count)]
        raise GGUFHeaderError(f"unknown GGUF value type {type_id} at byte {self.pos}")


def read_header(path: str | Path) -> tuple[dict[str, Any], list[TensorInfo]]:
    """(metadata, tensor directory) of a GGUF file.

    Raises:
        GGUFHeaderError: not GGUF, an unsupported version, or a header cut short.
    """
    path = Path(path)
    size = path.stat().st_size
    with path.open("rb") as file:
        head = file.read(24)
        if len(head) < 24 or head[:4] != GGUF_MAGIC:
            raise GGUFHeaderError(f"{path} is not a GGUF file (no GGUF magic)")
        version = struct.unpack("<I", head[4:8])[0]
        if version not in (2, 3):
            raise GGUFHeaderError(
                f"{path}: GGUF version {version} is not supported (2 and 3 are; a big-endian "
                "file reads as a huge version)"
            )
        # The header rarely exceeds a few MB (the vocabulary); read more if it does.
        chunk = 1 << 22
        data = head + file.read(chunk)
        while True:
            try:
                return _parse(data, path)
            except GGUFHeaderError:
                if len(data) >= size:
                    raise
                chunk *= 4
                file.seek(len(data))
                data += file.read(chunk)


def _parse(data: bytes, path: Path) -> tuple[dict[str, Any], list[TensorInfo]]:
    cursor = _Cursor(data)
    cursor.take(8)
    num_tensors, num_kv = cursor.unpack("<Q"), cursor.unpack("<Q")
    # The pseudo-keys `gguf.GGUFReader` reports as well.
    metadata: dict[str, Any] = {
        "GGUF.version": struct.unpack("<I", data[4:8])[0],
        "GGUF.tensor_count": num_tensors,
        "GGUF.kv_count": num_kv,
    }
    for _ in range(num_kv):
        key = cursor.string()
        metadata[key] = cursor.value(cursor.unpack("<I"))
    infos = []
    for _ in range(num_tensors):
        name = cursor.string()
        num_dims = cursor.unpack("<I")
        dims = tuple(cursor.unpack("<Q") for _ in range(num_dims))
        type_id, offset = cursor.unpack("<I"), cursor.unpack("<Q")
        infos.append((name, type_id, dims, offset))
    alignment = int(metadata.get("general.alignment", DEFAULT_ALIGNMENT))
    start = -(-cursor.pos // alignment) * alignment
    return metadata, [TensorInfo(n, t, d, start + o) for n, t, d, o in infos]
