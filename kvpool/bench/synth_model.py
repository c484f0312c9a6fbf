"""``kvpool bench synth-model``: GGUF files with random weights and the geometry and
quantization mix of real models, so speed and memory are measured at the sizes users run
without downloading anything. The text such a model writes is noise; its shapes, bytes
and arithmetic are real, and llama.cpp runs the same files.

Geometries follow the models' published configs (vocabulary sizes, head widths and context
lengths included; each preset's parameter count is the published one: tested); mixes follow
llama.cpp's quantize rules: ``Q4_0`` and ``Q8_0`` quantize every matrix alike (Q4_0's output
head is Q6_K, as llama.cpp makes it), ``Q4_K_M`` uses Q4_K with Q6_K for the output head and
for ``attn_v`` / ``ffn_down`` in the layers llama.cpp gives more bits (the first and last
eighth, and every third in between); ``Q5_K_M`` the same with Q5_K; ``Q3_K_M`` uses Q3_K with
Q6_K for the head, Q4_K for ``attn_output``, ``attn_v`` and ``ffn_down`` (Q5_K in the first two
layers' ``attn_v`` and the first sixteenth's ``ffn_down``); ``Q2_K`` uses Q2_K with Q6_K for the
head, Q3_K for ``attn_output`` and ``ffn_down`` and for ``attn_v`` (Q4_K where four or more
query heads share a KV head); ``IQ4_XS`` (without an
importance matrix) uses IQ4_XS with Q6_K for the head, Q5_K for ``attn_v`` where four or more
query heads share a KV head and for the first eighth's ``ffn_down``; ``IQ2_XXS`` (a grid
format, which llama.cpp makes with an importance matrix) uses IQ2_XXS with Q5_K for the head,
Q2_K for an untied embedding, and Q4_K for ``attn_v`` where four or more query heads share a
KV head (Q2_K elsewhere), following llama.cpp's rules for the type's neighbours; ``TQ1_0``
and ``TQ2_0`` (the ternary formats of BitNet-style models such as TriLM's) use that format
for every matrix but the head (Q6_K) and an untied embedding (Q4_K), as llama.cpp's quantize
makes them. A tied
embedding is the head, so it gets the head's type. The vocabulary is a SentencePiece one of
the real size (byte tokens, a few pieces and fillers) with a ChatML template.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvpool.bench.random_blocks import TYPES, random_blocks
from kvpool.progress import Progress


@dataclass(frozen=True)
class Geometry:
    arch: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    tied: bool
    rope_theta: float = 10000.0
    context: int = 8192
    llama3_rope: bool = False  # a rope_freqs tensor (Llama 3.1/3.2 frequency scaling)
    key_length: int = 0  # a head's width where it is not hidden / heads (qwen3)
    experts: int = 0  # a mixture of experts in each layer (qwen3moe): how many
    experts_used: int = 0  # per token
    expert_ffn: int = 0  # each expert's feed-forward width
    sliding_window: int = 0  # gemma3's local layers' window (five in six layers)
    rope_linear: float = 0.0  # linear rope scaling of the global layers (gemma3 4B and up)

    @property
    def head_dim(self) -> int:
        return self.key_length or self.hidden // self.heads


_L3 = {"rope_theta": 500000.0, "llama3_rope": True, "context": 131072}
_Q3 = {"rope_theta": 1000000.0, "context": 40960, "key_length": 128}
_G3 = {"rope_theta": 1000000.0, "context": 131072, "key_length": 256, "sliding_window": 1024}
_G3_1B = {**_G3, "context": 32768, "sliding_window": 512}
PRESETS = {
    "smollm2-135m": Geometry("llama", 576, 30, 9, 3, 1536, 49152, True, 100000.0),
    "llama-3.2-1b": Geometry("llama", 2048, 16, 32, 8, 8192, 128256, True, **_L3),
    "llama-3.2-3b": Geometry("llama", 3072, 28, 24, 8, 8192, 128256, True, **_L3),
    "llama-3.1-8b": Geometry("llama", 4096, 32, 32, 8, 14336, 128256, False, **_L3),
    "qwen2.5-0.5b": Geometry("qwen2", 896, 24, 14, 2, 4864, 151936, True, 1000000.0, 32768),
    "qwen3-0.6b": Geometry("qwen3", 1024, 28, 16, 8, 3072, 151936, True, **_Q3),
    "qwen3-1.7b": Geometry("qwen3", 2048, 28, 16, 8, 6144, 151936, True, **_Q3),
    "qwen3-4b": Geometry("qwen3", 2560, 36, 32, 8, 9728, 151936, True, **_Q3),
    "qwen3-8b": Geometry("qwen3", 4096, 36, 32, 8, 12288, 151936, False, **_Q3),
    "qwen3-30b-a3b": Geometry(
        "qwen3moe",
        2048,
        48,
        32,
        4,
        6144,
        151936,
        False,
        experts=128,
        experts_used=8,
        expert_ffn=768,
        **_Q3,
    ),
    "gemma3-1b": Geometry("gemma3", 1152, 26, 4, 1, 6912, 262144, True, **_G3_1B),
    "gemma3-4b": Geometry("gemma3", 2560, 34, 8, 4, 10240, 262208, True, rope_linear=8.0, **_G3),
}
MIXES = (
    "Q4_0",
    "Q8_0",
    "Q2_K",
    "Q3_K_M",
    "Q4_K_M",
    "Q5_K_M",
    "IQ4_XS",
    "IQ2_XXS",
    "TQ1_0",
    "TQ2_0",
)
# llama.cpp's, for rows that are not whole 256-blocks
FALLBACK = {
    "Q2_K": "Q4_0",
    "Q3_K": "Q4_0",
    "Q4_K": "Q5_0",
    "Q5_K": "Q5_1",
    "Q6_K": "Q8_0",
    "IQ4_XS": "IQ4_NL",
    "IQ2_XXS": "Q4_0",
    "TQ1_0": "Q4_0",
    "TQ2_0": "Q4_0",
}
# llama.cpp's general.file_type
FILE_TYPES = {
    "Q4_0": 2,
    "Q8_0": 7,
    "Q2_K": 10,
    "Q3_K_M": 12,
    "Q4_K_M": 15,
    "Q5_K_M": 17,
    "IQ4_XS": 30,
    "IQ2_XXS": 19,
    "TQ1_0": 36,
    "TQ2_0": 37,
}
WEIGHT_SCALE = 0.06  # spread of the random weights (keeps activations finite and moving)


def _more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's choice of the layers whose attn_v and ffn_down get more bits."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def tensor_type(mix: str, name: str, layer: int, geometry: Geometry) -> str:
    """The ggml type of one matrix under ``mix`` (1-D tensors are F32)."""
    head = name == "output.weight" or (name == "token_embd.weight" and geometry.tied)
    name = name.replace("_exps", "")  # experts: the type of the matrix they stand for
    if mix == "Q8_0":
        qtype = "Q8_0"
    elif mix == "Q4_0":
        qtype = "Q6_K" if head else "Q4_0"
    elif mix == "IQ4_XS":  # (no importance matrix: the first eighth's ffn_down get Q5_K)
        grouped = geometry.heads // geometry.kv_heads >= 4
        more = (name.endswith("attn_v.weight") and grouped) or (
            name.endswith("ffn_down.weight") and layer < geometry.layers // 8
        )
        qtype = "Q6_K" if head else "Q5_K" if more else "IQ4_XS"
    elif mix == "IQ2_XXS":
        grouped = geometry.heads // geometry.kv_heads >= 4
        if head:
            qtype = "Q5_K"
        elif name == "token_embd.weight":
            qtype = "Q2_K"
        elif name.endswith("attn_v.weight"):
            qtype = "Q4_K" if grouped else "Q2_K"
        else:
            qtype = "IQ2_XXS"
    elif mix in ("TQ1_0", "TQ2_0"):
        qtype = "Q6_K" if head else "Q4_K" if name == "token_embd.weight" else mix
    elif mix == "Q3_K_M":  # attn_v: Q5_K in the first two layers; ffn_down: the first 16th
        if head:
            qtype = "Q6_K"
        elif name.endswith("attn_v.weight"):
            qtype = "Q5_K" if layer < 2 else "Q4_K"
        elif name.endswith("ffn_down.weight"):
            qtype = "Q5_K" if layer < geometry.layers // 16 else "Q4_K"
        else:
            qtype = "Q4_K" if name.endswith("attn_output.weight") else "Q3_K"
    elif mix == "Q2_K":
        grouped = geometry.heads // geometry.kv_heads >= 4
        if head:
            qtype = "Q6_K"
        elif name.endswith("attn_v.weight"):
            qtype = "Q4_K" if grouped else "Q3_K"
        elif name.endswith(("ffn_down.weight", "attn_output.weight")):
            qtype = "Q3_K"
        else:
            qtype = "Q2_K"
    else:  # Q4_K_M, Q5_K_M
        more = name.endswith(("attn_v.weight", "ffn_down.weight"))
        base = {"Q4_K_M": "Q4_K", "Q5_K_M": "Q5_K"}[mix]
        qtype = "Q6_K" if head or (more and _more_bits(layer, geometry.layers)) else base
    return qtype


def _shapes(g: Geometry) -> list[tuple[str, tuple[int, ...], int]]:
    """(name, torch-order shape, layer) of every tensor, in llama.cpp's order."""
    out: list[tuple[str, tuple[int, ...], int]] = [("token_embd.weight", (g.vocab, g.hidden), -1)]
    if g.llama3_rope:
        out.append(("rope_freqs.weight", (g.head_dim // 2,), -1))
    for i in range(g.layers):
        p = f"blk.{i}."
        out += [
            (p + "attn_norm.weight", (g.hidden,), i),
            (p + "attn_q.weight", (g.heads * g.head_dim, g.hidden), i),
            (p + "attn_k.weight", (g.kv_heads * g.head_dim, g.hidden), i),
            (p + "attn_v.weight", (g.kv_heads * g.head_dim, g.hidden), i),
        ]
        if g.arch in ("qwen3", "qwen3moe", "gemma3"):
            out += [
                (p + "attn_q_norm.weight", (g.head_dim,), i),
                (p + "attn_k_norm.weight", (g.head_dim,), i),
            ]
        if g.arch == "qwen2":
            out += [
                (p + "attn_q.bias", (g.heads * g.head_dim,), i),
                (p + "attn_k.bias", (g.kv_heads * g.head_dim,), i),
                (p + "attn_v.bias", (g.kv_heads * g.head_dim,), i),
            ]
        out.append((p + "attn_output.weight", (g.hidden, g.heads * g.head_dim), i))
        if g.arch == "gemma3":  # the sandwich's norm of attention's output
            out.append((p + "post_attention_norm.weight", (g.hidden,), i))
        out.append((p + "ffn_norm.weight", (g.hidden,), i))
        if g.experts:  # the router (kept F32, as llama.cpp's quantize keeps it), stacks
            e, f = g.experts, g.expert_ffn
            out += [
                (p + "ffn_gate_inp.weight", (e, g.hidden), i),
                (p + "ffn_gate_exps.weight", (e, f, g.hidden), i),
                (p + "ffn_up_exps.weight", (e, f, g.hidden), i),
                (p + "ffn_down_exps.weight", (e, g.hidden, f), i),
            ]
        else:
            out += [
                (p + "ffn_gate.weight", (g.ffn, g.hidden), i),
                (p + "ffn_up.weight", (g.ffn, g.hidden), i),
                (p + "ffn_down.weight", (g.hidden, g.ffn), i),
            ]
        if g.arch == "gemma3":  # and of the feed-forward's
            out.append((p + "post_ffw_norm.weight", (g.hidden,), i))
    out.append(("output_norm.weight", (g.hidden,), -1))
    if not g.tied:
        out.append(("output.weight", (g.vocab, g.hidden), -1))
    return out


def _vocabulary(size: int) -> tuple[list[str], list[float], list[int]]:
    """A SentencePiece vocabulary of ``size`` tokens: unk, bos, eos, the ChatML markers,
    256 byte tokens (byte fallback: any text encodes), letters, then filler pieces."""
    tokens = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
    types = [2, 3, 3, 3, 3]
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [6] * 256
    letters = [*"abcdefghijklmnopqrstuvwxyz", "▁"]
    tokens += letters
    types += [1] * len(letters)
    filler = size - len(tokens)
    tokens += [f"▁w{i}" for i in range(filler)]
    types += [1] * filler
    scores = [0.0] * (len(tokens) - filler - len(letters)) + [
        -100.0 - i for i in range(len(letters))
    ]
    scores += [-1000.0 - i for i in range(filler)]
    return tokens, scores, types


CHATML = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _data(name: str, shape: tuple[int, ...], qtype: str, g: Geometry, rng) -> np.ndarray:
    if name.endswith("ffn_gate_inp.weight"):  # a router: logits of about unit spread
        return (rng.standard_normal(shape) / np.sqrt(shape[1])).astype(np.float32)
    if len(shape) == 1:
        if name == "rope_freqs.weight":
            return np.linspace(1.0, 8.0, shape[0]).astype(np.float32)
        if name.endswith("bias"):
            return (0.02 * rng.standard_normal(shape)).astype(np.float32)
        return (1.0 + 0.05 * rng.standard_normal(shape)).astype(np.float32)
    rows = int(np.prod(shape[:-1]))  # (a stack of experts: all their rows)
    return random_blocks(qtype, rows, shape[-1], rng, scale=WEIGHT_SCALE)


def mix_named(name: str) -> str:
    """The mix in ``MIXES`` that ``name`` spells in any case (Ollama's tags write q4_K_M);
    a ValueError names the mixes."""
    for mix in MIXES:
        if mix.lower() == name.lower():
            return mix
    raise ValueError(f"unknown mix {name!r}; choose from {', '.join(MIXES)}")


def write(
    preset: str | Geometry, mix: str, path: Path, *, seed: int = 0, progress: bool = True
) -> Path:
    """Write ``preset`` (a name in ``PRESETS``, or a geometry) quantized as ``mix`` (in
    any case) to ``path``; returns the path."""
    import gguf

    g = PRESETS[preset] if isinstance(preset, str) else preset
    mix = mix_named(mix)
    rng = np.random.default_rng(seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(str(path), g.arch)
    writer.add_name(f"{preset if isinstance(preset, str) else g.arch} (random weights, {mix})")
    writer.add_file_type(FILE_TYPES[mix])
    writer.add_context_length(g.context)
    writer.add_embedding_length(g.hidden)
    writer.add_feed_forward_length(g.ffn)
    writer.add_block_count(g.layers)
    writer.add_head_count(g.heads)
    writer.add_head_count_kv(g.kv_heads)
    writer.add_rope_dimension_count(g.head_dim)
    if g.key_length:
        writer.add_key_length(g.head_dim)
        writer.add_value_length(g.head_dim)
    if g.experts:
        writer.add_expert_count(g.experts)
        writer.add_expert_used_count(g.experts_used)
        writer.add_expert_feed_forward_length(g.expert_ffn)
    writer.add_layer_norm_rms_eps(1e-6 if g.arch == "gemma3" else 1e-5)
    writer.add_rope_freq_base(g.rope_theta)
    if g.sliding_window:
        writer.add_sliding_window(g.sliding_window)
    if g.rope_linear:
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(g.rope_linear)
    writer.add_vocab_size(g.vocab)
    tokens, scores, types = _vocabulary(g.vocab)
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(4)  # <|im_end|> ends a turn
    writer.add_unk_token_id(0)
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHATML)
    tensors = _shapes(g)
    plan = []
    for name, shape, layer in tensors:
        router = name.endswith("ffn_gate_inp.weight")
        qtype = "F32" if len(shape) == 1 or router else tensor_type(mix, name, layer, g)
        if qtype in FALLBACK and shape[-1] % 256:
            # rows that are not whole 256-blocks (Gemma 3 1B's 1152): llama.cpp's quantize
            # falls back to a legacy type of as many bits or more
            qtype = FALLBACK[qtype]
        plan.append((name, shape, qtype))
        if qtype == "F32":
            writer.add_tensor_info(name, shape, np.dtype(np.float32), 4 * int(np.prod(shape)))
        else:
            _, elems, size, _, _ = TYPES[qtype]
            row_bytes = shape[-1] // elems * size
            nbytes = int(np.prod(shape[:-1])) * row_bytes
            writer.add_tensor_info(
                name, (*shape[:-1], row_bytes), np.dtype(np.uint8), nbytes,
                raw_dtype=gguf.GGMLQuantizationType[qtype],
            )  # fmt: skip
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    bar = Progress(f"writing {path.name}", len(plan)) if progress else None
    for name, shape, qtype in plan:
        writer.write_tensor_data(_data(name, shape, qtype, g, rng))
        if bar:
            bar.advance()
    if bar:
        bar.__exit__()
    writer.close()
    if progress:
        print(f"wrote {path} ({path.stat().st_size / 2**20:.0f} MiB)", file=sys.stderr)
    return path
