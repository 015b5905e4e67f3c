/* test_cuda_gpu.c -- every op of the CUDA backend on a real GPU against the CPU backend, the
 * training ops included (see cuda-compare.h and cuda-compare-train.h for shapes and
 * tolerances). Skips, test by test, when no GPU is usable (or CUDA was not built in):
 * op_backend_cuda_new(0) then returns NULL. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include "cuda-compare-train.h"

static int setup(void **state) {
    (void)state;
    op_cpu_options o = {.n_threads = 1, .isa = OP_CPU_ISA_PORTABLE};
    cmp_cpu = op_backend_cpu_new(&o);
    assert_non_null(cmp_cpu);
    cmp_dev = op_backend_cuda_new(0);
    if (!cmp_dev) print_message("no CUDA backend: %s -- skipping\n", fu_last_error());
    else assert_string_equal(op_backend_name(cmp_dev), "cuda");
    return 0;
}

static int teardown(void **state) {
    (void)state;
    op_backend_free(cmp_dev);
    op_backend_free(cmp_cpu);
    return 0;
}

int main(void) {
    const struct CMUnitTest tests[] = {CMP_TESTS, CMP_TRAIN_TESTS};
    return cmocka_run_group_tests(tests, setup, teardown);
}
