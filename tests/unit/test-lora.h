/* test-lora.h -- what the LoRA tests share: random adapters with a non-zero update, and a
 * comparison of float arrays relative to the reference's scale. Include after cmocka.h. */
#ifndef FU_TEST_LORA_H
#define FU_TEST_LORA_H

#include <math.h>
#include <stdio.h>

#include "lora.h"
#include "status.h"

/* A random adapter of rank r over `targets` for c's blocks [first, last), alpha 2r, B drawn from
 * uniform(-0.5, 0.5); the same seed gives the same numbers whatever the span. The caller frees it. */
static inline lora_adapter *test_random_adapter(const mdl_config *c, int first, int last, uint32_t targets, int r,
                                                uint64_t seed) {
    lora_config lc = lora_config_default();
    lc.r = r;
    lc.alpha = 2.0f * (float)r;
    lc.targets = targets;
    lora_adapter *ad;
    assert_int_equal(lora_new(&lc, c, first, last, seed, &ad), FU_OK);
    lora_randomize_b(ad, seed + 1, 0.5f);
    return ad;
}

/* Checks |got - want| <= tol * max|want| over n values; fails naming `what` otherwise. */
static inline void test_assert_close(const char *what, const float *got, const float *want, size_t n, double tol) {
    double scale = 0, worst = 0;
    for (size_t i = 0; i < n; i++) scale = fmax(scale, fabs(want[i]));
    for (size_t i = 0; i < n; i++) worst = fmax(worst, fabs((double)got[i] - want[i]));
    if (worst > tol * scale) {
        fprintf(stderr, "%s: max |diff| %g > %g * max |ref| %g\n", what, worst, tol, scale);
        fail();
    }
}

#endif
