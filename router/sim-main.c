/* sim-main.c -- fusion-sim: loads a cluster and a placement, prints the max flow and the
 * simulated throughput of IWRR routing over it. */
#include <limits.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "options.h"
#include "router.h"
#include "status.h"

enum { PLACE_NONE, PLACE_PETALS, PLACE_SWARM, PLACE_SEARCH, PLACE_THROUGHPUT };

/* What the command line gives. */
typedef struct sim_args {
    char *json, *cluster, *hdir, *model_name, *profiles, *capacity, *constants;
    char *placement, *trace, *save, *lengths_file;
    rt_sim_request *lengths; /* --lengths, loaded */
    int n_lengths;
    int place;           /* PLACE_* */
    uint64_t seed;
    bool no_sim, quiet, no_profiles;
    rt_sim_opts so;
    rt_search_opts se;
    double max_tpot, max_hops;
    int evals;
} sim_args;

static sim_args args;

static const fu_opt_choice place_choices[] = {
    {"petals", PLACE_PETALS}, {"swarm", PLACE_SWARM}, {"search", PLACE_SEARCH}, {"throughput", PLACE_THROUGHPUT},
    {NULL, 0}};
static const fu_opt_choice routing_choices[] = {{"iwrr", RT_SIM_ROUTE_IWRR}, {"swarm", RT_SIM_ROUTE_SWARM}, {NULL, 0}};
static const fu_opt_choice load_choices[] = {{"live", RT_IWRR_LIVE}, {"cumulative", RT_IWRR_CUMULATIVE}, {NULL, 0}};
static const fu_opt_choice conv_choices[] = {{"runtime", RT_CONV_RUNTIME}, {"ilp", RT_CONV_ILP}, {NULL, 0}};

static const fu_opt sim_options[] = {
    {"json", 0, FU_OPT_STRING, FU_OPT_TO(args.json), "CLUSTER.json", "a cluster (and placement) saved as JSON"},
    {"helix-cluster", 0, FU_OPT_STRING, FU_OPT_TO(args.cluster), "CLUSTER.ini", "a Helix cluster"},
    {"helix-dir", 0, FU_OPT_STRING, FU_OPT_TO(args.hdir), "DIR", "the Helix data", .def = FUSION_HELIX_DIR},
    {"model", 0, FU_OPT_STRING, FU_OPT_TO(args.model_name), "NAME", "the model's constants", .def = "llama2_70b"},
    {"profiles", 0, FU_OPT_STRING, FU_OPT_TO(args.profiles), "INI", "machine profiles"},
    {"capacity", 0, FU_OPT_STRING, FU_OPT_TO(args.capacity), "CSV", "node capacity by layers"},
    {"constants", 0, FU_OPT_STRING, FU_OPT_TO(args.constants), "JSON", "model constants"},
    {"placement", 0, FU_OPT_STRING, FU_OPT_TO(args.placement), "SOL.ini", "a Helix placement"},
    {"place", 0, FU_OPT_CHOICE, FU_OPT_TO(args.place), .help = "place the servers", .choices = place_choices},
    {"time", 0, FU_OPT_FLOAT, FU_OPT_TO(args.se.time_limit_s), "S", "search budget (default 5)"},
    {"search-evals", 0, FU_OPT_INT, FU_OPT_TO(args.se.max_evals),
     .help = "the max-flow search runs this many evaluations and no clock (the same placement every run)", .lo = 0,
     .hi = 100000000},
    {"max-tpot", 0, FU_OPT_FLOAT, FU_OPT_TO(args.max_tpot), "S",
     "--place throughput: bound on the median time per output token"},
    {"max-hops", 0, FU_OPT_FLOAT, FU_OPT_TO(args.max_hops), "H", "--place throughput: bound on the mean servers per chain"},
    {"evals", 0, FU_OPT_INT, FU_OPT_TO(args.evals), .help = "--place throughput: simulations of its final local search (default 60)",
     .lo = 0, .hi = 1000000},
    {"seed", 0, FU_OPT_INT, FU_OPT_TO(args.seed), .help = "search and simulation seed", .lo = 0, .hi = LONG_MAX},
    {"conv", 0, FU_OPT_CHOICE, FU_OPT_TO(args.se.flow.conv), .help = "the flow convention of the search",
     .def = "runtime", .choices = conv_choices},
    {"partial", 0, FU_OPT_FLAG, FU_OPT_TO(args.se.flow.allow_partial), .help = "allow partial execution"},
    {"rate", 0, FU_OPT_FLOAT, FU_OPT_TO(args.so.arrival_rate), "R", "Poisson arrivals, requests/s"},
    {"concurrency", 0, FU_OPT_INT, FU_OPT_TO(args.so.concurrency), .help = "closed loop with N requests in flight",
     .lo = 0, .hi = INT32_MAX},
    {"trace", 0, FU_OPT_STRING, FU_OPT_TO(args.trace), "FILE", "requests to replay"},
    {"routing", 0, FU_OPT_CHOICE, FU_OPT_TO(args.so.routing),
     .help = "iwrr: the gateway's, over the max flow; swarm: Swarm's adaptive next hops (with --concurrency, --rate or --trace)",
     .def = "iwrr", .choices = routing_choices},
    {"iwrr-load", 0, FU_OPT_CHOICE, FU_OPT_TO(args.so.route.load),
     .help = "what a hop's IWRR load counts: live, the work routed over it now (the gateway's); cumulative, every "
             "token routed over it so far (Helix's scheduler)",
     .def = "live", .choices = load_choices},
    {"lengths", 0, FU_OPT_STRING, FU_OPT_TO(args.lengths_file), "FILE",
     "draw synthetic requests' lengths from this set of \"prompt_len output_len\" lines"},
    {"feed-hwm", 0, FU_OPT_FLOAT, FU_OPT_TO(args.so.feed_hwm), "F",
     "without --rate/--concurrency/--trace: add requests while the busiest block's KV use is <= F (default 0.8)"},
    {"kv-hwm", 0, FU_OPT_FLOAT, FU_OPT_TO(args.so.kv_hwm), "F", "servers admit while KV use stays <= F (default 0.85)"},
    {"no-step-profiles", 0, FU_OPT_FLAG, FU_OPT_TO(args.no_profiles),
     .help = "ignore step-time profiles (fluid servers from the throughput tables)"},
    {"duration", 0, FU_OPT_FLOAT, FU_OPT_TO(args.so.duration_s), "S", "simulated seconds", .def = "660"},
    {"warmup", 0, FU_OPT_FLOAT, FU_OPT_TO(args.so.warmup_s), "S", "left out of the figures", .def = "60"},
    {"prompt-len", 0, FU_OPT_INT, FU_OPT_TO(args.so.prompt_len), .help = "synthetic requests' prompt tokens",
     .lo = 0, .hi = INT32_MAX},
    {"prompt-sigma", 0, FU_OPT_FLOAT, FU_OPT_TO(args.so.prompt_sigma), "S",
     "draw prompt lengths lognormal around --prompt-len with this spread, at most --max-prompt-len"},
    {"output-sigma", 0, FU_OPT_FLOAT, FU_OPT_TO(args.so.output_sigma), "S", "the same for output lengths"},
    {"max-prompt-len", 0, FU_OPT_INT, FU_OPT_TO(args.so.max_prompt_len), .help = "longest drawn prompt (default 2047)",
     .lo = 0, .hi = INT32_MAX},
    {"max-output-len", 0, FU_OPT_INT, FU_OPT_TO(args.so.max_output_len), .help = "longest drawn output (default 1000)",
     .lo = 0, .hi = INT32_MAX},
    {"kv-output-tokens", 0, FU_OPT_INT, FU_OPT_TO(args.so.kv_output_tokens),
     .help = "reserve KV for the prompt and this many outputs (as Helix expects), not the request's own", .lo = 0,
     .hi = INT32_MAX},
    {"output-len", 0, FU_OPT_INT, FU_OPT_TO(args.so.output_len), .help = "synthetic requests' output tokens",
     .lo = 0, .hi = INT32_MAX},
    {"no-sim", 0, FU_OPT_FLAG, FU_OPT_TO(args.no_sim), .help = "the max flow only"},
    {"save-json", 0, FU_OPT_STRING, FU_OPT_TO(args.save), "OUT.json", "save the cluster, placement and step profiles (--json reads them back)"},
    {"quiet", 0, FU_OPT_FLAG, FU_OPT_TO(args.quiet), .help = "no line per server"},
    FU_OPT_END,
};

static const fu_opt_spec sim_spec = {
    "fusion-sim",
    "usage: fusion-sim (--json CLUSTER.json | --helix-cluster CLUSTER.ini [--helix-dir DIR]\n"
    "                   [--model llama2_70b] [--profiles INI] [--capacity CSV] [--constants JSON])\n"
    "                  [--placement SOL.ini | --place petals|swarm|search|throughput] [--time S] [--seed N]\n"
    "                  [--search-evals N] [--max-tpot S] [--max-hops H] [--evals N]\n"
    "                  [--prompt-sigma S] [--output-sigma S] [--max-prompt-len N] [--max-output-len N]\n"
    "                  [--kv-output-tokens N] [--lengths FILE]\n"
    "                  [--conv runtime|ilp] [--partial] [--rate R | --concurrency N | --trace FILE]\n"
    "                  [--routing iwrr|swarm] [--iwrr-load live|cumulative]\n"
    "                  [--feed-hwm F] [--kv-hwm F] [--no-step-profiles]\n"
    "                  [--duration S] [--warmup S] [--prompt-len N] [--output-len N] [--no-sim]\n"
    "                  [--save-json OUT.json] [--quiet]",
    sim_options,
    "Helix files default to DIR/simulator/model_manager/google_machine_profiles.ini,\n"
    "DIR/derived/node_capacity_by_layers.csv and DIR/derived/model_constants.json.\n"
    "A trace has one request per line: arrival_seconds prompt_len output_len.\n"
    "A lengths file has one pair per line: prompt_len output_len; synthetic requests\n"
    "draw from it uniformly (config/traces/azure-conv-lengths.txt is Helix's set).\n"
    "Without --rate, --concurrency or --trace, requests are fed as Helix's offline runs do.\n"
    "Step times come from Helix's per-GPU tables (--helix-cluster) or the file's\n"
    "\"step_profiles\" (--json); servers without one run at their throughput table.\n"
    "Prints key = value lines: servers, max_flow_tokens_per_s (runtime and ilp\n"
    "conventions), placement, the quick estimate of decode tokens/s (the surrogate\n"
    "--place throughput searches on), and simulated decode/prompt throughput.\n"};

/* Helix's files as the command line names them (its own, else the --helix-dir's). */
static rt_helix_files helix_files(const sim_args *a) {
    return (rt_helix_files){a->hdir, a->model_name, a->constants, a->profiles, a->capacity};
}

/* The cluster from Helix's files: the cluster, machine profiles, capacities and constants. */
static int sim_load_helix(const sim_args *a, rt_swarm *sw) {
    rt_helix_files f = helix_files(a);
    return rt_helix_load_swarm(sw, &f, a->cluster);
}

/* The simulation options of the command line: feed, seed, routing, step profiles. */
static rt_sim_opts sim_options_of(const sim_args *a, const rt_sim_profiles *prof) {
    rt_sim_opts so = a->so;
    so.seed = a->seed;
    so.route.flow.allow_partial = a->se.flow.allow_partial;
    so.feed = a->trace ? RT_FEED_TRACE : so.arrival_rate > 0 ? RT_FEED_POISSON : so.concurrency > 0 ? RT_FEED_CLOSED : RT_FEED_KV;
    so.profiles = prof;
    if (a->lengths) rt_sim_opts_draw_lengths(&so, a->lengths, a->n_lengths);
    return so;
}

/* --place throughput: the simulator scores the placements (with the command line's feed,
 * except a trace, which the caller loads later). */
static int sim_place_throughput(const sim_args *a, const rt_sim_profiles *prof, rt_swarm *sw) {
    rt_tplace_opts to = {a->se, sim_options_of(a, prof), a->max_tpot, a->max_hops, a->evals, 0, (uint64_t)a->seed};
    to.search.seed = a->seed;
    if (to.sim.feed == RT_FEED_TRACE) to.sim.feed = RT_FEED_KV;
    to.sim.duration_s = to.sim.warmup_s = 0; /* candidates are scored over the default 660 s */
    rt_tplace_stats st;
    int rc = rt_place_throughput(sw, &to, &st);
    if (!rc)
        printf("placement_seed = %s\nplacement_seed_decode_tokens_per_s = %.1f\nplacement_decode_tokens_per_s = %.1f\n"
               "placement_evaluations = %d\n", st.start, st.start_decode_tps, st.decode_tps, st.evals);
    return rc;
}

/* --place: Petals', Swarm's, fusion's max-flow search or the throughput placement. */
static int sim_place(const sim_args *a, const rt_sim_profiles *prof, rt_swarm *sw) {
    if (a->place == PLACE_PETALS) return rt_place_petals(sw);
    if (a->place == PLACE_SWARM) return rt_place_swarm(sw);
    if (a->place == PLACE_THROUGHPUT) return sim_place_throughput(a, prof, sw);
    rt_search_stats st = {0};
    rt_search_opts se = a->se;
    se.seed = a->seed;
    int rc = rt_place_search(sw, &se, &st);
    if (!rc) printf("search_seconds = %.2f\nsearch_evaluations = %ld\n", st.seconds, st.evaluations);
    return rc;
}

/* The cluster (--json, or Helix's files), its placement (--placement), then --place. */
static int sim_load(const sim_args *a, const rt_sim_profiles *prof, rt_swarm *sw) {
    int rc = a->json ? rt_swarm_load_json(sw, a->json) : sim_load_helix(a, sw);
    if (!rc && a->placement) rc = rt_helix_load_placement(sw, a->placement);
    if (!rc && a->place != PLACE_NONE) rc = sim_place(a, prof, sw);
    return rc;
}

/* Prints the cluster, the max flow in both conventions and, unless --quiet, each server's
 * span, capacity and flow. */
static void sim_print_flow(const sim_args *a, const rt_swarm *sw, const rt_flow_opts *fr) {
    int gap;
    int unc = rt_swarm_uncovered(sw, &gap);
    rt_flow_opts fi = {RT_CONV_ILP, fr->allow_partial};
    printf("model = %s\nlayers = %d\nservers = %d\nuncovered_blocks = %d\n", sw->model.name,
           sw->model.n_layers, rt_swarm_live(sw), unc);
    printf("max_flow_tokens_per_s = %.1f\nmax_flow_ilp_convention = %.1f\n", rt_max_flow(sw, fr),
           rt_max_flow(sw, &fi));
    if (a->quiet) return;
    rt_flow fl = {0};
    if (!rt_flow_compute(sw, fr, &fl, NULL)) {
        for (int i = 0; i < sw->n_servers; i++) {
            const rt_server *s = &sw->servers[i];
            if (s->state == RT_SERVER_GONE) continue;
            printf("server %-16s %-6s span [%2d, %2d) capacity %9.1f flow %8.1f\n", s->name,
                   s->kind, s->first, s->last, rt_swarm_tput(sw, i, s->last - s->first),
                   fl.server_flow[i]);
        }
    }
    rt_flow_free(&fl);
}

/* The step-time profiles: Helix's tables for a Helix cluster, the file's own for --json. */
static int sim_profiles(const sim_args *a, rt_sim_profiles *p) {
    if (a->no_profiles) return FU_OK;
    if (a->json) return rt_sim_profiles_load_json(p, a->json);
    rt_helix_files f = helix_files(a);
    return rt_helix_load_step_profiles(p, &f);
}

static void sim_print(const rt_sim_result *r) {
    printf("sim_decode_tokens_per_s = %.1f\nsim_prompt_tokens_per_s = %.1f\n", r->decode_tps, r->prompt_tps);
    printf("sim_ttft_s = p50 %.3f p95 %.3f p99 %.3f\n", r->ttft_p50, r->ttft_p95, r->ttft_p99);
    printf("sim_tpot_s = p50 %.4f p95 %.4f p99 %.4f\n", r->tpot_p50, r->tpot_p95, r->tpot_p99);
    printf("sim_mean_prompt_latency_s = %.3f\nsim_mean_decode_step_s = %.4f\n", r->mean_prompt_latency_s,
           r->mean_decode_latency_s);
    printf("sim_mean_hops = %.2f\nsim_mean_in_flight = %.1f\n", r->mean_hops, r->mean_in_flight);
    printf("sim_completed = %ld\nsim_rejected = %ld\nsim_events = %ld\n", r->completed, r->rejected, r->events);
}

/* Simulates IWRR routing over the placement (a --trace or synthetic requests) and prints
 * the throughput and latencies. */
static int sim_run(const sim_args *a, const rt_sim_profiles *prof, const rt_swarm *sw) {
    rt_sim_opts so = sim_options_of(a, prof);
    rt_sim_request *tr = NULL;
    int rc = a->trace ? rt_sim_requests_load(a->trace, 1, &tr, &so.n_trace) : FU_OK;
    so.trace = tr;
    rt_sim_result res;
    double est = 0;
    if (!rc) rc = rt_estimate_decode_tps(sw, &so, &est);
    if (!rc) printf("estimate_decode_tokens_per_s = %.1f\n", est);
    if (!rc) rc = rt_sim_run(sw, &so, &res);
    free(tr);
    if (!rc) sim_print(&res);
    return rc;
}

/* Does what `a` asks; the exit status. */
static int simulate(sim_args *a) {
    rt_swarm sw = {0};
    rt_sim_profiles prof = {0};
    rt_flow_opts fr = {RT_CONV_RUNTIME, a->se.flow.allow_partial};
    int rc = a->lengths_file ? rt_sim_requests_load(a->lengths_file, 0, &a->lengths, &a->n_lengths) : FU_OK;
    if (!rc) rc = sim_profiles(a, &prof);
    if (!rc) rc = sim_load(a, &prof, &sw);
    if (!rc) sim_print_flow(a, &sw, &fr);
    if (!rc && a->save) rc = rt_swarm_save_json_with(&sw, &prof, a->save);
    if (!rc && !a->no_sim) rc = sim_run(a, &prof, &sw);
    if (rc) fprintf(stderr, "fusion-sim: %s: %s\n", fu_status_str(rc), fu_last_error());
    rt_swarm_free(&sw);
    rt_sim_profiles_free(&prof);
    free(a->lengths);
    return rc ? 1 : 0;
}

int main(int argc, char **argv) {
    int status = fu_opt_main(&sim_spec, argc, argv, NULL);
    if (status < 0 && !args.json == !args.cluster)
        status = fu_opt_fail(&sim_spec, "give --json or --helix-cluster");
    if (status < 0) status = simulate(&args);
    fu_opt_free(sim_options);
    return status;
}
