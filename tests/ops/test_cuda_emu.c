/* test_cuda_emu.c -- the CUDA backend's kernels and host code on the CPU emulator, against the CPU
 * backend (every op, every weight type, the training ops; see cuda-compare.h and
 * cuda-compare-train.h), plus the emulator's own semantics.
 *
 * op_backend_cuda_emu_new() runs the very .cu sources of kernels/cuda compiled
 * as C, with the same launch configurations, metadata uploads and cuBLAS
 * arguments (checked by a reference GEMM); under ASan the kernels' memory
 * accesses are checked too. The emulator tests launch small kernels written
 * here: shuffles and warp reductions against their definitions, block
 * barriers, and the errors for misuse (barriers in a kernel declared
 * barrier-free, impossible launch configurations). Without the CUDA toolchain
 * (FUSION_CUDA=OFF) the emulator is not built and every test skips.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include "cuda-compare-train.h"

#ifdef FUSION_HAVE_CUDA_EMU
#include "cuda-emu.h"
#include "emu/emu.h"

/* ---- emulator semantics ------------------------------------------------------------------ */

static cu_dim3 cu_dim(unsigned x, unsigned y, unsigned z) {
    cu_dim3 d = {x, y, z};
    return d;
}

typedef struct emu_test_args {
    float *out; /* (threads of the grid, 4) */
} emu_test_args;

static unsigned emu_test_gtid(const cu_ctx *c) { return c->block_idx.x * c->block_dim.x + c->thread_idx.x; }

/* out[g] = {shfl_xor(tid, 5), warp sum of lane, warp max of lane * 3, smem exchange} */
static void emu_test_sync_body(const cu_ctx *c, const void *args) {
    const emu_test_args *a = args;
    unsigned tid = c->thread_idx.x, g = emu_test_gtid(c);
    float v = (float)tid;
    a->out[g * 4 + 0] = cu_emu_shfl_xor(c, v, 5);
    float r[2] = {(float)(tid % 32), (float)(tid % 32) * 3.0f};
    cu_emu_warp_reduce(c, &r[0], 1, CU_EMU_REDUCE_SUM);
    cu_emu_warp_reduce(c, &r[1], 1, CU_EMU_REDUCE_MAX);
    a->out[g * 4 + 1] = r[0];
    a->out[g * 4 + 2] = r[1];
    float *sm = (float *)c->smem;
    sm[tid] = (float)(2 * tid + c->block_idx.x);
    cu_emu_syncthreads(c);
    a->out[g * 4 + 3] = sm[(tid + 1) % c->block_dim.x];
    cu_emu_syncthreads(c);
}

static void emu_test_plain_body(const cu_ctx *c, const void *args) {
    const emu_test_args *a = args;
    a->out[emu_test_gtid(c)] = (float)c->block_idx.x;
    if (c->thread_idx.x == 3) cu_emu_syncthreads(c); /* not allowed in a barrier-free kernel */
}

static void test_emu_semantics(void **state) {
    (void)state;
    const unsigned nb = 3, nt = 64;
    float *out = calloc((size_t)nb * nt * 4, sizeof(float));
    assert_non_null(out);
    emu_test_args a = {out};
    const cu_emu_kernel ks = {"emu_test_sync", emu_test_sync_body, 1};
    assert_int_equal(cu_emu_launch(&ks, cu_dim(nb, 1, 1), cu_dim(nt, 1, 1), nt * sizeof(float), &a, __FILE__, __LINE__),
                     FU_OK);
    for (unsigned b = 0; b < nb; b++)
        for (unsigned t = 0; t < nt; t++) {
            const float *o = out + (size_t)(b * nt + t) * 4;
            assert_true(o[0] == (float)(t ^ 5));
            assert_true(o[1] == 496.0f); /* 0 + 1 + ... + 31 */
            assert_true(o[2] == 93.0f);
            assert_true(o[3] == (float)(2 * ((t + 1) % nt) + b));
        }
    const cu_emu_kernel kp = {"emu_test_plain", emu_test_plain_body, 0};
    assert_int_equal(cu_emu_launch(&kp, cu_dim(2, 1, 1), cu_dim(8, 1, 1), 0, &a, __FILE__, __LINE__), FU_ERR_INTERNAL);
    assert_non_null(strstr(fu_last_error(), "barrier-free"));
    /* launch limits of real GPUs */
    assert_int_equal(cu_emu_launch(&ks, cu_dim(1, 1, 1), cu_dim(2048, 1, 1), 0, &a, __FILE__, __LINE__), FU_ERR_INVALID);
    assert_int_equal(cu_emu_launch(&ks, cu_dim(1, 70000, 1), cu_dim(32, 1, 1), 0, &a, __FILE__, __LINE__), FU_ERR_INVALID);
    assert_int_equal(cu_emu_launch(&ks, cu_dim(1, 1, 1), cu_dim(32, 1, 1), 64 * 1024, &a, __FILE__, __LINE__),
                     FU_ERR_INVALID);
    /* a shuffle in a partial warp */
    assert_int_equal(cu_emu_launch(&ks, cu_dim(1, 1, 1), cu_dim(40, 1, 1), 40 * sizeof(float), &a, __FILE__, __LINE__),
                     FU_ERR_INTERNAL);
    free(out);
}

/* Without a GPU the real backend refuses cleanly; with one it works. */
static void test_real_backend_absent(void **state) {
    (void)state;
    op_backend *be = op_backend_cuda_new(0);
    if (be) {
        op_backend_free(be);
        return;
    }
    assert_true(strlen(fu_last_error()) > 0);
    assert_non_null(strstr(fu_last_error(), "cuda"));
    assert_null(op_backend_cuda_new(-1));
}

static int setup(void **state) {
    (void)state;
    op_cpu_options o = {.n_threads = 1, .isa = OP_CPU_ISA_PORTABLE};
    cmp_cpu = op_backend_cpu_new(&o);
    assert_non_null(cmp_cpu);
    /* small GEMM chunks: the prefill path then dequantizes weights in several pieces */
    cmp_dev = op_backend_cuda_emu_new(5 * 96);
    assert_non_null(cmp_dev);
    assert_string_equal(op_backend_name(cmp_dev), "cuda-emu");
    return 0;
}

static int teardown(void **state) {
    (void)state;
    op_backend_free(cmp_dev);
    op_backend_free(cmp_cpu);
    return 0;
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_emu_semantics),
        cmocka_unit_test(test_real_backend_absent),
        CMP_TESTS,
        CMP_TRAIN_TESTS,
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}

#else /* no CUDA toolchain: nothing to emulate, every test skips (cmp_dev stays NULL) */

static int setup(void **state) {
    (void)state;
    print_message("fusion was built without CUDA: no emulator -- skipping\n");
    return 0;
}

static int teardown(void **state) {
    (void)state;
    return 0;
}

int main(void) {
    const struct CMUnitTest tests[] = {CMP_TESTS, CMP_TRAIN_TESTS};
    return cmocka_run_group_tests(tests, setup, teardown);
}
#endif
