// GGUF's quantized blocks (ggml's layouts) and their scalar dequantization: the
// reference every vectorized kernel is tested against (tests compare these with the gguf
// package's numpy dequantizers, bit for bit).
//
// Only C headers and static inline functions: this header is included by translation
// units compiled for different instruction sets (quant_isa_*.cpp), and static functions
// cannot be merged across them by the linker.

#pragma once

#include <stdint.h>
#include <string.h>

namespace kvp {

// Functions the variants' kernels call are always inlined: a copy the compiler keeps out
// of line is compiled for the baseline (SSE: this header comes before a variant's
// target), and each call from a variant's AVX code switched between the two: AVX2's
// file-layout Q8_0 dequantization spent 87% of its time on the instruction after its
// fp16_to_f32 call (64 rows of 2,048: 434 us, 12 us inlined; docs/performance.md).
#if defined(__GNUC__) || defined(__clang__)
#define KVP_ALWAYS_INLINE inline __attribute__((always_inline))
#else
#define KVP_ALWAYS_INLINE inline
#endif

// ggml type ids
enum QType : int {
  kF32 = 0, kF16 = 1, kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ5_1 = 7, kQ8_0 = 8,
  kQ2_K = 10, kQ3_K = 11, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14, kIQ4_NL = 20, kIQ4_XS = 23,
  kBF16 = 30,
  // the grid formats (integer products from their grids' bytes, IQGrids)
  kIQ2_XXS = 16, kIQ2_XS = 17, kIQ3_XXS = 18, kIQ1_S = 19, kIQ3_S = 21, kIQ2_S = 22, kIQ1_M = 29,
  // the ternary formats (values -1, 0, 1 times one scale a block of 256)
  kTQ1_0 = 34, kTQ2_0 = 35,
};

// The grid formats' tables (ggml's iq2xxs_grid, iq2xs_grid, iq2s_grid, iq3xxs_grid,
// iq3s_grid), each row's values as floats (exact: IQ2's 8, 25, 43, IQ3's odd values to
// 62), 8 a row (IQ3: 4), so a block's rows are vector loads (IQ1's iq1s_grid only as
// bytes, below: 64 KiB as floats);
// ksigns: ggml's ksigns_iq2xs (7 sign bits and an eighth that makes their count even);
// signs: for each byte, its 8 bits as +1.f / -1.f (bit j set: value j negated).
// The *_b tables hold the same rows as bytes for the integer products (a row's 8 bytes,
// IQ3's 4, one load): IQ2's and IQ3's values as they are, IQ1's times 8 (-8, 0, 8: with
// its delta of +-1/8, 8 times an IQ1 value is an integer); sign_b: for each byte, its 8
// bits as int8 +1 / -1 (0xFF); ksign_b: sign_b's row of ksigns[i] for each 7 bits i (one
// load where a format stores 7 sign bits).
// Made once by set_iq_grids (quant_ops.cpp) from the gguf package's tables; null until
// then, and check_parts refuses these formats.
struct IQGrids {
  const float* iq2xxs = nullptr;  // [256][8]
  const float* iq2xs = nullptr;   // [512][8]
  const float* iq2s = nullptr;    // [1024][8]
  const float* iq3xxs = nullptr;  // [256][4]
  const float* iq3s = nullptr;    // [512][4]
  const uint8_t* ksigns = nullptr;  // [128]
  const float* signs = nullptr;     // [256][8]
  const uint8_t* iq2xxs_b = nullptr;  // [256][8]
  const uint8_t* iq2xs_b = nullptr;   // [512][8]
  const uint8_t* iq2s_b = nullptr;    // [1024][8]
  const uint8_t* iq3xxs_b = nullptr;  // [256][4]
  const uint8_t* iq3s_b = nullptr;    // [512][4]
  const int8_t* iq1s_b = nullptr;     // [2048][8], times 8
  const int8_t* sign_b = nullptr;     // [256][8]
  const int8_t* ksign_b = nullptr;    // [128][8]
};
// The one set of tables (quant_ops.cpp), read directly: the kernels ask for it per block.
extern IQGrids g_iq_grids;
static KVP_ALWAYS_INLINE const IQGrids& iq_grids() { return g_iq_grids; }

static KVP_ALWAYS_INLINE constexpr bool grid_type(int t) {
  return t == kIQ2_XXS || t == kIQ2_XS || t == kIQ2_S || t == kIQ3_XXS || t == kIQ3_S ||
         t == kIQ1_S || t == kIQ1_M;
}

static KVP_ALWAYS_INLINE constexpr bool ternary_type(int t) { return t == kTQ1_0 || t == kTQ2_0; }
// The formats whose products of many rows may take a kernel for 8 or 16 weight rows at
// once in the file's layout (x86's grid_group_dot): the grid formats and the ternary ones.
static KVP_ALWAYS_INLINE constexpr bool grouped_type(int t) {
  return grid_type(t) || ternary_type(t);
}

// IQ4_NL's and IQ4_XS's 16 levels (a nibble picks one; ggml's kvalues_iq4nl): int8
// values, so integer products take them as Q8_0's.
static const int8_t kIQ4Levels[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                      1,    13,   25,  38,  53,  69,  89,  113};

// Unit j's scale in an IQ4_XS block (d, scales_h, scales_l[4], qs[128]), -32 .. 31: its
// low 4 bits from scales_l, its high 2 from scales_h.
static KVP_ALWAYS_INLINE int iq4_xs_scale(const uint8_t* b, int j) {
  const int high = (b[2 | (j >> 2)] >> (2 * (j & 3))) & 3;  // scales_h, little-endian
  return (((b[4 + j / 2] >> (4 * (j % 2))) & 0xF) | (high << 4)) - 32;
}

// Elements and bytes of one block.
static KVP_ALWAYS_INLINE int block_elems(int t) {
  return (t == kQ2_K || t == kQ3_K || t == kQ4_K || t == kQ5_K || t == kQ6_K || t == kIQ4_XS ||
          grouped_type(t))
             ? 256
         : (t == kF32 || t == kF16 || t == kBF16) ? 1 : 32;
}
static KVP_ALWAYS_INLINE int block_bytes(int t) {
  switch (t) {
    case kF32: return 4;
    case kF16: case kBF16: return 2;
    case kQ4_0: return 18;
    case kQ4_1: return 20;
    case kQ5_0: return 22;
    case kQ5_1: return 24;
    case kQ8_0: return 34;
    case kQ2_K: return 84;
    case kQ3_K: return 110;
    case kQ4_K: return 144;
    case kQ5_K: return 176;
    case kQ6_K: return 210;
    case kIQ4_NL: return 18;
    case kIQ4_XS: return 136;
    case kIQ2_XXS: return 66;
    case kIQ2_XS: return 74;
    case kIQ2_S: return 82;
    case kIQ3_XXS: return 98;
    case kIQ3_S: return 110;
    case kIQ1_S: return 50;
    case kIQ1_M: return 56;
    case kTQ1_0: return 54;
    case kTQ2_0: return 66;
    default: return 0;
  }
}
static KVP_ALWAYS_INLINE bool known_type(int t) { return block_bytes(t) > 0; }

// Exact, every value: a subnormal's mant * 2^-24 is a normal float32 (no rounding).
static KVP_ALWAYS_INLINE float fp16_to_f32(uint16_t h) {
  const uint32_t sign = (uint32_t)(h & 0x8000) << 16;
  const uint32_t exp = (h >> 10) & 0x1f, mant = h & 0x3ff;
  if (exp == 0) {
    const float f = (float)mant * 5.9604644775390625e-8f;  // 2^-24
    return sign ? -f : f;
  }
  const uint32_t bits = sign | (mant << 13) | (exp == 31 ? 0x7f800000u : (exp + 127 - 15) << 23);
  float f;
  memcpy(&f, &bits, 4);
  return f;
}
static KVP_ALWAYS_INLINE float read_fp16(const uint8_t* p) {
  uint16_t h;
  memcpy(&h, p, 2);
  return fp16_to_f32(h);
}
// An IQ1_M block's scale d: an fp16 whose 16 bits are the top nibbles of its four
// uint16 scale words (scales[8] at byte 48; their low 12 bits: four 3-bit sub-scales).
static KVP_ALWAYS_INLINE float iq1_m_scale(const uint8_t* b) {
  uint16_t sc[4];
  memcpy(sc, b + 48, 8);
  return fp16_to_f32((uint16_t)((sc[0] >> 12) | ((sc[1] >> 8) & 0x00F0) |
                                ((sc[2] >> 4) & 0x0F00) | (sc[3] & 0xF000)));
}
static KVP_ALWAYS_INLINE float bf16_to_f32(uint16_t h) {
  const uint32_t bits = (uint32_t)h << 16;
  float f;
  memcpy(&f, &bits, 4);
  return f;
}

// float32 to bf16 bits as c10::BFloat16 rounds: to nearest even, a NaN to 0x7FC0.
static KVP_ALWAYS_INLINE uint16_t f32_to_bf16(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  return f != f ? 0x7FC0 : (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

// The ternary formats' stored values q (0, 1, 2; the value is q - 1, times the block's d).
// TQ2_0 (qs[64], d): value 32 c + m of unit 4 c + l (l < 4) is bits 2 l of qs[32 c + m],
// 0 .. 3 (a 3 is read as 2, as ggml reads it). TQ1_0 (qs[48], qh[4], d): five values a
// byte of qs, four a byte of qh, as base-3 digits of a fraction: digit n of byte b is
// ((uint8_t)(b * 3^n) * 3) >> 8. Values 0..159: digit n = p / 32 of qs[p % 32]; 160..239:
// digit n of qs[32 + p % 16] (n = (p - 160) / 16); 240..255: digit (p - 240) / 4 of
// qh[p % 4].
static KVP_ALWAYS_INLINE int trit(uint8_t b, int n) {
  static const uint8_t pow3[5] = {1, 3, 9, 27, 81};
  return ((int)(uint8_t)(b * pow3[n]) * 3) >> 8;
}
static KVP_ALWAYS_INLINE int tq1_value(const uint8_t* b, int p) {
  if (p < 160) return trit(b[p % 32], p / 32);
  if (p < 240) return trit(b[32 + p % 16], (p - 160) / 16);
  return trit(b[48 + p % 4], (p - 240) / 4);
}
static KVP_ALWAYS_INLINE int tq2_value(const uint8_t* b, int p) {
  return (b[32 * (p / 128) + p % 32] >> (2 * ((p / 32) % 4))) & 3;
}

// The 6-bit scale and min of sub-block j (0..7) of a Q4_K / Q5_K block.
static KVP_ALWAYS_INLINE void scale_min_k4(int j, const uint8_t* q, uint8_t* sc, uint8_t* m) {
  if (j < 4) {
    *sc = q[j] & 63;
    *m = q[j + 4] & 63;
  } else {
    *sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
    *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

// The 16 signed 6-bit scales of a Q3_K block.
static KVP_ALWAYS_INLINE void q3_k_scales(const uint8_t* s, int8_t* out) {
  for (int i = 0; i < 16; ++i) {
    const int low = (i < 8 ? s[i] : s[i - 8] >> 4) & 0xF;
    const int high = (s[8 + (i % 4)] >> (2 * (i / 4))) & 3;
    out[i] = (int8_t)((low | (high << 4)) - 32);
  }
}

// 8 values: scale times a grid row's, times the signs' (the gguf package's order of
// products: each value's bits are its).
static KVP_ALWAYS_INLINE void signed_grid8(const float* __restrict row, float scale,
                                           const float* __restrict sign, float* __restrict y) {
  for (int j = 0; j < 8; ++j) y[j] = scale * row[j] * sign[j];
}

// As signed_grid8 for two IQ3 rows of 4.
static KVP_ALWAYS_INLINE void signed_grid4x2(const float* __restrict r0,
                                             const float* __restrict r1, float scale,
                                             const float* __restrict sign, float* __restrict y) {
  for (int j = 0; j < 4; ++j) y[j] = scale * r0[j] * sign[j];
  for (int j = 0; j < 4; ++j) y[4 + j] = scale * r1[j] * sign[4 + j];
}

// 8 IQ1 values: dl * (grid value + delta), from the byte rows (8 x value; delta8 = 8 x
// delta, +-1): dl / 8 times the integer, the same exact product (dl / 8 is exact), so the
// same rounding. IQ1's float rows (2,048 x 32 bytes) overflowed a core's L1: 2.5-3x the
// time of these (docs/performance.md).
static KVP_ALWAYS_INLINE void shifted_grid8(const int8_t* __restrict row8, float dl, int delta8,
                                            float* __restrict y) {
  const float d8 = dl * 0.125f;
  for (int j = 0; j < 8; ++j) y[j] = d8 * (float)(row8[j] + delta8);
}

// A grid format's block (ggml's dequantize_row_iq*), through iq_grids' tables.
static KVP_ALWAYS_INLINE void dequantize_grid_block(int t, const uint8_t* b, float* y) {
  const IQGrids& g = iq_grids();
  switch (t) {
    case kIQ2_XXS: {  // d, 8 x (4 grid bytes, 4 x 7 sign bits | a 4-bit scale << 28)
      const float d = read_fp16(b);
      for (int ib = 0; ib < 8; ++ib, y += 32) {
        uint32_t aux[2];
        memcpy(aux, b + 2 + 8 * ib, 8);
        const float db = d * (0.5f + (float)(aux[1] >> 28)) * 0.25f;
        for (int l = 0; l < 4; ++l)
          signed_grid8(g.iq2xxs + 8 * ((aux[0] >> (8 * l)) & 255), db,
                       g.signs + 8 * g.ksigns[(aux[1] >> (7 * l)) & 127], y + 8 * l);
      }
      return;
    }
    case kIQ2_XS: {  // d, qs[32] (9-bit grid row | 7 sign bits << 9), scales[8] (4 bits a 16)
      const float d = read_fp16(b);
      for (int i = 0; i < 32; ++i, y += 8) {
        uint16_t q;
        memcpy(&q, b + 2 + 2 * i, 2);
        const int s = (b[66 + i / 4] >> (4 * ((i / 2) & 1))) & 15;
        const float db = d * (0.5f + (float)s) * 0.25f;
        signed_grid8(g.iq2xs + 8 * (q & 511), db, g.signs + 8 * g.ksigns[q >> 9], y);
      }
      return;
    }
    case kIQ2_S: {  // d, qs[32], signs[32], qh[8] (2 high bits a row), scales[8]
      const float d = read_fp16(b);
      for (int i = 0; i < 32; ++i, y += 8) {
        const int row = b[2 + i] | ((b[66 + i / 4] >> (2 * (i % 4))) & 3) << 8;
        const int s = (b[74 + i / 4] >> (4 * ((i / 2) & 1))) & 15;
        const float db = d * (0.5f + (float)s) * 0.25f;
        signed_grid8(g.iq2s + 8 * row, db, g.signs + 8 * b[34 + i], y);
      }
      return;
    }
    case kIQ3_XXS: {  // d, qs[64] (a grid row of 4 each), 8 x (4 x 7 sign bits | scale << 28)
      const float d = read_fp16(b);
      for (int ib = 0; ib < 8; ++ib) {
        uint32_t aux;
        memcpy(&aux, b + 66 + 4 * ib, 4);
        const float db = d * (0.5f + (float)(aux >> 28)) * 0.5f;
        for (int l = 0; l < 4; ++l, y += 8) {
          const uint8_t* q = b + 2 + 8 * ib + 2 * l;
          signed_grid4x2(g.iq3xxs + 4 * q[0], g.iq3xxs + 4 * q[1], db,
                         g.signs + 8 * g.ksigns[(aux >> (7 * l)) & 127], y);
        }
      }
      return;
    }
    case kIQ3_S: {  // d, qs[64], qh[8] (a high bit a row), signs[32], scales[4] (4 bits a 32)
      const float d = read_fp16(b);
      for (int i = 0; i < 32; ++i, y += 8) {  // values 8 i .. 8 i + 7: grid rows 2 i, 2 i + 1
        const int high = b[66 + i / 4] >> (2 * (i % 4));
        const int r0 = b[2 + 2 * i] | (high & 1) << 8, r1 = b[3 + 2 * i] | (high >> 1 & 1) << 8;
        const int s = (b[106 + i / 8] >> (4 * ((i / 4) & 1))) & 15;
        const float db = d * (float)(1 + 2 * s);
        signed_grid4x2(g.iq3s + 4 * r0, g.iq3s + 4 * r1, db, g.signs + 8 * b[74 + i], y);
      }
      return;
    }
    case kIQ1_S: {  // d, qs[32], qh[8] as uint16 (3 high bits a row, a scale, delta's sign)
      const float d = read_fp16(b);
      for (int ib = 0; ib < 8; ++ib) {
        uint16_t qh;
        memcpy(&qh, b + 34 + 2 * ib, 2);
        const float dl = d * (float)(2 * ((qh >> 12) & 7) + 1);
        const int delta = qh & 0x8000 ? -1 : 1;
        for (int l = 0; l < 4; ++l, y += 8)
          shifted_grid8(g.iq1s_b + 8 * (b[2 + 4 * ib + l] | ((qh >> (3 * l)) & 7) << 8), dl,
                        delta, y);
      }
      return;
    }
    case kIQ1_M: {  // qs[32], qh[16] (a nibble a row: 3 high bits, delta's sign), scales[8]
      uint16_t sc[4];
      memcpy(sc, b + 48, 8);
      const float d = iq1_m_scale(b);
      for (int i = 0; i < 32; ++i, y += 8) {
        const int s = (sc[i / 8] >> (3 * ((i / 2) % 4))) & 7;
        const float dl = d * (float)(2 * s + 1);
        const int h = (b[32 + i / 2] >> (4 * (i % 2))) & 15;
        shifted_grid8(g.iq1s_b + 8 * (b[i] | (h & 7) << 8), dl, h & 8 ? -1 : 1, y);
      }
      return;
    }
    default: return;
  }
}

// y[0 .. block_elems) = the values of one block. (__restrict: the loops vectorize without
// a run-time check that y and b overlap, which short blocks paid per block: Q4_0's 2.2-4.6x
// faster on the AVX-512 and generic variants, 1.35x slower on AVX2's: docs/performance.md)
static KVP_ALWAYS_INLINE void dequantize_block(int t, const uint8_t* __restrict b,
                                               float* __restrict y) {
  switch (t) {
    case kF32: memcpy(y, b, 4); return;
    case kF16: y[0] = read_fp16(b); return;
    case kBF16: { uint16_t h; memcpy(&h, b, 2); y[0] = bf16_to_f32(h); return; }
    case kQ4_0: {
      const float d = read_fp16(b);
      for (int i = 0; i < 16; ++i) {
        y[i] = ((b[2 + i] & 0xF) - 8) * d;
        y[i + 16] = ((b[2 + i] >> 4) - 8) * d;
      }
      return;
    }
    case kQ4_1: {
      const float d = read_fp16(b), m = read_fp16(b + 2);
      for (int i = 0; i < 16; ++i) {
        y[i] = (b[4 + i] & 0xF) * d + m;
        y[i + 16] = (b[4 + i] >> 4) * d + m;
      }
      return;
    }
    case kQ5_0: {
      const float d = read_fp16(b);
      uint32_t qh;
      memcpy(&qh, b + 2, 4);
      for (int i = 0; i < 16; ++i) {
        const int h0 = ((qh >> i) & 1) << 4, h1 = ((qh >> (i + 16)) & 1) << 4;
        y[i] = (((b[6 + i] & 0xF) | h0) - 16) * d;
        y[i + 16] = (((b[6 + i] >> 4) | h1) - 16) * d;
      }
      return;
    }
    case kQ5_1: {
      const float d = read_fp16(b), m = read_fp16(b + 2);
      uint32_t qh;
      memcpy(&qh, b + 4, 4);
      for (int i = 0; i < 16; ++i) {
        const int h0 = ((qh >> i) & 1) << 4, h1 = ((qh >> (i + 16)) & 1) << 4;
        y[i] = ((b[8 + i] & 0xF) | h0) * d + m;
        y[i + 16] = ((b[8 + i] >> 4) | h1) * d + m;
      }
      return;
    }
    case kQ8_0: {
      const float d = read_fp16(b);
      for (int i = 0; i < 32; ++i) y[i] = (int8_t)b[2 + i] * d;
      return;
    }
    case kQ2_K: {  // scales[16], qs[64], d, dmin
      const uint8_t* sc = b;
      const uint8_t* q = b + 16;
      const float d = read_fp16(b + 80), dmin = read_fp16(b + 82);
      int is = 0;
      for (int n = 0; n < 256; n += 128, q += 32) {
        for (int shift = 0; shift < 8; shift += 2) {
          for (int half = 0; half < 2; ++half, ++is) {
            const float dl = d * (sc[is] & 0xF), ml = dmin * (sc[is] >> 4);
            for (int l = 0; l < 16; ++l) *y++ = dl * ((q[half * 16 + l] >> shift) & 3) - ml;
          }
        }
      }
      return;
    }
    case kQ3_K: {  // hmask[32], qs[64], scales[12], d
      const uint8_t* hm = b;
      const uint8_t* q = b + 32;
      int8_t sc[16];
      q3_k_scales(b + 96, sc);
      const float d = read_fp16(b + 108);
      int is = 0;
      uint8_t m = 1;
      for (int n = 0; n < 256; n += 128, q += 32) {
        for (int shift = 0; shift < 8; shift += 2, m <<= 1) {
          for (int half = 0; half < 2; ++half, ++is) {
            const float dl = d * sc[is];
            for (int l = 0; l < 16; ++l) {
              const int k = half * 16 + l;
              *y++ = dl * ((int)((q[k] >> shift) & 3) - ((hm[k] & m) ? 0 : 4));
            }
          }
        }
      }
      return;
    }
    case kQ4_K: {  // d, dmin, scales[12], qs[128]
      const float d = read_fp16(b), dmin = read_fp16(b + 2);
      const uint8_t* scales = b + 4;
      const uint8_t* q = b + 16;
      for (int j = 0; j < 4; ++j, q += 32) {
        uint8_t s0, m0, s1, m1;
        scale_min_k4(2 * j, scales, &s0, &m0);
        scale_min_k4(2 * j + 1, scales, &s1, &m1);
        for (int l = 0; l < 32; ++l) *y++ = d * s0 * (q[l] & 0xF) - dmin * m0;
        for (int l = 0; l < 32; ++l) *y++ = d * s1 * (q[l] >> 4) - dmin * m1;
      }
      return;
    }
    case kQ5_K: {  // d, dmin, scales[12], qh[32], qs[128]
      const float d = read_fp16(b), dmin = read_fp16(b + 2);
      const uint8_t* scales = b + 4;
      const uint8_t* qh = b + 16;
      const uint8_t* q = b + 48;
      for (int j = 0; j < 4; ++j, q += 32) {
        uint8_t s0, m0, s1, m1;
        scale_min_k4(2 * j, scales, &s0, &m0);
        scale_min_k4(2 * j + 1, scales, &s1, &m1);
        const uint8_t u1 = 1 << (2 * j), u2 = 2 << (2 * j);
        for (int l = 0; l < 32; ++l) *y++ = d * s0 * ((q[l] & 0xF) + (qh[l] & u1 ? 16 : 0)) - dmin * m0;
        for (int l = 0; l < 32; ++l) *y++ = d * s1 * ((q[l] >> 4) + (qh[l] & u2 ? 16 : 0)) - dmin * m1;
      }
      return;
    }
    case kQ6_K: {  // ql[128], qh[64], scales[16], d
      const uint8_t* ql = b;
      const uint8_t* qh = b + 128;
      const int8_t* sc = (const int8_t*)(b + 192);
      const float d = read_fp16(b + 208);
      // quarter i of each 128 values: the low nibbles (i < 2) or high ones of ql's first
      // (i even) or second 32 bytes, the top bits in bits 2 i, 2 i + 1 of qh's; a scale
      // per 16 values (one loop per quarter and half: the compiler's vectors, 2.2x faster)
      for (int n = 0; n < 256; n += 128, ql += 64, qh += 32, sc += 8, y += 128) {
        for (int i = 0; i < 4; ++i) {
          const uint8_t* low = ql + 32 * (i & 1);
          const int shift = 4 * (i >> 1);
          for (int half = 0; half < 2; ++half) {
            const float scale = d * sc[half + 2 * i];
            for (int l = 16 * half; l < 16 * half + 16; ++l) {
              const int q = ((low[l] >> shift) & 0xF) | (((qh[l] >> (2 * i)) & 3) << 4);
              y[32 * i + l] = scale * (q - 32);
            }
          }
        }
      }
      return;
    }
    case kIQ4_NL: {  // d, qs[16]: value i the level of qs[i]'s low nibble, i + 16 its high
      const float d = read_fp16(b);
      for (int i = 0; i < 16; ++i) {
        y[i] = d * (float)kIQ4Levels[b[2 + i] & 0xF];
        y[i + 16] = d * (float)kIQ4Levels[b[2 + i] >> 4];
      }
      return;
    }
    case kIQ4_XS: {  // d, scales_h, scales_l[4], qs[128]
      const float d = read_fp16(b);
      for (int j = 0; j < 8; ++j, y += 32) {
        const float dl = d * (float)iq4_xs_scale(b, j);
        const uint8_t* q = b + 8 + 16 * j;
        for (int i = 0; i < 16; ++i) {
          y[i] = dl * (float)kIQ4Levels[q[i] & 0xF];
          y[i + 16] = dl * (float)kIQ4Levels[q[i] >> 4];
        }
      }
      return;
    }
    case kTQ1_0: {  // qs[48], qh[4], d
      const float d = read_fp16(b + 52);
      for (int p = 0; p < 256; ++p) y[p] = d * (float)(tq1_value(b, p) - 1);
      return;
    }
    case kTQ2_0: {  // qs[64], d
      const float d = read_fp16(b + 64);
      for (int p = 0; p < 256; ++p) y[p] = d * (float)(tq2_value(b, p) - 1);
      return;
    }
    default: dequantize_grid_block(t, b, y); return;  // the grid formats (or none)
  }
}

// One row of k elements (whole blocks) to floats.
static KVP_ALWAYS_INLINE void dequantize_row_scalar(int t, const uint8_t* row, int64_t k,
                                                    float* y) {
  const int be = block_elems(t), bb = block_bytes(t);
  for (int64_t i = 0; i < k / be; ++i) dequantize_block(t, row + i * bb, y + i * be);
}

}  // namespace kvp
