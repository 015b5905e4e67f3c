/* bench-util.h -- what the benchmarks share: wall clock, measured read bandwidth, peak RSS. */
#ifndef FU_BENCH_UTIL_H
#define FU_BENCH_UTIL_H

#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <time.h>

static inline double bench_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* Peak resident set size of this process, in MiB. */
static inline double bench_peak_rss_mib(void) {
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    return (double)ru.ru_maxrss / 1024.0;
}

typedef struct bench_bw_part {
    const uint64_t *p;
    size_t n;
    uint64_t sum;
} bench_bw_part;

static void *bench_bw_worker(void *arg) {
    bench_bw_part *w = arg;
    uint64_t s0 = 0, s1 = 0, s2 = 0, s3 = 0;
    size_t i = 0;
    for (; i + 4 <= w->n; i += 4) {
        s0 += w->p[i];
        s1 += w->p[i + 1];
        s2 += w->p[i + 2];
        s3 += w->p[i + 3];
    }
    for (; i < w->n; i++) s0 += w->p[i];
    w->sum = s0 + s1 + s2 + s3;
    return NULL;
}

/* Measured read bandwidth in GB/s (1e9 bytes/s) with n_threads threads
 * streaming over a buffer far larger than the caches; best of `reps`. */
static inline double bench_read_bandwidth(int n_threads, size_t bytes, int reps) {
    if (n_threads < 1) n_threads = 1;
    if (n_threads > 64) n_threads = 64;
    size_t n = bytes / sizeof(uint64_t);
    uint64_t *buf = malloc(n * sizeof *buf);
    if (!buf) return 0;
    for (size_t i = 0; i < n; i++) buf[i] = i; /* touch every page */
    double best = 0;
    volatile uint64_t sink = 0;
    for (int r = 0; r < reps; r++) {
        pthread_t th[64];
        bench_bw_part parts[64];
        size_t per = n / (size_t)n_threads;
        double t0 = bench_now();
        for (int t = 0; t < n_threads; t++) {
            parts[t].p = buf + per * (size_t)t;
            parts[t].n = t == n_threads - 1 ? n - per * (size_t)t : per;
            pthread_create(&th[t], NULL, bench_bw_worker, &parts[t]);
        }
        for (int t = 0; t < n_threads; t++) {
            pthread_join(th[t], NULL);
            sink += parts[t].sum;
        }
        double gbs = (double)(n * sizeof *buf) / (bench_now() - t0) / 1e9;
        if (gbs > best) best = gbs;
    }
    (void)sink;
    free(buf);
    return best;
}

#endif
