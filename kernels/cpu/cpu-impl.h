/* cpu-impl.h -- internals of the CPU backend: thread pool, per-ISA kernel tables, GEMM blocking. */
#ifndef FU_CPU_IMPL_H
#define FU_CPU_IMPL_H

#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#include "ops-impl.h"

/* ---- matmul blocking ---------------------------------------------------------
 *
 * Decode (T <= CPU_DECODE_MAX_T): each thread takes a contiguous range of
 * weight rows and streams them once; for each row the kernel dots it with up to
 * CPU_MV_T tokens at a time (further tokens re-read the row from L1).
 *
 * Prefill (larger T): the activations are first transposed into xT blocks of
 * CPU_TB tokens, xt[tb][k][j] = x[tb*CPU_TB + j][k] (zero past T). Each thread
 * owns a range of weight panels of `nr` rows; for every CPU_TC tokens, panel
 * and CPU_KC slice of K it dequantizes the panel slice to f32 once
 * (nr x CPU_KC, in L1) and reuses it for all CPU_TC / CPU_TB token blocks with
 * a register-blocked FMA micro-kernel that keeps tokens in vector lanes.
 */
#define CPU_DECODE_MAX_T 4
#define CPU_MV_T 4    /* tokens per pass of a matvec kernel */
#define CPU_TB 32     /* tokens per xT block (lanes of the micro-kernel) */
#define CPU_TC 256    /* tokens per outer GEMM block (multiple of CPU_TB) */
#define CPU_KC 512    /* K per GEMM slice (multiple of OP_QK) */
#define CPU_NR_MAX 16 /* largest micro-kernel panel over all ISAs */

/* Largest head_dim op_attention accepts (its accumulators live on the stack). */
#define CPU_ATTN_MAX_HD 1024
/* Positions scored per chunk of the attention kernel (online softmax). */
#define CPU_ATTN_CHUNK 64

/* One matmul, as the kernels see it. */
typedef struct cpu_mm {
    op_type type;
    const uint8_t *w;       /* (N, K) weight rows of `type` */
    size_t w_stride;        /* bytes between weight rows */
    const float *row_scale; /* (N) for OP_TYPE_I8, else NULL */
    int64_t n, k, t;        /* outputs, inputs, tokens */
    const float *x;         /* (T, K) activations */
    size_t ldx;             /* floats between rows of x */
    float *y;               /* (T, N) outputs */
    size_t ldy;             /* floats between rows of y */
    const float *xt;        /* (ceil(T/CPU_TB), K, CPU_TB) transposed activations (prefill) */
} cpu_mm;

/* Decode kernel: y[t][r] = W[r] . x[t] for r in [r0, r1) and every t < m->t. */
typedef void (*cpu_matvec_fn)(const cpu_mm *m, int64_t r0, int64_t r1);

/* Dequantizes elements [k0, k0 + n) of one weight row (k0 and n multiples of
 * OP_QK for block types) into out (n floats); scale is the row scale (I8) or 1. */
typedef void (*cpu_dequant_fn)(const uint8_t *row, int64_t k0, int64_t n, float scale, float *out);

/* GEMM micro-kernel: c[j][i] (+)= sum_k wf[j * ldw + k] * xt[k * CPU_TB + i]
 * for j < nr (the table's panel height), i < CPU_TB, k < kc.
 * wf: (nr, kc) f32 panel slice; xt: (kc, CPU_TB) transposed activations;
 * c: (nr, CPU_TB), overwritten when accumulate is 0. */
typedef void (*cpu_gemm_fn)(const float *wf, int64_t ldw, const float *xt, int64_t kc, float *c,
                            int accumulate);

/* Attention: s[j] = scale * q . K[j] for j < n, K rows of hd elements of type
 * kt (F32 or F16) at `stride` bytes. */
typedef void (*cpu_scores_fn)(const float *q, const uint8_t *k, op_type kt, size_t stride, int n,
                              int hd, float scale, float *s);
/* Attention: acc[d] += sum_j p[j] * V[j][d] for j < n. */
typedef void (*cpu_accum_fn)(const float *p, const uint8_t *v, op_type vt, size_t stride, int n,
                             int hd, float *acc);

/* Row conversion f32 -> f16 (kv_store). */
typedef void (*cpu_to_f16_fn)(const float *x, uint16_t *y, int64_t n);

typedef struct cpu_kernels {
    const char *name;                     /* "portable", "avx2", "avx512" */
    int nr;                               /* panel height of gemm (<= CPU_NR_MAX) */
    cpu_matvec_fn matvec[OP_TYPE_COUNT];  /* NULL for non-weight types */
    cpu_dequant_fn dequant[OP_TYPE_COUNT];
    cpu_gemm_fn gemm;
    cpu_scores_fn scores;
    cpu_accum_fn accum;
    cpu_to_f16_fn to_f16;
} cpu_kernels;

extern const cpu_kernels cpu_kernels_portable;
extern const cpu_kernels cpu_kernels_avx2;
extern const cpu_kernels cpu_kernels_avx512;

/* Portable pieces the SIMD tables reuse. */
void cpu_portable_dequant_any(op_type type, const uint8_t *row, int64_t k0, int64_t n,
                              float scale, float *out);
void cpu_portable_matvec_tail(const cpu_mm *m, int64_t r, int64_t k0, int t0, int nt, float *sums);

/* ---- thread pool --------------------------------------------------------- */

/* A job runs fn(arg, ith, nth) on every thread, ith in [0, nth). */
typedef void (*cpu_job_fn)(void *arg, int ith, int nth);

typedef struct cpu_pool cpu_pool;

/* Starts n_threads - 1 workers (the caller is thread 0). NULL on failure. */
cpu_pool *cpu_pool_new(int n_threads);
/* Joins the workers; NULL is a no-op. */
void cpu_pool_free(cpu_pool *pool);
/* Runs fn on all threads and returns when every one has finished (fork-join). */
void cpu_pool_run(cpu_pool *pool, cpu_job_fn fn, void *arg);

#endif
