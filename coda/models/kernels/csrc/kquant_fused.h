// The exact-mode K-quant matmul for a few input rows (decode steps; issue 18 item 3), AVX2 and
// AVX-512 builds: each super-block's scales are decoded once per output, its 16 chunks of 16
// weights are decoded straight into registers and multiplied into register accumulators for
// every row of the row tile (no L1 span buffer, no accumulator round trip per span: the span
// kernel of kquant_kernels.h spent half its batch-1 time there).
//
// Bits: a weight is computed by the same float32 operations as kquants.h (an exact product,
// then at most one rounding: fma(q, d1, -m1) equals d1 * q - m1, Q6_K/Q3_K a plain multiply),
// and each output's 16 lanes see their products in increasing k (lane k mod 16), then tree16,
// then + bias: the canonical order of isa.h, so the bits are the span kernel's and the scalar
// build's (tests/test_kernel_isa.py, tests/test_kquant_kernel.py).
#pragma once

#if CODA_ISA != CODA_SCALAR
#define CODA_AI inline __attribute__((always_inline))

// NOTE: the decode (W16, Scales, scales, chunk; AVX2: chunk_avx2, fast_ok) lives in these two
#include "kquant_decode.h"
#include "kquant_decode_avx2.h"
#include "table.h"

namespace coda_native {
namespace CODA_NS {
namespace kq {
namespace fused {

// R rows x G outputs of one type, accumulators in registers over the whole row.
template <int T, int R, int G>
struct Tile {
#if CODA_ISA == CODA_AVX512
  __m512 acc[R][G];
#else
  __m256 lo[R][G], hi[R][G];
#endif

  CODA_AI void zero() {
    for (int r = 0; r < R; ++r)
      for (int g = 0; g < G; ++g) {
#if CODA_ISA == CODA_AVX512
        acc[r][g] = _mm512_setzero_ps();
#else
        lo[r][g] = hi[r][g] = _mm256_setzero_ps();
#endif
      }
  }

#if CODA_ISA == CODA_AVX2
  // NOTE: each output's weights go into its accumulators at once (a W16 per output held across
  // the group spilled the accumulators to the stack)
  template <int I>
  CODA_AI void step_fast(const uint8_t* const* blk, const Scales* s, const float* x,
                         int64_t ldx) {
    static_assert(R == 1, "AVX2 row tile is 1");
    const __m256 x0 = _mm256_loadu_ps(x + 16 * I), x1 = _mm256_loadu_ps(x + 16 * I + 8);
    for (int g = 0; g < G; ++g) {
      const W16 w = chunk_avx2<T, I>(blk[g], s[g]);
      lo[0][g] = _mm256_fmadd_ps(w.lo, x0, lo[0][g]);
      hi[0][g] = _mm256_fmadd_ps(w.hi, x1, hi[0][g]);
    }
    // NOTE: the accumulators in registers at every step (GCC otherwise schedules the unrolled
    // steps into each other and keeps some accumulators on the stack)
    for (int g = 0; g < G; ++g) __asm__("" : "+x"(lo[0][g]), "+x"(hi[0][g]));
  }

  template <int... I>
  CODA_AI void block_fast(const uint8_t* const* blk, const Scales* s, const float* x,
                          int64_t ldx) {
    (step_fast<I>(blk, s, x, ldx), ...);
  }
#endif

  template <int I>
  CODA_AI void step(const uint8_t* const* blk, const Scales* s, const float* x, int64_t ldx) {
    W16 w[G];
    for (int g = 0; g < G; ++g) w[g] = chunk<T, I>(blk[g], s[g]);
    for (int r = 0; r < R; ++r) {
#if CODA_ISA == CODA_AVX512
      const __m512 xv = _mm512_loadu_ps(x + r * ldx + 16 * I);
      for (int g = 0; g < G; ++g) acc[r][g] = _mm512_fmadd_ps(w[g], xv, acc[r][g]);
#else
      const __m256 x0 = _mm256_loadu_ps(x + r * ldx + 16 * I);
      const __m256 x1 = _mm256_loadu_ps(x + r * ldx + 16 * I + 8);
      for (int g = 0; g < G; ++g) {
        lo[r][g] = _mm256_fmadd_ps(w[g].lo, x0, lo[r][g]);
        hi[r][g] = _mm256_fmadd_ps(w[g].hi, x1, hi[r][g]);
      }
#endif
    }
  }

  template <int... I>
  CODA_AI void block(const uint8_t* const* blk, const Scales* s, const float* x, int64_t ldx) {
    (step<I>(blk, s, x, ldx), ...);
  }

  CODA_AI float out(int r, int g) const {
#if CODA_ISA == CODA_AVX512
    return tree16(::coda_native::CODA_NS::F16{acc[r][g]});
#else
    return tree16(::coda_native::CODA_NS::F16{lo[r][g], hi[r][g]});
#endif
  }
};

constexpr int64_t QKK_ = 256;

// Outputs row[0..G) (one type T) for rows x[0..R) of length K; y[r * ldy + g] (+ bias[g]).
template <int T, int R, int G>
inline void run(const uint8_t* const* row, const uint8_t* const* next, const float* x,
                int64_t ldx, int64_t K, const float* bias, float* y, int64_t ldy) {
  constexpr int64_t bb = T == Q2_K ? 84 : T == Q3_K ? 110 : T == Q4_K ? 144 : T == Q5_K ? 176 : 210;
  Tile<T, R, G> t;
  t.zero();
  const int64_t nb = K / QKK_;
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk[G];
    Scales s[G];
    for (int g = 0; g < G; ++g) {
      blk[g] = row[g] + b * bb;
      scales<T>(blk[g], s[g]);
      // NOTE: the next group's rows, super-block by super-block (rows are short streams the
      // hardware prefetcher learns too late; see kquant_kernels.h)
      if (next[g])
        for (int64_t o = 0; o < bb; o += 64) __builtin_prefetch(next[g] + b * bb + o);
    }
    // NOTE: an opaque copy of &s: without it GCC keeps the scales in registers and broadcasts
    // each from there (a shuffle per 16 weights) instead of from memory (embedded broadcasts)
    const Scales* sp = s;
    __asm__("" : "+r"(sp));
#if CODA_ISA == CODA_AVX2
    {
      bool ok = true;
      for (int g = 0; g < G; ++g) ok = ok && fast_ok<T>(blk[g]);
      if (ok) {
        t.template block_fast<0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15>(
            blk, sp, x + b * QKK_, ldx);
        continue;
      }
    }
#endif
    t.template block<0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15>(blk, sp, x + b * QKK_,
                                                                           ldx);
  }
  for (int r = 0; r < R; ++r)
    for (int g = 0; g < G; ++g) {
      const float v = t.out(r, g);
      y[r * ldy + g] = bias ? v + bias[g] : v;
    }
}

// The widest row tile each build keeps in registers with G outputs (AVX-512 at 6..8 rows:
// kquant_tile8.h's 8-row tile, called by kquant_kernels.h's linear).
#if CODA_ISA == CODA_AVX512
constexpr int RT = 4, GMAX = 4;
#else
constexpr int RT = 1, GMAX = 4;
#endif

// Outputs per group for type t: AVX2 runs every type but Q6_K two at a time (measured at batch
// 1, 1B shapes: with four, 8 accumulators beside the decode temporaries in 16 registers
// spilled; Q6_K, whose chunk needs fewer temporaries, is faster at four). Any width gives the
// same bits (each output's order is its own).
inline int gwidth(int32_t t) {
#if CODA_ISA == CODA_AVX2
  return t == Q6_K ? GMAX : 2;
#else
  (void)t;
  return GMAX;
#endif
}

template <int T, int G>
inline void rows_g(const uint8_t* const* row, const uint8_t* const* next, const float* x,
                   int64_t M, int64_t K, const float* bias, float* y, int64_t ldy) {
  int64_t r = 0;
#if CODA_ISA == CODA_AVX512
  for (; r + 4 <= M; r += 4) run<T, 4, G>(row, next, x + r * K, K, K, bias, y + r * ldy, ldy);
  if (M - r == 3) run<T, 3, G>(row, next, x + r * K, K, K, bias, y + r * ldy, ldy);
  if (M - r == 2) run<T, 2, G>(row, next, x + r * K, K, K, bias, y + r * ldy, ldy);
  if (M - r == 1) run<T, 1, G>(row, next, x + r * K, K, K, bias, y + r * ldy, ldy);
#else
  for (; r < M; ++r) run<T, 1, G>(row, next, x + r * K, K, K, bias, y + r * ldy, ldy);
#endif
}

template <int T>
inline void rows(int g, const uint8_t* const* row, const uint8_t* const* next, const float* x,
                 int64_t M, int64_t K, const float* bias, float* y, int64_t ldy) {
  if (g == 4) rows_g<T, 4>(row, next, x, M, K, bias, y, ldy);
  else if (g == 3) rows_g<T, 3>(row, next, x, M, K, bias, y, ldy);
  else if (g == 2) rows_g<T, 2>(row, next, x, M, K, bias, y, ldy);
  else rows_g<T, 1>(row, next, x, M, K, bias, y, ldy);
}

inline bool fits(const KqCall& c, int64_t max_m) {
  if (c.M > max_m || c.K % QKK_ != 0) return false;
  for (int i = 0; i < c.nseg; ++i) {
    const int32_t t = c.segs[i].type;
    if (t != Q2_K && t != Q3_K && t != Q4_K && t != Q5_K && t != Q6_K) return false;
  }
  return true;
}

// Outputs [n0, n1): groups of up to GMAX outputs of one segment.
inline void range(const KqCall& c, int64_t n0, int64_t n1) {
  for_groups(c, n0, n1, [](const KqSeg& q) { return gwidth(q.type); }, [&](const KqGroup& gr) {
    const KqSeg& q = gr.q;
    const int g = gr.g;
    const int gw = gwidth(q.type);
    const uint8_t* row[GMAX];
    const uint8_t* next[GMAX] = {};
    gr.rows(row);
    rows_ahead(c, gr, gr.n + 2 * gw, gw, n1, next);  // two groups ahead, as the span kernel
    const float* bias = q.bias ? q.bias + gr.i0 : nullptr;
    float* y = c.y + gr.n;
    switch (q.type) {
      case Q4_K: rows<Q4_K>(g, row, next, c.x, c.M, c.K, bias, y, c.N); break;
      case Q5_K: rows<Q5_K>(g, row, next, c.x, c.M, c.K, bias, y, c.N); break;
      case Q6_K: rows<Q6_K>(g, row, next, c.x, c.M, c.K, bias, y, c.N); break;
      case Q3_K: rows<Q3_K>(g, row, next, c.x, c.M, c.K, bias, y, c.N); break;
      default: rows<Q2_K>(g, row, next, c.x, c.M, c.K, bias, y, c.N); break;
    }
  });
}

}  // namespace fused
}  // namespace kq
}  // namespace CODA_NS
}  // namespace coda_native

// NOTE: the 8-row tile (AVX-512, M = 8) is in its own file (size); it uses CODA_AI
#include "kquant_tile8.h"

#undef CODA_AI
#endif  // CODA_ISA != CODA_SCALAR
