// 3- and 4-row f32 tiles of blocks.h for the scalar and AVX2 builds (issues 18, 21; T4): a
// decode step of 3 or 4 rows, or a verification of 2 or 3 drafted tokens, as one call per tile
// whose weights are decoded once, in registers, for all the call's rows.
// Included by blocks.h inside namespace blocks (AVX-512 keeps its own tiles, blocks_avx512.h).
//
// Why: blocks.h's register tile holds a row's 16 lanes in two ymm registers, so with AVX2's 16
// ymm it ran 3 and 4 rows one output per pass (8 passes a tile, each converting the 16 scales of
// every block again), each pass walking the whole K (at K = 2048, 4 rows' inputs are 32 KiB:
// more than L1). Here a pass holds one 8-lane half of the lanes (the two halves are independent
// fma chains: lanes 0..7 take sub-vectors V = 0, 2 of each block, lanes 8..15 V = 1, 3), so it
// holds R rows x 2 outputs in 2 R registers; K runs in chunks whose inputs stay in L1 across the
// tile's passes; a chunk's scales are converted once per tile into a small float buffer.
//
// The order is unchanged (isa.h's lanes16-v2, blocks.h's file comment): each lane of output
// (r, c) is one fma chain in increasing k on the weight fma(q, d, m) (dequant8, one rounding);
// the pass-0 lanes wait in memory between passes and chunks and tree16 joins them with pass 1's
// as micro_f32 does. So every output has the bits of blocks.h's one-row tile.
#pragma once

// Rows one call takes: 3 and 4 (2 outputs a pass, 2 R accumulators). 2 rows keep blocks.h's tile
// (both halves at once: no pass repeated) and 5 or more blocks_gemm.h's decoded tile (one decode
// for up to 6 rows a group): each measured faster there than this kernel (docs/quantization.md).
constexpr int64_t FEW_FROM = 3, FEW_UPTO = 4;
// x floats of one K chunk (16 KiB: the rows' inputs stay in L1 across a tile's 8 passes).
constexpr int64_t kRowsX = 4096;
// Blocks per K chunk at most (the chunk's converted scales: 16 floats a block).
constexpr int64_t kRowsChunk = kRowsX / (FEW_FROM * QK);
constexpr int kRowsC = 2;

// Half h of the lanes of R rows x outputs c0..c0 + C over a chunk's nc blocks: acc[r][c] carried
// in and out. xb: the chunk's inputs, packed per block (pack_halves); dm: per block 8 d, then 8 m.
template <int KIND, int R, int C, int c0, int h>
inline void pass_half(const float* xb, int64_t nc, const float* dm, const uint8_t* q,
                      F8 acc[R][C]) {
  constexpr bool Q8W = kQ8<KIND>;
  for (int64_t b = 0; b < nc; ++b) {
    const uint8_t* qb = q + b * TILE * kQB<KIND>;
    const float* x = xb + b * R * QK;
    const float* s = dm + b * 16;
    for (int j = 0; j < 2; ++j) {  // NOTE: V = h + 2 j: the lane's inputs in increasing k
      for (int c = 0; c < C; ++c) {
        const F8 w = j == 0 ? dequant8<Q8W, h>(qb, c0 + c, s[c0 + c], s[8 + c0 + c])
                            : dequant8<Q8W, h + 2>(qb, c0 + c, s[c0 + c], s[8 + c0 + c]);
        for (int r = 0; r < R; ++r) acc[r][c] = fma8(w, load8(x + ((2 * h + j) * R + r) * 8), acc[r][c]);
      }
    }
  }
}

// Passes (c0, h) of one K chunk, c0 = 0, C, .. TILE - C, h = 0, 1. lanes[(h TILE + c) R + r]:
// 8 floats each, the lanes between chunks (+0.0 before the first); last: y[r, c] =
// tree16(lanes of (r, c)), c < ncols.
template <int KIND, int R, int C, int c0>
inline void passes_rows(const float* xb, int64_t nc, const float* dm, const uint8_t* q,
                        float* lanes, bool last, float* y, int64_t ldy, int64_t ncols) {
  F8 acc[R][C];
  auto at = [&](int h, int c, int r) { return lanes + ((h * TILE + c0 + c) * R + r) * 8; };
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = load8(at(0, c, r));
  pass_half<KIND, R, C, c0, 0>(xb, nc, dm, q, acc);
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) store8(at(0, c, r), acc[r][c]);
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = load8(at(1, c, r));
  pass_half<KIND, R, C, c0, 1>(xb, nc, dm, q, acc);
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) {
      if (!last) store8(at(1, c, r), acc[r][c]);
      else if (c0 + c < ncols) y[r * ldy + c0 + c] = tree16(F16{load8(at(0, c, r)), acc[r][c]});
    }
  if constexpr (c0 + C < TILE)
    passes_rows<KIND, R, C, c0 + C>(xb, nc, dm, q, lanes, last, y, ldy, ncols);
}

// R rows x one tile. xp: the R rows packed per block over the whole K (pack_halves).
template <int KIND, int R>
void tile_rows_half(const float* xp, int64_t K, const uint16_t* sc, const uint8_t* qs, float* y,
                    int64_t ldy, int64_t ncols, const Ahead& next) {
  constexpr int C = kRowsC;
  alignas(64) float dm[kRowsChunk * 16];
  alignas(64) float lanes[2 * TILE * R * 8];
  for (int64_t i = 0; i < 2 * TILE * R * 8; i += 8) store8(lanes + i, zero8());
  const int64_t nb = K / QK, most = kRowsX / (R * QK) < 1 ? 1 : kRowsX / (R * QK);
  const int64_t chunks = (nb + most - 1) / most;
  for (int64_t k = 0; k < chunks; ++k) {
    const int64_t b0 = nb * k / chunks, nc = nb * (k + 1) / chunks - b0;
    for (int64_t b = 0; b < nc; ++b) {
      scales8<KIND>(sc + (b0 + b) * kSC<KIND>, dm + b * 16, dm + b * 16 + 8);
      next.block<KIND>(b0 + b);
    }
    passes_rows<KIND, R, C, 0>(xp + b0 * R * QK, nc, dm, qs + b0 * TILE * kQB<KIND>, lanes,
                               k + 1 == chunks, y, ldy, ncols);
  }
}

template <int KIND>
inline void tile_rows_few(int64_t R, const float* xp, int64_t K, const uint16_t* sc,
                          const uint8_t* qs, float* y, int64_t ldy, int64_t ncols,
                          const Ahead& next) {
  if (R == 4) return tile_rows_half<KIND, 4>(xp, K, sc, qs, y, ldy, ncols, next);
  tile_rows_half<KIND, 3>(xp, K, sc, qs, y, ldy, ncols, next);
}

// x [R, K] -> xp, per block b, per sub-vector V = h + 2 j in the order (h, j), the R rows' 8
// inputs side by side: row r's inputs 8 V.. of block b at xp[((4 b + 2 h + j) R + r) 8]. So the
// loads of one step (rows r, r + 1, ..) alternate between the halves of a cache line: rows 128
// bytes apart (pack_rows) put every load of a pass at the same offset in its line (one L1 bank).
inline void pack_halves(const float* x, int64_t R, int64_t K, float* xp) {
  const int64_t nb = K / QK;
  for (int64_t b = 0; b < nb; ++b)
    for (int v = 0; v < 4; ++v)  // NOTE: (h, j) in order: V = 0, 2, 1, 3
      for (int64_t r = 0; r < R; ++r) {
        const float* src = x + r * K + b * QK + 8 * ((v / 2) + 2 * (v % 2));
        float* dst = xp + ((4 * b + v) * R + r) * 8;
        for (int e = 0; e < 8; ++e) dst[e] = src[e];
      }
}

// The FEW_FROM..FEW_UPTO rows of linear_f32 (blocks.h): one call per tile.
template <int KIND>
void linear_f32_few(const LinearCall& a) {
  const int64_t nb = a.K / QK, M = a.M, K = a.K, N = a.N;
  // NOTE: 64-byte aligned (no input load splits a cache line); K % 32 == 0 so the size is too
  float* xp = static_cast<float*>(std::aligned_alloc(64, sizeof(float) * M * K));
  pack_halves(a.x, M, K, xp);
  const int64_t tiles = (N + TILE - 1) / TILE;
  pool::parallel_for(tiles, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const uint16_t* s = a.sc + t * nb * kSC<KIND>;
      const uint8_t* q = a.qs + t * nb * TILE * kQB<KIND>;
      Ahead next;  // NOTE: the following tile, block by block while this one's scales convert
      if (t + 1 < tiles) next = {s + nb * kSC<KIND>, q + nb * TILE * kQB<KIND>};
      tile_rows_few<KIND>(M, xp, K, s, q, a.y + t * TILE, N, N - t * TILE, next);
    }
  });
  std::free(xp);
}
