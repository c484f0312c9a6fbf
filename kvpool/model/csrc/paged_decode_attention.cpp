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
// group share each key read.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

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

// Block blk of a sequence's table (its tokens start at start), for one head: its first
// row and the first row of the block after it (of this one, for the last block).
template <typename T>
inline std::pair<const T*, const T*> block_and_next(const T* head, const int64_t* table, int64_t blk,
                                                    int64_t start, int64_t len, int64_t block_size,
                                                    int64_t dim) {
  const int64_t next = start + block_size < len ? blk + 1 : blk;
  return {head + table[blk] * block_size * dim, head + table[next] * block_size * dim};
}

// exp(x) for x <= 0 (softmax arguments once the max is subtracted): Cody-Waite range
// reduction and a degree-6 polynomial (Cephes' expf coefficients), within 1 float32 ulp
// of exp (checked at 8.7 million points of [-87, 0]). std::exp is a scalar library call,
// and took a fifth of the kernel's time; this one inlines, and exp16_nonpositive runs it
// 16 lanes at a time.
inline float exp_nonpositive(float x) {
  x = std::max(x, -87.0f);  // exp(-87) ~ 1.6e-38: 2^n stays a normal float
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float two_n;
  std::memcpy(&two_n, &bits, sizeof(two_n));
  return p * two_n;
}

#if defined(__AVX512F__)
inline __m512 exp16_nonpositive(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f),
                                   _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x));
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);  // p * 2^n
}
#endif

// sj[t] = exp(sj[t] - m) for t < len; returns their sum.
inline float exp_shifted(float* sj, int64_t len, float m) {
  int64_t t = 0;
  float total = 0.f;
#if defined(__AVX512F__)
  __m512 sums = _mm512_setzero_ps();
  for (; t + 16 <= len; t += 16) {
    const __m512 e = exp16_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(sj + t), _mm512_set1_ps(m)));
    _mm512_storeu_ps(sj + t, e);
    sums = _mm512_add_ps(sums, e);
  }
  total = _mm512_reduce_add_ps(sums);
#endif
  for (; t < len; ++t) {
    sj[t] = exp_nonpositive(sj[t] - m);
    total += sj[t];
  }
  return total;
}

#if defined(__AVX512BF16__)
// q . k over D bf16 elements with the CPU's bf16 dot-product instruction: exact products,
// float32 sums, and no conversion of the key row (the generic loop converts each row,
// then multiplies in float32). Half the kernel's time at batch 16 x 300 tokens went there.
template <int D>
inline float dot_bf16(const c10::BFloat16* q, const c10::BFloat16* k) {
  __m512 sum = _mm512_setzero_ps();
  for (int x = 0; x < D; x += 32)
    sum = _mm512_dpbf16_ps(sum, (__m512bh)_mm512_loadu_si512(q + x), (__m512bh)_mm512_loadu_si512(k + x));
  return _mm512_reduce_add_ps(sum);
}
#endif

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
#if defined(__AVX512BF16__)
  // Key dots straight from bf16 q and k (dot_bf16); the fp32 query copy is then unused.
  constexpr bool bf16_dots = std::is_same_v<T, c10::BFloat16> && D > 0 && D % 32 == 0;
#else
  constexpr bool bf16_dots = false;
#endif

  at::parallel_for(0, batch * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, acc(group * dim), query(group * dim), row(dim);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / kv_heads, h = item % kv_heads;
      const int64_t len = lens[b];
      scores.resize(group * len);
      if constexpr (!bf16_dots) {
        for (int64_t j = 0; j < group; ++j)
          for (int64_t x = 0; x < dim; ++x)
            query[j * dim + x] = to_float(q_ptr[(b * num_heads + h * group + j) * dim + x]) * fscale;
      }
      const T* k_head = kv_ptr + h * slots * dim;
      const T* v_head = kv_ptr + (kv_heads + h) * slots * dim;
      const int64_t* table = tables + b * max_blocks;
      for (int64_t blk = 0, start = 0; start < len; ++blk, start += block_size) {
        const auto [base, ahead] = block_and_next(k_head, table, blk, start, len, block_size, dim);
        for (int64_t t = start; t < std::min(start + block_size, len); ++t) {
          const T* k = base + (t - start) * dim;
          prefetch_row(ahead + (t - start) * dim, dim);
#if defined(__AVX512BF16__)
          if constexpr (bf16_dots) {
            for (int64_t j = 0; j < group; ++j) {
              const T* qj = q_ptr + (b * num_heads + h * group + j) * dim;
              scores[j * len + t] = dot_bf16<D>(qj, k) * fscale;
            }
            continue;
          }
#endif
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
        const float inv = 1.f / exp_shifted(sj, len, m);
        for (int64_t t = 0; t < len; ++t) sj[t] *= inv;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t blk = 0, start = 0; start < len; ++blk, start += block_size) {
        const auto [base, ahead] = block_and_next(v_head, table, blk, start, len, block_size, dim);
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
