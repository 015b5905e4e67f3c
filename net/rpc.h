/* rpc.h -- the RPC layer: gRPC (C core) calls carrying protobuf-c messages, behind one small API.
 *
 * Servers register handlers per method path ("/fusion.Shard/Info"); clients
 * call methods on a channel. Messages are protobuf-c messages (generated from
 * net/proto/fusion.proto: "fusion.pb-c.h"); this layer packs and unpacks them, so
 * callers never see completion queues, byte buffers or wire bytes.
 *
 * Two kinds of methods:
 *   - unary:  one request, one reply. Server handlers run on the server's
 *             worker threads (several at once: handlers must be thread-safe).
 *   - stream: bidirectional. Each incoming stream gets its own thread running
 *             the handler, which loops rpc_stream_recv / rpc_stream_send and
 *             returns the final status. A client opens one with
 *             rpc_stream_open and uses the same send/recv.
 *
 * Security: every call carries the swarm secret (metadata "x-fusion-secret");
 * the server compares it in constant time and refuses a call without the
 * right one (UNAUTHENTICATED) before any handler runs. Transport is TLS
 * (gRPC SSL credentials); plaintext only when explicitly allowed and the
 * address is loopback (127.0.0.0/8, ::1, localhost, unix:).
 *
 * Return values: set-up functions (rpc_server_*, rpc_channel_new) return a
 * fu_status (FU_OK or FU_ERR_*, details in fu_last_error()). Call and stream
 * functions return an rpc_code (RPC_OK = 0 or a gRPC status code) and fill
 * an rpc_status (may be NULL) with the code and a message.
 *
 * Threads: a server, a channel and their functions are thread-safe; one
 * rpc_stream is used by one thread at a time (its handler thread on the
 * server; whichever thread the client likes, but not two at once).
 *
 * Latency: a stream is one HTTP/2 stream; send and recv cost one message each
 * way and never create threads or sleep. Keep channels and streams open:
 * opening a channel costs a TCP (and TLS) handshake on first use. Measured on
 * loopback (bench/rpc.c): ~30 us per stream step, ~50 us per small unary
 * call; TLS adds ~20 us.
 *
 * Flow control: send returns once its message is queued, so a client may
 * pipeline a few messages, but one that keeps sending without reading the
 * replies stalls (the server blocks sending, then stops reading). Read each
 * reply, or keep at most a few steps in flight.
 */
#ifndef FU_RPC_H
#define FU_RPC_H

#include <stdbool.h>
#include <stddef.h>

#include <protobuf-c/protobuf-c.h>

/* Method paths of service fusion.Shard (net/proto/fusion.proto). */
#define RPC_SHARD_SESSION "/fusion.Shard/Session" /* stream SessionRequest -> stream SessionReply */
#define RPC_SHARD_FORWARD "/fusion.Shard/Forward" /* ForwardRequest -> ForwardReply */
#define RPC_SHARD_INFO "/fusion.Shard/Info"       /* InfoRequest -> InfoReply */
#define RPC_SHARD_HEALTH "/fusion.Shard/Health"   /* HealthRequest -> HealthReply */
#define RPC_SHARD_ECHO "/fusion.Shard/Echo"       /* EchoRequest -> EchoReply */

/* Method paths of service fusion.Swarm (hosted by the gateway). */
#define RPC_SWARM_JOIN "/fusion.Swarm/Join"           /* JoinRequest -> JoinReply */
#define RPC_SWARM_HEARTBEAT "/fusion.Swarm/Heartbeat" /* HeartbeatRequest -> HeartbeatReply */

/* Metadata key that carries the swarm secret. */
#define RPC_SECRET_KEY "x-fusion-secret"

/* Default bound on one message, each direction, when an option says 0. */
#define RPC_DEFAULT_MAX_MESSAGE (64u << 20)

/* ---- status ---------------------------------------------------------------- */

/* X(name, value, description): gRPC's status codes, same values, plus
 * RPC_END_OF_STREAM, which never goes on the wire. */
#define RPC_CODE_LIST(X)                                              \
    X(RPC_OK, 0, "ok")                                                \
    X(RPC_CANCELLED, 1, "cancelled")                                  \
    X(RPC_UNKNOWN, 2, "unknown")                                      \
    X(RPC_INVALID_ARGUMENT, 3, "invalid argument")                    \
    X(RPC_DEADLINE_EXCEEDED, 4, "deadline exceeded")                  \
    X(RPC_NOT_FOUND, 5, "not found")                                  \
    X(RPC_ALREADY_EXISTS, 6, "already exists")                        \
    X(RPC_PERMISSION_DENIED, 7, "permission denied")                  \
    X(RPC_RESOURCE_EXHAUSTED, 8, "resource exhausted")                \
    X(RPC_FAILED_PRECONDITION, 9, "failed precondition")              \
    X(RPC_ABORTED, 10, "aborted")                                     \
    X(RPC_OUT_OF_RANGE, 11, "out of range")                           \
    X(RPC_UNIMPLEMENTED, 12, "unimplemented")                         \
    X(RPC_INTERNAL, 13, "internal")                                   \
    X(RPC_UNAVAILABLE, 14, "unavailable")                             \
    X(RPC_DATA_LOSS, 15, "data loss")                                 \
    X(RPC_UNAUTHENTICATED, 16, "unauthenticated")                     \
    X(RPC_END_OF_STREAM, 100, "end of stream")

typedef enum rpc_code {
#define RPC_CODE_ENUM_(name, value, desc) name = value,
    RPC_CODE_LIST(RPC_CODE_ENUM_)
#undef RPC_CODE_ENUM_
} rpc_code;

typedef struct rpc_status {
    rpc_code code;
    char message[256]; /* NUL-terminated; "" when the code says it all */
} rpc_status;

/* Static description of a code ("unauthenticated"); never NULL. */
const char *rpc_code_str(int code);

/* Sets *st (if st is not NULL) to code and a formatted message; returns code,
 * so a handler can `return rpc_status_setf(st, RPC_INVALID_ARGUMENT, ...)`. */
int rpc_status_setf(rpc_status *st, int code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* The gRPC code for a project status (FU_ERR_INVALID -> INVALID_ARGUMENT,
 * FU_ERR_EXHAUSTED / FU_ERR_NOMEM -> RESOURCE_EXHAUSTED, FU_ERR_AUTH ->
 * UNAUTHENTICATED, FU_ERR_NETWORK -> UNAVAILABLE, ...; unknown -> UNKNOWN). */
rpc_code rpc_code_from_fu(int fu_status);

/* The project status for a gRPC code (the inverse, as near as it goes;
 * RPC_OK -> FU_OK, RPC_END_OF_STREAM -> FU_ERR_NOT_FOUND). */
int rpc_code_to_fu(int code);

/* Sets *st from a project status: the mapped code and fu_last_error() (or the
 * status string when that is empty); returns the code. */
int rpc_status_from_fu(rpc_status *st, int fu_status);

/* True if `address` ("host:port", "[v6]:port", "unix:path") names this
 * machine only: 127.0.0.0/8, ::1, localhost, or a unix socket. */
bool rpc_address_is_loopback(const char *address);

/* ---- messages -------------------------------------------------------------- */

/* Frees a message returned by this layer (rpc_call_unary, rpc_stream_recv,
 * rpc_msg_unpack). NULL is a no-op. */
void rpc_msg_free(ProtobufCMessage *msg);

/* Unpacks wire bytes into a new message of type `desc` (for fuzzing and
 * tests of the decoding path). Malformed input or len > max_bytes ->
 * RPC_INVALID_ARGUMENT / RPC_RESOURCE_EXHAUSTED, *out = NULL. The caller frees
 * *out with rpc_msg_free. */
int rpc_msg_unpack(const ProtobufCMessageDescriptor *desc, const void *data, size_t len,
                   size_t max_bytes, ProtobufCMessage **out, rpc_status *st);

/* ---- server ---------------------------------------------------------------- */

typedef struct rpc_server rpc_server;
typedef struct rpc_stream rpc_stream;

typedef struct rpc_server_options {
    const char *address;      /* "host:port"; port 0 picks a free port (rpc_server_port) */
    const char *tls_cert;     /* PEM certificate chain: the PEM text itself, or a file path */
    const char *tls_key;      /* PEM private key: the PEM text itself, or a file path */
    bool allow_insecure;      /* plaintext when no tls_cert: refused unless address is loopback */
    const char *secret;       /* swarm secret (required): 1..1024 printable ASCII, copied */
    size_t max_message_bytes; /* bound on one message each way; 0: RPC_DEFAULT_MAX_MESSAGE */
    int n_workers;            /* threads that accept calls and run unary handlers; 0: 2.
                                 A long unary handler holds one: size for the slowest
                                 (Forward) plus one for Info/Health */
} rpc_server_options;

/* Unary handler: `req` is the unpacked request (owned by the layer, valid
 * during the call only). On success set *reply to a heap message and return
 * RPC_OK; the layer packs it, then frees it with the method's free function
 * (rpc_msg_free-compatible by default). On failure return a code (leave
 * *reply NULL, or it is freed too) and put the reason in st->message, e.g.
 * `return rpc_status_setf(st, RPC_NOT_FOUND, "no session %s", id);`. */
typedef int (*rpc_unary_fn)(void *ctx, const ProtobufCMessage *req, ProtobufCMessage **reply,
                            rpc_status *st);
/* Frees a unary handler's reply after it was sent. */
typedef void (*rpc_reply_free_fn)(void *ctx, ProtobufCMessage *reply);

/* Stream handler, on its own thread: receive with rpc_stream_recv(s, NULL,
 * ...) (NULL: the method's request type), send with rpc_stream_send, and
 * return the final code (message in st), which ends the call. recv reports a
 * client that half-closed (RPC_END_OF_STREAM) or cancelled / dropped
 * (RPC_CANCELLED) as soon as it happens; so do send and rpc_stream_cancelled. */
typedef int (*rpc_stream_fn)(void *ctx, rpc_stream *s, rpc_status *st);

/* Creates a server listening on o->address (bound now, so rpc_server_port
 * works at once) with TLS from o->tls_cert/tls_key, or plaintext if
 * o->allow_insecure and the address is loopback. Free with rpc_server_free. */
int rpc_server_new(const rpc_server_options *o, rpc_server **out);

/* Registers handlers; before rpc_server_start only. `method` is a full path
 * ("/fusion.Shard/Info", copied); `req_desc` the request type (borrowed:
 * generated descriptors are static). free_reply NULL: rpc_msg_free. */
int rpc_server_add_unary(rpc_server *srv, const char *method,
                         const ProtobufCMessageDescriptor *req_desc, rpc_unary_fn fn,
                         rpc_reply_free_fn free_reply, void *ctx);
int rpc_server_add_stream(rpc_server *srv, const char *method,
                          const ProtobufCMessageDescriptor *req_desc, rpc_stream_fn fn,
                          void *ctx);

/* Starts serving (methods not registered get UNIMPLEMENTED). */
int rpc_server_start(rpc_server *srv);

/* The bound TCP port (0 for a unix socket). */
int rpc_server_port(const rpc_server *srv);

/* Stops accepting calls, lets calls in flight finish for up to grace_ms, then
 * cancels the rest (their handlers see RPC_CANCELLED) and waits for every
 * handler to return. Idempotent. Handlers must return once cancelled; never
 * call it from a handler (it would wait for itself). */
int rpc_server_shutdown(rpc_server *srv, int grace_ms);

/* Shuts down (grace 0) if not yet, and frees. NULL is a no-op. */
void rpc_server_free(rpc_server *srv);

/* ---- client ---------------------------------------------------------------- */

typedef struct rpc_channel rpc_channel;

typedef struct rpc_channel_options {
    const char *tls_ca;          /* PEM CA certificate(s) to verify the server: text or a file
                                    path; NULL: gRPC's default roots */
    bool insecure;               /* plaintext: refused unless the target is loopback */
    const char *secret;          /* sent on every call; NULL: none (the server will refuse) */
    size_t max_message_bytes;    /* 0: RPC_DEFAULT_MAX_MESSAGE */
    const char *tls_server_name; /* name to verify in the server certificate instead of the
                                    target's host (tests, IP targets); NULL: the host */
} rpc_channel_options;

/* Creates a channel to `target` ("host:port"). It connects lazily, on the
 * first call, and reconnects as needed. Free with rpc_channel_free after all
 * its calls and streams are done. */
int rpc_channel_new(const char *target, const rpc_channel_options *o, rpc_channel **out);
void rpc_channel_free(rpc_channel *ch); /* NULL is a no-op */

/* Calls a unary method: sends req, waits up to timeout_ms (<= 0: no
 * deadline) and on RPC_OK sets *reply to a new message of type reply_desc
 * (free with rpc_msg_free). On error *reply is NULL and st says why:
 * RPC_UNAVAILABLE (cannot connect, TLS failure), RPC_UNAUTHENTICATED,
 * RPC_DEADLINE_EXCEEDED, RPC_RESOURCE_EXHAUSTED (message over a bound), the
 * handler's code, ... */
int rpc_call_unary(rpc_channel *ch, const char *method, const ProtobufCMessage *req,
                   const ProtobufCMessageDescriptor *reply_desc, ProtobufCMessage **reply,
                   int timeout_ms, rpc_status *st);

/* The same with the request as raw wire bytes (tests and fuzzing of servers). */
int rpc_call_unary_raw(rpc_channel *ch, const char *method, const void *data, size_t len,
                       const ProtobufCMessageDescriptor *reply_desc, ProtobufCMessage **reply,
                       int timeout_ms, rpc_status *st);

/* Opens a bidirectional stream; timeout_ms bounds the whole stream (<= 0:
 * none). Returns at once (the connection is made on first use; a failure
 * shows at the first send/recv). Free with rpc_stream_free. */
int rpc_stream_open(rpc_channel *ch, const char *method, int timeout_ms, rpc_stream **out,
                    rpc_status *st);

/* ---- streams (both sides) -------------------------------------------------- */

/* Sends one message. Returns once the previous message has left and this one
 * is queued (the message is packed at once: the caller may free it on
 * return). Errors: RPC_RESOURCE_EXHAUSTED (over the bound; the stream stays
 * usable), RPC_CANCELLED (server: the client went away), the call's final
 * status (client: the server ended the call; RPC_END_OF_STREAM if with OK). */
int rpc_stream_send(rpc_stream *s, const ProtobufCMessage *msg, rpc_status *st);

/* The same with raw wire bytes (tests and fuzzing). */
int rpc_stream_send_raw(rpc_stream *s, const void *data, size_t len, rpc_status *st);

/* Receives one message of type desc (server: NULL means the method's request
 * type) into *msg (free with rpc_msg_free), waiting up to timeout_ms (< 0:
 * forever). Returns RPC_OK; RPC_END_OF_STREAM when the peer has no more
 * (client: the server finished with OK; server: the client half-closed);
 * RPC_DEADLINE_EXCEEDED when timeout_ms passed (nothing lost: call again);
 * RPC_INVALID_ARGUMENT for a malformed message (the stream stays usable);
 * server: RPC_CANCELLED when the client cancelled or dropped; client: the
 * server's error status. Once no more messages can come, every later call
 * returns the same outcome. (gRPC ends a cancelled call's receive much like a
 * half-close; the layer tells them apart by waiting up to 2 ms for the call's
 * close, so in a rare race a cancel may read as RPC_END_OF_STREAM: either way
 * the client is gone and the session can be freed.) */
int rpc_stream_recv(rpc_stream *s, const ProtobufCMessageDescriptor *desc,
                    ProtobufCMessage **msg, int timeout_ms, rpc_status *st);

/* Non-blocking: true once the call is over on the peer's side (server: the
 * client cancelled or dropped; client: the server sent its final status). */
bool rpc_stream_cancelled(rpc_stream *s);

/* Client: half-closes (no more sends). Idempotent. */
int rpc_stream_close_send(rpc_stream *s, rpc_status *st);

/* Client: half-closes if not yet, discards unread replies, waits for the
 * server's final status and returns its code (message in st). */
int rpc_stream_finish(rpc_stream *s, rpc_status *st);

/* Client: cancels the call (the server sees RPC_CANCELLED). */
void rpc_stream_cancel(rpc_stream *s);

/* Client: cancels the call if not finished and frees. NULL is a no-op. */
void rpc_stream_free(rpc_stream *s);

#endif
