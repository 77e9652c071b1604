/* Issue 18, the exact mode on AVX2 at one row: is the per-weight float decode the limit, and
 * would a block-factored summation order lift it? One core, Q4_0 rows (ggml's 18-byte blocks,
 * random nibbles and float16 scales), 4 outputs side by side, no prefetch:
 *   A: today's canonical order: per 8 weights w = fma(q, d, -8 d) (the file's weight, exact),
 *      then acc = fma(w, x, acc): two FMAs and pmovzx, mask/shift, cvtdq2ps per 8 weights;
 *   B: factored: per block s = -8 sum(x) + sum(q x) in the same lanes, then acc = fma(d, s, acc):
 *      one FMA per 8 weights plus two per block (other bits: a different canonical order).
 * Prints G weights/s of each (best of the repeats), B's speed over A's, and their largest
 * relative difference. docs/quantization.md ("The AVX2 machine again") has the figures.
 *
 *   gcc -O3 -mavx2 -mfma -mf16c benchmarks/exact_q4_0_factored.c -o /tmp/eqf -lm
 *   /tmp/eqf 2048 2048 50; /tmp/eqf 8192 2048 20; /tmp/eqf 49152 2048 5   # N K repeats
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <math.h>
static double now(void){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
#define QK 32
typedef struct { uint16_t d; uint8_t q[16]; } __attribute__((packed)) blk;
static inline float h2f(uint16_t h){ return _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(h))); }
static inline float hsum(__m256 a, __m256 b){ __m256 s=_mm256_add_ps(a,b); __m128 x=_mm_add_ps(_mm256_castps256_ps128(s),_mm256_extractf128_ps(s,1)); x=_mm_add_ps(x,_mm_movehl_ps(x,x)); x=_mm_add_ss(x,_mm_movehdup_ps(x)); return _mm_cvtss_f32(x);}
#define G 4
static inline __m256i nib(const uint8_t* q, int V){ __m256i b=_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(q+8*(V%2)))); return V<2?_mm256_and_si256(b,_mm256_set1_epi32(0xF)):_mm256_srli_epi32(b,4);}
__attribute__((noinline)) void kA(const blk* W, int N, int K, const float* x, float* y){
  int nb=K/QK;
  for(int j=0;j<N;j+=G){
    __m256 lo[G],hi[G]; for(int g=0;g<G;g++) lo[g]=hi[g]=_mm256_setzero_ps();
    for(int b=0;b<nb;b++){
      for(int g=0;g<G;g++){
        const blk* p=W+(int64_t)(j+g)*nb+b; float d=h2f(p->d);
        __m256 dv=_mm256_set1_ps(d), m=_mm256_set1_ps(-8.f*d);
#define ST(V) { __m256 w=_mm256_fmadd_ps(_mm256_cvtepi32_ps(nib(p->q,V)),dv,m); __m256* a=(V%2)?&hi[g]:&lo[g]; *a=_mm256_fmadd_ps(w,_mm256_loadu_ps(x+b*QK+8*V),*a);}
        ST(0) ST(1) ST(2) ST(3)
#undef ST
      }
    }
    for(int g=0;g<G;g++) y[j+g]=hsum(lo[g],hi[g]);
  }
}
__attribute__((noinline)) void kB(const blk* W, int N, int K, const float* x, const float* xs, float* y){
  int nb=K/QK;
  for(int j=0;j<N;j+=G){
    __m256 lo[G],hi[G]; for(int g=0;g<G;g++) lo[g]=hi[g]=_mm256_setzero_ps();
    for(int b=0;b<nb;b++){
      const __m256 m8lo=_mm256_loadu_ps(xs+16*b), m8hi=_mm256_loadu_ps(xs+16*b+8);
      for(int g=0;g<G;g++){
        const blk* p=W+(int64_t)(j+g)*nb+b; __m256 dv=_mm256_set1_ps(h2f(p->d));
        __m256 sl=m8lo, sh=m8hi;  // -8 * lane sums of x
        sl=_mm256_fmadd_ps(_mm256_cvtepi32_ps(nib(p->q,0)),_mm256_loadu_ps(x+b*QK+0),sl);
        sh=_mm256_fmadd_ps(_mm256_cvtepi32_ps(nib(p->q,1)),_mm256_loadu_ps(x+b*QK+8),sh);
        sl=_mm256_fmadd_ps(_mm256_cvtepi32_ps(nib(p->q,2)),_mm256_loadu_ps(x+b*QK+16),sl);
        sh=_mm256_fmadd_ps(_mm256_cvtepi32_ps(nib(p->q,3)),_mm256_loadu_ps(x+b*QK+24),sh);
        lo[g]=_mm256_fmadd_ps(dv,sl,lo[g]); hi[g]=_mm256_fmadd_ps(dv,sh,hi[g]);
      }
    }
    for(int g=0;g<G;g++) y[j+g]=hsum(lo[g],hi[g]);
  }
}
int main(int argc,char**argv){
  int N=atoi(argv[1]),K=atoi(argv[2]),reps=atoi(argv[3]); int nb=K/QK;
  blk* W=aligned_alloc(64,((size_t)N*nb*sizeof(blk)+63)/64*64);
  for(size_t i=0;i<(size_t)N*nb;i++){ W[i].d=0x2000+(rand()&0x3ff); for(int k=0;k<16;k++) W[i].q[k]=rand(); }
  float* x=malloc(K*4),*xs=malloc(nb*16*4),*ya=malloc(N*4),*yb=malloc(N*4);
  for(int k=0;k<K;k++) x[k]=(rand()/(float)RAND_MAX)-0.5f;
  for(int b=0;b<nb;b++) for(int l=0;l<16;l++) xs[16*b+l]=-8.f*(x[b*QK+l]+x[b*QK+16+l]);
  double ta=1e9,tb=1e9;
  for(int r=0;r<reps;r++){ double t=now(); kA(W,N,K,x,ya); t=now()-t; if(t<ta)ta=t; t=now(); kB(W,N,K,x,xs,yb); t=now()-t; if(t<tb)tb=t; }
  double md=0; for(int i=0;i<N;i++){ double e=fabs(ya[i]-yb[i])/(fabs(ya[i])+1e-3); if(e>md)md=e;}
  printf("N=%d K=%d: A %.2f Gw/s  B %.2f Gw/s  B/A speed %.2fx  max rel diff %.2g\n",N,K,(double)N*K/ta/1e9,(double)N*K/tb/1e9,ta/tb,md);
}
