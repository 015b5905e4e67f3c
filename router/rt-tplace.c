/* rt-tplace.c -- placement for simulated throughput: the max-flow search's, Petals', Swarm's and
 * the current placement, each improved by annealing on a quick estimate, and the stripe
 * placements; the best of them by the simulator, then refined by simulated moves (a sweep of the
 * boundaries between spans, then random moves). Single-threaded, like the router. */
#include <math.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#include "router-impl.h"
#include "status.h"

typedef struct tplace {
    const rt_tplace_opts *o;
    rt_sim_opts sim;
    uint64_t rng;
    int evals, max_evals;
    long quick_evals, quick_moves;
    double out_len; /* tokens each request decodes */
    double p2;      /* mean squared prompt length */
    int restarts;
    rt_sim_result last;
    rt_flow fl;
    double *layer_kv; /* [n_layers] scratch */
} tplace;

typedef struct span {
    int first, last;
} span;

/* A score under the bounds: throughput scaled down by how far the median TPOT or the mean hops
 * exceed theirs. */
static double bounded(const tplace *t, double tps, double tpot, double hops) {
    double bt = t->o->max_tpot_s, bh = t->o->max_hops;
    if (bt > 0 && tpot > bt) tps *= bt / tpot * 0.5;
    if (bh > 0 && hops > bh + 1e-9) tps *= bh / hops * 0.5;
    return tps;
}

/* Simulated score of `sw`: decode tokens/s, scaled down when the median TPOT or the mean hops
 * break their bounds; -1 when a block is uncovered. */
static int score(tplace *t, const rt_swarm *sw, double *out) {
    *out = -1;
    if (rt_swarm_uncovered(sw, NULL) > 0) return FU_OK;
    int rc = rt_sim_run(sw, &t->sim, &t->last);
    t->evals++;
    if (rc) return rc;
    *out = bounded(t, t->last.decode_tps, t->last.tpot_p50, t->last.mean_hops);
    return FU_OK;
}

/*
 * The quick estimate that guides the local search (the simulator checks its result):
 * - flow: the max flow routes a request over server i with probability share_i = flow_i / F;
 * - concurrency N: the KV bound, as the feeder and the router keep it: every block's capacity
 *   over the servers holding it at 0.8, and every server's at kv_hwm for its share of N (a
 *   server whose capacity is unknown, such as a spare not yet loaded, bounds nothing);
 * - time per output token: the share-weighted cycle of each server for the batch Little's law
 *   gives it (tpot_fixed_point), plus the share-weighted link latency and M/G/1 wait;
 * - decode tokens/s = min(N / TPOT, what the prompt slots allow, the decode share of the max
 *   flow).
 */
/* Server i's cycle for `batch` sequences in all: as many batches as its decode limit needs,
 * each with its share of the prompts (amortised over the outputs); *one gets one batch's time. */
static double cycle_time(const tplace *t, const rt_swarm *sw, int i, double batch, double *one) {
    const rt_server *v = &sw->servers[i];
    int k = v->last - v->first;
    double per_req_prompt = (double)(t->sim.prompt_len > 0 ? t->sim.prompt_len : 750) /
                            (t->sim.output_len > 0 ? t->sim.output_len : 240);
    const rt_step_profile *p = rt_sim_profile_find(t->sim.profiles, v->kind);
    if (!p) {
        double tp = rt_swarm_tput(sw, i, k);
        *one = tp > 0 ? batch * (1 + per_req_prompt) / tp : 1e9;
        return *one;
    }
    int lim = p->decode_max_tokens && p->n_limits > 0 ? p->decode_max_tokens[(k < p->n_limits ? k : p->n_limits) - 1] : 0;
    double m = lim > 0 ? ceil(batch / lim) : 1, b = batch / m;
    *one = k * (rt_step_seconds(p, 0, b < 1 ? 1 : (int)ceil(b), 0) + rt_step_seconds(p, (int)ceil(b * per_req_prompt), 0, 0));
    return m * *one;
}

static double kv_bound(tplace *t, const rt_swarm *sw, double req_len) {
    int L = sw->model.n_layers;
    double hwm = t->sim.kv_hwm > 0 ? t->sim.kv_hwm : 0.85, n = 1e18, F = t->fl.value;
    memset(t->layer_kv, 0, (size_t)L * sizeof(double));
    for (int i = 0; i < sw->n_servers; i++) {
        if (!rt_swarm_serving(sw, i)) continue;
        const rt_server *v = &sw->servers[i];
        double cap = rt_swarm_kv_tokens(sw, i, v->last - v->first);
        for (int l = v->first; l < v->last; l++) t->layer_kv[l] += cap > 0 ? cap : INFINITY; /* unknown: no bound */
        if (!(cap > 0)) continue;
        double share = F > 0 ? t->fl.server_flow[i] / F : 0;
        if (share > 1e-9 && hwm * cap / (req_len * share) < n) n = hwm * cap / (req_len * share);
    }
    for (int l = 0; l < L; l++)
        if (t->layer_kv[l] > 0 && isfinite(t->layer_kv[l]) && 0.8 * t->layer_kv[l] / req_len < n)
            n = 0.8 * t->layer_kv[l] / req_len;
    return n < 1e17 ? n : 1e4;
}

/* The share-weighted delay of the hops at X steps/s in all: latency plus an M/G/1 wait on each
 * link, whose transfers are decode steps of one token and, once per output_len of them, a
 * prompt of prompt_len tokens (tok bytes a token to or from the coordinator, tok + act between
 * servers; the prompts' second moment is the length set's when there is one). A link at or over
 * capacity counts 10 s. */
static double link_delay(const tplace *t, const rt_swarm *sw, double x) {
    double d = 0, F = t->fl.value;
    double pl = t->sim.prompt_len > 0 ? t->sim.prompt_len : 750, ol = t->sim.output_len > 0 ? t->sim.output_len : 240;
    for (int h = 0; h < t->fl.n_hops; h++) {
        const rt_flow_hop *hp = &t->fl.hops[h];
        double share = hp->flow / F;
        if (share <= 0) continue;
        rt_link l = rt_swarm_link(sw, hp->from, hp->to);
        double b = (hp->from == RT_SOURCE || hp->to == RT_SINK) ? sw->model.token_bytes
                                                                 : sw->model.token_bytes + sw->model.act_bytes;
        double sd = l.bandwidth > 0 ? b / l.bandwidth : 0, sp = pl * sd;
        double lam = x * share * (1 + 1 / ol), es = (ol * sd + sp) / (ol + 1), es2 = (ol * sd * sd + t->p2 * sd * sd) / (ol + 1);
        double rho = lam * es, w = rho < 0.999 ? lam * es2 / (2 * (1 - rho)) : 10;
        d += share * (l.latency + sd + w);
    }
    return d;
}

/* Prompts server i takes into one cycle: its prompt request limit per batch (0: unlimited). */
static double prompt_slots(const tplace *t, const rt_swarm *sw, int i) {
    const rt_server *v = &sw->servers[i];
    int k = v->last - v->first;
    const rt_step_profile *p = rt_sim_profile_find(t->sim.profiles, v->kind);
    int lim = p && p->prompt_max_requests && p->n_limits > 0 ? p->prompt_max_requests[(k < p->n_limits ? k : p->n_limits) - 1] : 0;
    return lim > 0 ? lim : 1e9;
}

/* The time per output token for N requests in flight: each server's batch is, by Little's law,
 * its arrival rate N x share_i / TPOT times its cycle (as many batches as its decode limit
 * needs), and a request at a busy server waits for the cycle in progress, then its own batch;
 * solved by fixed-point iteration from single-request batches. *prompt_bound gets the decode
 * tokens/s the servers' prompt slots allow: a server takes at most its prompt limit of new
 * prompts per batch, and every output_len decode tokens bring one. */
static double tpot_fixed_point(tplace *t, const rt_swarm *sw, double n, double *prompt_bound) {
    double F = t->fl.value, tpot = link_delay(t, sw, 0), one;
    for (int i = 0; i < t->fl.n; i++)
        if (t->fl.server_flow[i] > 0) tpot += t->fl.server_flow[i] / F * cycle_time(t, sw, i, 1, &one);
    for (int it = 0; it < 30; it++) {
        double next = link_delay(t, sw, n / tpot);
        for (int i = 0; i < t->fl.n; i++) {
            double share = t->fl.server_flow[i] / F;
            if (share <= 0) continue;
            double c = cycle_time(t, sw, i, 1, &one);
            for (int inner = 0; inner < 3; inner++) c = cycle_time(t, sw, i, fmax(1, n * share * c / tpot), &one);
            next += share * (c + one); /* the cycle in progress, then its own batch */
            double pb = prompt_slots(t, sw, i) * t->out_len / (share * c);
            if (it == 0 || pb < *prompt_bound) *prompt_bound = pb;
        }
        if (fabs(next - tpot) < 1e-6 * tpot) return next;
        tpot = 0.5 * (tpot + next);
    }
    return tpot;
}

/* The quick estimate of decode tokens/s (-1: a block uncovered or no flow). */
static int quick_score(tplace *t, const rt_swarm *sw, double *out) {
    *out = -1;
    t->quick_evals++;
    if (rt_swarm_uncovered(sw, NULL) > 0) return FU_OK;
    int rc = rt_flow_compute(sw, &t->sim.route.flow, &t->fl, NULL);
    if (rc || !(t->fl.value > 0)) return rc;
    int pl = t->sim.prompt_len > 0 ? t->sim.prompt_len : 750, ol = t->sim.output_len > 0 ? t->sim.output_len : 240;
    int reserve = t->sim.kv_output_tokens > 0 ? t->sim.kv_output_tokens : ol;
    double prompts = 1e18, n = kv_bound(t, sw, pl + reserve), F = t->fl.value, tpot = tpot_fixed_point(t, sw, n, &prompts);
    double through = 0;
    for (int i = 0; i < t->fl.n; i++) through += t->fl.server_flow[i];
    *out = bounded(t, fmin(fmin(n / tpot, prompts), F * ol / (pl + ol)), tpot, through / F);
    return FU_OK;
}

/* The seed placements, written over a copy of `base`; 0 when `which` does not apply. */
static int seed_place(const rt_swarm *base, int which, const rt_tplace_opts *o, rt_swarm *out) {
    memset(out, 0, sizeof *out);
    int rc = rt_swarm_clone(out, base);
    if (rc) return rc;
    switch (which) {
    case 0: return rt_place_search(out, &o->search, NULL);
    case 1: return rt_place_petals(out);
    case 2: return rt_place_swarm(out);
    default: return rt_swarm_uncovered(out, NULL) ? FU_ERR_NOT_FOUND : FU_OK;
    }
}

static const char *seed_names[] = {"search", "petals", "swarm", "current", "stripes"};
enum { STRIPE_SEEDS = 6 }; /* stripe placements simulated, the best by the quick estimate */

/* Keeps `cand` in `sw` (the old content goes to cand) when its simulated score beats *best. */
static int keep_if_better(tplace *t, rt_swarm *sw, rt_swarm *cand, double *best, int *which, int k) {
    double s;
    int rc = score(t, cand, &s);
    if (rc || s <= *best) return rc;
    rt_swarm tmp = *sw;
    *sw = *cand;
    *cand = tmp;
    *best = s, *which = k;
    return FU_OK;
}

static int quick_search(tplace *t, rt_swarm *sw, span *saved, long moves);

static int stripe_score(void *ctx, const rt_swarm *sw, double *out) {
    return quick_score(ctx, sw, out);
}

/* The STRIPE_SEEDS stripe placements of each grouping (by kind and site, by site) that the quick
 * estimate ranks first, each simulated. */
static int stripe_seeds(tplace *t, const rt_swarm *base, rt_swarm *sw, double *best, int *which) {
    rt_swarm cand[STRIPE_SEEDS];
    int rc = FU_OK;
    for (int by = RT__STRIPE_KIND_SITE; by <= RT__STRIPE_SITE && !rc; by++) {
        int n = 0;
        rc = rt__stripe_best(base, (rt__stripe_groups)by, stripe_score, t, STRIPE_SEEDS, cand, &n);
        for (int i = 0; i < n; i++) {
            if (!rc) rc = keep_if_better(t, sw, &cand[i], best, which, 4);
            rt_swarm_free(&cand[i]);
        }
    }
    return rc;
}

/* Every seed, and `restarts` local searches on the quick estimate from each, are simulated, then
 * the stripe placements; the best goes into `sw`. */
static int best_seed(tplace *t, rt_swarm *sw, span *saved, double *best, int *which) {
    *best = -1;
    *which = -1;
    rt_swarm base = {0};
    int rc = rt_swarm_clone(&base, sw);
    for (int k = 0; k < 4 && !rc; k++) {
        rt_swarm seed, cand;
        rc = seed_place(&base, k, t->o, &seed);
        if (rc && rc != FU_ERR_NOMEM) { /* a rule that cannot place this swarm: not a seed */
            rt_swarm_free(&seed);
            rc = FU_OK;
            continue;
        }
        /* the seed as placed, then `restarts` searches from it (keep_if_better takes the copy) */
        for (int r = -1; r < t->restarts && !rc; r++) {
            if ((rc = rt_swarm_clone(&cand, &seed))) break;
            if (r >= 0) rc = quick_search(t, &cand, saved, t->quick_moves);
            if (!rc) rc = keep_if_better(t, sw, &cand, best, which, k);
            rt_swarm_free(&cand);
        }
        rt_swarm_free(&seed);
    }
    if (!rc) rc = stripe_seeds(t, &base, sw, best, which);
    rt_swarm_free(&base);
    if (!rc && *which < 0) rc = fu_errorf(FU_ERR_NOT_FOUND, "placement: no seed placement covers every block");
    return rc;
}

static int pick_serving(const rt_swarm *sw, uint64_t *rng) {
    for (int tries = 0; tries < 4 * sw->n_servers + 8; tries++) {
        int i = rt__rng_int(rng, sw->n_servers);
        if (sw->servers[i].state == RT_SERVER_ACTIVE) return i;
    }
    return -1;
}

/* A random move of one server: its new span (first == last: becomes a spare). */
static span propose(const rt_swarm *sw, int i, uint64_t *rng) {
    const rt_server *s = &sw->servers[i];
    int L = sw->model.n_layers, maxk = rt_swarm_max_layers(sw, i), k = s->last - s->first;
    int j = pick_serving(sw, rng);
    const rt_server *o = j >= 0 ? &sw->servers[j] : s;
    span r = {s->first, s->last};
    switch (rt__rng_int(rng, 5)) {
    case 0: /* resize, keeping the start */
        k = 1 + rt__rng_int(rng, maxk > 0 ? maxk : 1);
        r.first = s->first < L ? s->first : 0, r.last = r.first + k;
        break;
    case 1: /* shift */
        r.first = s->first + (rt__rng_int(rng, 2) ? 1 : -1) * (1 + rt__rng_int(rng, 4)), r.last = r.first + k;
        break;
    case 2: /* start where another ends */
        r.first = o->last < L ? o->last : L - (k > 0 ? k : 1), r.last = r.first + (k > 0 ? k : 1);
        break;
    case 3: /* copy another's span */
        r.first = o->first, r.last = o->last;
        break;
    default: /* become a spare */
        r.first = r.last = 0;
    }
    if (r.last > L) r.first -= r.last - L, r.last = L;
    if (r.first < 0) r.last -= r.first, r.first = 0;
    return r;
}

/* Covers a gap [g0, g1) by stretching one server that ends at g0 or starts at g1 over it,
 * within its limit; 1 if it did. */
static int repair_gap(rt_swarm *sw, int g0, int g1, uint64_t *rng) {
    int n = sw->n_servers, off = n > 0 ? rt__rng_int(rng, n) : 0;
    for (int t = 0; t < n; t++) {
        int i = (t + off) % n;
        const rt_server *s = &sw->servers[i];
        if (!rt_swarm_serving(sw, i)) continue;
        if (s->last == g0 && !rt_swarm_set_span(sw, i, s->first, g1)) return 1;
        if (s->first == g1 && !rt_swarm_set_span(sw, i, g0, s->last)) return 1;
    }
    return 0;
}

/* Stretches neighbours over the blocks a move left uncovered; 1 if every block is covered. */
static int repair(rt_swarm *sw, uint64_t *rng) {
    for (int round = 0; round < 4; round++) {
        int g0;
        if (rt_swarm_uncovered(sw, &g0) == 0) return 1;
        int g1 = g0 + 1;
        while (g1 < sw->model.n_layers) {
            int covered = 0;
            for (int i = 0; i < sw->n_servers && !covered; i++)
                covered = rt_swarm_serving(sw, i) && sw->servers[i].first <= g1 && g1 < sw->servers[i].last;
            if (covered) break;
            g1++;
        }
        if (!repair_gap(sw, g0, g1, rng)) return 0;
    }
    return rt_swarm_uncovered(sw, NULL) == 0;
}

static void save_spans(const rt_swarm *sw, span *out) {
    for (int i = 0; i < sw->n_servers; i++) out[i] = (span){sw->servers[i].first, sw->servers[i].last};
}

static void restore_spans(rt_swarm *sw, const span *in) {
    for (int i = 0; i < sw->n_servers; i++) {
        sw->servers[i].first = in[i].first;
        sw->servers[i].last = in[i].last;
    }
    sw->version++;
}

/* Moves one server (or swaps two), then repairs coverage. 1 if the swarm changed and covers. */
static int perturb(rt_swarm *sw, uint64_t *rng) {
    int i = pick_serving(sw, rng);
    if (i < 0) return 0;
    rt_server *s = &sw->servers[i];
    if (rt__rng_int(rng, 4) == 0) { /* swap with another */
        int j = pick_serving(sw, rng);
        if (j < 0 || j == i) return 0;
        rt_server *o = &sw->servers[j];
        span a = {s->first, s->last}, b = {o->first, o->last};
        if (rt_swarm_set_span(sw, i, b.first, b.last)) return 0;
        if (rt_swarm_set_span(sw, j, a.first, a.last)) return 0;
        return 1;
    }
    span nw = propose(sw, i, rng);
    if ((nw.first == s->first && nw.last == s->last) || rt_swarm_set_span(sw, i, nw.first, nw.last)) return 0;
    return repair(sw, rng);
}

/* Moves the boundary at block b by d blocks: every serving server that ends at b ends at b + d,
 * and every one that starts there starts at b + d, when each then holds at least one block
 * within its limit and both kinds exist; 1 if it moved (0 may leave spans changed: the caller
 * restores them). */
static int shift_boundary(rt_swarm *sw, int b, int d) {
    int ends = 0, starts = 0;
    for (int i = 0; i < sw->n_servers; i++) {
        const rt_server *s = &sw->servers[i];
        if (!rt_swarm_serving(sw, i) || (s->last != b && s->first != b)) continue;
        int k = s->last == b ? b + d - s->first : s->last - b - d;
        if (k < 1 || k > rt_swarm_max_layers(sw, i)) return 0;
        ends += s->last == b, starts += s->first == b;
    }
    if (!ends || !starts) return 0;
    for (int i = 0; i < sw->n_servers; i++) {
        const rt_server *s = &sw->servers[i];
        if (!rt_swarm_serving(sw, i)) continue;
        int rc = s->last == b ? rt_swarm_set_span(sw, i, s->first, b + d)
                 : s->first == b ? rt_swarm_set_span(sw, i, b + d, s->last) : FU_OK;
        if (rc) return 0;
    }
    return 1;
}

/* Exchanges the spans of serving server i and another placeable server of its kind (one that
 * holds nothing takes i's span, and i then holds nothing), so that the pipelines keep their
 * shape over other links; 1 if it did. */
static int swap_kind(rt_swarm *sw, int i, uint64_t *rng) {
    int n = sw->n_servers, off = rt__rng_int(rng, n);
    for (int t = 0; t < n; t++) {
        int j = (t + off) % n;
        if (j == i || !rt__placeable(sw, j) || strcmp(sw->servers[j].kind, sw->servers[i].kind)) continue;
        span a = {sw->servers[i].first, sw->servers[i].last}, b = {sw->servers[j].first, sw->servers[j].last};
        if (!rt_swarm_serving(sw, j)) b.first = b.last = 0;
        return !rt_swarm_set_span(sw, j, a.first, a.last) && !rt_swarm_set_span(sw, i, b.first, b.last);
    }
    return 0;
}

/* A refining move: a third of the time the boundary after a random serving server moves by one
 * or two blocks either way, a third it trades places with a server of its kind (the pipelines
 * keep their shape), else a perturbation. */
static int refine_move(rt_swarm *sw, uint64_t *rng) {
    int kind = rt__rng_int(rng, 3), i = pick_serving(sw, rng), d = 1 + rt__rng_int(rng, 2);
    if (kind == 0 || i < 0) return perturb(sw, rng);
    if (kind == 1) return swap_kind(sw, i, rng);
    return shift_boundary(sw, sw->servers[i].last, rt__rng_int(rng, 2) ? d : -d);
}

/* Tries moving each boundary between two spans by one block later, then earlier, in block
 * order, keeping the first move at a boundary that raises the simulated score, while
 * evaluations last. The stripes' shares follow the servers' limits, not their speed or KV, so
 * a pipeline is often one block from balance. */
static int sweep_boundaries(tplace *t, rt_swarm *sw, span *saved, double *best) {
    int rc = FU_OK;
    for (int b = 1; b < sw->model.n_layers && !rc && t->evals < t->max_evals; b++) {
        for (int d = 1; d >= -1 && !rc && t->evals < t->max_evals; d -= 2) {
            save_spans(sw, saved);
            double s = -1;
            int moved = shift_boundary(sw, b, d);
            if (moved) rc = score(t, sw, &s);
            if (moved && !rc && s > *best * (1 + 1e-6)) {
                *best = s;
                break;
            }
            restore_spans(sw, saved);
        }
    }
    return rc;
}

/* One simulated refining step: a move, kept when the score rises. */
static int try_move(tplace *t, rt_swarm *sw, span *saved, double *best) {
    save_spans(sw, saved);
    if (!refine_move(sw, &t->rng)) {
        restore_spans(sw, saved);
        return FU_OK;
    }
    double s;
    int rc = score(t, sw, &s);
    if (rc || s <= *best * (1 + 1e-6)) {
        restore_spans(sw, saved);
        return rc;
    }
    *best = s;
    return FU_OK;
}

/* Simulated annealing on the quick estimate: `moves` perturbations, each kept when the estimate
 * rises or, with a falling chance, when it drops a little; `sw` ends at the best one seen. */
static int quick_search(tplace *t, rt_swarm *sw, span *saved, long moves) {
    span *best_spans = malloc(((size_t)sw->n_servers + 1) * sizeof *best_spans);
    if (!best_spans) return fu_errorf(FU_ERR_NOMEM, "placement: out of memory");
    double cur, best, s;
    int rc = quick_score(t, sw, &cur);
    best = cur;
    save_spans(sw, best_spans);
    for (long m = 0; !rc && m < moves; m++) {
        save_spans(sw, saved);
        if (!perturb(sw, &t->rng)) {
            restore_spans(sw, saved);
            continue;
        }
        rc = quick_score(t, sw, &s);
        double temp = 0.05 * (1 - (double)m / moves) + 1e-4; /* relative: a 5% loss is likely at first */
        if (!rc && (s > cur || (cur > 0 && s > 0 && rt__rng_unit(&t->rng) < exp((s - cur) / (temp * cur))))) {
            cur = s;
            if (s > best * (1 + 1e-9)) best = s, save_spans(sw, best_spans);
        } else {
            restore_spans(sw, saved);
        }
    }
    restore_spans(sw, best_spans);
    free(best_spans);
    return rc;
}

/* E[prompt_len^2] of the workload: the length set's, else the fixed prompt's square. */
static double prompt_second_moment(const rt_sim_opts *so) {
    double pl = so->prompt_len > 0 ? so->prompt_len : 750, q = 0;
    if (!so->lengths || so->n_lengths <= 0) return pl * pl;
    for (int i = 0; i < so->n_lengths; i++) q += (double)so->lengths[i].prompt_len * so->lengths[i].prompt_len;
    return q / so->n_lengths;
}

static void tplace_init(tplace *t, const rt_tplace_opts *o) {
    memset(t, 0, sizeof *t);
    t->o = o;
    t->sim = o->sim;

    t->rng = o->seed ^ 0x7f4a7c159e3779b9ULL;
    t->max_evals = o->max_evals > 0 ? o->max_evals : 60;
    t->quick_moves = 6000;
    t->out_len = t->sim.output_len > 0 ? t->sim.output_len : 240;
    t->p2 = prompt_second_moment(&t->sim);
    t->restarts = o->restarts > 0 ? o->restarts : 4;
}

int rt_place_throughput(rt_swarm *sw, const rt_tplace_opts *opts, rt_tplace_stats *stats) {
    if (!sw || !opts) return fu_errorf(FU_ERR_INVALID, "rt_place_throughput: NULL argument");
    tplace t;
    tplace_init(&t, opts);
    span *saved = malloc(((size_t)sw->n_servers + 1) * sizeof *saved);
    t.layer_kv = calloc((size_t)sw->model.n_layers + 1, sizeof(double));
    double best = -1, start = -1;
    int which = -1, rc = saved && t.layer_kv ? FU_OK : fu_errorf(FU_ERR_NOMEM, "placement: out of memory");
    if (!rc) rc = best_seed(&t, sw, saved, &best, &which);
    start = best;
    if (!rc) rc = sweep_boundaries(&t, sw, saved, &best);
    /* moves that cannot apply (no span change, over a limit) cost no simulation; bound them too */
    for (long tries = 0; !rc && t.evals < t.max_evals && tries < 50L * t.max_evals; tries++)
        rc = try_move(&t, sw, saved, &best);
    double s;
    if (!rc) rc = score(&t, sw, &s);
    if (!rc && stats) {
        *stats = (rt_tplace_stats){t.evals, start, t.last.decode_tps, t.last.tpot_p50, t.last.mean_hops,
                                   seed_names[which]};
    }
    free(saved), free(t.layer_kv);
    rt_flow_free(&t.fl);
    return rc;
}

/* ---- the estimate alone, and a join by it ------------------------------------------------- */

/* A tplace for quick estimates under `so` with no bounds; t->layer_kv must be freed with t->fl. */
static int estimate_init(tplace *t, rt_tplace_opts *o, const rt_swarm *sw, const rt_sim_opts *so) {
    memset(o, 0, sizeof *o);
    if (so) o->sim = *so;
    tplace_init(t, o);
    t->layer_kv = calloc((size_t)sw->model.n_layers + 1, sizeof(double));
    return t->layer_kv ? FU_OK : fu_errorf(FU_ERR_NOMEM, "estimate: out of memory");
}

static void estimate_free(tplace *t) {
    free(t->layer_kv);
    rt_flow_free(&t->fl);
}

int rt_estimate_decode_tps(const rt_swarm *sw, const rt_sim_opts *so, double *tps) {
    if (!sw || !tps) return fu_errorf(FU_ERR_INVALID, "rt_estimate_decode_tps: NULL argument");
    tplace t;
    rt_tplace_opts o;
    int rc = estimate_init(&t, &o, sw, so);
    if (!rc) rc = quick_score(&t, sw, tps);
    if (!rc && *tps < 0) *tps = 0;
    estimate_free(&t);
    return rc;
}

/* The estimate with server id on [f, l) (an empty span: a spare), on the scratch copy `tmp`. */
static int window_score(tplace *t, rt_swarm *tmp, int id, int f, int l, int *uncovered, double *out) {
    int rc = rt_swarm_set_span(tmp, id, f, l);
    if (rc) return rc;
    *uncovered = rt_swarm_uncovered(tmp, NULL);
    return quick_score(t, tmp, out);
}

/* aligned[b] bit 1: b = 0 or some other serving server ends at b (a window may start there and
 * get flow); bit 2: b = L or one starts at b (a window may end there). NULL (every window tried)
 * when partial execution links any span, or a block is uncovered without server id (a window
 * that covers more of a gap is worth trying even where it meets no span). */
static unsigned char *aligned_ends(const tplace *t, const rt_swarm *tmp, int id) {
    int L = tmp->model.n_layers;
    if (t->sim.route.flow.allow_partial || rt_swarm_uncovered(tmp, NULL) > 0) return NULL;
    unsigned char *a = calloc((size_t)L + 1, 1);
    if (!a) return NULL;
    a[0] |= 1, a[L] |= 2;
    for (int i = 0; i < tmp->n_servers; i++)
        if (i != id && rt_swarm_serving(tmp, i)) a[tmp->servers[i].last] |= 1, a[tmp->servers[i].first] |= 2;
    return a;
}

/* The windows server id can hold (those meeting `ends` when not NULL), by: fewest blocks
 * uncovered, then the highest estimate, then the longer span (redundancy), then the earlier
 * start. tmp has id holding nothing. */
static int scan_windows(tplace *t, rt_swarm *tmp, int id, const unsigned char *ends, int *first, int *last,
                        double *best) {
    int L = tmp->model.n_layers, maxk = rt_swarm_max_layers(tmp, id), bunc = L + 1, rc = FU_OK;
    *first = *last = -1;
    *best = -1;
    for (int k = 1; k <= maxk && !rc; k++) {
        for (int f = 0; f + k <= L && !rc; f++) {
            if (ends && (!(ends[f] & 1) || !(ends[f + k] & 2))) continue;
            int unc = 0;
            double s = -1;
            rc = window_score(t, tmp, id, f, f + k, &unc, &s);
            double tol = 1e-9 * fabs(*best) + 1e-12;
            bool better = unc != bunc ? unc < bunc : fabs(s - *best) > tol ? s > *best : k > *last - *first;
            if (!rc && better) *first = f, *last = f + k, bunc = unc, *best = s;
        }
    }
    return rc;
}

/* The best window for server id (scan_windows). With every block covered and no partial
 * execution, only windows that meet other spans at both ends (or the model's) are tried, as
 * another carries no flow; every window when none of those fits. */
static int best_window_tp(tplace *t, rt_swarm *tmp, int id, int *first, int *last, double *best) {
    unsigned char *ends = aligned_ends(t, tmp, id);
    int rc = scan_windows(t, tmp, id, ends, first, last, best);
    if (!rc && ends && *first < 0) rc = scan_windows(t, tmp, id, NULL, first, last, best);
    free(ends);
    return rc;
}

int rt_place_join_throughput(const rt_swarm *sw, int id, const rt_sim_opts *so, int *first, int *last, double *gain) {
    if (!sw || !first || !last || id < 0 || id >= sw->n_servers)
        return fu_errorf(FU_ERR_INVALID, "rt_place_join_throughput: bad arguments");
    rt_swarm tmp;
    int rc = rt_swarm_clone(&tmp, sw);
    if (rc) return rc;
    tplace t;
    rt_tplace_opts o;
    double before = -1, after = -1;
    int unc;
    rc = estimate_init(&t, &o, &tmp, so);
    if (!rc) rc = window_score(&t, &tmp, id, 0, 0, &unc, &before);
    if (!rc) rc = best_window_tp(&t, &tmp, id, first, last, &after);
    if (!rc && *first < 0) rc = fu_errorf(FU_ERR_INVALID, "rt_place_join_throughput: server %d holds no block", id);
    if (!rc && gain) *gain = fmax(after, 0) - fmax(before, 0);
    estimate_free(&t);
    rt_swarm_free(&tmp);
    return rc;
}
