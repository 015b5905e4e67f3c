/* elementwise.cu -- swiglu, add and add_row: one thread per element, grid-stride. */
#include "elementwise.cuh"

typedef enum ew_kind {
    EW_SWIGLU = 0, /* out = silu(a) * b */
    EW_ADD,        /* out = a + b */
    EW_ADD_ROW,    /* out = a + b[i % d] */
} ew_kind;

typedef struct ew_args {
    float *out;     /* (n) */
    const float *a; /* (n) */
    const float *b; /* (n), or (d) for EW_ADD_ROW */
    int64_t n, d;
    int kind;
} ew_args;

CU_DEV void ew_body(const cu_ctx *c, const ew_args *a) {
    for (int64_t i = cu_gid(c); i < a->n; i += cu_gstride(c)) {
        float x = a->a[i];
        switch (a->kind) {
        case EW_SWIGLU:
            a->out[i] = x / (1.0f + expf(-x)) * a->b[i];
            break;
        case EW_ADD:
            a->out[i] = x + a->b[i];
            break;
        default:
            a->out[i] = x + a->b[i % a->d];
            break;
        }
    }
}
CU_KERNEL(ew, ew_args)

static int ew_run(op_backend *be, ew_kind kind, float *out, const float *x, const float *y, int64_t n,
                  int64_t d) {
    cuda_backend *cb = cuda_be(be);
    int rc = cu_rt_enter(cb);
    if (rc || n == 0) return rc;
    ew_args a;
    a.out = out;
    a.a = x;
    a.b = y;
    a.n = n;
    a.d = d;
    a.kind = (int)kind;
    return CU_LAUNCH(cb, ew, cu_dim(cu_blocks_for(n, 256), 1, 1), cu_dim(256, 1, 1), 0, a);
}

CU_INTERNAL int cuda_swiglu(op_backend *be, const op_tensor *gate, const op_tensor *up, op_tensor *out) {
    if (!cuda_f32_contig(gate) || !cuda_f32_contig(up) || !cuda_f32_contig(out))
        return fu_errorf(FU_ERR_INVALID, "swiglu: tensors must be contiguous f32");
    int rc = cuda_mem_check(cuda_be(be), "swiglu", gate, up, out);
    if (rc) return rc;
    return ew_run(be, EW_SWIGLU, (float *)out->data, (const float *)gate->data, (const float *)up->data,
                  op_tensor_nelems(gate), 1);
}

CU_INTERNAL int cuda_add(op_backend *be, op_tensor *x, const op_tensor *y) {
    if (!cuda_f32_contig(x) || !cuda_f32_contig(y))
        return fu_errorf(FU_ERR_INVALID, "add: tensors must be contiguous f32");
    int rc = cuda_mem_check(cuda_be(be), "add", x, y, NULL);
    if (rc) return rc;
    return ew_run(be, EW_ADD, (float *)x->data, (const float *)x->data, (const float *)y->data,
                  op_tensor_nelems(x), 1);
}

CU_INTERNAL int cuda_add_row(op_backend *be, op_tensor *x, const op_tensor *b) {
    if (!cuda_f32_contig(x) || !cuda_f32_contig(b))
        return fu_errorf(FU_ERR_INVALID, "add_row: tensors must be contiguous f32");
    int rc = cuda_mem_check(cuda_be(be), "add_row", x, b, NULL);
    if (rc) return rc;
    if (x->ne[0] == 0) return FU_OK;
    return ew_run(be, EW_ADD_ROW, (float *)x->data, (const float *)x->data, (const float *)b->data,
                  op_tensor_nelems(x), x->ne[0]);
}
