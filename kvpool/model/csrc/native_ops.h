// The torch-facing native ops, defined in their own files (fused_ops.cpp, quant_ops.cpp,
// paged_decode_attention.cpp, argmax_rows.cpp): what bindings.cpp exposes to Python and
// DecodeLayers (decode_layers.cpp) calls directly.

#pragma once

#include <ATen/ATen.h>

#include <string>
#include <vector>

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& layer_kv,
                                  const at::Tensor& block_tables, const at::Tensor& context_lens,
                                  int64_t block_size, double scale, const std::string& variant,
                                  int64_t window = 0);
at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& layer_kv,
                           const at::Tensor& block_tables, const at::Tensor& context_lens,
                           const at::Tensor& query_start, int64_t block_size, double scale,
                           const std::string& variant, int64_t window = 0);
at::Tensor add_rms_norm_(at::Tensor& x, const c10::optional<at::Tensor>& y, const at::Tensor& weight,
                         double eps, const std::string& variant);
at::Tensor rope_write_kv(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin_signed,
                         at::Tensor& layer_kv, const at::Tensor& slots, int64_t num_heads,
                         const std::string& variant);
at::Tensor head_rms_norm(const at::Tensor& qkv, const at::Tensor& q_weight,
                         const at::Tensor& k_weight, int64_t num_heads, int64_t num_kv_heads,
                         double eps, const std::string& variant);
at::Tensor silu_mul(const at::Tensor& gate_up, const std::string& variant);
at::Tensor argmax_rows(const at::Tensor& x);
std::vector<std::string> kernel_variants(bool built);
at::Tensor quant_dequantize(const at::Tensor& raw, int64_t qtype, int64_t k, const std::string& isa,
                            const c10::optional<at::Tensor>& rows, bool bf16);
at::Tensor quant_pack(const at::Tensor& raw, int64_t qtype, const c10::optional<at::Tensor>& into);
int64_t quant_packed_bytes(int64_t qtype, int64_t rows, int64_t k);
bool quant_packs(int64_t qtype, const std::string& isa);
void set_iq_grids(const std::vector<at::Tensor>& grids);
bool quant_has_int_dot(int64_t qtype, const std::string& isa);
at::Tensor quant_matmul(const at::Tensor& x, const std::vector<at::Tensor>& parts,
                        const std::vector<int64_t>& types, int64_t mode, const std::string& isa,
                        bool same_dtype);
