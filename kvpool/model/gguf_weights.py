"""Tensors of a GGUF file as the runtime holds them.

The header is parsed once (``kvpool.formats.gguf_header``); tensor data is read from the
file, tensor by tensor. With ``quantized=True`` (the CPU runtime with its native kernels) every
quantized matrix stays in its GGUF blocks (``QuantizedMatrix``: the file's bytes, the
one copy the model keeps, multiplied by ``native.quant_matmul``); otherwise, and for
unquantized and 1-D tensors, tensors are dequantized with the ``gguf`` package's numpy
kernels (F32, F16, BF16 are reinterpreted directly) into the runtime's dtype.
llama.cpp's converter permutes the rows of llama Q and K weights for its interleaved
rotary layout; they are permuted back here (whole rows of blocks, for quantized ones),
so the model uses the usual half-split rotary form.
"""

from __future__ import annotations

import math
import os
import threading
from collections import Counter, deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from kvpool.formats.gguf_header import GGML_TYPES, GGUFHeader, GGUFTensorInfo, read_gguf_header
from kvpool.model.config import ModelConfig, UnsupportedModel

# ggml type ids read without the gguf package
_F32, _F16, _BF16 = 0, 1, 30
_UNQUANTIZED = (_F32, _F16, _BF16)
# The types the native kernels multiply by, as integers or by tiles dequantized per
# thread: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K .. Q6_K, IQ4_NL, IQ4_XS and the grid formats
# (IQ2_XXS 16, IQ2_XS 17, IQ3_XXS 18, IQ1_S 19, IQ3_S 21, IQ2_S 22, IQ1_M 29) and the
# ternary TQ1_0 (34) and TQ2_0 (35); any other quantized type (MXFP4, NVFP4, Q1_0) is
# dequantized at load.
KEPT_QUANTIZED = frozenset(
    {2, 3, 6, 7, 8, 10, 11, 12, 13, 14, 16, 17, 18, 19, 20, 21, 22, 23, 29, 34, 35}
)
_EMBEDDING = "token_embd.weight"
# Threads that dequantize the tensors not kept in their blocks (at most the CPU count)
DEQUANTIZE_THREADS = 8
# The most bytes of a packed matrix read at once before packing (_pack_in_slices)
STAGING_BYTES = 32 << 20
# The tensor data is asked of the OS up to READ_AHEAD_BYTES ahead of the loader's reads
# (_ReadAhead), READ_AHEAD_CHUNK at a time: Linux starts at most its readahead size
# (read_ahead_kb, 128 KiB to 8 MiB) of reads per posix_fadvise WILLNEED.
READ_AHEAD_BYTES = 128 << 20
READ_AHEAD_CHUNK = 4 << 20


PACKED = 0x100  # a type flag for the native ops: the tensor is in the packed layout


@dataclass
class QuantizedMatrix:
    """A matrix ``[rows, cols]`` kept as its GGUF blocks: ``raw`` is uint8
    ``[rows, bytes per row]`` (each row whole blocks of ggml type ``qtype``), or, once
    ``pack``ed, the same bytes in the native kernels' packed layout (groups of 8 rows
    interleaved: ``[rows / 8, 8 * bytes per row]``)."""

    raw: torch.Tensor
    qtype: int
    cols: int
    packed: bool = False

    @property
    def rows(self) -> int:
        return self.raw.shape[0] * (8 if self.packed else 1)

    @property
    def shape(self) -> tuple[int, int]:
        return (self.rows, self.cols)

    @property
    def native_type(self) -> int:
        """The type id the native ops take (with the packed flag)."""
        return self.qtype | (PACKED if self.packed else 0)

    def numel(self) -> int:
        return self.rows * self.cols

    @property
    def nbytes(self) -> int:
        return self.raw.numel()

    def pack(self, variant: str = "") -> bool:
        """Repack in place where ``variant``'s kernels multiply the packed layout faster
        (the same bytes: the file's rows are not kept). True if packed."""
        from kvpool.model.native import native_ops

        ops = native_ops()
        if self.packed:
            return True
        if ops is None or self.rows % 8 or not ops.quant_packs(self.qtype, variant):
            return False
        self.raw = ops.quant_pack(self.raw, self.qtype)
        self.packed = True
        return True

    def split(self, parts: int) -> list[QuantizedMatrix]:
        """The matrix as ``parts`` matrices of equal height, top to bottom (a stack of
        experts, one per expert): views of the same bytes, packed or not."""
        if self.rows % parts or (self.packed and (self.rows // parts) % 8):
            raise ValueError(f"{self.rows} rows do not split into {parts} matrices")
        return [
            QuantizedMatrix(raw, self.qtype, self.cols, self.packed)
            for raw in self.raw.chunk(parts)
        ]

    def dequantize(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """float32 ``[rows, cols]`` (all rows, or the ones ``rows`` selects): natively
        where the ops are built, else with the gguf package's numpy kernels (the same
        values, bit for bit: tests compare them)."""
        from kvpool.model.native import native_ops

        ops = native_ops()
        if ops is not None:
            ids = None if rows is None else rows.cpu()
            return ops.quant_dequantize(self.raw, self.native_type, self.cols, "", ids)
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        raw = self.raw if rows is None else self.raw[rows.cpu()]
        return torch.from_numpy(dequantize(raw.numpy(), GGMLQuantizationType(self.qtype)))


class QuantizedRows:
    """A token embedding ``[vocab, dim]`` kept as its GGUF blocks, rows dequantized when
    looked up: the few rows a step reads instead of a dequantized copy of all of them
    (SmolLM2's Q8_0 embedding: 30 MB instead of 57 MB in bf16; a Llama 3 8B's Q4_K one:
    0.3 instead of 1 GB). Rows are bit-identical to those of the whole matrix
    dequantized. A tied output head multiplies by the same blocks."""

    def __init__(self, matrix: QuantizedMatrix, dtype: torch.dtype) -> None:
        self.matrix = matrix
        self.shape = matrix.shape
        self.dtype = dtype

    def __getitem__(self, ids: torch.Tensor) -> torch.Tensor:
        return self.matrix.dequantize(ids).to(self.dtype)

    def numel(self) -> int:
        return self.matrix.numel()


def _dequantize(raw: np.ndarray, info: GGUFTensorInfo) -> np.ndarray:
    """float32 array in torch order (the reverse of ggml's shape)."""
    shape = tuple(reversed(info.shape))
    if info.ggml_type == _F32:
        return raw.view(np.float32).reshape(shape)
    if info.ggml_type == _F16:
        return raw.view(np.float16).astype(np.float32).reshape(shape)
    if info.ggml_type == _BF16:
        return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32).reshape(shape)
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    try:
        qtype = GGMLQuantizationType(info.ggml_type)
    except ValueError:
        raise UnsupportedModel(f"tensor {info.name}: unknown ggml type {info.ggml_type}") from None
    rows = raw.reshape(-1, raw.size // max(1, int(np.prod(shape[:-1]))))
    return dequantize(rows, qtype).reshape(shape)


def _unpermute_rotary(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's per-head row permutation of Q/K (interleaved -> half-split)."""
    return w[_rotary_row_order(w.shape[0], n_heads).to(w.device)]


def _rotary_row_order(rows: int, n_heads: int) -> torch.Tensor:
    """Row ``i`` of the un-permuted matrix is row ``order[i]`` of the GGUF one."""
    half = rows // n_heads // 2
    return torch.arange(rows).reshape(n_heads, half, 2).transpose(1, 2).reshape(-1)


def load_gguf_weights(
    path: str | Path,
    dtype: torch.dtype = torch.float32,
    *,
    header: GGUFHeader | None = None,
    on_tensor: Callable[[int, int], None] | None = None,
    quantized: bool = False,
    pack_variant: str | None = None,
    device: torch.device | None = None,
    kept_types: frozenset[int] = KEPT_QUANTIZED,
) -> tuple[ModelConfig, dict[str, torch.Tensor | QuantizedMatrix]]:
    """Config and every tensor of the file, by GGUF name: dequantized to ``dtype``, or,
    with ``quantized``, each matrix of ``kept_types`` (the native kernels' by default;
    the 4-bit ones for torch's int4 kernels) as a ``QuantizedMatrix`` of its blocks,
    packed already where ``pack_variant``'s kernels multiply the packed layout. Kept
    blocks live in one anonymous mapping backed by huge pages where the OS gives them:
    a decode step streams every weight, and 2 MiB pages take 512x fewer TLB entries and
    page faults than 4 KiB ones.

    Dequantized tensors are made on ``device`` (None: the CPU), each moved there as
    soon as it is made: a GPU's model never has a whole copy in host memory (an 8B
    model's would be 16 GB in bf16). The gguf package's numpy kernels dequantize on up
    to ``DEQUANTIZE_THREADS`` threads (they release the GIL), at most one tensor a
    thread ahead of the reading; torch converts and moves each on this thread (torch
    ops on other threads would start an OpenMP pool in each)."""
    header = header or read_gguf_header(path)
    config = ModelConfig.from_gguf(header)
    config.check_tensors(header)  # (a damaged file is refused before its data is read)
    weights: dict[str, torch.Tensor | QuantizedMatrix] = {}
    plan = _plan(header, config, pack_variant, kept_types) if quantized else {}
    arena = _HugeArena(sum(size for size, _ in plan.values()))
    staging = torch.empty(0, dtype=torch.uint8)
    workers = max(1, min(DEQUANTIZE_THREADS, os.cpu_count() or 1))
    pool = ThreadPoolExecutor(workers, thread_name_prefix="kvpool-dequantize")
    pending: deque[tuple[str, int, Future[np.ndarray]]] = deque()

    def finish(limit: int) -> None:
        """Take the oldest dequantized arrays until at most ``limit`` are pending."""
        while len(pending) > limit:
            name, heads, future = pending.popleft()
            tensor = torch.from_numpy(future.result()).to(device=device, dtype=dtype)
            weights[name] = _unpermute_rotary(tensor, heads) if heads else tensor

    def dense(raw: np.ndarray, info: GGUFTensorInfo) -> np.ndarray:
        return np.ascontiguousarray(_dequantize(raw, info), dtype=np.float32)

    # Read, not mapped: a mapped file's pages count in the process's resident memory as
    # they are touched, which put the peak at twice the file while the blocks are copied.
    with (
        pool,
        open(header.path, "rb", buffering=0) as raw_file,
        _ReadAhead(raw_file, header.data_offset) as file,
    ):
        for i, info in enumerate(header.tensors):
            heads = _rotary_heads(config, info.name)
            file.seek(header.data_offset + info.offset)
            if info.name in plan:
                size, packs = plan[info.name]
                target = arena.take(size)
                n = _matrix_rows(info)
                if packs and not heads:  # packed slice by slice through the staging buffer
                    staging = _pack_in_slices(file, info, n, staging, target)
                    target = target.view(n // 8, -1)
                elif packs or heads:  # staged whole, then reordered (and packed) into the arena
                    if staging.numel() < info.num_bytes:
                        staging = torch.empty(info.num_bytes, dtype=torch.uint8)
                    rows = _read_into(file, staging[: info.num_bytes], info).view(n, -1)
                    if heads:
                        rows = rows[_rotary_row_order(n, heads)]
                    if packs:
                        _native().quant_pack(rows.contiguous(), info.ggml_type, target)
                        target = target.view(n // 8, -1)
                    else:
                        target.view(n, -1).copy_(rows)
                        target = target.view(n, -1)
                else:
                    target = _read_into(file, target, info).view(n, -1)
                weights[info.name] = QuantizedMatrix(target, info.ggml_type, info.shape[0], packs)
            else:
                raw = np.empty(info.num_bytes, dtype=np.uint8)
                _read_into(file, torch.from_numpy(raw), info)
                pending.append((info.name, heads, pool.submit(dense, raw, info)))
                finish(workers)
            if on_tensor:
                on_tensor(i + 1, len(header.tensors))
        finish(0)
    # in the file's order (the dense ones were finished out of it)
    return config, {info.name: weights[info.name] for info in header.tensors}


def dequantized_types(header: GGUFHeader, kept: frozenset[int]) -> dict[str, int]:
    """The file's matrices of quantized types outside ``kept`` (each dequantized at load
    to the compute dtype), counted by type name."""
    own = kept | set(_UNQUANTIZED)  # kept, or in their own precision
    names = (
        GGML_TYPES.get(info.ggml_type, (f"type {info.ggml_type}",))[0]
        for info in header.tensors
        if len(info.shape) >= 2 and info.ggml_type not in own
    )
    return dict(Counter(names))


def _matrix_rows(info: GGUFTensorInfo) -> int:
    """Rows of a matrix, or of a stack of experts' matrices (ggml ``[cols, rows, experts]``)
    held as one: expert ``e``'s rows are ``e * rows .. (e + 1) * rows - 1``."""
    return math.prod(int(n) for n in info.shape[1:])


def _pack_in_slices(
    file, info: GGUFTensorInfo, rows: int, staging: torch.Tensor, target: torch.Tensor
) -> torch.Tensor:
    """Reads a matrix's ``rows`` from ``file`` (at its data) and packs them into ``target``
    a slice of 8-row groups at a time (each group packs alone), so that the staging buffer
    holds at most ``STAGING_BYTES`` (or one group) instead of the whole matrix: the
    largest, an embedding and head, is a few hundred MiB that the load's peak would hold
    beside the arena. Returns the staging buffer, grown if it had to be."""
    row_bytes = info.num_bytes // rows
    step = max(8, STAGING_BYTES // row_bytes // 8 * 8)
    group_bytes = target.numel() // (rows // 8)
    if staging.numel() < min(rows, step) * row_bytes:
        staging = torch.empty(min(rows, step) * row_bytes, dtype=torch.uint8)
    for first in range(0, rows, step):
        count = min(step, rows - first)
        part = _read_into(file, staging[: count * row_bytes], info)
        into = target[first // 8 * group_bytes : (first + count) // 8 * group_bytes]
        _native().quant_pack(part.view(count, row_bytes), info.ggml_type, into)
    return staging


def _read_into(file, buffer: torch.Tensor, info: GGUFTensorInfo) -> torch.Tensor:
    """Fills ``buffer`` (all of ``info``'s data, or a slice of its rows) from ``file``."""
    if file.readinto(memoryview(buffer.numpy())) != buffer.numel():
        raise UnsupportedModel(f"tensor {info.name}: the file ends inside its data")
    return buffer


class _ReadAhead:
    """The file, read as it is (seek, tell, readinto), while a thread asks the OS for what
    comes after each read (posix_fadvise WILLNEED, ``READ_AHEAD_CHUNK`` a call, at most
    ``READ_AHEAD_BYTES`` ahead of the reads): a file not yet in the page cache comes from
    the disk while the loader packs what it has read, instead of after. The loader reads
    in the file's order from ``start``; the advice never goes back behind the reads.
    Advice only: where the OS has no such call (macOS) or refuses it, the thread ends and
    the reads are the same. Invariant: the thread has ended when the ``with`` block has."""

    def __init__(self, file, start: int) -> None:
        self._file = file
        self._fd = file.fileno()
        self._end = os.fstat(self._fd).st_size
        self._reading = start  # where the loader reads now (first: the data's start)
        self._next = self._reading  # where the advice goes on from
        self._stopped = False
        self._changed = threading.Condition()
        self._thread = threading.Thread(target=self._advise, name="kvpool-read-ahead", daemon=True)

    def __enter__(self) -> _ReadAhead:
        if hasattr(os, "posix_fadvise"):
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        with self._changed:
            self._stopped = True
            self._changed.notify()
        if self._thread.is_alive():
            self._thread.join()

    def seek(self, offset: int) -> int:
        return self._file.seek(offset)

    def tell(self) -> int:
        return self._file.tell()

    def readinto(self, buffer) -> int:
        with self._changed:
            self._reading = self._file.tell()
            self._changed.notify()
        return self._file.readinto(buffer)

    def _advise(self) -> None:
        while True:
            with self._changed:  # the next chunk starts at the reads or after them
                while not self._stopped and max(self._next, self._reading) >= min(
                    self._end, self._reading + READ_AHEAD_BYTES
                ):
                    self._changed.wait()
                if self._stopped:
                    return
                start = max(self._next, self._reading)
                size = min(READ_AHEAD_CHUNK, self._end - start)
                self._next = start + size
            try:  # (the call starts the reads and returns; the GIL is let go meanwhile)
                os.posix_fadvise(self._fd, start, size, os.POSIX_FADV_WILLNEED)
            except OSError:  # (a file system that does not take the advice)
                return


def _native():
    from kvpool.model.native import native_ops

    return native_ops()


def _plan(
    header: GGUFHeader, config: ModelConfig, pack_variant: str | None, kept: frozenset[int]
) -> dict[str, tuple[int, bool]]:
    """For each matrix kept in its blocks: its bytes in memory and whether it is packed."""
    ops = _native() if pack_variant is not None else None
    plan = {}
    for info in header.tensors:
        if info.ggml_type not in kept or len(info.shape) not in (2, 3):
            continue
        cols, rows = info.shape[0], _matrix_rows(info)
        # a stack of experts packs as one matrix whose 8-row groups never straddle two
        packs = ops is not None and info.shape[1] % 8 == 0
        packs = packs and ops.quant_packs(info.ggml_type, pack_variant)
        size = ops.quant_packed_bytes(info.ggml_type, rows, cols) if packs else info.num_bytes
        plan[info.name] = (size, packs)
    return plan


class _HugeArena:
    """One anonymous mapping handed out in 64-byte aligned pieces (torch views of it, which
    keep it alive), advised to the OS as huge-page memory; plain memory where the OS has
    no such mappings."""

    def __init__(self, size: int) -> None:
        import mmap

        self._used = 0
        self._tensor = torch.empty(0, dtype=torch.uint8)
        if size == 0:
            return
        size += 64 * 1024  # room for the alignment of every piece
        if hasattr(mmap, "MAP_ANONYMOUS"):
            mapping = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            if hasattr(mapping, "madvise") and hasattr(mmap, "MADV_HUGEPAGE"):
                mapping.madvise(mmap.MADV_HUGEPAGE)
            self._tensor = torch.frombuffer(mapping, dtype=torch.uint8)
        else:
            self._tensor = torch.empty(size, dtype=torch.uint8)

    def take(self, size: int) -> torch.Tensor:
        start = -(-self._used // 64) * 64
        self._used = start + size
        return self._tensor[start : start + size]


def _rotary_heads(config: ModelConfig, name: str) -> int:
    """Heads of a llama Q/K tensor whose rows llama.cpp permuted (0 for any other)."""
    if config.architecture != "llama":
        return 0
    if name.endswith(("attn_q.weight", "attn_q.bias")):
        return config.num_heads
    if name.endswith(("attn_k.weight", "attn_k.bias")):
        return config.num_kv_heads
    return 0
