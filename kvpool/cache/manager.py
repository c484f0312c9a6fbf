"""``KVCacheManager``: sequences on top of the block pool.

It maps each sequence to a block table, takes blocks on demand as the sequence grows,
shares cached prefixes between sequences, forks sequences with copy-on-write, and pins
system prompts. It manages block ids and token ids only; the model runtime owns the KV
tensors and performs the copies this manager reports.

Contract with the runtime:
- ``allocate`` and ``append`` record tokens and return where their KV goes. A full block
  enters the prefix index once its KV is *computed*: by default at once (``computed=True``,
  for callers that compute in the same step); a caller that computes later (chunked
  prefill) passes ``computed=False`` and calls ``mark_computed`` when the KV is written.
- Every call either succeeds whole or raises with the manager unchanged (``OutOfBlocks``
  is checked before anything is taken).
- The manager is not thread-safe: one owner (the engine's scheduler) calls it.
- With a second tier (``tier``), evicted cached blocks and blocks found in the tier
  become ``TierEvent``s, in the order they happened: the runtime takes them
  (``take_tier_events``) before its next forward pass and, in that order, copies an
  evicted block's bytes out to the tier or a found block's bytes into the pool. A block
  found in the tier is indexed and counted as cached at once (its bytes were verified
  when found), so the events must be applied before any step reads the blocks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from kvpool.cache.block import Block
from kvpool.cache.block_pool import BlockPool
from kvpool.cache.errors import (
    NotPinned,
    OutOfBlocks,
    PinLimitExceeded,
    SequenceExists,
    UnknownSequence,
)
from kvpool.cache.events import KVEvent
from kvpool.cache.geometry import ModelGeometry
from kvpool.cache.hashing import BlockHash, HashFn, Salt, hash_block, salt_bytes
from kvpool.cache.stats import CacheStats
from kvpool.cache.tier import ROOT_DIGEST, KVTier, Payload, prefix_digest

SeqId = int | str


@dataclass(frozen=True)
class Allocation:
    """Where a new sequence's prompt lives: its block table and how many of its first
    tokens were found in the cache (their KV need not be computed)."""

    block_ids: list[int]
    num_cached_tokens: int


@dataclass(frozen=True)
class PinInfo:
    """One pin: the prefix's tokens, the salt it was pinned under (``b""``: none, as for
    a prefix shared by every tenant) and the full blocks it holds."""

    salt: bytes
    token_ids: tuple[int, ...]
    num_blocks: int


@dataclass(frozen=True, slots=True)
class TierEvent:
    """For the runtime, in order: ``payload is None``: block ``block_id`` was evicted
    from the pool holding the prefix ``digest`` (its bytes go to the tier, under that
    digest, salt and tokens); otherwise ``payload`` (found in the tier, verified) goes
    into block ``block_id``."""

    block_id: int
    digest: bytes
    salt: bytes
    token_ids: tuple[int, ...]
    payload: Payload | None = None


@dataclass(slots=True)
class _Sequence:
    blocks: list[Block]
    num_tokens: int
    num_computed: int
    num_hashed_blocks: int  # leading blocks that carry a key (full and computed)
    salt: bytes
    lookup_keys: list[BlockHash] = field(default_factory=list)  # keys hashed at allocate
    public_blocks: int = 0  # leading blocks keyed without the salt (a shared prefix)

    def salt_of(self, index: int) -> bytes:
        return b"" if index < self.public_blocks else self.salt


class KVCacheManager:
    """Paged KV-cache block manager with prefix reuse. See the module docstring.

    Args:
        num_blocks: physical blocks in the pool.
        block_size: token slots per block.
        enable_prefix_caching: index full blocks and reuse them across sequences.
        max_pinned_fraction: share of the pool that pins may hold at most.
        geometry: the model's KV geometry, for byte figures in ``stats``.
        hash_fn: the block key function (tests inject a weak one).
        tier: a second tier (``kvpool.cache.tier``): evicted cached blocks are offered
            to it and prefix lookups continue into it (see ``TierEvent``).
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        enable_prefix_caching: bool = True,
        max_pinned_fraction: float = 0.5,
        geometry: ModelGeometry | None = None,
        hash_fn: HashFn = hash_block,
        tier: KVTier | None = None,
    ) -> None:
        if not 0.0 <= max_pinned_fraction <= 1.0:
            raise ValueError(f"max_pinned_fraction must be in [0, 1], got {max_pinned_fraction}")
        self.pool = BlockPool(
            num_blocks, block_size, max_pinned_blocks=int(num_blocks * max_pinned_fraction)
        )
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.geometry = geometry
        self._hash = hash_fn
        self._seqs: dict[SeqId, _Sequence] = {}
        self._pins: dict[tuple[bytes, tuple[int, ...]], list[Block]] = {}
        self._lookups = 0
        self._query_tokens = 0
        self._hit_tokens = 0
        self._cow_copies = 0
        self.tier = tier if enable_prefix_caching else None
        self._tier_events: list[TierEvent] = []
        self._tier_hit_tokens = 0
        if self.tier is not None:
            self.pool.on_evict = self._on_evict

    # -- the second tier ---------------------------------------------------------------
    def take_tier_events(self) -> list[TierEvent]:
        """The tier's work since the last call, in order (see ``TierEvent``)."""
        events, self._tier_events = self._tier_events, []
        return events

    def offer_all_to_tier(self) -> None:
        """Every indexed block (cached, in use or pinned) as an eviction event, least
        recently used first: at shutdown, so what the pool holds outlives the process."""
        if self.tier is None:
            return
        cached = [b for b in self.pool.free_queue if b.indexed]
        held = [b for b in self.pool.blocks if b.indexed and b.ref_count > 0]
        for block in cached + held:
            self._on_evict(block)

    def detach_tier(self) -> None:
        """Work without the tier from now on (it was closed)."""
        self.tier = None
        self.pool.on_evict = None
        self._tier_events = []

    @property
    def tier_hit_tokens(self) -> int:
        """Prompt tokens found in the tier (loaded, not computed) since the start."""
        return self._tier_hit_tokens

    def _on_evict(self, block: Block) -> None:
        if block.digest is not None:
            self._tier_events.append(
                TierEvent(block.block_id, block.digest, block.salt, tuple(block.token_ids))
            )

    def _match_tier(
        self,
        tokens: list[int],
        salt: bytes,
        hits: list[Block],
        keys: list[BlockHash],
        max_blocks: int,
        public_blocks: int,
        *,
        fetch: bool = True,
    ) -> list[tuple[list[int], BlockHash, bytes, bytes, Payload | None]]:
        """The blocks after the pool's ``hits`` found in the tier, in a row: ``(tokens,
        key, digest, salt, payload)`` each (payloads fetched and verified, or None
        without ``fetch``). ``keys`` grows by the keys hashed here."""
        tier = self.tier
        if tier is None or len(hits) >= max_blocks:
            return []
        bs = self.block_size
        digest = hits[-1].digest if hits else ROOT_DIGEST  # it chains the whole prefix
        if digest is None:  # (a block cached before the tier was there)
            return []
        found: list[tuple[list[int], BlockHash, bytes, bytes, Payload | None]] = []
        for i in range(len(hits), max_blocks):
            chunk = tokens[i * bs : (i + 1) * bs]
            block_salt = b"" if i < public_blocks else salt
            digest = prefix_digest(digest, block_salt, chunk)
            if i >= len(keys):
                keys.append(self._hash(keys[i - 1] if i else None, block_salt, chunk))
            if not tier.contains(digest):
                break
            payload = tier.fetch(digest, block_salt, chunk) if fetch else None
            if fetch and payload is None:
                break
            found.append((chunk, keys[i], digest, block_salt, payload))
        return found

    # -- queries -----------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        """Blocks available to new work: free ones plus evictable cached ones."""
        return self.pool.num_free

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= self.pool.num_free

    def has_sequence(self, seq_id: SeqId) -> bool:
        return seq_id in self._seqs

    def block_table(self, seq_id: SeqId) -> list[int]:
        return [block.block_id for block in self._seq(seq_id).blocks]

    def num_tokens(self, seq_id: SeqId) -> int:
        return self._seq(seq_id).num_tokens

    def num_computed_tokens(self, seq_id: SeqId) -> int:
        return self._seq(seq_id).num_computed

    def sequence_tokens(self, seq_id: SeqId) -> list[int]:
        """The sequence's tokens, read back through its block table."""
        seq = self._seq(seq_id)
        tokens: list[int] = []
        for block in seq.blocks:
            tokens.extend(block.token_ids)
        return tokens[: seq.num_tokens]

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def count_cached_tokens(
        self, token_ids: Sequence[int], salt: Salt = None, *, public_tokens: int = 0
    ) -> int:
        """How many leading tokens ``allocate`` would find cached now (no side effects)."""
        tokens = list(token_ids)
        max_blocks = (len(tokens) - 1) // self.block_size
        public = public_tokens // self.block_size
        salt_b = salt_bytes(salt)
        hits, keys = self._match_prefix(tokens, salt_b, max_blocks, public)
        tiered = self._match_tier(tokens, salt_b, hits, keys, max_blocks, public, fetch=False)
        return (len(hits) + len(tiered)) * self.block_size

    # -- sequence lifecycle --------------------------------------------------------------
    def allocate(
        self,
        seq_id: SeqId,
        token_ids: Sequence[int],
        salt: Salt = None,
        *,
        computed: bool = True,
        reserve_tokens: int = 0,
        keep_free: int = 0,
        public_tokens: int = 0,
        lookup: bool = True,
    ) -> Allocation:
        """Blocks for a new sequence's prompt: cached full blocks of its longest cached
        prefix, new blocks for the rest. Nothing is taken for future output unless
        ``reserve_tokens`` asks for it (the ``static`` policy's up-front reservation).

        The hit stops short of the block holding the last prompt token, so that token is
        always computed, into a block the sequence owns.

        ``keep_free`` is an admission watermark: the call fails (``OutOfBlocks``) unless
        that many blocks stay available afterwards, for the running sequences to grow.

        ``public_tokens``: the tokens' first full blocks within this many tokens are keyed
        without the salt, as if by no tenant (a prefix declared shared across tenants,
        e.g. a pinned system prompt); every later block carries the salt, and its key
        chains from the public blocks, so what follows the shared prefix stays private.

        ``lookup=False``: no cached prefix is used (every token is computed: a prompt
        scored position by position); the blocks still enter the index once computed.
        """
        if seq_id in self._seqs:
            raise SequenceExists(seq_id)
        tokens = list(token_ids)
        if not tokens:
            raise ValueError("cannot allocate a sequence with no tokens")
        bs = self.block_size
        salt_b = salt_bytes(salt)
        public = public_tokens // bs if salt_b else 0
        hits: list[Block] = []
        keys: list[BlockHash] = []
        tiered: list[tuple[list[int], BlockHash, bytes, bytes, Payload | None]] = []
        max_blocks = (len(tokens) - 1) // bs
        if self.enable_prefix_caching and lookup:
            hits, keys = self._match_prefix(tokens, salt_b, max_blocks, public)
        num_new = self.blocks_needed(max(len(tokens), reserve_tokens)) - len(hits)
        available = self.pool.num_free - sum(1 for block in hits if block.ref_count == 0)
        if num_new + keep_free > available:
            raise OutOfBlocks(num_new + keep_free, available, "allocate")
        # Blocks found in the tier take new blocks like computed ones, so they do not
        # change the count above; they are read (and verified) only once it has passed:
        # a request that waits for room is not read again at every step.
        tiered = self._match_tier(tokens, salt_b, hits, keys, max_blocks, public) if lookup else []

        for block in hits:
            self.pool.acquire(block)
        new_blocks = self.pool.take_new(num_new)
        start = len(hits) * bs
        for i, block in enumerate(new_blocks):
            chunk = tokens[start + i * bs : start + (i + 1) * bs]
            if chunk:
                self.pool.write_tokens(block, chunk)
        # Blocks found in the tier: cached at once, their bytes loaded before the next step.
        parent = hits[-1] if hits else None
        for position, (block, (chunk, key, digest, block_salt, payload)) in enumerate(
            zip(new_blocks, tiered, strict=False), start=len(hits)
        ):
            parent_cid = parent.content_id if parent is not None else -1
            parent_key = parent.block_hash if parent is not None else None
            self.pool.cache_full_block(block, key, parent_cid, block_salt, parent_key, position)
            block.digest = digest
            assert payload is not None
            self._tier_events.append(
                TierEvent(block.block_id, digest, block_salt, tuple(chunk), payload)
            )
            parent = block
        num_cached = (len(hits) + len(tiered)) * bs
        self._tier_hit_tokens += len(tiered) * bs
        seq = _Sequence(
            blocks=hits + new_blocks,
            num_tokens=len(tokens),
            num_computed=len(tokens) if computed else num_cached,
            num_hashed_blocks=len(hits) + len(tiered),
            salt=salt_b,
            lookup_keys=keys,
            public_blocks=public,
        )
        self._seqs[seq_id] = seq
        if self.enable_prefix_caching:
            self._lookups += 1
            self._query_tokens += len(tokens)
            self._hit_tokens += num_cached
            self._cache_computed_blocks(seq)
        return Allocation([block.block_id for block in seq.blocks], num_cached)

    def append(
        self, seq_id: SeqId, token_ids: Sequence[int], *, computed: bool = True
    ) -> list[tuple[int, int]]:
        """Extend a sequence by ``token_ids``; a new block is taken only when the last one
        is full. Returns the copy-on-write copies ``(src, dst)`` the runtime must perform
        before writing: a shared partially filled block is copied to a fresh one first."""
        seq = self._seq(seq_id)
        tokens = list(token_ids)
        if not tokens:
            return []
        bs = self.block_size
        first = seq.num_tokens // bs
        last = (seq.num_tokens + len(tokens) - 1) // bs
        needed = 0
        for i in range(first, last + 1):
            if i >= len(seq.blocks) or seq.blocks[i].ref_count > 1:
                needed += 1
        if needed > self.pool.num_free:
            raise OutOfBlocks(needed, self.pool.num_free, "append")

        copies: list[tuple[int, int]] = []
        pos = seq.num_tokens
        for i in range(first, last + 1):
            if i >= len(seq.blocks):
                seq.blocks.append(self.pool.take_new(1)[0])
            elif seq.blocks[i].ref_count > 1:
                shared = seq.blocks[i]
                (copy,) = self.pool.take_new(1)
                self.pool.write_tokens(copy, list(shared.token_ids))
                self.pool.release(shared)
                seq.blocks[i] = copy
                copies.append((shared.block_id, copy.block_id))
                self._cow_copies += 1
            take = min(bs * (i + 1), seq.num_tokens + len(tokens)) - pos
            offset = pos - seq.num_tokens
            self.pool.write_tokens(seq.blocks[i], tokens[offset : offset + take])
            pos += take
        seq.num_tokens = pos
        if computed:
            seq.num_computed = seq.num_tokens
            self._cache_computed_blocks(seq)
        return copies

    def mark_computed(self, seq_id: SeqId, num_tokens: int) -> None:
        """The KV of the sequence's first ``num_tokens`` tokens is written: its full blocks
        among them become findable by other sequences."""
        seq = self._seq(seq_id)
        seq.num_computed = max(seq.num_computed, min(num_tokens, seq.num_tokens))
        self._cache_computed_blocks(seq)

    def fork(self, parent_id: SeqId, child_id: SeqId) -> None:
        """The child shares every block of the parent (one more reference each). The first
        write into a shared partial block copies it (see ``append``)."""
        parent = self._seq(parent_id)
        if child_id in self._seqs:
            raise SequenceExists(child_id)
        for block in parent.blocks:
            self.pool.acquire(block)
        self._seqs[child_id] = _Sequence(
            blocks=list(parent.blocks),
            num_tokens=parent.num_tokens,
            num_computed=parent.num_computed,
            num_hashed_blocks=parent.num_hashed_blocks,
            salt=parent.salt,
            lookup_keys=parent.lookup_keys,
            public_blocks=parent.public_blocks,
        )

    def free(self, seq_id: SeqId) -> None:
        """Drop the sequence's references. Blocks that reach zero keep their content and
        key and stay findable until reused; they are released last block first, so the
        LRU order evicts a prefix chain's tail before its head."""
        seq = self._seqs.pop(seq_id, None)
        if seq is None:
            raise UnknownSequence(seq_id)
        for block in reversed(seq.blocks):
            self.pool.release(block)

    # -- KV events (kvpool.cache.events) --------------------------------------------------
    def enable_kv_events(self) -> None:
        """Start recording what the prefix index gains and loses (for a router)."""
        if self.pool.index.events is None:
            self.pool.index.events = []

    def take_kv_events(self) -> list[KVEvent]:
        """The events since the last call, in order (empty when not enabled)."""
        events = self.pool.index.events
        if not events:
            return []
        self.pool.index.events = []
        return events

    def cached_block_hashes(self) -> set[int]:
        """The keys of every findable block: what a router's copy must equal."""
        return {b.block_hash for b in self.pool.blocks if b.indexed and b.block_hash is not None}

    # -- pins ----------------------------------------------------------------------------
    def pin(
        self, token_ids: Sequence[int], salt: Salt = None, *, max_salt_blocks: int | None = None
    ) -> int:
        """Pin the cached full blocks of ``token_ids``'s longest cached prefix so they are
        never evicted. Returns the number of tokens pinned (0 if nothing was cached: the
        caller computes the prefix first, e.g. by running it as a sequence). Pinning the
        same tokens again is a no-op.

        Two caps, checked before anything is pinned (``PinLimitExceeded``): the pool's
        (``max_pinned_fraction``) and, with ``max_salt_blocks``, the blocks that this
        salt's pins may hold together (a tenant's share of the pin budget)."""
        tokens = list(token_ids)
        salt_b = salt_bytes(salt)
        key = (salt_b, tuple(tokens))
        if key in self._pins:
            return len(self._pins[key]) * self.block_size
        hits, _ = self._match_prefix(tokens, salt_b, len(tokens) // self.block_size)
        if not hits:
            return 0
        if max_salt_blocks is not None:
            held = self._salt_pinned_blocks(salt_b)
            more = sum(1 for block in hits if block.block_id not in held)
            if len(held) + more > max_salt_blocks:
                raise PinLimitExceeded(more, len(held), max_salt_blocks, "this tenant's ")
        newly_pinned = sum(1 for block in hits if block.pin_count == 0)
        if self.pool.num_pinned + newly_pinned > self.pool.max_pinned_blocks:
            raise PinLimitExceeded(newly_pinned, self.pool.num_pinned, self.pool.max_pinned_blocks)
        for block in hits:
            self.pool.pin(block)
        self._pins[key] = hits
        return len(hits) * self.block_size

    def pins(self) -> list[PinInfo]:
        """Every pin, in the order they were made."""
        return [PinInfo(salt, tokens, len(blocks)) for (salt, tokens), blocks in self._pins.items()]

    def pinned_blocks_of(self, salt: Salt) -> int:
        """Distinct blocks held by the pins made under ``salt``."""
        return len(self._salt_pinned_blocks(salt_bytes(salt)))

    def _salt_pinned_blocks(self, salt: bytes) -> set[int]:
        return {b.block_id for (s, _), blocks in self._pins.items() if s == salt for b in blocks}

    def unpin(self, token_ids: Sequence[int], salt: Salt = None) -> None:
        """Undo ``pin`` of the same tokens and salt; the blocks stay cached, evictable."""
        blocks = self._pins.pop((salt_bytes(salt), tuple(token_ids)), None)
        if blocks is None:
            raise NotPinned()
        for block in reversed(blocks):
            self.pool.unpin(block)

    def reset_prefix_cache(self, *, unpin: bool = False) -> int:
        """Forget all cached content not in use or pinned; returns the blocks dropped.
        With ``unpin``, every pin is dropped first (its blocks then go too)."""
        if unpin:
            for salt, tokens in list(self._pins):
                self.unpin(tokens, salt)
        return self.pool.reset_prefix_cache()

    # -- measurement ---------------------------------------------------------------------
    def stats(self) -> CacheStats:
        pool = self.pool
        per_block = self.geometry.bytes_per_block(self.block_size) if self.geometry else 0
        reserved = pool.num_empty_used * self.block_size
        return CacheStats(
            block_size=self.block_size,
            total_blocks=pool.num_blocks,
            free_blocks=pool.num_free - pool.num_cached,
            cached_blocks=pool.num_cached,
            used_blocks=pool.num_used,
            shared_blocks=pool.num_shared,
            pinned_blocks=pool.num_pinned,
            num_sequences=len(self._seqs),
            bytes_per_block=per_block,
            total_bytes=pool.num_blocks * per_block,
            used_bytes=pool.num_used * per_block,
            cached_bytes=pool.num_cached * per_block,
            prefix_lookups=self._lookups,
            prefix_query_tokens=self._query_tokens,
            prefix_hit_tokens=self._hit_tokens,
            evictions=pool.evictions,
            cow_copies=self._cow_copies,
            filled_slots=pool.filled_slots_used,
            waste_slots_internal=pool.num_used * self.block_size
            - pool.filled_slots_used
            - reserved,
            waste_slots_reserved=reserved,
        )

    # -- internals -----------------------------------------------------------------------
    def _seq(self, seq_id: SeqId) -> _Sequence:
        try:
            return self._seqs[seq_id]
        except KeyError:
            raise UnknownSequence(seq_id) from None

    def _match_prefix(
        self, tokens: list[int], salt: bytes, max_blocks: int, public_blocks: int = 0
    ) -> tuple[list[Block], list[BlockHash]]:
        """The longest chain of indexed blocks holding ``tokens``' first full blocks (at
        most ``max_blocks``), and the keys hashed on the way (one per block looked up,
        the first miss included, for reuse when the sequence's own blocks are cached).
        The first ``public_blocks`` are looked up without the salt."""
        bs = self.block_size
        hits: list[Block] = []
        keys: list[BlockHash] = []
        parent_key: BlockHash | None = None
        parent_cid = -1
        for i in range(max_blocks):
            chunk = tokens[i * bs : (i + 1) * bs]
            block_salt = b"" if i < public_blocks else salt
            key = self._hash(parent_key, block_salt, chunk)
            keys.append(key)
            block = self.pool.lookup(key, parent_cid, block_salt, chunk)
            if block is None:
                break
            hits.append(block)
            parent_key, parent_cid = key, block.content_id
        return hits, keys

    def _cache_computed_blocks(self, seq: _Sequence) -> None:
        """Give each newly full and computed block its key, chained from its parent."""
        if not self.enable_prefix_caching:
            return
        full = min(seq.num_computed // self.block_size, len(seq.blocks))
        for i in range(seq.num_hashed_blocks, full):
            block = seq.blocks[i]
            if len(block.token_ids) < self.block_size:
                break
            if block.block_hash is not None:  # shared with a fork that cached it first
                seq.num_hashed_blocks = i + 1
                continue
            parent = seq.blocks[i - 1] if i > 0 else None
            parent_key = parent.block_hash if parent is not None else None
            if i < len(seq.lookup_keys):
                key = seq.lookup_keys[i]
            else:
                key = self._hash(parent_key, seq.salt_of(i), block.token_ids)
            parent_cid = parent.content_id if parent is not None else -1
            self.pool.cache_full_block(block, key, parent_cid, seq.salt_of(i), parent_key, i)
            if self.tier is not None:
                parent_digest = parent.digest if parent is not None else ROOT_DIGEST
                if parent_digest is not None:
                    block.digest = prefix_digest(parent_digest, seq.salt_of(i), block.token_ids)
            seq.num_hashed_blocks = i + 1
        if seq.num_hashed_blocks >= len(seq.lookup_keys):
            seq.lookup_keys = []
