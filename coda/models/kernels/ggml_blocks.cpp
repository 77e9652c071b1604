// Batch-invariant linear layers on GGUF block weights (Q4_0, Q4_1, Q8_0), AVX2 + FMA (issue 10).
//
// Weights arrive re-laid-out by ggml_linear.py, as many bytes as in the file: output rows in tiles
// of 8; per (tile, block of 32 inputs) the 8 rows' float16 scales d (then, for Q4_1 only, the 8
// float16 mins m), and the 8 rows' quants (16 bytes of nibbles for Q4; 32 int8 for Q8_0, rows
// paired by halves). ggml order: weight j of a Q4 block is the low nibble of byte j for j < 16 and
// the high nibble of byte j - 16; w = d * q + m exactly in float32, with m = -8d for Q4_0 and 0
// for Q8_0 (float16 -> float32 is exact, and so are these products).
//
// T4 by construction: every output element (row r, column n) is computed by one thread with one
// fixed sequence of instructions that reads row r of x and column n of W only; the row tiling
// (R rows at a time) and the column grouping only choose which independent accumulators run side
// by side, never the order in which one accumulator is updated. So a row's output bits do not
// depend on M, on the row's position in the batch, or on the thread count.
//
// f32 mode: each weight sub-vector of 8 is dequantised in-register (fma(q, d, m), exact) and
// accumulated lane-wise, acc = fma(w, x, acc), over the blocks in order; then one fixed
// horizontal sum.
// q8 mode: each row's activations are quantised per block of 32 (dx = amax / 127, q = rint(x / dx)
// as x * (1 / dx), ties to even; sx = dx * sum(q)), the integer dots use maddubs/madd, and per
// block acc = fma(float(isum), d * dx, acc); the min term sum_b m * sx is added at the end.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <cmath>
#include <cstdint>

namespace {

constexpr int64_t TILE = 8;   // output rows per tile
constexpr int64_t QK = 32;    // weights per block

enum Kind { Q4_0 = 0, Q4_1 = 1, Q8_0 = 2 };
template <int KIND> constexpr bool kQ8 = KIND == Q8_0;
template <int KIND> constexpr int64_t kQB = KIND == Q8_0 ? 32 : 16;   // quant bytes per row-block
template <int KIND> constexpr int64_t kSC = KIND == Q4_1 ? 16 : 8;    // float16 scales per tile-block

// The tile-block's d (and m) as float32 vectors over its 8 rows.
template <int KIND>
inline void scales8(const uint16_t* s, __m256& d, __m256& m) {
  d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s)));
  if (KIND == Q4_1) m = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + 8)));
  else if (KIND == Q4_0) m = _mm256_mul_ps(d, _mm256_set1_ps(-8.0f));
  else m = _mm256_setzero_ps();
}

inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Sub-vector V (0..3) of a block's 32 weights of one output as 8 float32: exact d * q + m.
template <bool Q8W, int V>
inline __m256 dequant8(const uint8_t* q, __m256 d, __m256 m) {
  if (Q8W) {  // NOTE: q points at the output's first 16 bytes; its last 16 are 32 bytes on
    const __m256i i = _mm256_cvtepi8_epi32(
        _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + (V / 2) * 32 + (V % 2) * 8)));
    return _mm256_mul_ps(_mm256_cvtepi32_ps(i), d);
  }
  __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 8 * (V & 1))));
  b = V < 2 ? _mm256_and_si256(b, _mm256_set1_epi32(0xF)) : _mm256_srli_epi32(b, 4);
  return _mm256_fmadd_ps(_mm256_cvtepi32_ps(b), d, m);
}

template <bool Q8W, int R, int C, int V>
inline void step_f32(const float* x, int64_t K, const float* s, const uint8_t* q, int64_t c0,
                     __m256 acc[R][C]) {
  constexpr int64_t qb = Q8W ? 32 : 16;
  for (int c = 0; c < C; ++c) {
    const int64_t c1 = c0 + c, at = Q8W ? (c1 / 2) * 64 + (c1 % 2) * 16 : c1 * qb;
    const __m256 w = dequant8<Q8W, V>(q + at, _mm256_broadcast_ss(s + c1),
                                      _mm256_broadcast_ss(s + 8 + c1));
    for (int r = 0; r < R; ++r)
      acc[r][c] = _mm256_fmadd_ps(w, _mm256_loadu_ps(x + r * K + 8 * V), acc[r][c]);
  }
}

// R rows x C outputs (columns c0..c0+C of one tile), f32 activations.
template <int KIND, int R, int C>
void micro_f32(const float* x, int64_t K, const uint16_t* sc, const uint8_t* qs, int64_t c0,
               float* y, int64_t ldy, int64_t ncols) {
  constexpr bool Q8W = kQ8<KIND>;
  const int64_t nb = K / QK, qb = kQB<KIND>;
  __m256 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm256_setzero_ps();
  alignas(32) float s[16];
  for (int64_t b = 0; b < nb; ++b) {
    __m256 d, m;
    scales8<KIND>(sc + b * kSC<KIND>, d, m);
    _mm256_store_ps(s, d);
    _mm256_store_ps(s + 8, m);
    const uint8_t* q = qs + b * TILE * qb;
    const float* xb = x + b * QK;
    step_f32<Q8W, R, C, 0>(xb, K, s, q, c0, acc);
    step_f32<Q8W, R, C, 1>(xb, K, s, q, c0, acc);
    step_f32<Q8W, R, C, 2>(xb, K, s, q, c0, acc);
    step_f32<Q8W, R, C, 3>(xb, K, s, q, c0, acc);
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c)
      if (c0 + c < ncols) y[r * ldy + c0 + c] = hsum8(acc[r][c]);
}

template <int KIND, int R>
void tile_f32(const float* x, int64_t K, const uint16_t* sc, const uint8_t* qs, float* y,
              int64_t ldy, int64_t ncols) {
  constexpr int C = R == 1 ? 8 : R == 2 ? 4 : 2;
  for (int64_t c0 = 0; c0 < TILE; c0 += C) micro_f32<KIND, R, C>(x, K, sc, qs, c0, y, ldy, ncols);
}

// Rows of the q8 mode hold each block twice as wide: [x0..15, x0..15, x16..31, x16..31], so
// one 32-byte load of two outputs' nibbles (16 bytes each) meets both outputs' activations.
constexpr int64_t XQB = 64;

inline __m256i mul_q8(__m256i w, __m256i x) {  // |w| * (x * sign(w)), pairwise int16
  return _mm256_maddubs_epi16(_mm256_abs_epi8(w), _mm256_sign_epi8(x, w));
}

// R rows x P output pairs of one tile (pairs p0..p0+P), int8 activations. Lanes 0..3 of
// acc[r][p] accumulate output 2p, lanes 4..7 output 2p + 1: per block, the integer dot of each
// lane, then acc = fma(float(isum), d * dx, acc).
template <int KIND, int R, int P>
void micro_q8(const int8_t* xq, const float* dx, int64_t nb, const uint16_t* sc, const uint8_t* qs,
              int64_t p0, __m256 acc[R][P]) {
  constexpr bool Q8W = kQ8<KIND>;
  const int64_t qb = kQB<KIND>;
  const __m256i ones = _mm256_set1_epi16(1), low = _mm256_set1_epi8(0xF);
  for (int r = 0; r < R; ++r)
    for (int p = 0; p < P; ++p) acc[r][p] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* q = qs + b * TILE * qb;
    const __m256 d8 = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sc + b * kSC<KIND>)));
    __m256i lo[P], hi[P];
    __m256 d[P];
    for (int p = 0; p < P; ++p) {
      const int64_t c = 2 * (p0 + p);
      d[p] = _mm256_permutevar8x32_ps(d8, _mm256_setr_epi32(c, c, c, c, c + 1, c + 1, c + 1, c + 1));
      if (Q8W) {  // NOTE: repack() stores a Q8_0 pair as [c 0..15 | c+1 0..15 | c 16..31 | c+1 16..31]
        lo[p] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + c * 32));
        hi[p] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + c * 32 + 32));
      } else {
        const __m256i n = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + c * 16));
        lo[p] = _mm256_and_si256(n, low);
        hi[p] = _mm256_and_si256(_mm256_srli_epi16(n, 4), low);
      }
    }
    for (int r = 0; r < R; ++r) {
      const int64_t i = r * nb + b;
      const __m256i xl = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + i * XQB));
      const __m256i xh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + i * XQB + 32));
      const __m256 vdx = _mm256_set1_ps(dx[i]);
      for (int p = 0; p < P; ++p) {
        __m256i isum;
        if (Q8W) {  // NOTE: each half may reach 2 * 128 * 127: widen before adding
          isum = _mm256_add_epi32(_mm256_madd_epi16(mul_q8(lo[p], xl), ones),
                                  _mm256_madd_epi16(mul_q8(hi[p], xh), ones));
        } else {    // NOTE: 4-bit weights: |sum| <= 4 * 15 * 127 fits int16
          isum = _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(lo[p], xl),
                                                    _mm256_maddubs_epi16(hi[p], xh)), ones);
        }
        acc[r][p] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(d[p], vdx), acc[r][p]);
      }
    }
  }
}

inline float hsum4(__m128 v) {
  v = _mm_add_ps(v, _mm_movehl_ps(v, v));
  return _mm_cvtss_f32(_mm_add_ss(v, _mm_movehdup_ps(v)));
}

// R rows x one tile (8 outputs): y = hsum(lanes) + sum over blocks of m * sx (fixed order).
template <int KIND, int R>
void tile_q8(const int8_t* xq, const float* dx, const float* sx, int64_t nb, const uint16_t* sc,
             const uint8_t* qs, float* y, int64_t ldy, int64_t ncols) {
  constexpr int P = R == 1 ? 4 : 2;
  alignas(32) float mt[R][8];
  for (int r = 0; r < R; ++r) {
    __m256 am = _mm256_setzero_ps();
    if (!kQ8<KIND>)
      for (int64_t b = 0; b < nb; ++b) {
        __m256 d, m;
        scales8<KIND>(sc + b * kSC<KIND>, d, m);
        am = _mm256_fmadd_ps(m, _mm256_set1_ps(sx[r * nb + b]), am);
      }
    _mm256_store_ps(mt[r], am);
  }
  for (int64_t p0 = 0; p0 < TILE / 2; p0 += P) {
    __m256 acc[R][P];
    micro_q8<KIND, R, P>(xq, dx, nb, sc, qs, p0, acc);
    for (int r = 0; r < R; ++r)
      for (int p = 0; p < P; ++p) {
        const int64_t c = 2 * (p0 + p);
        if (c < ncols) y[r * ldy + c] = hsum4(_mm256_castps256_ps128(acc[r][p])) + mt[r][c];
        if (c + 1 < ncols)
          y[r * ldy + c + 1] = hsum4(_mm256_extractf128_ps(acc[r][p], 1)) + mt[r][c + 1];
      }
  }
}

// One row's activations quantised per block (see the file comment), written in the XQB layout.
void quantize_row(const float* x, int64_t nb, int8_t* q, float* dx, float* sx) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  for (int64_t b = 0; b < nb; ++b) {
    const float* xb = x + b * QK;
    __m256 v[4], mx = _mm256_setzero_ps();
    for (int j = 0; j < 4; ++j) {
      v[j] = _mm256_loadu_ps(xb + 8 * j);
      mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, v[j]));
    }
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_movehdup_ps(h));
    const float d = _mm_cvtss_f32(h) / 127.0f;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    int32_t sum = 0;
    int8_t* qb = q + b * XQB;
    for (int j = 0; j < 4; ++j) {
      const __m256 r = _mm256_round_ps(_mm256_mul_ps(v[j], _mm256_set1_ps(id)),
                                       _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      alignas(32) int32_t t[8];
      _mm256_store_si256(reinterpret_cast<__m256i*>(t), _mm256_cvtps_epi32(r));
      for (int k = 0; k < 8; ++k) {
        const int e = 8 * j + k, at = (e / 16) * 32 + e % 16;
        qb[at] = qb[at + 16] = static_cast<int8_t>(t[k]);
        sum += t[k];
      }
    }
    dx[b] = d;
    sx[b] = d * static_cast<float>(sum);
  }
}

void check(const at::Tensor& x, const at::Tensor& sc, const at::Tensor& qs, int64_t n,
           int64_t kind) {
  TORCH_CHECK(kind >= Q4_0 && kind <= Q8_0, "unknown block kind ", kind);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "x must be a contiguous float32 [M, K] tensor");
  const int64_t K = x.size(1), tiles = (n + TILE - 1) / TILE;
  TORCH_CHECK(K % QK == 0, "K must be a multiple of 32, got ", K);
  TORCH_CHECK(sc.scalar_type() == at::kHalf && sc.is_contiguous() &&
              sc.numel() == tiles * (K / QK) * (kind == Q4_1 ? 16 : 8),
              "scales do not match N=", n, " K=", K);
  TORCH_CHECK(qs.scalar_type() == at::kByte && qs.is_contiguous() &&
              qs.numel() == tiles * (K / QK) * TILE * (kind == Q8_0 ? 32 : 16),
              "quants do not match N=", n, " K=", K);
}

// Splits the output tiles of y [M, n] over threads; fn(s, q, yt, ncols) does every row for one
// tile: s/q its scales and quants, yt its first output column, ncols the columns left from it.
template <int KIND, typename F>
void over_tiles(const at::Tensor& sc, const at::Tensor& qs, int64_t n, int64_t nb, float* yp,
                const F& fn) {
  const uint16_t* sp = reinterpret_cast<const uint16_t*>(sc.data_ptr<at::Half>());
  const uint8_t* qp = qs.data_ptr<uint8_t>();
  at::parallel_for(0, (n + TILE - 1) / TILE, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      fn(sp + t * nb * kSC<KIND>, qp + t * nb * TILE * kQB<KIND>, yp + t * TILE, n - t * TILE);
  });
}

template <int KIND>
at::Tensor linear_f32_impl(const at::Tensor& x, const at::Tensor& sc, const at::Tensor& qs,
                           int64_t n) {
  const int64_t M = x.size(0), K = x.size(1), nb = K / QK;
  at::Tensor y = at::empty({M, n}, x.options());
  const float* xp = x.data_ptr<float>();
  over_tiles<KIND>(sc, qs, n, nb, y.data_ptr<float>(),
                   [&](const uint16_t* s, const uint8_t* q, float* yt, int64_t ncols) {
    int64_t r = 0;
    for (; r + 4 <= M; r += 4) tile_f32<KIND, 4>(xp + r * K, K, s, q, yt + r * n, n, ncols);
    if (M - r == 3) tile_f32<KIND, 3>(xp + r * K, K, s, q, yt + r * n, n, ncols);
    if (M - r == 2) tile_f32<KIND, 2>(xp + r * K, K, s, q, yt + r * n, n, ncols);
    if (M - r == 1) tile_f32<KIND, 1>(xp + r * K, K, s, q, yt + r * n, n, ncols);
  });
  return y;
}

template <int KIND>
at::Tensor linear_q8_impl(const at::Tensor& x, const at::Tensor& sc, const at::Tensor& qs,
                          int64_t n) {
  const int64_t M = x.size(0), K = x.size(1), nb = K / QK;
  at::Tensor xq = at::empty({M, nb * XQB}, x.options().dtype(at::kChar));
  at::Tensor dsx = at::empty({2, M, nb}, x.options());
  const float* xp = x.data_ptr<float>();
  int8_t* xqp = xq.data_ptr<int8_t>();
  float* dxp = dsx.data_ptr<float>();
  float* sxp = dxp + M * nb;
  at::parallel_for(0, M, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      quantize_row(xp + r * K, nb, xqp + r * nb * XQB, dxp + r * nb, sxp + r * nb);
  });
  at::Tensor y = at::empty({M, n}, x.options());
  over_tiles<KIND>(sc, qs, n, nb, y.data_ptr<float>(),
                   [&](const uint16_t* s, const uint8_t* q, float* yt, int64_t ncols) {
    int64_t r = 0;
    for (; r + 4 <= M; r += 4)
      tile_q8<KIND, 4>(xqp + r * nb * XQB, dxp + r * nb, sxp + r * nb, nb, s, q, yt + r * n, n, ncols);
    for (; r < M; ++r)
      tile_q8<KIND, 1>(xqp + r * nb * XQB, dxp + r * nb, sxp + r * nb, nb, s, q, yt + r * n, n, ncols);
  });
  return y;
}

// kind: 0 Q4_0, 1 Q4_1, 2 Q8_0 (ggml_linear.KINDS order)
at::Tensor linear(const at::Tensor& x, const at::Tensor& sc, const at::Tensor& qs, int64_t n,
                  int64_t kind, bool q8_acts) {
  check(x, sc, qs, n, kind);
  if (q8_acts) {
    if (kind == Q4_0) return linear_q8_impl<Q4_0>(x, sc, qs, n);
    if (kind == Q4_1) return linear_q8_impl<Q4_1>(x, sc, qs, n);
    return linear_q8_impl<Q8_0>(x, sc, qs, n);
  }
  if (kind == Q4_0) return linear_f32_impl<Q4_0>(x, sc, qs, n);
  if (kind == Q4_1) return linear_f32_impl<Q4_1>(x, sc, qs, n);
  return linear_f32_impl<Q8_0>(x, sc, qs, n);
}

std::vector<at::Tensor> quantize_rows(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous() &&
              x.size(1) % QK == 0, "x must be a contiguous float32 [M, K] tensor, K % 32 == 0");
  const int64_t M = x.size(0), K = x.size(1), nb = K / QK;
  std::vector<int8_t> wide(nb * XQB);
  at::Tensor q = at::empty({M, K}, x.options().dtype(at::kChar));
  at::Tensor dx = at::empty({M, nb}, x.options()), sx = at::empty({M, nb}, x.options());
  for (int64_t r = 0; r < M; ++r) {
    quantize_row(x.data_ptr<float>() + r * K, nb, wide.data(), dx.data_ptr<float>() + r * nb,
                 sx.data_ptr<float>() + r * nb);
    int8_t* out = q.data_ptr<int8_t>() + r * K;
    for (int64_t e = 0; e < K; ++e) out[e] = wide[(e / QK) * XQB + (e % QK / 16) * 32 + e % 16];
  }
  return {q, dx, sx};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, mod) {
  // NOTE: the GIL is released while a kernel runs, so the server's event loop keeps serving
  // (streams, new requests) during the engine thread's forward step.
  const auto nogil = pybind11::call_guard<pybind11::gil_scoped_release>();
  mod.def("linear", &linear, "y[M, N] = x[M, K] @ W.T on re-laid-out GGUF blocks", nogil);
  mod.def("quantize_rows", &quantize_rows, "the q8 mode's per-block activation quantisation", nogil);
}
