/* test_wire_ranges.c -- integer fields beyond int32 on the wire are refused by the typed services,
 * never truncated: each class of field (a session's open and its hops, a step's output options and
 * tensors, Forward and Echo, the shard's replies to a client, the swarm's member status and join
 * reply) carries 2^40 -- which an int32 decoder reads as 0 -- and the receiver answers
 * INVALID_ARGUMENT naming the field. Messages are written byte by byte (test-pb.h), as a peer would
 * send them. */
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
#include "shard-svc.h"
#include "status.h"
#include "swarm-svc.h"
#include "test-pb.h"

#define SECRET "unit-secret-wire-ranges"
#define HUGE (1ull << 40) /* 0 once truncated to 32 bits */

static void expect_code(int rc, int code, const rpc_status *st, const char *needle) {
    if (rc != code || !strstr(st->message, needle))
        fail_msg("expected %s containing '%s', got %s: %s", rpc_code_str(code), needle, rpc_code_str(rc),
                 st->message);
}

/* Decodes SessionRequest{kind `kind` (1 open, 2 step) = body} through the typed service. */
static int decode(int kind, const pbuf *body, rpc_status *st) {
    pbuf req = {0};
    pb_msg(&req, kind, body);
    const shard_svc_request *r = NULL;
    int rc = shard_svc_request_decode(req.b, req.n, 1 << 20, &r, st);
    shard_svc_request_free(r);
    return rc;
}

/* OpenSession: every scalar, and a hop's blocks; a negative int32 sender's value still decodes. */
static void test_open_fields(void **state) {
    (void)state;
    const struct {
        int field;
        const char *name;
    } f[] = {{2, "open.max_length"}, {4, "open.int8_block_size"}, {6, "open.first_block"},
             {7, "open.last_block"}, {9, "open.idle_timeout_ms"}};
    rpc_status st;
    for (size_t i = 0; i < sizeof f / sizeof f[0]; i++) {
        pbuf open = {0};
        pb_bytes(&open, 1, "s", 1);
        pb_uint(&open, f[i].field, HUGE);
        expect_code(decode(1, &open, &st), RPC_INVALID_ARGUMENT, &st, f[i].name);
    }
    for (int field = 2; field <= 3; field++) {
        pbuf hop = {0}, open = {0};
        pb_bytes(&hop, 1, "a:1", 3);
        pb_uint(&hop, field, HUGE);
        pb_bytes(&open, 1, "s", 1);
        pb_msg(&open, 8, &hop);
        expect_code(decode(1, &open, &st), RPC_INVALID_ARGUMENT, &st,
                    field == 2 ? "open.chain.first_block" : "open.chain.last_block");
    }
    pbuf open = {0};
    pb_bytes(&open, 1, "s", 1);
    pb_uint(&open, 9, (uint64_t)-1); /* idle_timeout_ms -1, as an int32 sender writes it */
    pbuf req = {0};
    pb_msg(&req, 1, &open);
    const shard_svc_request *r = NULL;
    assert_int_equal(shard_svc_request_decode(req.b, req.n, 1 << 20, &r, &st), RPC_OK);
    assert_int_equal(r->open->idle_timeout_ms, -1); /* the receiver's own check refuses it */
    shard_svc_request_free(r);
}

/* StepRequest: OutputSpec.top_logprobs, Sampling.top_k, the input tensor's block_size. */
static void test_step_fields(void **state) {
    (void)state;
    rpc_status st;
    pbuf spec = {0}, step = {0};
    pb_uint(&spec, 4, HUGE);
    pb_msg(&step, 4, &spec);
    expect_code(decode(2, &step, &st), RPC_INVALID_ARGUMENT, &st, "output.top_logprobs");
    pbuf samp = {0};
    pb_uint(&samp, 3, HUGE);
    spec = (pbuf){0};
    pb_msg(&spec, 3, &samp);
    step = (pbuf){0};
    pb_msg(&step, 4, &spec);
    expect_code(decode(2, &step, &st), RPC_INVALID_ARGUMENT, &st, "output.sampling.top_k");
    pbuf tensor = {0}, input = {0};
    pb_uint(&tensor, 1, 4); /* INT8_BLOCK */
    pb_uint(&tensor, 5, HUGE);
    pb_msg(&input, 2, &tensor);
    step = (pbuf){0};
    pb_msg(&step, 3, &input);
    expect_code(decode(2, &step, &st), RPC_INVALID_ARGUMENT, &st, "input.hidden.block_size");
}

/* ---- Forward and Echo on a typed server ------------------------------------------------------ */

static atomic_int forward_calls;

static int count_forward(void *ctx, const shard_svc_forward *req, shard_svc_forward_reply *reply, void **hold,
                         rpc_status *st) {
    (void)ctx, (void)req, (void)reply, (void)hold;
    atomic_fetch_add(&forward_calls, 1);
    return rpc_status_setf(st, RPC_UNIMPLEMENTED, "not here");
}

static const shard_svc_handlers fwd_handlers = {.forward = count_forward};

/* A server with `register_fn` run on it before start, and a channel to it. */
static rpc_server *server_start(int (*register_fn)(rpc_server *), rpc_channel **ch) {
    rpc_server_options o = {.address = "127.0.0.1:0", .secret = SECRET, .allow_insecure = true, .n_workers = 2};
    rpc_server *srv;
    assert_int_equal(rpc_server_new(&o, &srv), FU_OK);
    assert_int_equal(register_fn(srv), FU_OK);
    assert_int_equal(rpc_server_start(srv), FU_OK);
    char addr[64];
    snprintf(addr, sizeof addr, "127.0.0.1:%d", rpc_server_port(srv));
    rpc_channel_options co = {.insecure = true, .secret = SECRET};
    assert_int_equal(rpc_channel_new(addr, &co, ch), FU_OK);
    return srv;
}

static int serve_forward(rpc_server *srv) { return shard_svc_serve(srv, &fwd_handlers); }

/* Calls `method` with raw request bytes; the reply (if any) is of type desc and dropped. */
static int call_raw(rpc_channel *ch, const char *method, const pbuf *req, const ProtobufCMessageDescriptor *desc,
                    rpc_status *st) {
    ProtobufCMessage *rep = NULL;
    int rc = rpc_call_unary_raw(ch, method, req->b, req->n, desc, &rep, 5000, st);
    rpc_msg_free(rep);
    return rc;
}

/* ForwardRequest's blocks and a sequence's tensor, and EchoRequest.reply_bytes (2^40 would read as 0
 * bytes: a valid request). Refused before the handler runs. */
static void test_forward_and_echo_fields(void **state) {
    (void)state;
    rpc_channel *ch;
    rpc_server *srv = server_start(serve_forward, &ch);
    rpc_status st;
    for (int field = 6; field <= 7; field++) {
        pbuf input = {0}, req = {0};
        pb_uint(&input, 1, 1);
        pb_msg(&req, 2, &input);
        pb_uint(&req, field, HUGE);
        expect_code(call_raw(ch, RPC_SHARD_FORWARD, &req, &fusion__forward_reply__descriptor, &st),
                    RPC_INVALID_ARGUMENT, &st, field == 6 ? "first_block" : "last_block");
    }
    pbuf tensor = {0}, input = {0}, req = {0};
    pb_uint(&tensor, 5, HUGE);
    pb_msg(&input, 2, &tensor);
    pb_msg(&req, 2, &input);
    expect_code(call_raw(ch, RPC_SHARD_FORWARD, &req, &fusion__forward_reply__descriptor, &st), RPC_INVALID_ARGUMENT,
                &st, "sequences[0].hidden.block_size");
    assert_int_equal(atomic_load(&forward_calls), 0);
    pbuf echo = {0};
    pb_uint(&echo, 2, HUGE);
    expect_code(call_raw(ch, RPC_SHARD_ECHO, &echo, &fusion__echo_reply__descriptor, &st), RPC_INVALID_ARGUMENT,
                &st, "reply_bytes");
    rpc_channel_free(ch);
    rpc_server_free(srv);
}

/* ---- a peer's replies ------------------------------------------------------------------------ */

/* Info answered with a message whose field 2 (InfoReply.n_layers) is 2^40: a StepRequest's
 * start_position has that number and wire type. */
static int huge_info(void *ctx, const ProtobufCMessage *req, ProtobufCMessage **reply, rpc_status *st) {
    (void)ctx, (void)req, (void)st;
    Fusion__StepRequest *r = malloc(sizeof *r);
    fusion__step_request__init(r);
    r->start_position = (int64_t)HUGE;
    *reply = &r->base;
    return RPC_OK;
}

/* Info answered with step tables of two prompt sizes but one time. */
static int uneven_steps_info(void *ctx, const ProtobufCMessage *req, ProtobufCMessage **reply, rpc_status *st) {
    (void)ctx, (void)req, (void)st;
    Fusion__InfoReply *r = malloc(sizeof *r);
    fusion__info_reply__init(r);
    r->n_layers = 4, r->last_block = 4;
    r->n_prompt_step_tokens = 2, r->prompt_step_tokens = malloc(2 * sizeof(double));
    r->prompt_step_tokens[0] = 16, r->prompt_step_tokens[1] = 64;
    r->n_prompt_step_s = 1, r->prompt_step_s = malloc(sizeof(double));
    r->prompt_step_s[0] = 0.001;
    *reply = &r->base;
    return RPC_OK;
}

static int serve_uneven_info(rpc_server *srv) {
    return rpc_server_add_unary(srv, RPC_SHARD_INFO, &fusion__info_request__descriptor, uneven_steps_info, NULL, NULL);
}

/* StepReply bodies, one per step: output.tokens, a top-logprob entry's token, a timing's first
 * block, the output tensor's block_size -- each 2^40. */
static void bad_step_reply(int k, pbuf *step) {
    pbuf out = {0}, inner = {0}, entry = {0};
    *step = (pbuf){0};
    if (k == 0) {
        pb_varint(&inner, HUGE); /* packed repeated tokens */
        pb_bytes(&out, 3, inner.b, inner.n);
    } else if (k == 1) {
        pb_uint(&entry, 1, HUGE);
        pb_msg(&inner, 1, &entry);
        pb_msg(&out, 5, &inner);
    } else if (k == 2) {
        pb_uint(&inner, 2, HUGE);
        pb_msg(step, 4, &inner);
        return;
    } else {
        pb_uint(&inner, 5, HUGE);
        pb_msg(&out, 1, &inner);
    }
    pb_msg(step, 3, &out);
}

/* A Session peer: opens, then answers every step with the next bad reply. */
static int bad_session(void *ctx, rpc_stream *s, rpc_status *st) {
    (void)ctx;
    ProtobufCMessage *msg = NULL;
    for (int k = -1;; k++) {
        int rc = rpc_stream_recv(s, NULL, &msg, 5000, st);
        rpc_msg_free(msg);
        if (rc) return rc == RPC_END_OF_STREAM ? RPC_OK : rc;
        pbuf body = {0}, rep = {0};
        if (k >= 0) bad_step_reply(k, &body);
        pb_msg(&rep, k < 0 ? 1 : 2, &body); /* SessionReply.opened / .step */
        if ((rc = rpc_stream_send_raw(s, rep.b, rep.n, st))) return rc;
    }
}

/* Join answered with field 2 (JoinReply.heartbeat_ms) 2^40, as huge_info. */
static int serve_bad_peer(rpc_server *srv) {
    int rc = rpc_server_add_unary(srv, RPC_SHARD_INFO, &fusion__info_request__descriptor, huge_info, NULL, NULL);
    if (!rc) rc = rpc_server_add_unary(srv, RPC_SWARM_JOIN, &fusion__join_request__descriptor, huge_info, NULL, NULL);
    if (!rc)
        rc = rpc_server_add_stream(srv, RPC_SHARD_SESSION, &fusion__session_request__descriptor, bad_session, NULL);
    return rc;
}

/* A client refuses a peer's reply carrying a value its view cannot hold: Info, step outputs and
 * timings, and the swarm's Join reply. */
static void test_reply_fields(void **state) {
    (void)state;
    rpc_channel *ch;
    rpc_server *srv = server_start(serve_bad_peer, &ch);
    rpc_status st;
    shard_svc_info *info = NULL;
    expect_code(shard_svc_info_get(ch, 5000, &info, &st), RPC_INVALID_ARGUMENT, &st, "info.n_layers");
    assert_null(info);
    rpc_channel *ch2;
    rpc_server *srv2 = server_start(serve_uneven_info, &ch2);
    expect_code(shard_svc_info_get(ch2, 5000, &info, &st), RPC_INVALID_ARGUMENT, &st, "step tables");
    assert_null(info);
    rpc_channel_free(ch2);
    rpc_server_free(srv2);
    shard_svc_open open = {.session_id = "s", .max_length = 8};
    shard_svc_session *sess;
    assert_int_equal(shard_svc_session_open(ch, &open, 5000, &sess, &st), RPC_OK);
    const char *needles[] = {"output.tokens[0]", "output.top_logprobs.entries.token", "timing.first_block",
                             "output.hidden.block_size"};
    int32_t tok = 1;
    shard_svc_input in = {&tok, 1, NULL};
    shard_svc_step step = {.input = &in};
    for (int k = 0; k < 4; k++) {
        const shard_svc_step_reply *rep = NULL;
        expect_code(shard_svc_session_step(sess, &step, &rep, &st), RPC_INVALID_ARGUMENT, &st, needles[k]);
    }
    shard_svc_session_close(sess, NULL);
    swarm_svc_member m = {.address = "127.0.0.1:9", .n_layers = 4};
    swarm_svc_join_reply jr;
    expect_code(swarm_svc_join(ch, &m, 5000, &jr, &st), RPC_INVALID_ARGUMENT, &st, "heartbeat_ms");
    assert_int_equal(jr.heartbeat_ms, 0);
    rpc_channel_free(ch);
    rpc_server_free(srv);
}

/* ---- the swarm's member status ---------------------------------------------------------------- */

static atomic_int swarm_calls;

static int count_join(void *ctx, const swarm_svc_member *m, swarm_svc_join_reply *out, rpc_status *st) {
    (void)ctx, (void)m, (void)out, (void)st;
    atomic_fetch_add(&swarm_calls, 1);
    return RPC_OK;
}

static int count_heartbeat(void *ctx, const swarm_svc_heartbeat_request *req, swarm_svc_heartbeat_reply *out,
                           rpc_status *st) {
    (void)ctx, (void)req, (void)out, (void)st;
    atomic_fetch_add(&swarm_calls, 1);
    return RPC_OK;
}

static const swarm_svc_handlers swarm_handlers = {NULL, count_join, count_heartbeat};

static int serve_swarm(rpc_server *srv) { return swarm_svc_serve(srv, &swarm_handlers); }

/* Every count and block of a MemberStatus, in a Join and in a Heartbeat, refused before the
 * gateway's handler runs. */
static void test_member_status_fields(void **state) {
    (void)state;
    rpc_channel *ch;
    rpc_server *srv = server_start(serve_swarm, &ch);
    const struct {
        int field;
        const char *name;
    } f[] = {{3, "n_layers"},        {4, "first_block"},     {5, "last_block"},     {10, "max_blocks"},
             {14, "active_sessions"}, {17, "failed_first"},   {18, "failed_last"},   {20, "draining_first"},
             {21, "draining_last"},  {22, "draining_sessions"}, {23, "hidden_size"}};
    rpc_status st;
    for (size_t i = 0; i < sizeof f / sizeof f[0]; i++) {
        pbuf ms = {0}, join = {0}, hb = {0};
        pb_bytes(&ms, 1, "127.0.0.1:9", 11);
        pb_uint(&ms, f[i].field, HUGE);
        char needle[64];
        snprintf(needle, sizeof needle, "status.%s", f[i].name);
        pb_msg(&join, 1, &ms);
        expect_code(call_raw(ch, RPC_SWARM_JOIN, &join, &fusion__join_reply__descriptor, &st), RPC_INVALID_ARGUMENT,
                    &st, needle);
        pb_uint(&hb, 1, 1);
        pb_msg(&hb, 2, &ms);
        expect_code(call_raw(ch, RPC_SWARM_HEARTBEAT, &hb, &fusion__heartbeat_reply__descriptor, &st),
                    RPC_INVALID_ARGUMENT, &st, needle);
    }
    assert_int_equal(atomic_load(&swarm_calls), 0);
    rpc_channel_free(ch);
    rpc_server_free(srv);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_open_fields),
        cmocka_unit_test(test_step_fields),
        cmocka_unit_test(test_forward_and_echo_fields),
        cmocka_unit_test(test_reply_fields),
        cmocka_unit_test(test_member_status_fields),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
