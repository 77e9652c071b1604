// packed-q8 K-quant dots in registers (AVX2 and AVX-512 builds; issue 18): M >= 2 (one
// output's codes serve four activation rows per reduction) and the dispatch over a segment's
// outputs. The block dots and why the bits equal kquants_q8.h's portable path whatever the
// grouping are in kquants_q8_blk.h; M = 1 is kquants_q8_row.h.
#pragma once
#include <cstdint>

#include "kquants_q8_row.h"
#include "kquants_q8_row512.h"

#if CODA_ISA != CODA_SCALAR
namespace coda_native {
namespace CODA_NS {
namespace kq {
namespace q8s {

// M >= 2: one output (row) for every activation row, four rows per reduction; dx2 holds per
// (quad q, block b) the 8 lanes' d_x ([dx of row 4q, twice, row 4q + 1, twice, ...]); acc has
// 8 floats per quad.
template <int T>
inline void rows4(const uint8_t* row, const uint8_t* next, int64_t M, int64_t K, int64_t nb,
                  int64_t bb, const int8_t* xq, const int16_t* bs, const float* dx2, float* acc,
                  const float* bias, float* y, int64_t ldy) {
  const int64_t Mq = (M + 3) / 4;
  for (int64_t i = 0; i < 8 * Mq; ++i) acc[i] = 0.0f;
  for (int64_t b = 0; b < nb; ++b) {
    if (next) prefetch_block(next + b * bb, bb);
    Blk<T> w;
    load_blk<T>(row + b * bb, w);
    const __m256 d = _mm256_cvtph_ps(_mm_set1_epi32(static_cast<int>(w.dd)));
    for (int64_t q = 0; q < Mq; ++q) {
      __m256i is[4], ms[4];
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) {
        const int64_t r = 4 * q + j < M ? 4 * q + j : M - 1;  // NOTE: padding lanes unused
        const __m256i bsum =
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bs + (r * nb + b) * 16));
        dot<T>(w, xq + r * K + b * QKK, bsum, is[j], ms[j]);
      }
      const __m256 s = _mm256_mul_ps(d, _mm256_loadu_ps(dx2 + (q * nb + b) * 8));
      _mm256_storeu_ps(acc + 8 * q, _mm256_fmadd_ps(_mm256_cvtepi32_ps(reduce8(is, ms)), s,
                                                    _mm256_loadu_ps(acc + 8 * q)));
    }
  }
  for (int64_t r = 0; r < M; ++r) {
    const float v = acc[2 * r] - acc[2 * r + 1];
    y[r * ldy] = bias ? v + *bias : v;
  }
}

// dx [M, nb] -> dx2 [(M + 3) / 4, nb, 8] (rows past M repeat row M - 1).
inline void spread_dx(const float* dx, int64_t M, int64_t nb, float* dx2) {
  for (int64_t q = 0; q < (M + 3) / 4; ++q)
    for (int64_t b = 0; b < nb; ++b)
      for (int j = 0; j < 8; ++j) {
        const int64_t r = 4 * q + j / 2 < M ? 4 * q + j / 2 : M - 1;
        dx2[(q * nb + b) * 8 + j] = dx[r * nb + b];
      }
}

template <int T>
inline void group(const uint8_t* const* row, const uint8_t* const* next, int g, const KqCall& c,
                  const int8_t* xq, const int16_t* bs, const float* dx, const float* dx2,
                  const X1& x1, float* acc, int64_t bb, const float* bias, float* y) {
  const int64_t nb = c.K / QKK;
  if (c.M == 1) {
#if CODA_ISA == CODA_AVX512
    if constexpr (T == Q4_K || T == Q5_K || T == Q6_K) {
      if (x1.xp) {  // NOTE: kquants_q8_row512.h (the same bits as row1 / outputs4)
        for (int j = 0; j < g; ++j) {
          const float v = row1x<T>(row[j], next[j], nb, bb, xq, bs, x1, dx);
          y[j] = bias ? v + bias[j] : v;
        }
        return;
      }
    }
#else
    (void)x1;
#endif
    if constexpr (T == Q4_K || T == Q6_K) {
      for (int j = 0; j < g; ++j) {
        const float v = row1<T>(row[j], next[j], nb, bb, xq, bs, dx);
        y[j] = bias ? v + bias[j] : v;
      }
    } else {
      outputs4<T>(row, next, g, nb, bb, xq, bs, dx, bias, y);
    }
    return;
  }
  for (int j = 0; j < g; ++j)
    rows4<T>(row[j], j + 1 < g ? row[j + 1] : next[0], c.M, c.K, nb, bb, xq, bs, dx2, acc,
             bias ? bias + j : nullptr, y + j, c.N);
}

constexpr int G = 4;

// Outputs [n0, n1) of K-quant segments: groups of up to G outputs of one segment. acc: 8 floats
// per 4 activation rows.
inline void range(const KqCall& c, const int8_t* xq, const int16_t* bs, const float* dx,
                  const float* dx2, const X1& x1, int64_t n0, int64_t n1, float* acc) {
  const int64_t nb = c.K / QKK;
  for_groups(c, n0, n1, [](const KqSeg&) { return G; }, [&](const KqGroup& gr) {
    const KqSeg& q = gr.q;
    const int g = gr.g;
    const uint8_t* row[G];
    const uint8_t* next[G] = {nullptr, nullptr, nullptr, nullptr};
    gr.rows(row);
    // NOTE: the next group's rows (prefetched block by block while this group runs)
    rows_ahead(c, gr, gr.n + g, G, n1, next);
    const float* bias = q.bias ? q.bias + gr.i0 : nullptr;
    const int64_t bb = q.row_bytes / nb;
    float* y = c.y + gr.n;
    switch (q.type) {
      case Q4_K: group<Q4_K>(row, next, g, c, xq, bs, dx, dx2, x1, acc, bb, bias, y); break;
      case Q6_K: group<Q6_K>(row, next, g, c, xq, bs, dx, dx2, x1, acc, bb, bias, y); break;
      case Q5_K: group<Q5_K>(row, next, g, c, xq, bs, dx, dx2, x1, acc, bb, bias, y); break;
      case Q3_K: group<Q3_K>(row, next, g, c, xq, bs, dx, dx2, x1, acc, bb, bias, y); break;
      default: group<Q2_K>(row, next, g, c, xq, bs, dx, dx2, x1, acc, bb, bias, y); break;
    }
  });
}

}  // namespace q8s
}  // namespace kq
}  // namespace CODA_NS
}  // namespace coda_native
#endif  // CODA_ISA != CODA_SCALAR
