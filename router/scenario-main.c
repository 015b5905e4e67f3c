/* scenario-main.c -- fusion-bench-scenarios: the seeds' claims as runnable scenarios.
 *
 * Usage: fusion-bench-scenarios [--dir DIR] [--evals N] [--seed N] [--sim-duration S]
 *
 * For every JSON file of config/scenarios/ (written by scripts/gen-scenarios.py) prints the file's
 * assumptions (cards, memory bandwidth, FLOPs, efficiency, precision, links, placement rule)
 * and, per placement (fusion's max-flow search with a fixed seed and evaluation count, Petals'
 * rule, Swarm's stages, and placement for simulated throughput), the max flow, the simulated
 * decode tokens/s of IWRR routing (Helix's offline feeder, 750 + 240-token requests, the file's
 * step profiles) and the mean hops a token takes. Then FusionAI's verdict, by max flow and by
 * simulated decode: 50 x RTX 3080 at home against 4 x H100, and a sweep of the home link speed
 * (every rule placed again at each speed) and RTT.
 *
 * One thread; everything it loads is freed before it returns.
 */
#include <dirent.h>
#include <jansson.h>
#include <limits.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "options.h"
#include "router.h"
#include "status.h"

#define SC_3080 "fusionai-50x3080.json"
#define SC_H100 "fusionai-4xh100.json"

/* What the command line gives. */
typedef struct bench_args {
    char *dir;       /* the scenarios */
    int evals;       /* max-flow evaluations of the search per placement (no clock) */
    double sim_dur;  /* simulated seconds */
    uint64_t seed;
    const rt_sim_profiles *prof; /* the scenario's step profiles (set per scenario) */
} bench_args;

/* One placement's figures. */
typedef struct figures {
    double flow;     /* max flow, tokens/s */
    double decode;   /* simulated decode tokens/s */
    double hops;     /* mean servers a token passes */
} figures;

enum { PL_SEARCH, PL_PETALS, PL_SWARM, PL_THROUGHPUT, PL_COUNT };
static const char *const pl_names[PL_COUNT] = {"fusion search", "Petals rule", "Swarm stages", "for throughput"};

/* The CPU's model name from /proc/cpuinfo, or "unknown". */
static void cpu_model(char *out, size_t cap) {
    snprintf(out, cap, "unknown");
    FILE *f = fopen("/proc/cpuinfo", "r");
    if (!f) return;
    char line[512];
    while (fgets(line, sizeof line, f)) {
        char *colon = strchr(line, ':');
        if (strncmp(line, "model name", 10) || !colon) continue;
        colon += 1 + (colon[1] == ' ');
        colon[strcspn(colon, "\n")] = 0;
        snprintf(out, cap, "%s", colon);
        break;
    }
    fclose(f);
}

static int cmp_str(const void *a, const void *b) {
    return strcmp(*(char *const *)a, *(char *const *)b);
}

/* The names of DIR's *.json files, sorted; *names malloc'd (free each and the array). */
static int list_scenarios(const char *dir, char ***names, int *n) {
    *names = NULL;
    *n = 0;
    DIR *d = opendir(dir);
    if (!d) return fu_errorf(FU_ERR_NOT_FOUND, "cannot open the scenario folder %s", dir);
    struct dirent *e;
    int rc = FU_OK;
    while ((e = readdir(d))) {
        size_t len = strlen(e->d_name);
        if (len < 6 || strcmp(e->d_name + len - 5, ".json")) continue;
        char **grown = realloc(*names, (size_t)(*n + 1) * sizeof *grown);
        char *copy = malloc(len + 1);
        if (copy) memcpy(copy, e->d_name, len + 1);
        if (!grown || !copy) {
            free(grown ? (void *)copy : NULL);
            if (grown) *names = grown;
            rc = fu_errorf(FU_ERR_NOMEM, "out of memory");
            break;
        }
        *names = grown;
        (*names)[(*n)++] = copy;
    }
    closedir(d);
    if (*n) qsort(*names, (size_t)*n, sizeof **names, cmp_str);
    return rc;
}

static const char *jtext(json_t *o, const char *key) {
    const char *s = json_string_value(json_object_get(o, key));
    return s ? s : "(not given)";
}

/* The file's own account of itself: title, cards, efficiency, precision, links, placement. */
static void print_assumptions(json_t *root) {
    json_t *sc = json_object_get(root, "scenario"), *cards = json_object_get(root, "cards");
    json_t *eff = json_object_get(root, "efficiency");
    printf("\n== %s\n", jtext(sc, "title"));
    const char *kind;
    json_t *c;
    json_object_foreach(cards, kind, c) {
        printf("  card %-10s %5.1f GiB, %6.0f GB/s, %6.1f TFLOPS fp16 (%s)\n", kind,
               json_number_value(json_object_get(c, "vram_bytes")) / (1 << 30),
               json_number_value(json_object_get(c, "mem_bandwidth_bytes_per_s")) / 1e9,
               json_number_value(json_object_get(c, "fp16_flops")) / 1e12, jtext(c, "flops_note"));
    }
    printf("  efficiency: weights %.2f of bandwidth, matmuls %.2f of FLOPs, KV reads %.3f of bandwidth, prompt "
           "attention %.4f of fp32 FLOPs, %.2f ms a block step besides (%s)\n",
           json_number_value(json_object_get(eff, "bandwidth")), json_number_value(json_object_get(eff, "flops")),
           json_number_value(json_object_get(eff, "kv_bandwidth")),
           json_number_value(json_object_get(eff, "attention_flops")),
           json_number_value(json_object_get(eff, "step_overhead_ms")), jtext(eff, "basis"));
    printf("  precision: %s\n  links: %s\n  placement: %s\n", jtext(sc, "precision"), jtext(sc, "links"),
           jtext(sc, "placement_rule"));
    json_t *dt = json_object_get(root, "dtfm");
    if (dt)
        printf("  DT-FM matrices: %zu x %zu (one row per %s), %zu nodes\n",
               json_array_size(json_object_get(dt, "groups")), json_array_size(json_object_get(dt, "groups")),
               jtext(dt, "group_kind"), json_array_size(json_object_get(dt, "nodes")));
}

/* Mean servers a unit of flow passes: the flow through all servers over the max flow. */
static double mean_hops(const rt_swarm *sw, const rt_flow_opts *fo) {
    rt_flow f;
    memset(&f, 0, sizeof f);
    if (rt_flow_compute(sw, fo, &f, NULL)) return 0;
    double through = 0;
    for (int i = 0; i < f.n; i++) through += f.server_flow[i];
    double hops = f.value > 0 ? through / f.value : 0;
    rt_flow_free(&f);
    return hops;
}

/* The simulation of every row: Helix's offline feeder and request lengths, the scenario's step
 * profiles, a tenth of it warm-up. */
static rt_sim_opts sim_opts(const bench_args *a, const rt_flow_opts *fo) {
    rt_sim_opts sim;
    memset(&sim, 0, sizeof sim);
    sim.feed = RT_FEED_KV;
    sim.profiles = a->prof;
    sim.duration_s = a->sim_dur;
    sim.warmup_s = a->sim_dur / 10;
    sim.seed = a->seed;
    sim.route.flow = *fo;
    return sim;
}

/* Places `sw` by rule `pl`. */
static int place(rt_swarm *sw, int pl, const bench_args *a, const rt_flow_opts *fo) {
    rt_search_opts so = {0, a->seed, *fo, 0, a->evals};
    if (pl == PL_SEARCH) return rt_place_search(sw, &so, NULL);
    if (pl == PL_PETALS) return rt_place_petals(sw);
    if (pl == PL_SWARM) return rt_place_swarm(sw);
    rt_tplace_opts to = {so, sim_opts(a, fo), 0, 0, 20, 2, a->seed};
    return rt_place_throughput(sw, &to, NULL);
}

/* Places `sw` by rule `pl` and measures it: max flow, simulated decode, mean hops. */
static int place_and_measure(rt_swarm *sw, int pl, const bench_args *a, figures *out) {
    rt_flow_opts fo = {RT_CONV_RUNTIME, pl == PL_PETALS};
    int rc = place(sw, pl, a, &fo);
    if (rc) return rc;
    rt_sim_opts sim = sim_opts(a, &fo);
    rt_sim_result res;
    if ((rc = rt_sim_run(sw, &sim, &res))) return rc;
    out->flow = rt_max_flow(sw, &fo);
    out->decode = res.decode_tps;
    out->hops = mean_hops(sw, &fo);
    return FU_OK;
}

/* Re-simulates `sw`, placed by rule `pl` (links changed, placement kept): decode tokens/s. */
static double simulate(const rt_swarm *sw, int pl, const bench_args *a) {
    rt_flow_opts fo = {RT_CONV_RUNTIME, pl == PL_PETALS};
    rt_sim_opts sim = sim_opts(a, &fo);
    rt_sim_result res;
    return rt_sim_run(sw, &sim, &res) ? 0 : res.decode_tps;
}

/* The swarm and step profiles of scenario `path` (both to be freed only when FU_OK). */
static int load_scenario(const char *path, rt_swarm *base, rt_sim_profiles *prof) {
    int rc = rt_swarm_load_json(base, path);
    if (rc) return rc;
    if ((rc = rt_sim_profiles_load_json(prof, path))) rt_swarm_free(base);
    return rc;
}

/* Loads scenario `path`, prints its assumptions and one row per placement; *search gets the
 * figures of fusion's search. */
static int run_scenario(const char *path, const bench_args *args, figures *search) {
    rt_sim_profiles prof = {0};
    bench_args b = *args, *a = &b;
    b.prof = &prof;
    json_error_t jerr;
    json_t *root = json_load_file(path, 0, &jerr);
    if (!root) return fu_errorf(FU_ERR_FORMAT, "%s: %s (line %d)", path, jerr.text, jerr.line);
    print_assumptions(root);
    json_decref(root);
    rt_swarm base;
    int rc = load_scenario(path, &base, &prof);
    if (rc) return rc;
    printf("  %d servers, %d blocks, step profiles for %d kinds\n", base.n_servers, base.model.n_layers, prof.n);
    printf("  %-15s %12s %14s %10s\n", "placement", "flow tok/s", "sim decode/s", "mean hops");
    double best_decode = 0;
    for (int pl = 0; pl < PL_COUNT && !rc; pl++) {
        rt_swarm sw;
        figures f = {0};
        if ((rc = rt_swarm_clone(&sw, &base))) break;
        rc = place_and_measure(&sw, pl, a, &f);
        rt_swarm_free(&sw);
        if (rc) break;
        printf("  %-15s %12.1f %14.1f %10.2f\n", pl_names[pl], f.flow, f.decode, f.hops);
        if (pl == PL_SEARCH) *search = f;
        if (f.decode > best_decode) best_decode = f.decode;
    }
    search->decode = best_decode; /* the verdict compares the best simulated placement */
    rt_swarm_free(&base);
    rt_sim_profiles_free(&prof);
    return rc;
}

/* Every home link (between servers, to and from the coordinator) and every server's NIC at
 * `mbit` Mbit/s with `rtt_ms` round trips; mbit <= 0: unlimited. */
static int set_home_links(rt_swarm *sw, double mbit, double rtt_ms) {
    double bw = mbit > 0 ? mbit * 1e6 / 8 : 1e15, lat = rtt_ms / 2e3;
    int rc = FU_OK;
    for (int i = 0; i < sw->n_servers && !rc; i++) {
        sw->servers[i].nic_in = sw->servers[i].nic_out = mbit > 0 ? bw : 0;
        rc = rt_swarm_set_link(sw, RT_SOURCE, i, bw, lat);
        if (!rc) rc = rt_swarm_set_link(sw, i, RT_SINK, bw, lat);
        for (int j = 0; j < sw->n_servers && !rc; j++)
            if (j != i) rc = rt_swarm_set_link(sw, i, j, bw, lat);
    }
    return rc;
}

static const double sweep_mbit[] = {10, 25, 50, 100, 250, 500, 1000, 0};
static const double sweep_rtt[] = {10, 30, 50, 100, 200};
#define N_MBIT ((int)(sizeof sweep_mbit / sizeof sweep_mbit[0]))
#define N_RTT ((int)(sizeof sweep_rtt / sizeof sweep_rtt[0]))

/* At `mbit` Mbit/s and rtt_ms: every placement rule, placed again; out->flow is the search's max
 * flow, out->decode the best simulated decode of any rule, and *best (if not NULL) that rule. */
static int measure_at(const rt_swarm *base, double mbit, double rtt_ms, const bench_args *a, figures *out,
                      int *best) {
    *out = (figures){0};
    for (int pl = 0; pl < PL_COUNT; pl++) {
        rt_swarm sw;
        figures f = {0};
        int rc = rt_swarm_clone(&sw, base);
        if (!rc) rc = set_home_links(&sw, mbit, rtt_ms);
        if (!rc) rc = place_and_measure(&sw, pl, a, &f);
        rt_swarm_free(&sw);
        if (rc) return rc;
        if (pl == PL_SEARCH) out->flow = f.flow;
        if (f.decode > out->decode) {
            out->decode = f.decode;
            if (best) *best = pl;
        }
    }
    return FU_OK;
}

/* The link speed sweep: every rule placed again at each speed; at[i] per sweep_mbit[i]. */
static int sweep_speed(const rt_swarm *base, double rtt_ms, const bench_args *a, const figures *h100,
                       figures *at) {
    printf("\n  home link sweep (%g ms RTT; every placement rule again at each speed; flow of fusion's search, "
           "simulated decode of the best rule):\n", rtt_ms);
    printf("  %12s %12s %9s %14s %9s\n", "link Mbit/s", "flow tok/s", "vs H100", "sim decode/s", "vs H100");
    for (int i = 0; i < N_MBIT; i++) {
        int rc = measure_at(base, sweep_mbit[i], rtt_ms, a, &at[i], NULL);
        if (rc) return rc;
        char label[32];
        snprintf(label, sizeof label, sweep_mbit[i] > 0 ? "%g" : "unlimited", sweep_mbit[i]);
        printf("  %12s %12.1f %8.2fx %14.1f %8.2fx\n", label, at[i].flow,
               h100->flow > 0 ? at[i].flow / h100->flow : 0, at[i].decode,
               h100->decode > 0 ? at[i].decode / h100->decode : 0);
    }
    return FU_OK;
}

/* The RTT sweep at `mbit`: the placement of the rule that decodes fastest at the first RTT,
 * simulated at each RTT. */
static int sweep_rtt_at(const rt_swarm *base, double mbit, const bench_args *a) {
    rt_swarm sw;
    figures f = {0};
    int best = 0, rc = measure_at(base, mbit, sweep_rtt[0], a, &f, &best);
    if (rc || (rc = rt_swarm_clone(&sw, base))) return rc;
    if (!(rc = set_home_links(&sw, mbit, sweep_rtt[0]))) rc = place_and_measure(&sw, best, a, &f);
    printf("\n  RTT sweep at %g Mbit/s (%s, the fastest rule at %g ms; max flow %.1f tok/s whatever the RTT):\n",
           mbit, pl_names[best], sweep_rtt[0], f.flow);
    printf("  %12s %14s\n", "RTT ms", "sim decode/s");
    for (int i = 0; i < N_RTT && !rc; i++) {
        if ((rc = set_home_links(&sw, mbit, sweep_rtt[i]))) break;
        printf("  %12g %14.1f\n", sweep_rtt[i], simulate(&sw, best, a));
    }
    rt_swarm_free(&sw);
    return rc;
}

/* Helix's upper bound on any placement's flow: the sum over servers of max_k k * tput(k), over L. */
static double flow_bound(const rt_swarm *sw) {
    double sum = 0;
    for (int i = 0; i < sw->n_servers; i++) {
        double best = 0;
        for (int k = 1; k <= rt_swarm_max_layers(sw, i); k++)
            if (k * rt_swarm_tput(sw, i, k) > best) best = k * rt_swarm_tput(sw, i, k);
        sum += best;
    }
    return sw->model.n_layers > 0 ? sum / sw->model.n_layers : 0;
}

/* The first swept speed at which the 3080s' figure (max flow, or simulated decode) reaches the
 * H100s', or -1. */
static int first_holding(const figures *at, const figures *h, bool decode) {
    for (int i = 0; i < N_MBIT; i++)
        if (decode ? h->decode > 0 && at[i].decode >= h->decode : h->flow > 0 && at[i].flow >= h->flow) return i;
    return -1;
}

/* One measure's verdict line: from which home link speed the claim holds, or that it never does. */
static void print_holding(const char *measure, int i, double best_ratio) {
    if (i >= 0 && sweep_mbit[i] > 0)
        printf("  by %s: FusionAI's claim holds from %g Mbit/s home links on.\n", measure, sweep_mbit[i]);
    else if (i >= 0)
        printf("  by %s: FusionAI's claim holds only with unlimited home links.\n", measure);
    else
        printf("  by %s: FusionAI's claim is refuted: at no swept link speed, even unlimited (%.2fx), do "
               "50 x RTX 3080 reach 4 x H100.\n", measure, best_ratio);
}

/* FusionAI's claim in plain words from the two scenarios' figures and the speed sweep; `c3080`
 * (the 3080 swarm) says what binds its cards. */
static void print_verdict(const rt_swarm *c3080, const figures *c, const figures *h, const figures *at) {
    printf("\n  verdict: at the default home link, 50 x RTX 3080 serve %.1f tok/s (max flow; %.1f "
           "decode tok/s simulated, best placement), 4 x H100 %.1f (%.1f): ratio %.2f (%.2f simulated).\n",
           c->flow, c->decode, h->flow, h->decode, h->flow > 0 ? c->flow / h->flow : 0,
           h->decode > 0 ? c->decode / h->decode : 0);
    const figures *u = &at[N_MBIT - 1];
    print_holding("max flow", first_holding(at, h, false), h->flow > 0 ? u->flow / h->flow : 0);
    print_holding("simulated decode", first_holding(at, h, true), h->decode > 0 ? u->decode / h->decode : 0);
    int k = rt_swarm_max_layers(c3080, 0);
    printf("  Helix's bound on any placement's flow (sum of max_k k * tput(k) over L) is %.1f tok/s for the "
           "3080s. A 3080 holds at most %d blocks, with room for %.0f tokens of KV cache there, so its decode "
           "batches stay small and every step re-reads its weights.\n",
           flow_bound(c3080), k, rt_swarm_kv_tokens(c3080, 0, k));
}

/* FusionAI's comparison: the two scenarios' search figures, the sweeps and the verdict. */
static int fusionai(const bench_args *args, const figures *c, const figures *h) {
    rt_sim_profiles prof = {0};
    bench_args b = *args, *a = &b;
    b.prof = &prof;
    char path[4096];
    snprintf(path, sizeof path, "%s/%s", a->dir, SC_3080);
    rt_swarm base;
    int rc = load_scenario(path, &base, &prof);
    if (rc) return rc;
    json_t *root = json_load_file(path, 0, NULL);
    json_t *home = json_object_get(json_object_get(root, "scenario"), "home_link");
    double mbit = json_number_value(json_object_get(home, "mbit_s"));
    double rtt = json_number_value(json_object_get(home, "rtt_ms"));
    json_decref(root);
    printf("\n== FusionAI's claim: 50 x RTX 3080 reach the throughput of 4 x H100 (LLaMA-2 70B)\n");
    figures at[N_MBIT];
    if (!(mbit > 0) || !(rtt >= 0))
        rc = fu_errorf(FU_ERR_FORMAT, "%s: scenario.home_link needs mbit_s and rtt_ms", path);
    if (!rc) rc = sweep_speed(&base, rtt, a, h, at);
    if (!rc) rc = sweep_rtt_at(&base, mbit, a);
    if (!rc) print_verdict(&base, c, h, at);
    rt_swarm_free(&base);
    rt_sim_profiles_free(&prof);
    return rc;
}

/* Runs every scenario of the folder, then FusionAI's comparison if both of its files are there. */
static int bench(const bench_args *a) {
    char cpu[256], **names;
    int n, rc = list_scenarios(a->dir, &names, &n);
    cpu_model(cpu, sizeof cpu);
    printf("fusion-bench-scenarios: CPU %s; search of %d max-flow evaluations per placement, seed %llu, simulated "
           "%g s (requests of 750 + 240 tokens fed as in Helix's offline runs, step times from each file's "
           "step_profiles)\n", cpu, a->evals,
           (unsigned long long)a->seed, a->sim_dur);
    figures c = {0}, h = {0};
    int have = 0;
    for (int i = 0; i < n && !rc; i++) {
        char path[4096];
        figures f = {0};
        snprintf(path, sizeof path, "%s/%s", a->dir, names[i]);
        rc = run_scenario(path, a, &f);
        if (!strcmp(names[i], SC_3080)) c = f, have |= 1;
        if (!strcmp(names[i], SC_H100)) h = f, have |= 2;
    }
    for (int i = 0; i < n; i++) free(names[i]);
    free(names);
    if (!rc && !n) rc = fu_errorf(FU_ERR_NOT_FOUND, "no *.json scenarios in %s", a->dir);
    if (!rc && have == 3) rc = fusionai(a, &c, &h);
    return rc;
}

static bench_args args;

static const fu_opt bench_options[] = {
    {"dir", 0, FU_OPT_PATH, FU_OPT_TO(args.dir), "DIR", "the scenarios (*.json)", .def = FUSION_SCENARIO_DIR},
    {"evals", 0, FU_OPT_INT, FU_OPT_TO(args.evals), .help = "max-flow evaluations of the search per placement",
     .def = "300", .lo = 1, .hi = 1000000},
    {"seed", 0, FU_OPT_INT, FU_OPT_TO(args.seed), .help = "search and simulation seed", .def = "1", .lo = 0,
     .hi = LONG_MAX},
    {"sim-duration", 0, FU_OPT_FLOAT, FU_OPT_TO(args.sim_dur), "S", "simulated seconds", .def = "300"},
    FU_OPT_END,
};

static const fu_opt_spec bench_spec = {"fusion-bench-scenarios", "usage: fusion-bench-scenarios [options]",
                                       bench_options, NULL};

int main(int argc, char **argv) {
    int status = fu_opt_main(&bench_spec, argc, argv, NULL);
    if (status < 0 && !(args.sim_dur > 0)) status = fu_opt_fail(&bench_spec, "--sim-duration must be positive");
    if (status < 0) {
        int rc = bench(&args);
        if (rc) fprintf(stderr, "fusion-bench-scenarios: %s: %s\n", fu_status_str(rc), fu_last_error());
        status = rc ? 1 : 0;
    }
    fu_opt_free(bench_options);
    return status;
}
