/* gw-swarm.c -- membership (Info polls, fusion.Swarm joins and heartbeats), span placement and spares, link
 * measurements, an rt_swarm + rt_router kept current, routed leases. */
#include "gw-swarm.h"

#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "clock.h"
#include "grow.h"
#include "gw-affinity.h"
#include "log.h"
#include "router.h"
#include "rpc-base.h"
#include "shard-svc.h"
#include "status.h"
#include "swarm-svc.h"

#define GW_TICK_MS 200
#define GW_INFO_EVERY_S 1.0
#define GW_POLL_TIMEOUT_MS 1000
#define GW_ECHO_BYTES (256 << 10)
#define GW_DEFAULT_BANDWIDTH 1e12 /* an unmeasured link: loopback-class, so compute bounds the flow */
#define GW_DEFAULT_LATENCY 1e-4
#define GW_WIRE_BYTES 2          /* bf16 hidden states between servers */
#define GW_MAX_LOAD_FAILURES 3   /* a member whose loads failed this often is not asked again */
#define GW_LOADED_S 10.0         /* a refusal for want of KV room counts as load this long */
#define GW_MOVE_CHECK_S 1.0      /* least time between two searches for a move */
#define GW_AFFINITY_PER_SERVER 1024 /* prompt-prefix hashes remembered per server */
#define GW_AFFINITY_MAX_SERVERS 1024 /* beyond this many servers routing leans on no cache */
#define GW_PLAN_PROMPT 512      /* the planner's workload before any request is served: prompt tokens */
#define GW_PLAN_OUTPUT 128      /* ... and output tokens */
#define GW_PLAN_WEIGHT 0.02     /* each served request's weight in the moving averages */
#define GW_MAX_GONE 64           /* departed joined members kept for /v1/swarm; beyond, the oldest is reused */

typedef struct gw_member {
    char address[128];
    rpc_channel *ch;        /* NULL in manual mode */
    bool joined;            /* registered over fusion.Swarm (else a static --shard) */
    bool live;              /* counted in the swarm (a good poll / a join, and no retirement since) */
    bool probed;            /* joined: answered the gateway's first Echo since it joined; routed only then */
    uint64_t member_id;     /* joined: the id its heartbeats carry; 0 once retired */
    int id;                 /* router id; -1: not in the router */
    int first, last;        /* span served; equal: none (a spare) */
    int as_first, as_last;  /* joined: span assigned and being loaded; equal: none */
    bool fixed;             /* joined with a span of its own */
    char device[96], dtype[16];
    double tps, block_tps;
    int max_blocks;
    int64_t free_kv, total_kv, kv_per_pos;
    int sessions;
    double last_ok;         /* unix seconds of the last good report; 0: never */
    double last_hb;         /* joined: monotonic seconds of the last heartbeat */
    double info_at;         /* static: monotonic seconds of the last poll */
    double retired_at;      /* monotonic seconds of the last retirement */
    char error[200];        /* why it was retired, or why its last load failed */
    int dr_first, dr_last;  /* joined: a span it gives up after a move, still serving old sessions */
    int dr_sessions;
    int failed[GW_MAX_LOAD_FAILURES][2]; /* spans it failed to load: never asked for again */
    int n_fails;            /* loads failed; GW_MAX_LOAD_FAILURES: never asked again */
    int busy;               /* calls over ch in progress without the lock: not reused meanwhile */
    double span_since;      /* joined: heartbeat time since which it serves its span */
    double rtt_s, bw;       /* gateway -> member, measured; 0: not yet */
    double measured_at;     /* monotonic; 0: never */
    gw_step_table prompt_steps, decode_steps; /* one block's measured step times (n 0: none) */
    bool steps_refused;     /* static: its Info's step tables were refused (said once) */
    unsigned serial;        /* this gateway's number for it, unique while it runs */
    int n_links;            /* member -> peers, as reported */
    gw_peer_link links[GW_MAX_PEER_LINKS];
    /* the figures it was added to the router with (re-added when they change) */
    int r_first, r_last;
    double r_tps, r_block_tps;
    int64_t r_total_kv;
} gw_member;

struct gw_swarm {
    const gw_config *cfg;
    int n_layers;
    bool manual;
    pthread_mutex_t mu;      /* guards everything below */
    pthread_cond_t cv;       /* the thread's sleep */
    pthread_cond_t changed;  /* broadcast whenever the router or an assignment changes */
    bool stopping;
    rt_swarm sw;
    rt_router *router;
    gw_affinity *aff;        /* which servers recently got which prompt prefixes (cache-aware routing) */
    gw_member **m;           /* members never move or go away before gw_swarm_free; a departed joined one
                                may be reused for a new member (never while busy) */
    size_t n, cap;
    uint64_t next_member_id;
    bool left;               /* a serving member left since the last placement */
    double busy_at;          /* monotonic seconds of the last refusal for want of KV room; 0: none */
    double load_promoted_at; /* monotonic seconds of the last promotion for load; 0: none */
    double last_move_at;     /* tick time of the last move ordered; < 0: none yet */
    double move_checked_at;  /* tick time of the last search for a move; < 0: none yet */
    uint64_t move_checked_version; /* the swarm's version then (no change: no search) */
    int n_moves;
    double prompt_mean, output_mean; /* served requests' lengths (moving averages): the planner's workload */
    unsigned next_serial;    /* the next member's serial */
    rpc_server *rpc;         /* the fusion.Swarm service; NULL: none */
    swarm_svc_handlers handlers; /* registered on rpc; borrowed by it until rpc_server_free */
    pthread_t thread;
    bool started;
};

static double min_gain(const gw_swarm *s) { return s->cfg->min_gain_percent / 100.0; }

/* The router kind of member mb: its own when it measured its step times (they are its profile),
 * by member id if it joined, by serial if it is a static --shard. */
static void gw_member_kind(const gw_member *mb, char kind[32]) {
    if (mb->decode_steps.n > 0 && mb->prompt_steps.n > 0 && mb->joined)
        snprintf(kind, 32, "member-%llu", (unsigned long long)mb->member_id);
    else if (mb->decode_steps.n > 0 && mb->prompt_steps.n > 0)
        snprintf(kind, 32, "shard-%u", mb->serial);
    else snprintf(kind, 32, "%.31s", mb->device[0] ? mb->device : "shard");
}

/* ---- placement rule (pure) -------------------------------------------------------------- */

/* Spares weighed per placement decision. Weighing one costs a max flow per window of blocks it
 * could hold, under the swarm's lock, so only the most capable ones are (most blocks held, then
 * the fastest at that many), however many spares wait. */
#define GW_PICK_CANDIDATES 4

/* Whether spare a is more capable than spare b (more blocks, then more tokens/s holding them). */
static bool gw_spare_better(const rt_swarm *sw, int a, int b) {
    int ka = rt_swarm_max_layers(sw, a), kb = rt_swarm_max_layers(sw, b);
    if (ka != kb) return ka > kb;
    const rt_server *x = &sw->servers[a], *y = &sw->servers[b];
    double ta = ka > 0 && x->n_tput >= ka ? x->tput[ka - 1] : 0, tb = kb > 0 && y->n_tput >= kb ? y->tput[kb - 1] : 0;
    return ta > tb;
}

/* Whether index a ranks before index b among a pick's candidates. */
typedef bool (*gw_before_fn)(const void *ctx, int a, int b);

/* The (at most GW_PICK_CANDIDATES) first of the indices 0..n-1 by `before`, in cand[] in that
 * order (equals in index order); returns how many. */
static int gw_top(int n, gw_before_fn before, const void *ctx, int *cand) {
    int m = 0;
    for (int k = 0; k < n; k++) {
        int at = m;
        while (at > 0 && before(ctx, k, cand[at - 1])) at--;
        if (at >= GW_PICK_CANDIDATES) continue;
        if (m < GW_PICK_CANDIDATES) m++;
        memmove(cand + at + 1, cand + at, (size_t)(m - 1 - at) * sizeof *cand);
        cand[at] = k;
    }
    return m;
}

typedef struct gw_spare_rank {
    const rt_swarm *sw;
    const int *spares;
} gw_spare_rank;

static bool gw_spare_before(const void *ctx, int a, int b) {
    const gw_spare_rank *r = ctx;
    return gw_spare_better(r->sw, r->spares[a], r->spares[b]);
}

/* The indices into spares[0..n) of the (at most GW_PICK_CANDIDATES) most capable, in cand[];
 * returns how many, in order of spares[] among equals. */
static int gw_spare_candidates(const rt_swarm *sw, const int *spares, int n, int *cand) {
    gw_spare_rank r = {sw, spares};
    return gw_top(n, gw_spare_before, &r, cand);
}

/* The most uncovered blocks a candidate covers, then the highest estimate, over cand[0..m) (locked). */
static int gw_pick_cover(const rt_swarm *sw, const int *spares, const int *cand, int m, const rt_sim_opts *so,
                         int *first, int *last) {
    int L = sw->model.n_layers, best = -1, best_cov = 0;
    double best_gain = -1;
    char *covered = calloc((size_t)L, 1);
    if (!covered) return -1;
    for (int i = 0; i < sw->n_servers; i++)
        if (rt_swarm_serving(sw, i))
            for (int b = sw->servers[i].first; b < sw->servers[i].last; b++) covered[b] = 1;
    for (int j = 0; j < m; j++) {
        int f, l, k = cand[j], cov = 0;
        double gain = 0;
        if (rt_place_join_throughput(sw, spares[k], so, &f, &l, &gain)) continue;
        for (int b = f; b < l; b++) cov += !covered[b];
        if (cov > best_cov || (cov == best_cov && cov > 0 && gain > best_gain))
            best = k, *first = f, *last = l, best_cov = cov, best_gain = gain;
    }
    free(covered);
    return best;
}

int gw_pick_spare(const rt_swarm *sw, const int *spares, int n, int spares_target, double min_gain,
                  const rt_sim_opts *so, int *first, int *last) {
    if (n <= 0) return -1;
    int cand[GW_PICK_CANDIDATES], m = gw_spare_candidates(sw, spares, n, cand), best = -1, best_f = 0, best_l = 0;
    if (rt_swarm_uncovered(sw, NULL) > 0) {
        best = gw_pick_cover(sw, spares, cand, m, so, &best_f, &best_l);
    } else if (n > spares_target) {
        double now = 0, best_gain = -1;
        if (rt_estimate_decode_tps(sw, so, &now)) return -1;
        for (int j = 0; j < m; j++) {
            int f, l, k = cand[j];
            double gain = 0;
            if (rt_place_join_throughput(sw, spares[k], so, &f, &l, &gain)) continue;
            if (gain > best_gain) best = k, best_f = f, best_l = l, best_gain = gain;
        }
        if (best >= 0 && !(best_gain > 1e-9 && best_gain >= min_gain * now)) best = -1;
    }
    if (best >= 0) *first = best_f, *last = best_l;
    return best;
}

typedef struct gw_move_rank {
    const double *use; /* [n] share of its capacity each movable server uses in the max flow */
} gw_move_rank;

static bool gw_move_before(const void *ctx, int a, int b) {
    const gw_move_rank *r = ctx;
    return r->use[a] < r->use[b];
}

/* The indices into movable[0..n) of the (at most GW_PICK_CANDIDATES) serving servers that use the
 * least of their capacity in the max flow, in cand[]; returns how many. A move is weighed by an
 * estimate per window, so only these are. */
static int gw_move_candidates(const rt_swarm *sw, const int *movable, int n, int *cand) {
    rt_flow fl = {0};
    double *use = malloc((size_t)(n + 1) * sizeof *use);
    int m = 0;
    if (use && !rt_flow_compute(sw, NULL, &fl, NULL)) {
        for (int k = 0; k < n; k++) {
            int id = movable[k];
            if (!rt_swarm_serving(sw, id)) {
                use[k] = INFINITY;
                continue;
            }
            double cap = rt_swarm_tput(sw, id, sw->servers[id].last - sw->servers[id].first);
            use[k] = cap > 0 && id < fl.n ? fl.server_flow[id] / cap : 0;
        }
        gw_move_rank r = {use};
        m = gw_top(n, gw_move_before, &r, cand);
        while (m > 0 && isinf(use[cand[m - 1]])) m--; /* those not serving rank last; none of them */
    }
    rt_flow_free(&fl);
    free(use);
    return m;
}

int gw_pick_move(const rt_swarm *sw, const int *movable, int n, double min_gain, const rt_sim_opts *so, int *first,
                 int *last) {
    double now = 0;
    int cand[GW_PICK_CANDIDATES], m = gw_move_candidates(sw, movable, n, cand);
    if (!m || rt_estimate_decode_tps(sw, so, &now)) return -1;
    double best_tps = now * (1 + min_gain) + 1e-9;
    int best = -1, best_f = 0, best_l = 0;
    for (int j = 0; j < m; j++) {
        int k = cand[j], id = movable[k], f = 0, l = 0;
        rt_swarm view;
        if (rt_swarm_clone(&view, sw)) return -1;
        double without = 0, gain = 0;
        /* without it every block must stay covered: the old span serves until the new one does */
        if (!rt_swarm_set_span(&view, id, 0, 0) && rt_swarm_uncovered(&view, NULL) == 0 &&
            !rt_estimate_decode_tps(&view, so, &without) && !rt_place_join_throughput(&view, id, so, &f, &l, &gain) &&
            l > f && (f != sw->servers[id].first || l != sw->servers[id].last)) {
            if (without + gain > best_tps) best = k, best_f = f, best_l = l, best_tps = without + gain;
        }
        rt_swarm_free(&view);
    }
    if (best >= 0) *first = best_f, *last = best_l;
    return best;
}

/* ---- the router's view -------------------------------------------------------------------- */

/* Recomputes the router's flow and wakes requests waiting for a span (locked). */
static void gw_swarm_changed_locked(gw_swarm *s) {
    if (rt_router_update(s->router)) FU_WARN("router update failed: %s", fu_last_error());
    pthread_cond_broadcast(&s->changed);
}

/* The configured figure for from -> to ("gateway" for the gateway), if any. */
static const gw_link_cfg *gw_link_given(const gw_swarm *s, const char *from, const char *to) {
    for (int i = 0; i < s->cfg->n_links; i++)
        if (!strcmp(s->cfg->links[i].from, from) && !strcmp(s->cfg->links[i].to, to)) return &s->cfg->links[i];
    return NULL;
}

/* The figure member a reported for its link to b, if any. */
static const gw_peer_link *gw_link_reported(const gw_member *a, const gw_member *b) {
    for (int i = 0; i < a->n_links; i++)
        if (a->links[i].bandwidth > 0 && !strcmp(a->links[i].address, b->address)) return &a->links[i];
    return NULL;
}

/* Sets every link of the router's live servers from the given, measured or default figures (locked). */
static void gw_links_apply_locked(gw_swarm *s) {
    for (size_t i = 0; i < s->n; i++) {
        const gw_member *a = s->m[i];
        if (a->id < 0) continue;
        const gw_link_cfg *in = gw_link_given(s, "gateway", a->address), *out = gw_link_given(s, a->address, "gateway");
        double bw = a->bw > 0 ? a->bw : GW_DEFAULT_BANDWIDTH, lat = a->rtt_s > 0 ? a->rtt_s / 2 : GW_DEFAULT_LATENCY;
        rt_swarm_set_link(&s->sw, RT_SOURCE, a->id, in ? in->bandwidth : bw, in ? in->latency : lat);
        rt_swarm_set_link(&s->sw, a->id, RT_SINK, out ? out->bandwidth : bw, out ? out->latency : lat);
        for (size_t j = 0; j < s->n; j++) {
            const gw_member *b = s->m[j];
            if (j == i || b->id < 0) continue;
            const gw_link_cfg *g = gw_link_given(s, a->address, b->address);
            const gw_peer_link *r = gw_link_reported(a, b);
            if (!r) r = gw_link_reported(b, a);
            if (g) rt_swarm_set_link(&s->sw, a->id, b->id, g->bandwidth, g->latency);
            else if (r) rt_swarm_set_link(&s->sw, a->id, b->id, r->bandwidth, r->rtt_s / 2);
            else rt_swarm_set_link(&s->sw, a->id, b->id, GW_DEFAULT_BANDWIDTH, GW_DEFAULT_LATENCY);
        }
    }
}

/* Takes member mb out of the router (locked; the caller recomputes). */
static void gw_member_unroute_locked(gw_swarm *s, gw_member *mb) {
    if (mb->id < 0) return;
    rt_swarm_remove_server(&s->sw, mb->id);
    mb->id = -1;
}

/* Puts member mb into the router with its current figures (locked; the caller recomputes). */
static void gw_member_route_locked(gw_swarm *s, gw_member *mb) {
    int L = s->n_layers;
    int maxk = mb->joined && mb->max_blocks > 0 && mb->max_blocks < L ? mb->max_blocks : L;
    if (mb->last - mb->first > maxk) maxk = mb->last - mb->first;
    double *tput = calloc((size_t)maxk, sizeof *tput), *kv = calloc((size_t)maxk, sizeof *kv);
    if (!tput || !kv) {
        free(tput);
        free(kv);
        FU_WARN("swarm: out of memory adding %s", mb->address);
        return;
    }
    double kv_tokens = mb->kv_per_pos > 0 ? (double)mb->total_kv / (double)mb->kv_per_pos : 0;
    for (int k = 1; k <= maxk; k++) {
        tput[k - 1] = mb->block_tps > 0 ? mb->block_tps / k : mb->tps > 0 ? mb->tps : 1.0;
        kv[k - 1] = kv_tokens;
    }
    if (mb->tps > 0 && mb->last > mb->first) tput[mb->last - mb->first - 1] = mb->tps; /* measured on the span */
    rt_server d = {0};
    snprintf(d.name, sizeof d.name, "%.63s", mb->address);
    snprintf(d.address, sizeof d.address, "%s", mb->address);
    gw_member_kind(mb, d.kind);
    d.state = mb->last > mb->first ? RT_SERVER_ACTIVE : RT_SERVER_SPARE;
    d.first = mb->first;
    d.last = mb->last;
    d.n_tput = maxk;
    d.tput = tput;
    d.kv_tokens = kv;
    /* reuse a departed server's slot once no lease holds it, so churn does not grow the router */
    int slot = -1;
    for (int i = 0; i < s->sw.n_servers && slot < 0; i++)
        if (s->sw.servers[i].state == RT_SERVER_GONE && !rt_router_busy(s->router, i)) slot = i;
    int id = rt_swarm_add_server_at(&s->sw, slot, &d);
    free(tput);
    free(kv);
    if (id < 0) {
        FU_WARN("swarm: cannot add %s [%d, %d): %s", mb->address, mb->first, mb->last, fu_last_error());
        return;
    }
    mb->id = id;
    mb->r_first = mb->first;
    mb->r_last = mb->last;
    mb->r_tps = mb->tps;
    mb->r_block_tps = mb->block_tps;
    mb->r_total_kv = mb->total_kv;
}

/* Whether member mb may carry requests: live, and a joined one has answered a probe of the
 * gateway's (a Join alone proves only that its sender holds the secret). */
static bool gw_member_routable(const gw_member *mb) { return mb->live && (!mb->joined || mb->probed); }

/* Brings the router in line with member mb (locked). Returns true if the router changed. */
static bool gw_member_sync_locked(gw_swarm *s, gw_member *mb) {
    if (!gw_member_routable(mb)) {
        if (mb->id < 0) return false;
        gw_member_unroute_locked(s, mb);
    } else {
        if (mb->id >= 0 && mb->r_first == mb->first && mb->r_last == mb->last && mb->r_tps == mb->tps &&
            mb->r_block_tps == mb->block_tps && mb->r_total_kv == mb->total_kv)
            return false;
        gw_member_unroute_locked(s, mb);
        gw_member_route_locked(s, mb);
        if (mb->id >= 0) {
            if (mb->last > mb->first)
                FU_INFO("swarm: %s serves blocks [%d, %d), %.1f tokens/s", mb->address, mb->first, mb->last, mb->tps);
            else
                FU_INFO("swarm: %s waits as a spare (%.1f tokens/s for one block)", mb->address, mb->block_tps);
        }
    }
    gw_links_apply_locked(s);
    gw_swarm_changed_locked(s);
    return true;
}

/* Whether member mb failed to load [first, last) before (locked). */
static bool gw_member_failed(const gw_member *mb, int first, int last) {
    for (int i = 0; i < mb->n_fails; i++)
        if (mb->failed[i][0] == first && mb->failed[i][1] == last) return true;
    return false;
}

/* Whether member mb may be asked to load a span at all (locked). */
static bool gw_member_usable(const gw_member *mb) {
    return mb->joined && mb->live && !mb->fixed && mb->id >= 0 && mb->n_fails < GW_MAX_LOAD_FAILURES;
}

/* Whether rule 5 applies now: a request was refused for want of KV room lately, after the last promotion for
 * load, which was at least GW_LOADED_S ago (locked). */
static bool gw_loaded_locked(const gw_swarm *s, double now) {
    bool refused = s->busy_at > 0 && now - s->busy_at < GW_LOADED_S;
    bool after = s->load_promoted_at <= 0 ||
                 (s->busy_at > s->load_promoted_at && now - s->load_promoted_at >= GW_LOADED_S);
    return refused && after;
}

/* The planner's view (locked): the served requests' average lengths as its workload, and the routed
 * members' measured step times as profiles (*prof: free with rt_sim_profiles_free). */
static void gw_plan_opts_locked(const gw_swarm *s, rt_sim_opts *so, rt_sim_profiles *prof) {
    memset(so, 0, sizeof *so);
    memset(prof, 0, sizeof *prof);
    so->prompt_len = (int)fmax(1, lround(s->prompt_mean));
    so->output_len = (int)fmax(1, lround(s->output_mean));
    for (size_t i = 0; i < s->n; i++) {
        const gw_member *mb = s->m[i];
        char kind[32];
        gw_member_kind(mb, kind);
        if (mb->id < 0 || mb->decode_steps.n <= 0 || mb->prompt_steps.n <= 0 || rt_sim_profile_find(prof, kind)) continue;
        if (rt_sim_profiles_add(prof, kind, mb->prompt_steps.n, mb->prompt_steps.tokens, mb->prompt_steps.seconds,
                                mb->decode_steps.n, mb->decode_steps.tokens, mb->decode_steps.seconds))
            FU_WARN("swarm: %s's step times are left out: %s", mb->address, fu_last_error());
    }
    so->profiles = prof;
}

void gw_swarm_note_request(gw_swarm *s, int prompt_tokens, int output_tokens) {
    if (!s || prompt_tokens < 1 || output_tokens < 1) return;
    pthread_mutex_lock(&s->mu);
    s->prompt_mean += GW_PLAN_WEIGHT * (prompt_tokens - s->prompt_mean);
    s->output_mean += GW_PLAN_WEIGHT * (output_tokens - s->output_mean);
    pthread_mutex_unlock(&s->mu);
}

/* The live usable spares into spares[]/who[] (router ids / members), with the spans being loaded
 * applied to `view`; returns how many (locked). */
static int gw_spares_locked(gw_swarm *s, rt_swarm *view, int *spares, gw_member **who) {
    int n = 0;
    for (size_t i = 0; i < s->n; i++) {
        gw_member *mb = s->m[i];
        if (mb->id < 0 || !mb->live) continue;
        if (mb->as_last > mb->as_first) {
            /* a spare loading counts as serving; a move as serving both spans until it is done */
            if (mb->last == mb->first) rt_swarm_set_span(view, mb->id, mb->as_first, mb->as_last);
        } else if (gw_member_usable(mb) && mb->last == mb->first) {
            spares[n] = mb->id;
            who[n++] = mb;
        }
    }
    return n;
}

/* One placement decision: which spare, if any, loads which span now (locked). Returns whether one
 * was told to. */
static bool gw_place_one_locked(gw_swarm *s, const rt_sim_opts *so, double now, int *spares, gw_member **who) {
    rt_swarm view;
    if (rt_swarm_clone(&view, &s->sw)) return false;
    int n = gw_spares_locked(s, &view, spares, who);
    /* a member that failed to load a span is not asked for the same span again */
    for (int k = 0; k < n; k++) {
        int f, l;
        if (who[k]->n_fails && !rt_place_join_throughput(&view, spares[k], so, &f, &l, NULL) &&
            gw_member_failed(who[k], f, l)) {
            spares[k] = spares[n - 1], who[k] = who[n - 1];
            n--, k--;
        }
    }
    /* rules 4 and 5: a departure, or load, lets the spares within the count serve too */
    int target = s->cfg->spares, f = 0, l = 0;
    double gain = min_gain(s);
    bool loaded = gw_loaded_locked(s, now);
    if (s->left) target = 0;
    if (loaded) target = 0, gain = 0;
    int k = gw_pick_spare(&view, spares, n, target, gain, so, &f, &l);
    rt_swarm_free(&view);
    if (k < 0) return false;
    who[k]->as_first = f;
    who[k]->as_last = l;
    FU_INFO("swarm: asking %s to load blocks [%d, %d)%s", who[k]->address, f, l,
            rt_swarm_uncovered(&s->sw, NULL) ? ""
            : loaded                         ? " (the swarm is loaded)"
            : s->left                        ? " (a server left)"
                                             : "");
    /* one promotion per departure, and one per GW_LOADED_S of load */
    s->left = false;
    if (loaded) s->load_promoted_at = now;
    pthread_cond_broadcast(&s->changed);
    return true;
}

/* Whether a live usable member holds no span and loads none: a spare to place (locked). */
static bool gw_has_spare_locked(const gw_swarm *s) {
    for (size_t i = 0; i < s->n; i++) {
        const gw_member *mb = s->m[i];
        if (mb->id >= 0 && mb->live && mb->as_last == mb->as_first && gw_member_usable(mb) && mb->last == mb->first)
            return true;
    }
    return false;
}

/* Gives spares their spans by the placement rules (locked). */
static void gw_swarm_rebalance_locked(gw_swarm *s) {
    if (!gw_has_spare_locked(s)) { /* nothing to place: no planning */
        if (rt_swarm_uncovered(&s->sw, NULL) == 0) s->left = false;
        return;
    }
    double now = fu_now_s();
    rt_sim_opts so;
    rt_sim_profiles prof;
    gw_plan_opts_locked(s, &so, &prof);
    int *spares = calloc(s->n + 1, sizeof *spares);
    gw_member **who = calloc(s->n + 1, sizeof *who);
    for (size_t iter = 0; spares && who && iter <= s->n; iter++)
        if (!gw_place_one_locked(s, &so, now, spares, who)) break;
    free(spares);
    free(who);
    rt_sim_profiles_free(&prof);
    if (rt_swarm_uncovered(&s->sw, NULL) == 0) s->left = false;
}

/* Rule 6: orders at most one move of a serving joined member that has served its span for
 * cfg->rebalance_interval_ms, when that raises the max flow by min_gain, keeps every block covered
 * and no move happened for cfg->rebalance_interval_ms (locked). */
static void gw_swarm_move_locked(gw_swarm *s, double now) {
    if (s->cfg->rebalance_interval_ms <= 0 ||
        (s->last_move_at >= 0 && now - s->last_move_at < s->cfg->rebalance_interval_ms / 1000.0))
        return;
    if (rt_swarm_uncovered(&s->sw, NULL) > 0) return;
    /* the search costs max-flow runs: once per second at most, and only when the swarm changed (or,
     * as members settle in their spans, once per interval) */
    double since = now - s->move_checked_at, interval = s->cfg->rebalance_interval_ms / 1000.0;
    if (s->move_checked_at >= 0 &&
        (since < GW_MOVE_CHECK_S || (s->sw.version == s->move_checked_version && since < interval)))
        return;
    int *movable = calloc(s->n + 1, sizeof *movable);
    gw_member **who = calloc(s->n + 1, sizeof *who);
    int n = 0;
    for (size_t i = 0; movable && who && i < s->n; i++) {
        gw_member *mb = s->m[i];
        if (!mb->live || mb->id < 0) continue;
        if (mb->as_last > mb->as_first || mb->dr_last > mb->dr_first) { /* something is still settling */
            n = 0;
            break;
        }
        if (gw_member_usable(mb) && mb->last > mb->first &&
            now - mb->span_since >= s->cfg->rebalance_interval_ms / 1000.0) { /* settled in its span */
            movable[n] = mb->id;
            who[n++] = mb;
        }
    }
    int f = 0, l = 0;
    rt_sim_opts so;
    rt_sim_profiles prof;
    gw_plan_opts_locked(s, &so, &prof);
    int k = n ? gw_pick_move(&s->sw, movable, n, min_gain(s), &so, &f, &l) : -1;
    rt_sim_profiles_free(&prof);
    if (n) s->move_checked_at = now, s->move_checked_version = s->sw.version;
    if (k >= 0 && !gw_member_failed(who[k], f, l)) {
        who[k]->as_first = f;
        who[k]->as_last = l;
        s->last_move_at = now;
        s->n_moves++;
        FU_INFO("swarm: asking %s to move from blocks [%d, %d) to [%d, %d)", who[k]->address, who[k]->first,
                who[k]->last, f, l);
        pthread_cond_broadcast(&s->changed);
    }
    free(movable);
    free(who);
}

/* Retires member mb (locked). */
static void gw_member_retire_locked(gw_swarm *s, gw_member *mb, const char *why) {
    mb->retired_at = fu_now_s();
    snprintf(mb->error, sizeof mb->error, "%s", why);
    if (!mb->live) return;
    FU_WARN("swarm: retiring %s%s [%d, %d): %s", mb->joined ? "member " : "shard ", mb->address, mb->first, mb->last,
            why);
    if (mb->last > mb->first && mb->id >= 0) s->left = true;
    mb->live = false;
    mb->member_id = 0;
    mb->as_first = mb->as_last = 0;
    mb->dr_first = mb->dr_last = mb->dr_sessions = 0;
    gw_member_sync_locked(s, mb);
    gw_swarm_rebalance_locked(s);
}

static bool gw_pending_locked(const gw_swarm *s) {
    for (size_t i = 0; i < s->n; i++)
        if (s->m[i]->live && s->m[i]->as_last > s->m[i]->as_first) return true;
    return false;
}

/* ---- members ---------------------------------------------------------------------------- */

/* The departed joined member to reuse for a new one, if GW_MAX_GONE are kept already (locked). */
static gw_member *gw_member_reusable_locked(gw_swarm *s) {
    gw_member *oldest = NULL;
    int gone = 0;
    for (size_t i = 0; i < s->n; i++) {
        gw_member *mb = s->m[i];
        if (!mb->joined || mb->live) continue;
        gone++;
        if (!mb->busy && mb->id < 0 && (!oldest || mb->retired_at < oldest->retired_at)) oldest = mb;
    }
    return gone >= GW_MAX_GONE ? oldest : NULL;
}

/* A channel to a member (none for a manual swarm): the shards' CA, the gateway's client pair. */
static int gw_member_channel(const gw_swarm *s, const char *address, rpc_channel **out) {
    *out = NULL;
    if (s->manual) return FU_OK;
    return gw_channel_new(s->cfg, address, out);
}

/* A new member (locked). */
static gw_member *gw_member_add_locked(gw_swarm *s, const char *address) {
    gw_member *mb = gw_member_reusable_locked(s);
    if (mb) {
        rpc_channel *ch = NULL;
        if (gw_member_channel(s, address, &ch)) return NULL;
        rpc_channel_free(mb->ch);
        memset(mb, 0, sizeof *mb);
        mb->ch = ch;
        mb->id = -1;
        mb->serial = s->next_serial++;
        snprintf(mb->address, sizeof mb->address, "%s", address);
        snprintf(mb->error, sizeof mb->error, "not heard from yet");
        return mb;
    }
    if (fu_grow((void **)&s->m, &s->cap, s->n + 1, sizeof *s->m)) return NULL;
    mb = calloc(1, sizeof *mb);
    if (!mb) return NULL;
    mb->id = -1;
    mb->serial = s->next_serial++;
    snprintf(mb->address, sizeof mb->address, "%s", address);
    snprintf(mb->error, sizeof mb->error, "not heard from yet");
    if (gw_member_channel(s, mb->address, &mb->ch)) {
        free(mb);
        return NULL;
    }
    s->m[s->n++] = mb;
    return mb;
}

static gw_member *gw_member_find_address_locked(gw_swarm *s, const char *address) {
    for (size_t i = 0; i < s->n; i++)
        if (!strcmp(s->m[i]->address, address)) return s->m[i];
    return NULL;
}

/* A measured step table: at most GW_MAX_STEPS points, tokens ascending and >= 1, seconds finite and
 * within [0, 3600]. */
static int gw_steps_check(const char *what, const gw_step_table *t) {
    if (t->n < 0 || t->n > GW_MAX_STEPS) return fu_errorf(FU_ERR_INVALID, "%s: at most %d points", what, GW_MAX_STEPS);
    for (int i = 0; i < t->n; i++)
        if (!(t->tokens[i] >= 1 && t->tokens[i] <= 1e7) || !(t->seconds[i] >= 0 && t->seconds[i] <= 3600) ||
            (i > 0 && !(t->tokens[i] > t->tokens[i - 1])))
            return fu_errorf(FU_ERR_INVALID, "%s point %d: tokens ascending from 1, seconds within [0, 3600]", what, i);
    return FU_OK;
}

/* A member's two step tables: each as gw_steps_check wants, and both or neither. */
static int gw_steps_pair_check(const gw_step_table *prompt, const gw_step_table *decode) {
    if (gw_steps_check("prompt", prompt) || gw_steps_check("decode", decode)) return FU_ERR_INVALID;
    if ((prompt->n > 0) != (decode->n > 0)) return fu_errorf(FU_ERR_INVALID, "prompt and decode go together");
    return FU_OK;
}

static int gw_report_check(const gw_swarm *s, const gw_member_report *r) {
    if (!r->address[0] || !strchr(r->address, ':'))
        return fu_errorf(FU_ERR_INVALID, "status.address: HOST:PORT required, got '%.100s'", r->address);
    if (r->n_layers != s->n_layers)
        return fu_errorf(FU_ERR_INVALID, "status.n_layers: the gateway's model has %d blocks, the member's %d",
                         s->n_layers, r->n_layers);
    if (r->first != r->last && (r->first < 0 || r->last <= r->first || r->last > s->n_layers))
        return fu_errorf(FU_ERR_INVALID, "status: span [%d, %d) does not fit %d blocks", r->first, r->last,
                         s->n_layers);
    if (s->cfg->hidden_size > 0 && r->hidden_size > 0 && r->hidden_size != s->cfg->hidden_size)
        return fu_errorf(FU_ERR_INVALID, "status.hidden_size: the gateway's model has %d, the member's %d",
                         s->cfg->hidden_size, r->hidden_size);
    if (r->dr_first != r->dr_last && (r->dr_first < 0 || r->dr_last <= r->dr_first || r->dr_last > s->n_layers))
        return fu_errorf(FU_ERR_INVALID, "status: draining span [%d, %d) does not fit %d blocks", r->dr_first,
                         r->dr_last, s->n_layers);
    if (r->max_blocks < 0 || !isfinite(r->tokens_per_s) || r->tokens_per_s < 0 || !isfinite(r->block_tokens_per_s) ||
        r->block_tokens_per_s < 0 || r->n_links < 0 || r->n_links > GW_MAX_PEER_LINKS)
        return fu_errorf(FU_ERR_INVALID, "status: bad figures");
    if (gw_steps_pair_check(&r->prompt_steps, &r->decode_steps))
        return fu_errorf(FU_ERR_INVALID, "status: step tables: %s", fu_last_error());
    for (int i = 0; i < r->n_links; i++)
        if (!isfinite(r->links[i].rtt_s) || r->links[i].rtt_s < 0 || r->links[i].rtt_s > 60 ||
            !isfinite(r->links[i].bandwidth) || r->links[i].bandwidth < 0)
            return fu_errorf(FU_ERR_INVALID, "status.links[%d]: bad figures", i);
    return FU_OK;
}

/* Copies a report's figures into mb (locked). */
static void gw_member_take_report(gw_member *mb, const gw_member_report *r, double now) {
    if (r->first != mb->first || r->last != mb->last) mb->span_since = now;
    mb->first = r->first;
    mb->last = r->last;
    snprintf(mb->device, sizeof mb->device, "%s", r->device);
    snprintf(mb->dtype, sizeof mb->dtype, "%s", r->dtype);
    mb->tps = r->tokens_per_s;
    mb->block_tps = r->block_tokens_per_s;
    mb->max_blocks = r->max_blocks;
    mb->free_kv = r->free_kv;
    mb->total_kv = r->total_kv;
    mb->kv_per_pos = r->kv_per_pos;
    mb->sessions = r->sessions;
    mb->fixed = r->fixed_span;
    mb->dr_first = r->dr_first;
    mb->dr_last = r->dr_last;
    mb->dr_sessions = r->dr_sessions;
    mb->prompt_steps = r->prompt_steps;
    mb->decode_steps = r->decode_steps;
    mb->n_links = r->n_links;
    memcpy(mb->links, r->links, (size_t)r->n_links * sizeof *r->links);
    mb->last_hb = now;
    mb->last_ok = fu_wall_s();
}

static void gw_member_reply_fill_locked(gw_swarm *s, const gw_member *mb, gw_member_reply *out, bool peers) {
    memset(out, 0, sizeof *out);
    out->member_id = mb->member_id;
    out->first = mb->as_first;
    out->last = mb->as_last;
    for (size_t i = 0; peers && i < s->n && out->n_peers < GW_MAX_PEER_LINKS; i++) {
        const gw_member *p = s->m[i];
        if (p != mb && p->id >= 0 && p->last > p->first)
            snprintf(out->peers[out->n_peers++], sizeof out->peers[0], "%s", p->address);
    }
}

/* Live joined members other than `except` (locked). */
static int gw_joined_count_locked(const gw_swarm *s, const gw_member *except) {
    int n = 0;
    for (size_t i = 0; i < s->n; i++) n += s->m[i] != except && s->m[i]->joined && s->m[i]->live;
    return n;
}

/* Refuses a join that is not allowed: a static member's address (FU_ERR_INVALID) or one member
 * too many (FU_ERR_EXHAUSTED; a member joining again does not count twice). Locked. */
static int gw_join_allowed_locked(const gw_swarm *s, const gw_member *mb, const char *address) {
    if (mb && !mb->joined) return fu_errorf(FU_ERR_INVALID, "%s is a static --shard of this gateway", address);
    int n = gw_joined_count_locked(s, mb);
    if (n >= s->cfg->max_members)
        return fu_errorf(FU_ERR_EXHAUSTED, "the swarm is full: %d members joined, the gateway's cap (--max-members)",
                         n);
    return FU_OK;
}

int gw_swarm_member_join(gw_swarm *s, const gw_member_report *r, double now, gw_member_reply *out) {
    memset(out, 0, sizeof *out);
    int rc = gw_report_check(s, r);
    if (rc) return rc;
    pthread_mutex_lock(&s->mu);
    gw_member *mb = gw_member_find_address_locked(s, r->address);
    if ((rc = gw_join_allowed_locked(s, mb, r->address))) {
        pthread_mutex_unlock(&s->mu);
        return rc;
    }
    if (mb && mb->live) gw_member_retire_locked(s, mb, "joined again");
    if (!mb && !(mb = gw_member_add_locked(s, r->address))) {
        pthread_mutex_unlock(&s->mu);
        return fu_errorf(FU_ERR_NOMEM, "swarm: cannot add a member");
    }
    mb->joined = true;
    if (s->cfg->hidden_size <= 0 && r->hidden_size > 0 && s->sw.model.act_bytes != r->hidden_size * GW_WIRE_BYTES)
        s->sw.model.act_bytes = r->hidden_size * GW_WIRE_BYTES;
    gw_member_take_report(mb, r, now);
    mb->member_id = ++s->next_member_id;
    mb->live = true;
    mb->probed = s->manual; /* the swarm thread probes it; manual swarms make no calls */
    mb->as_first = mb->as_last = 0;
    mb->rtt_s = mb->bw = mb->measured_at = 0;
    mb->error[0] = '\0';
    FU_INFO("swarm: %s joined as member %llu (%s, %s, max %d blocks)", mb->address, (unsigned long long)mb->member_id,
            mb->device, mb->dtype, mb->max_blocks);
    gw_member_sync_locked(s, mb);
    if (mb->probed && mb->id < 0) {
        mb->live = false;
        mb->member_id = 0;
        snprintf(mb->error, sizeof mb->error, "cannot add it to the router");
        pthread_mutex_unlock(&s->mu);
        return fu_errorf(FU_ERR_INVALID, "swarm: cannot place %s", r->address);
    }
    gw_swarm_rebalance_locked(s);
    gw_member_reply_fill_locked(s, mb, out, false);
    pthread_mutex_unlock(&s->mu);
    return FU_OK;
}

static gw_member *gw_member_find_id_locked(gw_swarm *s, uint64_t member_id) {
    for (size_t i = 0; member_id && i < s->n; i++)
        if (s->m[i]->joined && s->m[i]->live && s->m[i]->member_id == member_id) return s->m[i];
    return NULL;
}

int gw_swarm_member_heartbeat(gw_swarm *s, uint64_t member_id, const gw_member_report *r, bool leaving, double now,
                              gw_member_reply *out) {
    memset(out, 0, sizeof *out);
    pthread_mutex_lock(&s->mu);
    gw_member *mb = gw_member_find_id_locked(s, member_id);
    if (!mb) {
        pthread_mutex_unlock(&s->mu);
        return fu_errorf(FU_ERR_NOT_FOUND, "no member %llu: join again", (unsigned long long)member_id);
    }
    if (leaving) {
        gw_member_retire_locked(s, mb, "left the swarm");
        pthread_mutex_unlock(&s->mu);
        return FU_OK;
    }
    int rc = gw_report_check(s, r);
    if (!rc && strcmp(r->address, mb->address))
        rc = fu_errorf(FU_ERR_INVALID, "status.address: member %llu joined as %s", (unsigned long long)member_id,
                       mb->address);
    if (rc) {
        pthread_mutex_unlock(&s->mu);
        return rc;
    }
    gw_member_take_report(mb, r, now);
    bool changed = false;
    if (mb->as_last > mb->as_first && r->load_error[0] && r->fail_first == mb->as_first &&
        r->fail_last == mb->as_last) {
        /* withdraw the assignment; this member is not asked for that span again */
        if (mb->n_fails < GW_MAX_LOAD_FAILURES) {
            mb->failed[mb->n_fails][0] = mb->as_first;
            mb->failed[mb->n_fails][1] = mb->as_last;
            mb->n_fails++;
        }
        snprintf(mb->error, sizeof mb->error, "loading blocks [%d, %d) failed: %.120s", mb->as_first, mb->as_last,
                 r->load_error);
        FU_WARN("swarm: %s: %s%s", mb->address, mb->error,
                mb->n_fails >= GW_MAX_LOAD_FAILURES ? " (not asked again)" : "");
        mb->as_first = mb->as_last = 0;
        changed = true;
    } else if (mb->as_last > mb->as_first && mb->first == mb->as_first && mb->last == mb->as_last) {
        mb->as_first = mb->as_last = 0; /* loaded (or moved) */
        mb->error[0] = '\0';
    }
    if (gw_member_sync_locked(s, mb) || changed) gw_swarm_rebalance_locked(s);
    gw_member_reply_fill_locked(s, mb, out, true);
    pthread_mutex_unlock(&s->mu);
    return FU_OK;
}

void gw_swarm_tick(gw_swarm *s, double now) {
    pthread_mutex_lock(&s->mu);
    double timeout = s->cfg->heartbeat_timeout_ms / 1000.0;
    for (size_t i = 0; i < s->n; i++) {
        gw_member *mb = s->m[i];
        if (mb->joined && mb->live && now - mb->last_hb > timeout) {
            char why[100];
            snprintf(why, sizeof why, "no heartbeat for %.1f s", now - mb->last_hb);
            gw_member_retire_locked(s, mb, why);
        }
    }
    gw_swarm_rebalance_locked(s);
    gw_swarm_move_locked(s, now);
    pthread_mutex_unlock(&s->mu);
}

int gw_swarm_member_link(gw_swarm *s, uint64_t member_id, double rtt_s, double bandwidth) {
    if (!isfinite(rtt_s) || rtt_s < 0 || !isfinite(bandwidth) || bandwidth < 0)
        return fu_errorf(FU_ERR_INVALID, "swarm: bad link figures");
    pthread_mutex_lock(&s->mu);
    gw_member *mb = gw_member_find_id_locked(s, member_id);
    if (mb) {
        mb->rtt_s = rtt_s;
        mb->bw = bandwidth;
        mb->measured_at = fu_now_s();
        gw_links_apply_locked(s);
        gw_swarm_changed_locked(s);
    }
    pthread_mutex_unlock(&s->mu);
    return mb ? FU_OK : fu_errorf(FU_ERR_NOT_FOUND, "no member %llu", (unsigned long long)member_id);
}

/* ---- static members: Info polls ---------------------------------------------------------- */

/* Describes a failed call to a member for its error: "Info: unavailable: ...". */
static void gw_call_why(char *why, size_t why_len, const char *method, int code, const rpc_status *st) {
    snprintf(why, why_len, "%s: %s%s%.150s", method, rpc_code_str(code), st->message[0] ? ": " : "", st->message);
}

/* One Info call over channel ch (unlocked); *out: free with shard_svc_info_free. */
static int gw_info_call(gw_swarm *s, rpc_channel *ch, shard_svc_info **out, char *why, size_t why_len) {
    *out = NULL;
    shard_svc_info *r = NULL;
    rpc_status st = {0};
    int code = shard_svc_info_get(ch, GW_POLL_TIMEOUT_MS, &r, &st);
    if (code) {
        gw_call_why(why, why_len, "Info", code, &st);
        return FU_ERR_NETWORK;
    }
    if (r->n_layers != s->n_layers || r->first_block < 0 || r->last_block <= r->first_block ||
        r->last_block > s->n_layers) {
        snprintf(why, why_len, "Info: span [%d, %d) of %d blocks does not fit the model's %d", r->first_block,
                 r->last_block, r->n_layers, s->n_layers);
        shard_svc_info_free(r);
        return FU_ERR_FORMAT;
    }
    *out = r;
    return FU_OK;
}

/* A received step table (the service bounds it to SWARM_SVC_MAX_STEPS points). */
static void gw_steps_from(const swarm_svc_steps *in, gw_step_table *out) {
    out->n = in->n <= GW_MAX_STEPS ? (int)in->n : -1; /* -1: refused by gw_steps_check */
    for (int i = 0; i < out->n; i++) out->tokens[i] = in->tokens[i], out->seconds[i] = in->seconds[i];
}

/* A static member's step tables from its Info reply r, kept when they pass the checks a joined
 * member's report does (gw_steps_pair_check); otherwise it has none (locked). */
static void gw_info_steps(const shard_svc_info *r, gw_member *mb) {
    gw_step_table p, d;
    gw_steps_from(&(swarm_svc_steps){r->n_prompt_steps, r->prompt_step_tokens, r->prompt_step_s}, &p);
    gw_steps_from(&(swarm_svc_steps){r->n_decode_steps, r->decode_step_tokens, r->decode_step_s}, &d);
    if (gw_steps_pair_check(&p, &d)) {
        if (!mb->steps_refused) FU_WARN("swarm: %s's step tables are left out: %s", mb->address, fu_last_error());
        mb->steps_refused = true;
        p.n = d.n = 0;
    }
    mb->prompt_steps = p, mb->decode_steps = d;
}

/* The member at index i, or NULL past the end (locks briefly: the array may grow). */
static gw_member *gw_member_at(gw_swarm *s, size_t i) {
    pthread_mutex_lock(&s->mu);
    gw_member *mb = i < s->n ? s->m[i] : NULL;
    pthread_mutex_unlock(&s->mu);
    return mb;
}

/* Polls static member mb once and applies the result. */
static void gw_member_poll(gw_swarm *s, gw_member *mb) {
    double t0 = fu_now_s();
    shard_svc_info *r = NULL;
    char why[200] = "";
    int rc = gw_info_call(s, mb->ch, &r, why, sizeof why);
    pthread_mutex_lock(&s->mu);
    mb->info_at = t0;
    if (rc) {
        gw_member_retire_locked(s, mb, why);
    } else if (mb->retired_at <= t0) { /* a failure reported during the poll wins */
        mb->first = r->first_block;
        mb->last = r->last_block;
        mb->tps = r->tokens_per_s;
        mb->free_kv = r->free_kv_bytes;
        mb->total_kv = r->total_kv_bytes;
        mb->kv_per_pos = r->kv_bytes_per_position;
        mb->sessions = r->active_sessions;
        snprintf(mb->device, sizeof mb->device, "%s", r->device);
        snprintf(mb->dtype, sizeof mb->dtype, "%s", r->dtype);
        gw_info_steps(r, mb);
        mb->last_ok = fu_wall_s();
        if (!mb->live) {
            mb->live = true;
            mb->error[0] = '\0';
        }
        if (gw_member_sync_locked(s, mb)) gw_swarm_rebalance_locked(s);
    }
    pthread_mutex_unlock(&s->mu);
    shard_svc_info_free(r);
}

/* ---- link measurements ------------------------------------------------------------------- */

/* One small Echo (a liveness probe): RPC_OK, or the code with why filled. */
static int gw_echo(rpc_channel *ch, char *why, size_t why_len) {
    rpc_status st = {0};
    int code = shard_svc_echo(ch, 0, GW_POLL_TIMEOUT_MS * 2, &st);
    if (code) gw_call_why(why, why_len, "Echo", code, &st);
    return code;
}

/* Probes joined member mb, not routed yet, with one small Echo (unlocked call): an answer makes it
 * routable (and placeable), a failure retires it. member_id: its membership when the probe began. */
static void gw_member_probe(gw_swarm *s, gw_member *mb, uint64_t member_id) {
    char why[200] = "";
    int code = gw_echo(mb->ch, why, sizeof why);
    pthread_mutex_lock(&s->mu);
    if (mb->live && mb->member_id == member_id) { /* still the membership probed */
        if (code) {
            char m[240];
            snprintf(m, sizeof m, "not reachable from the gateway: %s", why);
            gw_member_retire_locked(s, mb, m);
        } else {
            mb->probed = true;
            if (gw_member_sync_locked(s, mb)) gw_swarm_rebalance_locked(s);
        }
    }
    pthread_mutex_unlock(&s->mu);
}

/* Measures the link to member mb (unlocked calls); a failed call retires it. */
static void gw_member_measure(gw_swarm *s, gw_member *mb) {
    char why[200] = "";
    rpc_status st = {0};
    double rtt = 0, bw = 0;
    int code = shard_svc_measure_link(mb->ch, GW_ECHO_BYTES, GW_POLL_TIMEOUT_MS * 2, &rtt, &bw, &st);
    if (code) gw_call_why(why, sizeof why, "Echo", code, &st);
    pthread_mutex_lock(&s->mu);
    mb->measured_at = fu_now_s();
    if (code) {
        gw_member_retire_locked(s, mb, why);
    } else {
        mb->rtt_s = rtt;
        mb->bw = bw;
        gw_links_apply_locked(s);
        gw_swarm_changed_locked(s);
    }
    pthread_mutex_unlock(&s->mu);
}

/* ---- the background thread ---------------------------------------------------------------- */

static void gw_swarm_round(gw_swarm *s) {
    double now = fu_now_s();
    gw_swarm_tick(s, now);
    gw_member *mb;
    for (size_t i = 0; (mb = gw_member_at(s, i)); i++) {
        pthread_mutex_lock(&s->mu);
        bool poll = !mb->joined && now - mb->info_at >= GW_INFO_EVERY_S;
        bool probe = mb->joined && mb->live && !mb->probed;
        uint64_t member_id = mb->member_id;
        bool measure = s->cfg->measure_links && mb->live && !probe &&
                       (mb->measured_at <= 0 || now - mb->measured_at >= s->cfg->measure_interval_ms / 1000.0);
        bool stopping = s->stopping;
        if (poll || probe || measure) mb->busy++;
        pthread_mutex_unlock(&s->mu);
        if (stopping) return;
        if (poll) gw_member_poll(s, mb);
        if (probe) gw_member_probe(s, mb, member_id);
        if (measure) gw_member_measure(s, mb);
        if (poll || probe || measure) {
            pthread_mutex_lock(&s->mu);
            mb->busy--;
            pthread_mutex_unlock(&s->mu);
        }
    }
}

static void *gw_swarm_main(void *arg) {
    gw_swarm *s = arg;
    pthread_mutex_lock(&s->mu);
    while (!s->stopping) {
        struct timespec ts = fu_deadline_us(CLOCK_REALTIME, (int64_t)GW_TICK_MS * 1000);
        while (!s->stopping && pthread_cond_timedwait(&s->cv, &s->mu, &ts) == 0) {
        }
        if (s->stopping) break;
        pthread_mutex_unlock(&s->mu);
        gw_swarm_round(s);
        pthread_mutex_lock(&s->mu);
    }
    pthread_mutex_unlock(&s->mu);
    return NULL;
}

/* ---- the fusion.Swarm service ------------------------------------------------------------- */

/* A member's report as the gateway keeps it (strings bounded; an address too long becomes ""). */
static void gw_report_from_member(const swarm_svc_member *ms, gw_member_report *r) {
    memset(r, 0, sizeof *r);
    if (!ms) return;
    snprintf(r->address, sizeof r->address, "%s", ms->address);
    if (strlen(ms->address) >= sizeof r->address) r->address[0] = '\0';
    r->n_layers = ms->n_layers;
    r->first = ms->first_block;
    r->last = ms->last_block;
    snprintf(r->device, sizeof r->device, "%s", ms->device);
    snprintf(r->dtype, sizeof r->dtype, "%s", ms->dtype);
    r->tokens_per_s = ms->tokens_per_s;
    r->block_tokens_per_s = ms->block_tokens_per_s;
    r->max_blocks = ms->max_blocks;
    r->free_kv = ms->free_kv_bytes;
    r->total_kv = ms->total_kv_bytes;
    r->kv_per_pos = ms->kv_bytes_per_position;
    r->sessions = ms->active_sessions;
    r->fixed_span = ms->fixed_span;
    r->fail_first = ms->failed_first;
    r->fail_last = ms->failed_last;
    snprintf(r->load_error, sizeof r->load_error, "%s", ms->load_error);
    r->dr_first = ms->draining_first;
    r->dr_last = ms->draining_last;
    r->dr_sessions = ms->draining_sessions;
    r->hidden_size = ms->hidden_size;
    gw_steps_from(&ms->prompt_steps, &r->prompt_steps);
    gw_steps_from(&ms->decode_steps, &r->decode_steps);
    for (size_t i = 0; i < ms->n_links && r->n_links < GW_MAX_PEER_LINKS; i++) {
        const swarm_svc_link *lf = &ms->links[i];
        if (strlen(lf->address) >= sizeof r->links[0].address) continue;
        gw_peer_link *pl = &r->links[r->n_links++];
        snprintf(pl->address, sizeof pl->address, "%s", lf->address);
        pl->rtt_s = lf->rtt_s;
        pl->bandwidth = lf->bandwidth_bytes_per_s;
    }
}

/* A membership refusal as a gRPC status: NOT_FOUND keeps its code (the member joins again). */
static int gw_status_fail(rpc_status *st, int rc) {
    if (rc == FU_ERR_NOT_FOUND) return rpc_status_setf(st, RPC_NOT_FOUND, "%s", fu_last_error());
    return rpc_status_from_fu(st, rc);
}

/* Join: registers the member and answers its id, heartbeat interval and span to load (if any). */
static int gw_join_handler(void *ctx, const swarm_svc_member *status, swarm_svc_join_reply *out, rpc_status *st) {
    gw_swarm *s = ctx;
    if (!status) return rpc_status_setf(st, RPC_INVALID_ARGUMENT, "status: required");
    gw_member_report *r = malloc(sizeof *r);
    if (!r) return rpc_status_setf(st, RPC_RESOURCE_EXHAUSTED, "out of memory");
    gw_report_from_member(status, r);
    gw_member_reply m;
    int rc = gw_swarm_member_join(s, r, fu_now_s(), &m);
    free(r);
    if (rc) return gw_status_fail(st, rc);
    *out = (swarm_svc_join_reply){m.member_id, s->cfg->heartbeat_ms, m.last > m.first, m.first, m.last};
    return RPC_OK;
}

/* Heartbeat: the member's new figures; answers the span to load (if any) and the peers to measure. */
static int gw_heartbeat_handler(void *ctx, const swarm_svc_heartbeat_request *req, swarm_svc_heartbeat_reply *out,
                                rpc_status *st) {
    gw_swarm *s = ctx;
    if (!req->status && !req->leaving) return rpc_status_setf(st, RPC_INVALID_ARGUMENT, "status: required");
    gw_member_report *r = malloc(sizeof *r);
    gw_member_reply *m = malloc(sizeof *m);
    if (!r || !m) {
        free(r);
        free(m);
        return rpc_status_setf(st, RPC_RESOURCE_EXHAUSTED, "out of memory");
    }
    gw_report_from_member(req->status, r);
    int rc = gw_swarm_member_heartbeat(s, req->member_id, r, req->leaving, fu_now_s(), m);
    free(r);
    if (!rc) {
        out->has_span = m->last > m->first;
        out->first_block = m->first;
        out->last_block = m->last;
        for (int i = 0; i < m->n_peers && i < SWARM_SVC_MAX_PEERS; i++)
            snprintf(out->peers[out->n_peers++], sizeof out->peers[0], "%s", m->peers[i]);
    }
    free(m);
    return rc ? gw_status_fail(st, rc) : RPC_OK;
}

static int gw_swarm_serve(gw_swarm *s) {
    const gw_config *c = s->cfg;
    const char *cert = c->swarm_tls_cert ? c->swarm_tls_cert : c->https_cert;
    const char *key = c->swarm_tls_cert ? c->swarm_tls_key : c->https_key;
    rpc_server_options o = {c->swarm_listen, cert, key, c->insecure, c->secret, 0, 4, c->swarm_tls_client_ca, 0};
    int rc = rpc_server_new(&o, &s->rpc);
    if (!rc) rc = swarm_svc_serve(s->rpc, &s->handlers);
    if (!rc) rc = rpc_server_start(s->rpc);
    if (rc) return fu_errorf(rc, "swarm service on %s: %s", c->swarm_listen, fu_last_error());
    int port = rpc_server_port(s->rpc);
    FU_INFO("swarm: members join at %s (port %d)%s", c->swarm_listen, port,
            c->swarm_tls_client_ca ? ", mutual TLS" : cert ? ", TLS" : "");
    if (c->swarm_port_file) {
        char tmp[4096];
        snprintf(tmp, sizeof tmp, "%s.tmp", c->swarm_port_file);
        FILE *f = fopen(tmp, "w");
        if (!f || fprintf(f, "%d\n", port) < 0 || fclose(f) || rename(tmp, c->swarm_port_file))
            return fu_errorf(FU_ERR_IO, "cannot write %s: %s", c->swarm_port_file, strerror(errno));
    }
    return FU_OK;
}

/* ---- life cycle --------------------------------------------------------------------------- */

static int gw_swarm_create(const gw_config *cfg, int n_layers, bool manual, gw_swarm **out) {
    *out = NULL;
    if (cfg->n_shards <= 0 && !cfg->swarm_listen && !manual)
        return fu_errorf(FU_ERR_INVALID, "swarm: no shard addresses and no --swarm-listen");
    if (n_layers <= 0) return fu_errorf(FU_ERR_INVALID, "swarm: the model has no blocks");
    gw_swarm *s = calloc(1, sizeof *s);
    if (!s) return fu_errorf(FU_ERR_NOMEM, "swarm");
    s->cfg = cfg;
    s->n_layers = n_layers;
    s->manual = manual;
    s->handlers = (swarm_svc_handlers){s, gw_join_handler, gw_heartbeat_handler};
    s->last_move_at = s->move_checked_at = -1;
    s->prompt_mean = GW_PLAN_PROMPT, s->output_mean = GW_PLAN_OUTPUT;
    pthread_mutex_init(&s->mu, NULL);
    pthread_cond_init(&s->cv, NULL);
    pthread_cond_init(&s->changed, NULL);
    rt_model model = {0};
    snprintf(model.name, sizeof model.name, "gateway");
    model.n_layers = n_layers;
    model.token_bytes = 2;
    model.act_bytes = (cfg->hidden_size > 0 ? cfg->hidden_size : 1) * GW_WIRE_BYTES; /* per token between servers */
    int rc = rt_swarm_init(&s->sw, &model);
    if (rc) {
        pthread_cond_destroy(&s->changed);
        pthread_cond_destroy(&s->cv);
        pthread_mutex_destroy(&s->mu);
        free(s);
        return rc;
    }
    rt_route_opts ro = {0};
    if ((rc = rt_router_init(&s->router, &s->sw, &ro)) || (rc = gw_affinity_new(GW_AFFINITY_PER_SERVER, &s->aff))) {
        gw_swarm_free(s);
        return rc;
    }
    for (int i = 0; i < cfg->n_shards; i++) {
        pthread_mutex_lock(&s->mu);
        gw_member *mb = gw_member_add_locked(s, cfg->shards[i]);
        pthread_mutex_unlock(&s->mu);
        if (!mb) {
            gw_swarm_free(s);
            return fu_errorf(FU_ERR_NOMEM, "swarm: %s: %s", cfg->shards[i], fu_last_error());
        }
    }
    *out = s;
    return FU_OK;
}

const swarm_svc_handlers *gw_swarm_service(gw_swarm *s) { return &s->handlers; }

int gw_swarm_new_manual(const gw_config *cfg, int n_layers, gw_swarm **out) {
    return gw_swarm_create(cfg, n_layers, true, out);
}

int gw_swarm_new(const gw_config *cfg, int n_layers, gw_swarm **out) {
    gw_swarm *s;
    int rc = gw_swarm_create(cfg, n_layers, false, &s);
    if (rc) return rc;
    gw_member *mb;
    for (size_t i = 0; (mb = gw_member_at(s, i)); i++) gw_member_poll(s, mb);
    if (cfg->swarm_listen && (rc = gw_swarm_serve(s))) {
        gw_swarm_free(s);
        return rc;
    }
    if (pthread_create(&s->thread, NULL, gw_swarm_main, s)) {
        gw_swarm_free(s);
        return fu_errorf(FU_ERR_INTERNAL, "swarm: cannot start the heartbeat thread");
    }
    s->started = true;
    *out = s;
    return FU_OK;
}

int gw_swarm_port(const gw_swarm *s) { return s->rpc ? rpc_server_port(s->rpc) : 0; }

void gw_swarm_free(gw_swarm *s) {
    if (!s) return;
    rpc_server_free(s->rpc); /* no handler runs past this */
    if (s->started) {
        pthread_mutex_lock(&s->mu);
        s->stopping = true;
        pthread_cond_broadcast(&s->cv);
        pthread_mutex_unlock(&s->mu);
        pthread_join(s->thread, NULL);
    }
    rt_router_free(s->router);
    gw_affinity_free(s->aff);
    rt_swarm_free(&s->sw);
    for (size_t i = 0; i < s->n; i++) {
        rpc_channel_free(s->m[i]->ch);
        free(s->m[i]);
    }
    free(s->m);
    pthread_cond_destroy(&s->changed);
    pthread_cond_destroy(&s->cv);
    pthread_mutex_destroy(&s->mu);
    free(s);
}

/* ---- routing ------------------------------------------------------------------------------ */

/* Fills *err for a routing failure (locked). */
static void gw_swarm_route_error(gw_swarm *s, int rc, gw_error *err) {
    int gap = -1;
    if (rt_swarm_uncovered(&s->sw, &gap) > 0 && gap >= 0) {
        int end = gap + 1;
        for (; end < s->n_layers; end++) {
            bool covered = false;
            for (int i = 0; i < s->sw.n_servers && !covered; i++)
                covered = rt_swarm_serving(&s->sw, i) && s->sw.servers[i].first <= end &&
                          end < s->sw.servers[i].last;
            if (covered) break;
        }
        gw_error_set(err, 503, NULL, "no_route", "no server covers blocks [%d, %d)", gap, end);
    } else if (rc == FU_ERR_EXHAUSTED) {
        gw_error_set(err, 503, NULL, "overloaded", "the shard servers are at capacity, retry later: %s",
                     fu_last_error());
    } else {
        gw_error_set(err, 503, NULL, "no_route", "no chain of servers can serve the request: %s", fu_last_error());
    }
}

/* The tokens of the prompt with hashes h[0..n) that each router server likely holds cached,
 * into cached[0..n_servers) (mu held); NULL when the prompt has no whole block. */
static const int *gw_swarm_cached_locked(gw_swarm *s, const uint64_t *h, int n, int *cached) {
    if (n <= 0 || s->sw.n_servers > GW_AFFINITY_MAX_SERVERS) return NULL;
    for (int v = 0; v < s->sw.n_servers; v++) cached[v] = gw_affinity_cached(s->aff, v, h, n);
    return cached;
}

int gw_swarm_route(gw_swarm *s, int request_len, gw_lease *l, gw_error *err) {
    return gw_swarm_route_prefix(s, request_len, NULL, 0, l, err);
}

int gw_swarm_route_prefix(gw_swarm *s, int request_len, const int32_t *prompt, int n_prompt, gw_lease *l,
                          gw_error *err) {
    memset(l, 0, sizeof *l);
    uint64_t ph[GW_AFFINITY_MAX_BLOCKS];
    int cached[GW_AFFINITY_MAX_SERVERS];
    const int n_ph = prompt ? gw_affinity_hashes(prompt, n_prompt, ph) : 0;
    double deadline = fu_now_s() + s->cfg->route_wait_ms / 1000.0;
    pthread_mutex_lock(&s->mu);
    rt_path *p = NULL;
    int rc;
    for (;;) {
        rc = rt_route_cached(s->router, request_len > 0 ? request_len : 1, gw_swarm_cached_locked(s, ph, n_ph, cached),
                             &p);
        if (!rc && p->n_hops > GW_MAX_HOPS) {
            rt_release(p);
            p = NULL;
            rc = fu_errorf(FU_ERR_UNSUPPORTED, "the route has more than %d hops", GW_MAX_HOPS);
            break;
        }
        /* a spare loading an uncovered span is worth waiting for */
        double now = fu_now_s();
        if (!rc || !gw_pending_locked(s) || rt_swarm_uncovered(&s->sw, NULL) == 0 || now >= deadline) break;
        double wait = deadline - now < 0.1 ? deadline - now : 0.1;
        struct timespec ts = fu_deadline_us(CLOCK_REALTIME, (int64_t)(wait * 1e6));
        pthread_cond_timedwait(&s->changed, &s->mu, &ts);
    }
    if (rc) {
        if (rc == FU_ERR_EXHAUSTED && rt_swarm_uncovered(&s->sw, NULL) == 0) {
            s->busy_at = fu_now_s(); /* the swarm is loaded: rule 5 may promote a spare */
            gw_swarm_rebalance_locked(s);
        }
        gw_swarm_route_error(s, rc, err);
        pthread_mutex_unlock(&s->mu);
        return rc;
    }
    l->path = p;
    l->n_hops = p->n_hops;
    for (int h = 0; h < p->n_hops; h++) {
        const rt_server *sv = &s->sw.servers[p->servers[h]];
        snprintf(l->addr[h], sizeof l->addr[h], "%s", sv->address);
        l->hops[h] = (chain_hop){l->addr[h], p->first[h], p->last[h], NULL};
        l->ids[h] = p->servers[h];
    }
    for (int k = 0; k < p->n_hops; k++) gw_affinity_note(s->aff, p->servers[k], ph, n_ph); /* a hint: best effort */
    pthread_mutex_unlock(&s->mu);
    return FU_OK;
}

int gw_swarm_train_chain(gw_swarm *s, const int *avoid, int n_avoid, gw_lease *l, gw_error *err) {
    memset(l, 0, sizeof *l);
    int ids[GW_MAX_HOPS], n = 0;
    pthread_mutex_lock(&s->mu);
    int rc = rt_train_chain(&s->sw, avoid, n_avoid, GW_MAX_HOPS, ids, &n);
    for (int h = 0; !rc && h < n; h++) {
        const rt_server *sv = &s->sw.servers[ids[h]];
        snprintf(l->addr[h], sizeof l->addr[h], "%s", sv->address);
        l->hops[h] = (chain_hop){l->addr[h], sv->first, sv->last, NULL};
        l->ids[h] = ids[h];
    }
    pthread_mutex_unlock(&s->mu);
    if (rc) return gw_error_set(err, 503, NULL, "no_training_chain", "%s", fu_last_error()), rc;
    l->n_hops = n;
    return FU_OK;
}

void gw_swarm_release(gw_swarm *s, gw_lease *l) {
    if (!l->path) return;
    pthread_mutex_lock(&s->mu);
    rt_release(l->path);
    pthread_mutex_unlock(&s->mu);
    l->path = NULL;
    l->n_hops = 0;
}

/* The member whose router id is `id` (locked). */
static gw_member *gw_member_by_router_id_locked(gw_swarm *s, int id) {
    for (size_t i = 0; id >= 0 && i < s->n; i++)
        if (s->m[i]->id == id) return s->m[i];
    return NULL;
}

void gw_swarm_report_failure(gw_swarm *s, const gw_lease *l, int code, const char *message) {
    if (code == FU_ERR_EXHAUSTED) return; /* too big or too many: the member is fine */
    char why[200];
    snprintf(why, sizeof why, "call failed: %s", message ? message : "");
    /* "shard HOST:PORT: ..." names the failed hop */
    int named = -1;
    if (message && !strncmp(message, "shard ", 6)) {
        const char *a = message + 6;
        for (int h = 0; h < l->n_hops && named < 0; h++) {
            size_t n = strlen(l->addr[h]);
            if (!strncmp(a, l->addr[h], n) && a[n] == ':') named = h;
        }
    }
    /* a span that moved away ends its old sessions: the server is fine, the session is replayed elsewhere */
    if (message && strstr(message, "moved away from this server")) return;
    if (named >= 0) {
        pthread_mutex_lock(&s->mu);
        gw_member *mb = gw_member_by_router_id_locked(s, l->ids[named]);
        if (mb) gw_member_retire_locked(s, mb, why);
        pthread_mutex_unlock(&s->mu);
        return;
    }
    /* unnamed: probe each hop */
    for (int h = 0; h < l->n_hops; h++) {
        pthread_mutex_lock(&s->mu);
        gw_member *mb = gw_member_by_router_id_locked(s, l->ids[h]);
        if (mb) mb->busy++;
        pthread_mutex_unlock(&s->mu);
        if (!mb) continue;
        char pwhy[200];
        int code = mb->ch ? gw_echo(mb->ch, pwhy, sizeof pwhy) : RPC_OK;
        pthread_mutex_lock(&s->mu);
        if (code && mb->id == l->ids[h]) gw_member_retire_locked(s, mb, pwhy);
        mb->busy--;
        pthread_mutex_unlock(&s->mu);
    }
}

int gw_swarm_lease_retired(gw_swarm *s, const gw_lease *l) {
    int gone = -1;
    pthread_mutex_lock(&s->mu);
    for (int h = 0; h < l->n_hops && gone < 0; h++) {
        const gw_member *mb = gw_member_by_router_id_locked(s, l->ids[h]);
        if (!mb || !mb->live) gone = h;
    }
    pthread_mutex_unlock(&s->mu);
    return gone;
}

/* ---- /v1/swarm ---------------------------------------------------------------------------- */

static const char *gw_member_state(const gw_member *mb) {
    if (!mb->live) return mb->last_ok > 0 ? "gone" : "unreachable";
    if (!gw_member_routable(mb)) return "joining"; /* not probed yet */
    if (mb->last > mb->first) return mb->as_last > mb->as_first ? "moving" : "active";
    if (mb->as_last > mb->as_first) return "loading";
    return mb->joined && mb->n_fails >= GW_MAX_LOAD_FAILURES ? "failed" : "spare";
}

/* A step table as [[tokens, ms], ...]. */
static json_t *gw_steps_json(const gw_step_table *t) {
    json_t *a = json_array();
    for (int i = 0; a && i < t->n; i++) json_array_append_new(a, json_pack("[f, f]", t->tokens[i], t->seconds[i] * 1e3));
    return a;
}

/* The link from the gateway as the flow network uses it ("link") and the reported peer links
 * ("peer_links") of member mb, into o. */
static void gw_member_links_json(gw_swarm *s, const gw_member *mb, json_t *o, double now) {
    const gw_link_cfg *g = gw_link_given(s, "gateway", mb->address);
    json_t *link = json_object();
    json_object_set_new(link, "rtt_s",
                        g ? json_real(2 * g->latency) : mb->rtt_s > 0 ? json_real(mb->rtt_s) : json_null());
    json_object_set_new(link, "bandwidth_bytes_per_s",
                        g ? json_real(g->bandwidth) : mb->bw > 0 ? json_real(mb->bw) : json_null());
    json_object_set_new(link, "source", json_string(g ? "config" : mb->measured_at > 0 ? "measured" : "default"));
    json_object_set_new(link, "age_s", mb->measured_at > 0 ? json_real(now - mb->measured_at) : json_null());
    json_object_set_new(o, "link", link);
    json_t *peers = json_array();
    for (int i = 0; i < mb->n_links; i++)
        json_array_append_new(peers, json_pack("{s:s, s:f, s:f}", "address", mb->links[i].address, "rtt_s",
                                               mb->links[i].rtt_s, "bandwidth_bytes_per_s", mb->links[i].bandwidth));
    json_object_set_new(o, "peer_links", peers);
}

static json_t *gw_member_json(gw_swarm *s, const gw_member *mb, const rt_flow *f, double now_wall, double now) {
    int id = mb->id;
    json_t *o = json_object();
    if (!o) return NULL;
    json_object_set_new(o, "address", json_string(mb->address));
    json_object_set_new(o, "kind", json_string(mb->joined ? "joined" : "static"));
    json_object_set_new(o, "id", json_integer(id));
    if (mb->joined) json_object_set_new(o, "member_id", json_integer((json_int_t)mb->member_id));
    json_object_set_new(o, "span", mb->last > mb->first ? json_pack("[i, i]", mb->first, mb->last)
                                   : mb->joined       ? json_string("spare")
                                                      : json_null());
    json_object_set_new(o, "assigned", mb->as_last > mb->as_first ? json_pack("[i, i]", mb->as_first, mb->as_last)
                                                                   : json_null());
    json_object_set_new(o, "state", json_string(gw_member_state(mb)));
    if (mb->joined) {
        json_object_set_new(o, "draining", mb->dr_last > mb->dr_first
                                               ? json_pack("{s:[i, i], s:i}", "span", mb->dr_first, mb->dr_last,
                                                           "sessions", mb->dr_sessions)
                                               : json_null());
        json_t *failed = json_array();
        for (int i = 0; i < mb->n_fails; i++)
            json_array_append_new(failed, json_pack("[i, i]", mb->failed[i][0], mb->failed[i][1]));
        json_object_set_new(o, "failed_spans", failed);
        json_object_set_new(o, "failed_loads", json_integer(mb->n_fails));
    }
    json_object_set_new(o, "device", json_string(mb->device));
    json_object_set_new(o, "dtype", json_string(mb->dtype));
    json_object_set_new(o, "tokens_per_s", json_real(mb->tps));
    if (mb->joined) {
        json_object_set_new(o, "block_tokens_per_s", json_real(mb->block_tps));
        json_object_set_new(o, "max_blocks", json_integer(mb->max_blocks));
    }
    if (mb->decode_steps.n > 0)
        json_object_set_new(o, "step_ms", json_pack("{s:o, s:o}", "prompt", gw_steps_json(&mb->prompt_steps), "decode",
                                                    gw_steps_json(&mb->decode_steps)));
    json_object_set_new(o, "free_kv_bytes", json_integer((json_int_t)mb->free_kv));
    json_object_set_new(o, "total_kv_bytes", json_integer((json_int_t)mb->total_kv));
    json_object_set_new(o, "sessions", json_integer(mb->sessions));
    json_object_set_new(o, "flow", json_real(id >= 0 && f && id < f->n ? f->server_flow[id] : 0.0));
    json_object_set_new(o, "load", json_real(id >= 0 ? rt_router_load(s->router, id) : 0.0));
    gw_member_links_json(s, mb, o, now);
    json_object_set_new(o, "last_heartbeat", mb->last_ok > 0 ? json_real(mb->last_ok) : json_null());
    json_object_set_new(o, "heartbeat_age_s", mb->last_ok > 0 ? json_real(now_wall - mb->last_ok) : json_null());
    json_object_set_new(o, "error", mb->error[0] ? json_string(mb->error) : json_null());
    return o;
}

/* The planner's workload and its estimate of the swarm's decode tokens/s (locked). */
static json_t *gw_planner_json_locked(gw_swarm *s) {
    rt_sim_opts so;
    rt_sim_profiles prof;
    gw_plan_opts_locked(s, &so, &prof);
    double tps = 0;
    if (rt_estimate_decode_tps(&s->sw, &so, &tps)) tps = 0;
    int profiled = prof.n;
    rt_sim_profiles_free(&prof);
    return json_pack("{s:f, s:f, s:f, s:i}", "prompt_tokens", s->prompt_mean, "output_tokens", s->output_mean,
                     "decode_tokens_per_s", tps, "profiled_members", profiled);
}

int gw_swarm_uncovered(gw_swarm *s, int *n_layers) {
    pthread_mutex_lock(&s->mu);
    int uncovered = rt_swarm_uncovered(&s->sw, NULL);
    *n_layers = s->n_layers;
    pthread_mutex_unlock(&s->mu);
    return uncovered;
}

json_t *gw_swarm_json(gw_swarm *s) {
    json_t *servers = json_array(), *hops = json_array();
    if (!servers || !hops) {
        json_decref(servers);
        json_decref(hops);
        return NULL;
    }
    pthread_mutex_lock(&s->mu);
    const rt_flow *f = rt_router_flow(s->router);
    double now_wall = fu_wall_s(), now = fu_now_s();
    int n_spares = 0, n_active = 0;
    for (size_t i = 0; i < s->n; i++) {
        const gw_member *mb = s->m[i];
        json_t *o = gw_member_json(s, mb, f, now_wall, now);
        if (o) json_array_append_new(servers, o);
        if (mb->live && mb->last > mb->first) n_active++;
        else if (mb->live) n_spares++;
    }
    /* the flow on each hop (the gateway at both ends) */
    for (int h = 0; f && h < f->n_hops; h++) {
        int u = f->hops[h].from, v = f->hops[h].to;
        double x = f->hops[h].flow;
        if (!(x > 1e-9) || (u >= 0 && !rt_swarm_serving(&s->sw, u)) || (v >= 0 && !rt_swarm_serving(&s->sw, v)))
            continue;
        const char *from = u >= 0 ? s->sw.servers[u].address : "gateway";
        const char *to = v >= 0 ? s->sw.servers[v].address : "gateway";
        json_array_append_new(hops, json_pack("{s:s, s:s, s:f}", "from", from, "to", to, "tokens_per_s", x));
    }
    int uncovered = rt_swarm_uncovered(&s->sw, NULL);
    json_t *doc = json_pack("{s:s, s:i, s:f, s:i, s:i, s:i, s:i, s:i, s:i, s:b, s:f, s:i, s:o, s:o}", "object",
                            "swarm", "n_layers", s->n_layers, "max_flow", f ? f->value : 0.0, "uncovered_blocks",
                            uncovered, "live", rt_swarm_live(&s->sw), "active", n_active, "spares", n_spares,
                            "spares_target", s->cfg->spares, "moves", s->n_moves, "loaded",
                            s->busy_at > 0 && now - s->busy_at < GW_LOADED_S,
                            "act_bytes_per_token", s->sw.model.act_bytes, "router_slots", s->sw.n_servers,
                            "servers", servers, "flow", hops);
    if (doc) json_object_set_new(doc, "planner", gw_planner_json_locked(s));
    pthread_mutex_unlock(&s->mu);
    return doc;
}
