/* gw-swarm.h -- the gateway's live view of a swarm of shards: Info heartbeats, the router, leases, /v1/swarm.
 *
 * A gw_swarm polls every configured shard address for its Info about once a
 * second. Each reply (span, measured tokens/s, KV memory) updates an rt_swarm;
 * a failed poll, or a failed call reported by a generation, retires the server
 * (GONE) and a later good poll brings it back under a new router id. Every
 * change recomputes the router's max flow. All functions are thread-safe (one
 * mutex guards the swarm and the router, which are not).
 */
#ifndef FU_GW_SWARM_H
#define FU_GW_SWARM_H

#include <jansson.h>
#include <stdint.h>

#include "chain.h"
#include "gw.h"

typedef struct gw_swarm gw_swarm;
struct rt_path;

/* A routed chain held by one generation: hops for chain_session_open. */
typedef struct gw_lease {
    struct rt_path *path;       /* NULL: nothing held */
    int n_hops;
    chain_hop hops[GW_MAX_HOPS]; /* addresses point into addr[] */
    char addr[GW_MAX_HOPS][128];
    int ids[GW_MAX_HOPS];       /* router server ids */
} gw_lease;

/* Starts polling cfg->shards[] (borrowed cfg) for a model of n_layers blocks;
 * the first round of polls is done before it returns. Free with gw_swarm_free. */
int gw_swarm_new(const gw_config *cfg, int n_layers, gw_swarm **out);
/* Stops the heartbeat thread and frees; every lease must be released. NULL is a no-op. */
void gw_swarm_free(gw_swarm *s);

/* Routes a request of request_len tokens (prompt + new tokens) and fills *l.
 * On failure returns the status (FU_ERR_NOT_FOUND: no chain; FU_ERR_EXHAUSTED: no
 * KV room) with *err set to a 503 ("no server covers blocks [a, b)" when a span
 * is uncovered) and *l empty. */
int gw_swarm_route(gw_swarm *s, int request_len, gw_lease *l, gw_error *err);
/* Releases the lease's reservations (an empty lease is a no-op). */
void gw_swarm_release(gw_swarm *s, gw_lease *l);
/* A call over the lease failed with `message` (chain errors name the shard as
 * "shard HOST:PORT: ..."): retires the named hop, or, when none is named, every
 * hop of the lease that does not answer an Info probe. */
void gw_swarm_report_failure(gw_swarm *s, const gw_lease *l, const char *message);
/* The /v1/swarm document (new reference; NULL on allocation failure). */
json_t *gw_swarm_json(gw_swarm *s);

#endif
