/* gw-stop.c -- stop-string matching over streamed text, holding back what could still become a stop string. */
#include <stdlib.h>
#include <string.h>

#include "gw.h"
#include "status.h"

int gw_stop_init(gw_stop *s, char *const *stops, int n) {
    memset(s, 0, sizeof *s);
    if (n <= 0) return FU_OK;
    s->lens = calloc((size_t)n, sizeof *s->lens);
    if (!s->lens) return fu_errorf(FU_ERR_NOMEM, "stop strings");
    s->stops = (char **)stops;
    s->n = n;
    for (int i = 0; i < n; i++) {
        s->lens[i] = strlen(stops[i]);
        if (s->lens[i] > s->max_len) s->max_len = s->lens[i];
    }
    return FU_OK;
}

void gw_stop_free(gw_stop *s) {
    free(s->lens);
    fu_buf_free(&s->held);
    memset(s, 0, sizeof *s);
}

/* Longest k < len(stop) such that the last k bytes of text are the first k of some stop string. */
static size_t gw_stop_partial(const gw_stop *s, const char *text, size_t len) {
    size_t best = 0;
    for (int i = 0; i < s->n; i++) {
        size_t k = s->lens[i] - 1 < len ? s->lens[i] - 1 : len;
        for (; k > best; k--)
            if (!memcmp(text + len - k, s->stops[i], k)) {
                best = k;
                break;
            }
    }
    return best;
}

int gw_stop_feed(gw_stop *s, const char *text, size_t len, fu_buf *out) {
    if (s->matched) return FU_OK;
    if (s->n == 0) return fu_buf_append(out, text, len);
    if (fu_buf_append(&s->held, text, len)) return FU_ERR_NOMEM;
    const char *h = s->held.data;
    size_t hl = s->held.len;
    /* the earliest occurrence of any stop string */
    size_t first = SIZE_MAX;
    for (int i = 0; i < s->n; i++) {
        const char *p = memmem(h, hl, s->stops[i], s->lens[i]);
        if (p && (size_t)(p - h) < first) first = (size_t)(p - h);
    }
    if (first != SIZE_MAX) {
        int rc = fu_buf_append(out, h, first);
        s->matched = true;
        s->held.len = 0;
        return rc;
    }
    size_t keep = gw_stop_partial(s, h, hl);
    size_t release = hl - keep;
    /* never cut inside a character (a stop string starting with a continuation byte) */
    while (release > 0 && release < hl && ((unsigned char)h[release] & 0xC0) == 0x80) release--;
    if (release) {
        if (fu_buf_append(out, h, release)) return FU_ERR_NOMEM;
        fu_buf_consume(&s->held, release);
    }
    return FU_OK;
}

int gw_stop_flush(gw_stop *s, fu_buf *out) {
    if (s->matched || !s->held.len) return FU_OK;
    int rc = fu_buf_append(out, s->held.data, s->held.len);
    s->held.len = 0;
    return rc;
}
