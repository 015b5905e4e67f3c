/* kv-store.cu -- row t of src (T, C) f32 into its cache row, converting to f16 where the cache is F16. */
#include "kv-store.cuh"

/* Where token t goes, worked out on the host. */
typedef struct kv_row {
    uint8_t *row;         /* device: head 0 of the cache row */
    uint64_t head_stride; /* bytes between heads */
    int64_t hd;           /* elements per head */
    int32_t f16;          /* 1: F16 cache, 0: F32 */
    int32_t pad;
} kv_row;

typedef struct kv_store_args {
    const float *src;   /* (T, C) */
    const kv_row *rows; /* (T) device */
    int64_t nt, cols;
} kv_store_args;

CU_DEV void kv_store_body(const cu_ctx *c, const kv_store_args *a) {
    const int64_t n = a->nt * a->cols;
    for (int64_t g = cu_gid(c); g < n; g += cu_gstride(c)) {
        const int64_t t = g / a->cols, i = g % a->cols;
        kv_row r = a->rows[t];
        uint8_t *head = r.row + (uint64_t)(i / r.hd) * r.head_stride;
        if (r.f16)
            ((uint16_t *)head)[i % r.hd] = cu_f32_to_f16(a->src[g]);
        else
            ((float *)head)[i % r.hd] = a->src[g];
    }
}
CU_KERNEL(kv_store, kv_store_args)

CU_INTERNAL int cuda_kv_store(op_backend *be, const op_tensor *src, op_tensor *const *dst, const int32_t *seq,
                              const int32_t *pos) {
    cuda_backend *cb = cuda_be(be);
    if (!cuda_f32_contig(src)) return fu_errorf(FU_ERR_INVALID, "kv_store: src must be contiguous f32");
    int rc = cuda_mem_check(cb, "kv_store", src, NULL, NULL);
    if (rc) return rc;
    const int64_t nt = src->ne[1] * src->ne[2] * src->ne[3], cols = src->ne[0];
    if (nt == 0 || cols == 0) return FU_OK;
    kv_row *rows = (kv_row *)cuda_meta_host(cb, (size_t)nt * sizeof(kv_row));
    if (!rows) return FU_ERR_NOMEM;
    for (int64_t t = 0; t < nt; t++) {
        if (seq[t] < 0) return fu_errorf(FU_ERR_RANGE, "kv_store: negative sequence %d", seq[t]);
        const op_tensor *d = dst[seq[t]];
        op_kv_layout kl;
        if ((rc = op_kv_layout_of(d, cols, seq[t], &kl)) ||
            ((t == 0 || seq[t - 1] != seq[t]) && (rc = cuda_mem_check(cb, "kv_store", d, NULL, NULL))))
            return rc;
        size_t es = d->type == OP_TYPE_F16 ? 2 : 4;
        if (kl.pos_stride % es || kl.head_stride % es || (uintptr_t)d->data % es)
            return fu_errorf(FU_ERR_INVALID, "kv_store: cache %d is not aligned to its elements", seq[t]);
        if (pos[t] < 0 || pos[t] >= kl.len)
            return fu_errorf(FU_ERR_RANGE, "kv_store: position %d outside cache of %lld", pos[t],
                             (long long)kl.len);
        rows[t].row = (uint8_t *)d->data + (size_t)pos[t] * kl.pos_stride;
        rows[t].head_stride = kl.head_stride;
        rows[t].hd = kl.hd;
        rows[t].f16 = d->type == OP_TYPE_F16;
        rows[t].pad = 0;
    }
    if ((rc = cu_rt_enter(cb))) return rc;
    kv_store_args a;
    void *dev;
    if ((rc = cuda_meta_upload(cb, (size_t)nt * sizeof(kv_row), &dev))) return rc;
    a.src = (const float *)src->data;
    a.rows = (const kv_row *)dev;
    a.nt = nt;
    a.cols = cols;
    return CU_LAUNCH(cb, kv_store, cu_dim(cu_blocks_for(nt * cols, 256), 1, 1), cu_dim(256, 1, 1), 0, a);
}
