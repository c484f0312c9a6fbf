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
// offset or a minimum) and d * sum(q) of each 16 values (Q6_K's offset and Q2_K's minimums,
// per scale).
// off4 and off6: the offsets of Q4_0 (8) and Q6_K (32) in the integers, for the packed
// kernels that start their integer sums there (QuantKernels::sums_from_offsets): -8 times
// a block's q summed, and -32 times each 16 values' q summed, in the layout of the
// kernels' table (QuantKernels::offsets_into_sums: AVX2's by lane, positions 0, 1 mod 4
// and 2, 3 mod 4 as the two int16 halves of an int32; VNNI's whole); null where no
// kernel of the product reads them.
// Rows of q are ldq bytes apart (q_row_stride), those of the rest k / 32, k / 32, k / 16,
// k / 32 and k / 16.
struct Q8Rows {
  const int8_t* q;
  const float* d;
  const float* ds;
  const float* dsh;
  const int32_t* off4;
  const int32_t* off6;
  int64_t k;
  int64_t ldq;
};

// The bytes between rows of Q8Rows::q: k and a cache line. Rows k apart (k a multiple of
// 2 KiB in most models) put every row's unit u in the same one or two L1 sets, so a pass
// over many rows evicted its own activations: a line more moves row r r lines along.
// Measured (Zen 3, one thread, the 1B-class head, Q6_K 128256 x 2048, 32 rows): 0.98-0.99x
// the time at 8 rows a pass, 0.95-0.96x at 16, 0.92-0.94x at 32 (which, rows k apart,
// gained nothing).
inline int64_t q_row_stride(int64_t k) { return k + 64; }

// Two int16 values as the halves of an int32 (a first).
inline int32_t int16_pair(int32_t a, int32_t b) {
  return static_cast<int32_t>(static_cast<uint16_t>(a) |
                              (static_cast<uint32_t>(static_cast<uint16_t>(b)) << 16));
}

// off4 and off6 of m rows of quantized activations (k a multiple of 32, rows ldq apart)
// as the AVX2 packed kernels take them, from one pass over each block's lane sums
// (s[half][lane]). Each fits int16: |8 x 16 x 127| and |32 x 8 x 127| < 32768.
inline void offsets_as_lane_pairs(const int8_t* q, int64_t m, int64_t k, int64_t ldq,
                                  int32_t* off4, int32_t* off6) {
  for (int64_t r = 0, b = 0; r < m; ++r) {
    for (int64_t u = 0; u < k / 32; ++u, ++b) {
      const int8_t* x = q + r * ldq + 32 * u;
      int32_t s[2][2] = {{0, 0}, {0, 0}};
      for (int i = 0; i < 32; ++i) s[i >> 4][(i >> 1) & 1] += x[i];
      off4[b] = int16_pair(-8 * (s[0][0] + s[1][0]), -8 * (s[0][1] + s[1][1]));
      off6[2 * b] = int16_pair(-32 * s[0][0], -32 * s[0][1]);
      off6[2 * b + 1] = int16_pair(-32 * s[1][0], -32 * s[1][1]);
    }
  }
}

// off4 and off6 as the VNNI packed kernels take them: whole int32 sums (their int32 lanes
// sum every position of a row's values), -8 times a block's q summed and -32 times each
// 16 values'.
inline void offsets_whole(const int8_t* q, int64_t m, int64_t k, int64_t ldq, int32_t* off4,
                          int32_t* off6) {
  for (int64_t r = 0, b = 0; r < m; ++r) {
    for (int64_t u = 0; u < k / 32; ++u, ++b) {
      const int8_t* x = q + r * ldq + 32 * u;
      int32_t s[2] = {0, 0};
      for (int i = 0; i < 32; ++i) s[i >> 4] += x[i];
      off4[b] = -8 * (s[0] + s[1]);
      off6[2 * b] = -32 * s[0];
      off6[2 * b + 1] = -32 * s[1];
    }
  }
}

// Activation rows from which a step whose order of sums may be its own (quant_matmul's
// mode bit 6) takes int_dot's kernels for many rows (`grouped`: the x86 grid formats'):
// AVX-512's grid formats' row kernel still read faster in its single passes of 1 to 4
// rows; steps of 5 or more take it two passes or more (docs/performance.md).
constexpr int64_t kGroupedFrom = 5;

// How far ahead of their weights the kernels' passes of 1 to 4 activation rows, which
// stream the weights from memory, ask for them (quant_matmul's mode bit 7: far): 2 KiB
// read fastest on an AMX Xeon whose core streamed ~12 GB/s, and 8 KiB on a Zen 5 whose
// core streamed ~38 (a batch-1 step of an 8B-class file 0.85x the time there); which is
// the CPU's (its memory's latency times a core's rate), so ProductPolicy measures it.
constexpr int kReadAheadNear = 2048;
constexpr int kReadAheadFar = 8192;

// packed_dot's kernel for a single activation row (quant_matmul's mode, bits 4-5).
constexpr int kOneRowOwn = 0, kOneRowWide = 1, kOneRowNarrow = 2;

struct QuantKernels {
  const char* name;  // the instruction set: "avx512-vnni", "avx2", "generic"
  // Quantize m rows of k floats (k a multiple of 32) into q (rows ldq apart), d, ds, dsh.
  void (*quantize_rows)(const float* x, int64_t m, int64_t k, int8_t* q, int64_t ldq, float* d,
                        float* ds, float* dsh);
  // Does this table have integer products for ggml type t?
  bool (*has_int_dot)(int t);
  // y[r * ldy + n] = dot(weight row n, activation row r) for n in [0, n_rows) and r in
  // [0, m): weight rows of type t are row_bytes apart, activations quantized. Each output
  // is one row's sum in an order that does not depend on m, unless `grouped` (a step of
  // kGroupedFrom rows or more, where its order of sums may be its own): then a kernel for
  // many rows takes it where the table has one (the x86 grid formats, grid_group_dot,
  // starting its sums at off6: sums_from_offsets).
  // `ahead`: the read-ahead of passes of few rows (kReadAheadNear or kReadAheadFar).
  void (*int_dot)(int t, const uint8_t* w, int64_t row_bytes, int64_t n_rows, const Q8Rows* a,
                  int64_t m, float* y, int64_t ldy, bool grouped, int ahead);
  // out[i * k ...] = weight rows [0, n_rows) of type t dequantized to floats.
  void (*dequantize_rows)(int t, const uint8_t* w, int64_t row_bytes, int64_t n_rows, int64_t k,
                          float* out);
  // Does this table multiply the packed layout (quant_packed.h) of ggml type t?
  bool (*has_packed_dot)(int t);
  // Does its packed_dot of type t start its integer sums from Q8Rows' off4 / off6? (And
  // for the grid formats, kept in the file's layout: its int_dot where `grouped`.)
  bool (*sums_from_offsets)(int t);
  // off4 and off6 of m quantized rows (ldq apart) in this table's layout
  // (offsets_as_lane_pairs or offsets_whole).
  void (*offsets_into_sums)(const int8_t* q, int64_t m, int64_t k, int64_t ldq, int32_t* off4,
                            int32_t* off6);
  // As int_dot, for n_groups packed groups of 8 rows (group_bytes apart): rows 8 g .. 8 g + 7.
  // one_row, for a single activation row (m == 1): kOneRowOwn the table's own choice,
  // kOneRowWide AVX-512's kernel for pairs of groups, kOneRowNarrow one group at a time in
  // 256-bit vectors (the same results bit for bit; which reads faster is the CPU's: a
  // 512-bit unit's, or two 256-bit halves', ProductPolicy measures it at load).
  void (*packed_dot)(int t, const uint8_t* w, int64_t group_bytes, int64_t n_groups,
                     const Q8Rows* a, int64_t m, float* y, int64_t ldy, int one_row, int ahead);
  // y[r * ldy + n] = dot(float weight row n of w (ldw apart), x row r (k apart)), all float32.
  void (*float_dot)(const float* w, int64_t ldw, int64_t n_rows, const float* x, int64_t m,
                    int64_t k, float* y, int64_t ldy);
  // out[r * ldo ...] = rows [first, first + count) (0 <= first < first + count <= 8) of one
  // packed group of type t and k values a row (quant_packed.h), dequantized to floats.
  void (*dequantize_packed)(int t, const uint8_t* group, int64_t k, int first, int count,
                            float* out, int64_t ldo);
  // dequantize_rows and dequantize_packed into bf16 (bits; rounded as torch's .to() rounds
  // the floats): a bf16 tile's weights.
  void (*dequantize_rows_bf16)(int t, const uint8_t* w, int64_t row_bytes, int64_t n_rows,
                               int64_t k, uint16_t* out);
  void (*dequantize_packed_bf16)(int t, const uint8_t* group, int64_t k, int first, int count,
                                 uint16_t* out, int64_t ldo);
};

}  // namespace kvp

extern "C" {
const kvp::QuantKernels* kvp_quant_kernels_generic();
const kvp::QuantKernels* kvp_quant_kernels_avx2();
const kvp::QuantKernels* kvp_quant_kernels_aarch64_dotprod();
const kvp::QuantKernels* kvp_quant_kernels_avx512_vnni();
const kvp::QuantKernels* kvp_quant_kernels_avx512_bf16();
const kvp::QuantKernels* kvp_quant_kernels_avx512_amx();
}
