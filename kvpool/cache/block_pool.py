"""The pool of physical blocks: free queue, prefix index, reference counts and counters.

Verbs, like a page allocator's: ``take_new`` (evicting the least recently used cached
block when needed), ``acquire`` (one more holder of a block, e.g. a cache hit),
``release`` (one holder less), ``write_tokens``, ``cache_full_block``, ``pin``/``unpin``,
``reset_prefix_cache``. Every one is O(1) per block; none scans the pool.

Invariants:
- every block is in exactly one of three states: *in use* (``ref_count > 0``), *cached*
  (``ref_count == 0``, indexed: its KV is kept and findable), *free* (``ref_count == 0``,
  no content). ``num_used + num_cached + num_free == num_blocks``.
- cached and free blocks are exactly the blocks of the free queue; in-use blocks are never
  in it, so eviction can only ever touch unreferenced (and therefore unpinned) blocks.
- the counters below always equal what a full scan of the blocks would give, and so does
  ``states`` (the block map, one byte a block: ``block_map.code_of``).
"""

from __future__ import annotations

from collections.abc import Callable

from kvpool.cache.block import Block, FreeBlockQueue
from kvpool.cache.block_map import code_of
from kvpool.cache.events import BlockPinned, BlockUnpinned
from kvpool.cache.hashing import BlockHash
from kvpool.cache.prefix_index import PrefixIndex


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int, *, max_pinned_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.max_pinned_blocks = max_pinned_blocks
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.index = PrefixIndex()
        # Counters, kept on state transitions (see the module docstring).
        self.num_used = 0  # ref_count > 0
        self.num_shared = 0  # ref_count > 1
        self.num_cached = 0  # ref_count == 0 and indexed
        self.num_pinned = 0  # pin_count > 0
        self.filled_slots_used = 0  # tokens held by in-use blocks
        self.num_empty_used = 0  # in-use blocks holding no token yet (reserved ahead)
        self.evictions = 0
        self.states = bytearray(num_blocks)  # block_map codes, kept on every transition
        # Called with each cached block take_new evicts, before its content is forgotten
        # (the manager hands it to a second tier).
        self.on_evict: Callable[[Block], None] | None = None

    @property
    def num_free(self) -> int:
        """Blocks that can be taken now: truly free ones plus evictable cached ones."""
        return len(self.free_queue)

    # -- taking and returning blocks -------------------------------------------------
    def take_new(self, n: int) -> list[Block]:
        """``n`` empty blocks with one reference each. The caller checked ``num_free``."""
        assert n <= len(self.free_queue), "take_new beyond the free queue"
        taken = []
        for _ in range(n):
            block = self.free_queue.pop_head()
            if block.indexed:
                if self.on_evict is not None:
                    self.on_evict(block)
                self.index.remove(block)
                self.num_cached -= 1
                self.evictions += 1
            block.forget_content()
            block.ref_count = 1
            self.num_used += 1
            self.num_empty_used += 1
            self.states[block.block_id] = 1
            taken.append(block)
        return taken

    def acquire(self, block: Block) -> None:
        """One more holder of an existing block (a cache hit, a fork, a pin)."""
        if block.ref_count == 0:
            self.free_queue.remove(block)
            if block.indexed:
                self.num_cached -= 1
            self.num_used += 1
            self.filled_slots_used += len(block.token_ids)
            if not block.token_ids:
                self.num_empty_used += 1
        elif block.ref_count == 1:
            self.num_shared += 1
        block.ref_count += 1
        self.states[block.block_id] = code_of(block)

    def release(self, block: Block) -> None:
        """One holder less. At zero the block joins the free queue: as cached content at
        the tail when it is indexed (or can be), else emptied at the head."""
        assert block.ref_count > 0, f"release of unreferenced {block!r}"
        block.ref_count -= 1
        if block.ref_count == 1:
            self.num_shared -= 1
        if block.ref_count > 0:
            self.states[block.block_id] = code_of(block)
            return
        self.num_used -= 1
        self.filled_slots_used -= len(block.token_ids)
        if not block.token_ids:
            self.num_empty_used -= 1
        if block.block_hash is not None and not block.indexed and not self._has_twin(block):
            # A duplicate of content that was computed twice, whose indexed twin has been
            # evicted meanwhile: this copy takes its place.
            self.index.insert(block)
        if block.indexed:
            self.num_cached += 1
            self.free_queue.push_tail(block)
        else:
            block.forget_content()
            self.free_queue.push_head(block)
        self.states[block.block_id] = code_of(block)

    def _has_twin(self, block: Block) -> bool:
        assert block.block_hash is not None
        twin = self.index.find(
            block.block_hash, block.parent_content_id, block.salt, block.token_ids
        )
        return twin is not None

    # -- content -----------------------------------------------------------------------
    def write_tokens(self, block: Block, token_ids: list[int]) -> None:
        """Record tokens written into an unshared, in-use, unhashed block."""
        assert block.ref_count == 1 and block.block_hash is None
        assert len(block.token_ids) + len(token_ids) <= self.block_size
        if not block.token_ids and token_ids:
            self.num_empty_used -= 1
        block.token_ids.extend(token_ids)
        self.filled_slots_used += len(token_ids)

    def cache_full_block(
        self,
        block: Block,
        key: BlockHash,
        parent_content_id: int,
        salt: bytes,
        parent_key: BlockHash | None = None,
        position: int = -1,
    ) -> None:
        """Give a full, computed block its key and content id and index it, unless the
        same content is indexed already (then it shares that content id). ``position``:
        its place in the chain (shown by the block map, used by nothing else)."""
        assert len(block.token_ids) == self.block_size and block.block_hash is None
        block.block_hash = key
        block.position = position
        block.parent_hash = parent_key
        block.parent_content_id = parent_content_id
        block.salt = salt
        existing = self.index.find(key, parent_content_id, salt, block.token_ids)
        if existing is not None:
            block.content_id = existing.content_id
        else:
            block.content_id = self.index.new_content_id()
            self.index.insert(block)
            self.states[block.block_id] = code_of(block)

    def lookup(
        self, key: BlockHash, parent_content_id: int, salt: bytes, token_ids: list[int]
    ) -> Block | None:
        return self.index.find(key, parent_content_id, salt, token_ids)

    # -- pins --------------------------------------------------------------------------
    def pin(self, block: Block) -> None:
        self.acquire(block)
        if block.pin_count == 0:
            self.num_pinned += 1
            if self.index.events is not None and block.block_hash is not None:
                self.index.events.append(BlockPinned(block.block_hash))
        block.pin_count += 1
        self.states[block.block_id] = code_of(block)

    def unpin(self, block: Block) -> None:
        assert block.pin_count > 0
        block.pin_count -= 1
        if block.pin_count == 0:
            self.num_pinned -= 1
            if self.index.events is not None and block.block_hash is not None:
                self.index.events.append(BlockUnpinned(block.block_hash))
        self.release(block)

    def reset_prefix_cache(self) -> int:
        """Forget every cached (unreferenced) block's content; returns how many."""
        dropped = 0
        for block in self.free_queue:
            if block.indexed:
                self.index.remove(block)
                block.forget_content()
                self.states[block.block_id] = 0
                dropped += 1
        self.num_cached = 0
        return dropped
