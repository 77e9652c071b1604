// The exact-mode (f32) matmul of the re-laid-out legacy blocks (Q4_0, Q4_1, Q8_0; blocks.h) for
// 6..8 input rows (batch-8 decode; issue 18 item 3), AVX-512 build only; included by
// blocks_avx512.h inside blocks.h's namespace.
//
// blocks_avx512.h's tile already decodes each block once for all the call's rows, but walks the
// whole K per pass of 2 outputs: 8 rows of x are 8 K floats (64 KiB at K = 2048, 256 KiB at
// 8192), more than L1 holds, so each of the 16 FMAs per 16 weights waited on x from L2. Here, as
// in kquant_tile8.h: x is packed once per call chunk-major ([K / 16][8][16]: chunk i of row r at
// (i 8 + r) 16, one base pointer and constant offsets), a block of NT8 tiles (32 outputs) walks
// K in spans of KS8 blocks of 32 (16 KiB of x, which stays in L1 across the block's passes), and
// each pass's 16 accumulators (8 rows x 2 outputs) wait in a small array between spans. A
// tile-span's scales are converted to float32 once for its 4 passes.
//
// Bits: the same decode (dequant_out) and, per output, the same products into the same lane in
// increasing k (weights 0..15 of a block, then 16..31), then tree16 (tree16x4: the same
// additions): the canonical order of isa.h. A sum parked in memory between spans and reloaded is
// the same float, so the blocking changes no bit (tests/test_blocks_tile8.py compares with the
// scalar build).
#pragma once

#if CODA_ISA == CODA_AVX512

namespace tile8 {

constexpr int R8 = 8;  // input rows of the widest tile
constexpr int64_t KS8 = 16;  // blocks of 32 per span: 8 x 512 floats of x = 16 KiB
constexpr int NT8 = 4;       // tiles (of 8 outputs) per block: partial sums 32 x 8 x 64 B = 16 KiB

inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

// x [R, K] (row-major) -> xp [K / 16][R][16]: chunk i of row r at xp + (i R + r) 16.
inline void pack(const float* x, int64_t R, int64_t K, float* xp) {
  for (int64_t i = 0; i < K / 16; ++i)
    for (int64_t r = 0; r < R; ++r)
      _mm512_store_ps(xp + (i * R + r) * 16, _mm512_loadu_ps(x + r * K + i * 16));
}

// Outputs c0, c0 + 1 of one tile over nb blocks (q: the span's first tile-block), the R rows of
// xs (the span's packed x); d, m: the span's scales [nb][8]. Partial sums from / to
// ab[c R + r] unless first / last (then y[r ldy + c] for c < ncols).
template <int KIND, int R, int c0>
__attribute__((noinline)) void pass(const uint8_t* q, const float* d, const float* m, int64_t nb,
                                    const float* xs, __m512* ab, bool first, bool last, float* y,
                                    int64_t ldy, int64_t ncols, const Ahead& next) {
  constexpr int C = 2;
  constexpr int64_t qb = TILE * kQB<KIND>;
  __m512 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c)
      acc[r][c] = first ? _mm512_setzero_ps() : ab[(c0 + c) * R + r];
  const Ahead ahead = next;  // NOTE: in registers (see micro_f32_512)
  for (int64_t b = 0; b < nb; ++b) {
    ahead.block<KIND>(b);
    // NOTE: opaque copies: the scales broadcast from memory (see micro_f32_512)
    const float* dm = d + b * TILE;
    const float* mm = m + b * TILE;
    __asm__("" : "+r"(dm), "+r"(mm));
    __m512 w[C][2];
    for (int c = 0; c < C; ++c) dequant_out<KIND>(q + b * qb, c0 + c, dm, mm, w[c]);
    const float* xb = xs + b * 2 * R * 16;
    for (int h = 0; h < 2; ++h)
      for (int r = 0; r < R; ++r) {
        // NOTE: GCC folds this load into each of the C FMAs (as kquant_tile8.h); one load kept
        // in a register per row measured the same (0.97-1.01x, noise)
        const __m512 xv = _mm512_load_ps(xb + (h * R + r) * 16);
        for (int c = 0; c < C; ++c) acc[r][c] = _mm512_fmadd_ps(w[c][h], xv, acc[r][c]);
      }
  }
  if (!last) {
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) ab[(c0 + c) * R + r] = acc[r][c];
    return;
  }
  // NOTE: four trees at a time (same bits as tree16), the last four zero-padded (R odd)
  for (int g = 0; g < (R * C + 3) / 4; ++g) {
    F16 v[4];
    for (int j = 0; j < 4; ++j) {
      const int i = 4 * g + j;
      v[j].v = i < R * C ? acc[i / C][i % C] : _mm512_setzero_ps();
    }
    alignas(16) float out[4];
    tree16x4(v, out);
    for (int j = 0; j < 4 && 4 * g + j < R * C; ++j) {
      const int r = (4 * g + j) / C, c = c0 + (4 * g + j) % C;
      if (c < ncols) y[r * ldy + c] = out[j];
    }
  }
}

// One tile (sc, qs: its first block) over blocks [b0, b1): its passes of 2 outputs.
template <int KIND, int R>
inline void tile_span(const uint16_t* sc, const uint8_t* qs, int64_t b0, int64_t b1,
                      const float* xs, __m512* ab, bool first, bool last, float* y, int64_t ldy,
                      int64_t ncols, const Ahead& next) {
  alignas(64) float d[KS8 * TILE], m[KS8 * TILE];
  const int64_t nb = b1 - b0;
  for (int64_t b = 0; b < nb; ++b) scales8<KIND>(sc + (b0 + b) * kSC<KIND>, d + b * TILE, m + b * TILE);
  const uint8_t* q = qs + b0 * TILE * kQB<KIND>;
  // NOTE: the first pass prefetches the next span (all of it: a tile-span is 2-4 KiB)
  pass<KIND, R, 0>(q, d, m, nb, xs, ab, first, last, y, ldy, ncols, next);
  if (ncols > 2) pass<KIND, R, 2>(q, d, m, nb, xs, ab, first, last, y, ldy, ncols, Ahead{});
  if (ncols > 4) pass<KIND, R, 4>(q, d, m, nb, xs, ab, first, last, y, ldy, ncols, Ahead{});
  if (ncols > 6) pass<KIND, R, 6>(q, d, m, nb, xs, ab, first, last, y, ldy, ncols, Ahead{});
}

// Tiles [t0, t0 + nt) (nt <= NT8) of a call's `tiles` for the R rows of xp (packed by pack);
// y: their output rows (ldy a.N).
template <int KIND, int R>
void block(const LinearCall& a, const float* xp, float* y, int64_t t0, int64_t nt,
           int64_t tiles) {
  const int64_t nb = a.K / QK, N = a.N;
  alignas(64) __m512 ab[NT8 * TILE * R];
  auto tsc = [&](int64_t t) { return a.sc + t * nb * kSC<KIND>; };
  auto tqs = [&](int64_t t) { return a.qs + t * nb * TILE * kQB<KIND>; };
  for (int64_t b0 = 0; b0 < nb; b0 += KS8) {
    const int64_t b1 = min64(b0 + KS8, nb);
    const bool first = b0 == 0, last = b1 == nb;
    const float* xs = xp + b0 * 2 * R * 16;
    for (int64_t j = 0; j < nt; ++j) {
      const int64_t t = t0 + j;
      // NOTE: the same tile's next span, or in the last span the next block's tile
      Ahead next;
      if (!last) next = {tsc(t) + b1 * kSC<KIND>, tqs(t) + b1 * TILE * kQB<KIND>};
      else if (t + nt < tiles) next = {tsc(t + nt), tqs(t + nt)};
      tile_span<KIND, R>(tsc(t), tqs(t), b0, b1, xs, ab + j * TILE * R, first, last,
                         y + t * TILE, N, N - t * TILE, next);
    }
  }
}

template <int KIND>
inline void block_rows(int R, const LinearCall& a, const float* xp, float* y, int64_t t0,
                       int64_t nt, int64_t tiles) {
  switch (R) {
    case 8: return block<KIND, 8>(a, xp, y, t0, nt, tiles);
    case 7: return block<KIND, 7>(a, xp, y, t0, nt, tiles);
    default: return block<KIND, 6>(a, xp, y, t0, nt, tiles);
  }
}

// Row counts the tile takes: 6..8 (one group) and 13..16 (two groups of 6..8 rows).
// NOTE: a tile of R rows, not 8 padded with zero rows: the re-laid-out tile decodes once for
// all rows either way, so padding only adds FMAs (6 rows padded to 8: 1.15x the time of
// blocks_avx512.h's 6-row call); 9..12 rows stay one call of blocks_avx512.h's tile (one
// decode for all rows), and so do 5 or fewer
inline bool takes(int64_t M) { return (M >= 6 && M <= R8) || (M >= 13 && M <= 2 * R8); }

// The call (takes(M), f32 activations); false if x's packed copy cannot be allocated.
template <int KIND>
bool linear8(const LinearCall& a) {
  const int groups = a.M > R8 ? 2 : 1;
  // NOTE: malloc, not std::vector (isa.h); K % 32 == 0, so 64-byte multiples
  float* xp = static_cast<float*>(std::aligned_alloc(64, sizeof(float) * a.M * a.K));
  if (xp == nullptr) return false;
  // NOTE: two groups: the first takes the extra row (13: 7 + 6)
  const int rows[2] = {static_cast<int>((a.M + groups - 1) / groups),
                       static_cast<int>(a.M / groups)};
  const int64_t off = rows[0] * a.K;  // NOTE: floats before the second group (in x, xp, y)
  for (int g = 0; g < groups; ++g) pack(a.x + g * off, rows[g], a.K, xp + g * off);
  const int64_t tiles = (a.N + TILE - 1) / TILE;
  const int64_t yoff = rows[0] * a.N;
  pool::parallel_for(tiles, NT8, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; t += NT8)
      // NOTE: the second group right after the first: the block's weights are still in L2
      for (int g = 0; g < groups; ++g)
        block_rows<KIND>(rows[g], a, xp + g * off, a.y + g * yoff, t, min64(NT8, t1 - t), tiles);
  });
  std::free(xp);
  return true;
}

}  // namespace tile8

#endif  // CODA_ISA == CODA_AVX512
