// The SIMD builds' pass 2 of rows.h's attend (issue 21): a call's rows cut into items of lanes,
// each run by the build's lane kernel, rows_attend512.h (AVX-512) or rows_attend256.h (AVX2);
// both do each lane's operations exactly as rows::attend_one does, so the scalar build's bits.
// Included by rows.h inside namespace CODA_NS, after namespace rows.
#pragma once

#include "rows_lane_item.h"
#include "rows_attend256.h"
#include "rows_attend512.h"

#if CODA_ISA != CODA_SCALAR
#if CODA_ISA == CODA_AVX512
namespace lanes = rows512;
#else
namespace lanes = rows256;
#endif

// Pass 2 by the lane kernel: items of up to 16 (row, query head) lanes, the query
// heads of one KV head over consecutive rows of one sequence (rows of the call with the same
// sequence index, in the call's order), rows split near-equally (a 9-row verification at 3 query
// heads per KV head: 5 + 4 rows). Each lane's operations are rows::attend_one's (same bits).
inline void attend_items(const AttendCall& a) {
  const int64_t group = a.H / a.Hkv, per = lanes::kLanes / group, d = a.d;
  // NOTE: item j = rows first[j] .. first[j + 1] - 1; at most T items
  int64_t* first = static_cast<int64_t*>(std::malloc(sizeof(int64_t) * (a.T + 1)));
  int64_t n_items = 0;
  for (int64_t t = 0; t < a.T;) {
    int64_t e = t + 1;
    while (e < a.T && a.seq[e] == a.seq[t]) ++e;
    const int64_t parts = (e - t + per - 1) / per;
    for (int64_t c = 0, r = t; c < parts; ++c) {
      first[n_items++] = r;
      r += (e - r) / (parts - c);
    }
    t = e;
  }
  first[n_items] = a.T;
  const lanes::RunFn fn = lanes::run_for(d);
  const float* K = a.kv;
  const float* V = a.kv + a.Hkv * a.slots * d;
  pool::parallel_for(n_items * a.Hkv, 1, [&](int64_t w0, int64_t w1) {
    const int64_t keys = a.max_pos + 1;
    float* sc = static_cast<float*>(std::aligned_alloc(64, sizeof(float) * lanes::kLanes * keys));
    float* qb = static_cast<float*>(std::aligned_alloc(64, sizeof(float) * lanes::kLanes * d));
    int64_t* off = static_cast<int64_t*>(std::malloc(sizeof(int64_t) * keys));
    int64_t have = -1;  // NOTE: the item whose key offsets are in `off`
    lanes::Item it;
    for (int64_t w = w0; w < w1; ++w) {
      const int64_t j = w / a.Hkv, g = w % a.Hkv, t0 = first[j], rows_n = first[j + 1] - t0;
      it.L = static_cast<int>(rows_n * group);
      int64_t i0 = a.pos[t0], i1 = 0;
      for (int l = 0; l < lanes::kLanes; ++l) {
        if (l >= it.L) {  // NOTE: no key: never in a max, a sum or a weighted value
          it.lo[l] = INT32_MAX;
          it.hi[l] = -1;
          for (int64_t e = 0; e < d; ++e) qb[l * d + e] = 0.0f;
          continue;
        }
        const int64_t t = t0 + l / group, h = g * group + l % group;
        const int64_t lo = rows::first_key(a.pos[t], a.window);
        it.lo[l] = static_cast<int32_t>(lo);
        it.hi[l] = static_cast<int32_t>(a.pos[t]);
        i0 = lo < i0 ? lo : i0;
        i1 = a.pos[t] + 1 > i1 ? a.pos[t] + 1 : i1;
        const float* q = a.qr + (t * a.H + h) * d;
        for (int64_t e = 0; e < d; ++e) qb[l * d + e] = q[e];
        it.out[l] = a.out + (t * a.H + h) * d;
      }
      if (have != j) rows::key_offsets(a.tables + a.seq[t0] * a.maxb, i0, i1, a.bs, d, off);
      have = j;
      it.qb = qb;
      it.K = K + g * a.slots * d;
      it.V = V + g * a.slots * d;
      it.off = off;
      it.i0 = i0;
      it.i1 = i1;
      it.sc = sc;
      fn(it);
    }
    std::free(off);
    std::free(qb);
    std::free(sc);
  });
  std::free(first);
}
#endif
