// The instruction-set layer of Coda's kernels (issue 18): one 8-lane float vector type F8 and its
// operations, for the ISA the including translation unit is built for. Every kernel header
// (blocks.h, rows.h, ...) is written once over these operations, so the three builds (isa_*.cpp)
// run the same sequence of IEEE operations and give the same bits.
//
// Usage: a translation unit defines CODA_ISA (CODA_SCALAR, CODA_AVX2 or CODA_AVX512) and CODA_NS
// (the namespace its code lives in), then includes this header and the kernel headers. Each ISA's
// code lives in its own namespace (coda_native::scalar / avx2 / avx512): inline functions compiled
// with different target flags must never share a symbol, or the linker could keep the AVX-512 copy
// for the scalar path. For the same reason kernel headers use no std:: templates (builtins only).
//
// THE CANONICAL ORDER "lanes16-v2" (every ISA implements exactly this; the name is
// coda._native.canonical_order, recorded in the model identity; tests/test_kernel_order.py):
// * float dot products (every f32-activation matmul: blocks.h's re-laid-out Q4_0/Q4_1/Q8_0 tiles,
//   kquant_kernels.h's in-place rows of every GGUF type and of dense F32 weights; attention
//   scores; RMSNorm's sum of squares): per output 16 float lanes starting at +0.0; the product
//   of input index k goes to lane k mod 16; each lane is updated in increasing k by a fused
//   multiply-add; then the fixed tree tree16: lane i += lane i + 8 (i < 8), then i += i + 4,
//   then i += i + 2, then lane 0 + lane 1 (then + bias; RMSNorm adds a tail of n mod 16
//   elements left to right after the tree). Scalar holds the 16 lanes as two F8, AVX2 as two
//   8-lane registers, AVX-512 as one 512-bit register (F16 below).
// * q8 block dots (packed-q8's int8 activations): per output 4 float lanes; lane j adds, block
//   by block in increasing order, fma(float(s), d_w * d_x, lane) where s is the exact integer
//   dot over the block's k with k mod 16 in [4j, 4j + 4); then (lane 0 + lane 2) + (lane 1 +
//   lane 3), then + the min term.
// * weighted sums over keys (attention's values) and the softmax denominator: strictly left to
//   right over the keys, one fma (values) or add (denominator) per key.
// * elementwise ops (RoPE, SiLU, exp, scaling): no fused contraction unless written as fma
//   (builds use -ffp-contract=off), the same formula per element.
// (Until lanes16-v2 the re-laid-out tiles, attention and norms summed in 8 lanes, "lanes8-v1",
// beside the in-place kernel's 16: two orders in one model.) Change the name when the order
// changes: a replica with another order must not share a model_snapshot.
#pragma once

#define CODA_SCALAR 1
#define CODA_AVX2 2
#define CODA_AVX512 3

#ifndef CODA_ISA
#error "define CODA_ISA before including isa.h"
#endif

#include <cstdint>
#include <cstring>
#if CODA_ISA != CODA_SCALAR
#include <immintrin.h>
#endif

namespace coda_native {
namespace CODA_NS {

// float16 bits -> float32 (exact; what F16C's vcvtph2ps computes).
inline float h2f(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1Fu, man = h & 0x3FFu, bits;
  if (exp == 0x1F) {
    bits = sign | 0x7F800000u | (man << 13);
  } else if (exp != 0) {
    bits = sign | ((exp + 112u) << 23) | (man << 13);
  } else if (man == 0) {
    bits = sign;
  } else {  // NOTE: subnormal half: normalise (every half subnormal is a normal float)
    exp = 113;
    while (!(man & 0x400u)) { man <<= 1; --exp; }
    bits = sign | (exp << 23) | ((man & 0x3FFu) << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline float fma1(float a, float b, float c) { return __builtin_fmaf(a, b, c); }
inline float max1(float a, float b) { return a > b ? a : b; }  // NOTE: maxps semantics
inline float min1(float a, float b) { return a < b ? a : b; }  // NOTE: minps semantics

#if CODA_ISA == CODA_SCALAR

struct F8 { float v[8]; };

inline F8 load8(const float* p) { F8 r; for (int i = 0; i < 8; ++i) r.v[i] = p[i]; return r; }
inline void store8(float* p, const F8& a) { for (int i = 0; i < 8; ++i) p[i] = a.v[i]; }
inline F8 set8(float s) { F8 r; for (int i = 0; i < 8; ++i) r.v[i] = s; return r; }
inline F8 zero8() { return set8(0.0f); }
#define CODA_F8_BINARY(name, expr) \
  inline F8 name(const F8& a, const F8& b) { F8 r; for (int i = 0; i < 8; ++i) { const float x = a.v[i], y = b.v[i]; r.v[i] = (expr); } return r; }
CODA_F8_BINARY(add8, x + y)
CODA_F8_BINARY(sub8, x - y)
CODA_F8_BINARY(mul8, x * y)
CODA_F8_BINARY(div8, x / y)
#undef CODA_F8_BINARY
inline F8 fma8(const F8& a, const F8& b, const F8& c) {
  F8 r; for (int i = 0; i < 8; ++i) r.v[i] = fma1(a.v[i], b.v[i], c.v[i]); return r;
}

inline float hsum8(const F8& a) {
  const float s0 = a.v[0] + a.v[4], s1 = a.v[1] + a.v[5], s2 = a.v[2] + a.v[6],
              s3 = a.v[3] + a.v[7];
  return (s0 + s2) + (s1 + s3);
}

// exp(x) (Cephes' expf: reduction by ln 2 in two parts, degree-5 polynomial, ~1 ulp); x below
// -87.3 gives +0. The same operations as the vector exp8 below, one element at a time.
inline float exp1(float x) {
  const float lo = -87.33654475f;
  const bool under = x < lo;
  x = min1(max1(x, lo), 88.3762626647949f);
  const float fx = __builtin_nearbyintf(x * 1.44269504088896341f);
  float r = x - fx * 0.693359375f;
  r = r - fx * -2.12194440e-4f;
  float y = 1.9875691500e-4f;
  y = fma1(y, r, 1.3981999507e-3f);
  y = fma1(y, r, 8.3334519073e-3f);
  y = fma1(y, r, 4.1665795894e-2f);
  y = fma1(y, r, 1.6666665459e-1f);
  y = fma1(y, r, 5.0000001201e-1f);
  y = fma1(y, r * r, r + 1.0f);
  const uint32_t bits = static_cast<uint32_t>(static_cast<int32_t>(fx) + 127) << 23;
  float e;
  std::memcpy(&e, &bits, 4);
  y = y * e;
  return under ? 0.0f : y;
}

inline F8 exp8(const F8& a) { F8 r; for (int i = 0; i < 8; ++i) r.v[i] = exp1(a.v[i]); return r; }

// 8 float16 (bits) -> float32, exact.
inline F8 load_h8(const uint16_t* p) { F8 r; for (int i = 0; i < 8; ++i) r.v[i] = h2f(p[i]); return r; }

#else  // AVX2 and AVX-512 (256-bit ops; AVX-512's wider kernels live in the kernel headers)

using F8 = __m256;

inline F8 load8(const float* p) { return _mm256_loadu_ps(p); }
inline void store8(float* p, F8 a) { _mm256_storeu_ps(p, a); }
inline F8 set8(float s) { return _mm256_set1_ps(s); }
inline F8 zero8() { return _mm256_setzero_ps(); }
inline F8 add8(F8 a, F8 b) { return _mm256_add_ps(a, b); }
inline F8 sub8(F8 a, F8 b) { return _mm256_sub_ps(a, b); }
inline F8 mul8(F8 a, F8 b) { return _mm256_mul_ps(a, b); }
inline F8 div8(F8 a, F8 b) { return _mm256_div_ps(a, b); }
inline F8 fma8(F8 a, F8 b, F8 c) { return _mm256_fmadd_ps(a, b, c); }
inline F8 load_h8(const uint16_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

inline float hsum8(F8 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline F8 exp8(F8 x) {
  const __m256 lo = _mm256_set1_ps(-87.33654475f);
  const __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
  x = _mm256_max_ps(x, lo);
  x = _mm256_min_ps(x, _mm256_set1_ps(88.3762626647949f));
  __m256 fx = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                              _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_sub_ps(x, _mm256_mul_ps(fx, _mm256_set1_ps(0.693359375f)));
  r = _mm256_sub_ps(r, _mm256_mul_ps(fx, _mm256_set1_ps(-2.12194440e-4f)));
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i e = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(fx), _mm256_set1_epi32(127)), 23);
  y = _mm256_mul_ps(y, _mm256_castsi256_ps(e));
  return _mm256_andnot_ps(under, y);
}

#endif

// The canonical 16-lane accumulator (see THE CANONICAL ORDER above): lanes 0..7 are lo, 8..15 hi.
#if CODA_ISA == CODA_AVX512
struct F16 { __m512 v; };
inline F16 zero16() { return {_mm512_setzero_ps()}; }
inline F16 load16(const float* p) { return {_mm512_loadu_ps(p)}; }
inline void store16(float* p, const F16& a) { _mm512_storeu_ps(p, a.v); }
inline F16 fma16(const F16& a, const F16& b, const F16& c) {
  return {_mm512_fmadd_ps(a.v, b.v, c.v)};
}
inline F8 lo8(const F16& a) { return _mm512_castps512_ps256(a.v); }
inline F8 hi8(const F16& a) { return _mm512_extractf32x8_ps(a.v, 1); }
#else
struct F16 { F8 lo, hi; };
inline F16 zero16() { return {zero8(), zero8()}; }
inline F16 load16(const float* p) { return {load8(p), load8(p + 8)}; }
inline void store16(float* p, const F16& a) { store8(p, a.lo); store8(p + 8, a.hi); }
inline F16 fma16(const F16& a, const F16& b, const F16& c) {
  return {fma8(a.lo, b.lo, c.lo), fma8(a.hi, b.hi, c.hi)};
}
inline F8 lo8(const F16& a) { return a.lo; }
inline F8 hi8(const F16& a) { return a.hi; }
#endif

// tree16: lane i + lane i + 8, then hsum8's tree (i + 4, i + 2, 0 + 1) on the 8 sums.
inline float tree16(const F16& a) { return hsum8(add8(lo8(a), hi8(a))); }
inline float tree16(const float* a) { return tree16(load16(a)); }

}  // namespace CODA_NS
}  // namespace coda_native
