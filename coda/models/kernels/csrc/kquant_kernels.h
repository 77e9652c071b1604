// Exact-mode linear on GGUF rows read in place, every block type of kquants.h (issue 18; T4).
// Raw pointers only, no torch; each build (isa_*.cpp) includes it in its own namespace.
//
// y[m, n] = sum_k x[m, k] * W[n, k] + bias[n], W decoded bit for bit as gguf.quants.dequantize.
//
// Canonical summation order (the same in every ISA build, so a row's bits are the same on every
// machine): per output, a 16-lane float32 accumulator; the product of input k goes to lane
// k mod 16, lanes updated in increasing k with a fused multiply-add; then the fixed tree
// lane i += lane i + 8 (i < 8), i + 4 (i < 4), i + 2 (i < 2), i + 1 (i < 1); then + bias.
// AVX2 holds the 16 lanes as two 8-lane registers, AVX-512 as one, scalar as an array. (The
// re-laid-out Q4_0/Q4_1/Q8_0 kernel of blocks.h keeps isa.h's 8-lane order; both are fixed.)
//
// Decode once, use for every row: a span of KC weights of one output row is decoded into a
// small L1 buffer and multiplied into the accumulators of every input row of the row block
// (MB rows), whose partial sums wait in a small array between spans. The blocking (MB, KC,
// rows per micro-kernel call, which thread) never changes the order one accumulator is
// updated in, so a row's output bits do not depend on the batch size, its position in the
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

constexpr int64_t KC = 1024;  // weights decoded per span (4 KiB of float32)
constexpr int64_t MB = 64;    // input rows per row block (the x block stays in L2)
constexpr int LANES = 16;

inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

inline float tree16(const float* a) {
  float t[8];
  for (int i = 0; i < 8; ++i) t[i] = a[i] + a[i + 8];
  for (int i = 0; i < 4; ++i) t[i] = t[i] + t[i + 4];
  for (int i = 0; i < 2; ++i) t[i] = t[i] + t[i + 2];
  return t[0] + t[1];
}

// acc[r][16] += w[0:n] * x[r][0:n] in the canonical lane order (n a multiple of 16), R rows.
template <int R>
inline void dot(const float* w, int64_t n, const float* x, int64_t ldx, float* acc) {
#if CODA_ISA == CODA_AVX512
  __m512 a[R];
  for (int r = 0; r < R; ++r) a[r] = _mm512_loadu_ps(acc + r * LANES);
  for (int64_t k = 0; k < n; k += LANES) {
    const __m512 w0 = _mm512_loadu_ps(w + k);
    for (int r = 0; r < R; ++r) a[r] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(x + r * ldx + k), a[r]);
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(acc + r * LANES, a[r]);
#elif CODA_ISA == CODA_AVX2
  __m256 lo[R], hi[R];
  for (int r = 0; r < R; ++r) {
    lo[r] = _mm256_loadu_ps(acc + r * LANES);
    hi[r] = _mm256_loadu_ps(acc + r * LANES + 8);
  }
  for (int64_t k = 0; k < n; k += LANES) {
    const __m256 w0 = _mm256_loadu_ps(w + k), w1 = _mm256_loadu_ps(w + k + 8);
    for (int r = 0; r < R; ++r) {
      lo[r] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + r * ldx + k), lo[r]);
      hi[r] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x + r * ldx + k + 8), hi[r]);
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_ps(acc + r * LANES, lo[r]);
    _mm256_storeu_ps(acc + r * LANES + 8, hi[r]);
  }
#else
  for (int r = 0; r < R; ++r) {
    float a[LANES];
    for (int l = 0; l < LANES; ++l) a[l] = acc[r * LANES + l];
    const float* xr = x + r * ldx;
    for (int64_t k = 0; k < n; k += LANES)
      for (int l = 0; l < LANES; ++l) a[l] = fma1(w[k + l], xr[k + l], a[l]);
    for (int l = 0; l < LANES; ++l) acc[r * LANES + l] = a[l];
  }
#endif
}

// Every input row of the block against one decoded span, R rows per micro-kernel call.
inline void dot_rows(const float* w, int64_t n, const float* x, int64_t ldx, int64_t rows,
                     float* acc) {
  constexpr int R = CODA_ISA == CODA_AVX512 ? 8 : 4;
  int64_t r = 0;
  for (; r + R <= rows; r += R) dot<R>(w, n, x + r * ldx, ldx, acc + r * LANES);
  for (; r < rows; ++r) dot<1>(w, n, x + r * ldx, ldx, acc + r * LANES);
}

// Weights [k0, k0 + n) of a row into buf, or (F32) a pointer into the row itself.
inline const float* span(int32_t type, const uint8_t* row, int64_t k0, int64_t n, float* buf) {
  if (type == F32) return reinterpret_cast<const float*>(row) + k0;  // NOTE: read in place
#if CODA_ISA == CODA_SCALAR
  decode_span(type, row, k0, n, buf);
#else
  decode_span_avx2(type, row, k0, n, buf);
#endif
  return buf;
}

// Outputs [n0, n1) for all M input rows; scratch holds KC + MB * 16 floats.
inline void linear_range(const KqCall& c, int64_t n0, int64_t n1, float* scratch) {
  float* wbuf = scratch;
  float* acc = scratch + KC;
  const int64_t K = c.K;
  for (int64_t m0 = 0; m0 < c.M; m0 += MB) {
    const int64_t mb = min64(MB, c.M - m0);
    const float* xb = c.x + m0 * K;
    int s = 0;
    int64_t first = 0;  // output index of segment s's first row
    for (int64_t n = n0; n < n1; ++n) {
      while (n >= first + c.segs[s].rows) first += c.segs[s++].rows;
      const KqSeg& g = c.segs[s];
      const int64_t i = n - first, fr = g.row_map ? g.row_map[i] : i;
      const uint8_t* row = g.base + fr * g.row_bytes;
      for (int64_t j = 0; j < mb * LANES; ++j) acc[j] = 0.0f;
      for (int64_t k0 = 0; k0 < K; k0 += KC) {
        const int64_t kc = min64(KC, K - k0);
        dot_rows(span(g.type, row, k0, kc, wbuf), kc, xb + k0, K, mb, acc);
      }
      for (int64_t r = 0; r < mb; ++r) {
        const float v = tree16(acc + r * LANES);
        c.y[(m0 + r) * c.N + n] = g.bias ? v + g.bias[i] : v;
      }
    }
  }
}

inline void linear(const KqCall& c) {
  // NOTE: 16 outputs per chunk at least: one span decode per output is the unit of work
  pool::parallel_for(c.N, 16, [&c](int64_t n0, int64_t n1) {
    alignas(64) float scratch[KC + MB * LANES];
    linear_range(c, n0, n1, scratch);
  });
}

inline void gather(const KqSeg& g, int64_t K, const int64_t* ids, int64_t T, float* out) {
  for (int64_t t = 0; t < T; ++t) {
    const int64_t fr = g.row_map ? g.row_map[ids[t]] : ids[t];
#if CODA_ISA == CODA_SCALAR
    decode_span(g.type, g.base + fr * g.row_bytes, 0, K, out + t * K);
#else
    decode_span_avx2(g.type, g.base + fr * g.row_bytes, 0, K, out + t * K);
#endif
  }
}

}  // namespace kq
}  // namespace CODA_NS
}  // namespace coda_native
