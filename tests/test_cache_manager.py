"""Behaviour of the block manager, one property per test."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvpool.cache import (
    BlockHash,
    BudgetTooSmall,
    KVCacheManager,
    ModelGeometry,
    NotPinned,
    OutOfBlocks,
    PinLimitExceeded,
    SequenceExists,
    UnknownSequence,
    hash_block,
)
from tests.cache_invariants import check_invariants

BS = 4


def weak_hash(parent: BlockHash | None, salt: bytes, tokens) -> BlockHash:
    """Every block collides with every other: only verification keeps hits correct."""
    return BlockHash(7)


def make(num_blocks: int = 16, **kw) -> KVCacheManager:
    return KVCacheManager(num_blocks, BS, **kw)


# -- geometry ------------------------------------------------------------------------------
def test_bytes_per_token_is_k_and_v_times_layers_heads_dim_dtype():
    llama2_13b = ModelGeometry(num_layers=40, num_kv_heads=40, head_dim=128, dtype_bytes=2)
    assert llama2_13b.bytes_per_token == 2 * 40 * 40 * 128 * 2 == 819_200
    smollm2 = ModelGeometry(num_layers=30, num_kv_heads=3, head_dim=64, dtype_bytes=4)
    assert smollm2.bytes_per_token == 46_080
    assert smollm2.bytes_per_block(16) == 16 * 46_080


def test_blocks_for_budget_rounds_down_and_rejects_too_small():
    g = ModelGeometry(2, 2, 8, 2)  # 128 bytes per token
    assert g.blocks_for_budget(128 * 16 * 10 + 100, 16) == 10
    with pytest.raises(BudgetTooSmall, match="holds no block"):
        g.blocks_for_budget(128 * 16 - 1, 16)
    with pytest.raises(ValueError):
        ModelGeometry(0, 2, 8, 2)


# -- hashing -------------------------------------------------------------------------------
def test_block_key_is_stable_across_processes_and_covers_parent_and_salt():
    here = hash_block(None, b"", [1, 2, 3, 4])
    code = "from kvpool.cache import hash_block; print(hash_block(None, b'', [1, 2, 3, 4]))"
    for seed in ("0", "12345"):
        out = subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            check=True,
            env={"PYTHONHASHSEED": seed, "PATH": ""},
        )
        assert int(out.stdout) == here
    assert hash_block(here, b"", [5, 6, 7, 8]) != hash_block(None, b"", [5, 6, 7, 8])
    assert hash_block(None, b"tenant", [1, 2, 3, 4]) != here


# -- allocate ------------------------------------------------------------------------------
def test_allocate_takes_blocks_for_the_prompt_only():
    m = make()
    alloc = m.allocate("a", range(9))
    assert len(alloc.block_ids) == 3 and alloc.num_cached_tokens == 0
    assert m.num_free_blocks == 13
    assert m.sequence_tokens("a") == list(range(9))
    check_invariants(m)


def test_hit_after_free_reuses_the_same_blocks():
    m = make()
    first = m.allocate("a", range(10))
    m.free("a")
    again = m.allocate("b", [*range(10), 99])
    assert again.num_cached_tokens == 8
    assert again.block_ids[:2] == first.block_ids[:2]
    assert m.stats().prefix_hit_tokens == 8
    check_invariants(m)


def test_fully_cached_prompt_still_computes_its_last_token_in_an_owned_block():
    m = make()
    m.allocate("a", range(8))
    m.free("a")
    alloc = m.allocate("b", range(8))
    assert alloc.num_cached_tokens == 4  # the block holding token 7 is the sequence's own
    last = m.pool.blocks[alloc.block_ids[-1]]
    assert last.ref_count == 1
    check_invariants(m)


def test_running_sequences_share_prefix_blocks():
    m = make()
    a = m.allocate("a", range(9))
    b = m.allocate("b", [*range(8), 42])
    assert b.num_cached_tokens == 8 and b.block_ids[:2] == a.block_ids[:2]
    s = m.stats()
    assert s.shared_blocks == 2 and s.used_blocks == 4
    check_invariants(m)


def test_no_hit_across_salts():
    m = make()
    m.allocate("a", range(9), salt="tenant-1")
    m.free("a")
    assert m.allocate("b", range(9), salt="tenant-2").num_cached_tokens == 0
    assert m.allocate("c", range(9)).num_cached_tokens == 0
    assert m.allocate("d", range(9), salt="tenant-1").num_cached_tokens == 8
    check_invariants(m)


def test_a_public_prefix_is_shared_across_salts_and_what_follows_is_not():
    m = make()  # blocks of 4
    shared = list(range(8))  # two blocks declared shared (a pinned system prompt)
    m.allocate("a", [*shared, 50, 51, 52, 53, 54], salt="tenant-1", public_tokens=8)
    m.free("a")
    # another tenant hits the two public blocks, not tenant-1's block after them
    hit = m.allocate("b", [*shared, 50, 51, 52, 53, 54], salt="tenant-2", public_tokens=8)
    assert hit.num_cached_tokens == 8
    m.free("b")
    # without declaring the prefix public, nothing is shared across tenants
    assert m.count_cached_tokens([*shared, 50, 51, 52, 53, 54], salt="tenant-3") == 0
    # tenant-1 hits all three of its blocks
    assert m.count_cached_tokens([*shared, 50, 51, 52, 53, 54], "tenant-1", public_tokens=8) == 12
    check_invariants(m)


def test_partial_blocks_are_never_indexed():
    m = make()
    m.allocate("a", range(6))
    m.free("a")
    assert m.allocate("b", [*range(6), 6, 7, 8]).num_cached_tokens == 4
    check_invariants(m)


def test_equal_block_after_different_prefix_does_not_hit():
    m = make()
    m.allocate("a", [1, 1, 1, 1, 5, 5, 5, 5, 0])
    assert m.allocate("b", [2, 2, 2, 2, 5, 5, 5, 5, 0]).num_cached_tokens == 0
    check_invariants(m)


@pytest.mark.parametrize("salted", [False, True])
def test_forced_hash_collisions_never_match_other_content(salted):
    m = make(32, hash_fn=weak_hash)
    salt = "t" if salted else None
    m.allocate("a", [1, 1, 1, 1, 5, 5, 5, 5, 0], salt=salt)
    m.free("a")
    assert m.allocate("b", [2, 2, 2, 2, 5, 5, 5, 5, 0], salt=salt).num_cached_tokens == 0
    assert m.allocate("c", [1, 1, 1, 1, 6, 6, 6, 6, 0], salt=salt).num_cached_tokens == 4
    assert m.allocate("d", [1, 1, 1, 1, 5, 5, 5, 5, 0], salt="other").num_cached_tokens == 0
    assert m.allocate("e", [1, 1, 1, 1, 5, 5, 5, 5, 0], salt=salt).num_cached_tokens == 8
    for seq in "bcde":
        assert m.sequence_tokens(seq)[:8] == m.sequence_tokens(seq)[:8]
    check_invariants(m)


def test_uncomputed_blocks_are_not_findable_until_marked():
    m = make()
    m.allocate("a", range(13), computed=False)
    assert m.count_cached_tokens(range(13)) == 0
    m.mark_computed("a", 8)
    assert m.count_cached_tokens(range(13)) == 8
    m.free("a")
    assert m.count_cached_tokens(range(13)) == 8  # block 3 was never computed
    check_invariants(m)


def test_duplicate_computation_keeps_one_indexed_copy():
    m = make()
    m.allocate("a", range(9), computed=False)
    m.allocate("b", range(9), computed=False)  # nothing computed yet: no hit
    m.mark_computed("a", 9)
    m.mark_computed("b", 9)
    m.free("a")
    m.free("b")
    s = m.stats()
    assert s.cached_blocks == 2 and s.free_blocks == 14
    assert m.allocate("c", range(9)).num_cached_tokens == 8
    check_invariants(m)


def test_out_of_blocks_changes_nothing():
    m = make(4)
    m.allocate("a", range(8))
    m.free("a")
    m.allocate("b", range(100, 104))
    before = (m.stats(), m.block_table("b"), m.count_cached_tokens([*range(8), 1]))
    with pytest.raises(OutOfBlocks) as err:
        m.allocate("c", [*range(8), *range(200, 210)])  # 2 cached + 3 new > 3 available
    assert err.value.needed == 3 and err.value.free == 1
    with pytest.raises(OutOfBlocks):
        m.append("b", range(20))
    assert (m.stats(), m.block_table("b"), m.count_cached_tokens([*range(8), 1])) == before
    assert not m.has_sequence("c")
    check_invariants(m)


def test_keep_free_is_an_admission_watermark():
    m = make(4)
    m.allocate("a", range(8))
    m.free("a")
    with pytest.raises(OutOfBlocks):
        m.allocate("b", range(100, 109), keep_free=2)  # 3 new + 2 kept > 4
    assert m.count_cached_tokens([*range(8), 0]) == 8  # nothing was evicted for it
    with pytest.raises(OutOfBlocks):
        m.allocate("c", [*range(8), 1], keep_free=2)  # 2 hits + 1 new leave 1 available
    m.allocate("c", [*range(8), 1], keep_free=1)
    check_invariants(m)


def test_sequence_id_errors():
    m = make()
    m.allocate("a", [1])
    with pytest.raises(SequenceExists):
        m.allocate("a", [1])
    with pytest.raises(UnknownSequence):
        m.free("zz")
    with pytest.raises(UnknownSequence):
        m.append("zz", [1])
    with pytest.raises(SequenceExists):
        m.fork("a", "a")
    with pytest.raises(ValueError):
        m.allocate("b", [])


# -- append, fork, copy-on-write -----------------------------------------------------------
def test_append_takes_a_block_only_when_the_last_is_full():
    m = make()
    m.allocate("a", range(3))
    assert m.append("a", [3]) == [] and len(m.block_table("a")) == 1
    assert m.append("a", [4]) == [] and len(m.block_table("a")) == 2
    assert m.append("a", range(5, 14)) == [] and len(m.block_table("a")) == 4
    assert m.sequence_tokens("a") == list(range(14))
    check_invariants(m)


def test_append_to_shared_partial_block_copies_it_once():
    m = make()
    m.allocate("p", range(6))
    m.fork("p", "c")
    shared_partial = m.block_table("p")[1]
    copies = m.append("c", [100])
    assert len(copies) == 1 and copies[0][0] == shared_partial
    assert m.block_table("c")[0] == m.block_table("p")[0]  # the full block stays shared
    assert m.block_table("c")[1] == copies[0][1] != shared_partial
    assert m.append("c", [101]) == []  # the copy is the child's own now
    assert m.append("p", [7]) == []  # the original is the parent's alone now
    assert m.sequence_tokens("p") == [*range(6), 7]
    assert m.sequence_tokens("c") == [*range(6), 100, 101]
    assert m.stats().cow_copies == 1
    check_invariants(m)


def test_append_to_unshared_block_never_copies():
    m = make()
    m.allocate("a", range(6))
    assert m.append("a", [6, 7, 8]) == []
    assert m.stats().cow_copies == 0


def test_fork_at_block_boundary_shares_full_blocks_without_copies():
    m = make()
    m.allocate("p", range(8))
    for child in ("c1", "c2", "c3"):
        m.fork("p", child)
    for seq in ("p", "c1", "c2", "c3"):
        assert m.append(seq, [hash(seq) % 50]) == []
    s = m.stats()
    assert s.shared_blocks == 2 and s.used_blocks == 6 and s.cow_copies == 0
    check_invariants(m)


# -- free, eviction ------------------------------------------------------------------------
def test_free_keeps_content_findable_until_reused():
    m = make(3)
    m.allocate("a", range(9))
    m.free("a")
    s = m.stats()
    assert s.cached_blocks == 2 and s.free_blocks == 1 and s.used_blocks == 0
    assert m.count_cached_tokens(range(12)) == 8


def test_eviction_is_lru_and_takes_a_chains_tail_first():
    m = make(4)
    m.allocate("a", range(9))  # blocks: [0..3] [4..7] partial
    m.free("a")
    m.allocate("x", range(100, 109))  # needs 3: two empty blocks, then a's tail block
    assert m.count_cached_tokens(range(12)) == 4
    assert m.stats().evictions == 1
    check_invariants(m)


def test_hit_refreshes_lru_position():
    m = make(5)
    m.allocate("old", [*range(4), 0])
    m.free("old")
    m.allocate("new", [*range(10, 14), 0])
    m.free("new")
    m.allocate("old2", [*range(4), 1])  # touches "old"'s block
    m.free("old2")
    m.allocate("x", range(100, 116))  # 4 blocks: the 3 empty ones, then the LRU cached one
    assert m.count_cached_tokens([*range(4), 0]) == 4
    assert m.count_cached_tokens([*range(10, 14), 0]) == 0


def test_eviction_never_touches_referenced_or_pinned_blocks():
    m = make(8)
    m.allocate("live", range(9))
    m.allocate("sys", range(50, 59))
    assert m.pin(range(50, 58)) == 8
    m.free("sys")
    with pytest.raises(OutOfBlocks):
        m.allocate("big", range(100, 120))
    m.allocate("fits", range(100, 112))  # the 3 free blocks, evicting the cached tail
    assert m.sequence_tokens("live") == list(range(9))
    assert m.count_cached_tokens([*range(50, 58), 0]) == 8
    check_invariants(m)


# -- pins ----------------------------------------------------------------------------------
def test_pinned_prefix_survives_pressure_and_unpin_makes_it_evictable():
    m = make(6)
    m.allocate("sys", [*range(8), 0])
    m.free("sys")
    assert m.pin(range(8)) == 8
    assert m.pin(range(8)) == 8  # idempotent
    for i in range(10):
        m.allocate(i, range(1000 + 16 * i, 1016 + 16 * i))
        m.free(i)
    assert m.stats().pinned_blocks == 2
    assert m.allocate("user", [*range(8), 5]).num_cached_tokens == 8
    m.free("user")
    m.unpin(range(8))
    with pytest.raises(NotPinned):
        m.unpin(range(8))
    m.allocate("flood", range(5000, 5024))
    assert m.count_cached_tokens([*range(8), 0]) == 0
    check_invariants(m)


def test_pins_are_capped():
    m = make(8, max_pinned_fraction=0.25)  # two blocks at most
    m.allocate("a", range(13))
    assert m.pin(range(8)) == 8
    before = m.stats()
    with pytest.raises(PinLimitExceeded):
        m.pin(range(12))
    assert m.stats() == before
    check_invariants(m)


def test_pin_of_uncached_prefix_pins_nothing():
    m = make()
    assert m.pin(range(8)) == 0
    assert m.stats().pinned_blocks == 0


# -- reservation (the static policy) -------------------------------------------------------
def test_reserve_tokens_takes_blocks_ahead_and_counts_them_as_waste():
    m = make(enable_prefix_caching=False)
    m.allocate("a", range(5), reserve_tokens=16)
    s = m.stats()
    assert s.used_blocks == 4
    assert s.waste_slots_internal == 3 and s.waste_slots_reserved == 8
    m.append("a", range(5, 16))
    assert len(m.block_table("a")) == 4 and m.stats().waste_slots == 0
    check_invariants(m)


# -- stats ---------------------------------------------------------------------------------
def test_stats_count_shared_blocks_once_in_bytes():
    g = ModelGeometry(2, 2, 8, 2)
    m = KVCacheManager(10, BS, geometry=g)
    m.allocate("a", range(9))
    m.fork("a", "b")
    s = m.stats()
    assert s.used_blocks == 3 and s.shared_blocks == 3
    assert s.used_bytes == 3 * g.bytes_per_block(BS) and s.total_bytes == 10 * g.bytes_per_block(BS)
    assert s.as_dict()["usage"] == pytest.approx(0.3)


def test_reset_prefix_cache_drops_only_unreferenced_content():
    m = make()
    m.allocate("a", range(9))
    m.allocate("b", range(100, 109))
    m.free("b")
    assert m.reset_prefix_cache() == 2
    assert m.count_cached_tokens(range(100, 109)) == 0
    assert m.count_cached_tokens(range(9)) == 8
    check_invariants(m)


def test_prefix_caching_off_never_hits():
    m = make(enable_prefix_caching=False)
    m.allocate("a", range(9))
    m.free("a")
    assert m.allocate("b", range(9)).num_cached_tokens == 0
    assert m.stats().cached_blocks == 0


def test_cache_package_does_not_import_torch():
    code = "import sys, kvpool.cache; sys.exit('torch' in sys.modules or 'numpy' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_worked_example_in_the_design_note():
    """docs/cache-design.md walks through exactly this sequence."""
    m = make(8)
    system = [5] * 8
    assert m.allocate("a", [*system, 1]).block_ids == [0, 1, 2]
    assert m.allocate("b", [*system, 2]).block_ids == [0, 1, 3]
    m.free("a")
    m.free("b")
    assert [b.block_id for b in m.pool.free_queue] == [3, 2, 4, 5, 6, 7, 1, 0]
    assert m.count_cached_tokens([*system, 3]) == 8
    m.allocate("big", range(100, 128))
    assert m.stats().evictions == 1
    assert m.count_cached_tokens([*system, 3]) == 4


def test_each_block_is_hashed_once():
    calls = []

    def counting_hash(parent, salt, tokens):
        calls.append(tuple(tokens))
        return hash_block(parent, salt, tokens)

    m = make(64, hash_fn=counting_hash)
    m.allocate("warm", range(12))  # caches blocks 0-2
    m.free("warm")
    calls.clear()
    m.allocate("a", [*range(12), *range(100, 128)])  # 10 blocks: 3 hits, 7 new
    assert len(calls) == 10 and len(set(calls)) == 10
    calls.clear()
    for t in range(12):  # one token at a time fills three more blocks
        m.append("a", [t])
    assert len(calls) == 3
    calls.clear()
    m.allocate("b", [*range(100, 140)], computed=False)
    m.mark_computed("b", 20)
    m.mark_computed("b", 40)
    assert len(calls) == 10  # lookup of block 0 (a miss) reused, then each block once


def test_a_salts_pins_are_capped_apart_from_the_pool_and_listed():
    m = make(16, max_pinned_fraction=0.5)  # eight blocks in all
    for salt in ("a", "b"):
        m.allocate(salt, list(range(16)), salt=salt)
        m.free(salt)
    assert m.pin(range(8), "a", max_salt_blocks=2) == 8
    assert m.pin(range(8), "a", max_salt_blocks=2) == 8  # the same pin again: no-op
    with pytest.raises(PinLimitExceeded, match="this tenant's pin limit"):
        m.pin(range(12), "a", max_salt_blocks=2)  # one block more than a's share
    assert m.pinned_blocks_of("a") == 2
    assert m.pin(range(12), "b", max_salt_blocks=3) == 12  # b has its own share
    assert [(p.salt, len(p.token_ids), p.num_blocks) for p in m.pins()] == [
        (b"a", 8, 2),
        (b"b", 12, 3),
    ]
    assert m.stats().pinned_blocks == 5
    assert m.reset_prefix_cache() == 3  # the unpinned blocks of the 8 cached
    assert m.stats().pinned_blocks == 5  # the pins kept
    assert m.reset_prefix_cache(unpin=True) == 5
    assert m.pins() == [] and m.stats().pinned_blocks == 0
