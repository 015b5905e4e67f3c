/* rt-json.c -- fusion's JSON cluster format: parsing (profiles per kind, compact or object
 * links, a swarm-wide default link) and a streaming, atomic writer. Single-threaded; the swarm
 * it fills is the caller's. */
#define _POSIX_C_SOURCE 200809L
#include <errno.h>
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "router-impl.h"
#include "status.h"

/* --- server names ---------------------------------------------------------------------------- */

/* Server ids by name: open addressing over FNV-1a hashes (names are unique in a file). */
typedef struct name_ix {
    int *slot; /* [cap] id + 1, 0 empty */
    size_t cap;
} name_ix;

static uint64_t fnv(const void *p, size_t n, uint64_t h) {
    const unsigned char *b = p;
    for (size_t i = 0; i < n; i++) h = (h ^ b[i]) * 0x100000001b3ULL;
    return h;
}

static size_t name_pos(const name_ix *ix, const char *name) {
    return (size_t)fnv(name, strlen(name), 0xcbf29ce484222325ULL) & (ix->cap - 1);
}

/* The id of `name`, or -1. */
static int name_get(const name_ix *ix, const rt_swarm *sw, const char *name) {
    if (!ix->cap) return -1;
    for (size_t p = name_pos(ix, name); ix->slot[p]; p = (p + 1) & (ix->cap - 1))
        if (!strcmp(sw->servers[ix->slot[p] - 1].name, name)) return ix->slot[p] - 1;
    return -1;
}

/* Records id under its name; the table holds at most half its slots. */
static int name_put(name_ix *ix, const rt_swarm *sw, int id) {
    if ((size_t)(id + 1) * 2 > ix->cap) {
        size_t cap = ix->cap ? ix->cap * 2 : 64;
        while ((size_t)(id + 1) * 2 > cap) cap *= 2;
        int *old = ix->slot;
        size_t ocap = ix->cap;
        if (!(ix->slot = calloc(cap, sizeof(int)))) {
            ix->slot = old;
            return fu_errorf(FU_ERR_NOMEM, "cluster JSON: out of memory");
        }
        ix->cap = cap;
        for (size_t i = 0; i < ocap; i++)
            if (old[i]) name_put(ix, sw, old[i] - 1);
        free(old);
    }
    size_t p = name_pos(ix, sw->servers[id].name);
    while (ix->slot[p]) p = (p + 1) & (ix->cap - 1);
    ix->slot[p] = id + 1;
    return FU_OK;
}

/* --- reading ---------------------------------------------------------------------------------- */

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
        if (!json_is_number(x) || !(json_number_value(x) >= 0) || !isfinite(json_number_value(x))) {
            free(v);
            return -1;
        }
        v[i] = json_number_value(x);
    }
    *out = v;
    *n = (int)m;
    return 0;
}

static int parse_model(json_t *root, rt_model *model) {
    json_t *m = json_object_get(root, "model");
    if (!json_is_object(m)) return fu_errorf(FU_ERR_FORMAT, "cluster JSON: missing \"model\"");
    memset(model, 0, sizeof *model);
    if (jstr(m, "name", model->name, sizeof model->name))
        return fu_errorf(FU_ERR_FORMAT, "cluster JSON: bad model.name");
    json_t *nl = json_object_get(m, "n_layers");
    if (!json_is_integer(nl) || json_integer_value(nl) <= 0 || json_integer_value(nl) > 100000)
        return fu_errorf(FU_ERR_FORMAT, "cluster JSON: model.n_layers must be a positive integer");
    model->n_layers = (int)json_integer_value(nl);
    model->token_bytes = jnum(m, "token_bytes", 2);
    model->act_bytes = jnum(m, "activation_bytes", -1);
    model->layer_bytes = jnum(m, "layer_bytes", 0);
    model->kv_bytes_per_token_layer = jnum(m, "kv_bytes_per_token_layer", 0);
    model->weight_vram_fraction = jnum(m, "weight_vram_fraction", 0);
    if (!(model->token_bytes > 0) || !(model->act_bytes > 0) || !(model->layer_bytes >= 0) ||
        !(model->weight_vram_fraction >= 0) || model->weight_vram_fraction > 1)
        return fu_errorf(FU_ERR_FORMAT, "cluster JSON: model needs positive token_bytes and "
                         "activation_bytes, layer_bytes >= 0, weight_vram_fraction in [0, 1]");
    return FU_OK;
}

/* The server's tables: its own, or its profile's ("kinds"), or layer_tokens_per_s. */
static int parse_tables(json_t *s, json_t *prof, const rt_swarm *sw, rt_server *d) {
    json_t *tbl = json_object_get(s, "tokens_per_s_by_layers"), *kvt = json_object_get(s, "kv_tokens_by_layers");
    if (!tbl && prof) tbl = json_object_get(prof, "tokens_per_s_by_layers");
    if (!kvt && prof) kvt = json_object_get(prof, "kv_tokens_by_layers");
    double *kv = NULL;
    int nkv = 0;
    if (tbl) {
        if (jarray(tbl, &d->tput, &d->n_tput))
            return fu_errorf(FU_ERR_FORMAT, "server %s: bad tokens_per_s_by_layers", d->name);
    } else {
        double per = jnum(s, "layer_tokens_per_s", -1);
        json_t *mx = json_object_get(s, "max_layers");
        if (!(per > 0) || !isfinite(per) || !json_is_integer(mx) || json_integer_value(mx) <= 0 ||
            json_integer_value(mx) > sw->model.n_layers)
            return fu_errorf(FU_ERR_FORMAT, "server %s: needs tokens_per_s_by_layers or "
                             "layer_tokens_per_s + max_layers", d->name);
        d->n_tput = (int)json_integer_value(mx);
        if (!(d->tput = malloc((size_t)d->n_tput * sizeof(double))))
            return fu_errorf(FU_ERR_NOMEM, "out of memory");
        for (int k = 0; k < d->n_tput; k++) d->tput[k] = per / (k + 1);
    }
    if (kvt && (jarray(kvt, &kv, &nkv) || nkv != d->n_tput)) {
        free(kv);
        return fu_errorf(FU_ERR_FORMAT, "server %s: kv_tokens_by_layers must match the throughput table",
                         d->name);
    }
    d->kv_tokens = kv;
    return FU_OK;
}

static int parse_span(json_t *s, const rt_swarm *sw, rt_server *d) {
    json_t *span = json_object_get(s, "span");
    if (!span || json_is_null(span)) return FU_OK;
    json_t *a = json_array_get(span, 0), *b = json_array_get(span, 1);
    if (!json_is_array(span) || json_array_size(span) != 2 || !json_is_integer(a) || !json_is_integer(b) ||
        json_integer_value(a) < 0 || json_integer_value(b) > sw->model.n_layers ||
        json_integer_value(a) > json_integer_value(b))
        return fu_errorf(FU_ERR_FORMAT, "server %s: span must be [first, last)", d->name);
    d->first = (int)json_integer_value(a);
    d->last = (int)json_integer_value(b);
    return FU_OK;
}

/* A number from the server, else from its profile, else dflt. */
static double pnum(json_t *s, json_t *prof, const char *key, double dflt) {
    return jnum(s, key, prof ? jnum(prof, key, dflt) : dflt);
}

/* Fills d (its tables malloc'ed) from server object s, i-th in the file. */
static int parse_server(rt_swarm *sw, json_t *kinds, json_t *s, size_t i, rt_server *d) {
    memset(d, 0, sizeof *d);
    if (!json_is_object(s) || jstr(s, "name", d->name, sizeof d->name) || !d->name[0] ||
        jstr(s, "address", d->address, sizeof d->address) || jstr(s, "kind", d->kind, sizeof d->kind))
        return fu_errorf(FU_ERR_FORMAT, "cluster JSON: server %zu needs a name (and string address/kind)", i);
    char pname[64];
    snprintf(pname, sizeof pname, "%s", d->kind);
    if (jstr(s, "profile", pname, sizeof pname))
        return fu_errorf(FU_ERR_FORMAT, "server %s: bad profile", d->name);
    json_t *prof = pname[0] ? json_object_get(kinds, pname) : NULL;
    if (prof && !json_is_object(prof)) return fu_errorf(FU_ERR_FORMAT, "kinds.%s must be an object", pname);
    json_t *cpu = json_object_get(s, "cpu");
    d->is_cpu = json_is_true(cpu ? cpu : json_object_get(prof, "cpu"));
    char st[16] = "active";
    if (jstr(s, "state", st, sizeof st) || (strcmp(st, "active") && strcmp(st, "spare")))
        return fu_errorf(FU_ERR_FORMAT, "server %s: state must be active or spare", d->name);
    d->state = strcmp(st, "spare") ? RT_SERVER_ACTIVE : RT_SERVER_SPARE;
    d->nic_in = pnum(s, prof, "nic_in", 0);
    d->nic_out = pnum(s, prof, "nic_out", 0);
    d->vram_bytes = pnum(s, prof, "vram", 0);
    int rc = parse_tables(s, prof, sw, d);
    if (!rc && (rc = parse_span(s, sw, d))) free(d->tput), free(d->kv_tokens);
    return rc;
}

static int parse_servers(rt_swarm *sw, json_t *root, name_ix *ix) {
    json_t *servers = json_object_get(root, "servers"), *kinds = json_object_get(root, "kinds");
    if (!json_is_array(servers)) return fu_errorf(FU_ERR_FORMAT, "cluster JSON: missing \"servers\"");
    if (kinds && !json_is_object(kinds)) return fu_errorf(FU_ERR_FORMAT, "cluster JSON: \"kinds\" must be an object");
    size_t i;
    json_t *s;
    json_array_foreach(servers, i, s) {
        rt_server d;
        int rc = parse_server(sw, kinds, s, i, &d);
        if (rc) return rc;
        if (name_get(ix, sw, d.name) >= 0) rc = fu_errorf(FU_ERR_FORMAT, "cluster JSON: duplicate server %s", d.name);
        int id = rc ? rc : rt_swarm_add_server(sw, &d);
        free(d.tput), free(d.kv_tokens);
        if (id < 0) return id;
        if ((rc = name_put(ix, sw, id))) return rc;
    }
    return FU_OK;
}

static int endpoint_id(const rt_swarm *sw, const name_ix *ix, json_t *v, int *id) {
    if (json_is_integer(v)) { /* compact form: index into "servers", -1 source, -2 sink */
        json_int_t x = json_integer_value(v);
        if (x < RT_SINK || x >= sw->n_servers) return -1;
        *id = (int)x;
        return 0;
    }
    if (!json_is_string(v)) return -1;
    const char *s = json_string_value(v);
    if (!strcmp(s, "source")) *id = RT_SOURCE;
    else if (!strcmp(s, "sink")) *id = RT_SINK;
    else if ((*id = name_get(ix, sw, s)) < 0) return -1;
    return 0;
}

/* One entry of "links": {"from", "to", "bandwidth", "latency", "bidirectional"} or the compact
 * directed [from_index, to_index, bandwidth, latency]. */
static int parse_link(rt_swarm *sw, const name_ix *ix, json_t *l, size_t i) {
    int a, b, both;
    double bw, lat;
    if (json_is_array(l)) {
        if (json_array_size(l) != 4 || endpoint_id(sw, ix, json_array_get(l, 0), &a) ||
            endpoint_id(sw, ix, json_array_get(l, 1), &b))
            return fu_errorf(FU_ERR_FORMAT, "link %zu: must be [from, to, bandwidth, latency] of known servers", i);
        json_t *x = json_array_get(l, 2), *y = json_array_get(l, 3);
        bw = json_is_number(x) ? json_number_value(x) : -1;
        lat = json_is_number(y) ? json_number_value(y) : -1;
        both = 0;
    } else {
        if (endpoint_id(sw, ix, json_object_get(l, "from"), &a) || endpoint_id(sw, ix, json_object_get(l, "to"), &b))
            return fu_errorf(FU_ERR_FORMAT, "link %zu: unknown endpoint", i);
        bw = jnum(l, "bandwidth", -1), lat = jnum(l, "latency", 0);
        json_t *bi = json_object_get(l, "bidirectional");
        both = !bi || json_is_true(bi);
    }
    if (!(bw >= 0) || !(lat >= 0)) return fu_errorf(FU_ERR_FORMAT, "link %zu: bad numbers", i);
    int rc = rt_swarm_set_link(sw, a, b, bw, lat);
    if (rc) return fu_errorf(rc, "link %zu: %s", i, fu_last_error());
    if (both && a >= 0 && b >= 0 && (rc = rt_swarm_set_link(sw, b, a, bw, lat))) return rc;
    return FU_OK;
}

static int parse_links(rt_swarm *sw, json_t *root, const name_ix *ix) {
    json_t *dl = json_object_get(root, "default_link");
    if (dl) {
        double bw = jnum(dl, "bandwidth", -1), lat = jnum(dl, "latency", 0);
        if (!(bw > 0) || !(lat >= 0) || !isfinite(bw) || !isfinite(lat))
            return fu_errorf(FU_ERR_FORMAT, "bad default_link");
        sw->default_link = (rt_link){bw, lat}; /* every pair of the file's servers, not stored */
        json_t *servers = json_object_get(root, "servers");
        for (int a = 0; a < sw->n_servers; a++) {
            json_t *own = json_object_get(json_array_get(servers, (size_t)a), "default_link");
            sw->on_default[a] = !json_is_false(own); /* false: a server that joined later */
            sw->from_source[a] = sw->to_sink[a] = (rt_link){bw, lat};
        }
    }
    json_t *links = json_object_get(root, "links"), *l;
    if (links && !json_is_array(links)) return fu_errorf(FU_ERR_FORMAT, "\"links\" must be a list");
    size_t i;
    json_array_foreach(links, i, l) {
        int rc = parse_link(sw, ix, l, i);
        if (rc) return rc;
    }
    return FU_OK;
}

/* Fills the uninitialised sw from root; top-level keys it does not know are ignored. */
static int parse_json_root(rt_swarm *sw, json_t *root) {
    rt_model model;
    int rc = parse_model(root, &model);
    if (rc || (rc = rt_swarm_init(sw, &model))) return rc;
    json_t *co = json_object_get(root, "coordinator");
    sw->source_nic_out = jnum(co, "nic_out", 0);
    sw->sink_nic_in = jnum(co, "nic_in", 0);
    name_ix ix = {NULL, 0};
    rc = parse_servers(sw, root, &ix);
    if (!rc) rc = parse_links(sw, root, &ix);
    free(ix.slot);
    return rc;
}

int rt_swarm_parse_json(rt_swarm *sw, const char *text, size_t len) {
    if (!sw || !text) return fu_errorf(FU_ERR_INVALID, "rt_swarm_parse_json: NULL argument");
    memset(sw, 0, sizeof *sw);
    json_error_t jerr;
    json_t *root = json_loadb(text, len, 0, &jerr);
    if (!root) return fu_errorf(FU_ERR_FORMAT, "cluster JSON: %s (line %d)", jerr.text, jerr.line);
    int rc = json_is_object(root) ? parse_json_root(sw, root) : fu_errorf(FU_ERR_FORMAT, "cluster JSON: not an object");
    json_decref(root);
    if (rc) rt_swarm_free(sw);
    return rc;
}

static int parse_swarm(void *dst, const char *text, size_t len) {
    return rt_swarm_parse_json(dst, text, len);
}

int rt_swarm_load_json(rt_swarm *sw, const char *path) {
    if (!sw || !path) return fu_errorf(FU_ERR_INVALID, "rt_swarm_load_json: NULL argument");
    memset(sw, 0, sizeof *sw);
    return rt__load_file(path, parse_swarm, sw);
}

/* --- writing ---------------------------------------------------------------------------------- */

/* A JSON string literal. */
static void put_str(FILE *f, const char *s) {
    fputc('"', f);
    for (const unsigned char *p = (const unsigned char *)s; *p; p++) {
        if (*p == '"' || *p == '\\') fprintf(f, "\\%c", *p);
        else if (*p < 0x20) fprintf(f, "\\u%04x", *p);
        else fputc(*p, f);
    }
    fputc('"', f);
}

/* A number that reads back exactly (non-finite values, which JSON lacks, as 0). */
static void put_num(FILE *f, double v) { fprintf(f, "%.17g", isfinite(v) ? v : 0.0); }

static void put_table(FILE *f, const char *key, const double *v, int n) {
    fprintf(f, ",\"%s\":[", key);
    for (int k = 0; k < n; k++) {
        if (k) fputc(',', f);
        put_num(f, v ? v[k] : 0);
    }
    fputc(']', f);
}

/* Servers sharing a profile (kind, tables, VRAM, NICs, cpu) share one "kinds" entry. */
typedef struct prof_ix {
    int *rep;        /* [cap] server id + 1 of each bucket's profile, 0 empty */
    int *prof_of;    /* [n_servers] profile number of each server */
    int *name_no;    /* [n_servers] per-kind ordinal of the profile (0: the kind's name) */
    int *krep;       /* [cap] server id + 1 of the first server of each kind, 0 empty */
    int *kcount;     /* [n_servers] profiles seen so far of the kind whose first server this is */
    size_t cap;
    int n_prof;
} prof_ix;

static int same_profile(const rt_server *a, const rt_server *b) {
    if (strcmp(a->kind, b->kind) || a->n_tput != b->n_tput || a->is_cpu != b->is_cpu || a->vram_bytes != b->vram_bytes ||
        a->nic_in != b->nic_in || a->nic_out != b->nic_out)
        return 0;
    for (int k = 0; k < a->n_tput; k++)
        if (a->tput[k] != b->tput[k] || (a->kv_tokens ? a->kv_tokens[k] : 0) != (b->kv_tokens ? b->kv_tokens[k] : 0))
            return 0;
    return 1;
}

static uint64_t profile_hash(const rt_server *s) {
    uint64_t h = fnv(s->kind, strlen(s->kind), 0xcbf29ce484222325ULL);
    h = fnv(&s->n_tput, sizeof s->n_tput, h);
    for (int k = 0; k < s->n_tput; k++) h = fnv(&s->tput[k], sizeof(double), h);
    return h;
}

/* How many profiles of server i's kind came before its (a table of kinds by name). */
static int kind_ordinal(const rt_swarm *sw, prof_ix *px, int i) {
    const char *k = sw->servers[i].kind;
    size_t p = (size_t)fnv(k, strlen(k), 0xcbf29ce484222325ULL) & (px->cap - 1);
    while (px->krep[p] && strcmp(sw->servers[px->krep[p] - 1].kind, k)) p = (p + 1) & (px->cap - 1);
    if (!px->krep[p]) px->krep[p] = i + 1;
    return px->kcount[px->krep[p] - 1]++;
}

/* Groups the live servers of sw by profile. */
static int profiles_index(const rt_swarm *sw, prof_ix *px) {
    int n = sw->n_servers;
    px->cap = 64;
    while (px->cap < (size_t)n * 2 + 2) px->cap *= 2;
    px->rep = calloc(px->cap, sizeof(int));
    px->prof_of = calloc((size_t)n + 1, sizeof(int));
    px->name_no = calloc((size_t)n + 1, sizeof(int));
    px->krep = calloc(px->cap, sizeof(int));
    px->kcount = calloc((size_t)n + 1, sizeof(int));
    if (!px->rep || !px->prof_of || !px->name_no || !px->krep || !px->kcount) return fu_errorf(FU_ERR_NOMEM, "cluster JSON: out of memory");
    for (int i = 0; i < n; i++) {
        const rt_server *s = &sw->servers[i];
        if (s->state == RT_SERVER_GONE) continue;
        size_t p = (size_t)profile_hash(s) & (px->cap - 1);
        while (px->rep[p] && !same_profile(&sw->servers[px->rep[p] - 1], s)) p = (p + 1) & (px->cap - 1);
        if (!px->rep[p]) {
            px->rep[p] = i + 1;
            px->prof_of[i] = i; /* a new profile is named after its first server */
            px->name_no[i] = kind_ordinal(sw, px, i);
        } else px->prof_of[i] = px->rep[p] - 1;
    }
    return FU_OK;
}

static void prof_free(prof_ix *px) {
    free(px->rep), free(px->prof_of), free(px->name_no), free(px->krep), free(px->kcount);
}

/* The key of server i's profile in "kinds": its kind, or "kind#N" for the N-th other one (and
 * for servers of no kind). */
static void profile_key(const rt_swarm *sw, const prof_ix *px, int i, char *key, size_t cap) {
    int r = px->prof_of[i];
    if (px->name_no[r] || !sw->servers[r].kind[0]) snprintf(key, cap, "%s#%d", sw->servers[r].kind, px->name_no[r]);
    else snprintf(key, cap, "%s", sw->servers[r].kind);
}

/* ,"key":value */
static void put_field(FILE *f, const char *key, double v) {
    fprintf(f, ",\"%s\":", key);
    put_num(f, v);
}

static void write_head(FILE *f, const rt_swarm *sw) {
    const rt_model *m = &sw->model;
    fputs("{\"model\":{\"name\":", f);
    put_str(f, m->name);
    fprintf(f, ",\"n_layers\":%d", m->n_layers);
    put_field(f, "token_bytes", m->token_bytes);
    put_field(f, "activation_bytes", m->act_bytes);
    put_field(f, "layer_bytes", m->layer_bytes);
    put_field(f, "kv_bytes_per_token_layer", m->kv_bytes_per_token_layer);
    put_field(f, "weight_vram_fraction", m->weight_vram_fraction);
    fprintf(f, "},\n\"coordinator\":{\"nic_out\":");
    put_num(f, sw->source_nic_out);
    put_field(f, "nic_in", sw->sink_nic_in);
    fputs("}", f);
}

static void write_kinds(FILE *f, const rt_swarm *sw, const prof_ix *px) {
    fputs(",\n\"kinds\":{", f);
    int first = 1;
    char key[64];
    for (int i = 0; i < sw->n_servers; i++) {
        const rt_server *s = &sw->servers[i];
        if (s->state == RT_SERVER_GONE || px->prof_of[i] != i) continue;
        profile_key(sw, px, i, key, sizeof key);
        fputs(first ? "\n" : ",\n", f);
        first = 0;
        put_str(f, key);
        fprintf(f, ":{\"cpu\":%s", s->is_cpu ? "true" : "false");
        put_field(f, "vram", s->vram_bytes);
        put_field(f, "nic_in", s->nic_in);
        put_field(f, "nic_out", s->nic_out);
        put_table(f, "tokens_per_s_by_layers", s->tput, s->n_tput);
        put_table(f, "kv_tokens_by_layers", s->kv_tokens, s->n_tput);
        fputc('}', f);
    }
    fputs("}", f);
}

/* Servers in id order, GONE ones left out; *index receives each id's position (-1 GONE). */
static void write_servers(FILE *f, const rt_swarm *sw, const prof_ix *px, int *index) {
    fputs(",\n\"servers\":[", f);
    char key[64];
    int pos = 0;
    for (int i = 0; i < sw->n_servers; i++) {
        const rt_server *s = &sw->servers[i];
        index[i] = -1;
        if (s->state == RT_SERVER_GONE) continue;
        index[i] = pos;
        fputs(pos++ ? ",\n{\"name\":" : "\n{\"name\":", f);
        put_str(f, s->name);
        fputs(",\"address\":", f);
        put_str(f, s->address);
        fputs(",\"kind\":", f);
        put_str(f, s->kind);
        profile_key(sw, px, i, key, sizeof key);
        if (strcmp(key, s->kind)) {
            fputs(",\"profile\":", f);
            put_str(f, key);
        }
        if (s->state == RT_SERVER_SPARE) fputs(",\"state\":\"spare\"", f);
        if (sw->default_link.bandwidth > 0 && !sw->on_default[i]) fputs(",\"default_link\":false", f);
        if (s->last > s->first) fprintf(f, ",\"span\":[%d,%d]", s->first, s->last);
        fputc('}', f);
    }
    fputs("]", f);
}

static void put_link(FILE *f, int *count, int a, int b, rt_link l) {
    fprintf(f, *count == 0 ? "\n[%d,%d," : (*count % 8 ? ",[%d,%d," : ",\n[%d,%d,"), a, b);
    (*count)++;
    put_num(f, l.bandwidth);
    fputc(',', f);
    put_num(f, l.latency);
    fputc(']', f);
}

/* Every explicit link as directed [from, to, bandwidth, latency] by file index (-1 source,
 * -2 sink). Pairs on the default link stay implicit ("default_link" is written instead); with
 * a default, coordinator links are all written, absent ones too, since the default fills them. */
static void write_links(FILE *f, const rt_swarm *sw, const int *index) {
    int dflt = sw->default_link.bandwidth > 0, count = 0;
    if (dflt) {
        fputs(",\n\"default_link\":{\"bandwidth\":", f);
        put_num(f, sw->default_link.bandwidth);
        put_field(f, "latency", sw->default_link.latency);
        fputc('}', f);
    }
    fputs(",\n\"links\":[", f);
    for (int a = 0; a < sw->n_servers; a++) {
        if (index[a] < 0) continue;
        if (dflt || sw->from_source[a].bandwidth > 0) put_link(f, &count, RT_SOURCE, index[a], sw->from_source[a]);
        if (dflt || sw->to_sink[a].bandwidth > 0) put_link(f, &count, index[a], RT_SINK, sw->to_sink[a]);
        const rt_adj *o = &sw->out[a];
        for (int k = 0; k < o->n; k++)
            if (index[o->peer[k]] >= 0) put_link(f, &count, index[a], index[o->peer[k]], o->link[k]);
    }
    fputc(']', f);
}

/* [[x, ms], ...] from a table of x and seconds. */
static void put_points(FILE *f, const char *key, const double *x, const double *sec, int n) {
    fprintf(f, "\"%s\":[", key);
    for (int i = 0; i < n; i++) {
        fputs(i ? ",[" : "[", f);
        put_num(f, x[i]);
        fputc(',', f);
        put_num(f, sec[i] * 1e3);
        fputc(']', f);
    }
    fputc(']', f);
}

/* One batch limit per block count: ,"key":[v1, v2, ...] (ints, or doubles when dv is given). */
static void put_limits(FILE *f, const char *key, const int *iv, const double *dv, int n) {
    fprintf(f, ",\"%s\":[", key);
    for (int i = 0; i < n; i++) {
        if (i) fputc(',', f);
        if (dv) put_num(f, dv[i]);
        else fprintf(f, "%d", iv[i]);
    }
    fputc(']', f);
}

static void write_profile(FILE *f, const rt_step_profile *q) {
    put_str(f, q->kind);
    fputs(":{", f);
    put_points(f, "prompt", q->prompt_tokens, q->prompt_s, q->n_prompt);
    fputc(',', f);
    put_points(f, "decode", q->decode_tokens, q->decode_s, q->n_decode);
    put_field(f, "decode_ctx_ms_per_token", q->decode_ctx_s * 1e3);
    put_field(f, "single_decode_factor", q->single_decode_factor);
    if (q->n_limits > 0) {
        put_limits(f, "prompt_max_requests", q->prompt_max_requests, NULL, q->n_limits);
        put_limits(f, "prompt_max_tokens", q->prompt_max_tokens, NULL, q->n_limits);
        put_limits(f, "decode_max_tokens", q->decode_max_tokens, NULL, q->n_limits);
        put_limits(f, "decode_max_context", NULL, q->decode_max_context, q->n_limits);
    }
    fputc('}', f);
}

/* ,"step_profiles":{...} when there are any. */
static void write_step_profiles(FILE *f, const rt_sim_profiles *prof) {
    if (!prof || prof->n <= 0) return;
    fputs(",\n\"step_profiles\":{", f);
    for (int i = 0; i < prof->n; i++) {
        if (i) fputs(",\n", f);
        write_profile(f, &prof->items[i]);
    }
    fputc('}', f);
}

/* Writes the whole document to f. */
static int write_doc(FILE *f, const rt_swarm *sw, const rt_sim_profiles *prof) {
    prof_ix px = {0};
    int *index = malloc(((size_t)sw->n_servers + 1) * sizeof(int));
    int rc = index ? profiles_index(sw, &px) : fu_errorf(FU_ERR_NOMEM, "cluster JSON: out of memory");
    if (!rc) {
        write_head(f, sw);
        write_kinds(f, sw, &px);
        write_servers(f, sw, &px, index);
        write_links(f, sw, index);
        write_step_profiles(f, prof);
        fputs("}\n", f);
    }
    prof_free(&px);
    free(index);
    return rc;
}

int rt_swarm_save_json(const rt_swarm *sw, const char *path) { return rt_swarm_save_json_with(sw, NULL, path); }

int rt_swarm_save_json_with(const rt_swarm *sw, const rt_sim_profiles *prof, const char *path) {
    if (!sw || !path) return fu_errorf(FU_ERR_INVALID, "rt_swarm_save_json: NULL argument");
    size_t pl = strlen(path);
    char *tmp = malloc(pl + 16);
    if (!tmp) return fu_errorf(FU_ERR_NOMEM, "cluster JSON: out of memory");
    snprintf(tmp, pl + 16, "%s.tmp.XXXXXX", path);
    int fd = mkstemp(tmp);
    struct stat st; /* the file keeps its mode; a new one is readable by all, as before */
    if (fd >= 0) fchmod(fd, stat(path, &st) ? 0644 : st.st_mode & 07777);
    FILE *f = fd >= 0 ? fdopen(fd, "w") : NULL;
    if (!f) {
        int e = errno;
        if (fd >= 0) close(fd), unlink(tmp);
        free(tmp);
        return fu_errorf(FU_ERR_IO, "%s: cannot write: %s", path, strerror(e));
    }
    int rc = write_doc(f, sw, prof);
    int bad = ferror(f) | fflush(f) | fsync(fileno(f));
    bad |= fclose(f);
    if (!rc && bad) rc = fu_errorf(FU_ERR_IO, "%s: write failed", path);
    if (!rc && rename(tmp, path)) rc = fu_errorf(FU_ERR_IO, "%s: cannot replace: %s", path, strerror(errno));
    if (rc) unlink(tmp);
    free(tmp);
    return rc;
}
