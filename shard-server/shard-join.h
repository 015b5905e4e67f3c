/* shard-join.h -- a shard's membership in a gateway's swarm: Join, heartbeats, span assignments, peer links.
 *
 * A background thread registers with the gateway's fusion.Swarm service, then
 * heartbeats every interval the gateway asks for with the shard's current
 * figures. A span assignment (in the Join reply or a heartbeat reply) is
 * passed to the `load` callback on a thread of its own, while the heartbeats
 * go on (reporting the span served until then: a load may take longer than
 * the gateway waits for a heartbeat); once it returns the next heartbeat
 * (sent at once) reports the span as served, or the failure and its message
 * (the gateway then withdraws the assignment). `status` may be called while
 * `load` runs. An assignment differing from the span served is a move: the
 * new span loads beside the old one. A heartbeat the gateway refuses with
 * NOT_FOUND (it retired the shard or restarted) makes it join
 * again; an unreachable gateway is retried every interval. The thread also
 * measures the links to the peers the gateway names (Echo round trip and a
 * 256 KiB reply) and reports them. The calls are net/'s typed Swarm and Shard
 * services (swarm-svc.h, shard-svc.h).
 *
 * Threads: one membership thread per shard_join, plus a loader thread while a
 * span loads; `load` and `status` are called from those. Ownership: the
 * configuration and its strings are borrowed until shard_join_stop.
 */
#ifndef FU_SHARD_JOIN_H
#define FU_SHARD_JOIN_H

#include <stdbool.h>
#include <stdint.h>

#include "swarm-svc.h"

/* A shard's figures as reported to the gateway (filled by the `status` callback). */
typedef struct shard_join_status {
    int first, last;          /* served span; equal: none (spare) */
    char dtype[16];
    double tokens_per_s;      /* of the served span; 0: none */
    int64_t free_kv_bytes, total_kv_bytes, kv_bytes_per_position;
    int active_sessions;
    int draining_first, draining_last; /* a span given up after a move, still serving; equal: none */
    int draining_sessions;
} shard_join_status;

typedef struct shard_join_config {
    const char *gateway;      /* "host:port" of the gateway's --swarm-listen */
    const char *tls_ca;       /* CA of the gateway and peers; NULL: system roots */
    bool insecure;            /* plaintext, loopback only */
    const char *secret;       /* swarm secret */
    const char *address;      /* "host:port" this shard serves at */
    const char *model_name;
    int n_layers;
    const char *device;
    double block_tokens_per_s; /* measured throughput holding one block */
    int max_blocks;           /* most blocks it will load (0: all) */
    bool fixed_span;          /* started with its own span: never reassigned */
    int hidden_size;          /* the model's (reported; 0: unknown) */
    /* Loads [first, last) and starts serving it -- beside the span it serves, if any (a move:
     * that one then drains); FU_OK or a status (reported to the gateway in the next heartbeat). */
    int (*load)(void *ctx, int first, int last);
    /* Fills the current figures (thread-safe). */
    void (*status)(void *ctx, shard_join_status *st);
    void *ctx;
    const char *tls_client_cert; /* shown to the gateway and peers that require one (mTLS); NULL: none */
    const char *tls_client_key;  /* its key */
    /* Called once (from the membership thread) when the gateway refuses the swarm secret, which
     * retrying cannot mend; `why` says what to do. NULL: keep retrying. */
    void (*refused)(void *ctx, const char *why);
    /* One block's measured step times (swarm-svc.h; n 0: not measured), borrowed like the strings. */
    swarm_svc_steps prompt_steps, decode_steps;
} shard_join_config;

typedef struct shard_join shard_join;

/* Starts the membership thread (cfg and its strings are borrowed until shard_join_stop). */
int shard_join_start(const shard_join_config *cfg, shard_join **out);
/* Sends a last heartbeat saying the shard leaves (best effort), stops the thread and frees.
 * NULL is a no-op. */
void shard_join_stop(shard_join *j);

#endif
