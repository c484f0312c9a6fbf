"""Small GGUF files with random weights, written by the tests (gguf's GGUFWriter).

Each architecture the runtime supports, with chosen ggml types per tensor. K-quant
and IQ4 types, which the gguf package cannot quantize, are written as random blocks
(``kvpool.bench.random_blocks``: valid, finite blocks with small fp16 scales).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from kvpool.bench.random_blocks import random_blocks

HIDDEN, INTER, HEADS, KV_HEADS, LAYERS, VOCAB = 256, 512, 4, 2, 2, 512
# qwen3's heads are wider than hidden / heads (Qwen3-0.6B: 16 heads of 128 over 1024), and
# transformers' GGUF loader takes Qwen3Config's default head_dim, 128: so do these files
QWEN3_HEAD_DIM = 128
# qwen3moe: each layer's feed-forward is EXPERTS experts of EXPERT_INTER, USED per token
EXPERTS, USED, EXPERT_INTER = 8, 2, 256
# gemma3: six layers (five local, one global: its pattern), a window shorter than the
# tests' prompts and than a block
GEMMA3_LAYERS, GEMMA3_WINDOW = 6, 11


def write_model(
    path: Path,
    arch: str,
    qtypes: dict[str, str],
    seed: int = 0,
    extra: dict[str, np.ndarray] | None = None,
    counts: dict[str, int] | None = None,
) -> Path:
    """Write a tiny model; ``qtypes`` maps a tensor-name suffix (``attn_q.weight``...) to
    a ggml type name; the rest is F32. ``extra``: more tensors, written as given;
    ``counts``: more metadata, unsigned integers by key."""
    import gguf
    from gguf.quants import quantize

    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), arch)
    gemma3 = arch == "gemma3"
    layers = GEMMA3_LAYERS if gemma3 else LAYERS
    writer.add_context_length(512)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(INTER)
    writer.add_block_count(layers)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_layer_norm_rms_eps(1e-5)
    # (gemma3: its global layers' base; its local layers' is 10,000, fixed)
    writer.add_rope_freq_base(1000000.0 if gemma3 else 10000.0)
    writer.add_vocab_size(VOCAB)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([f"t{i}" for i in range(VOCAB)])
    writer.add_token_types([1] * VOCAB)
    writer.add_token_merges([])
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(1)
    for key, value in (counts or {}).items():
        writer.add_uint32(key, value)

    qwen3 = arch in ("qwen3", "qwen3moe")
    head_dim = QWEN3_HEAD_DIM if qwen3 else HIDDEN // HEADS
    if gemma3:  # Gemma 3's heads are wider than hidden / heads too; here they are not
        writer.add_sliding_window(GEMMA3_WINDOW)
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    if qwen3:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    if arch == "qwen3moe":
        writer.add_expert_count(EXPERTS)
        writer.add_expert_used_count(USED)
        writer.add_expert_feed_forward_length(EXPERT_INTER)
    shapes = {
        "token_embd.weight": (VOCAB, HIDDEN),
        "output_norm.weight": (HIDDEN,),
        "output.weight": (VOCAB, HIDDEN),
    }
    if gemma3:  # the head is the embedding (Gemma 3's files have no output.weight)
        del shapes["output.weight"]
    for i in range(layers):
        p = f"blk.{i}."
        shapes |= {
            p + "attn_norm.weight": (HIDDEN,),
            p + "attn_q.weight": (HEADS * head_dim, HIDDEN),
            p + "attn_k.weight": (KV_HEADS * head_dim, HIDDEN),
            p + "attn_v.weight": (KV_HEADS * head_dim, HIDDEN),
            p + "attn_output.weight": (HIDDEN, HEADS * head_dim),
            p + "ffn_norm.weight": (HIDDEN,),
        }
        if arch == "qwen3moe":  # stacked experts, and the router (F32, as llama.cpp keeps it)
            shapes |= {
                p + "ffn_gate_inp.weight": (EXPERTS, HIDDEN),
                p + "ffn_gate_exps.weight": (EXPERTS, EXPERT_INTER, HIDDEN),
                p + "ffn_up_exps.weight": (EXPERTS, EXPERT_INTER, HIDDEN),
                p + "ffn_down_exps.weight": (EXPERTS, HIDDEN, EXPERT_INTER),
            }
        else:
            shapes |= {
                p + "ffn_gate.weight": (INTER, HIDDEN),
                p + "ffn_up.weight": (INTER, HIDDEN),
                p + "ffn_down.weight": (HIDDEN, INTER),
            }
        if qwen3 or gemma3:
            shapes |= {p + "attn_q_norm.weight": (head_dim,), p + "attn_k_norm.weight": (head_dim,)}
        if gemma3:  # the sandwich: norms of attention's and the feed-forward's outputs
            shapes |= {
                p + "post_attention_norm.weight": (HIDDEN,),
                p + "post_ffw_norm.weight": (HIDDEN,),
            }
        if arch == "qwen2":
            shapes |= {
                p + "attn_q.bias": (HEADS * head_dim,),
                p + "attn_k.bias": (KV_HEADS * head_dim,),
                p + "attn_v.bias": (KV_HEADS * head_dim,),
            }
    for name, shape in shapes.items():
        if name.endswith("norm.weight"):
            data = (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
        else:
            data = (rng.standard_normal(shape) * 0.08).astype(np.float32)
        # experts take the type of the dense matrix they stand for (ffn_gate_exps: ffn_gate)
        plain = name.replace("_exps", "")
        qname = next((q for suffix, q in qtypes.items() if plain.endswith(suffix)), "F32")
        if qname == "F32" or len(shape) == 1 or name.endswith("ffn_gate_inp.weight"):
            writer.add_tensor(name, data)
        elif qname == "F16":
            writer.add_tensor(name, data.astype(np.float16))
        elif qname.endswith("_K") or qname.startswith(("IQ", "TQ")):
            rows = int(np.prod(shape[:-1]))
            raw = random_blocks(qname, rows, shape[-1], rng, scale=0.15)
            raw = raw.reshape(*shape[:-1], raw.shape[-1])
            writer.add_tensor(name, raw, raw_dtype=gguf.GGMLQuantizationType[qname])
        else:
            qtype = gguf.GGMLQuantizationType[qname]
            writer.add_tensor(name, quantize(data, qtype), raw_dtype=qtype)
    for name, data in (extra or {}).items():
        writer.add_tensor(name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def write_spm_vocab(path: Path, controls: tuple[str, ...] = ()) -> Path:
    """A GGUF file with a small SentencePiece (``llama``) vocabulary: scores, byte tokens
    for fallback, control tokens (``controls``: more, at the end), and no merges (they
    follow from the scores)."""
    import gguf

    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [2, 3, 3] + [6] * 256
    scores = [0.0, 0.0, 0.0] + [0.0] * 256
    letters = [*"abcdefghijklmnopqrstuvwxyz", "▁"]
    pieces = "▁t th he ▁th ▁the ▁a at ▁c ▁cat in ▁in er re on ▁on an ▁an and ▁and ll llo"
    pieces = [*pieces.split(), "▁he", "▁hello"]
    for i, piece in enumerate(letters + pieces):
        tokens.append(piece)
        types.append(1)
        scores.append(-float(i) if piece in pieces else -100.0 - i)
    tokens += controls
    types += [3] * len(controls)
    scores += [0.0] * len(controls)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_context_length(64)
    writer.add_embedding_length(8)
    writer.add_feed_forward_length(8)
    writer.add_head_count(1)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_scores(scores)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_add_bos_token(True)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
