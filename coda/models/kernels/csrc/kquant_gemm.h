// Exact-mode K-quant matmul for decode batches of GEMM_FROM or more rows, AVX2 build (issue 18;
// T4): a tile of GT outputs is decoded ONCE per K chunk into a float buffer, and every row of the
// call runs over it as a small float GEMM. Included by kquant_fused.h (namespace fused), whose
// decode (scales, chunk, chunk_avx2) it reuses; AVX-512 keeps its register row tiles.
//
// Why: the register kernel (kquant_fused.h) holds one row's 16-lane accumulators per output in
// AVX2's 16 ymm, so each extra row decoded every weight again; the span kernel (kquant_kernels.h)
// decodes once but feeds one row at a time (two weight loads per two FMAs: load bound). Here
// the decode is paid once per tile for all M rows, and a row costs its FMAs and input loads.
//
// Bits: the weights are the floats the register kernel multiplies (the same chunk_avx2, or
// chunk() for a block chunk_avx2 may not run: equal values wherever both run), stored and read
// back unchanged. Each output's order is isa.h's lanes16-v2: lane l (0..15) is one fma chain
// over the weights k = l mod 16 in increasing k, from +0.0; then tree16; then + bias. Lanes
// 0..7 and 8..15 are independent chains, so they run in two passes ("half" h = 0, then 1), each
// holding one 8-lane register per (row, output); K runs in chunks whose lanes are stored and
// reloaded between chunks (exactly: the chains go on unchanged). So every output has the bits
// of the one-row register kernel and of the scalar build (tests/test_kquant_rows.py).
#pragma once

#include <cstdlib>
#include <cstring>

namespace coda_native {
namespace CODA_NS {
namespace kq {
namespace fused {

#if CODA_ISA == CODA_AVX2
constexpr int GT = 4;              // outputs per decoded tile (one segment, one type)
constexpr int64_t GEMM_ROWS = 6;   // rows per GEMM call (<= 6: 12 accumulators)
constexpr int64_t GEMM_FROM = 2;   // fewer rows keep the register / span kernels (measured)
constexpr int64_t GEMM_MAX = 64;   // more rows (prefill) keep the span kernel

// Decoded chunk of n16 16-weight groups: per half h, per output pair p, per group i, per output
// c of the pair: 8 floats (a pass (h, pair) then streams its weights contiguously).
CODA_AI int64_t wd_at(int64_t n16, int h, int c, int64_t i) {
  return ((h * (GT / 2) + c / 2) * n16 + i) * 16 + (c % 2) * 8;
}

template <int T, bool FAST, int I>
CODA_AI void dec(const uint8_t* blk, const Scales& s, float* wd, int64_t n16, int c, int64_t i0) {
  const W16 w = FAST ? chunk_avx2<T, I>(blk, s) : chunk<T, I>(blk, s);
  _mm256_store_ps(wd + wd_at(n16, 0, c, i0 + I), w.lo);
  _mm256_store_ps(wd + wd_at(n16, 1, c, i0 + I), w.hi);
}

template <int T, bool FAST, int... I>
CODA_AI void dec_block(const uint8_t* blk, const Scales& s, float* wd, int64_t n16, int c,
                       int64_t i0) {
  (dec<T, FAST, I>(blk, s, wd, n16, c, i0), ...);
}

// One super-block of output c into the chunk buffer at group i0.
template <int T>
inline void decode_block(const uint8_t* blk, float* wd, int64_t n16, int c, int64_t i0) {
  Scales s;
  scales<T>(blk, s);
  // NOTE: per output, where the register kernel decides per group: for a block both may run,
  // chunk_avx2 and chunk give the same values (tests/test_kquant_fused_paths.py)
  if (fast_ok<T>(blk))
    dec_block<T, true, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15>(blk, s, wd, n16, c, i0);
  else
    dec_block<T, false, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15>(blk, s, wd, n16, c,
                                                                              i0);
}

// R rows x C outputs (c0..), half h, over the chunk's nc blocks: acc[r][c] carried in and out;
// x: the chunk's first block of the group's first row, packed (pack_blocks: block stride bs).
template <int R, int C>
CODA_AI void gemm_half(const float* x, int64_t bs, const float* wd, int64_t nc, int h, int c0,
                       __m256 acc[R][C]) {
  const int64_t n16 = nc * 16;
  const float* w0 = wd + wd_at(n16, h, c0, 0);
  const float* w1 = wd + wd_at(n16, h, c0 + 2 < GT ? c0 + 2 : c0, 0);  // NOTE: C = 4's 2nd pair
  for (int64_t b = 0; b < nc; ++b, x += bs, w0 += 256, w1 += 256)
    for (int i = 0; i < 16; ++i) {
      __m256 wc[C];
      for (int c = 0; c < C; ++c) wc[c] = _mm256_load_ps((c < 2 ? w0 : w1) + i * 16 + (c % 2) * 8);
      for (int r = 0; r < R; ++r) {
        __m256 xr = _mm256_load_ps(x + r * QKK_ + 16 * i + 8 * h);
        // NOTE: one load per input vector, held for its C FMAs (as blocks_gemm.h)
        __asm__("" : "+x"(xr));
        for (int c = 0; c < C; ++c) acc[r][c] = _mm256_fmadd_ps(wc[c], xr, acc[r][c]);
      }
    }
}

// R rows over one decoded chunk. lanes [R][2][GT][8]: the rows' lanes between chunks; first:
// they start at +0.0; last: y[r ldy + c] = tree16(lanes of (r, c)) (+ bias[c]), c < g.
template <int R>
void tile_gemm(const float* x, int64_t bs, const float* wd, int64_t nc, float* lanes,
               bool first, bool last, const float* bias, float* y, int64_t ldy, int g) {
  constexpr int C = R <= 2 ? 4 : 2;  // NOTE: R C accumulators + C weights + 1 input <= 15 ymm
  for (int h = 0; h < 2; ++h)
    for (int c0 = 0; c0 < GT; c0 += C) {
      __m256 acc[R][C];
      for (int r = 0; r < R; ++r)
        for (int c = 0; c < C; ++c)
          acc[r][c] = first ? _mm256_setzero_ps()
                            : _mm256_load_ps(lanes + ((r * 2 + h) * GT + c0 + c) * 8);
      gemm_half<R, C>(x, bs, wd, nc, h, c0, acc);
      for (int r = 0; r < R; ++r)
        for (int c = 0; c < C; ++c) {
          if (!last || h == 0) {
            _mm256_store_ps(lanes + ((r * 2 + h) * GT + c0 + c) * 8, acc[r][c]);
          } else if (c0 + c < g) {
            const __m256 lo = _mm256_load_ps(lanes + ((r * 2) * GT + c0 + c) * 8);
            const float v = tree16(::coda_native::CODA_NS::F16{lo, acc[r][c]});
            y[r * ldy + c0 + c] = bias ? v + bias[c0 + c] : v;
          }
        }
    }
}

inline void gemm_rows(int64_t R, const float* x, int64_t bs, const float* wd, int64_t nc,
                      float* lanes, bool first, bool last, const float* bias, float* y,
                      int64_t ldy, int g) {
  switch (R) {
    case 6: return tile_gemm<6>(x, bs, wd, nc, lanes, first, last, bias, y, ldy, g);
    case 5: return tile_gemm<5>(x, bs, wd, nc, lanes, first, last, bias, y, ldy, g);
    case 4: return tile_gemm<4>(x, bs, wd, nc, lanes, first, last, bias, y, ldy, g);
    case 3: return tile_gemm<3>(x, bs, wd, nc, lanes, first, last, bias, y, ldy, g);
    case 2: return tile_gemm<2>(x, bs, wd, nc, lanes, first, last, bias, y, ldy, g);
    default: return tile_gemm<1>(x, bs, wd, nc, lanes, first, last, bias, y, ldy, g);
  }
}

// Super-blocks per K chunk: a chunk's inputs of all M rows (1 KiB a row and block) near 16 KiB
// so that they and the decoded chunk (4 KiB a block) stay in L1.
inline int64_t chunk_blocks(int64_t M, int64_t nb) {
  const int64_t c = M <= 4 ? 4 : 16 / M;
  return c < 1 ? 1 : c > nb ? nb : c;
}

// The tile of g <= GT outputs row[0..g) (type T) for all c.M rows; next: the following tile's
// rows (nrb bytes each, prefetched block by block), y: output 0 of row 0 (row stride c.N).
template <int T>
void tile(const KqCall& c, const float* xp, const uint8_t* const* row, int g, const uint8_t* const* next,
          const int64_t* nrb, int gn, const float* bias, float* y, float* wd, float* lanes) {
  constexpr int64_t bb = T == Q2_K ? 84 : T == Q3_K ? 110 : T == Q4_K ? 144 : T == Q5_K ? 176 : 210;
  const int64_t nb = c.K / QKK_, M = c.M;
  const int64_t per = chunk_blocks(M, nb), chunks = (nb + per - 1) / per;
  const int64_t groups = (M + GEMM_ROWS - 1) / GEMM_ROWS;
  for (int64_t k = 0; k < chunks; ++k) {
    const int64_t b0 = nb * k / chunks, nc = nb * (k + 1) / chunks - b0, n16 = nc * 16;
    for (int j = g; j < GT; ++j)  // NOTE: a tail tile's absent outputs: zeros, never written out
      for (int h = 0; h < 2; ++h)
        for (int64_t i = 0; i < n16; ++i) std::memset(wd + wd_at(n16, h, j, i), 0, 32);
    for (int64_t b = b0; b < b0 + nc; ++b)
      for (int j = 0; j < g; ++j) {
        decode_block<T>(row[j] + b * bb, wd, n16, j, (b - b0) * 16);
        if (j + 1 == g)
          for (int i = 0; i < gn; ++i)
            for (int64_t o = 0; o < nrb[i]; o += 64) __builtin_prefetch(next[i] + b * nrb[i] + o);
      }
    for (int64_t q = 0, r = 0; q < groups; ++q) {
      const int64_t rows = (M - r) / (groups - q);  // NOTE: near-equal groups, the last larger
      gemm_rows(rows, xp + (b0 * M + r) * QKK_, M * QKK_, wd, nc, lanes + r * 2 * GT * 8, k == 0,
                k + 1 == chunks, bias, y + r * c.N, c.N, g);
      r += rows;
    }
  }
}

// Outputs [n0, n1) for all c.M rows: tiles of up to GT outputs of one segment.
inline void gemm_range(const KqCall& c, const float* xp, int64_t n0, int64_t n1) {
  const int64_t per = chunk_blocks(c.M, c.K / QKK_);
  // NOTE: 64-byte aligned (aligned loads); malloc, not std::vector (no std template in an ISA
  // build, isa.h)
  float* wd = static_cast<float*>(std::aligned_alloc(64, sizeof(float) * GT * per * QKK_));
  float* lanes = static_cast<float*>(std::aligned_alloc(64, sizeof(float) * c.M * 2 * GT * 8));
  int s = 0;
  int64_t first = 0;
  auto locate = [&c](int64_t n, int& seg, int64_t& f) {
    while (n >= f + c.segs[seg].rows) f += c.segs[seg++].rows;
  };
  auto at = [](const KqSeg& q, int64_t i) {
    return q.base + (q.row_map ? q.row_map[i] : i) * q.row_bytes;
  };
  for (int64_t n = n0; n < n1;) {
    locate(n, s, first);
    const KqSeg& q = c.segs[s];
    const int64_t i0 = n - first;
    const int g = static_cast<int>(min64(min64(GT, n1 - n), q.rows - i0));
    const uint8_t* row[GT];
    for (int j = 0; j < g; ++j) row[j] = at(q, i0 + j);
    const uint8_t* next[GT];
    int64_t nrb[GT];
    int gn = 0;
    {
      int t = s;
      int64_t f = first;
      for (; gn < GT && n + g + gn < n1; ++gn) {
        locate(n + g + gn, t, f);
        next[gn] = at(c.segs[t], n + g + gn - f);
        nrb[gn] = c.segs[t].row_bytes;
      }
    }
    const float* bias = q.bias ? q.bias + i0 : nullptr;
    float* y = c.y + n;
    switch (q.type) {
      case Q4_K: tile<Q4_K>(c, xp, row, g, next, nrb, gn, bias, y, wd, lanes); break;
      case Q5_K: tile<Q5_K>(c, xp, row, g, next, nrb, gn, bias, y, wd, lanes); break;
      case Q6_K: tile<Q6_K>(c, xp, row, g, next, nrb, gn, bias, y, wd, lanes); break;
      case Q3_K: tile<Q3_K>(c, xp, row, g, next, nrb, gn, bias, y, wd, lanes); break;
      default: tile<Q2_K>(c, xp, row, g, next, nrb, gn, bias, y, wd, lanes); break;
    }
    n += g;
  }
  std::free(lanes);
  std::free(wd);
}
// The whole call: the inputs packed per block (xp[(b M + r) 256 + k] = x[r, 256 b + k]: the rows
// of a block contiguous; NOTE: rows K floats apart share L1 sets whenever K * 4 is a multiple
// of 4 KiB, and 8 rows of a block then evicted each other: measured 1.17x the span kernel's
// time at 8 rows unpacked), then the outputs split over the pool (any split: the same bits).
inline void gemm_linear(const KqCall& c) {
  const int64_t nb = c.K / QKK_, M = c.M;
  float* xp = static_cast<float*>(std::aligned_alloc(64, sizeof(float) * M * c.K));
  for (int64_t b = 0; b < nb; ++b)
    for (int64_t r = 0; r < M; ++r)
      std::memcpy(xp + (b * M + r) * QKK_, c.x + r * c.K + b * QKK_, sizeof(float) * QKK_);
  pool::parallel_for(c.N, 16, [&c, xp](int64_t n0, int64_t n1) { gemm_range(c, xp, n0, n1); });
  std::free(xp);
}
#endif  // CODA_ISA == CODA_AVX2

}  // namespace fused
}  // namespace kq
}  // namespace CODA_NS
}  // namespace coda_native
