// The kernels in plain C++, for any CPU (aarch64, x86-64 without AVX2).
#define KVP_SUFFIX generic
#define KVP_ISA_NAME "generic"
#define KVP_TARGET ""
#define KVP_X86 0
#define KVP_VNNI 0
#define KVP_AVX512 0
#define KVP_BF16DOT 0
#include "isa_variant.inc"
