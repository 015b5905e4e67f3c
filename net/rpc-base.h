/* rpc-base.h -- the RPC layer as components see it: statuses, servers and channels, no wire types.
 *
 * gRPC (C core) carries protobuf-c messages between processes; this header is
 * the part of the layer that knows neither: it creates servers and channels
 * and names outcomes. What runs over them is typed per service --
 * shard-svc.h (fusion.Shard) and swarm-svc.h (fusion.Swarm) -- and only net/
 * (plus tests, tools and benchmarks) uses the message-level API in rpc.h.
 *
 * Security: every call carries the swarm secret (metadata "x-fusion-secret");
 * the server compares it in constant time and refuses a call without the
 * right one (UNAUTHENTICATED) before any handler runs. Transport is TLS
 * (gRPC SSL credentials); plaintext only when explicitly allowed and the
 * address is loopback (127.0.0.0/8, ::1, localhost, unix:). Mutual TLS is
 * optional: a server given a client CA (tls_client_ca) requires every client
 * to present a certificate signed by it, and refuses the handshake of one
 * without (no handler runs, no call is counted); the secret is still
 * checked. A channel presents its certificate (tls_client_cert/key) when
 * the server asks for one.
 *
 * Return values: set-up functions (rpc_server_*, rpc_channel_new) return a
 * fu_status (FU_OK or FU_ERR_*, details in fu_last_error()). Call and stream
 * functions (here and in the service headers) return an rpc_code (RPC_OK = 0
 * or a gRPC status code) and fill an rpc_status (may be NULL) with the code
 * and a message.
 *
 * Threads: a server, a channel and their functions are thread-safe.
 * Ownership: options are read during the call (strings copied where kept);
 * a server or channel is owned by its creator and freed with its _free.
 *
 * Latency: opening a channel costs a TCP (and TLS) handshake on first use:
 * keep channels open. Measured on loopback (bench/rpc.c): ~30 us per stream
 * step, ~50 us per small unary call; TLS adds ~20 us.
 */
#ifndef FU_RPC_BASE_H
#define FU_RPC_BASE_H

#include <stdbool.h>
#include <stddef.h>

/* Metadata key that carries the swarm secret. */
#define RPC_SECRET_KEY "x-fusion-secret"

/* Default bound on one message, each direction, when an option says 0. */
#define RPC_DEFAULT_MAX_MESSAGE (64u << 20)

/* Default bound on a server's concurrent stream calls (each holds a thread), when an option says 0. */
#define RPC_DEFAULT_MAX_STREAMS 256

/* ---- status ---------------------------------------------------------------- */

/* X(name, value, description): gRPC's status codes, same values, plus codes
 * >= 100 that never go on the wire: RPC_END_OF_STREAM, and
 * RPC_UNEXPECTED_REPLY (a peer answered with a message of the wrong kind). */
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
    X(RPC_END_OF_STREAM, 100, "end of stream")                        \
    X(RPC_UNEXPECTED_REPLY, 101, "unexpected reply")

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
 * RPC_OK -> FU_OK, RPC_END_OF_STREAM -> FU_ERR_NOT_FOUND,
 * RPC_UNEXPECTED_REPLY -> FU_ERR_FORMAT). */
int rpc_code_to_fu(int code);

/* Sets *st from a project status: the mapped code and fu_last_error() (or the
 * status string when that is empty); returns the code. */
int rpc_status_from_fu(rpc_status *st, int fu_status);

/* True if `address` ("host:port", "[v6]:port", "unix:path") names this
 * machine only: 127.0.0.0/8, ::1, localhost, or a unix socket. */
bool rpc_address_is_loopback(const char *address);

/* ---- server ---------------------------------------------------------------- */

typedef struct rpc_server rpc_server;

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
    const char *tls_client_ca; /* PEM CA certificate(s), text or a file path: require and verify
                                  a client certificate signed by it (mTLS; needs tls_cert);
                                  NULL: clients are not asked for one */
    int max_streams;          /* stream calls running at once (a thread each); one beyond is
                                 refused with RESOURCE_EXHAUSTED naming the cap, before any
                                 thread starts; 0: RPC_DEFAULT_MAX_STREAMS */
} rpc_server_options;

/* Creates a server listening on o->address (bound now, so rpc_server_port
 * works at once) with TLS from o->tls_cert/tls_key (requiring client
 * certificates when o->tls_client_ca is set), or plaintext if
 * o->allow_insecure and the address is loopback. FU_ERR_INVALID for a client
 * CA without TLS; FU_ERR_IO for a PEM file that is absent, unreadable, over
 * 1 MiB or not a regular file (a FIFO is refused, never waited on);
 * FU_ERR_FORMAT for one that is not PEM. Services are added with
 * shard_svc_serve / swarm_svc_serve (or rpc.h's rpc_server_add_*) before
 * rpc_server_start. Free with rpc_server_free. */
int rpc_server_new(const rpc_server_options *o, rpc_server **out);

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
    const char *tls_client_cert; /* PEM certificate chain (text or a file path) presented when
                                    the server asks for one (mTLS); NULL: none */
    const char *tls_client_key;  /* its private key; given with tls_client_cert or not at all */
} rpc_channel_options;

/* Creates a channel to `target` ("host:port"). It connects lazily, on the
 * first call, and reconnects as needed. PEM values are read now (errors as
 * rpc_server_new's; a client key that is not the client certificate's:
 * FU_ERR_INVALID); the client pair is ignored with o->insecure, like tls_ca.
 * A server that requires a certificate this channel lacks (or whose CA did
 * not sign it) fails the calls with RPC_UNAVAILABLE. Free with rpc_channel_free after all
 * its calls and streams are done. */
int rpc_channel_new(const char *target, const rpc_channel_options *o, rpc_channel **out);

/* Frees a channel; its calls and streams must be over. NULL is a no-op. */
void rpc_channel_free(rpc_channel *ch);

#endif
