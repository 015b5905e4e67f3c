/* rt-place.c -- span placement: Petals' weakest-window rule, Swarm's equal stages, fusion's
 * max-flow search (simulated annealing), incremental join and coverage-safe rebalancing. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "clock.h"
#include "log.h"
#include "router-impl.h"
#include "status.h"

/* Servers a placement may use: every non-GONE server (SPARE ones become ACTIVE). */
int rt__placeable(const rt_swarm *sw, int i) {
    return sw->servers[i].state != RT_SERVER_GONE && rt_swarm_max_layers(sw, i) > 0;
}

/* Sets a span without the checks of rt_swarm_set_span (callers guarantee validity). */
static void put_span(rt_swarm *sw, int i, int first, int last) {
    rt_server *s = &sw->servers[i];
    s->first = first;
    s->last = last;
    if (last > first && s->state == RT_SERVER_SPARE) s->state = RT_SERVER_ACTIVE;
}

/* --- Petals ------------------------------------------------------------------------------- */

static double min_block(const double *t, int L) {
    double m = t[0];
    for (int l = 1; l < L; l++)
        if (t[l] < m) m = t[l];
    return m;
}

/* Adds t to the per-block throughput over [first, last). */
static void bt_add(double *bt, int first, int last, double t) {
    for (int l = first; l < last; l++) bt[l] += t;
}

/* Petals' rebalancing round over the kept per-block throughput bt; returns 1 if a server moved. */
static int petals_round(rt_swarm *sw, double *bt, double *scratch) {
    int L = sw->model.n_layers, moved = 0;
    rt__block_tput(sw, bt); /* afresh each round, so rounding does not pile up */
    for (int i = 0; i < sw->n_servers; i++) {
        if (!rt_swarm_serving(sw, i)) continue;
        rt_server *sv = &sw->servers[i];
        int k = sv->last - sv->first, old = sv->first;
        double before = min_block(bt, L), t = rt_swarm_tput(sw, i, k);
        bt_add(bt, old, old + k, -t);
        int s = rt__petals_best_start(bt, L, k, scratch);
        bt_add(bt, s, s + k, t);
        if (s != old && min_block(bt, L) > before * (1 + 1e-9)) {
            put_span(sw, i, s, s + k);
            moved = 1;
        } else {
            bt_add(bt, s, s + k, -t);
            bt_add(bt, old, old + k, t);
        }
    }
    return moved;
}

int rt_place_petals(rt_swarm *sw) {
    if (!sw) return fu_errorf(FU_ERR_INVALID, "rt_place_petals: NULL swarm");
    int L = sw->model.n_layers, n = sw->n_servers;
    double *bt = calloc((size_t)L, sizeof(double)), *scratch = malloc((size_t)2 * L * sizeof(double));
    if (!bt || !scratch) {
        free(bt), free(scratch);
        return fu_errorf(FU_ERR_NOMEM, "petals: out of memory");
    }
    for (int i = 0; i < n; i++) put_span(sw, i, 0, 0);
    /* joins in id order, each at its weakest window */
    for (int i = 0; i < n; i++) {
        if (!rt__placeable(sw, i)) continue;
        int k = rt_swarm_max_layers(sw, i);
        int s = rt__petals_best_start(bt, L, k, scratch);
        put_span(sw, i, s, s + k);
        bt_add(bt, s, s + k, rt_swarm_tput(sw, i, k));
    }
    /* rebalancing: a server moves to its best window when that lifts the weakest block */
    for (int round = 0; round < 4 * n + 4 && petals_round(sw, bt, scratch); round++) {
    }
    free(bt), free(scratch);
    sw->version++;
    int gap;
    if (rt_swarm_uncovered(sw, &gap))
        return fu_errorf(FU_ERR_EXHAUSTED, "petals: servers cannot cover block %d", gap);
    return FU_OK;
}

/* --- Swarm -------------------------------------------------------------------------------- */

typedef struct ranked {
    double t;
    int id;
} ranked;

/* Decreasing throughput, then increasing id (the order a stable sort by throughput gives). */
static int cmp_ranked(const void *a, const void *b) {
    const ranked *x = a, *y = b;
    if (x->t != y->t) return x->t < y->t ? 1 : -1;
    return x->id - y->id;
}

/* The placeable servers into order[], by decreasing tput holding k blocks (ties: id order);
 * returns their count or FU_ERR_NOMEM. */
static int sort_by_tput(const rt_swarm *sw, int k, int *order) {
    int n = sw->n_servers, m = 0;
    ranked *r = malloc(((size_t)n + 1) * sizeof *r);
    if (!r) return fu_errorf(FU_ERR_NOMEM, "placement: out of memory");
    for (int i = 0; i < n; i++)
        if (rt__placeable(sw, i)) r[m++] = (ranked){rt_swarm_tput(sw, i, k), i};
    qsort(r, (size_t)m, sizeof *r, cmp_ranked);
    for (int a = 0; a < m; a++) order[a] = r[a].id;
    free(r);
    return m;
}

int rt_place_swarm(rt_swarm *sw) {
    if (!sw) return fu_errorf(FU_ERR_INVALID, "rt_place_swarm: NULL swarm");
    int L = sw->model.n_layers, n = sw->n_servers, s = 0;
    for (int i = 0; i < n; i++) {
        put_span(sw, i, 0, 0);
        if (!rt__placeable(sw, i)) continue;
        int k = rt_swarm_max_layers(sw, i);
        if (!s || k < s) s = k;
    }
    if (!s) return fu_errorf(FU_ERR_EXHAUSTED, "swarm: no servers");
    int stages = (L + s - 1) / s;
    double *tot = calloc((size_t)stages, sizeof(double));
    int *order = malloc((size_t)n * sizeof(int));
    if (!tot || !order) {
        free(tot), free(order);
        return fu_errorf(FU_ERR_NOMEM, "swarm: out of memory");
    }
    int m = sort_by_tput(sw, s, order);
    if (m < 0) {
        free(tot), free(order);
        return m;
    }
    for (int a = 0; a < m; a++) {
        int st = 0;
        for (int t = 1; t < stages; t++)
            if (tot[t] < tot[st]) st = t;
        int first = st * s, last = first + s < L ? first + s : L;
        put_span(sw, order[a], first, last);
        tot[st] += rt_swarm_tput(sw, order[a], last - first);
    }
    free(tot), free(order);
    sw->version++;
    if (m < stages) return fu_errorf(FU_ERR_EXHAUSTED, "swarm: %d servers for %d stages", m, stages);
    return FU_OK;
}

/* --- fusion's search ---------------------------------------------------------------------- */

typedef struct plc {
    int *first, *len; /* [n] */
} plc;

static void plc_apply(rt_swarm *sw, const plc *p) {
    for (int i = 0; i < sw->n_servers; i++)
        if (rt__placeable(sw, i)) put_span(sw, i, p->first[i], p->first[i] + p->len[i]);
}

static void plc_read(const rt_swarm *sw, plc *p) {
    for (int i = 0; i < sw->n_servers; i++) {
        p->first[i] = sw->servers[i].first;
        p->len[i] = sw->servers[i].last - sw->servers[i].first;
    }
}

/* Secondary score: capacity of the weakest block (normalised), so that on a plateau of equal
 * flow the search prefers placements with slack at the bottleneck. */
static double weak_block(const rt_swarm *sw, double *bt) {
    rt__block_tput(sw, bt);
    return min_block(bt, sw->model.n_layers);
}

typedef struct search_ctx {
    rt_swarm *sw;
    const rt_flow_opts *fo;
    rt_flow_ws ws;
    double *bt;
    long evals;
    long max_evals;    /* > 0: the evaluation budget */
    double t_end;      /* fu_now_s() deadline; 0: no clock */
    const int *ids;    /* the placeable servers, strongest first */
    int m;
    uint64_t rng;
    plc best, cur, nxt;
    double best_score, best_flow;
} search_ctx;

static double score(search_ctx *c, double *flow_out) {
    double f = rt__flow_eval(c->sw, c->fo, &c->ws);
    c->evals++;
    if (flow_out) *flow_out = f;
    return f + 1e-3 * weak_block(c->sw, c->bt);
}

/* Builds a candidate by mutating server i (and maybe j) of `cur` into `nxt`; returns 0 if the
 * move is a no-op. */
static int mutate(const rt_swarm *sw, const plc *cur, plc *nxt, const int *ids, int m,
                  uint64_t *rng) {
    int n = sw->n_servers, L = sw->model.n_layers;
    memcpy(nxt->first, cur->first, (size_t)n * sizeof(int));
    memcpy(nxt->len, cur->len, (size_t)n * sizeof(int));
    int i = ids[rt__rng_int(rng, m)], j = ids[rt__rng_int(rng, m)];
    int maxi = rt_swarm_max_layers(sw, i), maxj = rt_swarm_max_layers(sw, j);
    int f = cur->first[i], k = cur->len[i], e = f + k;
    int ej = cur->first[j] + cur->len[j];
    switch (rt__rng_int(rng, 8)) {
    case 0: /* shift */
        f += rt__rng_int(rng, 2) ? 1 + rt__rng_int(rng, 3) : -1 - rt__rng_int(rng, 3);
        break;
    case 1: /* grow/shrink at the end */
        k += rt__rng_int(rng, 2) ? 1 : -1;
        break;
    case 2: /* grow/shrink at the start */
        if (rt__rng_int(rng, 2)) f--, k++;
        else f++, k--;
        break;
    case 3: /* start where j ends, keep length */
        if (cur->len[j] == 0 || ej >= L) return 0;
        f = ej;
        break;
    case 4: /* end where j starts */
        if (cur->len[j] == 0 || cur->first[j] == 0) return 0;
        e = cur->first[j];
        if (e - f < 1 || e - f > maxi) f = e - k;
        k = e - f;
        break;
    case 5: /* join j's stage */
        if (cur->len[j] == 0 || cur->len[j] > maxi) return 0;
        f = cur->first[j];
        k = cur->len[j];
        break;
    case 6: /* swap spans */
        if (i == j || cur->len[j] > maxi || cur->len[i] > maxj || cur->len[j] == 0) return 0;
        nxt->first[j] = cur->first[i];
        nxt->len[j] = cur->len[i];
        f = cur->first[j];
        k = cur->len[j];
        break;
    default: /* bridge: start where j ends, end at some server's start within reach */
    {
        if (cur->len[j] == 0 || ej >= L) return 0;
        int h = ids[rt__rng_int(rng, m)], target = cur->first[h];
        if (cur->len[h] == 0 || cur->first[h] + cur->len[h] == L) target = L;
        f = ej;
        k = target - f;
        if (k < 1 || k > maxi) k = 1 + rt__rng_int(rng, maxi);
        break;
    }
    }
    if (k < 1) k = 1;
    if (k > maxi) k = maxi;
    if (f < 0) f = 0;
    if (f + k > L) f = L - k;
    if (f == cur->first[i] && k == cur->len[i] && nxt->first[j] == cur->first[j]) return 0;
    nxt->first[i] = f;
    nxt->len[i] = k;
    return 1;
}

/* Progress of an annealing run begun at `begin` (time) and e0 (evaluations) towards the
 * slice's end t_end / e_end (0: that bound is off), as the larger fraction; `it` counts tries,
 * at most 64 per evaluation, so a run of no-op moves ends too. */
static double progress(const search_ctx *c, double begin, double t_end, long e0, long e_end, long it) {
    double frac = 0;
    if (t_end > 0) frac = (fu_now_s() - begin) / (t_end - begin > 1e-9 ? t_end - begin : 1e-9);
    if (e_end > 0) {
        double span = (double)(e_end - e0 > 0 ? e_end - e0 : 1);
        double fe = (double)(c->evals - e0) / span, fi = (double)it / (64 * span + 64);
        if (fe > frac) frac = fe;
        if (fi > frac) frac = fi;
    }
    return frac;
}

/* Accepts nxt as the current placement; records it if it is the best so far. */
static void accept(search_ctx *c, double ns, double nf) {
    int n = c->sw->n_servers;
    plc tmp = c->cur;
    c->cur = c->nxt;
    c->nxt = tmp;
    if (ns > c->best_score) {
        c->best_score = ns;
        c->best_flow = nf;
        memcpy(c->best.first, c->cur.first, (size_t)n * sizeof(int));
        memcpy(c->best.len, c->cur.len, (size_t)n * sizeof(int));
    }
}

/* One annealing run from `start` until t_end (fu_now_s(); 0: no clock) or e_end evaluations
 * (0: no count), whichever comes first; the best result goes to c->best. */
static void anneal(search_ctx *c, const plc *start, double t_end, long e_end) {
    int n = c->sw->n_servers;
    memcpy(c->cur.first, start->first, (size_t)n * sizeof(int));
    memcpy(c->cur.len, start->len, (size_t)n * sizeof(int));
    plc_apply(c->sw, &c->cur);
    double fl, sc = score(c, &fl);
    double scale = c->best_flow > 0 ? c->best_flow : (fl > 0 ? fl : 1);
    double t0 = 0.03 * scale, t1 = 1e-4 * scale, begin = t_end > 0 ? fu_now_s() : 0;
    long e0 = c->evals;
    for (long it = 0;; it++) {
        double frac = progress(c, begin, t_end, e0, e_end, it);
        if (frac >= 1) break; /* checked every try: one evaluation of a large swarm is slow */
        double temp = t0 * pow(t1 / t0, frac < 1 ? frac : 1);
        if (!mutate(c->sw, &c->cur, &c->nxt, c->ids, c->m, &c->rng)) continue;
        plc_apply(c->sw, &c->nxt);
        double nf, ns = score(c, &nf);
        if (ns >= sc || rt__rng_unit(&c->rng) < exp((ns - sc) / temp)) {
            accept(c, ns, nf);
            sc = ns;
        }
    }
}

/* Seed: equal stages of length s, servers assigned (strongest first) to the stage with the
 * lowest capacity; servers that cannot hold s blocks get the largest span they can, placed at
 * the weakest window. */
static void seed_stages(rt_swarm *sw, int s, const int *ids, int m, double *bt, double *scratch) {
    int L = sw->model.n_layers, stages = (L + s - 1) / s;
    for (int a = 0; a < m; a++) put_span(sw, ids[a], 0, 0);
    rt__block_tput(sw, bt); /* then kept up to date as servers are placed */
    for (int a = 0; a < m; a++) {
        int i = ids[a], k = rt_swarm_max_layers(sw, i);
        if (k > s) k = s;
        int best = 0;
        double bv = 0;
        for (int st = 0; st < stages; st++) {
            double v = bt[st * s];
            if (st == 0 || v < bv) bv = v, best = st;
        }
        int first = best * s, last = first + k < L ? first + k : L;
        if (k < s) {
            first = rt__petals_best_start(bt, L, k, scratch);
            last = first + k;
        }
        put_span(sw, i, first, last);
        bt_add(bt, first, last, rt_swarm_tput(sw, i, last - first));
    }
}

static int best_window(rt_swarm *sw, int id, const rt_flow_opts *fo, rt_flow_ws *ws, int *first,
                       int *last, double *flow);

/* --- stage-packing seed -------------------------------------------------------------------- *
 *
 * Servers are grouped into regions (components of links at least a quarter as fast as the
 * fastest server link) and types (same region, same profile). For a target flow F, a dynamic
 * program over (first unplaced block, servers used per type, region and size class of the
 * previous stage) decides whether the blocks can be cut into consecutive stages, each held by
 * a group of same-region servers whose summed capacity at that stage length reaches F (only
 * minimal groups are tried), where consecutive stages in different regions need
 * |prev| * |cur| * (slowest link between the regions) >= F. Binary search on F gives the best
 * such packing; leftover servers are then added where they raise the flow most. */

typedef struct stype {
    int count, maxk, rep, region; /* rep: a member server id */
    double best;                  /* max over k of k * tput(k): block-capacity it can add */
} stype;

#define DP_SIZES 3 /* size classes of the previous group: 1, 2, >= 3 */

typedef struct dp_ctx {
    const rt_swarm *sw;
    stype *t;
    int nt, L, nreg;
    long prod;       /* number of used-count vectors */
    long nx;         /* previous-group classes: 1 + nreg * DP_SIZES */
    long *radix;     /* [nt] */
    int *prev;       /* [(L+1) * prod * nx] predecessor state + 1 (0 = unreachable) */
    int *used;       /* [nt] scratch */
    int *combo;      /* [nt] scratch */
    double *regcap;  /* [nreg * nreg] slowest link capacity (tokens/s) between regions */
    int *mstart;     /* [nt + 1] members of type t: members[mstart[t] .. mstart[t + 1]) */
    int *members;    /* [m] server ids by type, each type in ids order */
    double deadline; /* fu_now_s() limit (0: none); past it dp_feasible gives up */
    long max_visits; /* > 0: give up after this many steps (the clock-free bound) */
    int timed_out;
    long found;      /* final state reached, or -1 */
    long visits;
} dp_ctx;

static void dp_dfs(dp_ctx *d, long idx, double F);

static double ttput(const dp_ctx *d, int t, int len) { return rt_swarm_tput(d->sw, d->t[t].rep, len); }

/* Counts a step; 1 once the deadline or the step budget has passed. */
static int dp_stop(dp_ctx *d) {
    if (d->timed_out) return 1;
    d->visits++;
    if ((d->max_visits > 0 && d->visits > d->max_visits) ||
        (d->deadline > 0 && (d->visits & 1023) == 0 && fu_now_s() > d->deadline))
        d->timed_out = 1;
    return d->timed_out;
}

/* A minimal group of `size` servers reaching sum >= F for stage [l, l + len) in region reg:
 * records the state it leads to and searches on from there. */
static void dp_take(dp_ctx *d, int l, int len, long st, long x, int reg, int size, double sum, double F) {
    for (int u = 0; u < d->nt; u++)
        if (d->combo[u] && sum - ttput(d, u, len) >= F) return;
    if (x > 0) {
        int pr = (int)((x - 1) / DP_SIZES), ps = (int)((x - 1) % DP_SIZES) + 1;
        if (pr != reg && ps * (size < DP_SIZES ? size : DP_SIZES) * d->regcap[pr * d->nreg + reg] < F) return;
    }
    long nst = st;
    for (int u = 0; u < d->nt; u++) nst += d->combo[u] * d->radix[u];
    long nx = 1 + reg * DP_SIZES + (size < DP_SIZES ? size : DP_SIZES) - 1;
    long idx = ((long)(l + len) * d->prod + nst) * d->nx + nx;
    if (d->prev[idx]) return;
    d->prev[idx] = (int)(((long)l * d->prod + st) * d->nx + x) + 1;
    if (l + len == d->L) {
        d->found = idx;
        return;
    }
    int save_u[d->nt], save_c[d->nt];
    memcpy(save_u, d->used, sizeof save_u);
    memcpy(save_c, d->combo, sizeof save_c);
    dp_dfs(d, idx, F);
    memcpy(d->used, save_u, sizeof save_u);
    memcpy(d->combo, save_c, sizeof save_c);
}

/* Enumerates minimal groups of region `reg` for stage [l, l + len) from state (l, st, x). */
static void dp_groups(dp_ctx *d, int l, int len, long st, long x, int reg, int t, int size,
                      double sum, double F) {
    if (dp_stop(d)) return;
    if (sum >= F) {
        dp_take(d, l, len, st, x, reg, size, sum, F);
        return;
    }
    if (t == d->nt || d->found >= 0) return;
    dp_groups(d, l, len, st, x, reg, t + 1, size, sum, F); /* none of type t */
    double c = ttput(d, t, len);
    if (d->t[t].region != reg || d->t[t].maxk < len || !(c > 0)) return;
    int avail = d->t[t].count - d->used[t];
    for (int k = 1; k <= avail; k++) {
        d->combo[t] = k;
        double s2 = sum + k * c;
        dp_groups(d, l, len, st, x, reg, t + 1, size + k, s2, F);
        d->combo[t] = 0;
        if (s2 >= F) break;
    }
}

/* Depth-first search from state idx (blocks before it placed) for a packing reaching L. */
static void dp_dfs(dp_ctx *d, long idx, double F) {
    if (d->found >= 0 || dp_stop(d)) return;
    long per_l = d->prod * d->nx;
    int l = (int)(idx / per_l);
    long st = idx % per_l / d->nx, x = idx % d->nx, r = st;
    double room = 0; /* block-capacity the unused servers can still add */
    for (int u = 0; u < d->nt; u++) {
        d->used[u] = (int)(r % (d->t[u].count + 1));
        r /= d->t[u].count + 1;
        d->combo[u] = 0;
        room += (d->t[u].count - d->used[u]) * d->t[u].best;
    }
    if (room < F * (d->L - l) * (1 - 1e-12)) return; /* cannot reach F on the rest */
    for (int len = d->L - l; len >= 1 && d->found < 0; len--)
        for (int reg = 0; reg < d->nreg && d->found < 0; reg++)
            dp_groups(d, l, len, st, x, reg, 0, 0, 0, F);
}

/* Final state of a packing reaching flow F, or -1 (none, or the budget ran out). */
static long dp_feasible(dp_ctx *d, double F) {
    long total = (long)(d->L + 1) * d->prod * d->nx;
    memset(d->prev, 0, (size_t)total * sizeof(int));
    d->prev[0] = -1; /* start: l = 0, nothing used, no previous group */
    d->found = -1;
    dp_dfs(d, 0, F);
    return d->timed_out ? -1 : d->found;
}

/* Applies the packing ending in state `fin`: each stage's servers of type u are the next
 * members of u (in ids order) not placed yet. */
static void dp_apply(dp_ctx *d, rt_swarm *sw, const int *ids, int m, long fin) {
    for (int a = 0; a < m; a++) put_span(sw, ids[a], 0, 0);
    int cursor[d->nt];
    for (int u = 0; u < d->nt; u++) cursor[u] = d->mstart[u];
    long cur = fin, per_l = d->prod * d->nx;
    while (cur > 0) {
        long pv = d->prev[cur] - 1;
        int l2 = (int)(cur / per_l), l1 = (int)(pv / per_l);
        long s2 = cur % per_l / d->nx, s1 = pv % per_l / d->nx;
        for (int u = 0; u < d->nt; u++) {
            int c2 = (int)(s2 / d->radix[u] % (d->t[u].count + 1));
            int c1 = (int)(s1 / d->radix[u] % (d->t[u].count + 1));
            for (int k = 0; k < c2 - c1 && cursor[u] < d->mstart[u + 1]; k++)
                put_span(sw, d->members[cursor[u]++], l1, l2);
        }
        cur = pv;
    }
}

static int uf_find(int *p, int x) {
    while (p[x] != x) x = p[x] = p[p[x]];
    return x;
}

/* Regions: components of server pairs linked both ways at >= a quarter of the fastest server
 * link (over the placeable servers, marked in `on`); reg[i] for each of ids; returns nreg. */
static int dp_regions(const rt_swarm *sw, const int *ids, int m, const unsigned char *on, int *uf, int *reg) {
    int n = sw->n_servers, nreg = 0, dflt = 0;
    double maxbw = 0;
    for (int a = 0; a < m; a++) {
        const rt_adj *o = &sw->out[ids[a]];
        for (int k = 0; k < o->n; k++)
            if (on[o->peer[k]] && o->link[k].bandwidth > maxbw) maxbw = o->link[k].bandwidth;
        dflt += sw->default_link.bandwidth > 0 && sw->on_default[ids[a]];
    }
    if (dflt > 1 && sw->default_link.bandwidth > maxbw) maxbw = sw->default_link.bandwidth;
    for (int i = 0; i < n; i++) uf[i] = i, reg[i] = -1;
    int joined = -1; /* pairs on the default link are all alike: one union over them */
    for (int a = 0; a < m; a++) {
        int i = ids[a];
        const rt_adj *o = &sw->out[i];
        for (int k = 0; k < o->n; k++) {
            int j = o->peer[k];
            if (on[j] && o->link[k].bandwidth >= 0.25 * maxbw && rt_swarm_link(sw, j, i).bandwidth >= 0.25 * maxbw)
                uf[uf_find(uf, i)] = uf_find(uf, j);
        }
        if (dflt > 1 && sw->on_default[i] && sw->default_link.bandwidth >= 0.25 * maxbw) {
            if (joined >= 0) uf[uf_find(uf, i)] = uf_find(uf, joined);
            joined = i;
        }
    }
    for (int a = 0; a < m; a++) {
        int root = uf_find(uf, ids[a]);
        if (reg[root] < 0) reg[root] = nreg++;
        reg[ids[a]] = reg[root];
    }
    return nreg;
}

/* regcap[A * nreg + B]: the slowest link from region A to region B over all server pairs
 * (pairs without a link count as 0), in tokens/s; pairs are counted, not visited. */
static int dp_regcap(dp_ctx *d, const int *ids, int m, const unsigned char *on, const int *reg, double per_tok) {
    const rt_swarm *sw = d->sw;
    int R = d->nreg;
    long *size = calloc((size_t)R * 2, sizeof(long)), *cnt = calloc((size_t)R * R * 2, sizeof(long));
    double *mn = malloc((size_t)R * R * sizeof(double));
    if (!size || !cnt || !mn) {
        free(size), free(cnt), free(mn);
        return 0;
    }
    long *dsize = size + R, *dcnt = cnt + (size_t)R * R; /* on-default servers, explicit pairs among them */
    double dbw = sw->default_link.bandwidth;
    for (int x = 0; x < R * R; x++) mn[x] = 1e300;
    for (int a = 0; a < m; a++) {
        int i = ids[a];
        size[reg[i]]++;
        dsize[reg[i]] += dbw > 0 && sw->on_default[i];
        const rt_adj *o = &sw->out[i];
        for (int k = 0; k < o->n; k++) {
            int j = o->peer[k], x = reg[i] * R + reg[j];
            if (!on[j]) continue;
            cnt[x]++;
            dcnt[x] += rt__on_default(sw, i, j);
            if (o->link[k].bandwidth < mn[x]) mn[x] = o->link[k].bandwidth;
        }
    }
    for (int A = 0; A < R; A++)
        for (int B = 0; B < R; B++) {
            int x = A * R + B;
            long pairs = size[A] * size[B] - (A == B ? size[A] : 0);
            long dpairs = dbw > 0 ? dsize[A] * dsize[B] - (A == B ? dsize[A] : 0) - dcnt[x] : 0;
            if (dpairs > 0 && dbw < mn[x]) mn[x] = dbw;
            if (cnt[x] + dpairs < pairs) mn[x] = 0; /* some pair has no link */
            d->regcap[x] = mn[x] >= 1e300 ? 1e300 : mn[x] / per_tok;
        }
    free(size), free(cnt), free(mn);
    return 1;
}
/* Types: servers of one region with the same profile; fills d->t, members, and *hi (the
 * per-block capacity bound). 0 when the state space is too large for the program. */
static int dp_types(dp_ctx *d, const int *ids, int m, const int *reg, double *hi) {
    const rt_swarm *sw = d->sw;
    int *type_of = malloc(((size_t)m + 1) * sizeof(int));
    if (!type_of) return 0;
    *hi = 0;
    for (int a = 0; a < m; a++) {
        int i = ids[a], mk = rt_swarm_max_layers(sw, i), t = 0;
        for (; t < d->nt; t++) {
            if (d->t[t].maxk != mk || d->t[t].region != reg[i]) continue;
            int same = 1;
            for (int q = 1; q <= mk && same; q++) same = rt_swarm_tput(sw, i, q) == ttput(d, t, q);
            if (same) break;
        }
        double b = 0;
        for (int q = 1; q <= mk; q++)
            if (q * rt_swarm_tput(sw, i, q) > b) b = q * rt_swarm_tput(sw, i, q);
        if (t == d->nt) d->t[d->nt++] = (stype){0, mk, i, reg[i], b};
        d->t[t].count++;
        type_of[a] = t;
        *hi += b / d->L;
    }
    d->nx = 1 + (long)d->nreg * DP_SIZES;
    int ok = 1;
    for (int t = 0; t < d->nt && ok; t++) {
        d->radix[t] = d->prod;
        d->prod *= d->t[t].count + 1;
        ok = d->prod * d->nx * (d->L + 1) <= 8000000; /* too many distinct servers: skip */
    }
    for (int t = 0, pos = 0; ok && t < d->nt; t++) { /* members by type, in ids order */
        d->mstart[t] = pos;
        for (int a = 0; a < m; a++)
            if (type_of[a] == t) d->members[pos++] = ids[a];
        d->mstart[t + 1] = pos;
    }
    free(type_of);
    return ok;
}

/* Galloping search on F upward from lo (feasible targets are found quickly by the depth-first
 * search, infeasible ones cost a full exploration), then bisection once a target fails. Leaves
 * the best packing's spans in sw; returns 1 if it found one. */
static int dp_search(dp_ctx *d, rt_swarm *sw, const int *ids, int m, double lo, double hi) {
    int n = sw->n_servers, failed = 0, have = 0;
    double best = 0, step = 1.08;
    if (lo >= hi || lo <= 0) lo = 0.25 * hi;
    int *keep = malloc(((size_t)n + 1) * 2 * sizeof(int));
    if (!keep) return 0;
    for (int it = 0; it < 40 && !d->timed_out; it++) {
        double mid = failed ? 0.5 * (lo + hi) : (best > 0 ? lo * step : lo);
        if (mid > hi) mid = 0.5 * (lo + hi);
        if (failed && hi - lo <= 2e-3 * hi) break;
        long fin = dp_feasible(d, mid);
        if (fin >= 0) {
            lo = best = mid;
            dp_apply(d, sw, ids, m, fin);
            for (int a = 0; a < m; a++) {
                keep[2 * ids[a]] = sw->servers[ids[a]].first;
                keep[2 * ids[a] + 1] = sw->servers[ids[a]].last;
            }
            have = 1;
        } else if (d->timed_out) {
            break;
        } else if (best == 0) {
            hi = mid;
            lo = 0.5 * mid; /* even the known flow is out of the packing family: go lower */
            if (lo < 1e-9) break;
        } else {
            hi = mid;
            failed = 1;
        }
    }
    if (have)
        for (int a = 0; a < m; a++) put_span(sw, ids[a], keep[2 * ids[a]], keep[2 * ids[a] + 1]);
    free(keep);
    return have;
}

/* Leftover servers join where they raise the flow most (each window a flow evaluation), or,
 * past DP_EXACT_LEFTOVERS servers, at Petals' weakest window. */
#define DP_EXACT_LEFTOVERS 256
static void place_leftovers(rt_swarm *sw, const int *ids, int m, const rt_flow_opts *fo, rt_flow_ws *ws) {
    int L = sw->model.n_layers;
    double *bt = m > DP_EXACT_LEFTOVERS ? malloc((size_t)L * 3 * sizeof(double)) : NULL;
    if (bt) rt__block_tput(sw, bt);
    for (int a = 0; a < m; a++) {
        int i = ids[a], f, l;
        double fl;
        if (rt_swarm_serving(sw, i)) continue;
        if (bt) {
            int k = rt_swarm_max_layers(sw, i);
            f = rt__petals_best_start(bt, L, k, bt + L);
            put_span(sw, i, f, f + k);
            bt_add(bt, f, f + k, rt_swarm_tput(sw, i, k));
        } else if (!best_window(sw, i, fo, ws, &f, &l, &fl) && f >= 0) {
            put_span(sw, i, f, l);
        }
    }
    free(bt);
}

/* Stage-packing seed; leaves spans in `sw` and returns 1 on success. The program gives up at
 * `deadline` (fu_now_s(), 0: none) or after max_visits steps (0: none). */
static int seed_dp(rt_swarm *sw, const int *ids, int m, const rt_flow_opts *fo, rt_flow_ws *ws,
                   double lo, double deadline, long max_visits) {
    int L = sw->model.n_layers, n = sw->n_servers, ok = 0;
    double per_tok = fo->conv == RT_CONV_ILP ? sw->model.act_bytes : sw->model.act_bytes + sw->model.token_bytes;
    dp_ctx d = {sw, NULL, 0, L, 0, 1, 1, NULL, NULL, NULL, NULL, NULL, NULL, NULL, deadline, max_visits, 0, -1, 0};
    int *reg = malloc((size_t)n * sizeof(int)), *uf = malloc((size_t)n * sizeof(int));
    unsigned char *on = calloc((size_t)n + 1, 1);
    d.t = calloc((size_t)m, sizeof *d.t);
    d.radix = calloc((size_t)m, sizeof(long));
    d.used = calloc((size_t)m, sizeof(int));
    d.combo = calloc((size_t)m, sizeof(int));
    d.mstart = calloc((size_t)m + 1, sizeof(int));
    d.members = calloc((size_t)m, sizeof(int));
    if (!reg || !uf || !on || !d.t || !d.radix || !d.used || !d.combo || !d.mstart || !d.members) goto out;
    for (int a = 0; a < m; a++) on[ids[a]] = 1;
    d.nreg = dp_regions(sw, ids, m, on, uf, reg);
    double hi;
    if (!dp_types(&d, ids, m, reg, &hi)) goto out;
    d.regcap = malloc((size_t)d.nreg * d.nreg * sizeof(double));
    d.prev = malloc((size_t)(L + 1) * (size_t)d.prod * (size_t)d.nx * sizeof(int));
    if (!d.regcap || !d.prev || !dp_regcap(&d, ids, m, on, reg, per_tok)) goto out;
    if (!dp_search(&d, sw, ids, m, lo, hi)) goto out;
    place_leftovers(sw, ids, m, fo, ws);
    ok = !rt_swarm_uncovered(sw, NULL);
out:
    free(reg), free(uf), free(on);
    free(d.t), free(d.radix), free(d.used), free(d.combo), free(d.prev), free(d.regcap), free(d.mstart), free(d.members);
    return ok;
}

/* --- link-following seed ------------------------------------------------------------------- *
 *
 * Chains along the links: from each unplaced server with a coordinator link (strongest first),
 * a chain takes blocks [0, k) and extends over its fastest link to an unplaced server, which
 * takes the next blocks, until the last block; a chain with nowhere to go ends on a server
 * whose span starts where it stopped, if it links to one. In a sparse swarm this keeps
 * consecutive stages linked, which placements blind to links rarely manage. Servers left over
 * join at Petals' weakest window. O(servers x links). */

/* The next server of a chain ending at block `end` on server i: the unplaced out-neighbour
 * over the fastest link, else (*merge = 1) a placed one starting at `end`; -1 if none. */
static int chain_next(const rt_swarm *sw, int i, int end, const unsigned char *on, int *merge) {
    const rt_adj *o = &sw->out[i];
    int best = -1, join = -1;
    double bw = 0;
    for (int k = 0; k < o->n; k++) {
        int j = o->peer[k];
        if (!on[j] || !(o->link[k].bandwidth > 0)) continue;
        int placed = sw->servers[j].last > sw->servers[j].first;
        if (!placed && o->link[k].bandwidth > bw) best = j, bw = o->link[k].bandwidth;
        if (placed && join < 0 && sw->servers[j].first == end) join = j;
    }
    *merge = best < 0 && join >= 0;
    return best >= 0 ? best : join;
}

/* One chain from server i; its servers get spans. */
static void seed_chain(rt_swarm *sw, int i, const unsigned char *on) {
    int L = sw->model.n_layers, end = 0;
    while (i >= 0) {
        int k = rt_swarm_max_layers(sw, i);
        if (k > L - end) k = L - end;
        put_span(sw, i, end, end + k);
        end += k;
        if (end >= L) break;
        int merge;
        i = chain_next(sw, i, end, on, &merge);
        if (merge) break;
    }
}

static void seed_chains(rt_swarm *sw, const int *ids, int m, double *bt) {
    int n = sw->n_servers, L = sw->model.n_layers;
    unsigned char *on = calloc((size_t)n + 1, 1);
    if (!on) return;
    for (int a = 0; a < m; a++) {
        on[ids[a]] = 1;
        put_span(sw, ids[a], 0, 0);
    }
    for (int a = 0; a < m; a++) {
        int i = ids[a];
        if (sw->servers[i].last == 0 && sw->from_source[i].bandwidth > 0) seed_chain(sw, i, on);
    }
    rt__block_tput(sw, bt);
    for (int a = 0; a < m; a++) { /* leftovers cover what the chains missed */
        int i = ids[a], k = rt_swarm_max_layers(sw, i);
        if (rt_swarm_serving(sw, i)) continue;
        int f = rt__petals_best_start(bt, L, k, bt + L);
        put_span(sw, i, f, f + k);
        bt_add(bt, f, f + k, rt_swarm_tput(sw, i, k));
    }
    free(on);
}

/* The search's seeds: at most SEARCH_SEEDS placements kept for annealing restarts. */
#define SEARCH_SEEDS 64
/* Past this many servers the search tries at most SCALE_STAGE_SEEDS stage lengths. */
#define SCALE_SERVERS 256
#define SCALE_STAGE_SEEDS 8
/* Steps of the stage-packing program when there is no clock to stop it. */
#define DP_STEPS (1L << 21)

typedef struct seed_set {
    plc p[SEARCH_SEEDS];
    int n;
    int *buf; /* [SEARCH_SEEDS * 2 * n_servers] */
} seed_set;

/* Scores the swarm's current placement as a seed; keeps it for restarts and as the best. */
static void keep_seed(search_ctx *c, seed_set *ss) {
    int n = c->sw->n_servers;
    if (ss->n < SEARCH_SEEDS) {
        plc *p = &ss->p[ss->n];
        p->first = ss->buf + (size_t)ss->n * 2 * n;
        p->len = p->first + n;
        plc_read(c->sw, p);
        ss->n++;
    }
    double fl, sc = score(c, &fl);
    if (fl > 0 && sc > c->best_score) {
        c->best_score = sc, c->best_flow = fl;
        plc_read(c->sw, &c->best);
    }
}

/* Equal-stage seeds: every length 1 .. maxk, or SCALE_STAGE_SEEDS lengths spread over it. */
static void stage_seeds(search_ctx *c, seed_set *ss) {
    rt_swarm *sw = c->sw;
    int L = sw->model.n_layers, maxk = 0, prev = 0;
    for (int a = 0; a < c->m; a++)
        if (rt_swarm_max_layers(sw, c->ids[a]) > maxk) maxk = rt_swarm_max_layers(sw, c->ids[a]);
    int few = c->m > SCALE_SERVERS && maxk > SCALE_STAGE_SEEDS;
    for (int j = 1; j <= (few ? SCALE_STAGE_SEEDS : maxk); j++) {
        int s = few ? (int)((long)maxk * j / SCALE_STAGE_SEEDS) : j;
        if (s <= prev) continue;
        prev = s;
        seed_stages(sw, s, c->ids, c->m, c->bt, c->bt + L);
        if (!rt_swarm_uncovered(sw, NULL)) keep_seed(c, ss);
    }
}

/* All seeds: the current placement, Petals, Swarm, equal stages, chains, stage packing. */
static void search_seeds(search_ctx *c, seed_set *ss, const rt_search_opts *o, double t_begin) {
    rt_swarm *sw = c->sw;
    if (o->keep_current && !rt_swarm_uncovered(sw, NULL)) keep_seed(c, ss);
    if (!rt_place_petals(sw)) keep_seed(c, ss);
    if (!rt_place_swarm(sw)) keep_seed(c, ss);
    stage_seeds(c, ss);
    seed_chains(sw, c->ids, c->m, c->bt);
    if (!rt_swarm_uncovered(sw, NULL)) keep_seed(c, ss);
    double dp_deadline = c->t_end > 0 ? t_begin + 0.6 * o->time_limit_s : 0;
    if (seed_dp(sw, c->ids, c->m, &o->flow, &c->ws, c->best_flow, dp_deadline, c->t_end > 0 ? 0 : DP_STEPS))
        keep_seed(c, ss);
}

/* Annealing restarts from the best placement and the seeds until the budget is spent. */
static void search_anneal(search_ctx *c, const seed_set *ss, double limit) {
    for (int runs = 0;; runs++) {
        double t_slice = 0;
        long e_slice = 0, before = c->evals;
        if (c->t_end > 0) {
            double now = fu_now_s(), remaining = c->t_end - now;
            if (remaining <= 0.01) break;
            t_slice = now + (remaining < limit / 4 ? remaining : limit / 4);
        }
        if (c->max_evals > 0) {
            long rem = c->max_evals - c->evals, quarter = c->max_evals / 4 > 2 ? c->max_evals / 4 : 2;
            if (rem < 2) break;
            e_slice = c->evals + (rem < quarter ? rem : quarter);
        }
        const plc *from = &c->best;
        if (runs % 2 == 1 && ss->n) from = &ss->p[rt__rng_int(&c->rng, ss->n)];
        anneal(c, from, t_slice, e_slice);
        if (c->max_evals > 0 && c->evals == before) break;
    }
}

int rt_place_search(rt_swarm *sw, const rt_search_opts *opts, rt_search_stats *stats) {
    if (!sw) return fu_errorf(FU_ERR_INVALID, "rt_place_search: NULL swarm");
    rt_search_opts o = {0};
    if (opts) o = *opts;
    if (o.time_limit_s <= 0 && o.max_evals <= 0) o.time_limit_s = 5;
    double t_begin = fu_now_s();
    int n = sw->n_servers, L = sw->model.n_layers, rc = FU_OK;
    search_ctx c = {sw, &o.flow, {0}, NULL, 0, o.max_evals > 0 ? o.max_evals : 0,
                    o.time_limit_s > 0 ? t_begin + o.time_limit_s : 0, NULL, 0, o.seed ^ 0x5eed5eedULL,
                    {0}, {0}, {0}, -1, 0};
    int *ids = malloc((size_t)(n + 1) * sizeof(int)), *buf = malloc((size_t)(n + 1) * 8 * sizeof(int));
    seed_set ss = {.n = 0, .buf = malloc((size_t)SEARCH_SEEDS * 2 * ((size_t)n + 1) * sizeof(int))};
    c.bt = malloc((size_t)L * 3 * sizeof(double));
    if (!ids || !buf || !c.bt || !ss.buf) {
        rc = fu_errorf(FU_ERR_NOMEM, "search: out of memory");
        goto out;
    }
    plc cur0 = {buf, buf + n};
    c.best = (plc){buf + 2 * n, buf + 3 * n}, c.cur = (plc){buf + 4 * n, buf + 5 * n};
    c.nxt = (plc){buf + 6 * n, buf + 7 * n};
    c.ids = ids;
    if ((c.m = sort_by_tput(sw, 1, ids)) <= 0) { /* strongest first, for the stage seeds */
        rc = c.m < 0 ? c.m : fu_errorf(FU_ERR_EXHAUSTED, "search: no servers");
        goto out;
    }
    plc_read(sw, &cur0);
    search_seeds(&c, &ss, &o, t_begin);
    if (c.best_score < 0) {
        plc_apply(sw, &cur0);
        rc = fu_errorf(FU_ERR_EXHAUSTED, "search: the servers cannot carry any flow (blocks "
                       "uncovered or no connected chain)");
        goto out;
    }
    if (stats) stats->start_flow = c.best_flow;
    search_anneal(&c, &ss, o.time_limit_s);
    plc_apply(sw, &c.best);
    sw->version++;
    if (stats) {
        stats->flow = rt__flow_eval(sw, &o.flow, &c.ws);
        stats->evaluations = c.evals;
        stats->seconds = fu_now_s() - t_begin;
    }
out:
    rt__flow_ws_free(&c.ws);
    free(ids), free(buf), free(c.bt), free(ss.buf);
    return rc;
}

/* --- incremental placement ---------------------------------------------------------------- */

/* Lexicographic Petals key of a window: 1 if window a is weaker (preferred) than window b. */
static int window_weaker(const double *bt, int fa, int fb, int k, double *scratch) {
    /* sorted copies */
    double *x = scratch, *y = scratch + k;
    memcpy(x, bt + fa, (size_t)k * sizeof(double));
    memcpy(y, bt + fb, (size_t)k * sizeof(double));
    for (int a = 1; a < k; a++)
        for (int b = a; b > 0 && x[b - 1] > x[b]; b--) {
            double t = x[b];
            x[b] = x[b - 1];
            x[b - 1] = t;
        }
    for (int a = 1; a < k; a++)
        for (int b = a; b > 0 && y[b - 1] > y[b]; b--) {
            double t = y[b];
            y[b] = y[b - 1];
            y[b - 1] = t;
        }
    for (int t = 0; t < k; t++) {
        if (x[t] < y[t]) return 1;
        if (x[t] > y[t]) return 0;
    }
    return 0;
}

/* Best window for server `id` in the mutable `sw` (others fixed). Restores id's span. */
static int best_window(rt_swarm *sw, int id, const rt_flow_opts *fo, rt_flow_ws *ws, int *first,
                       int *last, double *flow) {
    int L = sw->model.n_layers, maxk = rt_swarm_max_layers(sw, id);
    if (maxk <= 0) return fu_errorf(FU_ERR_INVALID, "server %d cannot hold any block", id);
    rt_server *s = &sw->servers[id];
    int of = s->first, ol = s->last;
    rt_server_state ost = s->state;
    double *bt = malloc((size_t)L * 3 * sizeof(double));
    if (!bt) return fu_errorf(FU_ERR_NOMEM, "join: out of memory");
    put_span(sw, id, 0, 0);
    rt__block_tput(sw, bt);
    int bf = -1, bl = -1, bunc = L + 1;
    double bflow = -1;
    for (int k = 1; k <= maxk; k++) {
        for (int f = 0; f + k <= L; f++) {
            put_span(sw, id, f, f + k);
            int unc = rt_swarm_uncovered(sw, NULL);
            double fl = unc ? 0 : rt__flow_eval(sw, fo, ws);
            int better = 0;
            if (unc != bunc) better = unc < bunc;
            else if (fabs(fl - bflow) > 1e-9 * (fl > 1 ? fl : 1)) better = fl > bflow;
            else if (k != bl - bf) better = k > bl - bf; /* same flow: hold more (redundancy) */
            else better = window_weaker(bt, f, bf, k, bt + L);
            if (better) bf = f, bl = f + k, bunc = unc, bflow = fl;
        }
    }
    s->first = of;
    s->last = ol;
    s->state = ost;
    free(bt);
    *first = bf;
    *last = bl;
    *flow = bflow;
    return FU_OK;
}

int rt_place_join(const rt_swarm *sw, int id, const rt_flow_opts *opts, int *first, int *last,
                  double *gain) {
    if (!sw || !first || !last || id < 0 || id >= sw->n_servers)
        return fu_errorf(FU_ERR_INVALID, "rt_place_join: bad arguments");
    rt_swarm tmp;
    int rc = rt_swarm_clone(&tmp, sw);
    if (rc) return rc;
    rt_flow_ws ws = {0};
    put_span(&tmp, id, 0, 0);
    double before = rt_swarm_uncovered(&tmp, NULL) ? 0 : rt__flow_eval(&tmp, opts, &ws), after;
    rc = best_window(&tmp, id, opts, &ws, first, last, &after);
    if (!rc && gain) *gain = after - before;
    rt__flow_ws_free(&ws);
    rt_swarm_free(&tmp);
    return rc;
}

int rt_place_rebalance(rt_swarm *sw, const rt_flow_opts *opts, double min_gain, int max_moves,
                       rt_move *moves, int *n_moves) {
    if (!sw) return fu_errorf(FU_ERR_INVALID, "rt_place_rebalance: NULL swarm");
    int n = sw->n_servers, done = 0, rc = FU_OK;
    rt_flow_ws ws = {0};
    if (n_moves) *n_moves = 0;
    if (max_moves <= 0) return FU_OK;
    for (int iter = 0; iter < 4 * n + 8; iter++) {
        int unc = rt_swarm_uncovered(sw, NULL);
        double cur = unc ? 0 : rt__flow_eval(sw, opts, &ws);
        int bi = -1, bf = 0, bl = 0, bunc = unc;
        double bflow = cur;
        for (int i = 0; i < n; i++) {
            rt_server *s = &sw->servers[i];
            if (!rt__placeable(sw, i)) continue;
            int of = s->first, ol = s->last;
            /* may i leave its span without uncovering a block? */
            put_span(sw, i, 0, 0);
            int unc_wo = rt_swarm_uncovered(sw, NULL);
            s->first = of, s->last = ol;
            if (ol > of && unc_wo > unc) continue;
            int f, l;
            double fl;
            if ((rc = best_window(sw, i, opts, &ws, &f, &l, &fl))) goto out;
            if (f == of && l == ol) continue;
            put_span(sw, i, f, l);
            int u2 = rt_swarm_uncovered(sw, NULL);
            s->first = of, s->last = ol;
            if (u2 < bunc || (u2 == bunc && fl > bflow)) bi = i, bf = f, bl = l, bunc = u2, bflow = fl;
        }
        if (bi < 0) break;
        int covers_more = bunc < unc;
        if (!covers_more && !(bflow > cur * (1 + min_gain) + 1e-9)) break;
        rt_server *s = &sw->servers[bi];
        if (moves && done < max_moves)
            moves[done] = (rt_move){bi, s->first, s->last, bf, bl};
        if ((rc = rt_swarm_set_span(sw, bi, bf, bl))) goto out;
        done++;
        if (done >= max_moves) break;
    }
out:
    rt__flow_ws_free(&ws);
    if (n_moves) *n_moves = done < max_moves ? done : max_moves;
    return rc;
}
