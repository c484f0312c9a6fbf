"""Frames of a replay for the live view (``kvpool simulate --html``): the block map, the
running requests and the pool's counters at moments of simulated time, spread evenly
over the run (at most ``2 x max_frames`` kept while it runs: past that every other frame
is dropped and the spacing doubles, as ``Series`` does), and the history the page's
charts draw, one point a frame.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass, field
from typing import Any

from kvpool.cache import KVCacheManager
from kvpool.cache.block_map import count_states


@dataclass
class Frames:
    max_frames: int = 200
    every: float = 0.0  # simulated seconds between frames
    next_at: float = 0.0
    frames: list[dict[str, Any]] = field(default_factory=list)
    history: list[dict[str, Any]] = field(default_factory=list)
    _last: tuple[float, int, int, int, int, int] | None = None

    def due(self, t: float) -> bool:
        return t >= self.next_at

    def record(
        self,
        t: float,
        manager: KVCacheManager,
        running: list[dict[str, Any]],
        waiting: int,
        preemptions: int,
        output_tokens: int,
    ) -> None:
        """One frame at simulated time ``t``; ``running``: the running requests, each as
        the live view lists them (``blocks`` filled in here)."""
        stats = manager.stats()
        states = bytes(manager.pool.states)
        for r in running:
            r["blocks"] = manager.block_table(r.pop("seq"))
        totals = (t, stats.prefix_hit_tokens, stats.prefix_query_tokens, stats.evictions,
                  preemptions, output_tokens)  # fmt: skip
        last = self._last or totals
        self._last = totals
        queried = totals[2] - last[2]
        dt = t - last[0]
        self.frames.append({
            "t": t,
            "label": f"t = {t:.2f} s, {len(running)} running, {waiting} waiting",
            "map": base64.b64encode(states).decode(),
            "counts": count_states(states),
            "requests": running,
            "pool": {"prefix_hit_tokens": stats.prefix_hit_tokens,
                     "prefix_query_tokens": stats.prefix_query_tokens,
                     "evictions": stats.evictions, "preemptions": preemptions,
                     "running": len(running), "waiting": waiting, "steps": 0},
        })  # fmt: skip
        self.history.append({
            "t": t, "free": stats.free_blocks, "cached": stats.cached_blocks,
            "used": stats.used_blocks, "shared": stats.shared_blocks,
            "pinned": stats.pinned_blocks, "running": len(running), "waiting": waiting,
            "hit_rate": (totals[1] - last[1]) / queried if queried else None,
            "evictions": (totals[3] - last[3]) / dt if dt > 0 else 0,
            "preemptions": (totals[4] - last[4]) / dt if dt > 0 else 0,
            "tokens_per_s": (totals[5] - last[5]) / dt if dt > 0 else 0.0,
            "ttft_p50": None, "ttft_p99": None, "tier_blocks": None,
        })  # fmt: skip
        if len(self.frames) >= 2 * self.max_frames:
            del self.frames[1::2]
            del self.history[1::2]
            self.every = max(self.every * 2, t / len(self.frames))
        self.next_at = t + self.every
