// The exact-mode K-quant matmul for 8 input rows (batch-8 decode; issue 18 item 3), AVX-512
// build only: one 8-row register tile decodes each 16-weight chunk once for all 8 rows (two
// 4-row tiles of kquant_fused.h decode it twice: per chunk and output 8 FMAs beside two decodes
// of ~3 vector uops each, on the same two 512-bit ports).
//
// Eight rows of x are 8 K floats (64 KiB at K = 2048), more than L1 holds beside the weights, so
// the tile runs K-blocked: x is packed once per call chunk-major ([K / 16][8][16], one base
// pointer and constant offsets: row pointers made GCC keep 128 hoisted addresses on the stack),
// a block of NB8 outputs walks K in spans of KS8 super-blocks (16 KiB of x, which stays in L1
// across the block's tiles), and each tile's 16 accumulators wait in a small array between
// spans (16 loads and 16 stores per 32 chunks of 16 FMAs).
//
// Bits: the same decode (kquant_decode.h's chunk) and, per output, the same products into the
// same lane in increasing k, then tree16, then + bias: the canonical order of isa.h. An
// accumulator parked in memory between spans and reloaded is the same float, so the blocking
// changes no bit (tests/test_kquant_tile8.py, tests/test_kquant_kernel.py compare with the
// scalar build).
// Included by kquant_fused.h only (which defines CODA_AI).
#pragma once

#if CODA_ISA == CODA_AVX512
#include <cstdlib>

#include <unistd.h>

namespace coda_native {
namespace CODA_NS {
namespace kq {
namespace fused {

constexpr int R8 = 8;         // input rows of the tile
// NOTE: 6 and 7 rows run it too, padded with zero rows whose outputs are not written: one
// decode for 8 rows beat a 4-row tile plus a 2- or 3-row tile, which decode every chunk twice
// (measured 0.93x and 0.85x the time; at 5 rows even, 1.02x)
constexpr int64_t TILE8_MIN = 6;
constexpr int G8 = 2;         // outputs per tile: 16 accumulators, 2 weights, x, decode temporaries
constexpr int64_t KS8 = 2;    // super-blocks per span: 8 x 512 floats of x = 16 KiB (span_x_kib)
constexpr int NB8 = 32;       // outputs per block: their partial sums 32 x 8 x 64 B = 16 KiB
// NOTE: measured on a Sapphire Rapids core (1B step, batch 8): G8 = 3 1.04-1.09x the time (24
// accumulators leave too few registers), KS8 = 8 (x spans 64 KiB, out of L1) 1.14x, KS8 = 4 and
// NB8 = 16 or 64 within the noise; on an Emerald Rapids class core (48 KiB L1d) KS8 = 4 0.93-0.96x
// at Q4_K, 0.95-0.99x at Q6_K, so spans are 4 super-blocks where L1d holds them (span_x_kib)

// KiB of packed x per span of the 8-row tiles: 32 where L1d holds 48 KiB or more (Ice Lake and
// later Intel cores), else 16 (Skylake-X, Zen 4: 32 KiB). NOTE: the span's x and the weights
// streamed beside it must stay in L1 (docs/quantization.md, "Batch 8 ... spans")
inline int64_t span_x_kib() {
  static const int64_t kib = sysconf(_SC_LEVEL1_DCACHE_SIZE) >= 48 * 1024 ? 32 : 16;
  return kib;
}

// x [M, K] (row-major, M <= 8) -> xp [K / 16][8][16]: chunk i of row r at xp + (i * 8 + r) * 16,
// rows M..7 zero.
inline void pack8(const float* x, int64_t M, int64_t K, float* xp) {
  for (int64_t i = 0; i < K / 16; ++i)
    for (int r = 0; r < R8; ++r)
      _mm512_store_ps(xp + (i * R8 + r) * 16,
                      r < M ? _mm512_loadu_ps(x + r * K + i * 16) : _mm512_setzero_ps());
}

template <int T, int G>
struct Tile8 {
  __m512 acc[R8][G];

  // w[g] * x[r] into acc[r][g]; x: the chunk's 8 rows (16 floats each, consecutive).
  CODA_AI void fma(const W16* w, const float* x) {
    for (int r = 0; r < R8; ++r) {
      // NOTE: GCC folds this load into each of the G FMAs (a micro-fused memory operand):
      // measured no slower than one load kept in a register per row (docs/quantization.md)
      const __m512 xv = _mm512_load_ps(x + r * 16);
      for (int g = 0; g < G; ++g) acc[r][g] = _mm512_fmadd_ps(w[g], xv, acc[r][g]);
    }
  }

  template <int I>
  CODA_AI void step(const uint8_t* const* blk, const Scales* s, const float* x) {
    W16 w[G];
    for (int g = 0; g < G; ++g) w[g] = chunk<T, I>(blk[g], s[g]);
    fma(w, x + I * R8 * 16);
  }

  template <int... I>
  CODA_AI void block(const uint8_t* const* blk, const Scales* s, const float* x) {
    (step<I>(blk, s, x), ...);
  }
};

// Outputs row[0..G) over super-blocks [b0, b1) for the 8 rows of xs (the span's packed x);
// partial sums from / to ab[g * 8 + r] unless first / last (then y[r * ldy + g] (+ bias[g])
// for the m real rows).
// pf[g]: bytes to prefetch, one super-block's worth per super-block (null: none).
template <int T, int G>
__attribute__((noinline)) void span8(const uint8_t* const* row, const uint8_t* const* pf,
                                     int64_t b0, int64_t b1, const float* xs, __m512* ab,
                                     bool first, bool last, const float* bias, float* y,
                                     int64_t ldy, int m) {
  constexpr int64_t bb = T == Q2_K ? 84 : T == Q3_K ? 110 : T == Q4_K ? 144 : T == Q5_K ? 176 : 210;
  Tile8<T, G> t;
  for (int r = 0; r < R8; ++r)
    for (int g = 0; g < G; ++g) t.acc[r][g] = first ? _mm512_setzero_ps() : ab[g * R8 + r];
  for (int64_t b = b0; b < b1; ++b) {
    const uint8_t* blk[G];
    Scales s[G];
    for (int g = 0; g < G; ++g) {
      blk[g] = row[g] + b * bb;
      scales<T>(blk[g], s[g]);
      if (pf[g])
        for (int64_t o = 0; o < bb; o += 64) __builtin_prefetch(pf[g] + (b - b0) * bb + o);
    }
    // NOTE: as run's: the scales broadcast from memory, not shuffled out of registers
    const Scales* sp = s;
    __asm__("" : "+r"(sp));
    // NOTE: Q4_K too: a loop over its 4 pairs of sub-blocks (a quarter of the code) measured
    // no faster than this unrolled block
    t.template block<0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15>(
        blk, sp, xs + (b - b0) * QKK_ * R8);
  }
  if (last) {
    for (int r = 0; r < R8; ++r)
      for (int g = 0; g < G; ++g) {
        if (r >= m) continue;  // NOTE: a padding row: computed, never written
        const float v = tree16(::coda_native::CODA_NS::F16{t.acc[r][g]});
        y[r * ldy + g] = bias ? v + bias[g] : v;
      }
  } else {
    for (int r = 0; r < R8; ++r)
      for (int g = 0; g < G; ++g) ab[g * R8 + r] = t.acc[r][g];
  }
}

// Outputs row[0..nb) (one type T, nb <= NB8) for the 8 rows of xp; nrow: the next block's rows
// (prefetched during this block's last span).
template <int T>
void block8(const uint8_t* const* row, const uint8_t* const* nrow, int nb, const float* xp,
            int64_t K, const float* bias, float* y, int64_t ldy, int m) {
  constexpr int64_t bb = T == Q2_K ? 84 : T == Q3_K ? 110 : T == Q4_K ? 144 : T == Q5_K ? 176 : 210;
  alignas(64) __m512 ab[NB8 * R8];
  const int64_t nsb = K / QKK_;
  const int64_t ks = KS8 * span_x_kib() / 16;  // NOTE: 8 KiB of packed x a super-block
  for (int64_t b0 = 0; b0 < nsb; b0 += ks) {
    const int64_t b1 = min64(b0 + ks, nsb);
    const bool first = b0 == 0, last = b1 == nsb;
    const float* xs = xp + b0 * QKK_ * R8;
    for (int j = 0; j < nb; j += G8) {
      // NOTE: the same rows' next span, or in the last span the next block's first one
      const uint8_t* pf[G8] = {};
      for (int g = 0; g < G8 && j + g < nb; ++g)
        pf[g] = last ? nrow[j + g] : row[j + g] + b1 * bb;
      const float* bj = bias ? bias + j : nullptr;
      if (nb - j >= G8)
        span8<T, G8>(row + j, pf, b0, b1, xs, ab + j * R8, first, last, bj, y + j, ldy, m);
      else
        span8<T, 1>(row + j, pf, b0, b1, xs, ab + j * R8, first, last, bj, y + j, ldy, m);
    }
  }
}

// Outputs [n0, n1) in blocks of up to NB outputs of one segment (one type, one bias), each
// handed to block(type, rows, next block's rows, count, bias, y): the walk both 8-row tiles
// share (this file's K-quant blocks, legacy_tile8.h's legacy ones).
template <int NB, class Block>
inline void blocks8(const KqCall& c, int64_t n0, int64_t n1, Block&& block) {
  for_groups(c, n0, n1, [](const KqSeg&) { return NB; }, [&](const KqGroup& gr) {
    const KqSeg& q = gr.q;
    const uint8_t* row[NB];
    const uint8_t* nrow[NB] = {};
    gr.rows(row);
    rows_ahead(c, gr, gr.n + gr.g, gr.g, n1, nrow);
    block(q.type, row, nrow, gr.g, q.bias ? q.bias + gr.i0 : nullptr, c.y + gr.n);
  });
}

// Outputs [n0, n1) of a call of TILE8_MIN..8 rows (fits(c)), x packed by pack8 into xp.
inline void range8(const KqCall& c, const float* xp, int64_t n0, int64_t n1) {
  const int m = static_cast<int>(c.M);
  blocks8<NB8>(c, n0, n1, [&](int32_t t, const uint8_t* const* row, const uint8_t* const* nrow,
                              int nb, const float* bias, float* y) {
    switch (t) {
      case Q4_K: block8<Q4_K>(row, nrow, nb, xp, c.K, bias, y, c.N, m); break;
      case Q5_K: block8<Q5_K>(row, nrow, nb, xp, c.K, bias, y, c.N, m); break;
      case Q6_K: block8<Q6_K>(row, nrow, nb, xp, c.K, bias, y, c.N, m); break;
      case Q3_K: block8<Q3_K>(row, nrow, nb, xp, c.K, bias, y, c.N, m); break;
      default: block8<Q2_K>(row, nrow, nb, xp, c.K, bias, y, c.N, m); break;
    }
  });
}

}  // namespace fused
}  // namespace kq
}  // namespace CODA_NS
}  // namespace coda_native

#endif  // CODA_ISA == CODA_AVX512
