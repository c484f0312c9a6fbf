// The plain C++ kernels compiled for aarch64 with its int8 dot-product instructions
// (SDOT, an Armv8.2 option: Graviton 2 and later, Ampere Altra, Apple M1 and later,
// Cortex-A76 and later), which the compiler uses for the integer products' dot loops.
#define KVP_SUFFIX aarch64_dotprod
#define KVP_ISA_NAME "aarch64-dotprod"
#if defined(__clang__)
#define KVP_TARGET "+dotprod"
#else  // GCC: "+dotprod" alone leaves the assembler at armv8-a, which refuses SDOT
#define KVP_TARGET "arch=armv8.2-a+dotprod"
#endif
#define KVP_X86 0
#define KVP_ARM 1
#define KVP_VNNI 0
#define KVP_AVX512 0
#define KVP_BF16DOT 0
#include "isa_variant.inc"
