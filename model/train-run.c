/* train-run.c -- the coordinator's step: packing, forward and backward through the stages, clipping, AdamW. */
#include "train-run.h"

#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "log.h"
#include "safetensors.h"
#include "status.h"

/* One micro-batch in flight: its rows, and the hidden states (then the
 * gradients) between stages, two buffers used by turns (stage s reads
 * h[(s - 1) & 1] and writes h[s & 1]). */
typedef struct trn_micro {
    trn_batch b;
    int32_t *tokens, *target, *first; /* (max_tokens) */
    float *h[2];                      /* (max_tokens, D) */
    trn_loss loss;
} trn_micro;

/* The examples of one step taken since the last snapshot (for a replay). */
typedef struct trn_done_step {
    const trn_example *ex;
    int n;
} trn_done_step;

struct trn_run {
    trn_stage *stages; /* (n_stages) own copy */
    int n_stages;
    trn_run_options o;
    int64_t steps;
    int failed;          /* the stage whose call failed last, -1: none */
    int replacements;
    /* failover: the snapshot of every stage after step snap_step, and the steps since */
    trn_state *snap;     /* (n_stages) */
    int64_t snap_step;
    trn_done_step *since; /* (snapshot_every) */
    int n_since;
    /* the micro-batches in flight (depth of them, max_tokens rows each) */
    int depth;
    trn_micro *mb;       /* (depth) */
};

void trn_state_clear(trn_state *s) {
    free(s->params), free(s->m1), free(s->m2);
    *s = (trn_state){0};
}

int trn_optimizer_save(const char *dir, const float *m1, const float *m2, size_t n) {
    char path[4096];
    snprintf(path, sizeof path, "%s/" TRN_OPTIMIZER_FILE, dir);
    const int64_t shape[1] = {(int64_t)n};
    const st_write_tensor t[2] = {{"exp_avg", "F32", 1, shape, m1}, {"exp_avg_sq", "F32", 1, shape, m2}};
    return st_write(path, t, 2);
}

/* Copies n floats at offset `at` of f32 vector tensor `name` of st into out. */
static int trn_moment_read(const st_model *st, const char *name, size_t at, size_t n, float *out) {
    int64_t i = st_model_find_index(st, name);
    st_tensor_info ti;
    if (i < 0 || st_model_tensor_info(st, i, &ti))
        return fu_errorf(FU_ERR_FORMAT, "%s: no tensor %s", st_model_path(st), name);
    if (strcmp(ti.dtype, "F32") || ti.rank != 1 || ti.nbytes < (at + n) * sizeof(float))
        return fu_errorf(FU_ERR_FORMAT, "%s: %s is not an f32 vector of the adapter's size", st_model_path(st), name);
    memcpy(out, (const float *)ti.data + at, n * sizeof(float));
    return FU_OK;
}

/* The moments of out's span (blocks [out->first, out->last), out->n floats, every block the same size)
 * from dir's optimizer file, when there is one. */
static int trn_moments_load(const char *dir, trn_state *out) {
    char path[4096];
    snprintf(path, sizeof path, "%s/" TRN_OPTIMIZER_FILE, dir);
    if (access(path, F_OK)) return FU_OK;
    st_model *st = NULL;
    int rc = st_model_open(path, &st);
    const size_t at = out->n / (size_t)(out->last - out->first) * (size_t)out->first;
    out->m1 = rc ? NULL : malloc(out->n * sizeof(float) + 1);
    out->m2 = rc ? NULL : malloc(out->n * sizeof(float) + 1);
    if (!rc && !(out->m1 && out->m2)) rc = fu_errorf(FU_ERR_NOMEM, "optimizer state");
    if (!rc) rc = trn_moment_read(st, "exp_avg", at, out->n, out->m1);
    if (!rc) rc = trn_moment_read(st, "exp_avg_sq", at, out->n, out->m2);
    st_model_close(st);
    return rc;
}

int trn_state_load(const char *dir, const mdl_config *m, int first, int last, int max_rank, trn_state *out) {
    *out = (trn_state){0};
    lora_adapter *ad = NULL;
    int rc = lora_load(dir, m, first, last, max_rank, &ad);
    if (!rc) rc = lora_set_qk_order(ad, false);
    if (!rc) {
        *out = (trn_state){ad->first, ad->last, ad->n_floats, malloc(ad->n_floats * sizeof(float) + 1), NULL, NULL};
        if (out->params) memcpy(out->params, ad->data, ad->n_floats * sizeof(float));
        else rc = fu_errorf(FU_ERR_NOMEM, "adapter state");
    }
    if (!rc) rc = trn_moments_load(dir, out);
    lora_free(ad);
    if (rc) trn_state_clear(out);
    return rc;
}

/* ---- local stages ------------------------------------------------------------------- */

static int local_forward(void *st, int slot, const trn_batch *b, float *out, trn_loss *loss) {
    return trn_forward(st, slot, b, out, loss);
}
static int local_backward(void *st, int slot, const float *dy, float *dx) { return trn_backward(st, slot, dy, dx); }
static int local_sqnorm(void *st, double *out) {
    *out = trn_grad_sqnorm(st);
    return FU_OK;
}
static int local_step(void *st, const trn_adamw *h, float lr, float grad_scale, int64_t t) {
    return trn_step(st, h, lr, grad_scale, t);
}
static void local_drop(void *st, int slot) { trn_drop(st, slot); }
static int local_zero_grad(void *st) {
    trn_zero_grad(st);
    return FU_OK;
}

static int local_get_state(void *st, trn_state *out) {
    trn_span *s = st;
    const lora_adapter *ad = trn_adapter(s);
    const size_t n = ad->n_floats;
    *out = (trn_state){ad->first, ad->last, n, malloc(n * sizeof(float) + 1), malloc(n * sizeof(float) + 1),
                       malloc(n * sizeof(float) + 1)};
    int rc = out->params && out->m1 && out->m2 ? trn_export(s, out->params, out->m1, out->m2)
                                                : fu_errorf(FU_ERR_NOMEM, "training snapshot");
    if (rc) trn_state_clear(out);
    return rc;
}
static int local_put_state(void *st, const trn_state *s) {
    const lora_adapter *ad = trn_adapter(st);
    if (s->n != ad->n_floats || s->first != ad->first || s->last != ad->last)
        return fu_errorf(FU_ERR_INVALID, "training state of blocks [%d, %d) for a stage of [%d, %d)", s->first,
                         s->last, ad->first, ad->last);
    return trn_import(st, s->params, s->m1, s->m2);
}

static const trn_stage_vt local_vt = {local_forward, local_backward, local_sqnorm,   local_step,
                                      local_drop,    local_zero_grad, local_get_state, local_put_state};

trn_stage trn_stage_local(trn_span *s) { return (trn_stage){&local_vt, s}; }

/* ---- run ------------------------------------------------------------------------------- */

void trn_run_free(trn_run *r) {
    if (!r) return;
    for (int i = 0; r->snap && i < r->n_stages; i++) trn_state_clear(&r->snap[i]);
    free(r->snap), free(r->since), free(r->stages);
    for (int i = 0; r->mb && i < r->depth; i++) {
        trn_micro *m = &r->mb[i];
        free(m->tokens), free(m->target), free(m->first), free(m->h[0]), free(m->h[1]);
    }
    free(r->mb);
    free(r);
}

int trn_run_replacements(const trn_run *r) { return r->replacements; }
trn_stage trn_run_stage(const trn_run *r, int index) { return r->stages[index]; }

int trn_run_params(const trn_run *r, float *params, float *m1, float *m2, size_t n) {
    size_t at = 0;
    int rc = FU_OK;
    for (int s = 0; s < r->n_stages && !rc; s++) {
        trn_state state = {0};
        if (!(rc = r->stages[s].vt->get_state(r->stages[s].st, &state)) && at + state.n > n)
            rc = fu_errorf(FU_ERR_FORMAT, "span %d's state is larger than the adapter", s);
        if (!rc) memcpy(params + at, state.params, state.n * sizeof(float));
        if (!rc && m1) memcpy(m1 + at, state.m1, state.n * sizeof(float));
        if (!rc && m2) memcpy(m2 + at, state.m2, state.n * sizeof(float));
        at += state.n;
        trn_state_clear(&state);
    }
    if (!rc && at != n) rc = fu_errorf(FU_ERR_FORMAT, "the spans' states do not cover the adapter");
    return rc;
}

/* Pulls every stage's state into the snapshot (after step r->steps). */
static int trn_run_snapshot(trn_run *r) {
    for (int i = 0; i < r->n_stages; i++) {
        trn_state s;
        int rc = r->stages[i].vt->get_state(r->stages[i].st, &s);
        if (rc) {
            r->failed = i;
            return rc;
        }
        trn_state_clear(&r->snap[i]);
        r->snap[i] = s;
    }
    r->snap_step = r->steps;
    r->n_since = 0;
    return FU_OK;
}

int trn_run_new(const trn_stage *stages, int n_stages, const trn_run_options *o, trn_run **out) {
    *out = NULL;
    if (n_stages < 1 || n_stages > TRN_MAX_STAGES || o->max_tokens < 1 || o->dim < 1 || o->pipeline > TRN_MAX_PIPELINE)
        return fu_errorf(FU_ERR_INVALID, "training run: %d stages (1..%d), %d tokens per micro-batch, pipeline %d (most %d)",
                         n_stages, TRN_MAX_STAGES, o->max_tokens, o->pipeline, TRN_MAX_PIPELINE);
    trn_run *r = calloc(1, sizeof *r);
    if (!r) return fu_errorf(FU_ERR_NOMEM, "training run");
    r->n_stages = n_stages;
    r->o = *o;
    r->failed = -1;
    if (r->o.snapshot_every <= 0) r->o.snapshot_every = 1;
    r->stages = malloc((size_t)n_stages * sizeof *r->stages);
    r->snap = calloc((size_t)n_stages, sizeof *r->snap);
    r->since = calloc((size_t)r->o.snapshot_every, sizeof *r->since);
    if (r->stages) memcpy(r->stages, stages, (size_t)n_stages * sizeof *stages);
    r->depth = o->pipeline > 1 ? o->pipeline : 1;
    r->mb = calloc((size_t)r->depth, sizeof *r->mb);
    const size_t T = (size_t)o->max_tokens;
    bool ok = r->stages && r->snap && r->since && r->mb;
    for (int i = 0; ok && i < r->depth; i++) {
        trn_micro *m = &r->mb[i];
        m->tokens = calloc(T, sizeof(int32_t));
        m->target = calloc(T, sizeof(int32_t));
        m->first = calloc(T, sizeof(int32_t));
        m->h[0] = calloc(T * (size_t)o->dim, sizeof(float));
        m->h[1] = calloc(T * (size_t)o->dim, sizeof(float));
        ok = m->tokens && m->target && m->first && m->h[0] && m->h[1];
    }
    if (!ok) {
        trn_run_free(r);
        return fu_errorf(FU_ERR_NOMEM, "training run buffers for %d micro-batches of %zu tokens", r->depth, T);
    }
    int rc = r->o.replace ? trn_run_snapshot(r) : FU_OK;
    if (rc) {
        trn_run_free(r);
        return rc;
    }
    *out = r;
    return FU_OK;
}

int64_t trn_run_steps(const trn_run *r) { return r->steps; }
void trn_run_set_steps(trn_run *r, int64_t steps) { r->steps = steps; }

/* Packs examples ex[*next ..] into micro-batch m until the next one does not
 * fit; returns its rows. */
static int trn_pack(const trn_run *r, trn_micro *m, const trn_example *ex, int n, int *next) {
    int T = 0;
    while (*next < n && T + ex[*next].n <= r->o.max_tokens) {
        const trn_example *e = &ex[(*next)++];
        for (int i = 0; i < e->n; i++) {
            m->tokens[T + i] = e->tokens[i];
            m->target[T + i] = e->target[i];
            m->first[T + i] = T;
        }
        T += e->n;
    }
    return T;
}

/* One call of a pipeline tick: stage s on micro-batch m (slot m). */
typedef struct trn_call {
    trn_run *r;
    int s, m;
    bool back;
    int rc;
    pthread_t th;
} trn_call;

/* Runs one call: a stage's forward (its input from the previous stage's
 * buffer, its output to its own) or backward (dy from the next stage's
 * buffer, dx to its own). */
static void *trn_call_run(void *arg) {
    trn_call *c = arg;
    trn_run *r = c->r;
    trn_micro *m = &r->mb[c->m];
    const trn_stage *g = &r->stages[c->s];
    const bool last = c->s + 1 == r->n_stages;
    if (!c->back) {
        trn_batch b = m->b;
        b.embd = c->s ? m->h[(c->s - 1) & 1] : NULL;
        b.tokens = c->s ? NULL : m->tokens;
        c->rc = g->vt->forward(g->st, c->m, &b, last ? NULL : m->h[c->s & 1], &m->loss);
    } else {
        c->rc = g->vt->backward(g->st, c->m, last ? NULL : m->h[(c->s + 1) & 1], c->s ? m->h[c->s & 1] : NULL);
    }
    return NULL;
}

/* Runs calls[0..n) at once (the first on this thread); the first failure's
 * stage into r->failed. */
static int trn_tick(trn_run *r, trn_call *calls, int n) {
    for (int i = 1; i < n; i++)
        if (pthread_create(&calls[i].th, NULL, trn_call_run, &calls[i])) trn_call_run(&calls[i]), calls[i].th = 0;
    if (n) trn_call_run(&calls[0]);
    int rc = FU_OK;
    for (int i = 0; i < n; i++) {
        if (i && calls[i].th) pthread_join(calls[i].th, NULL);
        if (calls[i].rc && !rc) {
            rc = calls[i].rc;
            r->failed = calls[i].s;
        }
    }
    return rc;
}

/* Forwards (then backwards) micro-batches [0, k) through the stages as a
 * pipeline: at tick t of the forward, stage s runs micro-batch t - s; of the
 * backward, stage s runs micro-batch t - (S - 1 - s). Every stage thus meets
 * the micro-batches in order, and its gradients add up in the order of a
 * sequential run. On an error every stage drops them all. */
static int trn_run_group(trn_run *r, int k, bool train) {
    const int S = r->n_stages;
    trn_call calls[TRN_MAX_STAGES];
    int rc = FU_OK;
    for (int pass = 0; pass < 1 + train && !rc; pass++)
        for (int t = 0; t < k + S - 1 && !rc; t++) {
            int n = 0;
            for (int s = 0; s < S; s++) {
                const int m = pass ? t - (S - 1 - s) : t - s;
                if (m >= 0 && m < k) calls[n++] = (trn_call){r, s, m, pass == 1, 0, 0};
            }
            rc = trn_tick(r, calls, n);
        }
    if (rc || !train)
        for (int s = 0; s < S; s++)
            for (int m = 0; m < k; m++) r->stages[s].vt->drop(r->stages[s].st, m);
    return rc;
}

/* The step's target tokens, after checking every example fits a micro-batch. */
static int trn_count_targets(const trn_run *r, const trn_example *ex, int n, int64_t *count) {
    *count = 0;
    for (int i = 0; i < n; i++) {
        if (ex[i].n < 1 || ex[i].n > r->o.max_tokens)
            return fu_errorf(FU_ERR_RANGE, "training: example %d has %d tokens, outside [1, %d]", i, ex[i].n,
                             r->o.max_tokens);
        for (int t = 0; t < ex[i].n; t++) *count += ex[i].target[t] >= 0;
    }
    return FU_OK;
}

/* Every micro-batch of ex[0..n) through the stages, `depth` at a time; the
 * losses summed into *sum. */
static int trn_run_all(trn_run *r, const trn_example *ex, int n, bool train, float scale, trn_loss *sum, int *n_micro) {
    int next = 0, rc = FU_OK;
    memset(sum, 0, sizeof *sum);
    *n_micro = 0;
    while (next < n && !rc) {
        int k = 0;
        for (; k < r->depth && next < n; k++, ++*n_micro) {
            trn_micro *m = &r->mb[k];
            m->b = (trn_batch){.n_tokens = trn_pack(r, m, ex, n, &next), .first = m->first, .targets = m->target,
                               .loss_scale = scale,
                               .seed = r->o.seed ^ (0x9e3779b97f4a7c15ull * (uint64_t)(r->steps + 1)) ^
                                       (uint64_t)*n_micro};
            m->loss = (trn_loss){0};
        }
        rc = trn_run_group(r, k, train);
        for (int i = 0; i < k; i++) {
            sum->sum += r->mb[i].loss.sum;
            sum->n_tokens += r->mb[i].loss.n_tokens;
            sum->n_correct += r->mb[i].loss.n_correct;
        }
    }
    return rc;
}

/* The global gradient norm over the stages. */
static int trn_run_norm(trn_run *r, double *norm) {
    double total = 0;
    for (int s = 0; s < r->n_stages; s++) {
        double v = 0;
        int rc = r->stages[s].vt->sqnorm(r->stages[s].st, &v);
        if (rc) {
            r->failed = s;
            return rc;
        }
        total += v;
    }
    *norm = sqrt(total);
    return FU_OK;
}

/* Clears every stage's gradients after a step that is not applied (best
 * effort: the step's own error is what the caller sees). */
static void trn_run_discard(trn_run *r) {
    for (int s = 0; s < r->n_stages; s++) r->stages[s].vt->zero_grad(r->stages[s].st);
}

/* Every stage's AdamW step with the step's learning rate and clip factor. */
static int trn_run_apply(trn_run *r, trn_step_result *res) {
    float clip = 1.0f;
    if (r->o.clip > 0 && res->grad_norm > r->o.clip) clip = (float)(r->o.clip / (res->grad_norm + 1e-6));
    res->lr = trn_lr_at(&r->o.sched, r->steps);
    res->step = r->steps + 1;
    for (int s = 0; s < r->n_stages; s++) {
        int rc = r->stages[s].vt->step(r->stages[s].st, &r->o.adamw, res->lr, clip, res->step);
        if (rc) {
            r->failed = s;
            return rc;
        }
    }
    return FU_OK;
}

/* One step, without failover: forward and backward of every micro-batch,
 * the norm, AdamW. */
static int trn_run_once(trn_run *r, const trn_example *ex, int n, trn_step_result *res) {
    memset(res, 0, sizeof *res);
    r->failed = -1;
    int64_t count;
    int rc = trn_count_targets(r, ex, n, &count);
    if (rc) return rc;
    if (!count) return fu_errorf(FU_ERR_RANGE, "training: the batch has no target tokens");
    trn_loss sum;
    if ((rc = trn_run_all(r, ex, n, true, (float)(1.0 / (double)count), &sum, &res->micro_batches)) ||
        (rc = trn_run_norm(r, &res->grad_norm))) {
        trn_run_discard(r);
        return rc;
    }
    if (!isfinite(res->grad_norm) || !isfinite(sum.sum)) {
        trn_run_discard(r);
        return fu_errorf(FU_ERR_RANGE, "training step %lld: the loss or a gradient is not finite (norm %g); "
                         "the step was skipped", (long long)(r->steps + 1), res->grad_norm);
    }
    res->loss = sum.sum / (double)count;
    res->accuracy = (double)sum.n_correct / (double)count;
    res->n_tokens = count;
    if ((rc = trn_run_apply(r, res))) return rc;
    r->steps++;
    return FU_OK;
}

/* After stage r->failed's server is gone: a replacement from the snapshot,
 * every other stage put back to it, and the steps since the snapshot again. */
static int trn_run_recover(trn_run *r) {
    const int bad = r->failed;
    if (r->replacements >= r->o.max_replacements)
        return fu_errorf(FU_ERR_NETWORK, "training: stage %d failed (%s) and %d replacements are used up", bad,
                         fu_last_error(), r->o.max_replacements);
    FU_WARN("training: stage %d failed at step %lld (%s); replacing it from the snapshot of step %lld", bad,
            (long long)(r->steps + 1), fu_last_error(), (long long)r->snap_step);
    r->replacements++;
    int rc = r->o.replace(r->o.replace_arg, bad, &r->snap[bad], &r->stages[bad]);
    for (int s = 0; s < r->n_stages && !rc; s++)
        if (s != bad && (rc = r->stages[s].vt->put_state(r->stages[s].st, &r->snap[s]))) r->failed = s;
    if (rc) return rc;
    r->steps = r->snap_step;
    for (int i = 0; i < r->n_since && !rc; i++) {
        trn_step_result res;
        rc = trn_run_once(r, r->since[i].ex, r->since[i].n, &res);
    }
    return rc;
}

/* A failover's recovery, again while it meets another server gone. */
static int trn_run_recover_all(trn_run *r) {
    int rc;
    do rc = trn_run_recover(r);
    while (rc == FU_ERR_NETWORK && r->failed >= 0);
    return rc;
}

int trn_run_step(trn_run *r, const trn_example *ex, int n, trn_step_result *res) {
    if (!r->o.replace) return trn_run_once(r, ex, n, res);
    bool done = false;
    for (;;) {
        int rc = FU_OK;
        if (!done && !(rc = trn_run_once(r, ex, n, res))) {
            done = true;
            r->since[r->n_since++] = (trn_done_step){ex, n};
        }
        if (done) rc = r->n_since >= r->o.snapshot_every ? trn_run_snapshot(r) : FU_OK;
        if (rc != FU_ERR_NETWORK || r->failed < 0) return rc;
        if ((rc = trn_run_recover_all(r))) return rc;
    }
}

int trn_run_eval(trn_run *r, const trn_example *ex, int n, double *loss, double *accuracy) {
    int64_t count;
    int rc = trn_count_targets(r, ex, n, &count);
    if (rc) return rc;
    if (!count) return fu_errorf(FU_ERR_RANGE, "evaluation: no target tokens");
    trn_loss sum;
    int n_micro;
    if ((rc = trn_run_all(r, ex, n, false, 0.0f, &sum, &n_micro))) return rc;
    *loss = sum.sum / (double)count;
    *accuracy = (double)sum.n_correct / (double)count;
    return FU_OK;
}
