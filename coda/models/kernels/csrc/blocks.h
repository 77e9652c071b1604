// Batch-invariant linear layers on GGUF block weights (Q4_0, Q4_1, Q8_0) (issues 10, 18), over
// isa.h: the same code for every ISA, with ISA-specific dequantisation and integer dots.
//
// Weights arrive re-laid-out by ggml_linear.py, as many bytes as in the file: output rows in tiles
// of 8; per (tile, block of 32 inputs) the 8 rows' float16 scales d (then, for Q4_1 only, the 8
// float16 mins m), and the 8 rows' quants (16 bytes of nibbles for Q4; 32 int8 for Q8_0, rows
// paired by halves: [c 0..15 | c+1 0..15 | c 16..31 | c+1 16..31]). ggml order: weight j of a Q4
// block is the low nibble of byte j for j < 16 and the high nibble of byte j - 16.
// Q4 in f32 mode ("dword layout", api.cpp's q4_dwords): the 128 quant bytes as two groups of
// four rows, group g's byte 4 l + j = row 4 g + j's byte l; so 32-bit word l of a group holds
// weights l and 16 + l of its four rows, row j's at bits 8 j (low nibble) and 8 j + 4: a
// 64-byte load and one shift put a row's 16 nibbles in the low bits of 16 words (AVX-512 then
// looks them up with no widening shuffle). q8 mode keeps the byte layout (its integer dots).
//
// f32 mode: weight w = fma(q, d, m) (Q4; m = -8d for Q4_0) or q * d (Q8_0), one rounding (the
// file's weight exactly, as kquants.h decodes it), then isa.h's canonical 16-lane dot: lane
// k mod 16, acc = fma(w, x, acc) in increasing k, tree16 (so a Q4_0/Q4_1/Q8_0 matrix gives the
// in-place kernel's bits: one order for every matmul). Sub-vector V of a block (weights
// 8V..8V+7) feeds lanes 0..7 for even V, 8..15 for odd V.
// q8 mode: each row's activations are quantised per block of 32 (dx = amax / 127, q = rint(x / dx)
// as x * (1 / dx), ties to even; sx = dx * sum(q)), stored twice as wide (XQB layout: [x0..15,
// x0..15, x16..31, x16..31]); the integer dots are exact; per output 4 float lanes (isa.h), then
// + the min term sum_b fma(m, sx, .) in increasing b.
//
// T4 by construction: every output element (row r, column n) is computed by one thread with one
// fixed sequence of operations that reads row r of x and column n of W only; the row tiling and
// the column grouping only choose which independent accumulators run side by side. So a row's
// bits do not depend on M, on its position in the batch, on the thread count or on the ISA.
#pragma once

#include <cstdlib>

#include "isa.h"
#include "pool.h"
#include "table.h"

namespace coda_native {
namespace CODA_NS {
namespace blocks {

template <int KIND> constexpr bool kQ8 = KIND == Q8_0;
template <int KIND> constexpr int64_t kQB = KIND == Q8_0 ? 32 : 16;   // quant bytes per row-block
template <int KIND> constexpr int64_t kSC = KIND == Q4_1 ? 16 : 8;    // float16 scales per tile-block

// The tile-block's d and m of its 8 rows as float32 (m: Q4_1 its own, Q4_0 -8d, Q8_0 0).
// The tile a thread runs next, prefetched block by block while this one is computed: a tile is a
// few KiB read in strided passes (C outputs per pass), which the hardware prefetcher does not
// run ahead of (measured, 30000 Q4_1 tiles of K = 576 streamed from memory, AVX-512: 8 rows
// 59.8 -> ? ms). No tile (sc null): nothing prefetched.
struct Ahead {
  const uint16_t* sc = nullptr;
  const uint8_t* qs = nullptr;
  template <int KIND>
  void block(int64_t b) const;
};

template <int KIND>
inline void scales8(const uint16_t* s, F8& d, F8& m) {
  d = load_h8(s);
  m = KIND == Q4_1 ? load_h8(s + 8) : KIND == Q4_0 ? mul8(d, set8(-8.0f)) : zero8();
}

template <int KIND>
inline void Ahead::block(int64_t b) const {
  if (sc == nullptr) return;
  const uint8_t* q = qs + b * TILE * kQB<KIND>;
  for (int64_t o = 0; o < TILE * kQB<KIND>; o += 64) __builtin_prefetch(q + o);
  __builtin_prefetch(sc + b * kSC<KIND>);
}

template <int KIND>
inline void scales8(const uint16_t* s, float* d, float* m) {
  F8 dv, mv;
  scales8<KIND>(s, dv, mv);
  store8(d, dv);
  store8(m, mv);
}

// Sub-vector V (0..3) of a block's 32 weights of output c as 8 float32 (see the file comment).
// q: the tile-block's quants (Q8_0: pair layout; Q4: the f32 mode's dword layout).
template <bool Q8W, int V>
inline F8 dequant8(const uint8_t* q, int64_t c, float d, float m) {
  // NOTE: Q4: weights 8 V + i are word 8 (V % 2) + i of group c / 4, nibble 2 (c % 4) + V / 2
  const uint8_t* g = q + (c / 4) * 64 + 32 * (V % 2);
  const int shift = 8 * static_cast<int>(c % 4) + 4 * (V / 2);
#if CODA_ISA == CODA_SCALAR
  F8 w;
  for (int l = 0; l < 8; ++l) {
    if (Q8W) {
      const uint8_t* qc = q + (c / 2) * 64 + (c % 2) * 16;
      w.v[l] = static_cast<float>(static_cast<int8_t>(qc[(V / 2) * 32 + (V % 2) * 8 + l])) * d;
    } else {
      const uint32_t word = static_cast<uint32_t>(g[4 * l]) | static_cast<uint32_t>(g[4 * l + 1]) << 8 |
                            static_cast<uint32_t>(g[4 * l + 2]) << 16 |
                            static_cast<uint32_t>(g[4 * l + 3]) << 24;
      w.v[l] = fma1(static_cast<float>((word >> shift) & 0xF), d, m);
    }
  }
  return w;
#else
  if (Q8W) {
    const uint8_t* qc = q + (c / 2) * 64 + (c % 2) * 16;
    const __m256i i = _mm256_cvtepi8_epi32(
        _mm_loadl_epi64(reinterpret_cast<const __m128i*>(qc + (V / 2) * 32 + (V % 2) * 8)));
    return _mm256_mul_ps(_mm256_cvtepi32_ps(i), _mm256_set1_ps(d));
  }
  // NOTE: shift is a constant (c0 is a template constant): an immediate shift; the top
  // nibble (shift 28) needs no mask
  const __m256i v = _mm256_srli_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(g)), shift);
  const __m256i b = shift == 28 ? v : _mm256_and_si256(v, _mm256_set1_epi32(0xF));
  return _mm256_fmadd_ps(_mm256_cvtepi32_ps(b), _mm256_set1_ps(d), _mm256_set1_ps(m));
#endif
}

#if CODA_ISA != CODA_AVX512  // NOTE: AVX-512's f32 tiles are blocks_avx512.h's
template <bool Q8W, int R, int C, int V, int c0>
inline void step_f32(const float* x, int64_t K, const float* d, const float* m, const uint8_t* q,
                     F16 acc[R][C]) {
  for (int c = 0; c < C; ++c) {
    const int64_t c1 = c0 + c;
    const F8 w = dequant8<Q8W, V>(q, c1, d[c1], m[c1]);
    for (int r = 0; r < R; ++r) {
      F8& lane = V % 2 ? acc[r][c].hi : acc[r][c].lo;  // NOTE: k mod 16 = 8 (V % 2) + l
      lane = fma8(w, load8(x + r * QK + 8 * V), lane);
    }
  }
}

// R rows x C outputs (columns c0..c0+C of one tile), f32 activations (scalar and AVX2).
// NOTE: c0 a constant (as blocks_avx512.h): the dword layout's shifts are then immediates
template <int KIND, int R, int C, int c0>
void micro_f32(const float* x, int64_t K, const uint16_t* sc, const uint8_t* qs, float* y,
               int64_t ldy, int64_t ncols, const Ahead& next) {
  constexpr bool Q8W = kQ8<KIND>;
  const int64_t nb = K / QK, qb = kQB<KIND>;
  F16 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = zero16();
  float d[8], m[8];
  const Ahead ahead = next;  // NOTE: in registers (see blocks_avx512.h micro_f32_512)
  for (int64_t b = 0; b < nb; ++b) {
    scales8<KIND>(sc + b * kSC<KIND>, d, m);
    const uint8_t* q = qs + b * TILE * qb;
    const float* xb = x + b * R * QK;
    ahead.block<KIND>(b);
    step_f32<Q8W, R, C, 0, c0>(xb, K, d, m, q, acc);
    step_f32<Q8W, R, C, 1, c0>(xb, K, d, m, q, acc);
    step_f32<Q8W, R, C, 2, c0>(xb, K, d, m, q, acc);
    step_f32<Q8W, R, C, 3, c0>(xb, K, d, m, q, acc);
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c)
      if (c0 + c < ncols) y[r * ldy + c0 + c] = tree16(acc[r][c]);
}

// Passes c0, c0 + C, .. of a tile; the first prefetches the next tile.
template <int KIND, int R, int C, int c0>
inline void passes_f32(const float* x, int64_t K, const uint16_t* sc, const uint8_t* qs, float* y,
                       int64_t ldy, int64_t ncols, const Ahead& next) {
  micro_f32<KIND, R, C, c0>(x, K, sc, qs, y, ldy, ncols, c0 == 0 ? next : Ahead{});
  if constexpr (c0 + C < TILE) passes_f32<KIND, R, C, c0 + C>(x, K, sc, qs, y, ldy, ncols, next);
}

template <int KIND, int R>
void tile_f32(const float* x, int64_t K, const uint16_t* sc, const uint8_t* qs, float* y,
              int64_t ldy, int64_t ncols, const Ahead& next) {
  // NOTE: 2 registers per accumulator on AVX2 (16 ymm): at most 8 accumulators live
  constexpr int C = R == 1 ? 4 : R == 2 ? 2 : 1;
  passes_f32<KIND, R, C, 0>(x, K, sc, qs, y, ldy, ncols, next);
}
#endif

#include "blocks_q8.h"  // NOTE: the q8 tiles (blocks_avx512.h uses its min_terms, hsum4)

#include "blocks_avx512.h"

// R rows x one tile, f32 activations: the widest tile this ISA has.
template <int KIND, int R>
inline void tile(const float* x, int64_t K, const uint16_t* sc, const uint8_t* qs, float* y,
                 int64_t ldy, int64_t ncols, const Ahead& next) {
#if CODA_ISA == CODA_AVX512
  tile_f32_512<KIND, R>(x, K, sc, qs, y, ldy, ncols, next);
#else
  tile_f32<KIND, R>(x, K, sc, qs, y, ldy, ncols, next);
#endif
}

// NOTE: rows one tile call takes: each call decodes the tile's weights once for all its rows
// (AVX-512: 32 zmm hold up to 12 rows' accumulators, 2 outputs each; AVX2's 16 ymm, 4 rows):
// a verification of k_max = 8 drafts (9 rows) is one call
constexpr int64_t MAX_ROWS = CODA_ISA == CODA_AVX512 ? 12 : 4;

template <int KIND>
inline void tile_rows(int64_t R, const float* x, int64_t K, const uint16_t* sc, const uint8_t* qs,
                      float* y, int64_t ldy, int64_t ncols, const Ahead& next) {
  switch (R) {
#if CODA_ISA == CODA_AVX512
    case 12: return tile<KIND, 12>(x, K, sc, qs, y, ldy, ncols, next);
    case 11: return tile<KIND, 11>(x, K, sc, qs, y, ldy, ncols, next);
    case 10: return tile<KIND, 10>(x, K, sc, qs, y, ldy, ncols, next);
    case 9: return tile<KIND, 9>(x, K, sc, qs, y, ldy, ncols, next);
    case 8: return tile<KIND, 8>(x, K, sc, qs, y, ldy, ncols, next);
    case 7: return tile<KIND, 7>(x, K, sc, qs, y, ldy, ncols, next);
    case 6: return tile<KIND, 6>(x, K, sc, qs, y, ldy, ncols, next);
    case 5: return tile<KIND, 5>(x, K, sc, qs, y, ldy, ncols, next);
#endif
    case 4: return tile<KIND, 4>(x, K, sc, qs, y, ldy, ncols, next);
    case 3: return tile<KIND, 3>(x, K, sc, qs, y, ldy, ncols, next);
    case 2: return tile<KIND, 2>(x, K, sc, qs, y, ldy, ncols, next);
    default: return tile<KIND, 1>(x, K, sc, qs, y, ldy, ncols, next);
  }
}

// x rows [r0, r0 + R) of one tile call in the call's layout: per block b, the R rows' 32 inputs
// side by side (row r of block b at xp[(b R + r) 32]): a block's inputs of every row of the call
// are one contiguous run, read at fixed offsets (no per-row pointer in the inner loop).
inline void pack_rows(const float* x, int64_t R, int64_t K, float* xp) {
  const int64_t nb = K / QK;
  for (int64_t b = 0; b < nb; ++b)
    for (int64_t r = 0; r < R; ++r) {
      const float* src = x + r * K + b * QK;
      float* dst = xp + (b * R + r) * QK;
      for (int64_t e = 0; e < QK; ++e) dst[e] = src[e];
    }
}

// Per output tile, the M rows in ceil(M / MAX_ROWS) calls of near-equal size (13 rows: 6 + 7,
// not 12 + 1: a call costs its weight decode plus its rows' FMAs, and a lone row's call is
// decode-bound). Which call a row lands in, and where its inputs sit, never changes its
// operations (file comment).
#if CODA_ISA != CODA_AVX512
#include "blocks_gemm.h"
#include "blocks_rows.h"
#endif

template <int KIND>
void linear_f32(const LinearCall& a) {
#if CODA_ISA != CODA_AVX512
  if (a.M >= FEW_FROM && a.M <= FEW_UPTO) return linear_f32_few<KIND>(a);  // NOTE: in registers
  if (a.M >= GEMM_FROM) return linear_f32_rows<KIND>(a);  // NOTE: one decode for all rows
#else
  // NOTE: 6..8 and 13..16 rows: the K-blocked 8-row tile (blocks_tile8.h); the same bits
  if (tile8::takes(a.M) && tile8::linear8<KIND>(a)) return;
#endif
  const int64_t nb = a.K / QK, M = a.M, K = a.K, N = a.N;
  const int64_t calls = (M + MAX_ROWS - 1) / MAX_ROWS;
  // NOTE: malloc, not std::vector: no std template is instantiated in an ISA build (isa.h).
  // 64-byte aligned (as blocks_gemm.h's): malloc's 16 bytes put every other 32-byte input load
  // across two cache lines (the row-block stride is 128 bytes); K % 32 == 0 so the size is a
  // multiple of 64
  float* xp = M > 1 ? static_cast<float*>(std::aligned_alloc(64, sizeof(float) * M * K)) : nullptr;
  for (int64_t c = 0, r = 0; xp != nullptr && c < calls; ++c) {
    const int64_t rows = (M - r) / (calls - c);
    pack_rows(a.x + r * K, rows, K, xp + r * K);
    r += rows;
  }
  const float* xs = xp != nullptr ? xp : a.x;  // NOTE: one row is its own layout
  const int64_t tiles = (N + TILE - 1) / TILE;
  pool::parallel_for(tiles, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const uint16_t* s = a.sc + t * nb * kSC<KIND>;
      const uint8_t* q = a.qs + t * nb * TILE * kQB<KIND>;
      float* yt = a.y + t * TILE;
      const int64_t ncols = N - t * TILE;
      Ahead next;  // NOTE: the following tile, by the first call on this one
      if (t + 1 < tiles) next = {s + nb * kSC<KIND>, q + nb * TILE * kQB<KIND>};
      if (M == 1) {  // NOTE: a decode step's one row: no call split, division or row switch
        tile<KIND, 1>(xs, K, s, q, yt, N, ncols, next);  // per tile (~4% of a K = 576 tile)
        continue;
      }
      for (int64_t c = 0, r = 0; c < calls; ++c) {
        const int64_t rows = (M - r) / (calls - c);  // NOTE: the last calls take the extra rows
        tile_rows<KIND>(rows, xs + r * K, K, s, q, yt + r * N, N, ncols, c == 0 ? next : Ahead{});
        r += rows;
      }
    }
  });
  std::free(xp);
}

template <int KIND>
void linear_q8(const LinearCall& a) {
  const int64_t nb = a.K / QK, M = a.M, K = a.K, N = a.N;
  pool::parallel_for(M, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      quantize_row(a.x + r * K, nb, a.xq + r * nb * XQB, a.dx + r * nb, a.sx + r * nb);
  });
  const int64_t tiles = (N + TILE - 1) / TILE;
  pool::parallel_for(tiles, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const uint16_t* s = a.sc + t * nb * kSC<KIND>;
      const uint8_t* q = a.qs + t * nb * TILE * kQB<KIND>;
      Ahead next;  // NOTE: the following tile of this thread's run (see linear_f32)
      if (t + 1 < t1) next = {s + nb * kSC<KIND>, q + nb * TILE * kQB<KIND>};
      tiles_q8<KIND>(a.xq, a.dx, a.sx, M, nb, s, q, a.y + t * TILE, N, N - t * TILE, next);
    }
  });
}

}  // namespace blocks

inline void linear(const LinearCall& a) {
  if (a.q8) {
    if (a.kind == Q4_0) return blocks::linear_q8<Q4_0>(a);
    if (a.kind == Q4_1) return blocks::linear_q8<Q4_1>(a);
    return blocks::linear_q8<Q8_0>(a);
  }
  if (a.kind == Q4_0) return blocks::linear_f32<Q4_0>(a);
  if (a.kind == Q4_1) return blocks::linear_f32<Q4_1>(a);
  return blocks::linear_f32<Q8_0>(a);
}

inline void quantize_rows(const float* x, int64_t M, int64_t K, int8_t* xq, float* dx, float* sx) {
  const int64_t nb = K / QK;
  for (int64_t r = 0; r < M; ++r)
    blocks::quantize_row(x + r * K, nb, xq + r * nb * XQB, dx + r * nb, sx + r * nb);
}

}  // namespace CODA_NS
}  // namespace coda_native
