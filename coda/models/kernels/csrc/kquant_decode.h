// The K-quant super-block decode of the exact-mode register kernel (kquant_fused.h; issue 18),
// AVX2 and AVX-512 builds: 16 weights at a time into registers (W16), by the same float32
// operations as kquants.h (an exact product, then at most one rounding), so the weights are
// kquants.h's values bit for bit. Split out of kquant_fused.h (size); included by it only.
#pragma once

#include <immintrin.h>

#include <cstring>

#include "kquants.h"
#include "kquants_avx2.h"
#include "table.h"
// NOTE: AVX2: Q5_K / Q3_K codes unpacked once per block (q5_codes, q3_codes)
#include "kquant_codes_avx2.h"

#ifndef CODA_AI
#error "included by kquant_fused.h (which defines CODA_AI)"
#endif

namespace coda_native {
namespace CODA_NS {
namespace kq {
namespace fused {

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
  // NOTE: Q4_K, Q5_K: a[0..8) the sub-blocks' d * sc, a[8..16) their -(dmin * mn) (one 16-lane
  // store; b unused)
  alignas(64) float a[16];
  alignas(64) float b[16];
  // NOTE: Q6_K (and, AVX2, Q5_K / Q3_K: kquant_codes_avx2.h): the block's 256 codes (Q6_K
  // AVX-512: q - 32, signed; Q6_K AVX2: q + 32, unsigned; Q5_K 0..31; Q3_K -4..3) in weight
  // order, unpacked once per block with full-width integer ops (a 16-weight chunk then costs
  // one widening load instead of nine integer ops on 16 bytes); the codes are the same
  // integers, so the bits are unchanged. In memory, not registers: a chunk's codes are
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

// 16 bytes (unsigned or signed) -> 16 floats times d, stored at out (64-byte aligned).
template <bool SIGNED>
CODA_AI void times16(__m128i b, float d, float* out) {
#if CODA_ISA == CODA_AVX512
  const __m512i i = SIGNED ? _mm512_cvtepi8_epi32(b) : _mm512_cvtepu8_epi32(b);
  _mm512_store_ps(out, _mm512_mul_ps(_mm512_cvtepi32_ps(i), _mm512_set1_ps(d)));
#else
  const __m128i h = _mm_unpackhi_epi64(b, b);
  const __m256i i0 = SIGNED ? _mm256_cvtepi8_epi32(b) : _mm256_cvtepu8_epi32(b);
  const __m256i i1 = SIGNED ? _mm256_cvtepi8_epi32(h) : _mm256_cvtepu8_epi32(h);
  const __m256 dv = _mm256_set1_ps(d);
  _mm256_store_ps(out, _mm256_mul_ps(_mm256_cvtepi32_ps(i0), dv));
  _mm256_store_ps(out + 8, _mm256_mul_ps(_mm256_cvtepi32_ps(i1), dv));
#endif
}

// Q4_K / Q5_K: the 12 packed bytes at blk + 4 -> bytes 0..7 the sub-blocks' 6-bit scales,
// 8..15 their 6-bit mins (kquants.h's scale_min_k4 for all 8 at once, in one 16-byte register:
// a handful of vector ops where the byte-by-byte unpack took ~20 scalar ones per block).
// s[j] below is byte j of the 12: j < 4: sc = s[j] & 63, mn = s[j + 4] & 63; j >= 4:
// sc = (s[j + 4] & 15) | (s[j - 4] >> 6) << 4, mn = (s[j + 4] >> 4) | (s[j] >> 6) << 4.
CODA_AI __m128i k4_codes(const uint8_t* blk) {
  // NOTE: 16 bytes from blk + 4 (the 12 + 4 bytes of the codes after them; a block is >= 144)
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 4));
  // low parts: sc0..3 = s0..3, sc4..7 = s8..11 (low nibble), mn0..3 = s4..7, mn4..7 = s8..11
  // (high nibble: shifted down below)
  const __m128i lo = _mm_shuffle_epi8(v, _mm_setr_epi8(0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 8,
                                                       9, 10, 11));
  // NOTE: pblendw takes words 6, 7 (bytes 12..15, mn4..7) from the shifted copy; the bits a
  // 16-bit shift moves in from the next byte are masked off below
  const __m128i lo2 = _mm_blend_epi16(lo, _mm_srli_epi16(lo, 4), 0xC0);
  const __m128i low = _mm_and_si128(lo2, _mm_setr_epi8(63, 63, 63, 63, 15, 15, 15, 15, 63, 63, 63,
                                                       63, 15, 15, 15, 15));
  // high parts (bits 4, 5) of sc4..7 = s0..3 >> 6, of mn4..7 = s4..7 >> 6 (pshufb's -1: zero)
  const __m128i hb = _mm_shuffle_epi8(v, _mm_setr_epi8(-1, -1, -1, -1, 0, 1, 2, 3, -1, -1, -1, -1,
                                                       4, 5, 6, 7));
  return _mm_or_si128(low, _mm_and_si128(_mm_srli_epi16(hb, 2), _mm_set1_epi8(0x30)));
}

template <int T>
CODA_AI void scales(const uint8_t* blk, Scales& s) {
  if (T == Q4_K || T == Q5_K) {  // NOTE: a[j], a[8 + j] per sub-block j of 32 (k4_codes)
    const __m128i q = k4_codes(blk);
    // NOTE: [d, -dmin] (negating dmin first: q * (-dmin) is the exact -(dmin * q))
    const __m128 dm = _mm_xor_ps(_mm_cvtph_ps(_mm_cvtsi32_si128(static_cast<int>(le32(blk)))),
                                 _mm_castsi128_ps(_mm_set_epi32(0, 0, INT32_MIN, 0)));
#if CODA_ISA == CODA_AVX512
    const __m512 f = _mm512_permutexvar_ps(
        _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0), _mm512_castps128_ps512(dm));
    _mm512_store_ps(s.a, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(q)), f));
#else
    _mm256_store_ps(s.a, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(q)),
                                       _mm256_broadcastss_ps(dm)));
    _mm256_store_ps(s.a + 8, _mm256_mul_ps(
        _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_unpackhi_epi64(q, q))),
        _mm256_broadcastss_ps(_mm_movehdup_ps(dm))));
    if (T == Q5_K) q5_codes(blk, s.q);
#endif
  } else if (T == Q6_K) {
    times16<true>(ld16(blk + 192), f16c(blk + 208), s.a);
    q6_codes(blk, s.q);
#if CODA_ISA == CODA_AVX2
    const __m256 nm = _mm256_set1_ps(-kMagic);
    _mm256_storeu_ps(s.c, _mm256_mul_ps(_mm256_loadu_ps(s.a), nm));
    _mm256_storeu_ps(s.c + 8, _mm256_mul_ps(_mm256_loadu_ps(s.a + 8), nm));
#endif
  } else if (T == Q3_K) {
    // NOTE: kquants.h's scale_q3k for all 16 at once (byte i: the low or high nibble of byte
    // i % 8, | bits 2 (i / 4) of byte 8 + i % 4 at bit 4; then as int8 minus 32), and
    // d * sc as times16's sc * d (the same product)
    const uint32_t a0 = le32(blk + 96), a1 = le32(blk + 100), t = le32(blk + 104);
    const uint32_t m4 = 0x0F0F0F0Fu, m2 = 0x03030303u;
    const __m128i u = _mm_sub_epi8(  // NOTE: bytewise, no borrow between bytes
        _mm_set_epi32(static_cast<int>(((a1 >> 4) & m4) | (((t >> 6) & m2) << 4)),
                      static_cast<int>(((a0 >> 4) & m4) | (((t >> 4) & m2) << 4)),
                      static_cast<int>((a1 & m4) | (((t >> 2) & m2) << 4)),
                      static_cast<int>((a0 & m4) | ((t & m2) << 4))),
        _mm_set1_epi8(32));
    times16<true>(u, f16c(blk + 108), s.a);
#if CODA_ISA == CODA_AVX2
    q3_codes(blk, s.q);
#endif
  } else {  // Q2_K
    // NOTE: a = d * (sc & 15), b = (-dmin) * (sc >> 4): exact products, so negating dmin
    // first is kquants.h's -(dmin * mn)
    const __m128i v = ld16(blk);
    times16<false>(_mm_and_si128(v, _mm_set1_epi8(15)), f16c(blk + 80), s.a);
    times16<false>(bits(v, 4, 15), -f16c(blk + 82), s.b);
  }
}

#if CODA_ISA == CODA_AVX512
// Q4_K's lookup table for one sub-block: the weights q a + b of the 16 codes q. One fma: q a is
// exact (4 bits times a's 17: a = d * sc, an 11-bit half times a 6-bit integer), so
// fma(q, a, b) rounds once, as kquants.h's d1 * q - m1 does (b = -m1).
CODA_AI __m512 q4k_table(float a, float b) {
  return _mm512_fmadd_ps(_mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                         _mm512_set1_ps(a), _mm512_set1_ps(b));
}
#endif

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
    return _mm512_permutexvar_ps(h ? _mm512_srli_epi32(q, 4) : q, q4k_table(s.a[I / 2], s.a[8 + I / 2]));
#else
    return fmaw(codes16(bits(ld16(blk + 16 + c * 32 + half * 16), 4 * h, 15)), s.a[I / 2],
                s.a[8 + I / 2]);
#endif
  } else if (T == Q5_K) {
    constexpr int c = I / 4, h = (I / 2) % 2, half = I % 2, j = 2 * c + h;
    const __m128i lo = bits(ld16(blk + 48 + c * 32 + half * 16), 4 * h, 15);
    const __m128i hi = _mm_slli_epi16(bits(ld16(blk + 16 + half * 16), j, 1), 4);
    return fmaw(codes16(_mm_or_si128(lo, hi)), s.a[I / 2], s.a[8 + I / 2]);
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


}  // namespace fused
}  // namespace kq
}  // namespace CODA_NS
}  // namespace coda_native
