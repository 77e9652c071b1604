// The exact-mode matmul of Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0 rows for 6..8 input rows
// (batch-8 decode; issue 18 item 3), AVX-512 build only: the 8-row register tile of
// kquant_tile8.h over legacy blocks read in place. legacy_inplace.h's 4-row tile ran 8 rows as
// two calls that each decoded every block (per block and output 16 FMAs beside two decodes of
// ~5 vector uops each, on the same two 512-bit ports); here each block is decoded once for the
// 8 rows, on x packed once per call chunk-major (fused::pack8) and walked K-blocked, so the
// span's x stays in L1 across a block of outputs (kquant_tile8.h says why).
//
// Bits: the same decode (legacy_inplace.h's scales and decode: the file's weights exactly) and,
// per output, the same products into the same lane in increasing k (block b's weights 0..15,
// then 16..31), then tree16, then + bias: isa.h's canonical order. An accumulator parked in
// memory between spans is the same float, so the blocking changes no bit
// (tests/test_legacy_tile8.py compares with the scalar build and with each row alone).
// Included by legacy_inplace.h only (AVX-512).
#pragma once

#if CODA_ISA == CODA_AVX512
namespace coda_native {
namespace CODA_NS {
namespace kq {
namespace legacy {

constexpr int G8L = 2;        // outputs per tile: 16 accumulators, 4 decoded halves, x
// blocks of 32 per span (at most): 8 x 1024 floats of x = 32 KiB, where L1d holds 48 KiB
// (fused::span_x_kib; else spans of 16 blocks, 16 KiB)
constexpr int64_t KSL = 32;
constexpr int NBL = 32;       // outputs per block: their partial sums 32 x 8 x 64 B = 16 KiB

// Outputs row[0..G) over blocks [b0, b1) for the 8 rows of xs (the span's packed x: chunk i of
// row r at xs + (i * 8 + r) * 16); partial sums from / to ab[g * 8 + r] unless first / last
// (then y[r * ldy + g] (+ bias[g]) for the m real rows). pf[g]: the bytes to prefetch, spread
// over the span's blocks (null: none). sd[g][i], sm[g][i]: output g's d and m of block b0 + i
// (spanscales).
template <int T, int G>
__attribute__((noinline)) void span8(const uint8_t* const* row, const uint8_t* const* pf,
                                     const float (*sd)[KSL], const float (*sm)[KSL],
                                     int64_t b0, int64_t b1, const float* xs, __m512* ab,
                                     bool first, bool last, const float* bias, float* y,
                                     int64_t ldy, int m) {
  constexpr int R = fused::R8;
  constexpr int64_t bb = kBB<T>;
  __m512 acc[R][G];
  for (int r = 0; r < R; ++r)
    for (int g = 0; g < G; ++g) acc[r][g] = first ? _mm512_setzero_ps() : ab[g * R + r];
  // NOTE: software-pipelined: block b + 1 is decoded before block b's FMAs are issued, so the
  // decode's latency overlaps the FMAs instead of stalling them
  __m512 w[G][2], wn[G][2];
  auto dec = [&](int64_t b, __m512 (*out)[2]) {
    const int64_t off = b * bb;
    for (int g = 0; g < G; ++g) {
      if (pf[g]) __builtin_prefetch(pf[g] + (b - b0) * bb);
      decode<T>(row[g] + off, &sd[g][b - b0], &sm[g][b - b0], out[g]);
    }
  };
  dec(b0, w);
  for (int64_t b = b0; b < b1; ++b) {
    if (b + 1 < b1) dec(b + 1, wn);
    const float* xb = xs + (b - b0) * 2 * R * 16;
    for (int h = 0; h < 2; ++h)
      for (int r = 0; r < R; ++r) {
        __m512 xv = _mm512_load_ps(xb + (h * R + r) * 16);
        // NOTE: one load for the G products (folded into each FMA, the loads bound the tile)
        __asm__("" : "+v"(xv));
        for (int g = 0; g < G; ++g) acc[r][g] = _mm512_fmadd_ps(w[g][h], xv, acc[r][g]);
      }
    for (int g = 0; g < G; ++g) w[g][0] = wn[g][0], w[g][1] = wn[g][1];
  }
  if (last) {
    for (int r = 0; r < R && r < m; ++r)  // NOTE: padding rows: computed, never written
      for (int g = 0; g < G; ++g) {
        const float v = tree16(::coda_native::CODA_NS::F16{acc[r][g]});
        y[r * ldy + g] = bias ? v + bias[g] : v;
      }
  } else {
    for (int r = 0; r < R; ++r)
      for (int g = 0; g < G; ++g) ab[g * R + r] = acc[r][g];
  }
}

// The d (and m) of blocks [b0, b1) (b1 - b0 <= KSL) of outputs row[0..nb) as float32: sd[j][i]
// (sm[j][i]) for block b0 + i of output j. NOTE: once per span for the block's nb outputs, before
// their tiles, so that a tile's first decode starts from a load: one gather of the span's 16
// dwords at the blocks' starts (d, then m or the quants' first bytes) and 16 conversions at
// once. A conversion per block and output inside the tile (vpinsrw, vcvtph2ps, vmovss: ~4 uops
// on the two ports the FMAs need, ~1/4 of Q4_0's FMA count, and a ~50-cycle chain before each
// tile's first FMA) ran the Q4_0 tile at ~56 % of the FMA peak (Emerald Rapids class, M = 8);
// here 0.96-0.98x that time at Q4_0, 0.86-0.89x at Q4_1, 0.95-0.97x at Q5_0 and Q8_0. Gathers
// in each tile instead measured 0.99x at Q4_0, and scalar copies of the halves into a buffer
// converted 16 at a time (a store-forwarding stall) 1.08x
template <int T>
inline void spanscales(const uint8_t* const* row, int nb, int64_t b0, int64_t b1,
                       float (*sd)[KSL], float (*sm)[KSL]) {
  constexpr int64_t bb = kBB<T>;
  static_assert(KSL % 16 == 0, "gathers of 16 blocks");
  const __m512i at = _mm512_setr_epi32(0, bb, 2 * bb, 3 * bb, 4 * bb, 5 * bb, 6 * bb, 7 * bb,
                                       8 * bb, 9 * bb, 10 * bb, 11 * bb, 12 * bb, 13 * bb,
                                       14 * bb, 15 * bb);
  for (int64_t c = 0; c < b1 - b0; c += 16) {
    const int64_t n = b1 - b0 - c;
    const __mmask16 live = static_cast<__mmask16>(n >= 16 ? 0xFFFF : (1u << n) - 1);
    for (int j = 0; j < nb; ++j) {
      const __m512i v = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), live, at,
                                                    row[j] + (b0 + c) * bb, 1);
      _mm512_store_ps(sd[j] + c, _mm512_cvtph_ps(_mm512_cvtepi32_epi16(v)));
      if (kM<T>)
        _mm512_store_ps(sm[j] + c,
                        _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(v, 16))));
    }
  }
}

// Outputs row[0..nb) (one type T, nb <= NBL) for the 8 rows of xp; nrow: the next block's rows
// (prefetched during this block's last span).
template <int T>
void block8(const uint8_t* const* row, const uint8_t* const* nrow, int nb, const float* xp,
            int64_t K, const float* bias, float* y, int64_t ldy, int m) {
  constexpr int64_t bb = kBB<T>;
  alignas(64) __m512 ab[NBL * fused::R8];
  alignas(64) float sd[NBL][KSL], sm[NBL][KSL];  // NOTE: sm unused unless kM<T>
  const int64_t nblk = K / QK;
  // NOTE: 32 KiB spans measured 0.93-0.96x the time of 16 KiB ones (Q4_0, M = 8, a 48 KiB L1d);
  // 64 KiB ones (out of L1) 1.12-1.16x
  const int64_t ksl = fused::span_x_kib();  // NOTE: 1 KiB of packed x a block of 32
  for (int64_t b0 = 0; b0 < nblk; b0 += ksl) {
    const int64_t b1 = min64(b0 + ksl, nblk);
    const bool first = b0 == 0, last = b1 == nblk;
    const float* xs = xp + b0 * QK * fused::R8;
    spanscales<T>(row, nb, b0, b1, sd, sm);
    for (int j = 0; j < nb; j += G8L) {
      // NOTE: the same rows' next span, or in the last span the next block's first one
      const uint8_t* pf[G8L] = {};
      for (int g = 0; g < G8L && j + g < nb; ++g) pf[g] = last ? nrow[j + g] : row[j + g] + b1 * bb;
      const float* bj = bias ? bias + j : nullptr;
      if (nb - j >= G8L)
        span8<T, G8L>(row + j, pf, sd + j, sm + j, b0, b1, xs, ab + j * fused::R8, first, last,
                      bj, y + j, ldy, m);
      else
        span8<T, 1>(row + j, pf, sd + j, sm + j, b0, b1, xs, ab + j * fused::R8, first, last, bj,
                    y + j, ldy, m);
    }
  }
}

// Outputs [n0, n1) of a call of fused::TILE8_MIN..8 rows (fits(c, 8)), x packed by
// fused::pack8 into xp (fused::blocks8 walks the blocks).
inline void range8(const KqCall& c, const float* xp, int64_t n0, int64_t n1) {
  const int m = static_cast<int>(c.M);
  fused::blocks8<NBL>(c, n0, n1, [&](int32_t t, const uint8_t* const* row,
                                     const uint8_t* const* nrow, int nb, const float* bias,
                                     float* y) {
    switch (t) {
      case Q8_0: block8<Q8_0>(row, nrow, nb, xp, c.K, bias, y, c.N, m); break;
      case Q4_1: block8<Q4_1>(row, nrow, nb, xp, c.K, bias, y, c.N, m); break;
      case Q5_0: block8<Q5_0>(row, nrow, nb, xp, c.K, bias, y, c.N, m); break;
      case Q5_1: block8<Q5_1>(row, nrow, nb, xp, c.K, bias, y, c.N, m); break;
      default: block8<Q4_0>(row, nrow, nb, xp, c.K, bias, y, c.N, m); break;
    }
  });
}

}  // namespace legacy
}  // namespace kq
}  // namespace CODA_NS
}  // namespace coda_native
#endif  // CODA_ISA == CODA_AVX512
