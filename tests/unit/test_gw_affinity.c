/* test_gw_affinity.c -- the gateway's prompt-prefix memory per server: chained block hashes, the
 * longest prefix a server got, and the bound on what each server remembers (LRU). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include "gw-affinity.h"
#include "status.h"

#define N (4 * GW_AFFINITY_BLOCK + 10)

static void test_longest_prefix_per_server(void **state) {
    (void)state;
    int32_t p[N], q[N];
    for (int i = 0; i < N; i++) p[i] = q[i] = i % 500;
    q[2 * GW_AFFINITY_BLOCK + 3] = 9999; /* q shares p's first two blocks */
    uint64_t hp[GW_AFFINITY_MAX_BLOCKS], hq[GW_AFFINITY_MAX_BLOCKS];
    assert_int_equal(gw_affinity_hashes(p, N, hp), 4);
    assert_int_equal(gw_affinity_hashes(q, N, hq), 4);
    assert_int_equal(gw_affinity_hashes(p, GW_AFFINITY_BLOCK - 1, hp + 8), 0);
    assert_true(hp[1] == hq[1] && hp[2] != hq[2]);
    gw_affinity *a;
    assert_int_equal(gw_affinity_new(16, &a), FU_OK);
    assert_int_equal(gw_affinity_cached(a, 3, hp, 4), 0); /* a server never seen */
    assert_int_equal(gw_affinity_note(a, 3, hp, 4), FU_OK);
    assert_int_equal(gw_affinity_cached(a, 3, hp, 4), 4 * GW_AFFINITY_BLOCK);
    assert_int_equal(gw_affinity_cached(a, 3, hq, 4), 2 * GW_AFFINITY_BLOCK);
    assert_int_equal(gw_affinity_cached(a, 0, hp, 4), 0);
    assert_int_equal(gw_affinity_cached(a, -1, hp, 4), 0);
    gw_affinity_free(a);
    gw_affinity_free(NULL);
}

static void test_bounded_lru(void **state) {
    (void)state;
    gw_affinity *a;
    assert_int_equal(gw_affinity_new(4, &a), FU_OK);
    uint64_t h[6] = {11, 12, 13, 14, 15, 16};
    assert_int_equal(gw_affinity_note(a, 0, h, 4), FU_OK); /* full: 11..14 */
    assert_int_equal(gw_affinity_cached(a, 0, h, 1), GW_AFFINITY_BLOCK); /* touches 11 */
    assert_int_equal(gw_affinity_note(a, 0, h + 4, 1), FU_OK); /* 15 replaces 12, the least recent */
    assert_int_equal(gw_affinity_cached(a, 0, h, 4), GW_AFFINITY_BLOCK);
    assert_int_equal(gw_affinity_cached(a, 0, h + 2, 3), 3 * GW_AFFINITY_BLOCK); /* 13, 14, 15 */
    gw_affinity_free(a);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_longest_prefix_per_server),
        cmocka_unit_test(test_bounded_lru),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
