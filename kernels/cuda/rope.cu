/* rope.cu -- in-place rotary embedding: one thread per (token, head, rotated pair). */
#include "rope.cuh"

typedef struct rope_args {
    float *x;               /* (T, H, hd) contiguous */
    const int32_t *pos;     /* (T) device */
    const float *inv_freq;  /* (half) device */
    int64_t nt, nh, hd;
    int half, neox;
    float attn_factor;
} rope_args;

/* Pair i of (t, h): theta = pos[t] * inv_freq[i]; (x0, x1) of dims (i, i + half)
 * (NEOX) or (2i, 2i + 1) (NORM) become (x0 c - x1 s, x0 s + x1 c), c and s
 * scaled by attn_factor. */
CU_DEV void rope_body(const cu_ctx *c, const rope_args *a) {
    const int64_t n = a->nt * a->nh * a->half;
    for (int64_t g = cu_gid(c); g < n; g += cu_gstride(c)) {
        const int i = (int)(g % a->half);
        const int64_t th = g / a->half, t = th / a->nh;
        float theta = (float)a->pos[t] * a->inv_freq[i];
        float cs = cosf(theta) * a->attn_factor, sn = sinf(theta) * a->attn_factor;
        float *v = a->x + th * a->hd;
        int i0 = a->neox ? i : 2 * i, i1 = a->neox ? i + a->half : 2 * i + 1;
        float x0 = v[i0], x1 = v[i1];
        v[i0] = x0 * cs - x1 * sn;
        v[i1] = x0 * sn + x1 * cs;
    }
}
CU_KERNEL(rope, rope_args)

CU_INTERNAL int cuda_rope(op_backend *be, op_tensor *x, const int32_t *pos, const op_rope_params *p) {
    cuda_backend *cb = cuda_be(be);
    if (!cuda_f32_contig(x)) return fu_errorf(FU_ERR_INVALID, "rope: x must be contiguous f32");
    if (!p->inv_freq || !pos) return fu_errorf(FU_ERR_INVALID, "rope: no inv_freq or positions");
    int rc;
    if ((rc = cuda_mem_check(cb, "rope", x, NULL, NULL)) || (rc = cu_rt_enter(cb))) return rc;
    rope_args a;
    a.nt = x->ne[2] * x->ne[3];
    a.nh = x->ne[1];
    a.hd = x->ne[0];
    a.half = p->rot_dim / 2;
    a.neox = p->mode == OP_ROPE_NEOX;
    a.attn_factor = p->attn_factor;
    if (a.nt * a.nh == 0) return FU_OK;
    /* metadata: pos (T) | inv_freq (half) */
    size_t off = cuda_align16((size_t)a.nt * sizeof(int32_t));
    size_t n = off + (size_t)a.half * sizeof(float);
    uint8_t *h = (uint8_t *)cuda_meta_host(cb, n);
    if (!h) return FU_ERR_NOMEM;
    memcpy(h, pos, (size_t)a.nt * sizeof(int32_t));
    memcpy(h + off, p->inv_freq, (size_t)a.half * sizeof(float));
    void *dev;
    if ((rc = cuda_meta_upload(cb, n, &dev))) return rc;
    a.x = (float *)x->data;
    a.pos = (const int32_t *)dev;
    a.inv_freq = (const float *)((uint8_t *)dev + off);
    int64_t items = a.nt * a.nh * a.half;
    return CU_LAUNCH(cb, rope, cu_dim(cu_blocks_for(items, 256), 1, 1), cu_dim(256, 1, 1), 0, a);
}
