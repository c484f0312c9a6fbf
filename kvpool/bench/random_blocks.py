"""Random GGUF blocks of any supported quantized type: valid, finite blocks whose fp16
scale fields hold small values (the rest of each block, quants and packed sub-block
scales, is uniformly random bytes). What synthetic models and kernel tests are made of:
the gguf package cannot quantize the K-quant types, and random weights need no
quantizing anyway."""

from __future__ import annotations

import numpy as np

# ggml type name -> (id, elements per block, bytes per block, offsets of fp16 scales,
# offsets of fp16 mins)
TYPES: dict[str, tuple[int, int, int, tuple[int, ...], tuple[int, ...]]] = {
    "Q4_0": (2, 32, 18, (0,), ()),
    "Q4_1": (3, 32, 20, (0,), (2,)),
    "Q5_0": (6, 32, 22, (0,), ()),
    "Q5_1": (7, 32, 24, (0,), (2,)),
    "Q8_0": (8, 32, 34, (0,), ()),
    "Q2_K": (10, 256, 84, (80,), (82,)),
    "Q3_K": (11, 256, 110, (108,), ()),
    "Q4_K": (12, 256, 144, (0,), (2,)),
    "Q5_K": (13, 256, 176, (0,), (2,)),
    "Q6_K": (14, 256, 210, (208,), ()),
    "IQ4_NL": (20, 32, 18, (0,), ()),
    "IQ4_XS": (23, 256, 136, (0,), ()),
    # the grid formats (IQ1_M's fp16 scale is spread over its scales' top nibbles)
    "IQ2_XXS": (16, 256, 66, (0,), ()),
    "IQ2_XS": (17, 256, 74, (0,), ()),
    "IQ2_S": (22, 256, 82, (0,), ()),
    "IQ3_XXS": (18, 256, 98, (0,), ()),
    "IQ3_S": (21, 256, 110, (0,), ()),
    "IQ1_S": (19, 256, 50, (0,), ()),
    "IQ1_M": (29, 256, 56, (), ()),
    # the ternary formats (values -1, 0, 1: TQ2_0's 2-bit fields drawn from 0 .. 2)
    "TQ1_0": (34, 256, 54, (52,), ()),
    "TQ2_0": (35, 256, 66, (64,), ()),
}


def row_bytes(qtype: str, cols: int) -> int:
    _, elems, size, _, _ = TYPES[qtype]
    return cols // elems * size


def random_blocks(
    qtype: str, rows: int, cols: int, rng: np.random.Generator, scale: float = 1.0
) -> np.ndarray:
    """uint8 ``[rows, row_bytes]``: ``rows`` rows of ``cols`` values in ``qtype``.
    ``scale`` sets the spread of the values (the fp16 scales are drawn around
    ``scale`` / 64 per quant step for 4-bit types; the same magnitude for the others)."""
    _, elems, size, scales, mins = TYPES[qtype]
    if cols % elems:
        raise ValueError(f"{qtype}: {cols} columns is not a whole number of {elems}-blocks")
    count = rows * cols // elems
    blocks = rng.integers(0, 256, size=(count, size), dtype=np.uint8)
    # a value's spread is about step * levels: keep it near `scale` whatever the type
    # (IQ4: levels to +-127; IQ4_XS's unit scales to +-32 besides)
    levels = {"Q8_0": 128, "Q6_K": 32 * 64, "Q5_0": 16, "Q5_1": 32, "Q5_K": 32 * 64}
    levels |= {"IQ4_NL": 128, "IQ4_XS": 128 * 32}
    # (the grid formats: the largest grid value times the largest sub-block scale)
    levels |= {"IQ2_XXS": 168, "IQ2_XS": 168, "IQ2_S": 168, "IQ3_XXS": 480, "IQ3_S": 465}
    levels |= {"IQ1_S": 17, "IQ1_M": 17, "TQ1_0": 1, "TQ2_0": 1}
    step = scale / levels.get(qtype, 16 if elems == 32 else 16 * 64)
    for off in scales:
        d = rng.uniform(0.5 * step, 1.5 * step, size=count).astype(np.float16)
        blocks[:, off : off + 2] = d.view(np.uint8).reshape(-1, 2)
    for off in mins:
        m = rng.uniform(0.0, step * (64 if elems == 256 else 8), size=count).astype(np.float16)
        blocks[:, off : off + 2] = m.view(np.uint8).reshape(-1, 2)
    if qtype == "TQ2_0":  # a field of 3 would read as 2: values of mean 1/4, not 0
        fields = rng.integers(0, 3, size=(count, 64, 4), dtype=np.uint8)
        blocks[:, :64] = (
            fields[..., 0] | fields[..., 1] << 2 | fields[..., 2] << 4 | fields[..., 3] << 6
        )
    if qtype == "IQ1_M":  # d's 16 bits: the top nibble of each of the four uint16 scales
        d = rng.uniform(0.5 * step, 1.5 * step, size=count).astype(np.float16).view(np.uint16)
        scales = blocks[:, 48:56].copy().view(np.uint16)  # [count, 4]
        for i in range(4):
            scales[:, i] = (scales[:, i] & 0x0FFF) | (((d >> (4 * i)) & 0xF) << 12)
        blocks[:, 48:56] = scales.view(np.uint8)
    return blocks.reshape(rows, cols // elems * size)
