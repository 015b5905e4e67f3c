/* json-schema-regex.c -- a JSON Schema `pattern` (a regex subset) as GBNF over JSON string contents. */
#include <stdlib.h>
#include <string.h>

#include "grammar-impl.h"
#include "grow.h"
#include "json-schema-impl.h"
#include "json-schema.h"
#include "status.h"

typedef struct rx {
    const char *p, *end, *pattern;
    fu_buf *out;
    int depth;
} rx;

static int rx_fail(const rx *r, const char *what) {
    return fu_errorf(FU_ERR_INVALID, "json_schema: 'pattern' \"%.100s\": %s at offset %d", r->pattern, what,
                     (int)(r->p - r->pattern));
}

int js_gbnf_char(fu_buf *out, uint32_t c, int in_class) {
    int special = c == '"' || c == '\\' || (in_class && (c == ']' || c == '-' || c == '^' || c == '['));
    if (special) return fu_buf_appendf(out, "\\%c", (char)c) ? FU_ERR_NOMEM : FU_OK;
    if (c >= 0x20 && c < 0x7F) return fu_buf_appendf(out, "%c", (char)c) ? FU_ERR_NOMEM : FU_OK;
    if (c < 0x100) return fu_buf_appendf(out, "\\x%02X", c) ? FU_ERR_NOMEM : FU_OK;
    if (c < 0x10000) return fu_buf_appendf(out, "\\u%04X", c) ? FU_ERR_NOMEM : FU_OK;
    return fu_buf_appendf(out, "\\U%08X", c) ? FU_ERR_NOMEM : FU_OK;
}

/* Decodes one UTF-8 code point of s (advancing *s); 0xFFFD when malformed. */
static uint32_t rx_utf8(const char **s, const char *end) {
    const uint8_t *u = (const uint8_t *)*s;
    uint32_t c = u[0];
    int n = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 1;
    if (n > end - *s) n = 1;
    if (n > 1) c &= 0x3Fu >> (n - 1);
    for (int i = 1; i < n; i++) c = (c << 6) | (u[i] & 0x3Fu);
    *s += n;
    return c;
}

int js_gbnf_literal(fu_buf *out, const char *s, size_t n) {
    const char *end = s + n;
    if (fu_buf_append(out, "\"", 1)) return FU_ERR_NOMEM;
    while (s < end)
        if (js_gbnf_char(out, rx_utf8(&s, end), 0)) return FU_ERR_NOMEM;
    return fu_buf_append(out, "\"", 1) ? FU_ERR_NOMEM : FU_OK;
}

/* A character as JSON string contents: itself, or its escape. */
static int rx_json_char(fu_buf *out, uint32_t c) {
    if (c == '"') return fu_buf_append(out, "\"\\\\\\\"\"", 6) ? FU_ERR_NOMEM : FU_OK;
    if (c == '\\') return fu_buf_append(out, "\"\\\\\\\\\"", 6) ? FU_ERR_NOMEM : FU_OK;
    if (c < 0x20) {
        const char *e = c == '\n' ? "n" : c == '\t' ? "t" : c == '\r' ? "r" : NULL;
        return (e ? fu_buf_appendf(out, "\"\\\\%s\"", e) : fu_buf_appendf(out, "\"\\\\u00%02X\"", c)) ? FU_ERR_NOMEM : FU_OK;
    }
    if (fu_buf_append(out, "\"", 1) || js_gbnf_char(out, c, 0)) return FU_ERR_NOMEM;
    return fu_buf_append(out, "\"", 1) ? FU_ERR_NOMEM : FU_OK;
}

/* ---- classes ------------------------------------------------------------------------------ */

typedef struct rx_set {
    uint32_t *r;  /* lo, hi pairs */
    size_t n, cap;
} rx_set;

static int rx_set_add(rx_set *s, uint32_t lo, uint32_t hi) {
    if (fu_grow((void **)&s->r, &s->cap, 2 * s->n + 2, sizeof *s->r)) return FU_ERR_NOMEM;
    s->r[2 * s->n] = lo, s->r[2 * s->n + 1] = hi, s->n++;
    return FU_OK;
}

/* \d \w \s (upper case: negated) into s; 1 if e was one of them. */
static int rx_shorthand(rx_set *s, char e, int *negate) {
    static const uint32_t d[] = {'0', '9'}, w[] = {'0', '9', 'A', 'Z', '_', '_', 'a', 'z'},
                          sp[] = {'\t', '\r', ' ', ' '};
    const uint32_t *t = NULL;
    size_t n = 0;
    char l = (char)(e | 0x20);
    if (l == 'd') t = d, n = 1;
    else if (l == 'w') t = w, n = 4;
    else if (l == 's') t = sp, n = 2;
    if (!t) return 0;
    *negate = e != l;
    for (size_t i = 0; i < n; i++)
        if (rx_set_add(s, t[2 * i], t[2 * i + 1])) return -1;
    return 1;
}

/* The character an escape stands for, or -1 when unsupported. */
static int64_t rx_escape_char(char e) {
    if (e == 'n') return '\n';
    if (e == 't') return '\t';
    if (e == 'r') return '\r';
    if (strchr(".^$|?*+()[]{}\\/-\"", e)) return (unsigned char)e;
    return -1;
}

/* Emits set s (normalized here; negated when neg) as a GBNF alternative group restricted to what a
 * JSON string may hold raw, plus escaped `"` and `\` when the set holds them. */
static int rx_emit_set(rx *r, rx_set *s, int neg) {
    size_t n = gm_ranges_norm(s->r, s->n);
    /* the complement holds at most n + 1 ranges, and each range is cut into at most 3 raw ones */
    uint32_t *c = malloc((2 * n + 2) * sizeof *c), *raw = malloc((6 * n + 6) * sizeof *raw);
    int rc = !c || !raw ? FU_ERR_NOMEM : FU_OK;
    if (!rc && neg) n = gm_ranges_not(s->r, n, c);
    const uint32_t *set = neg ? c : s->r;
    int quote = 0, bslash = 0;
    size_t m = 0;
    for (size_t i = 0; !rc && i < n; i++) {
        uint32_t lo = set[2 * i] < 0x20 ? 0x20 : set[2 * i], hi = set[2 * i + 1];
        quote |= lo <= '"' && hi >= '"';
        bslash |= lo <= '\\' && hi >= '\\';
        uint32_t cuts[3][2] = {{lo, hi < '"' ? hi : '"' - 1}, {lo > '"' + 1 ? lo : '"' + 1, hi < '\\' ? hi : '\\' - 1},
                               {lo > '\\' + 1 ? lo : '\\' + 1, hi}};
        for (int k = 0; k < 3; k++)
            if (cuts[k][0] <= cuts[k][1] && cuts[k][1] >= lo && cuts[k][0] <= hi) raw[2 * m] = cuts[k][0], raw[2 * m + 1] = cuts[k][1], m++;
    }
    if (!rc && !m && !quote && !bslash) rc = rx_fail(r, "a class that matches nothing");
    int alts = 0;
    if (!rc && fu_buf_append(r->out, "(", 1)) rc = FU_ERR_NOMEM;
    if (!rc && m) {
        rc = fu_buf_append(r->out, "[", 1) ? FU_ERR_NOMEM : FU_OK;
        for (size_t i = 0; !rc && i < m; i++) {
            rc = js_gbnf_char(r->out, raw[2 * i], 1);
            if (!rc && raw[2 * i + 1] != raw[2 * i])
                rc = fu_buf_append(r->out, "-", 1) ? FU_ERR_NOMEM : js_gbnf_char(r->out, raw[2 * i + 1], 1);
        }
        if (!rc) rc = fu_buf_append(r->out, "]", 1) ? FU_ERR_NOMEM : FU_OK;
        alts++;
    }
    for (int k = 0; k < 2 && !rc; k++) {
        if (!(k ? bslash : quote)) continue;
        if (alts++ && fu_buf_append(r->out, " | ", 3)) rc = FU_ERR_NOMEM;
        if (!rc) rc = rx_json_char(r->out, k ? '\\' : '"');
    }
    if (!rc && fu_buf_append(r->out, ")", 1)) rc = FU_ERR_NOMEM;
    free(c), free(raw);
    return rc == FU_ERR_NOMEM ? fu_errorf(FU_ERR_NOMEM, "json_schema: out of memory") : rc;
}

/* One class member (a char, a range or a shorthand) into s. */
static int rx_class_member(rx *r, rx_set *s) {
    uint32_t lo;
    if (*r->p == '\\') {
        if (r->p + 1 >= r->end) return rx_fail(r, "a dangling '\\'");
        int neg = 0, sh = rx_shorthand(s, r->p[1], &neg);
        if (sh < 0) return FU_ERR_NOMEM;
        if (sh && neg) return rx_fail(r, "a negated shorthand inside a class");
        if (sh) return r->p += 2, FU_OK;
        int64_t c = rx_escape_char(r->p[1]);
        if (c < 0) return rx_fail(r, "an unsupported escape");
        lo = (uint32_t)c, r->p += 2;
    } else {
        lo = rx_utf8(&r->p, r->end);
    }
    uint32_t hi = lo;
    if (r->p + 1 < r->end && *r->p == '-' && r->p[1] != ']') {
        r->p++;
        int64_t h;
        if (*r->p == '\\') {
            h = r->p + 1 < r->end ? rx_escape_char(r->p[1]) : -1;
            r->p += 2;
        } else {
            h = rx_utf8(&r->p, r->end);
        }
        if (h < lo) return rx_fail(r, "a range out of order");
        hi = (uint32_t)h;
    }
    return rx_set_add(s, lo, hi) ? FU_ERR_NOMEM : FU_OK;
}

static int rx_class(rx *r) {
    r->p++;
    int neg = r->p < r->end && *r->p == '^';
    if (neg) r->p++;
    rx_set s = {0};
    int rc = FU_OK;
    while (!rc && r->p < r->end && *r->p != ']') rc = rx_class_member(r, &s);
    if (!rc && r->p >= r->end) rc = rx_fail(r, "an unterminated class");
    if (!rc) r->p++, rc = rx_emit_set(r, &s, neg);
    free(s.r);
    return rc;
}

/* ---- expressions ----------------------------------------------------------------------------- */

static int rx_alt(rx *r);

/* An escape outside a class: a shorthand class or a literal character. */
static int rx_escape(rx *r) {
    if (r->p + 1 >= r->end) return rx_fail(r, "a dangling '\\'");
    rx_set s = {0};
    int neg = 0, sh = rx_shorthand(&s, r->p[1], &neg);
    int rc = sh < 0 ? FU_ERR_NOMEM : sh ? rx_emit_set(r, &s, neg) : FU_OK;
    free(s.r);
    if (sh) return r->p += 2, rc;
    int64_t c = rx_escape_char(r->p[1]);
    if (c < 0) return rx_fail(r, "an unsupported escape (backreferences, \\b, \\p are not supported)");
    r->p += 2;
    return rx_json_char(r->out, (uint32_t)c);
}

static int rx_group(rx *r) {
    r->p++;
    if (r->p < r->end && *r->p == '?') {
        if (r->p + 1 < r->end && r->p[1] == ':') r->p += 2;
        else return rx_fail(r, "an unsupported group (lookaround or named)");
    }
    if (++r->depth > 64) return rx_fail(r, "groups nested too deep");
    if (fu_buf_append(r->out, "(", 1)) return FU_ERR_NOMEM;
    int rc = rx_alt(r);
    r->depth--;
    if (rc) return rc;
    if (r->p >= r->end || *r->p != ')') return rx_fail(r, "a missing ')'");
    r->p++;
    return fu_buf_append(r->out, ")", 1) ? FU_ERR_NOMEM : FU_OK;
}

static int rx_atom(rx *r) {
    char c = *r->p;
    if (c == '(') return rx_group(r);
    if (c == '[') return rx_class(r);
    if (c == '\\') return rx_escape(r);
    if (c == '.') return r->p++, fu_buf_append(r->out, "jchar", 5) ? FU_ERR_NOMEM : FU_OK;
    if (c == '^' || c == '$') return rx_fail(r, "an anchor that is not at the pattern's ends");
    if (c == '*' || c == '+' || c == '?' || c == '{' || c == ')') return rx_fail(r, "a misplaced operator");
    return rx_json_char(r->out, rx_utf8(&r->p, r->end));
}

/* A quantifier after an atom, copied as GBNF (a lazy '?' after it is dropped). */
static int rx_quant(rx *r) {
    if (r->p >= r->end) return FU_OK;
    char c = *r->p;
    const char *start = r->p;
    if (c == '*' || c == '+' || c == '?') {
        r->p++;
    } else if (c == '{') {
        while (r->p < r->end && *r->p != '}') {
            if (!strchr("{0123456789,", *r->p)) return rx_fail(r, "a malformed {m,n}");
            r->p++;
        }
        if (r->p >= r->end) return rx_fail(r, "a malformed {m,n}");
        r->p++;
    } else {
        return FU_OK;
    }
    if (fu_buf_append(r->out, start, (size_t)(r->p - start))) return FU_ERR_NOMEM;
    if (r->p < r->end && *r->p == '?') r->p++;
    return FU_OK;
}

static int rx_concat(rx *r) {
    while (r->p < r->end && *r->p != '|' && *r->p != ')') {
        if (fu_buf_append(r->out, " ", 1)) return FU_ERR_NOMEM;
        int rc = rx_atom(r);
        if (!rc) rc = rx_quant(r);
        if (rc) return rc;
    }
    return FU_OK;
}

static int rx_alt(rx *r) {
    for (;;) {
        int rc = rx_concat(r);
        if (rc) return rc;
        if (r->p >= r->end || *r->p != '|') return FU_OK;
        r->p++;
        if (fu_buf_append(r->out, " |", 2)) return FU_ERR_NOMEM;
    }
}

int js_regex_gbnf(const char *pattern, fu_buf *out) {
    size_t n = strlen(pattern);
    rx r = {pattern, pattern + n, pattern, out, 0};
    int head = n && pattern[0] == '^';
    int tail = n > (size_t)head && pattern[n - 1] == '$' && (n < 2 || pattern[n - 2] != '\\');
    r.p += head;
    r.end -= tail;
    if (!head && fu_buf_append(out, "jchar* ", 7)) return FU_ERR_NOMEM;
    if (fu_buf_append(out, "(", 1)) return FU_ERR_NOMEM;
    int rc = rx_alt(&r);
    if (!rc && r.p < r.end) rc = rx_fail(&r, "an unmatched ')'");
    if (rc) return rc == FU_ERR_NOMEM ? fu_errorf(FU_ERR_NOMEM, "json_schema: out of memory") : rc;
    if (fu_buf_append(out, ")", 1) || (!tail && fu_buf_append(out, " jchar*", 7))) return FU_ERR_NOMEM;
    return FU_OK;
}
