// Row-local ops of the decoder (issues 10, 18; T3, T4), over isa.h: each output row is computed
// from its own input row (and, for attention, its own keys) by one fixed sequence of operations,
// the same on every ISA, so its bits never depend on the batch, the row's place in it, the thread
// count or the machine.
//
// rms_norm / add_rms_norm: y = (x * (1 / sqrt(sum(x^2) / n + eps))) * w, sum(x^2) the canonical
// 16-lane dot (isa.h) over the first n - n % 16 elements, then the tail added left to right; add_rms_norm
// first forms x = x + r (in place).
// silu_mul: [T, 2I] (gate | up) -> silu(gate) * up, silu(g) = g / (1 + exp(-g)).
// gelu_tanh_mul: the same with gelu_tanh(g) = 0.5 g (1 + tanh(u)) = g / (1 + exp(-2u)),
// u = g (c + c 0.044715 g^2), c = sqrt(2 / pi) (Gemma 3's gate; torch's approximate="tanh").
//
// attend: row-by-row paged attention with RoPE and the cache write fused in. One call per layer
// and step, for every row of the step (prefill chunks and decode tokens alike):
//   1. optionally a per-head RMSNorm of q and k (Qwen3, Gemma 3; norm_row below, weights qn,
//      kn); RoPE on each row's q and k heads over their first rot dims (HF's half rotation of
//      those dims: y = (x * cos + swap(x) * sin) * scale, elementwise, no contraction: the same
//      bits as coda/models/llama.py's apply_rope; dims past rot are copied, times scale:
//      partial rotary), q scaled by `scale` (default 1/sqrt(d)); K and V written at the row's
//      cache slot;
//   2. then, per (row, query head), over the row's OWN keys lo..p read through its block table
//      (lo = 0, or p - window + 1 for a sliding-window layer):
//      s_i = q . k_i (isa.h's canonical 16-lane dot);
//      m = max s_i; e_i = exp(s_i - m) (isa.h's exp, the same for every element);
//      out = (sum_i e_i v_i) / (sum_i e_i), both sums strictly left to right over i.
// Cache layout: one layer's [2, H_kv, blocks, block_size, d] float32 tensor (K, then V).
#pragma once

#include <cstdlib>

#include "isa.h"
#include "pool.h"
#include "table.h"

namespace coda_native {
namespace CODA_NS {
namespace rows {

// y = x * cos + swap_halves(x) * sin_signed, then * scale, over the first rot of d floats; the
// rest times scale (a scale of 1 copies them exactly).
inline void rope_head(const float* x, const float* cos, const float* sin, float scale, float* y,
                      int64_t d, int64_t rot) {
  const int64_t half = rot / 2;
  for (int64_t i = 0; i < rot; ++i) {
    const float a = x[i] * cos[i];
    const float b = x[i < half ? i + half : i - half] * sin[i];
    y[i] = (a + b) * scale;
  }
  for (int64_t i = rot; i < d; ++i) y[i] = x[i] * scale;
}

inline void norm_row(const float* x, const float* w, float eps, float* y, int64_t n);

// One head: per-head RMSNorm (weight w, or none) then RoPE (rope_head).
inline void head_in(const float* x, const float* w, float eps, const float* cos, const float* sin,
                    float scale, float* y, int64_t d, int64_t rot) {
  if (w == nullptr) return rope_head(x, cos, sin, scale, y, d, rot);
  float normed[256];  // NOTE: d <= 256 (api.cpp checks)
  norm_row(x, w, eps, normed, d);
  rope_head(normed, cos, sin, scale, y, d, rot);
}

// Pass 1: RoPE, scale q into qr [T, H, d]; write K and V of every row at its slot.
inline void rope_and_store(const AttendCall& a) {
  const int64_t d = a.d, width = (a.H + 2 * a.Hkv) * d, rot = a.rot;
  const float scale = a.scale > 0.0f ? a.scale : 1.0f / __builtin_sqrtf(static_cast<float>(d));
  float* K = a.kv;
  float* V = a.kv + a.Hkv * a.slots * d;
  pool::parallel_for(a.T, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const float* row = a.qkv + t * width;
      const float* c = a.cos + t * rot;
      const float* sn = a.sin + t * rot;
      for (int64_t h = 0; h < a.H; ++h)
        head_in(row + h * d, a.qn, a.eps, c, sn, scale, a.qr + (t * a.H + h) * d, d, rot);
      for (int64_t g = 0; g < a.Hkv; ++g) {
        head_in(row + (a.H + g) * d, a.kn, a.eps, c, sn, 1.0f, K + (g * a.slots + a.slot[t]) * d,
                d, rot);
        const float* v = row + (a.H + a.Hkv + g) * d;
        float* vd = V + (g * a.slots + a.slot[t]) * d;
        for (int64_t i = 0; i < d; ++i) vd[i] = v[i];
      }
    }
  });
}

// Offsets (in floats, from a head's base) of keys lo..hi-1 (into off[0..hi-lo)) read through a
// block table.
inline void key_offsets(const int64_t* table, int64_t lo, int64_t hi, int64_t bs, int64_t d,
                        int64_t* off) {
  for (int64_t i = lo; i < hi; ++i) off[i - lo] = (table[i / bs] * bs + i % bs) * d;
}

// q . k for d = 16 * D16 floats: the canonical 16-lane dot (isa.h).
template <int D16>
inline float dot_qk(const F16* qv, const float* k) {
  F16 acc = zero16();
  for (int j = 0; j < D16; ++j) acc = fma16(qv[j], load16(k + j * 16), acc);
  return tree16(acc);
}

// Pass 2 for one (row, KV head): its `group` query heads over keys 0..n-1 (offsets `off`).
template <int D16>
void attend_one(const float* q, const float* K, const float* V, const int64_t* off, int64_t n,
                int64_t group, float* scores, float* out) {
  constexpr int64_t d = D16 * 16, D8 = D16 * 2;
  const int64_t stride = (n + 7) / 8 * 8;
  for (int64_t h = 0; h < group; ++h) {
    F16 qv[D16];
    for (int j = 0; j < D16; ++j) qv[j] = load16(q + h * d + j * 16);
    float* sc = scores + h * stride;
    int64_t i = 0;
    for (; i + 4 <= n; i += 4) {  // NOTE: 4 keys side by side: independent chains, same order
      const float* k0 = K + off[i];
      const float* k1 = K + off[i + 1];
      const float* k2 = K + off[i + 2];
      const float* k3 = K + off[i + 3];
      F16 a0 = zero16(), a1 = zero16(), a2 = zero16(), a3 = zero16();
      for (int j = 0; j < D16; ++j) {
        a0 = fma16(qv[j], load16(k0 + j * 16), a0);
        a1 = fma16(qv[j], load16(k1 + j * 16), a1);
        a2 = fma16(qv[j], load16(k2 + j * 16), a2);
        a3 = fma16(qv[j], load16(k3 + j * 16), a3);
      }
      sc[i] = tree16(a0);
      sc[i + 1] = tree16(a1);
      sc[i + 2] = tree16(a2);
      sc[i + 3] = tree16(a3);
    }
    for (; i < n; ++i) sc[i] = dot_qk<D16>(qv, K + off[i]);
  }
  for (int64_t h = 0; h < group; ++h) {
    float* sc = scores + h * stride;
    float m = sc[0];
    for (int64_t i = 1; i < n; ++i) m = max1(sc[i], m);
    for (int64_t i = n; i < stride; ++i) sc[i] = m;  // NOTE: padding lanes; never summed
    const F8 mv = set8(m);
    for (int64_t i = 0; i < stride; i += 8) store8(sc + i, exp8(sub8(load8(sc + i), mv)));
    float denom = 0.0f;
    for (int64_t i = 0; i < n; ++i) denom += sc[i];  // NOTE: strictly left to right
    F8 acc[D8];  // NOTE: element j * 8 + l sums e_i v_i[j * 8 + l] over i, left to right
    for (int j = 0; j < D8; ++j) acc[j] = zero8();
    for (int64_t i = 0; i < n; ++i) {
      const float* v = V + off[i];
      const F8 e = set8(sc[i]);
      for (int j = 0; j < D8; ++j) acc[j] = fma8(e, load8(v + j * 8), acc[j]);
    }
    const F8 dv = set8(denom);
    for (int j = 0; j < D8; ++j) store8(out + h * d + j * 8, div8(acc[j], dv));
  }
}

using AttendFn = void (*)(const float*, const float*, const float*, const int64_t*, int64_t,
                          int64_t, float*, float*);

inline AttendFn attend_for(int64_t d) {
  switch (d) {
    case 32: return attend_one<2>;
    case 64: return attend_one<4>;
    case 96: return attend_one<6>;
    case 128: return attend_one<8>;
    case 256: return attend_one<16>;
    default: return nullptr;
  }
}

// The first key row t sees: 0, or p - window + 1 for a sliding-window layer.
inline int64_t first_key(int64_t pos, int64_t window) {
  return window > 0 && pos + 1 > window ? pos + 1 - window : 0;
}

inline float sum_squares(const float* x, int64_t n) {
  F16 acc = zero16();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const F16 v = load16(x + i);
    acc = fma16(v, v, acc);
  }
  float ss = tree16(acc);
  for (; i < n; ++i) ss += x[i] * x[i];
  return ss;
}

inline void norm_row(const float* x, const float* w, float eps, float* y, int64_t n) {
  const float inv = 1.0f / __builtin_sqrtf(sum_squares(x, n) / static_cast<float>(n) + eps);
  for (int64_t i = 0; i < n; ++i) y[i] = (x[i] * inv) * w[i];
}

}  // namespace rows

#include "rows_items.h"  // NOTE: inside namespace CODA_NS (the SIMD builds' lane items)

inline void attend(const AttendCall& a) {
  rows::rope_and_store(a);
#if CODA_ISA != CODA_SCALAR
  if (lanes::run_for(a.d) != nullptr && a.H / a.Hkv <= lanes::kLanes) return attend_items(a);
#endif
  const rows::AttendFn fn = rows::attend_for(a.d);
  const int64_t group = a.H / a.Hkv, stride = (a.max_pos + 1 + 7) / 8 * 8, d = a.d;
  const float* K = a.kv;
  const float* V = a.kv + a.Hkv * a.slots * d;
  pool::parallel_for(a.T * a.Hkv, 1, [&](int64_t w0, int64_t w1) {
    // NOTE: malloc, not std::vector: no std template is instantiated in an ISA build (isa.h)
    float* scores = static_cast<float*>(std::malloc(sizeof(float) * group * stride));
    int64_t* off = static_cast<int64_t*>(std::malloc(sizeof(int64_t) * (a.max_pos + 1)));
    int64_t have = -1;  // NOTE: the row whose key offsets are in `off`
    for (int64_t w = w0; w < w1; ++w) {
      const int64_t t = w / a.Hkv, g = w % a.Hkv;
      const int64_t lo = rows::first_key(a.pos[t], a.window);
      if (have != t) rows::key_offsets(a.tables + a.seq[t] * a.maxb, lo, a.pos[t] + 1, a.bs, d, off);
      have = t;
      fn(a.qr + (t * a.H + g * group) * d, K + g * a.slots * d, V + g * a.slots * d, off,
         a.pos[t] + 1 - lo, group, scores, a.out + (t * a.H + g * group) * d);
    }
    std::free(off);
    std::free(scores);
  });
}

inline void rms_norm(const float* x, const float* w, float eps, float* y, int64_t T, int64_t D) {
  pool::parallel_for(T, 16, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) rows::norm_row(x + t * D, w, eps, y + t * D, D);
  });
}

// x += r (in place), y = rms_norm(x): the residual add and the next norm in one pass.
inline void add_rms_norm(float* x, const float* r, const float* w, float eps, float* y, int64_t T,
                         int64_t D) {
  pool::parallel_for(T, 16, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      float* row = x + t * D;
      for (int64_t i = 0; i < D; ++i) row[i] = row[i] + r[t * D + i];
      rows::norm_row(row, w, eps, y + t * D, D);
    }
  });
}

// gelu_tanh(g) * up (see the file comment), row by row, the same formula per element.
inline void gelu_tanh_mul(const float* gu, float* y, int64_t T, int64_t I) {
  pool::parallel_for(T, 16, [&](int64_t t0, int64_t t1) {
    const F8 one = set8(1.0f), c = set8(0.7978845608028654f), c3 = set8(0.035677408136300125f),
             m2 = set8(-2.0f);
    for (int64_t t = t0; t < t1; ++t) {
      const float* g = gu + t * 2 * I;
      for (int64_t i = 0; i < I; i += 8) {
        const F8 gv = load8(g + i);
        const F8 u = mul8(gv, add8(c, mul8(c3, mul8(gv, gv))));
        const F8 s = div8(gv, add8(one, exp8(mul8(m2, u))));
        store8(y + t * I + i, mul8(s, load8(g + I + i)));
      }
    }
  });
}

inline void silu_mul(const float* gu, float* y, int64_t T, int64_t I) {
  pool::parallel_for(T, 16, [&](int64_t t0, int64_t t1) {
    const F8 one = set8(1.0f);
    for (int64_t t = t0; t < t1; ++t) {
      const float* g = gu + t * 2 * I;
      for (int64_t i = 0; i < I; i += 8) {
        const F8 gv = load8(g + i);
        const F8 s = div8(gv, add8(one, exp8(sub8(zero8(), gv))));
        store8(y + t * I + i, mul8(s, load8(g + I + i)));
      }
    }
  });
}

}  // namespace CODA_NS
}  // namespace coda_native
