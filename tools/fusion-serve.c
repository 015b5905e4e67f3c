/* fusion-serve.c -- `fusion serve` (a gateway plus local shards, until Ctrl-C) and `fusion join`.
 *
 * serve: resolves the model, splits its blocks over N local shards (N from the cores unless
 * --shards), starts fusion-gateway with a membership service (--swarm-listen) and the shards with
 * --join and their --blocks, waits until /health is 200, prints the URL, the API key and the swarm
 * page, then watches the children. SIGINT/SIGTERM stops the gateway, then the shards, and waits
 * for them. join: one fusion-shard --join GATEWAY in the foreground, stopped the same way.
 * Secrets reach the children in their environment (FUSION_SECRET, FUSION_API_KEY), not argv.
 * Threading: one thread; signals only set fz_interrupted. Ownership: the option tables own the
 * strings of the args structs (fu_opt_free()); a serve run owns its work directory.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "clock.h"
#include "fusion-cli.h"
#include "model.h"
#include "ops.h"
#include "options.h"
#include "status.h"

#define FZ_MAX_SHARDS 64
#define FZ_STOP_MS 20000

/* --device auto: "cuda" when a CUDA backend opens here, else "cpu". */
static const char *fz_device_pick(const char *device) {
    if (strcmp(device, "auto")) return device;
    op_backend *be = op_backend_cuda_new(0);
    op_backend_free(be);
    fu_error_clear();
    return be ? "cuda" : "cpu";
}

/* ---- fusion serve: options ---------------------------------------------------------------- */

typedef struct fz_serve_args {
    char *host, *api_key, *secret, *device, *swarm_listen, *swarm_cert, *swarm_key, *tls_ca, *log_dir;
    int port, shards, threads, ready_timeout_s;
} fz_serve_args;

static fz_serve_args sa;

static const fu_opt fz_serve_options[] = {
    {"shards", 'n', FU_OPT_INT, FU_OPT_TO(sa.shards),
     .help = "local shards (default: one per 8 cores, at most 4; never\nmore than the model's blocks)", .lo = 1,
     .hi = FZ_MAX_SHARDS},
    {"port", 'p', FU_OPT_INT, FU_OPT_TO(sa.port), .help = "the gateway's HTTP port", .def = "8080", .lo = 1, .hi = 65535},
    {"host", 0, FU_OPT_STRING, FU_OPT_TO(sa.host), "ADDR", "the gateway's HTTP address", .def = "127.0.0.1"},
    {"api-key", 0, FU_OPT_STRING, FU_OPT_TO(sa.api_key), "K", "the API key (default $FUSION_API_KEY, else generated)"},
    {"secret", 0, FU_OPT_STRING, FU_OPT_TO(sa.secret), "S",
     "the swarm secret, 16+ bytes (default $FUSION_SECRET, else\ngenerated)"},
    {"threads", 't', FU_OPT_INT, FU_OPT_TO(sa.threads), .help = "CPU threads per shard (default: cores / shards)",
     .lo = 1, .hi = 1024},
    {"device", 0, FU_OPT_STRING, FU_OPT_TO(sa.device), "cpu|cuda|cuda:N|auto", "where the shards run", .def = "cpu"},
    {"swarm-listen", 0, FU_OPT_STRING, FU_OPT_TO(sa.swarm_listen), "HOST:PORT",
     "where other machines join (`fusion join`); beyond loopback\nit needs --swarm-tls-cert/--swarm-tls-key",
     .def = "127.0.0.1:0"},
    {"swarm-tls-cert", 0, FU_OPT_PATH, FU_OPT_TO(sa.swarm_cert), "F", "TLS certificate of the membership service"},
    {"swarm-tls-key", 0, FU_OPT_PATH, FU_OPT_TO(sa.swarm_key), "F", "its key"},
    {"tls-ca", 0, FU_OPT_PATH, FU_OPT_TO(sa.tls_ca), "F", "the CA of joining shards' certificates"},
    {"log-dir", 0, FU_OPT_PATH, FU_OPT_TO(sa.log_dir), "DIR",
     "keep the children's logs here (default: a temporary\ndirectory, removed on exit)"},
    {"ready-timeout", 0, FU_OPT_INT, FU_OPT_TO(sa.ready_timeout_s), "S", "give up when not healthy after S seconds",
     .def = "300", .lo = 1, .hi = 86400},
    FU_OPT_END,
};

static const fu_opt_spec fz_serve_spec = {
    "fusion serve",
    "usage: fusion serve [options] [MODEL]\n"
    "Runs an OpenAI-compatible gateway and local shards of MODEL (a path, a name from\n"
    "`fusion ls`, or a hub repo id; default: SmolLM2-135M-Instruct from the cache) on\n"
    "this machine, prints the URL, the API key and the swarm page, and stays up until\n"
    "Ctrl-C, which stops every process it started.\n",
    fz_serve_options,
    "\nExit status: 0 stopped by Ctrl-C or SIGTERM; 1 it could not start (one line says\n"
    "why: a port in use, a missing model, a shard that failed); 2 a usage error; 3 a\n"
    "gateway or shard died while serving; 130 interrupted while starting.\n"
    "Environment: FUSION_API_KEY, FUSION_SECRET, FUSION_CACHE.\n"};

/* ---- fusion serve: the run ------------------------------------------------------------------- */

/* One serve run: the model, the plan and the children (0: the gateway, 1..: the shards). */
typedef struct fz_serve {
    char *model;                   /* resolved path, malloc'd */
    int n_layers, n_shards, threads;
    char work[2048];               /* the logs and port files */
    int temp_work;                 /* 1: remove work at the end */
    char key[128], secret[256];
    char env_secret[300], env_key[160];
    char url[300], swarm_addr[300], local_join[300]; /* local_join: where local shards join */
    fz_child ch[FZ_MAX_SHARDS + 1];
    int pgid;
} fz_serve;

/* The model's block count, from its metadata only. */
static int fz_model_layers(const char *path, int *n_layers) {
    mdl_open_options mo = {.first = 0, .last = 0, .embed = false, .head = false};
    mdl_model *m = NULL;
    int rc = mdl_open(path, &mo, &m);
    if (!rc) *n_layers = m->cfg.n_layers;
    mdl_free(m);
    return rc ? fu_errorf(rc, "%s: %s", path, fu_last_error()) : FU_OK;
}

/* The shard count and threads per shard for this machine unless given. */
static void fz_serve_plan(fz_serve *s, const fz_serve_args *a) {
    long cores = sysconf(_SC_NPROCESSORS_ONLN);
    if (cores < 1) cores = 1;
    int n = a->shards ? a->shards : (int)(cores / 8 > 4 ? 4 : cores / 8 < 1 ? 1 : cores / 8);
    s->n_shards = n > s->n_layers ? s->n_layers : n;
    s->threads = a->threads ? a->threads : (int)(cores / s->n_shards > 0 ? cores / s->n_shards : 1);
}

/* The key and secret: given, from the environment, or generated. */
static int fz_serve_secrets(fz_serve *s, const fz_serve_args *a) {
    const char *key = a->api_key ? a->api_key : getenv("FUSION_API_KEY");
    const char *secret = a->secret ? a->secret : getenv("FUSION_SECRET");
    char hex[64];
    int rc = FU_OK;
    if (key && key[0]) snprintf(s->key, sizeof s->key, "%s", key);
    else if (!(rc = fz_random_hex(hex, sizeof hex, 12))) snprintf(s->key, sizeof s->key, "sk-fusion-%s", hex);
    if (!rc && secret && secret[0]) snprintf(s->secret, sizeof s->secret, "%s", secret);
    else if (!rc) rc = fz_random_hex(s->secret, sizeof s->secret, 16);
    snprintf(s->env_secret, sizeof s->env_secret, "FUSION_SECRET=%s", s->secret);
    snprintf(s->env_key, sizeof s->env_key, "FUSION_API_KEY=%s", s->key);
    return rc;
}

/* The directory of logs and port files: --log-dir, else a new temporary one. */
static int fz_serve_workdir(fz_serve *s, const fz_serve_args *a) {
    if (a->log_dir) {
        snprintf(s->work, sizeof s->work, "%s", a->log_dir);
        if (mkdir(s->work, 0700) && errno != EEXIST) return fu_errorf(FU_ERR_IO, "%s: %s", s->work, strerror(errno));
        return FU_OK;
    }
    const char *tmp = getenv("TMPDIR");
    snprintf(s->work, sizeof s->work, "%s/fusion-serve.XXXXXX", tmp && tmp[0] ? tmp : "/tmp");
    if (!mkdtemp(s->work)) return fu_errorf(FU_ERR_IO, "%s: %s", s->work, strerror(errno));
    s->temp_work = 1;
    return FU_OK;
}

/* Removes the work directory's files and itself (a temporary one only). */
static void fz_serve_cleanup(fz_serve *s) {
    if (!s->temp_work) return;
    char path[4200];
    for (int i = 0; i <= s->n_shards; i++) unlink(s->ch[i].log);
    const char *ports[] = {"gateway.port", "swarm.port"};
    for (size_t i = 0; i < 2; i++) snprintf(path, sizeof path, "%s/%s", s->work, ports[i]), unlink(path);
    for (int i = 0; i < s->n_shards; i++) snprintf(path, sizeof path, "%s/shard-%d.port", s->work, i), unlink(path);
    rmdir(s->work);
}

/* Where others join (this host's name for a wildcard --swarm-listen) and where local shards do. */
static void fz_serve_swarm_addr(fz_serve *s, const char *listen, int port) {
    const char *colon = strrchr(listen, ':');
    int hl = colon ? (int)(colon - listen) : (int)strlen(listen);
    char host[256];
    snprintf(host, sizeof host, "%.*s", hl, listen);
    int wildcard = !host[0] || !strcmp(host, "0.0.0.0") || !strcmp(host, "::") || !strcmp(host, "[::]");
    if (wildcard && gethostname(host, sizeof host)) snprintf(host, sizeof host, "127.0.0.1");
    host[sizeof host - 1] = '\0';
    snprintf(s->swarm_addr, sizeof s->swarm_addr, "%s:%d", host, port);
    snprintf(s->local_join, sizeof s->local_join, "%s:%d", wildcard ? "127.0.0.1" : host, port);
}

/* Starts the gateway and waits for its membership service's port. */
static int fz_serve_gateway(fz_serve *s, const fz_serve_args *a) {
    char listen[300], port_file[4200], swarm_file[4200];
    snprintf(listen, sizeof listen, "%s:%d", a->host, a->port);
    snprintf(port_file, sizeof port_file, "%s/gateway.port", s->work);
    snprintf(swarm_file, sizeof swarm_file, "%s/swarm.port", s->work);
    char *argv[24] = {"fusion-gateway", "--model", s->model, "--listen", listen, "--port-file", port_file,
                      "--swarm-listen", a->swarm_listen, "--swarm-port-file", swarm_file};
    int n = 11, port = 0;
    if (!a->swarm_cert) argv[n++] = "--insecure"; /* plaintext on loopback only */
    if (a->swarm_cert) argv[n++] = "--swarm-tls-cert", argv[n++] = a->swarm_cert;
    if (a->swarm_key) argv[n++] = "--swarm-tls-key", argv[n++] = a->swarm_key;
    if (a->tls_ca) argv[n++] = "--tls-ca", argv[n++] = a->tls_ca;
    char *env[] = {s->env_secret, s->env_key, NULL};
    fz_child *gw = &s->ch[0];
    snprintf(gw->name, sizeof gw->name, "the gateway");
    snprintf(gw->log, sizeof gw->log, "%s/gateway.log", s->work);
    int rc = fz_child_start(gw, argv, env, &s->pgid);
    if (!rc) rc = fz_wait_port_file(swarm_file, gw, 60000, &port);
    fz_serve_swarm_addr(s, a->swarm_listen, port);
    snprintf(s->url, sizeof s->url, "http://%s:%d", a->host, a->port);
    return rc;
}

/* Starts shard i of the plan: blocks [i*L/N, (i+1)*L/N), joining the gateway. */
static int fz_serve_shard(fz_serve *s, const fz_serve_args *a, int i) {
    int first = i * s->n_layers / s->n_shards, last = (i + 1) * s->n_layers / s->n_shards;
    char blocks[32], threads[16], port_file[4200];
    snprintf(blocks, sizeof blocks, "%d:%d", first, last);
    snprintf(threads, sizeof threads, "%d", s->threads);
    snprintf(port_file, sizeof port_file, "%s/shard-%d.port", s->work, i);
    char *argv[24] = {"fusion-shard", "--model", s->model, "--blocks", blocks, "--join", s->local_join,
                      "--listen", "127.0.0.1:0", "--port-file", port_file, "--threads", threads,
                      "--device", (char *)fz_device_pick(a->device)};
    int n = 15;
    if (!a->swarm_cert) argv[n++] = "--insecure";
    if (a->swarm_cert) /* TLS everywhere: the swarm's pair serves the local shards too */
        argv[n++] = "--tls-cert", argv[n++] = a->swarm_cert, argv[n++] = "--tls-key", argv[n++] = a->swarm_key,
        argv[n++] = "--tls-ca", argv[n++] = a->tls_ca ? a->tls_ca : a->swarm_cert;
    char *env[] = {s->env_secret, NULL};
    fz_child *c = &s->ch[1 + i];
    snprintf(c->name, sizeof c->name, "shard %d (blocks %s)", i, blocks);
    snprintf(c->log, sizeof c->log, "%s/shard-%d.log", s->work, i);
    return fz_child_start(c, argv, env, &s->pgid);
}

/* A child that is no longer running, or NULL. */
static fz_child *fz_serve_dead(fz_serve *s) {
    for (int i = 0; i <= s->n_shards; i++)
        if (s->ch[i].pid > 0 && fz_child_exited(&s->ch[i])) return &s->ch[i];
    return NULL;
}

/* Waits until /health says 200 while every child runs. */
static int fz_serve_ready(fz_serve *s, int timeout_s) {
    fz_http h;
    int rc = fz_http_init(&h, s->url, s->key);
    double deadline = fu_now_s() + timeout_s;
    fz_child *dead = NULL;
    for (long status = 0; !rc;) {
        json_t *doc = NULL;
        int got = fz_http_json(&h, "/health", NULL, &status, &doc);
        json_decref(doc);
        if (!got && status == 200) break;
        if (fz_interrupted) rc = FU_ERR_CANCELLED;
        else if ((dead = fz_serve_dead(s))) rc = FU_ERR_IO;
        else if (fu_now_s() > deadline) rc = fu_errorf(FU_ERR_EXHAUSTED, "not healthy after %d s (%s)", timeout_s,
                                                        got ? fu_last_error() : "no reply");
        else fu_sleep_ms(200);
    }
    if (dead) {
        char why[400];
        fz_child_why(dead, why, sizeof why);
        rc = fu_errorf(FU_ERR_IO, "%s", why);
    }
    fz_http_free(&h);
    return rc;
}

/* Why waiting for child c's port file failed, as the error. */
static int fz_wait_failed(int rc, const fz_child *c) {
    char why[400];
    if (rc == FU_ERR_IO) fz_child_why(c, why, sizeof why);
    else if (rc == FU_ERR_EXHAUSTED) snprintf(why, sizeof why, "%s did not start in time", c->name);
    else snprintf(why, sizeof why, "interrupted");
    return fu_errorf(rc, "%s", why);
}

/* Starts the gateway and the shards and waits until the gateway is healthy. */
static int fz_serve_start(fz_serve *s, const fz_serve_args *a) {
    int rc = fz_serve_gateway(s, a), port;
    if (rc) return rc == FU_ERR_IO || rc == FU_ERR_EXHAUSTED || rc == FU_ERR_CANCELLED ? fz_wait_failed(rc, &s->ch[0])
                                                                                        : rc;
    for (int i = 0; !rc && i < s->n_shards; i++) rc = fz_serve_shard(s, a, i);
    for (int i = 0; !rc && i < s->n_shards; i++) {
        char port_file[4200];
        snprintf(port_file, sizeof port_file, "%s/shard-%d.port", s->work, i);
        rc = fz_wait_port_file(port_file, &s->ch[1 + i], a->ready_timeout_s * 1000, &port);
        if (rc) rc = fz_wait_failed(rc, &s->ch[1 + i]);
    }
    return rc ? rc : fz_serve_ready(s, a->ready_timeout_s);
}

/* The checks before anything starts: the model, the plan, the port, the secrets. */
static int fz_serve_prepare(fz_serve *s, const fz_serve_args *a, const char *model) {
    int err = 0, rc = fz_model_resolve(model, &s->model);
    if (!rc) rc = fz_model_layers(s->model, &s->n_layers);
    if (!rc) fz_serve_plan(s, a);
    if (!rc && !fz_port_free(a->host, a->port, &err))
        rc = err == EADDRINUSE ? fu_errorf(FU_ERR_INVALID, "port %d is in use: pass --port", a->port)
                               : fu_errorf(FU_ERR_INVALID, "cannot listen on %s:%d: %s", a->host, a->port,
                                           strerror(err));
    if (!rc) rc = fz_serve_secrets(s, a);
    if (!rc) rc = fz_serve_workdir(s, a);
    return rc;
}

/* Prints where the gateway serves and how to use it. */
static void fz_serve_banner(const fz_serve *s) {
    const char *base = strrchr(s->model, '/');
    printf("fusion: serving %s with %d shard%s (%d blocks, %d thread%s each)\n", base ? base + 1 : s->model,
           s->n_shards, s->n_shards == 1 ? "" : "s", s->n_layers, s->threads, s->threads == 1 ? "" : "s");
    printf("  URL:     %s/v1\n", s->url);
    printf("  API key: %s\n", s->key);
    printf("  Swarm:   %s/\n", s->url);
    printf("  Join:    FUSION_SECRET=%s fusion join %s\n", s->secret, s->swarm_addr);
    printf("  Chat:    FUSION_API_KEY=%s fusion chat --url %s\n", s->key, s->url);
    if (!s->temp_work) printf("  Logs:    %s\n", s->work);
    printf("Press Ctrl-C to stop.\n");
    fflush(stdout);
}

/* Serves until a signal (FZ_EXIT_OK) or a child's death (FZ_EXIT_CHILD). */
static int fz_serve_watch(fz_serve *s) {
    fz_child *dead = NULL;
    while (!fz_interrupted && !(dead = fz_serve_dead(s))) fu_sleep_ms(100);
    if (!dead) return FZ_EXIT_OK;
    char why[400];
    fz_child_why(dead, why, sizeof why);
    fprintf(stderr, "fusion serve: %s\n", why);
    return FZ_EXIT_CHILD;
}

/* Stops the gateway first (no new requests), then the shards. */
static void fz_serve_stop(fz_serve *s) {
    int running = 0;
    for (int i = 0; i <= s->n_shards; i++) running += s->ch[i].pid > 0;
    if (running && fz_interrupted) fprintf(stderr, "fusion serve: stopping\n");
    fz_children_stop(&s->ch[0], 1, FZ_STOP_MS);
    fz_children_stop(&s->ch[1], s->n_shards, FZ_STOP_MS);
}

int fz_serve_main(int argc, char **argv) {
    int n = 0, status = fu_opt_main(&fz_serve_spec, argc, argv, &n);
    if (status < 0 && n > 1) status = fu_opt_fail(&fz_serve_spec, "more than one model ('%s', '%s')", argv[1], argv[2]);
    if (status >= 0) return fu_opt_free(fz_serve_options), status;
    fz_signals_catch();
    fz_serve *s = calloc(1, sizeof *s);
    int rc = s ? fz_serve_prepare(s, &sa, n ? argv[1] : NULL) : fu_errorf(FU_ERR_NOMEM, "out of memory");
    if (!rc) rc = fz_serve_start(s, &sa);
    if (rc && !fz_interrupted) fprintf(stderr, "fusion serve: %s\n", fu_last_error());
    if (!rc) fz_serve_banner(s);
    status = rc ? (fz_interrupted ? FZ_EXIT_INTERRUPTED : FZ_EXIT_FAIL) : fz_serve_watch(s);
    if (s) {
        fz_serve_stop(s);
        fz_serve_cleanup(s);
        free(s->model);
    }
    free(s);
    fu_opt_free(fz_serve_options);
    return status;
}

/* ---- fusion join ------------------------------------------------------------------------------- */

typedef struct fz_join_args {
    char *model, *secret, *device, *listen, *advertise, *tls_cert, *tls_key, *tls_ca;
    int threads, max_blocks;
} fz_join_args;

static fz_join_args ja;

static const fu_opt fz_join_options[] = {
    {"model", 'm', FU_OPT_STRING, FU_OPT_TO(ja.model), "MODEL",
     "the gateway's model here: a path, a name from `fusion ls`\nor a hub repo id (default: SmolLM2-135M-Instruct)"},
    {"secret", 0, FU_OPT_STRING, FU_OPT_TO(ja.secret), "S", "the swarm secret (default $FUSION_SECRET)"},
    {"device", 0, FU_OPT_STRING, FU_OPT_TO(ja.device), "auto|cpu|cuda|cuda:N",
     "auto: the GPU when built with CUDA and one is present", .def = "auto"},
    {"threads", 't', FU_OPT_INT, FU_OPT_TO(ja.threads), .help = "CPU threads (default: all)", .lo = 0, .hi = 1024},
    {"max-blocks", 0, FU_OPT_INT, FU_OPT_TO(ja.max_blocks), .help = "most blocks the gateway may assign",
     .lo = 1, .hi = 100000},
    {"listen", 0, FU_OPT_STRING, FU_OPT_TO(ja.listen), "HOST:PORT", "where this shard serves", .def = "127.0.0.1:0"},
    {"advertise", 0, FU_OPT_STRING, FU_OPT_TO(ja.advertise), "HOST:PORT",
     "the address the gateway and peers reach this shard by"},
    {"tls-cert", 0, FU_OPT_PATH, FU_OPT_TO(ja.tls_cert), "F", "serve TLS with this certificate (beyond loopback)"},
    {"tls-key", 0, FU_OPT_PATH, FU_OPT_TO(ja.tls_key), "F", "and this key"},
    {"tls-ca", 0, FU_OPT_PATH, FU_OPT_TO(ja.tls_ca), "F", "the CA of the gateway's and peers' certificates"},
    FU_OPT_END,
};

static const fu_opt_spec fz_join_spec = {
    "fusion join",
    "usage: fusion join [options] GATEWAY\n"
    "Joins the swarm of the gateway whose membership service is at GATEWAY (HOST:PORT, as\n"
    "`fusion serve` prints it) with this machine's GPU (when built with CUDA and one is\n"
    "present) or CPU: a fusion-shard that the gateway's router assigns a span of blocks.\n"
    "It stays up until Ctrl-C, which leaves the swarm (sessions drain first).\n",
    fz_join_options,
    "\nExit status: 0 left after Ctrl-C or SIGTERM; 1 it could not start; 2 a usage error;\n"
    "3 the shard died; 130 interrupted while the model was fetched.\n"
    "Environment: FUSION_SECRET, FUSION_CACHE.\n"};

/* Runs the shard in the foreground (its output on ours) until a signal or its end. */
static int fz_join_run(const fz_join_args *a, const char *model, const char *gateway, const char *secret) {
    char threads[16], blocks[16], env_secret[300];
    snprintf(threads, sizeof threads, "%d", a->threads);
    snprintf(blocks, sizeof blocks, "%d", a->max_blocks);
    snprintf(env_secret, sizeof env_secret, "FUSION_SECRET=%s", secret);
    char *argv[32] = {"fusion-shard", "--model", (char *)model, "--join", (char *)gateway, "--listen", a->listen,
                      "--threads", threads, "--device", (char *)fz_device_pick(a->device)};
    int n = 11, pgid = 0;
    if (a->max_blocks) argv[n++] = "--max-blocks", argv[n++] = blocks;
    if (a->advertise) argv[n++] = "--advertise", argv[n++] = a->advertise;
    if (a->tls_cert) argv[n++] = "--tls-cert", argv[n++] = a->tls_cert;
    if (a->tls_key) argv[n++] = "--tls-key", argv[n++] = a->tls_key;
    if (a->tls_ca) argv[n++] = "--tls-ca", argv[n++] = a->tls_ca;
    if (!a->tls_cert && fz_is_loopback(a->listen)) argv[n++] = "--insecure";
    char *env[] = {env_secret, NULL};
    fz_child c = {.name = "the shard"};
    fprintf(stderr, "fusion join: joining %s on %s; Ctrl-C leaves\n", gateway, argv[10]);
    if (fz_child_start(&c, argv, env, &pgid)) return fprintf(stderr, "fusion join: %s\n", fu_last_error()), 1;
    while (!fz_interrupted && !fz_child_exited(&c)) fu_sleep_ms(100);
    if (!fz_interrupted) {
        char why[400];
        fz_child_why(&c, why, sizeof why);
        fprintf(stderr, "fusion join: %s\n", why);
        return FZ_EXIT_CHILD;
    }
    fprintf(stderr, "fusion join: leaving\n");
    fz_children_stop(&c, 1, FZ_STOP_MS);
    return FZ_EXIT_OK;
}

int fz_join_main(int argc, char **argv) {
    int n = 0, status = fu_opt_main(&fz_join_spec, argc, argv, &n);
    if (status < 0 && n != 1) status = fu_opt_fail(&fz_join_spec, "give one GATEWAY (HOST:PORT)");
    const char *secret = ja.secret ? ja.secret : getenv("FUSION_SECRET");
    if (status < 0 && (!secret || !secret[0]))
        status = fu_opt_fail(&fz_join_spec, "no swarm secret: give --secret or set FUSION_SECRET");
    else if (status < 0 && strlen(secret) < 16)
        status = fu_opt_fail(&fz_join_spec, "the swarm secret is shorter than 16 bytes: use the gateway's");
    if (status >= 0) return fu_opt_free(fz_join_options), status;
    fz_signals_catch();
    char *model = NULL;
    if (fz_model_resolve(ja.model, &model)) {
        fprintf(stderr, "fusion join: %s\n", fu_last_error());
        status = fz_interrupted ? FZ_EXIT_INTERRUPTED : FZ_EXIT_FAIL;
    } else {
        status = fz_join_run(&ja, model, argv[1], secret);
    }
    free(model);
    fu_opt_free(fz_join_options);
    return status;
}
