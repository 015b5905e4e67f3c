/* rt-stripe.c -- stripe placements: the servers of one kind at one site laid out as one pipeline
 * over a head, a tail or the whole of the model, every group at the same cut. Few long spans on
 * like machines keep chains short and their KV balanced; groups on the same range run in
 * parallel, so a fast group's head can feed two slower tails. Single-threaded, like the router. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "router-impl.h"
#include "status.h"

enum {
    STRIPE_MAX_SERVERS = 512, /* the site grouping compares every pair */
    STRIPE_EXHAUSTIVE = 5,    /* up to this many groups, all 4^groups role choices at each cut */
    STRIPE_MAX_GROUPS = 16,   /* beyond it no stripes; between, a descent per cut */
    STRIPE_SWEEPS = 4,        /* the descent's passes over the groups at most */
    STRIPE_CUTS = 20,         /* cuts at multiples of n_layers / 20 */
    STRIPE_MAX_K = 16,
    STRIPE_MAX_SCORES = 4000, /* scores at most, whatever the groups */
};
#define STRIPE_SITE_LATENCY_S 0.005 /* servers linked this closely share a site */

enum { ROLE_NONE, ROLE_HEAD, ROLE_TAIL, ROLE_FULL };

typedef struct group {
    int *ids; /* servers in id order */
    int *seq; /* the same, in pipeline order for the roles being laid */
    int n;
    int blocks; /* the most blocks the group can hold */
} group;

typedef struct link_pair {
    double cost;
    int exit, entry; /* server ids */
} link_pair;

typedef struct stripes {
    const rt_swarm *base;
    group g[STRIPE_MAX_GROUPS];
    int n_groups;
    link_pair pair[STRIPE_MAX_GROUPS][STRIPE_MAX_GROUPS];
    int src[STRIPE_MAX_GROUPS][2]; /* members best linked from the coordinator */
    int scores; /* taken so far */
    /* the k best so far, best first */
    int k, n_best;
    double best_score[STRIPE_MAX_K];
    uint32_t best_roles[STRIPE_MAX_K];
    int best_cut[STRIPE_MAX_K];
} stripes;

static int find_root(int *parent, int i) {
    while (parent[i] != i) i = parent[i] = parent[parent[i]];
    return i;
}

/* site[i]: a representative of the servers linked to i (either way) within the site latency. */
static void sites(const rt_swarm *sw, int *site) {
    int n = sw->n_servers;
    for (int i = 0; i < n; i++) site[i] = i;
    for (int i = 0; i < n; i++) {
        for (int j = i + 1; j < n && rt__placeable(sw, i); j++) {
            if (!rt__placeable(sw, j)) continue;
            rt_link a = rt_swarm_link(sw, i, j), b = rt_swarm_link(sw, j, i);
            int near = (a.bandwidth > 0 && a.latency <= STRIPE_SITE_LATENCY_S) ||
                       (b.bandwidth > 0 && b.latency <= STRIPE_SITE_LATENCY_S);
            if (near) site[find_root(site, i)] = find_root(site, j);
        }
    }
    for (int i = 0; i < n; i++) site[i] = find_root(site, i);
}

/* The group of server i (same site and kind as its first member), or -1 if none yet. */
static int group_of(const stripes *s, const int *site, int i) {
    const rt_server *v = &s->base->servers[i];
    for (int g = 0; g < s->n_groups; g++) {
        int j = s->g[g].ids[0];
        if (site[j] == site[i] && !strcmp(s->base->servers[j].kind, v->kind)) return g;
    }
    return -1;
}

/* Groups the placeable servers by site and kind; 0 groups when there are too many. */
static int make_groups(stripes *s, int *site) {
    const rt_swarm *sw = s->base;
    sites(sw, site);
    for (int i = 0; i < sw->n_servers; i++) {
        if (!rt__placeable(sw, i)) continue;
        int g = group_of(s, site, i);
        if (g < 0 && s->n_groups == STRIPE_MAX_GROUPS) {
            s->n_groups = 0; /* too many groups: no stripes */
            return FU_OK;
        }
        if (g < 0) {
            g = s->n_groups++;
            s->g[g].ids = malloc((size_t)sw->n_servers * sizeof(int));
            s->g[g].seq = malloc((size_t)sw->n_servers * sizeof(int));
            if (!s->g[g].ids || !s->g[g].seq) return fu_errorf(FU_ERR_NOMEM, "stripes: out of memory");
        }
        s->g[g].ids[s->g[g].n++] = i;
        s->g[g].blocks += rt_swarm_max_layers(sw, i);
    }
    return FU_OK;
}

static void free_groups(stripes *s) {
    for (int g = 0; g < STRIPE_MAX_GROUPS; g++) free(s->g[g].ids), free(s->g[g].seq);
}

static int role_of(uint32_t roles, int g) {
    return (int)(roles >> (2 * g)) & 3;
}

static uint32_t with_role(uint32_t roles, int g, int r) {
    return (roles & ~(3u << (2 * g))) | (uint32_t)r << (2 * g);
}

/* The range of a role at cut c; an empty one for ROLE_NONE. */
static void role_range(int role, int c, int L, int *a, int *b) {
    *a = role == ROLE_TAIL ? c : 0;
    *b = role == ROLE_HEAD ? c : role == ROLE_NONE ? 0 : L;
}

/* 1 if the roles cover every block within each group's capacity, and the cut matters (some
 * group ends or starts at it) or c is the first cut (roles of no cut are tried once). */
static int roles_fit(const stripes *s, uint32_t roles, int c, int first_cut) {
    int L = s->base->model.n_layers, head = 0, tail = 0, at_cut = 0;
    for (int g = 0; g < s->n_groups; g++) {
        int r = role_of(roles, g), a, b;
        role_range(r, c, L, &a, &b);
        if (b - a > s->g[g].blocks) return 0;
        head |= r == ROLE_HEAD || r == ROLE_FULL;
        tail |= r == ROLE_TAIL || r == ROLE_FULL;
        at_cut |= r == ROLE_HEAD || r == ROLE_TAIL;
    }
    return head && tail && (at_cut || c == first_cut);
}

/* Seconds to send a 1000-token prompt's activations over from -> to (RT_SOURCE: from the
 * coordinator); a missing link costs infinity. */
static double link_cost(const rt_swarm *sw, int from, int to) {
    rt_link l = from == RT_SOURCE ? sw->from_source[to] : rt_swarm_link(sw, from, to);
    double bytes = 1000 * (from == RT_SOURCE ? sw->model.token_bytes : sw->model.token_bytes + sw->model.act_bytes);
    return l.bandwidth > 0 ? l.latency + bytes / l.bandwidth : INFINITY;
}

/* For every ordered pair of groups, the best linked exit of g and entry of h; for every group,
 * its two members best linked from the coordinator. */
static void best_links(stripes *s) {
    const rt_swarm *sw = s->base;
    for (int g = 0; g < s->n_groups; g++) {
        for (int h = 0; h < s->n_groups; h++) {
            link_pair *p = &s->pair[g][h];
            p->cost = INFINITY, p->exit = s->g[g].ids[0], p->entry = s->g[h].ids[0];
            for (int i = 0; g != h && i < s->g[g].n; i++) {
                for (int j = 0; j < s->g[h].n; j++) {
                    double c = link_cost(sw, s->g[g].ids[i], s->g[h].ids[j]);
                    if (c < p->cost) p->cost = c, p->exit = s->g[g].ids[i], p->entry = s->g[h].ids[j];
                }
            }
        }
        double c0 = INFINITY, c1 = INFINITY;
        s->src[g][0] = s->g[g].ids[0], s->src[g][1] = s->g[g].ids[s->g[g].n > 1]; /* when no link is known */
        for (int i = 0; i < s->g[g].n; i++) {
            int id = s->g[g].ids[i];
            double c = link_cost(sw, RT_SOURCE, id);
            if (c < c0) c1 = c0, s->src[g][1] = s->src[g][0], c0 = c, s->src[g][0] = id;
            else if (c < c1) c1 = c, s->src[g][1] = id;
        }
    }
}

/* The cheapest link pair into tail group h from a head group (into), or out of head group h to
 * a tail group (!into); NULL if there is none of that role. */
static const link_pair *best_pair(const stripes *s, uint32_t roles, int h, int into) {
    const link_pair *best = NULL;
    for (int g = 0; g < s->n_groups; g++) {
        if (role_of(roles, g) != (into ? ROLE_HEAD : ROLE_TAIL)) continue;
        const link_pair *p = into ? &s->pair[g][h] : &s->pair[h][g];
        if (!best || p->cost < best->cost) best = p;
    }
    return best;
}

/* Puts server `id` at position `to` of the group's pipeline, the others in order. */
static void place_member(group *g, int id, int to) {
    int i = 0;
    while (i < g->n && g->seq[i] != id) i++;
    if (i == g->n || to < 0) return;
    memmove(&g->seq[i], &g->seq[i + 1], (size_t)(g->n - 1 - i) * sizeof(int));
    memmove(&g->seq[to + 1], &g->seq[to], (size_t)(g->n - 1 - to) * sizeof(int));
    g->seq[to] = id;
}

/* Orders group g's pipeline of m members for its links: a head's last member is the one best
 * linked to a tail, a tail's first the one best linked from a head, and a head's or a whole
 * group's first the one best linked from the coordinator; the rest keep id order. */
static void order_group(stripes *s, uint32_t roles, int g, int m) {
    group *x = &s->g[g];
    int r = role_of(roles, g), exit = -1;
    memcpy(x->seq, x->ids, (size_t)x->n * sizeof(int));
    const link_pair *p = r == ROLE_HEAD || r == ROLE_TAIL ? best_pair(s, roles, g, r == ROLE_TAIL) : NULL;
    if (p && r == ROLE_TAIL) place_member(x, p->entry, 0);
    if (p && r == ROLE_HEAD) exit = p->exit;
    int entry = s->src[g][0] != exit || x->n == 1 ? s->src[g][0] : s->src[g][1];
    if (r == ROLE_HEAD || r == ROLE_FULL) place_member(x, entry, 0);
    if (exit >= 0) place_member(x, exit, m - 1); /* after the entry, so that it stays last */
}

/* Lays group g on [a, b) as one pipeline of its first m = min(members, b - a) in seq order,
 * each one's share in proportion to the most it can hold (largest remainders first, the
 * earliest on ties); the others hold nothing. */
static int lay_group(rt_swarm *sw, const group *g, int a, int b) {
    int len = b - a, m = g->n < len ? g->n : len, left = len, blocks = 0, rc = FU_OK;
    int k[STRIPE_MAX_SERVERS], mx[STRIPE_MAX_SERVERS];
    double frac[STRIPE_MAX_SERVERS];
    for (int i = 0; i < m; i++) blocks += mx[i] = rt_swarm_max_layers(sw, g->seq[i]);
    for (int i = 0; i < g->n; i++) {
        double raw = i < m ? (double)len * mx[i] / blocks : 0;
        k[i] = i < m && (int)floor(raw) > mx[i] ? mx[i] : (int)floor(raw); /* rounding: never over its limit */
        frac[i] = i < m ? raw - k[i] : -1, left -= k[i];
    }
    for (; left > 0; left--) { /* fits: the m hold at least len (roles_fit, and each holds >= 1) */
        int best = -1;
        for (int i = 0; i < m; i++)
            if (k[i] < mx[i] && (best < 0 || frac[i] > frac[best])) best = i;
        if (best < 0) break;
        k[best]++, frac[best] = -2;
    }
    for (int i = 0, at = a; i < g->n && !rc; at += k[i], i++)
        rc = rt_swarm_set_span(sw, g->seq[i], k[i] > 0 ? at : 0, k[i] > 0 ? at + k[i] : 0);
    return rc;
}

/* Writes the stripes of `roles` at cut c into sw (a copy of the base). */
static int lay(stripes *s, rt_swarm *sw, uint32_t roles, int c) {
    int rc = FU_OK;
    for (int g = 0; g < s->n_groups && !rc; g++) {
        int a, b;
        role_range(role_of(roles, g), c, sw->model.n_layers, &a, &b);
        order_group(s, roles, g, s->g[g].n < b - a ? s->g[g].n : b - a);
        rc = lay_group(sw, &s->g[g], a, b);
    }
    return rc;
}

/* Keeps (roles, c) among the k best when its score beats the k-th (earlier ones win ties). */
static void keep(stripes *s, double score, uint32_t roles, int c) {
    for (int i = 0; i < s->n_best; i++)
        if (s->best_roles[i] == roles && s->best_cut[i] == c) return; /* a descent may come back to one */
    int at = s->n_best;
    while (at > 0 && score > s->best_score[at - 1]) at--;
    if (at >= s->k) return;
    int n = s->n_best < s->k ? s->n_best + 1 : s->k;
    for (int i = n - 1; i > at; i--)
        s->best_score[i] = s->best_score[i - 1], s->best_roles[i] = s->best_roles[i - 1],
        s->best_cut[i] = s->best_cut[i - 1];
    s->best_score[at] = score, s->best_roles[at] = roles, s->best_cut[at] = c;
    s->n_best = n;
}

/* Scores `roles` at cut c on the scratch copy tmp into *v (-1: they do not fit) and keeps them
 * among the best. */
static int try_roles(stripes *s, rt_swarm *tmp, uint32_t roles, int c, int first_cut, rt__stripe_score_fn score,
                     void *ctx, double *v) {
    *v = -1;
    if (!roles_fit(s, roles, c, first_cut) || s->scores >= STRIPE_MAX_SCORES) return FU_OK;
    s->scores++;
    int rc = lay(s, tmp, roles, c);
    if (!rc) rc = score(ctx, tmp, v);
    if (!rc && *v >= 0) keep(s, *v, roles, c);
    return rc;
}

/* Many groups, at cut c: from the widest role each group can take (the whole model, else the
 * head and the tail in turn), every group in turn takes the role that scores best with the
 * others fixed, until a pass changes nothing. */
static int descend(stripes *s, rt_swarm *tmp, int c, rt__stripe_score_fn score, void *ctx) {
    int L = s->base->model.n_layers, rc = FU_OK;
    uint32_t roles = 0;
    for (int g = 0; g < s->n_groups; g++) {
        int b = s->g[g].blocks, head = g % 2 == 0;
        int r = b >= L ? ROLE_FULL : head && b >= c ? ROLE_HEAD : b >= L - c ? ROLE_TAIL : ROLE_NONE;
        roles = with_role(roles, g, r);
    }
    double cur;
    rc = try_roles(s, tmp, roles, c, c, score, ctx, &cur);
    for (int pass = 0, moved = 1; pass < STRIPE_SWEEPS && moved && !rc; pass++) {
        moved = 0;
        for (int g = 0; g < s->n_groups && !rc; g++) {
            for (int r = 0; r < 4 && !rc; r++) {
                uint32_t cand = with_role(roles, g, r);
                double v;
                if (cand != roles && !(rc = try_roles(s, tmp, cand, c, c, score, ctx, &v)) && v > cur)
                    cur = v, roles = cand, moved = 1;
            }
        }
    }
    return rc;
}

/* Scores the roles at every cut on the scratch copy tmp: all of them for a few groups, a descent
 * for more. */
static int enumerate(stripes *s, rt_swarm *tmp, rt__stripe_score_fn score, void *ctx) {
    int L = s->base->model.n_layers, step = L / STRIPE_CUTS > 0 ? L / STRIPE_CUTS : 1, rc = FU_OK;
    for (int c = step; c < L && !rc; c += step) {
        if (s->n_groups > STRIPE_EXHAUSTIVE) {
            rc = descend(s, tmp, c, score, ctx);
            continue;
        }
        for (uint32_t roles = 0; roles < 1u << (2 * s->n_groups) && !rc; roles++) {
            double v;
            rc = try_roles(s, tmp, roles, c, step, score, ctx, &v);
        }
    }
    return rc;
}

/* Copies of the base with the kept stripes, best first, into out[0 .. *n). */
static int build(stripes *s, rt_swarm *out, int *n) {
    int rc = FU_OK;
    for (int i = 0; i < s->n_best && !rc; i++) {
        rc = rt_swarm_clone(&out[i], s->base);
        if (!rc) rc = lay(s, &out[i], s->best_roles[i], s->best_cut[i]);
        if (!rc) ++*n;
        else rt_swarm_free(&out[i]);
    }
    if (rc) {
        for (int i = 0; i < *n; i++) rt_swarm_free(&out[i]);
        *n = 0;
    }
    return rc;
}

int rt__stripe_best(const rt_swarm *base, rt__stripe_score_fn score, void *ctx, int k, rt_swarm *out, int *n) {
    *n = 0;
    if (!base || !score || k <= 0 || base->n_servers > STRIPE_MAX_SERVERS || base->model.n_layers < 2)
        return FU_OK;
    stripes s = {.base = base, .k = k < STRIPE_MAX_K ? k : STRIPE_MAX_K};
    int *site = malloc((size_t)base->n_servers * sizeof(int));
    rt_swarm tmp = {0};
    int rc = site ? make_groups(&s, site) : fu_errorf(FU_ERR_NOMEM, "stripes: out of memory");
    if (!rc && s.n_groups > 0) best_links(&s);
    if (!rc && s.n_groups > 0) rc = rt_swarm_clone(&tmp, base);
    if (!rc && s.n_groups > 0) rc = enumerate(&s, &tmp, score, ctx);
    if (!rc) rc = build(&s, out, n);
    rt_swarm_free(&tmp);
    free_groups(&s);
    free(site);
    return rc;
}
