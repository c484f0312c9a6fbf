"""A router's copy of what every replica has cached, kept from their KV events.

``ClusterIndex.apply(replica, events)`` replays one replica's events in order;
``match(token_ids, salt)`` gives, for each replica, how many leading full blocks of a
prompt it holds (the request's chain hashes, computed here with the replicas' own
``hash_block``, looked up block by block until the first miss).

Invariant (exactness): after any sequence of events, ``blocks_of(r)`` equals the set of
keys replica ``r``'s prefix index holds (``KVCacheManager.cached_block_hashes``), and a
replica that is dropped (died, restarted) holds nothing here. A key held twice by one
replica (two contents whose 64-bit keys collide) is counted, so removing one copy keeps
the other.

The router trusts keys, not tokens: a hit here is a routing hint, and the replica still
verifies every block token by token before it reuses one.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping, Sequence

from kvpool.cache.events import BlockPinned, BlockRemoved, BlockStored, BlockUnpinned, KVEvent
from kvpool.cache.hashing import BlockHash, hash_block, salt_bytes


def prefix_keys(token_ids: Sequence[int], block_size: int, salt: str | bytes | None) -> list[int]:
    """The chain hashes of a prompt's full blocks that a replica could reuse: all but the
    block holding the last token, as the block manager's own lookup."""
    salt_b = salt_bytes(salt)
    keys: list[int] = []
    parent: BlockHash | None = None
    for i in range((len(token_ids) - 1) // block_size):
        parent = hash_block(parent, salt_b, token_ids[i * block_size : (i + 1) * block_size])
        keys.append(parent)
    return keys


class ClusterIndex:
    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._held: dict[Hashable, dict[int, int]] = {}  # replica -> key -> copies
        self._where: dict[int, set[Hashable]] = {}  # key -> replicas holding it
        self._pinned: dict[Hashable, dict[int, int]] = {}  # replica -> key -> pinned copies

    def apply(self, replica: Hashable, events: Iterable[KVEvent]) -> None:
        held = self._held.setdefault(replica, {})
        for event in events:
            if isinstance(event, BlockStored):
                key = event.block_hash
                held[key] = held.get(key, 0) + 1
                self._where.setdefault(key, set()).add(replica)
            elif isinstance(event, BlockRemoved):
                key = event.block_hash
                count = held.get(key, 0) - 1
                if count > 0:
                    held[key] = count
                    continue
                held.pop(key, None)
                where = self._where.get(key)
                if where is not None:
                    where.discard(replica)
                    if not where:
                        del self._where[key]
            elif isinstance(event, BlockPinned):
                pinned = self._pinned.setdefault(replica, {})
                pinned[event.block_hash] = pinned.get(event.block_hash, 0) + 1
            elif isinstance(event, BlockUnpinned):
                pinned = self._pinned.get(replica, {})
                count = pinned.get(event.block_hash, 0) - 1
                if count > 0:
                    pinned[event.block_hash] = count
                else:
                    pinned.pop(event.block_hash, None)

    def drop_replica(self, replica: Hashable) -> None:
        """Forget everything a replica held (it died or restarted)."""
        for key in self._held.pop(replica, {}):
            where = self._where.get(key)
            if where is not None:
                where.discard(replica)
                if not where:
                    del self._where[key]
        self._pinned.pop(replica, None)

    def replicas(self) -> list[Hashable]:
        return list(self._held)

    def blocks_of(self, replica: Hashable) -> set[int]:
        return set(self._held.get(replica, {}))

    def pinned_of(self, replica: Hashable) -> set[int]:
        return set(self._pinned.get(replica, {}))

    def prefix_keys(self, token_ids: Sequence[int], salt: str | bytes | None = None) -> list[int]:
        return prefix_keys(token_ids, self.block_size, salt)

    def held_by(self, replica: Hashable) -> Mapping[int, int]:
        """The keys a replica holds (a live view: key -> copies)."""
        return self._held.get(replica, {})

    def match(
        self, token_ids: Sequence[int], salt: str | bytes | None = None
    ) -> dict[Hashable, int]:
        """Per replica, the leading full blocks of the prompt it holds (replicas that
        hold none are left out)."""
        out: dict[Hashable, int] = {}
        alive: set[Hashable] | None = None
        for depth, key in enumerate(self.prefix_keys(token_ids, salt)):
            where = self._where.get(key)
            if not where:
                break
            alive = set(where) if alive is None else alive & where
            if not alive:
                break
            for replica in alive:
                out[replica] = depth + 1
        return out
