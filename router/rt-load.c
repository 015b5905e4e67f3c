/* rt-load.c -- loaders: Helix cluster/profile/placement INI files and capacity tables, and
 * the text reader they share. fusion's own JSON format is in rt-json.c. */
#define _POSIX_C_SOURCE 200809L
#include <ctype.h>
#include <errno.h>
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "router-impl.h"
#include "status.h"

/* --- small text helpers ------------------------------------------------------------------- */

int rt__read_text(const char *path, char **out, size_t *len) {
    FILE *f = fopen(path, "rb");
    if (!f) return fu_errorf(FU_ERR_IO, "%s: %s", path, strerror(errno));
    size_t cap = 1 << 16, n = 0;
    char *buf = malloc(cap);
    if (!buf) {
        fclose(f);
        return fu_errorf(FU_ERR_NOMEM, "%s: out of memory", path);
    }
    for (;;) {
        if (n + 1 >= cap) {
            if (cap >= RT_MAX_FILE) {
                free(buf), fclose(f);
                return fu_errorf(FU_ERR_RANGE, "%s: file too large", path);
            }
            char *nb = realloc(buf, cap * 2);
            if (!nb) {
                free(buf), fclose(f);
                return fu_errorf(FU_ERR_NOMEM, "%s: out of memory", path);
            }
            buf = nb;
            cap *= 2;
        }
        size_t r = fread(buf + n, 1, cap - n - 1, f);
        n += r;
        if (r == 0) break;
    }
    int bad = ferror(f);
    fclose(f);
    if (bad) {
        free(buf);
        return fu_errorf(FU_ERR_IO, "%s: read error", path);
    }
    buf[n] = '\0';
    *out = buf;
    if (len) *len = n;
    return FU_OK;
}

static char *dup_range(const char *a, const char *b) {
    while (a < b && isspace((unsigned char)*a)) a++;
    while (b > a && isspace((unsigned char)b[-1])) b--;
    char *s = malloc((size_t)(b - a) + 1);
    if (!s) return NULL;
    memcpy(s, a, (size_t)(b - a));
    s[b - a] = '\0';
    return s;
}

/* --- INI ---------------------------------------------------------------------------------- */

void rt__ini_free(rt_ini *ini) {
    if (!ini) return;
    for (int i = 0; i < ini->n; i++) {
        free(ini->items[i].section);
        free(ini->items[i].key);
        free(ini->items[i].value);
    }
    free(ini->items);
    memset(ini, 0, sizeof *ini);
}

int rt__ini_parse(rt_ini *ini, const char *text, size_t len) {
    memset(ini, 0, sizeof *ini);
    char *section = dup_range("", "");
    if (!section) return fu_errorf(FU_ERR_NOMEM, "ini: out of memory");
    const char *p = text, *end = text + len;
    int lineno = 0;
    while (p < end) {
        const char *eol = memchr(p, '\n', (size_t)(end - p));
        if (!eol) eol = end;
        lineno++;
        const char *a = p;
        while (a < eol && isspace((unsigned char)*a)) a++;
        if (a < eol && *a != '#' && *a != ';') {
            if (*a == '[') {
                const char *c = memchr(a, ']', (size_t)(eol - a));
                if (!c) goto bad;
                free(section);
                section = dup_range(a + 1, c);
                if (!section) goto nomem;
            } else {
                const char *eq = memchr(a, '=', (size_t)(eol - a));
                if (!eq) goto bad;
                if (ini->n == ini->cap) {
                    int c = ini->cap ? ini->cap * 2 : 64;
                    rt_ini_item *it = realloc(ini->items, (size_t)c * sizeof *it);
                    if (!it) goto nomem;
                    ini->items = it;
                    ini->cap = c;
                }
                rt_ini_item *it = &ini->items[ini->n];
                it->section = strdup(section);
                it->key = dup_range(a, eq);
                it->value = dup_range(eq + 1, eol);
                if (!it->section || !it->key || !it->value) {
                    free(it->section), free(it->key), free(it->value);
                    goto nomem;
                }
                ini->n++;
            }
        }
        p = eol + 1;
    }
    free(section);
    return FU_OK;
bad:
    free(section);
    rt__ini_free(ini);
    return fu_errorf(FU_ERR_FORMAT, "ini: malformed line %d", lineno);
nomem:
    free(section);
    rt__ini_free(ini);
    return fu_errorf(FU_ERR_NOMEM, "ini: out of memory");
}

int rt__load_file(const char *path, rt__parse_fn parse, void *dst) {
    char *text;
    size_t len;
    int rc = rt__read_text(path, &text, &len);
    if (rc) return rc;
    rc = parse(dst, text, len);
    free(text);
    return rc ? fu_errorf(rc, "%s: %s", path, fu_last_error()) : FU_OK;
}

static int parse_ini(void *dst, const char *text, size_t len) {
    return rt__ini_parse(dst, text, len);
}

int rt__ini_load(rt_ini *ini, const char *path) {
    return rt__load_file(path, parse_ini, ini);
}

const char *rt__ini_get(const rt_ini *ini, const char *section, const char *key) {
    for (int i = ini->n - 1; i >= 0; i--)
        if (!strcmp(ini->items[i].section, section) && !strcmp(ini->items[i].key, key))
            return ini->items[i].value;
    return NULL;
}

int rt__eval_expr(const char *s, double *out) {
    static const struct {
        const char *name;
        double v;
    } units[] = {{"kbps", 1e3}, {"mbps", 1e6}, {"gbps", 1e9}, {"KB", 1e3},   {"MB", 1e6},
                 {"GB", 1e9},   {"Byte", 1},   {"MilliSec", 1e-3}, {"Sec", 1}};
    if (!s) return fu_errorf(FU_ERR_FORMAT, "missing numeric value");
    double v = 1;
    int factors = 0;
    const char *p = s;
    for (;;) {
        while (isspace((unsigned char)*p)) p++;
        if (isalpha((unsigned char)*p)) {
            const char *a = p;
            while (isalnum((unsigned char)*p) || *p == '_') p++;
            size_t n = (size_t)(p - a);
            int found = 0;
            for (size_t u = 0; u < sizeof units / sizeof units[0]; u++)
                if (strlen(units[u].name) == n && !strncmp(a, units[u].name, n)) {
                    v *= units[u].v;
                    found = 1;
                }
            if (!found) return fu_errorf(FU_ERR_FORMAT, "unknown unit in \"%s\"", s);
        } else {
            char *e;
            errno = 0;
            double x = strtod(p, &e);
            if (e == p || errno) return fu_errorf(FU_ERR_FORMAT, "bad number in \"%s\"", s);
            v *= x;
            p = e;
        }
        factors++;
        while (isspace((unsigned char)*p)) p++;
        if (*p == '*') {
            p++;
            continue;
        }
        if (*p) return fu_errorf(FU_ERR_FORMAT, "bad expression \"%s\"", s);
        break;
    }
    if (!factors || !isfinite(v)) return fu_errorf(FU_ERR_FORMAT, "bad expression \"%s\"", s);
    *out = v;
    return FU_OK;
}

int rt__parse_int_list(const char *s, int **out, int *n) {
    *out = NULL;
    *n = 0;
    if (!s) return fu_errorf(FU_ERR_FORMAT, "missing list");
    const char *p = s;
    while (isspace((unsigned char)*p)) p++;
    if (*p++ != '[') return fu_errorf(FU_ERR_FORMAT, "list must start with '[': \"%.40s\"", s);
    int cap = 16, cnt = 0;
    int *v = malloc((size_t)cap * sizeof(int));
    if (!v) return fu_errorf(FU_ERR_NOMEM, "out of memory");
    for (;;) {
        while (isspace((unsigned char)*p) || *p == ',') p++;
        if (*p == ']') break;
        if (!*p) goto bad;
        int x;
        if (*p == '\'' || *p == '"') {
            char q = *p++;
            const char *a = p;
            while (*p && *p != q) p++;
            if (!*p) goto bad;
            size_t len = (size_t)(p - a);
            p++;
            if (len == 6 && !strncmp(a, "source", 6)) x = RT_SOURCE;
            else if (len == 4 && !strncmp(a, "sink", 4)) x = RT_SINK;
            else goto bad;
        } else {
            char *e;
            errno = 0;
            long l = strtol(p, &e, 10);
            if (e == p || errno || l < 0 || l > 1000000000) goto bad;
            x = (int)l;
            p = e;
        }
        if (cnt == cap) {
            cap *= 2;
            int *nv = realloc(v, (size_t)cap * sizeof(int));
            if (!nv) {
                free(v);
                return fu_errorf(FU_ERR_NOMEM, "out of memory");
            }
            v = nv;
        }
        v[cnt++] = x;
    }
    *out = v;
    *n = cnt;
    return FU_OK;
bad:
    free(v);
    return fu_errorf(FU_ERR_FORMAT, "malformed list \"%.60s\"", s);
}

/* --- Helix model constants ---------------------------------------------------------------- */

int rt_helix_load_model(rt_model *model, const char *constants_json, const char *model_name) {
    if (!model || !constants_json || !model_name)
        return fu_errorf(FU_ERR_INVALID, "rt_helix_load_model: NULL argument");
    json_error_t jerr;
    json_t *root = json_load_file(constants_json, 0, &jerr);
    if (!root) return fu_errorf(FU_ERR_FORMAT, "%s: %s (line %d)", constants_json, jerr.text,
                                jerr.line);
    int rc = FU_OK;
    json_t *m = json_object_get(json_object_get(root, "models"), model_name);
    if (!json_is_object(m)) {
        rc = fu_errorf(FU_ERR_NOT_FOUND, "%s: no model \"%s\"", constants_json, model_name);
        goto out;
    }
    memset(model, 0, sizeof *model);
    snprintf(model->name, sizeof model->name, "%s", model_name);
    json_t *L = json_object_get(m, "num_layers"), *tok = json_object_get(m, "token_size_bytes"),
           *act = json_object_get(m, "activation_size_bytes"),
           *pb = json_object_get(m, "param_bytes_per_layer_expr");
    if (!json_is_integer(L) || !json_is_number(tok) || !json_is_number(act) ||
        !json_is_string(pb)) {
        rc = fu_errorf(FU_ERR_FORMAT, "%s: model %s lacks num_layers/token/activation/param "
                       "sizes", constants_json, model_name);
        goto out;
    }
    model->n_layers = (int)json_integer_value(L);
    model->token_bytes = json_number_value(tok);
    model->act_bytes = json_number_value(act);
    /* "[1.53 * GB] * 80": the bracketed expression is the per-layer size */
    const char *e = json_string_value(pb), *a = strchr(e, '['), *b = a ? strchr(a, ']') : NULL;
    char *inner = a && b ? dup_range(a + 1, b) : NULL;
    rc = inner ? rt__eval_expr(inner, &model->layer_bytes) : fu_errorf(FU_ERR_FORMAT,
                                                                       "bad param expr %s", e);
    free(inner);
    if (rc) goto out;
    json_t *hf = json_object_get(m, "hf_config_json");
    json_t *hid = json_object_get(hf, "hidden_size"), *nh = json_object_get(hf, "num_attention_heads"),
           *nkv = json_object_get(hf, "num_key_value_heads");
    if (json_is_integer(hid) && json_is_integer(nh) && json_integer_value(nh) > 0) {
        double head = (double)json_integer_value(hid) / (double)json_integer_value(nh);
        double kvh = json_is_integer(nkv) ? (double)json_integer_value(nkv)
                                          : (double)json_integer_value(nh);
        model->kv_bytes_per_token_layer = 2.0 * kvh * head * 2.0; /* K and V, fp16 */
    }
    model->weight_vram_fraction = 0.5; /* Helix: 2 * layers * layer_bytes <= VRAM */
    if (model->n_layers <= 0 || model->token_bytes <= 0 || model->act_bytes <= 0)
        rc = fu_errorf(FU_ERR_FORMAT, "%s: model %s has non-positive sizes", constants_json,
                       model_name);
out:
    json_decref(root);
    return rc;
}

/* --- Helix capacity table ----------------------------------------------------------------- */

/* Splits one CSV line (quotes allowed) into at most `max` fields, in place. */
static int csv_split(char *line, char **f, int max) {
    int n = 0;
    char *p = line;
    while (n < max) {
        if (*p == '"') {
            char *w = ++p;
            f[n++] = w;
            while (*p && !(*p == '"' && p[1] != '"')) {
                if (*p == '"') p++;
                *w++ = *p++;
            }
            if (*p == '"') p++;
            *w = '\0';
            if (*p == ',') p++;
            else if (*p) return -1;
            else break;
            if (!*p) break;
        } else {
            f[n++] = p;
            char *c = strchr(p, ',');
            if (!c) break;
            *c = '\0';
            p = c + 1;
        }
    }
    return n;
}

/* 1 if the composition field names the cluster mix `key` ("A100x4+L4x8+T4x12"). */
static int composition_matches(const char *field, const char *key) {
    size_t k = strlen(key);
    if (!strcmp(field, key)) return 1;
    if (!strncmp(field, key, k) && field[k] == ' ' && field[k + 1] == '(') return 1;
    const char *p = strchr(field, '(');
    return p && !strncmp(p + 1, key, k) && p[1 + k] == ')';
}

typedef struct type_table {
    char kind[32];
    int count;
    int n;
    double tput[256], kv[256];
} type_table;

static int load_capacity_csv(const char *path, const char *model, const char *key,
                             type_table *types, int n_types) {
    char *text;
    int rc = rt__read_text(path, &text, NULL);
    if (rc) return rc;
    int rows = 0;
    char *save = text;
    for (char *line = text; line && *line;) {
        char *nl = strchr(line, '\n');
        if (nl) *nl = '\0';
        size_t ll = strlen(line);
        if (ll && line[ll - 1] == '\r') line[ll - 1] = '\0';
        char *f[16];
        int nf = csv_split(line, f, 16);
        if (nf >= 8 && !strcmp(f[0], model) && composition_matches(f[1], key)) {
            char *e;
            long k = strtol(f[3], &e, 10);
            double tp = strtod(f[4], NULL), kv = strtod(f[7], NULL);
            if (*e || k < 1 || k > 256 || !(tp >= 0) || !(kv >= 0)) {
                free(save);
                return fu_errorf(FU_ERR_FORMAT, "%s: bad row for %s k=%s", path, f[2], f[3]);
            }
            for (int t = 0; t < n_types; t++) {
                if (strcmp(types[t].kind, f[2])) continue;
                types[t].tput[k - 1] = tp;
                types[t].kv[k - 1] = kv / (double)k; /* entries are token x layer */
                if (k > types[t].n) types[t].n = (int)k;
                rows++;
            }
        }
        line = nl ? nl + 1 : NULL;
    }
    free(save);
    for (int t = 0; t < n_types; t++) {
        if (types[t].n == 0)
            return fu_errorf(FU_ERR_NOT_FOUND, "%s: no rows for model %s, mix %s, type %s", path,
                             model, key, types[t].kind);
        for (int k = 0; k < types[t].n; k++)
            if (!(types[t].tput[k] > 0))
                return fu_errorf(FU_ERR_FORMAT, "%s: %s lacks k=%d", path, types[t].kind, k + 1);
    }
    return rows ? FU_OK : fu_errorf(FU_ERR_NOT_FOUND, "%s: no rows", path);
}

static int cmp_types(const void *a, const void *b) {
    return strcmp(((const type_table *)a)->kind, ((const type_table *)b)->kind);
}

/* Parses "Link-a-b" into endpoints (ints, RT_SOURCE, RT_SINK). */
static int parse_link_name(const char *s, int *a, int *b) {
    if (strncmp(s, "Link-", 5)) return -1;
    const char *p = s + 5;
    int v[2];
    for (int i = 0; i < 2; i++) {
        if (!strncmp(p, "source", 6)) v[i] = RT_SOURCE, p += 6;
        else if (!strncmp(p, "sink", 4)) v[i] = RT_SINK, p += 4;
        else {
            char *e;
            long l = strtol(p, &e, 10);
            if (e == p || l < 0 || l > 1000000) return -1;
            v[i] = (int)l;
            p = e;
        }
        if (i == 0 && *p++ != '-') return -1;
    }
    if (*p) return -1;
    *a = v[0];
    *b = v[1];
    return 0;
}

int rt_helix_load_cluster(rt_swarm *sw, const char *cluster_ini, const char *profiles_ini,
                          const char *capacity_csv) {
    if (!sw || !cluster_ini || !profiles_ini || !capacity_csv)
        return fu_errorf(FU_ERR_INVALID, "rt_helix_load_cluster: NULL argument");
    if (sw->n_servers) return fu_errorf(FU_ERR_INVALID, "rt_helix_load_cluster: swarm not empty");
    rt_ini ci, pi;
    int rc = rt__ini_load(&ci, cluster_ini);
    if (rc) return rc;
    if ((rc = rt__ini_load(&pi, profiles_ini))) {
        rt__ini_free(&ci);
        return rc;
    }
    type_table *types = NULL;
    int *kinds = NULL;
    const char *nstr = rt__ini_get(&ci, "NodeNames", "total_compute_nodes");
    char *e = NULL;
    long n = nstr ? strtol(nstr, &e, 10) : -1;
    if (!nstr || *e || n <= 0 || n > 4096) {
        rc = fu_errorf(FU_ERR_FORMAT, "%s: bad [NodeNames] total_compute_nodes", cluster_ini);
        goto out;
    }
    types = calloc((size_t)n, sizeof *types);
    kinds = calloc((size_t)n, sizeof *kinds);
    if (!types || !kinds) {
        rc = fu_errorf(FU_ERR_NOMEM, "out of memory");
        goto out;
    }
    int n_types = 0;
    for (int i = 0; i < n; i++) {
        char sec[64];
        snprintf(sec, sizeof sec, "ComputeNode-%d", i);
        const char *t = rt__ini_get(&ci, sec, "type");
        if (!t || !*t || strlen(t) >= sizeof types[0].kind) {
            rc = fu_errorf(FU_ERR_FORMAT, "%s: [%s] lacks a valid type", cluster_ini, sec);
            goto out;
        }
        int k = 0;
        while (k < n_types && strcmp(types[k].kind, t)) k++;
        if (k == n_types) snprintf(types[n_types++].kind, sizeof types[0].kind, "%s", t);
        types[k].count++;
    }
    qsort(types, (size_t)n_types, sizeof *types, cmp_types);
    char key[512] = "";
    size_t kl = 0;
    for (int t = 0; t < n_types && kl < sizeof key; t++)
        kl += (size_t)snprintf(key + kl, sizeof key - kl, "%s%sx%d", t ? "+" : "", types[t].kind,
                               types[t].count);
    if (kl >= sizeof key) {
        rc = fu_errorf(FU_ERR_RANGE, "%s: too many machine types", cluster_ini);
        goto out;
    }
    if ((rc = load_capacity_csv(capacity_csv, sw->model.name, key, types, n_types))) goto out;
    double v;
    const char *src_out = rt__ini_get(&pi, "SourceNode", "outbound_nic_speed");
    const char *snk_in = rt__ini_get(&pi, "SinkNode", "inbound_nic_speed");
    if (src_out && !rt__eval_expr(src_out, &v)) sw->source_nic_out = v;
    if (snk_in && !rt__eval_expr(snk_in, &v)) sw->sink_nic_in = v;
    for (int i = 0; i < n; i++) {
        char sec[64];
        snprintf(sec, sizeof sec, "ComputeNode-%d", i);
        const char *t = rt__ini_get(&ci, sec, "type");
        int k = 0;
        while (strcmp(types[k].kind, t)) k++;
        rt_server d;
        memset(&d, 0, sizeof d);
        snprintf(d.name, sizeof d.name, "%s", sec);
        snprintf(d.kind, sizeof d.kind, "%s", t);
        d.state = RT_SERVER_ACTIVE;
        double nin, nout, vram;
        if (rt__eval_expr(rt__ini_get(&pi, t, "inbound_nic_speed"), &nin) ||
            rt__eval_expr(rt__ini_get(&pi, t, "outbound_nic_speed"), &nout) ||
            rt__eval_expr(rt__ini_get(&pi, t, "vram_size"), &vram)) {
            rc = fu_errorf(FU_ERR_FORMAT, "%s: machine type %s: %s", profiles_ini, t,
                           fu_last_error());
            goto out;
        }
        d.nic_in = nin;
        d.nic_out = nout;
        d.vram_bytes = vram;
        d.n_tput = types[k].n;
        d.tput = types[k].tput;
        d.kv_tokens = types[k].kv;
        int id = rt_swarm_add_server(sw, &d);
        if (id < 0) {
            rc = id;
            goto out;
        }
    }
    for (int it = 0; it < ci.n; it++) {
        int a, b;
        if (parse_link_name(ci.items[it].section, &a, &b)) continue;
        if (strcmp(ci.items[it].key, "bandwidth")) continue;
        double bw, lat;
        if (rt__eval_expr(ci.items[it].value, &bw) ||
            rt__eval_expr(rt__ini_get(&ci, ci.items[it].section, "latency"), &lat)) {
            rc = fu_errorf(FU_ERR_FORMAT, "%s: [%s]: %s", cluster_ini, ci.items[it].section,
                           fu_last_error());
            goto out;
        }
        if ((a >= n) || (b >= n) || a == RT_SINK || b == RT_SOURCE || a == b) {
            rc = fu_errorf(FU_ERR_FORMAT, "%s: bad link [%s]", cluster_ini, ci.items[it].section);
            goto out;
        }
        if (a == RT_SOURCE) rc = rt_swarm_set_link(sw, RT_SOURCE, b, bw, lat);
        else if (b == RT_SINK) rc = rt_swarm_set_link(sw, a, RT_SINK, bw, lat);
        else {
            rc = rt_swarm_set_link(sw, a, b, bw, lat);
            if (!rc) rc = rt_swarm_set_link(sw, b, a, bw, lat);
        }
        if (rc) goto out;
    }
    rc = FU_OK;
out:
    free(types);
    free(kinds);
    rt__ini_free(&ci);
    rt__ini_free(&pi);
    return rc;
}

const char *rt__helix_path(char *buf, size_t cap, const rt_helix_files *f, const char *given, const char *rel) {
    if (given) return given;
    snprintf(buf, cap, "%s/%s", f->dir, rel);
    return buf;
}

int rt_helix_load_swarm(rt_swarm *sw, const rt_helix_files *f, const char *cluster_ini) {
    if (!sw || !f || !f->dir || !f->model || !cluster_ini)
        return fu_errorf(FU_ERR_INVALID, "rt_helix_load_swarm: NULL argument");
    char a[4096], b[4096], c[4096];
    memset(sw, 0, sizeof *sw);
    rt_model m;
    int rc = rt_helix_load_model(&m, rt__helix_path(a, sizeof a, f, f->constants_json, "derived/model_constants.json"),
                                 f->model);
    if (!rc) rc = rt_swarm_init(sw, &m);
    if (!rc)
        rc = rt_helix_load_cluster(
            sw, cluster_ini,
            rt__helix_path(b, sizeof b, f, f->profiles_ini, "simulator/model_manager/google_machine_profiles.ini"),
            rt__helix_path(c, sizeof c, f, f->capacity_csv, "derived/node_capacity_by_layers.csv"));
    if (rc) {
        rt_swarm_free(sw);
        memset(sw, 0, sizeof *sw);
    }
    return rc;
}

int rt_helix_load_placement(rt_swarm *sw, const char *sol_ini) {
    if (!sw || !sol_ini) return fu_errorf(FU_ERR_INVALID, "rt_helix_load_placement: NULL argument");
    rt_ini ini;
    int rc = rt__ini_load(&ini, sol_ini);
    if (rc) return rc;
    long offset = 2;
    const char *os = rt__ini_get(&ini, "Settings", "offset");
    if (os) {
        char *e;
        offset = strtol(os, &e, 10);
        if (*e || offset < 0 || offset > 1000) {
            rt__ini_free(&ini);
            return fu_errorf(FU_ERR_FORMAT, "%s: bad offset", sol_ini);
        }
    }
    for (int i = 0; i < sw->n_servers; i++) sw->servers[i].first = sw->servers[i].last = 0;
    for (int it = 0; it < ini.n && !rc; it++) {
        if (strcmp(ini.items[it].section, "Solution")) continue;
        const char *k = ini.items[it].key;
        char *e;
        if (strncmp(k, "compute_node_", 13)) continue;
        long uid = strtol(k + 13, &e, 10);
        long id = uid - offset;
        if (*e || id < 0 || id >= sw->n_servers) {
            rc = fu_errorf(FU_ERR_FORMAT, "%s: %s names no server of the cluster", sol_ini, k);
            break;
        }
        int *layers, nl;
        if ((rc = rt__parse_int_list(ini.items[it].value, &layers, &nl))) break;
        for (int j = 1; j < nl && !rc; j++)
            if (layers[j] != layers[j - 1] + 1)
                rc = fu_errorf(FU_ERR_FORMAT, "%s: %s: layers not contiguous", sol_ini, k);
        if (!rc && nl > 0) {
            if (layers[0] < 0) rc = fu_errorf(FU_ERR_FORMAT, "%s: %s: bad layer", sol_ini, k);
            else rc = rt_swarm_set_span(sw, (int)id, layers[0], layers[0] + nl);
        }
        free(layers);
    }
    rt__ini_free(&ini);
    return rc;
}
