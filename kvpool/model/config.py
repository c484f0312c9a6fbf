"""Model configuration read from GGUF metadata."""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvpool.cache import ModelGeometry
from kvpool.formats.gguf_header import GGUFHeader

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3", "qwen3moe", "gemma3")
# Gemma 3's layers: five local (sliding-window) layers to one global, unless the file says
# otherwise; the local layers' rotary base (llama.cpp and transformers fix both)
GEMMA3_SLIDING_PERIOD = 6
GEMMA3_LOCAL_ROPE_THETA = 10000.0


class UnsupportedModel(ValueError):
    """A GGUF file whose architecture or layout this runtime does not run."""


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    name: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    context_length: int
    tie_word_embeddings: bool
    attention_bias: bool  # q/k/v biases (qwen2)
    qk_norm: bool = False  # per-head RMSNorm of Q and K before the rotation (qwen3)
    # A mixture of experts in place of each layer's feed-forward (qwen3moe): each token
    # goes through ``experts_used`` of ``experts`` feed-forwards of ``expert_ffn`` wide,
    # chosen and weighted by a router (0: one dense feed-forward of ``intermediate_size``).
    experts: int = 0
    experts_used: int = 0
    expert_ffn: int = 0
    # Gemma 3 (gemma3): local layers attend over the last ``sliding_window`` positions
    # (the query's own included), every ``sliding_period``-th layer over all of them;
    # local layers rotate with base ``rope_local_theta``; global layers' positions are
    # divided by ``rope_linear_scale`` (the file's linear rope scaling, any architecture).
    sliding_window: int = 0  # 0: every layer global
    sliding_period: int = 0
    rope_local_theta: float = 0.0  # 0: rope_theta
    rope_linear_scale: float = 1.0
    attention_scale: float = 0.0  # the scores' factor (0: head_dim ** -0.5)
    embedding_scale: float = 1.0  # the token embedding's factor (gemma3: sqrt(hidden))
    sandwich_norms: bool = False  # an RMSNorm after attention and after the feed-forward too
    activation: str = "silu"  # of the gate: "silu", or "gelu_tanh" (gemma3)

    @property
    def scale(self) -> float:
        """The attention scores' factor."""
        return self.attention_scale or self.head_dim**-0.5

    @property
    def shaped_layers(self) -> bool:
        """Layers shaped as Gemma 3's: any of windows, sandwich norms, a gate other than
        silu. (No file has one of them without the sandwich norms; their parts come
        together.)"""
        return bool(self.sliding_window or self.sandwich_norms or self.activation != "silu")

    def layer_window(self, layer: int) -> int:
        """Keys a query of ``layer`` sees, its own included (0: its whole context)."""
        if not self.sliding_window or (layer + 1) % self.sliding_period == 0:
            return 0
        return self.sliding_window

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def kv_geometry(self, dtype_bytes: float) -> ModelGeometry:
        return ModelGeometry(self.num_layers, self.num_kv_heads, self.head_dim, dtype_bytes)

    def tensor_shapes(self) -> dict[str, tuple[int | None, ...]]:
        """Every tensor the runtime reads, by GGUF name, with the shape this config needs
        (ggml's order: the contiguous dimension first); None where any positive size goes
        (the vocabulary's rows: an embedding may have more rows than the tokenizer has
        tokens; the head has as many as the embedding)."""
        h, q, kv, d = self.hidden_size, self.q_size, self.kv_size, self.head_dim
        shapes: dict[str, tuple[int | None, ...]] = {
            "token_embd.weight": (h, None),
            "output_norm.weight": (h,),
        }
        if not self.tie_word_embeddings:
            shapes["output.weight"] = (h, None)
        for i in range(self.num_layers):
            p = f"blk.{i}."
            shapes |= {
                p + "attn_norm.weight": (h,),
                p + "attn_q.weight": (h, q),
                p + "attn_k.weight": (h, kv),
                p + "attn_v.weight": (h, kv),
                p + "attn_output.weight": (q, h),
                p + "ffn_norm.weight": (h,),
            }
            if self.attention_bias:
                shapes |= {p + "attn_q.bias": (q,), p + "attn_k.bias": (kv,)}
                shapes[p + "attn_v.bias"] = (kv,)
            if self.qk_norm:
                shapes |= {p + "attn_q_norm.weight": (d,), p + "attn_k_norm.weight": (d,)}
            if self.sandwich_norms:
                shapes |= {p + "post_attention_norm.weight": (h,), p + "post_ffw_norm.weight": (h,)}
            if self.experts:
                e, f = self.experts, self.expert_ffn
                shapes |= {p + "ffn_gate_inp.weight": (h, e), p + "ffn_down_exps.weight": (f, h, e)}
                shapes |= {
                    p + "ffn_gate_exps.weight": (h, f, e),
                    p + "ffn_up_exps.weight": (h, f, e),
                }
            else:
                f = self.intermediate_size
                shapes |= {p + "ffn_gate.weight": (h, f), p + "ffn_up.weight": (h, f)}
                shapes[p + "ffn_down.weight"] = (f, h)
        return shapes

    def check_tensors(self, header: GGUFHeader) -> None:
        """Raises ``UnsupportedModel`` where the file lacks a tensor the runtime reads, or
        holds one of another shape than its metadata says (a damaged or mislabelled
        file): before any data is read, and before a kernel meets a matrix of the wrong
        width. Tensors the runtime does not read are not checked."""
        found = {t.name: t for t in header.tensors}
        geometry = (
            f"{self.architecture}, hidden {self.hidden_size}, {self.num_heads} heads / "
            f"{self.num_kv_heads} KV heads of {self.head_dim}"
        )
        for name, want in self.tensor_shapes().items():
            tensor = found.get(name)
            if tensor is None:
                raise UnsupportedModel(f"the file has no tensor {name!r} ({geometry})")
            got = tensor.shape
            if len(got) != len(want) or any(
                g != w if w is not None else g <= 0 for g, w in zip(got, want, strict=True)
            ):
                shown = ", ".join("n" if w is None else str(w) for w in want)
                raise UnsupportedModel(
                    f"tensor {name!r} is [{', '.join(map(str, got))}], where the file's "
                    f"metadata ({geometry}) needs [{shown}]"
                )
        head = found.get("output.weight")  # (its logits' ids go back into the embedding)
        if head is not None and head.shape[1] != found["token_embd.weight"].shape[1]:
            raise UnsupportedModel(
                f"the head's {head.shape[1]} rows ('output.weight') are not the token "
                f"embedding's {found['token_embd.weight'].shape[1]}"
            )
        rope = found.get("rope_freqs.weight")  # (Llama 3's scaling, where the file has it)
        if rope is not None and rope.shape != (self.head_dim // 2,):
            raise UnsupportedModel(
                f"tensor 'rope_freqs.weight' is {list(rope.shape)}, where heads of "
                f"{self.head_dim} need [{self.head_dim // 2}]"
            )

    @classmethod
    def from_gguf(cls, header: GGUFHeader) -> ModelConfig:
        arch = header.architecture
        if arch not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModel(
                f"architecture {arch!r} is not supported (supported: "
                f"{', '.join(SUPPORTED_ARCHITECTURES)})"
            )
        window = int(header.arch_value("attention.sliding_window", 0) or 0)
        if window and arch != "gemma3":
            raise UnsupportedModel(f"sliding-window attention in a {arch} file is not supported")
        names = {t.name for t in header.tensors}
        hidden = _count(header, "embedding_length")
        heads = _count(header, "attention.head_count")
        kv_heads = header.arch_value("attention.head_count_kv", heads)
        if isinstance(kv_heads, list):
            raise UnsupportedModel("per-layer KV head counts are not supported")
        kv_heads = _count(header, "attention.head_count_kv", heads)
        if heads % kv_heads:
            raise UnsupportedModel(f"{heads} heads do not share {kv_heads} KV heads evenly")
        head_dim = _count(header, "attention.key_length", hidden // heads)
        if head_dim % 2:
            raise UnsupportedModel(f"heads of {head_dim} (odd) cannot be rotated")
        if _count(header, "attention.value_length", head_dim) != head_dim:
            raise UnsupportedModel("value heads of another width than key heads are not supported")
        experts = int(header.arch_value("expert_count", 0) or 0)
        if experts and arch != "qwen3moe":  # (Mixtral's llama files: other routing defaults)
            raise UnsupportedModel(f"a mixture of experts in a {arch} file is not supported")
        if experts and (
            header.arch_value("expert_shared_count") or "blk.0.ffn_gate_shexp.weight" in names
        ):
            raise UnsupportedModel("shared experts are not supported")
        if experts and "blk.0.ffn_gate_exps.weight" not in names:
            raise UnsupportedModel("experts in another layout than ffn_*_exps are not supported")
        expert_ffn, experts_used = 0, 0
        if experts:
            gate = next(t for t in header.tensors if t.name == "blk.0.ffn_gate_exps.weight")
            if len(gate.shape) != 3:
                raise UnsupportedModel(
                    f"experts' tensor 'blk.0.ffn_gate_exps.weight' is {gate.shape}"
                )
            expert_ffn = _count(header, "expert_feed_forward_length", gate.shape[1])
            experts_used = int(header.arch_value("expert_used_count", 0) or 0)
            if not 0 < experts_used <= experts:
                raise UnsupportedModel(f"{experts_used} experts used of {experts}")
        # linear rope scaling divides positions (others, such as yarn for contexts past
        # the trained length, are not applied: contexts within it are unchanged)
        scaling = header.arch_value("rope.scaling.type")
        linear = _positive_float(header, "rope.scaling.factor", 1.0, zero=True)
        gemma3 = arch == "gemma3"
        period = header.arch_value("attention.sliding_window_pattern", GEMMA3_SLIDING_PERIOD)
        if not isinstance(period, int) or period < 1:
            raise UnsupportedModel(f"sliding window pattern {period!r} is not supported")
        layers = _count(header, "block_count")
        scale = float(header.arch_value("attention.scale", 0.0) or 0.0)
        if not math.isfinite(scale) or scale < 0:
            raise UnsupportedModel(f"the file's {arch}.attention.scale is {scale}")
        if gemma3 and not scale and layers == 62:
            # Gemma 3 27B scales by hidden / heads (168), not its head width (128); the
            # file does not say so (llama.cpp tells the 27B by its 62 layers, as here)
            scale = (hidden / heads) ** -0.5
        tokens = header.metadata.get("tokenizer.ggml.tokens")
        vocab = int(header.arch_value("vocab_size", len(tokens) if tokens else 0))
        if not vocab:
            embd = next((t for t in header.tensors if t.name == "token_embd.weight"), None)
            if embd is None or len(embd.shape) != 2:
                raise UnsupportedModel("the file has neither a vocabulary nor a token embedding")
            vocab = int(embd.shape[1])
        return cls(
            architecture=arch,
            name=str(header.metadata.get("general.name", header.path.stem)),
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=_count(header, "feed_forward_length", expert_ffn or None),
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=int(kv_heads),
            head_dim=head_dim,
            rms_norm_eps=_positive_float(header, "attention.layer_norm_rms_epsilon", 1e-5),
            rope_theta=_positive_float(header, "rope.freq_base", 10000.0),
            context_length=_count(header, "context_length", 4096),
            tie_word_embeddings="output.weight" not in names,
            attention_bias="blk.0.attn_q.bias" in names,
            qk_norm="blk.0.attn_q_norm.weight" in names,
            experts=experts,
            experts_used=experts_used,
            expert_ffn=expert_ffn,
            sliding_window=window,
            sliding_period=period if window else 0,
            rope_local_theta=GEMMA3_LOCAL_ROPE_THETA if gemma3 else 0.0,
            rope_linear_scale=linear if scaling == "linear" else 1.0,
            attention_scale=scale,
            embedding_scale=hidden**0.5 if gemma3 else 1.0,
            sandwich_norms="blk.0.post_attention_norm.weight" in names,
            activation="gelu_tanh" if gemma3 else "silu",
        )


def _count(header: GGUFHeader, key: str, default: int | None = None) -> int:
    """The architecture's ``key``: a positive integer (``default`` where the file has
    none; a file with neither is refused, as is any other value: a damaged header)."""
    value = header.arch_value(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        shown = "missing" if value is None else repr(value)
        raise UnsupportedModel(
            f"the file's {header.architecture}.{key} is {shown}, not a positive integer"
        )
    return value


def _positive_float(header: GGUFHeader, key: str, default: float, zero: bool = False) -> float:
    """The architecture's ``key``: a finite positive number (``default`` where the file
    has none, or with ``zero`` a zero), as a float; a NaN, an infinity or a negative one
    (a damaged header) is refused: it would make every logit NaN."""
    value = header.arch_value(key, default)
    if zero and value == 0:
        value = default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise UnsupportedModel(f"the file's {header.architecture}.{key} is {value!r}")
    if not math.isfinite(value) or value <= 0:
        raise UnsupportedModel(f"the file's {header.architecture}.{key} is {value}")
    return float(value)
