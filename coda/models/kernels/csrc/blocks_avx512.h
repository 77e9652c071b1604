// AVX-512 tiles of the block matmuls (blocks.h), included by blocks.h in the AVX-512 build only.
// Same canonical order as every build (isa.h), two or four outputs per 512-bit register:
// f32 mode: lanes 0..7 hold output c's 8 lanes, lanes 8..15 output c + 1's (lane k mod 8 each),
//   updated by one fma per sub-vector of 8 weights in increasing k, then hsum8 on each half;
// q8 mode: 128-bit chunk q holds output c + q's 4 lanes; the exact integer sums come from VNNI
//   (vpdpbusd: 4 adjacent byte products, the same k mod 16 partition as the AVX2 build's
//   maddubs + madd), then one fma per block, then (0 + 2) + (1 + 3) per chunk and the min term.
#pragma once

// NOTE: included inside blocks.h's namespace coda_native::avx512::blocks, after its helpers.
#if CODA_ISA == CODA_AVX512

// idx lanes: [a x 8, b x 8]
inline __m512i pair_index(int a, int b) {
  return _mm512_inserti64x4(_mm512_set1_epi32(a), _mm256_set1_epi32(b), 1);
}

// A tile-block's scales as [d0..7, m0..7] (m: Q4_1 its own, Q4_0 -8d, Q8_0 unused).
template <int KIND>
inline __m512 scales16(const uint16_t* s) {
  if (KIND == Q4_1) return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s)));
  const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s)));
  return _mm512_insertf32x8(_mm512_castps256_ps512(d), _mm256_mul_ps(d, _mm256_set1_ps(-8.0f)), 1);
}

// The 4 sub-vectors (V = 0..3) of a block's weights of outputs c and c + 1, as pairs.
template <bool Q8W>
inline void dequant_pair(const uint8_t* q, int64_t c, __m512 d, __m512 m, __m512 w[4]) {
  if (Q8W) {  // NOTE: pair layout [c 0..15 | c+1 0..15 | c 16..31 | c+1 16..31]
    const uint8_t* p = q + (c / 2) * 64;
    for (int h = 0; h < 2; ++h) {
      const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 32 * h));
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 32 * h + 16));
      w[2 * h] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_unpacklo_epi64(a, b))), d);
      w[2 * h + 1] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_unpackhi_epi64(a, b))), d);
    }
    return;
  }
  const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + c * 16));
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + c * 16 + 16));
  const __m512i i0 = _mm512_cvtepu8_epi32(_mm_unpacklo_epi64(a, b));  // bytes 0..7 of each
  const __m512i i1 = _mm512_cvtepu8_epi32(_mm_unpackhi_epi64(a, b));  // bytes 8..15 of each
  const __m512i low = _mm512_set1_epi32(0xF);
  w[0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(i0, low)), d, m);
  w[1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(i1, low)), d, m);
  w[2] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(i0, 4)), d, m);
  w[3] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(i1, 4)), d, m);
}

// R rows x P output pairs (pairs p0..p0+P of one tile), f32 activations.
template <int KIND, int R, int P>
void micro_f32_512(const float* x, int64_t K, const uint16_t* sc, const uint8_t* qs, int64_t p0,
                   float* y, int64_t ldy, int64_t ncols) {
  constexpr bool Q8W = kQ8<KIND>;
  const int64_t nb = K / QK, qb = kQB<KIND>;
  __m512 acc[R][P];
  for (int r = 0; r < R; ++r)
    for (int p = 0; p < P; ++p) acc[r][p] = _mm512_setzero_ps();
  __m512i di[P], mi[P];
  for (int p = 0; p < P; ++p) {
    const int c = static_cast<int>(2 * (p0 + p));
    di[p] = pair_index(c, c + 1);
    mi[p] = pair_index(c + 8, c + 9);
  }
  for (int64_t b = 0; b < nb; ++b) {
    const __m512 dm = scales16<KIND>(sc + b * kSC<KIND>);
    const uint8_t* q = qs + b * TILE * qb;
    const float* xb = x + b * QK;
    __m512 w[P][4];
    for (int p = 0; p < P; ++p)
      dequant_pair<Q8W>(q, 2 * (p0 + p), _mm512_permutexvar_ps(di[p], dm),
                        _mm512_permutexvar_ps(mi[p], dm), w[p]);
    for (int v = 0; v < 4; ++v)
      for (int r = 0; r < R; ++r) {
        const __m512 xv = _mm512_broadcast_f32x8(_mm256_loadu_ps(xb + r * K + 8 * v));
        for (int p = 0; p < P; ++p) acc[r][p] = _mm512_fmadd_ps(w[p][v], xv, acc[r][p]);
      }
  }
  for (int r = 0; r < R; ++r)
    for (int p = 0; p < P; ++p) {
      const int64_t c = 2 * (p0 + p);
      if (c < ncols) y[r * ldy + c] = hsum8(_mm512_castps512_ps256(acc[r][p]));
      if (c + 1 < ncols) y[r * ldy + c + 1] = hsum8(_mm512_extractf32x8_ps(acc[r][p], 1));
    }
}

template <int KIND, int R>
void tile_f32_512(const float* x, int64_t K, const uint16_t* sc, const uint8_t* qs, float* y,
                  int64_t ldy, int64_t ncols) {
  constexpr int P = R <= 2 ? 4 : 2;
  for (int64_t p0 = 0; p0 < TILE / 2; p0 += P)
    micro_f32_512<KIND, R, P>(x, K, sc, qs, p0, y, ldy, ncols);
}

// R rows x one tile (8 outputs = 2 quads), int8 activations.
template <int KIND, int R>
void tile_q8_512(const int8_t* xq, const float* dx, const float* sx, int64_t nb,
                 const uint16_t* sc, const uint8_t* qs, float* y, int64_t ldy, int64_t ncols) {
  constexpr bool Q8W = kQ8<KIND>;
  const int64_t qb = kQB<KIND>;
  float mt[R][8];
  for (int r = 0; r < R; ++r) min_terms<KIND>(sc, sx + r * nb, nb, mt[r]);
  __m512 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  const __m512i quad0 = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
  const __m512i quad1 = _mm512_add_epi32(quad0, _mm512_set1_epi32(4));
  const __m512i low = _mm512_set1_epi8(0xF);
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* q = qs + b * TILE * qb;
    const __m512 d16 = _mm512_castps256_ps512(
        _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sc + b * kSC<KIND>))));
    const __m512 d[2] = {_mm512_permutexvar_ps(quad0, d16), _mm512_permutexvar_ps(quad1, d16)};
    __m512i lo[2], hi[2];
    __mmask64 neg_lo[2] = {0, 0}, neg_hi[2] = {0, 0};
    for (int h = 0; h < 2; ++h) {
      if (Q8W) {  // NOTE: pairs 2h, 2h + 1: lo = [c, c+1, c+2, c+3 weights 0..15]
        const uint8_t* p = q + h * 128;
        lo[h] = _mm512_inserti64x4(
            _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))),
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 64)), 1);
        hi[h] = _mm512_inserti64x4(
            _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32))),
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 96)), 1);
        neg_lo[h] = _mm512_movepi8_mask(lo[h]);
        neg_hi[h] = _mm512_movepi8_mask(hi[h]);
        lo[h] = _mm512_abs_epi8(lo[h]);
        hi[h] = _mm512_abs_epi8(hi[h]);
      } else {
        const __m512i n = _mm512_loadu_si512(q + h * 64);
        lo[h] = _mm512_and_si512(n, low);
        hi[h] = _mm512_and_si512(_mm512_srli_epi16(n, 4), low);
      }
    }
    for (int r = 0; r < R; ++r) {
      const int64_t i = r * nb + b;
      const __m512i xl = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(xq + i * XQB)));
      const __m512i xh = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(xq + i * XQB + 32)));
      const __m512 vdx = _mm512_set1_ps(dx[i]);
      for (int h = 0; h < 2; ++h) {
        __m512i isum;
        if (Q8W) {  // NOTE: |w| * (x * sign(w)): vpdpbusd multiplies unsigned by signed bytes
          const __m512i z = _mm512_setzero_si512();
          isum = _mm512_dpbusd_epi32(z, lo[h], _mm512_mask_sub_epi8(xl, neg_lo[h], z, xl));
          isum = _mm512_dpbusd_epi32(isum, hi[h], _mm512_mask_sub_epi8(xh, neg_hi[h], z, xh));
        } else {
          isum = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), lo[h], xl),
                                     hi[h], xh);
        }
        acc[r][h] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(d[h], vdx), acc[r][h]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int h = 0; h < 2; ++h) {
      alignas(64) float lanes[16];
      _mm512_store_ps(lanes, acc[r][h]);
      for (int j = 0; j < 4; ++j) {
        const int64_t c = 4 * h + j;
        if (c < ncols) y[r * ldy + c] = hsum4(_mm_load_ps(lanes + 4 * j)) + mt[r][c];
      }
    }
}

template <int KIND>
void tiles_q8(const int8_t* xq, const float* dx, const float* sx, int64_t M, int64_t nb,
              const uint16_t* sc, const uint8_t* qs, float* yt, int64_t ldy, int64_t ncols) {
  int64_t r = 0;
  for (; r + 4 <= M; r += 4)
    tile_q8_512<KIND, 4>(xq + r * nb * XQB, dx + r * nb, sx + r * nb, nb, sc, qs, yt + r * ldy,
                         ldy, ncols);
  for (; r < M; ++r)
    tile_q8_512<KIND, 1>(xq + r * nb * XQB, dx + r * nb, sx + r * nb, nb, sc, qs, yt + r * ldy,
                         ldy, ncols);
}

#endif
