/* rpc.h -- the RPC layer: gRPC (C core) calls carrying protobuf-c messages, behind one small API.
 *
 * This is the message level, for net/ itself (the typed services shard-svc.c
 * and swarm-svc.c are built on it) and for tests, tools and benchmarks that
 * speak raw messages. Statuses, servers and channels are declared in
 * rpc-base.h, which components include with the service headers
 * (shard-svc.h, swarm-svc.h) instead of this one: they never see generated
 * types or protobuf-c.
 *
 * Servers register handlers per method path ("/fusion.Shard/Info"); clients
 * call methods on a channel. Messages are protobuf-c messages (generated from
 * net/proto/fusion.proto: "fusion.pb-c.h"); this layer packs and unpacks
 * them, so callers never see completion queues, byte buffers or wire bytes.
 *
 * Two kinds of methods:
 *   - unary:  one request, one reply. Server handlers run on the server's
 *             worker threads (several at once: handlers must be thread-safe).
 *   - stream: bidirectional. Each incoming stream gets its own thread running
 *             the handler, which loops rpc_stream_recv / rpc_stream_send and
 *             returns the final status. A client opens one with
 *             rpc_stream_open and uses the same send/recv.
 *
 * Threads: as rpc-base.h; one rpc_stream is used by one thread at a time (its
 * handler thread on the server; whichever thread the client likes, but not
 * two at once).
 *
 * Ownership: a message returned by this layer (rpc_call_unary, rpc_stream_recv,
 * rpc_msg_unpack) belongs to the caller, who frees it with rpc_msg_free;
 * messages passed in are packed during the call and stay the caller's.
 *
 * Latency: a stream is one HTTP/2 stream; send and recv cost one message each
 * way and never create threads or sleep.
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

#include "rpc-base.h"

/* Method paths of service fusion.Shard (net/proto/fusion.proto). */
#define RPC_SHARD_SESSION "/fusion.Shard/Session" /* stream SessionRequest -> stream SessionReply */
#define RPC_SHARD_FORWARD "/fusion.Shard/Forward" /* ForwardRequest -> ForwardReply */
#define RPC_SHARD_INFO "/fusion.Shard/Info"       /* InfoRequest -> InfoReply */
#define RPC_SHARD_HEALTH "/fusion.Shard/Health"   /* HealthRequest -> HealthReply */
#define RPC_SHARD_ECHO "/fusion.Shard/Echo"       /* EchoRequest -> EchoReply */
#define RPC_SHARD_LOAD_ADAPTER "/fusion.Shard/LoadAdapter"     /* LoadAdapterRequest -> LoadAdapterReply */
#define RPC_SHARD_UNLOAD_ADAPTER "/fusion.Shard/UnloadAdapter" /* UnloadAdapterRequest -> UnloadAdapterReply */

/* Method paths of service fusion.Train (hosted by shard servers). */
#define RPC_TRAIN_OPEN "/fusion.Train/Open"           /* TrainOpen -> TrainOpened */
#define RPC_TRAIN_FORWARD "/fusion.Train/Forward"     /* TrainForward -> TrainForwardReply */
#define RPC_TRAIN_BACKWARD "/fusion.Train/Backward"   /* TrainBackward -> TrainBackwardReply */
#define RPC_TRAIN_NORM "/fusion.Train/Norm"           /* TrainNorm -> TrainNormReply */
#define RPC_TRAIN_STEP "/fusion.Train/Step"           /* TrainStep -> TrainStepReply */
#define RPC_TRAIN_GET_STATE "/fusion.Train/GetState"  /* TrainStateRequest -> AdapterState */
#define RPC_TRAIN_PUT_STATE "/fusion.Train/PutState"  /* TrainPutState -> TrainStepReply */
#define RPC_TRAIN_CLOSE "/fusion.Train/Close"         /* TrainClose -> TrainClosed */

/* Method paths of service fusion.Swarm (hosted by the gateway). */
#define RPC_SWARM_JOIN "/fusion.Swarm/Join"           /* JoinRequest -> JoinReply */
#define RPC_SWARM_HEARTBEAT "/fusion.Swarm/Heartbeat" /* HeartbeatRequest -> HeartbeatReply */

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

typedef struct rpc_stream rpc_stream;

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

/* Registers handlers; before rpc_server_start only. `method` is a full path
 * ("/fusion.Shard/Info", copied); `req_desc` the request type (borrowed:
 * generated descriptors are static); ctx is borrowed until rpc_server_free.
 * free_reply NULL: rpc_msg_free. */
int rpc_server_add_unary(rpc_server *srv, const char *method,
                         const ProtobufCMessageDescriptor *req_desc, rpc_unary_fn fn,
                         rpc_reply_free_fn free_reply, void *ctx);
int rpc_server_add_stream(rpc_server *srv, const char *method,
                          const ProtobufCMessageDescriptor *req_desc, rpc_stream_fn fn,
                          void *ctx);

/* ---- client ---------------------------------------------------------------- */

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
