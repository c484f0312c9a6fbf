"""LLaMA-family decoder (llama, qwen2) over a paged KV store.

One forward pass takes a flat batch of tokens from several sequences (a prefill chunk of
one, a single decode token of another) and their ``AttentionBatch``: where each new
token's K/V goes (``slot_mapping``) and which slots hold each sequence's context. New K/V
are written in place into the store, then each sequence attends over its own slots. The
store is never padded; only the attention compute pads queries and keys to the batch's
longest, with a mask.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvpool.model.config import ModelConfig
from kvpool.model.kv_store import PagedKVStore


@dataclass
class AttentionBatch:
    """Index tensors for one forward pass over ``T`` new tokens of ``B`` sequences."""

    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T] absolute position of each new token
    slot_mapping: torch.Tensor  # [T] KV slot each new token is written to
    query_index: torch.Tensor  # [B, Qmax] flat index of each sequence's i-th new token
    query_valid: torch.Tensor  # [B, Qmax] bool
    context_slots: torch.Tensor  # [B, Lmax] KV slot of each context position
    attn_mask: torch.Tensor  # [B, 1, Qmax, Lmax] bool, True = may attend
    last_index: torch.Tensor  # [B] flat index of each sequence's last new token
    key_valid: torch.Tensor  # [B, Lmax] bool: context position exists
    decode_only: bool  # every sequence brings exactly one new token


@dataclass
class _Layer:
    attn_norm: torch.Tensor
    qkv: torch.Tensor  # [q + 2 kv, hidden], fused
    qkv_bias: torch.Tensor | None
    o: torch.Tensor
    ffn_norm: torch.Tensor
    gate_up: torch.Tensor  # [2 inter, hidden], fused
    down: torch.Tensor


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class LlamaModel:
    def __init__(
        self,
        config: ModelConfig,
        weights: dict[str, torch.Tensor],
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        self.config = config
        self.device = device
        self.dtype = dtype

        def w(name: str) -> torch.Tensor:
            return weights[name].to(device=device, dtype=dtype).contiguous()

        self.embed = w("token_embd.weight")
        self.lm_head = self.embed if config.tie_word_embeddings else w("output.weight")
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
                    qkv=torch.cat(
                        [w(p + "attn_q.weight"), w(p + "attn_k.weight"), w(p + "attn_v.weight")]
                    ),
                    qkv_bias=bias,
                    o=w(p + "attn_output.weight"),
                    ffn_norm=w(p + "ffn_norm.weight"),
                    gate_up=torch.cat([w(p + "ffn_gate.weight"), w(p + "ffn_up.weight")]),
                    down=w(p + "ffn_down.weight"),
                )
            )
        d = config.head_dim
        inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
        if "rope_freqs.weight" in weights:  # Llama-3 scaling, precomputed by the converter
            inv_freq = inv_freq / weights["rope_freqs.weight"].float()
        self.inv_freq = inv_freq.to(device)

    @property
    def num_parameters(self) -> int:
        n = self.embed.numel() + self.final_norm.numel()
        if self.lm_head is not self.embed:
            n += self.lm_head.numel()
        for layer in self.layers:
            n += sum(
                t.numel()
                for t in (
                    layer.attn_norm,
                    layer.qkv,
                    layer.o,
                    layer.ffn_norm,
                    layer.gate_up,
                    layer.down,
                )
            )
            if layer.qkv_bias is not None:
                n += layer.qkv_bias.numel()
        return n

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(self.dtype), emb.sin().to(self.dtype)

    def _attend(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: AttentionBatch
    ) -> torch.Tensor:
        """Each sequence's new queries over its own context slots -> ``[T, heads * dim]``."""
        cfg = self.config
        nh, nkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        b, length = batch.context_slots.shape
        flat = batch.context_slots.view(-1)
        keys = k_cache.index_select(0, flat).view(b, length, nkv, d)
        values = v_cache.index_select(0, flat).view(b, length, nkv, d).transpose(1, 2)
        if batch.decode_only:
            # One query per sequence: two small batched matmuls beat the flash kernel,
            # whose blocking is made for long query runs. Heads of a KV group share keys.
            queries = q.view(b, nkv, nh // nkv, d)
            scores = torch.matmul(queries, keys.permute(0, 2, 3, 1)) * (d**-0.5)
            scores = scores.masked_fill(~batch.key_valid[:, None, None, :], float("-inf"))
            probs = torch.softmax(scores.float(), dim=-1).to(values.dtype)
            return torch.matmul(probs, values).reshape(b, nh * d)
        queries = q[batch.query_index].transpose(1, 2)  # [B, nh, Q, d]
        out = F.scaled_dot_product_attention(
            queries, keys.transpose(1, 2), values, attn_mask=batch.attn_mask, enable_gqa=True
        )
        return out.transpose(1, 2)[batch.query_valid].reshape(q.shape[0], nh * d)

    @torch.inference_mode()
    def forward(
        self, batch: AttentionBatch, kv: PagedKVStore, *, all_logits: bool = False
    ) -> torch.Tensor:
        """Logits of each sequence's last new token ``[B, vocab]`` (or of every new token,
        ``[T, vocab]``, with ``all_logits``)."""
        cfg = self.config
        n_tokens = batch.input_ids.shape[0]
        nh, nkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        cos, sin = self._rope(batch.positions)
        cos, sin = cos[:, None, :], sin[:, None, :]
        x = self.embed[batch.input_ids]
        for i, layer in enumerate(self.layers):
            h = _rms_norm(x, layer.attn_norm, cfg.rms_norm_eps)
            qkv = F.linear(h, layer.qkv, layer.qkv_bias)
            q, k, v = qkv.split([cfg.q_size, cfg.kv_size, cfg.kv_size], dim=-1)
            q = q.view(n_tokens, nh, d)
            k = k.view(n_tokens, nkv, d)
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
            k_cache, v_cache = kv.k[i], kv.v[i]
            k_cache.index_copy_(0, batch.slot_mapping, k)
            v_cache.index_copy_(0, batch.slot_mapping, v.view(n_tokens, nkv, d))
            out = self._attend(q, k_cache, v_cache, batch)
            x = x + F.linear(out, layer.o)
            h = _rms_norm(x, layer.ffn_norm, cfg.rms_norm_eps)
            gate, up = F.linear(h, layer.gate_up).chunk(2, dim=-1)
            x = x + F.linear(F.silu(gate) * up, layer.down)
        if not all_logits:
            x = x[batch.last_index]
        x = _rms_norm(x, self.final_norm, cfg.rms_norm_eps)
        return F.linear(x, self.lm_head).float()
