// packed-q8 for K-quants (issue 18): float32 activations quantised per 256 to llama.cpp's Q8_K
// (int8 codes, one float scale, sums of 16), then exact integer dot products against the
// file's K-quant blocks (Q2_K..Q6_K), read in place. Portable C++ compiled into every build:
// the integer sums are exact whatever the vector width, and the float steps are the same
// scalar operations in the same order, so every ISA gives the same bits (the order below).
//
// Q8_K (as ggml's quantize_row_q8_K_ref): per block of 256, max = the element of largest
// magnitude (the first one on ties), iscale = -127 / max, q = min(127, rint(iscale * x)),
// d = 1 / iscale; all-zero block: d = 0, q = 0; bsums[j] = sum of q over elements 16j..16j+15.
//
// Order (per output, canonical "q8k" part of lanes16-v2's family): block by block in increasing
// order, isum = sum_j sc_j * (sum_l qw * qx) and msum = sum_j mn_j * bsum_j (exact int32), then
// acc = fma(float(isum), d_w * d_x, acc) and macc = fma(float(msum), dmin_w * d_x, macc); the
// output is acc - macc (+ bias). A row's bits depend on its own activations only (T4).
#pragma once
#include <cstdint>
#include <cstdlib>

#include "isa.h"
#include "kquants.h"
#include "kquants_avx2.h"
#include "kquants_q8_simd.h"
#include "pool.h"
#include "table.h"

namespace coda_native {
namespace CODA_NS {
namespace kq {

constexpr int64_t QKK = 256;

// One K-quant block as integers: w = d * sc_j * (u - off) - dmin * mn_j for weight l of
// sub-block j, u the unsigned code (0..63) so that the integer dot is one unsigned x signed
// byte product (maddubs); the offset comes back exactly as off * bsum_j.
struct IntBlock {
  float d, dmin;
  int nsub, sub;  // sub-blocks of `sub` weights (8 x 32 or 16 x 16)
  int32_t off;
  alignas(32) int32_t sc[16];
  int32_t mn[16];
  alignas(32) uint8_t q[256];
  // per 16 weights i: the sub-block's scale and min (int16, for the sums of 16 x codes) and per
  // 8 int32 lanes of scaled_dot's step c: the scale of each lane's weights (set by finish())
  alignas(32) int16_t sc16[16], mn16[16];
  alignas(32) int32_t lane_sc[64];
};

// The derived tables of IntBlock from sc / mn (the same integers in every build).
inline void finish(IntBlock& o) {
  for (int i = 0; i < 16; ++i) {
    const int j = o.sub == 32 ? i / 2 : i;
    o.sc16[i] = static_cast<int16_t>(o.sc[j]);
    o.mn16[i] = static_cast<int16_t>(o.mn[j]);
  }
  for (int c = 0; c < 8; ++c)
    for (int l = 0; l < 8; ++l) o.lane_sc[c * 8 + l] = o.sub == 32 ? o.sc[c] : o.sc[2 * c + l / 4];
}

template <bool CODES>
inline void ints_q2_k(const uint8_t* b, IntBlock& o) {
  o.d = f16(b + 80); o.dmin = f16(b + 82); o.nsub = 16; o.sub = 16; o.off = 0;
  for (int j = 0; j < 16; ++j) { o.sc[j] = b[j] & 15; o.mn[j] = b[j] >> 4; }
  if (!CODES) return;
  for (int h = 0; h < 2; ++h)
    for (int s = 0; s < 4; ++s)
      for (int half = 0; half < 2; ++half) {
        const uint8_t* q = b + 16 + h * 32 + half * 16;
        uint8_t* out = o.q + h * 128 + s * 32 + half * 16;
        for (int l = 0; l < 16; ++l) out[l] = static_cast<uint8_t>((q[l] >> (2 * s)) & 3);
      }
}

template <bool CODES>
inline void ints_q3_k(const uint8_t* b, IntBlock& o) {
  o.d = f16(b + 108); o.dmin = 0.0f; o.nsub = 16; o.sub = 16; o.off = 4;
  for (int j = 0; j < 16; ++j) { o.sc[j] = scale_q3k(b + 96, j); o.mn[j] = 0; }
  if (!CODES) return;
  for (int h = 0; h < 2; ++h)
    for (int s = 0; s < 4; ++s)
      for (int half = 0; half < 2; ++half) {
        const int idx0 = h * 128 + s * 32 + half * 16, hb = idx0 / 32;
        const uint8_t* q = b + 32 + h * 32 + half * 16;
        const uint8_t* m = b + half * 16;
        for (int l = 0; l < 16; ++l)
          o.q[idx0 + l] = static_cast<uint8_t>(((q[l] >> (2 * s)) & 3) + (((m[l] >> hb) & 1) ? 4 : 0));
      }
}

template <bool CODES>
inline void ints_q4_k(const uint8_t* b, IntBlock& o) {
  o.d = f16(b); o.dmin = f16(b + 2); o.nsub = 8; o.sub = 32; o.off = 0;
  for (int j = 0; j < 8; ++j) scale_min_k4(b + 4, j, o.sc[j], o.mn[j]);
  if (!CODES) return;
  for (int c = 0; c < 4; ++c)
    for (int h = 0; h < 2; ++h)
      for (int l = 0; l < 32; ++l)
        o.q[c * 64 + h * 32 + l] = static_cast<uint8_t>((b[16 + c * 32 + l] >> (4 * h)) & 15);
}

template <bool CODES>
inline void ints_q5_k(const uint8_t* b, IntBlock& o) {
  o.d = f16(b); o.dmin = f16(b + 2); o.nsub = 8; o.sub = 32; o.off = 0;
  for (int j = 0; j < 8; ++j) scale_min_k4(b + 4, j, o.sc[j], o.mn[j]);
  if (!CODES) return;
  for (int c = 0; c < 4; ++c)
    for (int h = 0; h < 2; ++h) {
      const int j = 2 * c + h;
      for (int l = 0; l < 32; ++l)
        o.q[j * 32 + l] = static_cast<uint8_t>(((b[48 + c * 32 + l] >> (4 * h)) & 15) |
                                              (((b[16 + l] >> j) & 1) << 4));
    }
}

template <bool CODES>
inline void ints_q6_k(const uint8_t* b, IntBlock& o) {
  o.d = f16(b + 208); o.dmin = 0.0f; o.nsub = 16; o.sub = 16; o.off = 32;
  const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
  for (int j = 0; j < 16; ++j) { o.sc[j] = sc[j]; o.mn[j] = 0; }
  if (!CODES) return;
  for (int half = 0; half < 2; ++half)
    for (int s = 0; s < 4; ++s)
      for (int g = 0; g < 2; ++g) {
        const int idx0 = half * 128 + s * 32 + g * 16, h = s / 2, l64 = (s % 2) * 32 + g * 16;
        const uint8_t* lo = b + half * 64 + l64;
        const uint8_t* hi = b + 128 + half * 32 + g * 16;
        for (int l = 0; l < 16; ++l)
          o.q[idx0 + l] = static_cast<uint8_t>(
              ((lo[l] >> (4 * h)) & 15) | (((hi[l] >> (2 * s)) & 3) << 4));
      }
}

inline bool is_kquant(int32_t t) {
  return t == Q2_K || t == Q3_K || t == Q4_K || t == Q5_K || t == Q6_K;
}

// One block's contribution to row r's two sums (sum (u - off) x = sum u x - off sum x,
// exactly; both kernels below add the same products in the same order).
template <class W>
inline void add_block(const W& w, int32_t isum, int32_t osum, int32_t msum, float d, float* acc,
                      int64_t r) {
  isum -= w.off * osum;
  acc[2 * r] = fma1(static_cast<float>(isum), w.d * d, acc[2 * r]);
  acc[2 * r + 1] = fma1(static_cast<float>(msum), w.dmin * d, acc[2 * r + 1]);
}

// Output n (row i of segment g) of every row: scaled sum less the min sum, plus the bias.
inline void store_output(const KqCall& c, const KqSeg& g, int64_t i, int64_t n, const float* acc) {
  for (int64_t r = 0; r < c.M; ++r) {
    const float v = acc[2 * r] - acc[2 * r + 1];
    c.y[r * c.N + n] = g.bias ? v + g.bias[i] : v;
  }
}

#if CODA_ISA != CODA_SCALAR
// The codes of ints_* above with AVX2 (the same bytes; scales and mins as the portable code).
inline void store32(uint8_t* p, __m256i v) { _mm256_store_si256(reinterpret_cast<__m256i*>(p), v); }

inline void codes_avx2(int32_t t, const uint8_t* b, IntBlock& o) {
  const __m256i three = _mm256_set1_epi8(3);
  switch (t) {
    case Q2_K:
      for (int h = 0; h < 2; ++h) {
        const __m256i v = load32(b + 16 + h * 32);
        for (int s = 0; s < 4; ++s)
          store32(o.q + h * 128 + s * 32, _mm256_and_si256(_mm256_srli_epi16(v, 2 * s), three));
      }
      return;
    case Q3_K: {
      const __m256i hm = load32(b);
      for (int h = 0; h < 2; ++h) {
        const __m256i v = load32(b + 32 + h * 32);
        for (int s = 0; s < 4; ++s) {
          const __m256i lo = _mm256_and_si256(_mm256_srli_epi16(v, 2 * s), three);
          const __m256i bit = _mm256_and_si256(_mm256_srli_epi16(hm, h * 4 + s), _mm256_set1_epi8(1));
          store32(o.q + h * 128 + s * 32, _mm256_or_si256(lo, _mm256_slli_epi16(bit, 2)));
        }
      }
      return;
    }
    case Q4_K:
      for (int c = 0; c < 4; ++c) {
        const __m256i v = load32(b + 16 + c * 32);
        store32(o.q + c * 64, nibbles(v, 0));
        store32(o.q + c * 64 + 32, nibbles(v, 4));
      }
      return;
    case Q5_K: {
      const __m256i qh = load32(b + 16);
      for (int c = 0; c < 4; ++c) {
        const __m256i v = load32(b + 48 + c * 32);
        for (int h = 0; h < 2; ++h) {
          const int j = 2 * c + h;
          const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(qh, j), _mm256_set1_epi8(1));
          store32(o.q + j * 32, _mm256_or_si256(nibbles(v, 4 * h), _mm256_slli_epi16(hi, 4)));
        }
      }
      return;
    }
    default:  // Q6_K
      for (int half = 0; half < 2; ++half) {
        const __m256i hv = load32(b + 128 + half * 32);
        for (int s = 0; s < 4; ++s) {
          const __m256i lv = load32(b + half * 64 + (s % 2) * 32);
          const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(hv, 2 * s), three);
          store32(o.q + half * 128 + s * 32,
                  _mm256_or_si256(nibbles(lv, 4 * (s / 2)), _mm256_slli_epi16(hi, 4)));
        }
      }
      return;
  }
}
#endif

// One block's scales, mins and codes (the codes by AVX2 where the build has it: the same bytes).
inline void ints(int32_t t, const uint8_t* b, IntBlock& o) {
  constexpr bool C = CODA_ISA == CODA_SCALAR;
  switch (t) {
    case Q2_K: ints_q2_k<C>(b, o); break;
    case Q3_K: ints_q3_k<C>(b, o); break;
    case Q4_K: ints_q4_k<C>(b, o); break;
    case Q5_K: ints_q5_k<C>(b, o); break;
    default: ints_q6_k<C>(b, o); break;
  }
#if CODA_ISA != CODA_SCALAR
  codes_avx2(t, b, o);
#endif
  finish(o);
}

// (sum_i sc16_i bsum_i, sum_i mn16_i bsum_i): exact int32 (|bsum| <= 16 * 127, |sc| <= 127).
inline void bsum_dots(const IntBlock& w, const int16_t* bsum, int32_t& osum, int32_t& msum) {
#if CODA_ISA == CODA_SCALAR
  osum = msum = 0;
  for (int i = 0; i < 16; ++i) {
    osum += static_cast<int32_t>(w.sc16[i]) * bsum[i];
    msum += static_cast<int32_t>(w.mn16[i]) * bsum[i];
  }
#else
  const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bsum));
  const __m256i o = _mm256_madd_epi16(_mm256_load_si256(reinterpret_cast<const __m256i*>(w.sc16)), b);
  const __m256i m = _mm256_madd_epi16(_mm256_load_si256(reinterpret_cast<const __m256i*>(w.mn16)), b);
  const __m256i om = _mm256_hadd_epi32(o, m);  // NOTE: [o01 o23 m01 m23 | o45 o67 m45 m67]
  __m128i h = _mm_add_epi32(_mm256_castsi256_si128(om), _mm256_extracti128_si256(om, 1));
  h = _mm_hadd_epi32(h, h);  // NOTE: [osum, msum, osum, msum]
  osum = _mm_cvtsi128_si32(h);
  msum = _mm_extract_epi32(h, 1);
#endif
}

// One activation row -> Q8_K blocks (see the file comment).
inline void quantize_q8k(const float* x, int64_t nb, int8_t* q, int16_t* bsums, float* d) {
  for (int64_t b = 0; b < nb; ++b) {
    const float* xb = x + b * QKK;
    float amax = 0.0f, mx = 0.0f;
    for (int j = 0; j < QKK; ++j) {
      const float ax = __builtin_fabsf(xb[j]);
      if (ax > amax) { amax = ax; mx = xb[j]; }
    }
    int8_t* qb = q + b * QKK;
    if (amax == 0.0f) {
      d[b] = 0.0f;
      for (int j = 0; j < QKK; ++j) qb[j] = 0;
      for (int j = 0; j < 16; ++j) bsums[b * 16 + j] = 0;
      continue;
    }
    const float iscale = -127.0f / mx;
    for (int j = 0; j < QKK; ++j) {
      const int v = static_cast<int>(__builtin_nearbyintf(iscale * xb[j]));
      qb[j] = static_cast<int8_t>(v < 127 ? v : 127);
    }
    for (int j = 0; j < 16; ++j) {
      int s = 0;
      for (int l = 0; l < 16; ++l) s += qb[j * 16 + l];
      bsums[b * 16 + j] = static_cast<int16_t>(s);
    }
    d[b] = 1.0f / iscale;
  }
}

// sum_j sc_j * (sum over sub-block j of u * x): exact int32 (|u| <= 63, |x| <= 127), so the
// SIMD and the portable sums are the same integer.
inline int32_t scaled_dot(const IntBlock& w, const int8_t* x) {
#if CODA_ISA == CODA_SCALAR
  int32_t isum = 0;
  for (int j = 0; j < w.nsub; ++j) {
    int32_t s = 0;
    for (int l = 0; l < w.sub; ++l)
      s += static_cast<int32_t>(w.q[j * w.sub + l]) * static_cast<int32_t>(x[j * w.sub + l]);
    isum += w.sc[j] * s;
  }
  return isum;
#else
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i acc = _mm256_setzero_si256();
  for (int c = 0; c < 8; ++c) {  // NOTE: 32 weights per step: one sub-block, or two of 16
    const __m256i p = _mm256_madd_epi16(
        _mm256_maddubs_epi16(_mm256_load_si256(reinterpret_cast<const __m256i*>(w.q + 32 * c)),
                             _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 32 * c))),
        ones);  // NOTE: |u x + u x| <= 2 * 63 * 127: no int16 saturation
    const __m256i sc = _mm256_load_si256(reinterpret_cast<const __m256i*>(w.lane_sc + 8 * c));
    acc = _mm256_add_epi32(acc, _mm256_mullo_epi32(p, sc));
  }
  __m128i h = _mm_add_epi32(_mm256_castsi256_si128(acc), _mm256_extracti128_si256(acc, 1));
  h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0x4E));
  h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0xB1));
  return _mm_cvtsi128_si32(h);
#endif
}

inline bool fast_q8(const KqCall& c) {
#if CODA_ISA != CODA_SCALAR
  for (int i = 0; i < c.nseg; ++i)
    if (!is_kquant(c.segs[i].type)) return false;
  return true;
#else
  (void)c;
  return false;
#endif
}

inline void linear_q8(const KqCall& c) {
  const int64_t K = c.K, nb = K / QKK, M = c.M, Mq = (M + 3) / 4;
  int8_t* xq = static_cast<int8_t*>(std::malloc(static_cast<size_t>(M * K)));
  int16_t* bs = static_cast<int16_t*>(std::malloc(sizeof(int16_t) * M * nb * 16));
  float* dx = static_cast<float*>(std::malloc(sizeof(float) * M * nb));
  pool::parallel_for(M, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      quantize_q8k(c.x + r * K, nb, xq + r * K, bs + r * nb * 16, dx + r * nb);
  });
  [[maybe_unused]] const bool fast = fast_q8(c);
  float* dx2 = nullptr;
#if CODA_ISA != CODA_SCALAR
  if (fast && M > 1) {
    dx2 = static_cast<float*>(std::malloc(sizeof(float) * Mq * nb * 8));
    q8s::spread_dx(dx, M, nb, dx2);
  }
#endif
#if CODA_ISA != CODA_SCALAR
  q8s::X1 x1{nullptr, nullptr};
#endif
#if CODA_ISA == CODA_AVX512
  int8_t* xp = nullptr;
  int16_t* bs2 = nullptr;
  if (fast && M == 1) {  // NOTE: kquants_q8_row512.h's layouts of the row (bs2 padded to a group)
    xp = static_cast<int8_t*>(std::malloc(static_cast<size_t>(K)));
    bs2 = static_cast<int16_t*>(std::malloc(sizeof(int16_t) * (nb + 4) * 8));
    q8s::make_x1(xq, bs, nb, xp, bs2);
    x1 = {xp, bs2};
  }
#endif
  pool::parallel_for(c.N, 16, [&](int64_t n0, int64_t n1) {
    float* acc = static_cast<float*>(std::malloc(sizeof(float) * 8 * Mq));
#if CODA_ISA != CODA_SCALAR
    if (fast) {
      q8s::range(c, xq, bs, dx, dx2, x1, n0, n1, acc);
      std::free(acc);
      return;
    }
#endif
    IntBlock w;
    int s = 0;
    int64_t first = 0;
    for (int64_t n = n0; n < n1; ++n) {
      while (n >= first + c.segs[s].rows) first += c.segs[s++].rows;
      const KqSeg& g = c.segs[s];
      const int64_t i = n - first;
      const uint8_t* row = g.row(i);
      for (int64_t r = 0; r < 2 * M; ++r) acc[r] = 0.0f;
      for (int64_t b = 0; b < nb; ++b) {
        ints(g.type, row + b * g.row_bytes / nb, w);
        for (int64_t r = 0; r < M; ++r) {
          const int8_t* xb = xq + r * K + b * QKK;
          const int16_t* bsum = bs + (r * nb + b) * 16;
          int32_t msum, osum;
          bsum_dots(w, bsum, osum, msum);
          add_block(w, scaled_dot(w, xb), osum, msum, dx[r * nb + b], acc, r);
        }
      }
      store_output(c, g, i, n, acc);
    }
    std::free(acc);
  });
#if CODA_ISA == CODA_AVX512
  std::free(bs2);
  std::free(xp);
#endif
  std::free(dx2);
  std::free(dx);
  std::free(bs);
  std::free(xq);
}

}  // namespace kq
}  // namespace CODA_NS
}  // namespace coda_native
