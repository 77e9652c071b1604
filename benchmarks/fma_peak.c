/* One core's AVX-512 FMA ceiling, for the exact tiles of issue 18 (docs/quantization.md,
 * "Legacy blocks at batch 8"): a register-only loop of 12 independent FMA chains, then an
 * R-row x G-output tile whose x rows come from L1 (one load per row, shared by the G FMAs), as
 * the kernels' tiles do without their decode.
 *
 *   gcc -O3 -funroll-all-loops -mavx512f benchmarks/fma_peak.c -o /tmp/fma_peak && /tmp/fma_peak
 */
#include <immintrin.h>
#include <stdio.h>
#include <time.h>

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

static float xs[64 * 8 * 16] __attribute__((aligned(64)));

static void chains(void) {
  __m512 a[12];
  for (int i = 0; i < 12; i++) a[i] = _mm512_set1_ps(i * 0.001f);
  const __m512 x = _mm512_set1_ps(0.9999f), y = _mm512_set1_ps(0.0001f);
  const long n = 200000000 / 12;
  const double t0 = now();
  for (long k = 0; k < n; k++)
    for (int i = 0; i < 12; i++) a[i] = _mm512_fmadd_ps(a[i], x, y);
  const double s = now() - t0;
  float o = 0;
  for (int i = 0; i < 12; i++) o += _mm512_reduce_add_ps(a[i]);
  printf("12 chains in registers: %.2f G zmm FMA/s (%g)\n", n * 12 / s / 1e9, o);
}

#define TILE(R, G)                                                                      \
  static void tile_##R##_##G(void) {                                                    \
    __m512 acc[R][G], w[G];                                                             \
    for (int r = 0; r < R; r++)                                                         \
      for (int g = 0; g < G; g++) acc[r][g] = _mm512_setzero_ps();                      \
    for (int g = 0; g < G; g++) w[g] = _mm512_set1_ps(1e-3f * (g + 1));                 \
    const long n = 4000000L * 16 / (R * G * 8);                                         \
    const double t0 = now();                                                            \
    for (long k = 0; k < n; k++) {                                                      \
      for (int c = 0; c < 64; c++) {                                                    \
        const float* x = xs + c * 128;                                                  \
        for (int r = 0; r < R; r++) {                                                   \
          __m512 xv = _mm512_load_ps(x + r * 16);                                       \
          __asm__("" : "+v"(xv));                                                       \
          for (int g = 0; g < G; g++) acc[r][g] = _mm512_fmadd_ps(w[g], xv, acc[r][g]); \
        }                                                                               \
        for (int g = 0; g < G; g++) __asm__("" : "+v"(w[g]));                           \
      }                                                                                 \
    }                                                                                   \
    const double s = now() - t0;                                                        \
    float o = 0;                                                                        \
    for (int r = 0; r < R; r++)                                                         \
      for (int g = 0; g < G; g++) o += _mm512_reduce_add_ps(acc[r][g]);                 \
    printf("%d x %d tile, x from L1: %.2f G zmm FMA/s (%g)\n", R, G,                    \
           n * 64.0 * R * G / s / 1e9, o);                                              \
  }
TILE(8, 2)
TILE(8, 3)
TILE(4, 4)

int main(void) {
  for (int i = 0; i < 64 * 8 * 16; i++) xs[i] = i * 1e-6f;
  chains();
  tile_8_2();
  tile_8_3();
  tile_4_4();
  return 0;
}
