// The packed ("x8") layouts: a repacked form of the same blocks, the same bytes and the
// same precision, made at load for the formats the vector kernels multiply fastest this
// way. Rows go in groups of 8, and each 32-value unit of the 8 rows is stored together,
// interleaved so that one 32-byte vector holds 4 consecutive values of each of the 8
// rows: an int8 dot product of that vector with 4 activation bytes broadcast gives one
// output row per 32-bit lane. A unit's 8 rows are multiplied with no horizontal sums and
// no shuffles, and each weight byte loaded serves every activation row of the pass.
//
// Per group of 8 rows and per block (fp16 fields as in the file; scales [unit][row], so
// a unit's 8 scales are one load):
//   Q4_0 (144 B):  d[8] | nibbles[128]
//   Q4_1 (160 B):  d[8] | m[8] | nibbles[128]
//   Q5_0 (176 B):  d[8] | nibbles[128] | fifth bits[32]
//   Q8_0 (272 B):  d[8] | q[256]                      (signed, as in the file)
//   Q4_K (1184 B): d[8] | dmin[8] | sc[8][8] | m[8][8] | 8 units x nibbles[128]
//                  (the 6-bit scales and mins unpacked to a byte each: 32 bytes more
//                  per 8 blocks, 2.8%; Q5_K's the same, 2.3%: the layouts not the file's
//                  size)
//   Q5_K (1440 B): Q4_K's header | 8 units x (nibbles[128] | fifth bits[32])
//   Q6_K (1680 B): d[8] | sc[16][8] (int8) | 8 units x (nibbles[128] | high bits[64])
//   Q3_K (912 B):  d[8] | sc[16][8] (int8: the 6-bit scale less 32) |
//                  8 units x (two bits[64] | third bits[32])
//                  (the scales a byte each: 32 bytes more per 8 blocks, 3.6%)
//   Q2_K (672 B):  d[8] | dmin[8] | sm[16][8] (the file's byte: scale | min << 4) |
//                  8 units x two bits[64]
//   IQ4_NL (144 B): d[8] | nibbles[128]                (Q4_0's; a nibble picks a level)
//   IQ4_XS (1104 B): d[8] | sc[8][8] (int8: the unit's 6-bit scale less 32) |
//                  8 units x nibbles[128]             (the scales a byte each: 16 bytes
//                  more per 8 blocks, 1.5%)
// nibbles[128], 4 vectors t: byte 32 t + 4 r + i = value 8 t + i of row r (low nibble)
//   and value 8 t + 4 + i (high nibble).
// q[256], 8 vectors j: byte 32 j + 4 r + i = value 4 j + i of row r.
// high bits[64] (Q6_K's top 2 bits), 2 vectors s for t = 2 s, 2 s + 1: byte 32 s + 4 r + i
//   holds, from bit 0, the values 8 t + i, 8 t + 4 + i of t = 2 s, then of t = 2 s + 1.
// two bits[64] (Q2_K's and Q3_K's low 2 bits), 2 vectors c: byte 32 c + 4 r + i holds in
//   bits 2 f, 2 f + 1 the value 4 (4 c + f) + i of row r (f = 0..3): vector v = 4 c + f of
//   the unit is a shift by 2 f and a mask.
// third bits[32] (Q3_K's), one vector: byte 4 r + i holds in bit v the value 4 v + i's.
// fifth bits[32] (Q5_0's and Q5_K's top bit), one vector: byte 4 r + i holds in bit 2 t the value
//   8 t + i's and in bit 2 t + 1 the value 8 t + 4 + i's (t = 0..3): at the byte of
//   nibble vector t's same values, so a shift and a mask put them in place.
//
// Plain C++ (static inline, C headers only): see quant_blocks.h. Its dequantization
// (per variant, for its vectors) is packed_dequantize.inc.

#pragma once

#include "quant_blocks.h"

namespace kvp {

constexpr int kGroup = 8;

// Q5_0 and Q5_K: a unit's values are nibbles and a fifth bit each (160-byte units).
static constexpr bool five_bit(int t) { return t == kQ5_0 || t == kQ5_K; }
// Q4_K and Q5_K: scales and mins, the header's 6-bit pairs unpacked to a byte each.
static constexpr bool k_with_mins(int t) { return t == kQ4_K || t == kQ5_K; }
// Q2_K and Q3_K: values of 2 bits (Q3_K: and a third bit) in 64-byte (96-byte) units.
static constexpr bool two_bit(int t) { return t == kQ2_K || t == kQ3_K; }
// The K-quants with an integer scale per 16 values, which the kernels multiply their
// integer sums by (a unit's two halves): Q2_K, Q3_K, Q6_K.
static constexpr bool scaled16(int t) { return two_bit(t) || t == kQ6_K; }
// Where a scaled16 format's header holds its scale bytes [16][8] (scale g of row r at
// 8 g + r; unit j's halves are scales 2 j and 2 j + 1): after d (Q3_K, Q6_K) or d and dmin.
static constexpr int scales16_at(int t) { return t == kQ2_K ? 32 : 16; }
// IQ4_NL and IQ4_XS: nibbles that pick int8 levels (kIQ4Levels).
static constexpr bool iq4(int t) { return t == kIQ4_NL || t == kIQ4_XS; }
// Formats whose values the kernels multiply as signed int8: Q8_0's, IQ4's levels.
static constexpr bool signed_values(int t) { return t == kQ8_0 || iq4(t); }

static inline bool packable(int t) {
  return t == kQ4_0 || t == kQ4_1 || t == kQ5_0 || t == kQ8_0 || t == kQ4_K || t == kQ5_K ||
         scaled16(t) || iq4(t);
}

// Bytes of a packed group-block's header, and of the group-block.
static inline int header_bytes(int t) {
  switch (t) {
    case kQ4_0: case kQ5_0: case kQ8_0: case kIQ4_NL: return 16;
    case kQ4_1: return 32;
    case kIQ4_XS: return 16 + 64;
    case kQ4_K: case kQ5_K: return 16 + 16 + 64 + 64;
    case kQ6_K: case kQ3_K: return 16 + 128;
    case kQ2_K: return 16 + 16 + 128;
    default: return 0;
  }
}
static inline int64_t group_block_bytes(int t) {
  return 8 * (int64_t)block_bytes(t) + (k_with_mins(t) || t == kQ3_K ? 32 : t == kIQ4_XS ? 16 : 0);
}
// Bytes of one packed group of 8 rows of k values.
static inline int64_t group_bytes(int t, int64_t k) { return k / block_elems(t) * group_block_bytes(t); }

static inline int units_per_block(int t) { return block_elems(t) / 32; }

// Bytes of one packed unit of 8 rows (its values; the scales are in the header).
static inline int unit_bytes(int t) {
  return t == kQ8_0 ? 256 : t == kQ6_K ? 192 : five_bit(t) ? 160 : t == kQ3_K ? 96
         : t == kQ2_K ? 64 : 128;
}

// A row's unit is packed 4 bytes of the unit's vectors at a time (32-bit words, masks and
// shifts: byte lanes never spill into each other, as each lane's value fits its shifts;
// 2-8x the rate of value-by-value loops, docs/performance.md, fifty-third session).
static inline uint32_t load32(const uint8_t* p) {
  uint32_t v;
  memcpy(&v, p, 4);
  return v;
}
static inline void store32(uint8_t* p, uint32_t v) { memcpy(p, &v, 4); }
constexpr uint32_t kNibbles = 0x0F0F0F0Fu;

// nibbles[128] of row r (bytes 32 q + 4 r ..), the unit's 32 values the nibbles at
// `shift` (0: low, 4: high) of the 32 bytes v32 (Q4_K, Q5_K, Q6_K's low bits): values
// 8 q + i and 8 q + 4 + i are bytes 8 q + i and 8 q + 4 + i.
static inline void pack_nibbles32(const uint8_t* v32, int shift, int r, uint8_t* u) {
  for (int q = 0; q < 4; ++q) {
    const uint32_t a = (load32(v32 + 8 * q) >> shift) & kNibbles;
    const uint32_t b = (load32(v32 + 8 * q + 4) >> shift) & kNibbles;
    store32(u + 32 * q + 4 * r, a | b << 4);
  }
}

// The same for the legacy layout (Q4_0, Q4_1, Q5_0, IQ4): values 0-15 the low nibbles of
// the 16 bytes v16, values 16-31 their high nibbles.
static inline void pack_nibbles16(const uint8_t* v16, int r, uint8_t* u) {
  for (int q = 0; q < 2; ++q) {
    const uint32_t a = load32(v16 + 8 * q), b = load32(v16 + 8 * q + 4);
    store32(u + 32 * q + 4 * r, (a & kNibbles) | (b & kNibbles) << 4);
    store32(u + 32 * (q + 2) + 4 * r, (a >> 4 & kNibbles) | (b & ~kNibbles));
  }
}

// fifth bits[32] of row r (Q5_K): value e's fifth bit is bit `shift` of byte e of qh32.
static inline void pack_fifth_bits32(const uint8_t* qh32, int shift, int r, uint8_t* u) {
  uint32_t bits = 0;
  for (int q = 0; q < 4; ++q) {
    bits |= ((load32(qh32 + 8 * q) >> shift) & 0x01010101u) << (2 * q);
    bits |= ((load32(qh32 + 8 * q + 4) >> shift) & 0x01010101u) << (2 * q + 1);
  }
  store32(u + 128 + 4 * r, bits);
}

// high bits[64] of row r (Q6_K): value e's top 2 bits are bits shift, shift + 1 of byte e
// of h32.
static inline void pack_high_bits32(const uint8_t* h32, int shift, int r, uint8_t* u) {
  for (int s = 0; s < 2; ++s) {
    uint32_t bits = 0;
    for (int h = 0; h < 2; ++h) {
      const int q = 2 * s + h;
      bits |= ((load32(h32 + 8 * q) >> shift) & 0x03030303u) << (4 * h);
      bits |= ((load32(h32 + 8 * q + 4) >> shift) & 0x03030303u) << (4 * h + 2);
    }
    store32(u + 128 + 32 * s + 4 * r, bits);
  }
}

// two bits[64] of row r (Q2_K, Q3_K's low bits): value e's are bits shift, shift + 1 of
// byte e of q32.
static inline void pack_two_bits32(const uint8_t* q32, int shift, int r, uint8_t* u) {
  for (int c = 0; c < 2; ++c) {
    uint32_t bits = 0;
    for (int f = 0; f < 4; ++f)
      bits |= ((load32(q32 + 16 * c + 4 * f) >> shift) & 0x03030303u) << (2 * f);
    store32(u + 32 * c + 4 * r, bits);
  }
}

// third bits[32] of row r (Q3_K): value e's third bit is bit `shift` of byte e of hm32.
static inline void pack_third_bits32(const uint8_t* hm32, int shift, int r, uint8_t* u) {
  uint32_t bits = 0;
  for (int v = 0; v < 8; ++v) bits |= ((load32(hm32 + 4 * v) >> shift) & 0x01010101u) << v;
  store32(u + 64 + 4 * r, bits);
}

// Unit j (values 32 j .. 32 j + 31) of row r's file block b into the group's unit u.
// Where the file keeps a unit's values: Q4_0, Q4_1, IQ4_NL: 16 bytes after the header,
// values 0-15 their low nibbles, 16-31 the high ones (IQ4_XS: unit j's 16 bytes at
// 8 + 16 j); Q5_0 likewise, each value's fifth bit bit e of the uint32 qh; Q8_0: 32 bytes
// of int8; Q4_K: the low (j even) or high nibbles of the 32 bytes at 16 + 32 (j / 2)
// (Q5_K: at 48 + ..., the fifth bit bit j of qh[32] at 16); Q6_K: unit (n, i) = (j / 4,
// j % 4) the nibbles (i / 2) of ql's 32 bytes at 64 n + 32 (i % 2), the top 2 bits bits
// 2 i of qh's 32 bytes at 128 + 32 n; Q2_K: bits 2 (j % 4) of qs' 32 bytes at
// 16 + 32 (j / 4) (Q3_K: at 32 + ..., the third bit bit j of hmask[32] at 0). The
// test_quant_products tests check the packed layout's values against the gguf package's.
template <int T>
static inline void pack_unit_words(const uint8_t* b, int j, int r, uint8_t* u) {
  switch (T) {
    case kQ4_0: case kIQ4_NL: return pack_nibbles16(b + 2, r, u);
    case kQ4_1: return pack_nibbles16(b + 4, r, u);
    case kIQ4_XS: return pack_nibbles16(b + 8 + 16 * j, r, u);
    case kQ5_0: {
      pack_nibbles16(b + 6, r, u);
      const uint32_t qh = load32(b + 2);  // bit e: value e's fifth bit
      for (int i = 0; i < 4; ++i) {
        int bits = 0;
        for (int q = 0; q < 4; ++q)
          bits |= ((qh >> (8 * q + i)) & 1) << (2 * q) | ((qh >> (8 * q + 4 + i)) & 1) << (2 * q + 1);
        u[128 + 4 * r + i] = (uint8_t)bits;
      }
      return;
    }
    case kQ8_0:
      for (int q = 0; q < 8; ++q) memcpy(u + 32 * q + 4 * r, b + 2 + 4 * q, 4);
      return;
    case kQ4_K: return pack_nibbles32(b + 16 + 32 * (j >> 1), 4 * (j & 1), r, u);
    case kQ5_K:
      pack_nibbles32(b + 48 + 32 * (j >> 1), 4 * (j & 1), r, u);
      return pack_fifth_bits32(b + 16, j, r, u);
    case kQ6_K: {
      const int n = j >> 2, i = j & 3;
      pack_nibbles32(b + 64 * n + 32 * (i & 1), 4 * (i >> 1), r, u);
      return pack_high_bits32(b + 128 + 32 * n, 2 * i, r, u);
    }
    case kQ2_K: return pack_two_bits32(b + 16 + 32 * (j >> 2), 2 * (j & 3), r, u);
    case kQ3_K:
      pack_two_bits32(b + 32 + 32 * (j >> 2), 2 * (j & 3), r, u);
      return pack_third_bits32(b, j, r, u);
    default: return;
  }
}

// Repack rows [8 g, 8 g + 8) (file blocks, row_bytes apart) into one group (the type a
// template parameter: the switches compile away).
template <int T>
static inline void pack_group_t(const uint8_t* rows, int64_t row_bytes, uint8_t* out) {
  constexpr int t = T;
  const int bb = block_bytes(t), units = units_per_block(t);
  const int64_t blocks = row_bytes / bb;
  for (int64_t blk = 0; blk < blocks; ++blk) {
    uint8_t* o = out + blk * group_block_bytes(t);
    const uint8_t* src[kGroup];
    for (int r = 0; r < kGroup; ++r) src[r] = rows + r * row_bytes + blk * bb;
    // headers
    for (int r = 0; r < kGroup; ++r) {
      switch (t) {
        case kQ4_0: case kQ5_0: case kQ8_0: case kIQ4_NL: memcpy(o + 2 * r, src[r], 2); break;
        case kIQ4_XS:  // d, then each unit's scale
          memcpy(o + 2 * r, src[r], 2);
          for (int j = 0; j < 8; ++j) o[16 + 8 * j + r] = (uint8_t)(int8_t)iq4_xs_scale(src[r], j);
          break;
        case kQ4_1: memcpy(o + 2 * r, src[r], 2); memcpy(o + 16 + 2 * r, src[r] + 2, 2); break;
        case kQ4_K: case kQ5_K:
          memcpy(o + 2 * r, src[r], 2);
          memcpy(o + 16 + 2 * r, src[r] + 2, 2);
          for (int j = 0; j < 8; ++j) scale_min_k4(j, src[r] + 4, o + 32 + 8 * j + r, o + 96 + 8 * j + r);
          break;
        case kQ6_K:
          memcpy(o + 2 * r, src[r] + 208, 2);
          for (int g = 0; g < 16; ++g) o[16 + 8 * g + r] = src[r][192 + g];
          break;
        case kQ3_K: {
          int8_t sc[16];
          q3_k_scales(src[r] + 96, sc);
          memcpy(o + 2 * r, src[r] + 108, 2);
          for (int g = 0; g < 16; ++g) o[16 + 8 * g + r] = (uint8_t)sc[g];
          break;
        }
        case kQ2_K:
          memcpy(o + 2 * r, src[r] + 80, 2);
          memcpy(o + 16 + 2 * r, src[r] + 82, 2);
          for (int g = 0; g < 16; ++g) o[32 + 8 * g + r] = src[r][g];
          break;
        default: break;
      }
    }
    uint8_t* body = o + header_bytes(t);
    for (int j = 0; j < units; ++j)
      for (int r = 0; r < kGroup; ++r) pack_unit_words<T>(src[r], j, r, body + j * unit_bytes(t));
  }
}

static inline void pack_group(int t, const uint8_t* rows, int64_t row_bytes, uint8_t* out) {
  switch (t) {
    case kQ4_0: return pack_group_t<kQ4_0>(rows, row_bytes, out);
    case kQ4_1: return pack_group_t<kQ4_1>(rows, row_bytes, out);
    case kQ5_0: return pack_group_t<kQ5_0>(rows, row_bytes, out);
    case kQ8_0: return pack_group_t<kQ8_0>(rows, row_bytes, out);
    case kQ4_K: return pack_group_t<kQ4_K>(rows, row_bytes, out);
    case kQ5_K: return pack_group_t<kQ5_K>(rows, row_bytes, out);
    case kQ6_K: return pack_group_t<kQ6_K>(rows, row_bytes, out);
    case kQ2_K: return pack_group_t<kQ2_K>(rows, row_bytes, out);
    case kQ3_K: return pack_group_t<kQ3_K>(rows, row_bytes, out);
    case kIQ4_NL: return pack_group_t<kIQ4_NL>(rows, row_bytes, out);
    case kIQ4_XS: return pack_group_t<kIQ4_XS>(rows, row_bytes, out);
    default: return;
  }
}

}  // namespace kvp
