"""``PagedRunner``: a ``ModelRunner`` paired with a block manager, for tests that drive the
runtime below the engine: chunks name a sequence of the manager (``Chunk``), and their
block tables are read from it, as the engine does."""

from __future__ import annotations

from typing import Any, NamedTuple

from kvpool.cache import KVCacheManager, SeqId
from kvpool.model.runner import ModelRunner, SeqChunk


class Chunk(NamedTuple):
    seq_id: SeqId
    token_ids: list[int]
    start: int


class PagedRunner:
    def __init__(self, model: Any, manager: KVCacheManager, **runner_kw: Any) -> None:
        self.manager = manager
        self.runner = ModelRunner(model, manager.num_blocks, manager.block_size, **runner_kw)
        self.kv = self.runner.kv
        self.threads = self.runner.threads

    def chunks(self, chunks: list[Chunk]) -> list[SeqChunk]:
        return [SeqChunk(c.token_ids, c.start, self.manager.block_table(c.seq_id)) for c in chunks]

    def build_batch(self, chunks: list[Chunk]) -> Any:
        return self.runner.build_batch(self.chunks(chunks))

    def forward(self, chunks: list[Chunk], **kw: Any) -> Any:
        return self.runner.forward(self.chunks(chunks), **kw)

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        self.runner.copy_blocks(copies)

    @property
    def model(self) -> Any:
        return self.runner.model

    def decode_step_after_prefills(self, prompts: list[list[int]], first: int) -> list[Chunk]:
        """Each prompt prefilled as a sequence of its own (ids 0, 1, ...), then a token
        ``first + id`` appended to each: the decode step's chunks, to run."""
        for seq, prompt in enumerate(prompts):
            self.manager.allocate(seq, prompt)
            self.forward([Chunk(seq, prompt, 0)])
        chunks = []
        for seq, prompt in enumerate(prompts):
            self.manager.append(seq, [first + seq])
            chunks.append(Chunk(seq, [first + seq], len(prompt)))
        return chunks
