// One item of rows_items.h's lane attention, the one layout both SIMD lane kernels read
// (rows_attend512.h, rows_attend256.h). Included by rows_items.h inside namespace CODA_NS.
#pragma once

namespace lane_item {

constexpr int kLanes = 16;

// One item's lanes (at most 16, the first L real; qb: their scaled queries [16][d], lanes past L
// zero), keys i0..i1-1 (key i at K / V + off[i - i0]); lane l sees keys lo[l]..hi[l].
struct Item {
  const float* qb;
  const float* K;
  const float* V;
  const int64_t* off;
  int64_t i0, i1;
  alignas(64) int32_t lo[kLanes];
  alignas(64) int32_t hi[kLanes];
  int L;
  float* sc;  // [(i1 - i0) * 16]: scores, then exp(score - max)
  float* out[kLanes];
};

}  // namespace lane_item
