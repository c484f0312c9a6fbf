"""How many bytes one token's KV takes, and how many blocks a memory budget holds."""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvpool.cache.errors import BudgetTooSmall

KV_DTYPE_BYTES: dict[str, float] = {
    "float32": 4.0,
    "fp32": 4.0,
    "float16": 2.0,
    "fp16": 2.0,
    "bfloat16": 2.0,
    "bf16": 2.0,
    "q8_0": 34 / 32,  # ggml q8_0: 32 int8 values + one fp16 scale per 32 elements
}
# kvpool's int8 KV blocks: a row of head_dim int8 values per (token, KV head) and a
# float16 scale per 32 of them (kvpool.model.kv_store): head_dim + 2 ceil(head_dim / 32)
# bytes a row, q8_0's 34 / 32 bytes an element where head_dim is a multiple of 32.
INT8_GROUP = 32


def int8_row_bytes(head_dim: int) -> int:
    """Bytes of one (token, KV head) row of an int8 KV store: values, then scales."""
    return head_dim + 2 * -(-head_dim // INT8_GROUP)


def kv_dtype_bytes(name: str, head_dim: int | None = None) -> float:
    """Bytes per KV element for a dtype name (``fp16``, ``bf16``, ``fp32``, ``q8_0``,
    ``int8``: the runtime's int8 rows, which need ``head_dim`` for their scales' share)."""
    if name.lower() == "int8":
        if head_dim is None or head_dim <= 0:
            raise ValueError("int8 KV bytes per element depend on the head dim; give head_dim")
        return int8_row_bytes(head_dim) / head_dim
    try:
        return KV_DTYPE_BYTES[name.lower()]
    except KeyError:
        known = ", ".join(sorted([*KV_DTYPE_BYTES, "int8"]))
        raise ValueError(f"unknown KV dtype {name!r}; known: {known}") from None


@dataclass(frozen=True)
class ModelGeometry:
    """The dimensions of a model that decide its KV size.

    ``bytes_per_token`` = 2 (K and V) x layers x kv_heads x head_dim x dtype_bytes. Grouped
    query attention shows here: Llama-2-13B (40 layers, 40 KV heads of 128, fp16) takes
    800 KiB per token, Llama-3.1-8B (32 layers, 8 KV heads) only 128 KiB.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype_bytes: float = 2.0

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.dtype_bytes <= 0:
            raise ValueError(f"dtype_bytes must be positive, got {self.dtype_bytes}")

    @property
    def bytes_per_token(self) -> int:
        elements = 2 * self.num_layers * self.num_kv_heads * self.head_dim
        return math.ceil(elements * self.dtype_bytes)

    def bytes_per_block(self, block_size: int) -> int:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        return self.bytes_per_token * block_size

    def blocks_for_budget(self, budget_bytes: int, block_size: int) -> int:
        """How many whole blocks fit in ``budget_bytes``; ``BudgetTooSmall`` if none does."""
        per_block = self.bytes_per_block(block_size)
        blocks = int(budget_bytes // per_block)
        if blocks < 1:
            raise BudgetTooSmall(
                f"a KV budget of {budget_bytes} bytes holds no block: one block of "
                f"{block_size} tokens takes {per_block} bytes "
                f"({self.bytes_per_token} bytes per token)"
            )
        return blocks
