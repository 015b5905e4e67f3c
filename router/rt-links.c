/* rt-links.c -- the swarm's sparse links: per-server adjacency lists (out and in, sorted by
 * peer), the swarm-wide default link, Helix's pruning, and the valid hops of a placement.
 * Single-threaded like the rest of the router; the swarm owns every list. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "router-impl.h"
#include "status.h"

/* --- adjacency lists ----------------------------------------------------------------------- */

/* Binary search: the index of `peer`, or -(insertion point) - 1. */
static int adj_search(const rt_adj *a, int peer) {
    int lo = 0, hi = a->n;
    while (lo < hi) {
        int mid = (lo + hi) / 2;
        if (a->peer[mid] < peer) lo = mid + 1;
        else if (a->peer[mid] > peer) hi = mid;
        else return mid;
    }
    return -lo - 1;
}

int rt__adj_find(const rt_adj *a, int peer) {
    int k = adj_search(a, peer);
    return k >= 0 ? k : -1;
}

/* Inserts or updates the entry for `peer`. */
static int adj_put(rt_adj *a, int peer, rt_link l) {
    int k = adj_search(a, peer);
    if (k >= 0) {
        a->link[k] = l;
        return FU_OK;
    }
    k = -k - 1;
    if (a->n == a->cap) {
        int c = a->cap ? a->cap * 2 : 4;
        int *p = realloc(a->peer, (size_t)c * sizeof *p);
        if (p) a->peer = p;
        rt_link *q = realloc(a->link, (size_t)c * sizeof *q);
        if (q) a->link = q;
        if (!p || !q) return fu_errorf(FU_ERR_NOMEM, "links: out of memory");
        a->cap = c;
    }
    memmove(a->peer + k + 1, a->peer + k, (size_t)(a->n - k) * sizeof *a->peer);
    memmove(a->link + k + 1, a->link + k, (size_t)(a->n - k) * sizeof *a->link);
    a->peer[k] = peer;
    a->link[k] = l;
    a->n++;
    return FU_OK;
}

static void adj_del(rt_adj *a, int peer) {
    int k = adj_search(a, peer);
    if (k < 0) return;
    memmove(a->peer + k, a->peer + k + 1, (size_t)(a->n - k - 1) * sizeof *a->peer);
    memmove(a->link + k, a->link + k + 1, (size_t)(a->n - k - 1) * sizeof *a->link);
    a->n--;
}

void rt__adj_free(rt_adj *a) {
    free(a->peer);
    free(a->link);
    memset(a, 0, sizeof *a);
}

int rt__adj_copy(rt_adj *dst, const rt_adj *src) {
    memset(dst, 0, sizeof *dst);
    if (!src->n) return FU_OK;
    dst->peer = malloc((size_t)src->n * sizeof *dst->peer);
    dst->link = malloc((size_t)src->n * sizeof *dst->link);
    if (!dst->peer || !dst->link) {
        rt__adj_free(dst);
        return fu_errorf(FU_ERR_NOMEM, "links: out of memory");
    }
    memcpy(dst->peer, src->peer, (size_t)src->n * sizeof *dst->peer);
    memcpy(dst->link, src->link, (size_t)src->n * sizeof *dst->link);
    dst->n = dst->cap = src->n;
    return FU_OK;
}

int rt__on_default(const rt_swarm *sw, int i, int j) {
    return sw->default_link.bandwidth > 0 && i != j && sw->on_default && sw->on_default[i] &&
           sw->on_default[j];
}

void rt__links_clear(rt_swarm *sw, int i) {
    rt_adj *o = &sw->out[i], *in = &sw->in[i];
    for (int k = 0; k < o->n; k++) adj_del(&sw->in[o->peer[k]], i);
    for (int k = 0; k < in->n; k++) adj_del(&sw->out[in->peer[k]], i);
    o->n = in->n = 0;
    if (sw->on_default) sw->on_default[i] = 0;
}

/* --- accessors ------------------------------------------------------------------------------ */

/* Sets the server link i -> j in both lists; an absent link off the default drops the entry. */
static int set_server_link(rt_swarm *sw, int i, int j, rt_link l) {
    if (l.bandwidth <= 0 && !rt__on_default(sw, i, j)) {
        adj_del(&sw->out[i], j);
        adj_del(&sw->in[j], i);
        return FU_OK;
    }
    int rc = adj_put(&sw->out[i], j, l);
    if (!rc && (rc = adj_put(&sw->in[j], i, l))) adj_del(&sw->out[i], j);
    return rc;
}

int rt_swarm_set_link(rt_swarm *sw, int from, int to, double bandwidth, double latency) {
    if (!sw) return fu_errorf(FU_ERR_INVALID, "rt_swarm_set_link: NULL swarm");
    if (!isfinite(bandwidth) || !isfinite(latency) || latency < 0)
        return fu_errorf(FU_ERR_INVALID, "link %d->%d: bad bandwidth/latency", from, to);
    rt_link l = {bandwidth > 0 ? bandwidth : 0, latency};
    int n = sw->n_servers;
    if (from == RT_SOURCE && to >= 0 && to < n) sw->from_source[to] = l;
    else if (to == RT_SINK && from >= 0 && from < n) sw->to_sink[from] = l;
    else if (from >= 0 && from < n && to >= 0 && to < n && from != to) {
        int rc = set_server_link(sw, from, to, l);
        if (rc) return rc;
    } else return fu_errorf(FU_ERR_INVALID, "link %d->%d: bad endpoints", from, to);
    sw->version++;
    return FU_OK;
}

rt_link rt_swarm_link(const rt_swarm *sw, int from, int to) {
    rt_link none = {0, 0};
    if (!sw) return none;
    int n = sw->n_servers;
    if (from == RT_SOURCE && to >= 0 && to < n) return sw->from_source[to];
    if (to == RT_SINK && from >= 0 && from < n) return sw->to_sink[from];
    if (from < 0 || from >= n || to < 0 || to >= n || from == to) return none;
    int k = rt__adj_find(&sw->out[from], to);
    if (k >= 0) return sw->out[from].link[k];
    return rt__on_default(sw, from, to) ? sw->default_link : none;
}

int rt_swarm_out_degree(const rt_swarm *sw, int i) {
    return sw && i >= 0 && i < sw->n_servers ? sw->out[i].n : 0;
}

rt_link rt_swarm_out_link(const rt_swarm *sw, int i, int k, int *to) {
    rt_link none = {0, 0};
    if (!sw || i < 0 || i >= sw->n_servers || k < 0 || k >= sw->out[i].n) return none;
    if (to) *to = sw->out[i].peer[k];
    return sw->out[i].link[k];
}

/* --- pruning -------------------------------------------------------------------------------- */

typedef struct cand {
    int peer;
    double bw;
} cand;

/* Faster first, then the lower peer id. */
static int cmp_cand(const void *a, const void *b) {
    const cand *x = a, *y = b;
    if (x->bw != y->bw) return x->bw < y->bw ? 1 : -1;
    return (x->peer > y->peer) - (x->peer < y->peer);
}

/* Server i's links in one direction (explicit with bandwidth > 0, then up to `want` through the
 * default), sorted best first, into c[]; returns the count. */
static int gather(const rt_swarm *sw, int i, const rt_adj *a, int want, cand *c) {
    int m = 0;
    for (int k = 0; k < a->n; k++)
        if (a->link[k].bandwidth > 0) c[m++] = (cand){a->peer[k], a->link[k].bandwidth};
    int dflt = sw->default_link.bandwidth > 0 && sw->on_default && sw->on_default[i];
    for (int j = 0, got = 0; dflt && j < sw->n_servers && got < want; j++)
        if (rt__on_default(sw, i, j) && rt__adj_find(a, j) < 0) {
            c[m++] = (cand){j, sw->default_link.bandwidth};
            got++;
        }
    qsort(c, (size_t)m, sizeof *c, cmp_cand);
    return m;
}

/* Adds i -> j with its current value to the new lists. */
static int keep_link(const rt_swarm *sw, rt_adj *out, rt_adj *in, int i, int j) {
    rt_link l = rt_swarm_link(sw, i, j);
    int rc = adj_put(&out[i], j, l);
    return rc ? rc : adj_put(&in[j], i, l);
}

/* Builds the surviving lists into out/in ([n] each, zeroed). */
static int prune_into(const rt_swarm *sw, int k, rt_adj *out, rt_adj *in) {
    int n = sw->n_servers, maxdeg = 0, rc = FU_OK;
    for (int i = 0; i < n; i++) {
        if (sw->out[i].n > maxdeg) maxdeg = sw->out[i].n;
        if (sw->in[i].n > maxdeg) maxdeg = sw->in[i].n;
    }
    cand *c = malloc(((size_t)maxdeg + (size_t)k + 1) * sizeof *c);
    if (!c) return fu_errorf(FU_ERR_NOMEM, "prune: out of memory");
    for (int i = 0; i < n && !rc; i++) {
        int m = gather(sw, i, &sw->out[i], k, c);
        for (int a = 0; a < m && a < k && !rc; a++) rc = keep_link(sw, out, in, i, c[a].peer);
        m = gather(sw, i, &sw->in[i], k, c);
        for (int a = 0; a < m && a < k && !rc; a++) rc = keep_link(sw, out, in, c[a].peer, i);
    }
    free(c);
    return rc;
}

int rt_swarm_prune_links(rt_swarm *sw, int k) {
    if (!sw || k < 1) return fu_errorf(FU_ERR_INVALID, "rt_swarm_prune_links: bad arguments");
    int n = sw->n_servers;
    rt_adj *out = calloc((size_t)sw->cap + 1, sizeof *out), *in = calloc((size_t)sw->cap + 1, sizeof *in);
    int rc = out && in ? prune_into(sw, k, out, in) : fu_errorf(FU_ERR_NOMEM, "prune: out of memory");
    if (rc) {
        for (int i = 0; out && in && i < n; i++) rt__adj_free(&out[i]), rt__adj_free(&in[i]);
        free(out), free(in);
        return rc;
    }
    for (int i = 0; i < n; i++) rt__adj_free(&sw->out[i]), rt__adj_free(&sw->in[i]);
    free(sw->out), free(sw->in);
    sw->out = out;
    sw->in = in;
    sw->default_link = (rt_link){0, 0};
    if (sw->on_default) memset(sw->on_default, 0, (size_t)sw->cap);
    sw->version++;
    return FU_OK;
}

/* --- valid hops ----------------------------------------------------------------------------- */

static int hops_push(rt_hops *h, int j, double bw) {
    if (h->n == h->cap) {
        int c = h->cap ? h->cap * 2 : 256;
        int *t = realloc(h->to, (size_t)c * sizeof *t);
        if (t) h->to = t;
        double *b = realloc(h->bw, (size_t)c * sizeof *b);
        if (b) h->bw = b;
        if (!t || !b) return fu_errorf(FU_ERR_NOMEM, "hops: out of memory");
        h->cap = c;
    }
    h->to[h->n] = j;
    h->bw[h->n++] = bw;
    return FU_OK;
}

/* Buckets the serving on-default servers by first block (for default-link hops). */
static int index_defaults(const rt_swarm *sw, rt_hops *h) {
    int n = sw->n_servers, L = sw->model.n_layers;
    if (h->by_cap < n + 1 || h->first_cap < L + 2) {
        free(h->by_first), free(h->first_at);
        h->by_first = malloc(((size_t)n + 1) * sizeof(int));
        h->first_at = malloc(((size_t)L + 2) * sizeof(int));
        if (!h->by_first || !h->first_at) {
            h->by_cap = h->first_cap = 0;
            return fu_errorf(FU_ERR_NOMEM, "hops: out of memory");
        }
        h->by_cap = n + 1;
        h->first_cap = L + 2;
    }
    memset(h->first_at, 0, ((size_t)L + 2) * sizeof(int));
    for (int j = 0; j < n; j++)
        if (sw->on_default[j] && rt_swarm_serving(sw, j)) h->first_at[sw->servers[j].first + 1]++;
    for (int b = 0; b <= L; b++) h->first_at[b + 1] += h->first_at[b];
    int *fill = h->first_at; /* reused as cursors, then restored */
    for (int j = 0; j < n; j++)
        if (sw->on_default[j] && rt_swarm_serving(sw, j)) h->by_first[fill[sw->servers[j].first]++] = j;
    for (int b = L; b > 0; b--) h->first_at[b] = h->first_at[b - 1];
    h->first_at[0] = 0;
    return FU_OK;
}

/* Hops of server i through the default link (pairs without an entry). */
static int default_hops(const rt_swarm *sw, int i, int allow_partial, rt_hops *h) {
    int end = sw->servers[i].last, lo = allow_partial ? 0 : end, rc = FU_OK;
    for (int b = lo; b <= end && !rc; b++)
        for (int x = h->first_at[b]; x < h->first_at[b + 1] && !rc; x++) {
            int j = h->by_first[x];
            if (j != i && rt__hop_valid(sw, i, j, allow_partial) && rt__adj_find(&sw->out[i], j) < 0)
                rc = hops_push(h, j, sw->default_link.bandwidth);
        }
    return rc;
}

int rt__hops_build(const rt_swarm *sw, int allow_partial, rt_hops *h) {
    int n = sw->n_servers, rc = FU_OK;
    int dflt = sw->default_link.bandwidth > 0 && sw->on_default;
    if (h->start_cap < n + 1) {
        free(h->start);
        h->start = malloc(((size_t)n + 1) * sizeof(int));
        h->start_cap = h->start ? n + 1 : 0;
        if (!h->start) return fu_errorf(FU_ERR_NOMEM, "hops: out of memory");
    }
    if (dflt && (rc = index_defaults(sw, h))) return rc;
    h->n = 0;
    h->n_srv = n;
    for (int i = 0; i < n && !rc; i++) {
        h->start[i] = h->n;
        if (!rt_swarm_serving(sw, i)) continue;
        const rt_adj *a = &sw->out[i];
        for (int k = 0; k < a->n && !rc; k++)
            if (a->link[k].bandwidth > 0 && rt__hop_valid(sw, i, a->peer[k], allow_partial))
                rc = hops_push(h, a->peer[k], a->link[k].bandwidth);
        if (!rc && dflt && sw->on_default[i]) rc = default_hops(sw, i, allow_partial, h);
    }
    h->start[n] = h->n;
    return rc;
}

void rt__hops_free(rt_hops *h) {
    if (!h) return;
    free(h->start), free(h->to), free(h->bw), free(h->by_first), free(h->first_at);
    memset(h, 0, sizeof *h);
}
