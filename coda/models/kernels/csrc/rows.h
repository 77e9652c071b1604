// Row-local ops of the decoder (issues 10, 18; T3, T4), over isa.h: each output row is computed
// from its own input row (and, for attention, its own keys) by one fixed sequence of operations,
// the same on every ISA, so its bits never depend on the batch, the row's place in it, the thread
// count or the machine.
//
// rms_norm / add_rms_norm: y = (x * (1 / sqrt(sum(x^2) / n + eps))) * w, sum(x^2) the canonical
// 16-lane dot (isa.h) over the first n - n % 16 elements, then the tail added left to right; add_rms_norm
// first forms x = x + r (in place).
// silu_mul: [T, 2I] (gate | up) -> silu(gate) * up, silu(g) = g / (1 + exp(-g)).
//
// attend: row-by-row paged attention with RoPE and the cache write fused in. One call per layer
// and step, for every row of the step (prefill chunks and decode tokens alike):
//   1. RoPE on each row's q and k heads (HF's half rotation: y = (x * cos + swap(x) * sin) *
//      scale, elementwise, no contraction: the same bits as coda/models/llama.py's apply_rope), q
//      scaled by 1/sqrt(d); K and V written at the row's cache slot;
//   2. then, per (row, query head), over the row's OWN keys 0..p read through its block table:
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

// y = x * cos + swap_halves(x) * sin_signed, then * scale, for one head of d floats.
inline void rope_head(const float* x, const float* cos, const float* sin, float scale, float* y,
                      int64_t d) {
  const int64_t half = d / 2;
  for (int64_t i = 0; i < d; ++i) {
    const float a = x[i] * cos[i];
    const float b = x[i < half ? i + half : i - half] * sin[i];
    y[i] = (a + b) * scale;
  }
}

// Pass 1: RoPE, scale q into qr [T, H, d]; write K and V of every row at its slot.
inline void rope_and_store(const AttendCall& a) {
  const int64_t d = a.d, width = (a.H + 2 * a.Hkv) * d;
  const float scale = 1.0f / __builtin_sqrtf(static_cast<float>(d));
  float* K = a.kv;
  float* V = a.kv + a.Hkv * a.slots * d;
  pool::parallel_for(a.T, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const float* row = a.qkv + t * width;
      const float* c = a.cos + t * d;
      const float* sn = a.sin + t * d;
      for (int64_t h = 0; h < a.H; ++h)
        rope_head(row + h * d, c, sn, scale, a.qr + (t * a.H + h) * d, d);
      for (int64_t g = 0; g < a.Hkv; ++g) {
        rope_head(row + (a.H + g) * d, c, sn, 1.0f, K + (g * a.slots + a.slot[t]) * d, d);
        const float* v = row + (a.H + a.Hkv + g) * d;
        float* vd = V + (g * a.slots + a.slot[t]) * d;
        for (int64_t i = 0; i < d; ++i) vd[i] = v[i];
      }
    }
  });
}

// Offsets (in floats, from a head's base) of keys 0..n-1 read through a block table.
inline void key_offsets(const int64_t* table, int64_t n, int64_t bs, int64_t d, int64_t* off) {
  for (int64_t i = 0, blk = 0; i < n; ++blk) {
    const int64_t base = table[blk] * bs;
    for (int64_t o = 0; o < bs && i < n; ++o, ++i) off[i] = (base + o) * d;
  }
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

inline void attend(const AttendCall& a) {
  rows::rope_and_store(a);
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
      if (have != t) rows::key_offsets(a.tables + a.seq[t] * a.maxb, a.pos[t] + 1, a.bs, d, off);
      have = t;
      fn(a.qr + (t * a.H + g * group) * d, K + g * a.slots * d, V + g * a.slots * d, off,
         a.pos[t] + 1, group, scores, a.out + (t * a.H + g * group) * d);
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
