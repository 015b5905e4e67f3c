/* rt-flow.c -- Dinic's max flow on real-valued capacities and the swarm's flow network
 * (Helix's in -> start -> end -> out construction, runtime and MILP conventions). */
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

/* Pushes up to `f` from u towards t along the level graph; returns the amount pushed. */
static double dinic_dfs(rt_graph *g, int u, int t, double f) {
    if (u == t) return f;
    for (; g->iter[u] >= 0; g->iter[u] = g->e[g->iter[u]].next) {
        int k = g->iter[u];
        int v = g->e[k].to;
        if (g->e[k].res <= g->eps || g->level[v] != g->level[u] + 1) continue;
        double d = dinic_dfs(g, v, t, f < g->e[k].res ? f : g->e[k].res);
        if (d > 0) {
            g->e[k].res -= d;
            g->e[k ^ 1].res += d;
            return d;
        }
    }
    return 0;
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

/* Builds the network into `g`; if `map` is not NULL it receives, per edge index, a tag:
 * -1 structural, server i's compute edge as -2 - i, hop u->v as u * (n+2) + v. */
static int build_network(const rt_swarm *sw, const rt_flow_opts *o, rt_graph *g, int *map,
                         int map_cap) {
    int n = sw->n_servers, L = sw->model.n_layers, rc;
    double tok = sw->model.token_bytes, act = sw->model.act_bytes;
    int ilp = o->conv == RT_CONV_ILP;
    if ((rc = rt__graph_reset(g, 4 + 4 * n))) return rc;
#define ADD(u, v, c, tag)                                      \
    do {                                                       \
        int e_ = rt_graph_add_edge(g, (u), (v), (c));          \
        if (e_ < 0) return e_;                                 \
        if (map && e_ < map_cap) map[e_] = (tag);              \
    } while (0)
    ADD(RT_N_SOURCE, RT_N_SRC_OUT, ilp ? RT_INF_CAP : div_cap(sw->source_nic_out, tok), -1);
    ADD(RT_N_SINK_IN, RT_N_SINK, ilp ? RT_INF_CAP : div_cap(sw->sink_nic_in, tok), -1);
    for (int i = 0; i < n; i++) {
        if (!rt_swarm_serving(sw, i)) continue;
        const rt_server *s = &sw->servers[i];
        int k = s->last - s->first;
        double tp = rt_swarm_tput(sw, i, k);
        /* predecessors / successors among servers decide the bytes per token of the NICs */
        int srv_in = 0, srv_out = 0;
        for (int j = 0; j < n && !(srv_in && srv_out); j++) {
            if (!srv_in && rt__hop_valid(sw, j, i, o->allow_partial) &&
                sw->links[(size_t)j * sw->cap + i].bandwidth > 0)
                srv_in = 1;
            if (!srv_out && rt__hop_valid(sw, i, j, o->allow_partial) &&
                sw->links[(size_t)i * sw->cap + j].bandwidth > 0)
                srv_out = 1;
        }
        if (ilp) {
            double nic = s->nic_in > 0 && (s->nic_out <= 0 || s->nic_in < s->nic_out) ? s->nic_in
                                                                                    : s->nic_out;
            double c = div_cap(nic, act);
            ADD(RT_N_IN(i), RT_N_START(i), RT_INF_CAP, -1);
            ADD(RT_N_START(i), RT_N_END(i), tp < c ? tp : c, -2 - i);
            ADD(RT_N_END(i), RT_N_OUT(i), RT_INF_CAP, -1);
        } else {
            ADD(RT_N_IN(i), RT_N_START(i), div_cap(s->nic_in, srv_in ? tok + act : tok), -1);
            ADD(RT_N_START(i), RT_N_END(i), tp, -2 - i);
            ADD(RT_N_END(i), RT_N_OUT(i), div_cap(s->nic_out, srv_out ? tok + act : tok), -1);
        }
        if (s->first == 0 && sw->from_source[i].bandwidth > 0)
            ADD(RT_N_SRC_OUT, RT_N_IN(i), sw->from_source[i].bandwidth / tok, n * (n + 2) + i);
        if (s->last == L && sw->to_sink[i].bandwidth > 0)
            ADD(RT_N_OUT(i), RT_N_SINK_IN, sw->to_sink[i].bandwidth / tok, i * (n + 2) + n + 1);
        for (int j = 0; j < n; j++) {
            double bw = sw->links[(size_t)i * sw->cap + j].bandwidth;
            if (bw > 0 && rt__hop_valid(sw, i, j, o->allow_partial))
                ADD(RT_N_OUT(i), RT_N_IN(j), bw / (ilp ? act : tok + act), i * (n + 2) + j);
        }
    }
#undef ADD
    return FU_OK;
}

static const rt_flow_opts default_opts = {RT_CONV_RUNTIME, 0};

double rt__flow_eval(const rt_swarm *sw, const rt_flow_opts *opts, rt_flow_ws *ws) {
    if (!opts) opts = &default_opts;
    if (!ws->g && rt_graph_init(&ws->g, 4 + 4 * sw->n_servers)) return 0;
    if (build_network(sw, opts, ws->g, NULL, 0)) return 0;
    double f = rt_graph_max_flow(ws->g, RT_N_SOURCE, RT_N_SINK);
    return f > 0 ? f : 0;
}

void rt__flow_ws_free(rt_flow_ws *ws) {
    if (!ws) return;
    rt_graph_free(ws->g);
    ws->g = NULL;
}

void rt_flow_free(rt_flow *flow) {
    if (!flow) return;
    free(flow->server_flow);
    free(flow->hop_flow);
    memset(flow, 0, sizeof *flow);
}

int rt_flow_compute(const rt_swarm *sw, const rt_flow_opts *opts, rt_flow *flow, double *value) {
    if (!sw) return fu_errorf(FU_ERR_INVALID, "rt_flow_compute: NULL swarm");
    if (!opts) opts = &default_opts;
    int n = sw->n_servers, rc;
    rt_graph *g = NULL;
    if ((rc = rt_graph_init(&g, 4 + 4 * n))) return rc;
    /* edges: 2 + per server 3 + 2 + n */
    int map_cap = 2 + n * (5 + n) + 8;
    int *map = malloc((size_t)map_cap * sizeof(int));
    if (!map) {
        rt_graph_free(g);
        return fu_errorf(FU_ERR_NOMEM, "flow: out of memory");
    }
    if ((rc = build_network(sw, opts, g, map, map_cap))) goto err;
    double f = rt_graph_max_flow(g, RT_N_SOURCE, RT_N_SINK);
    if (f < 0) f = 0;
    if (value) *value = f;
    if (flow) {
        size_t n2 = (size_t)(n + 2) * (size_t)(n + 2);
        double *sf = calloc((size_t)n + 1, sizeof(double));
        double *hf = calloc(n2, sizeof(double));
        if (!sf || !hf) {
            free(sf), free(hf);
            rc = fu_errorf(FU_ERR_NOMEM, "flow: out of memory");
            goto err;
        }
        rt_flow_free(flow);
        flow->value = f;
        flow->n = n;
        flow->server_flow = sf;
        flow->hop_flow = hf;
        int ne = g->ne / 2;
        for (int e = 0; e < ne && e < map_cap; e++) {
            if (map[e] == -1) continue;
            double x = rt_graph_edge_flow(g, e);
            if (map[e] < -1) sf[-2 - map[e]] = x;
            else hf[map[e]] = x;
        }
    }
    rc = FU_OK;
err:
    free(map);
    rt_graph_free(g);
    return rc;
}

double rt_max_flow(const rt_swarm *sw, const rt_flow_opts *opts) {
    double v = 0;
    if (rt_flow_compute(sw, opts, NULL, &v)) return 0;
    return v;
}
