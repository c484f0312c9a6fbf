"""Random operation sequences against the block manager, checked after every step.

Besides the manager's own invariants (``check_invariants``), a model here records, for
every physical block, the *context* its KV was computed under: the whole token prefix up
to the end of that block, as written by the sequence that wrote it. KV at a slot depends
on every earlier token, so a sequence is correct exactly when each block in its table has
the context equal to the sequence's own prefix. That is what a hash collision, a stale
index entry or a missed copy-on-write would break.
"""

from __future__ import annotations

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    invariant,
    precondition,
    rule,
)

from kvpool.cache import BlockHash, KVCacheManager, OutOfBlocks, PinLimitExceeded
from tests.cache_invariants import check_invariants

BS = 4
PREFIXES = [
    [],
    [1, 2, 3, 4],
    [1, 2, 3, 4, 5, 6, 7, 8],
    [9, 9, 9, 9, 1, 2],
    [1, 2, 3, 4, 1, 2, 3, 4],
]
SALTS = [None, "tenant-a"]


def colliding_hash(parent: BlockHash | None, salt: bytes, tokens) -> BlockHash:
    """Three buckets for everything: most lookups must be settled by verification."""
    return BlockHash(sum(tokens) % 3)


class CacheMachine(RuleBasedStateMachine):
    hash_fn = None

    def __init__(self) -> None:
        super().__init__()
        kwargs = {"hash_fn": self.hash_fn} if self.hash_fn else {}
        self.m = KVCacheManager(24, BS, max_pinned_fraction=0.25, **kwargs)
        self.tokens: dict[int, list[int]] = {}
        self.salt: dict[int, bytes | str | None] = {}
        self.public: dict[int, int] = {}  # seq -> leading blocks keyed without its salt
        self.context: dict[int, tuple] = {}  # block id -> (salt, prefix through the block)
        self.pins: set[tuple] = set()
        self.next_id = 0

    seqs = Bundle("seqs")

    def _record_written(self, seq: int, first_block: int) -> None:
        """Blocks from ``first_block`` on were written by ``seq``: their context is its."""
        table = self.m.block_table(seq)
        toks = self.tokens[seq]
        for i in range(first_block, len(table)):
            self.context[table[i]] = (self._salt(seq, i), tuple(toks[: (i + 1) * BS]))

    def _salt(self, seq: int, block: int) -> str | None:
        return None if block < self.public[seq] else self.salt[seq]

    def _check_contexts(self, seq: int, num_blocks: int | None = None) -> None:
        toks = self.tokens[seq]
        table = self.m.block_table(seq)[:num_blocks]
        for i, block_id in enumerate(table):
            if i * BS >= len(toks):
                break
            want = (self._salt(seq, i), tuple(toks[: (i + 1) * BS]))
            assert self.context[block_id] == want, f"seq {seq} block {i} holds other KV"

    @rule(
        target=seqs,
        prefix=st.sampled_from(PREFIXES),
        tail=st.lists(st.integers(0, 5), max_size=9),
        salt=st.sampled_from(SALTS),
        computed=st.booleans(),
        public=st.sampled_from([0, 0, BS, 2 * BS + 1]),
    )
    def allocate(self, prefix, tail, salt, computed, public):
        toks = prefix + tail
        if not toks:
            toks = [0]
        seq = self.next_id
        self.next_id += 1
        try:
            alloc = self.m.allocate(seq, toks, salt=salt, computed=computed, public_tokens=public)
        except OutOfBlocks:
            return seq  # a seq id that does not exist; later rules skip it
        self.tokens[seq] = toks
        self.salt[seq] = salt
        self.public[seq] = public // BS if salt else 0
        hit_blocks = alloc.num_cached_tokens // BS
        assert alloc.num_cached_tokens < len(toks)
        self._check_contexts(seq, hit_blocks)  # hit blocks must hold exactly this prefix
        self._record_written(seq, hit_blocks)
        return seq

    @rule(seq=seqs, new=st.lists(st.integers(0, 5), min_size=1, max_size=6))
    def append(self, seq, new):
        if seq not in self.tokens:
            return
        first = len(self.tokens[seq]) // BS
        try:
            copies = self.m.append(seq, new)
        except OutOfBlocks:
            return
        for src, dst in copies:
            self.context[dst] = self.context[src]
        self.tokens[seq] = self.tokens[seq] + new
        self._record_written(seq, first)

    @rule(seq=seqs, upto=st.integers(0, 40))
    def mark_computed(self, seq, upto):
        if seq in self.tokens:
            self.m.mark_computed(seq, upto)

    @rule(target=seqs, seq=seqs)
    def fork(self, seq):
        child = self.next_id
        self.next_id += 1
        if seq in self.tokens:
            self.m.fork(seq, child)
            self.tokens[child] = list(self.tokens[seq])
            self.salt[child] = self.salt[seq]
            self.public[child] = self.public[seq]
        return child

    @rule(seq=consumes(seqs))
    def free(self, seq):
        if seq in self.tokens:
            self.m.free(seq)
            del self.tokens[seq]

    @rule(prefix=st.sampled_from(PREFIXES[1:]), salt=st.sampled_from(SALTS))
    def pin(self, prefix, salt):
        try:
            pinned = self.m.pin(prefix, salt=salt)
        except PinLimitExceeded:
            return
        if pinned:
            self.pins.add((tuple(prefix), salt))

    @precondition(lambda self: self.pins)
    @rule(data=st.data())
    def unpin(self, data):
        prefix, salt = data.draw(st.sampled_from(sorted(self.pins, key=repr)))
        self.m.unpin(prefix, salt=salt)
        self.pins.discard((prefix, salt))

    @invariant()
    def consistent(self):
        check_invariants(self.m)
        for seq, toks in self.tokens.items():
            assert self.m.sequence_tokens(seq) == toks
            self._check_contexts(seq)

    def teardown(self):
        for seq in list(self.tokens):
            self.m.free(seq)
        for prefix, salt in list(self.pins):
            self.m.unpin(prefix, salt=salt)
        check_invariants(self.m)
        stats = self.m.stats()
        assert stats.used_blocks == 0 and stats.pinned_blocks == 0
        assert stats.free_blocks + stats.cached_blocks == stats.total_blocks


class CollidingHashMachine(CacheMachine):
    hash_fn = staticmethod(colliding_hash)


_SETTINGS = settings(
    max_examples=60,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestCacheStateful = CacheMachine.TestCase
TestCacheStateful.settings = _SETTINGS
TestCacheStatefulWithCollidingHash = CollidingHashMachine.TestCase
TestCacheStatefulWithCollidingHash.settings = _SETTINGS
