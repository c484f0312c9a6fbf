"""``KVEventLog``: the cluster's one ordered record of its replicas' KV events.

Each replica publishes its block manager's events (``kvpool.cache.events``) in batches,
one call at a time and in order, with its load at that moment; the log applies them to
its own ``ClusterIndex`` and keeps the recent batches numbered by a cursor. A router
pulls what follows its cursor (waiting up to a bound for something new: a long poll, no
spinning) and replays it into its local copy; a router that fell behind the kept batches
(or just started) gets the whole index instead. In the cluster it runs as one named Ray
actor (``kvpool.cluster.app``); it is plain Python, so tests drive it directly.

Invariants: ``index`` equals the union, per replica, of the batches published since the
replica's first (each replica's events are applied in the order it sent them); a replica
``forget`` was told of (it died) holds nothing, and any batch it still had in flight is
dropped, never resurrecting its blocks; a router that replays every entry from a
snapshot onwards holds the same index as the log.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from dataclasses import dataclass
from typing import Any

from kvpool.cache.events import BlockPinned, BlockStored, KVEvent
from kvpool.cache.kv_index import ClusterIndex


@dataclass(frozen=True)
class ReplicaLoad:
    """What a replica reported with its last batch (or heartbeat)."""

    running: int = 0
    waiting: int = 0
    free_blocks: int = 0
    total_blocks: int = 0


# An entry: (replica, events), or (replica, None) for "forget this replica".
Entry = tuple[str, list[KVEvent] | None]


class KVEventLog:
    def __init__(self, block_size: int, keep: int = 4096) -> None:
        self.index = ClusterIndex(block_size)
        self.loads: dict[str, ReplicaLoad] = {}
        self._entries: deque[Entry] = deque()
        self._first = 0  # cursor of _entries[0]
        self._keep = keep
        self._gone: set[str] = set()
        self._changed: asyncio.Event | None = None  # made on the actor's event loop

    @property
    def cursor(self) -> int:
        return self._first + len(self._entries)

    def _append(self, entry: Entry) -> None:
        self._entries.append(entry)
        while len(self._entries) > self._keep:
            self._entries.popleft()
            self._first += 1
        if self._changed is not None:  # wake every waiting pull; later ones get a new one
            self._changed.set()
            self._changed = None

    def publish(self, replica: str, events: list[KVEvent], load: ReplicaLoad | None = None) -> bool:
        """Apply one batch of a replica's events (False: the replica was forgotten)."""
        if replica in self._gone:
            return False
        if load is not None:
            self.loads[replica] = load
        if events:
            self.index.apply(replica, events)
            self._append((replica, list(events)))
        return True

    def forget(self, replica: str) -> None:
        """The replica is gone (died, removed): drop its blocks, now and for good."""
        if replica in self._gone:
            return
        self._gone.add(replica)
        self.loads.pop(replica, None)
        self.index.drop_replica(replica)
        self._append((replica, None))

    def snapshot(self) -> dict[str, Any]:
        """The whole index: each replica's block keys and pinned keys, and the cursor it
        is valid at."""
        return {
            "cursor": self.cursor,
            "blocks": {r: sorted(self.index.blocks_of(r)) for r in self.index.replicas()},
            "pinned": {r: sorted(self.index.pinned_of(r)) for r in self.index.replicas()},
            "loads": dict(self.loads),
            "gone": sorted(self._gone),
        }

    async def pull(self, cursor: int | None, wait_s: float = 1.0) -> dict[str, Any]:
        """What follows ``cursor``: ``{"cursor", "entries", "loads"}``, waiting up to
        ``wait_s`` for something new; or, for a cursor that is None or no longer kept,
        the ``snapshot`` (under ``"snapshot"``)."""
        if cursor is None or cursor < self._first or cursor > self.cursor:
            return {"cursor": self.cursor, "snapshot": self.snapshot(), "loads": dict(self.loads)}
        if cursor == self.cursor and wait_s > 0:
            if self._changed is None:
                self._changed = asyncio.Event()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), wait_s)
        start = cursor - self._first
        entries = [self._entries[i] for i in range(start, len(self._entries))]
        return {"cursor": self.cursor, "entries": entries, "loads": dict(self.loads)}

    def blocks(self) -> dict[str, list[int]]:
        """Each replica's block keys, as this log holds them (tests compare)."""
        return {r: sorted(self.index.blocks_of(r)) for r in self.index.replicas()}


class IndexReplay:
    """A router's local copy of the log's index, kept by replaying pulls."""

    def __init__(self, block_size: int) -> None:
        self.index = ClusterIndex(block_size)
        self.cursor: int | None = None
        self.loads: dict[str, ReplicaLoad] = {}
        self.gone: set[str] = set()

    def apply(self, pulled: dict[str, Any]) -> None:
        snap = pulled.get("snapshot")
        if snap is not None:
            index = ClusterIndex(self.index.block_size)
            for replica, keys in snap["blocks"].items():
                index.apply(replica, [BlockStored(k, None, 0, 0) for k in keys])
            for replica, keys in snap["pinned"].items():
                index.apply(replica, [BlockPinned(k) for k in keys])
            self.index = index
            self.gone = set(snap["gone"])
        for replica, events in pulled.get("entries", ()):
            if events is None:
                self.gone.add(replica)
                self.index.drop_replica(replica)
            elif replica not in self.gone:
                self.index.apply(replica, events)
        self.loads = dict(pulled.get("loads", {}))
        self.cursor = pulled["cursor"]
