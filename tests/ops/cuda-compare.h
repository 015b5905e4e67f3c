/* cuda-compare.h -- every op of a device backend against the CPU backend; shared by
 * test_cuda_emu.c (the CUDA backend under the CPU emulator) and test_cuda_gpu.c (on a GPU).
 *
 * The includer sets cmp_dev (backend under test; NULL makes every test skip)
 * and cmp_cpu (the reference: CPU backend, portable ISA, f32 matmul math) and
 * lists CMP_TESTS in its cmocka group. Inputs are random; device data goes
 * through op_buffer_alloc/op_buffer_set/op_buffer_get as real callers do.
 * Tolerances (|got - ref| <= tol), stated per check:
 *   matmul on the matvec kernels (f32 math: T <= 8 for the types cuBLAS does
 *     not take as they are): 2e-5 * sum_k |w_k x_k| + 1e-6
 *   matmul on cuBLAS (F32 / F16 / BF16 at every T, the others beyond T = 8): F32 2e-5,
 *     F16 and Q8_0/Q4_0/Q4_1/I8 (f16 operands) 4e-3, BF16 (bf16 activations)
 *     1.6e-2, times sum_k |w_k x_k|
 *   get_rows, rmsnorm, swiglu, add, add_row:   relative 1e-6 .. 1e-5
 *   rope:                                      2e-5 * max|x| (device sinf/cosf)
 *   softmax / log_softmax:                     1e-5 relative, NaN where the CPU has NaN
 *   kv_store:                                  bit-exact caches
 *   attention:                                 1e-4 * max|v| + 1e-6
 *   the engine (whole random models):          5e-3 * max|logit| + 1e-4 (CMP_ENG_TOL),
 *                                              and the same greedy tokens
 */
#ifndef FU_TEST_CUDA_COMPARE_H
#define FU_TEST_CUDA_COMPARE_H

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine.h"
#include "model.h"
#include "ops.h"
#include "sampler.h"
#include "status.h"
#include "../unit/test-model.h"

static op_backend *cmp_dev;
static op_backend *cmp_cpu;

static uint64_t cmp_rng = 0x9e3779b97f4a7c15ull;

static double cmp_rnd(void) { /* uniform in [-1, 1) */
    cmp_rng = cmp_rng * 6364136223846793005ull + 1442695040888963407ull;
    return (double)(cmp_rng >> 11) * (2.0 / 9007199254740992.0) - 1.0;
}

static void cmp_fill(float *x, int64_t n, double scale) {
    for (int64_t i = 0; i < n; i++) x[i] = (float)(scale * cmp_rnd());
}

static void *cmp_malloc(size_t n) {
    void *p = calloc(1, n ? n : 1);
    assert_non_null(p);
    return p;
}

/* Device copy of n host bytes. */
static void *cmp_put(const void *host, size_t n) {
    void *d = op_buffer_alloc(cmp_dev, n);
    if (!d) fail_msg("op_buffer_alloc(%zu): %s", n, fu_last_error());
    if (op_buffer_set(cmp_dev, d, host, n)) fail_msg("op_buffer_set: %s", fu_last_error());
    return d;
}

static void cmp_get(void *host, const void *dev, size_t n) {
    if (op_buffer_get(cmp_dev, host, dev, n)) fail_msg("op_buffer_get: %s", fu_last_error());
}

static void cmp_ok(int rc, const char *what) {
    if (rc) fail_msg("%s: %s (%s)", what, fu_status_str(rc), fu_last_error());
}

/* got[i] must be within tol[i] (or tol0 where tol is NULL) of want[i]; NaN matches NaN. */
static void cmp_close(const char *what, const float *got, const float *want, int64_t n, const double *tol,
                      double tol0) {
    for (int64_t i = 0; i < n; i++) {
        if ((isnan(want[i]) && isnan(got[i])) || got[i] == want[i]) continue; /* also equal infinities */
        double t = tol ? tol[i] : tol0;
        if (!(fabs((double)got[i] - (double)want[i]) <= t))
            fail_msg("%s: element %lld: got %.9g want %.9g (tol %.3g)", what, (long long)i, got[i], want[i], t);
    }
}

static double cmp_absmax(const float *x, int64_t n) {
    double m = 0;
    for (int64_t i = 0; i < n; i++) m = fmax(m, fabs(x[i]));
    return m;
}

#define CMP_SKIP_WITHOUT_DEVICE() \
    do {                          \
        if (!cmp_dev) skip();     \
    } while (0)

/* ---- basics -------------------------------------------------------------------------- */

static void cmp_test_basics(void **state) {
    (void)state;
    CMP_SKIP_WITHOUT_DEVICE();
    for (int t = 0; t < OP_TYPE_COUNT; t++) assert_int_equal(op_backend_supports(cmp_dev, (op_type)t), t != OP_TYPE_I32 && op_type_row_group((op_type)t) == 1);
    uint8_t *p = op_buffer_alloc(cmp_dev, 1000), host[1000];
    assert_non_null(p);
    cmp_get(host, p, sizeof host);
    for (int i = 0; i < 1000; i++) assert_int_equal(host[i], 0);
    for (int i = 0; i < 1000; i++) host[i] = (uint8_t)(i * 7);
    cmp_ok(op_buffer_set(cmp_dev, p, host, 1000), "set");
    uint8_t back[1000];
    cmp_get(back, p, sizeof back);
    assert_memory_equal(host, back, 1000);
    op_buffer_free(cmp_dev, p);
    op_buffer_free(cmp_dev, NULL);
    cmp_ok(op_reserve(cmp_dev, 64, 512), "reserve");
    cmp_ok(op_synchronize(cmp_dev), "synchronize");
    assert_int_not_equal(op_reserve(cmp_dev, -1, 4), FU_OK);
}

/* ---- matmul --------------------------------------------------------------------------- */

static const op_type cmp_weight_types[] = {OP_TYPE_F32,  OP_TYPE_F16,  OP_TYPE_BF16, OP_TYPE_Q8_0,
                                           OP_TYPE_Q4_0, OP_TYPE_Q4_1, OP_TYPE_I8};

/* Tolerance factor of matmul for a weight type and T (see the file comment). */
static double cmp_mm_tol(op_type type, int64_t t) {
    bool direct = type == OP_TYPE_F16 || type == OP_TYPE_BF16; /* cuBLAS at every T */
    if ((t <= 8 && !direct) || type == OP_TYPE_F32) return 2e-5;
    return type == OP_TYPE_BF16 ? 1.6e-2 : 4e-3;
}

/* y (T, N) = x (T, K) W^T with x / y row strides ldx >= K / ldy >= N floats. */
static void cmp_matmul_case(op_type type, int64_t t, int64_t n, int64_t k, int64_t ldx, int64_t ldy) {
    size_t rb = op_row_bytes(type, k);
    uint8_t *w = cmp_malloc(rb * (size_t)n);
    float *scales = cmp_malloc((size_t)n * sizeof(float)), *row = cmp_malloc((size_t)k * sizeof(float));
    float *wd = cmp_malloc((size_t)(n * k) * sizeof(float));
    float *x = cmp_malloc((size_t)(t * ldx) * sizeof(float));
    float *y = cmp_malloc((size_t)(t * ldy) * sizeof(float)), *yd = cmp_malloc((size_t)(t * ldy) * sizeof(float));
    double *tol = cmp_malloc((size_t)(t * ldy) * sizeof(double));
    for (int64_t r = 0; r < n; r++) {
        cmp_fill(row, k, 1.0);
        op_quantize_row(type, row, k, w + (size_t)r * rb, &scales[r]);
    }
    op_tensor wt = op_tensor_2d(type, w, k, n);
    wt.row_scale = scales;
    wt.name = "w";
    for (int64_t r = 0; r < n; r++) op_dequantize_row(&wt, r, wd + r * k);
    cmp_fill(x, t * ldx, 2.0);
    for (int64_t i = 0; i < t * ldx; i++) x[i] += 0.5f;
    for (int64_t i = 0; i < t; i++)
        for (int64_t r = 0; r < n; r++) {
            double a = 0;
            for (int64_t c = 0; c < k; c++) a += fabs((double)wd[r * k + c] * x[i * ldx + c]);
            tol[i * ldy + r] = cmp_mm_tol(type, t) * a + 1e-6;
        }
    op_tensor xt = op_tensor_2d(OP_TYPE_F32, x, k, t), yt = op_tensor_2d(OP_TYPE_F32, y, n, t);
    xt.nb[1] = (size_t)ldx * sizeof(float);
    xt.nb[2] = xt.nb[3] = xt.nb[1] * (size_t)t;
    yt.nb[1] = (size_t)ldy * sizeof(float);
    yt.nb[2] = yt.nb[3] = yt.nb[1] * (size_t)t;
    for (int64_t i = 0; i < t * ldy; i++) y[i] = yd[i] = -7.0f; /* padding must stay */
    char what[96];
    snprintf(what, sizeof what, "matmul %s T=%lld N=%lld K=%lld ldx=%lld ldy=%lld", op_type_name(type),
             (long long)t, (long long)n, (long long)k, (long long)ldx, (long long)ldy);
    cmp_ok(op_matmul(cmp_cpu, &wt, &xt, &yt), what);
    op_tensor wdv = wt, xdv = xt, ydv = yt;
    wdv.data = cmp_put(w, rb * (size_t)n);
    wdv.row_scale = cmp_put(scales, (size_t)n * sizeof(float));
    xdv.data = cmp_put(x, (size_t)(t * ldx) * sizeof(float));
    ydv.data = cmp_put(yd, (size_t)(t * ldy) * sizeof(float));
    cmp_ok(op_matmul(cmp_dev, &wdv, &xdv, &ydv), what);
    cmp_get(yd, ydv.data, (size_t)(t * ldy) * sizeof(float));
    cmp_close(what, yd, y, t * ldy, tol, 0);
    op_buffer_free(cmp_dev, wdv.data);
    op_buffer_free(cmp_dev, (void *)wdv.row_scale);
    op_buffer_free(cmp_dev, xdv.data);
    op_buffer_free(cmp_dev, ydv.data);
    free(w);
    free(scales);
    free(row);
    free(wd);
    free(x);
    free(y);
    free(yd);
    free(tol);
}

static void cmp_test_matmul(void **state) {
    (void)state;
    CMP_SKIP_WITHOUT_DEVICE();
    static const int64_t ts[] = {1, 3, 8, 9, 21};
    for (size_t i = 0; i < sizeof cmp_weight_types / sizeof cmp_weight_types[0]; i++) {
        op_type type = cmp_weight_types[i];
        for (size_t j = 0; j < sizeof ts / sizeof ts[0]; j++) cmp_matmul_case(type, ts[j], 37, 96, 96, 37);
        cmp_matmul_case(type, 2, 5, 64, 72, 9);   /* strided rows, matvec path (cuBLAS for F32 / F16 / BF16) */
        cmp_matmul_case(type, 12, 6, 64, 70, 11); /* strided rows, cuBLAS path */
        if (op_type_block_elems(type) == 1) {
            cmp_matmul_case(type, 4, 19, 40, 40, 19); /* K not a multiple of 32 */
            cmp_matmul_case(type, 10, 19, 40, 40, 19);
            /* rows of 34 and 36 elements: not whole 16-byte units */
            cmp_matmul_case(type, 1, 7, 34, 34, 7);
            cmp_matmul_case(type, 5, 7, 36, 36, 7);
        }
    }
}

static void cmp_test_matmul_errors(void **state) {
    (void)state;
    CMP_SKIP_WITHOUT_DEVICE();
    float *buf = op_buffer_alloc(cmp_dev, 4096);
    assert_non_null(buf);
    op_tensor w = op_tensor_2d(OP_TYPE_Q8_0, buf, 48, 2); /* K not a multiple of 32 */
    op_tensor x = op_tensor_2d(OP_TYPE_F32, buf, 48, 1), y = op_tensor_2d(OP_TYPE_F32, buf, 2, 1);
    assert_int_equal(op_matmul(cmp_dev, &w, &x, &y), FU_ERR_INVALID);
    w = op_tensor_2d(OP_TYPE_I8, buf, 32, 2); /* no row scales */
    x = op_tensor_2d(OP_TYPE_F32, buf, 32, 1);
    assert_int_equal(op_matmul(cmp_dev, &w, &x, &y), FU_ERR_INVALID);
    w = op_tensor_3d(OP_TYPE_F32, buf, 32, 2, 2); /* 3-D weight */
    assert_int_equal(op_matmul(cmp_dev, &w, &x, &y), FU_ERR_INVALID);
    op_buffer_free(cmp_dev, buf);
}

/* op_matmul_n on the device (its backend runs the matmuls one by one): each
 * output bit-exact with the device's own op_matmul. */
static void cmp_test_matmul_n(void **state) {
    (void)state;
    CMP_SKIP_WITHOUT_DEVICE();
    enum { K = 96, T = 9 };
    static const op_type types[] = {OP_TYPE_F16, OP_TYPE_Q4_0};
    static const int64_t ns[] = {37, 16};
    float *x = cmp_malloc(T * K * sizeof(float)), *row = cmp_malloc(K * sizeof(float));
    cmp_fill(x, T * K, 2.0);
    for (size_t ti = 0; ti < sizeof types / sizeof types[0]; ti++)
        for (int64_t t = 1; t <= T; t += T - 1) {
            op_tensor w[2], y[2], yn[2];
            op_tensor xd = op_tensor_2d(OP_TYPE_F32, cmp_put(x, (size_t)(t * K) * sizeof(float)), K, t);
            float *got[2], *want[2];
            for (int i = 0; i < 2; i++) {
                const size_t rb = op_row_bytes(types[ti], K);
                uint8_t *wh = cmp_malloc(rb * (size_t)ns[i]);
                for (int64_t r = 0; r < ns[i]; r++) {
                    cmp_fill(row, K, 1.0);
                    op_quantize_row(types[ti], row, K, wh + (size_t)r * rb, NULL);
                }
                w[i] = op_tensor_2d(types[ti], cmp_put(wh, rb * (size_t)ns[i]), K, ns[i]);
                free(wh);
                got[i] = cmp_malloc((size_t)(t * ns[i]) * sizeof(float));
                want[i] = cmp_malloc((size_t)(t * ns[i]) * sizeof(float));
                y[i] = op_tensor_2d(OP_TYPE_F32, cmp_put(want[i], (size_t)(t * ns[i]) * sizeof(float)), ns[i], t);
                yn[i] = op_tensor_2d(OP_TYPE_F32, cmp_put(got[i], (size_t)(t * ns[i]) * sizeof(float)), ns[i], t);
                cmp_ok(op_matmul(cmp_dev, &w[i], &xd, &y[i]), "matmul");
            }
            cmp_ok(op_matmul_n(cmp_dev, 2, (const op_tensor *[]){&w[0], &w[1]}, &xd, (op_tensor *[]){&yn[0], &yn[1]}),
                   "matmul_n");
            for (int i = 0; i < 2; i++) {
                cmp_get(want[i], y[i].data, (size_t)(t * ns[i]) * sizeof(float));
                cmp_get(got[i], yn[i].data, (size_t)(t * ns[i]) * sizeof(float));
                if (memcmp(got[i], want[i], (size_t)(t * ns[i]) * sizeof(float)) != 0)
                    fail_msg("matmul_n %s T=%lld: weight %d differs from op_matmul", op_type_name(types[ti]),
                             (long long)t, i);
                op_buffer_free(cmp_dev, w[i].data);
                op_buffer_free(cmp_dev, y[i].data);
                op_buffer_free(cmp_dev, yn[i].data);
                free(got[i]);
                free(want[i]);
            }
            op_buffer_free(cmp_dev, xd.data);
        }
    free(x);
    free(row);
}

/* ---- get_rows ------------------------------------------------------------------------- */

static void cmp_test_get_rows(void **state) {
    (void)state;
    CMP_SKIP_WITHOUT_DEVICE();
    const int64_t v = 9, d = 64, nt = 6;
    const int32_t ids[6] = {3, 0, 8, 3, 5, 1};
    float *row = cmp_malloc((size_t)d * sizeof(float)), scales[9];
    float *out = cmp_malloc((size_t)(nt * d) * sizeof(float)), *outd = cmp_malloc((size_t)(nt * d) * sizeof(float));
    for (size_t i = 0; i < sizeof cmp_weight_types / sizeof cmp_weight_types[0]; i++) {
        op_type type = cmp_weight_types[i];
        size_t rb = op_row_bytes(type, d);
        uint8_t *tab = cmp_malloc(rb * (size_t)v);
        for (int64_t r = 0; r < v; r++) {
            cmp_fill(row, d, 3.0);
            op_quantize_row(type, row, d, tab + (size_t)r * rb, &scales[r]);
        }
        op_tensor tt = op_tensor_2d(type, tab, d, v), ot = op_tensor_2d(OP_TYPE_F32, out, d, nt);
        tt.row_scale = scales;
        cmp_ok(op_get_rows(cmp_cpu, &tt, ids, &ot), "get_rows cpu");
        op_tensor tdv = tt, odv = ot;
        tdv.data = cmp_put(tab, rb * (size_t)v);
        tdv.row_scale = cmp_put(scales, sizeof scales);
        odv.data = op_buffer_alloc(cmp_dev, (size_t)(nt * d) * sizeof(float));
        cmp_ok(op_get_rows(cmp_dev, &tdv, ids, &odv), op_type_name(type));
        cmp_get(outd, odv.data, (size_t)(nt * d) * sizeof(float));
        char what[64];
        snprintf(what, sizeof what, "get_rows %s", op_type_name(type));
        cmp_close(what, outd, out, nt * d, NULL, 1e-6 * cmp_absmax(out, nt * d));
        int32_t bad[1] = {(int32_t)v};
        odv.ne[1] = 1;
        assert_int_equal(op_get_rows(cmp_dev, &tdv, bad, &odv), FU_ERR_RANGE);
        op_buffer_free(cmp_dev, tdv.data);
        op_buffer_free(cmp_dev, (void *)tdv.row_scale);
        op_buffer_free(cmp_dev, odv.data);
        free(tab);
    }
    free(row);
    free(out);
    free(outd);
}

/* ---- row-wise ops ------------------------------------------------------------------------- */

static void cmp_test_rmsnorm(void **state) {
    (void)state;
    CMP_SKIP_WITHOUT_DEVICE();
    static const int64_t ds[] = {5, 64, 300};
    for (size_t c = 0; c < 3; c++)
        for (int with_w = 0; with_w < 2; with_w++)
            for (int alias = 0; alias < 2; alias++) {
                const int64_t d = ds[c], r = 5, n = r * d;
                float *x = cmp_malloc((size_t)n * 4), *w = cmp_malloc((size_t)d * 4);
                float *y = cmp_malloc((size_t)n * 4), *yd = cmp_malloc((size_t)n * 4);
                cmp_fill(x, n, 3.0);
                cmp_fill(w, d, 1.5);
                op_tensor xt = op_tensor_2d(OP_TYPE_F32, x, d, r), wt = op_tensor_1d(OP_TYPE_F32, w, d);
                op_tensor yt = op_tensor_2d(OP_TYPE_F32, y, d, r);
                cmp_ok(op_rmsnorm(cmp_cpu, &xt, with_w ? &wt : NULL, 1e-5f, &yt), "rmsnorm cpu");
                op_tensor xdv = xt, wdv = wt, ydv = yt;
                xdv.data = cmp_put(x, (size_t)n * 4);
                wdv.data = cmp_put(w, (size_t)d * 4);
                ydv.data = alias ? xdv.data : op_buffer_alloc(cmp_dev, (size_t)n * 4);
                cmp_ok(op_rmsnorm(cmp_dev, &xdv, with_w ? &wdv : NULL, 1e-5f, &ydv), "rmsnorm");
                cmp_get(yd, ydv.data, (size_t)n * 4);
                char what[64];
                snprintf(what, sizeof what, "rmsnorm D=%lld w=%d alias=%d", (long long)d, with_w, alias);
                cmp_close(what, yd, y, n, NULL, 4e-6 * cmp_absmax(y, n));
                op_buffer_free(cmp_dev, xdv.data);
                op_buffer_free(cmp_dev, wdv.data);
                if (!alias) op_buffer_free(cmp_dev, ydv.data);
                free(x);
                free(w);
                free(y);
                free(yd);
            }
}

static void cmp_test_softmax(void **state) {
    (void)state;
    CMP_SKIP_WITHOUT_DEVICE();
    static const int64_t ds[] = {7, 300};
    for (size_t c = 0; c < 2; c++)
        for (int lg = 0; lg < 2; lg++) {
            const int64_t d = ds[c], r = 4, n = r * d;
            float *x = cmp_malloc((size_t)n * 4), *y = cmp_malloc((size_t)n * 4), *yd = cmp_malloc((size_t)n * 4);
            cmp_fill(x, n, 20.0);
            x[d + 1] = -INFINITY; /* row 1: some -inf */
            x[d + 3] = -INFINITY;
            for (int64_t i = 2 * d; i < 3 * d; i++) x[i] = -INFINITY; /* row 2: all -inf */
            x[3 * d] = 80.0f;                                       /* row 3: a large logit */
            memcpy(y, x, (size_t)n * 4);
            op_tensor yt = op_tensor_2d(OP_TYPE_F32, y, d, r);
            cmp_ok(lg ? op_log_softmax(cmp_cpu, &yt) : op_softmax(cmp_cpu, &yt), "softmax cpu");
            op_tensor ydv = yt;
            ydv.data = cmp_put(x, (size_t)n * 4);
            cmp_ok(lg ? op_log_softmax(cmp_dev, &ydv) : op_softmax(cmp_dev, &ydv), "softmax");
            cmp_get(yd, ydv.data, (size_t)n * 4);
            double *tol = cmp_malloc((size_t)n * sizeof(double));
            for (int64_t i = 0; i < n; i++) tol[i] = 1e-5 * fabs(y[i]) + (lg ? 1e-5 : 1e-7);
            char what[64];
            snprintf(what, sizeof what, "%s D=%lld", lg ? "log_softmax" : "softmax", (long long)d);
            cmp_close(what, yd, y, n, tol, 0);
            op_buffer_free(cmp_dev, ydv.data);
            free(tol);
            free(x);
            free(y);
            free(yd);
        }
    op_tensor bad = op_tensor_2d(OP_TYPE_F16, (void *)&cmp_dev, 2, 1);
    assert_int_equal(op_softmax(cmp_dev, &bad), FU_ERR_INVALID);
}

/* swiglu (kind 0), add (1), add_row (2). */
static void cmp_test_elementwise(void **state) {
    (void)state;
    CMP_SKIP_WITHOUT_DEVICE();
    const int64_t r = 3, d = 50, n = r * d;
    float *a = cmp_malloc((size_t)n * 4), *b = cmp_malloc((size_t)n * 4), *out = cmp_malloc((size_t)n * 4);
    float *outd = cmp_malloc((size_t)n * 4);
    for (int kind = 0; kind < 3; kind++) {
        cmp_fill(a, n, 6.0);
        cmp_fill(b, n, 2.0);
        const int64_t nb = kind == 2 ? d : n;
        op_tensor at = op_tensor_2d(OP_TYPE_F32, a, d, r), ot = op_tensor_2d(OP_TYPE_F32, out, d, r);
        op_tensor bt = kind == 2 ? op_tensor_1d(OP_TYPE_F32, b, d) : op_tensor_2d(OP_TYPE_F32, b, d, r);
        op_tensor adv = at, bdv = bt, odv = ot;
        adv.data = cmp_put(a, (size_t)n * 4);
        bdv.data = cmp_put(b, (size_t)nb * 4);
        if (kind == 0) {
            odv.data = op_buffer_alloc(cmp_dev, (size_t)n * 4);
            cmp_ok(op_swiglu(cmp_cpu, &at, &bt, &ot), "swiglu cpu");
            cmp_ok(op_swiglu(cmp_dev, &adv, &bdv, &odv), "swiglu");
        } else {
            odv.data = adv.data;
            memcpy(out, a, (size_t)n * 4);
            cmp_ok(kind == 1 ? op_add(cmp_cpu, &ot, &bt) : op_add_row(cmp_cpu, &ot, &bt), "add cpu");
            cmp_ok(kind == 1 ? op_add(cmp_dev, &odv, &bdv) : op_add_row(cmp_dev, &odv, &bdv), "add");
        }
        cmp_get(outd, odv.data, (size_t)n * 4);
        static const char *names[] = {"swiglu", "add", "add_row"};
        cmp_close(names[kind], outd, out, n, NULL, 2e-6 * cmp_absmax(out, n));
        op_buffer_free(cmp_dev, adv.data);
        op_buffer_free(cmp_dev, bdv.data);
        if (kind == 0) op_buffer_free(cmp_dev, odv.data);
    }
    free(a);
    free(b);
    free(out);
    free(outd);
}

/* ---- rope ----------------------------------------------------------------------------- */

static void cmp_test_rope(void **state) {
    (void)state;
    CMP_SKIP_WITHOUT_DEVICE();
    const int64_t t = 4, h = 3, hd = 16, n = t * h * hd;
    const int32_t pos[4] = {0, 5, 17, 1000};
    float inv[8];
    float *x = cmp_malloc((size_t)n * 4), *y = cmp_malloc((size_t)n * 4), *yd = cmp_malloc((size_t)n * 4);
    for (int mode = 0; mode < 2; mode++)
        for (int rot = 8; rot <= 16; rot += 8) {
            for (int i = 0; i < rot / 2; i++) inv[i] = powf(10000.0f, -2.0f * (float)i / (float)rot);
            op_rope_params p = {mode ? OP_ROPE_NORM : OP_ROPE_NEOX, rot, inv, rot == 8 ? 0.75f : 1.0f};
            cmp_fill(x, n, 2.0);
            memcpy(y, x, (size_t)n * 4);
            op_tensor yt = op_tensor_3d(OP_TYPE_F32, y, hd, h, t);
            cmp_ok(op_rope(cmp_cpu, &yt, pos, &p), "rope cpu");
            op_tensor ydv = yt;
            ydv.data = cmp_put(x, (size_t)n * 4);
            cmp_ok(op_rope(cmp_dev, &ydv, pos, &p), "rope");
            cmp_get(yd, ydv.data, (size_t)n * 4);
            char what[64];
            snprintf(what, sizeof what, "rope mode %d rot %d", mode, rot);
            cmp_close(what, yd, y, n, NULL, 2e-5 * cmp_absmax(x, n));
            op_buffer_free(cmp_dev, ydv.data);
        }
    free(x);
    free(y);
    free(yd);
}

/* ---- kv_store + attention --------------------------------------------------------------- */

#define CMP_SEQS 3
#define CMP_LEN 48

/* Attention of host q (T, H, hd) on the CPU over the caches of `a` into want, and on the device
 * over those of `ad` into got; *qdv and *odv are left describing the device's copy of q and its
 * output (the caller frees their data). */
static void cmp_attention_run(const op_tensor *qt, const op_attn *a, const op_attn *ad, float *want, float *got,
                              op_tensor *qdv, op_tensor *odv) {
    const size_t bytes = (size_t)op_tensor_nelems(qt) * 4;
    op_tensor ot = *qt;
    ot.data = want;
    cmp_ok(op_attention(cmp_cpu, qt, a, &ot), "attention cpu");
    *qdv = *qt;
    *odv = *qt;
    qdv->data = cmp_put(qt->data, bytes);
    odv->data = op_buffer_alloc(cmp_dev, bytes);
    cmp_ok(op_attention(cmp_dev, qdv, ad, odv), "attention");
    cmp_get(got, odv->data, bytes);
}

/* Fills CMP_SEQS caches of (CMP_LEN, kvh, hd) of `type` on both backends
 * through op_kv_store (prefill of lens[s] positions), checks the device caches
 * equal the CPU's bit for bit, then runs a mixed batch of attention.
 * head_major: op_tensor_kv_cache views (the engine's layout). */
static void cmp_attention_case(op_type type, int nh, int kvh, int hd, bool head_major) {
    const int lens[CMP_SEQS] = {40, 5, 34};
    const int64_t cols = (int64_t)kvh * hd, es = type == OP_TYPE_F16 ? 2 : 4;
    const size_t cache_bytes = (size_t)(CMP_LEN * cols * es);
    void *kc[CMP_SEQS], *vc[CMP_SEQS], *kd[CMP_SEQS], *vd[CMP_SEQS];
    op_tensor kt[CMP_SEQS], vt[CMP_SEQS], kdt[CMP_SEQS], vdt[CMP_SEQS];
    op_tensor *kp[CMP_SEQS], *vp[CMP_SEQS], *kdp[CMP_SEQS], *vdp[CMP_SEQS];
    for (int s = 0; s < CMP_SEQS; s++) {
        kc[s] = cmp_malloc(cache_bytes);
        vc[s] = cmp_malloc(cache_bytes);
        kd[s] = op_buffer_alloc(cmp_dev, cache_bytes);
        vd[s] = op_buffer_alloc(cmp_dev, cache_bytes);
        assert_true(kd[s] && vd[s]);
        op_tensor (*view)(op_type, void *, int64_t, int64_t, int64_t) = head_major ? op_tensor_kv_cache : op_tensor_3d;
        kt[s] = view(type, kc[s], hd, kvh, CMP_LEN);
        vt[s] = view(type, vc[s], hd, kvh, CMP_LEN);
        kdt[s] = view(type, kd[s], hd, kvh, CMP_LEN);
        vdt[s] = view(type, vd[s], hd, kvh, CMP_LEN);
        kp[s] = &kt[s];
        vp[s] = &vt[s];
        kdp[s] = &kdt[s];
        vdp[s] = &vdt[s];
    }
    /* prefill: every sequence's positions in one batch */
    int64_t np = 0;
    for (int s = 0; s < CMP_SEQS; s++) np += lens[s];
    int32_t *seq = cmp_malloc((size_t)np * 4), *pos = cmp_malloc((size_t)np * 4);
    for (int s = 0, i = 0; s < CMP_SEQS; s++)
        for (int p = 0; p < lens[s]; p++, i++) {
            seq[i] = s;
            pos[i] = p;
        }
    float *src = cmp_malloc((size_t)(np * cols) * 4);
    double vmax = 0;
    for (int kv = 0; kv < 2; kv++) {
        cmp_fill(src, np * cols, kv ? 1.5 : 1.0);
        vmax = fmax(vmax, kv ? cmp_absmax(src, np * cols) : 0);
        op_tensor st = op_tensor_2d(OP_TYPE_F32, src, cols, np), sdv = st;
        sdv.data = cmp_put(src, (size_t)(np * cols) * 4);
        cmp_ok(op_kv_store(cmp_cpu, &st, kv ? vp : kp, CMP_SEQS, seq, pos), "kv_store cpu");
        cmp_ok(op_kv_store(cmp_dev, &sdv, kv ? vdp : kdp, CMP_SEQS, seq, pos), "kv_store");
        op_buffer_free(cmp_dev, sdv.data);
    }
    uint8_t *back = cmp_malloc(cache_bytes);
    for (int s = 0; s < CMP_SEQS; s++) {
        cmp_get(back, kd[s], cache_bytes);
        if (memcmp(back, kc[s], cache_bytes)) fail_msg("kv_store %s: k cache %d differs", op_type_name(type), s);
        cmp_get(back, vd[s], cache_bytes);
        if (memcmp(back, vc[s], cache_bytes)) fail_msg("kv_store %s: v cache %d differs", op_type_name(type), s);
    }
    /* a range error writes nothing */
    {
        int32_t bs[2] = {0, 1}, bp[2] = {1, CMP_LEN};
        op_tensor st = op_tensor_2d(OP_TYPE_F32, src, cols, 2), sdv = st;
        sdv.data = cmp_put(src, (size_t)(2 * cols) * 4);
        assert_int_equal(op_kv_store(cmp_dev, &sdv, kdp, CMP_SEQS, bs, bp), FU_ERR_RANGE);
        bp[1] = 0;
        bs[1] = CMP_SEQS;
        assert_int_equal(op_kv_store(cmp_dev, &sdv, kdp, CMP_SEQS, bs, bp), FU_ERR_RANGE);
        cmp_get(back, kd[0], cache_bytes);
        if (memcmp(back, kc[0], cache_bytes)) fail_msg("kv_store: a failed call wrote to the cache");
        op_buffer_free(cmp_dev, sdv.data);
    }
    /* decode + chunked-prefill mix */
    enum { NT = 6 };
    const int32_t aseq[NT] = {0, 1, 2, 2, 0, 1}, apos[NT] = {39, 4, 33, 10, 0, 0};
    const int64_t qn = (int64_t)NT * nh * hd;
    float *q = cmp_malloc((size_t)qn * 4), *out = cmp_malloc((size_t)qn * 4), *outd = cmp_malloc((size_t)qn * 4);
    cmp_fill(q, qn, 2.0);
    op_attn a = {nh, kvh, hd, 1.0f / sqrtf((float)hd), CMP_SEQS, aseq, apos, kt, vt}, ad = a;
    ad.k = kdt;
    ad.v = vdt;
    op_tensor qt = op_tensor_3d(OP_TYPE_F32, q, hd, nh, NT), qdv, odv;
    cmp_attention_run(&qt, &a, &ad, out, outd, &qdv, &odv);
    char what[80];
    snprintf(what, sizeof what, "attention %s H=%d KVH=%d hd=%d%s", op_type_name(type), nh, kvh, hd,
             head_major ? " head-major" : "");
    cmp_close(what, outd, out, qn, NULL, 1e-4 * vmax + 1e-6);
    /* a token past its cache is a range error */
    int32_t far[NT];
    memcpy(far, apos, sizeof far);
    far[3] = CMP_LEN;
    ad.pos = far;
    assert_int_equal(op_attention(cmp_dev, &qdv, &ad, &odv), FU_ERR_RANGE);
    op_buffer_free(cmp_dev, qdv.data);
    op_buffer_free(cmp_dev, odv.data);
    for (int s = 0; s < CMP_SEQS; s++) {
        free(kc[s]);
        free(vc[s]);
        op_buffer_free(cmp_dev, kd[s]);
        op_buffer_free(cmp_dev, vd[s]);
    }
    free(seq);
    free(pos);
    free(src);
    free(back);
    free(q);
    free(out);
    free(outd);
}

/* Decode over a long cache: few (token, head) tasks, so the device splits each token's
 * positions over many warps and merges them; one token's positions end inside the first split,
 * leaving the others empty. Caches of 300 positions of `type`, filled from the host. */
static void cmp_attention_long_case(op_type type, int hd) {
    enum { LEN = 300, H = 4, KVH = 2, NT = 2 };
    const int64_t n = (int64_t)LEN * KVH * hd, qn = (int64_t)NT * H * hd;
    const size_t es = type == OP_TYPE_F16 ? 2 : 4;
    float *f = cmp_malloc((size_t)n * 4), *q = cmp_malloc((size_t)qn * 4), *want = cmp_malloc((size_t)qn * 4),
          *got = cmp_malloc((size_t)qn * 4);
    uint8_t *kh = cmp_malloc((size_t)n * es), *vh = cmp_malloc((size_t)n * es);
    for (int kv = 0; kv < 2; kv++) {
        cmp_fill(f, n, kv ? 1.5 : 1.0);
        for (int64_t i = 0; i < n; i++) {
            if (es == 2) ((uint16_t *)(kv ? vh : kh))[i] = op_f32_to_f16(f[i]);
            else ((float *)(kv ? vh : kh))[i] = f[i];
        }
    }
    cmp_fill(q, qn, 2.0);
    op_tensor k = op_tensor_kv_cache(type, kh, hd, KVH, LEN), v = op_tensor_kv_cache(type, vh, hd, KVH, LEN);
    op_tensor kd = k, vd = v;
    kd.data = cmp_put(kh, (size_t)n * es);
    vd.data = cmp_put(vh, (size_t)n * es);
    const int32_t seq[NT] = {0, 0}, pos[NT] = {LEN - 1, 7};
    op_attn a = {H, KVH, hd, 1.0f / sqrtf((float)hd), 1, seq, pos, &k, &v}, ad = a;
    ad.k = &kd;
    ad.v = &vd;
    op_tensor qt = op_tensor_3d(OP_TYPE_F32, q, hd, H, NT), qdv, odv;
    cmp_attention_run(&qt, &a, &ad, want, got, &qdv, &odv);
    char what[80];
    snprintf(what, sizeof what, "attention %s hd=%d, 300 positions split", op_type_name(type), hd);
    cmp_close(what, got, want, qn, NULL, 1.5e-4);
    op_buffer_free(cmp_dev, kd.data);
    op_buffer_free(cmp_dev, vd.data);
    op_buffer_free(cmp_dev, qdv.data);
    op_buffer_free(cmp_dev, odv.data);
    free(f);
    free(q);
    free(want);
    free(got);
    free(kh);
    free(vh);
}

static void cmp_test_attention(void **state) {
    (void)state;
    CMP_SKIP_WITHOUT_DEVICE();
    cmp_attention_case(OP_TYPE_F32, 4, 2, 16, false);
    cmp_attention_case(OP_TYPE_F16, 4, 2, 16, false);
    cmp_attention_case(OP_TYPE_F32, 2, 2, 64, false);
    cmp_attention_case(OP_TYPE_F16, 6, 2, 40, false);
    cmp_attention_case(OP_TYPE_F32, 4, 2, 16, true);
    cmp_attention_case(OP_TYPE_F16, 6, 2, 40, true);
    cmp_attention_long_case(OP_TYPE_F16, 64);
    cmp_attention_long_case(OP_TYPE_F32, 40); /* head_dim not a multiple of 32 */
    /* head_dim beyond the kernel's limit */
    float *buf = op_buffer_alloc(cmp_dev, 300 * 4);
    assert_non_null(buf);
    op_tensor k = op_tensor_3d(OP_TYPE_F32, buf, 300, 1, 1);
    int32_t s0 = 0, p0 = 0;
    op_attn a = {1, 1, 300, 1.0f, 1, &s0, &p0, &k, &k};
    op_tensor q = op_tensor_3d(OP_TYPE_F32, buf, 300, 1, 1);
    assert_int_equal(op_attention(cmp_dev, &q, &a, &q), FU_ERR_UNSUPPORTED);
    op_buffer_free(cmp_dev, buf);
}

/* ---- memory: uploads, and host memory refused ---------------------------------------------- */

static void cmp_test_memory(void **state) {
    (void)state;
    CMP_SKIP_WITHOUT_DEVICE();
    /* an I8 table with its row scales, uploaded, read back through get_rows */
    enum { R = 5, D = 64 };
    float rows[R * D], scales[R], want[2 * D], got[2 * D];
    int8_t q[R * D];
    cmp_fill(rows, R * D, 3.0);
    for (int r = 0; r < R; r++) op_quantize_row(OP_TYPE_I8, rows + r * D, D, q + r * D, &scales[r]);
    op_tensor t = op_tensor_2d(OP_TYPE_I8, q, D, R), td;
    t.row_scale = scales;
    t.name = "table";
    assert_int_equal(op_tensor_upload(cmp_dev, &t, &td), 1);
    assert_ptr_not_equal(td.data, t.data);
    assert_ptr_not_equal(td.row_scale, t.row_scale);
    const int32_t ids[2] = {4, 1};
    op_tensor o = op_tensor_2d(OP_TYPE_F32, want, D, 2);
    cmp_ok(op_get_rows(cmp_cpu, &t, ids, &o), "get_rows cpu");
    float *od = op_buffer_alloc(cmp_dev, sizeof got);
    assert_non_null(od);
    op_tensor odv = op_tensor_2d(OP_TYPE_F32, od, D, 2);
    cmp_ok(op_get_rows(cmp_dev, &td, ids, &odv), "get_rows of an uploaded table");
    cmp_get(got, od, sizeof got);
    assert_memory_equal(got, want, sizeof got);
    /* the CPU reads host memory as it is */
    op_tensor tc;
    assert_int_equal(op_tensor_upload(cmp_cpu, &t, &tc), 0);
    assert_ptr_equal(tc.data, t.data);

    /* host memory, or bytes past a buffer's end, are refused with an error, not read */
    float host[D];
    cmp_fill(host, D, 1.0);
    op_tensor xh = op_tensor_2d(OP_TYPE_F32, host, D, 1), xd = op_tensor_2d(OP_TYPE_F32, od, D, 1);
    xh.name = "x";
    assert_int_equal(op_rmsnorm(cmp_dev, &xh, NULL, 1e-5f, &xd), FU_ERR_INVALID);
    assert_non_null(strstr(fu_last_error(), "x is not in this backend's memory"));
    assert_int_equal(op_rmsnorm(cmp_dev, &xd, &xh, 1e-5f, &xd), FU_ERR_INVALID);
    assert_int_equal(op_add(cmp_dev, &xd, &xh), FU_ERR_INVALID);
    assert_int_equal(op_softmax(cmp_dev, &xh), FU_ERR_INVALID);
    assert_int_equal(op_get_rows(cmp_dev, &t, ids, &odv), FU_ERR_INVALID); /* the host table */
    op_tensor past = op_tensor_2d(OP_TYPE_F32, od, D, 3);                  /* 2 rows allocated */
    assert_int_equal(op_softmax(cmp_dev, &past), FU_ERR_INVALID);
    assert_int_equal(op_buffer_set(cmp_dev, host, host, sizeof host), FU_ERR_INVALID);
    assert_int_equal(op_buffer_get(cmp_dev, host, od, sizeof got + 4), FU_ERR_INVALID);
    op_tensor wh = op_tensor_2d(OP_TYPE_F32, host, D, 1), yd = op_tensor_2d(OP_TYPE_F32, od + D, 1, 1);
    wh.name = "w";
    assert_int_equal(op_matmul(cmp_dev, &wh, &xd, &yd), FU_ERR_INVALID);
    /* a freed buffer is no longer the backend's */
    op_buffer_free(cmp_dev, td.data);
    assert_int_equal(op_get_rows(cmp_dev, &td, ids, &odv), FU_ERR_INVALID);
    op_buffer_free(cmp_dev, od);
}

/* ---- the engine ------------------------------------------------------------------------------ */

#define CMP_ENG_TOL 5e-3

static double cmp_eng_tol(const float *want, int64_t n) { return CMP_ENG_TOL * cmp_absmax(want, n) + 1e-4; }

static void cmp_eng_close(const char *what, int step, const float *got, const float *want, int64_t n) {
    char w[128];
    snprintf(w, sizeof w, "%s, step %d", what, step);
    cmp_close(w, got, want, n, NULL, cmp_eng_tol(want, n));
}

/* The device's greedy token must be the CPU's unless the CPU's best two are
 * closer than the logits' tolerance allows to tell apart. */
static void cmp_eng_same_token(const float *got, const float *want, int64_t n) {
    int best = smp_argmax(want, (int)n), g = smp_argmax(got, (int)n);
    if (g == best) return;
    double second = -INFINITY;
    for (int64_t i = 0; i < n; i++)
        if (i != best) second = fmax(second, want[i]);
    if (want[best] - second > 2 * cmp_eng_tol(want, n))
        fail_msg("greedy token %d on the device, %d on the CPU", g, best);
}

/* Two sequences on the CPU and on the device: a batched prefill of their
 * prompts (12 and 7 tokens, in chunks of 16 and 3, so that both the cuBLAS and
 * the matvec paths run; only the last token of each wanted), then 3 batched
 * decode steps on the CPU's greedy tokens. Logits must agree (CMP_ENG_TOL) and
 * the device's greedy tokens must be the CPU's (cmp_eng_same_token). */
static void cmp_engine_case(mdl_arch arch, op_type wt, op_type kv, bool tied) {
    mdl_config c = test_small_config(arch);
    c.tied_embeddings = tied;
    mdl_open_options mo = mdl_open_options_all();
    mdl_model *m;
    cmp_ok(mdl_random(&c, wt, 7, &mo, &m), "random model");
    char what[96];
    snprintf(what, sizeof what, "engine arch %d, %s weights, %s cache%s", (int)arch, op_type_name(wt),
             op_type_name(kv), tied ? ", tied" : "");
    eng_options eo = {16, kv};
    eng_engine *e[2];
    eng_seq *s[2][2];
    op_backend *be[2] = {cmp_cpu, cmp_dev};
    for (int b = 0; b < 2; b++) {
        cmp_ok(eng_new(m, be[b], &eo, &e[b]), what);
        for (int j = 0; j < 2; j++) cmp_ok(eng_seq_new(e[b], 40, &s[b][j]), "sequence");
    }
    const int64_t V = c.vocab_size;
    enum { P0 = 12, P1 = 7, N = P0 + P1, STEPS = 3 };
    int32_t tok[N];
    uint8_t want[N] = {0};
    eng_seq *seqs[2][N];
    for (int t = 0; t < N; t++) {
        tok[t] = (int32_t)((t * 37 + 11) % V);
        for (int b = 0; b < 2; b++) seqs[b][t] = s[b][t < P0 ? 0 : 1];
    }
    want[P0 - 1] = want[N - 1] = 1;
    float *lg[2];
    for (int b = 0; b < 2; b++) {
        lg[b] = cmp_malloc(2 * (size_t)V * sizeof(float));
        eng_batch bt = {N, tok, NULL, seqs[b], want};
        cmp_ok(eng_forward(e[b], &bt, lg[b]), what);
    }
    cmp_eng_close(what, 0, lg[1], lg[0], 2 * V);
    for (int step = 1; step <= STEPS; step++) {
        int32_t next[2];
        for (int j = 0; j < 2; j++) {
            next[j] = smp_argmax(lg[0] + j * V, (int)V);
            cmp_eng_same_token(lg[1] + j * V, lg[0] + j * V, V);
        }
        for (int b = 0; b < 2; b++) {
            eng_batch bt = {2, next, NULL, s[b], NULL};
            cmp_ok(eng_forward(e[b], &bt, lg[b]), what);
        }
        cmp_eng_close(what, step, lg[1], lg[0], 2 * V);
    }
    for (int b = 0; b < 2; b++) {
        for (int j = 0; j < 2; j++) eng_seq_free(e[b], s[b][j]);
        eng_free(e[b]);
        free(lg[b]);
    }
    mdl_free(m);
}

/* A model split in two spans, [0, 1) from the embeddings to hidden states and
 * [1, 2) from hidden states to logits, on the device, against the whole
 * model on the CPU. */
static void cmp_engine_spans(void) {
    mdl_config c = test_small_config(MDL_ARCH_LLAMA);
    mdl_open_options all = mdl_open_options_all(), a = {0, 1, true, false}, b = {1, -1, false, true};
    mdl_model *m, *ma, *mb;
    cmp_ok(mdl_random(&c, OP_TYPE_Q8_0, 9, &all, &m), "model");
    cmp_ok(mdl_random(&c, OP_TYPE_Q8_0, 9, &a, &ma), "span a");
    cmp_ok(mdl_random(&c, OP_TYPE_Q8_0, 9, &b, &mb), "span b");
    eng_options eo = {16, OP_TYPE_F32};
    eng_engine *e, *ea, *eb;
    eng_seq *s, *sa, *sb;
    cmp_ok(eng_new(m, cmp_cpu, &eo, &e), "engine");
    cmp_ok(eng_new(ma, cmp_dev, &eo, &ea), "engine a");
    cmp_ok(eng_new(mb, cmp_dev, &eo, &eb), "engine b");
    cmp_ok(eng_seq_new(e, 32, &s), "seq");
    cmp_ok(eng_seq_new(ea, 32, &sa), "seq a");
    cmp_ok(eng_seq_new(eb, 32, &sb), "seq b");
    enum { N = 5 };
    const int64_t V = c.vocab_size, D = c.dim;
    int32_t tok[N] = {3, 14, 15, 92, 65};
    eng_seq *ss[N], *ssa[N], *ssb[N];
    for (int t = 0; t < N; t++) ss[t] = s, ssa[t] = sa, ssb[t] = sb;
    float *want = cmp_malloc((size_t)(N * V) * sizeof(float)), *got = cmp_malloc((size_t)(N * V) * sizeof(float));
    float *h = cmp_malloc((size_t)(N * D) * sizeof(float));
    eng_batch bt = {N, tok, NULL, ss, NULL}, bta = {N, tok, NULL, ssa, NULL};
    cmp_ok(eng_forward(e, &bt, want), "whole model");
    cmp_ok(eng_forward(ea, &bta, h), "span a");
    eng_batch btb = {N, NULL, h, ssb, NULL};
    cmp_ok(eng_forward(eb, &btb, got), "span b");
    cmp_eng_close("spans [0, 1) + [1, 2)", 0, got, want, N * V);
    eng_seq_free(e, s);
    eng_seq_free(ea, sa);
    eng_seq_free(eb, sb);
    eng_free(e);
    eng_free(ea);
    eng_free(eb);
    mdl_free(m);
    mdl_free(ma);
    mdl_free(mb);
    free(want);
    free(got);
    free(h);
}

static void cmp_test_engine(void **state) {
    (void)state;
    CMP_SKIP_WITHOUT_DEVICE();
    /* a few models (each launch is costly in the emulator): quantized, i8 with
     * its row scales, the direct f16 / bf16 cuBLAS paths, every architecture,
     * tied embeddings and f16 caches; Q8_0 in the spans */
    cmp_engine_case(MDL_ARCH_LLAMA, OP_TYPE_Q4_0, OP_TYPE_F32, false);
    cmp_engine_case(MDL_ARCH_QWEN2, OP_TYPE_I8, OP_TYPE_F32, true);
    cmp_engine_case(MDL_ARCH_QWEN3, OP_TYPE_BF16, OP_TYPE_F16, true);
    cmp_engine_case(MDL_ARCH_LLAMA, OP_TYPE_F16, OP_TYPE_F16, false);
    cmp_engine_spans();
}

#define CMP_TESTS                                                                                  \
    cmocka_unit_test(cmp_test_basics), cmocka_unit_test(cmp_test_matmul),                          \
        cmocka_unit_test(cmp_test_matmul_errors), cmocka_unit_test(cmp_test_matmul_n),             \
        cmocka_unit_test(cmp_test_get_rows),                                                       \
        cmocka_unit_test(cmp_test_rmsnorm), cmocka_unit_test(cmp_test_softmax),                    \
        cmocka_unit_test(cmp_test_elementwise), cmocka_unit_test(cmp_test_rope),                   \
        cmocka_unit_test(cmp_test_attention), cmocka_unit_test(cmp_test_memory),                   \
        cmocka_unit_test(cmp_test_engine)

#endif
