/* gw-jobs.c -- /v1/fine_tuning/jobs: request checks, the job, event and checkpoint objects, paging, cancel. */
#include "gw-jobs-impl.h"

#include <openssl/rand.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "gw-file-check.h"
#include "log.h"
#include "lora.h"
#include "parse.h"
#include "status.h"

/* ---- ids, names, events -------------------------------------------------------------------------- */

int gw_jobs_new_id(const char *prefix, char out[GW_JOB_ID_MAX]) {
    unsigned char r[12];
    if (RAND_bytes(r, sizeof r) != 1) return fu_errorf(FU_ERR_INTERNAL, "no random bytes for an id");
    int n = snprintf(out, GW_JOB_ID_MAX, "%s", prefix);
    for (size_t i = 0; i < sizeof r; i++) snprintf(out + n + 2 * i, 3, "%02x", r[i]);
    return FU_OK;
}

void gw_jobs_event(gw_jobs *j, const char *id, const char *level, const char *type, const json_t *data,
                   const char *fmt, ...) {
    gw_ftevent e = {.created_at = (int64_t)time(NULL)};
    snprintf(e.job_id, sizeof e.job_id, "%s", id);
    snprintf(e.level, sizeof e.level, "%s", level);
    snprintf(e.type, sizeof e.type, "%s", type);
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(e.message, sizeof e.message, fmt, ap);
    va_end(ap);
    char *text = data ? json_dumps(data, JSON_COMPACT) : NULL;
    if (text) snprintf(e.data, sizeof e.data, "%s", text);
    free(text);
    if (gw_jobs_new_id("ftevent-", e.id) || gw_store_event_insert(j->store, &e))
        FU_WARN("job %s: cannot record an event: %s", id, fu_last_error());
}

void gw_jobs_model_name(const gw_jobs *j, const gw_ftjob *jb, int64_t step, char *out, size_t cap) {
    int n = snprintf(out, cap, "ft:%s:%s:%s:%s", jb->model, j->cfg->ft_org ? j->cfg->ft_org : "fusion", jb->suffix,
                     jb->id);
    if (step > 0 && n > 0 && (size_t)n < cap) snprintf(out + n, cap - (size_t)n, ":ckpt-step-%lld", (long long)step);
}

void gw_jobs_dir(const gw_jobs *j, const char *id, const char *leaf, char *out, size_t cap) {
    if (leaf) snprintf(out, cap, "%s/jobs/%s/%s", gw_files_data_dir(j->files), id, leaf);
    else snprintf(out, cap, "%s/jobs/%s", gw_files_data_dir(j->files), id);
}

/* ---- objects ---------------------------------------------------------------------------------------- */

/* JSON text (a stored field) as a value: "" is null. */
static json_t *gw_json_field(const char *text) {
    json_t *v = text[0] ? json_loads(text, 0, NULL) : NULL;
    return v ? v : json_null();
}

/* An integer, or null when zero. */
static json_t *gw_json_int_or_null(int64_t v) {
    return v ? json_integer((json_int_t)v) : json_null();
}

/* OpenAI's FineTuningJob for jb (new reference). */
static json_t *gw_job_json(const gw_jobs *j, const gw_ftjob *jb) {
    json_t *hp = gw_json_field(jb->hyperparameters);
    json_t *method = json_pack("{s:s, s:{s:O}}", "type", "supervised", "supervised", "hyperparameters", hp);
    bool ended = !strcmp(jb->status, "succeeded") || !strcmp(jb->status, "failed") || !strcmp(jb->status, "cancelled");
    return json_pack("{s:s, s:s, s:I, s:o, s:o, s:o, s:o, s:s, s:s, s:o, s:I, s:s, s:o, s:s, s:o, s:o, s:n, s:o, "
                     "s:o, s:o}",
                     "id", jb->id, "object", "fine_tuning.job", "created_at", (json_int_t)jb->created_at, "error",
                     gw_json_field(jb->error), "fine_tuned_model",
                     jb->fine_tuned_model[0] ? json_string(jb->fine_tuned_model) : json_null(), "finished_at",
                     gw_json_int_or_null(jb->finished_at), "hyperparameters", hp, "model", jb->model,
                     "organization_id", j->cfg->ft_org ? j->cfg->ft_org : "fusion", "result_files",
                     gw_json_field(jb->result_files), "seed", (json_int_t)jb->seed, "status", jb->status,
                     "trained_tokens", ended || jb->trained_tokens ? json_integer(jb->trained_tokens) : json_null(),
                     "training_file", jb->training_file, "validation_file",
                     jb->validation_file[0] ? json_string(jb->validation_file) : json_null(), "estimated_finish",
                     gw_json_int_or_null(ended ? 0 : jb->estimated_finish), "integrations", "metadata",
                     gw_json_field(jb->metadata), "method", method, "lora", gw_json_field(jb->lora));
}

static json_t *gw_event_json(const gw_ftevent *e) {
    return json_pack("{s:s, s:s, s:I, s:s, s:s, s:s, s:o}", "id", e->id, "object", "fine_tuning.job.event",
                     "created_at", (json_int_t)e->created_at, "level", e->level, "message", e->message, "type",
                     e->type, "data", e->data[0] ? gw_json_field(e->data) : json_object());
}

static json_t *gw_ckpt_json(const gw_ftckpt *c) {
    return json_pack("{s:s, s:s, s:I, s:s, s:s, s:o, s:I}", "id", c->id, "object", "fine_tuning.job.checkpoint",
                     "created_at", (json_int_t)c->created_at, "fine_tuned_model_checkpoint", c->model,
                     "fine_tuning_job_id", c->job_id, "metrics", gw_json_field(c->metrics), "step_number",
                     (json_int_t)c->step_number);
}

/* ---- checks ------------------------------------------------------------------------------------------ */

/* A hyperparameter: absent or "auto" -> def; else a number in [lo, hi] (an integer when integral).
 * *out as resolved. 0 or 400 naming `param`. */
static int gw_hparam(const json_t *hp, const char *key, bool integral, double lo, double hi, double def,
                     double *out, gw_error *err) {
    const json_t *v = hp ? json_object_get(hp, key) : NULL;
    char param[64];
    snprintf(param, sizeof param, "hyperparameters.%s", key);
    *out = def;
    if (!v || json_is_null(v) || (json_is_string(v) && !strcmp(json_string_value(v), "auto"))) return 0;
    if (!json_is_number(v) || (integral && !json_is_integer(v)))
        return gw_error_set(err, 400, param, "invalid_value", "'%s' must be 'auto' or a%s number", key,
                            integral ? "n integer" : "");
    *out = json_number_value(v);
    if (*out < lo || *out > hi || (!integral && *out <= 0))
        return gw_error_set(err, 400, param, "invalid_value", "'%s' must lie in %s%g, %g]", key,
                            integral ? "[" : "(", lo, hi);
    return 0;
}

/* The method (or the legacy top-level hyperparameters) into jb->hyperparameters, resolved. */
static int gw_job_hparams(const json_t *body, int64_t n_examples, gw_ftjob *jb, gw_error *err) {
    const json_t *method = json_object_get(body, "method"), *hp = json_object_get(body, "hyperparameters");
    if (method && !json_is_null(method)) {
        const json_t *type = json_object_get(method, "type");
        if (!json_is_object(method) || !json_is_string(type) || strcmp(json_string_value(type), "supervised"))
            return gw_error_set(err, 400, "method.type", "invalid_value",
                                "method.type must be 'supervised' (this server trains LoRA adapters on chat data)");
        const json_t *sup = json_object_get(method, "supervised");
        hp = sup ? json_object_get(sup, "hyperparameters") : hp;
    }
    double epochs, batch, lrm, auto_batch = n_examples < 8 ? (double)(n_examples > 0 ? n_examples : 1) : 8;
    int rc = gw_hparam(hp, "n_epochs", true, 1, 50, 3, &epochs, err);
    if (!rc) rc = gw_hparam(hp, "batch_size", true, 1, 256, auto_batch, &batch, err);
    if (!rc) rc = gw_hparam(hp, "learning_rate_multiplier", false, 0, 10, 1, &lrm, err);
    if (rc) return rc;
    snprintf(jb->hyperparameters, sizeof jb->hyperparameters,
             "{\"n_epochs\":%d,\"batch_size\":%d,\"learning_rate_multiplier\":%.17g}", (int)epochs, (int)batch, lrm);
    return 0;
}

/* fusion's "lora" extension into jb->lora (defaults: r 16, alpha 2r, dropout 0, all-linear). */
static int gw_job_lora(const gw_jobs *j, const json_t *body, gw_ftjob *jb, gw_error *err) {
    const json_t *l = json_object_get(body, "lora"), *r = l ? json_object_get(l, "r") : NULL;
    const json_t *a = l ? json_object_get(l, "alpha") : NULL, *d = l ? json_object_get(l, "dropout") : NULL;
    const json_t *t = l ? json_object_get(l, "target_modules") : NULL;
    if (l && !json_is_object(l)) return gw_error_set(err, 400, "lora", "invalid_type", "'lora' must be an object");
    long rank = r ? (long)json_integer_value(r) : 16;
    if ((r && !json_is_integer(r)) || rank < 1 || rank > j->cfg->max_lora_rank)
        return gw_error_set(err, 400, "lora.r", "invalid_value", "lora.r must be an integer in [1, %d]",
                            j->cfg->max_lora_rank);
    double alpha = a ? json_number_value(a) : 2.0 * (double)rank, dropout = d ? json_number_value(d) : 0;
    if ((a && !json_is_number(a)) || alpha <= 0)
        return gw_error_set(err, 400, "lora.alpha", "invalid_value", "lora.alpha must be a positive number");
    if ((d && !json_is_number(d)) || dropout < 0 || dropout >= 1)
        return gw_error_set(err, 400, "lora.dropout", "invalid_value", "lora.dropout must lie in [0, 1)");
    char targets[256] = "all-linear";
    size_t i;
    const json_t *v;
    if (json_is_string(t)) snprintf(targets, sizeof targets, "%s", json_string_value(t));
    else if (json_is_array(t)) {
        targets[0] = '\0';
        json_array_foreach(t, i, v) if (json_is_string(v)) {
            size_t n = strlen(targets);
            snprintf(targets + n, sizeof targets - n, "%s%s", n ? "," : "", json_string_value(v));
        }
    }
    uint32_t bits;
    if ((t && !json_is_string(t) && !json_is_array(t)) || lora_targets_parse(targets, &bits))
        return gw_error_set(err, 400, "lora.target_modules", "invalid_value",
                            "lora.target_modules: 'all-linear' or PEFT module names (q_proj, ...)");
    json_t *o = json_pack("{s:i, s:f, s:f, s:s}", "r", (int)rank, "alpha", alpha, "dropout", dropout,
                          "target_modules", targets);
    char *text = o ? json_dumps(o, JSON_COMPACT) : NULL;
    if (text) snprintf(jb->lora, sizeof jb->lora, "%s", text);
    free(text), json_decref(o);
    return text ? 0 : gw_error_set(err, 500, NULL, NULL, "out of memory");
}

/* File `key` of body (required or not) as one owner may train on: into id[GW_FILE_ID_MAX]. */
static int gw_job_file(gw_jobs *j, const json_t *body, const char *key, bool required, const char *owner,
                       char *id, int64_t *n_examples, gw_error *err) {
    const json_t *v = json_object_get(body, key);
    if (!v || json_is_null(v)) {
        return required ? gw_error_set(err, 400, key, "missing_required_parameter", "'%s' is required", key) : 0;
    }
    gw_file f;
    if (!json_is_string(v) || gw_store_file_get(j->store, json_string_value(v), owner, &f))
        return gw_error_set(err, 400, key, "invalid_file", "%s: no such file: %.64s", key,
                            json_is_string(v) ? json_string_value(v) : "(not a string)");
    if (strcmp(f.status, "processed") || strcmp(f.purpose, "fine-tune"))
        return gw_error_set(err, 400, key, "invalid_file", "%s %s is not a processed fine-tune file", key, f.id);
    snprintf(id, GW_FILE_ID_MAX, "%s", f.id);
    if (n_examples) *n_examples = f.n_examples;
    return 0;
}

/* suffix, seed and metadata of body into jb. */
static int gw_job_extras(const json_t *body, gw_ftjob *jb, gw_error *err) {
    const json_t *s = json_object_get(body, "suffix"), *seed = json_object_get(body, "seed");
    const json_t *md = json_object_get(body, "metadata");
    if (s && !json_is_null(s)) {
        const char *t = json_is_string(s) ? json_string_value(s) : "";
        size_t n = strlen(t);
        if (n < 1 || n > 64 || strspn(t, "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_") != n)
            return gw_error_set(err, 400, "suffix", "invalid_value", "'suffix' must be 1..64 of [A-Za-z0-9-_]");
        snprintf(jb->suffix, sizeof jb->suffix, "%s", t);
    }
    if (seed && !json_is_null(seed) && (!json_is_integer(seed) || json_integer_value(seed) < 0))
        return gw_error_set(err, 400, "seed", "invalid_value", "'seed' must be a non-negative integer");
    jb->seed = seed && json_is_integer(seed) ? (int64_t)json_integer_value(seed) : (int64_t)(time(NULL) % 1000000007);
    if (md && !json_is_null(md)) {
        char *text = json_is_object(md) && json_object_size(md) <= 16 ? json_dumps(md, JSON_COMPACT) : NULL;
        if (!text || strlen(text) >= sizeof jb->metadata) {
            free(text);
            return gw_error_set(err, 400, "metadata", "invalid_value", "'metadata' must be an object of <= 16 pairs");
        }
        snprintf(jb->metadata, sizeof jb->metadata, "%s", text);
        free(text);
    }
    return 0;
}

int gw_jobs_create(gw_jobs *j, const char *owner, bool admin, const json_t *body, json_t **out, gw_error *err) {
    gw_ftjob *jb = calloc(1, sizeof *jb);
    if (!jb) return gw_error_set(err, 500, NULL, NULL, "out of memory");
    const json_t *model = json_object_get(body, "model");
    int64_t n_examples = 0;
    int rc = json_is_string(model) && !strcmp(json_string_value(model), j->model->name)
                 ? 0 : gw_error_set(err, 400, "model", "model_not_available",
                                    "'model' must be the served base model, %s", j->model->name);
    const char *fowner = admin ? NULL : owner;
    if (!rc) rc = gw_job_file(j, body, "training_file", true, fowner, jb->training_file, &n_examples, err);
    if (!rc && n_examples < GW_FILE_MIN_EXAMPLES)
        rc = gw_error_set(err, 400, "training_file", "invalid_n_examples",
                          "Training file has %lld example(s), but must have at least %d examples.",
                          (long long)n_examples, GW_FILE_MIN_EXAMPLES);
    if (!rc) rc = gw_job_file(j, body, "validation_file", false, fowner, jb->validation_file, NULL, err);
    if (!rc) rc = gw_job_hparams(body, n_examples, jb, err);
    if (!rc) rc = gw_job_lora(j, body, jb, err);
    if (!rc) rc = gw_job_extras(body, jb, err);
    snprintf(jb->model, sizeof jb->model, "%s", j->model->name);
    snprintf(jb->owner, sizeof jb->owner, "%s", owner);
    snprintf(jb->status, sizeof jb->status, "validating_files");
    snprintf(jb->result_files, sizeof jb->result_files, "[]");
    jb->created_at = (int64_t)time(NULL);
    if (!rc && (gw_jobs_new_id("ftjob-", jb->id) || gw_store_job_insert(j->store, jb))) {
        FU_ERROR("fine-tuning: %s", fu_last_error());
        rc = gw_error_set(err, 500, NULL, NULL, "cannot record the job");
    }
    if (!rc) {
        gw_jobs_event(j, jb->id, "info", "message", NULL, "Created fine-tuning job: %s", jb->id);
        gw_jobs_wake(j);
        if (!(*out = gw_job_json(j, jb))) rc = gw_error_set(err, 500, NULL, NULL, "out of memory");
    }
    free(jb);
    return rc;
}

/* ---- reads ------------------------------------------------------------------------------------------- */

/* The page query of ?after&limit (limit 1..100, default 20). 0 or 400. */
static int gw_page_args(const char *key, const char *after, const char *limit, gw_page_query *q, gw_error *err) {
    long n = 20;
    if (limit && fu_parse_long(limit, 1, 100, &n))
        return gw_error_set(err, 400, "limit", "invalid_value", "'limit' must be an integer in [1, 100]");
    *q = (gw_page_query){key, after && after[0] ? after : NULL, (int)n};
    return 0;
}

/* Job `id` as the caller sees it into *jb: 0 or 404/500. */
static int gw_job_find(gw_jobs *j, const char *owner, bool admin, const char *id, gw_ftjob *jb, gw_error *err) {
    int rc = gw_store_job_get(j->store, id, admin ? NULL : owner, jb);
    if (rc == FU_ERR_NOT_FOUND)
        return gw_error_set(err, 404, "id", "fine_tuning_job_not_found", "No such fine-tuning job: %.64s", id);
    return rc ? gw_error_set(err, 500, NULL, NULL, "the job database failed") : 0;
}

/* {object: "list", data, has_more} of n records at rows (size bytes each) made by fn. */
static int gw_page_json(const void *rows, size_t n, size_t size, json_t *(*fn)(const void *), bool has_more,
                        json_t **out, gw_error *err) {
    json_t *data = json_array();
    for (size_t i = 0; data && i < n; i++) json_array_append_new(data, fn((const char *)rows + i * size));
    *out = data ? json_pack("{s:s, s:o, s:b}", "object", "list", "data", data, "has_more", has_more) : NULL;
    return *out ? 0 : gw_error_set(err, 500, NULL, NULL, "out of memory");
}

static json_t *gw_event_json_row(const void *r) { return gw_event_json(r); }
static json_t *gw_ckpt_json_row(const void *r) { return gw_ckpt_json(r); }

/* A failed listing: 404 for an unknown `after`, else 500. */
static int gw_page_fail(int rc, gw_error *err) {
    if (rc == FU_ERR_NOT_FOUND) return gw_error_set(err, 400, "after", "invalid_value", "%s", fu_last_error());
    FU_ERROR("fine-tuning: %s", fu_last_error());
    return gw_error_set(err, 500, NULL, NULL, "the job database failed");
}

int gw_jobs_list(gw_jobs *j, const char *owner, bool admin, const char *after, const char *limit, json_t **out,
                 gw_error *err) {
    gw_page_query q;
    gw_ftjob *rows = NULL;
    size_t n = 0;
    bool more = false;
    int rc = gw_page_args(admin ? NULL : owner, after, limit, &q, err);
    if (rc) return rc;
    if ((rc = gw_store_job_list(j->store, &q, &rows, &n, &more))) return gw_page_fail(rc, err);
    json_t *data = json_array();
    for (size_t i = 0; data && i < n; i++) json_array_append_new(data, gw_job_json(j, &rows[i]));
    free(rows);
    *out = data ? json_pack("{s:s, s:o, s:b}", "object", "list", "data", data, "has_more", more) : NULL;
    rc = *out ? 0 : gw_error_set(err, 500, NULL, NULL, "out of memory");
    return rc;
}

int gw_jobs_get(gw_jobs *j, const char *owner, bool admin, const char *id, json_t **out, gw_error *err) {
    gw_ftjob *jb = malloc(sizeof *jb);
    int rc = jb ? gw_job_find(j, owner, admin, id, jb, err) : gw_error_set(err, 500, NULL, NULL, "out of memory");
    if (!rc && !(*out = gw_job_json(j, jb))) rc = gw_error_set(err, 500, NULL, NULL, "out of memory");
    free(jb);
    return rc;
}

int gw_jobs_cancel(gw_jobs *j, const char *owner, bool admin, const char *id, json_t **out, gw_error *err) {
    gw_ftjob *jb = malloc(sizeof *jb);
    int rc = jb ? gw_job_find(j, owner, admin, id, jb, err) : gw_error_set(err, 500, NULL, NULL, "out of memory");
    bool live = !rc && (!strcmp(jb->status, "validating_files") || !strcmp(jb->status, "queued") ||
                        !strcmp(jb->status, "running"));
    if (live && gw_store_job_cancel(j->store, jb->id, NULL, jb)) rc = gw_error_set(err, 500, NULL, NULL, "cannot cancel");
    if (live && !rc) {
        gw_jobs_event(j, jb->id, "info", "message", NULL, "Fine-tuning job cancelled");
        gw_jobs_wake(j);
    }
    if (!rc && !(*out = gw_job_json(j, jb))) rc = gw_error_set(err, 500, NULL, NULL, "out of memory");
    free(jb);
    return rc;
}

/* GET .../events or .../checkpoints (ckpts) of job id. */
static int gw_jobs_page(gw_jobs *j, const char *owner, bool admin, const char *id, const char *after,
                        const char *limit, bool ckpts, json_t **out, gw_error *err) {
    gw_ftjob *jb = malloc(sizeof *jb);
    gw_page_query q;
    void *rows = NULL;
    size_t n = 0;
    bool more = false;
    int rc = jb ? gw_job_find(j, owner, admin, id, jb, err) : gw_error_set(err, 500, NULL, NULL, "out of memory");
    free(jb);
    if (!rc) rc = gw_page_args(id, after, limit, &q, err);
    if (!rc && (rc = ckpts ? gw_store_ckpt_list(j->store, &q, (gw_ftckpt **)&rows, &n, &more)
                           : gw_store_event_list(j->store, &q, (gw_ftevent **)&rows, &n, &more)))
        rc = gw_page_fail(rc, err);
    if (!rc)
        rc = ckpts ? gw_page_json(rows, n, sizeof(gw_ftckpt), gw_ckpt_json_row, more, out, err)
                   : gw_page_json(rows, n, sizeof(gw_ftevent), gw_event_json_row, more, out, err);
    free(rows);
    return rc;
}

int gw_jobs_events(gw_jobs *j, const char *owner, bool admin, const char *id, const char *after, const char *limit,
                   json_t **out, gw_error *err) {
    return gw_jobs_page(j, owner, admin, id, after, limit, false, out, err);
}

int gw_jobs_checkpoints(gw_jobs *j, const char *owner, bool admin, const char *id, const char *after,
                        const char *limit, json_t **out, gw_error *err) {
    return gw_jobs_page(j, owner, admin, id, after, limit, true, out, err);
}

/* ---- life ------------------------------------------------------------------------------------------- */

void gw_jobs_wake(gw_jobs *j) {
    pthread_mutex_lock(&j->mu);
    j->gen++;
    pthread_cond_broadcast(&j->cv);
    pthread_mutex_unlock(&j->mu);
}

int gw_jobs_open(const gw_config *cfg, const gw_model *m, gw_files *files, gw_swarm *swarm, gw_jobs **out) {
    *out = NULL;
    gw_jobs *j = calloc(1, sizeof *j);
    if (!j) return fu_errorf(FU_ERR_NOMEM, "jobs");
    *j = (gw_jobs){.cfg = cfg, .model = m, .files = files, .store = gw_files_store(files), .swarm = swarm};
    pthread_mutex_init(&j->mu, NULL);
    pthread_cond_init(&j->cv, NULL);
    gw_jobs_reserve(j);
    j->n_slots = cfg->max_ft_jobs < 1 ? 1 : cfg->max_ft_jobs > GW_MAX_FT_JOBS ? GW_MAX_FT_JOBS : cfg->max_ft_jobs;
    for (int i = 0; i < j->n_slots; i++) {
        j->slots[i].j = j;
        if (!(j->slots[i].started = !pthread_create(&j->slots[i].thread, NULL, gw_jobs_runner, &j->slots[i]))) {
            gw_jobs_close(j);
            return fu_errorf(FU_ERR_INTERNAL, "cannot start the fine-tuning runners");
        }
    }
    *out = j;
    return FU_OK;
}

void gw_jobs_close(gw_jobs *j) {
    if (!j) return;
    pthread_mutex_lock(&j->mu);
    j->stopping = true;
    pthread_cond_broadcast(&j->cv);
    pthread_mutex_unlock(&j->mu);
    for (int i = 0; i < j->n_slots; i++)
        if (j->slots[i].started) pthread_join(j->slots[i].thread, NULL);
    pthread_cond_destroy(&j->cv);
    pthread_mutex_destroy(&j->mu);
    free(j);
}
