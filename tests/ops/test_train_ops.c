/* test_train_ops.c -- the training (backward) ops of the CPU backend on every ISA path and
 * thread count, against double-precision loops written here and against finite
 * differences of the forward ops.
 *
 * Backends: each of portable / avx2 / avx512 that this CPU has, with 1 and 2
 * threads. Checks and tolerances:
 *   matmul_back: every weight type (the _R16 layouts from op_repack_weight),
 *                T = 1, 7, 33, 300, K and N not multiples of any panel height,
 *                beta 0 and 1: |dx - ref| <= 1e-5 * sum_n |dy_n w_nk| + 1e-6
 *                over op_dequantize_row's weights; and the gradient of
 *                sum(g * op_matmul(W, x)) by central differences;
 *   outer_acc:   |dw - ref| <= 1e-5 * (|dw0| + |alpha| sum_t |dy x|) + 1e-6, and
 *                the weight gradient of an f32 op_matmul by differences;
 *   rmsnorm_back, swiglu_back, attention_back (GQA, packed examples, head_dim
 *                8 and 64): relative 2e-5 .. 1e-4 against the double loops,
 *                and within 1% of the largest gradient (plus a small absolute
 *                term) of central differences of op_rmsnorm / op_swiglu /
 *                op_attention over per-example views;
 *   cross_entropy: loss and gradient relative 1e-5, argmax, skipped rows,
 *                and the loss's differences;
 *   dropout:     the header's hash reproduced here bit for bit, the same mask
 *                on every backend and for any split of rows (row0);
 *   errors:      bad shapes, first[], targets, beta and types return their
 *                status and write nothing;
 *   rope:        with -pos it is the transpose of rope with pos.
 * Under the sanitizers (FUSION_SANITIZED=1) the largest shapes are skipped.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ops-test.h"
#include "ops.h"
#include "status.h"

/* ---- helpers ------------------------------------------------------------- */

static float *falloc(int64_t n) {
    float *p = malloc((size_t)(n ? n : 1) * sizeof(float));
    assert_non_null(p);
    return p;
}

typedef struct test_be {
    op_backend *be;
    char label[32];
} test_be;

#define MAX_BES 6
static test_be bes[MAX_BES];
static int n_bes;

/* Every ISA this CPU has, with 1 and 2 threads. */
static int setup_backends(void **state) {
    (void)state;
    static const op_cpu_isa isas[] = {OP_CPU_ISA_PORTABLE, OP_CPU_ISA_AVX2, OP_CPU_ISA_AVX512};
    static const char *names[] = {"portable", "avx2", "avx512"};
    n_bes = 0;
    for (int i = 0; i < 3; i++)
        for (int nt = 1; nt <= 2; nt++) {
            op_backend *be = op_backend_cpu_new(&(op_cpu_options){.n_threads = nt, .isa = isas[i]});
            assert_non_null(be);
            if (strcmp(op_backend_isa(be), names[i]) != 0) { /* the CPU lacks this level */
                op_backend_free(be);
                continue;
            }
            bes[n_bes].be = be;
            snprintf(bes[n_bes].label, sizeof bes[n_bes].label, "%s/%dt", names[i], nt);
            n_bes++;
        }
    assert_true(n_bes >= 2);
    return 0;
}

static int teardown_backends(void **state) {
    (void)state;
    for (int i = 0; i < n_bes; i++) op_backend_free(bes[i].be);
    n_bes = 0;
    return 0;
}

static double max_abs(const float *x, int64_t n) {
    double m = 0;
    for (int64_t i = 0; i < n; i++) m = fabs(x[i]) > m ? fabs(x[i]) : m;
    return m;
}

static double dot_f(const float *a, const float *b, int64_t n) {
    double s = 0;
    for (int64_t i = 0; i < n; i++) s += (double)a[i] * b[i];
    return s;
}

static void free_weight(op_tensor *w) {
    free(w->data);
    free((void *)w->row_scale);
}

/* ---- matmul_back ------------------------------------------------------------ */

/* dx = beta * dx0 + dy @ W for one type and shape on every backend. */
static void matmul_back_case(op_type type, int64_t t, int64_t n, int64_t k) {
    op_tensor w = random_weight(type, n, k);
    float *wf = falloc(n * k), *dy = falloc(t * n), *dx0 = falloc(t * k), *dx = falloc(t * k);
    for (int64_t r = 0; r < n; r++) op_dequantize_row(&w, r, wf + r * k);
    fill(dy, t * n, 1.0);
    fill(dx0, t * k, 1.0);
    op_tensor dyt = op_tensor_2d(OP_TYPE_F32, dy, n, t), dxt = op_tensor_2d(OP_TYPE_F32, dx, k, t);
    char what[64];
    snprintf(what, sizeof what, "matmul_back %s T=%lld N=%lld K=%lld", op_type_name(type), (long long)t, (long long)n,
             (long long)k);
    for (int b = 0; b < n_bes; b++)
        for (int beta = 0; beta < 2; beta++) {
            memcpy(dx, dx0, (size_t)(t * k) * sizeof(float));
            assert_int_equal(op_matmul_back(bes[b].be, &w, &dyt, &dxt, (float)beta), FU_OK);
            for (int64_t i = 0; i < t; i++)
                for (int64_t c = 0; c < k; c++) {
                    double ref = beta ? dx0[i * k + c] : 0, mag = 0;
                    for (int64_t r = 0; r < n; r++) {
                        ref += (double)dy[i * n + r] * wf[r * k + c];
                        mag += fabs((double)dy[i * n + r] * wf[r * k + c]);
                    }
                    check_close(what, bes[b].label, i * k + c, dx[i * k + c], ref,
                                1e-5 * mag + 1e-6 + (beta ? 1e-7 : 0));
                }
        }
    free(wf);
    free(dy);
    free(dx0);
    free(dx);
    free_weight(&w);
}

static void test_matmul_back_types(void **state) {
    (void)state;
    static const op_type types[] = {OP_TYPE_F32,      OP_TYPE_F16,      OP_TYPE_BF16,     OP_TYPE_Q8_0,
                                    OP_TYPE_Q4_0,     OP_TYPE_Q4_1,     OP_TYPE_I8,       OP_TYPE_Q4_0_R16,
                                    OP_TYPE_Q4_1_R16, OP_TYPE_F16_R16,  OP_TYPE_BF16_R16, OP_TYPE_Q8_0_R16};
    static const int64_t ts[] = {1, 7, 33, 300};
    for (size_t i = 0; i < sizeof types / sizeof types[0]; i++)
        for (size_t j = 0; j < sizeof ts / sizeof ts[0]; j++) {
            if (sanitized() && ts[j] > 33 && i > 0) continue;
            /* K = 160, N = 48: no panel height (6, 12, 8, 16, 24) divides K */
            matmul_back_case(types[i], ts[j], 48, 160);
        }
    /* plain types: K and N odd */
    matmul_back_case(OP_TYPE_F32, 37, 13, 29);
    matmul_back_case(OP_TYPE_F16, 300, 7, 3);
    matmul_back_case(OP_TYPE_BF16, 1, 5, 41);
}

/* A long reduction (N = 1100 > one K slice) and a tall output. */
static void test_matmul_back_large(void **state) {
    (void)state;
    if (sanitized()) skip();
    matmul_back_case(OP_TYPE_Q4_0_R16, 70, 1104, 96);
    matmul_back_case(OP_TYPE_Q8_0, 260, 600, 256);
}

/* L(x) = sum(g * op_matmul(W, x)): dL/dx = op_matmul_back(W, g), checked by
 * central differences of the forward (linear, so any step works). */
static void test_matmul_back_fd(void **state) {
    (void)state;
    enum { T = 3, N = 16, K = 64 };
    static const op_type types[] = {OP_TYPE_F32, OP_TYPE_Q4_0, OP_TYPE_Q8_0_R16};
    for (size_t ti = 0; ti < 3; ti++) {
        op_tensor w = random_weight(types[ti], N, K);
        float x[T * K], g[T * N], y[T * N], dx[T * K];
        fill(x, T * K, 1.0);
        fill(g, T * N, 1.0);
        op_tensor xt = op_tensor_2d(OP_TYPE_F32, x, K, T), yt = op_tensor_2d(OP_TYPE_F32, y, N, T);
        op_tensor gt = op_tensor_2d(OP_TYPE_F32, g, N, T), dxt = op_tensor_2d(OP_TYPE_F32, dx, K, T);
        for (int b = 0; b < n_bes; b++) {
            op_backend *be = bes[b].be;
            assert_int_equal(op_matmul_back(be, &w, &gt, &dxt, 0.0f), FU_OK);
            for (int i = 0; i < T * K; i += 7) {
                const float x0 = x[i], h = 0.25f;
                x[i] = x0 + h;
                assert_int_equal(op_matmul(be, &w, &xt, &yt), FU_OK);
                double lp = dot_f(g, y, T * N);
                x[i] = x0 - h;
                assert_int_equal(op_matmul(be, &w, &xt, &yt), FU_OK);
                double lm = dot_f(g, y, T * N);
                x[i] = x0;
                check_close("matmul_back vs differences", bes[b].label, i, dx[i], (lp - lm) / (2 * h),
                            1e-3 * max_abs(dx, T * K) + 1e-4);
            }
        }
        free_weight(&w);
    }
}

/* ---- outer_acc ----------------------------------------------------------------- */

static void outer_acc_case(int64_t n, int64_t k, int64_t t, float alpha) {
    float *dw0 = falloc(n * k), *dw = falloc(n * k), *dy = falloc(t * n), *x = falloc(t * k);
    fill(dw0, n * k, 1.0);
    fill(dy, t * n, 1.0);
    fill(x, t * k, 1.0);
    op_tensor dwt = op_tensor_2d(OP_TYPE_F32, dw, k, n), dyt = op_tensor_2d(OP_TYPE_F32, dy, n, t);
    op_tensor xt = op_tensor_2d(OP_TYPE_F32, x, k, t);
    char what[64];
    snprintf(what, sizeof what, "outer_acc N=%lld K=%lld T=%lld", (long long)n, (long long)k, (long long)t);
    for (int b = 0; b < n_bes; b++) {
        memcpy(dw, dw0, (size_t)(n * k) * sizeof(float));
        assert_int_equal(op_outer_acc(bes[b].be, &dwt, &dyt, &xt, alpha), FU_OK);
        for (int64_t r = 0; r < n; r++)
            for (int64_t c = 0; c < k; c++) {
                double s = 0, mag = 0;
                for (int64_t i = 0; i < t; i++) {
                    s += (double)dy[i * n + r] * x[i * k + c];
                    mag += fabs((double)dy[i * n + r] * x[i * k + c]);
                }
                check_close(what, bes[b].label, r * k + c, dw[r * k + c], dw0[r * k + c] + alpha * s,
                            1e-5 * (fabs(dw0[r * k + c]) + fabs(alpha) * mag) + 1e-6);
            }
    }
    free(dw0);
    free(dw);
    free(dy);
    free(x);
}

static void test_outer_acc(void **state) {
    (void)state;
    outer_acc_case(8, 200, 300, 0.5f);  /* LoRA A's gradient: rank 8 rows */
    outer_acc_case(130, 8, 77, -2.0f);  /* LoRA B's: rank 8 columns */
    outer_acc_case(33, 47, 1, 1.0f);
    outer_acc_case(5, 3, 1100, 1.0f);   /* reduction over several K slices */
    if (!sanitized()) outer_acc_case(96, 256, 600, 0.25f);
}

/* dW of L = sum(g * op_matmul(W f32, x)) is g^T x: op_outer_acc into zeros,
 * checked by differences of the forward. */
static void test_outer_acc_fd(void **state) {
    (void)state;
    enum { T = 5, N = 6, K = 20 };
    float w[N * K], x[T * K], g[T * N], y[T * N], dw[N * K];
    fill(w, N * K, 1.0);
    fill(x, T * K, 1.0);
    fill(g, T * N, 1.0);
    op_tensor wt = op_tensor_2d(OP_TYPE_F32, w, K, N), xt = op_tensor_2d(OP_TYPE_F32, x, K, T);
    op_tensor yt = op_tensor_2d(OP_TYPE_F32, y, N, T), gt = op_tensor_2d(OP_TYPE_F32, g, N, T);
    op_tensor dwt = op_tensor_2d(OP_TYPE_F32, dw, K, N);
    for (int b = 0; b < n_bes; b++) {
        memset(dw, 0, sizeof dw);
        assert_int_equal(op_outer_acc(bes[b].be, &dwt, &gt, &xt, 1.0f), FU_OK);
        for (int i = 0; i < N * K; i += 3) {
            const float w0 = w[i], h = 0.25f;
            w[i] = w0 + h;
            assert_int_equal(op_matmul(bes[b].be, &wt, &xt, &yt), FU_OK);
            double lp = dot_f(g, y, T * N);
            w[i] = w0 - h;
            assert_int_equal(op_matmul(bes[b].be, &wt, &xt, &yt), FU_OK);
            double lm = dot_f(g, y, T * N);
            w[i] = w0;
            check_close("outer_acc vs differences", bes[b].label, i, dw[i], (lp - lm) / (2 * h), 1e-4);
        }
    }
}

/* ---- rmsnorm_back ------------------------------------------------------------- */

/* The double reference of dx = beta * dx0 + d/dx sum(dy * rmsnorm(x, w)). */
static void rmsnorm_back_ref(const float *x, const float *w, const float *dy, const float *dx0, int beta, int64_t r,
                             int64_t d, float eps, double *out) {
    for (int64_t i = 0; i < r; i++) {
        const float *xi = x + i * d, *gi = dy + i * d;
        double ss = 0, s = 0;
        for (int64_t c = 0; c < d; c++) ss += (double)xi[c] * xi[c];
        double inv = 1.0 / sqrt(ss / d + eps);
        for (int64_t c = 0; c < d; c++) s += gi[c] * (w ? w[c] : 1.0) * xi[c];
        for (int64_t c = 0; c < d; c++)
            out[i * d + c] = (beta ? dx0[i * d + c] : 0) + inv * gi[c] * (w ? w[c] : 1.0) -
                             xi[c] * inv * inv * inv / d * s;
    }
}

static void rmsnorm_back_case(int64_t r, int64_t d, bool weighted) {
    const float eps = 1e-5f;
    float *x = falloc(r * d), *w = falloc(d), *dy = falloc(r * d), *dx0 = falloc(r * d), *dx = falloc(r * d);
    double *ref = malloc((size_t)(r * d) * sizeof(double));
    assert_non_null(ref);
    fill(x, r * d, 2.0);
    fill(w, d, 1.5);
    fill(dy, r * d, 1.0);
    fill(dx0, r * d, 1.0);
    op_tensor xt = op_tensor_2d(OP_TYPE_F32, x, d, r), wt = op_tensor_1d(OP_TYPE_F32, w, d);
    op_tensor dyt = op_tensor_2d(OP_TYPE_F32, dy, d, r), dxt = op_tensor_2d(OP_TYPE_F32, dx, d, r);
    for (int b = 0; b < n_bes; b++)
        for (int beta = 0; beta < 2; beta++) {
            memcpy(dx, dx0, (size_t)(r * d) * sizeof(float));
            assert_int_equal(op_rmsnorm_back(bes[b].be, &xt, weighted ? &wt : NULL, eps, &dyt, &dxt, (float)beta),
                             FU_OK);
            rmsnorm_back_ref(x, weighted ? w : NULL, dy, dx0, beta, r, d, eps, ref);
            for (int64_t i = 0; i < r * d; i++)
                check_close("rmsnorm_back", bes[b].label, i, dx[i], ref[i], 2e-5 * (fabs(ref[i]) + 1.0));
        }
    free(x);
    free(w);
    free(dy);
    free(dx0);
    free(dx);
    free(ref);
}

static void test_rmsnorm_back(void **state) {
    (void)state;
    rmsnorm_back_case(5, 64, true);
    rmsnorm_back_case(3, 33, false);
    rmsnorm_back_case(300, 256, true); /* spread over the pool */
}

/* dx of L = sum(g * op_rmsnorm(x, w)) against central differences. */
static void test_rmsnorm_back_fd(void **state) {
    (void)state;
    enum { R = 3, D = 24 };
    const float eps = 1e-6f;
    float x[R * D], w[D], g[R * D], y[R * D], dx[R * D];
    fill(x, R * D, 1.0);
    fill(w, D, 1.0);
    fill(g, R * D, 1.0);
    op_tensor xt = op_tensor_2d(OP_TYPE_F32, x, D, R), wt = op_tensor_1d(OP_TYPE_F32, w, D);
    op_tensor yt = op_tensor_2d(OP_TYPE_F32, y, D, R), gt = op_tensor_2d(OP_TYPE_F32, g, D, R);
    op_tensor dxt = op_tensor_2d(OP_TYPE_F32, dx, D, R);
    for (int b = 0; b < n_bes; b++) {
        assert_int_equal(op_rmsnorm_back(bes[b].be, &xt, &wt, eps, &gt, &dxt, 0.0f), FU_OK);
        const double tol = 1e-2 * max_abs(dx, R * D) + 1e-3;
        for (int i = 0; i < R * D; i++) {
            const float x0 = x[i], h = 1e-2f;
            x[i] = x0 + h;
            assert_int_equal(op_rmsnorm(bes[b].be, &xt, &wt, eps, &yt), FU_OK);
            double lp = dot_f(g, y, R * D);
            x[i] = x0 - h;
            assert_int_equal(op_rmsnorm(bes[b].be, &xt, &wt, eps, &yt), FU_OK);
            double lm = dot_f(g, y, R * D);
            x[i] = x0;
            check_close("rmsnorm_back vs differences", bes[b].label, i, dx[i], (lp - lm) / (2 * h), tol);
        }
    }
}

/* ---- swiglu_back ---------------------------------------------------------------- */

/* d out_i / d p_i by central differences of op_swiglu(gt, ut) -> yt, p being
 * the gate's or the up's data. */
static double swiglu_diff(op_backend *be, const op_tensor *gt, const op_tensor *ut, op_tensor *yt, float *p, int i) {
    const float h = 1e-2f, p0 = p[i];
    const float *y = yt->data;
    p[i] = p0 + h;
    assert_int_equal(op_swiglu(be, gt, ut, yt), FU_OK);
    double yp = y[i];
    p[i] = p0 - h;
    assert_int_equal(op_swiglu(be, gt, ut, yt), FU_OK);
    p[i] = p0;
    return (yp - y[i]) / (2 * h);
}

static void test_swiglu_back(void **state) {
    (void)state;
    enum { N = 40000 }; /* above the serial threshold: split over the pool */
    float *g = falloc(N), *u = falloc(N), *dout = falloc(N), *dg = falloc(N), *du = falloc(N), *y = falloc(N);
    fill(g, N, 6.0);
    fill(u, N, 2.0);
    op_tensor gt = op_tensor_1d(OP_TYPE_F32, g, N), ut = op_tensor_1d(OP_TYPE_F32, u, N);
    op_tensor dot = op_tensor_1d(OP_TYPE_F32, dout, N), dgt = op_tensor_1d(OP_TYPE_F32, dg, N);
    op_tensor dut = op_tensor_1d(OP_TYPE_F32, du, N), yt = op_tensor_1d(OP_TYPE_F32, y, N);
    for (int b = 0; b < n_bes; b++)
        for (int alias = 0; alias < 2; alias++) {
            fill(dout, N, 1.0);
            float *d0 = falloc(N);
            memcpy(d0, dout, N * sizeof(float));
            assert_int_equal(op_swiglu_back(bes[b].be, &gt, &ut, &dot, alias ? &dot : &dgt, &dut), FU_OK);
            const float *dgr = alias ? dout : dg;
            for (int i = 0; i < N; i++) {
                double s = 1.0 / (1.0 + exp(-(double)g[i]));
                double wg = d0[i] * u[i] * s * (1 + g[i] * (1 - s)), wu = d0[i] * g[i] * s;
                /* 1 + g (1 - s) cancels near g = -1.28: relative to its terms */
                check_close("swiglu_back dgate", bes[b].label, i, dgr[i], wg,
                            1e-5 * fabs(d0[i] * u[i] * s) * (1 + fabs(g[i])) + 1e-8);
                check_close("swiglu_back dup", bes[b].label, i, du[i], wu, 1e-5 * (fabs(wu) + 1e-3));
            }
            free(d0);
        }
    /* differences of op_swiglu: out_i depends on g_i and u_i only */
    fill(dout, N, 1.0);
    assert_int_equal(op_swiglu_back(bes[0].be, &gt, &ut, &dot, &dgt, &dut), FU_OK);
    for (int i = 0; i < N; i += 997) {
        check_close("swiglu_back dgate vs differences", bes[0].label, i, dg[i],
                    dout[i] * swiglu_diff(bes[0].be, &gt, &ut, &yt, g, i), 1e-3 * (fabs(dg[i]) + 1.0));
        check_close("swiglu_back dup vs differences", bes[0].label, i, du[i],
                    dout[i] * swiglu_diff(bes[0].be, &gt, &ut, &yt, u, i), 1e-3 * (fabs(du[i]) + 1.0));
    }
    free(g);
    free(u);
    free(dout);
    free(dg);
    free(du);
    free(y);
}

/* ---- attention_back ------------------------------------------------------------ */

typedef struct attn_case {
    int h, kvh, hd, n_ex;
    int lens[4]; /* rows per example, packed in order */
} attn_case;

/* Number of rows of c; first[] of its packed examples. */
static int attn_rows(const attn_case *c, int32_t *first) {
    int t = 0;
    for (int e = 0; e < c->n_ex; e++)
        for (int i = 0; i < c->lens[e]; i++, t++)
            if (first) first[t] = t - i;
    return t;
}

/* out = attention(q, k, v) by op_attention over per-example (len, KVH, hd)
 * views of k and v: seq[t] = the example, pos[t] = t - first[t]. */
static void attn_forward(op_backend *be, const attn_case *c, const int32_t *first, int T, float *q, float *k,
                         float *v, float *out) {
    op_tensor kv[8], vv[8];
    int32_t seq[512], pos[512];
    assert_true(T <= 512 && c->n_ex <= 8);
    for (int e = 0, s = 0; e < c->n_ex; s += c->lens[e], e++) {
        kv[e] = op_tensor_3d(OP_TYPE_F32, k + (size_t)s * c->kvh * c->hd, c->hd, c->kvh, c->lens[e]);
        vv[e] = op_tensor_3d(OP_TYPE_F32, v + (size_t)s * c->kvh * c->hd, c->hd, c->kvh, c->lens[e]);
        for (int i = 0; i < c->lens[e]; i++) seq[s + i] = e;
    }
    for (int t = 0; t < T; t++) pos[t] = t - first[t];
    op_attn a = {c->h, c->kvh, c->hd, 1.0f / sqrtf((float)c->hd), c->n_ex, seq, pos, kv, vv};
    op_tensor qt = op_tensor_3d(OP_TYPE_F32, q, c->hd, c->h, T), ot = op_tensor_3d(OP_TYPE_F32, out, c->hd, c->h, T);
    assert_int_equal(op_attention(be, &qt, &a, &ot), FU_OK);
}

/* The double reference of dq, dk, dv (dk, dv zeroed first). */
static void attn_back_ref(const attn_case *c, const int32_t *first, int T, const float *q, const float *k,
                          const float *v, const float *dout, double *dq, double *dk, double *dv) {
    const int hd = c->hd, grp = c->h / c->kvh;
    const double scale = 1.0 / sqrt((double)hd);
    memset(dk, 0, (size_t)T * c->kvh * hd * sizeof(double));
    memset(dv, 0, (size_t)T * c->kvh * hd * sizeof(double));
    double *p = malloc((size_t)T * sizeof(double)), *o = malloc((size_t)hd * sizeof(double));
    assert_true(p && o);
    for (int t = 0; t < T; t++)
        for (int h = 0; h < c->h; h++) {
            const int g = h / grp;
            const float *qt = q + ((size_t)t * c->h + h) * hd, *gt = dout + ((size_t)t * c->h + h) * hd;
            double mx = -INFINITY, l = 0, D = 0;
            for (int u = first[t]; u <= t; u++) {
                p[u] = scale * dot_f(qt, k + ((size_t)u * c->kvh + g) * hd, hd);
                mx = p[u] > mx ? p[u] : mx;
            }
            for (int u = first[t]; u <= t; u++) l += (p[u] = exp(p[u] - mx));
            for (int u = first[t]; u <= t; u++) p[u] /= l;
            memset(o, 0, (size_t)hd * sizeof(double));
            for (int u = first[t]; u <= t; u++)
                for (int d = 0; d < hd; d++) o[d] += p[u] * v[((size_t)u * c->kvh + g) * hd + d];
            for (int d = 0; d < hd; d++) D += gt[d] * o[d];
            double *dqt = dq + ((size_t)t * c->h + h) * hd;
            memset(dqt, 0, (size_t)hd * sizeof(double));
            for (int u = first[t]; u <= t; u++) {
                const size_t kv = ((size_t)u * c->kvh + g) * hd;
                const double ds = p[u] * (dot_f(gt, v + kv, hd) - D);
                for (int d = 0; d < hd; d++) {
                    dqt[d] += scale * ds * k[kv + d];
                    dk[kv + d] += scale * ds * qt[d];
                    dv[kv + d] += p[u] * gt[d];
                }
            }
        }
    free(p);
    free(o);
}

static void attn_check(const char *what, const char *label, const float *got, const double *want, int64_t n) {
    double m = 0;
    for (int64_t i = 0; i < n; i++) m = fabs(want[i]) > m ? fabs(want[i]) : m;
    for (int64_t i = 0; i < n; i++) check_close(what, label, i, got[i], want[i], 1e-4 * m + 1e-6);
}

static void attention_back_case(const attn_case *c, bool fd) {
    int32_t first[512];
    const int T = attn_rows(c, first), nq = T * c->h * c->hd, nk = T * c->kvh * c->hd;
    float *q = falloc(nq), *k = falloc(nk), *v = falloc(nk), *out = falloc(nq), *dout = falloc(nq);
    float *dq = falloc(nq), *dk = falloc(nk), *dv = falloc(nk), *o2 = falloc(nq);
    double *rq = malloc((size_t)nq * sizeof(double)), *rk = malloc((size_t)nk * sizeof(double));
    double *rv = malloc((size_t)nk * sizeof(double));
    assert_true(rq && rk && rv);
    fill(q, nq, 1.5);
    fill(k, nk, 1.5);
    fill(v, nk, 1.0);
    fill(dout, nq, 1.0);
    attn_back_ref(c, first, T, q, k, v, dout, rq, rk, rv);
    op_attn_train a = {c->h, c->kvh, c->hd, 1.0f / sqrtf((float)c->hd), first};
    op_tensor qt = op_tensor_3d(OP_TYPE_F32, q, c->hd, c->h, T), kt = op_tensor_3d(OP_TYPE_F32, k, c->hd, c->kvh, T);
    op_tensor vt = op_tensor_3d(OP_TYPE_F32, v, c->hd, c->kvh, T), ot = op_tensor_3d(OP_TYPE_F32, out, c->hd, c->h, T);
    op_tensor gt = op_tensor_3d(OP_TYPE_F32, dout, c->hd, c->h, T), dqt = op_tensor_3d(OP_TYPE_F32, dq, c->hd, c->h, T);
    op_tensor dkt = op_tensor_3d(OP_TYPE_F32, dk, c->hd, c->kvh, T), dvt = op_tensor_3d(OP_TYPE_F32, dv, c->hd, c->kvh, T);
    char what[80];
    snprintf(what, sizeof what, "attention_back H=%d KVH=%d hd=%d T=%d", c->h, c->kvh, c->hd, T);
    for (int b = 0; b < n_bes; b++) {
        op_backend *be = bes[b].be;
        attn_forward(be, c, first, T, q, k, v, out);
        fill(dq, nq, 9.0); /* overwritten, whatever they held */
        fill(dk, nk, 9.0);
        fill(dv, nk, 9.0);
        assert_int_equal(op_attention_back(be, &a, &qt, &kt, &vt, &ot, &gt, &dqt, &dkt, &dvt), FU_OK);
        attn_check(what, bes[b].label, dq, rq, nq);
        attn_check(what, bes[b].label, dk, rk, nk);
        attn_check(what, bes[b].label, dv, rv, nk);
        if (!fd) continue;
        /* L = sum(dout * attention(q, k, v)) by differences, on a sample of entries */
        float *xs[3] = {q, k, v}, *gs[3] = {dq, dk, dv};
        const int ns[3] = {nq, nk, nk};
        for (int w = 0; w < 3; w++) {
            const double tol = 1e-2 * max_abs(gs[w], ns[w]) + 2e-3;
            for (int i = w; i < ns[w]; i += 11) {
                const float x0 = xs[w][i], h = 1e-2f;
                xs[w][i] = x0 + h;
                attn_forward(be, c, first, T, q, k, v, o2);
                double lp = dot_f(dout, o2, nq);
                xs[w][i] = x0 - h;
                attn_forward(be, c, first, T, q, k, v, o2);
                double lm = dot_f(dout, o2, nq);
                xs[w][i] = x0;
                check_close(w == 0 ? "attention_back dq vs differences" : w == 1 ? "attention_back dk vs differences"
                                                                                  : "attention_back dv vs differences",
                            bes[b].label, i, gs[w][i], (lp - lm) / (2 * h), tol);
            }
        }
    }
    free(q);
    free(k);
    free(v);
    free(out);
    free(dout);
    free(dq);
    free(dk);
    free(dv);
    free(o2);
    free(rq);
    free(rk);
    free(rv);
}

static void test_attention_back(void **state) {
    (void)state;
    static const attn_case cases[] = {
        {4, 2, 8, 3, {5, 1, 9}},    /* GQA, packed examples of 5, 1 and 9 rows */
        {6, 2, 64, 2, {7, 4}},      /* groups of 3, head_dim 64 */
        {2, 2, 8, 1, {1}},          /* one row */
        {4, 1, 8, 2, {70, 3}},      /* one KV head, an example past a score chunk (64) */
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) attention_back_case(&cases[i], i != 3);
    if (!sanitized()) {
        static const attn_case big = {8, 2, 64, 4, {150, 33, 90, 200}};
        attention_back_case(&big, false);
    }
}

/* ---- cross_entropy --------------------------------------------------------------- */

static void test_cross_entropy(void **state) {
    (void)state;
    enum { R = 7, V = 5003 };
    const int32_t target[R] = {3, -1, 0, 5002, 17, 17, 2500};
    const float weight = 0.25f;
    float *x0 = falloc(R * V), *x = falloc(R * V);
    fill(x0, R * V, 8.0);
    x0[4 * V + 17] = 30.0f; /* row 4: the target is the largest logit */
    x0[5 * V + 17] = 30.0f; /* row 5: tied with an earlier logit, which wins */
    x0[5 * V + 2] = 30.0f;
    op_tensor xt = op_tensor_2d(OP_TYPE_F32, x, V, R);
    for (int b = 0; b < n_bes; b++) {
        float loss[R];
        uint8_t correct[R];
        memcpy(x, x0, (size_t)R * V * sizeof(float));
        assert_int_equal(op_cross_entropy(bes[b].be, &xt, target, weight, loss, correct), FU_OK);
        for (int r = 0; r < R; r++) {
            const float *xr = x0 + (size_t)r * V;
            if (target[r] < 0) {
                assert_true(loss[r] == 0.0f && correct[r] == 0 && max_abs(x + (size_t)r * V, V) == 0.0);
                continue;
            }
            double mx = xr[0], sum = 0;
            int am = 0;
            for (int i = 1; i < V; i++)
                if (xr[i] > mx) mx = xr[i], am = i;
            for (int i = 0; i < V; i++) sum += exp(xr[i] - mx);
            check_close("cross_entropy loss", bes[b].label, r, loss[r], mx + log(sum) - xr[target[r]],
                        1e-5 * (mx + log(sum)) + 1e-6);
            assert_int_equal(correct[r], am == target[r]);
            for (int i = 0; i < V; i++) {
                double want = weight * (exp(xr[i] - mx) / sum - (i == target[r]));
                check_close("cross_entropy gradient", bes[b].label, (int64_t)r * V + i, x[(size_t)r * V + i], want,
                            1e-5 * fabs(want) + 1e-9);
            }
        }
        assert_true(correct[4] == 1 && correct[5] == 0);
        /* NULL loss and correct */
        memcpy(x, x0, (size_t)R * V * sizeof(float));
        assert_int_equal(op_cross_entropy(bes[b].be, &xt, target, weight, NULL, NULL), FU_OK);
    }
    /* the gradient of weight * loss against differences of the loss */
    enum { V2 = 20 };
    float y0[V2], y[V2], g[V2], l2[1];
    const int32_t t2[1] = {7};
    fill(y0, V2, 3.0);
    op_tensor yt = op_tensor_2d(OP_TYPE_F32, y, V2, 1);
    memcpy(g, y0, sizeof g);
    op_tensor gt = op_tensor_2d(OP_TYPE_F32, g, V2, 1);
    assert_int_equal(op_cross_entropy(bes[0].be, &gt, t2, 1.0f, l2, NULL), FU_OK);
    for (int i = 0; i < V2; i++) {
        const float h = 1e-2f;
        float lp, lm;
        memcpy(y, y0, sizeof y);
        y[i] += h;
        assert_int_equal(op_cross_entropy(bes[0].be, &yt, t2, 1.0f, &lp, NULL), FU_OK);
        memcpy(y, y0, sizeof y);
        y[i] -= h;
        assert_int_equal(op_cross_entropy(bes[0].be, &yt, t2, 1.0f, &lm, NULL), FU_OK);
        check_close("cross_entropy vs differences", bes[0].label, i, g[i], (lp - lm) / (2 * h), 2e-3);
    }
    free(x0);
    free(x);
}

/* ---- dropout ---------------------------------------------------------------------- */

/* The hash of ops.h, written out again. */
static bool dropout_keep(uint64_t seed, int64_t row, int64_t col, float p) {
    uint64_t z = seed ^ ((uint64_t)row * 0xD1B54A32D192ED03ull) ^ ((uint64_t)col * 0x9E3779B97F4A7C15ull);
    z += 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    return (float)(z >> 40) * 0x1p-24f >= p;
}

static void test_dropout(void **state) {
    (void)state;
    enum { R = 37, N = 1000 };
    const float p = 0.3f, keep = 1.0f / (1.0f - p);
    const uint64_t seed = 0x1234567890abcdefull;
    const int64_t row0 = 1000003;
    float *x0 = falloc(R * N), *x = falloc(R * N), *part = falloc(R * N);
    fill(x0, R * N, 1.0);
    op_tensor xt = op_tensor_2d(OP_TYPE_F32, x, N, R);
    for (int b = 0; b < n_bes; b++) {
        memcpy(x, x0, (size_t)R * N * sizeof(float));
        assert_int_equal(op_dropout(bes[b].be, &xt, p, seed, row0), FU_OK);
        int64_t kept = 0;
        for (int64_t r = 0; r < R; r++)
            for (int64_t c = 0; c < N; c++) {
                const bool k = dropout_keep(seed, row0 + r, c, p);
                const float want = k ? x0[r * N + c] * keep : 0.0f;
                kept += k;
                if (memcmp(&x[r * N + c], &want, sizeof want) != 0)
                    fail_msg("dropout [%s] (%lld, %lld): got %.9g want %.9g", bes[b].label, (long long)r,
                             (long long)c, x[r * N + c], want);
            }
        const double frac = (double)kept / (R * N);
        if (fabs(frac - (1 - p)) > 0.02) fail_msg("dropout [%s]: kept %.4f, not about %.2f", bes[b].label, frac, 1 - p);
        /* rows 5.. alone, with row0 + 5: the same mask */
        memcpy(part, x0, (size_t)R * N * sizeof(float));
        op_tensor pt = op_tensor_2d(OP_TYPE_F32, part + 5 * N, N, R - 5);
        assert_int_equal(op_dropout(bes[b].be, &pt, p, seed, row0 + 5), FU_OK);
        assert_memory_equal(part + 5 * N, x + 5 * N, (size_t)(R - 5) * N * sizeof(float));
    }
    /* p = 0: a no-op; another seed: another mask */
    memcpy(x, x0, (size_t)R * N * sizeof(float));
    assert_int_equal(op_dropout(bes[0].be, &xt, 0.0f, seed, 0), FU_OK);
    assert_memory_equal(x, x0, (size_t)R * N * sizeof(float));
    assert_int_equal(op_dropout(bes[0].be, &xt, p, seed + 1, row0), FU_OK);
    int same = 0;
    for (int64_t c = 0; c < N; c++) same += dropout_keep(seed, row0, c, p) == (x[c] != 0.0f);
    assert_true(same < N * 9 / 10);
    free(x0);
    free(x);
    free(part);
}

/* ---- errors --------------------------------------------------------------------------- */

/* Each bad call returns its status and leaves every output as it was. */
static void test_errors(void **state) {
    (void)state;
    op_backend *be = bes[0].be;
    assert_true(op_backend_can_train(be));
    float w[4 * 8], a[64], b[64], c[64], d[64], e[64], f[64], snap[64];
    fill(w, 32, 1.0);
    fill(a, 64, 1.0);
    fill(b, 64, 1.0);
    fill(c, 64, 1.0);
    op_tensor wt = op_tensor_2d(OP_TYPE_F32, w, 8, 4); /* (N 4, K 8) */
    op_tensor dy = op_tensor_2d(OP_TYPE_F32, a, 4, 3), dx = op_tensor_2d(OP_TYPE_F32, c, 8, 3);
    op_tensor bad = op_tensor_2d(OP_TYPE_F32, c, 7, 3);
    memcpy(snap, c, sizeof c);
    assert_int_equal(op_matmul_back(be, &wt, &dy, &bad, 0.0f), FU_ERR_INVALID);
    assert_int_equal(op_matmul_back(be, &wt, &dy, &dx, 0.5f), FU_ERR_INVALID);
    op_tensor dx16 = op_tensor_2d(OP_TYPE_F16, c, 8, 3);
    assert_int_equal(op_matmul_back(be, &wt, &dy, &dx16, 0.0f), FU_ERR_INVALID);
    op_tensor dy2 = op_tensor_2d(OP_TYPE_F32, a, 4, 2);
    assert_int_equal(op_matmul_back(be, &wt, &dy2, &dx, 0.0f), FU_ERR_INVALID);
    assert_memory_equal(c, snap, sizeof c);

    op_tensor dw = op_tensor_2d(OP_TYPE_F32, c, 8, 4), xx = op_tensor_2d(OP_TYPE_F32, b, 8, 2);
    assert_int_equal(op_outer_acc(be, &dw, &dy, &xx, 1.0f), FU_ERR_INVALID); /* T 3 vs 2 */
    assert_memory_equal(c, snap, sizeof c);

    op_tensor x8 = op_tensor_2d(OP_TYPE_F32, a, 8, 3), g8 = op_tensor_2d(OP_TYPE_F32, b, 8, 3);
    op_tensor w7 = op_tensor_1d(OP_TYPE_F32, w, 7);
    assert_int_equal(op_rmsnorm_back(be, &x8, &w7, 1e-5f, &g8, &dx, 0.0f), FU_ERR_INVALID);
    assert_int_equal(op_rmsnorm_back(be, &x8, NULL, 1e-5f, &g8, &x8, 0.0f), FU_ERR_INVALID); /* dx aliases x */
    assert_memory_equal(c, snap, sizeof c);

    op_tensor s1 = op_tensor_1d(OP_TYPE_F32, a, 24), s2 = op_tensor_1d(OP_TYPE_F32, b, 24);
    op_tensor s3 = op_tensor_1d(OP_TYPE_F32, c, 24), s4 = op_tensor_1d(OP_TYPE_F32, d, 23);
    op_tensor s5 = op_tensor_1d(OP_TYPE_F32, e, 24);
    assert_int_equal(op_swiglu_back(be, &s1, &s2, &s3, &s5, &s4), FU_ERR_INVALID);
    assert_int_equal(op_swiglu_back(be, &s1, &s2, &s3, &s5, &s1), FU_ERR_INVALID); /* dup aliases gate */
    assert_memory_equal(c, snap, sizeof c);

    /* attention: first[] inconsistent or beyond the row; H % KVH */
    int32_t firsts[][4] = {{0, 0, 1, 1}, {0, 0, 0, 4}, {1, 1, 2, 3}, {0, -1, 2, 2}};
    op_tensor q = op_tensor_3d(OP_TYPE_F32, a, 4, 4, 4), k = op_tensor_3d(OP_TYPE_F32, b, 4, 2, 4);
    op_tensor v = op_tensor_3d(OP_TYPE_F32, d, 4, 2, 4), o = op_tensor_3d(OP_TYPE_F32, e, 4, 4, 4);
    op_tensor g = op_tensor_3d(OP_TYPE_F32, f, 4, 4, 4), dq = op_tensor_3d(OP_TYPE_F32, c, 4, 4, 4);
    float dkb[32], dvb[32];
    op_tensor dk = op_tensor_3d(OP_TYPE_F32, dkb, 4, 2, 4), dv = op_tensor_3d(OP_TYPE_F32, dvb, 4, 2, 4);
    for (size_t i = 0; i < sizeof firsts / sizeof firsts[0]; i++) {
        op_attn_train at = {4, 2, 4, 0.5f, firsts[i]};
        assert_int_equal(op_attention_back(be, &at, &q, &k, &v, &o, &g, &dq, &dk, &dv), FU_ERR_RANGE);
    }
    int32_t good[4] = {0, 0, 2, 2};
    op_attn_train at = {4, 3, 4, 0.5f, good};
    assert_int_equal(op_attention_back(be, &at, &q, &k, &v, &o, &g, &dq, &dk, &dv), FU_ERR_INVALID);
    at.n_kv_heads = 2;
    assert_int_equal(op_attention_back(be, &at, &q, &k, &v, &o, &g, &dq, &dk, &dv), FU_OK);
    op_tensor kbad = op_tensor_3d(OP_TYPE_F32, b, 4, 4, 4);
    memcpy(snap, c, sizeof c);
    assert_int_equal(op_attention_back(be, &at, &q, &kbad, &v, &o, &g, &dq, &dk, &dv), FU_ERR_INVALID);
    assert_memory_equal(c, snap, sizeof c);

    /* cross_entropy: a target outside [-1, V) */
    const int32_t tg[3] = {1, 8, 0}, tg2[3] = {1, -2, 0};
    float loss[3] = {7, 7, 7};
    op_tensor lg = op_tensor_2d(OP_TYPE_F32, c, 8, 3);
    assert_int_equal(op_cross_entropy(be, &lg, tg, 1.0f, loss, NULL), FU_ERR_RANGE);
    assert_int_equal(op_cross_entropy(be, &lg, tg2, 1.0f, loss, NULL), FU_ERR_RANGE);
    assert_memory_equal(c, snap, sizeof c);
    assert_true(loss[0] == 7 && loss[1] == 7 && loss[2] == 7);

    /* dropout: p outside [0, 1) */
    assert_int_equal(op_dropout(be, &lg, 1.0f, 1, 0), FU_ERR_INVALID);
    assert_int_equal(op_dropout(be, &lg, -0.1f, 1, 0), FU_ERR_INVALID);
    assert_memory_equal(c, snap, sizeof c);
}

/* ---- rope with negative positions ------------------------------------------------- */

/* dot(rope(x, pos), y) == dot(x, rope(y, -pos)): the backward of rope is rope
 * at -pos (attn_factor 1). */
static void test_rope_transpose(void **state) {
    (void)state;
    enum { T = 4, H = 2, HD = 32 };
    int32_t pos[T] = {0, 3, 77, 4000}, neg[T];
    for (int t = 0; t < T; t++) neg[t] = -pos[t];
    float inv[HD / 2], x[T * H * HD], y[T * H * HD], rx[T * H * HD], ry[T * H * HD];
    for (int i = 0; i < HD / 2; i++) inv[i] = (float)pow(10000.0, -2.0 * i / HD);
    fill(x, T * H * HD, 1.0);
    fill(y, T * H * HD, 1.0);
    for (int mode = 0; mode < 2; mode++)
        for (int rot = 16; rot <= HD; rot += 16) {
            op_rope_params p = {(op_rope_mode)mode, rot, inv, 1.0f};
            for (int b = 0; b < n_bes; b++) {
                memcpy(rx, x, sizeof x);
                memcpy(ry, y, sizeof y);
                op_tensor rxt = op_tensor_3d(OP_TYPE_F32, rx, HD, H, T), ryt = op_tensor_3d(OP_TYPE_F32, ry, HD, H, T);
                assert_int_equal(op_rope(bes[b].be, &rxt, pos, &p), FU_OK);
                assert_int_equal(op_rope(bes[b].be, &ryt, neg, &p), FU_OK);
                for (int t = 0; t < T; t++) {
                    const size_t o = (size_t)t * H * HD;
                    check_close("rope transpose", bes[b].label, t, dot_f(rx + o, y + o, H * HD),
                                dot_f(x + o, ry + o, H * HD), 1e-5 * H * HD);
                }
            }
        }
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_matmul_back_types),
        cmocka_unit_test(test_matmul_back_large),
        cmocka_unit_test(test_matmul_back_fd),
        cmocka_unit_test(test_outer_acc),
        cmocka_unit_test(test_outer_acc_fd),
        cmocka_unit_test(test_rmsnorm_back),
        cmocka_unit_test(test_rmsnorm_back_fd),
        cmocka_unit_test(test_swiglu_back),
        cmocka_unit_test(test_attention_back),
        cmocka_unit_test(test_cross_entropy),
        cmocka_unit_test(test_dropout),
        cmocka_unit_test(test_errors),
        cmocka_unit_test(test_rope_transpose),
    };
    return cmocka_run_group_tests(tests, setup_backends, teardown_backends);
}
