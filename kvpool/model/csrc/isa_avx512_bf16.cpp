// As isa_avx512_vnni.cpp, and attention's key dots with the bf16 dot-product instruction.
#define KVP_SUFFIX avx512_bf16
#define KVP_ISA_NAME "avx512-bf16"
#define KVP_TARGET "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx512bf16,avx2,fma,f16c,bmi2"
#define KVP_X86 1
#define KVP_VNNI 1
#define KVP_AVX512 1
#define KVP_BF16DOT 1
#include "isa_variant.inc"
