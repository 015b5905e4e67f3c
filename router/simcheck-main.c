/* simcheck-main.c -- fusion-bench-sim: fusion-sim against Helix's published simulator results
 * (LLaMA-2 70B, offline) on Helix's own clusters and placements, and the order of each
 * published pair of placements. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "options.h"
#include "router.h"
#include "status.h"

/*
 * Usage: fusion-bench-sim [--helix-dir DIR] [--lengths FILE] [--duration S] [--seed N] [--seeds N]
 *
 * Each row loads a Helix cluster and placement, feeds requests as Helix's offline runs do
 * (RT_FEED_KV), routes them with IWRR over the max flow, counting each hop's load as Helix's
 * scheduler does (RT_IWRR_CUMULATIVE: every token routed so far), and prints the simulated
 * decode tokens/s next to the figure in derived/ae_results.csv, twice: with Helix's average lengths
 * (750 + 240 tokens, fixed), and with lengths drawn as Helix draws them, uniformly from the
 * pairs of its filtered Azure Conversation set (config/traces/azure-conv-lengths.txt: 16,657
 * pairs, means 763.1 / 232.4, at most 2047 / 1000 tokens). Helix's Swarm rows of its
 * main runs (single cluster, and the first of two on 3 regions) used Swarm's own scheduler with
 * 180 requests in flight, and so do they here (RT_SIM_ROUTE_SWARM, a closed loop of 180); its
 * placement study ran the same 3-region Swarm placement with max-flow scheduling too (the second),
 * fed and routed as the others: by KV and IWRR.
 * The "gateway" column runs the Azure case again with the gateway's own accounting
 * (RT_IWRR_LIVE: the work routed over a hop now). Each row also gets the quick estimate the
 * throughput placement searches on (rt_estimate_decode_tps), and the published pairs are
 * ranked by it too.
 *
 * The online rows feed requests as Helix's online runs do, but by Poisson: Helix samples each
 * 3 s interval's rate from its (smooth) Azure Conversation arrival trace, rescaled so that the
 * average offers its cluster_token_throughput, i.e. that many tokens/s / 995.5 tokens a request
 * (the trace is a binary file not in the extract). 1800 s with no warm-up, Azure lengths,
 * and Helix's online KV setting: admission to 0.9 of KV, expecting 0.6 of the outputs.
 */

typedef struct check_row {
    const char *id, *label, *cluster, *placement;
    int partial;
    int swarm; /* run as Helix ran Swarm's scheduler: its routing, 180 requests in flight */
    double published;
    const char *published_note;
    double fixed, sim, max_flow, hops; /* fixed: Helix's average lengths; sim: Azure lengths */
    double live;                       /* Azure lengths, the gateway's IWRR load (0: Swarm rows) */
    double estimate;                   /* the placement's quick estimate (Azure mean lengths) */
} check_row;

static check_row rows[] = {
    {"single-helix", "single 24, Helix MILP", "single_cluster/config/cluster24.ini",
     "single_cluster/layout_llama70b/ilp/ilp_sol.ini", 0, 0, 252.1, "ae line 262", 0, 0, 0, 0, 0, 0},
    {"single-swarm", "single 24, Swarm", "single_cluster/config/cluster24.ini",
     "single_cluster/layout_llama70b/swarm/swarm_sol.ini", 0, 1, 124.7, "ae line 275, Swarm scheduler", 0, 0, 0, 0, 0, 0},
    {"geo-helix", "3-region 24, Helix MILP", "distributed_clusters/config/3cluster24.ini",
     "distributed_clusters/layout_llama70b/ilp/ilp_sol.ini", 0, 0, 98.0, "ae line 1634", 0, 0, 0, 0, 0, 0},
    {"geo-swarm-own", "3-region 24, Swarm", "distributed_clusters/config/3cluster24.ini",
     "distributed_clusters/layout_llama70b/swarm/swarm_sol.ini", 0, 1, 51.9, "ae line 1647, Swarm scheduler", 0, 0,
     0, 0, 0, 0},
    {"geo-swarm", "3-region 24, Swarm, max-flow", "distributed_clusters/config/3cluster24.ini",
     "model_placement/layout_distributed/swarm/swarm_sol.ini", 0, 0, 41.6, "ae line 2173", 0, 0, 0, 0, 0, 0},
    {"geo-petals", "3-region 24, Petals", "distributed_clusters/config/3cluster24.ini",
     "model_placement/layout_distributed/petals/petals_sol.ini", 1, 0, 66.6, "ae line 2186", 0, 0, 0, 0, 0, 0},
    {"geo-noprune", "3-region 24, MILP unpruned", "ablation/config/3cluster24.ini",
     "ablation/layouts/no_prune_24/ilp_sol.ini", 0, 0, 74.9, "ae line 2512", 0, 0, 0, 0, 0, 0},
};
enum { N_ROWS = sizeof rows / sizeof rows[0] };

/* Helix's online runs: the offered load (its cluster_token_throughput), and the published decode
 * tokens/s and median prompt and decode-step latencies. */
typedef struct online_row {
    const char *label, *cluster, *placement;
    double offered, published, prompt_p50, decode_p50;
    const char *published_note;
    double sim, ttft_p50, tpot_p50;
} online_row;

static online_row online[] = {
    {"single 24, Helix MILP", "single_cluster/config/cluster24.ini", "single_cluster/layout_llama70b/ilp/ilp_sol.ini",
     700, 141.6, 2.64, 0.98, "ae line 303", 0, 0, 0},
    {"3-region 24, Helix MILP", "distributed_clusters/config/3cluster24.ini",
     "distributed_clusters/layout_llama70b/ilp/ilp_sol.ini", 320, 59.3, 5.79, 0.93, "ae line 1675", 0, 0, 0},
};
enum { N_ONLINE = sizeof online / sizeof online[0] };

/* Published pairs: the first placement beat the second in Helix's simulator. */
static const char *pairs[][2] = {
    {"single-helix", "single-swarm"}, {"geo-helix", "geo-swarm-own"}, {"geo-helix", "geo-swarm"},
    {"geo-helix", "geo-petals"},      {"geo-petals", "geo-swarm"},      {"geo-helix", "geo-noprune"},
};
enum { N_PAIRS = sizeof pairs / sizeof pairs[0] };

static struct {
    char *hdir, *lengths_file;
    double duration;
    long seed, seeds;
    rt_sim_request *lengths;
    int n_lengths;
} args;

static const fu_opt opts[] = {
    {"helix-dir", 0, FU_OPT_STRING, FU_OPT_TO(args.hdir), "DIR", "the Helix data", .def = FUSION_HELIX_DIR},
    {"duration", 0, FU_OPT_FLOAT, FU_OPT_TO(args.duration), "S", "simulated seconds", .def = "660"},
    {"seed", 0, FU_OPT_INT, FU_OPT_TO(args.seed), .help = "the first simulation seed", .lo = 0, .hi = 1L << 30},
    {"seeds", 0, FU_OPT_INT, FU_OPT_TO(args.seeds), .help = "runs per figure, their mean printed (seeds from --seed on)",
     .def = "3", .lo = 1, .hi = 100},
    {"lengths", 0, FU_OPT_STRING, FU_OPT_TO(args.lengths_file), "FILE",
     "the request lengths to draw from (\"prompt_len output_len\" lines)", .def = FUSION_LENGTHS_FILE},
    FU_OPT_END,
};

static const fu_opt_spec spec = {"fusion-bench-sim",
                                 "usage: fusion-bench-sim [--helix-dir DIR] [--lengths FILE] [--duration S] [--seed N] [--seeds N]",
                                 opts, NULL};

static int load(const char *cluster, const char *placement, rt_swarm *sw) {
    char d[4096], e[4096];
    snprintf(d, sizeof d, "%s/artifact_evaluation/%s", args.hdir, cluster);
    snprintf(e, sizeof e, "%s/artifact_evaluation/%s", args.hdir, placement);
    rt_helix_files f = {args.hdir, "llama2_70b", NULL, NULL, NULL};
    int rc = rt_helix_load_swarm(sw, &f, d);
    if (!rc) rc = rt_helix_load_placement(sw, e);
    return rc;
}

/* Lengths drawn from the set of --lengths, as Helix's LengthSampler draws them (the quick
 * estimate reads their means). */
static void azure_lengths(rt_sim_opts *so) {
    rt_sim_opts_draw_lengths(so, args.lengths, args.n_lengths);
}

/* One simulation of a loaded placement: Helix's fixed average lengths (750 / 240), or lengths
 * drawn from Helix's Azure Conversation set (KV reserved for the prompt and 240 outputs as
 * Helix expects); IWRR counts cumulative tokens as Helix's scheduler does. */
static rt_sim_opts row_opts(const check_row *r, const rt_sim_profiles *prof, int azure) {
    rt_sim_opts so = {0};
    so.route.load = RT_IWRR_CUMULATIVE;
    so.duration_s = args.duration;
    so.feed = r->swarm ? RT_FEED_CLOSED : RT_FEED_KV;
    so.concurrency = 180;
    so.routing = r->swarm ? RT_SIM_ROUTE_SWARM : RT_SIM_ROUTE_IWRR;
    so.profiles = prof;
    so.route.flow.allow_partial = r->partial;
    if (azure) azure_lengths(&so), so.kv_output_tokens = 240;
    return so;
}

/* Runs `so` with --seeds seeds from --seed on; *res is the last run, its decode tokens/s and
 * median TTFT and TPOT the means of all. */
static int run_seeds(const rt_swarm *sw, rt_sim_opts so, rt_sim_result *res) {
    double tps = 0, ttft = 0, tpot = 0;
    int rc = FU_OK;
    for (long i = 0; i < args.seeds && !rc; i++) {
        so.seed = (uint64_t)(args.seed + i);
        rc = rt_sim_run(sw, &so, res);
        tps += res->decode_tps, ttft += res->ttft_p50, tpot += res->tpot_p50;
    }
    if (!rc) res->decode_tps = tps / args.seeds, res->ttft_p50 = ttft / args.seeds, res->tpot_p50 = tpot / args.seeds;
    return rc;
}

static int simulate(const rt_swarm *sw, const check_row *r, const rt_sim_profiles *prof, int azure, rt_sim_result *res) {
    return run_seeds(sw, row_opts(r, prof, azure), res);
}

/* The Azure run of a max-flow row with the gateway's live IWRR load; Swarm's rows get 0. */
static int simulate_live(const rt_swarm *sw, const check_row *r, const rt_sim_profiles *prof, double *out) {
    rt_sim_opts so = row_opts(r, prof, 1);
    rt_sim_result res;
    so.route.load = RT_IWRR_LIVE;
    *out = 0;
    if (r->swarm) return FU_OK;
    int rc = run_seeds(sw, so, &res);
    if (!rc) *out = res.decode_tps;
    return rc;
}

/* The throughput placement's quick estimate of the row (rt_estimate_decode_tps), for the
 * Azure run's workload (it reads the mean lengths only). */
static int estimate(const rt_swarm *sw, const check_row *r, const rt_sim_profiles *prof, double *out) {
    rt_sim_opts so = row_opts(r, prof, 1);
    return rt_estimate_decode_tps(sw, &so, out);
}

static int run_row(check_row *r, const rt_sim_profiles *prof) {
    rt_swarm sw = {0};
    rt_sim_result fixed, azure;
    int rc = load(r->cluster, r->placement, &sw);
    if (!rc) rc = simulate(&sw, r, prof, 0, &fixed);
    if (!rc) rc = simulate(&sw, r, prof, 1, &azure);
    if (!rc) r->fixed = fixed.decode_tps, r->sim = azure.decode_tps, r->max_flow = azure.max_flow, r->hops = azure.mean_hops;
    if (!rc) rc = simulate_live(&sw, r, prof, &r->live);
    if (!rc) rc = estimate(&sw, r, prof, &r->estimate);
    rt_swarm_free(&sw);
    return rc;
}

/* One online row: Poisson arrivals offering Helix's load (see the top). */
static int run_online(online_row *r, const rt_sim_profiles *prof) {
    rt_swarm sw = {0};
    rt_sim_result res;
    int rc = load(r->cluster, r->placement, &sw);
    if (!rc) {
        rt_sim_opts so = {0};
        so.duration_s = 1800, so.warmup_s = -1;
        so.feed = RT_FEED_POISSON, so.arrival_rate = r->offered / (763.1 + 232.4);
        so.profiles = prof;
        so.route.load = RT_IWRR_CUMULATIVE;
        azure_lengths(&so), so.kv_output_tokens = 144, so.kv_hwm = 0.9;
        rc = run_seeds(&sw, so, &res);
    }
    if (!rc) r->sim = res.decode_tps, r->ttft_p50 = res.ttft_p50, r->tpot_p50 = res.tpot_p50;
    rt_swarm_free(&sw);
    return rc;
}

static void print_online(void) {
    int within = 0;
    printf("\nonline (Poisson at Helix's offered load, 1800 s, Azure lengths):\n");
    printf("%-28s %8s %9s %9s %6s %12s %12s  %s\n", "placement", "offered", "published", "fusion", "ratio",
           "prompt p50", "decode p50", "source");
    for (int i = 0; i < N_ONLINE; i++) {
        const online_row *r = &online[i];
        double ratio = r->sim / r->published;
        within += fabs(ratio - 1) <= 0.15;
        printf("%-28s %8.0f %9.1f %9.1f %6.2f %5.2f/%5.2f s %5.2f/%5.2f s  %s\n", r->label, r->offered, r->published,
               r->sim, ratio, r->ttft_p50, r->prompt_p50, r->tpot_p50, r->decode_p50, r->published_note);
    }
    printf("online within 15%%: %d of %d\n", within, N_ONLINE);
}

static const check_row *find(const char *id) {
    for (int i = 0; i < N_ROWS; i++)
        if (!strcmp(rows[i].id, id)) return &rows[i];
    return NULL;
}

/* Which figure pairs_in_order compares. */
enum { BY_AZURE, BY_FIXED, BY_ESTIMATE };

static double figure(const check_row *r, int by) {
    return by == BY_FIXED ? r->fixed : by == BY_ESTIMATE ? r->estimate : r->sim;
}

static int pairs_in_order(int by) {
    int same = 0;
    for (int i = 0; i < N_PAIRS; i++) {
        const check_row *a = find(pairs[i][0]), *b = find(pairs[i][1]);
        double x = figure(a, by), y = figure(b, by);
        same += x > y;
        printf("pair %-13s > %-13s published %6.1f > %6.1f  fusion %6.1f %s %6.1f  %s\n", a->id, b->id, a->published,
               b->published, x, x > y ? ">" : "<=", y, x > y ? "same" : "REVERSED");
    }
    return same;
}

static void print_table(void) {
    int within = 0;
    printf("%-28s %9s %9s %9s %6s %9s %6s %8s %5s %9s  %s\n", "placement", "max flow", "published", "fixed", "ratio",
           "azure", "ratio", "gateway", "hops", "estimate", "source");
    for (int i = 0; i < N_ROWS; i++) {
        const check_row *r = &rows[i];
        double ratio = r->sim / r->published;
        char live[16] = "-";
        if (r->live > 0) snprintf(live, sizeof live, "%.1f", r->live);
        within += fabs(ratio - 1) <= 0.15;
        printf("%-28s %9.1f %9.1f %9.1f %6.2f %9.1f %6.2f %8s %5.1f %9.1f  %s%s\n", r->label, r->max_flow,
               r->published, r->fixed, r->fixed / r->published, r->sim, ratio, live, r->hops, r->estimate,
               r->published_note, fabs(ratio - 1) <= 0.15 ? "" : "  (outside 15%)");
    }
    printf("azure lengths within 15%%: %d of %d\n", within, N_ROWS);
    printf("(fixed, azure: IWRR counting every token routed, as Helix's scheduler; gateway: azure with the gateway's\n"
           " IWRR, counting the work in flight; Swarm's rows use Swarm's routing)\n\npairs (published order), Azure "
           "lengths:\n");
    int same = pairs_in_order(BY_AZURE);
    printf("pairs in the published order: %d of %d\n\npairs (published order), fixed lengths:\n", same, N_PAIRS);
    same = pairs_in_order(BY_FIXED);
    printf("pairs in the published order, fixed lengths: %d of %d\n\npairs (published order), the placement's quick "
           "estimate:\n", same, N_PAIRS);
    same = pairs_in_order(BY_ESTIMATE);
    printf("pairs in the published order, quick estimate: %d of %d\n", same, N_PAIRS);
}

int main(int argc, char **argv) {
    int status = fu_opt_main(&spec, argc, argv, NULL);
    if (status >= 0) return status;
    rt_helix_files f = {args.hdir, "llama2_70b", NULL, NULL, NULL};
    rt_sim_profiles prof = {0};
    int rc = rt_sim_requests_load(args.lengths_file, 0, &args.lengths, &args.n_lengths);
    if (!rc) rc = rt_helix_load_step_profiles(&prof, &f);
    for (int i = 0; i < N_ROWS && !rc; i++) rc = run_row(&rows[i], &prof);
    for (int i = 0; i < N_ONLINE && !rc; i++) rc = run_online(&online[i], &prof);
    rt_sim_profiles_free(&prof);
    free(args.lengths);
    if (!rc) print_table(), print_online();
    else fprintf(stderr, "fusion-bench-sim: %s\n", fu_last_error());
    fu_opt_free(opts);
    return rc ? 1 : 0;
}
