"""Model configuration read from GGUF metadata."""

from __future__ import annotations

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
        hidden = int(header.arch_value("embedding_length"))
        heads = int(header.arch_value("attention.head_count"))
        kv_heads = header.arch_value("attention.head_count_kv", heads)
        if isinstance(kv_heads, list):
            raise UnsupportedModel("per-layer KV head counts are not supported")
        head_dim = int(header.arch_value("attention.key_length", hidden // heads))
        if int(header.arch_value("attention.value_length", head_dim)) != head_dim:
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
            expert_ffn = int(header.arch_value("expert_feed_forward_length", gate.shape[1]))
            experts_used = int(header.arch_value("expert_used_count", 0) or 0)
            if not 0 < experts_used <= experts:
                raise UnsupportedModel(f"{experts_used} experts used of {experts}")
        # linear rope scaling divides positions (others, such as yarn for contexts past
        # the trained length, are not applied: contexts within it are unchanged)
        scaling = header.arch_value("rope.scaling.type")
        linear = float(header.arch_value("rope.scaling.factor", 1.0) or 1.0)
        gemma3 = arch == "gemma3"
        period = header.arch_value("attention.sliding_window_pattern", GEMMA3_SLIDING_PERIOD)
        if not isinstance(period, int) or period < 1:
            raise UnsupportedModel(f"sliding window pattern {period!r} is not supported")
        layers = int(header.arch_value("block_count"))
        scale = float(header.arch_value("attention.scale", 0.0) or 0.0)
        if gemma3 and not scale and layers == 62:
            # Gemma 3 27B scales by hidden / heads (168), not its head width (128); the
            # file does not say so (llama.cpp tells the 27B by its 62 layers, as here)
            scale = (hidden / heads) ** -0.5
        tokens = header.metadata.get("tokenizer.ggml.tokens")
        vocab = int(header.arch_value("vocab_size", len(tokens) if tokens else 0))
        if not vocab:
            embd = next(t for t in header.tensors if t.name == "token_embd.weight")
            vocab = int(embd.shape[1])
        return cls(
            architecture=arch,
            name=str(header.metadata.get("general.name", header.path.stem)),
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=int(header.arch_value("feed_forward_length", expert_ffn)),
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=int(kv_heads),
            head_dim=head_dim,
            rms_norm_eps=float(header.arch_value("attention.layer_norm_rms_epsilon", 1e-5)),
            rope_theta=float(header.arch_value("rope.freq_base", 10000.0)),
            context_length=int(header.arch_value("context_length", 4096)),
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
