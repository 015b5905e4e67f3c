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
static int placeable(const rt_swarm *sw, int i) {
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

int rt_place_petals(rt_swarm *sw) {
    if (!sw) return fu_errorf(FU_ERR_INVALID, "rt_place_petals: NULL swarm");
    int L = sw->model.n_layers, n = sw->n_servers;
    double *bt = malloc((size_t)L * sizeof(double)), *scratch = malloc((size_t)2 * L * sizeof(double));
    if (!bt || !scratch) {
        free(bt), free(scratch);
        return fu_errorf(FU_ERR_NOMEM, "petals: out of memory");
    }
    for (int i = 0; i < n; i++) put_span(sw, i, 0, 0);
    /* joins in id order, each at its weakest window */
    for (int i = 0; i < n; i++) {
        if (!placeable(sw, i)) continue;
        int k = rt_swarm_max_layers(sw, i);
        rt__block_tput(sw, bt);
        int s = rt__petals_best_start(bt, L, k, scratch);
        put_span(sw, i, s, s + k);
    }
    /* rebalancing: a server moves to its best window when that lifts the weakest block */
    for (int round = 0; round < 4 * n + 4; round++) {
        int moved = 0;
        for (int i = 0; i < n; i++) {
            if (!rt_swarm_serving(sw, i)) continue;
            rt_server *sv = &sw->servers[i];
            int k = sv->last - sv->first, old = sv->first;
            rt__block_tput(sw, bt);
            double before = min_block(bt, L), t = rt_swarm_tput(sw, i, k);
            for (int l = old; l < old + k; l++) bt[l] -= t;
            int s = rt__petals_best_start(bt, L, k, scratch);
            if (s == old) continue;
            for (int l = s; l < s + k; l++) bt[l] += t;
            if (min_block(bt, L) > before * (1 + 1e-9)) {
                put_span(sw, i, s, s + k);
                moved = 1;
            }
        }
        if (!moved) break;
    }
    free(bt), free(scratch);
    sw->version++;
    int gap;
    if (rt_swarm_uncovered(sw, &gap))
        return fu_errorf(FU_ERR_EXHAUSTED, "petals: servers cannot cover block %d", gap);
    return FU_OK;
}

/* --- Swarm -------------------------------------------------------------------------------- */

int rt_place_swarm(rt_swarm *sw) {
    if (!sw) return fu_errorf(FU_ERR_INVALID, "rt_place_swarm: NULL swarm");
    int L = sw->model.n_layers, n = sw->n_servers, s = 0;
    for (int i = 0; i < n; i++) {
        put_span(sw, i, 0, 0);
        if (!placeable(sw, i)) continue;
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
    int m = 0;
    for (int i = 0; i < n; i++)
        if (placeable(sw, i)) order[m++] = i;
    /* decreasing throughput at the stage size (insertion sort, stable) */
    for (int a = 1; a < m; a++) {
        int x = order[a], b = a;
        while (b > 0 && rt_swarm_tput(sw, order[b - 1], s) < rt_swarm_tput(sw, x, s)) {
            order[b] = order[b - 1];
            b--;
        }
        order[b] = x;
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
        if (placeable(sw, i)) put_span(sw, i, p->first[i], p->first[i] + p->len[i]);
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

/* One annealing run from `start` for `seconds`; best result in `best` / *best_score. */
static void anneal(search_ctx *c, const plc *start, plc *best, double *best_score,
                   double *best_flow, double seconds, uint64_t *rng, const int *ids, int m,
                   plc *cur, plc *nxt) {
    int n = c->sw->n_servers;
    memcpy(cur->first, start->first, (size_t)n * sizeof(int));
    memcpy(cur->len, start->len, (size_t)n * sizeof(int));
    plc_apply(c->sw, cur);
    double fl, sc = score(c, &fl);
    double scale = *best_flow > 0 ? *best_flow : (fl > 0 ? fl : 1);
    double t0 = 0.03 * scale, t1 = 1e-4 * scale, begin = fu_now_s();
    for (long it = 0;; it++) {
        double frac = (fu_now_s() - begin) / seconds;
        if ((it & 63) == 0 && frac >= 1) break;
        double temp = t0 * pow(t1 / t0, frac < 1 ? frac : 1);
        if (!mutate(c->sw, cur, nxt, ids, m, rng)) continue;
        plc_apply(c->sw, nxt);
        double nf, ns = score(c, &nf);
        if (ns >= sc || rt__rng_unit(rng) < exp((ns - sc) / temp)) {
            plc tmp = *cur;
            *cur = *nxt;
            *nxt = tmp;
            sc = ns;
            fl = nf;
            if (sc > *best_score) {
                *best_score = sc;
                *best_flow = fl;
                memcpy(best->first, cur->first, (size_t)n * sizeof(int));
                memcpy(best->len, cur->len, (size_t)n * sizeof(int));
            }
        }
    }
}

/* Seed: equal stages of length s, servers assigned (strongest first) to the stage with the
 * lowest capacity; servers that cannot hold s blocks get the largest span they can, placed at
 * the weakest window. */
static void seed_stages(rt_swarm *sw, int s, const int *ids, int m, double *bt, double *scratch) {
    int L = sw->model.n_layers, stages = (L + s - 1) / s;
    for (int a = 0; a < m; a++) put_span(sw, ids[a], 0, 0);
    for (int a = 0; a < m; a++) {
        int i = ids[a], k = rt_swarm_max_layers(sw, i);
        if (k > s) k = s;
        rt__block_tput(sw, bt);
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
    double deadline; /* fu_now_s() limit; past it dp_feasible gives up */
    int timed_out;
    long found;      /* final state reached, or -1 */
    long visits;
} dp_ctx;

static void dp_dfs(dp_ctx *d, long idx, double F);

static double ttput(const dp_ctx *d, int t, int len) { return rt_swarm_tput(d->sw, d->t[t].rep, len); }

/* Enumerates minimal groups of region `reg` for stage [l, l + len) from state (l, st, x). */
static void dp_groups(dp_ctx *d, int l, int len, long st, long x, int reg, int t, int size,
                      double sum, double F) {
    if (sum >= F) {
        for (int u = 0; u < d->nt; u++)
            if (d->combo[u] && sum - ttput(d, u, len) >= F) return;
        if (x > 0) {
            int pr = (int)((x - 1) / DP_SIZES), ps = (int)((x - 1) % DP_SIZES) + 1;
            if (pr != reg && ps * (size < DP_SIZES ? size : DP_SIZES) * d->regcap[pr * d->nreg + reg] < F)
                return;
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
    if (d->found >= 0 || d->timed_out) return;
    if ((++d->visits & 1023) == 0 && fu_now_s() > d->deadline) {
        d->timed_out = 1;
        return;
    }
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

/* Final state of a packing reaching flow F, or -1 (none, or the deadline passed). */
static long dp_feasible(dp_ctx *d, double F) {
    long total = (long)(d->L + 1) * d->prod * d->nx;
    memset(d->prev, 0, (size_t)total * sizeof(int));
    d->prev[0] = -1; /* start: l = 0, nothing used, no previous group */
    d->found = -1;
    dp_dfs(d, 0, F);
    return d->timed_out ? -1 : d->found;
}

/* Applies the packing ending in state `fin`. */
static int dp_apply(dp_ctx *d, rt_swarm *sw, const int *ids, int m, long fin) {
    for (int a = 0; a < m; a++) put_span(sw, ids[a], 0, 0);
    int *taken = calloc((size_t)sw->n_servers, sizeof(int));
    if (!taken) return 0;
    long cur = fin, per_l = d->prod * d->nx;
    while (cur > 0) {
        long pv = d->prev[cur] - 1;
        int l2 = (int)(cur / per_l), l1 = (int)(pv / per_l);
        long s2 = cur % per_l / d->nx, s1 = pv % per_l / d->nx;
        for (int u = 0; u < d->nt; u++) {
            int c2 = (int)(s2 / d->radix[u] % (d->t[u].count + 1));
            int c1 = (int)(s1 / d->radix[u] % (d->t[u].count + 1));
            for (int k = 0; k < c2 - c1; k++) {
                for (int a = 0; a < m; a++) { /* next unplaced member of type u */
                    int i = ids[a];
                    if (taken[i]) continue;
                    if (rt_swarm_max_layers(sw, i) != d->t[u].maxk) continue;
                    int same = 1;
                    for (int q = 1; q <= d->t[u].maxk && same; q++)
                        same = rt_swarm_tput(sw, i, q) == rt_swarm_tput(sw, d->t[u].rep, q);
                    if (!same || sw->servers[i].first != 0 || sw->servers[i].last != 0) continue;
                    if (d->used[i] != d->t[u].region) continue; /* used[] holds server regions */
                    taken[i] = 1;
                    put_span(sw, i, l1, l2);
                    break;
                }
            }
        }
        cur = pv;
    }
    free(taken);
    return 1;
}

static int uf_find(int *p, int x) {
    while (p[x] != x) x = p[x] = p[p[x]];
    return x;
}

/* Stage-packing seed; leaves spans in `sw` and returns 1 on success. */
static int seed_dp(rt_swarm *sw, const int *ids, int m, const rt_flow_opts *fo, rt_flow_ws *ws,
                   double lo, double deadline) {
    int L = sw->model.n_layers, n = sw->n_servers, ok = 0;
    double per_tok = fo->conv == RT_CONV_ILP ? sw->model.act_bytes
                                             : sw->model.act_bytes + sw->model.token_bytes;
    dp_ctx d = {sw, NULL, 0, L, 0, 1, 1, NULL, NULL, NULL, NULL, NULL, deadline, 0, -1, 0};
    int *reg = malloc((size_t)n * sizeof(int)), *uf = malloc((size_t)n * sizeof(int));
    d.t = calloc((size_t)m, sizeof *d.t);
    d.radix = calloc((size_t)m, sizeof(long));
    d.used = calloc((size_t)(n > m ? n : m), sizeof(int));
    d.combo = calloc((size_t)m, sizeof(int));
    d.regcap = calloc((size_t)m * m, sizeof(double));
    if (!reg || !uf || !d.t || !d.radix || !d.used || !d.combo || !d.regcap) goto out;
    /* regions */
    double maxbw = 0;
    for (int a = 0; a < m; a++)
        for (int b = 0; b < m; b++) {
            double bw = rt_swarm_link(sw, ids[a], ids[b]).bandwidth;
            if (bw > maxbw) maxbw = bw;
        }
    for (int i = 0; i < n; i++) uf[i] = i;
    for (int a = 0; a < m; a++)
        for (int b = 0; b < m; b++) {
            int i = ids[a], j = ids[b];
            if (i != j && rt_swarm_link(sw, i, j).bandwidth >= 0.25 * maxbw &&
                rt_swarm_link(sw, j, i).bandwidth >= 0.25 * maxbw)
                uf[uf_find(uf, i)] = uf_find(uf, j);
        }
    for (int i = 0; i < n; i++) reg[i] = -1;
    for (int a = 0; a < m; a++) {
        int root = uf_find(uf, ids[a]);
        if (reg[root] < 0) reg[root] = d.nreg++;
        reg[ids[a]] = reg[root];
    }
    for (int x = 0; x < d.nreg * d.nreg; x++) d.regcap[x] = 1e300;
    for (int a = 0; a < m; a++)
        for (int b = 0; b < m; b++) {
            int i = ids[a], j = ids[b];
            if (i == j) continue;
            double c = rt_swarm_link(sw, i, j).bandwidth / per_tok;
            double *rc = &d.regcap[reg[i] * d.nreg + reg[j]];
            if (c < *rc) *rc = c;
        }
    /* types */
    double hi = 0;
    for (int a = 0; a < m; a++) {
        int i = ids[a], mk = rt_swarm_max_layers(sw, i), t = 0;
        for (; t < d.nt; t++) {
            if (d.t[t].maxk != mk || d.t[t].region != reg[i]) continue;
            int same = 1;
            for (int q = 1; q <= mk && same; q++) same = rt_swarm_tput(sw, i, q) == ttput(&d, t, q);
            if (same) break;
        }
        double b = 0;
        for (int q = 1; q <= mk; q++)
            if (q * rt_swarm_tput(sw, i, q) > b) b = q * rt_swarm_tput(sw, i, q);
        if (t == d.nt) d.t[d.nt++] = (stype){0, mk, i, reg[i], b};
        d.t[t].count++;
        hi += b / L;
    }
    d.nx = 1 + (long)d.nreg * DP_SIZES;
    for (int t = 0; t < d.nt; t++) {
        d.radix[t] = d.prod;
        d.prod *= d.t[t].count + 1;
        if (d.prod * d.nx * (L + 1) > 8000000) goto out; /* too many distinct servers: skip */
    }
    d.prev = malloc((size_t)(L + 1) * (size_t)d.prod * (size_t)d.nx * sizeof(int));
    if (!d.prev) goto out;
    /* galloping search on F upward from the best flow known so far (feasible targets are found
     * quickly by the depth-first search, infeasible ones cost a full exploration), then
     * bisection once a target fails */
    double best = 0, step = 1.08;
    if (lo >= hi || lo <= 0) lo = 0.25 * hi;
    int failed = 0, have = 0;
    int *keep = malloc((size_t)n * 2 * sizeof(int));
    if (!keep) goto out;
    for (int it = 0; it < 40 && !d.timed_out; it++) {
        double mid = failed ? 0.5 * (lo + hi) : (best > 0 ? lo * step : lo);
        if (mid > hi) mid = 0.5 * (lo + hi);
        if (failed && hi - lo <= 2e-3 * hi) break;
        long fin = dp_feasible(&d, mid);
        if (fin >= 0) {
            lo = best = mid;
            /* dp_apply matches members by region through used[] */
            for (int i = 0; i < n; i++) d.used[i] = reg[i];
            if (dp_apply(&d, sw, ids, m, fin)) {
                for (int i = 0; i < n; i++) {
                    keep[2 * i] = sw->servers[i].first;
                    keep[2 * i + 1] = sw->servers[i].last;
                }
                have = 1;
            }
        } else if (d.timed_out) {
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
    if (!have) goto out;
    /* leftover servers: add each where it raises the flow most */
    for (int a = 0; a < m; a++) {
        int i = ids[a];
        if (rt_swarm_serving(sw, i)) continue;
        int f, l;
        double fl;
        if (!best_window(sw, i, fo, ws, &f, &l, &fl) && f >= 0) put_span(sw, i, f, l);
    }
    ok = !rt_swarm_uncovered(sw, NULL);
out:
    free(reg), free(uf);
    free(d.t), free(d.radix), free(d.used), free(d.combo), free(d.prev), free(d.regcap);
    return ok;
}

int rt_place_search(rt_swarm *sw, const rt_search_opts *opts, rt_search_stats *stats) {
    if (!sw) return fu_errorf(FU_ERR_INVALID, "rt_place_search: NULL swarm");
    rt_search_opts o = {0};
    if (opts) o = *opts;
    if (o.time_limit_s <= 0) o.time_limit_s = 5;
    double t_begin = fu_now_s();
    int n = sw->n_servers, L = sw->model.n_layers, rc = FU_OK;
    uint64_t rng = o.seed ^ 0x5eed5eedULL;
    search_ctx c = {sw, &o.flow, {0}, NULL, 0};
    int *ids = malloc((size_t)(n + 1) * sizeof(int));
    int *buf = malloc((size_t)(n + 1) * 8 * sizeof(int));
    c.bt = malloc((size_t)L * 3 * sizeof(double));
    if (!ids || !buf || !c.bt) {
        rc = fu_errorf(FU_ERR_NOMEM, "search: out of memory");
        goto out;
    }
    plc cur0 = {buf, buf + n}, best = {buf + 2 * n, buf + 3 * n}, cur = {buf + 4 * n, buf + 5 * n},
        nxt = {buf + 6 * n, buf + 7 * n};
    int m = 0;
    for (int i = 0; i < n; i++)
        if (placeable(sw, i)) ids[m++] = i;
    if (!m) {
        rc = fu_errorf(FU_ERR_EXHAUSTED, "search: no servers");
        goto out;
    }
    /* sort ids by decreasing one-block throughput for the stage seeds */
    for (int a = 1; a < m; a++) {
        int x = ids[a], b = a;
        while (b > 0 && rt_swarm_tput(sw, ids[b - 1], 1) < rt_swarm_tput(sw, x, 1)) {
            ids[b] = ids[b - 1];
            b--;
        }
        ids[b] = x;
    }
    double best_score = -1, best_flow = 0, fl, sc;
    plc_read(sw, &cur0);
    /* candidate seeds */
    int n_seeds = 0;
    plc seeds[64];
    int *seed_buf = malloc((size_t)64 * 2 * (size_t)n * sizeof(int));
    if (!seed_buf) {
        rc = fu_errorf(FU_ERR_NOMEM, "search: out of memory");
        goto out;
    }
#define KEEP_SEED()                                                                      \
    do {                                                                                 \
        if (n_seeds < 64) {                                                              \
            plc *p_ = &seeds[n_seeds];                                                   \
            p_->first = seed_buf + (size_t)n_seeds * 2 * n;                              \
            p_->len = p_->first + n;                                                     \
            plc_read(sw, p_);                                                            \
            n_seeds++;                                                                   \
        }                                                                                \
        sc = score(&c, &fl);                                                             \
        if (fl > 0 && sc > best_score) {                                                 \
            best_score = sc, best_flow = fl;                                             \
            plc_read(sw, &best);                                                         \
        }                                                                                \
    } while (0)
    if (o.keep_current && !rt_swarm_uncovered(sw, NULL)) KEEP_SEED();
    if (!rt_place_petals(sw)) KEEP_SEED();
    if (!rt_place_swarm(sw)) KEEP_SEED();
    int maxk = 0;
    for (int a = 0; a < m; a++)
        if (rt_swarm_max_layers(sw, ids[a]) > maxk) maxk = rt_swarm_max_layers(sw, ids[a]);
    for (int s = 1; s <= maxk; s++) {
        seed_stages(sw, s, ids, m, c.bt, c.bt + L);
        if (!rt_swarm_uncovered(sw, NULL)) KEEP_SEED();
    }
    double dp_deadline = t_begin + 0.6 * o.time_limit_s;
    if (seed_dp(sw, ids, m, &o.flow, &c.ws, best_flow, dp_deadline)) KEEP_SEED();
#undef KEEP_SEED
    if (best_score < 0) {
        free(seed_buf);
        plc_apply(sw, &cur0);
        rc = fu_errorf(FU_ERR_EXHAUSTED, "search: the servers cannot carry any flow (blocks "
                       "uncovered or no connected chain)");
        goto out;
    }
    if (stats) stats->start_flow = best_flow;
    /* anneal: restarts from the best seeds and from the incumbent */
    double remaining = o.time_limit_s - (fu_now_s() - t_begin);
    int runs = 0;
    while (remaining > 0.01) {
        double slice = remaining < o.time_limit_s / 4 ? remaining : o.time_limit_s / 4;
        const plc *from = &best;
        if (runs % 2 == 1 && n_seeds) from = &seeds[rt__rng_int(&rng, n_seeds)];
        anneal(&c, from, &best, &best_score, &best_flow, slice, &rng, ids, m, &cur, &nxt);
        runs++;
        remaining = o.time_limit_s - (fu_now_s() - t_begin);
    }
    free(seed_buf);
    plc_apply(sw, &best);
    sw->version++;
    if (stats) {
        stats->flow = rt__flow_eval(sw, &o.flow, &c.ws);
        stats->evaluations = c.evals;
        stats->seconds = fu_now_s() - t_begin;
    }
out:
    rt__flow_ws_free(&c.ws);
    free(ids), free(buf), free(c.bt);
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
            if (!placeable(sw, i)) continue;
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
