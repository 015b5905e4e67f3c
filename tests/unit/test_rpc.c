/* test_rpc.c -- the RPC layer: a real server on 127.0.0.1:0, real clients, plaintext and TLS; the
 * typed Shard and Swarm services (shard-svc.h, swarm-svc.h) over it and against generated messages.
 *
 * The test service (registered under /test.Echo/) echoes fusion.Tensor
 * messages: unary Echo returns the request; stream Chat replies to every
 * message with its data and shape [step index]. Tensor.block_size selects
 * misbehaviours (fail, sleep, oversized reply). TLS certificates are made at
 * run time with the openssl CLI in a temporary directory. A "dropped client"
 * is this program re-executed as a child that opens a stream and _exit()s.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <pthread.h>
#include <spawn.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "fusion.pb-c.h"
#include "rpc.h"
#include "shard-svc.h"
#include "status.h"
#include "swarm-svc.h"

extern char **environ;

#define SECRET "test-swarm-secret-0123456789"
#define ECHO "/test.Echo/Echo"
#define CHAT "/test.Echo/Chat"

enum { CMD_NONE = 0, CMD_FAIL = 1, CMD_SLEEP = 2, CMD_BIG = 3 };

/* ---- the test service ------------------------------------------------------------- */

typedef struct svc {
    atomic_int unary_calls;
    atomic_int stream_calls;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int streams_ended;
    int last_end_code; /* the code that ended the last stream handler's loop */
    size_t big_reply;  /* CMD_BIG: bytes of data in the reply */
} svc;

static svc g_svc = {.mu = PTHREAD_MUTEX_INITIALIZER, .cv = PTHREAD_COND_INITIALIZER};

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static void svc_reset(svc *sv) {
    atomic_store(&sv->unary_calls, 0);
    atomic_store(&sv->stream_calls, 0);
    pthread_mutex_lock(&sv->mu);
    sv->streams_ended = 0;
    sv->last_end_code = -1;
    pthread_mutex_unlock(&sv->mu);
}

static void svc_stream_ended(svc *sv, int code) {
    pthread_mutex_lock(&sv->mu);
    sv->streams_ended++;
    sv->last_end_code = code;
    pthread_cond_broadcast(&sv->cv);
    pthread_mutex_unlock(&sv->mu);
}

/* Waits up to timeout_s for `n` stream handlers to have ended; returns the
 * seconds waited, or -1 on timeout. */
static double svc_wait_ended(svc *sv, int n, double timeout_s) {
    double t0 = now_s();
    pthread_mutex_lock(&sv->mu);
    while (sv->streams_ended < n && now_s() - t0 < timeout_s) {
        pthread_mutex_unlock(&sv->mu);
        usleep(1000);
        pthread_mutex_lock(&sv->mu);
    }
    int ok = sv->streams_ended >= n;
    pthread_mutex_unlock(&sv->mu);
    return ok ? now_s() - t0 : -1;
}

/* A heap Tensor (free_unpacked-compatible) with a copy of data and shape. */
static Fusion__Tensor *tensor_new(const uint8_t *data, size_t len, const int64_t *shape,
                                  size_t n_shape) {
    Fusion__Tensor *t = malloc(sizeof *t);
    assert_non_null(t);
    fusion__tensor__init(t);
    t->dtype = FUSION__DTYPE__DTYPE_F32;
    if (len) {
        t->data.data = malloc(len);
        assert_non_null(t->data.data);
        if (data) memcpy(t->data.data, data, len);
        else memset(t->data.data, 0x5a, len);
        t->data.len = len;
    }
    if (n_shape) {
        t->shape = malloc(n_shape * sizeof *t->shape);
        assert_non_null(t->shape);
        memcpy(t->shape, shape, n_shape * sizeof *shape);
        t->n_shape = n_shape;
    }
    return t;
}

static int echo_unary(void *ctx, const ProtobufCMessage *req, ProtobufCMessage **reply,
                      rpc_status *st) {
    svc *sv = ctx;
    atomic_fetch_add(&sv->unary_calls, 1);
    const Fusion__Tensor *t = (const Fusion__Tensor *)req;
    if (t->block_size == CMD_FAIL)
        return rpc_status_setf(st, RPC_FAILED_PRECONDITION, "asked to fail (%d)", 42);
    if (t->block_size == CMD_SLEEP) usleep(500 * 1000);
    Fusion__Tensor *r = t->block_size == CMD_BIG ? tensor_new(NULL, sv->big_reply, NULL, 0)
                                                  : tensor_new(t->data.data, t->data.len,
                                                               t->shape, t->n_shape);
    *reply = &r->base;
    return RPC_OK;
}

static int echo_stream(void *ctx, rpc_stream *s, rpc_status *st) {
    svc *sv = ctx;
    atomic_fetch_add(&sv->stream_calls, 1);
    for (int64_t step = 0;; step++) {
        ProtobufCMessage *m;
        int rc = rpc_stream_recv(s, NULL, &m, -1, st);
        if (rc != RPC_OK) {
            /* the outcome sticks: a second receive reports the same */
            int again = rpc_stream_recv(s, NULL, &m, 0, NULL);
            svc_stream_ended(sv, again == rc ? rc : -1000 - again);
            return rc == RPC_END_OF_STREAM ? RPC_OK : rc;
        }
        Fusion__Tensor *t = (Fusion__Tensor *)m;
        if (t->block_size == CMD_SLEEP) {
            /* wait for a message that does not come, then give up with a
             * receive still in flight */
            rpc_msg_free(m);
            rc = rpc_stream_recv(s, NULL, &m, 20, st);
            svc_stream_ended(sv, rc);
            if (rc != RPC_DEADLINE_EXCEEDED) return RPC_INTERNAL;
            return rpc_status_setf(st, RPC_ABORTED, "gave up waiting");
        }
        if (t->block_size == CMD_FAIL) {
            rpc_msg_free(m);
            svc_stream_ended(sv, RPC_FAILED_PRECONDITION);
            return rpc_status_setf(st, RPC_FAILED_PRECONDITION, "stream asked to fail at step %d",
                                   (int)step);
        }
        Fusion__Tensor r = FUSION__TENSOR__INIT;
        r.dtype = t->dtype;
        r.data = t->data;
        r.shape = &step;
        r.n_shape = 1;
        rc = rpc_stream_send(s, &r.base, st);
        rpc_msg_free(m);
        if (rc != RPC_OK) {
            svc_stream_ended(sv, rc);
            return rc;
        }
    }
}

/* ---- fixtures ---------------------------------------------------------------------- */

static char g_dir[64];              /* temporary directory with the certificates */
static char g_cert[128], g_key[128]; /* server certificate (SAN localhost, 127.0.0.1) */
static char g_other_ca[128];         /* an unrelated self-signed certificate */
static const char *g_self;           /* this program, for the dropped-client child */

static void make_cert(const char *stem, char *cert, char *key) {
    snprintf(cert, 128, "%s/%s.pem", g_dir, stem);
    snprintf(key, 128, "%s/%s.key", g_dir, stem);
    char cmd[1024];
    snprintf(cmd, sizeof cmd,
             "openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes "
             "-keyout %s -out %s -days 2 -subj /CN=localhost "
             "-addext subjectAltName=DNS:localhost,IP:127.0.0.1 >/dev/null 2>&1",
             key, cert);
    assert_int_equal(system(cmd), 0);
}

static int setup_certs(void **state) {
    (void)state;
    snprintf(g_dir, sizeof g_dir, "/tmp/fusion-rpc-XXXXXX");
    if (!mkdtemp(g_dir)) return -1;
    make_cert("server", g_cert, g_key);
    char other_key[128];
    make_cert("other", g_other_ca, other_key);
    return 0;
}

static int teardown_certs(void **state) {
    (void)state;
    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf %s", g_dir);
    return system(cmd) == 0 ? 0 : -1;
}

static rpc_server *server_start(bool tls, size_t max_msg) {
    rpc_server_options o = {.address = "127.0.0.1:0",
                            .secret = SECRET,
                            .max_message_bytes = max_msg,
                            .n_workers = 2};
    if (tls) {
        o.tls_cert = g_cert;
        o.tls_key = g_key;
    } else {
        o.allow_insecure = true;
    }
    rpc_server *srv;
    int rc = rpc_server_new(&o, &srv);
    if (rc) fprintf(stderr, "rpc_server_new: %s\n", fu_last_error());
    assert_int_equal(rc, FU_OK);
    assert_true(rpc_server_port(srv) > 0);
    assert_int_equal(rpc_server_add_unary(srv, ECHO, &fusion__tensor__descriptor, echo_unary, NULL,
                                          &g_svc),
                     FU_OK);
    assert_int_equal(
        rpc_server_add_stream(srv, CHAT, &fusion__tensor__descriptor, echo_stream, &g_svc), FU_OK);
    assert_int_equal(rpc_server_start(srv), FU_OK);
    svc_reset(&g_svc);
    return srv;
}

typedef struct chan_opts {
    bool tls;
    const char *ca;
    const char *secret;
    size_t max_msg;
    const char *server_name;
} chan_opts;

static rpc_channel *channel_to(const rpc_server *srv, chan_opts co) {
    char target[64];
    snprintf(target, sizeof target, "127.0.0.1:%d", rpc_server_port(srv));
    rpc_channel_options o = {.insecure = !co.tls,
                             .tls_ca = co.tls ? co.ca : NULL,
                             .secret = co.secret,
                             .max_message_bytes = co.max_msg,
                             .tls_server_name = co.server_name};
    rpc_channel *ch;
    int rc = rpc_channel_new(target, &o, &ch);
    if (rc) fprintf(stderr, "rpc_channel_new: %s\n", fu_last_error());
    assert_int_equal(rc, FU_OK);
    return ch;
}

static rpc_channel *plain_channel(const rpc_server *srv) {
    return channel_to(srv, (chan_opts){.secret = SECRET});
}

/* One unary echo of `len` bytes; returns the code, checks the echo on OK. */
static int echo_once(rpc_channel *ch, size_t len, int cmd, int timeout_ms, rpc_status *st) {
    uint8_t *buf = malloc(len ? len : 1);
    assert_non_null(buf);
    for (size_t i = 0; i < len; i++) buf[i] = (uint8_t)(i * 31 + len);
    int64_t shape[2] = {(int64_t)len, 7};
    Fusion__Tensor t = FUSION__TENSOR__INIT;
    t.data.data = buf;
    t.data.len = len;
    t.shape = shape;
    t.n_shape = 2;
    t.block_size = cmd;
    ProtobufCMessage *reply = NULL;
    int rc = rpc_call_unary(ch, ECHO, &t.base, &fusion__tensor__descriptor, &reply, timeout_ms, st);
    if (rc == RPC_OK && cmd == CMD_NONE) {
        const Fusion__Tensor *r = (const Fusion__Tensor *)reply;
        assert_int_equal(r->data.len, len);
        assert_memory_equal(r->data.data, buf, len);
        assert_int_equal(r->n_shape, 2);
        assert_int_equal(r->shape[0], (int64_t)len);
        assert_int_equal(r->shape[1], 7);
    } else if (rc != RPC_OK) {
        assert_null(reply);
    }
    rpc_msg_free(reply);
    free(buf);
    return rc;
}

/* Sends step `i` (payload of len bytes) on a chat stream and checks the reply. */
static void chat_step(rpc_stream *s, int64_t i, size_t len) {
    uint8_t *buf = malloc(len ? len : 1);
    assert_non_null(buf);
    for (size_t k = 0; k < len; k++) buf[k] = (uint8_t)(k ^ (size_t)i);
    Fusion__Tensor t = FUSION__TENSOR__INIT;
    t.data.data = buf;
    t.data.len = len;
    rpc_status st;
    int rc = rpc_stream_send(s, &t.base, &st);
    if (rc) fprintf(stderr, "send: %s %s\n", rpc_code_str(rc), st.message);
    assert_int_equal(rc, RPC_OK);
    ProtobufCMessage *m;
    rc = rpc_stream_recv(s, &fusion__tensor__descriptor, &m, 5000, &st);
    if (rc) fprintf(stderr, "recv: %s %s\n", rpc_code_str(rc), st.message);
    assert_int_equal(rc, RPC_OK);
    const Fusion__Tensor *r = (const Fusion__Tensor *)m;
    assert_int_equal(r->n_shape, 1);
    assert_int_equal(r->shape[0], i);
    assert_int_equal(r->data.len, len);
    assert_memory_equal(r->data.data, buf, len);
    rpc_msg_free(m);
    free(buf);
}

/* ---- tests: status, addresses, messages ----------------------------------------- */

static void test_codes_and_mapping(void **state) {
    (void)state;
    assert_string_equal(rpc_code_str(RPC_UNAUTHENTICATED), "unauthenticated");
    assert_string_equal(rpc_code_str(RPC_END_OF_STREAM), "end of stream");
    assert_string_equal(rpc_code_str(999), "unknown code");
    assert_int_equal(rpc_code_from_fu(FU_OK), RPC_OK);
    assert_int_equal(rpc_code_from_fu(FU_ERR_INVALID), RPC_INVALID_ARGUMENT);
    assert_int_equal(rpc_code_from_fu(FU_ERR_FORMAT), RPC_INVALID_ARGUMENT);
    assert_int_equal(rpc_code_from_fu(FU_ERR_EXHAUSTED), RPC_RESOURCE_EXHAUSTED);
    assert_int_equal(rpc_code_from_fu(FU_ERR_NOMEM), RPC_RESOURCE_EXHAUSTED);
    assert_int_equal(rpc_code_from_fu(FU_ERR_AUTH), RPC_UNAUTHENTICATED);
    assert_int_equal(rpc_code_from_fu(FU_ERR_NOT_FOUND), RPC_NOT_FOUND);
    assert_int_equal(rpc_code_from_fu(FU_ERR_RANGE), RPC_OUT_OF_RANGE);
    assert_int_equal(rpc_code_from_fu(FU_ERR_NETWORK), RPC_UNAVAILABLE);
    assert_int_equal(rpc_code_from_fu(FU_ERR_UNSUPPORTED), RPC_UNIMPLEMENTED);
    assert_int_equal(rpc_code_from_fu(FU_ERR_CANCELLED), RPC_CANCELLED);
    assert_int_equal(rpc_code_from_fu(FU_ERR_INTERNAL), RPC_INTERNAL);
    assert_int_equal(rpc_code_from_fu(-1234), RPC_UNKNOWN);
    /* Round trip for every project status that has a distinct gRPC code. */
    const int fus[] = {FU_OK, FU_ERR_INVALID, FU_ERR_NOT_FOUND, FU_ERR_RANGE, FU_ERR_NETWORK,
                       FU_ERR_AUTH, FU_ERR_EXHAUSTED, FU_ERR_CANCELLED, FU_ERR_INTERNAL,
                       FU_ERR_UNSUPPORTED, FU_ERR_CHECKSUM};
    for (size_t i = 0; i < sizeof fus / sizeof *fus; i++)
        assert_int_equal(rpc_code_to_fu(rpc_code_from_fu(fus[i])), fus[i]);
    rpc_status st;
    fu_errorf(FU_ERR_RANGE, "position %d past %d", 9, 8);
    assert_int_equal(rpc_status_from_fu(&st, FU_ERR_RANGE), RPC_OUT_OF_RANGE);
    assert_int_equal(st.code, RPC_OUT_OF_RANGE);
    assert_string_equal(st.message, "position 9 past 8");
    assert_int_equal(rpc_status_setf(NULL, RPC_INTERNAL, "x"), RPC_INTERNAL);
}

static void test_loopback_addresses(void **state) {
    (void)state;
    const char *yes[] = {"127.0.0.1:0", "127.1.2.3:80", "localhost:5000", "LOCALHOST:1",
                         "[::1]:0", "[::ffff:127.0.0.1]:9", "unix:/tmp/x.sock",
                         "ipv4:127.0.0.1:7", "dns:///localhost:7"};
    const char *no[] = {"0.0.0.0:0", "[::]:0", "10.0.0.1:50051", "192.168.1.2:1",
                        "example.com:443", "128.0.0.1:1", "", "localhost.evil.com:1",
                        "[::2]:1"};
    for (size_t i = 0; i < sizeof yes / sizeof *yes; i++) {
        if (!rpc_address_is_loopback(yes[i])) fail_msg("%s should be loopback", yes[i]);
    }
    for (size_t i = 0; i < sizeof no / sizeof *no; i++) {
        if (rpc_address_is_loopback(no[i])) fail_msg("%s should not be loopback", no[i]);
    }
    assert_false(rpc_address_is_loopback(NULL));
}

/* Messages of fusion.proto survive pack/unpack, oneofs included; garbage is
 * refused without a crash. */
static void test_messages(void **state) {
    (void)state;
    int64_t toks[3] = {1, 22, 333};
    Fusion__Input in = FUSION__INPUT__INIT;
    in.tokens = toks;
    in.n_tokens = 3;
    Fusion__Sampling smp = FUSION__SAMPLING__INIT;
    smp.temperature = 0.7f;
    smp.seed = 0xfeedfacecafebeefull;
    Fusion__OutputSpec out = FUSION__OUTPUT_SPEC__INIT;
    out.sampling = &smp;
    out.top_logprobs = 5;
    Fusion__StepRequest step = FUSION__STEP_REQUEST__INIT;
    step.request_id = 77;
    step.start_position = 12;
    step.input = &in;
    step.output = &out;
    step.rollback_case = FUSION__STEP_REQUEST__ROLLBACK_ROLLBACK_TO;
    step.rollback_to = 0; /* 0 is a real rollback target: presence via the oneof */
    Fusion__SessionRequest req = FUSION__SESSION_REQUEST__INIT;
    req.kind_case = FUSION__SESSION_REQUEST__KIND_STEP;
    req.step = &step;
    size_t n = protobuf_c_message_get_packed_size(&req.base);
    uint8_t *buf = malloc(n);
    assert_non_null(buf);
    assert_int_equal(protobuf_c_message_pack(&req.base, buf), n);
    ProtobufCMessage *m;
    rpc_status st;
    assert_int_equal(rpc_msg_unpack(&fusion__session_request__descriptor, buf, n, 0, &m, &st),
                     RPC_OK);
    const Fusion__SessionRequest *r = (const Fusion__SessionRequest *)m;
    assert_int_equal(r->kind_case, FUSION__SESSION_REQUEST__KIND_STEP);
    assert_int_equal(r->step->request_id, 77);
    assert_int_equal(r->step->start_position, 12);
    assert_int_equal(r->step->rollback_case, FUSION__STEP_REQUEST__ROLLBACK_ROLLBACK_TO);
    assert_int_equal(r->step->rollback_to, 0);
    assert_int_equal(r->step->input->n_tokens, 3);
    assert_int_equal(r->step->input->tokens[2], 333);
    assert_non_null(r->step->output->sampling);
    assert_true(r->step->output->sampling->seed == 0xfeedfacecafebeefull);
    assert_int_equal(r->step->output->top_logprobs, 5);
    rpc_msg_free(m);
    /* over the bound */
    assert_int_equal(rpc_msg_unpack(&fusion__session_request__descriptor, buf, n, n - 1, &m, &st),
                     RPC_RESOURCE_EXHAUSTED);
    assert_null(m);
    /* every truncation of a valid message, then random bytes: refused or parsed, never a crash */
    for (size_t k = 0; k < n; k++) {
        if (rpc_msg_unpack(&fusion__session_request__descriptor, buf, k, 0, &m, &st) == RPC_OK)
            rpc_msg_free(m);
        else
            assert_int_equal(st.code, RPC_INVALID_ARGUMENT);
    }
    uint8_t junk[64];
    uint32_t x = 12345;
    int refused = 0;
    for (int k = 0; k < 2000; k++) {
        for (size_t j = 0; j < sizeof junk; j++) {
            x = x * 1103515245u + 12345u;
            junk[j] = (uint8_t)(x >> 16);
        }
        if (rpc_msg_unpack(&fusion__session_request__descriptor, junk, sizeof junk, 0, &m, &st) ==
            RPC_OK)
            rpc_msg_free(m);
        else
            refused++;
    }
    assert_true(refused > 1000);
    free(buf);
}

/* ---- tests: calls ------------------------------------------------------------------ */

static void test_unary_echo(void **state) {
    (void)state;
    rpc_server *srv = server_start(false, 0);
    rpc_channel *ch = plain_channel(srv);
    rpc_status st;
    const size_t sizes[] = {0, 1, 100, 65536, 3 << 20};
    for (size_t i = 0; i < sizeof sizes / sizeof *sizes; i++)
        assert_int_equal(echo_once(ch, sizes[i], CMD_NONE, 10000, &st), RPC_OK);
    assert_int_equal(atomic_load(&g_svc.unary_calls), 5);
    /* a handler's error status and message reach the client */
    assert_int_equal(echo_once(ch, 10, CMD_FAIL, 10000, &st), RPC_FAILED_PRECONDITION);
    assert_string_equal(st.message, "asked to fail (42)");
    /* unknown method */
    Fusion__Tensor t = FUSION__TENSOR__INIT;
    ProtobufCMessage *reply;
    assert_int_equal(rpc_call_unary(ch, "/test.Echo/Nope", &t.base, &fusion__tensor__descriptor,
                                    &reply, 5000, &st),
                     RPC_UNIMPLEMENTED);
    assert_non_null(strstr(st.message, "/test.Echo/Nope"));
    /* deadline: the handler sleeps 500 ms */
    double t0 = now_s();
    assert_int_equal(echo_once(ch, 10, CMD_SLEEP, 100, &st), RPC_DEADLINE_EXCEEDED);
    assert_true(now_s() - t0 < 0.45);
    rpc_channel_free(ch);
    rpc_server_free(srv);
}

static void test_stream_1000_steps(void **state) {
    (void)state;
    rpc_server *srv = server_start(false, 0);
    rpc_channel *ch = plain_channel(srv);
    rpc_stream *s;
    rpc_status st;
    assert_int_equal(rpc_stream_open(ch, CHAT, 0, &s, &st), RPC_OK);
    for (int64_t i = 0; i < 1000; i++) chat_step(s, i, (size_t)(i * 37 % 5000));
    /* a receive that times out loses nothing */
    ProtobufCMessage *m;
    assert_int_equal(rpc_stream_recv(s, &fusion__tensor__descriptor, &m, 20, &st),
                     RPC_DEADLINE_EXCEEDED);
    assert_null(m);
    chat_step(s, 1000, 12345);
    assert_int_equal(rpc_stream_close_send(s, &st), RPC_OK);
    assert_int_equal(rpc_stream_recv(s, &fusion__tensor__descriptor, &m, 5000, &st),
                     RPC_END_OF_STREAM);
    assert_int_equal(rpc_stream_finish(s, &st), RPC_OK);
    rpc_stream_free(s);
    assert_true(svc_wait_ended(&g_svc, 1, 5) >= 0);
    assert_int_equal(g_svc.last_end_code, RPC_END_OF_STREAM);
    assert_int_equal(atomic_load(&g_svc.stream_calls), 1);

    /* a handler's error ends the stream with its status */
    assert_int_equal(rpc_stream_open(ch, CHAT, 0, &s, &st), RPC_OK);
    chat_step(s, 0, 10);
    Fusion__Tensor t = FUSION__TENSOR__INIT;
    t.block_size = CMD_FAIL;
    assert_int_equal(rpc_stream_send(s, &t.base, &st), RPC_OK);
    assert_int_equal(rpc_stream_recv(s, &fusion__tensor__descriptor, &m, 5000, &st),
                     RPC_FAILED_PRECONDITION);
    assert_string_equal(st.message, "stream asked to fail at step 1");
    assert_int_equal(rpc_stream_send(s, &t.base, &st), RPC_FAILED_PRECONDITION);
    assert_int_equal(rpc_stream_finish(s, &st), RPC_FAILED_PRECONDITION);
    rpc_stream_free(s);

    /* a handler that returns with a receive in flight ends the call cleanly */
    assert_int_equal(rpc_stream_open(ch, CHAT, 0, &s, &st), RPC_OK);
    t.block_size = CMD_SLEEP;
    assert_int_equal(rpc_stream_send(s, &t.base, &st), RPC_OK);
    assert_int_equal(rpc_stream_recv(s, &fusion__tensor__descriptor, &m, 5000, &st), RPC_ABORTED);
    assert_string_equal(st.message, "gave up waiting");
    rpc_stream_free(s);
    assert_true(svc_wait_ended(&g_svc, 3, 5) >= 0);
    assert_int_equal(g_svc.last_end_code, RPC_DEADLINE_EXCEEDED);
    rpc_channel_free(ch);
    rpc_server_free(srv);
}

typedef struct worker_arg {
    rpc_channel *ch;
    int id;
    int failures;
} worker_arg;

static void *concurrent_worker(void *p) {
    worker_arg *a = p;
    rpc_status st;
    for (int i = 0; i < 20; i++)
        if (echo_once(a->ch, (size_t)(a->id * 1000 + i), CMD_NONE, 10000, &st) != RPC_OK)
            a->failures++;
    rpc_stream *s;
    if (rpc_stream_open(a->ch, CHAT, 0, &s, &st) != RPC_OK) {
        a->failures++;
        return NULL;
    }
    for (int64_t i = 0; i < 50; i++) chat_step(s, i, (size_t)(a->id * 100 + i));
    if (rpc_stream_finish(s, &st) != RPC_OK) a->failures++;
    rpc_stream_free(s);
    return NULL;
}

static void test_concurrent_clients(void **state) {
    (void)state;
    rpc_server *srv = server_start(false, 0);
    rpc_channel *ch = plain_channel(srv);
    pthread_t th[8];
    worker_arg args[8];
    for (int i = 0; i < 8; i++) {
        args[i] = (worker_arg){.ch = ch, .id = i};
        assert_int_equal(pthread_create(&th[i], NULL, concurrent_worker, &args[i]), 0);
    }
    for (int i = 0; i < 8; i++) {
        pthread_join(th[i], NULL);
        assert_int_equal(args[i].failures, 0);
    }
    assert_int_equal(atomic_load(&g_svc.unary_calls), 160);
    assert_int_equal(atomic_load(&g_svc.stream_calls), 8);
    assert_true(svc_wait_ended(&g_svc, 8, 5) >= 0);
    rpc_channel_free(ch);
    rpc_server_free(srv);
}

/* The dropped-client child: opens a stream, does one step, and exits without
 * closing anything. */
static int drop_client_main(int port) {
    char target[64];
    snprintf(target, sizeof target, "127.0.0.1:%d", port);
    rpc_channel_options o = {.insecure = true, .secret = SECRET};
    rpc_channel *ch;
    rpc_stream *s;
    rpc_status st;
    if (rpc_channel_new(target, &o, &ch) || rpc_stream_open(ch, CHAT, 0, &s, &st)) _exit(2);
    Fusion__Tensor t = FUSION__TENSOR__INIT;
    ProtobufCMessage *m;
    if (rpc_stream_send(s, &t.base, &st) ||
        rpc_stream_recv(s, &fusion__tensor__descriptor, &m, 5000, &st))
        _exit(3);
    _exit(0);
}

static void test_cancel_and_drop_noticed(void **state) {
    (void)state;
    rpc_server *srv = server_start(false, 0);
    rpc_channel *ch = plain_channel(srv);
    rpc_stream *s;
    rpc_status st;
    /* client cancels mid-stream: the handler blocked in recv sees CANCELLED at once */
    assert_int_equal(rpc_stream_open(ch, CHAT, 0, &s, &st), RPC_OK);
    chat_step(s, 0, 100);
    chat_step(s, 1, 100);
    rpc_stream_cancel(s);
    double waited = svc_wait_ended(&g_svc, 1, 5);
    assert_true(waited >= 0 && waited < 1.0);
    assert_int_equal(g_svc.last_end_code, RPC_CANCELLED);
    ProtobufCMessage *m;
    assert_int_equal(rpc_stream_recv(s, &fusion__tensor__descriptor, &m, 1000, &st),
                     RPC_CANCELLED);
    rpc_stream_free(s);

    /* freeing an open stream cancels it too */
    assert_int_equal(rpc_stream_open(ch, CHAT, 0, &s, &st), RPC_OK);
    chat_step(s, 0, 100);
    rpc_stream_free(s);
    waited = svc_wait_ended(&g_svc, 2, 5);
    assert_true(waited >= 0 && waited < 1.0);
    assert_int_equal(g_svc.last_end_code, RPC_CANCELLED);

    /* a client process that dies mid-stream */
    char port[16];
    snprintf(port, sizeof port, "%d", rpc_server_port(srv));
    char *argv[] = {(char *)g_self, "--drop-client", port, NULL};
    pid_t pid;
    assert_int_equal(posix_spawn(&pid, g_self, NULL, NULL, argv, environ), 0);
    int wst;
    assert_int_equal(waitpid(pid, &wst, 0), pid);
    assert_true(WIFEXITED(wst));
    assert_int_equal(WEXITSTATUS(wst), 0);
    waited = svc_wait_ended(&g_svc, 3, 5);
    assert_true(waited >= 0 && waited < 1.0);
    assert_int_equal(g_svc.last_end_code, RPC_CANCELLED);
    assert_int_equal(atomic_load(&g_svc.stream_calls), 3);
    rpc_channel_free(ch);
    rpc_server_free(srv);
}

static void test_secret_required(void **state) {
    (void)state;
    rpc_server *srv = server_start(false, 0);
    const char *bad[] = {"wrong-secret", "test-swarm-secret-012345678", SECRET "9", NULL};
    for (int i = 0; i < 4; i++) {
        rpc_channel *ch = channel_to(srv, (chan_opts){.secret = bad[i]});
        rpc_status st;
        assert_int_equal(echo_once(ch, 10, CMD_NONE, 5000, &st), RPC_UNAUTHENTICATED);
        rpc_stream *s;
        assert_int_equal(rpc_stream_open(ch, CHAT, 0, &s, &st), RPC_OK);
        Fusion__Tensor t = FUSION__TENSOR__INIT;
        int rc = rpc_stream_send(s, &t.base, &st);
        ProtobufCMessage *m = NULL;
        if (rc == RPC_OK) rc = rpc_stream_recv(s, &fusion__tensor__descriptor, &m, 5000, &st);
        assert_int_equal(rc, RPC_UNAUTHENTICATED);
        assert_int_equal(rpc_stream_finish(s, &st), RPC_UNAUTHENTICATED);
        rpc_stream_free(s);
        /* an unknown method is refused for the secret first */
        assert_int_equal(rpc_call_unary(ch, "/x.Y/Z", &t.base, &fusion__tensor__descriptor, &m,
                                        5000, &st),
                         RPC_UNAUTHENTICATED);
        rpc_channel_free(ch);
    }
    assert_int_equal(atomic_load(&g_svc.unary_calls), 0);
    assert_int_equal(atomic_load(&g_svc.stream_calls), 0);
    rpc_server_free(srv);
}

static void test_malformed_payload(void **state) {
    (void)state;
    rpc_server *srv = server_start(false, 0);
    rpc_channel *ch = plain_channel(srv);
    /* field 2 (shape), length-delimited, claims 100 bytes but has 2 */
    const uint8_t junk[] = {0x12, 0x64, 0x01, 0x02};
    ProtobufCMessage *m;
    rpc_status st;
    assert_int_equal(rpc_call_unary_raw(ch, ECHO, junk, sizeof junk, &fusion__tensor__descriptor,
                                        &m, 5000, &st),
                     RPC_INVALID_ARGUMENT);
    assert_null(m);
    assert_non_null(strstr(st.message, "malformed fusion.Tensor"));
    assert_int_equal(atomic_load(&g_svc.unary_calls), 0);
    /* on a stream, the handler's recv reports it; this handler ends the call */
    rpc_stream *s;
    assert_int_equal(rpc_stream_open(ch, CHAT, 0, &s, &st), RPC_OK);
    chat_step(s, 0, 10);
    assert_int_equal(rpc_stream_send_raw(s, junk, sizeof junk, &st), RPC_OK);
    assert_int_equal(rpc_stream_recv(s, &fusion__tensor__descriptor, &m, 5000, &st),
                     RPC_INVALID_ARGUMENT);
    rpc_stream_free(s);
    /* the server is still fine */
    assert_int_equal(echo_once(ch, 10, CMD_NONE, 5000, &st), RPC_OK);
    rpc_channel_free(ch);
    rpc_server_free(srv);
}

static void test_oversize(void **state) {
    (void)state;
    rpc_server *srv = server_start(false, 64 << 10);
    rpc_status st;
    /* the client allows 1 MiB, the server 64 KiB: the server refuses */
    rpc_channel *ch = channel_to(srv, (chan_opts){.secret = SECRET, .max_msg = 1 << 20});
    assert_int_equal(echo_once(ch, 60 << 10, CMD_NONE, 5000, &st), RPC_OK);
    assert_int_equal(echo_once(ch, 100 << 10, CMD_NONE, 5000, &st), RPC_RESOURCE_EXHAUSTED);
    /* over the client's own bound: refused before sending */
    assert_int_equal(echo_once(ch, 2 << 20, CMD_NONE, 5000, &st), RPC_RESOURCE_EXHAUSTED);
    assert_non_null(strstr(st.message, "exceeds the bound"));
    /* a reply over the server's bound */
    g_svc.big_reply = 100 << 10;
    assert_int_equal(echo_once(ch, 10, CMD_BIG, 5000, &st), RPC_RESOURCE_EXHAUSTED);
    /* on a stream: over the server's bound */
    rpc_stream *s;
    assert_int_equal(rpc_stream_open(ch, CHAT, 0, &s, &st), RPC_OK);
    chat_step(s, 0, 1000);
    uint8_t *big = calloc(1, 100 << 10);
    assert_non_null(big);
    Fusion__Tensor t = FUSION__TENSOR__INIT;
    t.data.data = big;
    t.data.len = 100 << 10;
    ProtobufCMessage *m;
    int rc = rpc_stream_send(s, &t.base, &st);
    if (rc == RPC_OK) rc = rpc_stream_recv(s, &fusion__tensor__descriptor, &m, 5000, &st);
    assert_int_equal(rc, RPC_RESOURCE_EXHAUSTED);
    free(big);
    rpc_stream_free(s);
    rpc_channel_free(ch);
    /* a reply over the client's bound (the server allows it) */
    ch = channel_to(srv, (chan_opts){.secret = SECRET, .max_msg = 16 << 10});
    g_svc.big_reply = 32 << 10;
    assert_int_equal(echo_once(ch, 10, CMD_BIG, 5000, &st), RPC_RESOURCE_EXHAUSTED);
    rpc_channel_free(ch);
    rpc_server_free(srv);
}

static void test_shutdown_with_open_stream(void **state) {
    (void)state;
    rpc_server *srv = server_start(false, 0);
    rpc_channel *ch = plain_channel(srv);
    rpc_stream *s;
    rpc_status st;
    assert_int_equal(rpc_stream_open(ch, CHAT, 0, &s, &st), RPC_OK);
    chat_step(s, 0, 100);
    double t0 = now_s();
    assert_int_equal(rpc_server_shutdown(srv, 200), FU_OK);
    double took = now_s() - t0;
    assert_true(took >= 0.15 && took < 2.0); /* waited the grace, then cancelled */
    assert_int_equal(g_svc.last_end_code, RPC_CANCELLED);
    ProtobufCMessage *m;
    t0 = now_s();
    int rc = rpc_stream_recv(s, &fusion__tensor__descriptor, &m, 5000, &st);
    assert_true(rc == RPC_UNAVAILABLE || rc == RPC_CANCELLED);
    assert_true(now_s() - t0 < 1.0);
    rpc_stream_free(s);
    /* nothing listens any more */
    assert_int_equal(echo_once(ch, 10, CMD_NONE, 2000, &st), RPC_UNAVAILABLE);
    assert_int_equal(rpc_server_shutdown(srv, 0), FU_OK); /* idempotent */
    rpc_channel_free(ch);
    rpc_server_free(srv);

    /* a server that is never started can be freed */
    rpc_server_options o = {.address = "127.0.0.1:0", .secret = SECRET, .allow_insecure = true};
    assert_int_equal(rpc_server_new(&o, &srv), FU_OK);
    rpc_server_free(srv);
}

static void test_tls(void **state) {
    (void)state;
    rpc_server *srv = server_start(true, 0);
    rpc_status st;
    /* TLS client with the right CA: unary and stream */
    rpc_channel *ch = channel_to(srv, (chan_opts){.tls = true, .ca = g_cert, .secret = SECRET});
    assert_int_equal(echo_once(ch, 1000, CMD_NONE, 5000, &st), RPC_OK);
    rpc_stream *s;
    assert_int_equal(rpc_stream_open(ch, CHAT, 0, &s, &st), RPC_OK);
    for (int64_t i = 0; i < 20; i++) chat_step(s, i, 300);
    assert_int_equal(rpc_stream_finish(s, &st), RPC_OK);
    rpc_stream_free(s);
    rpc_channel_free(ch);
    /* CA given as PEM text, name checked against SAN DNS:localhost */
    FILE *f = fopen(g_cert, "r");
    assert_non_null(f);
    char pem[8192];
    size_t n = fread(pem, 1, sizeof pem - 1, f);
    fclose(f);
    pem[n] = '\0';
    ch = channel_to(srv, (chan_opts){.tls = true, .ca = pem, .secret = SECRET,
                                     .server_name = "localhost"});
    assert_int_equal(echo_once(ch, 10, CMD_NONE, 5000, &st), RPC_OK);
    rpc_channel_free(ch);
    /* wrong secret over TLS */
    ch = channel_to(srv, (chan_opts){.tls = true, .ca = g_cert, .secret = "nope"});
    assert_int_equal(echo_once(ch, 10, CMD_NONE, 5000, &st), RPC_UNAUTHENTICATED);
    rpc_channel_free(ch);
    /* a name the certificate does not hold */
    ch = channel_to(srv, (chan_opts){.tls = true, .ca = g_cert, .secret = SECRET,
                                     .server_name = "other.example"});
    assert_int_equal(echo_once(ch, 10, CMD_NONE, 5000, &st), RPC_UNAVAILABLE);
    rpc_channel_free(ch);
    /* TLS client that trusts another CA */
    ch = channel_to(srv, (chan_opts){.tls = true, .ca = g_other_ca, .secret = SECRET});
    assert_int_equal(echo_once(ch, 10, CMD_NONE, 5000, &st), RPC_UNAVAILABLE);
    rpc_channel_free(ch);
    /* plaintext client to the TLS server */
    ch = channel_to(srv, (chan_opts){.secret = SECRET});
    assert_int_equal(echo_once(ch, 10, CMD_NONE, 5000, &st), RPC_UNAVAILABLE);
    rpc_channel_free(ch);
    assert_int_equal(atomic_load(&g_svc.unary_calls), 2);
    rpc_server_free(srv);
    /* TLS client to a plaintext server */
    srv = server_start(false, 0);
    ch = channel_to(srv, (chan_opts){.tls = true, .ca = g_cert, .secret = SECRET});
    assert_int_equal(echo_once(ch, 10, CMD_NONE, 5000, &st), RPC_UNAVAILABLE);
    rpc_channel_free(ch);
    rpc_server_free(srv);
}

static void test_setup_refusals(void **state) {
    (void)state;
    rpc_server *srv = NULL;
    rpc_server_options o = {.address = "0.0.0.0:0", .secret = SECRET, .allow_insecure = true};
    assert_int_equal(rpc_server_new(&o, &srv), FU_ERR_INVALID);
    assert_non_null(strstr(fu_last_error(), "loopback"));
    o.address = "192.168.77.1:0";
    assert_int_equal(rpc_server_new(&o, &srv), FU_ERR_INVALID);
    o.address = "127.0.0.1:0";
    o.allow_insecure = false; /* no TLS and not allowed */
    assert_int_equal(rpc_server_new(&o, &srv), FU_ERR_INVALID);
    o.allow_insecure = true;
    o.secret = NULL;
    assert_int_equal(rpc_server_new(&o, &srv), FU_ERR_INVALID);
    o.secret = "bad\nsecret";
    assert_int_equal(rpc_server_new(&o, &srv), FU_ERR_INVALID);
    o.secret = SECRET;
    o.tls_cert = "/nonexistent/cert.pem";
    o.tls_key = g_key;
    assert_int_equal(rpc_server_new(&o, &srv), FU_ERR_IO);
    o.tls_cert = g_key; /* a key is not a certificate */
    assert_int_equal(rpc_server_new(&o, &srv), FU_ERR_NETWORK);
    o.tls_cert = g_cert;
    o.tls_key = NULL;
    assert_int_equal(rpc_server_new(&o, &srv), FU_ERR_INVALID);
    assert_null(srv);
    /* a port in use */
    o = (rpc_server_options){.address = "127.0.0.1:0", .secret = SECRET, .allow_insecure = true};
    assert_int_equal(rpc_server_new(&o, &srv), FU_OK);
    char addr[64];
    snprintf(addr, sizeof addr, "127.0.0.1:%d", rpc_server_port(srv));
    rpc_server *srv2 = NULL;
    o.address = addr;
    assert_int_equal(rpc_server_new(&o, &srv2), FU_ERR_NETWORK);
    assert_int_equal(rpc_server_add_unary(srv, "no-slash", &fusion__tensor__descriptor,
                                          echo_unary, NULL, NULL),
                     FU_ERR_INVALID);
    assert_int_equal(rpc_server_add_unary(srv, ECHO, &fusion__tensor__descriptor, echo_unary,
                                          NULL, NULL),
                     FU_OK);
    assert_int_equal(rpc_server_add_unary(srv, ECHO, &fusion__tensor__descriptor, echo_unary,
                                          NULL, NULL),
                     FU_ERR_INVALID);
    rpc_server_free(srv);
    /* insecure channels only to loopback */
    rpc_channel *ch = NULL;
    rpc_channel_options co = {.insecure = true, .secret = SECRET};
    assert_int_equal(rpc_channel_new("10.1.2.3:50051", &co, &ch), FU_ERR_INVALID);
    assert_int_equal(rpc_channel_new("[::]:1", &co, &ch), FU_ERR_INVALID);
    assert_null(ch);
    co = (rpc_channel_options){.tls_ca = "/nonexistent/ca.pem", .secret = SECRET};
    assert_int_equal(rpc_channel_new("10.1.2.3:50051", &co, &ch), FU_ERR_IO);
    rpc_server_free(NULL);
    rpc_channel_free(NULL);
    rpc_stream_free(NULL);
}

/* ---- tests: the typed services (shard-svc.h, swarm-svc.h) ---------------------------- */

/* Fails the handler's call with the condition's text (cmocka cannot assert off the main thread). */
#define TS_CHECK(c)                                                                        \
    do {                                                                                   \
        if (!(c)) return rpc_status_setf(st, RPC_FAILED_PRECONDITION, "check: %s", #c);    \
    } while (0)

static const uint8_t ts_hidden_bytes[16] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16};
static const int64_t ts_hidden_shape[2] = {2, 4};
static const smp_bias ts_bias[2] = {{7, -100.0f}, {8, 1.5f}};
static pthread_mutex_t ts_mu = PTHREAD_MUTEX_INITIALIZER;
static int ts_sessions_ended; /* session handlers returned (under ts_mu) */

/* Counts a session handler's end (the test waits for it). */
static int ts_ended(int rc) {
    pthread_mutex_lock(&ts_mu);
    ts_sessions_ended++;
    pthread_mutex_unlock(&ts_mu);
    return rc;
}

static int ts_session_loop(shard_svc_stream *s, rpc_status *st);

/* The step the typed client sends first (and the server expects). */
static void ts_step1(shard_svc_step *step, shard_svc_input *in, wire_tensor *hidden, shard_svc_output_spec *spec,
                     shard_svc_sampling *samp) {
    static const int32_t toks[2] = {5, 6};
    *hidden = (wire_tensor){.dtype = WIRE_BF16, .n_shape = 2, .shape = ts_hidden_shape, .data = ts_hidden_bytes,
                            .data_len = sizeof ts_hidden_bytes};
    *in = (shard_svc_input){toks, 2, hidden};
    smp_params p = smp_params_default();
    p.temperature = 0.5f;
    p.top_p = 0; /* as on the wire: 0 is "off" */
    p.seed = 42;
    p.bias = ts_bias;
    p.n_bias = 2;
    *samp = shard_svc_sampling_from_params(&p, 1);
    *spec = (shard_svc_output_spec){true, true, samp, 2, false, false};
    *step = (shard_svc_step){9, 4, in, spec, true, 3, 2};
}

/* Checks a received step against ts_step1. */
static int ts_check_step1(const shard_svc_step *s, rpc_status *st) {
    TS_CHECK(s->request_id == 9 && s->start_position == 4 && s->has_rollback && s->rollback_to == 3 &&
             s->prefix_reuse == 2);
    TS_CHECK(s->input && s->input->n_tokens == 2 && s->input->tokens[1] == 6);
    const wire_tensor *h = s->input->hidden;
    TS_CHECK(h && h->dtype == WIRE_BF16 && h->n_shape == 2 && h->shape[0] == 2 && h->shape[1] == 4);
    TS_CHECK(h->data_len == 16 && !memcmp(h->data, ts_hidden_bytes, 16) && h->scales_len == 0);
    const shard_svc_output_spec *o = s->output;
    TS_CHECK(o && o->want_logits && o->all_positions && o->top_logprobs == 2 && o->sampling);
    const shard_svc_sampling *w = o->sampling;
    TS_CHECK(w->temperature == 0.5f && w->top_p == 0 && w->seed == 42 && w->penalty_start == 1);
    TS_CHECK(w->n_logit_bias == 2 && w->logit_bias[0].token == 7 && w->logit_bias[1].bias == 1.5f);
    smp_params p = shard_svc_sampling_to_params(w);
    TS_CHECK(p.top_p == 1.0f && p.repetition_penalty == 1.0f && p.n_bias == 2);
    return RPC_OK;
}

/* Answers step 1: the request's own hidden states back (a relay's move), logits, one sampled
 * token with two alternatives, two timings. */
static int ts_reply_step1(shard_svc_stream *s, const shard_svc_step *req, rpc_status *st) {
    static const int64_t lshape[2] = {1, 3};
    static const float logits[3] = {0.5f, -1.0f, 2.0f};
    static const int32_t tok[1] = {11}, alt[2] = {11, 12};
    static const float lp[1] = {-0.25f}, alt_lp[2] = {-0.25f, -2.0f};
    wire_tensor lt = {.dtype = WIRE_F32, .n_shape = 2, .shape = lshape, .data = (const uint8_t *)logits,
                      .data_len = sizeof logits};
    shard_svc_top top = {alt, alt_lp, 2};
    shard_svc_output out = {req->input->hidden, &lt, tok, 1, lp, 1, &top, 1};
    shard_svc_timing t[2] = {{"a:1", 0, 1, 10, 20, 30, 0}, {"b:2", 1, 2, 11, 21, 31, 5}};
    shard_svc_step_reply rep = {req->request_id, 6, &out, t, 2};
    return shard_svc_stream_send_step(s, &rep, st);
}

static int ts_session(void *ctx, shard_svc_stream *s, rpc_status *st) {
    (void)ctx;
    return ts_ended(ts_session_loop(s, st));
}

/* The open, then steps until the client closes. */
static int ts_session_loop(shard_svc_stream *s, rpc_status *st) {
    const shard_svc_request *req;
    int rc = shard_svc_stream_recv(s, &req, 5000, st);
    if (rc) return rc;
    TS_CHECK(req->kind == SHARD_SVC_OPEN);
    const shard_svc_open *o = req->open;
    if (!strcmp(o->session_id, "wrong")) { /* answers an open with a step reply */
        shard_svc_step_reply rep = {0};
        return shard_svc_stream_send_step(s, &rep, st);
    }
    TS_CHECK(!strcmp(o->session_id, "typed") && o->max_length == 9 && o->wire_dtype == WIRE_INT8_BLOCK);
    TS_CHECK(o->int8_block_size == 32 && !strcmp(o->adapter_id, "") && o->idle_timeout_ms == 77);
    TS_CHECK(o->n_prefix_tokens == 3 && o->prefix_tokens[2] == 42);
    TS_CHECK(o->first_block == 0 && o->last_block == 2 && o->n_chain == 2);
    TS_CHECK(!strcmp(o->chain[1].address, "b:2") && o->chain[1].first_block == 3 && o->chain[1].last_block == 4);
    TS_CHECK(!strcmp(o->chain[0].tls_server_name, "name") && !strcmp(o->chain[1].tls_server_name, ""));
    shard_svc_opened op = {o->session_id, 0, 2, 9, WIRE_INT8_BLOCK, 123, o->n_prefix_tokens == 3 ? 2 : -1};
    if ((rc = shard_svc_stream_send_opened(s, &op, st))) return rc;
    for (int n = 0;; n++) {
        if ((rc = shard_svc_stream_recv(s, &req, 5000, st))) return rc == RPC_END_OF_STREAM ? RPC_OK : rc;
        if (req->kind == SHARD_SVC_CLOSE) return RPC_OK;
        TS_CHECK(req->kind == SHARD_SVC_STEP);
        if (n == 0) {
            if ((rc = ts_check_step1(req->step, st)) || (rc = ts_reply_step1(s, req->step, st))) return rc;
            continue;
        }
        const shard_svc_step *sr = req->step;
        TS_CHECK(!sr->has_rollback && !sr->output && sr->input && !sr->input->hidden);
        shard_svc_step_reply rep = {sr->request_id, 7, NULL, NULL, 0};
        if ((rc = shard_svc_stream_send_step(s, &rep, st))) return rc;
    }
}

static int ts_info(void *ctx, shard_svc_info *r, rpc_status *st) {
    (void)ctx;
    (void)st;
    static const int dtypes[2] = {WIRE_F32, WIRE_BF16};
    r->model_name = "tiny";
    r->n_layers = 4;
    r->last_block = 4;
    r->has_head = true;
    r->device = "cpu";
    r->tokens_per_s = 12.5;
    r->total_kv_bytes = 1 << 20;
    r->wire_dtypes = dtypes;
    r->n_wire_dtypes = 2;
    static const double pt[2] = {16, 64}, ps[2] = {0.001, 0.003}, dt[3] = {1, 2, 4}, ds[3] = {1e-4, 1.5e-4, 2e-4};
    r->prompt_step_tokens = pt, r->prompt_step_s = ps, r->n_prompt_steps = 2;
    r->decode_step_tokens = dt, r->decode_step_s = ds, r->n_decode_steps = 3;
    return RPC_OK;
}

static int ts_health(void *ctx, shard_svc_health *r, rpc_status *st) {
    (void)ctx;
    (void)st;
    r->status = SHARD_SVC_SERVING_DRAINING;
    r->message = "draining";
    return RPC_OK;
}

static const shard_svc_handlers ts_handlers = {.session = ts_session, .info = ts_info, .health = ts_health};

static rpc_server *typed_server_start(void) {
    rpc_server_options o = {.address = "127.0.0.1:0", .secret = SECRET, .allow_insecure = true, .n_workers = 2};
    rpc_server *srv;
    assert_int_equal(rpc_server_new(&o, &srv), FU_OK);
    assert_int_equal(shard_svc_serve(srv, &ts_handlers), FU_OK);
    assert_int_equal(rpc_server_start(srv), FU_OK);
    return srv;
}

/* A Session over the typed client and server: every field of open and step arrives as sent,
 * received views can be sent on (a relay's hidden states), a wrong reply kind is named. */
static void test_shard_svc_session(void **state) {
    (void)state;
    rpc_server *srv = typed_server_start();
    rpc_channel *ch = plain_channel(srv);
    shard_svc_hop hops[2] = {{"a:1", 2, 3, "name"}, {"b:2", 3, 4, NULL}};
    const int32_t prefix[3] = {1, 7, 42};
    shard_svc_open open = {"typed", 9, WIRE_INT8_BLOCK, 32, NULL, 0, 2, hops, 2, 77, prefix, 3};
    shard_svc_session *sess;
    rpc_status st;
    int rc = shard_svc_session_open(ch, &open, 5000, &sess, &st);
    if (rc) fail_msg("open: %s %s", rpc_code_str(rc), st.message);
    assert_int_equal(shard_svc_session_cached(sess), 2);

    shard_svc_step step;
    shard_svc_input in;
    wire_tensor hidden;
    shard_svc_output_spec spec;
    shard_svc_sampling samp;
    ts_step1(&step, &in, &hidden, &spec, &samp);
    const shard_svc_step_reply *rep;
    rc = shard_svc_session_step(sess, &step, &rep, &st);
    if (rc) fail_msg("step: %s %s", rpc_code_str(rc), st.message);
    assert_int_equal(rep->request_id, 9);
    assert_int_equal(rep->position, 6);
    const shard_svc_output *o = rep->output;
    assert_non_null(o);
    assert_non_null(o->hidden);
    assert_int_equal(o->hidden->data_len, 16);
    assert_memory_equal(o->hidden->data, ts_hidden_bytes, 16);
    assert_int_equal(o->hidden->shape[1], 4);
    assert_non_null(o->logits);
    assert_int_equal(o->logits->dtype, WIRE_F32);
    assert_int_equal(o->logits->data_len, 12);
    assert_int_equal(o->n_tokens, 1);
    assert_int_equal(o->tokens[0], 11);
    assert_true(o->logprobs[0] == -0.25f);
    assert_int_equal(o->n_top, 1);
    assert_int_equal(o->top[0].n, 2);
    assert_int_equal(o->top[0].tokens[1], 12);
    assert_true(o->top[0].logprobs[1] == -2.0f);
    assert_int_equal(rep->n_timing, 2);
    assert_string_equal(rep->timing[1].server, "b:2");
    assert_int_equal(rep->timing[1].total_us, 31);
    assert_int_equal(rep->timing[1].prefix_hit_tokens, 5);

    shard_svc_input in2 = {in.tokens, 1, NULL};
    shard_svc_step step2 = {10, 6, &in2, NULL, false, 0, 0};
    assert_int_equal(shard_svc_session_step(sess, &step2, &rep, &st), RPC_OK);
    assert_int_equal(rep->position, 7);
    assert_null(rep->output);
    assert_int_equal(rep->n_timing, 0);
    shard_svc_session_close(sess, "bye"); /* the handler ends: closed, or cancelled by the free */
    int ended = 0;
    for (int i = 0; i < 500 && ended < 1; i++) {
        pthread_mutex_lock(&ts_mu);
        ended = ts_sessions_ended;
        pthread_mutex_unlock(&ts_mu);
        if (!ended) usleep(10000);
    }
    assert_int_equal(ended, 1);

    open.session_id = "wrong";
    assert_int_equal(shard_svc_session_open(ch, &open, 5000, &sess, &st), RPC_UNEXPECTED_REPLY);
    assert_null(sess);
    assert_string_equal(st.message, "expected an open reply");
    rpc_channel_free(ch);
    rpc_server_free(srv);
}

/* Info, Health and Echo of the typed service; Echo needs no handler of the component's. */
static void test_shard_svc_unary(void **state) {
    (void)state;
    rpc_server *srv = typed_server_start();
    rpc_channel *ch = plain_channel(srv);
    rpc_status st;
    shard_svc_info *info;
    assert_int_equal(shard_svc_info_get(ch, 5000, &info, &st), RPC_OK);
    assert_string_equal(info->model_name, "tiny");
    assert_string_equal(info->dtype, "");
    assert_int_equal(info->last_block, 4);
    assert_true(info->has_head && !info->has_embeddings);
    assert_true(info->tokens_per_s == 12.5);
    assert_int_equal(info->n_wire_dtypes, 2);
    assert_int_equal(info->wire_dtypes[1], WIRE_BF16);
    assert_int_equal(info->n_prompt_steps, 2), assert_int_equal(info->n_decode_steps, 3);
    assert_true(info->prompt_step_tokens[1] == 64 && info->prompt_step_s[1] == 0.003);
    assert_true(info->decode_step_tokens[2] == 4 && info->decode_step_s[2] == 2e-4);
    shard_svc_info_free(info);

    Fusion__HealthRequest hr = FUSION__HEALTH_REQUEST__INIT;
    ProtobufCMessage *m;
    assert_int_equal(rpc_call_unary(ch, RPC_SHARD_HEALTH, &hr.base, &fusion__health_reply__descriptor, &m, 5000, &st),
                     RPC_OK);
    assert_int_equal(((Fusion__HealthReply *)m)->status, FUSION__HEALTH_REPLY__SERVING_STATUS__SERVING_STATUS_DRAINING);
    rpc_msg_free(m);

    assert_int_equal(shard_svc_echo(ch, 1000, 5000, &st), RPC_OK);
    assert_int_equal(shard_svc_echo(ch, SHARD_SVC_ECHO_MAX + 1, 5000, &st), RPC_INVALID_ARGUMENT);
    double rtt, bw;
    assert_int_equal(shard_svc_measure_link(ch, 64 << 10, 5000, &rtt, &bw, &st), RPC_OK);
    assert_true(rtt > 0 && bw > 0);
    /* Forward has no handler here */
    Fusion__ForwardRequest fr = FUSION__FORWARD_REQUEST__INIT;
    assert_int_equal(rpc_call_unary(ch, RPC_SHARD_FORWARD, &fr.base, &fusion__forward_reply__descriptor, &m, 5000, &st),
                     RPC_UNIMPLEMENTED);
    rpc_channel_free(ch);
    rpc_server_free(srv);
}

/* Bytes packed from generated messages decode into the same views; a typed reply packs to the
 * size of its generated twin; malformed bytes are refused. */
static void test_shard_svc_wire(void **state) {
    (void)state;
    int64_t toks[2] = {3, 4};
    Fusion__LogitBias b = FUSION__LOGIT_BIAS__INIT, *bp = &b;
    b.token = 9;
    b.bias = -100;
    Fusion__Sampling smp = FUSION__SAMPLING__INIT;
    smp.top_k = 5;
    smp.n_logit_bias = 1;
    smp.logit_bias = &bp;
    Fusion__OutputSpec os = FUSION__OUTPUT_SPEC__INIT;
    os.sampling = &smp;
    Fusion__Input in = FUSION__INPUT__INIT;
    in.tokens = toks;
    in.n_tokens = 2;
    Fusion__StepRequest sr = FUSION__STEP_REQUEST__INIT;
    sr.request_id = 3;
    sr.input = &in;
    sr.output = &os;
    sr.rollback_case = FUSION__STEP_REQUEST__ROLLBACK_ROLLBACK_TO;
    sr.rollback_to = 0;
    Fusion__SessionRequest req = FUSION__SESSION_REQUEST__INIT;
    req.kind_case = FUSION__SESSION_REQUEST__KIND_STEP;
    req.step = &sr;
    uint8_t buf[256];
    size_t n = protobuf_c_message_pack(&req.base, buf);
    const shard_svc_request *r;
    rpc_status st;
    assert_int_equal(shard_svc_request_decode(buf, n, 1 << 20, &r, &st), RPC_OK);
    assert_int_equal(r->kind, SHARD_SVC_STEP);
    assert_true(r->step->has_rollback && r->step->rollback_to == 0);
    assert_int_equal(r->step->input->n_tokens, 2);
    assert_null(r->step->input->hidden);
    assert_int_equal(r->step->output->sampling->top_k, 5);
    assert_int_equal(r->step->output->sampling->logit_bias[0].token, 9);
    shard_svc_request_free(r);
    assert_int_equal(shard_svc_request_decode(buf, n, n - 1, &r, &st), RPC_RESOURCE_EXHAUSTED);
    assert_null(r);
    uint8_t junk[4] = {0x12, 0xff, 0xff, 0x01};
    assert_int_equal(shard_svc_request_decode(junk, sizeof junk, 1 << 20, &r, &st), RPC_INVALID_ARGUMENT);
    Fusion__CloseSession cl = FUSION__CLOSE_SESSION__INIT;
    cl.reason = "bye";
    Fusion__SessionRequest close = FUSION__SESSION_REQUEST__INIT;
    close.kind_case = FUSION__SESSION_REQUEST__KIND_CLOSE;
    close.close = &cl;
    n = protobuf_c_message_pack(&close.base, buf);
    assert_int_equal(shard_svc_request_decode(buf, n, 1 << 20, &r, &st), RPC_OK);
    assert_int_equal(r->kind, SHARD_SVC_CLOSE);
    assert_string_equal(r->close_reason, "bye");
    shard_svc_request_free(r);
    Fusion__SessionRequest none = FUSION__SESSION_REQUEST__INIT;
    n = protobuf_c_message_pack(&none.base, buf);
    assert_int_equal(shard_svc_request_decode(buf, n, 1 << 20, &r, &st), RPC_OK);
    assert_int_equal(r->kind, SHARD_SVC_NONE);
    shard_svc_request_free(r);

    /* a typed reply and its generated twin */
    int32_t tok = 7, alt[2] = {7, 8};
    float lp = -0.5f, alt_lp[2] = {-0.5f, -1.5f};
    shard_svc_top top = {alt, alt_lp, 2};
    shard_svc_output out = {.tokens = &tok, .n_tokens = 1, .logprobs = &lp, .n_logprobs = 1, .top = &top, .n_top = 1};
    shard_svc_timing t = {"x:1", 0, 4, 1, 2, 3, 0};
    shard_svc_step_reply rep = {5, 8, &out, &t, 1};
    size_t bytes = 0;
    assert_int_equal(shard_svc_step_reply_size(&rep, &bytes, &st), RPC_OK);
    Fusion__TokenLogprob e0 = FUSION__TOKEN_LOGPROB__INIT, e1 = FUSION__TOKEN_LOGPROB__INIT, *ep[2] = {&e0, &e1};
    e0.token = 7, e0.logprob = -0.5f, e1.token = 8, e1.logprob = -1.5f;
    Fusion__TopLogprobs tl = FUSION__TOP_LOGPROBS__INIT, *tlp = &tl;
    tl.n_entries = 2;
    tl.entries = ep;
    Fusion__Output go = FUSION__OUTPUT__INIT;
    int64_t tok64 = tok; /* int64 on the wire */
    go.n_tokens = 1, go.tokens = &tok64, go.n_logprobs = 1, go.logprobs = &lp, go.n_top_logprobs = 1;
    go.top_logprobs = &tlp;
    Fusion__ServerTiming gt = FUSION__SERVER_TIMING__INIT, *gtp = &gt;
    gt.server = "x:1", gt.last_block = 4, gt.queue_us = 1, gt.compute_us = 2, gt.total_us = 3;
    Fusion__StepReply gs = FUSION__STEP_REPLY__INIT;
    gs.request_id = 5, gs.position = 8, gs.output = &go, gs.n_timing = 1, gs.timing = &gtp;
    Fusion__SessionReply grep = FUSION__SESSION_REPLY__INIT;
    grep.kind_case = FUSION__SESSION_REPLY__KIND_STEP;
    grep.step = &gs;
    assert_int_equal(bytes, protobuf_c_message_get_packed_size(&grep.base));
}

/* ---- the typed Swarm service ---- */

static int tw_join(void *ctx, const swarm_svc_member *m, swarm_svc_join_reply *out, rpc_status *st) {
    (void)ctx;
    TS_CHECK(m && !strcmp(m->address, "127.0.0.1:9") && !strcmp(m->model_name, "") && m->n_layers == 4);
    TS_CHECK(m->fixed_span && m->hidden_size == 64 && m->total_kv_bytes == 1000 && !strcmp(m->load_error, "no"));
    TS_CHECK(m->n_links == 2 && !strcmp(m->links[1].address, "p:2") && m->links[1].bandwidth_bytes_per_s == 5e6);
    *out = (swarm_svc_join_reply){5, 300, true, 1, 3};
    return RPC_OK;
}

static int tw_heartbeat(void *ctx, const swarm_svc_heartbeat_request *req, swarm_svc_heartbeat_reply *out,
                        rpc_status *st) {
    (void)ctx;
    if (req->member_id != 5) return rpc_status_setf(st, RPC_NOT_FOUND, "no member %llu", (unsigned long long)req->member_id);
    TS_CHECK(req->leaving == !req->status);
    snprintf(out->peers[0], sizeof out->peers[0], "a:1");
    snprintf(out->peers[2], sizeof out->peers[2], "b:2");
    out->n_peers = 3; /* peers[1] stays "" */
    return RPC_OK;
}

static const swarm_svc_handlers tw_handlers = {NULL, tw_join, tw_heartbeat};

static void test_swarm_svc(void **state) {
    (void)state;
    rpc_server_options so = {.address = "127.0.0.1:0", .secret = SECRET, .allow_insecure = true, .n_workers = 2};
    rpc_server *srv;
    assert_int_equal(rpc_server_new(&so, &srv), FU_OK);
    assert_int_equal(swarm_svc_serve(srv, &tw_handlers), FU_OK);
    assert_int_equal(rpc_server_start(srv), FU_OK);
    rpc_channel *ch = plain_channel(srv);
    swarm_svc_link links[2] = {{"p:1", 0.001, 1e6}, {"p:2", 0.002, 5e6}};
    swarm_svc_member m = {.address = "127.0.0.1:9", .n_layers = 4, .fixed_span = true, .hidden_size = 64,
                          .total_kv_bytes = 1000, .load_error = "no", .links = links, .n_links = 2};
    swarm_svc_join_reply jr;
    rpc_status st;
    int rc = swarm_svc_join(ch, &m, 5000, &jr, &st);
    if (rc) fail_msg("join: %s %s", rpc_code_str(rc), st.message);
    assert_true(jr.member_id == 5 && jr.heartbeat_ms == 300 && jr.has_span && jr.first_block == 1 &&
                jr.last_block == 3);
    swarm_svc_heartbeat_request hb = {5, &m, false};
    swarm_svc_heartbeat_reply hr;
    rc = swarm_svc_heartbeat(ch, &hb, 5000, &hr, &st);
    if (rc) fail_msg("heartbeat: %s %s", rpc_code_str(rc), st.message);
    assert_false(hr.has_span);
    assert_int_equal(hr.n_peers, 2); /* the empty one is left out */
    assert_string_equal(hr.peers[1], "b:2");
    hb = (swarm_svc_heartbeat_request){5, NULL, true};
    assert_int_equal(swarm_svc_heartbeat(ch, &hb, 5000, &hr, &st), RPC_OK);
    hb.member_id = 6;
    assert_int_equal(swarm_svc_heartbeat(ch, &hb, 5000, &hr, &st), RPC_NOT_FOUND);
    assert_string_equal(st.message, "no member 6");
    rpc_channel_free(ch);
    rpc_server_free(srv);
}

int main(int argc, char **argv) {
    if (argc == 3 && !strcmp(argv[1], "--drop-client")) return drop_client_main(atoi(argv[2]));
    g_self = "/proc/self/exe";
    static char self[4096];
    ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
    if (n > 0) {
        self[n] = '\0';
        g_self = self;
    }
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_codes_and_mapping),
        cmocka_unit_test(test_loopback_addresses),
        cmocka_unit_test(test_messages),
        cmocka_unit_test(test_unary_echo),
        cmocka_unit_test(test_stream_1000_steps),
        cmocka_unit_test(test_concurrent_clients),
        cmocka_unit_test(test_cancel_and_drop_noticed),
        cmocka_unit_test(test_secret_required),
        cmocka_unit_test(test_malformed_payload),
        cmocka_unit_test(test_oversize),
        cmocka_unit_test(test_shutdown_with_open_stream),
        cmocka_unit_test(test_tls),
        cmocka_unit_test(test_setup_refusals),
        cmocka_unit_test(test_shard_svc_session),
        cmocka_unit_test(test_shard_svc_unary),
        cmocka_unit_test(test_shard_svc_wire),
        cmocka_unit_test(test_swarm_svc),
    };
    return cmocka_run_group_tests(tests, setup_certs, teardown_certs);
}
