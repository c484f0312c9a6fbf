// A model's layers for decode steps in one native call (decode_layers.cpp).

#pragma once

#include <ATen/ATen.h>

#include <string>
#include <vector>

namespace kvp {

// One of a layer's matrix products: the quantized parts quant_matmul multiplies (a fused
// QKV or gate/up), their types, and a bias or an undefined tensor.
struct LayerProduct {
  std::vector<at::Tensor> parts;
  std::vector<int64_t> types;
  at::Tensor bias;
};

// The layers of a LLaMA-family model whose products are all quantized (QuantLinear), for
// steps in which every sequence brings one token and attends through the native decode
// attention. run() does what LlamaModel._layers (the loop over layers) does for such a step,
// op for op: the same native ops (called here, not through Python), in the same order,
// on the same threads, so its results are the loop's bit for bit. What it saves is the
// loop's Python and the calls' conversions: ten calls a layer, ~1 ms of a 7 ms batch-1
// step of a 30-layer model.
class DecodeLayers {
 public:
  DecodeLayers(int64_t num_heads, double eps, double scale)
      : num_heads_(num_heads), eps_(eps), scale_(scale) {}

  // products: qkv, o, gate_up, down. q_norm, k_norm: per-head RMSNorm weights applied to
  // Q and K after the qkv product (qwen3), or both undefined.
  void add_layer(const at::Tensor& attn_norm, const at::Tensor& ffn_norm,
                 std::vector<LayerProduct> products, const at::Tensor& q_norm = at::Tensor(),
                 const at::Tensor& k_norm = at::Tensor());

  // x [B, hidden] bf16: the step's embedded tokens (its own tensor: updated in place).
  // Returns the residual stream after the last layer ([B, hidden]). mode: quant_matmul's;
  // heavy_threads > 0: products (and the attention with heavy_attention) on that many
  // threads and the rest on one, as LlamaModel._heavy runs them. variant: the products'
  // and the attention's kernels ("": the fastest); the row ops take the fastest.
  // query_start ([B + 1], 0 .. B): the attention is paged_attention's (a store in
  // another dtype, a batch-invariant model), else paged_decode_attention's.
  at::Tensor run(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin_signed,
                 const at::Tensor& slots, const at::Tensor& block_tables,
                 const at::Tensor& context_lens, const std::vector<at::Tensor>& kv_layers,
                 int64_t block_size, int64_t mode, int64_t heavy_threads,
                 bool heavy_attention, const std::string& variant,
                 const c10::optional<at::Tensor>& query_start) const;

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

 private:
  struct Layer {
    at::Tensor attn_norm, ffn_norm, q_norm, k_norm;
    LayerProduct qkv, o, gate_up, down;
  };
  int64_t num_heads_;
  double eps_, scale_;
  std::vector<Layer> layers_;
};

}  // namespace kvp
