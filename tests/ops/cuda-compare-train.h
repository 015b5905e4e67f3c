/* cuda-compare-train.h -- add_rows and the training (backward) ops of a device backend against the
 * CPU backend; shared, like cuda-compare.h (which it includes), by test_cuda_emu.c and
 * test_cuda_gpu.c, which list CMP_TRAIN_TESTS after CMP_TESTS.
 *
 * Same inputs on both backends, device data through op_buffer_* as real
 * callers do. Shapes: T 1, 7 and 33 (and 130, so that the GEMM kernel runs
 * both ways it splits its work); N and K not multiples of 32 for the plain
 * types; every weight type of the device for matmul_back; GQA 4/2 and 6/2
 * heads over packed examples for attention_back; rows with target -1.
 * Tolerances (|got - ref| <= tol), stated per check:
 *   add_rows, swiglu_back:    2e-6 * max|ref|
 *   matmul_back:              1e-5 * sum_n |dy_n w_nk| + 1e-6 (+ 1e-6 |dx0| when accumulating)
 *   outer_acc:                1e-5 * (|dw0| + |alpha| sum_t |dy x|) + 1e-6
 *   rmsnorm_back:             2e-5 * max|ref| (f32 sums here, double on the CPU)
 *   attention_back:           5e-5 * max|ref| + 1e-6 per gradient
 *   cross_entropy:            loss 1e-5 relative + 1e-6, gradient 1e-6 * weight
 *                             + 1e-5 |ref|; correct and skipped rows exact
 *   dropout:                  bit-exact (the hash of ops.h)
 * Errors: host memory refused, head_dim past the kernel's limit, a target
 * out of range writes nothing.
 */
#ifndef FU_TEST_CUDA_COMPARE_TRAIN_H
#define FU_TEST_CUDA_COMPARE_TRAIN_H

#include "cuda-compare.h"

/* A device copy of n floats of host memory, described as (ne1, ne0). */
static op_tensor cmp_dev_2d(const float *host, int64_t ne0, int64_t ne1) {
    return op_tensor_2d(OP_TYPE_F32, cmp_put(host, (size_t)(ne0 * ne1) * sizeof(float)), ne0, ne1);
}

/* Reads the device tensor t back into host (its elements) and frees it. */
static void cmp_fetch(float *host, op_tensor *t) {
    cmp_get(host, t->data, (size_t)op_tensor_nelems(t) * sizeof(float));
    op_buffer_free(cmp_dev, t->data);
    t->data = NULL;
}

/* A host float array of n random values in [-scale, scale). */
static float *cmp_rand(int64_t n, double scale) {
    float *x = cmp_malloc((size_t)n * sizeof(float));
    cmp_fill(x, n, scale);
    return x;
}

/* ---- add_rows ------------------------------------------------------------------------------ */

static void cmp_test_add_rows(void **state) {
    (void)state;
    CMP_SKIP_WITHOUT_DEVICE();
    assert_true(op_backend_can_train(cmp_dev));
    enum { R = 9, D = 37, N = 4 };
    const int32_t rows[N] = {7, 0, 4, 8};
    float *x = cmp_rand(R * D, 2.0), *y = cmp_rand(N * D, 1.0), got[R * D];
    op_tensor xd = cmp_dev_2d(x, D, R), yd = cmp_dev_2d(y, D, N);
    op_tensor xt = op_tensor_2d(OP_TYPE_F32, x, D, R), yt = op_tensor_2d(OP_TYPE_F32, y, D, N);
    cmp_ok(op_add_rows(cmp_cpu, &xt, rows, &yt, 0.5f), "add_rows cpu");
    cmp_ok(op_add_rows(cmp_dev, &xd, rows, &yd, 0.5f), "add_rows");
    /* a row out of range writes nothing; no rows at all is the probe LoRA makes */
    const int32_t bad[N] = {1, 2, R, 3};
    assert_int_equal(op_add_rows(cmp_dev, &xd, bad, &yd, 1.0f), FU_ERR_RANGE);
    op_tensor none = op_tensor_2d(OP_TYPE_F32, yd.data, D, 0);
    cmp_ok(op_add_rows(cmp_dev, &xd, NULL, &none, 1.0f), "add_rows of no rows");
    op_tensor yh = yt;
    yh.name = "y";
    assert_int_equal(op_add_rows(cmp_dev, &xd, rows, &yh, 1.0f), FU_ERR_INVALID); /* host memory */
    cmp_fetch(got, &xd);
    cmp_close("add_rows", got, x, R * D, NULL, 2e-6 * cmp_absmax(x, R * D));
    op_buffer_free(cmp_dev, yd.data);
    free(x);
    free(y);
}

/* ---- matmul gradients ------------------------------------------------------------------------ */

/* dx (T, K) = beta * dx0 + dy (T, N) @ W (N, K) on both backends, W of `type`. */
static void cmp_matmul_back_case(op_type type, int64_t t, int64_t n, int64_t k, int beta) {
    const size_t rb = op_row_bytes(type, k);
    uint8_t *w = cmp_malloc(rb * (size_t)n);
    float *scales = cmp_malloc((size_t)n * sizeof(float)), *wf = cmp_malloc((size_t)(n * k) * sizeof(float));
    for (int64_t r = 0; r < n; r++) {
        cmp_fill(wf + r * k, k, 1.0);
        op_quantize_row(type, wf + r * k, k, w + (size_t)r * rb, &scales[r]);
    }
    op_tensor wt = op_tensor_2d(type, w, k, n);
    wt.row_scale = scales;
    for (int64_t r = 0; r < n; r++) op_dequantize_row(&wt, r, wf + r * k);
    float *dy = cmp_rand(t * n, 1.0), *dx = cmp_rand(t * k, 1.0), *got = cmp_malloc((size_t)(t * k) * sizeof(float));
    double *tol = cmp_malloc((size_t)(t * k) * sizeof(double));
    for (int64_t i = 0; i < t; i++)
        for (int64_t c = 0; c < k; c++) {
            double mag = 0;
            for (int64_t r = 0; r < n; r++) mag += fabs((double)dy[i * n + r] * wf[r * k + c]);
            tol[i * k + c] = 1e-5 * mag + 1e-6 + (beta ? 1e-6 * fabs(dx[i * k + c]) : 0);
        }
    op_tensor wd = wt, dyd = cmp_dev_2d(dy, n, t), dxd = cmp_dev_2d(dx, k, t);
    wd.data = cmp_put(w, rb * (size_t)n);
    wd.row_scale = cmp_put(scales, (size_t)n * sizeof(float));
    op_tensor dyt = op_tensor_2d(OP_TYPE_F32, dy, n, t), dxt = op_tensor_2d(OP_TYPE_F32, dx, k, t);
    char what[96];
    snprintf(what, sizeof what, "matmul_back %s T=%lld N=%lld K=%lld beta=%d", op_type_name(type), (long long)t,
             (long long)n, (long long)k, beta);
    cmp_ok(op_matmul_back(cmp_cpu, &wt, &dyt, &dxt, (float)beta), what);
    cmp_ok(op_matmul_back(cmp_dev, &wd, &dyd, &dxd, (float)beta), what);
    cmp_fetch(got, &dxd);
    cmp_close(what, got, dx, t * k, tol, 0);
    op_buffer_free(cmp_dev, wd.data);
    op_buffer_free(cmp_dev, (void *)wd.row_scale);
    op_buffer_free(cmp_dev, dyd.data);
    free(w);
    free(scales);
    free(wf);
    free(dy);
    free(dx);
    free(got);
    free(tol);
}

static void cmp_test_matmul_back(void **state) {
    (void)state;
    CMP_SKIP_WITHOUT_DEVICE();
    static const int64_t ts[] = {1, 7, 33};
    for (size_t i = 0; i < sizeof cmp_weight_types / sizeof cmp_weight_types[0]; i++) {
        const op_type type = cmp_weight_types[i];
        const int64_t k = op_type_block_elems(type) > 1 ? 96 : 40; /* plain types: K not a multiple of 32 */
        for (size_t j = 0; j < sizeof ts / sizeof ts[0]; j++)
            for (int beta = 0; beta < 2; beta++) cmp_matmul_back_case(type, ts[j], 19, k, beta);
    }
    cmp_matmul_back_case(OP_TYPE_F32, 5, 0, 7, 0); /* N = 0: dx = 0 */
    /* enough tiles of 64 rows x 32 columns that each warp takes its own rows */
    cmp_matmul_back_case(OP_TYPE_F32, 130, 19, 2750, 1);
    cmp_matmul_back_case(OP_TYPE_Q4_0, 130, 19, 2752, 0);
    /* a weight of the CPU's interleaved layout is not the device's */
    float *buf = op_buffer_alloc(cmp_dev, 4096);
    assert_non_null(buf);
    op_tensor w = op_tensor_2d(OP_TYPE_Q4_0_R16, buf, 32, 16), dy = op_tensor_2d(OP_TYPE_F32, buf, 16, 1);
    op_tensor dx = op_tensor_2d(OP_TYPE_F32, buf, 32, 1);
    assert_int_equal(op_matmul_back(cmp_dev, &w, &dy, &dx, 0.0f), FU_ERR_UNSUPPORTED);
    op_buffer_free(cmp_dev, buf);
}

/* dw (N, K) += alpha * dy (T, N)^T @ x (T, K) on both backends. */
static void cmp_outer_acc_case(int64_t t, int64_t n, int64_t k, float alpha) {
    float *dw = cmp_rand(n * k, 1.0), *dy = cmp_rand(t * n, 1.0), *x = cmp_rand(t * k, 2.0);
    float *got = cmp_malloc((size_t)(n * k) * sizeof(float));
    double *tol = cmp_malloc((size_t)(n * k) * sizeof(double));
    for (int64_t r = 0; r < n; r++)
        for (int64_t c = 0; c < k; c++) {
            double mag = 0;
            for (int64_t i = 0; i < t; i++) mag += fabs((double)dy[i * n + r] * x[i * k + c]);
            tol[r * k + c] = 1e-5 * (fabs(dw[r * k + c]) + fabs(alpha) * mag) + 1e-6;
        }
    op_tensor dwd = cmp_dev_2d(dw, k, n), dyd = cmp_dev_2d(dy, n, t), xd = cmp_dev_2d(x, k, t);
    op_tensor dwt = op_tensor_2d(OP_TYPE_F32, dw, k, n), dyt = op_tensor_2d(OP_TYPE_F32, dy, n, t);
    op_tensor xt = op_tensor_2d(OP_TYPE_F32, x, k, t);
    char what[80];
    snprintf(what, sizeof what, "outer_acc T=%lld N=%lld K=%lld", (long long)t, (long long)n, (long long)k);
    cmp_ok(op_outer_acc(cmp_cpu, &dwt, &dyt, &xt, alpha), what);
    cmp_ok(op_outer_acc(cmp_dev, &dwd, &dyd, &xd, alpha), what);
    assert_int_equal(op_outer_acc(cmp_dev, &dwd, &dyt, &xd, alpha), FU_ERR_INVALID); /* host dy */
    cmp_fetch(got, &dwd);
    cmp_close(what, got, dw, n * k, tol, 0);
    op_buffer_free(cmp_dev, dyd.data);
    op_buffer_free(cmp_dev, xd.data);
    free(dw);
    free(dy);
    free(x);
    free(got);
    free(tol);
}

static void cmp_test_outer_acc(void **state) {
    (void)state;
    CMP_SKIP_WITHOUT_DEVICE();
    cmp_outer_acc_case(1, 19, 37, 0.5f);
    cmp_outer_acc_case(7, 19, 37, -2.0f);
    cmp_outer_acc_case(33, 8, 45, 1.0f);
    cmp_outer_acc_case(33, 45, 8, 0.25f);
    cmp_outer_acc_case(7, 130, 2750, 0.5f); /* a warp per 8 rows of dw */
}

/* ---- rmsnorm_back and swiglu_back ----------------------------------------------------------------- */

static void cmp_rmsnorm_back_case(int64_t d, int64_t r, bool with_w, int beta) {
    float *x = cmp_rand(r * d, 3.0), *w = cmp_rand(d, 1.5), *dy = cmp_rand(r * d, 1.0), *dx = cmp_rand(r * d, 1.0);
    float *got = cmp_malloc((size_t)(r * d) * sizeof(float));
    op_tensor xd = cmp_dev_2d(x, d, r), wd = cmp_dev_2d(w, d, 1), dyd = cmp_dev_2d(dy, d, r), dxd = cmp_dev_2d(dx, d, r);
    op_tensor xt = op_tensor_2d(OP_TYPE_F32, x, d, r), wt = op_tensor_1d(OP_TYPE_F32, w, d);
    op_tensor dyt = op_tensor_2d(OP_TYPE_F32, dy, d, r), dxt = op_tensor_2d(OP_TYPE_F32, dx, d, r);
    wd.ndim = 1;
    wd.ne[1] = 1;
    char what[80];
    snprintf(what, sizeof what, "rmsnorm_back D=%lld w=%d beta=%d", (long long)d, with_w, beta);
    cmp_ok(op_rmsnorm_back(cmp_cpu, &xt, with_w ? &wt : NULL, 1e-5f, &dyt, &dxt, (float)beta), what);
    cmp_ok(op_rmsnorm_back(cmp_dev, &xd, with_w ? &wd : NULL, 1e-5f, &dyd, &dxd, (float)beta), what);
    cmp_fetch(got, &dxd);
    cmp_close(what, got, dx, r * d, NULL, 2e-5 * cmp_absmax(dx, r * d));
    op_buffer_free(cmp_dev, xd.data);
    op_buffer_free(cmp_dev, wd.data);
    op_buffer_free(cmp_dev, dyd.data);
    free(x);
    free(w);
    free(dy);
    free(dx);
    free(got);
}

static void cmp_test_rmsnorm_back(void **state) {
    (void)state;
    CMP_SKIP_WITHOUT_DEVICE();
    static const int64_t ds[] = {5, 64, 300}, rs[] = {1, 7, 33};
    for (size_t c = 0; c < 3; c++)
        for (int with_w = 0; with_w < 2; with_w++)
            for (int beta = 0; beta < 2; beta++) cmp_rmsnorm_back_case(ds[c], rs[c], with_w, beta);
}

/* dgate into its own buffer, or over dout (alias). */
static void cmp_test_swiglu_back(void **state) {
    (void)state;
    CMP_SKIP_WITHOUT_DEVICE();
    enum { T = 7, F = 50, N = T * F };
    float *g = cmp_rand(N, 6.0), *u = cmp_rand(N, 2.0), *dout = cmp_rand(N, 1.0);
    float *dg = cmp_malloc(N * sizeof(float)), *du = cmp_malloc(N * sizeof(float));
    float got[N];
    op_tensor gt = op_tensor_2d(OP_TYPE_F32, g, F, T), ut = op_tensor_2d(OP_TYPE_F32, u, F, T);
    op_tensor dot = op_tensor_2d(OP_TYPE_F32, dout, F, T), dgt = op_tensor_2d(OP_TYPE_F32, dg, F, T);
    op_tensor dut = op_tensor_2d(OP_TYPE_F32, du, F, T);
    cmp_ok(op_swiglu_back(cmp_cpu, &gt, &ut, &dot, &dgt, &dut), "swiglu_back cpu");
    for (int alias = 0; alias < 2; alias++) {
        op_tensor gd = cmp_dev_2d(g, F, T), ud = cmp_dev_2d(u, F, T), dod = cmp_dev_2d(dout, F, T);
        op_tensor dgd = alias ? dod : cmp_dev_2d(dg, F, T), dud = cmp_dev_2d(du, F, T);
        cmp_ok(op_swiglu_back(cmp_dev, &gd, &ud, &dod, &dgd, &dud), "swiglu_back");
        cmp_fetch(got, &dgd);
        cmp_close(alias ? "swiglu_back dgate over dout" : "swiglu_back dgate", got, dg, N, NULL, 2e-6 * cmp_absmax(dg, N));
        cmp_fetch(got, &dud);
        cmp_close("swiglu_back dup", got, du, N, NULL, 2e-6 * cmp_absmax(du, N));
        op_buffer_free(cmp_dev, gd.data);
        op_buffer_free(cmp_dev, ud.data);
        if (!alias) op_buffer_free(cmp_dev, dod.data);
    }
    free(g);
    free(u);
    free(dout);
    free(dg);
    free(du);
}

/* ---- attention_back -------------------------------------------------------------------------- */

/* Examples of lens[0..n_ex) rows packed into T rows: first[] of each row. */
static void cmp_first_of(const int *lens, int n_ex, int32_t *first) {
    for (int e = 0, r = 0; e < n_ex; r += lens[e], e++)
        for (int i = 0; i < lens[e]; i++) first[r + i] = r;
}

/* The gradients of attention over packed examples (lens), on both backends.
 * out is the CPU's forward through op_attention over per-example views. */
static void cmp_attention_back_case(int nh, int kvh, int hd, const int *lens, int n_ex) {
    int T = 0;
    for (int e = 0; e < n_ex; e++) T += lens[e];
    const int64_t nq = (int64_t)T * nh * hd, nk = (int64_t)T * kvh * hd;
    int32_t *first = cmp_malloc((size_t)T * sizeof(int32_t));
    cmp_first_of(lens, n_ex, first);
    float *q = cmp_rand(nq, 2.0), *k = cmp_rand(nk, 2.0), *v = cmp_rand(nk, 1.5), *dout = cmp_rand(nq, 1.0);
    float *out = cmp_rand(nq, 1.0), *g[3], *got = cmp_malloc((size_t)nq * sizeof(float));
    for (int i = 0; i < 3; i++) g[i] = cmp_malloc((size_t)(i ? nk : nq) * sizeof(float));
    op_attn_train a = {nh, kvh, hd, 1.0f / sqrtf((float)hd), first};
    op_tensor qt = op_tensor_3d(OP_TYPE_F32, q, hd, nh, T), kt = op_tensor_3d(OP_TYPE_F32, k, hd, kvh, T);
    op_tensor vt = op_tensor_3d(OP_TYPE_F32, v, hd, kvh, T), ot = op_tensor_3d(OP_TYPE_F32, out, hd, nh, T);
    op_tensor dot = op_tensor_3d(OP_TYPE_F32, dout, hd, nh, T), gt[3];
    for (int i = 0; i < 3; i++) gt[i] = op_tensor_3d(OP_TYPE_F32, g[i], hd, i ? kvh : nh, T);
    /* out: each example's causal attention, as the forward computes it */
    for (int e = 0, r = 0; e < n_ex; r += lens[e], e++) {
        int32_t *seq = cmp_malloc((size_t)lens[e] * sizeof(int32_t)), *pos = cmp_malloc((size_t)lens[e] * sizeof(int32_t));
        for (int i = 0; i < lens[e]; i++) {
            seq[i] = 0;
            pos[i] = i;
        }
        op_tensor ke = op_tensor_3d(OP_TYPE_F32, k + (int64_t)r * kvh * hd, hd, kvh, lens[e]);
        op_tensor ve = op_tensor_3d(OP_TYPE_F32, v + (int64_t)r * kvh * hd, hd, kvh, lens[e]);
        op_tensor qe = op_tensor_3d(OP_TYPE_F32, q + (int64_t)r * nh * hd, hd, nh, lens[e]);
        op_tensor oe = op_tensor_3d(OP_TYPE_F32, out + (int64_t)r * nh * hd, hd, nh, lens[e]);
        op_attn fa = {nh, kvh, hd, a.scale, 1, seq, pos, &ke, &ve};
        cmp_ok(op_attention(cmp_cpu, &qe, &fa, &oe), "attention cpu");
        free(seq);
        free(pos);
    }
    cmp_ok(op_attention_back(cmp_cpu, &a, &qt, &kt, &vt, &ot, &dot, &gt[0], &gt[1], &gt[2]), "attention_back cpu");
    op_tensor qd = qt, kd = kt, vd = vt, od = ot, dod = dot, gd[3];
    qd.data = cmp_put(q, (size_t)nq * sizeof(float));
    kd.data = cmp_put(k, (size_t)nk * sizeof(float));
    vd.data = cmp_put(v, (size_t)nk * sizeof(float));
    od.data = cmp_put(out, (size_t)nq * sizeof(float));
    dod.data = cmp_put(dout, (size_t)nq * sizeof(float));
    for (int i = 0; i < 3; i++) {
        gd[i] = gt[i];
        gd[i].data = cmp_put(out, (size_t)(i ? nk : nq) * sizeof(float)); /* overwritten */
    }
    cmp_ok(op_attention_back(cmp_dev, &a, &qd, &kd, &vd, &od, &dod, &gd[0], &gd[1], &gd[2]), "attention_back");
    static const char *names[] = {"dq", "dk", "dv"};
    for (int i = 0; i < 3; i++) {
        const int64_t n = i ? nk : nq;
        char what[96];
        snprintf(what, sizeof what, "attention_back %s H=%d KVH=%d hd=%d T=%d", names[i], nh, kvh, hd, T);
        cmp_fetch(got, &gd[i]);
        cmp_close(what, got, g[i], n, NULL, 5e-5 * cmp_absmax(g[i], n) + 1e-6);
    }
    op_buffer_free(cmp_dev, qd.data);
    op_buffer_free(cmp_dev, kd.data);
    op_buffer_free(cmp_dev, vd.data);
    op_buffer_free(cmp_dev, od.data);
    op_buffer_free(cmp_dev, dod.data);
    for (int i = 0; i < 3; i++) free(g[i]);
    free(first);
    free(q);
    free(k);
    free(v);
    free(dout);
    free(out);
    free(got);
}

static void cmp_test_attention_back(void **state) {
    (void)state;
    CMP_SKIP_WITHOUT_DEVICE();
    static const int one[] = {1}, seven[] = {3, 4}, packed[] = {5, 1, 20, 7}, long1[] = {40};
    cmp_attention_back_case(4, 2, 16, one, 1);
    cmp_attention_back_case(4, 2, 16, seven, 2);
    cmp_attention_back_case(4, 2, 16, packed, 4);
    cmp_attention_back_case(6, 2, 40, packed, 4);
    cmp_attention_back_case(6, 2, 40, long1, 1); /* more than 32 keys and 32 (row, head) pairs */
    cmp_attention_back_case(2, 2, 64, seven, 2);
    /* head_dim beyond the kernel's limit */
    float *buf = op_buffer_alloc(cmp_dev, 300 * 4);
    assert_non_null(buf);
    const int32_t f0 = 0;
    op_attn_train a = {1, 1, 300, 1.0f, &f0};
    op_tensor t = op_tensor_3d(OP_TYPE_F32, buf, 300, 1, 1);
    assert_int_equal(op_attention_back(cmp_dev, &a, &t, &t, &t, &t, &t, &t, &t, &t), FU_ERR_UNSUPPORTED);
    op_buffer_free(cmp_dev, buf);
}

/* ---- cross_entropy and dropout -------------------------------------------------------------------- */

static void cmp_cross_entropy_case(int64_t r, int64_t v, float weight) {
    float *x = cmp_rand(r * v, 8.0), *got = cmp_malloc((size_t)(r * v) * sizeof(float));
    int32_t *tg = cmp_malloc((size_t)r * sizeof(int32_t));
    float *loss = cmp_malloc((size_t)r * sizeof(float)), *lossd = cmp_malloc((size_t)r * sizeof(float));
    uint8_t *corr = cmp_malloc((size_t)r), *corrd = cmp_malloc((size_t)r);
    for (int64_t i = 0; i < r; i++) tg[i] = i % 3 == 2 ? -1 : (int32_t)((i * 7919) % v);
    if (r > 1 && v > 2) { /* row 1: a tie for the largest logit, the target the second of them */
        x[v + 1] = x[v + 2] = 20.0f;
        tg[1] = 2;
    }
    if (r > 3) x[3 * v + tg[3]] = 30.0f; /* row 3: the target the clear winner */
    op_tensor xd = cmp_dev_2d(x, v, r), xt = op_tensor_2d(OP_TYPE_F32, x, v, r);
    char what[80];
    snprintf(what, sizeof what, "cross_entropy R=%lld V=%lld", (long long)r, (long long)v);
    cmp_ok(op_cross_entropy(cmp_cpu, &xt, tg, weight, loss, corr), what);
    cmp_ok(op_cross_entropy(cmp_dev, &xd, tg, weight, lossd, corrd), what);
    double *tol = cmp_malloc((size_t)(r * v) * sizeof(double));
    for (int64_t i = 0; i < r * v; i++) tol[i] = 1e-6 * weight + 1e-5 * fabs(x[i]);
    cmp_fetch(got, &xd);
    cmp_close(what, got, x, r * v, tol, 0);
    for (int64_t i = 0; i < r; i++) tol[i] = 1e-5 * fabs(loss[i]) + 1e-6;
    cmp_close(what, lossd, loss, r, tol, 0);
    assert_memory_equal(corrd, corr, (size_t)r);
    free(x);
    free(got);
    free(tg);
    free(loss);
    free(lossd);
    free(corr);
    free(corrd);
    free(tol);
}

static void cmp_test_cross_entropy(void **state) {
    (void)state;
    CMP_SKIP_WITHOUT_DEVICE();
    cmp_cross_entropy_case(1, 5, 1.0f);
    cmp_cross_entropy_case(7, 300, 0.25f);
    cmp_cross_entropy_case(33, 1000, 1.0f / 33.0f);
    /* loss and correct may be NULL; a target out of range writes nothing */
    enum { R = 3, V = 10 };
    float x[R * V], back[R * V];
    cmp_fill(x, R * V, 4.0);
    op_tensor xd = cmp_dev_2d(x, V, R);
    const int32_t tg[R] = {1, -1, 9}, bad[R] = {1, V, 0};
    assert_int_equal(op_cross_entropy(cmp_dev, &xd, bad, 1.0f, NULL, NULL), FU_ERR_RANGE);
    cmp_get(back, xd.data, sizeof back);
    assert_memory_equal(back, x, sizeof x);
    cmp_ok(op_cross_entropy(cmp_dev, &xd, tg, 1.0f, NULL, NULL), "cross_entropy without loss");
    cmp_fetch(back, &xd);
    for (int i = V; i < 2 * V; i++) assert_true(back[i] == 0.0f);
}

static void cmp_test_dropout(void **state) {
    (void)state;
    CMP_SKIP_WITHOUT_DEVICE();
    enum { R = 7, N = 77 };
    static const float ps[] = {0.1f, 0.5f, 0.9f};
    float *x = cmp_rand(R * N, 3.0), *want = cmp_malloc(R * N * sizeof(float)), got[R * N];
    for (int i = 0; i < 3; i++) {
        memcpy(want, x, R * N * sizeof(float));
        op_tensor xd = cmp_dev_2d(x, N, R), xt = op_tensor_2d(OP_TYPE_F32, want, N, R);
        const uint64_t seed = 0x1234567890abcdefull * (uint64_t)(i + 1);
        cmp_ok(op_dropout(cmp_cpu, &xt, ps[i], seed, 11 * i), "dropout cpu");
        cmp_ok(op_dropout(cmp_dev, &xd, ps[i], seed, 11 * i), "dropout");
        cmp_fetch(got, &xd);
        if (memcmp(got, want, sizeof got)) fail_msg("dropout p=%g: the device's mask or scale differs", ps[i]);
    }
    free(x);
    free(want);
}

#define CMP_TRAIN_TESTS                                                                                 \
    cmocka_unit_test(cmp_test_add_rows), cmocka_unit_test(cmp_test_matmul_back),                       \
        cmocka_unit_test(cmp_test_outer_acc), cmocka_unit_test(cmp_test_rmsnorm_back),                 \
        cmocka_unit_test(cmp_test_swiglu_back), cmocka_unit_test(cmp_test_attention_back),             \
        cmocka_unit_test(cmp_test_cross_entropy), cmocka_unit_test(cmp_test_dropout)

#endif
