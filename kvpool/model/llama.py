"""LLaMA-family decoder (llama, qwen2, qwen3, qwen3moe, gemma3) over a paged KV store.

One forward pass takes a flat batch of tokens from several sequences (a prefill chunk of
one, a single decode token of another) and their ``AttentionBatch``: where each new
token's K/V goes (``slot_mapping``) and which slots hold each sequence's context. New K/V
are written in place into the store, then each sequence attends over its own slots
(``kvpool.model.attention``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from kvpool.model.attention import AttentionBatch, StepAttention
from kvpool.model.config import ModelConfig
from kvpool.model.cpu import cpu_features
from kvpool.model.gguf_weights import QuantizedMatrix, QuantizedRows
from kvpool.model.int4_products import Int4Linear, int4_unavailable
from kvpool.model.int4_products import fits as int4_fits
from kvpool.model.kv_store import PagedKVStore
from kvpool.model.native import kernel_variant, native_ops
from kvpool.model.products import ProductPolicy, QuantLinear

# On the CPU a step's feed-forward runs over slices of at least this many tokens (a step
# of under twice this, whole): its [tokens, 2 x ffn] intermediate is the largest
# transient of a prefill (a 1B-class model's 2,000-token step peaked ~360 MiB higher
# whole). Not below the largest size ``calibrate`` measures, so a slice takes the product
# kernel the whole step would (docs/performance.md, twenty-sixth session).
FFN_SLICE_ROWS = 512


class Linear:
    """``y = x W^T (+ b)`` with a dense weight (an F32/F16/BF16 file, or any file where
    the native kernels are not built, and every device but the CPU).

    On the CPU in bfloat16 the weight is prepacked once into oneDNN's blocked layout,
    which runs the small-batch products of decoding faster than ``F.linear`` on
    the plain layout; elsewhere it is ``F.linear``.
    """

    __slots__ = ("bias", "numel_", "packed", "weight")

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None = None, prepack: bool = True
    ) -> None:
        """``prepack=False``: keep the plain layout (a tied head shares the embedding's
        tensor; a packed copy would hold the whole matrix twice)."""
        self.weight: torch.Tensor | None = weight
        self.bias = bias
        self.numel_ = weight.numel() + (bias.numel() if bias is not None else 0)
        self.packed = None
        cpu_bf16 = weight.device.type == "cpu" and weight.dtype == torch.bfloat16
        if prepack and cpu_bf16 and can_prepack():
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, 1)
            self.weight = None  # the packed copy is the only one kept

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)

    def numel(self) -> int:
        return self.numel_


# A product's weights: dense, in kvpool's kernels' blocks, or in torch's int4 layout.
Product = Linear | QuantLinear | Int4Linear


def can_prepack() -> bool:
    """Dense bf16 weights are prepacked for oneDNN only where the CPU runs bf16 products
    in hardware: elsewhere oneDNN emulates them."""
    return cpu_features().bf16_products


@dataclass
class _Experts:
    """A layer's mixture of experts (qwen3moe): a float32 ``router`` ``[experts, hidden]``
    and each expert's feed-forward, ``gate_up[e]`` ``[2 expert_ffn, hidden]`` (fused) and
    ``down[e]``. Quantized experts are views of the file's stacked blocks (one copy)."""

    router: torch.Tensor
    gate_up: list[Product]
    down: list[Product]
    used: int
    native: Any = None  # the native MixtureOfExperts of the same products (``native_for``)

    def native_for(self, ops: Any) -> Any:
        """The native ``MixtureOfExperts`` (decode_layers.h) of these experts, built once;
        None where a product is not quantized (an F16 file's experts)."""
        if self.native is None:
            products = self.gate_up + self.down
            self.native = False
            if all(isinstance(p, QuantLinear) for p in products):
                gate_up, down = _parts(self.gate_up), _parts(self.down)
                self.native = ops.MixtureOfExperts(self.router, gate_up, down, self.used)
        return self.native or None

    def numel(self) -> int:
        products = sum(p.numel() for p in self.gate_up) + sum(p.numel() for p in self.down)
        return self.router.numel() + products


@dataclass
class _Layer:
    attn_norm: torch.Tensor
    qkv: Product  # [q + 2 kv, hidden], fused
    o: Product
    ffn_norm: torch.Tensor
    gate_up: Product | None  # [2 inter, hidden], fused (None: experts)
    down: Product | None
    q_norm: torch.Tensor | None = None  # [head_dim]: each Q head's RMSNorm (qwen3)
    k_norm: torch.Tensor | None = None  # [head_dim]: each K head's
    experts: _Experts | None = None  # in place of gate_up and down (qwen3moe)
    post_attn_norm: torch.Tensor | None = None  # of attention's output (gemma3's sandwich)
    post_ffn_norm: torch.Tensor | None = None  # of the feed-forward's output


def _products(layer: _Layer) -> list[Any]:
    """Every matrix product of a layer (an expert's included)."""
    products: list[Any] = [layer.qkv, layer.o]
    if layer.experts is None:
        return [*products, layer.gate_up, layer.down]
    return products + layer.experts.gate_up + layer.experts.down


def _parts(products: list[Any]) -> list[tuple[Any, Any, Any]]:
    """``DecodeLayers``' form of quantized products: (raws, types, bias) each."""
    return [(p.raws, p.types, p.bias) for p in products]


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
        head multiplies by those same blocks. Without native kernels (a GPU, a CPU where
        they did not build), 4-bit ones become ``Int4Linear``s in bf16 (int4_products),
        the rest dense. Dense tensors become ``Linear``s."""
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

        def per_expert(names: list[str]) -> list[Product]:
            # each stacked tensor [experts, rows, cols] cut into its experts' matrices
            stacks = [weights.pop(name) for name in names]
            cut = [
                m.split(config.experts) if isinstance(m, QuantizedMatrix) else list(m.unbind(0))
                for m in stacks
            ]
            return [product(list(parts)) for parts in zip(*cut, strict=True)]

        def experts(p: str) -> _Experts:
            router = weights.pop(p + "ffn_gate_inp.weight")
            if isinstance(router, QuantizedMatrix):
                router = router.dequantize()
            return _Experts(
                router.to(device=device, dtype=torch.float32).contiguous(),
                per_expert([p + "ffn_gate_exps.weight", p + "ffn_up_exps.weight"]),
                per_expert([p + "ffn_down_exps.weight"]),
                config.experts_used,
            )

        def linear(names: list[str], bias: torch.Tensor | None = None) -> Product:
            return product([weights.pop(name) for name in names], bias)

        # kvpool's kernels multiply the blocks on the CPU where they are built; elsewhere
        # (a GPU, a CPU without them) torch's int4 kernels take the 4-bit formats in bf16
        native = device.type == "cpu" and native_ops() is not None
        int4 = not native and dtype == torch.bfloat16 and int4_unavailable(device) is None

        def product(parts: list[Any], bias: torch.Tensor | None = None) -> Product:
            if native and all(isinstance(p, QuantizedMatrix) for p in parts):
                return QuantLinear(parts, bias, self.products)  # type: ignore[arg-type]
            if int4 and int4_fits(parts):
                try:
                    return Int4Linear(parts, bias, device)
                except RuntimeError:  # a shape this device's int4 kernels refuse: dense
                    pass
            # each part to the device first: a GPU's dense parts are made there, the blocks
            # of 4-bit parts fused with them (a QKV with a 6-bit V) dequantize on the CPU
            dense = [
                (p.dequantize() if isinstance(p, QuantizedMatrix) else p).to(device, dtype)
                for p in parts
            ]
            return Linear(torch.cat(dense).contiguous(), bias)

        embedding = weights.get("token_embd.weight")
        if isinstance(embedding, QuantizedMatrix) and native:
            weights.pop("token_embd.weight")
            self.embed: torch.Tensor | QuantizedRows = QuantizedRows(embedding, dtype)
            if config.tie_word_embeddings:
                self.lm_head: Product = QuantLinear(
                    [embedding], None, self.products, float_out=True
                )
        else:
            self.embed = w("token_embd.weight")
            if config.tie_word_embeddings:
                self.lm_head = Linear(self.embed, prepack=False)
        if not config.tie_word_embeddings:
            self.lm_head = linear(["output.weight"])
            if isinstance(self.lm_head, QuantLinear):
                self.lm_head.float_out = True  # float32 logits (no bf16 rounding, no ties)
        self.final_norm = w("output_norm.weight")
        sandwich = config.sandwich_norms
        self.layers: list[_Layer] = []
        for i in range(config.num_layers):
            p = f"blk.{i}."
            bias = None
            if config.attention_bias:
                bias = torch.cat([w(p + "attn_q.bias"), w(p + "attn_k.bias"), w(p + "attn_v.bias")])
            moe = experts(p) if config.experts else None
            self.layers.append(
                _Layer(
                    attn_norm=w(p + "attn_norm.weight"),
                    qkv=linear(
                        [p + n for n in ("attn_q.weight", "attn_k.weight", "attn_v.weight")], bias
                    ),
                    o=linear([p + "attn_output.weight"]),
                    ffn_norm=w(p + "ffn_norm.weight"),
                    gate_up=None if moe else linear([p + "ffn_gate.weight", p + "ffn_up.weight"]),
                    down=None if moe else linear([p + "ffn_down.weight"]),
                    q_norm=w(p + "attn_q_norm.weight") if config.qk_norm else None,
                    k_norm=w(p + "attn_k_norm.weight") if config.qk_norm else None,
                    experts=moe,
                    post_attn_norm=w(p + "post_attention_norm.weight") if sandwich else None,
                    post_ffn_norm=w(p + "post_ffw_norm.weight") if sandwich else None,
                )
            )
        d = config.head_dim
        exponents = torch.arange(0, d, 2, dtype=torch.float32) / d
        inv_freq = 1.0 / (config.rope_theta**exponents) / config.rope_linear_scale
        if "rope_freqs.weight" in weights:  # Llama-3 scaling, precomputed by the converter
            inv_freq = inv_freq / weights.pop("rope_freqs.weight").float().cpu()
        self.inv_freq = inv_freq.to(device)
        # Sliding-window (local) layers (gemma3): each layer's window, 0 for a global one,
        # and the local layers' rotary frequencies (their own base, no scaling)
        self._windows = [config.layer_window(i) for i in range(config.num_layers)]
        self._embedding_scale: torch.Tensor | None = None  # the embedding's factor, made once
        if config.embedding_scale != 1.0:
            self._embedding_scale = torch.tensor(config.embedding_scale, dtype=dtype)
        self.inv_freq_local: torch.Tensor | None = None
        if config.rope_local_theta:
            self.inv_freq_local = (1.0 / config.rope_local_theta**exponents).to(device)
        self._buffer: torch.Tensor | None = None  # scratch for gathered K/V (attention.attend)
        self.source_path: Path | None = None  # the file it was loaded from (loader sets it)
        self.device_bytes: int | None = None  # on a GPU, its bytes there (loader measures)
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
        # The layers as one native call for decode steps (``_native_layers``): built at
        # the first step that can take it; False where the model cannot.
        self._decode_layers: Any = None

    def matrix_products(self) -> list[Any]:
        """The head's product and every layer's (experts' included)."""
        return [self.lm_head, *(p for layer in self.layers for p in _products(layer))]

    def layer_products(self, index: int) -> list[Any]:
        """Every matrix product of layer ``index`` (experts' included)."""
        return _products(self.layers[index])

    def step_products(self, index: int) -> list[Any]:
        """The matrix products one token runs in layer ``index``: all of them, but of a
        mixture of experts only ``used`` experts' (spread evenly over them: which ones a
        token takes is the router's, and every expert is the same shape and format)."""
        layer = self.layers[index]
        if layer.experts is None:
            return _products(layer)
        experts = layer.experts
        count = len(experts.gate_up)
        chosen = [e * count // experts.used for e in range(min(experts.used, count))]
        return [
            layer.qkv,
            layer.o,
            *(p for e in chosen for p in (experts.gate_up[e], experts.down[e])),
        ]

    @property
    def windows(self) -> list[int]:
        """Each layer's window (0: global)."""
        return self._windows

    @windows.setter
    def windows(self, windows: list[int]) -> None:
        """New windows (tests): the native call, which holds them, is built again."""
        self._windows = list(windows)
        self._decode_layers = None

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
            if layer.post_attn_norm is not None and layer.post_ffn_norm is not None:
                n += layer.post_attn_norm.numel() + layer.post_ffn_norm.numel()
            products = (layer.qkv, layer.o, layer.gate_up, layer.down)
            n += sum(lin.numel() for lin in products if lin is not None)
            if layer.experts is not None:
                n += layer.experts.numel()
            if layer.q_norm is not None and layer.k_norm is not None:
                n += layer.q_norm.numel() + layer.k_norm.numel()
        return n

    def _rope(
        self, positions: torch.Tensor, inv_freq: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos`` and ``sin_signed`` (see ``_rotate``) of each position, ``[T, 1, dim]``
        (``inv_freq``: other frequencies than the global layers')."""
        inv_freq = self.inv_freq if inv_freq is None else inv_freq
        freqs = positions.float()[:, None] * inv_freq[None, :]
        cos, sin = freqs.cos(), freqs.sin()
        cos = torch.cat((cos, cos), dim=-1).to(self.dtype)
        sin_signed = torch.cat((-sin, sin), dim=-1).to(self.dtype)
        return cos[:, None, :], sin_signed[:, None, :]

    @torch.inference_mode()
    def forward(
        self,
        batch: AttentionBatch,
        kv: PagedKVStore,
        *,
        all_logits: bool = False,
        return_hidden: bool = False,
        rows: torch.Tensor | None = None,
    ) -> Any:
        """Logits of each sequence's last new token ``[B, vocab]`` (or of every new token,
        ``[T, vocab]``, with ``all_logits``; or of the new tokens ``rows`` names); with
        ``return_hidden``, ``(logits, hidden)``, ``hidden`` the final-normed hidden
        states of the same rows (embeddings)."""
        cos, sin_signed = self._rope(batch.positions)
        x = self.embed[batch.input_ids].contiguous()  # the step's own: updated in place
        if self._embedding_scale is not None:  # (gemma3: sqrt(hidden), in the dtype)
            x = x * self._embedding_scale
        attention = StepAttention(self, batch, kv)
        if self.native_fused is not None:
            cos, sin_signed = cos.contiguous(), sin_signed.contiguous()
        local = None  # the local layers' rotation (gemma3)
        if self.inv_freq_local is not None:
            local = tuple(t.contiguous() for t in self._rope(batch.positions, self.inv_freq_local))
        # a decode step whose attention is one native op a layer
        single = attention.native is not None or attention.varlen_decode
        layers = self._native_layers() if single else None
        if layers is not None:  # every layer in one call: ``_layers``, op for op
            tables, lens = batch.context_blocks, batch.context_lens
            starts = None
            if attention.varlen_decode:  # paged_attention's (every token through it)
                starts, tables, lens, _ = batch.varlen  # type: ignore[misc]
            x = layers.run(
                x, cos, sin_signed, batch.slot_mapping, tables, lens, kv.layers, kv.block_size,
                self.products.mode(x.shape[0]), self.heavy_threads, attention.native_heavy,
                self.products.variant, starts, self._int8_max_rows(), *(local or ()),
            )  # fmt: skip
        else:
            x = self._layers(x, batch, kv, attention, (cos, sin_signed), local)
        if rows is not None:
            x = x[rows]
        elif not all_logits:
            x = x[batch.last_index]
        _, x = self._add_norm(x.contiguous(), None, self.final_norm)
        logits = self._heavy(self.lm_head, x).float()
        return (logits, x) if return_hidden else logits

    def _layers(
        self,
        x: torch.Tensor,
        batch: AttentionBatch,
        kv: PagedKVStore,
        attention: StepAttention,
        rope: tuple[torch.Tensor, torch.Tensor],
        local: tuple[torch.Tensor, ...] | None = None,
    ) -> torch.Tensor:
        """The residual stream ``x`` (the step's own tensor) through every layer
        (``rope``: the rotation's ``cos`` and ``sin_signed``; ``local``: the sliding-window
        layers' own, where they have one)."""
        nh = self.config.num_heads
        fused = self.native_fused
        x, h = self._add_norm(x, None, self.layers[0].attn_norm)
        for i, layer in enumerate(self.layers):
            cos, sin_signed = local if local is not None and self.windows[i] else rope
            qkv = self._heavy(layer.qkv, h)
            if layer.q_norm is not None:
                qkv = self._qk_norm(qkv, layer)
            if fused is not None:
                q = fused.rope_write_kv(qkv, cos, sin_signed, kv.layers[i], batch.slot_mapping, nh)
            else:
                q = self._rope_write_kv(qkv, cos, sin_signed, kv, i, batch.slot_mapping)
            out = self._heavy(layer.o, attention(q, i))
            if layer.post_attn_norm is not None:
                out = self._norm(out, layer.post_attn_norm)
            x, h = self._add_norm(x, out, layer.ffn_norm)
            y = self._feed_forward(h, layer)
            if layer.post_ffn_norm is not None:
                y = self._norm(y, layer.post_ffn_norm)
            if i + 1 < len(self.layers):
                x, h = self._add_norm(x, y, self.layers[i + 1].attn_norm)
            else:
                x = x + y
        return x

    def _native_layers(self) -> Any:
        """``DecodeLayers`` (decode_layers.h): ``_layers`` for a decode step whose
        attention is the native decode op, in one native call, op for op the same (bit
        for bit: tested). None where ``_layers`` runs instead: no native ops (now),
        float32 (the reference keeps torch's norms), dense products. gemma3's layers take
        their windows, rotations, sandwich norms and gelu into it (``shape_last_layer``).
        Built once, on the first step that can take it, from the layers as they are
        then (their weights and biases do not change after load); setting ``windows``
        drops it, so it is built again with them."""
        ops = self.native_fused
        if ops is None:  # (a test may take them away for a while: nothing is decided)
            return None
        cfg = self.config
        if cfg.shaped_layers and not cfg.sandwich_norms:  # (no such files)
            return None
        if self._decode_layers is None:
            products = [_products(lr) for lr in self.layers]
            quantized = all(isinstance(p, QuantLinear) for ps in products for p in ps)
            self._decode_layers = False
            if self.dtype == torch.bfloat16 and quantized:
                stack = ops.DecodeLayers(cfg.num_heads, cfg.rms_norm_eps, cfg.scale)
                for i, layer in enumerate(self.layers):
                    norms = (layer.attn_norm, layer.ffn_norm)
                    qk = (layer.q_norm, layer.k_norm)
                    moe = layer.experts
                    if moe is None:
                        parts = _parts([layer.qkv, layer.o, layer.gate_up, layer.down])
                        stack.add_layer(*norms, parts, *qk)
                    else:
                        parts = _parts([layer.qkv, layer.o])
                        stack.add_moe_layer(*norms, parts, *qk, moe.native_for(ops))
                    if cfg.shaped_layers:
                        window = self.windows[i]
                        stack.shape_last_layer(
                            layer.post_attn_norm, layer.post_ffn_norm, window,
                            bool(window) and self.inv_freq_local is not None,
                            cfg.activation == "gelu_tanh",
                        )  # fmt: skip
                self._decode_layers = stack
        return self._decode_layers or None

    def _feed_forward(self, h: torch.Tensor, layer: _Layer) -> torch.Tensor:
        """The layer's feed-forward of the normed hidden states ``h``: one, or the
        token's chosen experts (``_mixture``)."""
        if layer.experts is not None:
            return self._heavy(self._mixture, h, layer.experts)
        rows = h.shape[0]
        if rows >= 2 * FFN_SLICE_ROWS and self.device.type == "cpu":  # (not a GPU's)
            # slices never under a crossover set higher: each takes the step's kernel
            least = max(FFN_SLICE_ROWS, (self.products.int8_max_rows or 0) + 1)
            if rows >= 2 * least:
                parts = h.tensor_split(rows // least)
                return torch.cat([self._dense_feed_forward(part, layer) for part in parts])
        return self._dense_feed_forward(h, layer)

    def _dense_feed_forward(self, h: torch.Tensor, layer: _Layer) -> torch.Tensor:
        assert layer.gate_up is not None and layer.down is not None
        gate_up = self._heavy(layer.gate_up, h)
        if self.config.activation == "gelu_tanh":  # gemma3: gelu (tanh form) of the gate
            gate, up = gate_up.chunk(2, dim=-1)
            return self._heavy(layer.down, F.gelu(gate, approximate="tanh") * up)
        return self._heavy(layer.down, self._silu_mul(gate_up))

    def _int8_max_rows(self) -> int:
        """The native ops' form of the policy's crossover: -1 where every size is int8."""
        rows = self.products.int8_max_rows
        return -1 if rows is None or self.products.exact else rows

    def _mixture(self, h: torch.Tensor, experts: _Experts) -> torch.Tensor:
        """Each token's ``experts_used`` experts of the highest router probability
        (softmax over all experts, in float32), their outputs weighted by those
        probabilities renormalized to sum to 1 (llama.cpp's qwen3moe and Mixtral,
        transformers' ``norm_topk_prob``). The tokens routed to one expert go through
        it as one product, experts in ascending order, and each token's weighted sum
        accumulates in float32 in that order.

        In bfloat16 with the native ops and quantized experts, one native call
        (``MixtureOfExperts``, the one ``DecodeLayers`` calls: the same arithmetic, its
        routing in plain loops: within float32 rounding of this one), and so in a
        batch-invariant model of any dtype (each token's routing computed in an order of
        its own; torch's router product sums in an order that changes with the rows);
        in float32, the reference dtype, torch's ops below."""
        fused = self.native_fused
        if fused is not None and (self.dtype == torch.bfloat16 or self.products.fixed):
            native = experts.native_for(fused)
            if native is not None:
                mode = self.products.mode(h.shape[0])
                return native.run(h, mode, self._int8_max_rows(), self.products.variant)
        k = experts.used
        probs = F.linear(h.float(), experts.router).softmax(dim=-1)
        weights, chosen = probs.topk(k, dim=-1)
        weights = (weights / weights.sum(dim=-1, keepdim=True)).flatten()
        out = torch.zeros(h.shape[0], h.shape[1], dtype=torch.float32, device=h.device)
        flat = chosen.flatten()
        order = flat.argsort(stable=True)
        counts = torch.bincount(flat, minlength=len(experts.down)).tolist()
        begin = 0
        for e, n in enumerate(counts):
            if not n:
                continue
            picks = order[begin : begin + n]
            begin += n
            tokens = picks // k
            x = h[tokens] if h.shape[0] > 1 else h
            y = experts.down[e](self._silu_mul(experts.gate_up[e](x)))
            out.index_add_(0, tokens, y.float() * weights[picks, None])
        return out.to(h.dtype)

    def _silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` of ``[gate | up]`` rows. In bfloat16 with the native ops, one
        pass (the CPU's row kernel) instead of torch's chunk, silu and multiply; its exp is
        not torch's, which bf16's rounding hides (in 0.2% of values one bf16 ulp apart).
        In float32, the reference dtype, torch's ops are kept."""
        fused = self.native_fused
        if fused is not None and self.dtype == torch.bfloat16 and gate_up.is_contiguous():
            return fused.silu_mul(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def _qk_norm(self, qkv: torch.Tensor, layer: _Layer) -> torch.Tensor:
        """``[q | k | v]`` rows with each Q head and each K head RMS-normed over the head
        dimension by the layer's weights (qwen3: after the product, before the rotation).
        In bfloat16 with the native ops, one pass (``head_rms_norm``, the row kernels'
        norm); in float32, the reference dtype, torch's norm, as ``_add_norm`` keeps it."""
        cfg = self.config
        fused = self.native_fused
        assert layer.q_norm is not None and layer.k_norm is not None
        if fused is not None and self.dtype == torch.bfloat16:
            return fused.head_rms_norm(
                qkv, layer.q_norm, layer.k_norm, cfg.num_heads, cfg.num_kv_heads, cfg.rms_norm_eps
            )
        t, d, eps = qkv.shape[0], cfg.head_dim, cfg.rms_norm_eps
        q, k, v = qkv.split([cfg.q_size, cfg.kv_size, cfg.kv_size], dim=-1)
        q = _rms_norm(q.reshape(t, cfg.num_heads, d), layer.q_norm, eps).reshape(t, -1)
        k = _rms_norm(k.reshape(t, cfg.num_kv_heads, d), layer.k_norm, eps).reshape(t, -1)
        return torch.cat([q, k, v], dim=-1)

    def _norm(self, y: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """RMSNorm of a fresh tensor ``y`` (gemma3's post-attention and post-feed-forward
        norms), by ``_add_norm``'s path."""
        return self._add_norm(y.contiguous(), None, weight)[1]

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
