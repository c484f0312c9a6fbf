// Decode attention straight from the paged KV store: one query token per sequence,
// its context read through the sequence's block table, no gathered copy.
//
// q:            [B, num_heads, head_dim]            (float32 or bfloat16)
// layer_kv:     [2 * kv_heads, slots, head_dim]     K heads then V heads, same dtype
// block_tables: [B, max_blocks] int64               block ids of each context, in order
// context_lens: [B] int64                           tokens of context (the new one included)
// returns       [B, num_heads * head_dim]           in q's dtype
//
// Scores and the softmax are computed in float32 (bf16 key dots with the CPU's bf16
// dot-product instruction where it has one: exact products, float32 sums); the weighted
// sum of values too. Work is split over (sequence, kv head) pairs; the query heads of a
// group share each key read. The kernels (attention_kernels.inc) are compiled per
// instruction set and chosen at run time (isa_select.cpp); this file checks the inputs
// and splits the work.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <string>
#include <vector>

#include "isa_select.h"

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& layer_kv,
                                  const at::Tensor& block_tables, const at::Tensor& context_lens,
                                  int64_t block_size, double scale, const std::string& variant) {
  TORCH_CHECK(q.dim() == 3 && layer_kv.dim() == 3, "q [B, heads, dim], layer_kv [2 kv, slots, dim]");
  TORCH_CHECK(q.is_contiguous() && layer_kv.is_contiguous(), "contiguous inputs");
  TORCH_CHECK(q.scalar_type() == layer_kv.scalar_type(), "q and layer_kv of one dtype");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && context_lens.scalar_type() == at::kLong,
              "int64 block tables and context lengths");
  auto tables = block_tables.contiguous();
  auto lens = context_lens.contiguous();
  // Cheap checks (a few thousand integers) that keep a bad table from reading out of bounds.
  TORCH_CHECK(tables.size(0) == q.size(0) && lens.size(0) == q.size(0), "one row per sequence");
  TORCH_CHECK(layer_kv.size(0) % 2 == 0 && q.size(1) % (layer_kv.size(0) / 2) == 0,
              "query heads in whole groups of the kv heads");
  const int64_t store_blocks = layer_kv.size(1) / block_size;
  const int64_t* t = tables.data_ptr<int64_t>();
  for (int64_t i = 0; i < tables.numel(); ++i)
    TORCH_CHECK(t[i] >= 0 && t[i] < store_blocks, "block id out of the store");
  const int64_t* l = lens.data_ptr<int64_t>();
  for (int64_t i = 0; i < lens.numel(); ++i)
    TORCH_CHECK(l[i] >= 1 && l[i] <= tables.size(1) * block_size, "context length out of its table");
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16, "float32 or bfloat16");
  auto out = at::empty({q.size(0), q.size(1) * q.size(2)}, q.options());
  const auto* kernels = kvp::variant(variant).attention;
  kvp::AttnArgs args{q.data_ptr(), layer_kv.data_ptr(), tables.data_ptr<int64_t>(),
                     lens.data_ptr<int64_t>(), out.data_ptr(), q.size(1), layer_kv.size(0) / 2,
                     q.size(2), layer_kv.size(1), tables.size(1), block_size,
                     static_cast<float>(scale), q.scalar_type() == at::kBFloat16};
  const int64_t group = args.num_heads / args.kv_heads;
  int64_t longest = 0;
  for (int64_t i = 0; i < lens.numel(); ++i) longest = std::max(longest, l[i]);
  const int64_t scratch = group * (longest + 2 * args.dim) + args.dim;
  at::parallel_for(0, q.size(0) * args.kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> buffer(scratch);
    kernels->run(&args, begin, end, buffer.data());
  });
  return out;
}
