"""The physical KV cache: one K and one V tensor per layer, allocated once.

Each tensor is ``[num_kv_heads, num_blocks * block_size, head_dim]``: token slot
``block_id * block_size + offset`` holds the token at ``offset`` of block ``block_id``.
Nothing here knows about sequences: the block manager decides which slots a sequence
owns, and the runner turns its block table into slot indices.
"""

from __future__ import annotations

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
        shape = (config.num_kv_heads, num_blocks * block_size, config.head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_layers)]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy whole blocks ``src -> dst`` in every layer (copy-on-write)."""
        if not copies:
            return
        bs = self.block_size
        device = self.k[0].device
        src = torch.tensor([s for s, _ in copies], device=device)
        dst = torch.tensor([d for _, d in copies], device=device)
        offsets = torch.arange(bs, device=device)
        src_slots = (src[:, None] * bs + offsets).reshape(-1)
        dst_slots = (dst[:, None] * bs + offsets).reshape(-1)
        for tensor in self.k + self.v:
            tensor.index_copy_(1, dst_slots, tensor.index_select(1, src_slots))
