/* gw-jobs-run.c -- the fine-tuning runner: examples, stages on the chain's hops, steps, checkpoints, the final adapter. */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "chat-train.h"
#include "gw-plot.h"
#include "gw-jobs-impl.h"
#include "log.h"
#include "lora.h"
#include "mapped-file.h"
#include "rpc-base.h"
#include "status.h"
#include "train-remote.h"
#include "train-run.h"

#define GW_RUN_MAX_TOKENS 512 /* rows per micro-batch at least (longer examples raise it) */

/* The examples of one file, tokenized. */
typedef struct gw_examples {
    trn_example *ex;
    int n, max_len;
} gw_examples;

/* One job's run: its examples, its stages and what it has done. */
typedef struct gw_run {
    gw_jobs *j;
    gw_ftjob jb;
    gw_examples train, valid;  /* valid.n 0: no validation file */
    int epochs, batch;
    double lr;
    lora_config lora;
    gw_lease chain;            /* the hops trained on (no reservation: chain.path stays NULL) */
    int avoid[GW_MAX_HOPS];    /* swarm members this run lost */
    int n_avoid;
    rpc_channel *ch[GW_MAX_HOPS];
    trn_remote *rem[GW_MAX_HOPS];
    trn_stage stages[GW_MAX_HOPS];
    int n;
    int bs, per_epoch;         /* examples per step, steps per epoch */
    int64_t total;             /* steps of the whole job */
    int64_t start_step;        /* steps done before (a resumed job) */
    int64_t logged_step;       /* the last step with a metrics event already recorded */
    char resume_dir[4096];     /* the checkpoint resumed from; "" when none */
} gw_run;

static void gw_examples_free(gw_examples *e) {
    for (int i = 0; i < e->n; i++) free((void *)e->ex[i].tokens), free((void *)e->ex[i].target);
    free(e->ex);
}

/* Closes every stage and its channel. */
static void gw_run_close_stages(gw_run *r) {
    for (int i = 0; i < GW_MAX_HOPS; i++) {
        trn_remote_close(r->rem[i]), rpc_channel_free(r->ch[i]);
        r->rem[i] = NULL, r->ch[i] = NULL;
    }
    r->n = 0;
}

static void gw_run_free(gw_run *r) {
    gw_examples_free(&r->train), gw_examples_free(&r->valid);
    gw_run_close_stages(r);
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

/* One line of a data file into e. */
static int gw_run_line(const gw_model *m, gw_examples *e, const char *text, size_t len, int line) {
    int32_t *tok = NULL, *tg = NULL;
    size_t n = 0;
    int rc = chat_train_line(m->tpl, m->tok, m->vocab, text, len, &tok, &tg, &n);
    trn_example *grown = rc ? NULL : realloc(e->ex, (size_t)(e->n + 1) * sizeof *grown);
    if (!rc && !grown) rc = fu_errorf(FU_ERR_NOMEM, "out of memory");
    if (rc) {
        free(tok), free(tg);
        return fu_errorf(rc, "line %d: %s", line, fu_last_error());
    }
    e->ex = grown;
    e->ex[e->n++] = (trn_example){(int)n, tok, tg};
    if ((int)n > e->max_len) e->max_len = (int)n;
    return FU_OK;
}

/* The examples of uploaded file `id` (tokenized with the model's chat template) into e. */
static int gw_run_examples(gw_run *r, const char *id, gw_examples *e) {
    char path[PATH_MAX], *text = NULL;
    size_t len = 0;
    int rc = gw_files_path(r->j->files, id, path);
    if (!rc) rc = mf_read(path, (size_t)1 << 32, &text, &len);
    int line = 0;
    for (size_t at = 0; !rc && at < len;) {
        const char *nl = memchr(text + at, '\n', len - at);
        size_t n = nl ? (size_t)(nl - (text + at)) : len - at;
        line++;
        if (strspn(text + at, " \t\r") < n) rc = gw_run_line(r->j->model, e, text + at, n, line);
        at += n + 1;
    }
    free(text);
    return !rc && !e->n ? fu_errorf(FU_ERR_FORMAT, "the file has no examples") : rc;
}

/* The longest example of either file, at least GW_RUN_MAX_TOKENS: the rows of a micro-batch. */
static int gw_run_max_tokens(const gw_run *r) {
    int n = r->train.max_len > r->valid.max_len ? r->train.max_len : r->valid.max_len;
    return n > GW_RUN_MAX_TOKENS ? n : GW_RUN_MAX_TOKENS;
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

/* Stage i on hop i of the run's chain (from the resumed checkpoint's state when there is one). */
static int gw_run_stage(gw_run *r, int i, int max_tokens) {
    const gw_config *cfg = r->j->cfg;
    const chain_hop *h = &r->chain.hops[i];
    char job[128];
    snprintf(job, sizeof job, "%s-%lld-%d", r->jb.id, (long long)time(NULL), i);
    trn_remote_options o = {.job_id = job, .first_block = h->first_block, .last_block = h->last_block,
                            .embed = h->first_block == 0, .head = h->last_block == r->j->model->n_layers,
                            .lora = &r->lora, .init_seed = (uint64_t)r->jb.seed, .max_tokens = max_tokens,
                            .slots = 1, .dim = cfg->hidden_size, .timeout_ms = 600 * 1000};
    trn_state st = {0};
    int rc = gw_channel_new(cfg, h->address, &r->ch[i]);
    if (!rc && r->resume_dir[0])
        rc = trn_state_load(r->resume_dir, r->j->model->mdl, h->first_block, h->last_block, 4096, &st);
    if (!rc) rc = trn_remote_open(r->ch[i], &o, r->resume_dir[0] ? &st : NULL, &r->rem[i]);
    if (!rc) r->stages[i] = trn_remote_stage(r->rem[i]);
    trn_state_clear(&st);
    return rc ? fu_errorf(rc, "hop %s: %s", h->address, fu_last_error()) : FU_OK;
}

/* The last checkpoint of the job, if any: where to resume from (else from the start). */
static void gw_run_find_resume(gw_run *r) {
    gw_page_query q = {r->jb.id, NULL, 1};
    gw_ftckpt *c = NULL;
    size_t n = 0;
    bool more;
    r->resume_dir[0] = '\0', r->start_step = 0;
    if (!gw_store_ckpt_list(r->j->store, &q, &c, &n, &more) && n) {
        char leaf[64];
        snprintf(leaf, sizeof leaf, "ckpt-step-%lld", (long long)c->step_number);
        gw_jobs_dir(r->j, r->jb.id, leaf, r->resume_dir, sizeof r->resume_dir);
        r->start_step = c->step_number;
    }
    free(c);
}

/* The chain to train on: the static chain's hops, or the swarm's members whose whole spans tile
 * the model (none that this run lost). */
static int gw_run_chain(gw_run *r) {
    const gw_config *cfg = r->j->cfg;
    if (!r->j->model->mdl) return fu_errorf(FU_ERR_UNSUPPORTED, "the gateway does not know the model's shape");
    if (!r->j->swarm) {
        r->chain = (gw_lease){.n_hops = cfg->n_hops};
        for (int i = 0; i < cfg->n_hops; i++)
            r->chain.hops[i] = (chain_hop){cfg->hops[i].address, cfg->hops[i].first, cfg->hops[i].last, NULL},
            r->chain.ids[i] = -1;
        return cfg->n_hops ? FU_OK : fu_errorf(FU_ERR_UNSUPPORTED, "the gateway has no chain to train on");
    }
    gw_error err;
    int rc = gw_swarm_train_chain(r->j->swarm, r->avoid, r->n_avoid, &r->chain, &err);
    return rc ? fu_errorf(rc, "%s", err.message) : FU_OK;
}

/* Every stage of the chain. */
static int gw_run_stages(gw_run *r) {
    int max_tokens = gw_run_max_tokens(r), rc = gw_run_chain(r);
    gw_run_find_resume(r);
    for (int i = 0; i < r->chain.n_hops && !rc; i++, r->n++) rc = gw_run_stage(r, i, max_tokens);
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

/* Removes an adapter directory written by gw_run_save (its files, then itself). */
static void gw_run_rmdir(const char *dir) {
    char p[PATH_MAX + 32];
    snprintf(p, sizeof p, "%s/" LORA_CONFIG_FILE, dir);
    unlink(p);
    snprintf(p, sizeof p, "%s/" LORA_WEIGHTS_FILE, dir);
    unlink(p);
    snprintf(p, sizeof p, "%s/" TRN_OPTIMIZER_FILE, dir);
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
    float *m = NULL;
    int rc = gw_run_mkdirs(tmp);
    if (!rc) rc = lora_new(&r->lora, r->j->model->mdl, 0, r->j->model->n_layers, 0, &whole);
    if (!rc && !(m = malloc(2 * whole->n_floats * sizeof *m))) rc = fu_errorf(FU_ERR_NOMEM, "adapter moments");
    if (!rc) rc = trn_run_params(run, whole->data, m, m + whole->n_floats, whole->n_floats);
    if (!rc) whole->qk_interleaved = false, rc = lora_save(whole, tmp);
    if (!rc) rc = trn_optimizer_save(tmp, m, m + whole->n_floats, whole->n_floats);
    free(m);
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

/* The checkpoint after `step`: saved, recorded (with `metrics`, a JSON object's text), served. */
static void gw_run_checkpoint(gw_run *r, trn_run *run, int64_t step, const char *metrics) {
    gw_ftckpt c = {.step_number = step, .created_at = (int64_t)time(NULL)};
    char leaf[64], dir[PATH_MAX];
    snprintf(leaf, sizeof leaf, "ckpt-step-%lld", (long long)step);
    snprintf(c.job_id, sizeof c.job_id, "%s", r->jb.id);
    snprintf(c.metrics, sizeof c.metrics, "%s", metrics);
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

/* What one step measured: the step's own figures and, at the end of an epoch with a validation
 * file, the loss over the whole of it (valid < 0: not measured). */
typedef struct gw_step_metrics {
    trn_step_result res;
    double valid_loss, valid_accuracy;
} gw_step_metrics;

/* The step's figures as a JSON object (new reference; NULL on allocation failure). */
static json_t *gw_run_metrics_json(const gw_run *r, const gw_step_metrics *m) {
    json_t *d = json_pack("{s:I, s:f, s:f, s:I, s:f, s:f, s:I}", "step", (json_int_t)m->res.step, "train_loss",
                          m->res.loss, "train_mean_token_accuracy", m->res.accuracy, "total_steps",
                          (json_int_t)r->total, "learning_rate", (double)m->res.lr, "grad_norm", m->res.grad_norm,
                          "tokens", (json_int_t)m->res.n_tokens);
    if (d && m->valid_loss >= 0) {
        json_object_set_new(d, "valid_loss", json_real(m->valid_loss));
        json_object_set_new(d, "valid_mean_token_accuracy", json_real(m->valid_accuracy));
        json_object_set_new(d, "full_valid_loss", json_real(m->valid_loss));
        json_object_set_new(d, "full_valid_mean_token_accuracy", json_real(m->valid_accuracy));
    }
    return d;
}

/* The metrics event of one step, unless an earlier run of the job recorded it, and the step's
 * checkpoint metrics text into ckpt[cap]. */
static void gw_run_metrics(gw_run *r, const gw_step_metrics *m, char *ckpt, size_t cap) {
    json_t *d = gw_run_metrics_json(r, m);
    char *text = d ? json_dumps(d, JSON_COMPACT) : NULL;
    snprintf(ckpt, cap, "%s", text ? text : "{}");
    free(text);
    char valid[48] = "";
    if (m->valid_loss >= 0) snprintf(valid, sizeof valid, ", validation loss=%.4f", m->valid_loss);
    if (m->res.step > r->logged_step)
        gw_jobs_event(r->j, r->jb.id, "info", "metrics", d, "Step %lld/%lld: training loss=%.4f%s",
                      (long long)m->res.step, (long long)r->total, m->res.loss, valid);
    json_decref(d);
}

/* The run's options: AdamW, clip 1, 10% linear warm-up then cosine decay over r->total steps. */
static trn_run_options gw_run_options(const gw_run *r) {
    return (trn_run_options){.max_tokens = gw_run_max_tokens(r), .pipeline = 1, .dim = r->j->cfg->hidden_size,
                             .clip = 1.0f, .adamw = {0.9f, 0.999f, 1e-8f, 0.0f},
                             .sched = {(float)r->lr, r->total / 10, r->total, TRN_DECAY_COSINE},
                             .seed = (uint64_t)r->jb.seed};
}

/* The examples of step s (from 0): *at, *k. */
static void gw_run_batch(const gw_run *r, int64_t s, int *at, int *k) {
    *at = (int)(s % r->per_epoch) * r->bs;
    *k = r->train.n - *at < r->bs ? r->train.n - *at : r->bs;
}

/* Records progress after step `done` (of r->total): trained tokens and the expected end, from
 * the pace of this run's steps since t0 (steps from r->start_step). */
static void gw_run_progress(gw_run *r, int64_t done, double t0) {
    const double now = (double)time(NULL), per = (now - t0) / (double)(done - r->start_step);
    r->jb.estimated_finish = (int64_t)(now + per * (double)(r->total - done) + 0.5);
    gw_store_job_update(r->j->store, &r->jb); /* a cancelled job refuses it: the next step sees that */
}

/* The validation loss over the whole validation file after step s + 1 when it ends an epoch. */
static int gw_run_validate(gw_run *r, trn_run *run, int64_t s, gw_step_metrics *m) {
    m->valid_loss = -1;
    if (!r->valid.n || ((s + 1) % r->per_epoch && s + 1 < r->total)) return FU_OK;
    return trn_run_eval(run, r->valid.ex, r->valid.n, &m->valid_loss, &m->valid_accuracy);
}

/* Every step from r->start_step: FU_OK when all ran or the run stopped (*stopped); an error. */
static int gw_run_steps(gw_run *r, trn_run *run, bool *stopped) {
    int rc = FU_OK, at, k;
    r->jb.trained_tokens = 0;
    for (int64_t s = 0; s < r->start_step; s++) { /* the tokens of the steps done before */
        gw_run_batch(r, s, &at, &k);
        for (int i = 0; i < k; i++) r->jb.trained_tokens += r->train.ex[at + i].n;
    }
    const double t0 = (double)time(NULL);
    for (int64_t s = r->start_step; s < r->total && !rc; s++) {
        if ((*stopped = gw_run_stopped(r))) return FU_OK;
        gw_run_batch(r, s, &at, &k);
        gw_step_metrics m;
        char ckpt[1024];
        if ((rc = trn_run_step(run, r->train.ex + at, k, &m.res)) || (rc = gw_run_validate(r, run, s, &m))) break;
        for (int i = 0; i < k; i++) r->jb.trained_tokens += r->train.ex[at + i].n;
        gw_run_metrics(r, &m, ckpt, sizeof ckpt);
        gw_run_progress(r, s + 1, t0);
        if ((s + 1) % r->per_epoch == 0 && s + 1 < r->total) gw_run_checkpoint(r, run, s + 1, ckpt);
    }
    return rc;
}

/* ---- the result file ---------------------------------------------------------------------------------- */

/* The job's metrics, step by step (from its metrics events, oldest first); NaN where not measured. */
typedef struct gw_curve {
    size_t n;
    double *step, *train, *acc, *valid, *vacc, *lr;
} gw_curve;

static void gw_curve_free(gw_curve *c) {
    free(c->step);
    *c = (gw_curve){0};
}

/* Field key of metrics data d, or NaN. */
static double gw_metric(const json_t *d, const char *key) {
    const json_t *v = json_object_get(d, key);
    return json_is_number(v) ? json_number_value(v) : NAN;
}

/* The job's metrics events into c. */
static int gw_curve_load(gw_run *r, gw_curve *c) {
    gw_page_query q = {r->jb.id, NULL, 1000000};
    gw_ftevent *ev = NULL;
    size_t n = 0;
    bool more;
    int rc = gw_store_event_list(r->j->store, &q, &ev, &n, &more);
    double *a = rc ? NULL : malloc((6 * n + 1) * sizeof *a);
    if (!rc && !a) rc = fu_errorf(FU_ERR_NOMEM, "metrics");
    *c = (gw_curve){0, a, a + n, a + 2 * n, a + 3 * n, a + 4 * n, a + 5 * n};
    for (size_t i = n; i-- > 0 && !rc;) { /* oldest first */
        json_t *d = strcmp(ev[i].type, "metrics") ? NULL : json_loads(ev[i].data, 0, NULL);
        if (d) {
            const size_t k = c->n++;
            c->step[k] = gw_metric(d, "step"), c->train[k] = gw_metric(d, "train_loss");
            c->acc[k] = gw_metric(d, "train_mean_token_accuracy"), c->valid[k] = gw_metric(d, "valid_loss");
            c->vacc[k] = gw_metric(d, "valid_mean_token_accuracy"), c->lr[k] = gw_metric(d, "learning_rate");
        }
        json_decref(d);
    }
    free(ev);
    return rc;
}

/* A CSV cell: the value, or nothing when it was not measured. */
static int gw_csv_cell(fu_buf *b, double v, const char *sep) {
    return isfinite(v) ? fu_buf_appendf(b, "%.6g%s", v, sep) : fu_buf_appendf(b, "%s", sep);
}

/* OpenAI's step_metrics.csv of c. */
static int gw_curve_csv(const gw_curve *c, fu_buf *b) {
    int rc = fu_buf_appendf(b, "step,train_loss,train_accuracy,valid_loss,valid_mean_token_accuracy,learning_rate\n");
    for (size_t k = 0; k < c->n && !rc; k++) {
        const double v[6] = {c->step[k], c->train[k], c->acc[k], c->valid[k], c->vacc[k], c->lr[k]};
        for (int i = 0; i < 6 && !rc; i++) rc = gw_csv_cell(b, v[i], i < 5 ? "," : "\n");
    }
    return rc;
}

/* The loss curves of c as an SVG chart. */
static int gw_curve_svg(const gw_run *r, const gw_curve *c, fu_buf *b) {
    gw_plot_series s[2] = {{"training loss", "#1f77b4", c->step, c->train, c->n},
                           {"validation loss", "#d62728", c->step, c->valid, c->n}};
    char title[GW_JOB_ID_MAX + 32];
    snprintf(title, sizeof title, "Loss of %s", r->jb.id);
    return gw_plot_svg(title, "step", "loss (mean cross-entropy per token)", s, r->valid.n ? 2 : 1, b);
}

/* Adds file `leaf` of the adapter in dir as a result file of the job, its id into *f. */
static int gw_run_result_file(gw_run *r, const char *dir, const char *leaf, gw_file *f) {
    char path[PATH_MAX + 64], *data = NULL;
    size_t len = 0;
    snprintf(path, sizeof path, "%s/%s", dir, leaf);
    int rc = mf_read(path, (size_t)1 << 40, &data, &len);
    if (!rc) rc = gw_files_add(r->j->files, r->jb.owner, leaf, "fine-tune-results", data, len, f);
    free(data);
    return rc;
}

/* The result files: step_metrics.csv, loss_curve.svg and the final adapter in PEFT's format
 * (adapter_config.json, adapter_model.safetensors: downloaded into one directory, they load in peft). */
static int gw_run_results(gw_run *r, const char *final_dir) {
    gw_curve c;
    fu_buf csv = {0}, svg = {0};
    gw_file f[4];
    int rc = gw_curve_load(r, &c);
    if (!rc) rc = gw_curve_csv(&c, &csv);
    if (!rc) rc = gw_curve_svg(r, &c, &svg);
    if (!rc) rc = gw_files_add(r->j->files, r->jb.owner, "step_metrics.csv", "fine-tune-results", csv.data, csv.len, &f[0]);
    if (!rc) rc = gw_files_add(r->j->files, r->jb.owner, "loss_curve.svg", "fine-tune-results", svg.data, svg.len, &f[1]);
    if (!rc) rc = gw_run_result_file(r, final_dir, LORA_CONFIG_FILE, &f[2]);
    if (!rc) rc = gw_run_result_file(r, final_dir, LORA_WEIGHTS_FILE, &f[3]);
    if (!rc)
        snprintf(r->jb.result_files, sizeof r->jb.result_files, "[\"%s\", \"%s\", \"%s\", \"%s\"]", f[0].id,
                 f[1].id, f[2].id, f[3].id);
    fu_buf_free(&csv), fu_buf_free(&svg);
    gw_curve_free(&c);
    return rc;
}

/* Trains, saves and serves the final adapter. */
static int gw_run_train(gw_run *r, bool *stopped) {
    trn_run_options o = gw_run_options(r);
    trn_run *run = NULL;
    char dir[PATH_MAX];
    int rc = trn_run_new(r->stages, r->n, &o, &run);
    if (!rc) trn_run_set_steps(run, r->start_step);
    if (!rc) rc = gw_store_event_last_step(r->j->store, r->jb.id, &r->logged_step);
    if (!rc && r->start_step)
        gw_jobs_event(r->j, r->jb.id, "info", "message", NULL, "Resuming from step %lld", (long long)r->start_step);
    if (!rc) rc = gw_run_steps(r, run, stopped);
    if (!rc && !*stopped) rc = gw_run_save(r, run, "final", dir, sizeof dir);
    gw_jobs_model_name(r->j, &r->jb, 0, r->jb.fine_tuned_model, sizeof r->jb.fine_tuned_model);
    if (!rc && !*stopped) rc = gw_run_serve(r->j, r->jb.fine_tuned_model, dir);
    if (!rc && !*stopped) rc = gw_run_results(r, dir);
    trn_run_free(run);
    return rc;
}

/* The job's files: its examples and the plan of its steps. On failure the job fails naming the file. */
static int gw_run_data(gw_run *r) {
    int rc = gw_run_examples(r, r->jb.training_file, &r->train);
    if (rc) {
        gw_run_fail(r, "invalid_training_file", "training_file", fu_last_error());
        return rc;
    }
    if (r->jb.validation_file[0] && (rc = gw_run_examples(r, r->jb.validation_file, &r->valid))) {
        gw_run_fail(r, "invalid_validation_file", "validation_file", fu_last_error());
        return rc;
    }
    r->bs = r->batch < r->train.n ? r->batch : r->train.n;
    r->per_epoch = (r->train.n + r->bs - 1) / r->bs;
    r->total = (int64_t)r->per_epoch * r->epochs;
    return FU_OK;
}

#define GW_RUN_MAX_FAILOVERS 3 /* chains a swarm job may lose */

/* A server of the run's chain is gone (FU_ERR_NETWORK, message msg): the swarm is told, the
 * members the message names are avoided from now on, and the stages are closed. */
static void gw_run_lost(gw_run *r, const char *msg) {
    gw_swarm_report_failure(r->j->swarm, &r->chain, FU_ERR_NETWORK, msg);
    for (int h = 0; h < r->chain.n_hops && r->n_avoid < GW_MAX_HOPS; h++)
        if (strstr(msg, r->chain.addr[h])) r->avoid[r->n_avoid++] = r->chain.ids[h];
    gw_run_close_stages(r);
}

/* Trains on a chain; on a swarm, a chain that loses a server is replaced by another and the job
 * goes on from its last checkpoint, up to GW_RUN_MAX_FAILOVERS times. */
static int gw_run_chains(gw_run *r, bool *stopped) {
    for (int lost = 0;; lost++) {
        int rc = gw_run_stages(r);
        if (!rc) rc = gw_run_train(r, stopped);
        if (rc != FU_ERR_NETWORK || !r->j->swarm || lost == GW_RUN_MAX_FAILOVERS) return rc;
        char msg[512];
        snprintf(msg, sizeof msg, "%s", fu_last_error());
        gw_jobs_event(r->j, r->jb.id, "warn", "message", NULL,
                      "A server of the training chain was lost; going on from the last checkpoint on another chain");
        gw_run_lost(r, msg);
    }
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
    if (rc) gw_run_fail(r, "invalid_training_file", "training_file", fu_last_error());
    else if (!gw_run_data(r) && !gw_run_status(r, "queued") && !gw_run_status(r, "running")) {
        gw_jobs_event(j, jb->id, "info", "message", NULL, "Fine-tuning job started: %d examples, %d epochs",
                      r->train.n, r->epochs);
        if ((rc = gw_run_chains(r, &stopped)))
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

/* The oldest live job that no runner trains into *jb, marked as sl's (under mu). */
static int gw_jobs_claim(gw_jobs_slot *sl, gw_ftjob *jb) {
    gw_jobs *j = sl->j;
    const char *skip[GW_MAX_FT_JOBS];
    int n = 0;
    for (int i = 0; i < j->n_slots; i++)
        if (j->slots[i].id[0]) skip[n++] = j->slots[i].id;
    int rc = gw_store_job_next(j->store, skip, n, jb);
    if (!rc) snprintf(sl->id, sizeof sl->id, "%s", jb->id);
    return rc;
}

void *gw_jobs_runner(void *arg) {
    gw_jobs_slot *sl = arg;
    gw_jobs *j = sl->j;
    gw_ftjob *jb = malloc(sizeof *jb);
    pthread_mutex_lock(&j->mu);
    while (jb && !j->stopping) {
        const unsigned seen = j->gen;
        if (!gw_jobs_claim(sl, jb)) {
            pthread_mutex_unlock(&j->mu);
            gw_run_job(j, jb);
            pthread_mutex_lock(&j->mu);
            sl->id[0] = '\0';
            continue;
        }
        while (j->gen == seen && !j->stopping) pthread_cond_wait(&j->cv, &j->mu);
    }
    pthread_mutex_unlock(&j->mu);
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
