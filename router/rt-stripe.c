/* rt-stripe.c -- stripe placements: the servers of one kind at one site, or all the servers of
 * a site, laid out as one pipeline over a head, a tail or the whole of the model, every group at
 * the same cut. Few long spans on like machines keep chains short and their KV balanced; groups
 * on the same range run in parallel, so a fast group's head can feed two slower tails, and the
 * heads of two sites can feed a third site's tail. Single-threaded, like the router. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "router-impl.h"
#include "status.h"

enum {
    STRIPE_MAX_SERVERS = 512, /* the site grouping compares every pair */
    STRIPE_EXHAUSTIVE = 1024, /* up to this many role choices at a cut, all of them */
    STRIPE_MAX_GROUPS = 16,   /* beyond it no stripes; between, a descent per cut */
    STRIPE_SWEEPS = 4,        /* the descent's passes over the groups at most */
    STRIPE_CUTS = 20,         /* cuts at multiples of n_layers / 20 */
    STRIPE_MAX_K = 16,
    STRIPE_MAX_SCORES = 4000, /* scores at most, whatever the groups */
    STRIPE_STAGGER = 2,       /* blocks a boundary moves at most off another site's */
};
#define STRIPE_SITE_LATENCY_S 0.005 /* servers linked this closely share a site */

/* A group's choice: its role in the low two bits, and ROLE_LEAN for the lean layout (whole-site
 * groups only); ROLE_BITS bits a group in a uint64_t. */
enum { ROLE_NONE, ROLE_HEAD, ROLE_TAIL, ROLE_FULL, ROLE_LEAN = 4 };
#define ROLE_BITS 3

typedef struct group {
    int *ids;  /* servers in id order */
    int *pick; /* the same, those that hold the most blocks first (then by id) */
    int *seq;  /* scratch: pipeline order for the roles being laid, its first m members laid */
    int n, m;
    int blocks; /* the most blocks the group can hold */
    int site;   /* the site's representative server */
} group;

/* One group's pipeline: its stages (servers) in order. */
typedef struct layout {
    int n;
    int k[STRIPE_MAX_SERVERS];   /* blocks of each stage */
    int lim[STRIPE_MAX_SERVERS]; /* the most each stage can hold */
    int who[STRIPE_MAX_SERVERS]; /* its server */
} layout;

/* The links a member is chosen by for an end of its group's pipeline. */
enum { COST_SOURCE, COST_SINK, COST_OUT, COST_IN };

typedef struct stripes {
    const rt_swarm *base;
    int by_kind; /* groups of one kind at one site, else whole sites */
    group g[STRIPE_MAX_GROUPS];
    int n_groups;
    double *to_group; /* [n_servers * STRIPE_MAX_GROUPS] each server's best link into a group */
    int *owner;       /* [L + 1] scratch: the site of a stage boundary there, -1 none */
    layout lay;       /* scratch */
    int scores;       /* taken so far */
    /* the k best so far, best first */
    int k, n_best;
    double best_score[STRIPE_MAX_K];
    uint64_t best_roles[STRIPE_MAX_K];
    int best_cut[STRIPE_MAX_K];
    uint64_t best_hash[STRIPE_MAX_K]; /* of the spans laid */
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

/* The group of server i (same site, and kind when grouping by kind, as its first member), or -1
 * if none yet. */
static int group_of(const stripes *s, const int *site, int i) {
    const rt_server *v = &s->base->servers[i];
    for (int g = 0; g < s->n_groups; g++) {
        int j = s->g[g].ids[0];
        if (site[j] == site[i] && (!s->by_kind || !strcmp(s->base->servers[j].kind, v->kind))) return g;
    }
    return -1;
}

/* Orders group g's pick list: the members that hold the most blocks first, then by id. */
static void sort_pick(const rt_swarm *sw, group *g) {
    memcpy(g->pick, g->ids, (size_t)g->n * sizeof(int));
    for (int i = 1; i < g->n; i++) { /* insertion sort: stable, and ids come in order */
        int id = g->pick[i], mx = rt_swarm_max_layers(sw, id), j = i;
        for (; j > 0 && rt_swarm_max_layers(sw, g->pick[j - 1]) < mx; j--) g->pick[j] = g->pick[j - 1];
        g->pick[j] = id;
    }
}

/* Groups the placeable servers by site (and kind); 0 groups when there are too many. */
static int make_groups(stripes *s, int *site) {
    const rt_swarm *sw = s->base;
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
            s->g[g].pick = malloc((size_t)sw->n_servers * sizeof(int));
            s->g[g].seq = malloc((size_t)sw->n_servers * sizeof(int));
            if (!s->g[g].ids || !s->g[g].pick || !s->g[g].seq)
                return fu_errorf(FU_ERR_NOMEM, "stripes: out of memory");
            s->g[g].site = site[i];
        }
        s->g[g].ids[s->g[g].n++] = i;
        s->g[g].blocks += rt_swarm_max_layers(sw, i);
    }
    for (int g = 0; g < s->n_groups; g++) sort_pick(sw, &s->g[g]);
    return FU_OK;
}

static void free_groups(stripes *s) {
    for (int g = 0; g < STRIPE_MAX_GROUPS; g++) free(s->g[g].ids), free(s->g[g].pick), free(s->g[g].seq);
}

/* Group g's choice in `roles` (its role and ROLE_LEAN), and its role alone. */
static int choice_of(uint64_t roles, int g) {
    return (int)(roles >> (ROLE_BITS * g)) & 7;
}

static int role_of(uint64_t roles, int g) {
    return choice_of(roles, g) & 3;
}

static uint64_t with_choice(uint64_t roles, int g, int c) {
    return (roles & ~((uint64_t)7 << (ROLE_BITS * g))) | (uint64_t)c << (ROLE_BITS * g);
}

/* The choices a group may take: the four roles, and by whole sites the lean head, tail and
 * whole model too; choice_code maps 0 .. n_choices - 1 onto them. */
static int n_choices(const stripes *s) {
    return s->by_kind ? 4 : 7;
}

static int choice_code(int d) {
    return d < 4 ? d : d + 1;
}

/* The range of a role at cut c; an empty one for ROLE_NONE. */
static void role_range(int role, int c, int L, int *a, int *b) {
    *a = role == ROLE_TAIL ? c : 0;
    *b = role == ROLE_HEAD ? c : role == ROLE_NONE ? 0 : L;
}

/* 1 if the roles cover every block within each group's capacity, and the cut matters (some
 * group ends or starts at it) or c is the first cut (roles of no cut are tried once). */
static int roles_fit(const stripes *s, uint64_t roles, int c, int first_cut) {
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

/* Seconds to send a 1000-token prompt over from -> to (RT_SOURCE: from the coordinator, RT_SINK:
 * back to it); a missing link costs infinity. */
static double link_cost(const rt_swarm *sw, int from, int to) {
    rt_link l = from == RT_SOURCE ? sw->from_source[to] : rt_swarm_link(sw, from, to);
    int ends = from == RT_SOURCE || to == RT_SINK;
    double bytes = 1000 * (ends ? sw->model.token_bytes : sw->model.token_bytes + sw->model.act_bytes);
    return l.bandwidth > 0 ? l.latency + bytes / l.bandwidth : INFINITY;
}

/* For every placeable server and group, the cost of its best link into a member of the group. */
static void best_links(stripes *s) {
    const rt_swarm *sw = s->base;
    for (int i = 0; i < sw->n_servers; i++) {
        for (int h = 0; h < s->n_groups && rt__placeable(sw, i); h++) {
            double *c = &s->to_group[(size_t)i * STRIPE_MAX_GROUPS + h];
            *c = INFINITY;
            for (int j = 0; j < s->g[h].n; j++)
                if (s->g[h].ids[j] != i) *c = fmin(*c, link_cost(sw, i, s->g[h].ids[j]));
        }
    }
}

/* Server id's cost for one end of its pipeline (`which`): its link from the coordinator or to
 * it, its best links into the tails (summed), or its links from the heads' last members. */
static double end_cost(const stripes *s, uint64_t roles, int id, int which) {
    if (which == COST_SOURCE) return link_cost(s->base, RT_SOURCE, id);
    if (which == COST_SINK) return link_cost(s->base, id, RT_SINK);
    double c = 0;
    for (int h = 0; h < s->n_groups; h++) {
        const group *x = &s->g[h];
        int r = role_of(roles, h);
        if (which == COST_OUT && r == ROLE_TAIL) c += s->to_group[(size_t)id * STRIPE_MAX_GROUPS + h];
        if (which == COST_IN && r == ROLE_HEAD && x->m > 0) c += link_cost(s->base, x->seq[x->m - 1], id);
    }
    return c;
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

/* Moves the member of seq[from .. to) with the least cost for an end (`which`) to position
 * `at` (from or to - 1); on ties the one nearest it stays. */
static void place_end(const stripes *s, uint64_t roles, group *x, int from, int to, int which, int at) {
    int best = -1;
    double bc = INFINITY;
    for (int t = from; t < to; t++) {
        int i = at == from ? t : to - 1 - (t - from);
        double c = end_cost(s, roles, x->seq[i], which);
        if (best < 0 || c < bc) best = i, bc = c;
    }
    if (best >= 0) place_member(x, x->seq[best], at);
}

/* The fewest members of g's pick list that hold len blocks in all (every one when none do). */
static int cover(const rt_swarm *sw, const group *g, int len) {
    int m = 0;
    for (int held = 0; m < g->n && held < len; m++) held += rt_swarm_max_layers(sw, g->pick[m]);
    return m;
}

/* Chooses group g's members for len blocks into seq[0 .. m) and orders them for their links.
 * The plain layout takes the first min(members, len) in id order, the lean one the fewest that
 * hold len, those holding the most first. Then a head's last member is the one best linked
 * into the tails, a tail's first the one best linked from the heads' last members (heads go
 * first), a head's or a whole group's first the one best linked from the coordinator, and a
 * tail's or a whole group's last the one best linked back to it; the rest keep their order. */
static void choose_members(stripes *s, uint64_t roles, int g, int len) {
    group *x = &s->g[g];
    int r = role_of(roles, g), lean = choice_of(roles, g) & ROLE_LEAN;
    memcpy(x->seq, lean ? x->pick : x->ids, (size_t)x->n * sizeof(int));
    x->m = lean ? cover(s->base, x, len) : x->n < len ? x->n : len;
    int m = x->m;
    if (r == ROLE_HEAD) place_end(s, roles, x, 0, m, COST_OUT, m - 1);
    if (r == ROLE_TAIL) place_end(s, roles, x, 0, m, COST_IN, 0);
    if (r == ROLE_HEAD || r == ROLE_FULL) place_end(s, roles, x, 0, r == ROLE_HEAD ? m - 1 : m, COST_SOURCE, 0);
    if ((r == ROLE_TAIL || r == ROLE_FULL) && m > 1) place_end(s, roles, x, 1, m, COST_SINK, m - 1);
}

/* Group g's layout over len blocks: its chosen members in order, each one's share in proportion
 * to the most it can hold (the floors, then one more each to the largest remainders, the
 * earliest on ties, never over a limit; they hold at least len in all). */
static void layout_members(stripes *s, const group *g, int len) {
    layout *y = &s->lay;
    double frac[STRIPE_MAX_SERVERS];
    int cap = 0, left = len;
    for (y->n = 0; y->n < g->m; y->n++) {
        y->who[y->n] = g->seq[y->n];
        y->lim[y->n] = rt_swarm_max_layers(s->base, g->seq[y->n]);
        cap += y->lim[y->n];
    }
    for (int i = 0; i < y->n; i++) {
        double raw = (double)len * y->lim[i] / cap;
        y->k[i] = (int)floor(raw) > y->lim[i] ? y->lim[i] : (int)floor(raw);
        frac[i] = raw - y->k[i], left -= y->k[i];
    }
    for (; left > 0; left--) {
        int best = -1;
        for (int i = 0; i < y->n; i++)
            if (y->k[i] < y->lim[i] && (best < 0 || frac[i] > frac[best])) best = i;
        if (best < 0) break;
        y->k[best]++, frac[best] = -2;
    }
}

/* 1 if a boundary at `at` meets another site's. */
static int clash(const stripes *s, int at, int site) {
    return s->owner[at] >= 0 && s->owner[at] != site;
}

/* Moves each boundary between two stages of s->lay (from block a on) that meets another
 * site's by up to STRIPE_STAGGER blocks, within both stages' limits, so that no chain crosses
 * from one site's pipeline into another's midway. */
static void stagger(stripes *s, int a, int site) {
    layout *y = &s->lay;
    for (int i = 0, at = a; i + 1 < y->n; i++) {
        at += y->k[i];
        for (int d = 1; d <= STRIPE_STAGGER && clash(s, at, site); d++) {
            int up = y->k[i] + d <= y->lim[i] && y->k[i + 1] - d >= 1 && !clash(s, at + d, site);
            int down = !up && y->k[i] - d >= 1 && y->k[i + 1] + d <= y->lim[i + 1] && !clash(s, at - d, site);
            if (!up && !down) continue;
            int step = up ? d : -d;
            y->k[i] += step, y->k[i + 1] -= step, at += step;
            break;
        }
    }
}

/* Writes s->lay from block a into sw (group g's other members hold nothing) and marks its
 * boundaries as the site's where no other site has one. */
static int write_layout(stripes *s, rt_swarm *sw, const group *g, int a) {
    const layout *y = &s->lay;
    int rc = FU_OK;
    for (int i = 0; i < g->n && !rc; i++) rc = rt_swarm_set_span(sw, g->ids[i], 0, 0);
    for (int i = 0, at = a; i < y->n && !rc; at += y->k[i], i++) {
        if (y->k[i] > 0) rc = rt_swarm_set_span(sw, y->who[i], at, at + y->k[i]);
        if (i > 0 && s->owner[at] < 0) s->owner[at] = g->site;
    }
    return rc;
}

/* Writes the stripes of `roles` at cut c into sw (a copy of the base): every group's members
 * (the tails' after the others', for the heads' last members), then each group's layout in
 * turn, its boundaries staggered off those of the groups at other sites laid before it. */
static int lay(stripes *s, rt_swarm *sw, uint64_t roles, int c) {
    int rc = FU_OK, L = sw->model.n_layers, a, b;
    for (int l = 0; l <= L; l++) s->owner[l] = -1;
    for (int tails = 0; tails < 2; tails++) {
        for (int g = 0; g < s->n_groups; g++) {
            if ((role_of(roles, g) == ROLE_TAIL) != tails) continue;
            role_range(role_of(roles, g), c, L, &a, &b);
            choose_members(s, roles, g, b - a);
        }
    }
    for (int g = 0; g < s->n_groups && !rc; g++) {
        role_range(role_of(roles, g), c, L, &a, &b);
        layout_members(s, &s->g[g], b - a);
        stagger(s, a, s->g[g].site);
        rc = write_layout(s, sw, &s->g[g], a);
    }
    return rc;
}

/* A hash of every server's span in sw (FNV-1a). */
static uint64_t spans_hash(const rt_swarm *sw) {
    uint64_t h = 0xcbf29ce484222325ULL;
    for (int i = 0; i < sw->n_servers; i++) {
        h = (h ^ (uint64_t)sw->servers[i].first) * 0x100000001b3ULL;
        h = (h ^ (uint64_t)sw->servers[i].last) * 0x100000001b3ULL;
    }
    return h;
}

/* Keeps (roles, c), laid out as spans hashing to `hash`, among the k best when its score beats
 * the k-th (earlier ones win ties) and no kept one has the same spans. */
static void keep(stripes *s, double score, uint64_t roles, int c, uint64_t hash) {
    for (int i = 0; i < s->n_best; i++)
        if (s->best_hash[i] == hash) return; /* other choices, or a descent, may lay the same */
    int at = s->n_best;
    while (at > 0 && score > s->best_score[at - 1]) at--;
    if (at >= s->k) return;
    int n = s->n_best < s->k ? s->n_best + 1 : s->k;
    for (int i = n - 1; i > at; i--)
        s->best_score[i] = s->best_score[i - 1], s->best_roles[i] = s->best_roles[i - 1],
        s->best_cut[i] = s->best_cut[i - 1], s->best_hash[i] = s->best_hash[i - 1];
    s->best_score[at] = score, s->best_roles[at] = roles, s->best_cut[at] = c, s->best_hash[at] = hash;
    s->n_best = n;
}

/* Scores `roles` at cut c on the scratch copy tmp into *v (-1: they do not fit) and keeps them
 * among the best. */
static int try_roles(stripes *s, rt_swarm *tmp, uint64_t roles, int c, int first_cut, rt__stripe_score_fn score,
                     void *ctx, double *v) {
    *v = -1;
    if (!roles_fit(s, roles, c, first_cut) || s->scores >= STRIPE_MAX_SCORES) return FU_OK;
    s->scores++;
    int rc = lay(s, tmp, roles, c);
    if (!rc) rc = score(ctx, tmp, v);
    if (!rc && *v >= 0) keep(s, *v, roles, c, spans_hash(tmp));
    return rc;
}

/* Many groups, at cut c: from the widest role each group can take (the whole model, else the
 * head and the tail in turn), every group in turn takes the choice that scores best with the
 * others fixed, until a pass changes nothing. */
static int descend(stripes *s, rt_swarm *tmp, int c, rt__stripe_score_fn score, void *ctx) {
    int L = s->base->model.n_layers, rc = FU_OK;
    uint64_t roles = 0;
    for (int g = 0; g < s->n_groups; g++) {
        int b = s->g[g].blocks, head = g % 2 == 0;
        int r = b >= L ? ROLE_FULL : head && b >= c ? ROLE_HEAD : b >= L - c ? ROLE_TAIL : ROLE_NONE;
        roles = with_choice(roles, g, r);
    }
    double cur;
    rc = try_roles(s, tmp, roles, c, c, score, ctx, &cur);
    for (int pass = 0, moved = 1; pass < STRIPE_SWEEPS && moved && !rc; pass++) {
        moved = 0;
        for (int g = 0; g < s->n_groups && !rc; g++) {
            for (int d = 0; d < n_choices(s) && !rc; d++) {
                uint64_t cand = with_choice(roles, g, choice_code(d));
                double v;
                if (cand != roles && !(rc = try_roles(s, tmp, cand, c, c, score, ctx, &v)) && v > cur)
                    cur = v, roles = cand, moved = 1;
            }
        }
    }
    return rc;
}

/* The choices of every group numbered by `idx`, group 0's varying fastest. */
static uint64_t roles_at(const stripes *s, long idx) {
    uint64_t roles = 0;
    for (int g = 0; g < s->n_groups; g++, idx /= n_choices(s))
        roles = with_choice(roles, g, choice_code((int)(idx % n_choices(s))));
    return roles;
}

/* Scores the choices at every cut on the scratch copy tmp: all of them when they number at most
 * STRIPE_EXHAUSTIVE, else a descent. */
static int enumerate(stripes *s, rt_swarm *tmp, rt__stripe_score_fn score, void *ctx) {
    int L = s->base->model.n_layers, step = L / STRIPE_CUTS > 0 ? L / STRIPE_CUTS : 1, rc = FU_OK;
    long total = 1;
    for (int g = 0; g < s->n_groups && total <= STRIPE_EXHAUSTIVE; g++) total *= n_choices(s);
    for (int c = step; c < L && !rc; c += step) {
        if (total > STRIPE_EXHAUSTIVE) {
            rc = descend(s, tmp, c, score, ctx);
            continue;
        }
        for (long idx = 0; idx < total && !rc; idx++) {
            double v;
            rc = try_roles(s, tmp, roles_at(s, idx), c, step, score, ctx, &v);
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

int rt__stripe_best(const rt_swarm *base, rt__stripe_groups by, rt__stripe_score_fn score, void *ctx, int k,
                    rt_swarm *out, int *n) {
    *n = 0;
    if (!base || !score || k <= 0 || base->n_servers > STRIPE_MAX_SERVERS || base->model.n_layers < 2)
        return FU_OK;
    stripes s = {.base = base, .by_kind = by == RT__STRIPE_KIND_SITE, .k = k < STRIPE_MAX_K ? k : STRIPE_MAX_K};
    int *site = malloc((size_t)base->n_servers * sizeof(int));
    s.owner = malloc(((size_t)base->model.n_layers + 1) * sizeof(int));
    rt_swarm tmp = {0};
    int rc = site && s.owner ? FU_OK : fu_errorf(FU_ERR_NOMEM, "stripes: out of memory");
    if (!rc) sites(base, site);
    if (!rc) rc = make_groups(&s, site);
    s.to_group = rc ? NULL : malloc((size_t)base->n_servers * STRIPE_MAX_GROUPS * sizeof(double));
    if (!rc && !s.to_group) rc = fu_errorf(FU_ERR_NOMEM, "stripes: out of memory");
    if (!rc && s.n_groups > 0) best_links(&s);
    if (!rc && s.n_groups > 0) rc = rt_swarm_clone(&tmp, base);
    if (!rc && s.n_groups > 0) rc = enumerate(&s, &tmp, score, ctx);
    if (!rc) rc = build(&s, out, n);
    rt_swarm_free(&tmp);
    free_groups(&s);
    free(s.owner), free(s.to_group);
    free(site);
    return rc;
}
