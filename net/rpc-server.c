/* rpc-server.c -- the RPC layer's server: authentication, dispatch, unary calls and stream threads.
 *
 * Threads: n_workers threads drive the server's completion queue: they
 * receive new calls, check the swarm secret, run unary handlers and send
 * their replies. A stream call is bound to a completion queue of its own and
 * handed to a new thread that runs the handler and drives that queue directly
 * (no hand-off between threads per message). At most max_streams streams run
 * at once: one beyond is refused with RESOURCE_EXHAUSTED on the worker, before
 * a thread is created, so a flood of streams cannot exhaust threads or memory.
 *
 * Every method keeps RPC_SRV_REQUESTS calls requested from gRPC; a worker
 * re-requests as soon as one arrives. Calls to unregistered methods go to a
 * catch-all request and get UNIMPLEMENTED (after the secret check).
 */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <grpc/grpc_security.h>
#include <grpc/support/alloc.h>
#include <grpc/support/time.h>
#include <openssl/crypto.h>
#include <openssl/evp.h>

#include "clock.h"
#include "log.h"
#include "rpc-impl.h"
#include "status.h"

#define RPC_SRV_MAX_METHODS 32
#define RPC_SRV_REQUESTS 2 /* calls kept requested per method */
#define RPC_SRV_REJECT_WAIT_MS 2000

typedef struct srv_method {
    char *path;
    bool stream;
    const ProtobufCMessageDescriptor *desc;
    rpc_unary_fn unary;
    rpc_reply_free_fn free_reply;
    rpc_stream_fn stream_fn;
    void *ctx;
    void *handle; /* from grpc_server_register_method */
} srv_method;

/* One requested call. While `replying` is false it waits for gRPC to match a
 * call; then (unary and rejected calls) it carries the call until the reply
 * batch completes. Stream calls move into an rpc_stream instead. */
typedef struct srv_call {
    struct rpc_server *srv;
    srv_method *m;             /* NULL: the catch-all for unregistered methods */
    bool replying;
    grpc_call *call;
    grpc_completion_queue *cq; /* the call's queue: srv->cq, or its own for streams */
    gpr_timespec deadline;
    grpc_call_details details; /* catch-all only */
    grpc_metadata_array md;
    grpc_byte_buffer *payload; /* unary: the request */
    grpc_byte_buffer *reply;   /* unary: the reply in flight */
    grpc_slice status_msg;
    int cancelled;
} srv_call;

struct rpc_server {
    grpc_server *server;
    grpc_completion_queue *cq; /* new calls and unary calls */
    int port;
    size_t max_msg;
    unsigned char secret_hash[32];
    srv_method methods[RPC_SRV_MAX_METHODS];
    int n_methods;
    pthread_t *workers;
    int n_workers, n_started_workers;
    int max_streams;       /* stream calls running at once */
    bool started, shut;

    pthread_mutex_t mu;
    pthread_cond_t cv;     /* signalled when a count below drops or shutdown is notified */
    bool stopping;         /* no more requests */
    bool shutdown_notified;
    int n_requests;        /* srv_calls waiting for a call */
    int n_calls;           /* calls in flight (unary, rejected and streams) */
    int n_streams;         /* stream threads running */
    uint64_t n_refused;    /* streams refused at the cap (logged at powers of two) */
    char shutdown_tag;
};

static void sha256(const void *data, size_t n, unsigned char out[32]) {
    unsigned int len = 32;
    if (!EVP_Digest(data, n, out, &len, EVP_sha256(), NULL)) memset(out, 0, 32);
}

/* ---- calls ---------------------------------------------------------------------- */

static void call_free(srv_call *c) {
    if (!c) return;
    if (c->call) grpc_call_unref(c->call);
    if (c->cq && c->cq != c->srv->cq) rpc__cq_destroy(c->cq);
    if (!c->m) grpc_call_details_destroy(&c->details);
    grpc_metadata_array_destroy(&c->md);
    grpc_byte_buffer_destroy(c->payload);
    grpc_byte_buffer_destroy(c->reply);
    grpc_slice_unref(c->status_msg);
    free(c);
}

static void count_call_done(rpc_server *srv) {
    pthread_mutex_lock(&srv->mu);
    srv->n_calls--;
    pthread_cond_broadcast(&srv->cv);
    pthread_mutex_unlock(&srv->mu);
}

/* Requests one more call of method m (NULL: the catch-all) from gRPC. */
static void request_call(rpc_server *srv, srv_method *m) {
    srv_call *c = calloc(1, sizeof *c);
    if (!c) {
        FU_ERROR("rpc server: out of memory requesting a call");
        return;
    }
    c->srv = srv;
    c->m = m;
    c->status_msg = grpc_empty_slice();
    grpc_metadata_array_init(&c->md);
    c->cq = m && m->stream ? grpc_completion_queue_create_for_next(NULL) : srv->cq;
    pthread_mutex_lock(&srv->mu);
    srv->n_requests++;
    pthread_mutex_unlock(&srv->mu);
    grpc_call_error e;
    if (m) {
        e = grpc_server_request_registered_call(srv->server, m->handle, &c->call, &c->deadline,
                                                &c->md, m->stream ? NULL : &c->payload, c->cq,
                                                srv->cq, c);
    } else {
        grpc_call_details_init(&c->details);
        e = grpc_server_request_call(srv->server, &c->call, &c->details, &c->md, c->cq, srv->cq,
                                     c);
    }
    if (e != GRPC_CALL_OK) {
        FU_ERROR("rpc server: cannot request a call (%d)", (int)e);
        pthread_mutex_lock(&srv->mu);
        srv->n_requests--;
        pthread_cond_broadcast(&srv->cv);
        pthread_mutex_unlock(&srv->mu);
        call_free(c);
    }
}

/* Starts the final batch of a call handled on a worker: initial metadata, an
 * optional reply (c->reply), the status. Stream-bound calls (rejected before
 * their thread starts) complete synchronously. */
static void call_reply(srv_call *c, int code, const char *msg) {
    /* Once the batch starts, another worker may complete and free c. */
    rpc_server *srv = c->srv;
    bool sync = c->cq != srv->cq;
    c->replying = true;
    c->status_msg = grpc_slice_from_copied_string(msg ? msg : "");
    grpc_op ops[4];
    memset(ops, 0, sizeof ops);
    size_t n = 0;
    ops[n++].op = GRPC_OP_SEND_INITIAL_METADATA;
    if (c->reply) {
        ops[n].op = GRPC_OP_SEND_MESSAGE;
        ops[n++].data.send_message.send_message = c->reply;
    }
    ops[n].op = GRPC_OP_SEND_STATUS_FROM_SERVER;
    ops[n].data.send_status_from_server.status = (grpc_status_code)code;
    ops[n++].data.send_status_from_server.status_details = &c->status_msg;
    ops[n].op = GRPC_OP_RECV_CLOSE_ON_SERVER;
    ops[n++].data.recv_close_on_server.cancelled = &c->cancelled;
    grpc_call_error e = grpc_call_start_batch(c->call, ops, n, c, NULL);
    if (e != GRPC_CALL_OK) {
        FU_ERROR("rpc server: cannot send a reply (%d)", (int)e);
        grpc_call_cancel(c->call, NULL);
    }
    if (sync || e != GRPC_CALL_OK) {
        /* The batch ends as soon as the status is out; bound the wait anyway,
         * since a worker is blocked here. */
        if (e == GRPC_CALL_OK &&
            grpc_completion_queue_next(c->cq, rpc__deadline(RPC_SRV_REJECT_WAIT_MS), NULL).type ==
                GRPC_QUEUE_TIMEOUT) {
            grpc_call_cancel(c->call, NULL);
            grpc_completion_queue_next(c->cq, gpr_inf_future(GPR_CLOCK_MONOTONIC), NULL);
        }
        call_free(c);
        count_call_done(srv);
    }
}

/* True if the call's metadata carries the swarm secret (constant time). */
static bool call_authorized(const rpc_server *srv, const grpc_metadata_array *md) {
    for (size_t i = 0; i < md->count; i++) {
        if (grpc_slice_str_cmp(md->metadata[i].key, RPC_SECRET_KEY)) continue;
        unsigned char h[32];
        sha256(GRPC_SLICE_START_PTR(md->metadata[i].value),
               GRPC_SLICE_LENGTH(md->metadata[i].value), h);
        return CRYPTO_memcmp(h, srv->secret_hash, 32) == 0;
    }
    return false;
}

/* A handler's return value as a status code on the wire. */
static int wire_code(int code) {
    if (code == RPC_END_OF_STREAM) return RPC_OK;
    if (code < 0 || code > RPC_UNAUTHENTICATED) return RPC_UNKNOWN;
    return code;
}

static void run_unary(srv_call *c) {
    srv_method *m = c->m;
    rpc_status st = {RPC_OK, ""};
    ProtobufCMessage *req = NULL, *reply = NULL;
    int code;
    if (!c->payload)
        code = rpc_status_setf(&st, RPC_INVALID_ARGUMENT, "%s: the call carried no request",
                               m->path);
    else
        code = rpc__unpack(m->desc, c->payload, c->srv->max_msg, &req, &st);
    if (code == RPC_OK) {
        code = wire_code(m->unary(m->ctx, req, &reply, &st));
        if (code == RPC_OK && !reply)
            code = rpc_status_setf(&st, RPC_INTERNAL, "%s: the handler returned no reply",
                                   m->path);
        if (code == RPC_OK) code = rpc__pack(reply, c->srv->max_msg, &c->reply, &st);
        if (reply) {
            if (m->free_reply) m->free_reply(m->ctx, reply);
            else rpc_msg_free(reply);
        }
    }
    rpc_msg_free(req);
    call_reply(c, code, code == RPC_OK ? "" : st.message);
}

/* ---- streams -------------------------------------------------------------------- */

static void *stream_main(void *arg) {
    rpc_stream *s = arg;
    rpc_server *srv = s->srv;
    const srv_method *m = s->method;
    rpc_status st = {RPC_OK, ""};
    grpc_op op;
    memset(&op, 0, sizeof op);
    op.op = GRPC_OP_RECV_CLOSE_ON_SERVER;
    op.data.recv_close_on_server.cancelled = &s->cancelled;
    int code;
    if (grpc_call_start_batch(s->call, &op, 1, (void *)(intptr_t)RPC_TAG_END, NULL) ==
        GRPC_CALL_OK) {
        s->end_pending = true;
        code = wire_code(m->stream_fn(m->ctx, s, &st));
    } else {
        code = rpc_status_setf(&st, RPC_INTERNAL, "rpc: cannot start the stream");
    }
    while (s->send_pending) rpc__stream_pump(s, gpr_inf_future(GPR_CLOCK_MONOTONIC));
    grpc_slice msg = grpc_slice_from_copied_string(code == RPC_OK ? "" : st.message);
    grpc_op ops[2];
    memset(ops, 0, sizeof ops);
    size_t n = 0;
    if (!s->md_sent) ops[n++].op = GRPC_OP_SEND_INITIAL_METADATA;
    ops[n].op = GRPC_OP_SEND_STATUS_FROM_SERVER;
    ops[n].data.send_status_from_server.status = (grpc_status_code)code;
    ops[n++].data.send_status_from_server.status_details = &msg;
    if (grpc_call_start_batch(s->call, ops, n, (void *)(intptr_t)RPC_TAG_MISC, NULL) ==
        GRPC_CALL_OK)
        s->misc_pending = true;
    else
        grpc_call_cancel(s->call, NULL);
    /* After the status the call is over: a receive still in flight ends too. */
    rpc__stream_drain(s);
    grpc_slice_unref(msg);
    rpc__stream_destroy(s);
    pthread_mutex_lock(&srv->mu);
    srv->n_streams--;
    pthread_mutex_unlock(&srv->mu);
    count_call_done(srv);
    return NULL;
}

/* Takes one of the server's stream slots; false when max_streams run already (*refused: the
 * refusals so far, this one included). */
static bool stream_slot_take(rpc_server *srv, uint64_t *refused) {
    pthread_mutex_lock(&srv->mu);
    bool ok = srv->n_streams < srv->max_streams;
    if (ok) srv->n_streams++;
    else srv->n_refused++;
    *refused = srv->n_refused;
    pthread_mutex_unlock(&srv->mu);
    return ok;
}

/* Gives back a slot whose thread did not start. */
static void stream_slot_give(rpc_server *srv) {
    pthread_mutex_lock(&srv->mu);
    srv->n_streams--;
    pthread_mutex_unlock(&srv->mu);
}

/* Hands a stream call to a new thread (which then owns it), or refuses it when the server runs
 * max_streams already. */
static void start_stream(srv_call *c) {
    uint64_t refused;
    if (!stream_slot_take(c->srv, &refused)) {
        char msg[160];
        snprintf(msg, sizeof msg, "the server is at its cap of %d concurrent streams (sessions); retry later",
                 c->srv->max_streams);
        if ((refused & (refused - 1)) == 0) /* a flood logs a few lines, not one per stream */
            FU_WARN("rpc server: %s: %d streams run, the cap; %llu refused so far", c->m->path,
                    c->srv->max_streams, (unsigned long long)refused);
        call_reply(c, RPC_RESOURCE_EXHAUSTED, msg);
        return;
    }
    rpc_stream *s = calloc(1, sizeof *s);
    if (s) {
        s->server = true;
        s->call = c->call;
        s->cq = c->cq;
        s->max_msg = c->srv->max_msg;
        s->req_desc = c->m->desc;
        s->srv = c->srv;
        s->method = c->m;
        s->details = grpc_empty_slice();
        grpc_metadata_array_init(&s->initial_md);
        grpc_metadata_array_init(&s->trailing_md);
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        pthread_t t;
        int e = pthread_create(&t, &attr, stream_main, s);
        pthread_attr_destroy(&attr);
        if (e == 0) {
            c->call = NULL; /* moved into s */
            c->cq = NULL;
            call_free(c);
            return;
        }
        free(s);
    }
    stream_slot_give(c->srv);
    call_reply(c, RPC_RESOURCE_EXHAUSTED, "the server cannot start a stream thread");
}

/* ---- workers -------------------------------------------------------------------- */

static void call_arrived(rpc_server *srv, srv_call *c, bool ok) {
    pthread_mutex_lock(&srv->mu);
    srv->n_requests--;
    if (ok) srv->n_calls++;
    bool stopping = srv->stopping;
    pthread_cond_broadcast(&srv->cv);
    pthread_mutex_unlock(&srv->mu);
    if (!ok) { /* the request was cancelled by shutdown */
        call_free(c);
        return;
    }
    if (!stopping) request_call(srv, c->m);
    if (!call_authorized(srv, &c->md)) {
        char *peer = grpc_call_get_peer(c->call);
        FU_WARN("rpc server: refused a call to %s from %s: missing or wrong swarm secret",
                c->m ? c->m->path : "an unknown method", peer ? peer : "?");
        gpr_free(peer);
        call_reply(c, RPC_UNAUTHENTICATED, "missing or wrong swarm secret");
    } else if (!c->m) {
        char msg[200];
        snprintf(msg, sizeof msg, "unknown method %.*s", (int)GRPC_SLICE_LENGTH(c->details.method),
                 (const char *)GRPC_SLICE_START_PTR(c->details.method));
        call_reply(c, RPC_UNIMPLEMENTED, msg);
    } else if (c->m->stream) {
        start_stream(c);
    } else {
        run_unary(c);
    }
}

static void *worker_main(void *arg) {
    rpc_server *srv = arg;
    for (;;) {
        grpc_event ev =
            grpc_completion_queue_next(srv->cq, gpr_inf_future(GPR_CLOCK_MONOTONIC), NULL);
        if (ev.type == GRPC_QUEUE_SHUTDOWN) return NULL;
        if (ev.type != GRPC_OP_COMPLETE) continue;
        if (ev.tag == &srv->shutdown_tag) {
            pthread_mutex_lock(&srv->mu);
            srv->shutdown_notified = true;
            pthread_cond_broadcast(&srv->cv);
            pthread_mutex_unlock(&srv->mu);
            continue;
        }
        srv_call *c = ev.tag;
        if (c->replying) {
            call_free(c);
            count_call_done(srv);
        } else {
            call_arrived(srv, c, ev.success != 0);
        }
    }
}

/* ---- server --------------------------------------------------------------------- */

/* Reads a TLS server's pair and the CA of its clients (none: NULL). */
static int server_pems_load(const rpc_server_options *o, rpc_pems *p) {
    int rc = rpc__load_pem("certificate", o->tls_cert, &p->cert);
    if (!rc) rc = rpc__load_pem("private key", o->tls_key, &p->key);
    if (!rc && o->tls_client_ca)
        rc = rpc__load_pem("client CA certificate", o->tls_client_ca, &p->ca);
    if (rc) rpc__pems_free(p);
    return rc;
}

/* TLS with p's pair; with a client CA, the handshake of a client without a certificate
 * signed by it fails (mTLS). */
static grpc_server_credentials *server_tls_creds(const rpc_pems *p) {
    grpc_ssl_pem_key_cert_pair pair = {.private_key = p->key, .cert_chain = p->cert};
    return grpc_ssl_server_credentials_create_ex(
        p->ca, &pair, 1,
        p->ca ? GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY
                     : GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE,
        NULL);
}

int rpc_server_new(const rpc_server_options *o, rpc_server **out) {
    *out = NULL;
    if (!o || !o->address || !o->address[0])
        return fu_errorf(FU_ERR_INVALID, "rpc server: an address is required");
    int rc = rpc__check_secret(o->secret);
    if (rc) return rc;
    bool tls = o->tls_cert || o->tls_key;
    if (tls && !(o->tls_cert && o->tls_key))
        return fu_errorf(FU_ERR_INVALID, "rpc server: TLS needs both a certificate and a key");
    if (!tls && !o->allow_insecure)
        return fu_errorf(FU_ERR_INVALID,
                         "rpc server: TLS certificate and key required (plaintext needs "
                         "allow_insecure and a loopback address)");
    if (!tls && !rpc_address_is_loopback(o->address))
        return fu_errorf(FU_ERR_INVALID,
                         "rpc server: plaintext is only allowed on loopback; '%s' needs TLS",
                         o->address);
    if (o->tls_client_ca && !tls)
        return fu_errorf(FU_ERR_INVALID, "rpc server: client certificates (a client CA) need TLS: "
                                         "a certificate and key");
    rpc_pems pems = {0};
    if (tls && (rc = server_pems_load(o, &pems))) return rc;
    rpc_server *srv = calloc(1, sizeof *srv);
    if (!srv) {
        rpc__pems_free(&pems);
        return fu_errorf(FU_ERR_NOMEM, "rpc server: out of memory");
    }
    pthread_mutex_init(&srv->mu, NULL);
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&srv->cv, &ca);
    pthread_condattr_destroy(&ca);
    srv->max_msg = o->max_message_bytes ? o->max_message_bytes : RPC_DEFAULT_MAX_MESSAGE;
    if (srv->max_msg > INT32_MAX) srv->max_msg = INT32_MAX;
    srv->n_workers = o->n_workers > 0 ? o->n_workers : 2;
    srv->max_streams = o->max_streams > 0 ? o->max_streams : RPC_DEFAULT_MAX_STREAMS;
    sha256(o->secret, strlen(o->secret), srv->secret_hash);
    rpc__grpc_ref();

    grpc_arg args[7];
    size_t n = 0;
    args[n++] = (grpc_arg){.type = GRPC_ARG_INTEGER, .key = GRPC_ARG_MAX_RECEIVE_MESSAGE_LENGTH,
                           .value.integer = (int)srv->max_msg};
    args[n++] = (grpc_arg){.type = GRPC_ARG_INTEGER, .key = GRPC_ARG_MAX_SEND_MESSAGE_LENGTH,
                           .value.integer = (int)srv->max_msg};
    /* Notice dead clients on quiet connections; accept the clients' keepalive pings. */
    args[n++] = (grpc_arg){.type = GRPC_ARG_INTEGER, .key = GRPC_ARG_KEEPALIVE_TIME_MS,
                           .value.integer = 30000};
    args[n++] = (grpc_arg){.type = GRPC_ARG_INTEGER, .key = GRPC_ARG_KEEPALIVE_TIMEOUT_MS,
                           .value.integer = 10000};
    args[n++] = (grpc_arg){.type = GRPC_ARG_INTEGER,
                           .key = GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS,
                           .value.integer = 10000};
    /* A port in use is an error, not a silently shared port. */
    args[n++] = (grpc_arg){.type = GRPC_ARG_INTEGER, .key = GRPC_ARG_ALLOW_REUSEPORT,
                           .value.integer = 0};
    grpc_channel_args cargs = {.num_args = n, .args = args};
    srv->server = grpc_server_create(&cargs, NULL);
    srv->cq = grpc_completion_queue_create_for_next(NULL);
    grpc_server_register_completion_queue(srv->server, srv->cq, NULL);

    grpc_server_credentials *creds =
        tls ? server_tls_creds(&pems) : grpc_insecure_server_credentials_create();
    rpc__pems_free(&pems);
    srv->port = creds ? grpc_server_add_http2_port(srv->server, o->address, creds) : 0;
    grpc_server_credentials_release(creds);
    if (srv->port <= 0 && strncmp(o->address, "unix:", 5)) {
        rpc_server_free(srv);
        return fu_errorf(FU_ERR_NETWORK, "rpc server: cannot listen on '%s'%s", o->address,
                         tls ? " (or the TLS certificate, key or client CA is invalid)" : "");
    }
    if (srv->port < 0) srv->port = 0;
    *out = srv;
    return FU_OK;
}

static int add_method(rpc_server *srv, const char *method, const ProtobufCMessageDescriptor *desc,
                      srv_method *tmpl) {
    if (srv->started) return fu_errorf(FU_ERR_INVALID, "rpc server: add methods before start");
    if (!method || method[0] != '/' || !desc ||
        desc->magic != PROTOBUF_C__MESSAGE_DESCRIPTOR_MAGIC)
        return fu_errorf(FU_ERR_INVALID, "rpc server: bad method path or request type");
    if (srv->n_methods == RPC_SRV_MAX_METHODS)
        return fu_errorf(FU_ERR_EXHAUSTED, "rpc server: more than %d methods",
                         RPC_SRV_MAX_METHODS);
    for (int i = 0; i < srv->n_methods; i++)
        if (!strcmp(srv->methods[i].path, method))
            return fu_errorf(FU_ERR_INVALID, "rpc server: method %s registered twice", method);
    srv_method *m = &srv->methods[srv->n_methods];
    *m = *tmpl;
    m->desc = desc;
    if (!(m->path = strdup(method))) return fu_errorf(FU_ERR_NOMEM, "rpc server: out of memory");
    m->handle = grpc_server_register_method(
        srv->server, m->path, NULL,
        m->stream ? GRPC_SRM_PAYLOAD_NONE : GRPC_SRM_PAYLOAD_READ_INITIAL_BYTE_BUFFER, 0);
    if (!m->handle) {
        free(m->path);
        return fu_errorf(FU_ERR_INVALID, "rpc server: gRPC refused method %s", method);
    }
    srv->n_methods++;
    return FU_OK;
}

int rpc_server_add_unary(rpc_server *srv, const char *method,
                         const ProtobufCMessageDescriptor *req_desc, rpc_unary_fn fn,
                         rpc_reply_free_fn free_reply, void *ctx) {
    if (!fn) return fu_errorf(FU_ERR_INVALID, "rpc server: no handler for %s", method);
    srv_method m = {.stream = false, .unary = fn, .free_reply = free_reply, .ctx = ctx};
    return add_method(srv, method, req_desc, &m);
}

int rpc_server_add_stream(rpc_server *srv, const char *method,
                          const ProtobufCMessageDescriptor *req_desc, rpc_stream_fn fn,
                          void *ctx) {
    if (!fn) return fu_errorf(FU_ERR_INVALID, "rpc server: no handler for %s", method);
    srv_method m = {.stream = true, .stream_fn = fn, .ctx = ctx};
    return add_method(srv, method, req_desc, &m);
}

int rpc_server_start(rpc_server *srv) {
    if (srv->started || srv->shut) return fu_errorf(FU_ERR_INVALID, "rpc server: already started");
    srv->workers = calloc((size_t)srv->n_workers, sizeof *srv->workers);
    if (!srv->workers) return fu_errorf(FU_ERR_NOMEM, "rpc server: out of memory");
    grpc_server_start(srv->server);
    srv->started = true;
    for (int i = 0; i < srv->n_methods; i++)
        for (int k = 0; k < RPC_SRV_REQUESTS; k++) request_call(srv, &srv->methods[i]);
    request_call(srv, NULL);
    for (int i = 0; i < srv->n_workers; i++) {
        if (pthread_create(&srv->workers[i], NULL, worker_main, srv)) break;
        srv->n_started_workers++;
    }
    if (srv->n_started_workers == 0) {
        rpc_server_shutdown(srv, 0);
        return fu_errorf(FU_ERR_EXHAUSTED, "rpc server: cannot start worker threads");
    }
    return FU_OK;
}

int rpc_server_port(const rpc_server *srv) { return srv ? srv->port : 0; }

int rpc_server_shutdown(rpc_server *srv, int grace_ms) {
    pthread_mutex_lock(&srv->mu);
    bool already = srv->shut;
    srv->shut = true;
    srv->stopping = true;
    pthread_mutex_unlock(&srv->mu);
    if (already || !srv->server) return FU_OK;
    grpc_server_shutdown_and_notify(srv->server, srv->cq, &srv->shutdown_tag);
    if (!srv->started) {
        /* No workers: wait for the notification here. */
        for (;;) {
            grpc_event ev =
                grpc_completion_queue_next(srv->cq, gpr_inf_future(GPR_CLOCK_MONOTONIC), NULL);
            if (ev.type != GRPC_OP_COMPLETE || ev.tag == &srv->shutdown_tag) break;
        }
    } else {
        if (grace_ms < 0) grace_ms = 0;
        struct timespec until = fu_deadline_us(CLOCK_MONOTONIC, (int64_t)grace_ms * 1000);
        pthread_mutex_lock(&srv->mu);
        while (srv->n_calls > 0 && pthread_cond_timedwait(&srv->cv, &srv->mu, &until) == 0) {
        }
        int left = srv->n_calls;
        pthread_mutex_unlock(&srv->mu);
        if (left > 0 && grace_ms > 0)
            FU_INFO("rpc server: cancelling %d call(s) still in flight", left);
        grpc_server_cancel_all_calls(srv->server);
        pthread_mutex_lock(&srv->mu);
        while (srv->n_calls > 0 || srv->n_requests > 0 || !srv->shutdown_notified)
            pthread_cond_wait(&srv->cv, &srv->mu);
        pthread_mutex_unlock(&srv->mu);
    }
    grpc_server_destroy(srv->server);
    srv->server = NULL;
    grpc_completion_queue_shutdown(srv->cq);
    for (int i = 0; i < srv->n_started_workers; i++) pthread_join(srv->workers[i], NULL);
    if (!srv->started) {
        while (grpc_completion_queue_next(srv->cq, gpr_inf_future(GPR_CLOCK_MONOTONIC), NULL)
                   .type != GRPC_QUEUE_SHUTDOWN) {
        }
    }
    grpc_completion_queue_destroy(srv->cq);
    srv->cq = NULL;
    return FU_OK;
}

void rpc_server_free(rpc_server *srv) {
    if (!srv) return;
    rpc_server_shutdown(srv, 0);
    for (int i = 0; i < srv->n_methods; i++) free(srv->methods[i].path);
    free(srv->workers);
    pthread_cond_destroy(&srv->cv);
    pthread_mutex_destroy(&srv->mu);
    OPENSSL_cleanse(srv->secret_hash, sizeof srv->secret_hash);
    free(srv);
    rpc__grpc_unref();
}
