/* rt-swroute.c -- Swarm's adaptive routing for the simulator: each node (the coordinator or a
 * server) picks the next server for a request by interleaved weighted round robin over the
 * servers that can go on from where it ends, each weighted by an exponential moving average of
 * how long its last requests took to get through it (SWARM parallelism, Ryabinin et al. 2023,
 * appendix C, as Helix's simulator runs it). Single-threaded, like the simulator. */
#include <stdlib.h>

#include "router-impl.h"
#include "status.h"

typedef struct sw_node {
    int n;        /* candidates */
    int *next;    /* [n] server ids */
    double *prio; /* [n] the next pick goes to the smallest */
    double *ema;  /* [n] seconds a request took through that candidate, smoothed */
} sw_node;

struct rt__swroute {
    const rt_swarm *sw;
    sw_node *node; /* [n_servers + 1]: servers, then the coordinator */
    double smoothing;
};

static sw_node *node_of(rt__swroute *r, int from) {
    return &r->node[from == RT_SOURCE ? r->sw->n_servers : from];
}

/* Whether a request leaving `from` at block `end` can go to server j: serving, holding block
 * `end`, and linked from `from`. */
static int can_go(const rt_swarm *sw, int from, int end, int j) {
    const rt_server *s = &sw->servers[j];
    return j != from && end < sw->model.n_layers && rt_swarm_serving(sw, j) && s->first <= end && s->last > end &&
           rt_swarm_link(sw, from, j).bandwidth > 0;
}

/* The candidates of `from` (ending at block `end`), in server order, each at `initial`. */
static int fill_node(rt__swroute *r, int from, int end, double initial) {
    const rt_swarm *sw = r->sw;
    sw_node *x = node_of(r, from);
    int n = 0;
    for (int j = 0; j < sw->n_servers; j++) n += can_go(sw, from, end, j);
    x->next = malloc((size_t)(n > 0 ? n : 1) * sizeof *x->next);
    x->prio = malloc((size_t)(n > 0 ? n : 1) * sizeof *x->prio);
    x->ema = malloc((size_t)(n > 0 ? n : 1) * sizeof *x->ema);
    if (!x->next || !x->prio || !x->ema) return fu_errorf(FU_ERR_NOMEM, "swarm routing: out of memory");
    for (int j = 0; j < sw->n_servers; j++)
        if (can_go(sw, from, end, j)) x->next[x->n] = j, x->prio[x->n] = initial, x->ema[x->n] = initial, x->n++;
    return FU_OK;
}

int rt__swroute_init(rt__swroute **out, const rt_swarm *sw, double initial_s, double smoothing) {
    *out = NULL;
    rt__swroute *r = calloc(1, sizeof *r);
    if (!r) return fu_errorf(FU_ERR_NOMEM, "swarm routing: out of memory");
    r->sw = sw, r->smoothing = smoothing;
    r->node = calloc((size_t)sw->n_servers + 1, sizeof *r->node);
    int rc = r->node ? fill_node(r, RT_SOURCE, 0, initial_s) : fu_errorf(FU_ERR_NOMEM, "swarm routing: out of memory");
    for (int i = 0; i < sw->n_servers && !rc; i++)
        if (rt_swarm_serving(sw, i)) rc = fill_node(r, i, sw->servers[i].last, initial_s);
    if (rc) {
        rt__swroute_free(r);
        return rc;
    }
    *out = r;
    return FU_OK;
}

void rt__swroute_free(rt__swroute *r) {
    if (!r) return;
    for (int i = 0; r->node && i <= r->sw->n_servers; i++) free(r->node[i].next), free(r->node[i].prio), free(r->node[i].ema);
    free(r->node);
    free(r);
}

int rt__swroute_next(rt__swroute *r, int from) {
    sw_node *x = node_of(r, from);
    int best = -1;
    for (int c = 0; c < x->n; c++)
        if (best < 0 || x->prio[c] < x->prio[best]) best = c;
    if (best < 0) return -1;
    x->prio[best] += x->ema[best];
    return x->next[best];
}

void rt__swroute_observe(rt__swroute *r, int from, int to, double seconds) {
    sw_node *x = node_of(r, from);
    for (int c = 0; c < x->n; c++)
        if (x->next[c] == to) x->ema[c] = r->smoothing * seconds + (1 - r->smoothing) * x->ema[c];
}
