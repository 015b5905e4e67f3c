/* bench-util.h -- what the benchmarks share: random inputs, measured read bandwidth, peak RSS. */
#ifndef FU_BENCH_UTIL_H
#define FU_BENCH_UTIL_H

#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <time.h>
#include <immintrin.h>

#include "clock.h"

/* Uniform in [-1, 1): a xorshift stream with a fixed seed, so that every run draws the same
 * inputs (one stream per program). */
static inline float bench_randf(void) {
    static uint64_t rng = 0x9e3779b97f4a7c15ull;
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return (float)((rng >> 40) * (1.0 / 8388608.0) - 1.0);
}

/* Peak resident set size of this process, in MiB. */
static inline double bench_peak_rss_mib(void) {
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    return (double)ru.ru_maxrss / 1024.0;
}

/* Sums n bytes (a multiple of 128, 32-byte aligned) as 64-bit integers: a
 * streaming read the compiler cannot skip, with the same software prefetch
 * 4 KiB ahead as the decode kernels, so that the read is as fast as the
 * machine allows and kernels are not compared with a slower reference. */
__attribute__((target("avx2"))) static inline double bench_sum_avx2(const uint8_t *p, size_t n) {
    __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
    for (size_t i = 0; i + 128 <= n; i += 128) {
        _mm_prefetch((const char *)p + i + 4096, _MM_HINT_T0);
        _mm_prefetch((const char *)p + i + 4096 + 64, _MM_HINT_T0);
        a0 = _mm256_add_epi64(a0, _mm256_load_si256((const __m256i *)(p + i)));
        a1 = _mm256_add_epi64(a1, _mm256_load_si256((const __m256i *)(p + i + 32)));
        a2 = _mm256_add_epi64(a2, _mm256_load_si256((const __m256i *)(p + i + 64)));
        a3 = _mm256_add_epi64(a3, _mm256_load_si256((const __m256i *)(p + i + 96)));
    }
    a0 = _mm256_add_epi64(_mm256_add_epi64(a0, a1), _mm256_add_epi64(a2, a3));
    int64_t v[4];
    _mm256_storeu_si256((__m256i *)v, a0);
    return (double)(v[0] + v[1] + v[2] + v[3]);
}

static inline double bench_sum_plain(const uint8_t *p, size_t n) {
    const uint64_t *q = (const uint64_t *)p;
    uint64_t s[8] = {0};
    for (size_t i = 0; i + 8 <= n / 8; i += 8)
        for (int j = 0; j < 8; j++) s[j] += q[i + j];
    return (double)(s[0] + s[1] + s[2] + s[3] + s[4] + s[5] + s[6] + s[7]);
}

static inline double bench_sum(const uint8_t *p, size_t n) {
    return __builtin_cpu_supports("avx2") ? bench_sum_avx2(p, n) : bench_sum_plain(p, n);
}

typedef struct bench_bw_part {
    const uint8_t *p;
    size_t n;
    double sum;
} bench_bw_part;

static void *bench_bw_worker(void *arg) {
    bench_bw_part *w = arg;
    w->sum = bench_sum(w->p, w->n);
    return NULL;
}

/* qsort comparator for doubles, ascending. */
static inline int bench_cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

/* One read of buf (bytes) by n_threads threads, each streaming its share:
 * GB/s (1e9 bytes/s). */
static inline double bench_read_once(const uint8_t *buf, size_t bytes, int n_threads) {
    if (n_threads < 1) n_threads = 1;
    if (n_threads > 64) n_threads = 64;
    static volatile double sink;
    size_t part = bytes / (size_t)n_threads / 128 * 128;
    pthread_t th[64];
    bench_bw_part parts[64];
    double t0 = fu_now_s();
    for (int t = 0; t < n_threads; t++) {
        parts[t] = (bench_bw_part){buf + part * (size_t)t, part, 0};
        pthread_create(&th[t], NULL, bench_bw_worker, &parts[t]);
    }
    for (int t = 0; t < n_threads; t++) {
        pthread_join(th[t], NULL);
        sink += parts[t].sum;
    }
    return (double)(part * (size_t)n_threads) / (fu_now_s() - t0) / 1e9;
}

/* A buffer of `bytes` (a multiple of 64) to read, every page touched; NULL
 * when out of memory. free() it. */
static inline uint8_t *bench_read_buffer(size_t bytes) {
    uint8_t *buf = aligned_alloc(64, bytes);
    if (buf) memset(buf, 1, bytes);
    return buf;
}

/* Measured read bandwidth in GB/s (1e9 bytes/s) with n_threads threads
 * streaming over a buffer far larger than the caches; best of `reps`. */
static inline double bench_read_bandwidth(int n_threads, size_t bytes, int reps) {
    uint8_t *buf = bench_read_buffer(bytes);
    if (!buf) return 0;
    double best = 0;
    for (int r = 0; r < reps; r++) {
        double gbs = bench_read_once(buf, bytes, n_threads);
        if (gbs > best) best = gbs;
    }
    free(buf);
    return best;
}

#endif
