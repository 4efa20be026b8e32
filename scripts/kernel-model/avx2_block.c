// What the AVX2 path's block algorithm can reach on this CPU, with nothing of the kernel's
// bookkeeping: a G=4 group of bf16 blocks (32 tokens, K as [D][32], then V as [32][D]), scored
// by a register tile of 4 heads x 16 tokens, an online softmax with a lazy maximum, then V
// accumulated four heads x 16 channels at a time. No prefetch, no partial blocks, no NaN
// checks, accumulators left in their even/odd order: an upper bound for `kernel_avx2`, not a
// second kernel (#17). Timing only: the results are not checked.
//
//   gcc -O3 -mavx2 -mfma -DD=64 -o /tmp/avx2_block scripts/kernel-model/avx2_block.c
//   /tmp/avx2_block [KiB of KV, default 256: in L2]
//
// -O3, not -O2: at -O2 gcc keeps the accumulator arrays in memory. Zen 4 VM, 2026-12-02, p95
// over the peak's p95, three runs: D=64 0.925 without the softmax, 0.78-0.80 with it (the
// kernel: 0.66); D=128 0.92 / 0.84-0.86 (the kernel: 0.72). Overlapping the softmax with the
// previous block's V gained nothing.
//
// Each of 300 rounds times a short FMA-peak loop (12 chains, as `attention::fma_peak`) and
// then each variant over the blocks; shared VMs swing by 20-30% from one second to the next,
// so the rates are given as a percentile of the variant over the 95th percentile of the peak.
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#ifndef D
#define D 64
#endif
#define G 4
#define B 32

static float q[G * D] __attribute__((aligned(64)));
static float sbuf[2][G * B] __attribute__((aligned(64)));
static float acc[G * D] __attribute__((aligned(64)));
static float mrun[G], lrun[G];

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

// The kernel's bf16 pair load: even elements by a shift, odd ones by a blend with zero.
#define WIDEN(w, e, o)                                                 \
  __m256 e = _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));            \
  __m256 o = _mm256_castsi256_ps(_mm256_blend_epi16(z, w, 0xaa));

#define FMA8(p, e, o, a)                                               \
  for (int i = 0; i < 4; i++) {                                        \
    __m256 b = _mm256_broadcast_ss(p(i));                              \
    a[2 * i] = _mm256_fmadd_ps(b, e, a[2 * i]);                        \
    a[2 * i + 1] = _mm256_fmadd_ps(b, o, a[2 * i + 1]);                \
  }

// Scores of 16 tokens (j0 = 0 or 16) for the 4 heads, left in even/odd order.
static inline void scores(const uint16_t *k, int j0, float *s) {
  const __m256i z = _mm256_setzero_si256();
  __m256 a[8];
  for (int i = 0; i < 8; i++) a[i] = _mm256_setzero_ps();
  for (int c = 0; c < D; c++) {
    __m256i w = _mm256_loadu_si256((const __m256i *)(k + c * B + j0));
    WIDEN(w, e, o)
#define QP(i) (q + (i) * D + c)
    FMA8(QP, e, o, a)
#undef QP
  }
  for (int i = 0; i < 4; i++) {
    _mm256_storeu_ps(s + i * B + j0, a[2 * i]);
    _mm256_storeu_ps(s + i * B + j0 + 8, a[2 * i + 1]);
  }
}

// `kernel_avx2::exp2_ps`: degree-6 polynomial, exponent by conversion.
static inline __m256 exp2v(__m256 x) {
  __m256 lo = _mm256_set1_ps(-126.f);
  __m256 tiny = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
  x = _mm256_max_ps(lo, x);
  __m256 n = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 f = _mm256_sub_ps(x, n);
  static const float c[6] = {1.3398874e-3f, 9.618437e-3f, 5.5503325e-2f,
                             2.4022648e-1f, 6.931472e-1f, 1.f};
  __m256 p = _mm256_set1_ps(1.5353362e-4f);
  for (int i = 0; i < 6; i++) p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(c[i]));
  __m256i ex = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(tiny, _mm256_mul_ps(p, _mm256_castsi256_ps(ex)));
}

// Each head: are all scores within 2^8 of the running maximum (the lazy test), then the
// weights in place and their sum. The data keep the test true, as most blocks do.
static inline void softmax(float *s) {
  for (int h = 0; h < G; h++) {
    __m256 m = _mm256_set1_ps(mrun[h]), top = _mm256_set1_ps(mrun[h] + 8.f);
    __m256 le = _mm256_castsi256_ps(_mm256_set1_epi32(-1)), sum = _mm256_setzero_ps();
    for (int j = 0; j < B / 8; j++)
      le = _mm256_and_ps(le, _mm256_cmp_ps(_mm256_loadu_ps(s + h * B + 8 * j), top, _CMP_LE_OQ));
    if (_mm256_movemask_ps(le) != 0xff) mrun[h] = 1e9f;
    for (int j = 0; j < B / 8; j++) {
      __m256 v = exp2v(_mm256_sub_ps(_mm256_loadu_ps(s + h * B + 8 * j), m));
      sum = _mm256_add_ps(sum, v);
      _mm256_storeu_ps(s + h * B + 8 * j, v);
    }
    __m128 t = _mm_add_ps(_mm256_castps256_ps128(sum), _mm256_extractf128_ps(sum, 1));
    t = _mm_add_ps(t, _mm_movehl_ps(t, t));
    lrun[h] += _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps(t, t, 1)));
  }
}

// V: for each 16-channel slice, 8 accumulators through the block's 32 tokens.
static inline void values(const uint16_t *v, const float *s) {
  const __m256i z = _mm256_setzero_si256();
  for (int c0 = 0; c0 < D; c0 += 16) {
    __m256 a[8];
    for (int i = 0; i < 4; i++) {
      a[2 * i] = _mm256_loadu_ps(acc + i * D + c0);
      a[2 * i + 1] = _mm256_loadu_ps(acc + i * D + c0 + 8);
    }
    for (int t = 0; t < B; t++) {
      __m256i w = _mm256_loadu_si256((const __m256i *)(v + t * D + c0));
      WIDEN(w, e, o)
#define WP(i) (s + (i) * B + t)
      FMA8(WP, e, o, a)
#undef WP
    }
    for (int i = 0; i < 4; i++) {
      _mm256_storeu_ps(acc + i * D + c0, a[2 * i]);
      _mm256_storeu_ps(acc + i * D + c0 + 8, a[2 * i + 1]);
    }
  }
}

enum { NO_SOFTMAX, BLOCK, PIPELINED, VARIANTS };
static const char *NAMES[VARIANTS] = {
    "scores + V, no softmax", "scores, softmax, V (the kernel's order)",
    "scores(n), softmax(n), V(n-1): softmax overlaps the previous V"};

__attribute__((noinline)) static void scan(const uint16_t *buf, long nblk, int variant) {
  for (long b = 0; b < nblk; b++) {
    const uint16_t *k = buf + b * 2 * D * B;
    float *s = sbuf[b & 1];
    scores(k, 0, s);
    scores(k, 16, s);
    if (variant == NO_SOFTMAX) {
      values(k + D * B, s);
    } else if (variant == BLOCK) {
      softmax(s);
      values(k + D * B, s);
    } else {
      softmax(s);
      if (b > 0) values(k - D * B, sbuf[(b - 1) & 1]);
    }
  }
  if (variant == PIPELINED) values(buf + (nblk - 1) * 2 * D * B + D * B, sbuf[(nblk - 1) & 1]);
}

// Twelve named chains: an array here is kept in memory by the asm barrier.
__attribute__((noinline)) static void peak(long reps) {
  __m256 x = _mm256_set1_ps(0.999f), y = _mm256_set1_ps(1e-6f);
  __m256 a0 = _mm256_set1_ps(1.f), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0,
         a7 = a0, a8 = a0, a9 = a0, a10 = a0, a11 = a0;
  for (long r = 0; r < reps; r++) {
#define F(a) a = _mm256_fmadd_ps(a, x, y);
    F(a0) F(a1) F(a2) F(a3) F(a4) F(a5) F(a6) F(a7) F(a8) F(a9) F(a10) F(a11)
#undef F
    __asm__ volatile("" : "+x"(a0), "+x"(a1), "+x"(a2), "+x"(a3), "+x"(a4), "+x"(a5),
                     "+x"(a6), "+x"(a7), "+x"(a8), "+x"(a9), "+x"(a10), "+x"(a11));
  }
}

static int cmp(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

int main(int argc, char **argv) {
  long kib = argc > 1 ? atol(argv[1]) : 256;
  long bytes = 2L * D * B * 2, nblk = kib * 1024 / bytes;
  if (nblk < 2) nblk = 2;
  uint16_t *buf = aligned_alloc(4096, nblk * bytes);
  if (!buf) return 1;
  // bf16 values around 2^-7: scores stay far below the lazy maximum's slack.
  for (long i = 0; i < nblk * bytes / 2; i++) buf[i] = 0x3c00 + i % 97;
  for (int i = 0; i < G * D; i++) q[i] = 0.001f * (i % 5);
  for (int h = 0; h < G; h++) mrun[h] = 100.f;
  enum { R = 300 };
  static double rate[VARIANTS][R], pk[R];
  long passes = (4L << 20) / (nblk * bytes) + 1, reps = 200000;
  double fmas = 2.0 * G * D * B * nblk * passes / 8;  // vector FMAs of a timed pass
  for (int r = 0; r < R; r++) {
    double t = now();
    peak(reps);
    pk[r] = reps * 12 / (now() - t);
    for (int v = 0; v < VARIANTS; v++) {
      t = now();
      for (long p = 0; p < passes; p++) scan(buf, nblk, v);
      rate[v][r] = fmas / (now() - t);
    }
  }
  qsort(pk, R, sizeof pk[0], cmp);
  double top = pk[R * 95 / 100];
  printf("G=%d D=%d bf16, %ld KiB, FMA peak %.1f G lanes/s (p95)\n", G, D, kib, top * 8e-9);
  for (int v = 0; v < VARIANTS; v++) {
    qsort(rate[v], R, sizeof rate[v][0], cmp);
    printf("  %-62s median %.3f  p95 %.3f of the peak\n", NAMES[v], rate[v][R / 2] / top,
           rate[v][R * 95 / 100] / top);
  }
  return 0;
}
