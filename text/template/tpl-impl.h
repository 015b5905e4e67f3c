/* tpl-impl.h -- internals of the chat-template interpreter: values, AST, lexer, runtime.
 *
 * The pipeline: tpl_lex (tpl-lex.c) turns the source into tokens, tpl_parse
 * (tpl-parse.c) into a tree of tpl_node, and tpl_exec_template (tpl-eval.c)
 * walks the tree with the values of tpl-value.c and the filters, tests,
 * methods and globals of tpl-builtins.c.
 *
 * Threading: a parsed tree and its constants are immutable and shared by
 * concurrent renders; everything else belongs to one render (its tpl_rt) and
 * one thread. Reference counts are not atomic: a render's values never reach
 * another render, and compile-time values are immortal (rc < 0), so ref and
 * drop leave them alone.
 *
 * Ownership: values are reference counted; a function that writes a tpl_val
 * through an out pointer hands over a new reference, and tpl_val arguments
 * are borrowed unless the comment says "owned". Every value is accounted to
 * the render that allocated it (tpl_limits.max_memory). Tokens own their
 * text, nodes own their children, strings and names, and a tpl_template owns
 * its tree. Output and scratch text go to fu_buf buffers owned by the caller.
 */
#ifndef FU_TPL_IMPL_H
#define FU_TPL_IMPL_H

#include <jansson.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "buf.h"
#include "chat-template.h"

/* ------------------------------------------------------------------------ */
/* Values                                                                    */
/* ------------------------------------------------------------------------ */

/* Kinds of template values, mirroring the Python objects jinja2 sees. */
typedef enum tpl_kind {
    TPL_UNDEF = 0, /* jinja2 Undefined; o is NULL or a tpl_str with the hint */
    TPL_NONE,
    TPL_BOOL,     /* i is 0 or 1 */
    TPL_INT,      /* i */
    TPL_FLOAT,    /* f */
    TPL_STR,      /* o -> tpl_str (UTF-8, immutable) */
    TPL_LIST,     /* o -> tpl_list (list or tuple; immutable once built) */
    TPL_DICT,     /* o -> tpl_dict (insertion ordered; immutable once built) */
    TPL_NS,       /* o -> tpl_dict (a namespace(): attributes are mutable) */
    TPL_FUNC,     /* o -> tpl_func (builtin, bound method or macro) */
    TPL_LOOP,     /* o -> tpl_loop (the `loop` variable of a for loop) */
} tpl_kind;

typedef struct tpl_obj {
    int32_t rc;    /* reference count; negative: immortal (owned by a template) */
    uint32_t kind; /* tpl_kind of the object */
    size_t bytes;  /* bytes accounted to the render that allocated it */
} tpl_obj;

typedef struct tpl_val {
    int kind; /* tpl_kind */
    union {
        int64_t i;
        double f;
        tpl_obj *o;
    };
} tpl_val;

/* A string's data ranges: the bytes that came from the request's data
 * (messages, tools, ...) rather than from the template or the caller's own
 * variables. Sorted, disjoint, non-adjacent. */
typedef struct tpl_spans {
    tpl_span *v;
    size_t n, cap;
} tpl_spans;

typedef struct tpl_str {
    tpl_obj h;
    tpl_span *spans; /* data ranges (owned, accounted in h.bytes); NULL when none */
    size_t nspans;
    size_t len; /* bytes, not counting the terminating NUL */
    char s[];   /* UTF-8, NUL-terminated */
} tpl_str;

typedef struct tpl_list {
    tpl_obj h;
    size_t len, cap;
    bool tuple; /* prints as (a, b) and compares unequal to lists */
    bool gen;   /* came from a generator-returning filter (map, select...) */
    bool holds_mut; /* some item is (or holds) a namespace, loop or function */
    bool holds_data; /* some item is (or holds) a string with data ranges */
    tpl_val *v;
} tpl_list;

typedef struct tpl_dict {
    tpl_obj h;
    size_t len, cap;
    bool holds_mut; /* as tpl_list (namespaces always count as mutable) */
    bool holds_data; /* some key or value holds data (never cleared) */
    tpl_val *k, *v; /* keys are str, int, float, bool or none */
    uint32_t *slots; /* from TPL_DICT_INDEX_MIN keys: open addressing, entry index + 1 (0: empty) */
    size_t n_slots;  /* a power of two > 2 x len, or 0 */
} tpl_dict;

/* Dicts with at least this many keys are indexed by hash (smaller ones are scanned). */
#define TPL_DICT_INDEX_MIN 16

struct tpl_node;
struct tpl_scope;

typedef struct tpl_func {
    tpl_obj h;
    int id;                     /* TPL_FN_* for builtins and methods */
    tpl_val self;               /* bound object for methods (owned) */
    const struct tpl_node *mac; /* macro definition when id == TPL_FN_MACRO */
} tpl_func;

typedef struct tpl_loop {
    tpl_obj h;
    tpl_val items; /* the (filtered) list iterated over (owned) */
    size_t index0; /* current position */
    int depth0;
    tpl_val last_changed; /* for loop.changed() (owned) */
} tpl_loop;

/* Immediate constructors. */
static inline tpl_val tpl_undef(void) { tpl_val v = {.kind = TPL_UNDEF, .o = NULL}; return v; }
static inline tpl_val tpl_none(void) { tpl_val v = {.kind = TPL_NONE, .o = NULL}; return v; }
static inline tpl_val tpl_bool(bool b) { tpl_val v = {.kind = TPL_BOOL, .i = b ? 1 : 0}; return v; }
static inline tpl_val tpl_int(int64_t i) { tpl_val v = {.kind = TPL_INT, .i = i}; return v; }
static inline tpl_val tpl_float(double f) { tpl_val v = {.kind = TPL_FLOAT, .f = f}; return v; }

static inline bool tpl_is_heap(tpl_val v) {
    return v.kind >= TPL_STR || (v.kind == TPL_UNDEF && v.o != NULL);
}
static inline tpl_str *tpl_as_str(tpl_val v) { return (tpl_str *)v.o; }
static inline tpl_list *tpl_as_list(tpl_val v) { return (tpl_list *)v.o; }
static inline tpl_dict *tpl_as_dict(tpl_val v) { return (tpl_dict *)v.o; }
static inline bool tpl_is_num(tpl_val v) {
    return v.kind == TPL_INT || v.kind == TPL_FLOAT || v.kind == TPL_BOOL;
}

/* ------------------------------------------------------------------------ */
/* Runtime state of one render                                              */
/* ------------------------------------------------------------------------ */

typedef struct tpl_scope {
    struct tpl_scope *parent;
    tpl_val vars; /* TPL_DICT of name -> value (owned) */
} tpl_scope;

typedef enum tpl_ctl { TPL_CTL_NONE = 0, TPL_CTL_BREAK, TPL_CTL_CONTINUE } tpl_ctl;

typedef struct tpl_rt {
    const tpl_template *tpl;
    tpl_limits lim;
    fu_buf *out;        /* where output goes now (the result or a capture) */
    tpl_spans *out_spans; /* data ranges of *out */
    int taint;          /* > 0: every new string is all data (see tpl_taint_begin) */
    size_t out_total;   /* bytes written into all buffers (bounded by lim) */
    size_t live_bytes;  /* bytes held by this render's objects */
    uint64_t fuel;      /* work units left */
    uint64_t steps;     /* steps left (lim.max_steps) */
    uint64_t scanned;   /* variables scanned by lookups, not yet counted as steps */
    int depth;          /* macro call depth */
    int frames;         /* nested eval/exec calls, bounding C stack use */
    int line;           /* template line being evaluated, for messages */
    tpl_scope *scope;   /* innermost scope */
    tpl_scope *root;    /* template-level scope */
    tpl_ctl ctl;        /* pending break/continue */
    bool failed;        /* an error message has been recorded */
} tpl_rt;

/* Records a runtime error "line N: message" once and returns `status`. */
int tpl_rt_fail(tpl_rt *R, int status, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
#define tpl_type_error(R, ...) tpl_rt_fail((R), FU_ERR_TEMPLATE, __VA_ARGS__)

/* Charges `units` of work; fails with FU_ERR_EXHAUSTED when the budget is spent. */
int tpl_rt_charge(tpl_rt *R, uint64_t units);

/* ------------------------------------------------------------------------ */
/* Value operations (tpl-value.c). R may be NULL for immortal allocations    */
/* made at compile time. Functions returning tpl_val* write a new reference. */
/* ------------------------------------------------------------------------ */

void tpl_ref(tpl_val v);
void tpl_drop(tpl_rt *R, tpl_val v);
/* Drops *out and leaves it undefined: an error path's result, which its caller may drop too. */
static inline void tpl_drop_out(tpl_rt *R, tpl_val *out) {
    tpl_drop(R, *out);
    *out = tpl_undef();
}
/* Frees an immortal value made at compile time (R == NULL allocations). */
void tpl_free_immortal(tpl_val v);

int tpl_str_new(tpl_rt *R, const char *s, size_t len, tpl_val *out);
int tpl_str_cat(tpl_rt *R, const char *a, size_t alen, const char *b, size_t blen, tpl_val *out);
/* The substring s[lo..hi) (byte offsets on character boundaries), keeping s's data ranges. */
int tpl_str_sub(tpl_rt *R, tpl_val s, size_t lo, size_t hi, tpl_val *out);
int tpl_list_new(tpl_rt *R, size_t cap, tpl_val *out);
/* Appends `v`, taking ownership of it (it is dropped on failure). */
int tpl_list_push(tpl_rt *R, tpl_val list, tpl_val v);
int tpl_dict_new(tpl_rt *R, size_t cap, tpl_val *out);
/* Sets key -> v, taking ownership of both (dropped on failure). */
int tpl_dict_set(tpl_rt *R, tpl_val dict, tpl_val key, tpl_val v);
/* Sets a string key (copied) -> v (owned). */
int tpl_dict_set_cstr(tpl_rt *R, tpl_val dict, const char *key, tpl_val v);
/* Borrowed value for `key`, or NULL. */
tpl_val *tpl_dict_get(tpl_val dict, tpl_val key);
tpl_val *tpl_dict_get_cstr(tpl_val dict, const char *key, size_t len);
int tpl_func_new(tpl_rt *R, int id, tpl_val self, const struct tpl_node *mac, tpl_val *out);
/* An Undefined carrying a hint message (printf-style). */
int tpl_undef_hint(tpl_rt *R, tpl_val *out, const char *fmt, ...) __attribute__((format(printf, 3, 4)));

/* ---- Data ranges (taint): which bytes of a string came from the request's data ----
 * Strings converted from the data variables are all data. Concatenation
 * (+, ~, join, % and str.format, output captured by macros and blocks) keeps
 * the ranges of its parts; any other operation whose inputs hold data makes
 * every string it creates all data (tpl_taint_begin/end around it). */

/* True if v is, or holds, a string with data ranges. */
bool tpl_holds_data(tpl_val v);
/* Appends [start, end) to sp, merging with the last range; ranges must come in order. */
int tpl_spans_add(tpl_rt *R, tpl_spans *sp, size_t start, size_t end);
/* Records that b[before..b->len) is str(v): v's own ranges shifted by
 * `before` when v is a string, else the whole stretch when v holds data. */
int tpl_spans_note(tpl_rt *R, tpl_spans *sp, size_t before, size_t end, tpl_val v);
void tpl_spans_free(tpl_spans *sp);
/* Appends str(v) to b and its data ranges to sp. */
int tpl_buf_str_sp(tpl_rt *R, fu_buf *b, tpl_spans *sp, tpl_val v);
/* tpl_buf_to_str, then gives the new string the ranges of sp (emptied). */
int tpl_buf_to_str_sp(tpl_rt *R, fu_buf *b, tpl_spans *sp, tpl_val *out);
/* Starts/ends a stretch in which new strings are all data when `on`; returns
 * whether it was started, to pass to tpl_taint_end. */
static inline bool tpl_taint_begin(tpl_rt *R, bool on) {
    if (on)
        R->taint++;
    return on;
}
static inline void tpl_taint_end(tpl_rt *R, bool began) {
    if (began)
        R->taint--;
}

/* Converts JSON to a value (deep copy; FU_ERR_INVALID past 100 levels of nesting) and back. */
int tpl_from_json(tpl_rt *R, const json_t *j, tpl_val *out);

/* Python semantics. */
bool tpl_truthy(tpl_val v);
const char *tpl_type_name(tpl_val v); /* 'int', 'str', 'NoneType', ... */
bool tpl_equal(tpl_val a, tpl_val b);
/* Three-way compare for <, <=, >, >=; fails with a TypeError for mixed kinds. */
int tpl_compare(tpl_rt *R, tpl_val a, tpl_val b, const char *op, int *cmp);
/* Undefined's message ("'x' is undefined"). */
const char *tpl_undef_msg(tpl_val v);
int tpl_undef_fail(tpl_rt *R, tpl_val v);

/* Appends n bytes to b, charging them to R's work budget and bounding the
 * buffer by its memory limit (R == NULL: compile time, unbounded); on failure
 * the error is recorded in R and b is unchanged (the caller still frees it). */
int tpl_buf_put(tpl_rt *R, fu_buf *b, const char *s, size_t n);
/* Appends str(v) / repr(v) to a buffer, as tpl_buf_put. */
int tpl_buf_str(tpl_rt *R, fu_buf *b, tpl_val v);
int tpl_buf_repr(tpl_rt *R, fu_buf *b, tpl_val v);
/* Moves the buffer's bytes into a new string value; the buffer is emptied. */
int tpl_buf_to_str(tpl_rt *R, fu_buf *b, tpl_val *out);
/* str(v) as a new string value (returns v itself with a new ref if a string). */
int tpl_to_str(tpl_rt *R, tpl_val v, tpl_val *out);
/* Python's repr(float). */
void tpl_float_repr(double f, char *buf, size_t n);

/* json.dumps(v, ensure_ascii, indent, separators, sort_keys) as transformers' tojson.
 * indent: NULL for none, else the indent string. */
typedef struct tpl_json_opts {
    const char *indent; size_t indent_len;
    const char *item_sep; size_t item_sep_len;
    const char *key_sep; size_t key_sep_len;
    bool sort_keys;
    bool ensure_ascii;
} tpl_json_opts;
int tpl_buf_json(tpl_rt *R, fu_buf *b, tpl_val v, const tpl_json_opts *o, int level);

/* Returns a new list of the items of an iterable (list, tuple, dict keys,
 * string characters, Undefined -> empty); TypeError for the rest. */
int tpl_iter_list(tpl_rt *R, tpl_val v, tpl_val *out);

/* UTF-8 helpers: number of code points; byte offset of code point `i`. */
size_t tpl_utf8_len(const char *s, size_t n);
size_t tpl_utf8_offset(const char *s, size_t n, size_t i);
/* Decodes one code point at s (n bytes left); sets *adv to its size (>=1). */
int32_t tpl_utf8_get(const char *s, size_t n, size_t *adv);
size_t tpl_utf8_put(int32_t cp, char *out);

/* ------------------------------------------------------------------------ */
/* Lexer and parser (tpl-lex.c, tpl-parse.c)                                */
/* ------------------------------------------------------------------------ */

typedef enum tpl_tok_type {
    TK_EOF = 0,
    TK_DATA,        /* raw text (already whitespace-controlled) */
    TK_VAR_BEGIN,   /* {{ */
    TK_VAR_END,     /* }} */
    TK_BLOCK_BEGIN, /* {% */
    TK_BLOCK_END,   /* %} */
    TK_NAME,
    TK_STRING,      /* text holds the decoded value */
    TK_INT,
    TK_FLOAT,
    TK_OP,          /* text holds the operator: + - * / // % ** ~ ( ) [ ] { } . , : | = == != < <= > >= */
} tpl_tok_type;

typedef struct tpl_tok {
    int type;
    int line;
    char *text; /* owned; NUL-terminated */
    size_t len;
    int64_t ival;
    double fval;
} tpl_tok;

typedef struct tpl_toks {
    tpl_tok *v;
    size_t n, cap;
} tpl_toks;

/* Tokenizes `src` with trim_blocks and lstrip_blocks semantics. On error
 * returns FU_ERR_TEMPLATE with a message naming the line. */
int tpl_lex(const char *src, size_t len, tpl_toks *out);
void tpl_toks_free(tpl_toks *t);

typedef enum tpl_node_type {
    /* statements */
    ND_DATA,      /* str: text */
    ND_OUTPUT,    /* a: expression */
    ND_IF,        /* a: test, body: then, alt: else */
    ND_FOR,       /* names: targets, a: iterable, b: filter or NULL, body, alt: else */
    ND_SET,       /* names: targets (str: namespace attr when set), a: value */
    ND_SET_BLOCK, /* names[0]: target, str: ns attr, body, kids: filters (ND_FILTER with a=NULL) */
    ND_MACRO,     /* str: name, names: params, alt: defaults (NULL entries), body */
    ND_BREAK,
    ND_CONTINUE,
    ND_FILTER_BLOCK, /* body, kids: filter chain */
    ND_WITH,      /* names, kids: values, body */
    ND_BODY,      /* body (used for {% generation %}) */
    /* expressions */
    ND_CONST,     /* val */
    ND_NAME,      /* str */
    ND_GETATTR,   /* a: object, str: attribute */
    ND_GETITEM,   /* a: object, b: key */
    ND_SLICE,     /* a: object, kids[0..2]: start, stop, step (NULL entries) */
    ND_CALL,      /* a: callee, body: positional args, alt: keyword values, names: keywords */
    ND_FILTER,    /* a: input, str: name, id, body/alt/names: args */
    ND_TEST,      /* a: input, str: name, id, body/alt/names: args */
    ND_NOT,       /* a */
    ND_NEG,       /* a */
    ND_POS,       /* a */
    ND_BINOP,     /* op, a, b */
    ND_COMPARE,   /* a: first operand, body: further operands, ops: operators */
    ND_AND,       /* a, b */
    ND_OR,        /* a, b */
    ND_COND,      /* a: then value, b: test, c: else value or NULL */
    ND_LIST,      /* body: items */
    ND_TUPLE,     /* body: items */
    ND_DICT,      /* body: keys, alt: values */
} tpl_node_type;

typedef enum tpl_op {
    OP_ADD = 1, OP_SUB, OP_MUL, OP_DIV, OP_FLOORDIV, OP_MOD, OP_POW, OP_CONCAT,
    OP_EQ, OP_NE, OP_LT, OP_LE, OP_GT, OP_GE, OP_IN, OP_NOTIN,
} tpl_op;

typedef struct tpl_nodevec {
    struct tpl_node **v;
    size_t n, cap;
} tpl_nodevec;

typedef struct tpl_node {
    int type; /* tpl_node_type */
    int op;   /* tpl_op for ND_BINOP */
    int line;
    int id;   /* resolved filter/test id, -1 if unknown */
    struct tpl_node *a, *b, *c;
    tpl_nodevec body, alt, kids;
    char *str;
    size_t len;
    char **names;
    size_t nnames;
    int *ops;  /* ND_COMPARE operators, one per body entry */
    tpl_val val;
} tpl_node;

struct tpl_template {
    tpl_node *root; /* ND_BODY */
};

/* Parses tokens into an ND_BODY tree. */
int tpl_parse(tpl_toks *toks, tpl_node **out);
void tpl_node_free(tpl_node *n);

/* ------------------------------------------------------------------------ */
/* Evaluation and builtins (tpl-eval.c, tpl-builtins.c)                     */
/* ------------------------------------------------------------------------ */

/* Evaluated call arguments (borrowed values). */
typedef struct tpl_args {
    size_t npos;
    tpl_val *pos;
    size_t nkw;
    char *const *kwnames;
    tpl_val *kw;
} tpl_args;

enum {
    TPL_FN_MACRO = 1,
    TPL_FN_RANGE, TPL_FN_NAMESPACE, TPL_FN_DICT, TPL_FN_RAISE, TPL_FN_STRFTIME,
    TPL_FN_LOOP_CYCLE, TPL_FN_LOOP_CHANGED,
    TPL_FN_METHOD_BASE = 100, /* + method index (see tpl-builtins.c) */
};

int tpl_filter_id(const char *name);
/* True for jinja2 builtin filters fusion does not implement (errors only when used). */
bool tpl_is_jinja2_filter(const char *name);
int tpl_test_id(const char *name);
int tpl_global_id(const char *name);
/* Method id for attribute `name` on `obj`, or -1 if it has no such method. */
int tpl_method_id(tpl_val obj, const char *name);
/* True when `name` is a mutating method of list/dict (blocked by the sandbox). */
bool tpl_unsafe_method(tpl_val obj, const char *name);

int tpl_apply_filter(tpl_rt *R, int id, const char *name, tpl_val in, const tpl_args *a, tpl_val *out);
int tpl_apply_test(tpl_rt *R, int id, const char *name, tpl_val in, const tpl_args *a, bool *out);
/* Calls a builtin function or bound method (not macros). */
int tpl_call_builtin(tpl_rt *R, tpl_func *f, const tpl_args *a, tpl_val *out);

/* Argument binding: fills out[i] (borrowed) for each parameter name, or
 * leaves a TPL_UNDEF with o == NULL marker for missing ones (check with
 * `bound[i]`). Fails on unknown keywords or too many positionals. */
int tpl_bind(tpl_rt *R, const char *fname, const tpl_args *a, const char *const *params, size_t nparams,
             tpl_val *out, bool *bound);

/* Python's `fmt % args` string formatting (also the `format` filter). */
int tpl_format_percent(tpl_rt *R, tpl_val fmt, tpl_val args, tpl_val *out);
/* A loop object iterating over `items` (a list; a new reference is taken). */
int tpl_loop_new(tpl_rt *R, tpl_val items, tpl_val *out);
/* Sets *found if `v` holds (directly or nested) the mutable object `obj`, or
 * is nested too deeply to tell: storing v inside obj would make a cycle.
 * Charges the traversal to the work budget. */
int tpl_reaches(tpl_rt *R, tpl_val v, const tpl_obj *obj, bool *found);
/* Python binary operator `op` (OP_ADD...OP_CONCAT). */
int tpl_binop(tpl_rt *R, int op, tpl_val a, tpl_val b, tpl_val *out);
/* Runs a parsed template's top-level body. */
int tpl_exec_template(tpl_rt *R, const tpl_node *root);

/* Used by builtins: getattr with jinja2 semantics, and calling a macro. */
int tpl_getattr(tpl_rt *R, tpl_val obj, const char *name, size_t len, tpl_val *out);
int tpl_getitem(tpl_rt *R, tpl_val obj, tpl_val key, tpl_val *out);

#endif
