/* emu.c -- the CPU emulator of CUDA grids (see emu.h): host threads as CUDA threads, timed barriers. */
#include "emu.h"

#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "clock.h"
#include "status.h"

#define EMU_MAX_THREADS 1024
#define EMU_MAX_SMEM (48 * 1024)
#define EMU_BARRIER_TIMEOUT_S 20 /* a barrier not reached by all threads by then is a bug */
#define EMU_STACK_BYTES (512 * 1024)

typedef enum emu_err {
    EMU_ERR_NONE = 0,
    EMU_ERR_BARRIER_IN_PLAIN, /* a CU_KERNEL (barrier-free) kernel used a barrier */
    EMU_ERR_DIVERGENT,        /* a barrier timed out: some thread never reached it */
    EMU_ERR_PARTIAL_WARP,     /* a warp exchange in a warp of fewer than 32 threads */
} emu_err;

/* A reusable barrier that gives up (and stays broken) after a timeout instead
 * of hanging the test. */
typedef struct emu_barrier {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    unsigned count, waiting, gen;
    int broken;
} emu_barrier;

struct cu_emu_launch {
    const cu_emu_kernel *k;
    const void *args;
    cu_dim3 grid, block;
    unsigned nthreads;
    unsigned char *smem;
    size_t smem_bytes;
    int seq;               /* 1: threads run one after the other (no barriers allowed) */
    emu_barrier block_bar; /* all threads of the block */
    emu_barrier *warp_bar; /* (nwarps) */
    float *slots;          /* (nthreads, CU_EMU_SLOTS) exchange slots */
    atomic_int err;        /* first emu_err seen */
};

static void emu_fail(struct cu_emu_launch *l, emu_err e) {
    int none = EMU_ERR_NONE;
    atomic_compare_exchange_strong(&l->err, &none, (int)e);
}

static int emu_barrier_init(emu_barrier *b, unsigned count) {
    memset(b, 0, sizeof *b);
    b->count = count;
    pthread_condattr_t ca;
    if (pthread_condattr_init(&ca)) return -1;
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    int rc = pthread_cond_init(&b->cv, &ca);
    pthread_condattr_destroy(&ca);
    if (rc) return -1;
    if (pthread_mutex_init(&b->mu, NULL)) {
        pthread_cond_destroy(&b->cv);
        return -1;
    }
    return 0;
}

static void emu_barrier_destroy(emu_barrier *b) {
    pthread_cond_destroy(&b->cv);
    pthread_mutex_destroy(&b->mu);
}

/* Waits until `count` threads arrived. Returns 0, or -1 if the barrier timed
 * out now or earlier (then every later wait returns -1 at once). */
static int emu_barrier_wait(emu_barrier *b) {
    pthread_mutex_lock(&b->mu);
    if (b->broken) {
        pthread_mutex_unlock(&b->mu);
        return -1;
    }
    unsigned gen = b->gen;
    if (++b->waiting == b->count) {
        b->waiting = 0;
        b->gen++;
        pthread_cond_broadcast(&b->cv);
        pthread_mutex_unlock(&b->mu);
        return 0;
    }
    struct timespec dl = fu_deadline_us(CLOCK_MONOTONIC, (int64_t)EMU_BARRIER_TIMEOUT_S * 1000000);
    int rc = 0;
    while (gen == b->gen && !b->broken) {
        if (pthread_cond_timedwait(&b->cv, &b->mu, &dl) == ETIMEDOUT && gen == b->gen) {
            b->broken = 1;
            pthread_cond_broadcast(&b->cv);
        }
    }
    if (gen == b->gen) rc = -1; /* released by breakage, not by the last arrival */
    pthread_mutex_unlock(&b->mu);
    return rc;
}

static unsigned emu_tid(const cu_ctx *c) { return c->thread_idx.x + c->block_dim.x * (c->thread_idx.y + c->block_dim.y * c->thread_idx.z); }

void cu_emu_syncthreads(const cu_ctx *c) {
    struct cu_emu_launch *l = c->emu;
    if (l->seq) {
        emu_fail(l, EMU_ERR_BARRIER_IN_PLAIN);
        return;
    }
    if (emu_barrier_wait(&l->block_bar)) emu_fail(l, EMU_ERR_DIVERGENT);
}

/* The warp of the calling thread: its barrier, first thread and size. */
static emu_barrier *emu_warp(const cu_ctx *c, unsigned *base, unsigned *size) {
    struct cu_emu_launch *l = c->emu;
    unsigned tid = emu_tid(c);
    *base = tid / 32 * 32;
    *size = l->nthreads - *base < 32 ? l->nthreads - *base : 32;
    return &l->warp_bar[tid / 32];
}

void cu_emu_syncwarp(const cu_ctx *c) {
    struct cu_emu_launch *l = c->emu;
    if (l->seq) {
        emu_fail(l, EMU_ERR_BARRIER_IN_PLAIN);
        return;
    }
    unsigned base, size;
    if (emu_barrier_wait(emu_warp(c, &base, &size))) emu_fail(l, EMU_ERR_DIVERGENT);
}

float cu_emu_shfl_xor(const cu_ctx *c, float v, int mask) {
    struct cu_emu_launch *l = c->emu;
    if (l->seq) {
        emu_fail(l, EMU_ERR_BARRIER_IN_PLAIN);
        return v;
    }
    unsigned base, size, tid = emu_tid(c);
    emu_barrier *wb = emu_warp(c, &base, &size);
    if (size != 32) {
        emu_fail(l, EMU_ERR_PARTIAL_WARP);
        return v;
    }
    l->slots[(size_t)tid * CU_EMU_SLOTS] = v;
    if (emu_barrier_wait(wb)) emu_fail(l, EMU_ERR_DIVERGENT);
    float r = l->slots[(size_t)(base + ((tid - base) ^ ((unsigned)mask & 31))) * CU_EMU_SLOTS];
    if (emu_barrier_wait(wb)) emu_fail(l, EMU_ERR_DIVERGENT);
    return r;
}

void cu_emu_warp_reduce(const cu_ctx *c, float *v, int n, cu_emu_reduce_op op) {
    struct cu_emu_launch *l = c->emu;
    if (l->seq) {
        emu_fail(l, EMU_ERR_BARRIER_IN_PLAIN);
        return;
    }
    unsigned base, size, tid = emu_tid(c);
    emu_barrier *wb = emu_warp(c, &base, &size);
    if (size != 32 || n > CU_EMU_SLOTS) {
        emu_fail(l, EMU_ERR_PARTIAL_WARP);
        return;
    }
    for (int i = 0; i < n; i++) l->slots[(size_t)tid * CU_EMU_SLOTS + i] = v[i];
    if (emu_barrier_wait(wb)) emu_fail(l, EMU_ERR_DIVERGENT);
    for (int i = 0; i < n; i++) {
        float a[32], b[32];
        for (int j = 0; j < 32; j++) a[j] = l->slots[(size_t)(base + j) * CU_EMU_SLOTS + i];
        for (int m = 16; m > 0; m >>= 1) {
            for (int j = 0; j < 32; j++) b[j] = op == CU_EMU_REDUCE_SUM ? a[j] + a[j ^ m] : fmaxf(a[j], a[j ^ m]);
            memcpy(a, b, sizeof a);
        }
        v[i] = a[tid - base];
    }
    if (emu_barrier_wait(wb)) emu_fail(l, EMU_ERR_DIVERGENT);
}

/* The context of thread `tid` in block number `b` (x fastest). */
static void emu_ctx(struct cu_emu_launch *l, uint64_t b, unsigned tid, cu_ctx *c) {
    memset(c, 0, sizeof *c);
    c->grid_dim = l->grid;
    c->block_dim = l->block;
    c->block_idx.x = (unsigned)(b % l->grid.x);
    c->block_idx.y = (unsigned)(b / l->grid.x % l->grid.y);
    c->block_idx.z = (unsigned)(b / l->grid.x / l->grid.y);
    c->thread_idx.x = tid % l->block.x;
    c->thread_idx.y = tid / l->block.x % l->block.y;
    c->thread_idx.z = tid / l->block.x / l->block.y;
    c->smem = l->smem;
    c->emu = l;
}

static uint64_t emu_nblocks(const struct cu_emu_launch *l) {
    return (uint64_t)l->grid.x * l->grid.y * l->grid.z;
}

typedef struct emu_thread {
    struct cu_emu_launch *l;
    unsigned tid;
    pthread_t th;
} emu_thread;

/* One emulated CUDA thread: its body in every block, in grid order. Thread 0
 * refills shared memory between blocks while the others wait. */
static void *emu_thread_main(void *arg) {
    emu_thread *t = arg;
    struct cu_emu_launch *l = t->l;
    const uint64_t nb = emu_nblocks(l);
    for (uint64_t b = 0; b < nb; b++) {
        if (t->tid == 0 && l->smem_bytes) memset(l->smem, 0xff, l->smem_bytes);
        if (emu_barrier_wait(&l->block_bar)) emu_fail(l, EMU_ERR_DIVERGENT);
        cu_ctx c;
        emu_ctx(l, b, t->tid, &c);
        l->k->fn(&c, l->args);
        if (emu_barrier_wait(&l->block_bar)) emu_fail(l, EMU_ERR_DIVERGENT);
    }
    return NULL;
}

static int emu_run_threads(struct cu_emu_launch *l) {
    unsigned nwarps = (l->nthreads + 31) / 32, nbar = 0;
    int rc = FU_OK;
    emu_thread *ts = calloc(l->nthreads, sizeof *ts);
    l->warp_bar = calloc(nwarps, sizeof *l->warp_bar);
    l->slots = calloc((size_t)l->nthreads * CU_EMU_SLOTS, sizeof(float));
    if (!ts || !l->warp_bar || !l->slots) {
        rc = fu_errorf(FU_ERR_NOMEM, "cuda emulator: out of memory");
        goto out;
    }
    if (emu_barrier_init(&l->block_bar, l->nthreads)) {
        rc = fu_errorf(FU_ERR_INTERNAL, "cuda emulator: cannot make a barrier");
        goto out;
    }
    for (; nbar < nwarps; nbar++) {
        unsigned size = l->nthreads - nbar * 32 < 32 ? l->nthreads - nbar * 32 : 32;
        if (emu_barrier_init(&l->warp_bar[nbar], size)) {
            rc = fu_errorf(FU_ERR_INTERNAL, "cuda emulator: cannot make a barrier");
            goto out_bar;
        }
    }
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setstacksize(&attr, EMU_STACK_BYTES);
    unsigned started = 0;
    for (; started < l->nthreads; started++) {
        ts[started].l = l;
        ts[started].tid = started;
        if (pthread_create(&ts[started].th, &attr, emu_thread_main, &ts[started])) break;
    }
    pthread_attr_destroy(&attr);
    if (started < l->nthreads) {
        /* the started threads time out at their first barrier */
        rc = fu_errorf(FU_ERR_INTERNAL, "cuda emulator: cannot start %u threads", l->nthreads);
    }
    for (unsigned i = 0; i < started; i++) pthread_join(ts[i].th, NULL);
out_bar:
    for (unsigned i = 0; i < nbar; i++) emu_barrier_destroy(&l->warp_bar[i]);
    emu_barrier_destroy(&l->block_bar);
out:
    free(ts);
    free(l->warp_bar);
    free(l->slots);
    return rc;
}

int cu_emu_launch(const cu_emu_kernel *k, cu_dim3 grid, cu_dim3 block, size_t smem, const void *args,
                  const char *file, int line) {
    struct cu_emu_launch l;
    memset(&l, 0, sizeof l);
    l.k = k;
    l.args = args;
    l.grid = grid;
    l.block = block;
    uint64_t nthreads = (uint64_t)block.x * block.y * block.z;
    if (nthreads == 0 || nthreads > EMU_MAX_THREADS || block.z > 64 || grid.x == 0 || grid.y == 0 ||
        grid.z == 0 || grid.x > 0x7fffffffu || grid.y > 65535 || grid.z > 65535)
        return fu_errorf(FU_ERR_INVALID, "%s:%d: launch of %s: bad configuration grid (%u, %u, %u) block (%u, %u, %u)",
                         file, line, k->name, grid.x, grid.y, grid.z, block.x, block.y, block.z);
    if (smem > EMU_MAX_SMEM)
        return fu_errorf(FU_ERR_INVALID, "%s:%d: launch of %s: %zu bytes of shared memory", file, line,
                         k->name, smem);
    l.nthreads = (unsigned)nthreads;
    l.smem_bytes = smem;
    l.smem = smem ? aligned_alloc(16, (smem + 15) / 16 * 16) : NULL;
    if (smem && !l.smem) return fu_errorf(FU_ERR_NOMEM, "cuda emulator: out of memory");
    atomic_init(&l.err, EMU_ERR_NONE);
    int rc = FU_OK;
    if (!k->sync) {
        l.seq = 1;
        const uint64_t nb = emu_nblocks(&l);
        for (uint64_t b = 0; b < nb; b++) {
            if (smem) memset(l.smem, 0xff, smem);
            for (unsigned tid = 0; tid < l.nthreads; tid++) {
                cu_ctx c;
                emu_ctx(&l, b, tid, &c);
                k->fn(&c, args);
            }
        }
    } else {
        rc = emu_run_threads(&l);
    }
    free(l.smem);
    if (rc) return rc;
    switch ((emu_err)atomic_load(&l.err)) {
    case EMU_ERR_NONE:
        return FU_OK;
    case EMU_ERR_BARRIER_IN_PLAIN:
        return fu_errorf(FU_ERR_INTERNAL, "%s:%d: kernel %s used a barrier but is declared barrier-free",
                         file, line, k->name);
    case EMU_ERR_DIVERGENT:
        return fu_errorf(FU_ERR_INTERNAL, "%s:%d: kernel %s: a barrier was not reached by every thread",
                         file, line, k->name);
    case EMU_ERR_PARTIAL_WARP:
        return fu_errorf(FU_ERR_INTERNAL, "%s:%d: kernel %s: warp exchange in a partial warp", file,
                         line, k->name);
    }
    return fu_errorf(FU_ERR_INTERNAL, "%s:%d: kernel %s failed", file, line, k->name);
}
