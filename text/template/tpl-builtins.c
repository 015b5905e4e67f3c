/* tpl-builtins.c -- jinja2 filters and tests, Python str/dict/list methods, and template globals. */
#include "tpl-impl.h"

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

static int ret_str(tpl_rt *R, fu_buf *b, int rc, tpl_val *out) {
    if (rc) {
        fu_buf_free(b);
        return rc;
    }
    return tpl_buf_to_str(R, b, out);
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
    return tpl_str_new(R, p + lo, hi - lo, out);
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

/* str.split / rsplit. sep NULL: runs of whitespace. */
static int do_split(tpl_rt *R, tpl_val s, tpl_val sepv, int64_t maxsplit, bool right, tpl_val *out) {
    const char *p = S(s);
    size_t n = SL(s);
    int rc = new_list(R, out, false);
    if (rc)
        return rc;
    tpl_val piece;
    if (sepv.kind == TPL_STR) {
        const char *sep = S(sepv);
        size_t sl = SL(sepv);
        if (sl == 0) {
            tpl_drop(R, *out);
            return tpl_type_error(R, "empty separator");
        }
        if (!right) {
            size_t i = 0;
            int64_t done = 0;
            for (;;) {
                const char *hit = (maxsplit < 0 || done < maxsplit) ? memmem(p + i, n - i, sep, sl) : NULL;
                size_t end = hit ? (size_t)(hit - p) : n;
                if ((rc = tpl_str_new(R, p + i, end - i, &piece)) || (rc = tpl_list_push(R, *out, piece)))
                    break;
                if (!hit)
                    break;
                i = end + sl;
                done++;
            }
        } else {
            /* Collect from the right, then reverse. */
            size_t end = n;
            int64_t done = 0;
            for (;;) {
                const char *hit = NULL;
                if ((maxsplit < 0 || done < maxsplit) && end >= sl)
                    for (size_t k = end - sl + 1; k-- > 0;)
                        if (memcmp(p + k, sep, sl) == 0) {
                            hit = p + k;
                            break;
                        }
                size_t st = hit ? (size_t)(hit - p) + sl : 0;
                if ((rc = tpl_str_new(R, p + st, end - st, &piece)) || (rc = tpl_list_push(R, *out, piece)))
                    break;
                if (!hit)
                    break;
                end = (size_t)(hit - p);
                done++;
            }
            tpl_list *l = tpl_as_list(*out);
            for (size_t a = 0, z = l->len ? l->len - 1 : 0; a < z; a++, z--) {
                tpl_val t = l->v[a];
                l->v[a] = l->v[z];
                l->v[z] = t;
            }
        }
    } else {
        /* Whitespace split: leading/trailing whitespace ignored, no empty pieces. */
        size_t i = 0;
        int64_t done = 0;
        if (!right) {
            while (!rc) {
                while (i < n) {
                    size_t adv;
                    if (!py_space(tpl_utf8_get(p + i, n - i, &adv)))
                        break;
                    i += adv;
                }
                if (i >= n)
                    break;
                size_t st = i;
                if (maxsplit >= 0 && done >= maxsplit) {
                    /* The rest of the string, trailing whitespace included. */
                    if (!(rc = tpl_str_new(R, p + st, n - st, &piece)))
                        rc = tpl_list_push(R, *out, piece);
                    break;
                }
                while (i < n) {
                    size_t adv;
                    if (py_space(tpl_utf8_get(p + i, n - i, &adv)))
                        break;
                    i += adv;
                }
                if (!(rc = tpl_str_new(R, p + st, i - st, &piece)))
                    rc = tpl_list_push(R, *out, piece);
                done++;
            }
        } else {
            size_t end = n;
            while (!rc) {
                while (end > 0) {
                    size_t q = prev_cp(p, end), adv;
                    if (!py_space(tpl_utf8_get(p + q, end - q, &adv)))
                        break;
                    end = q;
                }
                if (end == 0)
                    break;
                size_t st = end;
                if (maxsplit >= 0 && done >= maxsplit) {
                    /* The rest of the string, leading whitespace included. */
                    if (!(rc = tpl_str_new(R, p, end, &piece)))
                        rc = tpl_list_push(R, *out, piece);
                    break;
                }
                while (st > 0) {
                    size_t q = prev_cp(p, st), adv;
                    if (py_space(tpl_utf8_get(p + q, st - q, &adv)))
                        break;
                    st = q;
                }
                if (!(rc = tpl_str_new(R, p + st, end - st, &piece)))
                    rc = tpl_list_push(R, *out, piece);
                end = st;
                done++;
            }
            tpl_list *l = tpl_as_list(*out);
            for (size_t a = 0, z = l->len ? l->len - 1 : 0; a < z; a++, z--) {
                tpl_val t = l->v[a];
                l->v[a] = l->v[z];
                l->v[z] = t;
            }
        }
    }
    if (rc)
        tpl_drop(R, *out);
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
        tpl_drop(R, *out);
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

/* Sort key: lowercased strings when !case_sensitive (jinja2 ignore_case). */
static int sort_key(tpl_rt *R, tpl_val item, tpl_val attr, bool case_sensitive, tpl_val *out) {
    tpl_val v;
    int rc;
    if (attr.kind != TPL_UNDEF && attr.kind != TPL_NONE) {
        if ((rc = attr_get(R, item, attr, &v)))
            return rc;
    } else {
        v = item;
        tpl_ref(v);
    }
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
            tpl_drop(R, *out);
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
        snprintf(spec, sizeof spec, "%%%s%s%s%s%s", flags, width >= 0 ? "*" : "", prec >= 0 ? ".*" : "", "ll",
                 conv == 'i' ? "d" : (char[]){conv, 0});
        if (width >= 0 && prec >= 0)
            snprintf(tmp, sizeof tmp, spec, width, prec, x);
        else if (width >= 0)
            snprintf(tmp, sizeof tmp, spec, width, x);
        else if (prec >= 0)
            snprintf(tmp, sizeof tmp, spec, prec, x);
        else
            snprintf(tmp, sizeof tmp, spec, x);
    } else {
        double x = v.kind == TPL_FLOAT ? v.f : (double)v.i;
        snprintf(spec, sizeof spec, "%%%s%s%s%c", flags, width >= 0 ? "*" : "", prec >= 0 ? ".*" : "", conv);
        if (width >= 0 && prec >= 0)
            snprintf(tmp, sizeof tmp, spec, width, prec, x);
        else if (width >= 0)
            snprintf(tmp, sizeof tmp, spec, width, x);
        else if (prec >= 0)
            snprintf(tmp, sizeof tmp, spec, prec, x);
        else
            snprintf(tmp, sizeof tmp, spec, x);
    }
    return tpl_buf_put(R, b, tmp, strlen(tmp));
}

int tpl_format_percent(tpl_rt *R, tpl_val fmt, tpl_val args, tpl_val *out) {
    const char *p = S(fmt);
    size_t n = SL(fmt), ai = 0;
    bool is_tuple = args.kind == TPL_LIST && tpl_as_list(args)->tuple;
    bool is_map = args.kind == TPL_DICT;
    size_t nargs = is_tuple ? tpl_as_list(args)->len : 1;
    bool used_map = false;
    fu_buf b = {0};
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
        if (i >= n) {
            rc = tpl_type_error(R, "incomplete format");
            break;
        }
        tpl_val arg = tpl_undef();
        bool have_arg = false;
        if (p[i] == '(') {
            size_t j = i + 1;
            while (j < n && p[j] != ')')
                j++;
            if (j >= n || !is_map) {
                rc = tpl_type_error(R, j >= n ? "incomplete format key" : "format requires a mapping");
                break;
            }
            tpl_val *v = tpl_dict_get_cstr(args, p + i + 1, j - i - 1);
            if (!v) {
                rc = tpl_type_error(R, "format key not found");
                break;
            }
            arg = *v;
            have_arg = true;
            used_map = true;
            i = j + 1;
        }
        char flags[8];
        size_t nf = 0;
        while (i < n && strchr("-+ #0", p[i]) && nf < sizeof flags - 1)
            flags[nf++] = p[i++];
        flags[nf] = '\0';
        int width = -1, prec = -1;
        while (i < n && isdigit((unsigned char)p[i]))
            width = (width < 0 ? 0 : width) * 10 + (p[i++] - '0') % 1000000;
        if (i < n && p[i] == '.') {
            i++;
            prec = 0;
            while (i < n && isdigit((unsigned char)p[i]))
                prec = prec * 10 + (p[i++] - '0') % 1000000;
        }
        if (width > 100000 || prec > 100000) {
            rc = tpl_type_error(R, "format width or precision too large");
            break;
        }
        if (i >= n) {
            rc = tpl_type_error(R, "incomplete format");
            break;
        }
        char conv = p[i++];
        if (conv == '%') {
            rc = tpl_buf_put(R, &b, "%", 1);
            continue;
        }
        if (!have_arg) {
            if (ai >= nargs) {
                rc = tpl_type_error(R, "not enough arguments for format string");
                break;
            }
            arg = is_tuple ? tpl_as_list(args)->v[ai] : args;
            ai++;
        }
        switch (conv) {
        case 's':
        case 'r':
        case 'a': {
            fu_buf t = {0};
            rc = conv == 's' ? tpl_buf_str(R, &t, arg) : tpl_buf_repr(R, &t, arg);
            if (!rc) {
                size_t len = t.len, ncp = tpl_utf8_len(t.data ? t.data : "", t.len);
                if (prec >= 0 && (size_t)prec < ncp) {
                    len = tpl_utf8_offset(t.data, t.len, (size_t)prec);
                    ncp = (size_t)prec;
                }
                bool left = strchr(flags, '-') != NULL;
                size_t pad = width > 0 && (size_t)width > ncp ? (size_t)width - ncp : 0;
                for (size_t k = 0; k < pad && !left && !rc; k++)
                    rc = tpl_buf_put(R, &b, " ", 1);
                if (!rc)
                    rc = tpl_buf_put(R, &b, t.data ? t.data : "", len);
                for (size_t k = 0; k < pad && left && !rc; k++)
                    rc = tpl_buf_put(R, &b, " ", 1);
            }
            fu_buf_free(&t);
            break;
        }
        case 'd': case 'i': case 'x': case 'X': case 'o':
        case 'f': case 'F': case 'e': case 'E': case 'g': case 'G':
            rc = fmt_num(R, &b, flags, width, prec, conv, arg);
            break;
        case 'c':
            if (arg.kind == TPL_STR && tpl_utf8_len(S(arg), SL(arg)) == 1) {
                rc = tpl_buf_put(R, &b, S(arg), SL(arg));
            } else if (arg.kind == TPL_INT && arg.i >= 0 && arg.i <= 0x10FFFF) {
                char enc[8];
                rc = tpl_buf_put(R, &b, enc, tpl_utf8_put((int32_t)arg.i, enc));
            } else {
                rc = tpl_type_error(R, "%%c requires int or char");
            }
            break;
        default:
            rc = tpl_type_error(R, "unsupported format character '%c'", conv);
        }
    }
    /* Python treats any argument with __getitem__ (list, dict, Undefined) as a
     * mapping and then never complains about unused arguments. */
    bool mapping_like = is_map || (args.kind == TPL_LIST && !is_tuple) || args.kind == TPL_UNDEF;
    if (!rc && !used_map && !mapping_like && ai < nargs)
        rc = tpl_type_error(R, "not all arguments converted during string formatting");
    return ret_str(R, &b, rc, out);
}

/* str.format(*args, **kwargs) with {} {0} {name} {{ }} and no format specs. */
static int str_format(tpl_rt *R, tpl_val fmt, const tpl_args *a, tpl_val *out) {
    const char *p = S(fmt);
    size_t n = SL(fmt), auto_i = 0;
    fu_buf b = {0};
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
        rc = tpl_buf_str(R, &b, arg);
        i = j + 1;
    }
    return ret_str(R, &b, rc, out);
}

/* ------------------------------------------------------------------------ */
/* Methods of str, dict and list                                             */
/* ------------------------------------------------------------------------ */

enum { K_STR = 1, K_DICT = 2, K_LIST = 4 };

#define TPL_METHODS(X)                                                                                  \
    X(strip, K_STR) X(lstrip, K_STR) X(rstrip, K_STR) X(startswith, K_STR) X(endswith, K_STR)            \
    X(split, K_STR) X(rsplit, K_STR) X(splitlines, K_STR) X(upper, K_STR) X(lower, K_STR)              \
    X(title, K_STR) X(capitalize, K_STR) X(swapcase, K_STR) X(casefold, K_STR) X(replace, K_STR)       \
    X(find, K_STR) X(rfind, K_STR) X(index, K_STR | K_LIST) X(rindex, K_STR) X(count, K_STR | K_LIST)  \
    X(join, K_STR) X(format, K_STR) X(isdigit, K_STR) X(isnumeric, K_STR) X(isdecimal, K_STR)          \
    X(isalpha, K_STR) X(isalnum, K_STR) X(isspace, K_STR) X(isupper, K_STR) X(islower, K_STR)          \
    X(zfill, K_STR) X(center, K_STR) X(ljust, K_STR) X(rjust, K_STR) X(removeprefix, K_STR)            \
    X(removesuffix, K_STR) X(get, K_DICT) X(items, K_DICT) X(keys, K_DICT) X(values, K_DICT)           \
    X(copy, K_DICT | K_LIST)

enum {
#define M_ENUM(name, kinds) M_##name,
    TPL_METHODS(M_ENUM)
#undef M_ENUM
    M_COUNT_
};

static const struct {
    const char *name;
    int kinds;
} METHODS[] = {
#define M_ROW(name, kinds) {#name, kinds},
    TPL_METHODS(M_ROW)
#undef M_ROW
};

static int kind_bit(tpl_val v) {
    switch (v.kind) {
    case TPL_STR: return K_STR;
    case TPL_DICT: return K_DICT;
    case TPL_LIST: return K_LIST;
    default: return 0;
    }
}

int tpl_method_id(tpl_val obj, const char *name) {
    int k = kind_bit(obj);
    if (!k)
        return -1;
    for (int i = 0; i < M_COUNT_; i++)
        if ((METHODS[i].kinds & k) && !strcmp(METHODS[i].name, name))
            return TPL_FN_METHOD_BASE + i;
    return -1;
}

bool tpl_unsafe_method(tpl_val obj, const char *name) {
    static const char *const list_m[] = {"append", "clear", "pop", "reverse", "insert", "sort", "extend", "remove", NULL};
    static const char *const dict_m[] = {"clear", "pop", "popitem", "setdefault", "update", NULL};
    const char *const *m = obj.kind == TPL_LIST ? list_m : obj.kind == TPL_DICT ? dict_m : NULL;
    for (; m && *m; m++)
        if (!strcmp(*m, name))
            return true;
    return false;
}

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
        case 0: ok = k == UTF8PROC_CATEGORY_ND; break; /* isdigit/isdecimal (approx.) */
        case 1: ok = k >= UTF8PROC_CATEGORY_LU && k <= UTF8PROC_CATEGORY_LO; break;
        case 2: ok = (k >= UTF8PROC_CATEGORY_LU && k <= UTF8PROC_CATEGORY_LO) || k == UTF8PROC_CATEGORY_ND ||
                     k == UTF8PROC_CATEGORY_NL || k == UTF8PROC_CATEGORY_NO; break;
        case 3: ok = py_space(c); break;
        case 4: /* isupper: no lowercase, at least one cased */
            ok = k != UTF8PROC_CATEGORY_LL && k != UTF8PROC_CATEGORY_LT;
            any_cased |= k == UTF8PROC_CATEGORY_LU;
            break;
        case 5:
            ok = k != UTF8PROC_CATEGORY_LU && k != UTF8PROC_CATEGORY_LT;
            any_cased |= k == UTF8PROC_CATEGORY_LL;
            break;
        case 6: ok = k == UTF8PROC_CATEGORY_ND || k == UTF8PROC_CATEGORY_NL || k == UTF8PROC_CATEGORY_NO; break;
        }
        if (!ok)
            return false;
        i += adv;
    }
    return what == 4 || what == 5 ? any_cased : true;
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

static int dict_view(tpl_rt *R, tpl_val d, int which, tpl_val *out) {
    tpl_dict *dd = tpl_as_dict(d);
    int rc = new_list(R, out, false);
    for (size_t i = 0; i < dd->len && !rc; i++) {
        if (which == 0) {
            rc = push_ref(R, *out, dd->k[i]);
        } else if (which == 1) {
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
    if (rc && rc != FU_OK)
        tpl_drop(R, *out);
    return rc;
}

static int call_method(tpl_rt *R, int m, tpl_val self, const tpl_args *a, tpl_val *out) {
    const char *name = METHODS[m].name;
    tpl_val p[3];
    bool got[3];
    static const char *const P1[] = {"a", "b", "c"};
    if (m == M_format && self.kind == TPL_STR)
        return str_format(R, self, a, out);
    int rc = a->nkw && (m == M_split || m == M_rsplit) ? FU_OK : tpl_bind(R, name, a, P1, 3, p, got);
    if (rc)
        return rc;
    if (a->nkw && m != M_format && m != M_split && m != M_rsplit)
        return tpl_type_error(R, "%s() takes no keyword arguments", name);
    if ((m == M_split || m == M_rsplit) && a->nkw) {
        /* split(sep=None, maxsplit=-1) */
        static const char *const SP[] = {"sep", "maxsplit"};
        if ((rc = tpl_bind(R, name, a, SP, 2, p, got)))
            return rc;
        got[2] = false;
    }
    if (self.kind == TPL_STR) {
        if ((rc = tpl_rt_charge(R, SL(self) / 32)))
            return rc;
        int64_t k = 0;
        switch (m) {
        case M_strip:
        case M_lstrip:
        case M_rstrip: {
            const char *chars = NULL;
            size_t nc = 0;
            if (got[0] && p[0].kind != TPL_NONE) {
                if ((rc = need_str(R, p[0], "strip arg")))
                    return rc;
                chars = S(p[0]);
                nc = SL(p[0]);
            }
            return do_strip(R, self, chars, nc, m == M_strip ? 3 : m == M_lstrip ? 1 : 2, out);
        }
        case M_startswith:
        case M_endswith: {
            if (!got[0])
                return tpl_type_error(R, "%s() takes at least 1 argument (0 given)", name);
            tpl_list one = {.len = 1, .v = &p[0]};
            tpl_list *opts = &one;
            if (p[0].kind == TPL_LIST && tpl_as_list(p[0])->tuple)
                opts = tpl_as_list(p[0]);
            else if ((rc = need_str(R, p[0], "the prefix")))
                return tpl_type_error(R, "%s first arg must be str or a tuple of str, not %s", name,
                                      tpl_type_name(p[0]));
            bool res = false;
            for (size_t i = 0; i < opts->len && !res; i++) {
                tpl_val x = opts->v[i];
                if (x.kind != TPL_STR)
                    return tpl_type_error(R, "tuple for %s must only contain str, not %s", name, tpl_type_name(x));
                if (SL(x) <= SL(self))
                    res = m == M_startswith ? !memcmp(S(self), S(x), SL(x))
                                            : !memcmp(S(self) + SL(self) - SL(x), S(x), SL(x));
            }
            *out = tpl_bool(res);
            return FU_OK;
        }
        case M_split:
        case M_rsplit: {
            int64_t maxsplit = -1;
            tpl_val sep = got[0] ? p[0] : tpl_none();
            if (sep.kind != TPL_NONE && (rc = need_str(R, sep, "separator")))
                return rc;
            if (got[1] && (rc = need_int(R, p[1], "maxsplit", &maxsplit)))
                return rc;
            return do_split(R, self, sep, maxsplit, m == M_rsplit, out);
        }
        case M_splitlines:
            return do_splitlines(R, self, got[0] && tpl_truthy(p[0]), out);
        case M_upper: return map_case(R, S(self), SL(self), CASE_UPPER, out);
        case M_lower:
        case M_casefold: return map_case(R, S(self), SL(self), CASE_LOWER, out);
        case M_title: return map_case(R, S(self), SL(self), CASE_TITLE_PY, out);
        case M_capitalize: return map_case(R, S(self), SL(self), CASE_CAPITALIZE, out);
        case M_swapcase: return map_case(R, S(self), SL(self), CASE_SWAP, out);
        case M_replace: {
            int64_t count = -1;
            if (!got[0] || !got[1])
                return tpl_type_error(R, "replace() takes at least 2 arguments");
            if ((rc = need_str(R, p[0], "replace() argument 1")) || (rc = need_str(R, p[1], "replace() argument 2")))
                return rc;
            if (got[2] && (rc = need_int(R, p[2], "count", &count)))
                return rc;
            return do_replace(R, S(self), SL(self), S(p[0]), SL(p[0]), S(p[1]), SL(p[1]), count, out);
        }
        case M_find:
        case M_rfind:
        case M_index:
        case M_rindex:
        case M_count: {
            if (!got[0] || (rc = need_str(R, p[0], "substring")))
                return got[0] ? rc : tpl_type_error(R, "%s() takes at least 1 argument", name);
            if (got[1])
                return tpl_type_error(R, "%s() with start/end is not supported", name);
            if (m == M_count) {
                int64_t c = 0;
                if (SL(p[0]) == 0) {
                    c = (int64_t)tpl_utf8_len(S(self), SL(self)) + 1;
                } else {
                    for (const char *h = S(self), *e = S(self) + SL(self);
                         (h = memmem(h, (size_t)(e - h), S(p[0]), SL(p[0]))); h += SL(p[0]))
                        c++;
                }
                *out = tpl_int(c);
                return FU_OK;
            }
            k = str_find(self, p[0], m == M_rfind || m == M_rindex);
            if (k < 0 && (m == M_index || m == M_rindex))
                return tpl_type_error(R, "substring not found");
            *out = tpl_int(k);
            return FU_OK;
        }
        case M_join: {
            if (!got[0])
                return tpl_type_error(R, "join() takes exactly one argument (0 given)");
            tpl_val items;
            if ((rc = tpl_iter_list(R, p[0], &items)))
                return rc;
            tpl_list *l = tpl_as_list(items);
            fu_buf b = {0};
            for (size_t i = 0; i < l->len && !rc; i++) {
                if (l->v[i].kind != TPL_STR) {
                    rc = tpl_type_error(R, "sequence item %zu: expected str instance, %s found", i,
                                        tpl_type_name(l->v[i]));
                    break;
                }
                if (i)
                    rc = tpl_buf_put(R, &b, S(self), SL(self));
                if (!rc)
                    rc = tpl_buf_put(R, &b, S(l->v[i]), SL(l->v[i]));
            }
            tpl_drop(R, items);
            return ret_str(R, &b, rc, out);
        }
        case M_format:
            return str_format(R, self, a, out);
        case M_isdigit:
        case M_isdecimal: *out = tpl_bool(all_cps(self, 0)); return FU_OK;
        case M_isnumeric: *out = tpl_bool(all_cps(self, 6)); return FU_OK;
        case M_isalpha: *out = tpl_bool(all_cps(self, 1)); return FU_OK;
        case M_isalnum: *out = tpl_bool(all_cps(self, 2)); return FU_OK;
        case M_isspace: *out = tpl_bool(all_cps(self, 3)); return FU_OK;
        case M_isupper: *out = tpl_bool(all_cps(self, 4)); return FU_OK;
        case M_islower: *out = tpl_bool(all_cps(self, 5)); return FU_OK;
        case M_zfill: {
            if (!got[0] || (rc = need_int(R, p[0], "width", &k)))
                return got[0] ? rc : tpl_type_error(R, "zfill() takes exactly one argument");
            size_t ncp = tpl_utf8_len(S(self), SL(self));
            if (k <= (int64_t)ncp) {
                tpl_ref(self);
                *out = self;
                return FU_OK;
            }
            if (k > (int64_t)R->lim.max_memory)
                return tpl_rt_fail(R, FU_ERR_EXHAUSTED, "template exceeded its memory limit");
            fu_buf b = {0};
            size_t sign = SL(self) && (S(self)[0] == '+' || S(self)[0] == '-');
            rc = tpl_buf_put(R, &b, S(self), sign);
            for (int64_t i = 0; i < k - (int64_t)ncp && !rc; i++)
                rc = tpl_buf_put(R, &b, "0", 1);
            if (!rc)
                rc = tpl_buf_put(R, &b, S(self) + sign, SL(self) - sign);
            return ret_str(R, &b, rc, out);
        }
        case M_center:
        case M_ljust:
        case M_rjust: {
            if (!got[0] || (rc = need_int(R, p[0], "width", &k)))
                return got[0] ? rc : tpl_type_error(R, "%s() takes at least 1 argument", name);
            const char *fill = " ";
            size_t fl = 1;
            if (got[1]) {
                if ((rc = need_str(R, p[1], "fill character")))
                    return rc;
                fill = S(p[1]);
                fl = SL(p[1]);
            }
            return do_pad(R, self, k, m == M_center ? '^' : m == M_ljust ? '<' : '>', fill, fl, out);
        }
        case M_removeprefix:
        case M_removesuffix: {
            if (!got[0] || (rc = need_str(R, p[0], "argument")))
                return got[0] ? rc : tpl_type_error(R, "%s() takes exactly one argument", name);
            size_t l = SL(p[0]);
            if (l <= SL(self) && (m == M_removeprefix ? !memcmp(S(self), S(p[0]), l)
                                                      : !memcmp(S(self) + SL(self) - l, S(p[0]), l)))
                return tpl_str_new(R, S(self) + (m == M_removeprefix ? l : 0), SL(self) - l, out);
            tpl_ref(self);
            *out = self;
            return FU_OK;
        }
        default:
            break;
        }
    } else if (self.kind == TPL_DICT) {
        switch (m) {
        case M_get: {
            if (!got[0])
                return tpl_type_error(R, "get expected at least 1 argument, got 0");
            tpl_val *v = tpl_dict_get(self, p[0]);
            *out = v ? *v : (got[1] ? p[1] : tpl_none());
            tpl_ref(*out);
            return FU_OK;
        }
        case M_keys: return dict_view(R, self, 0, out);
        case M_values: return dict_view(R, self, 1, out);
        case M_items: return dict_view(R, self, 2, out);
        case M_copy: {
            tpl_dict *d = tpl_as_dict(self);
            if ((rc = tpl_dict_new(R, d->len, out)))
                return rc;
            for (size_t i = 0; i < d->len && !rc; i++) {
                tpl_ref(d->k[i]);
                tpl_ref(d->v[i]);
                rc = tpl_dict_set(R, *out, d->k[i], d->v[i]);
            }
            if (rc)
                tpl_drop(R, *out);
            return rc;
        }
        default:
            break;
        }
    } else if (self.kind == TPL_LIST) {
        tpl_list *l = tpl_as_list(self);
        switch (m) {
        case M_count:
        case M_index: {
            if (!got[0])
                return tpl_type_error(R, "%s() takes exactly one argument (0 given)", name);
            int64_t c = 0, first = -1;
            for (size_t i = 0; i < l->len; i++)
                if (tpl_equal(l->v[i], p[0])) {
                    c++;
                    if (first < 0)
                        first = (int64_t)i;
                }
            if (m == M_index && first < 0)
                return tpl_type_error(R, "value is not in list");
            *out = tpl_int(m == M_count ? c : first);
            return FU_OK;
        }
        case M_copy: {
            if ((rc = new_list(R, out, false)))
                return rc;
            tpl_as_list(*out)->tuple = l->tuple;
            for (size_t i = 0; i < l->len && !rc; i++)
                rc = push_ref(R, *out, l->v[i]);
            if (rc)
                tpl_drop(R, *out);
            return rc;
        }
        default:
            break;
        }
    }
    return tpl_type_error(R, "'%s' object has no method '%s'", tpl_type_name(self), name);
}

/* ------------------------------------------------------------------------ */
/* Filters                                                                   */
/* ------------------------------------------------------------------------ */

#define TPL_FILTERS(X)                                                                                     \
    X(abs) X(attr) X(batch) X(capitalize) X(center) X(count) X(d) X(default) X(dictsort) X(e) X(escape) X(first)   \
    X(float) X(forceescape) X(format) X(indent) X(int) X(items) X(join) X(last) X(length) X(list)        \
    X(lower) X(map) X(max) X(min) X(reject) X(rejectattr) X(replace) X(reverse) X(round) X(safe)         \
    X(select) X(selectattr) X(slice) X(sort) X(string) X(sum) X(title) X(tojson) X(trim) X(truncate) X(unique)    \
    X(upper) X(wordcount)

enum {
#define F_ENUM(name) F_##name,
    TPL_FILTERS(F_ENUM)
#undef F_ENUM
    F_COUNT_
};

static const char *const FILTER_NAMES[] = {
#define F_NAME(name) #name,
    TPL_FILTERS(F_NAME)
#undef F_NAME
};

bool tpl_is_jinja2_filter(const char *name) {
    static const char *const names[] = {"filesizeformat", "groupby", "pprint", "random", "striptags",
                                        "urlencode", "urlize", "wordwrap", "xmlattr", NULL};
    for (int i = 0; names[i]; i++)
        if (!strcmp(names[i], name))
            return true;
    return false;
}

int tpl_filter_id(const char *name) {
    for (int i = 0; i < F_COUNT_; i++)
        if (!strcmp(FILTER_NAMES[i], name))
            return i;
    return -1;
}

/* Python float(str): surrounding whitespace allowed, whole string consumed. */
static bool parse_float(const char *s, size_t n, double *out) {
    char buf[128];
    while (n && isspace((unsigned char)*s)) {
        s++;
        n--;
    }
    while (n && isspace((unsigned char)s[n - 1]))
        n--;
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

static bool parse_int(const char *s, size_t n, int base, int64_t *out) {
    char buf[128];
    while (n && isspace((unsigned char)*s)) {
        s++;
        n--;
    }
    while (n && isspace((unsigned char)s[n - 1]))
        n--;
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

static int html_escape(tpl_rt *R, tpl_val v, tpl_val *out) {
    tpl_val s;
    int rc = tpl_to_str(R, v, &s);
    if (rc)
        return rc;
    fu_buf b = {0};
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
        rc = rep ? tpl_buf_put(R, &b, rep, strlen(rep)) : tpl_buf_put(R, &b, p + i, 1);
    }
    tpl_drop(R, s);
    return ret_str(R, &b, rc, out);
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

static int filter_seq_test(tpl_rt *R, tpl_val in, const tpl_args *a, bool select, bool by_attr, tpl_val *out);

static int filter_map(tpl_rt *R, tpl_val in, const tpl_args *a, tpl_val *out) {
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
        tpl_drop(R, *out);
    return rc;
}

static int filter_seq_test(tpl_rt *R, tpl_val in, const tpl_args *a, bool select, bool by_attr, tpl_val *out) {
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
        if (by_attr)
            rc = attr_get(R, l->v[i], a->pos[0], &v);
        else {
            v = l->v[i];
            tpl_ref(v);
        }
        if (rc)
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
        tpl_drop(R, *out);
    return rc;
}

/* Filters that accept Undefined input (they see it as "" or an empty sequence). */
static bool filter_takes_undefined(int id) {
    switch (id) {
    case F_batch: case F_slice:
    case F_capitalize: case F_center: case F_count: case F_d: case F_default: case F_e: case F_escape:
    case F_first: case F_forceescape: case F_format: case F_items: case F_join: case F_last: case F_length:
    case F_list: case F_lower: case F_map: case F_max: case F_min: case F_reject: case F_rejectattr:
    case F_replace: case F_reverse: case F_safe: case F_select: case F_selectattr: case F_sort:
    case F_string: case F_sum: case F_title: case F_trim: case F_truncate: case F_unique: case F_upper:
    case F_wordcount: case F_tojson:
        return true;
    default:
        return false;
    }
}

int tpl_apply_filter(tpl_rt *R, int id, const char *name, tpl_val in, const tpl_args *a, tpl_val *out) {
    if (id < 0 && tpl_filter_id(name) < 0 && !tpl_is_jinja2_filter(name))
        return tpl_type_error(R, "No filter named '%s'.", name);
    if (id < 0)
        return tpl_type_error(R, "the jinja2 filter '%s' is not supported", name);
    if (in.kind == TPL_UNDEF && !filter_takes_undefined(id))
        return tpl_undef_fail(R, in);
    tpl_val p[6];
    bool got[6];
    int rc;
    tpl_val s = tpl_undef();
#define BIND(...)                                                                                   \
    do {                                                                                            \
        static const char *const PN_[] = {__VA_ARGS__};                                             \
        if ((rc = tpl_bind(R, name, a, PN_, sizeof PN_ / sizeof PN_[0], p, got)))                   \
            return rc;                                                                              \
    } while (0)
#define ARG(i, dflt) (got[i] ? p[i] : (dflt))
    switch (id) {
    case F_abs:
        BIND("x");
        if (in.kind == TPL_FLOAT)
            *out = tpl_float(fabs(in.f));
        else if (in.kind == TPL_INT || in.kind == TPL_BOOL) {
            if (in.i == INT64_MIN)
                return tpl_type_error(R, "integer overflow");
            *out = tpl_int(in.i < 0 ? -in.i : in.i);
        } else
            return tpl_type_error(R, "bad operand type for abs(): '%s'", tpl_type_name(in));
        return FU_OK;
    case F_attr:
        BIND("name");
        if (!got[0] || p[0].kind != TPL_STR)
            return tpl_type_error(R, "attr() needs an attribute name");
        /* Python getattr only: no fallback to dict items. */
        if (in.kind == TPL_NS || in.kind == TPL_LOOP || tpl_method_id(in, S(p[0])) >= 0 ||
            tpl_unsafe_method(in, S(p[0])))
            return tpl_getattr(R, in, S(p[0]), SL(p[0]), out);
        return tpl_undef_hint(R, out, "'%s object' has no attribute '%s'", tpl_type_name(in), S(p[0]));
    case F_batch:
    case F_slice: {
        /* batch(n, fill_with): rows of n items; slice(n, fill_with): n columns. */
        if (id == F_batch)
            BIND("linecount", "fill_with");
        else
            BIND("slices", "fill_with");
        int64_t cnt = 0;
        if (!got[0])
            return tpl_type_error(R, "%s() missing required argument", name);
        if ((rc = need_int(R, p[0], "count", &cnt)))
            return rc;
        if (cnt <= 0)
            return tpl_type_error(R, "%s count must be positive", name);
        tpl_val items;
        if ((rc = tpl_iter_list(R, in, &items)))
            return rc;
        tpl_list *l = tpl_as_list(items);
        size_t n = l->len, rows, per = 0, extra = 0;
        if (id == F_batch) {
            rows = (n + (size_t)cnt - 1) / (size_t)cnt;
        } else {
            rows = (size_t)cnt;
            per = n / rows;
            extra = n % rows;
        }
        if ((rc = new_list(R, out, true))) {
            tpl_drop(R, items);
            return rc;
        }
        size_t pos = 0;
        for (size_t r = 0; r < rows && !rc; r++) {
            size_t take = id == F_batch ? (n - pos < (size_t)cnt ? n - pos : (size_t)cnt) : per + (r < extra);
            bool fill = got[1] && p[1].kind != TPL_NONE;
            /* jinja2 pads a short last batch to n; slice appends one filler to
             * every slice without an extra item. */
            size_t width = id == F_batch ? (size_t)cnt : take + (r >= extra ? 1 : 0);
            tpl_val row;
            if ((rc = new_list(R, &row, false)))
                break;
            for (size_t k = 0; k < take && !rc; k++)
                rc = push_ref(R, row, l->v[pos + k]);
            pos += take;
            for (size_t k = take; k < width && fill && !rc; k++)
                rc = push_ref(R, row, p[1]);
            if (rc)
                tpl_drop(R, row);
            else
                rc = tpl_list_push(R, *out, row);
        }
        tpl_drop(R, items);
        if (rc)
            tpl_drop(R, *out);
        return rc;
    }
    case F_capitalize:
    case F_lower:
    case F_upper:
    case F_title:
        BIND("x");
        if ((rc = tpl_to_str(R, in, &s)))
            return rc;
        rc = map_case(R, S(s), SL(s),
                      id == F_capitalize ? CASE_CAPITALIZE : id == F_lower ? CASE_LOWER
                      : id == F_upper ? CASE_UPPER : CASE_TITLE_JINJA, out);
        tpl_drop(R, s);
        return rc;
    case F_center: {
        BIND("width");
        int64_t w = 80;
        if (got[0] && (rc = need_int(R, p[0], "width", &w)))
            return rc;
        if ((rc = tpl_to_str(R, in, &s)))
            return rc;
        rc = do_pad(R, s, w, '^', " ", 1, out);
        tpl_drop(R, s);
        return rc;
    }
    case F_count:
    case F_length:
        BIND("x");
        switch (in.kind) {
        case TPL_UNDEF: *out = tpl_int(0); return FU_OK;
        case TPL_STR: *out = tpl_int((int64_t)tpl_utf8_len(S(in), SL(in))); return FU_OK;
        case TPL_LIST:
            if (tpl_as_list(in)->gen)
                break;
            *out = tpl_int((int64_t)tpl_as_list(in)->len);
            return FU_OK;
        case TPL_DICT: *out = tpl_int((int64_t)tpl_as_dict(in)->len); return FU_OK;
        default: break;
        }
        return tpl_type_error(R, "object of type '%s' has no len()", tpl_type_name(in));
    case F_d:
    case F_default:
        BIND("default_value", "boolean");
        if (in.kind == TPL_UNDEF || (got[1] && tpl_truthy(p[1]) && !tpl_truthy(in))) {
            if (got[0])
                *out = p[0];
            else
                return tpl_str_new(R, "", 0, out);
        } else {
            *out = in;
        }
        tpl_ref(*out);
        return FU_OK;
    case F_dictsort: {
        BIND("case_sensitive", "by", "reverse");
        if (in.kind != TPL_DICT)
            return tpl_type_error(R, "dictsort expects a mapping, not %s", tpl_type_name(in));
        bool by_value = false;
        if (got[1]) {
            if (p[1].kind != TPL_STR || (strcmp(S(p[1]), "key") && strcmp(S(p[1]), "value")))
                return tpl_type_error(R, "You can only sort by either \"key\" or \"value\"");
            by_value = !strcmp(S(p[1]), "value");
        }
        tpl_val items;
        if ((rc = dict_view(R, in, 2, &items)))
            return rc;
        tpl_val idx = tpl_int(by_value ? 1 : 0);
        rc = sorted_list(R, items, idx, got[0] && tpl_truthy(p[0]), got[2] && tpl_truthy(p[2]), out);
        tpl_drop(R, items);
        return rc;
    }
    case F_e:
    case F_escape:
    case F_forceescape:
        BIND("x");
        return html_escape(R, in, out);
    case F_first:
    case F_last: {
        BIND("x");
        if (id == F_last && in.kind == TPL_LIST && tpl_as_list(in)->gen)
            return tpl_type_error(R, "'generator' object is not reversible");
        tpl_val items;
        if ((rc = tpl_iter_list(R, in, &items)))
            return rc;
        tpl_list *l = tpl_as_list(items);
        if (l->len == 0)
            rc = tpl_undef_hint(R, out, "No %s item, sequence was empty.", id == F_first ? "first" : "last");
        else {
            *out = l->v[id == F_first ? 0 : l->len - 1];
            tpl_ref(*out);
        }
        tpl_drop(R, items);
        return rc;
    }
    case F_float: {
        BIND("default");
        double f;
        if (in.kind == TPL_FLOAT) {
            *out = in;
        } else if (in.kind == TPL_INT || in.kind == TPL_BOOL) {
            *out = tpl_float((double)in.i);
        } else if (in.kind == TPL_STR && parse_float(S(in), SL(in), &f)) {
            *out = tpl_float(f);
        } else {
            *out = ARG(0, tpl_float(0.0));
            tpl_ref(*out);
        }
        return FU_OK;
    }
    case F_format: {
        if (a->npos && a->nkw)
            return tpl_type_error(R, "can't handle positional and keyword arguments at the same time");
        tpl_val args;
        if (a->nkw) {
            if ((rc = tpl_dict_new(R, a->nkw, &args)))
                return rc;
            for (size_t k = 0; k < a->nkw && !rc; k++) {
                tpl_ref(a->kw[k]);
                rc = tpl_dict_set_cstr(R, args, a->kwnames[k], a->kw[k]);
            }
        } else {
            if ((rc = tpl_list_new(R, a->npos, &args)))
                return rc;
            tpl_as_list(args)->tuple = true;
            for (size_t k = 0; k < a->npos && !rc; k++)
                rc = push_ref(R, args, a->pos[k]);
        }
        if (!rc && !(rc = tpl_to_str(R, in, &s)))
            rc = tpl_format_percent(R, s, args, out);
        tpl_drop(R, s);
        tpl_drop(R, args);
        return rc;
    }
    case F_indent: {
        BIND("width", "first", "blank");
        tpl_val w = ARG(0, tpl_int(4));
        fu_buf ind = {0};
        if (w.kind == TPL_STR) {
            rc = tpl_buf_put(R, &ind, S(w), SL(w));
        } else if (w.kind == TPL_INT || w.kind == TPL_BOOL) {
            if (w.i > 100000)
                return tpl_type_error(R, "indent width too large");
            for (int64_t i = 0; i < w.i && !rc; i++)
                rc = tpl_buf_put(R, &ind, " ", 1);
        } else {
            return tpl_type_error(R, "can't multiply sequence by non-int of type '%s'", tpl_type_name(w));
        }
        bool first = got[1] && tpl_truthy(p[1]), blank = got[2] && tpl_truthy(p[2]);
        if (!rc && in.kind != TPL_STR) /* jinja2 does s += "\n" */
            rc = tpl_type_error(R, "unsupported operand type(s) for +=: '%s' and 'str'", tpl_type_name(in));
        if (rc || (rc = tpl_to_str(R, in, &s))) {
            fu_buf_free(&ind);
            return rc;
        }
        /* s + "\n", splitlines, then join with "\n" + indent on non-blank lines. */
        tpl_val withnl, lines;
        rc = tpl_str_cat(R, S(s), SL(s), "\n", 1, &withnl);
        tpl_drop(R, s);
        if (!rc) {
            rc = do_splitlines(R, withnl, false, &lines);
            tpl_drop(R, withnl);
        }
        if (rc) {
            fu_buf_free(&ind);
            return rc;
        }
        tpl_list *l = tpl_as_list(lines);
        fu_buf b = {0};
        const char *ip = ind.data ? ind.data : "";
        if (first)
            rc = tpl_buf_put(R, &b, ip, ind.len);
        for (size_t i = 0; i < l->len && !rc; i++) {
            if (i)
                rc = tpl_buf_put(R, &b, "\n", 1);
            if (!rc && i && (blank || SL(l->v[i]) > 0))
                rc = tpl_buf_put(R, &b, ip, ind.len);
            if (!rc)
                rc = tpl_buf_put(R, &b, S(l->v[i]), SL(l->v[i]));
        }
        tpl_drop(R, lines);
        fu_buf_free(&ind);
        return ret_str(R, &b, rc, out);
    }
    case F_int: {
        BIND("default", "base");
        int64_t base = 10, v;
        double f;
        if (got[1] && (rc = need_int(R, p[1], "base", &base)))
            return rc;
        if (in.kind == TPL_INT || in.kind == TPL_BOOL) {
            *out = tpl_int(in.i);
            return FU_OK;
        }
        if (in.kind == TPL_FLOAT && isfinite(in.f) && fabs(in.f) < 9.2e18) {
            *out = tpl_int((int64_t)in.f);
            return FU_OK;
        }
        if (in.kind == TPL_STR) {
            if (parse_int(S(in), SL(in), (int)base, &v)) {
                *out = tpl_int(v);
                return FU_OK;
            }
            if (parse_float(S(in), SL(in), &f) && isfinite(f) && fabs(f) < 9.2e18) {
                *out = tpl_int((int64_t)f);
                return FU_OK;
            }
        }
        *out = ARG(0, tpl_int(0));
        tpl_ref(*out);
        return FU_OK;
    }
    case F_items:
        BIND("x");
        if (in.kind == TPL_UNDEF)
            return new_list(R, out, true);
        if (in.kind != TPL_DICT)
            return tpl_type_error(R, "Can only get item pairs from a mapping.");
        if ((rc = dict_view(R, in, 2, out)))
            return rc;
        tpl_as_list(*out)->gen = true;
        return FU_OK;
    case F_join: {
        BIND("d", "attribute");
        tpl_val sep = ARG(0, tpl_undef());
        tpl_val items;
        if ((rc = tpl_iter_list(R, in, &items)))
            return rc;
        tpl_list *l = tpl_as_list(items);
        fu_buf b = {0};
        for (size_t i = 0; i < l->len && !rc; i++) {
            if (i)
                rc = tpl_buf_str(R, &b, sep);
            if (rc)
                break;
            if (got[1] && p[1].kind != TPL_NONE) {
                tpl_val v;
                if (!(rc = attr_get(R, l->v[i], p[1], &v))) {
                    rc = tpl_buf_str(R, &b, v);
                    tpl_drop(R, v);
                }
            } else {
                rc = tpl_buf_str(R, &b, l->v[i]);
            }
        }
        tpl_drop(R, items);
        return ret_str(R, &b, rc, out);
    }
    case F_list: {
        BIND("x");
        tpl_val items;
        if ((rc = tpl_iter_list(R, in, &items)))
            return rc;
        tpl_list *l = tpl_as_list(items);
        if (!l->tuple && !l->gen && items.o != in.o) {
            *out = items;
            return FU_OK;
        }
        if (!(rc = new_list(R, out, false)))
            for (size_t i = 0; i < l->len && !rc; i++)
                rc = push_ref(R, *out, l->v[i]);
        tpl_drop(R, items);
        if (rc)
            tpl_drop(R, *out);
        return rc;
    }
    case F_map:
        return filter_map(R, in, a, out);
    case F_max:
    case F_min: {
        BIND("case_sensitive", "attribute");
        tpl_val sorted;
        if ((rc = sorted_list(R, in, ARG(1, tpl_undef()), got[0] && tpl_truthy(p[0]), false, &sorted)))
            return rc;
        tpl_list *l = tpl_as_list(sorted);
        if (l->len == 0) {
            rc = tpl_undef_hint(R, out, "No aggregated item, sequence was empty.");
        } else {
            /* min: first of the stable sort; max: Python max keeps the first maximal item. */
            size_t k = 0;
            if (id == F_max) {
                k = l->len - 1;
                tpl_val kk, kp;
                while (k > 0 && !rc) {
                    if ((rc = sort_key(R, l->v[k], ARG(1, tpl_undef()), got[0] && tpl_truthy(p[0]), &kk)))
                        break;
                    if ((rc = sort_key(R, l->v[k - 1], ARG(1, tpl_undef()), got[0] && tpl_truthy(p[0]), &kp))) {
                        tpl_drop(R, kk);
                        break;
                    }
                    bool eq = tpl_equal(kk, kp);
                    tpl_drop(R, kk);
                    tpl_drop(R, kp);
                    if (!eq)
                        break;
                    k--;
                }
            }
            if (!rc) {
                *out = l->v[k];
                tpl_ref(*out);
            }
        }
        tpl_drop(R, sorted);
        return rc;
    }
    case F_reject:
    case F_select:
        return filter_seq_test(R, in, a, id == F_select, false, out);
    case F_rejectattr:
    case F_selectattr:
        return filter_seq_test(R, in, a, id == F_selectattr, true, out);
    case F_replace: {
        BIND("old", "new", "count");
        int64_t count = -1;
        tpl_val o, nw;
        if (!got[0] || !got[1])
            return tpl_type_error(R, "replace() needs old and new");
        if (got[2] && p[2].kind != TPL_NONE && (rc = need_int(R, p[2], "count", &count)))
            return rc;
        if ((rc = tpl_to_str(R, in, &s)))
            return rc;
        if ((rc = tpl_to_str(R, p[0], &o))) {
            tpl_drop(R, s);
            return rc;
        }
        if ((rc = tpl_to_str(R, p[1], &nw))) {
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
    case F_reverse: {
        BIND("x");
        if (in.kind == TPL_STR) {
            fu_buf b = {0};
            const char *q = S(in);
            size_t end = SL(in);
            rc = FU_OK;
            while (end > 0 && !rc) {
                size_t st = prev_cp(q, end);
                rc = tpl_buf_put(R, &b, q + st, end - st);
                end = st;
            }
            return ret_str(R, &b, rc, out);
        }
        tpl_val items;
        if ((rc = tpl_iter_list(R, in, &items)))
            return rc;
        tpl_list *l = tpl_as_list(items);
        if (!(rc = new_list(R, out, true)))
            for (size_t i = l->len; i-- > 0 && !rc;)
                rc = push_ref(R, *out, l->v[i]);
        tpl_drop(R, items);
        if (rc)
            tpl_drop(R, *out);
        return rc;
    }
    case F_round: {
        BIND("precision", "method");
        int64_t prec = 0;
        if (got[0] && (rc = need_int(R, p[0], "precision", &prec)))
            return rc;
        const char *method = "common";
        if (got[1]) {
            if (p[1].kind != TPL_STR)
                return tpl_type_error(R, "method must be common, ceil or floor");
            method = S(p[1]);
        }
        if (strcmp(method, "common") && strcmp(method, "ceil") && strcmp(method, "floor"))
            return tpl_type_error(R, "method must be common, ceil or floor");
        if (!tpl_is_num(in))
            return tpl_type_error(R, "type %s doesn't define __round__ method", tpl_type_name(in));
        if (!strcmp(method, "common")) {
            if (in.kind != TPL_FLOAT) {
                /* round(int, n) stays an int (rounds to tens etc. for n < 0) */
                int64_t v = in.i;
                if (prec < 0 && prec > -19) {
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
                    v = q * p10;
                } else if (prec <= -19) {
                    v = 0;
                }
                *out = tpl_int(v);
                return FU_OK;
            }
            *out = tpl_float(py_round(in.f, prec));
            return FU_OK;
        }
        double x = in.kind == TPL_FLOAT ? in.f : (double)in.i, p10 = pow(10.0, (double)prec);
        double r = !strcmp(method, "ceil") ? ceil(x * p10) : floor(x * p10);
        *out = tpl_float(r / p10);
        return FU_OK;
    }
    case F_safe:
    case F_string:
        BIND("x");
        return tpl_to_str(R, in, out);
    case F_sort: {
        BIND("reverse", "case_sensitive", "attribute");
        return sorted_list(R, in, ARG(2, tpl_undef()), got[1] && tpl_truthy(p[1]), got[0] && tpl_truthy(p[0]), out);
    }
    case F_sum: {
        BIND("attribute", "start");
        tpl_val acc = ARG(1, tpl_int(0)), items;
        tpl_ref(acc);
        if ((rc = tpl_iter_list(R, in, &items))) {
            tpl_drop(R, acc);
            return rc;
        }
        tpl_list *l = tpl_as_list(items);
        for (size_t i = 0; i < l->len && !rc; i++) {
            tpl_val v, nacc;
            if (got[0] && p[0].kind != TPL_NONE)
                rc = attr_get(R, l->v[i], p[0], &v);
            else {
                v = l->v[i];
                tpl_ref(v);
            }
            if (rc)
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
    case F_tojson: {
        BIND("ensure_ascii", "indent", "separators", "sort_keys");
        if (in.kind == TPL_LIST && tpl_as_list(in)->gen)
            return tpl_type_error(R, "Object of type generator is not JSON serializable");
        tpl_json_opts o = {.item_sep = ", ", .item_sep_len = 2, .key_sep = ": ", .key_sep_len = 2};
        o.ensure_ascii = got[0] && tpl_truthy(p[0]);
        o.sort_keys = got[3] && tpl_truthy(p[3]);
        char spaces[257];
        if (got[1] && p[1].kind != TPL_NONE) {
            if (p[1].kind == TPL_STR) {
                o.indent = S(p[1]);
                o.indent_len = SL(p[1]);
            } else if (p[1].kind == TPL_INT || p[1].kind == TPL_BOOL) {
                int64_t w = p[1].i < 0 ? 0 : p[1].i > 256 ? 256 : p[1].i;
                memset(spaces, ' ', (size_t)w);
                spaces[w] = '\0';
                o.indent = spaces;
                o.indent_len = (size_t)w;
            } else {
                return tpl_type_error(R, "indent must be an int or a string");
            }
            o.item_sep = ",";
            o.item_sep_len = 1;
        }
        if (got[2] && p[2].kind != TPL_NONE) {
            if (p[2].kind != TPL_LIST || tpl_as_list(p[2])->len != 2 || tpl_as_list(p[2])->v[0].kind != TPL_STR ||
                tpl_as_list(p[2])->v[1].kind != TPL_STR)
                return tpl_type_error(R, "separators must be a pair of strings");
            o.item_sep = S(tpl_as_list(p[2])->v[0]);
            o.item_sep_len = SL(tpl_as_list(p[2])->v[0]);
            o.key_sep = S(tpl_as_list(p[2])->v[1]);
            o.key_sep_len = SL(tpl_as_list(p[2])->v[1]);
        }
        fu_buf b = {0};
        rc = tpl_buf_json(R, &b, in, &o, 0);
        return ret_str(R, &b, rc, out);
    }
    case F_trim: {
        BIND("chars");
        if ((rc = tpl_to_str(R, in, &s)))
            return rc;
        tpl_val ch = ARG(0, tpl_none());
        if (ch.kind != TPL_NONE && ch.kind != TPL_STR) {
            tpl_drop(R, s);
            return tpl_type_error(R, "strip arg must be None or str");
        }
        rc = do_strip(R, s, ch.kind == TPL_STR ? S(ch) : NULL, ch.kind == TPL_STR ? SL(ch) : 0, 3, out);
        tpl_drop(R, s);
        return rc;
    }
    case F_truncate: {
        BIND("length", "killwords", "end", "leeway");
        int64_t length = 255, leeway = 5;
        if (got[0] && (rc = need_int(R, p[0], "length", &length)))
            return rc;
        if (got[3] && p[3].kind != TPL_NONE && (rc = need_int(R, p[3], "leeway", &leeway)))
            return rc;
        tpl_val end = ARG(2, tpl_undef());
        const char *ep = end.kind == TPL_STR ? S(end) : "...";
        size_t el = end.kind == TPL_STR ? SL(end) : 3;
        size_t ecp = tpl_utf8_len(ep, el);
        if (length < (int64_t)ecp)
            return tpl_type_error(R, "expected length >= %zu, got %lld", ecp, (long long)length);
        if (leeway < 0)
            return tpl_type_error(R, "expected leeway >= 0, got %lld", (long long)leeway);
        if (in.kind != TPL_STR && in.kind != TPL_UNDEF) {
            /* jinja2 measures len(s) first and returns short sequences unchanged. */
            int64_t n = in.kind == TPL_LIST && !tpl_as_list(in)->gen ? (int64_t)tpl_as_list(in)->len
                        : in.kind == TPL_DICT ? (int64_t)tpl_as_dict(in)->len : -1;
            if (n < 0)
                return tpl_type_error(R, "object of type '%s' has no len()", tpl_type_name(in));
            if (n > length + leeway)
                return tpl_type_error(R, "'%s' object has no attribute 'rsplit'", tpl_type_name(in));
            tpl_ref(in);
            *out = in;
            return FU_OK;
        }
        if ((rc = tpl_to_str(R, in, &s)))
            return rc;
        size_t ncp = tpl_utf8_len(S(s), SL(s));
        if ((int64_t)ncp <= length + leeway) {
            *out = s;
            return FU_OK;
        }
        size_t cut = tpl_utf8_offset(S(s), SL(s), (size_t)(length - (int64_t)ecp));
        if (!(got[1] && tpl_truthy(p[1]))) {
            /* s[:length - len(end)].rsplit(" ", 1)[0] */
            size_t k = cut;
            while (k > 0 && S(s)[k - 1] != ' ')
                k--;
            if (k > 0)
                cut = k - 1;
        }
        rc = tpl_str_cat(R, S(s), cut, ep, el, out);
        tpl_drop(R, s);
        return rc;
    }
    case F_unique: {
        BIND("case_sensitive", "attribute");
        tpl_val items;
        if ((rc = tpl_iter_list(R, in, &items)))
            return rc;
        tpl_val seen;
        if ((rc = new_list(R, &seen, false))) {
            tpl_drop(R, items);
            return rc;
        }
        if ((rc = new_list(R, out, true))) {
            tpl_drop(R, items);
            tpl_drop(R, seen);
            return rc;
        }
        tpl_list *l = tpl_as_list(items);
        for (size_t i = 0; i < l->len && !rc; i++) {
            tpl_val key;
            if ((rc = sort_key(R, l->v[i], ARG(1, tpl_undef()), got[0] && tpl_truthy(p[0]), &key)))
                break;
            bool dup = false;
            tpl_list *sl = tpl_as_list(seen);
            for (size_t j = 0; j < sl->len && !dup; j++)
                dup = tpl_equal(sl->v[j], key);
            if ((rc = tpl_rt_charge(R, sl->len / 8)))
                tpl_drop(R, key);
            else if (dup)
                tpl_drop(R, key);
            else if (!(rc = tpl_list_push(R, seen, key)))
                rc = push_ref(R, *out, l->v[i]);
        }
        tpl_drop(R, items);
        tpl_drop(R, seen);
        if (rc)
            tpl_drop(R, *out);
        return rc;
    }
    case F_wordcount: {
        BIND("x");
        if ((rc = tpl_to_str(R, in, &s)))
            return rc;
        /* len(re.findall(r"\w+", s)) */
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
        tpl_drop(R, s);
        *out = tpl_int(c);
        return FU_OK;
    }
    }
#undef BIND
#undef ARG
    return tpl_type_error(R, "No filter named '%s'.", name);
}

/* ------------------------------------------------------------------------ */
/* Tests                                                                     */
/* ------------------------------------------------------------------------ */

#define TPL_TESTS(X)                                                                                    \
    X(boolean) X(callable) X(defined) X(divisibleby) X(eq) X(equalto) X(escaped) X(even) X(false)      \
    X(filter) X(float) X(ge) X(gt) X(greaterthan) X(in) X(integer) X(iterable) X(le) X(lessthan)      \
    X(lower) X(lt) X(mapping) X(ne) X(none) X(number) X(odd) X(sameas) X(sequence) X(string) X(test)  \
    X(true) X(undefined) X(upper)

enum {
#define T_ENUM(name) T_##name,
    TPL_TESTS(T_ENUM)
#undef T_ENUM
    T_COUNT_
};

static const char *const TEST_NAMES[] = {
#define T_NAME(name) #name,
    TPL_TESTS(T_NAME)
#undef T_NAME
};

int tpl_test_id(const char *name) {
    for (int i = 0; i < T_COUNT_; i++)
        if (!strcmp(TEST_NAMES[i], name))
            return i;
    return -1;
}

int tpl_apply_test(tpl_rt *R, int id, const char *name, tpl_val in, const tpl_args *a, bool *out) {
    if (id < 0)
        return tpl_type_error(R, "No test named '%s'.", name);
    tpl_val p[2];
    bool got[2];
    static const char *const PN[] = {"other", "x"};
    int rc = tpl_bind(R, name, a, PN, 2, p, got);
    if (rc)
        return rc;
    int cmp;
    switch (id) {
    case T_boolean: *out = in.kind == TPL_BOOL; return FU_OK;
    case T_callable: *out = in.kind == TPL_FUNC || in.kind == TPL_UNDEF; return FU_OK;
    case T_defined: *out = in.kind != TPL_UNDEF; return FU_OK;
    case T_undefined: *out = in.kind == TPL_UNDEF; return FU_OK;
    case T_none: *out = in.kind == TPL_NONE; return FU_OK;
    case T_true: *out = in.kind == TPL_BOOL && in.i; return FU_OK;
    case T_false: *out = in.kind == TPL_BOOL && !in.i; return FU_OK;
    case T_integer: *out = in.kind == TPL_INT; return FU_OK;
    case T_float: *out = in.kind == TPL_FLOAT; return FU_OK;
    case T_number: *out = tpl_is_num(in); return FU_OK;
    case T_string: *out = in.kind == TPL_STR; return FU_OK;
    case T_mapping: *out = in.kind == TPL_DICT; return FU_OK;
    case T_iterable:
        *out = in.kind == TPL_STR || in.kind == TPL_LIST || in.kind == TPL_DICT || in.kind == TPL_UNDEF ||
               in.kind == TPL_LOOP;
        return FU_OK;
    case T_sequence:
        *out = in.kind == TPL_STR || (in.kind == TPL_LIST && !tpl_as_list(in)->gen) || in.kind == TPL_DICT ||
               in.kind == TPL_UNDEF;
        return FU_OK;
    case T_escaped: *out = false; return FU_OK;
    case T_lower:
    case T_upper: {
        tpl_val s;
        if ((rc = tpl_to_str(R, in, &s)))
            return rc;
        *out = all_cps(s, id == T_lower ? 5 : 4);
        tpl_drop(R, s);
        return FU_OK;
    }
    case T_even:
    case T_odd:
    case T_divisibleby: {
        int64_t d = 2;
        if (in.kind == TPL_UNDEF)
            return tpl_undef_fail(R, in);
        if (id == T_divisibleby) {
            if (!got[0])
                return tpl_type_error(R, "divisibleby needs a divisor");
            if ((rc = need_int(R, p[0], "divisor", &d)))
                return rc;
            if (d == 0)
                return tpl_type_error(R, "integer division or modulo by zero");
        }
        /* jinja2: odd is value % 2 == 1, even value % 2 == 0, divisibleby value % num == 0 (Python %). */
        if (in.kind == TPL_FLOAT) {
            double m = fmod(in.f, (double)d);
            if (m != 0.0 && ((m < 0) != (d < 0)))
                m += (double)d;
            *out = id == T_odd ? m == 1.0 : m == 0.0;
            return FU_OK;
        }
        if (in.kind != TPL_INT && in.kind != TPL_BOOL)
            return tpl_type_error(R, "unsupported operand type(s) for %%: '%s' and 'int'", tpl_type_name(in));
        int64_t m = d == -1 ? 0 : in.i % d;
        if (m != 0 && ((m < 0) != (d < 0)))
            m += d;
        *out = id == T_odd ? m == 1 : m == 0;
        return FU_OK;
    }
    case T_eq:
    case T_equalto:
    case T_ne:
        if (!got[0])
            return tpl_type_error(R, "test '%s' needs an argument", name);
        *out = tpl_equal(in, p[0]) == (id != T_ne);
        return FU_OK;
    case T_lt:
    case T_lessthan:
    case T_le:
    case T_gt:
    case T_greaterthan:
    case T_ge: {
        if (!got[0])
            return tpl_type_error(R, "test '%s' needs an argument", name);
        const char *sym = id == T_lt || id == T_lessthan ? "<" : id == T_le ? "<=" : id == T_ge ? ">=" : ">";
        if ((rc = tpl_compare(R, in, p[0], sym, &cmp)))
            return rc;
        if (cmp == 2)
            *out = false;
        else
            *out = sym[0] == '<' ? (sym[1] ? cmp <= 0 : cmp < 0) : (sym[1] ? cmp >= 0 : cmp > 0);
        return FU_OK;
    }
    case T_sameas:
        if (!got[0])
            return tpl_type_error(R, "sameas needs an argument");
        if (tpl_is_heap(in) || tpl_is_heap(p[0]))
            *out = in.kind == p[0].kind && in.o == p[0].o;
        else
            *out = in.kind == p[0].kind && (in.kind == TPL_FLOAT ? in.f == p[0].f : in.i == p[0].i);
        return FU_OK;
    case T_in: {
        if (!got[0])
            return tpl_type_error(R, "test 'in' needs a container");
        tpl_val container = p[0];
        if (container.kind == TPL_STR) {
            if (in.kind != TPL_STR)
                return tpl_type_error(R, "'in <string>' requires string as left operand, not %s", tpl_type_name(in));
            *out = SL(in) == 0 || memmem(S(container), SL(container), S(in), SL(in)) != NULL;
            return FU_OK;
        }
        if (container.kind == TPL_LIST) {
            *out = false;
            for (size_t i = 0; i < tpl_as_list(container)->len && !*out; i++)
                *out = tpl_equal(tpl_as_list(container)->v[i], in);
            return FU_OK;
        }
        if (container.kind == TPL_DICT) {
            *out = tpl_dict_get(container, in) != NULL;
            return FU_OK;
        }
        if (container.kind == TPL_UNDEF) {
            *out = false;
            return FU_OK;
        }
        return tpl_type_error(R, "argument of type '%s' is not iterable", tpl_type_name(container));
    }
    case T_filter:
    case T_test:
        if (in.kind != TPL_STR)
            *out = false;
        else
            *out = id == T_filter ? tpl_filter_id(S(in)) >= 0 : tpl_test_id(S(in)) >= 0;
        return FU_OK;
    }
    return tpl_type_error(R, "No test named '%s'.", name);
}

/* ------------------------------------------------------------------------ */
/* Globals and dispatch                                                      */
/* ------------------------------------------------------------------------ */

int tpl_global_id(const char *name) {
    if (!strcmp(name, "range"))
        return TPL_FN_RANGE;
    if (!strcmp(name, "namespace"))
        return TPL_FN_NAMESPACE;
    if (!strcmp(name, "dict"))
        return TPL_FN_DICT;
    if (!strcmp(name, "raise_exception"))
        return TPL_FN_RAISE;
    if (!strcmp(name, "strftime_now"))
        return TPL_FN_STRFTIME;
    return -1;
}

/* Fills dict `d` from a positional mapping / pair list and keyword args. */
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
    for (size_t k = 0; k < a->nkw && !rc; k++) {
        tpl_ref(a->kw[k]);
        rc = tpl_dict_set_cstr(R, d, a->kwnames[k], a->kw[k]);
    }
    return rc;
}

int tpl_call_builtin(tpl_rt *R, tpl_func *f, const tpl_args *a, tpl_val *out) {
    int rc;
    if (f->id >= TPL_FN_METHOD_BASE && f->id < TPL_FN_METHOD_BASE + M_COUNT_)
        return call_method(R, f->id - TPL_FN_METHOD_BASE, f->self, a, out);
    switch (f->id) {
    case TPL_FN_RANGE: {
        if (a->nkw)
            return tpl_type_error(R, "range() takes no keyword arguments");
        if (a->npos < 1 || a->npos > 3)
            return tpl_type_error(R, "range expected 1 to 3 arguments, got %zu", a->npos);
        int64_t v[3] = {0, 0, 0};
        for (size_t i = 0; i < a->npos; i++)
            if ((rc = need_int(R, a->pos[i], "range() argument", &v[i])))
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
        if ((rc = tpl_list_new(R, (size_t)count, out)))
            return rc;
        for (int64_t i = 0; i < (int64_t)count && !rc; i++)
            rc = tpl_list_push(R, *out, tpl_int(start + i * step));
        if (rc)
            tpl_drop(R, *out);
        return rc;
    }
    case TPL_FN_NAMESPACE:
    case TPL_FN_DICT:
        if ((rc = tpl_dict_new(R, a->nkw, out)))
            return rc;
        if ((rc = fill_dict(R, *out, a, f->id == TPL_FN_DICT ? "dict" : "namespace"))) {
            tpl_drop(R, *out);
            return rc;
        }
        if (f->id == TPL_FN_NAMESPACE) {
            out->kind = TPL_NS;
            out->o->kind = TPL_NS;
        }
        return FU_OK;
    case TPL_FN_RAISE: {
        tpl_val s = tpl_undef();
        if (a->npos >= 1 && (rc = tpl_to_str(R, a->pos[0], &s)))
            return rc;
        rc = tpl_rt_fail(R, FU_ERR_TEMPLATE, "%s", s.kind == TPL_STR ? S(s) : "");
        tpl_drop(R, s);
        return rc;
    }
    case TPL_FN_STRFTIME: {
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
    case TPL_FN_LOOP_CYCLE: {
        if (a->npos == 0)
            return tpl_type_error(R, "no items for cycling given");
        tpl_loop *l = (tpl_loop *)f->self.o;
        *out = a->pos[l->index0 % a->npos];
        tpl_ref(*out);
        return FU_OK;
    }
    case TPL_FN_LOOP_CHANGED: {
        tpl_loop *l = (tpl_loop *)f->self.o;
        tpl_val cur;
        if ((rc = tpl_list_new(R, a->npos, &cur)))
            return rc;
        for (size_t i = 0; i < a->npos && !rc; i++)
            rc = push_ref(R, cur, a->pos[i]);
        if (rc) {
            tpl_drop(R, cur);
            return rc;
        }
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
    }
    return tpl_type_error(R, "object is not callable");
}
