// The AVX2 + FMA + F16C build of the kernels (setup.py compiles this file alone with
// -mavx2 -mfma -mf16c); chosen at run time where the CPU has them (api.cpp).
#define CODA_ISA 2
#define CODA_NS avx2
#include "isa.h"
#include "blocks.h"
#include "rows.h"
#include "kquant_kernels.h"
#include "kquants_q8.h"
#include "kernels_def.h"
