// The kernels for x86-64 with AVX2, FMA and F16C (integer products with maddubs).
#define KVP_SUFFIX avx2
#define KVP_ISA_NAME "avx2"
#define KVP_TARGET "avx2,fma,f16c,bmi2"
#define KVP_X86 1
#define KVP_VNNI 0
#define KVP_AVX512 0
#define KVP_BF16DOT 0
#include "isa_variant.inc"
