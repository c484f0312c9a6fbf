"""The physical block record and the intrusive LRU queue of unreferenced blocks.

One ``Block`` exists per physical KV block, created once when the pool is built; nothing
on the hot path allocates block objects. The queue's links live inside the blocks
(``prev_free``/``next_free``) between two sentinels, so removing a block from the middle of
the queue (a cache hit on an unreferenced block) is O(1), as are push and pop.
"""

from __future__ import annotations

from collections.abc import Iterator

from kvpool.cache.hashing import BlockHash


class Block:
    """One physical block of ``block_size`` token slots.

    Invariants (kept by ``BlockPool``):
    - ``ref_count`` is the number of holders: sequences whose block table lists the block,
      plus pins. A block with ``ref_count > 0`` is never in the free queue and never evicted.
    - ``token_ids`` are the tokens whose KV the block holds, in slot order. A block with
      ``ref_count > 1`` is read-only: a writer copies it first (copy-on-write).
    - ``block_hash`` is set only on a full block whose KV is computed; ``content_id`` then
      names its content (the whole prefix up to and including it) and ``parent_content_id``
      the content of the block before it (``-1`` for a first block). ``indexed`` says whether
      this block is the one the prefix index returns for that content.
    - ``ref_count == 0`` blocks sit in the free queue; those that still carry a hash keep
      their KV and stay findable until they are taken for something else.
    """

    __slots__ = (
        "block_id",
        "ref_count",
        "pin_count",
        "token_ids",
        "block_hash",
        "content_id",
        "parent_content_id",
        "salt",
        "parent_hash",
        "digest",
        "position",
        "indexed",
        "next_same_hash",
        "prev_free",
        "next_free",
    )

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.pin_count = 0
        self.token_ids: list[int] = []
        self.block_hash: BlockHash | None = None
        self.content_id = -1
        self.parent_content_id = -1
        self.salt = b""
        self.parent_hash: BlockHash | None = None  # the previous block's key (KV events)
        self.digest: bytes | None = None  # the prefix digest, where a second tier is kept
        self.position = -1  # a hashed block's place in its chain (0: a prompt's first)
        self.indexed = False
        self.next_same_hash: Block | None = None  # collision chain inside the prefix index
        self.prev_free: Block | None = None
        self.next_free: Block | None = None

    def forget_content(self) -> None:
        """Drop what the block holds (it is about to be reused). Caller unindexes it first."""
        self.token_ids = []
        self.block_hash = None
        self.content_id = -1
        self.parent_content_id = -1
        self.salt = b""
        self.parent_hash = None
        self.digest = None
        self.position = -1

    def __repr__(self) -> str:
        return (
            f"Block({self.block_id}, ref={self.ref_count}, pins={self.pin_count}, "
            f"tokens={len(self.token_ids)}, hash={self.block_hash})"
        )


class FreeBlockQueue:
    """Doubly linked list of unreferenced blocks, least recently used at the head.

    Eviction takes from the head. Released blocks that hold cached content go to the tail
    (most recently used); blocks with nothing worth keeping go to the head, so they are
    reused before any cached content is lost.
    """

    __slots__ = ("_head", "_tail", "length")

    def __init__(self, blocks: list[Block]) -> None:
        self._head = Block(-1)
        self._tail = Block(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.length = 0
        for block in blocks:
            self.push_tail(block)

    def __len__(self) -> int:
        return self.length

    def __iter__(self) -> Iterator[Block]:
        node = self._head.next_free
        while node is not self._tail:
            assert node is not None
            yield node
            node = node.next_free

    def _link_between(self, block: Block, before: Block, after: Block) -> None:
        block.prev_free = before
        block.next_free = after
        before.next_free = block
        after.prev_free = block
        self.length += 1

    def push_tail(self, block: Block) -> None:
        before = self._tail.prev_free
        assert before is not None and block.prev_free is None
        self._link_between(block, before, self._tail)

    def push_head(self, block: Block) -> None:
        after = self._head.next_free
        assert after is not None and block.prev_free is None
        self._link_between(block, self._head, after)

    def pop_head(self) -> Block:
        block = self._head.next_free
        if block is self._tail or block is None:
            raise IndexError("free block queue is empty")
        self.remove(block)
        return block

    def remove(self, block: Block) -> None:
        before, after = block.prev_free, block.next_free
        assert before is not None and after is not None, "block is not in the free queue"
        before.next_free = after
        after.prev_free = before
        block.prev_free = block.next_free = None
        self.length -= 1
