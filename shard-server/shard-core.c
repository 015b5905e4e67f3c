/* shard-core.c -- sessions, KV admission control and the continuous batcher of a shard server. */
#include "shard-core.h"

#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "clock.h"
#include "engine.h"
#include "grow.h"
#include "log.h"
#include "shard-prefix.h"
#include "status.h"

#define SHARD_MAX_TOP_LOGPROBS 20
#define SHARD_GATHER_US 2000 /* longest wait for recently active sessions' next steps */
#define SHARD_ACTIVE_US 200000 /* a session whose step was queued or answered this recently counts as active */

/* A loaded LoRA adapter: its registry entry while loaded, and the sessions using it. */
typedef struct shard_adapter {
    char id[SHARD_ADAPTER_MAX_ID + 1];
    lora_adapter *ad;           /* owned */
    int refs;                   /* the registry's (while loaded) + one per session (guarded by mu) */
    uint64_t version;           /* the core's count of loads when it was loaded: keys its prefix-cache blocks */
    struct shard_adapter *next; /* the core's list of loaded adapters */
} shard_adapter;

struct shard_session {
    char id[129];
    eng_seq *seq;
    uint64_t kv_bytes;         /* reserved from the budget */
    int32_t *history;          /* (max_len) token id at each position, -1 if unknown */
    smp_sampler *smp;          /* created on the first sampling step */
    shard_adapter *ad;         /* NULL: the base model; a reference held until close */
    shard_session *next;       /* the core's list of sessions */

    /* prefix cache (the session's thread; pins under the core's mutex) */
    int pfx_tokens;            /* positions per block; 0: the cache is off */
    uint64_t pfx_seed;         /* the first block's parent: adapter and span */
    uint64_t pfx_parent;       /* hash of block pfx_done - 1 (pfx_seed when 0) */
    int pfx_done;              /* leading blocks known to be in the cache (imported or put there) */
    pfx_block **pins;          /* (n_pins) pinned at open for the first step */
    int n_pins;
    bool pfx_counted;          /* the first step's positions were counted */

    /* output buffers, grown on demand, owned by the session */
    float *out_f;              /* hidden (n, D) or logits (n_out, V) */
    size_t cap_f;
    int32_t *out_tok;          /* (n_out) */
    float *out_lp;             /* (n_out) */
    int32_t *out_top_ids;      /* (n_out, k) */
    float *out_top_lp;         /* (n_out, k) */
    size_t cap_tok, cap_lp, cap_top_ids, cap_top_lp;

    /* the step in flight (guarded by the core's mutex) */
    shard_step *step;
    shard_session *next_pending;
    bool done;
    int rc;
    char err[256];
    int step_done;             /* positions of the step computed so far (chunks) */
    bool cancel;               /* the step's client has gone: compute no more of it */
    int64_t t_enqueue_us;
    int64_t compute_acc_us;    /* the step's chunks' forward time so far */
    int64_t last_step_us;      /* when the session last queued a step or got its answer */
};

struct shard_core {
    const mdl_model *m;
    op_backend *be;
    eng_engine *e;
    shard_core_options o;

    pthread_mutex_t mu;
    pthread_cond_t cv_work;  /* the batcher waits for steps */
    pthread_cond_t cv_done;  /* submitters wait for their steps */
    pthread_cond_t cv_idle;  /* trainers wait for the batcher to have no work (shard_core_wait_idle) */
    pthread_t thread;
    bool running, stop;
    bool in_batch;           /* the batcher is computing a batch (outside mu) */
    shard_session *pend_head, *pend_tail;
    int n_pending;
    shard_session *sessions;
    uint64_t kv_used;
    shard_core_stats stats;
    shard_adapter *adapters;   /* loaded ones, by id */
    uint64_t adapter_loads;    /* adapters loaded since start (their versions) */
    pfx_cache *pfx;            /* NULL: prefix cache off; its blocks' bytes count against the budget */
    int n_adapters;
    pthread_mutex_t fwd_mu;    /* held around the engine's forwards and a sequence's adapter setting,
                                * which sizes the engine's scratch */

    /* batch scratch: batcher thread only */
    shard_session **b_sess;  /* (entries per batch) */
    int *b_off, *b_len;      /* each entry's chunk: positions [off, off + len) of its step */
    int32_t *b_tokens;       /* (cap_tokens) */
    float *b_hidden;         /* (cap_tokens, D) */
    eng_seq **b_seqs;        /* (cap_tokens) */
    uint8_t *b_want;         /* (cap_tokens) */
    float *b_out;            /* (cap_out) floats */
    size_t cap_tok, cap_seqs, cap_want, cap_hidden, cap_steps, cap_off, cap_len, cap_out;
};


/* ---- the batcher -------------------------------------------------------------- */

/* Which positions of a step produce output. */
static bool step_wants_output(const shard_core *c, const shard_step *st) {
    return !c->m->has_head || st->want_logits || st->sample;
}

static int step_n_out(const shard_core *c, const shard_step *st) {
    if (!c->m->has_head) return st->n;
    if (!st->want_logits && !st->sample) return 0;
    return st->all_positions ? st->n : 1;
}

/* Output rows that the chunk [off, off + len) of a step produces; *first: the first one's index
 * among the step's n_out rows. */
static int chunk_n_out(const shard_core *c, const shard_step *st, int off, int len, int *first) {
    *first = off;
    if (!c->m->has_head) return len;
    if (!st->want_logits && !st->sample) return 0;
    if (st->all_positions) return len;
    *first = 0;
    return off + len == st->n ? 1 : 0;
}

/* The sampling seed of output row i (0 <= i < n_out): the step's seed is the seed
 * of its last row; with all_positions the earlier rows count down from it, so
 * row i draws with seed - (n_out - 1 - i). */
static uint64_t shard_row_seed(const shard_step *st, int i) {
    return st->sampling.seed - (uint64_t)(st->n_out - 1 - i);
}

/* Output row i's token, its log-prob and top alternatives from the row's logits: the next
 * input token when scoring inputs (every row but the last), else a sampled one. */
static int shard_sample_row(shard_core *c, shard_session *s, const float *row, int i) {
    shard_step *st = s->step;
    const size_t V = (size_t)c->m->cfg.vocab_size;
    const int k = st->top_logprobs;
    int32_t *ids = s->out_top_ids + (size_t)i * k;
    float *lps = s->out_top_lp + (size_t)i * k;
    int32_t tok;
    if (st->score_inputs && i < st->n_out - 1) {
        tok = st->tokens[i + 1];
    } else {
        int pos = st->all_positions ? (int)st->start_pos + i : (int)st->start_pos + st->n - 1;
        smp_params p = st->sampling;
        p.seed = shard_row_seed(st, i);
        int rc = smp_reset(s->smp, &p);
        if (rc) return rc;
        for (int64_t q = st->penalty_start < 0 ? 0 : st->penalty_start; q <= pos; q++)
            if (s->history[q] >= 0) smp_accept(s->smp, s->history[q]);
        float *work = s->out_f + (st->want_logits ? (size_t)st->n_out * V : 0); /* (V) scratch */
        memcpy(work, row, V * sizeof(float));
        tok = smp_sample(s->smp, work);
    }
    s->out_tok[i] = tok;
    s->out_lp[i] = smp_top_logprobs(row, (int)V, tok, k, ids, lps);
    return FU_OK;
}

/* Fills a session's outputs for the chunk [off, off + len) of its step from the chunk's rows
 * of the batch's output. */
static int shard_finish_chunk(shard_core *c, shard_session *s, const float *rows, int off, int len) {
    shard_step *st = s->step;
    const mdl_config *cfg = &c->m->cfg;
    for (int j = 0; j < len; j++) s->history[st->start_pos + off + j] = st->tokens ? st->tokens[off + j] : -1;
    if (!c->m->has_head) {
        memcpy(s->out_f + (size_t)off * (size_t)cfg->dim, rows, (size_t)len * (size_t)cfg->dim * sizeof(float));
        return FU_OK;
    }
    const size_t V = (size_t)cfg->vocab_size;
    int first, n = chunk_n_out(c, st, off, len, &first);
    if (st->want_logits) memcpy(s->out_f + (size_t)first * V, rows, (size_t)n * V * sizeof(float));
    for (int i = 0; st->sample && i < n; i++) {
        int rc = shard_sample_row(c, s, rows + (size_t)i * V, first + i);
        if (rc) return rc;
    }
    return FU_OK;
}

/* Points a finished step's outputs at the session's buffers. */
static void shard_publish_outputs(shard_core *c, shard_session *s) {
    shard_step *st = s->step;
    if (!c->m->has_head) {
        st->out_hidden = s->out_f;
        return;
    }
    if (st->want_logits) st->out_logits = s->out_f;
    if (!st->sample) return;
    st->out_tokens = s->out_tok;
    st->out_logprobs = s->out_lp;
    st->out_top_ids = st->top_logprobs ? s->out_top_ids : NULL;
    st->out_top_lp = st->top_logprobs ? s->out_top_lp : NULL;
}

/* Ends a session's step with rc (mu held): a failed or cancelled one is rolled back to where
 * it started; the submitter is woken. */
static void shard_complete(shard_core *c, shard_session *s, int rc, const char *why) {
    shard_step *st = s->step;
    if (rc) {
        eng_seq_truncate(s->seq, (int)st->start_pos);
        if (why) snprintf(s->err, sizeof s->err, "%s", why);
        if (rc == FU_ERR_CANCELLED && s->cancel)
            FU_LOG(FU_LOG_LEVEL_INFO, s->id, "step cancelled after %d of %d positions: its client went away",
                   s->step_done, st->n);
    } else {
        shard_publish_outputs(c, s);
    }
    int64_t now = fu_now_us();
    st->compute_us = s->compute_acc_us;
    st->queue_us = now - s->t_enqueue_us - s->compute_acc_us;
    s->rc = rc;
    s->done = true;
    s->last_step_us = now;
    pthread_cond_broadcast(&c->cv_done);
}

/* Appends a session to the queue of pending steps (mu held). */
static void shard_enqueue(shard_core *c, shard_session *s) {
    s->next_pending = NULL;
    if (c->pend_tail) c->pend_tail->next_pending = s;
    else c->pend_head = s;
    c->pend_tail = s;
    c->n_pending++;
}

/* Takes the first pending session off the queue (mu held; the queue is not empty). */
static shard_session *shard_dequeue(shard_core *c) {
    shard_session *s = c->pend_head;
    c->pend_head = s->next_pending;
    if (!c->pend_head) c->pend_tail = NULL;
    c->n_pending--;
    return s;
}

/* Grows the batch's per-entry arrays to hold n entries. */
static int shard_grow_batch(shard_core *c, size_t n) {
    if (fu_grow((void **)&c->b_off, &c->cap_off, n, sizeof *c->b_off) ||
        fu_grow((void **)&c->b_len, &c->cap_len, n, sizeof *c->b_len) ||
        fu_grow((void **)&c->b_sess, &c->cap_steps, n, sizeof *c->b_sess))
        return FU_ERR_NOMEM;
    return FU_OK;
}

/* Takes pending steps, or their next chunks, in arrival order into the batch while it has
 * room (mu held): a step longer than the room left runs its first positions now and goes back
 * to the end of the queue. Cancelled steps are completed on the way. Returns the entries. */
static int shard_take_batch(shard_core *c) {
    int n = 0, tokens = 0;
    while (c->pend_head && tokens < c->o.max_batch_tokens) {
        if (shard_grow_batch(c, (size_t)n + 1)) break;
        shard_session *s = shard_dequeue(c);
        if (s->cancel) {
            shard_complete(c, s, FU_ERR_CANCELLED, "cancelled: the client went away");
            continue;
        }
        int left = s->step->n - s->step_done, room = c->o.max_batch_tokens - tokens;
        c->b_sess[n] = s;
        c->b_off[n] = s->step_done;
        c->b_len[n] = left < room ? left : room;
        tokens += c->b_len[n++];
    }
    return n;
}

/* Sizes the batch scratch for T tokens and n_want output rows. */
static int shard_grow_scratch(shard_core *c, size_t T, size_t n_want) {
    const mdl_model *m = c->m;
    const size_t row = m->has_head ? (size_t)m->cfg.vocab_size : (size_t)m->cfg.dim;
    if (fu_grow((void **)&c->b_tokens, &c->cap_tok, T, sizeof *c->b_tokens) ||
        fu_grow((void **)&c->b_seqs, &c->cap_seqs, T, sizeof *c->b_seqs) ||
        fu_grow((void **)&c->b_want, &c->cap_want, T, sizeof *c->b_want) ||
        (!m->has_embed && fu_grow((void **)&c->b_hidden, &c->cap_hidden, T * (size_t)m->cfg.dim, sizeof(float))) ||
        fu_grow((void **)&c->b_out, &c->cap_out, (n_want ? n_want : 1) * row, sizeof(float)))
        return fu_errorf(FU_ERR_NOMEM, "batch of %zu tokens", T);
    return FU_OK;
}

/* Lays the batch's n entries out as one eng_batch (tokens or hidden states, sequences, which
 * rows to output) and runs the forward into b_out. */
static int shard_forward_batch(shard_core *c, int n, size_t T) {
    const mdl_model *m = c->m;
    const int D = m->cfg.dim;
    size_t t = 0;
    for (int i = 0; i < n; i++) {
        shard_step *st = c->b_sess[i]->step;
        const int off = c->b_off[i], len = c->b_len[i];
        bool out = step_wants_output(c, st);
        if (!m->has_embed)
            memcpy(c->b_hidden + t * (size_t)D, st->hidden + (size_t)off * (size_t)D,
                   (size_t)len * (size_t)D * sizeof(float));
        for (int j = off; j < off + len; j++, t++) {
            c->b_seqs[t] = c->b_sess[i]->seq;
            if (m->has_embed) c->b_tokens[t] = st->tokens[j];
            c->b_want[t] = out && (!m->has_head || st->all_positions || j == st->n - 1);
        }
    }
    eng_batch b = {(int)T, m->has_embed ? c->b_tokens : NULL, m->has_embed ? NULL : c->b_hidden, c->b_seqs,
                   c->b_want};
    pthread_mutex_lock(&c->fwd_mu);
    int rc = eng_forward(c->e, &b, c->b_out);
    pthread_mutex_unlock(&c->fwd_mu);
    return rc;
}

/* Runs one batched forward over the batch's n entries, fills their outputs, then completes
 * each step whose last chunk ran (or that failed or was cancelled) and queues the others'
 * next chunks. */
static void shard_run_batch(shard_core *c, int n) {
    const size_t row = c->m->has_head ? (size_t)c->m->cfg.vocab_size : (size_t)c->m->cfg.dim;
    size_t T = 0, n_want = 0;
    int first;
    for (int i = 0; i < n; i++) {
        T += (size_t)c->b_len[i];
        n_want += (size_t)chunk_n_out(c, c->b_sess[i]->step, c->b_off[i], c->b_len[i], &first);
    }
    int64_t t0 = fu_now_us();
    int rc = shard_grow_scratch(c, T, n_want);
    if (!rc) rc = shard_forward_batch(c, n, T);
    int64_t t1 = fu_now_us();
    const char *err = rc ? fu_last_error() : "";
    const float *rows = c->b_out;
    for (int i = 0; i < n; i++) {
        shard_session *s = c->b_sess[i];
        s->rc = rc;
        if (rc) snprintf(s->err, sizeof s->err, "%s", err);
        else if ((s->rc = shard_finish_chunk(c, s, rows, c->b_off[i], c->b_len[i])))
            snprintf(s->err, sizeof s->err, "%s", fu_last_error());
        rows += (size_t)chunk_n_out(c, s->step, c->b_off[i], c->b_len[i], &first) * row;
    }
    pthread_mutex_lock(&c->mu);
    for (int i = 0; i < n; i++) {
        shard_session *s = c->b_sess[i];
        s->step_done += c->b_len[i];
        s->compute_acc_us += t1 - t0;
        if (s->rc) shard_complete(c, s, s->rc, NULL);
        else if (s->step_done == s->step->n) shard_complete(c, s, FU_OK, NULL);
        else if (s->cancel) shard_complete(c, s, FU_ERR_CANCELLED, "cancelled: the client went away");
        else shard_enqueue(c, s);
    }
    if (!rc) {
        c->stats.batches++;
        c->stats.batched_steps += (uint64_t)n;
        c->stats.tokens += T;
    }
    pthread_mutex_unlock(&c->mu);
}

/* Waits a moment for the next steps of recently active sessions (mu held): they send them
 * within a round trip of their last reply, and running them in one batch beats alternating
 * in smaller ones. (Counting from the answer matters: a batch can take longer than
 * SHARD_ACTIVE_US.) */
static void shard_gather(shard_core *c) {
    int active = 0;
    int64_t now = fu_now_us();
    for (shard_session *s = c->sessions; s; s = s->next) active += now - s->last_step_us < SHARD_ACTIVE_US;
    if (c->n_pending >= active) return;
    struct timespec dl = fu_deadline_us(CLOCK_REALTIME, SHARD_GATHER_US);
    while (!c->stop && c->n_pending < active && pthread_cond_timedwait(&c->cv_work, &c->mu, &dl) == 0) {
    }
}

static void *shard_batcher(void *arg) {
    shard_core *c = arg;
    pthread_mutex_lock(&c->mu);
    for (;;) {
        while (!c->pend_head && !c->stop) pthread_cond_wait(&c->cv_work, &c->mu);
        if (c->stop) break;
        shard_gather(c);
        if (c->stop) break;
        int n = shard_take_batch(c);
        if (n == 0) { /* all cancelled, or the batch list could not grow: fail the first step */
            if (c->pend_head) shard_complete(c, shard_dequeue(c), FU_ERR_NOMEM, "batch");
            continue;
        }
        c->in_batch = true;
        pthread_mutex_unlock(&c->mu);
        shard_run_batch(c, n);
        pthread_mutex_lock(&c->mu);
        c->in_batch = false;
        if (!c->pend_head) pthread_cond_broadcast(&c->cv_idle);
    }
    while (c->pend_head) shard_complete(c, shard_dequeue(c), FU_ERR_CANCELLED, "the server is shutting down");
    pthread_cond_broadcast(&c->cv_idle);
    pthread_mutex_unlock(&c->mu);
    return NULL;
}

/* ---- core ---------------------------------------------------------------------------- */

int shard_core_new(const mdl_model *m, op_backend *be, const shard_core_options *o, shard_core **out) {
    *out = NULL;
    shard_core *c = calloc(1, sizeof *c);
    if (!c) return fu_errorf(FU_ERR_NOMEM, "shard core");
    c->m = m;
    c->be = be;
    if (o) c->o = *o;
    if (!c->o.kv_budget_bytes) c->o.kv_budget_bytes = (uint64_t)1 << 30;
    if (c->o.max_batch_tokens <= 0) c->o.max_batch_tokens = 512;
    if (c->o.kv_type != OP_TYPE_F16) c->o.kv_type = OP_TYPE_F32;
    if (!c->o.max_logits_bytes) c->o.max_logits_bytes = (uint64_t)64 << 20;
    if (c->o.max_adapters <= 0) c->o.max_adapters = 8;
    if (c->o.max_lora_rank <= 0) c->o.max_lora_rank = 256;
    if (c->o.kv_block_tokens <= 0) c->o.kv_block_tokens = 32;
    eng_options eo = {c->o.max_batch_tokens, c->o.kv_type};
    int rc = eng_new(m, be, &eo, &c->e);
    if (!rc && !c->o.prefix_cache_off)
        rc = pfx_cache_new(c->o.kv_block_tokens, eng_kv_bytes_per_pos(c->e) * (uint64_t)c->o.kv_block_tokens, &c->pfx);
    if (rc) {
        eng_free(c->e);
        free(c);
        return rc;
    }
    pthread_mutex_init(&c->mu, NULL);
    pthread_mutex_init(&c->fwd_mu, NULL);
    pthread_cond_init(&c->cv_work, NULL);
    pthread_cond_init(&c->cv_done, NULL);
    pthread_cond_init(&c->cv_idle, NULL);
    if (pthread_create(&c->thread, NULL, shard_batcher, c)) {
        shard_core_free(c);
        return fu_errorf(FU_ERR_INTERNAL, "cannot start the batcher thread");
    }
    c->running = true;
    *out = c;
    return FU_OK;
}

void shard_core_free(shard_core *c) {
    if (!c) return;
    if (c->running) {
        pthread_mutex_lock(&c->mu);
        c->stop = true;
        pthread_cond_broadcast(&c->cv_work);
        pthread_mutex_unlock(&c->mu);
        pthread_join(c->thread, NULL);
    }
    while (c->sessions) shard_session_close(c, c->sessions);
    while (c->adapters) shard_core_adapter_unload(c, c->adapters->id);
    pthread_mutex_destroy(&c->mu);
    pthread_mutex_destroy(&c->fwd_mu);
    pthread_cond_destroy(&c->cv_work);
    pthread_cond_destroy(&c->cv_done);
    pthread_cond_destroy(&c->cv_idle);
    pfx_cache_free(c->pfx);
    eng_free(c->e);
    free(c->b_sess);
    free(c->b_off);
    free(c->b_len);
    free(c->b_tokens);
    free(c->b_hidden);
    free(c->b_seqs);
    free(c->b_want);
    free(c->b_out);
    free(c);
}

const mdl_model *shard_core_model(const shard_core *c) { return c->m; }

eng_engine *shard_core_engine(shard_core *c) { return c->e; }

void shard_core_get_stats(shard_core *c, shard_core_stats *st) {
    pthread_mutex_lock(&c->mu);
    *st = c->stats;
    st->kv_total_bytes = c->o.kv_budget_bytes;
    st->kv_free_bytes = c->o.kv_budget_bytes - c->kv_used;
    st->kv_bytes_per_pos = eng_kv_bytes_per_pos(c->e);
    st->prefix_cached_blocks = c->pfx ? pfx_cache_blocks(c->pfx) : 0;
    st->prefix_cached_bytes = c->pfx ? pfx_cache_bytes(c->pfx) : 0;
    int n = 0;
    for (shard_session *s = c->sessions; s; s = s->next) n++;
    st->active_sessions = n;
    pthread_mutex_unlock(&c->mu);
}

/* ---- training beside inference ------------------------------------------------------------ */

/* True while inference has work (mu held): steps queued (or being gathered) or a batch computing. */
static bool shard_busy(const shard_core *c) { return c->pend_head || c->in_batch; }

int64_t shard_core_wait_idle(shard_core *c, int64_t max_wait_us) {
    pthread_mutex_lock(&c->mu);
    if (!shard_busy(c) || max_wait_us <= 0) {
        pthread_mutex_unlock(&c->mu);
        return 0;
    }
    const int64_t t0 = fu_now_us();
    struct timespec dl = fu_deadline_us(CLOCK_REALTIME, max_wait_us);
    while (!c->stop && shard_busy(c) && pthread_cond_timedwait(&c->cv_idle, &c->mu, &dl) == 0) {
    }
    const int64_t waited = fu_now_us() - t0;
    c->stats.train_waits++;
    c->stats.train_wait_us += (uint64_t)waited;
    pthread_mutex_unlock(&c->mu);
    return waited;
}

/* ---- adapters ---------------------------------------------------------------------------- */

/* Refuses an adapter id that is empty, over SHARD_ADAPTER_MAX_ID bytes or holds a control
 * character (FU_ERR_INVALID). */
static int shard_adapter_id_check(const char *id) {
    size_t n = id ? strlen(id) : 0;
    if (n == 0 || n > SHARD_ADAPTER_MAX_ID)
        return fu_errorf(FU_ERR_INVALID, "adapter id must be 1..%d bytes", SHARD_ADAPTER_MAX_ID);
    for (size_t i = 0; i < n; i++)
        if ((unsigned char)id[i] < 0x20 || id[i] == 0x7f)
            return fu_errorf(FU_ERR_INVALID, "adapter id: control character 0x%02x at byte %zu",
                             (unsigned char)id[i], i);
    return FU_OK;
}

/* Checks that adapter ad fits the core: rank within its limit, its span, model shape and q/k
 * order (FU_ERR_INVALID naming the difference). */
static int shard_adapter_fits(const shard_core *c, const lora_adapter *ad) {
    const mdl_model *m = c->m;
    lora_shape shape = lora_shape_of(&m->cfg);
    if (ad->cfg.r < 1 || ad->cfg.r > c->o.max_lora_rank)
        return fu_errorf(FU_ERR_INVALID, "adapter rank %d outside [1, %d] (this server's limit)", ad->cfg.r,
                         c->o.max_lora_rank);
    if (ad->first != m->first || ad->last != m->last)
        return fu_errorf(FU_ERR_INVALID, "adapter holds blocks [%d, %d), this server [%d, %d)", ad->first,
                         ad->last, m->first, m->last);
    if (memcmp(&ad->shape, &shape, sizeof shape))
        return fu_errorf(FU_ERR_INVALID, "adapter is for another model shape");
    if (ad->qk_interleaved != (m->cfg.rope_mode == OP_ROPE_NORM))
        return fu_errorf(FU_ERR_INVALID, "adapter holds q/k rows in another order than the model");
    return FU_OK;
}

/* The loaded adapter `id` (mu held); NULL if none. *pp: the link pointing at it. */
static shard_adapter *shard_adapter_find(shard_core *c, const char *id, shard_adapter ***pp) {
    for (shard_adapter **p = &c->adapters; *p; p = &(*p)->next)
        if (!strcmp((*p)->id, id)) {
            if (pp) *pp = p;
            return *p;
        }
    return NULL;
}

/* Drops one reference to a (mu held), freeing it with the last. */
static void shard_adapter_put(shard_adapter *a) {
    if (!a || --a->refs > 0) return;
    lora_free(a->ad);
    free(a);
}

/* Takes loaded adapter a off the registry (mu held): sessions using it keep it. */
static void shard_adapter_unlink(shard_core *c, shard_adapter **pp) {
    shard_adapter *a = *pp;
    *pp = a->next;
    c->n_adapters--;
    shard_adapter_put(a);
}

int shard_core_adapter_load(shard_core *c, const char *id, lora_adapter *ad) {
    int rc = shard_adapter_id_check(id);
    if (!rc) rc = shard_adapter_fits(c, ad);
    if (rc) return rc;
    shard_adapter *a = calloc(1, sizeof *a);
    if (!a) return fu_errorf(FU_ERR_NOMEM, "adapter '%s'", id);
    snprintf(a->id, sizeof a->id, "%s", id);
    a->ad = ad;
    a->refs = 1;
    pthread_mutex_lock(&c->mu);
    shard_adapter **pp = NULL;
    shard_adapter *old = shard_adapter_find(c, id, &pp);
    if (!old && c->n_adapters >= c->o.max_adapters) {
        pthread_mutex_unlock(&c->mu);
        free(a);
        return fu_errorf(FU_ERR_EXHAUSTED, "%d adapters are loaded, this server's limit: unload one first",
                         c->o.max_adapters);
    }
    if (old) shard_adapter_unlink(c, pp);
    a->version = ++c->adapter_loads;
    a->next = c->adapters;
    c->adapters = a;
    c->n_adapters++;
    pthread_mutex_unlock(&c->mu);
    FU_INFO("adapter '%s' %s: rank %d, blocks [%d, %d)", id, old ? "replaced" : "loaded", ad->cfg.r, ad->first,
            ad->last);
    return FU_OK;
}

int shard_core_adapter_unload(shard_core *c, const char *id) {
    pthread_mutex_lock(&c->mu);
    shard_adapter **pp = NULL;
    shard_adapter *a = id ? shard_adapter_find(c, id, &pp) : NULL;
    if (a) shard_adapter_unlink(c, pp);
    pthread_mutex_unlock(&c->mu);
    if (!a) return fu_errorf(FU_ERR_NOT_FOUND, "adapter '%.64s' is not loaded on this server", id ? id : "");
    return FU_OK;
}

int shard_core_adapter_ids(shard_core *c, char ***ids, int *n) {
    *ids = NULL;
    *n = 0;
    pthread_mutex_lock(&c->mu);
    size_t bytes = 0;
    for (shard_adapter *a = c->adapters; a; a = a->next) bytes += sizeof(char *) + strlen(a->id) + 1;
    char **v = c->n_adapters ? malloc(bytes) : NULL;
    if (c->n_adapters && !v) {
        pthread_mutex_unlock(&c->mu);
        return fu_errorf(FU_ERR_NOMEM, "adapter ids");
    }
    char *text = (char *)(v + c->n_adapters);
    int k = 0;
    for (shard_adapter *a = c->adapters; a; a = a->next) {
        size_t len = strlen(a->id) + 1;
        v[k++] = memcpy(text, a->id, len);
        text += len;
    }
    pthread_mutex_unlock(&c->mu);
    *ids = v;
    *n = k;
    return FU_OK;
}

/* ---- prefix cache ------------------------------------------------------------------------ */

/* Gives back the blocks s pinned at open (mu held). */
static void shard_prefix_unpin(shard_core *c, shard_session *s) {
    if (s->n_pins) pfx_cache_release(c->pfx, s->pins, s->n_pins);
    s->n_pins = 0;
}

/* Marks the session's first k blocks (their tokens in history) as known cached. */
static void shard_prefix_known(shard_session *s, int k) {
    const int B = s->pfx_tokens;
    s->pfx_done = k;
    s->pfx_parent = s->pfx_seed;
    for (int i = 0; i < k; i++) s->pfx_parent = pfx_hash(s->pfx_parent, s->history + (size_t)i * B, B);
}

/* After a rollback to len positions: the blocks known cached are those wholly before len. */
static void shard_prefix_rewind(shard_session *s, int len) {
    if (s->pfx_tokens && s->pfx_done * s->pfx_tokens > len) shard_prefix_known(s, len / s->pfx_tokens);
}

/* On the session's first step (mu held): its pins go (reuse_prefix took what it needed) and its
 * positions count as a prompt. */
static void shard_prefix_first_step(shard_core *c, shard_session *s, const shard_step *st) {
    shard_prefix_unpin(c, s);
    if (s->pfx_counted) return;
    s->pfx_counted = true;
    c->stats.prefix_prompt_tokens += (uint64_t)(st->start_pos + st->n);
}

/* Makes room for one more block within the KV budget (mu held): false when even evicting every
 * unpinned block would not. */
static bool shard_prefix_room(shard_core *c) {
    const uint64_t block = eng_kv_bytes_per_pos(c->e) * (uint64_t)c->o.kv_block_tokens;
    uint64_t used = c->kv_used + pfx_cache_bytes(c->pfx);
    if (used + block > c->o.kv_budget_bytes) pfx_cache_evict(c->pfx, used + block - c->o.kv_budget_bytes);
    return c->kv_used + pfx_cache_bytes(c->pfx) + block <= c->o.kv_budget_bytes;
}

/* Copies block k of s (wholly computed) into a reserved cache block and publishes it. */
static void shard_prefix_put(shard_core *c, shard_session *s, pfx_block *b, int k) {
    pthread_mutex_lock(&c->fwd_mu);
    int rc = eng_seq_kv_export(s->seq, k * s->pfx_tokens, s->pfx_tokens, pfx_block_fill(b));
    pthread_mutex_unlock(&c->fwd_mu);
    pthread_mutex_lock(&c->mu);
    if (rc) pfx_cache_abandon(c->pfx, b);
    else pfx_cache_publish(c->pfx, b);
    pthread_mutex_unlock(&c->mu);
}

/* After a step: puts the session's full blocks not yet known cached into the cache, while their
 * token ids are known and the budget has room (the session's thread; the session is idle). */
static void shard_prefix_capture(shard_core *c, shard_session *s) {
    const int B = s->pfx_tokens, len = eng_seq_len(s->seq);
    while (B && (s->pfx_done + 1) * B <= len) {
        const int32_t *t = s->history + (size_t)s->pfx_done * B;
        for (int i = 0; i < B; i++)
            if (t[i] < 0) return; /* no token ids came with these positions */
        pthread_mutex_lock(&c->mu);
        bool room = shard_prefix_room(c);
        pfx_block *b = room ? pfx_cache_reserve(c->pfx, s->pfx_parent, t) : NULL;
        pthread_mutex_unlock(&c->mu);
        if (!room) return;
        if (b) shard_prefix_put(c, s, b, s->pfx_done);
        s->pfx_parent = pfx_hash(s->pfx_parent, t, B);
        s->pfx_done++;
    }
}

int shard_session_pin_prefix(shard_core *c, shard_session *s, const int32_t *tokens, int n) {
    const int B = s->pfx_tokens;
    int limit = n < eng_seq_max_len(s->seq) ? n : eng_seq_max_len(s->seq);
    int max_blocks = B && limit > 0 ? (limit - 1) / B : 0;
    if (!max_blocks || eng_seq_len(s->seq) || s->n_pins) return 0;
    pfx_block **pins = realloc(s->pins, (size_t)max_blocks * sizeof *pins);
    if (!pins) return 0;
    s->pins = pins;
    pthread_mutex_lock(&c->mu);
    s->n_pins = pfx_cache_acquire(c->pfx, s->pfx_seed, tokens, n, max_blocks, s->pins);
    pthread_mutex_unlock(&c->mu);
    return s->n_pins * B;
}

int shard_session_reuse_prefix(shard_core *c, shard_session *s, int n) {
    const int B = s->pfx_tokens;
    if (n < 0 || n > s->n_pins * B || eng_seq_len(s->seq))
        return fu_errorf(FU_ERR_RANGE, "prefix of %d positions: session '%s' has %d cached positions pinned and holds %d",
                         n, s->id, s->n_pins * B, eng_seq_len(s->seq));
    int rc = FU_OK;
    pthread_mutex_lock(&c->fwd_mu);
    for (int k = 0; k * B < n && !rc; k++) {
        int m = n - k * B < B ? n - k * B : B;
        rc = eng_seq_kv_import(s->seq, k * B, m, pfx_block_data(s->pins[k]), B);
        if (!rc) memcpy(s->history + (size_t)k * B, pfx_block_tokens(s->pins[k]), (size_t)m * sizeof *s->history);
    }
    pthread_mutex_unlock(&c->fwd_mu);
    if (rc) eng_seq_truncate(s->seq, 0);
    else if (B) shard_prefix_known(s, n / B); /* B is 0 (the cache off) only when n is */
    pthread_mutex_lock(&c->mu);
    if (!rc) c->stats.prefix_hit_tokens += (uint64_t)n;
    shard_prefix_unpin(c, s);
    pthread_mutex_unlock(&c->mu);
    return rc;
}

/* ---- sessions ------------------------------------------------------------------------- */

/* Checks a new session's id and length against the core (caller's thread). */
static int shard_session_check(const shard_core *c, const char *id, int max_len) {
    size_t idlen = id ? strlen(id) : 0;
    if (idlen == 0 || idlen > 128)
        return fu_errorf(FU_ERR_INVALID, "session id must be 1..128 characters");
    for (size_t i = 0; i < idlen; i++)
        if (id[i] < 0x21 || id[i] > 0x7e)
            return fu_errorf(FU_ERR_INVALID, "session id must be printable ASCII without spaces");
    const int limit = c->m->cfg.max_seq_len;
    if (max_len <= 0 || max_len > limit)
        return fu_errorf(FU_ERR_RANGE, "max_length %d outside [1, %d]", max_len, limit);
    return FU_OK;
}

/* Admits a session (mu held): a new id, its adapter loaded (a reference taken into *ad), `need`
 * bytes of KV budget reserved. */
static int shard_session_admit(shard_core *c, const char *id, int max_len, const char *adapter_id, uint64_t need,
                               shard_adapter **ad) {
    *ad = NULL;
    for (shard_session *s = c->sessions; s; s = s->next)
        if (!strcmp(s->id, id)) return fu_errorf(FU_ERR_INVALID, "session '%s' already exists", id);
    shard_adapter *a = adapter_id && adapter_id[0] ? shard_adapter_find(c, adapter_id, NULL) : NULL;
    if (adapter_id && adapter_id[0] && !a)
        return fu_errorf(FU_ERR_NOT_FOUND, "adapter '%.64s' is not loaded on this server", adapter_id);
    uint64_t cached = c->pfx ? pfx_cache_bytes(c->pfx) : 0;
    if (cached && need > c->o.kv_budget_bytes - c->kv_used - cached) /* cached blocks give way first */
        pfx_cache_evict(c->pfx, need - (c->o.kv_budget_bytes - c->kv_used - cached));
    if (need > c->o.kv_budget_bytes - c->kv_used - (c->pfx ? pfx_cache_bytes(c->pfx) : 0)) {
        uint64_t free_b = c->o.kv_budget_bytes - c->kv_used, per_pos = eng_kv_bytes_per_pos(c->e);
        return fu_errorf(FU_ERR_EXHAUSTED,
                         "KV cache full: a session of %d positions needs %.1f MiB, %.1f MiB of %.1f MiB "
                         "free (%d positions)",
                         max_len, need / 1048576.0, free_b / 1048576.0, c->o.kv_budget_bytes / 1048576.0,
                         (int)(free_b / (per_pos ? per_pos : 1)));
    }
    c->kv_used += need; /* reserved before allocating outside the lock */
    if (a) a->refs++;
    *ad = a;
    return FU_OK;
}

/* Frees a session that is in no list (its KV reservation and adapter reference already given
 * back). NULL is a no-op. */
static void shard_session_free(shard_core *c, shard_session *s) {
    if (!s) return;
    eng_seq_free(c->e, s->seq);
    smp_free(s->smp);
    free(s->pins);
    free(s->history);
    free(s->out_f);
    free(s->out_tok);
    free(s->out_lp);
    free(s->out_top_ids);
    free(s->out_top_lp);
    free(s);
}

/* Allocates an admitted session: its history, its sequence and the sequence's adapter (set
 * while no forward runs: it sizes the engine's scratch). */
static int shard_session_alloc(shard_core *c, const char *id, int max_len, shard_adapter *a, shard_session **out) {
    shard_session *s = calloc(1, sizeof *s);
    *out = s;
    if (!s) return fu_errorf(FU_ERR_NOMEM, "session");
    snprintf(s->id, sizeof s->id, "%s", id);
    s->pfx_tokens = c->pfx ? c->o.kv_block_tokens : 0;
    s->pfx_seed = s->pfx_parent = pfx_seed(a ? a->id : NULL, a ? a->version : 0, c->m->first, c->m->last);
    s->history = malloc((size_t)max_len * sizeof *s->history);
    int rc = s->history ? eng_seq_new(c->e, max_len, &s->seq) : fu_errorf(FU_ERR_NOMEM, "session");
    if (!rc && a) {
        pthread_mutex_lock(&c->fwd_mu);
        rc = eng_seq_set_adapter(s->seq, a->ad);
        pthread_mutex_unlock(&c->fwd_mu);
    }
    return rc;
}

int shard_session_open(shard_core *c, const char *id, int max_len, const char *adapter_id, shard_session **out) {
    *out = NULL;
    int rc = shard_session_check(c, id, max_len);
    if (rc) return rc;
    uint64_t need = eng_kv_bytes_per_pos(c->e) * (uint64_t)max_len;
    shard_adapter *a = NULL;
    pthread_mutex_lock(&c->mu);
    rc = shard_session_admit(c, id, max_len, adapter_id, need, &a);
    pthread_mutex_unlock(&c->mu);
    if (rc) return rc;
    shard_session *s = NULL;
    rc = shard_session_alloc(c, id, max_len, a, &s);
    pthread_mutex_lock(&c->mu);
    if (rc) {
        c->kv_used -= need;
        shard_adapter_put(a);
    } else {
        s->kv_bytes = need;
        s->ad = a;
        s->next = c->sessions;
        c->sessions = s;
    }
    pthread_mutex_unlock(&c->mu);
    if (rc) shard_session_free(c, s);
    else *out = s;
    return rc;
}

void shard_session_close(shard_core *c, shard_session *s) {
    if (!s) return;
    pthread_mutex_lock(&c->mu);
    for (shard_session **pp = &c->sessions; *pp; pp = &(*pp)->next)
        if (*pp == s) {
            *pp = s->next;
            break;
        }
    c->kv_used -= s->kv_bytes;
    shard_prefix_unpin(c, s);
    shard_adapter_put(s->ad); /* its steps are over: no batch uses the adapter through it */
    pthread_mutex_unlock(&c->mu);
    shard_session_free(c, s);
}

int shard_session_len(const shard_session *s) { return eng_seq_len(s->seq); }
int shard_session_max_len(const shard_session *s) { return eng_seq_max_len(s->seq); }
const char *shard_session_id(const shard_session *s) { return s->id; }

int shard_session_rollback(shard_session *s, int len) {
    int rc = eng_seq_truncate(s->seq, len);
    if (!rc) shard_prefix_rewind(s, len);
    return rc;
}

/* Checks a step's inputs against the session: positions, token ids, hidden states. */
static int shard_step_check_inputs(shard_core *c, shard_session *s, const shard_step *st) {
    const mdl_model *m = c->m;
    const int len = eng_seq_len(s->seq), max_len = eng_seq_max_len(s->seq);
    if (st->n <= 0) return fu_errorf(FU_ERR_INVALID, "a step needs at least one position");
    if (st->start_pos != len)
        return fu_errorf(FU_ERR_INVALID, "start_position %lld but session '%s' holds %d positions",
                         (long long)st->start_pos, s->id, len);
    if (st->n > max_len - len)
        return fu_errorf(FU_ERR_RANGE, "%d positions exceed session '%s' max_length %d (holds %d)", st->n,
                         s->id, max_len, len);
    if (m->has_embed && !st->tokens)
        return fu_errorf(FU_ERR_INVALID, "this server holds the embeddings: send token ids");
    if (!m->has_embed && !st->hidden)
        return fu_errorf(FU_ERR_INVALID, "this server starts at block %d: send hidden states", m->first);
    if (st->tokens)
        for (int i = 0; i < st->n; i++)
            if (st->tokens[i] < 0 || st->tokens[i] >= m->cfg.vocab_size)
                return fu_errorf(FU_ERR_INVALID, "token id %d outside the vocabulary [0, %d)",
                                 st->tokens[i], m->cfg.vocab_size);
    if (st->hidden) {
        size_t nh = (size_t)st->n * (size_t)m->cfg.dim;
        for (size_t i = 0; i < nh; i++)
            if (!isfinite(st->hidden[i]))
                return fu_errorf(FU_ERR_INVALID, "hidden state has a non-finite value at %zu", i);
    }
    return FU_OK;
}

/* Checks a step and sizes the session's output buffers (caller's thread). */
static int shard_step_prepare(shard_core *c, shard_session *s, shard_step *st) {
    const mdl_model *m = c->m;
    int rc = shard_step_check_inputs(c, s, st);
    if (rc) return rc;
    if (!m->has_head) {
        st->want_logits = st->sample = st->score_inputs = false;
        st->top_logprobs = 0;
    }
    if (st->score_inputs && (!st->sample || !st->all_positions || !st->tokens))
        return fu_errorf(FU_ERR_INVALID, "scoring inputs needs sampling, all positions and the token ids");
    if (st->top_logprobs < 0 || st->top_logprobs > SHARD_MAX_TOP_LOGPROBS)
        return fu_errorf(FU_ERR_INVALID, "top_logprobs must be in [0, %d]", SHARD_MAX_TOP_LOGPROBS);
    if (st->sample && (rc = s->smp ? smp_reset(s->smp, &st->sampling)
                                   : smp_new(&st->sampling, m->cfg.vocab_size, &s->smp)))
        return rc;
    st->n_out = step_n_out(c, st);
    const uint64_t row = (uint64_t)m->cfg.vocab_size * sizeof(float), logits = st->want_logits ? st->n_out * row : 0;
    if (logits > c->o.max_logits_bytes)
        return fu_errorf(FU_ERR_EXHAUSTED, "logits of %d positions x %d tokens (%.1f MiB) exceed this server's limit of "
                         "%.1f MiB per step: ask for fewer positions, or score them (score_inputs)",
                         st->n_out, m->cfg.vocab_size, logits / 1048576.0, c->o.max_logits_bytes / 1048576.0);
    size_t nf = m->has_head
                    ? (size_t)(st->want_logits ? st->n_out : 0) * (size_t)m->cfg.vocab_size +
                          (st->sample ? (size_t)m->cfg.vocab_size : 0)
                    : (size_t)st->n * (size_t)m->cfg.dim;
    size_t n_top = (size_t)st->n_out * (size_t)st->top_logprobs + 1;
    if (fu_grow((void **)&s->out_f, &s->cap_f, nf ? nf : 1, sizeof(float)) ||
        fu_grow((void **)&s->out_tok, &s->cap_tok, (size_t)st->n_out + 1, sizeof(int32_t)) ||
        fu_grow((void **)&s->out_lp, &s->cap_lp, (size_t)st->n_out + 1, sizeof(float)) ||
        fu_grow((void **)&s->out_top_ids, &s->cap_top_ids, n_top, sizeof(int32_t)) ||
        fu_grow((void **)&s->out_top_lp, &s->cap_top_lp, n_top, sizeof(float)))
        return fu_errorf(FU_ERR_NOMEM, "step outputs");
    st->out_hidden = st->out_logits = st->out_logprobs = st->out_top_lp = NULL;
    st->out_tokens = st->out_top_ids = NULL;
    return FU_OK;
}

/* Waits for the session's step to complete (mu held), polling the step's cancel callback
 * (outside the lock) when it has one. */
static void shard_wait_step(shard_core *c, shard_session *s, shard_step *st) {
    while (!s->done) {
        if (!st->cancelled || s->cancel) {
            pthread_cond_wait(&c->cv_done, &c->mu);
            continue;
        }
        pthread_mutex_unlock(&c->mu);
        bool gone = st->cancelled(st->cancel_arg);
        pthread_mutex_lock(&c->mu);
        if (gone) s->cancel = true;
        struct timespec dl = fu_deadline_us(CLOCK_REALTIME, 50000);
        if (!s->done && !gone) pthread_cond_timedwait(&c->cv_done, &c->mu, &dl);
    }
}

int shard_session_step(shard_core *c, shard_session *s, shard_step *st) {
    int rc = shard_step_prepare(c, s, st);
    if (rc) return rc;
    pthread_mutex_lock(&c->mu);
    shard_prefix_first_step(c, s, st);
    if (c->stop) {
        pthread_mutex_unlock(&c->mu);
        return fu_errorf(FU_ERR_CANCELLED, "the server is shutting down");
    }
    s->step = st;
    s->done = s->cancel = false;
    s->step_done = 0;
    s->compute_acc_us = 0;
    s->t_enqueue_us = s->last_step_us = fu_now_us();
    shard_enqueue(c, s);
    pthread_cond_signal(&c->cv_work);
    shard_wait_step(c, s, st);
    rc = s->rc;
    s->step = NULL;
    pthread_mutex_unlock(&c->mu);
    if (rc) return fu_errorf(rc, "%s", s->err);
    shard_prefix_capture(c, s);
    return FU_OK;
}

/* ---- throughput ------------------------------------------------------------------------- */

double shard_core_measure(shard_core *c, int batch, double seconds) {
    const mdl_model *m = c->m;
    if (batch < 1) batch = 1;
    eng_seq **seqs = calloc((size_t)batch, sizeof *seqs);
    int32_t *tokens = calloc((size_t)batch, sizeof *tokens);
    float *hidden = calloc((size_t)batch * (size_t)m->cfg.dim, sizeof *hidden);
    float *out = malloc((size_t)batch * (size_t)(m->has_head ? m->cfg.vocab_size : m->cfg.dim) *
                        sizeof *out);
    int len = m->cfg.max_seq_len < 64 ? m->cfg.max_seq_len : 64;
    double tps = FU_ERR_NOMEM;
    if (!seqs || !tokens || !hidden || !out) goto done;
    for (int i = 0; i < batch; i++) {
        tokens[i] = i % m->cfg.vocab_size;
        for (int j = 0; j < m->cfg.dim; j++) hidden[(size_t)i * m->cfg.dim + j] = (float)((i + j) % 7) * 0.1f;
        if (eng_seq_new(c->e, len, &seqs[i])) goto done;
    }
    eng_batch b = {batch, m->has_embed ? tokens : NULL, m->has_embed ? NULL : hidden, seqs, NULL};
    /* one untimed step first (when the sequences have room): it faults the
     * mmapped weights in, which would otherwise dominate a short measurement */
    const int warm = len > 1;
    if (warm && eng_forward(c->e, &b, out)) {
        tps = FU_ERR_INTERNAL;
        goto done;
    }
    int64_t t0 = fu_now_us(), steps = warm;
    while (steps < len && (steps < warm + 2 || (double)(fu_now_us() - t0) < seconds * 1e6)) {
        if (eng_forward(c->e, &b, out)) {
            tps = FU_ERR_INTERNAL;
            goto done;
        }
        steps++;
    }
    tps = (double)((steps - warm) * batch) / ((double)(fu_now_us() - t0) * 1e-6);
done:
    for (int i = 0; seqs && i < batch; i++) eng_seq_free(c->e, seqs[i]);
    free(seqs);
    free(tokens);
    free(hidden);
    free(out);
    return tps;
}

/* Inputs for `n` batch entries of the model's first layer (ids or hidden states), and the output. */
typedef struct step_bufs {
    int32_t *tokens;
    float *hidden, *out;
    eng_seq **seqs;
} step_bufs;

static void step_bufs_free(step_bufs *b) {
    free(b->tokens), free(b->hidden), free(b->out), free(b->seqs);
}

static int step_bufs_new(const mdl_model *m, int n, step_bufs *b) {
    b->tokens = calloc((size_t)n, sizeof *b->tokens);
    b->hidden = calloc((size_t)n * (size_t)m->cfg.dim, sizeof *b->hidden);
    b->out = malloc((size_t)n * (size_t)(m->has_head ? m->cfg.vocab_size : m->cfg.dim) * sizeof *b->out);
    b->seqs = calloc((size_t)n, sizeof *b->seqs);
    if (!b->tokens || !b->hidden || !b->out || !b->seqs) return fu_errorf(FU_ERR_NOMEM, "timing a step");
    for (int i = 0; i < n; i++) {
        b->tokens[i] = i % m->cfg.vocab_size;
        for (int j = 0; j < m->cfg.dim; j++) b->hidden[(size_t)i * m->cfg.dim + j] = (float)((i + j) % 7) * 0.1f;
    }
    return FU_OK;
}

/* One timed forward over fresh sequences: n entries of one sequence (prompt) or of n sequences. */
static int step_once(shard_core *c, step_bufs *b, int n, bool prompt, double *secs) {
    const mdl_model *m = c->m;
    int n_seqs = prompt ? 1 : n, rc = FU_OK, made = 0;
    for (; made < n_seqs && !rc; made++) rc = eng_seq_new(c->e, prompt ? n : 1, &b->seqs[made]);
    if (rc) made--;
    for (int i = 0; i < n && !rc; i++) b->seqs[i] = b->seqs[prompt ? 0 : i];
    eng_batch batch = {n, m->has_embed ? b->tokens : NULL, m->has_embed ? NULL : b->hidden, b->seqs, NULL};
    int64_t t0 = fu_now_us();
    if (!rc) rc = eng_forward(c->e, &batch, b->out);
    *secs = (double)(fu_now_us() - t0) * 1e-6;
    for (int i = 0; i < made; i++) eng_seq_free(c->e, b->seqs[i]);
    return rc;
}

double shard_core_time_step(shard_core *c, int tokens, bool prompt, double seconds) {
    if (tokens < 1 || tokens > c->m->cfg.max_seq_len || (c->o.max_batch_tokens > 0 && tokens > c->o.max_batch_tokens))
        return FU_ERR_RANGE;
    step_bufs b = {0};
    int rc = step_bufs_new(c->m, tokens, &b);
    double best = INFINITY, spent = 0, t;
    for (int run = 0; !rc && run < 6 && (run < 2 || spent < seconds); run++) {
        rc = step_once(c, &b, tokens, prompt, &t);
        spent += t;
        if (run > 0 && t < best) best = t; /* the first run faults the weights in */
    }
    step_bufs_free(&b);
    return rc ? (rc < 0 ? rc : -rc) : best;
}

int shard_session_final_hidden(shard_core *c, shard_session *s, const int32_t *tokens, const float *hidden, int n,
                               float *out) {
    const mdl_model *m = c->m;
    if (!m->has_head) return fu_errorf(FU_ERR_UNSUPPORTED, "embeddings: this server does not hold the head");
    if (n < 1 || eng_seq_len(s->seq) != 0 || (m->has_embed ? !tokens : !hidden))
        return fu_errorf(FU_ERR_INVALID, "embeddings: %d positions on a session of %d, %s", n, eng_seq_len(s->seq),
                         m->has_embed ? "token ids needed" : "hidden states needed");
    eng_seq **seqs = malloc((size_t)n * sizeof *seqs);
    if (!seqs) return fu_errorf(FU_ERR_NOMEM, "embeddings");
    for (int t = 0; t < n; t++) seqs[t] = s->seq;
    eng_batch b = {n, m->has_embed ? tokens : NULL, m->has_embed ? NULL : hidden, seqs, NULL};
    pthread_mutex_lock(&c->fwd_mu);
    int rc = eng_forward_final_hidden(c->e, &b, out);
    pthread_mutex_unlock(&c->fwd_mu);
    free(seqs);
    return rc;
}
