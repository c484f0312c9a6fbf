"""Tensors of a GGUF file, dequantized into torch tensors in the runtime's dtype.

The header is parsed once (``kvpool.formats.gguf_header``); tensor data is read through a
memory map and dequantized with the ``gguf`` package's numpy kernels (F32, F16, BF16 are
reinterpreted directly). llama.cpp's converter permutes the rows of llama Q and K weights
for its interleaved rotary layout; they are permuted back here, so the model uses the
usual half-split rotary form.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from kvpool.formats.gguf_header import GGUFHeader, GGUFTensorInfo, read_gguf_header
from kvpool.model.config import ModelConfig, UnsupportedModel

# ggml type ids read without the gguf package
_F32, _F16, _BF16, _Q4_0, _Q4_1 = 0, 1, 30, 2, 3
_UNQUANTIZED = (_F32, _F16, _BF16)
_Q4_GROUP = 32
_EMBEDDING = "token_embd.weight"


@dataclass
class Int4Weight:
    """A Q4_0 / Q4_1 matrix ``[N, K]`` in torch's CPU int4 layout, without dequantizing:
    ``w = (q - 8) * scale + zero`` per group of 32 along K. The mapping is exact:
    Q4_0 (``d * (q - 8)``) has ``scale = d, zero = 0``; Q4_1 (``d * q + m``) has
    ``scale = d, zero = m + 8 d``. Rows concatenate (fused QKV, gate/up)."""

    packed: torch.Tensor  # uint8 [N, K / 2], from _convert_weight_to_int4pack_for_cpu
    scales_zeros: torch.Tensor  # float32 [K / 32, N, 2]

    @staticmethod
    def cat(parts: list[Int4Weight]) -> Int4Weight:
        return Int4Weight(
            torch.cat([p.packed for p in parts]), torch.cat([p.scales_zeros for p in parts], 1)
        )


class QuantizedRows:
    """A matrix ``[N, K]`` kept as its GGUF blocks, rows dequantized when looked up: for a
    token embedding, the few rows a step reads instead of a dequantized copy of all of
    them (SmolLM2's Q8_0 embedding: 30 MB instead of 57 MB in bf16; a Llama 3 8B's Q4_K
    one: 0.3 instead of 1 GB). Rows are bit-identical to those of the whole matrix
    dequantized: each row is whole blocks, dequantized alone by the same kernels."""

    def __init__(self, raw: np.ndarray, qtype: int, cols: int, dtype: torch.dtype) -> None:
        from gguf import GGMLQuantizationType

        self.raw = raw  # uint8 [N, bytes per row]
        self.qtype = GGMLQuantizationType(qtype)
        self.shape = (raw.shape[0], cols)
        self.dtype = dtype

    def __getitem__(self, ids: torch.Tensor) -> torch.Tensor:
        from gguf.quants import dequantize

        rows = self.raw[ids.cpu().numpy()]
        return torch.from_numpy(dequantize(rows, self.qtype)).to(self.dtype)

    def numel(self) -> int:
        return self.shape[0] * self.shape[1]


def _int4_weight(raw: np.ndarray, info: GGUFTensorInfo, row_order: torch.Tensor | None):
    """``Int4Weight`` of a 2-D Q4_0 / Q4_1 tensor (rows reordered by ``row_order``)."""
    k, n = info.shape  # ggml order
    block = 18 if info.ggml_type == _Q4_0 else 20
    blocks = raw.reshape(n, k // _Q4_GROUP, block)
    d = blocks[:, :, 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    if info.ggml_type == _Q4_0:
        zero = np.zeros_like(d)
        qs = blocks[:, :, 2:18]
    else:
        m = blocks[:, :, 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        zero = m + 8 * d
        qs = blocks[:, :, 4:20]
    # element j of a group is the low nibble of byte j, element j + 16 the high nibble
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).reshape(n, k)
    q_t = torch.from_numpy(q.astype(np.int32))
    sz = torch.from_numpy(np.stack([d, zero], axis=-1))  # [N, groups, 2]
    if row_order is not None:
        q_t, sz = q_t[row_order], sz[row_order]
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q_t, 1)
    return Int4Weight(packed, sz.transpose(0, 1).contiguous())


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
    return w[_rotary_row_order(w.shape[0], n_heads)]


def _rotary_row_order(rows: int, n_heads: int) -> torch.Tensor:
    """Row ``i`` of the un-permuted matrix is row ``order[i]`` of the GGUF one."""
    half = rows // n_heads // 2
    return torch.arange(rows).reshape(n_heads, half, 2).transpose(1, 2).reshape(-1)


def load_gguf_weights(
    path: str | Path,
    dtype: torch.dtype = torch.float32,
    *,
    header: GGUFHeader | None = None,
    on_tensor: Callable[[int, int], None] | None = None,
    int4: dict[str, Int4Weight] | None = None,
    rows: dict[str, QuantizedRows] | None = None,
) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Config and every tensor of the file, by GGUF name, dequantized to ``dtype``. With
    ``int4`` given, Q4_0 / Q4_1 matrices are also put there in torch's int4 layout; with
    ``rows`` given, a quantized token embedding is also put there as ``QuantizedRows``."""
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
        heads = _rotary_heads(config, info.name)
        if heads:
            tensor = _unpermute_rotary(tensor, heads)
        weights[info.name] = tensor
        if rows is not None and info.name == _EMBEDDING and info.ggml_type not in _UNQUANTIZED:
            n = info.shape[1]
            rows[info.name] = QuantizedRows(raw.reshape(n, -1).copy(), info.ggml_type,
                                            info.shape[0], dtype)  # fmt: skip
        if int4 is not None and info.ggml_type in (_Q4_0, _Q4_1) and len(info.shape) == 2:
            order = _rotary_row_order(info.shape[1], heads) if heads else None
            int4[info.name] = _int4_weight(raw, info, order)
        if on_tensor:
            on_tensor(i + 1, len(header.tensors))
    return config, weights


def _rotary_heads(config: ModelConfig, name: str) -> int:
    """Heads of a llama Q/K tensor whose rows llama.cpp permuted (0 for any other)."""
    if config.architecture != "llama":
        return 0
    if name.endswith(("attn_q.weight", "attn_q.bias")):
        return config.num_heads
    if name.endswith(("attn_k.weight", "attn_k.bias")):
        return config.num_kv_heads
    return 0
