/* test_parse.c -- strict parsing of numbers, ranges and token-id lists; opening a backend by device name. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ops.h"
#include "parse.h"
#include "status.h"

static void test_long(void **state) {
    long v;
    assert_int_equal(fu_parse_long("42", 0, 100, &v), FU_OK);
    assert_int_equal(v, 42);
    assert_int_equal(fu_parse_long("-3", -5, 5, &v), FU_OK);
    assert_int_equal(v, -3);
    const char *bad[] = {"", "4x", "x", "101", "-1", "99999999999999999999999", " "};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++)
        assert_int_equal(fu_parse_long(bad[i], 0, 100, &v), FU_ERR_INVALID);
}

static void test_float(void **state) {
    float f;
    assert_int_equal(fu_parse_float("0.5", &f), FU_OK);
    assert_true(f == 0.5f);
    assert_int_equal(fu_parse_float("0.5x", &f), FU_ERR_INVALID);
    assert_int_equal(fu_parse_float("", &f), FU_ERR_INVALID);
    assert_int_equal(fu_parse_float("1e999", &f), FU_ERR_INVALID);
}

static void test_double_and_range(void **state) {
    double d;
    assert_int_equal(fu_parse_double("0.02", &d), FU_OK);
    assert_true(d == 0.02);
    assert_int_equal(fu_parse_double("1e300", &d), FU_OK);
    const char *bad[] = {"", "1e999", "0.5x", "x", " "};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++)
        assert_int_equal(fu_parse_double(bad[i], &d), FU_ERR_INVALID);
    float f;
    assert_int_equal(fu_parse_float("1e39", &f), FU_ERR_INVALID); /* a double, not a float */
    long a, b;
    assert_int_equal(fu_parse_range("0:15", 0, 100, &a, &b), FU_OK);
    assert_int_equal(a, 0);
    assert_int_equal(b, 15);
    assert_int_equal(fu_parse_range("7:7", 0, 100, &a, &b), FU_OK);
    const char *bad_ranges[] = {"",      ":",     "1:",  ":2", "3:2", "-1:2",
                                "1:101", "1:2:3", "1-2", "123456789012345678901234567890123:1"};
    for (size_t i = 0; i < sizeof bad_ranges / sizeof bad_ranges[0]; i++) {
        assert_int_equal(fu_parse_range(bad_ranges[i], 0, 100, &a, &b), FU_ERR_INVALID);
        assert_non_null(strstr(fu_last_error(), "expected A:B with 0 <= A <= B <= 100"));
    }
}

static void test_ids(void **state) {
    int32_t *ids;
    size_t n;
    assert_int_equal(fu_parse_ids("1,20,300", &ids, &n), FU_OK);
    assert_int_equal(n, 3);
    assert_int_equal(ids[2], 300);
    free(ids);
    /* more than the initial capacity */
    char buf[200] = "0";
    for (int i = 1; i < 40; i++) snprintf(buf + strlen(buf), sizeof buf - strlen(buf), ",%d", i);
    assert_int_equal(fu_parse_ids(buf, &ids, &n), FU_OK);
    assert_int_equal(n, 40);
    assert_int_equal(ids[39], 39);
    free(ids);
    const char *bad[] = {"", "1,,2", "1,x", "-1", "1;2", "2147483648", ","};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++)
        assert_int_equal(fu_parse_ids(bad[i], &ids, &n), FU_ERR_INVALID);
}

static void test_backend_open(void **state) {
    (void)state;
    op_backend *be = NULL;
    char desc[300];
    assert_int_equal(op_backend_open("cpu", 2, OP_CPU_ISA_PORTABLE, &be, desc, sizeof desc), FU_OK);
    assert_string_equal(op_backend_name(be), "cpu");
    assert_string_equal(desc, "cpu (portable, 2 threads)");
    op_backend_free(be);
    static const char *bad[] = {"gpu", "", "cuda:", "cuda:x", "cuda:-1", "cuda0", "cudax", "CPU", "cuda:1:2"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        be = (op_backend *)1;
        assert_int_equal(op_backend_open(bad[i], 0, OP_CPU_ISA_AUTO, &be, desc, sizeof desc), FU_ERR_INVALID);
        assert_null(be);
        assert_non_null(strstr(fu_last_error(), "unknown device"));
    }
    /* a GPU where there is one; else a clear refusal */
    int rc = op_backend_open("cuda:0", 0, OP_CPU_ISA_AUTO, &be, desc, sizeof desc);
    if (rc == FU_OK) {
        assert_string_equal(op_backend_name(be), "cuda");
        assert_memory_equal(desc, "cuda:0 (", 8);
        op_backend_free(be);
    } else {
        assert_int_equal(rc, FU_ERR_UNSUPPORTED);
        assert_null(be);
        assert_true(fu_last_error()[0] != '\0');
    }
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_long),
        cmocka_unit_test(test_float),
        cmocka_unit_test(test_double_and_range),
        cmocka_unit_test(test_ids),
        cmocka_unit_test(test_backend_open),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
