/* test_cuda_emu_lora.c -- LoRA on the CUDA backend, run by the CPU emulator, against the CPU
 * backend on a random model: an adapted sequence's logits (the adapter copied to the backend's
 * memory), and a training step (forward, backward, AdamW) with the adapter's weights and
 * gradients in the backend's memory: the loss, every gradient and the stepped weights agree.
 * Without the CUDA toolchain (FUSION_CUDA=OFF) the emulator is not built and the tests skip. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "engine.h"
#include "lora.h"
#include "model.h"
#include "status.h"
#include "train.h"

#ifdef FUSION_HAVE_CUDA_EMU
#include "cuda-emu.h"

#include "../unit/test-model.h"

#define T_ROWS 10

typedef struct side {
    op_backend *be;
    mdl_model *m;
    eng_engine *e;
    lora_adapter *ad;
} side;

static void side_open(side *s, op_backend *be, const mdl_config *c) {
    s->be = be;
    mdl_open_options o = mdl_open_options_all();
    assert_int_equal(mdl_random(c, OP_TYPE_F32, 42, &o, &s->m), FU_OK);
    eng_options eo = {16, OP_TYPE_F32};
    assert_int_equal(eng_new(s->m, be, &eo, &s->e), FU_OK);
    lora_config lc = lora_config_default();
    lc.r = 4;
    lc.alpha = 8;
    lc.targets = LORA_TARGETS_ALL;
    assert_int_equal(lora_new(&lc, c, 0, c->n_layers, 3, &s->ad), FU_OK);
    lora_randomize_b(s->ad, 4, 0.1f);
}

static void side_close(side *s) {
    lora_free(s->ad);
    eng_free(s->e);
    mdl_free(s->m);
    op_backend_free(s->be);
}

/* max |a - b| <= tol * max |b| over n values. */
static void assert_close(const char *what, const float *a, const float *b, size_t n, double tol) {
    double err = 0, scale = 0;
    for (size_t i = 0; i < n; i++) {
        err = fmax(err, fabs((double)a[i] - b[i]));
        scale = fmax(scale, fabs((double)b[i]));
    }
    if (!(err <= tol * scale)) fail_msg("%s: max error %g against max %g", what, err, scale);
}

static const int32_t tokens[T_ROWS] = {3, 17, 42, 5, 99, 0, 61, 8, 13, 21};

static void test_lora_forward(void **state) {
    (void)state;
    mdl_config c = test_small_config(MDL_ARCH_QWEN2);
    op_cpu_options co = {.n_threads = 2};
    side cpu, gpu;
    side_open(&cpu, op_backend_cpu_new(&co), &c);
    side_open(&gpu, op_backend_cuda_emu_new(0), &c);
    float lc[T_ROWS * 100], lg[T_ROWS * 100];
    side *sides[2] = {&cpu, &gpu};
    float *out[2] = {lc, lg};
    for (int i = 0; i < 2; i++) {
        eng_seq *s;
        assert_int_equal(eng_seq_new(sides[i]->e, 32, &s), FU_OK);
        assert_int_equal(eng_seq_set_adapter(s, sides[i]->ad), FU_OK);
        eng_seq *seqs[T_ROWS];
        for (int t = 0; t < T_ROWS; t++) seqs[t] = s;
        eng_batch b = {T_ROWS, tokens, NULL, seqs, NULL};
        assert_int_equal(eng_forward(sides[i]->e, &b, out[i]), FU_OK);
        eng_seq_free(sides[i]->e, s);
    }
    assert_true(gpu.ad->dev != gpu.ad->data); /* a copy in the backend's memory */
    assert_close("logits", lg, lc, sizeof lc / sizeof lc[0], 1e-3);
    side_close(&cpu);
    side_close(&gpu);
}

static void test_lora_training_step(void **state) {
    (void)state;
    mdl_config c = test_small_config(MDL_ARCH_QWEN3);
    op_cpu_options co = {.n_threads = 2};
    side cpu, gpu;
    side_open(&cpu, op_backend_cpu_new(&co), &c);
    side_open(&gpu, op_backend_cuda_emu_new(0), &c);
    const int32_t first[T_ROWS] = {0, 0, 0, 0, 0, 5, 5, 5, 5, 5};
    const int32_t targets[T_ROWS] = {17, 42, 5, 99, -1, -1, 8, 13, 21, 1};
    trn_batch b = {T_ROWS, tokens, NULL, first, targets, 1.0f / 8, 7};
    trn_span *tc, *tg;
    trn_options to = {.max_tokens = 16};
    assert_int_equal(trn_new(cpu.e, cpu.ad, &to, &tc), FU_OK);
    assert_int_equal(trn_new(gpu.e, gpu.ad, &to, &tg), FU_OK);
    trn_loss l1 = {0}, l2 = {0};
    assert_int_equal(trn_forward(tc, 0, &b, NULL, &l1), FU_OK);
    assert_int_equal(trn_forward(tg, 0, &b, NULL, &l2), FU_OK);
    assert_float_equal(l2.sum, l1.sum, 1e-3 * fabs(l1.sum));
    assert_int_equal(trn_backward(tc, 0, NULL, NULL), FU_OK);
    assert_int_equal(trn_backward(tg, 0, NULL, NULL), FU_OK);
    assert_close("gradients", trn_grads(tg), trn_grads(tc), cpu.ad->n_floats, 1e-3);
    trn_adamw h = trn_adamw_default();
    assert_int_equal(trn_step(tc, &h, 1e-2f, 1.0f, 1), FU_OK);
    assert_int_equal(trn_step(tg, &h, 1e-2f, 1.0f, 1), FU_OK);
    assert_close("stepped weights", gpu.ad->data, cpu.ad->data, cpu.ad->n_floats, 1e-4);
    trn_free(tc);
    trn_free(tg);
    side_close(&cpu);
    side_close(&gpu);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_lora_forward),
        cmocka_unit_test(test_lora_training_step),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}

#else

static void test_skipped(void **state) {
    (void)state;
    skip();
}

int main(void) {
    const struct CMUnitTest tests[] = {cmocka_unit_test(test_skipped)};
    return cmocka_run_group_tests(tests, NULL, NULL);
}

#endif
