/* rpc.c -- the RPC layer's status codes, message packing, streams (both sides) and client. */
#include "rpc.h"

#include <arpa/inet.h>
#include <ctype.h>
#include <limits.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <grpc/byte_buffer_reader.h>
#include <grpc/grpc_security.h>
#include <grpc/support/log.h>
#include <grpc/support/time.h>
#include <openssl/crypto.h>
#include <openssl/err.h>
#include <openssl/pem.h>
#include <openssl/x509.h>

#include "log.h"
#include "mapped-file.h"
#include "rpc-impl.h"
#include "status.h"

#define RPC_PEM_MAX (1u << 20) /* largest PEM file we read */
#define RPC_SECRET_MAX 1024
#define RPC_CANCEL_SETTLE_MS 2 /* see rpc_stream_recv */

/* ---- status ------------------------------------------------------------------ */

const char *rpc_code_str(int code) {
    switch (code) {
#define RPC_CODE_CASE_(name, value, desc) \
    case value:                           \
        return desc;
        RPC_CODE_LIST(RPC_CODE_CASE_)
#undef RPC_CODE_CASE_
    }
    return "unknown code";
}

int rpc_status_setf(rpc_status *st, int code, const char *fmt, ...) {
    if (st) {
        st->code = (rpc_code)code;
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(st->message, sizeof st->message, fmt, ap);
        va_end(ap);
    }
    return code;
}

rpc_code rpc_code_from_fu(int fu) {
    switch (fu) {
    case FU_OK: return RPC_OK;
    case FU_ERR_NOMEM: return RPC_RESOURCE_EXHAUSTED;
    case FU_ERR_IO: return RPC_INTERNAL;
    case FU_ERR_FORMAT: return RPC_INVALID_ARGUMENT;
    case FU_ERR_UNSUPPORTED: return RPC_UNIMPLEMENTED;
    case FU_ERR_INVALID: return RPC_INVALID_ARGUMENT;
    case FU_ERR_NOT_FOUND: return RPC_NOT_FOUND;
    case FU_ERR_RANGE: return RPC_OUT_OF_RANGE;
    case FU_ERR_NETWORK: return RPC_UNAVAILABLE;
    case FU_ERR_CHECKSUM: return RPC_DATA_LOSS;
    case FU_ERR_TEMPLATE: return RPC_INVALID_ARGUMENT;
    case FU_ERR_AUTH: return RPC_UNAUTHENTICATED;
    case FU_ERR_EXHAUSTED: return RPC_RESOURCE_EXHAUSTED;
    case FU_ERR_CANCELLED: return RPC_CANCELLED;
    case FU_ERR_INTERNAL: return RPC_INTERNAL;
    }
    return RPC_UNKNOWN;
}

int rpc_code_to_fu(int code) {
    switch (code) {
    case RPC_OK: return FU_OK;
    case RPC_CANCELLED: return FU_ERR_CANCELLED;
    case RPC_INVALID_ARGUMENT:
    case RPC_FAILED_PRECONDITION:
    case RPC_ALREADY_EXISTS: return FU_ERR_INVALID;
    case RPC_NOT_FOUND:
    case RPC_END_OF_STREAM: return FU_ERR_NOT_FOUND;
    case RPC_PERMISSION_DENIED:
    case RPC_UNAUTHENTICATED: return FU_ERR_AUTH;
    case RPC_RESOURCE_EXHAUSTED: return FU_ERR_EXHAUSTED;
    case RPC_OUT_OF_RANGE: return FU_ERR_RANGE;
    case RPC_UNIMPLEMENTED: return FU_ERR_UNSUPPORTED;
    case RPC_DEADLINE_EXCEEDED:
    case RPC_UNAVAILABLE:
    case RPC_ABORTED: return FU_ERR_NETWORK;
    case RPC_DATA_LOSS: return FU_ERR_CHECKSUM;
    case RPC_UNEXPECTED_REPLY: return FU_ERR_FORMAT;
    }
    return FU_ERR_INTERNAL;
}

int rpc_status_from_fu(rpc_status *st, int fu) {
    rpc_code code = rpc_code_from_fu(fu);
    const char *msg = fu == FU_OK ? "" : fu_last_error();
    if (fu != FU_OK && !msg[0]) msg = fu_status_str(fu);
    return rpc_status_setf(st, code, "%s", msg);
}

void rpc__status_from_slice(rpc_status *st, int code, grpc_slice msg) {
    if (!st) return;
    st->code = (rpc_code)code;
    size_t n = GRPC_SLICE_LENGTH(msg);
    if (n >= sizeof st->message) n = sizeof st->message - 1;
    memcpy(st->message, GRPC_SLICE_START_PTR(msg), n);
    st->message[n] = '\0';
}

int rpc__client_status(rpc_status *st, int code, grpc_slice details, int tls) {
    rpc__status_from_slice(st, code, details);
    /* gRPC's words for a connection closed before it was ready, e.g. by a refused TLS handshake;
     * they name no cause, so say the likely one (briefly: callers quote 150 characters) */
    if (!st || !tls || code != RPC_UNAVAILABLE || strncmp(st->message, "failed to connect", 17) ||
        !strstr(st->message, "Socket closed"))
        return code;
    return rpc_status_setf(st, code, "the server closed the TLS connection while it was set up: %s",
                           tls == RPC_CHANNEL_TLS_CERT
                               ? "it may require client certificates signed by another CA "
                                 "than this one's"
                               : "it may require a client certificate, and none is configured");
}

/* ---- addresses, secrets, PEM -------------------------------------------------- */

bool rpc_address_is_loopback(const char *address) {
    if (!address) return false;
    if (!strncmp(address, "unix:", 5) || !strncmp(address, "unix-abstract:", 14)) return true;
    if (!strncmp(address, "dns:///", 7)) address += 7;
    else if (!strncmp(address, "ipv4:", 5) || !strncmp(address, "ipv6:", 5)) address += 5;
    char host[256];
    const char *end;
    if (address[0] == '[') {
        address++;
        end = strchr(address, ']');
    } else {
        end = strrchr(address, ':');
        if (!end) end = address + strlen(address);
    }
    if (!end || (size_t)(end - address) >= sizeof host) return false;
    memcpy(host, address, (size_t)(end - address));
    host[end - address] = '\0';
    if (!strcasecmp(host, "localhost")) return true;
    unsigned char a[16];
    if (inet_pton(AF_INET, host, a) == 1) return a[0] == 127;
    if (inet_pton(AF_INET6, host, a) == 1) {
        static const unsigned char v6_loop[16] = {[15] = 1};
        static const unsigned char v4_mapped[12] = {[10] = 0xff, [11] = 0xff};
        if (!memcmp(a, v6_loop, 16)) return true;
        return !memcmp(a, v4_mapped, 12) && a[12] == 127;
    }
    return false;
}

int rpc__check_secret(const char *secret) {
    if (!secret || !secret[0]) return fu_errorf(FU_ERR_INVALID, "rpc: a swarm secret is required");
    size_t n = strlen(secret);
    if (n > RPC_SECRET_MAX)
        return fu_errorf(FU_ERR_INVALID, "rpc: swarm secret longer than %d bytes", RPC_SECRET_MAX);
    for (size_t i = 0; i < n; i++)
        if (secret[i] < 0x20 || secret[i] > 0x7e)
            return fu_errorf(FU_ERR_INVALID, "rpc: swarm secret must be printable ASCII");
    return FU_OK;
}

int rpc__load_pem(const char *what, const char *value, char **out) {
    *out = NULL;
    if (strstr(value, "-----BEGIN")) {
        *out = strdup(value);
        return *out ? FU_OK : fu_errorf(FU_ERR_NOMEM, "rpc: out of memory");
    }
    char *buf;
    size_t n;
    int rc = mf_read(value, RPC_PEM_MAX, &buf, &n); /* regular files only: a FIFO never blocks */
    if (rc) /* absent, unreadable, not a regular file, too large: all FU_ERR_IO here */
        return fu_errorf(rc == FU_ERR_NOMEM ? rc : FU_ERR_IO, "rpc: %s file: %s", what,
                         fu_last_error());
    if (strlen(buf) != n || !strstr(buf, "-----BEGIN")) {
        free(buf);
        return fu_errorf(FU_ERR_FORMAT, "rpc: %s file '%s' is not PEM", what, value);
    }
    *out = buf;
    return FU_OK;
}

/* An encrypted key is refused, never prompted for. */
static int no_passphrase(char *buf, int size, int rwflag, void *u) {
    (void)buf, (void)size, (void)rwflag, (void)u;
    return -1;
}

static X509 *pem_cert(const char *pem) {
    BIO *bio = BIO_new_mem_buf(pem, -1);
    X509 *x = bio ? PEM_read_bio_X509(bio, NULL, no_passphrase, NULL) : NULL;
    BIO_free(bio);
    return x;
}

static EVP_PKEY *pem_key(const char *pem) {
    BIO *bio = BIO_new_mem_buf(pem, -1);
    EVP_PKEY *k = bio ? PEM_read_bio_PrivateKey(bio, NULL, no_passphrase, NULL) : NULL;
    BIO_free(bio);
    return k;
}

int rpc__check_pem_pair(const char *what, const char *cert, const char *key) {
    X509 *x = pem_cert(cert);
    EVP_PKEY *k = pem_key(key);
    int rc = FU_OK;
    if (!x)
        rc = fu_errorf(FU_ERR_FORMAT, "rpc: the %s certificate is not a PEM certificate", what);
    else if (!k)
        rc = fu_errorf(FU_ERR_FORMAT, "rpc: the %s key is not a PEM private key (unencrypted)",
                       what);
    else if (X509_check_private_key(x, k) != 1)
        rc = fu_errorf(FU_ERR_INVALID, "rpc: the %s key does not belong to the %s certificate",
                       what, what);
    X509_free(x);
    EVP_PKEY_free(k);
    ERR_clear_error();
    return rc;
}

void rpc__pems_free(rpc_pems *p) {
    if (p->key) OPENSSL_cleanse(p->key, strlen(p->key));
    free(p->key);
    free(p->cert);
    free(p->ca);
    memset(p, 0, sizeof *p);
}

/* ---- library lifetime ----------------------------------------------------------- */

/* gRPC's own log lines go through the project's logger. Its errors are mostly
 * about peers (a failed TLS handshake), so they are warnings here. */
static void grpc_log_to_fu(gpr_log_func_args *a) {
    fu_log_level level = a->severity == GPR_LOG_SEVERITY_ERROR  ? FU_LOG_LEVEL_WARN
                         : a->severity == GPR_LOG_SEVERITY_INFO ? FU_LOG_LEVEL_DEBUG
                                                                : FU_LOG_LEVEL_DEBUG;
    if ((int)level >= fu_log_threshold)
        fu_log_write(level, "grpc", a->file, a->line, "%s", a->message);
}

static void grpc_log_setup(void) { gpr_set_log_function(grpc_log_to_fu); }

void rpc__grpc_ref(void) {
    static pthread_once_t once = PTHREAD_ONCE_INIT;
    pthread_once(&once, grpc_log_setup);
    grpc_init();
}
void rpc__grpc_unref(void) { grpc_shutdown(); }

gpr_timespec rpc__deadline(int timeout_ms) {
    if (timeout_ms < 0) return gpr_inf_future(GPR_CLOCK_MONOTONIC);
    return gpr_time_add(gpr_now(GPR_CLOCK_MONOTONIC),
                        gpr_time_from_millis(timeout_ms, GPR_TIMESPAN));
}

void rpc__cq_destroy(grpc_completion_queue *cq) {
    if (!cq) return;
    grpc_completion_queue_shutdown(cq);
    while (grpc_completion_queue_next(cq, gpr_inf_future(GPR_CLOCK_MONOTONIC), NULL).type !=
           GRPC_QUEUE_SHUTDOWN) {
    }
    grpc_completion_queue_destroy(cq);
}

/* ---- messages ------------------------------------------------------------------ */

static bool is_message(const ProtobufCMessage *msg) {
    return msg && msg->descriptor &&
           msg->descriptor->magic == PROTOBUF_C__MESSAGE_DESCRIPTOR_MAGIC;
}

void rpc_msg_free(ProtobufCMessage *msg) {
    if (msg) protobuf_c_message_free_unpacked(msg, NULL);
}

int rpc_msg_unpack(const ProtobufCMessageDescriptor *desc, const void *data, size_t len,
                   size_t max_bytes, ProtobufCMessage **out, rpc_status *st) {
    *out = NULL;
    if (!desc || desc->magic != PROTOBUF_C__MESSAGE_DESCRIPTOR_MAGIC || (!data && len))
        return rpc_status_setf(st, RPC_INTERNAL, "rpc: bad message descriptor or buffer");
    if (max_bytes && len > max_bytes)
        return rpc_status_setf(st, RPC_RESOURCE_EXHAUSTED,
                               "message of %zu bytes exceeds the bound of %zu", len, max_bytes);
    ProtobufCMessage *m =
        protobuf_c_message_unpack(desc, NULL, len, len ? data : (const uint8_t *)"");
    if (!m)
        return rpc_status_setf(st, RPC_INVALID_ARGUMENT, "malformed %s message (%zu bytes)",
                               desc->name, len);
    *out = m;
    return rpc_status_setf(st, RPC_OK, "%s", "");
}

grpc_byte_buffer *rpc__bytes(const void *data, size_t len) {
    grpc_slice s = grpc_slice_malloc(len);
    if (len) memcpy(GRPC_SLICE_START_PTR(s), data, len);
    grpc_byte_buffer *bb = grpc_raw_byte_buffer_create(&s, 1);
    grpc_slice_unref(s);
    return bb;
}

int rpc__pack(const ProtobufCMessage *msg, size_t max_bytes, grpc_byte_buffer **out,
              rpc_status *st) {
    *out = NULL;
    if (!is_message(msg)) return rpc_status_setf(st, RPC_INTERNAL, "rpc: not a protobuf-c message");
    size_t n = protobuf_c_message_get_packed_size(msg);
    if (n > max_bytes)
        return rpc_status_setf(st, RPC_RESOURCE_EXHAUSTED,
                               "%s message of %zu bytes exceeds the bound of %zu",
                               msg->descriptor->name, n, max_bytes);
    grpc_slice s = grpc_slice_malloc(n);
    size_t packed = protobuf_c_message_pack(msg, GRPC_SLICE_START_PTR(s));
    if (packed != n) {
        grpc_slice_unref(s);
        return rpc_status_setf(st, RPC_INTERNAL, "rpc: packed %zu of %zu bytes", packed, n);
    }
    *out = grpc_raw_byte_buffer_create(&s, 1);
    grpc_slice_unref(s);
    return RPC_OK;
}

int rpc__unpack(const ProtobufCMessageDescriptor *desc, grpc_byte_buffer *bb, size_t max_bytes,
                ProtobufCMessage **out, rpc_status *st) {
    *out = NULL;
    grpc_byte_buffer_reader r;
    if (!grpc_byte_buffer_reader_init(&r, bb))
        return rpc_status_setf(st, RPC_INVALID_ARGUMENT, "cannot read the message (compressed?)");
    grpc_slice s = grpc_byte_buffer_reader_readall(&r);
    grpc_byte_buffer_reader_destroy(&r);
    int rc = rpc_msg_unpack(desc, GRPC_SLICE_START_PTR(s), GRPC_SLICE_LENGTH(s), max_bytes, out,
                            st);
    grpc_slice_unref(s);
    return rc;
}

/* ---- streams: completion handling ------------------------------------------------- */

bool rpc__stream_pump(rpc_stream *s, gpr_timespec deadline) {
    grpc_event ev = grpc_completion_queue_next(s->cq, deadline, NULL);
    if (ev.type != GRPC_OP_COMPLETE) return false;
    switch ((intptr_t)ev.tag) {
    case RPC_TAG_SEND:
        s->send_pending = false;
        grpc_byte_buffer_destroy(s->send_bb);
        s->send_bb = NULL;
        if (!ev.success) s->send_failed = true;
        break;
    case RPC_TAG_RECV:
        s->recv_pending = false;
        s->recv_ready = true;
        s->recv_ok = ev.success != 0;
        break;
    case RPC_TAG_END:
        s->end_pending = false;
        s->done = true;
        break;
    case RPC_TAG_MISC:
        s->misc_pending = false;
        break;
    }
    return true;
}

void rpc__stream_drain(rpc_stream *s) {
    while (s->send_pending || s->recv_pending || s->end_pending || s->misc_pending)
        rpc__stream_pump(s, gpr_inf_future(GPR_CLOCK_MONOTONIC));
}

void rpc__stream_destroy(rpc_stream *s) {
    if (!s) return;
    if (s->call) {
        rpc__stream_drain(s);
        grpc_call_unref(s->call);
    }
    rpc__cq_destroy(s->cq);
    grpc_byte_buffer_destroy(s->recv_bb);
    grpc_metadata_array_destroy(&s->initial_md);
    grpc_metadata_array_destroy(&s->trailing_md);
    grpc_slice_unref(s->details);
    free(s);
}

static int start_batch(rpc_stream *s, const grpc_op *ops, size_t n, int tag, rpc_status *st) {
    grpc_call_error e = grpc_call_start_batch(s->call, ops, n, (void *)(intptr_t)tag, NULL);
    if (e != GRPC_CALL_OK)
        return rpc_status_setf(st, RPC_INTERNAL, "rpc: grpc_call_start_batch failed (%d)", (int)e);
    return RPC_OK;
}

/* The call is over (or failing): the final outcome as seen by this side. */
static int stream_over(rpc_stream *s, rpc_status *st) {
    if (s->server) return rpc_status_setf(st, RPC_CANCELLED, "the client cancelled or went away");
    while (s->end_pending) rpc__stream_pump(s, gpr_inf_future(GPR_CLOCK_MONOTONIC));
    if (s->status == GRPC_STATUS_OK)
        return rpc_status_setf(st, RPC_END_OF_STREAM, "the server finished the stream");
    return rpc__client_status(st, (int)s->status, s->details, s->tls);
}

/* ---- streams: send / recv ------------------------------------------------------- */

/* What a receive reports once no more messages will come. */
static int server_eos(rpc_stream *s, rpc_status *st) {
    if (!s->server) return stream_over(s, st);
    if (s->eos_cancelled) return stream_over(s, st);
    return rpc_status_setf(st, RPC_END_OF_STREAM, "the client closed the stream");
}

static int stream_send_bb(rpc_stream *s, grpc_byte_buffer *bb, rpc_status *st) {
    while (s->send_pending) rpc__stream_pump(s, gpr_inf_future(GPR_CLOCK_MONOTONIC));
    if (s->send_failed || s->done) {
        grpc_byte_buffer_destroy(bb);
        return stream_over(s, st);
    }
    if (s->send_closed) {
        grpc_byte_buffer_destroy(bb);
        return rpc_status_setf(st, RPC_FAILED_PRECONDITION, "send after close_send");
    }
    grpc_op ops[2];
    memset(ops, 0, sizeof ops);
    size_t n = 0;
    bool first = s->server && !s->md_sent;
    if (first) ops[n++].op = GRPC_OP_SEND_INITIAL_METADATA;
    ops[n].op = GRPC_OP_SEND_MESSAGE;
    ops[n++].data.send_message.send_message = bb;
    s->send_bb = bb;
    int rc = start_batch(s, ops, n, RPC_TAG_SEND, st);
    if (rc != RPC_OK) {
        s->send_bb = NULL;
        grpc_byte_buffer_destroy(bb);
        return rc;
    }
    s->md_sent = s->md_sent || first;
    s->send_pending = true;
    return rpc_status_setf(st, RPC_OK, "%s", "");
}

int rpc_stream_send(rpc_stream *s, const ProtobufCMessage *msg, rpc_status *st) {
    grpc_byte_buffer *bb;
    int rc = rpc__pack(msg, s->max_msg, &bb, st);
    if (rc != RPC_OK) return rc;
    return stream_send_bb(s, bb, st);
}

int rpc_stream_send_raw(rpc_stream *s, const void *data, size_t len, rpc_status *st) {
    if (len > s->max_msg)
        return rpc_status_setf(st, RPC_RESOURCE_EXHAUSTED,
                               "message of %zu bytes exceeds the bound of %zu", len, s->max_msg);
    return stream_send_bb(s, rpc__bytes(data, len), st);
}

int rpc_stream_recv(rpc_stream *s, const ProtobufCMessageDescriptor *desc,
                    ProtobufCMessage **msg, int timeout_ms, rpc_status *st) {
    *msg = NULL;
    if (!desc) desc = s->req_desc;
    if (!desc) return rpc_status_setf(st, RPC_INTERNAL, "rpc_stream_recv: no message type");
    if (s->eos) return server_eos(s, st);
    if (!s->recv_pending && !s->recv_ready) {
        if (s->done) return stream_over(s, st);
        grpc_op op;
        memset(&op, 0, sizeof op);
        op.op = GRPC_OP_RECV_MESSAGE;
        op.data.recv_message.recv_message = &s->recv_bb;
        int rc = start_batch(s, &op, 1, RPC_TAG_RECV, st);
        if (rc != RPC_OK) return rc;
        s->recv_pending = true;
    }
    gpr_timespec deadline = rpc__deadline(timeout_ms);
    while (!s->recv_ready)
        if (!rpc__stream_pump(s, deadline))
            return rpc_status_setf(st, RPC_DEADLINE_EXCEEDED, "no message within %d ms",
                                   timeout_ms);
    s->recv_ready = false;
    grpc_byte_buffer *bb = s->recv_bb;
    s->recv_bb = NULL;
    if (!s->recv_ok || !bb) {
        grpc_byte_buffer_destroy(bb);
        s->eos = true;
        if (s->server && s->recv_ok) {
            /* A cancelled call also ends its receive with no message; its
             * close op then completes within microseconds, while after a
             * half-close it completes only with our status. Let it settle. */
            gpr_timespec settle = rpc__deadline(RPC_CANCEL_SETTLE_MS);
            while (!s->done && rpc__stream_pump(s, settle)) {
            }
        }
        s->eos_cancelled = !s->recv_ok || s->cancelled;
        return server_eos(s, st);
    }
    int rc = rpc__unpack(desc, bb, s->max_msg, msg, st);
    grpc_byte_buffer_destroy(bb);
    return rc;
}

bool rpc_stream_cancelled(rpc_stream *s) {
    while (rpc__stream_pump(s, gpr_inf_past(GPR_CLOCK_MONOTONIC))) {
    }
    return s->server ? s->done || s->send_failed : s->done;
}

/* ---- client --------------------------------------------------------------------- */

struct rpc_channel {
    grpc_channel *channel;
    size_t max_msg;
    char *secret; /* NULL: none */
    int tls;      /* RPC_CHANNEL_* */
};

/* Reads the CA and the client pair of o (nothing for plaintext) and checks that the key is
 * the certificate's, so that a wrong pair fails here rather than at every handshake. */
static int channel_pems_load(const rpc_channel_options *o, rpc_pems *p) {
    memset(p, 0, sizeof *p);
    if (!o->tls_client_cert != !o->tls_client_key)
        return fu_errorf(FU_ERR_INVALID,
                         "rpc: a client certificate needs its key, and a key its certificate");
    if (o->insecure) return FU_OK;
    int rc = FU_OK;
    if (o->tls_ca) rc = rpc__load_pem("CA certificate", o->tls_ca, &p->ca);
    if (!rc && o->tls_client_cert)
        rc = rpc__load_pem("client certificate", o->tls_client_cert, &p->cert);
    if (!rc && o->tls_client_key) rc = rpc__load_pem("client key", o->tls_client_key, &p->key);
    if (!rc && p->cert) rc = rpc__check_pem_pair("client", p->cert, p->key);
    if (rc) rpc__pems_free(p);
    return rc;
}

/* Fills args (room for 8) with a channel's settings; returns how many. */
static size_t channel_args(const rpc_channel_options *o, size_t max_msg, grpc_arg *args) {
    size_t n = 0;
    args[n++] = (grpc_arg){.type = GRPC_ARG_INTEGER, .key = GRPC_ARG_MAX_RECEIVE_MESSAGE_LENGTH,
                           .value.integer = (int)max_msg};
    args[n++] = (grpc_arg){.type = GRPC_ARG_INTEGER, .key = GRPC_ARG_MAX_SEND_MESSAGE_LENGTH,
                           .value.integer = (int)max_msg};
    /* No transparent retries: they buffer every sent message; the router
     * replays sessions itself. */
    args[n++] = (grpc_arg){.type = GRPC_ARG_INTEGER, .key = GRPC_ARG_ENABLE_RETRIES,
                           .value.integer = 0};
    /* Notice a dead server within ~40 s on a quiet connection. */
    args[n++] = (grpc_arg){.type = GRPC_ARG_INTEGER, .key = GRPC_ARG_KEEPALIVE_TIME_MS,
                           .value.integer = 30000};
    args[n++] = (grpc_arg){.type = GRPC_ARG_INTEGER, .key = GRPC_ARG_KEEPALIVE_TIMEOUT_MS,
                           .value.integer = 10000};
    if (!o->insecure && o->tls_server_name)
        args[n++] = (grpc_arg){.type = GRPC_ARG_STRING, .key = GRPC_SSL_TARGET_NAME_OVERRIDE_ARG,
                               .value.string = (char *)o->tls_server_name};
    return n;
}

/* Plaintext, or TLS verifying the server with p->ca and presenting p's client pair if any. */
static grpc_channel_credentials *channel_creds(const rpc_channel_options *o, const rpc_pems *p) {
    if (o->insecure) return grpc_insecure_credentials_create();
    grpc_ssl_pem_key_cert_pair pair = {.private_key = p->key, .cert_chain = p->cert};
    return grpc_ssl_credentials_create(p->ca, p->cert ? &pair : NULL, NULL, NULL);
}

int rpc_channel_new(const char *target, const rpc_channel_options *o, rpc_channel **out) {
    *out = NULL;
    if (!target || !target[0] || !o)
        return fu_errorf(FU_ERR_INVALID, "rpc: channel needs a target");
    if (o->insecure && !rpc_address_is_loopback(target))
        return fu_errorf(FU_ERR_INVALID,
                         "rpc: plaintext is only allowed to loopback; '%s' needs TLS", target);
    int rc = o->secret ? rpc__check_secret(o->secret) : FU_OK;
    rpc_pems pems;
    if (rc || (rc = channel_pems_load(o, &pems))) return rc;
    rpc_channel *ch = calloc(1, sizeof *ch);
    if (!ch || (o->secret && !(ch->secret = strdup(o->secret)))) {
        free(ch);
        rpc__pems_free(&pems);
        return fu_errorf(FU_ERR_NOMEM, "rpc: out of memory");
    }
    ch->max_msg = o->max_message_bytes ? o->max_message_bytes : RPC_DEFAULT_MAX_MESSAGE;
    if (ch->max_msg > INT_MAX) ch->max_msg = INT_MAX;
    rpc__grpc_ref();
    grpc_arg args[8];
    grpc_channel_args cargs = {.num_args = channel_args(o, ch->max_msg, args), .args = args};
    ch->tls = o->insecure ? RPC_CHANNEL_PLAIN : pems.cert ? RPC_CHANNEL_TLS_CERT : RPC_CHANNEL_TLS;
    grpc_channel_credentials *creds = channel_creds(o, &pems);
    rpc__pems_free(&pems);
    if (creds) ch->channel = grpc_channel_create(target, creds, &cargs);
    grpc_channel_credentials_release(creds);
    if (!ch->channel) {
        rpc_channel_free(ch);
        return fu_errorf(FU_ERR_INVALID, "rpc: cannot create a channel to '%s'", target);
    }
    *out = ch;
    return FU_OK;
}

void rpc_channel_free(rpc_channel *ch) {
    if (!ch) return;
    if (ch->channel) grpc_channel_destroy(ch->channel);
    free(ch->secret);
    free(ch);
    rpc__grpc_unref();
}

static grpc_call *channel_call(rpc_channel *ch, const char *method, grpc_completion_queue *cq,
                               int timeout_ms) {
    grpc_slice m = grpc_slice_from_static_string(method);
    return grpc_channel_create_call(ch->channel, NULL, GRPC_PROPAGATE_DEFAULTS, cq, m, NULL,
                                    rpc__deadline(timeout_ms > 0 ? timeout_ms : -1), NULL);
}

static void secret_md(const rpc_channel *ch, grpc_metadata *md) {
    memset(md, 0, sizeof *md);
    md->key = grpc_slice_from_static_string(RPC_SECRET_KEY);
    md->value = grpc_slice_from_static_string(ch->secret);
}

/* Runs a unary call with a packed request (consumed). */
static int call_unary_bb(rpc_channel *ch, const char *method, grpc_byte_buffer *req,
                         const ProtobufCMessageDescriptor *reply_desc, ProtobufCMessage **reply,
                         int timeout_ms, rpc_status *st) {
    grpc_completion_queue *cq = grpc_completion_queue_create_for_next(NULL);
    grpc_call *call = channel_call(ch, method, cq, timeout_ms);
    if (!call) {
        grpc_byte_buffer_destroy(req);
        rpc__cq_destroy(cq);
        return rpc_status_setf(st, RPC_INTERNAL, "rpc: cannot create a call to %s", method);
    }
    grpc_metadata md;
    grpc_metadata_array initial, trailing;
    grpc_metadata_array_init(&initial);
    grpc_metadata_array_init(&trailing);
    grpc_byte_buffer *rbb = NULL;
    grpc_status_code status = GRPC_STATUS_UNKNOWN;
    grpc_slice details = grpc_empty_slice();
    grpc_op ops[6];
    memset(ops, 0, sizeof ops);
    ops[0].op = GRPC_OP_SEND_INITIAL_METADATA;
    if (ch->secret) {
        secret_md(ch, &md);
        ops[0].data.send_initial_metadata.count = 1;
        ops[0].data.send_initial_metadata.metadata = &md;
    }
    ops[1].op = GRPC_OP_SEND_MESSAGE;
    ops[1].data.send_message.send_message = req;
    ops[2].op = GRPC_OP_SEND_CLOSE_FROM_CLIENT;
    ops[3].op = GRPC_OP_RECV_INITIAL_METADATA;
    ops[3].data.recv_initial_metadata.recv_initial_metadata = &initial;
    ops[4].op = GRPC_OP_RECV_MESSAGE;
    ops[4].data.recv_message.recv_message = &rbb;
    ops[5].op = GRPC_OP_RECV_STATUS_ON_CLIENT;
    ops[5].data.recv_status_on_client.trailing_metadata = &trailing;
    ops[5].data.recv_status_on_client.status = &status;
    ops[5].data.recv_status_on_client.status_details = &details;
    int rc;
    if (grpc_call_start_batch(call, ops, 6, (void *)1, NULL) != GRPC_CALL_OK) {
        rc = rpc_status_setf(st, RPC_INTERNAL, "rpc: cannot start a call to %s", method);
    } else {
        grpc_completion_queue_next(cq, gpr_inf_future(GPR_CLOCK_MONOTONIC), NULL);
        if (status != GRPC_STATUS_OK) {
            rc = rpc__client_status(st, (int)status, details, ch->tls);
        } else if (!rbb) {
            rc = rpc_status_setf(st, RPC_INTERNAL, "%s: the server sent no reply", method);
        } else {
            rc = rpc__unpack(reply_desc, rbb, ch->max_msg, reply, st);
        }
    }
    grpc_call_unref(call);
    rpc__cq_destroy(cq);
    grpc_byte_buffer_destroy(req);
    grpc_byte_buffer_destroy(rbb);
    grpc_slice_unref(details);
    grpc_metadata_array_destroy(&initial);
    grpc_metadata_array_destroy(&trailing);
    return rc;
}

int rpc_call_unary(rpc_channel *ch, const char *method, const ProtobufCMessage *req,
                   const ProtobufCMessageDescriptor *reply_desc, ProtobufCMessage **reply,
                   int timeout_ms, rpc_status *st) {
    *reply = NULL;
    grpc_byte_buffer *bb;
    int rc = rpc__pack(req, ch->max_msg, &bb, st);
    if (rc != RPC_OK) return rc;
    return call_unary_bb(ch, method, bb, reply_desc, reply, timeout_ms, st);
}

int rpc_call_unary_raw(rpc_channel *ch, const char *method, const void *data, size_t len,
                       const ProtobufCMessageDescriptor *reply_desc, ProtobufCMessage **reply,
                       int timeout_ms, rpc_status *st) {
    *reply = NULL;
    if (len > ch->max_msg)
        return rpc_status_setf(st, RPC_RESOURCE_EXHAUSTED,
                               "message of %zu bytes exceeds the bound of %zu", len, ch->max_msg);
    return call_unary_bb(ch, method, rpc__bytes(data, len), reply_desc, reply, timeout_ms, st);
}

int rpc_stream_open(rpc_channel *ch, const char *method, int timeout_ms, rpc_stream **out,
                    rpc_status *st) {
    *out = NULL;
    rpc_stream *s = calloc(1, sizeof *s);
    if (!s) return rpc_status_setf(st, RPC_RESOURCE_EXHAUSTED, "rpc: out of memory");
    s->max_msg = ch->max_msg;
    s->tls = ch->tls;
    s->details = grpc_empty_slice();
    s->status = GRPC_STATUS_UNKNOWN;
    grpc_metadata_array_init(&s->initial_md);
    grpc_metadata_array_init(&s->trailing_md);
    s->cq = grpc_completion_queue_create_for_next(NULL);
    s->call = channel_call(ch, method, s->cq, timeout_ms);
    if (!s->call) {
        rpc__stream_destroy(s);
        return rpc_status_setf(st, RPC_INTERNAL, "rpc: cannot create a call to %s", method);
    }
    grpc_op ops[2];
    memset(ops, 0, sizeof ops);
    ops[0].op = GRPC_OP_SEND_INITIAL_METADATA;
    if (ch->secret) {
        secret_md(ch, &s->secret_md);
        ops[0].data.send_initial_metadata.count = 1;
        ops[0].data.send_initial_metadata.metadata = &s->secret_md;
    }
    int rc = start_batch(s, ops, 1, RPC_TAG_MISC, st);
    if (rc == RPC_OK) {
        s->misc_pending = true;
        memset(ops, 0, sizeof ops);
        ops[0].op = GRPC_OP_RECV_INITIAL_METADATA;
        ops[0].data.recv_initial_metadata.recv_initial_metadata = &s->initial_md;
        ops[1].op = GRPC_OP_RECV_STATUS_ON_CLIENT;
        ops[1].data.recv_status_on_client.trailing_metadata = &s->trailing_md;
        ops[1].data.recv_status_on_client.status = &s->status;
        ops[1].data.recv_status_on_client.status_details = &s->details;
        rc = start_batch(s, ops, 2, RPC_TAG_END, st);
        if (rc == RPC_OK) s->end_pending = true;
    }
    if (rc != RPC_OK) {
        grpc_call_cancel(s->call, NULL);
        rpc__stream_destroy(s);
        return rc;
    }
    *out = s;
    return rpc_status_setf(st, RPC_OK, "%s", "");
}

int rpc_stream_close_send(rpc_stream *s, rpc_status *st) {
    if (s->server) return rpc_status_setf(st, RPC_INTERNAL, "close_send on a server stream");
    if (s->send_closed) return rpc_status_setf(st, RPC_OK, "%s", "");
    while (s->send_pending || s->misc_pending)
        rpc__stream_pump(s, gpr_inf_future(GPR_CLOCK_MONOTONIC));
    s->send_closed = true;
    if (s->done) return rpc_status_setf(st, RPC_OK, "%s", "");
    grpc_op op;
    memset(&op, 0, sizeof op);
    op.op = GRPC_OP_SEND_CLOSE_FROM_CLIENT;
    int rc = start_batch(s, &op, 1, RPC_TAG_MISC, st);
    if (rc != RPC_OK) return rc;
    s->misc_pending = true;
    return rpc_status_setf(st, RPC_OK, "%s", "");
}

int rpc_stream_finish(rpc_stream *s, rpc_status *st) {
    if (s->server) return rpc_status_setf(st, RPC_INTERNAL, "finish on a server stream");
    int rc = rpc_stream_close_send(s, st);
    if (rc != RPC_OK) return rc;
    while (s->end_pending) {
        /* Discard unread replies: an unread message can hold the status back. */
        if (!s->recv_pending && !s->recv_ready && !s->eos) {
            grpc_op op;
            memset(&op, 0, sizeof op);
            op.op = GRPC_OP_RECV_MESSAGE;
            op.data.recv_message.recv_message = &s->recv_bb;
            if (start_batch(s, &op, 1, RPC_TAG_RECV, NULL) == RPC_OK) s->recv_pending = true;
        }
        rpc__stream_pump(s, gpr_inf_future(GPR_CLOCK_MONOTONIC));
        if (s->recv_ready) {
            s->recv_ready = false;
            if (!s->recv_ok || !s->recv_bb) s->eos = true;
            grpc_byte_buffer_destroy(s->recv_bb);
            s->recv_bb = NULL;
        }
    }
    if (s->status == GRPC_STATUS_OK) return rpc_status_setf(st, RPC_OK, "%s", "");
    return rpc__client_status(st, (int)s->status, s->details, s->tls);
}

void rpc_stream_cancel(rpc_stream *s) {
    if (s && !s->server && s->call && !s->done) grpc_call_cancel(s->call, NULL);
}

void rpc_stream_free(rpc_stream *s) {
    if (!s) return;
    if (s->server) {
        FU_ERROR("rpc_stream_free on a server stream: ignored (the server owns it)");
        return;
    }
    rpc_stream_cancel(s);
    rpc__stream_destroy(s);
}
