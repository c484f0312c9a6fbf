// The small ops around a layer's matrix products, fused: torch runs each of them as
// several kernels with a fixed cost of a few microseconds, which at one decoded token is
// most of their time (the measurements: docs/performance.md, "Measurements behind design
// choices").
//
// Each computes what the torch path computes, rounded to the tensor's dtype at the same
// points, so bf16 results are bit-identical to it (the RMSNorm's sum of squares may add
// in another order: within one rounding); float32 ones may differ in the last bit where
// the compiler fuses a multiply and an add.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include <cmath>

namespace {

inline float f32(float x) { return x; }
inline float f32(c10::BFloat16 x) { return static_cast<float>(x); }

// x += y (rounded to T, as torch's add); h = x * rsqrt(mean(x^2) + eps) * w, computed in
// float32 and rounded once (as torch's rms_norm). Without y, only the norm.
template <typename T>
void add_rms_norm_impl(at::Tensor& x, const T* y, const at::Tensor& w, double eps, at::Tensor& h) {
  const int64_t rows = x.size(0), n = x.size(1);
  T* xp = x.data_ptr<T>();
  const T* wp = w.data_ptr<T>();
  T* hp = h.data_ptr<T>();
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      T* xr = xp + r * n;
      if (y != nullptr) {
        const T* yr = y + r * n;
        for (int64_t i = 0; i < n; ++i) xr[i] = static_cast<T>(f32(xr[i]) + f32(yr[i]));
      }
      float part[16] = {0.f};  // partial sums apart: vectorized, and a shorter chain
      int64_t i = 0;
      for (; i + 16 <= n; i += 16)
        for (int l = 0; l < 16; ++l) part[l] += f32(xr[i + l]) * f32(xr[i + l]);
      for (; i < n; ++i) part[i % 16] += f32(xr[i]) * f32(xr[i]);
      float squares = 0.f;
      for (int l = 0; l < 16; ++l) squares += part[l];
      const float rstd = 1.f / std::sqrt(squares / n + static_cast<float>(eps));
      T* hr = hp + r * n;
      for (int64_t i = 0; i < n; ++i) hr[i] = static_cast<T>(f32(xr[i]) * rstd * f32(wp[i]));
    }
  });
}

// Element i of a head row x rotated: x * cos + rotate_half(x) * sin_signed, each product
// and the sum rounded to T (as the torch path rounds).
template <typename T>
inline T rotated(const T* x, const T* c, const T* s, int64_t i, int64_t half) {
  const T a = static_cast<T>(f32(x[i]) * f32(c[i]));
  const T b = static_cast<T>(f32(x[i < half ? i + half : i - half]) * f32(s[i]));
  return static_cast<T>(f32(a) + f32(b));
}

// Rotary embedding of Q and K in the half-split layout (x * cos + rotate_half(x) * sin,
// with the sign in sin_signed; each product and the sum rounded to T), K and V written to
// the store at each token's slot; Q returned as [T, num_heads, head_dim].
template <typename T>
void rope_write_kv_impl(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin_signed,
                        at::Tensor& layer_kv, const at::Tensor& slots, int64_t num_heads,
                        at::Tensor& q) {
  const int64_t tokens = qkv.size(0), width = qkv.size(1);
  const int64_t kv_heads = layer_kv.size(0) / 2, store_slots = layer_kv.size(1);
  const int64_t dim = layer_kv.size(2), half = dim / 2;
  const T* src = qkv.data_ptr<T>();
  const T* c = cos.data_ptr<T>();
  const T* s = sin_signed.data_ptr<T>();
  const int64_t* slot = slots.data_ptr<int64_t>();
  T* store = layer_kv.data_ptr<T>();
  T* q_out = q.data_ptr<T>();
  at::parallel_for(0, tokens, 8, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* row = src + t * width;
      const T* ct = c + t * dim;
      const T* st = s + t * dim;
      for (int64_t h = 0; h < num_heads + kv_heads; ++h) {
        const T* x = row + h * dim;
        T* dst = h < num_heads ? q_out + (t * num_heads + h) * dim
                               : store + ((h - num_heads) * store_slots + slot[t]) * dim;
        for (int64_t i = 0; i < dim; ++i) dst[i] = rotated(x, ct, st, i, half);
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
void rope_write_kv_convert(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin_signed,
                           at::Tensor& layer_kv, const at::Tensor& slots, int64_t num_heads,
                           int64_t dim, at::Tensor& q) {
  const int64_t tokens = qkv.size(0), width = qkv.size(1), half = dim / 2;
  const int64_t kv_heads = layer_kv.size(0) / 2, store_slots = layer_kv.size(1);
  const int64_t row_bytes = layer_kv.size(2) * layer_kv.element_size();
  const auto type = layer_kv.scalar_type();
  const T* src = qkv.data_ptr<T>();
  const T* c = cos.data_ptr<T>();
  const T* s = sin_signed.data_ptr<T>();
  const int64_t* slot = slots.data_ptr<int64_t>();
  auto* store = static_cast<uint8_t*>(layer_kv.data_ptr());
  T* q_out = q.data_ptr<T>();
  at::parallel_for(0, tokens, 8, [&](int64_t begin, int64_t end) {
    std::vector<float> row(dim);
    for (int64_t t = begin; t < end; ++t) {
      const T* in = src + t * width;
      const T* ct = c + t * dim;
      const T* st = s + t * dim;
      for (int64_t h = 0; h < num_heads + kv_heads; ++h) {
        const T* x = in + h * dim;
        T* qd = h < num_heads ? q_out + (t * num_heads + h) * dim : nullptr;
        for (int64_t i = 0; i < dim; ++i) {
          const T v = rotated(x, ct, st, i, half);
          if (qd != nullptr) qd[i] = v; else row[i] = f32(v);
        }
        if (qd == nullptr)
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
                         double eps) {
  check_rows(x, "x");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1) && weight.is_contiguous() &&
              weight.scalar_type() == x.scalar_type(), "weight: [features] of x's dtype");
  if (y.has_value()) {
    check_rows(*y, "y");
    TORCH_CHECK(y->sizes() == x.sizes() && y->scalar_type() == x.scalar_type(), "y: x's shape and dtype");
  }
  auto h = at::empty_like(x);
  if (x.scalar_type() == at::kFloat) {
    add_rms_norm_impl<float>(x, y ? y->data_ptr<float>() : nullptr, weight, eps, h);
  } else {
    add_rms_norm_impl<c10::BFloat16>(x, y ? y->data_ptr<c10::BFloat16>() : nullptr, weight, eps, h);
  }
  return h;
}

at::Tensor rope_write_kv(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin_signed,
                         at::Tensor& layer_kv, const at::Tensor& slots, int64_t num_heads) {
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
  auto q = at::empty({tokens, num_heads, dim}, qkv.options());
  if (qkv.scalar_type() == at::kFloat) {
    if (same) rope_write_kv_impl<float>(qkv, cos, sin_signed, layer_kv, slots, num_heads, q);
    else rope_write_kv_convert<float>(qkv, cos, sin_signed, layer_kv, slots, num_heads, dim, q);
  } else {
    if (same) rope_write_kv_impl<c10::BFloat16>(qkv, cos, sin_signed, layer_kv, slots, num_heads, q);
    else rope_write_kv_convert<c10::BFloat16>(qkv, cos, sin_signed, layer_kv, slots, num_heads, dim, q);
  }
  return q;
}
