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
#include <immintrin.h>

#include "kquants.h"
#include "kquants_avx2.h"
#include "table.h"

namespace coda_native {
namespace CODA_NS {
namespace kq {
namespace fused {

#define CODA_AI inline __attribute__((always_inline))

// 16 lanes of weights (AVX-512: one register; AVX2: two).
#if CODA_ISA == CODA_AVX512
using W16 = __m512;
CODA_AI W16 codes16(__m128i b) { return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(b)); }
CODA_AI W16 scodes16(__m128i b) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b)); }
CODA_AI W16 fmaw(W16 a, float b, float c) {
  return _mm512_fmadd_ps(a, _mm512_set1_ps(b), _mm512_set1_ps(c));
}
CODA_AI W16 mulw(W16 a, float b) { return _mm512_mul_ps(a, _mm512_set1_ps(b)); }
#else
struct W16 { __m256 lo, hi; };
CODA_AI W16 codes16(__m128i b) {
  return {_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b)),
          _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(b, 8)))};
}
CODA_AI W16 scodes16(__m128i b) {
  return {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)),
          _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b, 8)))};
}
CODA_AI W16 fmaw(W16 a, float b, float c) {
  const __m256 bv = _mm256_set1_ps(b), cv = _mm256_set1_ps(c);
  return {_mm256_fmadd_ps(a.lo, bv, cv), _mm256_fmadd_ps(a.hi, bv, cv)};
}
CODA_AI W16 mulw(W16 a, float b) {
  const __m256 bv = _mm256_set1_ps(b);
  return {_mm256_mul_ps(a.lo, bv), _mm256_mul_ps(a.hi, bv)};
}
#endif

#if CODA_ISA == CODA_AVX2
constexpr float kMagic = 12582912.0f;  // 1.5 * 2^23 (chunk_avx2)
#endif

CODA_AI __m128i ld16(const uint8_t* p) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)); }
CODA_AI __m128i bits(__m128i v, int shift, int mask) {
  return _mm_and_si128(_mm_srli_epi16(v, shift), _mm_set1_epi8(static_cast<char>(mask)));
}

// A super-block's factors per sub-block: w = fma(q, a[j], b[j]) (Q4_K, Q5_K: 8 sub-blocks of
// 32; Q2_K: 16 of 16) or q * a[j] (Q6_K, Q3_K: 16 of 16).
struct Scales {
  float a[16], b[16];
  // NOTE: Q6_K only: the block's 256 codes (AVX-512: q - 32, signed; AVX2: q + 32, unsigned)
  // in weight order, unpacked once per block with full-width integer ops (a 16-weight chunk
  // then costs one widening load instead of nine integer ops on 16 bytes); the codes are the
  // same integers, so the bits are unchanged. In memory, not registers: a chunk's codes are
  // then one widening load (vpmovzx/sx from memory) where a register copy needed an extract
  // first (a shuffle per 16 weights)
  alignas(64) int8_t q[256];
#if CODA_ISA == CODA_AVX2
  // NOTE: Q6_K only: c[j] = -M * a[j] with M = 1.5 * 2^23 (see chunk_avx2); exact, since a[j] =
  // d * sc has at most 19 significant bits and M's odd part is 3
  float c[16];
#endif
};

// Q6_K: the 256 codes of a block, q = (ql nibble | qh pair << 4) - 32 (kquants.h's layout:
// weight half*128 + s*32 + l takes nibble s / 2 of ql[half*64 + (s % 2)*32 + l] and bits 2s of
// qh[half*32 + l]).
#if CODA_ISA == CODA_AVX512
CODA_AI void q6_codes(const uint8_t* blk, int8_t* out) {
  const __m512i m4 = _mm512_set1_epi8(0x0F), m30 = _mm512_set1_epi8(0x30),
                o32 = _mm512_set1_epi8(32);
  // NOTE: per 16-bit lane shift counts: low 256 bits (s = 0 / 2), high 256 bits (s = 1 / 3);
  // ((qh >> 2s) & 3) << 4 is (qh << (4 - 2s)) & 0x30; bits crossing a byte are masked off
  const __m512i sl01 = _mm512_inserti64x4(_mm512_set1_epi16(4), _mm256_set1_epi16(2), 1);
  const __m512i sr23 = _mm512_inserti64x4(_mm512_set1_epi16(0), _mm256_set1_epi16(2), 1);
  for (int hf = 0; hf < 2; ++hf) {
    const __m512i l = _mm512_loadu_si512(blk + hf * 64);
    const __m512i h = _mm512_broadcast_i64x4(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 128 + hf * 32)));
    const __m512i lo = _mm512_and_si512(l, m4);
    const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(l, 4), m4);
    // NOTE: 0xF8 = A | (B & C)
    const __m512i q01 = _mm512_ternarylogic_epi32(lo, _mm512_sllv_epi16(h, sl01), m30, 0xF8);
    const __m512i q23 = _mm512_ternarylogic_epi32(hi, _mm512_srlv_epi16(h, sr23), m30, 0xF8);
    _mm512_store_si512(out + 128 * hf, _mm512_sub_epi8(q01, o32));
    _mm512_store_si512(out + 128 * hf + 64, _mm512_sub_epi8(q23, o32));
  }
}
#else
// NOTE: AVX2 stores u = q + 32 in [0, 64) (unsigned; chunk_avx2 folds the - 32 into its magic
// constant, the fallback chunk subtracts it), and takes the qh pair as (qh << (4 - 2 sh)) & 0x30
// (sh = 3: (qh >> 2) & 0x30): 17 integer ops per 128 codes where the signed codes took 28
CODA_AI void q6_codes(const uint8_t* blk, int8_t* q) {
  const __m256i m4 = _mm256_set1_epi8(0x0F), m30 = _mm256_set1_epi8(0x30);
  for (int hf = 0; hf < 2; ++hf) {
    const __m256i hv = load32(blk + 128 + hf * 32);
    const __m256i l0 = load32(blk + hf * 64), l1 = load32(blk + hf * 64 + 32);
    __m256i* o = reinterpret_cast<__m256i*>(q + hf * 128);
    _mm256_store_si256(o, _mm256_or_si256(_mm256_and_si256(l0, m4),
                                          _mm256_and_si256(_mm256_slli_epi16(hv, 4), m30)));
    _mm256_store_si256(o + 1, _mm256_or_si256(_mm256_and_si256(l1, m4),
                                              _mm256_and_si256(_mm256_slli_epi16(hv, 2), m30)));
    _mm256_store_si256(o + 2, _mm256_or_si256(nibbles(l0, 4), _mm256_and_si256(hv, m30)));
    _mm256_store_si256(o + 3, _mm256_or_si256(nibbles(l1, 4),
                                              _mm256_and_si256(_mm256_srli_epi16(hv, 2), m30)));
  }
}
#endif

// 8 bytes -> 8 floats (unsigned or signed) times d, stored at out.
template <bool SIGNED>
CODA_AI void times8(uint64_t bytes, float d, float* out) {
  const __m128i b = _mm_cvtsi64_si128(static_cast<long long>(bytes));
  const __m256i i = SIGNED ? _mm256_cvtepi8_epi32(b) : _mm256_cvtepu8_epi32(b);
  _mm256_storeu_ps(out, _mm256_mul_ps(_mm256_cvtepi32_ps(i), _mm256_set1_ps(d)));
}

template <int T>
CODA_AI void scales(const uint8_t* blk, Scales& s) {
  if (T == Q4_K || T == Q5_K) {  // NOTE: a[j], b[j] per sub-block j of 32 (kquants.h's
    // scale_min_k4 on all 8 at once: bytes 0..3 low 6 bits; 4..7 from the 4-bit and 2-bit parts)
    const uint32_t u0 = le32(blk + 4), u1 = le32(blk + 8), u2 = le32(blk + 12);
    const uint32_t sc_hi = (u2 & 0x0F0F0F0Fu) | (((u0 >> 6) & 0x03030303u) << 4);
    const uint32_t mn_hi = ((u2 >> 4) & 0x0F0F0F0Fu) | (((u1 >> 6) & 0x03030303u) << 4);
    times8<false>((u0 & 0x3F3F3F3Fu) | static_cast<uint64_t>(sc_hi) << 32, f16c(blk), s.a);
    // NOTE: -(dmin * mn): the product is exact, so negating the factor first is the same value
    times8<false>((u1 & 0x3F3F3F3Fu) | static_cast<uint64_t>(mn_hi) << 32, -f16c(blk + 2), s.b);
  } else if (T == Q6_K) {
    const float d = f16c(blk + 208);
    uint64_t lo, hi;
    std::memcpy(&lo, blk + 192, 8);
    std::memcpy(&hi, blk + 200, 8);
    times8<true>(lo, d, s.a);
    times8<true>(hi, d, s.a + 8);
    q6_codes(blk, s.q);
#if CODA_ISA == CODA_AVX2
    const __m256 nm = _mm256_set1_ps(-kMagic);
    _mm256_storeu_ps(s.c, _mm256_mul_ps(_mm256_loadu_ps(s.a), nm));
    _mm256_storeu_ps(s.c + 8, _mm256_mul_ps(_mm256_loadu_ps(s.a + 8), nm));
#endif
  } else if (T == Q3_K) {
    // NOTE: kquants.h's scale_q3k for all 16 at once (byte i: the low or high nibble of byte
    // i % 8, | bits 2 (i / 4) of byte 8 + i % 4 at bit 4; then as int8 minus 32), and
    // d * sc as times8's sc * d (the same product)
    const uint32_t a0 = le32(blk + 96), a1 = le32(blk + 100), t = le32(blk + 104);
    const uint32_t m4 = 0x0F0F0F0Fu, m2 = 0x03030303u;
    const __m128i u = _mm_sub_epi8(  // NOTE: bytewise, no borrow between bytes
        _mm_set_epi32(static_cast<int>(((a1 >> 4) & m4) | (((t >> 6) & m2) << 4)),
                      static_cast<int>(((a0 >> 4) & m4) | (((t >> 4) & m2) << 4)),
                      static_cast<int>((a1 & m4) | (((t >> 2) & m2) << 4)),
                      static_cast<int>((a0 & m4) | ((t & m2) << 4))),
        _mm_set1_epi8(32));
    const uint64_t lo = static_cast<uint64_t>(_mm_cvtsi128_si64(u));
    const uint64_t hi = static_cast<uint64_t>(_mm_extract_epi64(u, 1));
    const float d = f16c(blk + 108);
    times8<true>(lo, d, s.a);
    times8<true>(hi, d, s.a + 8);
  } else {  // Q2_K
    const float d = f16c(blk + 80), dmin = f16c(blk + 82);
    for (int i = 0; i < 16; ++i) {
      s.a[i] = d * static_cast<float>(blk[i] & 15);
      s.b[i] = -(dmin * static_cast<float>(blk[i] >> 4));
    }
  }
}

// Weights 16 i .. 16 i + 15 of a super-block (kquants.h's layouts and formulas).
template <int T, int I>
CODA_AI W16 chunk(const uint8_t* blk, const Scales& s) {
  if (T == Q4_K) {  // idx = c*64 + h*32 + l: byte qs[c*32 + l], nibble h
    constexpr int c = I / 4, h = (I / 2) % 2, half = I % 2;
#if CODA_ISA == CODA_AVX512
    // NOTE: as blocks_avx512.h's Q4 tiles: the sub-block's 16 possible weights q a + b (q a is
    // exact: 4 bits times a's 17, so one rounding, fma(q, a, b)'s bits) looked up by nibble
    // (vpermps reads the low 4 bits of each index: the high nibble needs a shift, no mask);
    // a table and a widened load serve two chunks (the compiler shares them)
    const __m512i q = _mm512_cvtepu8_epi32(ld16(blk + 16 + c * 32 + half * 16));
    const __m512 table = _mm512_add_ps(
        _mm512_mul_ps(_mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                      _mm512_set1_ps(s.a[I / 2])),
        _mm512_set1_ps(s.b[I / 2]));
    return _mm512_permutexvar_ps(h ? _mm512_srli_epi32(q, 4) : q, table);
#else
    return fmaw(codes16(bits(ld16(blk + 16 + c * 32 + half * 16), 4 * h, 15)), s.a[I / 2], s.b[I / 2]);
#endif
  } else if (T == Q5_K) {
    constexpr int c = I / 4, h = (I / 2) % 2, half = I % 2, j = 2 * c + h;
    const __m128i lo = bits(ld16(blk + 48 + c * 32 + half * 16), 4 * h, 15);
    const __m128i hi = _mm_slli_epi16(bits(ld16(blk + 16 + half * 16), j, 1), 4);
    return fmaw(codes16(_mm_or_si128(lo, hi)), s.a[I / 2], s.b[I / 2]);
  } else if (T == Q6_K) {  // the codes unpacked by scales<Q6_K> (q6_codes)
#if CODA_ISA == CODA_AVX512
    return mulw(scodes16(ld16(reinterpret_cast<const uint8_t*>(s.q) + 16 * I)), s.a[I]);
#else  // NOTE: AVX2's q6_codes stores q + 32
    const __m128i u = ld16(reinterpret_cast<const uint8_t*>(s.q) + 16 * I);
    return mulw(scodes16(_mm_sub_epi8(u, _mm_set1_epi8(32))), s.a[I]);
#endif
  } else if (T == Q3_K) {  // idx = h*128 + s*32 + half*16 + l
    constexpr int h = I / 8, sh = (I / 2) % 4, half = I % 2, hb = h * 4 + sh;
    const __m128i lo = bits(ld16(blk + 32 + h * 32 + half * 16), 2 * sh, 3);
    const __m128i bit = bits(ld16(blk + half * 16), hb, 1);
    // NOTE: q = lo - 4 where the mask bit is 0
    const __m128i q = _mm_sub_epi8(lo, _mm_andnot_si128(_mm_slli_epi16(bit, 2), _mm_set1_epi8(4)));
    return mulw(scodes16(q), s.a[I]);
  } else {  // Q2_K, idx = h*128 + s*32 + half*16 + l
    constexpr int h = I / 8, sh = (I / 2) % 4, half = I % 2;
    return fmaw(codes16(bits(ld16(blk + 16 + h * 32 + half * 16), 2 * sh, 3)), s.a[I], s.b[I]);
  }
}

#if CODA_ISA == CODA_AVX2
// AVX2 chunks for a block whose scales are finite (run() checks; other blocks take chunk()).
// Codes are widened straight from memory, 8 at a time (one vpmovzx/sx with a memory operand: no
// extract, no shift of a 16-byte register), and each half's weights are computed so that the
// FMA pipes do no more than before and the conversion leaves them:
// * Q6_K: f = as_float(0x4B400000 + q) is exactly M + q (M = 1.5 * 2^23, |q| <= 32, the
//   "magic number" conversion, one integer add); then fma(f, a, c) with c = -M * a (exact, see
//   Scales::c) is round(M a + q a - M a) = round(q * a): one rounding of the same real number
//   as kquants.h's (d * sc) * q, so the same bits. Needs a finite a (run() checks d).
// * Q4_K, Q5_K, Q2_K: the code from its dword (and, shifts), converted, then fma(q, a, b) as
//   before; Q3_K: (lo | mask bit << 2) - 4, converted, times a, as before.
// (Measured at one row, 1B shapes, 1 thread, against the chunk() path on this build: Q6_K about
// 1.25x, Q4_K 1.5-1.7x, Q5_K 1.2x, Q3_K / Q2_K 1.15x; docs/quantization.md.)
CODA_AI __m256i ld8u(const void* p) {
  return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}

template <int T, int I>
CODA_AI W16 chunk_avx2(const uint8_t* blk, const Scales& s) {
  if constexpr (T == Q6_K) {
    // NOTE: the codes are u = q + 32: M + q = bits 0x4B400000 - 32 + u
    const __m256i mg = _mm256_set1_epi32(0x4B400000 - 32);
    const __m256 a = _mm256_broadcast_ss(s.a + I), c = _mm256_broadcast_ss(s.c + I);
    const __m256 f0 = _mm256_castsi256_ps(_mm256_add_epi32(ld8u(s.q + 16 * I), mg));
    const __m256 f1 = _mm256_castsi256_ps(_mm256_add_epi32(ld8u(s.q + 16 * I + 8), mg));
    return {_mm256_fmadd_ps(f0, a, c), _mm256_fmadd_ps(f1, a, c)};
  } else if constexpr (T == Q4_K) {
    constexpr int c = I / 4, h = (I / 2) % 2, half = I % 2;
    const uint8_t* p = blk + 16 + c * 32 + half * 16;
    __m256i q0 = ld8u(p), q1 = ld8u(p + 8);
    if (h) {
      q0 = _mm256_srli_epi32(q0, 4);
      q1 = _mm256_srli_epi32(q1, 4);
    } else {
      q0 = _mm256_and_si256(q0, _mm256_set1_epi32(15));
      q1 = _mm256_and_si256(q1, _mm256_set1_epi32(15));
    }
    const __m256 a = _mm256_broadcast_ss(s.a + I / 2), b = _mm256_broadcast_ss(s.b + I / 2);
    return {_mm256_fmadd_ps(_mm256_cvtepi32_ps(q0), a, b),
            _mm256_fmadd_ps(_mm256_cvtepi32_ps(q1), a, b)};
  } else if constexpr (T == Q5_K) {  // NOTE: bit j of qh[l] is the code's bit 4
    constexpr int c = I / 4, h = (I / 2) % 2, half = I % 2, j = 2 * c + h;
    const uint8_t* p = blk + 48 + c * 32 + half * 16;
    const uint8_t* ph = blk + 16 + half * 16;
    __m256i q[2];
    for (int e = 0; e < 2; ++e) {
      const __m256i v = ld8u(p + 8 * e), hv = ld8u(ph + 8 * e);
      const __m256i lo = h ? _mm256_srli_epi32(v, 4) : _mm256_and_si256(v, _mm256_set1_epi32(15));
      const __m256i hb = j <= 4 ? _mm256_slli_epi32(hv, 4 - j) : _mm256_srli_epi32(hv, j - 4);
      q[e] = _mm256_or_si256(lo, _mm256_and_si256(hb, _mm256_set1_epi32(16)));
    }
    const __m256 a = _mm256_broadcast_ss(s.a + I / 2), b = _mm256_broadcast_ss(s.b + I / 2);
    return {_mm256_fmadd_ps(_mm256_cvtepi32_ps(q[0]), a, b),
            _mm256_fmadd_ps(_mm256_cvtepi32_ps(q[1]), a, b)};
  } else if constexpr (T == Q3_K) {  // NOTE: q = (lo | mask bit << 2) - 4
    constexpr int h = I / 8, sh = (I / 2) % 4, half = I % 2, hb = h * 4 + sh;
    const uint8_t* p = blk + 32 + h * 32 + half * 16;
    const uint8_t* pm = blk + half * 16;
    __m256i q[2];
    for (int e = 0; e < 2; ++e) {
      const __m256i v = ld8u(p + 8 * e), mv = ld8u(pm + 8 * e);
      const __m256i lo = _mm256_and_si256(_mm256_srli_epi32(v, 2 * sh), _mm256_set1_epi32(3));
      const __m256i bt = hb <= 2 ? _mm256_slli_epi32(mv, 2 - hb) : _mm256_srli_epi32(mv, hb - 2);
      q[e] = _mm256_sub_epi32(_mm256_or_si256(lo, _mm256_and_si256(bt, _mm256_set1_epi32(4))),
                              _mm256_set1_epi32(4));
    }
    const __m256 a = _mm256_broadcast_ss(s.a + I);
    return {_mm256_mul_ps(_mm256_cvtepi32_ps(q[0]), a), _mm256_mul_ps(_mm256_cvtepi32_ps(q[1]), a)};
  } else {  // Q2_K
    constexpr int h = I / 8, sh = (I / 2) % 4, half = I % 2;
    const uint8_t* p = blk + 16 + h * 32 + half * 16;
    const __m256i m3 = _mm256_set1_epi32(3);
    const __m256i q0 = _mm256_and_si256(_mm256_srli_epi32(ld8u(p), 2 * sh), m3);
    const __m256i q1 = _mm256_and_si256(_mm256_srli_epi32(ld8u(p + 8), 2 * sh), m3);
    const __m256 a = _mm256_broadcast_ss(s.a + I), b = _mm256_broadcast_ss(s.b + I);
    return {_mm256_fmadd_ps(_mm256_cvtepi32_ps(q0), a, b),
            _mm256_fmadd_ps(_mm256_cvtepi32_ps(q1), a, b)};
  }
}

// Whether chunk_avx2 may run a block of type T (Q6_K: a finite d).
template <int T>
CODA_AI bool fast_ok(const uint8_t* blk) {
  if constexpr (T == Q6_K) {
    uint16_t h;
    std::memcpy(&h, blk + 208, 2);
    return (h & 0x7C00u) != 0x7C00u;  // NOTE: exponent all ones: inf or NaN
  } else {
    return true;
  }
}
#endif

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

// The widest row tile each build keeps in registers with G outputs.
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
  int s = 0;
  int64_t first = 0;
  auto locate = [&c](int64_t n, int& seg, int64_t& f) {
    while (n >= f + c.segs[seg].rows) f += c.segs[seg++].rows;
  };
  for (int64_t n = n0; n < n1;) {
    locate(n, s, first);
    const KqSeg& q = c.segs[s];
    const int64_t i0 = n - first;
    const int gw = gwidth(q.type);
    const int g = static_cast<int>(min64(min64(gw, n1 - n), q.rows - i0));
    const uint8_t* row[GMAX];
    const uint8_t* next[GMAX] = {};
    for (int j = 0; j < g; ++j) {
      const int64_t i = i0 + j;
      row[j] = q.base + (q.row_map ? q.row_map[i] : i) * q.row_bytes;
    }
    // the group after the next one (two groups ahead, as the span kernel)
    {
      int t = s;
      int64_t f = first;
      for (int j = 0; j < gw; ++j) {
        const int64_t m = n + 2 * gw + j;
        if (m >= n1) break;
        locate(m, t, f);
        const KqSeg& u = c.segs[t];
        if (u.row_bytes != q.row_bytes) break;
        const int64_t i = m - f;
        next[j] = u.base + (u.row_map ? u.row_map[i] : i) * u.row_bytes;
      }
    }
    const float* bias = q.bias ? q.bias + i0 : nullptr;
    float* y = c.y + n;
    switch (q.type) {
      case Q4_K: rows<Q4_K>(g, row, next, c.x, c.M, c.K, bias, y, c.N); break;
      case Q5_K: rows<Q5_K>(g, row, next, c.x, c.M, c.K, bias, y, c.N); break;
      case Q6_K: rows<Q6_K>(g, row, next, c.x, c.M, c.K, bias, y, c.N); break;
      case Q3_K: rows<Q3_K>(g, row, next, c.x, c.M, c.K, bias, y, c.N); break;
      default: rows<Q2_K>(g, row, next, c.x, c.M, c.K, bias, y, c.N); break;
    }
    n += g;
  }
}

}  // namespace fused
}  // namespace kq
}  // namespace CODA_NS
}  // namespace coda_native

#undef CODA_AI
#endif  // CODA_ISA != CODA_SCALAR
