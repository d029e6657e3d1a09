// Read bandwidth of the same bytes as sixteen interleaved streams or as one:
// the measurement behind the band layout of f16/bf16 weights
// (crates/kvant-kernels/src/halfpack.rs).
//
// Sixteen streams: a one-token tile over groups stored one after another
// reads 16 bytes from each of sixteen groups 9 KiB apart (SmolLM2's 576
// columns of 8 f16 rows) per weight index. One stream: the same bytes with
// the sixteen groups' 16 bytes side by side (a band row of 256 bytes). Both
// widen with vcvtph2ps and add into the same eight accumulators, on a
// 256 MiB buffer advised for transparent huge pages (as kvant's weights).
// Fewer streams are printed for reference; they keep fewer accumulators busy,
// so they are latency-bound and not comparable with the two above.
//
//   gcc -O2 -o /tmp/streams tools/bench/streams.c && /tmp/streams
//
// Needs AVX-512 F (Zen 4, Sapphire Rapids and later). Best of 3 passes per
// line, three rounds alternating the layouts. On the Zen 4 VM of issue 17:
// 16 streams 22.8-24.4 GB/s, one stream 31.7-35.4 GB/s (two runs).
#include <immintrin.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

#define SIZE (256ul << 20)
#define HUGE (2ul << 20)
#define REGION 9216 /* bytes of one group: 576 columns x 8 rows x 2 bytes */

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

// k groups of REGION bytes read side by side, 16 bytes of each per step.
__attribute__((target("avx512f"))) static float streams(const unsigned char *b, int k) {
  __m512 acc[8];
  for (int i = 0; i < 8; i++) acc[i] = _mm512_setzero_ps();
  size_t span = (size_t)REGION * k;
  for (size_t g = 0; g + span <= SIZE; g += span) {
    const unsigned char *base = b + g;
    for (size_t off = 0; off < REGION; off += 16) {
      for (int s = 0; s < k; s += 2) {
        __m128i lo = _mm_loadu_si128((const __m128i *)(base + s * REGION + off));
        __m128i hi = _mm_loadu_si128((const __m128i *)(base + (s + 1) * REGION + off));
        __m256i both = _mm256_inserti128_si256(_mm256_castsi128_si256(lo), hi, 1);
        acc[(s / 2) & 7] = _mm512_add_ps(acc[(s / 2) & 7], _mm512_cvtph_ps(both));
      }
    }
  }
  __m512 t = acc[0];
  for (int i = 1; i < 8; i++) t = _mm512_add_ps(t, acc[i]);
  return _mm512_reduce_add_ps(t);
}

// The same bytes as bands: the 16 groups' 16 bytes of a step side by side.
__attribute__((target("avx512f"))) static float band(const unsigned char *b) {
  __m512 acc[8];
  for (int i = 0; i < 8; i++) acc[i] = _mm512_setzero_ps();
  for (size_t off = 0; off + 256 <= SIZE; off += 256) {
    for (int s = 0; s < 16; s += 2) {
      __m256i both = _mm256_loadu_si256((const __m256i *)(b + off + s * 16));
      acc[(s / 2) & 7] = _mm512_add_ps(acc[(s / 2) & 7], _mm512_cvtph_ps(both));
    }
  }
  __m512 t = acc[0];
  for (int i = 1; i < 8; i++) t = _mm512_add_ps(t, acc[i]);
  return _mm512_reduce_add_ps(t);
}

int main(void) {
  if (!__builtin_cpu_supports("avx512f")) {
    fprintf(stderr, "streams: this CPU has no AVX-512 F\n");
    return 1;
  }
  unsigned char *raw = mmap(0, SIZE + HUGE, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (raw == MAP_FAILED) {
    perror("mmap");
    return 1;
  }
  unsigned char *b = (unsigned char *)(((size_t)raw + HUGE - 1) & ~(HUGE - 1));
  madvise(b, SIZE, MADV_HUGEPAGE);
  memset(b, 0x3c, SIZE); /* f16 1.0 in every lane; commits the pages */
  volatile float sink = 0;
  int ks[] = {2, 4, 8, 16};
  for (int round = 0; round < 3; round++) {
    for (int i = 0; i < 4; i++) {
      double best = 1e9;
      for (int r = 0; r < 3; r++) {
        double t = now();
        sink += streams(b, ks[i]);
        t = now() - t;
        if (t < best) best = t;
      }
      printf("%2d streams 9 KiB apart: %5.1f GB/s\n", ks[i], SIZE / best / 1e9);
    }
    double best = 1e9;
    for (int r = 0; r < 3; r++) {
      double t = now();
      sink += band(b);
      t = now() - t;
      if (t < best) best = t;
    }
    printf("the same 16 as one stream (bands): %5.1f GB/s\n", SIZE / best / 1e9);
  }
  return 0;
}
