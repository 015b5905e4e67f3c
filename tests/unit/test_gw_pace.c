/* test_gw_pace.c -- step deadlines from measured step times: the fallback until a path is
 * measured, a floor plus a multiple of each hop's p99, prefill scaling, the cap, eviction. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <stdio.h>
#include <string.h>

#include "gw-pace.h"

static const chain_hop HOPS[2] = {{"10.0.0.1:7000", 0, 15, NULL}, {"10.0.0.2:7000", 15, 30, NULL}};

/* Records a step of n positions whose hops took us0 and us1 (queue + compute). */
static void record(gw_pace *p, int n, int64_t us0, int64_t us1) {
    chain_timing t[2] = {{.queue_us = us0 / 2, .compute_us = us0 - us0 / 2}, {.compute_us = us1}};
    chain_result res = {.n_timing = 2, .timing = t};
    gw_pace_record(p, HOPS, 2, n, &res);
}

static void test_fallback_until_measured(void **state) {
    (void)state;
    gw_pace_options o = {.floor_ms = 1000, .multiple = 4, .fallback_ms = 30000};
    gw_pace *p = gw_pace_new(&o);
    assert_non_null(p);
    assert_int_equal(gw_pace_deadline_ms(p, HOPS, 2, 1), 30000);
    record(p, 1, 10000, 20000); /* decode samples only: prefill not measured yet */
    assert_int_equal(gw_pace_deadline_ms(p, HOPS, 2, 1), 30000);
    record(p, 11, 110000, 220000); /* 10 and 20 ms per position */
    /* 1000 + 4 x (10 + 20) ms */
    assert_int_equal(gw_pace_deadline_ms(p, HOPS, 2, 1), 1120);
    /* 101 positions: + 4 x 100 x (10 + 20) ms */
    assert_int_equal(gw_pace_deadline_ms(p, HOPS, 2, 101), 13120);
    /* capped at the fallback x (1 + n / GW_PACE_CHUNK) */
    assert_int_equal(gw_pace_deadline_ms(p, HOPS, 2, 1001), (int)(30000 * (1 + 1001.0 / GW_PACE_CHUNK)));
    /* a hop never seen: the fallback */
    chain_hop other[2] = {HOPS[0], {"10.0.0.3:7000", 15, 30, NULL}};
    assert_int_equal(gw_pace_deadline_ms(p, other, 2, 1), 30000);
    gw_pace_free(p);
}

static void test_p99_and_mismatched_timings(void **state) {
    (void)state;
    gw_pace *p = gw_pace_new(NULL); /* defaults: floor 2000, x4, fallback 60000 */
    record(p, 2, 0, 0);
    for (int i = 0; i < 98; i++) record(p, 1, 1000, 1000);
    record(p, 1, 100000, 1000); /* two slow steps in 100: the p99 */
    record(p, 1, 100000, 1000);
    /* 2000 + 4 x (100 + 1) ms */
    assert_int_equal(gw_pace_deadline_ms(p, HOPS, 2, 1), 2404);
    /* GW_PACE_SAMPLES later the slow step is forgotten */
    for (int i = 0; i < GW_PACE_SAMPLES; i++) record(p, 1, 1000, 1000);
    assert_int_equal(gw_pace_deadline_ms(p, HOPS, 2, 1), 2008);
    /* timings that do not match the hops are ignored */
    chain_timing t = {.compute_us = 1 << 30};
    chain_result res = {.n_timing = 1, .timing = &t};
    gw_pace_record(p, HOPS, 2, 1, &res);
    assert_int_equal(gw_pace_deadline_ms(p, HOPS, 2, 1), 2008);
    gw_pace_free(p);
}

static void test_table_is_bounded(void **state) {
    (void)state;
    gw_pace *p = gw_pace_new(NULL);
    chain_timing t = {.compute_us = 1000};
    chain_result res = {.n_timing = 1, .timing = &t};
    char addr[64];
    for (int i = 0; i < GW_PACE_SERVERS + 10; i++) {
        snprintf(addr, sizeof addr, "10.1.%d.%d:7000", i / 256, i % 256);
        chain_hop h = {addr, 0, 30, NULL};
        gw_pace_record(p, &h, 1, 1, &res);
        gw_pace_record(p, &h, 1, 3, &res);
        assert_int_equal(gw_pace_deadline_ms(p, &h, 1, 1), 2000 + 4);
    }
    chain_hop first = {"10.1.0.0:7000", 0, 30, NULL}; /* the least recently updated: replaced */
    assert_int_equal(gw_pace_deadline_ms(p, &first, 1, 1), 60000);
    gw_pace_free(p);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_fallback_until_measured),
        cmocka_unit_test(test_p99_and_mismatched_timings),
        cmocka_unit_test(test_table_is_bounded),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
