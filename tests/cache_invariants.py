"""Full-scan checks of the block manager's invariants, shared by the cache tests.

Everything here recomputes from the blocks themselves what the pool keeps as counters,
so a counter that drifts, a leaked reference or a block in two states fails loudly.
"""

from __future__ import annotations

from collections import Counter

from kvpool.cache import KVCacheManager
from kvpool.cache.block_map import code_of, count_states


def check_invariants(manager: KVCacheManager) -> None:
    pool = manager.pool
    stats = manager.stats()
    blocks = pool.blocks
    bs = manager.block_size

    # Holders: each sequence's table and each pin hold one reference per listing.
    holders: Counter[int] = Counter()
    for seq in manager._seqs.values():
        holders.update(block.block_id for block in seq.blocks)
    pin_holders: Counter[int] = Counter()
    for pinned in manager._pins.values():
        pin_holders.update(block.block_id for block in pinned)
    for block in blocks:
        expected = holders[block.block_id] + pin_holders[block.block_id]
        assert block.ref_count == expected, f"{block!r}: expected {expected} holders"
        assert block.pin_count == pin_holders[block.block_id], f"{block!r} pin count"

    # Three states, and the free queue holds exactly the unreferenced blocks.
    in_queue = [block.block_id for block in pool.free_queue]
    assert len(in_queue) == len(set(in_queue)) == len(pool.free_queue)
    assert set(in_queue) == {b.block_id for b in blocks if b.ref_count == 0}
    used = [b for b in blocks if b.ref_count > 0]
    cached = [b for b in blocks if b.ref_count == 0 and b.indexed]
    free = [b for b in blocks if b.ref_count == 0 and not b.indexed]
    for block in free:
        assert block.block_hash is None and not block.token_ids, f"free {block!r} has content"
    assert stats.used_blocks == len(used)
    assert stats.cached_blocks == len(cached)
    assert stats.free_blocks == len(free)
    assert stats.free_blocks + stats.used_blocks + stats.cached_blocks == stats.total_blocks
    assert stats.shared_blocks == sum(1 for b in blocks if b.ref_count > 1)
    assert stats.pinned_blocks == sum(1 for b in blocks if b.pin_count > 0)
    assert stats.pinned_blocks <= pool.max_pinned_blocks
    assert stats.filled_slots == sum(len(b.token_ids) for b in used)
    assert stats.waste_slots_reserved == bs * sum(1 for b in used if not b.token_ids)
    assert stats.waste_slots == len(used) * bs - stats.filled_slots

    # The block map, kept on transitions, equals one computed from the blocks.
    assert pool.states == bytearray(code_of(b) for b in blocks), "the block map drifted"
    counts = count_states(pool.states)
    assert counts["free"] == len(free) and counts["cached"] == len(cached)
    assert counts["pinned"] == stats.pinned_blocks

    # The index: only full, hashed blocks, each findable by its own content.
    indexed = [b for b in blocks if b.indexed]
    assert len(pool.index) == len(indexed)
    for block in indexed:
        assert block.block_hash is not None and len(block.token_ids) == bs
        found = pool.index.find(
            block.block_hash, block.parent_content_id, block.salt, block.token_ids
        )
        assert found is block, "two indexed blocks hold the same content"
    for block in blocks:
        if block.block_hash is not None:
            assert len(block.token_ids) == bs, "a partial block carries a key"

    # Each sequence: enough blocks, and only its last written block may be partial.
    for seq in manager._seqs.values():
        assert len(seq.blocks) >= manager.blocks_needed(seq.num_tokens)
        for i, block in enumerate(seq.blocks):
            start = i * bs
            expect = max(0, min(bs, seq.num_tokens - start))
            assert len(block.token_ids) == expect, f"block {i} of a sequence holds wrong count"
            if block.block_hash is not None:
                assert block.position == i, f"block {i} says position {block.position}"
        assert seq.num_hashed_blocks <= seq.num_computed // bs
