// The AVX-512 intrinsics from SIMDe (https://github.com/simd-everywhere/simde), for the
// emulation build only (KVP_SIMDE: KVPOOL_EMULATE_AVX512=1 in kvpool.model.native): the
// AVX-512 variants compile under the AVX2 target, each 512-bit operation SIMDe's sequence
// of native AVX2 ones, and run on CPUs without AVX-512, several times slower, so their
// tests run there. Included by isa_variant.inc in place of <immintrin.h>, after the
// target pragma; never part of a production build.
//
// SIMDe lacks five names the kernels use: they are defined here from its intrinsics;
// its fused multiply-adds are replaced (below).
// _mm512_reduce_add_ps is not one instruction: GCC's header defines it as this sequence
// (halves, then quarters, then pairs), so these sums have the same bits as on AVX-512.
// SIMDe's _mm512_dpbf16_ps adds a pair's even product first; the instruction (Intel's
// pseudo-code) adds the odd one first, each step a fused add with bf16 denormals read as
// zero and denormal sums flushed to zero: replaced by that.

#pragma once

#include <stdint.h>
#include <string.h>

#define SIMDE_ENABLE_NATIVE_ALIASES
#include <simde/x86/avx512.h>
#include <simde/x86/f16c.h>

#ifndef _MM_FROUND_NO_EXC
#define _MM_FROUND_NO_EXC SIMDE_MM_FROUND_NO_EXC
#endif

static inline float _mm512_reduce_add_ps(__m512 a) {
  const __m256 t = _mm256_add_ps(_mm512_extractf32x8_ps(a, 1), _mm512_castps512_ps256(a));
  __m128 s = _mm_add_ps(_mm256_extractf128_ps(t, 1), _mm256_castps256_ps128(t));
  s = _mm_add_ps(s, _mm_shuffle_ps(s, s, _MM_SHUFFLE(1, 0, 3, 2)));
  s = _mm_add_ps(s, _mm_shuffle_ps(s, s, _MM_SHUFFLE(0, 1, 0, 1)));
  return _mm_cvtss_f32(s);
}

// 16 bytes widened to 16 int32 (sign- or zero-extended): each half by AVX2's form
static inline __m512i _mm512_cvtepi8_epi32(__m128i a) {
  return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_cvtepi8_epi32(a)),
                            _mm256_cvtepi8_epi32(_mm_srli_si128(a, 8)), 1);
}

static inline __m512i _mm512_cvtepu8_epi32(__m128i a) {
  return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_cvtepu8_epi32(a)),
                            _mm256_cvtepu8_epi32(_mm_srli_si128(a, 8)), 1);
}

static inline float _cvtsh_ss(unsigned short h) {
  return _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(h)));
}

static inline float kvp_emulated_daz_ftz(float v) {
  return __builtin_fabsf(v) < 1.17549435e-38f ? __builtin_copysignf(0.f, v) : v;
}

static inline __m512 kvp_emulated_dpbf16_ps(__m512 src, __m512bh a, __m512bh b) {
  float acc[16];
  uint16_t x[32], y[32];
  _mm512_storeu_ps(acc, src);
  _mm512_storeu_si512(x, (__m512i)a);
  _mm512_storeu_si512(y, (__m512i)b);
  for (int i = 0; i < 16; ++i) {
    for (int half = 1; half >= 0; --half) {
      uint32_t xb = (uint32_t)x[2 * i + half] << 16, yb = (uint32_t)y[2 * i + half] << 16;
      float xf, yf;
      memcpy(&xf, &xb, 4);
      memcpy(&yf, &yb, 4);
      acc[i] = kvp_emulated_daz_ftz(
          __builtin_fmaf(kvp_emulated_daz_ftz(xf), kvp_emulated_daz_ftz(yf), acc[i]));
    }
  }
  return _mm512_loadu_ps(acc);
}
#undef _mm512_dpbf16_ps
#define _mm512_dpbf16_ps(src, a, b) kvp_emulated_dpbf16_ps(src, a, b)

// Fused multiply-adds, rounded once as the instructions are. Under the target pragma
// SIMDe sees no native FMA and composes them of a multiply and an add: fused again only
// by the compiler's own contraction, which the native ops' build turns off
// (-ffp-contract=off, kvpool.model.native).
template <class V>
static inline V kvp_emulated_fma(V a, V b, V c, float sign) {
  constexpr int n = sizeof(V) / sizeof(float);
  float x[n], y[n], z[n];
  memcpy(x, &a, sizeof a);
  memcpy(y, &b, sizeof b);
  memcpy(z, &c, sizeof c);
  for (int i = 0; i < n; ++i) z[i] = __builtin_fmaf(sign * x[i], y[i], z[i]);
  memcpy(&c, z, sizeof c);
  return c;
}
#undef _mm256_fmadd_ps
#define _mm256_fmadd_ps(a, b, c) kvp_emulated_fma<__m256>(a, b, c, 1.f)
#undef _mm256_fnmadd_ps
#define _mm256_fnmadd_ps(a, b, c) kvp_emulated_fma<__m256>(a, b, c, -1.f)
#undef _mm512_fmadd_ps
#define _mm512_fmadd_ps(a, b, c) kvp_emulated_fma<__m512>(a, b, c, 1.f)
#undef _mm512_fnmadd_ps
#define _mm512_fnmadd_ps(a, b, c) kvp_emulated_fma<__m512>(a, b, c, -1.f)
