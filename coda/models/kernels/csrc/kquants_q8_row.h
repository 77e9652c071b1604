// packed-q8 K-quant dots at M = 1 (issue 18; split from kquants_q8_simd.h): a decode step's
// one activation row against the weights streamed from memory. Same integer sums and the same
// per-output float steps as kquants_q8.h's portable path (see kquants_q8_blk.h).
#pragma once
#include <cstdint>
#include <cstring>

#include "kquants_q8_blk.h"

#if CODA_ISA != CODA_SCALAR
namespace coda_native {
namespace CODA_NS {
namespace kq {
namespace q8s {

// The per-call M = 1 activations in the layouts below (built and used by the AVX-512 build only,
// kquants_q8_row512.h; null: row1).
struct X1 {
  const int8_t* xp;    // [nb][256]: per 128, the sub-blocks of 32 of x in the order 0 2 1 3
  const int16_t* bs2;  // [nb][8]: bsum[2j] + bsum[2j + 1] (|.| <= 32 * 127: int16)
};

// x (one Q8_K row, nb blocks) and its sums of 16 -> X1's two arrays.
inline void make_x1(const int8_t* x, const int16_t* bs, int64_t nb, int8_t* xp, int16_t* bs2) {
  for (int64_t b = 0; b < nb; ++b) {
    for (int h = 0; h < 2; ++h) {
      static constexpr int kSub[4] = {0, 2, 1, 3};  // NOTE: the 32-code slot s holds sub-block kSub[s]
      for (int s = 0; s < 4; ++s)
        std::memcpy(xp + b * QKK + h * 128 + s * 32, x + b * QKK + h * 128 + kSub[s] * 32, 32);
    }
    for (int j = 0; j < 8; ++j)
      bs2[b * 8 + j] = static_cast<int16_t>(bs[b * 16 + 2 * j] + bs[b * 16 + 2 * j + 1]);
  }
}

// M = 1, Q4_K and Q6_K: dot's sums straight from the block bytes, each code vector and lane
// scale made where the dot takes it (a whole Blk is 18 registers: with four outputs' sums live
// the compiler spilled it; the sums are the same exact integers in any order).
template <int T>
inline void dot_bytes(const uint8_t* b, const int8_t* x, __m256i bsum, __m256i& i, __m256i& m,
                      uint32_t& dd) {
  __m256i a0 = _mm256_setzero_si256(), a1 = _mm256_setzero_si256();
  if constexpr (T == Q4_K) {
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    __m256i s16, mnb;
    k4_scales(b, dd, s16, mnb);
    for (int c = 0; c < 4; ++c) {
      const __m256i v = load32(b + 16 + c * 32);
      const __m256i p0 = _mm256_maddubs_epi16(_mm256_and_si256(v, m4), load_x(x + 64 * c));
      const __m256i p1 = _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(v, 4), m4),
                                              load_x(x + 64 * c + 32));
      a0 = madd_acc(a0, p0, _mm256_shuffle_epi8(s16, lane16(2 * c)));
      a1 = madd_acc(a1, p1, _mm256_shuffle_epi8(s16, lane16(2 * c + 1)));
    }
    i = _mm256_add_epi32(a0, a1);
    m = _mm256_madd_epi16(mnb, bsum);
  } else {  // Q6_K
    const __m256i three = _mm256_set1_epi8(3);
    uint16_t h;
    std::memcpy(&h, b + 208, 2);  // NOTE: the last bytes of the block: no 4-byte read
    dd = h;
    const __m128i s8 = load16(b + 192);
    const __m256i s16 = _mm256_cvtepi8_epi16(evens_odds(s8));
    for (int half = 0; half < 2; ++half) {
      const __m256i hv = load32(b + 128 + half * 32);
      const __m256i l0 = load32(b + half * 64), l1 = load32(b + half * 64 + 32);
      for (int s = 0; s < 4; ++s) {
        const int k = half * 4 + s;
        const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(hv, 2 * s), three);
        const __m256i q =
            _mm256_or_si256(nibbles(s % 2 ? l1 : l0, 4 * (s / 2)), _mm256_slli_epi16(hi, 4));
        const __m256i p = _mm256_maddubs_epi16(q, load_x(x + 32 * k));
        if (k % 2) a1 = madd_acc(a1, p, _mm256_shuffle_epi8(s16, lane16(k)));
        else a0 = madd_acc(a0, p, _mm256_shuffle_epi8(s16, lane16(k)));
      }
    }
    // NOTE: off = 32: the offset's sum comes off as 32 * osum (as dot)
    const __m256i o = _mm256_madd_epi16(_mm256_cvtepi8_epi16(s8), bsum);
    i = _mm256_sub_epi32(_mm256_add_epi32(a0, a1), _mm256_slli_epi32(o, 5));
    m = _mm256_setzero_si256();
  }
}

// M = 1, Q4_K and Q6_K: one output at a time, its blocks four per reduction (lanes
// [i_b m_b i_b+1 m_b+1 ...]), then the block steps in order on scalars: acc = fma(float(isum_b),
// d_w * d_x, acc) and macc the same with dmin, exactly outputs4's lane steps, so the same bits.
// NOTE: one sequential stream per output (outputs4 reads four rows side by side); `next` is
// the row prefetched block by block alongside (G rows ahead, as outputs4's next group)
template <int T>
inline float row1(const uint8_t* row, const uint8_t* next, int64_t nb, int64_t bb,
                  const int8_t* xq, const int16_t* bs, const float* dx) {
  float acc = 0.0f, macc = 0.0f;
  const __m256i spread = _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3);
  for (int64_t b0 = 0; b0 < nb; b0 += 4) {
    const int n4 = nb - b0 < 4 ? static_cast<int>(nb - b0) : 4;
    __m256i is[4], ms[4];
    alignas(16) uint32_t dd[4];
    alignas(16) float d4[4];
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {
      const int64_t b = b0 + (j < n4 ? j : n4 - 1);  // NOTE: padding lanes unused
      if (next) prefetch_block(next + b * bb, bb);
      const __m256i bsum = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bs + b * 16));
      dot_bytes<T>(row + b * bb, xq + b * QKK, bsum, is[j], ms[j], dd[j]);
      d4[j] = dx[b];
    }
    const __m256 w = _mm256_cvtph_ps(_mm_load_si128(reinterpret_cast<const __m128i*>(dd)));
    const __m256 dxs = _mm256_permutevar8x32_ps(_mm256_castps128_ps256(_mm_load_ps(d4)), spread);
    alignas(32) float f[8], s[8];
    _mm256_store_ps(f, _mm256_cvtepi32_ps(reduce8(is, ms)));
    _mm256_store_ps(s, _mm256_mul_ps(w, dxs));
    for (int j = 0; j < n4; ++j) {
      acc = fma1(f[2 * j], s[2 * j], acc);
      macc = fma1(f[2 * j + 1], s[2 * j + 1], macc);
    }
  }
  return acc - macc;  // NOTE: as kquants_q8.h's store_output (the caller adds the bias)
}

// M = 1: outputs row[0..g) (g <= 4; missing ones repeat the last row, their lanes unused).
template <int T>
inline void outputs4(const uint8_t* const* row, const uint8_t* const* next, int g, int64_t nb,
                     int64_t bb, const int8_t* xq, const int16_t* bs, const float* dx,
                     const float* bias, float* y) {
  const uint8_t* r[4];
  for (int j = 0; j < 4; ++j) r[j] = row[j < g ? j : g - 1];
  __m256 acc = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    for (int j = 0; j < 4; ++j)  // NOTE: the rows a group ahead (streams learnt late)
      if (next[j]) prefetch_block(next[j] + b * bb, bb);
    const __m256i bsum = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bs + b * 16));
    __m256i is[4], ms[4];
    uint32_t dd[4];
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {
      if constexpr (T == Q4_K || T == Q6_K) {
        dot_bytes<T>(r[j] + b * bb, xq + b * QKK, bsum, is[j], ms[j], dd[j]);
      } else {
        Blk<T> w;
        load_blk<T>(r[j] + b * bb, w);
        dot<T>(w, xq + b * QKK, bsum, is[j], ms[j]);
        dd[j] = w.dd;
      }
    }
    const __m128i h = _mm_set_epi32(static_cast<int>(dd[3]), static_cast<int>(dd[2]),
                                    static_cast<int>(dd[1]), static_cast<int>(dd[0]));
    const __m256 s = _mm256_mul_ps(_mm256_cvtph_ps(h), _mm256_set1_ps(dx[b]));
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(reduce8(is, ms)), s, acc);
  }
  alignas(32) float a[8];
  _mm256_store_ps(a, acc);
  for (int j = 0; j < g; ++j) {  // NOTE: acc - macc (+ bias), as kquants_q8.h's store_output
    const float v = a[2 * j] - a[2 * j + 1];
    y[j] = bias ? v + bias[j] : v;
  }
}

}  // namespace q8s
}  // namespace kq
}  // namespace CODA_NS
}  // namespace coda_native
#endif  // CODA_ISA != CODA_SCALAR
