/* rt-profile.c -- step-time profiles for the simulator: Helix's per-GPU tables and the
 * "step_profiles" section of fusion's cluster files; interpolation of a batch's step time. */
#include <ctype.h>
#include <errno.h>
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "router-impl.h"
#include "status.h"

enum { MAX_POINTS = 4096 };

static void profile_free(rt_step_profile *p) {
    free(p->prompt_tokens), free(p->prompt_s), free(p->decode_tokens), free(p->decode_s);
    free(p->prompt_max_requests), free(p->prompt_max_tokens), free(p->decode_max_tokens);
    free(p->decode_max_context);
    memset(p, 0, sizeof *p);
}

void rt_sim_profiles_free(rt_sim_profiles *p) {
    if (!p) return;
    for (int i = 0; i < p->n; i++) profile_free(&p->items[i]);
    free(p->items);
    p->items = NULL;
    p->n = 0;
}

const rt_step_profile *rt_sim_profile_find(const rt_sim_profiles *p, const char *kind) {
    for (int i = 0; p && kind && i < p->n; i++)
        if (!strcmp(p->items[i].kind, kind)) return &p->items[i];
    return NULL;
}

static int profile_add(rt_sim_profiles *p, const char *kind, rt_step_profile **out) {
    if (strlen(kind) >= sizeof p->items[0].kind || rt_sim_profile_find(p, kind))
        return fu_errorf(FU_ERR_FORMAT, "step profile \"%s\": duplicate or too long a kind", kind);
    rt_step_profile *it = realloc(p->items, (size_t)(p->n + 1) * sizeof *it);
    if (!it) return fu_errorf(FU_ERR_NOMEM, "step profiles: out of memory");
    p->items = it;
    rt_step_profile *q = &it[p->n++];
    memset(q, 0, sizeof *q);
    snprintf(q->kind, sizeof q->kind, "%s", kind);
    *out = q;
    return FU_OK;
}

/* Removes the last profile added (a failed one's tables freed). */
static void profile_drop_last(rt_sim_profiles *p) {
    if (p->n > 0) profile_free(&p->items[--p->n]);
}

/* Checks a table: n >= 1 points, batch sizes ascending and >= 0, times finite and >= 0. */
static int check_table(const char *kind, const char *what, int n, const double *x, const double *y) {
    if (n < 1) return fu_errorf(FU_ERR_FORMAT, "step profile \"%s\": empty %s table", kind, what);
    for (int i = 0; i < n; i++) {
        if (!isfinite(x[i]) || !isfinite(y[i]) || x[i] < 0 || y[i] < 0 || (i > 0 && !(x[i] > x[i - 1])))
            return fu_errorf(FU_ERR_FORMAT, "step profile \"%s\": %s point %d is not ascending, finite "
                             "and non-negative", kind, what, i);
    }
    return FU_OK;
}

static double interp(int n, const double *x, const double *y, double v) {
    if (n == 1) return x[0] > 0 ? y[0] * v / x[0] : y[0];
    int i = 1;
    while (i < n - 1 && x[i] < v) i++;
    double t = y[i - 1] + (y[i] - y[i - 1]) * (v - x[i - 1]) / (x[i] - x[i - 1]);
    return t > 0 ? t : 0;
}

double rt_step_seconds(const rt_step_profile *p, int prompt_tokens, int decode_tokens, double decode_ctx) {
    double t = 0;
    if (prompt_tokens > 0) t += interp(p->n_prompt, p->prompt_tokens, p->prompt_s, prompt_tokens);
    if (decode_tokens > 0) {
        double d = interp(p->n_decode, p->decode_tokens, p->decode_s, decode_tokens);
        if (decode_tokens == 1 && p->single_decode_factor > 0) d *= p->single_decode_factor;
        t += d + p->decode_ctx_s * decode_ctx;
    }
    return t;
}

/* A copy of n doubles into *out (NULL on failure). */
static int copy_points(int n, const double *in, double **out) {
    *out = malloc((size_t)n * sizeof(double));
    if (!*out) return fu_errorf(FU_ERR_NOMEM, "step profiles: out of memory");
    memcpy(*out, in, (size_t)n * sizeof(double));
    return FU_OK;
}

int rt_sim_profiles_add(rt_sim_profiles *p, const char *kind, int n_prompt, const double *prompt_tokens,
                        const double *prompt_s, int n_decode, const double *decode_tokens, const double *decode_s) {
    if (!p || !kind || n_prompt > MAX_POINTS || n_decode > MAX_POINTS || (n_prompt > 0 && (!prompt_tokens || !prompt_s)) ||
        (n_decode > 0 && (!decode_tokens || !decode_s)))
        return fu_errorf(FU_ERR_FORMAT, "step profile \"%s\": bad tables", kind ? kind : "");
    int rc = check_table(kind, "prompt", n_prompt, prompt_tokens, prompt_s);
    if (!rc) rc = check_table(kind, "decode", n_decode, decode_tokens, decode_s);
    rt_step_profile *q;
    if (!rc) rc = profile_add(p, kind, &q);
    if (rc) return rc;
    q->n_prompt = n_prompt, q->n_decode = n_decode;
    rc = copy_points(n_prompt, prompt_tokens, &q->prompt_tokens);
    if (!rc) rc = copy_points(n_prompt, prompt_s, &q->prompt_s);
    if (!rc) rc = copy_points(n_decode, decode_tokens, &q->decode_tokens);
    if (!rc) rc = copy_points(n_decode, decode_s, &q->decode_s);
    if (rc) profile_drop_last(p);
    return rc;
}

/* --- Helix's tables ------------------------------------------------------------------------ */

/* Reads "batch,time_ms" rows into seconds. */
static int read_bs2time(const char *path, int *n, double **x, double **y) {
    FILE *f = fopen(path, "r");
    if (!f) return fu_errorf(FU_ERR_IO, "%s: %s", path, strerror(errno));
    double *bx = malloc(MAX_POINTS * sizeof(double)), *by = malloc(MAX_POINTS * sizeof(double));
    int k = 0, rc = FU_OK;
    char line[256];
    while (bx && by && fgets(line, sizeof line, f)) {
        double a, b;
        if (sscanf(line, "%lf,%lf", &a, &b) != 2) continue;
        if (k == MAX_POINTS) {
            rc = fu_errorf(FU_ERR_RANGE, "%s: more than %d rows", path, MAX_POINTS);
            break;
        }
        bx[k] = a, by[k++] = b * 1e-3;
    }
    fclose(f);
    if (!bx || !by) rc = fu_errorf(FU_ERR_NOMEM, "%s: out of memory", path);
    if (rc) {
        free(bx), free(by);
        return rc;
    }
    *n = k, *x = bx, *y = by;
    return FU_OK;
}

/* "a100" -> "A100", "t4x2" -> "T4x2" (Helix's machine-type names). */
static void helix_kind(const char *dir, char *out, size_t cap) {
    size_t i = 0;
    for (; dir[i] && i + 1 < cap; i++) out[i] = dir[i] == 'x' && i > 0 ? 'x' : (char)toupper((unsigned char)dir[i]);
    out[i] = '\0';
}

/* Copies an object of "k": value into arr[k - 1] for k = 1..n (n = the largest key). */
static int limits_from(json_t *obj, double scale, int **iarr, double **darr, int *n) {
    int mx = 0;
    const char *key;
    json_t *v;
    json_object_foreach(obj, key, v) {
        int k = atoi(key);
        if (k > mx && k <= 100000) mx = k;
    }
    if (mx == 0) return fu_errorf(FU_ERR_FORMAT, "model constants: empty per-layer table");
    if (*n && *n != mx) return fu_errorf(FU_ERR_FORMAT, "model constants: per-layer tables differ in length");
    *n = mx;
    if (iarr) *iarr = calloc((size_t)mx, sizeof(int));
    if (darr) *darr = calloc((size_t)mx, sizeof(double));
    if ((iarr && !*iarr) || (darr && !*darr)) return fu_errorf(FU_ERR_NOMEM, "model constants: out of memory");
    json_object_foreach(obj, key, v) {
        int k = atoi(key);
        if (k < 1 || k > mx || !json_is_number(v)) continue;
        if (iarr) (*iarr)[k - 1] = (int)(json_number_value(v) * scale);
        if (darr) (*darr)[k - 1] = json_number_value(v) * scale;
    }
    return FU_OK;
}

/* Batch limits of one GPU as Helix's simulator sets them: prompt tokens <= requests x
 * MAX_INPUT_LEN, decode context <= tokens x DECODE_PER_TOKEN_MAX_CONTEXT. */
static int helix_limits(rt_step_profile *q, json_t *gpu, json_t *globals) {
    json_t *pm = json_object_get(gpu, "prompt_max_requests_dict"), *dm = json_object_get(gpu, "decode_max_tokens_dict");
    double max_in = json_number_value(json_object_get(globals, "MAX_INPUT_LEN"));
    double ctx = json_number_value(json_object_get(globals, "DECODE_PER_TOKEN_MAX_CONTEXT"));
    if (!json_is_object(pm) || !json_is_object(dm) || !(max_in > 0) || !(ctx > 0))
        return fu_errorf(FU_ERR_FORMAT, "model constants: %s lacks batch limits", q->kind);
    int rc = limits_from(pm, 1, &q->prompt_max_requests, NULL, &q->n_limits);
    if (!rc) rc = limits_from(pm, max_in, &q->prompt_max_tokens, NULL, &q->n_limits);
    if (!rc) rc = limits_from(dm, 1, &q->decode_max_tokens, NULL, &q->n_limits);
    if (!rc) rc = limits_from(dm, ctx, NULL, &q->decode_max_context, &q->n_limits);
    return rc;
}

static int helix_gpu(rt_sim_profiles *p, const char *model_dir, const char *dir, json_t *gpu, json_t *globals) {
    char kind[32], path[4096];
    helix_kind(dir, kind, sizeof kind);
    rt_step_profile *q;
    int rc = profile_add(p, kind, &q);
    if (rc) return rc;
    q->single_decode_factor = 2;
    snprintf(path, sizeof path, "%s/%s/prompt_bs2time.csv", model_dir, dir);
    rc = read_bs2time(path, &q->n_prompt, &q->prompt_tokens, &q->prompt_s);
    snprintf(path, sizeof path, "%s/%s/decode_bs2time.csv", model_dir, dir);
    if (!rc) rc = read_bs2time(path, &q->n_decode, &q->decode_tokens, &q->decode_s);
    if (!rc) rc = check_table(kind, "prompt", q->n_prompt, q->prompt_tokens, q->prompt_s);
    if (!rc) rc = check_table(kind, "decode", q->n_decode, q->decode_tokens, q->decode_s);
    if (!rc) rc = helix_limits(q, gpu, globals);
    return rc;
}

int rt_sim_profiles_load_helix(rt_sim_profiles *p, const char *model_dir, const char *constants_json,
                               const char *model_name) {
    json_error_t err;
    json_t *root = json_load_file(constants_json, 0, &err);
    if (!root) return fu_errorf(FU_ERR_FORMAT, "%s:%d: %s", constants_json, err.line, err.text);
    json_t *globals = json_object_get(root, "global_constants_simulator_event_simulator_utils_py");
    json_t *gpus = json_object_get(json_object_get(json_object_get(root, "models"), model_name), "per_gpu");
    int rc = json_is_object(gpus) ? FU_OK : fu_errorf(FU_ERR_NOT_FOUND, "%s: no model %s", constants_json, model_name);
    const char *name;
    json_t *gpu;
    json_object_foreach(gpus, name, gpu) {
        if (rc) break;
        char dir[32];
        size_t i = 0;
        for (; name[i] && i + 1 < sizeof dir; i++) dir[i] = (char)tolower((unsigned char)name[i]);
        dir[i] = '\0';
        rc = helix_gpu(p, model_dir, dir, gpu, globals);
    }
    json_decref(root);
    if (rc) rt_sim_profiles_free(p);
    return rc;
}

int rt_helix_load_step_profiles(rt_sim_profiles *p, const rt_helix_files *f) {
    if (!p || !f || !f->dir || !f->model) return fu_errorf(FU_ERR_INVALID, "rt_helix_load_step_profiles: NULL argument");
    char dir[4096], rel[256], cons[4096];
    snprintf(rel, sizeof rel, "simulator/model_manager/%s", f->model);
    return rt_sim_profiles_load_helix(p, rt__helix_path(dir, sizeof dir, f, NULL, rel),
                                      rt__helix_path(cons, sizeof cons, f, f->constants_json, "derived/model_constants.json"),
                                      f->model);
}

/* --- fusion's "step_profiles" ---------------------------------------------------------------- */

static int json_table(const char *kind, const char *what, json_t *a, int *n, double **x, double **y) {
    size_t m = json_array_size(a);
    if (!json_is_array(a) || m == 0 || m > MAX_POINTS)
        return fu_errorf(FU_ERR_FORMAT, "step profile \"%s\": \"%s\" must be 1..%d [batch, ms] pairs", kind, what,
                         MAX_POINTS);
    *x = malloc(m * sizeof(double)), *y = malloc(m * sizeof(double));
    if (!*x || !*y) return fu_errorf(FU_ERR_NOMEM, "step profiles: out of memory");
    for (size_t i = 0; i < m; i++) {
        json_t *pt = json_array_get(a, i);
        if (json_array_size(pt) != 2 || !json_is_number(json_array_get(pt, 0)) || !json_is_number(json_array_get(pt, 1)))
            return fu_errorf(FU_ERR_FORMAT, "step profile \"%s\": %s[%zu] is not [batch, ms]", kind, what, i);
        (*x)[i] = json_number_value(json_array_get(pt, 0));
        (*y)[i] = json_number_value(json_array_get(pt, 1)) * 1e-3;
    }
    *n = (int)m;
    return check_table(kind, what, *n, *x, *y);
}

/* One optional non-negative number (0 when absent). */
static int json_opt(const char *kind, json_t *o, const char *key, double *out) {
    json_t *v = json_object_get(o, key);
    *out = 0;
    if (!v) return FU_OK;
    if (!json_is_number(v) || !isfinite(json_number_value(v)) || json_number_value(v) < 0 || json_number_value(v) > 1e12)
        return fu_errorf(FU_ERR_FORMAT, "step profile \"%s\": \"%s\" must be a number >= 0", kind, key);
    *out = json_number_value(v);
    return FU_OK;
}

/* How many block counts a limit gives: 1 for a number, its length for an array (0: bad). */
static int limit_count(json_t *v) {
    if (!v || json_is_number(v)) return 1;
    size_t n = json_array_size(v);
    return json_is_array(v) && n >= 1 && n <= MAX_POINTS ? (int)n : 0;
}

/* Entry i of a limit (a number holds for every block count): a number in [0, 1e12], else -1. */
static double limit_value(json_t *v, int i) {
    json_t *x = json_is_array(v) ? json_array_get(v, (size_t)i) : v;
    if (!x) return 0;
    double d = json_is_number(x) ? json_number_value(x) : -1;
    return isfinite(d) && d >= 0 && d <= 1e12 ? d : -1;
}

/* The four batch limits: each a number (any block count) or an array by block count (entry
 * min(k, n) - 1 for k blocks); the arrays must be as long as each other. */
static int json_limits(rt_step_profile *q, json_t *o) {
    static const char *keys[4] = {"prompt_max_requests", "prompt_max_tokens", "decode_max_tokens", "decode_max_context"};
    int n = 1;
    for (int i = 0; i < 4; i++) {
        json_t *v = json_object_get(o, keys[i]);
        int c = limit_count(v);
        if (!c || (c > 1 && n > 1 && c != n))
            return fu_errorf(FU_ERR_FORMAT, "step profile \"%s\": \"%s\" must be a number or an array of numbers as long as "
                             "the other limits' arrays", q->kind, keys[i]);
        if (c > 1) n = c;
    }
    q->n_limits = n;
    q->prompt_max_requests = calloc((size_t)n, sizeof(int)), q->prompt_max_tokens = calloc((size_t)n, sizeof(int));
    q->decode_max_tokens = calloc((size_t)n, sizeof(int)), q->decode_max_context = calloc((size_t)n, sizeof(double));
    if (!q->prompt_max_requests || !q->prompt_max_tokens || !q->decode_max_tokens || !q->decode_max_context)
        return fu_errorf(FU_ERR_NOMEM, "step profiles: out of memory");
    for (int k = 0; k < n; k++) {
        double v[4];
        for (int i = 0; i < 4; i++)
            if ((v[i] = limit_value(json_object_get(o, keys[i]), k)) < 0)
                return fu_errorf(FU_ERR_FORMAT, "step profile \"%s\": \"%s\" must be a number >= 0", q->kind, keys[i]);
        q->prompt_max_requests[k] = (int)fmin(v[0], 1e9), q->prompt_max_tokens[k] = (int)fmin(v[1], 1e9);
        q->decode_max_tokens[k] = (int)fmin(v[2], 1e9), q->decode_max_context[k] = v[3];
    }
    return FU_OK;
}

static int json_profile(rt_sim_profiles *p, const char *kind, json_t *o) {
    if (!json_is_object(o)) return fu_errorf(FU_ERR_FORMAT, "step profile \"%s\" is not an object", kind);
    rt_step_profile *q;
    int rc = profile_add(p, kind, &q);
    if (rc) return rc;
    rc = json_table(kind, "prompt", json_object_get(o, "prompt"), &q->n_prompt, &q->prompt_tokens, &q->prompt_s);
    if (!rc) rc = json_table(kind, "decode", json_object_get(o, "decode"), &q->n_decode, &q->decode_tokens, &q->decode_s);
    double ctx_ms = 0;
    if (!rc) rc = json_opt(kind, o, "decode_ctx_ms_per_token", &ctx_ms);
    if (!rc) q->decode_ctx_s = ctx_ms * 1e-3;
    if (!rc) rc = json_opt(kind, o, "single_decode_factor", &q->single_decode_factor);
    if (!rc) rc = json_limits(q, o);
    return rc;
}

static int parse_root(rt_sim_profiles *p, json_t *root) {
    json_t *sp = json_object_get(root, "step_profiles");
    if (!sp) return FU_OK;
    if (!json_is_object(sp)) return fu_errorf(FU_ERR_FORMAT, "\"step_profiles\" must be an object");
    const char *kind;
    json_t *o;
    json_object_foreach(sp, kind, o) {
        int rc = json_profile(p, kind, o);
        if (rc) return rc;
    }
    return FU_OK;
}

int rt_sim_profiles_parse_json(rt_sim_profiles *p, const char *text, size_t len) {
    json_error_t err;
    json_t *root = json_loadb(text, len, 0, &err);
    if (!root) return fu_errorf(FU_ERR_FORMAT, "cluster JSON:%d: %s", err.line, err.text);
    int rc = json_is_object(root) ? parse_root(p, root) : fu_errorf(FU_ERR_FORMAT, "cluster JSON: not an object");
    json_decref(root);
    if (rc) rt_sim_profiles_free(p);
    return rc;
}

static int parse_profiles(void *dst, const char *text, size_t len) {
    return rt_sim_profiles_parse_json(dst, text, len);
}

int rt_sim_profiles_load_json(rt_sim_profiles *p, const char *path) {
    return rt__load_file(path, parse_profiles, p);
}
