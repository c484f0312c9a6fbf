// Decode attention straight from the paged KV store: one query token per sequence,
// its context read through the sequence's block table, no gathered copy.
//
// q:            [B, num_heads, head_dim]            (float32 or bfloat16)
// layer_kv:     [2 * kv_heads, slots, head_dim]     K heads then V heads, same dtype
// block_tables: [B, max_blocks] int64               block ids of each context, in order
// context_lens: [B] int64                           tokens of context (the new one included)
// window:       keys a query sees, its own included (a sliding window); 0: the whole context
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
#include <array>
#include <atomic>
#include <string>
#include <vector>

#include "isa_select.h"
#include "native_ops.h"
#include "parallel.h"

namespace {

// Cheap checks (a few thousand integers) that keep a bad table or length from reading
// outside the store: heads in whole groups, every block id in the store, every context
// length within its table.
void check_tables(const at::Tensor& q, const at::Tensor& layer_kv, const at::Tensor& tables,
                  const at::Tensor& lens, int64_t block_size) {
  TORCH_CHECK(tables.size(0) == lens.size(0), "one row per sequence");
  TORCH_CHECK(layer_kv.size(0) % 2 == 0 && q.size(1) % (layer_kv.size(0) / 2) == 0,
              "query heads in whole groups of the kv heads");
  const int64_t store_blocks = layer_kv.size(1) / block_size;
  const int64_t* t = tables.data_ptr<int64_t>();
  for (int64_t i = 0; i < tables.numel(); ++i)
    TORCH_CHECK(t[i] >= 0 && t[i] < store_blocks, "block id out of the store");
  const int64_t* l = lens.data_ptr<int64_t>();
  for (int64_t i = 0; i < lens.numel(); ++i)
    TORCH_CHECK(l[i] >= 1 && l[i] <= tables.size(1) * block_size, "context length out of its table");
}

}  // namespace

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& layer_kv,
                                  const at::Tensor& block_tables, const at::Tensor& context_lens,
                                  int64_t block_size, double scale, const std::string& variant,
                                  int64_t window) {
  TORCH_CHECK(q.dim() == 3 && layer_kv.dim() == 3, "q [B, heads, dim], layer_kv [2 kv, slots, dim]");
  TORCH_CHECK(window >= 0, "a window of 0 (none) or more keys");
  TORCH_CHECK(q.is_contiguous() && layer_kv.is_contiguous(), "contiguous inputs");
  TORCH_CHECK(q.scalar_type() == layer_kv.scalar_type(), "q and layer_kv of one dtype");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && context_lens.scalar_type() == at::kLong,
              "int64 block tables and context lengths");
  auto tables = block_tables.contiguous();
  auto lens = context_lens.contiguous();
  TORCH_CHECK(tables.size(0) == q.size(0), "one row per sequence");
  check_tables(q, layer_kv, tables, lens, block_size);
  const int64_t* l = lens.data_ptr<int64_t>();
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16, "float32 or bfloat16");
  auto out = at::empty({q.size(0), q.size(1) * q.size(2)}, q.options());
  const auto* kernels = kvp::variant(variant).attention;
  kvp::AttnArgs args{q.data_ptr(), layer_kv.data_ptr(), tables.data_ptr<int64_t>(),
                     lens.data_ptr<int64_t>(), out.data_ptr(), q.size(1), layer_kv.size(0) / 2,
                     q.size(2), layer_kv.size(1), tables.size(1), block_size,
                     static_cast<float>(scale), q.scalar_type() == at::kBFloat16, window};
  const int64_t group = args.num_heads / args.kv_heads;
  int64_t longest = 0;
  for (int64_t i = 0; i < lens.numel(); ++i) longest = std::max(longest, l[i]);
  const int64_t scratch = group * (longest + 2 * args.dim + 128) + args.dim;
  kvp::parallel_for(0, q.size(0) * args.kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> buffer(scratch);
    kernels->run(&args, begin, end, buffer.data());
  });
  return out;
}

// Attention of any number of new tokens per sequence over a paged store of any element
// type (float32, bfloat16, float16, or int8 rows with their scale): prefill chunks,
// decode tokens and mixed steps in one call.
//
// q:            [T, num_heads, head_dim]        float32 or bfloat16
// layer_kv:     [2 * kv_heads, slots, row]      row = head_dim elements, or for int8
//                                               head_dim bytes + a float16 scale per 32
// block_tables: [S, max_blocks] int64
// context_lens: [S] int64                       each sequence's context, new tokens included
// query_start:  [S + 1] int64                   sequence s's new tokens are q rows
//                                               query_start[s] .. query_start[s + 1]
// window:       keys a new token sees, its own included (a sliding window); 0: all
//               keys up to its position
// returns       [T, num_heads * head_dim]       in q's dtype
at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& layer_kv,
                           const at::Tensor& block_tables, const at::Tensor& context_lens,
                           const at::Tensor& query_start, int64_t block_size, double scale,
                           const std::string& variant, int64_t window) {
  TORCH_CHECK(q.dim() == 3 && layer_kv.dim() == 3, "q [T, heads, dim], layer_kv [2 kv, slots, row]");
  TORCH_CHECK(window >= 0, "a window of 0 (none) or more keys");
  TORCH_CHECK(q.is_contiguous() && layer_kv.is_contiguous(), "contiguous inputs");
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16, "q: float32 or bfloat16");
  const int64_t dim = q.size(2);
  int kv_type;
  switch (layer_kv.scalar_type()) {
    case at::kFloat: kv_type = kvp::kKvF32; break;
    case at::kBFloat16: kv_type = kvp::kKvBF16; break;
    case at::kHalf: kv_type = kvp::kKvF16; break;
    case at::kChar: kv_type = kvp::kKvInt8; break;
    default: TORCH_CHECK(false, "layer_kv: float32, bfloat16, float16 or int8");
  }
  const int64_t row_bytes =
      kv_type == kvp::kKvInt8 ? dim + 2 * ((dim + 31) / 32) : dim * layer_kv.element_size();
  TORCH_CHECK(layer_kv.size(2) * layer_kv.element_size() == row_bytes,
              "layer_kv rows: head_dim elements (int8: and a float16 scale per 32)");
  for (const auto* t : {&block_tables, &context_lens, &query_start})
    TORCH_CHECK(t->scalar_type() == at::kLong, "int64 tables, lengths and query starts");
  auto tables = block_tables.contiguous();
  auto lens = context_lens.contiguous();
  auto starts = query_start.contiguous();
  const int64_t seqs = tables.size(0);
  TORCH_CHECK(starts.size(0) == seqs + 1, "one query start per sequence, and the end");
  check_tables(q, layer_kv, tables, lens, block_size);
  const int64_t* t = tables.data_ptr<int64_t>();
  const int64_t* l = lens.data_ptr<int64_t>();
  const int64_t* st = starts.data_ptr<int64_t>();
  TORCH_CHECK(st[0] == 0 && st[seqs] == q.size(0), "query starts from 0 to the tokens of q");
  const int64_t tile = 16;  // new tokens of one sequence per item
  // (keys the tile reads, sequence, first new token): its cost grows with the keys
  std::vector<std::array<int64_t, 3>> order;
  for (int64_t s = 0; s < seqs; ++s) {
    const int64_t nq = st[s + 1] - st[s];
    TORCH_CHECK(nq >= 1 && nq <= l[s], "each sequence brings 1 .. context new tokens");
    for (int64_t j = 0; j < nq; j += tile) order.push_back({l[s] - nq + std::min(j + tile, nq), s, j});
  }
  // The costliest tiles first, and each thread takes the next item when it is done: the
  // threads end together (a causal prompt's last tiles read many times its first ones'
  // keys, and equal shares of the items in order left one thread with most of the work).
  std::stable_sort(order.begin(), order.end(),
                   [](const auto& x, const auto& y) { return x[0] > y[0]; });
  std::vector<int64_t> tiles;
  for (const auto& o : order) {
    tiles.push_back(o[1]);
    tiles.push_back(o[2]);
  }
  auto out = at::empty({q.size(0), q.size(1) * dim}, q.options());
  const auto* kernels = kvp::variant(variant).attention;
  kvp::VarlenArgs args{q.data_ptr(), static_cast<const uint8_t*>(layer_kv.data_ptr()),
                       t, l, st, tiles.data(), out.data_ptr(), q.size(1), layer_kv.size(0) / 2,
                       dim, layer_kv.size(1), tables.size(1), block_size, row_bytes, tile,
                       static_cast<float>(scale), q.scalar_type() == at::kBFloat16, kv_type,
                       window};
  const int64_t items = static_cast<int64_t>(tiles.size() / 2) * args.kv_heads;
  const int64_t scratch = kvp::varlen_scratch(args);
  const int64_t workers = std::min<int64_t>(kvp::num_threads(), items);
  std::atomic<int64_t> next{0};
  kvp::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    std::vector<float> buffer(scratch);
    for (int64_t item; (item = next.fetch_add(1, std::memory_order_relaxed)) < items;)
      kernels->run_varlen(&args, item, item + 1, buffer.data());
  });
  return out;
}
