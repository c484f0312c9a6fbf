// AMX's tile instructions in plain C++, for the emulation build only (KVP_SIMDE:
// KVPOOL_EMULATE_AVX512=1 in kvpool.model.native), where the avx512-amx variant compiles
// under the AVX2 target with SIMDe's AVX-512 (simd_emulation.h) and these tiles, so that
// its kernels' tests (bit for bit against the dot instructions) run on CPUs without AMX.
// Included by isa_variant.inc after simd_emulation.h; never part of a production build.
//
// What the kernels use, as Intel's pseudo-code has it: a configuration (palette 1: rows
// and bytes a row of each of 8 tiles, of at most 16 rows of 64 bytes), loads and stores
// of a tile's rows a stride apart, zeroing, and the int8 products: C[m][n] (int32) plus
// the sum over k < K of the four products A[m][4 k + i] x B[k][4 n + i], for M = C's rows,
// N = C's bytes / 4, K = A's bytes / 4 (B's rows), wrapping at 32 bits. A shape the
// instruction would fault on traps here too. The tiles are per thread, as the hardware's
// state is.

#pragma once

#include <stdint.h>
#include <string.h>

namespace kvp_amx_emulation {

struct Tiles {
  uint8_t rows[8];
  uint16_t colsb[8];
  bool configured;
  uint8_t data[8][16][64];
};

static inline Tiles& tiles() {
  static thread_local Tiles state;
  return state;
}

static inline void load_config(const void* config) {
  const uint8_t* c = static_cast<const uint8_t*>(config);
  Tiles& t = tiles();
  if (c[0] != 1) __builtin_trap();  // palette 1 only
  for (int i = 0; i < 8; ++i) {
    memcpy(&t.colsb[i], c + 16 + 2 * i, 2);  // bytes 16..47: 16 bytes-a-row, 2 bytes each
    t.rows[i] = c[48 + i];                   // bytes 48..63: 16 row counts
    if (t.rows[i] > 16 || t.colsb[i] > 64) __builtin_trap();
  }
  memset(t.data, 0, sizeof(t.data));
  t.configured = true;
}

static inline Tiles& configured() {
  Tiles& t = tiles();
  if (!t.configured) __builtin_trap();  // a tile instruction before a configuration
  return t;
}

static inline void load(int tile, const void* base, int64_t stride) {
  Tiles& t = configured();
  memset(t.data[tile], 0, sizeof(t.data[tile]));
  for (int r = 0; r < t.rows[tile]; ++r)
    memcpy(t.data[tile][r], static_cast<const uint8_t*>(base) + r * stride, t.colsb[tile]);
}

static inline void store(int tile, void* base, int64_t stride) {
  Tiles& t = configured();
  for (int r = 0; r < t.rows[tile]; ++r)
    memcpy(static_cast<uint8_t*>(base) + r * stride, t.data[tile][r], t.colsb[tile]);
}

static inline void zero(int tile) { memset(configured().data[tile], 0, sizeof(tiles().data[0])); }

template <bool kSignedA, bool kSignedB>
static inline void dot(int c, int a, int b) {
  Tiles& t = configured();
  const int m = t.rows[c], n = t.colsb[c] / 4, k = t.colsb[a] / 4;
  if (t.rows[a] != m || t.rows[b] != k || t.colsb[b] != t.colsb[c]) __builtin_trap();
  for (int i = 0; i < m; ++i)
    for (int j = 0; j < n; ++j) {
      uint32_t acc;  // unsigned: the hardware's sums wrap
      memcpy(&acc, &t.data[c][i][4 * j], 4);
      for (int l = 0; l < k; ++l)
        for (int e = 0; e < 4; ++e) {
          const uint8_t x = t.data[a][i][4 * l + e], y = t.data[b][l][4 * j + e];
          const int32_t xv = kSignedA ? static_cast<int8_t>(x) : x;
          const int32_t yv = kSignedB ? static_cast<int8_t>(y) : y;
          acc += static_cast<uint32_t>(xv * yv);
        }
      memcpy(&t.data[c][i][4 * j], &acc, 4);
    }
}

static inline void release() { tiles().configured = false; }

}  // namespace kvp_amx_emulation

// (the compiler's header, which SIMDe may have included, defines some of these names)
#undef _tile_loadconfig
#undef _tile_loadd
#undef _tile_stored
#undef _tile_zero
#undef _tile_dpbssd
#undef _tile_dpbsud
#undef _tile_dpbusd
#undef _tile_dpbuud
#undef _tile_release
#define _tile_loadconfig(config) kvp_amx_emulation::load_config(config)
#define _tile_loadd(tile, base, stride) kvp_amx_emulation::load(tile, base, stride)
#define _tile_stored(tile, base, stride) kvp_amx_emulation::store(tile, base, stride)
#define _tile_zero(tile) kvp_amx_emulation::zero(tile)
#define _tile_dpbssd(c, a, b) kvp_amx_emulation::dot<true, true>(c, a, b)
#define _tile_dpbsud(c, a, b) kvp_amx_emulation::dot<true, false>(c, a, b)
#define _tile_dpbusd(c, a, b) kvp_amx_emulation::dot<false, true>(c, a, b)
#define _tile_dpbuud(c, a, b) kvp_amx_emulation::dot<false, false>(c, a, b)
#define _tile_release() kvp_amx_emulation::release()
