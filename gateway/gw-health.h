/* gw-health.h -- readiness and the shards' figures: whether a full chain can serve now, and why not.
 *
 * A routed swarm already knows its members (gw-swarm.h polls or hears from
 * them): readiness is every block covered by a live member. A static chain
 * (cfg->hops) is probed here: a thread calls Info on every hop each
 * GW_HEALTH_INTERVAL_MS with the swarm secret, so a hop that is down, or that
 * refuses the secret, makes the gateway not ready within about a second --
 * and ready again once it answers. Both give the same document: each server's
 * address, span, state, KV bytes free and total, sessions and tokens/s. The
 * reason for not being ready names blocks and the kind of failure, never an
 * address (it is shown to clients).
 *
 * Threading: the probe thread writes the static chain's figures under the
 * module's mutex; every gw_health_* call is thread-safe and answers at once
 * (no call waits on a shard). Ownership: the config and swarm are borrowed
 * and must outlive the module; documents are new references for the caller.
 */
#ifndef FU_GW_HEALTH_H
#define FU_GW_HEALTH_H

#include <jansson.h>
#include <stdbool.h>
#include <stddef.h>

#include "buf.h"
#include "gw.h"

struct gw_swarm;
typedef struct gw_health gw_health;

#define GW_HEALTH_INTERVAL_MS 1000

/* Starts watching: the static chain cfg->hops (probe thread; the first round is done before it
 * returns) or, with swarm non-NULL, the swarm's view. FU_OK, FU_ERR_NOMEM, FU_ERR_INTERNAL. */
int gw_health_new(const gw_config *cfg, struct gw_swarm *swarm, gw_health **out);
/* Stops the probe thread and frees. NULL is a no-op. */
void gw_health_free(gw_health *h);

/* Whether a full chain can serve now; when not, why into reason[cap] (no addresses). */
bool gw_health_ready(gw_health *h, char *reason, size_t cap);

/* The servers: [{address, first, last, state ("serving", "unreachable", "unauthorized",
 * or the swarm's member state), free_kv_bytes, total_kv_bytes, sessions, tokens_per_s}]
 * (new reference; NULL when out of memory). */
json_t *gw_health_servers(gw_health *h);

/* Appends the Prometheus gauges of readiness and of every server (up, KV bytes free and total,
 * sessions, tokens/s; labels shard=ADDRESS, first, last, state) to out. FU_OK or FU_ERR_NOMEM. */
int gw_health_render(gw_health *h, fu_buf *out);

#endif
