/* cpu.c -- the CPU backend: ISA selection, scratch, and every op split over the thread pool. */
#include <cpuid.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cpu-impl.h"
#include "status.h"

/* ---- ISA selection ------------------------------------------------------- */

static bool cpu_has_avx2(void) {
    __builtin_cpu_init();
    /* F16C from CPUID leaf 1 (ECX bit 29): not every compiler's
     * __builtin_cpu_supports knows its name */
    unsigned a, b, c, d;
    bool f16c = __get_cpuid(1, &a, &b, &c, &d) && (c & bit_F16C);
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && f16c;
}

static bool cpu_has_avx512(void) {
    /* cpu-avx512.c uses F/BW/VL/DQ and VNNI (vpdpbusd). It is also compiled
     * with -mavx512bf16, but no BF16 instruction is written there and GCC does
     * not generate them on its own, so BF16 is not required. */
    return cpu_has_avx2() && __builtin_cpu_supports("avx512f") &&
           __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
           __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vnni");
}

/* The kernels for `isa`, or for the best level below it that the CPU has. */
static const cpu_kernels *cpu_pick_kernels(op_cpu_isa isa) {
    if ((isa == OP_CPU_ISA_AUTO || isa == OP_CPU_ISA_AVX512) && cpu_has_avx512())
        return &cpu_kernels_avx512;
    if (isa != OP_CPU_ISA_PORTABLE && cpu_has_avx2()) return &cpu_kernels_avx2;
    return &cpu_kernels_portable;
}

/* ---- backend basics -------------------------------------------------------- */

static void cpu_free(op_backend *be) {
    cpu_backend *c = cpu_be(be);
    cpu_pool_free(c->pool);
    free(c->xt);
    free(c->xq);
    free(c->xw);
    free(c->wf);
    free(c->wfg);
    free(c->cbuf);
    free(c);
}

static const char *cpu_isa(const op_backend *be) { return ((const cpu_backend *)be)->kern->name; }

static bool cpu_supports(const op_backend *be, op_type type) {
    (void)be;
    return op_type_is_weight(type);
}

static void *cpu_alloc_aligned(size_t nbytes) {
    void *p = NULL;
    if (posix_memalign(&p, 64, nbytes ? nbytes : 64) != 0) return NULL;
    return p;
}

static void *cpu_buffer_alloc(op_backend *be, size_t nbytes) {
    (void)be;
    void *p = cpu_alloc_aligned(nbytes);
    if (p) memset(p, 0, nbytes);
    return p;
}

static void cpu_buffer_free(op_backend *be, void *ptr) {
    (void)be;
    free(ptr);
}

static int cpu_buffer_copy(op_backend *be, void *dst, const void *src, size_t nbytes) {
    (void)be;
    if (nbytes) memmove(dst, src, nbytes);
    return FU_OK;
}

/* Largest T of a `type` matmul that takes the matvec path: CPU_DECODE_MAX_T,
 * or for the block types CPU_DECODE_NARROW_T where the narrow GEMM kernel
 * takes over (unless the opt-in integer decode path applies to the type), or
 * CPU_DECODE_R16_T (every T) for the interleaved types on AVX-512: their
 * matvec converts each weight once per pass of up to 8 tokens, beats the GEMM
 * up to 32 tokens and is within a few percent of it beyond, and gives a token
 * the same bits whatever the batch. */
static int64_t cpu_decode_max_t(const cpu_backend *c, op_type type) {
    if (op_type_row_group(type) > 1 && c->kern == &cpu_kernels_avx512) return CPU_DECODE_R16_T;
    if (!c->kern->gemm16 || (c->quant_x && c->kern->quant_x[type])) return CPU_DECODE_MAX_T;
    if (type == OP_TYPE_F32 || type == OP_TYPE_F16 || type == OP_TYPE_BF16) return CPU_DECODE_MAX_T;
    return CPU_DECODE_NARROW_T;
}

/* Scratch buf (*cap bytes) grown to at least `need` bytes (contents not
 * kept): the new buffer, or NULL (buf still valid) when out of memory. */
static void *cpu_grow(void *buf, size_t *cap, size_t need) {
    if (buf && need <= *cap) return buf;
    void *p = cpu_alloc_aligned(need);
    if (!p) {
        fu_errorf(FU_ERR_NOMEM, "cpu: no memory for %zu bytes of matmul scratch", need);
        return NULL;
    }
    free(buf);
    *cap = need;
    return p;
}

/* Makes room for the transposed activations of a (t, k) prefill matmul. */
static int cpu_reserve_xt(cpu_backend *c, int64_t t, int64_t k) {
    float *p = cpu_grow(c->xt, &c->xt_cap, (size_t)((t + CPU_TB - 1) / CPU_TB * CPU_TB) * (size_t)k * sizeof(float));
    return p ? (c->xt = p, FU_OK) : FU_ERR_NOMEM;
}

/* Makes room for the quantized activations of a (t <= CPU_DECODE_MAX_T, k) decode matmul. */
static int cpu_reserve_xq(cpu_backend *c, int64_t t, int64_t k) {
    uint8_t *p = cpu_grow(c->xq, &c->xq_cap, (size_t)t * CPU_XQ_BYTES(k));
    return p ? (c->xq = p, FU_OK) : FU_ERR_NOMEM;
}

/* Makes room for the int16 activations of a (t, k) Q8_0 / Q4 _R16 matmul (only
 * kernels with quant_xw take them). */
static int cpu_reserve_xw(cpu_backend *c, int64_t t, int64_t k) {
    if (!c->kern->quant_xw) return FU_OK;
    cpu_xw_block *p = cpu_grow(c->xw, &c->xw_cap, (size_t)t * (size_t)(k / OP_QK) * sizeof(cpu_xw_block));
    return p ? (c->xw = p, FU_OK) : FU_ERR_NOMEM;
}

typedef struct cpu_xw_job {
    _Atomic int64_t next; /* next token to round */
    const cpu_backend *c;
    const cpu_mm *m;
} cpu_xw_job;

static void cpu_xw_job_run(void *arg, int ith, int nth) {
    (void)ith;
    (void)nth;
    cpu_xw_job *j = arg;
    const int64_t nb = j->m->k / OP_QK;
    for (int64_t t; (t = atomic_fetch_add(&j->next, 1)) < j->m->t;)
        j->c->kern->quant_xw(j->m->x + t * (int64_t)j->m->ldx, j->m->k, j->c->xw + t * nb);
}

/* Rounds m's activations for a Q8_0 / Q4 _R16 matvec into c->xw and points m at
 * them; a no-op for kernels without quant_xw. Prefill spreads the tokens over
 * the pool. */
static int cpu_round_xw(cpu_backend *c, cpu_mm *m) {
    /* the interleaved block types; F16_R16 / BF16_R16 take f32 activations */
    if (!c->kern->quant_xw || op_type_row_group(m->type) == 1 || op_type_block_elems(m->type) == 1) return FU_OK;
    int rc = cpu_reserve_xw(c, m->t, m->k);
    if (rc) return rc;
    cpu_xw_job j = {.c = c, .m = m};
    if (m->t * m->k < CPU_SERIAL_ELEMS)
        cpu_xw_job_run(&j, 0, 1);
    else
        cpu_pool_run(c->pool, cpu_xw_job_run, &j);
    m->xw = c->xw;
    return FU_OK;
}

/* Puts F16 / BF16 / Q8_0 / Q4_0 / Q4_1 matrices into the interleaved layout where
 * the AVX-512 kernels are in use (see the _R16 kernels in cpu-avx512.c);
 * other types and ISAs keep their weights as they are. */
static op_type cpu_weight_layout(const op_backend *be, op_type type, int64_t rows) {
    if (((const cpu_backend *)be)->kern != &cpu_kernels_avx512 || rows % OP_R16_ROWS) return type;
    switch (type) {
    case OP_TYPE_Q8_0: return OP_TYPE_Q8_0_R16;
    case OP_TYPE_Q4_0: return OP_TYPE_Q4_0_R16;
    case OP_TYPE_Q4_1: return OP_TYPE_Q4_1_R16;
    case OP_TYPE_F16: return OP_TYPE_F16_R16;
    case OP_TYPE_BF16: return OP_TYPE_BF16_R16;
    default: return type;
    }
}

static int cpu_weight_prepare(op_backend *be, const op_tensor *w, op_tensor *out) {
    const op_type to = cpu_weight_layout(be, w->type, w->ne[1]);
    if (to == w->type || w->ndim != 2 || !op_tensor_is_contiguous(w)) return 0;
    void *p = cpu_alloc_aligned(op_tensor_nbytes(w));
    if (!p) return fu_errorf(FU_ERR_NOMEM, "cpu: no memory to repack %s", w->name ? w->name : "a weight");
    int rc = op_repack_weight(w, to, p);
    if (rc) {
        free(p);
        return rc;
    }
    *out = *w;
    out->type = to;
    out->data = p;
    return 1;
}

/* Scratch for matmuls of up to max_tokens x max_k: the transposed activations
 * of prefill, the int16 activations of the interleaved Q8_0 / Q4 matvecs (AVX-512)
 * and (opt-in only) the int8 activations of decode. Every other op uses
 * fixed per-thread buffers allocated with the backend, or the stack. A matmul
 * larger than reserved grows the scratch once (an allocation on that call). */
static int cpu_reserve(op_backend *be, int64_t max_tokens, int64_t max_k) {
    if (max_tokens < 0 || max_k < 0) return fu_errorf(FU_ERR_INVALID, "cpu reserve: negative size");
    int rc = cpu_reserve_xw(cpu_be(be), max_tokens, max_k);
    if (rc) return rc;
    if (cpu_be(be)->quant_x) {
        rc = cpu_reserve_xq(cpu_be(be), max_tokens < CPU_DECODE_MAX_T ? max_tokens : CPU_DECODE_MAX_T, max_k);
        if (rc) return rc;
    }
    if (max_tokens <= (cpu_be(be)->kern->gemm16 ? CPU_DECODE_NARROW_T : CPU_DECODE_MAX_T)) return FU_OK;
    return cpu_reserve_xt(cpu_be(be), max_tokens, max_k);
}

static int cpu_synchronize(op_backend *be) {
    (void)be;
    return FU_OK;
}

/* ---- matmul -------------------------------------------------------------- */

/* Matmul work is handed out in chunks from a shared counter, so that a thread
 * that the OS delays (2 vCPUs shared with other processes) does not hold up
 * the others at the join. A matvec job may cover several matmuls of the same
 * activations (op_matmul_n): their rows are handed out as one range, matmul i
 * taking rows [end[i - 1], end[i]), its N rounded up to 16. */
typedef struct cpu_mm_job {
    cpu_backend *c;
    cpu_mm m[OP_MATMUL_N_MAX]; /* the matmuls (gemm: one) */
    int nm;
    int64_t end[OP_MATMUL_N_MAX];
    int64_t share;        /* matvec: a chunk is 1/share of the rows left */
    int64_t pg;           /* gemm: panels per unit of work (<= CPU_PG) */
    _Atomic int64_t next; /* first row not yet taken (matvec) or next (token block, panel
                             group) unit (gemm) */
} cpu_mm_job;

/* Matvec chunks shrink as the rows run out (guided scheduling): the first
 * ones are long, so that each thread streams long runs of consecutive weight
 * rows (the prefetchers restart at every chunk; the first chunk is 1/nth of
 * all the rows), and the last ones are short, so that the threads finish
 * together. Chunks are multiples of 16 rows from each matmul's row 0, so the
 * kernels group rows the same way whatever the thread count and whichever
 * matmuls share the job. */
static void cpu_matvec_job(void *arg, int ith, int nth) {
    (void)ith;
    (void)nth;
    cpu_mm_job *j = arg;
    const int64_t n = j->end[j->nm - 1];
    int64_t r0 = atomic_load_explicit(&j->next, memory_order_relaxed);
    while (r0 < n) {
        int64_t size = (n - r0 + j->share - 1) / j->share;
        size = size < 16 ? 16 : (size + 15) / 16 * 16;
        int64_t r1 = r0 + size < n ? r0 + size : n;
        if (atomic_compare_exchange_weak_explicit(&j->next, &r0, r1, memory_order_relaxed,
                                                  memory_order_relaxed)) {
            for (int i = 0; i < j->nm; i++) {
                const cpu_mm *m = &j->m[i];
                const int64_t at = i ? j->end[i - 1] : 0;
                const int64_t a = r0 > at ? r0 - at : 0, b = r1 - at < m->n ? r1 - at : m->n;
                if (a < b) j->c->kern->matvec[m->type](m, a, b);
            }
            r0 = atomic_load_explicit(&j->next, memory_order_relaxed);
        }
    }
}

/* xt[b][k][i] = x[b * tb + i][k] (at x + (b * tb + i) * ldx + k * ldk), zero
 * for tokens >= T. Units of work:
 * (token block, 256 values of k). */
static void cpu_transpose_job(void *arg, int ith, int nth) {
    (void)ith;
    (void)nth;
    cpu_mm_job *j = arg;
    const cpu_mm *m = &j->m[0];
    const int64_t tbw = m->tb, ntb = (m->t + tbw - 1) / tbw, nkc = (m->k + 255) / 256;
    float *xt = j->c->xt;
    for (;;) {
        int64_t u = atomic_fetch_add_explicit(&j->next, 1, memory_order_relaxed);
        if (u >= ntb * nkc) break;
        int64_t tb = u / nkc, k0 = u % nkc * 256, k1 = m->k < k0 + 256 ? m->k : k0 + 256;
        int64_t nt = m->t - tb * tbw < tbw ? m->t - tb * tbw : tbw;
        float *dst = xt + (size_t)tb * (size_t)m->k * (size_t)tbw;
        for (int64_t k = k0; k < k1; k++) {
            float *d = dst + k * tbw;
            for (int64_t i = 0; i < nt; i++) d[i] = m->x[(size_t)(tb * tbw + i) * m->ldx + (size_t)k * m->ldk];
            for (int64_t i = nt; i < tbw; i++) d[i] = 0.0f;
        }
    }
}

/* The GEMM panel of W rows [n0, n0 + nv) (zero rows up to nr), inputs
 * [k0, k0 + kc), dequantized to f32: wf[r * CPU_WF_LD + kk]. */
static void cpu_panel_fill(const cpu_mm *m, const cpu_kernels *kern, int64_t n0, int64_t nv, int nr, int64_t k0,
                           int64_t kc, float *wf) {
    for (int64_t r = 0; r < nr; r++) {
        if (r < nv) {
            int64_t row = n0 + r;
            float s = m->row_scale ? m->row_scale[row] : 1.0f;
            kern->dequant[m->type](m->w, m->w_stride, row, k0, kc, s, wf + r * CPU_WF_LD);
        } else {
            memset(wf + r * CPU_WF_LD, 0, (size_t)kc * sizeof(float));
        }
    }
}

/* Units of work: (block of CPU_TC tokens, group of pg panels), token block
 * major, taken from a shared counter. Within a unit: K slice > panel > token
 * block (tb tokens). With 32-token blocks (prefill) the xT slice (CPU_KC x
 * CPU_TC floats, 512 KiB) and the group's f32 partial sums (CPU_PG x nr x
 * CPU_TC) stay in L2, each dequantized panel slice (L1) serves CPU_TC tokens,
 * and y is written once per element after the last slice. With 16-token
 * blocks (T % 32 in 1..16) the narrow kernel runs on taller panels and
 * shorter slices; see cpu-impl.h. A transposed weight (m->back: the matmul
 * gradients) fills its group's panels together (cpu_back_fill, into the
 * per-thread wfg), since a panel covers only part of each W row's block. */
static void cpu_gemm_job(void *arg, int ith, int nth) {
    (void)nth;
    cpu_mm_job *j = arg;
    const cpu_mm *m = &j->m[0];
    const cpu_kernels *kern = j->c->kern;
    const bool narrow = m->tb == CPU_TB16;
    const int nr = narrow ? kern->nr16 : kern->nr, tbw = m->tb;
    const int64_t kcmax = narrow ? CPU_KC16 : CPU_KC, pg = j->pg;
    const cpu_gemm_fn gemm = narrow ? kern->gemm16 : kern->gemm;
    /* bq weights take qb bytes (a block of the block types, else one weight) */
    const int64_t bq = op_type_block_elems(m->type);
    const size_t qb = op_type_block_bytes(m->type);
    float *wf = j->c->wf + (size_t)ith * CPU_NR_MAX * CPU_WF_LD;
    float *cbuf = j->c->cbuf + (size_t)ith * CPU_PG * CPU_NR_MAX * CPU_TC;
    const int64_t npanels = (m->n + nr - 1) / nr, ngroups = (npanels + pg - 1) / pg;
    const int64_t nunits = (m->t + CPU_TC - 1) / CPU_TC * ngroups;
    for (;;) {
        int64_t u = atomic_fetch_add_explicit(&j->next, 1, memory_order_relaxed);
        if (u >= nunits) break;
        int64_t t0 = u / ngroups * CPU_TC, g0 = u % ngroups * pg;
        int64_t t1 = m->t < t0 + CPU_TC ? m->t : t0 + CPU_TC;
        int64_t g1 = npanels < g0 + pg ? npanels : g0 + pg;
        for (int64_t k0 = 0; k0 < m->k; k0 += kcmax) {
            int64_t kc = m->k - k0 < kcmax ? m->k - k0 : kcmax;
            for (int64_t p = g0; p < g1; p++) {
                int64_t n0 = p * nr, nv = m->n - n0 < nr ? m->n - n0 : nr;
                const float *pw = wf;
                if (!m->back) {
                    cpu_panel_fill(m, kern, n0, nv, nr, k0, kc, wf);
                } else { /* the whole group's panels at once: W's 32-blocks dequantized once */
                    float *gw = j->c->wfg + (size_t)ith * CPU_PG * CPU_NR_MAX * CPU_WF_LD;
                    const int64_t gn0 = g0 * nr, gnv = m->n - gn0 < (g1 - g0) * nr ? m->n - gn0 : (g1 - g0) * nr;
                    if (p == g0) cpu_back_fill(m, kern, gn0, gnv, (int)((g1 - g0) * nr), k0, kc, gw);
                    pw = gw + (size_t)(p - g0) * nr * CPU_WF_LD;
                }
                /* few token blocks: prefetch the next slice of this panel,
                 * or the first of the next panel, while the first block runs
                 * (not for a transposed W, whose panel is a strip of columns) */
                cpu_gemm_pf pf = {0};
                if (t1 - t0 <= CPU_TB && !m->back) {
                    int64_t pk = k0 + kc, pn = n0, prow = nv;
                    if (pk >= m->k) {
                        pk = 0;
                        pn = n0 + nr;
                        prow = p + 1 < g1 ? (m->n - pn < nr ? m->n - pn : nr) : 0;
                    }
                    if (prow > 0) {
                        int64_t pkc = m->k - pk < kcmax ? m->k - pk : kcmax;
                        pf.at = m->w + (size_t)pn * m->w_stride + (size_t)(pk / bq) * qb;
                        pf.stride = m->w_stride;
                        pf.rows = (int)prow;
                        /* one more line where a row's slice may straddle one */
                        const size_t bytes = (size_t)((pkc + bq - 1) / bq) * qb;
                        pf.lines = (int)((bytes + 63) / 64 + (((uintptr_t)pf.at | pf.stride | bytes) % 64 != 0));
                    }
                }
                float *c = cbuf + (size_t)(p - g0) * nr * CPU_TC;
                for (int64_t tb0 = t0; tb0 < t1; tb0 += tbw) {
                    const float *xt = m->xt + ((size_t)(tb0 / tbw) * (size_t)m->k + (size_t)k0) * (size_t)tbw;
                    gemm(pw, CPU_WF_LD, xt, kc, c + (tb0 - t0) * nr, k0 > 0, tb0 == t0 ? &pf : NULL);
                }
            }
        }
        for (int64_t p = g0; p < g1; p++) {
            int64_t n0 = p * nr, nv = m->n - n0 < nr ? m->n - n0 : nr;
            const float *c = cbuf + (size_t)(p - g0) * nr * CPU_TC;
            for (int64_t tb0 = t0; tb0 < t1; tb0 += tbw) {
                const float *tile = c + (tb0 - t0) * nr;
                int64_t nt = t1 - tb0 < tbw ? t1 - tb0 : tbw;
                for (int64_t i = 0; i < nt; i++) {
                    float *y = m->y + (size_t)(tb0 + i) * m->ldy + n0;
                    if (m->beta != 0.0f)
                        for (int64_t r = 0; r < nv; r++) y[r] = m->beta * y[r] + m->scale * tile[r * tbw + i];
                    else
                        for (int64_t r = 0; r < nv; r++) y[r] = m->scale * tile[r * tbw + i];
                }
            }
        }
    }
}

/* True if t is a set of rows: contiguous along ne[0], and dimensions 2 and 3
 * continue the row stride nb[1] (so row r of the flattened view is at r * nb[1]). */
static bool cpu_rows_ok(const op_tensor *t) {
    if (t->nb[0] != op_type_block_bytes(t->type) || t->data == NULL) return false;
    for (int i = 2; i < 4; i++)
        if (t->ne[i] > 1 && t->nb[i] != t->nb[i - 1] * (size_t)t->ne[i - 1]) return false;
    return true;
}

/* See cpu-impl.h: W readable row by row by the kernels. */
int cpu_weight_check(const op_tensor *w, const char *op) {
    if (!cpu_rows_ok(w) || w->ne[2] * w->ne[3] != 1)
        return fu_errorf(FU_ERR_INVALID, "%s %s: W must be 2-D and its rows contiguous", op, w->name ? w->name : "");
    if (op_type_block_elems(w->type) > 1 && w->ne[0] % OP_QK)
        return fu_errorf(FU_ERR_INVALID, "%s %s: K=%lld is not a multiple of %d", op, w->name ? w->name : "",
                         (long long)w->ne[0], OP_QK);
    if (w->type == OP_TYPE_I8 && !w->row_scale)
        return fu_errorf(FU_ERR_INVALID, "%s %s: i8 weights need row scales", op, w->name ? w->name : "");
    if (w->ne[1] % op_type_row_group(w->type) || (op_type_row_group(w->type) > 1 && !op_tensor_is_contiguous(w)))
        return fu_errorf(FU_ERR_INVALID, "%s %s: %s weights must be contiguous, rows a multiple of %d", op,
                         w->name ? w->name : "", op_type_name(w->type), op_type_row_group(w->type));
    return FU_OK;
}

/* Checks W, x and y and describes the matmul in m. */
static int cpu_mm_setup(const op_tensor *w, const op_tensor *x, const op_tensor *y, cpu_mm *m) {
    int rc = cpu_weight_check(w, "matmul");
    if (rc) return rc;
    if (!cpu_rows_ok(x) || !cpu_rows_ok(y))
        return fu_errorf(FU_ERR_INVALID, "matmul %s: x and y rows must be contiguous", w->name ? w->name : "");
    *m = (cpu_mm){.type = w->type,
                  .w = w->data,
                  .w_stride = w->nb[1],
                  .row_scale = w->type == OP_TYPE_I8 ? w->row_scale : NULL,
                  .n = w->ne[1],
                  .k = w->ne[0],
                  .t = x->ne[1] * x->ne[2] * x->ne[3],
                  .x = x->data,
                  .ldx = x->nb[1] / sizeof(float),
                  .ldk = 1,
                  .y = y->data,
                  .ldy = y->nb[1] / sizeof(float),
                  .scale = 1.0f};
    return FU_OK;
}

/* The matvec of j's nm matmuls (same type and activations) over the pool,
 * the activations rounded once for all of them. */
static int cpu_matvec_run(cpu_backend *c, cpu_mm_job *j) {
    cpu_mm *m = &j->m[0];
    cpu_quant_x_fn qx = c->quant_x ? c->kern->quant_x[m->type] : NULL;
    j->share = c->base.n_threads;
    if (qx && m->k % 64 == 0) {
        int rc = cpu_reserve_xq(c, m->t, m->k);
        if (rc) return rc;
        for (int64_t t = 0; t < m->t; t++) qx(m->x + t * m->ldx, m->k, c->xq + t * CPU_XQ_BYTES(m->k));
        m->xq = c->xq;
    }
    int rc = cpu_round_xw(c, m);
    if (rc) return rc;
    for (int i = 0; i < j->nm; i++) {
        j->m[i].xq = m->xq;
        j->m[i].xw = m->xw;
        j->end[i] = (i ? j->end[i - 1] : 0) + (j->m[i].n + 15) / 16 * 16;
    }
    cpu_pool_run(c->pool, cpu_matvec_job, j);
    return FU_OK;
}

/* One matmul m (T, N, K > 0): the matvec up to cpu_decode_max_t tokens, else
 * the GEMM. */
static int cpu_mm_run(cpu_backend *c, const cpu_mm *m) {
    if (m->t > cpu_decode_max_t(c, m->type)) return cpu_gemm_run(c, m);
    cpu_mm_job j = {.c = c, .m = {*m}, .nm = 1};
    return cpu_matvec_run(c, &j);
}

int cpu_gemm_run(cpu_backend *c, const cpu_mm *m) {
    cpu_mm_job j = {.c = c, .m = {*m}, .nm = 1};
    int rc = cpu_reserve_xt(c, m->t, m->k);
    if (rc) return rc;
    if (m->back) {
        float *p = cpu_grow(c->wfg, &c->wfg_cap,
                            (size_t)c->base.n_threads * CPU_PG * CPU_NR_MAX * CPU_WF_LD * sizeof(float));
        if (!p) return FU_ERR_NOMEM;
        c->wfg = p;
    }
    j.m[0].xt = c->xt;
    const int64_t tail = m->t % CPU_TB;
    j.m[0].tb = c->kern->gemm16 && tail >= 1 && tail <= CPU_TB16 && m->t < 4 * CPU_TB ? CPU_TB16 : CPU_TB;
    /* panels per unit: all CPU_PG when the slices serve many token blocks,
     * else few enough that every thread gets several units */
    const int nr = j.m[0].tb == CPU_TB16 ? c->kern->nr16 : c->kern->nr;
    const int64_t npanels = (m->n + nr - 1) / nr;
    j.pg = CPU_PG;
    if (m->t <= CPU_TB) {
        j.pg = npanels / (4 * (int64_t)c->base.n_threads);
        j.pg = j.pg < 1 ? 1 : j.pg > CPU_PG ? CPU_PG : j.pg;
    }
    cpu_pool_run(c->pool, cpu_transpose_job, &j);
    atomic_store(&j.next, 0);
    cpu_pool_run(c->pool, cpu_gemm_job, &j);
    return FU_OK;
}

/* n matmuls of the same x: one matvec job when they share a type and take the
 * matvec path, else one after another. */
static int cpu_matmul_n(op_backend *be, int n, const op_tensor *const *w, const op_tensor *x, op_tensor *const *y) {
    cpu_backend *c = cpu_be(be);
    cpu_mm all[OP_MATMUL_N_MAX];
    for (int i = 0; i < n; i++) { /* all checked before any is written */
        int rc = cpu_mm_setup(w[i], x, y[i], &all[i]);
        if (rc) return rc;
    }
    cpu_mm_job j = {.c = c};
    bool joint = true;
    for (int i = 0; i < n; i++) {
        const cpu_mm *m = &all[i];
        if (m->t == 0 || m->n == 0) continue;
        if (m->k == 0) {
            for (int64_t t = 0; t < m->t; t++) memset(m->y + t * m->ldy, 0, (size_t)m->n * sizeof(float));
            continue;
        }
        joint = joint && (j.nm == 0 || m->type == j.m[0].type) && m->t <= cpu_decode_max_t(c, m->type);
        j.m[j.nm++] = *m;
    }
    if (j.nm == 0) return FU_OK;
    if (joint) return cpu_matvec_run(c, &j);
    for (int i = 0; i < j.nm; i++) {
        int rc = cpu_mm_run(c, &j.m[i]);
        if (rc) return rc;
    }
    return FU_OK;
}

static int cpu_matmul(op_backend *be, const op_tensor *w, const op_tensor *x, op_tensor *y) {
    return cpu_matmul_n(be, 1, &w, x, &y);
}

/* ---- row-wise ops ---------------------------------------------------------- */

typedef enum cpu_row_kind {
    CPU_ROW_RMSNORM,
    CPU_ROW_SOFTMAX,
    CPU_ROW_LOG_SOFTMAX,
    CPU_ROW_SWIGLU,
    CPU_ROW_ADD,
    CPU_ROW_ADD_ROW,
} cpu_row_kind;

typedef struct cpu_row_job {
    _Atomic int64_t next; /* next chunk of rows to take */
    int64_t chunk;        /* rows per chunk */
    cpu_row_kind kind;
    int64_t rows, d;   /* rows of d elements */
    float *out;        /* (rows, d) */
    const float *a;    /* (rows, d) first operand */
    const float *b;    /* (rows, d), or (d) for add_row / rmsnorm weight (may be NULL) */
    float eps;
    const cpu_kernels *kern; /* set by cpu_rows_run */
} cpu_row_job;

static void cpu_row_one(const cpu_row_job *j, int64_t r) {
    const int64_t d = j->d;
    float *o = j->out + r * d;
    const float *a = j->a + r * d;
    switch (j->kind) {
    case CPU_ROW_RMSNORM: {
        double ss = j->kern->sumsq(a, d);
        float inv = (float)(1.0 / sqrt(ss / (double)d + (double)j->eps));
        if (j->b)
            for (int64_t i = 0; i < d; i++) o[i] = a[i] * inv * j->b[i];
        else
            for (int64_t i = 0; i < d; i++) o[i] = a[i] * inv;
        break;
    }
    case CPU_ROW_SOFTMAX:
    case CPU_ROW_LOG_SOFTMAX: {
        float mx = -INFINITY;
        for (int64_t i = 0; i < d; i++) mx = a[i] > mx ? a[i] : mx;
        if (mx == -INFINITY) mx = 0; /* all -inf: softmax gives nan like the reference */
        double sum = 0;
        if (j->kind == CPU_ROW_SOFTMAX) {
            for (int64_t i = 0; i < d; i++) {
                o[i] = expf(a[i] - mx);
                sum += o[i];
            }
            float inv = (float)(1.0 / sum);
            for (int64_t i = 0; i < d; i++) o[i] *= inv;
        } else {
            for (int64_t i = 0; i < d; i++) sum += expf(a[i] - mx);
            float lse = mx + (float)log(sum);
            for (int64_t i = 0; i < d; i++) o[i] = a[i] - lse;
        }
        break;
    }
    case CPU_ROW_SWIGLU: {
        j->kern->swiglu(a, j->b + r * d, o, d);
        break;
    }
    case CPU_ROW_ADD: {
        const float *b = j->b + r * d;
        for (int64_t i = 0; i < d; i++) o[i] = a[i] + b[i];
        break;
    }
    case CPU_ROW_ADD_ROW:
        for (int64_t i = 0; i < d; i++) o[i] = a[i] + j->b[i];
        break;
    }
}

static void cpu_row_job_run(void *arg, int ith, int nth) {
    (void)ith;
    (void)nth;
    cpu_row_job *j = arg;
    for (;;) {
        int64_t r0 = atomic_fetch_add_explicit(&j->next, 1, memory_order_relaxed) * j->chunk;
        if (r0 >= j->rows) break;
        int64_t r1 = r0 + j->chunk < j->rows ? r0 + j->chunk : j->rows;
        for (int64_t r = r0; r < r1; r++) cpu_row_one(j, r);
    }
}

static int cpu_rows_run(cpu_backend *c, cpu_row_job *j) {
    int nth = c->base.n_threads;
    j->kern = c->kern;
    j->chunk = (j->rows + 4 * nth - 1) / (4 * nth);
    if (j->rows * j->d < CPU_SERIAL_ELEMS || j->rows == 1)
        cpu_row_job_run(j, 0, 1);
    else
        cpu_pool_run(c->pool, cpu_row_job_run, j);
    return FU_OK;
}

static int cpu_rmsnorm(op_backend *be, const op_tensor *x, const op_tensor *w, float eps, op_tensor *y) {
    if (!cpu_f32_contig(x) || !cpu_f32_contig(y) || (w && !cpu_f32_contig(w)))
        return fu_errorf(FU_ERR_INVALID, "rmsnorm: tensors must be contiguous f32");
    cpu_row_job j = {0, 0, CPU_ROW_RMSNORM, op_tensor_nelems(x) / (x->ne[0] ? x->ne[0] : 1), x->ne[0],
                     y->data, x->data, w ? w->data : NULL, eps, NULL};
    if (x->ne[0] == 0) return FU_OK;
    return cpu_rows_run(cpu_be(be), &j);
}

static int cpu_softmax_any(op_backend *be, op_tensor *x, cpu_row_kind kind) {
    if (!cpu_f32_contig(x)) return fu_errorf(FU_ERR_INVALID, "softmax: x must be contiguous f32");
    if (x->ne[0] == 0) return FU_OK;
    cpu_row_job j = {0, 0, kind, op_tensor_nelems(x) / x->ne[0], x->ne[0], x->data, x->data, NULL, 0, NULL};
    return cpu_rows_run(cpu_be(be), &j);
}

static int cpu_softmax(op_backend *be, op_tensor *x) { return cpu_softmax_any(be, x, CPU_ROW_SOFTMAX); }

static int cpu_log_softmax(op_backend *be, op_tensor *x) {
    return cpu_softmax_any(be, x, CPU_ROW_LOG_SOFTMAX);
}

static int cpu_swiglu(op_backend *be, const op_tensor *gate, const op_tensor *up, op_tensor *out) {
    if (!cpu_f32_contig(gate) || !cpu_f32_contig(up) || !cpu_f32_contig(out))
        return fu_errorf(FU_ERR_INVALID, "swiglu: tensors must be contiguous f32");
    int64_t n = op_tensor_nelems(gate), d = gate->ne[0] ? gate->ne[0] : 1;
    cpu_row_job j = {0, 0, CPU_ROW_SWIGLU, n / d, d, out->data, gate->data, up->data, 0, NULL};
    return cpu_rows_run(cpu_be(be), &j);
}

static int cpu_add(op_backend *be, op_tensor *x, const op_tensor *y) {
    if (!cpu_f32_contig(x) || !cpu_f32_contig(y))
        return fu_errorf(FU_ERR_INVALID, "add: tensors must be contiguous f32");
    int64_t n = op_tensor_nelems(x), d = x->ne[0] ? x->ne[0] : 1;
    cpu_row_job j = {0, 0, CPU_ROW_ADD, n / d, d, x->data, x->data, y->data, 0, NULL};
    return cpu_rows_run(cpu_be(be), &j);
}

static int cpu_add_row(op_backend *be, op_tensor *x, const op_tensor *b) {
    if (!cpu_f32_contig(x) || !cpu_f32_contig(b))
        return fu_errorf(FU_ERR_INVALID, "add_row: tensors must be contiguous f32");
    if (x->ne[0] == 0) return FU_OK;
    cpu_row_job j = {0, 0, CPU_ROW_ADD_ROW, op_tensor_nelems(x) / x->ne[0], x->ne[0], x->data, x->data,
                     b->data, 0, NULL};
    return cpu_rows_run(cpu_be(be), &j);
}

/* x (R, N) row rows[i] += scale * y (n, N) row i; small (LoRA updates): serial. */
static int cpu_add_rows(op_backend *be, op_tensor *x, const int32_t *rows, const op_tensor *y, float scale) {
    (void)be;
    if (!cpu_f32_contig(x) || !cpu_f32_contig(y))
        return fu_errorf(FU_ERR_INVALID, "add_rows: tensors must be contiguous f32");
    const int64_t d = x->ne[0];
    for (int64_t i = 0; i < y->ne[1]; i++) {
        float *o = (float *)x->data + (int64_t)rows[i] * d;
        const float *a = (const float *)y->data + i * d;
        for (int64_t k = 0; k < d; k++) o[k] += scale * a[k];
    }
    return FU_OK;
}

/* ---- rope ------------------------------------------------------------------ */

static int cpu_rope(op_backend *be, op_tensor *x, const int32_t *pos, const op_rope_params *p) {
    (void)be;
    if (!cpu_f32_contig(x)) return fu_errorf(FU_ERR_INVALID, "rope: x must be contiguous f32");
    if (p->rot_dim > CPU_ATTN_MAX_HD || !p->inv_freq)
        return fu_errorf(FU_ERR_INVALID, "rope: rot_dim %d unsupported or no inv_freq", p->rot_dim);
    const int64_t hd = x->ne[0], nh = x->ne[1], nt = x->ne[2] * x->ne[3];
    const int half = p->rot_dim / 2;
    float cs[CPU_ATTN_MAX_HD / 2], sn[CPU_ATTN_MAX_HD / 2];
    for (int64_t t = 0; t < nt; t++) {
        for (int i = 0; i < half; i++) {
            float theta = (float)pos[t] * p->inv_freq[i];
            cs[i] = cosf(theta) * p->attn_factor;
            sn[i] = sinf(theta) * p->attn_factor;
        }
        for (int64_t h = 0; h < nh; h++) {
            float *v = (float *)x->data + (t * nh + h) * hd;
            for (int i = 0; i < half; i++) {
                int i0 = p->mode == OP_ROPE_NEOX ? i : 2 * i;
                int i1 = p->mode == OP_ROPE_NEOX ? i + half : 2 * i + 1;
                float x0 = v[i0], x1 = v[i1];
                v[i0] = x0 * cs[i] - x1 * sn[i];
                v[i1] = x0 * sn[i] + x1 * cs[i];
            }
        }
    }
    return FU_OK;
}

/* ---- attention ------------------------------------------------------------- */

typedef struct cpu_attn_job {
    cpu_backend *c;
    const op_tensor *q;
    const op_attn *a;
    op_tensor *out;
    int sg;                /* query heads per task (<= CPU_ATTN_GROUP) */
    int nsub;              /* tasks per KV head: ceil(group / sg) */
    int64_t ntasks;        /* T * n_kv_heads * nsub */
    _Atomic int64_t next;  /* next task to take */
} cpu_attn_job;

/* Prefetches rows [r0, r1) of row_bytes each, `stride` bytes apart from base. */
static void cpu_prefetch_rows(const uint8_t *base, size_t stride, int r0, int r1, size_t row_bytes) {
    for (int r = r0; r < r1; r++)
        for (size_t o = 0; o < row_bytes; o += 64) __builtin_prefetch(base + (size_t)r * stride + o);
}

/* One (token, KV head, up to sg of its query heads): online softmax over
 * chunks of CPU_ATTN_CHUNK positions (scores of a chunk, then a rescale of a
 * head's running sum when its maximum grows), each K and V row read once for
 * the task's heads. A head's result does not depend on which heads share its
 * task. Scratch rule: none is needed -- the chunk's scores and the (sg, hd)
 * accumulators live on the worker's stack, so any cache length works without
 * op_reserve; head_dim is limited to CPU_ATTN_MAX_HD. */
static void cpu_attn_task(cpu_attn_job *j, int64_t task) {
    const op_attn *a = j->a;
    const cpu_kernels *kern = j->c->kern;
    const int hd = a->head_dim, group = a->n_heads / a->n_kv_heads;
    const int64_t t = task / ((int64_t)a->n_kv_heads * j->nsub);
    const int g = (int)(task / j->nsub % a->n_kv_heads), h0 = g * group + (int)(task % j->nsub) * j->sg;
    const int nh = g * group + group - h0 < j->sg ? g * group + group - h0 : j->sg;
    const op_tensor *kc = &a->k[a->seq[t]], *vc = &a->v[a->seq[t]];
    const float *q = (const float *)((const uint8_t *)j->q->data + t * j->q->nb[2] + h0 * j->q->nb[1]);
    const uint8_t *kbase = (const uint8_t *)kc->data + g * kc->nb[1];
    const uint8_t *vbase = (const uint8_t *)vc->data + g * vc->nb[1];
    float acc[CPU_ATTN_GROUP * CPU_ATTN_MAX_HD], s[CPU_ATTN_GROUP * CPU_ATTN_CHUNK];
    float mx[CPU_ATTN_GROUP], l[CPU_ATTN_GROUP];
    for (int h = 0; h < nh; h++) {
        mx[h] = -INFINITY;
        l[h] = 0;
    }
    memset(acc, 0, (size_t)(nh * hd) * sizeof(float));
    const int n = a->pos[t] + 1;
    const size_t row_bytes = (size_t)hd * op_type_block_bytes(kc->type);
    cpu_prefetch_rows(kbase, kc->nb[2], 0, n < CPU_ATTN_CHUNK ? n : CPU_ATTN_CHUNK, row_bytes);
    for (int j0 = 0; j0 < n; j0 += CPU_ATTN_CHUNK) {
        int cn = n - j0 < CPU_ATTN_CHUNK ? n - j0 : CPU_ATTN_CHUNK;
        /* this chunk's V rows and the next chunk's K rows, while the chunk
         * is scored: in a position-major cache a KV head's rows are a whole
         * cache row apart, too far for the hardware prefetchers to follow
         * (in a head-major one, op_tensor_kv_cache, they are in sequence) */
        cpu_prefetch_rows(vbase, vc->nb[2], j0, j0 + cn, row_bytes);
        cpu_prefetch_rows(kbase, kc->nb[2], j0 + cn, n < j0 + cn + CPU_ATTN_CHUNK ? n : j0 + cn + CPU_ATTN_CHUNK,
                          row_bytes);
        kern->scores(q, j->q->nb[1] / sizeof(float), nh, kbase + (size_t)j0 * kc->nb[2], kc->type, kc->nb[2], cn,
                     hd, a->scale, s);
        for (int h = 0; h < nh; h++) {
            float *sh = s + h * CPU_ATTN_CHUNK, *ah = acc + h * hd;
            float cm = sh[0];
            for (int i = 1; i < cn; i++) cm = sh[i] > cm ? sh[i] : cm;
            if (cm > mx[h]) {
                float f = expf(mx[h] - cm); /* 0 on the first chunk */
                l[h] *= f;
                for (int d = 0; d < hd; d++) ah[d] *= f;
                mx[h] = cm;
            }
            l[h] += kern->exp_sum(sh, cn, mx[h]);
        }
        kern->accum(s, nh, vbase + (size_t)j0 * vc->nb[2], vc->type, vc->nb[2], cn, hd, acc);
    }
    for (int h = 0; h < nh; h++) {
        float *out = (float *)((uint8_t *)j->out->data + t * j->out->nb[2] + (h0 + h) * j->out->nb[1]);
        float inv = 1.0f / l[h];
        for (int d = 0; d < hd; d++) out[d] = acc[h * hd + d] * inv;
    }
}

static void cpu_attn_job_run(void *arg, int ith, int nth) {
    (void)ith;
    (void)nth;
    cpu_attn_job *j = arg;
    for (;;) {
        int64_t task = atomic_fetch_add_explicit(&j->next, 1, memory_order_relaxed);
        if (task >= j->ntasks) break;
        cpu_attn_task(j, task);
    }
}

static int cpu_attention(op_backend *be, const op_tensor *q, const op_attn *a, op_tensor *out) {
    cpu_backend *c = cpu_be(be);
    if (q->type != OP_TYPE_F32 || out->type != OP_TYPE_F32 || q->nb[0] != 4 || out->nb[0] != 4 ||
        out->ne[0] != a->head_dim || out->ne[1] != a->n_heads || !q->data || !out->data)
        return fu_errorf(FU_ERR_INVALID, "attention: q and out must be f32 (T, H, hd)");
    if (a->head_dim <= 0 || a->head_dim > CPU_ATTN_MAX_HD)
        return fu_errorf(FU_ERR_UNSUPPORTED, "attention: head_dim %d outside [1, %d]", a->head_dim,
                         CPU_ATTN_MAX_HD);
    const int64_t nt = q->ne[2] * q->ne[3];
    for (int64_t t = 0; t < nt; t++) {
        int s = a->seq[t];
        if (s < 0 || s >= a->n_seqs)
            return fu_errorf(FU_ERR_RANGE, "attention: token %lld has sequence %d of %d",
                             (long long)t, s, a->n_seqs);
        const op_tensor *k = &a->k[s], *v = &a->v[s];
        if ((k->type != OP_TYPE_F32 && k->type != OP_TYPE_F16) || v->type != k->type ||
            k->ne[0] != a->head_dim || v->ne[0] != a->head_dim || k->ne[1] != a->n_kv_heads ||
            v->ne[1] != a->n_kv_heads || k->nb[0] != op_type_block_bytes(k->type) ||
            v->nb[0] != k->nb[0])
            return fu_errorf(FU_ERR_INVALID, "attention: cache %d must be F32/F16 (len, %d, %d)", s,
                             a->n_kv_heads, a->head_dim);
        if (a->pos[t] < 0 || a->pos[t] >= k->ne[2] || a->pos[t] >= v->ne[2])
            return fu_errorf(FU_ERR_RANGE, "attention: token %lld at position %d outside cache of %lld",
                             (long long)t, a->pos[t], (long long)k->ne[2]);
    }
    /* as many heads per task as CPU_ATTN_GROUP allows, unless that leaves
     * fewer than two tasks per thread */
    const int group = a->n_heads / a->n_kv_heads;
    int sg = group < CPU_ATTN_GROUP ? group : CPU_ATTN_GROUP;
    while (sg > 1 && nt * a->n_kv_heads * ((group + sg - 1) / sg) < 2 * (int64_t)c->base.n_threads) sg = (sg + 1) / 2;
    cpu_attn_job j = {.c = c, .q = q, .a = a, .out = out, .sg = sg, .nsub = (group + sg - 1) / sg};
    j.ntasks = nt * a->n_kv_heads * j.nsub;
    atomic_init(&j.next, 0);
    if (j.ntasks == 1)
        cpu_attn_job_run(&j, 0, 1);
    else
        cpu_pool_run(c->pool, cpu_attn_job_run, &j);
    return FU_OK;
}

/* ---- kv_store / get_rows ---------------------------------------------------- */

static int cpu_kv_store(op_backend *be, const op_tensor *src, op_tensor *const *dst,
                        const int32_t *seq, const int32_t *pos) {
    cpu_backend *c = cpu_be(be);
    if (!cpu_f32_contig(src)) return fu_errorf(FU_ERR_INVALID, "kv_store: src must be contiguous f32");
    const int64_t nt = src->ne[1] * src->ne[2] * src->ne[3], cols = src->ne[0];
    for (int64_t t = 0; t < nt; t++) {
        if (seq[t] < 0) return fu_errorf(FU_ERR_RANGE, "kv_store: negative sequence %d", seq[t]);
        const op_tensor *d = dst[seq[t]];
        op_kv_layout kl;
        int rc = op_kv_layout_of(d, cols, seq[t], &kl);
        if (rc) return rc;
        if (pos[t] < 0 || pos[t] >= kl.len)
            return fu_errorf(FU_ERR_RANGE, "kv_store: position %d outside cache of %lld", pos[t],
                             (long long)kl.len);
        for (int64_t h = 0; h < cols / kl.hd; h++) {
            const float *s = (const float *)src->data + t * cols + h * kl.hd;
            uint8_t *row = (uint8_t *)d->data + (size_t)pos[t] * kl.pos_stride + (size_t)h * kl.head_stride;
            if (d->type == OP_TYPE_F32)
                memcpy(row, s, (size_t)kl.hd * sizeof(float));
            else
                c->kern->to_f16(s, (uint16_t *)row, kl.hd);
        }
    }
    return FU_OK;
}

static int cpu_get_rows(op_backend *be, const op_tensor *table, const int32_t *ids, op_tensor *out) {
    cpu_backend *c = cpu_be(be);
    if (!op_type_is_weight(table->type) || !cpu_rows_ok(table) || !cpu_f32_contig(out))
        return fu_errorf(FU_ERR_INVALID, "get_rows: bad table type or layout");
    if (op_type_block_elems(table->type) > 1 && table->ne[0] % OP_QK)
        return fu_errorf(FU_ERR_INVALID, "get_rows: row length not a multiple of %d", OP_QK);
    if (table->type == OP_TYPE_I8 && !table->row_scale)
        return fu_errorf(FU_ERR_INVALID, "get_rows: i8 table needs row scales");
    if (table->ne[1] % op_type_row_group(table->type) ||
        (op_type_row_group(table->type) > 1 && !op_tensor_is_contiguous(table)))
        return fu_errorf(FU_ERR_INVALID, "get_rows: %s table must be contiguous, rows a multiple of %d",
                         op_type_name(table->type), op_type_row_group(table->type));
    const int64_t d = table->ne[0], nt = out->ne[1] * out->ne[2] * out->ne[3];
    for (int64_t t = 0; t < nt; t++) {
        float s = table->type == OP_TYPE_I8 ? table->row_scale[ids[t]] : 1.0f;
        c->kern->dequant[table->type](table->data, table->nb[1], ids[t], 0, d, s, (float *)out->data + t * d);
    }
    return FU_OK;
}

/* ---- construction ------------------------------------------------------------ */

static const op_backend_vtbl cpu_vtbl = {
    .name = "cpu",
    .free = cpu_free,
    .isa = cpu_isa,
    .supports = cpu_supports,
    .buffer_alloc = cpu_buffer_alloc,
    .buffer_free = cpu_buffer_free,
    .buffer_set = cpu_buffer_copy,
    .buffer_get = cpu_buffer_copy,
    .reserve = cpu_reserve,
    .weight_prepare = cpu_weight_prepare,
    .weight_layout = cpu_weight_layout,
    .synchronize = cpu_synchronize,
    .matmul = cpu_matmul,
    .matmul_n = cpu_matmul_n,
    .rmsnorm = cpu_rmsnorm,
    .rope = cpu_rope,
    .attention = cpu_attention,
    .kv_store = cpu_kv_store,
    .swiglu = cpu_swiglu,
    .add = cpu_add,
    .add_row = cpu_add_row,
    .get_rows = cpu_get_rows,
    .softmax = cpu_softmax,
    .log_softmax = cpu_log_softmax,
    .add_rows = cpu_add_rows,
    .matmul_back = cpu_matmul_back,
    .outer_acc = cpu_outer_acc,
    .rmsnorm_back = cpu_rmsnorm_back,
    .swiglu_back = cpu_swiglu_back,
    .attention_back = cpu_attention_back,
    .cross_entropy = cpu_cross_entropy,
    .dropout = cpu_dropout,
};

op_backend *op_backend_cpu_new(const op_cpu_options *opts) {
    op_cpu_options o = opts ? *opts : (op_cpu_options){0};
    int n = o.n_threads;
    if (n <= 0) {
        long online = sysconf(_SC_NPROCESSORS_ONLN);
        n = online > 0 ? (int)online : 1;
    }
    if (n > 256) n = 256;
    cpu_backend *c = calloc(1, sizeof *c);
    if (!c) {
        fu_errorf(FU_ERR_NOMEM, "cpu backend: out of memory");
        return NULL;
    }
    op_backend_base_init(&c->base, &cpu_vtbl, n);
    c->kern = cpu_pick_kernels(o.isa);
    c->quant_x = o.quantized_activations;
    c->wf = cpu_alloc_aligned((size_t)n * CPU_NR_MAX * CPU_WF_LD * sizeof(float));
    c->cbuf = cpu_alloc_aligned((size_t)n * CPU_PG * CPU_NR_MAX * CPU_TC * sizeof(float));
    if (!c->wf || !c->cbuf) {
        fu_errorf(FU_ERR_NOMEM, "cpu backend: out of memory for scratch");
        goto err;
    }
    c->pool = cpu_pool_new(n);
    if (!c->pool) {
        fu_errorf(FU_ERR_INTERNAL, "cpu backend: cannot start %d threads", n);
        goto err;
    }
    return &c->base;
err:
    free(c->wf);
    free(c->cbuf);
    free(c);
    return NULL;
}
