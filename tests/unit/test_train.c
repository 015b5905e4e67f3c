/* test_train.c -- the trainer and the coordinator's run on random models: keeping
 * activations equals recomputing them (with dropout too, whose masks a seed fixes);
 * refusals of budgets, adapters, batches and slots; a step with a non-finite gradient is
 * skipped and changes nothing; a stage whose server dies mid-run is replaced from the
 * snapshot and the run ends with the adapter of an undisturbed one, bit for bit; a
 * pipeline of micro-batches in flight gives the sequential run's adapter, bit for bit; the
 * learning-rate schedules; the state's export in PEFT's order from a GGUF-layout model; a
 * span's state (weights and AdamW moments) loads from a saved whole adapter and its optimizer
 * file, and a damaged optimizer file is refused. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "engine.h"
#include "lora.h"
#include "model.h"
#include "status.h"
#include "test-files.h"
#include "test-model.h"
#include "train-run.h"
#include "train.h"

#define T_ROWS 12

/* A span [first, last) of the small llama, its engine, adapter and trainer. */
typedef struct span_fx {
    mdl_model *m;
    eng_engine *e;
    lora_adapter *ad;
    trn_span *t;
} span_fx;

static op_backend *be;

static int setup(void **state) {
    if (tf_setup(state)) return -1;
    op_cpu_options co = {.n_threads = 2};
    be = op_backend_cpu_new(&co);
    return be ? 0 : -1;
}

static int teardown(void **state) {
    op_backend_free(be);
    return tf_teardown(state);
}

static lora_config test_lora(float dropout) {
    lora_config c = lora_config_default();
    c.r = 4;
    c.alpha = 8;
    c.dropout = dropout;
    c.targets = LORA_TARGETS_ALL;
    return c;
}

static void span_open(span_fx *f, const mdl_config *c, int first, int last, const lora_config *lc, trn_memory mem) {
    mdl_open_options o = {first, last, first == 0, last == c->n_layers};
    assert_int_equal(mdl_random(c, OP_TYPE_F32, 42, &o, &f->m), FU_OK);
    eng_options eo = {1, OP_TYPE_F32};
    assert_int_equal(eng_new(f->m, be, &eo, &f->e), FU_OK);
    assert_int_equal(lora_new(lc, &f->m->cfg, first, last, 7, &f->ad), FU_OK);
    lora_randomize_b(f->ad, 8, 0.05f);
    trn_options to = {.max_tokens = 32, .slots = 2, .memory = mem};
    assert_int_equal(trn_new(f->e, f->ad, &to, &f->t), FU_OK);
}

static void span_close(span_fx *f) {
    trn_free(f->t);
    lora_free(f->ad);
    eng_free(f->e);
    mdl_free(f->m);
}

/* Two examples (7 and 5 rows) with targets, the second's first two rows without. */
static const int32_t tokens[T_ROWS] = {3, 17, 42, 5, 99, 0, 61, 8, 8, 13, 21, 34};
static const int32_t first[T_ROWS] = {0, 0, 0, 0, 0, 0, 0, 7, 7, 7, 7, 7};
static const int32_t targets[T_ROWS] = {17, 42, 5, 99, 0, 61, -1, -1, -1, 13, 21, 34};

static trn_batch test_batch(uint64_t seed) {
    return (trn_batch){T_ROWS, tokens, NULL, first, targets, 1.0f / 9, seed};
}

/* ---- trainer ----------------------------------------------------------------------------- */

static void check_keep_equals_recompute(float dropout) {
    mdl_config c = test_small_config(MDL_ARCH_QWEN3);
    lora_config lc = test_lora(dropout);
    span_fx a, b;
    span_open(&a, &c, 0, 2, &lc, TRN_RECOMPUTE);
    span_open(&b, &c, 0, 2, &lc, TRN_KEEP);
    trn_batch bt = test_batch(5);
    trn_loss la = {0}, lb = {0};
    assert_int_equal(trn_forward(a.t, 0, &bt, NULL, &la), FU_OK);
    assert_int_equal(trn_forward(b.t, 1, &bt, NULL, &lb), FU_OK);
    assert_true(la.sum == lb.sum && la.n_tokens == 9 && la.n_correct == lb.n_correct);
    assert_int_equal(trn_backward(a.t, 0, NULL, NULL), FU_OK);
    assert_int_equal(trn_backward(b.t, 1, NULL, NULL), FU_OK);
    assert_memory_equal(trn_grads(a.t), trn_grads(b.t), a.ad->n_floats * sizeof(float));
    assert_true(trn_grad_sqnorm(a.t) > 0);
    span_close(&a);
    span_close(&b);
}

static void test_keep_equals_recompute(void **state) {
    (void)state;
    check_keep_equals_recompute(0.0f);
    check_keep_equals_recompute(0.25f); /* the masks are rebuilt from the seed */
}

static void test_dropout_seeded(void **state) {
    (void)state;
    mdl_config c = test_small_config(MDL_ARCH_LLAMA);
    lora_config lc = test_lora(0.3f);
    span_fx f;
    span_open(&f, &c, 0, 2, &lc, TRN_RECOMPUTE);
    trn_loss l1 = {0}, l2 = {0}, l3 = {0};
    trn_batch b1 = test_batch(1), b2 = test_batch(2);
    assert_int_equal(trn_forward(f.t, 0, &b1, NULL, &l1), FU_OK);
    trn_drop(f.t, 0);
    assert_int_equal(trn_forward(f.t, 0, &b1, NULL, &l2), FU_OK);
    trn_drop(f.t, 0);
    assert_int_equal(trn_forward(f.t, 0, &b2, NULL, &l3), FU_OK);
    assert_true(l1.sum == l2.sum && l1.sum != l3.sum);
    span_close(&f);
}

static void test_refusals(void **state) {
    (void)state;
    mdl_config c = test_small_config(MDL_ARCH_LLAMA);
    lora_config lc = test_lora(0);
    span_fx f;
    span_open(&f, &c, 0, 2, &lc, TRN_RECOMPUTE);
    trn_span *t = NULL;
    trn_options tight = {.max_tokens = 4096, .slots = 8, .budget_bytes = 1 << 20};
    assert_int_equal(trn_new(f.e, f.ad, &tight, &t), FU_ERR_EXHAUSTED);
    assert_non_null(strstr(fu_last_error(), "over the budget of 1.0 MiB"));
    lora_adapter *half = NULL;
    assert_int_equal(lora_new(&lc, &c, 0, 1, 1, &half), FU_OK);
    assert_int_equal(trn_new(f.e, half, NULL, &t), FU_ERR_INVALID);
    lora_free(half);

    int32_t bad_first[T_ROWS], bad_tg[T_ROWS], bad_tok[T_ROWS];
    memcpy(bad_first, first, sizeof first);
    memcpy(bad_tg, targets, sizeof targets);
    memcpy(bad_tok, tokens, sizeof tokens);
    bad_first[9] = 8; /* inside an example, not its start */
    bad_tg[3] = 100;
    bad_tok[0] = -1;
    trn_batch b = test_batch(0);
    b.first = bad_first;
    assert_int_equal(trn_forward(f.t, 0, &b, NULL, NULL), FU_ERR_RANGE);
    b = test_batch(0), b.targets = bad_tg;
    assert_int_equal(trn_forward(f.t, 0, &b, NULL, NULL), FU_ERR_RANGE);
    b = test_batch(0), b.tokens = bad_tok;
    assert_int_equal(trn_forward(f.t, 0, &b, NULL, NULL), FU_ERR_RANGE);
    b = test_batch(0), b.n_tokens = 33;
    assert_int_equal(trn_forward(f.t, 0, &b, NULL, NULL), FU_ERR_RANGE);
    b = test_batch(0);
    assert_int_equal(trn_forward(f.t, 2, &b, NULL, NULL), FU_ERR_INVALID);
    assert_int_equal(trn_backward(f.t, 0, NULL, NULL), FU_ERR_INVALID); /* nothing forwarded */
    assert_int_equal(trn_forward(f.t, 0, &b, NULL, NULL), FU_OK);
    assert_int_equal(trn_forward(f.t, 0, &b, NULL, NULL), FU_ERR_INVALID); /* slot busy */
    assert_int_equal(trn_slot_tokens(f.t, 0), T_ROWS);
    assert_int_equal(trn_backward(f.t, 0, NULL, NULL), FU_OK);
    assert_int_equal(trn_slot_tokens(f.t, 0), 0);
    trn_adamw h = trn_adamw_default();
    assert_int_equal(trn_step(f.t, &h, 1e-3f, 1.0f, 0), FU_ERR_RANGE); /* steps count from 1 */
    span_close(&f);
}

/* ---- the run ------------------------------------------------------------------------------ */

static const trn_example examples[4] = {
    {7, tokens, targets},
    {5, tokens + 7, targets + 7},
    {6, tokens + 3, targets + 3},
    {4, tokens + 8, targets + 8},
};

static trn_run_options run_options(void) {
    return (trn_run_options){.max_tokens = 32, .dim = 64, .clip = 1.0f, .adamw = trn_adamw_default(),
                             .sched = {5e-3f, 1, 6, TRN_DECAY_COSINE}, .seed = 9};
}

static void test_nonfinite_step_skipped(void **state) {
    (void)state;
    mdl_config c = test_small_config(MDL_ARCH_QWEN2);
    lora_config lc = test_lora(0);
    span_fx f;
    span_open(&f, &c, 0, 2, &lc, TRN_RECOMPUTE);
    trn_stage st = trn_stage_local(f.t);
    trn_run_options o = run_options();
    trn_run *r = NULL;
    assert_int_equal(trn_run_new(&st, 1, &o, &r), FU_OK);
    const size_t bytes = f.ad->n_floats * sizeof(float);
    float *before = malloc(bytes), keep = f.ad->data[f.ad->n_floats - 1];
    f.ad->data[f.ad->n_floats - 1] = NAN; /* the last block's down_proj B */
    memcpy(before, f.ad->data, bytes);
    trn_step_result res;
    assert_int_equal(trn_run_step(r, examples, 2, &res), FU_ERR_RANGE);
    assert_non_null(strstr(fu_last_error(), "not finite"));
    assert_memory_equal(before, f.ad->data, bytes);
    assert_int_equal(trn_run_steps(r), 0);
    f.ad->data[f.ad->n_floats - 1] = keep;
    assert_int_equal(trn_run_step(r, examples, 2, &res), FU_OK);
    assert_true(res.step == 1 && res.n_tokens == 9 && isfinite(res.loss) && res.grad_norm > 0);
    free(before);
    trn_run_free(r);
    span_close(&f);
}

/* A stage that dies (FU_ERR_NETWORK from then on) at its `die_at`-th backward. */
typedef struct flaky {
    trn_stage inner;
    int die_at, backwards;
    bool dead;
} flaky;

static int fl_dead(flaky *f) {
    (void)f;
    return fu_errorf(FU_ERR_NETWORK, "stage gone");
}
static int fl_forward(void *p, int slot, const trn_batch *b, float *out, trn_loss *loss) {
    flaky *f = p;
    return f->dead ? fl_dead(f) : f->inner.vt->forward(f->inner.st, slot, b, out, loss);
}
static int fl_backward(void *p, int slot, const float *dy, float *dx) {
    flaky *f = p;
    if (!f->dead && ++f->backwards == f->die_at) f->dead = true;
    return f->dead ? fl_dead(f) : f->inner.vt->backward(f->inner.st, slot, dy, dx);
}
static int fl_sqnorm(void *p, double *out) {
    flaky *f = p;
    return f->dead ? fl_dead(f) : f->inner.vt->sqnorm(f->inner.st, out);
}
static int fl_step(void *p, const trn_adamw *h, float lr, float gs, int64_t t) {
    flaky *f = p;
    return f->dead ? fl_dead(f) : f->inner.vt->step(f->inner.st, h, lr, gs, t);
}
static void fl_drop(void *p, int slot) {
    flaky *f = p;
    if (!f->dead) f->inner.vt->drop(f->inner.st, slot);
}
static int fl_zero(void *p) {
    flaky *f = p;
    return f->dead ? fl_dead(f) : f->inner.vt->zero_grad(f->inner.st);
}
static int fl_get(void *p, trn_state *s) {
    flaky *f = p;
    return f->dead ? fl_dead(f) : f->inner.vt->get_state(f->inner.st, s);
}
static int fl_put(void *p, const trn_state *s) {
    flaky *f = p;
    return f->dead ? fl_dead(f) : f->inner.vt->put_state(f->inner.st, s);
}
static const trn_stage_vt flaky_vt = {fl_forward, fl_backward, fl_sqnorm, fl_step, fl_drop, fl_zero, fl_get, fl_put};

/* The replacement: a fresh span of the dead one's blocks, given the snapshot. */
typedef struct spares {
    mdl_config c;
    lora_config lc;
    span_fx spare;
    int used;
} spares;

static int replace(void *arg, int index, const trn_state *snap, trn_stage *out) {
    spares *s = arg;
    assert_int_equal(index, 1);
    s->used++;
    span_open(&s->spare, &s->c, 1, 2, &s->lc, TRN_RECOMPUTE);
    trn_stage st = trn_stage_local(s->spare.t);
    int rc = st.vt->put_state(st.st, snap);
    if (!rc) *out = st;
    return rc;
}

/* Trains 5 steps over spans [0, 1) and [1, 2); the second dies at backward die_at
 * (0: never). The final adapter of both spans into out (n floats). */
static void run_chain(int die_at, int snapshot_every, float *out, size_t *n) {
    mdl_config c = test_small_config(MDL_ARCH_LLAMA);
    spares sp = {.c = c, .lc = test_lora(0.1f)};
    span_fx a, b;
    span_open(&a, &c, 0, 1, &sp.lc, TRN_RECOMPUTE);
    span_open(&b, &c, 1, 2, &sp.lc, TRN_RECOMPUTE);
    flaky fb = {trn_stage_local(b.t), die_at, 0, false};
    trn_stage stages[2] = {trn_stage_local(a.t), {&flaky_vt, &fb}};
    trn_run_options o = run_options();
    o.replace = replace;
    o.replace_arg = &sp;
    o.snapshot_every = snapshot_every;
    o.max_replacements = 1;
    trn_run *r = NULL;
    assert_int_equal(trn_run_new(stages, 2, &o, &r), FU_OK);
    for (int s = 0; s < 5; s++) {
        trn_step_result res;
        assert_int_equal(trn_run_step(r, examples + (s % 2) * 2, 2, &res), FU_OK);
        assert_int_equal(res.step, s + 1);
    }
    assert_int_equal(sp.used, die_at ? 1 : 0);
    assert_int_equal(trn_run_replacements(r), die_at ? 1 : 0);
    trn_state s0, s1;
    trn_stage last = trn_run_stage(r, 1);
    assert_int_equal(stages[0].vt->get_state(stages[0].st, &s0), FU_OK);
    assert_int_equal(last.vt->get_state(last.st, &s1), FU_OK);
    memcpy(out, s0.params, s0.n * sizeof(float));
    memcpy(out + s0.n, s1.params, s1.n * sizeof(float));
    *n = s0.n + s1.n;
    trn_state_clear(&s0);
    trn_state_clear(&s1);
    trn_run_free(r);
    span_close(&a);
    span_close(&b);
    if (sp.used) span_close(&sp.spare);
}

static void test_failover_equals_undisturbed(void **state) {
    (void)state;
    static float ref[1 << 16], got[1 << 16];
    size_t n_ref, n_got;
    run_chain(0, 1, ref, &n_ref);
    run_chain(5, 1, got, &n_got); /* dies in step 3 */
    assert_int_equal(n_ref, n_got);
    assert_memory_equal(ref, got, n_ref * sizeof(float));
    run_chain(4, 2, got, &n_got); /* in step 2 of a 2-step snapshot interval: step 1 replayed */
    assert_memory_equal(ref, got, n_ref * sizeof(float));
}

/* Params after 3 steps over spans [0, 1) and [1, 2), micro-batches of at most
 * 8 rows (one example each), `depth` of them in flight. */
static void run_pipelined(int depth, float *out, size_t *n) {
    mdl_config c = test_small_config(MDL_ARCH_QWEN2);
    lora_config lc = test_lora(0.1f);
    span_fx a, b;
    span_open(&a, &c, 0, 1, &lc, TRN_RECOMPUTE);
    span_open(&b, &c, 1, 2, &lc, TRN_KEEP);
    trn_stage stages[2] = {trn_stage_local(a.t), trn_stage_local(b.t)};
    trn_run_options o = run_options();
    o.max_tokens = 8;
    o.pipeline = depth;
    trn_run *r = NULL;
    assert_int_equal(trn_run_new(stages, 2, &o, &r), FU_OK);
    for (int s = 0; s < 3; s++) {
        trn_step_result res;
        assert_int_equal(trn_run_step(r, examples, 4, &res), FU_OK);
        assert_int_equal(res.micro_batches, 4);
    }
    memcpy(out, a.ad->data, a.ad->n_floats * sizeof(float));
    memcpy(out + a.ad->n_floats, b.ad->data, b.ad->n_floats * sizeof(float));
    *n = a.ad->n_floats + b.ad->n_floats;
    trn_run_free(r);
    span_close(&a);
    span_close(&b);
}

static void test_pipeline_equals_sequential(void **state) {
    (void)state;
    static float ref[1 << 16], got[1 << 16];
    size_t n_ref, n_got;
    run_pipelined(1, ref, &n_ref);
    run_pipelined(2, got, &n_got); /* the stages' 2 slots */
    assert_int_equal(n_ref, n_got);
    assert_memory_equal(ref, got, n_ref * sizeof(float));
}

static void test_schedules(void **state) {
    (void)state;
    trn_schedule s = {1.0f, 2, 10, TRN_DECAY_LINEAR};
    assert_true(trn_lr_at(&s, 0) == 0.0f && trn_lr_at(&s, 1) == 0.5f && trn_lr_at(&s, 2) == 1.0f);
    assert_float_equal(trn_lr_at(&s, 6), 0.5f, 1e-7);
    assert_true(trn_lr_at(&s, 10) == 0.0f && trn_lr_at(&s, 12) == 0.0f);
    s.decay = TRN_DECAY_COSINE;
    assert_float_equal(trn_lr_at(&s, 6), 0.5f, 1e-6);
    assert_float_equal(trn_lr_at(&s, 4), 0.5f * (1.0f + cosf((float)M_PI / 4)), 1e-6);
    s.decay = TRN_DECAY_CONSTANT;
    assert_true(trn_lr_at(&s, 9) == 1.0f);
}

static void test_state_in_peft_order(void **state) {
    (void)state;
    mdl_config c = test_small_config(MDL_ARCH_LLAMA);
    c.rope_mode = OP_ROPE_NORM; /* a GGUF llama's layout: q/k rows interleaved */
    lora_config lc = test_lora(0);
    span_fx a, b;
    span_open(&a, &c, 0, 2, &lc, TRN_RECOMPUTE);
    span_open(&b, &c, 0, 2, &lc, TRN_RECOMPUTE);
    assert_true(a.ad->qk_interleaved);
    const size_t n = a.ad->n_floats;
    float *p = malloc(3 * n * sizeof(float));
    assert_int_equal(trn_export(a.t, p, p + n, p + 2 * n), FU_OK);
    /* q_proj's B of block 0, head 0: PEFT's row j * hd/2 + i is held row 2i + j */
    const lora_pair *q = lora_at(a.ad, 0, LORA_TARGET_Q);
    const float *peft_b = p + (q->b - a.ad->data);
    assert_memory_equal(peft_b + 1 * lc.r, q->b + 2 * lc.r, lc.r * sizeof(float)); /* i 1, j 0 */
    assert_memory_equal(peft_b + 8 * lc.r, q->b + 1 * lc.r, lc.r * sizeof(float)); /* i 0, j 1 */
    assert_int_equal(trn_import(b.t, p, p + n, p + 2 * n), FU_OK);
    assert_memory_equal(a.ad->data, b.ad->data, n * sizeof(float));
    free(p);
    span_close(&a);
    span_close(&b);
}

/* A whole adapter saved with its moments (m1[i] = i, m2[i] = -i) into tmpdir/rel. */
static lora_adapter *saved_with_moments(const mdl_config *c, const char *rel, size_t moments) {
    lora_config lc = test_lora(0);
    lora_adapter *ad;
    assert_int_equal(lora_new(&lc, c, 0, c->n_layers, 3, &ad), FU_OK);
    lora_randomize_b(ad, 4, 0.1f);
    char dir[512];
    tmp_path(dir, sizeof dir, rel);
    mkdir(dir, 0755);
    assert_int_equal(lora_save(ad, dir), FU_OK);
    float *m = malloc(2 * moments * sizeof(float));
    for (size_t i = 0; i < moments; i++) m[i] = (float)i, m[moments + i] = -(float)i;
    assert_int_equal(trn_optimizer_save(dir, m, m + moments, moments), FU_OK);
    free(m);
    return ad;
}

static void test_state_with_moments(void **state) {
    (void)state;
    mdl_config c = test_small_config(MDL_ARCH_LLAMA);
    lora_adapter *whole = saved_with_moments(&c, "resume", 0);
    const size_t n = whole->n_floats, per_block = n / (size_t)c.n_layers;
    lora_free(whole);
    whole = saved_with_moments(&c, "resume", n);
    char dir[512];
    tmp_path(dir, sizeof dir, "resume");
    trn_state st;
    assert_int_equal(trn_state_load(dir, &c, 1, 2, 64, &st), FU_OK); /* the second block */
    assert_true(st.first == 1 && st.last == 2 && st.n == per_block && st.m1 && st.m2);
    assert_memory_equal(st.params, whole->data + per_block, per_block * sizeof(float));
    assert_true(st.m1[0] == (float)per_block && st.m2[per_block - 1] == -(float)(2 * per_block - 1));
    trn_state_clear(&st);
    float *small = calloc(2 * n, sizeof(float)); /* moments of another size: refused */
    assert_int_equal(trn_optimizer_save(dir, small, small + n, n / 2), FU_OK);
    assert_int_equal(trn_state_load(dir, &c, 1, 2, 64, &st), FU_ERR_FORMAT);
    assert_null(st.params);
    tmp_path(dir, sizeof dir, "resume/" TRN_OPTIMIZER_FILE); /* none: weights only */
    assert_int_equal(unlink(dir), 0);
    tmp_path(dir, sizeof dir, "resume");
    assert_int_equal(trn_state_load(dir, &c, 0, 2, 64, &st), FU_OK);
    assert_true(st.n == n && !st.m1 && !st.m2);
    trn_state_clear(&st);
    free(small);
    lora_free(whole);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_keep_equals_recompute),
        cmocka_unit_test(test_dropout_seeded),
        cmocka_unit_test(test_refusals),
        cmocka_unit_test(test_nonfinite_step_skipped),
        cmocka_unit_test(test_failover_equals_undisturbed),
        cmocka_unit_test(test_pipeline_equals_sequential),
        cmocka_unit_test(test_schedules),
        cmocka_unit_test(test_state_in_peft_order),
        cmocka_unit_test(test_state_with_moments),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
