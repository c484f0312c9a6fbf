// The plain C++ kernels compiled for aarch64 with its int8 dot-product instructions
// (SDOT, an Armv8.2 option: Graviton 2 and later, Ampere Altra, Apple M1 and later,
// Cortex-A76 and later), which the compiler uses for the integer products' dot loops.
#define KVP_SUFFIX aarch64_dotprod
#define KVP_ISA_NAME "aarch64-dotprod"
#define KVP_TARGET "+dotprod"
#define KVP_X86 0
#define KVP_ARM 1
#define KVP_VNNI 0
#define KVP_AVX512 0
#define KVP_BF16DOT 0
#include "isa_variant.inc"
