"""The block map: one byte per physical block saying what state it is in, kept by
``BlockPool`` on every transition so a view of the whole pool is one copy of a
``bytearray`` (never a scan of the blocks).

A byte is ``holders | PINNED | CACHED``:
- ``holders`` (the low six bits): sequences holding the block (its reference count less
  its pins), capped at ``MAX_HOLDERS``; 0 for a block no sequence holds;
- ``PINNED``: at least one pin holds it;
- ``CACHED``: its content is indexed, so a prefix lookup can find it.

So 0 is a free block, ``CACHED`` alone a cached (unreferenced, evictable) block, 1 a block
one sequence holds, 2 or more a block shared by that many sequences.
"""

from __future__ import annotations

from kvpool.cache.block import Block

MAX_HOLDERS = 0x3F
PINNED = 0x40
CACHED = 0x80

FREE = "free"
CACHED_STATE = "cached"
IN_USE = "in_use"
SHARED = "shared"
PINNED_STATE = "pinned"
STATES = (FREE, CACHED_STATE, IN_USE, SHARED, PINNED_STATE)


def code_of(block: Block) -> int:
    """The byte for ``block`` as it is now."""
    holders = min(block.ref_count - block.pin_count, MAX_HOLDERS)
    return holders | (PINNED if block.pin_count else 0) | (CACHED if block.indexed else 0)


def state_of(code: int) -> str:
    """The one state a block's byte is drawn as: pinned before shared before in use."""
    if code & PINNED:
        return PINNED_STATE
    holders = code & MAX_HOLDERS
    if holders >= 2:
        return SHARED
    if holders == 1:
        return IN_USE
    return CACHED_STATE if code & CACHED else FREE


def count_states(codes: bytes | bytearray) -> dict[str, int]:
    """How many blocks of a map are in each state (``STATES``)."""
    counts = dict.fromkeys(STATES, 0)
    histogram = [0] * 256
    for code in set(codes):
        histogram[code] = codes.count(code)
    for code, n in enumerate(histogram):
        if n:
            counts[state_of(code)] += n
    return counts
