// The Python module of the native ops (kvpool.model.native builds it).

#include <torch/extension.h>

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& layer_kv,
                                  const at::Tensor& block_tables, const at::Tensor& context_lens,
                                  int64_t block_size, double scale);
at::Tensor add_rms_norm_(at::Tensor& x, const c10::optional<at::Tensor>& y, const at::Tensor& weight,
                         double eps);
at::Tensor rope_write_kv(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin_signed,
                         at::Tensor& layer_kv, const at::Tensor& slots, int64_t num_heads);
at::Tensor q8_0_matvec(const at::Tensor& x, const at::Tensor& raw);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention,
        "decode attention over a paged KV store (one query token per sequence)");
  m.def("add_rms_norm_", &add_rms_norm_,
        "x += y in place (y optional), then RMSNorm of x times weight, returned");
  m.def("rope_write_kv", &rope_write_kv,
        "rotary embedding of Q and K, K and V written to the store's slots; returns Q");
  m.def("q8_0_matvec", &q8_0_matvec,
        "x [rows <= 8, K] times a Q8_0 matrix [N, K] transposed, float32 [rows, N]");
}
