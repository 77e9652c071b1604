// AVX2's faster K-quant chunks for the exact-mode register kernel (kquant_fused.h; issue 18):
// codes widened straight from memory, the same weight values as kquant_decode.h's chunk().
// Split out of kquant_fused.h (size); included by it only, after kquant_decode.h.
#pragma once

#include "kquant_decode.h"

namespace coda_native {
namespace CODA_NS {
namespace kq {
namespace fused {

#if CODA_ISA == CODA_AVX2
// AVX2 chunks for a block whose scales are finite (run() checks; other blocks take chunk()).
// Codes are widened straight from memory, 8 at a time (one vpmovzx/sx with a memory operand: no
// extract, no shift of a 16-byte register), and each half's weights are computed so that the
// FMA pipes do no more than before and the conversion leaves them:
// * Q6_K: f = as_float(0x4B400000 + q) is exactly M + q (M = 1.5 * 2^23, |q| <= 32, the
//   "magic number" conversion, one integer add); then fma(f, a, c) with c = -M * a (exact, see
//   Scales::c) is round(M a + q a - M a) = round(q * a): one rounding of the same real number
//   as kquants.h's (d * sc) * q, so the same bits. Needs a finite a (run() checks d).
// * Q4_K, Q2_K: the code from its dword (and, shifts), converted, then fma(q, a, b) as before;
//   Q5_K: the code from q5_codes' unpacked bytes, the same; Q3_K: q3_codes' (lo | mask bit
//   << 2) - 4, converted, times a, as before.
// (Measured at one row, 1B shapes, 1 thread, against the chunk() path on this build: Q6_K about
// 1.25x, Q4_K 1.5-1.7x, Q5_K 1.2x, Q3_K / Q2_K 1.15x; docs/quantization.md.)
CODA_AI __m256i ld8u(const void* p) {
  return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}

template <int T, int I>
CODA_AI W16 chunk_avx2(const uint8_t* blk, const Scales& s) {
  if constexpr (T == Q6_K) {
    // NOTE: the codes are u = q + 32: M + q = bits 0x4B400000 - 32 + u
    const __m256i mg = _mm256_set1_epi32(0x4B400000 - 32);
    const __m256 a = _mm256_broadcast_ss(s.a + I), c = _mm256_broadcast_ss(s.c + I);
    const __m256 f0 = _mm256_castsi256_ps(_mm256_add_epi32(ld8u(s.q + 16 * I), mg));
    const __m256 f1 = _mm256_castsi256_ps(_mm256_add_epi32(ld8u(s.q + 16 * I + 8), mg));
    return {_mm256_fmadd_ps(f0, a, c), _mm256_fmadd_ps(f1, a, c)};
  } else if constexpr (T == Q4_K) {
    constexpr int c = I / 4, h = (I / 2) % 2, half = I % 2;
    const uint8_t* p = blk + 16 + c * 32 + half * 16;
    __m256i q0 = ld8u(p), q1 = ld8u(p + 8);
    if (h) {
      q0 = _mm256_srli_epi32(q0, 4);
      q1 = _mm256_srli_epi32(q1, 4);
    } else {
      q0 = _mm256_and_si256(q0, _mm256_set1_epi32(15));
      q1 = _mm256_and_si256(q1, _mm256_set1_epi32(15));
    }
    const __m256 a = _mm256_broadcast_ss(s.a + I / 2), b = _mm256_broadcast_ss(s.a + 8 + I / 2);
    return {_mm256_fmadd_ps(_mm256_cvtepi32_ps(q0), a, b),
            _mm256_fmadd_ps(_mm256_cvtepi32_ps(q1), a, b)};
  } else if constexpr (T == Q5_K) {  // NOTE: the codes unpacked by scales<Q5_K> (q5_codes)
    const __m256 a = _mm256_broadcast_ss(s.a + I / 2), b = _mm256_broadcast_ss(s.a + 8 + I / 2);
    return {_mm256_fmadd_ps(_mm256_cvtepi32_ps(ld8u(s.q + 16 * I)), a, b),
            _mm256_fmadd_ps(_mm256_cvtepi32_ps(ld8u(s.q + 16 * I + 8)), a, b)};
  } else if constexpr (T == Q3_K) {  // NOTE: the codes unpacked by scales<Q3_K> (q3_codes)
    const __m256 a = _mm256_broadcast_ss(s.a + I);
    const auto ld8s = [](const int8_t* p) {
      return _mm256_cvtepi32_ps(
          _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
    };
    return {_mm256_mul_ps(ld8s(s.q + 16 * I), a), _mm256_mul_ps(ld8s(s.q + 16 * I + 8), a)};
  } else {  // Q2_K
    constexpr int h = I / 8, sh = (I / 2) % 4, half = I % 2;
    const uint8_t* p = blk + 16 + h * 32 + half * 16;
    const __m256i m3 = _mm256_set1_epi32(3);
    const __m256i q0 = _mm256_and_si256(_mm256_srli_epi32(ld8u(p), 2 * sh), m3);
    const __m256i q1 = _mm256_and_si256(_mm256_srli_epi32(ld8u(p + 8), 2 * sh), m3);
    const __m256 a = _mm256_broadcast_ss(s.a + I), b = _mm256_broadcast_ss(s.b + I);
    return {_mm256_fmadd_ps(_mm256_cvtepi32_ps(q0), a, b),
            _mm256_fmadd_ps(_mm256_cvtepi32_ps(q1), a, b)};
  }
}

// Whether chunk_avx2 may run a block of type T (Q6_K: a finite d).
template <int T>
CODA_AI bool fast_ok(const uint8_t* blk) {
  if constexpr (T == Q6_K) {
    uint16_t h;
    std::memcpy(&h, blk + 208, 2);
    return (h & 0x7C00u) != 0x7C00u;  // NOTE: exponent all ones: inf or NaN
  } else {
    return true;
  }
}
#endif

}  // namespace fused
}  // namespace kq
}  // namespace CODA_NS
}  // namespace coda_native
