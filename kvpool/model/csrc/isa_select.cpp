// The choice of kernel variant by what the CPU has (CPUID, through the compiler's
// __builtin_cpu_supports; on aarch64 Linux the kernel's hardware capabilities, on macOS
// its sysctl names): the module is built once per architecture, never for the machine
// that happened to build it.

#include "isa_select.h"

#include <c10/util/Exception.h>

#if defined(__x86_64__) && defined(__linux__)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#elif defined(__aarch64__) && defined(__linux__)
#include <sys/auxv.h>
#elif defined(__aarch64__) && defined(__APPLE__)
#include <sys/sysctl.h>
#endif

namespace kvp {
namespace {

#if defined(__x86_64__) && defined(__linux__)
// AMX's tiles with their int8 products: CPUID leaf 7's AMX-TILE and AMX-INT8 bits, and
// Linux's permission for the process to use the tiles' 8 KiB of state (asked for once;
// without it the first tile instruction is a SIGILL; oneDNN asks the same way).
bool amx_int8_usable() {
  static const bool usable = [] {
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
    const bool tile = (d >> 24) & 1, int8 = (d >> 25) & 1;
    constexpr long kReqXcompPerm = 0x1023, kXfeatureTileData = 18;
    return tile && int8 && syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureTileData) == 0;
  }();
  return usable;
}
#endif

bool has(const char* feature) {
#if defined(KVP_SIMDE) && defined(__x86_64__)
  // the emulation build: its AVX-512 variants are SIMDe's, on AVX2, the AMX variant's
  // tiles amx_emulation.h's (isa_variant.inc)
  if (std::string(feature).rfind("avx512", 0) == 0) return has("avx2");
#endif
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  __builtin_cpu_init();
  const std::string f = feature;
  if (f == "avx2") return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
                      __builtin_cpu_supports("avx512vnni") && has("avx2");
  if (f == "avx512-vnni") return avx512;
  if (f == "avx512-bf16") return avx512 && __builtin_cpu_supports("avx512bf16");
#if defined(__linux__)
  if (f == "avx512-amx") return has("avx512-bf16") && amx_int8_usable();
#endif
#elif defined(__aarch64__) && defined(__linux__)
  // HWCAP_ASIMDDP: the SDOT / UDOT instructions
  if (std::string(feature) == "aarch64-dotprod") return (getauxval(AT_HWCAP) & (1UL << 20)) != 0;
#elif defined(__aarch64__) && defined(__APPLE__)
  // macOS names each Arm feature in sysctl (every Apple M-series CPU has the dot products)
  if (std::string(feature) == "aarch64-dotprod") {
    int value = 0;
    size_t size = sizeof(value);
    return sysctlbyname("hw.optional.arm.FEAT_DotProd", &value, &size, nullptr, 0) == 0 &&
           value != 0;
  }
#else
  (void)feature;
#endif
  return false;
}

}  // namespace

const std::vector<Variant>& built_variants() {
  static const std::vector<Variant> variants = [] {
    std::vector<Variant> out;
    const Variant all[] = {
        {"avx512-amx", kvp_quant_kernels_avx512_amx(), kvp_attention_kernels_avx512_amx(),
         kvp_row_kernels_avx512_amx()},
        {"avx512-bf16", kvp_quant_kernels_avx512_bf16(), kvp_attention_kernels_avx512_bf16(),
         kvp_row_kernels_avx512_bf16()},
        {"avx512-vnni", kvp_quant_kernels_avx512_vnni(), kvp_attention_kernels_avx512_vnni(),
         kvp_row_kernels_avx512_vnni()},
        {"avx2", kvp_quant_kernels_avx2(), kvp_attention_kernels_avx2(), kvp_row_kernels_avx2()},
        {"aarch64-dotprod", kvp_quant_kernels_aarch64_dotprod(),
         kvp_attention_kernels_aarch64_dotprod(), kvp_row_kernels_aarch64_dotprod()},
    };
    for (const auto& v : all)
      if (v.quant != nullptr) out.push_back(v);
    out.push_back({"generic", kvp_quant_kernels_generic(), kvp_attention_kernels_generic(),
                   kvp_row_kernels_generic()});
    return out;
  }();
  return variants;
}

const std::vector<Variant>& cpu_variants() {
  static const std::vector<Variant> variants = [] {
    std::vector<Variant> out;
    for (const auto& v : built_variants())
      if (v.name == "generic" || has(v.name.c_str())) out.push_back(v);
    return out;
  }();
  return variants;
}

const Variant& variant(const std::string& name) {
  const auto& all = cpu_variants();
  if (name.empty()) return all.front();
  for (const auto& v : all)
    if (v.name == name) return v;
  TORCH_CHECK(false, "kernel variant '", name, "' cannot run on this CPU");
}

}  // namespace kvp
