/* cpu-train.c -- the CPU backend's training (backward) ops, split over the thread pool.
 *
 * Like the forward ops (cpu.c), each op runs alone (ops.c holds the backend's
 * lock, and has checked shapes, types and index ranges), hands its work out
 * from a shared atomic counter, and each task writes disjoint outputs. The
 * matmul gradients run the forward GEMM (cpu_gemm_run) with the weight read
 * transposed (cpu_back_fill); the others are row loops or, for attention,
 * tasks of one example and one KV head whose scores live on the stack.
 */
#include <math.h>
#include <string.h>

#include "cpu-impl.h"
#include "dropout-hash.h"
#include "status.h"

/* ---- matmul gradients -------------------------------------------------------- */

void cpu_back_fill(const cpu_mm *m, const cpu_kernels *kern, int64_t n0, int64_t nv, int nr, int64_t k0,
                   int64_t kc, float *wf) {
    const int64_t be = op_type_block_elems(m->type);
    const int64_t c0 = n0 / be * be, c1 = (n0 + nv + be - 1) / be * be;
    float win[CPU_PG * CPU_NR_MAX + 2 * OP_QK]; /* W row's columns [c0, c1): nv + at most 2 * 31 */
    for (int64_t kk = 0; kk < kc; kk++) {
        const int64_t row = k0 + kk;
        kern->dequant[m->type](m->w, m->w_stride, row, c0, c1 - c0, m->row_scale ? m->row_scale[row] : 1.0f, win);
        for (int64_t j = 0; j < nv; j++) wf[j * CPU_WF_LD + kk] = win[n0 - c0 + j];
    }
    for (int64_t j = nv; j < nr; j++) memset(wf + j * CPU_WF_LD, 0, (size_t)kc * sizeof(float));
}

/* dx (T, K) = beta * dx + dy (T, N) @ W (N, K): the GEMM of tokens dy over
 * the transposed weight (outputs K, inputs N). */
int cpu_matmul_back(op_backend *be, const op_tensor *w, const op_tensor *dy, op_tensor *dx, float beta) {
    int rc = cpu_weight_check(w, "matmul_back");
    if (rc) return rc;
    const int64_t T = op_tensor_nelems(dx) / (dx->ne[0] ? dx->ne[0] : 1), K = w->ne[0], N = w->ne[1];
    if (T == 0 || K == 0) return FU_OK;
    if (N == 0) {
        if (beta == 0.0f) memset(dx->data, 0, (size_t)(T * K) * sizeof(float));
        return FU_OK;
    }
    cpu_mm m = {.type = w->type,
                .w = w->data,
                .w_stride = w->nb[1],
                .row_scale = w->type == OP_TYPE_I8 ? w->row_scale : NULL,
                .n = K,
                .k = N,
                .t = T,
                .x = dy->data,
                .ldx = (size_t)N,
                .ldk = 1,
                .y = dx->data,
                .ldy = (size_t)K,
                .beta = beta,
                .scale = 1.0f,
                .back = true};
    return cpu_gemm_run(cpu_be(be), &m);
}

/* dw (N, K) += alpha * dy (T, N)^T @ x (T, K): the GEMM whose "tokens" are the
 * N rows of dw (dy read column-wise: token n, input t at dy[t * N + n]) and
 * whose transposed weight is x (T rows of K, f32). */
int cpu_outer_acc(op_backend *be, op_tensor *dw, const op_tensor *dy, const op_tensor *x, float alpha) {
    const int64_t N = dw->ne[1], K = dw->ne[0], T = op_tensor_nelems(x) / (K ? K : 1);
    if (N == 0 || K == 0 || T == 0 || op_tensor_nelems(dy) == 0) return FU_OK;
    cpu_mm m = {.type = OP_TYPE_F32,
                .w = x->data,
                .w_stride = (size_t)K * sizeof(float),
                .n = K,
                .k = T,
                .t = N,
                .x = dy->data,
                .ldx = 1,
                .ldk = (size_t)N,
                .y = dw->data,
                .ldy = (size_t)K,
                .beta = 1.0f,
                .scale = alpha,
                .back = true};
    return cpu_gemm_run(cpu_be(be), &m);
}

/* ---- row loops ---------------------------------------------------------------- */

/* Rows [r0, r1) of an op whose arguments are at arg. */
typedef void (*cpu_rows_fn)(const void *arg, int64_t r0, int64_t r1);

typedef struct cpu_each_job {
    _Atomic int64_t next; /* next chunk to take */
    int64_t rows, chunk;
    cpu_rows_fn fn;
    const void *arg;
} cpu_each_job;

/* Takes chunks of rows from the shared counter until none is left. */
static void cpu_each_job_run(void *p, int ith, int nth) {
    (void)ith;
    (void)nth;
    cpu_each_job *j = p;
    for (;;) {
        int64_t r0 = atomic_fetch_add_explicit(&j->next, 1, memory_order_relaxed) * j->chunk;
        if (r0 >= j->rows) break;
        j->fn(j->arg, r0, r0 + j->chunk < j->rows ? r0 + j->chunk : j->rows);
    }
}

/* Runs fn over `rows` rows of d elements: on the calling thread when small,
 * else in chunks (4 per thread) over the pool. */
static int cpu_each(cpu_backend *c, int64_t rows, int64_t d, cpu_rows_fn fn, const void *arg) {
    cpu_each_job j = {.rows = rows, .fn = fn, .arg = arg};
    const int nth = c->base.n_threads;
    j.chunk = (rows + 4 * nth - 1) / (4 * nth);
    if (j.chunk < 1) j.chunk = 1;
    atomic_init(&j.next, 0);
    if (rows * d < CPU_SERIAL_ELEMS || rows == 1)
        cpu_each_job_run(&j, 0, 1);
    else
        cpu_pool_run(c->pool, cpu_each_job_run, &j);
    return FU_OK;
}

/* ---- rmsnorm ------------------------------------------------------------------ */

typedef struct cpu_rms_back {
    const cpu_kernels *kern;
    int64_t d;
    const float *x, *w, *dy; /* (R, d), (d) or NULL, (R, d) */
    float *dx;               /* (R, d) */
    float eps, beta;
} cpu_rms_back;

/* y = x * inv * w, inv = 1 / sqrt(mean(x^2) + eps) as the forward computes it:
 * dx = beta * dx + inv * (dy * w) - x * inv^3 / d * sum(dy * w * x). */
static void cpu_rms_back_rows(const void *arg, int64_t r0, int64_t r1) {
    const cpu_rms_back *a = arg;
    const int64_t d = a->d;
    for (int64_t r = r0; r < r1; r++) {
        const float *x = a->x + r * d, *dy = a->dy + r * d;
        float *dx = a->dx + r * d;
        const double inv = (float)(1.0 / sqrt(a->kern->sumsq(x, d) / (double)d + (double)a->eps));
        double s = 0;
        for (int64_t i = 0; i < d; i++) s += (double)dy[i] * (a->w ? a->w[i] : 1.0f) * x[i];
        const float fi = (float)inv, c = (float)(inv * inv * inv * s / (double)d);
        for (int64_t i = 0; i < d; i++) {
            float v = fi * dy[i] * (a->w ? a->w[i] : 1.0f) - x[i] * c;
            dx[i] = a->beta != 0.0f ? dx[i] + v : v;
        }
    }
}

int cpu_rmsnorm_back(op_backend *be, const op_tensor *x, const op_tensor *w, float eps, const op_tensor *dy,
                     op_tensor *dx, float beta) {
    cpu_backend *c = cpu_be(be);
    const int64_t d = x->ne[0];
    if (d == 0) return FU_OK;
    cpu_rms_back a = {c->kern, d, x->data, w ? w->data : NULL, dy->data, dx->data, eps, beta};
    return cpu_each(c, op_tensor_nelems(x) / d, d, cpu_rms_back_rows, &a);
}

/* ---- swiglu ------------------------------------------------------------------- */

#define CPU_EW_CHUNK 1024 /* elements per "row" of an element-wise op */

typedef struct cpu_swiglu_back_args {
    int64_t n;
    const float *g, *u, *dout;
    float *dg, *du; /* dg may be dout */
} cpu_swiglu_back_args;

/* sig = sigmoid(g): dg = dout * u * sig * (1 + g * (1 - sig)), du = dout * g * sig. */
static void cpu_swiglu_back_rows(const void *arg, int64_t r0, int64_t r1) {
    const cpu_swiglu_back_args *a = arg;
    const int64_t i1 = r1 * CPU_EW_CHUNK < a->n ? r1 * CPU_EW_CHUNK : a->n;
    for (int64_t i = r0 * CPU_EW_CHUNK; i < i1; i++) {
        const float g = a->g[i], d = a->dout[i], sig = 1.0f / (1.0f + expf(-g));
        a->dg[i] = d * a->u[i] * sig * (1.0f + g * (1.0f - sig));
        a->du[i] = d * g * sig;
    }
}

int cpu_swiglu_back(op_backend *be, const op_tensor *gate, const op_tensor *up, const op_tensor *dout,
                    op_tensor *dgate, op_tensor *dup) {
    const int64_t n = op_tensor_nelems(gate);
    cpu_swiglu_back_args a = {n, gate->data, up->data, dout->data, dgate->data, dup->data};
    return cpu_each(cpu_be(be), (n + CPU_EW_CHUNK - 1) / CPU_EW_CHUNK, CPU_EW_CHUNK, cpu_swiglu_back_rows, &a);
}

/* ---- cross-entropy ------------------------------------------------------------ */

typedef struct cpu_xent {
    int64_t v;
    float *logits; /* (R, v) in place */
    const int32_t *target;
    float weight;
    float *loss;      /* (R) or NULL */
    uint8_t *correct; /* (R) or NULL */
} cpu_xent;

/* One row: loss = logsumexp - x[target] (max subtracted, sum in double), the
 * row becomes weight * (softmax - onehot), the target's entry as -weight *
 * (sum of the others' exp) / sum, exact where p rounds to 1 in f32; target
 * -1: all zero. */
static void cpu_xent_row(const cpu_xent *a, int64_t r) {
    float *x = a->logits + r * a->v;
    const int32_t tg = a->target[r];
    if (tg < 0) {
        memset(x, 0, (size_t)a->v * sizeof(float));
        if (a->loss) a->loss[r] = 0.0f;
        if (a->correct) a->correct[r] = 0;
        return;
    }
    int64_t am = 0;
    for (int64_t i = 1; i < a->v; i++) am = x[i] > x[am] ? i : am;
    const float mx = x[am], xt = x[tg];
    double sum = 0;
    for (int64_t i = 0; i < a->v; i++) {
        x[i] = expf(x[i] - mx);
        sum += x[i];
    }
    if (a->loss) a->loss[r] = (float)((double)mx + log(sum) - (double)xt);
    if (a->correct) a->correct[r] = am == tg;
    const float f = (float)(a->weight / sum);
    const double rest = sum - x[tg]; /* the target's p - 1 without cancellation in f32 */
    for (int64_t i = 0; i < a->v; i++) x[i] *= f;
    x[tg] = (float)(-a->weight * rest / sum);
}

/* Rows [r0, r1) of cross_entropy (cpu_rows_fn). */
static void cpu_xent_rows(const void *arg, int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; r++) cpu_xent_row(arg, r);
}

int cpu_cross_entropy(op_backend *be, op_tensor *logits, const int32_t *target, float weight, float *loss,
                      uint8_t *correct) {
    const int64_t v = logits->ne[0];
    if (v == 0) return FU_OK;
    cpu_xent a = {v, logits->data, target, weight, loss, correct};
    return cpu_each(cpu_be(be), op_tensor_nelems(logits) / v, v, cpu_xent_rows, &a);
}

/* ---- dropout ------------------------------------------------------------------ */

typedef struct cpu_dropout_args {
    int64_t n, row0;
    float *x; /* (R, n) in place */
    float p;
    uint64_t seed;
} cpu_dropout_args;

/* Rows [r0, r1) of dropout (cpu_rows_fn): the mask of op_dropout_u, kept ones scaled. */
static void cpu_dropout_rows(const void *arg, int64_t r0, int64_t r1) {
    const cpu_dropout_args *a = arg;
    const float keep = 1.0f / (1.0f - a->p);
    for (int64_t r = r0; r < r1; r++) {
        float *x = a->x + r * a->n;
        for (int64_t c = 0; c < a->n; c++)
            x[c] = op_dropout_u(a->seed, (uint64_t)(a->row0 + r), (uint64_t)c) >= a->p ? x[c] * keep : 0.0f;
    }
}

int cpu_dropout(op_backend *be, op_tensor *x, float p, uint64_t seed, int64_t row0) {
    const int64_t n = x->ne[0];
    if (n == 0) return FU_OK;
    cpu_dropout_args a = {n, row0, x->data, p, seed};
    return cpu_each(cpu_be(be), op_tensor_nelems(x) / n, n, cpu_dropout_rows, &a);
}

/* ---- attention ---------------------------------------------------------------- */

typedef struct cpu_attn_back_job {
    const cpu_kernels *kern;
    const op_attn_train *a;
    int64_t T;
    const float *q, *k, *v, *out, *dout; /* (T, H, hd), (T, KVH, hd) x 2, (T, H, hd) x 2 */
    float *dq, *dk, *dv;                 /* (T, H, hd), (T, KVH, hd) x 2 */
    _Atomic int64_t next;                /* next (row, KV head) task: only an example's first row works */
} cpu_attn_back_job;

/* Softmax statistics of query qt over the rows [s, t]: *mx their largest
 * score, returned the sum of exp(score - *mx), online over chunks. */
static float cpu_attn_back_stats(const cpu_attn_back_job *j, const float *qt, const uint8_t *kb, size_t stride,
                                 int n, float *mx) {
    const int hd = j->a->head_dim;
    float sc[CPU_ATTN_CHUNK], l = 0.0f;
    *mx = -INFINITY;
    for (int j0 = 0; j0 < n; j0 += CPU_ATTN_CHUNK) {
        const int cn = n - j0 < CPU_ATTN_CHUNK ? n - j0 : CPU_ATTN_CHUNK;
        j->kern->scores(qt, (size_t)hd, 1, kb + (size_t)j0 * stride, OP_TYPE_F32, stride, cn, hd, j->a->scale, sc);
        float cm = sc[0];
        for (int i = 1; i < cn; i++) cm = sc[i] > cm ? sc[i] : cm;
        if (cm > *mx) {
            l *= expf(*mx - cm); /* 0 on the first chunk */
            *mx = cm;
        }
        l += j->kern->exp_sum(sc, cn, *mx);
    }
    return l;
}

/* rows[i * ld + d] += coef[i] * vec[d] for i < n, d < hd: the attention
 * backward's rank-1 updates of dk and dv, compiled for each ISA (this file is
 * built without ISA flags) and picked at load time. */
__attribute__((target_clones("avx512f", "avx2", "default"))) static void
cpu_rank1(float *restrict rows, int64_t ld, int n, const float *restrict coef, const float *restrict vec, int hd) {
    for (int i = 0; i < n; i++) {
        float *r = rows + (int64_t)i * ld;
        const float c = coef[i];
        for (int d = 0; d < hd; d++) r[d] += c * vec[d];
    }
}

/* Query row t, head h of the example starting at row s, KV head g: P_u =
 * softmax(scale q_t . k_u), dS_u = P_u (dout_t . v_u - dout_t . out_t);
 * dq_t = scale sum_u dS_u k_u, dk_u += scale dS_u q_t, dv_u += P_u dout_t. */
static void cpu_attn_back_query(const cpu_attn_back_job *j, int64_t s, int64_t t, int h, int g) {
    const op_attn_train *a = j->a;
    const int hd = a->head_dim, n = (int)(t - s + 1);
    const int64_t qo = (t * a->n_heads + h) * hd, kvs = (int64_t)a->n_kv_heads * hd, ko = s * kvs + (int64_t)g * hd;
    const float *qt = j->q + qo, *dot = j->dout + qo, *ot = j->out + qo;
    const uint8_t *kb = (const uint8_t *)(j->k + ko), *vb = (const uint8_t *)(j->v + ko);
    const size_t stride = (size_t)kvs * sizeof(float);
    float mx, sc[CPU_ATTN_CHUNK], dp[CPU_ATTN_CHUNK], dqa[CPU_ATTN_MAX_HD];
    const float il = 1.0f / cpu_attn_back_stats(j, qt, kb, stride, n, &mx);
    float D = 0.0f;
    for (int d = 0; d < hd; d++) D += dot[d] * ot[d];
    memset(dqa, 0, (size_t)hd * sizeof(float));
    for (int j0 = 0; j0 < n; j0 += CPU_ATTN_CHUNK) {
        const int cn = n - j0 < CPU_ATTN_CHUNK ? n - j0 : CPU_ATTN_CHUNK;
        j->kern->scores(qt, (size_t)hd, 1, kb + (size_t)j0 * stride, OP_TYPE_F32, stride, cn, hd, a->scale, sc);
        j->kern->scores(dot, (size_t)hd, 1, vb + (size_t)j0 * stride, OP_TYPE_F32, stride, cn, hd, 1.0f, dp);
        j->kern->exp_sum(sc, cn, mx); /* sc = exp(score - max) */
        for (int i = 0; i < cn; i++) {
            sc[i] *= il;                             /* P */
            dp[i] = a->scale * sc[i] * (dp[i] - D); /* scale dS */
        }
        cpu_rank1(j->dk + ko + j0 * kvs, kvs, cn, dp, qt, hd);
        cpu_rank1(j->dv + ko + j0 * kvs, kvs, cn, sc, dot, hd);
        j->kern->accum(dp, 1, kb + (size_t)j0 * stride, OP_TYPE_F32, stride, cn, hd, dqa);
    }
    memcpy(j->dq + qo, dqa, (size_t)hd * sizeof(float));
}

/* One example [s, e) and KV head g: its dk / dv rows zeroed, then every query
 * row and every query head of the group. */
static void cpu_attn_back_task(const cpu_attn_back_job *j, int64_t s, int g) {
    const op_attn_train *a = j->a;
    const int hd = a->head_dim, group = a->n_heads / a->n_kv_heads;
    int64_t e = s + 1;
    while (e < j->T && a->first[e] == s) e++;
    for (int64_t u = s; u < e; u++) {
        memset(j->dk + (u * a->n_kv_heads + g) * hd, 0, (size_t)hd * sizeof(float));
        memset(j->dv + (u * a->n_kv_heads + g) * hd, 0, (size_t)hd * sizeof(float));
    }
    for (int64_t t = s; t < e; t++)
        for (int h = g * group; h < (g + 1) * group; h++) cpu_attn_back_query(j, s, t, h, g);
}

/* Takes (row, KV head) tasks from the shared counter; a row that starts an
 * example runs its task, the others are skipped. */
static void cpu_attn_back_run(void *arg, int ith, int nth) {
    (void)ith;
    (void)nth;
    cpu_attn_back_job *j = arg;
    const int kvh = j->a->n_kv_heads;
    for (;;) {
        int64_t task = atomic_fetch_add_explicit(&j->next, 1, memory_order_relaxed);
        if (task >= j->T * kvh) break;
        const int64_t s = task / kvh;
        if (j->a->first[s] == s) cpu_attn_back_task(j, s, (int)(task % kvh));
    }
}

int cpu_attention_back(op_backend *be, const op_attn_train *a, const op_tensor *q, const op_tensor *k,
                       const op_tensor *v, const op_tensor *out, const op_tensor *dout, op_tensor *dq,
                       op_tensor *dk, op_tensor *dv) {
    cpu_backend *c = cpu_be(be);
    if (a->head_dim > CPU_ATTN_MAX_HD)
        return fu_errorf(FU_ERR_UNSUPPORTED, "attention_back: head_dim %d above %d", a->head_dim, CPU_ATTN_MAX_HD);
    cpu_attn_back_job j = {.kern = c->kern, .a = a, .T = q->ne[2] * q->ne[3], .q = q->data, .k = k->data,
                           .v = v->data, .out = out->data, .dout = dout->data, .dq = dq->data, .dk = dk->data,
                           .dv = dv->data};
    atomic_init(&j.next, 0);
    if (j.T == 0) return FU_OK;
    cpu_pool_run(c->pool, cpu_attn_back_run, &j);
    return FU_OK;
}
