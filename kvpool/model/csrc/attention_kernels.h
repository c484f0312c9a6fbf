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
};

struct AttentionKernels {
  const char* name;
  // Items [begin, end) of B * kv_heads; scratch: group * (max context + 3 * dim) floats.
  void (*run)(const AttnArgs* args, int64_t begin, int64_t end, float* scratch);
};

}  // namespace kvp

extern "C" {
const kvp::AttentionKernels* kvp_attention_kernels_generic();
const kvp::AttentionKernels* kvp_attention_kernels_avx2();
const kvp::AttentionKernels* kvp_attention_kernels_avx512_vnni();
const kvp::AttentionKernels* kvp_attention_kernels_avx512_bf16();
}
