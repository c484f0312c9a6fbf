"""``EngineSnapshot``: the engine's counters at one moment, plain frozen data that any
thread may read (``AsyncLLM`` keeps the latest; the server answers from it)."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvpool.cache import CacheStats, PinInfo
from kvpool.cache.tier import TierStats
from kvpool.engine.pool_view import PoolView


@dataclass(frozen=True)
class TenantSnapshot:
    """One tenant's (cache salt's) part of the engine: what it runs, waits for, was
    served from the cache and holds pinned."""

    running: int = 0
    waiting: int = 0
    admitted: int = 0
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    pinned_blocks: int = 0
    pins: int = 0


@dataclass(frozen=True)
class EngineSnapshot:
    """The engine's counters after a step (or a command between steps)."""

    cache: CacheStats
    running: int
    waiting: int
    preemptions: int
    steps: int
    max_pinned_blocks: int = 0
    expected_output: float = 0.0  # admission's running mean of finished output lengths
    tenants: dict[str | None, TenantSnapshot] = field(default_factory=dict)
    pins: tuple[PinInfo, ...] = ()
    kv_cache_dtype: str = ""  # the blocks' dtype ("bf16", "int8", ...), "auto" resolved
    tier: TierStats | None = None  # the second KV tier, where there is one
    view: PoolView | None = None  # the block map and requests, while someone watches
