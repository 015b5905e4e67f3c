/* gw-swarm.c -- shard membership by Info heartbeats, an rt_swarm + rt_router kept current, routed leases. */
#include "gw-swarm.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "fusion.pb-c.h"
#include "log.h"
#include "router.h"
#include "rpc.h"
#include "status.h"

#define GW_HEARTBEAT_MS 1000
#define GW_POLL_TIMEOUT_MS 1000

typedef struct gw_member {
    char address[128];
    rpc_channel *ch;
    int id;                 /* router id while ACTIVE; -1 when retired or never seen */
    int first, last;        /* span from the last good Info */
    double tps;
    int64_t free_kv, total_kv, kv_per_pos;
    int sessions;
    double last_ok;         /* unix seconds of the last good heartbeat; 0: never */
    double retired_at;      /* monotonic seconds of the last retirement */
    char error[200];        /* why it was retired */
} gw_member;

struct gw_swarm {
    const gw_config *cfg;
    int n_layers;
    pthread_mutex_t mu;     /* guards everything below */
    pthread_cond_t cv;
    bool stopping;
    rt_swarm sw;
    rt_router *router;
    gw_member *m;
    int n;
    pthread_t thread;
    bool started;
};

static double mono_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

static double wall_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* Recomputes the router's flow (locked). */
static void gw_swarm_changed_locked(gw_swarm *s) {
    if (rt_router_update(s->router)) FU_WARN("router update failed: %s", fu_last_error());
}

/* Retires member i (locked). */
static void gw_member_retire_locked(gw_swarm *s, int i, const char *why) {
    gw_member *mb = &s->m[i];
    mb->retired_at = mono_s();
    snprintf(mb->error, sizeof mb->error, "%s", why);
    if (mb->id < 0) return;
    FU_WARN("swarm: retiring shard %s [%d, %d): %s", mb->address, mb->first, mb->last, why);
    rt_swarm_remove_server(&s->sw, mb->id);
    mb->id = -1;
    gw_swarm_changed_locked(s);
}

/* Adds member i to the router with its current figures (locked). */
static void gw_member_join_locked(gw_swarm *s, int i) {
    gw_member *mb = &s->m[i];
    int L = s->n_layers;
    double tput[1024], kv[1024];
    int n_tput = L < 1024 ? L : 1024;
    double kv_tokens = mb->kv_per_pos > 0 ? (double)mb->total_kv / (double)mb->kv_per_pos : 0;
    for (int k = 0; k < n_tput; k++) {
        tput[k] = mb->tps > 0 ? mb->tps : 1.0;
        kv[k] = kv_tokens;
    }
    rt_server d = {0};
    snprintf(d.name, sizeof d.name, "%.63s", mb->address);
    snprintf(d.address, sizeof d.address, "%s", mb->address);
    snprintf(d.kind, sizeof d.kind, "shard");
    d.state = RT_SERVER_ACTIVE;
    d.first = d.last = 0;
    d.n_tput = n_tput;
    d.tput = tput;
    d.kv_tokens = kv;
    int id = rt_swarm_add_server(&s->sw, &d);
    if (id < 0) {
        FU_WARN("swarm: cannot add %s: %s", mb->address, fu_last_error());
        return;
    }
    if (rt_swarm_set_span(&s->sw, id, mb->first, mb->last)) {
        FU_WARN("swarm: %s: bad span [%d, %d): %s", mb->address, mb->first, mb->last, fu_last_error());
        rt_swarm_remove_server(&s->sw, id);
        return;
    }
    /* links: loopback-class figures; the flow is then bounded by compute */
    rt_swarm_set_link(&s->sw, RT_SOURCE, id, 1e12, 1e-4);
    rt_swarm_set_link(&s->sw, id, RT_SINK, 1e12, 1e-4);
    for (int j = 0; j < s->sw.n_servers; j++)
        if (j != id && s->sw.servers[j].state != RT_SERVER_GONE) {
            rt_swarm_set_link(&s->sw, id, j, 1e12, 1e-4);
            rt_swarm_set_link(&s->sw, j, id, 1e12, 1e-4);
        }
    mb->id = id;
    mb->error[0] = '\0';
    FU_INFO("swarm: shard %s joined with blocks [%d, %d), %.1f tokens/s", mb->address, mb->first, mb->last,
            mb->tps);
    gw_swarm_changed_locked(s);
}

/* One Info call to member i (unlocked; the channel is fixed after creation). */
static int gw_member_info(gw_swarm *s, int i, Fusion__InfoReply **out, char *why, size_t why_len) {
    *out = NULL;
    Fusion__InfoRequest req = FUSION__INFO_REQUEST__INIT;
    ProtobufCMessage *rep = NULL;
    rpc_status st = {0};
    int code = rpc_call_unary(s->m[i].ch, RPC_SHARD_INFO, &req.base, &fusion__info_reply__descriptor, &rep,
                              GW_POLL_TIMEOUT_MS, &st);
    if (code) {
        snprintf(why, why_len, "Info: %s%s%.150s", rpc_code_str(code), st.message[0] ? ": " : "", st.message);
        return FU_ERR_NETWORK;
    }
    Fusion__InfoReply *r = (Fusion__InfoReply *)rep;
    if (r->n_layers != s->n_layers || r->first_block < 0 || r->last_block <= r->first_block ||
        r->last_block > s->n_layers) {
        snprintf(why, why_len, "Info: span [%d, %d) of %d blocks does not fit the model's %d", r->first_block,
                 r->last_block, r->n_layers, s->n_layers);
        rpc_msg_free(rep);
        return FU_ERR_FORMAT;
    }
    *out = r;
    return FU_OK;
}

/* Polls every member once and applies the results. */
static void gw_swarm_poll(gw_swarm *s) {
    for (int i = 0; i < s->n; i++) {
        double t0 = mono_s();
        Fusion__InfoReply *r = NULL;
        char why[200] = "";
        int rc = gw_member_info(s, i, &r, why, sizeof why);
        pthread_mutex_lock(&s->mu);
        gw_member *mb = &s->m[i];
        if (rc) {
            gw_member_retire_locked(s, i, why);
        } else if (mb->retired_at <= t0) { /* a failure reported during the poll wins */
            bool span_changed = mb->first != r->first_block || mb->last != r->last_block;
            bool tps_changed = mb->tps != r->tokens_per_s;
            mb->first = r->first_block;
            mb->last = r->last_block;
            mb->tps = r->tokens_per_s;
            mb->free_kv = r->free_kv_bytes;
            mb->total_kv = r->total_kv_bytes;
            mb->kv_per_pos = r->kv_bytes_per_position;
            mb->sessions = r->active_sessions;
            mb->last_ok = wall_s();
            if (mb->id >= 0 && (span_changed || tps_changed)) gw_member_retire_locked(s, i, "span or speed changed");
            if (mb->id < 0) gw_member_join_locked(s, i);
        }
        pthread_mutex_unlock(&s->mu);
        rpc_msg_free((ProtobufCMessage *)r);
    }
}

static void *gw_swarm_main(void *arg) {
    gw_swarm *s = arg;
    pthread_mutex_lock(&s->mu);
    while (!s->stopping) {
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        ts.tv_sec += GW_HEARTBEAT_MS / 1000;
        ts.tv_nsec += (long)(GW_HEARTBEAT_MS % 1000) * 1000000L;
        if (ts.tv_nsec >= 1000000000L) {
            ts.tv_sec++;
            ts.tv_nsec -= 1000000000L;
        }
        while (!s->stopping && pthread_cond_timedwait(&s->cv, &s->mu, &ts) == 0) {
        }
        if (s->stopping) break;
        pthread_mutex_unlock(&s->mu);
        gw_swarm_poll(s);
        pthread_mutex_lock(&s->mu);
    }
    pthread_mutex_unlock(&s->mu);
    return NULL;
}

int gw_swarm_new(const gw_config *cfg, int n_layers, gw_swarm **out) {
    *out = NULL;
    if (cfg->n_shards <= 0) return fu_errorf(FU_ERR_INVALID, "swarm: no shard addresses");
    if (n_layers <= 0) return fu_errorf(FU_ERR_INVALID, "swarm: the model has no blocks");
    gw_swarm *s = calloc(1, sizeof *s);
    if (!s) return fu_errorf(FU_ERR_NOMEM, "swarm");
    s->cfg = cfg;
    s->n_layers = n_layers;
    pthread_mutex_init(&s->mu, NULL);
    pthread_cond_init(&s->cv, NULL);
    rt_model model = {0};
    snprintf(model.name, sizeof model.name, "gateway");
    model.n_layers = n_layers;
    model.token_bytes = 2;
    model.act_bytes = 2;
    int rc = rt_swarm_init(&s->sw, &model);
    if (rc) {
        pthread_cond_destroy(&s->cv);
        pthread_mutex_destroy(&s->mu);
        free(s);
        return rc;
    }
    s->m = calloc((size_t)cfg->n_shards, sizeof *s->m);
    if (!s->m) {
        gw_swarm_free(s);
        return fu_errorf(FU_ERR_NOMEM, "swarm");
    }
    rpc_channel_options co = {cfg->tls_ca, cfg->insecure, cfg->secret, 0, NULL};
    for (int i = 0; i < cfg->n_shards; i++) {
        gw_member *mb = &s->m[i];
        mb->id = -1;
        snprintf(mb->address, sizeof mb->address, "%s", cfg->shards[i]);
        snprintf(mb->error, sizeof mb->error, "not polled yet");
        if ((rc = rpc_channel_new(mb->address, &co, &mb->ch))) {
            gw_swarm_free(s);
            return rc;
        }
        s->n++;
    }
    rt_route_opts ro = {0};
    if ((rc = rt_router_init(&s->router, &s->sw, &ro))) {
        gw_swarm_free(s);
        return rc;
    }
    gw_swarm_poll(s);
    if (pthread_create(&s->thread, NULL, gw_swarm_main, s)) {
        gw_swarm_free(s);
        return fu_errorf(FU_ERR_INTERNAL, "swarm: cannot start the heartbeat thread");
    }
    s->started = true;
    *out = s;
    return FU_OK;
}

void gw_swarm_free(gw_swarm *s) {
    if (!s) return;
    if (s->started) {
        pthread_mutex_lock(&s->mu);
        s->stopping = true;
        pthread_cond_broadcast(&s->cv);
        pthread_mutex_unlock(&s->mu);
        pthread_join(s->thread, NULL);
    }
    rt_router_free(s->router);
    rt_swarm_free(&s->sw);
    for (int i = 0; i < s->n; i++) rpc_channel_free(s->m[i].ch);
    free(s->m);
    pthread_cond_destroy(&s->cv);
    pthread_mutex_destroy(&s->mu);
    free(s);
}

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

int gw_swarm_route(gw_swarm *s, int request_len, gw_lease *l, gw_error *err) {
    memset(l, 0, sizeof *l);
    pthread_mutex_lock(&s->mu);
    rt_path *p = NULL;
    int rc = rt_route(s->router, request_len > 0 ? request_len : 1, &p);
    if (!rc && p->n_hops > GW_MAX_HOPS) {
        rt_release(p);
        p = NULL;
        rc = fu_errorf(FU_ERR_UNSUPPORTED, "the route has more than %d hops", GW_MAX_HOPS);
    }
    if (rc) {
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
    pthread_mutex_unlock(&s->mu);
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

/* Retires the member whose router id is `id`, if still current (locked). */
static void gw_swarm_retire_id_locked(gw_swarm *s, int id, const char *why) {
    for (int i = 0; i < s->n; i++)
        if (s->m[i].id == id) gw_member_retire_locked(s, i, why);
}

void gw_swarm_report_failure(gw_swarm *s, const gw_lease *l, const char *message) {
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
    if (named >= 0) {
        pthread_mutex_lock(&s->mu);
        gw_swarm_retire_id_locked(s, l->ids[named], why);
        pthread_mutex_unlock(&s->mu);
        return;
    }
    /* unnamed: probe each hop */
    for (int h = 0; h < l->n_hops; h++) {
        int mi = -1;
        pthread_mutex_lock(&s->mu);
        for (int i = 0; i < s->n; i++)
            if (s->m[i].id == l->ids[h]) mi = i;
        pthread_mutex_unlock(&s->mu);
        if (mi < 0) continue;
        Fusion__InfoReply *r = NULL;
        char pwhy[200];
        if (gw_member_info(s, mi, &r, pwhy, sizeof pwhy)) {
            pthread_mutex_lock(&s->mu);
            gw_swarm_retire_id_locked(s, l->ids[h], pwhy);
            pthread_mutex_unlock(&s->mu);
        }
        rpc_msg_free((ProtobufCMessage *)r);
    }
}

json_t *gw_swarm_json(gw_swarm *s) {
    json_t *servers = json_array();
    if (!servers) return NULL;
    pthread_mutex_lock(&s->mu);
    const rt_flow *f = rt_router_flow(s->router);
    double now = wall_s();
    for (int i = 0; i < s->n; i++) {
        const gw_member *mb = &s->m[i];
        int id = mb->id;
        const char *state = id >= 0 ? (s->sw.servers[id].state == RT_SERVER_SPARE ? "spare" : "active")
                                    : (mb->last_ok > 0 ? "gone" : "unreachable");
        double flow = id >= 0 && f && id < f->n ? f->server_flow[id] : 0;
        json_t *o = json_pack("{s:s, s:i, s:[i, i], s:s, s:f, s:I, s:I, s:i, s:f, s:f}", "address", mb->address,
                              "id", id, "span", mb->first, mb->last, "state", state, "tokens_per_s", mb->tps,
                              "free_kv_bytes", (json_int_t)mb->free_kv, "total_kv_bytes", (json_int_t)mb->total_kv,
                              "sessions", mb->sessions, "flow", flow, "load",
                              id >= 0 ? rt_router_load(s->router, id) : 0.0);
        if (!o) continue;
        json_object_set_new(o, "last_heartbeat", mb->last_ok > 0 ? json_real(mb->last_ok) : json_null());
        json_object_set_new(o, "heartbeat_age_s", mb->last_ok > 0 ? json_real(now - mb->last_ok) : json_null());
        json_object_set_new(o, "error", mb->error[0] ? json_string(mb->error) : json_null());
        json_array_append_new(servers, o);
    }
    int gap = -1;
    int uncovered = rt_swarm_uncovered(&s->sw, &gap);
    json_t *doc = json_pack("{s:s, s:i, s:f, s:i, s:i, s:o}", "object", "swarm", "n_layers", s->n_layers,
                            "max_flow", f ? f->value : 0.0, "uncovered_blocks", uncovered, "live",
                            rt_swarm_live(&s->sw), "servers", servers);
    pthread_mutex_unlock(&s->mu);
    return doc;
}
