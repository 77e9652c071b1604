// AVX-512 pass 2 of rows.h's attend (issue 21: what a verification row costs): the same
// arithmetic per (row, query head) as rows::attend_one, so the same bits (T4; every build gives
// the scalar build's bits, tests/test_kernel_isa.py), run for up to 16 such "lanes" at once.
//
// An item is up to 16 lanes: the query heads of one KV head for a few consecutive rows of one
// sequence (a verification's 1 + k rows, a prefill chunk's rows; a decode row alone), so
//   * each key and value vector is loaded once per item, not once per (row, query head);
//   * the scores of one key for all the lanes come out of one transposed tree (tree16_lanes:
//     isa.h's tree16 pairing, lane by lane, ~3 vector ops a score instead of ~9);
//   * each lane's running max and its denominator are one lane of a vector, so their strictly
//     ordered chains (max1 key after key, the sum left to right) run side by side instead of
//     one after another at the adder's latency;
//   * the weighted values take 16-lane fmas (the same fma per element as rows.h's 8-lane ones).
// Lanes whose rows see different keys (a verification's later rows one key more each, a
// sliding window) are masked per key: a lane's operations are exactly its own keys', in order.
#pragma once

#if CODA_ISA == CODA_AVX512

namespace rows512 {

constexpr int kLanes = lane_item::kLanes;

// isa.h's exp8 over 16 lanes: the same operations per element, so the same bits.
inline __m512 exp16(__m512 x) {
  const __m512 lo = _mm512_set1_ps(-87.33654475f);
  const __mmask16 under = _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ);
  x = _mm512_max_ps(x, lo);
  x = _mm512_min_ps(x, _mm512_set1_ps(88.3762626647949f));
  const __m512 fx = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                         _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_sub_ps(x, _mm512_mul_ps(fx, _mm512_set1_ps(0.693359375f)));
  r = _mm512_sub_ps(r, _mm512_mul_ps(fx, _mm512_set1_ps(-2.12194440e-4f)));
  __m512 y = _mm512_set1_ps(1.9875691500e-4f);
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.3981999507e-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(8.3334519073e-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(4.1665795894e-2f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.6666665459e-1f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(5.0000001201e-1f));
  y = _mm512_fmadd_ps(y, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  const __m512i e = _mm512_slli_epi32(
      _mm512_add_epi32(_mm512_cvtps_epi32(fx), _mm512_set1_epi32(127)), 23);
  y = _mm512_mul_ps(y, _mm512_castsi512_ps(e));
  return _mm512_maskz_mov_ps(static_cast<__mmask16>(~under), y);  // NOTE: exp8's andnot
}

// Lane k (< NL = 4, 8 or 16) of the result is isa.h's tree16(v[k]): x_i = v_i + v_{i+8}, then
// x_i + x_{i+4}, then y_0 + y_2 and y_1 + y_3, then z_0 + z_1, each with the lower lane as the
// first operand (the same bits, -0.0 and NaN payloads included); four, two, one per 128 bits.
template <int NL>
inline __m512 tree16_lanes(const __m512* v) {
  constexpr int NX = NL / 2, NY = NL / 4, NZ = NY > 1 ? NY / 2 : 1;
  __m512 x[NX], y[NY], z[NZ];
  for (int p = 0; p < NX; ++p)  // NOTE: [x(v 2p) | x(v 2p + 1)]
    x[p] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * p], v[2 * p + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_f32x4(v[2 * p], v[2 * p + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  for (int p = 0; p < NY; ++p)  // NOTE: 128-bit quarter q holds y(v 4p + q)
    y[p] = _mm512_add_ps(_mm512_shuffle_f32x4(x[2 * p], x[2 * p + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(x[2 * p], x[2 * p + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  for (int p = 0; p < NZ; ++p) {  // NOTE: quarter q: z(y[2p] q), z(y[2p + 1] q) (or itself)
    const __m512 a = y[2 * p], b = y[NY > 1 ? 2 * p + 1 : 0];
    z[p] = _mm512_add_ps(_mm512_shuffle_ps(a, b, _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(a, b, _MM_SHUFFLE(3, 2, 3, 2)));
  }
  const __m512 a = z[0], b = z[NZ - 1];
  const __m512 w = _mm512_add_ps(_mm512_shuffle_ps(a, b, _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm512_shuffle_ps(a, b, _MM_SHUFFLE(3, 1, 3, 1)));
  // NOTE: w's lane 4 q + j holds tree16(v[4 j + q]) (j < NL / 4): back to lane order
  return _mm512_permutexvar_ps(
      _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), w);
}

using lane_item::Item;

// Pass A: every lane's score of every key (row i - i0 of sc), and each lane's max over its own
// keys in order: m = its first key's score, then max1(s, m) key after key (rows::attend_one).
template <int D16, int NL>
inline __m512 scores(const Item& it) {
  constexpr int64_t d = 16 * D16;
  const __m512i lov = _mm512_load_si512(it.lo), hiv = _mm512_load_si512(it.hi);
  __m512 m = _mm512_setzero_ps();
  for (int64_t i = it.i0; i < it.i1; ++i) {
    const float* k = it.K + it.off[i - it.i0];
    __m512 acc[NL];
    for (int l = 0; l < NL; ++l) acc[l] = _mm512_setzero_ps();
    for (int j = 0; j < D16; ++j) {  // NOTE: each lane's fma chain in increasing j (dot_qk)
      const __m512 kj = _mm512_loadu_ps(k + 16 * j);
      for (int l = 0; l < NL; ++l)
        acc[l] = _mm512_fmadd_ps(_mm512_loadu_ps(it.qb + l * d + 16 * j), kj, acc[l]);
    }
    const __m512 s = tree16_lanes<NL>(acc);
    _mm512_storeu_ps(it.sc + (i - it.i0) * kLanes, s);
    const __m512i iv = _mm512_set1_epi32(static_cast<int32_t>(i));
    const __mmask16 first = _mm512_cmpeq_epi32_mask(lov, iv);
    const __mmask16 rest = _mm512_cmplt_epi32_mask(lov, iv) & _mm512_cmple_epi32_mask(iv, hiv);
    m = _mm512_mask_mov_ps(m, first, s);
    m = _mm512_mask_max_ps(m, rest, s, m);  // NOTE: maxps(s, m) = max1(s, m)
  }
  return m;
}

// Pass B: e = exp(s - m) in place, and each lane's denominator: +0 plus its own keys' e, left
// to right. Returns the denominators.
inline __m512 softmax(const Item& it, __m512 m) {
  const __m512i lov = _mm512_load_si512(it.lo), hiv = _mm512_load_si512(it.hi);
  __m512 den = _mm512_setzero_ps();
  for (int64_t i = it.i0; i < it.i1; ++i) {
    float* s = it.sc + (i - it.i0) * kLanes;
    const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(s), m));
    _mm512_storeu_ps(s, e);
    const __m512i iv = _mm512_set1_epi32(static_cast<int32_t>(i));
    const __mmask16 act = _mm512_cmple_epi32_mask(lov, iv) & _mm512_cmple_epi32_mask(iv, hiv);
    den = _mm512_mask_add_ps(den, act, den, e);
  }
  return den;
}

// Pass C for lanes l0..l0+G-1: out = (sum over each lane's keys, left to right, of fma(e, v))
// / denominator. Keys all G lanes see run unchecked; the rest lane by lane.
template <int D16, int G>
void values(const Item& it, int l0, const float* den) {
  __m512 acc[G][D16];
  for (int l = 0; l < G; ++l)
    for (int j = 0; j < D16; ++j) acc[l][j] = _mm512_setzero_ps();
  int64_t a = it.lo[l0], b = it.hi[l0], first = a, last = b;
  for (int l = 1; l < G; ++l) {
    a = it.lo[l0 + l] > a ? it.lo[l0 + l] : a;
    b = it.hi[l0 + l] < b ? it.hi[l0 + l] : b;
    first = it.lo[l0 + l] < first ? it.lo[l0 + l] : first;
    last = it.hi[l0 + l] > last ? it.hi[l0 + l] : last;
  }
  const auto key = [&](int64_t i, bool all) {
    const float* v = it.V + it.off[i - it.i0];
    const float* e = it.sc + (i - it.i0) * kLanes + l0;
    __m512 vj[D16];
    for (int j = 0; j < D16; ++j) vj[j] = _mm512_loadu_ps(v + 16 * j);
    for (int l = 0; l < G; ++l) {
      if (!all && (i < it.lo[l0 + l] || i > it.hi[l0 + l])) continue;
      const __m512 el = _mm512_set1_ps(e[l]);
      for (int j = 0; j < D16; ++j) acc[l][j] = _mm512_fmadd_ps(el, vj[j], acc[l][j]);
    }
  };
  int64_t i = first;
  for (; i < a; ++i) key(i, false);
  for (; i <= b; ++i) key(i, true);
  for (; i <= last; ++i) key(i, false);
  for (int l = 0; l < G; ++l) {
    const __m512 dv = _mm512_set1_ps(den[l0 + l]);
    for (int j = 0; j < D16; ++j)
      _mm512_storeu_ps(it.out[l0 + l] + 16 * j, _mm512_div_ps(acc[l][j], dv));
  }
}

// NOTE: G lanes' D16 accumulators plus D16 value vectors within the 32 zmm
template <int D16>
constexpr int kGroup = D16 <= 2 ? 8 : 24 / D16 > 1 ? 24 / D16 : 1;

template <int D16, int G = kGroup<D16>>
inline void values_of(const Item& it, int l0, int g, const float* den) {
  if constexpr (G > 1) {
    if (g < G) return values_of<D16, G - 1>(it, l0, g, den);
  }
  values<D16, G>(it, l0, den);
}

template <int D16, int NL>
void run(const Item& it) {
  alignas(64) float den[kLanes];
  _mm512_store_ps(den, softmax(it, scores<D16, NL>(it)));
  const int groups = (it.L + kGroup<D16> - 1) / kGroup<D16>;
  for (int c = 0, l = 0; c < groups; ++c) {
    const int g = (it.L - l) / (groups - c);  // NOTE: near-equal groups
    values_of<D16>(it, l, g, den);
    l += g;
  }
}

template <int D16>
inline void run_lanes(const Item& it) {
  if (it.L <= 4) return run<D16, 4>(it);
  if (it.L <= 8) return run<D16, 8>(it);
  run<D16, 16>(it);
}

using RunFn = void (*)(const Item&);

inline RunFn run_for(int64_t d) {
  switch (d) {
    case 32: return run_lanes<2>;
    case 64: return run_lanes<4>;
    case 96: return run_lanes<6>;
    case 128: return run_lanes<8>;
    case 256: return run_lanes<16>;
    default: return nullptr;
  }
}

}  // namespace rows512

#endif
