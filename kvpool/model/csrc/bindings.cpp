// The Python module of the native ops (kvpool.model.native builds it).

#include <torch/extension.h>

#include <string>
#include <thread>
#include <tuple>

#include "decode_layers.h"
#include "float_control.h"
#include "native_ops.h"
#include "parallel.h"

namespace {

// A product as Python passes it: (parts, types, bias or None).
using Product = std::tuple<std::vector<at::Tensor>, std::vector<int64_t>, c10::optional<at::Tensor>>;

std::vector<kvp::LayerProduct> layer_products(const std::vector<Product>& products) {
  std::vector<kvp::LayerProduct> ps;
  for (const auto& [parts, types, bias] : products)
    ps.push_back({parts, types, bias.has_value() ? *bias : at::Tensor()});
  return ps;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention,
        "decode attention over a paged KV store (one query token per sequence)", py::arg("q"),
        py::arg("layer_kv"), py::arg("block_tables"), py::arg("context_lens"),
        py::arg("block_size"), py::arg("scale"), py::arg("variant") = "", py::arg("window") = 0,
        py::call_guard<kvp::FlushDenormals>());
  m.def("paged_attention", &paged_attention,
        "attention of any number of new tokens per sequence over a paged KV store of any "
        "element type (float32, bfloat16, float16, int8 with a scale per row)", py::arg("q"),
        py::arg("layer_kv"), py::arg("block_tables"), py::arg("context_lens"),
        py::arg("query_start"), py::arg("block_size"), py::arg("scale"),
        py::arg("variant") = "", py::arg("window") = 0,
        py::call_guard<kvp::FlushDenormals>());
  m.def("add_rms_norm_", &add_rms_norm_,
        "x += y in place (y optional), then RMSNorm of x times weight, returned", py::arg("x"),
        py::arg("y"), py::arg("weight"), py::arg("eps"), py::arg("variant") = "",
        py::call_guard<kvp::FlushDenormals>());
  m.def("rope_write_kv", &rope_write_kv,
        "rotary embedding of Q and K, K and V written to the store's slots; returns Q",
        py::arg("qkv"), py::arg("cos"), py::arg("sin_signed"), py::arg("layer_kv"),
        py::arg("slots"), py::arg("num_heads"), py::arg("variant") = "",
        py::call_guard<kvp::FlushDenormals>());
  m.def("head_rms_norm", &head_rms_norm,
        "qkv rows with each Q head normed by q_weight and each K head by k_weight (RMSNorm "
        "over head_dim, as qwen3's), V as it was; a new tensor", py::arg("qkv"),
        py::arg("q_weight"), py::arg("k_weight"), py::arg("num_heads"), py::arg("num_kv_heads"),
        py::arg("eps"), py::arg("variant") = "",
        py::call_guard<kvp::FlushDenormals>());
  m.def("silu_mul", &silu_mul,
        "silu(gate) * up of each row [gate | up], rounded where torch's F.silu(gate) * up "
        "rounds (exp: the kernels' own, within 2 float32 ulps)", py::arg("gate_up"),
        py::arg("variant") = "",
        py::call_guard<kvp::FlushDenormals>());
  m.def("argmax_rows", &argmax_rows,
        "each row's argmax as torch.argmax(x, -1) gives it (first index; NaN counts highest)");
  m.def("kernel_variants", &kernel_variants,
        "the kernel variants this CPU runs, fastest first (built=True: every one this build "
        "compiled, whatever the CPU)", py::arg("built") = false);
  m.def("threads_from", [] { return kvp::kOpenMP ? std::string("openmp") : std::string("own pool"); },
        "whose threads the ops share their work among: torch's OpenMP pool, or kvp's own "
        "(a build without OpenMP)");
  m.def("parallel_chunks", [](int64_t begin, int64_t end, int64_t grain) {
    std::vector<std::tuple<int64_t, int64_t, bool, int64_t>> chunks(end > begin ? end - begin : 0);
    kvp::parallel_for(begin, end, grain, [&](int64_t from, int64_t to) {
      const bool nested = kvp::in_parallel_region();
      for (int64_t i = from; i < to; ++i) {
        auto& [f, t, n, visits] = chunks[i - begin];
        f = from, t = to, n = nested, ++visits;
      }
    });
    return chunks;
  }, "for tests: each index of a parallel_for's chunk (from, to, in a parallel region) and "
     "how many times it was passed");
  m.def("parallel_raises", [](int64_t n, int64_t bad) {
    kvp::parallel_for(0, n, 1, [&](int64_t from, int64_t to) {
      TORCH_CHECK(!(from <= bad && bad < to), "index ", bad, " refused");
    });
  }, "for tests: a parallel_for whose chunk holding index bad throws");
  m.def("flush_control", &kvp::flush_denormals_control,
        "the control bits the native float ops flush subnormals under (float_control.h: "
        "x86 MXCSR's FTZ and DAZ, or FTZ alone where this CPU's half-float conversions read "
        "subnormals as zero under DAZ; aarch64 FPCR's FZ)");
  m.def("flushes_denormals", &kvp::flushing_denormals,
        "whether the calling thread flushes subnormal floats to zero now (float_control.h; "
        "the native float ops do while they run)");
  m.def("chunks_flush_denormals", [](int64_t n, bool flush) {
    std::vector<std::tuple<bool, bool>> chunks(n > 0 ? n : 0);
    const auto caller = std::this_thread::get_id();
    const auto run = [&] {
      kvp::parallel_for(0, n, 1, [&](int64_t from, int64_t to) {
        for (int64_t i = from; i < to; ++i)
          chunks[i] = {kvp::flushing_denormals(), std::this_thread::get_id() == caller};
      });
    };
    if (flush) {
      const kvp::FlushDenormals scope;
      run();
    } else {
      run();
    }
    return chunks;
  }, "for tests: for each index of a parallel_for run under FlushDenormals (flush) or "
     "as the caller is, whether its chunk flushed subnormals and ran on the calling thread");
  m.def("quant_dequantize", &quant_dequantize,
        "rows of GGUF blocks to float32 [rows, K] (bf16: to bf16, as a bf16 tile's weights)",
        py::arg("raw"), py::arg("qtype"), py::arg("k"), py::arg("variant") = "",
        py::arg("rows") = py::none(), py::arg("bf16") = false);
  m.def("quant_pack", &quant_pack, "rows of GGUF blocks in the packed layout (groups of 8 rows)",
        py::arg("raw"), py::arg("qtype"), py::arg("into") = py::none());
  m.def("quant_packed_bytes", &quant_packed_bytes, "bytes of a matrix in the packed layout");
  m.def("set_iq_grids", &set_iq_grids,
        "the grid formats' tables, once (uint8 [256, 8] IQ2_XXS, [512, 8] IQ2_XS, [1024, 8] "
        "IQ2_S, [256, 4] IQ3_XXS, [512, 4] IQ3_S, int8 [2048, 8] IQ1_S/IQ1_M)",
        py::arg("grids"));
  m.def("quant_packs", &quant_packs, "whether these kernels multiply the packed layout of a type",
        py::arg("qtype"), py::arg("variant") = "");
  m.def("quant_has_int_dot", &quant_has_int_dot,
        "whether these kernels have integer products for a type (its file's layout)",
        py::arg("qtype"), py::arg("variant") = "");
  m.def("quant_matmul", &quant_matmul,
        "x [M, K] times the stacked quantized parts transposed: [M, rows], float32 (or x's "
        "dtype with same_dtype)", py::arg("x"), py::arg("parts"), py::arg("types"),
        py::arg("mode") = 0, py::arg("variant") = "", py::arg("same_dtype") = false,
        py::call_guard<kvp::FlushDenormals>());
  // module_local: two builds of this module (another checkout's sources) can be loaded
  // in one process without their classes clashing in pybind11's registry
  py::class_<kvp::MixtureOfExperts, std::shared_ptr<kvp::MixtureOfExperts>>(
      m, "MixtureOfExperts", py::module_local(),
      "a layer's mixture of experts with quantized products (decode_layers.h)")
      .def(py::init([](const at::Tensor& router, const std::vector<Product>& gate_up,
                       const std::vector<Product>& down, int64_t used) {
             return std::make_shared<kvp::MixtureOfExperts>(router, layer_products(gate_up),
                                                            layer_products(down), used);
           }),
           py::arg("router"), py::arg("gate_up"), py::arg("down"), py::arg("used"))
      .def("run", &kvp::MixtureOfExperts::run,
           "h [tokens, hidden] through each token's experts, weighted and summed",
           py::arg("h"), py::arg("mode"), py::arg("int8_max_rows"), py::arg("variant") = "",
           py::call_guard<py::gil_scoped_release, kvp::FlushDenormals>());
  py::class_<kvp::DecodeLayers>(m, "DecodeLayers", py::module_local(),
                                "a model's layers for decode steps in one call (decode_layers.h)")
      .def(py::init<int64_t, double, double>(), py::arg("num_heads"), py::arg("eps"),
           py::arg("scale"))
      .def(
          "add_layer",
          [](kvp::DecodeLayers& self, const at::Tensor& attn_norm, const at::Tensor& ffn_norm,
             const std::vector<Product>& products, const c10::optional<at::Tensor>& q_norm,
             const c10::optional<at::Tensor>& k_norm) {
            self.add_layer(attn_norm, ffn_norm, layer_products(products),
                           q_norm.value_or(at::Tensor()), k_norm.value_or(at::Tensor()));
          },
          "a layer: its norms' weights, its products qkv, o, gate_up, down, each "
          "(parts, types, bias or None), and its per-head Q/K norms' weights (qwen3) or None",
          py::arg("attn_norm"), py::arg("ffn_norm"), py::arg("products"),
          py::arg("q_norm") = py::none(), py::arg("k_norm") = py::none())
      .def(
          "add_moe_layer",
          [](kvp::DecodeLayers& self, const at::Tensor& attn_norm, const at::Tensor& ffn_norm,
             const std::vector<Product>& products, const c10::optional<at::Tensor>& q_norm,
             const c10::optional<at::Tensor>& k_norm,
             std::shared_ptr<kvp::MixtureOfExperts> experts) {
            self.add_moe_layer(attn_norm, ffn_norm, layer_products(products),
                               q_norm.value_or(at::Tensor()), k_norm.value_or(at::Tensor()),
                               std::move(experts));
          },
          "a layer whose feed-forward is a mixture of experts: its norms' weights, its "
          "products qkv and o, its Q/K norms' weights or None, its MixtureOfExperts",
          py::arg("attn_norm"), py::arg("ffn_norm"), py::arg("products"), py::arg("q_norm"),
          py::arg("k_norm"), py::arg("experts"))
      .def("shape_last_layer", &kvp::DecodeLayers::shape_last_layer,
           "gemma3's parts of the last layer added: its post-attention and post-feed-forward "
           "norms' weights, its sliding window (0: none), whether it rotates with the local "
           "tables, whether its gate is gelu (tanh form)",
           py::arg("post_attn_norm"), py::arg("post_ffn_norm"), py::arg("window"),
           py::arg("local_rope"), py::arg("gelu"))
      .def("run", &kvp::DecodeLayers::run,
           "every layer of a decode step; x (updated in place) -> the residual after the last",
           py::arg("x"), py::arg("cos"), py::arg("sin_signed"), py::arg("slots"),
           py::arg("block_tables"), py::arg("context_lens"), py::arg("kv_layers"),
           py::arg("block_size"), py::arg("mode"), py::arg("heavy_threads"),
           py::arg("heavy_attention"), py::arg("variant") = "",
           py::arg("query_start") = py::none(), py::arg("int8_max_rows") = -1,
           py::arg("local_cos") = py::none(), py::arg("local_sin") = py::none(),
           py::call_guard<py::gil_scoped_release, kvp::FlushDenormals>())
      .def_property_readonly("num_layers", &kvp::DecodeLayers::num_layers);
}
