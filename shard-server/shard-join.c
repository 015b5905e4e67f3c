/* shard-join.c -- the shard side of fusion.Swarm: join the gateway, heartbeat, load assigned spans, measure peers. */
#include "shard-join.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "clock.h"
#include "log.h"
#include "rpc-base.h"
#include "shard-svc.h"
#include "status.h"
#include "swarm-svc.h"

#define JOIN_DEFAULT_INTERVAL_MS 500
#define JOIN_CALL_TIMEOUT_MS 2000
#define JOIN_PEER_TIMEOUT_MS 500
#define JOIN_MAX_PEERS 32
#define JOIN_PEER_REFRESH_S 5.0
#define JOIN_BW_BYTES (256 << 10)

typedef struct join_peer {
    char address[128];
    rpc_channel *ch;
    double rtt_s, bw;  /* 0: not measured (yet) */
    double measured_at; /* monotonic seconds; 0: never */
    bool named;         /* in the gateway's latest list */
} join_peer;

struct shard_join {
    shard_join_config cfg;
    rpc_channel *gw;
    rpc_channel_options peer_opts;
    pthread_t thread;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    bool stopping;
    uint64_t member_id; /* 0: not joined */
    double warned_at;   /* monotonic seconds of the last warning about the gateway; 0: none since success */
    int interval_ms;
    join_peer peers[JOIN_MAX_PEERS];
    int n_peers;
    int fail_first, fail_last; /* the last assignment that failed to load; equal: none */
    char load_error[200];
    /* the loader thread: an assignment loads beside the heartbeats, which go on reporting the span served
     * (a load can take longer than the gateway waits between heartbeats) */
    pthread_t loader;
    bool loading;                 /* a loader thread was started and not yet joined */
    bool loaded;                  /* it has finished (under mu): load_rc, load_msg hold the result */
    int load_first, load_last;
    int load_rc;
    char load_msg[200];
};

/* The member status as reported; strings point into *st, cfg and j (valid while they are), the
 * measured peer links into links[0..JOIN_MAX_PEERS). */
static void fill_status(shard_join *j, shard_join_status *st, swarm_svc_member *ms, swarm_svc_link *links) {
    memset(st, 0, sizeof *st);
    j->cfg.status(j->cfg.ctx, st);
    *ms = (swarm_svc_member){
        .address = j->cfg.address,
        .model_name = j->cfg.model_name ? j->cfg.model_name : "",
        .n_layers = j->cfg.n_layers,
        .first_block = st->first,
        .last_block = st->last,
        .device = j->cfg.device ? j->cfg.device : "cpu",
        .dtype = st->dtype,
        .tokens_per_s = st->tokens_per_s,
        .block_tokens_per_s = j->cfg.block_tokens_per_s,
        .max_blocks = j->cfg.max_blocks,
        .free_kv_bytes = st->free_kv_bytes,
        .total_kv_bytes = st->total_kv_bytes,
        .kv_bytes_per_position = st->kv_bytes_per_position,
        .active_sessions = st->active_sessions,
        .fixed_span = j->cfg.fixed_span,
        .draining_first = st->draining_first,
        .draining_last = st->draining_last,
        .draining_sessions = st->draining_sessions,
        .hidden_size = j->cfg.hidden_size,
        .prompt_steps = j->cfg.prompt_steps,
        .decode_steps = j->cfg.decode_steps,
    };
    if (j->fail_last > j->fail_first) {
        ms->failed_first = j->fail_first;
        ms->failed_last = j->fail_last;
        ms->load_error = j->load_error;
    }
    size_t n = 0;
    for (int i = 0; i < j->n_peers; i++) {
        const join_peer *p = &j->peers[i];
        if (!p->named || p->bw <= 0) continue;
        links[n++] = (swarm_svc_link){p->address, p->rtt_s, p->bw};
    }
    ms->n_links = n;
    ms->links = n ? links : NULL;
}

/* Measures the named peer whose figures are the oldest, if older than the refresh interval (one per
 * round, so that a dead peer cannot delay the heartbeats much). */
static void measure_peers(shard_join *j) {
    double now = fu_now_s();
    int oldest = -1;
    for (int i = 0; i < j->n_peers; i++) {
        join_peer *p = &j->peers[i];
        if (p->named && (p->measured_at <= 0 || now - p->measured_at >= JOIN_PEER_REFRESH_S) &&
            (oldest < 0 || p->measured_at < j->peers[oldest].measured_at))
            oldest = i;
    }
    if (oldest < 0) return;
    join_peer *p = &j->peers[oldest];
    p->measured_at = now;
    p->rtt_s = p->bw = 0;
    if (!p->ch && rpc_channel_new(p->address, &j->peer_opts, &p->ch)) {
        FU_DEBUG("join: no channel to peer %s: %s", p->address, fu_last_error());
        return;
    }
    shard_svc_measure_link(p->ch, JOIN_BW_BYTES, JOIN_PEER_TIMEOUT_MS, &p->rtt_s, &p->bw, NULL);
}

/* Takes the gateway's list of peers (the shard's own address excluded). */
static void set_peers(shard_join *j, const swarm_svc_heartbeat_reply *r) {
    for (int i = 0; i < j->n_peers; i++) j->peers[i].named = false;
    for (int k = 0; k < r->n_peers; k++) {
        const char *a = r->peers[k];
        if (!a || !a[0] || strlen(a) >= sizeof j->peers[0].address || !strcmp(a, j->cfg.address)) continue;
        int i = 0;
        while (i < j->n_peers && strcmp(j->peers[i].address, a)) i++;
        if (i == j->n_peers) {
            /* reuse an unnamed slot when full */
            if (j->n_peers == JOIN_MAX_PEERS) {
                for (i = 0; i < j->n_peers && j->peers[i].named; i++) {
                }
                if (i == j->n_peers) continue;
                rpc_channel_free(j->peers[i].ch);
            } else {
                j->n_peers++;
            }
            memset(&j->peers[i], 0, sizeof j->peers[i]);
            snprintf(j->peers[i].address, sizeof j->peers[i].address, "%s", a);
        }
        j->peers[i].named = true;
    }
}

static void *join_loader(void *arg) {
    shard_join *j = arg;
    int rc = j->cfg.load(j->cfg.ctx, j->load_first, j->load_last);
    pthread_mutex_lock(&j->mu);
    j->load_rc = rc;
    if (rc) snprintf(j->load_msg, sizeof j->load_msg, "%s: %s", fu_status_str(rc), fu_last_error());
    j->loaded = true;
    pthread_cond_broadcast(&j->cv); /* the result goes to the gateway at once */
    pthread_mutex_unlock(&j->mu);
    return NULL;
}

/* Keeps the result of the load that ended for the next heartbeat. */
static void load_report(shard_join *j) {
    j->loading = j->loaded = false;
    if (j->load_rc) {
        j->fail_first = j->load_first;
        j->fail_last = j->load_last;
        snprintf(j->load_error, sizeof j->load_error, "%s", j->load_msg);
        FU_WARN("join: loading [%d, %d) failed: %s", j->load_first, j->load_last, j->load_error);
    } else {
        j->fail_first = j->fail_last = 0;
        j->load_error[0] = '\0';
    }
}

/* Takes the result of a finished load (joining its thread); true if there was one. */
static bool load_finished(shard_join *j) {
    pthread_mutex_lock(&j->mu);
    bool done = j->loading && j->loaded;
    pthread_mutex_unlock(&j->mu);
    if (!done) return false;
    pthread_join(j->loader, NULL);
    load_report(j);
    return true;
}

/* Starts loading an assigned span unless it is served already, it failed already, the span is fixed
 * or a load is under way. Returns true if the next heartbeat should follow at once (a load finished). */
static bool maybe_load(shard_join *j, bool has_span, int first, int last) {
    if (load_finished(j)) return true;
    if (!has_span || j->cfg.fixed_span || j->loading) return false;
    shard_join_status st;
    memset(&st, 0, sizeof st);
    j->cfg.status(j->cfg.ctx, &st);
    if (st.first == first && st.last == last) return false;
    if (j->fail_first == first && j->fail_last == last) return false; /* reported; the gateway withdraws it */
    if (first < 0 || last <= first || last > j->cfg.n_layers) {
        FU_WARN("join: ignoring the invalid assignment [%d, %d)", first, last);
        return false;
    }
    if (st.last > st.first)
        FU_INFO("join: the gateway moves this server from blocks [%d, %d) to [%d, %d): loading", st.first, st.last,
                first, last);
    else
        FU_INFO("join: the gateway assigns blocks [%d, %d): loading", first, last);
    j->load_first = first;
    j->load_last = last;
    j->loaded = false;
    j->loading = true;
    if (pthread_create(&j->loader, NULL, join_loader, j)) { /* no thread: load here */
        join_loader(j);
        load_report(j);
        return true;
    }
    return false;
}

/* Warns about a failed call to the gateway: the first failure, then every 10 s while it lasts. */
static void gateway_warn(shard_join *j, const char *method, int code, const rpc_status *rs) {
    double now = fu_now_s();
    if (j->warned_at > 0 && now - j->warned_at < 10) return;
    j->warned_at = now;
    FU_WARN("join: gateway %s: %s: %s%s%s", j->cfg.gateway, method, rpc_code_str(code), rs->message[0] ? ": " : "",
            rs->message);
}

/* Joins the gateway's swarm with status ms; returns true if the next heartbeat should follow at once. */
static bool join_once(shard_join *j, const shard_join_status *st, const swarm_svc_member *ms) {
    rpc_status rs = {0};
    swarm_svc_join_reply r;
    int code = swarm_svc_join(j->gw, ms, JOIN_CALL_TIMEOUT_MS, &r, &rs);
    if (code == RPC_UNAUTHENTICATED && j->cfg.refused) {
        j->cfg.refused(j->cfg.ctx, "the gateway refused this server's swarm secret: start it with the gateway's "
                                   "secret (--secret, --secret-file or FUSION_SECRET)");
        return false;
    }
    if (code) {
        gateway_warn(j, "Join", code, &rs);
        return false;
    }
    j->warned_at = 0;
    j->member_id = r.member_id;
    if (r.heartbeat_ms >= 50 && r.heartbeat_ms <= 60000) j->interval_ms = r.heartbeat_ms;
    FU_INFO("join: joined gateway %s as member %llu%s", j->cfg.gateway, (unsigned long long)r.member_id,
            r.has_span || st->last > st->first ? "" : " (a spare)");
    return maybe_load(j, r.has_span, r.first_block, r.last_block);
}

/* One Join or Heartbeat exchange; returns true if the next one should follow at once. */
static bool join_round(shard_join *j, bool leaving) {
    shard_join_status st;
    swarm_svc_member ms;
    swarm_svc_link links[JOIN_MAX_PEERS];
    fill_status(j, &st, &ms, links);
    if (!j->member_id) return leaving ? false : join_once(j, &st, &ms);
    rpc_status rs = {0};
    swarm_svc_heartbeat_request req = {j->member_id, &ms, leaving};
    swarm_svc_heartbeat_reply r;
    int code = swarm_svc_heartbeat(j->gw, &req, JOIN_CALL_TIMEOUT_MS, &r, &rs);
    if (code == RPC_NOT_FOUND) {
        FU_WARN("join: the gateway no longer knows member %llu: joining again", (unsigned long long)j->member_id);
        j->member_id = 0;
        return !leaving;
    }
    if (code) {
        gateway_warn(j, "Heartbeat", code, &rs);
        return false;
    }
    j->warned_at = 0;
    bool loaded = !leaving && maybe_load(j, r.has_span, r.first_block, r.last_block);
    if (!leaving) set_peers(j, &r);
    return loaded;
}

static void *join_main(void *arg) {
    shard_join *j = arg;
    pthread_mutex_lock(&j->mu);
    while (!j->stopping) {
        pthread_mutex_unlock(&j->mu);
        bool again = join_round(j, false);
        if (!again) measure_peers(j);
        pthread_mutex_lock(&j->mu);
        if (again) continue;
        struct timespec ts = fu_deadline_us(CLOCK_REALTIME, (int64_t)j->interval_ms * 1000);
        while (!j->stopping && !(j->loading && j->loaded) && pthread_cond_timedwait(&j->cv, &j->mu, &ts) == 0) {
        }
    }
    pthread_mutex_unlock(&j->mu);
    if (j->loading) pthread_join(j->loader, NULL); /* a load cannot be cut short */
    join_round(j, true);
    return NULL;
}

int shard_join_start(const shard_join_config *cfg, shard_join **out) {
    *out = NULL;
    if (!cfg->gateway || !cfg->address || !cfg->load || !cfg->status || cfg->n_layers <= 0)
        return fu_errorf(FU_ERR_INVALID, "join: incomplete configuration");
    shard_join *j = calloc(1, sizeof *j);
    if (!j) return fu_errorf(FU_ERR_NOMEM, "join");
    j->cfg = *cfg;
    j->interval_ms = JOIN_DEFAULT_INTERVAL_MS;
    j->peer_opts = (rpc_channel_options){.tls_ca = cfg->tls_ca, .insecure = cfg->insecure, .secret = cfg->secret,
                                         .tls_client_cert = cfg->tls_client_cert,
                                         .tls_client_key = cfg->tls_client_key};
    int rc = rpc_channel_new(cfg->gateway, &j->peer_opts, &j->gw);
    if (rc) {
        free(j);
        return rc;
    }
    pthread_mutex_init(&j->mu, NULL);
    pthread_cond_init(&j->cv, NULL);
    if (pthread_create(&j->thread, NULL, join_main, j)) {
        rpc_channel_free(j->gw);
        pthread_cond_destroy(&j->cv);
        pthread_mutex_destroy(&j->mu);
        free(j);
        return fu_errorf(FU_ERR_INTERNAL, "join: cannot start the membership thread");
    }
    *out = j;
    return FU_OK;
}

void shard_join_stop(shard_join *j) {
    if (!j) return;
    pthread_mutex_lock(&j->mu);
    j->stopping = true;
    pthread_cond_broadcast(&j->cv);
    pthread_mutex_unlock(&j->mu);
    pthread_join(j->thread, NULL);
    for (int i = 0; i < j->n_peers; i++) rpc_channel_free(j->peers[i].ch);
    rpc_channel_free(j->gw);
    pthread_cond_destroy(&j->cv);
    pthread_mutex_destroy(&j->mu);
    free(j);
}
