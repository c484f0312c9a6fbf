// Products with weights kept in GGUF's quantized blocks: the torch-facing ops, and the
// choice of kernels by what the CPU has, made at run time (the module is built once for
// the architecture, not for the machine that built it).
//
// quant_matmul(x [M, K], parts, ...) computes x W^T for W the rows of every part stacked
// (a fused QKV or gate/up of parts that may differ in format): float32 [M, sum of rows],
// or in x's dtype with same_dtype (each sum rounded once, as .to() rounds). A decode step
// makes a hundred or more of these calls with a few KB each: the activations' float32
// copy, their int8 blocks and a bf16 product's float32 sums (a work item's at a time)
// live in per-thread scratch buffers, not in tensors allocated (and converted through the
// dispatcher) per call.
//   mode 0: integer products where the kernels have them for a part's format
//           (activations quantized to int8 per block of 32, as llama.cpp does);
//   mode 1: float products: weights dequantized (in tiles, per thread) and multiplied
//           with the float32 activations: what dequantizing the file and multiplying
//           in float32 gives, up to the order of the sums (the exact reference);
//   mode 2: as 1, the tiles and activations rounded to bfloat16 for the product (for
//           large steps on CPUs with bf16 products in hardware).
// Work is split over tiles of weight rows, which the threads take in runs from a shared
// counter (a thread slowed by its core's other work takes fewer); each thread dequantizes
// or unpacks only the rows it takes, so no dequantized copy of a matrix ever exists.
//
// A part's type may carry kPacked: its tensor then holds the packed layout of
// quant_packed.h, [rows / 8, 8 * bytes per row] (quant_pack makes it).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#if defined(__linux__)
#include <sched.h>
#endif

#include <algorithm>
#include <atomic>
#include <cstring>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include "quant_blocks.h"
#include "isa_select.h"
#include "native_ops.h"
#include "parallel.h"
#include "quant_kernels.h"
#include "quant_packed.h"

namespace {

using kvp::QuantKernels;

const QuantKernels* table(const std::string& isa) { return kvp::variant(isa).quant; }

constexpr int kPacked = 0x100;  // a type flag: the part is in the packed layout

struct Part {
  const uint8_t* raw;
  int64_t rows, row_bytes, offset;  // offset: first output column
  int type;
  bool packed;
};

std::vector<Part> check_parts(const std::vector<at::Tensor>& parts, const std::vector<int64_t>& types,
                              int64_t k) {
  TORCH_CHECK(!parts.empty() && parts.size() == types.size(), "one type per part");
  std::vector<Part> out;
  int64_t offset = 0;
  for (size_t i = 0; i < parts.size(); ++i) {
    const auto& p = parts[i];
    const bool packed = (types[i] & kPacked) != 0;
    const int t = static_cast<int>(types[i] & ~kPacked);
    TORCH_CHECK(kvp::known_type(t) && t != kvp::kF32 && t != kvp::kF16 && t != kvp::kBF16,
                "part ", i, ": unsupported ggml type ", t);
    TORCH_CHECK(!packed || kvp::packable(t), "part ", i, ": type ", t, " has no packed layout");
    TORCH_CHECK(!kvp::grid_type(t) || kvp::iq_grids().iq2xxs != nullptr, "part ", i,
                ": type ", t, "'s grid was not handed over (set_iq_grids)");
    TORCH_CHECK(k % kvp::block_elems(t) == 0 && k % 32 == 0, "part ", i, ": K=", k,
                " is not a whole number of blocks");
    const int64_t row_bytes = k / kvp::block_elems(t) * kvp::block_bytes(t);
    const int64_t width = packed ? kvp::group_bytes(t, k) : row_bytes;
    TORCH_CHECK(p.dim() == 2 && p.scalar_type() == at::kByte && p.is_contiguous() && p.size(1) == width,
                "part ", i, ": a contiguous uint8 [rows, ", width, "] tensor of its blocks");
    const int64_t rows = packed ? p.size(0) * kvp::kGroup : p.size(0);
    out.push_back({p.data_ptr<uint8_t>(), rows, row_bytes, offset, t, packed});
    offset += rows;
  }
  return out;
}

// Rows [first, first + count) of a part as floats, or as bf16 bits (count * k):
// dequantized from the file blocks or from the packed layout (a group, or its part, at a
// time) by the kernels.
template <class Out>
void dequantize_part(const QuantKernels* t, const Part& p, int64_t first, int64_t count, int64_t k,
                     Out* out) {
  constexpr bool bf16 = std::is_same_v<Out, uint16_t>;
  if (!p.packed) {
    const uint8_t* w = p.raw + first * p.row_bytes;
    if constexpr (bf16) t->dequantize_rows_bf16(p.type, w, p.row_bytes, count, k, out);
    else t->dequantize_rows(p.type, w, p.row_bytes, count, k, out);
    return;
  }
  const int64_t group_bytes = kvp::group_bytes(p.type, k);
  while (count > 0) {
    const int r = static_cast<int>(first % kvp::kGroup);
    const int n = static_cast<int>(std::min<int64_t>(count, kvp::kGroup - r));
    const uint8_t* group = p.raw + (first / kvp::kGroup) * group_bytes;
    if constexpr (bf16) t->dequantize_packed_bf16(p.type, group, k, r, n, out, k);
    else t->dequantize_packed(p.type, group, k, r, n, out, k);
    first += n;
    count -= n;
    out += n * k;
  }
}

constexpr int64_t kIntTile = 16;     // weight rows per task, integer products
constexpr int64_t kFloatTile = 64;   // weight rows per task, float products (dequantized)
constexpr int64_t kRowBlock = 128;   // activation rows per pass (they stay in cache)
constexpr int64_t kGemmRows = 16;    // from this many activation rows, float tiles use at::mm
constexpr int64_t kRunsPerThread = 16;  // runs of work items a thread takes, on average
// Products of at most this many activation rows stream their weights from memory (a
// decode step's): a thread then takes kStreamRuns runs on average, so each reads long
// stretches of the matrix. With 16, the default model's 576-row products (36 tiles of
// 16 rows, 5.8 KB each) went a tile at a time, the two threads taking alternate tiles,
// and its batch-1 step read its layers' weights at ~18 GB/s (the memory gives ~31):
// with 2, that step takes 0.80-0.90x the time, batch 8 0.96x, the 1B-class batch 1 ~0.98x
// (a Zen 3; docs/performance.md).
constexpr int64_t kStreamRows = 8;
constexpr int64_t kStreamRuns = 2;
constexpr int64_t kQuantizeValues = 1 << 14;  // activation values quantized per thread, at least
constexpr int64_t kGemmTileMax = 256;  // weight rows per task at most, tiles through at::mm

// The CPUs this process may use (fixed for its life, unlike the threads of a call).
int64_t usable_cpus() {
#if defined(__linux__)
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) return std::max(1, CPU_COUNT(&set));
#endif
  return std::max(1u, std::thread::hardware_concurrency());
}

// Weight rows a tile multiplied by at::mm takes from a part of `rows` rows: each call
// packs the activations again (oneDNN's AMX bf16 kernels, MKL's sgemm), so wider tiles
// cost less (AMX Xeon, 2 threads, 512 rows, bf16: 8,192 x 2,048 15.6 -> 12.6 ms, 2,048 x
// 8,192 16.1 -> 12.0 ms with 256 rows for 64; float32 5-10%), while a part still needs
// two tiles a CPU to keep every CPU busy. Not the call's thread count: a tile's width
// changes its sums' last bits, and a product must give the same bits on any number of
// threads (the engine's thread policy runs a step on one thread or on all).
int64_t gemm_tile_rows(int64_t rows) {
  static const int64_t cpus = usable_cpus();
  const int64_t share = rows / (2 * cpus) / kFloatTile * kFloatTile;
  return std::clamp(share, kFloatTile, kGemmTileMax);
}

}  // namespace

namespace kvp {
IQGrids g_iq_grids;  // set once by set_iq_grids, before a grid format is read
}  // namespace kvp
static std::vector<float> g_iq_floats;  // what g_iq_grids points at: the grids, then the signs
static std::vector<uint8_t> g_iq_bytes;  // as bytes (IQGrids' *_b), ksigns, ksign_b

void set_iq_grids(const std::vector<at::Tensor>& grids) {
  static const int64_t shapes[6][2] = {{256, 8}, {512, 8}, {1024, 8},
                                       {256, 4}, {512, 4}, {2048, 8}};
  TORCH_CHECK(grids.size() == 6, "six grids: IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S");
  size_t offsets[7] = {0};
  for (size_t i = 0; i < 6; ++i) {
    const at::Tensor& g = grids[i];
    TORCH_CHECK(g.dim() == 2 && g.size(0) == shapes[i][0] && g.size(1) == shapes[i][1] &&
                    g.scalar_type() == (i == 5 ? at::kChar : at::kByte),
                "grid ", i, ": ", i == 5 ? "int8" : "uint8", " [", shapes[i][0], ", ",
                shapes[i][1], "]");
    offsets[i + 1] = offsets[i] + g.numel();
  }
  std::vector<float> floats(offsets[6] + 256 * 8);
  for (size_t i = 0; i < 6; ++i) {
    const at::Tensor f = grids[i].to(at::kFloat).contiguous();
    std::copy(f.data_ptr<float>(), f.data_ptr<float>() + f.numel(), &floats[offsets[i]]);
  }
  float* signs = &floats[offsets[6]];
  for (int byte = 0; byte < 256; ++byte)
    for (int j = 0; j < 8; ++j) signs[8 * byte + j] = (byte >> j) & 1 ? -1.f : 1.f;
  if (kvp::g_iq_grids.iq2xxs != nullptr) {  // once: a kernel may be reading the first ones
    TORCH_CHECK(floats == g_iq_floats, "the grids were set to other values");
    return;
  }
  g_iq_floats = std::move(floats);
  // bytes: the grids (IQ1's times 8), the signs as int8, ksigns, the signs of ksigns
  g_iq_bytes.resize(offsets[6] + 256 * 8 + 128 + 128 * 8);
  for (size_t i = 0; i < offsets[6] + 256 * 8; ++i) {
    const int v = static_cast<int>(g_iq_floats[i]) * (i >= offsets[5] && i < offsets[6] ? 8 : 1);
    g_iq_bytes[i] = static_cast<uint8_t>(static_cast<int8_t>(v));
  }
  uint8_t* ksigns = &g_iq_bytes[offsets[6] + 256 * 8];
  for (int i = 0; i < 128; ++i)
    ksigns[i] = static_cast<uint8_t>(i | (__builtin_popcount(i) & 1) << 7);
  uint8_t* ksign_rows = ksigns + 128;
  for (int i = 0; i < 128; ++i)
    std::copy_n(&g_iq_bytes[offsets[6] + 8 * ksigns[i]], 8, ksign_rows + 8 * i);
  kvp::IQGrids g;
  g.iq2xxs = &g_iq_floats[offsets[0]];
  g.iq2xs = &g_iq_floats[offsets[1]];
  g.iq2s = &g_iq_floats[offsets[2]];
  g.iq3xxs = &g_iq_floats[offsets[3]];
  g.iq3s = &g_iq_floats[offsets[4]];
  g.ksigns = ksigns;
  g.signs = &g_iq_floats[offsets[6]];
  g.iq2xxs_b = &g_iq_bytes[offsets[0]];
  g.iq2xs_b = &g_iq_bytes[offsets[1]];
  g.iq2s_b = &g_iq_bytes[offsets[2]];
  g.iq3xxs_b = &g_iq_bytes[offsets[3]];
  g.iq3s_b = &g_iq_bytes[offsets[4]];
  g.iq1s_b = reinterpret_cast<const int8_t*>(&g_iq_bytes[offsets[5]]);
  g.sign_b = reinterpret_cast<const int8_t*>(&g_iq_bytes[offsets[6]]);
  g.ksign_b = reinterpret_cast<const int8_t*>(ksign_rows);
  kvp::g_iq_grids = g;
}

std::vector<std::string> kernel_variants(bool built) {
  std::vector<std::string> names;
  for (const auto& v : built ? kvp::built_variants() : kvp::cpu_variants()) names.push_back(v.name);
  return names;
}

bool quant_packs(int64_t qtype, const std::string& isa) {
  return kvp::packable(static_cast<int>(qtype)) && table(isa)->has_packed_dot(static_cast<int>(qtype));
}

bool quant_has_int_dot(int64_t qtype, const std::string& isa) {
  return table(isa)->has_int_dot(static_cast<int>(qtype));
}

at::Tensor quant_pack(const at::Tensor& raw, int64_t qtype, const c10::optional<at::Tensor>& into) {
  TORCH_CHECK(kvp::packable(static_cast<int>(qtype)), "type ", qtype, " has no packed layout");
  TORCH_CHECK(raw.dim() == 2 && raw.scalar_type() == at::kByte && raw.is_contiguous() &&
              raw.size(0) % kvp::kGroup == 0, "raw: contiguous uint8 [rows, bytes], rows a multiple of 8");
  const int t = static_cast<int>(qtype);
  const int64_t row_bytes = raw.size(1);
  TORCH_CHECK(row_bytes % kvp::block_bytes(t) == 0, "raw: rows of whole blocks");
  const int64_t k = row_bytes / kvp::block_bytes(t) * kvp::block_elems(t);
  const int64_t group_bytes = kvp::group_bytes(t, k);
  at::Tensor out;
  if (into.has_value()) {  // storage the caller gives (a huge-page mapping)
    out = *into;
    TORCH_CHECK(out.scalar_type() == at::kByte && out.is_contiguous() &&
                out.numel() == raw.size(0) / kvp::kGroup * group_bytes, "into: the packed size");
    out = out.view({raw.size(0) / kvp::kGroup, group_bytes});
  } else {
    out = at::empty({raw.size(0) / kvp::kGroup, group_bytes}, raw.options());
  }
  const uint8_t* in = raw.data_ptr<uint8_t>();
  uint8_t* o = out.data_ptr<uint8_t>();
  kvp::parallel_for(0, out.size(0), 16, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g)
      kvp::pack_group(t, in + g * kvp::kGroup * row_bytes, row_bytes, o + g * group_bytes);
  });
  return out;
}

int64_t quant_packed_bytes(int64_t qtype, int64_t rows, int64_t k) {
  return rows / kvp::kGroup * kvp::group_bytes(static_cast<int>(qtype), k);
}

at::Tensor quant_dequantize(const at::Tensor& raw, int64_t qtype, int64_t k, const std::string& isa,
                            const c10::optional<at::Tensor>& rows, bool bf16) {
  const auto parts = check_parts({raw}, {qtype}, k);
  const Part& p = parts[0];
  const QuantKernels* t = table(isa);
  auto every_row = [&](auto* o) {
    kvp::parallel_for(0, p.rows, 64, [&](int64_t begin, int64_t end) {
      dequantize_part(t, p, begin, end - begin, k, o + begin * k);
    });
  };
  if (bf16) {  // every row as a bf16 tile's weights (tests compare them with .to())
    TORCH_CHECK(!rows.has_value(), "bf16: every row");
    auto out = at::empty({p.rows, k}, at::kBFloat16);
    every_row(reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()));
    return out;
  }
  if (rows.has_value()) {  // selected rows (an embedding lookup)
    const auto ids = rows->to(at::kLong).contiguous();
    const int64_t* id = ids.data_ptr<int64_t>();
    for (int64_t i = 0; i < ids.numel(); ++i)
      TORCH_CHECK(id[i] >= 0 && id[i] < p.rows, "row ", id[i], " out of the matrix");
    auto out = at::empty({ids.numel(), k}, at::kFloat);
    float* o = out.data_ptr<float>();
    kvp::parallel_for(0, ids.numel(), 16, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) dequantize_part(t, p, id[i], 1, k, o + i * k);
    });
    return out;
  }
  auto out = at::empty({p.rows, k}, at::kFloat);
  every_row(out.data_ptr<float>());
  return out;
}

// Calls this small (elements of the activations or the output) use per-thread scratch
// buffers that only grow (up to 1 MiB of floats each: decode steps); larger ones
// (prefill) allocate, which their size amortizes, and keep nothing.
constexpr int64_t kScratchMax = 1 << 18;

// A buffer of n elements: the calling thread's scratch (owned by it for one call; the
// worker threads of that call only read or write inside it), or ``keep``'s when large.
template <class T>
T* buffer_for(std::vector<T>& scratch, at::Tensor& keep, int64_t n, at::ScalarType type) {
  if (n > kScratchMax) {
    keep = at::empty({n}, at::TensorOptions().dtype(type));
    return keep.data_ptr<T>();
  }
  if (static_cast<int64_t>(scratch.size()) < n) scratch.resize(n);
  return scratch.data();
}

// dst[i] = src[i] converted, over the threads when large.
template <class S, class D>
void convert(const S* src, D* dst, int64_t n) {
  kvp::parallel_for(0, n, 1 << 15, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) dst[i] = static_cast<D>(src[i]);
  });
}

at::Tensor quant_matmul(const at::Tensor& x_in, const std::vector<at::Tensor>& parts_in,
                        const std::vector<int64_t>& types, int64_t mode, const std::string& isa,
                        bool same_dtype) {
  TORCH_CHECK(x_in.dim() == 2, "x: [rows, K]");
  TORCH_CHECK(x_in.scalar_type() == at::kFloat || x_in.scalar_type() == at::kBFloat16,
              "x: float32 or bfloat16");
  // mode: bits 0-1 the product's kind (0 integer, 1 float, 2 bf16 tiles); bits 2-3, where
  // set, one more than the kind of the parts in the file's layout (those the kernels
  // multiply unpacked, whose crossover to tiles comes earlier: ProductPolicy); bits 4-5 the
  // packed kernel for a single row (kvp::kOneRowOwn, kOneRowWide or kOneRowNarrow); bit 6
  // `grouped`: integer products may take a kernel for many rows whose order of sums
  // differs from a single row's (QuantKernels::int_dot; not for batch-invariant products);
  // bit 7 `far`: passes of few rows ask for their weights kReadAheadFar bytes ahead, not
  // kReadAheadNear (the same results: only when the memory is asked for differs)
  const int64_t packed_mode = mode & 3;
  const int64_t file_mode = (mode >> 2 & 3) ? (mode >> 2 & 3) - 1 : packed_mode;
  const int one_row = static_cast<int>(mode >> 4 & 3);
  const bool grouped_mode = (mode >> 6 & 1) != 0;
  const int ahead = (mode >> 7 & 1) ? kvp::kReadAheadFar : kvp::kReadAheadNear;
  TORCH_CHECK(mode >= 0 && mode < 256 && packed_mode <= 2 && file_mode <= 2 &&
                  one_row <= kvp::kOneRowNarrow,
              "mode: 0 (integer), 1 (float) or 2 (bf16 tiles), plus 4 x (1 + the kind for "
              "the file's layout) where it differs, plus 16 x the single row's packed kernel "
              "(0 the kernels' own, 1 wide, 2 narrow), plus 64 where the integer products "
              "may take kernels for many rows (not batch-invariant), plus 128 to read "
              "the weights further ahead");
  const int64_t m = x_in.size(0), k = x_in.size(1);
  // the kernels for many rows, in a step of enough (one choice for all its rows)
  const bool grouped = grouped_mode && m >= kvp::kGroupedFrom;
  const auto parts = check_parts(parts_in, types, k);
  const int64_t n_total = parts.back().offset + parts.back().rows;
  const QuantKernels* t = table(isa);
  static thread_local std::vector<float> x_scratch, d_scratch;
  static thread_local std::vector<int8_t> q_scratch;
  static thread_local std::vector<int32_t> o_scratch;
  const bool bf16_in = x_in.scalar_type() == at::kBFloat16;
  const bool bf16_out = same_dtype && bf16_in;
  // Tiles multiplied by at::mm, each on the thread that took it, several at once: only
  // where torch's BLAS is MKL (its x86 builds). Its aarch64 build's (OpenBLAS), called
  // so, rounded a tile's sums differently from call to call (seen under emulation: the
  // same product differed in its last bits between runs on two threads), which breaks
  // "the same bits on any number of threads" that the thread policy rests on; float_dot
  // then multiplies the tiles. And only inside OpenMP's region, where torch and MKL see
  // it and multiply each tile on its one thread: from kvp's own pool's workers (a build
  // without OpenMP) every call would start a team of its own.
  const bool gemm_tiles = m >= kGemmRows && at::hasMKL() && kvp::kOpenMP;
  auto mode_of = [&](const Part& p) { return p.packed ? packed_mode : file_mode; };
  auto integer_for = [&](const Part& p) {
    return mode_of(p) == 0 && (p.packed ? t->has_packed_dot(p.type) : t->has_int_dot(p.type));
  };
  auto bf16_tiles_for = [&](const Part& p) { return mode_of(p) == 2 && gemm_tiles; };
  // any_float: a part's float tiles multiply float32 activations (any_bf16: bf16 ones)
  bool any_int = false, any_float = false, any_bf16 = false, offsets = false;  // off4 / off6
  for (const auto& p : parts) {
    const bool integer = integer_for(p);
    any_int |= integer;
    any_float |= !integer && !bf16_tiles_for(p);
    any_bf16 |= !integer && bf16_tiles_for(p);
    // (the packed kernels', and the grid and ternary formats in the file's layout on x86:
    // grid_group_dot)
    offsets |= integer && (p.packed || (grouped && kvp::grouped_type(p.type))) &&
               t->sums_from_offsets(p.type);
  }
  const auto x16 = any_bf16 ? x_in.to(at::kBFloat16).contiguous() : at::Tensor();
  auto y = at::empty({m, n_total}, x_in.options().dtype(bf16_out ? at::kBFloat16 : at::kFloat));
  if (m == 0) return y;
  // The activations in float32: x itself, or its bf16 values widened into scratch where
  // a float product reads them (an integer product's quantizing widens a few rows at a
  // time, and bf16 tiles read x16: a prefill step's [M, K] float32 copy, 16 MiB for 512
  // rows of K = 8192, is not made).
  const float* xp = nullptr;
  const at::BFloat16* x16p = nullptr;
  at::Tensor x16_keep, x_keep, q_keep, d_keep, o_keep;
  if (bf16_in) {
    x16_keep = x_in.contiguous();
    x16p = x16_keep.data_ptr<at::BFloat16>();
    if (any_float) {
      float* dst = buffer_for(x_scratch, x_keep, m * k, at::kFloat);
      convert(x16p, dst, m * k);
      xp = dst;
      x16p = nullptr;
    }
  } else {
    x_keep = x_in.contiguous();
    xp = x_keep.data_ptr<float>();
  }
  // The float32 sums go to y itself, or where y is bf16, each work item's to its thread's
  // tile buffer, rounded into y as the item ends (as .to() rounds: the same bits as
  // rounding all of y at the end, without a [M, N] float32 copy of it: 32 MiB for a
  // 512-row step's gate/up product of 16384 rows).
  float* yp = bf16_out ? nullptr : y.data_ptr<float>();
  at::BFloat16* y16 = bf16_out ? y.data_ptr<at::BFloat16>() : nullptr;
  const int64_t ldq = kvp::q_row_stride(k);
  kvp::Q8Rows act{nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, k, ldq};
  if (any_int) {
    int8_t* q = buffer_for(q_scratch, q_keep, m * ldq, at::kChar);
    float* d = buffer_for(d_scratch, d_keep, m * (k / 32) * 2 + m * (k / 16), at::kFloat);
    float* ds = d + m * (k / 32);  // then ds, then dsh
    float* dsh = ds + m * (k / 32);
    int32_t* off4 = offsets ? buffer_for(o_scratch, o_keep, m * (k / 32) * 3, at::kInt) : nullptr;
    int32_t* off6 = offsets ? off4 + m * (k / 32) : nullptr;
    const int64_t grain = std::max<int64_t>(1, kQuantizeValues / k);
    kvp::parallel_for(0, m, grain, [&](int64_t begin, int64_t end) {
      // bf16 activations without a float32 copy: widened grain rows at a time (rows are
      // quantized independently, so any split gives the same blocks)
      static thread_local std::vector<float> widened;
      for (int64_t r = begin; r < end; r += grain) {
        const int64_t n = std::min(grain, end - r);
        const float* xr = xp ? xp + r * k : nullptr;
        if (!xr) {
          widened.resize(n * k);
          for (int64_t i = 0; i < n * k; ++i) widened[i] = static_cast<float>(x16p[r * k + i]);
          xr = widened.data();
        }
        t->quantize_rows(xr, n, k, q + r * ldq, ldq, d + r * (k / 32), ds + r * (k / 32),
                         dsh + r * (k / 16));
        if (offsets)
          t->offsets_into_sums(q + r * ldq, n, k, ldq, off4 + r * (k / 32), off6 + r * (k / 16));
      }
    });
    act = {q, d, ds, dsh, off4, off6, k, ldq};
  }

  // Work items: each float tile (dequantized once, then multiplied with every row), then
  // each integer tile for each block of activation rows (a block's rows stay in cache
  // across its tiles). Packed parts' tiles are whole groups of 8 rows.
  struct Task { int part; int64_t row, rows; };
  std::vector<Task> float_tasks, int_tasks;
  for (size_t i = 0; i < parts.size(); ++i) {
    const bool integer = integer_for(parts[i]);
    const int64_t tile = integer                              ? kIntTile
                         : gemm_tiles && mode_of(parts[i]) != 0 ? gemm_tile_rows(parts[i].rows)
                                                                : kFloatTile;
    for (int64_t r = 0; r < parts[i].rows; r += tile)
      (integer ? int_tasks : float_tasks)
          .push_back({static_cast<int>(i), r, std::min(tile, parts[i].rows - r)});
  }
  const int64_t n_float = float_tasks.size(), n_int = int_tasks.size();
  const int64_t row_blocks = (m + kRowBlock - 1) / kRowBlock;
  const int64_t items = n_float + row_blocks * n_int;
  // Where an item's sums go: y's columns of it (row stride n_total), or for a bf16 y the
  // thread's tile (row stride its columns), which round_tile then rounds into y.
  auto target = [&](std::vector<float>& tile, int64_t row, int64_t col, int64_t rows,
                    int64_t cols) -> std::pair<float*, int64_t> {
    if (!bf16_out) return {yp + row * n_total + col, n_total};
    tile.resize(rows * cols);
    return {tile.data(), cols};
  };
  auto round_tile = [&](const std::vector<float>& tile, int64_t row, int64_t col, int64_t rows,
                        int64_t cols) {
    if (!bf16_out) return;
    for (int64_t r = 0; r < rows; ++r) {
      at::BFloat16* dst = y16 + (row + r) * n_total + col;
      const float* src = tile.data() + r * cols;
      for (int64_t c = 0; c < cols; ++c) dst[c] = static_cast<at::BFloat16>(src[c]);
    }
  };
  auto run_item = [&](int64_t i, std::vector<float>& buffer, std::vector<uint16_t>& buffer16,
                      std::vector<float>& tile) {
    if (i < n_float) {
      const Task& task = float_tasks[i];
      const Part& p = parts[task.part];
      const int64_t col = p.offset + task.row;
      const auto [out, ldo] = target(tile, 0, col, m, task.rows);
      const bool bf16_tiles = bf16_tiles_for(p);
      if (bf16_tiles) {  // the weights dequantized straight to bf16 (mode 2)
        buffer16.resize(task.rows * k);
        dequantize_part(t, p, task.row, task.rows, k, buffer16.data());
      } else {
        buffer.resize(task.rows * k);
        dequantize_part(t, p, task.row, task.rows, k, buffer.data());
      }
      if (gemm_tiles && mode_of(p) != 0) {
        // (not in int8 mode: it promises each row's result whatever the batch, and a part
        // without integer kernels (none of the types kept today) would keep that promise
        // with float_dot, whose order of sums is the same at every M; at::mm's is not)
        const kvp::OneThreadForLibraries one_thread;
        auto yt = at::from_blob(out, {m, task.rows}, {ldo, 1}, at::kFloat);
        if (bf16_tiles) {
          auto wt = at::from_blob(buffer16.data(), {task.rows, k}, at::kBFloat16);
          yt.copy_(at::mm(x16, wt.t()));
        } else {
          auto wt = at::from_blob(buffer.data(), {task.rows, k}, at::kFloat);
          auto xt = at::from_blob(const_cast<float*>(xp), {m, k}, at::kFloat);  // (no copy)
          at::mm_out(yt, xt, wt.t());
        }
      } else {
        t->float_dot(buffer.data(), k, task.rows, xp, m, k, out, ldo);
      }
      round_tile(tile, 0, col, m, task.rows);
      return;
    }
    const int64_t m0 = (i - n_float) / n_int * kRowBlock;
    const Task& task = int_tasks[(i - n_float) % n_int];
    const int64_t mb = std::min(kRowBlock, m - m0);
    const kvp::Q8Rows block{act.q + m0 * ldq, act.d + m0 * (k / 32), act.ds + m0 * (k / 32),
                            act.dsh + m0 * (k / 16),
                            act.off4 ? act.off4 + m0 * (k / 32) : nullptr,
                            act.off6 ? act.off6 + m0 * (k / 16) : nullptr, k, ldq};
    const Part& p = parts[task.part];
    const int64_t col = p.offset + task.row;
    const auto [out, ldo] = target(tile, m0, col, mb, task.rows);
    if (p.packed) {
      const int64_t group_bytes = kvp::group_bytes(p.type, k);
      t->packed_dot(p.type, p.raw + task.row / kvp::kGroup * group_bytes, group_bytes,
                    task.rows / kvp::kGroup, &block, mb, out, ldo, one_row, ahead);
    } else {
      t->int_dot(p.type, p.raw + task.row * p.row_bytes, p.row_bytes, task.rows, &block, mb, out,
                 ldo, grouped, ahead);
    }
    round_tile(tile, m0, col, mb, task.rows);
  };
  // Threads take runs of consecutive items from a shared counter until none are left,
  // not a fixed share each: a thread slowed by anything else on its core (a busy
  // neighbour, a hypervisor's other guests) takes fewer, and the step ends when the last
  // run does (fewer, longer runs where the weights stream from memory: kStreamRows).
  // Each output is computed by one item in a fixed order, so the results do not depend
  // on which thread took it.
  const int64_t threads = kvp::in_parallel_region() ? 1 : kvp::num_threads();
  const int64_t runs_per_thread = m <= kStreamRows ? kStreamRuns : kRunsPerThread;
  const int64_t run = std::max<int64_t>(1, items / (threads * runs_per_thread));
  const int64_t workers = std::min(threads, (items + run - 1) / run);
  std::atomic<int64_t> next{0};
  kvp::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    std::vector<float> buffer;
    std::vector<uint16_t> buffer16;  // (bf16 bits)
    // an item's sums for a bf16 y: 8 KiB for an integer item, M x 64 floats for a float one
    static thread_local std::vector<float> tile;
    for (int64_t begin; (begin = next.fetch_add(run)) < items;)
      for (int64_t i = begin; i < std::min(items, begin + run); ++i)
        run_item(i, buffer, buffer16, tile);
  });
  return y;
}
