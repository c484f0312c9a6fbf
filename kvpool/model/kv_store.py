"""The physical KV cache: one tensor per layer, allocated once.

A layer's tensor is ``[2 * num_kv_heads, num_blocks * block_size, row]``, its K heads
then its V heads (``k[i]`` and ``v[i]`` are the two halves): token slot
``block_id * block_size + offset`` holds the token at ``offset`` of block ``block_id``.
A row is ``head_dim`` elements of the store's dtype (float32, bfloat16, float16), or for
int8 ``head_dim`` int8 values then a float16 scale per group of 32 of them (value = q *
scale, scale = max |x| / 127 of the group: ggml's q8_0 grouping, the same bytes): one
tensor still holds everything a block is, so copying, saving and loading a block stay
byte copies of its slots.
Nothing here knows about sequences: the block manager decides which slots a sequence
owns, and the runner turns its block table into slot indices.

On the CPU the tensors lie in one anonymous memory mapping, which the OS fills with zeros
page by page on first touch: the pool is allocated once at its full size, but only the
blocks that have held tokens occupy memory (a server given a large budget and a light
load stays small; its resident KV grows to the budget as blocks are used and cached).
"""

from __future__ import annotations

import math
import mmap
import warnings

import torch

from kvpool.cache.geometry import int8_row_bytes, kv_dtype_bytes
from kvpool.model.config import ModelConfig

# KV dtype names (EngineConfig.kv_cache_dtype, "auto" aside) and their torch dtypes.
KV_TORCH_DTYPES = {
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "int8": torch.int8,
}


def kv_torch_dtype(name: str, compute: torch.dtype) -> torch.dtype:
    """The store dtype a ``kv_cache_dtype`` name means (``auto``: the compute dtype)."""
    return compute if name == "auto" else KV_TORCH_DTYPES[name]


def kv_dtype_name(dtype: torch.dtype) -> str:
    """The ``kv_cache_dtype`` name of a store dtype (``bf16``, ``int8``, ...)."""
    return next(name for name, d in KV_TORCH_DTYPES.items() if d == dtype)


def kv_element_bytes(dtype: torch.dtype, head_dim: int) -> float:
    """Bytes per KV element in a store of ``dtype`` (int8: its scales' share included),
    as the block manager's geometry and the simulator count them."""
    return kv_dtype_bytes("int8", head_dim) if dtype == torch.int8 else float(dtype.itemsize)


class PagedKVStore:
    def __init__(
        self,
        config: ModelConfig,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.dtype = dtype
        self.head_dim = config.head_dim
        # Head-major: gathering a batch's context gives one contiguous [tokens, dim] run
        # per (head, sequence), the operand layout of the decode attention's matmuls.
        # A layer's K heads then its V heads, so one gather reads both.
        nkv = config.num_kv_heads
        row = int8_row_bytes(config.head_dim) if dtype == torch.int8 else config.head_dim
        shape = (2 * nkv, num_blocks * block_size, row)
        per_layer = math.prod(shape)
        storage = _zeros(config.num_layers * per_layer, dtype, device)
        self.layers = [t.view(shape) for t in storage.split(per_layer)]
        self.k = [t[:nkv] for t in self.layers]  # [num_kv_heads, slots, head_dim] views
        self.v = [t[nkv:] for t in self.layers]

    @property
    def quantized(self) -> bool:
        """int8 rows with scales (read only through the native ``paged_attention``)."""
        return self.dtype == torch.int8

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.layers)

    @property
    def block_bytes(self) -> int:
        """Bytes of one block in every layer (what ``read_block`` returns)."""
        return sum(t[:, : self.block_size].numel() * t.element_size() for t in self.layers)

    def read_block(self, block_id: int) -> memoryview:
        """Block ``block_id``'s rows of every layer, copied once into a new buffer: layer
        by layer, ``[K heads + V heads, block_size, row]`` each."""
        out = torch.empty(self.block_bytes, dtype=torch.uint8)
        for view, part in self._block_parts(block_id, out):
            part.copy_(view)
        return memoryview(out.numpy()).cast("B")

    def write_block(self, block_id: int, payload: bytes | memoryview) -> None:
        """Put ``read_block``'s bytes back, into block ``block_id`` (one copy)."""
        if len(payload) != self.block_bytes:
            raise ValueError(f"a block is {self.block_bytes} bytes, got {len(payload)}")
        with warnings.catch_warnings():  # read only: a read-only buffer is fine
            warnings.simplefilter("ignore", UserWarning)
            data = torch.frombuffer(payload, dtype=torch.uint8)
        for view, part in self._block_parts(block_id, data):
            view.copy_(part)

    def _block_parts(self, block_id: int, flat: torch.Tensor):  # type: ignore[no-untyped-def]
        """Each layer's slots of the block, paired with its part of the flat buffer."""
        bs, at = self.block_size, 0
        for t in self.layers:
            view = t[:, block_id * bs : (block_id + 1) * bs]
            n = view.numel() * t.element_size()
            yield view, flat[at : at + n].view(t.dtype).view(view.shape)
            at += n

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy whole blocks ``src -> dst`` in every layer (copy-on-write)."""
        if not copies:
            return
        bs = self.block_size
        device = self.layers[0].device
        src = torch.tensor([s for s, _ in copies], device=device)
        dst = torch.tensor([d for _, d in copies], device=device)
        offsets = torch.arange(bs, device=device)
        src_slots = (src[:, None] * bs + offsets).reshape(-1)
        dst_slots = (dst[:, None] * bs + offsets).reshape(-1)
        for tensor in self.layers:
            tensor.index_copy_(1, dst_slots, tensor.index_select(1, src_slots))


def _zeros(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero-filled 1-D tensor; on the CPU (where the platform has anonymous mappings)
    backed by a private anonymous mapping whose pages are committed when first written,
    not here. Zeros, not garbage, matter: attention reads whole blocks and masks the
    unused slots, and a NaN in a masked slot would still poison its products."""
    if device.type != "cpu" or not hasattr(mmap, "MAP_ANONYMOUS") or numel == 0:
        return torch.zeros(numel, dtype=dtype, device=device)
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
    mapping = mmap.mmap(-1, numel * dtype.itemsize, flags=flags)
    return torch.frombuffer(mapping, dtype=dtype)  # the tensor keeps the mapping alive
