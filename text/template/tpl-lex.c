/* tpl-lex.c -- template tokenizer with jinja2's whitespace control (trim_blocks, lstrip_blocks, -/+). */
#include "tpl-impl.h"

#include <ctype.h>
#include <errno.h>
#include <stdlib.h>
#include <string.h>

typedef struct lexer {
    const char *s; /* normalized source */
    size_t n, pos;
    int line;
    bool line_starting; /* the previous match ended with a newline */
    tpl_toks *out;
    char brackets[256]; /* balancing stack of the expected closers */
    int nbrackets;
} lexer;

static int lex_fail(int line, const char *fmt, const char *arg) {
    char msg[300];
    snprintf(msg, sizeof msg, fmt, arg);
    return fu_errorf(FU_ERR_TEMPLATE, "template syntax error at line %d: %s", line, msg);
}

static int count_lines(const char *s, size_t n) {
    int c = 0;
    for (size_t i = 0; i < n; i++)
        c += s[i] == '\n';
    return c;
}

static int push_tok(lexer *L, int type, const char *text, size_t len, int line) {
    tpl_toks *t = L->out;
    if (t->n == t->cap) {
        size_t nc = t->cap ? t->cap * 2 : 64;
        tpl_tok *v = realloc(t->v, nc * sizeof *v);
        if (!v)
            return fu_errorf(FU_ERR_NOMEM, "out of memory");
        t->v = v;
        t->cap = nc;
    }
    tpl_tok *k = &t->v[t->n];
    memset(k, 0, sizeof *k);
    k->type = type;
    k->line = line;
    k->text = malloc(len + 1);
    if (!k->text)
        return fu_errorf(FU_ERR_NOMEM, "out of memory");
    if (len)
        memcpy(k->text, text, len);
    k->text[len] = '\0';
    k->len = len;
    t->n++;
    return FU_OK;
}

void tpl_toks_free(tpl_toks *t) {
    if (!t)
        return;
    for (size_t i = 0; i < t->n; i++)
        free(t->v[i].text);
    free(t->v);
    t->v = NULL;
    t->n = t->cap = 0;
}

static bool is_ws(char c) {
    return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\v' || c == '\f' ||
           (c >= 0x1c && c <= 0x1f);
}

static size_t skip_ws(const lexer *L, size_t p) {
    while (p < L->n && is_ws(L->s[p]))
        p++;
    return p;
}

/* Emits the data `text[0..len)` preceding a tag, applying the tag's
 * whitespace control: sign '-' strips all trailing whitespace; otherwise,
 * with lstrip_blocks and a block/comment tag, spaces and tabs between the
 * last newline (or the start of a line) and the tag are dropped. */
static int emit_data_before(lexer *L, const char *text, size_t len, char sign, bool is_var, int line) {
    if (sign == '-') {
        while (len > 0 && is_ws(text[len - 1]))
            len--;
    } else if (sign != '+' && !is_var) {
        size_t lpos = len;
        while (lpos > 0 && text[lpos - 1] != '\n')
            lpos--;
        if (lpos > 0 || L->line_starting) {
            bool only_blank = true;
            for (size_t i = lpos; i < len; i++)
                if (text[i] != ' ' && text[i] != '\t')
                    only_blank = false;
            if (only_blank)
                len = lpos;
        }
    }
    if (len == 0)
        return FU_OK;
    return push_tok(L, TK_DATA, text, len, line);
}

/* Matches a block end at p: "+%}", "-%}\s*" or "%}\n?". Returns the end
 * position or 0 when there is none. */
static size_t match_block_end(const lexer *L, size_t p) {
    const char *s = L->s;
    if (p + 3 <= L->n && s[p] == '+' && s[p + 1] == '%' && s[p + 2] == '}')
        return p + 3;
    if (p + 3 <= L->n && s[p] == '-' && s[p + 1] == '%' && s[p + 2] == '}')
        return skip_ws(L, p + 3);
    if (p + 2 <= L->n && s[p] == '%' && s[p + 1] == '}') {
        p += 2;
        if (p < L->n && s[p] == '\n')
            p++;
        return p;
    }
    return 0;
}

static size_t match_var_end(const lexer *L, size_t p) {
    const char *s = L->s;
    if (p + 3 <= L->n && s[p] == '-' && s[p + 1] == '}' && s[p + 2] == '}')
        return skip_ws(L, p + 3);
    if (p + 2 <= L->n && s[p] == '}' && s[p + 1] == '}')
        return p + 2;
    return 0;
}

/* Decodes a string literal body as Python's unicode-escape does. */
static int decode_string(lexer *L, const char *s, size_t n, int line) {
    char *buf = malloc(n + 1);
    if (!buf)
        return fu_errorf(FU_ERR_NOMEM, "out of memory");
    size_t o = 0;
    for (size_t i = 0; i < n; i++) {
        if (s[i] != '\\' || i + 1 >= n) {
            buf[o++] = s[i];
            continue;
        }
        char c = s[++i];
        long cp = -1;
        int hex = 0;
        switch (c) {
        case '\n': continue; /* line continuation */
        case '\\': buf[o++] = '\\'; continue;
        case '\'': buf[o++] = '\''; continue;
        case '"': buf[o++] = '"'; continue;
        case 'a': buf[o++] = '\a'; continue;
        case 'b': buf[o++] = '\b'; continue;
        case 'f': buf[o++] = '\f'; continue;
        case 'n': buf[o++] = '\n'; continue;
        case 'r': buf[o++] = '\r'; continue;
        case 't': buf[o++] = '\t'; continue;
        case 'v': buf[o++] = '\v'; continue;
        case 'x': hex = 2; break;
        case 'u': hex = 4; break;
        case 'U': hex = 8; break;
        default:
            if (c >= '0' && c <= '7') {
                cp = c - '0';
                for (int k = 0; k < 2 && i + 1 < n && s[i + 1] >= '0' && s[i + 1] <= '7'; k++)
                    cp = cp * 8 + (s[++i] - '0');
            } else {
                buf[o++] = '\\';
                buf[o++] = c;
                continue;
            }
        }
        if (hex) {
            cp = 0;
            for (int k = 0; k < hex; k++) {
                if (i + 1 >= n || !isxdigit((unsigned char)s[i + 1])) {
                    free(buf);
                    return lex_fail(line, "truncated \\%s escape in string literal", c == 'x' ? "x" : (c == 'u' ? "u" : "U"));
                }
                char d = s[++i];
                cp = cp * 16 + (isdigit((unsigned char)d) ? d - '0' : (tolower((unsigned char)d) - 'a' + 10));
            }
        }
        if (cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) {
            free(buf);
            return lex_fail(line, "%s", "invalid code point escape in string literal");
        }
        /* An escape never expands beyond its own length (\x41 -> 1..2 bytes). */
        o += tpl_utf8_put((int32_t)cp, buf + o);
    }
    int rc = push_tok(L, TK_STRING, buf, o, line);
    free(buf);
    return rc;
}

static const char *const OPS[] = {"//", "**", "==", "!=", ">=", "<=", "+", "-", "/", "*", "%", "~", "[",
                                  "]",  "(",  ")",  "{",  "}",  "=",  ".", ":", "|", ",", ">", "<", ";"};

/* Moves past s[from..e), counting its newlines; a match that ends with a newline starts a line. */
static void lex_skip(lexer *L, size_t from, size_t e) {
    L->line += count_lines(L->s + from, e - from);
    L->line_starting = L->s[e - 1] == '\n';
    L->pos = e;
}

/* The end of the run of digits from q ('_' allowed between digits). */
static size_t digits_end(const lexer *L, size_t q) {
    const char *s = L->s;
    while (q < L->n && (isdigit((unsigned char)s[q]) || (s[q] == '_' && q + 1 < L->n && isdigit((unsigned char)s[q + 1]))))
        q++;
    return q;
}

/* An int or float literal at p: digits ('.' digits)? (e[+-]?digits)?, with '_' separators. */
static int lex_number(lexer *L, size_t p) {
    const char *s = L->s;
    size_t q = digits_end(L, p), r = q;
    bool is_float = false, after_dot = p > 0 && s[p - 1] == '.';
    if (!after_dot && r + 1 < L->n && s[r] == '.' && isdigit((unsigned char)s[r + 1])) {
        r = digits_end(L, r + 1);
        is_float = true;
    }
    if (!after_dot && r < L->n && (s[r] == 'e' || s[r] == 'E')) {
        size_t t = r + 1;
        if (t < L->n && (s[t] == '+' || s[t] == '-'))
            t++;
        if (t < L->n && isdigit((unsigned char)s[t])) {
            r = digits_end(L, t);
            is_float = true;
        }
    }
    if (!is_float)
        r = q;
    char num[128];
    size_t k = 0;
    for (size_t i = p; i < r && k + 1 < sizeof num; i++)
        if (s[i] != '_')
            num[k++] = s[i];
    num[k] = '\0';
    int rc = push_tok(L, is_float ? TK_FLOAT : TK_INT, s + p, r - p, L->line);
    if (rc)
        return rc;
    tpl_tok *t = &L->out->v[L->out->n - 1];
    errno = 0;
    if (is_float) {
        t->fval = strtod(num, NULL);
    } else {
        t->ival = strtoll(num, NULL, 10);
        if (errno == ERANGE)
            return lex_fail(L->line, "integer literal '%s' is too large", num);
    }
    L->pos = r;
    return FU_OK;
}

static int lex_name(lexer *L, size_t p) {
    size_t q = p;
    while (q < L->n && (isalnum((unsigned char)L->s[q]) || L->s[q] == '_'))
        q++;
    int rc = push_tok(L, TK_NAME, L->s + p, q - p, L->line);
    L->pos = q;
    return rc;
}

/* A string literal quoted by L->s[p]. */
static int lex_string(lexer *L, size_t p) {
    const char *s = L->s;
    size_t q = p + 1;
    while (q < L->n && s[q] != s[p]) {
        if (s[q] == '\\' && q + 1 < L->n)
            q++;
        q++;
    }
    if (q >= L->n)
        return lex_fail(L->line, "%s", "unterminated string literal");
    int rc = decode_string(L, s + p + 1, q - p - 1, L->line);
    if (rc)
        return rc;
    L->line += count_lines(s + p, q - p);
    L->pos = q + 1;
    return FU_OK;
}

/* Keeps the bracket stack balanced for the operator `op`. */
static int track_bracket(lexer *L, const char *op) {
    if (op[1] != '\0')
        return FU_OK;
    if (strchr("([{", op[0])) {
        if (L->nbrackets >= (int)sizeof L->brackets)
            return lex_fail(L->line, "%s", "brackets nested too deeply");
        L->brackets[L->nbrackets++] = op[0] == '(' ? ')' : (op[0] == '[' ? ']' : '}');
    } else if (strchr(")]}", op[0])) {
        if (L->nbrackets == 0)
            return lex_fail(L->line, "unexpected '%s'", op);
        if (L->brackets[L->nbrackets - 1] != op[0]) {
            char msg[64];
            snprintf(msg, sizeof msg, "unexpected '%c', expected '%c'", op[0], L->brackets[L->nbrackets - 1]);
            return lex_fail(L->line, "%s", msg);
        }
        L->nbrackets--;
    }
    return FU_OK;
}

/* The longest operator at p (OPS lists two-character operators first). */
static int lex_op(lexer *L, size_t p) {
    const char *op = NULL;
    for (size_t i = 0; i < sizeof OPS / sizeof OPS[0] && !op; i++) {
        size_t ol = strlen(OPS[i]);
        if (p + ol <= L->n && memcmp(L->s + p, OPS[i], ol) == 0)
            op = OPS[i];
    }
    if (!op) {
        char ch[8] = {L->s[p], 0};
        return lex_fail(L->line, "unexpected char '%s'", ch);
    }
    int rc = track_bracket(L, op);
    if (rc || (rc = push_tok(L, TK_OP, op, strlen(op), L->line)))
        return rc;
    L->pos = p + strlen(op);
    return FU_OK;
}

/* Lexes the inside of a {{ }} or {% %} tag starting at L->pos, through its end. */
static int lex_tag(lexer *L, bool is_block, int open_line) {
    L->nbrackets = 0;
    for (;;) {
        size_t p = skip_ws(L, L->pos);
        L->line += count_lines(L->s + L->pos, p - L->pos);
        L->pos = p;
        if (p >= L->n)
            return lex_fail(open_line, "%s", is_block ? "missing end of block tag '%}'" : "missing end of variable tag '}}'");
        size_t e = L->nbrackets ? 0 : is_block ? match_block_end(L, p) : match_var_end(L, p);
        if (e) {
            int rc = push_tok(L, is_block ? TK_BLOCK_END : TK_VAR_END, "", 0, L->line);
            if (!rc)
                lex_skip(L, p, e);
            return rc;
        }
        char c = L->s[p];
        int rc = isdigit((unsigned char)c)             ? lex_number(L, p)
                 : isalpha((unsigned char)c) || c == '_' ? lex_name(L, p)
                 : c == '\'' || c == '"'                 ? lex_string(L, p)
                                                         : lex_op(L, p);
        if (rc)
            return rc;
    }
}

/* Finds "{%[-+]?\s*endraw\s*(+%}|-%}\s*|%}\n?)" from p; returns its start or
 * SIZE_MAX, with the sign and the end position. */
static size_t find_endraw(const lexer *L, size_t p, char *sign, size_t *end) {
    for (size_t i = p; i + 1 < L->n; i++) {
        if (L->s[i] != '{' || L->s[i + 1] != '%')
            continue;
        size_t q = i + 2;
        char sg = 0;
        if (q < L->n && (L->s[q] == '-' || L->s[q] == '+'))
            sg = L->s[q++];
        q = skip_ws(L, q);
        if (q + 6 > L->n || memcmp(L->s + q, "endraw", 6) != 0)
            continue;
        q = skip_ws(L, q + 6);
        size_t e = match_block_end(L, q);
        if (!e)
            continue;
        *sign = sg;
        *end = e;
        return i;
    }
    return SIZE_MAX;
}

/* Matches "{%[-+]?\s*raw\s*(-%}\s*|%})" at p; returns the end or 0. */
static size_t match_raw_begin(const lexer *L, size_t p, char *sign) {
    size_t q = p + 2;
    *sign = 0;
    if (q < L->n && (L->s[q] == '-' || L->s[q] == '+'))
        *sign = L->s[q++];
    q = skip_ws(L, q);
    if (q + 3 > L->n || memcmp(L->s + q, "raw", 3) != 0)
        return 0;
    q += 3;
    if (q < L->n && (isalnum((unsigned char)L->s[q]) || L->s[q] == '_'))
        return 0;
    q = skip_ws(L, q);
    if (q + 3 <= L->n && L->s[q] == '-' && L->s[q + 1] == '%' && L->s[q + 2] == '}')
        return skip_ws(L, q + 3);
    if (q + 2 <= L->n && L->s[q] == '%' && L->s[q + 1] == '}')
        return q + 2;
    return 0;
}

/* The end of a comment whose body starts at q: after "+#}", "-#}\s*" or "#}\n?"; 0 if there is none. */
static size_t match_comment_end(const lexer *L, size_t q) {
    const char *s = L->s;
    for (size_t i = q; i + 1 < L->n; i++) {
        if (s[i] == '+' && i + 2 < L->n && s[i + 1] == '#' && s[i + 2] == '}')
            return i + 3;
        if (s[i] == '-' && i + 2 < L->n && s[i + 1] == '#' && s[i + 2] == '}')
            return skip_ws(L, i + 3);
        if (s[i] == '#' && s[i + 1] == '}')
            return i + 2 < L->n && s[i + 2] == '\n' ? i + 3 : i + 2;
    }
    return 0;
}

/* Skips the comment opened at t whose body starts at q. */
static int lex_comment(lexer *L, size_t t, size_t q, int tag_line) {
    size_t end = match_comment_end(L, q);
    if (!end && q >= L->n) { /* jinja2 quietly accepts a bare "{#" at the very end */
        L->pos = L->n;
        return FU_OK;
    }
    if (!end)
        return lex_fail(tag_line, "%s", "missing end of comment tag");
    lex_skip(L, t, end);
    return FU_OK;
}

/* Emits as data the body of the raw block whose opening tag spans [t, raw_end). */
static int lex_raw(lexer *L, size_t t, size_t raw_end, int tag_line) {
    lex_skip(L, t, raw_end);
    char esign;
    size_t eend;
    size_t e = find_endraw(L, raw_end, &esign, &eend);
    if (e == SIZE_MAX && raw_end >= L->n) { /* as jinja2: nothing left to lex */
        L->pos = L->n;
        return FU_OK;
    }
    if (e == SIZE_MAX)
        return lex_fail(tag_line, "%s", "missing end of raw directive");
    int rc = emit_data_before(L, L->s + raw_end, e - raw_end, esign, false, L->line);
    if (rc)
        return rc;
    lex_skip(L, raw_end, eend);
    return FU_OK;
}

/* Lexes a {{ or {% tag whose inside starts at q. */
static int lex_open_tag(lexer *L, bool is_block, size_t q, int tag_line) {
    int rc = push_tok(L, is_block ? TK_BLOCK_BEGIN : TK_VAR_BEGIN, "", 0, tag_line);
    if (rc)
        return rc;
    L->pos = q;
    return lex_tag(L, is_block, tag_line);
}

/* Lexes the template: data between tags, the tags, comments and raw blocks. */
static int lex_root(lexer *L) {
    while (L->pos < L->n) {
        const char *s = L->s;
        size_t p = L->pos, t = p;
        /* Earliest tag start. */
        while (t + 1 < L->n && !(s[t] == '{' && (s[t + 1] == '{' || s[t + 1] == '%' || s[t + 1] == '#')))
            t++;
        if (t + 1 >= L->n) {
            int rc = push_tok(L, TK_DATA, s + p, L->n - p, L->line);
            L->line += count_lines(s + p, L->n - p);
            L->pos = L->n;
            return rc;
        }
        char kind = s[t + 1], sign = 0;
        size_t raw_end = kind == '%' ? match_raw_begin(L, t, &sign) : 0;
        if (!raw_end && t + 2 < L->n && (s[t + 2] == '-' || s[t + 2] == '+'))
            sign = s[t + 2];
        int rc = emit_data_before(L, s + p, t - p, sign, kind == '{', L->line);
        if (rc)
            return rc;
        L->line += count_lines(s + p, t - p);
        if (raw_end) {
            rc = lex_raw(L, t, raw_end, L->line);
        } else {
            size_t q = t + 2 + (sign ? 1 : 0);
            L->line_starting = false;
            rc = kind == '#' ? lex_comment(L, t, q, L->line) : lex_open_tag(L, kind == '%', q, L->line);
        }
        if (rc)
            return rc;
    }
    return FU_OK;
}

int tpl_lex(const char *src, size_t len, tpl_toks *out) {
    memset(out, 0, sizeof *out);
    /* Normalize newlines (\r\n and \r become \n) and drop one trailing newline. */
    char *s = malloc(len + 1);
    if (!s)
        return fu_errorf(FU_ERR_NOMEM, "out of memory");
    size_t n = 0;
    for (size_t i = 0; i < len; i++) {
        if (src[i] == '\r') {
            s[n++] = '\n';
            if (i + 1 < len && src[i + 1] == '\n')
                i++;
        } else {
            s[n++] = src[i];
        }
    }
    if (n > 0 && s[n - 1] == '\n')
        n--;
    s[n] = '\0';
    lexer L = {.s = s, .n = n, .pos = 0, .line = 1, .line_starting = true, .out = out};
    int rc = lex_root(&L);
    if (!rc)
        rc = push_tok(&L, TK_EOF, "", 0, L.line);
    free(s);
    if (rc)
        tpl_toks_free(out);
    return rc;
}
