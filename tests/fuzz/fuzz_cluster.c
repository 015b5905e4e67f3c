/* fuzz_cluster.c -- libFuzzer target: arbitrary bytes as a cluster file (router/rt-json.c: fusion's
 * JSON cluster, compact or object links, kinds, default link), its step profiles
 * (router/rt-profile.c), as Helix's INI files and value expressions (router/rt-load.c) and as
 * the simulator's traces and length sets (router/rt-requests.c). A
 * cluster that parses is simulated briefly, saved and read back, which must give the same servers
 * and max flow. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "log.h"
#include "router-impl.h"
#include "router.h"

static char path[64];

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    (void)argc;
    (void)argv;
    fu_log_set_level(FU_LOG_LEVEL_OFF);
    snprintf(path, sizeof path, "/tmp/fuzz-cluster-%ld.json", (long)getpid());
    return 0;
}

/* Short simulations of a parsed cluster with its profiles, routed by IWRR (live or cumulative
 * load, as `cumulative` says) and by Swarm's rule, when every block is covered. */
static void simulate(const rt_swarm *sw, const rt_sim_profiles *prof, int cumulative) {
    if (sw->n_servers > 64 || sw->model.n_layers > 256 || rt_swarm_uncovered(sw, NULL) > 0) return;
    rt_sim_opts so;
    memset(&so, 0, sizeof so);
    so.duration_s = 5, so.warmup_s = 1, so.concurrency = 4, so.prompt_len = 16, so.output_len = 4;
    so.profiles = prof;
    rt_sim_result r;
    so.route.load = cumulative ? RT_IWRR_CUMULATIVE : RT_IWRR_LIVE;
    rt_sim_run(sw, &so, &r);
    so.routing = RT_SIM_ROUTE_SWARM;
    rt_sim_run(sw, &so, &r);
}

/* Saves and reloads with the profiles: the same server count, max flow and profiles. */
static void round_trip(const rt_swarm *sw, const rt_sim_profiles *prof) {
    if (rt_swarm_save_json_with(sw, prof, path)) return;
    rt_swarm back;
    rt_sim_profiles pb = {0};
    if (rt_swarm_load_json(&back, path) || rt_sim_profiles_load_json(&pb, path)) abort();
    double a = rt_max_flow(sw, NULL), b = rt_max_flow(&back, NULL);
    if (back.n_servers != sw->n_servers || fabs(a - b) > 1e-6 * (1 + fabs(a))) abort();
    if (pb.n != prof->n) abort();
    for (int i = 0; i < pb.n; i++)
        if (pb.items[i].n_limits != prof->items[i].n_limits || pb.items[i].n_prompt != prof->items[i].n_prompt) abort();
    rt_sim_profiles_free(&pb);
    rt_swarm_free(&back);
}

static void ini(const char *text, size_t len) {
    rt_ini in;
    if (!rt__ini_parse(&in, text, len)) {
        for (int i = 0; i < in.n; i++) {
            double v;
            int *list = NULL, n = 0;
            rt__eval_expr(in.items[i].value, &v);
            if (!rt__parse_int_list(in.items[i].value, &list, &n)) free(list);
        }
        rt__ini_free(&in);
    }
}

/* Both request-file forms; what parses is sorted (traces) and in range. */
static void requests(const char *text, size_t len) {
    for (int with_arrival = 0; with_arrival < 2; with_arrival++) {
        rt_sim_request *v;
        int n;
        if (rt_sim_requests_parse(text, len, with_arrival, &v, &n)) continue;
        for (int i = 0; i < n; i++)
            if (n < 1 || v[i].prompt_len < 1 || v[i].output_len < 0 || !(v[i].arrival_s >= 0) ||
                (i > 0 && v[i].arrival_s < v[i - 1].arrival_s))
                abort();
        free(v);
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    const char *text = (const char *)data;
    rt_swarm sw;
    rt_sim_profiles prof = {0};
    if (!rt_swarm_parse_json(&sw, text, size)) {
        if (!rt_sim_profiles_parse_json(&prof, text, size)) simulate(&sw, &prof, size & 1);
        round_trip(&sw, &prof);
        rt_sim_profiles_free(&prof);
        rt_swarm_free(&sw);
    }
    char *z = malloc(size + 1);
    if (!z) return 0;
    memcpy(z, data, size);
    z[size] = '\0';
    ini(z, size);
    requests(text, size);
    free(z);
    unlink(path);
    return 0;
}
