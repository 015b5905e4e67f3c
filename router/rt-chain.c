/* rt-chain.c -- chains of whole spans for training: fewest hops, then the fastest bottleneck. */
#include <stdbool.h>
#include <stdlib.h>

#include "router.h"
#include "status.h"

/* The best chain found to each block boundary: hops, its slowest server, the server ending it. */
typedef struct rt_reach {
    int hops;       /* -1: not reached */
    double slowest; /* the smallest tokens/s along it */
    int via;        /* the server whose span ends here */
} rt_reach;

/* Server i's tokens/s for its whole span (0: unknown). */
static double rt_span_tput(const rt_server *sv) {
    const int k = sv->last - sv->first;
    return sv->tput && k >= 1 && k <= sv->n_tput ? sv->tput[k - 1] : 0;
}

/* Whether server i may be in a training chain. */
static bool rt_trainable(const rt_swarm *sw, int i, const int *avoid, int n_avoid) {
    const rt_server *sv = &sw->servers[i];
    if (sv->state != RT_SERVER_ACTIVE || sv->first >= sv->last || sv->first < 0 || sv->last > sw->model.n_layers)
        return false;
    for (int a = 0; a < n_avoid; a++)
        if (avoid[a] == i) return false;
    return true;
}

/* Extends the chains reaching block b by every trainable server starting there. */
static void rt_reach_from(const rt_swarm *sw, rt_reach *r, int b, const int *avoid, int n_avoid) {
    for (int i = 0; i < sw->n_servers; i++) {
        const rt_server *sv = &sw->servers[i];
        if (sv->first != b || !rt_trainable(sw, i, avoid, n_avoid)) continue;
        const double t = rt_span_tput(sv), slowest = r[b].hops == 0 || t < r[b].slowest ? t : r[b].slowest;
        rt_reach *e = &r[sv->last];
        if (e->hops < 0 || r[b].hops + 1 < e->hops || (r[b].hops + 1 == e->hops && slowest > e->slowest))
            *e = (rt_reach){r[b].hops + 1, slowest, i};
    }
}

int rt_train_chain(const rt_swarm *sw, const int *avoid, int n_avoid, int max, int *ids, int *n) {
    const int L = sw->model.n_layers;
    *n = 0;
    if (L < 1) return fu_errorf(FU_ERR_NOT_FOUND, "the model has no blocks");
    rt_reach *r = malloc((size_t)(L + 1) * sizeof *r);
    if (!r) return fu_errorf(FU_ERR_NOMEM, "training chain");
    for (int b = 0; b <= L; b++) r[b] = (rt_reach){b ? -1 : 0, 0, -1};
    for (int b = 0; b < L; b++)
        if (r[b].hops >= 0) rt_reach_from(sw, r, b, avoid, n_avoid);
    int rc = r[L].hops < 0 || r[L].hops > max
                 ? fu_errorf(FU_ERR_NOT_FOUND, "no chain of whole spans covers blocks [0, %d)", L)
                 : FU_OK;
    if (!rc) {
        *n = r[L].hops;
        for (int b = L, k = *n; b > 0; b = sw->servers[ids[k]].first) ids[--k] = r[b].via;
    }
    free(r);
    return rc;
}
