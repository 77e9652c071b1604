// Exact-mode linear on GGUF rows read in place, every block type of kquants.h (issue 18; T4).
// Raw pointers only: no torch, no threads (the caller splits the outputs over its threads).
//
// y[m, n] = sum_k x[m, k] * W[n, k] + bias[n], W decoded bit for bit as gguf.quants.dequantize.
//
// Canonical summation order (the same in every ISA build, so a row's bits are the same on every
// machine): per output, a 16-lane float32 accumulator; the product of input k goes to lane
// k mod 16, lanes updated in increasing k with a fused multiply-add; then the fixed tree
// lane i += lane i + 8 (i < 8), i + 4 (i < 4), i + 2 (i < 2), i + 1 (i < 1); then + bias.
// AVX2 holds the 16 lanes as two 8-lane registers, AVX-512 as one, scalar as an array.
//
// Decode once, use for every row: a span of KC weights of one output row is decoded into a
// small L1 buffer and multiplied into the accumulators of every input row of the row block
// (MB rows), whose partial sums wait in a small array between spans. The blocking (MB, KC,
// rows per micro-kernel call, which thread) never changes the order one accumulator is
// updated in, so a row's output bits do not depend on the batch size, its position in the
// batch or the thread count.
#pragma once
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "kquants.h"
#include "kquants_avx2.h"

namespace kq {

enum Isa : int32_t { SCALAR = 0, AVX2 = 1, AVX512 = 2 };

constexpr int64_t KC = 1024;  // weights decoded per span (4 KiB of float32)
constexpr int64_t MB = 64;    // input rows per row block (x block stays in L2)
constexpr int LANES = 16;

// One weight tensor as the file stores it: rows of row_bytes bytes from base; output n of the
// segment reads file row row_map[n] (llama.cpp's q/k order) or row n; bias (float32) or null.
struct Seg {
  const uint8_t* base;
  int64_t rows;
  int64_t row_bytes;
  int32_t type;
  const int32_t* row_map;
  const float* bias;
};

inline float tree16(const float* a) {
  float t[8];
  for (int i = 0; i < 8; ++i) t[i] = a[i] + a[i + 8];
  for (int i = 0; i < 4; ++i) t[i] = t[i] + t[i + 4];
  for (int i = 0; i < 2; ++i) t[i] = t[i] + t[i + 2];
  return t[0] + t[1];
}

// acc[r][16] += w[0:n] * x[r][0:n] in the canonical lane order (n a multiple of 16).
template <int R>
inline void dot_scalar(const float* w, int64_t n, const float* x, int64_t ldx, float* acc) {
  for (int r = 0; r < R; ++r) {
    float a[LANES];
    for (int l = 0; l < LANES; ++l) a[l] = acc[r * LANES + l];
    const float* xr = x + r * ldx;
    for (int64_t k = 0; k < n; k += LANES)
      for (int l = 0; l < LANES; ++l) a[l] = std::fma(w[k + l], xr[k + l], a[l]);
    for (int l = 0; l < LANES; ++l) acc[r * LANES + l] = a[l];
  }
}

template <int R>
__attribute__((target("avx2,fma"))) inline void dot_avx2(const float* w, int64_t n,
                                                        const float* x, int64_t ldx, float* acc) {
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
}

template <int R>
__attribute__((target("avx512f"))) inline void dot_avx512(const float* w, int64_t n,
                                                          const float* x, int64_t ldx, float* acc) {
  __m512 a[R];
  for (int r = 0; r < R; ++r) a[r] = _mm512_loadu_ps(acc + r * LANES);
  for (int64_t k = 0; k < n; k += LANES) {
    const __m512 w0 = _mm512_loadu_ps(w + k);
    for (int r = 0; r < R; ++r) a[r] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(x + r * ldx + k), a[r]);
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(acc + r * LANES, a[r]);
}

template <int ISA, int R>
inline void dot(const float* w, int64_t n, const float* x, int64_t ldx, float* acc) {
  if (ISA == AVX512) dot_avx512<R>(w, n, x, ldx, acc);
  else if (ISA == AVX2) dot_avx2<R>(w, n, x, ldx, acc);
  else dot_scalar<R>(w, n, x, ldx, acc);
}

// Every input row of the block against one decoded span, R rows per micro-kernel call.
template <int ISA>
inline void dot_rows(const float* w, int64_t n, const float* x, int64_t ldx, int64_t rows,
                     float* acc) {
  constexpr int R = ISA == AVX512 ? 8 : 4;
  int64_t r = 0;
  for (; r + R <= rows; r += R) dot<ISA, R>(w, n, x + r * ldx, ldx, acc + r * LANES);
  for (; r < rows; ++r) dot<ISA, 1>(w, n, x + r * ldx, ldx, acc + r * LANES);
}

// Scratch floats one call of linear_range needs (one thread's buffer).
constexpr int64_t scratch_floats() { return KC + MB * LANES; }

// Whether a segment table fits K: known types, K a multiple of every block size and of 16.
inline bool segs_fit(const Seg* segs, int nseg, int64_t K) {
  if (K <= 0 || K % LANES) return false;
  for (int s = 0; s < nseg; ++s) {
    const int64_t bs = block_size(segs[s].type);
    if (bs == 0 || K % bs || segs[s].row_bytes != K / bs * block_bytes(segs[s].type))
      return false;
  }
  return true;
}

// Outputs [n0, n1) of the concatenated segments for all M input rows: y[m * ldy + n].
template <int ISA>
void linear_range(const float* x, int64_t M, int64_t K, const Seg* segs, int nseg, int64_t n0,
                  int64_t n1, float* y, int64_t ldy, float* scratch) {
  float* wbuf = scratch;
  float* acc = scratch + KC;
  for (int64_t m0 = 0; m0 < M; m0 += MB) {
    const int64_t mb = std::min(MB, M - m0);
    const float* xb = x + m0 * K;
    int s = 0;
    int64_t first = 0;  // global output index of segment s's first row
    for (int64_t n = n0; n < n1; ++n) {
      while (n >= first + segs[s].rows) first += segs[s++].rows;
      const Seg& g = segs[s];
      const int64_t i = n - first, fr = g.row_map ? g.row_map[i] : i;
      const uint8_t* row = g.base + fr * g.row_bytes;
      std::fill(acc, acc + mb * LANES, 0.0f);
      for (int64_t k0 = 0; k0 < K; k0 += KC) {
        const int64_t kc = std::min(KC, K - k0);
        const float* w = wbuf;
        if (g.type == F32) w = reinterpret_cast<const float*>(row) + k0;  // NOTE: read in place
        else if (ISA == SCALAR) decode_span(g.type, row, k0, kc, wbuf);
        else decode_span_avx2(g.type, row, k0, kc, wbuf);
        dot_rows<ISA>(w, kc, xb + k0, K, mb, acc);
      }
      const float b = g.bias ? g.bias[i] : 0.0f;
      for (int64_t r = 0; r < mb; ++r) {
        const float v = tree16(acc + r * LANES);
        y[(m0 + r) * ldy + n] = g.bias ? v + b : v;
      }
    }
  }
}

inline void linear_range_isa(int32_t isa, const float* x, int64_t M, int64_t K, const Seg* segs,
                             int nseg, int64_t n0, int64_t n1, float* y, int64_t ldy,
                             float* scratch) {
  if (isa == AVX512) linear_range<AVX512>(x, M, K, segs, nseg, n0, n1, y, ldy, scratch);
  else if (isa == AVX2) linear_range<AVX2>(x, M, K, segs, nseg, n0, n1, y, ldy, scratch);
  else linear_range<SCALAR>(x, M, K, segs, nseg, n0, n1, y, ldy, scratch);
}

// Rows ids[0..T) of one segment decoded to out[t * K ...] (token embeddings, gathered from
// the blocks; an id outside the segment is the caller's to refuse).
inline void gather_rows(int32_t isa, const Seg& g, int64_t K, const int64_t* ids, int64_t T,
                        float* out) {
  for (int64_t t = 0; t < T; ++t) {
    const int64_t fr = g.row_map ? g.row_map[ids[t]] : ids[t];
    if (isa == SCALAR) decode_span(g.type, g.base + fr * g.row_bytes, 0, K, out + t * K);
    else decode_span_avx2(g.type, g.base + fr * g.row_bytes, 0, K, out + t * K);
  }
}

}  // namespace kq
