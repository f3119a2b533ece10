"""A GGUF file's header read in one pass: metadata as Python values, tensors as views of the
memory-mapped file.

The `gguf` package's `GGUFReader` builds a numpy view for every part of every metadata value; a
tokenizer's 49k-string vocabulary and merges make that about 10 s per load on a 2-core machine,
paid by every server start. This reader parses the same header with `struct` (strings) and
`np.frombuffer` (numeric arrays) and keeps `GGUFReader`'s interface where the engine uses it:
`fields[key].contents()` and `tensors` (`name`, `tensor_type`, `shape` fastest-first, `data`
typed as `GGUFReader` types it, so `gguf.quants.dequantize(t.data, t.tensor_type)` applies).

Format (little-endian, versions 2 and 3): magic "GGUF", version u32, tensor count u64, metadata
count u64; metadata key/value pairs (key: u64 length + UTF-8, value type u32, value); tensor
infos (name, n_dims u32, dims u64 fastest-first, type u32, offset u64 from the data start); the
data start is the end of the infos rounded up to `general.alignment` (default 32).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

__all__ = ["GGUFFile", "MetadataField", "TensorInfo"]

_MAGIC = b"GGUF"
_VERSIONS = (2, 3)
_STRING, _ARRAY = 8, 9
#: Scalar metadata types -> numpy dtype (little-endian); 7 is bool.
_SCALARS = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?",
            10: "<u8", 11: "<i8", 12: "<f8"}
#: Unquantised tensor types GGUFReader gives a typed view of (the others: bytes per row).
_TYPED = {"F16": np.float16, "F32": np.float32, "F64": np.float64, "I8": np.int8,
          "I16": np.int16, "I32": np.int32, "I64": np.int64}


@dataclass(frozen=True)
class MetadataField:
    """One metadata value; `contents()` as GGUFReader's: str, number, bool or a list of them."""

    name: str
    value: Any

    def contents(self) -> Any:
        return self.value


class TensorInfo(NamedTuple):
    """A tensor of the file: `shape` fastest-first (as stored), `data` a view of its bytes."""

    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: np.ndarray
    n_elements: int
    n_bytes: int
    data_offset: int
    data: np.ndarray


class _Cursor:
    """Reads little-endian values from `buf` at a moving offset."""

    def __init__(self, buf: memoryview) -> None:
        self.buf, self.pos = buf, 0

    def unpack(self, fmt: str) -> tuple:
        values = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return values

    def string(self) -> str:
        (n,) = self.unpack("<Q")
        if self.pos + n > len(self.buf):
            raise ValueError(f"a string of {n} bytes at byte {self.pos} ends past the end of "
                             f"the file")
        text = bytes(self.buf[self.pos:self.pos + n]).decode("utf-8")
        self.pos += n
        return text

    def value(self, kind: int) -> Any:
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            item_kind, count = self.unpack("<IQ")
            if item_kind in _SCALARS:
                dtype = np.dtype(_SCALARS[item_kind])
                items = np.frombuffer(self.buf, dtype, count, self.pos)
                self.pos += dtype.itemsize * count
                return items.tolist()
            return [self.value(item_kind) for _ in range(count)]
        if kind in _SCALARS:
            dtype = np.dtype(_SCALARS[kind])
            item = np.frombuffer(self.buf, dtype, 1, self.pos)[0].item()
            self.pos += dtype.itemsize
            return item
        raise ValueError(f"unknown GGUF metadata type {kind} at byte {self.pos - 4}")


class GGUFFile:
    """The header of the GGUF file at `path` (ValueError when it is not one this reads)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._map = np.memmap(path, dtype=np.uint8, mode="r")
        cur = _Cursor(memoryview(self._map))
        if bytes(self._map[:4]) != _MAGIC:
            raise ValueError(f"not a GGUF file (magic {bytes(self._map[:4])!r})")
        cur.pos = 4
        version, n_tensors, n_kv = cur.unpack("<IQQ")
        if version not in _VERSIONS:
            raise ValueError(f"GGUF version {version} (big-endian or unknown); this reads "
                             f"little-endian versions {_VERSIONS}")
        self.fields: dict[str, MetadataField] = {}
        for _ in range(n_kv):
            key = cur.string()
            (kind,) = cur.unpack("<I")
            self.fields[key] = MetadataField(key, cur.value(kind))
        infos = [self._tensor_info(cur) for _ in range(n_tensors)]
        alignment = int(self.fields["general.alignment"].value) \
            if "general.alignment" in self.fields else 32
        start = -(-cur.pos // alignment) * alignment
        self.tensors = [self._tensor(start, *info) for info in infos]

    @staticmethod
    def _tensor_info(cur: _Cursor) -> tuple[str, list[int], int, int]:
        name = cur.string()
        (n_dims,) = cur.unpack("<I")
        dims = list(cur.unpack(f"<{n_dims}Q"))
        kind, offset = cur.unpack("<IQ")
        return name, dims, kind, offset

    def _tensor(self, start: int, name: str, dims: list[int], kind: int,
                offset: int) -> TensorInfo:
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        ggml_type = GGMLQuantizationType(kind)
        block, type_size = GGML_QUANT_SIZES[ggml_type]
        n_elements = int(np.prod(dims, dtype=np.int64))
        n_bytes = n_elements * type_size // block
        rows_first = tuple(reversed(dims))
        begin = start + offset
        raw = self._map[begin:begin + n_bytes]
        if len(raw) != n_bytes:
            raise ValueError(f"tensor {name!r} ends past the end of the file")
        if ggml_type.name in _TYPED:
            data = raw.view(_TYPED[ggml_type.name]).reshape(rows_first)
        else:  # bytes, the fastest dimension in blocks: GGUFReader's quant_shape_to_byte_shape
            data = raw.reshape(*rows_first[:-1], rows_first[-1] // block * type_size)
        return TensorInfo(name, ggml_type, np.array(dims, dtype=np.uint64), n_elements,
                          n_bytes, begin, data)
