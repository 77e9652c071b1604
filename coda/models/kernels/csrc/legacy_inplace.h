// The exact-mode matmul of Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0 rows read in place from the mapped
// file (issue 18), AVX2 and AVX-512 builds, 1..LEGACY_M input rows (decode steps,
// kquant_kernels.h): each output's ggml blocks (float16 d, Q4_1's and Q5_1's float16 m, Q5's 4
// bytes of high bits, then 16 bytes of nibbles or 32 int8) are decoded straight into registers
// and multiplied into register accumulators for every row of the call, G = 4 outputs side by
// side: no L1 span buffer (kquant_kernels.h's span kernel, ~2x the time at one row) and no
// re-laid-out copy (blocks.h). Included by kquant_kernels.h only.
//
// Bits: a weight is q * d (Q8_0), fma(q, d, m) (Q4; m = -8 d for Q4_0), (q - 16) d (Q5_0) or
// fma(q, d, m) (Q5_1; q d exact, so one rounding as kquants.h's q d + m), the file's weight
// exactly, as kquants.h decodes it; per output 16 float lanes, the product of input k in lane
// k mod 16, fma in increasing k (a block's weights 0..15, then 16..31), then tree16, then
// + bias: isa.h's canonical order, the same operations as blocks.h's re-laid-out tiles and the
// span kernel (tests/test_legacy_inplace.py compares them with the scalar build; blocks.h has no
// Q5 tile).
//
// Speed (docs/quantization.md): at one row it streams Gemma 3 270M's 262144 x 640 Q8_0 head in
// ~1.1x the re-laid-out tile's time (both near one core's memory bandwidth); in L2 ~1.4x: per
// block and output it converts a scale and addresses its own row, where the tile converts 8
// scales at once and reads one contiguous run.
#pragma once

#if CODA_ISA != CODA_SCALAR
#include <immintrin.h>

#include <cstring>

#include "isa.h"
#include "table.h"

namespace coda_native {
namespace CODA_NS {
namespace kq {
namespace legacy {

// block bytes, offset of the quants (Q5's 16 bytes of nibbles follow its 4 bytes of high bits)
template <int T> constexpr int64_t kBB =
    T == Q8_0 ? 34 : T == Q4_1 ? 20 : T == Q5_0 ? 22 : T == Q5_1 ? 24 : 18;
template <int T> constexpr int64_t kQO = T == Q4_1 ? 4 : T == Q5_0 ? 6 : T == Q5_1 ? 8 : 2;
template <int T> constexpr bool kQ5 = T == Q5_0 || T == Q5_1;
template <int T> constexpr bool kM = T == Q4_1 || T == Q5_1;  // a float16 m after d

// A Q5 block's 32 high bits (bit j: weight j's bit 4), little-endian as kquants.h's le32.
template <int T>
inline uint32_t qh_bits(const uint8_t* blk) {
  uint32_t v;
  std::memcpy(&v, blk + kQO<T> - 4, 4);
  return v;
}

// RT: rows per call of the register tile; kG<R>: outputs side by side at R rows (GW at one row,
// the group width): R G accumulators (AVX2: two registers each), the decoded weights and x fit
// the register file (32 zmm, 16 ymm). NOTE: AVX-512 at one row, 8 outputs (as blocks.h's tile)
// measured no faster than 4 (0.95-1.0x the time), and their row pointers overflowed the general
// registers
constexpr int RT = 4;
#if CODA_ISA == CODA_AVX512
template <int R> constexpr int kG = 4;
#else
template <int R> constexpr int kG = R == 1 ? 4 : R == 2 ? 2 : 1;
#endif
constexpr int GW = kG<1>;
constexpr int64_t AHEAD = 4;  // groups between the one computed and the one prefetched

// The G (<= 4) blocks' d as float32 into s[0..4), and for Q4_1 their m into s[4..8), by one
// conversion of 4 float16 (exact, as kquants.h's f16). NOTE: the halves are packed into a
// general register (loads, shifts, ors on the scalar ports), then moved to a vector once, off
// the vector ports that the decode saturates: a conversion per output and block, or GCC's own
// packing (vmovd, vpinsrw, vpunpck), measured 0.9-1.1x its time (noise-level)
template <int G>
inline __m128i halves(const uint8_t* const* blk, int off) {
  uint64_t w = 0;
  for (int g = 0; g < G; ++g) {
    uint16_t h;
    std::memcpy(&h, blk[g] + off, 2);
    w |= static_cast<uint64_t>(h) << (16 * g);
  }
  __asm__("" : "+r"(w));  // NOTE: keeps the packing in a general register
  return _mm_cvtsi64_si128(static_cast<int64_t>(w));
}

template <int T, int G>
inline void scales(const uint8_t* const* blk, float* s) {
  static_assert(G <= 4, "4 scales per conversion");
  _mm_store_ps(s, _mm_cvtph_ps(halves<G>(blk, 0)));
  if (kM<T>) _mm_store_ps(s + 4, _mm_cvtph_ps(halves<G>(blk, 2)));
}

#if CODA_ISA == CODA_AVX512
// One output's block as two 16-lane halves (w[0]: weights 0..15, w[1]: 16..31); its d at *dp
// and (Q4_1, Q5_1) its m at *mp.
template <int T>
inline void decode(const uint8_t* blk, const float* dp, const float* mp, __m512 w[2]) {
  const uint8_t* q = blk + kQO<T>;
  if (T == Q8_0) {
    for (int h = 0; h < 2; ++h)
      w[h] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                               _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16 * h)))),
                           _mm512_set1_ps(*dp));
    return;
  }
  // NOTE: the 16 possible weights once per block, then looked up by nibble (vpermps reads an
  // index's low 4 bits), as blocks_avx512.h's dequant_out: (q - 8) d is exactly fma(q, d, -8 d)
  // and Q4_1's q d + m rounds once (q d is exact), so the table holds the file's weights
  __m512 table;
  if (T == Q4_0) {
    table = _mm512_mul_ps(_mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7),
                          _mm512_set1_ps(*dp));
  } else {
    table = _mm512_add_ps(
        _mm512_mul_ps(_mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                      _mm512_set1_ps(*dp)),
        _mm512_set1_ps(*mp));
  }
  // NOTE: byte j's low nibble is weight j, its high nibble weight 16 + j (ggml order)
  const __m512i i = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)));
  if constexpr (kQ5<T>) {
    // NOTE: the 32 possible weights as two tables (q in 0..15, 16..31), looked up by the 5-bit
    // index nibble | high bit << 4 (vpermt2ps reads an index's low 5 bits): (q - 16) d and
    // q d + m round once as kquants.h's (q d is exact: 11 by 5 significant bits)
    const __m512 d = _mm512_set1_ps(*dp);
    const __m512 k = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __m512 lo, hi;
    if (T == Q5_0) {
      lo = _mm512_mul_ps(_mm512_sub_ps(k, _mm512_set1_ps(16)), d);
      hi = _mm512_mul_ps(k, d);
    } else {
      const __m512 m = _mm512_set1_ps(*mp);
      lo = _mm512_fmadd_ps(k, d, m);
      hi = _mm512_fmadd_ps(_mm512_add_ps(k, _mm512_set1_ps(16)), d, m);
    }
    // NOTE: qh's bits 0..15 are weights 0..15's high bits, bits 16..31 weights 16..31's: a mask
    // each sets the index's bit 4 (the low nibble's own bits 4..7 cleared first)
    const uint32_t qh = qh_bits<T>(blk);
    const __m512i b4 = _mm512_set1_epi32(16);
    const __m512i n0 = _mm512_and_si512(i, _mm512_set1_epi32(0xF)), n1 = _mm512_srli_epi32(i, 4);
    const __mmask16 k0 = static_cast<__mmask16>(qh), k1 = static_cast<__mmask16>(qh >> 16);
    w[0] = _mm512_permutex2var_ps(lo, _mm512_mask_or_epi32(n0, k0, n0, b4), hi);
    w[1] = _mm512_permutex2var_ps(lo, _mm512_mask_or_epi32(n1, k1, n1, b4), hi);
    return;
  }
  w[0] = _mm512_permutexvar_ps(i, table);
  w[1] = _mm512_permutexvar_ps(_mm512_srli_epi32(i, 4), table);
}

// R rows x G outputs, accumulators in registers over the whole row.
template <int T, int R, int G>
struct Tile {
  __m512 acc[R][G];

  inline void zero() {
    for (int r = 0; r < R; ++r)
      for (int g = 0; g < G; ++g) acc[r][g] = _mm512_setzero_ps();
  }

  // Block b of every output: decode, then one fma per half, row and output.
  inline void block(const uint8_t* const* blk, const float* s, const float* x, int64_t ldx) {
    __m512 w[G][2];
    for (int g = 0; g < G; ++g) decode<T>(blk[g], s + g, s + 4 + g, w[g]);
    for (int h = 0; h < 2; ++h)
      for (int r = 0; r < R; ++r) {
        __m512 xv = _mm512_loadu_ps(x + r * ldx + 16 * h);
        // NOTE: one load for the G products (see blocks_avx512.h's micro_f32_512)
        __asm__("" : "+v"(xv));
        for (int g = 0; g < G; ++g) acc[r][g] = _mm512_fmadd_ps(w[g][h], xv, acc[r][g]);
      }
  }

  inline float out(int r, int g) const { return tree16(::coda_native::CODA_NS::F16{acc[r][g]}); }
};
#else
// One output's sub-vector V (weights 8 V .. 8 V + 7) of a block as 8 lanes.
template <int T, int V>
inline __m256 decode8(const uint8_t* blk, const float* s) {
  const uint8_t* q = blk + kQO<T>;
  if (T == Q8_0) {
    const __m256i i = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 8 * V)));
    return _mm256_mul_ps(_mm256_cvtepi32_ps(i), _mm256_set1_ps(s[0]));
  }
  // NOTE: weights 8 V + l: bytes 8 (V % 2) + l, low nibble for V < 2, high for V >= 2
  const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 8 * (V % 2))));
  __m256i n = V < 2 ? _mm256_and_si256(b, _mm256_set1_epi32(0xF)) : _mm256_srli_epi32(b, 4);
  const __m256 d = _mm256_set1_ps(s[0]);
  if constexpr (kQ5<T>) {
    // NOTE: weight 8 V + l's high bit is qh's bit 8 V + l, moved to bit 4
    const __m256i sh = _mm256_setr_epi32(8 * V, 8 * V + 1, 8 * V + 2, 8 * V + 3, 8 * V + 4,
                                         8 * V + 5, 8 * V + 6, 8 * V + 7);
    const __m256i h = _mm256_srlv_epi32(_mm256_set1_epi32(static_cast<int>(qh_bits<T>(blk))), sh);
    n = _mm256_or_si256(n, _mm256_and_si256(_mm256_slli_epi32(h, 4), _mm256_set1_epi32(16)));
    // NOTE: (q - 16) d and q d + m round once, as kquants.h's (q d is exact)
    if (T == Q5_0)
      return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(n, _mm256_set1_epi32(16))), d);
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(n), d, _mm256_set1_ps(s[4]));
  }
  // NOTE: Q4_0's m = -8 d is exact (blocks.h's scales8)
  const __m256 m = T == Q4_1 ? _mm256_set1_ps(s[4]) : _mm256_mul_ps(d, _mm256_set1_ps(-8.0f));
  return _mm256_fmadd_ps(_mm256_cvtepi32_ps(n), d, m);
}

template <int T, int R, int G>
struct Tile {
  __m256 lo[R][G], hi[R][G];

  inline void zero() {
    for (int r = 0; r < R; ++r)
      for (int g = 0; g < G; ++g) lo[r][g] = hi[r][g] = _mm256_setzero_ps();
  }

  template <int V>
  inline void step(const uint8_t* const* blk, const float* s, const float* x, int64_t ldx) {
    for (int g = 0; g < G; ++g) {
      const __m256 w = decode8<T, V>(blk[g], s + g);
      for (int r = 0; r < R; ++r) {
        __m256& a = V % 2 ? hi[r][g] : lo[r][g];  // NOTE: lane k mod 16 = 8 (V % 2) + l
        a = _mm256_fmadd_ps(w, _mm256_loadu_ps(x + r * ldx + 8 * V), a);
      }
    }
  }

  inline void block(const uint8_t* const* blk, const float* s, const float* x, int64_t ldx) {
    step<0>(blk, s, x, ldx);
    step<1>(blk, s, x, ldx);
    step<2>(blk, s, x, ldx);
    step<3>(blk, s, x, ldx);
  }

  inline float out(int r, int g) const { return tree16(::coda_native::CODA_NS::F16{lo[r][g], hi[r][g]}); }
};
#endif

// What a run prefetches while it computes (rows are short streams the hardware prefetcher learns
// late; see kquant_kernels.h): the rows of a later group, either as one byte range (consecutive
// file rows), whose lines are spread evenly over the run's blocks, or row by row (a row map),
// line b of each row at block b (a row of nb blocks of <= 64 bytes has at most nb lines).
struct Ahead {
  const uint8_t* from = nullptr;  // range: its first byte and its size
  int64_t bytes = 0;
  const uint8_t* const* rows = nullptr;  // or G rows of rb bytes

  // The part for outputs [j, j + g) of the group (rows of rb bytes).
  Ahead part(int j, int g, int64_t rb) const {
    Ahead a;
    if (from != nullptr) {
      const int64_t lo = j * rb, hi = (j + g) * rb < bytes ? (j + g) * rb : bytes;
      if (lo < hi) a.from = from + lo, a.bytes = hi - lo;
    } else if (rows != nullptr) {
      a.rows = rows + j;
    }
    return a;
  }
};

// Outputs row[0..G) (one type T) for rows x[0..R) (row stride ldx) of length K; y[r ldy + g]
// (+ bias[g]); ahead: what to prefetch meanwhile.
template <int T, int R, int G>
__attribute__((noinline)) void run(const uint8_t* const* row, const Ahead& ahead, const float* x,
                                   int64_t ldx, int64_t K, const float* bias, float* y,
                                   int64_t ldy) {
  constexpr int64_t bb = kBB<T>;
  const int64_t nb = K / QK, rb = nb * bb;
  Tile<T, R, G> t;
  t.zero();
  // NOTE: the range's lines (64-byte aligned), nl of them
  const uint8_t* const* pr = ahead.rows;
  const uint8_t* line0 = reinterpret_cast<const uint8_t*>(
      reinterpret_cast<uintptr_t>(ahead.from) & ~static_cast<uintptr_t>(63));
  const int64_t nl = ahead.from ? (ahead.from + ahead.bytes - line0 + 63) / 64 : 0;
  const uint8_t* line = line0;
  int64_t due = 0;
  for (int64_t b = 0, off = 0; b < nb; ++b, off += bb) {
    alignas(16) float s[8];
    // NOTE: the row pointers are read from memory each block (an opaque copy of row), one
    // offset moves: with G = 8, pointers kept in registers overflowed the general registers
    // into vector ones (a vmovq each way per output and block, on the vector ports)
    const uint8_t* const* rp = row;
    __asm__("" : "+r"(rp));
    const uint8_t* blk[G];
    for (int g = 0; g < G; ++g) {
      blk[g] = rp[g] + off;
      if (pr != nullptr && b * 64 < rb) __builtin_prefetch(pr[g] + b * 64);
    }
    scales<T, G>(blk, s);
    // NOTE: lines [b nl / nb, (b + 1) nl / nb) at block b, by a running remainder (no division)
    for (due += nl; due >= nb; due -= nb, line += 64) __builtin_prefetch(line);
    // NOTE: an opaque copy: the scales are read by the instructions that use them (embedded
    // broadcasts), not kept in a register and shuffled out (see blocks_avx512.h)
    const float* sp = s;
    __asm__("" : "+r"(sp));
    t.block(blk, sp, x + b * QK, ldx);
  }
  for (int r = 0; r < R; ++r)
    for (int g = 0; g < G; ++g) {
      const float v = t.out(r, g);
      y[r * ldy + g] = bias ? v + bias[g] : v;
    }
}

// A group of n <= GW outputs for R rows runs in tiles of kG<R> outputs, then halves of that
// (each output's operations are its own: any split gives the same bits).
template <int T, int R, int G>
inline void outs_from(const uint8_t* const* row, const Ahead& ahead, int j, int n,
                      const float* x, int64_t K, const float* bias, float* y, int64_t ldy) {
  const int64_t rb = K / QK * kBB<T>;
  for (; j + G <= n; j += G)
    run<T, R, G>(row + j, ahead.part(j, G, rb), x, K, K, bias ? bias + j : nullptr, y + j, ldy);
  if constexpr (G > 1)
    if (j < n) outs_from<T, R, G / 2>(row, ahead, j, n, x, K, bias, y, ldy);
}

// n outputs (row, one type T) for all M rows, RT rows per call: the group's rows are read from
// memory by the first call, from L1 by the others.
template <int T>
inline void rows(const uint8_t* const* row, const Ahead& ahead, int n, const float* x,
                 int64_t M, int64_t K, const float* bias, float* y, int64_t ldy) {
  for (int64_t r = 0; r < M; r += RT) {
    const int64_t m = M - r < RT ? M - r : RT;
    const Ahead pf = r == 0 ? ahead : Ahead{};
    const float* xr = x + r * K;
    float* yr = y + r * ldy;
    if (m == 4) outs_from<T, 4, kG<4>>(row, pf, 0, n, xr, K, bias, yr, ldy);
    else if (m == 3) outs_from<T, 3, kG<3>>(row, pf, 0, n, xr, K, bias, yr, ldy);
    else if (m == 2) outs_from<T, 2, kG<2>>(row, pf, 0, n, xr, K, bias, yr, ldy);
    else outs_from<T, 1, kG<1>>(row, pf, 0, n, xr, K, bias, yr, ldy);
  }
}

inline bool legacy_type(int32_t t) {
  return t == Q4_0 || t == Q4_1 || t == Q5_0 || t == Q5_1 || t == Q8_0;
}

// Whether the call is this kernel's: at most max_m rows, every segment a legacy block type.
inline bool fits(const KqCall& c, int64_t max_m) {
  if (c.M > max_m) return false;
  for (int i = 0; i < c.nseg; ++i)
    if (!legacy_type(c.segs[i].type)) return false;
  return true;
}

// Outputs [n0, n1): groups of up to GW outputs of one segment.
inline void range(const KqCall& c, int64_t n0, int64_t n1) {
  for_groups(c, n0, n1, [](const KqSeg&) { return GW; }, [&](const KqGroup& gr) {
    const KqSeg& q = gr.q;
    const int64_t n = gr.n, i0 = gr.i0;
    const int g = gr.g;
    const uint8_t* row[GW];
    const uint8_t* next[GW];
    gr.rows(row);
    // NOTE: the group AHEAD groups on, if in the range and the segment: consecutive file rows
    // as one range (spread over the blocks: measured 1.3x faster than a line of each row per
    // block, whose bursts of prefetches filled the line buffers), else row by row
    Ahead ahead;
    const int64_t d = AHEAD * GW;
    const int64_t gn = min64(min64(g, n1 - n - d), q.rows - i0 - d);
    if (gn > 0) {
      if (q.row_map == nullptr) {
        ahead.from = q.base + (i0 + d) * q.row_bytes;
        ahead.bytes = gn * q.row_bytes;
      } else {
        for (int j = 0; j < g; ++j) {
          const int64_t i = i0 + d + (j < gn ? j : 0);  // NOTE: past the end: row i0 + d again
          next[j] = q.row(i);
        }
        ahead.rows = next;
      }
    }
    const float* bias = q.bias ? q.bias + i0 : nullptr;
    float* y = c.y + n;
    switch (q.type) {
      case Q8_0: rows<Q8_0>(row, ahead, g, c.x, c.M, c.K, bias, y, c.N); break;
      case Q4_1: rows<Q4_1>(row, ahead, g, c.x, c.M, c.K, bias, y, c.N); break;
      case Q5_0: rows<Q5_0>(row, ahead, g, c.x, c.M, c.K, bias, y, c.N); break;
      case Q5_1: rows<Q5_1>(row, ahead, g, c.x, c.M, c.K, bias, y, c.N); break;
      default: rows<Q4_0>(row, ahead, g, c.x, c.M, c.K, bias, y, c.N); break;
    }
  });
}

}  // namespace legacy
}  // namespace kq
}  // namespace CODA_NS
}  // namespace coda_native

// NOTE: the 8-row tile (AVX-512, 6..8 rows) is in its own file (size)
#include "legacy_tile8.h"
#endif  // CODA_ISA != CODA_SCALAR
