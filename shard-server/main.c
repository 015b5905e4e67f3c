/* main.c -- fusion-shard: serves a span of transformer blocks of a model over gRPC. */
#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "clock.h"
#include "hub.h"
#include "log.h"
#include "model.h"
#include "ops.h"
#include "options.h"
#include "lora.h"
#include "parse.h"
#include "shard-core.h"
#include "shard-join.h"
#include "shard-rpc.h"
#include "status.h"

/* What the command line and the config file give. */
typedef struct shard_args {
    char *model;
    int span[2];         /* --blocks [first, last); {-1, -1}: the whole model, or the gateway's choice */
    int embed, head;     /* -1: default (first == 0 / last == all) */
    char *listen;
    char *advertise;
    char *secret;
    char *tls_cert, *tls_key, *tls_ca;
    char *tls_client_ca;                  /* require client certificates signed by it (mTLS) */
    char *tls_client_cert, *tls_client_key; /* shown to peers that require one; default: tls_cert/key */
    bool insecure;
    long kv_budget_mib;
    int kv_type;     /* op_type: OP_TYPE_F32 or OP_TYPE_F16 */
    int prefix_cache; /* 1: on, 0: off */
    int kv_block_tokens;
    int max_batch;
    int threads;
    int idle_timeout_ms;
    int drain_ms;
    char *port_file;
    char *join;          /* gateway's swarm address */
    char *device;        /* "cpu", "cuda", "cuda:N" */
    int max_blocks;      /* most blocks to load when the gateway places it (0: all) */
    int max_sessions, max_forward_tokens, max_step_tokens; /* caps per caller (shard_server_config) */
    int train_budget_mib, max_train_jobs, max_lora_rank;    /* fine-tuning (shard_server_config) */
    int train_priority;  /* shard_train_priority */
    fu_opt_list loras;   /* NAME=DIR: PEFT adapters loaded into every span served */
} shard_args;

static shard_args args = {.span = {-1, -1}, .embed = -1, .head = -1};

static const fu_opt_choice shard_on_off[] = {{"on", 1}, {"off", 0}, {NULL, 0}};
static const fu_opt_choice train_priority_choices[] = {
    {"inference", SHARD_TRAIN_PRIORITY_INFERENCE}, {"fair", SHARD_TRAIN_PRIORITY_FAIR}, {NULL, 0}};

static const fu_opt shard_options[] = {
    {"config", 0, FU_OPT_CONFIG, .help = "JSON config (keys as the long options, e.g. \"kv_budget_mib\";\n"
                                         "keys starting with '_' are comments)"},
    {"model", 0, FU_OPT_PATH, FU_OPT_TO(args.model), "PATH|REPO", "the model: a local path or a hub repo id"},
    {"blocks", 0, FU_OPT_SPAN, FU_OPT_TO(args.span), .hi = 100000,
     .help = "serve blocks [A, B) (default: all, or what --join assigns)"},
    {"listen", 0, FU_OPT_STRING, FU_OPT_TO(args.listen), "HOST:PORT", "port 0 picks one", .def = "127.0.0.1:7001"},
    {"advertise", 0, FU_OPT_STRING, FU_OPT_TO(args.advertise), "HOST:PORT",
     "the address this server is called at: announced on --join and\n"
     "reported in timings (default: the listen address; required with\n"
     "--join when listening on 0.0.0.0 or ::)"},
    {"secret", 0, FU_OPT_STRING, FU_OPT_TO(args.secret), "S",
     "swarm secret (or env FUSION_SECRET, or --secret-file)"},
    {"secret-file", 0, FU_OPT_FILE_TEXT, FU_OPT_TO(args.secret), "F", "the swarm secret from a file"},
    {"tls-cert", 0, FU_OPT_PATH, FU_OPT_TO(args.tls_cert), "F", "serve TLS with this certificate"},
    {"tls-key", 0, FU_OPT_PATH, FU_OPT_TO(args.tls_key), "F", "and this key"},
    {"tls-ca", 0, FU_OPT_PATH, FU_OPT_TO(args.tls_ca), "F", "CA to verify next hops when forwarding"},
    {"tls-client-ca", 0, FU_OPT_PATH, FU_OPT_TO(args.tls_client_ca), "F",
     "mTLS: refuse clients (gateway, other shards) without a certificate\n"
     "signed by this CA (the secret is still checked)"},
    {"tls-client-cert", 0, FU_OPT_PATH, FU_OPT_TO(args.tls_client_cert), "F",
     "mTLS: the certificate shown to next hops and the gateway that\n"
     "require one (default: --tls-cert)"},
    {"tls-client-key", 0, FU_OPT_PATH, FU_OPT_TO(args.tls_client_key), "F", "its key (default: --tls-key)"},
    {"insecure", 0, FU_OPT_FLAG, FU_OPT_TO(args.insecure), .help = "plaintext, loopback addresses only"},
    {"embed", 0, FU_OPT_FLAG, FU_OPT_TO(args.embed), .help = "hold the token embeddings (default: when A = 0)"},
    {"no-embed", 0, FU_OPT_FLAG, FU_OPT_TO(args.embed), .help = "leave the embeddings out", .flags = FU_OPT_NEGATE},
    {"head", 0, FU_OPT_FLAG, FU_OPT_TO(args.head),
     .help = "hold the final norm and LM head (default: when B = all)"},
    {"no-head", 0, FU_OPT_FLAG, FU_OPT_TO(args.head), .help = "leave the head out", .flags = FU_OPT_NEGATE},
    {"kv-budget-mib", 0, FU_OPT_INT, FU_OPT_TO(args.kv_budget_mib), .help = "KV cache memory for all sessions",
     .def = "1024", .lo = 1, .hi = 1L << 24},
    {"kv", 0, FU_OPT_CHOICE, FU_OPT_TO(args.kv_type), .help = "KV cache type", .def = "f32",
     .choices = op_kv_type_choices},
    {"prefix-cache", 0, FU_OPT_CHOICE, FU_OPT_TO(args.prefix_cache),
     .help = "keep the KV of prompts' blocks for later sessions with the same prefix", .def = "on",
     .choices = shard_on_off},
    {"kv-block-tokens", 0, FU_OPT_INT, FU_OPT_TO(args.kv_block_tokens),
     .help = "positions per prefix-cache block", .def = "32", .lo = 1, .hi = 4096},
    {"max-batch", 0, FU_OPT_INT, FU_OPT_TO(args.max_batch), .help = "tokens per batched forward", .def = "512",
     .lo = 1, .hi = 1 << 16},
    {"device", 0, FU_OPT_STRING, FU_OPT_TO(args.device), "cpu|cuda|cuda:N", "where the span runs", .def = "cpu"},
    {"threads", 0, FU_OPT_INT, FU_OPT_TO(args.threads), .help = "CPU threads (default: all)", .lo = 0, .hi = 1024},
    {"idle-timeout-ms", 0, FU_OPT_INT, FU_OPT_TO(args.idle_timeout_ms), .help = "expire idle sessions",
     .def = "120000", .lo = 1, .hi = 86400000},
    {"drain-ms", 0, FU_OPT_INT, FU_OPT_TO(args.drain_ms), .help = "on SIGTERM, let sessions finish this long",
     .def = "10000", .lo = 0, .hi = 3600000},
    {"port-file", 0, FU_OPT_PATH, FU_OPT_TO(args.port_file), "F", "write the bound port to F (atomically)"},
    {"join", 0, FU_OPT_STRING, FU_OPT_TO(args.join), "HOST:PORT",
     "register with a gateway's --swarm-listen and heartbeat; without\n"
     "--blocks the gateway assigns the span (or keeps it as a spare)"},
    {"max-blocks", 0, FU_OPT_INT, FU_OPT_TO(args.max_blocks),
     .help = "most blocks the gateway may assign (default: the whole model)", .lo = 1, .hi = 100000},
    {"max-sessions", 0, FU_OPT_INT, FU_OPT_TO(args.max_sessions), .help = "Session streams at once; more are refused",
     .def = "256", .lo = 1, .hi = 65536},
    {"max-forward-tokens", 0, FU_OPT_INT, FU_OPT_TO(args.max_forward_tokens),
     .help = "positions one stateless Forward may run (all sequences)", .def = "2048", .lo = 1, .hi = 1 << 24},
    {"max-step-tokens", 0, FU_OPT_INT, FU_OPT_TO(args.max_step_tokens),
     .help = "positions one session step may run (0: up to the session's length)", .def = "0", .lo = 0,
     .hi = 1 << 24},
    {"train-budget-mib", 0, FU_OPT_INT, FU_OPT_TO(args.train_budget_mib),
     .help = "memory all fine-tuning jobs may hold together", .def = "2048", .lo = 1, .hi = 1 << 24},
    {"max-train-jobs", 0, FU_OPT_INT, FU_OPT_TO(args.max_train_jobs), .help = "fine-tuning jobs at once",
     .def = "4", .lo = 1, .hi = 1024},
    {"train-priority", 0, FU_OPT_CHOICE, FU_OPT_TO(args.train_priority),
     .help = "inference: fine-tuning jobs wait while inference steps are\n"
             "queued or running (a bounded wait before each long op);\n"
             "fair: training and inference take turns op by op",
     .def = "inference", .choices = train_priority_choices},
    {"max-lora-rank", 0, FU_OPT_INT, FU_OPT_TO(args.max_lora_rank), .help = "largest LoRA rank accepted",
     .def = "256", .lo = 1, .hi = 4096},
    {"lora", 0, FU_OPT_LIST, FU_OPT_TO(args.loras), "NAME=DIR",
     "serve the PEFT adapter in DIR as adapter NAME (repeatable; the\n"
     "span's blocks of it are loaded with each span)"},
    FU_OPT_END,
};

static const fu_opt_spec shard_spec = {
    "fusion-shard", "usage: fusion-shard --model PATH|ORG/NAME[@REV] (--blocks A:B | --join HOST:PORT) [options]",
    shard_options, NULL};

static int write_port_file(const char *path, int port) {
    char tmp[4096];
    snprintf(tmp, sizeof tmp, "%s.tmp.%d", path, (int)getpid());
    FILE *f = fopen(tmp, "w");
    if (!f) return -1;
    fprintf(f, "%d\n", port);
    if (fclose(f)) return -1;
    return rename(tmp, path);
}

#define SHARD_STEP_POINTS 8
#define SHARD_STEP_MAX_S 0.25 /* step tables stop at the first size taking longer */

/* The span this process serves: opened at start-up (--blocks) or when the gateway assigns one. */
typedef struct shard_span {
    pthread_mutex_t mu;  /* guards m, core, tps against the membership thread's reads */
    char *path;
    op_backend *be;
    int n_layers;
    char name[128], dtype[16], device[300];
    uint64_t kv_budget;
    int max_batch;
    op_type kv_type;     /* OP_TYPE_F32 or OP_TYPE_F16 */
    bool prefix_cache;
    int kv_block_tokens;
    double block_tps;    /* measured with one block */
    int n_psteps, n_dsteps; /* one block's step times (0: not measured): prompts of pstep_tok[i] tokens, */
    double pstep_tok[SHARD_STEP_POINTS], pstep_s[SHARD_STEP_POINTS]; /* decode steps of dstep_tok[i] */
    double dstep_tok[SHARD_STEP_POINTS], dstep_s[SHARD_STEP_POINTS]; /* sequences */
    mdl_model *m;        /* NULL while a spare */
    shard_core *core;
    double tps;
    shard_server *srv;
    mdl_model *old_m;    /* the span given up by the last move, while it drains; NULL: none */
    shard_core *old_core;
    double moved_at;     /* monotonic seconds of that move */
    int drain_ms;        /* how long its sessions may go on */
    int hidden_size;
    int max_lora_rank;
    const fu_opt_list *loras; /* --lora NAME=DIR, loaded into each span's core */
} shard_span;

/* Loads each --lora NAME=DIR adapter's blocks of m's span into `core`. */
static int shard_span_load_loras(const shard_span *sp, const mdl_model *m, shard_core *core) {
    for (size_t i = 0; sp->loras && i < sp->loras->n; i++) {
        const char *item = sp->loras->items[i], *eq = strchr(item, '=');
        if (!eq || eq == item || !eq[1]) return fu_errorf(FU_ERR_INVALID, "--lora '%s': NAME=DIR expected", item);
        char name[SHARD_ADAPTER_MAX_ID + 1];
        if ((size_t)(eq - item) >= sizeof name) return fu_errorf(FU_ERR_INVALID, "--lora '%s': name too long", item);
        snprintf(name, sizeof name, "%.*s", (int)(eq - item), item);
        lora_adapter *ad = NULL;
        int rc = lora_load(eq + 1, &m->cfg, m->first, m->last, sp->max_lora_rank, &ad);
        if (!rc && (rc = shard_core_adapter_load(core, name, ad))) lora_free(ad);
        if (rc) {
            char why[512];
            snprintf(why, sizeof why, "%s", fu_last_error());
            return fu_errorf(rc, "--lora %s: %s", name, why);
        }
    }
    return FU_OK;
}

/* Opens [first, last) (embed/head: -1 for the default) and its core; measures it. */
static int shard_span_open(shard_span *sp, int first, int last, int embed, int head, mdl_model **m_out,
                           shard_core **core_out, double *tps_out) {
    mdl_open_options mo = {first, last, embed >= 0 ? embed != 0 : first == 0,
                           head >= 0 ? head != 0 : last == sp->n_layers};
    mdl_model *m = NULL;
    shard_core *core = NULL;
    int rc = mdl_open(sp->path, &mo, &m);
    shard_core_options so = {.kv_budget_bytes = sp->kv_budget, .max_batch_tokens = sp->max_batch,
                             .kv_type = sp->kv_type, .max_lora_rank = sp->max_lora_rank,
                             .prefix_cache_off = !sp->prefix_cache, .kv_block_tokens = sp->kv_block_tokens};
    if (!rc) rc = shard_core_new(m, sp->be, &so, &core);
    if (!rc) rc = shard_span_load_loras(sp, m, core);
    if (rc) {
        shard_core_free(core);
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
    long port;
    if (!colon || hl == 0 || fu_parse_long(colon + 1, advertised ? 1 : 0, 65535, &port))
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

/* Times steps of sizes[0..n) while one takes under SHARD_STEP_MAX_S and the core allows; returns
 * how many were timed. */
static int shard_time_table(shard_core *c, const int *sizes, int n, bool prompt, double *tok, double *secs) {
    int k = 0;
    for (int i = 0; i < n && k < SHARD_STEP_POINTS; i++) {
        double t = shard_core_time_step(c, sizes[i], prompt, 0.05);
        if (t < 0) break;
        tok[k] = sizes[i], secs[k++] = t;
        if (t > SHARD_STEP_MAX_S) break;
    }
    return k;
}

/* One block's step times, for the gateway's planner: prompts of 16..1024 tokens, decode steps of
 * 1..64 sequences (both tables or neither). */
static void shard_span_time_steps(shard_span *sp, shard_core *c1) {
    static const int prompt_sizes[] = {16, 64, 256, 1024}, decode_sizes[] = {1, 2, 4, 8, 16, 32, 64};
    sp->n_psteps = shard_time_table(c1, prompt_sizes, 4, true, sp->pstep_tok, sp->pstep_s);
    sp->n_dsteps = shard_time_table(c1, decode_sizes, 7, false, sp->dstep_tok, sp->dstep_s);
    if (!sp->n_psteps || !sp->n_dsteps) sp->n_psteps = sp->n_dsteps = 0;
    if (sp->n_dsteps)
        FU_INFO("one block: a %g-token prompt takes %.2f ms, a decode step of %g sequences %.2f ms",
                sp->pstep_tok[sp->n_psteps - 1], sp->pstep_s[sp->n_psteps - 1] * 1e3, sp->dstep_tok[sp->n_dsteps - 1],
                sp->dstep_s[sp->n_dsteps - 1] * 1e3);
}

/* Probes the model: its block count, name and weight type, and one block's throughput and step
 * times, so that the gateway can model any span (a joined shard reports them in its status, a
 * static one in Info). */
static int shard_span_probe(shard_span *sp, const shard_args *a) {
    mdl_model *probe = NULL;
    mdl_open_options po = {0, 1, false, false};
    int rc = mdl_open(sp->path, &po, &probe);
    if (rc) return rc;
    sp->n_layers = probe->cfg.n_layers;
    sp->hidden_size = probe->cfg.dim;
    snprintf(sp->name, sizeof sp->name, "%s", probe->name);
    if (probe->last > probe->first) {
        snprintf(sp->dtype, sizeof sp->dtype, "%s", op_type_name(probe->layers[0].wq.type));
        shard_core *c1 = NULL;
        shard_core_options so = {.kv_budget_bytes = 64u << 20, .max_batch_tokens = a->max_batch,
                                 .kv_type = OP_TYPE_F32};
        if (!(rc = shard_core_new(probe, sp->be, &so, &c1))) {
            sp->block_tps = shard_core_measure(c1, 1, 0.2);
            shard_span_time_steps(sp, c1);
        }
        shard_core_free(c1);
        if (sp->block_tps < 0) sp->block_tps = 0;
    }
    mdl_free(probe);
    return rc;
}

/* Resolves the model, opens the backend, probes the model and opens the span that --blocks
 * names (the whole model without it; none when joining without it). */
static int shard_span_init(shard_span *sp, const shard_args *a) {
    hub_options ho;
    hub_options_init(&ho);
    sp->kv_budget = (uint64_t)a->kv_budget_mib << 20;
    sp->max_batch = a->max_batch;
    sp->kv_type = (op_type)a->kv_type;
    sp->prefix_cache = a->prefix_cache;
    sp->kv_block_tokens = a->kv_block_tokens;
    sp->drain_ms = a->drain_ms;
    sp->max_lora_rank = a->max_lora_rank;
    sp->loras = &a->loras;
    int rc = hub_resolve(a->model, &ho, &sp->path);
    if (!rc) rc = op_backend_open(a->device, a->threads, OP_CPU_ISA_AUTO, &sp->be, sp->device, sizeof sp->device);
    if (!rc) rc = shard_span_probe(sp, a);
    if (rc) return rc;
    if (a->join && a->span[0] < 0 && (a->embed >= 0 || a->head >= 0))
        return fu_errorf(FU_ERR_INVALID, "--embed/--head need --blocks (a joining shard takes them with its span)");
    if (a->join && a->span[0] < 0) return FU_OK;
    int first = a->span[0] < 0 ? 0 : a->span[0], last = a->span[0] < 0 ? sp->n_layers : a->span[1];
    if ((rc = shard_span_open(sp, first, last, a->embed, a->head, &sp->m, &sp->core, &sp->tps))) return rc;
    if (sp->m->last > sp->m->first)
        snprintf(sp->dtype, sizeof sp->dtype, "%s", op_type_name(sp->m->layers[0].wq.type));
    return FU_OK;
}

/* Frees the server and everything the span holds. */
static void shard_span_free(shard_span *sp) {
    shard_server_free(sp->srv);
    shard_core_free(sp->core);
    shard_core_free(sp->old_core);
    op_backend_free(sp->be);
    mdl_free(sp->m);
    mdl_free(sp->old_m);
    free(sp->path);
    pthread_mutex_destroy(&sp->mu);
}

/* Logs what the span served. */
static void shard_span_log_stats(shard_span *sp) {
    pthread_mutex_lock(&sp->mu);
    if (sp->core) {
        shard_core_stats cs;
        shard_core_get_stats(sp->core, &cs);
        FU_INFO("served %llu batched forwards carrying %llu steps (%.1f a forward), %llu positions",
                (unsigned long long)cs.batches, (unsigned long long)cs.batched_steps,
                cs.batches ? (double)cs.batched_steps / (double)cs.batches : 0.0, (unsigned long long)cs.tokens);
        if (cs.train_waits)
            FU_INFO("training yielded to inference %llu times, %.1f s in all", (unsigned long long)cs.train_waits,
                    (double)cs.train_wait_us * 1e-6);
    }
    pthread_mutex_unlock(&sp->mu);
}

/* Why the gateway refused to admit this server (set once by the membership thread, under
 * join_refused_mu). */
static char join_refused[200];
static pthread_mutex_t join_refused_mu = PTHREAD_MUTEX_INITIALIZER;

/* shard_join_config.refused: records why and stops the server as SIGTERM would. */
static void shard_join_refused(void *ctx, const char *why) {
    (void)ctx;
    pthread_mutex_lock(&join_refused_mu);
    int first = !join_refused[0];
    if (first) snprintf(join_refused, sizeof join_refused, "%s", why);
    pthread_mutex_unlock(&join_refused_mu);
    if (first) kill(getpid(), SIGTERM);
}

/* Starts the server (and the membership thread with --join), waits for SIGTERM or SIGINT,
 * then drains. */
static int shard_serve(shard_span *sp, const shard_args *a, const sigset_t *sigs) {
    const char *client_cert = a->tls_client_cert ? a->tls_client_cert : a->tls_cert;
    const char *client_key = a->tls_client_cert ? a->tls_client_key : a->tls_key;
    shard_server_config cfg = {a->listen, a->advertise, a->tls_cert, a->tls_key, a->tls_ca, a->insecure,
                               a->secret, 0, a->idle_timeout_ms, 4, sp->name, sp->device, sp->tps,
                               a->tls_client_ca, client_cert, client_key,
                               a->max_sessions, a->max_forward_tokens, a->max_step_tokens,
                               (uint64_t)a->train_budget_mib << 20, a->max_train_jobs, a->max_lora_rank,
                               (shard_train_priority)a->train_priority,
                               sp->pstep_tok, sp->pstep_s, sp->dstep_tok, sp->dstep_s, sp->n_psteps, sp->n_dsteps};
    int rc = shard_server_new(sp->core, &cfg, &sp->srv);
    if (rc || (rc = shard_server_start(sp->srv))) return rc;
    int port = shard_server_port(sp->srv);
    if (sp->m)
        FU_INFO("fusion-shard serving blocks [%d, %d) of %s%s%s on %s (port %d) on %s, %.1f tokens/s measured",
                sp->m->first, sp->m->last, sp->name, sp->m->has_embed ? " +embeddings" : "",
                sp->m->has_head ? " +head" : "", a->listen, port, sp->device, sp->tps);
    else
        FU_INFO("fusion-shard on %s (port %d) holds no span yet: joining %s (%.1f tokens/s for one block)", a->listen,
                port, a->join, sp->block_tps);
    if (a->port_file && write_port_file(a->port_file, port))
        return fu_errorf(FU_ERR_IO, "%s: %s", a->port_file, strerror(errno));
    shard_join *join = NULL;
    shard_join_config jc = {a->join, a->tls_ca, a->insecure, a->secret, shard_server_address(sp->srv), sp->name,
                            sp->n_layers, sp->device, sp->block_tps, a->max_blocks, sp->m != NULL, sp->hidden_size,
                            shard_span_load, shard_span_status, sp, client_cert, client_key, shard_join_refused,
                            {(size_t)sp->n_psteps, sp->pstep_tok, sp->pstep_s},
                            {(size_t)sp->n_dsteps, sp->dstep_tok, sp->dstep_s}};
    if (a->join && (rc = shard_join_start(&jc, &join))) return rc;
    int sig = 0;
    sigwait(sigs, &sig);
    shard_join_stop(join); /* the membership thread has ended: join_refused is settled */
    if (join_refused[0]) return fu_errorf(FU_ERR_AUTH, "%s: %s", a->join, join_refused);
    FU_INFO("%s: draining (up to %d ms)", sig == SIGTERM ? "SIGTERM" : "SIGINT", a->drain_ms);
    shard_server_drain(sp->srv, a->drain_ms);
    shard_span_log_stats(sp);
    return FU_OK;
}

/* The shortest swarm secret accepted (bytes), as the gateway's. */
#define SHARD_MIN_SECRET_BYTES 16

/* The command line into a: -1 to go on, else the exit status. */
static int shard_args_parse(shard_args *a, int argc, char **argv) {
    int status = fu_opt_main(&shard_spec, argc, argv, NULL);
    if (status >= 0) return status;
    const char *env = getenv("FUSION_SECRET");
    if (env && a->secret && strcmp(env, a->secret))
        return fu_opt_fail(&shard_spec, "the swarm secret in FUSION_SECRET differs from the one given by --secret, "
                                        "--secret-file or the config file: keep one of them");
    if (!a->secret && env && !(a->secret = strdup(env))) return 1;
    if (a->join && check_announced(a->advertise ? a->advertise : a->listen, a->advertise != NULL)) {
        fprintf(stderr, "fusion-shard: %s\n", fu_last_error());
        return 2;
    }
    if (!a->tls_client_cert != !a->tls_client_key)
        return fu_opt_fail(&shard_spec, "--tls-client-cert and --tls-client-key go together");
    if (a->tls_client_ca && !a->tls_cert)
        return fu_opt_fail(&shard_spec, "--tls-client-ca (mTLS) needs TLS: --tls-cert and --tls-key");
    if (!a->model || !a->secret || !a->secret[0])
        return fu_opt_fail(&shard_spec, "--model and a swarm secret (--secret, --secret-file or FUSION_SECRET) "
                                        "are required");
    if (strlen(a->secret) < SHARD_MIN_SECRET_BYTES)
        return fu_opt_fail(&shard_spec, "the swarm secret is %zu bytes: at least %d are needed (e.g. openssl rand "
                                        "-hex 16)", strlen(a->secret), SHARD_MIN_SECRET_BYTES);
    return -1;
}

/* Serves what a asks for; the exit status. */
static int shard_run(const shard_args *a) {
    /* signals are taken by sigwait in this thread; every other thread blocks them */
    sigset_t sigs;
    sigemptyset(&sigs);
    sigaddset(&sigs, SIGTERM);
    sigaddset(&sigs, SIGINT);
    pthread_sigmask(SIG_BLOCK, &sigs, NULL);
    signal(SIGPIPE, SIG_IGN);
    shard_span sp = {0};
    pthread_mutex_init(&sp.mu, NULL);
    int rc = shard_span_init(&sp, a);
    if (!rc) rc = shard_serve(&sp, a, &sigs);
    if (rc) fprintf(stderr, "fusion-shard: %s: %s\n", fu_status_str(rc), fu_last_error());
    shard_span_free(&sp);
    return rc ? 1 : 0;
}

int main(int argc, char **argv) {
    int status = shard_args_parse(&args, argc, argv);
    if (status < 0) status = shard_run(&args);
    fu_opt_free(shard_options);
    return status;
}
