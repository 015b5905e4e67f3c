/* grammar.c -- llama.cpp's GBNF parsed into rules, quantifiers made rules of their own, and the
 * checks a matcher relies on (defined rules, no left recursion, a finite string). */
#include "grammar-impl.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "grow.h"
#include "status.h"

/* ---- the builder ------------------------------------------------------------------------ */

typedef struct gb_seq {
    gm_elem *e;
    size_t n, cap;
} gb_seq;

typedef struct gb_rule {
    char *name;
    int defined;
    gb_seq *alts;
    size_t n_alts, cap_alts;
} gb_rule;

typedef struct gb {
    gb_rule *rules;
    size_t n_rules, cap_rules;
    int32_t *hash;        /* (hcap) rule ids + 1 by name; 0: empty */
    size_t hcap;
    gm_cset *sets;
    size_t n_sets, cap_sets;
    uint32_t *ranges;     /* lo, hi pairs */
    size_t n_ranges, cap_ranges;
    int32_t ascii_set[128]; /* the one-character set of each ASCII character, + 1 */
    size_t total_elems;
    const char *src, *p, *end;
    int anon;             /* anonymous rules made so far */
    int err;
} gb;

static void gb_seq_free(gb_seq *s) {
    free(s->e);
    memset(s, 0, sizeof *s);
}

static void gb_free(gb *b) {
    for (size_t i = 0; i < b->n_rules; i++) {
        for (size_t a = 0; a < b->rules[i].n_alts; a++) gb_seq_free(&b->rules[i].alts[a]);
        free(b->rules[i].alts);
        free(b->rules[i].name);
    }
    free(b->rules);
    free(b->hash);
    free(b->sets);
    free(b->ranges);
}

/* Records the first error (FU_ERR_INVALID at the parser's line and column) and returns it. */
static int gb_fail(gb *b, int status, const char *fmt, ...) {
    if (b->err) return b->err;
    char msg[256];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    int line = 1, col = 1;
    for (const char *q = b->src; b->src && q < b->p && q < b->end; q++) {
        if (*q == '\n') line++, col = 1;
        else col++;
    }
    b->err = b->src ? fu_errorf(status, "grammar: %s at line %d, column %d", msg, line, col)
                    : fu_errorf(status, "grammar: %s", msg);
    return b->err;
}

static int gb_push(gb *b, gb_seq *s, int type, uint32_t arg) {
    if (b->total_elems >= GM_MAX_ELEMS) return gb_fail(b, FU_ERR_EXHAUSTED, "more than %u elements", GM_MAX_ELEMS);
    if (fu_grow((void **)&s->e, &s->cap, s->n + 1, sizeof *s->e)) return gb_fail(b, FU_ERR_NOMEM, "out of memory");
    s->e[s->n++] = (gm_elem){(uint32_t)type, arg};
    b->total_elems++;
    return FU_OK;
}

static int gb_append(gb *b, gb_seq *dst, const gb_seq *src) {
    for (size_t i = 0; i < src->n; i++)
        if (gb_push(b, dst, (int)src->e[i].type, src->e[i].arg)) return b->err;
    return FU_OK;
}

static uint64_t gb_hash_name(const char *s, size_t n) {
    uint64_t h = 1469598103934665603ull;
    for (size_t i = 0; i < n; i++) h = (h ^ (uint8_t)s[i]) * 1099511628211ull;
    return h;
}

/* Inserts rule id under its name into the hash (rebuilding it when over half full). */
static int gb_hash_put(gb *b, int id);

static int gb_hash_rebuild(gb *b, size_t cap) {
    int32_t *h = calloc(cap, sizeof *h);
    if (!h) return gb_fail(b, FU_ERR_NOMEM, "out of memory");
    free(b->hash);
    b->hash = h;
    b->hcap = cap;
    for (size_t i = 0; i + 1 < b->n_rules; i++) gb_hash_put(b, (int)i);
    return FU_OK;
}

static int gb_hash_put(gb *b, int id) {
    const char *name = b->rules[id].name;
    size_t i = gb_hash_name(name, strlen(name)) & (b->hcap - 1);
    while (b->hash[i]) i = (i + 1) & (b->hcap - 1);
    b->hash[i] = id + 1;
    return FU_OK;
}

/* The id of the rule named s[0..n), or -1. */
static int gb_find(const gb *b, const char *s, size_t n) {
    if (!b->hcap) return -1;
    size_t i = gb_hash_name(s, n) & (b->hcap - 1);
    for (; b->hash[i]; i = (i + 1) & (b->hcap - 1)) {
        const char *name = b->rules[b->hash[i] - 1].name;
        if (strlen(name) == n && !memcmp(name, s, n)) return b->hash[i] - 1;
    }
    return -1;
}

/* Adds a rule named s[0..n) (undefined so far); returns its id or a negative status. */
static int gb_add_rule(gb *b, const char *s, size_t n) {
    if (b->n_rules >= GM_MAX_RULES) return gb_fail(b, FU_ERR_EXHAUSTED, "more than %d rules", GM_MAX_RULES);
    if (fu_grow((void **)&b->rules, &b->cap_rules, b->n_rules + 1, sizeof *b->rules))
        return gb_fail(b, FU_ERR_NOMEM, "out of memory");
    gb_rule *r = &b->rules[b->n_rules++];
    memset(r, 0, sizeof *r);
    r->name = malloc(n + 1);
    if (!r->name) return gb_fail(b, FU_ERR_NOMEM, "out of memory");
    memcpy(r->name, s, n);
    r->name[n] = 0;
    if ((b->n_rules * 2 > b->hcap) && gb_hash_rebuild(b, b->hcap ? b->hcap * 2 : 64)) return b->err;
    gb_hash_put(b, (int)b->n_rules - 1);
    return (int)b->n_rules - 1;
}

/* The id of rule s[0..n), added (undefined) when new. */
static int gb_rule_id(gb *b, const char *s, size_t n) {
    int id = gb_find(b, s, n);
    return id >= 0 ? id : gb_add_rule(b, s, n);
}

/* A new anonymous rule named after `base`; its id or a negative status. */
static int gb_anon_rule(gb *b, const char *base) {
    char name[96];
    int n = snprintf(name, sizeof name, "%.60s-%d", base, ++b->anon);
    int id = gb_add_rule(b, name, (size_t)n);
    if (id >= 0) b->rules[id].defined = 1;
    return id;
}

/* Moves seq s (emptied) into rule id as a new alternative. */
static int gb_add_alt(gb *b, int id, gb_seq *s) {
    gb_rule *r = &b->rules[id];
    if (fu_grow((void **)&r->alts, &r->cap_alts, r->n_alts + 1, sizeof *r->alts)) {
        gb_seq_free(s);
        return gb_fail(b, FU_ERR_NOMEM, "out of memory");
    }
    r->alts[r->n_alts++] = *s;
    memset(s, 0, sizeof *s);
    return FU_OK;
}

/* ---- character sets ----------------------------------------------------------------------- */

static int gb_range_cmp(const void *a, const void *b) {
    const uint32_t *x = a, *y = b;
    return (x[0] > y[0]) - (x[0] < y[0]);
}

/* Sorts and merges pairs r[0..2n); returns the new pair count. */
size_t gm_ranges_norm(uint32_t *r, size_t n) {
    if (!n) return 0;
    qsort(r, n, 2 * sizeof *r, gb_range_cmp);
    size_t m = 0;
    for (size_t i = 1; i < n; i++) {
        if (r[2 * i] <= r[2 * m + 1] + 1) {
            if (r[2 * i + 1] > r[2 * m + 1]) r[2 * m + 1] = r[2 * i + 1];
        } else {
            m++;
            r[2 * m] = r[2 * i];
            r[2 * m + 1] = r[2 * i + 1];
        }
    }
    return m + 1;
}

/* The complement over [0, 0x10FFFF] of normalized pairs r[0..2n) into out (2n + 2 entries). */
size_t gm_ranges_not(const uint32_t *r, size_t n, uint32_t *out) {
    size_t m = 0;
    uint32_t next = 0;
    for (size_t i = 0; i < n; i++) {
        if (r[2 * i] > next) out[2 * m] = next, out[2 * m + 1] = r[2 * i] - 1, m++;
        next = r[2 * i + 1] + 1;
    }
    if (next <= 0x10FFFF) out[2 * m] = next, out[2 * m + 1] = 0x10FFFF, m++;
    return m;
}

/* Adds the set of normalized pairs r[0..2n); returns its index or a negative status. */
static int gb_add_set(gb *b, const uint32_t *r, size_t n) {
    if (fu_grow((void **)&b->sets, &b->cap_sets, b->n_sets + 1, sizeof *b->sets) ||
        fu_grow((void **)&b->ranges, &b->cap_ranges, 2 * (b->n_ranges + n), sizeof *b->ranges))
        return gb_fail(b, FU_ERR_NOMEM, "out of memory");
    gm_cset *s = &b->sets[b->n_sets];
    memset(s, 0, sizeof *s);
    s->off = (uint32_t)b->n_ranges;
    s->n = (uint32_t)n;
    if (n) memcpy(b->ranges + 2 * b->n_ranges, r, 2 * n * sizeof *r);
    b->n_ranges += n;
    for (size_t i = 0; i < n; i++) {
        for (uint32_t c = r[2 * i]; c <= r[2 * i + 1] && c < 128; c++) s->ascii[c >> 5] |= 1u << (c & 31);
        if (r[2 * i + 1] >= 128) s->wide = 1;
    }
    return (int)b->n_sets++;
}

/* The set holding code point c alone. */
static int gb_char_set(gb *b, uint32_t c) {
    if (c < 128 && b->ascii_set[c]) return b->ascii_set[c] - 1;
    uint32_t r[2] = {c, c};
    int id = gb_add_set(b, r, 1);
    if (id >= 0 && c < 128) b->ascii_set[c] = id + 1;
    return id;
}

/* ---- finishing ------------------------------------------------------------------------------ */

static int gb_check_defined(gb *b) {
    for (size_t i = 0; i < b->n_rules; i++)
        if (!b->rules[i].defined) return gb_fail(b, FU_ERR_INVALID, "rule '%s' is used but not defined", b->rules[i].name);
    return FU_OK;
}

/* Flattens the rules into g. */
static int gb_flatten(gb *b, gm_grammar *g) {
    size_t n_alts = 0, n_elems = 0;
    for (size_t i = 0; i < b->n_rules; i++) {
        n_alts += b->rules[i].n_alts;
        for (size_t a = 0; a < b->rules[i].n_alts; a++) n_elems += b->rules[i].alts[a].n + 1;
    }
    g->elems = malloc((n_elems + 1) * sizeof *g->elems);
    g->alts = malloc((n_alts + 1) * sizeof *g->alts);
    g->rule_alt = malloc((b->n_rules + 1) * sizeof *g->rule_alt);
    if (!g->elems || !g->alts || !g->rule_alt) return gb_fail(b, FU_ERR_NOMEM, "out of memory");
    uint32_t e = 0, k = 0;
    for (size_t i = 0; i < b->n_rules; i++) {
        g->rule_alt[i] = k;
        for (size_t a = 0; a < b->rules[i].n_alts; a++) {
            g->alts[k++] = e;
            if (b->rules[i].alts[a].n) memcpy(g->elems + e, b->rules[i].alts[a].e, b->rules[i].alts[a].n * sizeof *g->elems);
            e += (uint32_t)b->rules[i].alts[a].n;
            g->elems[e++] = (gm_elem){GM_END, 0};
        }
    }
    g->rule_alt[b->n_rules] = k;
    g->n_elems = e;
    g->n_rules = (int)b->n_rules;
    g->sets = b->sets;
    g->ranges = b->ranges;
    b->sets = NULL;
    b->ranges = NULL;
    return FU_OK;
}

/* Whether alternative a of g is made only of elements in `ok` (rules) or, with sets_ok, sets. */
static int gm_alt_all(const gm_grammar *g, uint32_t a, const uint8_t *ok, int sets_ok) {
    for (uint32_t p = g->alts[a]; g->elems[p].type != GM_END; p++) {
        if (g->elems[p].type == GM_SET ? !sets_ok || !g->sets[g->elems[p].arg].n : !ok[g->elems[p].arg])
            return 0;
    }
    return 1;
}

/* Fixpoint: rules with an alternative all of whose elements qualify (nullable: no sets;
 * productive: non-empty sets and productive rules). */
static void gm_fixpoint(const gm_grammar *g, uint8_t *ok, int sets_ok) {
    memset(ok, 0, (size_t)g->n_rules);
    for (int changed = 1; changed;) {
        changed = 0;
        for (int r = 0; r < g->n_rules; r++) {
            for (uint32_t a = g->rule_alt[r]; !ok[r] && a < g->rule_alt[r + 1]; a++)
                if (gm_alt_all(g, a, ok, sets_ok)) ok[r] = 1, changed = 1;
        }
    }
}

/* The leftmost rules of each rule (those that may start it): CSR into *off / *to. */
static int gm_left_edges(const gm_grammar *g, const uint8_t *nullable, uint32_t **off, uint32_t **to) {
    *off = calloc((size_t)g->n_rules + 1, sizeof **off);
    *to = malloc(((size_t)g->n_elems + 1) * sizeof **to);
    if (!*off || !*to) return fu_errorf(FU_ERR_NOMEM, "grammar: out of memory");
    uint32_t n = 0;
    for (int r = 0; r < g->n_rules; r++) {
        (*off)[r] = n;
        for (uint32_t a = g->rule_alt[r]; a < g->rule_alt[r + 1]; a++) {
            for (uint32_t p = g->alts[a]; g->elems[p].type == GM_REF; p++) {
                (*to)[n++] = g->elems[p].arg;
                if (!nullable[g->elems[p].arg]) break;
            }
        }
    }
    (*off)[g->n_rules] = n;
    return FU_OK;
}

/* Iterative DFS over the leftmost-rule graph: the first rule on a cycle, or -1. */
static int gm_find_left_cycle(const gm_grammar *g, const uint32_t *off, const uint32_t *to, uint8_t *color,
                              uint32_t *stk, uint32_t *it) {
    for (int s = 0; s < g->n_rules; s++) {
        if (color[s]) continue;
        int sp = 0;
        stk[sp] = (uint32_t)s, it[sp] = off[s], color[s] = 1;
        while (sp >= 0) {
            uint32_t r = stk[sp];
            if (it[sp] == off[r + 1]) {
                color[r] = 2, sp--;
                continue;
            }
            uint32_t t = to[it[sp]++];
            if (color[t] == 1) return (int)t;
            if (!color[t]) sp++, stk[sp] = t, it[sp] = off[t], color[t] = 1;
        }
    }
    return -1;
}

static int gm_check(gb *b, gm_grammar *g) {
    size_t R = (size_t)g->n_rules;
    uint8_t *nullable = malloc(R), *color = calloc(R, 1);
    uint32_t *stk = malloc(R * sizeof *stk), *it = malloc(R * sizeof *it), *off = NULL, *to = NULL;
    int rc = !nullable || !color || !stk || !it ? gb_fail(b, FU_ERR_NOMEM, "out of memory") : FU_OK;
    if (!rc) {
        gm_fixpoint(g, nullable, 0);
        rc = gm_left_edges(g, nullable, &off, &to);
    }
    int cyc = rc ? -1 : gm_find_left_cycle(g, off, to, color, stk, it);
    if (cyc >= 0) rc = gb_fail(b, FU_ERR_INVALID, "rule '%s' is left-recursive", b->rules[cyc].name);
    if (!rc) {
        gm_fixpoint(g, nullable, 1); /* now: productive */
        if (!nullable[g->root])
            rc = gb_fail(b, FU_ERR_INVALID, "rule '%s' derives no finite string", b->rules[g->root].name);
    }
    free(nullable), free(color), free(stk), free(it), free(off), free(to);
    return rc;
}

void gm_grammar_free(gm_grammar *g) {
    if (!g) return;
    free(g->elems);
    free(g->alts);
    free(g->rule_alt);
    free(g->sets);
    free(g->ranges);
    free(g);
}

int gm_grammar_rules(const gm_grammar *g) { return g->n_rules; }

/* Turns a parsed builder into a grammar starting at rule `root`. */
static int gb_finish(gb *b, const char *root, gm_grammar **out) {
    b->src = NULL;
    int id = gb_find(b, root, strlen(root));
    if (id < 0) return gb_fail(b, FU_ERR_INVALID, "no rule '%s' to start from", root);
    if (gb_check_defined(b)) return b->err;
    gm_grammar *g = calloc(1, sizeof *g);
    if (!g) return gb_fail(b, FU_ERR_NOMEM, "out of memory");
    g->root = id;
    if (gb_flatten(b, g) || gm_check(b, g)) {
        gm_grammar_free(g);
        return b->err;
    }
    *out = g;
    return FU_OK;
}

/* ---- GBNF ------------------------------------------------------------------------------- */

static int gb_alts(gb *b, int rule, int nested);

/* Skips blanks and # comments; newlines too when nl. */
static void gb_space(gb *b, int nl) {
    while (b->p < b->end) {
        char c = *b->p;
        if (c == ' ' || c == '\t' || (nl && (c == '\n' || c == '\r'))) {
            b->p++;
        } else if (c == '#') {
            while (b->p < b->end && *b->p != '\n') b->p++;
        } else {
            break;
        }
    }
}

static int gb_is_name(char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '-' || c == '_';
}

static size_t gb_name_len(const gb *b) {
    size_t n = 0;
    while (b->p + n < b->end && gb_is_name(b->p[n])) n++;
    return n;
}

/* Decodes one UTF-8 code point at b->p (advancing); -1 when malformed. */
static int64_t gb_utf8(gb *b) {
    const uint8_t *s = (const uint8_t *)b->p;
    size_t avail = (size_t)(b->end - b->p);
    uint32_t c = s[0];
    int n = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 0;
    if (!n || (size_t)n > avail) return -1;
    if (n > 1) c &= 0x3Fu >> (n - 1);
    for (int i = 1; i < n; i++) {
        if ((s[i] & 0xC0) != 0x80) return -1;
        c = (c << 6) | (s[i] & 0x3Fu);
    }
    b->p += n;
    return c;
}

/* Reads `digits` hex digits; -1 when malformed. */
static int64_t gb_hex(gb *b, int digits) {
    uint32_t v = 0;
    for (int i = 0; i < digits; i++, b->p++) {
        if (b->p >= b->end) return -1;
        char c = *b->p;
        int d = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : c >= 'A' && c <= 'F' ? c - 'A' + 10 : -1;
        if (d < 0) return -1;
        v = v * 16 + (uint32_t)d;
        if (v > 0x10FFFF) return -1;
    }
    return (int64_t)v;
}

/* One character of a literal or class (escapes included); -1 (error recorded) when malformed. */
static int64_t gb_char(gb *b) {
    if (b->p >= b->end) return gb_fail(b, FU_ERR_INVALID, "unexpected end"), -1;
    if (*b->p != '\\') {
        int64_t c = gb_utf8(b);
        if (c < 0) gb_fail(b, FU_ERR_INVALID, "malformed UTF-8");
        return c;
    }
    b->p++;
    if (b->p >= b->end) return gb_fail(b, FU_ERR_INVALID, "unexpected end after '\\'"), -1;
    char e = *b->p++;
    int64_t c = e == 'n' ? '\n' : e == 't' ? '\t' : e == 'r' ? '\r' : e == '0' ? 0
              : e == 'x' ? gb_hex(b, 2) : e == 'u' ? gb_hex(b, 4) : e == 'U' ? gb_hex(b, 8)
              : (e == '\\' || e == '"' || e == '[' || e == ']' || e == '-' || e == '^' || e == '/') ? e : -2;
    if (c == -2) gb_fail(b, FU_ERR_INVALID, "unknown escape '\\%c'", e);
    else if (c < 0) gb_fail(b, FU_ERR_INVALID, "malformed escape");
    return c < 0 ? -1 : c;
}

/* "literal": one set element per character, appended to s. */
static int gb_literal(gb *b, gb_seq *s) {
    b->p++;
    while (b->p < b->end && *b->p != '"') {
        int64_t c = gb_char(b);
        if (c < 0) return b->err;
        int set = gb_char_set(b, (uint32_t)c);
        if (set < 0 || gb_push(b, s, GM_SET, (uint32_t)set)) return b->err;
    }
    if (b->p >= b->end) return gb_fail(b, FU_ERR_INVALID, "unterminated string literal");
    b->p++;
    return FU_OK;
}

/* [class] or [^class]: one set element appended to s. */
static int gb_class(gb *b, gb_seq *s) {
    b->p++;
    int neg = b->p < b->end && *b->p == '^';
    if (neg) b->p++;
    uint32_t *r = NULL;
    size_t n = 0, cap = 0;
    while (b->p < b->end && *b->p != ']') {
        int64_t lo = gb_char(b), hi = lo;
        if (lo >= 0 && b->p + 1 < b->end && *b->p == '-' && b->p[1] != ']') {
            b->p++;
            hi = gb_char(b);
        }
        if (lo < 0 || hi < 0) break;
        if (hi < lo) gb_fail(b, FU_ERR_INVALID, "range out of order");
        else if (fu_grow((void **)&r, &cap, 2 * n + 2, sizeof *r)) gb_fail(b, FU_ERR_NOMEM, "out of memory");
        if (b->err) break;
        r[2 * n] = (uint32_t)lo, r[2 * n + 1] = (uint32_t)hi, n++;
    }
    if (!b->err && b->p >= b->end) gb_fail(b, FU_ERR_INVALID, "unterminated character class");
    uint32_t *c = b->err ? NULL : malloc((2 * n + 2) * sizeof *c);
    if (!b->err && !c) gb_fail(b, FU_ERR_NOMEM, "out of memory");
    if (!b->err) {
        b->p++;
        n = gm_ranges_norm(r, n);
        if (neg) n = gm_ranges_not(r, n, c);
        int set = gb_add_set(b, neg ? c : r, n);
        if (set >= 0) gb_push(b, s, GM_SET, (uint32_t)set);
    }
    free(r);
    free(c);
    return b->err;
}

/* Rule R ::= it R | "" (it*), returning R. */
static int gb_star(gb *b, const gb_seq *it) {
    int r = gb_anon_rule(b, "star");
    gb_seq a = {0}, e = {0};
    if (r < 0 || gb_append(b, &a, it) || gb_push(b, &a, GM_REF, (uint32_t)r) || gb_add_alt(b, r, &a) ||
        gb_add_alt(b, r, &e)) {
        gb_seq_free(&a);
        return b->err ? b->err : r;
    }
    return r;
}

/* Rule R ::= it next | "" (next < 0: R ::= it | ""), returning R. */
static int gb_opt(gb *b, const gb_seq *it, int next) {
    int r = gb_anon_rule(b, "opt");
    gb_seq a = {0}, e = {0};
    if (r < 0 || gb_append(b, &a, it) || (next >= 0 && gb_push(b, &a, GM_REF, (uint32_t)next)) ||
        gb_add_alt(b, r, &a) || gb_add_alt(b, r, &e)) {
        gb_seq_free(&a);
        return b->err ? b->err : r;
    }
    return r;
}

/* Reads an unsigned decimal up to GM_MAX_REPEAT; -1 (error recorded) otherwise. */
static long gb_count(gb *b) {
    long v = 0;
    const char *start = b->p;
    while (b->p < b->end && *b->p >= '0' && *b->p <= '9' && v <= GM_MAX_REPEAT) v = v * 10 + (*b->p++ - '0');
    if (b->p == start) return gb_fail(b, FU_ERR_INVALID, "expected a number"), -1;
    if (v > GM_MAX_REPEAT) return gb_fail(b, FU_ERR_EXHAUSTED, "repetition count over %d", GM_MAX_REPEAT), -1;
    return v;
}

/* {m}, {m,} or {m,n} after an item: *lo, *hi (-1: unbounded). */
static int gb_braces(gb *b, long *lo, long *hi) {
    b->p++;
    gb_space(b, 0);
    if ((*lo = gb_count(b)) < 0) return b->err;
    gb_space(b, 0);
    *hi = *lo;
    if (b->p < b->end && *b->p == ',') {
        b->p++;
        gb_space(b, 0);
        *hi = b->p < b->end && *b->p == '}' ? -1 : gb_count(b);
        if (b->err) return b->err;
        gb_space(b, 0);
    }
    if (b->p >= b->end || *b->p != '}') return gb_fail(b, FU_ERR_INVALID, "expected '}'");
    b->p++;
    if (*hi >= 0 && *hi < *lo) return gb_fail(b, FU_ERR_INVALID, "repetition {%ld,%ld} out of order", *lo, *hi);
    return FU_OK;
}

/* Appends item `it` repeated lo..hi times (hi -1: unbounded) to s. */
static int gb_repeat(gb *b, gb_seq *s, const gb_seq *it, long lo, long hi) {
    if (lo * (long)it->n > GM_MAX_REPEAT * 16L || (hi > 0 && hi * (long)it->n > GM_MAX_REPEAT * 16L))
        return gb_fail(b, FU_ERR_EXHAUSTED, "repetition too large");
    for (long i = 0; i < lo; i++)
        if (gb_append(b, s, it)) return b->err;
    int tail = -1;
    if (hi < 0) tail = gb_star(b, it);
    for (long i = lo; i < hi && !b->err; i++) tail = gb_opt(b, it, tail);
    if (b->err) return b->err;
    return tail >= 0 ? gb_push(b, s, GM_REF, (uint32_t)tail) : FU_OK;
}

/* A quantifier after item `it` (if any), then `it` appended to s. */
static int gb_quantified(gb *b, gb_seq *s, gb_seq *it) {
    long lo = 1, hi = 1;
    char c = b->p < b->end ? *b->p : 0;
    if (c == '*' || c == '+' || c == '?') {
        b->p++;
        lo = c == '+' ? 1 : 0;
        hi = c == '?' ? 1 : -1;
    } else if (c == '{') {
        if (gb_braces(b, &lo, &hi)) return b->err;
    }
    return gb_repeat(b, s, it, lo, hi);
}

/* (alternatives) as an anonymous rule: its reference appended to it. */
static int gb_group(gb *b, gb_seq *it) {
    b->p++;
    int r = gb_anon_rule(b, "group");
    if (r < 0) return b->err;
    gb_space(b, 1);
    if (gb_alts(b, r, 1)) return b->err;
    if (b->p >= b->end || *b->p != ')') return gb_fail(b, FU_ERR_INVALID, "expected ')'");
    b->p++;
    return gb_push(b, it, GM_REF, (uint32_t)r);
}

/* One item into it (a literal, class, `.`, group or rule name). */
static int gb_item(gb *b, gb_seq *it) {
    char c = *b->p;
    if (c == '"') return gb_literal(b, it);
    if (c == '[') return gb_class(b, it);
    if (c == '(') return gb_group(b, it);
    if (c == '.') {
        b->p++;
        static const uint32_t any[2] = {0, 0x10FFFF};
        int set = gb_add_set(b, any, 1);
        return set < 0 ? b->err : gb_push(b, it, GM_SET, (uint32_t)set);
    }
    size_t n = gb_name_len(b);
    if (!n) return gb_fail(b, FU_ERR_INVALID, "unexpected '%c'", c);
    int r = gb_rule_id(b, b->p, n);
    b->p += n;
    return r < 0 ? b->err : gb_push(b, it, GM_REF, (uint32_t)r);
}

/* A sequence of items (up to '|', ')', or the line's end when not nested) into s. */
static int gb_sequence(gb *b, gb_seq *s, int nested) {
    for (;;) {
        gb_space(b, nested);
        if (b->p >= b->end) return FU_OK;
        char c = *b->p;
        if (c == '|' || c == ')' || c == '\n' || c == '\r') return FU_OK;
        gb_seq it = {0};
        int rc = gb_item(b, &it);
        if (!rc) rc = gb_quantified(b, s, &it);
        gb_seq_free(&it);
        if (rc) return rc;
    }
}

/* Alternatives separated by '|' into rule `rule`. */
static int gb_alts(gb *b, int rule, int nested) {
    for (;;) {
        gb_seq s = {0};
        if (gb_sequence(b, &s, nested) || gb_add_alt(b, rule, &s)) {
            gb_seq_free(&s);
            return b->err;
        }
        if (b->p >= b->end || *b->p != '|') return FU_OK;
        b->p++;
        gb_space(b, 1);
    }
}

/* name ::= alternatives */
static int gb_rule_def(gb *b) {
    size_t n = gb_name_len(b);
    if (!n) return gb_fail(b, FU_ERR_INVALID, "expected a rule name");
    int r = gb_rule_id(b, b->p, n);
    if (r < 0) return b->err;
    if (b->rules[r].defined) return gb_fail(b, FU_ERR_INVALID, "rule '%s' defined twice", b->rules[r].name);
    b->rules[r].defined = 1;
    b->p += n;
    gb_space(b, 0);
    if (b->end - b->p < 3 || memcmp(b->p, "::=", 3)) return gb_fail(b, FU_ERR_INVALID, "expected '::='");
    b->p += 3;
    gb_space(b, 1);
    if (gb_alts(b, r, 0)) return b->err;
    if (b->p < b->end && *b->p != '\n' && *b->p != '\r') return gb_fail(b, FU_ERR_INVALID, "unexpected '%c'", *b->p);
    return FU_OK;
}

int gm_grammar_parse(const char *text, size_t len, const char *root, gm_grammar **out) {
    *out = NULL;
    if (len > GM_MAX_TEXT) return fu_errorf(FU_ERR_EXHAUSTED, "grammar: over %u bytes", GM_MAX_TEXT);
    gb b;
    memset(&b, 0, sizeof b);
    b.src = b.p = text;
    b.end = text + len;
    for (gb_space(&b, 1); b.p < b.end && !b.err; gb_space(&b, 1)) gb_rule_def(&b);
    int rc = b.err ? b.err : gb_finish(&b, root ? root : "root", out);
    gb_free(&b);
    return rc;
}
