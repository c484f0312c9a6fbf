"""The physical KV cache: one tensor per layer, allocated once.

A layer's tensor is ``[2 * num_kv_heads, num_blocks * block_size, head_dim]``, its K heads
then its V heads (``k[i]`` and ``v[i]`` are the two halves): token slot
``block_id * block_size + offset`` holds the token at ``offset`` of block ``block_id``.
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

import torch

from kvpool.model.config import ModelConfig


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
        # Head-major: gathering a batch's context gives one contiguous [tokens, dim] run
        # per (head, sequence), the operand layout of the decode attention's matmuls.
        # A layer's K heads then its V heads, so one gather reads both.
        nkv = config.num_kv_heads
        shape = (2 * nkv, num_blocks * block_size, config.head_dim)
        per_layer = math.prod(shape)
        storage = _zeros(config.num_layers * per_layer, dtype, device)
        self.layers = [t.view(shape) for t in storage.split(per_layer)]
        self.k = [t[:nkv] for t in self.layers]  # [num_kv_heads, slots, head_dim] views
        self.v = [t[nkv:] for t in self.layers]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.layers)

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
