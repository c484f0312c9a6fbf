// Products with weights kept in GGUF's quantized blocks: the torch-facing ops, and the
// choice of kernels by what the CPU has, made at run time (the module is built once for
// the architecture, not for the machine that built it).
//
// quant_matmul(x [M, K], parts, ...) computes x W^T for W the rows of every part stacked
// (a fused QKV or gate/up of parts that may differ in format): float32 [M, sum of rows].
//   mode 0: integer products where the kernels have them for a part's format
//           (activations quantized to int8 per block of 32, as llama.cpp does);
//   mode 1: float products: weights dequantized (in tiles, per thread) and multiplied
//           with the float32 activations: what dequantizing the file and multiplying
//           in float32 gives, up to the order of the sums (the exact reference);
//   mode 2: as 1, the tiles and activations rounded to bfloat16 for the product (for
//           large steps on CPUs with bf16 products in hardware).
// Work is split over tiles of weight rows; each thread dequantizes or unpacks only its
// own rows, so no dequantized copy of a matrix ever exists.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cstring>
#include <string>
#include <vector>

#include "quant_blocks.h"
#include "isa_select.h"
#include "quant_kernels.h"

namespace {

using kvp::QuantKernels;

const QuantKernels* table(const std::string& isa) { return kvp::variant(isa).quant; }

struct Part {
  const uint8_t* raw;
  int64_t rows, row_bytes, offset;  // offset: first output column
  int type;
};

std::vector<Part> check_parts(const std::vector<at::Tensor>& parts, const std::vector<int64_t>& types,
                              int64_t k) {
  TORCH_CHECK(!parts.empty() && parts.size() == types.size(), "one type per part");
  std::vector<Part> out;
  int64_t offset = 0;
  for (size_t i = 0; i < parts.size(); ++i) {
    const auto& p = parts[i];
    const int t = static_cast<int>(types[i]);
    TORCH_CHECK(kvp::known_type(t) && t != kvp::kF32 && t != kvp::kF16 && t != kvp::kBF16,
                "part ", i, ": unsupported ggml type ", t);
    TORCH_CHECK(k % kvp::block_elems(t) == 0 && k % 32 == 0, "part ", i, ": K=", k,
                " is not a whole number of blocks");
    const int64_t row_bytes = k / kvp::block_elems(t) * kvp::block_bytes(t);
    TORCH_CHECK(p.dim() == 2 && p.scalar_type() == at::kByte && p.is_contiguous() && p.size(1) == row_bytes,
                "part ", i, ": a contiguous uint8 [rows, ", row_bytes, "] tensor of its blocks");
    out.push_back({p.data_ptr<uint8_t>(), p.size(0), row_bytes, offset, t});
    offset += p.size(0);
  }
  return out;
}

constexpr int64_t kIntTile = 16;     // weight rows per task, integer products
constexpr int64_t kFloatTile = 64;   // weight rows per task, float products (dequantized)
constexpr int64_t kRowBlock = 128;   // activation rows per pass (they stay in cache)
constexpr int64_t kGemmRows = 16;    // from this many activation rows, float tiles use at::mm

}  // namespace

std::vector<std::string> kernel_variants() {
  std::vector<std::string> names;
  for (const auto& v : kvp::cpu_variants()) names.push_back(v.name);
  return names;
}

at::Tensor quant_dequantize(const at::Tensor& raw, int64_t qtype, int64_t k, const std::string& isa) {
  const auto parts = check_parts({raw}, {qtype}, k);
  auto out = at::empty({raw.size(0), k}, at::kFloat);
  const QuantKernels* t = table(isa);
  float* o = out.data_ptr<float>();
  at::parallel_for(0, raw.size(0), 64, [&](int64_t begin, int64_t end) {
    t->dequantize_rows(parts[0].type, parts[0].raw + begin * parts[0].row_bytes, parts[0].row_bytes,
                       end - begin, k, o + begin * k);
  });
  return out;
}

at::Tensor quant_matmul(const at::Tensor& x_in, const std::vector<at::Tensor>& parts_in,
                        const std::vector<int64_t>& types, int64_t mode, const std::string& isa) {
  TORCH_CHECK(x_in.dim() == 2, "x: [rows, K]");
  TORCH_CHECK(x_in.scalar_type() == at::kFloat || x_in.scalar_type() == at::kBFloat16,
              "x: float32 or bfloat16");
  TORCH_CHECK(mode >= 0 && mode <= 2, "mode: 0 (integer), 1 (float) or 2 (bf16 tiles)");
  const int64_t m = x_in.size(0), k = x_in.size(1);
  const auto parts = check_parts(parts_in, types, k);
  const int64_t n_total = parts.back().offset + parts.back().rows;
  const QuantKernels* t = table(isa);
  const auto x = x_in.to(at::kFloat).contiguous();
  const bool bf16_tiles = mode == 2 && x.size(0) >= kGemmRows;
  const auto x16 = bf16_tiles ? x_in.to(at::kBFloat16).contiguous() : at::Tensor();
  auto y = at::empty({m, n_total}, x.options());
  if (m == 0) return y;
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();

  bool any_int = false;
  for (const auto& p : parts) any_int |= mode == 0 && t->has_int_dot(p.type);
  at::Tensor q8, q8d, q8ds;
  kvp::Q8Rows act{nullptr, nullptr, nullptr, k};
  if (any_int) {
    q8 = at::empty({m, k}, at::kChar);
    q8d = at::empty({m, k / 32}, at::kFloat);
    q8ds = at::empty({m, k / 32}, at::kFloat);
    int8_t* q = q8.data_ptr<int8_t>();
    float* d = q8d.data_ptr<float>();
    float* ds = q8ds.data_ptr<float>();
    at::parallel_for(0, m, 64, [&](int64_t begin, int64_t end) {
      t->quantize_rows(xp + begin * k, end - begin, k, q + begin * k, d + begin * (k / 32),
                       ds + begin * (k / 32));
    });
    act = {q, d, ds, k};
  }

  // Tasks: (part, first row, rows), integer tiles and float tiles apart.
  struct Task { int part; int64_t row, rows; bool integer; };
  std::vector<Task> tasks;
  for (size_t i = 0; i < parts.size(); ++i) {
    const bool integer = mode == 0 && t->has_int_dot(parts[i].type);
    const int64_t tile = integer ? kIntTile : kFloatTile;
    for (int64_t r = 0; r < parts[i].rows; r += tile)
      tasks.push_back({static_cast<int>(i), r, std::min(tile, parts[i].rows - r), integer});
  }
  at::parallel_for(0, static_cast<int64_t>(tasks.size()), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> buffer;
    for (int64_t i = begin; i < end; ++i) {  // float tiles: dequantized once, all rows
      const Task& task = tasks[i];
      if (task.integer) continue;
      const Part& p = parts[task.part];
      buffer.resize(task.rows * k);
      t->dequantize_rows(p.type, p.raw + task.row * p.row_bytes, p.row_bytes, task.rows, k,
                         buffer.data());
      float* out = yp + p.offset + task.row;
      if (bf16_tiles) {
        auto wt = at::from_blob(buffer.data(), {task.rows, k}, at::kFloat).to(at::kBFloat16);
        auto yt = at::from_blob(out, {m, task.rows}, {n_total, 1}, at::kFloat);
        yt.copy_(at::mm(x16, wt.t()));
      } else if (m >= kGemmRows) {
        auto wt = at::from_blob(buffer.data(), {task.rows, k}, at::kFloat);
        auto xt = at::from_blob(const_cast<float*>(xp), {m, k}, at::kFloat);
        auto yt = at::from_blob(out, {m, task.rows}, {n_total, 1}, at::kFloat);
        at::mm_out(yt, xt, wt.t());
      } else {
        t->float_dot(buffer.data(), k, task.rows, xp, m, k, out, n_total);
      }
    }
    // integer tiles: activation rows in blocks that stay in cache across the tiles
    for (int64_t m0 = 0; m0 < m; m0 += kRowBlock) {
      const int64_t mb = std::min(kRowBlock, m - m0);
      const kvp::Q8Rows block{act.q + m0 * k, act.d + m0 * (k / 32), act.ds + m0 * (k / 32), k};
      for (int64_t i = begin; i < end; ++i) {
        const Task& task = tasks[i];
        if (!task.integer) continue;
        const Part& p = parts[task.part];
        t->int_dot(p.type, p.raw + task.row * p.row_bytes, p.row_bytes, task.rows, &block, mb,
                   yp + m0 * n_total + p.offset + task.row, n_total);
      }
    }
  });
  return y;
}
