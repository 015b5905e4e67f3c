/* get-rows.cu -- out (T, D) f32 = dequantized rows ids[t] of a table: one thread per output element. */
#include "get-rows.cuh"

typedef struct get_rows_args {
    const uint8_t *table;   /* (V, D) rows of row_bytes */
    size_t row_bytes;
    const float *row_scale; /* (V) device, I8 only */
    const int32_t *ids;     /* (T) device */
    float *out;             /* (T, D) */
    int64_t nt, d;
    int type;
} get_rows_args;

CU_DEV void get_rows_body(const cu_ctx *c, const get_rows_args *a) {
    const int64_t n = a->nt * a->d;
    for (int64_t g = cu_gid(c); g < n; g += cu_gstride(c)) {
        const int64_t t = g / a->d, i = g % a->d, id = a->ids[t];
        float v = cu_dequant(a->type, a->table + (size_t)id * a->row_bytes, i);
        a->out[g] = a->type == OP_TYPE_I8 ? a->row_scale[id] * v : v;
    }
}
CU_KERNEL(get_rows, get_rows_args)

CU_INTERNAL int cuda_get_rows(op_backend *be, const op_tensor *table, const int32_t *ids, op_tensor *out) {
    cuda_backend *cb = cuda_be(be);
    if (!cuda_supports_type(table->type) || !cuda_rows_ok(table) || !cuda_f32_contig(out) ||
        table->nb[1] % cuda_type_align(table->type) || (uintptr_t)table->data % cuda_type_align(table->type))
        return fu_errorf(FU_ERR_INVALID, "get_rows: bad table type or layout");
    if (op_type_block_elems(table->type) > 1 && table->ne[0] % OP_QK)
        return fu_errorf(FU_ERR_INVALID, "get_rows: row length not a multiple of %d", OP_QK);
    if (table->type == OP_TYPE_I8 && !table->row_scale)
        return fu_errorf(FU_ERR_INVALID, "get_rows: i8 table needs row scales");
    const int64_t d = table->ne[0], nt = out->ne[1] * out->ne[2] * out->ne[3];
    int rc;
    if ((rc = cuda_mem_check(cb, "get_rows", table, out, NULL)) || (rc = cu_rt_enter(cb)) || nt == 0 || d == 0)
        return rc;
    int32_t *h = (int32_t *)cuda_meta_host(cb, (size_t)nt * sizeof(int32_t));
    if (!h) return FU_ERR_NOMEM;
    memcpy(h, ids, (size_t)nt * sizeof(int32_t));
    void *dev;
    if ((rc = cuda_meta_upload(cb, (size_t)nt * sizeof(int32_t), &dev))) return rc;
    get_rows_args a;
    a.table = (const uint8_t *)table->data;
    a.row_bytes = table->nb[1];
    a.row_scale = table->row_scale;
    a.ids = (const int32_t *)dev;
    a.out = (float *)out->data;
    a.nt = nt;
    a.d = d;
    a.type = (int)table->type;
    return CU_LAUNCH(cb, get_rows, cu_dim(cu_blocks_for(nt * d, 256), 1, 1), cu_dim(256, 1, 1), 0, a);
}
