/* cpu-pool.c -- the CPU backend's fork-join thread pool (spin, then futex sleep). */
#include <limits.h>
#include <linux/futex.h>
#include <pthread.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "cpu-impl.h"

/* Iterations a waiting thread polls (with pause, ~40-140 cycles each) before it
 * sleeps in the kernel: tens of microseconds, enough to cover the gap between
 * consecutive ops of a forward pass without burning a core when idle. */
#define CPU_POOL_SPIN 2048

struct cpu_pool {
    int n;                    /* threads including the caller */
    pthread_t *threads;       /* (n - 1) workers */
    _Atomic uint32_t gen;     /* futex word: bumped once per job */
    _Atomic uint32_t closed;  /* generation of the last job the caller has closed */
    _Atomic uint32_t active;  /* futex word: workers inside the current job */
    _Atomic int sleepers;     /* workers blocked (or about to block) on gen */
    _Atomic int main_waiting; /* the caller is blocked (or about to block) on active */
    _Atomic int stop;
    cpu_job_fn fn;
    void *arg;
};

typedef struct cpu_pool_worker {
    cpu_pool *pool;
    int ith;
} cpu_pool_worker;

static void cpu_futex_wait(_Atomic uint32_t *addr, uint32_t expected) {
    syscall(SYS_futex, (uint32_t *)addr, FUTEX_WAIT_PRIVATE, expected, NULL, NULL, 0);
}

static void cpu_futex_wake(_Atomic uint32_t *addr) {
    syscall(SYS_futex, (uint32_t *)addr, FUTEX_WAKE_PRIVATE, INT_MAX, NULL, NULL, 0);
}

static inline void cpu_pause(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

static void *cpu_pool_main(void *p) {
    cpu_pool_worker *w = p;
    cpu_pool *pool = w->pool;
    uint32_t seen = 0;
    for (;;) {
        uint32_t g;
        int spins = 0;
        while ((g = atomic_load_explicit(&pool->gen, memory_order_acquire)) == seen) {
            if (++spins < CPU_POOL_SPIN) {
                cpu_pause();
                continue;
            }
            atomic_fetch_add(&pool->sleepers, 1);
            cpu_futex_wait(&pool->gen, seen);
            atomic_fetch_sub(&pool->sleepers, 1);
            spins = 0;
        }
        seen = g;
        if (atomic_load(&pool->stop)) break;
        /* Join job g only while it is open: the caller closes it once its own
         * share is done and then waits for the workers that joined, so a
         * worker the OS runs late never delays it (jobs hand out their work
         * from shared counters, so whoever runs takes it all). */
        atomic_fetch_add(&pool->active, 1);
        if (atomic_load(&pool->gen) == g && atomic_load(&pool->closed) != g)
            pool->fn(pool->arg, w->ith, pool->n);
        if (atomic_fetch_sub(&pool->active, 1) == 1 && atomic_load(&pool->main_waiting))
            cpu_futex_wake(&pool->active);
    }
    free(w);
    return NULL;
}

cpu_pool *cpu_pool_new(int n_threads) {
    cpu_pool *pool = calloc(1, sizeof *pool);
    if (!pool) return NULL;
    pool->n = n_threads < 1 ? 1 : n_threads;
    pool->threads = calloc((size_t)pool->n, sizeof *pool->threads);
    if (!pool->threads) goto err;
    for (int i = 1; i < pool->n; i++) {
        cpu_pool_worker *w = malloc(sizeof *w);
        if (!w) goto err_started;
        w->pool = pool;
        w->ith = i;
        if (pthread_create(&pool->threads[i - 1], NULL, cpu_pool_main, w) != 0) {
            free(w);
            goto err_started;
        }
        continue;
    err_started:
        pool->n = i; /* join the i - 1 workers that did start */
        cpu_pool_free(pool);
        return NULL;
    }
    return pool;
err:
    free(pool->threads);
    free(pool);
    return NULL;
}

void cpu_pool_free(cpu_pool *pool) {
    if (!pool) return;
    atomic_store(&pool->stop, 1);
    atomic_fetch_add(&pool->gen, 1);
    cpu_futex_wake(&pool->gen);
    for (int i = 1; i < pool->n; i++) pthread_join(pool->threads[i - 1], NULL);
    free(pool->threads);
    free(pool);
}

void cpu_pool_run(cpu_pool *pool, cpu_job_fn fn, void *arg) {
    if (pool->n == 1) {
        fn(arg, 0, 1);
        return;
    }
    pool->fn = fn;
    pool->arg = arg;
    /* seq_cst: publishes fn/arg, ordered before the sleepers read */
    uint32_t g = atomic_fetch_add(&pool->gen, 1) + 1;
    if (atomic_load(&pool->sleepers) > 0) cpu_futex_wake(&pool->gen);
    fn(arg, 0, pool->n);
    /* Close the job, then wait for the workers inside it. A worker either sees
     * the close and skips, or has raised `active` before our read (seq_cst). */
    atomic_store(&pool->closed, g);
    uint32_t a;
    int spins = 0;
    while ((a = atomic_load(&pool->active)) != 0) {
        if (++spins < CPU_POOL_SPIN) {
            cpu_pause();
            continue;
        }
        atomic_store(&pool->main_waiting, 1);
        if (atomic_load(&pool->active) != 0) cpu_futex_wait(&pool->active, a);
        atomic_store(&pool->main_waiting, 0);
        spins = 0;
    }
}
