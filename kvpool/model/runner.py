"""``ModelRunner``: runs the model on sequences whose blocks the block manager holds.

The runner turns block tables into slot indices, builds the ``AttentionBatch`` and calls
the model. It owns the ``PagedKVStore``, sized from the manager's pool once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvpool.cache import KVCacheManager, SeqId
from kvpool.model.kv_store import PagedKVStore
from kvpool.model.llama import AttentionBatch, LlamaModel, SharedPrefix

_THREADS_AT_IMPORT = torch.get_num_threads()


@dataclass(frozen=True)
class SeqChunk:
    """New tokens of one sequence to compute in a step, from position ``start``."""

    seq_id: SeqId
    token_ids: list[int]
    start: int


class ModelRunner:
    """Runs steps of the model over sequences held by ``manager``.

    Threads on the CPU (with the passive OpenMP wait policy, see ``kvpool.model``): a
    decode step, or any step of at most ``single_thread_tokens`` tokens, runs its matrix
    products and large gathers on all threads and the many small ops around them on
    one, where waking the second thread for each costs more than it brings (measured,
    2 cores: batch 1 21.0 -> 17.2 ms a step against one thread for everything, batch 8
    44.1 -> 32.0 ms, batch 32 at 100 tokens of context 71.5 -> 67.8 ms against all
    threads for everything). Larger prefill steps run everything on all threads.
    """

    def __init__(
        self,
        model: LlamaModel,
        manager: KVCacheManager,
        *,
        single_thread_tokens: int = 8,
        min_shared_tokens: int = 256,
    ) -> None:
        self.model = model
        self.manager = manager
        self.kv = PagedKVStore(
            model.config, manager.num_blocks, manager.block_size, model.dtype, model.device
        )
        self.single_thread_tokens = single_thread_tokens if model.device.type == "cpu" else 0
        self.max_threads = _THREADS_AT_IMPORT  # not the current count: a runner may have
        # left it at one
        # Decode reads a prefix shared by several sequences once per group only when it
        # is this long: below, the extra ops cost more than the gathers they save
        # (batch 32: 256 shared of 320 tokens, par; 600 of 640, 151 -> 101 ms a step).
        self.min_shared_blocks = max(1, min_shared_tokens // manager.block_size)

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        self.kv.copy_blocks(copies)

    def build_batch(self, chunks: list[SeqChunk]) -> AttentionBatch:
        bs = self.manager.block_size
        device = self.model.device
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        q_lens = [len(c.token_ids) for c in chunks]
        ctx_lens = [c.start + len(c.token_ids) for c in chunks]
        q_max = max(q_lens)
        tables = [
            self.manager.block_table(c.seq_id)[: -(-ctx // bs)]
            for c, ctx in zip(chunks, ctx_lens, strict=True)
        ]
        groups: list[SharedPrefix] = []
        skip = [0] * len(chunks)  # leading blocks each sequence reads through its group
        if q_max == 1 and len(chunks) > 1:
            groups = _shared_prefixes(tables, ctx_lens, bs, self.min_shared_blocks)
            for group in groups:
                for row in group.rows.tolist():
                    skip[row] = group.blocks.shape[0]
            groups = [g.to(device) for g in groups]
        n_max = max(len(t) - k for t, k in zip(tables, skip, strict=True))
        l_max = n_max * bs  # keys are gathered whole blocks at a time
        query_index = torch.zeros(len(chunks), q_max, dtype=torch.long)
        context_blocks = torch.zeros(len(chunks), n_max, dtype=torch.long)
        offset = 0
        for b, chunk in enumerate(chunks):
            ctx = ctx_lens[b]
            table = tables[b]
            context_blocks[b, : len(table) - skip[b]] = torch.tensor(table[skip[b] :])
            input_ids.extend(chunk.token_ids)
            positions.extend(range(chunk.start, ctx))
            slots.extend(table[p // bs] * bs + p % bs for p in range(chunk.start, ctx))
            query_index[b, : q_lens[b]] = torch.arange(offset, offset + q_lens[b])
            offset += q_lens[b]
        q_len_t = torch.tensor(q_lens)
        ctx_t = torch.tensor(ctx_lens) - torch.tensor(skip) * bs  # context in context_blocks
        i = torch.arange(q_max)
        j = torch.arange(l_max)
        query_valid = i[None, :] < q_len_t[:, None]
        q_pos = (ctx_t - q_len_t)[:, None] + i[None, :]  # absolute position of each query
        mask = (j[None, None, :] <= q_pos[:, :, None]) & (j[None, None, :] < ctx_t[:, None, None])
        mask &= query_valid[:, :, None]
        mask[:, :, 0] |= ~query_valid  # padded query rows attend to something (no NaN)
        last_index = torch.cumsum(q_len_t, 0) - 1
        return AttentionBatch(
            input_ids=torch.tensor(input_ids, dtype=torch.long, device=device),
            positions=torch.tensor(positions, dtype=torch.long, device=device),
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
            query_index=query_index.to(device),
            query_valid=query_valid.to(device),
            context_blocks=context_blocks.to(device),
            attn_mask=mask[:, None].to(device),
            last_index=last_index.to(device),
            key_valid=(j[None, :] < ctx_t[:, None]).to(device),
            decode_only=q_max == 1,
            shared_prefixes=groups,
        )

    def forward(self, chunks: list[SeqChunk], *, all_logits: bool = False) -> torch.Tensor:
        batch = self.build_batch(chunks)
        self.model.heavy_threads = 0
        if self.single_thread_tokens:
            small = batch.input_ids.shape[0] <= self.single_thread_tokens
            split = small or batch.decode_only
            torch.set_num_threads(1 if split else self.max_threads)
            if split and self.max_threads > 1:  # products and gathers on all threads
                self.model.heavy_threads = self.max_threads
        return self.model.forward(batch, self.kv, all_logits=all_logits)


def _shared_prefixes(
    tables: list[list[int]], ctx_lens: list[int], block_size: int, min_blocks: int
) -> list[SharedPrefix]:
    """Groups of decoding sequences whose block tables start with the same physical
    blocks (a shared system prompt, the prompt of n samples): each group's common full
    blocks, read once for all its members. A sequence's own last block is never part of
    a group's prefix, so every member keeps at least one block of its own."""
    by_first: dict[int, list[int]] = {}
    for row, table in enumerate(tables):
        by_first.setdefault(table[0], []).append(row)
    groups = []
    for rows in by_first.values():
        if len(rows) < 2:
            continue
        limit = min((ctx_lens[r] - 1) // block_size for r in rows)  # full, not the last
        first = tables[rows[0]]
        shared = 0
        while shared < limit and all(tables[r][shared] == first[shared] for r in rows):
            shared += 1
        if shared >= min_blocks:
            groups.append(
                SharedPrefix(torch.tensor(first[:shared]), torch.tensor(rows, dtype=torch.long))
            )
    return groups
