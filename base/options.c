/* options.c -- one description of a program's options: the command line, JSON config files, --help. */
#include "options.h"

#include <assert.h>
#include <errno.h>
#include <jansson.h>
#include <limits.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "mapped-file.h"
#include "parse.h"
#include "status.h"

/* ---- names ------------------------------------------------------------------------------- */

/* Whether the an bytes at a and the bn bytes at b are one name, '-' and '_' alike. */
static bool same_name(const char *a, size_t an, const char *b, size_t bn) {
    if (an != bn) return false;
    for (size_t i = 0; i < an; i++)
        if ((a[i] == '_' ? '-' : a[i]) != (b[i] == '_' ? '-' : b[i])) return false;
    return true;
}

/* Whether the n bytes at s name o: its long name or one of its aliases. */
static bool names(const fu_opt *o, const char *s, size_t n) {
    if (same_name(o->name, strlen(o->name), s, n)) return true;
    for (const char *p = o->alias; p && *p;) {
        size_t len = strcspn(p, "|");
        if (same_name(p, len, s, n)) return true;
        p += len + (p[len] == '|');
    }
    return false;
}

/* The entry the n bytes at s name, or NULL. */
static const fu_opt *find_long(const fu_opt *opts, const char *s, size_t n) {
    for (const fu_opt *o = opts; o->name; o++)
        if (names(o, s, n)) return o;
    return NULL;
}

/* The entry whose short name is c (not 0), or NULL. */
static const fu_opt *find_short(const fu_opt *opts, char c) {
    for (const fu_opt *o = opts; o->name; o++)
        if (o->short_name == c) return o;
    return NULL;
}

/* ---- storing one value ------------------------------------------------------------------- */

static int parse_bool(const char *v, bool *out) {
    static const char *const yes[] = {"1", "true", "yes", "on"}, *const no[] = {"0", "false", "no", "off"};
    for (size_t i = 0; i < sizeof yes / sizeof *yes; i++)
        if (!strcmp(v, yes[i]) || !strcmp(v, no[i])) {
            *out = !strcmp(v, yes[i]);
            return FU_OK;
        }
    return fu_errorf(FU_ERR_INVALID, "expected true or false, got '%s'", v);
}

/* Stores x in the destination: 1 byte is a bool, 4 an int32_t (int, an enum), 8 an int64_t
 * (long, size_t, uint64_t). */
static void store_integer(const fu_opt *o, long x) {
    if (o->size == 1) {
        bool b = x != 0;
        memcpy(o->dest, &b, 1);
    } else if (o->size == sizeof(int32_t)) {
        int32_t y = (int32_t)x;
        memcpy(o->dest, &y, sizeof y);
    } else {
        assert(o->size == sizeof(int64_t));
        int64_t y = x;
        memcpy(o->dest, &y, sizeof y);
    }
}

/* FU_OPT_FLAG, FU_OPT_BOOL: v NULL is a flag given alone. */
static int store_bool(const fu_opt *o, const char *v) {
    bool b = true;
    int rc = v ? parse_bool(v, &b) : FU_OK;
    if (!rc) store_integer(o, b != ((o->flags & FU_OPT_NEGATE) != 0));
    return rc;
}

static int store_int(const fu_opt *o, const char *v) {
    const bool wide = o->size == sizeof(int64_t);
    long lo = o->lo, hi = o->hi, x;
    if (!lo && !hi) {
        lo = wide ? LONG_MIN : INT32_MIN;
        hi = wide ? LONG_MAX : INT32_MAX;
    }
    int rc = fu_parse_long(v, lo, hi, &x);
    if (!rc) store_integer(o, x);
    return rc;
}

static int store_float(const fu_opt *o, const char *v) {
    if (o->size == sizeof(float)) return fu_parse_float(v, o->dest);
    return fu_parse_double(v, o->dest);
}

/* A copy of v, a leading "~/" made "$HOME/" when expand is set; NULL when out of memory. */
static char *copy_value(const char *v, bool expand) {
    const char *home = getenv("HOME");
    if (!expand || !home || v[0] != '~' || v[1] != '/') return strdup(v);
    char *s = NULL;
    return asprintf(&s, "%s%s", home, v + 1) < 0 ? NULL : s;
}

static int store_string(const fu_opt *o, const char *v) {
    char *s = copy_value(v, o->kind == FU_OPT_PATH);
    if (!s) return fu_errorf(FU_ERR_NOMEM, "out of memory");
    char **dst = o->dest;
    free(*dst);
    *dst = s;
    return FU_OK;
}

/* The largest file FU_OPT_FILE_TEXT reads (a secret, a token). */
#define FU_OPT_FILE_TEXT_MAX 65536

/* FU_OPT_FILE_TEXT: the file's text, trailing newlines and spaces dropped. Only a regular
 * file is read (mf_read): a FIFO or a device is refused at once rather than waited on. */
static int store_file_text(const fu_opt *o, const char *path) {
    char *text;
    size_t n;
    int rc = mf_read(path, FU_OPT_FILE_TEXT_MAX, &text, &n);
    if (rc) return rc;
    while (n && (text[n - 1] == '\n' || text[n - 1] == '\r' || text[n - 1] == ' ')) text[--n] = '\0';
    rc = store_string(o, text);
    free(text);
    return rc;
}

static int list_add(fu_opt_list *l, const char *v) {
    char **items = realloc(l->items, (l->n + 1) * sizeof *items);
    if (!items) return fu_errorf(FU_ERR_NOMEM, "out of memory");
    l->items = items;
    if (!(items[l->n] = strdup(v))) return fu_errorf(FU_ERR_NOMEM, "out of memory");
    l->n++;
    return FU_OK;
}

/* Writes the choices as "a|b|c" into buf. */
static void choice_names(const fu_opt_choice *c, char *buf, size_t n) {
    size_t len = 0;
    buf[0] = '\0';
    for (; c && c->name && len < n; c++)
        len += (size_t)snprintf(buf + len, n - len, "%s%s", len ? "|" : "", c->name);
}

static int store_choice(const fu_opt *o, const char *v) {
    for (const fu_opt_choice *c = o->choices; c && c->name; c++)
        if (!strcmp(c->name, v)) {
            store_integer(o, c->value);
            return FU_OK;
        }
    char names[256];
    choice_names(o->choices, names, sizeof names);
    return fu_errorf(FU_ERR_INVALID, "expected %s, got '%s'", names, v);
}

/* "A:B" with lo <= A < B <= hi (hi 0: INT_MAX) into span[2]. */
static int parse_span(const char *v, long lo, long hi, int span[2]) {
    long a, b;
    if (!hi) hi = INT_MAX;
    if (fu_parse_range(v, lo, hi, &a, &b)) return FU_ERR_INVALID;
    if (a == b) return fu_errorf(FU_ERR_INVALID, "the span '%s' is empty", v);
    span[0] = (int)a;
    span[1] = (int)b;
    return FU_OK;
}

/* Stores v (NULL: a flag given alone) in o's destination. FU_OK or the error, unlabelled. */
static int store(const fu_opt *o, const char *v) {
    switch (o->kind) {
    case FU_OPT_FLAG:
    case FU_OPT_BOOL: return store_bool(o, v);
    case FU_OPT_STRING:
    case FU_OPT_PATH: return store_string(o, v);
    case FU_OPT_FILE_TEXT: return store_file_text(o, v);
    case FU_OPT_LIST: return list_add(o->dest, v);
    case FU_OPT_INT: return store_int(o, v);
    case FU_OPT_FLOAT: return store_float(o, v);
    case FU_OPT_CHOICE: return store_choice(o, v);
    case FU_OPT_SPAN: return parse_span(v, o->lo, o->hi, o->dest);
    case FU_OPT_CALL: return o->fn(o->dest, v);
    case FU_OPT_CONFIG: break; /* apply() loads it */
    }
    return fu_errorf(FU_ERR_INTERNAL, "option kind %d", (int)o->kind);
}

/* store(), its error prefixed with "label: "; a config file's errors name the file. */
static int apply(const fu_opt *opts, const fu_opt *o, const char *v, const char *label) {
    if (o->kind == FU_OPT_CONFIG) return fu_opt_load(opts, v);
    int rc = store(o, v);
    return rc ? fu_errorf(rc, "%s: %s", label, fu_last_error()) : FU_OK;
}

int fu_opt_defaults(const fu_opt *opts) {
    for (const fu_opt *o = opts; o->name; o++) {
        int rc = o->def && o->kind != FU_OPT_LIST ? apply(opts, o, o->def, o->name) : FU_OK;
        if (rc) return rc;
    }
    return FU_OK;
}

int fu_opt_set(const fu_opt *opts, const char *name, const char *value) {
    const fu_opt *o = find_long(opts, name, strlen(name));
    if (!o) return fu_errorf(FU_ERR_INVALID, "unknown option '%s'", name);
    return apply(opts, o, value, name);
}

/* ---- config files ------------------------------------------------------------------------ */

/* What o takes in a config file, for a type error. */
static const char *json_wanted(const fu_opt *o) {
    switch (o->kind) {
    case FU_OPT_FLAG:
    case FU_OPT_BOOL: return "true or false";
    case FU_OPT_INT: return "an integer";
    case FU_OPT_FLOAT: return "a number";
    default: return "a string";
    }
}

static const char *json_kind(const json_t *v) {
    return json_is_boolean(v) ? "a boolean" : json_is_array(v) ? "an array" : json_is_object(v) ? "an object"
                                                                            : "a number";
}

/* Applies one JSON value of `key` to o: scalars as text, arrays element by element. */
static int apply_json(const fu_opt *opts, const fu_opt *o, const char *key, const json_t *v) {
    const bool flag = o->kind == FU_OPT_FLAG || o->kind == FU_OPT_BOOL;
    const bool many = o->kind == FU_OPT_LIST || (o->flags & FU_OPT_REPEAT);
    char num[64];
    if (json_is_null(v)) return FU_OK;
    if (json_is_string(v)) return apply(opts, o, json_string_value(v), key);
    if (json_is_integer(v)) {
        snprintf(num, sizeof num, "%lld", (long long)json_integer_value(v));
        return apply(opts, o, num, key);
    }
    if (json_is_real(v) && o->kind == FU_OPT_FLOAT) {
        snprintf(num, sizeof num, "%.17g", json_real_value(v));
        return apply(opts, o, num, key);
    }
    if (json_is_boolean(v) && flag) return apply(opts, o, json_is_true(v) ? "true" : "false", key);
    if (json_is_array(v) && many) {
        size_t i;
        const json_t *e;
        json_array_foreach(v, i, e) {
            int rc = apply_json(opts, o, key, e);
            if (rc) return rc;
        }
        return FU_OK;
    }
    return fu_errorf(FU_ERR_INVALID, "%s: expected %s, got %s", key, json_wanted(o), json_kind(v));
}

/* Applies every key of the object root. */
static int apply_object(const fu_opt *opts, const json_t *root) {
    const char *key;
    const json_t *val;
    json_object_foreach((json_t *)root, key, val) {
        if (key[0] == '_' || !strcmp(key, "comment")) continue; /* they document the file */
        const fu_opt *o = find_long(opts, key, strlen(key));
        if (!o || o->kind == FU_OPT_CONFIG || (o->flags & FU_OPT_NOFILE))
            return fu_errorf(FU_ERR_INVALID, "unknown option '%s'", key);
        int rc = apply_json(opts, o, key, val);
        if (rc) return rc;
    }
    return FU_OK;
}

int fu_opt_load(const fu_opt *opts, const char *path) {
    json_error_t err;
    json_t *root = json_load_file(path, JSON_REJECT_DUPLICATES, &err);
    if (!root && err.line < 1) return fu_errorf(FU_ERR_IO, "%s", err.text); /* names the file */
    if (!root) return fu_errorf(FU_ERR_FORMAT, "%s:%d: %s", path, err.line, err.text);
    int rc = json_is_object(root) ? apply_object(opts, root)
                                  : fu_errorf(FU_ERR_FORMAT, "the config must be a JSON object");
    json_decref(root);
    return rc ? fu_errorf(rc, "%s: %s", path, fu_last_error()) : FU_OK;
}

/* ---- the command line -------------------------------------------------------------------- */

/* One argument read from argv. */
typedef struct arg_read {
    const fu_opt *opt;  /* NULL: an operand (argv[at]) */
    const char *value;  /* NULL: a flag given alone */
    int at;             /* index of the argument */
    char label[80];     /* the option as written, for messages: "--workers", "-n" */
} arg_read;

/* Reads a long option at argv[*i] ("--name", "--name=value", "--name value"). */
static int read_long(const fu_opt *opts, int argc, char **argv, int *i, arg_read *r) {
    const char *a = argv[*i] + 2, *eq = strchr(a, '=');
    size_t n = eq ? (size_t)(eq - a) : strlen(a);
    snprintf(r->label, sizeof r->label, "--%.*s", (int)n, a);
    if (!strcmp(r->label, "--help")) return FU_OPT_HELP_ASKED;
    if (!strcmp(r->label, "--print-config")) return FU_OPT_CONFIG_ASKED;
    if (!(r->opt = find_long(opts, a, n))) return fu_errorf(FU_ERR_INVALID, "unknown option '%s'", r->label);
    if (eq) r->value = eq + 1;
    else if (r->opt->kind != FU_OPT_FLAG && *i + 1 < argc) r->value = argv[++*i];
    else if (r->opt->kind != FU_OPT_FLAG) return fu_errorf(FU_ERR_INVALID, "%s needs a value", r->label);
    return FU_OK;
}

/* Reads a short option at argv[*i] ("-x", "-xVALUE", "-x VALUE"). */
static int read_short(const fu_opt *opts, int argc, char **argv, int *i, arg_read *r) {
    const char *a = argv[*i];
    snprintf(r->label, sizeof r->label, "-%c", a[1]);
    if (a[1] == 'h' && !a[2]) return FU_OPT_HELP_ASKED;
    if (!(r->opt = find_short(opts, a[1]))) return fu_errorf(FU_ERR_INVALID, "unknown option '%s'", a);
    if (r->opt->kind == FU_OPT_FLAG) {
        if (a[2]) return fu_errorf(FU_ERR_INVALID, "%s takes no value, got '%s'", r->label, a);
    } else if (a[2]) {
        r->value = a + 2;
    } else if (*i + 1 < argc) {
        r->value = argv[++*i];
    } else {
        return fu_errorf(FU_ERR_INVALID, "%s needs a value", r->label);
    }
    return FU_OK;
}

/* Reads the argument at argv[*i] (and its value), advancing *i past them. *operands_only
 * turns on at "--". FU_OK, FU_OPT_HELP_ASKED or FU_ERR_INVALID. */
static int read_arg(const fu_opt *opts, int argc, char **argv, int *i, bool *operands_only, arg_read *r) {
    const char *a = argv[*i];
    memset(r, 0, sizeof *r);
    r->at = *i;
    int rc = FU_OK;
    if (!*operands_only && !strcmp(a, "--")) {
        *operands_only = true;
        r->at = -1; /* nothing */
    } else if (!*operands_only && a[0] == '-' && a[1] == '-') {
        rc = read_long(opts, argc, argv, i, r);
    } else if (!*operands_only && a[0] == '-' && a[1]) {
        rc = read_short(opts, argc, argv, i, r);
    }
    ++*i;
    return rc;
}

enum { PASS_CHECK, PASS_CONFIG, PASS_APPLY };

/* One pass over argv: PASS_CHECK reads every argument (errors, --help), PASS_CONFIG loads the
 * config files, PASS_APPLY applies the other options and gathers the operands. */
static int walk(const fu_opt *opts, int argc, char **argv, int pass, int *n_operands) {
    bool operands_only = false;
    int n = 0;
    for (int i = 1; i < argc;) {
        arg_read r;
        int rc = read_arg(opts, argc, argv, &i, &operands_only, &r);
        if (rc) return rc;
        if (r.at < 0) continue; /* "--" */
        if (!r.opt && !n_operands) return fu_errorf(FU_ERR_INVALID, "unexpected argument '%s'", argv[r.at]);
        if (!r.opt && pass == PASS_APPLY) argv[++n] = argv[r.at]; /* n < r.at: already read */
        if (r.opt && pass == (r.opt->kind == FU_OPT_CONFIG ? PASS_CONFIG : PASS_APPLY) &&
            (rc = apply(opts, r.opt, r.value, r.label)))
            return rc;
    }
    if (pass == PASS_APPLY && n_operands) *n_operands = n;
    return FU_OK;
}

int fu_opt_parse(const fu_opt *opts, int argc, char **argv, int *n_operands) {
    int rc = walk(opts, argc, argv, PASS_CHECK, n_operands);
    if (!rc) rc = fu_opt_defaults(opts);
    if (!rc) rc = walk(opts, argc, argv, PASS_CONFIG, n_operands);
    if (!rc) rc = walk(opts, argc, argv, PASS_APPLY, n_operands);
    return rc;
}

/* ---- help -------------------------------------------------------------------------------- */

/* The value's name in the help ("N", "f32|f16"); "" for a flag. */
static const char *arg_name(const fu_opt *o, char *buf, size_t n) {
    static const char *const names[] = {
        [FU_OPT_FLAG] = "",     [FU_OPT_BOOL] = "true|false", [FU_OPT_STRING] = "S",  [FU_OPT_PATH] = "FILE",
        [FU_OPT_FILE_TEXT] = "FILE", [FU_OPT_LIST] = "S",   [FU_OPT_INT] = "N",     [FU_OPT_FLOAT] = "X",
        [FU_OPT_SPAN] = "A:B",  [FU_OPT_CALL] = "VALUE",      [FU_OPT_CONFIG] = "FILE"};
    if (o->arg) return o->arg;
    if (o->kind != FU_OPT_CHOICE) return names[o->kind];
    choice_names(o->choices, buf, n);
    return buf;
}

/* The option column of o's help line: "  -n, --name ARG". */
static void option_column(const fu_opt *o, char *buf, size_t n) {
    char choices[256];
    const char *arg = arg_name(o, choices, sizeof choices);
    if (o->short_name) snprintf(buf, n, "  -%c, --%s%s%s", o->short_name, o->name, *arg ? " " : "", arg);
    else snprintf(buf, n, "  --%s%s%s", o->name, *arg ? " " : "", arg);
}

/* Writes text, each '\n' followed by `indent` spaces. */
static void write_indented(FILE *f, const char *text, int indent) {
    for (const char *p = text; *p; p++) {
        fputc(*p, f);
        if (*p == '\n') fprintf(f, "%*s", indent, "");
    }
}

enum { HELP_MAX_COLUMN = 30 };

/* Where the help texts start: past the widest option column that stays within
 * HELP_MAX_COLUMN (a wider one puts its text on the next line). */
static int help_column(const fu_opt *opts) {
    char left[400];
    int col = (int)strlen("  -h, --help") + 2;
    for (const fu_opt *o = opts; o->name; o++) {
        option_column(o, left, sizeof left);
        int want = (int)strlen(left) + 2;
        if (o->help && want > col && want <= HELP_MAX_COLUMN) col = want;
    }
    return col;
}

/* One option's help: its column, then its text and default from column col. */
static void help_line(FILE *f, const fu_opt *o, int col) {
    char left[400];
    option_column(o, left, sizeof left);
    int len = (int)strlen(left);
    fputs(left, f);
    if (len + 2 > col) fprintf(f, "\n%*s", col, "");
    else fprintf(f, "%*s", col - len, "");
    write_indented(f, o->help, col);
    if (o->def) fprintf(f, " (default %s)", o->def);
    fputc('\n', f);
}

void fu_opt_help(FILE *f, const fu_opt_spec *spec) {
    int col = help_column(spec->opts);
    fprintf(f, "%s\n", spec->usage);
    for (const fu_opt *o = spec->opts; o->name; o++)
        if (o->help) help_line(f, o, col);
    fprintf(f, "%-*sthis text\n", col, "  -h, --help");
    fprintf(f, "%-*severy option as a JSON config file with its default\n", col, "  --print-config");
    if (spec->epilog) fputs(spec->epilog, f);
}

/* An option's default as the JSON its kind takes (null: none); a new reference. */
static json_t *config_default(const fu_opt *o) {
    long v;
    if (!o->def) return json_null(); /* a flag too: false would set a negated one */
    if (o->kind == FU_OPT_INT && !fu_parse_long(o->def, LONG_MIN, LONG_MAX, &v)) return json_integer(v);
    if (o->kind == FU_OPT_FLOAT) return json_real(strtod(o->def, NULL));
    if (o->kind == FU_OPT_FLAG || o->kind == FU_OPT_BOOL)
        return json_boolean(!strcmp(o->def, "true") || !strcmp(o->def, "1") || !strcmp(o->def, "yes"));
    return json_string(o->def);
}

/* Adds option o to the config document: "_name" (its help) then "name" (its default). */
static int config_entry(json_t *doc, const fu_opt *o) {
    char key[96], comment[98], choices[256];
    snprintf(key, sizeof key, "%s", o->name);
    for (char *c = key; *c; c++) if (*c == '-') *c = '_';
    snprintf(comment, sizeof comment, "_%s", key);
    const char *arg = arg_name(o, choices, sizeof choices);
    char *text = NULL;
    const char *only = o->flags & FU_OPT_NOFILE ? "command line only, " : "";
    size_t n = strlen(o->help ? o->help : "") + strlen(arg) + strlen(only) + 8;
    if ((text = malloc(n))) snprintf(text, n, "%s%s%s%s", only, arg, *arg ? ": " : "", o->help ? o->help : "");
    for (char *c = text; c && *c; c++) if (*c == '\n') *c = ' ';
    int rc = text ? json_object_set_new(doc, comment, json_string(text)) : -1;
    free(text);
    if (o->flags & FU_OPT_NOFILE) return rc ? FU_ERR_NOMEM : FU_OK; /* a comment only: no key loads it */
    return rc || json_object_set_new(doc, key, config_default(o)) ? FU_ERR_NOMEM : FU_OK;
}

int fu_opt_print_config(FILE *f, const fu_opt_spec *spec) {
    json_t *doc = json_object();
    char head[256];
    snprintf(head, sizeof head, "%s --config FILE: every option, with its default (made by %s --print-config; "
                                "keys starting with '_' are comments, null values are skipped)", spec->prog, spec->prog);
    int rc = doc && !json_object_set_new(doc, "_comment", json_string(head)) ? FU_OK : FU_ERR_NOMEM;
    for (const fu_opt *o = spec->opts; o->name && !rc; o++)
        if (o->kind != FU_OPT_CONFIG && o->help) rc = config_entry(doc, o);
    if (!rc && json_dumpf(doc, f, JSON_INDENT(2) | JSON_PRESERVE_ORDER | JSON_REAL_PRECISION(9))) rc = FU_ERR_IO;
    if (!rc) fputc('\n', f);
    json_decref(doc);
    return rc ? fu_errorf(rc, "--print-config") : FU_OK;
}

int fu_opt_fail(const fu_opt_spec *spec, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "%s: ", spec->prog);
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
    fu_opt_help(stderr, spec);
    return 2;
}

int fu_opt_main(const fu_opt_spec *spec, int argc, char **argv, int *n_operands) {
    int rc = fu_opt_parse(spec->opts, argc, argv, n_operands);
    if (rc == FU_OPT_HELP_ASKED) {
        fu_opt_help(stdout, spec);
        return 0;
    }
    if (rc == FU_OPT_CONFIG_ASKED) return fu_opt_print_config(stdout, spec) ? 1 : 0;
    return rc ? fu_opt_fail(spec, "%s", fu_last_error()) : -1;
}

/* ---- the rest ---------------------------------------------------------------------------- */

void fu_opt_free(const fu_opt *opts) {
    for (const fu_opt *o = opts; o->name; o++) {
        if (o->kind == FU_OPT_STRING || o->kind == FU_OPT_PATH || o->kind == FU_OPT_FILE_TEXT) {
            char **s = o->dest;
            free(*s);
            *s = NULL;
        } else if (o->kind == FU_OPT_LIST) {
            fu_opt_list *l = o->dest;
            for (size_t i = 0; i < l->n; i++) free(l->items[i]);
            free(l->items);
            memset(l, 0, sizeof *l);
        }
    }
}

int fu_opt_split_span(const char *s, long hi, char **prefix, int span[2]) {
    const char *b = strrchr(s, ':'), *a = b;
    while (a && a > s && *--a != ':') {}
    if (!a || a == s || *a != ':')
        return fu_errorf(FU_ERR_INVALID, "expected ADDRESS:FIRST:LAST, got '%s'", s);
    if (parse_span(a + 1, 0, hi, span)) return fu_errorf(FU_ERR_INVALID, "'%s': %s", s, fu_last_error());
    if (!(*prefix = strndup(s, (size_t)(a - s)))) return fu_errorf(FU_ERR_NOMEM, "out of memory");
    return FU_OK;
}
