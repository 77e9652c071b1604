// AVX2: a K-quant block's codes unpacked once per super-block into Scales::q (issue 18), for the
// exact-mode register kernel (kquant_fused.h): the codes are the same integers the per-chunk
// unpack computed, so the weights and bits are unchanged. Split out of kquant_decode.h (size);
// included by it only.
#pragma once

#include "kquants_avx2.h"

#ifndef CODA_AI
#error "included by kquant_decode.h (which kquant_fused.h includes after defining CODA_AI)"
#endif

#if CODA_ISA == CODA_AVX2
namespace coda_native {
namespace CODA_NS {
namespace kq {
namespace fused {

// Q5_K, AVX2: the 256 5-bit codes of a block in weight order (weight c*64 + h*32 + l: nibble h
// of ql[c*32 + l], bit 2c + h of qh[l] as bit 4), 32 codes per integer op; chunk_avx2 then
// widens a chunk's codes with one load each (per 16 weights it unpacked nibble and high bit
// from two widened loads: ~10 integer ops). The same integers, so the same bits. The qh bit
// goes to bit 4 by a 16-bit shift: the bits a shift carries across a byte never reach bit 4
// (left by k <= 4: they land below bit k; right by k <= 3: at bit 8 - k or above).
CODA_AI void q5_codes(const uint8_t* blk, int8_t* q) {
  const __m256i m4 = _mm256_set1_epi8(0x0F), m16 = _mm256_set1_epi8(0x10);
  const __m256i qh = load32(blk + 16);
  for (int c = 0; c < 4; ++c) {
    const __m256i v = load32(blk + 48 + c * 32);
    // NOTE: bit 2c (low nibbles) and 2c + 1 (high nibbles) of each qh byte, moved to bit 4
    const __m256i h0 = c < 3 ? _mm256_slli_epi16(qh, 4 - 2 * c) : _mm256_srli_epi16(qh, 2);
    const __m256i h1 = c < 2 ? _mm256_slli_epi16(qh, 3 - 2 * c)
                             : _mm256_srli_epi16(qh, 2 * c - 3);
    __m256i* o = reinterpret_cast<__m256i*>(q + c * 64);
    _mm256_store_si256(o, _mm256_or_si256(_mm256_and_si256(v, m4), _mm256_and_si256(h0, m16)));
    _mm256_store_si256(o + 1, _mm256_or_si256(nibbles(v, 4), _mm256_and_si256(h1, m16)));
  }
}

// Q3_K, AVX2: the 256 signed codes q = (lo | mask bit << 2) - 4 in weight order (weight
// h*128 + s*32 + l: bits 2s of ql[h*32 + l], bit 4h + s of hmask[l]), 32 per integer op (the
// chunk took ~12 integer ops per 16 weights on two widened loads). 16-bit shifts as q5_codes:
// a right shift by 2s <= 6 carries bits to bit 8 - 2s >= 2 or above (masked to bits 0, 1), a
// shift of the mask by <= 5 never carries into bit 2.
CODA_AI void q3_codes(const uint8_t* blk, int8_t* q) {
  const __m256i m3 = _mm256_set1_epi8(3), m4 = _mm256_set1_epi8(4);
  const __m256i hm = load32(blk);
  for (int h = 0; h < 2; ++h) {
    const __m256i v = load32(blk + 32 + h * 32);
    for (int s = 0; s < 4; ++s) {
      const int hb = 4 * h + s;
      const __m256i lo = _mm256_and_si256(_mm256_srli_epi16(v, 2 * s), m3);
      const __m256i bt = hb <= 2 ? _mm256_slli_epi16(hm, 2 - hb) : _mm256_srli_epi16(hm, hb - 2);
      _mm256_store_si256(reinterpret_cast<__m256i*>(q + h * 128 + s * 32),
                         _mm256_sub_epi8(_mm256_or_si256(lo, _mm256_and_si256(bt, m4)), m4));
    }
  }
}

}  // namespace fused
}  // namespace kq
}  // namespace CODA_NS
}  // namespace coda_native
#endif  // CODA_ISA == CODA_AVX2
