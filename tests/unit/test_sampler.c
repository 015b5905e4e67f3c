/* test_sampler.c -- sampling: greedy, seeds, truncations, penalties, bias, logprobs, bad parameters. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <math.h>
#include <string.h>

#include "sampler.h"
#include "status.h"

#define V 8
static const float base[V] = {1.0f, 3.0f, 2.5f, -1.0f, 0.0f, 2.9f, -5.0f, 0.5f};

static int32_t sample_once(smp_sampler *s) {
    float l[V];
    memcpy(l, base, sizeof l);
    return smp_sample(s, l);
}

static void test_greedy_and_argmax(void **state) {
    smp_params p = smp_params_default();
    p.temperature = 0;
    smp_sampler *s;
    assert_int_equal(smp_new(&p, V, &s), FU_OK);
    for (int i = 0; i < 10; i++) assert_int_equal(sample_once(s), 1);
    smp_free(s);
    float ties[3] = {2, 2, 1};
    assert_int_equal(smp_argmax(ties, 3), 0);
}

static void test_seed_determinism_and_distribution(void **state) {
    smp_params p = smp_params_default();
    p.seed = 1234;
    smp_sampler *a, *b;
    assert_int_equal(smp_new(&p, V, &a), FU_OK);
    assert_int_equal(smp_new(&p, V, &b), FU_OK);
    int counts[V] = {0};
    const int N = 20000;
    for (int i = 0; i < N; i++) {
        int32_t x = sample_once(a), y = sample_once(b);
        assert_int_equal(x, y);
        counts[x]++;
    }
    /* frequencies follow softmax(base) within 4 standard deviations */
    double z = 0;
    for (int i = 0; i < V; i++) z += exp(base[i]);
    for (int i = 0; i < V; i++) {
        double pi = exp(base[i]) / z, sd = sqrt(N * pi * (1 - pi));
        assert_true(fabs(counts[i] - N * pi) <= 4 * sd + 1);
    }
    /* a different seed gives a different sequence */
    smp_params q = p;
    q.seed = 99;
    assert_int_equal(smp_reset(b, &q), FU_OK);
    assert_int_equal(smp_reset(a, &p), FU_OK);
    int same = 0;
    for (int i = 0; i < 64; i++) same += sample_once(a) == sample_once(b);
    assert_true(same < 64);
    smp_free(a);
    smp_free(b);
}

static void test_truncations(void **state) {
    smp_params p = smp_params_default();
    p.top_k = 2;
    p.seed = 5;
    smp_sampler *s;
    assert_int_equal(smp_new(&p, V, &s), FU_OK);
    for (int i = 0; i < 500; i++) {
        int32_t t = sample_once(s);
        assert_true(t == 1 || t == 5);
    }
    /* top_p small: only the most likely token */
    p.top_k = 0;
    p.top_p = 0.05f;
    assert_int_equal(smp_reset(s, &p), FU_OK);
    for (int i = 0; i < 200; i++) assert_int_equal(sample_once(s), 1);
    /* min_p 0.5: tokens with p >= 0.5 * p(best): 1 (3.0), 5 (2.9), 2 (2.5: e^-0.5 = 0.61) */
    p.top_p = 1;
    p.min_p = 0.5f;
    assert_int_equal(smp_reset(s, &p), FU_OK);
    for (int i = 0; i < 500; i++) {
        int32_t t = sample_once(s);
        assert_true(t == 1 || t == 5 || t == 2);
    }
    smp_free(s);
}

static void test_penalties_and_bias(void **state) {
    smp_params p = smp_params_default();
    p.temperature = 0;
    p.presence_penalty = 2.0f;
    smp_sampler *s;
    assert_int_equal(smp_new(&p, V, &s), FU_OK);
    smp_accept(s, 1); /* 3.0 - 2 = 1.0: now 5 (2.9) wins */
    assert_int_equal(sample_once(s), 5);
    smp_free(s);

    smp_bias bias[2] = {{1, -100}, {6, 10}};
    p = smp_params_default();
    p.temperature = 0;
    p.bias = bias;
    p.n_bias = 1;
    assert_int_equal(smp_new(&p, V, &s), FU_OK);
    assert_int_equal(sample_once(s), 5); /* 1 banned */
    p.n_bias = 2;
    assert_int_equal(smp_reset(s, &p), FU_OK);
    assert_int_equal(sample_once(s), 6); /* -5 + 10 */
    smp_free(s);
}

static void test_top_logprobs(void **state) {
    int32_t ids[3];
    float lp[3];
    float lt = smp_top_logprobs(base, V, 2, 3, ids, lp);
    assert_int_equal(ids[0], 1);
    assert_int_equal(ids[1], 5);
    assert_int_equal(ids[2], 2);
    double z = 0;
    for (int i = 0; i < V; i++) z += exp(base[i]);
    assert_true(fabs(lp[0] - (3.0 - log(z))) < 1e-5);
    assert_true(fabs(lt - (2.5 - log(z))) < 1e-5);
    assert_true(lp[0] >= lp[1] && lp[1] >= lp[2]);
}

static void test_bad_parameters(void **state) {
    smp_sampler *s;
    smp_params p = smp_params_default();
    p.temperature = -0.1f;
    assert_int_equal(smp_new(&p, V, &s), FU_ERR_INVALID);
    p = smp_params_default();
    p.top_p = 0;
    assert_int_equal(smp_new(&p, V, &s), FU_ERR_INVALID);
    p = smp_params_default();
    p.top_p = NAN;
    assert_int_equal(smp_new(&p, V, &s), FU_ERR_INVALID);
    p = smp_params_default();
    p.frequency_penalty = 3;
    assert_int_equal(smp_new(&p, V, &s), FU_ERR_INVALID);
    smp_bias bad = {V, 1};
    p = smp_params_default();
    p.bias = &bad;
    p.n_bias = 1;
    assert_int_equal(smp_new(&p, V, &s), FU_ERR_INVALID);
    assert_non_null(strstr(fu_last_error(), "logit_bias"));
    static smp_bias many[SMP_MAX_LOGIT_BIAS + 1]; /* token 0, bias 0 */
    p = smp_params_default();
    p.bias = many;
    p.n_bias = SMP_MAX_LOGIT_BIAS;
    assert_int_equal(smp_new(&p, V, &s), FU_OK);
    p.n_bias = SMP_MAX_LOGIT_BIAS + 1;
    assert_int_equal(smp_reset(s, &p), FU_ERR_INVALID);
    assert_non_null(strstr(fu_last_error(), "at most"));
    smp_free(s);
    assert_int_equal(smp_new(&p, V, &s), FU_ERR_INVALID);
    p = smp_params_default();
    assert_int_equal(smp_new(&p, 0, &s), FU_ERR_INVALID);
}

/* The allowed-token mask: greedy and seeded sampling pick only allowed tokens; a mask of the
 * wrong size or with nothing allowed is refused. */
static void test_allowed_mask(void **state) {
    (void)state;
    uint8_t mask[1] = {(1u << 3) | (1u << 6)}; /* tokens 3 and 6, the two least likely */
    smp_params p = smp_params_default();
    p.allowed = mask;
    p.n_allowed = 1;
    p.temperature = 0;
    smp_sampler *s;
    assert_int_equal(smp_new(&p, V, &s), FU_OK);
    assert_int_equal(sample_once(s), 3);
    p.temperature = 1.5f;
    for (uint64_t seed = 0; seed < 50; seed++) {
        p.seed = seed;
        assert_int_equal(smp_reset(s, &p), FU_OK);
        int32_t t = sample_once(s);
        assert_true(t == 3 || t == 6);
    }
    p.n_allowed = 2;
    assert_int_equal(smp_reset(s, &p), FU_ERR_INVALID);
    assert_non_null(strstr(fu_last_error(), "allowed_tokens"));
    mask[0] = 0;
    p.n_allowed = 1;
    assert_int_equal(smp_reset(s, &p), FU_ERR_INVALID);
    smp_free(s);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_greedy_and_argmax),
        cmocka_unit_test(test_seed_determinism_and_distribution),
        cmocka_unit_test(test_truncations),
        cmocka_unit_test(test_penalties_and_bias),
        cmocka_unit_test(test_top_logprobs),
        cmocka_unit_test(test_bad_parameters),
        cmocka_unit_test(test_allowed_mask),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
