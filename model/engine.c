/* engine.c -- the transformer forward pass over a span of blocks, batched across sequences. */
#include "engine-impl.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "status.h"

const mdl_model *eng_model(const eng_engine *e) { return e->m; }

uint64_t eng_kv_bytes_per_pos(const eng_engine *e) {
    return (uint64_t)e->n_span * 2u * (uint64_t)e->kd * e->kv_elem;
}

void eng_free(eng_engine *e) {
    if (!e) return;
    for (int i = 0; i < e->n_owned; i++) op_buffer_free(e->be, e->owned[i]);
    free(e->owned);
    free(e->lw);
    float *bufs[] = {e->x, e->xn, e->q, e->k, e->v, e->att, e->tmp, e->gate, e->up, e->logits};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) op_buffer_free(e->be, bufs[i]);
    free(e->pos);
    free(e->seq_idx);
    free(e->rows);
    free(e->useq);
    free(e->base_len);
    free(e->kview);
    free(e->vview);
    free(e->kptr);
    free(e->vptr);
    free(e->lad);
    free(e->lgrp);
    free(e->lrows);
    free(e->loff);
    op_buffer_free(e->be, e->lx);
    op_buffer_free(e->be, e->lu);
    op_buffer_free(e->be, e->ld);
    free(e);
}

/* *w as the backend runs it: the model's tensor, or a copy that the engine
 * owns (after which the model may give back the original's pages). A matrix
 * goes through op_weight_prepare, anything else through op_tensor_upload. */
static int eng_prepare(eng_engine *e, const op_tensor *src, op_tensor *w, bool matrix) {
    int rc = matrix ? op_weight_prepare(e->be, src, w) : op_tensor_upload(e->be, src, w);
    if (rc <= 0) return rc;
    e->owned[e->n_owned++] = w->data;
    mdl_release_tensor(e->m, src);
    return FU_OK;
}

/* Prepares the span's tensors, the final norm and LM head, and the
 * embeddings (see eng_prepare). */
static int eng_prepare_weights(eng_engine *e) {
    const mdl_model *m = e->m;
    const mdl_config *c = &m->cfg;
    e->lw = calloc((size_t)e->n_span + 1, sizeof *e->lw);
    e->owned = calloc(14 * (size_t)e->n_span + 3, sizeof *e->owned);
    if (!e->lw || !e->owned) return fu_errorf(FU_ERR_NOMEM, "engine weights");
    int rc = FU_OK;
    for (int l = 0; l < e->n_span && !rc; l++) {
        const mdl_layer *src = &m->layers[l];
        mdl_layer *L = &e->lw[l];
        *L = *src;
        if ((rc = eng_prepare(e, &src->wq, &L->wq, true)) || (rc = eng_prepare(e, &src->wk, &L->wk, true)) ||
            (rc = eng_prepare(e, &src->wv, &L->wv, true)) || (rc = eng_prepare(e, &src->wo, &L->wo, true)) ||
            (rc = eng_prepare(e, &src->w_gate, &L->w_gate, true)) ||
            (rc = eng_prepare(e, &src->w_up, &L->w_up, true)) ||
            (rc = eng_prepare(e, &src->w_down, &L->w_down, true)) ||
            (rc = eng_prepare(e, &src->attn_norm, &L->attn_norm, false)) ||
            (rc = eng_prepare(e, &src->ffn_norm, &L->ffn_norm, false)))
            break;
        if (c->qkv_bias && ((rc = eng_prepare(e, &src->bq, &L->bq, false)) ||
                            (rc = eng_prepare(e, &src->bk, &L->bk, false)) ||
                            (rc = eng_prepare(e, &src->bv, &L->bv, false))))
            break;
        if (c->qk_norm && ((rc = eng_prepare(e, &src->q_norm, &L->q_norm, false)) ||
                           (rc = eng_prepare(e, &src->k_norm, &L->k_norm, false))))
            break;
    }
    if (!rc && m->has_head && !(rc = eng_prepare(e, &m->lm_head, &e->head, true)))
        rc = eng_prepare(e, &m->out_norm, &e->out_norm, false);
    if (rc || !m->has_embed) return rc;
    /* tied embeddings that the head's preparation copied as they are: one copy serves both */
    if (m->has_head && m->lm_head.data == m->tok_embd.data && e->head.data != m->lm_head.data &&
        e->head.type == m->tok_embd.type) {
        e->embd = e->head;
        e->embd.name = m->tok_embd.name;
        return FU_OK;
    }
    return eng_prepare(e, &m->tok_embd, &e->embd, false);
}

int eng_new(const mdl_model *m, op_backend *be, const eng_options *opts, eng_engine **out) {
    *out = NULL;
    eng_engine *e = calloc(1, sizeof *e);
    if (!e) return fu_errorf(FU_ERR_NOMEM, "engine");
    e->m = m;
    e->be = be;
    e->opts.max_batch_tokens = 256;
    e->opts.kv_type = OP_TYPE_F32;
    if (opts) {
        if (opts->max_batch_tokens > 0) e->opts.max_batch_tokens = opts->max_batch_tokens;
        e->opts.kv_type = opts->kv_type;
    }
    if (e->opts.kv_type != OP_TYPE_F32 && e->opts.kv_type != OP_TYPE_F16) {
        free(e);
        return fu_errorf(FU_ERR_INVALID, "engine: KV cache type must be f32 or f16");
    }
    const mdl_config *c = &m->cfg;
    const size_t T = (size_t)e->opts.max_batch_tokens;
    e->n_span = m->last - m->first;
    e->qd = (int64_t)c->n_heads * c->head_dim;
    e->kd = (int64_t)c->n_kv_heads * c->head_dim;
    e->kv_elem = op_type_block_bytes(e->opts.kv_type);
    const size_t f = sizeof(float);
    e->x = op_buffer_alloc(be, T * (size_t)c->dim * f);
    e->xn = op_buffer_alloc(be, T * (size_t)c->dim * f);
    e->q = op_buffer_alloc(be, T * (size_t)e->qd * f);
    e->k = op_buffer_alloc(be, T * (size_t)e->kd * f);
    e->v = op_buffer_alloc(be, T * (size_t)e->kd * f);
    e->att = op_buffer_alloc(be, T * (size_t)e->qd * f);
    e->tmp = op_buffer_alloc(be, T * (size_t)c->dim * f);
    e->gate = op_buffer_alloc(be, T * (size_t)c->ffn_dim * f);
    e->up = op_buffer_alloc(be, T * (size_t)c->ffn_dim * f);
    if (m->has_head) e->logits = op_buffer_alloc(be, T * (size_t)c->vocab_size * f);
    e->pos = calloc(T, sizeof *e->pos);
    e->seq_idx = calloc(T, sizeof *e->seq_idx);
    e->rows = calloc(T, sizeof *e->rows);
    e->useq = calloc(T, sizeof *e->useq);
    e->base_len = calloc(T, sizeof *e->base_len);
    e->kview = calloc(T, sizeof *e->kview);
    e->vview = calloc(T, sizeof *e->vview);
    e->kptr = calloc(T, sizeof *e->kptr);
    e->vptr = calloc(T, sizeof *e->vptr);
    e->lad = calloc(T, sizeof *e->lad);
    e->lgrp = calloc(T, sizeof *e->lgrp);
    e->lrows = calloc(T, sizeof *e->lrows);
    e->loff = calloc(T + 1, sizeof *e->loff);
    if (!e->lad || !e->lgrp || !e->lrows || !e->loff) {
        eng_free(e);
        return fu_errorf(FU_ERR_NOMEM, "engine LoRA scratch for %zu tokens", T);
    }
    if (!e->x || !e->xn || !e->q || !e->k || !e->v || !e->att || !e->tmp || !e->gate || !e->up ||
        (m->has_head && !e->logits) || !e->pos || !e->seq_idx || !e->rows || !e->useq ||
        !e->base_len || !e->kview || !e->vview || !e->kptr || !e->vptr) {
        eng_free(e);
        return fu_errorf(FU_ERR_NOMEM, "engine scratch for %zu tokens", T);
    }
    int64_t max_k = c->dim > c->ffn_dim ? c->dim : c->ffn_dim;
    if (e->qd > max_k) max_k = e->qd;
    e->max_k = max_k;
    int rc = op_reserve(be, (int64_t)T, max_k);
    if (!rc) rc = eng_prepare_weights(e);
    if (rc) {
        eng_free(e);
        return rc;
    }
    *out = e;
    return FU_OK;
}

/* ---- sequences ------------------------------------------------------------------ */

int eng_seq_new(eng_engine *e, int max_len, eng_seq **out) {
    *out = NULL;
    const mdl_config *c = &e->m->cfg;
    if (max_len <= 0 || max_len > c->max_seq_len)
        return fu_errorf(FU_ERR_RANGE, "sequence length %d outside [1, %d]", max_len, c->max_seq_len);
    eng_seq *s = calloc(1, sizeof *s);
    if (!s) return fu_errorf(FU_ERR_NOMEM, "sequence");
    s->e = e;
    s->max_len = max_len;
    size_t layer_bytes = (size_t)max_len * (size_t)e->kd * e->kv_elem;
    int n = e->n_span > 0 ? e->n_span : 1;
    s->kv = op_buffer_alloc(e->be, layer_bytes * 2 * (size_t)n);
    s->k3 = calloc((size_t)n, sizeof *s->k3);
    s->v3 = calloc((size_t)n, sizeof *s->v3);
    if (!s->kv || !s->k3 || !s->v3) {
        eng_seq_free(e, s);
        return fu_errorf(FU_ERR_NOMEM, "KV cache of %d positions (%zu bytes)", max_len,
                         layer_bytes * 2 * (size_t)n);
    }
    for (int l = 0; l < e->n_span; l++) {
        uint8_t *kp = (uint8_t *)s->kv + layer_bytes * (size_t)(2 * l);
        uint8_t *vp = kp + layer_bytes;
        s->k3[l] = op_tensor_kv_cache(e->opts.kv_type, kp, c->head_dim, c->n_kv_heads, max_len);
        s->v3[l] = op_tensor_kv_cache(e->opts.kv_type, vp, c->head_dim, c->n_kv_heads, max_len);
    }
    *out = s;
    return FU_OK;
}

void eng_seq_free(eng_engine *e, eng_seq *s) {
    if (!s) return;
    op_buffer_free(e->be, s->kv);
    free(s->k3);
    free(s->v3);
    free(s);
}

int eng_seq_len(const eng_seq *s) { return s->len; }

int eng_seq_max_len(const eng_seq *s) { return s->max_len; }

int eng_seq_truncate(eng_seq *s, int len) {
    if (len < 0 || len > s->len)
        return fu_errorf(FU_ERR_RANGE, "cannot roll back to %d positions (sequence holds %d)", len,
                         s->len);
    s->len = len;
    return FU_OK;
}

/* Copies positions [pos, pos + n) between s's cache and host bytes laid out
 * (n_span, {K, V}, KVH, ld, hd), ld >= n: out of the cache into `out`, else
 * into it from `in`. */
static int eng_seq_kv_copy(eng_seq *s, int pos, int n, int ld, uint8_t *out, const uint8_t *in) {
    const eng_engine *e = s->e;
    const mdl_config *c = &e->m->cfg;
    const size_t run = (size_t)n * (size_t)c->head_dim * e->kv_elem; /* one head's n positions */
    const size_t step = (size_t)ld * (size_t)c->head_dim * e->kv_elem;
    for (int l = 0; l < e->n_span; l++)
        for (int kv = 0; kv < 2; kv++) {
            const op_tensor *t = kv ? &s->v3[l] : &s->k3[l];
            for (int h = 0; h < c->n_kv_heads; h++) {
                uint8_t *p = (uint8_t *)t->data + (size_t)h * t->nb[1] + (size_t)pos * t->nb[2];
                int rc = out ? op_buffer_get(e->be, out, p, run) : op_buffer_set(e->be, p, in, run);
                if (rc) return rc;
                if (out) out += step;
                else in += step;
            }
        }
    return FU_OK;
}

int eng_seq_kv_export(eng_seq *s, int pos, int n, void *dst) {
    if (pos < 0 || n < 0 || pos + n > s->len)
        return fu_errorf(FU_ERR_RANGE, "KV export of [%d, %d): the sequence holds %d positions", pos, pos + n, s->len);
    return n ? eng_seq_kv_copy(s, pos, n, n, dst, NULL) : FU_OK;
}

int eng_seq_kv_import(eng_seq *s, int pos, int n, const void *src, int src_n) {
    if (pos != s->len || n < 0 || n > src_n || pos + n > s->max_len)
        return fu_errorf(FU_ERR_RANGE, "KV import of [%d, %d) into a sequence of %d positions (max %d)", pos,
                         pos + n, s->len, s->max_len);
    int rc = n ? eng_seq_kv_copy(s, pos, n, src_n, NULL, src) : FU_OK;
    if (!rc) s->len += n;
    return rc;
}

/* ---- LoRA ------------------------------------------------------------------------ */

/* FU_OK when adapter a holds the engine's span and has its model's shape. */
static int eng_lora_check(const eng_engine *e, const lora_adapter *a) {
    const mdl_model *m = e->m;
    if (a->first != m->first || a->last != m->last)
        return fu_errorf(FU_ERR_INVALID, "LoRA adapter holds blocks [%d, %d), the engine runs [%d, %d)",
                         a->first, a->last, m->first, m->last);
    lora_shape want = lora_shape_of(&m->cfg);
    const lora_shape *got = &a->shape;
    if (got->n_layers != want.n_layers || got->dim != want.dim || got->ffn_dim != want.ffn_dim ||
        got->n_heads != want.n_heads || got->n_kv_heads != want.n_kv_heads || got->head_dim != want.head_dim)
        return fu_errorf(FU_ERR_INVALID,
                         "LoRA adapter is for a model of (layers %d, dim %d, ffn %d, heads %d, kv heads %d, "
                         "head dim %d), not (%d, %d, %d, %d, %d, %d)",
                         got->n_layers, got->dim, got->ffn_dim, got->n_heads, got->n_kv_heads, got->head_dim,
                         want.n_layers, want.dim, want.ffn_dim, want.n_heads, want.n_kv_heads, want.head_dim);
    if (a->cfg.r < 1) return fu_errorf(FU_ERR_INVALID, "LoRA adapter rank %d", a->cfg.r);
    if (a->qk_interleaved != (m->cfg.rope_mode == OP_ROPE_NORM))
        return fu_errorf(FU_ERR_INVALID, "LoRA adapter holds q/k rows in another order than the model");
    return FU_OK;
}

/* Sizes the LoRA scratch for rank r: the gathered inputs and outputs once,
 * A x whenever r grows. */
static int eng_lora_reserve(eng_engine *e, int r) {
    const size_t T = (size_t)e->opts.max_batch_tokens, f = sizeof(float);
    if (!e->lx) e->lx = op_buffer_alloc(e->be, T * (size_t)e->max_k * f);
    if (!e->ld) e->ld = op_buffer_alloc(e->be, T * (size_t)e->max_k * f);
    if (!e->lx || !e->ld) return fu_errorf(FU_ERR_NOMEM, "LoRA scratch for %zu tokens", T);
    if (r <= e->lora_r) return FU_OK;
    float *lu = op_buffer_alloc(e->be, T * (size_t)r * f);
    if (!lu) return fu_errorf(FU_ERR_NOMEM, "LoRA scratch of rank %d for %zu tokens", r, T);
    op_buffer_free(e->be, e->lu);
    e->lu = lu;
    e->lora_r = r;
    return r > e->max_k ? op_reserve(e->be, (int64_t)T, r) : FU_OK;
}

int eng_seq_set_adapter(eng_seq *s, lora_adapter *a) {
    eng_engine *e = s->e;
    if (!a) {
        s->ad = NULL;
        return FU_OK;
    }
    int rc = eng_lora_check(e, a);
    if (rc) return rc;
    op_tensor x = op_tensor_2d(OP_TYPE_F32, e->x, e->m->cfg.dim, 1);
    op_tensor none = op_tensor_2d(OP_TYPE_F32, e->x, e->m->cfg.dim, 0);
    if (op_add_rows(e->be, &x, NULL, &none, 0.0f) == FU_ERR_UNSUPPORTED)
        return fu_errorf(FU_ERR_UNSUPPORTED, "LoRA is not supported on the %s backend yet",
                         op_backend_name(e->be));
    if ((rc = eng_lora_reserve(e, a->cfg.r)) || (!a->dev && (rc = lora_upload(a, e->be)))) return rc;
    s->ad = a;
    return FU_OK;
}

/* Groups the chunk's rows by their sequence's adapter (lad, lrows, loff). */
static void eng_lora_group(eng_engine *e, int T, eng_seq *const *seqs) {
    int n = 0;
    for (int t = 0; t < T; t++) {
        const lora_adapter *ad = seqs[t]->ad;
        int g = -1;
        if (ad) {
            for (g = 0; g < n && e->lad[g] != ad; g++) {}
            if (g == n) e->lad[n++] = ad;
        }
        e->lgrp[t] = g;
    }
    e->n_lgroups = n;
    if (!n) return;
    int k = 0;
    for (int g = 0; g < n; g++) {
        e->loff[g] = k;
        for (int t = 0; t < T; t++)
            if (e->lgrp[t] == g) e->lrows[k++] = t;
    }
    e->loff[n] = k;
}

/* y (T, out) += scale * B (A x) on each adapted row, for target t of the
 * span's block l: x (T, in) is the layer's input, y its output. */
static int eng_lora_apply(eng_engine *e, int l, lora_target t, const op_tensor *x, op_tensor *y) {
    op_backend *be = e->be;
    const int64_t T = x->ne[1];
    for (int g = 0; g < e->n_lgroups; g++) {
        const lora_adapter *ad = e->lad[g];
        const lora_pair *p = lora_at(ad, e->m->first + l, t);
        if (!p->a) continue;
        const int32_t *rows = e->lrows + e->loff[g];
        const int64_t n = e->loff[g + 1] - e->loff[g], r = ad->cfg.r, in = x->ne[0], out = y->ne[0];
        op_tensor a = op_tensor_2d(OP_TYPE_F32, lora_dev(ad, p->a), in, r);
        op_tensor b = op_tensor_2d(OP_TYPE_F32, lora_dev(ad, p->b), r, out);
        op_tensor xg = op_tensor_2d(OP_TYPE_F32, e->lx, in, n), u = op_tensor_2d(OP_TYPE_F32, e->lu, r, n);
        op_tensor d = op_tensor_2d(OP_TYPE_F32, e->ld, out, n);
        a.name = "lora_A";
        b.name = "lora_B";
        int rc;
        if (n < T && (rc = op_get_rows(be, x, rows, &xg))) return rc;
        if ((rc = op_matmul(be, &a, n < T ? &xg : x, &u)) || (rc = op_matmul(be, &b, &u, &d)) ||
            (rc = op_add_rows(be, y, rows, &d, lora_scale(&ad->cfg))))
            return rc;
    }
    return FU_OK;
}

/* ---- forward ----------------------------------------------------------------------- */

/* The chunk's activations as tensors over the engine's scratch (T rows). */
typedef struct eng_views {
    op_tensor x, xn, tmp;     /* (T, D) */
    op_tensor q, att;         /* (T, H * hd) */
    op_tensor k, v;           /* (T, KVH * hd) */
    op_tensor q3, att3;       /* (T, H, hd) */
    op_tensor k3;             /* (T, KVH, hd) */
    op_tensor qh, kh;         /* (T * H, hd), (T * KVH, hd): per-head rows */
    op_tensor gate, up;       /* (T, F) */
} eng_views;

static eng_views eng_views_of(const eng_engine *e, int64_t T) {
    const mdl_config *c = &e->m->cfg;
    const int64_t D = c->dim, F = c->ffn_dim, H = c->n_heads, KVH = c->n_kv_heads, hd = c->head_dim;
    return (eng_views){
        .x = op_tensor_2d(OP_TYPE_F32, e->x, D, T),
        .xn = op_tensor_2d(OP_TYPE_F32, e->xn, D, T),
        .tmp = op_tensor_2d(OP_TYPE_F32, e->tmp, D, T),
        .q = op_tensor_2d(OP_TYPE_F32, e->q, e->qd, T),
        .att = op_tensor_2d(OP_TYPE_F32, e->att, e->qd, T),
        .k = op_tensor_2d(OP_TYPE_F32, e->k, e->kd, T),
        .v = op_tensor_2d(OP_TYPE_F32, e->v, e->kd, T),
        .q3 = op_tensor_3d(OP_TYPE_F32, e->q, hd, H, T),
        .att3 = op_tensor_3d(OP_TYPE_F32, e->att, hd, H, T),
        .k3 = op_tensor_3d(OP_TYPE_F32, e->k, hd, KVH, T),
        .qh = op_tensor_2d(OP_TYPE_F32, e->q, hd, H * T),
        .kh = op_tensor_2d(OP_TYPE_F32, e->k, hd, KVH * T),
        .gate = op_tensor_2d(OP_TYPE_F32, e->gate, F, T),
        .up = op_tensor_2d(OP_TYPE_F32, e->up, F, T),
    };
}

/* The attention half of the span's block l on the chunk (n_useq sequences):
 * x += o(attention(rope(norm(q)), rope(norm(k)), v)) of rmsnorm(x). */
static int eng_attention(eng_engine *e, int l, eng_views *w, int n_useq) {
    const mdl_config *c = &e->m->cfg;
    const mdl_layer *L = &e->lw[l];
    op_backend *be = e->be;
    op_rope_params rp = {c->rope_mode, e->m->rot_dim, e->m->inv_freq, 1.0f};
    op_attn a = {c->n_heads, c->n_kv_heads, c->head_dim, 1.0f / sqrtf((float)c->head_dim), n_useq,
                 e->seq_idx, e->pos, e->kview, e->vview};
    for (int j = 0; j < n_useq; j++) {
        e->kview[j] = e->useq[j]->k3[l];
        e->vview[j] = e->useq[j]->v3[l];
        e->kptr[j] = &e->useq[j]->k3[l];
        e->vptr[j] = &e->useq[j]->v3[l];
    }
    int rc;
    if ((rc = op_rmsnorm(be, &w->x, &L->attn_norm, c->norm_eps, &w->xn)) ||
        (rc = op_matmul_n(be, 3, (const op_tensor *[]){&L->wq, &L->wk, &L->wv}, &w->xn,
                          (op_tensor *[]){&w->q, &w->k, &w->v})) ||
        (rc = eng_lora_apply(e, l, LORA_TARGET_Q, &w->xn, &w->q)) ||
        (rc = eng_lora_apply(e, l, LORA_TARGET_K, &w->xn, &w->k)) ||
        (rc = eng_lora_apply(e, l, LORA_TARGET_V, &w->xn, &w->v)))
        return rc;
    if (c->qkv_bias && ((rc = op_add_row(be, &w->q, &L->bq)) || (rc = op_add_row(be, &w->k, &L->bk)) ||
                        (rc = op_add_row(be, &w->v, &L->bv))))
        return rc;
    if (c->qk_norm && ((rc = op_rmsnorm(be, &w->qh, &L->q_norm, c->norm_eps, &w->qh)) ||
                       (rc = op_rmsnorm(be, &w->kh, &L->k_norm, c->norm_eps, &w->kh))))
        return rc;
    if ((rc = op_rope(be, &w->q3, e->pos, &rp)) || (rc = op_rope(be, &w->k3, e->pos, &rp)) ||
        (rc = op_kv_store(be, &w->k, e->kptr, n_useq, e->seq_idx, e->pos)) ||
        (rc = op_kv_store(be, &w->v, e->vptr, n_useq, e->seq_idx, e->pos)))
        return rc;
    if ((rc = op_attention(be, &w->q3, &a, &w->att3)) || (rc = op_matmul(be, &L->wo, &w->att, &w->tmp)) ||
        (rc = eng_lora_apply(e, l, LORA_TARGET_O, &w->att, &w->tmp)))
        return rc;
    return op_add(be, &w->x, &w->tmp);
}

/* The MLP half of the span's block l: x += down(swiglu(gate(h), up(h))), h = rmsnorm(x). */
static int eng_mlp(eng_engine *e, int l, eng_views *w) {
    const mdl_layer *L = &e->lw[l];
    op_backend *be = e->be;
    int rc;
    if ((rc = op_rmsnorm(be, &w->x, &L->ffn_norm, e->m->cfg.norm_eps, &w->xn)) ||
        (rc = op_matmul_n(be, 2, (const op_tensor *[]){&L->w_gate, &L->w_up}, &w->xn,
                          (op_tensor *[]){&w->gate, &w->up})) ||
        (rc = eng_lora_apply(e, l, LORA_TARGET_GATE, &w->xn, &w->gate)) ||
        (rc = eng_lora_apply(e, l, LORA_TARGET_UP, &w->xn, &w->up)) ||
        (rc = op_swiglu(be, &w->gate, &w->up, &w->gate)) || (rc = op_matmul(be, &L->w_down, &w->gate, &w->tmp)) ||
        (rc = eng_lora_apply(e, l, LORA_TARGET_DOWN, &w->gate, &w->tmp)))
        return rc;
    return op_add(be, &w->x, &w->tmp);
}

/* One chunk of at most max_batch_tokens tokens. Sequence lengths were checked
 * and base positions assigned by the caller. */
static int eng_forward_chunk(eng_engine *e, int T, const int32_t *tokens, const float *embd,
                             eng_seq *const *seqs, const uint8_t *want, bool final_hidden, float *out, int *n_out) {
    const mdl_model *m = e->m;
    const mdl_config *c = &m->cfg;
    op_backend *be = e->be;
    const int64_t D = c->dim;
    int rc;

    /* distinct sequences, their slots and positions */
    int n_useq = 0;
    for (int t = 0; t < T; t++) {
        int j = 0;
        while (j < n_useq && e->useq[j] != seqs[t]) j++;
        if (j == n_useq) {
            e->useq[n_useq] = seqs[t];
            e->base_len[n_useq] = seqs[t]->len;
            n_useq++;
        }
        e->seq_idx[t] = j;
        e->pos[t] = e->base_len[j]++;
    }
    eng_lora_group(e, T, seqs);

    eng_views w = eng_views_of(e, T);
    op_tensor x = w.x;
    if (m->has_embed) {
        if ((rc = op_get_rows(be, &e->embd, tokens, &x))) return rc;
    } else {
        if ((rc = op_buffer_set(be, e->x, embd, (size_t)T * (size_t)D * sizeof(float)))) return rc;
    }
    for (int l = 0; l < e->n_span; l++)
        if ((rc = eng_attention(e, l, &w, n_useq)) || (rc = eng_mlp(e, l, &w))) return rc;

    /* the wanted rows: all of x, or gathered into xn */
    int n = 0;
    for (int t = 0; t < T; t++)
        if (!want || want[t]) e->rows[n++] = t;
    *n_out = n;
    if (n == 0) return FU_OK;
    const size_t row = (size_t)D * sizeof(float);
    op_tensor h = op_tensor_2d(OP_TYPE_F32, e->xn, D, n);
    if (n < T && (rc = op_get_rows(be, &x, e->rows, &h))) return rc;
    if (!m->has_head) return op_buffer_get(be, out, n < T ? e->xn : e->x, (size_t)n * row);
    if ((rc = op_rmsnorm(be, n < T ? &h : &x, &e->out_norm, c->norm_eps, &h))) return rc;
    if (final_hidden) return op_buffer_get(be, out, e->xn, (size_t)n * row);
    op_tensor logits = op_tensor_2d(OP_TYPE_F32, e->logits, c->vocab_size, n);
    if ((rc = op_matmul(be, &e->head, &h, &logits))) return rc;
    return op_buffer_get(be, out, e->logits, (size_t)n * (size_t)c->vocab_size * sizeof(float));
}

/* eng_forward, with final_hidden: eng_forward_final_hidden. */
static int eng_forward_out(eng_engine *e, const eng_batch *b, bool final_hidden, float *out) {
    const mdl_model *m = e->m;
    const int T = b->n_tokens;
    if (T <= 0) return fu_errorf(FU_ERR_INVALID, "forward: empty batch");
    if (m->has_embed ? !b->tokens : !b->embd)
        return fu_errorf(FU_ERR_INVALID, "forward: the span %s token ids",
                         m->has_embed ? "starts at the embeddings and needs" : "takes hidden states, not");
    /* every sequence must fit the batch's positions; count each one's tokens */
    for (int t = 0; t < T; t++) {
        eng_seq *s = b->seqs[t];
        if (!s) return fu_errorf(FU_ERR_INVALID, "forward: token %d has no sequence", t);
        int count = 0;
        for (int u = 0; u < T; u++) count += b->seqs[u] == s;
        if (s->len + count > s->max_len)
            return fu_errorf(FU_ERR_RANGE, "forward: sequence would grow to %d positions (max %d)",
                             s->len + count, s->max_len);
        if (m->has_embed && (b->tokens[t] < 0 || b->tokens[t] >= m->cfg.vocab_size))
            return fu_errorf(FU_ERR_RANGE, "forward: token id %d outside [0, %d)", b->tokens[t],
                             m->cfg.vocab_size);
    }
    const int chunk = e->opts.max_batch_tokens;
    const size_t out_row = (size_t)(m->has_head && !final_hidden ? m->cfg.vocab_size : m->cfg.dim);
    for (int t0 = 0; t0 < T; t0 += chunk) {
        int n = T - t0 < chunk ? T - t0 : chunk;
        int n_out = 0;
        int rc = eng_forward_chunk(e, n, b->tokens ? b->tokens + t0 : NULL,
                                   b->embd ? b->embd + (size_t)t0 * m->cfg.dim : NULL, b->seqs + t0,
                                   b->want ? b->want + t0 : NULL, final_hidden, out, &n_out);
        if (rc) {
            for (int t = 0; t < t0; t++) b->seqs[t]->len--; /* undo the chunks done */
            return rc;
        }
        out += (size_t)n_out * out_row;
        /* the chunk's positions are now in the caches */
        for (int t = t0; t < t0 + n; t++) b->seqs[t]->len++;
    }
    return FU_OK;
}

int eng_forward(eng_engine *e, const eng_batch *b, float *out) { return eng_forward_out(e, b, false, out); }

int eng_forward_final_hidden(eng_engine *e, const eng_batch *b, float *out) {
    if (!e->m->has_head) return fu_errorf(FU_ERR_UNSUPPORTED, "forward: the span does not hold the head");
    return eng_forward_out(e, b, true, out);
}
