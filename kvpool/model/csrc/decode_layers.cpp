// A model's layers for decode steps in one native call (see decode_layers.h). Each op is
// the one LlamaModel._layers calls through Python (fused_ops.cpp, quant_ops.cpp,
// paged_decode_attention.cpp), with the same arguments: the row ops with the fastest
// kernels (""), the products and the attention with the policy's variant.

#include "decode_layers.h"

#include <ATen/Parallel.h>

#include <utility>

#include "native_ops.h"

namespace kvp {

namespace {

// Runs f on `threads` threads and puts the calling thread back to one after (also when f
// throws), as LlamaModel._heavy does; threads == 0: on the threads as they are.
template <class F>
auto on_threads(int64_t threads, F&& f) {
  if (threads <= 0) return f();
  struct Restore {
    ~Restore() { at::set_num_threads(1); }
  } restore;
  at::set_num_threads(static_cast<int>(threads));
  return f();
}

// A layer's products and norms as add_layer and add_moe_layer take them.
void check_layer(const std::vector<LayerProduct>& products, size_t count, const char* names,
                 const at::Tensor& q_norm, const at::Tensor& k_norm) {
  TORCH_CHECK(products.size() == count, "a layer's products: ", names);
  for (const auto& p : products)
    TORCH_CHECK(!p.parts.empty() && p.parts.size() == p.types.size(), "one type per part");
  TORCH_CHECK(q_norm.defined() == k_norm.defined(), "q_norm and k_norm: both or neither");
}

}  // namespace

void DecodeLayers::add_layer(const at::Tensor& attn_norm, const at::Tensor& ffn_norm,
                             std::vector<LayerProduct> products, const at::Tensor& q_norm,
                             const at::Tensor& k_norm) {
  check_layer(products, 4, "qkv, o, gate_up, down", q_norm, k_norm);
  layers_.push_back({attn_norm, ffn_norm, q_norm, k_norm, std::move(products[0]),
                     std::move(products[1]), std::move(products[2]), std::move(products[3])});
}

void DecodeLayers::add_moe_layer(const at::Tensor& attn_norm, const at::Tensor& ffn_norm,
                                 std::vector<LayerProduct> products, const at::Tensor& q_norm,
                                 const at::Tensor& k_norm,
                                 std::shared_ptr<const MixtureOfExperts> experts) {
  check_layer(products, 2, "qkv, o (a mixture of experts in place of gate_up, down)", q_norm,
              k_norm);
  TORCH_CHECK(experts != nullptr, "experts: a MixtureOfExperts");
  layers_.push_back({attn_norm, ffn_norm, q_norm, k_norm, std::move(products[0]),
                     std::move(products[1]), {}, {}, std::move(experts)});
}

void DecodeLayers::shape_last_layer(const at::Tensor& post_attn_norm,
                                    const at::Tensor& post_ffn_norm, int64_t window,
                                    bool local_rope, bool gelu) {
  TORCH_CHECK(!layers_.empty(), "no layer to shape");
  TORCH_CHECK(post_attn_norm.defined() == post_ffn_norm.defined(),
              "post_attn_norm and post_ffn_norm: both or neither");
  TORCH_CHECK(window >= 0, "a window of 0 (none) or more keys");
  Layer& layer = layers_.back();
  TORCH_CHECK(!gelu || !layer.experts, "a gelu gate is a dense feed-forward's");
  layer.post_attn_norm = post_attn_norm;
  layer.post_ffn_norm = post_ffn_norm;
  layer.window = window;
  layer.local_rope = local_rope;
  layer.gelu = gelu;
}

at::Tensor DecodeLayers::run(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin_signed,
                             const at::Tensor& slots, const at::Tensor& block_tables,
                             const at::Tensor& context_lens,
                             const std::vector<at::Tensor>& kv_layers, int64_t block_size,
                             int64_t mode, int64_t heavy_threads, bool heavy_attention,
                             const std::string& variant,
                             const c10::optional<at::Tensor>& query_start,
                             int64_t int8_max_rows,
                             const c10::optional<at::Tensor>& local_cos,
                             const c10::optional<at::Tensor>& local_sin) const {
  TORCH_CHECK(!layers_.empty(), "no layers");
  TORCH_CHECK(kv_layers.size() == layers_.size(), "one KV store layer per layer");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.dim() == 2 && x.is_contiguous(),
              "x: contiguous [tokens, hidden] bfloat16");
  for (const Layer& layer : layers_)
    TORCH_CHECK(!layer.local_rope || (local_cos.has_value() && local_sin.has_value()),
                "a local layer's rotation: local_cos and local_sin");
  const std::string row_kernels;  // the row ops' kernels: the fastest, as the Python path
  auto product = [&](const LayerProduct& p, const at::Tensor& in) {
    auto y = on_threads(heavy_threads,
                        [&] { return quant_matmul(in, p.parts, p.types, mode, variant, true); });
    return p.bias.defined() ? at::add(y, p.bias) : y;
  };
  at::Tensor h = add_rms_norm_(x, c10::nullopt, layers_[0].attn_norm, eps_, row_kernels);
  for (size_t i = 0; i < layers_.size(); ++i) {
    const Layer& layer = layers_[i];
    at::Tensor layer_kv = kv_layers[i];
    at::Tensor qkv = product(layer.qkv, h);
    if (layer.q_norm.defined()) {
      const int64_t kv_heads = layer_kv.size(0) / 2;
      qkv = head_rms_norm(qkv, layer.q_norm, layer.k_norm, num_heads_, kv_heads, eps_, row_kernels);
    }
    const at::Tensor& c = layer.local_rope ? *local_cos : cos;
    const at::Tensor& s = layer.local_rope ? *local_sin : sin_signed;
    const at::Tensor q = rope_write_kv(qkv, c, s, layer_kv, slots, num_heads_, row_kernels);
    const at::Tensor out = on_threads(heavy_attention ? heavy_threads : 0, [&] {
      if (query_start.has_value())
        return paged_attention(q, layer_kv, block_tables, context_lens, *query_start, block_size,
                               scale_, variant, layer.window);
      return paged_decode_attention(q, layer_kv, block_tables, context_lens, block_size, scale_,
                                    variant, layer.window);
    });
    at::Tensor attended = product(layer.o, out);
    if (layer.post_attn_norm.defined())
      attended = add_rms_norm_(attended, c10::nullopt, layer.post_attn_norm, eps_, row_kernels);
    h = add_rms_norm_(x, attended, layer.ffn_norm, eps_, row_kernels);
    at::Tensor y;
    if (layer.experts) {
      y = on_threads(heavy_threads,
                     [&] { return layer.experts->run(h, mode, int8_max_rows, variant); });
    } else if (layer.gelu) {  // LlamaModel._feed_forward's torch ops
      const auto gate_up = product(layer.gate_up, h).chunk(2, -1);
      y = product(layer.down, at::mul(at::gelu(gate_up[0], "tanh"), gate_up[1]));
    } else {
      y = product(layer.down, silu_mul(product(layer.gate_up, h), row_kernels));
    }
    if (layer.post_ffn_norm.defined())
      y = add_rms_norm_(y, c10::nullopt, layer.post_ffn_norm, eps_, row_kernels);
    if (i + 1 < layers_.size())
      h = add_rms_norm_(x, y, layers_[i + 1].attn_norm, eps_, row_kernels);
    else
      x = at::add(x, y);
  }
  return x;
}

}  // namespace kvp
