/* test_shard_core.c -- the shard core: concurrent sessions batched together compute what
 * each computes alone; chained spans equal the whole model; admission control; bad steps;
 * waiting for an idle batcher (what training yields to). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine.h"
#include "model.h"
#include "shard-core.h"
#include "status.h"

#define N_SESS 6
#define N_PROMPT 9
#define N_GEN 12

static mdl_config test_config(void) {
    mdl_config c;
    memset(&c, 0, sizeof c);
    c.arch = MDL_ARCH_LLAMA;
    c.n_layers = 3;
    c.dim = 64;
    c.ffn_dim = 128;
    c.n_heads = 4;
    c.n_kv_heads = 2;
    c.head_dim = 16;
    c.vocab_size = 97;
    c.max_seq_len = 128;
    c.norm_eps = 1e-5f;
    c.rope_theta = 10000.0f;
    c.rope_mode = OP_ROPE_NEOX;
    return c;
}

/* A random model of test_config() on the CPU backend and a shard core over it. */
typedef struct fixture {
    mdl_model *m;
    op_backend *be;
    shard_core *core;
} fixture;

/* Opens the fixture: weights of type wt from seed, `threads` CPU threads, options o (NULL: defaults). */
static void fixture_open(fixture *f, op_type wt, uint64_t seed, int threads, const shard_core_options *o) {
    mdl_config cfg = test_config();
    assert_int_equal(mdl_random(&cfg, wt, seed, NULL, &f->m), FU_OK);
    op_cpu_options co = {.n_threads = threads, .isa = OP_CPU_ISA_AUTO};
    f->be = op_backend_cpu_new(&co);
    assert_non_null(f->be);
    assert_int_equal(shard_core_new(f->m, f->be, o, &f->core), FU_OK);
}

/* Frees the core, the backend and the model (every session closed). */
static void fixture_close(fixture *f) {
    shard_core_free(f->core);
    op_backend_free(f->be);
    mdl_free(f->m);
}

/* Greedy reference on a private engine: the tokens a prompt continues with. */
static void reference_greedy(const mdl_model *m, op_backend *be, const int32_t *prompt, int n,
                             int32_t *gen) {
    eng_engine *e;
    assert_int_equal(eng_new(m, be, NULL, &e), FU_OK);
    eng_seq *s;
    assert_int_equal(eng_seq_new(e, 64, &s), FU_OK);
    eng_seq *seqs[64];
    for (int i = 0; i < 64; i++) seqs[i] = s;
    uint8_t want[N_PROMPT] = {0};
    want[n - 1] = 1;
    float logits[97];
    eng_batch b = {n, prompt, NULL, seqs, want};
    assert_int_equal(eng_forward(e, &b, logits), FU_OK);
    for (int i = 0; i < N_GEN; i++) {
        gen[i] = smp_argmax(logits, 97);
        eng_batch d = {1, &gen[i], NULL, seqs, NULL};
        assert_int_equal(eng_forward(e, &d, logits), FU_OK);
    }
    eng_seq_free(e, s);
    eng_free(e);
}

typedef struct worker {
    shard_core *core;
    int idx;
    int32_t prompt[N_PROMPT];
    int32_t gen[N_GEN];
    int rc;
} worker;

static void *worker_run(void *arg) {
    worker *w = arg;
    char id[32];
    snprintf(id, sizeof id, "sess-%d", w->idx);
    shard_session *s;
    if ((w->rc = shard_session_open(w->core, id, 64, NULL, &s))) return NULL;
    shard_step st;
    memset(&st, 0, sizeof st);
    st.n = N_PROMPT;
    st.tokens = w->prompt;
    st.sample = true;
    st.sampling = smp_params_default();
    st.sampling.temperature = 0;
    st.top_logprobs = 3;
    for (int i = 0; i < N_GEN; i++) {
        st.start_pos = shard_session_len(s);
        if ((w->rc = shard_session_step(w->core, s, &st))) break;
        if (st.n_out != 1 || !st.out_tokens || !st.out_top_ids || st.out_top_ids[0] != st.out_tokens[0]) {
            w->rc = -100;
            break;
        }
        w->gen[i] = st.out_tokens[0];
        st.n = 1;
        st.tokens = &w->gen[i];
    }
    shard_session_close(w->core, s);
    return NULL;
}

static void test_concurrent_sessions_batch_and_match(void **state) {
    fixture f;
    shard_core_options o = {.kv_budget_bytes = 64u << 20, .max_batch_tokens = 64, .kv_type = OP_TYPE_F32};
    fixture_open(&f, OP_TYPE_BF16, 11, 2, &o);
    shard_core *core = f.core;
    worker w[N_SESS];
    pthread_t th[N_SESS];
    for (int i = 0; i < N_SESS; i++) {
        memset(&w[i], 0, sizeof w[i]);
        w[i].core = core;
        w[i].idx = i;
        for (int j = 0; j < N_PROMPT; j++) w[i].prompt[j] = (i * 13 + j * 7 + 1) % 97;
        assert_int_equal(pthread_create(&th[i], NULL, worker_run, &w[i]), 0);
    }
    for (int i = 0; i < N_SESS; i++) pthread_join(th[i], NULL);
    for (int i = 0; i < N_SESS; i++) {
        assert_int_equal(w[i].rc, FU_OK);
        int32_t ref[N_GEN];
        reference_greedy(f.m, f.be, w[i].prompt, N_PROMPT, ref);
        assert_memory_equal(ref, w[i].gen, sizeof ref);
    }
    shard_core_stats st;
    shard_core_get_stats(core, &st);
    assert_int_equal(st.active_sessions, 0);
    assert_true(st.kv_free_bytes == st.kv_total_bytes);
    assert_int_equal(st.batched_steps, N_SESS * N_GEN);
    /* concurrent steps were merged: fewer forwards than steps */
    assert_true(st.batches < st.batched_steps);
    assert_true(shard_core_measure(core, 2, 0.05) > 0);
    /* step timing: prompts in one sequence, decode steps over many; sizes past the context refused */
    assert_true(shard_core_time_step(core, 8, true, 0.01) >= 0);
    assert_true(shard_core_time_step(core, 4, false, 0.01) >= 0);
    assert_true(shard_core_time_step(core, 0, true, 0.01) < 0);
    assert_true(shard_core_time_step(core, 1 << 20, false, 0.01) < 0);
    shard_core_get_stats(core, &st);
    assert_true(st.kv_free_bytes == st.kv_total_bytes); /* its sequences are freed */
    fixture_close(&f);
}

static void test_chained_spans_equal_whole(void **state) {
    mdl_config cfg = test_config();
    mdl_model *whole, *a, *b;
    mdl_open_options oa = {0, 2, true, false}, ob = {2, 3, false, true};
    assert_int_equal(mdl_random(&cfg, OP_TYPE_F16, 5, NULL, &whole), FU_OK);
    assert_int_equal(mdl_random(&cfg, OP_TYPE_F16, 5, &oa, &a), FU_OK);
    assert_int_equal(mdl_random(&cfg, OP_TYPE_F16, 5, &ob, &b), FU_OK);
    op_cpu_options co = {.n_threads = 1, .isa = OP_CPU_ISA_AUTO};
    op_backend *be = op_backend_cpu_new(&co);
    shard_core *cw, *ca, *cb;
    assert_int_equal(shard_core_new(whole, be, NULL, &cw), FU_OK);
    assert_int_equal(shard_core_new(a, be, NULL, &ca), FU_OK);
    assert_int_equal(shard_core_new(b, be, NULL, &cb), FU_OK);
    shard_session *sw, *sa, *sb;
    assert_int_equal(shard_session_open(cw, "w", 32, NULL, &sw), FU_OK);
    assert_int_equal(shard_session_open(ca, "x", 32, NULL, &sa), FU_OK);
    assert_int_equal(shard_session_open(cb, "x", 32, NULL, &sb), FU_OK);
    int32_t ids[5] = {3, 1, 4, 1, 5};
    shard_step s1 = {.n = 5, .tokens = ids, .want_logits = true, .all_positions = true};
    assert_int_equal(shard_session_step(cw, sw, &s1), FU_OK);
    shard_step s2 = {.n = 5, .tokens = ids};
    assert_int_equal(shard_session_step(ca, sa, &s2), FU_OK);
    assert_non_null(s2.out_hidden);
    shard_step s3 = {.n = 5, .tokens = ids, .hidden = s2.out_hidden, .want_logits = true, .all_positions = true};
    assert_int_equal(shard_session_step(cb, sb, &s3), FU_OK);
    assert_int_equal(s3.n_out, 5);
    for (int i = 0; i < 5 * 97; i++) assert_true(fabsf(s1.out_logits[i] - s3.out_logits[i]) < 1e-5f);

    /* rollback the last two positions on both and replay: same last logits */
    float last[97];
    memcpy(last, s1.out_logits + 4 * 97, sizeof last);
    assert_int_equal(shard_session_rollback(sw, 3), FU_OK);
    shard_step s4 = {.n = 2, .start_pos = 3, .tokens = ids + 3, .want_logits = true};
    assert_int_equal(shard_session_step(cw, sw, &s4), FU_OK);
    assert_int_equal(s4.n_out, 1);
    for (int i = 0; i < 97; i++) assert_true(fabsf(s4.out_logits[i] - last[i]) < 1e-5f);

    shard_session_close(cw, sw);
    shard_session_close(ca, sa);
    shard_session_close(cb, sb);
    shard_core_free(cw);
    shard_core_free(ca);
    shard_core_free(cb);
    op_backend_free(be);
    mdl_free(whole);
    mdl_free(a);
    mdl_free(b);
}

static void test_admission_and_bad_steps(void **state) {
    fixture f;
    /* 3 layers x 2 (K, V) x 32 floats x 4 bytes = 768 bytes per position: room for 100 */
    shard_core_options o = {.kv_budget_bytes = 76800, .max_batch_tokens = 32, .kv_type = OP_TYPE_F32};
    fixture_open(&f, OP_TYPE_F32, 3, 1, &o);
    shard_core *core = f.core;
    shard_session *s1, *s2, *s3;
    assert_int_equal(shard_session_open(core, "a", 60, NULL, &s1), FU_OK);
    assert_int_equal(shard_session_open(core, "b", 60, NULL, &s2), FU_ERR_EXHAUSTED);
    assert_non_null(strstr(fu_last_error(), "KV cache full"));
    assert_int_equal(shard_session_open(core, "a", 10, NULL, &s2), FU_ERR_INVALID); /* duplicate */
    assert_int_equal(shard_session_open(core, "", 10, NULL, &s2), FU_ERR_INVALID);
    assert_int_equal(shard_session_open(core, "c", 1000, NULL, &s2), FU_ERR_RANGE); /* over the context */
    assert_int_equal(shard_session_open(core, "b", 40, NULL, &s2), FU_OK);
    shard_session_close(core, s1);
    assert_int_equal(shard_session_open(core, "c", 60, NULL, &s3), FU_OK); /* freed at once */

    int32_t ids[4] = {1, 2, 3, 200};
    shard_step bad_tok = {.n = 4, .tokens = ids};
    assert_int_equal(shard_session_step(core, s2, &bad_tok), FU_ERR_INVALID);
    shard_step bad_pos = {.n = 2, .start_pos = 5, .tokens = ids};
    assert_int_equal(shard_session_step(core, s2, &bad_pos), FU_ERR_INVALID);
    shard_step no_tok = {.n = 2};
    assert_int_equal(shard_session_step(core, s2, &no_tok), FU_ERR_INVALID);
    int32_t many[41] = {0};
    shard_step too_long = {.n = 41, .tokens = many};
    assert_int_equal(shard_session_step(core, s2, &too_long), FU_ERR_RANGE);
    shard_step bad_top = {.n = 1, .tokens = ids, .sample = true, .top_logprobs = 21};
    bad_top.sampling = smp_params_default();
    assert_int_equal(shard_session_step(core, s2, &bad_top), FU_ERR_INVALID);
    shard_step bad_temp = {.n = 1, .tokens = ids, .sample = true};
    bad_temp.sampling = smp_params_default();
    bad_temp.sampling.temperature = -1;
    assert_int_equal(shard_session_step(core, s2, &bad_temp), FU_ERR_INVALID);
    assert_int_equal(shard_session_len(s2), 0);
    shard_step ok = {.n = 3, .tokens = ids, .sample = true};
    ok.sampling = smp_params_default();
    ok.sampling.seed = 9;
    assert_int_equal(shard_session_step(core, s2, &ok), FU_OK);
    assert_int_equal(shard_session_len(s2), 3);
    assert_int_equal(shard_session_rollback(s2, 4), FU_ERR_RANGE);
    shard_session_close(core, s2);
    shard_session_close(core, s3);
    fixture_close(&f);
}

/* The step's seed is the seed of its last output row: with all_positions, row i of
 * n draws with seed - (n - 1 - i), the same token as a last-only step that ends
 * at that row's position and sends that seed. */
static void test_all_positions_row_seeds(void **state) {
    fixture f;
    fixture_open(&f, OP_TYPE_F32, 11, 1, NULL);
    shard_core *core = f.core;
    shard_session *all, *one;
    assert_int_equal(shard_session_open(core, "all", 16, NULL, &all), FU_OK);
    assert_int_equal(shard_session_open(core, "one", 16, NULL, &one), FU_OK);
    enum { N = 6 };
    const uint64_t seed = 0x5eedull;
    int32_t ids[N] = {7, 3, 90, 41, 5, 62};
    shard_step st = {.n = N, .tokens = ids, .sample = true, .all_positions = true};
    st.sampling = smp_params_default();
    st.sampling.seed = seed;
    assert_int_equal(shard_session_step(core, all, &st), FU_OK);
    assert_int_equal(st.n_out, N);
    int32_t rows[N];
    memcpy(rows, st.out_tokens, sizeof rows);
    for (int i = 0; i < N; i++) {
        assert_int_equal(shard_session_rollback(one, 0), FU_OK);
        shard_step last = {.n = i + 1, .tokens = ids, .sample = true};
        last.sampling = smp_params_default();
        last.sampling.seed = seed - (uint64_t)(N - 1 - i);
        assert_int_equal(shard_session_step(core, one, &last), FU_OK);
        assert_int_equal(last.n_out, 1);
        assert_int_equal(last.out_tokens[0], rows[i]);
    }
    shard_session_close(core, all);
    shard_session_close(core, one);
    fixture_close(&f);
}

/* A step longer than max_batch_tokens runs in chunks and computes what one forward computes:
 * the logits of every position, and a no-head span's hidden states. */
static void test_chunked_step_equals_whole(void **state) {
    fixture whole, chunked;
    shard_core_options small = {.kv_budget_bytes = 0, .max_batch_tokens = 4, .kv_type = OP_TYPE_F32};
    fixture_open(&whole, OP_TYPE_F32, 21, 1, NULL);
    fixture_open(&chunked, OP_TYPE_F32, 21, 1, &small);
    enum { N = 37 };
    int32_t ids[N];
    for (int i = 0; i < N; i++) ids[i] = (i * 13 + 5) % 97;
    shard_session *sw, *sc;
    assert_int_equal(shard_session_open(whole.core, "w", 64, NULL, &sw), FU_OK);
    assert_int_equal(shard_session_open(chunked.core, "c", 64, NULL, &sc), FU_OK);
    shard_step a = {.n = N, .tokens = ids, .want_logits = true, .all_positions = true};
    shard_step b = a;
    assert_int_equal(shard_session_step(whole.core, sw, &a), FU_OK);
    assert_int_equal(shard_session_step(chunked.core, sc, &b), FU_OK);
    assert_int_equal(b.n_out, N);
    for (int i = 0; i < N * 97; i++) assert_true(fabsf(a.out_logits[i] - b.out_logits[i]) < 1e-4f);
    shard_core_stats st;
    shard_core_get_stats(chunked.core, &st);
    assert_int_equal((int)st.batches, (N + 3) / 4);
    assert_int_equal(shard_session_len(sc), N);
    /* last-position output of a chunked step: the last row only */
    shard_step c1 = {.n = 9, .start_pos = N, .tokens = ids, .want_logits = true};
    shard_step c2 = c1;
    assert_int_equal(shard_session_step(whole.core, sw, &c1), FU_OK);
    assert_int_equal(shard_session_step(chunked.core, sc, &c2), FU_OK);
    assert_int_equal(c2.n_out, 1);
    for (int i = 0; i < 97; i++) assert_true(fabsf(c1.out_logits[i] - c2.out_logits[i]) < 1e-4f);
    shard_session_close(whole.core, sw);
    shard_session_close(chunked.core, sc);
    fixture_close(&whole);
    fixture_close(&chunked);
}

/* Scoring inputs: row i < n - 1 reports the next input token with its log-softmax and top
 * alternatives (no full-vocabulary rows needed); the last row samples as usual. */
static void test_score_inputs(void **state) {
    fixture f;
    shard_core_options small = {.kv_budget_bytes = 0, .max_batch_tokens = 5, .kv_type = OP_TYPE_F32};
    fixture_open(&f, OP_TYPE_F32, 31, 1, &small);
    enum { N = 12, K = 3 };
    int32_t ids[N];
    for (int i = 0; i < N; i++) ids[i] = (i * 29 + 3) % 97;
    shard_session *sl, *ss;
    assert_int_equal(shard_session_open(f.core, "l", 32, NULL, &sl), FU_OK);
    assert_int_equal(shard_session_open(f.core, "s", 32, NULL, &ss), FU_OK);
    shard_step lg = {.n = N, .tokens = ids, .want_logits = true, .all_positions = true};
    assert_int_equal(shard_session_step(f.core, sl, &lg), FU_OK);
    shard_step sc = {.n = N, .tokens = ids, .sample = true, .all_positions = true, .score_inputs = true,
                     .top_logprobs = K};
    sc.sampling = smp_params_default();
    sc.sampling.temperature = 0;
    assert_int_equal(shard_session_step(f.core, ss, &sc), FU_OK);
    assert_int_equal(sc.n_out, N);
    assert_null(sc.out_logits);
    for (int i = 0; i < N; i++) {
        const float *row = lg.out_logits + (size_t)i * 97;
        float mx = row[0], sum = 0;
        for (int v = 1; v < 97; v++) mx = row[v] > mx ? row[v] : mx;
        for (int v = 0; v < 97; v++) sum += expf(row[v] - mx);
        int32_t want = i < N - 1 ? ids[i + 1] : smp_argmax(row, 97);
        assert_int_equal(sc.out_tokens[i], want);
        assert_true(fabsf(sc.out_logprobs[i] - (row[want] - mx - logf(sum))) < 1e-4f);
        assert_int_equal(sc.out_top_ids[i * K], smp_argmax(row, 97));
    }
    /* full-vocabulary rows over the limit are refused before any work (97 x 4 bytes a row) */
    shard_core_options tiny = {.max_batch_tokens = 5, .kv_type = OP_TYPE_F32, .max_logits_bytes = 97 * 4 * 3};
    fixture t;
    fixture_open(&t, OP_TYPE_F32, 31, 1, &tiny);
    shard_session *st_;
    assert_int_equal(shard_session_open(t.core, "t", 32, NULL, &st_), FU_OK);
    shard_step four = {.n = 4, .tokens = ids, .want_logits = true, .all_positions = true};
    assert_int_equal(shard_session_step(t.core, st_, &four), FU_ERR_EXHAUSTED);
    assert_non_null(strstr(fu_last_error(), "logits of 4 positions"));
    four.n = 3;
    assert_int_equal(shard_session_step(t.core, st_, &four), FU_OK);
    shard_session_close(t.core, st_);
    fixture_close(&t);
    shard_step bad = {.n = 2, .start_pos = N, .tokens = ids, .sample = true, .score_inputs = true};
    bad.sampling = smp_params_default();
    assert_int_equal(shard_session_step(f.core, ss, &bad), FU_ERR_INVALID); /* needs all_positions */
    shard_session_close(f.core, sl);
    shard_session_close(f.core, ss);
    fixture_close(&f);
}

typedef struct long_step {
    shard_core *core;
    shard_session *s;
    shard_step st;
    int32_t ids[120];
    bool cancel;
    int rc;
    _Atomic int finished;
} long_step;

static bool long_step_cancelled(void *arg) { return ((long_step *)arg)->cancel; }

static void *long_step_run(void *arg) {
    long_step *l = arg;
    l->rc = shard_session_step(l->core, l->s, &l->st);
    l->finished = 1;
    return NULL;
}

/* Starts a 120-position step of session `id` in chunks of one position on its own thread, and
 * waits until its first chunk has run. */
static void long_step_start(long_step *l, shard_core *core, const char *id, bool cancel, pthread_t *t) {
    memset(l, 0, sizeof *l);
    l->core = core;
    l->cancel = cancel;
    for (int i = 0; i < 120; i++) l->ids[i] = i % 97;
    assert_int_equal(shard_session_open(core, id, 128, NULL, &l->s), FU_OK);
    l->st = (shard_step){.n = 120, .tokens = l->ids, .want_logits = true, .cancelled = long_step_cancelled,
                         .cancel_arg = l};
    shard_core_stats before, now;
    shard_core_get_stats(core, &before);
    assert_int_equal(pthread_create(t, NULL, long_step_run, l), 0);
    do shard_core_get_stats(core, &now);
    while (now.batches == before.batches && !l->finished);
}

/* A session's short step is answered between the chunks of another's long prefill; a step
 * whose client goes away stops after the chunk in flight and leaves its session as it was. */
static void test_prefill_interleaves_and_cancels(void **state) {
    fixture f;
    shard_core_options one = {.kv_budget_bytes = 0, .max_batch_tokens = 1, .kv_type = OP_TYPE_F32};
    fixture_open(&f, OP_TYPE_F32, 41, 1, &one);
    shard_session *quick;
    assert_int_equal(shard_session_open(f.core, "quick", 128, NULL, &quick), FU_OK);
    int interleaved = 0, cancelled = 0;
    for (int round = 0; round < 20 && (!interleaved || !cancelled); round++) {
        long_step l;
        pthread_t t;
        long_step_start(&l, f.core, "long", false, &t);
        int32_t tok = 7;
        shard_step q = {.n = 1, .start_pos = shard_session_len(quick), .tokens = &tok, .want_logits = true};
        assert_int_equal(shard_session_step(f.core, quick, &q), FU_OK);
        interleaved += !l.finished;
        pthread_join(t, NULL);
        assert_int_equal(l.rc, FU_OK);
        assert_int_equal(shard_session_len(l.s), 120);
        shard_session_close(f.core, l.s);
        assert_int_equal(shard_session_rollback(quick, 0), FU_OK);

        long_step_start(&l, f.core, "gone", true, &t);
        pthread_join(t, NULL);
        if (l.rc == FU_ERR_CANCELLED) {
            cancelled++;
            assert_int_equal(shard_session_len(l.s), 0);
        } else {
            assert_int_equal(l.rc, FU_OK);
        }
        shard_session_close(f.core, l.s);
    }
    assert_true(interleaved > 0);
    assert_true(cancelled > 0);
    shard_session_close(f.core, quick);
    fixture_close(&f);
}

/* shard_core_wait_idle returns at once on an idle core; on a busy one it returns only once the
 * batcher has no step queued or computing (a long prefill's chunks keep it busy to the last). */
static void test_wait_idle(void **state) {
    (void)state;
    fixture f;
    shard_core_options one = {.kv_budget_bytes = 0, .max_batch_tokens = 1, .kv_type = OP_TYPE_F32};
    fixture_open(&f, OP_TYPE_F32, 43, 1, &one);
    assert_int_equal(shard_core_wait_idle(f.core, 1000000), 0);
    int waited = 0;
    for (int round = 0; round < 200 && !waited; round++) { /* a busy machine may run all 120 chunks first */
        long_step l;
        pthread_t t;
        long_step_start(&l, f.core, "long", false, &t);
        int64_t us = shard_core_wait_idle(f.core, 10000000);
        assert_true(us >= 0 && us < 10000000);
        if (us > 0) {
            waited++;
            assert_int_equal(shard_session_len(l.s), 120); /* every chunk ran first */
        }
        pthread_join(t, NULL);
        assert_int_equal(l.rc, FU_OK);
        shard_session_close(f.core, l.s);
    }
    assert_true(waited > 0);
    shard_core_stats st;
    shard_core_get_stats(f.core, &st);
    assert_int_equal(st.train_waits, (uint64_t)waited);
    fixture_close(&f);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_concurrent_sessions_batch_and_match),
        cmocka_unit_test(test_chained_spans_equal_whole),
        cmocka_unit_test(test_admission_and_bad_steps),
        cmocka_unit_test(test_all_positions_row_seeds),
        cmocka_unit_test(test_chunked_step_equals_whole),
        cmocka_unit_test(test_score_inputs),
        cmocka_unit_test(test_prefill_interleaves_and_cancels),
        cmocka_unit_test(test_wait_idle),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
