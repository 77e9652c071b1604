// Exact-mode linear on GGUF rows read in place, every block type of kquants.h (issue 18; T4).
// Raw pointers only, no torch; each build (isa_*.cpp) includes it in its own namespace.
//
// y[m, n] = sum_k x[m, k] * W[n, k] + bias[n], W decoded bit for bit as gguf.quants.dequantize.
//
// Summation order: isa.h's canonical order (lanes16-v2), the one every kernel shares: per
// output, a 16-lane float32 accumulator; the product of input k goes to lane k mod 16, lanes
// updated in increasing k with a fused multiply-add; then tree16; then + bias. AVX2 holds the
// 16 lanes as two 8-lane registers, AVX-512 as one, scalar as an array.
//
// Decode batches (AVX-512: up to FUSED_M = 8 rows, 6..8 through the 8-row tile of
// kquant_tile8.h; AVX2: 1) of K-quant tensors run the register kernel of kquant_fused.h instead
// (no span buffer; same operations, same order, same bits); Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0
// tensors of up to LEGACY_M rows (AVX-512: 8, AVX2: 4) run legacy_inplace.h's register kernel
// (the same bits as the span kernel and, Q4 and Q8_0, as blocks.h's re-laid-out tiles). On
// AVX-512, 9..SPLIT_M rows of either run as groups of 8 rows through the 8-row tiles.
// Decode once, use for every row: a span of KC weights of G = 4 output rows is decoded into a
// small L1 buffer and multiplied into the accumulators of every input row of the row block
// (MB rows), whose partial sums wait in a small array between spans; the G outputs run side by
// side as independent FMA chains (a single output's chain is FMA-latency bound). The blocking
// (MB, KC, G, rows per micro-kernel call, which thread) never changes the order one accumulator
// is updated in, so a row's output bits do not depend on the batch size, its position in the
// batch or the thread count; the pool splits the outputs (any split gives the same bits).
#pragma once
#include <cstdint>

#include "isa.h"
#include "kquants.h"
#include "kquants_avx2.h"
#include "pool.h"
#include "table.h"

namespace coda_native {
namespace CODA_NS {
namespace kq {

constexpr int64_t KC = 256;  // weights decoded per span (1 KiB of float32; x spans stay in L1)
constexpr int64_t MB = 64;    // input rows per row block (the x block stays in L2)
constexpr int LANES = 16;

inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

// NOTE: the final tree is isa.h's tree16 (one definition for every kernel).

// Accumulators live in acc[c][r][16] (c < G outputs of the group, r < MB rows) between spans.
inline float* acc_at(float* acc, int c, int64_t r) { return acc + (c * MB + r) * LANES; }

// acc[c][r0 + r] += w[c][0:n] * x[r][0:n] for C outputs (w[c]: a decoded span, or an F32 row's
// own memory) and R input rows, in
// the canonical lane order (n a multiple of 16). C independent chains per row hide the FMA
// latency; each accumulator still sees its products in increasing k.
template <int R, int C>
inline void dot(const float* const* w, int64_t n, const float* x, int64_t ldx, float* acc,
                int64_t r0, bool fresh) {
#if CODA_ISA == CODA_AVX512
  __m512 a[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c)
      a[r][c] = fresh ? _mm512_setzero_ps() : _mm512_loadu_ps(acc_at(acc, c, r0 + r));
  for (int64_t k = 0; k < n; k += LANES) {
    __m512 xv[R];
    for (int r = 0; r < R; ++r) xv[r] = _mm512_loadu_ps(x + r * ldx + k);
    for (int c = 0; c < C; ++c) {
      const __m512 wc = _mm512_loadu_ps(w[c] + k);
      for (int r = 0; r < R; ++r) a[r][c] = _mm512_fmadd_ps(wc, xv[r], a[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(acc_at(acc, c, r0 + r), a[r][c]);
#elif CODA_ISA == CODA_AVX2
  __m256 lo[R][C], hi[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) {
      lo[r][c] = fresh ? _mm256_setzero_ps() : _mm256_loadu_ps(acc_at(acc, c, r0 + r));
      hi[r][c] = fresh ? _mm256_setzero_ps() : _mm256_loadu_ps(acc_at(acc, c, r0 + r) + 8);
    }
  for (int64_t k = 0; k < n; k += LANES) {
    for (int r = 0; r < R; ++r) {
      const __m256 x0 = _mm256_loadu_ps(x + r * ldx + k), x1 = _mm256_loadu_ps(x + r * ldx + k + 8);
      for (int c = 0; c < C; ++c) {
        lo[r][c] = _mm256_fmadd_ps(_mm256_loadu_ps(w[c] + k), x0, lo[r][c]);
        hi[r][c] = _mm256_fmadd_ps(_mm256_loadu_ps(w[c] + k + 8), x1, hi[r][c]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) {
      _mm256_storeu_ps(acc_at(acc, c, r0 + r), lo[r][c]);
      _mm256_storeu_ps(acc_at(acc, c, r0 + r) + 8, hi[r][c]);
    }
#else
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) {
      float* a = acc_at(acc, c, r0 + r);
      if (fresh)
        for (int l = 0; l < LANES; ++l) a[l] = 0.0f;
      const float* xr = x + r * ldx;
      const float* wc = w[c];
      for (int64_t k = 0; k < n; k += LANES)
        for (int l = 0; l < LANES; ++l) a[l] = fma1(wc[k + l], xr[k + l], a[l]);
    }
#endif
}

// Every input row of the block against the group's decoded spans.
template <int C>
inline void dot_rows(const float* const* w, int64_t n, const float* x, int64_t ldx, int64_t rows,
                     float* acc, bool fresh) {
  constexpr int R = CODA_ISA == CODA_AVX512 ? 4 : CODA_ISA == CODA_AVX2 ? 1 : 1;
  int64_t r = 0;
  for (; r + R <= rows; r += R) dot<R, C>(w, n, x + r * ldx, ldx, acc, r, fresh);
  for (; r < rows; ++r) dot<1, C>(w, n, x + r * ldx, ldx, acc, r, fresh);
}

constexpr int G = 4;  // outputs decoded and accumulated side by side

inline void dot_group(int g, const float* const* w, int64_t n, const float* x, int64_t ldx,
                      int64_t rows, float* acc, bool fresh) {
  if (g == 4) dot_rows<4>(w, n, x, ldx, rows, acc, fresh);
  else if (g == 3) dot_rows<3>(w, n, x, ldx, rows, acc, fresh);
  else if (g == 2) dot_rows<2>(w, n, x, ldx, rows, acc, fresh);
  else dot_rows<1>(w, n, x, ldx, rows, acc, fresh);
}

// Weights [k0, k0 + n) of a row into buf (decoded, or copied for F32).
inline void span(int32_t type, const uint8_t* row, int64_t k0, int64_t n, float* buf) {
#if CODA_ISA == CODA_SCALAR
  decode_span(type, row, k0, n, buf);
#else
  decode_span_avx2(type, row, k0, n, buf);
#endif
}

constexpr int64_t SCRATCH = G * KC + G * MB * LANES;  // floats of one chunk's scratch

// Outputs [n0, n1) for all M input rows, G outputs at a time.
inline void linear_range(const KqCall& c, int64_t n0, int64_t n1, float* scratch) {
  float* wbuf = scratch;
  float* acc = scratch + G * KC;
  const int64_t K = c.K;
  for (int64_t m0 = 0; m0 < c.M; m0 += MB) {
    const int64_t mb = min64(MB, c.M - m0);
    const float* xb = c.x + m0 * K;
    int s = 0;
    int64_t first = 0;  // output index of segment s's first row
    for (int64_t nb = n0; nb < n1; nb += G) {
      const int g = static_cast<int>(min64(G, n1 - nb));
      const KqSeg* seg[G];
      const uint8_t* row[G];
      int64_t idx[G];
      for (int j = 0; j < g; ++j) {
        locate(c, nb + j, s, first);
        seg[j] = &c.segs[s];
        idx[j] = nb + j - first;
        row[j] = seg[j]->row(idx[j]);
      }
      // NOTE: the rows two groups ahead are prefetched span by span: rows are short streams (a
      // few KiB) the hardware prefetcher does not learn in time (measured on a 49152-row Q6_K
      // head, 1 thread: 86 ms without, 28 ms one group ahead, 15 ms two groups ahead)
      const uint8_t* next[G];
      int64_t nrb = 0;
      const int gn = static_cast<int>(min64(G, n1 - nb - 2 * G));
      for (int j = 0; j < gn; ++j) {
        int64_t f = first;
        int t = s;
        while (nb + 2 * G + j >= f + c.segs[t].rows) f += c.segs[t++].rows;
        const KqSeg& q = c.segs[t];
        const int64_t i = nb + 2 * G + j - f;
        next[j] = q.row(i);
        nrb = q.row_bytes;
      }
      bool f32 = true;
      for (int j = 0; j < g; ++j) f32 = f32 && seg[j]->type == ggml::F32;
      // NOTE: F32 rows need no span buffer: longer spans keep the accumulators in registers
      // (prefill 512 rows: 1B layer 0.85x -> 0.90x F.linear; one row streams better in short)
      const int64_t step = f32 && mb > 1 ? 4 * KC : KC;
      for (int64_t k0 = 0; k0 < K; k0 += step) {
        const int64_t kc = min64(step, K - k0);
        const int64_t b0 = k0 * nrb / K, b1 = (k0 + kc) * nrb / K;
        for (int j = 0; j < gn; ++j)
          for (int64_t o = b0; o < b1; o += 64) __builtin_prefetch(next[j] + o);
        const float* wp[G];
        for (int j = 0; j < g; ++j) {
          // NOTE: F32 rows are read where they lie (the dense fp32-kernel mode): a copy into
          // wbuf cost a third of the batch-1 time; the products and their order are the same
          if (seg[j]->type == ggml::F32) {
            wp[j] = reinterpret_cast<const float*>(row[j]) + k0;
          } else {
            span(seg[j]->type, row[j], k0, kc, wbuf + j * KC);
            wp[j] = wbuf + j * KC;
          }
        }
        // NOTE: the first span starts every accumulator at +0.0 in registers (no zeroed array)
        dot_group(g, wp, kc, xb + k0, K, mb, acc, k0 == 0);
      }
      for (int j = 0; j < g; ++j)
        for (int64_t r = 0; r < mb; ++r) {
          const float v = tree16(acc_at(acc, j, r));
          c.y[(m0 + r) * c.N + nb + j] = seg[j]->bias ? v + seg[j]->bias[idx[j]] : v;
        }
    }
  }
}

}  // namespace kq
}  // namespace CODA_NS
}  // namespace coda_native

#include "kquant_fused.h"
#include "legacy_inplace.h"

namespace coda_native {
namespace CODA_NS {
namespace kq {

// NOTE: input rows up to which the register kernel (kquant_fused.h) beats the span kernel
// (which decodes a span once for up to MB rows); the same bits either way
#if CODA_ISA == CODA_AVX512
constexpr int64_t FUSED_M = 8;
#else
constexpr int64_t FUSED_M = 1;
#endif
// NOTE: input rows up to which legacy_inplace.h's register kernel runs legacy blocks (RT
// rows per call, the group's rows re-read from L1); measured against the span kernel, 4096 x
// 2048, 1 thread: AVX-512 0.40-0.64x the time at 1 row, 0.61-0.69x at 4, 0.84-0.93x at 8,
// 1.02-1.25x at 16; AVX2 0.56-0.64x at 1, 0.70-0.77x at 4, 1.01-1.06x at 8
#if CODA_ISA == CODA_AVX512
constexpr int64_t LEGACY_M = 8;
#else
constexpr int64_t LEGACY_M = 4;
#endif

#if CODA_ISA == CODA_AVX512
// NOTE: input rows up to which a batch runs as groups of 8 through the 8-row tiles (the span
// kernel past it); measured against the span kernel (4096 x 2048, 1 thread, Emerald Rapids
// class): Q4_0 0.66x the time at 9 rows, 0.83x at 12, 0.85x at 16, 0.70x at 24, 0.73x at 32;
// Q4_K 0.74-0.92x, Q6_K 0.81-0.97x
constexpr int64_t SPLIT_M = 32;
#endif

inline void linear(const KqCall& c) {
#if CODA_ISA == CODA_AVX512
  // NOTE: 9..SPLIT_M rows: the 8-row tile on each group of 8 rows (the rest through the kernels
  // below), not the span kernel; a row's bits are its own (T4), so the same bits
  if (c.M > fused::R8 && c.M <= SPLIT_M && (fused::fits(c, c.M) || legacy::fits(c, c.M))) {
    for (int64_t r0 = 0; r0 < c.M; r0 += fused::R8) {
      KqCall g = c;
      g.x = c.x + r0 * c.K, g.M = min64(fused::R8, c.M - r0), g.y = c.y + r0 * c.N;
      linear(g);
    }
    return;
  }
  // NOTE: 6..8 rows: one 8-row tile, kquant_tile8.h's
  // (K-quant segments) or legacy_tile8.h's (legacy blocks), on x packed once per call (shared
  // by the threads), not two row tiles that decode every weight twice; the same bits
  const bool kq8 = fused::fits(c, FUSED_M), legacy8 = !kq8 && legacy::fits(c, LEGACY_M);
  if (c.M >= fused::TILE8_MIN && (kq8 || legacy8)) {
    // malloc, not std::vector: no std template is instantiated in an ISA build (isa.h)
    float* xp = static_cast<float*>(std::aligned_alloc(64, sizeof(float) * fused::R8 * c.K));
    if (xp) {
      fused::pack8(c.x, c.M, c.K, xp);
      pool::parallel_for(c.N, 16, [&c, xp, kq8](int64_t n0, int64_t n1) {
        if (kq8) fused::range8(c, xp, n0, n1);
        else legacy::range8(c, xp, n0, n1);
      });
      std::free(xp);
      return;
    }
  }
#endif
#if CODA_ISA != CODA_SCALAR
  // NOTE: Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 rows: legacy_inplace.h's register kernel (same bits)
  if (legacy::fits(c, LEGACY_M)) {
    pool::parallel_for(c.N, 16, [&c](int64_t n0, int64_t n1) { legacy::range(c, n0, n1); });
    return;
  }
  if (fused::fits(c, FUSED_M)) {
    pool::parallel_for(c.N, 16, [&c](int64_t n0, int64_t n1) { fused::range(c, n0, n1); });
    return;
  }
#endif
  // NOTE: chunks of 16 outputs at least (4 groups); any split gives the same bits
  pool::parallel_for(c.N, 16, [&c](int64_t n0, int64_t n1) {
    alignas(64) float scratch[SCRATCH];
    linear_range(c, n0, n1, scratch);
  });
}

inline void gather(const KqSeg& g, int64_t K, const int64_t* ids, int64_t T, float* out) {
  for (int64_t t = 0; t < T; ++t) {
    span(g.type, g.row(ids[t]), 0, K, out + t * K);
  }
}

}  // namespace kq
}  // namespace CODA_NS
}  // namespace coda_native
