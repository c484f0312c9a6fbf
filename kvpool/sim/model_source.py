"""Resolve ``--model``: a preset name, a GGUF file, or a Hugging Face ``config.json``."""

from __future__ import annotations

import json
from pathlib import Path

from kvpool.formats.gguf_header import read_gguf_header
from kvpool.sim.presets import MODEL_PRESETS, ModelSpec


def resolve_model(name_or_path: str) -> ModelSpec:
    key = name_or_path.lower()
    if key in MODEL_PRESETS:
        return MODEL_PRESETS[key]
    path = Path(name_or_path)
    if path.is_dir() and (path / "config.json").is_file():
        path = path / "config.json"
    if path.is_file():
        if path.suffix == ".gguf":
            return model_from_gguf(path)
        if path.suffix == ".json":
            return model_from_hf_config(path)
    known = ", ".join(MODEL_PRESETS)
    raise ValueError(
        f"unknown model {name_or_path!r}: give a preset ({known}), a .gguf file or a config.json"
    )


def model_from_gguf(path: str | Path) -> ModelSpec:
    """Geometry and real weight size from a GGUF file's metadata."""
    header = read_gguf_header(path, skip_arrays=True)
    n_heads = int(header.arch_value("attention.head_count"))
    n_kv = header.arch_value("attention.head_count_kv", n_heads)
    if isinstance(n_kv, list):  # per-layer counts in some files: size for the largest
        n_kv = max(n_kv)
    hidden = int(header.arch_value("embedding_length"))
    head_dim = int(header.arch_value("attention.key_length", hidden // n_heads))
    experts = int(header.arch_value("expert_count", 0) or 0)
    return ModelSpec(
        name=str(header.metadata.get("general.name", Path(path).stem)),
        num_layers=int(header.arch_value("block_count")),
        num_kv_heads=int(n_kv),
        head_dim=head_dim,
        num_parameters=header.num_parameters,
        context_length=int(header.arch_value("context_length", 4096)),
        weight_bytes_override=header.weight_bytes,
        experts=experts,
        experts_used=int(header.arch_value("expert_used_count", 0) or 0) if experts else 0,
        expert_parameters=sum(t.num_elements for t in header.tensors if "_exps." in t.name),
    )


def model_from_hf_config(path: str | Path) -> ModelSpec:
    """Geometry from a Hugging Face ``config.json``; parameters estimated from shapes."""
    cfg = json.loads(Path(path).read_text())
    layers = int(cfg["num_hidden_layers"])
    hidden = int(cfg["hidden_size"])
    n_heads = int(cfg["num_attention_heads"])
    n_kv = int(cfg.get("num_key_value_heads") or n_heads)
    head_dim = int(cfg.get("head_dim") or hidden // n_heads)
    inter = int(cfg.get("intermediate_size", 4 * hidden))
    vocab = int(cfg.get("vocab_size", 32000))
    attn = hidden * head_dim * (n_heads + 2 * n_kv) + n_heads * head_dim * hidden
    # a mixture of experts (Qwen3-MoE's num_experts, Mixtral's num_local_experts) in
    # place of each feed-forward: the experts and a router
    experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
    used = int(cfg.get("num_experts_per_tok") or 0) if experts else 0
    expert = 3 * hidden * int(cfg.get("moe_intermediate_size") or inter)
    ffn = experts * (expert + hidden) if experts else 3 * hidden * inter
    per_layer = attn + ffn + 2 * hidden
    embeddings = vocab * hidden * (1 if cfg.get("tie_word_embeddings") else 2)
    return ModelSpec(
        name=str(cfg.get("_name_or_path") or Path(path).parent.name or "config"),
        num_layers=layers,
        num_kv_heads=n_kv,
        head_dim=head_dim,
        num_parameters=layers * per_layer + embeddings + hidden,
        context_length=int(cfg.get("max_position_embeddings", 4096)),
        experts=experts,
        experts_used=used,
        expert_parameters=layers * experts * expert,
    )
