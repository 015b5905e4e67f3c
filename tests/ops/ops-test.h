/* ops-test.h -- helpers the CPU op tests share: a seeded generator, the
 * sanitizer switch, a tolerance check and random weights of every type.
 *
 * Included once by each test program (after cmocka.h); every helper is
 * static. Single-threaded test code only (the generator is a global).
 */
#ifndef FU_OPS_TEST_H
#define FU_OPS_TEST_H

#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "ops.h"
#include "status.h"

static uint64_t rng_state = 0x243f6a8885a308d3ull;

static double rnd(void) { /* uniform in [-1, 1) */
    rng_state = rng_state * 6364136223846793005ull + 1442695040888963407ull;
    return (double)(rng_state >> 11) * (2.0 / 9007199254740992.0) - 1.0;
}

static void fill(float *x, int64_t n, double scale) {
    for (int64_t i = 0; i < n; i++) x[i] = (float)(scale * rnd());
}

/* True under the sanitizer build (FUSION_SANITIZED=1): big shapes are skipped. */
static bool sanitized(void) {
    const char *s = getenv("FUSION_SANITIZED");
    return s && *s && strcmp(s, "0") != 0;
}

/* Fails with a message naming the check, backend and index if |got - want| > tol. */
static void check_close(const char *what, const char *label, int64_t i, double got, double want, double tol) {
    if (!(fabs(got - want) <= tol)) {
        fail_msg("%s [%s] element %lld: got %.9g want %.9g (tol %.3g)", what, label, (long long)i, got, want, tol);
    }
}

/* W (N, K) of `type`: random rows quantized as its plain type, repacked when
 * it is interleaved; row scales for I8. The caller frees data and row_scale. */
static op_tensor random_weight(op_type type, int64_t n, int64_t k) {
    const op_type plain = op_type_plain(type);
    const size_t rb = op_row_bytes(plain, k);
    uint8_t *w = malloc(rb * (size_t)n);
    float *scales = malloc((size_t)n * sizeof(float)), *row = malloc((size_t)k * sizeof(float));
    assert_true(w && scales && row);
    for (int64_t r = 0; r < n; r++) {
        fill(row, k, 1.0);
        op_quantize_row(plain, row, k, w + (size_t)r * rb, &scales[r]);
    }
    free(row);
    op_tensor t = op_tensor_2d(plain, w, k, n);
    t.row_scale = plain == OP_TYPE_I8 ? scales : (free(scales), NULL);
    if (type != plain) {
        uint8_t *wr = malloc(rb * (size_t)n);
        assert_non_null(wr);
        assert_int_equal(op_repack_weight(&t, type, wr), FU_OK);
        free(w);
        t.type = type;
        t.data = wr;
    }
    return t;
}

#endif
