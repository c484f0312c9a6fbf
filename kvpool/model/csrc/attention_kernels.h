// Decode attention kernels per instruction set (attention_isa_*.cpp, from
// attention_kernels.inc), chosen at run time by paged_decode_attention.cpp. Raw pointers
// only, single-threaded: the dispatcher splits the (sequence, KV head) items over threads.

#pragma once

#include <stdint.h>

namespace kvp {

struct AttnArgs {
  const void* q;           // [B, num_heads, dim], float32 or bfloat16 (bf16: raw bits)
  const void* kv;          // [2 * kv_heads, slots, dim], q's dtype
  const int64_t* tables;   // [B, max_blocks]
  const int64_t* lens;     // [B]
  void* out;               // [B, num_heads * dim], q's dtype
  int64_t num_heads, kv_heads, dim, slots, max_blocks, block_size;
  float scale;
  bool bf16;
  int64_t window;          // keys a query sees, its own included (0: all of its context)
};

// The element types a KV store may hold (paged_attention): float32, bfloat16, float16,
// or int8 in groups of 32 values with a float16 scale each (ggml's q8_0 grouping): a
// (token, KV head) row is dim int8 values, then its ceil(dim / 32) scales (value = q *
// scale).
enum KvType : int { kKvF32 = 0, kKvBF16 = 1, kKvF16 = 2, kKvInt8 = 3 };

struct VarlenArgs {
  const void* q;           // [T, num_heads, dim], float32 or bfloat16 (q_bf16)
  const uint8_t* kv;       // [2 * kv_heads, slots, row_bytes]: K heads then V heads
  const int64_t* tables;   // [S, max_blocks]
  const int64_t* lens;     // [S] context tokens of each sequence, its new ones included
  const int64_t* q_start;  // [S + 1] sequence s's new tokens are q rows q_start[s] ..
  const int64_t* tiles;    // [n_tiles, 2]: (sequence, its first new token in the tile)
  void* out;               // [T, num_heads * dim], q's dtype
  int64_t num_heads, kv_heads, dim, slots, max_blocks, block_size, row_bytes, tile;
  float scale;
  bool q_bf16;
  int kv_type;             // KvType
  int64_t window;          // keys a query sees, its own included (0: all up to it)
};

struct AttentionKernels {
  const char* name;
  // Items [begin, end) of B * kv_heads; scratch: group * (max context + 2 * dim + 128)
  // + dim floats.
  void (*run)(const AttnArgs* args, int64_t begin, int64_t end, float* scratch);
  // Items [begin, end) of n_tiles * kv_heads; scratch: varlen_scratch(args) floats.
  void (*run_varlen)(const VarlenArgs* args, int64_t begin, int64_t end, float* scratch);
};

// Keys run_varlen's vector kernels take at a time: whole blocks, 64 keys where the
// block size divides 64.
static inline int64_t varlen_span(int64_t block_size) {
  return block_size >= 64 ? block_size : 64 / block_size * block_size;
}

// Floats of scratch one thread of run_varlen needs.
static inline int64_t varlen_scratch(const VarlenArgs& a) {
  const int64_t rows = a.tile * (a.num_heads / a.kv_heads);
  // a span in whole vectors (a span holds at least a block: attend_varlen's too)
  const int64_t width = (varlen_span(a.block_size) + 15) / 16 * 16;
  return rows * (2 * a.dim + width + 3) + 2 * width * a.dim;
}

}  // namespace kvp

extern "C" {
const kvp::AttentionKernels* kvp_attention_kernels_generic();
const kvp::AttentionKernels* kvp_attention_kernels_avx2();
const kvp::AttentionKernels* kvp_attention_kernels_aarch64_dotprod();
const kvp::AttentionKernels* kvp_attention_kernels_avx512_vnni();
const kvp::AttentionKernels* kvp_attention_kernels_avx512_bf16();
const kvp::AttentionKernels* kvp_attention_kernels_avx512_amx();
}
