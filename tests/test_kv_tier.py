"""The second KV tier (``kvpool.cache.tier``): its files, its index, and the block
manager's use of it (evicted blocks offered in order, lookups continuing into it), with
the runtime emulated by a dict of block bytes; then the engine over a real pool."""

from __future__ import annotations

import hashlib
import logging
import random

import pytest

from kvpool.cache import KVCacheManager
from kvpool.cache.tier import (
    ROOT_DIGEST,
    DiskTier,
    MemoryTier,
    TierIdentity,
    decode_block,
    encode_block,
    prefix_digest,
)

BLOCK_BYTES = 64


def _identity(model: str = "m") -> TierIdentity:
    return TierIdentity(model, "float32", 2, 1, 4, "fp32", 4, BLOCK_BYTES)


def _payload(digest: bytes) -> bytes:
    """What a block holding the prefix ``digest`` holds: a function of that prefix only."""
    return hashlib.blake2b(digest, digest_size=BLOCK_BYTES).digest()


def test_a_block_file_decodes_to_what_was_encoded_and_any_flipped_byte_is_refused():
    digest = prefix_digest(ROOT_DIGEST, b"tenant", [1, 2, 3, 4])
    data = encode_block(digest, b"tenant", [1, 2, 3, 4], _payload(digest))
    assert decode_block(data) == (digest, b"tenant", [1, 2, 3, 4], _payload(digest))
    for at in range(0, len(data), 7):
        bad = bytearray(data)
        bad[at] ^= 0x10
        assert decode_block(bytes(bad)) is None
    assert decode_block(data[:-1]) is None


def test_digests_name_the_whole_prefix_and_the_salt():
    a = prefix_digest(ROOT_DIGEST, b"", [1, 2])
    assert prefix_digest(a, b"", [3, 4]) != prefix_digest(
        prefix_digest(ROOT_DIGEST, b"", [1, 5]), b"", [3, 4]
    )
    assert prefix_digest(ROOT_DIGEST, b"x", [1, 2]) != a


@pytest.mark.parametrize("kind", ["memory", "disk"])
def test_a_tier_keeps_its_size_drops_least_recently_used_first_and_verifies(kind, tmp_path):
    entry = (
        BLOCK_BYTES if kind == "memory" else len(encode_block(b"\0" * 16, b"", [0] * 4, b"\0" * 64))
    )
    tier = (
        MemoryTier(3 * entry, BLOCK_BYTES)
        if kind == "memory"
        else DiskTier(tmp_path, 3 * entry, _identity())
    )
    digests = [prefix_digest(ROOT_DIGEST, b"", [i] * 4) for i in range(5)]
    for i, d in enumerate(digests[:3]):
        tier.put(d, b"", [i] * 4, _payload(d))
    tier.flush()
    assert tier.fetch(digests[0], b"", [0] * 4) == _payload(digests[0])  # 0 is now recent
    tier.put(digests[3], b"", [3] * 4, _payload(digests[3]))
    tier.flush()
    assert [tier.contains(d) for d in digests[:4]] == [True, False, True, True]
    stats = tier.stats()
    assert stats.blocks == 3 and stats.bytes <= 3 * entry and stats.evictions == 1
    # the caller's salt and tokens must match the entry's, not only the digest
    assert tier.fetch(digests[2], b"other", [2] * 4) is None
    assert not tier.contains(digests[2]) and tier.stats().refused == 1
    assert tier.fetch(digests[3], b"", [3] * 4) == _payload(digests[3])
    assert tier.clear() == 2 and tier.stats().blocks == 0
    tier.close()


def test_a_disk_tier_reopens_its_blocks_and_never_serves_a_damaged_one(tmp_path, caplog):
    tier = DiskTier(tmp_path, 1 << 20, _identity())
    digests = [prefix_digest(ROOT_DIGEST, b"", [i] * 4) for i in range(4)]
    for i, d in enumerate(digests):
        tier.put(d, b"", [i] * 4, _payload(d))
    tier.save_pins([{"tokens": [1, 2], "salt": None, "shared": False}])
    tier.close()
    blocks = tmp_path / _identity().digest() / "blocks"
    damaged = blocks / f"{digests[1].hex()}.kvb"
    data = bytearray(damaged.read_bytes())
    data[len(data) // 2] ^= 1  # a flipped byte in the payload
    damaged.write_bytes(bytes(data))
    torn = blocks / f"{digests[2].hex()}.kvb"
    torn.write_bytes(torn.read_bytes()[:50])  # a write cut short
    (blocks / f".{digests[3].hex()}.kvb.1.1.tmp").write_bytes(b"partial")  # killed mid-write
    again = DiskTier(tmp_path, 1 << 20, _identity())
    assert not list(blocks.glob("*.tmp"))
    assert again.load_pins() == [{"tokens": [1, 2], "salt": None, "shared": False}]
    assert again.fetch(digests[0], b"", [0] * 4) == _payload(digests[0])
    with caplog.at_level(logging.WARNING, logger="kvpool.tier"):
        assert again.fetch(digests[1], b"", [1] * 4) is None
        assert again.fetch(digests[2], b"", [2] * 4) is None
    assert again.stats().refused == 2 and not damaged.exists() and not torn.exists()
    assert "did not verify" in caplog.text
    again.close()


def test_a_tier_of_another_model_or_setting_is_ignored_with_a_warning(tmp_path, caplog):
    tier = DiskTier(tmp_path, 1 << 20, _identity("model-a"))
    d = prefix_digest(ROOT_DIGEST, b"", [1] * 4)
    tier.put(d, b"", [1] * 4, _payload(d))
    tier.close()
    with caplog.at_level(logging.WARNING, logger="kvpool.tier"):
        other = DiskTier(tmp_path, 1 << 20, _identity("model-b"))
    assert not other.contains(d) and "ignored" in caplog.text
    other.close()
    assert DiskTier(tmp_path, 1 << 20, _identity("model-a")).contains(d)


class _Runtime:
    """The runtime's part, emulated: block bytes by block id. Computing a block writes
    the bytes of its prefix (``_payload``); tier events move bytes as the engine does."""

    def __init__(self, manager: KVCacheManager) -> None:
        self.manager = manager
        self.store: dict[int, bytes] = {}

    def apply(self) -> None:
        tier = self.manager.tier
        for event in self.manager.take_tier_events():
            if event.payload is None:
                # the evicted block still holds its prefix's bytes (nothing ran since)
                assert self.store[event.block_id] == _payload(event.digest)
                tier.put(event.digest, event.salt, event.token_ids, self.store[event.block_id])
            else:
                self.store[event.block_id] = event.payload

    def compute(self, seq, cached_tokens: int) -> None:
        """The forward pass: the blocks after the cached ones get their prefix's bytes;
        the cached ones (pool or tier) must hold theirs already."""
        cached = cached_tokens // self.manager.block_size
        for i, block_id in enumerate(self.manager.block_table(seq)):
            block = self.manager.pool.blocks[block_id]
            if block.digest is None:
                continue
            if i < cached:
                assert self.store[block_id] == _payload(block.digest)
            else:
                self.store[block_id] = _payload(block.digest)


def test_random_operations_never_load_another_prefixs_bytes():
    """Sequences of prompts drawn from a few shared beginnings, under two salts, in a
    pool far smaller than their working set, with a tier behind it: every block found
    (pool or tier) holds exactly its prefix's bytes, and the tier's hits are real."""
    rng = random.Random(7)
    tier = MemoryTier(400 * BLOCK_BYTES, BLOCK_BYTES)
    manager = KVCacheManager(24, 4, tier=tier)
    runtime = _Runtime(manager)
    stems = [[rng.randrange(50) for _ in range(12)] for _ in range(4)]
    live: list[int] = []
    for seq in range(300):
        if live and (len(live) > 3 or rng.random() < 0.4):
            victim = live.pop(rng.randrange(len(live)))
            manager.free(victim)
            runtime.apply()
            continue
        prompt = rng.choice(stems) + [rng.randrange(50) for _ in range(rng.randrange(0, 9))]
        salt = rng.choice([None, "tenant-b"])
        try:
            allocation = manager.allocate(seq, prompt, salt)
        except Exception:  # the pool is full: nothing changed
            continue
        runtime.apply()
        runtime.compute(seq, allocation.num_cached_tokens)  # checks the cached blocks
        live.append(seq)
    assert manager.tier_hit_tokens > 0 and tier.stats().writes > 0


def test_a_salted_prompt_never_loads_another_tenants_tier_blocks():
    tier = MemoryTier(100 * BLOCK_BYTES, BLOCK_BYTES)
    manager = KVCacheManager(4, 4, tier=tier)
    runtime = _Runtime(manager)
    prompt = list(range(13))
    manager.allocate("a", prompt, "tenant-a")
    runtime.apply()
    runtime.compute("a", 0)
    manager.free("a")
    manager.allocate("filler", list(range(100, 116)))  # evicts a's blocks into the tier
    runtime.apply()
    runtime.compute("filler", 0)
    manager.free("filler")
    assert tier.stats().blocks == 3
    assert manager.allocate("b", prompt, "tenant-b").num_cached_tokens == 0
    runtime.apply()
    runtime.compute("b", 0)
    manager.free("b")
    assert manager.allocate("a2", prompt, "tenant-a").num_cached_tokens == 12
    runtime.apply()
    runtime.compute("a2", 12)  # the loaded blocks hold tenant a's prefix
    assert manager.tier_hit_tokens == 12


# -- the engine over a real pool ------------------------------------------------------


def _docs(tokenizer, n: int, words: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    vocab = [
        "memory", "block", "cache", "river", "stone", "paper", "signal", "garden", "engine",
        "window", "orbit", "lantern", "harbor", "pencil", "meadow", "circuit", "violin",
    ]  # fmt: skip
    return [
        tokenizer.encode(" ".join(rng.choice(vocab) for _ in range(words)) + f" (document {i})")
        for i in range(n)
    ]


@pytest.mark.parametrize("kind", ["memory", "disk"])
def test_an_engine_with_a_tier_serves_revisited_prompts_from_it_with_the_same_tokens(
    kind, fp32_model, default_tokenizer, tmp_path
):
    torch = pytest.importorskip("torch")
    from kvpool.engine.engine import Engine
    from kvpool.engine.sampling import SamplingParams

    del torch
    docs = _docs(default_tokenizer, 4, 30, seed=1)  # ~65 tokens each; the pool holds ~1
    greedy = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    tier = (
        dict(kv_offload_memory=64 << 20) if kind == "memory" else dict(kv_offload_dir=str(tmp_path))
    )
    engine = Engine(fp32_model, num_blocks=6, **tier)
    first = [engine.generate([d], greedy)[0] for d in docs]
    second = [engine.generate([d], greedy)[0] for d in docs]
    assert [o.token_ids for o in second] == [o.token_ids for o in first]
    assert sum(o.cached_prompt_tokens for o in first) == 0
    prompt = sum(len(d) for d in docs)
    full_blocks = sum((len(d) - 1) // 16 * 16 for d in docs)
    assert sum(o.cached_prompt_tokens for o in second) == full_blocks > 0.8 * prompt
    stats = engine.tier_stats()
    assert stats.kind == kind and stats.hit_blocks * 16 == full_blocks and stats.refused == 0
    engine.close()
    without = Engine(fp32_model, num_blocks=6)
    for d in docs:
        without.generate([d], greedy)
    assert sum(without.generate([d], greedy)[0].cached_prompt_tokens for d in docs) == 0


def test_a_disk_tier_outlives_the_engine_and_refuses_damaged_blocks(
    fp32_model, default_tokenizer, tmp_path
):
    pytest.importorskip("torch")
    from kvpool.engine.engine import Engine
    from kvpool.engine.sampling import SamplingParams

    docs = _docs(default_tokenizer, 3, 30, seed=2)
    greedy = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    engine = Engine(fp32_model, num_blocks=6, kv_offload_dir=str(tmp_path))
    first = [engine.generate([d], greedy)[0].token_ids for d in docs]
    engine.generate([docs[0][:5]], greedy)  # a short prompt pushes the last doc out too
    engine.close()
    # a restart: the documents are hits
    engine = Engine(fp32_model, num_blocks=6, kv_offload_dir=str(tmp_path))
    again = [engine.generate([d], greedy)[0] for d in docs]
    assert [o.token_ids for o in again] == first
    assert all(o.cached_prompt_tokens > 0 for o in again)
    engine.close()
    # every block file damaged: nothing is served from the tier, the outputs stay right
    for path in tmp_path.glob("*/blocks/*.kvb"):
        data = bytearray(path.read_bytes())
        data[-40] ^= 0xFF
        path.write_bytes(bytes(data))
    engine = Engine(fp32_model, num_blocks=6, kv_offload_dir=str(tmp_path))
    damaged = [engine.generate([d], greedy)[0] for d in docs]
    assert [o.token_ids for o in damaged] == first
    assert sum(o.cached_prompt_tokens for o in damaged) == 0
    assert engine.tier_stats().refused >= len(docs)
    engine.close()


def test_pins_are_kept_with_a_disk_tier_and_pinned_again_on_start(
    fp32_model, default_tokenizer, tmp_path
):
    pytest.importorskip("torch")
    from kvpool.engine.engine import Engine

    system = default_tokenizer.encode("You answer questions about the tier. " * 6)
    engine = Engine(fp32_model, num_blocks=16, kv_offload_dir=str(tmp_path))
    engine.pin_prefix(system, salt="tenant-a")
    while engine.has_work():
        engine.step()
    assert [p.token_ids for p in engine.snapshot().pins] == [tuple(system)]
    engine.close()
    again = Engine(fp32_model, num_blocks=16, kv_offload_dir=str(tmp_path))
    while again.has_work():  # the saved pin, pinned again: its blocks come from the tier
        again.step()
    (pin,) = again.snapshot().pins
    assert pin.token_ids == tuple(system) and pin.salt == b"tenant-a"
    assert pin.num_blocks == len(system) // 16
    assert again.tier_stats().hit_tokens >= (len(system) - 1) // 16 * 16
    again.unpin_prefix(system, salt="tenant-a")
    again.close()
    assert Engine(fp32_model, num_blocks=16, kv_offload_dir=str(tmp_path)).snapshot().pins == ()
