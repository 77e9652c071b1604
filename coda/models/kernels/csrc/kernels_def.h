// Defines kernels_<CODA_NS>(): the entry-point table of the ISA this translation unit builds.
// Included last by each isa_*.cpp, after the kernel headers.
#pragma once

#include "table.h"

#define CODA_CAT2(a, b) a##b
#define CODA_CAT(a, b) CODA_CAT2(a, b)
#define CODA_STR2(a) #a
#define CODA_STR(a) CODA_STR2(a)

namespace coda_native {

const Kernels& CODA_CAT(kernels_, CODA_NS)() {
  static const Kernels table{
      CODA_STR(CODA_NS),
      CODA_NS::linear,
      CODA_NS::quantize_rows,
      CODA_NS::attend,
      CODA_NS::rms_norm,
      CODA_NS::add_rms_norm,
      CODA_NS::silu_mul,
      CODA_NS::gelu_tanh_mul,
      CODA_NS::kq::linear,
      CODA_NS::kq::linear_q8,
      CODA_NS::kq::gather,
  };
  return table;
}

}  // namespace coda_native
