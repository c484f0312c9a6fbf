"""KV events and the router's copy of every replica's cache (``ClusterIndex``): after any
sequence of operations the copy equals what each replica's prefix index holds (also when
keys collide), pins included; ``match`` agrees with the replicas' own lookups; a dropped
replica holds nothing; publishing is off until asked and costs one small event per
block that changes."""

from __future__ import annotations

import random

from hypothesis import HealthCheck, settings
from hypothesis.stateful import invariant, rule

from kvpool.cache import KVCacheManager
from kvpool.cache.events import BlockRemoved, BlockStored, salt_hash
from kvpool.cache.kv_index import ClusterIndex
from tests.test_cache_stateful import BS, CacheMachine, colliding_hash


class EventsMachine(CacheMachine):
    """The block manager's random operations, its events replayed into a router copy."""

    def __init__(self) -> None:
        super().__init__()
        self.m.enable_kv_events()
        self.index = ClusterIndex(BS)

    @rule()
    def reset(self):
        self.m.reset_prefix_cache()

    @invariant()
    def router_copy_is_exact(self):
        self.index.apply("replica", self.m.take_kv_events())
        assert self.index.blocks_of("replica") == self.m.cached_block_hashes()
        blocks = self.m.pool.blocks
        pinned = {b.block_hash for b in blocks if b.pin_count and b.block_hash is not None}
        assert self.index.pinned_of("replica") == pinned


class CollidingEventsMachine(EventsMachine):
    hash_fn = staticmethod(colliding_hash)


_SETTINGS = settings(
    max_examples=40, stateful_step_count=50, deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)  # fmt: skip
TestEvents = EventsMachine.TestCase
TestEvents.settings = _SETTINGS
TestEventsWithCollidingKeys = CollidingEventsMachine.TestCase
TestEventsWithCollidingKeys.settings = _SETTINGS


def _run(manager: KVCacheManager, seq: int, tokens: list[int], salt=None) -> None:
    manager.allocate(seq, tokens, salt, computed=False)
    manager.mark_computed(seq, len(tokens))
    manager.free(seq)


def test_match_agrees_with_each_replicas_lookup_and_a_dead_replica_holds_nothing():
    rng = random.Random(7)
    replicas = {name: KVCacheManager(40, BS) for name in ("a", "b", "c")}
    index = ClusterIndex(BS)
    systems = [[rng.randrange(50) for _ in range(3 * BS)] for _ in range(4)]
    for m in replicas.values():
        m.enable_kv_events()
    for step in range(300):
        name = rng.choice(list(replicas))
        salt = rng.choice([None, "t1"])
        prompt = rng.choice(systems) + [rng.randrange(50) for _ in range(rng.randrange(1, 9))]
        _run(replicas[name], step, prompt, salt)
        for n, m in replicas.items():
            index.apply(n, m.take_kv_events())
        probe = [*rng.choice(systems), 1, 2, 3, 4, 5]
        probe_salt = rng.choice([None, "t1"])
        got = index.match(probe, probe_salt)
        for n, m in replicas.items():
            expect = m.count_cached_tokens(probe, probe_salt) // BS
            assert got.get(n, 0) == expect, (step, n)
            assert index.blocks_of(n) == m.cached_block_hashes()
    index.drop_replica("b")
    assert index.blocks_of("b") == set()
    assert all("b" not in index.match([*s, 1]) for s in systems)


def test_events_are_off_until_asked_and_name_salts_by_hash():
    m = KVCacheManager(8, BS)
    _run(m, 0, list(range(9)))
    assert m.take_kv_events() == []
    m.enable_kv_events()
    _run(m, 1, list(range(100, 109)), "tenant-a")
    events = m.take_kv_events()
    stored = [e for e in events if isinstance(e, BlockStored)]
    assert len(stored) == 2 and stored[1].parent_hash == stored[0].block_hash
    assert stored[0].parent_hash is None and stored[0].num_tokens == BS
    assert stored[0].salt_hash == salt_hash(b"tenant-a") != 0
    assert "tenant-a" not in repr(events)
    m.reset_prefix_cache()
    removed = [e.block_hash for e in m.take_kv_events() if isinstance(e, BlockRemoved)]
    assert set(removed) >= {e.block_hash for e in stored}
    assert m.take_kv_events() == []


def test_a_decode_step_at_batch_32_publishes_at_most_a_block_per_sequence():
    """Cost is per changed block: 32 sequences decoding one token each store at most
    one block each (when a block fills), and evict at most as many."""
    m = KVCacheManager(32 * 6, BS)
    m.enable_kv_events()
    for seq in range(32):
        m.allocate(seq, [seq] * (2 * BS - 1), computed=False)
        m.mark_computed(seq, 2 * BS - 1)
    m.take_kv_events()
    for step in range(3 * BS):
        for seq in range(32):
            m.append(seq, [step])
            m.mark_computed(seq, m.num_tokens(seq))
        assert len(m.take_kv_events()) <= 2 * 32
