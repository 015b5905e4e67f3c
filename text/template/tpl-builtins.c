/* tpl-builtins.c -- jinja2 filters and tests, Python str/dict/list methods, and template globals. */
#include "tpl-impl.h"

#include <assert.h>
#include <ctype.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <utf8proc.h>

#define MAX_RANGE 100000 /* jinja2.sandbox.MAX_RANGE */

/* ------------------------------------------------------------------------ */
/* Small helpers                                                             */
/* ------------------------------------------------------------------------ */

static const char *S(tpl_val v) { return tpl_as_str(v)->s; }
static size_t SL(tpl_val v) { return tpl_as_str(v)->len; }

static int new_list(tpl_rt *R, tpl_val *out, bool gen) {
    int rc = tpl_list_new(R, 0, out);
    if (!rc)
        tpl_as_list(*out)->gen = gen;
    return rc;
}

/* Pushes a new reference to v. */
static int push_ref(tpl_rt *R, tpl_val list, tpl_val v) {
    tpl_ref(v);
    return tpl_list_push(R, list, v);
}

/* Returns a new reference to v. */
static int same(tpl_val v, tpl_val *out) {
    tpl_ref(v);
    *out = v;
    return FU_OK;
}

/* A new list (a tuple with `tuple`, a generator's result with `gen`) of new
 * references to v[0..n), allocated with room for `cap` items. */
static int list_of(tpl_rt *R, const tpl_val *v, size_t n, size_t cap, bool tuple, bool gen, tpl_val *out) {
    int rc = tpl_list_new(R, cap, out);
    if (rc)
        return rc;
    tpl_as_list(*out)->tuple = tuple;
    tpl_as_list(*out)->gen = gen;
    for (size_t i = 0; i < n && !rc; i++)
        rc = push_ref(R, *out, v[i]);
    if (rc)
        tpl_drop_out(R, out);
    return rc;
}

/* Moves b into a new string value when rc is FU_OK; frees b and returns rc otherwise. */
static int ret_str(tpl_rt *R, fu_buf *b, int rc, tpl_val *out) {
    if (rc) {
        fu_buf_free(b);
        return rc;
    }
    return tpl_buf_to_str(R, b, out);
}

/* ret_str for text whose data ranges are in sp (freed either way). */
static int ret_str_sp(tpl_rt *R, fu_buf *b, tpl_spans *sp, int rc, tpl_val *out) {
    if (rc) {
        fu_buf_free(b);
        tpl_spans_free(sp);
        return rc;
    }
    return tpl_buf_to_str_sp(R, b, sp, out);
}

/* ret_str_sp for a formatted string: all data when the format string holds data. */
static int ret_format(tpl_rt *R, tpl_val fmt, fu_buf *b, tpl_spans *sp, int rc, tpl_val *out) {
    bool taint = tpl_taint_begin(R, tpl_holds_data(fmt));
    rc = ret_str_sp(R, b, sp, rc, out);
    tpl_taint_end(R, taint);
    return rc;
}

/* Python str.isspace() for one code point. */
static bool py_space(int32_t c) {
    if (c < 0x80)
        return c == ' ' || (c >= 0x09 && c <= 0x0d) || (c >= 0x1c && c <= 0x1f);
    if (c == 0x85)
        return true;
    utf8proc_category_t k = utf8proc_category(c);
    return k == UTF8PROC_CATEGORY_ZS || k == UTF8PROC_CATEGORY_ZL || k == UTF8PROC_CATEGORY_ZP;
}

static bool py_cased(int32_t c) {
    utf8proc_category_t k = utf8proc_category(c);
    return k == UTF8PROC_CATEGORY_LU || k == UTF8PROC_CATEGORY_LL || k == UTF8PROC_CATEGORY_LT;
}

enum { CASE_UPPER, CASE_LOWER, CASE_TITLE_PY, CASE_CAPITALIZE, CASE_SWAP, CASE_TITLE_JINJA };

/* Python's full case mappings that expand to several characters
 * (SpecialCasing.txt, the common ones); NULL when the simple mapping applies. */
static const char *special_case(int32_t c, bool upper, bool title) {
    static const struct {
        int32_t cp;
        const char *up, *ti;
    } T[] = {
        {0x00DF, "SS", "Ss"},          {0xFB00, "FF", "Ff"},          {0xFB01, "FI", "Fi"},
        {0xFB02, "FL", "Fl"},          {0xFB03, "FFI", "Ffi"},        {0xFB04, "FFL", "Ffl"},
        {0xFB05, "ST", "St"},          {0xFB06, "ST", "St"},          {0x0149, "\u02BCN", "\u02BCN"},
        {0x01F0, "J\u030C", "J\u030C"}, {0x0587, "\u0535\u0552", "\u0535\u0582"},
    };
    if (!upper)
        return c == 0x0130 ? "i\u0307" : NULL;
    for (size_t i = 0; i < sizeof T / sizeof T[0]; i++)
        if (T[i].cp == c)
            return title ? T[i].ti : T[i].up;
    return NULL;
}

/* Maps the case of s[0..n) into a new string. */
static int map_case(tpl_rt *R, const char *s, size_t n, int mode, tpl_val *out) {
    enum { KEEP, UP, LOW, TITLE };
    fu_buf b = {0};
    int rc = FU_OK;
    bool prev_cased = false, first = true, word_start = true;
    for (size_t i = 0; i < n && !rc;) {
        size_t adv;
        int32_t c = tpl_utf8_get(s + i, n - i, &adv);
        int act = KEEP;
        switch (mode) {
        case CASE_UPPER: act = UP; break;
        case CASE_LOWER: act = LOW; break;
        case CASE_CAPITALIZE: act = first ? TITLE : LOW; break;
        case CASE_SWAP:
            act = utf8proc_category(c) == UTF8PROC_CATEGORY_LU ? LOW
                  : utf8proc_category(c) == UTF8PROC_CATEGORY_LL ? UP : KEEP;
            break;
        case CASE_TITLE_PY:
            act = prev_cased ? LOW : TITLE;
            prev_cased = py_cased(c);
            break;
        case CASE_TITLE_JINJA:
            /* Words start after runs of [-\s({\[<]; item[0].upper() + item[1:].lower(). */
            if (c == '-' || c == '(' || c == '{' || c == '[' || c == '<' || py_space(c)) {
                word_start = true;
            } else {
                act = word_start ? UP : LOW;
                word_start = false;
            }
            break;
        }
        first = false;
        const char *sp = act == UP ? special_case(c, true, false)
                         : act == TITLE ? special_case(c, true, true)
                         : act == LOW ? special_case(c, false, false) : NULL;
        if (sp) {
            rc = tpl_buf_put(R, &b, sp, strlen(sp));
        } else {
            int32_t m = act == UP ? utf8proc_toupper(c) : act == LOW ? utf8proc_tolower(c)
                        : act == TITLE ? utf8proc_totitle(c) : c;
            char enc[8];
            size_t k = tpl_utf8_put(m, enc);
            rc = k ? tpl_buf_put(R, &b, enc, k) : tpl_buf_put(R, &b, s + i, adv);
        }
        i += adv;
    }
    return ret_str(R, &b, rc, out);
}

/* Code point set membership for strip(chars). */
static bool in_chars(int32_t c, const char *chars, size_t n) {
    if (!chars)
        return py_space(c);
    for (size_t i = 0; i < n;) {
        size_t adv;
        if (tpl_utf8_get(chars + i, n - i, &adv) == c)
            return true;
        i += adv;
    }
    return false;
}

static size_t prev_cp(const char *s, size_t end) {
    size_t i = end;
    while (i > 0) {
        i--;
        if (((unsigned char)s[i] & 0xC0) != 0x80)
            break;
    }
    return i;
}

/* strip: which bit 1 = left, 2 = right. */
static int do_strip(tpl_rt *R, tpl_val s, const char *chars, size_t nchars, int which, tpl_val *out) {
    const char *p = S(s);
    size_t lo = 0, hi = SL(s);
    if (which & 1)
        while (lo < hi) {
            size_t adv;
            int32_t c = tpl_utf8_get(p + lo, hi - lo, &adv);
            if (!in_chars(c, chars, nchars))
                break;
            lo += adv;
        }
    if (which & 2)
        while (hi > lo) {
            size_t st = prev_cp(p, hi), adv;
            int32_t c = tpl_utf8_get(p + st, hi - st, &adv);
            if (!in_chars(c, chars, nchars))
                break;
            hi = st;
        }
    if (lo == 0 && hi == SL(s)) {
        tpl_ref(s);
        *out = s;
        return FU_OK;
    }
    return tpl_str_sub(R, s, lo, hi, out);
}

static int need_str(tpl_rt *R, tpl_val v, const char *what) {
    if (v.kind == TPL_UNDEF)
        return tpl_undef_fail(R, v);
    if (v.kind != TPL_STR)
        return tpl_type_error(R, "%s must be str, not %s", what, tpl_type_name(v));
    return FU_OK;
}

static int need_int(tpl_rt *R, tpl_val v, const char *what, int64_t *out) {
    if (v.kind == TPL_UNDEF)
        return tpl_undef_fail(R, v);
    if (v.kind != TPL_INT && v.kind != TPL_BOOL)
        return tpl_type_error(R, "%s must be an integer, not %s", what, tpl_type_name(v));
    *out = v.i;
    return FU_OK;
}

/* str.replace(old, new, count) */
static int do_replace(tpl_rt *R, const char *s, size_t n, const char *old, size_t on, const char *nw, size_t nn,
                      int64_t count, tpl_val *out) {
    fu_buf b = {0};
    int rc = FU_OK;
    if (on == 0) {
        /* Inserts `new` before every code point and at the end. */
        int64_t done = 0;
        size_t i = 0;
        while (!rc && i <= n) {
            if (count < 0 || done < count) {
                rc = tpl_buf_put(R, &b, nw, nn);
                done++;
            }
            if (i == n || rc)
                break;
            size_t adv;
            tpl_utf8_get(s + i, n - i, &adv);
            rc = tpl_buf_put(R, &b, s + i, adv);
            i += adv;
        }
        return ret_str(R, &b, rc, out);
    }
    size_t i = 0;
    int64_t done = 0;
    while (!rc && i < n) {
        const char *hit = (count < 0 || done < count) ? memmem(s + i, n - i, old, on) : NULL;
        if (!hit) {
            rc = tpl_buf_put(R, &b, s + i, n - i);
            break;
        }
        size_t at = (size_t)(hit - s);
        rc = tpl_buf_put(R, &b, s + i, at - i);
        if (!rc)
            rc = tpl_buf_put(R, &b, nw, nn);
        i = at + on;
        done++;
    }
    return ret_str(R, &b, rc, out);
}

/* Pushes a new string s[0..n) onto `list`. */
static int push_piece(tpl_rt *R, tpl_val list, const char *s, size_t n) {
    tpl_val piece;
    int rc = tpl_str_new(R, s, n, &piece);
    return rc ? rc : tpl_list_push(R, list, piece);
}

static void list_reverse(tpl_list *l) {
    for (size_t a = 0, z = l->len ? l->len - 1 : 0; a < z; a++, z--) {
        tpl_val t = l->v[a];
        l->v[a] = l->v[z];
        l->v[z] = t;
    }
}

/* The first position from i where p[0..n) stops being (space) whitespace or non-whitespace. */
static size_t span_fwd(const char *p, size_t n, size_t i, bool space) {
    while (i < n) {
        size_t adv;
        if (py_space(tpl_utf8_get(p + i, n - i, &adv)) != space)
            break;
        i += adv;
    }
    return i;
}

/* The start of the run of (space) whitespace or non-whitespace ending at `end`. */
static size_t span_back(const char *p, size_t end, bool space) {
    while (end > 0) {
        size_t q = prev_cp(p, end), adv;
        if (py_space(tpl_utf8_get(p + q, end - q, &adv)) != space)
            break;
        end = q;
    }
    return end;
}

/* str.split(sep, maxsplit) of p[0..n) into `list`; sep is not empty. */
static int split_sep(tpl_rt *R, const char *p, size_t n, const char *sep, size_t sl, int64_t maxsplit, tpl_val list) {
    size_t i = 0;
    for (int64_t done = 0;; done++) {
        const char *hit = (maxsplit < 0 || done < maxsplit) ? memmem(p + i, n - i, sep, sl) : NULL;
        size_t end = hit ? (size_t)(hit - p) : n;
        int rc = push_piece(R, list, p + i, end - i);
        if (rc || !hit)
            return rc;
        i = end + sl;
    }
}

/* str.rsplit(sep, maxsplit) into `list`, last piece first. */
static int rsplit_sep(tpl_rt *R, const char *p, size_t n, const char *sep, size_t sl, int64_t maxsplit, tpl_val list) {
    size_t end = n;
    for (int64_t done = 0;; done++) {
        const char *hit = NULL;
        if ((maxsplit < 0 || done < maxsplit) && end >= sl)
            for (size_t k = end - sl + 1; k-- > 0;)
                if (memcmp(p + k, sep, sl) == 0) {
                    hit = p + k;
                    break;
                }
        size_t st = hit ? (size_t)(hit - p) + sl : 0;
        int rc = push_piece(R, list, p + st, end - st);
        if (rc || !hit)
            return rc;
        end = (size_t)(hit - p);
    }
}

/* str.split(None, maxsplit): runs of whitespace separate, the ends are ignored, no empty pieces. */
static int split_ws(tpl_rt *R, const char *p, size_t n, int64_t maxsplit, tpl_val list) {
    size_t i = 0;
    int rc = FU_OK;
    for (int64_t done = 0; !rc; done++) {
        i = span_fwd(p, n, i, true);
        if (i >= n)
            break;
        size_t st = i;
        if (maxsplit >= 0 && done >= maxsplit) /* the rest of the string, trailing whitespace included */
            return push_piece(R, list, p + st, n - st);
        i = span_fwd(p, n, i, false);
        rc = push_piece(R, list, p + st, i - st);
    }
    return rc;
}

/* str.rsplit(None, maxsplit) into `list`, last piece first. */
static int rsplit_ws(tpl_rt *R, const char *p, size_t n, int64_t maxsplit, tpl_val list) {
    size_t end = n;
    int rc = FU_OK;
    for (int64_t done = 0; !rc; done++) {
        end = span_back(p, end, true);
        if (end == 0)
            break;
        if (maxsplit >= 0 && done >= maxsplit) /* the rest of the string, leading whitespace included */
            return push_piece(R, list, p, end);
        size_t st = span_back(p, end, false);
        rc = push_piece(R, list, p + st, end - st);
        end = st;
    }
    return rc;
}

/* str.split / rsplit into a new list. sepv: a str, or anything else for runs of whitespace. */
static int do_split(tpl_rt *R, tpl_val s, tpl_val sepv, int64_t maxsplit, bool right, tpl_val *out) {
    int rc = new_list(R, out, false);
    if (rc)
        return rc;
    if (sepv.kind == TPL_STR && SL(sepv) == 0) {
        tpl_drop_out(R, out);
        return tpl_type_error(R, "empty separator");
    }
    if (sepv.kind == TPL_STR)
        rc = (right ? rsplit_sep : split_sep)(R, S(s), SL(s), S(sepv), SL(sepv), maxsplit, *out);
    else
        rc = (right ? rsplit_ws : split_ws)(R, S(s), SL(s), maxsplit, *out);
    if (right)
        list_reverse(tpl_as_list(*out));
    if (rc)
        tpl_drop_out(R, out);
    return rc;
}

/* str.splitlines(): \n, \r, \r\n, \v, \f, \x1c-\x1e, \x85, U+2028, U+2029. */
static int do_splitlines(tpl_rt *R, tpl_val s, bool keepends, tpl_val *out) {
    const char *p = S(s);
    size_t n = SL(s), st = 0, i = 0;
    int rc = new_list(R, out, false);
    while (!rc && i < n) {
        size_t adv;
        int32_t c = tpl_utf8_get(p + i, n - i, &adv);
        bool br = c == '\n' || c == '\r' || c == '\v' || c == '\f' || (c >= 0x1c && c <= 0x1e) || c == 0x85 ||
                  c == 0x2028 || c == 0x2029;
        if (!br) {
            i += adv;
            continue;
        }
        size_t end = i;
        i += adv;
        if (c == '\r' && i < n && p[i] == '\n')
            i++;
        tpl_val piece;
        if (!(rc = tpl_str_new(R, p + st, (keepends ? i : end) - st, &piece)))
            rc = tpl_list_push(R, *out, piece);
        st = i;
    }
    if (!rc && st < n) {
        tpl_val piece;
        if (!(rc = tpl_str_new(R, p + st, n - st, &piece)))
            rc = tpl_list_push(R, *out, piece);
    }
    if (rc)
        tpl_drop_out(R, out);
    return rc;
}

/* Pads to `width` code points: align '<', '>' or '^' (Python center). */
static int do_pad(tpl_rt *R, tpl_val s, int64_t width, char align, const char *fill, size_t fl, tpl_val *out) {
    size_t ncp = tpl_utf8_len(S(s), SL(s));
    if (width <= (int64_t)ncp) {
        tpl_ref(s);
        *out = s;
        return FU_OK;
    }
    if ((uint64_t)width > R->lim.max_memory / (fl ? fl : 1))
        return tpl_rt_fail(R, FU_ERR_EXHAUSTED, "template exceeded its memory limit (%zu bytes)", R->lim.max_memory);
    size_t total = (size_t)width - ncp, left = 0;
    if (align == '>')
        left = total;
    else if (align == '^')
        left = total / 2 + (total & (size_t)width & 1); /* Python: left = pad//2 + (pad & width & 1) */
    fu_buf b = {0};
    int rc = FU_OK;
    for (size_t i = 0; i < left && !rc; i++)
        rc = tpl_buf_put(R, &b, fill, fl);
    if (!rc)
        rc = tpl_buf_put(R, &b, S(s), SL(s));
    for (size_t i = left; i < total && !rc; i++)
        rc = tpl_buf_put(R, &b, fill, fl);
    return ret_str(R, &b, rc, out);
}

/* make_attrgetter: dotted path, numeric parts as ints, via getitem. */
static int attr_get(tpl_rt *R, tpl_val item, tpl_val attr, tpl_val *out) {
    if (attr.kind != TPL_STR) {
        return tpl_getitem(R, item, attr, out);
    }
    const char *p = S(attr);
    size_t n = SL(attr);
    tpl_val cur = item;
    tpl_ref(cur);
    size_t st = 0;
    for (size_t i = 0; i <= n; i++) {
        if (i < n && p[i] != '.')
            continue;
        tpl_val key, next;
        bool digits = i > st;
        for (size_t k = st; k < i; k++)
            digits = digits && isdigit((unsigned char)p[k]);
        int rc;
        if (digits) {
            key = tpl_int(strtoll(p + st, NULL, 10));
            rc = FU_OK;
        } else {
            rc = tpl_str_new(R, p + st, i - st, &key);
        }
        if (!rc)
            rc = tpl_getitem(R, cur, key, &next);
        tpl_drop(R, key);
        tpl_drop(R, cur);
        if (rc)
            return rc;
        cur = next;
        st = i + 1;
    }
    *out = cur;
    return FU_OK;
}

/* item's attribute path `attr` (jinja2's make_attrgetter) when `use`, else
 * item itself; a new reference. */
static int item_attr(tpl_rt *R, tpl_val item, bool use, tpl_val attr, tpl_val *out) {
    return use ? attr_get(R, item, attr, out) : same(item, out);
}

/* Sort key: lowercased strings when !case_sensitive (jinja2 ignore_case). */
static int sort_key(tpl_rt *R, tpl_val item, tpl_val attr, bool case_sensitive, tpl_val *out) {
    tpl_val v;
    int rc = item_attr(R, item, attr.kind != TPL_UNDEF && attr.kind != TPL_NONE, attr, &v);
    if (rc)
        return rc;
    if (!case_sensitive && v.kind == TPL_STR) {
        rc = map_case(R, S(v), SL(v), CASE_LOWER, out);
        tpl_drop(R, v);
        return rc;
    }
    *out = v;
    return FU_OK;
}

/* Stable merge sort of keys[] carrying items[]; fails on incomparable keys. */
static int merge_sort(tpl_rt *R, tpl_val *keys, tpl_val *items, size_t n, bool reverse) {
    if (n < 2)
        return FU_OK;
    tpl_val *tk = malloc(n * sizeof *tk), *ti = malloc(n * sizeof *ti);
    if (!tk || !ti) {
        free(tk);
        free(ti);
        return tpl_rt_fail(R, FU_ERR_NOMEM, "out of memory");
    }
    int rc = FU_OK;
    for (size_t w = 1; w < n && !rc; w *= 2) {
        for (size_t lo = 0; lo < n && !rc; lo += 2 * w) {
            size_t mid = lo + w < n ? lo + w : n, hi = lo + 2 * w < n ? lo + 2 * w : n;
            size_t i = lo, j = mid, k = lo;
            while (i < mid && j < hi && !rc) {
                int c;
                rc = tpl_compare(R, keys[j], keys[i], "<", &c);
                bool take_right = reverse ? (c > 0 && c != 2) : (c < 0);
                if (take_right) {
                    tk[k] = keys[j];
                    ti[k++] = items[j++];
                } else {
                    tk[k] = keys[i];
                    ti[k++] = items[i++];
                }
            }
            while (i < mid) {
                tk[k] = keys[i];
                ti[k++] = items[i++];
            }
            while (j < hi) {
                tk[k] = keys[j];
                ti[k++] = items[j++];
            }
        }
        if (!rc) {
            memcpy(keys, tk, n * sizeof *tk);
            memcpy(items, ti, n * sizeof *ti);
        }
        if (!rc)
            rc = tpl_rt_charge(R, n);
    }
    free(tk);
    free(ti);
    return rc;
}

/* Sorts the items of `seq` by key; result is a new list. */
static int sorted_list(tpl_rt *R, tpl_val seq, tpl_val attr, bool case_sensitive, bool reverse, tpl_val *out) {
    tpl_val items;
    int rc = tpl_iter_list(R, seq, &items);
    if (rc)
        return rc;
    tpl_list *l = tpl_as_list(items);
    size_t n = l->len;
    tpl_val *keys = calloc(n ? n : 1, sizeof *keys), *its = calloc(n ? n : 1, sizeof *its);
    if (!keys || !its) {
        free(keys);
        free(its);
        tpl_drop(R, items);
        return tpl_rt_fail(R, FU_ERR_NOMEM, "out of memory");
    }
    size_t made = 0;
    for (; made < n && !rc; made++) {
        its[made] = l->v[made];
        rc = sort_key(R, l->v[made], attr, case_sensitive, &keys[made]);
        if (rc)
            break;
    }
    if (!rc)
        rc = merge_sort(R, keys, its, n, reverse);
    if (!rc && !(rc = new_list(R, out, false))) {
        for (size_t i = 0; i < n && !rc; i++)
            rc = push_ref(R, *out, its[i]);
        if (rc)
            tpl_drop_out(R, out);
    }
    for (size_t i = 0; i < made; i++)
        tpl_drop(R, keys[i]);
    free(keys);
    free(its);
    tpl_drop(R, items);
    return rc;
}

/* ------------------------------------------------------------------------ */
/* printf-style % formatting and str.format                                  */
/* ------------------------------------------------------------------------ */

static int fmt_num(tpl_rt *R, fu_buf *b, const char *flags, int width, int prec, char conv, tpl_val v) {
    char spec[64], tmp[512];
    if (v.kind == TPL_UNDEF)
        return tpl_undef_fail(R, v);
    if (!tpl_is_num(v))
        return tpl_type_error(R, "%%%c format: a real number is required, not %s", conv, tpl_type_name(v));
    if (conv == 'd' || conv == 'i' || conv == 'x' || conv == 'X' || conv == 'o') {
        long long x = v.kind == TPL_FLOAT ? (long long)v.f : (long long)v.i;
        if (v.kind == TPL_FLOAT && (conv == 'x' || conv == 'X' || conv == 'o'))
            return tpl_type_error(R, "%%%c format: an integer is required, not float", conv);
        snprintf(spec, sizeof spec, "%%%s*.*ll%c", flags, conv == 'i' ? 'd' : conv);
        snprintf(tmp, sizeof tmp, spec, width < 0 ? 0 : width, prec, x);
    } else {
        double x = v.kind == TPL_FLOAT ? v.f : (double)v.i;
        snprintf(spec, sizeof spec, "%%%s*.*%c", flags, conv);
        snprintf(tmp, sizeof tmp, spec, width < 0 ? 0 : width, prec, x);
    }
    return tpl_buf_put(R, b, tmp, strlen(tmp));
}

/* The arguments of one `fmt % args`, consumed left to right. */
typedef struct pct_args {
    tpl_val args;  /* the right operand (borrowed) */
    bool is_tuple; /* a tuple: one item per conversion */
    bool is_map;   /* a dict: %(key)s conversions */
    size_t nargs;  /* items to convert (1 unless a tuple) */
    size_t next;   /* the next item to convert */
    bool used_map; /* some %(key) conversion ran */
} pct_args;

/* One conversion "%(key)flags width.prec conv"; arg is set once taken. */
typedef struct pct_spec {
    char flags[8];
    int width, prec; /* -1 when not given */
    char conv;
    tpl_val arg;     /* the value to convert (borrowed) */
    bool have_arg;
} pct_spec;

/* Parses "(key)" at p[*i] (after a '%'): the mapping item becomes sp->arg. */
static int pct_key(tpl_rt *R, const char *p, size_t n, size_t *i, pct_args *pa, pct_spec *sp) {
    size_t j = *i + 1;
    while (j < n && p[j] != ')')
        j++;
    if (j >= n || !pa->is_map)
        return tpl_type_error(R, j >= n ? "incomplete format key" : "format requires a mapping");
    tpl_val *v = tpl_dict_get_cstr(pa->args, p + *i + 1, j - *i - 1);
    if (!v)
        return tpl_type_error(R, "format key not found");
    sp->arg = *v;
    sp->have_arg = true;
    pa->used_map = true;
    *i = j + 1;
    return FU_OK;
}

/* Parses the conversion spec after a '%' at p[*i] up to and including its conversion character. */
static int pct_parse(tpl_rt *R, const char *p, size_t n, size_t *i, pct_args *pa, pct_spec *sp) {
    int rc;
    if (*i >= n)
        return tpl_type_error(R, "incomplete format");
    if (p[*i] == '(' && (rc = pct_key(R, p, n, i, pa, sp)))
        return rc;
    size_t nf = 0;
    while (*i < n && strchr("-+ #0", p[*i]) && nf < sizeof sp->flags - 1)
        sp->flags[nf++] = p[(*i)++];
    sp->flags[nf] = '\0';
    sp->width = sp->prec = -1;
    while (*i < n && isdigit((unsigned char)p[*i]))
        sp->width = (sp->width < 0 ? 0 : sp->width) * 10 + (p[(*i)++] - '0') % 1000000;
    if (*i < n && p[*i] == '.') {
        (*i)++;
        sp->prec = 0;
        while (*i < n && isdigit((unsigned char)p[*i]))
            sp->prec = sp->prec * 10 + (p[(*i)++] - '0') % 1000000;
    }
    if (sp->width > 100000 || sp->prec > 100000)
        return tpl_type_error(R, "format width or precision too large");
    if (*i >= n)
        return tpl_type_error(R, "incomplete format");
    sp->conv = p[(*i)++];
    return FU_OK;
}

/* %s, %r, %a: str() or repr() cut to the precision and padded to the width (code points). */
static int pct_text(tpl_rt *R, fu_buf *b, const pct_spec *sp) {
    fu_buf t = {0};
    int rc = sp->conv == 's' ? tpl_buf_str(R, &t, sp->arg) : tpl_buf_repr(R, &t, sp->arg);
    if (!rc) {
        size_t len = t.len, ncp = tpl_utf8_len(t.data ? t.data : "", t.len);
        if (sp->prec >= 0 && (size_t)sp->prec < ncp) {
            len = tpl_utf8_offset(t.data, t.len, (size_t)sp->prec);
            ncp = (size_t)sp->prec;
        }
        bool left = strchr(sp->flags, '-') != NULL;
        size_t pad = sp->width > 0 && (size_t)sp->width > ncp ? (size_t)sp->width - ncp : 0;
        for (size_t k = 0; k < pad && !left && !rc; k++)
            rc = tpl_buf_put(R, b, " ", 1);
        if (!rc)
            rc = tpl_buf_put(R, b, t.data ? t.data : "", len);
        for (size_t k = 0; k < pad && left && !rc; k++)
            rc = tpl_buf_put(R, b, " ", 1);
    }
    fu_buf_free(&t);
    return rc;
}

/* %c: a one-character string or a code point. */
static int pct_char(tpl_rt *R, fu_buf *b, tpl_val arg) {
    if (arg.kind == TPL_STR && tpl_utf8_len(S(arg), SL(arg)) == 1)
        return tpl_buf_put(R, b, S(arg), SL(arg));
    if (arg.kind == TPL_INT && arg.i >= 0 && arg.i <= 0x10FFFF) {
        char enc[8];
        return tpl_buf_put(R, b, enc, tpl_utf8_put((int32_t)arg.i, enc));
    }
    return tpl_type_error(R, "%%c requires int or char");
}

/* Takes the next argument unless the spec has one, then appends the conversion to b. */
static int pct_convert(tpl_rt *R, fu_buf *b, pct_args *pa, pct_spec *sp) {
    if (!sp->have_arg) {
        if (pa->next >= pa->nargs)
            return tpl_type_error(R, "not enough arguments for format string");
        sp->arg = pa->is_tuple ? tpl_as_list(pa->args)->v[pa->next] : pa->args;
        pa->next++;
    }
    switch (sp->conv) {
    case 's': case 'r': case 'a':
        return pct_text(R, b, sp);
    case 'd': case 'i': case 'x': case 'X': case 'o':
    case 'f': case 'F': case 'e': case 'E': case 'g': case 'G':
        return fmt_num(R, b, sp->flags, sp->width, sp->prec, sp->conv, sp->arg);
    case 'c':
        return pct_char(R, b, sp->arg);
    default:
        return tpl_type_error(R, "unsupported format character '%c'", sp->conv);
    }
}

int tpl_format_percent(tpl_rt *R, tpl_val fmt, tpl_val args, tpl_val *out) {
    const char *p = S(fmt);
    size_t n = SL(fmt);
    bool is_tuple = args.kind == TPL_LIST && tpl_as_list(args)->tuple;
    pct_args pa = {.args = args, .is_tuple = is_tuple, .is_map = args.kind == TPL_DICT,
                   .nargs = is_tuple ? tpl_as_list(args)->len : 1};
    fu_buf b = {0};
    tpl_spans spans = {0};
    int rc = FU_OK;
    for (size_t i = 0; i < n && !rc;) {
        if (p[i] != '%') {
            size_t j = i;
            while (j < n && p[j] != '%')
                j++;
            rc = tpl_buf_put(R, &b, p + i, j - i);
            i = j;
            continue;
        }
        i++;
        pct_spec sp = {.have_arg = false};
        size_t before = b.len;
        if (!(rc = pct_parse(R, p, n, &i, &pa, &sp)))
            rc = sp.conv == '%' ? tpl_buf_put(R, &b, "%", 1) : pct_convert(R, &b, &pa, &sp);
        if (!rc && sp.conv != '%') /* an exact copy of a string keeps its ranges, else all data */
            rc = sp.conv == 's' && sp.arg.kind == TPL_STR && b.len - before == SL(sp.arg)
                     ? tpl_spans_note(R, &spans, before, b.len, sp.arg)
                     : tpl_holds_data(sp.arg) ? tpl_spans_add(R, &spans, before, b.len) : FU_OK;
    }
    /* Python treats any argument with __getitem__ (list, dict, Undefined) as a
     * mapping and then never complains about unused arguments. */
    bool mapping_like = pa.is_map || (args.kind == TPL_LIST && !is_tuple) || args.kind == TPL_UNDEF;
    if (!rc && !pa.used_map && !mapping_like && pa.next < pa.nargs)
        rc = tpl_type_error(R, "not all arguments converted during string formatting");
    return ret_format(R, fmt, &b, &spans, rc, out);
}

/* str.format(*args, **kwargs) with {} {0} {name} {{ }} and no format specs. */
static int str_format(tpl_rt *R, tpl_val fmt, const tpl_args *a, tpl_val *out) {
    const char *p = S(fmt);
    size_t n = SL(fmt), auto_i = 0;
    fu_buf b = {0};
    tpl_spans spans = {0};
    int rc = FU_OK;
    for (size_t i = 0; i < n && !rc;) {
        char c = p[i];
        if (c == '{' && i + 1 < n && p[i + 1] == '{') {
            rc = tpl_buf_put(R, &b, "{", 1);
            i += 2;
            continue;
        }
        if (c == '}' && i + 1 < n && p[i + 1] == '}') {
            rc = tpl_buf_put(R, &b, "}", 1);
            i += 2;
            continue;
        }
        if (c == '}') {
            rc = tpl_type_error(R, "Single '}' encountered in format string");
            break;
        }
        if (c != '{') {
            size_t j = i;
            while (j < n && p[j] != '{' && p[j] != '}')
                j++;
            rc = tpl_buf_put(R, &b, p + i, j - i);
            i = j;
            continue;
        }
        size_t j = i + 1;
        while (j < n && p[j] != '}')
            j++;
        if (j >= n) {
            rc = tpl_type_error(R, "Single '{' encountered in format string");
            break;
        }
        const char *field = p + i + 1;
        size_t fl = j - i - 1;
        if (memchr(field, ':', fl) || memchr(field, '!', fl) || memchr(field, '.', fl) || memchr(field, '[', fl)) {
            rc = tpl_type_error(R, "format specs in str.format are not supported");
            break;
        }
        tpl_val arg = tpl_undef();
        bool found = false;
        if (fl == 0 || isdigit((unsigned char)field[0])) {
            size_t idx = fl == 0 ? auto_i++ : (size_t)strtoul(field, NULL, 10);
            if (idx < a->npos) {
                arg = a->pos[idx];
                found = true;
            } else {
                rc = tpl_type_error(R, "Replacement index %zu out of range for positional args tuple", idx);
                break;
            }
        } else {
            for (size_t k = 0; k < a->nkw && !found; k++)
                if (strlen(a->kwnames[k]) == fl && !memcmp(a->kwnames[k], field, fl)) {
                    arg = a->kw[k];
                    found = true;
                }
            if (!found) {
                rc = tpl_type_error(R, "format key '%.*s' not given", (int)fl, field);
                break;
            }
        }
        rc = tpl_buf_str_sp(R, &b, &spans, arg);
        i = j + 1;
    }
    return ret_format(R, fmt, &b, &spans, rc, out);
}

/* ------------------------------------------------------------------------ */
/* Tables of builtins                                                        */
/* ------------------------------------------------------------------------ */

/* The arguments of one call of a filter, test, method or global, bound to the
 * names of the table entry's parameters (values borrowed from the call). */
typedef struct bound {
    const tpl_args *a; /* the arguments as passed */
    const char *name;  /* the builtin's name, for messages */
    int arg;           /* the entry's `arg` */
    tpl_val p[4];      /* parameter values (TPL_UNDEF where not passed) */
    bool got[4];       /* which parameters were passed */
} bound;

/* A builtin: `self` is a filter's input, a tested value, a method's receiver
 * or a global's bound object (borrowed); on success *out is a new reference. */
typedef int (*builtin_fn)(tpl_rt *R, tpl_val self, const bound *b, tpl_val *out);

enum {
    B_UNDEF_OK = 1, /* filters: Undefined input is accepted (seen as "" or empty) */
    B_RAW = 2,      /* nothing is bound: the handler reads b->a */
    B_KW = 4,       /* methods: keywords bind to `params`; otherwise only up to 3 positionals */
    B_SPANS = 8,    /* keeps its inputs' data ranges itself (concatenation, substrings): no blanket taint */
};

/* One entry of a table. The tables of methods, filters and tests are sorted
 * by name (searched by bisection); FUNCS is indexed by TPL_FN_* id. */
typedef struct builtin {
    const char *name;
    builtin_fn fn;
    const char *const *params; /* NULL-terminated parameter names */
    int arg;                   /* which variant of a shared handler (b->arg) */
    int flags;                 /* B_* */
} builtin;

#define PARAMS(...) ((const char *const[]){__VA_ARGS__, NULL})
#define N_OF(t) (sizeof(t) / sizeof((t)[0]))

/* Runs a builtin whose arguments are bound. When its input or arguments hold
 * data, every string it makes is data (tpl_taint_begin), unless it keeps
 * exact ranges itself (B_SPANS). */
static int run_builtin(tpl_rt *R, const builtin *e, tpl_val self, const bound *b, tpl_val *out) {
    const tpl_args *a = b->a;
    bool d = false;
    if (!(e->flags & B_SPANS)) {
        d = tpl_holds_data(self);
        for (size_t i = 0; i < a->npos && !d; i++)
            d = tpl_holds_data(a->pos[i]);
        for (size_t i = 0; i < a->nkw && !d; i++)
            d = tpl_holds_data(a->kw[i]);
    }
    bool taint = tpl_taint_begin(R, d);
    int rc = e->fn(R, self, b, out);
    tpl_taint_end(R, taint);
    return rc;
}

static int builtin_cmp(const void *name, const void *entry) {
    return strcmp(name, ((const builtin *)entry)->name);
}

/* Index of `name` in t[0..n) (sorted by name), or -1. */
static int builtin_find(const builtin *t, size_t n, const char *name) {
    const builtin *e = bsearch(name, t, n, sizeof *t, builtin_cmp);
    return e ? (int)(e - t) : -1;
}

/* Binds a's arguments to the NULL-terminated `params` (at most 4) into b. */
static int bind_args(tpl_rt *R, const tpl_args *a, const char *const *params, bound *b) {
    size_t n = 0;
    while (params[n])
        n++;
    assert(n <= N_OF(b->p));
    return tpl_bind(R, b->name, a, params, n, b->p, b->got);
}

/* Parameter i, or `dflt` when it was not passed. */
static tpl_val arg_or(const bound *b, int i, tpl_val dflt) { return b->got[i] ? b->p[i] : dflt; }
/* Parameter i was passed and is true. */
static bool arg_true(const bound *b, int i) { return b->got[i] && tpl_truthy(b->p[i]); }
/* Parameter i was passed and is not None. */
static bool arg_given(const bound *b, int i) { return b->got[i] && b->p[i].kind != TPL_NONE; }

/* ------------------------------------------------------------------------ */
/* Methods of str, dict and list                                             */
/* ------------------------------------------------------------------------ */

bool tpl_unsafe_method(tpl_val obj, const char *name) {
    static const char *const list_m[] = {"append", "clear", "pop", "reverse", "insert", "sort", "extend", "remove", NULL};
    static const char *const dict_m[] = {"clear", "pop", "popitem", "setdefault", "update", NULL};
    const char *const *m = obj.kind == TPL_LIST ? list_m : obj.kind == TPL_DICT ? dict_m : NULL;
    for (; m && *m; m++)
        if (!strcmp(*m, name))
            return true;
    return false;
}

/* Character classes of str.isdigit() and friends. */
enum { CP_DIGIT, CP_ALPHA, CP_ALNUM, CP_SPACE, CP_UPPER, CP_LOWER, CP_NUMERIC };

/* True if s is not empty and every code point is in class `what` (for
 * CP_UPPER/CP_LOWER: none of the other case, and at least one cased). */
static bool all_cps(tpl_val s, int what) {
    const char *p = S(s);
    size_t n = SL(s);
    if (n == 0)
        return false;
    bool any_cased = false;
    for (size_t i = 0; i < n;) {
        size_t adv;
        int32_t c = tpl_utf8_get(p + i, n - i, &adv);
        utf8proc_category_t k = utf8proc_category(c);
        bool ok = true;
        switch (what) {
        case CP_DIGIT: ok = k == UTF8PROC_CATEGORY_ND; break; /* isdigit/isdecimal (approx.) */
        case CP_ALPHA: ok = k >= UTF8PROC_CATEGORY_LU && k <= UTF8PROC_CATEGORY_LO; break;
        case CP_ALNUM: ok = (k >= UTF8PROC_CATEGORY_LU && k <= UTF8PROC_CATEGORY_LO) || k == UTF8PROC_CATEGORY_ND ||
                     k == UTF8PROC_CATEGORY_NL || k == UTF8PROC_CATEGORY_NO; break;
        case CP_SPACE: ok = py_space(c); break;
        case CP_UPPER: /* isupper: no lowercase, at least one cased */
            ok = k != UTF8PROC_CATEGORY_LL && k != UTF8PROC_CATEGORY_LT;
            any_cased |= k == UTF8PROC_CATEGORY_LU;
            break;
        case CP_LOWER:
            ok = k != UTF8PROC_CATEGORY_LU && k != UTF8PROC_CATEGORY_LT;
            any_cased |= k == UTF8PROC_CATEGORY_LL;
            break;
        case CP_NUMERIC: ok = k == UTF8PROC_CATEGORY_ND || k == UTF8PROC_CATEGORY_NL || k == UTF8PROC_CATEGORY_NO; break;
        }
        if (!ok)
            return false;
        i += adv;
    }
    return what == CP_UPPER || what == CP_LOWER ? any_cased : true;
}

/* Finds `sub` in s: first (dir > 0) or last; returns code point index or -1. */
static int64_t str_find(tpl_val s, tpl_val sub, bool last) {
    const char *p = S(s), *q = S(sub);
    size_t n = SL(s), m = SL(sub);
    if (m > n)
        return -1;
    if (!last) {
        const char *hit = m ? memmem(p, n, q, m) : p;
        return hit ? (int64_t)tpl_utf8_len(p, (size_t)(hit - p)) : -1;
    }
    for (size_t k = n - m + 1; k-- > 0;)
        if (memcmp(p + k, q, m) == 0)
            return (int64_t)tpl_utf8_len(p, k);
    return -1;
}

enum { VIEW_KEYS, VIEW_VALUES, VIEW_ITEMS };

/* A new list of d's keys, values or (key, value) tuples. */
static int dict_view(tpl_rt *R, tpl_val d, int which, tpl_val *out) {
    tpl_dict *dd = tpl_as_dict(d);
    int rc = new_list(R, out, false);
    if (rc)
        return rc;
    for (size_t i = 0; i < dd->len && !rc; i++) {
        if (which == VIEW_KEYS) {
            rc = push_ref(R, *out, dd->k[i]);
        } else if (which == VIEW_VALUES) {
            rc = push_ref(R, *out, dd->v[i]);
        } else {
            tpl_val t;
            if ((rc = tpl_list_new(R, 2, &t)))
                break;
            tpl_as_list(t)->tuple = true;
            if ((rc = push_ref(R, t, dd->k[i])) || (rc = push_ref(R, t, dd->v[i]))) {
                tpl_drop(R, t);
                break;
            }
            rc = tpl_list_push(R, *out, t);
        }
    }
    if (rc)
        tpl_drop_out(R, out);
    return rc;
}

/* Each m_NAME is the builtin_fn of Python's method NAME (self: the receiver);
 * a handler shared by several methods says what its b->arg selects. */

/* str.strip/lstrip/rstrip([chars]); arg: the ends to strip (1 left, 2 right, 3 both). */
static int m_strip(tpl_rt *R, tpl_val self, const bound *b, tpl_val *out) {
    const char *chars = NULL;
    size_t nc = 0;
    if (arg_given(b, 0)) {
        int rc = need_str(R, b->p[0], "strip arg");
        if (rc)
            return rc;
        chars = S(b->p[0]);
        nc = SL(b->p[0]);
    }
    bool taint = tpl_taint_begin(R, tpl_holds_data(b->p[0])); /* data chooses what is cut */
    int rc = do_strip(R, self, chars, nc, b->arg, out);
    tpl_taint_end(R, taint);
    return rc;
}

/* str.startswith/endswith(prefix or tuple of prefixes); arg: 0 start, 1 end. */
static int m_affix(tpl_rt *R, tpl_val self, const bound *b, tpl_val *out) {
    if (!b->got[0])
        return tpl_type_error(R, "%s() takes at least 1 argument (0 given)", b->name);
    tpl_val x0 = b->p[0];
    tpl_list one = {.len = 1, .v = &x0};
    tpl_list *opts = &one;
    if (x0.kind == TPL_LIST && tpl_as_list(x0)->tuple)
        opts = tpl_as_list(x0);
    else if (need_str(R, x0, "the prefix"))
        return tpl_type_error(R, "%s first arg must be str or a tuple of str, not %s", b->name, tpl_type_name(x0));
    bool res = false;
    for (size_t i = 0; i < opts->len && !res; i++) {
        tpl_val x = opts->v[i];
        if (x.kind != TPL_STR)
            return tpl_type_error(R, "tuple for %s must only contain str, not %s", b->name, tpl_type_name(x));
        if (SL(x) <= SL(self))
            res = !memcmp(S(self) + (b->arg ? SL(self) - SL(x) : 0), S(x), SL(x));
    }
    *out = tpl_bool(res);
    return FU_OK;
}

/* str.split/rsplit(sep=None, maxsplit=-1); arg: 1 for rsplit. */
static int m_split(tpl_rt *R, tpl_val self, const bound *b, tpl_val *out) {
    int64_t maxsplit = -1;
    tpl_val sep = arg_or(b, 0, tpl_none());
    int rc;
    if (sep.kind != TPL_NONE && (rc = need_str(R, sep, "separator")))
        return rc;
    if (b->got[1] && (rc = need_int(R, b->p[1], "maxsplit", &maxsplit)))
        return rc;
    return do_split(R, self, sep, maxsplit, b->arg, out);
}

static int m_splitlines(tpl_rt *R, tpl_val self, const bound *b, tpl_val *out) {
    return do_splitlines(R, self, arg_true(b, 0), out);
}

/* upper, lower, casefold, title, capitalize, swapcase; arg: CASE_*. */
static int m_case(tpl_rt *R, tpl_val self, const bound *b, tpl_val *out) {
    return map_case(R, S(self), SL(self), b->arg, out);
}

static int m_replace(tpl_rt *R, tpl_val self, const bound *b, tpl_val *out) {
    int64_t count = -1;
    int rc;
    if (!b->got[0] || !b->got[1])
        return tpl_type_error(R, "replace() takes at least 2 arguments");
    if ((rc = need_str(R, b->p[0], "replace() argument 1")) || (rc = need_str(R, b->p[1], "replace() argument 2")))
        return rc;
    if (b->got[2] && (rc = need_int(R, b->p[2], "count", &count)))
        return rc;
    return do_replace(R, S(self), SL(self), S(b->p[0]), SL(b->p[0]), S(b->p[1]), SL(b->p[1]), count, out);
}

/* Checks the substring argument of find/rfind/index/rindex/count (no start/end). */
static int substring_arg(tpl_rt *R, const bound *b) {
    if (!b->got[0])
        return tpl_type_error(R, "%s() takes at least 1 argument", b->name);
    int rc = need_str(R, b->p[0], "substring");
    if (rc)
        return rc;
    if (b->got[1])
        return tpl_type_error(R, "%s() with start/end is not supported", b->name);
    return FU_OK;
}

enum { FIND_LAST = 1, FIND_RAISE = 2 };

/* str.find/rfind/index/rindex(sub); arg: FIND_* bits. */
static int m_find(tpl_rt *R, tpl_val self, const bound *b, tpl_val *out) {
    int rc = substring_arg(R, b);
    if (rc)
        return rc;
    int64_t k = str_find(self, b->p[0], b->arg & FIND_LAST);
    if (k < 0 && (b->arg & FIND_RAISE))
        return tpl_type_error(R, "substring not found");
    *out = tpl_int(k);
    return FU_OK;
}

/* str.count(sub): non-overlapping occurrences. */
static int m_count(tpl_rt *R, tpl_val self, const bound *b, tpl_val *out) {
    int rc = substring_arg(R, b);
    if (rc)
        return rc;
    tpl_val sub = b->p[0];
    int64_t c = 0;
    if (SL(sub) == 0) {
        c = (int64_t)tpl_utf8_len(S(self), SL(self)) + 1;
    } else {
        for (const char *h = S(self), *e = S(self) + SL(self); (h = memmem(h, (size_t)(e - h), S(sub), SL(sub)));
             h += SL(sub))
            c++;
    }
    *out = tpl_int(c);
    return FU_OK;
}

static int m_join(tpl_rt *R, tpl_val self, const bound *b, tpl_val *out) {
    if (!b->got[0])
        return tpl_type_error(R, "join() takes exactly one argument (0 given)");
    tpl_val items;
    int rc = tpl_iter_list(R, b->p[0], &items);
    if (rc)
        return rc;
    tpl_list *l = tpl_as_list(items);
    fu_buf buf = {0};
    tpl_spans spans = {0};
    for (size_t i = 0; i < l->len && !rc; i++) {
        if (l->v[i].kind != TPL_STR) {
            rc = tpl_type_error(R, "sequence item %zu: expected str instance, %s found", i, tpl_type_name(l->v[i]));
            break;
        }
        if (i)
            rc = tpl_buf_str_sp(R, &buf, &spans, self);
        if (!rc)
            rc = tpl_buf_str_sp(R, &buf, &spans, l->v[i]);
    }
    tpl_drop(R, items);
    return ret_str_sp(R, &buf, &spans, rc, out);
}

static int m_format(tpl_rt *R, tpl_val self, const bound *b, tpl_val *out) { return str_format(R, self, b->a, out); }

/* isdigit, isalpha, ...; arg: CP_*. */
static int m_is(tpl_rt *R, tpl_val self, const bound *b, tpl_val *out) {
    *out = tpl_bool(all_cps(self, b->arg));
    return FU_OK;
}

static int m_zfill(tpl_rt *R, tpl_val self, const bound *b, tpl_val *out) {
    int64_t k = 0;
    if (!b->got[0])
        return tpl_type_error(R, "zfill() takes exactly one argument");
    int rc = need_int(R, b->p[0], "width", &k);
    if (rc)
        return rc;
    size_t ncp = tpl_utf8_len(S(self), SL(self));
    if (k <= (int64_t)ncp)
        return same(self, out);
    if (k > (int64_t)R->lim.max_memory)
        return tpl_rt_fail(R, FU_ERR_EXHAUSTED, "template exceeded its memory limit");
    fu_buf buf = {0};
    size_t sign = SL(self) && (S(self)[0] == '+' || S(self)[0] == '-');
    rc = tpl_buf_put(R, &buf, S(self), sign);
    for (int64_t i = 0; i < k - (int64_t)ncp && !rc; i++)
        rc = tpl_buf_put(R, &buf, "0", 1);
    if (!rc)
        rc = tpl_buf_put(R, &buf, S(self) + sign, SL(self) - sign);
    return ret_str(R, &buf, rc, out);
}

/* center/ljust/rjust(width, fillchar=' '); arg: the alignment '^', '<' or '>'. */
static int m_pad(tpl_rt *R, tpl_val self, const bound *b, tpl_val *out) {
    int64_t k = 0;
    if (!b->got[0])
        return tpl_type_error(R, "%s() takes at least 1 argument", b->name);
    int rc = need_int(R, b->p[0], "width", &k);
    if (rc)
        return rc;
    const char *fill = " ";
    size_t fl = 1;
    if (b->got[1]) {
        if ((rc = need_str(R, b->p[1], "fill character")))
            return rc;
        fill = S(b->p[1]);
        fl = SL(b->p[1]);
    }
    return do_pad(R, self, k, (char)b->arg, fill, fl, out);
}

/* str.removeprefix/removesuffix; arg: 0 prefix, 1 suffix. */
static int m_remove_affix(tpl_rt *R, tpl_val self, const bound *b, tpl_val *out) {
    if (!b->got[0])
        return tpl_type_error(R, "%s() takes exactly one argument", b->name);
    int rc = need_str(R, b->p[0], "argument");
    if (rc)
        return rc;
    size_t l = SL(b->p[0]), at = b->arg ? SL(self) - l : 0;
    if (l <= SL(self) && !memcmp(S(self) + at, S(b->p[0]), l))
        return tpl_str_new(R, S(self) + (b->arg ? 0 : l), SL(self) - l, out);
    return same(self, out);
}

static int m_get(tpl_rt *R, tpl_val self, const bound *b, tpl_val *out) {
    if (!b->got[0])
        return tpl_type_error(R, "get expected at least 1 argument, got 0");
    tpl_val *v = tpl_dict_get(self, b->p[0]);
    return same(v ? *v : arg_or(b, 1, tpl_none()), out);
}

/* keys, values, items; arg: VIEW_*. */
static int m_view(tpl_rt *R, tpl_val self, const bound *b, tpl_val *out) { return dict_view(R, self, b->arg, out); }

static int m_dict_copy(tpl_rt *R, tpl_val self, const bound *b, tpl_val *out) {
    tpl_dict *d = tpl_as_dict(self);
    int rc = tpl_dict_new(R, d->len, out);
    if (rc)
        return rc;
    for (size_t i = 0; i < d->len && !rc; i++) {
        tpl_ref(d->k[i]);
        tpl_ref(d->v[i]);
        rc = tpl_dict_set(R, *out, d->k[i], d->v[i]);
    }
    if (rc)
        tpl_drop_out(R, out);
    return rc;
}

/* list.count/index(x); arg: 1 for index. */
static int m_list_find(tpl_rt *R, tpl_val self, const bound *b, tpl_val *out) {
    tpl_list *l = tpl_as_list(self);
    if (!b->got[0])
        return tpl_type_error(R, "%s() takes exactly one argument (0 given)", b->name);
    int64_t c = 0, first = -1;
    for (size_t i = 0; i < l->len; i++)
        if (tpl_equal(l->v[i], b->p[0])) {
            c++;
            if (first < 0)
                first = (int64_t)i;
        }
    if (b->arg && first < 0)
        return tpl_type_error(R, "value is not in list");
    *out = tpl_int(b->arg ? first : c);
    return FU_OK;
}

static int m_list_copy(tpl_rt *R, tpl_val self, const bound *b, tpl_val *out) {
    tpl_list *l = tpl_as_list(self);
    return list_of(R, l->v, l->len, 0, l->tuple, false, out);
}

#define KW_SPLIT PARAMS("sep", "maxsplit")

static const builtin STR_METHODS[] = {
    {"capitalize", m_case, NULL, CASE_CAPITALIZE, 0},
    {"casefold", m_case, NULL, CASE_LOWER, 0},
    {"center", m_pad, NULL, '^', 0},
    {"count", m_count, NULL, 0, 0},
    {"endswith", m_affix, NULL, 1, 0},
    {"find", m_find, NULL, 0, 0},
    {"format", m_format, NULL, 0, B_RAW | B_SPANS},
    {"index", m_find, NULL, FIND_RAISE, 0},
    {"isalnum", m_is, NULL, CP_ALNUM, 0},
    {"isalpha", m_is, NULL, CP_ALPHA, 0},
    {"isdecimal", m_is, NULL, CP_DIGIT, 0},
    {"isdigit", m_is, NULL, CP_DIGIT, 0},
    {"islower", m_is, NULL, CP_LOWER, 0},
    {"isnumeric", m_is, NULL, CP_NUMERIC, 0},
    {"isspace", m_is, NULL, CP_SPACE, 0},
    {"isupper", m_is, NULL, CP_UPPER, 0},
    {"join", m_join, NULL, 0, B_SPANS},
    {"ljust", m_pad, NULL, '<', 0},
    {"lower", m_case, NULL, CASE_LOWER, 0},
    {"lstrip", m_strip, NULL, 1, B_SPANS},
    {"removeprefix", m_remove_affix, NULL, 0, 0},
    {"removesuffix", m_remove_affix, NULL, 1, 0},
    {"replace", m_replace, NULL, 0, 0},
    {"rfind", m_find, NULL, FIND_LAST, 0},
    {"rindex", m_find, NULL, FIND_LAST | FIND_RAISE, 0},
    {"rjust", m_pad, NULL, '>', 0},
    {"rsplit", m_split, KW_SPLIT, 1, B_KW},
    {"rstrip", m_strip, NULL, 2, B_SPANS},
    {"split", m_split, KW_SPLIT, 0, B_KW},
    {"splitlines", m_splitlines, NULL, 0, 0},
    {"startswith", m_affix, NULL, 0, 0},
    {"strip", m_strip, NULL, 3, B_SPANS},
    {"swapcase", m_case, NULL, CASE_SWAP, 0},
    {"title", m_case, NULL, CASE_TITLE_PY, 0},
    {"upper", m_case, NULL, CASE_UPPER, 0},
    {"zfill", m_zfill, NULL, 0, 0},
};

static const builtin DICT_METHODS[] = {
    {"copy", m_dict_copy, NULL, 0, 0},
    {"get", m_get, NULL, 0, 0},
    {"items", m_view, NULL, VIEW_ITEMS, 0},
    {"keys", m_view, NULL, VIEW_KEYS, 0},
    {"values", m_view, NULL, VIEW_VALUES, 0},
};

static const builtin LIST_METHODS[] = {
    {"copy", m_list_copy, NULL, 0, 0},
    {"count", m_list_find, NULL, 0, 0},
    {"index", m_list_find, NULL, 1, 0},
};

/* The method table of obj's type (*n entries), or NULL if it has none. */
static const builtin *methods_of(tpl_val obj, size_t *n) {
    switch (obj.kind) {
    case TPL_STR: *n = N_OF(STR_METHODS); return STR_METHODS;
    case TPL_DICT: *n = N_OF(DICT_METHODS); return DICT_METHODS;
    case TPL_LIST: *n = N_OF(LIST_METHODS); return LIST_METHODS;
    default: *n = 0; return NULL;
    }
}

int tpl_method_id(tpl_val obj, const char *name) {
    size_t n;
    const builtin *t = methods_of(obj, &n);
    int i = t ? builtin_find(t, n, name) : -1;
    return i < 0 ? -1 : TPL_FN_METHOD_BASE + i;
}

/* Calls method e of self: binds up to 3 positionals (or, for B_KW methods
 * called with keywords, the keywords by name); str receivers are charged by
 * length. */
static int call_method(tpl_rt *R, const builtin *e, tpl_val self, const tpl_args *a, tpl_val *out) {
    bound b = {.a = a, .name = e->name, .arg = e->arg};
    int rc = FU_OK;
    if (!(e->flags & B_RAW)) {
        bool by_name = a->nkw && (e->flags & B_KW);
        rc = bind_args(R, a, by_name ? e->params : PARAMS("a", "b", "c"), &b);
        if (!rc && a->nkw && !by_name)
            rc = tpl_type_error(R, "%s() takes no keyword arguments", e->name);
        if (!rc && self.kind == TPL_STR)
            rc = tpl_rt_charge(R, SL(self) / 32);
    }
    return rc ? rc : run_builtin(R, e, self, &b, out);
}

/* ------------------------------------------------------------------------ */
/* Filters                                                                   */
/* ------------------------------------------------------------------------ */

bool tpl_is_jinja2_filter(const char *name) {
    static const char *const names[] = {"filesizeformat", "groupby", "pprint", "random", "striptags",
                                        "urlencode", "urlize", "wordwrap", "xmlattr", NULL};
    for (int i = 0; names[i]; i++)
        if (!strcmp(names[i], name))
            return true;
    return false;
}

/* Strips ASCII whitespace from both ends of s[0..*n): returns the new start and shortens *n. */
static const char *strip_ascii(const char *s, size_t *n) {
    while (*n && isspace((unsigned char)*s)) {
        s++;
        (*n)--;
    }
    while (*n && isspace((unsigned char)s[*n - 1]))
        (*n)--;
    return s;
}

/* Python float(str): surrounding whitespace allowed, whole string consumed. */
static bool parse_float(const char *s, size_t n, double *out) {
    char buf[128];
    s = strip_ascii(s, &n);
    if (n == 0 || n >= sizeof buf)
        return false;
    memcpy(buf, s, n);
    buf[n] = '\0';
    for (size_t i = 0; i < n; i++)
        if (buf[i] == '_' || (buf[i] == 'x' || buf[i] == 'X')) /* no hex floats */
            return false;
    char *end;
    errno = 0;
    *out = strtod(buf, &end);
    return *end == '\0';
}

/* Python int(str, base): surrounding whitespace and '_' separators allowed, no overflow. */
static bool parse_int(const char *s, size_t n, int base, int64_t *out) {
    char buf[128];
    s = strip_ascii(s, &n);
    if (n == 0 || n >= sizeof buf)
        return false;
    size_t k = 0;
    for (size_t i = 0; i < n; i++)
        if (s[i] != '_')
            buf[k++] = s[i];
    buf[k] = '\0';
    const char *p = buf;
    if (*p == '+' || *p == '-')
        p++;
    if (!isalnum((unsigned char)*p))
        return false;
    char *end;
    errno = 0;
    long long v = strtoll(buf, &end, base);
    if (*end != '\0' || errno == ERANGE)
        return false;
    *out = v;
    return true;
}

/* Python round(x, ndigits) for floats: correctly rounded, ties to even. */
static double py_round(double x, int64_t nd) {
    if (!isfinite(x))
        return x;
    if (nd > 300)
        return x;
    if (nd >= 0) {
        char buf[512];
        snprintf(buf, sizeof buf, "%.*f", (int)nd, x);
        return strtod(buf, NULL);
    }
    double p = pow(10.0, (double)-nd);
    double y = x / p, r = nearbyint(y);
    return r * p;
}

/* Python round(int, ndigits): stays an int; ndigits < 0 rounds to tens etc., ties to even. */
static int64_t round_int(int64_t v, int64_t prec) {
    if (prec <= -19)
        return 0;
    if (prec >= 0)
        return v;
    int64_t p10 = 1;
    for (int64_t i = 0; i < -prec; i++)
        p10 *= 10;
    int64_t q = v / p10, r = v % p10;
    if (r < 0) {
        q--;
        r += p10;
    }
    if (2 * r > p10 || (2 * r == p10 && (q & 1)))
        q++;
    return q * p10;
}

/* len(v), or -1 when v has no length (a generator, a number...); Undefined has 0. */
static int64_t seq_len(tpl_val v) {
    switch (v.kind) {
    case TPL_UNDEF: return 0;
    case TPL_STR: return (int64_t)tpl_utf8_len(S(v), SL(v));
    case TPL_LIST: return tpl_as_list(v)->gen ? -1 : (int64_t)tpl_as_list(v)->len;
    case TPL_DICT: return (int64_t)tpl_as_dict(v)->len;
    default: return -1;
    }
}

/* Runs fn on str(in), a temporary string. */
static int on_str(tpl_rt *R, tpl_val in, const bound *b, builtin_fn fn, tpl_val *out) {
    tpl_val s;
    int rc = tpl_to_str(R, in, &s);
    if (rc)
        return rc;
    rc = fn(R, s, b, out);
    tpl_drop(R, s);
    return rc;
}

/* Each f_NAME is the builtin_fn of jinja2's filter NAME (self: the filter's
 * input); a handler shared by several filters says what its b->arg selects. */

static int f_abs(tpl_rt *R, tpl_val in, const bound *b, tpl_val *out) {
    if (in.kind == TPL_FLOAT) {
        *out = tpl_float(fabs(in.f));
        return FU_OK;
    }
    if (in.kind != TPL_INT && in.kind != TPL_BOOL)
        return tpl_type_error(R, "bad operand type for abs(): '%s'", tpl_type_name(in));
    if (in.i == INT64_MIN)
        return tpl_type_error(R, "integer overflow");
    *out = tpl_int(in.i < 0 ? -in.i : in.i);
    return FU_OK;
}

static int f_attr(tpl_rt *R, tpl_val in, const bound *b, tpl_val *out) {
    tpl_val name = b->p[0];
    if (!b->got[0] || name.kind != TPL_STR)
        return tpl_type_error(R, "attr() needs an attribute name");
    /* Python getattr only: no fallback to dict items. */
    if (in.kind == TPL_NS || in.kind == TPL_LOOP || tpl_method_id(in, S(name)) >= 0 || tpl_unsafe_method(in, S(name)))
        return tpl_getattr(R, in, S(name), SL(name), out);
    return tpl_undef_hint(R, out, "'%s object' has no attribute '%s'", tpl_type_name(in), S(name));
}

/* Appends to `out` the rows of l's items: rows of `cnt` items (batch) or
 * `cnt` columns (slice); `fill` (NULL: none) pads short rows. */
static int batch_rows(tpl_rt *R, const tpl_list *l, size_t cnt, bool slice, const tpl_val *fill, tpl_val out) {
    size_t n = l->len, rows = slice ? cnt : (n + cnt - 1) / cnt;
    size_t per = slice ? n / rows : 0, extra = slice ? n % rows : 0, pos = 0;
    int rc = FU_OK;
    for (size_t r = 0; r < rows && !rc; r++) {
        size_t take = slice ? per + (r < extra) : (n - pos < cnt ? n - pos : cnt);
        /* jinja2 pads a short last batch to cnt; slice appends one filler to
         * every slice without an extra item. */
        size_t width = slice ? take + (r >= extra ? 1 : 0) : cnt;
        tpl_val row;
        if ((rc = new_list(R, &row, false)))
            break;
        for (size_t k = 0; k < take && !rc; k++)
            rc = push_ref(R, row, l->v[pos + k]);
        pos += take;
        for (size_t k = take; k < width && fill && !rc; k++)
            rc = push_ref(R, row, *fill);
        if (rc)
            tpl_drop(R, row);
        else
            rc = tpl_list_push(R, out, row);
    }
    return rc;
}

/* batch(linecount, fill_with) and slice(slices, fill_with); arg: 1 for slice. */
static int f_batch(tpl_rt *R, tpl_val in, const bound *b, tpl_val *out) {
    int64_t cnt = 0;
    int rc;
    if (!b->got[0])
        return tpl_type_error(R, "%s() missing required argument", b->name);
    if ((rc = need_int(R, b->p[0], "count", &cnt)))
        return rc;
    if (cnt <= 0)
        return tpl_type_error(R, "%s count must be positive", b->name);
    tpl_val items;
    if ((rc = tpl_iter_list(R, in, &items)))
        return rc;
    if (!(rc = new_list(R, out, true))) {
        rc = batch_rows(R, tpl_as_list(items), (size_t)cnt, b->arg, arg_given(b, 1) ? &b->p[1] : NULL, *out);
        if (rc)
            tpl_drop_out(R, out);
    }
    tpl_drop(R, items);
    return rc;
}

/* capitalize, lower, upper, title; arg: CASE_*. */
static int f_case(tpl_rt *R, tpl_val in, const bound *b, tpl_val *out) { return on_str(R, in, b, m_case, out); }

static int f_center(tpl_rt *R, tpl_val in, const bound *b, tpl_val *out) {
    int64_t w = 80;
    int rc;
    if (b->got[0] && (rc = need_int(R, b->p[0], "width", &w)))
        return rc;
    tpl_val s;
    if ((rc = tpl_to_str(R, in, &s)))
        return rc;
    rc = do_pad(R, s, w, '^', " ", 1, out);
    tpl_drop(R, s);
    return rc;
}

/* length and count. */
static int f_length(tpl_rt *R, tpl_val in, const bound *b, tpl_val *out) {
    int64_t n = seq_len(in);
    if (n < 0)
        return tpl_type_error(R, "object of type '%s' has no len()", tpl_type_name(in));
    *out = tpl_int(n);
    return FU_OK;
}

/* default and d. */
static int f_default(tpl_rt *R, tpl_val in, const bound *b, tpl_val *out) {
    if (in.kind != TPL_UNDEF && !(arg_true(b, 1) && !tpl_truthy(in)))
        return same(in, out);
    if (!b->got[0])
        return tpl_str_new(R, "", 0, out);
    return same(b->p[0], out);
}

static int f_dictsort(tpl_rt *R, tpl_val in, const bound *b, tpl_val *out) {
    if (in.kind != TPL_DICT)
        return tpl_type_error(R, "dictsort expects a mapping, not %s", tpl_type_name(in));
    bool by_value = false;
    if (b->got[1]) {
        tpl_val by = b->p[1];
        if (by.kind != TPL_STR || (strcmp(S(by), "key") && strcmp(S(by), "value")))
            return tpl_type_error(R, "You can only sort by either \"key\" or \"value\"");
        by_value = !strcmp(S(by), "value");
    }
    tpl_val items;
    int rc = dict_view(R, in, VIEW_ITEMS, &items);
    if (rc)
        return rc;
    rc = sorted_list(R, items, tpl_int(by_value ? 1 : 0), arg_true(b, 0), arg_true(b, 2), out);
    tpl_drop(R, items);
    return rc;
}

/* escape, e and forceescape: HTML-escapes str(in). */
static int f_escape(tpl_rt *R, tpl_val in, const bound *b, tpl_val *out) {
    tpl_val s;
    int rc = tpl_to_str(R, in, &s);
    if (rc)
        return rc;
    fu_buf buf = {0};
    const char *p = S(s);
    for (size_t i = 0; i < SL(s) && !rc; i++) {
        const char *rep = NULL;
        switch (p[i]) {
        case '&': rep = "&amp;"; break;
        case '<': rep = "&lt;"; break;
        case '>': rep = "&gt;"; break;
        case '"': rep = "&#34;"; break;
        case '\'': rep = "&#39;"; break;
        }
        rc = rep ? tpl_buf_put(R, &buf, rep, strlen(rep)) : tpl_buf_put(R, &buf, p + i, 1);
    }
    tpl_drop(R, s);
    return ret_str(R, &buf, rc, out);
}

/* first and last; arg: 1 for last. */
static int f_first_last(tpl_rt *R, tpl_val in, const bound *b, tpl_val *out) {
    if (b->arg && in.kind == TPL_LIST && tpl_as_list(in)->gen)
        return tpl_type_error(R, "'generator' object is not reversible");
    tpl_val items;
    int rc = tpl_iter_list(R, in, &items);
    if (rc)
        return rc;
    tpl_list *l = tpl_as_list(items);
    if (l->len == 0)
        rc = tpl_undef_hint(R, out, "No %s item, sequence was empty.", b->arg ? "last" : "first");
    else
        rc = same(l->v[b->arg ? l->len - 1 : 0], out);
    tpl_drop(R, items);
    return rc;
}

static int f_float(tpl_rt *R, tpl_val in, const bound *b, tpl_val *out) {
    double f;
    if (in.kind == TPL_FLOAT)
        *out = in;
    else if (in.kind == TPL_INT || in.kind == TPL_BOOL)
        *out = tpl_float((double)in.i);
    else if (in.kind == TPL_STR && parse_float(S(in), SL(in), &f))
        *out = tpl_float(f);
    else
        return same(arg_or(b, 0, tpl_float(0.0)), out);
    return FU_OK;
}

/* Binds every keyword argument of a, by name, in dict d. */
static int dict_add_kwargs(tpl_rt *R, tpl_val d, const tpl_args *a) {
    int rc = FU_OK;
    for (size_t k = 0; k < a->nkw && !rc; k++) {
        tpl_ref(a->kw[k]);
        rc = tpl_dict_set_cstr(R, d, a->kwnames[k], a->kw[k]);
    }
    return rc;
}

/* format(*args) or format(**kwargs): str(in) % args (a tuple) or % kwargs (a dict). */
static int f_format(tpl_rt *R, tpl_val in, const bound *b, tpl_val *out) {
    const tpl_args *a = b->a;
    if (a->npos && a->nkw)
        return tpl_type_error(R, "can't handle positional and keyword arguments at the same time");
    tpl_val args, s = tpl_undef();
    int rc;
    if (a->nkw) {
        if ((rc = tpl_dict_new(R, a->nkw, &args)))
            return rc;
        rc = dict_add_kwargs(R, args, a);
    } else if ((rc = list_of(R, a->pos, a->npos, a->npos, true, false, &args))) {
        return rc;
    }
    if (!rc && !(rc = tpl_to_str(R, in, &s)))
        rc = tpl_format_percent(R, s, args, out);
    tpl_drop(R, s);
    tpl_drop(R, args);
    return rc;
}

/* Appends indent(width)'s indentation to ind: a string as is, or `width` spaces. */
static int indent_unit(tpl_rt *R, tpl_val width, fu_buf *ind) {
    if (width.kind == TPL_STR)
        return tpl_buf_put(R, ind, S(width), SL(width));
    if (width.kind != TPL_INT && width.kind != TPL_BOOL)
        return tpl_type_error(R, "can't multiply sequence by non-int of type '%s'", tpl_type_name(width));
    if (width.i > 100000)
        return tpl_type_error(R, "indent width too large");
    int rc = FU_OK;
    for (int64_t i = 0; i < width.i && !rc; i++)
        rc = tpl_buf_put(R, ind, " ", 1);
    return rc;
}

/* The lines of s + "\n", as str.splitlines() gives them. */
static int lines_of(tpl_rt *R, tpl_val s, tpl_val *lines) {
    tpl_val withnl;
    int rc = tpl_str_cat(R, S(s), SL(s), "\n", 1, &withnl);
    if (rc)
        return rc;
    rc = do_splitlines(R, withnl, false, lines);
    tpl_drop(R, withnl);
    return rc;
}

/* Appends to res the lines joined by "\n", each but the first prefixed by
 * `ind` unless empty (always with `blank`), the first only with `first`. */
static int indent_join(tpl_rt *R, const tpl_list *l, const fu_buf *ind, bool first, bool blank, fu_buf *res) {
    const char *ip = ind->data ? ind->data : "";
    int rc = first ? tpl_buf_put(R, res, ip, ind->len) : FU_OK;
    for (size_t i = 0; i < l->len && !rc; i++) {
        if (i)
            rc = tpl_buf_put(R, res, "\n", 1);
        if (!rc && i && (blank || SL(l->v[i]) > 0))
            rc = tpl_buf_put(R, res, ip, ind->len);
        if (!rc)
            rc = tpl_buf_put(R, res, S(l->v[i]), SL(l->v[i]));
    }
    return rc;
}

static int f_indent(tpl_rt *R, tpl_val in, const bound *b, tpl_val *out) {
    fu_buf ind = {0}, res = {0};
    tpl_val s, lines;
    int rc = indent_unit(R, arg_or(b, 0, tpl_int(4)), &ind);
    if (!rc && in.kind != TPL_STR) /* jinja2 does s += "\n" */
        rc = tpl_type_error(R, "unsupported operand type(s) for +=: '%s' and 'str'", tpl_type_name(in));
    if (!rc && !(rc = tpl_to_str(R, in, &s))) {
        rc = lines_of(R, s, &lines);
        tpl_drop(R, s);
    }
    if (!rc) {
        rc = indent_join(R, tpl_as_list(lines), &ind, arg_true(b, 1), arg_true(b, 2), &res);
        tpl_drop(R, lines);
    }
    fu_buf_free(&ind);
    return ret_str(R, &res, rc, out);
}

static int f_int(tpl_rt *R, tpl_val in, const bound *b, tpl_val *out) {
    int64_t base = 10, v;
    double f;
    int rc;
    if (b->got[1] && (rc = need_int(R, b->p[1], "base", &base)))
        return rc;
    if (in.kind == TPL_INT || in.kind == TPL_BOOL) {
        *out = tpl_int(in.i);
        return FU_OK;
    }
    if (in.kind == TPL_FLOAT && isfinite(in.f) && fabs(in.f) < 9.2e18) {
        *out = tpl_int((int64_t)in.f);
        return FU_OK;
    }
    if (in.kind == TPL_STR && parse_int(S(in), SL(in), (int)base, &v)) {
        *out = tpl_int(v);
        return FU_OK;
    }
    if (in.kind == TPL_STR && parse_float(S(in), SL(in), &f) && isfinite(f) && fabs(f) < 9.2e18) {
        *out = tpl_int((int64_t)f);
        return FU_OK;
    }
    return same(arg_or(b, 0, tpl_int(0)), out);
}

static int f_items(tpl_rt *R, tpl_val in, const bound *b, tpl_val *out) {
    if (in.kind == TPL_UNDEF)
        return new_list(R, out, true);
    if (in.kind != TPL_DICT)
        return tpl_type_error(R, "Can only get item pairs from a mapping.");
    int rc = dict_view(R, in, VIEW_ITEMS, out);
    if (!rc)
        tpl_as_list(*out)->gen = true;
    return rc;
}

static int f_join(tpl_rt *R, tpl_val in, const bound *b, tpl_val *out) {
    tpl_val sep = arg_or(b, 0, tpl_undef()), items;
    int rc = tpl_iter_list(R, in, &items);
    if (rc)
        return rc;
    tpl_list *l = tpl_as_list(items);
    fu_buf buf = {0};
    tpl_spans spans = {0};
    for (size_t i = 0; i < l->len && !rc; i++) {
        tpl_val v;
        if ((i && (rc = tpl_buf_str_sp(R, &buf, &spans, sep))) ||
            (rc = item_attr(R, l->v[i], arg_given(b, 1), b->p[1], &v)))
            break;
        rc = tpl_buf_str_sp(R, &buf, &spans, v);
        tpl_drop(R, v);
    }
    tpl_drop(R, items);
    return ret_str_sp(R, &buf, &spans, rc, out);
}

static int f_list(tpl_rt *R, tpl_val in, const bound *b, tpl_val *out) {
    tpl_val items;
    int rc = tpl_iter_list(R, in, &items);
    if (rc)
        return rc;
    tpl_list *l = tpl_as_list(items);
    if (!l->tuple && !l->gen && items.o != in.o) {
        *out = items;
        return FU_OK;
    }
    rc = list_of(R, l->v, l->len, 0, false, false, out);
    tpl_drop(R, items);
    return rc;
}

/* map(filter, *args, **kwargs) or map(attribute=..., default=...). */
static int f_map(tpl_rt *R, tpl_val in, const bound *b, tpl_val *out) {
    const tpl_args *a = b->a;
    tpl_val items;
    if (!tpl_truthy(in)) /* jinja2: "if value:" guards the iteration */
        return new_list(R, out, true);
    int rc = tpl_iter_list(R, in, &items);
    if (rc)
        return rc;
    tpl_val attr = tpl_undef(), dflt = tpl_undef();
    for (size_t k = 0; k < a->nkw; k++) {
        if (!strcmp(a->kwnames[k], "attribute"))
            attr = a->kw[k];
        else if (!strcmp(a->kwnames[k], "default"))
            dflt = a->kw[k];
    }
    tpl_list *l = tpl_as_list(items);
    if ((rc = new_list(R, out, true))) {
        tpl_drop(R, items);
        return rc;
    }
    if (attr.kind == TPL_UNDEF && a->npos == 0) {
        /* map() with no filter name: jinja2 yields nothing useful; mirror "no filter" error */
        rc = tpl_type_error(R, "map requires a filter argument");
    } else if (attr.kind == TPL_UNDEF && a->pos[0].kind != TPL_STR) {
        rc = tpl_type_error(R, "map filter name must be a string");
    }
    for (size_t i = 0; i < l->len && !rc; i++) {
        tpl_val v;
        if (attr.kind != TPL_UNDEF) {
            rc = attr_get(R, l->v[i], attr, &v);
            if (!rc && v.kind == TPL_UNDEF && dflt.kind != TPL_UNDEF) {
                tpl_drop(R, v);
                v = dflt;
                tpl_ref(v);
            }
        } else {
            tpl_args sub = {.npos = a->npos - 1, .pos = a->pos + 1, .nkw = a->nkw, .kwnames = a->kwnames, .kw = a->kw};
            rc = tpl_apply_filter(R, tpl_filter_id(S(a->pos[0])), S(a->pos[0]), l->v[i], &sub, &v);
        }
        if (!rc)
            rc = tpl_list_push(R, *out, v);
    }
    tpl_drop(R, items);
    if (rc)
        tpl_drop_out(R, out);
    return rc;
}

/* Index in l (sorted by key, ascending) of max's result: Python's max keeps
 * the first of the items whose keys are equal and maximal. */
static int max_index(tpl_rt *R, const tpl_list *l, tpl_val attr, bool case_sensitive, size_t *k) {
    int rc = FU_OK;
    for (*k = l->len - 1; *k > 0; (*k)--) {
        tpl_val kk, kp;
        if ((rc = sort_key(R, l->v[*k], attr, case_sensitive, &kk)))
            break;
        if ((rc = sort_key(R, l->v[*k - 1], attr, case_sensitive, &kp))) {
            tpl_drop(R, kk);
            break;
        }
        bool eq = tpl_equal(kk, kp);
        tpl_drop(R, kk);
        tpl_drop(R, kp);
        if (!eq)
            break;
    }
    return rc;
}

/* min and max (case_sensitive, attribute); arg: 1 for max. */
static int f_minmax(tpl_rt *R, tpl_val in, const bound *b, tpl_val *out) {
    tpl_val attr = arg_or(b, 1, tpl_undef()), sorted;
    int rc = sorted_list(R, in, attr, arg_true(b, 0), false, &sorted);
    if (rc)
        return rc;
    tpl_list *l = tpl_as_list(sorted);
    size_t k = 0; /* min: the first of the stable sort */
    if (l->len == 0)
        rc = tpl_undef_hint(R, out, "No aggregated item, sequence was empty.");
    else if (b->arg)
        rc = max_index(R, l, attr, arg_true(b, 0), &k);
    if (!rc && l->len)
        rc = same(l->v[k], out);
    tpl_drop(R, sorted);
    return rc;
}

enum { SEL_KEEP = 1, SEL_ATTR = 2 };

/* select, reject, selectattr, rejectattr(*[attribute,] test, *args); arg: SEL_* bits. */
static int f_select(tpl_rt *R, tpl_val in, const bound *b, tpl_val *out) {
    const tpl_args *a = b->a;
    bool select = b->arg & SEL_KEEP, by_attr = b->arg & SEL_ATTR;
    tpl_val items;
    if (!tpl_truthy(in)) /* jinja2: "if value:" guards the iteration */
        return new_list(R, out, true);
    int rc = tpl_iter_list(R, in, &items);
    if (rc)
        return rc;
    size_t base = by_attr ? 1 : 0;
    if (by_attr && a->npos < 1) {
        tpl_drop(R, items);
        return tpl_type_error(R, "selectattr/rejectattr need an attribute name");
    }
    bool have_test = a->npos > base;
    if (have_test && a->pos[base].kind != TPL_STR) {
        tpl_drop(R, items);
        return tpl_type_error(R, "test name must be a string");
    }
    tpl_list *l = tpl_as_list(items);
    if ((rc = new_list(R, out, true))) {
        tpl_drop(R, items);
        return rc;
    }
    for (size_t i = 0; i < l->len && !rc; i++) {
        tpl_val v;
        if ((rc = item_attr(R, l->v[i], by_attr, by_attr ? a->pos[0] : tpl_undef(), &v)))
            break;
        bool res;
        if (have_test) {
            tpl_args sub = {.npos = a->npos - base - 1, .pos = a->pos + base + 1, .nkw = a->nkw,
                            .kwnames = a->kwnames, .kw = a->kw};
            rc = tpl_apply_test(R, tpl_test_id(S(a->pos[base])), S(a->pos[base]), v, &sub, &res);
        } else {
            res = tpl_truthy(v);
        }
        tpl_drop(R, v);
        if (!rc && res == select)
            rc = push_ref(R, *out, l->v[i]);
    }
    tpl_drop(R, items);
    if (rc)
        tpl_drop_out(R, out);
    return rc;
}

static int f_replace(tpl_rt *R, tpl_val in, const bound *b, tpl_val *out) {
    int64_t count = -1;
    tpl_val s, o, nw;
    int rc;
    if (!b->got[0] || !b->got[1])
        return tpl_type_error(R, "replace() needs old and new");
    if (arg_given(b, 2) && (rc = need_int(R, b->p[2], "count", &count)))
        return rc;
    if ((rc = tpl_to_str(R, in, &s)))
        return rc;
    if ((rc = tpl_to_str(R, b->p[0], &o))) {
        tpl_drop(R, s);
        return rc;
    }
    if ((rc = tpl_to_str(R, b->p[1], &nw))) {
        tpl_drop(R, s);
        tpl_drop(R, o);
        return rc;
    }
    rc = do_replace(R, S(s), SL(s), S(o), SL(o), S(nw), SL(nw), count, out);
    tpl_drop(R, s);
    tpl_drop(R, o);
    tpl_drop(R, nw);
    return rc;
}

/* A string's code points in reverse order. */
static int str_reverse(tpl_rt *R, tpl_val s, tpl_val *out) {
    fu_buf buf = {0};
    const char *q = S(s);
    size_t end = SL(s);
    int rc = FU_OK;
    while (end > 0 && !rc) {
        size_t st = prev_cp(q, end);
        rc = tpl_buf_put(R, &buf, q + st, end - st);
        end = st;
    }
    return ret_str(R, &buf, rc, out);
}

static int f_reverse(tpl_rt *R, tpl_val in, const bound *b, tpl_val *out) {
    if (in.kind == TPL_STR)
        return str_reverse(R, in, out);
    tpl_val items;
    int rc = tpl_iter_list(R, in, &items);
    if (rc)
        return rc;
    tpl_list *l = tpl_as_list(items);
    if (!(rc = new_list(R, out, true))) {
        for (size_t i = l->len; i-- > 0 && !rc;)
            rc = push_ref(R, *out, l->v[i]);
        if (rc)
            tpl_drop_out(R, out);
    }
    tpl_drop(R, items);
    return rc;
}

/* round(precision=0, method='common'|'ceil'|'floor'). */
static int f_round(tpl_rt *R, tpl_val in, const bound *b, tpl_val *out) {
    int64_t prec = 0;
    int rc;
    if (b->got[0] && (rc = need_int(R, b->p[0], "precision", &prec)))
        return rc;
    const char *method = "common";
    if (b->got[1]) {
        if (b->p[1].kind != TPL_STR)
            return tpl_type_error(R, "method must be common, ceil or floor");
        method = S(b->p[1]);
    }
    if (strcmp(method, "common") && strcmp(method, "ceil") && strcmp(method, "floor"))
        return tpl_type_error(R, "method must be common, ceil or floor");
    if (!tpl_is_num(in))
        return tpl_type_error(R, "type %s doesn't define __round__ method", tpl_type_name(in));
    if (!strcmp(method, "common")) {
        *out = in.kind == TPL_FLOAT ? tpl_float(py_round(in.f, prec)) : tpl_int(round_int(in.i, prec));
        return FU_OK;
    }
    double x = in.kind == TPL_FLOAT ? in.f : (double)in.i, p10 = pow(10.0, (double)prec);
    double r = !strcmp(method, "ceil") ? ceil(x * p10) : floor(x * p10);
    *out = tpl_float(r / p10);
    return FU_OK;
}

/* string and safe. */
static int f_string(tpl_rt *R, tpl_val in, const bound *b, tpl_val *out) { return tpl_to_str(R, in, out); }

static int f_sort(tpl_rt *R, tpl_val in, const bound *b, tpl_val *out) {
    return sorted_list(R, in, arg_or(b, 2, tpl_undef()), arg_true(b, 1), arg_true(b, 0), out);
}

static int f_sum(tpl_rt *R, tpl_val in, const bound *b, tpl_val *out) {
    tpl_val acc = arg_or(b, 1, tpl_int(0)), items;
    tpl_ref(acc);
    int rc = tpl_iter_list(R, in, &items);
    if (rc) {
        tpl_drop(R, acc);
        return rc;
    }
    tpl_list *l = tpl_as_list(items);
    for (size_t i = 0; i < l->len && !rc; i++) {
        tpl_val v, nacc;
        if ((rc = item_attr(R, l->v[i], arg_given(b, 0), b->p[0], &v)))
            break;
        rc = tpl_binop(R, OP_ADD, acc, v, &nacc);
        tpl_drop(R, v);
        if (!rc) {
            tpl_drop(R, acc);
            acc = nacc;
        }
    }
    tpl_drop(R, items);
    if (rc) {
        tpl_drop(R, acc);
        return rc;
    }
    *out = acc;
    return FU_OK;
}

/* tojson's json.dumps options; an int indent is written as spaces into `spaces`. */
static int tojson_opts(tpl_rt *R, const bound *b, tpl_json_opts *o, char spaces[257]) {
    *o = (tpl_json_opts){.item_sep = ", ", .item_sep_len = 2, .key_sep = ": ", .key_sep_len = 2};
    o->ensure_ascii = arg_true(b, 0);
    o->sort_keys = arg_true(b, 3);
    if (arg_given(b, 1)) {
        tpl_val ind = b->p[1];
        if (ind.kind == TPL_STR) {
            o->indent = S(ind);
            o->indent_len = SL(ind);
        } else if (ind.kind == TPL_INT || ind.kind == TPL_BOOL) {
            int64_t w = ind.i < 0 ? 0 : ind.i > 256 ? 256 : ind.i;
            memset(spaces, ' ', (size_t)w);
            spaces[w] = '\0';
            o->indent = spaces;
            o->indent_len = (size_t)w;
        } else {
            return tpl_type_error(R, "indent must be an int or a string");
        }
        o->item_sep = ",";
        o->item_sep_len = 1;
    }
    if (arg_given(b, 2)) {
        tpl_list *sep = b->p[2].kind == TPL_LIST ? tpl_as_list(b->p[2]) : NULL;
        if (!sep || sep->len != 2 || sep->v[0].kind != TPL_STR || sep->v[1].kind != TPL_STR)
            return tpl_type_error(R, "separators must be a pair of strings");
        o->item_sep = S(sep->v[0]);
        o->item_sep_len = SL(sep->v[0]);
        o->key_sep = S(sep->v[1]);
        o->key_sep_len = SL(sep->v[1]);
    }
    return FU_OK;
}

/* tojson(ensure_ascii, indent, separators, sort_keys) as transformers defines it. */
static int f_tojson(tpl_rt *R, tpl_val in, const bound *b, tpl_val *out) {
    if (in.kind == TPL_LIST && tpl_as_list(in)->gen)
        return tpl_type_error(R, "Object of type generator is not JSON serializable");
    tpl_json_opts o;
    char spaces[257];
    int rc = tojson_opts(R, b, &o, spaces);
    if (rc)
        return rc;
    fu_buf buf = {0};
    rc = tpl_buf_json(R, &buf, in, &o, 0);
    return ret_str(R, &buf, rc, out);
}

/* trim(chars) on a string s. */
static int trim_str(tpl_rt *R, tpl_val s, const bound *b, tpl_val *out) {
    tpl_val ch = arg_or(b, 0, tpl_none());
    if (ch.kind != TPL_NONE && ch.kind != TPL_STR)
        return tpl_type_error(R, "strip arg must be None or str");
    bool taint = tpl_taint_begin(R, tpl_holds_data(ch)); /* data chooses what is cut */
    int rc = do_strip(R, s, ch.kind == TPL_STR ? S(ch) : NULL, ch.kind == TPL_STR ? SL(ch) : 0, 3, out);
    tpl_taint_end(R, taint);
    return rc;
}

static int f_trim(tpl_rt *R, tpl_val in, const bound *b, tpl_val *out) { return on_str(R, in, b, trim_str, out); }

/* truncate on a sequence: jinja2 measures len() first and returns short
 * sequences unchanged (longer ones fail on rsplit). */
static int truncate_seq(tpl_rt *R, tpl_val in, int64_t max, tpl_val *out) {
    int64_t n = seq_len(in);
    if (n < 0)
        return tpl_type_error(R, "object of type '%s' has no len()", tpl_type_name(in));
    if (n > max)
        return tpl_type_error(R, "'%s' object has no attribute 'rsplit'", tpl_type_name(in));
    return same(in, out);
}

/* Where truncate cuts s[0..n): after `keep` code points, or without
 * killwords before the last space there: s[:keep].rsplit(" ", 1)[0]. */
static size_t truncate_at(const char *s, size_t n, size_t keep, bool killwords) {
    size_t cut = tpl_utf8_offset(s, n, keep), k = cut;
    if (killwords)
        return cut;
    while (k > 0 && s[k - 1] != ' ')
        k--;
    return k > 0 ? k - 1 : cut;
}

/* truncate(length=255, killwords=False, end='...', leeway=5). */
static int f_truncate(tpl_rt *R, tpl_val in, const bound *b, tpl_val *out) {
    int64_t length = 255, leeway = 5;
    int rc;
    if (b->got[0] && (rc = need_int(R, b->p[0], "length", &length)))
        return rc;
    if (arg_given(b, 3) && (rc = need_int(R, b->p[3], "leeway", &leeway)))
        return rc;
    tpl_val end = arg_or(b, 2, tpl_undef()), s;
    const char *ep = end.kind == TPL_STR ? S(end) : "...";
    size_t el = end.kind == TPL_STR ? SL(end) : 3, ecp = tpl_utf8_len(ep, el);
    if (length < (int64_t)ecp)
        return tpl_type_error(R, "expected length >= %zu, got %lld", ecp, (long long)length);
    if (leeway < 0)
        return tpl_type_error(R, "expected leeway >= 0, got %lld", (long long)leeway);
    if (in.kind != TPL_STR && in.kind != TPL_UNDEF)
        return truncate_seq(R, in, length + leeway, out);
    if ((rc = tpl_to_str(R, in, &s)))
        return rc;
    if ((int64_t)tpl_utf8_len(S(s), SL(s)) <= length + leeway) {
        *out = s;
        return FU_OK;
    }
    size_t cut = truncate_at(S(s), SL(s), (size_t)(length - (int64_t)ecp), arg_true(b, 1));
    rc = tpl_str_cat(R, S(s), cut, ep, el, out);
    tpl_drop(R, s);
    return rc;
}

/* unique(case_sensitive, attribute): the first item of each key, in order. */
static int f_unique(tpl_rt *R, tpl_val in, const bound *b, tpl_val *out) {
    tpl_val items, seen;
    int rc = tpl_iter_list(R, in, &items);
    if (rc)
        return rc;
    if ((rc = new_list(R, &seen, false))) {
        tpl_drop(R, items);
        return rc;
    }
    if ((rc = new_list(R, out, true))) {
        tpl_drop(R, items);
        tpl_drop(R, seen);
        return rc;
    }
    tpl_list *l = tpl_as_list(items), *sl = tpl_as_list(seen);
    for (size_t i = 0; i < l->len && !rc; i++) {
        tpl_val key;
        if ((rc = sort_key(R, l->v[i], arg_or(b, 1, tpl_undef()), arg_true(b, 0), &key)))
            break;
        bool dup = false;
        for (size_t j = 0; j < sl->len && !dup; j++)
            dup = tpl_equal(sl->v[j], key);
        if ((rc = tpl_rt_charge(R, sl->len / 8)) || dup)
            tpl_drop(R, key);
        else if (!(rc = tpl_list_push(R, seen, key)))
            rc = push_ref(R, *out, l->v[i]);
    }
    tpl_drop(R, items);
    tpl_drop(R, seen);
    if (rc)
        tpl_drop_out(R, out);
    return rc;
}

/* wordcount on a string: len(re.findall(r"\w+", s)). */
static int count_words(tpl_rt *R, tpl_val s, const bound *b, tpl_val *out) {
    int64_t c = 0;
    bool inw = false;
    for (size_t i = 0; i < SL(s);) {
        size_t adv;
        int32_t ch = tpl_utf8_get(S(s) + i, SL(s) - i, &adv);
        utf8proc_category_t k = utf8proc_category(ch);
        bool w = ch == '_' || (k >= UTF8PROC_CATEGORY_LU && k <= UTF8PROC_CATEGORY_LO) ||
                 (k >= UTF8PROC_CATEGORY_ND && k <= UTF8PROC_CATEGORY_NO);
        if (w && !inw)
            c++;
        inw = w;
        i += adv;
    }
    *out = tpl_int(c);
    return FU_OK;
}

static int f_wordcount(tpl_rt *R, tpl_val in, const bound *b, tpl_val *out) { return on_str(R, in, b, count_words, out); }

#define P_X PARAMS("x")
#define P_CASE_ATTR PARAMS("case_sensitive", "attribute")
#define P_DEFAULT PARAMS("default_value", "boolean")
#define U B_UNDEF_OK

/* jinja2's filters; `params` name what each binds (B_RAW: it reads the call's arguments itself). */
static const builtin FILTERS[] = {
    {"abs", f_abs, P_X, 0, 0},
    {"attr", f_attr, PARAMS("name"), 0, 0},
    {"batch", f_batch, PARAMS("linecount", "fill_with"), 0, U},
    {"capitalize", f_case, P_X, CASE_CAPITALIZE, U},
    {"center", f_center, PARAMS("width"), 0, U},
    {"count", f_length, P_X, 0, U},
    {"d", f_default, P_DEFAULT, 0, U},
    {"default", f_default, P_DEFAULT, 0, U},
    {"dictsort", f_dictsort, PARAMS("case_sensitive", "by", "reverse"), 0, 0},
    {"e", f_escape, P_X, 0, U},
    {"escape", f_escape, P_X, 0, U},
    {"first", f_first_last, P_X, 0, U},
    {"float", f_float, PARAMS("default"), 0, 0},
    {"forceescape", f_escape, P_X, 0, U},
    {"format", f_format, NULL, 0, U | B_RAW | B_SPANS},
    {"indent", f_indent, PARAMS("width", "first", "blank"), 0, 0},
    {"int", f_int, PARAMS("default", "base"), 0, 0},
    {"items", f_items, P_X, 0, U},
    {"join", f_join, PARAMS("d", "attribute"), 0, U | B_SPANS},
    {"last", f_first_last, P_X, 1, U},
    {"length", f_length, P_X, 0, U},
    {"list", f_list, P_X, 0, U},
    {"lower", f_case, P_X, CASE_LOWER, U},
    {"map", f_map, NULL, 0, U | B_RAW},
    {"max", f_minmax, P_CASE_ATTR, 1, U},
    {"min", f_minmax, P_CASE_ATTR, 0, U},
    {"reject", f_select, NULL, 0, U | B_RAW},
    {"rejectattr", f_select, NULL, SEL_ATTR, U | B_RAW},
    {"replace", f_replace, PARAMS("old", "new", "count"), 0, U},
    {"reverse", f_reverse, P_X, 0, U},
    {"round", f_round, PARAMS("precision", "method"), 0, 0},
    {"safe", f_string, P_X, 0, U},
    {"select", f_select, NULL, SEL_KEEP, U | B_RAW},
    {"selectattr", f_select, NULL, SEL_KEEP | SEL_ATTR, U | B_RAW},
    {"slice", f_batch, PARAMS("slices", "fill_with"), 1, U},
    {"sort", f_sort, PARAMS("reverse", "case_sensitive", "attribute"), 0, U},
    {"string", f_string, P_X, 0, U},
    {"sum", f_sum, PARAMS("attribute", "start"), 0, U},
    {"title", f_case, P_X, CASE_TITLE_JINJA, U},
    {"tojson", f_tojson, PARAMS("ensure_ascii", "indent", "separators", "sort_keys"), 0, U},
    {"trim", f_trim, PARAMS("chars"), 0, U | B_SPANS},
    {"truncate", f_truncate, PARAMS("length", "killwords", "end", "leeway"), 0, U},
    {"unique", f_unique, P_CASE_ATTR, 0, U},
    {"upper", f_case, P_X, CASE_UPPER, U},
    {"wordcount", f_wordcount, P_X, 0, U},
};

#undef U

int tpl_filter_id(const char *name) { return builtin_find(FILTERS, N_OF(FILTERS), name); }

int tpl_apply_filter(tpl_rt *R, int id, const char *name, tpl_val in, const tpl_args *a, tpl_val *out) {
    if (id < 0 && tpl_filter_id(name) < 0 && !tpl_is_jinja2_filter(name))
        return tpl_type_error(R, "No filter named '%s'.", name);
    if (id < 0)
        return tpl_type_error(R, "the jinja2 filter '%s' is not supported", name);
    if ((size_t)id >= N_OF(FILTERS))
        return tpl_type_error(R, "No filter named '%s'.", name);
    const builtin *e = &FILTERS[id];
    if (in.kind == TPL_UNDEF && !(e->flags & B_UNDEF_OK))
        return tpl_undef_fail(R, in);
    bound b = {.a = a, .name = name, .arg = e->arg};
    int rc = e->flags & B_RAW ? FU_OK : bind_args(R, a, e->params, &b);
    return rc ? rc : run_builtin(R, e, in, &b, out);
}

/* ------------------------------------------------------------------------ */
/* Tests                                                                     */
/* ------------------------------------------------------------------------ */

/* Each t_NAME is the builtin_fn of jinja2's test NAME (self: the tested value):
 * it writes a bool to *out. Every test binds the parameters (other, x). */

#define KIND(k) (1 << (k))
#define ALL_KINDS (KIND(TPL_LOOP + 1) - 1)

/* The tests of a value's type (boolean, defined, iterable...); arg: the set of KIND()s that pass. */
static int t_kind(tpl_rt *R, tpl_val in, const bound *b, tpl_val *out) {
    *out = tpl_bool((b->arg & KIND(in.kind)) != 0);
    return FU_OK;
}

/* true and false; arg: the value. */
static int t_bool_is(tpl_rt *R, tpl_val in, const bound *b, tpl_val *out) {
    *out = tpl_bool(in.kind == TPL_BOOL && (in.i != 0) == (b->arg != 0));
    return FU_OK;
}

static int t_sequence(tpl_rt *R, tpl_val in, const bound *b, tpl_val *out) {
    *out = tpl_bool(in.kind == TPL_STR || (in.kind == TPL_LIST && !tpl_as_list(in)->gen) || in.kind == TPL_DICT ||
                    in.kind == TPL_UNDEF);
    return FU_OK;
}

/* lower and upper on str(in); arg: CP_LOWER or CP_UPPER. */
static int t_case(tpl_rt *R, tpl_val in, const bound *b, tpl_val *out) { return on_str(R, in, b, m_is, out); }

enum { MOD_EVEN, MOD_ODD, MOD_BY };

/* even, odd, divisibleby(num), with Python's %; arg: MOD_*. */
static int t_mod(tpl_rt *R, tpl_val in, const bound *b, tpl_val *out) {
    int64_t d = 2;
    int rc;
    if (in.kind == TPL_UNDEF)
        return tpl_undef_fail(R, in);
    if (b->arg == MOD_BY) {
        if (!b->got[0])
            return tpl_type_error(R, "divisibleby needs a divisor");
        if ((rc = need_int(R, b->p[0], "divisor", &d)))
            return rc;
        if (d == 0)
            return tpl_type_error(R, "integer division or modulo by zero");
    }
    bool odd = b->arg == MOD_ODD;
    if (in.kind == TPL_FLOAT) {
        double m = fmod(in.f, (double)d);
        if (m != 0.0 && ((m < 0) != (d < 0)))
            m += (double)d;
        *out = tpl_bool(odd ? m == 1.0 : m == 0.0);
        return FU_OK;
    }
    if (in.kind != TPL_INT && in.kind != TPL_BOOL)
        return tpl_type_error(R, "unsupported operand type(s) for %%: '%s' and 'int'", tpl_type_name(in));
    int64_t m = d == -1 ? 0 : in.i % d;
    if (m != 0 && ((m < 0) != (d < 0)))
        m += d;
    *out = tpl_bool(odd ? m == 1 : m == 0);
    return FU_OK;
}

/* eq, equalto (arg 1) and ne (arg 0). */
static int t_eq(tpl_rt *R, tpl_val in, const bound *b, tpl_val *out) {
    if (!b->got[0])
        return tpl_type_error(R, "test '%s' needs an argument", b->name);
    *out = tpl_bool(tpl_equal(in, b->p[0]) == (b->arg != 0));
    return FU_OK;
}

enum { ORD_LT, ORD_LE, ORD_GT, ORD_GE };

/* lt/lessthan, le, gt/greaterthan, ge; arg: ORD_*. */
static int t_order(tpl_rt *R, tpl_val in, const bound *b, tpl_val *out) {
    static const char *const SYM[] = {"<", "<=", ">", ">="};
    int cmp, rc;
    if (!b->got[0])
        return tpl_type_error(R, "test '%s' needs an argument", b->name);
    if ((rc = tpl_compare(R, in, b->p[0], SYM[b->arg], &cmp)))
        return rc;
    bool res = b->arg == ORD_LT ? cmp < 0 : b->arg == ORD_LE ? cmp <= 0 : b->arg == ORD_GT ? cmp > 0 : cmp >= 0;
    *out = tpl_bool(cmp != 2 && res); /* 2: unordered (NaN) */
    return FU_OK;
}

static int t_sameas(tpl_rt *R, tpl_val in, const bound *b, tpl_val *out) {
    tpl_val o = b->p[0];
    if (!b->got[0])
        return tpl_type_error(R, "sameas needs an argument");
    if (tpl_is_heap(in) || tpl_is_heap(o))
        *out = tpl_bool(in.kind == o.kind && in.o == o.o);
    else
        *out = tpl_bool(in.kind == o.kind && (in.kind == TPL_FLOAT ? in.f == o.f : in.i == o.i));
    return FU_OK;
}

/* in(container). */
static int t_in(tpl_rt *R, tpl_val in, const bound *b, tpl_val *out) {
    tpl_val c = b->p[0];
    bool res = false;
    if (!b->got[0])
        return tpl_type_error(R, "test 'in' needs a container");
    switch (c.kind) {
    case TPL_STR:
        if (in.kind != TPL_STR)
            return tpl_type_error(R, "'in <string>' requires string as left operand, not %s", tpl_type_name(in));
        res = SL(in) == 0 || memmem(S(c), SL(c), S(in), SL(in)) != NULL;
        break;
    case TPL_LIST:
        for (size_t i = 0; i < tpl_as_list(c)->len && !res; i++)
            res = tpl_equal(tpl_as_list(c)->v[i], in);
        break;
    case TPL_DICT: res = tpl_dict_get(c, in) != NULL; break;
    case TPL_UNDEF: break;
    default: return tpl_type_error(R, "argument of type '%s' is not iterable", tpl_type_name(c));
    }
    *out = tpl_bool(res);
    return FU_OK;
}

/* filter and test: whether the string names one; arg: 1 for test. */
static int t_known(tpl_rt *R, tpl_val in, const bound *b, tpl_val *out) {
    bool known = in.kind == TPL_STR && (b->arg ? tpl_test_id(S(in)) : tpl_filter_id(S(in))) >= 0;
    *out = tpl_bool(known);
    return FU_OK;
}

static const builtin TESTS[] = {
    {"boolean", t_kind, NULL, KIND(TPL_BOOL), 0},
    {"callable", t_kind, NULL, KIND(TPL_FUNC) | KIND(TPL_UNDEF), 0},
    {"defined", t_kind, NULL, ALL_KINDS & ~KIND(TPL_UNDEF), 0},
    {"divisibleby", t_mod, NULL, MOD_BY, 0},
    {"eq", t_eq, NULL, 1, 0},
    {"equalto", t_eq, NULL, 1, 0},
    {"escaped", t_kind, NULL, 0, 0},
    {"even", t_mod, NULL, MOD_EVEN, 0},
    {"false", t_bool_is, NULL, 0, 0},
    {"filter", t_known, NULL, 0, 0},
    {"float", t_kind, NULL, KIND(TPL_FLOAT), 0},
    {"ge", t_order, NULL, ORD_GE, 0},
    {"greaterthan", t_order, NULL, ORD_GT, 0},
    {"gt", t_order, NULL, ORD_GT, 0},
    {"in", t_in, NULL, 0, 0},
    {"integer", t_kind, NULL, KIND(TPL_INT), 0},
    {"iterable", t_kind, NULL, KIND(TPL_STR) | KIND(TPL_LIST) | KIND(TPL_DICT) | KIND(TPL_UNDEF) | KIND(TPL_LOOP),
     0},
    {"le", t_order, NULL, ORD_LE, 0},
    {"lessthan", t_order, NULL, ORD_LT, 0},
    {"lower", t_case, NULL, CP_LOWER, 0},
    {"lt", t_order, NULL, ORD_LT, 0},
    {"mapping", t_kind, NULL, KIND(TPL_DICT), 0},
    {"ne", t_eq, NULL, 0, 0},
    {"none", t_kind, NULL, KIND(TPL_NONE), 0},
    {"number", t_kind, NULL, KIND(TPL_INT) | KIND(TPL_FLOAT) | KIND(TPL_BOOL), 0},
    {"odd", t_mod, NULL, MOD_ODD, 0},
    {"sameas", t_sameas, NULL, 0, 0},
    {"sequence", t_sequence, NULL, 0, 0},
    {"string", t_kind, NULL, KIND(TPL_STR), 0},
    {"test", t_known, NULL, 1, 0},
    {"true", t_bool_is, NULL, 1, 0},
    {"undefined", t_kind, NULL, KIND(TPL_UNDEF), 0},
    {"upper", t_case, NULL, CP_UPPER, 0},
};

int tpl_test_id(const char *name) { return builtin_find(TESTS, N_OF(TESTS), name); }

int tpl_apply_test(tpl_rt *R, int id, const char *name, tpl_val in, const tpl_args *a, bool *out) {
    if (id < 0 || (size_t)id >= N_OF(TESTS))
        return tpl_type_error(R, "No test named '%s'.", name);
    bound b = {.a = a, .name = name, .arg = TESTS[id].arg};
    tpl_val res;
    int rc = bind_args(R, a, PARAMS("other", "x"), &b);
    if (!rc && !(rc = TESTS[id].fn(R, in, &b, &res)))
        *out = res.i != 0;
    return rc;
}

/* ------------------------------------------------------------------------ */
/* Globals and dispatch                                                      */
/* ------------------------------------------------------------------------ */

/* range([start,] stop[, step]) as a list, bounded by the sandbox's MAX_RANGE. */
static int fn_range(tpl_rt *R, tpl_val self, const bound *b, tpl_val *out) {
    const tpl_args *a = b->a;
    if (a->nkw)
        return tpl_type_error(R, "range() takes no keyword arguments");
    if (a->npos < 1 || a->npos > 3)
        return tpl_type_error(R, "range expected 1 to 3 arguments, got %zu", a->npos);
    int64_t v[3] = {0, 0, 0};
    for (size_t i = 0; i < a->npos; i++)
        if (need_int(R, a->pos[i], "range() argument", &v[i]))
            return tpl_type_error(R, "'%s' object cannot be interpreted as an integer", tpl_type_name(a->pos[i]));
    int64_t start = a->npos == 1 ? 0 : v[0], stop = a->npos == 1 ? v[0] : v[1], step = a->npos == 3 ? v[2] : 1;
    if (step == 0)
        return tpl_type_error(R, "range() arg 3 must not be zero");
    double count = step > 0 ? ceil(((double)stop - (double)start) / (double)step)
                            : ceil(((double)start - (double)stop) / (double)-step);
    if (count < 0)
        count = 0;
    if (count > MAX_RANGE)
        return tpl_type_error(R, "Range too big. The sandbox blocks ranges larger than MAX_RANGE (%d).", MAX_RANGE);
    int rc = tpl_list_new(R, (size_t)count, out);
    if (rc)
        return rc;
    for (int64_t i = 0; i < (int64_t)count && !rc; i++)
        rc = tpl_list_push(R, *out, tpl_int(start + i * step));
    if (rc)
        tpl_drop_out(R, out);
    return rc;
}

/* Fills dict `d` from a positional mapping or list of pairs, then the keywords. */
static int fill_dict(tpl_rt *R, tpl_val d, const tpl_args *a, const char *fname) {
    int rc = FU_OK;
    if (a->npos > 1)
        return tpl_type_error(R, "%s expected at most 1 argument, got %zu", fname, a->npos);
    if (a->npos == 1) {
        tpl_val src = a->pos[0];
        if (src.kind == TPL_DICT || src.kind == TPL_NS) {
            tpl_dict *sd = tpl_as_dict(src);
            for (size_t i = 0; i < sd->len && !rc; i++) {
                tpl_ref(sd->k[i]);
                tpl_ref(sd->v[i]);
                rc = tpl_dict_set(R, d, sd->k[i], sd->v[i]);
            }
        } else {
            tpl_val items;
            if ((rc = tpl_iter_list(R, src, &items)))
                return rc;
            tpl_list *l = tpl_as_list(items);
            for (size_t i = 0; i < l->len && !rc; i++) {
                tpl_val pair = l->v[i];
                if (pair.kind != TPL_LIST || tpl_as_list(pair)->len != 2) {
                    rc = tpl_type_error(R, "cannot convert dictionary update sequence element #%zu to a sequence", i);
                    break;
                }
                tpl_val k = tpl_as_list(pair)->v[0], v = tpl_as_list(pair)->v[1];
                tpl_ref(k);
                tpl_ref(v);
                rc = tpl_dict_set(R, d, k, v);
            }
            tpl_drop(R, items);
        }
    }
    return rc ? rc : dict_add_kwargs(R, d, a);
}

/* dict(...) and namespace(...); arg: the kind made (TPL_DICT or TPL_NS). */
static int fn_dict(tpl_rt *R, tpl_val self, const bound *b, tpl_val *out) {
    int rc = tpl_dict_new(R, b->a->nkw, out);
    if (rc)
        return rc;
    if ((rc = fill_dict(R, *out, b->a, b->name))) {
        tpl_drop_out(R, out);
        return rc;
    }
    out->kind = b->arg;
    out->o->kind = (uint32_t)b->arg;
    return FU_OK;
}

static int fn_raise(tpl_rt *R, tpl_val self, const bound *b, tpl_val *out) {
    tpl_val s = tpl_undef();
    int rc;
    if (b->a->npos >= 1 && (rc = tpl_to_str(R, b->a->pos[0], &s)))
        return rc;
    rc = tpl_rt_fail(R, FU_ERR_TEMPLATE, "%s", s.kind == TPL_STR ? S(s) : "");
    tpl_drop(R, s);
    return rc;
}

static int fn_strftime(tpl_rt *R, tpl_val self, const bound *b, tpl_val *out) {
    const tpl_args *a = b->a;
    if (a->npos != 1 || a->pos[0].kind != TPL_STR)
        return tpl_type_error(R, "strftime_now() takes one format string");
    if (SL(a->pos[0]) > 256)
        return tpl_type_error(R, "strftime_now() format too long");
    time_t now = time(NULL);
    struct tm tm;
    localtime_r(&now, &tm);
    char buf[4096];
    size_t n = strftime(buf, sizeof buf, S(a->pos[0]), &tm);
    return tpl_str_new(R, buf, n, out);
}

/* loop.cycle(*items); self: the loop. */
static int fn_loop_cycle(tpl_rt *R, tpl_val self, const bound *b, tpl_val *out) {
    const tpl_args *a = b->a;
    if (a->npos == 0)
        return tpl_type_error(R, "no items for cycling given");
    tpl_loop *l = (tpl_loop *)self.o;
    return same(a->pos[l->index0 % a->npos], out);
}

/* loop.changed(*values): whether they differ from the previous call's; self: the loop. */
static int fn_loop_changed(tpl_rt *R, tpl_val self, const bound *b, tpl_val *out) {
    tpl_loop *l = (tpl_loop *)self.o;
    tpl_val cur;
    int rc = list_of(R, b->a->pos, b->a->npos, b->a->npos, false, false, &cur);
    if (rc)
        return rc;
    bool changed = l->last_changed.kind == TPL_UNDEF || !tpl_equal(l->last_changed, cur);
    bool cyc;
    if ((rc = tpl_reaches(R, cur, &l->h, &cyc)) || cyc) { /* storing it would make a reference cycle */
        tpl_drop(R, cur);
        return rc ? rc : tpl_type_error(R, "loop.changed() cannot take the loop itself");
    }
    tpl_drop(R, l->last_changed);
    l->last_changed = cur;
    *out = tpl_bool(changed);
    return FU_OK;
}

/* Builtin functions by TPL_FN_* id; the template globals are those from
 * TPL_FN_RANGE to TPL_FN_STRFTIME. All read their arguments themselves. */
static const builtin FUNCS[] = {
    [TPL_FN_RANGE] = {"range", fn_range, NULL, 0, B_RAW},
    [TPL_FN_NAMESPACE] = {"namespace", fn_dict, NULL, TPL_NS, B_RAW},
    [TPL_FN_DICT] = {"dict", fn_dict, NULL, TPL_DICT, B_RAW},
    [TPL_FN_RAISE] = {"raise_exception", fn_raise, NULL, 0, B_RAW},
    [TPL_FN_STRFTIME] = {"strftime_now", fn_strftime, NULL, 0, B_RAW},
    [TPL_FN_LOOP_CYCLE] = {"cycle", fn_loop_cycle, NULL, 0, B_RAW},
    [TPL_FN_LOOP_CHANGED] = {"changed", fn_loop_changed, NULL, 0, B_RAW},
};

int tpl_global_id(const char *name) {
    for (int id = TPL_FN_RANGE; id <= TPL_FN_STRFTIME; id++)
        if (!strcmp(FUNCS[id].name, name))
            return id;
    return -1;
}

int tpl_call_builtin(tpl_rt *R, tpl_func *f, const tpl_args *a, tpl_val *out) {
    if (f->id >= TPL_FN_METHOD_BASE) {
        size_t n;
        const builtin *t = methods_of(f->self, &n);
        if (t && (size_t)(f->id - TPL_FN_METHOD_BASE) < n)
            return call_method(R, &t[f->id - TPL_FN_METHOD_BASE], f->self, a, out);
    } else if (f->id > 0 && (size_t)f->id < N_OF(FUNCS) && FUNCS[f->id].fn) {
        const builtin *e = &FUNCS[f->id];
        bound b = {.a = a, .name = e->name, .arg = e->arg};
        return run_builtin(R, e, f->self, &b, out);
    }
    return tpl_type_error(R, "object is not callable");
}
