/* json-schema.c -- JSON Schema to GBNF: one rule per schema node over shared JSON rules. */
#include "json-schema.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "buf.h"
#include "json-schema-impl.h"
#include "status.h"

#define JS_MAX_REFS 4096

static const char js_base[] =
    "ws ::= | \" \" | \"\\n\" [ ]{0,12}\n"
    "jchar ::= [^\"\\\\\\x00-\\x1f] | jesc\n"
    "jesc ::= \"\\\\\" ([\"\\\\/bfnrt] | \"u\" [0-9a-fA-F]{4})\n"
    "string ::= \"\\\"\" jchar* \"\\\"\"\n"
    "integer ::= \"-\"? (\"0\" | [1-9] [0-9]{0,15})\n"
    "number ::= integer (\".\" [0-9]{1,16})? ([eE] [-+]? [0-9]{1,3})?\n"
    "boolean ::= \"true\" | \"false\"\n"
    "null ::= \"null\"\n"
    "value ::= object | array | string | number | boolean | null\n"
    "member ::= string ws \":\" ws value ws\n"
    "object ::= \"{\" ws (member (\",\" ws member)*)? \"}\"\n"
    "array ::= \"[\" ws (value ws (\",\" ws value ws)*)? \"]\"\n";

const char *js_base_rules(void) { return js_base; }

typedef struct js_refent {
    char *ref;
    int rule;
} js_refent;

typedef struct js_gen {
    fu_buf out;            /* the rules written so far */
    const json_t *root;
    int n_rules;           /* rules r0 .. r(n-1) */
    js_refent *refs;
    size_t n_refs;
    int depth;
    const char *prefix;    /* of every rule name */
} js_gen;

/* A rule name "<prefix>rN" written into name (32 bytes). */
static const char *js_name(const js_gen *g, char *name, int id) {
    snprintf(name, 32, "%.12sr%d", g->prefix, id);
    return name;
}

static const char *js_keywords[] = {
    "type", "properties", "required", "additionalProperties", "items", "minItems", "maxItems", "enum",
    "const", "$ref", "$defs", "definitions", "anyOf", "oneOf", "allOf", "pattern", "format", "minLength",
    "maxLength", "title", "description", "$schema", "$id", "$comment", "default", "examples", "deprecated",
    "readOnly", "writeOnly", NULL};

/* FU_ERR_INVALID unless every keyword of node is one this compiler knows. */
static int js_check_keywords(const json_t *node, const char *path) {
    const char *key;
    json_t *v;
    json_object_foreach((json_t *)node, key, v) {
        int known = 0;
        for (int i = 0; js_keywords[i] && !known; i++) known = !strcmp(key, js_keywords[i]);
        if (!known) return fu_errorf(FU_ERR_INVALID, "json_schema: unsupported keyword '%s' at '%s'", key, path);
    }
    return FU_OK;
}

static int js_node(js_gen *g, const json_t *node, const char *path, char *name);

/* Appends "<name> ::= <body>\n". */
static int js_emit(js_gen *g, const char *name, const fu_buf *body) {
    int rc = fu_buf_appendf(&g->out, "%s ::= %s\n", name, body->len ? body->data : "\"\"");
    return rc ? fu_errorf(FU_ERR_NOMEM, "json_schema: out of memory") : FU_OK;
}

/* Reserves a new rule; its name into name. */
static const char *js_new_rule(js_gen *g, char *name) { return js_name(g, name, g->n_rules++); }

/* A child path "<path>/<key>" (truncated to fit). */
static void js_child(char *dst, size_t cap, const char *path, const char *key) {
    snprintf(dst, cap, "%.200s/%.50s", path, key);
}

/* ---- values: const, enum ------------------------------------------------------------------ */

/* Appends JSON value v (compact) as a GBNF literal. */
static int js_value_literal(fu_buf *b, const json_t *v) {
    char *s = json_dumps(v, JSON_COMPACT | JSON_ENCODE_ANY);
    if (!s) return fu_errorf(FU_ERR_NOMEM, "json_schema: out of memory");
    int rc = js_gbnf_literal(b, s, strlen(s));
    free(s);
    return rc;
}

static int js_enum(js_gen *g, const json_t *e, const char *path, fu_buf *body) {
    if (!json_is_array(e) || !json_array_size(e))
        return fu_errorf(FU_ERR_INVALID, "json_schema: 'enum' at '%s' must be a non-empty array", path);
    for (size_t i = 0; i < json_array_size(e); i++) {
        if ((i && fu_buf_append(body, " | ", 3)) || js_value_literal(body, json_array_get(e, i)))
            return fu_errorf(FU_ERR_NOMEM, "json_schema: out of memory");
    }
    (void)g;
    return FU_OK;
}

/* anyOf / oneOf: alternatives of the subschemas. */
static int js_any_of(js_gen *g, const json_t *list, const char *kw, const char *path, fu_buf *body) {
    if (!json_is_array(list) || !json_array_size(list))
        return fu_errorf(FU_ERR_INVALID, "json_schema: '%s' at '%s' must be a non-empty array", kw, path);
    for (size_t i = 0; i < json_array_size(list); i++) {
        char sub[300], idx[24], name[32];
        snprintf(idx, sizeof idx, "%s/%zu", kw, i);
        js_child(sub, sizeof sub, path, idx);
        int rc = js_node(g, json_array_get(list, i), sub, name);
        if (rc) return rc;
        if (fu_buf_appendf(body, "%s%s", i ? " | " : "", name)) return fu_errorf(FU_ERR_NOMEM, "json_schema");
    }
    return FU_OK;
}

/* ---- $ref ------------------------------------------------------------------------------------ */

/* The schema a local ref points at ("#", "#/$defs/X", "#/definitions/X"), or NULL. */
static const json_t *js_resolve(const js_gen *g, const char *ref) {
    if (!strcmp(ref, "#")) return g->root;
    const char *kinds[] = {"#/$defs/", "#/definitions/"};
    for (int k = 0; k < 2; k++) {
        size_t n = strlen(kinds[k]);
        if (strncmp(ref, kinds[k], n)) continue;
        char key[256];
        size_t o = 0;
        for (const char *p = ref + n; *p && o + 1 < sizeof key; p++) {
            if (*p == '/') return NULL;
            if (p[0] == '~' && (p[1] == '0' || p[1] == '1')) key[o++] = p[1] == '0' ? '~' : '/', p++;
            else key[o++] = *p;
        }
        key[o] = 0;
        return json_object_get(json_object_get(g->root, k ? "definitions" : "$defs"), key);
    }
    return NULL;
}

/* Follows a chain of bare $refs from ref: FU_ERR_INVALID when it loops or resolves nowhere. */
static int js_ref_chain(const js_gen *g, const char *ref, const json_t **target) {
    const char *seen[64];
    for (int n = 0; n < 64; n++) {
        for (int i = 0; i < n; i++)
            if (!strcmp(seen[i], ref)) return fu_errorf(FU_ERR_INVALID, "json_schema: $ref loop through '%s'", ref);
        seen[n] = ref;
        const json_t *t = js_resolve(g, ref);
        if (!t) return fu_errorf(FU_ERR_INVALID, "json_schema: $ref '%s' resolves to nothing (only '#', '#/$defs/...' "
                                 "and '#/definitions/...' are supported)", ref);
        const json_t *next = json_is_object(t) ? json_object_get(t, "$ref") : NULL;
        if (!json_is_string(next)) {
            *target = t;
            return FU_OK;
        }
        ref = json_string_value(next);
    }
    return fu_errorf(FU_ERR_INVALID, "json_schema: $ref chain too long at '%s'", ref);
}

static int js_ref(js_gen *g, const json_t *r, const char *path, char *name) {
    if (!json_is_string(r)) return fu_errorf(FU_ERR_INVALID, "json_schema: '$ref' at '%s' must be a string", path);
    const char *ref = json_string_value(r);
    for (size_t i = 0; i < g->n_refs; i++)
        if (!strcmp(g->refs[i].ref, ref)) return js_name(g, name, g->refs[i].rule), FU_OK;
    const json_t *t;
    int rc = js_ref_chain(g, ref, &t);
    if (rc) return rc;
    if (g->n_refs >= JS_MAX_REFS) return fu_errorf(FU_ERR_EXHAUSTED, "json_schema: more than %d $refs", JS_MAX_REFS);
    js_refent *nr = realloc(g->refs, (g->n_refs + 1) * sizeof *nr);
    char *copy = strdup(ref);
    if (nr) g->refs = nr;
    if (!nr || !copy) return free(copy), fu_errorf(FU_ERR_NOMEM, "json_schema: out of memory");
    int id = g->n_rules++;
    g->refs[g->n_refs++] = (js_refent){copy, id};
    char sub[32];
    if ((rc = js_node(g, t, ref, sub))) return rc;
    js_name(g, name, id);
    fu_buf body = {0};
    rc = fu_buf_appendf(&body, "%s", sub) ? fu_errorf(FU_ERR_NOMEM, "json_schema") : js_emit(g, name, &body);
    fu_buf_free(&body);
    return rc;
}

/* ---- objects ----------------------------------------------------------------------------- */

typedef struct js_prop {
    const char *key;
    char rule[32];
    int required;
} js_prop;

/* Whether `key` is listed in required. */
static int js_required(const json_t *req, const char *key) {
    for (size_t i = 0; i < json_array_size(req); i++)
        if (json_is_string(json_array_get(req, i)) && !strcmp(json_string_value(json_array_get(req, i)), key)) return 1;
    return 0;
}

/* The properties (declared ones, then required keys not declared, which take any value). */
static int js_props(js_gen *g, const json_t *node, const char *path, js_prop **out, size_t *n) {
    const json_t *props = json_object_get(node, "properties"), *req = json_object_get(node, "required");
    if (props && !json_is_object(props)) return fu_errorf(FU_ERR_INVALID, "json_schema: 'properties' at '%s' must be an object", path);
    if (req && !json_is_array(req)) return fu_errorf(FU_ERR_INVALID, "json_schema: 'required' at '%s' must be an array", path);
    size_t cap = json_object_size(props) + json_array_size(req);
    js_prop *p = calloc(cap ? cap : 1, sizeof *p);
    if (!p) return fu_errorf(FU_ERR_NOMEM, "json_schema: out of memory");
    *out = p;
    *n = 0;
    const char *key;
    json_t *v;
    json_object_foreach((json_t *)props, key, v) {
        char sub[300], child[80];
        snprintf(child, sizeof child, "properties/%.60s", key);
        js_child(sub, sizeof sub, path, child);
        p[*n] = (js_prop){key, "", js_required(req, key)};
        int rc = js_node(g, v, sub, p[*n].rule);
        if (rc) return rc;
        (*n)++;
    }
    for (size_t i = 0; i < json_array_size(req); i++) {
        const json_t *k = json_array_get(req, i);
        if (!json_is_string(k)) return fu_errorf(FU_ERR_INVALID, "json_schema: 'required' at '%s' must list strings", path);
        if (!json_object_get(props, json_string_value(k))) p[(*n)++] = (js_prop){json_string_value(k), "value", 1};
    }
    return FU_OK;
}

/* "\"key\"" ws ":" ws RULE ws */
static int js_kv(fu_buf *b, const js_prop *p) {
    json_t *k = json_string(p->key);
    int rc = k ? js_value_literal(b, k) : FU_ERR_NOMEM;
    json_decref(k);
    if (!rc && fu_buf_appendf(b, " ws \":\" ws %s ws", p->rule)) rc = FU_ERR_NOMEM;
    return rc ? fu_errorf(rc == FU_ERR_NOMEM ? FU_ERR_NOMEM : rc, "json_schema: out of memory") : FU_OK;
}

/* Emits the tail rules of props[i..n) (something already written) and the head rules (nothing
 * written yet); *head: the rule of head 0. extra: the rule of other keys' member, or NULL. */
static int js_object_rules(js_gen *g, const js_prop *p, size_t n, const char *extra, char *head) {
    char next_t[32] = "", next_h[32] = "", t[32], h[32];
    int rc = FU_OK;
    for (size_t k = n + 1; k-- > 0 && !rc;) {
        fu_buf tb = {0}, hb = {0};
        js_new_rule(g, t);
        js_new_rule(g, h);
        if (k == n) {
            if (extra) rc = fu_buf_appendf(&tb, "(\",\" ws %s)*", extra) || fu_buf_appendf(&hb, "(%s %s)?", extra, t);
        } else {
            const char *open = p[k].required ? "\",\" ws " : "(\",\" ws ";
            rc = fu_buf_append(&tb, open, strlen(open)) || js_kv(&tb, &p[k]) ||
                 fu_buf_appendf(&tb, p[k].required ? " %s" : ")? %s", next_t) || js_kv(&hb, &p[k]) ||
                 fu_buf_appendf(&hb, " %s", next_t) || (!p[k].required && fu_buf_appendf(&hb, " | %s", next_h));
        }
        if (rc) rc = fu_errorf(FU_ERR_NOMEM, "json_schema: out of memory");
        if (!rc) rc = js_emit(g, t, &tb);
        if (!rc) rc = js_emit(g, h, &hb);
        fu_buf_free(&tb), fu_buf_free(&hb);
        memcpy(next_t, t, 32), memcpy(next_h, h, 32);
    }
    memcpy(head, next_h, 32);
    return rc;
}

static int js_str_cmp(const void *a, const void *b) { return strcmp(*(const char *const *)a, *(const char *const *)b); }

/* Length of the UTF-8 character at s (1 when malformed). */
static size_t js_char_len(const char *s) {
    uint8_t c = (uint8_t)*s;
    size_t n = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 1;
    for (size_t i = 1; i < n; i++)
        if (!s[i]) return 1;
    return n;
}

/* Writes rule `name`: JSON string contents other than the sorted keys[lo, hi), which share
 * their first d bytes (a trie of the keys, one rule per node). */
static int js_not_keys(js_gen *g, const char **keys, size_t lo, size_t hi, size_t d, char *name) {
    fu_buf b = {0}, cls = {0};
    js_new_rule(g, name);
    int rc = FU_OK, ends = 0;
    for (size_t i = lo; !rc && i < hi;) {
        if (!keys[i][d]) {
            ends = 1, i++;
            continue;
        }
        size_t cl = js_char_len(keys[i] + d), j = i;
        while (j < hi && !strncmp(keys[j] + d, keys[i] + d, cl)) j++;
        char child[32];
        rc = js_not_keys(g, keys, i, j, d + cl, child);
        if (!rc) rc = fu_buf_append(&cls, keys[i] + d, cl) || fu_buf_append(&b, " | ", 3) ||
                      js_gbnf_literal(&b, keys[i] + d, cl) || fu_buf_appendf(&b, " %s", child);
        i = j;
    }
    const char *dot = "[^\"\\\\\\x00-\\x1f";
    if (!rc) rc = fu_buf_append(&cls, "", 0) || fu_buf_append(&b, ends ? "" : " | \"\"", ends ? 0 : 5);
    fu_buf head = {0};
    if (!rc) rc = fu_buf_append(&head, dot, strlen(dot));
    for (const char *p = cls.data; !rc && p && *p;) {
        const char *q = p;
        p += js_char_len(p);
        uint32_t c = (uint8_t)*q;
        if (p - q > 1) c &= 0x3Fu >> (p - q - 1);
        for (const char *r = q + 1; r < p; r++) c = (c << 6) | ((uint8_t)*r & 0x3Fu);
        rc = js_gbnf_char(&head, c, 1);
    }
    if (!rc) rc = fu_buf_appendf(&head, "] jchar* | jesc jchar*%s", b.data ? b.data : "");
    rc = rc ? (rc < 0 ? rc : fu_errorf(FU_ERR_NOMEM, "json_schema: out of memory")) : js_emit(g, name, &head);
    fu_buf_free(&b), fu_buf_free(&cls), fu_buf_free(&head);
    return rc;
}

/* Whether key can be left out of the other keys' names (no quote, backslash or control). */
static int js_plain_key(const char *k) {
    for (; *k; k++)
        if (*k == '"' || *k == '\\' || (uint8_t)*k < 0x20) return 0;
    return 1;
}

/* The member rule for other keys (additionalProperties absent/true: any value; a schema: its
 * values; false: none, *extra empty); their names differ from the declared ones. */
static int js_extra(js_gen *g, const json_t *node, const js_prop *p, size_t n, const char *path, char *extra) {
    const json_t *ap = json_object_get(node, "additionalProperties");
    extra[0] = 0;
    if (json_is_false(ap)) return FU_OK;
    char sub[300], vr[32] = "value", name[32], keyr[32] = "";
    js_child(sub, sizeof sub, path, "additionalProperties");
    int rc = ap && !json_is_true(ap) ? js_node(g, ap, sub, vr) : FU_OK;
    if (rc) return rc;
    const char **keys = calloc(n + 1, sizeof *keys);
    if (!keys) return fu_errorf(FU_ERR_NOMEM, "json_schema: out of memory");
    size_t k = 0;
    for (size_t i = 0; i < n; i++)
        if (js_plain_key(p[i].key)) keys[k++] = p[i].key;
    qsort(keys, k, sizeof *keys, js_str_cmp);
    rc = js_not_keys(g, keys, 0, k, 0, keyr);
    free(keys);
    if (rc) return rc;
    fu_buf b = {0};
    js_new_rule(g, name);
    rc = fu_buf_appendf(&b, "\"\\\"\" %s \"\\\"\" ws \":\" ws %s ws", keyr, vr) ? fu_errorf(FU_ERR_NOMEM, "json_schema")
                                                                          : js_emit(g, name, &b);
    fu_buf_free(&b);
    memcpy(extra, name, 32);
    return rc;
}

static int js_object(js_gen *g, const json_t *node, const char *path, fu_buf *body) {
    js_prop *p = NULL;
    size_t n = 0;
    char extra[32], head[32];
    int rc = js_props(g, node, path, &p, &n);
    if (!rc) rc = js_extra(g, node, p, n, path, extra);
    if (!rc) rc = js_object_rules(g, p, n, extra[0] ? extra : NULL, head);
    if (!rc && fu_buf_appendf(body, "\"{\" ws %s \"}\"", head)) rc = fu_errorf(FU_ERR_NOMEM, "json_schema");
    free(p);
    return rc;
}

/* ---- arrays, strings ---------------------------------------------------------------------- */

/* Reads a non-negative integer keyword (absent: dflt). */
static int js_count(const json_t *node, const char *kw, const char *path, long dflt, long *out) {
    const json_t *v = json_object_get(node, kw);
    *out = dflt;
    if (!v) return FU_OK;
    if (!json_is_integer(v) || json_integer_value(v) < 0 || json_integer_value(v) > 1000000)
        return fu_errorf(FU_ERR_INVALID, "json_schema: '%s' at '%s' must be a non-negative integer", kw, path);
    *out = (long)json_integer_value(v);
    return FU_OK;
}

static int js_array(js_gen *g, const json_t *node, const char *path, fu_buf *body) {
    long lo, hi;
    int rc = js_count(node, "minItems", path, 0, &lo);
    if (!rc) rc = js_count(node, "maxItems", path, -1, &hi);
    if (rc) return rc;
    if (hi >= 0 && hi < lo) return fu_errorf(FU_ERR_INVALID, "json_schema: maxItems < minItems at '%s'", path);
    char item[32] = "value", sub[300];
    const json_t *items = json_object_get(node, "items");
    js_child(sub, sizeof sub, path, "items");
    if (items && (rc = js_node(g, items, sub, item))) return rc;
    if (hi == 0) rc = fu_buf_appendf(body, "\"[\" ws \"]\"");
    else if (lo == 0 && hi < 0) rc = fu_buf_appendf(body, "\"[\" ws (%s ws (\",\" ws %s ws)*)? \"]\"", item, item);
    else if (lo == 0) rc = fu_buf_appendf(body, "\"[\" ws (%s ws (\",\" ws %s ws){0,%ld})? \"]\"", item, item, hi - 1);
    else if (hi < 0) rc = fu_buf_appendf(body, "\"[\" ws %s ws (\",\" ws %s ws){%ld,} \"]\"", item, item, lo - 1);
    else rc = fu_buf_appendf(body, "\"[\" ws %s ws (\",\" ws %s ws){%ld,%ld} \"]\"", item, item, lo - 1, hi - 1);
    return rc ? fu_errorf(FU_ERR_NOMEM, "json_schema: out of memory") : FU_OK;
}

static const char *js_formats[][2] = {
    {"date", "[0-9]{4} \"-\" (\"0\" [1-9] | \"1\" [0-2]) \"-\" (\"0\" [1-9] | [12] [0-9] | \"3\" [01])"},
    {"time", "([01] [0-9] | \"2\" [0-3]) \":\" [0-5] [0-9] \":\" [0-5] [0-9] (\".\" [0-9]{1,6})? "
             "(\"Z\" | [+-] ([01] [0-9] | \"2\" [0-3]) \":\" [0-5] [0-9])"},
    {"uuid", "[0-9a-fA-F]{8} \"-\" [0-9a-fA-F]{4} \"-\" [0-9a-fA-F]{4} \"-\" [0-9a-fA-F]{4} \"-\" [0-9a-fA-F]{12}"},
    {"email", "[a-zA-Z0-9._%+-]{1,64} \"@\" [a-zA-Z0-9-]{1,63} (\".\" [a-zA-Z0-9-]{1,63}){0,4} \".\" [a-zA-Z]{2,12}"},
    {NULL, NULL}};

static int js_format(const char *fmt, const char *path, fu_buf *body) {
    if (!strcmp(fmt, "date-time"))
        return fu_buf_appendf(body, "\"\\\"\" (%s) \"T\" (%s) \"\\\"\"", js_formats[0][1], js_formats[1][1]) ? FU_ERR_NOMEM : FU_OK;
    for (int i = 0; js_formats[i][0]; i++)
        if (!strcmp(fmt, js_formats[i][0])) return fu_buf_appendf(body, "\"\\\"\" %s \"\\\"\"", js_formats[i][1]) ? FU_ERR_NOMEM : FU_OK;
    return fu_errorf(FU_ERR_INVALID, "json_schema: unsupported keyword 'format' value '%s' at '%s'", fmt, path);
}

static int js_string(const json_t *node, const char *path, fu_buf *body) {
    const json_t *pat = json_object_get(node, "pattern"), *fmt = json_object_get(node, "format");
    long lo, hi;
    int rc = js_count(node, "minLength", path, 0, &lo);
    if (!rc) rc = js_count(node, "maxLength", path, -1, &hi);
    if (rc) return rc;
    int lengths = lo > 0 || hi >= 0;
    if ((pat || fmt) && lengths)
        return fu_errorf(FU_ERR_INVALID, "json_schema: unsupported keyword 'minLength'/'maxLength' with '%s' at '%s'",
                         pat ? "pattern" : "format", path);
    if (pat && fmt) return fu_errorf(FU_ERR_INVALID, "json_schema: unsupported keyword 'format' with 'pattern' at '%s'", path);
    if (pat) {
        if (!json_is_string(pat)) return fu_errorf(FU_ERR_INVALID, "json_schema: 'pattern' at '%s' must be a string", path);
        if (fu_buf_append(body, "\"\\\"\" (", 6)) return FU_ERR_NOMEM;
        if ((rc = js_regex_gbnf(json_string_value(pat), body))) return rc;
        return fu_buf_append(body, ") \"\\\"\"", 6) ? FU_ERR_NOMEM : FU_OK;
    }
    if (fmt) return json_is_string(fmt) ? js_format(json_string_value(fmt), path, body)
                                        : fu_errorf(FU_ERR_INVALID, "json_schema: 'format' at '%s' must be a string", path);
    if (hi > 1000 || lo > 1000) return fu_errorf(FU_ERR_INVALID, "json_schema: minLength/maxLength over 1000 at '%s'", path);
    if (!lengths) return fu_buf_append(body, "string", 6) ? FU_ERR_NOMEM : FU_OK;
    rc = hi < 0 ? fu_buf_appendf(body, "\"\\\"\" jchar{%ld,} \"\\\"\"", lo) : fu_buf_appendf(body, "\"\\\"\" jchar{%ld,%ld} \"\\\"\"", lo, hi);
    return rc ? FU_ERR_NOMEM : FU_OK;
}

/* ---- types and nodes ----------------------------------------------------------------------- */

static int js_typed(js_gen *g, const json_t *node, const char *type, const char *path, fu_buf *body) {
    if (!strcmp(type, "object")) return js_object(g, node, path, body);
    if (!strcmp(type, "array")) return js_array(g, node, path, body);
    if (!strcmp(type, "string")) return js_string(node, path, body);
    const char *simple[] = {"number", "integer", "boolean", "null"};
    for (int i = 0; i < 4; i++)
        if (!strcmp(type, simple[i])) return fu_buf_appendf(body, "%s", type) ? FU_ERR_NOMEM : FU_OK;
    return fu_errorf(FU_ERR_INVALID, "json_schema: unknown type '%s' at '%s'", type, path);
}

/* The type a typeless node implies by its keywords, or NULL (any value). */
static const char *js_implied_type(const json_t *node) {
    if (json_object_get(node, "properties") || json_object_get(node, "additionalProperties") ||
        json_object_get(node, "required"))
        return "object";
    if (json_object_get(node, "items") || json_object_get(node, "minItems") || json_object_get(node, "maxItems"))
        return "array";
    if (json_object_get(node, "pattern") || json_object_get(node, "format") || json_object_get(node, "minLength") ||
        json_object_get(node, "maxLength"))
        return "string";
    return NULL;
}

static int js_types(js_gen *g, const json_t *node, const char *path, fu_buf *body) {
    const json_t *t = json_object_get(node, "type");
    if (!t) {
        const char *implied = js_implied_type(node);
        return implied ? js_typed(g, node, implied, path, body) : (fu_buf_append(body, "value", 5) ? FU_ERR_NOMEM : FU_OK);
    }
    if (json_is_string(t)) return js_typed(g, node, json_string_value(t), path, body);
    if (!json_is_array(t) || !json_array_size(t))
        return fu_errorf(FU_ERR_INVALID, "json_schema: 'type' at '%s' must be a string or a non-empty array", path);
    for (size_t i = 0; i < json_array_size(t); i++) {
        const json_t *ti = json_array_get(t, i);
        if (!json_is_string(ti)) return fu_errorf(FU_ERR_INVALID, "json_schema: 'type' at '%s' must list strings", path);
        if (i && fu_buf_append(body, " | ", 3)) return FU_ERR_NOMEM;
        int rc = js_typed(g, node, json_string_value(ti), path, body);
        if (rc) return rc;
    }
    return FU_OK;
}

/* The body of a node's rule, by its first structural keyword. */
static int js_body(js_gen *g, const json_t *node, const char *path, fu_buf *body) {
    const json_t *v;
    if ((v = json_object_get(node, "const"))) return js_value_literal(body, v);
    if ((v = json_object_get(node, "enum"))) return js_enum(g, v, path, body);
    if ((v = json_object_get(node, "anyOf"))) return js_any_of(g, v, "anyOf", path, body);
    if ((v = json_object_get(node, "oneOf"))) return js_any_of(g, v, "oneOf", path, body);
    if ((v = json_object_get(node, "allOf"))) {
        if (!json_is_array(v) || json_array_size(v) != 1)
            return fu_errorf(FU_ERR_INVALID, "json_schema: unsupported keyword 'allOf' (more than one schema) at '%s'", path);
        return js_any_of(g, v, "allOf", path, body);
    }
    return js_types(g, node, path, body);
}

/* Writes the rule of schema node (at JSON pointer path); its name into name (32 bytes). */
static int js_node(js_gen *g, const json_t *node, const char *path, char *name) {
    if (json_is_true(node) || (json_is_object(node) && !json_object_size(node))) return snprintf(name, 32, "value"), FU_OK;
    if (!json_is_object(node)) return fu_errorf(FU_ERR_INVALID, "json_schema: the schema at '%s' must be an object", path);
    int rc = js_check_keywords(node, path);
    if (rc) return rc;
    const json_t *ref = json_object_get(node, "$ref");
    if (ref) return js_ref(g, ref, path, name);
    if (g->depth >= JS_MAX_DEPTH) return fu_errorf(FU_ERR_EXHAUSTED, "json_schema: nested deeper than %d at '%s'", JS_MAX_DEPTH, path);
    g->depth++;
    fu_buf body = {0};
    js_new_rule(g, name);
    rc = js_body(g, node, path, &body);
    if (rc == FU_ERR_NOMEM) rc = fu_errorf(FU_ERR_NOMEM, "json_schema: out of memory");
    if (!rc) rc = js_emit(g, name, &body);
    fu_buf_free(&body);
    g->depth--;
    return rc;
}

int js_schema_rules(const json_t *schema, const char *prefix, fu_buf *out) {
    size_t size = json_dumpb(schema, NULL, 0, JSON_COMPACT | JSON_ENCODE_ANY);
    if (size > JS_MAX_SCHEMA_BYTES)
        return fu_errorf(FU_ERR_EXHAUSTED, "json_schema: the schema is over %u bytes", JS_MAX_SCHEMA_BYTES);
    js_gen g;
    memset(&g, 0, sizeof g);
    g.root = schema;
    g.prefix = prefix;
    g.out = *out;
    char name[32];
    int rc = js_node(&g, schema, "#", name);
    if (!rc && (fu_buf_appendf(&g.out, "%.12sroot ::= %s\n", prefix, name) || g.out.len > GM_MAX_TEXT))
        rc = fu_errorf(FU_ERR_EXHAUSTED, "json_schema: the grammar is too large");
    for (size_t i = 0; i < g.n_refs; i++) free(g.refs[i].ref);
    free(g.refs);
    *out = g.out;
    return rc;
}

int js_schema_gbnf(const json_t *schema, char **text, size_t *len) {
    fu_buf b = {0};
    *text = NULL;
    int rc = js_schema_rules(schema, "", &b);
    if (!rc && fu_buf_append(&b, js_base, strlen(js_base))) rc = fu_errorf(FU_ERR_NOMEM, "json_schema: out of memory");
    if (rc) {
        fu_buf_free(&b);
        return rc;
    }
    *text = b.data;
    if (len) *len = b.len;
    return FU_OK;
}

int js_schema_grammar(const json_t *schema, gm_grammar **out) {
    char *text;
    size_t len;
    *out = NULL;
    int rc = js_schema_gbnf(schema, &text, &len);
    if (rc) return rc;
    rc = gm_grammar_parse(text, len, "root", out);
    free(text);
    if (rc && strstr(fu_last_error(), "no finite string"))
        return fu_errorf(FU_ERR_INVALID, "json_schema: the schema admits no finite value (a $ref recursion that never ends)");
    if (rc) return fu_errorf(rc, "json_schema: %s", fu_last_error());
    return FU_OK;
}

int js_schema_grammar_text(const char *text, size_t len, gm_grammar **out) {
    *out = NULL;
    if (len > JS_MAX_SCHEMA_BYTES) return fu_errorf(FU_ERR_EXHAUSTED, "json_schema: the schema is over %u bytes", JS_MAX_SCHEMA_BYTES);
    json_error_t e;
    json_t *s = json_loadb(text, len, JSON_DECODE_ANY, &e);
    if (!s) return fu_errorf(FU_ERR_INVALID, "json_schema: malformed JSON: %s", e.text);
    int rc = js_schema_grammar(s, out);
    json_decref(s);
    return rc;
}

int js_object_grammar(gm_grammar **out) {
    fu_buf b = {0};
    int rc = fu_buf_appendf(&b, "root ::= object\n%s", js_base) ? fu_errorf(FU_ERR_NOMEM, "json_schema") : FU_OK;
    if (!rc) rc = gm_grammar_parse(b.data, b.len, "root", out);
    fu_buf_free(&b);
    return rc;
}
