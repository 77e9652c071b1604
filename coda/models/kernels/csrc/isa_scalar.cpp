// The portable build of the kernels: plain C++ (std::fma-equivalent builtins), the reference
// the SIMD builds must match bit for bit, and the fallback on CPUs without AVX2 (and non-x86).
#define CODA_ISA 1
#define CODA_NS scalar
#include "isa.h"
#include "blocks.h"
#include "rows.h"
#include "kquant_kernels.h"
#include "kquants_q8.h"
#include "kernels_def.h"
