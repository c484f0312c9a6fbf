// The output head read straight from a Q8_0 matrix (GGUF's blocks of 32 int8 values and
// one fp16 scale): for steps of a few rows, where the product is a matrix-vector one
// whose time is reading the weights. SmolLM2's tied 49,152 x 576 embedding is 30 MB in
// Q8_0 against 57 MB as the bf16 copy the prepacked product reads; and the logits come
// out in float32 from the file's exact weights (the bf16 copy rounds each d * q, and
// the bf16 product rounds its outputs, which makes ties of nearby logits).
//
// x:    [B, K] float32 or bfloat16, K a multiple of 32
// raw:  [N, K / 32 * 34] uint8, each row its Q8_0 blocks (fp16 d, then 32 int8 q)
// out:  [B, N] float32, out[b, n] = sum_k x[b, k] * d * q of row n

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#include <cstring>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kBlock = 32;
constexpr int64_t kBlockBytes = 34;
constexpr int64_t kMaxRows = 8;

inline float half_to_float(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, sizeof(bits));
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}

void matvec(const float* x, int64_t rows, int64_t k, const uint8_t* raw, int64_t n, float* out) {
  const int64_t blocks = k / kBlock, row_bytes = blocks * kBlockBytes;
  at::parallel_for(0, n, 512, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const uint8_t* row = raw + r * row_bytes;
#if defined(__AVX512F__)
      __m512 acc[kMaxRows];
      for (int64_t b = 0; b < rows; ++b) acc[b] = _mm512_setzero_ps();
      for (int64_t blk = 0; blk < blocks; ++blk) {
        const uint8_t* block = row + blk * kBlockBytes;
        const __m512 d = _mm512_set1_ps(half_to_float(block));
        const __m128i* q = reinterpret_cast<const __m128i*>(block + 2);
        const __m512 w0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(q)));
        const __m512 w1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(q + 1)));
        for (int64_t b = 0; b < rows; ++b) {
          const float* xb = x + b * k + blk * kBlock;
          const __m512 s = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xb + 16), _mm512_mul_ps(w0, _mm512_loadu_ps(xb)));
          acc[b] = _mm512_fmadd_ps(d, s, acc[b]);
        }
      }
      for (int64_t b = 0; b < rows; ++b) out[b * n + r] = _mm512_reduce_add_ps(acc[b]);
#else
      for (int64_t b = 0; b < rows; ++b) {
        float total = 0.f;
        for (int64_t blk = 0; blk < blocks; ++blk) {
          const uint8_t* block = row + blk * kBlockBytes;
          const int8_t* q = reinterpret_cast<const int8_t*>(block + 2);
          const float* xb = x + b * k + blk * kBlock;
          float s = 0.f;
          for (int64_t i = 0; i < kBlock; ++i) s += static_cast<float>(q[i]) * xb[i];
          total += half_to_float(block) * s;
        }
        out[b * n + r] = total;
      }
#endif
    }
  });
}

}  // namespace

at::Tensor q8_0_matvec(const at::Tensor& x, const at::Tensor& raw) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) % kBlock == 0, "x: [rows, K], K a multiple of 32");
  TORCH_CHECK(x.size(0) >= 1 && x.size(0) <= kMaxRows, "x: 1 to 8 rows");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "x: float32 or bfloat16");
  TORCH_CHECK(raw.dim() == 2 && raw.scalar_type() == at::kByte && raw.is_contiguous() &&
              raw.size(1) == x.size(1) / kBlock * kBlockBytes,
              "raw: contiguous uint8 [N, K / 32 * 34] (Q8_0 rows)");
  const auto xf = x.to(at::kFloat).contiguous();
  auto out = at::empty({x.size(0), raw.size(0)}, x.options().dtype(at::kFloat));
  matvec(xf.data_ptr<float>(), x.size(0), x.size(1), raw.data_ptr<uint8_t>(), raw.size(0),
         out.data_ptr<float>());
  return out;
}
