"""A snapshot of the block manager's state and counters."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class CacheStats:
    """Block counts partition the pool: ``free + cached + used == total``.

    ``shared`` and ``pinned`` are subsets of ``used``. Bytes count each physical block
    once, however many sequences share it (0 when the manager has no geometry).
    ``waste_*`` are allocated token slots that hold no token: ``internal`` in the
    partially filled blocks, ``reserved`` in whole blocks taken ahead of need (only the
    ``static`` policy reserves).
    """

    block_size: int
    total_blocks: int
    free_blocks: int
    cached_blocks: int
    used_blocks: int
    shared_blocks: int
    pinned_blocks: int
    num_sequences: int
    bytes_per_block: int
    total_bytes: int
    used_bytes: int
    cached_bytes: int
    prefix_lookups: int
    prefix_query_tokens: int
    prefix_hit_tokens: int
    evictions: int
    cow_copies: int
    filled_slots: int
    waste_slots_internal: int
    waste_slots_reserved: int

    @property
    def prefix_hit_rate(self) -> float:
        """Share of looked-up prompt tokens that were served from cache."""
        return (
            self.prefix_hit_tokens / self.prefix_query_tokens if self.prefix_query_tokens else 0.0
        )

    @property
    def usage(self) -> float:
        """Share of the pool's blocks in use."""
        return self.used_blocks / self.total_blocks

    @property
    def waste_slots(self) -> int:
        return self.waste_slots_internal + self.waste_slots_reserved

    def as_dict(self) -> dict[str, int | float]:
        out: dict[str, int | float] = asdict(self)
        out["prefix_hit_rate"] = self.prefix_hit_rate
        out["usage"] = self.usage
        out["waste_slots"] = self.waste_slots
        return out
