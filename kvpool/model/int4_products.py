"""4-bit GGUF matrices (Q4_0, Q4_1, Q4_K) multiplied by torch's own int4 kernels, where
kvpool's native kernels are not: a CUDA GPU, or a CPU on which they could not be built.

Without this such a runtime dequantized every matrix to bf16 at load: 2 bytes a weight
where the file holds ~0.56 (an 8B-class Q4_K_M file: ~16 GB instead of ~5). torch's
"tinygemm" kernels (``_weight_int4pack_mm`` on CUDA, ``_weight_int4pack_mm_for_cpu`` on
the CPU) multiply bf16 activations by 4-bit values ``q`` in groups of 32 along K, each
group with a bf16 scale and zero: ``w = (q - 8) * scale + zero``. Every 4-bit GGUF format
is that form exactly, per 32 values:

- Q4_0: ``w = d (q - 8)``: scale ``d``, zero 0;
- Q4_1: ``w = d q + m``: scale ``d``, zero ``m + 8 d``;
- Q4_K: ``w = d sc q - dmin mn`` per sub-block: scale ``d sc``, zero ``8 d sc - dmin mn``;

so the values are the file's, held once in torch's packed layout (0.5 bytes a weight and
4 bytes a group of 32: ~0.63 a weight), and only the scales and zeros are rounded, to
bf16 (a relative error of at most 2^-9 per group, like bf16 weights' per weight).
Formats of other widths (Q5_K, Q6_K, Q8_0) have no such torch kernel and stay dense.

A device whose int4 kernels fail a small product against the dequantized one at first
use (a GPU too old for them, a torch without them) keeps dense weights, and
``int4_unavailable`` says why.
"""

from __future__ import annotations

import functools

import torch

from kvpool.model.gguf_weights import QuantizedMatrix

Q4_0, Q4_1, Q4_K = 2, 3, 12  # ggml type ids
FOUR_BIT = frozenset({Q4_0, Q4_1, Q4_K})
GROUP = 32  # values per scale and zero


def _f16(raw: torch.Tensor, at: int) -> torch.Tensor:
    """The float16 at byte ``at`` of each block (``raw``: [..., block bytes]), as float32."""
    return raw[..., at : at + 2].contiguous().view(torch.float16)[..., 0].float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[..., 16 x j bytes] -> [..., 32 x j] values: each 32-value run is its 16 (or 32)
    bytes' low nibbles, then their high nibbles (GGUF's order)."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=-1)


def four_bit_values(matrix: QuantizedMatrix) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A 4-bit matrix ``[N, K]`` as ``(q, scale, zero)``: ``q`` uint8 ``[N, K]`` (0..15),
    ``scale`` and ``zero`` float32 ``[N, K / 32]``, with ``w = (q - 8) scale + zero``
    equal to the file's dequantized values (exact in float32)."""
    if matrix.packed or matrix.qtype not in FOUR_BIT:
        raise ValueError(f"type {matrix.qtype} (packed {matrix.packed}) is not a 4-bit layout")
    n, k = matrix.rows, matrix.cols
    raw = matrix.raw.view(n, -1)
    if matrix.qtype in (Q4_0, Q4_1):
        size = 18 if matrix.qtype == Q4_0 else 20
        blocks = raw.view(n, k // 32, size)
        d = _f16(blocks, 0)
        q = _nibbles(blocks[..., size - 16 :]).reshape(n, k)
        zero = torch.zeros_like(d) if matrix.qtype == Q4_0 else _f16(blocks, 2) + 8 * d
        return q, d, zero
    blocks = raw.view(n, k // 256, 144)  # Q4_K: d, dmin, 12 bytes of 6-bit scales, 128 of q
    d, dmin = _f16(blocks, 0)[..., None], _f16(blocks, 2)[..., None]
    s = blocks[..., 4:16].to(torch.int32)
    b0, b4, b8 = s[..., 0:4], s[..., 4:8], s[..., 8:12]  # bytes 0-3, 4-7, 8-11
    # get_scale_min_k4: sub-blocks 0-3 from the low 6 bits of bytes 0-3 (scales) and 4-7
    # (mins); 4-7 from bytes 8-11's nibbles, their top 2 bits from bytes 0-3 and 4-7
    sc = torch.cat([b0 & 63, (b8 & 0x0F) | ((b0 >> 6) << 4)], dim=-1)
    mn = torch.cat([b4 & 63, (b8 >> 4) | ((b4 >> 6) << 4)], dim=-1)
    q = _nibbles(blocks[..., 16:].reshape(n, k // 256, 4, 32)).reshape(n, k)
    scale = d * sc.float()
    zero = 8 * scale - dmin * mn.float()
    return q, scale.reshape(n, k // 32), zero.reshape(n, k // 32)


def _pack(q: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``q`` [N, K] uint8 in torch's int4 layout for ``device``'s kernel."""
    if device.type == "cuda":
        k = q.shape[1]
        inner = 8 if k % 128 == 0 else 4 if k % 64 == 0 else 2
        pairs = (q[:, ::2] << 4 | q[:, 1::2]).to(device)  # an even column in the high nibble
        return torch.ops.aten._convert_weight_to_int4pack(pairs, inner)
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1)


def _mm(x: torch.Tensor, packed: torch.Tensor, scale_zero: torch.Tensor) -> torch.Tensor:
    if x.device.type == "cuda":
        return torch.ops.aten._weight_int4pack_mm(x, packed, GROUP, scale_zero)
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, GROUP, scale_zero)


class Int4Linear:
    """``y = x W^T (+ b)`` for a product whose parts (a fused QKV or gate/up, or one
    matrix) are 4-bit GGUF matrices, in bf16: the parts' values in one int4 matrix
    (``[N, K]``, N the parts' rows together), computed by torch's int4 kernel."""

    __slots__ = ("bias", "cols", "numel_", "packed", "rows", "scale_zero")

    def __init__(
        self, parts: list[QuantizedMatrix], bias: torch.Tensor | None, device: torch.device
    ) -> None:
        values = [four_bit_values(p) for p in parts]
        q = torch.cat([v[0] for v in values])
        self.rows, self.cols = q.shape
        # [K / 32, N, 2]: each group's scale and zero, for every output row
        scale = torch.cat([v[1] for v in values]).t()
        zero = torch.cat([v[2] for v in values]).t()
        self.scale_zero = torch.stack([scale, zero], dim=-1).to(device, torch.bfloat16)
        self.packed = _pack(q, device)
        self.bias = bias
        self.numel_ = q.numel() + (bias.numel() if bias is not None else 0)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        y = _mm(x.reshape(-1, self.cols).to(torch.bfloat16), self.packed, self.scale_zero)
        y = y.reshape(*shape[:-1], self.rows)
        return y + self.bias if self.bias is not None else y

    def numel(self) -> int:
        return self.numel_

    def nbytes(self) -> int:
        return self.packed.nbytes + self.scale_zero.nbytes


def fits(parts: list[QuantizedMatrix]) -> bool:
    """Whether torch's int4 kernels take these parts: 4-bit formats in the file's layout,
    K a multiple of 32, N (all parts) a multiple of 16."""
    if not all(
        isinstance(p, QuantizedMatrix) and not p.packed and p.qtype in FOUR_BIT for p in parts
    ):
        return False
    cols = parts[0].cols
    return (
        cols % GROUP == 0
        and all(p.cols == cols for p in parts)
        and sum(p.rows for p in parts) % 16 == 0
    )


@functools.cache
def int4_unavailable(device: torch.device) -> str | None:
    """None where ``device`` runs torch's int4 products right (a 32 x 256 Q4_K-form
    product against its dequantized values), else why not (one line)."""
    try:
        gen = torch.Generator().manual_seed(0)
        q = torch.randint(0, 16, (32, 256), generator=gen, dtype=torch.uint8)
        scale = torch.rand(32, 8, generator=gen) * 0.1 + 0.01
        zero = torch.randn(32, 8, generator=gen) * 0.1
        scale_zero = torch.stack([scale.t(), zero.t()], -1).to(device, torch.bfloat16)
        x = torch.randn(3, 256, generator=gen).to(device, torch.bfloat16)
        got = _mm(x, _pack(q, device), scale_zero).float().cpu()
        sz = scale_zero.float().cpu()
        w = (q.float() - 8) * sz[..., 0].t().repeat_interleave(GROUP, 1)
        w += sz[..., 1].t().repeat_interleave(GROUP, 1)
        want = x.float().cpu() @ w.t()
        if not torch.allclose(got, want, rtol=0.02, atol=0.02 * want.abs().max().item()):
            return f"torch's int4 product on {device} is not the dequantized one"
    except Exception as exc:  # no such kernel here (an old GPU, another torch)
        return f"no int4 kernels on {device}: {str(exc).splitlines()[0][:200]}"
    return None
