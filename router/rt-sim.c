/* rt-sim.c -- discrete-event simulator of serving: continuous batching on each server by its
 * step-time profile, links and NICs as FIFO pipes with latency, KV-bounded admission, routing
 * by the gateway's IWRR (rt_route). The model is documented at rt_sim_run in router.h. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "grow.h"
#include "router-impl.h"
#include "status.h"

enum { EV_NEW = 0, EV_ARRIVE = 1, EV_BATCH = 2 };

/* Most events one run processes (about a minute here): a bound on runs that cannot end. */
#define SIM_MAX_EVENTS 400000000L

typedef struct sim_event {
    double t;
    uint64_t seq;
    int kind;
    int a, b; /* EV_NEW: trace index or -1; EV_ARRIVE: request, hop; EV_BATCH: server */
} sim_event;

typedef struct sim_req {
    rt_path *path;               /* the router's, or the simulator's own under Swarm's routing */
    double arrival, step_start, sent_at; /* sent_at: when it left its last node */
    int prompt_len, output_len, step, w, ctx;
    int next_free;
} sim_req;

typedef struct item {
    int req, hop;
} item;

typedef struct items {
    item *v;
    int n;
    size_t cap;
} items;

typedef struct srv_state {
    items queue; /* steps waiting, in arrival order */
    items batch; /* the batch running */
    int busy;
} srv_state;

typedef struct link_slot {
    int64_t key; /* -1: empty */
    double free_at;
} link_slot;

typedef struct samples {
    double *v;
    long n;
    size_t cap;
} samples;

typedef struct sim {
    const rt_swarm *sw; /* the caller's swarm */
    rt_swarm kv;        /* a copy with KV capacities scaled by kv_hwm (the router's view) */
    rt_router *router;
    rt__swroute *swr; /* Swarm's routing (RT_SIM_ROUTE_SWARM), else NULL */
    const rt_sim_opts *o;
    rt_sim_result *res;
    sim_event *heap;
    int nh;
    size_t caph;
    uint64_t seq, rng;
    sim_req *req;
    int nreq, capreq, free_head;
    items wait; /* requests waiting for KV room (hop unused) */
    srv_state *srv;
    double *nic_out_free, *nic_in_free; /* [n + 2]: servers, then source, sink */
    link_slot *links;
    int nlinks_cap, nlinks_used;
    double *layer_used, *layer_cap; /* expected KV tokens per block (RT_FEED_KV) */
    samples ttft, tpot;
    double t0, t1, last_t, in_flight_area, hops_sum;
    int in_flight;
    long admitted;
    int prompt_len, output_len;
    double host_s_per_byte;
} sim;

static int items_push(items *q, int req, int hop) {
    if (fu_grow((void **)&q->v, &q->cap, (size_t)q->n + 1, sizeof *q->v))
        return fu_errorf(FU_ERR_NOMEM, "sim: out of memory");
    q->v[q->n++] = (item){req, hop};
    return FU_OK;
}

static int sample_add(samples *s, double v) {
    if (fu_grow((void **)&s->v, &s->cap, (size_t)s->n + 1, sizeof *s->v))
        return fu_errorf(FU_ERR_NOMEM, "sim: out of memory");
    s->v[s->n++] = v;
    return FU_OK;
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static double pct(const samples *s, double q) {
    if (s->n == 0) return 0;
    long i = (long)ceil(q * (double)s->n) - 1;
    return s->v[i < 0 ? 0 : (i >= s->n ? s->n - 1 : i)];
}

/* --- events ------------------------------------------------------------------------------- */

static int ev_before(const sim_event *x, const sim_event *y) {
    return x->t < y->t || (x->t == y->t && x->seq < y->seq);
}

static int heap_push(sim *s, double t, int kind, int a, int b) {
    if (fu_grow((void **)&s->heap, &s->caph, (size_t)s->nh + 1, sizeof *s->heap))
        return fu_errorf(FU_ERR_NOMEM, "sim: out of memory");
    sim_event e = {t, s->seq++, kind, a, b};
    int i = s->nh++;
    while (i > 0 && ev_before(&e, &s->heap[(i - 1) / 2])) {
        s->heap[i] = s->heap[(i - 1) / 2];
        i = (i - 1) / 2;
    }
    s->heap[i] = e;
    return FU_OK;
}

static sim_event heap_pop(sim *s) {
    sim_event top = s->heap[0], last = s->heap[--s->nh];
    int i = 0;
    for (;;) {
        int c = 2 * i + 1;
        if (c >= s->nh) break;
        if (c + 1 < s->nh && ev_before(&s->heap[c + 1], &s->heap[c])) c++;
        if (!ev_before(&s->heap[c], &last)) break;
        s->heap[i] = s->heap[c];
        i = c;
    }
    s->heap[i] = last;
    return top;
}

/* --- links and NICs ------------------------------------------------------------------------ */

static int nic_index(const sim *s, int v) {
    return v >= 0 ? v : (v == RT_SOURCE ? s->sw->n_servers : s->sw->n_servers + 1);
}

static int link_find(const link_slot *t, int cap, int64_t key) {
    int i = (int)(((uint64_t)key * 0x9E3779B97F4A7C15ULL) >> 40) & (cap - 1);
    while (t[i].key >= 0 && t[i].key != key) i = (i + 1) & (cap - 1);
    return i;
}

static int links_grow(sim *s) {
    int c = s->nlinks_cap ? s->nlinks_cap * 2 : 64;
    link_slot *nl = malloc((size_t)c * sizeof *nl);
    if (!nl) return fu_errorf(FU_ERR_NOMEM, "sim: out of memory");
    for (int i = 0; i < c; i++) nl[i].key = -1;
    for (int i = 0; i < s->nlinks_cap; i++)
        if (s->links[i].key >= 0) nl[link_find(nl, c, s->links[i].key)] = s->links[i];
    free(s->links);
    s->links = nl;
    s->nlinks_cap = c;
    return FU_OK;
}

/* When the directed link from -> to is next free (a slot of an open-addressing table). */
static double *link_free_at(sim *s, int from, int to) {
    int64_t key = (int64_t)nic_index(s, from) * (s->sw->n_servers + 2) + nic_index(s, to);
    if (2 * (s->nlinks_used + 1) > s->nlinks_cap && links_grow(s)) return NULL;
    int i = link_find(s->links, s->nlinks_cap, key);
    if (s->links[i].key < 0) {
        s->links[i] = (link_slot){key, 0};
        s->nlinks_used++;
    }
    return &s->links[i].free_at;
}

/* Passes `bytes` through one FIFO stage serving `rate` bytes/s (no limit when rate <= 0) that
 * is next free at *free: returns when they are through, and moves *free there. */
static double stage(double *free, double now, double bytes, double rate) {
    double end = fmax(now, *free) + (rate > 0 ? bytes / rate : 0);
    *free = end;
    return end;
}

/* Sends w tokens from -> to at `now`; *arrive is when they are there. The link, the sender's
 * outbound NIC and the receiver's inbound NIC each pass the bytes in FIFO order at their own rate,
 * so a NIC is shared by its links (a slow link does not hold it for the others); the transfer
 * ends when the slowest of the three has passed it, and arrives one latency later. */
static int transfer(sim *s, int from, int to, int w, double now, double *arrive) {
    const rt_swarm *sw = s->sw;
    double bytes = w * ((from == RT_SOURCE || to == RT_SINK) ? sw->model.token_bytes
                                                              : sw->model.token_bytes + sw->model.act_bytes);
    rt_link l = rt_swarm_link(sw, from, to);
    double nout = from >= 0 ? sw->servers[from].nic_out : sw->source_nic_out;
    double nin = to >= 0 ? sw->servers[to].nic_in : sw->sink_nic_in;
    double *lf = link_free_at(s, from, to);
    if (!lf) return fu_errorf(FU_ERR_NOMEM, "sim: out of memory");
    double end = stage(lf, now, bytes, l.bandwidth);
    end = fmax(end, stage(&s->nic_out_free[nic_index(s, from)], now, bytes, nout));
    end = fmax(end, stage(&s->nic_in_free[nic_index(s, to)], now, bytes, nin));
    *arrive = end + l.latency;
    return FU_OK;
}

/* --- KV expectation per block (Helix's offline feeder) --------------------------------------- */

static void kv_account(sim *s, const rt_path *p, double sign) {
    for (int h = 0; h < p->n_hops; h++) {
        const rt_server *v = &s->sw->servers[p->servers[h]];
        int k = v->last - v->first, j = p->last[h] - p->first[h];
        if (k <= 0 || rt_swarm_kv_tokens(s->sw, p->servers[h], k) <= 0) continue;
        double per = sign * p->request_len * (double)j / k;
        for (int l = v->first; l < v->last; l++) s->layer_used[l] += per;
    }
}

static double kv_bottleneck(const sim *s) {
    double worst = 0;
    for (int l = 0; l < s->sw->model.n_layers; l++)
        if (s->layer_cap[l] > 0 && s->layer_used[l] / s->layer_cap[l] > worst) worst = s->layer_used[l] / s->layer_cap[l];
    return worst;
}

static void kv_init(sim *s) {
    for (int i = 0; i < s->sw->n_servers; i++) {
        if (!rt_swarm_serving(s->sw, i)) continue;
        const rt_server *v = &s->sw->servers[i];
        double cap = rt_swarm_kv_tokens(s->sw, i, v->last - v->first);
        for (int l = v->first; l < v->last && cap > 0; l++) s->layer_cap[l] += cap;
    }
}

/* --- requests ------------------------------------------------------------------------------ */

static void track_in_flight(sim *s, double now, int delta) {
    double a = fmax(s->last_t, s->t0), b = fmin(now, s->t1);
    if (b > a) s->in_flight_area += s->in_flight * (b - a);
    s->last_t = now;
    s->in_flight += delta;
}

static int req_new(sim *s, double now, int prompt_len, int output_len) {
    if (s->free_head < 0) {
        if (s->nreq == s->capreq) {
            int c = s->capreq ? s->capreq * 2 : 256;
            sim_req *r = realloc(s->req, (size_t)c * sizeof *r);
            if (!r) return fu_errorf(FU_ERR_NOMEM, "sim: out of memory");
            s->req = r;
            s->capreq = c;
        }
        s->req[s->nreq].next_free = -1;
        s->free_head = s->nreq++;
    }
    int id = s->free_head;
    sim_req *r = &s->req[id];
    s->free_head = r->next_free;
    memset(r, 0, sizeof *r);
    r->arrival = now;
    r->prompt_len = prompt_len > 0 ? prompt_len : 1;
    r->output_len = output_len > 0 ? output_len : 0;
    return id;
}

static void req_free(sim *s, int id) {
    s->req[id].next_free = s->free_head;
    s->free_head = id;
}

/* --- Swarm's routing: paths grow a hop at a time during the prompt ---------------------------- */

/* An empty path the simulator owns, room for a hop per block. */
static rt_path *own_path(const sim *s) {
    int L = s->sw->model.n_layers;
    rt_path *p = calloc(1, sizeof *p + 3 * (size_t)L * sizeof(int));
    if (!p) return NULL;
    p->servers = (int *)(p + 1), p->first = p->servers + L, p->last = p->first + L;
    return p;
}

static void release_path(sim *s, sim_req *r) {
    if (r->path && s->swr) free(r->path);
    else if (r->path) rt_release(r->path);
    r->path = NULL;
}

/* Appends the hop Swarm's routing picks after `from` (RT_SOURCE or the path's last server). */
static int grow_path(sim *s, rt_path *p, int from) {
    int v = rt__swroute_next(s->swr, from), start = from == RT_SOURCE ? 0 : s->sw->servers[from].last;
    if (v < 0 || p->n_hops >= s->sw->model.n_layers)
        return fu_errorf(FU_ERR_NOT_FOUND, "sim: no server goes on from block %d", start);
    p->servers[p->n_hops] = v, p->first[p->n_hops] = start, p->last[p->n_hops] = s->sw->servers[v].last;
    p->n_hops++;
    return FU_OK;
}

static int start_step(sim *s, int id, double now) {
    sim_req *r = &s->req[id];
    r->step_start = r->sent_at = now;
    r->w = r->step == 0 ? r->prompt_len : 1;
    int rc = s->swr && r->step == 0 ? grow_path(s, r->path, RT_SOURCE) : FU_OK;
    if (!rc && !s->swr && r->step > 0) rc = rt_path_step(r->path, r->w);
    double at;
    if (!rc) rc = transfer(s, RT_SOURCE, r->path->servers[0], r->w, now, &at);
    return rc ? rc : heap_push(s, at, EV_ARRIVE, id, 0);
}

/* Routes request id: 1 started, 0 queued or rejected, 2 full (when !may_queue), < 0 error.
 * Swarm's routing admits every request (its path grows as its prompt goes). */
static int admit(sim *s, int id, double now, int may_queue) {
    sim_req *r = &s->req[id];
    if (s->swr) {
        if (!(r->path = own_path(s))) return fu_errorf(FU_ERR_NOMEM, "sim: out of memory");
        track_in_flight(s, now, 1);
        int rc = start_step(s, id, now);
        return rc ? rc : 1;
    }
    int expect = s->o->kv_output_tokens > 0 ? s->o->kv_output_tokens : r->output_len;
    int rc = rt_route_request(s->router, r->prompt_len, r->prompt_len + expect, NULL, &r->path);
    if (rc == FU_ERR_EXHAUSTED) return may_queue ? items_push(&s->wait, id, 0) : 2;
    if (rc) {
        s->res->rejected++;
        req_free(s, id);
        return rc == FU_ERR_NOT_FOUND ? 0 : rc;
    }
    kv_account(s, r->path, 1);
    s->hops_sum += r->path->n_hops;
    s->admitted++;
    track_in_flight(s, now, 1);
    rc = start_step(s, id, now);
    return rc ? rc : 1;
}

static int new_request(sim *s, double now, int prompt_len, int output_len) {
    int id = req_new(s, now, prompt_len, output_len);
    if (id < 0) return id;
    int rc = admit(s, id, now, 1);
    return rc < 0 ? rc : FU_OK;
}

/* A length drawn around `mean` (lognormal with sigma `sd`, its mean kept), within [4, cap]. */
static int draw_len(sim *s, int mean, double sd, int cap) {
    if (!(sd > 0)) return mean;
    double u1 = rt__rng_unit(&s->rng), u2 = rt__rng_unit(&s->rng);
    double z = sqrt(-2 * log(1 - u1)) * cos(2 * M_PI * u2);
    double v = mean * exp(sd * z - sd * sd / 2);
    if (v < 4) v = 4;
    return v > cap ? cap : (int)v;
}

/* A synthetic request: lengths drawn from the options' set, fixed, or drawn around the means. */
static int new_synthetic(sim *s, double now) {
    const rt_sim_opts *o = s->o;
    if (o->lengths && o->n_lengths > 0) {
        int i = (int)(rt__rng_unit(&s->rng) * o->n_lengths);
        const rt_sim_request *q = &o->lengths[i < o->n_lengths ? i : o->n_lengths - 1];
        return new_request(s, now, q->prompt_len, q->output_len);
    }
    int pl = draw_len(s, s->prompt_len, o->prompt_sigma, o->max_prompt_len > 0 ? o->max_prompt_len : 2047);
    int ol = draw_len(s, s->output_len, o->output_sigma, o->max_output_len > 0 ? o->max_output_len : 1000);
    return new_request(s, now, pl, ol);
}

/* Admits waiting requests in order while they fit. */
static int admit_waiting(sim *s, double now) {
    int i = 0, rc = FU_OK;
    while (i < s->wait.n && (rc = admit(s, s->wait.v[i].req, now, 0)) != 2) {
        if (rc < 0) return rc;
        i++;
    }
    if (i > 0) memmove(s->wait.v, s->wait.v + i, (size_t)(s->wait.n - i) * sizeof(item));
    s->wait.n -= i;
    return FU_OK;
}

/* After a prompt or a request finished: the closed loop replaces a finished request; Helix's
 * feeder adds one while KV allows. */
static int feed(sim *s, double now, int finished) {
    if (s->o->feed == RT_FEED_CLOSED && finished) return new_synthetic(s, now);
    if (s->o->feed == RT_FEED_KV && now <= s->t1) {
        double hwm = s->o->feed_hwm > 0 ? s->o->feed_hwm : 0.8;
        if (kv_bottleneck(s) <= hwm) return heap_push(s, now + 0.1, EV_NEW, -1, 0);
    }
    return FU_OK;
}

static int finish_request(sim *s, int id, double now) {
    sim_req *r = &s->req[id];
    if (now >= s->t0 && now <= s->t1) s->res->completed++;
    if (!s->swr) kv_account(s, r->path, -1);
    release_path(s, r);
    track_in_flight(s, now, -1);
    req_free(s, id);
    int rc = admit_waiting(s, now);
    return rc ? rc : feed(s, now, 1);
}

/* A step came back to the coordinator. */
static int step_done(sim *s, int id, double now) {
    sim_req *r = &s->req[id];
    int in_window = now >= s->t0 && now <= s->t1, rc = FU_OK;
    if (r->step == 0) {
        if (in_window) s->res->prompt_tps += r->prompt_len, rc = sample_add(&s->ttft, now - r->arrival);
        if (s->swr) s->hops_sum += r->path->n_hops, s->admitted++; /* its path is whole now */
        r->ctx = r->prompt_len;
    } else {
        if (in_window) s->res->decode_tps += 1, rc = sample_add(&s->tpot, now - r->step_start);
        r->ctx++;
    }
    if (rc) return rc;
    r->step++;
    if (r->step > r->output_len) return finish_request(s, id, now);
    rc = start_step(s, id, now);
    return rc ? rc : (r->step == 1 ? feed(s, now, 0) : FU_OK);
}

/* --- servers -------------------------------------------------------------------------------- */

static int limit_at(const int *a, int n, int k) {
    return a && n > 0 ? a[(k < n ? k : n) - 1] : 0;
}

typedef struct batch_fill {
    int prompts, prompt_tokens, decodes;
    double ctx;
} batch_fill;

/* Whether request r fits the batch `f` under p's limits for k blocks. */
static int fits(const rt_step_profile *p, int k, const batch_fill *f, const sim_req *r) {
    if (!p || k <= 0) return 1;
    if (r->step == 0) {
        int mr = limit_at(p->prompt_max_requests, p->n_limits, k), mt = limit_at(p->prompt_max_tokens, p->n_limits, k);
        return (!mr || f->prompts + 1 <= mr) && (!mt || f->prompt_tokens + r->w <= mt);
    }
    int md = limit_at(p->decode_max_tokens, p->n_limits, k);
    double mc = p->decode_max_context && p->n_limits > 0 ? p->decode_max_context[(k < p->n_limits ? k : p->n_limits) - 1] : 0;
    return (!md || f->decodes + 1 <= md) && (!(mc > 0) || f->ctx + r->ctx <= mc);
}

/* Moves the queued steps that fit the batch limits into the batch, in arrival order, skipping
 * those that do not fit (the first one always goes). */
static int take_batch(sim *s, int v, const rt_step_profile *p, int k) {
    srv_state *st = &s->srv[v];
    batch_fill f = {0};
    int keep = 0;
    st->batch.n = 0;
    for (int i = 0; i < st->queue.n; i++) {
        item it = st->queue.v[i];
        sim_req *r = &s->req[it.req];
        if (st->batch.n > 0 && !fits(p, k, &f, r)) {
            st->queue.v[keep++] = it;
            continue;
        }
        int rc = items_push(&st->batch, it.req, it.hop);
        if (rc) return rc;
        if (r->step == 0) f.prompts++, f.prompt_tokens += r->w;
        else f.decodes++, f.ctx += r->ctx;
    }
    st->queue.n = keep;
    return FU_OK;
}

static double batch_seconds(const sim *s, int v, const rt_step_profile *p, int k) {
    const srv_state *st = &s->srv[v];
    double tp = rt_swarm_tput(s->sw, v, k), fluid = 0, ctx = 0, tokens = 0;
    int prompt = 0, decode = 0, jmax = 0;
    for (int i = 0; i < st->batch.n; i++) {
        const sim_req *r = &s->req[st->batch.v[i].req];
        int h = st->batch.v[i].hop, j = r->path->last[h] - r->path->first[h];
        if (j > jmax) jmax = j;
        tokens += r->w;
        if (r->step == 0) prompt += r->w;
        else decode++, ctx += r->ctx;
        if (tp > 0 && k > 0) fluid += r->w * ((double)j / k) / tp;
    }
    double t = p ? jmax * rt_step_seconds(p, prompt, decode, ctx) : fluid;
    t += tokens * s->sw->model.act_bytes * s->host_s_per_byte;
    return t > 1e-6 ? t : 1e-6; /* a step takes some time, so simulated time always advances */
}

static int server_start(sim *s, int v, double now) {
    srv_state *st = &s->srv[v];
    if (st->busy || st->queue.n == 0) return FU_OK;
    const rt_server *sv = &s->sw->servers[v];
    int k = sv->last - sv->first;
    const rt_step_profile *p = rt_sim_profile_find(s->o->profiles, sv->kind);
    int rc = take_batch(s, v, p, k);
    if (rc) return rc;
    st->busy = 1;
    return heap_push(s, now + batch_seconds(s, v, p, k), EV_BATCH, v, 0);
}

/* Under Swarm's routing, a step through server v (hop h) tells the node that sent it how long it
 * took, and a prompt at its path's end that more blocks remain picks its next hop. */
static int swarm_hop_done(sim *s, sim_req *r, int v, int h, double now) {
    rt__swroute_observe(s->swr, h > 0 ? r->path->servers[h - 1] : RT_SOURCE, v, now - r->sent_at);
    if (r->step > 0 || h + 1 < r->path->n_hops || r->path->last[h] >= s->sw->model.n_layers) return FU_OK;
    return grow_path(s, r->path, v);
}

static int on_batch(sim *s, int v, double now) {
    srv_state *st = &s->srv[v];
    for (int i = 0; i < st->batch.n; i++) {
        item it = st->batch.v[i];
        sim_req *r = &s->req[it.req];
        int rc = s->swr ? swarm_hop_done(s, r, v, it.hop, now) : FU_OK;
        if (rc) return rc;
        int next = it.hop + 1 < r->path->n_hops ? r->path->servers[it.hop + 1] : RT_SINK;
        double at;
        r->sent_at = now;
        rc = transfer(s, v, next, r->w, now, &at);
        if (!rc) rc = heap_push(s, at, EV_ARRIVE, it.req, it.hop + 1);
        if (rc) return rc;
    }
    st->batch.n = 0;
    st->busy = 0;
    return server_start(s, v, now);
}

static int on_arrive(sim *s, int id, int hop, double now) {
    const rt_path *p = s->req[id].path;
    if (hop >= p->n_hops) return step_done(s, id, now);
    int v = p->servers[hop];
    int rc = items_push(&s->srv[v].queue, id, hop);
    return rc ? rc : server_start(s, v, now);
}

/* --- the run --------------------------------------------------------------------------------- */

static int on_new(sim *s, int trace_index, double now) {
    const rt_sim_opts *o = s->o;
    if (trace_index >= 0) return new_request(s, now, o->trace[trace_index].prompt_len, o->trace[trace_index].output_len);
    int rc = new_synthetic(s, now);
    if (rc || o->feed != RT_FEED_POISSON) return rc;
    double next = now - log(1 - rt__rng_unit(&s->rng)) / o->arrival_rate;
    return next <= s->t1 ? heap_push(s, next, EV_NEW, -1, 0) : FU_OK;
}

static int seed_events(sim *s) {
    const rt_sim_opts *o = s->o;
    int rc = FU_OK;
    switch (o->feed) {
    case RT_FEED_TRACE:
        for (int i = 0; i < o->n_trace && !rc; i++)
            if (o->trace[i].arrival_s <= s->t1) rc = heap_push(s, o->trace[i].arrival_s, EV_NEW, i, 0);
        return rc;
    case RT_FEED_POISSON:
        if (!(o->arrival_rate > 0)) return fu_errorf(FU_ERR_INVALID, "sim: Poisson arrivals need a rate > 0");
        return heap_push(s, -log(1 - rt__rng_unit(&s->rng)) / o->arrival_rate, EV_NEW, -1, 0);
    case RT_FEED_KV:
        for (int i = 0; i < (o->initial_requests > 0 ? o->initial_requests : 20) && !rc; i++)
            rc = heap_push(s, 0.1 * i, EV_NEW, -1, 0);
        return rc;
    default: {
        int c = o->concurrency > 0 ? o->concurrency : 256;
        for (int i = 0; i < c && !rc; i++) rc = heap_push(s, 10.0 * i / c, EV_NEW, -1, 0);
        return rc;
    }
    }
}

/* The router's view: KV capacities scaled by kv_hwm. */
static int kv_view(sim *s) {
    int rc = rt_swarm_clone(&s->kv, s->sw);
    if (rc) return rc;
    double hwm = s->o->kv_hwm > 0 ? s->o->kv_hwm : 0.85;
    for (int i = 0; i < s->kv.n_servers; i++)
        for (int k = 0; s->kv.servers[i].kv_tokens && k < s->kv.servers[i].n_tput; k++)
            s->kv.servers[i].kv_tokens[k] *= hwm;
    return FU_OK;
}

static int sim_init(sim *s, const rt_swarm *sw, const rt_sim_opts *o, rt_sim_result *res) {
    memset(s, 0, sizeof *s);
    s->sw = sw, s->o = o, s->res = res;
    s->free_head = -1;
    s->rng = o->seed ^ 0xabcdef12345ULL;
    s->t1 = o->duration_s > 0 ? o->duration_s : 660;
    s->t0 = o->warmup_s < 0 ? 0 : (o->warmup_s > 0 ? o->warmup_s : 60);
    if (s->t0 >= s->t1) s->t0 = 0;
    s->prompt_len = o->prompt_len > 0 ? o->prompt_len : 750;
    s->output_len = o->output_len > 0 ? o->output_len : 240;
    s->host_s_per_byte = o->host_s_per_byte < 0 ? 0 : (o->host_s_per_byte > 0 ? o->host_s_per_byte : 1 / 4e9 + 1 / 5e9);
    int n = sw->n_servers, rc = kv_view(s);
    if (rc) return rc;
    s->srv = calloc((size_t)n + 1, sizeof *s->srv);
    s->nic_out_free = calloc((size_t)n + 2, sizeof(double));
    s->nic_in_free = calloc((size_t)n + 2, sizeof(double));
    s->layer_used = calloc((size_t)sw->model.n_layers + 1, sizeof(double));
    s->layer_cap = calloc((size_t)sw->model.n_layers + 1, sizeof(double));
    if (!s->srv || !s->nic_out_free || !s->nic_in_free || !s->layer_used || !s->layer_cap)
        return fu_errorf(FU_ERR_NOMEM, "sim: out of memory");
    kv_init(s);
    if (o->routing == RT_SIM_ROUTE_SWARM && (rc = rt__swroute_init(&s->swr, sw, 0.05, 0.8))) return rc;
    if ((rc = rt_router_init(&s->router, &s->kv, &o->route))) return rc;
    res->max_flow = rt_router_flow(s->router)->value;
    return FU_OK;
}

static void sim_free(sim *s) {
    for (int i = 0; i < s->nreq; i++) release_path(s, &s->req[i]);
    rt_router_free(s->router);
    rt__swroute_free(s->swr);
    rt_swarm_free(&s->kv);
    for (int i = 0; s->srv && i < s->sw->n_servers; i++) free(s->srv[i].queue.v), free(s->srv[i].batch.v);
    free(s->heap), free(s->req), free(s->wait.v), free(s->srv), free(s->links);
    free(s->nic_out_free), free(s->nic_in_free), free(s->layer_used), free(s->layer_cap);
    free(s->ttft.v), free(s->tpot.v);
}

static void sim_results(sim *s) {
    rt_sim_result *res = s->res;
    double span = s->t1 - s->t0;
    track_in_flight(s, s->t1, 0);
    res->decode_tps /= span;
    res->prompt_tps /= span;
    res->mean_in_flight = s->in_flight_area / span;
    res->mean_hops = s->admitted ? s->hops_sum / (double)s->admitted : 0;
    samples *sm[2] = {&s->ttft, &s->tpot};
    double *out[2][3] = {{&res->ttft_p50, &res->ttft_p95, &res->ttft_p99}, {&res->tpot_p50, &res->tpot_p95, &res->tpot_p99}};
    double *mean[2] = {&res->mean_prompt_latency_s, &res->mean_decode_latency_s};
    for (int i = 0; i < 2; i++) {
        double sum = 0;
        for (long j = 0; j < sm[i]->n; j++) sum += sm[i]->v[j];
        *mean[i] = sm[i]->n ? sum / (double)sm[i]->n : 0;
        if (sm[i]->n > 0) qsort(sm[i]->v, (size_t)sm[i]->n, sizeof(double), cmp_double); /* v may be NULL */
        *out[i][0] = pct(sm[i], 0.50), *out[i][1] = pct(sm[i], 0.95), *out[i][2] = pct(sm[i], 0.99);
    }
}

int rt_sim_run(const rt_swarm *sw, const rt_sim_opts *opts, rt_sim_result *res) {
    if (!sw || !opts || !res) return fu_errorf(FU_ERR_INVALID, "rt_sim_run: NULL argument");
    if (opts->feed == RT_FEED_TRACE && (!opts->trace || opts->n_trace <= 0))
        return fu_errorf(FU_ERR_INVALID, "sim: a trace feed needs requests");
    if (opts->routing == RT_SIM_ROUTE_SWARM && opts->feed == RT_FEED_KV)
        return fu_errorf(FU_ERR_INVALID, "sim: Swarm's routing keeps no KV account to feed by; use a closed loop, "
                                         "Poisson arrivals or a trace");
    memset(res, 0, sizeof *res);
    sim s;
    int rc = sim_init(&s, sw, opts, res);
    if (!rc) rc = seed_events(&s);
    while (!rc && s.nh > 0) {
        sim_event ev = heap_pop(&s);
        if (ev.t > s.t1) break;
        if (++res->events > SIM_MAX_EVENTS)
            rc = fu_errorf(FU_ERR_RANGE, "sim: more than %ld events by %.1f s of %.1f: step times or links near "
                           "zero, or a run too long", (long)SIM_MAX_EVENTS, ev.t, s.t1);
        if (rc) break;
        if (ev.kind == EV_NEW) rc = on_new(&s, ev.a, ev.t);
        else if (ev.kind == EV_BATCH) rc = on_batch(&s, ev.a, ev.t);
        else rc = on_arrive(&s, ev.a, ev.b, ev.t);
    }
    if (!rc) sim_results(&s);
    sim_free(&s);
    return rc;
}
