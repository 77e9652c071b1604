// packed-q8 K-quant dots in registers (AVX2 and AVX-512 builds; issue 18): Q2_K..Q6_K straight
// from the block bytes against Q8_K activations, with the bits of kquants_q8.h's portable path.
//
// Per block and per (output, activation row) pair the integer sums are two int32 vectors whose
// lanes add up to isum - off * osum and msum (exact integers: any association gives the same
// value); four pairs are reduced together into one vector [i0 m0 i1 m1 i2 m2 i3 m3], converted
// to float and added by one vector fma into the pairs' (acc, macc) lanes, each lane doing the
// portable path's scalar step fma(float(s), d_w * d_x, lane) in the same block order, so the
// bits are the same whatever the grouping. At M = 1 (kquants_q8_row.h) Q4_K / Q6_K reduce four
// blocks of one output and step them in order on scalars; the other types four outputs of one
// segment (the activation block shared, one horizontal reduction per four outputs and block
// instead of three per output and block); at M >= 2 one output's codes serve four rows.
// Scales reach each int16 lane by pshufb from one register (not a broadcast per sub-block);
// the AVX-512 build fuses multiply and add (VNNI dpwssd).
#pragma once
#include <cstdint>

#include "isa.h"
#include "kquants.h"
#include "kquants_avx2.h"
#include "table.h"

#if CODA_ISA != CODA_SCALAR
namespace coda_native {
namespace CODA_NS {
namespace kq {
namespace q8s {

constexpr int64_t QKK = 256;

// The cache lines of one block (bb bytes at p). NOTE: at M = 1 the step streams the weights
// from memory; without these hints a thread read ~4 GB/s, with them ~7 (one 75 MB Q4_K matrix,
// 2-core machine shared with other jobs; prefetcht1 and one group ahead no worse than the others
// tried, within the noise)
inline void prefetch_block(const uint8_t* p, int64_t bb) {
  for (int64_t o = 0; o < bb; o += 64) __builtin_prefetch(p + o, 0, 2);
  __builtin_prefetch(p + bb - 1, 0, 2);
}

inline __m128i load16(const uint8_t* p) {
  return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
}

// int16 lane j of each 128-bit half, broadcast over that half (pshufb mask).
inline __m256i lane16(int j) {
  return _mm256_set1_epi16(static_cast<int16_t>((2 * j) | ((2 * j + 1) << 8)));
}

// 16 scale bytes (sub-blocks of 16) -> low half: the even ones, high half: the odd ones, as
// bytes 0..7 of each 128-bit half (what cvtep*8_epi16 then widens).
inline __m128i evens_odds(__m128i v) {
  return _mm_shuffle_epi8(v, _mm_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15));
}

// One super-block in registers: 8 x 32 unsigned codes, per maddubs step k the scale of each
// int16 lane (sc[k]), per bsum i the scale (scb, only where off != 0) and the min (mnb).
template <int T>
struct Blk {
  __m256i q[8], sc[8], scb, mnb;
  uint32_t dd;  // float16 bits: d (low), dmin (high; 0 for types without mins)
};

template <int T>
inline void widen_pairs(__m256i s16, Blk<T>& o) {  // s16: [even scales | odd scales] as int16
  for (int k = 0; k < 8; ++k) o.sc[k] = _mm256_shuffle_epi8(s16, lane16(k));
}

// Q4_K / Q5_K (8 sub-blocks of 32): d and dmin, the 8 scales as int16 (both halves: a sub-block
// of 32 is both halves of a maddubs step) and the mins per bsum lane.
inline void k4_scales(const uint8_t* b, uint32_t& dd, __m256i& s16, __m256i& mnb) {
  dd = le32(b);
  // NOTE: kquants.h's scale_min_k4 for all 8 sub-blocks at once (bytes 0..3: low 6 bits;
  // 4..7: 4 bits from bytes 8..11 and 2 from the top of bytes 0..3 / 4..7), in registers
  const uint32_t u0 = le32(b + 4), u1 = le32(b + 8), u2 = le32(b + 12);
  const uint64_t scs = (u0 & 0x3F3F3F3Fu) |
      static_cast<uint64_t>((u2 & 0x0F0F0F0Fu) | (((u0 >> 6) & 0x03030303u) << 4)) << 32;
  const uint64_t mns = (u1 & 0x3F3F3F3Fu) |
      static_cast<uint64_t>(((u2 >> 4) & 0x0F0F0F0Fu) | (((u1 >> 6) & 0x03030303u) << 4)) << 32;
  const __m128i s8 = _mm_cvtepu8_epi16(_mm_cvtsi64_si128(static_cast<long long>(scs)));
  const __m128i m8 = _mm_cvtepu8_epi16(_mm_cvtsi64_si128(static_cast<long long>(mns)));
  s16 = _mm256_set_m128i(s8, s8);
  mnb = _mm256_set_m128i(_mm_unpackhi_epi16(m8, m8), _mm_unpacklo_epi16(m8, m8));
}

template <int T>
inline void load_k4_scales(const uint8_t* b, Blk<T>& o) {
  __m256i s16;
  k4_scales(b, o.dd, s16, o.mnb);
  widen_pairs(s16, o);
  o.scb = _mm256_setzero_si256();
}

template <int T>
inline void load_blk(const uint8_t* b, Blk<T>& o) {
  const __m256i m4 = _mm256_set1_epi8(0x0F), three = _mm256_set1_epi8(3), one = _mm256_set1_epi8(1);
  if constexpr (T == Q4_K) {
    load_k4_scales(b, o);
    for (int c = 0; c < 4; ++c) {
      const __m256i v = load32(b + 16 + c * 32);
      o.q[2 * c] = _mm256_and_si256(v, m4);
      o.q[2 * c + 1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
    }
  } else if constexpr (T == Q5_K) {
    load_k4_scales(b, o);
    const __m256i qh = load32(b + 16);
    for (int c = 0; c < 4; ++c) {
      const __m256i v = load32(b + 48 + c * 32);
      for (int h = 0; h < 2; ++h) {
        const int j = 2 * c + h;
        const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(qh, j), one);
        o.q[j] = _mm256_or_si256(nibbles(v, 4 * h), _mm256_slli_epi16(hi, 4));
      }
    }
  } else if constexpr (T == Q6_K) {
    uint16_t h;
    std::memcpy(&h, b + 208, 2);  // NOTE: the last bytes of the block: no 4-byte read
    o.dd = h;
    const __m128i s8 = load16(b + 192);
    o.scb = _mm256_cvtepi8_epi16(s8);
    o.mnb = _mm256_setzero_si256();
    widen_pairs(_mm256_cvtepi8_epi16(evens_odds(s8)), o);
    for (int half = 0; half < 2; ++half) {
      const __m256i hv = load32(b + 128 + half * 32);
      const __m256i l0 = load32(b + half * 64), l1 = load32(b + half * 64 + 32);
      for (int s = 0; s < 4; ++s) {
        const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(hv, 2 * s), three);
        o.q[half * 4 + s] =
            _mm256_or_si256(nibbles(s % 2 ? l1 : l0, 4 * (s / 2)), _mm256_slli_epi16(hi, 4));
      }
    }
  } else if constexpr (T == Q3_K) {
    uint16_t h;
    std::memcpy(&h, b + 108, 2);
    o.dd = h;
    // NOTE: kquants.h's scale_q3k for all 16 at once: byte i is the low nibble of byte i % 8
    // (i < 8) or its high nibble, | bits 2 (i / 4) of byte 8 + i % 4 at bit 4; minus 32
    const uint32_t a0 = le32(b + 96), a1 = le32(b + 100), t = le32(b + 104);
    const uint32_t n4 = 0x0F0F0F0Fu, n2 = 0x03030303u;
    const __m128i u = _mm_set_epi32(static_cast<int>(((a1 >> 4) & n4) | (((t >> 6) & n2) << 4)),
                                    static_cast<int>(((a0 >> 4) & n4) | (((t >> 4) & n2) << 4)),
                                    static_cast<int>((a1 & n4) | (((t >> 2) & n2) << 4)),
                                    static_cast<int>((a0 & n4) | ((t & n2) << 4)));
    const __m256i k32 = _mm256_set1_epi16(32);
    o.scb = _mm256_sub_epi16(_mm256_cvtepu8_epi16(u), k32);
    o.mnb = _mm256_setzero_si256();
    widen_pairs(_mm256_sub_epi16(_mm256_cvtepu8_epi16(evens_odds(u)), k32), o);
    const __m256i hm = load32(b);
    for (int hh = 0; hh < 2; ++hh) {
      const __m256i v = load32(b + 32 + hh * 32);
      for (int s = 0; s < 4; ++s) {
        const __m256i lo = _mm256_and_si256(_mm256_srli_epi16(v, 2 * s), three);
        const __m256i bit = _mm256_and_si256(_mm256_srli_epi16(hm, hh * 4 + s), one);
        o.q[hh * 4 + s] = _mm256_or_si256(lo, _mm256_slli_epi16(bit, 2));
      }
    }
  } else {  // Q2_K
    o.dd = le32(b + 80);
    const __m128i u = load16(b);
    const __m128i n4 = _mm_set1_epi8(0x0F);
    o.scb = _mm256_setzero_si256();
    o.mnb = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(u, 4), n4));
    widen_pairs(_mm256_cvtepu8_epi16(evens_odds(_mm_and_si128(u, n4))), o);
    for (int hh = 0; hh < 2; ++hh) {
      const __m256i v = load32(b + 16 + hh * 32);
      for (int s = 0; s < 4; ++s) o.q[hh * 4 + s] = _mm256_and_si256(_mm256_srli_epi16(v, 2 * s), three);
    }
  }
}

// acc += madd(a, b) (AVX-512 VNNI: one instruction).
inline __m256i madd_acc(__m256i acc, __m256i a, __m256i b) {
#if CODA_ISA == CODA_AVX512
  return _mm256_dpwssd_epi32(acc, a, b);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b));
#endif
}

// The block's two sums against one activation block (x: 256 codes, bsum: its 16 sums of 16):
// lanes of i add to isum - off * osum, lanes of m to msum.
template <int T>
inline void dot(const Blk<T>& w, const int8_t* x, __m256i bsum, __m256i& i, __m256i& m) {
  // NOTE: two accumulators: half the dependent chain of dpwssd (Q4_K 9.2 -> 8.1 ns per block)
  __m256i a2[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
  for (int k = 0; k < 8; ++k) {
    // NOTE: |u x + u x| <= 2 * 63 * 127 fits int16; times a scale |sc| <= 128 in int32
    const __m256i p = _mm256_maddubs_epi16(
        w.q[k], _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 32 * k)));
    a2[k & 1] = madd_acc(a2[k & 1], p, w.sc[k]);
  }
  __m256i a = _mm256_add_epi32(a2[0], a2[1]);
  if constexpr (T == Q6_K) {  // NOTE: off = 32, 4: the offset's sum comes off as off * osum
    a = _mm256_sub_epi32(a, _mm256_slli_epi32(_mm256_madd_epi16(w.scb, bsum), 5));
  } else if constexpr (T == Q3_K) {
    a = _mm256_sub_epi32(a, _mm256_slli_epi32(_mm256_madd_epi16(w.scb, bsum), 2));
  }
  i = a;
  if constexpr (T == Q6_K || T == Q3_K) m = _mm256_setzero_si256();
  else m = _mm256_madd_epi16(w.mnb, bsum);
}

inline __m256i load_x(const int8_t* x) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
}

// [sum i0, sum m0, sum i1, sum m1, sum i2, sum m2, sum i3, sum m3] (exact int32 sums).
inline __m256i reduce8(const __m256i* i, const __m256i* m) {
  const __m256i a = _mm256_hadd_epi32(i[0], m[0]), b = _mm256_hadd_epi32(i[1], m[1]);
  const __m256i c = _mm256_hadd_epi32(i[2], m[2]), d = _mm256_hadd_epi32(i[3], m[3]);
  const __m256i ab = _mm256_hadd_epi32(a, b), cd = _mm256_hadd_epi32(c, d);
  // NOTE: ab's halves hold [i0 m0 i1 m1] of elements 0..3 and of 4..7
  return _mm256_add_epi32(_mm256_permute2x128_si256(ab, cd, 0x20),
                          _mm256_permute2x128_si256(ab, cd, 0x31));
}

}  // namespace q8s
}  // namespace kq
}  // namespace CODA_NS
}  // namespace coda_native
#endif  // CODA_ISA != CODA_SCALAR
