/* attention.cu -- one warp per (token, head) with an online softmax over chunks of 32 positions.
 *
 * Per chunk: lane j scores position j0 + j (a full dot product with q, which
 * the warp keeps in shared memory), the warp takes the chunk maximum, rescales
 * its running accumulator when the maximum grows, publishes the 32
 * probabilities in shared memory, and each lane accumulates the dims
 * d = lane + 32 i of V. The softmax denominator is kept per lane and summed
 * over the warp at the end. */
#include "attention.cuh"

#define ATTN_WARPS 4 /* warps (tasks) per block */

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
    uint64_t q_nb1, q_nb2, o_nb1, o_nb2;
    int64_t ntasks;         /* T * H */
    int nh, group, hd;
    float scale;
} attn_args;

CU_DEV float attn_load(const uint8_t *row, int d, int f16) {
    return f16 ? cu_f16_to_f32(((const uint16_t *)row)[d]) : ((const float *)row)[d];
}

/* Shared memory: ATTN_WARPS x (hd + 32) floats: each warp's q and probabilities. */
CU_DEV void attn_body(const cu_ctx *c, const attn_args *a) {
    const int lane = (int)cu_lane(c), warp = (int)cu_warp_id(c), hd = a->hd;
    const int64_t task = cu_block(c) * ATTN_WARPS + warp;
    if (task >= a->ntasks) return; /* the whole warp leaves; no block barriers below */
    const int64_t t = task / a->nh;
    const int h = (int)(task % a->nh), g = h / a->group;
    const attn_tok tk = a->tok[t];
    float *qs = (float *)c->smem + warp * (hd + CU_WARP);
    float *ps = qs + hd;
    const float *q = (const float *)((const uint8_t *)a->q + t * a->q_nb2 + h * a->q_nb1);
    for (int d = lane; d < hd; d += CU_WARP) qs[d] = q[d];
    cu_syncwarp(c);
    const uint8_t *kb = tk.k + g * tk.k_nb1, *vb = tk.v + g * tk.v_nb1;
    float acc[CU_ATTN_MAX_HD / CU_WARP];
    for (int i = 0; i < CU_ATTN_MAX_HD / CU_WARP; i++) acc[i] = 0.0f;
    float m = -INFINITY, l = 0.0f;
    for (int j0 = 0; j0 < tk.n; j0 += CU_WARP) {
        const int j = j0 + lane, cn = tk.n - j0 < CU_WARP ? tk.n - j0 : CU_WARP;
        float s = -INFINITY;
        if (j < tk.n) {
            const uint8_t *kr = kb + (uint64_t)j * tk.k_nb2;
            float dot = 0.0f;
            for (int d = 0; d < hd; d++) dot += qs[d] * attn_load(kr, d, tk.f16);
            s = dot * a->scale;
        }
        float cm = s;
        cu_warp_max_n(c, &cm, 1);
        const float mn = fmaxf(m, cm);
        const float f = expf(m - mn); /* 0 on the first chunk */
        const float p = j < tk.n ? expf(s - mn) : 0.0f;
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
    const float inv = 1.0f / l;
    float *o = (float *)((uint8_t *)a->out + t * a->o_nb2 + h * a->o_nb1);
    for (int i = 0; i < CU_ATTN_MAX_HD / CU_WARP; i++) {
        const int d = lane + CU_WARP * i;
        if (d >= hd) break;
        o[d] = acc[i] * inv;
    }
}
CU_KERNEL_SYNC(attn, attn_args)

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
    for (int64_t t = 0; t < nt; t++) {
        int s = a->seq[t];
        if (s < 0 || s >= a->n_seqs)
            return fu_errorf(FU_ERR_RANGE, "attention: token %lld has sequence %d of %d", (long long)t, s,
                             a->n_seqs);
        const op_tensor *k = &a->k[s], *v = &a->v[s];
        size_t es = k->type == OP_TYPE_F16 ? 2 : 4;
        if ((k->type != OP_TYPE_F32 && k->type != OP_TYPE_F16) || v->type != k->type ||
            k->ne[0] != a->head_dim || v->ne[0] != a->head_dim || k->ne[1] != a->n_kv_heads ||
            v->ne[1] != a->n_kv_heads || k->nb[0] != es || v->nb[0] != es || !k->data || !v->data ||
            k->nb[1] % es || k->nb[2] % es || v->nb[1] % es || v->nb[2] % es ||
            (uintptr_t)k->data % es || (uintptr_t)v->data % es)
            return fu_errorf(FU_ERR_INVALID, "attention: cache %d must be F32/F16 (len, %d, %d)", s,
                             a->n_kv_heads, a->head_dim);
        if (a->pos[t] < 0 || a->pos[t] >= k->ne[2] || a->pos[t] >= v->ne[2])
            return fu_errorf(FU_ERR_RANGE, "attention: token %lld at position %d outside cache of %lld",
                             (long long)t, a->pos[t], (long long)k->ne[2]);
        if ((t == 0 || a->seq[t - 1] != s) && (rc = cuda_mem_check(cb, "attention", k, v, NULL))) return rc;
        tok[t].k = (const uint8_t *)k->data;
        tok[t].v = (const uint8_t *)v->data;
        tok[t].k_nb1 = k->nb[1];
        tok[t].k_nb2 = k->nb[2];
        tok[t].v_nb1 = v->nb[1];
        tok[t].v_nb2 = v->nb[2];
        tok[t].n = a->pos[t] + 1;
        tok[t].f16 = k->type == OP_TYPE_F16;
    }
    if ((rc = cu_rt_enter(cb))) return rc;
    void *dev;
    if ((rc = cuda_meta_upload(cb, (size_t)nt * sizeof(attn_tok), &dev))) return rc;
    attn_args p;
    p.q = (const float *)q->data;
    p.out = (float *)out->data;
    p.tok = (const attn_tok *)dev;
    p.q_nb1 = q->nb[1];
    p.q_nb2 = q->nb[2];
    p.o_nb1 = out->nb[1];
    p.o_nb2 = out->nb[2];
    p.ntasks = nt * a->n_heads;
    p.nh = a->n_heads;
    p.group = a->n_heads / a->n_kv_heads;
    p.hd = a->head_dim;
    p.scale = a->scale;
    int64_t blocks = (p.ntasks + ATTN_WARPS - 1) / ATTN_WARPS;
    /* 2-D grid past 2^31 - 1 blocks is not needed: T * H stays far below */
    return CU_LAUNCH(cb, attn, cu_dim((unsigned)blocks, 1, 1), cu_dim(ATTN_WARPS * CU_WARP, 1, 1),
                     (size_t)ATTN_WARPS * (size_t)(p.hd + CU_WARP) * sizeof(float), p);
}
