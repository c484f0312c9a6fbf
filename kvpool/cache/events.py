"""KV events: what a block manager's prefix index gained and lost, in order.

A router that sends each request where its prefix is cached (``kvpool.cache.kv_index``)
keeps a copy of every replica's index from these events. They name blocks by their
chain hash (``BlockHash``: the block's tokens, its salt and, through the parent's hash,
its whole prefix), so a router can compute the hashes of a request's prefix itself and
look them up; the tenant salt travels only as a hash of it.

- ``BlockStored``: a full block became findable (indexed).
- ``BlockRemoved``: it stopped being findable (evicted, or dropped by a reset).
- ``BlockPinned`` / ``BlockUnpinned``: its first pin came / its last pin went.

Publishing is off until a manager's ``enable_kv_events``; then each change appends one
small tuple, and ``take_kv_events`` hands over (and clears) what accumulated: a replica
sends one batch per step.
"""

from __future__ import annotations

from dataclasses import dataclass
from hashlib import blake2b


@dataclass(frozen=True, slots=True)
class BlockStored:
    block_hash: int
    parent_hash: int | None
    salt_hash: int  # 0: no salt
    num_tokens: int


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hash: int


@dataclass(frozen=True, slots=True)
class BlockPinned:
    block_hash: int


@dataclass(frozen=True, slots=True)
class BlockUnpinned:
    block_hash: int


KVEvent = BlockStored | BlockRemoved | BlockPinned | BlockUnpinned


def salt_hash(salt: bytes) -> int:
    """A salt as events name it (0 for none): a tenant's name never leaves the replica."""
    if not salt:
        return 0
    return int.from_bytes(blake2b(salt, digest_size=8, person=b"kvpool-salt").digest(), "little")
