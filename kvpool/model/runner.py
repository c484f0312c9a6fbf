"""``ModelRunner``: runs the model on sequences given as plain data: each chunk's new
tokens, its start position and its block table (the physical block ids holding its KV,
in order, as the block manager hands them out).

The runner turns block tables into slot indices, builds the ``AttentionBatch`` and calls
the model. It owns the ``PagedKVStore`` of ``num_blocks`` blocks of ``block_size``.
"""

from __future__ import annotations

import time
from array import array
from dataclasses import dataclass
from itertools import repeat
from typing import Any, Literal

import torch

from kvpool.model.attention import AttentionBatch, SharedPrefix
from kvpool.model.kv_store import PagedKVStore
from kvpool.model.llama import LlamaModel
from kvpool.model.threads import Mode, ThreadPolicy

_THREADS_AT_IMPORT = torch.get_num_threads()

# The torch attention path (a GPU, or a CPU without the native ops) gathers each row's
# context, padded to the step's longest, into one scratch buffer a layer (K and V), kept
# for later steps. A step whose gather would pass this many bytes runs as several
# forwards over groups of rows of similar context length (a long context beside many
# short ones would otherwise pad them all to its length): the buffer, and the memory a
# GPU must keep beside its KV pool, stay bounded whatever the pool holds.
GATHER_BYTES_MAX = 1 << 30


def _long_rows(rows: list[list[int]], width: int) -> torch.Tensor:
    """``rows`` as a ``[len(rows), width]`` int64 tensor, each row padded with zeros:
    through one flat buffer, where ``torch.tensor`` of the nested lists reads element by
    element (a batch-32 step's block tables: ~0.4 ms, this ~30 us)."""
    flat = array("q")
    for row in rows:
        flat.extend(row)
        flat.extend(repeat(0, width - len(row)))
    if not flat:
        return torch.zeros(len(rows), width, dtype=torch.long)
    return torch.frombuffer(flat, dtype=torch.long).view(len(rows), width)


@dataclass(frozen=True)
class SeqChunk:
    """New tokens of one sequence to compute in a step, from position ``start``;
    ``block_table`` holds the sequence's blocks, covering at least ``start +
    len(token_ids)`` positions (the new tokens' K/V are written into them)."""

    token_ids: list[int]
    start: int
    block_table: list[int]


class ModelRunner:
    """Runs steps of the model over a paged KV store of ``num_blocks`` blocks.

    On the CPU a ``ThreadPolicy`` decides, by measuring, how each step uses the threads
    (see ``kvpool.model.threads``); ``threads=None`` leaves torch's setting alone.
    """

    def __init__(
        self,
        model: LlamaModel,
        num_blocks: int,
        block_size: int,
        *,
        threads: ThreadPolicy | Literal["auto"] | None = "auto",
        min_shared_tokens: int | None = None,
        kv_dtype: torch.dtype | None = None,
    ) -> None:
        self.model = model
        self.block_size = block_size
        kv_dtype = kv_dtype or model.dtype
        native = model.native_fused is not None and model.device.type == "cpu"
        # A store in another dtype than the compute one (int8 above all) is read and
        # written only by the native ops, which convert rows in registers.
        if kv_dtype != model.dtype and not native:
            raise ValueError(
                f"a {kv_dtype} KV cache under {model.dtype} compute needs the native CPU ops "
                "(kvpool.model.native); use kv_cache_dtype='auto' here"
            )
        # Every token through the native ``paged_attention`` (one kernel for prompt and
        # decode tokens: a token's attention is then the same whatever step computes it,
        # which a batch-invariant model promises), or only prompt chunks (``_varlen``).
        self.varlen = kv_dtype != model.dtype or (native and model.products.fixed)
        # Prompt chunks attend through ``paged_attention`` wherever it is built: its rows
        # do not depend on where a chunk starts or ends (SDPA's do, in the last bits), it
        # reads the blocks in place and skips what a causal row does not see. (Off, the
        # torch path's SDPA takes them, and the decode tokens of their steps: tests
        # compare the two.)
        self.native_chunks = native
        self.kv = PagedKVStore(model.config, num_blocks, block_size, kv_dtype, model.device)
        if threads == "auto":
            # the count at import, not the current one: a runner may have left it at one
            cpu = model.device.type == "cpu"
            threads = ThreadPolicy(_THREADS_AT_IMPORT) if cpu else None
        self.threads: ThreadPolicy | None = threads
        # On the torch path, decode reads a prefix shared by several sequences once per
        # group, when it is this long: below, the extra ops cost more than the gathers
        # they save. With the native decode attention no groups are made (unless asked
        # for): it reads every sequence's own table, the shared blocks hot in the cache,
        # which measured faster than the grouped torch path (docs/performance.md,
        # "Shared-prefix decode").
        if min_shared_tokens is None and model.native_decode is None:
            min_shared_tokens = 256
        self.min_shared_blocks: int | None = None
        # (a sliding window cuts a sequence's shared prefix at its own place: no groups)
        if min_shared_tokens is not None and not model.config.sliding_window:
            self.min_shared_blocks = max(1, min_shared_tokens // block_size)
        # padded context blocks a step's rows may gather at once (None: no gather, the
        # native ops read the blocks in place)
        self.gather_blocks_max: int | None = None
        if not native:
            cfg = model.config
            block = 2 * cfg.num_kv_heads * block_size * cfg.head_dim * self.kv.dtype.itemsize
            self.gather_blocks_max = max(1, GATHER_BYTES_MAX // block)

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        self.kv.copy_blocks(copies)

    def build_batch(self, chunks: list[SeqChunk]) -> AttentionBatch:
        """The step's index tensors. Where the native ops are built, a step's longer
        chunks attend through ``paged_attention`` and its single decode tokens through
        the native decode attention, each in one call a layer: each token's attention
        then takes the same path whatever it is batched with."""
        q_lens, ctx_lens, tables = self._step_lists(chunks)
        if self._native_decode_step(q_lens) or (self.varlen and max(q_lens) == 1):
            return self._decode_batch(chunks, tables, ctx_lens)
        return self._padded_batch(chunks, tables, q_lens, ctx_lens)

    def _step_lists(self, chunks: list[SeqChunk]) -> tuple[list[int], list[int], list[list[int]]]:
        """Each chunk's new tokens, its context (the new ones included) and the blocks of
        its table that context fills."""
        bs = self.block_size
        q_lens = [len(c.token_ids) for c in chunks]
        ctx_lens = [c.start + len(c.token_ids) for c in chunks]
        tables = [c.block_table[: -(-ctx // bs)] for c, ctx in zip(chunks, ctx_lens, strict=True)]
        return q_lens, ctx_lens, tables

    def _native_decode_step(self, q_lens: list[int]) -> bool:
        """Whether a step of these chunk lengths is single tokens that all attend through
        the native decode attention (no prefix groups: it reads each table itself)."""
        return (
            max(q_lens) == 1
            and not self.varlen
            and self.model.native_decode is not None
            and self.min_shared_blocks is None
        )

    def _decode_batch(
        self, chunks: list[SeqChunk], tables: list[list[int]], ctx_lens: list[int]
    ) -> AttentionBatch:
        """``_padded_batch``'s tensors for a step of single tokens (each sequence's last
        position attends to its whole context), built from the lists in a few calls: the
        general form's masks and indices took ~20 small torch ops (3x the time). Where
        every token attends through ``paged_attention`` (``self.varlen``), its ``varlen``
        is these tables and lengths, a query each."""
        bs, device = self.block_size, self.model.device
        n = len(chunks)
        width = max(len(t) for t in tables)
        positions = [c.start for c in chunks]
        slots = [t[p // bs] * bs + p % bs for t, p in zip(tables, positions, strict=True)]
        # the per-sequence rows in one tensor (each torch.tensor call costs ~10 us)
        ids = [c.token_ids[0] for c in chunks]
        rows = _long_rows([ids, positions, slots, ctx_lens, list(range(n))], n)
        key_valid = torch.arange(width * bs)[None, :] < rows[3][:, None]
        blocks = _long_rows(tables, width).to(device)
        ids_t, positions_t, slots_t, ctx_t, index_t = rows.to(device).unbind()
        varlen = None
        if self.varlen:  # a query each
            varlen = (torch.arange(n + 1, device=device), blocks, ctx_t, None)
        return AttentionBatch(
            input_ids=ids_t,
            positions=positions_t,
            slot_mapping=slots_t,
            context_blocks=blocks,
            last_index=index_t,
            key_valid=key_valid.to(device),
            context_lens=ctx_t,
            decode_only=True,
            varlen=varlen,
        )

    def _padded_batch(
        self,
        chunks: list[SeqChunk],
        tables: list[list[int]],
        q_lens: list[int],
        ctx_lens: list[int],
    ) -> AttentionBatch:
        """Any step's tensors: queries padded to the longest chunk, keys to the longest
        context (the blocks gathered), each chunk's span (chunk_attention's)."""
        bs = self.block_size
        device = self.model.device
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        offsets = []
        for chunk, ctx, table in zip(chunks, ctx_lens, tables, strict=True):
            offsets.append(len(input_ids))
            input_ids.extend(chunk.token_ids)
            positions.extend(range(chunk.start, ctx))
            slots.extend(table[p // bs] * bs + p % bs for p in range(chunk.start, ctx))
        singles = [b for b, n in enumerate(q_lens) if n == 1]
        native_chunks = self.native_chunks and len(singles) < len(chunks)
        # the single decode tokens apart, through the native decode attention
        split = not self.varlen and native_chunks and len(singles) > 0
        varlen = None
        if self.varlen or native_chunks:
            # through the native paged_attention, one call a layer: every sequence, or
            # the chunks only, their tokens picked out of the step's
            native = [b for b, n in enumerate(q_lens) if n > 1] if split else range(len(chunks))
            varlen = self._varlen(
                [tables[b] for b in native], [q_lens[b] for b in native],
                [ctx_lens[b] for b in native],
                [offsets[b] for b in native] if split else None,
            )  # fmt: skip
        rows = [b for b, n in enumerate(q_lens) if n > 1] if split else list(range(len(chunks)))
        decode = None
        if split:
            width = max(len(tables[b]) for b in singles)
            decode_blocks = _long_rows([tables[b] for b in singles], width)
            decode = (
                torch.tensor([offsets[b] for b in singles], device=device),
                decode_blocks.to(device),
                torch.tensor([ctx_lens[b] for b in singles], device=device),
            )
        q_max = max(q_lens[b] for b in rows)
        groups: list[SharedPrefix] = []
        skip = [0] * len(rows)  # leading blocks each sequence reads through its group
        if q_max == 1 and len(rows) > 1 and self.min_shared_blocks is not None and not self.varlen:
            groups = _shared_prefixes(tables, ctx_lens, bs, self.min_shared_blocks)
            for group in groups:
                for row in group.rows.tolist():
                    skip[row] = group.blocks.shape[0]
            groups = [g.to(device) for g in groups]
        n_max = max(len(tables[b]) - k for b, k in zip(rows, skip, strict=True))
        l_max = n_max * bs  # keys are gathered whole blocks at a time
        context_blocks = _long_rows([tables[b][k:] for b, k in zip(rows, skip, strict=True)], n_max)
        # context in context_blocks
        ctx_t = torch.tensor([ctx_lens[b] for b in rows]) - torch.tensor(skip) * bs
        j = torch.arange(l_max)
        last_index = torch.tensor(offsets) + torch.tensor(q_lens) - 1
        spans = []
        if q_max > 1:
            spans = [(offsets[b], q_lens[b], c) for b, c in zip(rows, ctx_t.tolist(), strict=True)]
        return AttentionBatch(
            input_ids=torch.tensor(input_ids, dtype=torch.long, device=device),
            positions=torch.tensor(positions, dtype=torch.long, device=device),
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
            context_blocks=context_blocks.to(device),
            last_index=last_index.to(device),
            key_valid=(j[None, :] < ctx_t[:, None]).to(device),
            context_lens=ctx_t.to(device),
            decode_only=q_max == 1 and not split,
            shared_prefixes=groups,
            decode=decode,
            varlen=varlen,
            spans=spans,
        )

    def _varlen(
        self,
        tables: list[list[int]],
        q_lens: list[int],
        ctx_lens: list[int],
        offsets: list[int] | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """``AttentionBatch.varlen`` for these sequences: their query starts, block
        tables and context lengths, and (``offsets``: where each one's new tokens start
        among the step's) the indices of their tokens in the step, None when they are
        all of them, in order."""
        device = self.model.device
        table_t = _long_rows(tables, max(len(t) for t in tables))
        starts = torch.tensor([0, *q_lens], dtype=torch.long).cumsum(0)
        lens_t = torch.tensor(ctx_lens, dtype=torch.long)
        index = None
        if offsets is not None:
            index = torch.cat(
                [torch.arange(o, o + n) for o, n in zip(offsets, q_lens, strict=True)]
            )
            index = index.to(device)
        return starts.to(device), table_t.to(device), lens_t.to(device), index

    def forward(
        self, chunks: list[SeqChunk], *, all_logits: bool = False, return_hidden: bool = False
    ) -> Any:
        """``LlamaModel.forward`` of the chunks: logits, or ``(logits, hidden)``."""
        groups = None if all_logits else self.gather_groups(chunks)
        if groups is not None:
            return self._forward_groups(chunks, groups, return_hidden)
        batch = self.build_batch(chunks)
        return self._run(batch, all_logits=all_logits, return_hidden=return_hidden)

    def gather_groups(self, chunks: list[SeqChunk]) -> list[list[int]] | None:
        """None, or the groups of chunk indices to run one forward each, where the step's
        padded context gather would pass ``gather_blocks_max`` blocks: indices by context
        length, each group as many as fit its longest context (a context longer than the
        bound alone, then). A chunk attends to its own blocks only, and blocks become
        findable by others after the step, so the groups' order changes nothing."""
        limit = self.gather_blocks_max
        if limit is None or len(chunks) < 2:
            return None
        bs = self.block_size
        blocks = [-(-(c.start + len(c.token_ids)) // bs) for c in chunks]
        if len(chunks) * max(blocks) <= limit:
            return None
        groups: list[list[int]] = [[]]
        for i in sorted(range(len(chunks)), key=blocks.__getitem__):
            if groups[-1] and (len(groups[-1]) + 1) * blocks[i] > limit:
                groups.append([])
            groups[-1].append(i)
        return groups

    def _forward_groups(
        self, chunks: list[SeqChunk], groups: list[list[int]], return_hidden: bool
    ) -> Any:
        """``forward`` of the chunks one group at a time, its rows back in chunk order."""
        outs = [self.forward([chunks[i] for i in g], return_hidden=return_hidden) for g in groups]
        order = torch.tensor([i for g in groups for i in g])
        index = torch.empty_like(order)
        index[order] = torch.arange(len(order))  # chunk i's row in the groups' order
        if not return_hidden:
            return torch.cat(outs)[index.to(outs[0].device)]
        logits, hidden = (torch.cat(parts) for parts in zip(*outs, strict=True))
        index = index.to(logits.device)
        return logits[index], hidden[index]

    def forward_scored(
        self, chunks: list[SeqChunk], scored: list[int], *, return_hidden: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None, list[torch.Tensor]]:
        """``forward``, and the logits of every token of the chunks ``scored`` names (a
        prompt's log-probabilities): ``(logits, hidden or None, [each scored chunk's
        [len, vocab]])``. Only those rows go through the output head."""
        batch = self.build_batch(chunks)
        last = batch.last_index
        spans = [
            torch.arange(int(last[i]) - len(chunks[i].token_ids) + 1, int(last[i]) + 1,
                         device=last.device)
            for i in scored
        ]  # fmt: skip
        out = self._run(batch, return_hidden=return_hidden, rows=torch.cat([last, *spans]))
        logits, hidden = out if return_hidden else (out, None)
        b = last.shape[0]
        parts = list(logits[b:].split([len(s) for s in spans]))
        return logits[:b], hidden[:b] if hidden is not None else None, parts

    def _run(self, batch: Any, **kw: Any) -> Any:
        if self.threads is None:
            return self.model.forward(batch, self.kv, **kw)
        mode = self.threads.choose(batch.input_ids.shape[0], batch.decode_only)
        n = self.threads.max_threads
        torch.set_num_threads(n if mode is Mode.ALL else 1)
        self.model.heavy_threads = n if mode is Mode.SPLIT else 0
        start = time.perf_counter()
        logits = self.model.forward(batch, self.kv, **kw)
        self.threads.record(time.perf_counter() - start)
        return logits


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
