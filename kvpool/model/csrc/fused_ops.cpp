// The small ops around a layer's matrix products, fused: torch runs each of them as
// several kernels with a fixed cost of a few microseconds, which at one decoded token is
// most of their time (the measurements: docs/performance.md, "Measurements behind design
// choices").
//
// Each computes what the torch path computes, rounded to the tensor's dtype at the same
// points, so bf16 results are bit-identical to it (the RMSNorm's sum of squares may add
// in another order: within one rounding), float32 ones too (no fused multiply-adds). The
// row-wise arithmetic is the row kernels' (row_kernels.h), per instruction set, chosen at
// run time like the other kernels (``variant``: "" for the fastest this CPU runs); this
// file checks the tensors and splits the rows over threads.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cstring>
#include <cmath>
#include <string>
#include <type_traits>
#include <vector>

#include "isa_select.h"
#include "native_ops.h"
#include "parallel.h"

namespace {

inline float f32(float x) { return x; }
inline float f32(c10::BFloat16 x) { return static_cast<float>(x); }

// Whether T's tensors reach the row kernels as bf16 bits.
template <typename T> constexpr bool kBf16 = std::is_same_v<T, c10::BFloat16>;

// Rotary embedding of Q and K in the half-split layout (x * cos + rotate_half(x) * sin,
// with the sign in sin_signed; each product and the sum rounded to T), K and V written to
// the store at each token's slot; Q returned as [T, num_heads, head_dim].
template <typename T>
void rope_write_kv_impl(const kvp::RowKernels* k, const at::Tensor& qkv, const at::Tensor& cos,
                        const at::Tensor& sin_signed, at::Tensor& layer_kv, const at::Tensor& slots,
                        int64_t num_heads, at::Tensor& q) {
  const int64_t tokens = qkv.size(0), width = qkv.size(1);
  const int64_t kv_heads = layer_kv.size(0) / 2, store_slots = layer_kv.size(1);
  const int64_t dim = layer_kv.size(2);
  const T* src = qkv.data_ptr<T>();
  const T* c = cos.data_ptr<T>();
  const T* s = sin_signed.data_ptr<T>();
  const int64_t* slot = slots.data_ptr<int64_t>();
  T* store = layer_kv.data_ptr<T>();
  T* q_out = q.data_ptr<T>();
  kvp::parallel_for(0, tokens, 8, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* row = src + t * width;
      const T* ct = c + t * dim;
      const T* st = s + t * dim;
      for (int64_t h = 0; h < num_heads + kv_heads; ++h) {
        const T* x = row + h * dim;
        T* dst = h < num_heads ? q_out + (t * num_heads + h) * dim
                               : store + ((h - num_heads) * store_slots + slot[t]) * dim;
        k->rotate(kBf16<T>, x, ct, st, dim, dst);
      }
      const T* v = row + (num_heads + kv_heads) * dim;
      for (int64_t h = 0; h < kv_heads; ++h) {
        T* dst = store + ((kv_heads + h) * store_slots + slot[t]) * dim;
        for (int64_t i = 0; i < dim; ++i) dst[i] = v[h * dim + i];
      }
    }
  });
}

// One K or V row (dim values, already rounded to the compute dtype) written to a store of
// another element type: float32, bfloat16 or float16 by rounding to nearest even, or int8
// in groups of 32 values (ggml's q8_0 grouping; the last group may be shorter), each with
// a float16 scale = max |x| / 127, q = rint(x / scale) (all zeros: scale 0), so |x - q
// scale| <= scale / 2; the scales follow the row's dim bytes.
void write_row(uint8_t* dst, const float* x, int64_t dim, at::ScalarType type) {
  switch (type) {
    case at::kFloat: memcpy(dst, x, dim * sizeof(float)); return;
    case at::kBFloat16: {
      auto* d = reinterpret_cast<c10::BFloat16*>(dst);
      for (int64_t i = 0; i < dim; ++i) d[i] = static_cast<c10::BFloat16>(x[i]);
      return;
    }
    case at::kHalf: {
      auto* d = reinterpret_cast<c10::Half*>(dst);
      for (int64_t i = 0; i < dim; ++i) d[i] = static_cast<c10::Half>(x[i]);
      return;
    }
    default: {
      auto* q = reinterpret_cast<int8_t*>(dst);
      auto* scales = reinterpret_cast<c10::Half*>(dst + dim);  // 2-byte aligned: dim is even
      for (int64_t g = 0; g * 32 < dim; ++g) {
        const int64_t begin = g * 32, end = std::min(dim, begin + 32);
        float amax = 0.f;
        for (int64_t i = begin; i < end; ++i) amax = std::max(amax, std::fabs(x[i]));
        const c10::Half half_scale(std::min(amax / 127.f, 65504.f));
        const float scale = static_cast<float>(half_scale);
        const float inv = scale > 0.f ? 1.f / scale : 0.f;
        for (int64_t i = begin; i < end; ++i)
          q[i] = static_cast<int8_t>(std::max(-127.f, std::min(127.f, std::nearbyint(x[i] * inv))));
        scales[g] = half_scale;
      }
    }
  }
}

// rope_write_kv_impl for a store whose element type is not T: each K row is rotated as
// there (the same roundings to T), then converted by write_row.
template <typename T>
void rope_write_kv_convert(const kvp::RowKernels* k, const at::Tensor& qkv, const at::Tensor& cos,
                           const at::Tensor& sin_signed, at::Tensor& layer_kv,
                           const at::Tensor& slots, int64_t num_heads, int64_t dim, at::Tensor& q) {
  const int64_t tokens = qkv.size(0), width = qkv.size(1);
  const int64_t kv_heads = layer_kv.size(0) / 2, store_slots = layer_kv.size(1);
  const int64_t row_bytes = layer_kv.size(2) * layer_kv.element_size();
  const auto type = layer_kv.scalar_type();
  const T* src = qkv.data_ptr<T>();
  const T* c = cos.data_ptr<T>();
  const T* s = sin_signed.data_ptr<T>();
  const int64_t* slot = slots.data_ptr<int64_t>();
  auto* store = static_cast<uint8_t*>(layer_kv.data_ptr());
  T* q_out = q.data_ptr<T>();
  kvp::parallel_for(0, tokens, 8, [&](int64_t begin, int64_t end) {
    std::vector<float> row(dim);
    std::vector<T> rotated_k(dim);
    for (int64_t t = begin; t < end; ++t) {
      const T* in = src + t * width;
      const T* ct = c + t * dim;
      const T* st = s + t * dim;
      for (int64_t h = 0; h < num_heads + kv_heads; ++h) {
        const T* x = in + h * dim;
        if (h < num_heads) {
          k->rotate(kBf16<T>, x, ct, st, dim, q_out + (t * num_heads + h) * dim);
          continue;
        }
        k->rotate(kBf16<T>, x, ct, st, dim, rotated_k.data());
        for (int64_t i = 0; i < dim; ++i) row[i] = f32(rotated_k[i]);
        write_row(store + ((h - num_heads) * store_slots + slot[t]) * row_bytes, row.data(), dim, type);
      }
      const T* v = in + (num_heads + kv_heads) * dim;
      for (int64_t h = 0; h < kv_heads; ++h) {
        for (int64_t i = 0; i < dim; ++i) row[i] = f32(v[h * dim + i]);
        write_row(store + ((kv_heads + h) * store_slots + slot[t]) * row_bytes, row.data(), dim, type);
      }
    }
  });
}

void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 2 && t.is_contiguous(), name, ": a contiguous [rows, features] tensor");
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16,
              name, ": float32 or bfloat16");
}

}  // namespace

at::Tensor add_rms_norm_(at::Tensor& x, const c10::optional<at::Tensor>& y, const at::Tensor& weight,
                         double eps, const std::string& variant) {
  check_rows(x, "x");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1) && weight.is_contiguous() &&
              weight.scalar_type() == x.scalar_type(), "weight: [features] of x's dtype");
  if (y.has_value()) {
    check_rows(*y, "y");
    TORCH_CHECK(y->sizes() == x.sizes() && y->scalar_type() == x.scalar_type(), "y: x's shape and dtype");
  }
  const auto* k = kvp::variant(variant).rows;
  auto h = at::empty_like(x);
  const int64_t n = x.size(1), size = x.element_size();
  auto* xp = static_cast<uint8_t*>(x.data_ptr());
  const auto* yp = y.has_value() ? static_cast<const uint8_t*>(y->data_ptr()) : nullptr;
  auto* hp = static_cast<uint8_t*>(h.data_ptr());
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  kvp::parallel_for(0, x.size(0), 16, [&](int64_t begin, int64_t end) {
    const int64_t at = begin * n * size;
    k->add_rms_norm(bf16, xp + at, yp ? yp + at : nullptr, weight.data_ptr(), end - begin, n,
                    static_cast<float>(eps), hp + at);
  });
  return h;
}

at::Tensor rope_write_kv(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin_signed,
                         at::Tensor& layer_kv, const at::Tensor& slots, int64_t num_heads,
                         const std::string& variant) {
  check_rows(qkv, "qkv");
  const auto kv_type = layer_kv.scalar_type();
  const bool same = kv_type == qkv.scalar_type();
  TORCH_CHECK(layer_kv.dim() == 3 && layer_kv.is_contiguous() &&
              (same || kv_type == at::kFloat || kv_type == at::kBFloat16 || kv_type == at::kHalf ||
               kv_type == at::kChar),
              "layer_kv: contiguous [2 * kv_heads, slots, row] of qkv's dtype, float32, "
              "bfloat16, float16 or int8");
  const int64_t tokens = qkv.size(0), kv_heads = layer_kv.size(0) / 2;
  const int64_t dim = qkv.size(1) / (num_heads + 2 * kv_heads);
  TORCH_CHECK(dim > 0 && dim % 2 == 0 && qkv.size(1) == (num_heads + 2 * kv_heads) * dim,
              "qkv: [tokens, (num_heads + 2 * kv_heads) * head_dim]");
  const int64_t row = kv_type == at::kChar ? dim + 2 * ((dim + 31) / 32) : dim;
  TORCH_CHECK(layer_kv.size(2) == row, "layer_kv rows: head_dim elements (int8: and the scales)");
  for (const auto* t : {&cos, &sin_signed})
    TORCH_CHECK(t->is_contiguous() && t->numel() == tokens * dim && t->scalar_type() == qkv.scalar_type(),
                "cos, sin_signed: contiguous [tokens, 1, head_dim] of qkv's dtype");
  TORCH_CHECK(slots.dim() == 1 && slots.size(0) == tokens && slots.scalar_type() == at::kLong &&
              slots.is_contiguous(), "slots: [tokens] int64");
  const int64_t* s = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK(s[t] >= 0 && s[t] < layer_kv.size(1), "slot out of the store");
  const auto* k = kvp::variant(variant).rows;
  auto q = at::empty({tokens, num_heads, dim}, qkv.options());
  if (qkv.scalar_type() == at::kFloat) {
    if (same) rope_write_kv_impl<float>(k, qkv, cos, sin_signed, layer_kv, slots, num_heads, q);
    else rope_write_kv_convert<float>(k, qkv, cos, sin_signed, layer_kv, slots, num_heads, dim, q);
  } else {
    if (same) rope_write_kv_impl<c10::BFloat16>(k, qkv, cos, sin_signed, layer_kv, slots, num_heads, q);
    else rope_write_kv_convert<c10::BFloat16>(k, qkv, cos, sin_signed, layer_kv, slots, num_heads, dim, q);
  }
  return q;
}

at::Tensor head_rms_norm(const at::Tensor& qkv, const at::Tensor& q_weight,
                         const at::Tensor& k_weight, int64_t num_heads, int64_t num_kv_heads,
                         double eps, const std::string& variant) {
  check_rows(qkv, "qkv");
  const int64_t dim = q_weight.numel();
  for (const auto* w : {&q_weight, &k_weight})
    TORCH_CHECK(w->dim() == 1 && w->size(0) == dim && w->is_contiguous() &&
                w->scalar_type() == qkv.scalar_type(), "q_weight, k_weight: [head_dim] of qkv's dtype");
  const int64_t width = qkv.size(1), heads = num_heads + num_kv_heads;
  TORCH_CHECK(dim > 0 && width == (heads + num_kv_heads) * dim,
              "qkv: [tokens, (num_heads + 2 * num_kv_heads) * head_dim]");
  const auto* k = kvp::variant(variant).rows;
  auto out = at::empty_like(qkv);
  const int64_t size = qkv.element_size();
  auto* in = static_cast<uint8_t*>(qkv.data_ptr());  // read only: add_rms_norm without y
  auto* op = static_cast<uint8_t*>(out.data_ptr());
  const bool bf16 = qkv.scalar_type() == at::kBFloat16;
  const float e = static_cast<float>(eps);
  kvp::parallel_for(0, qkv.size(0), 8, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      uint8_t* row = in + t * width * size;
      uint8_t* dst = op + t * width * size;
      k->add_rms_norm(bf16, row, nullptr, q_weight.data_ptr(), num_heads, dim, e, dst);
      k->add_rms_norm(bf16, row + num_heads * dim * size, nullptr, k_weight.data_ptr(),
                      num_kv_heads, dim, e, dst + num_heads * dim * size);
      std::memcpy(dst + heads * dim * size, row + heads * dim * size, num_kv_heads * dim * size);
    }
  });
  return out;
}

at::Tensor silu_mul(const at::Tensor& gate_up, const std::string& variant) {
  check_rows(gate_up, "gate_up");
  TORCH_CHECK(gate_up.size(1) % 2 == 0, "gate_up: [rows, 2 * n] (gate, then up)");
  const auto* k = kvp::variant(variant).rows;
  const int64_t n = gate_up.size(1) / 2, size = gate_up.element_size();
  auto out = at::empty({gate_up.size(0), n}, gate_up.options());
  const auto* in = static_cast<const uint8_t*>(gate_up.data_ptr());
  auto* op = static_cast<uint8_t*>(out.data_ptr());
  const bool bf16 = gate_up.scalar_type() == at::kBFloat16;
  // rows by the grain of 2^14 values each at least (a thread's start costs microseconds)
  const int64_t grain = std::max<int64_t>(1, (1 << 14) / std::max<int64_t>(1, n));
  kvp::parallel_for(0, gate_up.size(0), grain, [&](int64_t begin, int64_t end) {
    k->silu_mul(bf16, in + begin * 2 * n * size, end - begin, n, op + begin * n * size);
  });
  return out;
}
