/* gw-config.c -- the gateway's options: one table (options.h) for the flags, the JSON config
 * file and --help; API key files; the environment. */
#include <assert.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gw.h"
#include "log.h"
#include "mapped-file.h"
#include "options.h"
#include "parse.h"
#include "rpc-base.h"
#include "status.h"

/* ---- values that are more than a field -------------------------------------------------- */

/* A static chain's hop: "HOST:PORT:FIRST:LAST" (the host may itself hold colons, e.g. "[::1]"). */
static int add_hop(void *ctx, const char *v) {
    gw_config *c = ctx;
    if (c->n_hops == GW_MAX_HOPS) return fu_errorf(FU_ERR_INVALID, "at most %d hops", GW_MAX_HOPS);
    gw_hop_cfg *h = &c->hops[c->n_hops];
    int span[2];
    int rc = fu_opt_split_span(v, 1000000, &h->address, span);
    if (rc) return rc;
    h->first = span[0];
    h->last = span[1];
    c->n_hops++;
    return FU_OK;
}

/* A swarm member: "host:port" (its span comes from its Info). */
static int add_shard(void *ctx, const char *v) {
    gw_config *c = ctx;
    if (c->n_shards == GW_MAX_SHARDS) return fu_errorf(FU_ERR_INVALID, "at most %d shards", GW_MAX_SHARDS);
    const char *colon = strrchr(v, ':');
    long port;
    if (!colon || colon == v || strlen(v) >= 128 || fu_parse_long(colon + 1, 1, 65535, &port))
        return fu_errorf(FU_ERR_INVALID, "expected HOST:PORT, got '%.200s'", v);
    if (!(c->shards[c->n_shards] = strdup(v))) return fu_errorf(FU_ERR_NOMEM, "shard");
    c->n_shards++;
    return FU_OK;
}

/* Splits text at commas into at most n parts; returns how many, or n + 1 when there are more. */
static int split_commas(char *text, char **parts, int n) {
    int k = 0;
    for (char *p = text; p; k++) {
        if (k == n) return n + 1;
        parts[k] = p;
        if ((p = strchr(p, ','))) *p++ = '\0';
    }
    return k;
}

/* "FROM,TO,BANDWIDTH,LATENCY": FROM/TO a member address or "gateway", bandwidth in bytes/s,
 * latency in seconds. */
static int add_link(void *ctx, const char *v) {
    gw_config *c = ctx;
    if (c->n_links == GW_MAX_LINKS) return fu_errorf(FU_ERR_INVALID, "at most %d links", GW_MAX_LINKS);
    char buf[400], *parts[4];
    double bw = 0, lat = -1;
    const size_t len = strlen(v);
    if (len < sizeof buf) memcpy(buf, v, len + 1);
    const bool ok = len < sizeof buf && split_commas(buf, parts, 4) == 4 && parts[0][0] && parts[1][0] &&
                    strlen(parts[0]) < 128 && strlen(parts[1]) < 128 && !fu_parse_double(parts[2], &bw) &&
                    !fu_parse_double(parts[3], &lat) && bw > 0 && bw <= 1e15 && lat >= 0 && lat <= 60;
    if (!ok)
        return fu_errorf(FU_ERR_INVALID,
                         "expected FROM,TO,BANDWIDTH_BYTES_PER_S,LATENCY_S (FROM/TO: HOST:PORT or gateway), "
                         "got '%.200s'", v);
    gw_link_cfg *l = &c->links[c->n_links];
    l->from = strdup(parts[0]);
    l->to = strdup(parts[1]);
    if (!l->from || !l->to) {
        free(l->from);
        free(l->to);
        return fu_errorf(FU_ERR_NOMEM, "link");
    }
    l->bandwidth = bw;
    l->latency = lat;
    c->n_links++;
    return FU_OK;
}

static int add_key(void *ctx, const char *k) {
    gw_config *c = ctx;
    if (!k[0]) return FU_OK;
    if (c->n_api_keys == GW_MAX_KEYS) return fu_errorf(FU_ERR_INVALID, "at most %d keys", GW_MAX_KEYS);
    if (!(c->api_keys[c->n_api_keys] = strdup(k))) return fu_errorf(FU_ERR_NOMEM, "config");
    c->n_api_keys++;
    return FU_OK;
}

/* The largest API key file read. */
#define GW_KEY_FILE_MAX (1 << 20)

/* API keys, one per line ('#' comments, blank lines skipped), from a regular file (mf_read:
 * a FIFO or a device is refused at once rather than waited on). */
/* An admin key: accepted as an API key, and it sees every owner's files. */
static int add_admin_key(void *ctx, const char *k) {
    gw_config *c = ctx;
    if (!k[0]) return FU_OK;
    if (c->n_admin_keys == GW_MAX_KEYS) return fu_errorf(FU_ERR_INVALID, "at most %d admin keys", GW_MAX_KEYS);
    int rc = add_key(ctx, k);
    if (!rc && !(c->admin_keys[c->n_admin_keys] = strdup(k))) rc = fu_errorf(FU_ERR_NOMEM, "config");
    if (!rc) c->n_admin_keys++;
    return rc;
}

static int load_keys(void *ctx, const char *path) {
    char *text;
    size_t len;
    int rc = mf_read(path, GW_KEY_FILE_MAX, &text, &len);
    if (rc) return rc;
    for (char *line = text; line && !rc;) {
        char *nl = strchr(line, '\n');
        if (nl) *nl = '\0';
        size_t n = strlen(line);
        while (n && (line[n - 1] == '\r' || line[n - 1] == ' ' || line[n - 1] == '\t')) line[--n] = '\0';
        while (*line == ' ' || *line == '\t') line++;
        if (*line && *line != '#') rc = add_key(ctx, line);
        line = nl ? nl + 1 : NULL;
    }
    free(text);
    return rc;
}

static int set_log_level(void *ctx, const char *v) {
    int level = fu_log_level_parse(v);
    if (level < 0) return fu_errorf(FU_ERR_INVALID, "expected debug|info|warn|error|off, got '%s'", v);
    fu_log_set_level((fu_log_level)level);
    return FU_OK;
}

/* ---- the table ------------------------------------------------------------------------------ */

enum { GW_N_OPTIONS = 80 };

/* The gateway's options bound to one config (a value, so that it can be made anywhere). */
typedef struct gw_options {
    fu_opt t[GW_N_OPTIONS];
} gw_options;

static gw_options options(gw_config *c) {
    gw_limits *l = &c->limits;
    const fu_opt t[] = {
        {"config", 0, FU_OPT_CONFIG,
         .help = "JSON config (keys as the long options; see config/gateway.example.json)"},
        {"model", 0, FU_OPT_PATH, FU_OPT_TO(c->model), "PATH|REPO",
         "model for the tokenizer, chat template and context length"},
        {"model-name", 0, FU_OPT_STRING, FU_OPT_TO(c->model_name), "NAME",
         "id served in /v1/models (default: the file's name without .gguf and a quantization tag)", .alias = "served-model-name"},
        {"listen", 0, FU_OPT_STRING, FU_OPT_TO(c->listen), "HOST:PORT",
         "(default 127.0.0.1:8080; port 0 picks one)"},
        {"port-file", 0, FU_OPT_PATH, FU_OPT_TO(c->port_file), "F", "write the bound port to F once serving"},
        {"metrics-listen", 0, FU_OPT_STRING, FU_OPT_TO(c->metrics_listen), "HOST:PORT",
         "also serve /metrics, /health and /livez here without an API key\n(for Prometheus; keep it private)"},
        {"metrics-port-file", 0, FU_OPT_PATH, FU_OPT_TO(c->metrics_port_file), "F",
         "write the --metrics-listen port to F once serving"},
        {"hop", 0, FU_OPT_CALL, .dest = c, .fn = add_hop, .arg = "HOST:PORT:A:B",
         .help = "a shard serving blocks [A, B); in chain order (a static chain)", .alias = "hops|chain",
         .flags = FU_OPT_REPEAT},
        {"shard", 0, FU_OPT_CALL, .dest = c, .fn = add_shard, .arg = "HOST:PORT",
         .help = "a swarm member (repeatable; spans may overlap): each request is\n"
                 "routed over the live shards, with failover; GET /v1/swarm",
         .alias = "shards", .flags = FU_OPT_REPEAT},
        {"swarm-listen", 0, FU_OPT_STRING, FU_OPT_TO(c->swarm_listen), "HOST:PORT",
         "host fusion.Swarm: shards started with --join register and heartbeat\n"
         "here; the gateway assigns spans, keeps spares, GET /v1/swarm"},
        {"swarm-tls-cert", 0, FU_OPT_PATH, FU_OPT_TO(c->swarm_tls_cert), "F",
         "TLS of the membership service (default: the HTTPS pair;\n--insecure: plaintext on loopback)"},
        {"swarm-tls-key", 0, FU_OPT_PATH, FU_OPT_TO(c->swarm_tls_key), "F", "its key"},
        {"swarm-tls-client-ca", 0, FU_OPT_PATH, FU_OPT_TO(c->swarm_tls_client_ca), "F",
         "mTLS: refuse members without a certificate signed by this CA\n(the secret is still checked)",
         .alias = "tls-client-ca"},
        {"swarm-port-file", 0, FU_OPT_PATH, FU_OPT_TO(c->swarm_port_file), "F",
         "write the membership service's bound port to F"},
        {"spares", 0, FU_OPT_INT, FU_OPT_TO(c->spares), .help = "spares kept waiting once every block is covered",
         .def = "1", .lo = 0, .hi = 1024},
        {"max-members", 0, FU_OPT_INT, FU_OPT_TO(c->max_members),
         .help = "joined members at once; a Join beyond is refused", .def = "256", .lo = 1, .hi = 65536},
        {"min-gain-percent", 0, FU_OPT_INT, FU_OPT_TO(c->min_gain_percent), "P",
         "a surplus spare serves (a server moves) if that raises the planner's estimate of decode tokens/s by P%", .def = "5", .lo = 0, .hi = 1000},
        {"rebalance-interval-ms", 0, FU_OPT_INT, FU_OPT_TO(c->rebalance_interval_ms),
         .help = "least time between two moves of serving members; 0: never move one", .def = "30000",
         .lo = 0, .hi = 86400000},
        {"heartbeat-ms", 0, FU_OPT_INT, FU_OPT_TO(c->heartbeat_ms), .help = "member heartbeats", .def = "500",
         .lo = 50, .hi = 60000},
        {"heartbeat-timeout-ms", 0, FU_OPT_INT, FU_OPT_TO(c->heartbeat_timeout_ms),
         .help = "retire a member silent this long", .def = "3000", .lo = 100, .hi = 600000},
        {"route-wait-ms", 0, FU_OPT_INT, FU_OPT_TO(c->route_wait_ms),
         .help = "wait for a spare loading an uncovered span", .def = "5000", .lo = 0, .hi = 600000},
        {"measure-links", 0, FU_OPT_BOOL, FU_OPT_TO(c->measure_links), .help = "RTT/bandwidth probes",
         .def = "true"},
        {"measure-interval-ms", 0, FU_OPT_INT, FU_OPT_TO(c->measure_interval_ms),
         .help = "between two probes of a link", .def = "5000", .lo = 100, .hi = 3600000},
        {"link", 0, FU_OPT_CALL, .dest = c, .fn = add_link, .arg = "FROM,TO,BW,LAT",
         .help = "given link figures (bytes/s, s; FROM/TO: HOST:PORT or gateway)", .alias = "links",
         .flags = FU_OPT_REPEAT},
        {"secret", 0, FU_OPT_STRING, FU_OPT_TO(c->secret), "S", "swarm secret (or env FUSION_SECRET)"},
        {"secret-file", 0, FU_OPT_FILE_TEXT, FU_OPT_TO(c->secret), "F", "the swarm secret from a file"},
        {"insecure", 0, FU_OPT_FLAG, FU_OPT_TO(c->insecure), .help = "plaintext to loopback shards"},
        {"tls-ca", 0, FU_OPT_PATH, FU_OPT_TO(c->tls_ca), "F", "the shards' CA"},
        {"tls-client-cert", 0, FU_OPT_PATH, FU_OPT_TO(c->tls_client_cert), "F",
         "mTLS: the certificate shown to shards that require one\n"
         "(default: the swarm service's pair, else the HTTPS pair)"},
        {"tls-client-key", 0, FU_OPT_PATH, FU_OPT_TO(c->tls_client_key), "F", "its key"},
        {"forward", 0, FU_OPT_FLAG, FU_OPT_TO(c->forward), .help = "server-to-server forwarding along the chain"},
        {"api-key", 0, FU_OPT_CALL, .dest = c, .fn = add_key, .arg = "K",
         .help = "accepted API key (repeatable; env FUSION_API_KEY, comma-separated)", .alias = "api-keys",
         .flags = FU_OPT_REPEAT},
        {"api-key-file", 0, FU_OPT_CALL, .dest = c, .fn = load_keys, .arg = "F",
         .help = "API keys, one per line (env FUSION_API_KEY_FILE)", .flags = FU_OPT_REPEAT},
        {"admin-key", 0, FU_OPT_CALL, .dest = c, .fn = add_admin_key, .arg = "K",
         .help = "an API key that also sees every key's files (repeatable)", .alias = "admin-keys",
         .flags = FU_OPT_REPEAT},
        {"data-dir", 0, FU_OPT_PATH, FU_OPT_TO(c->data_dir), "DIR",
         "uploaded files and their database (created 0700; default:\n"
         "$XDG_DATA_HOME/fusion, else ~/.local/share/fusion)"},
        {"ft-org", 0, FU_OPT_STRING, FU_OPT_TO(c->ft_org), "NAME",
         "the organization in fine-tuned model names (ft:BASE:NAME:SUFFIX:JOB)", .def = "fusion"},
        {"max-ft-jobs", 0, FU_OPT_INT, FU_OPT_TO(c->max_ft_jobs),
         .help = "fine-tuning jobs trained at once; the rest wait in order\n(each needs a training slot on every shard)",
         .def = "1", .lo = 1, .hi = GW_MAX_FT_JOBS},
        {"max-file-bytes", 0, FU_OPT_INT, FU_OPT_TO(c->max_file_bytes), .help = "an uploaded file's size at most",
         .def = "536870912", .lo = 1, .hi = 1L << 40},
        {"max-file-lines", 0, FU_OPT_INT, FU_OPT_TO(c->max_file_lines), .help = "an uploaded file's lines at most",
         .def = "1000000", .lo = 1, .hi = 1 << 30},
        {"no-auth", 0, FU_OPT_FLAG, FU_OPT_TO(c->no_auth),
         .help = "serve without API keys on a --listen beyond loopback (refused otherwise)"},
        {"allowed-host", 0, FU_OPT_LIST, FU_OPT_TO(c->allowed_hosts), "NAME",
         "a Host header accepted besides loopback names and the --listen host\n"
         "(repeatable; '*': any; others get 403)", .alias = "allowed-hosts"},
        {"cors-origin", 0, FU_OPT_LIST, FU_OPT_TO(c->cors_origins), "ORIGIN",
         "a browser Origin allowed, with CORS (repeatable, e.g. https://app.example;\n"
         "'*': any); besides it only this gateway's loopback origins", .alias = "cors-origins"},
        {"https-cert", 0, FU_OPT_PATH, FU_OPT_TO(c->https_cert), "F", "serve HTTPS with this certificate",
         .alias = "tls-cert"},
        {"https-key", 0, FU_OPT_PATH, FU_OPT_TO(c->https_key), "F", "and this key", .alias = "tls-key"},
        {"workers", 0, FU_OPT_INT, FU_OPT_TO(c->workers), .help = "concurrent generations", .def = "32", .lo = 1,
         .hi = 4096},
        {"max-queue", 0, FU_OPT_INT, FU_OPT_TO(c->max_queue), .help = "waiting generations before 429", .def = "64",
         .lo = 0, .hi = 1000000},
        {"max-body-bytes", 0, FU_OPT_INT, FU_OPT_TO(c->max_body_bytes), .help = "request body limit",
         .def = "8388608", .lo = 1024, .hi = 1L << 30},
        {"connection-timeout-s", 0, FU_OPT_INT, FU_OPT_TO(c->connection_timeout_s),
         .help = "idle connection timeout", .def = "30", .lo = 1, .hi = 86400},
        {"max-connections", 0, FU_OPT_INT, FU_OPT_TO(c->max_connections), .help = "open connections at most",
         .def = "1024", .lo = 1, .hi = 1000000},
        {"max-connections-per-ip", 0, FU_OPT_INT, FU_OPT_TO(c->max_connections_per_ip),
         .help = "open connections from one client address at most (0: no cap;\n"
                 "behind a reverse proxy every client shares its address)",
         .def = "64", .lo = 0, .hi = 1000000},
        {"connection-reserve", 0, FU_OPT_INT, FU_OPT_TO(c->connection_reserve),
         .help = "past max-connections minus this (at most half), a new connection\n"
                 "closes the oldest one still sending its request",
         .def = "16", .lo = 0, .hi = 1000000},
        {"header-timeout-s", 0, FU_OPT_INT, FU_OPT_TO(c->header_timeout_s),
         .help = "seconds for a request's headers, however they trickle (from the\n"
                 "connection, or from the previous response on a kept-alive one)",
         .def = "10", .lo = 1, .hi = 3600},
        {"body-timeout-s", 0, FU_OPT_INT, FU_OPT_TO(c->body_timeout_s),
         .help = "seconds for a request's body after its headers (else it is closed)",
         .def = "60", .lo = 1, .hi = 86400},
        {"default-max-tokens", 0, FU_OPT_INT, FU_OPT_TO(c->default_max_tokens),
         .help = "max_tokens when a request gives none", .def = "512", .lo = 1, .hi = 1 << 24},
        {"step-timeout-ms", 0, FU_OPT_INT, FU_OPT_TO(c->step_timeout_ms),
         .help = "per chain step; in a swarm, until the path's shards have measured step times", .def = "60000",
         .lo = 1, .hi = 3600000},
        {"max-request-seconds", 0, FU_OPT_INT, FU_OPT_TO(c->max_request_seconds),
         .help = "a request still running after this long ends with 408 and its shards stop (0: never)",
         .def = "1800", .lo = 0, .hi = 1 << 30},
        {"max-request-tokens", 0, FU_OPT_INT, FU_OPT_TO(l->max_request_tokens),
         .help = "request limit: positions computed, (prompt + max_tokens) x choices (0: the context only)",
         .def = "0", .lo = 0, .hi = 1 << 30},
        {"step-deadline-floor-ms", 0, FU_OPT_INT, FU_OPT_TO(c->step_deadline_floor_ms),
         .help = "in a swarm, a step waits this plus 4x its shards' measured p99 step time before failing over",
         .def = "2000", .lo = 1, .hi = 3600000},
        {"max-n", 0, FU_OPT_INT, FU_OPT_TO(l->max_n), .help = "request limit: choices per prompt (default 16)",
         .lo = 1, .hi = 1024},
        {"max-choices", 0, FU_OPT_INT, FU_OPT_TO(l->max_choices), .help = "request limit: prompts x n (default 64)",
         .lo = 1, .hi = 4096},
        {"max-prompts", 0, FU_OPT_INT, FU_OPT_TO(l->max_prompts),
         .help = "request limit: prompts of a completion (default 64)", .lo = 1, .hi = 4096},
        {"max-stop", 0, FU_OPT_INT, FU_OPT_TO(l->max_stop), .help = "request limit: stop strings (default 16)",
         .lo = 0, .hi = 1024},
        {"max-stop-bytes", 0, FU_OPT_INT, FU_OPT_TO(l->max_stop_bytes),
         .help = "request limit: bytes per stop string (default 256)", .lo = 1, .hi = 65536},
        {"max-logit-bias", 0, FU_OPT_INT, FU_OPT_TO(l->max_logit_bias),
         .help = "request limit: logit_bias entries (default and most: 300, what shards accept)", .lo = 0,
         .hi = SMP_MAX_LOGIT_BIAS},
        {"max-top-logprobs", 0, FU_OPT_INT, FU_OPT_TO(l->max_top_logprobs),
         .help = "request limit: top_logprobs (default 20)", .lo = 0, .hi = 64},
        {"max-messages", 0, FU_OPT_INT, FU_OPT_TO(l->max_messages),
         .help = "request limit: chat messages (default 4096)", .lo = 1, .hi = 1000000},
        {"lora", 0, FU_OPT_LIST, FU_OPT_TO(c->loras), "NAME=DIR",
         "serve the PEFT LoRA adapter in DIR as model NAME, a child of the base model\n"
         "(repeatable); the shards get its blocks' slices on first use", .alias = "loras"},
        {"lora-dir", 0, FU_OPT_PATH, FU_OPT_TO(c->lora_dir), "DIR",
         "allow POST /v1/load_lora_adapter for adapters within DIR (default: refused)"},
        {"max-lora-rank", 0, FU_OPT_INT, FU_OPT_TO(c->max_lora_rank), .help = "largest LoRA rank accepted",
         .def = "256", .lo = 1, .hi = 4096},
        {"max-loras", 0, FU_OPT_INT, FU_OPT_TO(c->max_loras), .help = "LoRA adapters loaded at once", .def = "8",
         .lo = 1, .hi = 1024},
        {"log-level", 0, FU_OPT_CALL, .fn = set_log_level, .arg = "debug|info|warn|error",
         .help = "log threshold (default: env FUSION_LOG, else info)", .flags = FU_OPT_NOFILE},
        FU_OPT_END,
    };
    _Static_assert(sizeof t <= sizeof(gw_options), "GW_N_OPTIONS is too small");
    gw_options o;
    memset(&o, 0, sizeof o);
    memcpy(o.t, t, sizeof t);
    return o;
}

/* ---- the interface ------------------------------------------------------------------------- */

void gw_config_init(gw_config *c) {
    memset(c, 0, sizeof *c);
    gw_limits_default(&c->limits);
    int rc = fu_opt_defaults(options(c).t);
    assert(rc == FU_OK); /* the table's defaults parse */
    (void)rc;
}

void gw_config_free(gw_config *c) {
    fu_opt_free(options(c).t);
    for (int i = 0; i < c->n_hops; i++) free(c->hops[i].address);
    for (int i = 0; i < c->n_shards; i++) free(c->shards[i]);
    for (int i = 0; i < c->n_api_keys; i++) free(c->api_keys[i]);
    for (int i = 0; i < c->n_admin_keys; i++) free(c->admin_keys[i]);
    for (int i = 0; i < c->n_links; i++) {
        free(c->links[i].from);
        free(c->links[i].to);
    }
    memset(c, 0, sizeof *c);
}

int gw_config_set(gw_config *c, const char *name, const char *value) {
    return fu_opt_set(options(c).t, name, value);
}

int gw_config_load(gw_config *c, const char *path) {
    return fu_opt_load(options(c).t, path);
}

/* The environment: FUSION_SECRET where no secret is given (a different one given by --secret,
 * --secret-file or the config file is an error naming both: neither silently wins),
 * FUSION_API_KEY_FILE and FUSION_API_KEY (comma-separated) add keys. */
static int config_env(gw_config *c) {
    const char *env = getenv("FUSION_SECRET");
    int rc = FU_OK;
    if (env && c->secret && strcmp(env, c->secret))
        return fu_errorf(FU_ERR_INVALID, "the swarm secret in FUSION_SECRET differs from the one given by --secret, "
                                         "--secret-file or the config file: keep one of them");
    if (env && !c->secret && (rc = gw_config_set(c, "secret", env))) return rc;
    if ((env = getenv("FUSION_API_KEY_FILE")) && (rc = load_keys(c, env))) return rc;
    char *copy = (env = getenv("FUSION_API_KEY")) ? strdup(env) : NULL;
    if (env && !copy) return fu_errorf(FU_ERR_NOMEM, "FUSION_API_KEY");
    for (char *k = copy; k && !rc;) {
        char *comma = strchr(k, ',');
        if (comma) *comma = '\0';
        rc = add_key(c, k);
        k = comma ? comma + 1 : NULL;
    }
    free(copy);
    return rc;
}

int gw_config_args(gw_config *c, int argc, char **argv) {
    gw_options o = options(c);
    const fu_opt_spec spec = {
        "fusion-gateway",
        "usage: fusion-gateway --model PATH|ORG/NAME (--hop HOST:PORT:FIRST:LAST ... | --shard HOST:PORT ... |\n"
        "                      --swarm-listen HOST:PORT) [options]",
        o.t, NULL};
    int status = fu_opt_main(&spec, argc, argv, NULL);
    if (status >= 0) return status;
    if (config_env(c)) {
        fprintf(stderr, "fusion-gateway: %s\n", fu_last_error());
        return 1;
    }
    return gw_config_check(c) ? fu_opt_fail(&spec, "%s", fu_last_error()) : -1;
}

int gw_config_check(const gw_config *c) {
    if (!c->model) return fu_errorf(FU_ERR_INVALID, "no model: give --model (path or repo id)");
    if (c->n_hops == 0 && c->n_shards == 0 && !c->swarm_listen)
        return fu_errorf(FU_ERR_INVALID, "no shards: give --hop HOST:PORT:FIRST:LAST (a chain), --shard HOST:PORT "
                                         "or --swarm-listen HOST:PORT (shards join)");
    if (c->n_hops && (c->n_shards || c->swarm_listen))
        return fu_errorf(FU_ERR_INVALID, "give either --hop (a static chain) or --shard / --swarm-listen");
    if (!!c->swarm_tls_cert != !!c->swarm_tls_key)
        return fu_errorf(FU_ERR_INVALID, "the swarm service needs both --swarm-tls-cert and --swarm-tls-key");
    if (c->swarm_listen && !c->swarm_tls_cert && !c->https_cert && !c->insecure)
        return fu_errorf(FU_ERR_INVALID, "--swarm-listen needs TLS (--swarm-tls-cert/--swarm-tls-key or the HTTPS "
                                         "pair) or --insecure on a loopback address");
    if (!!c->tls_client_cert != !!c->tls_client_key)
        return fu_errorf(FU_ERR_INVALID, "--tls-client-cert and --tls-client-key go together");
    if (c->swarm_tls_client_ca && (!c->swarm_listen || (!c->swarm_tls_cert && !c->https_cert)))
        return fu_errorf(FU_ERR_INVALID, "--swarm-tls-client-ca (mTLS) needs --swarm-listen with TLS "
                                         "(--swarm-tls-cert/--swarm-tls-key or the HTTPS pair)");
    if (c->heartbeat_timeout_ms <= c->heartbeat_ms)
        return fu_errorf(FU_ERR_INVALID, "--heartbeat-timeout-ms must exceed --heartbeat-ms");
    if (c->n_hops && c->hops[0].first != 0) return fu_errorf(FU_ERR_INVALID, "the first hop must start at block 0");
    for (int i = 1; i < c->n_hops; i++)
        if (c->hops[i].first != c->hops[i - 1].last)
            return fu_errorf(FU_ERR_INVALID, "hop %d starts at block %d, the previous ends at %d", i, c->hops[i].first,
                             c->hops[i - 1].last);
    if (!c->secret || !c->secret[0])
        return fu_errorf(FU_ERR_INVALID, "no swarm secret: --secret, --secret-file or FUSION_SECRET");
    if (strlen(c->secret) < GW_MIN_SECRET_BYTES)
        return fu_errorf(FU_ERR_INVALID, "the swarm secret is %zu bytes: at least %d are needed (e.g. openssl rand "
                         "-hex 16)", strlen(c->secret), GW_MIN_SECRET_BYTES);
    if (c->no_auth && c->n_api_keys)
        return fu_errorf(FU_ERR_INVALID, "give either API keys or --no-auth, not both");
    if (!!c->https_cert != !!c->https_key)
        return fu_errorf(FU_ERR_INVALID, "HTTPS needs both --https-cert and --https-key");
    return FU_OK;
}

int gw_channel_new(const gw_config *c, const char *address, rpc_channel **out) {
    rpc_channel_options co = {.tls_ca = c->tls_ca, .insecure = c->insecure, .secret = c->secret};
    gw_client_pair(c, &co.tls_client_cert, &co.tls_client_key);
    return rpc_channel_new(address, &co, out);
}

void gw_client_pair(const gw_config *c, const char **cert, const char **key) {
    if (c->tls_client_cert) {
        *cert = c->tls_client_cert;
        *key = c->tls_client_key;
    } else if (c->swarm_tls_cert) {
        *cert = c->swarm_tls_cert;
        *key = c->swarm_tls_key;
    } else {
        *cert = c->https_cert;
        *key = c->https_key;
    }
}
