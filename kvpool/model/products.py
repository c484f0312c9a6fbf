"""Matrix products with weights kept in their GGUF blocks (``QuantLinear``), and the
policy that picks the kernels for a step (``ProductPolicy``).

Two kinds of product (``native.quant_matmul``):

- ``int8``: activations quantized to int8 per block of 32, integer dot products with the
  unpacked weight blocks, llama.cpp's method. Every output element is one row's dot
  product in a fixed order, so a row's result does not depend on the rest of the batch
  (except where ``GROUPED`` lets a kernel for many rows take steps of many: not in
  batch-invariant products).
  Every variant has them for Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K,
  IQ4_NL, IQ4_XS and the grid formats IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS and
  IQ3_S (their grid rows as bytes; the generic variant in plain C++ that compilers
  vectorize: NEON on aarch64); a format without them would be multiplied by dequantized
  tiles one row at a time in this mode, which keeps that property.
- ``float``: weights dequantized tile by tile (per thread, never a whole matrix) and
  multiplied with float32 activations: what dequantizing the file gives, up to the
  order of the sums. The reference; exact comparisons (tests at float32) use it.

Where ``int8`` stops being the faster one is a property of the CPU (a float GEMM on
dequantized tiles wins for large steps where the CPU has wide float units and the
integer kernels' unpacking costs more than the tile's dequantization), so the policy's
``int8_max_rows`` is measured at load (``calibrate``), or set.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

import torch

from kvpool.model.gguf_weights import PACKED, QuantizedMatrix
from kvpool.model.native import native_ops

INT8, FLOAT, BF16_TILES = 0, 1, 2  # quant_matmul's modes
# (quant_matmul's mode, bit 6) integer products may take kernels for many rows whose order
# of sums differs from a single row's: the x86 grid formats (IQ1-IQ3) 8 weight rows at a
# time (AVX-512: 16) from 5 rows (docs/performance.md); never in batch-invariant products
GROUPED = 64
# The packed kernel for a single activation row (quant_matmul's mode, 16 x): the kernels'
# own choice, AVX-512's pair of groups in 512-bit vectors, or one group in 256-bit ones
ONE_ROW_OWN, ONE_ROW_WIDE, ONE_ROW_NARROW = 0, 1, 2
# (quant_matmul's mode, bit 7) passes of 1 to 4 rows ask for their weights 8 KiB ahead
# instead of 2 (kReadAheadFar, kReadAheadNear: the same results), measured at load
FAR_AHEAD = 128
READ_AHEAD_KIB = {False: 2, True: 8}


@dataclass
class ProductPolicy:
    """Which product a step of ``rows`` rows takes. ``exact``: float products always
    (the float32 reference). Otherwise ``int8`` up to ``int8_max_rows`` rows (None: at
    every size; with ``fixed`` every product is then batch-invariant, the kernels' order of
    sums the same at every step size: ``GROUPED`` off), and ``tiles`` above:
    ``FLOAT``, or ``BF16_TILES`` where the CPU has bf16 products in hardware.

    ``file_int8_max_rows``, where ``file_crossover``: the crossover of the matrices kept
    in the file's layout (the kernels' row form: Q5_1 on x86, which has no packed layout;
    its int8 products of many rows are several times slower than the packed formats'),
    measured apart where a model has both kinds; without it, the one crossover holds for
    all.

    ``one_row``: the packed kernel for a step of one row (a batch-1 decode step) on an
    AVX-512 variant (``ONE_ROW_WIDE`` or ``ONE_ROW_NARROW``; the same results bit for bit),
    measured at load; ``ONE_ROW_OWN`` leaves it to the kernels. ``far_ahead``: passes of
    few rows (a decode step's), which stream the weights from memory, ask for them 8 KiB
    ahead instead of 2 (x86; the same results), measured at load: the memory's latency
    times a core's rate decides it."""

    exact: bool = False
    int8_max_rows: int | None = None
    tiles: int = FLOAT
    variant: str = ""  # the kernels' instruction set ("": the fastest this CPU runs)
    fixed: bool = False  # batch-invariant: int8 at every size, never recalibrated
    file_crossover: bool = False
    file_int8_max_rows: int | None = None
    one_row: int = ONE_ROW_OWN
    one_row_ms: tuple[float, float] | None = None  # measured: (wide, narrow) a step's products
    far_ahead: bool = False
    ahead_ms: tuple[float, float] | None = None  # measured: (near, far) a step's products

    def _kind(self, rows: int, crossover: int | None) -> int:
        if crossover is None or rows <= crossover:
            return INT8
        return self.tiles

    def mode(self, rows: int) -> int:
        """quant_matmul's mode: the kind of product (``INT8``, ``FLOAT``, ``BF16_TILES``),
        plus 4 x (1 + the kind for the file's layout) where that has its own crossover,
        plus 16 x ``one_row``, plus ``GROUPED`` unless ``fixed``, plus ``FAR_AHEAD``."""
        if self.exact:
            return FLOAT
        mode = self._kind(rows, self.int8_max_rows)
        if self.file_crossover:
            mode |= (1 + self._kind(rows, self.file_int8_max_rows)) << 2
        if not self.fixed:
            mode |= GROUPED
        if self.far_ahead:
            mode |= FAR_AHEAD
        # (for any number of rows: a mixture of experts' product may give an expert one)
        return mode | self.one_row << 4

    def describe(self) -> str:
        ops = native_ops()
        variant = self.variant or (ops.kernel_variants()[0] if ops is not None else "none")
        kernels = f"{variant} kernels"
        if ops is not None and ops.threads_from() != "openmp":
            kernels += "; their own thread pool: a build without OpenMP"
        if self.exact:
            return (
                f"float products from dequantized tiles, the exact reference ({kernels}; "
                "without --dtype, int8 products: several times faster)"
            )
        tiles = "bf16" if self.tiles == BF16_TILES else "float32"

        def kinds(crossover: int | None) -> str:
            if crossover is None:
                return "int8 products at every step size"
            if crossover == 0:
                return f"{tiles} tiles at every step size"
            rows = f"{crossover} row{'s' if crossover > 1 else ''}"
            return f"int8 products up to {rows}, {tiles} tiles above"

        what = kinds(self.int8_max_rows)
        if self.int8_max_rows is None and self.fixed:
            what += ", batch-invariant"
        if self.file_crossover:
            what += f"; matrices in the file's layout: {kinds(self.file_int8_max_rows)}"
        if self.one_row != ONE_ROW_OWN:
            width = "512-bit vectors" if self.one_row == ONE_ROW_WIDE else "256-bit vectors"
            what += f"; one row in {width}"
            if self.one_row_ms is not None:
                wide, narrow = self.one_row_ms
                what += f" (batch-1 products {wide:.1f} ms in 512-bit, {narrow:.1f} in 256-bit)"
        if self.far_ahead or self.ahead_ms is not None:
            what += f"; weights asked for {READ_AHEAD_KIB[self.far_ahead]} KiB ahead"
            if self.ahead_ms is not None:
                near, far = self.ahead_ms
                what += f" (batch-1 products {near:.1f} ms at 2 KiB, {far:.1f} at 8 KiB)"
        return f"{what} ({kernels})"


class QuantLinear:
    """``y = x W^T (+ b)`` for W the rows of one or more quantized parts (a fused QKV
    whose parts may differ in format), kept in their blocks. Output in x's dtype, or in
    float32 with ``float_out`` (an output head: logits are not rounded to bf16)."""

    __slots__ = ("bias", "cols", "float_out", "numel_", "policy", "raws", "types")

    def __init__(
        self,
        parts: list[QuantizedMatrix],
        bias: torch.Tensor | None,
        policy: ProductPolicy,
        *,
        float_out: bool = False,
    ) -> None:
        cols = {p.cols for p in parts}
        if len(cols) != 1:
            raise ValueError(f"parts of one product need one width, got {sorted(cols)}")
        self.cols = parts[0].cols
        self.float_out = float_out
        # The packed layout where the int8 kernels have it (the same bytes). Not under an
        # exact policy, which never takes them: its float products dequantize tiles, as
        # fast from the file's layout (repacking would be load time for nothing).
        if not policy.exact:
            for part in parts:
                part.pack(policy.variant)
        self.raws = [p.raw for p in parts]
        self.types = [p.native_type for p in parts]
        self.bias = bias
        self.policy = policy
        self.numel_ = sum(p.numel() for p in parts) + (bias.numel() if bias is not None else 0)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        ops = native_ops()
        policy = self.policy
        mode = policy.mode(x.shape[0])
        y = ops.quant_matmul(x, self.raws, self.types, mode, policy.variant, not self.float_out)
        return y if self.bias is None else y + self.bias

    def numel(self) -> int:
        return self.numel_

    @property
    def nbytes(self) -> int:
        return sum(raw.numel() for raw in self.raws)


PROBE_ROWS = 2048  # rows of a crossover's probe (probe): a 1B-class model's o's


def probe(linear: QuantLinear, packed: bool, rows: int = PROBE_ROWS) -> QuantLinear | None:
    """A product of ``linear``'s first part in the packed layout (``packed``) or in the
    file's, cut to its first ``rows`` rows (views of the same bytes): what that layout's
    crossover is measured on. None where ``linear`` has no such part."""
    for raw, native_type in zip(linear.raws, linear.types, strict=True):
        if bool(native_type & PACKED) != packed:
            continue
        groups = rows // 8 if packed else rows  # a packed raw's rows are groups of 8
        part = QuantizedMatrix(raw[:groups], native_type & ~PACKED, linear.cols, packed)
        # (an exact policy's product never packs: a file-layout part kept so for its odd
        # number of rows would otherwise be packed once cut, and measured as packed; only
        # the variant is read from the policy when measuring)
        return QuantLinear([part], None, dataclasses.replace(linear.policy, exact=True))
    return None


def calibrate(
    linear: QuantLinear,
    tiles: int,
    sizes: tuple[int, ...] = (1, 8, 16, 32, 64, 128, 256, 512),
) -> int | None:
    """The largest step size at which ``int8`` products are still faster than ``tiles``
    for this product on this CPU: 0 if tiles win from one row on, None if int8 wins at
    every size measured. Each size: the fastest of three runs per mode (alternating), of
    six where tiles win; it stops at the first size tiles win (a few hundred
    milliseconds for a 1B-class layer).
    One row is measured too: plain C++ integer kernels (the generic variant) can win a
    decode step's one row and lose at eight."""
    ops = native_ops()

    def int8_wins(x: torch.Tensor, elapsed: dict[int, float]) -> bool:
        """Three more alternating runs a mode into ``elapsed`` (each mode's fastest);
        whether int8's is still the faster."""
        for _ in range(3):
            for mode in elapsed:
                start = time.perf_counter()
                kind = mode | GROUPED if mode == INT8 else mode  # (int8's fastest kernels)
                ops.quant_matmul(x, linear.raws, linear.types, kind, linear.policy.variant)
                elapsed[mode] = min(elapsed[mode], time.perf_counter() - start)
        return elapsed[INT8] <= elapsed[tiles]

    best: int | None = 0
    for rows in sizes:
        x = torch.randn(rows, linear.cols)
        elapsed = {INT8: float("inf"), tiles: float("inf")}
        # where tiles win, three more runs a mode decide: a busy moment of the machine
        # across int8's runs would hand the step sizes from there on to the slower kind
        # (seen with another process's tests running beside)
        if not (int8_wins(x, elapsed) or int8_wins(x, elapsed)):
            return best
        best = rows
    return None
