/* gw-health.c -- readiness: the static chain's probe thread, the swarm's coverage, the servers' figures. */
#include "gw-health.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "clock.h"
#include "gw-swarm.h"
#include "rpc-base.h"
#include "shard-svc.h"
#include "status.h"

/* What the last probe of one static hop found. */
typedef struct gw_hop_health {
    rpc_channel *ch;
    const char *state;  /* "serving", "unreachable", "unauthorized", "wrong_span" */
    int64_t free_kv, total_kv;
    int sessions;
    double tps;
    int64_t pfx_blocks, pfx_hits, pfx_prompt; /* its prefix cache (InfoReply.prefix_*) */
} gw_hop_health;

struct gw_health {
    const gw_config *cfg;
    gw_swarm *swarm;           /* NULL: the static chain */
    gw_hop_health hops[GW_MAX_HOPS];
    pthread_t thread;
    bool started, stopping;    /* stopping under mu */
    pthread_mutex_t mu;        /* guards hops[]'s figures and stopping */
    pthread_cond_t cv;         /* the stop */
};

/* Probes hop i once (no lock held during the call) and records what it found. */
static void gw_health_probe(gw_health *h, int i) {
    const gw_hop_cfg *hc = &h->cfg->hops[i];
    shard_svc_info *info = NULL;
    rpc_status st;
    int code = h->hops[i].ch ? shard_svc_info_get(h->hops[i].ch, GW_HEALTH_INTERVAL_MS, &info, &st) : RPC_UNAVAILABLE;
    const char *state = code == RPC_OK                ? "serving"
                        : code == RPC_UNAUTHENTICATED ? "unauthorized"
                        : code == RPC_PERMISSION_DENIED ? "unauthorized"
                                                        : "unreachable";
    if (info && (info->first_block != hc->first || info->last_block != hc->last)) state = "wrong_span";
    pthread_mutex_lock(&h->mu);
    gw_hop_health *o = &h->hops[i];
    o->state = state;
    o->free_kv = info ? info->free_kv_bytes : 0, o->total_kv = info ? info->total_kv_bytes : 0;
    o->sessions = info ? info->active_sessions : 0, o->tps = info ? info->tokens_per_s : 0;
    o->pfx_blocks = info ? info->prefix_cached_blocks : 0, o->pfx_hits = info ? info->prefix_hit_tokens : 0;
    o->pfx_prompt = info ? info->prefix_prompt_tokens : 0;
    pthread_mutex_unlock(&h->mu);
    shard_svc_info_free(info);
}

static void *gw_health_main(void *arg) {
    gw_health *h = arg;
    pthread_mutex_lock(&h->mu);
    while (!h->stopping) {
        pthread_mutex_unlock(&h->mu);
        for (int i = 0; i < h->cfg->n_hops; i++) gw_health_probe(h, i);
        pthread_mutex_lock(&h->mu);
        struct timespec ts = fu_deadline_us(CLOCK_REALTIME, GW_HEALTH_INTERVAL_MS * 1000LL);
        if (!h->stopping) pthread_cond_timedwait(&h->cv, &h->mu, &ts);
    }
    pthread_mutex_unlock(&h->mu);
    return NULL;
}

/* A channel to every static hop (a hop whose channel cannot be made counts as unreachable). */
static void gw_health_channels(gw_health *h) {
    const gw_config *cfg = h->cfg;
    for (int i = 0; i < cfg->n_hops; i++) {
        h->hops[i].state = "unreachable";
        if (gw_channel_new(cfg, cfg->hops[i].address, &h->hops[i].ch)) h->hops[i].ch = NULL;
    }
}

int gw_health_new(const gw_config *cfg, gw_swarm *swarm, gw_health **out) {
    *out = NULL;
    gw_health *h = calloc(1, sizeof *h);
    if (!h) return fu_errorf(FU_ERR_NOMEM, "health");
    h->cfg = cfg, h->swarm = swarm;
    pthread_mutex_init(&h->mu, NULL);
    pthread_cond_init(&h->cv, NULL);
    if (!swarm && cfg->n_hops > 0) {
        gw_health_channels(h);
        for (int i = 0; i < cfg->n_hops; i++) gw_health_probe(h, i);
        if (!(h->started = !pthread_create(&h->thread, NULL, gw_health_main, h))) {
            gw_health_free(h);
            return fu_errorf(FU_ERR_INTERNAL, "cannot start the health probes");
        }
    }
    *out = h;
    return FU_OK;
}

void gw_health_free(gw_health *h) {
    if (!h) return;
    pthread_mutex_lock(&h->mu);
    h->stopping = true;
    pthread_cond_broadcast(&h->cv);
    pthread_mutex_unlock(&h->mu);
    if (h->started) pthread_join(h->thread, NULL);
    for (int i = 0; i < GW_MAX_HOPS; i++) rpc_channel_free(h->hops[i].ch);
    pthread_cond_destroy(&h->cv);
    pthread_mutex_destroy(&h->mu);
    free(h);
}

/* The swarm's readiness: every block covered by a live member. */
static bool gw_health_swarm_ready(gw_health *h, char *reason, size_t cap) {
    int n_layers = 0, uncovered = gw_swarm_uncovered(h->swarm, &n_layers);
    bool ready = uncovered == 0 && n_layers > 0;
    if (!ready) snprintf(reason, cap, "no live server covers %d of the model's %d blocks", uncovered, n_layers);
    return ready;
}

bool gw_health_ready(gw_health *h, char *reason, size_t cap) {
    if (h->swarm) return gw_health_swarm_ready(h, reason, cap);
    if (h->cfg->n_hops == 0) return snprintf(reason, cap, "no chain is configured"), false;
    bool ready = true;
    pthread_mutex_lock(&h->mu);
    for (int i = 0; i < h->cfg->n_hops && ready; i++) {
        if (!strcmp(h->hops[i].state, "serving")) continue;
        ready = false;
        snprintf(reason, cap, "the server of blocks [%d, %d) is %s%s", h->cfg->hops[i].first,
                 h->cfg->hops[i].last, h->hops[i].state,
                 !strcmp(h->hops[i].state, "unauthorized") ? " (it refuses the swarm secret)" : "");
    }
    pthread_mutex_unlock(&h->mu);
    return ready;
}

/* One server of the swarm's document in this module's shape. */
static json_t *gw_health_member(const json_t *m) {
    const json_t *span = json_object_get(m, "span");
    return json_pack("{s:O, s:I, s:I, s:O, s:O, s:O, s:O, s:O}", "address", json_object_get(m, "address"),
                     "first", json_is_array(span) ? json_integer_value(json_array_get(span, 0)) : 0,
                     "last", json_is_array(span) ? json_integer_value(json_array_get(span, 1)) : 0,
                     "state", json_object_get(m, "state"), "free_kv_bytes", json_object_get(m, "free_kv_bytes"),
                     "total_kv_bytes", json_object_get(m, "total_kv_bytes"), "sessions",
                     json_object_get(m, "sessions"), "tokens_per_s", json_object_get(m, "tokens_per_s"));
}

json_t *gw_health_servers(gw_health *h) {
    json_t *out = json_array();
    if (h->swarm) {
        json_t *doc = gw_swarm_json(h->swarm), *m;
        size_t i;
        json_array_foreach(json_object_get(doc, "servers"), i, m) json_array_append_new(out, gw_health_member(m));
        json_decref(doc);
        return out;
    }
    pthread_mutex_lock(&h->mu);
    for (int i = 0; i < h->cfg->n_hops && out; i++) {
        const gw_hop_health *o = &h->hops[i];
        json_t *srv = json_pack("{s:s, s:i, s:i, s:s, s:I, s:I, s:i, s:f}", "address", h->cfg->hops[i].address,
                                "first", h->cfg->hops[i].first, "last", h->cfg->hops[i].last, "state", o->state,
                                "free_kv_bytes", (json_int_t)o->free_kv, "total_kv_bytes", (json_int_t)o->total_kv,
                                "sessions", o->sessions, "tokens_per_s", o->tps);
        if (srv && json_object_update_new(srv, json_pack("{s:I, s:I, s:I}", "prefix_cached_blocks",
                                                         (json_int_t)o->pfx_blocks, "prefix_hit_tokens",
                                                         (json_int_t)o->pfx_hits, "prefix_prompt_tokens",
                                                         (json_int_t)o->pfx_prompt)))
            json_object_clear(srv);
        json_array_append_new(out, srv);
    }
    pthread_mutex_unlock(&h->mu);
    return out;
}

/* A Prometheus label value: backslash, quote and newline escaped. */
static int gw_label(fu_buf *out, const char *v) {
    int rc = FU_OK;
    for (; v && *v && !rc; v++)
        rc = *v == '\\' ? fu_buf_appendf(out, "\\\\")
             : *v == '"'  ? fu_buf_appendf(out, "\\\"")
             : *v == '\n' ? fu_buf_appendf(out, "\\n")
                          : fu_buf_append(out, v, 1);
    return rc;
}

/* One gauge line of server o: NAME{shard,first,last,state} value. */
static int gw_server_gauge(fu_buf *out, const char *name, const json_t *o, double value) {
    int rc = fu_buf_appendf(out, "%s{shard=\"", name);
    if (!rc) rc = gw_label(out, json_string_value(json_object_get(o, "address")));
    if (!rc) rc = fu_buf_appendf(out, "\",first=\"%lld\",last=\"%lld\",state=\"",
                                 (long long)json_integer_value(json_object_get(o, "first")),
                                 (long long)json_integer_value(json_object_get(o, "last")));
    if (!rc) rc = gw_label(out, json_string_value(json_object_get(o, "state")));
    return rc ? rc : fu_buf_appendf(out, "\"} %.17g\n", value);
}

/* Whether a server in state `state` serves its span. */
static bool gw_state_up(const char *state) {
    return state && (!strcmp(state, "serving") || !strcmp(state, "active") || !strcmp(state, "moving"));
}

int gw_health_render(gw_health *h, fu_buf *out) {
    static const struct { const char *name, *help, *key; } g[] = {
        {"fusion_shard_up", "1 when the server serves its span.", NULL},
        {"fusion_shard_kv_free_bytes", "KV-cache bytes the server has free.", "free_kv_bytes"},
        {"fusion_shard_kv_total_bytes", "KV-cache bytes of the server's budget.", "total_kv_bytes"},
        {"fusion_shard_sessions", "Sessions open on the server.", "sessions"},
        {"fusion_shard_tokens_per_second", "The server's measured tokens/s for its span.", "tokens_per_s"},
        {"fusion_shard_prefix_cached_blocks", "KV blocks in the server's prefix cache.", "prefix_cached_blocks"},
        {"fusion_shard_prefix_hit_tokens", "Prompt positions the server took from its prefix cache since it started.",
         "prefix_hit_tokens"},
        {"fusion_shard_prefix_prompt_tokens", "Prompt positions of the server's sessions since it started.",
         "prefix_prompt_tokens"},
    };
    char reason[256];
    json_t *servers = gw_health_servers(h), *o;
    int rc = servers ? fu_buf_appendf(out, "# HELP fusion_gateway_ready 1 when a full chain can serve.\n"
                                           "# TYPE fusion_gateway_ready gauge\nfusion_gateway_ready %d\n",
                                      gw_health_ready(h, reason, sizeof reason))
                     : FU_ERR_NOMEM;
    for (size_t k = 0; k < sizeof g / sizeof g[0] && !rc; k++) {
        rc = fu_buf_appendf(out, "# HELP %s %s\n# TYPE %s gauge\n", g[k].name, g[k].help, g[k].name);
        size_t i;
        json_array_foreach(servers, i, o) {
            const json_t *v = g[k].key ? json_object_get(o, g[k].key) : NULL;
            double x = g[k].key ? json_number_value(v) : gw_state_up(json_string_value(json_object_get(o, "state")));
            if (!rc) rc = gw_server_gauge(out, g[k].name, o, x);
        }
    }
    double blocks = 0;
    size_t i;
    json_array_foreach(servers, i, o) blocks += json_number_value(json_object_get(o, "prefix_cached_blocks"));
    if (!rc)
        rc = fu_buf_appendf(out, "# HELP fusion_prefix_cached_blocks KV blocks in the servers' prefix caches.\n"
                                 "# TYPE fusion_prefix_cached_blocks gauge\nfusion_prefix_cached_blocks %.0f\n", blocks);
    json_decref(servers);
    return rc ? fu_errorf(FU_ERR_NOMEM, "metrics") : FU_OK;
}
