/* attention.cu -- causal grouped-query attention, split over positions (flash decoding).
 *
 * A task is (token, head, split): one warp runs an online softmax over the split's positions
 * [split * split_len, min((split + 1) * split_len, n)) in chunks of 32. Per chunk, lane j
 * scores position j0 + j (a full dot product with q, which the warp keeps in shared memory),
 * the warp takes the chunk maximum, rescales its running accumulator when the maximum grows,
 * publishes the 32 probabilities in shared memory, and each lane accumulates the dims
 * d = lane + 32 i of V. With one split a task writes its output; with several, each writes its
 * maximum, sum and unnormalized accumulator to scratch, and attn_merge combines a (token,
 * head)'s splits. Splits are chosen so that decode (few tokens over long caches) still gives
 * the GPU ATTN_TARGET_WARPS warps of work. */
#include "attention.cuh"

#define ATTN_WARPS 4            /* warps (tasks) per block */
#define ATTN_TARGET_WARPS 4096  /* tasks worth splitting a batch for */

/* The cache of a token's sequence, worked out on the host. */
typedef struct attn_tok {
    const uint8_t *k, *v; /* device: caches at kv head 0, position 0 */
    uint64_t k_nb1, k_nb2; /* bytes between kv heads / positions of k */
    uint64_t v_nb1, v_nb2;
    int32_t n;             /* positions attended: pos + 1 */
    int32_t f16;           /* 1: F16 caches, 0: F32 */
} attn_tok;

typedef struct attn_args {
    const float *q;         /* (T, H, hd) with strides q_nb1 (head), q_nb2 (token) in bytes */
    float *out;             /* (T, H, hd) with strides o_nb1, o_nb2 */
    const attn_tok *tok;    /* (T) device */
    float *part;            /* splits > 1: (T * H * splits) rows of hd + 2: accumulator, max, sum */
    uint64_t q_nb1, q_nb2, o_nb1, o_nb2;
    int64_t ntasks;         /* T * H * splits */
    int nh, group, hd, splits, split_len;
    float scale;
} attn_args;

CU_DEV float attn_load(const uint8_t *row, int d, int f16) {
    return f16 ? cu_f16_to_f32(((const uint16_t *)row)[d]) : ((const float *)row)[d];
}

/* Where a task writes: its output row, or with several splits its row of the scratch
 * (accumulator, then the maximum and the sum, which attn_merge reads). */
CU_DEV void attn_write(const cu_ctx *c, const attn_args *a, int64_t task, int64_t t, int h, const float *acc,
                       float m, float l) {
    const int lane = (int)cu_lane(c), hd = a->hd;
    float *o = a->splits > 1 ? a->part + task * (hd + 2)
                             : (float *)((uint8_t *)a->out + t * a->o_nb2 + h * a->o_nb1);
    const float inv = a->splits > 1 ? 1.0f : 1.0f / l;
    for (int i = 0; i < CU_ATTN_MAX_HD / CU_WARP; i++) {
        const int d = lane + CU_WARP * i;
        if (d >= hd) break;
        o[d] = acc[i] * inv;
    }
    if (a->splits > 1 && lane == 0) {
        o[hd] = m; /* -inf for a split past the token's positions, whose sum is 0 */
        o[hd + 1] = l;
    }
}

/* Shared memory: ATTN_WARPS x (hd + 32) floats: each warp's q and probabilities. */
CU_DEV void attn_body(const cu_ctx *c, const attn_args *a) {
    const int lane = (int)cu_lane(c), warp = (int)cu_warp_id(c), hd = a->hd;
    const int64_t task = cu_block(c) * ATTN_WARPS + warp;
    if (task >= a->ntasks) return; /* the whole warp leaves; no block barriers below */
    const int64_t th = task / a->splits, t = th / a->nh;
    const int h = (int)(th % a->nh), g = h / a->group;
    const attn_tok tk = a->tok[t];
    const int jb = (int)(task % a->splits) * a->split_len;
    const int je = tk.n < jb + a->split_len ? tk.n : jb + a->split_len;
    float *qs = (float *)c->smem + warp * (hd + CU_WARP);
    float *ps = qs + hd;
    const float *q = (const float *)((const uint8_t *)a->q + t * a->q_nb2 + h * a->q_nb1);
    for (int d = lane; d < hd; d += CU_WARP) qs[d] = q[d];
    cu_syncwarp(c);
    const uint8_t *kb = tk.k + g * tk.k_nb1, *vb = tk.v + g * tk.v_nb1;
    float acc[CU_ATTN_MAX_HD / CU_WARP];
    for (int i = 0; i < CU_ATTN_MAX_HD / CU_WARP; i++) acc[i] = 0.0f;
    float m = -INFINITY, l = 0.0f;
    for (int j0 = jb; j0 < je; j0 += CU_WARP) {
        const int j = j0 + lane, cn = je - j0 < CU_WARP ? je - j0 : CU_WARP;
        float s = -INFINITY;
        if (j < je) {
            const uint8_t *kr = kb + (uint64_t)j * tk.k_nb2;
            float dot = 0.0f;
            for (int d = 0; d < hd; d++) dot += qs[d] * attn_load(kr, d, tk.f16);
            s = dot * a->scale;
        }
        float cm = s;
        cu_warp_max_n(c, &cm, 1);
        const float mn = fmaxf(m, cm);
        const float f = expf(m - mn); /* 0 on the first chunk */
        const float p = j < je ? expf(s - mn) : 0.0f;
        l = l * f + p;
        ps[lane] = p;
        cu_syncwarp(c);
        for (int i = 0; i < CU_ATTN_MAX_HD / CU_WARP; i++) {
            const int d = lane + CU_WARP * i;
            if (d >= hd) break;
            float v = acc[i] * f;
            for (int jj = 0; jj < cn; jj++) v += ps[jj] * attn_load(vb + (uint64_t)(j0 + jj) * tk.v_nb2, d, tk.f16);
            acc[i] = v;
        }
        cu_syncwarp(c); /* ps is rewritten by the next chunk */
        m = mn;
    }
    cu_warp_sum_n(c, &l, 1);
    attn_write(c, a, task, t, h, acc, m, l);
}
CU_KERNEL_SYNC(attn, attn_args)

/* One warp per (token, head): out = sum_s acc_s e^(m_s - M) / sum_s l_s e^(m_s - M). */
CU_DEV void attn_merge_body(const cu_ctx *c, const attn_args *a) {
    const int64_t th = cu_block(c) * ATTN_WARPS + cu_warp_id(c);
    if (th >= a->ntasks / a->splits) return;
    const int hd = a->hd, row = hd + 2;
    const float *pp = a->part + th * a->splits * row;
    float mx = -INFINITY, l = 0.0f;
    for (int s = 0; s < a->splits; s++) mx = fmaxf(mx, pp[s * row + hd]);
    for (int s = 0; s < a->splits; s++) l += pp[s * row + hd + 1] * expf(pp[s * row + hd] - mx);
    float *o = (float *)((uint8_t *)a->out + th / a->nh * a->o_nb2 + th % a->nh * a->o_nb1);
    for (int d = (int)cu_lane(c); d < hd; d += CU_WARP) {
        float v = 0.0f;
        for (int s = 0; s < a->splits; s++) v += pp[s * row + d] * expf(pp[s * row + hd] - mx);
        o[d] = v / l;
    }
}
CU_KERNEL(attn_merge, attn_args)

/* Splits of a multiple of 32 positions, as few as give ATTN_TARGET_WARPS tasks (max_n >= 1).
 * With several splits, tasks * splits stays under 2 * ATTN_TARGET_WARPS, which bounds the
 * scratch at 8.5 MB. */
static void attn_split(attn_args *p, int64_t tasks, int max_n) {
    const int64_t want = (ATTN_TARGET_WARPS + tasks - 1) / tasks, chunks = (max_n + CU_WARP - 1) / CU_WARP;
    const int64_t splits = want < chunks ? want : chunks;
    p->split_len = (int)(((max_n + splits - 1) / splits + CU_WARP - 1) / CU_WARP * CU_WARP);
    p->splits = (max_n + p->split_len - 1) / p->split_len;
    p->ntasks = tasks * p->splits;
}

/* Checks token t's sequence, cache and position, and describes its cache in *tok. */
static int attn_tok_fill(cuda_backend *cb, const op_attn *a, int64_t t, attn_tok *tok) {
    int s = a->seq[t];
    if (s < 0 || s >= a->n_seqs)
        return fu_errorf(FU_ERR_RANGE, "attention: token %lld has sequence %d of %d", (long long)t, s, a->n_seqs);
    const op_tensor *k = &a->k[s], *v = &a->v[s];
    size_t es = k->type == OP_TYPE_F16 ? 2 : 4;
    if ((k->type != OP_TYPE_F32 && k->type != OP_TYPE_F16) || v->type != k->type || k->ne[0] != a->head_dim ||
        v->ne[0] != a->head_dim || k->ne[1] != a->n_kv_heads || v->ne[1] != a->n_kv_heads || k->nb[0] != es ||
        v->nb[0] != es || !k->data || !v->data || k->nb[1] % es || k->nb[2] % es || v->nb[1] % es ||
        v->nb[2] % es || (uintptr_t)k->data % es || (uintptr_t)v->data % es)
        return fu_errorf(FU_ERR_INVALID, "attention: cache %d must be F32/F16 (len, %d, %d)", s, a->n_kv_heads,
                         a->head_dim);
    if (a->pos[t] < 0 || a->pos[t] >= k->ne[2] || a->pos[t] >= v->ne[2])
        return fu_errorf(FU_ERR_RANGE, "attention: token %lld at position %d outside cache of %lld", (long long)t,
                         a->pos[t], (long long)k->ne[2]);
    int rc;
    if ((t == 0 || a->seq[t - 1] != s) && (rc = cuda_mem_check(cb, "attention", k, v, NULL))) return rc;
    tok->k = (const uint8_t *)k->data;
    tok->v = (const uint8_t *)v->data;
    tok->k_nb1 = k->nb[1];
    tok->k_nb2 = k->nb[2];
    tok->v_nb1 = v->nb[1];
    tok->v_nb2 = v->nb[2];
    tok->n = a->pos[t] + 1;
    tok->f16 = k->type == OP_TYPE_F16;
    return FU_OK;
}

/* Queues the attention kernel over p's tasks, then the merge of their splits if any. */
static int attn_launch(cuda_backend *cb, attn_args *p, int64_t nt, int max_n) {
    attn_split(p, nt * p->nh, max_n);
    int rc;
    if (p->splits > 1) {
        size_t bytes = (size_t)p->ntasks * (size_t)(p->hd + 2) * sizeof(float);
        if ((rc = cuda_scratch(cb, &cb->attn, &cb->attn_cap, bytes))) return rc;
        p->part = (float *)cb->attn;
    }
    /* 2-D grids are not needed: T * H * splits stays far below 2^31 blocks */
    rc = CU_LAUNCH(cb, attn, cu_dim((unsigned)((p->ntasks + ATTN_WARPS - 1) / ATTN_WARPS), 1, 1),
                   cu_dim(ATTN_WARPS * CU_WARP, 1, 1), (size_t)ATTN_WARPS * (size_t)(p->hd + CU_WARP) * sizeof(float),
                   *p);
    if (rc || p->splits == 1) return rc;
    return CU_LAUNCH(cb, attn_merge, cu_dim((unsigned)((nt * p->nh + ATTN_WARPS - 1) / ATTN_WARPS), 1, 1),
                     cu_dim(ATTN_WARPS * CU_WARP, 1, 1), 0, *p);
}

CU_INTERNAL int cuda_attention(op_backend *be, const op_tensor *q, const op_attn *a, op_tensor *out) {
    cuda_backend *cb = cuda_be(be);
    if (q->type != OP_TYPE_F32 || out->type != OP_TYPE_F32 || q->nb[0] != 4 || out->nb[0] != 4 ||
        out->ne[0] != a->head_dim || out->ne[1] != a->n_heads || !q->data || !out->data ||
        q->nb[1] % 4 || q->nb[2] % 4 || out->nb[1] % 4 || out->nb[2] % 4)
        return fu_errorf(FU_ERR_INVALID, "attention: q and out must be f32 (T, H, hd)");
    if (a->head_dim <= 0 || a->head_dim > CU_ATTN_MAX_HD)
        return fu_errorf(FU_ERR_UNSUPPORTED, "attention: head_dim %d outside [1, %d]", a->head_dim,
                         CU_ATTN_MAX_HD);
    int rc;
    if ((rc = cuda_mem_check(cb, "attention", q, out, NULL))) return rc;
    const int64_t nt = q->ne[2] * q->ne[3];
    if (nt == 0) return FU_OK;
    attn_tok *tok = (attn_tok *)cuda_meta_host(cb, (size_t)nt * sizeof(attn_tok));
    if (!tok) return FU_ERR_NOMEM;
    int max_n = 1;
    for (int64_t t = 0; t < nt; t++) {
        if ((rc = attn_tok_fill(cb, a, t, &tok[t]))) return rc;
        if (tok[t].n > max_n) max_n = tok[t].n;
    }
    if ((rc = cu_rt_enter(cb))) return rc;
    void *dev;
    if ((rc = cuda_meta_upload(cb, (size_t)nt * sizeof(attn_tok), &dev))) return rc;
    attn_args p;
    memset(&p, 0, sizeof p);
    p.q = (const float *)q->data;
    p.out = (float *)out->data;
    p.tok = (const attn_tok *)dev;
    p.q_nb1 = q->nb[1];
    p.q_nb2 = q->nb[2];
    p.o_nb1 = out->nb[1];
    p.o_nb2 = out->nb[2];
    p.nh = a->n_heads;
    p.group = a->n_heads / a->n_kv_heads;
    p.hd = a->head_dim;
    p.scale = a->scale;
    return attn_launch(cb, &p, nt, max_n);
}
