/* tpl-parse.c -- recursive-descent parser from tokens to the template AST (jinja2's grammar). */
#include "tpl-impl.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Nesting of expressions, blocks and chains (each link of a + b + c, a.b.c or
 * a|f|g nests the tree one level deeper). It bounds the recursion of the
 * parser and of every walk of the tree (checking, evaluation, freeing) so
 * that the worst case fits a 256 KiB thread stack even under ASan; real
 * templates nest less than 50. */
#define TPL_MAX_PARSE_DEPTH 200

typedef struct parser {
    tpl_toks *t;
    size_t i;
    int depth;
    int loops; /* enclosing for-loop bodies (break/continue are legal inside) */
    bool failed;
} parser;

/* ------------------------------------------------------------------------ */
/* Nodes                                                                     */
/* ------------------------------------------------------------------------ */

static void vec_free(tpl_nodevec *v) {
    for (size_t i = 0; i < v->n; i++)
        tpl_node_free(v->v[i]);
    free(v->v);
}

void tpl_node_free(tpl_node *n) {
    if (!n)
        return;
    tpl_node_free(n->a);
    tpl_node_free(n->b);
    tpl_node_free(n->c);
    vec_free(&n->body);
    vec_free(&n->alt);
    vec_free(&n->kids);
    free(n->str);
    for (size_t i = 0; i < n->nnames; i++)
        free(n->names[i]);
    free(n->names);
    free(n->ops);
    tpl_free_immortal(n->val);
    free(n);
}

static int pfail(parser *P, int line, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static int pfail(parser *P, int line, const char *fmt, ...) {
    if (P->failed)
        return FU_ERR_TEMPLATE;
    char msg[600];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    P->failed = true;
    return fu_errorf(FU_ERR_TEMPLATE, "template syntax error at line %d: %s", line, msg);
}

static tpl_node *node_new(parser *P, int type, int line) {
    tpl_node *n = calloc(1, sizeof *n);
    if (!n) {
        P->failed = true;
        fu_errorf(FU_ERR_NOMEM, "out of memory");
        return NULL;
    }
    n->type = type;
    n->line = line;
    n->id = -1;
    return n;
}

/* Appends `c` (may be NULL for optional slots) to `v`; frees it on failure. */
static int vec_push(parser *P, tpl_nodevec *v, tpl_node *c) {
    if (v->n == v->cap) {
        size_t nc = v->cap ? v->cap * 2 : 4;
        tpl_node **nv = realloc(v->v, nc * sizeof *nv);
        if (!nv) {
            tpl_node_free(c);
            P->failed = true;
            return fu_errorf(FU_ERR_NOMEM, "out of memory");
        }
        v->v = nv;
        v->cap = nc;
    }
    v->v[v->n++] = c;
    return FU_OK;
}

static int names_push(parser *P, tpl_node *n, const char *name) {
    char **nv = realloc(n->names, (n->nnames + 1) * sizeof *nv);
    if (!nv)
        goto oom;
    n->names = nv;
    if (!(n->names[n->nnames] = strdup(name)))
        goto oom;
    n->nnames++;
    return FU_OK;
oom:
    P->failed = true;
    return fu_errorf(FU_ERR_NOMEM, "out of memory");
}

static int set_str(parser *P, tpl_node *n, const char *s, size_t len) {
    n->str = malloc(len + 1);
    if (!n->str) {
        P->failed = true;
        return fu_errorf(FU_ERR_NOMEM, "out of memory");
    }
    memcpy(n->str, s, len);
    n->str[len] = '\0';
    n->len = len;
    return FU_OK;
}

/* ------------------------------------------------------------------------ */
/* Token helpers                                                             */
/* ------------------------------------------------------------------------ */

static tpl_tok *cur(parser *P) { return &P->t->v[P->i]; }
static tpl_tok *look(parser *P) { return &P->t->v[P->i + 1 < P->t->n ? P->i + 1 : P->i]; }
static void advance(parser *P) {
    if (P->i + 1 < P->t->n)
        P->i++;
}

static bool is_op(tpl_tok *t, const char *op) { return t->type == TK_OP && strcmp(t->text, op) == 0; }
static bool is_name(tpl_tok *t, const char *name) { return t->type == TK_NAME && strcmp(t->text, name) == 0; }

static const char *describe(tpl_tok *t) {
    switch (t->type) {
    case TK_EOF: return "end of template";
    case TK_DATA: return "template data";
    case TK_VAR_BEGIN: return "begin of print statement";
    case TK_VAR_END: return "end of print statement";
    case TK_BLOCK_BEGIN: return "begin of statement block";
    case TK_BLOCK_END: return "end of statement block";
    case TK_STRING: return "string literal";
    default: return t->text;
    }
}

static int expect_op(parser *P, const char *op) {
    if (!is_op(cur(P), op))
        return pfail(P, cur(P)->line, "expected '%s', got '%s'", op, describe(cur(P)));
    advance(P);
    return FU_OK;
}

static int expect_type(parser *P, int type, const char *what) {
    if (cur(P)->type != type)
        return pfail(P, cur(P)->line, "expected %s, got '%s'", what, describe(cur(P)));
    advance(P);
    return FU_OK;
}

static int enter(parser *P) {
    if (++P->depth > TPL_MAX_PARSE_DEPTH)
        return pfail(P, cur(P)->line, "template nested too deeply (limit %d)", TPL_MAX_PARSE_DEPTH);
    return FU_OK;
}

/* Enters one more level for a chain link that will nest `n` (owned) inside
 * a new node; returns n, or NULL (n freed) past the nesting limit. The
 * caller restores P->depth when the chain ends. */
static tpl_node *deeper(parser *P, tpl_node *n) {
    if (!enter(P))
        return n;
    tpl_node_free(n);
    return NULL;
}

/* ------------------------------------------------------------------------ */
/* Expressions                                                               */
/* ------------------------------------------------------------------------ */

static tpl_node *parse_expression(parser *P, bool with_condexpr);
static tpl_node *parse_tuple(parser *P, bool with_condexpr, const char *extra_end, bool explicit_parens,
                             bool simplified);
static tpl_node *parse_primary(parser *P);
static tpl_node *parse_postfix(parser *P, tpl_node *n);
static tpl_node *parse_unary(parser *P, bool with_filter);

/* Parses "(args, kw=value)" into n->body, n->names / n->alt. */
static int parse_call_args(parser *P, tpl_node *n) {
    int rc = expect_op(P, "(");
    bool need_comma = false;
    while (!rc && !is_op(cur(P), ")")) {
        if (need_comma) {
            if ((rc = expect_op(P, ",")))
                break;
            if (is_op(cur(P), ")"))
                break;
        }
        if (is_op(cur(P), "*") || is_op(cur(P), "**"))
            return pfail(P, cur(P)->line, "*args and **kwargs in calls are not supported");
        if (cur(P)->type == TK_NAME && is_op(look(P), "=")) {
            if ((rc = names_push(P, n, cur(P)->text)))
                return rc;
            advance(P);
            advance(P);
            tpl_node *v = parse_expression(P, true);
            if (!v)
                return FU_ERR_TEMPLATE;
            rc = vec_push(P, &n->alt, v);
        } else {
            if (n->nnames)
                return pfail(P, cur(P)->line, "positional argument follows keyword argument");
            tpl_node *v = parse_expression(P, true);
            if (!v)
                return FU_ERR_TEMPLATE;
            rc = vec_push(P, &n->body, v);
        }
        need_comma = true;
    }
    if (rc)
        return rc;
    return expect_op(P, ")");
}

/* Filter and test names may be dotted ("a.b"); appends ".name" parts to n->str. */
static int append_dotted(parser *P, tpl_node *n) {
    while (is_op(cur(P), ".")) {
        advance(P);
        if (cur(P)->type != TK_NAME)
            return pfail(P, cur(P)->line, "expected name after '.', got '%s'", describe(cur(P)));
        size_t add = cur(P)->len;
        char *ns = realloc(n->str, n->len + add + 2);
        if (!ns) {
            P->failed = true;
            return fu_errorf(FU_ERR_NOMEM, "out of memory");
        }
        ns[n->len] = '.';
        memcpy(ns + n->len + 1, cur(P)->text, add + 1);
        n->str = ns;
        n->len += add + 1;
        advance(P);
    }
    return FU_OK;
}

static tpl_node *parse_filter(parser *P, tpl_node *in, bool start_inline) {
    int base = P->depth;
    while (in && (is_op(cur(P), "|") || start_inline) && (in = deeper(P, in))) {
        if (!start_inline)
            advance(P);
        start_inline = false;
        if (cur(P)->type != TK_NAME) {
            pfail(P, cur(P)->line, "expected filter name, got '%s'", describe(cur(P)));
            tpl_node_free(in);
            return NULL;
        }
        tpl_node *f = node_new(P, ND_FILTER, cur(P)->line);
        if (!f || set_str(P, f, cur(P)->text, cur(P)->len)) {
            tpl_node_free(f);
            tpl_node_free(in);
            return NULL;
        }
        f->a = in;
        advance(P);
        if (append_dotted(P, f)) {
            tpl_node_free(f);
            return NULL;
        }
        f->id = tpl_filter_id(f->str);
        if (is_op(cur(P), "(") && parse_call_args(P, f)) {
            tpl_node_free(f);
            return NULL;
        }
        in = f;
    }
    P->depth = base;
    return in;
}

static tpl_node *parse_test(parser *P, tpl_node *in) {
    int line = cur(P)->line;
    advance(P); /* 'is' */
    bool negated = false;
    if (is_name(cur(P), "not")) {
        negated = true;
        advance(P);
    }
    tpl_node *t = node_new(P, ND_TEST, line);
    if (!t) {
        tpl_node_free(in);
        return NULL;
    }
    t->a = in;
    if (cur(P)->type != TK_NAME) {
        pfail(P, cur(P)->line, "expected test name, got '%s'", describe(cur(P)));
        tpl_node_free(t);
        return NULL;
    }
    if (set_str(P, t, cur(P)->text, cur(P)->len)) {
        tpl_node_free(t);
        return NULL;
    }
    advance(P);
    if (append_dotted(P, t)) {
        tpl_node_free(t);
        return NULL;
    }
    t->id = tpl_test_id(t->str);
    tpl_tok *c = cur(P);
    if (is_op(c, "(")) {
        if (parse_call_args(P, t)) {
            tpl_node_free(t);
            return NULL;
        }
    } else if ((c->type == TK_NAME || c->type == TK_STRING || c->type == TK_INT || c->type == TK_FLOAT ||
                is_op(c, "(") || is_op(c, "[") || is_op(c, "{")) &&
               !is_name(c, "else") && !is_name(c, "or") && !is_name(c, "and")) {
        if (is_name(c, "is")) {
            pfail(P, c->line, "You cannot chain multiple tests with is");
            tpl_node_free(t);
            return NULL;
        }
        tpl_node *arg = parse_primary(P);
        arg = arg ? parse_postfix(P, arg) : NULL;
        if (!arg || vec_push(P, &t->body, arg)) {
            tpl_node_free(t);
            return NULL;
        }
    }
    if (negated) {
        tpl_node *n = node_new(P, ND_NOT, line);
        if (!n) {
            tpl_node_free(t);
            return NULL;
        }
        n->a = t;
        return n;
    }
    return t;
}

/* A call of `callee` (owned) at "(": an ND_CALL node, or NULL on failure (callee freed). */
static tpl_node *parse_call(parser *P, tpl_node *callee) {
    tpl_node *c = node_new(P, ND_CALL, cur(P)->line);
    if (!c) {
        tpl_node_free(callee);
        return NULL;
    }
    c->a = callee;
    if (parse_call_args(P, c)) {
        tpl_node_free(c);
        return NULL;
    }
    return c;
}

static tpl_node *parse_filter_expr(parser *P, tpl_node *n) {
    int base = P->depth;
    while (n && (is_op(cur(P), "|") || is_name(cur(P), "is") || is_op(cur(P), "(")) && (n = deeper(P, n))) {
        if (is_op(cur(P), "|"))
            n = parse_filter(P, n, false);
        else if (is_name(cur(P), "is"))
            n = parse_test(P, n);
        else
            n = parse_call(P, n);
    }
    P->depth = base;
    return n;
}

/* Inside [ ]: an expression or a slice start:stop:step. */
static tpl_node *parse_subscribed(parser *P) {
    int line = cur(P)->line;
    tpl_node *first = NULL;
    if (!is_op(cur(P), ":")) {
        first = parse_expression(P, true);
        if (!first)
            return NULL;
        if (!is_op(cur(P), ":"))
            return first;
    }
    advance(P); /* ':' */
    tpl_node *s = node_new(P, ND_SLICE, line);
    if (!s || vec_push(P, &s->kids, first)) {
        if (s)
            tpl_node_free(s);
        else
            tpl_node_free(first);
        return NULL;
    }
    tpl_node *stop = NULL, *step = NULL;
    if (!is_op(cur(P), ":") && !is_op(cur(P), "]") && !is_op(cur(P), ",")) {
        if (!(stop = parse_expression(P, true)))
            goto err;
    }
    if (vec_push(P, &s->kids, stop))
        goto err;
    if (is_op(cur(P), ":")) {
        advance(P);
        if (!is_op(cur(P), "]") && !is_op(cur(P), ",")) {
            if (!(step = parse_expression(P, true)))
                goto err;
        }
    }
    if (vec_push(P, &s->kids, step))
        goto err;
    return s;
err:
    tpl_node_free(s);
    return NULL;
}

static tpl_node *parse_subscript(parser *P, tpl_node *obj) {
    tpl_tok *t = cur(P);
    int line = t->line;
    if (is_op(t, ".")) {
        advance(P);
        tpl_tok *a = cur(P);
        if (a->type == TK_NAME) {
            tpl_node *g = node_new(P, ND_GETATTR, line);
            if (!g || set_str(P, g, a->text, a->len)) {
                tpl_node_free(g);
                tpl_node_free(obj);
                return NULL;
            }
            g->a = obj;
            advance(P);
            return g;
        }
        if (a->type != TK_INT) {
            pfail(P, a->line, "expected name or number");
            tpl_node_free(obj);
            return NULL;
        }
        tpl_node *g = node_new(P, ND_GETITEM, line);
        tpl_node *k = node_new(P, ND_CONST, line);
        if (!g || !k) {
            tpl_node_free(g);
            tpl_node_free(k);
            tpl_node_free(obj);
            return NULL;
        }
        k->val = tpl_int(a->ival);
        g->a = obj;
        g->b = k;
        advance(P);
        return g;
    }
    /* '[' */
    advance(P);
    tpl_node *g = node_new(P, ND_GETITEM, line);
    if (!g) {
        tpl_node_free(obj);
        return NULL;
    }
    g->a = obj;
    tpl_nodevec args = {0};
    while (!is_op(cur(P), "]")) {
        if (args.n && expect_op(P, ","))
            goto err;
        tpl_node *s = parse_subscribed(P);
        if (!s || vec_push(P, &args, s))
            goto err;
    }
    advance(P);
    if (args.n == 0) {
        pfail(P, line, "expected subscript expression");
        goto err;
    }
    if (args.n == 1) {
        g->b = args.v[0];
        free(args.v);
    } else {
        tpl_node *tu = node_new(P, ND_TUPLE, line);
        if (!tu)
            goto err;
        tu->body = args;
        g->b = tu;
    }
    return g;
err:
    vec_free(&args);
    tpl_node_free(g);
    return NULL;
}

static tpl_node *parse_postfix(parser *P, tpl_node *n) {
    int base = P->depth;
    while (n && (is_op(cur(P), ".") || is_op(cur(P), "[") || is_op(cur(P), "(")) && (n = deeper(P, n))) {
        if (is_op(cur(P), "("))
            n = parse_call(P, n);
        else
            n = parse_subscript(P, n);
    }
    P->depth = base;
    return n;
}

static tpl_node *parse_list_or_dict(parser *P, bool dict) {
    int line = cur(P)->line;
    const char *close = dict ? "}" : "]";
    advance(P);
    tpl_node *n = node_new(P, dict ? ND_DICT : ND_LIST, line);
    if (!n)
        return NULL;
    while (!is_op(cur(P), close)) {
        if (n->body.n && expect_op(P, ","))
            goto err;
        if (is_op(cur(P), close))
            break;
        tpl_node *k = parse_expression(P, true);
        if (!k || vec_push(P, &n->body, k))
            goto err;
        if (dict) {
            if (expect_op(P, ":"))
                goto err;
            tpl_node *v = parse_expression(P, true);
            if (!v || vec_push(P, &n->alt, v))
                goto err;
        }
    }
    advance(P);
    return n;
err:
    tpl_node_free(n);
    return NULL;
}

static tpl_node *parse_primary(parser *P) {
    tpl_tok *t = cur(P);
    tpl_node *n = NULL;
    if (enter(P))
        return NULL;
    if (t->type == TK_NAME) {
        if (!strcmp(t->text, "true") || !strcmp(t->text, "True") || !strcmp(t->text, "false") ||
            !strcmp(t->text, "False")) {
            if ((n = node_new(P, ND_CONST, t->line)))
                n->val = tpl_bool(t->text[0] == 't' || t->text[0] == 'T');
        } else if (!strcmp(t->text, "none") || !strcmp(t->text, "None")) {
            if ((n = node_new(P, ND_CONST, t->line)))
                n->val = tpl_none();
        } else if ((n = node_new(P, ND_NAME, t->line)) && set_str(P, n, t->text, t->len)) {
            tpl_node_free(n);
            n = NULL;
        }
        advance(P);
    } else if (t->type == TK_STRING) {
        /* Adjacent string literals concatenate. */
        fu_buf b = {0};
        int line = t->line;
        int rc = FU_OK;
        while (!rc && cur(P)->type == TK_STRING) {
            rc = tpl_buf_put(NULL, &b, cur(P)->text, cur(P)->len);
            advance(P);
        }
        if (!rc && (n = node_new(P, ND_CONST, line))) {
            if (tpl_str_new(NULL, b.data ? b.data : "", b.len, &n->val)) {
                P->failed = true;
                tpl_node_free(n);
                n = NULL;
            }
        }
        if (rc)
            P->failed = true;
        fu_buf_free(&b);
    } else if (t->type == TK_INT || t->type == TK_FLOAT) {
        if ((n = node_new(P, ND_CONST, t->line)))
            n->val = t->type == TK_INT ? tpl_int(t->ival) : tpl_float(t->fval);
        advance(P);
    } else if (is_op(t, "(")) {
        advance(P);
        n = parse_tuple(P, true, NULL, true, false);
        if (n && expect_op(P, ")")) {
            tpl_node_free(n);
            n = NULL;
        }
    } else if (is_op(t, "[")) {
        n = parse_list_or_dict(P, false);
    } else if (is_op(t, "{")) {
        n = parse_list_or_dict(P, true);
    } else {
        pfail(P, t->line, "unexpected '%s'", describe(t));
    }
    P->depth--;
    return n;
}

static tpl_node *parse_unary(parser *P, bool with_filter) {
    tpl_tok *t = cur(P);
    tpl_node *n;
    if (enter(P))
        return NULL;
    if (is_op(t, "-") || is_op(t, "+")) {
        int type = is_op(t, "-") ? ND_NEG : ND_POS;
        int line = t->line;
        advance(P);
        tpl_node *a = parse_unary(P, false);
        n = a ? node_new(P, type, line) : NULL;
        if (n)
            n->a = a;
        else
            tpl_node_free(a);
    } else {
        n = parse_primary(P);
    }
    n = parse_postfix(P, n);
    if (with_filter)
        n = parse_filter_expr(P, n);
    P->depth--;
    return n;
}

/* A node of `type` (ND_BINOP with `op`, ND_AND, ND_OR) over a and b; frees
 * both and returns NULL when either is missing or allocation fails. */
static tpl_node *pair_node(parser *P, int type, int op, tpl_node *a, tpl_node *b, int line) {
    tpl_node *n = a && b ? node_new(P, type, line) : NULL;
    if (!n) {
        tpl_node_free(a);
        tpl_node_free(b);
        return NULL;
    }
    n->op = op;
    n->a = a;
    n->b = b;
    return n;
}

static tpl_node *binop(parser *P, int op, tpl_node *a, tpl_node *b, int line) {
    return pair_node(P, ND_BINOP, op, a, b, line);
}

static tpl_node *parse_pow(parser *P) {
    int base = P->depth;
    tpl_node *n = parse_unary(P, true);
    while (n && is_op(cur(P), "**") && (n = deeper(P, n))) {
        int line = cur(P)->line;
        advance(P);
        n = binop(P, OP_POW, n, parse_unary(P, true), line);
    }
    P->depth = base;
    return n;
}

static int math2_op(tpl_tok *t) {
    return is_op(t, "*") ? OP_MUL : is_op(t, "/") ? OP_DIV : is_op(t, "//") ? OP_FLOORDIV : is_op(t, "%") ? OP_MOD : 0;
}

static tpl_node *parse_math2(parser *P) {
    int base = P->depth;
    tpl_node *n = parse_pow(P);
    while (n && math2_op(cur(P)) && (n = deeper(P, n))) {
        tpl_tok *t = cur(P);
        advance(P);
        n = binop(P, math2_op(t), n, parse_pow(P), t->line);
    }
    P->depth = base;
    return n;
}

static tpl_node *parse_concat(parser *P) {
    int base = P->depth;
    tpl_node *n = parse_math2(P);
    while (n && is_op(cur(P), "~") && (n = deeper(P, n))) {
        int line = cur(P)->line;
        advance(P);
        n = binop(P, OP_CONCAT, n, parse_math2(P), line);
    }
    P->depth = base;
    return n;
}

static tpl_node *parse_math1(parser *P) {
    int base = P->depth;
    tpl_node *n = parse_concat(P);
    while (n && (is_op(cur(P), "+") || is_op(cur(P), "-")) && (n = deeper(P, n))) {
        int op = is_op(cur(P), "+") ? OP_ADD : OP_SUB;
        int line = cur(P)->line;
        advance(P);
        n = binop(P, op, n, parse_concat(P), line);
    }
    P->depth = base;
    return n;
}

static tpl_node *parse_compare(parser *P) {
    int line = cur(P)->line;
    tpl_node *first = parse_math1(P);
    if (!first)
        return NULL;
    tpl_node *c = NULL;
    for (;;) {
        tpl_tok *t = cur(P);
        int op = is_op(t, "==") ? OP_EQ : is_op(t, "!=") ? OP_NE : is_op(t, "<") ? OP_LT : is_op(t, "<=") ? OP_LE
               : is_op(t, ">") ? OP_GT : is_op(t, ">=") ? OP_GE : 0;
        if (op) {
            advance(P);
        } else if (is_name(t, "in")) {
            op = OP_IN;
            advance(P);
        } else if (is_name(t, "not") && is_name(look(P), "in")) {
            op = OP_NOTIN;
            advance(P);
            advance(P);
        } else {
            break;
        }
        if (!c) {
            if (!(c = node_new(P, ND_COMPARE, line))) {
                tpl_node_free(first);
                return NULL;
            }
            c->a = first;
        }
        tpl_node *rhs = parse_math1(P);
        int *ops = realloc(c->ops, (c->body.n + 1) * sizeof *ops);
        if (!rhs || !ops) {
            if (ops)
                c->ops = ops;
            tpl_node_free(rhs);
            tpl_node_free(c);
            if (!ops)
                fu_errorf(FU_ERR_NOMEM, "out of memory");
            return NULL;
        }
        c->ops = ops;
        c->ops[c->body.n] = op;
        if (vec_push(P, &c->body, rhs)) {
            tpl_node_free(c);
            return NULL;
        }
    }
    return c ? c : first;
}

static tpl_node *parse_not(parser *P) {
    if (is_name(cur(P), "not")) {
        int line = cur(P)->line;
        advance(P);
        if (enter(P))
            return NULL;
        tpl_node *a = parse_not(P);
        P->depth--;
        tpl_node *n = a ? node_new(P, ND_NOT, line) : NULL;
        if (n)
            n->a = a;
        else
            tpl_node_free(a);
        return n;
    }
    return parse_compare(P);
}

/* `a and b` (or_level false) or `a or b` (true), left-associative. */
static tpl_node *parse_logic(parser *P, bool or_level) {
    const char *word = or_level ? "or" : "and";
    int base = P->depth;
    tpl_node *n = or_level ? parse_logic(P, false) : parse_not(P);
    while (n && is_name(cur(P), word) && (n = deeper(P, n))) {
        int line = cur(P)->line;
        advance(P);
        tpl_node *b = or_level ? parse_logic(P, false) : parse_not(P);
        n = pair_node(P, or_level ? ND_OR : ND_AND, 0, n, b, line);
    }
    P->depth = base;
    return n;
}

static tpl_node *parse_condexpr(parser *P) {
    int line = cur(P)->line;
    int base = P->depth;
    tpl_node *n = parse_logic(P, true);
    while (n && is_name(cur(P), "if") && (n = deeper(P, n))) {
        advance(P);
        tpl_node *test = parse_logic(P, true);
        tpl_node *other = NULL;
        if (test && is_name(cur(P), "else")) {
            advance(P);
            if (enter(P)) {
                tpl_node_free(test);
                tpl_node_free(n);
                return NULL;
            }
            other = parse_condexpr(P);
            P->depth--;
            if (!other) {
                tpl_node_free(test);
                test = NULL;
            }
        }
        tpl_node *c = test ? node_new(P, ND_COND, line) : NULL;
        if (!c) {
            tpl_node_free(n);
            tpl_node_free(test);
            tpl_node_free(other);
            return NULL;
        }
        c->a = n;
        c->b = test;
        c->c = other;
        n = c;
        line = cur(P)->line;
    }
    P->depth = base;
    return n;
}

static tpl_node *parse_expression(parser *P, bool with_condexpr) {
    if (enter(P))
        return NULL;
    tpl_node *n = with_condexpr ? parse_condexpr(P) : parse_logic(P, true);
    P->depth--;
    return n;
}

static bool tuple_end(parser *P, const char *extra_end) {
    tpl_tok *t = cur(P);
    if (t->type == TK_VAR_END || t->type == TK_BLOCK_END || is_op(t, ")") || t->type == TK_EOF)
        return true;
    return extra_end && is_name(t, extra_end);
}

static tpl_node *parse_tuple(parser *P, bool with_condexpr, const char *extra_end, bool explicit_parens,
                             bool simplified) {
    int line = cur(P)->line;
    tpl_nodevec args = {0};
    bool is_tuple = false;
    for (;;) {
        if (args.n && expect_op(P, ","))
            goto err;
        if (tuple_end(P, extra_end))
            break;
        tpl_node *e = simplified ? parse_primary(P) : parse_expression(P, with_condexpr);
        if (!e || vec_push(P, &args, e))
            goto err;
        if (is_op(cur(P), ","))
            is_tuple = true;
        else
            break;
    }
    if (!is_tuple) {
        if (args.n) {
            tpl_node *n = args.v[0];
            free(args.v);
            return n;
        }
        if (!explicit_parens) {
            pfail(P, line, "Expected an expression, got '%s'", describe(cur(P)));
            goto err;
        }
    }
    tpl_node *t = node_new(P, ND_TUPLE, line);
    if (!t)
        goto err;
    t->body = args;
    return t;
err:
    vec_free(&args);
    return NULL;
}

/* ------------------------------------------------------------------------ */
/* Statements                                                                */
/* ------------------------------------------------------------------------ */

static int subparse(parser *P, tpl_nodevec *body, const char *const *ends, const char *open_tag, int open_line);

static int expect_block_end(parser *P) { return expect_type(P, TK_BLOCK_END, "end of statement block"); }

/* Parses an assignment target: `name`, `a, b` / `(a, b)`, or `ns.attr` when
 * with_ns. Names go to n->names; a namespace attribute to n->str. */
static int parse_target(parser *P, tpl_node *n, bool with_ns, const char *extra_end) {
    tpl_tok *t = cur(P);
    if (with_ns && t->type == TK_NAME && is_op(look(P), ".")) {
        int rc = names_push(P, n, t->text);
        if (rc)
            return rc;
        advance(P);
        advance(P);
        if (cur(P)->type != TK_NAME)
            return pfail(P, cur(P)->line, "expected name after '.' in assignment target");
        if ((rc = set_str(P, n, cur(P)->text, cur(P)->len)))
            return rc;
        advance(P);
        return FU_OK;
    }
    bool paren = is_op(t, "(");
    if (paren)
        advance(P);
    for (;;) {
        if (cur(P)->type != TK_NAME)
            return pfail(P, cur(P)->line, "can't assign to '%s'", describe(cur(P)));
        const char *nm = cur(P)->text;
        if (!strcmp(nm, "true") || !strcmp(nm, "false") || !strcmp(nm, "none") || !strcmp(nm, "True") ||
            !strcmp(nm, "False") || !strcmp(nm, "None"))
            return pfail(P, cur(P)->line, "can't assign to '%s'", nm);
        int rc = names_push(P, n, nm);
        if (rc)
            return rc;
        advance(P);
        if (!is_op(cur(P), ","))
            break;
        advance(P);
        if (paren ? is_op(cur(P), ")") : (cur(P)->type != TK_NAME || (extra_end && is_name(cur(P), extra_end))))
            break;
    }
    if (paren)
        return expect_op(P, ")");
    return FU_OK;
}

static tpl_node *parse_for(parser *P, int line) {
    tpl_node *n = node_new(P, ND_FOR, line);
    if (!n)
        return NULL;
    static const char *const ends_body[] = {"endfor", "else", NULL};
    static const char *const ends_else[] = {"endfor", NULL};
    if (parse_target(P, n, false, "in"))
        goto err;
    if (!is_name(cur(P), "in")) {
        pfail(P, cur(P)->line, "expected 'in', got '%s'", describe(cur(P)));
        goto err;
    }
    advance(P);
    if (!(n->a = parse_tuple(P, false, "recursive", false, false)))
        goto err;
    if (is_name(cur(P), "if")) {
        advance(P);
        if (!(n->b = parse_expression(P, true)))
            goto err;
    }
    if (is_name(cur(P), "recursive")) {
        pfail(P, cur(P)->line, "recursive for loops are not supported");
        goto err;
    }
    P->loops++;
    int brc = expect_block_end(P) || subparse(P, &n->body, ends_body, "for", line);
    P->loops--;
    if (brc)
        goto err;
    if (is_name(cur(P), "else")) {
        advance(P);
        if (expect_block_end(P) || subparse(P, &n->alt, ends_else, "for", line))
            goto err;
    }
    advance(P); /* endfor */
    if (expect_block_end(P))
        goto err;
    return n;
err:
    tpl_node_free(n);
    return NULL;
}

static tpl_node *parse_if(parser *P, int line) {
    static const char *const ends[] = {"elif", "else", "endif", NULL};
    static const char *const ends_else[] = {"endif", NULL};
    tpl_node *n = node_new(P, ND_IF, line);
    if (!n)
        return NULL;
    if (!(n->a = parse_tuple(P, false, NULL, false, false)) || expect_block_end(P) ||
        subparse(P, &n->body, ends, "if", line))
        goto err;
    tpl_node *tail = n; /* the innermost if whose else we fill */
    int base = P->depth;
    for (;;) {
        if (is_name(cur(P), "elif")) {
            int eline = cur(P)->line;
            if (enter(P)) /* each elif nests one level deeper */
                goto err;
            advance(P);
            tpl_node *e = node_new(P, ND_IF, eline);
            if (!e || vec_push(P, &tail->alt, e))
                goto err;
            tail = e;
            if (!(e->a = parse_tuple(P, false, NULL, false, false)) || expect_block_end(P) ||
                subparse(P, &e->body, ends, "if", line))
                goto err;
            continue;
        }
        if (is_name(cur(P), "else")) {
            advance(P);
            if (expect_block_end(P) || subparse(P, &tail->alt, ends_else, "if", line))
                goto err;
        }
        break;
    }
    P->depth = base;
    advance(P); /* endif */
    if (expect_block_end(P))
        goto err;
    return n;
err:
    tpl_node_free(n);
    return NULL;
}

static tpl_node *parse_set(parser *P, int line) {
    static const char *const ends[] = {"endset", NULL};
    tpl_node *n = node_new(P, ND_SET, line);
    if (!n)
        return NULL;
    if (parse_target(P, n, true, NULL))
        goto err;
    if (is_op(cur(P), "=")) {
        advance(P);
        if (!(n->a = parse_tuple(P, true, NULL, false, false)) || expect_block_end(P))
            goto err;
        return n;
    }
    if (n->nnames != 1 && !n->str) {
        pfail(P, line, "block set needs a single target");
        goto err;
    }
    n->type = ND_SET_BLOCK;
    if (is_op(cur(P), "|")) {
        /* Filters applied to the captured block; a NULL input marks "the block". */
        tpl_node *f = parse_filter(P, node_new(P, ND_CONST, line), false);
        if (!f || vec_push(P, &n->kids, f))
            goto err;
    }
    if (expect_block_end(P) || subparse(P, &n->body, ends, "set", line))
        goto err;
    advance(P);
    if (expect_block_end(P))
        goto err;
    return n;
err:
    tpl_node_free(n);
    return NULL;
}

static tpl_node *parse_macro(parser *P, int line) {
    static const char *const ends[] = {"endmacro", NULL};
    tpl_node *n = node_new(P, ND_MACRO, line);
    if (!n)
        return NULL;
    if (cur(P)->type != TK_NAME) {
        pfail(P, cur(P)->line, "expected macro name");
        goto err;
    }
    if (set_str(P, n, cur(P)->text, cur(P)->len))
        goto err;
    advance(P);
    if (expect_op(P, "("))
        goto err;
    bool have_default = false;
    while (!is_op(cur(P), ")")) {
        if (n->nnames && expect_op(P, ","))
            goto err;
        if (cur(P)->type != TK_NAME) {
            pfail(P, cur(P)->line, "expected parameter name, got '%s'", describe(cur(P)));
            goto err;
        }
        if (names_push(P, n, cur(P)->text))
            goto err;
        advance(P);
        tpl_node *def = NULL;
        if (is_op(cur(P), "=")) {
            advance(P);
            if (!(def = parse_expression(P, true)))
                goto err;
            have_default = true;
        } else if (have_default) {
            pfail(P, cur(P)->line, "non-default argument follows default argument");
            goto err;
        }
        if (vec_push(P, &n->alt, def))
            goto err;
    }
    advance(P);
    int saved_loops = P->loops;
    P->loops = 0;
    int brc = expect_block_end(P) || subparse(P, &n->body, ends, "macro", line);
    P->loops = saved_loops;
    if (brc)
        goto err;
    advance(P);
    if (cur(P)->type == TK_NAME) /* {% endmacro name %} */
        advance(P);
    if (expect_block_end(P))
        goto err;
    return n;
err:
    tpl_node_free(n);
    return NULL;
}

static tpl_node *parse_filter_block(parser *P, int line) {
    static const char *const ends[] = {"endfilter", NULL};
    tpl_node *n = node_new(P, ND_FILTER_BLOCK, line);
    if (!n)
        return NULL;
    tpl_node *f = parse_filter(P, node_new(P, ND_CONST, line), true);
    if (!f || vec_push(P, &n->kids, f) || expect_block_end(P) || subparse(P, &n->body, ends, "filter", line))
        goto err;
    advance(P);
    if (expect_block_end(P))
        goto err;
    return n;
err:
    tpl_node_free(n);
    return NULL;
}

static tpl_node *parse_with(parser *P, int line) {
    static const char *const ends[] = {"endwith", NULL};
    tpl_node *n = node_new(P, ND_WITH, line);
    if (!n)
        return NULL;
    while (cur(P)->type != TK_BLOCK_END) {
        if (n->nnames && expect_op(P, ","))
            goto err;
        if (cur(P)->type != TK_NAME) {
            pfail(P, cur(P)->line, "expected name in with statement");
            goto err;
        }
        if (names_push(P, n, cur(P)->text))
            goto err;
        advance(P);
        if (expect_op(P, "="))
            goto err;
        tpl_node *v = parse_expression(P, true);
        if (!v || vec_push(P, &n->kids, v))
            goto err;
    }
    advance(P);
    if (subparse(P, &n->body, ends, "with", line))
        goto err;
    advance(P);
    if (expect_block_end(P))
        goto err;
    return n;
err:
    tpl_node_free(n);
    return NULL;
}

static tpl_node *parse_statement(parser *P) {
    tpl_tok *t = cur(P);
    int line = t->line;
    if (t->type != TK_NAME) {
        pfail(P, line, "tag name expected");
        return NULL;
    }
    char name[64];
    snprintf(name, sizeof name, "%s", t->text);
    if (enter(P))
        return NULL;
    advance(P);
    tpl_node *n = NULL;
    if (!strcmp(name, "for")) {
        n = parse_for(P, line);
    } else if (!strcmp(name, "if")) {
        n = parse_if(P, line);
    } else if (!strcmp(name, "set")) {
        n = parse_set(P, line);
    } else if (!strcmp(name, "macro")) {
        n = parse_macro(P, line);
    } else if (!strcmp(name, "filter")) {
        n = parse_filter_block(P, line);
    } else if (!strcmp(name, "with")) {
        n = parse_with(P, line);
    } else if ((!strcmp(name, "break") || !strcmp(name, "continue")) && P->loops == 0) {
        pfail(P, line, "'%s' outside loop", name);
    } else if (!strcmp(name, "break") || !strcmp(name, "continue")) {
        n = node_new(P, name[0] == 'b' ? ND_BREAK : ND_CONTINUE, line);
        if (n && expect_block_end(P)) {
            tpl_node_free(n);
            n = NULL;
        }
    } else if (!strcmp(name, "print")) {
        /* {% print a, b %} prints each expression. */
        n = node_new(P, ND_BODY, line);
        while (n && cur(P)->type != TK_BLOCK_END) {
            tpl_node *o = NULL;
            if ((n->body.n && expect_op(P, ",")) || !(o = node_new(P, ND_OUTPUT, cur(P)->line)) ||
                !(o->a = parse_expression(P, true)) || vec_push(P, &n->body, o)) {
                if (o && !o->a)
                    tpl_node_free(o);
                tpl_node_free(n);
                n = NULL;
            }
        }
        if (n && expect_block_end(P)) {
            tpl_node_free(n);
            n = NULL;
        }
    } else if (!strcmp(name, "generation")) {
        static const char *const ends[] = {"endgeneration", NULL};
        n = node_new(P, ND_BODY, line);
        if (n && (expect_block_end(P) || subparse(P, &n->body, ends, "generation", line))) {
            tpl_node_free(n);
            n = NULL;
        } else if (n) {
            advance(P);
            if (expect_block_end(P)) {
                tpl_node_free(n);
                n = NULL;
            }
        }
    } else if (!strcmp(name, "block") || !strcmp(name, "extends") || !strcmp(name, "include") ||
               !strcmp(name, "import") || !strcmp(name, "from") || !strcmp(name, "call") ||
               !strcmp(name, "autoescape") || !strcmp(name, "do")) {
        pfail(P, line, "the '%s' tag is not supported", name);
    } else {
        pfail(P, line, "Encountered unknown tag '%s'.", name);
    }
    P->depth--;
    return n;
}

/* Parses template content into `body` until a block tag named in `ends`
 * (left current, after its '{%') or the end of the template. */
static int subparse(parser *P, tpl_nodevec *body, const char *const *ends, const char *open_tag, int open_line) {
    for (;;) {
        tpl_tok *t = cur(P);
        tpl_node *n = NULL;
        switch (t->type) {
        case TK_EOF:
            if (ends) {
                char want[128] = "";
                for (int i = 0; ends[i]; i++) {
                    size_t l = strlen(want);
                    snprintf(want + l, sizeof want - l, "%s'%s'", i ? " or " : "", ends[i]);
                }
                return pfail(P, t->line,
                             "Unexpected end of template. Jinja was looking for the following tags: %s. "
                             "The innermost block that needs to be closed is '%s' (line %d).",
                             want, open_tag, open_line);
            }
            return FU_OK;
        case TK_DATA:
            if (!(n = node_new(P, ND_DATA, t->line)) || set_str(P, n, t->text, t->len)) {
                tpl_node_free(n);
                return FU_ERR_NOMEM;
            }
            advance(P);
            break;
        case TK_VAR_BEGIN:
            advance(P);
            if (!(n = node_new(P, ND_OUTPUT, t->line)))
                return FU_ERR_NOMEM;
            if (!(n->a = parse_tuple(P, true, NULL, false, false)) ||
                expect_type(P, TK_VAR_END, "end of print statement")) {
                tpl_node_free(n);
                return FU_ERR_TEMPLATE;
            }
            break;
        case TK_BLOCK_BEGIN:
            advance(P);
            if (ends && cur(P)->type == TK_NAME)
                for (int i = 0; ends[i]; i++)
                    if (!strcmp(cur(P)->text, ends[i]))
                        return FU_OK;
            if (cur(P)->type == TK_NAME && !strncmp(cur(P)->text, "end", 3) && strlen(cur(P)->text) > 3) {
                if (ends)
                    return pfail(P, cur(P)->line,
                                 "Encountered unknown tag '%s'. Jinja was looking for '%s' to close the '%s' block "
                                 "opened at line %d.",
                                 cur(P)->text, ends[0], open_tag, open_line);
                return pfail(P, cur(P)->line, "Encountered unknown tag '%s'.", cur(P)->text);
            }
            if (cur(P)->type == TK_NAME && (!strcmp(cur(P)->text, "else") || !strcmp(cur(P)->text, "elif")))
                return pfail(P, cur(P)->line, "Encountered unknown tag '%s'.", cur(P)->text);
            if (!(n = parse_statement(P)))
                return FU_ERR_TEMPLATE;
            break;
        default:
            return pfail(P, t->line, "unexpected '%s'", describe(t));
        }
        int rc = vec_push(P, body, n);
        if (rc)
            return rc;
    }
}

static int check_vec(parser *P, const tpl_nodevec *v, bool soft);

/* jinja2 rejects unknown filters and tests at compile time unless they sit
 * in an {% if %} or an inline if-expression ("soft" frames; loop, macro,
 * block and with bodies are not soft). */
static int check_names(parser *P, const tpl_node *n, bool soft) {
    if (!n)
        return FU_OK;
    int rc;
    bool known = n->id >= 0 || (n->type == ND_FILTER && tpl_is_jinja2_filter(n->str));
    if ((n->type == ND_FILTER || n->type == ND_TEST) && !known && !soft)
        return pfail(P, n->line, "No %s named '%s'.", n->type == ND_FILTER ? "filter" : "test", n->str);
    bool inner = soft;
    switch (n->type) {
    case ND_IF:
    case ND_COND:
        inner = true;
        break;
    case ND_FOR:
        if ((rc = check_names(P, n->a, soft)))
            return rc;
        return check_names(P, n->b, false) || check_vec(P, &n->body, false) || check_vec(P, &n->alt, false)
                   ? FU_ERR_TEMPLATE : FU_OK;
    case ND_MACRO:
    case ND_SET_BLOCK:
    case ND_FILTER_BLOCK:
    case ND_BODY:
        inner = false;
        break;
    case ND_WITH:
        if ((rc = check_vec(P, &n->kids, soft)))
            return rc;
        return check_vec(P, &n->body, false);
    default:
        break;
    }
    if ((rc = check_names(P, n->a, inner)) || (rc = check_names(P, n->b, inner)) || (rc = check_names(P, n->c, inner)) ||
        (rc = check_vec(P, &n->body, inner)) || (rc = check_vec(P, &n->alt, inner)) || (rc = check_vec(P, &n->kids, inner)))
        return rc;
    return FU_OK;
}

static int check_vec(parser *P, const tpl_nodevec *v, bool soft) {
    for (size_t i = 0; i < v->n; i++) {
        int rc = check_names(P, v->v[i], soft);
        if (rc)
            return rc;
    }
    return FU_OK;
}

int tpl_parse(tpl_toks *toks, tpl_node **out) {
    parser P = {.t = toks};
    *out = NULL;
    tpl_node *root = node_new(&P, ND_BODY, 1);
    if (!root)
        return FU_ERR_NOMEM;
    int rc = subparse(&P, &root->body, NULL, NULL, 0);
    if (!rc)
        rc = check_vec(&P, &root->body, false);
    if (rc) {
        tpl_node_free(root);
        return rc == FU_ERR_NOMEM ? rc : FU_ERR_TEMPLATE;
    }
    *out = root;
    return FU_OK;
}
