/* rt-flow.c -- Dinic's max flow on real-valued capacities and the swarm's flow network
 * (Helix's in -> start -> end -> out construction, runtime and MILP conventions), refined to
 * the least busy max flow by cycle canceling when the flow itself is wanted. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "router-impl.h"
#include "status.h"

/*
 * Dinic's algorithm: repeat { BFS levels from s over residual edges; blocking flow by DFS
 * along level-increasing edges with per-node edge iterators } until t is unreachable.
 * O(V^2 E) in general; our networks are small DAGs (4 nodes per server), so a flow takes
 * microseconds. Real capacities: a residual below eps (1e-12 of the largest finite capacity
 * out of s, at least 1e-12) counts as saturated, which bounds the number of phases and makes
 * the result exact up to that tolerance. Capacities above RT_INF_CAP are treated as infinite.
 */
#define RT_INF_CAP 1e30

typedef struct rt_edge {
    int to, next;
    double cap;   /* original capacity */
    double res;   /* residual capacity */
} rt_edge;

struct rt_graph {
    int n, cap_n;
    int *head;    /* [cap_n] first edge index per node (-1 none) */
    int *level;   /* [cap_n] */
    int *iter;    /* [cap_n] */
    int *queue;   /* [cap_n] */
    rt_edge *e;   /* edges in pairs: 2k forward, 2k+1 reverse */
    int ne, cap_e;
    double eps;
};

int rt_graph_init(rt_graph **out, int n_nodes) {
    if (!out || n_nodes <= 0 || n_nodes > (1 << 26))
        return fu_errorf(FU_ERR_INVALID, "rt_graph_init: bad node count %d", n_nodes);
    rt_graph *g = calloc(1, sizeof *g);
    if (!g) return fu_errorf(FU_ERR_NOMEM, "rt_graph_init: out of memory");
    int rc = rt__graph_reset(g, n_nodes);
    if (rc) {
        rt_graph_free(g);
        return rc;
    }
    *out = g;
    return FU_OK;
}

int rt__graph_reset(rt_graph *g, int n_nodes) {
    if (n_nodes > g->cap_n) {
        int c = n_nodes;
        int *h = realloc(g->head, (size_t)c * sizeof(int));
        if (h) g->head = h;
        int *l = realloc(g->level, (size_t)c * sizeof(int));
        if (l) g->level = l;
        int *it = realloc(g->iter, (size_t)c * sizeof(int));
        if (it) g->iter = it;
        int *q = realloc(g->queue, (size_t)c * sizeof(int));
        if (q) g->queue = q;
        if (!h || !l || !it || !q) return fu_errorf(FU_ERR_NOMEM, "graph: out of memory");
        g->cap_n = c;
    }
    g->n = n_nodes;
    g->ne = 0;
    for (int i = 0; i < n_nodes; i++) g->head[i] = -1;
    return FU_OK;
}

void rt_graph_free(rt_graph *g) {
    if (!g) return;
    free(g->head), free(g->level), free(g->iter), free(g->queue), free(g->e);
    free(g);
}

int rt_graph_add_edge(rt_graph *g, int u, int v, double cap) {
    if (!g || u < 0 || v < 0 || u >= g->n || v >= g->n || !(cap >= 0) || isnan(cap))
        return fu_errorf(FU_ERR_INVALID, "rt_graph_add_edge: bad edge %d->%d (%g)", u, v, cap);
    if (cap > RT_INF_CAP) cap = RT_INF_CAP;
    if (g->ne + 2 > g->cap_e) {
        int c = g->cap_e ? g->cap_e * 2 : 64;
        rt_edge *e = realloc(g->e, (size_t)c * sizeof *e);
        if (!e) return fu_errorf(FU_ERR_NOMEM, "graph: out of memory");
        g->e = e;
        g->cap_e = c;
    }
    int k = g->ne;
    g->e[k] = (rt_edge){v, g->head[u], cap, cap};
    g->head[u] = k;
    g->e[k + 1] = (rt_edge){u, g->head[v], 0, 0};
    g->head[v] = k + 1;
    g->ne += 2;
    return k / 2;
}

static int dinic_bfs(rt_graph *g, int s, int t) {
    for (int i = 0; i < g->n; i++) g->level[i] = -1;
    int qh = 0, qt = 0;
    g->queue[qt++] = s;
    g->level[s] = 0;
    while (qh < qt) {
        int u = g->queue[qh++];
        for (int k = g->head[u]; k >= 0; k = g->e[k].next) {
            int v = g->e[k].to;
            if (g->level[v] < 0 && g->e[k].res > g->eps) {
                g->level[v] = g->level[u] + 1;
                g->queue[qt++] = v;
            }
        }
    }
    return g->level[t] >= 0;
}

/* Pushes up to `f` from u towards t along the level graph, over as many edges as it takes
 * (one search carries many paths); returns the amount pushed. A node that can push nothing
 * more leaves the level graph. */
static double dinic_dfs(rt_graph *g, int u, int t, double f) {
    if (u == t) return f;
    double pushed = 0;
    for (; g->iter[u] >= 0; g->iter[u] = g->e[g->iter[u]].next) {
        int k = g->iter[u];
        int v = g->e[k].to;
        if (g->e[k].res <= g->eps || g->level[v] != g->level[u] + 1) continue;
        double want = f - pushed < g->e[k].res ? f - pushed : g->e[k].res;
        double d = dinic_dfs(g, v, t, want);
        if (d > 0) {
            g->e[k].res -= d;
            g->e[k ^ 1].res += d;
            pushed += d;
            if (f - pushed <= g->eps) return pushed; /* keep iter[u]: the edge may have room */
        }
    }
    if (pushed <= 0) g->level[u] = -1;
    return pushed;
}

double rt_graph_max_flow(rt_graph *g, int s, int t) {
    if (!g || s < 0 || t < 0 || s >= g->n || t >= g->n || s == t) return -1;
    double maxcap = 0;
    for (int k = 0; k < g->ne; k += 2) {
        g->e[k].res = g->e[k].cap;
        g->e[k + 1].res = 0;
        if (g->e[k].cap < RT_INF_CAP && g->e[k].cap > maxcap) maxcap = g->e[k].cap;
    }
    g->eps = maxcap * 1e-12 > 1e-12 ? maxcap * 1e-12 : 1e-12;
    double total = 0;
    while (dinic_bfs(g, s, t)) {
        for (int i = 0; i < g->n; i++) g->iter[i] = g->head[i];
        double f;
        while ((f = dinic_dfs(g, s, t, RT_INF_CAP * 4)) > 0) {
            total += f;
            if (total >= RT_INF_CAP) return RT_INF_CAP; /* an uncapacitated path */
        }
    }
    return total;
}

double rt_graph_edge_flow(const rt_graph *g, int e) {
    if (!g || e < 0 || 2 * e >= g->ne) return 0;
    double f = g->e[2 * e].cap - g->e[2 * e].res;
    return f > 0 ? f : 0;
}

/* --- the swarm's network ------------------------------------------------------------------ */

int rt__hop_valid(const rt_swarm *sw, int i, int j, int allow_partial) {
    if (i == j || !rt_swarm_serving(sw, i) || !rt_swarm_serving(sw, j)) return 0;
    int end_i = sw->servers[i].last, sj = sw->servers[j].first, ej = sw->servers[j].last;
    if (end_i == sj) return 1;
    return allow_partial && sj <= end_i && end_i < ej;
}

static double div_cap(double bw, double bytes) {
    if (bw <= 0) return RT_INF_CAP; /* unlimited NIC */
    return bytes > 0 ? bw / bytes : RT_INF_CAP;
}

/* What a network edge stands for, for reading the flow back: a server's compute edge
 * (u = server, v = FLOW_COMPUTE), a hop (u, v: server ids, RT_SOURCE, RT_SINK) or neither. */
#define FLOW_STRUCT (-100)
#define FLOW_COMPUTE (-101)
typedef struct flow_tag {
    int u, v;
} flow_tag;

typedef struct flow_map {
    flow_tag *tag; /* [cap] per edge index */
    int cap;
} flow_map;

/* Adds an edge to g, recording its tag in `map` (may be NULL). */
static int add_tagged(rt_graph *g, flow_map *map, int a, int b, double c, int u, int v) {
    int e = rt_graph_add_edge(g, a, b, c);
    if (e < 0 || !map) return e < 0 ? e : FU_OK;
    if (e >= map->cap) {
        int nc = map->cap ? map->cap * 2 : 256;
        while (nc <= e) nc *= 2;
        flow_tag *t = realloc(map->tag, (size_t)nc * sizeof *t);
        if (!t) return fu_errorf(FU_ERR_NOMEM, "flow: out of memory");
        map->tag = t;
        map->cap = nc;
    }
    map->tag[e] = (flow_tag){u, v};
    return FU_OK;
}

/* Server i's in/compute/out edges; srv_in / srv_out: it has server predecessors/successors. */
static int add_server_edges(const rt_swarm *sw, int ilp, int i, int srv_in, int srv_out, rt_graph *g,
                            flow_map *map) {
    const rt_server *s = &sw->servers[i];
    double tok = sw->model.token_bytes, act = sw->model.act_bytes;
    double tp = rt_swarm_tput(sw, i, s->last - s->first);
    double cin, cout, ccomp = tp;
    if (ilp) {
        double nic = s->nic_in > 0 && (s->nic_out <= 0 || s->nic_in < s->nic_out) ? s->nic_in : s->nic_out;
        double c = div_cap(nic, act);
        cin = cout = RT_INF_CAP;
        ccomp = tp < c ? tp : c;
    } else {
        cin = div_cap(s->nic_in, srv_in ? tok + act : tok);
        cout = div_cap(s->nic_out, srv_out ? tok + act : tok);
    }
    int rc = add_tagged(g, map, RT_N_IN(i), RT_N_START(i), cin, FLOW_STRUCT, 0);
    if (!rc) rc = add_tagged(g, map, RT_N_START(i), RT_N_END(i), ccomp, i, FLOW_COMPUTE);
    if (!rc) rc = add_tagged(g, map, RT_N_END(i), RT_N_OUT(i), cout, FLOW_STRUCT, 0);
    return rc;
}

/* Builds the network into `g` from the valid hops `h` (rt__hops_build), tagging edges in `map`
 * (may be NULL). `has_pred` is scratch of n_servers bytes. */
static int build_network(const rt_swarm *sw, const rt_flow_opts *o, const rt_hops *h, rt_graph *g,
                         flow_map *map, unsigned char *has_pred) {
    int n = sw->n_servers, L = sw->model.n_layers, rc;
    double tok = sw->model.token_bytes, act = sw->model.act_bytes;
    int ilp = o->conv == RT_CONV_ILP;
    if ((rc = rt__graph_reset(g, 4 + 4 * n))) return rc;
    memset(has_pred, 0, (size_t)n + 1);
    for (int x = 0; x < h->n; x++) has_pred[h->to[x]] = 1;
    rc = add_tagged(g, map, RT_N_SOURCE, RT_N_SRC_OUT, ilp ? RT_INF_CAP : div_cap(sw->source_nic_out, tok),
                    FLOW_STRUCT, 0);
    if (!rc)
        rc = add_tagged(g, map, RT_N_SINK_IN, RT_N_SINK, ilp ? RT_INF_CAP : div_cap(sw->sink_nic_in, tok),
                        FLOW_STRUCT, 0);
    for (int i = 0; i < n && !rc; i++) {
        if (!rt_swarm_serving(sw, i)) continue;
        const rt_server *s = &sw->servers[i];
        rc = add_server_edges(sw, ilp, i, has_pred[i], h->start[i + 1] > h->start[i], g, map);
        if (!rc && s->first == 0 && sw->from_source[i].bandwidth > 0)
            rc = add_tagged(g, map, RT_N_SRC_OUT, RT_N_IN(i), sw->from_source[i].bandwidth / tok, RT_SOURCE, i);
        if (!rc && s->last == L && sw->to_sink[i].bandwidth > 0)
            rc = add_tagged(g, map, RT_N_OUT(i), RT_N_SINK_IN, sw->to_sink[i].bandwidth / tok, i, RT_SINK);
        for (int x = h->start[i]; x < h->start[i + 1] && !rc; x++)
            rc = add_tagged(g, map, RT_N_OUT(i), RT_N_IN(h->to[x]), h->bw[x] / (ilp ? act : tok + act), i,
                            h->to[x]);
    }
    return rc;
}

/*
 * Among maximum flows, one whose servers are least busy in sum: sum over servers of flow /
 * capacity, so that flow a fast server can carry does not go through a slow one (a max flow
 * leaves that choice to the order it finds paths in, and IWRR sends nothing where the flow is
 * zero). Cycle canceling: Bellman-Ford over the residual network, with each server's compute
 * edge costing 1 / capacity per token/s (its reverse the negative), finds a negative cycle; the
 * flow around it moves to cheaper servers, the value unchanged. Stops when none is left or after
 * LEAST_BUSY_BUDGET edge relaxations (a large swarm keeps the flow it has, still a max flow;
 * by count, not clock, so the result is the same on any machine).
 */
#define LEAST_BUSY_BUDGET 20000000L

typedef struct cycle_ws {
    const double *cost; /* [ne / 2] per forward edge */
    double *dist, tol;  /* [n] */
    int *pred;          /* [n] residual edge into each node on the best walk */
    long budget;
} cycle_ws;

static double res_cost(const cycle_ws *w, int k) { return k & 1 ? -w->cost[k / 2] : w->cost[k / 2]; }

/* One Bellman-Ford pass over every residual edge; the last node it relaxed, or -1. */
static int relax_pass(rt_graph *g, cycle_ws *w) {
    int last = -1;
    for (int u = 0; u < g->n; u++)
        for (int k = g->head[u]; k >= 0; k = g->e[k].next, w->budget--) {
            int v = g->e[k].to;
            double d = w->dist[u] + res_cost(w, k);
            if (g->e[k].res > g->eps && d < w->dist[v] - w->tol) w->dist[v] = d, w->pred[v] = k, last = v;
        }
    return last;
}

/* A node on a negative-cost residual cycle, or -1 when there is none (or the budget ran out). */
static int negative_cycle(rt_graph *g, cycle_ws *w) {
    for (int i = 0; i < g->n; i++) w->dist[i] = 0, w->pred[i] = -1;
    int x = -1;
    for (int pass = 0; pass < g->n && w->budget > 0; pass++)
        if ((x = relax_pass(g, w)) < 0) return -1;
    if (x < 0 || w->budget <= 0) return -1;
    for (int i = 0; i < g->n && x >= 0; i++) /* walk back onto the cycle */
        x = w->pred[x] >= 0 ? g->e[w->pred[x] ^ 1].to : -1;
    return x;
}

/* Pushes the most the residual cycle through x takes around it. */
static void cancel_cycle(rt_graph *g, const cycle_ws *w, int x) {
    double f = RT_INF_CAP;
    int v = x;
    do {
        int k = w->pred[v];
        if (g->e[k].res < f) f = g->e[k].res;
        v = g->e[k ^ 1].to;
    } while (v != x);
    do {
        int k = w->pred[v];
        g->e[k].res -= f, g->e[k ^ 1].res += f;
        v = g->e[k ^ 1].to;
    } while (v != x);
}

static int least_busy(rt_graph *g, const flow_map *map) {
    int ne = g->ne / 2;
    cycle_ws w = {NULL, malloc((size_t)g->n * sizeof(double)), 0, malloc((size_t)g->n * sizeof(int)),
                  LEAST_BUSY_BUDGET};
    double *cost = calloc((size_t)ne + 1, sizeof(double)), top = 0;
    if (!w.dist || !w.pred || !cost) {
        free(w.dist), free(w.pred), free(cost);
        return fu_errorf(FU_ERR_NOMEM, "flow: out of memory");
    }
    for (int e = 0; e < ne; e++) {
        double c = g->e[2 * e].cap;
        if (map->tag[e].v == FLOW_COMPUTE && c > 0 && c < RT_INF_CAP) cost[e] = 1 / c;
        if (cost[e] > top) top = cost[e];
    }
    w.cost = cost, w.tol = top * 1e-9;
    for (int x; w.budget > 0 && (x = negative_cycle(g, &w)) >= 0;) cancel_cycle(g, &w, x);
    free(w.dist), free(w.pred), free(cost);
    return FU_OK;
}

static const rt_flow_opts default_opts = {RT_CONV_RUNTIME, 0};

/* Hops, scratch and network of `sw` into ws->g (grown as needed). */
static int prepare(const rt_swarm *sw, const rt_flow_opts *opts, rt_flow_ws *ws, flow_map *map) {
    int n = sw->n_servers, rc;
    if (!ws->g && (rc = rt_graph_init(&ws->g, 4 + 4 * n))) return rc;
    if ((rc = rt__hops_build(sw, opts->allow_partial, &ws->hops))) return rc;
    unsigned char *has_pred = malloc((size_t)n + 1);
    if (!has_pred) return fu_errorf(FU_ERR_NOMEM, "flow: out of memory");
    rc = build_network(sw, opts, &ws->hops, ws->g, map, has_pred);
    free(has_pred);
    return rc;
}

double rt__flow_eval(const rt_swarm *sw, const rt_flow_opts *opts, rt_flow_ws *ws) {
    if (!opts) opts = &default_opts;
    if (prepare(sw, opts, ws, NULL)) return 0;
    double f = rt_graph_max_flow(ws->g, RT_N_SOURCE, RT_N_SINK);
    return f > 0 ? f : 0;
}

void rt__flow_ws_free(rt_flow_ws *ws) {
    if (!ws) return;
    rt_graph_free(ws->g);
    ws->g = NULL;
    rt__hops_free(&ws->hops);
}

void rt_flow_free(rt_flow *flow) {
    if (!flow) return;
    free(flow->server_flow);
    free(flow->hops);
    free(flow->hop_start);
    memset(flow, 0, sizeof *flow);
}

/* Node index of a hop end for ordering: servers by id, then the source (n) or sink (n + 1). */
static int hop_node(int id, int n) { return id == RT_SOURCE ? n : id == RT_SINK ? n + 1 : id; }

/* Orders hops whose ends hold node indices (hop_node). */
static int cmp_hop(const void *a, const void *b) {
    const rt_flow_hop *x = a, *y = b;
    if (x->from != y->from) return x->from - y->from;
    return x->to - y->to;
}

static int node_id(int x, int n) { return x == n ? RT_SOURCE : x == n + 1 ? RT_SINK : x; }

/* Reads the per-server and per-hop flow of the solved network into `flow`. */
static int read_flow(const rt_graph *g, const flow_map *map, int n, double value, rt_flow *flow) {
    int ne = g->ne / 2, nh = 0;
    double *sf = calloc((size_t)n + 1, sizeof(double));
    rt_flow_hop *hops = malloc(((size_t)ne + 1) * sizeof *hops);
    int *start = calloc((size_t)n + 2, sizeof(int));
    if (!sf || !hops || !start) {
        free(sf), free(hops), free(start);
        return fu_errorf(FU_ERR_NOMEM, "flow: out of memory");
    }
    for (int e = 0; e < ne; e++) {
        flow_tag t = map->tag[e];
        double x = rt_graph_edge_flow(g, e);
        if (t.u == FLOW_STRUCT) continue;
        if (t.v == FLOW_COMPUTE) sf[t.u] = x;
        else if (x > 0) hops[nh++] = (rt_flow_hop){hop_node(t.u, n), hop_node(t.v, n), x};
    }
    qsort(hops, (size_t)nh, sizeof *hops, cmp_hop);
    for (int x = 0; x < nh; x++) {
        start[hops[x].from + 1]++;
        hops[x].from = node_id(hops[x].from, n);
        hops[x].to = node_id(hops[x].to, n);
    }
    for (int u = 0; u <= n; u++) start[u + 1] += start[u];
    rt_flow_free(flow);
    *flow = (rt_flow){value, n, sf, nh, hops, start};
    return FU_OK;
}

int rt_flow_compute(const rt_swarm *sw, const rt_flow_opts *opts, rt_flow *flow, double *value) {
    if (!sw) return fu_errorf(FU_ERR_INVALID, "rt_flow_compute: NULL swarm");
    if (!opts) opts = &default_opts;
    rt_flow_ws ws = {0};
    flow_map map = {NULL, 0};
    int rc = prepare(sw, opts, &ws, flow ? &map : NULL);
    if (!rc) {
        double f = rt_graph_max_flow(ws.g, RT_N_SOURCE, RT_N_SINK);
        if (f < 0) f = 0;
        if (value) *value = f;
        if (flow) rc = least_busy(ws.g, &map);
        if (flow && !rc) rc = read_flow(ws.g, &map, sw->n_servers, f, flow);
    }
    free(map.tag);
    rt__flow_ws_free(&ws);
    return rc;
}

double rt_flow_hop_value(const rt_flow *flow, int from, int to) {
    if (!flow || !flow->hop_start) return 0;
    int n = flow->n, u = hop_node(from, n), v = hop_node(to, n);
    if (u < 0 || u > n || v < 0 || v > n + 1 || (u == n && from != RT_SOURCE)) return 0;
    int lo = flow->hop_start[u], hi = flow->hop_start[u + 1];
    while (lo < hi) {
        int mid = (lo + hi) / 2, w = hop_node(flow->hops[mid].to, n);
        if (w == v) return flow->hops[mid].flow;
        if (w < v) lo = mid + 1;
        else hi = mid;
    }
    return 0;
}

double rt_max_flow(const rt_swarm *sw, const rt_flow_opts *opts) {
    double v = 0;
    if (rt_flow_compute(sw, opts, NULL, &v)) return 0;
    return v;
}
