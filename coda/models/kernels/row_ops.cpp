// Row-local ops of the decoder, AVX2 + FMA (issue 10, T3, T4): each output row is computed from its
// own input row (and, for attention, its own keys) by one fixed sequence of instructions, so its
// bits never depend on the batch, the row's place in it or the thread count.
//
// rms_norm / add_rms_norm: y = (x * (1 / sqrt(sum(x^2) / n + eps))) * w, sum(x^2) one lane-wise FMA
// chain and one fixed horizontal sum; add_rms_norm first forms x = x + r (in place).
// silu_mul: [T, 2I] (gate | up) -> silu(gate) * up, silu(g) = g / (1 + exp(-g)).
//
// attend: row-by-row paged attention with RoPE and the cache write fused in. One call per layer and step, for every row of the step (prefill chunks and decode tokens alike):
//   1. RoPE on each row's q and k heads (HF's half rotation: y = x * cos + swap(x) * sin_signed,
//      elementwise, no FMA contraction: the same bits as coda/models/llama.py's apply_rope), q
//      scaled by 1/sqrt(d); K and V written at the row's cache slot;
//   2. then, per (row, query head), over the row's OWN keys 0..p read through its block table:
//      s_i = q . k_i (one fixed lane-wise FMA chain over d, one fixed horizontal sum);
//      m = max s_i; e_i = exp(s_i - m) (one vectorised exp, the same code for every element);
//      out = (sum_i e_i v_i) / (sum_i e_i), both sums strictly left to right over i.
//
// T4 by construction: a row's output is a function of its q and its keys only; the batch, the
// row's place in it, whether it is prefilled or decoded, the chunking and the thread count only
// choose which rows run, never the order of any reduction. Cache layout: one layer's
// [2, H_kv, blocks, block_size, d] float32 tensor (K, then V), as coda/models/attention.py.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace {

constexpr int64_t MAX_GROUP = 16;  // query heads per KV head handled together

inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// exp(x) for 8 lanes (Cephes' expf: range reduction by ln 2 in two parts, degree-5 polynomial,
// ~1 ulp); lanes below -87.3 give 0. Elementwise: a value's result never depends on its lane.
inline __m256 exp8(__m256 x) {
  const __m256 lo = _mm256_set1_ps(-87.33654475f);
  const __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
  x = _mm256_max_ps(x, lo);
  x = _mm256_min_ps(x, _mm256_set1_ps(88.3762626647949f));
  __m256 fx = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                              _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_sub_ps(x, _mm256_mul_ps(fx, _mm256_set1_ps(0.693359375f)));
  r = _mm256_sub_ps(r, _mm256_mul_ps(fx, _mm256_set1_ps(-2.12194440e-4f)));
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i e = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(fx), _mm256_set1_epi32(127)), 23);
  y = _mm256_mul_ps(y, _mm256_castsi256_ps(e));
  return _mm256_andnot_ps(under, y);
}

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

struct Shape {
  int64_t T, H, Hkv, d, slots, maxb, bs;
};

// Pass 1: RoPE, scale q into qr [T, H, d]; write K and V of every row at its slot.
void rope_and_store(const float* qkv, const float* cos, const float* sin, const int64_t* slot,
                    float* kv, float* qr, const Shape& s) {
  const int64_t width = (s.H + 2 * s.Hkv) * s.d;
  const float scale = 1.0f / std::sqrt(static_cast<float>(s.d));
  float* K = kv;
  float* V = kv + s.Hkv * s.slots * s.d;
  at::parallel_for(0, s.T, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const float* row = qkv + t * width;
      const float* c = cos + t * s.d;
      const float* sn = sin + t * s.d;
      for (int64_t h = 0; h < s.H; ++h)
        rope_head(row + h * s.d, c, sn, scale, qr + (t * s.H + h) * s.d, s.d);
      for (int64_t g = 0; g < s.Hkv; ++g) {
        float* kd = K + (g * s.slots + slot[t]) * s.d;
        rope_head(row + (s.H + g) * s.d, c, sn, 1.0f, kd, s.d);
        std::copy_n(row + (s.H + s.Hkv + g) * s.d, s.d, V + (g * s.slots + slot[t]) * s.d);
      }
    }
  });
}

// Offsets (in floats, from a head's base) of keys 0..n-1 read through a block table.
void key_offsets(const int64_t* table, int64_t n, const Shape& s, int64_t* off) {
  for (int64_t i = 0, blk = 0; i < n; ++blk) {
    const int64_t base = table[blk] * s.bs;
    for (int64_t o = 0; o < s.bs && i < n; ++o, ++i) off[i] = (base + o) * s.d;
  }
}

// Pass 2 for one (row, KV head): its `group` query heads over keys 0..n-1 (offsets `off`).
template <int D8>
void attend_one(const float* q, const float* K, const float* V, const int64_t* off, int64_t n,
                int64_t group, float* scores, float* out) {
  constexpr int64_t d = D8 * 8;
  const int64_t stride = (n + 7) / 8 * 8;
  for (int64_t h = 0; h < group; ++h) {  // scores: one FMA chain per (head, key)
    const float* qh = q + h * d;
    __m256 qv[D8];
    for (int j = 0; j < D8; ++j) qv[j] = _mm256_loadu_ps(qh + j * 8);
    float* sc = scores + h * stride;
    int64_t i = 0;
    for (; i + 4 <= n; i += 4) {  // NOTE: 4 keys side by side: independent chains, same order
      const float* k0 = K + off[i];
      const float* k1 = K + off[i + 1];
      const float* k2 = K + off[i + 2];
      const float* k3 = K + off[i + 3];
      __m256 a0 = _mm256_mul_ps(qv[0], _mm256_loadu_ps(k0));
      __m256 a1 = _mm256_mul_ps(qv[0], _mm256_loadu_ps(k1));
      __m256 a2 = _mm256_mul_ps(qv[0], _mm256_loadu_ps(k2));
      __m256 a3 = _mm256_mul_ps(qv[0], _mm256_loadu_ps(k3));
      for (int j = 1; j < D8; ++j) {
        a0 = _mm256_fmadd_ps(qv[j], _mm256_loadu_ps(k0 + j * 8), a0);
        a1 = _mm256_fmadd_ps(qv[j], _mm256_loadu_ps(k1 + j * 8), a1);
        a2 = _mm256_fmadd_ps(qv[j], _mm256_loadu_ps(k2 + j * 8), a2);
        a3 = _mm256_fmadd_ps(qv[j], _mm256_loadu_ps(k3 + j * 8), a3);
      }
      sc[i] = hsum8(a0);
      sc[i + 1] = hsum8(a1);
      sc[i + 2] = hsum8(a2);
      sc[i + 3] = hsum8(a3);
    }
    for (; i < n; ++i) {
      const float* k = K + off[i];
      __m256 acc = _mm256_mul_ps(qv[0], _mm256_loadu_ps(k));
      for (int j = 1; j < D8; ++j) acc = _mm256_fmadd_ps(qv[j], _mm256_loadu_ps(k + j * 8), acc);
      sc[i] = hsum8(acc);
    }
  }
  for (int64_t h = 0; h < group; ++h) {
    float* sc = scores + h * stride;
    float m = sc[0];
    for (int64_t i = 1; i < n; ++i) m = std::max(m, sc[i]);
    for (int64_t i = n; i < stride; ++i) sc[i] = m;  // NOTE: padding lanes; never summed
    const __m256 mv = _mm256_set1_ps(m);
    for (int64_t i = 0; i < stride; i += 8)
      _mm256_storeu_ps(sc + i, exp8(_mm256_sub_ps(_mm256_loadu_ps(sc + i), mv)));
    float denom = 0.0f;
    for (int64_t i = 0; i < n; ++i) denom += sc[i];  // NOTE: strictly left to right
    __m256 acc[D8];  // NOTE: lane j * 8 + l sums e_i v_i[j * 8 + l] over i, left to right
    for (int j = 0; j < D8; ++j) acc[j] = _mm256_setzero_ps();
    for (int64_t i = 0; i < n; ++i) {
      const float* v = V + off[i];
      const __m256 e = _mm256_set1_ps(sc[i]);
      for (int j = 0; j < D8; ++j) acc[j] = _mm256_fmadd_ps(e, _mm256_loadu_ps(v + j * 8), acc[j]);
    }
    const __m256 dv = _mm256_set1_ps(denom);
    for (int j = 0; j < D8; ++j) _mm256_storeu_ps(out + h * d + j * 8, _mm256_div_ps(acc[j], dv));
  }
}

using AttendFn = void (*)(const float*, const float*, const float*, const int64_t*, int64_t,
                          int64_t, float*, float*);

AttendFn attend_for(int64_t d) {
  switch (d) {
    case 32: return attend_one<4>;
    case 64: return attend_one<8>;
    case 96: return attend_one<12>;
    case 128: return attend_one<16>;
    default: return nullptr;
  }
}

// qkv [T, (H + 2 H_kv) d] (the fused projection's output), cos/sin_signed [T, d], kv_layer
// [2, H_kv, blocks, bs, d], slots/seq_of/positions [T], tables [B, maxb] -> out [T, H d].
at::Tensor attend(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                  const at::Tensor& kv_layer, const at::Tensor& slots, const at::Tensor& seq_of,
                  const at::Tensor& positions, const at::Tensor& tables, int64_t H, int64_t Hkv) {
  TORCH_CHECK(kv_layer.dim() == 5 && kv_layer.size(0) == 2 && kv_layer.size(1) == Hkv &&
              kv_layer.scalar_type() == at::kFloat && kv_layer.is_contiguous(),
              "kv_layer must be a contiguous float32 [2, H_kv, blocks, bs, d] tensor");
  Shape s{qkv.size(0), H, Hkv, kv_layer.size(4), kv_layer.size(2) * kv_layer.size(3),
          tables.size(1), kv_layer.size(3)};
  TORCH_CHECK(Hkv > 0 && H % Hkv == 0 && H / Hkv <= MAX_GROUP, "bad head counts ", H, "/", Hkv);
  const AttendFn fn = attend_for(s.d);
  TORCH_CHECK(fn != nullptr, "head_dim must be 32, 64, 96 or 128, got ", s.d);
  TORCH_CHECK(qkv.dim() == 2 && qkv.scalar_type() == at::kFloat && qkv.is_contiguous() &&
              qkv.size(1) == (H + 2 * Hkv) * s.d, "qkv must be contiguous float32 [T, (H+2Hkv)d]");
  for (const at::Tensor* t : {&cos, &sin})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() &&
                t->numel() == s.T * s.d, "cos/sin must be contiguous float32 [T, d]");
  for (const at::Tensor* t : {&slots, &seq_of, &positions})
    TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous() && t->numel() == s.T,
                "slots, seq_of and positions must be int64 [T]");
  TORCH_CHECK(tables.dim() == 2 && tables.scalar_type() == at::kLong && tables.is_contiguous(),
              "tables must be int64 [B, max_blocks]");
  const int64_t* slot = slots.data_ptr<int64_t>();
  const int64_t* seq = seq_of.data_ptr<int64_t>();
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t* tab = tables.data_ptr<int64_t>();
  int64_t max_pos = 0;
  for (int64_t t = 0; t < s.T; ++t) {
    TORCH_CHECK(slot[t] >= 0 && slot[t] < s.slots, "slot out of range");
    TORCH_CHECK(seq[t] >= 0 && seq[t] < tables.size(0), "sequence index out of range");
    TORCH_CHECK(pos[t] >= 0 && pos[t] / s.bs < s.maxb, "position beyond the block table");
    max_pos = std::max(max_pos, pos[t]);
  }
  for (int64_t i = 0; i < tables.numel(); ++i)
    TORCH_CHECK(tab[i] >= 0 && tab[i] < kv_layer.size(2), "block id out of range");
  at::Tensor qr = at::empty({s.T, H, s.d}, qkv.options());
  float* kv = kv_layer.data_ptr<float>();
  rope_and_store(qkv.data_ptr<float>(), cos.data_ptr<float>(), sin.data_ptr<float>(), slot, kv,
                 qr.data_ptr<float>(), s);
  at::Tensor out = at::empty({s.T, H * s.d}, qkv.options());
  const int64_t group = H / Hkv, stride = (max_pos + 1 + 7) / 8 * 8;
  const float* K = kv;
  const float* V = kv + Hkv * s.slots * s.d;
  const float* qp = qr.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, s.T * Hkv, 1, [&](int64_t w0, int64_t w1) {
    std::vector<float> scores(group * stride);
    std::vector<int64_t> off(max_pos + 1);
    int64_t have = -1;  // NOTE: the row whose key offsets are in `off`
    for (int64_t w = w0; w < w1; ++w) {
      const int64_t t = w / Hkv, g = w % Hkv;
      if (have != t) key_offsets(tab + seq[t] * s.maxb, pos[t] + 1, s, off.data());
      have = t;
      fn(qp + (t * H + g * group) * s.d, K + g * s.slots * s.d, V + g * s.slots * s.d,
         off.data(), pos[t] + 1, group, scores.data(), op + (t * H + g * group) * s.d);
    }
  });
  return out;
}

inline float sum_squares(const float* x, int64_t n) {
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    acc = _mm256_fmadd_ps(v, v, acc);
  }
  float ss = hsum8(acc);
  for (; i < n; ++i) ss += x[i] * x[i];
  return ss;
}

inline void norm_row(const float* x, const float* w, float eps, float* y, int64_t n) {
  const float inv = 1.0f / std::sqrt(sum_squares(x, n) / static_cast<float>(n) + eps);
  for (int64_t i = 0; i < n; ++i) y[i] = (x[i] * inv) * w[i];
}

void check_rows(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "x must be a contiguous float32 [T, D] tensor");
  TORCH_CHECK(w.dim() == 1 && w.scalar_type() == at::kFloat && w.is_contiguous() &&
              w.size(0) == x.size(1), "weight must be float32 [D]");
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  check_rows(x, w);
  const int64_t T = x.size(0), D = x.size(1);
  at::Tensor y = at::empty_like(x);
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, T, 16, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      norm_row(xp + t * D, wp, static_cast<float>(eps), yp + t * D, D);
  });
  return y;
}

// x += r (in place), returns rms_norm(x): the residual add and the next norm in one pass.
at::Tensor add_rms_norm(at::Tensor& x, const at::Tensor& r, const at::Tensor& w, double eps) {
  check_rows(x, w);
  TORCH_CHECK(r.sizes() == x.sizes() && r.scalar_type() == at::kFloat && r.is_contiguous(),
              "residual must match x");
  const int64_t T = x.size(0), D = x.size(1);
  at::Tensor y = at::empty_like(x);
  float* xp = x.data_ptr<float>();
  const float* rp = r.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, T, 16, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      float* row = xp + t * D;
      for (int64_t i = 0; i < D; ++i) row[i] = row[i] + rp[t * D + i];
      norm_row(row, wp, static_cast<float>(eps), yp + t * D, D);
    }
  });
  return y;
}

at::Tensor silu_mul(const at::Tensor& gu) {
  TORCH_CHECK(gu.dim() == 2 && gu.scalar_type() == at::kFloat && gu.is_contiguous() &&
              gu.size(1) % 16 == 0, "gate_up must be contiguous float32 [T, 2I], I % 8 == 0");
  const int64_t T = gu.size(0), I = gu.size(1) / 2;
  at::Tensor y = at::empty({T, I}, gu.options());
  const float* gp = gu.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, T, 16, [&](int64_t t0, int64_t t1) {
    const __m256 one = _mm256_set1_ps(1.0f);
    for (int64_t t = t0; t < t1; ++t) {
      const float* g = gp + t * 2 * I;
      for (int64_t i = 0; i < I; i += 8) {
        const __m256 gv = _mm256_loadu_ps(g + i);
        const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), gv));
        const __m256 s = _mm256_div_ps(gv, _mm256_add_ps(one, e));
        _mm256_storeu_ps(yp + t * I + i, _mm256_mul_ps(s, _mm256_loadu_ps(g + I + i)));
      }
    }
  });
  return y;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, mod) {
  // NOTE: the GIL is released while a kernel runs, so the server's event loop keeps serving
  // (streams, new requests) during the engine thread's forward step.
  const auto nogil = pybind11::call_guard<pybind11::gil_scoped_release>();
  mod.def("attend", &attend, "RoPE + cache write + row-by-row paged attention (T4)", nogil);
  mod.def("rms_norm", &rms_norm, "row-wise RMSNorm, one fixed reduction order", nogil);
  mod.def("add_rms_norm", &add_rms_norm, "x += r in place; returns rms_norm(x)", nogil);
  mod.def("silu_mul", &silu_mul, "silu(gate) * up of [T, 2I] rows", nogil);
}
