"""Index of cached full blocks by content, verified token by token.

A key (``BlockHash``) only narrows the search: blocks whose keys collide are chained
through ``Block.next_same_hash`` and a candidate matches only if

- its salt equals the caller's salt,
- its ``parent_content_id`` equals the content id of the block the caller matched just
  before (``-1`` for a first block), and
- its token ids equal the caller's token ids.

Content ids are handed out so that two blocks share one only when they hold the same
tokens after the same (verified) prefix under the same salt. By induction over the chain,
a hit therefore holds exactly the caller's whole prefix: a forced hash collision can cost
a comparison, never another prefix's KV.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvpool.cache.block import Block
from kvpool.cache.events import BlockRemoved, BlockStored, KVEvent, salt_hash
from kvpool.cache.hashing import BlockHash


class PrefixIndex:
    __slots__ = ("_by_hash", "_next_content_id", "events", "length")

    def __init__(self) -> None:
        self._by_hash: dict[BlockHash, Block] = {}
        self._next_content_id = 0
        self.length = 0
        # KV events (kvpool.cache.events), where a manager publishes them: every insert
        # and remove, in order.
        self.events: list[KVEvent] | None = None

    def __len__(self) -> int:
        return self.length

    def new_content_id(self) -> int:
        cid = self._next_content_id
        self._next_content_id += 1
        return cid

    def find(
        self, key: BlockHash, parent_content_id: int, salt: bytes, token_ids: Sequence[int]
    ) -> Block | None:
        """The indexed block holding ``token_ids`` after the given parent, or None."""
        block = self._by_hash.get(key)
        while block is not None:
            if (
                block.parent_content_id == parent_content_id
                and block.salt == salt
                and block.token_ids == token_ids
            ):
                return block
            block = block.next_same_hash
        return None

    def insert(self, block: Block) -> None:
        """Index a hashed block (the caller has checked that no equal content is indexed)."""
        assert block.block_hash is not None and not block.indexed
        block.next_same_hash = self._by_hash.get(block.block_hash)
        self._by_hash[block.block_hash] = block
        block.indexed = True
        self.length += 1
        if self.events is not None:
            self.events.append(BlockStored(
                block.block_hash, block.parent_hash, salt_hash(block.salt), len(block.token_ids)
            ))  # fmt: skip

    def remove(self, block: Block) -> None:
        assert block.indexed and block.block_hash is not None
        key = block.block_hash
        head = self._by_hash[key]
        if head is block:
            if block.next_same_hash is None:
                del self._by_hash[key]
            else:
                self._by_hash[key] = block.next_same_hash
        else:
            node = head
            while node.next_same_hash is not block:
                assert node.next_same_hash is not None, "indexed block missing from its chain"
                node = node.next_same_hash
            node.next_same_hash = block.next_same_hash
        block.next_same_hash = None
        block.indexed = False
        if self.events is not None:
            self.events.append(BlockRemoved(key))
        self.length -= 1
