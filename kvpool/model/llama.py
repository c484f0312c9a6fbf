"""LLaMA-family decoder (llama, qwen2) over a paged KV store.

One forward pass takes a flat batch of tokens from several sequences (a prefill chunk of
one, a single decode token of another) and their ``AttentionBatch``: where each new
token's K/V goes (``slot_mapping``) and which slots hold each sequence's context. New K/V
are written in place into the store, then each sequence attends over its own slots. The
store is never padded; only the attention compute pads queries and keys to the batch's
longest, with a mask.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from kvpool.model.config import ModelConfig
from kvpool.model.cpu import cpu_features
from kvpool.model.gguf_weights import QuantizedMatrix, QuantizedRows
from kvpool.model.kv_store import PagedKVStore
from kvpool.model.native import kernel_variant, native_ops
from kvpool.model.products import ProductPolicy, QuantLinear


@dataclass
class AttentionBatch:
    """Index tensors for one forward pass over ``T`` new tokens of ``B`` sequences."""

    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T] absolute position of each new token
    slot_mapping: torch.Tensor  # [T] KV slot each new token is written to
    query_index: torch.Tensor  # [B, Qmax] flat index of each sequence's i-th new token
    query_valid: torch.Tensor  # [B, Qmax] bool
    context_blocks: torch.Tensor  # [B, Nmax] block ids of each sequence's context
    attn_mask: torch.Tensor  # [B, 1, Qmax, Nmax * block_size] bool, True = may attend
    last_index: torch.Tensor  # [B] flat index of each sequence's last new token
    key_valid: torch.Tensor  # [B, Nmax * block_size] bool: context position exists
    context_lens: torch.Tensor  # [B] context tokens in context_blocks
    decode_only: bool  # every sequence brings exactly one new token
    # Decode only: groups whose first blocks are shared; a member's ``context_blocks``
    # then holds only the blocks after its group's prefix.
    shared_prefixes: list[SharedPrefix] = field(default_factory=list)
    # A step mixing single decode tokens with longer chunks (with the native decode
    # attention): the single tokens' flat indices [D], block tables [D, N] and context
    # lengths [D]. The fields above then describe only the longer chunks' sequences
    # (``last_index`` still covers every sequence).
    decode: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None


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
# attention in fp32 on the CPU (measured, 2 cores, one sequence: 128 keys 57 -> 33 us a
# layer, 384 on par, 512 and any larger batch slower).
FP32_ATTENTION_MAX_KEYS = 256
# Context reads (the torch path's gathers, the native decode attention) over fewer
# elements (per K or V) run on one thread even in a split step.
PARALLEL_GATHER_MIN = 1 << 16


def _call(fn: Any, *args: Any, **kwargs: Any) -> Any:
    return fn(*args, **kwargs)


class Linear:
    """``y = x W^T (+ b)`` with a dense weight (an F32/F16/BF16 file, or any file where
    the native kernels are not built, and every device but the CPU).

    On the CPU in bfloat16 the weight is prepacked once into oneDNN's blocked layout,
    which runs the small-batch products of decoding 1.3-2x faster than ``F.linear`` on
    the plain layout; elsewhere it is ``F.linear``.
    """

    __slots__ = ("bias", "numel_", "packed", "weight")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.weight: torch.Tensor | None = weight
        self.bias = bias
        self.numel_ = weight.numel() + (bias.numel() if bias is not None else 0)
        self.packed = None
        if weight.device.type == "cpu" and weight.dtype == torch.bfloat16 and can_prepack():
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, 1)
            self.weight = None  # the packed copy is the only one kept

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)

    def numel(self) -> int:
        return self.numel_


def can_prepack() -> bool:
    """Dense bf16 weights are prepacked for oneDNN only where the CPU runs bf16 products
    in hardware: elsewhere oneDNN emulates them."""
    return cpu_features().bf16_products


@dataclass
class _Layer:
    attn_norm: torch.Tensor
    qkv: Linear | QuantLinear  # [q + 2 kv, hidden], fused
    o: Linear | QuantLinear
    ffn_norm: torch.Tensor
    gate_up: Linear | QuantLinear  # [2 inter, hidden], fused
    down: Linear | QuantLinear


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # One fused kernel (it accumulates in fp32 for bf16 input).
    return F.rms_norm(x, weight.shape, weight, eps)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """Rotary embedding in the half-split layout: ``x * cos + rotate_half(x) * sin``
    where ``rotate_half(x) = [-x2, x1]``. Swapping the halves is one ``flip`` and the sign
    rides in ``sin_signed = [-sin, sin]`` (bit-identical: negation is exact), so Q and K
    of all heads rotate in 3 kernels instead of 7 per tensor."""
    t, heads, d = x.shape
    swapped = x.view(t, heads, 2, d // 2).flip(2).view(t, heads, d)
    return x * cos + swapped * sin_signed


class LlamaModel:
    def __init__(
        self,
        config: ModelConfig,
        weights: dict[str, torch.Tensor | QuantizedMatrix],
        device: torch.device,
        dtype: torch.dtype,
        products: ProductPolicy | None = None,
    ) -> None:
        """Build from GGUF-named tensors; ``weights`` is consumed (emptied). Matrices
        given as ``QuantizedMatrix`` (the CPU runtime with native kernels) stay in their
        blocks and are multiplied by ``QuantLinear`` under ``products``; the token
        embedding then stays in its blocks too (rows dequantized on lookup), and a tied
        head multiplies by those same blocks. Dense tensors become ``Linear``s."""
        self.config = config
        self.device = device
        self.dtype = dtype
        self.products = products or ProductPolicy(
            exact=dtype == torch.float32, variant=kernel_variant()
        )

        def w(name: str) -> torch.Tensor:
            # Consumes the dict as it goes, so the plain copies can be freed early.
            tensor = weights.pop(name)
            if isinstance(tensor, QuantizedMatrix):
                tensor = tensor.dequantize()
            return tensor.to(device=device, dtype=dtype).contiguous()

        def linear(names: list[str], bias: torch.Tensor | None = None) -> Linear | QuantLinear:
            parts = [weights.pop(name) for name in names]
            if device.type == "cpu" and all(isinstance(p, QuantizedMatrix) for p in parts):
                return QuantLinear(parts, bias, self.products)  # type: ignore[arg-type]
            dense = [p.dequantize() if isinstance(p, QuantizedMatrix) else p for p in parts]
            return Linear(torch.cat(dense).to(device=device, dtype=dtype).contiguous(), bias)

        embedding = weights.get("token_embd.weight")
        if isinstance(embedding, QuantizedMatrix) and device.type == "cpu":
            weights.pop("token_embd.weight")
            self.embed: torch.Tensor | QuantizedRows = QuantizedRows(embedding, dtype)
            if config.tie_word_embeddings:
                self.lm_head: Linear | QuantLinear = QuantLinear(
                    [embedding], None, self.products, float_out=True
                )
        else:
            self.embed = w("token_embd.weight")
            if config.tie_word_embeddings:
                self.lm_head = Linear(self.embed)
        if not config.tie_word_embeddings:
            self.lm_head = linear(["output.weight"])
            if isinstance(self.lm_head, QuantLinear):
                self.lm_head.float_out = True  # float32 logits (no bf16 rounding, no ties)
        self.final_norm = w("output_norm.weight")
        self.layers: list[_Layer] = []
        for i in range(config.num_layers):
            p = f"blk.{i}."
            bias = None
            if config.attention_bias:
                bias = torch.cat([w(p + "attn_q.bias"), w(p + "attn_k.bias"), w(p + "attn_v.bias")])
            self.layers.append(
                _Layer(
                    attn_norm=w(p + "attn_norm.weight"),
                    qkv=linear(
                        [p + n for n in ("attn_q.weight", "attn_k.weight", "attn_v.weight")], bias
                    ),
                    o=linear([p + "attn_output.weight"]),
                    ffn_norm=w(p + "ffn_norm.weight"),
                    gate_up=linear([p + "ffn_gate.weight", p + "ffn_up.weight"]),
                    down=linear([p + "ffn_down.weight"]),
                )
            )
        d = config.head_dim
        inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
        if "rope_freqs.weight" in weights:  # Llama-3 scaling, precomputed by the converter
            inv_freq = inv_freq / weights.pop("rope_freqs.weight").float()
        self.inv_freq = inv_freq.to(device)
        self._buffer: torch.Tensor | None = None  # scratch for gathered K/V (_attend)
        # > 0: the step's light ops run on one thread and only the matrix products and
        # large gathers on this many (set by the runner for its SPLIT mode on the CPU).
        self.heavy_threads = 0
        self._fp32_attention = device.type == "cpu" and dtype != torch.float32
        # Native ops (kvpool.model.native), where built: decode attention read straight
        # from the store, and the fused residual/norm and rotary/K-V-write ops.
        cpu_dtype = device.type == "cpu" and dtype in (torch.float32, torch.bfloat16)
        ops = native_ops() if cpu_dtype else None
        self.native_decode = ops.paged_decode_attention if ops is not None else None
        self.native_fused = ops

    def _heavy(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """Run a matrix product or a large gather on ``heavy_threads`` threads."""
        if not self.heavy_threads:
            return fn(*args, **kwargs)
        torch.set_num_threads(self.heavy_threads)
        try:
            return fn(*args, **kwargs)
        finally:
            torch.set_num_threads(1)

    def _scratch(self, numel: int) -> torch.Tensor:
        """A reusable buffer of at least ``numel`` elements (grown, never shrunk)."""
        if self._buffer is None or self._buffer.numel() < numel:
            self._buffer = torch.empty(numel, dtype=self.dtype, device=self.device)
        return self._buffer[:numel]

    @property
    def vocab_rows(self) -> int:
        """Rows of the token embedding: the valid input ids are ``[0, vocab_rows)``."""
        return int(self.embed.shape[0])

    @property
    def num_parameters(self) -> int:
        n = self.embed.numel() + self.final_norm.numel()
        if not self.config.tie_word_embeddings:
            n += self.lm_head.numel()
        for layer in self.layers:
            n += layer.attn_norm.numel() + layer.ffn_norm.numel()
            n += sum(lin.numel() for lin in (layer.qkv, layer.o, layer.gate_up, layer.down))
        return n

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos`` and ``sin_signed`` (see ``_rotate``) of each position, ``[T, 1, dim]``."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        cos, sin = freqs.cos(), freqs.sin()
        cos = torch.cat((cos, cos), dim=-1).to(self.dtype)
        sin_signed = torch.cat((-sin, sin), dim=-1).to(self.dtype)
        return cos[:, None, :], sin_signed[:, None, :]

    def _attend(
        self,
        q: torch.Tensor,
        layer_kv: torch.Tensor,
        batch: AttentionBatch,
        decode_bias: torch.Tensor | None,
        head_blocks: torch.Tensor,
        rows: bool = False,
    ) -> torch.Tensor:
        """Each sequence's new queries over its own context slots -> ``[T, heads * dim]``
        (with ``rows``: only the tokens of ``batch.query_index``, in its order).

        The context is gathered whole blocks at a time (``block_size * dim`` contiguous
        elements per copy, not one token's ``dim``: 3-4x faster than gathering slots), K
        and V in one row gather over the layer's store seen as ``[(K and V heads) *
        blocks, block_size * dim]`` (``head_blocks``: the rows of each head's blocks,
        head-major), which torch runs on all threads (a gather along the block dimension
        of ``[heads, blocks, ...]`` runs on one: batch 32, 60 gathers a step from memory,
        12.1 -> 8.9 ms)."""
        cfg = self.config
        nh, nkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        b, n_blocks = batch.context_blocks.shape
        length = batch.key_valid.shape[1]  # n_blocks * block_size
        rows = (-1, length // n_blocks * d)  # [heads * blocks, block_size * dim]
        size = nkv * b * length * d
        buf = self._scratch(2 * size)  # reused: a fresh multi-MB tensor per layer costs
        # page faults on every step (measured: the gather ran 10x slower than memcpy)
        # Small gathers stay on the current thread: waking another costs more.
        gather = self._heavy if size >= PARALLEL_GATHER_MIN else _call
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
                scores = torch.baddbmm(decode_bias, queries.float(), keys_t, alpha=d**-0.5)
                values32 = kv32[size:].view(nkv * b, length, d)
                out = torch.bmm(torch.softmax(scores, dim=-1), values32).to(self.dtype)
                return out.view(nkv, b, g, d).transpose(0, 1).reshape(b, nh * d)
            scores = torch.baddbmm(decode_bias, queries, keys.transpose(1, 2), alpha=d**-0.5)
            if batch.shared_prefixes:
                bs = length // n_blocks
                k_cache, v_cache = layer_kv[:nkv], layer_kv[nkv:]
                return self._attend_shared(queries, scores, values, k_cache, v_cache, batch, bs)
            probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(values.dtype)
            out = torch.bmm(probs, values)  # [nkv * b, g, d]
            return out.view(nkv, b, g, d).transpose(0, 1).reshape(b, nh * d)
        queries = q[batch.query_index].transpose(1, 2)  # [B, nh, Q, d]
        keys = keys.view(nkv, b, length, d).transpose(0, 1)
        values = values.view(nkv, b, length, d).transpose(0, 1)
        out = F.scaled_dot_product_attention(
            queries, keys, values, attn_mask=batch.attn_mask, enable_gqa=True
        )
        out = out.transpose(1, 2)[batch.query_valid]
        return out.reshape(-1 if rows else q.shape[0], nh * d)

    def _attend_split(
        self, q: torch.Tensor, kv: PagedKVStore, layer: int, batch: AttentionBatch,
        head_blocks: torch.Tensor,
    ) -> torch.Tensor:  # fmt: skip
        """A mixed step: the single decode tokens through the native decode attention,
        the longer chunks through ``_attend`` (see ``AttentionBatch.decode``)."""
        tokens, blocks, lens = batch.decode  # type: ignore[misc]
        d = self.config.head_dim
        out = torch.empty(q.shape[0], q.shape[1] * d, dtype=q.dtype, device=q.device)
        chunked = batch.query_index[batch.query_valid]
        out[chunked] = self._attend(q, kv.layers[layer], batch, None, head_blocks, rows=True)
        native = self.native_decode
        out[tokens] = self._heavy(
            native, q[tokens].contiguous(), kv.layers[layer], blocks, lens, kv.block_size,
            d**-0.5, self.products.variant,
        )  # fmt: skip
        return out

    def _attend_shared(
        self,
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
        cfg = self.config
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
            shared[:, rows, :, :length] = scores.view(nkv, n, g, length).mul_(d**-0.5)
            parts.append((rows, n, length, values))
        scores = torch.cat([shared.view(nkv * b, g, width), own_scores], dim=-1)
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(own_values.dtype)
        out = torch.bmm(probs[..., width:], own_values).view(nkv, b, g, d)
        probs4 = probs.view(nkv, b, g, width + own_scores.shape[-1])
        for rows, n, length, values in parts:
            weights = probs4[:, rows, :, :length].reshape(nkv, n * g, length)
            out[:, rows] += torch.bmm(weights, values).view(nkv, n, g, d)
        return out.transpose(0, 1).reshape(b, cfg.num_heads * d)

    @torch.inference_mode()
    def forward(
        self, batch: AttentionBatch, kv: PagedKVStore, *, all_logits: bool = False
    ) -> torch.Tensor:
        """Logits of each sequence's last new token ``[B, vocab]`` (or of every new token,
        ``[T, vocab]``, with ``all_logits``)."""
        cfg = self.config
        nh, nkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        cos, sin_signed = self._rope(batch.positions)
        x = self.embed[batch.input_ids]
        native = self.native_decode if batch.decode_only and not batch.shared_prefixes else None
        if native is not None:  # one op a layer, on all threads when it is large
            context = batch.key_valid.numel() * nkv * d
            native_call = self._heavy if context >= PARALLEL_GATHER_MIN else _call
        else:  # rows of the context blocks in a layer's store as [(K, V heads) * blocks, ...]
            head_offsets = torch.arange(2 * nkv, device=x.device)[:, None] * kv.num_blocks
            head_blocks = (head_offsets + batch.context_blocks.view(1, -1)).view(-1)
        decode_bias = None
        if batch.decode_only and native is None:  # mask of missing context, for all layers
            valid = batch.key_valid.repeat(nkv, 1)[:, None, :]  # (head, seq) major
            # Few keys in all: attention runs in fp32 (bf16 batched products cost a fixed
            # ~25 us each on the CPU, fp32 ones a third of it, which outweighs the
            # conversions); the bias carries that choice to every layer in its dtype.
            small = batch.key_valid.numel() <= FP32_ATTENTION_MAX_KEYS
            dtype = torch.float32 if self._fp32_attention and small else self.dtype
            decode_bias = torch.zeros(valid.shape, dtype=dtype, device=x.device)
            decode_bias.masked_fill_(~valid, float("-inf"))
        fused = self.native_fused
        if fused is not None:
            cos, sin_signed = cos.contiguous(), sin_signed.contiguous()
        x, h = self._add_norm(x.contiguous(), None, self.layers[0].attn_norm)
        for i, layer in enumerate(self.layers):
            qkv = self._heavy(layer.qkv, h)
            if fused is not None:
                q = fused.rope_write_kv(qkv, cos, sin_signed, kv.layers[i], batch.slot_mapping, nh)
            else:
                q = self._rope_write_kv(qkv, cos, sin_signed, kv, i, batch.slot_mapping)
            if native is not None:
                out = native_call(
                    native, q.contiguous(), kv.layers[i], batch.context_blocks,
                    batch.context_lens, kv.block_size, d**-0.5, self.products.variant,
                )  # fmt: skip
            elif batch.decode is not None:
                out = self._attend_split(q, kv, i, batch, head_blocks)
            else:
                out = self._attend(q, kv.layers[i], batch, decode_bias, head_blocks)
            x, h = self._add_norm(x, self._heavy(layer.o, out), layer.ffn_norm)
            gate, up = self._heavy(layer.gate_up, h).chunk(2, dim=-1)
            y = self._heavy(layer.down, F.silu(gate) * up)
            if i + 1 < len(self.layers):
                x, h = self._add_norm(x, y, self.layers[i + 1].attn_norm)
            else:
                x = x + y
        if not all_logits:
            x = x[batch.last_index]
        x = _rms_norm(x, self.final_norm, cfg.rms_norm_eps)
        return self._heavy(self.lm_head, x).float()

    def _add_norm(
        self, x: torch.Tensor, y: torch.Tensor | None, weight: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual ``x + y`` (``x`` alone without ``y``) and its RMSNorm.

        In bfloat16 with the native ops, one fused op that adds in place: ``x`` must be
        this step's own tensor (the embedding lookup made it). In float32, the reference
        dtype, torch's norm is kept: the native one sums the squares in another order, a
        few float32 ulps apart, which a random synthetic model amplified to 8e-3 in its
        logits against transformers (the torch path: 1e-5)."""
        fused = self.native_fused
        if fused is not None and self.dtype == torch.bfloat16:
            return x, fused.add_rms_norm_(x, y, weight, self.config.rms_norm_eps)
        if y is not None:
            x = x + y
        return x, _rms_norm(x, weight, self.config.rms_norm_eps)

    def _rope_write_kv(
        self,
        qkv: torch.Tensor,
        cos: torch.Tensor,
        sin_signed: torch.Tensor,
        kv: PagedKVStore,
        layer: int,
        slot_mapping: torch.Tensor,
    ) -> torch.Tensor:
        """Q and K rotated, K and V written to the layer's store at the new tokens' slots
        (the torch form of the native ``rope_write_kv``); returns Q ``[T, heads, dim]``."""
        cfg = self.config
        n_tokens, nh, nkv, d = qkv.shape[0], cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        qk, v = qkv.split([cfg.q_size + cfg.kv_size, cfg.kv_size], dim=-1)
        qk = _rotate(qk.reshape(n_tokens, nh + nkv, d), cos, sin_signed)
        q, k = qk[:, :nh], qk[:, nh:]
        kv.k[layer].index_copy_(1, slot_mapping, k.transpose(0, 1))
        kv.v[layer].index_copy_(1, slot_mapping, v.view(n_tokens, nkv, d).transpose(0, 1))
        return q
