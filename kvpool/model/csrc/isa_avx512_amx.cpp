// As isa_avx512_bf16.cpp, and the int8 products of 16 activation rows or more on AMX's
// tiles (Intel Xeon since Sapphire Rapids): quant_kernels.inc's group_pair_amx.
#define KVP_SUFFIX avx512_amx
#define KVP_ISA_NAME "avx512-amx"
#define KVP_TARGET \
  "avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx512bf16,avx2,fma,f16c,bmi2,amx-tile,amx-int8"
#define KVP_X86 1
#define KVP_VNNI 1
#define KVP_AVX512 1
#define KVP_BF16DOT 1
#define KVP_AMX 1
#include "isa_variant.inc"
