// GGUF block decoders: ggml's own row bytes -> float32, bit for bit as gguf.quants.dequantize
// (issue 18). Raw pointers only, no torch: shared by the matmul (kquant_kernels.h) and the
// embedding gather. Portable C++ (every build has it; the SIMD builds use kquants_avx2.h).
// Included after isa.h, inside each build's own namespace (see isa.h).
//
// Exactness: every decoder computes each weight with the same float32 operations, in the same
// order, as gguf-py's numpy dequantize. Every product that feeds an addition is exact in
// float32 (an fp16 scale has 11 significant bits, a 6-bit sub-scale and a <= 6-bit quant keep
// the product under 24 bits), so contracting ``d * q + m`` into an FMA cannot change a bit;
// the one product that can round (Q6_K's (d * sc) * q) is a plain multiply everywhere.
//
// Block layouts (QK_K = 256 weights per super-block; "idx" is a weight's index in its block):
//   Q4_0  18 B: d, qs[16]             w = d * (nib - 8)           nib: idx<16 low of qs[idx], else high of qs[idx-16]
//   Q4_1  20 B: d, m, qs[16]          w = d * nib + m
//   Q5_0  22 B: d, qh[4], qs[16]      w = d * (nib | bit(qh, idx) << 4 - 16)
//   Q5_1  24 B: d, m, qh[4], qs[16]   w = d * q5 + m
//   Q8_0  34 B: d, qs[32] int8        w = q * d
//   Q2_K  84 B: sc[16], qs[64], d, dmin   q = qs[h*32+l] >> 2s & 3 (idx = h*128 + s*32 + l),
//               w = (d * (sc[idx/16] & 15)) * q - dmin * (sc[idx/16] >> 4)
//   Q3_K 110 B: hm[32], qs[64], sc[12], d  q = (qs[..] >> 2s & 3) - 4 * !(hm[idx%32] >> idx/32 & 1),
//               w = (d * (sc6[idx/16] - 32)) * q
//   Q4_K 144 B: d, dmin, sc[12], qs[128]   q = qs[c*32+l] >> 4h & 15 (idx = c*64 + h*32 + l),
//               w = (d * sc6[idx/32]) * q - dmin * mn6[idx/32]
//   Q5_K 176 B: d, dmin, sc[12], qh[32], qs[128]  as Q4_K, q |= (qh[idx%32] >> idx/32 & 1) << 4
//   Q6_K 210 B: ql[128], qh[64], sc[16] int8, d   q = (ql nibble | qh pair << 4) - 32,
//               w = (d * sc[idx/16]) * q
//   F32 4 B, F16 2 B, BF16 2 B per weight.
#pragma once
#include <cstdint>
#include <cstring>

#include "isa.h"
#include "table.h"

namespace coda_native {
namespace CODA_NS {
namespace kq {

// NOTE: the numbers are ggml's GGMLQuantizationType values, so Python passes them unchanged.
// NOTE: GGML type numbers, block_size and block_bytes are in table.h (shared with api.cpp).
using ggml::block_bytes;
using ggml::block_size;
using ggml::F32, ggml::F16, ggml::BF16, ggml::Q4_0, ggml::Q4_1, ggml::Q5_0, ggml::Q5_1,
    ggml::Q8_0, ggml::Q2_K, ggml::Q3_K, ggml::Q4_K, ggml::Q5_K, ggml::Q6_K;

// Exact IEEE half -> float (subnormals, infinities and NaN included), portable: isa.h's h2f.
inline float f16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return h2f(h);
}

inline float bf16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  const uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// Q4_K / Q5_K: the 6-bit scale and min of sub-block j (0..7) from the 12 packed bytes.
inline void scale_min_k4(const uint8_t* s, int j, int& sc, int& mn) {
  if (j < 4) {
    sc = s[j] & 63;
    mn = s[j + 4] & 63;
  } else {
    sc = (s[j + 4] & 0x0F) | ((s[j - 4] >> 2) & 0x30);
    mn = (s[j + 4] >> 4) | ((s[j] >> 2) & 0x30);
  }
}

// Q3_K: the signed 6-bit scale of sub-block i (0..15).
inline int scale_q3k(const uint8_t* s, int i) {
  const int lo = i < 8 ? (s[i] & 0x0F) : (s[i - 8] >> 4);
  const int hi = (s[8 + (i % 4)] >> (2 * (i / 4))) & 3;
  return static_cast<int>(static_cast<int8_t>(static_cast<uint8_t>(lo | (hi << 4)))) - 32;
}

// One block of type T at b -> out[block_size(T)]. Plain loops (the compiler vectorises them;
// every weight is computed by the same per-element operations whatever the vector width).
inline void decode_q4_0(const uint8_t* b, float* out) {
  const float d = f16(b);
  for (int j = 0; j < 16; ++j) {
    out[j] = d * static_cast<float>((b[2 + j] & 15) - 8);
    out[j + 16] = d * static_cast<float>((b[2 + j] >> 4) - 8);
  }
}

inline void decode_q4_1(const uint8_t* b, float* out) {
  const float d = f16(b), m = f16(b + 2);
  for (int j = 0; j < 16; ++j) {
    out[j] = d * static_cast<float>(b[4 + j] & 15) + m;
    out[j + 16] = d * static_cast<float>(b[4 + j] >> 4) + m;
  }
}

inline uint32_t le32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

inline void decode_q5_0(const uint8_t* b, float* out) {
  const float d = f16(b);
  const uint32_t qh = le32(b + 2);
  const uint8_t* qs = b + 6;
  for (int j = 0; j < 16; ++j) {
    const int lo = (qs[j] & 15) | static_cast<int>(((qh >> j) & 1) << 4);
    const int hi = (qs[j] >> 4) | static_cast<int>(((qh >> (j + 16)) & 1) << 4);
    out[j] = d * static_cast<float>(lo - 16);
    out[j + 16] = d * static_cast<float>(hi - 16);
  }
}

inline void decode_q5_1(const uint8_t* b, float* out) {
  const float d = f16(b), m = f16(b + 2);
  const uint32_t qh = le32(b + 4);
  const uint8_t* qs = b + 8;
  for (int j = 0; j < 16; ++j) {
    const int lo = (qs[j] & 15) | static_cast<int>(((qh >> j) & 1) << 4);
    const int hi = (qs[j] >> 4) | static_cast<int>(((qh >> (j + 16)) & 1) << 4);
    out[j] = d * static_cast<float>(lo) + m;
    out[j + 16] = d * static_cast<float>(hi) + m;
  }
}

inline void decode_q8_0(const uint8_t* b, float* out) {
  const float d = f16(b);
  const int8_t* q = reinterpret_cast<const int8_t*>(b + 2);
  for (int j = 0; j < 32; ++j) out[j] = static_cast<float>(q[j]) * d;
}

inline void decode_q2_k(const uint8_t* b, float* out) {
  const uint8_t* sc = b;
  const uint8_t* qs = b + 16;
  const float d = f16(b + 80), dmin = f16(b + 82);
  for (int h = 0; h < 2; ++h)
    for (int s = 0; s < 4; ++s)
      for (int half = 0; half < 2; ++half) {  // NOTE: 16 weights share one sub-scale
        const int idx0 = h * 128 + s * 32 + half * 16, sub = idx0 / 16;
        const float dl = d * static_cast<float>(sc[sub] & 15);
        const float ml = dmin * static_cast<float>(sc[sub] >> 4);
        const uint8_t* q = qs + h * 32 + half * 16;
        float* o = out + idx0;
        for (int l = 0; l < 16; ++l) o[l] = dl * static_cast<float>((q[l] >> (2 * s)) & 3) - ml;
      }
}

inline void decode_q3_k(const uint8_t* b, float* out) {
  const uint8_t* hm = b;
  const uint8_t* qs = b + 32;
  const uint8_t* sc = b + 96;
  const float d = f16(b + 108);
  for (int h = 0; h < 2; ++h)
    for (int s = 0; s < 4; ++s)
      for (int half = 0; half < 2; ++half) {
        const int idx0 = h * 128 + s * 32 + half * 16, sub = idx0 / 16, hb = idx0 / 32;
        const float dl = d * static_cast<float>(scale_q3k(sc, sub));
        const uint8_t* q = qs + h * 32 + half * 16;
        const uint8_t* m = hm + half * 16;
        float* o = out + idx0;
        for (int l = 0; l < 16; ++l) {
          const int v = ((q[l] >> (2 * s)) & 3) - (((m[l] >> hb) & 1) ? 0 : 4);
          o[l] = dl * static_cast<float>(v);
        }
      }
}

inline void decode_q4_k(const uint8_t* b, float* out) {
  const float d = f16(b), dmin = f16(b + 2);
  const uint8_t* sc = b + 4;
  const uint8_t* qs = b + 16;
  for (int c = 0; c < 4; ++c)
    for (int h = 0; h < 2; ++h) {
      int s, mn;
      scale_min_k4(sc, 2 * c + h, s, mn);
      const float d1 = d * static_cast<float>(s), m1 = dmin * static_cast<float>(mn);
      const uint8_t* q = qs + c * 32;
      float* o = out + c * 64 + h * 32;
      for (int l = 0; l < 32; ++l) o[l] = d1 * static_cast<float>((q[l] >> (4 * h)) & 15) - m1;
    }
}

inline void decode_q5_k(const uint8_t* b, float* out) {
  const float d = f16(b), dmin = f16(b + 2);
  const uint8_t* sc = b + 4;
  const uint8_t* qh = b + 16;
  const uint8_t* qs = b + 48;
  for (int c = 0; c < 4; ++c)
    for (int h = 0; h < 2; ++h) {
      const int j = 2 * c + h;
      int s, mn;
      scale_min_k4(sc, j, s, mn);
      const float d1 = d * static_cast<float>(s), m1 = dmin * static_cast<float>(mn);
      const uint8_t* q = qs + c * 32;
      float* o = out + j * 32;
      for (int l = 0; l < 32; ++l) {
        const int v = ((q[l] >> (4 * h)) & 15) | (((qh[l] >> j) & 1) << 4);
        o[l] = d1 * static_cast<float>(v) - m1;
      }
    }
}

inline void decode_q6_k(const uint8_t* b, float* out) {
  const uint8_t* ql = b;
  const uint8_t* qh = b + 128;
  const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
  const float d = f16(b + 208);
  for (int half = 0; half < 2; ++half)
    for (int s = 0; s < 4; ++s)
      for (int g = 0; g < 2; ++g) {  // NOTE: 16 weights share one sub-scale
        const int idx0 = half * 128 + s * 32 + g * 16;
        const float d1 = d * static_cast<float>(sc[idx0 / 16]);
        // idx = half*128 + h*64 + l64 for ql (nibble h), = half*128 + s*32 + l32 for qh
        const int h = s / 2, l64 = (s % 2) * 32 + g * 16;
        const uint8_t* lo = ql + half * 64 + l64;
        const uint8_t* hi = qh + half * 32 + g * 16;
        float* o = out + idx0;
        for (int l = 0; l < 16; ++l) {
          const int v = (((lo[l] >> (4 * h)) & 15) | (((hi[l] >> (2 * s)) & 3) << 4)) - 32;
          o[l] = d1 * static_cast<float>(v);
        }
      }
}

// Weights [k0, k0 + n) of one row (row points at the row's first byte); k0 and n are
// multiples of the type's block size. Returns false for a type it does not know.
inline bool decode_span(int32_t t, const uint8_t* row, int64_t k0, int64_t n, float* out) {
  const int64_t bs = block_size(t), bb = block_bytes(t);
  if (bs == 0) return false;
  const uint8_t* p = row + (k0 / bs) * bb;
  switch (t) {
    case F32: std::memcpy(out, p, static_cast<size_t>(n) * 4); return true;
    case F16: for (int64_t i = 0; i < n; ++i) out[i] = f16(p + 2 * i); return true;
    case BF16: for (int64_t i = 0; i < n; ++i) out[i] = bf16(p + 2 * i); return true;
    default: break;
  }
  for (int64_t i = 0; i < n; i += bs, p += bb, out += bs) {
    switch (t) {
      case Q4_0: decode_q4_0(p, out); break;
      case Q4_1: decode_q4_1(p, out); break;
      case Q5_0: decode_q5_0(p, out); break;
      case Q5_1: decode_q5_1(p, out); break;
      case Q8_0: decode_q8_0(p, out); break;
      case Q2_K: decode_q2_k(p, out); break;
      case Q3_K: decode_q3_k(p, out); break;
      case Q4_K: decode_q4_k(p, out); break;
      case Q5_K: decode_q5_k(p, out); break;
      case Q6_K: decode_q6_k(p, out); break;
      default: return false;
    }
  }
  return true;
}

}  // namespace kq
}  // namespace CODA_NS
}  // namespace coda_native
