/* rmsnorm.cu -- y = x / sqrt(mean(x^2) + eps) * w: one block per row, block-wide sum. */
#include "rmsnorm.cuh"

typedef struct rmsnorm_args {
    const float *x; /* (rows, d) */
    const float *w; /* (d) or NULL */
    float *y;       /* (rows, d), may alias x */
    int64_t rows, d;
    float eps;
} rmsnorm_args;

/* Shared memory: (32) floats for the reduction. Each thread reads and writes
 * only its own elements after the reduction, so y may alias x. */
CU_DEV void rmsnorm_body(const cu_ctx *c, const rmsnorm_args *a) {
    float *red = (float *)c->smem;
    for (int64_t r = cu_block(c); r < a->rows; r += (int64_t)c->grid_dim.x * c->grid_dim.y) {
        const float *x = a->x + r * a->d;
        float *y = a->y + r * a->d;
        float ss = 0.0f;
        for (int64_t i = cu_tid(c); i < a->d; i += c->block_dim.x) ss += x[i] * x[i];
        ss = cu_block_reduce(c, ss, red, 0);
        float inv = 1.0f / sqrtf(ss / (float)a->d + a->eps);
        for (int64_t i = cu_tid(c); i < a->d; i += c->block_dim.x)
            y[i] = a->w ? x[i] * inv * a->w[i] : x[i] * inv;
    }
}
CU_KERNEL_SYNC(rmsnorm, rmsnorm_args)

/* Threads per block for rows of d: a multiple of 32, at most 256. */
static unsigned rmsnorm_threads(int64_t d) {
    int64_t t = (d + 31) / 32 * 32;
    return t < 32 ? 32u : t > 256 ? 256u : (unsigned)t;
}

CU_INTERNAL int cuda_rmsnorm(op_backend *be, const op_tensor *x, const op_tensor *w, float eps, op_tensor *y) {
    cuda_backend *cb = cuda_be(be);
    if (!cuda_f32_contig(x) || !cuda_f32_contig(y) || (w && !cuda_f32_contig(w)))
        return fu_errorf(FU_ERR_INVALID, "rmsnorm: tensors must be contiguous f32");
    int rc;
    if ((rc = cuda_mem_check(cb, "rmsnorm", x, w, y)) || (rc = cu_rt_enter(cb)) || x->ne[0] == 0) return rc;
    rmsnorm_args a;
    a.x = (const float *)x->data;
    a.w = w ? (const float *)w->data : NULL;
    a.y = (float *)y->data;
    a.d = x->ne[0];
    a.rows = op_tensor_nelems(x) / a.d;
    a.eps = eps;
    if (a.rows == 0) return FU_OK;
    return CU_LAUNCH(cb, rmsnorm, cu_dim(cu_blocks_for(a.rows, 1), 1, 1), cu_dim(rmsnorm_threads(a.d), 1, 1),
                     32 * sizeof(float), a);
}
