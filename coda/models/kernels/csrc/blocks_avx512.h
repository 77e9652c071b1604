// AVX-512 tiles of the block matmuls (blocks.h), included by blocks.h in the AVX-512 build only.
// Same canonical order as every build (isa.h), two or four outputs per 512-bit register:
// f32 mode: one 512-bit register per output holds its 16 lanes (lane k mod 16), updated by one
//   fma per half block (weights 0..15, then 16..31) in increasing k, then tree16;
// q8 mode: 128-bit chunk q holds output c + q's 4 lanes; the exact integer sums come from VNNI
//   (vpdpbusd: 4 adjacent byte products, the same k mod 16 partition as the AVX2 build's
//   maddubs + madd), then one fma per block, then (0 + 2) + (1 + 3) per chunk and the min term.
#pragma once

// NOTE: included inside blocks.h's namespace coda_native::avx512::blocks, after its helpers.
#if CODA_ISA == CODA_AVX512

// Output c's weights of one block as two 16-lane halves (w[0]: weights 0..15, w[1]: 16..31).
// d, m: the tile-block's 8 scales and mins as float32 in memory (scales8), read by the
// instructions that use them (embedded broadcasts): a broadcast into a register first costs a
// vector op per output and block (measured on Zen 4: ~20% of a one-row Q4 tile).
template <int KIND>
inline void dequant_out(const uint8_t* q, int64_t c, const float* d, const float* m, __m512 w[2]) {
  if (kQ8<KIND>) {  // NOTE: pair layout [c 0..15 | c+1 0..15 | c 16..31 | c+1 16..31]
    const __m512 dv = _mm512_set1_ps(d[c]);
    const uint8_t* p = q + (c / 2) * 64 + (c % 2) * 16;
    for (int h = 0; h < 2; ++h)
      w[h] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 32 * h)))), dv);
    return;
  }
  // NOTE: the dword layout (blocks.h): word l of group c / 4 holds the row's weights l and
  // 16 + l at bits 8 (c % 4) and 8 (c % 4) + 4 (c is a constant here: immediate shifts)
  const __m512i g = _mm512_loadu_si512(q + (c / 4) * 64);
  const int sh = 8 * static_cast<int>(c % 4);
  const __m512i i = sh ? _mm512_srli_epi32(g, sh) : g;
  // NOTE: the 16 possible weights fma(q, d, m), q = 0..15, once per block; each weight is then
  // looked up by its nibble (vpermps reads the low 4 bits of each index): the same bits as
  // converting every code, one shuffle per 16 weights instead of a convert and an fma.
  // The table is built without an fma, with the same bits: q d is exact (4 bits times an
  // float16's 11), so Q4_0's (q - 8) d is exactly fma(q, d, -8 d), and Q4_1's q d + m rounds
  // once, as fma(q, d, m) does. A mul and an add (each with its scalar operand read from
  // memory) run on separate pipes where an fma would need one operand broadcast first.
  __m512 table;
  if (KIND == Q4_0) {
    table = _mm512_mul_ps(
        _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7), _mm512_set1_ps(d[c]));
  } else {
    table = _mm512_add_ps(
        _mm512_mul_ps(_mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                      _mm512_set1_ps(d[c])),
        _mm512_set1_ps(m[c]));
  }
  w[0] = _mm512_permutexvar_ps(i, table);
  w[1] = _mm512_permutexvar_ps(_mm512_srli_epi32(i, 4), table);
}

// isa.h's tree16 of four accumulators at once: the same additions of the same operands in the
// same operand order (so the same bits, -0.0 and NaN payloads included), four outputs per
// instruction instead of one (at K = 576 the one-by-one trees were ~15% of a multi-row tile).
// Quarters (128 bits) are written qN; tree16 is: s = lo8 + hi8; t = s0..3 + s4..7;
// u = t0 + t2, t1 + t3; u0 + u1.
inline void tree16x4(const F16 v[4], float out[4]) {
  constexpr int LO = _MM_SHUFFLE(1, 0, 1, 0), HI = _MM_SHUFFLE(3, 2, 3, 2);
  // [a lanes 0..7 | b lanes 0..7] + [a lanes 8..15 | b lanes 8..15]: a's s, then b's
  const __m512 ab = _mm512_add_ps(_mm512_shuffle_f32x4(v[0].v, v[1].v, LO),
                                  _mm512_shuffle_f32x4(v[0].v, v[1].v, HI));
  const __m512 cd = _mm512_add_ps(_mm512_shuffle_f32x4(v[2].v, v[3].v, LO),
                                  _mm512_shuffle_f32x4(v[2].v, v[3].v, HI));
  // quarter j: output j's t = s0..3 + s4..7
  const __m512 t = _mm512_add_ps(_mm512_shuffle_f32x4(ab, cd, _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm512_shuffle_f32x4(ab, cd, _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512 u = _mm512_add_ps(t, _mm512_permute_ps(t, _MM_SHUFFLE(1, 0, 3, 2)));  // movehl
  const __m512 w = _mm512_add_ps(u, _mm512_movehdup_ps(u));  // NOTE: lane 0 of each quarter
  _mm_storeu_ps(out, _mm512_castps512_ps128(_mm512_permutexvar_ps(
                        _mm512_setr_epi32(0, 4, 8, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0), w)));
}

// R rows x C outputs (columns c0..c0+C of one tile), f32 activations. NOTE: c0 a constant:
// a run-time c0 made every quant and scale address a register of its own (spilled at one row)
template <int KIND, int R, int C, int c0>
void micro_f32_512(const float* x, int64_t K, const uint16_t* sc, const uint8_t* qs, float* y,
                   int64_t ldy, int64_t ncols, const Ahead& next) {
  const int64_t nb = K / QK, qb = kQB<KIND>;
  F16 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = zero16();
  float d[8], m[8];
  // NOTE: a copy in registers: through the reference, every block reloaded the next tile's
  // pointers (the scale stores to d and m may alias it), ~12 instructions of a one-row block
  const Ahead ahead = next;
  for (int64_t b = 0; b < nb; ++b) {
    scales8<KIND>(sc + b * kSC<KIND>, d, m);
    // NOTE: opaque copies of &d, &m: without them GCC keeps the 8 scales in a register and
    // broadcasts each from there (a shuffle per output and block) instead of from memory
    const float* dm = d;
    const float* mm = m;
    __asm__("" : "+r"(dm), "+r"(mm));
    const uint8_t* q = qs + b * TILE * qb;
    const float* xb = x + b * R * QK;  // NOTE: the call's rows side by side (linear_f32)
    ahead.block<KIND>(b);
    __m512 w[C][2];
    for (int c = 0; c < C; ++c) dequant_out<KIND>(q, c0 + c, dm, mm, w[c]);
    for (int h = 0; h < 2; ++h)
      for (int r = 0; r < R; ++r) {
        __m512 xv = _mm512_loadu_ps(xb + r * QK + 16 * h);
        // NOTE: one load for the C products: without this GCC folds a load into every fma
        // (C times the loads; the load ports, not the FMAs, then bound the multi-row tiles)
        __asm__("" : "+v"(xv));
        for (int c = 0; c < C; ++c) acc[r][c].v = _mm512_fmadd_ps(w[c][h], xv, acc[r][c].v);
      }
  }
  if constexpr (R == 1) {  // NOTE: one row: no measured gain from the grouped trees
    for (int c = 0; c < C; ++c)
      if (c0 + c < ncols) y[c0 + c] = tree16(acc[0][c]);
    return;
  }
  constexpr int N4 = (R * C + 3) / 4;  // NOTE: the R C trees four at a time, zero-padded
  for (int g = 0; g < N4; ++g) {
    F16 v[4];
    for (int j = 0; j < 4; ++j) {
      const int i = 4 * g + j;
      v[j] = i < R * C ? acc[i / C][i % C] : zero16();
    }
    alignas(16) float out[4];
    tree16x4(v, out);
    for (int j = 0; j < 4 && 4 * g + j < R * C; ++j) {
      const int i = 4 * g + j, r = i / C, c = i % C;
      if (c0 + c < ncols) y[r * ldy + c0 + c] = out[j];
    }
  }
}

// Passes c0, c0 + C, .. of a tile; the first prefetches the next tile.
template <int KIND, int R, int C, int c0>
inline void passes_f32_512(const float* x, int64_t K, const uint16_t* sc, const uint8_t* qs,
                           float* y, int64_t ldy, int64_t ncols, const Ahead& next) {
  micro_f32_512<KIND, R, C, c0>(x, K, sc, qs, y, ldy, ncols, c0 == 0 ? next : Ahead{});
  if constexpr (c0 + C < TILE) passes_f32_512<KIND, R, C, c0 + C>(x, K, sc, qs, y, ldy, ncols, next);
}

template <int KIND, int R>
void tile_f32_512(const float* x, int64_t K, const uint16_t* sc, const uint8_t* qs, float* y,
                  int64_t ldy, int64_t ncols, const Ahead& next) {
  // NOTE: R C accumulators + 2 C weights + the x row and the decode's temporaries fit the 32
  // zmm: C = 8 at one row, 4 up to 4 rows, 2 up to 12 (the tile's weights are decoded once per
  // call whatever C is; a narrower C only reloads x rows, which stay in L1)
  constexpr int C = R == 1 ? 8 : R <= 4 ? 4 : 2;
  passes_f32_512<KIND, R, C, 0>(x, K, sc, qs, y, ldy, ncols, next);
}

// R rows x one tile (8 outputs = 2 quads), int8 activations.
template <int KIND, int R>
void tile_q8_512(const int8_t* xq, const float* dx, const float* sx, int64_t nb,
                 const uint16_t* sc, const uint8_t* qs, float* y, int64_t ldy, int64_t ncols,
                 const Ahead& next) {
  constexpr bool Q8W = kQ8<KIND>;
  const int64_t qb = kQB<KIND>;
  // NOTE: one row: min_terms' sums, in its order, in the dot pass (as blocks_q8.h's AVX2 tile:
  // no second walk of the scales; 1B step's Q4_0 q8 matrices 0.93x time, 1 thread, CPU clock)
  float mt[R][8];
  if (R > 1)
    for (int r = 0; r < R; ++r) min_terms<KIND>(sc, sx + r * nb, nb, mt[r]);
  __m256 am = _mm256_setzero_ps();
  __m512 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  const __m512i quad0 = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
  const __m512i quad1 = _mm512_add_epi32(quad0, _mm512_set1_epi32(4));
  const __m512i low = _mm512_set1_epi8(0xF);
  const Ahead ahead = next;  // NOTE: in registers (see micro_f32_512)
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* q = qs + b * TILE * qb;
    ahead.block<KIND>(b);
    if (R == 1 && !Q8W) {
      F8 d8, m8;
      scales8<KIND>(sc + b * kSC<KIND>, d8, m8);
      am = _mm256_fmadd_ps(m8, _mm256_set1_ps(sx[b]), am);
    }
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
  if (R == 1) _mm256_storeu_ps(mt[0], am);
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
              const uint16_t* sc, const uint8_t* qs, float* yt, int64_t ldy, int64_t ncols,
              const Ahead& next) {
  int64_t r = 0;
  for (; r + 4 <= M; r += 4)  // NOTE: the first call over the tile prefetches the next one
    tile_q8_512<KIND, 4>(xq + r * nb * XQB, dx + r * nb, sx + r * nb, nb, sc, qs, yt + r * ldy,
                         ldy, ncols, r == 0 ? next : Ahead{});
  for (; r < M; ++r)
    tile_q8_512<KIND, 1>(xq + r * nb * XQB, dx + r * nb, sx + r * nb, nb, sc, qs, yt + r * ldy,
                         ldy, ncols, r == 0 ? next : Ahead{});
}

// NOTE: the 6..8-row tile (K in spans, x packed once per call) is in its own file (size)
#include "blocks_tile8.h"

#endif
