/* parse.c -- strict parsing of command-line and config values. */
#include "parse.h"

#include <errno.h>
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

int fu_parse_float(const char *s, float *out) {
    char *end;
    errno = 0;
    float v = strtof(s, &end);
    if (errno || end == s || *end) return fu_errorf(FU_ERR_INVALID, "expected a number, got '%s'", s);
    *out = v;
    return FU_OK;
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
