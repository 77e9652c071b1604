// The q8 mode of blocks.h (Q4_0, Q4_1, Q8_0 weights against int8 activations; issues 10, 18):
// the min terms, the scalar and AVX2 tiles and the activation quantisation (AVX-512's tiles are
// blocks_avx512.h's). Included by blocks.h only, in its namespace, after its f32 tiles; the
// numerics are described in blocks.h's file comment ("q8 mode").
#pragma once
// NOTE: no includes of its own: blocks.h's types (F8, kQ8, kSC, scales8) precede the include

// The min term of a tile's 8 outputs for one row: mt[c] = sum_b fma(m_c, sx_b, .), in order.
template <int KIND>
inline void min_terms(const uint16_t* sc, const float* sx, int64_t nb, float* mt) {
  F8 am = zero8();
  if (!kQ8<KIND>) {
    F8 d, m;
    for (int64_t b = 0; b < nb; ++b) {
      scales8<KIND>(sc + b * kSC<KIND>, d, m);
      am = fma8(m, set8(sx[b]), am);
    }
  }
  store8(mt, am);
}

#if CODA_ISA == CODA_SCALAR

// One row x one tile (8 outputs), int8 activations: the canonical q8 order of isa.h.
template <int KIND>
void tile_q8_row(const int8_t* xq, const float* dx, const float* sx, int64_t nb,
                 const uint16_t* sc, const uint8_t* qs, float* y, int64_t ncols) {
  constexpr bool Q8W = kQ8<KIND>;
  const int64_t qb = kQB<KIND>;
  float mt[8];
  min_terms<KIND>(sc, sx, nb, mt);
  for (int64_t c = 0; c < TILE && c < ncols; ++c) {
    float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* q = qs + b * TILE * qb;
      const int8_t* xb = xq + b * XQB;
      const float scale = h2f(sc[b * kSC<KIND> + c]) * dx[b];
      for (int j = 0; j < 4; ++j) {
        int32_t s = 0;
        for (int t = 4 * j; t < 4 * j + 4; ++t) {
          int32_t wl, wh;  // weights t and 16 + t of output c
          if (Q8W) {
            const uint8_t* qc = q + (c / 2) * 64 + (c % 2) * 16;
            wl = static_cast<int8_t>(qc[t]);
            wh = static_cast<int8_t>(qc[32 + t]);
          } else {
            wl = q[c * 16 + t] & 0xF;
            wh = q[c * 16 + t] >> 4;
          }
          s += wl * xb[t] + wh * xb[32 + t];
        }
        acc[j] = fma1(static_cast<float>(s), scale, acc[j]);
      }
    }
    y[c] = ((acc[0] + acc[2]) + (acc[1] + acc[3])) + mt[c];
  }
}

template <int KIND>
void tiles_q8(const int8_t* xq, const float* dx, const float* sx, int64_t M, int64_t nb,
              const uint16_t* sc, const uint8_t* qs, float* yt, int64_t ldy, int64_t ncols,
              const Ahead&) {
  for (int64_t r = 0; r < M; ++r)
    tile_q8_row<KIND>(xq + r * nb * XQB, dx + r * nb, sx + r * nb, nb, sc, qs, yt + r * ldy,
                      ncols);
}

// One row's activations quantised per block (see the file comment), written in the XQB layout.
inline void quantize_row(const float* x, int64_t nb, int8_t* q, float* dx, float* sx) {
  for (int64_t b = 0; b < nb; ++b) {
    const float* xb = x + b * QK;
    float mx = 0.0f;
    for (int e = 0; e < 32; ++e) mx = max1(mx, __builtin_fabsf(xb[e]));
    const float d = mx / 127.0f;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    int32_t sum = 0;
    int8_t* qb = q + b * XQB;
    for (int e = 0; e < 32; ++e) {
      const int32_t t = static_cast<int32_t>(__builtin_nearbyintf(xb[e] * id));
      const int at = (e / 16) * 32 + e % 16;
      qb[at] = qb[at + 16] = static_cast<int8_t>(t);
      sum += t;
    }
    dx[b] = d;
    sx[b] = d * static_cast<float>(sum);
  }
}

#else  // AVX2 (AVX-512 shares the activation quantisation; its tiles are blocks_avx512.h)

inline __m256i mul_q8(__m256i w, __m256i x) {  // |w| * (x * sign(w)), pairwise int16
  return _mm256_maddubs_epi16(_mm256_abs_epi8(w), _mm256_sign_epi8(x, w));
}

// Blocks ahead of the one being multiplied that the q8 tiles prefetch (into L2). NOTE: a 1B
// decode step's Q4_0 matrices (547 MB streamed, 1 thread, AVX2, CPU clock, load 4-5), time over
// the base build's in the same process: no prefetch 0.93 (the fused min terms alone), 4 blocks
// ahead 0.86, 8: 0.82, 16: 0.71, 32: 0.69, 48: 0.71, 64: 0.68, 128: 0.72; into L1 no better
constexpr int64_t kAhead = 32;

// The quants and scales kAhead blocks past block b (q, s: block b's) of a tile's streams (the
// tiles of a thread's range follow each other in memory: past the tile's end is the next's).
template <int KIND>
inline void prefetch_q8(const uint8_t* q, const uint16_t* s) {
  const uint8_t* a = q + kAhead * TILE * kQB<KIND>;
  for (int64_t o = 0; o < TILE * kQB<KIND>; o += 64) __builtin_prefetch(a + o, 0, 2);
  __builtin_prefetch(s + kAhead * kSC<KIND>, 0, 2);
}

// R rows x P output pairs of one tile (pairs p0..p0+P), int8 activations. Lanes 0..3 of
// acc[r][p] are output 2p's four lanes of the canonical q8 order, lanes 4..7 output 2p + 1's.
// mt: R = 1 only (the whole tile in one pass, P = 4): min_terms' sums, in its order, computed
// in this pass (no second walk of the scales, and its fma chain runs beside the dots).
template <int KIND, int R, int P>
void micro_q8(const int8_t* xq, const float* dx, const float* sx, int64_t nb, const uint16_t* sc,
              const uint8_t* qs, int64_t p0, __m256 acc[R][P], bool ahead, float* mt) {
  constexpr bool Q8W = kQ8<KIND>;
  const int64_t qb = kQB<KIND>;
  const __m256i ones = _mm256_set1_epi16(1), low = _mm256_set1_epi8(0xF);
  for (int r = 0; r < R; ++r)
    for (int p = 0; p < P; ++p) acc[r][p] = _mm256_setzero_ps();
  __m256 am = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* q = qs + b * TILE * qb;
    if (ahead) prefetch_q8<KIND>(q, sc + b * kSC<KIND>);
    __m256 d8, m8;
    scales8<KIND>(sc + b * kSC<KIND>, d8, m8);
    if (R == 1 && !Q8W) am = _mm256_fmadd_ps(m8, _mm256_set1_ps(sx[b]), am);
    // NOTE: one row: the products d_c * dx once for the 8 outputs, then permuted (the same
    // float products as permuting first)
    const __m256 dd8 = R == 1 ? _mm256_mul_ps(d8, _mm256_set1_ps(dx[b])) : d8;
    __m256i lo[P], hi[P];
    __m256 d[P];
    for (int p = 0; p < P; ++p) {
      const int64_t c = 2 * (p0 + p);
      d[p] = _mm256_permutevar8x32_ps(dd8, _mm256_setr_epi32(c, c, c, c, c + 1, c + 1, c + 1, c + 1));
      if (Q8W) {
        lo[p] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + c * 32));
        hi[p] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + c * 32 + 32));
      } else {
        const __m256i n = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + c * 16));
        lo[p] = _mm256_and_si256(n, low);
        hi[p] = _mm256_and_si256(_mm256_srli_epi16(n, 4), low);
      }
    }
    for (int r = 0; r < R; ++r) {
      const int64_t i = r * nb + b;
      const __m256i xl = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + i * XQB));
      const __m256i xh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + i * XQB + 32));
      const __m256 vdx = _mm256_set1_ps(dx[i]);
      for (int p = 0; p < P; ++p) {
        __m256i isum;
        if (Q8W) {  // NOTE: each half may reach 2 * 128 * 127: widen before adding
          isum = _mm256_add_epi32(_mm256_madd_epi16(mul_q8(lo[p], xl), ones),
                                  _mm256_madd_epi16(mul_q8(hi[p], xh), ones));
        } else {    // NOTE: 4-bit weights: |sum| <= 4 * 15 * 127 fits int16
          isum = _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(lo[p], xl),
                                                    _mm256_maddubs_epi16(hi[p], xh)), ones);
        }
        const __m256 s = R == 1 ? d[p] : _mm256_mul_ps(d[p], vdx);
        acc[r][p] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), s, acc[r][p]);
      }
    }
  }
  if (R == 1) _mm256_storeu_ps(mt, am);
}

inline float hsum4(__m128 v) {
  v = _mm_add_ps(v, _mm_movehl_ps(v, v));
  return _mm_cvtss_f32(_mm_add_ss(v, _mm_movehdup_ps(v)));
}

template <int KIND, int R>
void tile_q8(const int8_t* xq, const float* dx, const float* sx, int64_t nb, const uint16_t* sc,
             const uint8_t* qs, float* y, int64_t ldy, int64_t ncols, bool ahead) {
  constexpr int P = R == 1 ? 4 : 2;
  float mt[R][8];
  if (R > 1)
    for (int r = 0; r < R; ++r) min_terms<KIND>(sc, sx + r * nb, nb, mt[r]);
  for (int64_t p0 = 0; p0 < TILE / 2; p0 += P) {
    __m256 acc[R][P];
    micro_q8<KIND, R, P>(xq, dx, sx, nb, sc, qs, p0, acc, ahead && p0 == 0, mt[0]);
    for (int r = 0; r < R; ++r)
      for (int p = 0; p < P; ++p) {
        const int64_t c = 2 * (p0 + p);
        if (c < ncols) y[r * ldy + c] = hsum4(_mm256_castps256_ps128(acc[r][p])) + mt[r][c];
        if (c + 1 < ncols)
          y[r * ldy + c + 1] = hsum4(_mm256_extractf128_ps(acc[r][p], 1)) + mt[r][c + 1];
      }
  }
}

#if CODA_ISA == CODA_AVX2
template <int KIND>
void tiles_q8(const int8_t* xq, const float* dx, const float* sx, int64_t M, int64_t nb,
              const uint16_t* sc, const uint8_t* qs, float* yt, int64_t ldy, int64_t ncols,
              const Ahead&) {
  int64_t r = 0;
  bool ahead = true;  // NOTE: the first call on the tile prefetches
  for (; r + 4 <= M; r += 4, ahead = false)
    tile_q8<KIND, 4>(xq + r * nb * XQB, dx + r * nb, sx + r * nb, nb, sc, qs, yt + r * ldy, ldy,
                     ncols, ahead);
  for (; r < M; ++r, ahead = false)
    tile_q8<KIND, 1>(xq + r * nb * XQB, dx + r * nb, sx + r * nb, nb, sc, qs, yt + r * ldy, ldy,
                     ncols, ahead);
}
#endif

inline void quantize_row(const float* x, int64_t nb, int8_t* q, float* dx, float* sx) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  for (int64_t b = 0; b < nb; ++b) {
    const float* xb = x + b * QK;
    __m256 v[4], mx = _mm256_setzero_ps();
    for (int j = 0; j < 4; ++j) {
      v[j] = _mm256_loadu_ps(xb + 8 * j);
      mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, v[j]));
    }
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_movehdup_ps(h));
    const float d = _mm_cvtss_f32(h) / 127.0f;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    __m256i sum = _mm256_setzero_si256();
    int8_t* qb = q + b * XQB;
    alignas(32) int32_t t[32];
    for (int j = 0; j < 4; ++j) {
      const __m256 r = _mm256_round_ps(_mm256_mul_ps(v[j], _mm256_set1_ps(id)),
                                       _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      const __m256i qi = _mm256_cvtps_epi32(r);
      sum = _mm256_add_epi32(sum, qi);
      _mm256_store_si256(reinterpret_cast<__m256i*>(t + 8 * j), qi);
    }
    for (int e = 0; e < 32; ++e) {
      const int at = (e / 16) * 32 + e % 16;
      qb[at] = qb[at + 16] = static_cast<int8_t>(t[e]);
    }
    alignas(32) int32_t s8[8];
    _mm256_store_si256(reinterpret_cast<__m256i*>(s8), sum);
    const int32_t total = s8[0] + s8[1] + s8[2] + s8[3] + s8[4] + s8[5] + s8[6] + s8[7];
    dx[b] = d;
    sx[b] = d * static_cast<float>(total);
  }
}

#endif
