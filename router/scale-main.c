/* scale-main.c -- fusion-bench-scale: how the router's costs grow with the swarm, on synthetic
 * swarms of 100, 1000 and 10,000 servers (or the sizes given). Single-threaded; each size runs
 * in a child process so that its peak memory is its own. */
#define _POSIX_C_SOURCE 200809L
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "clock.h"
#include "options.h"
#include "router.h"
#include "status.h"

/*
 * Usage: fusion-bench-scale [--sizes 100,1000,10000] [--evals N] [--keep K] [--requests N]
 *                           [--seed N] [--dir DIR]
 *
 * The generator: LLaMA-2 70B (80 blocks); servers of three kinds (A100 40 GB, L4 24 GB, T4
 * 16 GB; tokens/s with k blocks = base / (k + 0.3)) spread over regions of about 250 servers.
 * Each server links to 24 random servers of its region (1.25 GB/s, 1 ms) and 8 of other
 * regions (12.5-125 MB/s, 40 ms), both ways; the coordinator reaches every server. Then each
 * server's K best links are kept (rt_swarm_prune_links). Per size it prints the build + prune
 * time, one max flow, the placement (rt_place_search with a fixed number of evaluations and no
 * clock), the router's flow (rt_router_init: the max flow with its least-busy refinement), the
 * mean hops of routed requests, routing N requests, peak RSS, the JSON file's size and its
 * save and load times; then each figure's growth exponent between sizes.
 */

typedef struct figures {
    int n;
    double build_s, flow_s, place_s, router_s, hops, route_s, save_s, load_s;
    double rss_mb, file_mb, flow, links;
    long evals;
} figures;

typedef struct scale_args {
    char *sizes;
    long evals, keep, requests;
    uint64_t seed;
    char *dir;
} scale_args;

static scale_args args;

static uint64_t rng_next(uint64_t *s) {
    uint64_t z = (*s += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}

static double rng_unit(uint64_t *s) { return (double)(rng_next(s) >> 11) * 0x1.0p-53; }

static const struct {
    const char *kind;
    double vram, base;
} kinds[] = {{"A100", 40e9, 24000}, {"L4", 24e9, 8000}, {"T4", 16e9, 4000}};

/* Adds server i of kind `kd`; returns its id or a status. */
static int add_server(rt_swarm *sw, int i, int kd) {
    double tput[16];
    rt_server d;
    memset(&d, 0, sizeof d);
    snprintf(d.name, sizeof d.name, "s%d", i);
    snprintf(d.address, sizeof d.address, "10.%d.%d.%d:7070", i >> 16 & 255, i >> 8 & 255, i & 255);
    snprintf(d.kind, sizeof d.kind, "%s", kinds[kd].kind);
    d.state = RT_SERVER_ACTIVE;
    d.nic_in = d.nic_out = 1.25e9;
    d.vram_bytes = kinds[kd].vram;
    d.n_tput = 16;
    d.tput = tput;
    for (int k = 1; k <= 16; k++) tput[k - 1] = kinds[kd].base / (k + 0.3);
    return rt_swarm_add_server(sw, &d);
}

/* Links of server i: 24 in its region, 8 elsewhere, both ways. */
static int link_server(rt_swarm *sw, int i, int n, int per_region, uint64_t *rng) {
    int region = i / per_region, lo = region * per_region, hi = lo + per_region < n ? lo + per_region : n, rc = 0;
    for (int t = 0; t < 32 && !rc; t++) {
        int in = t < 24 && hi - lo > 1, j;
        double bw, lat;
        if (in) {
            j = lo + (int)(rng_next(rng) % (uint64_t)(hi - lo));
            bw = 1.25e9 * (0.8 + 0.2 * rng_unit(rng)), lat = 0.001;
        } else {
            j = (int)(rng_next(rng) % (uint64_t)n);
            bw = 1.25e7 * (1 + 9 * rng_unit(rng)), lat = 0.04;
        }
        if (j == i) continue;
        rc = rt_swarm_set_link(sw, i, j, bw, lat);
        if (!rc) rc = rt_swarm_set_link(sw, j, i, bw, lat);
    }
    if (!rc) rc = rt_swarm_set_link(sw, RT_SOURCE, i, region ? 1.25e8 : 1.25e9, region ? 0.04 : 0.001);
    if (!rc) rc = rt_swarm_set_link(sw, i, RT_SINK, region ? 1.25e8 : 1.25e9, region ? 0.04 : 0.001);
    return rc;
}

/* The synthetic swarm of n servers, pruned to `keep` links per server. */
static int build(rt_swarm *sw, int n, int keep, uint64_t seed) {
    rt_model m = {.n_layers = 80, .token_bytes = 2, .act_bytes = 16384, .layer_bytes = 1.53e9,
                  .kv_bytes_per_token_layer = 4096, .weight_vram_fraction = 0.5};
    snprintf(m.name, sizeof m.name, "llama2_70b");
    int rc = rt_swarm_init(sw, &m);
    uint64_t rng = seed;
    for (int i = 0; i < n && !rc; i++) {
        double u = rng_unit(&rng);
        int id = add_server(sw, i, u < 0.2 ? 0 : u < 0.55 ? 1 : 2);
        if (id < 0) rc = id;
    }
    int per_region = n < 250 ? (n + 3) / 4 : 250;
    for (int i = 0; i < n && !rc; i++) rc = link_server(sw, i, n, per_region, &rng);
    if (!rc) rc = rt_swarm_prune_links(sw, keep);
    return rc;
}

/* Routes `count` requests (held, then released): seconds, and the mean hops into *hops; the
 * router's set-up into *init_s. */
static int route_many(const rt_swarm *sw, long count, double *init_s, double *secs, double *hops) {
    rt_router *r;
    double t_init = fu_now_s();
    int rc = rt_router_init(&r, sw, NULL);
    *init_s = fu_now_s() - t_init;
    if (rc) return rc;
    rt_path **p = calloc((size_t)count, sizeof *p);
    if (!p) {
        rt_router_free(r);
        return FU_ERR_NOMEM;
    }
    long got = 0, total = 0;
    double t0 = fu_now_s();
    for (long i = 0; i < count; i++)
        if (!rt_route(r, 990, &p[i])) total += p[i]->n_hops, got++;
    *secs = fu_now_s() - t0;
    *hops = got ? (double)total / (double)got : 0;
    for (long i = 0; i < count; i++) rt_release(p[i]);
    free(p);
    rt_router_free(r);
    return got ? FU_OK : fu_errorf(FU_ERR_NOT_FOUND, "no request could be routed");
}

/* Saves and reloads the swarm; sizes and times into f. */
static int file_round_trip(const rt_swarm *sw, figures *f) {
    char path[4096];
    snprintf(path, sizeof path, "%s/fusion-bench-scale-%d.json", args.dir, f->n);
    double t0 = fu_now_s();
    int rc = rt_swarm_save_json(sw, path);
    f->save_s = fu_now_s() - t0;
    struct stat st;
    if (!rc && !stat(path, &st)) f->file_mb = (double)st.st_size / 1e6;
    rt_swarm back;
    t0 = fu_now_s();
    if (!rc && !(rc = rt_swarm_load_json(&back, path))) {
        f->load_s = fu_now_s() - t0;
        if (fabs(rt_max_flow(&back, NULL) - f->flow) > 1e-6 * (f->flow + 1))
            rc = fu_errorf(FU_ERR_INTERNAL, "the reloaded swarm's flow differs");
        rt_swarm_free(&back);
    }
    unlink(path);
    return rc;
}

/* All figures of one size (run in a child process). */
static int measure(int n, figures *f) {
    rt_swarm sw;
    memset(f, 0, sizeof *f);
    f->n = n;
    double t0 = fu_now_s();
    int rc = build(&sw, n, (int)args.keep, args.seed);
    f->build_s = fu_now_s() - t0;
    if (rc) return rc;
    for (int i = 0; i < n; i++) f->links += rt_swarm_out_degree(&sw, i);
    rt_search_opts so = {0, args.seed, {RT_CONV_RUNTIME, 0}, 0, args.evals};
    rt_search_stats st;
    t0 = fu_now_s();
    rc = rt_place_search(&sw, &so, &st);
    f->place_s = fu_now_s() - t0;
    f->evals = st.evaluations;
    if (!rc) {
        t0 = fu_now_s();
        f->flow = rt_max_flow(&sw, NULL);
        f->flow_s = fu_now_s() - t0;
        rc = route_many(&sw, args.requests, &f->router_s, &f->route_s, &f->hops);
    }
    if (!rc) rc = file_round_trip(&sw, f);
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    f->rss_mb = (double)ru.ru_maxrss / 1024.0;
    rt_swarm_free(&sw);
    return rc;
}

/* Runs measure(n) in a child; its figures come back through a pipe. */
static int measure_apart(int n, figures *f) {
    int fd[2];
    if (pipe(fd)) return fu_errorf(FU_ERR_IO, "pipe failed");
    fflush(stdout);
    pid_t pid = fork();
    if (pid == 0) {
        close(fd[0]);
        int rc = measure(n, f);
        if (rc) fprintf(stderr, "fusion-bench-scale: %d servers: %s\n", n, fu_last_error());
        ssize_t w = rc ? 0 : write(fd[1], f, sizeof *f);
        _exit(w == (ssize_t)sizeof *f ? 0 : 1);
    }
    close(fd[1]);
    ssize_t r = pid > 0 ? read(fd[0], f, sizeof *f) : -1;
    close(fd[0]);
    int status = 0;
    if (pid > 0) waitpid(pid, &status, 0);
    return r == (ssize_t)sizeof *f && WIFEXITED(status) && !WEXITSTATUS(status) ? FU_OK
                                                                                 : fu_errorf(FU_ERR_INTERNAL, "size %d failed", n);
}

static void print_cpu(void) {
    FILE *f = fopen("/proc/cpuinfo", "r");
    char line[512], model[256] = "unknown";
    int cpus = 0;
    while (f && fgets(line, sizeof line, f)) {
        if (!strncmp(line, "model name", 10) && strchr(line, ':')) {
            snprintf(model, sizeof model, "%s", strchr(line, ':') + 2);
            model[strcspn(model, "\n")] = '\0';
        }
        if (!strncmp(line, "processor", 9)) cpus++;
    }
    if (f) fclose(f);
    printf("CPU: %s (%d logical CPUs; the benchmark uses one)\n", model, cpus);
}

static void print_row(const figures *f) {
    printf("%7d %8.0f %9.3f %9.4f %9.3f %5ld %9.4f %6.2f %9.4f %10.1f %8.2f %8.3f %8.3f %10.1f\n", f->n, f->links,
           f->build_s, f->flow_s, f->place_s, f->evals, f->router_s, f->hops, f->route_s, f->rss_mb, f->file_mb,
           f->save_s, f->load_s, f->flow);
}

static double expo(double a, double b, int n1, int n2) {
    return a > 0 && b > 0 ? log(b / a) / log((double)n2 / n1) : NAN;
}

static void print_growth(const figures *a, const figures *b) {
    printf("%7d->%-7d %9.2f %9.2f %9.2f %9.2f %9.2f %9.2f %8.2f %8.2f %8.2f\n", a->n, b->n,
           expo(a->build_s, b->build_s, a->n, b->n), expo(a->flow_s, b->flow_s, a->n, b->n),
           expo(a->place_s, b->place_s, a->n, b->n), expo(a->router_s, b->router_s, a->n, b->n),
           expo(a->route_s, b->route_s, a->n, b->n),
           expo(a->rss_mb, b->rss_mb, a->n, b->n), expo(a->file_mb, b->file_mb, a->n, b->n),
           expo(a->save_s, b->save_s, a->n, b->n), expo(a->load_s, b->load_s, a->n, b->n));
}

static const fu_opt scale_options[] = {
    {"sizes", 0, FU_OPT_STRING, FU_OPT_TO(args.sizes), "N,N,...", "swarm sizes", .def = "100,1000,10000"},
    {"evals", 0, FU_OPT_INT, FU_OPT_TO(args.evals), .help = "max-flow evaluations of the placement search",
     .def = "100", .lo = 1, .hi = 1000000},
    {"keep", 0, FU_OPT_INT, FU_OPT_TO(args.keep), .help = "links kept per server", .def = "16", .lo = 1, .hi = 4096},
    {"requests", 0, FU_OPT_INT, FU_OPT_TO(args.requests), .help = "requests routed", .def = "10000", .lo = 1,
     .hi = 10000000},
    {"seed", 0, FU_OPT_INT, FU_OPT_TO(args.seed), .help = "generator and search seed", .def = "1", .lo = 0,
     .hi = LONG_MAX},
    {"dir", 0, FU_OPT_PATH, FU_OPT_TO(args.dir), "DIR", "where the JSON files go (removed after)", .def = "/tmp"},
    FU_OPT_END,
};

static const fu_opt_spec scale_spec = {"fusion-bench-scale", "usage: fusion-bench-scale [options]", scale_options,
                                       NULL};

/* Runs every size, then prints the growth exponents; the exit status. */
static int bench(void) {
    figures f[16];
    int nf = 0, rc = FU_OK;
    print_cpu();
    printf("search: %ld evaluations, no clock; %ld links kept per server; %ld requests of 990 tokens\n",
           args.evals, args.keep, args.requests);
    printf("%7s %8s %9s %9s %9s %5s %9s %6s %9s %10s %8s %8s %8s %10s\n", "servers", "links", "build s", "flow s",
           "place s", "evals", "router s", "hops", "route s", "peakRSS MB", "file MB", "save s", "load s",
           "flow tok/s");
    for (char *p = args.sizes; p && *p && nf < 16 && !rc; p += strspn(p, ",")) {
        char *e;
        long n = strtol(p, &e, 10);
        if (e == p || n < 4 || n > 1000000) return fu_opt_fail(&scale_spec, "--sizes: a list of sizes >= 4");
        p = e;
        if (!(rc = measure_apart((int)n, &f[nf]))) print_row(&f[nf++]);
    }
    if (nf > 1) {
        printf("\ngrowth exponents log(x2/x1)/log(n2/n1):\n%15s %9s %9s %9s %9s %9s %9s %8s %8s %8s\n", "sizes",
               "build", "flow", "place", "router", "route", "peakRSS", "file", "save", "load");
        for (int i = 1; i < nf; i++) print_growth(&f[i - 1], &f[i]);
    }
    if (rc) fprintf(stderr, "fusion-bench-scale: %s\n", fu_last_error());
    return rc ? 1 : 0;
}

int main(int argc, char **argv) {
    int status = fu_opt_main(&scale_spec, argc, argv, NULL);
    if (status < 0) status = bench();
    fu_opt_free(scale_options);
    return status;
}
