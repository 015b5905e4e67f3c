/* rpc-impl.h -- RPC layer internals shared by rpc.c (messages, streams, client) and rpc-server.c.
 *
 * Not for use outside net/. Threads: an rpc_stream and its completion queue
 * are driven by the one thread using the stream; the helpers are stateless.
 * Ownership: functions returning byte buffers, messages or strings hand them
 * to the caller (each says how to free them).
 */
#ifndef FU_RPC_IMPL_H
#define FU_RPC_IMPL_H

#include <stdint.h>

#include <grpc/byte_buffer.h>
#include <grpc/grpc.h>

#include "rpc.h"

/* Tags on a stream's own completion queue: one outstanding batch of each. */
enum {
    RPC_TAG_SEND = 1, /* SEND_MESSAGE (server: with SEND_INITIAL_METADATA the first time) */
    RPC_TAG_RECV = 2, /* RECV_MESSAGE */
    RPC_TAG_END = 3,  /* client: RECV_INITIAL_METADATA + RECV_STATUS_ON_CLIENT;
                         server: RECV_CLOSE_ON_SERVER. Completes when the call is over. */
    RPC_TAG_MISC = 4, /* client: SEND_INITIAL_METADATA, then SEND_CLOSE_FROM_CLIENT;
                         server: the final SEND_STATUS_FROM_SERVER */
};

struct rpc_server;

/* One call's stream state. The call is bound to `cq`, which only the thread
 * using the stream drives (rpc__stream_pump), so no locks are needed. */
struct rpc_stream {
    grpc_call *call;
    grpc_completion_queue *cq;
    bool server;
    size_t max_msg;                             /* bound on one message, each way */
    const ProtobufCMessageDescriptor *req_desc; /* server: the method's request type */

    /* batches in flight */
    bool send_pending, recv_pending, end_pending, misc_pending;
    bool send_failed; /* a SEND_MESSAGE completed with failure: the call is over */
    bool recv_ready;  /* RECV_MESSAGE completed, not consumed yet */
    bool recv_ok;
    bool eos;         /* no more messages will come (a NULL message was received) */
    bool eos_cancelled; /* server: ...because the client cancelled or went away */
    bool done;        /* the END batch completed: the call is over */
    grpc_byte_buffer *send_bb;
    grpc_byte_buffer *recv_bb;

    /* client */
    bool send_closed;
    grpc_metadata secret_md;
    grpc_metadata_array initial_md, trailing_md;
    grpc_status_code status;
    grpc_slice details;
    int tls;             /* the channel's RPC_CHANNEL_* (for rpc__client_status) */

    /* server */
    int cancelled;       /* from RECV_CLOSE_ON_SERVER */
    bool md_sent;        /* initial metadata sent */
    struct rpc_server *srv;
    const void *method;  /* rpc-server.c's method record */
};

/* gRPC library reference counting (grpc_init / grpc_shutdown). */
void rpc__grpc_ref(void);
void rpc__grpc_unref(void);

/* Absolute deadline timeout_ms from now; timeout_ms < 0: never. */
gpr_timespec rpc__deadline(int timeout_ms);

/* Packs msg into a new byte buffer (*out); RPC_RESOURCE_EXHAUSTED if over
 * max_bytes, RPC_INVALID_ARGUMENT if msg is not a message. */
int rpc__pack(const ProtobufCMessage *msg, size_t max_bytes, grpc_byte_buffer **out,
              rpc_status *st);

/* A new byte buffer holding a copy of data[0..len). */
grpc_byte_buffer *rpc__bytes(const void *data, size_t len);

/* Unpacks a received buffer (not consumed) into a new message. */
int rpc__unpack(const ProtobufCMessageDescriptor *desc, grpc_byte_buffer *bb, size_t max_bytes,
                ProtobufCMessage **out, rpc_status *st);

/* Copies a slice into st->message (truncating). */
void rpc__status_from_slice(rpc_status *st, int code, grpc_slice msg);

/* What a client channel is: plaintext, TLS, TLS presenting a client certificate. */
enum { RPC_CHANNEL_PLAIN = 0, RPC_CHANNEL_TLS = 1, RPC_CHANNEL_TLS_CERT = 2 };

/* A client call's final status into st, as rpc__status_from_slice; on a `tls` channel
 * (RPC_CHANNEL_*), a connection the server closed while it was set up -- what a server
 * requiring client certificates does to a client without an acceptable one -- is reported
 * as such, with the likely cause. Returns code. */
int rpc__client_status(rpc_status *st, int code, grpc_slice details, int tls);

/* Waits for one event on the stream's queue until deadline and records it;
 * false on timeout. */
bool rpc__stream_pump(rpc_stream *s, gpr_timespec deadline);

/* Waits for every batch in flight to complete. */
void rpc__stream_drain(rpc_stream *s);

/* Drains (the call must be over or cancelled), releases the call and the
 * queue, frees s. */
void rpc__stream_destroy(rpc_stream *s);

/* Shuts a completion queue down, drains it and destroys it. */
void rpc__cq_destroy(grpc_completion_queue *cq);

/* Reads a PEM value that is either the PEM text itself or a path to a
 * regular file holding it (read with mf_read: a FIFO or device is refused,
 * never waited on); *out is a new NUL-terminated string (free()). */
int rpc__load_pem(const char *what, const char *value, char **out);

/* PEM texts for TLS credentials (each malloc'd or NULL): a server's own pair and the CA
 * of its clients, or a channel's client pair and the CA of its servers. */
typedef struct rpc_pems {
    char *cert, *key, *ca;
} rpc_pems;

/* Wipes the key, frees the texts and zeroes *p. */
void rpc__pems_free(rpc_pems *p);

/* Checks that `cert` (PEM text) starts with a certificate and `key` (PEM text) is an
 * unencrypted private key that belongs to it: FU_OK, else FU_ERR_FORMAT / FU_ERR_INVALID
 * with a message naming `what` ("client", "server"). */
int rpc__check_pem_pair(const char *what, const char *cert, const char *key);

/* Checks a swarm secret: 1..1024 printable ASCII (legal in metadata). */
int rpc__check_secret(const char *secret);

#endif
