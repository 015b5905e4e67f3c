/* finetune.c -- fusion-finetune: uploads a JSONL file to a gateway, runs a fine-tuning job on it and follows it.
 *
 * The gateway's API (README, "Fine-tuning"): POST /v1/files (multipart, purpose "fine-tune"),
 * POST /v1/fine_tuning/jobs, then GET /v1/fine_tuning/jobs/{id} and .../events about every
 * second until the job ends. The fine-tuned model's name is the last line of stdout.
 *
 * Threading: one thread. SIGINT only sets a flag (ft_interrupted), read by the follow loop
 * between requests, which then cancels the job; a second SIGINT kills the program.
 * Ownership: the option table owns the strings in `args` (fu_opt_free()); an ft_client owns
 * its curl handle and headers; JSON values are jansson references, freed by whoever got them.
 * Errors: the request functions return FU_OK or a status with fu_last_error() saying why in one
 * line; FU_ERR_NETWORK (no connection, 5xx, a reply that is not JSON) may pass on a retry.
 */
#include <curl/curl.h>
#include <errno.h>
#include <jansson.h>
#include <math.h>
#include <signal.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "buf.h"
#include "clock.h"
#include "options.h"
#include "status.h"

#define FT_PROG "fusion-finetune"
#define FT_DEFAULT_URL "http://127.0.0.1:8080" /* the gateway's default --listen */
#define FT_POLL_MS 1000
#define FT_MAX_RETRIES 5      /* consecutive failed polls before giving up */
#define FT_MAX_PAGES 1000     /* event pages read in one poll, at most */
#define FT_EXIT_INTERRUPTED 130

/* ---- options ----------------------------------------------------------------------------------- */

/* The command line and --config. Numbers not given stay unset (-1, NAN): the server's default. */
typedef struct ft_args {
    char *url, *api_key, *model, *suffix, *validation, *targets, *results, *follow;
    long seed;
    int epochs, batch_size, lora_r;
    double lr_multiplier, lora_alpha, lora_dropout;
    bool no_follow, quiet;
} ft_args;

static ft_args args = {.seed = -1, .epochs = -1, .batch_size = -1, .lora_r = -1};

static const fu_opt ft_options[] = {
    {"config", 0, FU_OPT_CONFIG, .help = "JSON file of these settings (keys as the long options,\n"
                                          "e.g. \"lora_r\"); flags override it"},
    {"url", 0, FU_OPT_STRING, FU_OPT_TO(args.url), "URL",
     "the gateway (default $FUSION_URL, else\n" FT_DEFAULT_URL ")"},
    {"api-key", 0, FU_OPT_STRING, FU_OPT_TO(args.api_key), "KEY",
     "bearer token (default $FUSION_API_KEY, else $OPENAI_API_KEY)"},
    {"model", 'm', FU_OPT_STRING, FU_OPT_TO(args.model), "ID", "base model (default: the first of /v1/models)"},
    {"validation", 0, FU_OPT_PATH, FU_OPT_TO(args.validation), "FILE", "a validation JSONL, uploaded too"},
    {"suffix", 0, FU_OPT_STRING, FU_OPT_TO(args.suffix), "S", "in the model's name: ft:BASE:ORG:S:JOB"},
    {"seed", 0, FU_OPT_INT, FU_OPT_TO(args.seed), .help = "the job's seed", .lo = 0, .hi = 2147483647},
    {"epochs", 0, FU_OPT_INT, FU_OPT_TO(args.epochs), .help = "n_epochs (server default 3)", .lo = 1, .hi = 1000},
    {"batch-size", 0, FU_OPT_INT, FU_OPT_TO(args.batch_size),
     .help = "examples per step (server default min(8, examples))", .lo = 1, .hi = 1000000},
    {"lr-multiplier", 0, FU_OPT_FLOAT, FU_OPT_TO(args.lr_multiplier), "X",
     "learning_rate_multiplier (server default 1)"},
    {"lora-r", 0, FU_OPT_INT, FU_OPT_TO(args.lora_r), .help = "LoRA rank (server default 16)", .lo = 1, .hi = 65536},
    {"lora-alpha", 0, FU_OPT_FLOAT, FU_OPT_TO(args.lora_alpha), "A", "LoRA alpha (server default 2r)"},
    {"lora-dropout", 0, FU_OPT_FLOAT, FU_OPT_TO(args.lora_dropout), "P", "LoRA dropout (server default 0)"},
    {"lora-targets", 0, FU_OPT_STRING, FU_OPT_TO(args.targets), "LIST",
     "\"all-linear\" or module names, q_proj,v_proj,...\n(server default all-linear)"},
    {"results", 0, FU_OPT_PATH, FU_OPT_TO(args.results), "DIR", "download the job's result files into DIR"},
    {"no-follow", 0, FU_OPT_FLAG, FU_OPT_TO(args.no_follow), .help = "print the job's id and exit"},
    {"follow", 0, FU_OPT_STRING, FU_OPT_TO(args.follow), "JOB_ID",
     "follow an existing job instead of creating one", .flags = FU_OPT_NOFILE},
    {"quiet", 'q', FU_OPT_FLAG, FU_OPT_TO(args.quiet), .help = "no progress or messages, only the result"},
    FU_OPT_END,
};

static const fu_opt_spec ft_spec = {
    FT_PROG,
    "usage: fusion-finetune [options] DATA.jsonl\n"
    "       fusion-finetune [options] --follow JOB_ID\n"
    "Uploads DATA.jsonl (OpenAI's chat fine-tuning format) to a fusion gateway, starts a\n"
    "LoRA fine-tuning job on it and follows it: one progress line, the job's messages,\n"
    "and at the end the fine-tuned model's name as the last line of stdout.\n",
    ft_options,
    "\n"
    "Exit status: 0 when the job succeeded; 1 when it failed or was cancelled, or on an\n"
    "error; 2 on a usage error; 130 when interrupted (Ctrl-C cancels the job).\n"
    "Environment: FUSION_URL, FUSION_API_KEY, OPENAI_API_KEY.\n"};

/* ---- HTTP ------------------------------------------------------------------------------------------ */

/* A connection to the gateway: base URL without a trailing "/" or "/v1". */
typedef struct ft_client {
    CURL *curl;
    char *base;                /* malloc'd */
    struct curl_slist *auth;   /* the Authorization header, or NULL */
    char curl_error[CURL_ERROR_SIZE];
} ft_client;

/* Opens a client of `url` sending `key` (NULL or "": none). FU_OK, or FU_ERR_NOMEM. */
static int ft_client_init(ft_client *c, const char *url, const char *key) {
    memset(c, 0, sizeof *c);
    size_t n = strlen(url);
    while (n > 0 && url[n - 1] == '/') n--;
    if (n >= 3 && !strncmp(url + n - 3, "/v1", 3)) n -= 3;
    c->base = strndup(url, n);
    c->curl = curl_easy_init();
    if (key && key[0]) {
        fu_buf h = {0};
        if (!fu_buf_appendf(&h, "Authorization: Bearer %s", key)) c->auth = curl_slist_append(NULL, h.data);
        fu_buf_free(&h);
        if (!c->auth) c->base = (free(c->base), NULL);
    }
    return c->base && c->curl ? FU_OK : fu_errorf(FU_ERR_NOMEM, "out of memory");
}

/* Frees what c holds; a zeroed client is a no-op. */
static void ft_client_free(ft_client *c) {
    curl_easy_cleanup(c->curl);
    curl_slist_free_all(c->auth);
    free(c->base);
    memset(c, 0, sizeof *c);
}

/* curl's write callback: appends to the fu_buf at user. */
static size_t ft_write(char *data, size_t size, size_t n, void *user) {
    return fu_buf_append(user, data, size * n) ? 0 : size * n;
}

/* An HTTP error reply as one line into fu_last_error(): "400 invalid_request_error: message". */
static int ft_http_error(long status, const fu_buf *body) {
    json_t *doc = body->data ? json_loadb(body->data, body->len, 0, NULL) : NULL;
    json_t *e = json_object_get(doc, "error");
    const char *type = json_string_value(json_object_get(e, "type"));
    const char *msg = json_string_value(json_object_get(e, "message"));
    if (!type) type = json_string_value(json_object_get(e, "code"));
    int rc = status >= 500 ? FU_ERR_NETWORK : status == 401 || status == 403 ? FU_ERR_AUTH : FU_ERR_INVALID;
    if (msg) fu_errorf(rc, "%ld %s: %s", status, type ? type : "error", msg);
    else fu_errorf(rc, "%ld: %.200s", status, body->data && body->len ? body->data : "(no body)");
    json_decref(doc);
    return rc;
}

/* The common options of one request to c->base + path, its reply going into *out. */
static struct curl_slist *ft_request_setup(ft_client *c, const char *path, fu_buf *out, bool json) {
    fu_buf url = {0};
    curl_easy_reset(c->curl);
    if (fu_buf_appendf(&url, "%s%s", c->base, path)) return NULL;
    curl_easy_setopt(c->curl, CURLOPT_URL, url.data);
    fu_buf_free(&url);
    curl_easy_setopt(c->curl, CURLOPT_NOSIGNAL, 1L);
    curl_easy_setopt(c->curl, CURLOPT_ERRORBUFFER, c->curl_error);
    curl_easy_setopt(c->curl, CURLOPT_WRITEFUNCTION, ft_write);
    curl_easy_setopt(c->curl, CURLOPT_WRITEDATA, out);
    curl_easy_setopt(c->curl, CURLOPT_CONNECTTIMEOUT, 10L);
    curl_easy_setopt(c->curl, CURLOPT_LOW_SPEED_LIMIT, 1L); /* no byte for 120 s: give up */
    curl_easy_setopt(c->curl, CURLOPT_LOW_SPEED_TIME, 120L);
    struct curl_slist *h = NULL;
    for (const struct curl_slist *a = c->auth; a; a = a->next) h = curl_slist_append(h, a->data);
    if (json) h = curl_slist_append(h, "Content-Type: application/json");
    h = curl_slist_append(h, "Expect:");
    curl_easy_setopt(c->curl, CURLOPT_HTTPHEADER, h);
    return h;
}

/* Sends method (GET or POST) to path with `body` (JSON text) or `mime` (NULL: none); the reply's
 * body into *out (the caller's, emptied first). FU_OK for a 2xx, else the error (see the top). */
static int ft_request(ft_client *c, const char *method, const char *path, const char *body, curl_mime *mime,
                      fu_buf *out) {
    fu_buf_free(out);
    c->curl_error[0] = '\0';
    struct curl_slist *h = ft_request_setup(c, path, out, body != NULL);
    if (!h) return fu_errorf(FU_ERR_NOMEM, "out of memory");
    if (mime) curl_easy_setopt(c->curl, CURLOPT_MIMEPOST, mime);
    else if (body) curl_easy_setopt(c->curl, CURLOPT_POSTFIELDS, body);
    else if (!strcmp(method, "POST")) curl_easy_setopt(c->curl, CURLOPT_POSTFIELDS, "");
    CURLcode cc = curl_easy_perform(c->curl);
    curl_slist_free_all(h);
    long status = 0;
    curl_easy_getinfo(c->curl, CURLINFO_RESPONSE_CODE, &status);
    if (cc != CURLE_OK)
        return fu_errorf(FU_ERR_NETWORK, "cannot reach %s: %s", c->base,
                         c->curl_error[0] ? c->curl_error : curl_easy_strerror(cc));
    return status / 100 == 2 ? FU_OK : ft_http_error(status, out);
}

/* As ft_request, the reply parsed: *out a JSON object (new reference). */
static int ft_call(ft_client *c, const char *method, const char *path, const json_t *body, curl_mime *mime,
                   json_t **out) {
    *out = NULL;
    char *text = body ? json_dumps(body, JSON_COMPACT) : NULL;
    if (body && !text) return fu_errorf(FU_ERR_NOMEM, "out of memory");
    fu_buf reply = {0};
    int rc = ft_request(c, method, path, text, mime, &reply);
    free(text);
    json_error_t jerr;
    if (!rc) *out = reply.data ? json_loadb(reply.data, reply.len, 0, &jerr) : NULL;
    if (!rc && !json_is_object(*out)) {
        rc = fu_errorf(FU_ERR_NETWORK, "%s %s: the reply is not a JSON object", method, path);
        json_decref(*out);
        *out = NULL;
    }
    fu_buf_free(&reply);
    return rc;
}

/* path = prefix + id (URL-escaped) + rest, into *path (the caller frees it). FU_OK or FU_ERR_NOMEM. */
static int ft_path(ft_client *c, const char *prefix, const char *id, const char *rest, fu_buf *path) {
    char *esc = curl_easy_escape(c->curl, id, 0);
    int rc = esc ? fu_buf_appendf(path, "%s%s%s", prefix, esc, rest ? rest : "") : FU_ERR_NOMEM;
    curl_free(esc);
    return rc ? fu_errorf(FU_ERR_NOMEM, "out of memory") : FU_OK;
}

/* The string `key` of object o, or def when absent or not a string. */
static const char *ft_str(const json_t *o, const char *key, const char *def) {
    const char *s = json_string_value(json_object_get(o, key));
    return s ? s : def;
}

/* ---- the job --------------------------------------------------------------------------------------- */

/* The id of the first model of GET /v1/models into *out (malloc'd). */
static int ft_default_model(ft_client *c, char **out) {
    json_t *doc;
    int rc = ft_call(c, "GET", "/v1/models", NULL, NULL, &doc);
    const char *id = rc ? NULL : ft_str(json_array_get(json_object_get(doc, "data"), 0), "id", NULL);
    if (!rc && !id) rc = fu_errorf(FU_ERR_NOT_FOUND, "%s serves no model (GET /v1/models)", c->base);
    if (!rc && !(*out = strdup(id))) rc = fu_errorf(FU_ERR_NOMEM, "out of memory");
    json_decref(doc);
    return rc;
}

/* POSTs body (JSON) or mime to path; the reply's "id" into *id (malloc'd). */
static int ft_post_id(ft_client *c, const char *path, const json_t *body, curl_mime *mime, char **id) {
    json_t *doc = NULL;
    int rc = ft_call(c, "POST", path, body, mime, &doc);
    const char *got = rc ? NULL : ft_str(doc, "id", NULL);
    if (!rc && !got) rc = fu_errorf(FU_ERR_NETWORK, "POST %s: the reply has no id", path);
    if (!rc && !(*id = strdup(got))) rc = fu_errorf(FU_ERR_NOMEM, "out of memory");
    json_decref(doc);
    return rc;
}

/* Uploads `path` for fine-tuning; its file id into *id (malloc'd). */
static int ft_upload(ft_client *c, const char *path, char **id) {
    FILE *f = fopen(path, "rb");
    if (!f) return fu_errorf(FU_ERR_IO, "%s: %s", path, strerror(errno));
    fclose(f);
    curl_mime *mime = curl_mime_init(c->curl);
    curl_mimepart *p = curl_mime_addpart(mime);
    curl_mime_name(p, "purpose");
    curl_mime_data(p, "fine-tune", CURL_ZERO_TERMINATED);
    p = curl_mime_addpart(mime);
    curl_mime_name(p, "file");
    int rc = curl_mime_filedata(p, path) == CURLE_OK ? FU_OK : fu_errorf(FU_ERR_NOMEM, "out of memory");
    if (!rc) rc = ft_post_id(c, "/v1/files", NULL, mime, id);
    curl_mime_free(mime);
    return rc;
}

/* Sets key of o to a number unless it is unset (< 0 or NaN). */
static void ft_set_number(json_t *o, const char *key, double v, bool integral) {
    if (isnan(v) || v < 0) return;
    json_object_set_new(o, key, integral ? json_integer((json_int_t)v) : json_real(v));
}

/* The body of POST /v1/fine_tuning/jobs (new reference, NULL when out of memory). */
static json_t *ft_job_body(const ft_args *a, const char *model, const char *train, const char *valid) {
    json_t *hp = json_object(), *lora = json_object();
    ft_set_number(hp, "n_epochs", a->epochs, true);
    ft_set_number(hp, "batch_size", a->batch_size, true);
    ft_set_number(hp, "learning_rate_multiplier", a->lr_multiplier, false);
    ft_set_number(lora, "r", a->lora_r, true);
    ft_set_number(lora, "alpha", a->lora_alpha, false);
    ft_set_number(lora, "dropout", a->lora_dropout, false);
    if (a->targets) json_object_set_new(lora, "target_modules", json_string(a->targets));
    json_t *body = json_pack("{s:s, s:s, s:{s:s, s:{s:O}}}", "model", model, "training_file", train, "method",
                             "type", "supervised", "supervised", "hyperparameters", hp);
    if (body && valid) json_object_set_new(body, "validation_file", json_string(valid));
    if (body && a->suffix) json_object_set_new(body, "suffix", json_string(a->suffix));
    if (body && a->seed >= 0) json_object_set_new(body, "seed", json_integer(a->seed));
    if (body && json_object_size(lora)) json_object_set(body, "lora", lora);
    json_decref(hp);
    json_decref(lora);
    return body;
}

/* Creates the job of a's settings on the uploaded files; its id into *id (malloc'd). */
static int ft_create(ft_client *c, const ft_args *a, const char *model, const char *train, const char *valid,
                     char **id) {
    json_t *body = ft_job_body(a, model, train, valid);
    int rc = body ? ft_post_id(c, "/v1/fine_tuning/jobs", body, NULL, id) : fu_errorf(FU_ERR_NOMEM, "out of memory");
    json_decref(body);
    return rc;
}

/* ---- display ----------------------------------------------------------------------------------------- */

/* What the progress line shows, and what it is computed from. */
typedef struct ft_progress {
    bool tty, quiet, shown;   /* shown: a progress line is on the terminal, without its newline */
    long step, total;         /* of the newest metrics event; 0: none yet */
    double loss, valid;       /* valid: NAN when the events carry none */
    long base_step;           /* the step when base_t was taken, for the step rate */
    double base_t;            /* 0: not yet taken */
    long long tok0;           /* trained_tokens first seen, at tok_t; -1: none yet */
    double tok_t, tok_rate;   /* tokens/s, 0: unknown */
    double finish;            /* the job's estimated_finish (unix seconds), 0: unknown */
} ft_progress;

/* Writes a duration as "45s", "1m05s" or "2h03m". */
static void ft_format_duration(double s, char *out, size_t cap) {
    long t = s > 0 ? (long)(s + 0.5) : 0;
    if (t < 60) snprintf(out, cap, "%lds", t);
    else if (t < 3600) snprintf(out, cap, "%ldm%02lds", t / 60, t % 60);
    else snprintf(out, cap, "%ldh%02ldm", t / 3600, t / 60 % 60);
}

/* Seconds left: from estimated_finish when known, else from the step rate; < 0: unknown. */
static double ft_eta(const ft_progress *p) {
    if (p->finish > 0) return p->finish - fu_wall_s();
    double dt = fu_now_s() - p->base_t;
    if (p->base_t <= 0 || p->step <= p->base_step || dt <= 0 || p->total <= 0) return -1;
    return (double)(p->total - p->step) * dt / (double)(p->step - p->base_step);
}

/* The progress line's text: "step 12/40  loss 1.234  valid 1.300  412 tok/s  ETA 1m05s". */
static void ft_progress_text(const ft_progress *p, char *out, size_t cap) {
    char eta[32];
    double left = ft_eta(p);
    int n = snprintf(out, cap, "step %ld/%ld  loss %.3f", p->step, p->total, p->loss);
    if (!isnan(p->valid) && n > 0 && (size_t)n < cap) n += snprintf(out + n, cap - (size_t)n, "  valid %.3f", p->valid);
    if (p->tok_rate > 0 && n > 0 && (size_t)n < cap)
        n += snprintf(out + n, cap - (size_t)n, "  %.0f tok/s", p->tok_rate);
    if (left >= 0 && n > 0 && (size_t)n < cap) {
        ft_format_duration(left, eta, sizeof eta);
        snprintf(out + n, cap - (size_t)n, "  ETA %s", eta);
    }
}

/* Redraws the progress line in place (terminals only). */
static void ft_progress_draw(ft_progress *p) {
    if (p->quiet || !p->tty || p->step <= 0) return;
    char line[256];
    ft_progress_text(p, line, sizeof line);
    printf("\r\033[K%s", line);
    fflush(stdout);
    p->shown = true;
}

/* Takes the progress line off the terminal, so that other lines can be written. */
static void ft_progress_clear(ft_progress *p) {
    if (!p->shown) return;
    printf("\r\033[K");
    fflush(stdout);
    p->shown = false;
}

/* Writes one line to f (stdout: not when quiet) above the progress line. */
static void ft_say(ft_progress *p, FILE *f, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static void ft_say(ft_progress *p, FILE *f, const char *fmt, ...) {
    if (f == stdout && p->quiet) return;
    ft_progress_clear(p);
    va_list ap;
    va_start(ap, fmt);
    vfprintf(f, fmt, ap);
    va_end(ap);
    fputc('\n', f);
    fflush(f);
    ft_progress_draw(p);
}

/* ---- following ----------------------------------------------------------------------------------------- */

static volatile sig_atomic_t ft_interrupted;

static void ft_on_sigint(int sig) {
    (void)sig;
    ft_interrupted = 1;
}

/* One metrics event's data into p; a line of its own when stdout is no terminal. */
static void ft_on_metrics(ft_progress *p, const json_t *d) {
    const json_t *step = json_object_get(d, "step"), *total = json_object_get(d, "total_steps");
    const json_t *valid = json_object_get(d, "valid_loss");
    if (!json_is_number(step)) return;
    p->step = (long)json_number_value(step);
    if (json_is_number(total)) p->total = (long)json_number_value(total);
    p->loss = json_number_value(json_object_get(d, "train_loss"));
    if (json_is_number(valid)) p->valid = json_number_value(valid);
    if (p->quiet || p->tty) return;
    char line[256];
    ft_progress_text(p, line, sizeof line);
    printf("%s\n", line);
    fflush(stdout);
}

/* Shows one event: metrics into the progress, anything else as a line. */
static void ft_on_event(ft_progress *p, const json_t *e) {
    const char *type = ft_str(e, "type", ""), *level = ft_str(e, "level", "info");
    if (!strcmp(type, "metrics")) {
        ft_on_metrics(p, json_object_get(e, "data"));
        return;
    }
    const char *msg = ft_str(e, "message", "");
    if (!strcmp(level, "info")) ft_say(p, stdout, "%s", msg);
    else ft_say(p, stdout, "%s: %s", level, msg);
}

/* Appends to `fresh` the events of page `doc` (newest first) newer than `last` (NULL: all);
 * *more: whether older ones may still be new (the page ended before `last`, the server has more). */
static void ft_events_page(const json_t *doc, const char *last, json_t *fresh, bool *more) {
    const json_t *data = json_object_get(doc, "data");
    json_t *e;
    size_t i;
    *more = json_is_true(json_object_get(doc, "has_more"));
    json_array_foreach(data, i, e) {
        const char *id = ft_str(e, "id", NULL);
        if (!id || (last && !strcmp(id, last))) {
            *more = false;
            return;
        }
        json_array_append(fresh, e);
    }
    if (!json_array_size(data)) *more = false;
}

/* The job's events newer than `last` (NULL: all), newest first, into *fresh (new reference). */
static int ft_events_new(ft_client *c, const char *job, const char *last, json_t **fresh) {
    json_t *doc = NULL;
    int rc = (*fresh = json_array()) ? FU_OK : fu_errorf(FU_ERR_NOMEM, "out of memory");
    bool more = true;
    for (int page = 0; !rc && more && page < FT_MAX_PAGES; page++) {
        fu_buf path = {0};
        rc = ft_path(c, "/v1/fine_tuning/jobs/", job, "/events?limit=100", &path);
        size_t n = json_array_size(*fresh);
        const char *after = n ? ft_str(json_array_get(*fresh, n - 1), "id", NULL) : NULL;
        if (!rc && after) rc = ft_path(c, "&after=", after, NULL, &path);
        json_decref(doc);
        doc = NULL;
        if (!rc) rc = ft_call(c, "GET", path.data, NULL, NULL, &doc);
        if (!rc) ft_events_page(doc, last, *fresh, &more);
        fu_buf_free(&path);
    }
    json_decref(doc);
    return rc;
}

/* Shows the events that are new since last time; *last (malloc'd) becomes the newest one's id. */
static int ft_poll_events(ft_client *c, const char *job, ft_progress *p, char **last) {
    json_t *fresh;
    int rc = ft_events_new(c, job, *last, &fresh);
    size_t n = rc ? 0 : json_array_size(fresh);
    for (size_t i = n; i-- > 0;) ft_on_event(p, json_array_get(fresh, i)); /* oldest first */
    if (n) {
        char *id = strdup(ft_str(json_array_get(fresh, 0), "id", ""));
        if (id) free(*last), *last = id;
    }
    json_decref(fresh);
    if (p->base_t <= 0 && p->step > 0) p->base_t = fu_now_s(), p->base_step = p->step;
    ft_progress_draw(p);
    return rc;
}

/* The rate and the estimate of job object j into p. */
static void ft_on_job(ft_progress *p, const json_t *j) {
    const json_t *tok = json_object_get(j, "trained_tokens"), *fin = json_object_get(j, "estimated_finish");
    p->finish = json_is_number(fin) ? json_number_value(fin) : 0;
    if (!json_is_integer(tok)) return;
    long long n = (long long)json_integer_value(tok);
    double now = fu_now_s();
    if (p->tok0 < 0) p->tok0 = n, p->tok_t = now;
    else if (n > p->tok0 && now > p->tok_t) p->tok_rate = (double)(n - p->tok0) / (now - p->tok_t);
}

/* Sleeps ms milliseconds unless interrupted first. */
static void ft_nap(long ms) {
    for (long t = 0; t < ms && !ft_interrupted; t += 50) fu_sleep_ms(50);
}

/* Polls job `id` until it ends or an interrupt: *job becomes its last object (new reference,
 * NULL when interrupted). Network errors are retried FT_MAX_RETRIES times in a row. */
static int ft_poll(ft_client *c, const char *id, ft_progress *p, json_t **job) {
    fu_buf path = {0};
    char *last = NULL;
    int rc = ft_path(c, "/v1/fine_tuning/jobs/", id, NULL, &path), failures = 0;
    for (*job = NULL; !rc && !ft_interrupted && !*job;) {
        json_t *j = NULL;
        rc = ft_call(c, "GET", path.data, NULL, NULL, &j);
        if (!rc) ft_on_job(p, j);
        if (!rc) rc = ft_poll_events(c, id, p, &last);
        const char *st = rc ? "" : ft_str(j, "status", NULL);
        if (!rc && !st) rc = fu_errorf(FU_ERR_NETWORK, "GET %s: the reply has no status", path.data);
        if (rc) st = "";
        if (!strcmp(st, "succeeded") || !strcmp(st, "failed") || !strcmp(st, "cancelled")) *job = json_incref(j);
        json_decref(j);
        failures = rc == FU_ERR_NETWORK ? failures + 1 : 0;
        if (rc == FU_ERR_NETWORK && failures < FT_MAX_RETRIES) {
            ft_say(p, stderr, "%s: %s (retrying)", FT_PROG, fu_last_error());
            rc = FU_OK;
        }
        if (!rc && !*job) ft_nap(FT_POLL_MS);
    }
    free(last);
    fu_buf_free(&path);
    return rc;
}

/* ---- the end ------------------------------------------------------------------------------------------- */

/* Downloads file `id` into dir, named as the server names it. */
static int ft_download(ft_client *c, const char *id, const char *dir, ft_progress *p) {
    fu_buf path = {0}, body = {0}, out = {0};
    json_t *meta = NULL;
    int rc = ft_path(c, "/v1/files/", id, NULL, &path);
    if (!rc) rc = ft_call(c, "GET", path.data, NULL, NULL, &meta);
    const char *name = meta ? ft_str(meta, "filename", id) : id, *slash = strrchr(name, '/');
    name = slash ? slash + 1 : name;
    if (!name[0] || !strcmp(name, ".") || !strcmp(name, "..")) name = id;
    if (!rc && !fu_buf_append(&path, "/content", 8)) rc = ft_request(c, "GET", path.data, NULL, NULL, &body);
    if (!rc && fu_buf_appendf(&out, "%s/%s", dir, name)) rc = fu_errorf(FU_ERR_NOMEM, "out of memory");
    FILE *f = rc ? NULL : fopen(out.data, "wb");
    if (!rc && !f) rc = fu_errorf(FU_ERR_IO, "%s: %s", out.data, strerror(errno));
    if (f && ((body.len && fwrite(body.data, 1, body.len, f) != body.len) | (fclose(f) != 0)))
        rc = fu_errorf(FU_ERR_IO, "%s: cannot write", out.data);
    if (!rc) ft_say(p, stdout, "Wrote %s", out.data);
    json_decref(meta);
    fu_buf_free(&path), fu_buf_free(&body), fu_buf_free(&out);
    return rc;
}

/* Downloads every file of the job's result_files into dir (made if needed). */
static int ft_results(ft_client *c, const json_t *job, const char *dir, ft_progress *p) {
    if (mkdir(dir, 0777) && errno != EEXIST) return fu_errorf(FU_ERR_IO, "%s: %s", dir, strerror(errno));
    const json_t *files = json_object_get(job, "result_files"), *v;
    size_t i;
    int rc = FU_OK;
    json_array_foreach(files, i, v) {
        if (json_is_string(v) && !rc) rc = ft_download(c, json_string_value(v), dir, p);
    }
    if (!rc && !json_array_size(files)) ft_say(p, stderr, "%s: the job has no result files", FT_PROG);
    return rc;
}

/* The exit status of ended job j: its model on stdout when it succeeded, else why not. */
static int ft_finish(ft_client *c, const ft_args *a, const json_t *j, ft_progress *p) {
    const char *st = ft_str(j, "status", ""), *id = ft_str(j, "id", "?");
    const json_t *err = json_object_get(j, "error");
    if (p->shown) { /* the last progress line stays on the screen */
        printf("\n");
        p->shown = false;
    }
    if (!strcmp(st, "failed")) {
        fprintf(stderr, "%s: job %s failed: %s: %s\n", FT_PROG, id, ft_str(err, "code", "error"),
                ft_str(err, "message", "(no message)"));
        return 1;
    }
    if (strcmp(st, "succeeded")) {
        fprintf(stderr, "%s: job %s was %s\n", FT_PROG, id, st);
        return 1;
    }
    const char *model = ft_str(j, "fine_tuned_model", NULL);
    if (a->results && ft_results(c, j, a->results, p)) fprintf(stderr, "%s: %s\n", FT_PROG, fu_last_error());
    if (!model) fprintf(stderr, "%s: job %s succeeded without a fine_tuned_model\n", FT_PROG, id);
    else printf("%s\n", model);
    return model && fflush(stdout) == 0 ? 0 : 1;
}

/* Cancels job id after an interrupt; FT_EXIT_INTERRUPTED. */
static int ft_cancel(ft_client *c, const char *id, ft_progress *p) {
    fu_buf path = {0};
    json_t *j = NULL;
    ft_progress_clear(p);
    int rc = ft_path(c, "/v1/fine_tuning/jobs/", id, "/cancel", &path);
    if (!rc) rc = ft_call(c, "POST", path.data, NULL, NULL, &j);
    if (rc) fprintf(stderr, "%s: interrupted; cannot cancel job %s: %s\n", FT_PROG, id, fu_last_error());
    else fprintf(stderr, "%s: interrupted; job %s is %s\n", FT_PROG, id, ft_str(j, "status", "cancelled"));
    json_decref(j);
    fu_buf_free(&path);
    return FT_EXIT_INTERRUPTED;
}

/* Follows job id to its end; the exit status. */
static int ft_follow(ft_client *c, const ft_args *a, const char *id) {
    ft_progress p = {.tty = isatty(STDOUT_FILENO), .quiet = a->quiet, .valid = NAN, .tok0 = -1};
    json_t *job = NULL;
    if (!a->quiet) printf("Following %s\n", id), fflush(stdout);
    int rc = ft_poll(c, id, &p, &job);
    int status = ft_interrupted ? ft_cancel(c, id, &p) : 1;
    if (!ft_interrupted && rc) {
        ft_progress_clear(&p);
        fprintf(stderr, "%s: %s\n", FT_PROG, fu_last_error());
    }
    if (!ft_interrupted && !rc) status = ft_finish(c, a, job, &p);
    json_decref(job);
    return status;
}

/* ---- main ------------------------------------------------------------------------------------------------ */

/* Uploads the data (and the validation file) and creates the job; its id into *id (malloc'd). */
static int ft_start(ft_client *c, ft_args *a, const char *data, char **id) {
    char *train = NULL, *valid = NULL;
    int rc = ft_upload(c, data, &train);
    if (!rc && !a->quiet) printf("Uploaded %s as %s\n", data, train);
    if (!rc && a->validation) rc = ft_upload(c, a->validation, &valid);
    if (!rc && valid && !a->quiet) printf("Uploaded %s as %s\n", a->validation, valid);
    if (!rc && !a->model) rc = ft_default_model(c, &a->model);
    if (!rc && !ft_interrupted) rc = ft_create(c, a, a->model, train, valid, id);
    if (!rc && *id && !a->quiet) printf("Created %s: fine-tuning %s\n", *id, a->model);
    fflush(stdout);
    free(train);
    free(valid);
    return rc;
}

/* Runs the command: a new job on `data` (NULL with --follow), followed unless --no-follow. */
static int ft_main(ft_args *a, const char *data) {
    ft_client c;
    char *id = NULL;
    int rc = ft_client_init(&c, a->url, a->api_key), status = 1;
    if (!rc && data) rc = ft_start(&c, a, data, &id);
    if (!rc && !data && !(id = strdup(a->follow))) rc = fu_errorf(FU_ERR_NOMEM, "out of memory");
    if (rc) fprintf(stderr, "%s: %s\n", FT_PROG, fu_last_error());
    else if (ft_interrupted && !id) status = FT_EXIT_INTERRUPTED;
    else if (a->no_follow) status = printf("%s\n", id) < 0 || fflush(stdout) ? 1 : 0;
    else status = ft_follow(&c, a, id);
    free(id);
    ft_client_free(&c);
    return status;
}

/* Fills what neither a flag nor the config set from the environment and the defaults. */
static int ft_defaults(ft_args *a) {
    const char *url = getenv("FUSION_URL"), *key = getenv("FUSION_API_KEY");
    if (!key || !key[0]) key = getenv("OPENAI_API_KEY");
    if (!a->url && !(a->url = strdup(url && url[0] ? url : FT_DEFAULT_URL))) return FU_ERR_NOMEM;
    if (!a->api_key && key && !(a->api_key = strdup(key))) return FU_ERR_NOMEM;
    return FU_OK;
}

int main(int argc, char **argv) {
    args.lr_multiplier = args.lora_alpha = args.lora_dropout = NAN;
    int n_data = 0;
    int status = fu_opt_main(&ft_spec, argc, argv, &n_data);
    if (status < 0 && n_data > 1)
        status = fu_opt_fail(&ft_spec, "more than one data file ('%s', '%s')", argv[1], argv[2]);
    if (status < 0 && n_data == 1 && args.follow) status = fu_opt_fail(&ft_spec, "--follow takes no data file");
    if (status < 0 && n_data == 0 && !args.follow) status = fu_opt_fail(&ft_spec, "no data file");
    if (status < 0 && ft_defaults(&args)) fprintf(stderr, "%s: out of memory\n", FT_PROG), status = 1;
    if (status < 0) {
        struct sigaction sa = {.sa_handler = ft_on_sigint, .sa_flags = SA_RESETHAND};
        sigemptyset(&sa.sa_mask);
        sigaction(SIGINT, &sa, NULL);
        curl_global_init(CURL_GLOBAL_DEFAULT);
        status = ft_main(&args, n_data ? argv[1] : NULL);
        curl_global_cleanup();
    }
    fu_opt_free(ft_options);
    return status;
}
