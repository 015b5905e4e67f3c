/* train.c -- LoRA training over a span: forward with saved block inputs, backward, the head's loss, AdamW. */
#include "train.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "engine-impl.h"
#include "log.h"
#include "status.h"

#define TRN_HEAD_ROWS 64 /* rows of logits the head computes at a time */

/* A block's internals for T rows (backend memory). qp/kp (before the q/k
 * norms) only with qk_norm; u[t] = A dropout(x) of each adapted target. */
typedef struct trn_stash {
    float *xn_a, *qp, *kp, *q, *k, *v, *att, *xmid, *xn_m, *gate, *up;
    float *u[LORA_N_TARGETS];
} trn_stash;

typedef struct trn_slot {
    bool used;
    int T, n_ex;
    int32_t *first, *pos, *seq, *targets; /* (max_tokens) host */
    int32_t *ex_first, *ex_len;           /* (max_tokens) host: each example's first row and length */
    uint64_t seed;
    float *xin;       /* (n_span + 1, max_tokens, D): block inputs, then the span's output */
    float *dh;        /* at the head: (max_tokens, D) gradient of the span's output */
    trn_stash *keep;  /* TRN_KEEP: (n_span) */
} trn_slot;

struct trn_span {
    eng_engine *e;
    const mdl_model *m;
    op_backend *be;
    lora_adapter *ad;
    trn_options opts;
    int n_span, r;
    int64_t D, F, qd, kd, max_k;
    float scale;            /* lora_scale */
    float *grad, *m1, *m2;  /* (n_floats) host, as ad->data */
    float *dgrad;           /* the gradients as the backend's ops accumulate them: grad itself on a
                               backend that reads host memory, else a backend buffer (synced to grad
                               after each backward) */
    trn_slot *slots;
    trn_stash rs;           /* TRN_RECOMPUTE: the block being rebuilt */
    /* scratch (backend memory), max_tokens rows */
    float *act, *dact, *dup, *dxn, *datt, *dq, *dk, *dv, *dqp, *dkp, *lx, *ld, *du, *g;
    float *hr, *hn, *logits, *dhn, *dhr; /* head: TRN_HEAD_ROWS rows */
    int32_t *ident, *rows;              /* (max_tokens) host */
    op_tensor *kview, *vview;           /* (max_tokens) */
    float *zeros;                       /* (max_tokens, D) host zeros, to clear backend rows */
    float *hloss;                       /* (TRN_HEAD_ROWS) host */
    uint8_t *hcorrect;                  /* (TRN_HEAD_ROWS) host */
    void **bufs;                        /* every backend buffer, for trn_free */
    int n_bufs, cap_bufs;
    uint64_t bytes;
    trn_yield_fn yield;                 /* NULL: none */
    void *yield_arg;
};

/* ---- memory --------------------------------------------------------------------- */

/* A zeroed backend buffer of n floats that the trainer frees, counted in its bytes. */
static float *trn_alloc(trn_span *s, int64_t n) {
    if (s->n_bufs == s->cap_bufs) {
        int cap = s->cap_bufs ? 2 * s->cap_bufs : 64;
        void **p = realloc(s->bufs, (size_t)cap * sizeof *p);
        if (!p) return NULL;
        s->bufs = p;
        s->cap_bufs = cap;
    }
    float *b = op_buffer_alloc(s->be, (size_t)(n > 0 ? n : 1) * sizeof(float));
    if (b) {
        s->bufs[s->n_bufs++] = b;
        s->bytes += (uint64_t)n * sizeof(float);
    }
    return b;
}

/* Floats of one stash for T rows. */
static int64_t trn_stash_floats(const trn_span *s, int64_t T) {
    const mdl_config *c = &s->m->cfg;
    int64_t n = T * (3 * s->D + 2 * s->qd + 2 * s->kd + 2 * s->F);
    if (c->qk_norm) n += T * (s->qd + s->kd);
    for (int t = 0; t < LORA_N_TARGETS; t++)
        if (s->ad->cfg.targets & LORA_TARGET_BIT(t)) n += T * s->r;
    return n;
}

static int trn_stash_alloc(trn_span *s, trn_stash *st) {
    const int64_t T = s->opts.max_tokens;
    float **f[] = {&st->xn_a, &st->xmid, &st->xn_m, &st->q, &st->att, &st->k, &st->v, &st->gate, &st->up};
    const int64_t w[] = {s->D, s->D, s->D, s->qd, s->qd, s->kd, s->kd, s->F, s->F};
    for (size_t i = 0; i < sizeof w / sizeof w[0]; i++)
        if (!(*f[i] = trn_alloc(s, T * w[i]))) return FU_ERR_NOMEM;
    if (s->m->cfg.qk_norm && (!(st->qp = trn_alloc(s, T * s->qd)) || !(st->kp = trn_alloc(s, T * s->kd))))
        return FU_ERR_NOMEM;
    for (int t = 0; t < LORA_N_TARGETS; t++)
        if ((s->ad->cfg.targets & LORA_TARGET_BIT(t)) && !(st->u[t] = trn_alloc(s, T * s->r))) return FU_ERR_NOMEM;
    return FU_OK;
}

/* The bytes trn_new will allocate, for the budget check. */
static uint64_t trn_plan_bytes(const trn_span *s) {
    const int64_t T = s->opts.max_tokens, V = s->m->cfg.vocab_size, H = TRN_HEAD_ROWS;
    int64_t per_slot = (s->n_span + 1) * T * s->D + (s->m->has_head ? T * s->D : 0);
    if (s->opts.memory == TRN_KEEP) per_slot += s->n_span * trn_stash_floats(s, T);
    int64_t scratch = trn_stash_floats(s, T) + T * (3 * s->F + 2 * s->D + 3 * s->qd + 3 * s->kd + 2 * s->max_k + s->r);
    if (s->m->has_head) scratch += H * (4 * s->D + V);
    return (uint64_t)(s->opts.slots * per_slot + scratch) * sizeof(float) + 3 * (uint64_t)s->ad->n_floats * sizeof(float);
}

static int trn_alloc_scratch(trn_span *s) {
    const int64_t T = s->opts.max_tokens, H = TRN_HEAD_ROWS;
    float **f[] = {&s->act, &s->dact, &s->dup, &s->dxn, &s->g, &s->datt, &s->dq, &s->dqp,
                   &s->dk, &s->dv, &s->dkp, &s->lx, &s->ld, &s->du};
    const int64_t w[] = {s->F, s->F, s->F, s->D, s->D, s->qd, s->qd, s->qd, s->kd, s->kd, s->kd,
                         s->max_k, s->max_k, s->r};
    for (size_t i = 0; i < sizeof w / sizeof w[0]; i++)
        if (!(*f[i] = trn_alloc(s, T * w[i]))) return FU_ERR_NOMEM;
    if (s->m->has_head) {
        float **h[] = {&s->hr, &s->hn, &s->dhn, &s->dhr, &s->logits};
        const int64_t hw[] = {s->D, s->D, s->D, s->D, s->m->cfg.vocab_size};
        for (size_t i = 0; i < 5; i++)
            if (!(*h[i] = trn_alloc(s, H * hw[i]))) return FU_ERR_NOMEM;
    }
    return trn_stash_alloc(s, &s->rs);
}

static int trn_alloc_slot(trn_span *s, trn_slot *sl) {
    const size_t T = (size_t)s->opts.max_tokens;
    int32_t **h[] = {&sl->first, &sl->pos, &sl->seq, &sl->targets, &sl->ex_first, &sl->ex_len};
    for (size_t i = 0; i < 6; i++)
        if (!(*h[i] = calloc(T, sizeof(int32_t)))) return FU_ERR_NOMEM;
    if (!(sl->xin = trn_alloc(s, (int64_t)(s->n_span + 1) * (int64_t)T * s->D))) return FU_ERR_NOMEM;
    if (s->m->has_head && !(sl->dh = trn_alloc(s, (int64_t)T * s->D))) return FU_ERR_NOMEM;
    if (s->opts.memory != TRN_KEEP) return FU_OK;
    if (!(sl->keep = calloc((size_t)s->n_span, sizeof *sl->keep))) return FU_ERR_NOMEM;
    for (int l = 0; l < s->n_span; l++)
        if (trn_stash_alloc(s, &sl->keep[l])) return FU_ERR_NOMEM;
    return FU_OK;
}

void trn_free(trn_span *s) {
    if (!s) return;
    for (int i = 0; i < s->n_bufs; i++) op_buffer_free(s->be, s->bufs[i]);
    free(s->bufs);
    for (int i = 0; s->slots && i < s->opts.slots; i++) {
        trn_slot *sl = &s->slots[i];
        free(sl->first), free(sl->pos), free(sl->seq), free(sl->targets), free(sl->ex_first), free(sl->ex_len);
        free(sl->keep);
    }
    free(s->slots);
    free(s->grad), free(s->m1), free(s->m2);
    free(s->ident), free(s->rows), free(s->kview), free(s->vview), free(s->zeros), free(s->hloss), free(s->hcorrect);
    free(s);
}

uint64_t trn_bytes(const trn_span *s) { return s->bytes; }

const lora_adapter *trn_adapter(const trn_span *s) { return s->ad; }

/* Puts the adapter where the backend reads it and gives the gradients a
 * place there: the host arrays themselves on the CPU. */
static int trn_device_grads(trn_span *s) {
    int rc = lora_upload(s->ad, s->be);
    if (rc) return rc;
    if (s->ad->dev == s->ad->data) {
        s->dgrad = s->grad;
        return FU_OK;
    }
    return (s->dgrad = trn_alloc(s, (int64_t)s->ad->n_floats)) ? FU_OK : fu_errorf(FU_ERR_NOMEM, "training gradients");
}

/* After the backend's ops changed the gradients: the host copy follows. */
static int trn_sync_grads(trn_span *s) {
    if (s->dgrad == s->grad) return FU_OK;
    return op_buffer_get(s->be, s->grad, s->dgrad, s->ad->n_floats * sizeof(float));
}

/* ---- construction ------------------------------------------------------------------ */

static int trn_check_adapter(const trn_span *s) {
    const lora_adapter *a = s->ad;
    if (a->first != s->m->first || a->last != s->m->last)
        return fu_errorf(FU_ERR_INVALID, "training: the adapter holds blocks [%d, %d), the span is [%d, %d)",
                         a->first, a->last, s->m->first, s->m->last);
    lora_shape want = lora_shape_of(&s->m->cfg);
    if (memcmp(&want, &a->shape, sizeof want))
        return fu_errorf(FU_ERR_INVALID, "training: the adapter is for another model shape");
    if (a->qk_interleaved != (s->m->cfg.rope_mode == OP_ROPE_NORM))
        return fu_errorf(FU_ERR_INVALID, "training: the adapter holds q/k rows in another order than the model");
    return lora_config_check(&a->cfg);
}

static int trn_host_alloc(trn_span *s) {
    const size_t T = (size_t)s->opts.max_tokens, n = s->ad->n_floats;
    s->grad = calloc(n ? n : 1, sizeof(float));
    s->m1 = calloc(n ? n : 1, sizeof(float));
    s->m2 = calloc(n ? n : 1, sizeof(float));
    s->ident = calloc(T, sizeof(int32_t));
    s->rows = calloc(T, sizeof(int32_t));
    s->kview = calloc(T, sizeof(op_tensor));
    s->vview = calloc(T, sizeof(op_tensor));
    s->zeros = calloc(T * (size_t)s->D, sizeof(float));
    s->hloss = calloc(TRN_HEAD_ROWS, sizeof(float));
    s->hcorrect = calloc(TRN_HEAD_ROWS, 1);
    s->slots = calloc((size_t)s->opts.slots, sizeof *s->slots);
    if (!s->grad || !s->m1 || !s->m2 || !s->ident || !s->rows || !s->kview || !s->vview || !s->zeros || !s->hloss ||
        !s->hcorrect || !s->slots)
        return FU_ERR_NOMEM;
    for (size_t t = 0; t < T; t++) s->ident[t] = (int32_t)t;
    s->bytes += (3 * (uint64_t)n + T * (uint64_t)s->D) * sizeof(float);
    return FU_OK;
}

static void trn_set_sizes(trn_span *s, eng_engine *e, lora_adapter *ad, const trn_options *opts) {
    s->e = e;
    s->m = e->m;
    s->be = e->be;
    s->ad = ad;
    s->opts = (trn_options){.max_tokens = 1024, .slots = 1};
    if (opts) {
        if (opts->max_tokens > 0) s->opts.max_tokens = opts->max_tokens;
        if (opts->slots > 0) s->opts.slots = opts->slots;
        s->opts.memory = opts->memory;
        s->opts.budget_bytes = opts->budget_bytes;
    }
    const mdl_config *c = &s->m->cfg;
    s->n_span = s->m->last - s->m->first;
    s->r = ad->cfg.r;
    s->D = c->dim;
    s->F = c->ffn_dim;
    s->qd = (int64_t)c->n_heads * c->head_dim;
    s->kd = (int64_t)c->n_kv_heads * c->head_dim;
    s->max_k = s->D > s->F ? s->D : s->F;
    if (s->qd > s->max_k) s->max_k = s->qd;
    s->scale = lora_scale(&ad->cfg);
}

int trn_new(eng_engine *e, lora_adapter *ad, const trn_options *opts, trn_span **out) {
    *out = NULL;
    if (!op_backend_can_train(e->be))
        return fu_errorf(FU_ERR_UNSUPPORTED, "training is not supported on the %s backend yet", op_backend_name(e->be));
    trn_span *s = calloc(1, sizeof *s);
    if (!s) return fu_errorf(FU_ERR_NOMEM, "trainer");
    trn_set_sizes(s, e, ad, opts);
    int rc = trn_check_adapter(s);
    uint64_t need = rc ? 0 : trn_plan_bytes(s);
    if (!rc && s->opts.budget_bytes && need > s->opts.budget_bytes)
        rc = fu_errorf(FU_ERR_EXHAUSTED,
                       "training %d blocks with %d micro-batches of %d tokens in flight needs %.1f MiB, "
                       "over the budget of %.1f MiB",
                       s->n_span, s->opts.slots, s->opts.max_tokens, need / 1048576.0,
                       s->opts.budget_bytes / 1048576.0);
    if (!rc && (trn_host_alloc(s) || trn_alloc_scratch(s)))
        rc = fu_errorf(FU_ERR_NOMEM, "training scratch (%.1f MiB)", need / 1048576.0);
    if (!rc) rc = trn_device_grads(s);
    for (int i = 0; !rc && i < s->opts.slots; i++)
        if (trn_alloc_slot(s, &s->slots[i])) rc = fu_errorf(FU_ERR_NOMEM, "training slot %d", i);
    if (!rc) rc = op_reserve(s->be, s->opts.max_tokens, s->max_k);
    if (rc) {
        trn_free(s);
        return rc;
    }
    *out = s;
    return FU_OK;
}

/* ---- tensors ----------------------------------------------------------------------- */

static op_tensor trn_t2(float *p, int64_t cols, int64_t rows) { return op_tensor_2d(OP_TYPE_F32, p, cols, rows); }

/* The gradient accumulator of matrix A (is_b 0) or B of pair p, where the backend's ops add to it. */
static float *trn_grad_of(const trn_span *s, const lora_pair *p, int is_b) {
    const float *w = is_b ? p->b : p->a;
    return s->dgrad + (w - s->ad->data);
}

/* The dropout seed of (micro-batch, block, target). */
static uint64_t trn_drop_seed(uint64_t seed, int block, lora_target t) {
    uint64_t z = seed ^ (0x9e3779b97f4a7c15ull * (uint64_t)(block * LORA_N_TARGETS + (int)t + 1));
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    return z ^ (z >> 27);
}

/* ---- the ops through the base weights, each after the yield hook ---------------------- */

void trn_set_yield(trn_span *s, trn_yield_fn fn, void *arg) {
    s->yield = fn;
    s->yield_arg = arg;
}

/* Lets the yield hook hold the trainer back before its next long op (a no-op without one). */
static void trn_yield(const trn_span *s) {
    if (s->yield) s->yield(s->yield_arg);
}

/* y = W x through a base weight (op_matmul), after the yield hook. */
static int trn_mm(trn_span *s, const op_tensor *w, const op_tensor *x, op_tensor *y) {
    trn_yield(s);
    return op_matmul(s->be, w, x, y);
}

/* y[i] = W[i] x for n base weights (op_matmul_n), after the yield hook. */
static int trn_mm_n(trn_span *s, int n, const op_tensor *const *w, const op_tensor *x, op_tensor *const *y) {
    trn_yield(s);
    return op_matmul_n(s->be, n, w, x, y);
}

/* dx = W^T dy + beta dx through a base weight (op_matmul_back), after the yield hook. */
static int trn_mm_back(trn_span *s, const op_tensor *w, const op_tensor *dy, op_tensor *dx, float beta) {
    trn_yield(s);
    return op_matmul_back(s->be, w, dy, dx, beta);
}

/* ---- LoRA ---------------------------------------------------------------------------- */

/* x as the adapter's A reads it: dropout(x) in lx when the adapter has
 * dropout, else x itself. */
static int trn_lora_input(trn_span *s, const trn_slot *sl, int l, lora_target t, const op_tensor *x, op_tensor *xd) {
    *xd = *x;
    if (s->ad->cfg.dropout <= 0) return FU_OK;
    *xd = trn_t2(s->lx, x->ne[0], x->ne[1]);
    int rc = op_get_rows(s->be, x, s->ident, xd);
    return rc ? rc : op_dropout(s->be, xd, s->ad->cfg.dropout, trn_drop_seed(sl->seed, s->m->first + l, t), 0);
}

/* u = A dropout(x) for target t of block l; then, when y is given,
 * y += scale * B u. */
static int trn_lora_fwd(trn_span *s, const trn_slot *sl, int l, lora_target t, const op_tensor *x, float *u,
                        op_tensor *y) {
    const lora_pair *p = lora_at(s->ad, s->m->first + l, t);
    if (!p->a) return FU_OK;
    const int64_t T = x->ne[1], in = x->ne[0];
    op_tensor a = trn_t2(lora_dev(s->ad, p->a), in, s->r), ut = trn_t2(u, s->r, T), xd;
    int rc = trn_lora_input(s, sl, l, t, x, &xd);
    if (rc || (rc = op_matmul(s->be, &a, &xd, &ut)) || !y) return rc;
    op_tensor b = trn_t2(lora_dev(s->ad, p->b), s->r, y->ne[0]), d = trn_t2(s->ld, y->ne[0], T);
    if ((rc = op_matmul(s->be, &b, &ut, &d))) return rc;
    return op_add_rows(s->be, y, s->ident, &d, s->scale);
}

/* The backward of y += scale * B A dropout(x): dB += scale dy^T u,
 * dA += scale (dy B)^T dropout(x), dx += scale dropout'(dy B A). */
static int trn_lora_back(trn_span *s, const trn_slot *sl, int l, lora_target t, const op_tensor *x, const float *u,
                         const op_tensor *dy, op_tensor *dx) {
    const lora_pair *p = lora_at(s->ad, s->m->first + l, t);
    if (!p->a) return FU_OK;
    const int64_t T = x->ne[1], in = x->ne[0], out = dy->ne[0];
    op_tensor gb = trn_t2(trn_grad_of(s, p, 1), s->r, out), ga = trn_t2(trn_grad_of(s, p, 0), in, s->r);
    op_tensor ut = trn_t2((float *)u, s->r, T), b = trn_t2(lora_dev(s->ad, p->b), s->r, out);
    op_tensor a = trn_t2(lora_dev(s->ad, p->a), in, s->r);
    op_tensor du = trn_t2(s->du, s->r, T), d = trn_t2(s->ld, in, T), xd;
    int rc;
    if ((rc = op_outer_acc(s->be, &gb, dy, &ut, s->scale)) || (rc = op_matmul_back(s->be, &b, dy, &du, 0.0f)) ||
        (rc = trn_lora_input(s, sl, l, t, x, &xd)) || (rc = op_outer_acc(s->be, &ga, &du, &xd, s->scale)) ||
        (rc = op_matmul_back(s->be, &a, &du, &d, 0.0f)))
        return rc;
    if (s->ad->cfg.dropout > 0 &&
        (rc = op_dropout(s->be, &d, s->ad->cfg.dropout, trn_drop_seed(sl->seed, s->m->first + l, t), 0)))
        return rc;
    return op_add_rows(s->be, dx, s->ident, &d, s->scale);
}

/* ---- forward ----------------------------------------------------------------------- */

/* Causal attention within each example of the slot: per-example views of k
 * and v (the rows [ex_first, ex_first + ex_len) of the batch) for op_attention. */
static int trn_attention(trn_span *s, const trn_slot *sl, const trn_stash *st) {
    const mdl_config *c = &s->m->cfg;
    const int64_t hd = c->head_dim, KVH = c->n_kv_heads, T = sl->T;
    for (int j = 0; j < sl->n_ex; j++) {
        op_tensor *kv[2] = {&s->kview[j], &s->vview[j]};
        float *base[2] = {st->k, st->v};
        for (int i = 0; i < 2; i++) {
            *kv[i] = op_tensor_3d(OP_TYPE_F32, base[i] + (size_t)sl->ex_first[j] * (size_t)s->kd, hd, KVH,
                                  sl->ex_len[j]);
        }
    }
    op_attn a = {c->n_heads, c->n_kv_heads, c->head_dim, 1.0f / sqrtf((float)c->head_dim), sl->n_ex,
                 sl->seq, sl->pos, s->kview, s->vview};
    op_tensor q3 = op_tensor_3d(OP_TYPE_F32, st->q, hd, c->n_heads, T);
    op_tensor o3 = op_tensor_3d(OP_TYPE_F32, st->att, hd, c->n_heads, T);
    return op_attention(s->be, &q3, &a, &o3);
}

/* q, k, v of block l from x: projections (with LoRA), biases, q/k norms, RoPE. */
static int trn_qkv(trn_span *s, const trn_slot *sl, int l, trn_stash *st) {
    const mdl_config *c = &s->m->cfg;
    const mdl_layer *L = &s->e->lw[l];
    const int64_t T = sl->T, hd = c->head_dim;
    op_tensor xn = trn_t2(st->xn_a, s->D, T), v = trn_t2(st->v, s->kd, T);
    op_tensor q = trn_t2(c->qk_norm ? st->qp : st->q, s->qd, T), k = trn_t2(c->qk_norm ? st->kp : st->k, s->kd, T);
    int rc;
    if ((rc = trn_mm_n(s, 3, (const op_tensor *[]){&L->wq, &L->wk, &L->wv}, &xn,
                          (op_tensor *[]){&q, &k, &v})) ||
        (rc = trn_lora_fwd(s, sl, l, LORA_TARGET_Q, &xn, st->u[LORA_TARGET_Q], &q)) ||
        (rc = trn_lora_fwd(s, sl, l, LORA_TARGET_K, &xn, st->u[LORA_TARGET_K], &k)) ||
        (rc = trn_lora_fwd(s, sl, l, LORA_TARGET_V, &xn, st->u[LORA_TARGET_V], &v)))
        return rc;
    if (c->qkv_bias && ((rc = op_add_row(s->be, &q, &L->bq)) || (rc = op_add_row(s->be, &k, &L->bk)) ||
                        (rc = op_add_row(s->be, &v, &L->bv))))
        return rc;
    op_tensor qh = trn_t2(st->q, hd, T * c->n_heads), kh = trn_t2(st->k, hd, T * c->n_kv_heads);
    if (c->qk_norm) {
        op_tensor qph = trn_t2(st->qp, hd, T * c->n_heads), kph = trn_t2(st->kp, hd, T * c->n_kv_heads);
        if ((rc = op_rmsnorm(s->be, &qph, &L->q_norm, c->norm_eps, &qh)) ||
            (rc = op_rmsnorm(s->be, &kph, &L->k_norm, c->norm_eps, &kh)))
            return rc;
    }
    op_rope_params rp = {c->rope_mode, s->m->rot_dim, s->m->inv_freq, 1.0f};
    op_tensor q3 = op_tensor_3d(OP_TYPE_F32, st->q, hd, c->n_heads, T);
    op_tensor k3 = op_tensor_3d(OP_TYPE_F32, st->k, hd, c->n_kv_heads, T);
    if ((rc = op_rope(s->be, &q3, sl->pos, &rp))) return rc;
    return op_rope(s->be, &k3, sl->pos, &rp);
}

/* The attention half of block l: xmid = x + o(attention(q, k, v)). */
static int trn_attn_fwd(trn_span *s, const trn_slot *sl, int l, trn_stash *st, const float *x) {
    const mdl_layer *L = &s->e->lw[l];
    const int64_t T = sl->T;
    op_tensor xt = trn_t2((float *)x, s->D, T), xn = trn_t2(st->xn_a, s->D, T);
    op_tensor att = trn_t2(st->att, s->qd, T), xmid = trn_t2(st->xmid, s->D, T);
    int rc;
    if ((rc = op_rmsnorm(s->be, &xt, &L->attn_norm, s->m->cfg.norm_eps, &xn)) || (rc = trn_qkv(s, sl, l, st)) ||
        (rc = trn_attention(s, sl, st)) || (rc = trn_mm(s, &L->wo, &att, &xmid)) ||
        (rc = trn_lora_fwd(s, sl, l, LORA_TARGET_O, &att, st->u[LORA_TARGET_O], &xmid)))
        return rc;
    return op_add(s->be, &xmid, &xt);
}

/* The MLP half of block l: out = xmid + down(swiglu(gate, up)); with out
 * NULL (a rebuild for backward) only what backward reads: gate, up and
 * down's LoRA input u, with the activations left in s->act. */
static int trn_mlp_fwd(trn_span *s, const trn_slot *sl, int l, trn_stash *st, float *out) {
    const mdl_layer *L = &s->e->lw[l];
    const int64_t T = sl->T;
    op_tensor xmid = trn_t2(st->xmid, s->D, T), xn = trn_t2(st->xn_m, s->D, T);
    op_tensor gate = trn_t2(st->gate, s->F, T), up = trn_t2(st->up, s->F, T), act = trn_t2(s->act, s->F, T);
    op_tensor y = trn_t2(out, s->D, T);
    int rc;
    if ((rc = op_rmsnorm(s->be, &xmid, &L->ffn_norm, s->m->cfg.norm_eps, &xn)) ||
        (rc = trn_mm_n(s, 2, (const op_tensor *[]){&L->w_gate, &L->w_up}, &xn,
                          (op_tensor *[]){&gate, &up})) ||
        (rc = trn_lora_fwd(s, sl, l, LORA_TARGET_GATE, &xn, st->u[LORA_TARGET_GATE], &gate)) ||
        (rc = trn_lora_fwd(s, sl, l, LORA_TARGET_UP, &xn, st->u[LORA_TARGET_UP], &up)) ||
        (rc = op_swiglu(s->be, &gate, &up, &act)))
        return rc;
    if (!out) return trn_lora_fwd(s, sl, l, LORA_TARGET_DOWN, &act, st->u[LORA_TARGET_DOWN], NULL);
    if ((rc = trn_mm(s, &L->w_down, &act, &y)) ||
        (rc = trn_lora_fwd(s, sl, l, LORA_TARGET_DOWN, &act, st->u[LORA_TARGET_DOWN], &y)))
        return rc;
    return op_add(s->be, &y, &xmid);
}

static float *trn_xin(const trn_span *s, const trn_slot *sl, int l) {
    return sl->xin + (size_t)l * (size_t)s->opts.max_tokens * (size_t)s->D;
}

static trn_stash *trn_stash_of(trn_span *s, trn_slot *sl, int l) {
    return s->opts.memory == TRN_KEEP ? &sl->keep[l] : &s->rs;
}

/* Checks b against the span and copies its layout into slot sl. */
static int trn_take_batch(trn_span *s, trn_slot *sl, const trn_batch *b) {
    const mdl_model *m = s->m;
    const int T = b->n_tokens;
    if (T < 1 || T > s->opts.max_tokens)
        return fu_errorf(FU_ERR_RANGE, "training: %d tokens outside [1, %d]", T, s->opts.max_tokens);
    if (m->has_embed ? !b->tokens : !b->embd)
        return fu_errorf(FU_ERR_INVALID, "training: the span %s", m->has_embed ? "needs token ids" : "needs hidden states");
    if (!b->first) return fu_errorf(FU_ERR_INVALID, "training: no example boundaries");
    if (m->has_head && (!b->targets || !isfinite(b->loss_scale)))
        return fu_errorf(FU_ERR_INVALID, "training: the head needs targets and a finite loss scale");
    for (int t = 0; t < T; t++) {
        int32_t f = b->first[t];
        if (f < 0 || f > t || (f != t && (t == 0 || b->first[t - 1] != f)))
            return fu_errorf(FU_ERR_RANGE, "training: row %d starts its example at row %d", t, f);
        if (m->has_embed && (b->tokens[t] < 0 || b->tokens[t] >= m->cfg.vocab_size))
            return fu_errorf(FU_ERR_RANGE, "training: token id %d outside [0, %d)", b->tokens[t], m->cfg.vocab_size);
        if (m->has_head && (b->targets[t] < -1 || b->targets[t] >= m->cfg.vocab_size))
            return fu_errorf(FU_ERR_RANGE, "training: target %d outside [-1, %d)", b->targets[t], m->cfg.vocab_size);
        if (t - f >= m->cfg.max_seq_len)
            return fu_errorf(FU_ERR_RANGE, "training: an example is longer than the context (%d)", m->cfg.max_seq_len);
    }
    sl->T = T;
    sl->seed = b->seed;
    sl->n_ex = 0;
    for (int t = 0; t < T; t++) {
        if (b->first[t] == t) {
            sl->ex_first[sl->n_ex] = t;
            sl->ex_len[sl->n_ex++] = 0;
        }
        sl->first[t] = b->first[t];
        sl->pos[t] = t - b->first[t];
        sl->seq[t] = sl->n_ex - 1;
        sl->ex_len[sl->n_ex - 1]++;
        sl->targets[t] = m->has_head ? b->targets[t] : -1;
    }
    return FU_OK;
}

/* The span's input rows into block 0's input. */
static int trn_input(trn_span *s, trn_slot *sl, const trn_batch *b) {
    op_tensor x = trn_t2(trn_xin(s, sl, 0), s->D, sl->T);
    if (s->m->has_embed) return op_get_rows(s->be, &s->e->embd, b->tokens, &x);
    return op_buffer_set(s->be, x.data, b->embd, (size_t)sl->T * (size_t)s->D * sizeof(float));
}

/* Rows [r0, r0 + n) of the head's targeted rows (s->rows): loss and the
 * gradient of the span's output (into sl->dh). */
static int trn_head_chunk(trn_span *s, trn_slot *sl, int r0, int n, float loss_scale, trn_loss *loss) {
    const mdl_config *c = &s->m->cfg;
    op_tensor h = trn_t2(trn_xin(s, sl, s->n_span), s->D, sl->T), dh = trn_t2(sl->dh, s->D, sl->T);
    op_tensor hr = trn_t2(s->hr, s->D, n), hn = trn_t2(s->hn, s->D, n), dhn = trn_t2(s->dhn, s->D, n);
    op_tensor dhr = trn_t2(s->dhr, s->D, n), lg = trn_t2(s->logits, c->vocab_size, n);
    int32_t tg[TRN_HEAD_ROWS];
    for (int i = 0; i < n; i++) tg[i] = sl->targets[s->rows[r0 + i]];
    int rc;
    if ((rc = op_get_rows(s->be, &h, s->rows + r0, &hr)) ||
        (rc = op_rmsnorm(s->be, &hr, &s->e->out_norm, c->norm_eps, &hn)) ||
        (rc = trn_mm(s, &s->e->head, &hn, &lg)) ||
        (rc = op_cross_entropy(s->be, &lg, tg, loss_scale, s->hloss, s->hcorrect)) ||
        (rc = trn_mm_back(s, &s->e->head, &lg, &dhn, 0.0f)) ||
        (rc = op_rmsnorm_back(s->be, &hr, &s->e->out_norm, c->norm_eps, &dhn, &dhr, 0.0f)) ||
        (rc = op_add_rows(s->be, &dh, s->rows + r0, &dhr, 1.0f)))
        return rc;
    for (int i = 0; i < n; i++) {
        loss->sum += s->hloss[i];
        loss->n_tokens++;
        loss->n_correct += s->hcorrect[i];
    }
    return FU_OK;
}

/* At the head: the loss of the slot's targeted rows and the gradient of the
 * span's output, TRN_HEAD_ROWS rows at a time. */
static int trn_head(trn_span *s, trn_slot *sl, float loss_scale, trn_loss *loss) {
    int n = 0;
    for (int t = 0; t < sl->T; t++)
        if (sl->targets[t] >= 0) s->rows[n++] = t;
    memset(loss, 0, sizeof *loss);
    /* rows without targets get no gradient from the loss */
    int rc = op_buffer_set(s->be, sl->dh, s->zeros, (size_t)sl->T * (size_t)s->D * sizeof(float));
    if (rc) return rc;
    for (int r0 = 0; r0 < n; r0 += TRN_HEAD_ROWS) {
        int k = n - r0 < TRN_HEAD_ROWS ? n - r0 : TRN_HEAD_ROWS;
        if ((rc = trn_head_chunk(s, sl, r0, k, loss_scale, loss))) return rc;
    }
    return FU_OK;
}

int trn_forward(trn_span *s, int slot, const trn_batch *b, float *out, trn_loss *loss) {
    if (slot < 0 || slot >= s->opts.slots || s->slots[slot].used)
        return fu_errorf(FU_ERR_INVALID, "training: slot %d is not a free slot of %d", slot, s->opts.slots);
    trn_slot *sl = &s->slots[slot];
    int rc = trn_take_batch(s, sl, b);
    if (rc || (rc = trn_input(s, sl, b))) return rc;
    for (int l = 0; l < s->n_span && !rc; l++) {
        trn_stash *st = trn_stash_of(s, sl, l);
        if (!(rc = trn_attn_fwd(s, sl, l, st, trn_xin(s, sl, l)))) rc = trn_mlp_fwd(s, sl, l, st, trn_xin(s, sl, l + 1));
    }
    trn_loss lz;
    if (!rc && s->m->has_head) rc = trn_head(s, sl, b->loss_scale, loss ? loss : &lz);
    if (!rc && out)
        rc = op_buffer_get(s->be, out, trn_xin(s, sl, s->n_span), (size_t)sl->T * (size_t)s->D * sizeof(float));
    if (!rc) sl->used = true;
    return rc;
}

void trn_drop(trn_span *s, int slot) {
    if (slot >= 0 && slot < s->opts.slots) s->slots[slot].used = false;
}

/* ---- backward ---------------------------------------------------------------------- */

/* The MLP half of block l backwards: g (T, D), the gradient of the block's
 * output, becomes that of xmid. s->act holds swiglu(gate, up). */
static int trn_mlp_back(trn_span *s, const trn_slot *sl, int l, const trn_stash *st) {
    const mdl_layer *L = &s->e->lw[l];
    const int64_t T = sl->T;
    op_tensor g = trn_t2(s->g, s->D, T), act = trn_t2(s->act, s->F, T), dact = trn_t2(s->dact, s->F, T);
    op_tensor gate = trn_t2(st->gate, s->F, T), up = trn_t2(st->up, s->F, T), dup = trn_t2(s->dup, s->F, T);
    op_tensor xn = trn_t2(st->xn_m, s->D, T), dxn = trn_t2(s->dxn, s->D, T), xmid = trn_t2(st->xmid, s->D, T);
    int rc;
    if ((rc = trn_mm_back(s, &L->w_down, &g, &dact, 0.0f)) ||
        (rc = trn_lora_back(s, sl, l, LORA_TARGET_DOWN, &act, st->u[LORA_TARGET_DOWN], &g, &dact)) ||
        (rc = op_swiglu_back(s->be, &gate, &up, &dact, &dact, &dup)) ||
        (rc = trn_mm_back(s, &L->w_gate, &dact, &dxn, 0.0f)) ||
        (rc = trn_mm_back(s, &L->w_up, &dup, &dxn, 1.0f)) ||
        (rc = trn_lora_back(s, sl, l, LORA_TARGET_GATE, &xn, st->u[LORA_TARGET_GATE], &dact, &dxn)) ||
        (rc = trn_lora_back(s, sl, l, LORA_TARGET_UP, &xn, st->u[LORA_TARGET_UP], &dup, &dxn)))
        return rc;
    return op_rmsnorm_back(s->be, &xmid, &L->ffn_norm, s->m->cfg.norm_eps, &dxn, &g, 1.0f);
}

/* dq, dk (after RoPE) back through RoPE and the q/k norms, in place or into
 * dqp / dkp; *dq_out / *dk_out name the gradients of the projections' outputs. */
static int trn_qk_back(trn_span *s, const trn_slot *sl, int l, const trn_stash *st, float **dq_out, float **dk_out) {
    const mdl_config *c = &s->m->cfg;
    const mdl_layer *L = &s->e->lw[l];
    const int64_t T = sl->T, hd = c->head_dim;
    int32_t *neg = s->rows; /* -pos: RoPE's transpose */
    for (int t = 0; t < T; t++) neg[t] = -sl->pos[t];
    op_rope_params rp = {c->rope_mode, s->m->rot_dim, s->m->inv_freq, 1.0f};
    op_tensor dq3 = op_tensor_3d(OP_TYPE_F32, s->dq, hd, c->n_heads, T);
    op_tensor dk3 = op_tensor_3d(OP_TYPE_F32, s->dk, hd, c->n_kv_heads, T);
    int rc;
    if ((rc = op_rope(s->be, &dq3, neg, &rp)) || (rc = op_rope(s->be, &dk3, neg, &rp))) return rc;
    *dq_out = s->dq;
    *dk_out = s->dk;
    if (!c->qk_norm) return FU_OK;
    op_tensor qp = trn_t2(st->qp, hd, T * c->n_heads), kp = trn_t2(st->kp, hd, T * c->n_kv_heads);
    op_tensor dq = trn_t2(s->dq, hd, T * c->n_heads), dk = trn_t2(s->dk, hd, T * c->n_kv_heads);
    op_tensor dqp = trn_t2(s->dqp, hd, T * c->n_heads), dkp = trn_t2(s->dkp, hd, T * c->n_kv_heads);
    *dq_out = s->dqp;
    *dk_out = s->dkp;
    if ((rc = op_rmsnorm_back(s->be, &qp, &L->q_norm, c->norm_eps, &dq, &dqp, 0.0f))) return rc;
    return op_rmsnorm_back(s->be, &kp, &L->k_norm, c->norm_eps, &dk, &dkp, 0.0f);
}

/* The attention half of block l backwards: g, the gradient of xmid, becomes
 * that of the block's input x. */
static int trn_attn_back(trn_span *s, const trn_slot *sl, int l, const trn_stash *st, const float *x) {
    const mdl_config *c = &s->m->cfg;
    const mdl_layer *L = &s->e->lw[l];
    const int64_t T = sl->T, hd = c->head_dim;
    op_tensor g = trn_t2(s->g, s->D, T), att = trn_t2(st->att, s->qd, T), datt = trn_t2(s->datt, s->qd, T);
    op_attn_train at = {c->n_heads, c->n_kv_heads, c->head_dim, 1.0f / sqrtf((float)hd), sl->first};
    op_tensor q3 = op_tensor_3d(OP_TYPE_F32, st->q, hd, c->n_heads, T), o3 = op_tensor_3d(OP_TYPE_F32, st->att, hd, c->n_heads, T);
    op_tensor k3 = op_tensor_3d(OP_TYPE_F32, st->k, hd, c->n_kv_heads, T), v3 = op_tensor_3d(OP_TYPE_F32, st->v, hd, c->n_kv_heads, T);
    op_tensor dq3 = op_tensor_3d(OP_TYPE_F32, s->dq, hd, c->n_heads, T), do3 = op_tensor_3d(OP_TYPE_F32, s->datt, hd, c->n_heads, T);
    op_tensor dk3 = op_tensor_3d(OP_TYPE_F32, s->dk, hd, c->n_kv_heads, T), dv3 = op_tensor_3d(OP_TYPE_F32, s->dv, hd, c->n_kv_heads, T);
    float *dqp, *dkp;
    int rc;
    if ((rc = trn_mm_back(s, &L->wo, &g, &datt, 0.0f)) ||
        (rc = trn_lora_back(s, sl, l, LORA_TARGET_O, &att, st->u[LORA_TARGET_O], &g, &datt)) ||
        (rc = op_attention_back(s->be, &at, &q3, &k3, &v3, &o3, &do3, &dq3, &dk3, &dv3)) ||
        (rc = trn_qk_back(s, sl, l, st, &dqp, &dkp)))
        return rc;
    op_tensor dq = trn_t2(dqp, s->qd, T), dk = trn_t2(dkp, s->kd, T), dv = trn_t2(s->dv, s->kd, T);
    op_tensor xn = trn_t2(st->xn_a, s->D, T), dxn = trn_t2(s->dxn, s->D, T), xt = trn_t2((float *)x, s->D, T);
    if ((rc = trn_mm_back(s, &L->wq, &dq, &dxn, 0.0f)) || (rc = trn_mm_back(s, &L->wk, &dk, &dxn, 1.0f)) ||
        (rc = trn_mm_back(s, &L->wv, &dv, &dxn, 1.0f)) ||
        (rc = trn_lora_back(s, sl, l, LORA_TARGET_Q, &xn, st->u[LORA_TARGET_Q], &dq, &dxn)) ||
        (rc = trn_lora_back(s, sl, l, LORA_TARGET_K, &xn, st->u[LORA_TARGET_K], &dk, &dxn)) ||
        (rc = trn_lora_back(s, sl, l, LORA_TARGET_V, &xn, st->u[LORA_TARGET_V], &dv, &dxn)))
        return rc;
    return op_rmsnorm_back(s->be, &xt, &L->attn_norm, c->norm_eps, &dxn, &g, 1.0f);
}

/* Block l backwards on the slot (g: the gradient of its output, then of its
 * input), rebuilding its internals first unless the slot kept them. */
static int trn_block_back(trn_span *s, trn_slot *sl, int l) {
    trn_stash *st = trn_stash_of(s, sl, l);
    const float *x = trn_xin(s, sl, l);
    int rc;
    if (s->opts.memory != TRN_KEEP) {
        if ((rc = trn_attn_fwd(s, sl, l, st, x)) || (rc = trn_mlp_fwd(s, sl, l, st, NULL))) return rc;
    } else {
        op_tensor gate = trn_t2(st->gate, s->F, sl->T), up = trn_t2(st->up, s->F, sl->T), act = trn_t2(s->act, s->F, sl->T);
        if ((rc = op_swiglu(s->be, &gate, &up, &act))) return rc;
    }
    if ((rc = trn_mlp_back(s, sl, l, st))) return rc;
    return trn_attn_back(s, sl, l, st, x);
}

int trn_backward(trn_span *s, int slot, const float *dy, float *dx) {
    if (slot < 0 || slot >= s->opts.slots || !s->slots[slot].used)
        return fu_errorf(FU_ERR_INVALID, "training: slot %d holds no forward", slot);
    trn_slot *sl = &s->slots[slot];
    const size_t bytes = (size_t)sl->T * (size_t)s->D * sizeof(float);
    int rc;
    if (s->m->has_head) {
        op_tensor g = trn_t2(s->g, s->D, sl->T), dh = trn_t2(sl->dh, s->D, sl->T);
        rc = op_get_rows(s->be, &dh, s->ident, &g);
    } else {
        rc = dy ? op_buffer_set(s->be, s->g, dy, bytes) : fu_errorf(FU_ERR_INVALID, "training: no output gradient");
    }
    for (int l = s->n_span - 1; l >= 0 && !rc; l--) rc = trn_block_back(s, sl, l);
    if (!rc) rc = trn_sync_grads(s);
    if (!rc && dx) rc = op_buffer_get(s->be, dx, s->g, bytes);
    sl->used = false;
    return rc;
}

/* ---- optimizer ----------------------------------------------------------------------- */

double trn_grad_sqnorm(const trn_span *s) {
    double sum = 0;
    for (size_t i = 0; i < s->ad->n_floats; i++) sum += (double)s->grad[i] * s->grad[i];
    return sum;
}

void trn_zero_grad(trn_span *s) {
    memset(s->grad, 0, s->ad->n_floats * sizeof(float));
    if (s->dgrad != s->grad && op_buffer_set(s->be, s->dgrad, s->grad, s->ad->n_floats * sizeof(float)))
        FU_WARN("training: clearing the gradients on the %s backend failed: %s", op_backend_name(s->be), fu_last_error());
}

trn_adamw trn_adamw_default(void) { return (trn_adamw){0.9f, 0.999f, 1e-8f, 0.01f}; }

int trn_step(trn_span *s, const trn_adamw *h, float lr, float grad_scale, int64_t t) {
    if (t < 1) return fu_errorf(FU_ERR_RANGE, "optimizer step %lld (steps count from 1)", (long long)t);
    if (!isfinite(trn_grad_sqnorm(s)) || !isfinite(grad_scale) || !isfinite(lr))
        return fu_errorf(FU_ERR_RANGE, "optimizer step %lld: a gradient is not finite", (long long)t);
    const double bc1 = 1.0 - pow(h->beta1, (double)t), bc2 = 1.0 - pow(h->beta2, (double)t);
    const float step = (float)(lr / bc1), bc2s = (float)sqrt(bc2), decay = 1.0f - lr * h->weight_decay;
    float *p = s->ad->data;
    for (size_t i = 0; i < s->ad->n_floats; i++) {
        float g = s->grad[i] * grad_scale;
        p[i] *= decay;
        s->m1[i] = h->beta1 * s->m1[i] + (1.0f - h->beta1) * g;
        s->m2[i] = h->beta2 * s->m2[i] + (1.0f - h->beta2) * g * g;
        p[i] -= step * s->m1[i] / (sqrtf(s->m2[i]) / bc2s + h->eps);
    }
    trn_zero_grad(s);
    return lora_upload(s->ad, s->be); /* the backend's copy follows the new weights */
}

float *trn_moment1(trn_span *s) { return s->m1; }
float *trn_moment2(trn_span *s) { return s->m2; }
const float *trn_grads(const trn_span *s) { return s->grad; }

float trn_lr_at(const trn_schedule *sc, int64_t done) {
    if (done < sc->warmup) return sc->lr * (float)done / (float)(sc->warmup > 0 ? sc->warmup : 1);
    if (sc->decay == TRN_DECAY_CONSTANT) return sc->lr;
    const int64_t span = sc->total - sc->warmup;
    double progress = span > 0 ? (double)(done - sc->warmup) / (double)span : 1.0;
    if (progress > 1) progress = 1;
    if (sc->decay == TRN_DECAY_LINEAR) return sc->lr * (float)(1.0 - progress);
    return sc->lr * (float)(0.5 * (1.0 + cos(M_PI * progress)));
}

int trn_slot_tokens(const trn_span *s, int slot) {
    return slot >= 0 && slot < s->opts.slots && s->slots[slot].used ? s->slots[slot].T : 0;
}

/* Copies src (an adapter-shaped array, n_floats) into dst, permuting the q/k
 * rows from the held order to PEFT's (to_peft) or back, through scratch
 * adapter `tmp` of the same shape. */
static int trn_reorder(const trn_span *s, lora_adapter *tmp, const float *src, float *dst, bool to_peft) {
    const bool held = s->ad->qk_interleaved;
    memcpy(tmp->data, src, s->ad->n_floats * sizeof(float));
    tmp->qk_interleaved = to_peft ? held : false;
    int rc = lora_set_qk_order(tmp, to_peft ? false : held);
    if (!rc) memcpy(dst, tmp->data, s->ad->n_floats * sizeof(float));
    return rc;
}

/* A scratch adapter of s's shape (its numbers unset). */
static int trn_scratch_adapter(const trn_span *s, lora_adapter **out) {
    mdl_config c = s->m->cfg;
    return lora_new(&s->ad->cfg, &c, s->ad->first, s->ad->last, 0, out);
}

int trn_export(const trn_span *s, float *params, float *m1, float *m2) {
    lora_adapter *tmp = NULL;
    int rc = trn_scratch_adapter(s, &tmp);
    if (!rc && params) rc = trn_reorder(s, tmp, s->ad->data, params, true);
    if (!rc && m1) rc = trn_reorder(s, tmp, s->m1, m1, true);
    if (!rc && m2) rc = trn_reorder(s, tmp, s->m2, m2, true);
    lora_free(tmp);
    return rc;
}

int trn_import(trn_span *s, const float *params, const float *m1, const float *m2) {
    const size_t n = s->ad->n_floats;
    float *p = malloc(3 * n * sizeof(float) + 1);
    lora_adapter *tmp = NULL;
    int rc = p ? trn_scratch_adapter(s, &tmp) : fu_errorf(FU_ERR_NOMEM, "training state");
    if (!rc) rc = trn_reorder(s, tmp, params, p, false);
    if (!rc && m1) rc = trn_reorder(s, tmp, m1, p + n, false);
    if (!rc && m2) rc = trn_reorder(s, tmp, m2, p + 2 * n, false);
    if (!rc) {
        memcpy(s->ad->data, p, n * sizeof(float));
        if (m1) memcpy(s->m1, p + n, n * sizeof(float)); else memset(s->m1, 0, n * sizeof(float));
        if (m2) memcpy(s->m2, p + 2 * n, n * sizeof(float)); else memset(s->m2, 0, n * sizeof(float));
        trn_zero_grad(s);
        for (int i = 0; i < s->opts.slots; i++) s->slots[i].used = false;
        rc = lora_upload(s->ad, s->be);
    }
    lora_free(tmp);
    free(p);
    return rc;
}
