/* tpl-eval.c -- tree-walking evaluator: scopes, statements, operators, attribute access, calls, macros. */
#include "tpl-impl.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int eval(tpl_rt *R, const tpl_node *n, tpl_val *out);
static int exec_body(tpl_rt *R, const tpl_nodevec *body);

/* Keeps the recursive dispatchers (eval_node, exec_stmt) small: each kind of
 * node pays for its own stack frame only when it is evaluated, which is what
 * lets TPL_MAX_FRAMES nested evaluations fit a small thread stack. */
#define TPL_NOINLINE __attribute__((noinline))

/* Run-time nesting, weighted by C stack use: an expression counts 1 (about
 * 200 bytes under ASan), a statement body 3 and a macro call 1 more. Macro
 * calls and the tree's nesting (bounded at compile time) are the sources of
 * depth. Measured under ASan: the full 400 frames of macro recursion take
 * about 80 KiB, and printing a value nested as deep as tpl-value.c allows at
 * that point about 90 KiB more, so the worst case stays well inside a
 * 256 KiB thread stack (the unit tests run it on 192 KiB). */
#define TPL_MAX_FRAMES 400
#define TPL_FRAMES_EXPR 1
#define TPL_FRAMES_BODY 3
#define TPL_FRAMES_MACRO 1

static int frame_enter(tpl_rt *R, int weight);

/* ------------------------------------------------------------------------ */
/* Scopes and output                                                         */
/* ------------------------------------------------------------------------ */

static int scope_push(tpl_rt *R, tpl_scope *s, tpl_scope *parent) {
    s->parent = parent;
    int rc = tpl_dict_new(R, 0, &s->vars);
    if (rc)
        return rc;
    R->scope = s;
    return FU_OK;
}

static void scope_pop(tpl_rt *R, tpl_scope *s, tpl_scope *restore) {
    tpl_drop(R, s->vars);
    s->vars = tpl_undef();
    R->scope = restore;
}

/* Variable tables are searched linearly: a lookup notes the variables it
 * scans, and the next step() counts them, so that a template defining tens
 * of thousands of variables runs out of steps instead of going quadratic. */
static void note_scan(tpl_rt *R, tpl_val dict) { R->scanned += tpl_as_dict(dict)->len; }

/* Counts `units` steps plus the variables scanned since the last call (8 to
 * a step) against the step budget, and charges them as work; fails with
 * FU_ERR_EXHAUSTED when either budget is spent. */
static int step(tpl_rt *R, uint64_t units) {
    units += R->scanned / 8;
    R->scanned %= 8;
    if (units > R->steps) {
        R->steps = 0;
        return tpl_rt_fail(R, FU_ERR_EXHAUSTED, "template exceeded its step limit (%llu steps)",
                           (unsigned long long)R->lim.max_steps);
    }
    R->steps -= units;
    return tpl_rt_charge(R, units);
}

static tpl_val *scope_lookup(tpl_rt *R, const char *name, size_t len) {
    for (tpl_scope *s = R->scope; s; s = s->parent) {
        note_scan(R, s->vars);
        tpl_val *v = tpl_dict_get_cstr(s->vars, name, len);
        if (v)
            return v;
    }
    return NULL;
}

/* Binds name -> v (owned) in the innermost scope. */
static int scope_set(tpl_rt *R, const char *name, tpl_val v) {
    note_scan(R, R->scope->vars);
    return tpl_dict_set_cstr(R, R->scope->vars, name, v);
}

static int emit(tpl_rt *R, const char *s, size_t n) {
    if (n > R->lim.max_output || R->out_total > R->lim.max_output - n)
        return tpl_rt_fail(R, FU_ERR_EXHAUSTED, "template output exceeded its limit (%zu bytes)", R->lim.max_output);
    R->out_total += n;
    return tpl_buf_put(R, R->out, s, n);
}

/* Writes str(v), recording its data ranges in R->out_spans. */
static int emit_val(tpl_rt *R, tpl_val v) {
    size_t before = R->out->len;
    int rc;
    if (v.kind == TPL_STR) {
        rc = emit(R, tpl_as_str(v)->s, tpl_as_str(v)->len);
    } else {
        if ((rc = tpl_buf_str(R, R->out, v)))
            return rc;
        size_t n = R->out->len - before;
        if (n > R->lim.max_output || R->out_total > R->lim.max_output - n)
            return tpl_rt_fail(R, FU_ERR_EXHAUSTED, "template output exceeded its limit (%zu bytes)", R->lim.max_output);
        R->out_total += n;
    }
    return rc ? rc : tpl_spans_note(R, R->out_spans, before, R->out->len, v);
}

/* ------------------------------------------------------------------------ */
/* Attribute and item access (jinja2 sandbox semantics)                      */
/* ------------------------------------------------------------------------ */

static const char *obj_type_repr(tpl_val v) {
    switch (v.kind) {
    case TPL_NONE: return "None";
    case TPL_BOOL: return "bool object";
    case TPL_INT: return "int object";
    case TPL_FLOAT: return "float object";
    case TPL_STR: return "str object";
    case TPL_LIST: return tpl_as_list(v)->tuple ? "tuple object" : "list object";
    case TPL_DICT: return "dict object";
    case TPL_NS: return "jinja2.utils.Namespace object";
    case TPL_LOOP: return "jinja2.runtime.LoopContext object";
    default: return "object";
    }
}

static int missing_attr(tpl_rt *R, tpl_val obj, const char *name, tpl_val *out) {
    return tpl_undef_hint(R, out, "'%s' has no attribute '%s'", obj_type_repr(obj), name);
}

static int loop_attr(tpl_rt *R, tpl_val obj, const char *name, tpl_val *out) {
    tpl_loop *l = (tpl_loop *)obj.o;
    tpl_list *items = tpl_as_list(l->items);
    size_t len = items->len, i = l->index0;
    if (!strcmp(name, "index"))
        *out = tpl_int((int64_t)i + 1);
    else if (!strcmp(name, "index0"))
        *out = tpl_int((int64_t)i);
    else if (!strcmp(name, "revindex"))
        *out = tpl_int((int64_t)(len - i));
    else if (!strcmp(name, "revindex0"))
        *out = tpl_int((int64_t)(len - i - 1));
    else if (!strcmp(name, "first"))
        *out = tpl_bool(i == 0);
    else if (!strcmp(name, "last"))
        *out = tpl_bool(i + 1 == len);
    else if (!strcmp(name, "length"))
        *out = tpl_int((int64_t)len);
    else if (!strcmp(name, "depth"))
        *out = tpl_int(l->depth0 + 1);
    else if (!strcmp(name, "depth0"))
        *out = tpl_int(l->depth0);
    else if (!strcmp(name, "previtem")) {
        if (i == 0)
            return tpl_undef_hint(R, out, "there is no previous item");
        *out = items->v[i - 1];
        tpl_ref(*out);
    } else if (!strcmp(name, "nextitem")) {
        if (i + 1 >= len)
            return tpl_undef_hint(R, out, "there is no next item");
        *out = items->v[i + 1];
        tpl_ref(*out);
    } else if (!strcmp(name, "cycle"))
        return tpl_func_new(R, TPL_FN_LOOP_CYCLE, obj, NULL, out);
    else if (!strcmp(name, "changed"))
        return tpl_func_new(R, TPL_FN_LOOP_CHANGED, obj, NULL, out);
    else
        return missing_attr(R, obj, name, out);
    return FU_OK;
}

int tpl_getattr(tpl_rt *R, tpl_val obj, const char *name, size_t len, tpl_val *out) {
    if (obj.kind == TPL_UNDEF)
        return tpl_undef_fail(R, obj);
    int mid = tpl_method_id(obj, name);
    if (mid >= 0)
        return tpl_func_new(R, mid, obj, NULL, out);
    if (tpl_unsafe_method(obj, name))
        return tpl_undef_hint(R, out, "access to attribute '%s' of '%s' object is unsafe.", name, tpl_type_name(obj));
    switch (obj.kind) {
    case TPL_DICT:
    case TPL_NS: {
        tpl_val *v = tpl_dict_get_cstr(obj, name, len);
        if (v) {
            *out = *v;
            tpl_ref(*out);
            return FU_OK;
        }
        return missing_attr(R, obj, name, out);
    }
    case TPL_LOOP:
        return loop_attr(R, obj, name, out);
    default:
        return missing_attr(R, obj, name, out);
    }
}

/* Python index normalization for a sequence of `len` items. */
static bool norm_index(tpl_val key, size_t len, size_t *idx) {
    if (key.kind != TPL_INT && key.kind != TPL_BOOL)
        return false;
    int64_t i = key.i;
    if (i < 0)
        i += (int64_t)len;
    if (i < 0 || (uint64_t)i >= len)
        return false;
    *idx = (size_t)i;
    return true;
}

static int no_element(tpl_rt *R, tpl_val obj, tpl_val key, tpl_val *out) {
    if (key.kind == TPL_STR)
        return missing_attr(R, obj, tpl_as_str(key)->s, out);
    fu_buf b = {0};
    int rc = tpl_buf_repr(R, &b, key);
    if (!rc)
        rc = tpl_undef_hint(R, out, "%s has no element %s", obj_type_repr(obj), b.data ? b.data : "");
    fu_buf_free(&b);
    return rc;
}

int tpl_getitem(tpl_rt *R, tpl_val obj, tpl_val key, tpl_val *out) {
    size_t idx;
    switch (obj.kind) {
    case TPL_UNDEF:
        return tpl_undef_fail(R, obj);
    case TPL_DICT: {
        int rc = tpl_rt_charge(R, tpl_as_dict(obj)->len / 16);
        if (rc)
            return rc;
        tpl_val *v = tpl_dict_get(obj, key);
        if (v) {
            *out = *v;
            tpl_ref(*out);
            return FU_OK;
        }
        break;
    }
    case TPL_LIST:
        if (norm_index(key, tpl_as_list(obj)->len, &idx)) {
            *out = tpl_as_list(obj)->v[idx];
            tpl_ref(*out);
            return FU_OK;
        }
        break;
    case TPL_STR: {
        tpl_str *s = tpl_as_str(obj);
        int rc = tpl_rt_charge(R, s->len / 32);
        if (rc)
            return rc;
        if (norm_index(key, tpl_utf8_len(s->s, s->len), &idx)) {
            size_t off = tpl_utf8_offset(s->s, s->len, idx), adv;
            tpl_utf8_get(s->s + off, s->len - off, &adv);
            return tpl_str_sub(R, obj, off, off + adv, out);
        }
        break;
    }
    case TPL_NS:
        if (key.kind == TPL_STR) {
            tpl_val *v = tpl_dict_get(obj, key);
            if (v) {
                *out = *v;
                tpl_ref(*out);
                return FU_OK;
            }
        }
        break;
    default:
        break;
    }
    if (key.kind == TPL_STR && obj.kind != TPL_NS)
        return tpl_getattr(R, obj, tpl_as_str(key)->s, tpl_as_str(key)->len, out);
    return no_element(R, obj, key, out);
}

/* Python slice index adjustment (PySlice_AdjustIndices). */
static int slice_indices(tpl_rt *R, const tpl_val *sv, int64_t len, int64_t *start, int64_t *stop, int64_t *step) {
    for (int i = 0; i < 3; i++)
        if (sv[i].kind != TPL_NONE && sv[i].kind != TPL_INT && sv[i].kind != TPL_BOOL)
            return tpl_type_error(R, "slice indices must be integers or None");
    *step = sv[2].kind == TPL_NONE ? 1 : sv[2].i;
    if (*step == 0)
        return tpl_type_error(R, "slice step cannot be zero");
    int64_t lo_def = *step < 0 ? len - 1 : 0, hi_def = *step < 0 ? -1 : len;
    for (int k = 0; k < 2; k++) {
        int64_t *dst = k == 0 ? start : stop;
        if (sv[k].kind == TPL_NONE) {
            *dst = k == 0 ? lo_def : hi_def;
            continue;
        }
        int64_t v = sv[k].i;
        if (v < 0) {
            v += len;
            if (v < 0)
                v = *step < 0 ? -1 : 0;
        } else if (v >= len) {
            v = *step < 0 ? len - 1 : len;
        }
        *dst = v;
    }
    return FU_OK;
}

static int do_slice(tpl_rt *R, tpl_val obj, const tpl_val *sv, tpl_val *out) {
    int64_t start, stop, step;
    int rc;
    if (obj.kind == TPL_UNDEF)
        return tpl_undef_fail(R, obj);
    if (obj.kind == TPL_LIST) {
        tpl_list *l = tpl_as_list(obj);
        if ((rc = slice_indices(R, sv, (int64_t)l->len, &start, &stop, &step)) || (rc = tpl_list_new(R, 0, out)))
            return rc;
        tpl_as_list(*out)->tuple = l->tuple;
        for (int64_t i = start; step > 0 ? i < stop : i > stop; i += step) {
            tpl_ref(l->v[i]);
            if ((rc = tpl_list_push(R, *out, l->v[i]))) {
                tpl_drop_out(R, out);
                return rc;
            }
        }
        return FU_OK;
    }
    if (obj.kind == TPL_STR) {
        tpl_str *s = tpl_as_str(obj);
        size_t ncp = tpl_utf8_len(s->s, s->len);
        if ((rc = slice_indices(R, sv, (int64_t)ncp, &start, &stop, &step)))
            return rc;
        if (ncp == s->len) { /* ASCII fast path */
            if (step == 1)
                return tpl_str_new(R, s->s + start, stop > start ? (size_t)(stop - start) : 0, out);
        }
        /* General case: index code point offsets. */
        size_t *offs = malloc((ncp + 1) * sizeof *offs);
        if (!offs)
            return tpl_rt_fail(R, FU_ERR_NOMEM, "out of memory");
        size_t k = 0;
        for (size_t i = 0; i < s->len; i++)
            if (((unsigned char)s->s[i] & 0xC0) != 0x80)
                offs[k++] = i;
        offs[ncp] = s->len;
        fu_buf b = {0};
        rc = FU_OK;
        for (int64_t i = start; !rc && (step > 0 ? i < stop : i > stop); i += step)
            rc = tpl_buf_put(R, &b, s->s + offs[i], offs[i + 1] - offs[i]);
        free(offs);
        if (rc) {
            fu_buf_free(&b);
            return rc;
        }
        return tpl_buf_to_str(R, &b, out);
    }
    /* jinja2 slices with a plain Python subscript (no sandbox fallback). */
    if (obj.kind == TPL_DICT || obj.kind == TPL_NS)
        return tpl_type_error(R, "unhashable type: 'slice'");
    return tpl_type_error(R, "'%s' object is not subscriptable", tpl_type_name(obj));
}

/* ------------------------------------------------------------------------ */
/* Operators                                                                 */
/* ------------------------------------------------------------------------ */

static const char *op_sym(int op) {
    switch (op) {
    case OP_ADD: return "+";
    case OP_SUB: return "-";
    case OP_MUL: return "*";
    case OP_DIV: return "/";
    case OP_FLOORDIV: return "//";
    case OP_MOD: return "%";
    case OP_POW: return "** or pow()";
    default: return "?";
    }
}

static double num_f(tpl_val v) { return v.kind == TPL_FLOAT ? v.f : (double)v.i; }

static int unsupported(tpl_rt *R, int op, tpl_val a, tpl_val b) {
    return tpl_type_error(R, "unsupported operand type(s) for %s: '%s' and '%s'", op_sym(op), tpl_type_name(a),
                          tpl_type_name(b));
}

static int repeat_seq(tpl_rt *R, tpl_val seq, int64_t times, tpl_val *out) {
    int rc;
    if (times < 0)
        times = 0;
    if (seq.kind == TPL_STR) {
        tpl_str *s = tpl_as_str(seq);
        if (s->len && (uint64_t)times > R->lim.max_memory / s->len)
            return tpl_rt_fail(R, FU_ERR_EXHAUSTED, "template exceeded its memory limit (%zu bytes)", R->lim.max_memory);
        fu_buf b = {0};
        rc = FU_OK;
        for (int64_t i = 0; i < times && !rc; i++)
            rc = tpl_buf_put(R, &b, s->s, s->len);
        if (rc) {
            fu_buf_free(&b);
            return rc;
        }
        return tpl_buf_to_str(R, &b, out);
    }
    tpl_list *l = tpl_as_list(seq);
    if (l->len && (uint64_t)times > R->lim.max_memory / (l->len * sizeof(tpl_val)))
        return tpl_rt_fail(R, FU_ERR_EXHAUSTED, "template exceeded its memory limit (%zu bytes)", R->lim.max_memory);
    if ((rc = tpl_list_new(R, 0, out)))
        return rc;
    tpl_as_list(*out)->tuple = l->tuple;
    for (int64_t i = 0; i < times; i++)
        for (size_t j = 0; j < l->len; j++) {
            tpl_ref(l->v[j]);
            if ((rc = tpl_list_push(R, *out, l->v[j]))) {
                tpl_drop_out(R, out);
                return rc;
            }
        }
    return FU_OK;
}

/* a ~ b: str(a) + str(b). */
static int binop_concat(tpl_rt *R, tpl_val a, tpl_val b, tpl_val *out) {
    fu_buf buf = {0};
    tpl_spans sp = {0};
    int rc = tpl_buf_str_sp(R, &buf, &sp, a);
    if (!rc)
        rc = tpl_buf_str_sp(R, &buf, &sp, b);
    if (rc) {
        fu_buf_free(&buf);
        tpl_spans_free(&sp);
        return rc;
    }
    return tpl_buf_to_str_sp(R, &buf, &sp, out);
}

/* a + b, a - b, a * b on numbers: floats if either is, else ints checked for overflow. */
static int num_arith(tpl_rt *R, int op, tpl_val a, tpl_val b, tpl_val *out) {
    if (a.kind == TPL_FLOAT || b.kind == TPL_FLOAT) {
        double x = num_f(a), y = num_f(b);
        *out = tpl_float(op == OP_ADD ? x + y : op == OP_SUB ? x - y : x * y);
        return FU_OK;
    }
    int64_t r;
    bool over = op == OP_ADD   ? __builtin_add_overflow(a.i, b.i, &r)
                : op == OP_SUB ? __builtin_sub_overflow(a.i, b.i, &r)
                               : __builtin_mul_overflow(a.i, b.i, &r);
    if (over)
        return tpl_type_error(R, "integer overflow");
    *out = tpl_int(r);
    return FU_OK;
}

/* a + b on sequences: str + str, or list + list (tuple + tuple). */
static int seq_add(tpl_rt *R, tpl_val a, tpl_val b, tpl_val *out) {
    if (a.kind == TPL_STR && b.kind == TPL_STR)
        return binop_concat(R, a, b, out);
    if (a.kind == TPL_LIST && b.kind == TPL_LIST && tpl_as_list(a)->tuple == tpl_as_list(b)->tuple) {
        tpl_list *x = tpl_as_list(a), *y = tpl_as_list(b);
        int rc = tpl_list_new(R, x->len + y->len, out);
        if (rc)
            return rc;
        tpl_as_list(*out)->tuple = x->tuple;
        for (size_t i = 0; i < x->len + y->len; i++) {
            tpl_val v = i < x->len ? x->v[i] : y->v[i - x->len];
            tpl_ref(v);
            if ((rc = tpl_list_push(R, *out, v))) {
                tpl_drop_out(R, out);
                return rc;
            }
        }
        return FU_OK;
    }
    if (a.kind == TPL_STR || a.kind == TPL_LIST)
        return tpl_type_error(R, "can only concatenate %s (not \"%s\") to %s", tpl_type_name(a), tpl_type_name(b),
                              tpl_type_name(a));
    return unsupported(R, OP_ADD, a, b);
}

/* a * b with a sequence: repetition by an int. */
static int seq_mul(tpl_rt *R, tpl_val a, tpl_val b, tpl_val *out) {
    bool a_seq = a.kind == TPL_STR || a.kind == TPL_LIST, b_seq = b.kind == TPL_STR || b.kind == TPL_LIST;
    if (a_seq && (b.kind == TPL_INT || b.kind == TPL_BOOL))
        return repeat_seq(R, a, b.i, out);
    if (b_seq && (a.kind == TPL_INT || a.kind == TPL_BOOL))
        return repeat_seq(R, b, a.i, out);
    if (a_seq || b_seq)
        return tpl_type_error(R, "can't multiply sequence by non-int of type '%s'", tpl_type_name(a_seq ? b : a));
    return unsupported(R, OP_MUL, a, b);
}

/* a // b or a % b on ints, with Python's floor semantics. */
static int int_divmod(tpl_rt *R, int op, int64_t a, int64_t b, tpl_val *out) {
    if (b == 0)
        return tpl_type_error(R, op == OP_MOD ? "integer modulo by zero" : "integer division or modulo by zero");
    if (a == INT64_MIN && b == -1)
        return tpl_type_error(R, "integer overflow");
    int64_t q = a / b, m = a % b;
    if (m != 0 && ((m < 0) != (b < 0))) {
        q--;
        m += b;
    }
    *out = tpl_int(op == OP_MOD ? m : q);
    return FU_OK;
}

/* a // b or a % b on numbers; floats as Python computes them. */
static int num_divmod(tpl_rt *R, int op, tpl_val a, tpl_val b, tpl_val *out) {
    if (a.kind != TPL_FLOAT && b.kind != TPL_FLOAT)
        return int_divmod(R, op, a.i, b.i, out);
    if (num_f(b) == 0.0)
        return tpl_type_error(R, op == OP_MOD ? "float modulo" : "float floor division by zero");
    double x = num_f(a), y = num_f(b);
    double m = fmod(x, y);
    if (m != 0.0 && ((m < 0) != (y < 0)))
        m += y;
    else if (m == 0.0)
        m = copysign(0.0, y);
    if (op == OP_MOD) {
        *out = tpl_float(m);
        return FU_OK;
    }
    double q = (x - m) / y, fq = floor(q);
    if (q - fq > 0.5)
        fq += 1.0;
    *out = tpl_float(fq);
    return FU_OK;
}

/* a ** b on numbers: an int for int ** non-negative int (checked), else a float. */
static int num_pow(tpl_rt *R, tpl_val a, tpl_val b, tpl_val *out) {
    if (a.kind != TPL_FLOAT && b.kind != TPL_FLOAT && b.i >= 0) {
        int64_t base = a.i, acc = 1, e = b.i;
        while (e > 0) {
            if (e & 1 && __builtin_mul_overflow(acc, base, &acc))
                return tpl_type_error(R, "integer overflow");
            e >>= 1;
            if (e && __builtin_mul_overflow(base, base, &base))
                return tpl_type_error(R, "integer overflow");
        }
        *out = tpl_int(acc);
        return FU_OK;
    }
    if (num_f(a) == 0.0 && num_f(b) < 0)
        return tpl_type_error(R, "0.0 cannot be raised to a negative power");
    *out = tpl_float(pow(num_f(a), num_f(b)));
    return FU_OK;
}

int tpl_binop(tpl_rt *R, int op, tpl_val a, tpl_val b, tpl_val *out) {
    if (op == OP_CONCAT)
        return binop_concat(R, a, b, out);
    if (op == OP_MOD && a.kind == TPL_STR) /* str.__mod__ runs first, even with an Undefined argument */
        return tpl_format_percent(R, a, b, out);
    if (a.kind == TPL_UNDEF)
        return tpl_undef_fail(R, a);
    if (b.kind == TPL_UNDEF)
        return tpl_undef_fail(R, b);
    bool nums = tpl_is_num(a) && tpl_is_num(b);
    if (nums && (op == OP_ADD || op == OP_SUB || op == OP_MUL))
        return num_arith(R, op, a, b, out);
    if (!nums && (op == OP_SUB || op == OP_DIV || op == OP_FLOORDIV || op == OP_MOD || op == OP_POW))
        return unsupported(R, op, a, b);
    switch (op) {
    case OP_ADD: return seq_add(R, a, b, out);
    case OP_MUL: {
        bool taint = tpl_taint_begin(R, tpl_holds_data(a) || tpl_holds_data(b));
        int rc = seq_mul(R, a, b, out);
        tpl_taint_end(R, taint);
        return rc;
    }
    case OP_DIV:
        if (num_f(b) == 0.0)
            return tpl_type_error(R, "division by zero");
        *out = tpl_float(num_f(a) / num_f(b));
        return FU_OK;
    case OP_FLOORDIV:
    case OP_MOD: return num_divmod(R, op, a, b, out);
    case OP_POW: return num_pow(R, a, b, out);
    }
    return tpl_type_error(R, "unknown operator");
}

/* `a in b` */
static int contains(tpl_rt *R, tpl_val a, tpl_val b, bool *res) {
    switch (b.kind) {
    case TPL_UNDEF:
        *res = false;
        return FU_OK;
    case TPL_STR: {
        if (a.kind == TPL_UNDEF)
            return tpl_undef_fail(R, a);
        if (a.kind != TPL_STR)
            return tpl_type_error(R, "'in <string>' requires string as left operand, not %s", tpl_type_name(a));
        tpl_str *h = tpl_as_str(b), *nd = tpl_as_str(a);
        int rc = tpl_rt_charge(R, h->len / 32);
        if (rc)
            return rc;
        *res = nd->len == 0 || (nd->len <= h->len && memmem(h->s, h->len, nd->s, nd->len) != NULL);
        return FU_OK;
    }
    case TPL_LIST: {
        tpl_list *l = tpl_as_list(b);
        int rc = tpl_rt_charge(R, l->len / 8);
        if (rc)
            return rc;
        *res = false;
        for (size_t i = 0; i < l->len && !*res; i++)
            *res = tpl_equal(l->v[i], a);
        return FU_OK;
    }
    case TPL_DICT: {
        if (a.kind == TPL_LIST || a.kind == TPL_DICT || a.kind == TPL_NS)
            return tpl_type_error(R, "unhashable type: '%s'", tpl_type_name(a));
        int rc = tpl_rt_charge(R, tpl_as_dict(b)->len / 8);
        if (rc)
            return rc;
        *res = tpl_dict_get(b, a) != NULL;
        return FU_OK;
    }
    default:
        return tpl_type_error(R, "argument of type '%s' is not iterable", tpl_type_name(b));
    }
}

static int compare_op(tpl_rt *R, int op, tpl_val a, tpl_val b, bool *res) {
    int cmp, rc;
    switch (op) {
    case OP_EQ:
        *res = tpl_equal(a, b);
        return FU_OK;
    case OP_NE:
        *res = !tpl_equal(a, b);
        return FU_OK;
    case OP_IN:
        return contains(R, a, b, res);
    case OP_NOTIN:
        rc = contains(R, a, b, res);
        *res = !*res;
        return rc;
    default: {
        const char *sym = op == OP_LT ? "<" : op == OP_LE ? "<=" : op == OP_GT ? ">" : ">=";
        if ((rc = tpl_compare(R, a, b, sym, &cmp)))
            return rc;
        if (cmp == 2) { /* NaN */
            *res = false;
            return FU_OK;
        }
        *res = op == OP_LT ? cmp < 0 : op == OP_LE ? cmp <= 0 : op == OP_GT ? cmp > 0 : cmp >= 0;
        return FU_OK;
    }
    }
}

/* ------------------------------------------------------------------------ */
/* Calls                                                                     */
/* ------------------------------------------------------------------------ */

/* Evaluated arguments of a call node; release with args_free. */
typedef struct eargs {
    tpl_args a;
    tpl_val small[8];
} eargs;

static void args_free(tpl_rt *R, eargs *e) {
    size_t n = e->a.npos + e->a.nkw;
    for (size_t i = 0; i < n; i++)
        tpl_drop(R, e->a.pos[i]);
    if (e->a.pos != e->small)
        free(e->a.pos);
}

static int args_eval(tpl_rt *R, const tpl_node *n, eargs *e) {
    size_t total = n->body.n + n->alt.n;
    e->a.pos = total <= 8 ? e->small : malloc(total * sizeof(tpl_val));
    if (!e->a.pos)
        return tpl_rt_fail(R, FU_ERR_NOMEM, "out of memory");
    e->a.npos = 0;
    e->a.nkw = 0;
    e->a.kwnames = n->names;
    for (size_t i = 0; i < n->body.n; i++) {
        int rc = eval(R, n->body.v[i], &e->a.pos[i]);
        if (rc) {
            args_free(R, e);
            return rc;
        }
        e->a.npos++;
    }
    e->a.kw = e->a.pos + n->body.n;
    for (size_t i = 0; i < n->alt.n; i++) {
        int rc = eval(R, n->alt.v[i], &e->a.kw[i]);
        if (rc) {
            args_free(R, e);
            return rc;
        }
        e->a.nkw++;
    }
    return FU_OK;
}

int tpl_bind(tpl_rt *R, const char *fname, const tpl_args *a, const char *const *params, size_t nparams,
             tpl_val *out, bool *bound) {
    for (size_t i = 0; i < nparams; i++) {
        out[i] = tpl_undef();
        bound[i] = false;
    }
    if (a->npos > nparams)
        return tpl_type_error(R, "%s() takes at most %zu argument(s) (%zu given)", fname, nparams, a->npos);
    for (size_t i = 0; i < a->npos; i++) {
        out[i] = a->pos[i];
        bound[i] = true;
    }
    for (size_t k = 0; k < a->nkw; k++) {
        size_t i = 0;
        while (i < nparams && strcmp(params[i], a->kwnames[k]) != 0)
            i++;
        if (i == nparams)
            return tpl_type_error(R, "%s() got an unexpected keyword argument '%s'", fname, a->kwnames[k]);
        if (bound[i])
            return tpl_type_error(R, "%s() got multiple values for argument '%s'", fname, a->kwnames[k]);
        out[i] = a->kw[k];
        bound[i] = true;
    }
    return FU_OK;
}

TPL_NOINLINE static int call_macro(tpl_rt *R, const tpl_node *m, const tpl_args *a, tpl_val *out) {
    if (a->npos > m->nnames)
        return tpl_type_error(R, "macro '%s' takes not more than %zu argument(s)", m->str, m->nnames);
    if (R->depth >= R->lim.max_depth)
        return tpl_rt_fail(R, FU_ERR_EXHAUSTED, "macro calls nested deeper than %d", R->lim.max_depth);
    for (size_t k = 0; k < a->nkw; k++) {
        size_t i = 0;
        while (i < m->nnames && strcmp(m->names[i], a->kwnames[k]) != 0)
            i++;
        if (i == m->nnames)
            return tpl_type_error(R, "macro '%s' takes no keyword argument '%s'", m->str, a->kwnames[k]);
        if (i < a->npos)
            return tpl_type_error(R, "macro '%s' got multiple values for argument '%s'", m->str, a->kwnames[k]);
    }
    tpl_scope *saved_scope = R->scope;
    fu_buf *saved_out = R->out;
    tpl_spans *saved_spans = R->out_spans;
    tpl_ctl saved_ctl = R->ctl;
    tpl_scope sc;
    int rc = scope_push(R, &sc, R->root);
    if (rc)
        return rc;
    for (size_t i = 0; i < m->nnames && !rc; i++) {
        tpl_val v = tpl_undef();
        bool have = false;
        if (i < a->npos) {
            v = a->pos[i];
            tpl_ref(v);
            have = true;
        }
        for (size_t k = 0; k < a->nkw && !have; k++)
            if (!strcmp(m->names[i], a->kwnames[k])) {
                v = a->kw[k];
                tpl_ref(v);
                have = true;
            }
        if (!have && i < m->alt.n && m->alt.v[i]) {
            rc = eval(R, m->alt.v[i], &v);
            have = !rc;
        }
        if (!have && !rc)
            rc = tpl_undef_hint(R, &v, "parameter '%s' was not provided", m->names[i]);
        if (!rc)
            rc = scope_set(R, m->names[i], v);
    }
    fu_buf buf = {0};
    tpl_spans sp = {0};
    if (!rc && !(rc = frame_enter(R, TPL_FRAMES_MACRO))) {
        R->out = &buf;
        R->out_spans = &sp;
        R->depth++;
        rc = exec_body(R, &m->body);
        R->depth--;
        R->frames -= TPL_FRAMES_MACRO;
        R->out = saved_out;
        R->out_spans = saved_spans;
    }
    R->ctl = saved_ctl;
    scope_pop(R, &sc, saved_scope);
    if (rc) {
        fu_buf_free(&buf);
        tpl_spans_free(&sp);
        return rc;
    }
    return tpl_buf_to_str_sp(R, &buf, &sp, out);
}

static int call_value(tpl_rt *R, tpl_val f, const tpl_args *a, tpl_val *out) {
    if (f.kind == TPL_UNDEF)
        return tpl_undef_fail(R, f);
    if (f.kind != TPL_FUNC)
        return tpl_type_error(R, "'%s' object is not callable", tpl_type_name(f));
    tpl_func *fn = (tpl_func *)f.o;
    if (fn->id == TPL_FN_MACRO)
        return call_macro(R, fn->mac, a, out);
    return tpl_call_builtin(R, fn, a, out);
}

/* A call: obj.method(...) and global functions run as a transient builtin
 * without materializing a function value; anything else is evaluated and called. */
TPL_NOINLINE static int eval_call(tpl_rt *R, const tpl_node *n, tpl_val *out) {
    const tpl_node *callee = n->a;
    tpl_func fn = {.h = {.rc = -1, .kind = TPL_FUNC}, .id = -1, .self = tpl_undef()};
    tpl_val fv = tpl_undef();
    int rc = FU_OK;
    if (callee->type == ND_GETATTR) {
        if ((rc = eval(R, callee->a, &fn.self)))
            return rc;
        fn.id = fn.self.kind == TPL_UNDEF ? -1 : tpl_method_id(fn.self, callee->str);
        if (fn.id < 0)
            rc = tpl_getattr(R, fn.self, callee->str, callee->len, &fv);
    } else if (callee->type == ND_NAME && !scope_lookup(R, callee->str, callee->len) &&
               tpl_global_id(callee->str) > 0) {
        fn.id = tpl_global_id(callee->str);
    } else {
        rc = eval(R, callee, &fv);
    }
    eargs e;
    if (!rc && !(rc = args_eval(R, n, &e))) {
        R->line = n->line;
        rc = fn.id >= 0 ? tpl_call_builtin(R, &fn, &e.a, out) : call_value(R, fv, &e.a, out);
        args_free(R, &e);
    }
    tpl_drop(R, fn.self);
    tpl_drop(R, fv);
    return rc;
}

/* Applies the filter node f (its arguments evaluated now) to x (borrowed). */
static int filter_apply(tpl_rt *R, const tpl_node *f, tpl_val x, tpl_val *out) {
    eargs e;
    int rc = args_eval(R, f, &e);
    if (rc)
        return rc;
    R->line = f->line;
    rc = tpl_apply_filter(R, f->id, f->str, x, &e.a, out);
    args_free(R, &e);
    return rc;
}

/* Applies a filter chain whose innermost input is the placeholder ND_CONST
 * (for {% filter %} and {% set x | f %}) to `in` (borrowed). */
TPL_NOINLINE static int apply_chain(tpl_rt *R, const tpl_node *f, tpl_val in, tpl_val *out) {
    if (f->type != ND_FILTER) {
        tpl_ref(in);
        *out = in;
        return FU_OK;
    }
    tpl_val x;
    int rc = frame_enter(R, TPL_FRAMES_EXPR);
    if (rc)
        return rc;
    rc = apply_chain(R, f->a, in, &x);
    R->frames -= TPL_FRAMES_EXPR;
    if (rc)
        return rc;
    rc = filter_apply(R, f, x, out);
    tpl_drop(R, x);
    return rc;
}

/* ------------------------------------------------------------------------ */
/* Expressions                                                               */
/* ------------------------------------------------------------------------ */

TPL_NOINLINE static int eval_seq(tpl_rt *R, const tpl_node *n, bool tuple, tpl_val *out) {
    int rc = tpl_list_new(R, n->body.n, out);
    if (rc)
        return rc;
    tpl_as_list(*out)->tuple = tuple;
    for (size_t i = 0; i < n->body.n; i++) {
        tpl_val v;
        if ((rc = eval(R, n->body.v[i], &v)) || (rc = tpl_list_push(R, *out, v))) {
            tpl_drop_out(R, out);
            return rc;
        }
    }
    return FU_OK;
}

static bool hashable(tpl_val v) { return v.kind <= TPL_STR || (v.kind == TPL_LIST && tpl_as_list(v)->tuple); }


static int eval_node(tpl_rt *R, const tpl_node *n, tpl_val *out);

/* Enters a nesting level of `weight` frames; fails past TPL_MAX_FRAMES (the
 * caller leaves with R->frames -= weight). */
static int frame_enter(tpl_rt *R, int weight) {
    if (R->frames + weight > TPL_MAX_FRAMES)
        return tpl_rt_fail(R, FU_ERR_EXHAUSTED, "template nested too deeply at run time (limit %d)", TPL_MAX_FRAMES);
    R->frames += weight;
    return FU_OK;
}

static int eval(tpl_rt *R, const tpl_node *n, tpl_val *out) {
    int rc = frame_enter(R, TPL_FRAMES_EXPR);
    if (rc)
        return rc;
    rc = eval_node(R, n, out);
    R->frames -= TPL_FRAMES_EXPR;
    return rc;
}

/* An operation on the value of n->a (borrowed); *out receives a new reference. */
typedef int (*unary_fn)(tpl_rt *R, const tpl_node *n, tpl_val a, tpl_val *out);
/* An operation on the values of n->a and n->b (borrowed). */
typedef int (*binary_fn)(tpl_rt *R, const tpl_node *n, tpl_val a, tpl_val b, tpl_val *out);

/* Evaluates n->a, then fn on it. */
TPL_NOINLINE static int eval_unary(tpl_rt *R, const tpl_node *n, unary_fn fn, tpl_val *out) {
    tpl_val a;
    int rc = eval(R, n->a, &a);
    if (rc)
        return rc;
    rc = fn(R, n, a, out);
    tpl_drop(R, a);
    return rc;
}

/* Evaluates n->a and n->b, then fn on them (at n's line). */
TPL_NOINLINE static int eval_binary(tpl_rt *R, const tpl_node *n, binary_fn fn, tpl_val *out) {
    tpl_val a, b;
    int rc = eval(R, n->a, &a);
    if (rc)
        return rc;
    if ((rc = eval(R, n->b, &b))) {
        tpl_drop(R, a);
        return rc;
    }
    R->line = n->line;
    rc = fn(R, n, a, b, out);
    tpl_drop(R, a);
    tpl_drop(R, b);
    return rc;
}

/* Evaluates e for its truth value only. */
static int eval_truth(tpl_rt *R, const tpl_node *e, bool *t) {
    tpl_val v;
    int rc = eval(R, e, &v);
    if (rc)
        return rc;
    *t = tpl_truthy(v);
    tpl_drop(R, v);
    return FU_OK;
}

/* A variable: the innermost binding, else a global function, else Undefined. */
TPL_NOINLINE static int eval_name(tpl_rt *R, const tpl_node *n, tpl_val *out) {
    tpl_val *v = scope_lookup(R, n->str, n->len);
    if (v) {
        *out = *v;
        tpl_ref(*out);
        return FU_OK;
    }
    int gid = tpl_global_id(n->str);
    if (gid > 0)
        return tpl_func_new(R, gid, tpl_undef(), NULL, out);
    return tpl_undef_hint(R, out, "'%s' is undefined", n->str);
}

/* a.name */
static int getattr_of(tpl_rt *R, const tpl_node *n, tpl_val a, tpl_val *out) {
    R->line = n->line;
    return tpl_getattr(R, a, n->str, n->len, out);
}

/* a[start:stop:step] for the ND_SLICE node n->b. */
static int slice_of(tpl_rt *R, const tpl_node *n, tpl_val a, tpl_val *out) {
    const tpl_node *s = n->b;
    tpl_val sv[3] = {tpl_none(), tpl_none(), tpl_none()};
    int rc = FU_OK;
    for (int i = 0; i < 3 && !rc; i++)
        if (s->kids.v[i])
            rc = eval(R, s->kids.v[i], &sv[i]);
    R->line = n->line;
    if (!rc) {
        bool taint = tpl_taint_begin(R, tpl_holds_data(a));
        rc = do_slice(R, a, sv, out);
        tpl_taint_end(R, taint);
    }
    for (int i = 0; i < 3; i++)
        tpl_drop(R, sv[i]);
    return rc;
}

/* a[b] */
static int getitem_of(tpl_rt *R, const tpl_node *n, tpl_val a, tpl_val b, tpl_val *out) {
    return tpl_getitem(R, a, b, out);
}

/* a is test(args...) */
static int test_of(tpl_rt *R, const tpl_node *n, tpl_val a, tpl_val *out) {
    eargs e;
    int rc = args_eval(R, n, &e);
    if (rc)
        return rc;
    bool res = false;
    R->line = n->line;
    rc = tpl_apply_test(R, n->id, n->str, a, &e.a, &res);
    args_free(R, &e);
    *out = tpl_bool(res);
    return rc;
}

/* not a */
static int not_of(tpl_rt *R, const tpl_node *n, tpl_val a, tpl_val *out) {
    *out = tpl_bool(!tpl_truthy(a));
    return FU_OK;
}

/* -a and +a on a number. */
static int sign_of(tpl_rt *R, const tpl_node *n, tpl_val a, tpl_val *out) {
    bool neg = n->type == ND_NEG;
    R->line = n->line;
    if (a.kind == TPL_UNDEF)
        return tpl_undef_fail(R, a);
    if (a.kind == TPL_FLOAT) {
        *out = tpl_float(neg ? -a.f : a.f);
        return FU_OK;
    }
    if (a.kind != TPL_INT && a.kind != TPL_BOOL)
        return tpl_type_error(R, "bad operand type for unary %c: '%s'", neg ? '-' : '+', tpl_type_name(a));
    if (neg && a.i == INT64_MIN)
        return tpl_type_error(R, "integer overflow");
    *out = tpl_int(neg ? -a.i : a.i);
    return FU_OK;
}

/* a op b for the arithmetic operators. */
static int binop_of(tpl_rt *R, const tpl_node *n, tpl_val a, tpl_val b, tpl_val *out) {
    return tpl_binop(R, n->op, a, b, out);
}

/* a op1 b op2 c ...: chained, each operand evaluated at most once, stopping at the first false. */
TPL_NOINLINE static int eval_compare(tpl_rt *R, const tpl_node *n, tpl_val *out) {
    tpl_val a, b;
    int rc = eval(R, n->a, &a);
    if (rc)
        return rc;
    bool res = true;
    for (size_t i = 0; i < n->body.n && res; i++) {
        if ((rc = eval(R, n->body.v[i], &b))) {
            tpl_drop(R, a);
            return rc;
        }
        R->line = n->line;
        rc = compare_op(R, n->ops[i], a, b, &res);
        tpl_drop(R, a);
        a = b;
        if (rc) {
            tpl_drop(R, a);
            return rc;
        }
    }
    tpl_drop(R, a);
    *out = tpl_bool(res);
    return FU_OK;
}

/* a and b, a or b: the deciding operand itself. */
TPL_NOINLINE static int eval_logic(tpl_rt *R, const tpl_node *n, tpl_val *out) {
    tpl_val a;
    int rc = eval(R, n->a, &a);
    if (rc)
        return rc;
    if (tpl_truthy(a) == (n->type == ND_OR)) {
        *out = a;
        return FU_OK;
    }
    tpl_drop(R, a);
    return eval(R, n->b, out);
}

/* a if b else c; without else, an Undefined when b is false. */
TPL_NOINLINE static int eval_cond(tpl_rt *R, const tpl_node *n, tpl_val *out) {
    bool yes;
    int rc = eval_truth(R, n->b, &yes);
    if (rc)
        return rc;
    if (yes)
        return eval(R, n->a, out);
    if (n->c)
        return eval(R, n->c, out);
    return tpl_undef_hint(R, out,
                          "the inline if-expression on line %d evaluated to false and no else section was defined.",
                          n->line);
}

/* Evaluates one `key: value` of a dict display into `dict`. */
static int dict_item(tpl_rt *R, const tpl_node *kn, const tpl_node *vn, tpl_val dict) {
    tpl_val k, v;
    int rc = eval(R, kn, &k);
    if (rc)
        return rc;
    if (!hashable(k)) {
        rc = tpl_type_error(R, "unhashable type: '%s'", tpl_type_name(k));
        tpl_drop(R, k);
        return rc;
    }
    if ((rc = eval(R, vn, &v))) {
        tpl_drop(R, k);
        return rc;
    }
    note_scan(R, dict);
    return tpl_dict_set(R, dict, k, v);
}

TPL_NOINLINE static int eval_dict(tpl_rt *R, const tpl_node *n, tpl_val *out) {
    int rc = tpl_dict_new(R, n->body.n, out);
    if (rc)
        return rc;
    for (size_t i = 0; i < n->body.n && !rc; i++)
        rc = dict_item(R, n->body.v[i], n->alt.v[i], *out);
    if (rc)
        tpl_drop_out(R, out);
    return rc;
}

static int eval_node(tpl_rt *R, const tpl_node *n, tpl_val *out) {
    int rc = step(R, 1);
    if (rc)
        return rc;
    R->line = n->line;
    switch (n->type) {
    case ND_CONST:
        *out = n->val;
        tpl_ref(*out);
        return FU_OK;
    case ND_NAME: return eval_name(R, n, out);
    case ND_GETATTR: return eval_unary(R, n, getattr_of, out);
    case ND_GETITEM:
        if (n->b->type == ND_SLICE)
            return eval_unary(R, n, slice_of, out);
        return eval_binary(R, n, getitem_of, out);
    case ND_CALL: return eval_call(R, n, out);
    case ND_FILTER: return eval_unary(R, n, filter_apply, out);
    case ND_TEST: return eval_unary(R, n, test_of, out);
    case ND_NOT: return eval_unary(R, n, not_of, out);
    case ND_NEG:
    case ND_POS: return eval_unary(R, n, sign_of, out);
    case ND_BINOP: return eval_binary(R, n, binop_of, out);
    case ND_COMPARE: return eval_compare(R, n, out);
    case ND_AND:
    case ND_OR: return eval_logic(R, n, out);
    case ND_COND: return eval_cond(R, n, out);
    case ND_LIST:
    case ND_TUPLE: return eval_seq(R, n, n->type == ND_TUPLE, out);
    case ND_DICT: return eval_dict(R, n, out);
    default: return tpl_rt_fail(R, FU_ERR_INTERNAL, "cannot evaluate node type %d", n->type);
    }
}

/* ------------------------------------------------------------------------ */
/* Statements                                                                */
/* ------------------------------------------------------------------------ */

/* Binds `names` to `v` (borrowed), unpacking when there are several. */
static int assign_names(tpl_rt *R, char *const *names, size_t nnames, tpl_val v) {
    if (nnames == 1) {
        tpl_ref(v);
        return scope_set(R, names[0], v);
    }
    if (v.kind == TPL_UNDEF)
        return tpl_undef_fail(R, v);
    tpl_val items;
    int rc = tpl_iter_list(R, v, &items);
    if (rc)
        return rc;
    tpl_list *l = tpl_as_list(items);
    if (l->len != nnames) {
        rc = l->len > nnames
                 ? tpl_type_error(R, "too many values to unpack (expected %zu)", nnames)
                 : tpl_type_error(R, "not enough values to unpack (expected %zu, got %zu)", nnames, l->len);
    }
    for (size_t i = 0; i < nnames && !rc; i++) {
        tpl_ref(l->v[i]);
        rc = scope_set(R, names[i], l->v[i]);
    }
    tpl_drop(R, items);
    return rc;
}

static bool reaches(tpl_val v, const tpl_obj *obj, int depth, uint64_t *visits) {
    if (depth > 200)
        return true;
    (*visits)++;
    switch (v.kind) {
    case TPL_LIST: {
        tpl_list *l = tpl_as_list(v);
        for (size_t i = 0; l->holds_mut && i < l->len; i++)
            if (reaches(l->v[i], obj, depth + 1, visits))
                return true;
        return false;
    }
    case TPL_DICT:
    case TPL_NS: {
        tpl_dict *d = tpl_as_dict(v);
        if (v.o == obj)
            return true;
        for (size_t i = 0; (d->holds_mut || v.kind == TPL_NS) && i < d->len; i++)
            if (reaches(d->v[i], obj, depth + 1, visits))
                return true;
        return false;
    }
    case TPL_FUNC:
        return v.o == obj || reaches(((tpl_func *)v.o)->self, obj, depth + 1, visits);
    case TPL_LOOP:
        return v.o == obj || reaches(((tpl_loop *)v.o)->items, obj, depth + 1, visits) ||
               reaches(((tpl_loop *)v.o)->last_changed, obj, depth + 1, visits);
    default:
        return false;
    }
}

int tpl_reaches(tpl_rt *R, tpl_val v, const tpl_obj *obj, bool *found) {
    uint64_t visits = 0;
    *found = reaches(v, obj, 0, &visits);
    return tpl_rt_charge(R, visits);
}

/* Assigns v (owned) to the target of an ND_SET / ND_SET_BLOCK node. */
static int assign_target(tpl_rt *R, const tpl_node *n, tpl_val v) {
    int rc;
    if (n->str) { /* ns.attr */
        tpl_val *ns = scope_lookup(R, n->names[0], strlen(n->names[0]));
        if (!ns || ns->kind != TPL_NS) {
            tpl_drop(R, v);
            return tpl_type_error(R, "cannot assign attribute on non-namespace object");
        }
        bool cyc;
        if ((rc = tpl_reaches(R, v, ns->o, &cyc)) || cyc) {
            tpl_drop(R, v);
            return rc ? rc : tpl_type_error(R, "cannot store a namespace inside itself");
        }
        note_scan(R, *ns);
        return tpl_dict_set_cstr(R, *ns, n->str, v);
    }
    rc = assign_names(R, n->names, n->nnames, v);
    tpl_drop(R, v);
    return rc;
}

/* Keeps the items of `items` (owned, replaced by a new list) for which the
 * for loop's `if` condition holds, each evaluated in a scope of its own. */
static int loop_filter(tpl_rt *R, const tpl_node *n, tpl_scope *outer, tpl_val *items) {
    tpl_val kept;
    int rc = tpl_list_new(R, 0, &kept);
    if (rc) {
        tpl_drop(R, *items);
        return rc;
    }
    tpl_list *l = tpl_as_list(*items);
    tpl_scope sc;
    for (size_t i = 0; i < l->len && !rc; i++) {
        if ((rc = scope_push(R, &sc, outer)))
            break;
        tpl_val c;
        rc = assign_names(R, n->names, n->nnames, l->v[i]);
        if (!rc && !(rc = eval(R, n->b, &c))) {
            if (tpl_truthy(c)) {
                tpl_ref(l->v[i]);
                rc = tpl_list_push(R, kept, l->v[i]);
            }
            tpl_drop(R, c);
        }
        scope_pop(R, &sc, outer);
    }
    tpl_drop(R, *items);
    *items = kept;
    if (rc)
        tpl_drop(R, kept);
    return rc;
}

/* Runs the loop body once per item with `loop` bound; honours break/continue. */
static int loop_run(tpl_rt *R, const tpl_node *n, tpl_scope *outer, tpl_val loopv) {
    tpl_loop *loop = (tpl_loop *)loopv.o;
    tpl_list *l = tpl_as_list(loop->items);
    tpl_scope sc;
    int rc = FU_OK;
    for (size_t i = 0; i < l->len && !rc; i++) {
        if ((rc = step(R, 1)))
            break;
        loop->index0 = i;
        if ((rc = scope_push(R, &sc, outer)))
            break;
        rc = assign_names(R, n->names, n->nnames, l->v[i]);
        if (!rc) {
            tpl_ref(loopv);
            rc = scope_set(R, "loop", loopv);
        }
        if (!rc)
            rc = exec_body(R, &n->body);
        scope_pop(R, &sc, outer);
        if (R->ctl == TPL_CTL_BREAK) {
            R->ctl = TPL_CTL_NONE;
            break;
        }
        R->ctl = TPL_CTL_NONE;
    }
    return rc;
}

/* {% for names in seq [if cond] %}body{% else %}alt{% endfor %} */
TPL_NOINLINE static int exec_for(tpl_rt *R, const tpl_node *n) {
    tpl_val seq, items;
    int rc = eval(R, n->a, &seq);
    if (rc)
        return rc;
    R->line = n->line;
    rc = tpl_iter_list(R, seq, &items);
    tpl_drop(R, seq);
    if (rc)
        return rc;
    tpl_scope *outer = R->scope;
    if (n->b && (rc = loop_filter(R, n, outer, &items))) /* filter first, without `loop` */
        return rc;
    if (tpl_as_list(items)->len == 0) {
        tpl_scope sc;
        tpl_drop(R, items);
        if ((rc = scope_push(R, &sc, outer)))
            return rc;
        rc = exec_body(R, &n->alt);
        scope_pop(R, &sc, outer);
        return rc;
    }
    tpl_val loopv;
    rc = tpl_loop_new(R, items, &loopv);
    tpl_drop(R, items); /* owned by the loop now */
    if (rc)
        return rc;
    rc = loop_run(R, n, outer, loopv);
    tpl_drop(R, loopv);
    return rc;
}

TPL_NOINLINE static int exec_output(tpl_rt *R, const tpl_node *n) {
    tpl_val v;
    int rc = eval(R, n->a, &v);
    if (rc)
        return rc;
    rc = emit_val(R, v);
    tpl_drop(R, v);
    return rc;
}

TPL_NOINLINE static int exec_if(tpl_rt *R, const tpl_node *n) {
    bool t;
    int rc = eval_truth(R, n->a, &t);
    return rc ? rc : exec_body(R, t ? &n->body : &n->alt);
}

TPL_NOINLINE static int exec_set(tpl_rt *R, const tpl_node *n) {
    tpl_val v;
    int rc = eval(R, n->a, &v);
    if (rc)
        return rc;
    R->line = n->line;
    return assign_target(R, n, v);
}

/* {% set x %}...{% endset %} and {% filter f %}...{% endfilter %}: the body's
 * output captured, passed through the filters, then assigned or emitted. */
TPL_NOINLINE static int exec_capture(tpl_rt *R, const tpl_node *n) {
    fu_buf buf = {0};
    fu_buf *saved = R->out;
    tpl_spans sp = {0}, *saved_spans = R->out_spans;
    tpl_val v;
    R->out = &buf;
    R->out_spans = &sp;
    int rc = exec_body(R, &n->body);
    R->out = saved;
    R->out_spans = saved_spans;
    if (rc || (rc = tpl_buf_to_str_sp(R, &buf, &sp, &v))) {
        fu_buf_free(&buf);
        tpl_spans_free(&sp);
        return rc;
    }
    if (n->kids.n) {
        tpl_val f;
        rc = apply_chain(R, n->kids.v[0], v, &f);
        tpl_drop(R, v);
        if (rc)
            return rc;
        v = f;
    }
    if (n->type == ND_SET_BLOCK)
        return assign_target(R, n, v);
    rc = emit_val(R, v);
    tpl_drop(R, v);
    return rc;
}

TPL_NOINLINE static int exec_macro(tpl_rt *R, const tpl_node *n) {
    tpl_val v;
    int rc = tpl_func_new(R, TPL_FN_MACRO, tpl_undef(), n, &v);
    if (rc)
        return rc;
    return scope_set(R, n->str, v);
}

/* {% with a = x, ... %}body{% endwith %}: the values are evaluated in the outer scope. */
TPL_NOINLINE static int exec_with(tpl_rt *R, const tpl_node *n) {
    tpl_scope *outer = R->scope;
    tpl_scope sc;
    tpl_val vals[16];
    size_t nv = n->kids.n;
    int rc;
    if (nv > 16)
        return tpl_type_error(R, "too many with-assignments");
    for (size_t i = 0; i < nv; i++) {
        if ((rc = eval(R, n->kids.v[i], &vals[i]))) {
            for (size_t j = 0; j < i; j++)
                tpl_drop(R, vals[j]);
            return rc;
        }
    }
    if ((rc = scope_push(R, &sc, outer))) {
        for (size_t j = 0; j < nv; j++)
            tpl_drop(R, vals[j]);
        return rc;
    }
    for (size_t i = 0; i < nv; i++) {
        if (!rc)
            rc = scope_set(R, n->names[i], vals[i]);
        else
            tpl_drop(R, vals[i]);
    }
    if (!rc)
        rc = exec_body(R, &n->body);
    scope_pop(R, &sc, outer);
    return rc;
}

static int exec_stmt(tpl_rt *R, const tpl_node *n) {
    int rc = step(R, 1);
    if (rc)
        return rc;
    R->line = n->line;
    switch (n->type) {
    case ND_DATA: return emit(R, n->str, n->len);
    case ND_OUTPUT: return exec_output(R, n);
    case ND_IF: return exec_if(R, n);
    case ND_FOR: return exec_for(R, n);
    case ND_SET: return exec_set(R, n);
    case ND_SET_BLOCK:
    case ND_FILTER_BLOCK: return exec_capture(R, n);
    case ND_MACRO: return exec_macro(R, n);
    case ND_BREAK:
        R->ctl = TPL_CTL_BREAK;
        return FU_OK;
    case ND_CONTINUE:
        R->ctl = TPL_CTL_CONTINUE;
        return FU_OK;
    case ND_WITH: return exec_with(R, n);
    case ND_BODY: return exec_body(R, &n->body);
    default: return tpl_rt_fail(R, FU_ERR_INTERNAL, "cannot execute node type %d", n->type);
    }
}

static int exec_body(tpl_rt *R, const tpl_nodevec *body) {
    int rc = frame_enter(R, TPL_FRAMES_BODY);
    if (rc)
        return rc;
    for (size_t i = 0; i < body->n && !rc; i++) {
        rc = exec_stmt(R, body->v[i]);
        if (R->ctl != TPL_CTL_NONE)
            break;
    }
    R->frames -= TPL_FRAMES_BODY;
    return rc;
}

int tpl_exec_template(tpl_rt *R, const tpl_node *root) { return exec_body(R, &root->body); }

