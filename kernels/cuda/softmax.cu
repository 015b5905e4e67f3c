/* softmax.cu -- in-place (log-)softmax: one block per row, block-wide max then sum. */
#include "softmax.cuh"

typedef struct softmax_args {
    float *x; /* (rows, d), in place */
    int64_t rows, d;
    int log; /* 1: log-softmax */
} softmax_args;

/* softmax: x = exp(x - max) / sum; log: x = x - (max + log(sum)). A row of
 * all -inf uses max = 0 (softmax gives NaN, as the CPU reference). */
CU_DEV void softmax_body(const cu_ctx *c, const softmax_args *a) {
    float *red = (float *)c->smem;
    for (int64_t r = cu_block(c); r < a->rows; r += (int64_t)c->grid_dim.x * c->grid_dim.y) {
        float *x = a->x + r * a->d;
        float mx = -INFINITY;
        for (int64_t i = cu_tid(c); i < a->d; i += c->block_dim.x) mx = fmaxf(mx, x[i]);
        mx = cu_block_reduce(c, mx, red, 1);
        if (mx == -INFINITY) mx = 0.0f;
        float sum = 0.0f;
        for (int64_t i = cu_tid(c); i < a->d; i += c->block_dim.x) sum += expf(x[i] - mx);
        sum = cu_block_reduce(c, sum, red, 0);
        if (a->log) {
            float lse = mx + logf(sum);
            for (int64_t i = cu_tid(c); i < a->d; i += c->block_dim.x) x[i] -= lse;
        } else {
            float inv = 1.0f / sum;
            for (int64_t i = cu_tid(c); i < a->d; i += c->block_dim.x) x[i] = expf(x[i] - mx) * inv;
        }
    }
}
CU_KERNEL_SYNC(softmax, softmax_args)

static int softmax_run(op_backend *be, op_tensor *x, int log) {
    cuda_backend *cb = cuda_be(be);
    if (!cuda_f32_contig(x)) return fu_errorf(FU_ERR_INVALID, "softmax: x must be contiguous f32");
    int rc;
    if ((rc = cuda_mem_check(cb, "softmax", x, NULL, NULL)) || (rc = cu_rt_enter(cb)) || x->ne[0] == 0) return rc;
    softmax_args a;
    a.x = (float *)x->data;
    a.d = x->ne[0];
    a.rows = op_tensor_nelems(x) / a.d;
    a.log = log;
    if (a.rows == 0) return FU_OK;
    int64_t t = (a.d + 31) / 32 * 32;
    unsigned threads = t > 256 ? 256u : (unsigned)t;
    return CU_LAUNCH(cb, softmax, cu_dim(cu_blocks_for(a.rows, 1), 1, 1), cu_dim(threads, 1, 1),
                     32 * sizeof(float), a);
}

CU_INTERNAL int cuda_softmax(op_backend *be, op_tensor *x) { return softmax_run(be, x, 0); }

CU_INTERNAL int cuda_log_softmax(op_backend *be, op_tensor *x) { return softmax_run(be, x, 1); }
