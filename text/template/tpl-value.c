/* tpl-value.c -- template values: allocation and accounting, Python str/repr/==/<, JSON in and out. */
#include "tpl-impl.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <utf8proc.h>

#define TPL_MAX_NEST 100 /* nesting depth for repr/json/compare (C stack: ~85 KiB under ASan) */

/* ------------------------------------------------------------------------ */
/* Errors and accounting                                                     */
/* ------------------------------------------------------------------------ */

int tpl_rt_fail(tpl_rt *R, int status, const char *fmt, ...) {
    if (R && R->failed)
        return status;
    char msg[900];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    if (!R) /* compile time */
        return fu_errorf(status, "%s", msg);
    R->failed = true;
    return fu_errorf(status, "line %d: %s", R->line, msg);
}

int tpl_rt_charge(tpl_rt *R, uint64_t units) {
    if (!R)
        return FU_OK;
    if (units > R->fuel) {
        R->fuel = 0;
        return tpl_rt_fail(R, FU_ERR_EXHAUSTED, "template exceeded its work limit (%llu units)",
                           (unsigned long long)R->lim.max_work);
    }
    R->fuel -= units;
    return FU_OK;
}

/* Accounts `bytes` more to R (R == NULL: compile time, unbounded). */
static int account(tpl_rt *R, size_t bytes) {
    if (!R)
        return FU_OK;
    if (bytes > R->lim.max_memory || R->live_bytes > R->lim.max_memory - bytes)
        return tpl_rt_fail(R, FU_ERR_EXHAUSTED, "template exceeded its memory limit (%zu bytes)",
                           R->lim.max_memory);
    int rc = tpl_rt_charge(R, bytes / 32);
    if (rc)
        return rc;
    R->live_bytes += bytes;
    return FU_OK;
}

static void unaccount(tpl_rt *R, size_t bytes) {
    if (R)
        R->live_bytes -= bytes < R->live_bytes ? bytes : R->live_bytes;
}

static int oom(tpl_rt *R) {
    if (R)
        return tpl_rt_fail(R, FU_ERR_NOMEM, "out of memory");
    return fu_errorf(FU_ERR_NOMEM, "out of memory");
}

/* Allocates a zeroed object of `size` bytes: rc 1, or immortal when R is NULL. */
static void *obj_alloc(tpl_rt *R, size_t size, int kind, int *rc) {
    *rc = account(R, size);
    if (*rc)
        return NULL;
    tpl_obj *o = calloc(1, size);
    if (!o) {
        unaccount(R, size);
        *rc = oom(R);
        return NULL;
    }
    o->rc = R ? 1 : -1;
    o->kind = (uint32_t)kind;
    o->bytes = size;
    return o;
}

void tpl_ref(tpl_val v) {
    if (tpl_is_heap(v) && v.o->rc > 0)
        v.o->rc++;
}

/* Children of an object whose count reached zero are released through an
 * explicit work list, so freeing deeply nested values cannot overflow the
 * stack. */
static void release_child(tpl_val v, tpl_obj ***stack, size_t *n, size_t *cap) {
    if (!tpl_is_heap(v) || v.o->rc < 0)
        return;
    if (--v.o->rc > 0)
        return;
    if (*n == *cap) {
        size_t nc = *cap ? *cap * 2 : 16;
        tpl_obj **ns = realloc(*stack, nc * sizeof *ns);
        if (!ns) {
            /* Cannot grow the work list: leak rather than recurse unboundedly. */
            return;
        }
        *stack = ns;
        *cap = nc;
    }
    (*stack)[(*n)++] = v.o;
}

void tpl_drop(tpl_rt *R, tpl_val v) {
    if (!tpl_is_heap(v) || v.o->rc < 0)
        return;
    if (--v.o->rc > 0)
        return;
    tpl_obj *first = v.o;
    tpl_obj **stack = NULL;
    size_t n = 0, cap = 0;
    tpl_obj *o = first;
    for (;;) {
        switch (o->kind) {
        case TPL_LIST: {
            tpl_list *l = (tpl_list *)o;
            for (size_t i = 0; i < l->len; i++)
                release_child(l->v[i], &stack, &n, &cap);
            free(l->v);
            break;
        }
        case TPL_DICT:
        case TPL_NS: {
            tpl_dict *d = (tpl_dict *)o;
            for (size_t i = 0; i < d->len; i++) {
                release_child(d->k[i], &stack, &n, &cap);
                release_child(d->v[i], &stack, &n, &cap);
            }
            free(d->k);
            free(d->v);
            free(d->slots);
            break;
        }
        case TPL_FUNC:
            release_child(((tpl_func *)o)->self, &stack, &n, &cap);
            break;
        case TPL_LOOP:
            release_child(((tpl_loop *)o)->items, &stack, &n, &cap);
            release_child(((tpl_loop *)o)->last_changed, &stack, &n, &cap);
            break;
        case TPL_STR:
            free(((tpl_str *)o)->spans);
            break;
        default:
            break;
        }
        unaccount(R, o->bytes);
        free(o);
        if (n == 0)
            break;
        o = stack[--n];
    }
    free(stack);
}

void tpl_free_immortal(tpl_val v) {
    if (!tpl_is_heap(v) || v.o->rc >= 0)
        return;
    /* Compile-time values are strings only. */
    free(v.o);
}

/* ------------------------------------------------------------------------ */
/* Constructors                                                              */
/* ------------------------------------------------------------------------ */

/* Moves sp's ranges into the new string s (sp is emptied); the whole
 * string's range when new strings are all data. */
static int attach_spans(tpl_rt *R, tpl_str *s, tpl_spans *sp) {
    if (!sp->n || s->spans) {
        tpl_spans_free(sp);
        return FU_OK;
    }
    size_t bytes = sp->n * sizeof(tpl_span);
    int rc = account(R, bytes);
    if (rc) {
        tpl_spans_free(sp);
        return rc;
    }
    s->h.bytes += bytes;
    s->spans = sp->v;
    s->nspans = sp->n;
    *sp = (tpl_spans){0};
    return FU_OK;
}

int tpl_spans_add(tpl_rt *R, tpl_spans *sp, size_t start, size_t end) {
    if (start >= end)
        return FU_OK;
    if (sp->n && sp->v[sp->n - 1].end >= start) {
        if (end > sp->v[sp->n - 1].end)
            sp->v[sp->n - 1].end = end;
        return FU_OK;
    }
    int rc = tpl_rt_charge(R, 1);
    if (rc)
        return rc;
    if (sp->n == sp->cap) {
        size_t nc = sp->cap ? sp->cap * 2 : 4;
        tpl_span *v = realloc(sp->v, nc * sizeof *v);
        if (!v)
            return oom(R);
        sp->v = v;
        sp->cap = nc;
    }
    sp->v[sp->n++] = (tpl_span){start, end};
    return FU_OK;
}

int tpl_spans_note(tpl_rt *R, tpl_spans *sp, size_t before, size_t end, tpl_val v) {
    int rc = FU_OK;
    if (v.kind == TPL_STR) {
        tpl_str *s = tpl_as_str(v);
        for (size_t i = 0; i < s->nspans && !rc; i++)
            rc = tpl_spans_add(R, sp, before + s->spans[i].start, before + s->spans[i].end);
        return rc;
    }
    return tpl_holds_data(v) ? tpl_spans_add(R, sp, before, end) : FU_OK;
}

void tpl_spans_free(tpl_spans *sp) {
    free(sp->v);
    *sp = (tpl_spans){0};
}

bool tpl_holds_data(tpl_val v) {
    switch (v.kind) {
    case TPL_STR: return tpl_as_str(v)->nspans > 0;
    case TPL_LIST: return tpl_as_list(v)->holds_data;
    case TPL_DICT:
    case TPL_NS: return tpl_as_dict(v)->holds_data;
    case TPL_FUNC: return tpl_holds_data(((tpl_func *)v.o)->self);
    case TPL_LOOP: return tpl_holds_data(((tpl_loop *)v.o)->items);
    default: return false;
    }
}

int tpl_str_cat(tpl_rt *R, const char *a, size_t alen, const char *b, size_t blen, tpl_val *out) {
    if (alen > SIZE_MAX / 2 || blen > SIZE_MAX / 2)
        return oom(R);
    int rc;
    tpl_str *s = obj_alloc(R, sizeof(tpl_str) + alen + blen + 1, TPL_STR, &rc);
    if (!s)
        return rc;
    if (alen)
        memcpy(s->s, a, alen);
    if (blen)
        memcpy(s->s + alen, b, blen);
    s->len = alen + blen;
    s->s[s->len] = '\0';
    out->kind = TPL_STR;
    out->o = &s->h;
    if (R && R->taint > 0 && s->len) {
        tpl_spans all = {0};
        if ((rc = tpl_spans_add(R, &all, 0, s->len)) || (rc = attach_spans(R, s, &all))) {
            tpl_drop_out(R, out);
            return rc;
        }
    }
    return FU_OK;
}

int tpl_str_new(tpl_rt *R, const char *s, size_t len, tpl_val *out) {
    return tpl_str_cat(R, s, len, NULL, 0, out);
}

int tpl_str_sub(tpl_rt *R, tpl_val s, size_t lo, size_t hi, tpl_val *out) {
    tpl_str *x = tpl_as_str(s);
    int rc = tpl_str_new(R, x->s + lo, hi - lo, out);
    if (rc || !x->nspans)
        return rc;
    tpl_spans sp = {0};
    for (size_t i = 0; i < x->nspans && !rc; i++) {
        size_t a = x->spans[i].start > lo ? x->spans[i].start : lo;
        size_t b = x->spans[i].end < hi ? x->spans[i].end : hi;
        if (a < b)
            rc = tpl_spans_add(R, &sp, a - lo, b - lo);
    }
    if (rc || (rc = attach_spans(R, tpl_as_str(*out), &sp))) {
        tpl_spans_free(&sp);
        tpl_drop_out(R, out);
    }
    return rc;
}

int tpl_list_new(tpl_rt *R, size_t cap, tpl_val *out) {
    int rc;
    tpl_list *l = obj_alloc(R, sizeof(tpl_list), TPL_LIST, &rc);
    if (!l)
        return rc;
    out->kind = TPL_LIST;
    out->o = &l->h;
    if (cap) {
        rc = account(R, cap * sizeof(tpl_val));
        if (!rc && !(l->v = malloc(cap * sizeof(tpl_val)))) {
            unaccount(R, cap * sizeof(tpl_val));
            rc = oom(R);
        }
        if (rc) {
            tpl_drop_out(R, out);
            return rc;
        }
        l->cap = cap;
        l->h.bytes += cap * sizeof(tpl_val);
    }
    return FU_OK;
}

/* Grows an array of tpl_val held by object `h` to at least `need` entries. */
static int grow(tpl_rt *R, tpl_obj *h, tpl_val **arr, size_t *cap, size_t need, int narr,
                tpl_val **arr2) {
    if (need <= *cap)
        return FU_OK;
    size_t nc = *cap ? *cap * 2 : 4;
    while (nc < need)
        nc *= 2;
    size_t extra = (nc - *cap) * sizeof(tpl_val) * (size_t)narr;
    int rc = account(R, extra);
    if (rc)
        return rc;
    tpl_val *a = realloc(*arr, nc * sizeof(tpl_val));
    if (!a) {
        unaccount(R, extra);
        return oom(R);
    }
    *arr = a;
    if (arr2) {
        tpl_val *b = realloc(*arr2, nc * sizeof(tpl_val));
        if (!b) {
            unaccount(R, extra);
            return oom(R);
        }
        *arr2 = b;
    }
    *cap = nc;
    h->bytes += extra;
    return FU_OK;
}

/* True if v is a mutable object or a container holding one. */
static bool mutable_ref(tpl_val v) {
    switch (v.kind) {
    case TPL_NS:
    case TPL_LOOP:
    case TPL_FUNC:
        return true;
    case TPL_LIST:
        return tpl_as_list(v)->holds_mut;
    case TPL_DICT:
        return tpl_as_dict(v)->holds_mut;
    default:
        return false;
    }
}

int tpl_list_push(tpl_rt *R, tpl_val list, tpl_val v) {
    tpl_list *l = tpl_as_list(list);
    l->holds_mut |= mutable_ref(v);
    l->holds_data |= tpl_holds_data(v);
    int rc = grow(R, &l->h, &l->v, &l->cap, l->len + 1, 1, NULL);
    if (rc) {
        tpl_drop(R, v);
        return rc;
    }
    l->v[l->len++] = v;
    return FU_OK;
}

int tpl_dict_new(tpl_rt *R, size_t cap, tpl_val *out) {
    int rc;
    tpl_dict *d = obj_alloc(R, sizeof(tpl_dict), TPL_DICT, &rc);
    if (!d)
        return rc;
    out->kind = TPL_DICT;
    out->o = &d->h;
    if (cap && (rc = grow(R, &d->h, &d->k, &d->cap, cap, 2, &d->v))) {
        tpl_drop_out(R, out);
        return rc;
    }
    return FU_OK;
}

static bool key_equal(tpl_val a, tpl_val b) {
    if (a.kind == TPL_STR && b.kind == TPL_STR) {
        tpl_str *x = tpl_as_str(a), *y = tpl_as_str(b);
        return x->len == y->len && memcmp(x->s, y->s, x->len) == 0;
    }
    return tpl_equal(a, b);
}

static double num_f(tpl_val v);

static uint64_t hash_bytes(const void *p, size_t n) {
    const unsigned char *b = p;
    uint64_t h = 0xcbf29ce484222325ull; /* FNV-1a */
    for (size_t i = 0; i < n; i++)
        h = (h ^ b[i]) * 0x100000001b3ull;
    return h ^ (h >> 29);
}

/* A key's hash: equal keys (1 == 1.0 == true, as tpl_equal) hash alike. */
static uint64_t key_hash(tpl_val k) {
    if (k.kind == TPL_STR)
        return hash_bytes(tpl_as_str(k)->s, tpl_as_str(k)->len);
    if (tpl_is_num(k)) {
        double x = num_f(k);
        if (x == 0)
            x = 0; /* -0.0 == 0.0 */
        return hash_bytes(&x, sizeof x);
    }
    return (uint64_t)k.kind * 0x9e3779b97f4a7c15ull;
}

/* Rebuilds the index with room for twice the keys (the dict has at least TPL_DICT_INDEX_MIN). */
static int dict_reindex(tpl_rt *R, tpl_dict *d) {
    size_t n = 64;
    while (n < 4 * d->len)
        n *= 2;
    size_t bytes = n * sizeof *d->slots, old = d->n_slots * sizeof *d->slots;
    int rc = account(R, bytes);
    if (rc)
        return rc;
    uint32_t *s = calloc(n, sizeof *s);
    if (!s) {
        unaccount(R, bytes);
        return oom(R);
    }
    for (size_t i = 0; i < d->len; i++) {
        size_t j = (size_t)key_hash(d->k[i]) & (n - 1);
        while (s[j])
            j = (j + 1) & (n - 1);
        s[j] = (uint32_t)(i + 1);
    }
    free(d->slots);
    unaccount(R, old);
    d->h.bytes += bytes - old;
    d->slots = s;
    d->n_slots = n;
    return FU_OK;
}

/* The entry index of a key equal to `key` by the index (d->slots set), or -1. */
static ptrdiff_t dict_find_indexed(const tpl_dict *d, tpl_val key) {
    for (size_t j = (size_t)key_hash(key) & (d->n_slots - 1); d->slots[j]; j = (j + 1) & (d->n_slots - 1))
        if (key_equal(d->k[d->slots[j] - 1], key))
            return (ptrdiff_t)d->slots[j] - 1;
    return -1;
}

tpl_val *tpl_dict_get(tpl_val dict, tpl_val key) {
    tpl_dict *d = tpl_as_dict(dict);
    if (d->slots) {
        ptrdiff_t i = dict_find_indexed(d, key);
        return i < 0 ? NULL : &d->v[i];
    }
    for (size_t i = 0; i < d->len; i++)
        if (key_equal(d->k[i], key))
            return &d->v[i];
    return NULL;
}

tpl_val *tpl_dict_get_cstr(tpl_val dict, const char *key, size_t len) {
    tpl_dict *d = tpl_as_dict(dict);
    for (size_t j = (size_t)hash_bytes(key, len) & (d->n_slots - 1); d->slots && d->slots[j];
         j = (j + 1) & (d->n_slots - 1)) {
        tpl_val k = d->k[d->slots[j] - 1];
        if (k.kind == TPL_STR && tpl_as_str(k)->len == len && memcmp(tpl_as_str(k)->s, key, len) == 0)
            return &d->v[d->slots[j] - 1];
    }
    if (d->slots)
        return NULL;
    for (size_t i = 0; i < d->len; i++) {
        if (d->k[i].kind != TPL_STR)
            continue;
        tpl_str *s = tpl_as_str(d->k[i]);
        if (s->len == len && memcmp(s->s, key, len) == 0)
            return &d->v[i];
    }
    return NULL;
}

int tpl_dict_set(tpl_rt *R, tpl_val dict, tpl_val key, tpl_val v) {
    tpl_dict *d = tpl_as_dict(dict);
    d->holds_mut |= mutable_ref(v);
    d->holds_data |= tpl_holds_data(key) || tpl_holds_data(v);
    tpl_val *slot = tpl_dict_get(dict, key);
    if (slot) {
        tpl_drop(R, key);
        tpl_val old = *slot;
        *slot = v;
        tpl_drop(R, old);
        return FU_OK;
    }
    int rc = grow(R, &d->h, &d->k, &d->cap, d->len + 1, 2, &d->v);
    if (rc) {
        tpl_drop(R, key);
        tpl_drop(R, v);
        return rc;
    }
    d->k[d->len] = key;
    d->v[d->len] = v;
    d->len++;
    if (d->len < TPL_DICT_INDEX_MIN)
        return FU_OK;
    if (!d->slots || 2 * d->len >= d->n_slots) {
        rc = dict_reindex(R, d);
        if (rc) { /* the dict stays whole, scanned instead */
            free(d->slots);
            unaccount(R, d->n_slots * sizeof *d->slots);
            d->h.bytes -= d->n_slots * sizeof *d->slots;
            d->slots = NULL;
            d->n_slots = 0;
        }
        return rc;
    }
    size_t j = (size_t)key_hash(key) & (d->n_slots - 1);
    while (d->slots[j])
        j = (j + 1) & (d->n_slots - 1);
    d->slots[j] = (uint32_t)d->len;
    return FU_OK;
}

int tpl_dict_set_cstr(tpl_rt *R, tpl_val dict, const char *key, tpl_val v) {
    tpl_val k;
    int rc = tpl_str_new(R, key, strlen(key), &k);
    if (rc) {
        tpl_drop(R, v);
        return rc;
    }
    return tpl_dict_set(R, dict, k, v);
}

int tpl_loop_new(tpl_rt *R, tpl_val items, tpl_val *out) {
    int rc;
    tpl_loop *l = obj_alloc(R, sizeof(tpl_loop), TPL_LOOP, &rc);
    if (!l)
        return rc;
    l->items = items;
    tpl_ref(items);
    l->last_changed = tpl_undef();
    out->kind = TPL_LOOP;
    out->o = &l->h;
    return FU_OK;
}

int tpl_func_new(tpl_rt *R, int id, tpl_val self, const struct tpl_node *mac, tpl_val *out) {
    int rc;
    tpl_func *f = obj_alloc(R, sizeof(tpl_func), TPL_FUNC, &rc);
    if (!f)
        return rc;
    f->id = id;
    f->self = self;
    tpl_ref(self);
    f->mac = mac;
    out->kind = TPL_FUNC;
    out->o = &f->h;
    return FU_OK;
}

int tpl_undef_hint(tpl_rt *R, tpl_val *out, const char *fmt, ...) {
    char msg[512];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    if (n < 0)
        n = 0;
    if ((size_t)n >= sizeof msg)
        n = sizeof msg - 1;
    int rc = tpl_str_new(R, msg, (size_t)n, out);
    if (rc)
        return rc;
    out->kind = TPL_UNDEF;
    return FU_OK;
}

const char *tpl_undef_msg(tpl_val v) {
    if (v.kind == TPL_UNDEF && v.o)
        return tpl_as_str(v)->s;
    return "value is undefined";
}

int tpl_undef_fail(tpl_rt *R, tpl_val v) { return tpl_type_error(R, "%s", tpl_undef_msg(v)); }

/* ------------------------------------------------------------------------ */
/* JSON input                                                                */
/* ------------------------------------------------------------------------ */

/* tpl_from_json at nesting `depth`, bounded like the other walks of values. */
static int from_json(tpl_rt *R, const json_t *j, tpl_val *out, int depth) {
    int rc;
    if (depth > TPL_MAX_NEST)
        return tpl_rt_fail(R, FU_ERR_INVALID, "template variables nested too deeply (limit %d)", TPL_MAX_NEST);
    switch (json_typeof(j)) {
    case JSON_OBJECT: {
        if ((rc = tpl_dict_new(R, json_object_size(j), out)))
            return rc;
        const char *key;
        json_t *val;
        json_object_foreach((json_t *)j, key, val) {
            tpl_val v;
            if ((rc = from_json(R, val, &v, depth + 1)) || (rc = tpl_dict_set_cstr(R, *out, key, v))) {
                tpl_drop_out(R, out);
                return rc;
            }
        }
        return FU_OK;
    }
    case JSON_ARRAY: {
        if ((rc = tpl_list_new(R, json_array_size(j), out)))
            return rc;
        size_t i;
        json_t *val;
        json_array_foreach(j, i, val) {
            tpl_val v;
            if ((rc = from_json(R, val, &v, depth + 1)) || (rc = tpl_list_push(R, *out, v))) {
                tpl_drop_out(R, out);
                return rc;
            }
        }
        return FU_OK;
    }
    case JSON_STRING:
        return tpl_str_new(R, json_string_value(j), json_string_length(j), out);
    case JSON_INTEGER:
        *out = tpl_int(json_integer_value(j));
        return FU_OK;
    case JSON_REAL:
        *out = tpl_float(json_real_value(j));
        return FU_OK;
    case JSON_TRUE:
        *out = tpl_bool(true);
        return FU_OK;
    case JSON_FALSE:
        *out = tpl_bool(false);
        return FU_OK;
    case JSON_NULL:
    default:
        *out = tpl_none();
        return FU_OK;
    }
}

int tpl_from_json(tpl_rt *R, const json_t *j, tpl_val *out) { return from_json(R, j, out, 0); }

/* ------------------------------------------------------------------------ */
/* Python semantics                                                          */
/* ------------------------------------------------------------------------ */

bool tpl_truthy(tpl_val v) {
    switch (v.kind) {
    case TPL_UNDEF:
    case TPL_NONE:
        return false;
    case TPL_BOOL:
    case TPL_INT:
        return v.i != 0;
    case TPL_FLOAT:
        return v.f != 0.0;
    case TPL_STR:
        return tpl_as_str(v)->len > 0;
    case TPL_LIST:
        return tpl_as_list(v)->len > 0;
    case TPL_DICT:
        return tpl_as_dict(v)->len > 0;
    default:
        return true;
    }
}

const char *tpl_type_name(tpl_val v) {
    switch (v.kind) {
    case TPL_UNDEF: return "Undefined";
    case TPL_NONE: return "NoneType";
    case TPL_BOOL: return "bool";
    case TPL_INT: return "int";
    case TPL_FLOAT: return "float";
    case TPL_STR: return "str";
    case TPL_LIST: return tpl_as_list(v)->tuple ? "tuple" : (tpl_as_list(v)->gen ? "generator" : "list");
    case TPL_DICT: return "dict";
    case TPL_NS: return "Namespace";
    case TPL_FUNC: return ((tpl_func *)v.o)->id == TPL_FN_MACRO ? "Macro" : "builtin_function_or_method";
    case TPL_LOOP: return "LoopContext";
    }
    return "object";
}

static double num_f(tpl_val v) { return v.kind == TPL_FLOAT ? v.f : (double)v.i; }

static bool equal_depth(tpl_val a, tpl_val b, int depth) {
    if (depth > TPL_MAX_NEST)
        return false;
    if (tpl_is_num(a) && tpl_is_num(b)) {
        if (a.kind != TPL_FLOAT && b.kind != TPL_FLOAT)
            return a.i == b.i;
        return num_f(a) == num_f(b);
    }
    if (a.kind != b.kind)
        return false;
    switch (a.kind) {
    case TPL_UNDEF:
    case TPL_NONE:
        return true;
    case TPL_STR: {
        tpl_str *x = tpl_as_str(a), *y = tpl_as_str(b);
        return x->len == y->len && memcmp(x->s, y->s, x->len) == 0;
    }
    case TPL_LIST: {
        tpl_list *x = tpl_as_list(a), *y = tpl_as_list(b);
        if (x->tuple != y->tuple || x->len != y->len)
            return false;
        for (size_t i = 0; i < x->len; i++)
            if (!equal_depth(x->v[i], y->v[i], depth + 1))
                return false;
        return true;
    }
    case TPL_DICT: {
        tpl_dict *x = tpl_as_dict(a), *y = tpl_as_dict(b);
        if (x->len != y->len)
            return false;
        for (size_t i = 0; i < x->len; i++) {
            tpl_val *w = tpl_dict_get(b, x->k[i]);
            if (!w || !equal_depth(x->v[i], *w, depth + 1))
                return false;
        }
        return true;
    }
    default:
        return a.o == b.o;
    }
}

bool tpl_equal(tpl_val a, tpl_val b) { return equal_depth(a, b, 0); }

static int compare_depth(tpl_rt *R, tpl_val a, tpl_val b, const char *op, int *cmp, int depth) {
    if (depth > TPL_MAX_NEST)
        return tpl_type_error(R, "values nested too deeply to compare");
    if (a.kind == TPL_UNDEF)
        return tpl_undef_fail(R, a);
    if (b.kind == TPL_UNDEF)
        return tpl_undef_fail(R, b);
    if (tpl_is_num(a) && tpl_is_num(b)) {
        if (a.kind != TPL_FLOAT && b.kind != TPL_FLOAT)
            *cmp = (a.i > b.i) - (a.i < b.i);
        else {
            double x = num_f(a), y = num_f(b);
            *cmp = (x > y) - (x < y); /* NaN compares as equal-ish: all ops false but == */
            if (isnan(x) || isnan(y))
                *cmp = 2; /* unordered */
        }
        return FU_OK;
    }
    if (a.kind == TPL_STR && b.kind == TPL_STR) {
        tpl_str *x = tpl_as_str(a), *y = tpl_as_str(b);
        size_t n = x->len < y->len ? x->len : y->len;
        int c = memcmp(x->s, y->s, n);
        *cmp = c ? (c > 0 ? 1 : -1) : (x->len > y->len) - (x->len < y->len);
        return FU_OK;
    }
    if (a.kind == TPL_LIST && b.kind == TPL_LIST && tpl_as_list(a)->tuple == tpl_as_list(b)->tuple) {
        tpl_list *x = tpl_as_list(a), *y = tpl_as_list(b);
        for (size_t i = 0; i < x->len && i < y->len; i++) {
            if (equal_depth(x->v[i], y->v[i], depth + 1))
                continue;
            return compare_depth(R, x->v[i], y->v[i], op, cmp, depth + 1);
        }
        *cmp = (x->len > y->len) - (x->len < y->len);
        return FU_OK;
    }
    return tpl_type_error(R, "'%s' not supported between instances of '%s' and '%s'", op,
                          tpl_type_name(a), tpl_type_name(b));
}

int tpl_compare(tpl_rt *R, tpl_val a, tpl_val b, const char *op, int *cmp) {
    return compare_depth(R, a, b, op, cmp, 0);
}

int tpl_iter_list(tpl_rt *R, tpl_val v, tpl_val *out) {
    int rc;
    switch (v.kind) {
    case TPL_UNDEF:
        return tpl_list_new(R, 0, out);
    case TPL_LIST:
        tpl_ref(v);
        *out = v;
        return FU_OK;
    case TPL_DICT: {
        tpl_dict *d = tpl_as_dict(v);
        if ((rc = tpl_list_new(R, d->len, out)))
            return rc;
        for (size_t i = 0; i < d->len; i++) {
            tpl_ref(d->k[i]);
            if ((rc = tpl_list_push(R, *out, d->k[i]))) {
                tpl_drop_out(R, out);
                return rc;
            }
        }
        return FU_OK;
    }
    case TPL_STR: {
        tpl_str *s = tpl_as_str(v);
        if ((rc = tpl_list_new(R, 0, out)))
            return rc;
        bool taint = tpl_taint_begin(R, s->nspans > 0);
        for (size_t i = 0; i < s->len && !rc;) {
            size_t adv;
            tpl_utf8_get(s->s + i, s->len - i, &adv);
            tpl_val c;
            if (!(rc = tpl_str_new(R, s->s + i, adv, &c)))
                rc = tpl_list_push(R, *out, c);
            i += adv;
        }
        tpl_taint_end(R, taint);
        if (rc)
            tpl_drop_out(R, out);
        return rc;
    }
    default:
        return tpl_type_error(R, "'%s' object is not iterable", tpl_type_name(v));
    }
}

/* ------------------------------------------------------------------------ */
/* UTF-8                                                                     */
/* ------------------------------------------------------------------------ */

int32_t tpl_utf8_get(const char *s, size_t n, size_t *adv) {
    utf8proc_int32_t cp;
    utf8proc_ssize_t k = utf8proc_iterate((const utf8proc_uint8_t *)s, (utf8proc_ssize_t)n, &cp);
    if (k <= 0) {
        *adv = 1;
        return (unsigned char)s[0];
    }
    *adv = (size_t)k;
    return cp;
}

size_t tpl_utf8_put(int32_t cp, char *out) {
    utf8proc_ssize_t k = utf8proc_encode_char(cp, (utf8proc_uint8_t *)out);
    return k > 0 ? (size_t)k : 0;
}

size_t tpl_utf8_len(const char *s, size_t n) {
    size_t c = 0;
    for (size_t i = 0; i < n; i++)
        if (((unsigned char)s[i] & 0xC0) != 0x80)
            c++;
    return c;
}

size_t tpl_utf8_offset(const char *s, size_t n, size_t idx) {
    size_t c = 0;
    for (size_t i = 0; i < n; i++) {
        if (((unsigned char)s[i] & 0xC0) != 0x80) {
            if (c == idx)
                return i;
            c++;
        }
    }
    return n;
}

/* ------------------------------------------------------------------------ */
/* Buffers, str() and repr()                                                 */
/* ------------------------------------------------------------------------ */

int tpl_buf_put(tpl_rt *R, fu_buf *b, const char *s, size_t n) {
    if (n == 0)
        return FU_OK;
    size_t limit = R ? R->lim.max_memory : SIZE_MAX / 2;
    if (n > limit || b->len > limit - n)
        return tpl_rt_fail(R, FU_ERR_EXHAUSTED, "template exceeded its memory limit (%zu bytes)",
                           limit);
    int rc = tpl_rt_charge(R, n / 32);
    if (rc)
        return rc;
    if (fu_buf_append(b, s, n))
        return oom(R);
    return FU_OK;
}

static int buf_cstr(tpl_rt *R, fu_buf *b, const char *s) { return tpl_buf_put(R, b, s, strlen(s)); }

int tpl_buf_to_str(tpl_rt *R, fu_buf *b, tpl_val *out) {
    int rc = tpl_str_new(R, b->data ? b->data : "", b->len, out);
    fu_buf_free(b);
    return rc;
}

int tpl_buf_to_str_sp(tpl_rt *R, fu_buf *b, tpl_spans *sp, tpl_val *out) {
    int rc = tpl_buf_to_str(R, b, out);
    if (rc) {
        tpl_spans_free(sp);
        return rc;
    }
    if ((rc = attach_spans(R, tpl_as_str(*out), sp)))
        tpl_drop_out(R, out);
    return rc;
}

int tpl_buf_str_sp(tpl_rt *R, fu_buf *b, tpl_spans *sp, tpl_val v) {
    size_t before = b->len;
    int rc = tpl_buf_str(R, b, v);
    return rc ? rc : tpl_spans_note(R, sp, before, b->len, v);
}

void tpl_float_repr(double f, char *buf, size_t n) {
    if (isnan(f)) {
        snprintf(buf, n, "nan");
        return;
    }
    if (isinf(f)) {
        snprintf(buf, n, f < 0 ? "-inf" : "inf");
        return;
    }
    if (f == 0.0) {
        snprintf(buf, n, signbit(f) ? "-0.0" : "0.0");
        return;
    }
    char tmp[64];
    for (int p = 1; p <= 17; p++) {
        snprintf(tmp, sizeof tmp, "%.*e", p - 1, f);
        if (strtod(tmp, NULL) == f)
            break;
    }
    /* tmp is [-]d[.ddd]e[+-]XX: collect the digits and the exponent. */
    char digits[32];
    int nd = 0, exp10 = 0;
    bool neg = false;
    const char *p = tmp;
    if (*p == '-') {
        neg = true;
        p++;
    }
    for (; *p && *p != 'e'; p++)
        if (*p >= '0' && *p <= '9' && nd < 30)
            digits[nd++] = *p;
    if (*p == 'e')
        exp10 = (int)strtol(p + 1, NULL, 10);
    while (nd > 1 && digits[nd - 1] == '0')
        nd--;
    digits[nd] = '\0';
    char out[96];
    size_t o = 0;
    if (neg)
        out[o++] = '-';
    if (exp10 >= -4 && exp10 < 16) {
        if (exp10 < 0) {
            out[o++] = '0';
            out[o++] = '.';
            for (int i = 0; i < -exp10 - 1; i++)
                out[o++] = '0';
            for (int i = 0; i < nd; i++)
                out[o++] = digits[i];
        } else {
            for (int i = 0; i <= exp10; i++)
                out[o++] = i < nd ? digits[i] : '0';
            out[o++] = '.';
            if (nd > exp10 + 1)
                for (int i = exp10 + 1; i < nd; i++)
                    out[o++] = digits[i];
            else
                out[o++] = '0';
        }
        out[o] = '\0';
    } else {
        out[o++] = digits[0];
        if (nd > 1) {
            out[o++] = '.';
            for (int i = 1; i < nd; i++)
                out[o++] = digits[i];
        }
        snprintf(out + o, sizeof out - o, "e%c%02d", exp10 < 0 ? '-' : '+', exp10 < 0 ? -exp10 : exp10);
    }
    snprintf(buf, n, "%s", out);
}

/* True if Python's str.isprintable() holds for code point cp. */
static bool py_printable(int32_t cp) {
    if (cp == ' ')
        return true;
    switch (utf8proc_category(cp)) {
    case UTF8PROC_CATEGORY_CC:
    case UTF8PROC_CATEGORY_CF:
    case UTF8PROC_CATEGORY_CS:
    case UTF8PROC_CATEGORY_CO:
    case UTF8PROC_CATEGORY_CN:
    case UTF8PROC_CATEGORY_ZL:
    case UTF8PROC_CATEGORY_ZP:
    case UTF8PROC_CATEGORY_ZS:
        return false;
    default:
        return true;
    }
}

/* String quoting: when esc holds an escape for the adv bytes at s + i, writes
 * the verbatim run s[*run, i) and the escape, and starts the next run after
 * them; otherwise the bytes stay in the run. */
static int put_escaped(tpl_rt *R, fu_buf *b, const char *s, size_t *run, size_t i, size_t adv, const char *esc) {
    if (!esc[0])
        return FU_OK;
    int rc = tpl_buf_put(R, b, s + *run, i - *run);
    if (!rc)
        rc = buf_cstr(R, b, esc);
    *run = i + adv;
    return rc;
}

static int repr_str(tpl_rt *R, fu_buf *b, const char *s, size_t n) {
    bool has_sq = memchr(s, '\'', n) != NULL, has_dq = memchr(s, '"', n) != NULL;
    char q = (has_sq && !has_dq) ? '"' : '\'';
    int rc = tpl_buf_put(R, b, &q, 1);
    size_t run = 0; /* start of a run of bytes copied verbatim */
    for (size_t i = 0; i < n && !rc;) {
        size_t adv;
        int32_t cp = tpl_utf8_get(s + i, n - i, &adv);
        char esc[16];
        esc[0] = '\0';
        if (cp == '\\')
            snprintf(esc, sizeof esc, "\\\\");
        else if (cp == q)
            snprintf(esc, sizeof esc, "\\%c", q);
        else if (cp == '\n')
            snprintf(esc, sizeof esc, "\\n");
        else if (cp == '\r')
            snprintf(esc, sizeof esc, "\\r");
        else if (cp == '\t')
            snprintf(esc, sizeof esc, "\\t");
        else if (cp < 0x80 ? (cp < 0x20 || cp == 0x7f) : !py_printable(cp)) {
            if (cp < 0x100)
                snprintf(esc, sizeof esc, "\\x%02x", (unsigned)cp);
            else if (cp < 0x10000)
                snprintf(esc, sizeof esc, "\\u%04x", (unsigned)cp);
            else
                snprintf(esc, sizeof esc, "\\U%08x", (unsigned)cp);
        }
        rc = put_escaped(R, b, s, &run, i, adv, esc);
        i += adv;
    }
    if (!rc)
        rc = tpl_buf_put(R, b, s + run, n - run);
    if (!rc)
        rc = tpl_buf_put(R, b, &q, 1);
    return rc;
}

static int repr_depth(tpl_rt *R, fu_buf *b, tpl_val v, int depth);

static int str_depth(tpl_rt *R, fu_buf *b, tpl_val v, int depth) {
    char tmp[64];
    switch (v.kind) {
    case TPL_UNDEF:
        return FU_OK;
    case TPL_NONE:
        return buf_cstr(R, b, "None");
    case TPL_BOOL:
        return buf_cstr(R, b, v.i ? "True" : "False");
    case TPL_INT:
        snprintf(tmp, sizeof tmp, "%lld", (long long)v.i);
        return buf_cstr(R, b, tmp);
    case TPL_FLOAT:
        tpl_float_repr(v.f, tmp, sizeof tmp);
        return buf_cstr(R, b, tmp);
    case TPL_STR:
        return tpl_buf_put(R, b, tpl_as_str(v)->s, tpl_as_str(v)->len);
    default:
        return repr_depth(R, b, v, depth);
    }
}

static int repr_depth(tpl_rt *R, fu_buf *b, tpl_val v, int depth) {
    int rc;
    if (depth > TPL_MAX_NEST)
        return tpl_type_error(R, "value nested too deeply to print");
    switch (v.kind) {
    case TPL_UNDEF:
        return buf_cstr(R, b, "Undefined");
    case TPL_STR:
        return repr_str(R, b, tpl_as_str(v)->s, tpl_as_str(v)->len);
    case TPL_LIST: {
        tpl_list *l = tpl_as_list(v);
        if ((rc = buf_cstr(R, b, l->tuple ? "(" : "[")))
            return rc;
        for (size_t i = 0; i < l->len; i++) {
            if (i && (rc = buf_cstr(R, b, ", ")))
                return rc;
            if ((rc = repr_depth(R, b, l->v[i], depth + 1)))
                return rc;
        }
        if (l->tuple && l->len == 1 && (rc = buf_cstr(R, b, ",")))
            return rc;
        return buf_cstr(R, b, l->tuple ? ")" : "]");
    }
    case TPL_DICT:
    case TPL_NS: {
        tpl_dict *d = tpl_as_dict(v);
        if (v.kind == TPL_NS && (rc = buf_cstr(R, b, "<Namespace ")))
            return rc;
        if ((rc = buf_cstr(R, b, "{")))
            return rc;
        for (size_t i = 0; i < d->len; i++) {
            if (i && (rc = buf_cstr(R, b, ", ")))
                return rc;
            if ((rc = repr_depth(R, b, d->k[i], depth + 1)) || (rc = buf_cstr(R, b, ": ")) ||
                (rc = repr_depth(R, b, d->v[i], depth + 1)))
                return rc;
        }
        return buf_cstr(R, b, v.kind == TPL_NS ? "}>" : "}");
    }
    case TPL_FUNC: {
        tpl_func *f = (tpl_func *)v.o;
        if (f->id == TPL_FN_MACRO) {
            char tmp[300];
            snprintf(tmp, sizeof tmp, "<Macro '%s'>", f->mac && f->mac->str ? f->mac->str : "");
            return buf_cstr(R, b, tmp);
        }
        return buf_cstr(R, b, "<built-in method>");
    }
    case TPL_LOOP: {
        tpl_loop *l = (tpl_loop *)v.o;
        char tmp[80];
        snprintf(tmp, sizeof tmp, "<LoopContext %zu/%zu>", l->index0 + 1, tpl_as_list(l->items)->len);
        return buf_cstr(R, b, tmp);
    }
    default:
        return str_depth(R, b, v, depth);
    }
}

int tpl_buf_str(tpl_rt *R, fu_buf *b, tpl_val v) { return str_depth(R, b, v, 0); }
int tpl_buf_repr(tpl_rt *R, fu_buf *b, tpl_val v) { return repr_depth(R, b, v, 0); }

int tpl_to_str(tpl_rt *R, tpl_val v, tpl_val *out) {
    if (v.kind == TPL_STR) {
        tpl_ref(v);
        *out = v;
        return FU_OK;
    }
    fu_buf b = {0};
    tpl_spans sp = {0};
    int rc = tpl_buf_str_sp(R, &b, &sp, v);
    if (rc) {
        fu_buf_free(&b);
        tpl_spans_free(&sp);
        return rc;
    }
    return tpl_buf_to_str_sp(R, &b, &sp, out);
}

/* ------------------------------------------------------------------------ */
/* JSON output (Python's json.dumps)                                         */
/* ------------------------------------------------------------------------ */

static int json_str(tpl_rt *R, fu_buf *b, const char *s, size_t n, bool ensure_ascii) {
    int rc = buf_cstr(R, b, "\"");
    size_t run = 0;
    for (size_t i = 0; i < n && !rc;) {
        unsigned char c = (unsigned char)s[i];
        char esc[16];
        esc[0] = '\0';
        size_t adv = 1;
        switch (c) {
        case '"': snprintf(esc, sizeof esc, "\\\""); break;
        case '\\': snprintf(esc, sizeof esc, "\\\\"); break;
        case '\n': snprintf(esc, sizeof esc, "\\n"); break;
        case '\r': snprintf(esc, sizeof esc, "\\r"); break;
        case '\t': snprintf(esc, sizeof esc, "\\t"); break;
        case '\b': snprintf(esc, sizeof esc, "\\b"); break;
        case '\f': snprintf(esc, sizeof esc, "\\f"); break;
        default:
            if (c < 0x20) {
                snprintf(esc, sizeof esc, "\\u%04x", c);
            } else if (c >= 0x80 && ensure_ascii) {
                int32_t cp = tpl_utf8_get(s + i, n - i, &adv);
                if (cp >= 0x10000) {
                    cp -= 0x10000;
                    snprintf(esc, sizeof esc, "\\u%04x\\u%04x", 0xD800 + (cp >> 10), 0xDC00 + (cp & 0x3FF));
                } else {
                    snprintf(esc, sizeof esc, "\\u%04x", (unsigned)cp);
                }
            }
        }
        rc = put_escaped(R, b, s, &run, i, adv, esc);
        i += adv;
    }
    if (!rc)
        rc = tpl_buf_put(R, b, s + run, n - run);
    if (!rc)
        rc = buf_cstr(R, b, "\"");
    return rc;
}

static int json_float(tpl_rt *R, fu_buf *b, double f) {
    if (isnan(f))
        return buf_cstr(R, b, "NaN");
    if (isinf(f))
        return buf_cstr(R, b, f < 0 ? "-Infinity" : "Infinity");
    char tmp[64];
    tpl_float_repr(f, tmp, sizeof tmp);
    return buf_cstr(R, b, tmp);
}

static int json_newline(tpl_rt *R, fu_buf *b, const tpl_json_opts *o, int level) {
    int rc = buf_cstr(R, b, "\n");
    for (int i = 0; i < level && !rc; i++)
        rc = tpl_buf_put(R, b, o->indent, o->indent_len);
    return rc;
}

/* Key text as json.dumps converts non-string keys. */
static int json_key(tpl_rt *R, fu_buf *b, tpl_val k, const tpl_json_opts *o) {
    char tmp[64];
    switch (k.kind) {
    case TPL_STR:
        return json_str(R, b, tpl_as_str(k)->s, tpl_as_str(k)->len, o->ensure_ascii);
    case TPL_INT:
        snprintf(tmp, sizeof tmp, "\"%lld\"", (long long)k.i);
        return buf_cstr(R, b, tmp);
    case TPL_BOOL:
        return buf_cstr(R, b, k.i ? "\"true\"" : "\"false\"");
    case TPL_NONE:
        return buf_cstr(R, b, "\"null\"");
    case TPL_FLOAT: {
        int rc = buf_cstr(R, b, "\"");
        if (!rc)
            rc = json_float(R, b, k.f);
        if (!rc)
            rc = buf_cstr(R, b, "\"");
        return rc;
    }
    default:
        return tpl_type_error(R, "keys must be str, int, float, bool or None, not %s", tpl_type_name(k));
    }
}

/* Orders dict keys for sort_keys (str keys by code point, numbers by value). */
static int key_cmp(const void *x, const void *y) {
    const tpl_val *a = x, *b = y;
    if (a->kind == TPL_STR && b->kind == TPL_STR) {
        tpl_str *s = tpl_as_str(*a), *t = tpl_as_str(*b);
        size_t n = s->len < t->len ? s->len : t->len;
        int c = memcmp(s->s, t->s, n);
        return c ? c : (s->len > t->len) - (s->len < t->len);
    }
    if (tpl_is_num(*a) && tpl_is_num(*b)) {
        double p = num_f(*a), q = num_f(*b);
        return (p > q) - (p < q);
    }
    return a->kind - b->kind;
}

int tpl_buf_json(tpl_rt *R, fu_buf *b, tpl_val v, const tpl_json_opts *o, int level) {
    int rc;
    char tmp[64];
    if (level > TPL_MAX_NEST)
        return tpl_type_error(R, "value nested too deeply for tojson");
    switch (v.kind) {
    case TPL_NONE:
        return buf_cstr(R, b, "null");
    case TPL_BOOL:
        return buf_cstr(R, b, v.i ? "true" : "false");
    case TPL_INT:
        snprintf(tmp, sizeof tmp, "%lld", (long long)v.i);
        return buf_cstr(R, b, tmp);
    case TPL_FLOAT:
        return json_float(R, b, v.f);
    case TPL_STR:
        return json_str(R, b, tpl_as_str(v)->s, tpl_as_str(v)->len, o->ensure_ascii);
    case TPL_LIST: {
        tpl_list *l = tpl_as_list(v);
        if (l->len == 0)
            return buf_cstr(R, b, "[]");
        if ((rc = buf_cstr(R, b, "[")))
            return rc;
        for (size_t i = 0; i < l->len; i++) {
            if (i && (rc = tpl_buf_put(R, b, o->item_sep, o->item_sep_len)))
                return rc;
            if (o->indent && (rc = json_newline(R, b, o, level + 1)))
                return rc;
            if ((rc = tpl_buf_json(R, b, l->v[i], o, level + 1)))
                return rc;
        }
        if (o->indent && (rc = json_newline(R, b, o, level)))
            return rc;
        return buf_cstr(R, b, "]");
    }
    case TPL_DICT: {
        tpl_dict *d = tpl_as_dict(v);
        if (d->len == 0)
            return buf_cstr(R, b, "{}");
        size_t *order = malloc(d->len * sizeof *order);
        if (!order)
            return oom(R);
        for (size_t i = 0; i < d->len; i++)
            order[i] = i;
        if (o->sort_keys) {
            /* Stable insertion sort by key (dicts in templates are small). */
            for (size_t i = 1; i < d->len; i++) {
                size_t x = order[i], j = i;
                while (j > 0 && key_cmp(&d->k[order[j - 1]], &d->k[x]) > 0) {
                    order[j] = order[j - 1];
                    j--;
                }
                order[j] = x;
            }
        }
        rc = buf_cstr(R, b, "{");
        for (size_t i = 0; i < d->len && !rc; i++) {
            size_t k = order[i];
            if (i)
                rc = tpl_buf_put(R, b, o->item_sep, o->item_sep_len);
            if (!rc && o->indent)
                rc = json_newline(R, b, o, level + 1);
            if (!rc)
                rc = json_key(R, b, d->k[k], o);
            if (!rc)
                rc = tpl_buf_put(R, b, o->key_sep, o->key_sep_len);
            if (!rc)
                rc = tpl_buf_json(R, b, d->v[k], o, level + 1);
        }
        free(order);
        if (!rc && o->indent)
            rc = json_newline(R, b, o, level);
        if (!rc)
            rc = buf_cstr(R, b, "}");
        return rc;
    }
    default:
        return tpl_type_error(R, "Object of type %s is not JSON serializable", tpl_type_name(v));
    }
}
