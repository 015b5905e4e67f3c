/* bench-main.c -- fusion-bench-router: fusion's placement search + IWRR routing vs Petals'
 * rule, Swarm's stages and Helix's published MILP placement on Helix's 24-node clusters. */
#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "options.h"
#include "router.h"
#include "status.h"

/*
 * Usage: fusion-bench-router [--helix-dir DIR] [--time S] [--seed N] [--sim-duration S]
 *
 * For the single-region cluster24 and the 3-region 3cluster24 with LLaMA-2 70B, prints one row
 * per placement: max flow (tokens/s, fusion's runtime convention and Helix's MILP convention),
 * its ratio to Helix's MILP placement, the simulated decode throughput with IWRR routing, and
 * the time the placement took. Petals' placements need partial execution (a hop may enter a
 * span in its middle), as in Helix's own evaluation; the others use exact boundaries.
 */

typedef struct row {
    const char *name;
    double flow, flow_ilp, decode, seconds;
} row;

static int run_cluster(const char *hdir, const char *title, const char *cluster, const char *ilp,
                       const char *petals_sol, const char *swarm_sol, double tlimit, uint64_t seed,
                       double sim_dur) {
    char prof[4096], cap[4096], cons[4096];
    snprintf(prof, sizeof prof, "%s/simulator/model_manager/google_machine_profiles.ini", hdir);
    snprintf(cap, sizeof cap, "%s/derived/node_capacity_by_layers.csv", hdir);
    snprintf(cons, sizeof cons, "%s/derived/model_constants.json", hdir);
    rt_model m;
    rt_swarm base;
    int rc = rt_helix_load_model(&m, cons, "llama2_70b");
    if (rc || (rc = rt_swarm_init(&base, &m))) return rc;
    if ((rc = rt_helix_load_cluster(&base, cluster, prof, cap))) {
        rt_swarm_free(&base);
        return rc;
    }
    row rows[8];
    int nr = 0;
    double milp = 0;
    for (int variant = 0; variant < 6; variant++) {
        rt_swarm sw;
        if ((rc = rt_swarm_clone(&sw, &base))) break;
        rt_flow_opts fo = {RT_CONV_RUNTIME, 0};
        row r = {0};
        double t0 = 0;
        rt_search_stats st = {0};
        switch (variant) {
        case 0: r.name = "Helix MILP (ilp_sol.ini)"; rc = rt_helix_load_placement(&sw, ilp); break;
        case 1:
            r.name = "fusion search";
            rt_search_opts so = {tlimit, seed, fo, 0, 0};
            rc = rt_place_search(&sw, &so, &st);
            t0 = st.seconds;
            break;
        case 2: r.name = "Petals rule (fusion impl.)"; fo.allow_partial = 1; rc = rt_place_petals(&sw); break;
        case 3: r.name = "Petals (Helix petals_sol)"; fo.allow_partial = 1; rc = rt_helix_load_placement(&sw, petals_sol); break;
        case 4: r.name = "Swarm stages (fusion impl.)"; rc = rt_place_swarm(&sw); break;
        default: r.name = "Swarm (Helix swarm_sol)"; rc = rt_helix_load_placement(&sw, swarm_sol); break;
        }
        if (rc) {
            rt_swarm_free(&sw);
            break;
        }
        rt_flow_opts fi = fo;
        fi.conv = RT_CONV_ILP;
        r.flow = rt_max_flow(&sw, &fo);
        r.flow_ilp = rt_max_flow(&sw, &fi);
        r.seconds = t0;
        if (variant == 0) milp = r.flow_ilp;
        rt_sim_opts sim = {0};
        sim.duration_s = sim_dur;
        sim.warmup_s = sim_dur / 10;
        sim.seed = seed;
        sim.route.flow = fo;
        rt_sim_result res;
        if ((rc = rt_sim_run(&sw, &sim, &res))) {
            rt_swarm_free(&sw);
            break;
        }
        r.decode = res.decode_tps;
        rows[nr++] = r;
        rt_swarm_free(&sw);
    }
    rt_swarm_free(&base);
    if (rc) return rc;
    printf("\n%s (LLaMA-2 70B, 24 nodes: 4 A100 + 8 L4 + 12 T4)\n", title);
    printf("%-30s %12s %12s %9s %14s %9s\n", "placement", "flow tok/s", "flow (MILP", "vs MILP",
           "sim decode", "time s");
    printf("%-30s %12s %12s %9s %14s %9s\n", "", "(runtime)", "convention)", "", "tok/s (IWRR)", "");
    for (int i = 0; i < nr; i++)
        printf("%-30s %12.1f %12.1f %8.3fx %14.1f %9.2f\n", rows[i].name, rows[i].flow,
               rows[i].flow_ilp, milp > 0 ? rows[i].flow_ilp / milp : 0, rows[i].decode,
               rows[i].seconds);
    return FU_OK;
}

/* What the command line gives. */
typedef struct bench_args {
    char *hdir;      /* the Helix data */
    double tlimit;   /* search budget per cluster, seconds */
    double sim_dur;  /* simulated seconds */
    uint64_t seed;
} bench_args;

static bench_args args;

static const fu_opt bench_options[] = {
    {"helix-dir", 0, FU_OPT_STRING, FU_OPT_TO(args.hdir), "DIR", "the Helix data", .def = FUSION_HELIX_DIR},
    {"time", 0, FU_OPT_FLOAT, FU_OPT_TO(args.tlimit), "S", "search budget per cluster", .def = "5"},
    {"seed", 0, FU_OPT_INT, FU_OPT_TO(args.seed), .help = "search and simulation seed", .def = "1", .lo = 0,
     .hi = LONG_MAX},
    {"sim-duration", 0, FU_OPT_FLOAT, FU_OPT_TO(args.sim_dur), "S", "simulated seconds", .def = "300"},
    FU_OPT_END,
};

static const fu_opt_spec bench_spec = {"fusion-bench-router", "usage: fusion-bench-router [options]",
                                       bench_options, NULL};

/* Compares the placements on both clusters; the exit status. */
static int bench(const bench_args *args) {
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
    printf("fusion-bench-router: search budget %.1f s per cluster, seed %llu, simulated %g s "
           "(closed loop, 256 requests of 750 + 240 tokens)\n", args->tlimit, (unsigned long long)args->seed,
           args->sim_dur);
    int rc = run_cluster(args->hdir, "single region: cluster24", a[0], a[1], a[2], a[3], args->tlimit, args->seed,
                         args->sim_dur);
    if (!rc)
        rc = run_cluster(args->hdir, "3 regions: 3cluster24", b[0], b[1], b[2], b[3], args->tlimit, args->seed,
                         args->sim_dur);
    if (rc) fprintf(stderr, "fusion-bench-router: %s: %s\n", fu_status_str(rc), fu_last_error());
    return rc ? 1 : 0;
}

int main(int argc, char **argv) {
    int status = fu_opt_main(&bench_spec, argc, argv, NULL);
    if (status < 0 && (!(args.tlimit > 0) || !(args.sim_dur > 0)))
        status = fu_opt_fail(&bench_spec, "--time and --sim-duration must be positive");
    if (status < 0) status = bench(&args);
    fu_opt_free(bench_options);
    return status;
}
