/* rt-requests.c -- request files for the simulator: traces ("arrival prompt output" per line)
 * and length sets ("prompt output" per line). */
#include <limits.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#include "parse.h"
#include "router-impl.h"
#include "status.h"

typedef struct req_list {
    rt_sim_request *v;
    int n, cap;
    int with_arrival;
} req_list;

/* Cuts `line` into at most 4 blank-separated fields; returns how many. */
static int split_fields(char *line, char *f[4]) {
    static const char blanks[] = " \t\r";
    int n = 0;
    for (char *p = line + strspn(line, blanks); *p && n < 4; p += strspn(p, blanks)) {
        f[n++] = p;
        p += strcspn(p, blanks);
        if (*p) *p++ = '\0';
    }
    return n;
}

/* One line into q: "arrival prompt output" or "prompt output". */
static bool parse_request_line(char *line, int with_arrival, rt_sim_request *q) {
    char *f[4];
    int n = split_fields(line, f), a = with_arrival ? 1 : 0;
    long prompt, output;
    q->arrival_s = 0;
    if (n != 2 + a) return false;
    if (a && (fu_parse_double(f[0], &q->arrival_s) || !(q->arrival_s >= 0) || q->arrival_s > 1e12)) return false;
    if (fu_parse_long(f[a], 1, INT_MAX, &prompt) || fu_parse_long(f[a + 1], 0, INT_MAX, &output)) return false;
    q->prompt_len = (int)prompt;
    q->output_len = (int)output;
    return true;
}

static int list_push(req_list *l, const rt_sim_request *q) {
    if (l->n == l->cap) {
        if (l->cap >= INT_MAX / 2) return fu_errorf(FU_ERR_RANGE, "too many requests");
        int c = l->cap ? l->cap * 2 : 256;
        rt_sim_request *nv = realloc(l->v, (size_t)c * sizeof *nv);
        if (!nv) return fu_errorf(FU_ERR_NOMEM, "out of memory");
        l->v = nv;
        l->cap = c;
    }
    l->v[l->n++] = *q;
    return FU_OK;
}

static int cmp_arrival(const void *x, const void *y) {
    double a = ((const rt_sim_request *)x)->arrival_s, b = ((const rt_sim_request *)y)->arrival_s;
    return a < b ? -1 : a > b;
}

/* Parses one line of `len` bytes at `s` (no newline) into l; blank and '#' lines are skipped. */
static int parse_one(req_list *l, const char *s, size_t len, int lineno) {
    char buf[128];
    size_t skip = 0;
    while (skip < len && (s[skip] == ' ' || s[skip] == '\t' || s[skip] == '\r')) skip++;
    if (skip >= len || s[skip] == '#') return FU_OK;
    if (len >= sizeof buf) return fu_errorf(FU_ERR_FORMAT, "line %d: too long", lineno);
    memcpy(buf, s, len);
    buf[len] = '\0';
    rt_sim_request q;
    if (!parse_request_line(buf, l->with_arrival, &q))
        return fu_errorf(FU_ERR_FORMAT, "line %d: expected \"%s\"", lineno,
                         l->with_arrival ? "arrival_seconds prompt_len output_len" : "prompt_len output_len");
    return list_push(l, &q);
}

static int parse_requests(void *dst, const char *text, size_t len) {
    req_list *l = dst;
    int lineno = 0, rc = FU_OK;
    for (size_t at = 0; at < len && !rc;) {
        const char *nl = memchr(text + at, '\n', len - at);
        size_t end = nl ? (size_t)(nl - text) : len;
        if (memchr(text + at, '\0', end - at)) return fu_errorf(FU_ERR_FORMAT, "line %d: NUL byte", lineno + 1);
        rc = parse_one(l, text + at, end - at, ++lineno);
        at = end + 1;
    }
    if (!rc && l->n == 0) rc = fu_errorf(FU_ERR_FORMAT, "no requests");
    return rc;
}

/* Hands l's requests to the caller (sorted by arrival when they have one), or frees them. */
static int finish(req_list *l, int rc, rt_sim_request **out, int *n) {
    if (rc) {
        free(l->v);
        return rc;
    }
    if (l->with_arrival) qsort(l->v, (size_t)l->n, sizeof *l->v, cmp_arrival);
    *out = l->v;
    *n = l->n;
    return FU_OK;
}

int rt_sim_requests_parse(const char *text, size_t len, int with_arrival, rt_sim_request **out, int *n) {
    req_list l = {NULL, 0, 0, with_arrival};
    return finish(&l, parse_requests(&l, text, len), out, n);
}

int rt_sim_requests_load(const char *path, int with_arrival, rt_sim_request **out, int *n) {
    req_list l = {NULL, 0, 0, with_arrival};
    return finish(&l, rt__load_file(path, parse_requests, &l), out, n);
}

void rt_sim_requests_mean(const rt_sim_request *v, int n, double *prompt, double *output) {
    double p = 0, o = 0;
    for (int i = 0; i < n; i++) p += v[i].prompt_len, o += v[i].output_len;
    *prompt = n > 0 ? p / n : 0;
    *output = n > 0 ? o / n : 0;
}

void rt_sim_opts_draw_lengths(rt_sim_opts *so, const rt_sim_request *v, int n) {
    double pl, ol;
    rt_sim_requests_mean(v, n, &pl, &ol);
    so->lengths = v, so->n_lengths = n;
    so->prompt_len = (int)(pl + 0.5), so->output_len = (int)(ol + 0.5);
}
