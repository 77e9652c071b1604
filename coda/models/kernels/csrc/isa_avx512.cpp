// The AVX-512 (F, BW, DQ, VL, VNNI) build of the kernels (setup.py compiles this file alone with
// the AVX-512 flags); chosen at run time where the CPU has them (api.cpp).
#define CODA_ISA 3
#define CODA_NS avx512
#include "isa.h"
#include "blocks.h"
#include "rows.h"
#include "kquant_kernels.h"
#include "kquants_q8.h"
#include "kernels_def.h"
