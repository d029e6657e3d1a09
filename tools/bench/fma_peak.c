// Peak f32 multiply-add rate of one core, and the rates of the other
// instructions a half-precision product can be built on: the compute
// roofline for F16 and BF16 prefill (issue 17).
//
// Each line runs 12 independent accumulator chains (enough to cover the
// FMA latency on two pipes) of one instruction over register operands, no
// memory traffic, best of 5 passes of 100M instructions:
//   vfmadd231ps ymm / zmm   8 / 16 multiply-adds per instruction (f32)
//   vdpbf16ps  ymm / zmm   16 / 32 multiply-adds (bf16 pairs into f32)
//   vcvtph2ps + vfmadd ymm  the F16 tile's inner step: widen 8 halves, 3 FMAs
// and prints GFLOP/s (2 FLOPs per multiply-add) on one thread.
//
//   gcc -O2 -o /tmp/fma_peak tools/bench/fma_peak.c && /tmp/fma_peak
//
// Needs AVX-512 F and BF16 (Zen 4, Sapphire Rapids and later).
#include <immintrin.h>
#include <stdio.h>
#include <time.h>

#define ITERS 100000000l

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

#define CHAINS(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11)

// The asm volatile barrier keeps each accumulator in a register and the
// loop from being folded; the operands are loop-invariant registers.
#define LOOP(T, ZERO, OP, SUM)                                        \
  T a0 = ZERO, a1 = ZERO, a2 = ZERO, a3 = ZERO, a4 = ZERO, a5 = ZERO; \
  T a6 = ZERO, a7 = ZERO, a8 = ZERO, a9 = ZERO, a10 = ZERO, a11 = ZERO; \
  for (long i = 0; i < ITERS / 12; i++) {                             \
    CHAINS(OP)                                                        \
    __asm__ volatile("" : "+v"(a0), "+v"(a1), "+v"(a2), "+v"(a3), "+v"(a4), "+v"(a5)); \
    __asm__ volatile("" : "+v"(a6), "+v"(a7), "+v"(a8), "+v"(a9), "+v"(a10), "+v"(a11)); \
  }                                                                   \
  return SUM;

__attribute__((target("avx2,fma"))) static float fma_ymm(__m256 x, __m256 y) {
#define OP(i) a##i = _mm256_fmadd_ps(x, y, a##i);
  LOOP(__m256, _mm256_setzero_ps(), OP,
       _mm256_cvtss_f32(_mm256_add_ps(_mm256_add_ps(a0, a6), a11)))
#undef OP
}

__attribute__((target("avx512f"))) static float fma_zmm(__m512 x, __m512 y) {
#define OP(i) a##i = _mm512_fmadd_ps(x, y, a##i);
  LOOP(__m512, _mm512_setzero_ps(), OP, _mm512_reduce_add_ps(_mm512_add_ps(a0, a11)))
#undef OP
}

__attribute__((target("avx512f,avx512vl,avx512bf16"))) static float dpbf16_ymm(__m256bh x, __m256bh y) {
#define OP(i) a##i = _mm256_dpbf16_ps(a##i, x, y);
  LOOP(__m256, _mm256_setzero_ps(), OP,
       _mm256_cvtss_f32(_mm256_add_ps(_mm256_add_ps(a0, a6), a11)))
#undef OP
}

__attribute__((target("avx512f,avx512bf16"))) static float dpbf16_zmm(__m512bh x, __m512bh y) {
#define OP(i) a##i = _mm512_dpbf16_ps(a##i, x, y);
  LOOP(__m512, _mm512_setzero_ps(), OP, _mm512_reduce_add_ps(_mm512_add_ps(a0, a11)))
#undef OP
}

// The F16 prefill tile's step: one vcvtph2ps feeding three FMAs (three
// tokens' broadcasts); 12 chains = 4 widened weights x 3 tokens.
__attribute__((target("avx2,fma,f16c"))) static float cvt_fma_ymm(__m128i h, __m256 y) {
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0;
  __m256 a6 = a0, a7 = a0, a8 = a0, a9 = a0, a10 = a0, a11 = a0;
  __m128i h0 = h, h1 = _mm_add_epi16(h, _mm_set1_epi16(1)), h2 = _mm_add_epi16(h, _mm_set1_epi16(2)),
          h3 = _mm_add_epi16(h, _mm_set1_epi16(3));
  for (long i = 0; i < ITERS / 12; i++) {
    __asm__ volatile("" : "+x"(h0), "+x"(h1), "+x"(h2), "+x"(h3));
    __m256 w0 = _mm256_cvtph_ps(h0), w1 = _mm256_cvtph_ps(h1), w2 = _mm256_cvtph_ps(h2),
           w3 = _mm256_cvtph_ps(h3);
    a0 = _mm256_fmadd_ps(w0, y, a0); a1 = _mm256_fmadd_ps(w0, w1, a1); a2 = _mm256_fmadd_ps(w0, w2, a2);
    a3 = _mm256_fmadd_ps(w1, y, a3); a4 = _mm256_fmadd_ps(w1, w2, a4); a5 = _mm256_fmadd_ps(w1, w3, a5);
    a6 = _mm256_fmadd_ps(w2, y, a6); a7 = _mm256_fmadd_ps(w2, w3, a7); a8 = _mm256_fmadd_ps(w2, w0, a8);
    a9 = _mm256_fmadd_ps(w3, y, a9); a10 = _mm256_fmadd_ps(w3, w0, a10); a11 = _mm256_fmadd_ps(w3, w1, a11);
    __asm__ volatile("" : "+v"(a0), "+v"(a1), "+v"(a2), "+v"(a3), "+v"(a4), "+v"(a5));
    __asm__ volatile("" : "+v"(a6), "+v"(a7), "+v"(a8), "+v"(a9), "+v"(a10), "+v"(a11));
  }
  return _mm256_cvtss_f32(_mm256_add_ps(_mm256_add_ps(a0, a6), a11));
}

// Best of 5 passes; `macs` multiply-adds per instruction of the loop's kind.
#define RUN(name, call, macs)                                                   \
  do {                                                                          \
    double best = 1e30;                                                         \
    float sink = 0;                                                             \
    for (int p = 0; p < 5; p++) {                                               \
      double t0 = now();                                                        \
      sink += call;                                                             \
      double t = now() - t0;                                                    \
      if (t < best) best = t;                                                   \
    }                                                                           \
    printf("%-34s %7.1f GFLOP/s  (%.2f G instr/s)  [%g]\n", name,              \
           2.0 * (macs) * (ITERS / 12 * 12) / best / 1e9, (ITERS / 12 * 12) / best / 1e9, sink); \
  } while (0)

__attribute__((target("avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512bf16"))) int main(void) {
  volatile float v = 1e-7f;
  __m256 y8 = _mm256_set1_ps(v);
  __m512 y16 = _mm512_set1_ps(v);
  __m256bh b8 = (__m256bh)_mm256_set1_epi16(0x3380);
  __m512bh b16 = (__m512bh)_mm512_set1_epi16(0x3380);
  __m128i h = _mm_set1_epi16(0x1400);
  RUN("vfmadd231ps ymm", fma_ymm(y8, y8), 8);
  RUN("vfmadd231ps zmm", fma_zmm(y16, y16), 16);
  RUN("vdpbf16ps ymm", dpbf16_ymm(b8, b8), 16);
  RUN("vdpbf16ps zmm", dpbf16_zmm(b16, b16), 32);
  RUN("vcvtph2ps + 3 vfmadd231ps ymm", cvt_fma_ymm(h, y8), 8);
  return 0;
}
