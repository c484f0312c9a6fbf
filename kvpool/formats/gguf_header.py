"""GGUF metadata and tensor directory, read with the standard library only.

Reads the header of a GGUF file (format versions 2 and 3): the key/value metadata and, for
each tensor, its name, shape, ggml type, byte size and offset. Tensor data is not read.
Arrays of strings (the vocabulary) are read in one pass; ``skip_arrays`` skips their
contents for callers that only need the model's geometry.

A damaged or crafted file (a partial download, flipped bytes) raises ``GGUFFormatError``
with the byte it stopped at, never another exception: every length and count is checked
against the bytes left in the file before anything of that size is read or allocated,
and each tensor's data must lie inside the file.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4  # ggml's GGML_MAX_DIMS
# Arrays of arrays are read this deep and no deeper (ggml's own reader refuses them all):
# a crafted file's thousands of levels would exhaust Python's recursion
MAX_NESTING = 8

# ggml tensor types: id -> (name, elements per block, bytes per block)
GGML_TYPES: dict[int, tuple[str, int, int]] = {
    0: ("F32", 1, 4),
    1: ("F16", 1, 2),
    2: ("Q4_0", 32, 18),
    3: ("Q4_1", 32, 20),
    6: ("Q5_0", 32, 22),
    7: ("Q5_1", 32, 24),
    8: ("Q8_0", 32, 34),
    9: ("Q8_1", 32, 40),
    10: ("Q2_K", 256, 84),
    11: ("Q3_K", 256, 110),
    12: ("Q4_K", 256, 144),
    13: ("Q5_K", 256, 176),
    14: ("Q6_K", 256, 210),
    15: ("Q8_K", 256, 292),
    16: ("IQ2_XXS", 256, 66),
    17: ("IQ2_XS", 256, 74),
    18: ("IQ3_XXS", 256, 98),
    19: ("IQ1_S", 256, 50),
    20: ("IQ4_NL", 32, 18),
    21: ("IQ3_S", 256, 110),
    22: ("IQ2_S", 256, 82),
    23: ("IQ4_XS", 256, 136),
    24: ("I8", 1, 1),
    25: ("I16", 1, 2),
    26: ("I32", 1, 4),
    27: ("I64", 1, 8),
    28: ("F64", 1, 8),
    29: ("IQ1_M", 256, 56),
    30: ("BF16", 1, 2),
    34: ("TQ1_0", 256, 54),
    35: ("TQ2_0", 256, 66),
    39: ("MXFP4", 32, 17),
    40: ("NVFP4", 64, 36),
    41: ("Q1_0", 128, 18),
}

# metadata value types: id -> struct format (None: string, array or bool handled apart)
_SCALARS = {
    0: "<B",
    1: "<b",
    2: "<H",
    3: "<h",
    4: "<I",
    5: "<i",
    6: "<f",
    10: "<Q",
    11: "<q",
    12: "<d",
}
_BOOL, _STRING, _ARRAY = 7, 8, 9


class GGUFFormatError(ValueError):
    """The file is not a GGUF file this reader understands."""


@dataclass(frozen=True)
class GGUFTensorInfo:
    name: str
    shape: tuple[int, ...]  # ggml order: shape[0] is the contiguous (fastest) dimension
    ggml_type: int
    offset: int  # from the start of the data section

    @property
    def type_name(self) -> str:
        return GGML_TYPES.get(self.ggml_type, (f"type{self.ggml_type}", 1, 0))[0]

    @property
    def num_elements(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def num_bytes(self) -> int:
        if self.ggml_type not in GGML_TYPES:
            raise GGUFFormatError(f"tensor {self.name}: unknown ggml type {self.ggml_type}")
        _, block, size = GGML_TYPES[self.ggml_type]
        return self.num_elements // block * size


@dataclass(frozen=True)
class GGUFHeader:
    path: Path
    version: int
    metadata: dict[str, Any]
    tensors: list[GGUFTensorInfo]
    data_offset: int  # absolute file offset of the tensor data section

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", ""))

    def arch_value(self, key: str, default: Any = None) -> Any:
        """``metadata[f"{architecture}.{key}"]``."""
        return self.metadata.get(f"{self.architecture}.{key}", default)

    @property
    def num_parameters(self) -> int:
        return sum(t.num_elements for t in self.tensors)

    @property
    def weight_bytes(self) -> int:
        return sum(t.num_bytes for t in self.tensors)


class _Reader:
    def __init__(self, f: BinaryIO, size: int) -> None:
        self.f = f
        self.size = size  # the file's bytes

    def left(self) -> int:
        return self.size - self.f.tell()

    def need(self, n: int, what: str) -> None:
        """Raises unless ``n`` bytes of ``what`` are left in the file."""
        if n > self.left():
            raise GGUFFormatError(
                f"{what} of {n} bytes at byte {self.f.tell()} runs past the end of the file "
                f"({self.size} bytes)"
            )

    def unpack(self, fmt: str) -> Any:
        size = struct.calcsize(fmt)
        data = self.f.read(size)
        if len(data) != size:
            raise GGUFFormatError(
                f"unexpected end of file in the GGUF header (byte {self.f.tell()})"
            )
        return struct.unpack(fmt, data)[0]

    def string(self) -> str:
        n = self.unpack("<Q")
        self.need(n, "a string")
        return self.f.read(n).decode("utf-8", errors="replace")

    def count(self, least_bytes: int, what: str) -> int:
        """A count of items, each at least ``least_bytes`` long in the file."""
        n = self.unpack("<Q")
        self.need(n * least_bytes, f"{n} {what}")
        return n

    def value(self, vtype: int, skip_arrays: bool, depth: int = 0) -> Any:
        if vtype in _SCALARS:
            return self.unpack(_SCALARS[vtype])
        if vtype == _BOOL:
            return bool(self.unpack("<B"))
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            if depth >= MAX_NESTING:
                raise GGUFFormatError(
                    f"arrays nested more than {MAX_NESTING} deep at byte {self.f.tell()}"
                )
            etype = self.unpack("<I")
            least = {_BOOL: 1, _STRING: 8, _ARRAY: 12}.get(etype) or struct.calcsize(
                _SCALARS.get(etype, "<B")
            )
            count = self.count(least, "array items")
            if etype in _SCALARS:
                fmt = _SCALARS[etype]
                size = struct.calcsize(fmt)
                raw = self.f.read(size * count)
                if skip_arrays:
                    return None
                return list(struct.unpack(f"<{count}{fmt[1]}", raw))
            if etype == _BOOL:
                raw = self.f.read(count)
                return None if skip_arrays else [bool(b) for b in raw]
            if etype == _STRING:
                out = []
                read, unpack = self.f.read, struct.unpack
                for _ in range(count):
                    head = read(8)
                    n = unpack("<Q", head)[0] if len(head) == 8 else -1
                    raw = read(n) if 0 <= n <= self.size else b""  # (a bounded read)
                    if len(raw) != n:
                        raise GGUFFormatError(
                            f"a string in an array at byte {self.f.tell()} runs past the "
                            f"end of the file ({self.size} bytes)"
                        )
                    if not skip_arrays:
                        out.append(raw.decode("utf-8", errors="replace"))
                return None if skip_arrays else out
            return [self.value(etype, skip_arrays, depth + 1) for _ in range(count)]
        raise GGUFFormatError(f"unknown GGUF metadata value type {vtype}")


def read_gguf_header(path: str | Path, *, skip_arrays: bool = False) -> GGUFHeader:
    """Parse a GGUF file's metadata and tensor directory (not the tensor data). Raises
    ``GGUFFormatError`` for a file that is not one, or is damaged: a header that runs past
    the end of the file, a tensor of more than 4 dimensions, or one of a known type whose
    rows are not whole blocks or whose data lies (partly) outside the file."""
    path = Path(path)
    with path.open("rb") as f:
        size = os.fstat(f.fileno()).st_size
        r = _Reader(f, size)
        if f.read(4) != GGUF_MAGIC:
            raise GGUFFormatError(f"{path} is not a GGUF file (bad magic)")
        version = r.unpack("<I")
        if version not in (2, 3):
            raise GGUFFormatError(f"{path}: GGUF version {version} is not supported")
        n_tensors = r.count(24, "tensors")  # (a name's length, dimensions, type, offset)
        n_kv = r.count(12, "metadata keys")  # (a key's length, a value's type)
        metadata: dict[str, Any] = {}
        try:
            for _ in range(n_kv):
                key = r.string()
                metadata[key] = r.value(r.unpack("<I"), skip_arrays)
        except (struct.error, OverflowError, MemoryError) as exc:
            raise GGUFFormatError(f"{path}: damaged metadata at byte {f.tell()}: {exc}") from None
        tensors = []
        for _ in range(n_tensors):
            name = r.string()
            n_dims = r.unpack("<I")
            if not 1 <= n_dims <= MAX_DIMS:
                raise GGUFFormatError(f"{path}: tensor {name!r} has {n_dims} dimensions")
            shape = tuple(r.unpack("<Q") for _ in range(n_dims))
            tensors.append(GGUFTensorInfo(name, shape, r.unpack("<I"), r.unpack("<Q")))
        alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
            raise GGUFFormatError(f"{path}: alignment {alignment!r} is not a power of two")
        pos = f.tell()
        data_offset = pos + (-pos % alignment)
    for t in tensors:
        _check_extent(path, t, size - data_offset)
    return GGUFHeader(path, version, metadata, tensors, data_offset)


def _check_extent(path: Path, t: GGUFTensorInfo, data_bytes: int) -> None:
    """A tensor's rows are whole blocks and its data lies inside the file's ``data_bytes``
    of tensor data. A type this reader does not know (a newer ggml's) is left to whoever
    reads that tensor (``num_bytes`` raises): the header's geometry still serves."""
    if t.ggml_type not in GGML_TYPES:
        return
    name, block, _ = GGML_TYPES[t.ggml_type]
    if t.shape[0] % block:
        raise GGUFFormatError(
            f"{path}: tensor {t.name!r}: rows of {t.shape[0]} values are not whole {name} "
            f"blocks of {block}"
        )
    end = t.offset + t.num_bytes
    if end > data_bytes:
        raise GGUFFormatError(
            f"{path}: tensor {t.name!r}: its data ends {end - data_bytes} bytes past the end "
            "of the file (a partial download?)"
        )
