/* gw-config.c -- the gateway's options: defaults, flags, a JSON config file, API key files. */
#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gw.h"
#include "status.h"

void gw_config_init(gw_config *c) {
    memset(c, 0, sizeof *c);
    c->workers = 32;
    c->max_queue = 64;
    c->max_body_bytes = 8u << 20;
    c->connection_timeout_s = 30;
    c->max_connections = 1024;
    c->default_max_tokens = 512;
    c->step_timeout_ms = 60000;
    c->spares = 1;
    c->min_gain_percent = 5;
    c->heartbeat_ms = 500;
    c->heartbeat_timeout_ms = 3000;
    c->route_wait_ms = 5000;
    c->measure_links = true;
    c->measure_interval_ms = 5000;
    c->rebalance_interval_ms = 30000;
    gw_limits_default(&c->limits);
}

void gw_config_free(gw_config *c) {
    free(c->model);
    free(c->model_name);
    free(c->listen);
    free(c->port_file);
    for (int i = 0; i < c->n_hops; i++) free(c->hops[i].address);
    for (int i = 0; i < c->n_shards; i++) free(c->shards[i]);
    free(c->secret);
    free(c->tls_ca);
    for (int i = 0; i < c->n_api_keys; i++) free(c->api_keys[i]);
    free(c->https_cert);
    free(c->https_key);
    free(c->swarm_listen);
    free(c->swarm_tls_cert);
    free(c->swarm_tls_key);
    free(c->swarm_port_file);
    for (int i = 0; i < c->n_links; i++) {
        free(c->links[i].from);
        free(c->links[i].to);
    }
    memset(c, 0, sizeof *c);
}

/* Replaces *dst with a copy of v, expanding a leading "~/" to $HOME. */
static int set_str(char **dst, const char *v) {
    char *s;
    const char *home = getenv("HOME");
    if (v[0] == '~' && v[1] == '/' && home) {
        size_t n = strlen(home) + strlen(v);
        s = malloc(n);
        if (s) snprintf(s, n, "%s%s", home, v + 1);
    } else {
        s = strdup(v);
    }
    if (!s) return fu_errorf(FU_ERR_NOMEM, "config");
    free(*dst);
    *dst = s;
    return FU_OK;
}

static int parse_long(const char *name, const char *v, long lo, long hi, long *out) {
    char *end;
    errno = 0;
    long x = strtol(v, &end, 10);
    if (errno || end == v || *end || x < lo || x > hi)
        return fu_errorf(FU_ERR_INVALID, "%s: expected an integer in [%ld, %ld], got '%s'", name, lo, hi, v);
    *out = x;
    return FU_OK;
}

static int parse_bool(const char *name, const char *v, bool *out) {
    if (!strcmp(v, "1") || !strcmp(v, "true") || !strcmp(v, "yes") || !strcmp(v, "on")) *out = true;
    else if (!strcmp(v, "0") || !strcmp(v, "false") || !strcmp(v, "no") || !strcmp(v, "off")) *out = false;
    else return fu_errorf(FU_ERR_INVALID, "%s: expected true or false, got '%s'", name, v);
    return FU_OK;
}

/* "HOST:PORT:FIRST:LAST" (the host may itself hold colons, e.g. "[::1]"). */
static int parse_hop(gw_config *c, const char *v) {
    if (c->n_hops == GW_MAX_HOPS) return fu_errorf(FU_ERR_INVALID, "hop: at most %d hops", GW_MAX_HOPS);
    const char *b = strrchr(v, ':');
    const char *a = b ? b - 1 : NULL;
    while (a && a > v && *a != ':') a--;
    if (!b || !a || a == v || *a != ':')
        return fu_errorf(FU_ERR_INVALID, "hop: expected HOST:PORT:FIRST:LAST, got '%s'", v);
    char num[32];
    long first = 0, last = 0;
    size_t fl = (size_t)(b - a - 1);
    if (fl == 0 || fl >= sizeof num) return fu_errorf(FU_ERR_INVALID, "hop '%s': bad first block", v);
    memcpy(num, a + 1, fl);
    num[fl] = '\0';
    if (parse_long("hop first block", num, 0, 1000000, &first) || parse_long("hop last block", b + 1, 1, 1000000, &last))
        return FU_ERR_INVALID;
    if (last <= first) return fu_errorf(FU_ERR_INVALID, "hop '%s': empty span", v);
    char *addr = strndup(v, (size_t)(a - v));
    if (!addr) return fu_errorf(FU_ERR_NOMEM, "config");
    c->hops[c->n_hops++] = (gw_hop_cfg){addr, (int)first, (int)last};
    return FU_OK;
}

/* A swarm member: "host:port" (its span comes from its Info). */
static int add_shard(gw_config *c, const char *v) {
    if (c->n_shards == GW_MAX_SHARDS) return fu_errorf(FU_ERR_INVALID, "shard: at most %d shards", GW_MAX_SHARDS);
    const char *colon = strrchr(v, ':');
    if (!colon || colon == v || !colon[1] || strlen(v) >= 128)
        return fu_errorf(FU_ERR_INVALID, "shard: expected HOST:PORT, got '%.200s'", v);
    long port;
    if (parse_long("shard port", colon + 1, 1, 65535, &port)) return FU_ERR_INVALID;
    char *a = strdup(v);
    if (!a) return fu_errorf(FU_ERR_NOMEM, "shard");
    c->shards[c->n_shards++] = a;
    return FU_OK;
}

/* "FROM,TO,BANDWIDTH,LATENCY": FROM/TO a member address or "gateway", bandwidth in bytes/s,
 * latency in seconds. */
static int add_link(gw_config *c, const char *v) {
    if (c->n_links == GW_MAX_LINKS) return fu_errorf(FU_ERR_INVALID, "link: at most %d links", GW_MAX_LINKS);
    char buf[400];
    if (strlen(v) >= sizeof buf) return fu_errorf(FU_ERR_INVALID, "link: too long");
    snprintf(buf, sizeof buf, "%s", v);
    char *parts[4];
    int n = 0;
    for (char *p = buf; n < 4; n++) {
        parts[n] = p;
        char *comma = strchr(p, ',');
        if (!comma) {
            n++;
            break;
        }
        *comma = '\0';
        p = comma + 1;
    }
    char *end1, *end2;
    double bw = n == 4 ? strtod(parts[2], &end1) : 0, lat = n == 4 ? strtod(parts[3], &end2) : 0;
    if (n != 4 || !parts[0][0] || !parts[1][0] || strlen(parts[0]) >= 128 || strlen(parts[1]) >= 128 ||
        end1 == parts[2] || *end1 || end2 == parts[3] || *end2 || !(bw > 0) || !(lat >= 0) || bw > 1e15 || lat > 60)
        return fu_errorf(FU_ERR_INVALID,
                         "link: expected FROM,TO,BANDWIDTH_BYTES_PER_S,LATENCY_S (FROM/TO: HOST:PORT or gateway), "
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

static int add_key(gw_config *c, const char *k) {
    if (!k[0]) return FU_OK;
    if (c->n_api_keys == GW_MAX_KEYS) return fu_errorf(FU_ERR_INVALID, "api-key: at most %d keys", GW_MAX_KEYS);
    if (!(c->api_keys[c->n_api_keys] = strdup(k))) return fu_errorf(FU_ERR_NOMEM, "config");
    c->n_api_keys++;
    return FU_OK;
}

static char *read_small_file(const char *path, size_t max) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    char *buf = malloc(max + 1);
    size_t n = buf ? fread(buf, 1, max, f) : 0;
    fclose(f);
    if (!buf) return NULL;
    buf[n] = '\0';
    return buf;
}

int gw_config_load_keys(gw_config *c, const char *path) {
    char *text = read_small_file(path, 1 << 20);
    if (!text) return fu_errorf(FU_ERR_IO, "api-key-file %s: %s", path, strerror(errno));
    int rc = FU_OK;
    for (char *line = text; line && !rc;) {
        char *nl = strchr(line, '\n');
        if (nl) *nl = '\0';
        size_t n = strlen(line);
        while (n && (line[n - 1] == '\r' || line[n - 1] == ' ' || line[n - 1] == '\t')) line[--n] = '\0';
        while (*line == ' ' || *line == '\t') line++;
        if (*line && *line != '#') rc = add_key(c, line);
        line = nl ? nl + 1 : NULL;
    }
    free(text);
    return rc;
}

int gw_config_set(gw_config *c, const char *name_in, const char *v) {
    char name[64];
    size_t i = 0;
    for (; name_in[i] && i + 1 < sizeof name; i++) name[i] = name_in[i] == '_' ? '-' : name_in[i];
    name[i] = '\0';
    long x;
    int rc;
    if (!strcmp(name, "model")) return set_str(&c->model, v);
    if (!strcmp(name, "model-name") || !strcmp(name, "served-model-name")) return set_str(&c->model_name, v);
    if (!strcmp(name, "listen")) return set_str(&c->listen, v);
    if (!strcmp(name, "port-file")) return set_str(&c->port_file, v);
    if (!strcmp(name, "hop") || !strcmp(name, "hops") || !strcmp(name, "chain")) return parse_hop(c, v);
    if (!strcmp(name, "shard") || !strcmp(name, "shards")) return add_shard(c, v);
    if (!strcmp(name, "secret")) return set_str(&c->secret, v);
    if (!strcmp(name, "secret-file")) {
        char *s = read_small_file(v, 4096);
        if (!s) return fu_errorf(FU_ERR_IO, "secret-file %s: %s", v, strerror(errno));
        size_t n = strlen(s);
        while (n && (s[n - 1] == '\n' || s[n - 1] == '\r' || s[n - 1] == ' ')) s[--n] = '\0';
        free(c->secret);
        c->secret = s;
        return FU_OK;
    }
    if (!strcmp(name, "tls-ca")) return set_str(&c->tls_ca, v);
    if (!strcmp(name, "insecure")) return parse_bool(name, v, &c->insecure);
    if (!strcmp(name, "forward")) return parse_bool(name, v, &c->forward);
    if (!strcmp(name, "api-key") || !strcmp(name, "api-keys")) return add_key(c, v);
    if (!strcmp(name, "api-key-file")) return gw_config_load_keys(c, v);
    if (!strcmp(name, "https-cert") || !strcmp(name, "tls-cert")) return set_str(&c->https_cert, v);
    if (!strcmp(name, "https-key") || !strcmp(name, "tls-key")) return set_str(&c->https_key, v);
    if (!strcmp(name, "swarm-listen")) return set_str(&c->swarm_listen, v);
    if (!strcmp(name, "swarm-tls-cert")) return set_str(&c->swarm_tls_cert, v);
    if (!strcmp(name, "swarm-tls-key")) return set_str(&c->swarm_tls_key, v);
    if (!strcmp(name, "swarm-port-file")) return set_str(&c->swarm_port_file, v);
    if (!strcmp(name, "measure-links")) return parse_bool(name, v, &c->measure_links);
    if (!strcmp(name, "link") || !strcmp(name, "links")) return add_link(c, v);
    struct {
        const char *name;
        int *dst;
        long lo, hi;
    } ints[] = {
        {"workers", &c->workers, 1, 4096},
        {"max-queue", &c->max_queue, 0, 1000000},
        {"connection-timeout-s", &c->connection_timeout_s, 1, 86400},
        {"max-connections", &c->max_connections, 1, 1000000},
        {"default-max-tokens", &c->default_max_tokens, 1, 1 << 24},
        {"step-timeout-ms", &c->step_timeout_ms, 1, 3600000},
        {"spares", &c->spares, 0, 1024},
        {"min-gain-percent", &c->min_gain_percent, 0, 1000},
        {"heartbeat-ms", &c->heartbeat_ms, 50, 60000},
        {"heartbeat-timeout-ms", &c->heartbeat_timeout_ms, 100, 600000},
        {"route-wait-ms", &c->route_wait_ms, 0, 600000},
        {"measure-interval-ms", &c->measure_interval_ms, 100, 3600000},
        {"rebalance-interval-ms", &c->rebalance_interval_ms, 0, 86400000},
        {"max-n", &c->limits.max_n, 1, 1024},
        {"max-choices", &c->limits.max_choices, 1, 4096},
        {"max-prompts", &c->limits.max_prompts, 1, 4096},
        {"max-stop", &c->limits.max_stop, 0, 1024},
        {"max-stop-bytes", &c->limits.max_stop_bytes, 1, 65536},
        {"max-logit-bias", &c->limits.max_logit_bias, 0, 300},
        {"max-top-logprobs", &c->limits.max_top_logprobs, 0, 64},
        {"max-messages", &c->limits.max_messages, 1, 1000000},
    };
    for (size_t k = 0; k < sizeof ints / sizeof ints[0]; k++)
        if (!strcmp(name, ints[k].name)) {
            if ((rc = parse_long(name, v, ints[k].lo, ints[k].hi, &x))) return rc;
            *ints[k].dst = (int)x;
            return FU_OK;
        }
    if (!strcmp(name, "max-body-bytes")) {
        if ((rc = parse_long(name, v, 1024, 1L << 30, &x))) return rc;
        c->max_body_bytes = (size_t)x;
        return FU_OK;
    }
    return fu_errorf(FU_ERR_INVALID, "unknown option '%s'", name_in);
}

/* Applies one JSON value (scalars as text; arrays element by element). */
static int gw_config_set_json(gw_config *c, const char *key, const json_t *val) {
    char buf[64];
    if (json_is_array(val)) {
        size_t i;
        json_t *e;
        json_array_foreach(val, i, e) {
            int rc = gw_config_set_json(c, key, e);
            if (rc) return rc;
        }
        return FU_OK;
    }
    if (json_is_string(val)) return gw_config_set(c, key, json_string_value(val));
    if (json_is_integer(val)) {
        snprintf(buf, sizeof buf, "%lld", (long long)json_integer_value(val));
        return gw_config_set(c, key, buf);
    }
    if (json_is_boolean(val)) return gw_config_set(c, key, json_is_true(val) ? "true" : "false");
    if (json_is_null(val)) return FU_OK;
    return fu_errorf(FU_ERR_INVALID, "config key '%s': unsupported value type", key);
}

int gw_config_load(gw_config *c, const char *path) {
    json_error_t err;
    json_t *root = json_load_file(path, JSON_REJECT_DUPLICATES, &err);
    if (!root) return fu_errorf(FU_ERR_FORMAT, "%s:%d: %s", path, err.line, err.text);
    if (!json_is_object(root)) {
        json_decref(root);
        return fu_errorf(FU_ERR_FORMAT, "%s: the config must be a JSON object", path);
    }
    const char *key;
    json_t *val;
    int rc = FU_OK;
    json_object_foreach(root, key, val) {
        if (key[0] == '_' || !strcmp(key, "comment")) continue; /* "_comment" keys document the file */
        if ((rc = gw_config_set_json(c, key, val))) break;
    }
    json_decref(root);
    if (rc) return fu_errorf(rc, "%s: %s", path, fu_last_error());
    return rc;
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
    if (c->heartbeat_timeout_ms <= c->heartbeat_ms)
        return fu_errorf(FU_ERR_INVALID, "--heartbeat-timeout-ms must exceed --heartbeat-ms");
    if (c->n_hops && c->hops[0].first != 0) return fu_errorf(FU_ERR_INVALID, "the first hop must start at block 0");
    for (int i = 1; i < c->n_hops; i++)
        if (c->hops[i].first != c->hops[i - 1].last)
            return fu_errorf(FU_ERR_INVALID, "hop %d starts at block %d, the previous ends at %d", i, c->hops[i].first,
                             c->hops[i - 1].last);
    if (!c->secret || !c->secret[0])
        return fu_errorf(FU_ERR_INVALID, "no swarm secret: --secret, --secret-file or FUSION_SECRET");
    if (!!c->https_cert != !!c->https_key)
        return fu_errorf(FU_ERR_INVALID, "HTTPS needs both --https-cert and --https-key");
    return FU_OK;
}
