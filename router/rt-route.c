/* rt-route.c -- request routing: interleaved weighted round-robin over the swarm's max flow,
 * with KV admission, backtracking, and per-hop load accounting released with the path. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "router-impl.h"
#include "status.h"

/* Hop indices: 0 = source, 1 = sink, 2 + i = server i. */
#define HX(i) ((i) + 2)

struct rt_router {
    const rt_swarm *sw;
    rt_route_opts opts;
    rt_flow flow;
    int n;              /* server slots tracked */
    int stride;         /* row length of hop_load (n + 2) */
    double *hop_load;   /* [stride^2] work (tokens) routed over each hop */
    double *srv_load;   /* [n] work routed through each server */
    double *kv_used;    /* [n] KV tokens reserved on each server */
    uint64_t next_id;
    long live_paths;
    const int *cached;  /* during rt_route_cached: tokens each server likely holds cached */
    /* scratch for the search */
    int *stack_srv, *cand;
    double *cand_score;
};

static int router_resize(rt_router *r, int n) {
    if (n <= r->n && r->hop_load) return FU_OK;
    int stride = n + 2;
    double *hl = calloc((size_t)stride * stride, sizeof(double));
    double *sl = calloc((size_t)n + 1, sizeof(double)), *kv = calloc((size_t)n + 1, sizeof(double));
    int *st = malloc(((size_t)n + 2) * sizeof(int)), *cand = malloc(((size_t)n + 2) * (n + 2) * sizeof(int));
    double *cs = malloc(((size_t)n + 2) * sizeof(double));
    if (!hl || !sl || !kv || !st || !cand || !cs) {
        free(hl), free(sl), free(kv), free(st), free(cand), free(cs);
        return fu_errorf(FU_ERR_NOMEM, "router: out of memory");
    }
    for (int a = 0; a < r->stride; a++)
        for (int b = 0; b < r->stride; b++) hl[a * stride + b] = r->hop_load[a * r->stride + b];
    for (int i = 0; i < r->n; i++) sl[i] = r->srv_load[i], kv[i] = r->kv_used[i];
    free(r->hop_load), free(r->srv_load), free(r->kv_used), free(r->stack_srv), free(r->cand),
        free(r->cand_score);
    r->hop_load = hl, r->srv_load = sl, r->kv_used = kv, r->stack_srv = st, r->cand = cand;
    r->cand_score = cs;
    r->n = n;
    r->stride = stride;
    return FU_OK;
}

int rt_router_init(rt_router **out, const rt_swarm *sw, const rt_route_opts *opts) {
    if (!out || !sw) return fu_errorf(FU_ERR_INVALID, "rt_router_init: NULL argument");
    rt_router *r = calloc(1, sizeof *r);
    if (!r) return fu_errorf(FU_ERR_NOMEM, "router: out of memory");
    r->sw = sw;
    if (opts) r->opts = *opts;
    if (r->opts.min_share <= 0) r->opts.min_share = 0.05;
    int rc = rt_router_update(r);
    if (rc) {
        rt_router_free(r);
        return rc;
    }
    *out = r;
    return FU_OK;
}

void rt_router_free(rt_router *r) {
    if (!r) return;
    rt_flow_free(&r->flow);
    free(r->hop_load), free(r->srv_load), free(r->kv_used), free(r->stack_srv), free(r->cand),
        free(r->cand_score);
    free(r);
}

int rt_router_update(rt_router *r) {
    if (!r) return fu_errorf(FU_ERR_INVALID, "rt_router_update: NULL router");
    int rc = router_resize(r, r->sw->n_servers);
    if (rc) return rc;
    return rt_flow_compute(r->sw, &r->opts.flow, &r->flow, NULL);
}

const rt_flow *rt_router_flow(const rt_router *r) { return r ? &r->flow : NULL; }

double rt_router_load(const rt_router *r, int id) {
    if (!r || id < 0 || id >= r->n) return 0;
    return r->srv_load[id];
}

int rt_router_busy(const rt_router *r, int id) {
    if (!r || id < 0 || id >= r->n) return 0;
    if (r->srv_load[id] > 0 || r->kv_used[id] > 0) return 1;
    size_t x = (size_t)HX(id);
    for (size_t u = 0; u < (size_t)r->stride; u++)
        if (r->hop_load[u * r->stride + x] > 0 || r->hop_load[x * r->stride + u] > 0) return 1;
    return 0;
}

/* Flow on hop u -> v in the router's flow (u, v: server ids, RT_SOURCE, RT_SINK). */
static double hop_flow(const rt_router *r, int u, int v) {
    int n = r->flow.n;
    int a = u == RT_SOURCE ? n : u, b = v == RT_SINK ? n + 1 : v;
    if (a < 0 || b < 0 || a > n + 1 || b > n + 1) return 0;
    return r->flow.hop_flow[(size_t)a * (n + 2) + b];
}

static double *hop_load(rt_router *r, int u, int v) {
    int a = u == RT_SOURCE ? 0 : HX(u), b = v == RT_SINK ? 1 : HX(v);
    return &r->hop_load[(size_t)a * r->stride + b];
}

static int admits(const rt_router *r, int v, int len) {
    const rt_server *s = &r->sw->servers[v];
    double cap = rt_swarm_kv_tokens(r->sw, v, s->last - s->first);
    return cap <= 0 || r->kv_used[v] + len <= cap + 1e-9;
}

/* Depth-first search with IWRR ordering; stack_srv[0..depth) holds the chain so far.
 * Returns the path length on success, 0 if this branch fails, -1 when the budget ran out. */
static int dfs(rt_router *r, int u, int depth, int len, int *budget, int *saw_full) {
    if (--*budget < 0) return -1;
    int n = r->flow.n;
    double out = 0;
    for (int v = 0; v < n; v++) out += hop_flow(r, u, v);
    double to_sink = u == RT_SOURCE ? 0 : hop_flow(r, u, RT_SINK);
    out += to_sink;
    if (out <= 0) return 0;
    if (to_sink >= r->opts.min_share * out) return depth; /* chain complete */
    /* candidates sorted by (load + work) / flow */
    int *cand = r->cand + (size_t)depth * (n + 2), nc = 0;
    for (int v = 0; v < n; v++) {
        double f = hop_flow(r, u, v);
        if (f <= 0 || f < r->opts.min_share * out || !rt_swarm_serving(r->sw, v)) continue;
        int seen = 0;
        for (int d = 0; d < depth && !seen; d++) seen = r->stack_srv[d] == v;
        if (seen) continue;
        if (!admits(r, v, len)) {
            *saw_full = 1;
            continue;
        }
        double saved = r->cached && r->cached[v] > 0 ? (r->cached[v] < len ? r->cached[v] : len) : 0;
        double sc = (*hop_load(r, u, v) + len - saved) / f;
        int b = nc++;
        while (b > 0 && r->cand_score[b - 1] > sc) {
            cand[b] = cand[b - 1];
            r->cand_score[b] = r->cand_score[b - 1];
            b--;
        }
        cand[b] = v;
        r->cand_score[b] = sc;
    }
    for (int c = 0; c < nc; c++) {
        int v = cand[c];
        r->stack_srv[depth] = v;
        int got = dfs(r, v, depth + 1, len, budget, saw_full);
        if (got != 0) return got;
    }
    return 0;
}

int rt_route_cached(rt_router *r, int request_len, const int *cached, rt_path **path) {
    if (r) r->cached = cached;
    int rc = rt_route(r, request_len, path);
    if (r) r->cached = NULL;
    return rc;
}

int rt_route(rt_router *r, int request_len, rt_path **path) {
    if (!r || !path || request_len <= 0)
        return fu_errorf(FU_ERR_INVALID, "rt_route: bad arguments");
    *path = NULL;
    if (!(r->flow.value > 0)) return fu_errorf(FU_ERR_NOT_FOUND, "no chain covers every block");
    if (r->flow.n != r->sw->n_servers || r->n < r->flow.n)
        return fu_errorf(FU_ERR_INVALID, "rt_route: swarm changed; call rt_router_update");
    int budget = 64 * (r->flow.n + 4), saw_full = 0;
    int depth = dfs(r, RT_SOURCE, 0, request_len, &budget, &saw_full);
    if (depth <= 0) {
        if (saw_full || depth < 0)
            return fu_errorf(FU_ERR_EXHAUSTED, "no chain can admit %d more tokens now", request_len);
        return fu_errorf(FU_ERR_NOT_FOUND, "no usable chain");
    }
    rt_path *p = calloc(1, sizeof *p);
    int *buf = malloc((size_t)depth * 3 * sizeof(int));
    if (!p || !buf) {
        free(p), free(buf);
        return fu_errorf(FU_ERR_NOMEM, "rt_route: out of memory");
    }
    p->router = r;
    p->id = ++r->next_id;
    p->n_hops = depth;
    p->servers = buf;
    p->first = buf + depth;
    p->last = buf + 2 * depth;
    p->request_len = request_len;
    int prev = RT_SOURCE, pos = 0;
    for (int d = 0; d < depth; d++) {
        int v = r->stack_srv[d];
        const rt_server *s = &r->sw->servers[v];
        p->servers[d] = v;
        p->first[d] = d == 0 ? s->first : pos; /* partial execution starts where prev ended */
        p->last[d] = s->last;
        pos = s->last;
        *hop_load(r, prev, v) += request_len;
        r->srv_load[v] += request_len;
        r->kv_used[v] += request_len;
        prev = v;
    }
    *hop_load(r, prev, RT_SINK) += request_len;
    r->live_paths++;
    *path = p;
    return FU_OK;
}

void rt_release(rt_path *p) {
    if (!p) return;
    rt_router *r = p->router;
    int prev = RT_SOURCE;
    for (int d = 0; d < p->n_hops; d++) {
        int v = p->servers[d];
        if (v >= 0 && v < r->n) {
            *hop_load(r, prev, v) -= p->request_len;
            r->srv_load[v] -= p->request_len;
            r->kv_used[v] -= p->request_len;
            if (r->kv_used[v] < 0) r->kv_used[v] = 0;
        }
        prev = v;
    }
    *hop_load(r, prev, RT_SINK) -= p->request_len;
    r->live_paths--;
    free(p->servers);
    free(p);
}
