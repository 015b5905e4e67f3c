/* swarm-svc.h -- the fusion.Swarm service in plain C: Join and Heartbeat, client and server.
 *
 * Role: the one place that knows fusion.Swarm's messages (net/proto/fusion.proto):
 * a shard joins the gateway's swarm and heartbeats with these calls; the
 * gateway serves them through two typed handlers. Each struct mirrors the
 * proto message of the same name (MemberStatus -> swarm_svc_member, ...) with
 * its field meanings and rules; received values are unchecked beyond what the
 * protobuf decoder guarantees (strings are never NULL), except integer fields:
 * int64 on the wire, one outside the int32 of its struct (a MemberStatus count
 * or block, JoinReply.heartbeat_ms, a span) is refused with INVALID_ARGUMENT
 * naming the field, before any handler runs.
 *
 * Ownership: structs passed in are borrowed and packed during the call. A
 * handler's request views (swarm_svc_member, its links and strings) are valid
 * during the handler call only. Replies are plain values, copied both ways.
 *
 * Threads: the calls are thread-safe; handlers run on the server's worker
 * threads, several at once.
 */
#ifndef FU_SWARM_SVC_H
#define FU_SWARM_SVC_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "rpc-base.h"

/* Bounds of a heartbeat reply's peer list (more, or longer addresses, are left out). */
#define SWARM_SVC_MAX_PEERS 64
#define SWARM_SVC_ADDRESS_LEN 128 /* bytes with the NUL */

/* LinkFigure: a link measured from the reporting server to a peer. */
typedef struct swarm_svc_link {
    const char *address;
    double rtt_s;
    double bandwidth_bytes_per_s; /* 0: not measured */
} swarm_svc_link;

#define SWARM_SVC_MAX_STEPS 16

/* Measured step times of one block: seconds[i] for tokens[i] (a prompt of that many tokens, or
 * that many decode sequences of one token each); n == 0: not measured. */
typedef struct swarm_svc_steps {
    size_t n;
    const double *tokens, *seconds;
} swarm_svc_steps;

/* MemberStatus: what a member reports about itself. */
typedef struct swarm_svc_member {
    const char *address, *model_name;
    int32_t n_layers, first_block, last_block;
    const char *device, *dtype;
    double tokens_per_s, block_tokens_per_s;
    int32_t max_blocks;
    int64_t free_kv_bytes, total_kv_bytes, kv_bytes_per_position;
    int32_t active_sessions;
    bool fixed_span;
    const swarm_svc_link *links; /* (n_links) */
    size_t n_links;
    int32_t failed_first, failed_last;
    const char *load_error;
    int32_t draining_first, draining_last, draining_sessions;
    int32_t hidden_size;
    swarm_svc_steps prompt_steps, decode_steps; /* at most SWARM_SVC_MAX_STEPS each */
} swarm_svc_member;

/* JoinReply. */
typedef struct swarm_svc_join_reply {
    uint64_t member_id;
    int32_t heartbeat_ms;
    bool has_span;                   /* false: wait as a spare */
    int32_t first_block, last_block; /* with has_span */
} swarm_svc_join_reply;

/* HeartbeatRequest. */
typedef struct swarm_svc_heartbeat_request {
    uint64_t member_id;
    const swarm_svc_member *status; /* NULL: absent */
    bool leaving;
} swarm_svc_heartbeat_request;

/* HeartbeatReply. Received peers that are empty or longer than
 * SWARM_SVC_ADDRESS_LEN - 1, and any past SWARM_SVC_MAX_PEERS, are left out. */
typedef struct swarm_svc_heartbeat_reply {
    bool has_span;
    int32_t first_block, last_block; /* with has_span */
    int n_peers;
    char peers[SWARM_SVC_MAX_PEERS][SWARM_SVC_ADDRESS_LEN];
} swarm_svc_heartbeat_reply;

/* ---- client -------------------------------------------------------------------------------- */

/* Calls Join with `status`: RPC_OK with *out filled, else a code (out zeroed). */
int swarm_svc_join(rpc_channel *ch, const swarm_svc_member *status, int timeout_ms, swarm_svc_join_reply *out,
                   rpc_status *st);

/* Calls Heartbeat: RPC_OK with *out filled, else a code (out zeroed); RPC_NOT_FOUND: the
 * gateway does not know the member (join again). */
int swarm_svc_heartbeat(rpc_channel *ch, const swarm_svc_heartbeat_request *req, int timeout_ms,
                        swarm_svc_heartbeat_reply *out, rpc_status *st);

/* ---- server -------------------------------------------------------------------------------- */

/* Handlers of the Swarm service: fill the zeroed *out and return RPC_OK, or a
 * code with the reason in st->message. */
typedef struct swarm_svc_handlers {
    void *ctx; /* passed to every handler */
    /* status: NULL when the request carried none. */
    int (*join)(void *ctx, const swarm_svc_member *status, swarm_svc_join_reply *out, rpc_status *st);
    int (*heartbeat)(void *ctx, const swarm_svc_heartbeat_request *req, swarm_svc_heartbeat_reply *out, rpc_status *st);
} swarm_svc_handlers;

/* Decodes `len` bytes as a HeartbeatRequest (heartbeat) or a JoinRequest and runs it through
 * h's handler as the service would, without a transport; the reply is packed and freed.
 * Returns an rpc_code; never crashes on any input. For fuzzing the message path. */
int swarm_svc_fuzz_one(const swarm_svc_handlers *h, bool heartbeat, const void *data, size_t len);

/* Registers Join and Heartbeat on srv (before rpc_server_start); h is borrowed,
 * with its ctx, until rpc_server_free. FU_OK or a status. */
int swarm_svc_serve(rpc_server *srv, const swarm_svc_handlers *h);

#endif
