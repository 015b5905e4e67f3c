/* test_train_svc.c -- the typed Train service (train-svc.h) over a real server on 127.0.0.1:0.
 *
 * Fake handlers check every field they receive against the values the test sends (a mismatch
 * answers FAILED_PRECONDITION naming the check) and reply with known values, which the test
 * checks on the client's views: every method end to end, F32 and BF16 tensors with shapes,
 * adapter states with their moments, LoRA specs with target names, negative targets. A job named
 * "missing" fails every method with NOT_FOUND; done() is counted against the successful calls
 * that hold a reply. Requests the views cannot carry (int32 overflows, bad job ids, names) are
 * sent as generated messages with out-of-range values (or written by hand) and must be refused
 * with INVALID_ARGUMENT naming the field, and train_svc_request_check must give the same verdict
 * for the same bytes; requests that pass go to the job "missing", whose NOT_FOUND shows that the
 * handler got them.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fusion.pb-c.h"
#include "rpc.h"
#include "status.h"
#include "test-pb.h"
#include "train-svc.h"

#define SECRET "test-train-secret-0123456789"
#define WAIT_MS 5000

/* ---- the values sent and answered --------------------------------------------------------- */

static const float g_f32_vals[6] = {1.5f, -2.0f, 0.25f, 3.0f, -0.5f, 8.0f};
static const int64_t g_f32_shape[1] = {6};
static const wire_tensor g_f32 = {WIRE_F32, 1, g_f32_shape, (const uint8_t *)g_f32_vals, sizeof g_f32_vals,
                                  NULL, 0, 0, 0};
static const uint16_t g_bf16_vals[12] = {0x3f80, 0xbf80, 0x4000, 0, 1, 2, 3, 4, 0x7f7f, 0xff7f, 0x3e80, 0x4040};
static const int64_t g_bf16_shape[2] = {3, 4};
static const wire_tensor g_bf16 = {WIRE_BF16, 2, g_bf16_shape, (const uint8_t *)g_bf16_vals, sizeof g_bf16_vals,
                                   NULL, 0, 0, 0};
static const float g_m1_vals[6] = {0.1f, 0.2f, 0.3f, 0.4f, 0.5f, 0.6f};
static const wire_tensor g_m1 = {WIRE_F32, 1, g_f32_shape, (const uint8_t *)g_m1_vals, sizeof g_m1_vals,
                                 NULL, 0, 0, 0};

static const char *const g_targets[2] = {"q_proj", "v_proj"};
static const train_svc_lora g_lora = {8, 16.0f, 0.05f, true, g_targets, 2, 7};
static const char *const g_all[1] = {"all-linear"};
static const train_svc_lora g_lora_all = {4, 8.0f, 0.0f, false, g_all, 1, 123456789012345ull};
static const train_svc_state g_state = {2, 5, &g_lora, &g_f32, &g_m1, NULL};
static const train_svc_state g_state_back = {2, 5, &g_lora_all, &g_f32, &g_m1, &g_m1};

static const int32_t g_tokens[3] = {0, 5, INT32_MAX};
static const int32_t g_first[3] = {0, 0, 2};
static const int32_t g_tgt[3] = {5, -1, INT32_MIN};

/* ---- comparisons -------------------------------------------------------------------------- */

/* Whether two tensors (either may be NULL) hold the same dtype, shape and bytes. */
static bool tensor_eq(const wire_tensor *a, const wire_tensor *b) {
    if (!a || !b) return a == b;
    return a->dtype == b->dtype && a->n_shape == b->n_shape &&
           !memcmp(a->shape, b->shape, a->n_shape * sizeof *a->shape) && a->data_len == b->data_len &&
           !memcmp(a->data, b->data, a->data_len) && a->scales_len == b->scales_len &&
           a->block_size == b->block_size && a->scale_dtype == b->scale_dtype;
}

/* Whether two LoRA specs (either may be NULL) are the same. */
static bool lora_eq(const train_svc_lora *a, const train_svc_lora *b) {
    if (!a || !b) return a == b;
    if (a->r != b->r || a->alpha != b->alpha || a->dropout != b->dropout || a->use_rslora != b->use_rslora ||
        a->n_targets != b->n_targets || a->init_seed != b->init_seed)
        return false;
    for (size_t i = 0; i < a->n_targets; i++)
        if (strcmp(a->targets[i], b->targets[i])) return false;
    return true;
}

/* Whether two adapter states (either may be NULL) are the same. */
static bool state_eq(const train_svc_state *a, const train_svc_state *b) {
    if (!a || !b) return a == b;
    return a->first_block == b->first_block && a->last_block == b->last_block && lora_eq(a->lora, b->lora) &&
           tensor_eq(a->params, b->params) && tensor_eq(a->moment1, b->moment1) && tensor_eq(a->moment2, b->moment2);
}

/* ---- the fake handlers -------------------------------------------------------------------- */

static atomic_int g_done;  /* done() calls */
static atomic_int g_holds; /* successful calls whose handler holds the reply */

#define TT_CHECK(c)                                                                     \
    do {                                                                                \
        if (!(c)) return rpc_status_setf(st, RPC_FAILED_PRECONDITION, "check: %s", #c); \
    } while (0)

/* NOT_FOUND for the job "missing"; RPC_OK otherwise. */
static int tt_known(const char *job_id, rpc_status *st) {
    if (!strcmp(job_id, "missing")) return rpc_status_setf(st, RPC_NOT_FOUND, "no job %s", job_id);
    return RPC_OK;
}

/* A hold for a successful call: a malloc()ed byte that done frees (a leak or a double free shows
 * under the sanitizers). */
static void *tt_hold(void) {
    atomic_fetch_add(&g_holds, 1);
    return malloc(1);
}

static int tt_open(void *ctx, const train_svc_open *req, train_svc_opened *reply, void **hold, rpc_status *st) {
    (void)ctx;
    int rc = tt_known(req->job_id, st);
    if (rc) return rc;
    TT_CHECK(!reply->job_id && !reply->n_params && !reply->bytes); /* zeroed */
    TT_CHECK(req->first_block == 2 && req->last_block == 5 && req->max_tokens == 64 && req->slots == 2);
    TT_CHECK(req->idle_timeout_ms == -1 && req->keep_activations);
    if (!strcmp(req->job_id, "bare")) {
        TT_CHECK(!req->lora && !req->state);
    } else {
        TT_CHECK(!strcmp(req->job_id, "job-1") && lora_eq(req->lora, &g_lora) && state_eq(req->state, &g_state));
    }
    *reply = (train_svc_opened){"job-1", 6, INT64_MAX};
    *hold = tt_hold();
    return RPC_OK;
}

static int tt_forward(void *ctx, const train_svc_forward *req, train_svc_forward_reply *reply, void **hold,
                      rpc_status *st) {
    (void)ctx;
    int rc = tt_known(req->job_id, st);
    if (rc) return rc;
    TT_CHECK(req->input && req->n_first == 3 && !memcmp(req->first, g_first, sizeof g_first));
    TT_CHECK(req->n_targets == 3 && !memcmp(req->targets, g_tgt, sizeof g_tgt));
    TT_CHECK(req->loss_scale == 0.5f && req->seed == UINT64_MAX && req->wire_dtype == WIRE_F32);
    if (req->slot == 1) { /* the first span: tokens */
        TT_CHECK(req->input->n_tokens == 3 && !memcmp(req->input->tokens, g_tokens, sizeof g_tokens));
        TT_CHECK(!req->input->hidden);
        *reply = (train_svc_forward_reply){&g_f32, 0, 0, 0};
    } else { /* the head: hidden states */
        TT_CHECK(req->slot == 0 && !req->input->n_tokens && tensor_eq(req->input->hidden, &g_bf16));
        *reply = (train_svc_forward_reply){NULL, 1.25, 2, -1};
    }
    *hold = tt_hold();
    return RPC_OK;
}

static int tt_backward(void *ctx, const train_svc_backward *req, train_svc_backward_reply *reply, void **hold,
                       rpc_status *st) {
    (void)ctx;
    int rc = tt_known(req->job_id, st);
    if (rc) return rc;
    TT_CHECK(req->slot == INT32_MAX && req->wire_dtype == WIRE_BF16);
    TT_CHECK(req->want_input_grad ? tensor_eq(req->grad, &g_bf16) : !req->grad);
    reply->grad = req->want_input_grad ? &g_bf16 : NULL;
    *hold = tt_hold();
    return RPC_OK;
}

static int tt_norm(void *ctx, const char *job_id, double *sqnorm, rpc_status *st) {
    (void)ctx;
    int rc = tt_known(job_id, st);
    if (rc) return rc;
    TT_CHECK(!strcmp(job_id, "job-1"));
    *sqnorm = 2.5e10;
    return RPC_OK;
}

static int tt_step(void *ctx, const train_svc_step *req, rpc_status *st) {
    (void)ctx;
    int rc = tt_known(req->job_id, st);
    if (rc) return rc;
    TT_CHECK(!strcmp(req->job_id, "job-1") && req->step == INT64_MAX && req->lr == 1e-4f);
    TT_CHECK(req->grad_scale == 0.5f && req->beta1 == 0.9f && req->beta2 == 0.999f && req->eps == 1e-8f);
    TT_CHECK(req->weight_decay == 0.01f && req->discard);
    return RPC_OK;
}

static int tt_get_state(void *ctx, const char *job_id, train_svc_state *reply, void **hold, rpc_status *st) {
    (void)ctx;
    int rc = tt_known(job_id, st);
    if (rc) return rc;
    TT_CHECK(!strcmp(job_id, "job-1") && state_eq(reply, &(train_svc_state){0}));
    *reply = g_state_back;
    *hold = tt_hold();
    return RPC_OK;
}

static int tt_put_state(void *ctx, const char *job_id, const train_svc_state *state, rpc_status *st) {
    (void)ctx;
    int rc = tt_known(job_id, st);
    if (rc) return rc;
    TT_CHECK(!strcmp(job_id, "job-1") ? state_eq(state, &g_state_back) : !state);
    return RPC_OK;
}

static int tt_close(void *ctx, const char *job_id, rpc_status *st) {
    (void)ctx;
    if (!strcmp(job_id, "busy")) return rpc_status_setf(st, RPC_FAILED_PRECONDITION, "job busy is stepping");
    return tt_known(job_id, st);
}

static void tt_done(void *ctx, void *hold) {
    (void)ctx;
    free(hold);
    atomic_fetch_add(&g_done, 1);
}

static const train_svc_handlers tt_handlers = {NULL,        tt_open,      tt_forward,   tt_backward, tt_norm,
                                               tt_step,     tt_get_state, tt_put_state, tt_close,    tt_done};

/* ---- the server --------------------------------------------------------------------------- */

static rpc_server *g_srv;
static rpc_channel *g_ch;

/* A server on 127.0.0.1:0 with the Train service of handlers h, and a channel to it. */
static void serve(const train_svc_handlers *h, rpc_server **srv, rpc_channel **ch) {
    rpc_server_options so = {.address = "127.0.0.1:0", .secret = SECRET, .allow_insecure = true, .n_workers = 2};
    assert_int_equal(rpc_server_new(&so, srv), FU_OK);
    assert_int_equal(train_svc_serve(*srv, h), FU_OK);
    assert_int_equal(rpc_server_start(*srv), FU_OK);
    char target[64];
    snprintf(target, sizeof target, "127.0.0.1:%d", rpc_server_port(*srv));
    rpc_channel_options co = {.insecure = true, .secret = SECRET};
    assert_int_equal(rpc_channel_new(target, &co, ch), FU_OK);
}

static int setup(void **state) {
    (void)state;
    serve(&tt_handlers, &g_srv, &g_ch);
    return 0;
}

static int teardown(void **state) {
    (void)state;
    rpc_channel_free(g_ch);
    rpc_server_free(g_srv);
    return 0;
}

/* Fails the test with the status unless rc is RPC_OK. */
static void ok(int rc, const rpc_status *st, const char *what) {
    if (rc) fail_msg("%s: %s: %s", what, rpc_code_str(rc), st->message);
}

/* ---- every method end to end -------------------------------------------------------------- */

static void test_open(void **state) {
    (void)state;
    rpc_status st;
    train_svc_opened out;
    train_svc_open req = {"job-1", 2, 5, &g_lora, &g_state, 64, 2, true, -1};
    ok(train_svc_call_open(g_ch, &req, WAIT_MS, &out, &st), &st, "open");
    assert_null(out.job_id); /* not held */
    assert_int_equal(out.n_params, 6);
    assert_true(out.bytes == INT64_MAX);
    req = (train_svc_open){"bare", 2, 5, NULL, NULL, 64, 2, true, -1};
    ok(train_svc_call_open(g_ch, &req, WAIT_MS, &out, &st), &st, "open bare");
}

static void test_forward(void **state) {
    (void)state;
    rpc_status st;
    const train_svc_forward_reply *rep;
    train_svc_reply *held;
    shard_svc_input in = {g_tokens, 3, NULL};
    train_svc_forward req = {"job-1", 1, &in, g_first, 3, g_tgt, 3, 0.5f, UINT64_MAX, WIRE_F32};
    ok(train_svc_call_forward(g_ch, &req, WAIT_MS, &rep, &held, &st), &st, "forward");
    assert_true(tensor_eq(rep->hidden, &g_f32));
    assert_true(rep->loss_sum == 0 && rep->n_tokens == 0 && rep->n_correct == 0);
    train_svc_reply_free(held);
    in = (shard_svc_input){NULL, 0, &g_bf16};
    req.slot = 0;
    ok(train_svc_call_forward(g_ch, &req, WAIT_MS, &rep, &held, &st), &st, "forward at the head");
    assert_null(rep->hidden);
    assert_true(rep->loss_sum == 1.25 && rep->n_tokens == 2 && rep->n_correct == -1);
    train_svc_reply_free(held);
}

static void test_backward(void **state) {
    (void)state;
    rpc_status st;
    const train_svc_backward_reply *rep;
    train_svc_reply *held;
    train_svc_backward req = {"job-1", INT32_MAX, &g_bf16, true, WIRE_BF16};
    ok(train_svc_call_backward(g_ch, &req, WAIT_MS, &rep, &held, &st), &st, "backward");
    assert_true(tensor_eq(rep->grad, &g_bf16));
    train_svc_reply_free(held);
    req = (train_svc_backward){"job-1", INT32_MAX, NULL, false, WIRE_BF16};
    ok(train_svc_call_backward(g_ch, &req, WAIT_MS, &rep, &held, &st), &st, "backward at the first span");
    assert_null(rep->grad);
    train_svc_reply_free(held);
}

static void test_norm_step_close(void **state) {
    (void)state;
    rpc_status st;
    double sq = 0;
    ok(train_svc_call_norm(g_ch, "job-1", WAIT_MS, &sq, &st), &st, "norm");
    assert_true(sq == 2.5e10);
    train_svc_step step = {"job-1", INT64_MAX, 1e-4f, 0.5f, 0.9f, 0.999f, 1e-8f, 0.01f, true};
    ok(train_svc_call_step(g_ch, &step, WAIT_MS, &st), &st, "step");
    ok(train_svc_call_close(g_ch, "job-1", WAIT_MS, &st), &st, "close");
}

static void test_state(void **state) {
    (void)state;
    rpc_status st;
    const train_svc_state *got;
    train_svc_reply *held;
    ok(train_svc_call_get_state(g_ch, "job-1", WAIT_MS, &got, &held, &st), &st, "get_state");
    assert_true(state_eq(got, &g_state_back));
    assert_string_equal(got->lora->targets[0], "all-linear");
    ok(train_svc_call_put_state(g_ch, "job-1", got, WAIT_MS, &st), &st, "put_state");
    train_svc_reply_free(held);
    ok(train_svc_call_put_state(g_ch, "other", NULL, WAIT_MS, &st), &st, "put_state without a state");
    train_svc_reply_free(NULL);
}

/* ---- handler errors ----------------------------------------------------------------------- */

/* Expects code rc with the message `msg`. */
static void expect(int rc, const rpc_status *st, int code, const char *msg) {
    if (rc != code) fail_msg("expected %s, got %s: %s", rpc_code_str(code), rpc_code_str(rc), st->message);
    assert_string_equal(st->message, msg);
}

static void test_handler_errors(void **state) {
    (void)state;
    int done0 = atomic_load(&g_done);
    rpc_status st;
    train_svc_opened opened = {"x", 1, 1};
    train_svc_open open = {"missing", 2, 5, NULL, NULL, 64, 2, true, -1};
    expect(train_svc_call_open(g_ch, &open, WAIT_MS, &opened, &st), &st, RPC_NOT_FOUND, "no job missing");
    assert_true(!opened.job_id && !opened.n_params && !opened.bytes);
    const train_svc_forward_reply *fr = (const void *)&st;
    train_svc_reply *held = (train_svc_reply *)&st;
    train_svc_forward fwd = {.job_id = "missing"};
    expect(train_svc_call_forward(g_ch, &fwd, WAIT_MS, &fr, &held, &st), &st, RPC_NOT_FOUND, "no job missing");
    assert_true(!fr && !held);
    const train_svc_backward_reply *br = (const void *)&st;
    train_svc_backward bwd = {.job_id = "missing"};
    expect(train_svc_call_backward(g_ch, &bwd, WAIT_MS, &br, &held, &st), &st, RPC_NOT_FOUND, "no job missing");
    assert_true(!br && !held);
    double sq = 1;
    expect(train_svc_call_norm(g_ch, "missing", WAIT_MS, &sq, &st), &st, RPC_NOT_FOUND, "no job missing");
    assert_true(sq == 0);
    train_svc_step step = {.job_id = "missing"};
    expect(train_svc_call_step(g_ch, &step, WAIT_MS, &st), &st, RPC_NOT_FOUND, "no job missing");
    const train_svc_state *gs = (const void *)&st;
    expect(train_svc_call_get_state(g_ch, "missing", WAIT_MS, &gs, &held, &st), &st, RPC_NOT_FOUND,
           "no job missing");
    assert_true(!gs && !held);
    expect(train_svc_call_put_state(g_ch, "missing", NULL, WAIT_MS, &st), &st, RPC_NOT_FOUND, "no job missing");
    expect(train_svc_call_close(g_ch, "missing", WAIT_MS, &st), &st, RPC_NOT_FOUND, "no job missing");
    expect(train_svc_call_close(g_ch, "busy", WAIT_MS, &st), &st, RPC_FAILED_PRECONDITION, "job busy is stepping");
    assert_int_equal(atomic_load(&g_done), done0); /* failures hold nothing */
}

/* A method the handlers leave NULL is not served; done NULL is allowed. */
static void test_unimplemented(void **state) {
    (void)state;
    train_svc_handlers h = {.norm = tt_norm};
    rpc_server *srv;
    rpc_channel *ch;
    serve(&h, &srv, &ch);
    rpc_status st;
    double sq;
    ok(train_svc_call_norm(ch, "job-1", WAIT_MS, &sq, &st), &st, "norm");
    assert_int_equal(train_svc_call_close(ch, "job-1", WAIT_MS, &st), RPC_UNIMPLEMENTED);
    rpc_channel_free(ch);
    rpc_server_free(srv);
}

/* ---- refusals ----------------------------------------------------------------------------- */

/* Each method's path and reply type, as the test sends them raw. */
static const struct {
    const char *path;
    const ProtobufCMessageDescriptor *rep;
} g_methods[TRAIN_SVC_N_METHODS] = {
    [TRAIN_SVC_OPEN] = {RPC_TRAIN_OPEN, &fusion__train_opened__descriptor},
    [TRAIN_SVC_FORWARD] = {RPC_TRAIN_FORWARD, &fusion__train_forward_reply__descriptor},
    [TRAIN_SVC_BACKWARD] = {RPC_TRAIN_BACKWARD, &fusion__train_backward_reply__descriptor},
    [TRAIN_SVC_NORM] = {RPC_TRAIN_NORM, &fusion__train_norm_reply__descriptor},
    [TRAIN_SVC_STEP] = {RPC_TRAIN_STEP, &fusion__train_step_reply__descriptor},
    [TRAIN_SVC_GET_STATE] = {RPC_TRAIN_GET_STATE, &fusion__adapter_state__descriptor},
    [TRAIN_SVC_PUT_STATE] = {RPC_TRAIN_PUT_STATE, &fusion__train_step_reply__descriptor},
    [TRAIN_SVC_CLOSE] = {RPC_TRAIN_CLOSE, &fusion__train_closed__descriptor},
};

/* Sends bytes as method m's request: expects `code` with `msg` (NULL: any) from the server, and
 * the same verdict and message from train_svc_request_check (RPC_OK where the server's handler
 * answered, as the check runs no handler). */
static void expect_raw(train_svc_method m, const void *b, size_t n, int code, const char *msg) {
    rpc_status st, cst;
    ProtobufCMessage *rep = NULL;
    int rc = rpc_call_unary_raw(g_ch, g_methods[m].path, b, n, g_methods[m].rep, &rep, WAIT_MS, &st);
    rpc_msg_free(rep);
    if (rc != code) fail_msg("method %d: expected %s, got %s: %s", m, rpc_code_str(code), rpc_code_str(rc), st.message);
    if (msg) assert_string_equal(st.message, msg);
    int crc = train_svc_request_check(m, b, n, 1 << 20, &cst);
    if (code == RPC_INVALID_ARGUMENT) {
        assert_int_equal(crc, code);
        assert_string_equal(cst.message, st.message);
    } else {
        assert_int_equal(crc, RPC_OK);
    }
}

/* The same with a generated message, packed here. */
static void expect_msg(train_svc_method m, const ProtobufCMessage *msg, int code, const char *text) {
    size_t n = protobuf_c_message_get_packed_size(msg);
    uint8_t *b = malloc(n + 1);
    assert_non_null(b);
    assert_int_equal(protobuf_c_message_pack(msg, b), n);
    expect_raw(m, b, n, code, text);
    free(b);
}

static void test_refuse_open(void **state) {
    (void)state;
    Fusion__TrainOpen m = FUSION__TRAIN_OPEN__INIT;
    m.job_id = "missing";
    expect_msg(TRAIN_SVC_OPEN, &m.base, RPC_NOT_FOUND, "no job missing");
    m.first_block = 1LL << 40;
    expect_msg(TRAIN_SVC_OPEN, &m.base, RPC_INVALID_ARGUMENT, "open.first_block: 1099511627776 is out of range");
    m.first_block = 0;
    m.slots = (int64_t)INT32_MIN - 1;
    expect_msg(TRAIN_SVC_OPEN, &m.base, RPC_INVALID_ARGUMENT, "open.slots: -2147483649 is out of range");
    m.slots = 1;
    m.idle_timeout_ms = (int64_t)INT32_MAX + 1;
    expect_msg(TRAIN_SVC_OPEN, &m.base, RPC_INVALID_ARGUMENT, "open.idle_timeout_ms: 2147483648 is out of range");
    m.idle_timeout_ms = 0;
    Fusion__LoraSpec lora = FUSION__LORA_SPEC__INIT;
    lora.r = 1LL << 32;
    m.lora = &lora;
    expect_msg(TRAIN_SVC_OPEN, &m.base, RPC_INVALID_ARGUMENT, "open.lora.r: 4294967296 is out of range");
    lora.r = 8;
    char *names[TRAIN_SVC_MAX_TARGETS + 1];
    for (int i = 0; i <= TRAIN_SVC_MAX_TARGETS; i++) names[i] = "q_proj";
    lora.target_modules = names;
    lora.n_target_modules = TRAIN_SVC_MAX_TARGETS;
    expect_msg(TRAIN_SVC_OPEN, &m.base, RPC_NOT_FOUND, "no job missing");
    lora.n_target_modules = TRAIN_SVC_MAX_TARGETS + 1;
    expect_msg(TRAIN_SVC_OPEN, &m.base, RPC_INVALID_ARGUMENT, "open.lora.target_modules: 17 names, at most 16");
    char name[TRAIN_SVC_MAX_NAME + 2];
    memset(name, 'a', sizeof name - 1);
    name[sizeof name - 1] = '\0';
    names[1] = name;
    lora.n_target_modules = 2;
    expect_msg(TRAIN_SVC_OPEN, &m.base, RPC_INVALID_ARGUMENT, "open.lora.target_modules[1]: longer than 64 bytes");
    name[TRAIN_SVC_MAX_NAME] = '\0';
    expect_msg(TRAIN_SVC_OPEN, &m.base, RPC_NOT_FOUND, "no job missing");
    names[1] = "v_proj\n";
    expect_msg(TRAIN_SVC_OPEN, &m.base, RPC_INVALID_ARGUMENT,
               "open.lora.target_modules[1]: control character 0x0a at byte 6");
}

static void test_refuse_state(void **state) {
    (void)state;
    Fusion__Tensor t = FUSION__TENSOR__INIT;
    t.block_size = 1LL << 40;
    Fusion__AdapterState as = FUSION__ADAPTER_STATE__INIT;
    as.moment2 = &t;
    Fusion__TrainOpen m = FUSION__TRAIN_OPEN__INIT;
    m.job_id = "missing";
    m.state = &as;
    expect_msg(TRAIN_SVC_OPEN, &m.base, RPC_INVALID_ARGUMENT,
               "open.state.moment2.block_size: 1099511627776 is out of range");
    Fusion__TrainPutState p = FUSION__TRAIN_PUT_STATE__INIT;
    p.job_id = "missing";
    p.state = &as;
    expect_msg(TRAIN_SVC_PUT_STATE, &p.base, RPC_INVALID_ARGUMENT,
               "put_state.state.moment2.block_size: 1099511627776 is out of range");
    t.block_size = 64;
    as.last_block = -(1LL << 40);
    expect_msg(TRAIN_SVC_PUT_STATE, &p.base, RPC_INVALID_ARGUMENT,
               "put_state.state.last_block: -1099511627776 is out of range");
    as.last_block = 3;
    Fusion__LoraSpec lora = FUSION__LORA_SPEC__INIT;
    char *bad = "q\x7f";
    lora.target_modules = &bad;
    lora.n_target_modules = 1;
    as.lora = &lora;
    expect_msg(TRAIN_SVC_PUT_STATE, &p.base, RPC_INVALID_ARGUMENT,
               "put_state.state.lora.target_modules[0]: control character 0x7f at byte 1");
    bad = "q";
    expect_msg(TRAIN_SVC_PUT_STATE, &p.base, RPC_NOT_FOUND, "no job missing");
}

static void test_refuse_forward(void **state) {
    (void)state;
    int64_t toks[2] = {3, -1}, first[2] = {0, 1LL << 31}, tgt[2] = {(int64_t)INT32_MIN - 1, -1};
    Fusion__Input in = FUSION__INPUT__INIT;
    in.tokens = toks;
    in.n_tokens = 2;
    Fusion__TrainForward m = FUSION__TRAIN_FORWARD__INIT;
    m.job_id = "missing";
    m.input = &in;
    m.first = first;
    m.n_first = 2;
    m.targets = tgt;
    m.n_targets = 2;
    expect_msg(TRAIN_SVC_FORWARD, &m.base, RPC_INVALID_ARGUMENT,
               "forward.input.tokens[1]: token id -1 is not a valid id");
    toks[1] = 1LL << 31;
    expect_msg(TRAIN_SVC_FORWARD, &m.base, RPC_INVALID_ARGUMENT,
               "forward.input.tokens[1]: token id 2147483648 is not a valid id");
    toks[1] = INT32_MAX;
    expect_msg(TRAIN_SVC_FORWARD, &m.base, RPC_INVALID_ARGUMENT, "forward.first[1]: 2147483648 is out of range");
    first[1] = 1;
    expect_msg(TRAIN_SVC_FORWARD, &m.base, RPC_INVALID_ARGUMENT, "forward.targets[0]: -2147483649 is out of range");
    tgt[0] = INT32_MIN;
    m.slot = 1LL << 33;
    expect_msg(TRAIN_SVC_FORWARD, &m.base, RPC_INVALID_ARGUMENT, "forward.slot: 8589934592 is out of range");
    m.slot = 0;
    Fusion__Tensor t = FUSION__TENSOR__INIT;
    t.block_size = -(1LL << 35);
    in.hidden = &t;
    expect_msg(TRAIN_SVC_FORWARD, &m.base, RPC_INVALID_ARGUMENT,
               "forward.input.hidden.block_size: -34359738368 is out of range");
    t.block_size = 0;
    expect_msg(TRAIN_SVC_FORWARD, &m.base, RPC_NOT_FOUND, "no job missing");
}

static void test_refuse_backward(void **state) {
    (void)state;
    Fusion__TrainBackward m = FUSION__TRAIN_BACKWARD__INIT;
    m.job_id = "missing";
    m.slot = -(1LL << 31) - 1;
    expect_msg(TRAIN_SVC_BACKWARD, &m.base, RPC_INVALID_ARGUMENT, "backward.slot: -2147483649 is out of range");
    m.slot = 0;
    Fusion__Tensor t = FUSION__TENSOR__INIT;
    t.block_size = 1LL << 31;
    m.grad = &t;
    expect_msg(TRAIN_SVC_BACKWARD, &m.base, RPC_INVALID_ARGUMENT,
               "backward.grad.block_size: 2147483648 is out of range");
}

/* A request carrying only the job id id[0..n) (field 1 of every request), written by hand. */
static void id_request(pbuf *p, const char *id, size_t n) {
    p->n = 0;
    pb_bytes(p, 1, id, n);
}

static void test_refuse_job_ids(void **state) {
    (void)state;
    static const char *const what[TRAIN_SVC_N_METHODS] = {"open", "forward", "backward", "norm",
                                                          "step", "get_state", "put_state", "close"};
    char id[TRAIN_SVC_MAX_ID + 2], msg[128];
    memset(id, 'j', sizeof id);
    pbuf p;
    for (int m = 0; m < TRAIN_SVC_N_METHODS; m++) {
        id_request(&p, id, 0);
        snprintf(msg, sizeof msg, "%s.job_id: empty", what[m]);
        expect_raw(m, p.b, p.n, RPC_INVALID_ARGUMENT, msg);
        id_request(&p, id, TRAIN_SVC_MAX_ID + 1);
        snprintf(msg, sizeof msg, "%s.job_id: longer than 128 bytes", what[m]);
        expect_raw(m, p.b, p.n, RPC_INVALID_ARGUMENT, msg);
        id_request(&p, "job\x1f", 4);
        snprintf(msg, sizeof msg, "%s.job_id: control character 0x1f at byte 3", what[m]);
        expect_raw(m, p.b, p.n, RPC_INVALID_ARGUMENT, msg);
        /* the longest id passes the views (the fake handlers then refuse what they do not expect) */
        id_request(&p, id, TRAIN_SVC_MAX_ID);
        assert_int_equal(train_svc_request_check(m, p.b, p.n, 1 << 20, NULL), RPC_OK);
    }
    /* a job id with an embedded NUL reads as the string before it */
    id_request(&p, "missing\0x", 9);
    expect_raw(TRAIN_SVC_NORM, p.b, p.n, RPC_NOT_FOUND, "no job missing");
}

static void test_request_check(void **state) {
    (void)state;
    rpc_status st;
    uint8_t junk[4] = {0x0a, 0xff, 0xff, 0x01};
    for (int m = 0; m < TRAIN_SVC_N_METHODS; m++)
        assert_int_equal(train_svc_request_check(m, junk, sizeof junk, 1 << 20, &st), RPC_INVALID_ARGUMENT);
    pbuf p;
    id_request(&p, "job-1", 5);
    assert_int_equal(train_svc_request_check(TRAIN_SVC_CLOSE, p.b, p.n, p.n, &st), RPC_OK);
    assert_int_equal(train_svc_request_check(TRAIN_SVC_CLOSE, p.b, p.n, p.n - 1, &st), RPC_RESOURCE_EXHAUSTED);
    assert_int_equal(train_svc_request_check(TRAIN_SVC_N_METHODS, p.b, p.n, 1 << 20, &st), RPC_INVALID_ARGUMENT);
    assert_int_equal(train_svc_request_check((train_svc_method)-1, p.b, p.n, 1 << 20, &st), RPC_INVALID_ARGUMENT);
    /* an empty message: every method refuses the missing job id */
    for (int m = 0; m < TRAIN_SVC_N_METHODS; m++)
        assert_int_equal(train_svc_request_check(m, "", 0, 1 << 20, &st), RPC_INVALID_ARGUMENT);
}

/* Last: every successful call that held its reply was released exactly once, after packing. */
static void test_done_count(void **state) {
    (void)state;
    assert_int_equal(atomic_load(&g_holds), 7); /* open 2, forward 2, backward 2, get_state 1 */
    assert_int_equal(atomic_load(&g_done), atomic_load(&g_holds));
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_open),
        cmocka_unit_test(test_forward),
        cmocka_unit_test(test_backward),
        cmocka_unit_test(test_norm_step_close),
        cmocka_unit_test(test_state),
        cmocka_unit_test(test_handler_errors),
        cmocka_unit_test(test_unimplemented),
        cmocka_unit_test(test_refuse_open),
        cmocka_unit_test(test_refuse_state),
        cmocka_unit_test(test_refuse_forward),
        cmocka_unit_test(test_refuse_backward),
        cmocka_unit_test(test_refuse_job_ids),
        cmocka_unit_test(test_request_check),
        cmocka_unit_test(test_done_count),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
