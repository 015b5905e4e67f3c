/* bench-main.c -- fusion-bench-router: fusion's placements (max-flow search, for throughput)
 * vs Petals' rule, Swarm's stages and Helix's published placements on Helix's 24-node clusters,
 * by max flow and by simulated decode throughput. */
#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "clock.h"
#include "options.h"
#include "router.h"
#include "status.h"

/*
 * Usage: fusion-bench-router [--helix-dir DIR] [--evals N] [--seed N] [--sim-duration S]
 *                            [--prompt-sigma S] [--output-sigma S]
 *
 * For the single-region cluster24 and the 3-region 3cluster24 with LLaMA-2 70B, prints one row
 * per placement: max flow (tokens/s, fusion's runtime convention and Helix's MILP convention),
 * its ratio to Helix's MILP placement, the simulated decode throughput (fusion-sim: Helix's
 * per-GPU step tables, Helix's offline feeder, IWRR routing), its ratio to the MILP
 * placement's, the mean hops and the time the placement took. Placements: Helix's MILP, Petals
 * and Swarm files, fusion's Petals and Swarm rules, fusion's max-flow search, and fusion's
 * placement for throughput, unbounded and with mean hops at most the MILP placement's. Petals'
 * placements need partial execution (a hop may enter a span in its middle), as in Helix's own
 * evaluation; the others use exact boundaries. The searches run by evaluation count, with no
 * clock, so a run repeats exactly.
 */

/* What the command line gives. */
typedef struct bench_args {
    char *hdir;      /* the Helix data */
    int evals;       /* max-flow evaluations of the search */
    double sim_dur;  /* simulated seconds */
    uint64_t seed;
    double prompt_sigma, output_sigma; /* spread of the drawn lengths (0: Helix's fixed averages) */
    rt_sim_profiles prof;
} bench_args;

typedef struct row {
    const char *name;
    double flow, flow_ilp, decode, hops, seconds;
} row;

enum { V_MILP, V_SEARCH, V_PETALS, V_PETALS_FILE, V_SWARM, V_SWARM_FILE, V_TPUT, V_TPUT_HOPS, V_COUNT };
static const char *const v_names[V_COUNT] = {
    "Helix MILP (ilp_sol.ini)",   "fusion max-flow search", "Petals rule (fusion impl.)",
    "Petals (Helix petals_sol)",  "Swarm stages (fusion impl.)", "Swarm (Helix swarm_sol)",
    "fusion for throughput",      "fusion for throughput, hops<=MILP"};

typedef struct cluster_files {
    const char *title, *cluster, *ilp, *petals, *swarm;
} cluster_files;

static rt_sim_opts sim_opts(const bench_args *a, const rt_flow_opts *fo) {
    rt_sim_opts sim;
    memset(&sim, 0, sizeof sim);
    sim.duration_s = a->sim_dur;
    sim.feed = RT_FEED_KV;
    sim.profiles = &a->prof;
    sim.seed = a->seed;
    sim.route.flow = *fo;
    if (a->prompt_sigma > 0 || a->output_sigma > 0) { /* like Helix's Azure Conversation set */
        sim.prompt_len = 763, sim.output_len = 232, sim.kv_output_tokens = 240;
        sim.prompt_sigma = a->prompt_sigma, sim.output_sigma = a->output_sigma;
    }
    return sim;
}

/* Places `sw` as variant v; milp_hops bounds V_TPUT_HOPS. */
static int place(rt_swarm *sw, int v, const cluster_files *c, const bench_args *a, rt_flow_opts *fo,
                 double milp_hops) {
    rt_search_opts so = {0, a->seed, *fo, 0, a->evals};
    rt_tplace_opts to = {so, sim_opts(a, fo), 0, v == V_TPUT_HOPS ? milp_hops : 0, 60, 4, a->seed};
    fo->allow_partial = v == V_PETALS || v == V_PETALS_FILE;
    switch (v) {
    case V_MILP: return rt_helix_load_placement(sw, c->ilp);
    case V_SEARCH: return rt_place_search(sw, &so, NULL);
    case V_PETALS: return rt_place_petals(sw);
    case V_PETALS_FILE: return rt_helix_load_placement(sw, c->petals);
    case V_SWARM: return rt_place_swarm(sw);
    case V_SWARM_FILE: return rt_helix_load_placement(sw, c->swarm);
    default: return rt_place_throughput(sw, &to, NULL);
    }
}

/* Places a copy of `base` as variant v and measures it into *r. */
static int measure(const rt_swarm *base, int v, const cluster_files *c, const bench_args *a, double milp_hops,
                   row *r) {
    rt_swarm sw;
    rt_flow_opts fo = {RT_CONV_RUNTIME, 0};
    int rc = rt_swarm_clone(&sw, base);
    double t0 = fu_now_s();
    if (!rc) rc = place(&sw, v, c, a, &fo, milp_hops);
    *r = (row){v_names[v], 0, 0, 0, 0, fu_now_s() - t0};
    rt_flow_opts fi = {RT_CONV_ILP, fo.allow_partial};
    rt_sim_opts sim = sim_opts(a, &fo);
    rt_sim_result res;
    if (!rc) rc = rt_sim_run(&sw, &sim, &res);
    if (!rc) r->flow = rt_max_flow(&sw, &fo), r->flow_ilp = rt_max_flow(&sw, &fi), r->decode = res.decode_tps,
             r->hops = res.mean_hops;
    rt_swarm_free(&sw);
    return rc;
}

static void print_rows(const char *title, const row *rows, int n) {
    printf("\n%s (LLaMA-2 70B, 24 nodes: 4 A100 + 8 L4 + 12 T4)\n", title);
    printf("%-34s %11s %11s %8s %11s %8s %6s %8s\n", "placement", "flow tok/s", "flow (MILP", "vs MILP", "sim decode",
           "vs MILP", "hops", "time s");
    printf("%-34s %11s %11s %8s %11s %8s %6s %8s\n", "", "(runtime)", "convention)", "", "tok/s", "", "", "");
    for (int i = 0; i < n; i++)
        printf("%-34s %11.1f %11.1f %7.3fx %11.1f %7.2fx %6.2f %8.2f\n", rows[i].name, rows[i].flow, rows[i].flow_ilp,
               rows[0].flow_ilp > 0 ? rows[i].flow_ilp / rows[0].flow_ilp : 0, rows[i].decode,
               rows[0].decode > 0 ? rows[i].decode / rows[0].decode : 0, rows[i].hops, rows[i].seconds);
}

static int run_cluster(const cluster_files *c, const bench_args *a) {
    rt_helix_files f = {a->hdir, "llama2_70b", NULL, NULL, NULL};
    rt_swarm base;
    int rc = rt_helix_load_swarm(&base, &f, c->cluster);
    row rows[V_COUNT];
    for (int v = 0; v < V_COUNT && !rc; v++) rc = measure(&base, v, c, a, rows[V_MILP].hops, &rows[v]);
    rt_swarm_free(&base);
    if (!rc) print_rows(c->title, rows, V_COUNT);
    return rc;
}

static bench_args args;

static const fu_opt bench_options[] = {
    {"helix-dir", 0, FU_OPT_STRING, FU_OPT_TO(args.hdir), "DIR", "the Helix data", .def = FUSION_HELIX_DIR},
    {"evals", 0, FU_OPT_INT, FU_OPT_TO(args.evals), .help = "max-flow evaluations of the search",
     .def = "3000", .lo = 1, .hi = 100000000},
    {"seed", 0, FU_OPT_INT, FU_OPT_TO(args.seed), .help = "search and simulation seed", .def = "1", .lo = 0,
     .hi = LONG_MAX},
    {"sim-duration", 0, FU_OPT_FLOAT, FU_OPT_TO(args.sim_dur), "S", "simulated seconds", .def = "660"},
    {"prompt-sigma", 0, FU_OPT_FLOAT, FU_OPT_TO(args.prompt_sigma), "S",
     "lognormal spread of prompt lengths around 763 (0 with --output-sigma 0: fixed 750 / 240)", .def = "0.5"},
    {"output-sigma", 0, FU_OPT_FLOAT, FU_OPT_TO(args.output_sigma), "S", "the same for outputs around 232",
     .def = "0.5"},
    FU_OPT_END,
};

static const fu_opt_spec bench_spec = {"fusion-bench-router", "usage: fusion-bench-router [options]",
                                       bench_options, NULL};

/* Compares the placements on both clusters; the exit status. */
static int bench(bench_args *args) {
    char a[4][4096], b[4][4096];
    const char *ae = "artifact_evaluation";
    snprintf(a[0], 4096, "%s/%s/single_cluster/config/cluster24.ini", args->hdir, ae);
    snprintf(a[1], 4096, "%s/%s/single_cluster/layout_llama70b/ilp/ilp_sol.ini", args->hdir, ae);
    snprintf(a[2], 4096, "%s/%s/single_cluster/layout_llama70b/petals/petals_sol.ini", args->hdir, ae);
    snprintf(a[3], 4096, "%s/%s/single_cluster/layout_llama70b/swarm/swarm_sol.ini", args->hdir, ae);
    snprintf(b[0], 4096, "%s/%s/distributed_clusters/config/3cluster24.ini", args->hdir, ae);
    snprintf(b[1], 4096, "%s/%s/distributed_clusters/layout_llama70b/ilp/ilp_sol.ini", args->hdir, ae);
    snprintf(b[2], 4096, "%s/%s/distributed_clusters/layout_llama70b/petals/petals_sol.ini", args->hdir, ae);
    snprintf(b[3], 4096, "%s/%s/distributed_clusters/layout_llama70b/swarm/swarm_sol.ini", args->hdir, ae);
    printf("fusion-bench-router: max-flow search of %d evaluations, seed %llu, simulated %g s (Helix's "
           "offline feeder, Helix's per-GPU step tables, requests ", args->evals, (unsigned long long)args->seed,
           args->sim_dur);
    if (args->prompt_sigma > 0 || args->output_sigma > 0)
        printf("drawn like Helix's Azure Conversation set: means 763 + 232 tokens, lognormal spreads %g / %g)\n",
               args->prompt_sigma, args->output_sigma);
    else
        printf("of 750 + 240 tokens)\n");
    cluster_files c1 = {"single region: cluster24", a[0], a[1], a[2], a[3]};
    cluster_files c2 = {"3 regions: 3cluster24", b[0], b[1], b[2], b[3]};
    rt_helix_files f = {args->hdir, "llama2_70b", NULL, NULL, NULL};
    int rc = rt_helix_load_step_profiles(&args->prof, &f);
    if (!rc) rc = run_cluster(&c1, args);
    if (!rc) rc = run_cluster(&c2, args);
    rt_sim_profiles_free(&args->prof);
    if (rc) fprintf(stderr, "fusion-bench-router: %s: %s\n", fu_status_str(rc), fu_last_error());
    return rc ? 1 : 0;
}

int main(int argc, char **argv) {
    int status = fu_opt_main(&bench_spec, argc, argv, NULL);
    if (status < 0 && !(args.sim_dur > 0)) status = fu_opt_fail(&bench_spec, "--sim-duration must be positive");
    if (status < 0) status = bench(&args);
    fu_opt_free(bench_options);
    return status;
}
