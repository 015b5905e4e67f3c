/* gw-swarm.h -- the gateway's live view of a swarm of shards: membership, placement, spares, links, the router, leases.
 *
 * Members come two ways. Static ones (cfg->shards) are polled for their Info
 * about once a second. Joined ones register over the fusion.Swarm service the
 * gateway hosts on cfg->swarm_listen (Join), then heartbeat with their figures;
 * a member silent for cfg->heartbeat_timeout_ms, or one a call from the gateway
 * fails on, is retired (GONE in the router); a joined member then joins again.
 *
 * Placement (joined members without a span of their own; static --shard members
 * and members that joined with a span are never told to load or move) weighs
 * placements by the planner's estimate of decode tokens/s (rt_estimate_decode_tps:
 * max-flow shares, the KV bound on requests in flight, batch cycles from the
 * members' measured step times, link waits) for the workload the gateway serves
 * (moving averages of its requests' prompt and output lengths, 512 / 128 before
 * any), so a span that adds flow but lengthens chains more than it helps loses:
 *   1. while some block is uncovered, a spare (a joining member counts as one)
 *      is told to load the span rt_place_join_throughput picks for it (the one
 *      covering the most uncovered blocks, then the highest estimate); among
 *      several spares the one covering the most uncovered blocks, then raising
 *      the estimate the most, goes first;
 *   2. once every block is covered, up to cfg->spares members wait as spares;
 *   3. a spare beyond that loads its rt_place_join_throughput span if that
 *      raises the estimate by at least cfg->min_gain_percent; otherwise it waits;
 *   4. when a serving member leaves (retired or gone), the spares within the
 *      count are considered too, once: the best one is promoted if its span
 *      raises the estimate by at least min_gain_percent (restores what left);
 *   5. when the swarm is loaded -- a request was refused for want of KV room
 *      (503 "overloaded") in the last 10 s -- one spare is promoted to the span
 *      raising the estimate the most, at most one per 10 s;
 *   6. moves: at most once per cfg->rebalance_interval_ms (a tick, with every
 *      block covered and nothing loading or draining), the serving joined member
 *      that has served its span for that long too and whose move raises the
 *      estimate the most, by at least min_gain_percent, is told to load its new
 *      span beside the old one -- only if the others cover its old span. The old
 *      span stays routed until the member reports the new one; it then serves only
 *      the sessions it had (MemberStatus.draining_*) until they end or the
 *      shard's --drain-ms pass (the rest fail "moved away" and are replayed
 *      elsewhere, without retiring the member), and is freed. So a move never
 *      leaves a block uncovered, and the interval, the settling time and the
 *      threshold keep the swarm from oscillating.
 * Requests are routed by the router's IWRR over the max flow of the placement.
 * Spans being loaded count as covered when deciding, so one gap is given to one
 * spare. A member whose load fails reports it in its next heartbeat: the
 * assignment is withdrawn, the member is not asked for that span again (another
 * spare is), and after 3 failed loads it is not asked at all (state "failed");
 * /v1/swarm shows the error. A request that finds a block uncovered while a
 * spare loads it waits up to cfg->route_wait_ms.
 *
 * The flow network's bytes per token between servers are the model's hidden
 * size (cfg->hidden_size, else what members report) x 2 (bf16 on the wire).
 * Router slots of departed members are reused once no lease holds them, and
 * beyond 64 departed joined members the oldest one's entry is reused, so churn
 * does not grow the gateway's memory.
 *
 * Links: the gateway times a small Echo (RTT) and a 256 KiB one (bandwidth) to
 * every member each cfg->measure_interval_ms; members report the same figures
 * to the peers the gateway names in heartbeat replies. Both feed the flow
 * network's link capacities; cfg->links override them. Every change recomputes
 * the router's max flow. All functions are thread-safe (one mutex guards the
 * swarm and the router, which are not).
 *
 * Calls to members and the membership service go through net/'s typed Shard
 * and Swarm services (shard-svc.h, swarm-svc.h). Ownership: the configuration
 * is borrowed for the swarm's life; a lease is the caller's struct, filled by
 * gw_swarm_route and emptied by gw_swarm_release.
 */
#ifndef FU_GW_SWARM_H
#define FU_GW_SWARM_H

#include <jansson.h>
#include <stdint.h>

#include "chain.h"
#include "gw.h"
#include "router.h"
#include "swarm-svc.h"

typedef struct gw_swarm gw_swarm;

/* A routed chain held by one generation: hops for chain_session_open. */
typedef struct gw_lease {
    struct rt_path *path;       /* NULL: nothing held */
    int n_hops;
    chain_hop hops[GW_MAX_HOPS]; /* addresses point into addr[] */
    char addr[GW_MAX_HOPS][128];
    int ids[GW_MAX_HOPS];       /* router server ids */
} gw_lease;

/* Starts polling cfg->shards[] (borrowed cfg) for a model of n_layers blocks and,
 * with cfg->swarm_listen, the membership service; the first round of polls is
 * done before it returns. Free with gw_swarm_free. */
int gw_swarm_new(const gw_config *cfg, int n_layers, gw_swarm **out);
/* The same without the background thread, the membership service or any call to
 * a member: the caller drives membership with gw_swarm_member_* and time with
 * gw_swarm_tick (tests of the gateway's decisions). */
int gw_swarm_new_manual(const gw_config *cfg, int n_layers, gw_swarm **out);
/* The handlers of the fusion.Swarm service over s (Join, Heartbeat), borrowed from s: the
 * service runs them; so may a test or a fuzz target on a manual swarm. */
const swarm_svc_handlers *gw_swarm_service(gw_swarm *s);
/* The bound port of the membership service (0: none). */
int gw_swarm_port(const gw_swarm *s);
/* Stops the heartbeat thread and frees; every lease must be released. NULL is a no-op. */
void gw_swarm_free(gw_swarm *s);

/* Routes a request of request_len tokens (prompt + new tokens) and fills *l.
 * On failure returns the status (FU_ERR_NOT_FOUND: no chain; FU_ERR_EXHAUSTED: no
 * KV room) with *err set to a 503 ("no server covers blocks [a, b)" when a span
 * is uncovered) and *l empty. */
int gw_swarm_route(gw_swarm *s, int request_len, gw_lease *l, gw_error *err);
/* As gw_swarm_route, cache-aware: among the chains the router's max flow allows, it leans
 * towards servers that recently got the same leading blocks of prompt[0..n_prompt) (their
 * prefix caches likely hold them; rt_route_cached bounds the lean), and remembers the chain's
 * servers for this prompt (gw-affinity.h). */
int gw_swarm_route_prefix(gw_swarm *s, int request_len, const int32_t *prompt, int n_prompt, gw_lease *l,
                          gw_error *err);
/* A chain for a training run (rt_train_chain): members whose whole spans tile the model, none of
 * router ids avoid[0..n_avoid), into *l -- addresses, spans and ids, no reservation (l->path
 * stays NULL; gw_swarm_report_failure takes it). On failure *err is a 503 saying which blocks
 * no chain of whole spans covers. */
int gw_swarm_train_chain(gw_swarm *s, const int *avoid, int n_avoid, gw_lease *l, gw_error *err);
/* Releases the lease's reservations (an empty lease is a no-op). */
void gw_swarm_release(gw_swarm *s, gw_lease *l);
/* A call over the lease failed with status `code` and `message` (chain errors name
 * the shard as "shard HOST:PORT: ..."): retires the named hop, or, when none is
 * named, every hop of the lease that does not answer an Echo probe. A refusal for
 * size or load (FU_ERR_EXHAUSTED: a shard's RESOURCE_EXHAUSTED, a request over its
 * budget) and a span that moved away retire no one: the member is fine. */
void gw_swarm_report_failure(gw_swarm *s, const gw_lease *l, int code, const char *message);
/* The first hop of the lease that has been retired since it was routed (its member failed its
 * polls or heartbeats, or another call reported it), or -1 when all are still in the swarm. */
int gw_swarm_lease_retired(gw_swarm *s, const gw_lease *l);
/* Blocks of the model no live member covers now; *n_layers gets the model's blocks. */
int gw_swarm_uncovered(gw_swarm *s, int *n_layers);
/* The /v1/swarm document (new reference; NULL on allocation failure). */
json_t *gw_swarm_json(gw_swarm *s);

/* ---- membership (the fusion.Swarm handlers call these) ---------------------------------- */

#define GW_MAX_PEER_LINKS 32

typedef struct gw_peer_link {
    char address[128];
    double rtt_s, bandwidth; /* bandwidth 0: not measured */
} gw_peer_link;

#define GW_MAX_STEPS 16

/* A member's measured step times of one block (MemberStatus.*_step_*, or a static member's
 * InfoReply.*_step_*): seconds[i] for tokens[i]. */
typedef struct gw_step_table {
    int n; /* 0: not measured */
    double tokens[GW_MAX_STEPS], seconds[GW_MAX_STEPS];
} gw_step_table;

/* What a member reports (MemberStatus). */
typedef struct gw_member_report {
    char address[128];
    int n_layers;
    int first, last;            /* served span; equal: none */
    char device[96], dtype[16];
    double tokens_per_s, block_tokens_per_s;
    int max_blocks;             /* 0: all */
    int64_t free_kv, total_kv, kv_per_pos;
    int sessions;
    bool fixed_span;
    int n_links;
    gw_peer_link links[GW_MAX_PEER_LINKS];
    int fail_first, fail_last;  /* the last assignment it could not load; equal: none */
    char load_error[200];       /* why */
    int dr_first, dr_last;      /* a span given up after a move, still serving old sessions; equal: none */
    int dr_sessions;
    int hidden_size;            /* 0: not reported */
    gw_step_table prompt_steps, decode_steps; /* both or neither measured */
} gw_member_report;

/* What the gateway answers: the member id and the span to load (first == last: none). */
typedef struct gw_member_reply {
    uint64_t member_id;
    int first, last;
    int n_peers;                /* heartbeat replies: addresses to measure */
    char peers[GW_MAX_PEER_LINKS][128];
} gw_member_reply;

/* Registers a member at monotonic time `now` (seconds). FU_ERR_INVALID: a bad
 * report (the model's block count differs, a bad span or address, a static
 * member's address). */
int gw_swarm_member_join(gw_swarm *s, const gw_member_report *r, double now, gw_member_reply *out);
/* A heartbeat of member `member_id`; `leaving` retires it at once.
 * FU_ERR_NOT_FOUND: no such member (retired or never joined): it must join again. */
int gw_swarm_member_heartbeat(gw_swarm *s, uint64_t member_id, const gw_member_report *r, bool leaving, double now,
                              gw_member_reply *out);
/* Retires joined members silent since before now - heartbeat timeout and gives
 * spares their spans (the background thread calls it a few times a second). */
void gw_swarm_tick(gw_swarm *s, double now);
/* Sets the measured gateway -> member link (for tests; the thread measures it). */
int gw_swarm_member_link(gw_swarm *s, uint64_t member_id, double rtt_s, double bandwidth);

/* Rules 1-3 (above) over `sw`, with the spans being loaded already applied:
 * which of the spares spares[0..n) should load which span now (rules 4 and 5
 * call it with spares_target 0, rule 5 also with min_gain 0), by the estimate
 * under `so` (the workload and step profiles; NULL: rt_sim_run's defaults). Only
 * the 4 most capable spares (most blocks, then fastest) are weighed, each costing
 * an estimate per window, so that a crowd of spares cannot stall the swarm's lock.
 * Returns its index in spares[] (and *first, *last), or -1: they all wait. */
int gw_pick_spare(const rt_swarm *sw, const int *spares, int n, int spares_target, double min_gain,
                  const rt_sim_opts *so, int *first, int *last);
/* Rule 6's choice over `sw`: which serving server of movable[0..n) should move to which span:
 * the move raising the estimate under `so` the most, by at least min_gain (a fraction), among
 * those that leave every block covered by the others. Only the 4 that use the least of their
 * capacity in the max flow are weighed (an estimate per window each). Returns its index (and
 * *first, *last), or -1. */
int gw_pick_move(const rt_swarm *sw, const int *movable, int n, double min_gain, const rt_sim_opts *so, int *first,
                 int *last);
/* A served request's prompt and output token counts, folded into the planner's workload. */
void gw_swarm_note_request(gw_swarm *s, int prompt_tokens, int output_tokens);

#endif
