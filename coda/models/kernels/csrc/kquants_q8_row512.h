// packed-q8 K-quant dots at M = 1, AVX-512 build (issue 18, branch kq8b1): Q4_K and Q6_K one
// output at a time like kquants_q8_row.h's row1, with 64 weights per instruction. Same exact
// integer sums per block and the same per-output float steps in block order (row1's), so the
// same bits as the portable path and as the AVX2 build.
//
// Per call the Q8_K row is copied once into the order Q4_K / Q5_K codes come out of a 64-byte
// load (`X1::xp`, per 128 codes: sub-blocks of 32 in the order 0 2 1 3: one AND gives
// sub-blocks 2c and 2c + 2, one shift + AND 2c + 1 and 2c + 3) and its sums of 16 are paired
// into sums of 32 (`X1::bs2`: the mins' term is one multiply per sub-block). Q6_K's codes come
// out of a 64-byte load in x's own order. Per block: 4 VNNI dpbusd (64 code x activation
// products each, exact int32 sums of 4), 2 packssdw into int16 (exact: the sums fit) and 2 VNNI
// dpwssd with the sub-block scale of each int16 lane; the four blocks of a group have their
// scale / min bytes unpacked in one register and their sums reduced together.
#pragma once
#include <cstdint>
#include <cstring>

#include "kquants_q8_row.h"

#if CODA_ISA == CODA_AVX512
namespace coda_native {
namespace CODA_NS {
namespace kq {
namespace q8s {

inline __m512i load64(const void* p) { return _mm512_loadu_si512(p); }

inline __m256i fold512(__m512i a) {
  return _mm256_add_epi32(_mm512_castsi512_si256(a), _mm512_extracti64x4_epi64(a, 1));
}

// Four blocks' sums: y[j] (16 int32 lanes adding to isum_j), mt (lane 4l + j: a part of msum_j,
// the parts of j spread over the four 128-bit lanes l) -> [i0 m0 i1 m1 | i2 m2 i3 m3] (exact
// int32: any association is the same integer).
inline __m256i reduce_group(const __m512i* y, __m512i mt) {
  const __m512i a01 = _mm512_add_epi32(_mm512_unpacklo_epi32(y[0], y[1]),
                                       _mm512_unpackhi_epi32(y[0], y[1]));
  const __m512i a23 = _mm512_add_epi32(_mm512_unpacklo_epi32(y[2], y[3]),
                                       _mm512_unpackhi_epi32(y[2], y[3]));
  // NOTE: 128-bit lane l of v: [i0 i1 i2 i3] (parts); of lo / hi: [i0 m0 i1 m1] / [i2 m2 i3 m3]
  const __m512i v = _mm512_add_epi32(_mm512_unpacklo_epi64(a01, a23),
                                     _mm512_unpackhi_epi64(a01, a23));
  const __m512i lo = _mm512_unpacklo_epi32(v, mt), hi = _mm512_unpackhi_epi32(v, mt);
  const __m256i l2 = fold512(lo), h2 = fold512(hi);
  return _mm256_add_epi32(_mm256_permute2x128_si256(l2, h2, 0x20),
                          _mm256_permute2x128_si256(l2, h2, 0x31));
}

// kquant_decode.h's k4_codes for four blocks at once, from each block's first 16 bytes (d, dmin
// and 12 of the 12 scale bytes): per 128-bit lane the 8 scales in bytes 0..7, the 8 mins in 8..15.
inline __m512i k4_codes4(__m512i v) {
  const __m512i lo = _mm512_shuffle_epi8(
      v, _mm512_broadcast_i32x4(_mm_setr_epi8(4, 5, 6, 7, 12, 13, 14, 15, 8, 9, 10, 11, 12, 13, 14, 15)));
  const __m512i lo2 = _mm512_mask_blend_epi16(0xC0C0C0C0u, lo, _mm512_srli_epi16(lo, 4));
  const __m512i low = _mm512_and_si512(lo2, _mm512_broadcast_i32x4(_mm_setr_epi8(
      63, 63, 63, 63, 15, 15, 15, 15, 63, 63, 63, 63, 15, 15, 15, 15)));
  const __m512i hb = _mm512_shuffle_epi8(v, _mm512_broadcast_i32x4(_mm_setr_epi8(
      -1, -1, -1, -1, 4, 5, 6, 7, -1, -1, -1, -1, 8, 9, 10, 11)));
  return _mm512_ternarylogic_epi32(low, _mm512_srli_epi16(hb, 2), _mm512_set1_epi8(0x30), 0xF8);
}

// vpermw index over sw (128-bit lane j: block j's 8 scales as int16): per 128-bit lane L of the
// result [sc a x4, sc b x4] with (a, b) = (s, s + 1) for L < 2, (s + 2, s + 3) for L >= 2: the
// sub-blocks of packssdw's words from two dpbusd results (d of sub-blocks s | s + 2, then
// s + 1 | s + 3).
inline __m512i sel_pack(int j, int s) {
  alignas(64) int16_t v[32];
  for (int w = 0; w < 32; ++w)
    v[w] = static_cast<int16_t>(8 * j + s + (w / 8 < 2 ? 0 : 2) + (w % 8 < 4 ? 0 : 1));
  return _mm512_load_si512(v);
}

// One Q4_K / Q5_K block against xp's block: 16 int32 lanes adding to isum. VNNI dpbusd takes 64
// codes x activations per instruction (4 per int32 lane, one sub-block per 256 bits), packssdw
// pairs two results into int16 (exact) and dpwssd applies each lane's sub-block scale.
template <int T>
inline __m512i dot_q4k(const uint8_t* blk, const int8_t* xp, __m512i sw, int j) {
  const __m512i m4 = _mm512_set1_epi8(0x0F), z = _mm512_setzero_si512();
  const uint8_t* qs = blk + (T == Q5_K ? 48 : 16);
  const __m512i v0 = load64(qs), v1 = load64(qs + 64);
  __m512i c0 = _mm512_and_si512(v0, m4), c1 = _mm512_and_si512(_mm512_srli_epi16(v0, 4), m4);
  __m512i c2 = _mm512_and_si512(v1, m4), c3 = _mm512_and_si512(_mm512_srli_epi16(v1, 4), m4);
  if constexpr (T == Q5_K) {
    // NOTE: sub-block s takes bit s of qh as its bit 4; [qh | qh >> 2] puts the bits of
    // sub-blocks 0 | 2, 1 | 3, 4 | 6, 5 | 7 (c0..c3's halves) at bits 0, 1, 4, 5 (the bits a
    // 16-bit shift carries in from the next byte are masked off)
    const __m256i qh = load32(blk + 16);
    const __m512i h2 =
        _mm512_inserti64x4(_mm512_castsi256_si512(qh), _mm256_srli_epi16(qh, 2), 1);
    const __m512i m10 = _mm512_set1_epi8(0x10);
    c0 = _mm512_ternarylogic_epi32(c0, _mm512_slli_epi16(h2, 4), m10, 0xF8);  // NOTE: a | (b & c)
    c1 = _mm512_ternarylogic_epi32(c1, _mm512_slli_epi16(h2, 3), m10, 0xF8);
    c2 = _mm512_ternarylogic_epi32(c2, h2, m10, 0xF8);
    c3 = _mm512_ternarylogic_epi32(c3, _mm512_srli_epi16(h2, 1), m10, 0xF8);
  }
  const __m512i d0 = _mm512_dpbusd_epi32(z, c0, load64(xp));
  const __m512i d1 = _mm512_dpbusd_epi32(z, c1, load64(xp + 64));
  const __m512i d2 = _mm512_dpbusd_epi32(z, c2, load64(xp + 128));
  const __m512i d3 = _mm512_dpbusd_epi32(z, c3, load64(xp + 192));
  // NOTE: |4 u x| <= 4 * 31 * 127 fits int16, so packssdw is exact; times a scale <= 63 in int32
  const __m512i a = _mm512_madd_epi16(_mm512_packs_epi32(d0, d1),
                                      _mm512_permutexvar_epi16(sel_pack(j, 0), sw));
  return _mm512_dpwssd_epi32(a, _mm512_packs_epi32(d2, d3),
                             _mm512_permutexvar_epi16(sel_pack(j, 4), sw));
}

// vpermw index over Q6_K's 16 sub-scales (int16): per 128-bit lane L of the result
// [sc 8h + L x4, sc 8h + 4 + L x4]: packssdw's words from the dpbusd results of half h.
inline __m512i sel_q6(int h) {
  alignas(64) int16_t v[32];
  for (int w = 0; w < 32; ++w) v[w] = static_cast<int16_t>(8 * h + w / 8 + (w % 8 < 4 ? 0 : 4));
  return _mm512_load_si512(v);
}

// One Q6_K block against x's block in its own order (16 lanes adding to isum; no mins): per
// half, two 64-byte code vectors (sub-blocks of 16 per 128 bits), dpbusd, packssdw, dpwssd.
inline __m512i dot_q6k(const uint8_t* blk, const int8_t* x, const int16_t* bsum) {
  const __m512i m4 = _mm512_set1_epi8(0x0F), m30 = _mm512_set1_epi8(0x30);
  const __m512i z = _mm512_setzero_si512();
  const __m256i sc16 =
      _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 192)));
  const __m512i scz = _mm512_castsi256_si512(sc16);
  // NOTE: off = 32: the offset's sum comes off as 32 * osum (as kquants_q8_blk.h's dot)
  const __m256i o =
      _mm256_madd_epi16(sc16, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bsum)));
  __m512i a = _mm512_zextsi256_si512(
      _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32(o, 5)));
  for (int h = 0; h < 2; ++h) {
    const __m512i l = load64(blk + 64 * h);
    const __m256i hv = load32(blk + 128 + 32 * h);
    // NOTE: [hv | hv >> 2]: bits 0, 1 / 2, 3 of each byte for codes 0..63, bits 4, 5 / 6, 7 for
    // 64..127 (the bits a 16-bit shift carries in from the next byte are masked off)
    const __m512i h2 =
        _mm512_inserti64x4(_mm512_castsi256_si512(hv), _mm256_srli_epi16(hv, 2), 1);
    const __m512i qa = _mm512_ternarylogic_epi32(
        l, m4, _mm512_and_si512(_mm512_slli_epi16(h2, 4), m30), 0xEA);  // NOTE: (l & m4) | c
    const __m512i qb = _mm512_ternarylogic_epi32(
        _mm512_srli_epi16(l, 4), m4, _mm512_and_si512(h2, m30), 0xEA);
    // NOTE: |4 u x| <= 4 * 63 * 127 = 32004 fits int16 (packssdw exact); times |sc| <= 128
    const __m512i p = _mm512_packs_epi32(_mm512_dpbusd_epi32(z, qa, load64(x + 128 * h)),
                                         _mm512_dpbusd_epi32(z, qb, load64(x + 128 * h + 64)));
    a = _mm512_dpwssd_epi32(a, p, _mm512_permutexvar_epi16(sel_q6(h), scz));
  }
  return a;
}

// M = 1, Q4_K / Q5_K / Q6_K: row1's loop and float steps (the same integers per block, the same
// scalar fma steps in block order) with the dots above.
template <int T>
inline float row1x(const uint8_t* row, const uint8_t* next, int64_t nb, int64_t bb,
                   const int8_t* xq, const int16_t* bs, const X1& x1, const float* dx) {
  float acc = 0.0f, macc = 0.0f;
  const __m256i spread = _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3);
  // NOTE: 128-bit lane j's int32 i -> lane i's element j (a 4 x 4 transpose)
  const __m512i tr = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  for (int64_t b0 = 0; b0 < nb; b0 += 4) {
    const int n4 = nb - b0 < 4 ? static_cast<int>(nb - b0) : 4;
    const uint8_t* blk[4];
    for (int j = 0; j < 4; ++j) blk[j] = row + (b0 + (j < n4 ? j : n4 - 1)) * bb;  // NOTE: padding lanes unused
    __m512i ys[4];
    __m128i dd;
    __m512i mt = _mm512_setzero_si512();
    if constexpr (T == Q4_K || T == Q5_K) {
      __m512i hd = _mm512_castsi128_si512(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk[0])));
      hd = _mm512_inserti32x4(hd, _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk[1])), 1);
      hd = _mm512_inserti32x4(hd, _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk[2])), 2);
      hd = _mm512_inserti32x4(hd, _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk[3])), 3);
      dd = _mm512_castsi512_si128(_mm512_permutexvar_epi32(tr, hd));  // NOTE: each block's d, dmin
      const __m512i sm = k4_codes4(hd);
      // NOTE: pshufb: bytes 0..7 (the scales) / 8..15 (the mins) zero-extended to int16
      const __m512i sw = _mm512_shuffle_epi8(sm, _mm512_broadcast_i32x4(_mm_set_epi64x(
          static_cast<long long>(0x8007800680058004ull), static_cast<long long>(0x8003800280018000ull))));
      const __m512i mw = _mm512_shuffle_epi8(sm, _mm512_broadcast_i32x4(_mm_set_epi64x(
          static_cast<long long>(0x800F800E800D800Cull), static_cast<long long>(0x800B800A80098008ull))));
      // NOTE: mins x pair sums: lane j, element i a part of msum_j; transposed for reduce_group
      mt = _mm512_permutexvar_epi32(
          tr, _mm512_madd_epi16(mw, _mm512_maskz_loadu_epi16(static_cast<__mmask32>((1ull << (8 * n4)) - 1), x1.bs2 + b0 * 8)));
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) {
        const int64_t b = b0 + (j < n4 ? j : n4 - 1);
        if (next) prefetch_block(next + b * bb, bb);
        ys[j] = dot_q4k<T>(blk[j], x1.xp + b * QKK, sw, j);
      }
    } else {
      alignas(16) uint32_t h[4];
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) {
        const int64_t b = b0 + (j < n4 ? j : n4 - 1);
        if (next) prefetch_block(next + b * bb, bb);
        uint16_t d;
        std::memcpy(&d, blk[j] + 208, 2);  // NOTE: the last bytes of the block: no 4-byte read
        h[j] = d;
        ys[j] = dot_q6k(blk[j], xq + b * QKK, bs + b * 16);
      }
      dd = _mm_set_epi32(static_cast<int>(h[3]), static_cast<int>(h[2]), static_cast<int>(h[1]),
                         static_cast<int>(h[0]));
    }
    const __m256 w = _mm256_cvtph_ps(dd);
    const __m256 dxs = _mm256_permutevar8x32_ps(
        _mm256_castps128_ps256(_mm_maskz_loadu_ps(static_cast<__mmask8>((1u << n4) - 1), dx + b0)), spread);
    alignas(32) float f[8], s[8];
    _mm256_store_ps(f, _mm256_cvtepi32_ps(reduce_group(ys, mt)));
    _mm256_store_ps(s, _mm256_mul_ps(w, dxs));
    for (int j = 0; j < n4; ++j) {  // NOTE: row1's steps, in block order
      acc = fma1(f[2 * j], s[2 * j], acc);
      macc = fma1(f[2 * j + 1], s[2 * j + 1], macc);
    }
  }
  return acc - macc;
}

}  // namespace q8s
}  // namespace kq
}  // namespace CODA_NS
}  // namespace coda_native
#endif  // CODA_ISA == CODA_AVX512
