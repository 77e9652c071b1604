// The interface between the dispatcher (module.cpp) and the per-ISA builds (isa_*.cpp): plain
// argument structs (pointers into memory Python owns, shapes) and one table of entry points per
// ISA. Arguments are validated by module.cpp before any entry point runs. To add a kernel: a field
// here, its implementation in a kernel header (written over isa.h), one line in kernels_def.h, its
// binding in module.cpp.
#pragma once

#include <cstdint>

namespace coda_native {

constexpr int64_t TILE = 8;   // output rows per tile of a re-laid-out block matrix
constexpr int64_t QK = 32;    // weights per block
constexpr int64_t XQB = 64;   // bytes per block of a q8 activation row (see blocks.h)

enum Kind { Q4_0 = 0, Q4_1 = 1, Q8_0 = 2 };

// y[M, N] = x[M, K] @ W.T, W re-laid-out by ggml_linear.repack (scales sc, quants qs). q8: the
// activations are quantised first into xq [M, K/32, XQB], dx and sx [M, K/32] (scratch).
struct LinearCall {
  const float* x;
  int64_t M, K, N;
  const uint16_t* sc;
  const uint8_t* qs;
  int kind;
  bool q8;
  float* y;
  int8_t* xq;
  float* dx;
  float* sx;
};

// RoPE + cache write + row-by-row paged attention (rows.h); qr [T, H, d] is scratch.
struct AttendCall {
  const float* qkv;   // [T, (H + 2 Hkv) d]
  const float* cos;   // [T, rot]
  const float* sin;   // [T, rot], signed
  float* kv;          // [2, Hkv, blocks, bs, d]
  const int64_t* slot;
  const int64_t* seq;
  const int64_t* pos;
  const int64_t* tables;  // [B, maxb]
  int64_t T, H, Hkv, d, slots, maxb, bs, max_pos;
  float* qr;
  float* out;  // [T, H d]
  int64_t rot;        // rotated dims per head (d: full RoPE; fewer: partial rotary), even
  int64_t window;     // keys a row sees, its own included (0: all; Gemma 3's local layers)
  float scale;        // query scale (0: 1 / sqrt(d))
  const float* qn;    // per-head RMSNorm weight [d] of q before RoPE, or null (Qwen3, Gemma 3)
  const float* kn;    // the same for k, or null
  float eps;          // their epsilon
};

// GGUF tensors read in place by the kquant kernels (kquants.h, kquant_kernels.h; issue 18).
namespace ggml {

// NOTE: ggml's GGMLQuantizationType numbers, so Python passes them unchanged.
enum Type : int32_t {
  F32 = 0, F16 = 1, Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8,
  Q2_K = 10, Q3_K = 11, Q4_K = 12, Q5_K = 13, Q6_K = 14, BF16 = 30,
};

// Weights per block; 0 for a type the kernels do not read.
inline int64_t block_size(int32_t t) {
  switch (t) {
    case F32: case F16: case BF16: return 1;
    case Q4_0: case Q4_1: case Q5_0: case Q5_1: case Q8_0: return 32;
    case Q2_K: case Q3_K: case Q4_K: case Q5_K: case Q6_K: return 256;
    default: return 0;
  }
}

// Bytes per block; 0 for a type the kernels do not read.
inline int64_t block_bytes(int32_t t) {
  switch (t) {
    case F32: return 4;
    case F16: case BF16: return 2;
    case Q4_0: return 18;
    case Q4_1: return 20;
    case Q5_0: return 22;
    case Q5_1: return 24;
    case Q8_0: return 34;
    case Q2_K: return 84;
    case Q3_K: return 110;
    case Q4_K: return 144;
    case Q5_K: return 176;
    case Q6_K: return 210;
    default: return 0;
  }
}

}  // namespace ggml

// One weight tensor as the file stores it: rows of row_bytes bytes from base; output i of the
// segment reads file row row_map[i] (llama.cpp's q/k order) or row i; bias (float32) or null.
struct KqSeg {
  const uint8_t* base;
  int64_t rows;
  int64_t row_bytes;
  int32_t type;
  const int32_t* row_map;
  const float* bias;
  // The bytes of the segment's row i (its file row through row_map, if any).
  const uint8_t* row(int64_t i) const { return base + (row_map ? row_map[i] : i) * row_bytes; }
};

// y[M, N] = x[M, K] @ W.T (+ bias), W the row concatenation of segs (N = sum of their rows).
struct KqCall {
  const float* x;
  int64_t M, K;
  const KqSeg* segs;
  int nseg;
  int64_t N;
  float* y;
};

// The segment holding output n, walking forward from (seg, first), the segment's first output:
// a range's outputs only increase (for_groups and rows_ahead below walk with it).
inline void locate(const KqCall& c, int64_t n, int& seg, int64_t& first) {
  while (n >= first + c.segs[seg].rows) first += c.segs[seg++].rows;
}

// One group of a range walk: outputs [n, n + g), all of segment q (index s, first output
// first), i.e. the segment's rows i0 .. i0 + g - 1.
struct KqGroup {
  const KqSeg& q;
  int s;
  int64_t first, n, i0;
  int g;
  // row[j] = the bytes of the group's output j, for j < g
  void rows(const uint8_t** row) const {
    for (int j = 0; j < g; ++j) row[j] = q.row(i0 + j);
  }
};

// The range walk every segmented kernel shares: fn(group) for outputs [n0, n1) in order, each
// group the next min(width(segment), what is left of the range and of the segment) outputs (a
// group never spans two segments: one type, one bias, one row size).
template <class Width, class Fn>
inline void for_groups(const KqCall& c, int64_t n0, int64_t n1, Width width, Fn fn) {
  int s = 0;
  int64_t first = 0;
  for (int64_t n = n0; n < n1;) {
    locate(c, n, s, first);
    const KqSeg& q = c.segs[s];
    const int64_t i0 = n - first;
    int64_t g = static_cast<int64_t>(width(q));
    if (n1 - n < g) g = n1 - n;
    if (q.rows - i0 < g) g = q.rows - i0;
    fn(KqGroup{q, s, first, n, i0, static_cast<int>(g)});
    n += g;
  }
}

// For prefetching a later group: next[j] = the bytes of output m + j for j < count while
// m + j < n1 and its segment's rows are as long as at's (so the caller's block offsets stay
// inside the row); the entries after the first miss are left as they are.
inline void rows_ahead(const KqCall& c, const KqGroup& at, int64_t m, int count, int64_t n1,
                       const uint8_t** next) {
  int t = at.s;
  int64_t f = at.first;
  for (int j = 0; j < count && m + j < n1; ++j) {
    locate(c, m + j, t, f);
    const KqSeg& u = c.segs[t];
    if (u.row_bytes != at.q.row_bytes) break;
    next[j] = u.row(m + j - f);
  }
}

struct Kernels {
  const char* name;
  void (*linear)(const LinearCall&);
  // one row per x row, written in the XQB layout (blocks.h), with dx and sx per block
  void (*quantize_rows)(const float* x, int64_t M, int64_t K, int8_t* xq, float* dx, float* sx);
  void (*attend)(const AttendCall&);
  void (*rms_norm)(const float* x, const float* w, float eps, float* y, int64_t T, int64_t D);
  void (*add_rms_norm)(float* x, const float* r, const float* w, float eps, float* y, int64_t T,
                       int64_t D);
  void (*silu_mul)(const float* gu, float* y, int64_t T, int64_t I);
  void (*gelu_tanh_mul)(const float* gu, float* y, int64_t T, int64_t I);
  void (*kq_linear)(const KqCall&);
  void (*kq_linear_q8)(const KqCall&);  // K-quant segments only (checked by api.cpp)
  // rows ids[0..T) of one segment decoded to out [T, K] (ids checked by api.cpp)
  void (*kq_gather)(const KqSeg& seg, int64_t K, const int64_t* ids, int64_t T, float* out);
};

const Kernels& kernels_scalar();
#if defined(__x86_64__)
const Kernels& kernels_avx2();
const Kernels& kernels_avx512();
#endif

}  // namespace coda_native
