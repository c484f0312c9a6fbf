"""Tensors of a GGUF file, dequantized into torch tensors in the runtime's dtype.

The header is parsed once (``kvpool.formats.gguf_header``); tensor data is read through a
memory map and dequantized with the ``gguf`` package's numpy kernels (F32, F16, BF16 are
reinterpreted directly). llama.cpp's converter permutes the rows of llama Q and K weights
for its interleaved rotary layout; they are permuted back here, so the model uses the
usual half-split rotary form.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from kvpool.formats.gguf_header import GGUFHeader, GGUFTensorInfo, read_gguf_header
from kvpool.model.config import ModelConfig, UnsupportedModel

# ggml type ids read without the gguf package
_F32, _F16, _BF16 = 0, 1, 30


def _dequantize(raw: np.ndarray, info: GGUFTensorInfo) -> np.ndarray:
    """float32 array in torch order (the reverse of ggml's shape)."""
    shape = tuple(reversed(info.shape))
    if info.ggml_type == _F32:
        return raw.view(np.float32).reshape(shape)
    if info.ggml_type == _F16:
        return raw.view(np.float16).astype(np.float32).reshape(shape)
    if info.ggml_type == _BF16:
        return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32).reshape(shape)
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    try:
        qtype = GGMLQuantizationType(info.ggml_type)
    except ValueError:
        raise UnsupportedModel(f"tensor {info.name}: unknown ggml type {info.ggml_type}") from None
    rows = raw.reshape(-1, raw.size // max(1, int(np.prod(shape[:-1]))))
    return dequantize(rows, qtype).reshape(shape)


def _unpermute_rotary(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's per-head row permutation of Q/K (interleaved -> half-split)."""
    rows = w.shape[0]
    return (
        w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)
    )


def load_gguf_weights(
    path: str | Path,
    dtype: torch.dtype = torch.float32,
    *,
    header: GGUFHeader | None = None,
    on_tensor: Callable[[int, int], None] | None = None,
) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Config and every tensor of the file, by GGUF name, dequantized to ``dtype``."""
    header = header or read_gguf_header(path)
    config = ModelConfig.from_gguf(header)
    data = np.memmap(header.path, dtype=np.uint8, mode="r", offset=header.data_offset)
    weights: dict[str, torch.Tensor] = {}
    for i, info in enumerate(header.tensors):
        raw = np.asarray(data[info.offset : info.offset + info.num_bytes])
        array = _dequantize(raw, info)
        if not array.flags.writeable:  # a view of the read-only map
            array = array.copy()
        tensor = torch.from_numpy(np.ascontiguousarray(array, dtype=np.float32)).to(dtype)
        if config.architecture == "llama":
            if info.name.endswith("attn_q.weight") or info.name.endswith("attn_q.bias"):
                tensor = _unpermute_rotary(tensor, config.num_heads)
            elif info.name.endswith("attn_k.weight") or info.name.endswith("attn_k.bias"):
                tensor = _unpermute_rotary(tensor, config.num_kv_heads)
        weights[info.name] = tensor
        if on_tensor:
            on_tensor(i + 1, len(header.tensors))
    return config, weights
