// The interface between the dispatcher (module.cpp) and the per-ISA builds (isa_*.cpp): plain
// argument structs (pointers into memory Python owns, shapes) and one table of entry points per
// ISA. Arguments are validated by module.cpp before any entry point runs. To add a kernel: a field
// here, its implementation in a kernel header (written over isa.h), one line in kernels_def.h, its
// binding in module.cpp.
#pragma once

#include <cstdint>

namespace coda_native {

constexpr int64_t TILE = 8;   // output rows per tile of a re-laid-out block matrix
constexpr int64_t QK = 32;    // weights per block
constexpr int64_t XQB = 64;   // bytes per block of a q8 activation row (see blocks.h)

enum Kind { Q4_0 = 0, Q4_1 = 1, Q8_0 = 2 };

// y[M, N] = x[M, K] @ W.T, W re-laid-out by ggml_linear.repack (scales sc, quants qs). q8: the
// activations are quantised first into xq [M, K/32, XQB], dx and sx [M, K/32] (scratch).
struct LinearCall {
  const float* x;
  int64_t M, K, N;
  const uint16_t* sc;
  const uint8_t* qs;
  int kind;
  bool q8;
  float* y;
  int8_t* xq;
  float* dx;
  float* sx;
};

// RoPE + cache write + row-by-row paged attention (rows.h); qr [T, H, d] is scratch.
struct AttendCall {
  const float* qkv;   // [T, (H + 2 Hkv) d]
  const float* cos;   // [T, d]
  const float* sin;   // [T, d], signed
  float* kv;          // [2, Hkv, blocks, bs, d]
  const int64_t* slot;
  const int64_t* seq;
  const int64_t* pos;
  const int64_t* tables;  // [B, maxb]
  int64_t T, H, Hkv, d, slots, maxb, bs, max_pos;
  float* qr;
  float* out;  // [T, H d]
};

struct Kernels {
  const char* name;
  void (*linear)(const LinearCall&);
  // one row per x row, written in the XQB layout (blocks.h), with dx and sx per block
  void (*quantize_rows)(const float* x, int64_t M, int64_t K, int8_t* xq, float* dx, float* sx);
  void (*attend)(const AttendCall&);
  void (*rms_norm)(const float* x, const float* w, float eps, float* y, int64_t T, int64_t D);
  void (*add_rms_norm)(float* x, const float* r, const float* w, float eps, float* y, int64_t T,
                       int64_t D);
  void (*silu_mul)(const float* gu, float* y, int64_t T, int64_t I);
};

const Kernels& kernels_scalar();
#if defined(__x86_64__)
const Kernels& kernels_avx2();
const Kernels& kernels_avx512();
#endif

}  // namespace coda_native
