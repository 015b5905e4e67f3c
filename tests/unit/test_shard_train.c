/* test_shard_train.c -- fusion.Train on a shard server in one process: a real server on loopback
 * with a random-weight span and a real client. A job trains (forward, backward, norm, step) and
 * its state round-trips; every kind of bad request is refused with a clear status and leaves
 * the job usable; a job over the server's training budget, a second job of the same id and a
 * rank over the limit are refused; a job left idle past its timeout is gone. A job that yields to
 * inference (--train-priority inference) while sessions step on the core, waiting for the batcher
 * between its passes, computes the same loss, gradients and weights, bit for bit, as a job that
 * does not yield, on a server without sessions. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "clock.h"
#include "model.h"
#include "rpc.h"
#include "shard-core.h"
#include "shard-rpc.h"
#include "status.h"
#include "test-shard.h"
#include "train-svc.h"
#include "wire.h"

#define SECRET "unit-secret"
#define D 64
#define T 6

typedef shard_fixture fixture;

/* A server for blocks [1, 3) of a 3-block random llama (hidden states in, no head). */
static void start(fixture *f, uint64_t budget) {
    mdl_config c = {.arch = MDL_ARCH_LLAMA, .n_layers = 3, .dim = D, .ffn_dim = 96, .n_heads = 4, .n_kv_heads = 2,
                    .head_dim = 16, .vocab_size = 50, .max_seq_len = 32, .norm_eps = 1e-5f, .rope_theta = 1e4f};
    shard_server_config sc = {.listen = "127.0.0.1:0", .allow_insecure = true, .secret = SECRET, .n_workers = 2,
                              .train_budget_bytes = budget, .max_lora_rank = 8};
    shard_fixture_start(f, &c, (mdl_open_options){1, 3, false, false}, 1u << 20, &sc);
}

/* A server for blocks [1, 3) with the LM head, whose jobs train with priority `prio`. */
static void start_head(fixture *f, shard_train_priority prio) {
    mdl_config c = {.arch = MDL_ARCH_LLAMA, .n_layers = 3, .dim = D, .ffn_dim = 96, .n_heads = 4, .n_kv_heads = 2,
                    .head_dim = 16, .vocab_size = 50, .max_seq_len = 32, .norm_eps = 1e-5f, .rope_theta = 1e4f};
    shard_server_config sc = {.listen = "127.0.0.1:0", .allow_insecure = true, .secret = SECRET, .n_workers = 2,
                              .max_lora_rank = 8, .train_priority = prio};
    shard_fixture_start(f, &c, (mdl_open_options){1, 3, false, true}, 1u << 20, &sc);
}

static void stop(fixture *f) { shard_fixture_stop(f); }

static const char *const all_targets[] = {"all-linear"};
static const train_svc_lora lora4 = {4, 8.0f, 0.0f, false, all_targets, 1, 3};

static train_svc_open open_req(const char *id) {
    return (train_svc_open){id, 1, 3, &lora4, NULL, 16, 2, false, 0};
}

/* Asserts a call's code and that its message holds `text`. */
static void expect(int code, int want, const rpc_status *st, const char *text) {
    if (code != want || (text && !strstr(st->message, text)))
        fail_msg("got %s (%s), want %s with \"%s\"", rpc_code_str(code), st->message, rpc_code_str(want),
                 text ? text : "");
}

/* Hidden states (rows, D) as an F32 tensor over buf. */
static wire_tensor hidden(float *buf, int64_t *shape, int rows, int cols, float value) {
    for (int i = 0; i < rows * cols; i++) buf[i] = value * (float)((i % 13) - 6);
    shape[0] = rows;
    shape[1] = cols;
    return (wire_tensor){.dtype = WIRE_F32, .n_shape = 2, .shape = shape, .data = (const uint8_t *)buf,
                         .data_len = (size_t)rows * (size_t)cols * 4};
}

static const int32_t first[T] = {0, 0, 0, 3, 3, 3};

/* Forward of T rows on slot 0 of job `id`. */
static int forward(fixture *f, const char *id, const wire_tensor *h, const int32_t *fst, size_t n_first, rpc_status *st) {
    shard_svc_input in = {NULL, 0, h};
    train_svc_forward req = {id, 0, &in, fst, n_first, NULL, 0, 0.0f, 1, WIRE_F32};
    const train_svc_forward_reply *rep;
    train_svc_reply *held = NULL;
    int code = train_svc_call_forward(f->ch, &req, 10000, &rep, &held, st);
    if (!code) assert_true(rep->hidden && rep->hidden->shape[0] == T && rep->hidden->shape[1] == D);
    train_svc_reply_free(held);
    return code;
}

static int backward(fixture *f, const char *id, const wire_tensor *g, rpc_status *st) {
    train_svc_backward req = {id, 0, g, true, WIRE_F32};
    const train_svc_backward_reply *rep;
    train_svc_reply *held = NULL;
    int code = train_svc_call_backward(f->ch, &req, 10000, &rep, &held, st);
    if (!code) assert_true(rep->grad && rep->grad->shape[0] == T);
    train_svc_reply_free(held);
    return code;
}

static void test_job_trains(void **state) {
    (void)state;
    fixture f;
    start(&f, 0);
    rpc_status st = {0};
    train_svc_open o = open_req("job-a");
    train_svc_opened opened = {0};
    expect(train_svc_call_open(f.ch, &o, 10000, &opened, &st), RPC_OK, &st, NULL);
    assert_true(opened.n_params > 0 && opened.bytes > 0);
    float hb[T * D], gb[T * D];
    int64_t hs[2], gs[2];
    wire_tensor h = hidden(hb, hs, T, D, 0.1f), g = hidden(gb, gs, T, D, 0.01f);
    expect(forward(&f, "job-a", &h, first, T, &st), RPC_OK, &st, NULL);
    expect(backward(&f, "job-a", &g, &st), RPC_OK, &st, NULL);
    double sq = 0;
    expect(train_svc_call_norm(f.ch, "job-a", 10000, &sq, &st), RPC_OK, &st, NULL);
    assert_true(sq > 0 && isfinite(sq));
    train_svc_step step = {"job-a", 1, 1e-3f, 1.0f, 0.9f, 0.999f, 1e-8f, 0.0f, false};
    expect(train_svc_call_step(f.ch, &step, 10000, &st), RPC_OK, &st, NULL);
    const train_svc_state *s1;
    train_svc_reply *held = NULL;
    expect(train_svc_call_get_state(f.ch, "job-a", 10000, &s1, &held, &st), RPC_OK, &st, NULL);
    assert_true(s1->first_block == 1 && s1->last_block == 3 && s1->params->shape[0] == opened.n_params);
    expect(train_svc_call_put_state(f.ch, "job-a", s1, 10000, &st), RPC_OK, &st, NULL);
    train_svc_reply_free(held);
    expect(train_svc_call_close(f.ch, "job-a", 10000, &st), RPC_OK, &st, NULL);
    expect(train_svc_call_norm(f.ch, "job-a", 10000, &sq, &st), RPC_NOT_FOUND, &st, "no training job 'job-a'");
    stop(&f);
}

static void test_bad_requests(void **state) {
    (void)state;
    fixture f;
    start(&f, 0);
    rpc_status st = {0};
    train_svc_open o = open_req("job-b");
    train_svc_opened opened;
    o.first_block = 0;
    expect(train_svc_call_open(f.ch, &o, 10000, &opened, &st), RPC_FAILED_PRECONDITION, &st, "holds [1, 3)");
    o = open_req("job-b");
    train_svc_lora big = lora4;
    big.r = 16;
    o.lora = &big;
    expect(train_svc_call_open(f.ch, &o, 10000, &opened, &st), RPC_INVALID_ARGUMENT, &st, "lora.r: 16 outside [1, 8]");
    const char *const bogus[] = {"qkv_proj"};
    train_svc_lora bad_t = lora4;
    bad_t.targets = bogus;
    o.lora = &bad_t;
    expect(train_svc_call_open(f.ch, &o, 10000, &opened, &st), RPC_INVALID_ARGUMENT, &st, "unknown module 'qkv_proj'");
    o = open_req("job-b");
    o.max_tokens = 0;
    expect(train_svc_call_open(f.ch, &o, 10000, &opened, &st), RPC_OUT_OF_RANGE, &st, "max_tokens");
    o = open_req("job-b");
    expect(train_svc_call_open(f.ch, &o, 10000, &opened, &st), RPC_OK, &st, NULL);
    expect(train_svc_call_open(f.ch, &o, 10000, &opened, &st), RPC_ALREADY_EXISTS, &st, "already open");

    float hb[T * D], wb[T * D]; /* wb: the (T, 32) tensor, then a (T - 1, D) one */
    int64_t hs[2], ws[2];
    wire_tensor h = hidden(hb, hs, T, D, 0.1f), wrong = hidden(wb, ws, T, 32, 0.1f);
    int32_t bad_first[T] = {0, 0, 1, 3, 3, 3};
    expect(forward(&f, "nobody", &h, first, T, &st), RPC_NOT_FOUND, &st, "no training job");
    expect(forward(&f, "job-b", &wrong, first, T, &st), RPC_INVALID_ARGUMENT, &st, "input.hidden: shape");
    expect(forward(&f, "job-b", &h, first, T - 1, &st), RPC_INVALID_ARGUMENT, &st, "first: 5 entries for 6 rows");
    expect(forward(&f, "job-b", &h, bad_first, T, &st), RPC_OUT_OF_RANGE, &st, "starts its example");
    hb[7] = NAN;
    expect(forward(&f, "job-b", &h, first, T, &st), RPC_INVALID_ARGUMENT, &st, NULL);
    hb[7] = 0.5f;
    expect(backward(&f, "job-b", &h, &st), RPC_FAILED_PRECONDITION, &st, "holds no forward");
    expect(forward(&f, "job-b", &h, first, T, &st), RPC_OK, &st, NULL);
    wire_tensor short_g = hidden(wb, ws, T - 1, D, 0.01f);
    expect(backward(&f, "job-b", &short_g, &st), RPC_INVALID_ARGUMENT, &st, "grad: 5 rows, the forward had 6");
    expect(backward(&f, "job-b", &h, &st), RPC_FAILED_PRECONDITION, &st, "holds no forward"); /* dropped */
    train_svc_step step = {"job-b", 1, NAN, 1.0f, 0.9f, 0.999f, 1e-8f, 0.0f, false};
    expect(train_svc_call_step(f.ch, &step, 10000, &st), RPC_INVALID_ARGUMENT, &st, "lr");
    step.lr = 1e-3f, step.step = 0;
    expect(train_svc_call_step(f.ch, &step, 10000, &st), RPC_INVALID_ARGUMENT, &st, "steps count from 1");
    expect(forward(&f, "job-b", &h, first, T, &st), RPC_OK, &st, NULL); /* still usable */
    stop(&f);
}

static void test_limits_and_idle(void **state) {
    (void)state;
    fixture f;
    start(&f, 4u << 20);
    rpc_status st = {0};
    train_svc_open o = open_req("job-big");
    train_svc_opened opened;
    o.max_tokens = 4096;
    o.slots = 8;
    expect(train_svc_call_open(f.ch, &o, 10000, &opened, &st), RPC_RESOURCE_EXHAUSTED, &st, "over the budget of");
    o = open_req("job-idle");
    o.idle_timeout_ms = 100;
    expect(train_svc_call_open(f.ch, &o, 10000, &opened, &st), RPC_OK, &st, NULL);
    fu_sleep_ms(300);
    double sq;
    expect(train_svc_call_norm(f.ch, "job-idle", 10000, &sq, &st), RPC_NOT_FOUND, &st, "no training job");
    stop(&f);
}

/* ---- priority: training yields to inference, and computes the same ---------------------- */

#define STEPS 2
#define SESSION_ROWS 16

/* What a job computed over STEPS steps: losses, input gradients, norms and its final state. */
typedef struct job_result {
    double loss[STEPS], sqnorm[STEPS];
    float dx[STEPS][T * D];
    float *state; /* params, moment1, moment2: 3 x n */
    int64_t n;
} job_result;

/* Steps a session of the core over and over (prefills of SESSION_ROWS rows, rolled back) until
 * told to stop; `rc` is the first failure (cmocka's asserts belong to the test's thread). */
typedef struct session_load {
    shard_core *core;
    atomic_bool stop;
    atomic_int steps;
    int rc;
    float h[SESSION_ROWS * D];
} session_load;

static void *session_loop(void *arg) {
    session_load *l = arg;
    shard_session *s = NULL;
    for (int i = 0; i < SESSION_ROWS * D; i++) l->h[i] = 0.05f * (float)((i % 11) - 5);
    l->rc = shard_session_open(l->core, "load", 32, NULL, &s);
    while (!l->rc && !atomic_load(&l->stop)) {
        shard_step st = {.n = SESSION_ROWS, .start_pos = 0, .hidden = l->h};
        if (!(l->rc = shard_session_step(l->core, s, &st))) l->rc = shard_session_rollback(s, 0);
        atomic_fetch_add(&l->steps, 1); /* and at once the next: the batcher is rarely idle */
    }
    shard_session_close(l->core, s);
    return NULL;
}

/* Copies an F32 tensor's n floats into out. */
static void tensor_floats(const wire_tensor *t, float *out, size_t n) {
    assert_true(t && t->dtype == WIRE_F32 && t->data_len == n * sizeof(float));
    memcpy(out, t->data, n * sizeof(float));
}

/* Forward and backward of one micro-batch at the head (slot 0), then the norm and an AdamW step. */
static void job_step(fixture *f, int k, job_result *r) {
    static const int32_t targets[T] = {3, 7, -1, 11, 2, -1};
    float hb[T * D];
    int64_t hs[2];
    wire_tensor h = hidden(hb, hs, T, D, 0.1f + 0.05f * (float)k);
    shard_svc_input in = {NULL, 0, &h};
    train_svc_forward fr = {"job-p", 0, &in, first, T, targets, T, 0.25f, 9, WIRE_F32};
    const train_svc_forward_reply *frep;
    const train_svc_backward_reply *brep;
    train_svc_reply *held = NULL;
    rpc_status st = {0};
    expect(train_svc_call_forward(f->ch, &fr, 10000, &frep, &held, &st), RPC_OK, &st, NULL);
    r->loss[k] = frep->loss_sum;
    assert_true(frep->n_tokens == 4 && isfinite(r->loss[k]));
    train_svc_reply_free(held);
    train_svc_backward br = {"job-p", 0, NULL, true, WIRE_F32};
    expect(train_svc_call_backward(f->ch, &br, 10000, &brep, &held, &st), RPC_OK, &st, NULL);
    tensor_floats(brep->grad, r->dx[k], T * D);
    train_svc_reply_free(held);
    expect(train_svc_call_norm(f->ch, "job-p", 10000, &r->sqnorm[k], &st), RPC_OK, &st, NULL);
    train_svc_step step = {"job-p", k + 1, 1e-2f, 1.0f, 0.9f, 0.999f, 1e-8f, 0.01f, false};
    expect(train_svc_call_step(f->ch, &step, 10000, &st), RPC_OK, &st, NULL);
}

/* Trains job-p for STEPS steps on a fresh server with priority prio, with a session stepping
 * meanwhile or not; *waits: the times the job waited for the batcher. */
static void run_job(shard_train_priority prio, bool sessions, job_result *r, uint64_t *waits) {
    fixture f;
    start_head(&f, prio);
    rpc_status st = {0};
    train_svc_open o = open_req("job-p");
    train_svc_opened opened;
    expect(train_svc_call_open(f.ch, &o, 10000, &opened, &st), RPC_OK, &st, NULL);
    session_load load = {.core = f.core};
    pthread_t th;
    if (sessions) {
        assert_int_equal(pthread_create(&th, NULL, session_loop, &load), 0);
        for (int i = 0; i < 5000 && atomic_load(&load.steps) < 2; i++) fu_sleep_ms(1);
    }
    for (int k = 0; k < STEPS; k++) job_step(&f, k, r);
    if (sessions) {
        atomic_store(&load.stop, true);
        pthread_join(th, NULL);
        assert_int_equal(load.rc, FU_OK);
    }
    const train_svc_state *s;
    train_svc_reply *held = NULL;
    expect(train_svc_call_get_state(f.ch, "job-p", 10000, &s, &held, &st), RPC_OK, &st, NULL);
    r->n = opened.n_params;
    r->state = malloc(3 * (size_t)r->n * sizeof(float));
    assert_non_null(r->state);
    tensor_floats(s->params, r->state, (size_t)r->n);
    tensor_floats(s->moment1, r->state + r->n, (size_t)r->n);
    tensor_floats(s->moment2, r->state + 2 * r->n, (size_t)r->n);
    train_svc_reply_free(held);
    shard_core_stats cs;
    shard_core_get_stats(f.core, &cs);
    *waits = cs.train_waits;
    stop(&f);
}

static void test_priority_same_results(void **state) {
    (void)state;
    job_result yielding = {0}, fair = {0};
    uint64_t waits_yielding = 0, waits_fair = 0;
    run_job(SHARD_TRAIN_PRIORITY_INFERENCE, true, &yielding, &waits_yielding);
    run_job(SHARD_TRAIN_PRIORITY_FAIR, false, &fair, &waits_fair);
    if (waits_yielding == 0) fail_msg("the job never waited for the batcher while a session stepped");
    assert_int_equal(waits_fair, 0);
    assert_int_equal(yielding.n, fair.n);
    for (int k = 0; k < STEPS; k++) {
        assert_memory_equal(&yielding.loss[k], &fair.loss[k], sizeof(double));
        assert_memory_equal(&yielding.sqnorm[k], &fair.sqnorm[k], sizeof(double));
        assert_memory_equal(yielding.dx[k], fair.dx[k], sizeof fair.dx[k]);
    }
    assert_memory_equal(yielding.state, fair.state, 3 * (size_t)fair.n * sizeof(float));
    free(yielding.state);
    free(fair.state);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_job_trains),
        cmocka_unit_test(test_bad_requests),
        cmocka_unit_test(test_limits_and_idle),
        cmocka_unit_test(test_priority_same_results),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
