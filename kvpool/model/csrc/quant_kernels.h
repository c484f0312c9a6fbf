// The table of quantized-product kernels one instruction set provides (quant_isa_*.cpp)
// and the data they work on. The dispatcher (quant_ops.cpp) picks a table at run time by
// what the CPU has, and runs the kernels over rows in parallel; the kernels themselves
// are single-threaded, take raw pointers, and use nothing from the C++ library (they are
// compiled for several instruction sets in one module: see quant_blocks.h).

#pragma once

#include <stdint.h>

namespace kvp {

// Activations quantized for the integer products: each row's blocks of 32 values as
// int8 (q = round(x / d)), their scales d, d * sum(q) (for the weight formats with an
// offset or a minimum) and d * sum(q) of each 16 values (Q6_K's offset, per scale).
// Rows are k, k / 32, k / 32 and k / 16 apart.
struct Q8Rows {
  const int8_t* q;
  const float* d;
  const float* ds;
  const float* dsh;
  int64_t k;
};

struct QuantKernels {
  const char* name;  // the instruction set: "avx512-vnni", "avx2", "generic"
  // Quantize m rows of k floats (k a multiple of 32) into q, d, ds, dsh.
  void (*quantize_rows)(const float* x, int64_t m, int64_t k, int8_t* q, float* d, float* ds,
                        float* dsh);
  // Does this table have integer products for ggml type t?
  bool (*has_int_dot)(int t);
  // y[r * ldy + n] = dot(weight row n, activation row r) for n in [0, n_rows) and r in
  // [0, m): weight rows of type t are row_bytes apart, activations quantized.
  void (*int_dot)(int t, const uint8_t* w, int64_t row_bytes, int64_t n_rows, const Q8Rows* a,
                  int64_t m, float* y, int64_t ldy);
  // out[i * k ...] = weight rows [0, n_rows) of type t dequantized to floats.
  void (*dequantize_rows)(int t, const uint8_t* w, int64_t row_bytes, int64_t n_rows, int64_t k,
                          float* out);
  // Does this table multiply the packed layout (quant_packed.h) of ggml type t?
  bool (*has_packed_dot)(int t);
  // As int_dot, for n_groups packed groups of 8 rows (group_bytes apart): rows 8 g .. 8 g + 7.
  void (*packed_dot)(int t, const uint8_t* w, int64_t group_bytes, int64_t n_groups,
                     const Q8Rows* a, int64_t m, float* y, int64_t ldy);
  // y[r * ldy + n] = dot(float weight row n of w (ldw apart), x row r (k apart)), all float32.
  void (*float_dot)(const float* w, int64_t ldw, int64_t n_rows, const float* x, int64_t m,
                    int64_t k, float* y, int64_t ldy);
};

}  // namespace kvp

extern "C" {
const kvp::QuantKernels* kvp_quant_kernels_generic();
const kvp::QuantKernels* kvp_quant_kernels_avx2();
const kvp::QuantKernels* kvp_quant_kernels_avx512_vnni();
const kvp::QuantKernels* kvp_quant_kernels_avx512_bf16();
}
