/* parse.c -- strict parsing of command-line and config values. */
#include "parse.h"

#include <errno.h>
#include <float.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "status.h"

int fu_parse_long(const char *s, long lo, long hi, long *out) {
    char *end;
    errno = 0;
    long v = strtol(s, &end, 10);
    if (errno || end == s || *end || v < lo || v > hi)
        return fu_errorf(FU_ERR_INVALID, "expected an integer in [%ld, %ld], got '%s'", lo, hi, s);
    *out = v;
    return FU_OK;
}

int fu_parse_double(const char *s, double *out) {
    char *end;
    errno = 0;
    double v = strtod(s, &end);
    if (errno || end == s || *end) return fu_errorf(FU_ERR_INVALID, "expected a number, got '%s'", s);
    *out = v;
    return FU_OK;
}

int fu_parse_float(const char *s, float *out) {
    double v;
    if (fu_parse_double(s, &v)) return FU_ERR_INVALID;
    if (isfinite(v) && fabs(v) > FLT_MAX) return fu_errorf(FU_ERR_INVALID, "expected a number, got '%s'", s);
    *out = (float)v;
    return FU_OK;
}

int fu_parse_range(const char *s, long lo, long hi, long *a, long *b) {
    const char *colon = strchr(s, ':');
    char first[32];
    size_t n = colon ? (size_t)(colon - s) : sizeof first;
    long x, y;
    if (n < sizeof first) {
        memcpy(first, s, n);
        first[n] = '\0';
        if (!fu_parse_long(first, lo, hi, &x) && !fu_parse_long(colon + 1, x, hi, &y)) {
            *a = x;
            *b = y;
            return FU_OK;
        }
    }
    return fu_errorf(FU_ERR_INVALID, "expected A:B with %ld <= A <= B <= %ld, got '%s'", lo, hi, s);
}

int fu_parse_ids(const char *s, int32_t **ids, size_t *n) {
    size_t cap = 16, count = 0;
    int32_t *v = malloc(cap * sizeof *v);
    if (!v) return fu_errorf(FU_ERR_NOMEM, "token ids");
    while (*s) {
        char *end;
        errno = 0;
        long x = strtol(s, &end, 10);
        if (errno || end == s || x < 0 || x > INT32_MAX || (*end && *end != ',')) goto bad;
        if (count == cap) {
            int32_t *nv = realloc(v, (cap *= 2) * sizeof *v);
            if (!nv) {
                free(v);
                return fu_errorf(FU_ERR_NOMEM, "token ids");
            }
            v = nv;
        }
        v[count++] = (int32_t)x;
        s = *end ? end + 1 : end;
    }
    if (!count) goto bad;
    *ids = v;
    *n = count;
    return FU_OK;
bad:
    free(v);
    return fu_errorf(FU_ERR_INVALID, "expected comma-separated token ids");
}
