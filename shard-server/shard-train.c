/* shard-train.c -- fusion.Train on a shard server: jobs, each a LoRA adapter and its trainer over the core's span. */
#include "shard-train.h"

#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "clock.h"
#include "engine.h"
#include "lora.h"
#include "shard-lora.h"
#include "shard-tensor.h"
#include "status.h"
#include "train-svc.h"
#include "train.h"

#define TRAIN_MAX_SLOTS 64

typedef struct train_job {
    char id[TRAIN_SVC_MAX_ID + 1];
    pthread_mutex_t mu; /* one call at a time */
    int refs;           /* calls holding the job (under the service's lock) */
    bool closed;
    int64_t last_us, idle_us;
    int64_t turn_until_us; /* after a wait for the batcher ran out: the trainer's turn, no waits till then */
    shard_core *core;
    lora_adapter *ad;
    trn_span *tr;
} train_job;

struct shard_train {
    shard_train_config cfg;
    pthread_mutex_t mu; /* guards core, jobs[] and every job's refs / closed / last_us */
    shard_core *core;
    train_job **jobs;   /* (cfg.max_jobs) NULL: free */
    train_svc_handlers h;
};

/* What a reply points at, released by train_done after packing. */
typedef struct train_hold {
    grow_buf buf[3];
    float *f;            /* floats encoded into buf */
    int64_t shape[3][2];
    wire_tensor t[3];
    train_svc_lora lora;
    const char *names[LORA_N_TARGETS];
} train_hold;

/* ---- jobs ----------------------------------------------------------------------------- */

static void job_free(train_job *j) {
    if (!j) return;
    trn_free(j->tr);
    lora_free(j->ad);
    pthread_mutex_destroy(&j->mu);
    free(j);
}

/* Frees jobs that are closed or idle too long and held by no call (under t->mu). */
static void jobs_sweep(shard_train *t) {
    const int64_t now = fu_now_us();
    for (int i = 0; i < t->cfg.max_jobs; i++) {
        train_job *j = t->jobs[i];
        if (!j || j->refs) continue;
        if (j->closed || now - j->last_us > j->idle_us) {
            job_free(j);
            t->jobs[i] = NULL;
        }
    }
}

/* Finds job `id` and holds it (locked) for one call; NOT_FOUND if none. */
static int job_get(shard_train *t, const char *id, train_job **out, rpc_status *st) {
    pthread_mutex_lock(&t->mu);
    jobs_sweep(t);
    train_job *j = NULL;
    for (int i = 0; i < t->cfg.max_jobs && !j; i++)
        if (t->jobs[i] && !t->jobs[i]->closed && !strcmp(t->jobs[i]->id, id)) j = t->jobs[i];
    if (j) j->refs++;
    pthread_mutex_unlock(&t->mu);
    if (!j) return rpc_status_setf(st, RPC_NOT_FOUND, "no training job '%s' on this server", id);
    pthread_mutex_lock(&j->mu);
    *out = j;
    return RPC_OK;
}

/* Ends a call's hold on j; a closed job held by no other call is freed. */
static void job_put(shard_train *t, train_job *j) {
    pthread_mutex_unlock(&j->mu);
    pthread_mutex_lock(&t->mu);
    j->refs--;
    j->last_us = fu_now_us();
    if (j->closed && !j->refs) jobs_sweep(t);
    pthread_mutex_unlock(&t->mu);
}

bool shard_train_uses(shard_train *t, const shard_core *core) {
    bool used = false;
    pthread_mutex_lock(&t->mu);
    for (int i = 0; i < t->cfg.max_jobs && !used; i++) used = t->jobs[i] && t->jobs[i]->core == core;
    pthread_mutex_unlock(&t->mu);
    return used;
}

/* Memory the open jobs hold (under t->mu). */
static uint64_t jobs_bytes(const shard_train *t) {
    uint64_t sum = 0;
    for (int i = 0; i < t->cfg.max_jobs; i++)
        if (t->jobs[i] && !t->jobs[i]->closed) sum += trn_bytes(t->jobs[i]->tr);
    return sum;
}

int shard_train_jobs(shard_train *t) {
    int n = 0;
    pthread_mutex_lock(&t->mu);
    for (int i = 0; i < t->cfg.max_jobs; i++) n += t->jobs[i] && !t->jobs[i]->closed;
    pthread_mutex_unlock(&t->mu);
    return n;
}

void shard_train_set_core(shard_train *t, shard_core *core) {
    pthread_mutex_lock(&t->mu);
    for (int i = 0; i < t->cfg.max_jobs; i++)
        if (t->jobs[i] && t->jobs[i]->core != core) t->jobs[i]->closed = true;
    t->core = core;
    jobs_sweep(t);
    pthread_mutex_unlock(&t->mu);
}

/* ---- open ------------------------------------------------------------------------------- */

/* Checks the open request's sizes and span against the server. */
static int open_check(const shard_train *t, const shard_core *core, const train_svc_open *req, rpc_status *st) {
    const mdl_model *m = shard_core_model(core);
    if (req->first_block != m->first || req->last_block != m->last)
        return rpc_status_setf(st, RPC_FAILED_PRECONDITION, "span [%d, %d) asked, this server holds [%d, %d)",
                               req->first_block, req->last_block, m->first, m->last);
    if (req->max_tokens < 1 || req->max_tokens > t->cfg.max_tokens)
        return rpc_status_setf(st, RPC_OUT_OF_RANGE, "max_tokens: %d outside [1, %d]", req->max_tokens,
                               t->cfg.max_tokens);
    if (req->slots < 1 || req->slots > TRAIN_MAX_SLOTS)
        return rpc_status_setf(st, RPC_OUT_OF_RANGE, "slots: %d outside [1, %d]", req->slots, TRAIN_MAX_SLOTS);
    if (req->idle_timeout_ms < 0) return rpc_status_setf(st, RPC_INVALID_ARGUMENT, "idle_timeout_ms: negative");
    return RPC_OK;
}

/* Puts AdapterState s into job j's trainer (the span and config must be j's). */
static int state_put(train_job *j, const train_svc_state *s, rpc_status *st) {
    const size_t n = j->ad->n_floats;
    if (s->first_block != j->ad->first || s->last_block != j->ad->last)
        return rpc_status_setf(st, RPC_INVALID_ARGUMENT, "state: blocks [%d, %d), the job holds [%d, %d)",
                               s->first_block, s->last_block, j->ad->first, j->ad->last);
    if (!s->params) return rpc_status_setf(st, RPC_INVALID_ARGUMENT, "state.params: missing");
    float *f = malloc(3 * n * sizeof *f + 1);
    if (!f) return rpc_status_setf(st, RPC_RESOURCE_EXHAUSTED, "out of memory for the state");
    int rc = shard_lora_floats(s->params, n, "state.params", f, st);
    if (!rc && s->moment1) rc = shard_lora_floats(s->moment1, n, "state.moment1", f + n, st);
    if (!rc && s->moment2) rc = shard_lora_floats(s->moment2, n, "state.moment2", f + 2 * n, st);
    if (!rc && trn_import(j->tr, f, s->moment1 ? f + n : NULL, s->moment2 ? f + 2 * n : NULL))
        rc = rpc_status_setf(st, RPC_RESOURCE_EXHAUSTED, "%s", fu_last_error());
    free(f);
    return rc;
}

/* A trainer's yield hook under SHARD_TRAIN_PRIORITY_INFERENCE (on the job's call, under its mu): waits for
 * the core's batcher to be idle; a wait that runs its full bound starts the job's turn. */
static void job_yield(void *arg) {
    train_job *j = arg;
    const int64_t max_us = (int64_t)SHARD_TRAIN_YIELD_MAX_MS * 1000;
    if (fu_now_us() < j->turn_until_us) return;
    if (shard_core_wait_idle(j->core, max_us) >= max_us)
        j->turn_until_us = fu_now_us() + (int64_t)SHARD_TRAIN_TURN_MS * 1000;
}

/* A new job over `core` (its adapter fresh or from req->state), not yet in the table. */
static int job_make(const shard_train *t, shard_core *core, const train_svc_open *req, const lora_config *lc,
                    uint64_t budget, train_job **out, rpc_status *st) {
    const mdl_model *m = shard_core_model(core);
    train_job *j = calloc(1, sizeof *j);
    if (!j) return rpc_status_setf(st, RPC_RESOURCE_EXHAUSTED, "out of memory");
    pthread_mutex_init(&j->mu, NULL);
    snprintf(j->id, sizeof j->id, "%s", req->job_id);
    j->core = core;
    j->idle_us = 1000ll * (req->idle_timeout_ms ? req->idle_timeout_ms : t->cfg.idle_timeout_ms);
    trn_options to = {req->max_tokens, req->slots, req->keep_activations ? TRN_KEEP : TRN_RECOMPUTE, budget};
    int rc = lora_new(lc, &m->cfg, m->first, m->last, req->lora->init_seed, &j->ad);
    if (!rc) rc = trn_new(shard_core_engine(core), j->ad, &to, &j->tr);
    if (!rc && t->cfg.priority == SHARD_TRAIN_PRIORITY_INFERENCE) trn_set_yield(j->tr, job_yield, j);
    if (rc) rc = rpc_status_setf(st, rpc_code_from_fu(rc), "%s", fu_last_error());
    if (!rc && req->state) rc = state_put(j, req->state, st);
    if (rc) {
        job_free(j);
        return rc;
    }
    *out = j;
    return RPC_OK;
}

/* Puts j into a free place of the table unless its id is taken (under t->mu). */
static int job_insert(shard_train *t, train_job *j, rpc_status *st) {
    int free_at = -1;
    for (int i = 0; i < t->cfg.max_jobs; i++) {
        if (t->jobs[i] && !t->jobs[i]->closed && !strcmp(t->jobs[i]->id, j->id))
            return rpc_status_setf(st, RPC_ALREADY_EXISTS, "training job '%s' is already open", j->id);
        if (!t->jobs[i] && free_at < 0) free_at = i;
    }
    if (free_at < 0)
        return rpc_status_setf(st, RPC_RESOURCE_EXHAUSTED, "this server runs %d training jobs already", t->cfg.max_jobs);
    j->last_us = fu_now_us();
    t->jobs[free_at] = j;
    return RPC_OK;
}

static int train_open(void *ctx, const train_svc_open *req, train_svc_opened *reply, void **hold, rpc_status *st) {
    (void)hold;
    shard_train *t = ctx;
    lora_config lc;
    pthread_mutex_lock(&t->mu);
    jobs_sweep(t);
    shard_core *core = t->core;
    uint64_t used = jobs_bytes(t);
    pthread_mutex_unlock(&t->mu);
    if (!core) return rpc_status_setf(st, RPC_UNAVAILABLE, "this server holds no span yet");
    int rc = open_check(t, core, req, st);
    if (!rc) rc = shard_lora_config(req->lora, t->cfg.max_rank, "lora", &lc, st);
    if (!rc && used >= t->cfg.budget_bytes)
        rc = rpc_status_setf(st, RPC_RESOURCE_EXHAUSTED, "training jobs hold %.1f MiB, this server's budget",
                             used / 1048576.0);
    train_job *j = NULL;
    if (!rc) rc = job_make(t, core, req, &lc, t->cfg.budget_bytes - used, &j, st);
    if (rc) return rc;
    pthread_mutex_lock(&t->mu);
    rc = t->core == core ? job_insert(t, j, st) : rpc_status_setf(st, RPC_UNAVAILABLE, "this server's span changed");
    pthread_mutex_unlock(&t->mu);
    if (rc) {
        job_free(j);
        return rc;
    }
    reply->n_params = (int64_t)j->ad->n_floats;
    reply->bytes = (int64_t)trn_bytes(j->tr);
    return RPC_OK;
}

/* ---- forward and backward ---------------------------------------------------------------- */

static void train_done(void *ctx, void *hold) {
    (void)ctx;
    train_hold *h = hold;
    if (!h) return;
    for (int i = 0; i < 3; i++) free(h->buf[i].p);
    free(h->f);
    free(h);
}

/* A hold with room for n floats. */
static train_hold *hold_new(size_t n) {
    train_hold *h = calloc(1, sizeof *h);
    if (h && !(h->f = malloc(n * sizeof(float) + 1))) {
        free(h);
        return NULL;
    }
    return h;
}

static int wire_or_bf16(int dtype) { return dtype ? dtype : WIRE_BF16; }

/* The micro-batch of a TrainForward as a trn_batch (hidden states decoded into buf). */
static int forward_batch(const train_job *j, const train_svc_forward *req, grow_buf *buf, trn_batch *b,
                         rpc_status *st) {
    const mdl_model *m = shard_core_model(j->core);
    const shard_svc_input *in = req->input;
    if (!in) return rpc_status_setf(st, RPC_INVALID_ARGUMENT, "input: missing");
    int T = (int)in->n_tokens;
    *b = (trn_batch){.tokens = in->tokens, .first = req->first, .targets = req->targets,
                     .loss_scale = req->loss_scale, .seed = req->seed};
    if (!m->has_embed) {
        if (!in->hidden) return rpc_status_setf(st, RPC_INVALID_ARGUMENT, "input.hidden: missing (the span has no embeddings)");
        int rc = shard_decode_hidden(in->hidden, m->cfg.dim, "input.hidden", &T, buf, &b->embd, st);
        if (rc) return rc;
        b->tokens = NULL;
    }
    b->n_tokens = T;
    if (req->n_first != (size_t)T)
        return rpc_status_setf(st, RPC_INVALID_ARGUMENT, "first: %zu entries for %d rows", req->n_first, T);
    if (m->has_head ? req->n_targets != (size_t)T : req->n_targets != 0)
        return rpc_status_setf(st, RPC_INVALID_ARGUMENT, "targets: %zu entries for %d rows%s", req->n_targets, T,
                               m->has_head ? "" : " (only the span with the head takes targets)");
    if (req->wire_dtype && !wire_dtype_valid(req->wire_dtype))
        return rpc_status_setf(st, RPC_INVALID_ARGUMENT, "wire_dtype: unknown %d", req->wire_dtype);
    return RPC_OK;
}

/* Runs the forward of job j and encodes the span's output into h. */
static int forward_run(train_job *j, const train_svc_forward *req, train_hold *h, train_svc_forward_reply *reply,
                       rpc_status *st) {
    const mdl_model *m = shard_core_model(j->core);
    trn_batch b;
    trn_loss loss = {0};
    int rc = forward_batch(j, req, &h->buf[1], &b, st);
    if (rc) return rc;
    trn_drop(j->tr, req->slot); /* a slot used again: its old micro-batch was abandoned */
    if ((rc = trn_forward(j->tr, req->slot, &b, m->has_head ? NULL : h->f, &loss)))
        return rpc_status_setf(st, rpc_code_from_fu(rc), "%s", fu_last_error());
    reply->loss_sum = loss.sum;
    reply->n_tokens = loss.n_tokens;
    reply->n_correct = loss.n_correct;
    if (m->has_head) return RPC_OK;
    if (shard_encode_tensor(&h->t[0], h->shape[0], h->f, b.n_tokens, m->cfg.dim, wire_or_bf16(req->wire_dtype),
                            WIRE_DEFAULT_BLOCK, &h->buf[0])) {
        trn_drop(j->tr, req->slot);
        return rpc_status_setf(st, RPC_RESOURCE_EXHAUSTED, "out of memory for the reply");
    }
    reply->hidden = &h->t[0];
    return RPC_OK;
}

static int train_forward(void *ctx, const train_svc_forward *req, train_svc_forward_reply *reply, void **hold,
                         rpc_status *st) {
    shard_train *t = ctx;
    train_job *j;
    int rc = job_get(t, req->job_id, &j, st);
    if (rc) return rc;
    const size_t T = req->input ? (req->input->n_tokens ? req->input->n_tokens : (size_t)t->cfg.max_tokens) : 1;
    train_hold *h = hold_new(T * (size_t)shard_core_model(j->core)->cfg.dim);
    rc = h ? forward_run(j, req, h, reply, st) : rpc_status_setf(st, RPC_RESOURCE_EXHAUSTED, "out of memory");
    job_put(t, j);
    if (rc) train_done(NULL, h);
    else *hold = h;
    return rc;
}

/* Runs the backward of job j's slot; the input gradient, when asked, encoded into h. */
static int backward_run(train_job *j, const train_svc_backward *req, train_hold *h,
                        train_svc_backward_reply *reply, rpc_status *st) {
    const mdl_model *m = shard_core_model(j->core);
    const int T = trn_slot_tokens(j->tr, req->slot);
    const float *dy = NULL;
    int n = 0, rc;
    if (!T) return rpc_status_setf(st, RPC_FAILED_PRECONDITION, "slot %d holds no forward", req->slot);
    if (!m->has_head && !req->grad) rc = rpc_status_setf(st, RPC_INVALID_ARGUMENT, "grad: missing");
    else if (!m->has_head && !(rc = shard_decode_hidden(req->grad, m->cfg.dim, "grad", &n, &h->buf[1], &dy, st)) && n != T)
        rc = rpc_status_setf(st, RPC_INVALID_ARGUMENT, "grad: %d rows, the forward had %d", n, T);
    else rc = RPC_OK;
    if (req->wire_dtype && !wire_dtype_valid(req->wire_dtype))
        rc = rpc_status_setf(st, RPC_INVALID_ARGUMENT, "wire_dtype: unknown %d", req->wire_dtype);
    if (rc) {
        trn_drop(j->tr, req->slot);
        return rc;
    }
    if ((rc = trn_backward(j->tr, req->slot, dy, req->want_input_grad ? h->f : NULL)))
        return rpc_status_setf(st, rpc_code_from_fu(rc), "%s", fu_last_error());
    if (!req->want_input_grad) return RPC_OK;
    if (shard_encode_tensor(&h->t[0], h->shape[0], h->f, T, m->cfg.dim, wire_or_bf16(req->wire_dtype),
                            WIRE_DEFAULT_BLOCK, &h->buf[0]))
        return rpc_status_setf(st, RPC_RESOURCE_EXHAUSTED, "out of memory for the reply");
    reply->grad = &h->t[0];
    return RPC_OK;
}

static int train_backward(void *ctx, const train_svc_backward *req, train_svc_backward_reply *reply, void **hold,
                          rpc_status *st) {
    shard_train *t = ctx;
    train_job *j;
    int rc = job_get(t, req->job_id, &j, st);
    if (rc) return rc;
    const int T = trn_slot_tokens(j->tr, req->slot);
    train_hold *h = hold_new((size_t)(T ? T : 1) * (size_t)shard_core_model(j->core)->cfg.dim);
    rc = h ? backward_run(j, req, h, reply, st) : rpc_status_setf(st, RPC_RESOURCE_EXHAUSTED, "out of memory");
    job_put(t, j);
    if (rc) train_done(NULL, h);
    else *hold = h;
    return rc;
}

/* ---- optimizer and state ------------------------------------------------------------------- */

static int train_norm(void *ctx, const char *job_id, double *sqnorm, rpc_status *st) {
    shard_train *t = ctx;
    train_job *j;
    int rc = job_get(t, job_id, &j, st);
    if (rc) return rc;
    *sqnorm = trn_grad_sqnorm(j->tr);
    job_put(t, j);
    return RPC_OK;
}

/* Checks a step's hyper-parameters. */
static int step_check(const train_svc_step *r, rpc_status *st) {
    if (r->discard) return RPC_OK;
    if (r->step < 1) return rpc_status_setf(st, RPC_INVALID_ARGUMENT, "step: %lld (steps count from 1)", (long long)r->step);
    const float v[] = {r->lr, r->grad_scale, r->beta1, r->beta2, r->eps, r->weight_decay};
    const char *names[] = {"lr", "grad_scale", "beta1", "beta2", "eps", "weight_decay"};
    for (int i = 0; i < 6; i++)
        if (!isfinite(v[i]) || v[i] < 0) return rpc_status_setf(st, RPC_INVALID_ARGUMENT, "%s: %g", names[i], v[i]);
    if (r->beta1 >= 1 || r->beta2 >= 1) return rpc_status_setf(st, RPC_INVALID_ARGUMENT, "beta1, beta2 must be below 1");
    return RPC_OK;
}

static int train_step(void *ctx, const train_svc_step *req, rpc_status *st) {
    shard_train *t = ctx;
    train_job *j;
    int rc = step_check(req, st);
    if (rc || (rc = job_get(t, req->job_id, &j, st))) return rc;
    if (req->discard) {
        trn_zero_grad(j->tr);
    } else {
        trn_adamw h = {req->beta1, req->beta2, req->eps, req->weight_decay};
        if ((rc = trn_step(j->tr, &h, req->lr, req->grad_scale, req->step)))
            rc = rpc_status_setf(st, RPC_FAILED_PRECONDITION, "%s", fu_last_error());
    }
    job_put(t, j);
    return rc;
}

/* Encodes n floats of h->f + i * n as flat F32 tensor i of h. */
static int state_tensor(train_hold *h, int i, size_t n) {
    if (shard_encode_tensor(&h->t[i], h->shape[i], h->f + (size_t)i * n, 1, (int64_t)n, WIRE_F32, 0, &h->buf[i]))
        return FU_ERR_NOMEM;
    h->t[i].n_shape = 1;
    h->shape[i][0] = (int64_t)n;
    return FU_OK;
}

static int train_get_state(void *ctx, const char *job_id, train_svc_state *reply, void **hold, rpc_status *st) {
    shard_train *t = ctx;
    train_job *j;
    int rc = job_get(t, job_id, &j, st);
    if (rc) return rc;
    const size_t n = j->ad->n_floats;
    train_hold *h = hold_new(3 * n);
    if (!h || trn_export(j->tr, h->f, h->f + n, h->f + 2 * n) || state_tensor(h, 0, n) || state_tensor(h, 1, n) ||
        state_tensor(h, 2, n))
        rc = rpc_status_setf(st, RPC_RESOURCE_EXHAUSTED, "out of memory for the state");
    if (!rc) {
        h->lora = shard_svc_lora_of(&j->ad->cfg, h->names);
        *reply = (train_svc_state){j->ad->first, j->ad->last, &h->lora, &h->t[0], &h->t[1], &h->t[2]};
    }
    job_put(t, j);
    if (rc) train_done(NULL, h);
    else *hold = h;
    return rc;
}

static int train_put_state(void *ctx, const char *job_id, const train_svc_state *state, rpc_status *st) {
    shard_train *t = ctx;
    train_job *j;
    int rc = job_get(t, job_id, &j, st);
    if (rc) return rc;
    rc = state_put(j, state, st);
    job_put(t, j);
    return rc;
}

static int train_close(void *ctx, const char *job_id, rpc_status *st) {
    shard_train *t = ctx;
    train_job *j;
    int rc = job_get(t, job_id, &j, st);
    if (rc) return rc;
    pthread_mutex_lock(&t->mu);
    j->closed = true;
    pthread_mutex_unlock(&t->mu);
    job_put(t, j);
    return RPC_OK;
}

/* ---- service --------------------------------------------------------------------------------- */

int shard_train_new(const shard_train_config *cfg, shard_train **out) {
    *out = NULL;
    shard_train *t = calloc(1, sizeof *t);
    if (!t) return fu_errorf(FU_ERR_NOMEM, "training service");
    t->cfg = cfg ? *cfg : (shard_train_config){0};
    if (!t->cfg.budget_bytes) t->cfg.budget_bytes = 2ull << 30;
    if (t->cfg.max_jobs <= 0) t->cfg.max_jobs = 4;
    if (t->cfg.max_rank <= 0) t->cfg.max_rank = 256;
    if (t->cfg.max_tokens <= 0) t->cfg.max_tokens = 4096;
    if (t->cfg.idle_timeout_ms <= 0) t->cfg.idle_timeout_ms = 600000;
    if (!(t->jobs = calloc((size_t)t->cfg.max_jobs, sizeof *t->jobs))) {
        free(t);
        return fu_errorf(FU_ERR_NOMEM, "training service");
    }
    pthread_mutex_init(&t->mu, NULL);
    t->h = (train_svc_handlers){t, train_open, train_forward, train_backward, train_norm, train_step,
                                train_get_state, train_put_state, train_close, train_done};
    *out = t;
    return FU_OK;
}

void shard_train_free(shard_train *t) {
    if (!t) return;
    for (int i = 0; i < t->cfg.max_jobs; i++) job_free(t->jobs[i]);
    free(t->jobs);
    pthread_mutex_destroy(&t->mu);
    free(t);
}

int shard_train_serve(shard_train *t, rpc_server *srv) { return train_svc_serve(srv, &t->h); }
