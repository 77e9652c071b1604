// Multi-row f32 tiles of blocks.h for the scalar and AVX2 builds (issues 18, 21; T4): a tile's
// weights decoded ONCE per call into a float buffer, then every row of the call run over it as a
// small float GEMM. Included by blocks.h inside namespace blocks (AVX-512 keeps its own tiles,
// blocks_avx512.h).
//
// Why: a decode step of M rows (or a verification of k drafted tokens: k + 1 rows) used to decode
// each tile once per call of <= 4 rows (AVX2's 16 ymm hold 4 rows' 16-lane accumulators), so an
// extra row paid a share of the decode, and each step of the 16-lane accumulator fed only half
// its registers. Here the decode (per weight: shift, mask, convert, one fma) is paid once per
// tile for all M rows, and an extra row costs its FMAs (one per 8 weights) and its loads. Used
// from GEMM_FROM rows (below that the buffer's stores cost more than they save).
//
// The order is unchanged (isa.h's lanes16-v2, blocks.h's file comment): output (r, c)'s lanes
// 0..7 take sub-vectors V = 0, 2 of each block, lanes 8..15 V = 1, 3, each lane one fma chain in
// increasing k; the two halves are independent chains, so they run in two passes over K ("half"
// h = 0, then 1), each holding one 8-lane register per (row, output): 12 outputs live at once.
// The pass-0 lanes wait in memory; tree16 then joins them with pass 1's, as micro_f32 does.
// K runs in chunks of <= 20 blocks (decoded chunk <= 20 KiB, a group's inputs <= 15 KiB: L1;
// K = 576 is one chunk, 1536 three), the lanes stored and reloaded between chunks (exactly: the
// chains go on unchanged). Chunks of 8 blocks measured slower at K = 576 (more passes).
// Weights are the same single-rounding fma(q, d, m) (dequant8), stored as floats and read back:
// the same values. So every output has the bits of blocks.h's one-row tile.
#pragma once

// Decoded chunk layout (nc blocks): per half h, per output pair p, per block b, per j
// (V = h + 2 j), per output c of the pair: 8 floats. NOTE: a pass (h, outputs c0..) then streams
// its weights contiguously (a 1 KiB block stride maps them onto a few L1 sets)
constexpr int64_t kWdBlock = 4 * TILE * 8;  // floats per decoded tile-block
constexpr int64_t kChunk = 20;              // blocks per K chunk (at most)

inline int64_t wd_at(int64_t nc, int h, int c, int64_t b, int j) {
  return ((h * (TILE / 2) + c / 2) * nc + b) * 32 + j * 16 + (c % 2) * 8;
}

template <int KIND, int V, int c = 0>
inline void decode_v(const uint8_t* q, const float* d, const float* m, float* wd, int64_t nc,
                     int64_t b) {
  // NOTE: c a template constant: the dword layout's shift is an immediate (dequant8)
  store8(wd + wd_at(nc, V % 2, c, b, V / 2), dequant8<kQ8<KIND>, V>(q, c, d[c], m[c]));
  if constexpr (c + 1 < TILE) decode_v<KIND, V, c + 1>(q, d, m, wd, nc, b);
}

// nc blocks of a tile (its sc and qs from the chunk's first block) -> wd (the layout above).
template <int KIND>
void decode_chunk(int64_t nc, const uint16_t* sc, const uint8_t* qs, float* wd) {
  float d[8], m[8];
  for (int64_t b = 0; b < nc; ++b) {
    scales8<KIND>(sc + b * kSC<KIND>, d, m);
    const uint8_t* q = qs + b * TILE * kQB<KIND>;
    decode_v<KIND, 0>(q, d, m, wd, nc, b);
    decode_v<KIND, 1>(q, d, m, wd, nc, b);
    decode_v<KIND, 2>(q, d, m, wd, nc, b);
    decode_v<KIND, 3>(q, d, m, wd, nc, b);
  }
}

// R rows x C outputs (c0..c0 + C), half h of the 16 lanes, over a chunk's nc blocks: acc[r][c]
// the lanes 8 h..8 h + 7 of output c0 + c, carried in and out. xb: the chunk's first block of
// the group's rows, packed per block (pack_rows: row r of block b at xb[(b R + r) 32]).
template <int R, int C>
inline void gemm_half(const float* xb, const float* wd, int64_t nc, int h, int c0,
                      F8 acc[R][C]) {
  const float* w0 = wd + wd_at(nc, h, c0, 0, 0);
  const float* w1 = wd + wd_at(nc, h, c0 + 2, 0, 0);  // NOTE: C = 4: the second pair's stream
  for (int64_t b = 0; b < nc; ++b) {
    const float* x = xb + b * R * QK + 8 * h;
    for (int j = 0; j < 2; ++j) {  // NOTE: V = h + 2 j: inputs 8 V.. of the block, in order
      F8 wc[C];
      for (int c = 0; c < C; ++c) wc[c] = load8((c < 2 ? w0 : w1) + b * 32 + j * 16 + (c % 2) * 8);
      for (int r = 0; r < R; ++r) {
        F8 xr = load8(x + r * QK + 16 * j);
#if CODA_ISA == CODA_AVX2
        // NOTE: one load per input vector, in a register for its C FMAs (GCC folded it into
        // each FMA instead: C loads, and the loads, not the FMAs, bound the loop)
        __asm__("" : "+x"(xr));
#endif
        for (int c = 0; c < C; ++c) acc[r][c] = fma8(wc[c], xr, acc[r][c]);
      }
    }
  }
}

// R rows x one decoded chunk (blocks b0.. of the tile). lanes [R][2][TILE][8]: the rows' lanes
// between chunks; first: they start at +0.0; last: y[r, c] = tree16(lanes of (r, c)), c < ncols.
template <int R>
void tile_gemm(const float* xb, int64_t nc, const float* wd, float* lanes, bool first, bool last,
               float* y, int64_t ldy, int64_t ncols) {
  // NOTE: AVX2's 16 ymm: R C accumulators + C weights + 1 input live (<= 15)
  constexpr int C = R <= 2 ? 4 : 2;
  for (int h = 0; h < 2; ++h)
    for (int c0 = 0; c0 < TILE; c0 += C) {
      F8 acc[R][C];
      for (int r = 0; r < R; ++r)
        for (int c = 0; c < C; ++c)
          acc[r][c] = first ? zero8() : load8(lanes + ((r * 2 + h) * TILE + c0 + c) * 8);
      gemm_half<R, C>(xb, wd, nc, h, c0, acc);
      for (int r = 0; r < R; ++r)
        for (int c = 0; c < C; ++c) {
          float* lo = lanes + ((r * 2) * TILE + c0 + c) * 8;
          if (!last || h == 0) store8(lanes + ((r * 2 + h) * TILE + c0 + c) * 8, acc[r][c]);
          else if (c0 + c < ncols) y[r * ldy + c0 + c] = tree16(F16{load8(lo), acc[r][c]});
        }
    }
}

// Rows one tile_gemm call takes (<= 6: 12 accumulators).
constexpr int64_t GEMM_ROWS = 6;
// Calls of fewer rows decode in registers, no buffer (blocks.h's tiles; 3 and 4 rows
// blocks_rows.h's): the buffer's stores cost more than they save below 5 rows (measured, AVX2:
// 4 rows 1.04x, 8 rows 0.86x the time of the register tiles; docs/quantization.md).
constexpr int64_t GEMM_FROM = 5;

inline void gemm_rows(int64_t R, const float* xb, int64_t nc, const float* wd, float* lanes,
                      bool first, bool last, float* y, int64_t ldy, int64_t ncols) {
  switch (R) {
    case 6: return tile_gemm<6>(xb, nc, wd, lanes, first, last, y, ldy, ncols);
    case 5: return tile_gemm<5>(xb, nc, wd, lanes, first, last, y, ldy, ncols);
    case 4: return tile_gemm<4>(xb, nc, wd, lanes, first, last, y, ldy, ncols);
    case 3: return tile_gemm<3>(xb, nc, wd, lanes, first, last, y, ldy, ncols);
    case 2: return tile_gemm<2>(xb, nc, wd, lanes, first, last, y, ldy, ncols);
    default: return tile_gemm<1>(xb, nc, wd, lanes, first, last, y, ldy, ncols);
  }
}

// The M > 1 rows of linear_f32 (blocks.h): rows in ceil(M / GEMM_ROWS) groups of near-equal size
// (a group's rows packed per block, pack_rows); per tile, per K chunk, one decode, then each
// group's GEMM over it.
template <int KIND>
void linear_f32_rows(const LinearCall& a) {
  const int64_t nb = a.K / QK, M = a.M, K = a.K, N = a.N;
  const int64_t groups = (M + GEMM_ROWS - 1) / GEMM_ROWS;
  const int64_t chunks = (nb + kChunk - 1) / kChunk;
  // NOTE: 64-byte aligned (no input load splits a cache line); K % 32 == 0 so the size is too.
  // malloc, not std::vector: no std template is instantiated in an ISA build (isa.h)
  float* xp = static_cast<float*>(std::aligned_alloc(64, sizeof(float) * M * K));
  for (int64_t g = 0, r = 0; g < groups; ++g) {
    const int64_t rows = (M - r) / (groups - g);
    pack_rows(a.x + r * K, rows, K, xp + r * K);
    r += rows;
  }
  const int64_t tiles = (N + TILE - 1) / TILE;
  pool::parallel_for(tiles, 1, [&](int64_t t0, int64_t t1) {
    // NOTE: per thread run: one decoded chunk (8 KiB) and every row's lanes (512 B a row)
    float* wd = static_cast<float*>(std::aligned_alloc(64, sizeof(float) * kChunk * kWdBlock));
    float* lanes = static_cast<float*>(std::aligned_alloc(64, sizeof(float) * M * 2 * TILE * 8));
    for (int64_t t = t0; t < t1; ++t) {
      const uint16_t* s = a.sc + t * nb * kSC<KIND>;
      const uint8_t* q = a.qs + t * nb * TILE * kQB<KIND>;
      Ahead next;  // NOTE: the following tile, block by block while this one is decoded
      if (t + 1 < tiles) next = {s + nb * kSC<KIND>, q + nb * TILE * kQB<KIND>};
      for (int64_t k = 0; k < chunks; ++k) {
        const int64_t b0 = nb * k / chunks, nc = nb * (k + 1) / chunks - b0;
        for (int64_t b = b0; b < b0 + nc; ++b) next.block<KIND>(b);
        decode_chunk<KIND>(nc, s + b0 * kSC<KIND>, q + b0 * TILE * kQB<KIND>, wd);
        for (int64_t g = 0, r = 0; g < groups; ++g) {
          const int64_t rows = (M - r) / (groups - g);  // NOTE: the last groups take the extra rows
          gemm_rows(rows, xp + r * K + b0 * rows * QK, nc, wd, lanes + r * 2 * TILE * 8, k == 0,
                    k + 1 == chunks, a.y + r * N + t * TILE, N, N - t * TILE);
          r += rows;
        }
      }
    }
    std::free(lanes);
    std::free(wd);
  });
  std::free(xp);
}
