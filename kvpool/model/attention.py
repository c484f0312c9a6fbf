"""Attention over the paged KV store: the ``AttentionBatch`` a step's index tensors are
held in, and the paths each layer's attention takes (``StepAttention`` picks one per
step): the native decode op reading each sequence's blocks in place (single tokens); the
native ``paged_attention`` (prompt chunks, a mixed step's single tokens going to the
decode op; every token for an int8 store or a batch-invariant model); and, without the
native ops, the torch path, which gathers whole context blocks and runs batched products
(decode, decode groups reading a shared prefix once) or SDPA on each sequence's chunk
over its context (``chunk_attention``).

Every path computes the same attention: each new query over its own sequence's context
slots, causal within the chunk, nothing across sequences; in a sliding-window layer
(gemma3's local layers) over the last ``window`` positions only, its own included.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from kvpool.model.kv_store import PagedKVStore

if TYPE_CHECKING:
    from kvpool.model.llama import LlamaModel


@dataclass
class AttentionBatch:
    """Index tensors for one forward pass over ``T`` new tokens of ``B`` sequences."""

    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T] absolute position of each new token
    slot_mapping: torch.Tensor  # [T] KV slot each new token is written to
    context_blocks: torch.Tensor  # [B, Nmax] block ids of each sequence's context
    last_index: torch.Tensor  # [B] flat index of each sequence's last new token
    key_valid: torch.Tensor  # [B, Nmax * block_size] bool: context position exists
    context_lens: torch.Tensor  # [B] context tokens in context_blocks
    decode_only: bool  # every sequence brings exactly one new token
    # Decode only: groups whose first blocks are shared; a member's ``context_blocks``
    # then holds only the blocks after its group's prefix.
    shared_prefixes: list[SharedPrefix] = field(default_factory=list)
    # A step mixing single decode tokens with longer chunks (the chunks in ``varlen``):
    # the single tokens' flat indices [D], block tables [D, N] and context lengths [D],
    # for the native decode attention. The fields above then describe only the longer
    # chunks' sequences (``last_index`` still covers every sequence).
    decode: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    # Sequences whose new tokens attend through the native ``paged_attention``: their
    # query starts [S + 1] (each one's new tokens consecutive), block tables [S, N],
    # context lengths [S], and the indices of their tokens among the step's (None: every
    # token, in order). Every sequence (a store in another dtype than the compute one,
    # int8 above all; a batch-invariant model), the fields above then unused; or the
    # prompt chunks where the native ops are built, beside ``decode``'s single tokens.
    varlen: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None] | None = None
    # Steps with chunks longer than one token: each row's (flat index of its first new
    # token, new tokens, context tokens), for ``chunk_attention`` (its new tokens are
    # consecutive and the last of its context); empty for a step of single tokens.
    spans: list[tuple[int, int, int]] = field(default_factory=list)


@dataclass
class SharedPrefix:
    """Decoding sequences (batch ``rows``) whose contexts start with the same physical
    ``blocks``: attention reads those blocks once for the whole group."""

    blocks: torch.Tensor  # [P] block ids
    rows: torch.Tensor  # [n] batch rows, ascending
    # The rows as a slice when they are consecutive (views, no gather/scatter); set once
    # here rather than in every layer.
    select: slice | torch.Tensor = field(init=False, repr=False)

    def __post_init__(self) -> None:
        first, n = int(self.rows[0]), self.rows.shape[0]
        consecutive = int(self.rows[-1]) - first == n - 1
        self.select = slice(first, first + n) if consecutive else self.rows

    def to(self, device: torch.device) -> SharedPrefix:
        return SharedPrefix(self.blocks.to(device), self.rows.to(device))


# Decode steps whose sequences have at most this many context keys in all compute their
# attention in fp32 on the CPU: below it, bf16's fixed cost per batched product
# outweighs the conversions (docs/performance.md, "Attention").
FP32_ATTENTION_MAX_KEYS = 256
# Context reads (the torch path's gathers, the native decode attention) over fewer
# elements (per K or V) run on one thread even in a split step.
PARALLEL_GATHER_MIN = 1 << 16


def _call(fn: Any, *args: Any, **kwargs: Any) -> Any:
    return fn(*args, **kwargs)


def attend(
    model: LlamaModel,
    q: torch.Tensor,
    layer_kv: torch.Tensor,
    batch: AttentionBatch,
    decode_bias: torch.Tensor | None,
    head_blocks: torch.Tensor,
    window: int = 0,
) -> torch.Tensor:
    """Each sequence's new queries over its own context slots -> ``[T, heads * dim]``
    (a mixed step's: its chunks' tokens only, in their order).

    The context is gathered whole blocks at a time (``block_size * dim`` contiguous
    elements per copy, not one token's ``dim``: several times faster than slots), K
    and V in one row gather over the layer's store seen as ``[(K and V heads) *
    blocks, block_size * dim]`` (``head_blocks``: the rows of each head's blocks,
    head-major), which torch runs on all threads (a gather along the block dimension
    of ``[heads, blocks, ...]`` runs on one)."""
    cfg = model.config
    nh, nkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    scale = cfg.scale
    b, n_blocks = batch.context_blocks.shape
    length = batch.key_valid.shape[1]  # n_blocks * block_size
    rows = (-1, length // n_blocks * d)  # [heads * blocks, block_size * dim]
    size = nkv * b * length * d
    buf = model._scratch(2 * size)  # reused: a fresh multi-MB tensor per layer costs
    # page faults on every step (the gather then ran far slower than memcpy)
    # Small gathers stay on the current thread: waking another costs more.
    gather = model._heavy if size >= PARALLEL_GATHER_MIN else _call
    gather(torch.index_select, layer_kv.view(rows), 0, head_blocks, out=buf.view(rows))
    keys = buf[:size].view(nkv * b, length, d)
    values = buf[size:].view(nkv * b, length, d)
    if decode_bias is not None:
        # One query per sequence: two small batched matmuls per (KV head, sequence)
        # beat the flash kernel, whose blocking is made for long query runs; the
        # heads of a KV group share its keys. The scale and the mask of missing
        # context positions ride along in baddbmm.
        g = nh // nkv
        queries = q.view(b, nkv, g, d).transpose(0, 1).reshape(nkv * b, g, d)
        if decode_bias.dtype != values.dtype:  # fp32 attention, chosen in forward
            kv32 = buf.float()  # K and V in one conversion
            keys_t = kv32[:size].view(nkv * b, length, d).transpose(1, 2)
            scores = torch.baddbmm(decode_bias, queries.float(), keys_t, alpha=scale)
            values32 = kv32[size:].view(nkv * b, length, d)
            out = torch.bmm(torch.softmax(scores, dim=-1), values32).to(model.dtype)
            return out.view(nkv, b, g, d).transpose(0, 1).reshape(b, nh * d)
        scores = torch.baddbmm(decode_bias, queries, keys.transpose(1, 2), alpha=scale)
        if batch.shared_prefixes:
            bs = length // n_blocks
            k_cache, v_cache = layer_kv[:nkv], layer_kv[nkv:]
            assert not window  # (the runner makes no prefix groups for a windowed model)
            return attend_shared(model, queries, scores, values, k_cache, v_cache, batch, bs)
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(values.dtype)
        out = torch.bmm(probs, values)  # [nkv * b, g, d]
        return out.view(nkv, b, g, d).transpose(0, 1).reshape(b, nh * d)
    keys = keys.view(nkv, b, length, d)
    values = values.view(nkv, b, length, d)
    parts = [  # each sequence's chunk alone, its new tokens consecutive in q
        chunk_attention(q[first : first + n], keys[:, r, :ctx], values[:, r, :ctx], window, scale)
        for r, (first, n, ctx) in enumerate(batch.spans)
    ]
    out = parts[0] if len(parts) == 1 else torch.cat(parts)
    return out.reshape(-1, nh * d)


def chunk_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    window: int = 0,
    scale: float | None = None,
) -> torch.Tensor:
    """One sequence's chunk of new tokens ``q`` ``[n, heads, dim]`` over its context
    ``keys``/``values`` ``[kv_heads, ctx, dim]``, whose last ``n`` positions are the
    chunk's own -> ``[n, heads, dim]`` (``window``: keys each token sees, its own
    included; 0: all up to it. ``scale``: the scores' factor, SDPA's by default).

    A chunk's rows are the same alone or batched: SDPA's results change with masked
    keys padded on, so none are (the context is sliced to its length). A chunk at the
    start of its context runs SDPA's ``is_causal``, which skips the masked half of the
    scores and gives the masked form's bits; a later chunk runs with its mask. (SDPA's
    rows still depend in the last bits on where a chunk starts, through its blocks of
    rows, unless at a multiple of 64: docs/performance.md, sixteenth session.)"""
    n, ctx = q.shape[0], keys.shape[1]
    qh, kh, vh = q.transpose(0, 1)[None], keys[None], values[None]  # [1, heads, len, dim]
    if ctx == n and (not window or window >= n):
        out = F.scaled_dot_product_attention(
            qh, kh, vh, is_causal=True, enable_gqa=True, scale=scale
        )
    else:
        i = torch.arange(n, device=q.device)[:, None] + (ctx - n)  # each token's position
        j = torch.arange(ctx, device=q.device)[None, :]
        mask = (j <= i) & (j > i - window) if window else j <= i
        out = F.scaled_dot_product_attention(
            qh, kh, vh, attn_mask=mask, enable_gqa=True, scale=scale
        )
    return out[0].transpose(0, 1)


def attend_shared(
    model: LlamaModel,
    queries: torch.Tensor,
    own_scores: torch.Tensor,
    own_values: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    batch: AttentionBatch,
    bs: int,
) -> torch.Tensor:
    """Decode attention when groups of sequences share leading blocks: each group's
    queries score the shared blocks in one product (the blocks are read once, not
    once per member), then one softmax runs over [shared | own] scores of every
    sequence (-inf where a sequence has no shared part), and the two value products
    are summed. Exact: the same softmax as attending to each sequence's blocks."""
    cfg = model.config
    nkv, d = cfg.num_kv_heads, cfg.head_dim
    g = cfg.num_heads // nkv
    b = own_scores.shape[0] // nkv
    blocked = (nkv, -1, bs * d)
    width = max(group.blocks.shape[0] for group in batch.shared_prefixes) * bs
    shared = torch.full(
        (nkv, b, g, width), float("-inf"), dtype=own_scores.dtype, device=queries.device
    )
    parts = []
    q4 = queries.view(nkv, b, g, d)
    for group in batch.shared_prefixes:
        rows = group.select
        length = group.blocks.shape[0] * bs
        keys = k_cache.view(blocked).index_select(1, group.blocks).view(nkv, length, d)
        values = v_cache.view(blocked).index_select(1, group.blocks).view(nkv, length, d)
        n = group.rows.shape[0]
        scores = torch.bmm(q4[:, rows].reshape(nkv, n * g, d), keys.transpose(1, 2))
        shared[:, rows, :, :length] = scores.view(nkv, n, g, length).mul_(cfg.scale)
        parts.append((rows, n, length, values))
    scores = torch.cat([shared.view(nkv * b, g, width), own_scores], dim=-1)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(own_values.dtype)
    out = torch.bmm(probs[..., width:], own_values).view(nkv, b, g, d)
    probs4 = probs.view(nkv, b, g, width + own_scores.shape[-1])
    for rows, n, length, values in parts:
        weights = probs4[:, rows, :, :length].reshape(nkv, n * g, length)
        out[:, rows] += torch.bmm(weights, values).view(nkv, n, g, d)
    return out.transpose(0, 1).reshape(b, cfg.num_heads * d)


class StepAttention:
    """The attention of one forward pass: which path its layers take and the tensors
    that path needs, built once for all layers (``model`` gives the native op, the
    threads, the scratch buffer and the dtype)."""

    def __init__(self, model: LlamaModel, batch: AttentionBatch, kv: PagedKVStore) -> None:
        self.model, self.batch, self.kv = model, batch, kv
        nkv, d = model.config.num_kv_heads, model.config.head_dim
        device = batch.input_ids.device
        self.varlen = batch.varlen
        self.native_call: Any = _call
        # a decode step whose every token goes through paged_attention (DecodeLayers can
        # run its layers)
        self.varlen_decode = False
        if self.varlen is not None:  # one native op a layer, on all threads when large
            assert model.native_fused is not None
            context = int(self.varlen[2].sum()) * nkv * d
            self.native_heavy = context >= PARALLEL_GATHER_MIN
            self.native_call = model._heavy if self.native_heavy else _call
            self.native, self.head_blocks, self.decode_bias = None, None, None
            self.varlen_decode = batch.decode_only and self.varlen[3] is None
            return
        native = model.native_decode if batch.decode_only and not batch.shared_prefixes else None
        self.native = native
        self.head_blocks: torch.Tensor | None = None
        # the native decode op on the heavy threads (it is large; see ``model._heavy``)
        self.native_heavy = False
        if native is not None:  # one op a layer, on all threads when it is large
            self.native_heavy = batch.key_valid.numel() * nkv * d >= PARALLEL_GATHER_MIN
            self.native_call = model._heavy if self.native_heavy else _call
        else:  # rows of the context blocks in a layer's store as [(K, V heads) * blocks, ...]
            head_offsets = torch.arange(2 * nkv, device=device)[:, None] * kv.num_blocks
            self.head_blocks = (head_offsets + batch.context_blocks.view(1, -1)).view(-1)
        self.decode_bias: torch.Tensor | None = None
        if batch.decode_only and native is None:  # mask of missing context, for all layers
            valid = batch.key_valid.repeat(nkv, 1)[:, None, :]  # (head, seq) major
            # Few keys in all: attention runs in fp32 (bf16 batched products have a fixed
            # cost on the CPU about 3x fp32's, which outweighs the conversions); the bias
            # carries that choice to every layer in its dtype.
            small = batch.key_valid.numel() <= FP32_ATTENTION_MAX_KEYS
            dtype = torch.float32 if model._fp32_attention and small else model.dtype
            self.decode_bias = torch.zeros(valid.shape, dtype=dtype, device=device)
            self.decode_bias.masked_fill_(~valid, float("-inf"))
        # the decode bias of a sliding-window layer, by window, made at its first layer
        self._window_bias: dict[int, torch.Tensor] = {}

    def _decode_bias(self, window: int) -> torch.Tensor | None:
        """The torch decode path's bias for a layer of ``window`` (0: ``decode_bias``): the
        context positions before each sequence's last ``window`` masked too."""
        if not window or self.decode_bias is None:
            return self.decode_bias
        if window not in self._window_bias:
            batch = self.batch
            nkv = self.model.config.num_kv_heads
            positions = torch.arange(batch.key_valid.shape[1], device=batch.key_valid.device)
            early = positions[None, :] < (batch.context_lens[:, None] - window)
            early = early.repeat(nkv, 1)[:, None, :]  # (head, seq) major, as the bias
            self._window_bias[window] = self.decode_bias.masked_fill(early, float("-inf"))
        return self._window_bias[window]

    def __call__(self, q: torch.Tensor, layer: int) -> torch.Tensor:
        """Layer ``layer``'s attention of the queries ``q`` ``[T, heads, dim]`` (this
        step's K/V already written) -> ``[T, heads * dim]``."""
        model, batch, kv = self.model, self.batch, self.kv
        window = model.windows[layer]
        if self.varlen is not None:
            starts, tables, lens, index = self.varlen
            queries = q[index] if index is not None else q.contiguous()
            op = model.native_fused.paged_attention
            out = self._native(self.native_call, op, queries, layer, window, tables, lens, starts)
            if batch.decode is None:
                return out
            # the step's single decode tokens through the native decode attention
            tokens, blocks, lens = batch.decode
            full = torch.empty(q.shape[0], out.shape[1], dtype=out.dtype, device=out.device)
            full[index] = out
            singles = q[tokens].contiguous()
            full[tokens] = self._native(
                model._heavy, model.native_decode, singles, layer, window, blocks, lens
            )
            return full
        if self.native is not None:
            return self._native(
                self.native_call, self.native, q.contiguous(), layer, window,
                batch.context_blocks, batch.context_lens,
            )  # fmt: skip
        assert self.head_blocks is not None
        bias = self._decode_bias(window)
        return attend(model, q, kv.layers[layer], batch, bias, self.head_blocks, window)

    def _native(
        self, call: Any, op: Any, q: torch.Tensor, layer: int, window: int,
        tables: torch.Tensor, lens: torch.Tensor, *starts: torch.Tensor,
    ) -> torch.Tensor:  # fmt: skip
        """A native attention op (the decode one, or ``paged_attention`` with its query
        starts) over layer ``layer``'s store, run through ``call`` (``window``: the
        layer's sliding window, 0 for none)."""
        return call(
            op, q, self.kv.layers[layer], tables, lens, *starts, self.kv.block_size,
            self.model.config.scale, self.model.products.variant, window,
        )  # fmt: skip
