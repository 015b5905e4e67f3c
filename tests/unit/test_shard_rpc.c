/* test_shard_rpc.c -- fusion.Shard end to end in one process: a real server on loopback with a
 * random-weight span, a real client, and every kind of bad request refused with a clear status. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "fusion.pb-c.h"
#include "model.h"
#include "rpc.h"
#include "shard-core.h"
#include "shard-rpc.h"
#include "status.h"
#include "test-shard.h"
#include "wire.h"

#define SECRET "unit-secret"

typedef shard_fixture fixture;

static mdl_config cfg_small(void) {
    mdl_config c;
    memset(&c, 0, sizeof c);
    c.arch = MDL_ARCH_LLAMA;
    c.n_layers = 4;
    c.dim = 64;
    c.ffn_dim = 96;
    c.n_heads = 4;
    c.n_kv_heads = 2;
    c.head_dim = 16;
    c.vocab_size = 50;
    c.max_seq_len = 32;
    c.norm_eps = 1e-5f;
    c.rope_theta = 10000.0f;
    return c;
}

/* A server for blocks [first, last) of the random model. */
static void start(fixture *f, int first, int last, bool embed, bool head) {
    mdl_config c = cfg_small();
    shard_server_config sc = {.listen = "127.0.0.1:0", .allow_insecure = true, .secret = SECRET,
                              .max_message_bytes = 1u << 20, .idle_timeout_ms = 2000, .n_workers = 2,
                              .model_name = "random", .device = "cpu", .tokens_per_s = 1.0};
    shard_fixture_start(f, &c, (mdl_open_options){first, last, embed, head}, 1u << 20, &sc);
}

static void stop(fixture *f) { shard_fixture_stop(f); }

/* Opens a session stream; returns the open's outcome. */
static int open_session(fixture *f, rpc_stream **s, const Fusion__OpenSession *open, rpc_status *st) {
    assert_int_equal(rpc_stream_open(f->ch, RPC_SHARD_SESSION, 10000, s, st), RPC_OK);
    Fusion__SessionRequest req = FUSION__SESSION_REQUEST__INIT;
    req.kind_case = FUSION__SESSION_REQUEST__KIND_OPEN;
    req.open = (Fusion__OpenSession *)open;
    int rc = rpc_stream_send(*s, &req.base, st);
    ProtobufCMessage *msg = NULL;
    if (!rc) rc = rpc_stream_recv(*s, &fusion__session_reply__descriptor, &msg, 10000, st);
    rpc_msg_free(msg);
    return rc;
}

static int send_step(rpc_stream *s, const Fusion__StepRequest *sr, Fusion__SessionReply **rep, rpc_status *st) {
    Fusion__SessionRequest req = FUSION__SESSION_REQUEST__INIT;
    req.kind_case = FUSION__SESSION_REQUEST__KIND_STEP;
    req.step = (Fusion__StepRequest *)sr;
    int rc = rpc_stream_send(s, &req.base, st);
    ProtobufCMessage *msg = NULL;
    if (!rc) rc = rpc_stream_recv(s, &fusion__session_reply__descriptor, &msg, 10000, st);
    *rep = (Fusion__SessionReply *)msg;
    return rc;
}

static Fusion__OpenSession open_msg(const char *id, int max_len) {
    Fusion__OpenSession o = FUSION__OPEN_SESSION__INIT;
    o.session_id.data = (uint8_t *)id;
    o.session_id.len = strlen(id);
    o.max_length = max_len;
    o.wire_dtype = FUSION__DTYPE__DTYPE_F32;
    return o;
}

static void test_info_and_good_session(void **state) {
    fixture f;
    start(&f, 0, 4, true, true);
    Fusion__InfoRequest ir = FUSION__INFO_REQUEST__INIT;
    ProtobufCMessage *msg = NULL;
    rpc_status st;
    assert_int_equal(rpc_call_unary(f.ch, RPC_SHARD_INFO, &ir.base, &fusion__info_reply__descriptor, &msg, 5000, &st),
                     RPC_OK);
    Fusion__InfoReply *info = (Fusion__InfoReply *)msg;
    assert_int_equal(info->n_layers, 4);
    assert_int_equal(info->last_block, 4);
    assert_true(info->has_embeddings && info->has_head);
    assert_int_equal(info->total_kv_bytes, 1 << 20);
    rpc_msg_free(msg);

    rpc_stream *s;
    Fusion__OpenSession o = open_msg("good", 16);
    assert_int_equal(open_session(&f, &s, &o, &st), RPC_OK);
    int64_t toks[3] = {1, 2, 3};
    Fusion__Input in = FUSION__INPUT__INIT;
    in.n_tokens = 3;
    in.tokens = toks;
    Fusion__Sampling samp = FUSION__SAMPLING__INIT;
    Fusion__OutputSpec os = FUSION__OUTPUT_SPEC__INIT;
    os.sampling = &samp;
    os.top_logprobs = 2;
    Fusion__StepRequest sr = FUSION__STEP_REQUEST__INIT;
    sr.input = &in;
    sr.output = &os;
    Fusion__SessionReply *rep;
    assert_int_equal(send_step(s, &sr, &rep, &st), RPC_OK);
    assert_int_equal(rep->step->position, 3);
    assert_int_equal(rep->step->output->n_tokens, 1);
    assert_int_equal(rep->step->output->n_top_logprobs, 1);
    assert_int_equal(rep->step->output->top_logprobs[0]->entries[0]->token, rep->step->output->tokens[0]);
    rpc_msg_free(&rep->base);
    rpc_stream_free(s);
    stop(&f);
}

/* Sends a step that must be refused with `code`; the message must contain `needle`. */
static void expect_step_refused(fixture *f, const Fusion__StepRequest *sr, int code, const char *needle) {
    rpc_stream *s;
    rpc_status st;
    static int n;
    char id[32];
    snprintf(id, sizeof id, "bad-%d", n++);
    Fusion__OpenSession o = open_msg(id, 16);
    assert_int_equal(open_session(f, &s, &o, &st), RPC_OK);
    Fusion__SessionReply *rep = NULL;
    int rc = send_step(s, sr, &rep, &st);
    if (rc != code || !strstr(st.message, needle))
        fail_msg("expected %s containing '%s', got %s: %s", rpc_code_str(code), needle, rpc_code_str(rc),
                 st.message);
    rpc_msg_free(rep ? &rep->base : NULL);
    rpc_stream_free(s);
}

static void test_bad_steps(void **state) {
    fixture f;
    start(&f, 2, 4, false, true); /* takes hidden states of dim 64 */
    float h[3 * 64] = {0};
    uint8_t bytes[3 * 64 * 4];
    memcpy(bytes, h, sizeof bytes);
    int64_t shape_bad[2] = {3, 63}, shape_ok[2] = {3, 64}, shape_3d[3] = {1, 3, 64};
    Fusion__Tensor t = FUSION__TENSOR__INIT;
    t.dtype = FUSION__DTYPE__DTYPE_F32;
    t.n_shape = 2;
    t.shape = shape_bad;
    t.data.data = bytes;
    t.data.len = 3 * 63 * 4;
    Fusion__Input in = FUSION__INPUT__INIT;
    in.hidden = &t;
    Fusion__StepRequest sr = FUSION__STEP_REQUEST__INIT;
    sr.input = &in;
    expect_step_refused(&f, &sr, RPC_INVALID_ARGUMENT, "shape");
    t.n_shape = 3;
    t.shape = shape_3d;
    expect_step_refused(&f, &sr, RPC_INVALID_ARGUMENT, "shape");
    t.n_shape = 2;
    t.shape = shape_ok;
    t.data.len = 100; /* bytes do not match the shape */
    expect_step_refused(&f, &sr, RPC_INVALID_ARGUMENT, "bytes");
    t.data.len = sizeof bytes;
    t.dtype = (Fusion__Dtype)9;
    expect_step_refused(&f, &sr, RPC_INVALID_ARGUMENT, "dtype");
    t.dtype = FUSION__DTYPE__DTYPE_F32;
    float nan = __builtin_nanf("");
    memcpy(bytes + 8, &nan, 4);
    expect_step_refused(&f, &sr, RPC_INVALID_ARGUMENT, "non-finite");
    memset(bytes, 0, sizeof bytes);
    int64_t toks[2] = {1, 2};
    in.n_tokens = 2; /* 2 ids for 3 positions */
    in.tokens = toks;
    expect_step_refused(&f, &sr, RPC_INVALID_ARGUMENT, "tokens");
    in.n_tokens = 0;
    sr.start_position = 5;
    expect_step_refused(&f, &sr, RPC_INVALID_ARGUMENT, "start_position");
    sr.start_position = 0;
    sr.rollback_case = FUSION__STEP_REQUEST__ROLLBACK_ROLLBACK_TO;
    sr.rollback_to = 7;
    expect_step_refused(&f, &sr, RPC_OUT_OF_RANGE, "rollback_to");
    sr.rollback_case = FUSION__STEP_REQUEST__ROLLBACK__NOT_SET;
    Fusion__Input tok_only = FUSION__INPUT__INIT;
    tok_only.n_tokens = 2;
    tok_only.tokens = toks;
    sr.input = &tok_only; /* token ids to a server without embeddings */
    expect_step_refused(&f, &sr, RPC_INVALID_ARGUMENT, "hidden states");
    sr.input = NULL;
    expect_step_refused(&f, &sr, RPC_INVALID_ARGUMENT, "input");
    /* too many positions for the session */
    static uint8_t big[20 * 64 * 4];
    int64_t shape_big[2] = {20, 64};
    Fusion__Tensor tb = FUSION__TENSOR__INIT;
    tb.dtype = FUSION__DTYPE__DTYPE_F32;
    tb.n_shape = 2;
    tb.shape = shape_big;
    tb.data.data = big;
    tb.data.len = sizeof big;
    Fusion__Input inb = FUSION__INPUT__INIT;
    inb.hidden = &tb;
    sr.input = &inb;
    expect_step_refused(&f, &sr, RPC_OUT_OF_RANGE, "max_length");
    /* sampling with bad parameters */
    sr.input = &in;
    Fusion__Sampling samp = FUSION__SAMPLING__INIT;
    samp.temperature = -1;
    Fusion__OutputSpec os = FUSION__OUTPUT_SPEC__INIT;
    os.sampling = &samp;
    sr.output = &os;
    expect_step_refused(&f, &sr, RPC_INVALID_ARGUMENT, "temperature");
    samp.temperature = 0;
    os.top_logprobs = 50;
    expect_step_refused(&f, &sr, RPC_INVALID_ARGUMENT, "top_logprobs");
    os.top_logprobs = 0;
    uint8_t mask[3] = {1, 1, 1}; /* wrong size for the model's vocabulary */
    samp.allowed_tokens.data = mask;
    samp.allowed_tokens.len = sizeof mask;
    expect_step_refused(&f, &sr, RPC_INVALID_ARGUMENT, "allowed_tokens");
    stop(&f);
}

static void test_bad_opens_and_auth(void **state) {
    fixture f;
    start(&f, 0, 2, true, false);
    rpc_stream *s;
    rpc_status st;
    Fusion__OpenSession o = open_msg("x", 16);
    o.first_block = 1;
    o.last_block = 3;
    assert_int_equal(open_session(&f, &s, &o, &st), RPC_FAILED_PRECONDITION);
    rpc_stream_free(s);
    o = open_msg("x", 1000); /* beyond the context */
    assert_int_equal(open_session(&f, &s, &o, &st), RPC_OUT_OF_RANGE);
    rpc_stream_free(s);
    o = open_msg("x", 16);
    o.adapter_id = (char *)"nope";
    assert_int_equal(open_session(&f, &s, &o, &st), RPC_NOT_FOUND);
    rpc_stream_free(s);
    o = open_msg("", 16);
    assert_int_equal(open_session(&f, &s, &o, &st), RPC_INVALID_ARGUMENT);
    rpc_stream_free(s);
    /* the KV budget (1 MiB, 2 layers x 2 x 32 floats x 4 B = 512 B per position) */
    o = open_msg("fits", 32);
    rpc_stream *keep;
    assert_int_equal(open_session(&f, &keep, &o, &st), RPC_OK);
    /* a step message as the first message */
    assert_int_equal(rpc_stream_open(f.ch, RPC_SHARD_SESSION, 10000, &s, &st), RPC_OK);
    Fusion__StepRequest sr = FUSION__STEP_REQUEST__INIT;
    Fusion__SessionReply *rep = NULL;
    assert_int_equal(send_step(s, &sr, &rep, &st), RPC_INVALID_ARGUMENT);
    assert_non_null(strstr(st.message, "open"));
    rpc_stream_free(s);
    /* duplicate session id while the first is open */
    o = open_msg("fits", 8);
    assert_int_equal(open_session(&f, &s, &o, &st), RPC_INVALID_ARGUMENT);
    rpc_stream_free(s);
    rpc_stream_free(keep);
    /* garbage bytes */
    assert_int_equal(rpc_stream_open(f.ch, RPC_SHARD_SESSION, 10000, &s, &st), RPC_OK);
    const uint8_t junk[] = {0x0a, 0xff, 0xff, 0xff, 0xff, 0x0f, 0x01};
    rpc_stream_send_raw(s, junk, sizeof junk, &st);
    ProtobufCMessage *msg = NULL;
    int rc = rpc_stream_recv(s, &fusion__session_reply__descriptor, &msg, 10000, &st);
    assert_int_equal(rc, RPC_INVALID_ARGUMENT);
    rpc_stream_free(s);
    /* wrong secret */
    rpc_channel *bad;
    rpc_channel_options cho = {.insecure = true, .secret = "wrong"};
    assert_int_equal(rpc_channel_new(shard_server_address(f.srv), &cho, &bad), FU_OK);
    Fusion__HealthRequest hr = FUSION__HEALTH_REQUEST__INIT;
    assert_int_equal(rpc_call_unary(bad, RPC_SHARD_HEALTH, &hr.base, &fusion__health_reply__descriptor, &msg, 5000, &st),
                     RPC_UNAUTHENTICATED);
    rpc_channel_free(bad);
    /* a stateless forward of two sequences */
    int64_t a[3] = {1, 2, 3}, b[2] = {4, 5};
    Fusion__Input ia = FUSION__INPUT__INIT, ib = FUSION__INPUT__INIT;
    ia.n_tokens = 3;
    ia.tokens = a;
    ib.n_tokens = 2;
    ib.tokens = b;
    Fusion__Input *seqs[2] = {&ia, &ib};
    Fusion__ForwardRequest fr = FUSION__FORWARD_REQUEST__INIT;
    fr.n_sequences = 2;
    fr.sequences = seqs;
    fr.wire_dtype = FUSION__DTYPE__DTYPE_F32;
    assert_int_equal(rpc_call_unary(f.ch, RPC_SHARD_FORWARD, &fr.base, &fusion__forward_reply__descriptor, &msg, 5000, &st),
                     RPC_OK);
    Fusion__ForwardReply *fwd = (Fusion__ForwardReply *)msg;
    assert_int_equal(fwd->n_outputs, 2);
    assert_int_equal(fwd->outputs[0]->hidden->shape[0], 3);
    assert_int_equal(fwd->outputs[1]->hidden->shape[1], 64);
    rpc_msg_free(msg);
    ib.tokens[0] = 99; /* out of the vocabulary */
    assert_int_equal(rpc_call_unary(f.ch, RPC_SHARD_FORWARD, &fr.base, &fusion__forward_reply__descriptor, &msg, 5000, &st),
                     RPC_INVALID_ARGUMENT);
    assert_non_null(strstr(st.message, "sequences[1]"));
    stop(&f);
}

/* Free KV bytes as the server reports them. */
static int64_t free_kv(fixture *f) {
    Fusion__InfoRequest ir = FUSION__INFO_REQUEST__INIT;
    ProtobufCMessage *msg = NULL;
    rpc_status st;
    assert_int_equal(rpc_call_unary(f->ch, RPC_SHARD_INFO, &ir.base, &fusion__info_reply__descriptor, &msg, 5000, &st),
                     RPC_OK);
    int64_t v = ((Fusion__InfoReply *)msg)->free_kv_bytes;
    rpc_msg_free(msg);
    return v;
}

/* One step of one token at position `pos` over an open session; the rpc code. */
static int step_one(rpc_stream *s, int pos, rpc_status *st) {
    int64_t toks[1] = {1};
    Fusion__Input in = FUSION__INPUT__INIT;
    in.n_tokens = 1;
    in.tokens = toks;
    Fusion__StepRequest sr = FUSION__STEP_REQUEST__INIT;
    sr.input = &in;
    sr.start_position = pos;
    Fusion__SessionReply *rep = NULL;
    int rc = send_step(s, &sr, &rep, st);
    rpc_msg_free(rep ? &rep->base : NULL);
    return rc;
}

/* Polls until the server's free KV bytes equal `want` (the handler frees a
 * dropped session as soon as it notices). */
static bool wait_free_kv(fixture *f, int64_t want) {
    for (int i = 0; i < 200; i++) {
        if (free_kv(f) == want) return true;
        struct timespec ts = {0, 10 * 1000 * 1000};
        nanosleep(&ts, NULL);
    }
    return false;
}

static void test_sessions_free_memory_when_dropped_or_idle(void **state) {
    fixture f;
    start(&f, 0, 4, true, true);
    const int64_t total = free_kv(&f);
    rpc_stream *s;
    rpc_status st;
    Fusion__OpenSession o = open_msg("dropped", 32);
    assert_int_equal(open_session(&f, &s, &o, &st), RPC_OK);
    assert_true(free_kv(&f) < total);
    rpc_stream_free(s); /* the client goes away without closing */
    assert_true(wait_free_kv(&f, total));

    o = open_msg("idle", 32);
    o.idle_timeout_ms = 200;
    assert_int_equal(open_session(&f, &s, &o, &st), RPC_OK);
    assert_true(free_kv(&f) < total);
    struct timespec ts = {0, 500 * 1000 * 1000};
    nanosleep(&ts, NULL);
    assert_true(wait_free_kv(&f, total)); /* expired by the server */
    assert_int_equal(step_one(s, 0, &st), RPC_DEADLINE_EXCEEDED);
    assert_non_null(strstr(st.message, "expired"));
    rpc_stream_free(s);
    stop(&f);
}

static Fusion__OpenSession open_span(const char *id, int first, int last) {
    Fusion__OpenSession o = open_msg(id, 16);
    o.first_block = first;
    o.last_block = last;
    return o;
}

/* The old core back once nothing uses it (sessions end asynchronously). */
static shard_core *wait_old_core(shard_server *srv) {
    for (int i = 0; i < 500; i++) {
        shard_core *c = shard_server_old_core(srv, false);
        if (c) return c;
        struct timespec ts = {0, 10 * 1000 * 1000};
        nanosleep(&ts, NULL);
    }
    return NULL;
}

/* A move: the new span serves new sessions and Info while the old one serves the sessions naming it
 * until they end, or until it is closed (their next step fails: "moved away"); then it is handed back. */
static void test_move_beside_old_span(void **state) {
    (void)state;
    fixture f;
    start(&f, 0, 2, true, false);
    rpc_stream *s1, *s2, *s3;
    rpc_status st;
    Fusion__OpenSession o = open_span("before", 0, 2);
    assert_int_equal(open_session(&f, &s1, &o, &st), RPC_OK);
    assert_int_equal(step_one(s1, 0, &st), RPC_OK);
    /* nothing to hand back before a move */
    assert_null(shard_server_old_core(f.srv, true));
    mdl_config c = cfg_small();
    mdl_open_options mo = {2, 4, false, true};
    mdl_model *m2;
    shard_core *core2;
    assert_int_equal(mdl_random(&c, OP_TYPE_F32, 1, &mo, &m2), FU_OK);
    shard_core_options so = {.kv_budget_bytes = 1u << 20, .max_batch_tokens = 64, .kv_type = OP_TYPE_F32};
    assert_int_equal(shard_core_new(m2, f.be, &so, &core2), FU_OK);
    assert_int_equal(shard_server_move(f.srv, core2, 2.0), FU_OK);
    assert_int_equal(shard_server_move(f.srv, core2, 2.0), FU_ERR_INVALID); /* the old span still drains */
    /* Info and new sessions: the new span */
    Fusion__InfoRequest ir = FUSION__INFO_REQUEST__INIT;
    ProtobufCMessage *msg = NULL;
    assert_int_equal(rpc_call_unary(f.ch, RPC_SHARD_INFO, &ir.base, &fusion__info_reply__descriptor, &msg, 5000, &st),
                     RPC_OK);
    assert_int_equal(((Fusion__InfoReply *)msg)->first_block, 2);
    rpc_msg_free(msg);
    o = open_span("after", 2, 4);
    assert_int_equal(open_session(&f, &s2, &o, &st), RPC_OK);
    rpc_stream_free(s2);
    /* the old session goes on; one naming the old span still opens there while it drains */
    assert_int_equal(step_one(s1, 1, &st), RPC_OK);
    o = open_span("late", 0, 2);
    assert_int_equal(open_session(&f, &s3, &o, &st), RPC_OK);
    rpc_stream_free(s1);
    /* past the drain time: closed, so the last session's next step fails and the core comes back */
    assert_null(shard_server_old_core(f.srv, true));
    int rc = step_one(s3, 0, &st);
    assert_int_equal(rc, RPC_UNAVAILABLE);
    assert_non_null(strstr(st.message, "moved away"));
    rpc_stream_free(s3);
    shard_core *old = wait_old_core(f.srv);
    assert_ptr_equal(old, f.core);
    /* now the old span is gone: a session naming it is refused */
    o = open_span("gone", 0, 2);
    assert_int_equal(open_session(&f, &s3, &o, &st), RPC_FAILED_PRECONDITION);
    rpc_stream_free(s3);
    rpc_channel_free(f.ch);
    shard_server_drain(f.srv, 0);
    shard_server_free(f.srv);
    shard_core_free(core2);
    mdl_free(m2);
    shard_core_free(f.core);
    op_backend_free(f.be);
    mdl_free(f.m);
}

/* ---- raw wire messages: what the typed structs cannot express ------------------------------ */

/* A protobuf message built by hand. */
typedef struct pbuf {
    uint8_t b[512];
    size_t n;
} pbuf;

static void pb_varint(pbuf *p, uint64_t v) {
    do {
        assert_true(p->n < sizeof p->b);
        p->b[p->n++] = (uint8_t)((v & 0x7f) | (v > 0x7f ? 0x80 : 0));
        v >>= 7;
    } while (v);
}

/* Field `field` as varint `v`. */
static void pb_uint(pbuf *p, int field, uint64_t v) {
    pb_varint(p, (uint64_t)field << 3);
    pb_varint(p, v);
}

/* Field `field` as `n` length-delimited bytes. */
static void pb_bytes(pbuf *p, int field, const void *d, size_t n) {
    pb_varint(p, (uint64_t)field << 3 | 2);
    pb_varint(p, n);
    assert_true(p->n + n <= sizeof p->b);
    memcpy(p->b + p->n, d, n);
    p->n += n;
}

/* Sends SessionRequest{kind `kind` (1 open, 2 step) = body} and returns the reply's code. */
static int send_raw(rpc_stream *s, int kind, const pbuf *body, rpc_status *st) {
    pbuf req = {0};
    pb_bytes(&req, kind, body->b, body->n);
    int rc = rpc_stream_send_raw(s, req.b, req.n, st);
    ProtobufCMessage *msg = NULL;
    if (!rc) rc = rpc_stream_recv(s, &fusion__session_reply__descriptor, &msg, 10000, st);
    rpc_msg_free(msg);
    return rc;
}

/* OpenSession{session_id = id[0..n), max_length 16, wire_dtype F32} as raw bytes on a new stream. */
static int open_raw(fixture *f, rpc_stream **s, const char *id, size_t n, rpc_status *st) {
    assert_int_equal(rpc_stream_open(f->ch, RPC_SHARD_SESSION, 10000, s, st), RPC_OK);
    pbuf open = {0};
    pb_bytes(&open, 1, id, n);
    pb_uint(&open, 2, 16);
    pb_uint(&open, 3, 1);
    return send_raw(*s, 1, &open, st);
}

static void expect_code(int rc, int code, const rpc_status *st, const char *needle) {
    if (rc != code || !strstr(st->message, needle))
        fail_msg("expected %s containing '%s', got %s: %s", rpc_code_str(code), needle, rpc_code_str(rc),
                 st->message);
}

/* A session id is 1..128 printable bytes: an embedded NUL (which a C string would silently cut
 * at), a control character or 129 bytes are refused, and the server goes on serving. */
static void test_session_id_bytes_refused(void **state) {
    fixture f;
    start(&f, 0, 2, true, false);
    rpc_stream *s;
    rpc_status st;
    expect_code(open_raw(&f, &s, "a\0b", 3, &st), RPC_INVALID_ARGUMENT, &st, "session_id");
    rpc_stream_free(s);
    expect_code(open_raw(&f, &s, "a\nb", 3, &st), RPC_INVALID_ARGUMENT, &st, "session_id");
    rpc_stream_free(s);
    char long_id[129];
    memset(long_id, 'x', sizeof long_id);
    expect_code(open_raw(&f, &s, long_id, sizeof long_id, &st), RPC_INVALID_ARGUMENT, &st, "session_id");
    rpc_stream_free(s);
    assert_int_equal(open_raw(&f, &s, long_id, 128, &st), RPC_OK);
    rpc_stream_free(s);
    stop(&f);
}

/* Token ids that do not fit int32 (2^40, 2^32 + 1: both look valid once truncated) and negative
 * ones are refused with INVALID_ARGUMENT naming the field; so are logit-bias tokens beyond
 * int32. The session and server stay usable. */
static void test_token_ids_beyond_int32_refused(void **state) {
    fixture f;
    start(&f, 0, 4, true, true);
    const uint64_t bad[] = {1ull << 40, (1ull << 32) + 1, (uint64_t)-1};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        rpc_stream *s;
        rpc_status st;
        char id[16];
        snprintf(id, sizeof id, "tok-%zu", i);
        assert_int_equal(open_raw(&f, &s, id, strlen(id), &st), RPC_OK);
        pbuf packed = {0}, input = {0}, step = {0};
        pb_varint(&packed, 1);
        pb_varint(&packed, bad[i]);
        pb_bytes(&input, 1, packed.b, packed.n); /* Input.tokens, packed */
        pb_bytes(&step, 3, input.b, input.n);    /* StepRequest.input */
        expect_code(send_raw(s, 2, &step, &st), RPC_INVALID_ARGUMENT, &st, "tokens");
        rpc_stream_free(s);
    }
    /* logit_bias { token: 2^40 } */
    rpc_stream *s;
    rpc_status st;
    assert_int_equal(open_raw(&f, &s, "bias", 4, &st), RPC_OK);
    pbuf bias = {0}, samp = {0}, spec = {0}, input = {0}, step = {0};
    pb_uint(&bias, 1, 1ull << 40);
    pb_bytes(&samp, 9, bias.b, bias.n);  /* Sampling.logit_bias */
    pb_bytes(&spec, 3, samp.b, samp.n);  /* OutputSpec.sampling */
    pb_uint(&input, 1, 1);               /* Input.tokens = [1], unpacked */
    pb_bytes(&step, 3, input.b, input.n);
    pb_bytes(&step, 4, spec.b, spec.n);  /* StepRequest.output */
    expect_code(send_raw(s, 2, &step, &st), RPC_INVALID_ARGUMENT, &st, "logit_bias");
    rpc_stream_free(s);
    stop(&f);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_info_and_good_session),
        cmocka_unit_test(test_bad_steps),
        cmocka_unit_test(test_bad_opens_and_auth),
        cmocka_unit_test(test_sessions_free_memory_when_dropped_or_idle),
        cmocka_unit_test(test_move_beside_old_span),
        cmocka_unit_test(test_session_id_bytes_refused),
        cmocka_unit_test(test_token_ids_beyond_int32_refused),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
