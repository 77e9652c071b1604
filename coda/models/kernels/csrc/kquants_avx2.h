// AVX2 block decoders: the same bits as the portable ones of kquants.h (each weight by the same
// float32 operations: an exact product, then at most one rounding, so fma(d, q, -m) equals
// d * q - m), eight weights per instruction. Used by the AVX2 and AVX-512 builds of the matmul.
// Compiled only into the AVX2 and AVX-512 builds (their translation units carry the flags).
#pragma once
#include "kquants.h"

#if CODA_ISA != CODA_SCALAR
#include <immintrin.h>


namespace coda_native {
namespace CODA_NS {
namespace kq {

// NOTE: F16C's conversion: the same exact value as kquants.h's portable f16, without branches.
inline float f16c(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

// 8 byte codes (low 8 bytes of b; signed or unsigned) -> out[0..8) = q * d (+ m when FMA).
template <bool SIGNED, bool FMA>
inline void emit8(__m128i b, __m256 d, __m256 m, float* out) {
  const __m256i i = SIGNED ? _mm256_cvtepi8_epi32(b) : _mm256_cvtepu8_epi32(b);
  const __m256 q = _mm256_cvtepi32_ps(i);
  _mm256_storeu_ps(out, FMA ? _mm256_fmadd_ps(q, d, m) : _mm256_mul_ps(q, d));
}

// 16 byte codes -> 16 floats with one (d, m); one 16-lane pass in the AVX-512 build.
template <bool SIGNED, bool FMA>
inline void emit16(__m128i b, __m256 d, __m256 m, float* out) {
#if CODA_ISA == CODA_AVX512
  const __m512i i = SIGNED ? _mm512_cvtepi8_epi32(b) : _mm512_cvtepu8_epi32(b);
  const __m512 q = _mm512_cvtepi32_ps(i);
  // NOTE: d and m are broadcasts: lane 0 is the value
  const __m512 d16 = _mm512_broadcastss_ps(_mm256_castps256_ps128(d));
  const __m512 m16 = _mm512_broadcastss_ps(_mm256_castps256_ps128(m));
  _mm512_storeu_ps(out, FMA ? _mm512_fmadd_ps(q, d16, m16) : _mm512_mul_ps(q, d16));
#else
  emit8<SIGNED, FMA>(b, d, m, out);
  emit8<SIGNED, FMA>(_mm_srli_si128(b, 8), d, m, out + 8);
#endif
}

// 32 byte codes -> 32 floats: the first 16 with (d0, m0), the last 16 with (d1, m1).
template <bool SIGNED, bool FMA>
inline void emit32(__m256i b, float d0, float m0, float d1, float m1, float* out) {
  emit16<SIGNED, FMA>(_mm256_castsi256_si128(b), _mm256_set1_ps(d0), _mm256_set1_ps(m0), out);
  emit16<SIGNED, FMA>(_mm256_extracti128_si256(b, 1), _mm256_set1_ps(d1), _mm256_set1_ps(m1),
                      out + 16);
}

inline __m256i nibbles(__m256i v, int shift) {
  return _mm256_and_si256(_mm256_srli_epi16(v, shift), _mm256_set1_epi8(0x0F));
}

inline __m256i load32(const uint8_t* p) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
}

// Q4_0 / Q4_1 / Q8_0 / Q5_0 / Q5_1: 16 bytes of nibbles -> 32 codes, low nibbles first.
inline __m256i split16(const uint8_t* qs) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  const __m128i lo = _mm_and_si128(v, _mm_set1_epi8(0x0F));
  const __m128i hi = _mm_and_si128(_mm_srli_epi16(v, 4), _mm_set1_epi8(0x0F));
  return _mm256_set_m128i(hi, lo);
}

// The 32 bits of qh as 32 bytes of 0 or 16 (bit j -> byte j).
inline __m256i bits16(uint32_t qh) {
  const __m256i shuf = _mm256_set_epi64x(0x0303030303030303LL, 0x0202020202020202LL,
                                         0x0101010101010101LL, 0x0000000000000000LL);
  const __m256i bytes = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(qh)), shuf);
  const __m256i bit = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ULL));
  const __m256i on = _mm256_cmpeq_epi8(_mm256_and_si256(bytes, bit), bit);
  return _mm256_and_si256(on, _mm256_set1_epi8(16));
}

inline void decode_q4_0_avx2(const uint8_t* b, float* out) {
  const float d = f16c(b);
  const __m256i q = _mm256_sub_epi8(split16(b + 2), _mm256_set1_epi8(8));
  emit32<true, false>(q, d, 0.0f, d, 0.0f, out);
}

inline void decode_q4_1_avx2(const uint8_t* b, float* out) {
  const float d = f16c(b), m = f16c(b + 2);
  emit32<false, true>(split16(b + 4), d, m, d, m, out);
}

inline void decode_q5_0_avx2(const uint8_t* b, float* out) {
  const float d = f16c(b);
  const __m256i q = _mm256_or_si256(split16(b + 6), bits16(le32(b + 2)));
  emit32<true, false>(_mm256_sub_epi8(q, _mm256_set1_epi8(16)), d, 0.0f, d, 0.0f, out);
}

inline void decode_q5_1_avx2(const uint8_t* b, float* out) {
  const float d = f16c(b), m = f16c(b + 2);
  emit32<false, true>(_mm256_or_si256(split16(b + 8), bits16(le32(b + 4))), d, m, d, m, out);
}

inline void decode_q8_0_avx2(const uint8_t* b, float* out) {
  const float d = f16c(b);
  emit32<true, false>(load32(b + 2), d, 0.0f, d, 0.0f, out);
}

inline void decode_q2_k_avx2(const uint8_t* b, float* out) {
  const uint8_t* sc = b;
  const float d = f16c(b + 80), dmin = f16c(b + 82);
  for (int h = 0; h < 2; ++h) {
    const __m256i v = load32(b + 16 + h * 32);
    for (int s = 0; s < 4; ++s) {
      const int sub = h * 8 + s * 2;
      const __m256i q = _mm256_and_si256(_mm256_srli_epi16(v, 2 * s), _mm256_set1_epi8(3));
      emit32<false, true>(q, d * static_cast<float>(sc[sub] & 15),
                          -(dmin * static_cast<float>(sc[sub] >> 4)),
                          d * static_cast<float>(sc[sub + 1] & 15),
                          -(dmin * static_cast<float>(sc[sub + 1] >> 4)), out + sub * 16);
    }
  }
}

inline void decode_q3_k_avx2(const uint8_t* b, float* out) {
  const __m256i hm = load32(b);
  const uint8_t* sc = b + 96;
  const float d = f16c(b + 108);
  for (int h = 0; h < 2; ++h) {
    const __m256i v = load32(b + 32 + h * 32);
    for (int s = 0; s < 4; ++s) {
      const int sub = h * 8 + s * 2, hb = h * 4 + s;
      const __m256i lo = _mm256_and_si256(_mm256_srli_epi16(v, 2 * s), _mm256_set1_epi8(3));
      const __m256i bit = _mm256_and_si256(_mm256_srli_epi16(hm, hb), _mm256_set1_epi8(1));
      // NOTE: q = lo - 4 when the mask bit is 0, lo when it is 1
      const __m256i q = _mm256_sub_epi8(lo, _mm256_andnot_si256(_mm256_slli_epi16(bit, 2),
                                                                _mm256_set1_epi8(4)));
      emit32<true, false>(q, d * static_cast<float>(scale_q3k(sc, sub)), 0.0f,
                          d * static_cast<float>(scale_q3k(sc, sub + 1)), 0.0f, out + sub * 16);
    }
  }
}

inline void decode_q4_k_avx2(const uint8_t* b, float* out) {
  const float d = f16c(b), dmin = f16c(b + 2);
  for (int c = 0; c < 4; ++c) {
    const __m256i v = load32(b + 16 + c * 32);
    for (int h = 0; h < 2; ++h) {
      int s, mn;
      scale_min_k4(b + 4, 2 * c + h, s, mn);
      const float d1 = d * static_cast<float>(s), m1 = -(dmin * static_cast<float>(mn));
      emit32<false, true>(nibbles(v, 4 * h), d1, m1, d1, m1, out + c * 64 + h * 32);
    }
  }
}

inline void decode_q5_k_avx2(const uint8_t* b, float* out) {
  const float d = f16c(b), dmin = f16c(b + 2);
  const __m256i qh = load32(b + 16);
  for (int c = 0; c < 4; ++c) {
    const __m256i v = load32(b + 48 + c * 32);
    for (int h = 0; h < 2; ++h) {
      const int j = 2 * c + h;
      int s, mn;
      scale_min_k4(b + 4, j, s, mn);
      const float d1 = d * static_cast<float>(s), m1 = -(dmin * static_cast<float>(mn));
      const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(qh, j), _mm256_set1_epi8(1));
      const __m256i q = _mm256_or_si256(nibbles(v, 4 * h), _mm256_slli_epi16(hi, 4));
      emit32<false, true>(q, d1, m1, d1, m1, out + j * 32);
    }
  }
}

inline void decode_q6_k_avx2(const uint8_t* b, float* out) {
  const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
  const float d = f16c(b + 208);
  for (int half = 0; half < 2; ++half) {
    const __m256i hv = load32(b + 128 + half * 32);
    for (int s = 0; s < 4; ++s) {
      const __m256i lv = load32(b + half * 64 + (s % 2) * 32);
      const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(hv, 2 * s), _mm256_set1_epi8(3));
      const __m256i q = _mm256_sub_epi8(
          _mm256_or_si256(nibbles(lv, 4 * (s / 2)), _mm256_slli_epi16(hi, 4)),
          _mm256_set1_epi8(32));
      const int idx0 = half * 128 + s * 32;
      emit32<true, false>(q, d * static_cast<float>(sc[idx0 / 16]), 0.0f,
                          d * static_cast<float>(sc[idx0 / 16 + 1]), 0.0f, out + idx0);
    }
  }
}

inline void decode_f16_avx2(const uint8_t* p, int64_t n, float* out) {
  for (int64_t i = 0; i < n; i += 8)
    _mm256_storeu_ps(out + i, _mm256_cvtph_ps(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 2 * i))));
}

inline void decode_bf16_avx2(const uint8_t* p, int64_t n, float* out) {
  for (int64_t i = 0; i < n; i += 8) {
    const __m256i h = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 2 * i)));
    _mm256_storeu_ps(out + i, _mm256_castsi256_ps(_mm256_slli_epi32(h, 16)));
  }
}

// As decode_span (n a multiple of 16 and of the block size), AVX2.
inline bool decode_span_avx2(int32_t t, const uint8_t* row, int64_t k0, int64_t n,
                                     float* out) {
  const int64_t bs = block_size(t), bb = block_bytes(t);
  if (bs == 0) return false;
  const uint8_t* p = row + (k0 / bs) * bb;
  switch (t) {
    case F16: decode_f16_avx2(p, n, out); return true;
    case BF16: decode_bf16_avx2(p, n, out); return true;
    case F32: return decode_span(t, row, k0, n, out);
    default: break;
  }
  for (int64_t i = 0; i < n; i += bs, p += bb, out += bs) {
    switch (t) {
      case Q4_0: decode_q4_0_avx2(p, out); break;
      case Q4_1: decode_q4_1_avx2(p, out); break;
      case Q5_0: decode_q5_0_avx2(p, out); break;
      case Q5_1: decode_q5_1_avx2(p, out); break;
      case Q8_0: decode_q8_0_avx2(p, out); break;
      case Q2_K: decode_q2_k_avx2(p, out); break;
      case Q3_K: decode_q3_k_avx2(p, out); break;
      case Q4_K: decode_q4_k_avx2(p, out); break;
      case Q5_K: decode_q5_k_avx2(p, out); break;
      case Q6_K: decode_q6_k_avx2(p, out); break;
      default: return false;
    }
  }
  return true;
}

}  // namespace kq
}  // namespace CODA_NS
}  // namespace coda_native

#endif  // CODA_ISA != CODA_SCALAR
