/* sim-main.c -- fusion-sim: loads a cluster and a placement, prints the max flow and the
 * simulated throughput of IWRR routing over it. */
#include <errno.h>
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "router.h"
#include "status.h"

static void usage(FILE *f) {
    fprintf(f,
        "usage: fusion-sim (--json CLUSTER.json | --helix-cluster CLUSTER.ini [--helix-dir DIR]\n"
        "                   [--model llama2_70b] [--profiles INI] [--capacity CSV] [--constants JSON])\n"
        "                  [--placement SOL.ini | --place petals|swarm|search] [--time S] [--seed N]\n"
        "                  [--conv runtime|ilp] [--partial] [--rate R | --concurrency N | --trace FILE]\n"
        "                  [--duration S] [--warmup S] [--prompt-len N] [--output-len N] [--no-sim]\n"
        "                  [--save-json OUT.json] [--quiet]\n"
        "  Helix files default to DIR/simulator/model_manager/google_machine_profiles.ini,\n"
        "  DIR/derived/node_capacity_by_layers.csv and DIR/derived/model_constants.json.\n"
        "  A trace has one request per line: arrival_seconds prompt_len output_len.\n"
        "  Prints key = value lines: servers, max_flow_tokens_per_s (runtime and ilp\n"
        "  conventions), placement, and simulated decode/prompt throughput.\n");
}

static int load_trace(const char *path, rt_sim_request **out, int *n) {
    FILE *f = fopen(path, "r");
    if (!f) return fu_errorf(FU_ERR_IO, "%s: %s", path, strerror(errno));
    int cap = 1024, cnt = 0;
    rt_sim_request *v = malloc((size_t)cap * sizeof *v);
    char line[256];
    while (v && fgets(line, sizeof line, f)) {
        if (line[0] == '#' || line[0] == '\n') continue;
        rt_sim_request q;
        if (sscanf(line, "%lf %d %d", &q.arrival_s, &q.prompt_len, &q.output_len) != 3 ||
            q.arrival_s < 0 || q.prompt_len <= 0 || q.output_len < 0) {
            free(v);
            fclose(f);
            return fu_errorf(FU_ERR_FORMAT, "%s: bad line \"%.40s\"", path, line);
        }
        if (cnt == cap) {
            cap *= 2;
            rt_sim_request *nv = realloc(v, (size_t)cap * sizeof *v);
            if (!nv) break;
            v = nv;
        }
        v[cnt++] = q;
    }
    fclose(f);
    if (!v) return fu_errorf(FU_ERR_NOMEM, "out of memory");
    *out = v;
    *n = cnt;
    return FU_OK;
}

static double num_arg(const char *s, const char *name) {
    char *e;
    errno = 0;
    double v = strtod(s, &e);
    if (e == s || *e || errno) {
        fprintf(stderr, "fusion-sim: bad number for %s: %s\n", name, s);
        exit(2);
    }
    return v;
}

int main(int argc, char **argv) {
    const char *json = NULL, *cluster = NULL, *hdir = FUSION_HELIX_DIR;
    const char *model_name = "llama2_70b", *profiles = NULL, *capacity = NULL, *constants = NULL;
    const char *placement = NULL, *place = NULL, *trace = NULL, *save = NULL;
    rt_sim_opts so = {0};
    rt_search_opts se = {0};
    int no_sim = 0, quiet = 0;
    so.duration_s = 300;
    so.warmup_s = 30;
    static struct option lo[] = {
        {"json", 1, 0, 'j'},        {"helix-cluster", 1, 0, 'c'}, {"helix-dir", 1, 0, 'H'},
        {"model", 1, 0, 'm'},       {"profiles", 1, 0, 'P'},      {"capacity", 1, 0, 'C'},
        {"constants", 1, 0, 'K'},   {"placement", 1, 0, 'p'},     {"place", 1, 0, 'a'},
        {"time", 1, 0, 't'},        {"seed", 1, 0, 's'},          {"conv", 1, 0, 'v'},
        {"partial", 0, 0, 'x'},     {"rate", 1, 0, 'r'},          {"concurrency", 1, 0, 'n'},
        {"trace", 1, 0, 'T'},       {"duration", 1, 0, 'd'},      {"warmup", 1, 0, 'w'},
        {"prompt-len", 1, 0, 'i'},  {"output-len", 1, 0, 'o'},    {"no-sim", 0, 0, 'N'},
        {"save-json", 1, 0, 'S'},   {"quiet", 0, 0, 'q'},         {"help", 0, 0, 'h'},
        {0, 0, 0, 0}};
    int ch;
    while ((ch = getopt_long(argc, argv, "h", lo, NULL)) != -1) {
        switch (ch) {
        case 'j': json = optarg; break;
        case 'c': cluster = optarg; break;
        case 'H': hdir = optarg; break;
        case 'm': model_name = optarg; break;
        case 'P': profiles = optarg; break;
        case 'C': capacity = optarg; break;
        case 'K': constants = optarg; break;
        case 'p': placement = optarg; break;
        case 'a': place = optarg; break;
        case 't': se.time_limit_s = num_arg(optarg, "--time"); break;
        case 's': se.seed = so.seed = (uint64_t)num_arg(optarg, "--seed"); break;
        case 'v':
            if (!strcmp(optarg, "ilp")) se.flow.conv = RT_CONV_ILP;
            else if (strcmp(optarg, "runtime")) {
                fprintf(stderr, "fusion-sim: --conv runtime|ilp\n");
                return 2;
            }
            break;
        case 'x': se.flow.allow_partial = 1; break;
        case 'r': so.arrival_rate = num_arg(optarg, "--rate"); break;
        case 'n': so.concurrency = (int)num_arg(optarg, "--concurrency"); break;
        case 'T': trace = optarg; break;
        case 'd': so.duration_s = num_arg(optarg, "--duration"); break;
        case 'w': so.warmup_s = num_arg(optarg, "--warmup"); break;
        case 'i': so.prompt_len = (int)num_arg(optarg, "--prompt-len"); break;
        case 'o': so.output_len = (int)num_arg(optarg, "--output-len"); break;
        case 'N': no_sim = 1; break;
        case 'S': save = optarg; break;
        case 'q': quiet = 1; break;
        case 'h': usage(stdout); return 0;
        default: usage(stderr); return 2;
        }
    }
    if (!json == !cluster || optind != argc) {
        usage(stderr);
        return 2;
    }
    char pb[4096], cb[4096], kb[4096];
    rt_swarm sw;
    int rc;
    if (json) {
        rc = rt_swarm_load_json(&sw, json);
        if (rc) {
            fprintf(stderr, "fusion-sim: %s\n", fu_last_error());
            return 1;
        }
    } else {
        if (!profiles) snprintf(pb, sizeof pb, "%s/simulator/model_manager/google_machine_profiles.ini", hdir), profiles = pb;
        if (!capacity) snprintf(cb, sizeof cb, "%s/derived/node_capacity_by_layers.csv", hdir), capacity = cb;
        if (!constants) snprintf(kb, sizeof kb, "%s/derived/model_constants.json", hdir), constants = kb;
        rt_model m;
        if ((rc = rt_helix_load_model(&m, constants, model_name)) || (rc = rt_swarm_init(&sw, &m))) {
            fprintf(stderr, "fusion-sim: %s\n", fu_last_error());
            return 1;
        }
        if ((rc = rt_helix_load_cluster(&sw, cluster, profiles, capacity))) goto fail;
    }
    if (placement && (rc = rt_helix_load_placement(&sw, placement))) goto fail;
    if (place) {
        rt_search_stats st = {0};
        if (!strcmp(place, "petals")) rc = rt_place_petals(&sw);
        else if (!strcmp(place, "swarm")) rc = rt_place_swarm(&sw);
        else if (!strcmp(place, "search")) {
            rc = rt_place_search(&sw, &se, &st);
            if (!rc) printf("search_seconds = %.2f\nsearch_evaluations = %ld\n", st.seconds, st.evaluations);
        } else {
            fprintf(stderr, "fusion-sim: --place petals|swarm|search\n");
            rt_swarm_free(&sw);
            return 2;
        }
        if (rc) goto fail;
    }
    int gap;
    int unc = rt_swarm_uncovered(&sw, &gap);
    rt_flow_opts fr = {RT_CONV_RUNTIME, se.flow.allow_partial}, fi = {RT_CONV_ILP, se.flow.allow_partial};
    printf("model = %s\nlayers = %d\nservers = %d\nuncovered_blocks = %d\n", sw.model.name,
           sw.model.n_layers, rt_swarm_live(&sw), unc);
    printf("max_flow_tokens_per_s = %.1f\nmax_flow_ilp_convention = %.1f\n", rt_max_flow(&sw, &fr),
           rt_max_flow(&sw, &fi));
    if (!quiet) {
        rt_flow fl = {0};
        if (!rt_flow_compute(&sw, &fr, &fl, NULL)) {
            for (int i = 0; i < sw.n_servers; i++) {
                const rt_server *s = &sw.servers[i];
                if (s->state == RT_SERVER_GONE) continue;
                printf("server %-16s %-6s span [%2d, %2d) capacity %9.1f flow %8.1f\n", s->name,
                       s->kind, s->first, s->last, rt_swarm_tput(&sw, i, s->last - s->first),
                       fl.server_flow[i]);
            }
        }
        rt_flow_free(&fl);
    }
    if (save && (rc = rt_swarm_save_json(&sw, save))) goto fail;
    if (!no_sim) {
        rt_sim_request *tr = NULL;
        if (trace) {
            if ((rc = load_trace(trace, &tr, &so.n_trace))) goto fail;
            so.trace = tr;
        }
        so.route.flow = fr;
        rt_sim_result res;
        rc = rt_sim_run(&sw, &so, &res);
        free(tr);
        if (rc) goto fail;
        printf("sim_decode_tokens_per_s = %.1f\nsim_prompt_tokens_per_s = %.1f\n", res.decode_tps,
               res.prompt_tps);
        printf("sim_mean_prompt_latency_s = %.3f\nsim_mean_decode_step_s = %.4f\n",
               res.mean_prompt_latency_s, res.mean_decode_latency_s);
        printf("sim_completed = %ld\nsim_rejected = %ld\n", res.completed, res.rejected);
    }
    rt_swarm_free(&sw);
    return 0;
fail:
    fprintf(stderr, "fusion-sim: %s: %s\n", fu_status_str(rc), fu_last_error());
    rt_swarm_free(&sw);
    return 1;
}
