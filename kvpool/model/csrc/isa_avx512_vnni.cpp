// The kernels for AVX-512 (F, BW, VL, DQ) with VNNI: int8 dot products, a 16-lane exp.
#define KVP_SUFFIX avx512_vnni
#define KVP_ISA_NAME "avx512-vnni"
#define KVP_TARGET "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c,bmi2"
#define KVP_X86 1
#define KVP_VNNI 1
#define KVP_AVX512 1
#define KVP_BF16DOT 0
#include "isa_variant.inc"
