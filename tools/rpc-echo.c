/* rpc-echo.c -- a stand-in shard server: fusion.Shard with fixed, checkable answers (RPC tests).
 *
 *   FUSION_SWARM_SECRET=... fusion-rpc-echo [--address HOST:PORT]
 *       [--tls-cert PEM --tls-key PEM | --insecure] [--max-message BYTES]
 *
 * Prints "port N" on stdout once serving; SIGTERM or SIGINT drains (grace
 * 2 s) and exits 0. No model: every answer is a fixed function of the
 * request, so a client written independently can check it:
 *   Info    -> model "fusion-rpc-echo", span [4, 12) of 32, hidden 8, ...
 *   Health  -> SERVING
 *   Forward -> per sequence: tokens t -> t + 1; F32 hidden x -> 2x + 1
 *   Session -> open: OpenReply (max_length, wire dtype BF16 if unspecified);
 *              step: the same transform, position = start + n; start must
 *              equal the length (after rollback_to), else OUT_OF_RANGE; going
 *              past max_length is RESOURCE_EXHAUSTED; close ends the stream.
 */
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fusion.pb-c.h"
#include "log.h"
#include "options.h"
#include "rpc.h"
#include "status.h"

#define ECHO_FIRST 4
#define ECHO_LAST 12

typedef struct echo_server {
    atomic_int sessions;
    size_t max_msg;
} echo_server;

static int64_t *copy_i64(const int64_t *v, size_t n) {
    int64_t *out = malloc(n ? n * sizeof *out : 1);
    if (out && n) memcpy(out, v, n * sizeof *out);
    return out;
}

/* Fills `out` (heap fields, free_unpacked-compatible) from `in`: tokens + 1,
 * F32 hidden 2x + 1. Returns an rpc code. */
static int transform(const Fusion__Input *in, Fusion__Output *out, int64_t *n_pos,
                     rpc_status *st) {
    fusion__output__init(out);
    *n_pos = 0;
    if (!in) return rpc_status_setf(st, RPC_INVALID_ARGUMENT, "input missing");
    if (in->n_tokens) {
        out->tokens = malloc(in->n_tokens * sizeof *out->tokens);
        if (!out->tokens) return rpc_status_setf(st, RPC_RESOURCE_EXHAUSTED, "out of memory");
        for (size_t i = 0; i < in->n_tokens; i++) out->tokens[i] = in->tokens[i] + 1;
        out->n_tokens = in->n_tokens;
        *n_pos = (int64_t)in->n_tokens;
    }
    const Fusion__Tensor *h = in->hidden;
    if (h) {
        if (h->dtype != FUSION__DTYPE__DTYPE_F32 || h->n_shape != 2 || h->shape[0] < 0 ||
            h->shape[1] < 0 || h->shape[1] > (1 << 20) ||
            (uint64_t)h->shape[0] * (uint64_t)h->shape[1] * 4 != h->data.len)
            return rpc_status_setf(st, RPC_INVALID_ARGUMENT,
                                   "hidden: want F32 (n, d) with n*d*4 bytes of data");
        if (in->n_tokens && (int64_t)in->n_tokens != h->shape[0])
            return rpc_status_setf(st, RPC_INVALID_ARGUMENT, "tokens and hidden disagree");
        Fusion__Tensor *t = malloc(sizeof *t);
        if (!t) return rpc_status_setf(st, RPC_RESOURCE_EXHAUSTED, "out of memory");
        fusion__tensor__init(t);
        out->hidden = t;
        t->dtype = FUSION__DTYPE__DTYPE_F32;
        t->shape = copy_i64(h->shape, 2);
        t->data.data = malloc(h->data.len ? h->data.len : 1);
        if (!t->shape || !t->data.data)
            return rpc_status_setf(st, RPC_RESOURCE_EXHAUSTED, "out of memory");
        t->n_shape = 2;
        t->data.len = h->data.len;
        for (size_t i = 0; i < h->data.len / 4; i++) {
            float x;
            memcpy(&x, h->data.data + 4 * i, 4);
            x = 2 * x + 1;
            memcpy(t->data.data + 4 * i, &x, 4);
        }
        *n_pos = h->shape[0];
    }
    if (*n_pos == 0) return rpc_status_setf(st, RPC_INVALID_ARGUMENT, "empty input");
    return RPC_OK;
}

static int on_info(void *ctx, const ProtobufCMessage *req, ProtobufCMessage **reply,
                   rpc_status *st) {
    echo_server *es = ctx;
    static Fusion__Dtype wire[] = {FUSION__DTYPE__DTYPE_F32, FUSION__DTYPE__DTYPE_BF16};
    Fusion__InfoReply *r = malloc(sizeof *r);
    if (!r) return rpc_status_setf(st, RPC_RESOURCE_EXHAUSTED, "out of memory");
    fusion__info_reply__init(r);
    r->model_name = strdup("fusion-rpc-echo");
    r->dtype = strdup("f32");
    r->device = strdup("cpu");
    r->version = strdup("0.1.0");
    r->wire_dtypes = malloc(sizeof wire);
    if (!r->model_name || !r->dtype || !r->device || !r->version || !r->wire_dtypes) {
        rpc_msg_free(&r->base);
        return rpc_status_setf(st, RPC_RESOURCE_EXHAUSTED, "out of memory");
    }
    memcpy(r->wire_dtypes, wire, sizeof wire);
    r->n_wire_dtypes = 2;
    r->n_layers = 32;
    r->first_block = ECHO_FIRST;
    r->last_block = ECHO_LAST;
    r->tokens_per_s = 123.5;
    r->free_kv_bytes = (int64_t)1 << 30;
    r->total_kv_bytes = (int64_t)2 << 30;
    r->active_sessions = atomic_load(&es->sessions);
    r->hidden_size = 8;
    r->vocab_size = 100;
    r->max_length = 4096;
    r->max_message_bytes = (int64_t)es->max_msg;
    *reply = &r->base;
    return RPC_OK;
}

static int on_health(void *ctx, const ProtobufCMessage *req, ProtobufCMessage **reply,
                     rpc_status *st) {
    Fusion__HealthReply *r = malloc(sizeof *r);
    if (!r) return rpc_status_setf(st, RPC_RESOURCE_EXHAUSTED, "out of memory");
    fusion__health_reply__init(r);
    r->status = FUSION__HEALTH_REPLY__SERVING_STATUS__SERVING_STATUS_SERVING;
    *reply = &r->base;
    return RPC_OK;
}

static int on_forward(void *ctx, const ProtobufCMessage *req, ProtobufCMessage **reply,
                      rpc_status *st) {
    const Fusion__ForwardRequest *f = (const Fusion__ForwardRequest *)req;
    if (f->n_sequences == 0) return rpc_status_setf(st, RPC_INVALID_ARGUMENT, "no sequences");
    Fusion__ForwardReply *r = malloc(sizeof *r);
    if (!r) return rpc_status_setf(st, RPC_RESOURCE_EXHAUSTED, "out of memory");
    fusion__forward_reply__init(r);
    *reply = &r->base; /* freed by the layer on error too */
    r->request_id = f->request_id;
    r->outputs = calloc(f->n_sequences, sizeof *r->outputs);
    if (!r->outputs) return rpc_status_setf(st, RPC_RESOURCE_EXHAUSTED, "out of memory");
    for (size_t i = 0; i < f->n_sequences; i++) {
        if (!(r->outputs[i] = malloc(sizeof *r->outputs[i])))
            return rpc_status_setf(st, RPC_RESOURCE_EXHAUSTED, "out of memory");
        r->n_outputs = i + 1;
        int64_t n;
        int rc = transform(f->sequences[i], r->outputs[i], &n, st);
        if (rc != RPC_OK) {
            char msg[sizeof st->message + 32];
            snprintf(msg, sizeof msg, "sequence %zu: %s", i, st->message);
            return rpc_status_setf(st, rc, "%s", msg);
        }
    }
    return RPC_OK;
}

/* One session: open, then steps until close, half-close or an error. */
static int on_session(void *ctx, rpc_stream *s, rpc_status *st) {
    echo_server *es = ctx;
    ProtobufCMessage *m;
    int rc = rpc_stream_recv(s, NULL, &m, 10000, st);
    if (rc != RPC_OK) return rc;
    const Fusion__SessionRequest *req = (const Fusion__SessionRequest *)m;
    if (req->kind_case != FUSION__SESSION_REQUEST__KIND_OPEN) {
        rpc_msg_free(m);
        return rpc_status_setf(st, RPC_FAILED_PRECONDITION, "the first message must be open");
    }
    const Fusion__OpenSession *open = req->open;
    if (!open->session_id.len || open->max_length <= 0) {
        rpc_msg_free(m);
        return rpc_status_setf(st, RPC_INVALID_ARGUMENT, "session_id and max_length > 0 required");
    }
    int64_t max_len = open->max_length, len = 0;
    Fusion__OpenReply opened = FUSION__OPEN_REPLY__INIT;
    char sid[129];
    snprintf(sid, sizeof sid, "%.*s", (int)(open->session_id.len < 128 ? open->session_id.len : 128),
             (const char *)open->session_id.data);
    opened.session_id = sid;
    opened.first_block = ECHO_FIRST;
    opened.last_block = ECHO_LAST;
    opened.max_length = open->max_length;
    opened.wire_dtype = open->wire_dtype ? open->wire_dtype : FUSION__DTYPE__DTYPE_BF16;
    opened.kv_bytes = max_len * 64;
    Fusion__SessionReply reply = FUSION__SESSION_REPLY__INIT;
    reply.kind_case = FUSION__SESSION_REPLY__KIND_OPENED;
    reply.opened = &opened;
    rc = rpc_stream_send(s, &reply.base, st);
    rpc_msg_free(m);
    if (rc != RPC_OK) return rc;
    atomic_fetch_add(&es->sessions, 1);
    for (;;) {
        rc = rpc_stream_recv(s, NULL, &m, -1, st);
        if (rc != RPC_OK) break;
        req = (const Fusion__SessionRequest *)m;
        if (req->kind_case == FUSION__SESSION_REQUEST__KIND_CLOSE) {
            rpc_msg_free(m);
            rc = RPC_OK;
            break;
        }
        if (req->kind_case != FUSION__SESSION_REQUEST__KIND_STEP) {
            rpc_msg_free(m);
            rc = rpc_status_setf(st, RPC_INVALID_ARGUMENT, "expected a step or close");
            break;
        }
        const Fusion__StepRequest *step = req->step;
        if (step->rollback_case == FUSION__STEP_REQUEST__ROLLBACK_ROLLBACK_TO) {
            if (step->rollback_to < 0 || step->rollback_to > len) {
                rpc_msg_free(m);
                rc = rpc_status_setf(st, RPC_OUT_OF_RANGE, "rollback_to %lld past length %lld",
                                     (long long)step->rollback_to, (long long)len);
                break;
            }
            len = step->rollback_to;
        }
        if (step->start_position != len) {
            rpc_msg_free(m);
            rc = rpc_status_setf(st, RPC_OUT_OF_RANGE, "start_position %lld != length %lld",
                                 (long long)step->start_position, (long long)len);
            break;
        }
        Fusion__StepReply sr = FUSION__STEP_REPLY__INIT;
        Fusion__Output out;
        int64_t n;
        rc = transform(step->input, &out, &n, st);
        if (rc == RPC_OK && len + n > max_len)
            rc = rpc_status_setf(st, RPC_RESOURCE_EXHAUSTED,
                                 "%lld positions exceed max_length %lld", (long long)(len + n),
                                 (long long)max_len);
        if (rc == RPC_OK) {
            len += n;
            sr.request_id = step->request_id;
            sr.position = len;
            sr.output = &out;
            reply.kind_case = FUSION__SESSION_REPLY__KIND_STEP;
            reply.step = &sr;
            rc = rpc_stream_send(s, &reply.base, st);
        }
        /* out's fields are heap: free them through a heap copy of the struct */
        Fusion__Output *heap = malloc(sizeof *heap);
        if (heap) {
            *heap = out;
            rpc_msg_free(&heap->base);
        }
        rpc_msg_free(m);
        if (rc != RPC_OK) break;
    }
    atomic_fetch_sub(&es->sessions, 1);
    return rc == RPC_END_OF_STREAM ? RPC_OK : rc;
}

/* What the command line gives. */
typedef struct echo_args {
    char *address, *tls_cert, *tls_key;
    bool insecure;
    size_t max_message;
} echo_args;

static echo_args args;

static const fu_opt echo_options[] = {
    {"address", 0, FU_OPT_STRING, FU_OPT_TO(args.address), "HOST:PORT", "where to listen", .def = "127.0.0.1:0"},
    {"tls-cert", 0, FU_OPT_STRING, FU_OPT_TO(args.tls_cert), "PEM", "serve TLS with this certificate"},
    {"tls-key", 0, FU_OPT_STRING, FU_OPT_TO(args.tls_key), "PEM", "and this key"},
    {"insecure", 0, FU_OPT_FLAG, FU_OPT_TO(args.insecure), .help = "plaintext, loopback addresses only"},
    {"max-message", 0, FU_OPT_INT, FU_OPT_TO(args.max_message), "BYTES",
     "bound on one message each way (default: the RPC default)", .lo = 0, .hi = 1L << 40},
    FU_OPT_END,
};

static const fu_opt_spec echo_spec = {
    "fusion-rpc-echo", "usage: FUSION_SWARM_SECRET=... fusion-rpc-echo [options]", echo_options, NULL};

int main(int argc, char **argv) {
    int status = fu_opt_main(&echo_spec, argc, argv, NULL);
    if (status >= 0) return status;
    rpc_server_options o = {.address = args.address, .tls_cert = args.tls_cert, .tls_key = args.tls_key,
                            .allow_insecure = args.insecure, .max_message_bytes = args.max_message,
                            .secret = getenv("FUSION_SWARM_SECRET")};
    /* Block the signals before any thread starts; the main thread waits for them. */
    sigset_t sigs;
    sigemptyset(&sigs);
    sigaddset(&sigs, SIGTERM);
    sigaddset(&sigs, SIGINT);
    pthread_sigmask(SIG_BLOCK, &sigs, NULL);
    echo_server es = {.max_msg = o.max_message_bytes ? o.max_message_bytes
                                                     : RPC_DEFAULT_MAX_MESSAGE};
    rpc_server *srv;
    if (rpc_server_new(&o, &srv) ||
        rpc_server_add_unary(srv, RPC_SHARD_INFO, &fusion__info_request__descriptor, on_info,
                             NULL, &es) ||
        rpc_server_add_unary(srv, RPC_SHARD_HEALTH, &fusion__health_request__descriptor,
                             on_health, NULL, &es) ||
        rpc_server_add_unary(srv, RPC_SHARD_FORWARD, &fusion__forward_request__descriptor,
                             on_forward, NULL, &es) ||
        rpc_server_add_stream(srv, RPC_SHARD_SESSION, &fusion__session_request__descriptor,
                              on_session, &es) ||
        rpc_server_start(srv)) {
        fprintf(stderr, "fusion-rpc-echo: %s\n", fu_last_error());
        rpc_server_free(srv);
        fu_opt_free(echo_options);
        return 1;
    }
    printf("port %d\n", rpc_server_port(srv));
    fflush(stdout);
    int sig;
    sigwait(&sigs, &sig);
    FU_INFO("fusion-rpc-echo: signal %d, draining", sig);
    rpc_server_shutdown(srv, 2000);
    rpc_server_free(srv);
    fu_opt_free(echo_options);
    return 0;
}
