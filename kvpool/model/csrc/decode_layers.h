// A model's layers for decode steps in one native call (decode_layers.cpp).

#pragma once

#include <ATen/ATen.h>

#include <memory>
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

// A layer's mixture of experts (qwen3moe; mixture_of_experts.cpp), whose products are all
// quantized: each token's `used` experts of the highest router logits (router: [experts,
// hidden] float32), weighted by the softmax of those logits, through their gate_up and
// down products. LlamaModel._mixture calls run() for a bf16 model, DecodeLayers the same.
class MixtureOfExperts {
 public:
  MixtureOfExperts(const at::Tensor& router, std::vector<LayerProduct> gate_up,
                   std::vector<LayerProduct> down, int64_t used);

  // h [tokens, hidden] -> [tokens, hidden] in h's dtype. mode: quant_matmul's for the
  // step; where it is not int8, an expert's product of at most int8_max_rows rows is int8
  // all the same (ProductPolicy.mode of its own rows; -1: no such rows).
  at::Tensor run(const at::Tensor& h, int64_t mode, int64_t int8_max_rows,
                 const std::string& variant) const;

 private:
  at::Tensor router_;
  std::vector<LayerProduct> gate_up_, down_;
  int64_t used_;
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

  // A layer whose feed-forward is a mixture of experts (qwen3moe): products qkv and o,
  // and the model's own MixtureOfExperts for the layer (shared, not copied).
  void add_moe_layer(const at::Tensor& attn_norm, const at::Tensor& ffn_norm,
                     std::vector<LayerProduct> products, const at::Tensor& q_norm,
                     const at::Tensor& k_norm, std::shared_ptr<const MixtureOfExperts> experts);

  // Gemma 3's parts of the last layer added: RMSNorms of attention's output and of the
  // feed-forward's (both or neither), its sliding window (0: none) and rotation (local:
  // run()'s local_cos / local_sin), and a gelu (tanh form) gate in place of silu.
  void shape_last_layer(const at::Tensor& post_attn_norm, const at::Tensor& post_ffn_norm,
                        int64_t window, bool local_rope, bool gelu);

  // x [B, hidden] bf16: the step's embedded tokens (its own tensor: updated in place).
  // Returns the residual stream after the last layer ([B, hidden]). mode: quant_matmul's;
  // heavy_threads > 0: products (and the attention with heavy_attention) on that many
  // threads and the rest on one, as LlamaModel._heavy runs them. variant: the products'
  // and the attention's kernels ("": the fastest); the row ops take the fastest.
  // query_start ([B + 1], 0 .. B): the attention is paged_attention's (a store in
  // another dtype, a batch-invariant model), else paged_decode_attention's.
  // int8_max_rows: MixtureOfExperts::run's.
  at::Tensor run(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin_signed,
                 const at::Tensor& slots, const at::Tensor& block_tables,
                 const at::Tensor& context_lens, const std::vector<at::Tensor>& kv_layers,
                 int64_t block_size, int64_t mode, int64_t heavy_threads,
                 bool heavy_attention, const std::string& variant,
                 const c10::optional<at::Tensor>& query_start,
                 int64_t int8_max_rows = -1,
                 const c10::optional<at::Tensor>& local_cos = c10::nullopt,
                 const c10::optional<at::Tensor>& local_sin = c10::nullopt) const;

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

 private:
  struct Layer {
    at::Tensor attn_norm, ffn_norm, q_norm, k_norm;
    LayerProduct qkv, o, gate_up, down;
    std::shared_ptr<const MixtureOfExperts> experts;  // in place of gate_up and down
    at::Tensor post_attn_norm, post_ffn_norm;  // gemma3 (shape_last_layer)
    int64_t window = 0;
    bool local_rope = false, gelu = false;
  };
  int64_t num_heads_;
  double eps_, scale_;
  std::vector<Layer> layers_;
};

}  // namespace kvp
