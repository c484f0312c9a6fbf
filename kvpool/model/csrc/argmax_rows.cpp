// argmax_rows(x [B, V] float32): each row's argmax, as torch.argmax(x, -1) gives it: the
// first index of the largest value, or of the first NaN where a row has one (torch counts
// NaN above every number). Greedy decoding takes one per sequence per step, over the whole
// vocabulary (Llama 3's 128,256 logits): torch's reduction compares index and value
// together element by element (~2.4 ns an element here, 5 ms a batch-32 step); this finds
// the largest value first, in vector lanes of x86-64's baseline SSE2 (a plain loop
// elsewhere), then the first index that holds it.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "native_ops.h"
#include "parallel.h"

namespace {

// The largest value of x[0, n) ignoring NaNs, and whether there is a NaN.
#if defined(__SSE2__)
void scan(const float* x, int64_t n, float* top, bool* nan) {
  __m128 best[4], bad = _mm_setzero_ps();
  for (auto& b : best) b = _mm_set1_ps(-std::numeric_limits<float>::infinity());
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    for (int l = 0; l < 4; ++l) {
      const __m128 v = _mm_loadu_ps(x + i + 4 * l);
      best[l] = _mm_max_ps(best[l], v);  // (NaN in v: best[l] kept)
      bad = _mm_or_ps(bad, _mm_cmpunord_ps(v, v));
    }
  float lanes[16];
  for (int l = 0; l < 4; ++l) _mm_storeu_ps(lanes + 4 * l, best[l]);
  float m = lanes[0];
  for (float v : lanes) m = v > m ? v : m;
  bool any = _mm_movemask_ps(bad) != 0;
  for (; i < n; ++i) {
    m = x[i] > m ? x[i] : m;
    any |= x[i] != x[i];
  }
  *top = m;
  *nan = any;
}
#else
void scan(const float* x, int64_t n, float* top, bool* nan) {
  float m = -std::numeric_limits<float>::infinity();
  bool any = false;
  for (int64_t i = 0; i < n; ++i) {
    m = x[i] > m ? x[i] : m;
    any |= x[i] != x[i];
  }
  *top = m;
  *nan = any;
}
#endif

// The first index j in [0, n) where x[j] == value (NaN: where x[j] is NaN), or n.
#if defined(__SSE2__)
int64_t first_index(const float* x, int64_t n, float value, bool nan) {
  const __m128 want = _mm_set1_ps(value);
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) {
    int mask = 0;
    for (int l = 0; l < 4; ++l) {
      const __m128 v = _mm_loadu_ps(x + j + 4 * l);
      const __m128 hit = nan ? _mm_cmpunord_ps(v, v) : _mm_cmpeq_ps(v, want);
      mask |= _mm_movemask_ps(hit) << (4 * l);
    }
    if (mask != 0) return j + __builtin_ctz(static_cast<unsigned>(mask));
  }
  for (; j < n; ++j)
    if (nan ? std::isnan(x[j]) : x[j] == value) return j;
  return n;
}
#else
int64_t first_index(const float* x, int64_t n, float value, bool nan) {
  for (int64_t j = 0; j < n; ++j)
    if (nan ? std::isnan(x[j]) : x[j] == value) return j;
  return n;
}
#endif

int64_t argmax_row(const float* x, int64_t n) {
  float top;
  bool nan;
  scan(x, n, &top, &nan);
  return first_index(x, n, top, nan);  // (found: top is one of the row's values, n > 0)
}

}  // namespace

at::Tensor argmax_rows(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.device().is_cpu(),
              "x: a float32 [rows, n] CPU tensor");
  TORCH_CHECK(x.size(1) > 0, "x: rows of at least one value");
  const auto xc = x.contiguous();
  const int64_t rows = xc.size(0), n = xc.size(1);
  auto out = at::empty({rows}, xc.options().dtype(at::kLong));
  const float* xp = xc.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  kvp::parallel_for(0, rows, std::max<int64_t>(1, (1 << 16) / n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) op[r] = argmax_row(xp + r * n, n);
  });
  return out;
}
