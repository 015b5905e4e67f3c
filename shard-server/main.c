/* main.c -- fusion-shard: serves a span of transformer blocks of a model over gRPC. */
#include <errno.h>
#include <getopt.h>
#include <jansson.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "clock.h"
#include "hub.h"
#include "log.h"
#include "model.h"
#include "ops.h"
#include "parse.h"
#include "shard-core.h"
#include "shard-join.h"
#include "shard-rpc.h"
#include "status.h"

typedef struct shard_args {
    char *model;
    int first, last;     /* -1: default */
    int embed, head;     /* -1: default (first == 0 / last == all) */
    char *listen;
    char *advertise;
    char *secret;
    char *tls_cert, *tls_key, *tls_ca;
    int insecure;
    long kv_budget_mib;
    int kv_f16;
    int max_batch;
    int threads;
    int idle_timeout_ms;
    int drain_ms;
    char *port_file;
    char *join;          /* gateway's swarm address */
    char *device;        /* "cpu", "cuda", "cuda:N"; NULL: cpu */
    int max_blocks;      /* most blocks to load when the gateway places it (0: all) */
} shard_args;

static void usage(FILE *f) {
    fprintf(f,
            "usage: fusion-shard --model PATH|ORG/NAME[@REV] (--blocks A:B | --join HOST:PORT) [options]\n"
            "  --config FILE         JSON config (keys as the long options, e.g. \"kv_budget_mib\";\n"
            "                        keys starting with '_' are comments)\n"
            "  --listen HOST:PORT    (default 127.0.0.1:7001; port 0 picks one)\n"
            "  --advertise HOST:PORT the address this server is called at: announced on --join and\n"
            "                        reported in timings (default: the listen address; required with\n"
            "                        --join when listening on 0.0.0.0 or ::)\n"
            "  --secret S            swarm secret (or env FUSION_SECRET, or --secret-file)\n"
            "  --secret-file F\n"
            "  --tls-cert F --tls-key F   serve TLS\n"
            "  --tls-ca F            CA to verify next hops when forwarding\n"
            "  --insecure            plaintext, loopback addresses only\n"
            "  --embed / --no-embed  hold the token embeddings (default: when A = 0)\n"
            "  --head / --no-head    hold the final norm and LM head (default: when B = all)\n"
            "  --kv-budget-mib N     KV cache memory for all sessions (default 1024)\n"
            "  --kv f32|f16          KV cache type (default f32)\n"
            "  --max-batch N         tokens per batched forward (default 512)\n"
            "  --device cpu|cuda|cuda:N   where the span runs (default cpu)\n"
            "  --threads N           CPU threads (default: all)\n"
            "  --idle-timeout-ms N   expire idle sessions (default 120000)\n"
            "  --drain-ms N          on SIGTERM, let sessions finish this long (default 10000)\n"
            "  --port-file F         write the bound port to F (atomically)\n"
            "  --join HOST:PORT      register with a gateway's --swarm-listen and heartbeat; without\n"
            "                        --blocks the gateway assigns the span (or keeps it as a spare)\n"
            "  --max-blocks N        most blocks the gateway may assign (default: the whole model)\n");
}

static char *read_file_trim(const char *path) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    char buf[1100];
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[n] = '\0';
    while (n && (buf[n - 1] == '\n' || buf[n - 1] == '\r' || buf[n - 1] == ' ')) buf[--n] = '\0';
    return strdup(buf);
}

static int set_str(char **dst, const char *v) {
    free(*dst);
    *dst = strdup(v);
    return *dst ? 0 : -1;
}

static int parse_blocks(const char *s, int *a, int *b) {
    char *end;
    long x = strtol(s, &end, 10);
    if (end == s || *end != ':' || x < 0 || x > 100000) return -1;
    const char *t = end + 1;
    long y = strtol(t, &end, 10);
    if (end == t || *end || y <= x || y > 100000) return -1;
    *a = (int)x;
    *b = (int)y;
    return 0;
}

/* Applies one option (from the command line or the config file). */
static int apply_option(shard_args *a, const char *name, const char *val) {
    long v;
    if (!strcmp(name, "model")) {
        if (!strncmp(val, "~/", 2) && getenv("HOME")) {
            char buf[4096];
            snprintf(buf, sizeof buf, "%s/%s", getenv("HOME"), val + 2);
            return set_str(&a->model, buf);
        }
        return set_str(&a->model, val);
    }
    if (!strcmp(name, "blocks")) return parse_blocks(val, &a->first, &a->last);
    if (!strcmp(name, "listen")) return set_str(&a->listen, val);
    if (!strcmp(name, "advertise")) return set_str(&a->advertise, val);
    if (!strcmp(name, "secret")) return set_str(&a->secret, val);
    if (!strcmp(name, "secret-file") || !strcmp(name, "secret_file")) {
        char *s = read_file_trim(val);
        if (!s) return -1;
        free(a->secret);
        a->secret = s;
        return 0;
    }
    if (!strcmp(name, "tls-cert") || !strcmp(name, "tls_cert")) return set_str(&a->tls_cert, val);
    if (!strcmp(name, "tls-key") || !strcmp(name, "tls_key")) return set_str(&a->tls_key, val);
    if (!strcmp(name, "tls-ca") || !strcmp(name, "tls_ca")) return set_str(&a->tls_ca, val);
    if (!strcmp(name, "port-file") || !strcmp(name, "port_file")) return set_str(&a->port_file, val);
    if (!strcmp(name, "join")) return set_str(&a->join, val);
    if (!strcmp(name, "device")) return set_str(&a->device, val);
    if (!strcmp(name, "kv")) {
        if (!strcmp(val, "f16")) a->kv_f16 = 1;
        else if (!strcmp(val, "f32")) a->kv_f16 = 0;
        else return -1;
        return 0;
    }
#define SHARD_INT_OPT_(opt, alt, field, lo, hi)                     \
    if (!strcmp(name, opt) || !strcmp(name, alt)) {                \
        if (fu_parse_long(val, lo, hi, &v)) return -1;                 \
        a->field = (int)v;                                          \
        return 0;                                                   \
    }
    SHARD_INT_OPT_("max-batch", "max_batch", max_batch, 1, 1 << 16)
    SHARD_INT_OPT_("threads", "threads", threads, 0, 1024)
    SHARD_INT_OPT_("idle-timeout-ms", "idle_timeout_ms", idle_timeout_ms, 1, 86400000)
    SHARD_INT_OPT_("drain-ms", "drain_ms", drain_ms, 0, 3600000)
    SHARD_INT_OPT_("max-blocks", "max_blocks", max_blocks, 1, 100000)
#undef SHARD_INT_OPT_
    if (!strcmp(name, "kv-budget-mib") || !strcmp(name, "kv_budget_mib")) {
        if (fu_parse_long(val, 1, 1L << 24, &v)) return -1;
        a->kv_budget_mib = v;
        return 0;
    }
    return -2;
}

/* Loads a JSON config: an object whose keys are option names. */
static int load_config(shard_args *a, const char *path) {
    json_error_t err;
    json_t *root = json_load_file(path, JSON_REJECT_DUPLICATES, &err);
    if (!root) {
        fprintf(stderr, "fusion-shard: %s:%d: %s\n", path, err.line, err.text);
        return -1;
    }
    if (!json_is_object(root)) {
        fprintf(stderr, "fusion-shard: %s: the config must be a JSON object\n", path);
        json_decref(root);
        return -1;
    }
    const char *key;
    json_t *val;
    int rc = 0;
    json_object_foreach(root, key, val) {
        if (key[0] == '_') continue; /* comments */
        char buf[64];
        const char *s;
        if (json_is_string(val)) s = json_string_value(val);
        else if (json_is_integer(val)) {
            snprintf(buf, sizeof buf, "%lld", (long long)json_integer_value(val));
            s = buf;
        } else if (json_is_boolean(val)) {
            int on = json_is_true(val);
            if (!strcmp(key, "insecure")) a->insecure = on;
            else if (!strcmp(key, "embed")) a->embed = on;
            else if (!strcmp(key, "head")) a->head = on;
            else {
                fprintf(stderr, "fusion-shard: %s: \"%s\" is not a boolean option\n", path, key);
                rc = -1;
            }
            continue;
        } else {
            fprintf(stderr, "fusion-shard: %s: \"%s\" must be a string, integer or boolean\n", path, key);
            rc = -1;
            continue;
        }
        int r = apply_option(a, key, s);
        if (r) {
            fprintf(stderr, "fusion-shard: %s: %s \"%s\"\n", path,
                    r == -2 ? "unknown option" : "bad value for", key);
            rc = -1;
        }
    }
    json_decref(root);
    return rc;
}

static int write_port_file(const char *path, int port) {
    char tmp[4096];
    snprintf(tmp, sizeof tmp, "%s.tmp.%d", path, (int)getpid());
    FILE *f = fopen(tmp, "w");
    if (!f) return -1;
    fprintf(f, "%d\n", port);
    if (fclose(f)) return -1;
    return rename(tmp, path);
}

static void free_args(shard_args *a) {
    free(a->model);
    free(a->listen);
    free(a->advertise);
    free(a->secret);
    free(a->tls_cert);
    free(a->tls_key);
    free(a->tls_ca);
    free(a->port_file);
    free(a->join);
    free(a->device);
}

/* The span this process serves: opened at start-up (--blocks) or when the gateway assigns one. */
typedef struct shard_span {
    pthread_mutex_t mu;  /* guards m, core, tps against the membership thread's reads */
    char *path;
    op_backend *be;
    int n_layers;
    char name[128], dtype[16], device[300];
    uint64_t kv_budget;
    int max_batch;
    bool kv_f16;
    double block_tps;    /* measured with one block */
    mdl_model *m;        /* NULL while a spare */
    shard_core *core;
    double tps;
    shard_server *srv;
    mdl_model *old_m;    /* the span given up by the last move, while it drains; NULL: none */
    shard_core *old_core;
    double moved_at;     /* monotonic seconds of that move */
    int drain_ms;        /* how long its sessions may go on */
    int hidden_size;
} shard_span;

/* Opens [first, last) (embed/head: -1 for the default) and its core; measures it. */
static int shard_span_open(shard_span *sp, int first, int last, int embed, int head, mdl_model **m_out,
                           shard_core **core_out, double *tps_out) {
    mdl_open_options mo = {first, last, embed >= 0 ? embed != 0 : first == 0,
                           head >= 0 ? head != 0 : last == sp->n_layers};
    mdl_model *m = NULL;
    shard_core *core = NULL;
    int rc = mdl_open(sp->path, &mo, &m);
    shard_core_options so = {sp->kv_budget, sp->max_batch, sp->kv_f16 ? OP_TYPE_F16 : OP_TYPE_F32};
    if (!rc) rc = shard_core_new(m, sp->be, &so, &core);
    if (rc) {
        mdl_free(m);
        return rc;
    }
    double tps = shard_core_measure(core, 1, 0.3);
    *m_out = m;
    *core_out = core;
    *tps_out = tps > 0 ? tps : 0;
    return FU_OK;
}

/* Frees the span given up by the last move once its sessions are done; past drain_ms its sessions
 * are ended (the gateway replays them elsewhere). */
static void shard_span_reap(shard_span *sp) {
    pthread_mutex_lock(&sp->mu);
    const bool draining = sp->old_core != NULL;
    const bool late = draining && fu_now_s() - sp->moved_at >= sp->drain_ms / 1000.0;
    pthread_mutex_unlock(&sp->mu);
    if (!draining) return;
    shard_core *c = shard_server_old_core(sp->srv, late);
    if (!c) return;
    pthread_mutex_lock(&sp->mu);
    mdl_model *m = sp->old_m;
    FU_INFO("fusion-shard: freed blocks [%d, %d) (moved away)", m->first, m->last);
    sp->old_m = NULL;
    sp->old_core = NULL;
    pthread_mutex_unlock(&sp->mu);
    shard_core_free(c);
    mdl_free(m);
}

/* shard_join_config.load: loads the span the gateway assigned and serves it; a serving shard
 * (a move) loads it beside its span, which then drains. It runs beside shard_span_status, on the
 * loader thread, and is the only writer of core and m. */
static int shard_span_load(void *ctx, int first, int last) {
    shard_span *sp = ctx;
    pthread_mutex_lock(&sp->mu);
    const int dfirst = sp->old_core ? sp->old_m->first : 0, dlast = sp->old_core ? sp->old_m->last : 0;
    pthread_mutex_unlock(&sp->mu);
    if (dlast > dfirst)
        return fu_errorf(FU_ERR_INVALID, "blocks [%d, %d) still drain after the last move", dfirst, dlast);
    mdl_model *m = NULL;
    shard_core *core = NULL;
    double tps = 0;
    int rc = shard_span_open(sp, first, last, -1, -1, &m, &core, &tps);
    if (rc) return rc;
    rc = sp->core ? shard_server_move(sp->srv, core, tps) : shard_server_set_core(sp->srv, core, tps);
    if (rc) {
        shard_core_free(core);
        mdl_free(m);
        return rc;
    }
    pthread_mutex_lock(&sp->mu);
    const bool moved = sp->core != NULL;
    if (moved) {
        sp->old_m = sp->m;
        sp->old_core = sp->core;
        sp->moved_at = fu_now_s();
    }
    sp->m = m;
    sp->core = core;
    sp->tps = tps;
    snprintf(sp->dtype, sizeof sp->dtype, "%s", op_type_name(m->layers[0].wq.type));
    pthread_mutex_unlock(&sp->mu);
    FU_INFO("fusion-shard serving blocks [%d, %d) of %s%s%s at %s on %s, %.1f tokens/s measured%s", first, last,
            sp->name, m->has_embed ? " +embeddings" : "", m->has_head ? " +head" : "", shard_server_address(sp->srv),
            sp->device, tps, moved ? " (the previous span drains)" : "");
    return FU_OK;
}

/* shard_join_config.status */
static void shard_span_status(void *ctx, shard_join_status *st) {
    shard_span *sp = ctx;
    shard_span_reap(sp); /* the membership thread calls this every heartbeat */
    pthread_mutex_lock(&sp->mu);
    if (sp->old_core) {
        shard_core_stats os;
        shard_core_get_stats(sp->old_core, &os);
        st->draining_first = sp->old_m->first;
        st->draining_last = sp->old_m->last;
        st->draining_sessions = os.active_sessions;
    }
    snprintf(st->dtype, sizeof st->dtype, "%s", sp->dtype);
    if (sp->core) {
        shard_core_stats cs;
        shard_core_get_stats(sp->core, &cs);
        st->first = sp->m->first;
        st->last = sp->m->last;
        st->tokens_per_s = sp->tps;
        st->free_kv_bytes = (int64_t)cs.kv_free_bytes;
        st->total_kv_bytes = (int64_t)cs.kv_total_bytes;
        st->kv_bytes_per_position = (int64_t)cs.kv_bytes_per_pos;
        st->active_sessions = cs.active_sessions;
    }
    pthread_mutex_unlock(&sp->mu);
}

/* The address a joining shard announces (--advertise, else the listen host with the bound port)
 * must be one the gateway and peers can call. */
static int check_announced(const char *address, bool advertised) {
    const char *colon = strrchr(address, ':');
    size_t hl = colon ? (size_t)(colon - address) : 0;
    char *end = NULL;
    long port = colon ? strtol(colon + 1, &end, 10) : -1;
    if (!colon || hl == 0 || !end || end == colon + 1 || *end || port < (advertised ? 1 : 0) || port > 65535)
        return fu_errorf(FU_ERR_INVALID, "%s '%s' is not HOST:PORT", advertised ? "--advertise" : "--listen",
                         address);
    static const char *const wildcard[] = {"0.0.0.0", "::", "[::]", "*"};
    for (size_t i = 0; i < sizeof wildcard / sizeof *wildcard; i++)
        if (strlen(wildcard[i]) == hl && !strncmp(address, wildcard[i], hl))
            return fu_errorf(FU_ERR_INVALID,
                             "--join: listening on %s, this server would announce %s, which others cannot call: "
                             "give --advertise HOST:PORT (a name or address the gateway and peers reach it by)",
                             address, address);
    return FU_OK;
}

int main(int argc, char **argv) {
    shard_args a = {.first = -1, .last = -1, .embed = -1, .head = -1, .kv_budget_mib = 1024,
                    .max_batch = 512, .idle_timeout_ms = 120000, .drain_ms = 10000};
    static const struct option opts[] = {
        {"config", required_argument, 0, 'c'},   {"model", required_argument, 0, 1},
        {"blocks", required_argument, 0, 1},     {"listen", required_argument, 0, 1},
        {"advertise", required_argument, 0, 1},  {"secret", required_argument, 0, 1},
        {"secret-file", required_argument, 0, 1}, {"tls-cert", required_argument, 0, 1},
        {"tls-key", required_argument, 0, 1},    {"tls-ca", required_argument, 0, 1},
        {"kv", required_argument, 0, 1},         {"kv-budget-mib", required_argument, 0, 1},
        {"max-batch", required_argument, 0, 1},  {"threads", required_argument, 0, 1},
        {"idle-timeout-ms", required_argument, 0, 1}, {"drain-ms", required_argument, 0, 1},
        {"port-file", required_argument, 0, 1},  {"insecure", no_argument, 0, 'i'},
        {"join", required_argument, 0, 1},       {"max-blocks", required_argument, 0, 1},
        {"device", required_argument, 0, 1},
        {"embed", no_argument, 0, 'e'},          {"no-embed", no_argument, 0, 'E'},
        {"head", no_argument, 0, 'H'},           {"no-head", no_argument, 0, 'N'},
        {"help", no_argument, 0, 'h'},           {0, 0, 0, 0}};
    /* the config file first, so that flags override it */
    for (int i = 1; i + 1 < argc; i++)
        if (!strcmp(argv[i], "--config") && load_config(&a, argv[i + 1])) {
            free_args(&a);
            return 2;
        }
    int c, idx;
    while ((c = getopt_long(argc, argv, "h", opts, &idx)) != -1) {
        switch (c) {
        case 'c': break;
        case 1: {
            int r = apply_option(&a, opts[idx].name, optarg);
            if (r) {
                fprintf(stderr, "fusion-shard: bad value for --%s: '%s'\n", opts[idx].name, optarg);
                free_args(&a);
                return 2;
            }
            break;
        }
        case 'i': a.insecure = 1; break;
        case 'e': a.embed = 1; break;
        case 'E': a.embed = 0; break;
        case 'H': a.head = 1; break;
        case 'N': a.head = 0; break;
        case 'h': usage(stdout); free_args(&a); return 0;
        default: usage(stderr); free_args(&a); return 2;
        }
    }
    if (!a.secret && getenv("FUSION_SECRET")) a.secret = strdup(getenv("FUSION_SECRET"));
    if (!a.listen) a.listen = strdup("127.0.0.1:7001");
    if (a.join && check_announced(a.advertise ? a.advertise : a.listen, a.advertise != NULL)) {
        fprintf(stderr, "fusion-shard: %s\n", fu_last_error());
        free_args(&a);
        return 2;
    }
    if (!a.model || !a.secret || !a.secret[0]) {
        fprintf(stderr, "fusion-shard: --model and a swarm secret (--secret, --secret-file or FUSION_SECRET) "
                        "are required\n");
        usage(stderr);
        free_args(&a);
        return 2;
    }

    /* signals are taken by sigwait in this thread; every other thread blocks them */
    sigset_t sigs;
    sigemptyset(&sigs);
    sigaddset(&sigs, SIGTERM);
    sigaddset(&sigs, SIGINT);
    pthread_sigmask(SIG_BLOCK, &sigs, NULL);
    signal(SIGPIPE, SIG_IGN);

    int rc, status = 1;
    shard_span sp = {0};
    pthread_mutex_init(&sp.mu, NULL);
    shard_server *srv = NULL;
    shard_join *join = NULL;
    hub_options ho;
    hub_options_init(&ho);
    if ((rc = hub_resolve(a.model, &ho, &sp.path))) goto done;
    sp.kv_budget = (uint64_t)a.kv_budget_mib << 20;
    sp.max_batch = a.max_batch;
    sp.kv_f16 = a.kv_f16 != 0;
    sp.drain_ms = a.drain_ms;
    if ((rc = op_backend_open(a.device ? a.device : "cpu", a.threads, OP_CPU_ISA_AUTO, &sp.be, sp.device,
                              sizeof sp.device)))
        goto done;
    /* the block count, name and weight type first */
    {
        mdl_model *probe = NULL;
        mdl_open_options po = {0, a.join && a.first < 0 ? 1 : 0, false, false};
        if ((rc = mdl_open(sp.path, &po, &probe))) goto done;
        sp.n_layers = probe->cfg.n_layers;
        sp.hidden_size = probe->cfg.dim;
        snprintf(sp.name, sizeof sp.name, "%s", probe->name);
        if (probe->last > probe->first) {
            snprintf(sp.dtype, sizeof sp.dtype, "%s", op_type_name(probe->layers[0].wq.type));
            /* joining without a span: measure one block, so the gateway can model any span */
            shard_core *c1 = NULL;
            shard_core_options so = {64u << 20, a.max_batch, OP_TYPE_F32};
            if (!(rc = shard_core_new(probe, sp.be, &so, &c1))) sp.block_tps = shard_core_measure(c1, 1, 0.2);
            shard_core_free(c1);
            if (sp.block_tps < 0) sp.block_tps = 0;
        }
        mdl_free(probe);
        if (rc) goto done;
    }
    if (a.join && a.first < 0) {
        if (a.embed >= 0 || a.head >= 0) {
            rc = fu_errorf(FU_ERR_INVALID, "--embed/--head need --blocks (a joining shard takes them with its span)");
            goto done;
        }
    } else {
        int first = a.first < 0 ? 0 : a.first, last = a.last < 0 ? sp.n_layers : a.last;
        if ((rc = shard_span_open(&sp, first, last, a.embed, a.head, &sp.m, &sp.core, &sp.tps))) goto done;
        if (sp.m->last > sp.m->first)
            snprintf(sp.dtype, sizeof sp.dtype, "%s", op_type_name(sp.m->layers[0].wq.type));
    }
    shard_server_config cfg = {a.listen, a.advertise, a.tls_cert, a.tls_key, a.tls_ca, a.insecure != 0,
                               a.secret, 0, a.idle_timeout_ms, 4, sp.name, sp.device, sp.tps};
    if ((rc = shard_server_new(sp.core, &cfg, &srv)) || (rc = shard_server_start(srv))) goto done;
    sp.srv = srv;
    int port = shard_server_port(srv);
    if (sp.m)
        FU_INFO("fusion-shard serving blocks [%d, %d) of %s%s%s on %s (port %d) on %s, %.1f tokens/s measured",
                sp.m->first, sp.m->last, sp.name, sp.m->has_embed ? " +embeddings" : "",
                sp.m->has_head ? " +head" : "", a.listen, port, sp.device, sp.tps);
    else
        FU_INFO("fusion-shard on %s (port %d) holds no span yet: joining %s (%.1f tokens/s for one block)", a.listen,
                port, a.join, sp.block_tps);
    if (a.port_file && write_port_file(a.port_file, port)) {
        rc = fu_errorf(FU_ERR_IO, "%s: %s", a.port_file, strerror(errno));
        goto done;
    }
    if (a.join) {
        shard_join_config jc = {a.join, a.tls_ca, a.insecure != 0, a.secret, shard_server_address(srv), sp.name,
                                sp.n_layers, sp.device, sp.block_tps, a.max_blocks, sp.m != NULL, sp.hidden_size,
                                shard_span_load, shard_span_status, &sp};
        if ((rc = shard_join_start(&jc, &join))) goto done;
    }
    int sig = 0;
    sigwait(&sigs, &sig);
    FU_INFO("%s: draining (up to %d ms)", sig == SIGTERM ? "SIGTERM" : "SIGINT", a.drain_ms);
    shard_join_stop(join);
    join = NULL;
    shard_server_drain(srv, a.drain_ms);
    pthread_mutex_lock(&sp.mu);
    if (sp.core) {
        shard_core_stats cs;
        shard_core_get_stats(sp.core, &cs);
        FU_INFO("served %llu batched forwards carrying %llu steps (%.1f a forward), %llu positions",
                (unsigned long long)cs.batches, (unsigned long long)cs.batched_steps,
                cs.batches ? (double)cs.batched_steps / (double)cs.batches : 0.0, (unsigned long long)cs.tokens);
    }
    pthread_mutex_unlock(&sp.mu);
    status = 0;
done:
    if (status) fprintf(stderr, "fusion-shard: %s: %s\n", fu_status_str(rc), fu_last_error());
    shard_join_stop(join);
    shard_server_free(srv);
    shard_core_free(sp.core);
    shard_core_free(sp.old_core);
    op_backend_free(sp.be);
    mdl_free(sp.m);
    mdl_free(sp.old_m);
    free(sp.path);
    pthread_mutex_destroy(&sp.mu);
    free_args(&a);
    return status;
}
