"""The last minutes of the pool, one point a second, for the live view (``/dashboard``).

``Activity`` counts what the engine's snapshot does not: tokens as they stream and each
request's time to first token (the generation path feeds it). ``PoolHistory`` samples the
engine's latest snapshot and the activity once a second into a ring of ``keep`` points:
reading a snapshot never waits for a step, so a history nobody reads costs a dict a
second.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from kvpool.engine.snapshot import EngineSnapshot

log = logging.getLogger("kvpool.server")

TTFT_WINDOW_S = 30.0  # TTFT quantiles over first tokens of the last this many seconds


class Activity:
    """Tokens streamed so far and recent times to first token."""

    def __init__(self) -> None:
        self.tokens = 0
        self.ttfts: deque[tuple[float, float]] = deque(maxlen=8192)  # (monotonic, seconds)

    def streamed(self, n: int) -> None:
        self.tokens += n

    def first_token(self, seconds: float) -> None:
        self.ttfts.append((time.monotonic(), seconds))

    def ttft_quantiles(self, window: float = TTFT_WINDOW_S) -> tuple[float | None, float | None]:
        """p50 and p99 of the first tokens of the last ``window`` seconds (None: none)."""
        since = time.monotonic() - window
        values = sorted(s for t, s in list(self.ttfts) if t >= since)
        if not values:
            return None, None
        return _quantile(values, 0.5), _quantile(values, 0.99)


def _quantile(ordered: list[float], q: float) -> float:
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


@dataclass(frozen=True)
class Point:
    """One second of the pool: block counts at the sample, rates over the second before."""

    t: float  # time.time()
    free: int
    cached: int
    used: int
    shared: int
    pinned: int
    running: int
    waiting: int
    hit_rate: float | None  # prompt tokens found cached / looked up, over the interval
    evictions: int  # over the interval
    preemptions: int  # over the interval
    tokens_per_s: float
    ttft_p50: float | None  # over the last TTFT_WINDOW_S
    ttft_p99: float | None
    tier_blocks: int | None  # the second tier's stored blocks, where there is one


class PoolHistory:
    def __init__(
        self,
        snapshot: Callable[[], EngineSnapshot],
        activity: Activity,
        *,
        period: float = 1.0,
        keep: int = 600,
    ) -> None:
        self._snapshot = snapshot
        self.activity = activity
        self.period = period
        self.points: deque[Point] = deque(maxlen=keep)
        self._last: tuple[float, int, int, int, int, int] | None = None

    def sample(self) -> Point:
        """Add the point for now and return it."""
        snap = self._snapshot()
        c = snap.cache
        now = time.monotonic()
        totals = (now, c.prefix_hit_tokens, c.prefix_query_tokens, c.evictions,
                  snap.preemptions, self.activity.tokens)  # fmt: skip
        last = self._last or totals
        self._last = totals
        dt = max(now - last[0], 1e-9)
        queried = totals[2] - last[2]
        p50, p99 = self.activity.ttft_quantiles()
        point = Point(
            t=time.time(),
            free=c.free_blocks,
            cached=c.cached_blocks,
            used=c.used_blocks,
            shared=c.shared_blocks,
            pinned=c.pinned_blocks,
            running=snap.running,
            waiting=snap.waiting,
            hit_rate=(totals[1] - last[1]) / queried if queried else None,
            evictions=totals[3] - last[3],
            preemptions=totals[4] - last[4],
            tokens_per_s=(totals[5] - last[5]) / dt if last is not totals else 0.0,
            ttft_p50=p50,
            ttft_p99=p99,
            tier_blocks=snap.tier.blocks if snap.tier is not None else None,
        )
        self.points.append(point)
        return point

    def since(self, t: float = 0.0) -> list[dict[str, Any]]:
        """The points after ``t`` (time.time()), oldest first."""
        return [asdict(p) for p in list(self.points) if p.t > t]

    async def run_forever(self) -> None:
        """Sample every ``period`` seconds until cancelled (a server lifespan task)."""
        while True:
            try:
                self.sample()
            except Exception:  # never let the sampler die
                log.exception("sampling the pool's history failed")
            await asyncio.sleep(self.period)
