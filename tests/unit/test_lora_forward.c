/* test_lora_forward.c -- LoRA in the engine's forward pass, on random f32 models:
 * an adapted sequence's logits equal those of the model with the adapter merged
 * into its weights (W + scale * B A); a batch mixing adapters and unadapted
 * sequences gives each its own logits, across chunks; B = 0 gives the base
 * logits exactly; adapters of another span or shape are refused. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine.h"
#include "lora.h"
#include "model.h"
#include "status.h"
#include "test-engine.h"
#include "test-lora.h"
#include "test-model.h"

#define N_TOK 7
#define MAX_LEN 32

static void fixture_open(fixture *f, const mdl_config *c, int max_batch) {
    fixture_open_config(f, c, OP_TYPE_F32, max_batch);
}

static const int32_t prompt[N_TOK] = {3, 17, 42, 5, 99, 0, 61};

/* The weight of target t in layer L. */
static op_tensor *target_weight(mdl_layer *L, lora_target t) {
    switch (t) {
    case LORA_TARGET_Q: return &L->wq;
    case LORA_TARGET_K: return &L->wk;
    case LORA_TARGET_V: return &L->wv;
    case LORA_TARGET_O: return &L->wo;
    case LORA_TARGET_GATE: return &L->w_gate;
    case LORA_TARGET_UP: return &L->w_up;
    default: return &L->w_down;
    }
}

/* W (out, in) += scale * B (out, r) @ A (r, in) for every adapted target of
 * every block: the reference PEFT's merge_and_unload computes. */
static void merge_adapter(mdl_model *m, const lora_adapter *ad) {
    const float s = lora_scale(&ad->cfg);
    const int r = ad->cfg.r;
    for (int l = ad->first; l < ad->last; l++)
        for (int t = 0; t < LORA_N_TARGETS; t++) {
            const lora_pair *p = lora_at(ad, l, (lora_target)t);
            if (!p->a) continue;
            op_tensor *w = target_weight(&m->layers[l - m->first], (lora_target)t);
            assert_int_equal(w->type, OP_TYPE_F32);
            const int64_t in = w->ne[0], out = w->ne[1];
            float *wd = w->data;
            for (int64_t o = 0; o < out; o++)
                for (int64_t i = 0; i < in; i++) {
                    double acc = 0;
                    for (int k = 0; k < r; k++) acc += (double)p->b[o * r + k] * p->a[k * in + i];
                    wd[o * in + i] += (float)(s * acc);
                }
        }
}

/* Runs `n` tokens of one fresh sequence with adapter ad (NULL: none); logits of every position. */
static void run_alone(fixture *f, lora_adapter *ad, const int32_t *ids, int n, float *out) {
    eng_seq *s;
    assert_int_equal(eng_seq_new(f->e, MAX_LEN, &s), FU_OK);
    assert_int_equal(eng_seq_set_adapter(s, ad), FU_OK);
    eng_seq *seqs[N_TOK];
    for (int i = 0; i < n; i++) seqs[i] = s;
    eng_batch b = {n, ids, NULL, seqs, NULL};
    assert_int_equal(eng_forward(f->e, &b, out), FU_OK);
    eng_seq_free(f->e, s);
}

/* Adapted logits equal the merged model's, for each architecture's extras
 * (q/k/v bias, q/k norm), with every target and with PEFT's default q/v. */
static void test_matches_merged(void **state) {
    (void)state;
    const mdl_arch archs[] = {MDL_ARCH_LLAMA, MDL_ARCH_QWEN2, MDL_ARCH_QWEN3};
    const uint32_t targets[] = {LORA_TARGETS_ALL, LORA_TARGET_BIT(LORA_TARGET_Q) | LORA_TARGET_BIT(LORA_TARGET_V)};
    for (size_t a = 0; a < sizeof archs / sizeof archs[0]; a++)
        for (size_t t = 0; t < 2; t++) {
            mdl_config c = test_small_config(archs[a]);
            fixture f, merged;
            fixture_open(&f, &c, 4); /* chunks of 4: the second chunk has 3 rows */
            lora_adapter *ad = test_random_adapter(&c, 0, c.n_layers, targets[t], 4, 11 + t);
            fixture_open(&merged, &c, 256);
            merge_adapter(merged.m, ad);
            const size_t n = (size_t)N_TOK * (size_t)c.vocab_size;
            float *got = malloc(n * sizeof *got), *want = malloc(n * sizeof *want), *base = malloc(n * sizeof *base);
            run_alone(&f, ad, prompt, N_TOK, got);
            run_alone(&merged, NULL, prompt, N_TOK, want);
            run_alone(&f, NULL, prompt, N_TOK, base);
            test_assert_close("adapted vs merged", got, want, n, 1e-4);
            double moved = 0;
            for (size_t i = 0; i < n; i++) moved = fmax(moved, fabs((double)got[i] - base[i]));
            assert_true(moved > 1e-3); /* the adapter does change the logits */
            free(got);
            free(want);
            free(base);
            lora_free(ad);
            fixture_close(&merged);
            fixture_close(&f);
        }
}

/* One batch, interleaving a sequence with adapter 1, one without and one with
 * adapter 2 (another rank), in chunks of 5: each gets its logits alone. */
static void test_mixed_batch(void **state) {
    (void)state;
    mdl_config c = test_small_config(MDL_ARCH_LLAMA);
    fixture f;
    fixture_open(&f, &c, 5);
    const uint32_t od = LORA_TARGET_BIT(LORA_TARGET_O) | LORA_TARGET_BIT(LORA_TARGET_DOWN);
    lora_adapter *ad[3] = {test_random_adapter(&c, 0, c.n_layers, LORA_TARGETS_ALL, 4, 21), NULL,
                           test_random_adapter(&c, 0, c.n_layers, od, 8, 31)};
    const size_t V = (size_t)c.vocab_size, n = (size_t)N_TOK * V;
    float *alone = malloc(3 * n * sizeof *alone), *got = malloc(3 * n * sizeof *got);
    eng_seq *s[3], *seqs[3 * N_TOK];
    int32_t ids[3 * N_TOK];
    for (int j = 0; j < 3; j++) {
        run_alone(&f, ad[j], prompt, N_TOK, alone + (size_t)j * n);
        assert_int_equal(eng_seq_new(f.e, MAX_LEN, &s[j]), FU_OK);
        assert_int_equal(eng_seq_set_adapter(s[j], ad[j]), FU_OK);
    }
    for (int i = 0; i < N_TOK; i++)
        for (int j = 0; j < 3; j++) {
            seqs[3 * i + j] = s[j];
            ids[3 * i + j] = prompt[i];
        }
    eng_batch b = {3 * N_TOK, ids, NULL, seqs, NULL};
    assert_int_equal(eng_forward(f.e, &b, got), FU_OK);
    for (int j = 0; j < 3; j++) {
        float *mine = malloc(n * sizeof *mine);
        for (int i = 0; i < N_TOK; i++) memcpy(mine + i * V, got + (size_t)(3 * i + j) * V, V * sizeof *mine);
        test_assert_close("mixed batch vs alone", mine, alone + (size_t)j * n, n, 1e-5);
        free(mine);
        eng_seq_free(f.e, s[j]);
    }
    free(alone);
    free(got);
    lora_free(ad[0]);
    lora_free(ad[2]);
    fixture_close(&f);
}

/* A fresh adapter (B = 0) leaves the logits exactly as they are. */
static void test_zero_b_is_base(void **state) {
    (void)state;
    mdl_config c = test_small_config(MDL_ARCH_QWEN2);
    fixture f;
    fixture_open(&f, &c, 256);
    lora_config lc = lora_config_default();
    lc.targets = LORA_TARGETS_ALL;
    lora_adapter *ad;
    assert_int_equal(lora_new(&lc, &c, 0, c.n_layers, 5, &ad), FU_OK);
    const size_t n = (size_t)N_TOK * (size_t)c.vocab_size;
    float *got = malloc(n * sizeof *got), *base = malloc(n * sizeof *base);
    run_alone(&f, ad, prompt, N_TOK, got);
    run_alone(&f, NULL, prompt, N_TOK, base);
    for (size_t i = 0; i < n; i++) assert_true(got[i] == base[i]);
    free(got);
    free(base);
    lora_free(ad);
    fixture_close(&f);
}

/* Adapters of another span or model shape are refused with a message; the
 * sequence keeps running without one. */
static void test_mismatch_refused(void **state) {
    (void)state;
    mdl_config c = test_small_config(MDL_ARCH_LLAMA);
    fixture f;
    fixture_open(&f, &c, 256);
    lora_config lc = lora_config_default();
    lora_adapter *part, *other;
    assert_int_equal(lora_new(&lc, &c, 0, 1, 1, &part), FU_OK);
    mdl_config wide = c;
    wide.ffn_dim = 128;
    assert_int_equal(lora_new(&lc, &wide, 0, wide.n_layers, 1, &other), FU_OK);
    eng_seq *s;
    assert_int_equal(eng_seq_new(f.e, MAX_LEN, &s), FU_OK);
    assert_int_equal(eng_seq_set_adapter(s, part), FU_ERR_INVALID);
    assert_non_null(strstr(fu_last_error(), "blocks [0, 1)"));
    assert_int_equal(eng_seq_set_adapter(s, other), FU_ERR_INVALID);
    assert_non_null(strstr(fu_last_error(), "ffn 128"));
    eng_seq *seqs[1] = {s};
    float *out = malloc((size_t)c.vocab_size * sizeof *out);
    eng_batch b = {1, prompt, NULL, seqs, NULL};
    assert_int_equal(eng_forward(f.e, &b, out), FU_OK);
    free(out);
    eng_seq_free(f.e, s);
    lora_free(part);
    lora_free(other);
    fixture_close(&f);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_matches_merged),
        cmocka_unit_test(test_mixed_batch),
        cmocka_unit_test(test_zero_b_is_base),
        cmocka_unit_test(test_mismatch_refused),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
