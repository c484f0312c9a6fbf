// The row-wise ops around a layer's matrix products (RMSNorm with the residual add, the
// rotary embedding, the feed-forward's silu(gate) * up), per instruction set (row_kernels.inc, compiled in each isa_*.cpp)
// and chosen at run time with the other kernels: compiled for x86-64's baseline alone,
// their bfloat16 forms ran 3.5x slower than with AVX-512 (the measurements:
// docs/performance.md). Raw pointers, one thread; fused_ops.cpp checks the tensors and
// splits the rows over threads.
//
// Every variant computes the same values: element-wise float32 arithmetic, the sum of
// squares in 16 partial sums (the same order at any vector width), no fused
// multiply-adds (contraction is off in row_kernels.inc), bfloat16 rounded to nearest
// even (NaN to 0x7FC0) as c10::BFloat16 rounds.

#pragma once

#include <stdint.h>

namespace kvp {

struct RowKernels {
  const char* name;
  // Rows [0, m) of n values (bf16: raw bits): x += y where y is not null (rounded to the
  // element type, as torch's add), then h = x * rsqrt(mean(x^2) + eps) * w, in float32
  // and rounded once (as torch's rms_norm).
  void (*add_rms_norm)(bool bf16, void* x, const void* y, const void* w, int64_t m, int64_t n,
                       float eps, void* h);
  // One head row x rotated into dst: x * cos + rotate_half(x) * sin_signed in the
  // half-split layout, each product and the sum rounded to the element type (as the
  // torch form rounds).
  void (*rotate)(bool bf16, const void* x, const void* cos, const void* sin_signed, int64_t dim,
                 void* dst);
  // Rows [0, m) of gate_up ([gate (n) | up (n)] each) into out ([m, n]): silu(gate) * up,
  // silu(g) = g / (1 + exp(-g)) rounded to the element type, then the product rounded
  // (where torch's F.silu(gate) * up rounds). exp is the kernels' own polynomial
  // (expf_poly), not torch's: float32 results may differ from torch's in the last bits,
  // so the float32 model keeps torch's ops.
  void (*silu_mul)(bool bf16, const void* gate_up, int64_t m, int64_t n, void* out);
};

}  // namespace kvp

extern "C" {
const kvp::RowKernels* kvp_row_kernels_generic();
const kvp::RowKernels* kvp_row_kernels_avx2();
const kvp::RowKernels* kvp_row_kernels_aarch64_dotprod();
const kvp::RowKernels* kvp_row_kernels_avx512_vnni();
const kvp::RowKernels* kvp_row_kernels_avx512_bf16();
const kvp::RowKernels* kvp_row_kernels_avx512_amx();
}
