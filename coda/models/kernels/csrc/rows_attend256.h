// AVX2 pass 2 of rows.h's attend (issue 21: what a verification row costs), the counterpart of
// rows_attend512.h: the same arithmetic per (row, query head) "lane" as rows::attend_one, so the
// same bits (T4; tests/test_kernel_isa.py), for up to 16 lanes at once (rows_items.h forms the
// items: the query heads of one KV head over consecutive rows of one sequence). Per item
//   * each key vector is read from L2 once (then from L1 for each group of 4 lanes), and the
//     values in blocks of kBlock keys that stay in L1 while every lane takes them;
//   * the scores of one key for 8 lanes come out of one transposed tree (tree8_lanes: isa.h's
//     tree16 pairing lane by lane, 8 lanes per 256-bit vector, two halves for 16 lanes);
//   * each lane's running max and denominator are one lane of a vector: the strictly ordered
//     chains of 8 lanes run side by side;
//   * a lane's weighted values are its own 8-wide fmas, keys in order, as in attend_one.
// Lanes whose rows see different keys are masked per key: a lane's operations are exactly its
// own keys', in order.
#pragma once

#if CODA_ISA == CODA_AVX2

namespace rows256 {

constexpr int kLanes = lane_item::kLanes;
constexpr int64_t kBlock = 64;  // NOTE: keys a values block keeps in L1 (16 KB at 64 floats)

using lane_item::Item;

// x[c] = lane c's 16-lane accumulator (dot_qk's fma chains, increasing j) with its two halves
// added (tree16's first step, lane i + lane i + 8), for C <= 4 lanes (queries d floats apart);
// x[C..3] = 0.
template <int D16, int C>
inline void dots(const float* q, const float* k, __m256* x) {
  constexpr int64_t d = 16 * D16;
  __m256 lo[C > 0 ? C : 1], hi[C > 0 ? C : 1];
  for (int c = 0; c < C; ++c) lo[c] = hi[c] = _mm256_setzero_ps();
  for (int j = 0; j < D16; ++j) {
    const __m256 k0 = _mm256_loadu_ps(k + 16 * j), k1 = _mm256_loadu_ps(k + 16 * j + 8);
    for (int c = 0; c < C; ++c) {
      lo[c] = _mm256_fmadd_ps(_mm256_loadu_ps(q + c * d + 16 * j), k0, lo[c]);
      hi[c] = _mm256_fmadd_ps(_mm256_loadu_ps(q + c * d + 16 * j + 8), k1, hi[c]);
    }
  }
  for (int c = 0; c < 4; ++c) x[c] = c < C ? _mm256_add_ps(lo[c], hi[c]) : _mm256_setzero_ps();
}

template <int D16>
inline void dots_n(int n, const float* q, const float* k, __m256* x) {
  switch (n) {
    case 4: return dots<D16, 4>(q, k, x);
    case 3: return dots<D16, 3>(q, k, x);
    case 2: return dots<D16, 2>(q, k, x);
    case 1: return dots<D16, 1>(q, k, x);
    default: return dots<D16, 0>(q, k, x);
  }
}

// Four lanes' x (above) -> [z0_0, z0_1, z2_0, z2_1 | z1_0, z1_1, z3_0, z3_1]: hsum8's first two
// steps lane by lane, y_i = x_i + x_{i+4}, then z_0 = y_0 + y_2, z_1 = y_1 + y_3, each with the
// lower element as the first operand (the same bits, -0.0 and NaN payloads included).
inline __m256 tree_z(const __m256* x) {
  const __m256 y01 = _mm256_add_ps(_mm256_permute2f128_ps(x[0], x[1], 0x20),
                                   _mm256_permute2f128_ps(x[0], x[1], 0x31));
  const __m256 y23 = _mm256_add_ps(_mm256_permute2f128_ps(x[2], x[3], 0x20),
                                   _mm256_permute2f128_ps(x[2], x[3], 0x31));
  return _mm256_add_ps(_mm256_shuffle_ps(y01, y23, _MM_SHUFFLE(1, 0, 1, 0)),
                       _mm256_shuffle_ps(y01, y23, _MM_SHUFFLE(3, 2, 3, 2)));
}

// Lanes 0..3 (za) and 4..7 (zb) -> lane l holds z_l0 + z_l1 = tree16 of lane l's accumulator.
inline __m256 tree_w(__m256 za, __m256 zb) {
  const __m256 w = _mm256_add_ps(_mm256_shuffle_ps(za, zb, _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm256_shuffle_ps(za, zb, _MM_SHUFFLE(3, 1, 3, 1)));
  // NOTE: w is [w0, w2, w4, w6 | w1, w3, w5, w7]: back to lane order
  return _mm256_permutevar8x32_ps(w, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

// Pass A: every lane's score of every key (sc row i - i0, lanes 0..15), and each lane's max over
// its own keys in order: its first key's score, then max1(s, m) key after key (attend_one).
// m[h] holds lanes 8h..8h+7.
template <int D16>
inline void scores(const Item& it, __m256* m) {
  constexpr int64_t d = 16 * D16;
  const int halves = it.L > 8 ? 2 : 1;
  int n[4];  // NOTE: lanes in each group of 4
  for (int c = 0; c < 4; ++c) n[c] = it.L - 4 * c < 0 ? 0 : it.L - 4 * c > 4 ? 4 : it.L - 4 * c;
  m[0] = m[1] = _mm256_setzero_ps();
  for (int64_t i = it.i0; i < it.i1; ++i) {
    const float* k = it.K + it.off[i - it.i0];
    const __m256i iv = _mm256_set1_epi32(static_cast<int32_t>(i));
    for (int h = 0; h < halves; ++h) {
      __m256 x[4];
      dots_n<D16>(n[2 * h], it.qb + 8 * h * d, k, x);
      const __m256 za = tree_z(x);
      __m256 zb = za;
      if (n[2 * h + 1] > 0) {
        dots_n<D16>(n[2 * h + 1], it.qb + (8 * h + 4) * d, k, x);
        zb = tree_z(x);
      }
      const __m256 s = tree_w(za, zb);
      _mm256_storeu_ps(it.sc + (i - it.i0) * kLanes + 8 * h, s);
      const __m256i lov = _mm256_load_si256(reinterpret_cast<const __m256i*>(it.lo + 8 * h));
      const __m256i hiv = _mm256_load_si256(reinterpret_cast<const __m256i*>(it.hi + 8 * h));
      const __m256 first = _mm256_castsi256_ps(_mm256_cmpeq_epi32(lov, iv));
      const __m256 rest = _mm256_castsi256_ps(
          _mm256_andnot_si256(_mm256_cmpgt_epi32(iv, hiv), _mm256_cmpgt_epi32(iv, lov)));
      m[h] = _mm256_blendv_ps(m[h], s, first);
      m[h] = _mm256_blendv_ps(m[h], _mm256_max_ps(s, m[h]), rest);  // NOTE: max1(s, m)
    }
  }
}

// Pass B: e = exp(s - m) in place (isa.h's exp8), and each lane's denominator: +0 plus its own
// keys' e, left to right.
inline void softmax(const Item& it, const __m256* m, float* den) {
  const int halves = it.L > 8 ? 2 : 1;
  for (int h = 0; h < halves; ++h) {
    const __m256i lov = _mm256_load_si256(reinterpret_cast<const __m256i*>(it.lo + 8 * h));
    const __m256i hiv = _mm256_load_si256(reinterpret_cast<const __m256i*>(it.hi + 8 * h));
    __m256 acc = _mm256_setzero_ps();
    for (int64_t i = it.i0; i < it.i1; ++i) {
      float* s = it.sc + (i - it.i0) * kLanes + 8 * h;
      const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s), m[h]));
      _mm256_storeu_ps(s, e);
      const __m256i iv = _mm256_set1_epi32(static_cast<int32_t>(i));
      const __m256 out = _mm256_castsi256_ps(
          _mm256_or_si256(_mm256_cmpgt_epi32(lov, iv), _mm256_cmpgt_epi32(iv, hiv)));
      acc = _mm256_blendv_ps(_mm256_add_ps(acc, e), acc, out);
    }
    _mm256_storeu_ps(den + 8 * h, acc);
  }
}

// Pass C, columns c0..c0 + 8 NC - 1 of every lane: acc (one row of NC vectors a lane, from +0)
// takes fma(e_i, v_i) over the lane's keys in order, a block of kBlock keys at a time.
template <int NC>
inline void values_cols(const Item& it, int64_t c0, const float* den, float* acc) {
  for (int l = 0; l < it.L; ++l)
    for (int j = 0; j < NC; ++j) _mm256_storeu_ps(acc + (l * NC + j) * 8, _mm256_setzero_ps());
  for (int64_t b0 = it.i0; b0 < it.i1; b0 += kBlock) {
    const int64_t b1 = b0 + kBlock < it.i1 ? b0 + kBlock : it.i1;
    for (int l = 0; l < it.L; ++l) {
      const int64_t a = it.lo[l] > b0 ? it.lo[l] : b0;
      const int64_t z = it.hi[l] + 1 < b1 ? it.hi[l] + 1 : b1;
      if (a >= z) continue;
      __m256 r[NC];
      for (int j = 0; j < NC; ++j) r[j] = _mm256_loadu_ps(acc + (l * NC + j) * 8);
      for (int64_t i = a; i < z; ++i) {
        const float* v = it.V + it.off[i - it.i0] + c0;
        const __m256 e = _mm256_set1_ps(it.sc[(i - it.i0) * kLanes + l]);
        for (int j = 0; j < NC; ++j) r[j] = _mm256_fmadd_ps(e, _mm256_loadu_ps(v + 8 * j), r[j]);
      }
      for (int j = 0; j < NC; ++j) _mm256_storeu_ps(acc + (l * NC + j) * 8, r[j]);
    }
  }
  for (int l = 0; l < it.L; ++l) {
    const __m256 dv = _mm256_set1_ps(den[l]);
    for (int j = 0; j < NC; ++j)
      _mm256_storeu_ps(it.out[l] + c0 + 8 * j,
                       _mm256_div_ps(_mm256_loadu_ps(acc + (l * NC + j) * 8), dv));
  }
}

template <int D16>
void run(const Item& it) {
  constexpr int64_t D8 = 2 * D16;
  __m256 m[2];
  scores<D16>(it, m);
  alignas(32) float den[kLanes];
  softmax(it, m, den);
  alignas(32) float acc[kLanes * 64];
  int64_t c = 0;
  for (; c + 8 <= D8; c += 8) values_cols<8>(it, c * 8, den, acc);
  if (c < D8) values_cols<4>(it, c * 8, den, acc);  // NOTE: D8 is a multiple of 4
}

using RunFn = void (*)(const Item&);

inline RunFn run_for(int64_t d) {
  switch (d) {
    case 32: return run<2>;
    case 64: return run<4>;
    case 96: return run<6>;
    case 128: return run<8>;
    case 256: return run<16>;
    default: return nullptr;
  }
}

}  // namespace rows256

#endif
