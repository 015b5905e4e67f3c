/* rt-route.c -- request routing: interleaved weighted round-robin over the swarm's max flow,
 * with KV admission, backtracking, and per-hop load accounting: live (released with the path)
 * or cumulative (every token routed so far, as Helix counts). */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "router-impl.h"
#include "status.h"

/* Work routed over each hop, keyed by its ends (0 = source, 1 = sink, 2 + i = server i):
 * open addressing with linear probing; an entry leaves when its work returns to 0, so under
 * live accounting the table holds only hops of paths in flight; it survives rt_router_update. */
#define HX(i) ((i) + 2)
#define LOAD_EMPTY UINT64_MAX

typedef struct load_slot {
    uint64_t key;
    double work;
} load_slot;

typedef struct load_map {
    load_slot *slot; /* [cap], cap a power of two */
    size_t cap, used;
} load_map;

struct rt_router {
    const rt_swarm *sw;
    rt_route_opts opts;
    rt_flow flow;
    int n;              /* server slots tracked */
    load_map hop_load;  /* work (tokens) routed over each hop */
    double *srv_load;   /* [n] work routed through each server */
    double *kv_used;    /* [n] KV tokens reserved on each server */
    uint64_t next_id;
    long live_paths;
    const int *cached;  /* during rt_route_request: tokens each server likely holds cached */
    int work;           /* during rt_route_request: the work a hop's score adds */
    /* scratch for the search: a chain has at most n_layers hops (each ends further on) */
    int depth_cap, deg_cap;
    int *stack_srv;     /* [depth_cap] */
    int *cand;          /* [depth_cap * deg_cap] candidates per depth */
    double *cand_score; /* [depth_cap * deg_cap] their scores */
};

static size_t load_pos(const load_map *m, uint64_t key) {
    uint64_t h = key * 0x9e3779b97f4a7c15ULL;
    return (size_t)(h >> 17) & (m->cap - 1);
}

static int load_grow(load_map *m) {
    size_t cap = m->cap ? m->cap * 2 : 64;
    load_slot *s = malloc(cap * sizeof *s), *old = m->slot;
    if (!s) return fu_errorf(FU_ERR_NOMEM, "router: out of memory");
    for (size_t i = 0; i < cap; i++) s[i].key = LOAD_EMPTY;
    size_t ocap = m->cap;
    m->slot = s;
    m->cap = cap;
    for (size_t i = 0; i < ocap; i++) {
        if (old[i].key == LOAD_EMPTY) continue;
        size_t p = load_pos(m, old[i].key);
        while (s[p].key != LOAD_EMPTY) p = (p + 1) & (cap - 1);
        s[p] = old[i];
    }
    free(old);
    return FU_OK;
}

static uint64_t hop_key(int u, int v) {
    uint32_t a = u == RT_SOURCE ? 0 : (uint32_t)HX(u), b = v == RT_SINK ? 1 : (uint32_t)HX(v);
    return (uint64_t)a << 32 | b;
}

/* Work on hop u -> v (0 when none). */
static double load_get(const load_map *m, int u, int v) {
    if (!m->cap) return 0;
    uint64_t key = hop_key(u, v);
    for (size_t p = load_pos(m, key); m->slot[p].key != LOAD_EMPTY; p = (p + 1) & (m->cap - 1))
        if (m->slot[p].key == key) return m->slot[p].work;
    return 0;
}

/* Removes slot p, moving later probes back (deletion without tombstones). */
static void load_erase(load_map *m, size_t p) {
    size_t mask = m->cap - 1;
    m->slot[p].key = LOAD_EMPTY;
    m->used--;
    for (size_t q = (p + 1) & mask; m->slot[q].key != LOAD_EMPTY; q = (q + 1) & mask) {
        size_t home = load_pos(m, m->slot[q].key);
        /* q's entry may fill the hole if its home is not within (p, q] cyclically */
        if ((q > p && (home <= p || home > q)) || (q < p && home <= p && home > q)) {
            m->slot[p] = m->slot[q];
            m->slot[q].key = LOAD_EMPTY;
            p = q;
        }
    }
}

/* Adds `d` to the work on hop u -> v; an entry that returns to 0 is dropped. */
static int load_add(load_map *m, int u, int v, double d) {
    if ((m->used + 1) * 2 > m->cap && load_grow(m)) return FU_ERR_NOMEM;
    uint64_t key = hop_key(u, v);
    size_t p = load_pos(m, key);
    while (m->slot[p].key != LOAD_EMPTY && m->slot[p].key != key) p = (p + 1) & (m->cap - 1);
    if (m->slot[p].key == LOAD_EMPTY) {
        m->slot[p] = (load_slot){key, 0};
        m->used++;
    }
    m->slot[p].work += d;
    if (m->slot[p].work <= 0) load_erase(m, p);
    return FU_OK;
}

static int router_resize(rt_router *r, int n) {
    if (n <= r->n && r->srv_load) return FU_OK;
    double *sl = calloc((size_t)n + 1, sizeof(double)), *kv = calloc((size_t)n + 1, sizeof(double));
    if (!sl || !kv) {
        free(sl), free(kv);
        return fu_errorf(FU_ERR_NOMEM, "router: out of memory");
    }
    for (int i = 0; i < r->n; i++) sl[i] = r->srv_load[i], kv[i] = r->kv_used[i];
    free(r->srv_load), free(r->kv_used);
    r->srv_load = sl, r->kv_used = kv;
    r->n = n;
    return FU_OK;
}

/* Sizes the search scratch for the current flow: depth <= n_layers, out-degree of any node. */
static int scratch_resize(rt_router *r) {
    int depth = r->sw->model.n_layers + 2, deg = 1;
    for (int u = 0; u <= r->flow.n; u++) {
        int d = r->flow.hop_start[u + 1] - r->flow.hop_start[u];
        if (d > deg) deg = d;
    }
    if (depth <= r->depth_cap && deg <= r->deg_cap) return FU_OK;
    int *st = malloc((size_t)depth * sizeof(int)), *cand = malloc((size_t)depth * (size_t)deg * sizeof(int));
    double *cs = malloc((size_t)depth * (size_t)deg * sizeof(double));
    if (!st || !cand || !cs) {
        free(st), free(cand), free(cs);
        return fu_errorf(FU_ERR_NOMEM, "router: out of memory");
    }
    free(r->stack_srv), free(r->cand), free(r->cand_score);
    r->stack_srv = st, r->cand = cand, r->cand_score = cs;
    r->depth_cap = depth, r->deg_cap = deg;
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
    free(r->hop_load.slot), free(r->srv_load), free(r->kv_used), free(r->stack_srv), free(r->cand),
        free(r->cand_score);
    free(r);
}

int rt_router_update(rt_router *r) {
    if (!r) return fu_errorf(FU_ERR_INVALID, "rt_router_update: NULL router");
    int rc = router_resize(r, r->sw->n_servers);
    if (rc) return rc;
    if ((rc = rt_flow_compute(r->sw, &r->opts.flow, &r->flow, NULL))) return rc;
    return scratch_resize(r);
}

const rt_flow *rt_router_flow(const rt_router *r) { return r ? &r->flow : NULL; }

double rt_router_load(const rt_router *r, int id) {
    if (!r || id < 0 || id >= r->n) return 0;
    return r->srv_load[id];
}

int rt_router_busy(const rt_router *r, int id) {
    if (!r || id < 0 || id >= r->n) return 0;
    /* every path through id holds work on it (request_len > 0), hops included */
    return r->srv_load[id] > 0 || r->kv_used[id] > 0;
}

static int admits(const rt_router *r, int v, int len) {
    const rt_server *s = &r->sw->servers[v];
    double cap = rt_swarm_kv_tokens(r->sw, v, s->last - s->first);
    return cap <= 0 || r->kv_used[v] + len <= cap + 1e-9;
}

/* The next candidate to try: the first of the lowest score among those not tried yet (the
 * order a stable sort would give, found in one pass since most searches stop at the first). */
static int cand_pick(const double *score, int nc) {
    int b = -1;
    for (int c = 0; c < nc; c++)
        if (score[c] < INFINITY && (b < 0 || score[c] < score[b])) b = c;
    return b;
}

/* Depth-first search with IWRR ordering; stack_srv[0..depth) holds the chain so far. Only the
 * hops out of u that carry flow are looked at. Returns the path length on success, 0 if this
 * branch fails, -1 when the budget ran out. */
static int dfs(rt_router *r, int u, int depth, int len, int *budget, int *saw_full) {
    if (--*budget < 0) return -1;
    if (depth >= r->depth_cap - 1) return 0;
    int n = r->flow.n, a = u == RT_SOURCE ? n : u;
    const rt_flow_hop *hop = r->flow.hops + r->flow.hop_start[a];
    int nh = r->flow.hop_start[a + 1] - r->flow.hop_start[a];
    double out = 0, to_sink = 0, top = 0;
    for (int x = 0; x < nh; x++) {
        out += hop[x].flow;
        if (hop[x].to == RT_SINK) to_sink = hop[x].flow;
        else if (hop[x].flow > top) top = hop[x].flow;
    }
    if (out <= 0) return 0;
    if (u != RT_SOURCE && to_sink >= r->opts.min_share * out) return depth; /* chain complete */
    /* a hop is skipped below min_share of the out-flow, or of the strongest hop when the flow
     * fans out so widely (the source of a large swarm) that every hop is below that share */
    double floor = r->opts.min_share * (top < r->opts.min_share * out ? top : out);
    /* candidates, tried by increasing (load + work) / flow */
    int *cand = r->cand + (size_t)depth * r->deg_cap, nc = 0;
    double *score = r->cand_score + (size_t)depth * r->deg_cap;
    for (int x = 0; x < nh; x++) {
        int v = hop[x].to;
        double f = hop[x].flow;
        if (v == RT_SINK || f < floor || !rt_swarm_serving(r->sw, v)) continue;
        int seen = 0;
        for (int d = 0; d < depth && !seen; d++) seen = r->stack_srv[d] == v;
        if (seen) continue;
        if (!admits(r, v, len)) {
            *saw_full = 1;
            continue;
        }
        int w = r->work;
        double saved = r->cached && r->cached[v] > 0 ? (r->cached[v] < w ? r->cached[v] : w) : 0;
        cand[nc] = v;
        score[nc++] = (load_get(&r->hop_load, u, v) + w - saved) / f;
    }
    for (int c; (c = cand_pick(score, nc)) >= 0;) {
        int v = cand[c];
        score[c] = INFINITY;
        r->stack_srv[depth] = v;
        int got = dfs(r, v, depth + 1, len, budget, saw_full);
        if (got != 0) return got;
    }
    return 0;
}

int rt_route_cached(rt_router *r, int request_len, const int *cached, rt_path **path) {
    return rt_route_request(r, request_len, request_len, cached, path);
}

int rt_route(rt_router *r, int request_len, rt_path **path) {
    return rt_route_request(r, request_len, request_len, NULL, path);
}

/* The chain's search: fills r->stack_srv and returns its length, or an error. */
static int search(rt_router *r, int request_len) {
    if (!(r->flow.value > 0)) return fu_errorf(FU_ERR_NOT_FOUND, "no chain covers every block");
    if (r->flow.n != r->sw->n_servers || r->n < r->flow.n)
        return fu_errorf(FU_ERR_INVALID, "rt_route: swarm changed; call rt_router_update");
    int budget = 64 * (r->flow.n + 4), saw_full = 0;
    int depth = dfs(r, RT_SOURCE, 0, request_len, &budget, &saw_full);
    if (depth > 0) return depth;
    if (saw_full || depth < 0)
        return fu_errorf(FU_ERR_EXHAUSTED, "no chain can admit %d more tokens now", request_len);
    return fu_errorf(FU_ERR_NOT_FOUND, "no usable chain");
}

int rt_route_request(rt_router *r, int prompt_len, int request_len, const int *cached, rt_path **path) {
    if (!r || !path || request_len <= 0 || prompt_len <= 0 || prompt_len > request_len)
        return fu_errorf(FU_ERR_INVALID, "rt_route: bad arguments");
    *path = NULL;
    r->cached = cached;
    r->work = r->opts.load == RT_IWRR_CUMULATIVE ? prompt_len : request_len;
    int depth = search(r, request_len);
    r->cached = NULL;
    if (depth < 0) return depth;
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
    p->work = r->work;
    int prev = RT_SOURCE, pos = 0;
    for (int d = 0; d < depth; d++) {
        int v = r->stack_srv[d];
        const rt_server *s = &r->sw->servers[v];
        p->servers[d] = v;
        p->first[d] = d == 0 ? s->first : pos; /* partial execution starts where prev ended */
        p->last[d] = s->last;
        pos = s->last;
        load_add(&r->hop_load, prev, v, p->work);
        r->srv_load[v] += request_len;
        r->kv_used[v] += request_len;
        prev = v;
    }
    load_add(&r->hop_load, prev, RT_SINK, p->work);
    r->live_paths++;
    *path = p;
    return FU_OK;
}

void rt_release(rt_path *p) {
    if (!p) return;
    rt_router *r = p->router;
    int live = r->opts.load != RT_IWRR_CUMULATIVE;
    int prev = RT_SOURCE;
    for (int d = 0; d < p->n_hops; d++) {
        int v = p->servers[d];
        if (v >= 0 && v < r->n) {
            if (live) load_add(&r->hop_load, prev, v, -p->work);
            r->srv_load[v] -= p->request_len;
            r->kv_used[v] -= p->request_len;
            if (r->kv_used[v] < 0) r->kv_used[v] = 0;
        }
        prev = v;
    }
    if (live) load_add(&r->hop_load, prev, RT_SINK, -p->work);
    r->live_paths--;
    free(p->servers);
    free(p);
}

int rt_path_step(rt_path *p, int tokens) {
    if (!p || !p->router || tokens <= 0 || p->router->opts.load != RT_IWRR_CUMULATIVE) return FU_OK;
    rt_router *r = p->router;
    int prev = RT_SOURCE, rc = FU_OK;
    for (int d = 0; d < p->n_hops && !rc; d++) {
        if (p->servers[d] < 0 || p->servers[d] >= r->n) return FU_OK;
        rc = load_add(&r->hop_load, prev, p->servers[d], tokens);
        prev = p->servers[d];
    }
    return rc ? rc : load_add(&r->hop_load, prev, RT_SINK, tokens);
}
