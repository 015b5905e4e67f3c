/* rt-load.c -- loaders: Helix cluster/profile/placement INI files and capacity tables, and
 * fusion's own JSON cluster format (load and save). */
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

/* Reads a whole file (NUL-terminated, at most 64 MiB). *out malloc'ed. */
static int read_text(const char *path, char **out, size_t *len) {
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
            if (cap >= (64u << 20)) {
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

int rt__ini_load(rt_ini *ini, const char *path) {
    char *text;
    size_t len;
    int rc = read_text(path, &text, &len);
    if (rc) return rc;
    rc = rt__ini_parse(ini, text, len);
    free(text);
    if (rc) return fu_errorf(rc, "%s: %s", path, fu_last_error());
    return FU_OK;
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
    int rc = read_text(path, &text, NULL);
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

/* --- fusion's JSON format ----------------------------------------------------------------- */

static double jnum(json_t *o, const char *key, double dflt) {
    json_t *v = json_object_get(o, key);
    return json_is_number(v) ? json_number_value(v) : dflt;
}

static int jstr(json_t *o, const char *key, char *dst, size_t cap) {
    json_t *v = json_object_get(o, key);
    if (!v) return 0;
    if (!json_is_string(v) || strlen(json_string_value(v)) >= cap) return -1;
    snprintf(dst, cap, "%s", json_string_value(v));
    return 0;
}

/* Reads a number array into a fresh malloc'ed buffer. */
static int jarray(json_t *a, double **out, int *n) {
    *out = NULL;
    *n = 0;
    if (!json_is_array(a) || json_array_size(a) == 0 || json_array_size(a) > 100000) return -1;
    size_t m = json_array_size(a);
    double *v = malloc(m * sizeof(double));
    if (!v) return -1;
    for (size_t i = 0; i < m; i++) {
        json_t *x = json_array_get(a, i);
        if (!json_is_number(x) || !(json_number_value(x) >= 0) ||
            !isfinite(json_number_value(x))) {
            free(v);
            return -1;
        }
        v[i] = json_number_value(x);
    }
    *out = v;
    *n = (int)m;
    return 0;
}

static int endpoint_id(const rt_swarm *sw, json_t *v, int *id) {
    if (!json_is_string(v)) return -1;
    const char *s = json_string_value(v);
    if (!strcmp(s, "source")) *id = RT_SOURCE;
    else if (!strcmp(s, "sink")) *id = RT_SINK;
    else {
        for (int i = 0; i < sw->n_servers; i++)
            if (!strcmp(sw->servers[i].name, s)) {
                *id = i;
                return 0;
            }
        return -1;
    }
    return 0;
}

static int parse_json_root(rt_swarm *sw, json_t *root) {
    json_t *m = json_object_get(root, "model");
    if (!json_is_object(m)) return fu_errorf(FU_ERR_FORMAT, "cluster JSON: missing \"model\"");
    rt_model model;
    memset(&model, 0, sizeof model);
    if (jstr(m, "name", model.name, sizeof model.name))
        return fu_errorf(FU_ERR_FORMAT, "cluster JSON: bad model.name");
    json_t *nl = json_object_get(m, "n_layers");
    if (!json_is_integer(nl) || json_integer_value(nl) <= 0 || json_integer_value(nl) > 100000)
        return fu_errorf(FU_ERR_FORMAT, "cluster JSON: model.n_layers must be a positive integer");
    model.n_layers = (int)json_integer_value(nl);
    model.token_bytes = jnum(m, "token_bytes", 2);
    model.act_bytes = jnum(m, "activation_bytes", -1);
    model.layer_bytes = jnum(m, "layer_bytes", 0);
    model.kv_bytes_per_token_layer = jnum(m, "kv_bytes_per_token_layer", 0);
    model.weight_vram_fraction = jnum(m, "weight_vram_fraction", 0);
    if (!(model.token_bytes > 0) || !(model.act_bytes > 0) || !(model.layer_bytes >= 0) ||
        !(model.weight_vram_fraction >= 0) || model.weight_vram_fraction > 1)
        return fu_errorf(FU_ERR_FORMAT, "cluster JSON: model needs positive token_bytes and "
                         "activation_bytes, layer_bytes >= 0, weight_vram_fraction in [0, 1]");
    int rc = rt_swarm_init(sw, &model);
    if (rc) return rc;
    json_t *co = json_object_get(root, "coordinator");
    sw->source_nic_out = jnum(co, "nic_out", 0);
    sw->sink_nic_in = jnum(co, "nic_in", 0);
    json_t *servers = json_object_get(root, "servers");
    if (!json_is_array(servers)) return fu_errorf(FU_ERR_FORMAT, "cluster JSON: missing \"servers\"");
    size_t i;
    json_t *s;
    json_array_foreach(servers, i, s) {
        rt_server d;
        memset(&d, 0, sizeof d);
        if (!json_is_object(s) || jstr(s, "name", d.name, sizeof d.name) || !d.name[0] ||
            jstr(s, "address", d.address, sizeof d.address) ||
            jstr(s, "kind", d.kind, sizeof d.kind))
            return fu_errorf(FU_ERR_FORMAT, "cluster JSON: server %zu needs a name (and string "
                             "address/kind)", i);
        for (int j = 0; j < sw->n_servers; j++)
            if (!strcmp(sw->servers[j].name, d.name))
                return fu_errorf(FU_ERR_FORMAT, "cluster JSON: duplicate server %s", d.name);
        d.is_cpu = json_is_true(json_object_get(s, "cpu"));
        char st[16] = "active";
        if (jstr(s, "state", st, sizeof st) || (strcmp(st, "active") && strcmp(st, "spare")))
            return fu_errorf(FU_ERR_FORMAT, "server %s: state must be active or spare", d.name);
        d.state = strcmp(st, "spare") ? RT_SERVER_ACTIVE : RT_SERVER_SPARE;
        d.nic_in = jnum(s, "nic_in", 0);
        d.nic_out = jnum(s, "nic_out", 0);
        d.vram_bytes = jnum(s, "vram", 0);
        json_t *tbl = json_object_get(s, "tokens_per_s_by_layers");
        double *tp = NULL, *kv = NULL;
        int ntp = 0, nkv = 0;
        if (tbl) {
            if (jarray(tbl, &tp, &ntp))
                return fu_errorf(FU_ERR_FORMAT, "server %s: bad tokens_per_s_by_layers", d.name);
        } else {
            double per = jnum(s, "layer_tokens_per_s", -1);
            json_t *mx = json_object_get(s, "max_layers");
            if (!(per > 0) || !isfinite(per) || !json_is_integer(mx) ||
                json_integer_value(mx) <= 0 || json_integer_value(mx) > model.n_layers)
                return fu_errorf(FU_ERR_FORMAT, "server %s: needs tokens_per_s_by_layers or "
                                 "layer_tokens_per_s + max_layers", d.name);
            ntp = (int)json_integer_value(mx);
            tp = malloc((size_t)ntp * sizeof(double));
            if (!tp) return fu_errorf(FU_ERR_NOMEM, "out of memory");
            for (int k = 0; k < ntp; k++) tp[k] = per / (k + 1);
        }
        json_t *kvt = json_object_get(s, "kv_tokens_by_layers");
        if (kvt && (jarray(kvt, &kv, &nkv) || nkv != ntp)) {
            free(tp), free(kv);
            return fu_errorf(FU_ERR_FORMAT, "server %s: kv_tokens_by_layers must match the "
                             "throughput table", d.name);
        }
        d.n_tput = ntp;
        d.tput = tp;
        d.kv_tokens = kv;
        json_t *span = json_object_get(s, "span");
        if (span && !json_is_null(span)) {
            json_t *a = json_array_get(span, 0), *b = json_array_get(span, 1);
            if (!json_is_array(span) || json_array_size(span) != 2 || !json_is_integer(a) ||
                !json_is_integer(b) || json_integer_value(a) < 0 ||
                json_integer_value(b) > model.n_layers ||
                json_integer_value(a) > json_integer_value(b)) {
                free(tp), free(kv);
                return fu_errorf(FU_ERR_FORMAT, "server %s: span must be [first, last)", d.name);
            }
            d.first = (int)json_integer_value(a);
            d.last = (int)json_integer_value(b);
        }
        int id = rt_swarm_add_server(sw, &d);
        free(tp), free(kv);
        if (id < 0) return id;
    }
    json_t *dl = json_object_get(root, "default_link");
    if (dl) {
        double bw = jnum(dl, "bandwidth", -1), lat = jnum(dl, "latency", 0);
        if (!(bw > 0) || !(lat >= 0)) return fu_errorf(FU_ERR_FORMAT, "bad default_link");
        for (int a = 0; a < sw->n_servers; a++) {
            sw->from_source[a] = sw->to_sink[a] = (rt_link){bw, lat};
            for (int b = 0; b < sw->n_servers; b++)
                if (a != b) sw->links[(size_t)a * sw->cap + b] = (rt_link){bw, lat};
        }
    }
    json_t *links = json_object_get(root, "links");
    if (links && !json_is_array(links)) return fu_errorf(FU_ERR_FORMAT, "\"links\" must be a list");
    json_t *l;
    json_array_foreach(links, i, l) {
        int a, b;
        if (endpoint_id(sw, json_object_get(l, "from"), &a) ||
            endpoint_id(sw, json_object_get(l, "to"), &b))
            return fu_errorf(FU_ERR_FORMAT, "link %zu: unknown endpoint", i);
        double bw = jnum(l, "bandwidth", -1), lat = jnum(l, "latency", 0);
        if (!(bw >= 0) || !(lat >= 0)) return fu_errorf(FU_ERR_FORMAT, "link %zu: bad numbers", i);
        json_t *bi = json_object_get(l, "bidirectional");
        int both = !bi || json_is_true(bi);
        if ((rc = rt_swarm_set_link(sw, a, b, bw, lat)))
            return fu_errorf(rc, "link %zu: %s", i, fu_last_error());
        if (both && a >= 0 && b >= 0 && (rc = rt_swarm_set_link(sw, b, a, bw, lat))) return rc;
    }
    return FU_OK;
}

int rt_swarm_parse_json(rt_swarm *sw, const char *text, size_t len) {
    if (!sw || !text) return fu_errorf(FU_ERR_INVALID, "rt_swarm_parse_json: NULL argument");
    memset(sw, 0, sizeof *sw);
    json_error_t jerr;
    json_t *root = json_loadb(text, len, 0, &jerr);
    if (!root) return fu_errorf(FU_ERR_FORMAT, "cluster JSON: %s (line %d)", jerr.text, jerr.line);
    int rc = json_is_object(root) ? parse_json_root(sw, root)
                                  : fu_errorf(FU_ERR_FORMAT, "cluster JSON: not an object");
    json_decref(root);
    if (rc) rt_swarm_free(sw);
    return rc;
}

int rt_swarm_load_json(rt_swarm *sw, const char *path) {
    if (!sw || !path) return fu_errorf(FU_ERR_INVALID, "rt_swarm_load_json: NULL argument");
    memset(sw, 0, sizeof *sw);
    char *text;
    size_t len;
    int rc = read_text(path, &text, &len);
    if (rc) return rc;
    rc = rt_swarm_parse_json(sw, text, len);
    free(text);
    if (rc) return fu_errorf(rc, "%s: %s", path, fu_last_error());
    return FU_OK;
}

static json_t *link_json(const char *from, const char *to, rt_link l) {
    return json_pack("{s:s, s:s, s:f, s:f, s:b}", "from", from, "to", to, "bandwidth",
                     l.bandwidth, "latency", l.latency, "bidirectional", 0);
}

int rt_swarm_save_json(const rt_swarm *sw, const char *path) {
    if (!sw || !path) return fu_errorf(FU_ERR_INVALID, "rt_swarm_save_json: NULL argument");
    const rt_model *m = &sw->model;
    json_t *root = json_object(), *servers = json_array(), *links = json_array();
    int ok = root && servers && links;
    ok = ok && !json_object_set_new(root, "model",
                      json_pack("{s:s, s:i, s:f, s:f, s:f, s:f, s:f}", "name", m->name,
                                "n_layers", m->n_layers, "token_bytes", m->token_bytes,
                                "activation_bytes", m->act_bytes, "layer_bytes", m->layer_bytes,
                                "kv_bytes_per_token_layer", m->kv_bytes_per_token_layer,
                                "weight_vram_fraction", m->weight_vram_fraction));
    ok = ok && !json_object_set_new(root, "coordinator",
                      json_pack("{s:f, s:f}", "nic_out", sw->source_nic_out, "nic_in",
                                sw->sink_nic_in));
    for (int i = 0; ok && i < sw->n_servers; i++) {
        const rt_server *s = &sw->servers[i];
        if (s->state == RT_SERVER_GONE) continue;
        json_t *tp = json_array(), *kv = json_array();
        for (int k = 0; tp && kv && k < s->n_tput; k++) {
            json_array_append_new(tp, json_real(s->tput[k]));
            json_array_append_new(kv, json_real(s->kv_tokens ? s->kv_tokens[k] : 0));
        }
        json_t *o = json_pack("{s:s, s:s, s:s, s:b, s:s, s:f, s:f, s:f, s:o, s:o}", "name",
                              s->name, "address", s->address, "kind", s->kind, "cpu", s->is_cpu,
                              "state", s->state == RT_SERVER_SPARE ? "spare" : "active", "nic_in",
                              s->nic_in, "nic_out", s->nic_out, "vram", s->vram_bytes,
                              "tokens_per_s_by_layers", tp, "kv_tokens_by_layers", kv);
        if (o && s->last > s->first)
            json_object_set_new(o, "span", json_pack("[i, i]", s->first, s->last));
        ok = o && !json_array_append_new(servers, o);
    }
    for (int a = 0; ok && a < sw->n_servers; a++) {
        if (sw->servers[a].state == RT_SERVER_GONE) continue;
        const char *an = sw->servers[a].name;
        if (sw->from_source[a].bandwidth > 0)
            ok = ok && !json_array_append_new(links, link_json("source", an, sw->from_source[a]));
        if (sw->to_sink[a].bandwidth > 0)
            ok = ok && !json_array_append_new(links, link_json(an, "sink", sw->to_sink[a]));
        for (int b = 0; ok && b < sw->n_servers; b++) {
            rt_link l = sw->links[(size_t)a * sw->cap + b];
            if (l.bandwidth > 0 && sw->servers[b].state != RT_SERVER_GONE)
                ok = !json_array_append_new(links, link_json(an, sw->servers[b].name, l));
        }
    }
    int rc = FU_OK;
    if (!ok) rc = fu_errorf(FU_ERR_NOMEM, "cluster JSON: out of memory");
    else {
        json_object_set(root, "servers", servers);
        json_object_set(root, "links", links);
        if (json_dump_file(root, path, JSON_INDENT(1) | JSON_REAL_PRECISION(10)))
            rc = fu_errorf(FU_ERR_IO, "%s: cannot write", path);
    }
    json_decref(servers);
    json_decref(links);
    json_decref(root);
    return rc;
}
