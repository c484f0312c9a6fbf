// Which kernel variants (isa_*.cpp) this CPU runs, read at run time from CPUID.

#pragma once

#include <string>
#include <vector>

#include "attention_kernels.h"
#include "quant_kernels.h"
#include "row_kernels.h"

namespace kvp {

struct Variant {
  std::string name;
  const QuantKernels* quant;
  const AttentionKernels* attention;
  const RowKernels* rows;
};

// The variants this build compiled (a compiler may lack one's intrinsics: AMX's before
// GCC 11), fastest first (the generic one always last).
const std::vector<Variant>& built_variants();
// Those of them this CPU can run, in the same order.
const std::vector<Variant>& cpu_variants();
// A variant by name ("" for the fastest); raises if this CPU cannot run it.
const Variant& variant(const std::string& name);

}  // namespace kvp
