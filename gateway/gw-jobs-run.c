/* gw-jobs-run.c -- the fine-tuning runner: examples, stages on the chain's hops, steps, checkpoints, the final adapter. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "chat-train.h"
#include "gw-jobs-impl.h"
#include "log.h"
#include "lora.h"
#include "mapped-file.h"
#include "rpc-base.h"
#include "status.h"
#include "train-remote.h"
#include "train-run.h"

#define GW_RUN_MAX_TOKENS 512 /* rows per micro-batch at least (longer examples raise it) */

/* One job's run: its examples, its stages and what it has done. */
typedef struct gw_run {
    gw_jobs *j;
    gw_ftjob jb;
    trn_example *ex;
    int n_ex, max_len;
    int epochs, batch;
    double lr;
    lora_config lora;
    rpc_channel *ch[GW_MAX_HOPS];
    trn_remote *rem[GW_MAX_HOPS];
    trn_stage stages[GW_MAX_HOPS];
    int n;
    int64_t start_step;        /* steps done before (a resumed job) */
    char resume_dir[4096];     /* the checkpoint resumed from; "" when none */
} gw_run;

static void gw_run_free(gw_run *r) {
    for (int i = 0; i < r->n_ex; i++) free((void *)r->ex[i].tokens), free((void *)r->ex[i].target);
    free(r->ex);
    for (int i = 0; i < GW_MAX_HOPS; i++) trn_remote_close(r->rem[i]), rpc_channel_free(r->ch[i]);
}

/* Fails the job with error {code, message, param}. */
static void gw_run_fail(gw_run *r, const char *code, const char *param, const char *msg) {
    json_t *e = json_pack("{s:s, s:s, s:o}", "code", code, "message", msg, "param", param ? json_string(param) : json_null());
    char *text = e ? json_dumps(e, JSON_COMPACT) : NULL;
    snprintf(r->jb.error, sizeof r->jb.error, "%s", text ? text : "");
    free(text), json_decref(e);
    snprintf(r->jb.status, sizeof r->jb.status, "failed");
    r->jb.finished_at = (int64_t)time(NULL);
    if (!gw_store_job_update(r->j->store, &r->jb)) gw_jobs_event(r->j, r->jb.id, "error", "message", NULL, "%s", msg);
    FU_WARN("fine-tuning job %s failed: %s", r->jb.id, msg);
}

/* Sets the job's status (FU_ERR_NOT_FOUND: it was cancelled meanwhile). */
static int gw_run_status(gw_run *r, const char *status) {
    snprintf(r->jb.status, sizeof r->jb.status, "%s", status);
    return gw_store_job_update(r->j->store, &r->jb);
}

/* Whether the run must stop: the gateway stops, or the job is no longer live. */
static bool gw_run_stopped(gw_run *r) {
    pthread_mutex_lock(&r->j->mu);
    bool stop = r->j->stopping;
    pthread_mutex_unlock(&r->j->mu);
    gw_ftjob *now = malloc(sizeof *now);
    if (!stop && now && !gw_store_job_get(r->j->store, r->jb.id, NULL, now)) stop = strcmp(now->status, "running") != 0;
    free(now);
    return stop;
}

/* One line of the training file into r->ex. */
static int gw_run_line(gw_run *r, const char *text, size_t len, int line) {
    const gw_model *m = r->j->model;
    int32_t *tok = NULL, *tg = NULL;
    size_t n = 0;
    int rc = chat_train_line(m->tpl, m->tok, m->vocab, text, len, &tok, &tg, &n);
    trn_example *grown = rc ? NULL : realloc(r->ex, (size_t)(r->n_ex + 1) * sizeof *grown);
    if (!rc && !grown) rc = fu_errorf(FU_ERR_NOMEM, "out of memory");
    if (rc) {
        free(tok), free(tg);
        return fu_errorf(rc, "line %d: %s", line, fu_last_error());
    }
    r->ex = grown;
    r->ex[r->n_ex++] = (trn_example){(int)n, tok, tg};
    if ((int)n > r->max_len) r->max_len = (int)n;
    return FU_OK;
}

/* The training file's examples (tokenized with the model's chat template). */
static int gw_run_examples(gw_run *r) {
    char path[PATH_MAX], *text = NULL;
    size_t len = 0;
    int rc = gw_files_path(r->j->files, r->jb.training_file, path);
    if (!rc) rc = mf_read(path, (size_t)1 << 32, &text, &len);
    int line = 0;
    for (size_t at = 0; !rc && at < len;) {
        const char *nl = memchr(text + at, '\n', len - at);
        size_t n = nl ? (size_t)(nl - (text + at)) : len - at;
        line++;
        if (strspn(text + at, " \t\r") < n) rc = gw_run_line(r, text + at, n, line);
        at += n + 1;
    }
    free(text);
    return !rc && !r->n_ex ? fu_errorf(FU_ERR_FORMAT, "the training file has no examples") : rc;
}

/* The job's hyperparameters and LoRA settings into r. */
static int gw_run_settings(gw_run *r) {
    json_t *hp = json_loads(r->jb.hyperparameters, 0, NULL), *l = json_loads(r->jb.lora, 0, NULL);
    int rc = hp && l ? FU_OK : fu_errorf(FU_ERR_FORMAT, "the job's settings do not parse");
    if (!rc) {
        r->epochs = (int)json_integer_value(json_object_get(hp, "n_epochs"));
        r->batch = (int)json_integer_value(json_object_get(hp, "batch_size"));
        r->lr = 2e-4 * json_number_value(json_object_get(hp, "learning_rate_multiplier"));
        r->lora = lora_config_default();
        r->lora.r = (int)json_integer_value(json_object_get(l, "r"));
        r->lora.alpha = (float)json_number_value(json_object_get(l, "alpha"));
        r->lora.dropout = (float)json_number_value(json_object_get(l, "dropout"));
        snprintf(r->lora.base_model, sizeof r->lora.base_model, "%s", r->jb.model);
        rc = lora_targets_parse(json_string_value(json_object_get(l, "target_modules")), &r->lora.targets);
    }
    if (!rc && (r->epochs < 1 || r->batch < 1)) rc = fu_errorf(FU_ERR_FORMAT, "bad hyperparameters");
    json_decref(hp), json_decref(l);
    return rc;
}

/* Stage i on hop i of the static chain (from the resumed checkpoint's state when there is one). */
static int gw_run_stage(gw_run *r, int i, int max_tokens) {
    const gw_config *cfg = r->j->cfg;
    const gw_hop_cfg *h = &cfg->hops[i];
    rpc_channel_options co = {.tls_ca = cfg->tls_ca, .insecure = cfg->insecure, .secret = cfg->secret};
    gw_client_pair(cfg, &co.tls_client_cert, &co.tls_client_key);
    char job[128];
    snprintf(job, sizeof job, "%s-%lld-%d", r->jb.id, (long long)time(NULL), i);
    trn_remote_options o = {.job_id = job, .first_block = h->first, .last_block = h->last, .embed = h->first == 0,
                            .head = h->last == r->j->model->n_layers, .lora = &r->lora,
                            .init_seed = (uint64_t)r->jb.seed, .max_tokens = max_tokens, .slots = 1,
                            .dim = cfg->hidden_size, .timeout_ms = 600 * 1000};
    trn_state st = {0};
    int rc = rpc_channel_new(h->address, &co, &r->ch[i]);
    if (!rc && r->resume_dir[0]) rc = trn_state_load(r->resume_dir, r->j->model->mdl, h->first, h->last, 4096, &st);
    if (!rc) rc = trn_remote_open(r->ch[i], &o, r->resume_dir[0] ? &st : NULL, &r->rem[i]);
    if (!rc) r->stages[i] = trn_remote_stage(r->rem[i]);
    trn_state_clear(&st);
    return rc ? fu_errorf(rc, "hop %s: %s", h->address, fu_last_error()) : FU_OK;
}

/* The last checkpoint of the job, if any: where to resume from. */
static void gw_run_find_resume(gw_run *r) {
    gw_page_query q = {r->jb.id, NULL, 1};
    gw_ftckpt *c = NULL;
    size_t n = 0;
    bool more;
    if (!gw_store_ckpt_list(r->j->store, &q, &c, &n, &more) && n) {
        char leaf[64];
        snprintf(leaf, sizeof leaf, "ckpt-step-%lld", (long long)c->step_number);
        gw_jobs_dir(r->j, r->jb.id, leaf, r->resume_dir, sizeof r->resume_dir);
        r->start_step = c->step_number;
    }
    free(c);
}

/* Every stage of the static chain. */
static int gw_run_stages(gw_run *r) {
    const gw_config *cfg = r->j->cfg;
    if (cfg->n_shards > 0 || cfg->n_hops == 0 || !r->j->model->mdl)
        return fu_errorf(FU_ERR_UNSUPPORTED, "fine-tuning runs over a static chain (--hop); this gateway routes a "
                                             "swarm, which cannot train yet");
    int max_tokens = r->max_len > GW_RUN_MAX_TOKENS ? r->max_len : GW_RUN_MAX_TOKENS, rc = FU_OK;
    gw_run_find_resume(r);
    for (int i = 0; i < cfg->n_hops && !rc; i++, r->n++) rc = gw_run_stage(r, i, max_tokens);
    return rc;
}

/* ---- adapters ------------------------------------------------------------------------------------- */

/* mkdir -p of the job's directory. */
static int gw_run_mkdirs(const char *path) {
    char p[PATH_MAX];
    snprintf(p, sizeof p, "%s", path);
    for (char *s = p + 1; *s; s++) {
        if (*s != '/') continue;
        *s = '\0';
        if (mkdir(p, 0700) && errno != EEXIST) return fu_errorf(FU_ERR_IO, "mkdir %s: %s", p, strerror(errno));
        *s = '/';
    }
    return mkdir(p, 0700) && errno != EEXIST ? fu_errorf(FU_ERR_IO, "mkdir %s: %s", p, strerror(errno)) : FU_OK;
}

/* Removes an adapter directory written by lora_save (its two files, then itself). */
static void gw_run_rmdir(const char *dir) {
    char p[PATH_MAX + 32];
    snprintf(p, sizeof p, "%s/adapter_config.json", dir);
    unlink(p);
    snprintf(p, sizeof p, "%s/adapter_model.safetensors", dir);
    unlink(p);
    rmdir(dir);
}

/* The whole adapter, assembled from the stages' states, saved atomically to DATA_DIR/jobs/<id>/leaf
 * (written to leaf.tmp, then renamed). */
static int gw_run_save(gw_run *r, trn_run *run, const char *leaf, char *dir, size_t cap) {
    char tmp[PATH_MAX];
    gw_jobs_dir(r->j, r->jb.id, leaf, dir, cap);
    snprintf(tmp, sizeof tmp, "%s.tmp", dir);
    gw_run_rmdir(tmp);
    lora_adapter *whole = NULL;
    int rc = gw_run_mkdirs(tmp);
    if (!rc) rc = lora_new(&r->lora, r->j->model->mdl, 0, r->j->model->n_layers, 0, &whole);
    if (!rc) rc = trn_run_params(run, whole->data, whole->n_floats);
    if (!rc) whole->qk_interleaved = false, rc = lora_save(whole, tmp);
    lora_free(whole);
    if (!rc) gw_run_rmdir(dir);
    if (!rc && rename(tmp, dir)) rc = fu_errorf(FU_ERR_IO, "rename %s: %s", tmp, strerror(errno));
    return rc;
}

/* Serves the adapter in dir as model `name` (a name already served is left as it is). */
static int gw_run_serve(gw_jobs *j, const char *name, const char *dir) {
    gw_error err;
    if (!j->model->loras) return fu_errorf(FU_ERR_UNSUPPORTED, "this gateway serves no adapters");
    if (gw_lora_add(j->model->loras, name, dir, j->model->name, false, &err) && !strstr(err.message, "already"))
        return fu_errorf(FU_ERR_INVALID, "%s", err.message);
    return FU_OK;
}

/* The checkpoint after `step`: saved, recorded, served. */
static void gw_run_checkpoint(gw_run *r, trn_run *run, int64_t step, const trn_step_result *res) {
    gw_ftckpt c = {.step_number = step, .created_at = (int64_t)time(NULL)};
    char leaf[64], dir[PATH_MAX];
    snprintf(leaf, sizeof leaf, "ckpt-step-%lld", (long long)step);
    snprintf(c.job_id, sizeof c.job_id, "%s", r->jb.id);
    snprintf(c.metrics, sizeof c.metrics, "{\"step\":%lld,\"train_loss\":%.6f,\"train_mean_token_accuracy\":%.6f}",
             (long long)step, res->loss, res->accuracy);
    gw_jobs_model_name(r->j, &r->jb, step, c.model, sizeof c.model);
    int rc = gw_run_save(r, run, leaf, dir, sizeof dir);
    if (!rc) rc = gw_jobs_new_id("ftckpt-", c.id);
    if (!rc) rc = gw_store_ckpt_insert(r->j->store, &c);
    if (!rc && gw_run_serve(r->j, c.model, dir))
        gw_jobs_event(r->j, r->jb.id, "warn", "message", NULL, "Checkpoint %s is saved but not served: %s", c.model,
                      fu_last_error());
    if (rc) gw_jobs_event(r->j, r->jb.id, "warn", "message", NULL, "Checkpoint at step %lld failed: %s",
                          (long long)step, fu_last_error());
}

/* ---- steps ---------------------------------------------------------------------------------------- */

/* The metrics event of one step. */
static void gw_run_metrics(gw_run *r, int64_t total, const trn_step_result *res) {
    json_t *d = json_pack("{s:I, s:f, s:f, s:I, s:f, s:f}", "step", (json_int_t)res->step, "train_loss", res->loss,
                          "train_mean_token_accuracy", res->accuracy, "total_steps", (json_int_t)total,
                          "learning_rate", (double)res->lr, "grad_norm", res->grad_norm);
    gw_jobs_event(r->j, r->jb.id, "info", "metrics", d, "Step %lld/%lld: training loss=%.4f", (long long)res->step,
                  (long long)total, res->loss);
    json_decref(d);
}

/* The run's options: AdamW, clip 1, 10% linear warm-up then cosine decay over `total` steps. */
static trn_run_options gw_run_options(const gw_run *r, int64_t total) {
    int max_tokens = r->max_len > GW_RUN_MAX_TOKENS ? r->max_len : GW_RUN_MAX_TOKENS;
    return (trn_run_options){.max_tokens = max_tokens, .pipeline = 1, .dim = r->j->cfg->hidden_size, .clip = 1.0f,
                             .adamw = {0.9f, 0.999f, 1e-8f, 0.0f},
                             .sched = {(float)r->lr, total / 10, total, TRN_DECAY_COSINE},
                             .seed = (uint64_t)r->jb.seed};
}

/* Every step from r->start_step: FU_OK when all ran, FU_ERR_CANCELLED... when stopped (*stopped). */
static int gw_run_steps(gw_run *r, trn_run *run, bool *stopped) {
    const int bs = r->batch < r->n_ex ? r->batch : r->n_ex, per_epoch = (r->n_ex + bs - 1) / bs;
    const int64_t total = (int64_t)per_epoch * r->epochs;
    int rc = FU_OK;
    for (int64_t s = r->start_step; s < total && !rc; s++) {
        if ((*stopped = gw_run_stopped(r))) return FU_OK;
        const int at = (int)(s % per_epoch) * bs, k = r->n_ex - at < bs ? r->n_ex - at : bs;
        trn_step_result res;
        if ((rc = trn_run_step(run, r->ex + at, k, &res))) break;
        for (int i = 0; i < k; i++) r->jb.trained_tokens += r->ex[at + i].n;
        gw_run_metrics(r, total, &res);
        if ((s + 1) % per_epoch == 0 && s + 1 < total) gw_run_checkpoint(r, run, s + 1, &res);
    }
    return rc;
}

/* ---- the result file ---------------------------------------------------------------------------------- */

/* step,train_loss,train_accuracy,learning_rate from the job's metrics events, as a results file. */
static int gw_run_results(gw_run *r) {
    gw_page_query q = {r->jb.id, NULL, 100000};
    gw_ftevent *ev = NULL;
    size_t n = 0;
    bool more;
    fu_buf csv = {0};
    int rc = gw_store_event_list(r->j->store, &q, &ev, &n, &more);
    if (!rc) rc = fu_buf_appendf(&csv, "step,train_loss,train_accuracy,learning_rate\n");
    for (size_t i = n; i-- > 0 && !rc;) { /* oldest first */
        json_t *d = strcmp(ev[i].type, "metrics") ? NULL : json_loads(ev[i].data, 0, NULL);
        if (d)
            rc = fu_buf_appendf(&csv, "%lld,%.6f,%.6f,%.6g\n", (long long)json_integer_value(json_object_get(d, "step")),
                               json_number_value(json_object_get(d, "train_loss")),
                               json_number_value(json_object_get(d, "train_mean_token_accuracy")),
                               json_number_value(json_object_get(d, "learning_rate")));
        json_decref(d);
    }
    gw_file f;
    if (!rc) rc = gw_files_add(r->j->files, r->jb.owner, "step_metrics.csv", "fine-tune-results", csv.data, csv.len, &f);
    if (!rc) snprintf(r->jb.result_files, sizeof r->jb.result_files, "[\"%s\"]", f.id);
    fu_buf_free(&csv);
    free(ev);
    return rc;
}

/* Trains, saves and serves the final adapter. */
static int gw_run_train(gw_run *r, bool *stopped) {
    const int bs = r->batch < r->n_ex ? r->batch : r->n_ex;
    const int64_t total = (int64_t)((r->n_ex + bs - 1) / bs) * r->epochs;
    trn_run_options o = gw_run_options(r, total);
    trn_run *run = NULL;
    char dir[PATH_MAX];
    int rc = trn_run_new(r->stages, r->n, &o, &run);
    if (!rc) trn_run_set_steps(run, r->start_step);
    if (!rc && r->start_step)
        gw_jobs_event(r->j, r->jb.id, "info", "message", NULL, "Resuming from step %lld", (long long)r->start_step);
    if (!rc) rc = gw_run_steps(r, run, stopped);
    if (!rc && !*stopped) rc = gw_run_save(r, run, "final", dir, sizeof dir);
    gw_jobs_model_name(r->j, &r->jb, 0, r->jb.fine_tuned_model, sizeof r->jb.fine_tuned_model);
    if (!rc && !*stopped) rc = gw_run_serve(r->j, r->jb.fine_tuned_model, dir);
    if (!rc && !*stopped) rc = gw_run_results(r);
    trn_run_free(run);
    return rc;
}

/* Runs job jb to its end (or the gateway's stop). */
static void gw_run_job(gw_jobs *j, const gw_ftjob *jb) {
    gw_run *r = calloc(1, sizeof *r);
    if (!r) return;
    r->j = j;
    r->jb = *jb;
    bool stopped = false;
    FU_INFO("fine-tuning job %s: starting", jb->id);
    int rc = gw_run_settings(r);
    if (!rc) rc = gw_run_examples(r);
    if (rc) gw_run_fail(r, "invalid_training_file", "training_file", fu_last_error());
    else if (!gw_run_status(r, "queued") && !gw_run_status(r, "running")) {
        gw_jobs_event(j, jb->id, "info", "message", NULL, "Fine-tuning job started: %d examples, %d epochs",
                      r->n_ex, r->epochs);
        if ((rc = gw_run_stages(r)) || (rc = gw_run_train(r, &stopped)))
            gw_run_fail(r, rc == FU_ERR_UNSUPPORTED ? "unsupported" : "training_failed", NULL, fu_last_error());
        else if (!stopped) {
            r->jb.finished_at = (int64_t)time(NULL);
            if (!gw_run_status(r, "succeeded"))
                gw_jobs_event(j, jb->id, "info", "message", NULL, "The job has successfully completed");
        }
    }
    gw_run_free(r);
    free(r);
}

void *gw_jobs_runner(void *arg) {
    gw_jobs *j = arg;
    gw_ftjob *jb = malloc(sizeof *jb);
    for (;;) {
        pthread_mutex_lock(&j->mu);
        bool stop = j->stopping;
        j->wake = false;
        pthread_mutex_unlock(&j->mu);
        if (stop || !jb) break;
        if (!gw_store_job_next(j->store, jb)) {
            gw_run_job(j, jb);
            continue;
        }
        pthread_mutex_lock(&j->mu);
        while (!j->wake && !j->stopping) pthread_cond_wait(&j->cv, &j->mu);
        pthread_mutex_unlock(&j->mu);
    }
    free(jb);
    return NULL;
}

/* ---- serving earlier jobs' adapters ------------------------------------------------------------------- */

/* Serves the checkpoints of job jb and, once it succeeded, its final adapter. */
static void gw_jobs_reserve_job(gw_jobs *j, const gw_ftjob *jb) {
    gw_page_query q = {jb->id, NULL, 1000};
    gw_ftckpt *c = NULL;
    size_t n = 0;
    bool more;
    char leaf[64], dir[PATH_MAX];
    if (!gw_store_ckpt_list(j->store, &q, &c, &n, &more))
        for (size_t i = n; i-- > 0;) {
            snprintf(leaf, sizeof leaf, "ckpt-step-%lld", (long long)c[i].step_number);
            gw_jobs_dir(j, jb->id, leaf, dir, sizeof dir);
            if (gw_run_serve(j, c[i].model, dir)) FU_WARN("%s: %s", c[i].model, fu_last_error());
        }
    free(c);
    gw_jobs_dir(j, jb->id, "final", dir, sizeof dir);
    if (!strcmp(jb->status, "succeeded") && gw_run_serve(j, jb->fine_tuned_model, dir))
        FU_WARN("%s: %s", jb->fine_tuned_model, fu_last_error());
}

void gw_jobs_reserve(gw_jobs *j) {
    gw_page_query q = {NULL, NULL, 100};
    char after[GW_JOB_ID_MAX];
    for (bool more = true; more;) {
        gw_ftjob *rows = NULL;
        size_t n = 0;
        if (gw_store_job_list(j->store, &q, &rows, &n, &more)) break;
        for (size_t i = 0; i < n; i++) gw_jobs_reserve_job(j, &rows[i]);
        if (n) snprintf(after, sizeof after, "%s", rows[n - 1].id), q.after = after;
        free(rows);
    }
}
