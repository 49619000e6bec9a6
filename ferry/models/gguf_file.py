"""A GGUF file's header read in one pass: its metadata, its tensors' names, types, shapes and
memory-mapped data (the format: llama.cpp's docs/gguf.md).

gguf's own GGUFReader builds a numpy view for every metadata value, and a tokenizer's vocabulary and
merges are ~100k strings: opening the bundled SmolLM2 took ~2 s of every start. Here scalars are
unpacked with `struct`, numeric arrays become one numpy array each, and string arrays are only walked
(their offsets kept) until someone asks for their contents. The tensors are what GGUFReader gives
(the same `data` views of the file's memory map, the same shapes), so the loader reads either.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import quant_shape_to_byte_shape

_MAGIC = 0x46554747  # "GGUF", little-endian
_STRING, _ARRAY = 8, 9
# value type -> (struct format, numpy dtype)
_SCALARS = {
    0: ("<B", np.uint8), 1: ("<b", np.int8), 2: ("<H", np.uint16), 3: ("<h", np.int16), 4: ("<I", np.uint32),
    5: ("<i", np.int32), 6: ("<f", np.float32), 7: ("<?", np.bool_), 10: ("<Q", np.uint64), 11: ("<q", np.int64),
    12: ("<d", np.float64),
}  # fmt: skip
# tensor types stored as plain numbers (the rest as bytes of blocks)
_PLAIN = {
    GGMLQuantizationType.F16: np.float16, GGMLQuantizationType.F32: np.float32,
    GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8, GGMLQuantizationType.I16: np.int16,
    GGMLQuantizationType.I32: np.int32, GGMLQuantizationType.I64: np.int64,
}  # fmt: skip


class GGUFField:
    """One metadata value: `contents()` as Python (a list for arrays); `data` as long as the array
    (one element for a scalar), as GGUFReader's fields are sized."""

    def __init__(self, value: Any = None, strings: tuple[memoryview, list[int]] | None = None) -> None:
        self._value, self._strings = value, strings

    @property
    def data(self) -> Any:
        if self._strings is not None:
            return range(len(self._strings[1]))
        return self._value if isinstance(self._value, np.ndarray) else [0]

    def contents(self) -> Any:
        if self._strings is not None:
            buf, offsets = self._strings
            return [_read_string(buf, o)[0] for o in offsets]
        return self._value.tolist() if isinstance(self._value, np.ndarray) else self._value


@dataclass
class GGUFTensor:
    name: str
    tensor_type: GGMLQuantizationType
    shape: np.ndarray  # GGUF's order: the fastest-varying dimension first
    n_elements: int
    n_bytes: int
    data_offset: int
    data: np.ndarray  # a view of the memory map: numbers in numpy's (reversed) shape, or rows of block bytes


def _read_string(buf: memoryview, offset: int) -> tuple[str, int]:
    (n,) = struct.unpack_from("<Q", buf, offset)
    end = offset + 8 + n
    if end > len(buf):
        raise ValueError("a string runs past the end of the file")
    return bytes(buf[offset + 8 : end]).decode("utf-8", errors="replace"), end


class GGUFFile:
    """`fields` (metadata key -> GGUFField) and `tensors` (in file order) of a GGUF file, version 2 or 3,
    little-endian."""

    def __init__(self, path: str) -> None:
        self.data = np.memmap(path, mode="r")
        buf = memoryview(self.data)
        if len(buf) < 24:
            raise ValueError("too short for a GGUF header")
        magic, version, tensor_count, kv_count = struct.unpack_from("<IIQQ", buf, 0)
        if magic != _MAGIC:
            raise ValueError("GGUF magic invalid")
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} (big-endian, or unknown) is not read; versions 2 and 3 are")
        offset = 24
        self.fields: dict[str, GGUFField] = {}
        for _ in range(kv_count):
            key, offset = _read_string(buf, offset)
            (kind,) = struct.unpack_from("<I", buf, offset)
            self.fields[key], offset = self._value(buf, offset + 4, kind)
        infos = []
        for _ in range(tensor_count):
            name, offset = _read_string(buf, offset)
            (n_dims,) = struct.unpack_from("<I", buf, offset)
            dims = np.frombuffer(buf, dtype="<u8", count=n_dims, offset=offset + 4).copy()
            offset += 4 + 8 * n_dims
            kind, data_offset = struct.unpack_from("<IQ", buf, offset)
            offset += 12
            infos.append((name, dims, GGMLQuantizationType(kind), data_offset))
        alignment = self.fields.get("general.alignment")
        align = int(alignment.contents()) if alignment is not None else 32
        if align <= 0 or align & (align - 1):
            raise ValueError(f"GGUF alignment {align} is not a power of two")
        self.data_offset = -(-offset // align) * align
        self.tensors: list[GGUFTensor] = []
        seen: set[str] = set()
        for name, dims, ggml_type, rel in infos:
            if name in seen:
                raise ValueError(f"GGUF tensor {name!r} appears twice")
            seen.add(name)
            n_elems = int(np.prod(dims))
            block, type_size = GGML_QUANT_SIZES[ggml_type]
            n_bytes = n_elems * type_size // block
            start = self.data_offset + int(rel)
            if start + n_bytes > len(self.data):
                raise ValueError(f"GGUF tensor {name!r} runs past the end of the file")
            np_dims = tuple(reversed(dims.tolist()))
            plain = _PLAIN.get(ggml_type)
            if plain is not None:
                view = self.data[start : start + n_bytes].view(plain).reshape(np_dims)
            else:
                view = self.data[start : start + n_bytes].reshape(quant_shape_to_byte_shape(np_dims, ggml_type))
            self.tensors.append(GGUFTensor(name, ggml_type, dims, n_elems, n_bytes, start, view))

    @staticmethod
    def _value(buf: memoryview, offset: int, kind: int) -> tuple[GGUFField, int]:
        if kind == _STRING:
            text, offset = _read_string(buf, offset)
            return GGUFField(text), offset
        if kind in _SCALARS:
            fmt, _ = _SCALARS[kind]
            (value,) = struct.unpack_from(fmt, buf, offset)
            return GGUFField(value), offset + struct.calcsize(fmt)
        if kind != _ARRAY:
            raise ValueError(f"unknown GGUF value type {kind}")
        sub, count = struct.unpack_from("<IQ", buf, offset)
        offset += 12
        if sub == _STRING:  # walked, not decoded: a vocabulary is ~50k strings
            offsets = []
            unpack = struct.Struct("<Q").unpack_from
            for _ in range(count):
                offsets.append(offset)
                offset += 8 + unpack(buf, offset)[0]
            if offset > len(buf):
                raise ValueError("a string array runs past the end of the file")
            return GGUFField(strings=(buf, offsets)), offset
        if sub not in _SCALARS:
            raise ValueError(f"GGUF arrays of type {sub} are not read")
        dtype = np.dtype(_SCALARS[sub][1]).newbyteorder("<")
        values = np.frombuffer(buf, dtype=dtype, count=count, offset=offset).copy()
        return GGUFField(values), offset + values.nbytes
