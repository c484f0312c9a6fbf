// A layer's mixture of experts (see decode_layers.h): routing in plain loops, each expert's
// products through quant_matmul, the weighted sum accumulated in float32. torch runs the
// same as a dozen small kernels per expert, whose fixed costs were a fifth of a batch-1
// step of a 48-layer model (docs/performance.md, "twenty-third session").

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <utility>
#include <vector>

#include "decode_layers.h"
#include "native_ops.h"
#include "parallel.h"

namespace kvp {

namespace {

// The dot product of a and b, in float32, in an order that depends on n alone: eight
// running sums (lanes the compiler may vectorize: no reassociation), added pairwise. A
// token's routing is then the same whatever else is in the step (at::linear's order
// changes with the number of rows), as a batch-invariant model needs.
float dot(const float* a, const float* b, int64_t n) {
  float lane[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int j = 0; j < 8; ++j) lane[j] += a[i + j] * b[i + j];
  for (int j = 0; i < n; ++i, ++j) lane[j] += a[i] * b[i];
  return ((lane[0] + lane[4]) + (lane[2] + lane[6])) + ((lane[1] + lane[5]) + (lane[3] + lane[7]));
}

}  // namespace

MixtureOfExperts::MixtureOfExperts(const at::Tensor& router, std::vector<LayerProduct> gate_up,
                                   std::vector<LayerProduct> down, int64_t used)
    : router_(router), gate_up_(std::move(gate_up)), down_(std::move(down)), used_(used) {
  TORCH_CHECK(router.scalar_type() == at::kFloat && router.dim() == 2 && router.is_contiguous(),
              "router: contiguous [experts, hidden] float32");
  const auto experts = static_cast<size_t>(router.size(0));
  TORCH_CHECK(gate_up_.size() == experts && down_.size() == experts,
              "one gate_up and one down product per expert");
  TORCH_CHECK(used > 0 && used <= router.size(0), "experts used: 1 .. experts");
  for (const auto* products : {&gate_up_, &down_})
    for (const auto& p : *products)
      TORCH_CHECK(!p.parts.empty() && p.parts.size() == p.types.size() && !p.bias.defined(),
                  "an expert's product: quantized parts, one type each, no bias");
}

at::Tensor MixtureOfExperts::run(const at::Tensor& h, int64_t mode, int64_t int8_max_rows,
                                 const std::string& variant) const {
  TORCH_CHECK(h.dim() == 2 && h.is_contiguous() && h.size(1) == router_.size(1),
              "h: contiguous [tokens, hidden]");
  const int64_t tokens = h.size(0), hidden = h.size(1), experts = router_.size(0);
  const int64_t k = used_;
  // Routing, per token: the router's logits (float32), the k experts of the highest
  // logits (of the highest softmax probabilities: the same order; ties to the lower
  // index; a NaN counts lowest, so the order stays a strict one) and their weights, the
  // softmax renormalized over those k: exp(l_i - l_max) / sum over the k of
  // exp(l_j - l_max).
  const at::Tensor hf = h.to(at::kFloat).contiguous();
  const float* hp = hf.data_ptr<float>();
  const float* router = router_.data_ptr<float>();
  std::vector<int64_t> chosen(tokens * k);
  std::vector<float> weight(tokens * k);
  // tokens by the grain of ~2^18 multiply-adds each (a thread's start costs microseconds)
  const int64_t grain = std::max<int64_t>(1, (1 << 18) / std::max<int64_t>(1, experts * hidden));
  kvp::parallel_for(0, tokens, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> l(experts);
    std::vector<int64_t> order(experts);
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t e = 0; e < experts; ++e) {
        l[e] = dot(hp + t * hidden, router + e * hidden, hidden);
        if (std::isnan(l[e])) l[e] = -std::numeric_limits<float>::infinity();
      }
      std::iota(order.begin(), order.end(), 0);
      std::partial_sort(order.begin(), order.begin() + k, order.end(), [&l](int64_t a, int64_t b) {
        return l[a] > l[b] || (l[a] == l[b] && a < b);
      });
      float sum = 0.0f;
      for (int64_t j = 0; j < k; ++j) {
        weight[t * k + j] = std::exp(l[order[j]] - l[order[0]]);
        sum += weight[t * k + j];
        chosen[t * k + j] = order[j];
      }
      for (int64_t j = 0; j < k; ++j) weight[t * k + j] /= sum;
    }
  });
  // The tokens of each expert, in ascending order (a counting sort).
  std::vector<int64_t> start(experts + 1, 0);
  for (int64_t e : chosen) ++start[e + 1];
  for (int64_t e = 0; e < experts; ++e) start[e + 1] += start[e];
  std::vector<int64_t> routed(tokens * k);  // t * k + j, grouped by expert
  {
    std::vector<int64_t> next(start.begin(), start.end() - 1);
    for (int64_t i = 0; i < tokens * k; ++i) routed[next[chosen[i]]++] = i;
  }
  // Each expert's rows through its products, ascending by expert; each token's sum adds
  // its experts in that order, in float32 (the down product's float32 output unrounded).
  at::Tensor out = at::zeros({tokens, hidden}, h.options().dtype(at::kFloat));
  float* acc = out.data_ptr<float>();
  for (int64_t e = 0; e < experts; ++e) {
    const int64_t n = start[e + 1] - start[e];
    if (n == 0) continue;
    const int64_t* picks = routed.data() + start[e];
    at::Tensor x = h;
    if (tokens > 1) {
      at::Tensor rows = at::empty({n}, at::kLong);
      for (int64_t r = 0; r < n; ++r) rows.data_ptr<int64_t>()[r] = picks[r] / k;
      x = h.index_select(0, rows);
    }
    // QuantLinear's mode for this expert's rows (ProductPolicy.mode of n rows; bits 4-5,
    // the single row's kernel, kept)
    const bool int8 = (mode & 15) != 0 && int8_max_rows >= 0 && n <= int8_max_rows;
    const int64_t m = int8 ? mode & ~int64_t{15} : mode;
    const LayerProduct& gu = gate_up_[e];
    const LayerProduct& dn = down_[e];
    const at::Tensor g = silu_mul(quant_matmul(x, gu.parts, gu.types, m, variant, true), "");
    const at::Tensor y = quant_matmul(g, dn.parts, dn.types, m, variant, false).contiguous();
    const float* yr = y.data_ptr<float>();
    for (int64_t r = 0; r < n; ++r) {
      const float w = weight[picks[r]];
      float* o = acc + (picks[r] / k) * hidden;
      const float* v = yr + r * hidden;
      for (int64_t d = 0; d < hidden; ++d) o[d] += w * v[d];
    }
  }
  return out.to(h.scalar_type());
}

}  // namespace kvp
