/* cpu-impl.h -- internals of the CPU backend: thread pool, per-ISA kernel tables, GEMM blocking.
 *
 * One op runs at a time (ops.c holds the backend's lock); it splits its work
 * into ranges that the pool's workers and the calling thread run at once, each
 * writing disjoint outputs. The backend owns its pool and scratch.
 */
#ifndef FU_CPU_IMPL_H
#define FU_CPU_IMPL_H

#include <math.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "ops-impl.h"

/* ---- matmul blocking ---------------------------------------------------------
 *
 * Decode (T <= CPU_DECODE_MAX_T; for the block types CPU_DECODE_NARROW_T
 * where the ISA has a narrow GEMM kernel, which is faster from there on unless
 * the opt-in integer path applies): threads take chunks of consecutive weight
 * rows and stream them once; for each row the kernel dots it with up to
 * CPU_MV_T tokens at a time (further tokens re-read the row from L1; the
 * AVX-512 kernel instead takes 6..8 tokens at once over 3 rows, so that the
 * activations, which no longer fit L1, are loaded once per 3 rows). The
 * block types (Q8_0/Q4_0/Q4_1, and I8) have their own SIMD matvecs: each
 * 32-weight block is dequantized exactly in registers (the same f32 values as
 * op_dequantize_row) and FMA'd with the f32 activations of up to
 * CPU_QMV_T tokens, over a few rows at a time (cpu-avx512.c; the AVX2 and
 * portable tables use their generic matvec, also f32). On AVX-512,
 * op_weight_prepare repacks F16/BF16/Q8_0/Q4_0/Q4_1 into the interleaved _R16
 * layouts (the block types' exact kernels then serve only matrices whose rows
 * are not a multiple of 16, and weights used as they are), whose matvec keeps
 * 16 rows in the lanes of a vector and takes every matmul of those types,
 * prefill included: a token's result then has the same bits whatever else
 * shares its batch, so that a session replayed on another server after a
 * failure rebuilds exactly the KV cache it had (the other paths run those
 * layouts only through cpu_portable_dequant, for correctness).
 *
 * Prefill and batched decode (larger T): the activations are first transposed
 * into xT blocks of tb tokens, xt[b][k][j] = x[b*tb + j][k] (zero past T).
 * Threads take (CPU_TC tokens, up to CPU_PG panels of `nr` rows) units; for
 * each panel and slice of K the panel slice is dequantized to f32 once (nr x
 * kc, in L1) and reused for all token blocks of the unit by a
 * register-blocked FMA micro-kernel that keeps tokens in vector lanes.
 * tb is CPU_TB (32 lanes); where the ISA has a narrow micro-kernel (gemm16)
 * and T % 32 is 1..16 (e.g. 9..16 sessions decoding together), tb is
 * CPU_TB16 so that no more than 15 lanes of the last block are idle: that
 * kernel covers a taller panel (nr16 rows) with one vector of tokens per row,
 * over K slices of CPU_KC16 so that the panel slice still fits L1. Each
 * panel slice then serves only one or two token blocks, so units hold fewer
 * panels (both threads get work on small N), and the micro-kernel prefetches
 * the weights of the next panel slice (into L2) while it computes, so that
 * the dequantization of that slice does not wait on memory.
 */
#define CPU_DECODE_MAX_T 8    /* largest T that takes the matvec path */
#define CPU_DECODE_NARROW_T 6 /* the same for block types with a narrow GEMM kernel (gemm16) */
#define CPU_DECODE_R16_T INT64_MAX /* the same for the interleaved types on AVX-512: every T */
#define CPU_PF_DIST 4096      /* bytes a matvec prefetches ahead of the weight it reads */
#define CPU_MV_T 4    /* tokens per pass of a matvec kernel */
#define CPU_QMV_T 8   /* tokens per pass of a block-type matvec kernel */
#define CPU_TB 32     /* tokens per xT block (lanes of the micro-kernel) */
#define CPU_TB16 16   /* tokens per xT block of the narrow micro-kernel (gemm16) */
#define CPU_KC16 256  /* K per GEMM slice with the narrow micro-kernel (multiple of OP_QK) */
#define CPU_TC 256    /* tokens per outer GEMM block (multiple of CPU_TB) */
#define CPU_KC 512    /* K per GEMM slice (multiple of OP_QK) */
#define CPU_NR_MAX 24 /* largest micro-kernel panel over all ISAs (nr and nr16) */
#define CPU_PG 8      /* panels whose partial sums a thread keeps at a time */
/* Floats between panel rows: CPU_KC plus a pad so that the rows do not all
 * fall into the same few L1 sets. */
#define CPU_WF_LD (CPU_KC + 16)

/* Elements below which an element-wise op runs on the calling thread only
 * (a fork-join costs a few microseconds). */
#define CPU_SERIAL_ELEMS 32768

/* Largest head_dim op_attention accepts (its accumulators live on the stack). */
#define CPU_ATTN_MAX_HD 1024
/* Positions scored per chunk of the attention kernel (online softmax). */
#define CPU_ATTN_CHUNK 64
/* Query heads an attention task takes at most: they read each K and V row once. */
#define CPU_ATTN_GROUP 4

/* Integer decode path, only with op_cpu_options.quantized_activations (Q8_0/
 * Q4_0/Q4_1 weights, K % 64 == 0, AVX2 maddubs or AVX-512 VNNI): each token row is quantized to int8 per 32-block
 * (d = amax / 127, q = rint(x / d)) and laid out per pair of blocks as 64 int8
 * values plus per-block scales and sums, CPU_XQ_PAIR bytes per 64 inputs (the
 * layouts: cpu_quant_x_natural below, cpu_avx512_quant_x_q4 in cpu-avx512.c). Results then match the f32 computation over the rounded x. */
#define CPU_XQ_PAIR 192
#define CPU_XQ_BYTES(k) ((size_t)((k) / 64) * CPU_XQ_PAIR)

/* Activations of the interleaved Q8_0 / Q4 matvecs (Q8_0_R16, Q4_0_R16,
 * Q4_1_R16 on AVX-512), one per block of 32 inputs of a token: x rounded to
 * integers q = rint(x / d), d = amax / CPU_XW_QMAX, each stored as two signed
 * bytes, q = 256 hi + lo (hence the bound 127 * 256 + 127), so that the
 * kernels multiply 16 rows' weights by 4 bytes per instruction (vpdpbusd)
 * with exact integer sums; see cpu_avx512_mv_r16 and cpu_avx512_mv_r16q8. The
 * rounding error is at most d/2 per input, 1/65278 of the block's largest |x|,
 * and a token's values do not depend on the others in its batch. */
#define CPU_XW_QMAX 32639
typedef struct cpu_xw_block {
    int32_t q4[16]; /* word 4c + h, byte i: the low (h = 0, 1) or high (h = 2, 3) byte of
                       q[8c + 2i + (h & 1)], c, i < 4 (the Q4 layout's order) */
    int32_t q8[16]; /* word 2 (2c + i) + h, byte j: the low (h = 0) or high (h = 1) byte of
                       q[8c + 2i + {0, 1, 4, 5}[j]], c < 4, i < 2 (Q8_0_R16's order) */
    float d;        /* amax / CPU_XW_QMAX (0 for a block of zeros) */
    int32_t off;    /* -8 * sum(q): Q4_0's offset, folded into the integer sum (16 x for Q8_0's) */
    float s;        /* sum of the block's x: Q4_1's minimum term */
    int32_t pad;
} cpu_xw_block;

/* One matmul, as the kernels see it. */
typedef struct cpu_mm {
    op_type type;
    const uint8_t *w;       /* (N, K) weight rows of `type` */
    size_t w_stride;        /* bytes between weight rows */
    const float *row_scale; /* (N) for OP_TYPE_I8, else NULL */
    int64_t n, k, t;        /* outputs, inputs, tokens */
    const float *x;         /* (T, K) activations */
    size_t ldx;             /* floats between rows of x */
    size_t ldk;             /* floats between inputs of a row of x (1; the GEMM path reads any) */
    float *y;               /* (T, N) outputs */
    size_t ldy;             /* floats between rows of y */
    float beta, scale;      /* GEMM path: y = beta * y + scale * (x @ W^T), y not read when
                               beta is 0 (0 and 1 for op_matmul) */
    bool back;              /* GEMM path: W holds the transpose, (K, N) rows of `type`, so
                               that y = x @ W (op_matmul_back, op_outer_acc; see cpu_back_fill) */
    int tb;                 /* tokens per xT block: CPU_TB or CPU_TB16 (prefill) */
    const float *xt;        /* (ceil(T/tb), K, tb) transposed activations (prefill) */
    const uint8_t *xq;      /* (T, CPU_XQ_BYTES(K)) quantized activations (decode, opt-in),
                               or NULL: f32 activations */
    const cpu_xw_block *xw; /* (T, K / 32) int16 activations for the Q8_0_R16 / Q4_0_R16 /
                               Q4_1_R16 matvec of kernels that have quant_xw, else NULL */
} cpu_mm;

/* Decode kernel: y[t][r] = W[r] . x[t] for r in [r0, r1) and every t < m->t. */
typedef void (*cpu_matvec_fn)(const cpu_mm *m, int64_t r0, int64_t r1);

/* Dequantizes elements [k0, k0 + n) of row r of the weights at w (k0 and n
 * multiples of OP_QK for block types) into out (n floats); rows are `stride`
 * bytes apart (nb[1]; for the interleaved types, the average, see ops.h);
 * scale is the row scale (I8) or 1. */
typedef void (*cpu_dequant_fn)(const uint8_t *w, size_t stride, int64_t r, int64_t k0, int64_t n, float scale,
                               float *out);

/* Weight bytes a GEMM micro-kernel prefetches (into L2) while it computes:
 * `lines` 64-byte lines of each of `rows` rows, `stride` bytes apart from
 * `at`, one line per k step, so that the misses of the next panel slice
 * overlap with the FMAs instead of stalling its dequantization. */
typedef struct cpu_gemm_pf {
    const uint8_t *at;
    size_t stride;
    int rows, lines; /* rows 0: nothing to prefetch */
} cpu_gemm_pf;

/* GEMM micro-kernel: c[j][i] (+)= sum_k wf[j * ldw + k] * xt[k * tb + i]
 * for j < nr, i < tb, k < kc, where (nr, tb) is (the table's nr, CPU_TB) for
 * gemm and (nr16, CPU_TB16) for gemm16. ldw is CPU_WF_LD.
 * wf: (nr, kc) f32 panel slice; xt: (kc, tb) transposed activations;
 * c: (nr, tb), overwritten when accumulate is 0; pf: see cpu_gemm_pf (the
 * kernel may ignore it). */
typedef void (*cpu_gemm_fn)(const float *wf, int64_t ldw, const float *xt, int64_t kc, float *c,
                            int accumulate, const cpu_gemm_pf *pf);

/* Attention for nh (1..CPU_ATTN_GROUP) query heads that share a KV head, each
 * head's results independent of nh: s[h * CPU_ATTN_CHUNK + j] = scale *
 * q[h * ldq ..] . K[j] for h < nh, j < n (<= CPU_ATTN_CHUNK), K rows of hd
 * elements of type kt (F32 or F16) at `stride` bytes. */
typedef void (*cpu_scores_fn)(const float *q, size_t ldq, int nh, const uint8_t *k, op_type kt, size_t stride,
                              int n, int hd, float scale, float *s);
/* acc[h * hd + d] += sum_j p[h * CPU_ATTN_CHUNK + j] * V[j][d] for h < nh, j < n. */
typedef void (*cpu_accum_fn)(const float *p, int nh, const uint8_t *v, op_type vt, size_t stride, int n, int hd,
                             float *acc);

/* Row conversion f32 -> f16 (kv_store). */
typedef void (*cpu_to_f16_fn)(const float *x, uint16_t *y, int64_t n);

/* Attention's softmax step: s[j] = exp(s[j] - m) for j < n; returns their sum. */
typedef float (*cpu_exp_sum_fn)(float *s, int n, float m);

/* Row kernels: out[i] = silu(g[i]) * u[i] = g[i] / (1 + exp(-g[i])) * u[i]
 * (out may be g); and sum(x[i]^2) in double, for RMSNorm. */
typedef void (*cpu_swiglu_fn)(const float *g, const float *u, float *out, int64_t n);
typedef double (*cpu_sumsq_fn)(const float *x, int64_t n);

/* Quantizes one activation row x (k floats, k % 64 == 0) into CPU_XQ_BYTES(k)
 * bytes at dst, in the layout the `type` matvec kernel reads. */
typedef void (*cpu_quant_x_fn)(const float *x, int64_t k, uint8_t *dst);

/* Rounds one activation row x (k floats, k % 32 == 0) into k / 32 blocks at dst. */
typedef void (*cpu_quant_xw_fn)(const float *x, int64_t k, cpu_xw_block *dst);

typedef struct cpu_kernels {
    const char *name;                     /* "portable", "avx2", "avx512" */
    int nr;                               /* panel height of gemm (<= CPU_NR_MAX) */
    int nr16;                             /* panel height of gemm16 (<= CPU_NR_MAX) */
    cpu_matvec_fn matvec[OP_TYPE_COUNT];  /* NULL for non-weight types */
    cpu_dequant_fn dequant[OP_TYPE_COUNT];
    cpu_gemm_fn gemm;
    cpu_gemm_fn gemm16;                   /* narrow micro-kernel (CPU_TB16 tokens), or NULL */
    cpu_scores_fn scores;
    cpu_accum_fn accum;
    cpu_to_f16_fn to_f16;
    cpu_exp_sum_fn exp_sum;
    cpu_swiglu_fn swiglu;
    cpu_sumsq_fn sumsq;
    cpu_quant_x_fn quant_x[OP_TYPE_COUNT]; /* opt-in integer decode path (quantized_activations);
                                              NULL: the type has none */
    cpu_quant_xw_fn quant_xw;              /* int16 activations of the Q8_0 / Q4 _R16 matvecs, or NULL:
                                              those matvecs take f32 activations */
} cpu_kernels;

extern const cpu_kernels cpu_kernels_portable;
extern const cpu_kernels cpu_kernels_avx2;
extern const cpu_kernels cpu_kernels_avx512;

/* Portable pieces the SIMD tables reuse. */
void cpu_portable_dequant_any(op_type type, const uint8_t *row, int64_t k0, int64_t n,
                              float scale, float *out);
void cpu_portable_matvec_tail(const cpu_mm *m, int64_t r, int64_t k0, int t0, int nt, float *sums);
/* Any weight type, interleaved ones included: row r of w (see cpu_dequant_fn). */
void cpu_portable_dequant(op_type type, const uint8_t *w, size_t stride, int64_t r, int64_t k0, int64_t n,
                          float scale, float *out);
/* The interleaved types' dequant (see cpu_dequant_fn), through op_r16_dequant. */
void cpu_portable_dequant_q4_0_r16(const uint8_t *w, size_t stride, int64_t r, int64_t k0, int64_t n,
                                   float scale, float *out);
void cpu_portable_dequant_q4_1_r16(const uint8_t *w, size_t stride, int64_t r, int64_t k0, int64_t n,
                                   float scale, float *out);
void cpu_portable_dequant_f16_r16(const uint8_t *w, size_t stride, int64_t r, int64_t k0, int64_t n,
                                  float scale, float *out);
void cpu_portable_dequant_bf16_r16(const uint8_t *w, size_t stride, int64_t r, int64_t k0, int64_t n,
                                   float scale, float *out);
void cpu_portable_dequant_q8_0_r16(const uint8_t *w, size_t stride, int64_t r, int64_t k0, int64_t n,
                                   float scale, float *out);
/* expf one element at a time (see cpu_exp_sum_fn, cpu_swiglu_fn, cpu_sumsq_fn). */
float cpu_portable_exp_sum(float *s, int n, float m);
void cpu_portable_swiglu(const float *g, const float *u, float *out, int64_t n);
double cpu_portable_sumsq(const float *x, int64_t n);
/* The generic matvec (any weight type, f32 math over cpu_portable_dequant). */
void cpu_portable_matvec(const cpu_mm *m, int64_t r0, int64_t r1);

/* ---- the backend ------------------------------------------------------------ */

typedef struct cpu_backend {
    op_backend base;
    const cpu_kernels *kern; /* kernels of the ISA in use */
    bool quant_x;            /* op_cpu_options.quantized_activations: int8 decode activations */
    struct cpu_pool *pool;
    float *xt;       /* transposed activations for prefill matmuls */
    size_t xt_cap;   /* bytes in xt */
    uint8_t *xq;     /* quantized activations for integer decode matvecs */
    size_t xq_cap;   /* bytes in xq */
    cpu_xw_block *xw; /* int16 activations of the Q8_0 / Q4 _R16 matvecs (kern->quant_xw) */
    size_t xw_cap;    /* bytes in xw */
    float *wf;       /* (n_threads, CPU_NR_MAX, CPU_WF_LD) dequantized weight panels */
    float *wfg;      /* (n_threads, CPU_PG * CPU_NR_MAX, CPU_WF_LD) a panel group of a transposed
                        weight (cpu_back_fill), grown by the first op that needs it */
    size_t wfg_cap;  /* bytes in wfg */
    float *cbuf;     /* (n_threads, CPU_PG, CPU_NR_MAX, CPU_TC) partial sums of panel groups */
} cpu_backend;

static inline cpu_backend *cpu_be(op_backend *be) { return (cpu_backend *)be; }

static inline bool cpu_f32_contig(const op_tensor *t) {
    return t->type == OP_TYPE_F32 && t->data && op_tensor_is_contiguous(t);
}

/* Checks that W (any weight type) can be read row by row by the kernels:
 * 2-D, rows contiguous, K a multiple of OP_QK for block types, row scales for
 * I8, an interleaved one contiguous with rows a multiple of 16. FU_OK or
 * FU_ERR_INVALID naming `op`. */
int cpu_weight_check(const op_tensor *w, const char *op);

/* The GEMM path of m (t, n, k > 0; m->x, ldx, ldk, y, ldy, beta, scale, back
 * set): transposes x into the backend's xt scratch (grown once) and runs the
 * micro-kernels over the pool. */
int cpu_gemm_run(cpu_backend *c, const cpu_mm *m);

/* The GEMM panels of a transposed weight (m->back), nr <= CPU_PG * CPU_NR_MAX
 * rows (a whole panel group): wf[j * CPU_WF_LD + kk] = W[k0 + kk][n0 + j]
 * (zero for j in [nv, nr)), W (m->k, m->n) of m->type, for kk < kc. Each W
 * row's 32-aligned window of columns covering the panels is dequantized on
 * the stack, then scattered. */
void cpu_back_fill(const cpu_mm *m, const cpu_kernels *kern, int64_t n0, int64_t nv, int nr, int64_t k0,
                   int64_t kc, float *wf);

/* The training ops (cpu-train.c); see ops.h. */
int cpu_matmul_back(op_backend *be, const op_tensor *w, const op_tensor *dy, op_tensor *dx, float beta);
int cpu_outer_acc(op_backend *be, op_tensor *dw, const op_tensor *dy, const op_tensor *x, float alpha);
int cpu_rmsnorm_back(op_backend *be, const op_tensor *x, const op_tensor *w, float eps, const op_tensor *dy,
                     op_tensor *dx, float beta);
int cpu_swiglu_back(op_backend *be, const op_tensor *gate, const op_tensor *up, const op_tensor *dout,
                    op_tensor *dgate, op_tensor *dup);
int cpu_attention_back(op_backend *be, const op_attn_train *a, const op_tensor *q, const op_tensor *k,
                       const op_tensor *v, const op_tensor *out, const op_tensor *dout, op_tensor *dq,
                       op_tensor *dk, op_tensor *dv);
int cpu_cross_entropy(op_backend *be, op_tensor *logits, const int32_t *target, float weight, float *loss,
                      uint8_t *correct);
int cpu_dropout(op_backend *be, op_tensor *x, float p, uint64_t seed, int64_t row0);

/* ---- thread pool --------------------------------------------------------- */

/* A job runs fn(arg, ith, nth) on the caller (ith 0) and on the workers that
 * join it in time (distinct ith in [1, nth)): a job must hand out its work
 * from a shared counter so that the threads that do run take all of it; ith
 * only selects per-thread scratch. */
typedef void (*cpu_job_fn)(void *arg, int ith, int nth);

typedef struct cpu_pool cpu_pool;

/* Starts n_threads - 1 workers (the caller is thread 0). NULL on failure. */
cpu_pool *cpu_pool_new(int n_threads);
/* Joins the workers; NULL is a no-op. */
void cpu_pool_free(cpu_pool *pool);
/* Runs a job (see cpu_job_fn) and returns when every thread that joined it has
 * finished (fork-join). */
void cpu_pool_run(cpu_pool *pool, cpu_job_fn fn, void *arg);

/* ---- activation quantization (inline: compiled with each ISA's flags) ------ */

/* The natural layout of quantized activations: per pair of blocks (b, b+1),
 * CPU_XQ_PAIR bytes: int8 q_b[32], q_b1[32] in order, then f32 dx_b, dx_b1
 * (d = amax / 127, q = rint(x / d)) and f32 sx_b, sx_b1 (dx * sum(q)).
 * x: (k) floats, k % 64 == 0; dst: CPU_XQ_BYTES(k) bytes. */
static inline void cpu_quant_x_natural(const float *x, int64_t k, uint8_t *dst) {
    for (int64_t p = 0; p < k / 64; p++) {
        uint8_t *o = dst + p * CPU_XQ_PAIR;
        for (int h = 0; h < 2; h++) {
            const float *xb = x + p * 64 + 32 * h;
            float amax = 0;
            for (int j = 0; j < 32; j++) amax = fmaxf(amax, fabsf(xb[j]));
            float d = amax / 127.0f, id = d > 0 ? 1.0f / d : 0.0f;
            int sum = 0;
            for (int j = 0; j < 32; j++) {
                int v = (int)rintf(xb[j] * id);
                o[32 * h + j] = (uint8_t)(int8_t)v;
                sum += v;
            }
            float sx = d * (float)sum;
            memcpy(o + 64 + 4 * h, &d, 4);
            memcpy(o + 72 + 4 * h, &sx, 4);
        }
    }
}

#endif
