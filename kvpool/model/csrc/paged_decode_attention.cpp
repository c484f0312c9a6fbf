// Decode attention straight from the paged KV store: one query token per sequence,
// its context read through the sequence's block table, no gathered copy.
//
// q:            [B, num_heads, head_dim]            (float32 or bfloat16)
// layer_kv:     [2 * kv_heads, slots, head_dim]     K heads then V heads, same dtype
// block_tables: [B, max_blocks] int64               block ids of each context, in order
// context_lens: [B] int64                           tokens of context (the new one included)
// returns       [B, num_heads * head_dim]           in q's dtype
//
// Scores and the softmax are computed in float32; the weighted sum of values too. Work is
// split over (sequence, kv head) pairs; the query heads of a group share each key read.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) { return static_cast<float>(x); }

// The hardware prefetcher follows ascending runs and stops at each block's end, and a
// sequence's blocks lie anywhere in the store: read token by token, a scattered block
// table ran at half the speed of one in store order (batch 16 x 300 tokens, 30 layers:
// 18.5 vs 10.5 ms). So the loops walk blocks, and each row read asks for the same slot
// of the table's next block: 11.9 vs 10.4 ms with it. (Check with objdump that a change
// keeps the prefetch instructions: gcc 12 dropped them from a variant that returned
// early, and a lambda loop body cost 10% more.)
template <typename T>
inline void prefetch_row(const T* row, int64_t dim) {
  const char* p = reinterpret_cast<const char*>(row);
  for (int64_t off = 0; off < dim * static_cast<int64_t>(sizeof(T)); off += 64)
    __builtin_prefetch(p + off);
}

constexpr int kLanes = 16;  // partial sums kept apart so the compiler can vectorize dots

// D: head_dim when it is a compile-time constant (the common sizes), 0 for any other.
template <typename T, int D>
void decode_attention_impl(const at::Tensor& q, const at::Tensor& layer_kv,
                           const at::Tensor& block_tables, const at::Tensor& context_lens,
                           int64_t block_size, double scale, at::Tensor& out) {
  const int64_t batch = q.size(0), num_heads = q.size(1);
  const int64_t dim = D > 0 ? D : q.size(2);
  const int64_t kv_heads = layer_kv.size(0) / 2, slots = layer_kv.size(1);
  const int64_t group = num_heads / kv_heads, max_blocks = block_tables.size(1);
  const T* q_ptr = q.data_ptr<T>();
  const T* kv_ptr = layer_kv.data_ptr<T>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  T* out_ptr = out.data_ptr<T>();
  const float fscale = static_cast<float>(scale);
  const bool lanes_fit = dim % kLanes == 0;

  at::parallel_for(0, batch * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, acc(group * dim), query(group * dim), row(dim);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / kv_heads, h = item % kv_heads;
      const int64_t len = lens[b];
      scores.resize(group * len);
      for (int64_t j = 0; j < group; ++j)
        for (int64_t x = 0; x < dim; ++x)
          query[j * dim + x] = to_float(q_ptr[(b * num_heads + h * group + j) * dim + x]) * fscale;
      const T* k_head = kv_ptr + h * slots * dim;
      const T* v_head = kv_ptr + (kv_heads + h) * slots * dim;
      const int64_t* table = tables + b * max_blocks;
      for (int64_t blk = 0, start = 0; start < len; ++blk, start += block_size) {
        const T* base = k_head + table[blk] * block_size * dim;
        const T* ahead = k_head + table[start + block_size < len ? blk + 1 : blk] * block_size * dim;
        for (int64_t t = start; t < std::min(start + block_size, len); ++t) {
          const T* k = base + (t - start) * dim;
          prefetch_row(ahead + (t - start) * dim, dim);
          float* key = row.data();
          for (int64_t x = 0; x < dim; ++x) key[x] = to_float(k[x]);
          for (int64_t j = 0; j < group; ++j) {
            const float* qj = query.data() + j * dim;
            float s = 0.f;
            if (lanes_fit) {
              float part[kLanes] = {0.f};
              for (int64_t x = 0; x < dim; x += kLanes)
                for (int l = 0; l < kLanes; ++l) part[l] += qj[x + l] * key[x + l];
              for (int l = 0; l < kLanes; ++l) s += part[l];
            } else {
              for (int64_t x = 0; x < dim; ++x) s += qj[x] * key[x];
            }
            scores[j * len + t] = s;
          }
        }
      }
      for (int64_t j = 0; j < group; ++j) {
        float* sj = scores.data() + j * len;
        const float m = *std::max_element(sj, sj + len);
        float total = 0.f;
        for (int64_t t = 0; t < len; ++t) {
          sj[t] = std::exp(sj[t] - m);
          total += sj[t];
        }
        const float inv = 1.f / total;
        for (int64_t t = 0; t < len; ++t) sj[t] *= inv;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t blk = 0, start = 0; start < len; ++blk, start += block_size) {
        const T* base = v_head + table[blk] * block_size * dim;
        const T* ahead = v_head + table[start + block_size < len ? blk + 1 : blk] * block_size * dim;
        for (int64_t t = start; t < std::min(start + block_size, len); ++t) {
          const T* v = base + (t - start) * dim;
          prefetch_row(ahead + (t - start) * dim, dim);
          float* value = row.data();
          for (int64_t x = 0; x < dim; ++x) value[x] = to_float(v[x]);
          for (int64_t j = 0; j < group; ++j) {
            const float p = scores[j * len + t];
            float* aj = acc.data() + j * dim;
            for (int64_t x = 0; x < dim; ++x) aj[x] += p * value[x];
          }
        }
      }
      for (int64_t j = 0; j < group; ++j)
        for (int64_t x = 0; x < dim; ++x)
          out_ptr[(b * num_heads + h * group + j) * dim + x] = static_cast<T>(acc[j * dim + x]);
    }
  });
}

template <typename T>
void dispatch_dim(const at::Tensor& q, const at::Tensor& layer_kv, const at::Tensor& tables,
                  const at::Tensor& lens, int64_t block_size, double scale, at::Tensor& out) {
  switch (q.size(2)) {
    case 64: return decode_attention_impl<T, 64>(q, layer_kv, tables, lens, block_size, scale, out);
    case 128: return decode_attention_impl<T, 128>(q, layer_kv, tables, lens, block_size, scale, out);
    default: return decode_attention_impl<T, 0>(q, layer_kv, tables, lens, block_size, scale, out);
  }
}

}  // namespace

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& layer_kv,
                                  const at::Tensor& block_tables, const at::Tensor& context_lens,
                                  int64_t block_size, double scale) {
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
  auto out = at::empty({q.size(0), q.size(1) * q.size(2)}, q.options());
  if (q.scalar_type() == at::kFloat) {
    dispatch_dim<float>(q, layer_kv, tables, lens, block_size, scale, out);
  } else {
    TORCH_CHECK(q.scalar_type() == at::kBFloat16, "float32 or bfloat16");
    dispatch_dim<c10::BFloat16>(q, layer_kv, tables, lens, block_size, scale, out);
  }
  return out;
}
