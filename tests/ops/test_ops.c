/* test_ops.c -- every op of the CPU backend on every ISA path and thread count, against
 * straightforward double-precision loops written here.
 *
 * Backends: each of portable / avx2 / avx512 that this CPU has, with 1 and 2
 * threads. Tolerances (stated per check below):
 *   matmul:     |y - ref| <= 1e-5 * sum_k |w_k x_k| + 1e-6, where ref uses the
 *               op_dequantize_row'd weights (f32 accumulation vs double), for
 *               every weight type and every T (decode T <= 8, batched decode
 *               T = 6..33 around the matvec / 16-token / 32-token block
 *               boundaries, and prefill alike), and results for the same
 *               token at T <= 8 and T > 8 agree to that tolerance. Backends with the opt-in
 *               op_cpu_options.quantized_activations (each SIMD ISA, 2
 *               threads): for Q8_0/Q4_0/Q4_1 at T <= 8 and K % 64 == 0 the
 *               same tolerance against the double reference over x rounded
 *               to int8 per 32-block (d = amax/127, q = rint(x/d)), which the
 *               exact path must NOT match at long K (the checks discriminate);
 *               elsewhere ref. Q8_0_R16 / Q4_0_R16 / Q4_1_R16 on AVX-512
 *               (every T): the same tolerance against the reference over x
 *               rounded to integers per 32-block (d = amax/32639; Q4_1's minimum
 *               times the exact sum of x), and within that plus
 *               sum_blocks d/2 * sum |w| of ref; Q8_0 also over all 256 byte
 *               values;
 *   get_rows:   bit-exact with op_dequantize_row;
 *   kv_store:   bit-exact with op_f32_to_f16 / memcpy;
 *   attention:  |out - ref| <= 2e-5 * max|v| + 1e-6 (online softmax in f32);
 *   rmsnorm, rope, swiglu, softmax, log_softmax, add: relative 2e-6 .. 1e-5.
 * Under the sanitizers (FUSION_SANITIZED=1) the big shapes are skipped.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ops-test.h"
#include "ops.h"
#include "status.h"

/* ---- helpers ------------------------------------------------------------- */

typedef struct test_be {
    op_backend *be;
    char label[32];
} test_be;

#define MAX_BES 6
static test_be bes[MAX_BES]; /* the default (exact) backends */
static int n_bes;
static test_be qbes[2]; /* SIMD backends with the opt-in int8 decode activations */
static int n_qbes;

/* Every ISA this CPU has, with 1 and 2 threads; and each SIMD ISA with
 * quantized_activations (2 threads). */
static int setup_backends(void **state) {
    (void)state;
    static const op_cpu_isa isas[] = {OP_CPU_ISA_PORTABLE, OP_CPU_ISA_AVX2, OP_CPU_ISA_AVX512};
    static const char *names[] = {"portable", "avx2", "avx512"};
    n_bes = n_qbes = 0;
    for (int i = 0; i < 3; i++) {
        for (int nt = 1; nt <= 3; nt++) {
            bool qx = nt == 3;
            if (qx && isas[i] == OP_CPU_ISA_PORTABLE) continue;
            op_backend *be = op_backend_cpu_new(
                &(op_cpu_options){.n_threads = qx ? 2 : nt, .isa = isas[i], .quantized_activations = qx});
            assert_non_null(be);
            if (strcmp(op_backend_isa(be), names[i]) != 0) { /* the CPU lacks this level */
                op_backend_free(be);
                continue;
            }
            test_be *tb = qx ? &qbes[n_qbes++] : &bes[n_bes++];
            tb->be = be;
            snprintf(tb->label, sizeof tb->label, "%s/%dt%s", names[i], qx ? 2 : nt, qx ? "/int8-x" : "");
        }
    }
    assert_true(n_bes >= 2);
    return 0;
}

static int teardown_backends(void **state) {
    (void)state;
    for (int i = 0; i < n_bes; i++) op_backend_free(bes[i].be);
    for (int i = 0; i < n_qbes; i++) op_backend_free(qbes[i].be);
    n_bes = n_qbes = 0;
    return 0;
}

/* ---- backend basics ---------------------------------------------------------- */

static void test_backend_basics(void **state) {
    (void)state;
    for (int b = 0; b < n_bes; b++) {
        op_backend *be = bes[b].be;
        assert_string_equal(op_backend_name(be), "cpu");
        assert_true(op_backend_n_threads(be) == 1 || op_backend_n_threads(be) == 2);
        for (int t = 0; t < OP_TYPE_COUNT; t++)
            assert_int_equal(op_backend_supports(be, (op_type)t), t != OP_TYPE_I32);
        /* only the AVX-512 kernels want rows interleaved, and only whole groups of 16 */
        bool avx512 = strcmp(op_backend_isa(be), "avx512") == 0;
        static uint8_t q[48 * 32 * sizeof(float)];
        static const struct { op_type type; int64_t rows; bool repacked; } cases[] = {
            {OP_TYPE_Q4_0, 48, true}, {OP_TYPE_Q4_1, 16, true}, {OP_TYPE_Q4_0, 40, false},
            {OP_TYPE_F16, 32, true},  {OP_TYPE_BF16, 16, true}, {OP_TYPE_BF16, 24, false},
            {OP_TYPE_Q8_0, 48, true}, {OP_TYPE_Q8_0, 24, false}, {OP_TYPE_F32, 32, false},
            {OP_TYPE_I8, 32, false}};
        for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
            op_tensor w = op_tensor_2d(cases[i].type, q, 32, cases[i].rows), pw;
            int rc = op_weight_prepare(be, &w, &pw);
            assert_int_equal(rc, avx512 && cases[i].repacked);
            if (rc == 1) {
                assert_int_equal(op_type_row_group(pw.type), OP_R16_ROWS);
                assert_int_equal(op_type_plain(pw.type), cases[i].type);
                assert_true(pw.data != w.data);
                op_buffer_free(be, pw.data);
            } else {
                assert_memory_equal(&pw, &w, sizeof w);
            }
        }
        uint8_t *p = op_buffer_alloc(be, 1000);
        assert_non_null(p);
        for (int i = 0; i < 1000; i++) assert_int_equal(p[i], 0);
        uint8_t src[16], dst[16];
        for (int i = 0; i < 16; i++) src[i] = (uint8_t)(i * 7);
        assert_int_equal(op_buffer_set(be, p, src, 16), FU_OK);
        assert_int_equal(op_buffer_get(be, dst, p, 16), FU_OK);
        assert_memory_equal(src, dst, 16);
        op_buffer_free(be, p);
        op_buffer_free(be, NULL);
        assert_int_equal(op_reserve(be, 64, 1024), FU_OK);
        assert_int_equal(op_synchronize(be), FU_OK);
    }
    op_backend_free(NULL);
    /* AUTO picks the best level; a level the CPU lacks falls back */
    op_backend *be = op_backend_cpu_new(NULL);
    assert_non_null(be);
    assert_true(op_backend_n_threads(be) >= 1);
    op_backend_free(be);
}

/* ---- matmul ------------------------------------------------------------------ */

static const op_type weight_types[] = {OP_TYPE_F32,  OP_TYPE_F16,  OP_TYPE_BF16, OP_TYPE_Q8_0,
                                       OP_TYPE_Q4_0, OP_TYPE_Q4_1, OP_TYPE_I8};
/* the row-interleaved layouts (N a multiple of 16) */
static const op_type r16_types[] = {OP_TYPE_Q8_0_R16, OP_TYPE_Q4_0_R16, OP_TYPE_Q4_1_R16, OP_TYPE_F16_R16,
                                    OP_TYPE_BF16_R16};

/* One (type, T, N, K) case on every backend against a double reference over
 * the dequantized weights (and, for the opt-in int8-activation backends where
 * that path applies, over the int8-rounded x). Returns the largest
 * |y - ref| / tol seen on the opt-in backends where they use int8 x (0 if none). */
static double matmul_case_full(op_type type, int64_t t, int64_t n, int64_t k, bool full_range) {
    const op_type plain = op_type_plain(type); /* quantized as this, then repacked as type */
    size_t rb = op_row_bytes(plain, k);
    uint8_t *w = malloc(rb * (size_t)n + 1), *wr = NULL;
    float *scales = malloc((size_t)n * sizeof(float));
    float *row = malloc((size_t)k * sizeof(float));
    float *wd = malloc((size_t)(n * k) * sizeof(float));
    float *x = malloc((size_t)(t * k) * sizeof(float));
    float *y = malloc((size_t)(t * n) * sizeof(float));
    double *ref = malloc((size_t)(t * n) * sizeof(double));
    double *mag = malloc((size_t)(t * n) * sizeof(double));
    double *refq = malloc((size_t)(t * n) * sizeof(double)); /* over int8-rounded x */
    double *xr = malloc((size_t)(t * k) * sizeof(double));
    double *refw = malloc((size_t)(t * n) * sizeof(double)); /* over int16-rounded x */
    double *bnd = malloc((size_t)(t * n) * sizeof(double));  /* sum over blocks of d/2 * sum |w| */
    double *xw = malloc((size_t)(t * k) * sizeof(double)), *xwd = malloc((size_t)(t * k) * sizeof(double));
    assert_true(w && scales && row && wd && x && y && ref && mag && refq && xr && refw && bnd && xw && xwd);
    for (int64_t r = 0; r < n; r++) {
        fill(row, k, 1.0);
        op_quantize_row(plain, row, k, w + (size_t)r * rb, &scales[r]);
    }
    if (full_range) { /* Q8_0 values over all 256 bytes, -128 too (files may hold it; op_quantize_row does not) */
        assert_int_equal(plain, OP_TYPE_Q8_0);
        for (int64_t r = 0; r < n; r++)
            for (int64_t b = 0; b < k / 32; b++) {
                op_block_q8_0 *blk = (op_block_q8_0 *)(w + (size_t)r * rb) + b;
                for (int i = 0; i < 32; i++) {
                    int v = (int)floor((rnd() + 1.0) * 128.0);
                    blk->qs[i] = (int8_t)(r == 0 && b == 0 ? -128 : r == 1 && b == 0 ? 127 : v - 128);
                }
            }
    }
    op_tensor wt = op_tensor_2d(plain, w, k, n);
    wt.row_scale = scales;
    wt.name = "w";
    for (int64_t r = 0; r < n; r++) op_dequantize_row(&wt, r, wd + r * k);
    if (type != plain) { /* the same weights interleaved: they dequantize to the same values */
        wr = malloc(rb * (size_t)n);
        assert_non_null(wr);
        assert_int_equal(op_repack_weight(&wt, type, wr), FU_OK);
        wt.type = type;
        wt.data = wr;
        for (int64_t r = 0; r < n; r++) {
            op_dequantize_row(&wt, r, row);
            assert_memory_equal(row, wd + r * k, (size_t)k * sizeof(float));
        }
    }
    fill(x, t * k, 2.0);
    for (int64_t i = 0; i < t * k; i++) x[i] += 0.5f; /* a mean, so that block sums matter */
    bool int8_x = t <= 8 && k % 64 == 0 &&
                  (type == OP_TYPE_Q8_0 || type == OP_TYPE_Q4_0 || type == OP_TYPE_Q4_1);
    for (int64_t i = 0; int8_x && i < t * k; i += 32) {
        float am = 0;
        for (int64_t c = i; c < i + 32; c++) am = fmaxf(am, fabsf(x[c]));
        float d = am / 127.0f, id = d > 0 ? 1.0f / d : 0.0f;
        for (int64_t c = i; c < i + 32; c++) xr[c] = (double)d * (double)rintf(x[c] * id);
    }
    /* the Q8_0 and Q4 interleaved matvecs on AVX-512 round x to integers per
     * 32-block (d = amax/32639, q = rint(x/d)) whatever T */
    const bool int16_x = type == OP_TYPE_Q8_0_R16 || type == OP_TYPE_Q4_0_R16 || type == OP_TYPE_Q4_1_R16;
    for (int64_t i = 0; int16_x && i < t * k; i += 32) {
        float am = 0;
        for (int64_t c = i; c < i + 32; c++) am = fmaxf(am, fabsf(x[c]));
        float d = am / 32639.0f, id = d > 0 ? 1.0f / d : 0.0f;
        for (int64_t c = i; c < i + 32; c++) {
            xw[c] = (double)d * (double)rintf(x[c] * id);
            xwd[c] = d;
        }
    }
    for (int64_t i = 0; i < t; i++)
        for (int64_t r = 0; r < n; r++) {
            double s = 0, a = 0, q = 0, qw = 0, e = 0;
            for (int64_t c = 0; c < k; c++) {
                double p = (double)wd[r * k + c] * x[i * k + c];
                s += p;
                a += fabs(p);
                if (int8_x) q += (double)wd[r * k + c] * xr[i * k + c];
                if (int16_x) {
                    /* Q4_1's minimum m multiplies the block's exact sum of x */
                    double mn = 0;
                    if (plain == OP_TYPE_Q4_1) {
                        uint16_t h;
                        memcpy(&h, w + (size_t)r * rb + (size_t)(c / 32) * sizeof(op_block_q4_1) + 2, 2);
                        mn = op_f16_to_f32(h);
                    }
                    qw += ((double)wd[r * k + c] - mn) * xw[i * k + c] + mn * x[i * k + c];
                    e += fabs((double)wd[r * k + c]) * xwd[i * k + c] / 2;
                }
            }
            ref[i * n + r] = s;
            mag[i * n + r] = a;
            refq[i * n + r] = int8_x ? q : s;
            refw[i * n + r] = int16_x ? qw : s;
            bnd[i * n + r] = e;
        }
    op_tensor xt = op_tensor_2d(OP_TYPE_F32, x, k, t), yt = op_tensor_2d(OP_TYPE_F32, y, n, t);
    char what[64];
    snprintf(what, sizeof what, "matmul %s T=%lld N=%lld K=%lld", op_type_name(type), (long long)t, (long long)n,
             (long long)k);
    for (int b = 0; b < n_bes; b++) { /* every path against ref, or refw and within bnd of ref */
        const bool w16 = int16_x && strncmp(bes[b].label, "avx512", 6) == 0;
        for (int64_t i = 0; i < t * n; i++) y[i] = NAN;
        int rc = op_matmul(bes[b].be, &wt, &xt, &yt);
        if (rc) fail_msg("%s [%s]: %s", what, bes[b].label, fu_last_error());
        for (int64_t i = 0; i < t * n; i++) {
            check_close(what, bes[b].label, i, y[i], w16 ? refw[i] : ref[i], 1e-5 * mag[i] + 1e-6);
            if (w16) check_close(what, bes[b].label, i, y[i], ref[i], 1e-5 * mag[i] + 1e-6 + bnd[i]);
        }
    }
    double worst = 0;
    for (int b = 0; b < n_qbes; b++) { /* opt-in: refq where the int8 path applies */
        for (int64_t i = 0; i < t * n; i++) y[i] = NAN;
        int rc = op_matmul(qbes[b].be, &wt, &xt, &yt);
        if (rc) fail_msg("%s [%s]: %s", what, qbes[b].label, fu_last_error());
        for (int64_t i = 0; i < t * n; i++) {
            double tol = 1e-5 * mag[i] + 1e-6;
            check_close(what, qbes[b].label, i, y[i],
                        int16_x && strncmp(qbes[b].label, "avx512", 6) == 0 ? refw[i] : refq[i], tol);
            if (int8_x && fabs(y[i] - ref[i]) / tol > worst) worst = fabs(y[i] - ref[i]) / tol;
        }
    }
    free(w);
    free(wr);
    free(scales);
    free(row);
    free(wd);
    free(x);
    free(y);
    free(ref);
    free(mag);
    free(refq);
    free(xr);
    free(refw);
    free(bnd);
    free(xw);
    free(xwd);
    return worst;
}

static double matmul_case(op_type type, int64_t t, int64_t n, int64_t k) {
    return matmul_case_full(type, t, n, k, false);
}

static void test_matmul_decode(void **state) {
    (void)state;
    /* T <= 8 takes the matvec path (T <= 6 where the narrow GEMM kernel takes
     * T = 7, 8; the opt-in int8 path up to 8); K multiples of 32 but not of 64/256 (f32
     * activations), and multiples of 64 (the int8 activation path); odd N */
    /* K/32 blocks per row: 1..18 (steps of 8 blocks and tails); N leaves
     * row-group tails; T = 1..8 */
    static const int64_t shapes[][3] = {{1, 67, 96}, {2, 13, 160}, {3, 33, 288}, {4, 5, 32},
                                        {1, 1, 64}, {1, 35, 128}, {4, 19, 320}, {2, 3, 576},
                                        {7, 21, 128}, {8, 17, 96},  {5, 23, 544}, {6, 9, 256},
                                        {1, 38, 2048}};
    for (size_t ti = 0; ti < sizeof weight_types / sizeof weight_types[0]; ti++)
        for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++)
            matmul_case(weight_types[ti], shapes[s][0], shapes[s][1], shapes[s][2]);
}

/* The interleaved layouts: decode (every token count of the matvec path,
 * K from 1 to 64 blocks, up to 10 groups of rows), batched decode (passes of
 * up to 8 tokens) and prefill (GEMM panels that straddle groups), on every ISA
 * (the portable and AVX2 paths run them too, though op_weight_prepare never
 * picks them there); the 16-bit ones also with K not a multiple of 32. */
static void test_matmul_interleaved(void **state) {
    (void)state;
    static const int64_t shapes[][3] = {{1, 16, 32},  {2, 32, 96},   {3, 48, 288},  {4, 16, 2048}, {5, 64, 544},
                                        {6, 32, 256}, {7, 16, 128},  {8, 48, 96},   {1, 160, 576}, {9, 32, 544},
                                        {16, 48, 544}, {17, 16, 544}, {33, 32, 160}, {40, 64, 544}};
    static const int64_t odd_k[][3] = {{1, 16, 7}, {3, 32, 45}, {9, 16, 70}, {33, 48, 131}};
    for (size_t ti = 0; ti < sizeof r16_types / sizeof r16_types[0]; ti++) {
        for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++)
            matmul_case(r16_types[ti], shapes[s][0], shapes[s][1], shapes[s][2]);
        for (size_t s = 0; op_type_block_elems(r16_types[ti]) == 1 && s < sizeof odd_k / sizeof odd_k[0]; s++)
            matmul_case(r16_types[ti], odd_k[s][0], odd_k[s][1], odd_k[s][2]);
    }
    /* Q8_0_R16 stores q + 128: every byte value, rows of all -128 and all 127 among them */
    matmul_case_full(OP_TYPE_Q8_0_R16, 1, 48, 2048, true);
    matmul_case_full(OP_TYPE_Q8_0_R16, 3, 32, 544, true);
    matmul_case_full(OP_TYPE_Q8_0_R16, 9, 16, 96, true);
    matmul_case_full(OP_TYPE_Q8_0, 2, 19, 160, true);
    /* a NaN or inf among a token's activations makes its outputs NaN or inf,
     * as in f32 (the int16 rounding must not turn it into a finite number) */
    for (size_t ti = 0; ti < sizeof r16_types / sizeof r16_types[0]; ti++) {
        enum { N = 32, K = 64 };
        const op_type plain = op_type_plain(r16_types[ti]);
        const size_t rb = op_row_bytes(plain, K);
        uint8_t *w = malloc(rb * N), *wr = malloc(rb * N);
        float row[K], x[K], y[N];
        assert_true(w && wr);
        for (int r = 0; r < N; r++) {
            fill(row, K, 1.0);
            op_quantize_row(plain, row, K, w + (size_t)r * rb, NULL);
        }
        op_tensor pt = op_tensor_2d(plain, w, K, N), wt = pt;
        assert_int_equal(op_repack_weight(&pt, r16_types[ti], wr), FU_OK);
        wt.type = r16_types[ti];
        wt.data = wr;
        static const float bad[] = {NAN, INFINITY, -INFINITY};
        for (int bi = 0; bi < 3; bi++)
            for (int b = 0; b < n_bes; b++) {
                fill(x, K, 1.0);
                x[37] = bad[bi];
                op_tensor xt = op_tensor_2d(OP_TYPE_F32, x, K, 1), yt = op_tensor_2d(OP_TYPE_F32, y, N, 1);
                assert_int_equal(op_matmul(bes[b].be, &wt, &xt, &yt), FU_OK);
                for (int r = 0; r < N; r++)
                    if (isfinite(y[r]))
                        fail_msg("matmul %s [%s]: x holds %g, row %d is finite (%g)", op_type_name(wt.type),
                                 bes[b].label, (double)bad[bi], r, (double)y[r]);
            }
        free(w);
        free(wr);
    }
    /* what cannot be interleaved is refused */
    static uint8_t q[17 * sizeof(op_block_q4_0)], out[sizeof q];
    op_tensor w = op_tensor_2d(OP_TYPE_Q4_0, q, 32, 17);
    assert_int_equal(op_repack_weight(&w, OP_TYPE_Q4_0_R16, out), FU_ERR_INVALID);
    w.ne[1] = 16;
    assert_int_equal(op_repack_weight(&w, OP_TYPE_Q4_1_R16, out), FU_ERR_INVALID);
    assert_int_equal(op_repack_weight(&w, OP_TYPE_Q8_0, out), FU_ERR_INVALID);
    assert_int_equal(op_repack_weight(&w, OP_TYPE_Q8_0_R16, out), FU_ERR_INVALID); /* a Q4_0 source */
    op_tensor r = op_tensor_2d(OP_TYPE_Q4_0_R16, out, 32, 17);
    float x[32] = {0}, y[17];
    op_tensor xt = op_tensor_2d(OP_TYPE_F32, x, 32, 1), yt = op_tensor_2d(OP_TYPE_F32, y, 17, 1);
    for (int b = 0; b < n_bes; b++) assert_int_equal(op_matmul(bes[b].be, &r, &xt, &yt), FU_ERR_INVALID);
}

/* On AVX-512 the interleaved layouts give a token the same bits whatever
 * else shares its matmul (decode, batched decode and prefill alike): results
 * do not depend on batching (greedy output is the same alone or with other
 * sessions, and a replay rebuilds the same KV cache). N = 80 makes passes of
 * 4 groups and 1. */
static void test_matmul_interleaved_batch_invariant(void **state) {
    (void)state;
    enum { N = 80, TB = 64 };
    static const int64_t ks[] = {544, 70};
    for (size_t ti = 0; ti < sizeof r16_types / sizeof r16_types[0]; ti++) {
        const op_type type = r16_types[ti];
        const int64_t K = ks[op_type_block_elems(type) == 1];
        op_tensor wt = random_weight(type, N, K);
        float *x = malloc((size_t)(TB * K) * sizeof(float));
        float *yb = malloc((size_t)(TB * N) * sizeof(float)), *ys = malloc((size_t)(TB * N) * sizeof(float));
        assert_true(x && yb && ys);
        fill(x, (int64_t)TB * K, 2.0);
        for (int b = 0; b < n_bes; b++) {
            if (strncmp(bes[b].label, "avx512", 6) != 0) continue;
            op_tensor xt = op_tensor_2d(OP_TYPE_F32, x, K, TB), yt = op_tensor_2d(OP_TYPE_F32, yb, N, TB);
            assert_int_equal(op_matmul(bes[b].be, &wt, &xt, &yt), FU_OK);
            static const int ts[] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 17, 31, 33, 40};
            for (size_t s = 0; s < sizeof ts / sizeof ts[0]; s++) {
                xt = op_tensor_2d(OP_TYPE_F32, x, K, ts[s]);
                yt = op_tensor_2d(OP_TYPE_F32, ys, N, ts[s]);
                assert_int_equal(op_matmul(bes[b].be, &wt, &xt, &yt), FU_OK);
                if (memcmp(ys, yb, (size_t)(ts[s] * N) * sizeof(float)) != 0)
                    fail_msg("matmul %s [%s]: T=%d differs from the same tokens at T=%d", op_type_name(type),
                             bes[b].label, ts[s], TB);
            }
        }
        free(wt.data);
        free(x);
        free(yb);
        free(ys);
    }
}

/* Two threads share one backend (a shard serving two spans during a move):
 * each op runs whole, so every result equals the one computed alone. Q4_1
 * interleaved weights use the backend's scratch (the int16-rounded x, on
 * AVX-512) on every decode matmul. */
typedef struct shared_job {
    op_backend *be;
    const op_tensor *w;
    const float *x;  /* (T, K) this thread's activations */
    const float *want;
    int64_t t, n, k;
    int bad;
} shared_job;

static void *shared_run(void *arg) {
    shared_job *j = arg;
    float *y = malloc((size_t)(j->t * j->n) * sizeof(float));
    op_tensor xt = op_tensor_2d(OP_TYPE_F32, (void *)j->x, j->k, j->t), yt = op_tensor_2d(OP_TYPE_F32, y, j->n, j->t);
    for (int it = 0; it < 2000 && y; it++)
        if (op_matmul(j->be, j->w, &xt, &yt) || memcmp(y, j->want, (size_t)(j->t * j->n) * sizeof(float)))
            j->bad++;
    free(y);
    return NULL;
}

static void test_backend_shared_by_threads(void **state) {
    (void)state;
    enum { N = 64, K = 256, T = 3 };
    const size_t rb = op_row_bytes(OP_TYPE_Q4_1, K);
    uint8_t *w = malloc(rb * N);
    float row[K], *x = malloc(2 * T * K * sizeof(float)), *want = malloc(2 * T * N * sizeof(float));
    assert_true(w && x && want);
    for (int r = 0; r < N; r++) {
        fill(row, K, 1.0);
        op_quantize_row(OP_TYPE_Q4_1, row, K, w + (size_t)r * rb, NULL);
    }
    fill(x, 2 * T * K, 2.0);
    op_backend *be = op_backend_cpu_new(&(op_cpu_options){.n_threads = 2});
    assert_non_null(be);
    op_tensor pt = op_tensor_2d(OP_TYPE_Q4_1, w, K, N), wt;
    int rc = op_weight_prepare(be, &pt, &wt);
    assert_true(rc >= 0);
    shared_job jobs[2];
    for (int i = 0; i < 2; i++) {
        op_tensor xt = op_tensor_2d(OP_TYPE_F32, x + i * T * K, K, T), yt = op_tensor_2d(OP_TYPE_F32, want + i * T * N, N, T);
        assert_int_equal(op_matmul(be, &wt, &xt, &yt), FU_OK);
        jobs[i] = (shared_job){be, &wt, x + i * T * K, want + i * T * N, T, N, K, 0};
    }
    pthread_t th[2];
    for (int i = 0; i < 2; i++) assert_int_equal(pthread_create(&th[i], NULL, shared_run, &jobs[i]), 0);
    for (int i = 0; i < 2; i++) pthread_join(th[i], NULL);
    assert_int_equal(jobs[0].bad + jobs[1].bad, 0);
    if (rc == 1) op_buffer_free(be, wt.data);
    op_backend_free(be);
    free(w);
    free(x);
    free(want);
}

/* The opt-in int8-activation path is measurably off the exact reference at
 * long K (so the strict check above can fail), and matches its own. */
static void test_matmul_int8_x_opt_in(void **state) {
    (void)state;
    if (n_qbes == 0) skip();
    static const op_type qtypes[] = {OP_TYPE_Q8_0, OP_TYPE_Q4_0, OP_TYPE_Q4_1};
    for (size_t ti = 0; ti < 3; ti++) {
        double worst = matmul_case(qtypes[ti], 2, 24, 2048);
        if (!(worst > 1.0))
            fail_msg("int8-x %s: expected errors beyond the exact tolerance, worst %.3g of it",
                     op_type_name(qtypes[ti]), worst);
    }
}

/* A token's outputs do not depend on how many tokens share the matmul: rows
 * of a T=12 (prefill) result against T = 1, 3, 8 (decode) over the same rows. */
static void test_matmul_batch_invariance(void **state) {
    (void)state;
    enum { TB = 12, N = 29, K = 1024 };
    for (size_t ti = 0; ti < sizeof weight_types / sizeof weight_types[0]; ti++) {
        op_type type = weight_types[ti];
        size_t rb = op_row_bytes(type, K);
        uint8_t *w = malloc(rb * N);
        float *scales = malloc(N * sizeof(float)), *row = malloc(K * sizeof(float));
        float *wd = malloc((size_t)N * K * sizeof(float)), *x = malloc((size_t)TB * K * sizeof(float));
        float *yb = malloc((size_t)TB * N * sizeof(float)), *ys = malloc((size_t)TB * N * sizeof(float));
        assert_true(w && scales && row && wd && x && yb && ys);
        for (int r = 0; r < N; r++) {
            fill(row, K, 1.0);
            op_quantize_row(type, row, K, w + (size_t)r * rb, &scales[r]);
        }
        op_tensor wt = op_tensor_2d(type, w, K, N);
        wt.row_scale = scales;
        for (int r = 0; r < N; r++) op_dequantize_row(&wt, r, wd + (size_t)r * K);
        fill(x, (int64_t)TB * K, 2.0);
        for (int b = 0; b < n_bes; b++) {
            op_tensor xt = op_tensor_2d(OP_TYPE_F32, x, K, TB), yt = op_tensor_2d(OP_TYPE_F32, yb, N, TB);
            assert_int_equal(op_matmul(bes[b].be, &wt, &xt, &yt), FU_OK);
            static const int ts[] = {1, 3, 8};
            for (int s = 0; s < 3; s++) {
                xt = op_tensor_2d(OP_TYPE_F32, x, K, ts[s]);
                yt = op_tensor_2d(OP_TYPE_F32, ys, N, ts[s]);
                assert_int_equal(op_matmul(bes[b].be, &wt, &xt, &yt), FU_OK);
                for (int i = 0; i < ts[s] * N; i++) {
                    double mag = 0;
                    for (int c = 0; c < K; c++) mag += fabs((double)wd[(i % N) * K + c] * x[(i / N) * K + c]);
                    char what[64];
                    snprintf(what, sizeof what, "matmul %s T=%d vs T=%d", op_type_name(type), ts[s], TB);
                    check_close(what, bes[b].label, i, ys[i], yb[i], 1e-5 * mag + 1e-6);
                }
            }
        }
        free(w);
        free(scales);
        free(row);
        free(wd);
        free(x);
        free(yb);
        free(ys);
    }
}

/* Batched decode (the steps of several sessions in one matmul): T around the
 * boundaries of the matvec path (6, 7, 8), of the 16-token GEMM blocks (9, 15,
 * 16, 17) and of the 32-token ones (31, 32, 33, and 40: two 16-token blocks
 * and a half-empty one). N = 53 leaves partial panels of every height; K = 544
 * spans two narrow K slices and a tail (and one wide slice and a tail). */
static void test_matmul_batched_decode(void **state) {
    (void)state;
    static const int64_t ts[] = {6, 7, 8, 9, 15, 16, 17, 31, 32, 33, 40};
    for (size_t ti = 0; ti < sizeof weight_types / sizeof weight_types[0]; ti++)
        for (size_t s = 0; s < sizeof ts / sizeof ts[0]; s++) matmul_case(weight_types[ti], ts[s], 53, 544);
    if (!sanitized()) /* many units of work per thread, and rows of 4 KiB (bf16 at K = 2048) */
        for (size_t s = 0; s < sizeof ts / sizeof ts[0]; s++) matmul_case(OP_TYPE_BF16, ts[s], 203, 2048);
}

static void test_matmul_prefill(void **state) {
    (void)state;
    /* N not a multiple of any panel height; T=37 leaves a partial token block;
     * K=544 spans two K slices */
    static const int64_t shapes[][3] = {{9, 7, 96}, {37, 29, 160}, {64, 24, 544}, {33, 100, 32}};
    for (size_t ti = 0; ti < sizeof weight_types / sizeof weight_types[0]; ti++)
        for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++)
            matmul_case(weight_types[ti], shapes[s][0], shapes[s][1], shapes[s][2]);
    if (!sanitized()) {
        /* two token blocks of 256, three K slices */
        matmul_case(OP_TYPE_F16, 300, 53, 1056);
        matmul_case(OP_TYPE_Q4_1, 270, 40, 1056);
    }
}

static void test_matmul_plain_odd_k(void **state) {
    (void)state;
    /* plain types accept any K: SIMD tails */
    static const op_type plain[] = {OP_TYPE_F32, OP_TYPE_F16, OP_TYPE_BF16, OP_TYPE_I8};
    for (size_t ti = 0; ti < sizeof plain / sizeof plain[0]; ti++) {
        matmul_case(plain[ti], 1, 19, 37);
        matmul_case(plain[ti], 3, 9, 75);
        matmul_case(plain[ti], 37, 21, 37);
        matmul_case(plain[ti], 9, 5, 7);
        matmul_case(plain[ti], 7, 11, 75); /* several tokens and rows at once, then the K tail */
    }
}

static void test_matmul_errors(void **state) {
    (void)state;
    op_backend *be = bes[0].be;
    float x[64 * 2] = {0}, y[8 * 2];
    uint8_t w[64 * 8 * 4] = {0};
    op_tensor wt = op_tensor_2d(OP_TYPE_F32, w, 64, 8), xt = op_tensor_2d(OP_TYPE_F32, x, 64, 2);
    op_tensor yt = op_tensor_2d(OP_TYPE_F32, y, 7, 2);
    assert_int_equal(op_matmul(be, &wt, &xt, &yt), FU_ERR_INVALID); /* N mismatch */
    yt = op_tensor_2d(OP_TYPE_F32, y, 8, 2);
    op_tensor xbad = op_tensor_2d(OP_TYPE_F32, x, 32, 4);
    assert_int_equal(op_matmul(be, &wt, &xbad, &yt), FU_ERR_INVALID); /* K mismatch */
    op_tensor wq = op_tensor_2d(OP_TYPE_Q8_0, w, 48, 2);
    op_tensor xq = op_tensor_2d(OP_TYPE_F32, x, 48, 2), yq = op_tensor_2d(OP_TYPE_F32, y, 2, 2);
    assert_int_equal(op_matmul(be, &wq, &xq, &yq), FU_ERR_INVALID); /* K % 32 */
    op_tensor wi = op_tensor_2d(OP_TYPE_I8, w, 64, 8);
    assert_int_equal(op_matmul(be, &wi, &xt, &yt), FU_ERR_INVALID); /* no row scales */
    op_tensor w32 = op_tensor_2d(OP_TYPE_I32, w, 64, 8);
    assert_int_equal(op_matmul(be, &w32, &xt, &yt), FU_ERR_UNSUPPORTED);
}

/* op_matmul_n gives each weight's op_matmul result bit for bit: weights of
 * one type (the CPU backend's joint matvec, whose row ranges meet at N not a
 * multiple of 16 for the plain types), of mixed types (one by one), at decode
 * and prefill sizes, on every backend; bad arguments fail before anything
 * is written. */
static void test_matmul_n(void **state) {
    (void)state;
    enum { K = 544, TMAX = 40 };
    static const int ts[] = {1, 3, 8, 20, TMAX};
    op_type types[sizeof weight_types / sizeof weight_types[0] + sizeof r16_types / sizeof r16_types[0] + 1][3];
    size_t nt = 0;
    for (size_t i = 0; i < sizeof weight_types / sizeof weight_types[0]; i++, nt++)
        types[nt][0] = types[nt][1] = types[nt][2] = weight_types[i];
    for (size_t i = 0; i < sizeof r16_types / sizeof r16_types[0]; i++, nt++)
        types[nt][0] = types[nt][1] = types[nt][2] = r16_types[i];
    types[nt][0] = OP_TYPE_Q8_0_R16, types[nt][1] = OP_TYPE_F16, types[nt][2] = OP_TYPE_Q4_0, nt++;
    float *x = malloc((size_t)TMAX * K * sizeof(float));
    assert_non_null(x);
    fill(x, (int64_t)TMAX * K, 2.0);
    for (size_t ti = 0; ti < nt; ti++) {
        op_tensor w[3];
        float *want[3], *got[3];
        for (int i = 0; i < 3; i++) {
            const bool r16 = op_type_row_group(types[ti][i]) > 1;
            const int64_t n = r16 ? 32 * (i + 1) : (int64_t[]){40, 17, 33}[i];
            w[i] = random_weight(types[ti][i], n, K);
            want[i] = malloc((size_t)TMAX * (size_t)n * sizeof(float));
            got[i] = malloc((size_t)TMAX * (size_t)n * sizeof(float));
            assert_true(want[i] && got[i]);
        }
        for (int b = 0; b < n_bes + n_qbes; b++) {
            const test_be *tb = b < n_bes ? &bes[b] : &qbes[b - n_bes];
            for (size_t s = 0; s < sizeof ts / sizeof ts[0]; s++) {
                op_tensor xt = op_tensor_2d(OP_TYPE_F32, x, K, ts[s]), yw[3], yg[3];
                for (int i = 0; i < 3; i++) {
                    yw[i] = op_tensor_2d(OP_TYPE_F32, want[i], w[i].ne[1], ts[s]);
                    yg[i] = op_tensor_2d(OP_TYPE_F32, got[i], w[i].ne[1], ts[s]);
                    assert_int_equal(op_matmul(tb->be, &w[i], &xt, &yw[i]), FU_OK);
                    memset(got[i], 0xff, (size_t)(ts[s] * w[i].ne[1]) * sizeof(float));
                }
                for (int n = 1; n <= 3; n++) {
                    assert_int_equal(op_matmul_n(tb->be, n, (const op_tensor *[]){&w[0], &w[1], &w[2]}, &xt,
                                                 (op_tensor *[]){&yg[0], &yg[1], &yg[2]}),
                                     FU_OK);
                    for (int i = 0; i < n; i++)
                        if (memcmp(got[i], want[i], (size_t)(ts[s] * w[i].ne[1]) * sizeof(float)) != 0)
                            fail_msg("matmul_n of %d (%s, %s, %s) [%s] T=%d: weight %d differs from op_matmul", n,
                                     op_type_name(types[ti][0]), op_type_name(types[ti][1]),
                                     op_type_name(types[ti][2]), tb->label, ts[s], i);
                }
            }
        }
        for (int i = 0; i < 3; i++) {
            free(w[i].data);
            free((void *)w[i].row_scale);
            free(want[i]);
            free(got[i]);
        }
    }
    /* a K mismatch in the second weight, too many weights, none */
    op_tensor w0 = random_weight(OP_TYPE_Q4_0, 32, K), w1 = random_weight(OP_TYPE_Q4_0, 32, K - 32);
    float *y0 = malloc(32 * sizeof(float)), *y1 = malloc(32 * sizeof(float));
    assert_true(y0 && y1);
    memset(y0, 0, 32 * sizeof(float));
    op_tensor xt = op_tensor_2d(OP_TYPE_F32, x, K, 1), yt0 = op_tensor_2d(OP_TYPE_F32, y0, 32, 1),
              yt1 = op_tensor_2d(OP_TYPE_F32, y1, 32, 1);
    const op_tensor *ws[OP_MATMUL_N_MAX + 1] = {&w0, &w1, &w0, &w0, &w0};
    op_tensor *ys[OP_MATMUL_N_MAX + 1] = {&yt0, &yt1, &yt0, &yt0, &yt0};
    assert_int_equal(op_matmul_n(bes[0].be, 2, ws, &xt, ys), FU_ERR_INVALID);
    for (int i = 0; i < 32; i++) assert_true(y0[i] == 0.0f);
    ws[1] = &w0;
    ys[1] = &yt0;
    assert_int_equal(op_matmul_n(bes[0].be, OP_MATMUL_N_MAX + 1, ws, &xt, ys), FU_ERR_INVALID);
    assert_int_equal(op_matmul_n(bes[0].be, 0, ws, &xt, ys), FU_ERR_INVALID);
    assert_int_equal(op_matmul_n(bes[0].be, OP_MATMUL_N_MAX, ws, &xt, ys), FU_OK);
    free(w0.data);
    free(w1.data);
    free(y0);
    free(y1);
    free(x);
}

/* Many back-to-back ops of different kinds: the fork-join pool must not lose,
 * repeat or mix jobs (a late worker must never run a finished job). */
static void test_pool_many_small_ops(void **state) {
    (void)state;
    enum { N = 40, K = 64, ITERS = 300, R = 8, D = 8192 };
    float w[N * K], x[K], y[N], ref[N];
    float *a = malloc(R * D * sizeof(float)), *b = malloc(R * D * sizeof(float));
    assert_true(a && b);
    fill(w, N * K, 1.0);
    fill(x, K, 1.0);
    fill(b, R * D, 1.0);
    for (int r = 0; r < N; r++) {
        double s = 0;
        for (int c = 0; c < K; c++) s += (double)w[r * K + c] * x[c];
        ref[r] = (float)s;
    }
    op_tensor wt = op_tensor_2d(OP_TYPE_F32, w, K, N), xt = op_tensor_2d(OP_TYPE_F32, x, K, 1);
    op_tensor yt = op_tensor_2d(OP_TYPE_F32, y, N, 1);
    op_tensor at = op_tensor_2d(OP_TYPE_F32, a, D, R), bt = op_tensor_2d(OP_TYPE_F32, b, D, R);
    for (int bi = 0; bi < n_bes; bi++) {
        memset(a, 0, R * D * sizeof(float));
        for (int it = 0; it < ITERS; it++) {
            memset(y, 0, sizeof y);
            assert_int_equal(op_matmul(bes[bi].be, &wt, &xt, &yt), FU_OK);
            for (int r = 0; r < N; r++) check_close("pool matvec", bes[bi].label, r, y[r], ref[r], 1e-5);
            if (it % 10 == 0) /* a threaded row op: a += b, counted below */
                assert_int_equal(op_add(bes[bi].be, &at, &bt), FU_OK);
        }
        for (int i = 0; i < R * D; i++) check_close("pool add", bes[bi].label, i, a[i], 30.0 * b[i], 1e-4);
    }
    free(a);
    free(b);
}

/* ---- get_rows ------------------------------------------------------------------ */

/* get_rows of tt on every backend gives ref's op_dequantize_row'd rows, bit for bit. */
static void check_get_rows(const op_tensor *tt, const op_tensor *ref, const int32_t *ids, int t_n) {
    const int64_t d = tt->ne[0];
    float *out = malloc((size_t)(t_n * d) * sizeof(float)), *want = malloc((size_t)d * sizeof(float));
    assert_true(out && want);
    op_tensor ot = op_tensor_2d(OP_TYPE_F32, out, d, t_n);
    for (int b = 0; b < n_bes; b++) {
        memset(out, 0xff, (size_t)(t_n * d) * sizeof(float));
        assert_int_equal(op_get_rows(bes[b].be, tt, ids, &ot), FU_OK);
        for (int t = 0; t < t_n; t++) {
            op_dequantize_row(ref, ids[t], want);
            if (memcmp(want, out + t * d, (size_t)d * sizeof(float)) != 0)
                fail_msg("get_rows %s [%s] row %d differs from %s's op_dequantize_row", op_type_name(tt->type),
                         bes[b].label, t, op_type_name(ref->type));
        }
    }
    free(out);
    free(want);
}

static void test_get_rows(void **state) {
    (void)state;
    enum { V = 23, D = 96, T = 7 };
    int32_t ids[T] = {0, 22, 5, 5, 13, 1, 21};
    for (size_t ti = 0; ti < sizeof weight_types / sizeof weight_types[0]; ti++) {
        op_type type = weight_types[ti];
        size_t rb = op_row_bytes(type, D);
        uint8_t *tab = malloc(rb * V);
        float scales[V], row[D], out[D];
        for (int r = 0; r < V; r++) {
            fill(row, D, 3.0);
            op_quantize_row(type, row, D, tab + r * rb, &scales[r]);
        }
        op_tensor tt = op_tensor_2d(type, tab, D, V);
        tt.row_scale = scales;
        check_get_rows(&tt, &tt, ids, T);
        int32_t bad[1] = {V};
        op_tensor o1 = op_tensor_2d(OP_TYPE_F32, out, D, 1);
        assert_int_equal(op_get_rows(bes[0].be, &tt, bad, &o1), FU_ERR_RANGE);
        bad[0] = -1;
        assert_int_equal(op_get_rows(bes[0].be, &tt, bad, &o1), FU_ERR_RANGE);
        free(tab);
    }
    /* interleaved tables give the plain table's rows */
    enum { VR = 48 };
    for (size_t ti = 0; ti < sizeof r16_types / sizeof r16_types[0]; ti++) {
        op_type type = r16_types[ti], plain = op_type_plain(type);
        size_t rb = op_row_bytes(plain, D);
        uint8_t *tab = malloc(rb * VR), *rep = malloc(rb * VR);
        float row[D];
        assert_true(tab && rep);
        for (int r = 0; r < VR; r++) {
            fill(row, D, 3.0);
            op_quantize_row(plain, row, D, tab + r * rb, NULL);
        }
        op_tensor pt = op_tensor_2d(plain, tab, D, VR), tt = pt;
        assert_int_equal(op_repack_weight(&pt, type, rep), FU_OK);
        tt.type = type;
        tt.data = rep;
        const int32_t rids[T] = {0, 47, 15, 16, 31, 32, 5};
        check_get_rows(&tt, &pt, rids, T);
        free(tab);
        free(rep);
    }
}

/* ---- element-wise and row ops ---------------------------------------------------- */

static void test_rmsnorm(void **state) {
    (void)state;
    static const int64_t shapes[][2] = {{3, 37}, {5, 2048}, {40, 1000}}; /* (R, D); last one is threaded */
    for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++) {
        int64_t r = shapes[s][0], d = shapes[s][1];
        float *x = malloc((size_t)(r * d) * 4), *y = malloc((size_t)(r * d) * 4), *w = malloc((size_t)d * 4);
        fill(x, r * d, 4.0);
        fill(w, d, 2.0);
        for (int b = 0; b < n_bes; b++)
            for (int use_w = 0; use_w < 2; use_w++)
                for (int alias = 0; alias < 2; alias++) {
                    float *xc = malloc((size_t)(r * d) * 4);
                    memcpy(xc, x, (size_t)(r * d) * 4);
                    float *out = alias ? xc : y;
                    op_tensor xt = op_tensor_2d(OP_TYPE_F32, xc, d, r), yt = op_tensor_2d(OP_TYPE_F32, out, d, r);
                    op_tensor wt = op_tensor_1d(OP_TYPE_F32, w, d);
                    assert_int_equal(op_rmsnorm(bes[b].be, &xt, use_w ? &wt : NULL, 1e-5f, &yt), FU_OK);
                    for (int64_t i = 0; i < r; i++) {
                        double ss = 0;
                        for (int64_t j = 0; j < d; j++) ss += (double)x[i * d + j] * x[i * d + j];
                        double inv = 1.0 / sqrt(ss / d + 1e-5);
                        for (int64_t j = 0; j < d; j++) {
                            double want = x[i * d + j] * inv * (use_w ? w[j] : 1.0);
                            check_close("rmsnorm", bes[b].label, i * d + j, out[i * d + j], want,
                                        2e-6 * fabs(want) + 1e-7);
                        }
                    }
                    free(xc);
                }
        float bad[3];
        op_tensor xt = op_tensor_2d(OP_TYPE_F32, x, d, r), wt = op_tensor_1d(OP_TYPE_F32, bad, 3);
        assert_int_equal(op_rmsnorm(bes[0].be, &xt, &wt, 1e-5f, &xt), FU_ERR_INVALID);
        free(x);
        free(y);
        free(w);
    }
}

static void test_softmax_and_log_softmax(void **state) {
    (void)state;
    static const int64_t shapes[][2] = {{4, 33}, {1, 5}, {3, 20000}};
    for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++) {
        int64_t r = shapes[s][0], d = shapes[s][1];
        float *x = malloc((size_t)(r * d) * 4), *y = malloc((size_t)(r * d) * 4);
        fill(x, r * d, 30.0); /* large logits: needs the max shift */
        for (int b = 0; b < n_bes; b++)
            for (int lg = 0; lg < 2; lg++) {
                memcpy(y, x, (size_t)(r * d) * 4);
                op_tensor yt = op_tensor_2d(OP_TYPE_F32, y, d, r);
                assert_int_equal(lg ? op_log_softmax(bes[b].be, &yt) : op_softmax(bes[b].be, &yt), FU_OK);
                for (int64_t i = 0; i < r; i++) {
                    double mx = -INFINITY, sum = 0;
                    for (int64_t j = 0; j < d; j++) mx = fmax(mx, x[i * d + j]);
                    for (int64_t j = 0; j < d; j++) sum += exp((double)x[i * d + j] - mx);
                    for (int64_t j = 0; j < d; j++) {
                        double want = lg ? x[i * d + j] - mx - log(sum) : exp((double)x[i * d + j] - mx) / sum;
                        check_close(lg ? "log_softmax" : "softmax", bes[b].label, i * d + j, y[i * d + j], want,
                                    lg ? 1e-5 * (1 + fabs(want)) : 1e-5 * want + 1e-9);
                    }
                }
            }
        free(x);
        free(y);
    }
}

/* add_rows: x's selected rows gain scale * y's rows, the others are untouched;
 * rows out of range are refused with nothing written. */
static void test_add_rows(void **state) {
    (void)state;
    const int64_t r = 5, d = 37;
    float x[5 * 37], x0[5 * 37], y[2 * 37];
    fill(x0, r * d, 3.0);
    fill(y, 2 * d, 2.0);
    const int32_t rows[2] = {3, 1}, bad[2] = {0, 5};
    for (int b = 0; b < n_bes; b++) {
        memcpy(x, x0, sizeof x);
        op_tensor xt = op_tensor_2d(OP_TYPE_F32, x, d, r), yt = op_tensor_2d(OP_TYPE_F32, y, d, 2);
        assert_int_equal(op_add_rows(bes[b].be, &xt, rows, &yt, 0.5f), FU_OK);
        for (int64_t i = 0; i < r; i++)
            for (int64_t k = 0; k < d; k++) {
                double want = x0[i * d + k] + (i == 3 ? 0.5 * y[k] : i == 1 ? 0.5 * y[d + k] : 0.0);
                check_close("add_rows", bes[b].label, i * d + k, x[i * d + k], want, 1e-6 * (fabs(want) + 1));
            }
        memcpy(x, x0, sizeof x);
        assert_int_equal(op_add_rows(bes[b].be, &xt, bad, &yt, 1.0f), FU_ERR_RANGE);
        assert_memory_equal(x, x0, sizeof x);
        op_tensor y0 = op_tensor_2d(OP_TYPE_F32, y, d, 0);
        assert_int_equal(op_add_rows(bes[b].be, &xt, NULL, &y0, 1.0f), FU_OK);
    }
}

static void test_swiglu_add_add_row(void **state) {
    (void)state;
    static const int64_t shapes[][2] = {{3, 45}, {6, 8192}};
    for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++) {
        int64_t r = shapes[s][0], d = shapes[s][1], n = r * d;
        float *g = malloc((size_t)n * 4), *u = malloc((size_t)n * 4), *o = malloc((size_t)n * 4);
        float *bias = malloc((size_t)d * 4);
        fill(g, n, 6.0);
        fill(u, n, 2.0);
        fill(bias, d, 1.0);
        for (int b = 0; b < n_bes; b++) {
            op_tensor gt = op_tensor_2d(OP_TYPE_F32, g, d, r), ut = op_tensor_2d(OP_TYPE_F32, u, d, r);
            op_tensor ot = op_tensor_2d(OP_TYPE_F32, o, d, r), bt = op_tensor_1d(OP_TYPE_F32, bias, d);
            assert_int_equal(op_swiglu(bes[b].be, &gt, &ut, &ot), FU_OK);
            for (int64_t i = 0; i < n; i++) {
                double want = g[i] / (1.0 + exp(-(double)g[i])) * u[i];
                check_close("swiglu", bes[b].label, i, o[i], want, 2e-6 * fabs(want) + 1e-7);
            }
            memcpy(o, g, (size_t)n * 4);
            assert_int_equal(op_add(bes[b].be, &ot, &ut), FU_OK);
            for (int64_t i = 0; i < n; i++) check_close("add", bes[b].label, i, o[i], (double)g[i] + u[i], 1e-6 * (fabs(g[i]) + fabs(u[i])));
            memcpy(o, g, (size_t)n * 4);
            assert_int_equal(op_add_row(bes[b].be, &ot, &bt), FU_OK);
            for (int64_t i = 0; i < n; i++)
                check_close("add_row", bes[b].label, i, o[i], (double)g[i] + bias[i % d], 1e-6 * (fabs(g[i]) + 1));
            /* out aliases gate */
            memcpy(o, g, (size_t)n * 4);
            assert_int_equal(op_swiglu(bes[b].be, &ot, &ut, &ot), FU_OK);
            for (int64_t i = 0; i < n; i++) {
                double want = g[i] / (1.0 + exp(-(double)g[i])) * u[i];
                check_close("swiglu alias", bes[b].label, i, o[i], want, 2e-6 * fabs(want) + 1e-7);
            }
        }
        op_tensor short_t = op_tensor_2d(OP_TYPE_F32, u, d, r - 1), gt = op_tensor_2d(OP_TYPE_F32, g, d, r);
        assert_int_equal(op_add(bes[0].be, &gt, &short_t), FU_ERR_INVALID);
        free(g);
        free(u);
        free(o);
        free(bias);
    }
}

/* ---- rope ---------------------------------------------------------------------- */

static void test_rope(void **state) {
    (void)state;
    enum { T = 5, H = 3, HD = 64 };
    int32_t pos[T] = {0, 1, 7, 300, 4095};
    static const int rots[] = {64, 32, 16};
    for (int mode = 0; mode < 2; mode++)
        for (size_t ri = 0; ri < sizeof rots / sizeof rots[0]; ri++) {
            int rot = rots[ri];
            float inv[HD / 2], x[T * H * HD], y[T * H * HD];
            for (int i = 0; i < rot / 2; i++) inv[i] = (float)pow(500000.0, -2.0 * i / rot);
            fill(x, T * H * HD, 2.0);
            op_rope_params p = {(op_rope_mode)mode, rot, inv, ri == 1 ? 1.25f : 1.0f};
            for (int b = 0; b < n_bes; b++) {
                memcpy(y, x, sizeof x);
                op_tensor yt = op_tensor_3d(OP_TYPE_F32, y, HD, H, T);
                assert_int_equal(op_rope(bes[b].be, &yt, pos, &p), FU_OK);
                for (int t = 0; t < T; t++)
                    for (int h = 0; h < H; h++) {
                        const float *xi = x + (t * H + h) * HD;
                        const float *yi = y + (t * H + h) * HD;
                        double want[HD];
                        for (int d = 0; d < HD; d++) want[d] = xi[d]; /* dims >= rot untouched */
                        for (int i = 0; i < rot / 2; i++) {
                            float theta = (float)pos[t] * inv[i]; /* the angle in f32, as torch does */
                            double c = cos((double)theta) * p.attn_factor, s = sin((double)theta) * p.attn_factor;
                            int i0 = mode == OP_ROPE_NEOX ? i : 2 * i, i1 = mode == OP_ROPE_NEOX ? i + rot / 2 : 2 * i + 1;
                            want[i0] = xi[i0] * c - xi[i1] * s;
                            want[i1] = xi[i0] * s + xi[i1] * c;
                        }
                        for (int d = 0; d < HD; d++)
                            check_close(mode ? "rope norm" : "rope neox", bes[b].label, (t * H + h) * HD + d, yi[d],
                                        want[d], 2e-6 * 4);
                    }
            }
        }
    float x[8];
    op_tensor xt = op_tensor_3d(OP_TYPE_F32, x, 8, 1, 1);
    float inv[8] = {1};
    int32_t pos1[1] = {0};
    op_rope_params bad = {OP_ROPE_NEOX, 10, inv, 1.0f};
    assert_int_equal(op_rope(bes[0].be, &xt, pos1, &bad), FU_ERR_INVALID);
    bad.rot_dim = 3;
    assert_int_equal(op_rope(bes[0].be, &xt, pos1, &bad), FU_ERR_INVALID);
}

/* ---- kv_store + attention ---------------------------------------------------------- */

static double cache_val(const op_tensor *c, int64_t p, int g, int d) {
    const uint8_t *row = (const uint8_t *)c->data + p * c->nb[2] + g * c->nb[1];
    if (c->type == OP_TYPE_F16) {
        uint16_t h;
        memcpy(&h, row + 2 * d, 2);
        return op_f16_to_f32(h);
    }
    float f;
    memcpy(&f, row + 4 * d, 4);
    return f;
}

/* Fills caches through op_kv_store (checked bit-exactly), then checks
 * op_attention on a batch mixing sequences and positions. head_major: the
 * caches are op_tensor_kv_cache views (head by head) instead of
 * position-major (max_len, KVH, hd) tensors. */
static void attention_case(op_type ctype, int hd, int nh, int nkv, bool head_major) {
    enum { NS = 3, MAXLEN = 200 };
    const int lens[NS] = {150, 1, 67}; /* positions filled per sequence */
    const int c = nkv * hd;
    op_tensor kc[NS], vc[NS];
    size_t esz = op_type_block_bytes(ctype);
    for (int s = 0; s < NS; s++) {
        void *kd = calloc((size_t)MAXLEN * c, esz), *vd = calloc((size_t)MAXLEN * c, esz);
        kc[s] = head_major ? op_tensor_kv_cache(ctype, kd, hd, nkv, MAXLEN) : op_tensor_3d(ctype, kd, hd, nkv, MAXLEN);
        vc[s] = head_major ? op_tensor_kv_cache(ctype, vd, hd, nkv, MAXLEN) : op_tensor_3d(ctype, vd, hd, nkv, MAXLEN);
        assert_true(kc[s].data && vc[s].data);
    }
    /* store every position of every sequence in one batch, converting */
    int total = 0;
    for (int s = 0; s < NS; s++) total += lens[s];
    float *kr = malloc((size_t)total * c * 4), *vr = malloc((size_t)total * c * 4);
    int32_t *sq = malloc((size_t)total * 4), *ps = malloc((size_t)total * 4);
    fill(kr, (int64_t)total * c, 1.0);
    fill(vr, (int64_t)total * c, 1.0);
    for (int s = 0, i = 0; s < NS; s++)
        for (int p = 0; p < lens[s]; p++, i++) {
            sq[i] = s;
            ps[i] = p;
        }
    op_tensor *kp[NS], *vp[NS];
    for (int s = 0; s < NS; s++) {
        kp[s] = &kc[s];
        vp[s] = &vc[s];
    }
    op_tensor kt = op_tensor_2d(OP_TYPE_F32, kr, c, total), vt = op_tensor_2d(OP_TYPE_F32, vr, c, total);
    op_backend *be0 = bes[n_bes - 1].be;
    assert_int_equal(op_kv_store(be0, &kt, kp, NS, sq, ps), FU_OK);
    assert_int_equal(op_kv_store(be0, &vt, vp, NS, sq, ps), FU_OK);
    for (int i = 0; i < total; i++)
        for (int j = 0; j < c; j++) {
            const float want = ctype == OP_TYPE_F16 ? op_f16_to_f32(op_f32_to_f16(kr[(size_t)i * c + j]))
                                                    : kr[(size_t)i * c + j];
            const double got = cache_val(&kc[sq[i]], ps[i], j / hd, j % hd);
            if (memcmp(&(float){(float)got}, &want, 4) != 0) fail_msg("kv_store mismatch at %d/%d", i, j);
        }
    int32_t badpos[1] = {MAXLEN};
    op_tensor k1 = op_tensor_2d(OP_TYPE_F32, kr, c, 1);
    assert_int_equal(op_kv_store(be0, &k1, kp, NS, sq, badpos), FU_ERR_RANGE);

    /* a batch: decode tokens at the ends and prefill-like positions inside */
    enum { T = 6 };
    int32_t tseq[T] = {0, 1, 2, 0, 2, 0}, tpos[T] = {149, 0, 66, 63, 0, 64};
    float *q = malloc((size_t)T * nh * hd * 4), *out = malloc((size_t)T * nh * hd * 4);
    fill(q, (int64_t)T * nh * hd, 3.0);
    op_attn a = {nh, nkv, hd, 1.0f / sqrtf((float)hd), NS, tseq, tpos, kc, vc};
    op_tensor qt = op_tensor_3d(OP_TYPE_F32, q, hd, nh, T), ot = op_tensor_3d(OP_TYPE_F32, out, hd, nh, T);
    double *sc = malloc(MAXLEN * sizeof(double));
    for (int b = 0; b < n_bes; b++) {
        char what[64];
        snprintf(what, sizeof what, "attention %s hd=%d H=%d KVH=%d%s", op_type_name(ctype), hd, nh, nkv,
                 head_major ? " head-major" : "");
        for (int i = 0; i < T * nh * hd; i++) out[i] = NAN;
        int rc = op_attention(bes[b].be, &qt, &a, &ot);
        if (rc) fail_msg("%s [%s]: %s", what, bes[b].label, fu_last_error());
        for (int t = 0; t < T; t++)
            for (int h = 0; h < nh; h++) {
                int g = h / (nh / nkv), n = tpos[t] + 1;
                const float *qi = q + (t * nh + h) * hd;
                double mx = -INFINITY, sum = 0, vmax = 0;
                for (int p = 0; p < n; p++) {
                    double s = 0;
                    for (int d = 0; d < hd; d++) s += qi[d] * cache_val(&kc[tseq[t]], p, g, d);
                    sc[p] = s * a.scale;
                    mx = fmax(mx, sc[p]);
                }
                for (int p = 0; p < n; p++) sum += (sc[p] = exp(sc[p] - mx));
                for (int d = 0; d < hd; d++) {
                    double o = 0;
                    for (int p = 0; p < n; p++) {
                        double v = cache_val(&vc[tseq[t]], p, g, d);
                        o += sc[p] / sum * v;
                        vmax = fmax(vmax, fabs(v));
                    }
                    check_close(what, bes[b].label, (t * nh + h) * hd + d, out[(t * nh + h) * hd + d], o,
                                2e-5 * vmax + 1e-6);
                }
            }
        /* a token alone (its heads split over more tasks, fewer heads each)
         * gets the same bits as in the batch */
        for (int t = 0; t < T; t++) {
            float *one = malloc((size_t)nh * hd * 4);
            assert_non_null(one);
            op_attn a1 = a;
            a1.seq = &tseq[t];
            a1.pos = &tpos[t];
            op_tensor q1 = op_tensor_3d(OP_TYPE_F32, q + (size_t)t * nh * hd, hd, nh, 1);
            op_tensor o1 = op_tensor_3d(OP_TYPE_F32, one, hd, nh, 1);
            assert_int_equal(op_attention(bes[b].be, &q1, &a1, &o1), FU_OK);
            if (memcmp(one, out + (size_t)t * nh * hd, (size_t)nh * hd * 4) != 0)
                fail_msg("%s [%s]: token %d alone differs from the batch", what, bes[b].label, t);
            free(one);
        }
    }
    /* errors: position beyond the cache, sequence out of range */
    int32_t p2[T] = {MAXLEN, 0, 0, 0, 0, 0}, s2[T] = {NS, 0, 0, 0, 0, 0};
    op_attn bad = a;
    bad.pos = p2;
    assert_int_equal(op_attention(bes[0].be, &qt, &bad, &ot), FU_ERR_RANGE);
    bad = a;
    bad.seq = s2;
    assert_int_equal(op_attention(bes[0].be, &qt, &bad, &ot), FU_ERR_RANGE);
    free(sc);
    free(q);
    free(out);
    free(kr);
    free(vr);
    free(sq);
    free(ps);
    for (int s = 0; s < NS; s++) {
        free(kc[s].data);
        free(vc[s].data);
    }
}

static void test_attention(void **state) {
    (void)state;
    static const op_type ctypes[] = {OP_TYPE_F32, OP_TYPE_F16};
    for (int ci = 0; ci < 2; ci++) {
        for (int hm = 0; hm < 2; hm++) { /* position-major caches, then head-major (the engine's) */
            attention_case(ctypes[ci], 64, 4, 4, hm);   /* MHA */
            attention_case(ctypes[ci], 64, 4, 2, hm);   /* GQA 2 */
            attention_case(ctypes[ci], 40, 8, 2, hm);   /* GQA 4, head_dim not a multiple of 16 */
            attention_case(ctypes[ci], 64, 9, 3, hm);   /* GQA 3 (SmolLM2) */
            attention_case(ctypes[ci], 72, 12, 2, hm);  /* GQA 6: tasks of 4 and 2 heads */
            attention_case(ctypes[ci], 16, 8, 1, hm);   /* MQA 8 */
            if (!sanitized()) attention_case(ctypes[ci], 128, 8, 2, hm);
        }
    }
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_backend_basics),
        cmocka_unit_test(test_matmul_decode),
        cmocka_unit_test(test_matmul_interleaved),
        cmocka_unit_test(test_matmul_interleaved_batch_invariant),
        cmocka_unit_test(test_backend_shared_by_threads),
        cmocka_unit_test(test_matmul_int8_x_opt_in),
        cmocka_unit_test(test_matmul_batch_invariance),
        cmocka_unit_test(test_matmul_batched_decode),
        cmocka_unit_test(test_matmul_prefill),
        cmocka_unit_test(test_matmul_plain_odd_k),
        cmocka_unit_test(test_matmul_errors),
        cmocka_unit_test(test_matmul_n),
        cmocka_unit_test(test_pool_many_small_ops),
        cmocka_unit_test(test_get_rows),
        cmocka_unit_test(test_rmsnorm),
        cmocka_unit_test(test_softmax_and_log_softmax),
        cmocka_unit_test(test_swiglu_add_add_row),
        cmocka_unit_test(test_add_rows),
        cmocka_unit_test(test_rope),
        cmocka_unit_test(test_attention),
    };
    return cmocka_run_group_tests(tests, setup_backends, teardown_backends);
}
