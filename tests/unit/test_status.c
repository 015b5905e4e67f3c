/* test_status.c -- status strings and per-thread error details. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <pthread.h>
#include <string.h>

#include "status.h"

static void test_strings(void **state) {
    (void)state;
    assert_string_equal(fu_status_str(FU_OK), "ok");
    assert_string_equal(fu_status_str(FU_ERR_FORMAT), "malformed input");
    assert_string_equal(fu_status_str(12345), "unknown status");
}

static void test_errorf_returns_status_and_message(void **state) {
    (void)state;
    fu_error_clear();
    assert_string_equal(fu_last_error(), "");
    int rc = fu_errorf(FU_ERR_RANGE, "tensor '%s' row %d", "w", 7);
    assert_int_equal(rc, FU_ERR_RANGE);
    assert_string_equal(fu_last_error(), "tensor 'w' row 7");
    /* wrapping the previous message */
    fu_errorf(FU_ERR_IO, "%s: %s", "model.gguf", fu_last_error());
    assert_string_equal(fu_last_error(), "model.gguf: tensor 'w' row 7");
}

static void *other_thread(void *arg) {
    (void)arg;
    fu_errorf(FU_ERR_IO, "other");
    return NULL;
}

static void test_errors_are_per_thread(void **state) {
    (void)state;
    fu_errorf(FU_ERR_IO, "mine");
    pthread_t t;
    assert_int_equal(pthread_create(&t, NULL, other_thread, NULL), 0);
    pthread_join(t, NULL);
    assert_string_equal(fu_last_error(), "mine");
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_strings),
        cmocka_unit_test(test_errorf_returns_status_and_message),
        cmocka_unit_test(test_errors_are_per_thread),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
