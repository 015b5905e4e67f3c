/* train.cu -- add_rows and the training (backward) ops: the CUDA backend's side of LoRA fine-tuning.
 *
 * Kernels, each with the math of the CPU reference (kernels/cpu/cpu-train.c)
 * in f32 unless said otherwise:
 *   - add_rows, swiglu_back, dropout: one thread per element, grid-stride;
 *   - matmul_back and outer_acc: one small GEMM kernel, C = beta C + alpha A B
 *     with A f32 read through strides (dy or dy^T) and B rows of any weight
 *     type dequantized element by element as they are read (W, or x); a
 *     block per tile of 32 columns of C and 64 rows, a warp per 8 of them,
 *     or, when those tiles are too few to fill the GPU (small T), 8 rows and
 *     the 8 warps splitting the inner dimension;
 *   - rmsnorm_back, cross_entropy: one block per row with block reductions;
 *   - attention_back: two warp-per-task kernels without atomics: one warp per
 *     (query row, head) recomputes the softmax over its example's rows, writes
 *     dq and keeps the softmax statistics; then one warp per (key row, KV
 *     head) sums dk and dv over the later query rows of its example and the
 *     query heads of its group.
 */
#include "train.cuh"

#include "matmul.cuh"

#define OP_DROPOUT_QUAL CU_HD
#include "dropout-hash.h"

/* ---- add_rows ------------------------------------------------------------------------------ */

typedef struct tr_add_rows_args {
    float *x;              /* (R, d) */
    const float *y;        /* (n, d) */
    const int32_t *rows;   /* (n) device, distinct, in [0, R) */
    int64_t n, d;
    float scale;
} tr_add_rows_args;

/* x[rows[i]] += scale * y[i], element by element. */
CU_DEV void tr_add_rows_body(const cu_ctx *c, const tr_add_rows_args *a) {
    for (int64_t g = cu_gid(c); g < a->n * a->d; g += cu_gstride(c))
        a->x[(int64_t)a->rows[g / a->d] * a->d + g % a->d] += a->scale * a->y[g];
}
CU_KERNEL(tr_add_rows, tr_add_rows_args)

/* Copies n int32 of host memory to the device metadata; *dev gets their address. */
static int tr_upload_i32(cuda_backend *cb, const int32_t *host, int64_t n, const int32_t **dev) {
    int32_t *h = (int32_t *)cuda_meta_host(cb, (size_t)n * sizeof(int32_t));
    if (!h) return FU_ERR_NOMEM;
    memcpy(h, host, (size_t)n * sizeof(int32_t));
    void *d;
    int rc = cuda_meta_upload(cb, (size_t)n * sizeof(int32_t), &d);
    *dev = (const int32_t *)d;
    return rc;
}

/* FU_ERR_INVALID naming op unless each of the n tensors (NULL ones skipped) is
 * contiguous, aligned f32 in this backend's memory; then makes the device
 * current (cu_rt_enter). */
static int tr_check_f32(cuda_backend *cb, const char *op, int n, const op_tensor *const *t) {
    for (int i = 0; i < n; i++) {
        if (!t[i]) continue;
        if (!cuda_f32_contig(t[i]))
            return fu_errorf(FU_ERR_INVALID, "%s: %s must be contiguous, aligned f32", op,
                             t[i]->name ? t[i]->name : "every activation");
        int rc = cuda_mem_check(cb, op, t[i], NULL, NULL);
        if (rc) return rc;
    }
    return cu_rt_enter(cb);
}

CU_INTERNAL int cuda_add_rows(op_backend *be, op_tensor *x, const int32_t *rows, const op_tensor *y, float scale) {
    cuda_backend *cb = cuda_be(be);
    const int64_t n = y->ne[1] * y->ne[2] * y->ne[3], d = x->ne[0];
    if (n == 0 || d == 0) return FU_OK; /* also the probe of op_add_rows */
    const op_tensor *ts[] = {x, y};
    int rc = tr_check_f32(cb, "add_rows", 2, ts);
    tr_add_rows_args a;
    if (rc || (rc = tr_upload_i32(cb, rows, n, &a.rows))) return rc;
    a.x = (float *)x->data;
    a.y = (const float *)y->data;
    a.n = n;
    a.d = d;
    a.scale = scale;
    return CU_LAUNCH(cb, tr_add_rows, cu_dim(cu_blocks_for(n * d, 256), 1, 1), cu_dim(256, 1, 1), 0, a);
}

/* ---- matmul gradients ------------------------------------------------------------------------ */

#define TR_MM_ROWS 8      /* rows of C per warp */
#define TR_MM_COLS 32     /* columns of a tile of C: one per lane */
#define TR_MM_WARPS 8     /* warps per block */
#define TR_MM_MIN_TILES 256 /* fewer tiles of TR_MM_WARPS x TR_MM_ROWS rows (about 2 per SM of a
                                large GPU) and the warps split the inner dimension instead */
#if TR_MM_WARPS != TR_MM_ROWS
#error "tr_mm_body: warp w finishes row w of a split tile"
#endif

typedef struct tr_mm_args {
    const float *a;         /* A (M, J): A(m, j) at a[m * a_sm + j * a_sj] */
    int64_t a_sm, a_sj;
    const uint8_t *b;       /* B (J, K): rows of b_stride bytes of the kernel's type */
    size_t b_stride;
    const float *row_scale; /* (J), I8 only */
    float *c;               /* C (M, K) contiguous */
    int64_t m, j, k;
    float alpha, beta;      /* beta 0: C is not read */
    int split;              /* 1: a warp per TR_MM_ROWS rows; TR_MM_WARPS: the warps split j */
} tr_mm_args;

/* C (m0 + i, k) = beta * C + alpha * sum[i] for i < nm, k < K. */
CU_DEV void tr_mm_store(const tr_mm_args *a, int64_t m0, int nm, int64_t k, const float *sum) {
    for (int i = 0; i < nm && k < a->k; i++) {
        float *cp = a->c + (m0 + i) * a->k + k;
        *cp = a->beta != 0.0f ? *cp + a->alpha * sum[i] : a->alpha * sum[i];
    }
}

/* C (M, K) = beta * C + alpha * A (M, J) @ B (J, K), a block per tile of
 * TR_MM_COLS columns (grid-stride over tiles), lane l on column k0 + l, so
 * that the lanes read consecutive elements of a row of B and the same element
 * of A, summing in f32 in order of j. split 1: a tile of TR_MM_WARPS x
 * TR_MM_ROWS rows, warp w's own TR_MM_ROWS over every j (the warps share
 * their rows of B through the cache). split TR_MM_WARPS: a tile of TR_MM_ROWS
 * rows, warp w over j = w, w + TR_MM_WARPS, ..., then warp w adds up row w's
 * partial sums in warp order. `type` is a constant in each kernel below, so
 * the dequantization switch folds away. Shared memory (split only):
 * TR_MM_WARPS x TR_MM_ROWS x TR_MM_COLS floats of partial sums. */
CU_DEV void tr_mm_body(const cu_ctx *c, const tr_mm_args *a, int type) {
    float *part = (float *)c->smem;
    const int lane = (int)cu_lane(c), w = (int)cu_warp_id(c), split = a->split;
    const int64_t rows = split == 1 ? TR_MM_WARPS * TR_MM_ROWS : TR_MM_ROWS;
    const int64_t col_tiles = (a->k + TR_MM_COLS - 1) / TR_MM_COLS, tiles = col_tiles * ((a->m + rows - 1) / rows);
    for (int64_t tile = cu_block(c); tile < tiles; tile += (int64_t)c->grid_dim.x * c->grid_dim.y) {
        const int64_t k = tile % col_tiles * TR_MM_COLS + lane;
        const int64_t m0 = tile / col_tiles * rows + (split == 1 ? w * TR_MM_ROWS : 0);
        const int nm = a->m - m0 < TR_MM_ROWS ? (int)(a->m - m0) : TR_MM_ROWS; /* <= 0: no rows */
        float acc[TR_MM_ROWS];
        for (int i = 0; i < TR_MM_ROWS; i++) acc[i] = 0.0f;
        for (int64_t j = split == 1 ? 0 : w; nm > 0 && k < a->k && j < a->j; j += split) {
            float bv = cu_dequant(type, a->b + (size_t)j * a->b_stride, k);
            if (type == OP_TYPE_I8) bv *= a->row_scale[j];
            const float *ap = a->a + m0 * a->a_sm + j * a->a_sj;
            for (int i = 0; i < TR_MM_ROWS; i++)
                if (i < nm) acc[i] += ap[i * a->a_sm] * bv;
        }
        if (split == 1) {
            tr_mm_store(a, m0, nm, k, acc);
            continue; /* split is the same for the whole grid: no barriers on this path */
        }
        for (int i = 0; i < TR_MM_ROWS; i++) part[(w * TR_MM_ROWS + i) * TR_MM_COLS + lane] = acc[i];
        cu_syncthreads(c);
        float sum = 0.0f;
        for (int p = 0; p < TR_MM_WARPS; p++) sum += part[(p * TR_MM_ROWS + w) * TR_MM_COLS + lane];
        if (w < nm) tr_mm_store(a, m0 + w, 1, k, &sum);
        cu_syncthreads(c); /* part is rewritten by the next tile */
    }
}

CU_WEIGHT_KERNELS(tr_mm, tr_mm_args, CU_KERNEL_SYNC)

/* Launches the GEMM kernel of B's type over a's C, the inner dimension split
 * over the warps when C has too few tiles of whole warps' rows to fill the
 * GPU (small T, or few columns); nothing when C is empty. */
static int tr_mm_run(cuda_backend *cb, op_type type, tr_mm_args *a) {
    if (a->m == 0 || a->k == 0) return FU_OK;
    const int64_t col_tiles = (a->k + TR_MM_COLS - 1) / TR_MM_COLS, big = TR_MM_WARPS * TR_MM_ROWS;
    a->split = (a->m + big - 1) / big * col_tiles >= TR_MM_MIN_TILES ? 1 : TR_MM_WARPS;
    const int64_t rows = a->split == 1 ? big : TR_MM_ROWS, tiles = (a->m + rows - 1) / rows * col_tiles;
    return tr_mm_launch(cb, type, cu_dim(cu_blocks_for(tiles, 1), 1, 1), cu_dim(TR_MM_WARPS * CU_WARP, 1, 1),
                        (size_t)(TR_MM_WARPS * TR_MM_ROWS * TR_MM_COLS) * sizeof(float), a);
}

/* dx (T, K) = beta * dx + dy (T, N) @ W (N, K): A = dy, B = W. */
CU_INTERNAL int cuda_matmul_back(op_backend *be, const op_tensor *w, const op_tensor *dy, op_tensor *dx,
                                 float beta) {
    cuda_backend *cb = cuda_be(be);
    const op_tensor *ts[] = {dy, dx};
    int rc = cuda_weight_check(cb, "matmul_back", w);
    if (rc || (rc = tr_check_f32(cb, "matmul_back", 2, ts))) return rc;
    tr_mm_args a;
    a.j = w->ne[1];
    a.k = w->ne[0];
    a.m = a.k ? op_tensor_nelems(dx) / a.k : 0;
    a.a = (const float *)dy->data;
    a.a_sm = a.j;
    a.a_sj = 1;
    a.b = (const uint8_t *)w->data;
    a.b_stride = w->nb[1];
    a.row_scale = w->type == OP_TYPE_I8 ? w->row_scale : NULL;
    a.c = (float *)dx->data;
    a.alpha = 1.0f;
    a.beta = beta;
    return tr_mm_run(cb, w->type, &a);
}

/* dw (N, K) += alpha * dy (T, N)^T @ x (T, K): A(n, t) = dy[t * N + n], B = x. */
CU_INTERNAL int cuda_outer_acc(op_backend *be, op_tensor *dw, const op_tensor *dy, const op_tensor *x,
                               float alpha) {
    cuda_backend *cb = cuda_be(be);
    const op_tensor *ts[] = {dw, dy, x};
    int rc = tr_check_f32(cb, "outer_acc", 3, ts);
    if (rc) return rc;
    tr_mm_args a;
    a.m = dw->ne[1];
    a.k = dw->ne[0];
    a.j = a.k ? op_tensor_nelems(x) / a.k : 0;
    if (a.j == 0) return FU_OK; /* nothing to add */
    a.a = (const float *)dy->data;
    a.a_sm = 1;
    a.a_sj = a.m;
    a.b = (const uint8_t *)x->data;
    a.b_stride = (size_t)a.k * sizeof(float);
    a.row_scale = NULL;
    a.c = (float *)dw->data;
    a.alpha = alpha;
    a.beta = 1.0f;
    return tr_mm_run(cb, OP_TYPE_F32, &a);
}

/* ---- rmsnorm_back ------------------------------------------------------------------------------ */

typedef struct tr_rms_back_args {
    const float *x, *w, *dy; /* (rows, d), (d) or NULL, (rows, d) */
    float *dx;               /* (rows, d) */
    int64_t rows, d;
    float eps, beta;
} tr_rms_back_args;

/* Threads per block for rows of d: a multiple of 32, at most 256. */
static unsigned tr_row_threads(int64_t d) {
    int64_t t = (d + 31) / 32 * 32;
    return t < 32 ? 32u : t > 256 ? 256u : (unsigned)t;
}

/* One block per row: inv = 1 / sqrt(mean(x^2) + eps) as the forward, s =
 * sum(dy * w * x); dx = beta * dx + inv * dy * w - x * inv^3 s / d.
 * Shared memory: (32) floats for the reductions. */
CU_DEV void tr_rms_back_body(const cu_ctx *c, const tr_rms_back_args *a) {
    float *red = (float *)c->smem;
    for (int64_t r = cu_block(c); r < a->rows; r += (int64_t)c->grid_dim.x * c->grid_dim.y) {
        const float *x = a->x + r * a->d, *dy = a->dy + r * a->d;
        float *dx = a->dx + r * a->d;
        float ss = 0.0f, s = 0.0f;
        for (int64_t i = cu_tid(c); i < a->d; i += c->block_dim.x) {
            ss += x[i] * x[i];
            s += dy[i] * (a->w ? a->w[i] : 1.0f) * x[i];
        }
        ss = cu_block_reduce(c, ss, red, 0);
        s = cu_block_reduce(c, s, red, 0);
        const float inv = 1.0f / sqrtf(ss / (float)a->d + a->eps), k = inv * inv * inv * s / (float)a->d;
        for (int64_t i = cu_tid(c); i < a->d; i += c->block_dim.x) {
            const float v = inv * dy[i] * (a->w ? a->w[i] : 1.0f) - x[i] * k;
            dx[i] = a->beta != 0.0f ? dx[i] + v : v;
        }
    }
}
CU_KERNEL_SYNC(tr_rms_back, tr_rms_back_args)

CU_INTERNAL int cuda_rmsnorm_back(op_backend *be, const op_tensor *x, const op_tensor *w, float eps,
                                  const op_tensor *dy, op_tensor *dx, float beta) {
    cuda_backend *cb = cuda_be(be);
    const op_tensor *ts[] = {x, w, dy, dx};
    int rc = tr_check_f32(cb, "rmsnorm_back", 4, ts);
    if (rc || x->ne[0] == 0) return rc;
    tr_rms_back_args a;
    a.x = (const float *)x->data;
    a.w = w ? (const float *)w->data : NULL;
    a.dy = (const float *)dy->data;
    a.dx = (float *)dx->data;
    a.d = x->ne[0];
    a.rows = op_tensor_nelems(x) / a.d;
    a.eps = eps;
    a.beta = beta;
    if (a.rows == 0) return FU_OK;
    return CU_LAUNCH(cb, tr_rms_back, cu_dim(cu_blocks_for(a.rows, 1), 1, 1), cu_dim(tr_row_threads(a.d), 1, 1),
                     32 * sizeof(float), a);
}

/* ---- swiglu_back and dropout: element-wise -------------------------------------------------------- */

typedef struct tr_swiglu_back_args {
    const float *g, *u, *dout; /* (n) */
    float *dg, *du;            /* (n); dg may be dout */
    int64_t n;
} tr_swiglu_back_args;

/* sig = sigmoid(g): dg = dout * u * sig * (1 + g * (1 - sig)), du = dout * g * sig. */
CU_DEV void tr_swiglu_back_body(const cu_ctx *c, const tr_swiglu_back_args *a) {
    for (int64_t i = cu_gid(c); i < a->n; i += cu_gstride(c)) {
        const float g = a->g[i], d = a->dout[i], sig = 1.0f / (1.0f + expf(-g));
        a->dg[i] = d * a->u[i] * sig * (1.0f + g * (1.0f - sig));
        a->du[i] = d * g * sig;
    }
}
CU_KERNEL(tr_swiglu_back, tr_swiglu_back_args)

CU_INTERNAL int cuda_swiglu_back(op_backend *be, const op_tensor *gate, const op_tensor *up,
                                 const op_tensor *dout, op_tensor *dgate, op_tensor *dup) {
    cuda_backend *cb = cuda_be(be);
    const op_tensor *ts[] = {gate, up, dout, dgate, dup};
    int rc = tr_check_f32(cb, "swiglu_back", 5, ts);
    tr_swiglu_back_args a;
    a.n = op_tensor_nelems(gate);
    if (rc || a.n == 0) return rc;
    a.g = (const float *)gate->data;
    a.u = (const float *)up->data;
    a.dout = (const float *)dout->data;
    a.dg = (float *)dgate->data;
    a.du = (float *)dup->data;
    return CU_LAUNCH(cb, tr_swiglu_back, cu_dim(cu_blocks_for(a.n, 256), 1, 1), cu_dim(256, 1, 1), 0, a);
}

typedef struct tr_dropout_args {
    float *x;      /* (rows, n) in place */
    int64_t n, row0, total;
    uint64_t seed;
    float p, keep; /* keep = 1 / (1 - p) in f32 */
} tr_dropout_args;

/* Element (r, c) kept (times keep) when op_dropout_u(seed, row0 + r, c) >= p, else 0. */
CU_DEV void tr_dropout_body(const cu_ctx *c, const tr_dropout_args *a) {
    for (int64_t i = cu_gid(c); i < a->total; i += cu_gstride(c)) {
        const float u = op_dropout_u(a->seed, (uint64_t)(a->row0 + i / a->n), (uint64_t)(i % a->n));
        a->x[i] = u >= a->p ? a->x[i] * a->keep : 0.0f;
    }
}
CU_KERNEL(tr_dropout, tr_dropout_args)

CU_INTERNAL int cuda_dropout(op_backend *be, op_tensor *x, float p, uint64_t seed, int64_t row0) {
    cuda_backend *cb = cuda_be(be);
    const op_tensor *t = x;
    int rc = tr_check_f32(cb, "dropout", 1, &t);
    tr_dropout_args a;
    a.total = op_tensor_nelems(x);
    if (rc || a.total == 0) return rc;
    a.x = (float *)x->data;
    a.n = x->ne[0];
    a.row0 = row0;
    a.seed = seed;
    a.p = p;
    a.keep = 1.0f / (1.0f - p);
    return CU_LAUNCH(cb, tr_dropout, cu_dim(cu_blocks_for(a.total, 256), 1, 1), cu_dim(256, 1, 1), 0, a);
}

/* ---- cross_entropy ------------------------------------------------------------------------------- */

#define TR_XENT_MAX_V (1 << 24) /* row indices pass through float reductions exactly below this */

typedef struct tr_xent_args {
    float *x;              /* (rows, v) logits in, gradient out */
    const int32_t *target; /* (rows) device */
    float *loss;           /* (rows) device */
    uint8_t *correct;      /* (rows) device */
    int64_t rows, v;
    float weight;
} tr_xent_args;

/* Row r with target tg >= 0: mx = the largest logit, am its first index;
 * e_i = exp(x_i - mx) (kept in x), rest = sum of e_i over i != tg, sum =
 * rest + e_tg; loss = mx + log(sum) - x_tg (in double), correct = am == tg;
 * x_i = weight * e_i / sum, x_tg = -weight * rest / sum (no cancellation).
 * Every thread reads x_tg before the first barrier, so before any write. */
CU_DEV void tr_xent_row(const cu_ctx *c, const tr_xent_args *a, int64_t r, float *red) {
    float *x = a->x + r * a->v;
    const int32_t tg = a->target[r];
    const unsigned nt = c->block_dim.x;
    if (tg < 0) {
        for (int64_t i = cu_tid(c); i < a->v; i += nt) x[i] = 0.0f;
        if (cu_tid(c) == 0) {
            a->loss[r] = 0.0f;
            a->correct[r] = 0;
        }
        return; /* the whole block leaves this row */
    }
    const float xt = x[tg];
    float mx = -INFINITY;
    for (int64_t i = cu_tid(c); i < a->v; i += nt) mx = fmaxf(mx, x[i]);
    mx = cu_block_reduce(c, mx, red, 1);
    float am = -(float)a->v; /* -(first index of mx), as a max */
    for (int64_t i = cu_tid(c); i < a->v; i += nt)
        if (x[i] == mx) am = fmaxf(am, -(float)i);
    am = -cu_block_reduce(c, am, red, 1);
    float rest = 0.0f;
    for (int64_t i = cu_tid(c); i < a->v; i += nt) {
        const float e = expf(x[i] - mx);
        x[i] = e;
        if (i != tg) rest += e;
    }
    rest = cu_block_reduce(c, rest, red, 0);
    const float sum = rest + expf(xt - mx), f = a->weight / sum;
    for (int64_t i = cu_tid(c); i < a->v; i += nt) x[i] = i == tg ? -a->weight * rest / sum : x[i] * f;
    if (cu_tid(c) == 0) {
        a->loss[r] = (float)((double)mx + log((double)sum) - (double)xt);
        a->correct[r] = am == (float)tg;
    }
}

/* One block per row. Shared memory: (32) floats for the reductions. */
CU_DEV void tr_xent_body(const cu_ctx *c, const tr_xent_args *a) {
    for (int64_t r = cu_block(c); r < a->rows; r += (int64_t)c->grid_dim.x * c->grid_dim.y)
        tr_xent_row(c, a, r, (float *)c->smem);
}
CU_KERNEL_SYNC(tr_xent, tr_xent_args)

/* The metadata: targets (R int32), then loss (R floats) and correct (R bytes)
 * written by the kernel, then read back to the host when asked for. */
CU_INTERNAL int cuda_cross_entropy(op_backend *be, op_tensor *logits, const int32_t *target, float weight,
                                   float *loss, uint8_t *correct) {
    cuda_backend *cb = cuda_be(be);
    const op_tensor *t = logits;
    int rc = tr_check_f32(cb, "cross_entropy", 1, &t);
    tr_xent_args a;
    a.v = logits->ne[0];
    if (rc || a.v == 0) return rc;
    if (a.v > TR_XENT_MAX_V)
        return fu_errorf(FU_ERR_UNSUPPORTED, "cross_entropy: %lld logits per row, above %d", (long long)a.v,
                         TR_XENT_MAX_V);
    a.rows = op_tensor_nelems(logits) / a.v;
    if (a.rows == 0) return FU_OK;
    const size_t o_loss = cuda_align16((size_t)a.rows * 4), o_corr = o_loss + cuda_align16((size_t)a.rows * 4);
    uint8_t *h = (uint8_t *)cuda_meta_host(cb, o_corr + (size_t)a.rows);
    if (!h) return FU_ERR_NOMEM;
    memcpy(h, target, (size_t)a.rows * sizeof(int32_t));
    void *dev;
    if ((rc = cuda_meta_upload(cb, o_corr + (size_t)a.rows, &dev))) return rc;
    a.x = (float *)logits->data;
    a.target = (const int32_t *)dev;
    a.loss = (float *)((uint8_t *)dev + o_loss);
    a.correct = (uint8_t *)dev + o_corr;
    a.weight = weight;
    rc = CU_LAUNCH(cb, tr_xent, cu_dim(cu_blocks_for(a.rows, 1), 1, 1), cu_dim(tr_row_threads(a.v), 1, 1),
                   32 * sizeof(float), a);
    if (!rc && loss) rc = cu_rt_download(cb, loss, a.loss, (size_t)a.rows * sizeof(float));
    if (!rc && correct) rc = cu_rt_download(cb, correct, a.correct, (size_t)a.rows);
    return rc;
}

/* ---- attention_back ------------------------------------------------------------------------------ */

#define TR_ATTN_WARPS 4 /* warps (tasks) per block */
#define TR_ATTN_DPL (CU_ATTN_MAX_HD / CU_WARP) /* head dimensions per lane, at most */

typedef struct tr_attn_args {
    const float *q, *k, *v, *out, *dout; /* (T, H, hd), (T, KVH, hd) x 2, (T, H, hd) x 2 */
    float *dq, *dk, *dv;                 /* (T, H, hd), (T, KVH, hd) x 2 */
    float *stats;                        /* (T, H, 3): softmax max, 1 / sum, dout . out */
    const int32_t *first, *end;          /* (T) device: token t's example is rows [first[t], end[t]) */
    int64_t ntasks;                      /* T * H (dq) or T * KVH (dk, dv) */
    int nh, nkv, hd;
    float scale;
} tr_attn_args;

/* x . y over hd elements, both readable by every lane (one lane's whole product). */
CU_DEV float tr_dot(const float *x, const float *y, int hd) {
    float s = 0.0f;
    for (int d = 0; d < hd; d++) s += x[d] * y[d];
    return s;
}

/* Softmax max *m and 1 / sum of query row qs (shared memory) over key rows
 * [s, t] of KV head g: lane j scores row j0 + j of each chunk of 32. */
CU_DEV float tr_attn_stats(const cu_ctx *c, const tr_attn_args *a, const float *qs, int64_t s, int64_t t, int g,
                           float *m) {
    const int lane = (int)cu_lane(c), hd = a->hd;
    float mx = -INFINITY, l = 0.0f;
    for (int64_t j0 = s; j0 <= t; j0 += CU_WARP) {
        const int64_t j = j0 + lane;
        const float sc = j <= t ? tr_dot(qs, a->k + (j * a->nkv + g) * hd, hd) * a->scale : -INFINITY;
        float cm = sc;
        cu_warp_max_n(c, &cm, 1);
        const float mn = fmaxf(mx, cm);
        l = l * expf(mx - mn) + (j <= t ? expf(sc - mn) : 0.0f); /* l is 0 on the first chunk */
        mx = mn;
    }
    cu_warp_sum_n(c, &l, 1);
    *m = mx;
    return 1.0f / l;
}

/* Task (t, h), one warp: P_u = softmax(scale q_t . k_u) over u in [first[t],
 * t], D = dout_t . out_t, dS_u = scale P_u (dout_t . v_u - D); dq_t = sum_u
 * dS_u k_u; stats (max, 1 / sum, D) kept for tr_attn_dkv. Shared memory:
 * TR_ATTN_WARPS x (2 hd + 32) floats: each warp's q, dout and dS. */
CU_DEV void tr_attn_dq_body(const cu_ctx *c, const tr_attn_args *a) {
    const int lane = (int)cu_lane(c), warp = (int)cu_warp_id(c), hd = a->hd;
    const int64_t task = cu_block(c) * TR_ATTN_WARPS + warp;
    if (task >= a->ntasks) return; /* the whole warp leaves; no block barriers below */
    const int64_t t = task / a->nh, s = a->first[t];
    const int g = (int)(task % a->nh) / (a->nh / a->nkv);
    float *qs = (float *)c->smem + warp * (2 * hd + CU_WARP), *ds = qs + hd, *ps = ds + hd;
    for (int d = lane; d < hd; d += CU_WARP) {
        qs[d] = a->q[task * hd + d];
        ds[d] = a->dout[task * hd + d];
    }
    cu_syncwarp(c);
    /* in the order of dout . v_u below, so that dS is exactly 0 where out_t is v_u */
    const float D = tr_dot(ds, a->out + task * hd, hd);
    float mx;
    const float il = tr_attn_stats(c, a, qs, s, t, g, &mx);
    float acc[TR_ATTN_DPL];
    for (int i = 0; i < TR_ATTN_DPL; i++) acc[i] = 0.0f;
    for (int64_t j0 = s; j0 <= t; j0 += CU_WARP) {
        const int64_t j = j0 + lane, cn = t - j0 + 1 < CU_WARP ? t - j0 + 1 : CU_WARP;
        float dsj = 0.0f;
        if (j <= t) {
            const int64_t kv = (j * a->nkv + g) * hd;
            const float p = expf(tr_dot(qs, a->k + kv, hd) * a->scale - mx) * il;
            dsj = a->scale * p * (tr_dot(ds, a->v + kv, hd) - D);
        }
        ps[lane] = dsj;
        cu_syncwarp(c);
        for (int i = 0; i < TR_ATTN_DPL && lane + CU_WARP * i < hd; i++)
            for (int jj = 0; jj < cn; jj++) acc[i] += ps[jj] * a->k[((j0 + jj) * a->nkv + g) * hd + lane + CU_WARP * i];
        cu_syncwarp(c); /* ps is rewritten by the next chunk */
    }
    for (int i = 0; i < TR_ATTN_DPL && lane + CU_WARP * i < hd; i++) a->dq[task * hd + lane + CU_WARP * i] = acc[i];
    if (lane == 0) {
        a->stats[task * 3] = mx;
        a->stats[task * 3 + 1] = il;
        a->stats[task * 3 + 2] = D;
    }
}
CU_KERNEL_SYNC(tr_attn_dq, tr_attn_args)

/* Task (u, g), one warp: over the pairs (t, h) of query rows t in [u,
 * end[u]) and heads h of group g, 32 at a time (lane j scores pair j), P and
 * dS as tr_attn_dq_body has them, from its stats; dk_u = sum dS q_t,h and
 * dv_u = sum P dout_t,h, overwritten. Shared memory: TR_ATTN_WARPS x (2 hd +
 * 64) floats: each warp's k_u, v_u, P and dS. */
CU_DEV void tr_attn_dkv_body(const cu_ctx *c, const tr_attn_args *a) {
    const int lane = (int)cu_lane(c), warp = (int)cu_warp_id(c), hd = a->hd, group = a->nh / a->nkv;
    const int64_t task = cu_block(c) * TR_ATTN_WARPS + warp;
    if (task >= a->ntasks) return; /* the whole warp leaves; no block barriers below */
    const int64_t u = task / a->nkv, npairs = (a->end[u] - u) * group;
    const int g = (int)(task % a->nkv);
    float *ks = (float *)c->smem + warp * (2 * hd + 2 * CU_WARP), *vs = ks + hd, *ps = vs + hd, *ds = ps + CU_WARP;
    for (int d = lane; d < hd; d += CU_WARP) {
        ks[d] = a->k[task * hd + d];
        vs[d] = a->v[task * hd + d];
    }
    cu_syncwarp(c);
    float dk[TR_ATTN_DPL], dv[TR_ATTN_DPL];
    for (int i = 0; i < TR_ATTN_DPL; i++) dk[i] = dv[i] = 0.0f;
    for (int64_t i0 = 0; i0 < npairs; i0 += CU_WARP) {
        const int64_t i = i0 + lane, cn = npairs - i0 < CU_WARP ? npairs - i0 : CU_WARP;
        float p = 0.0f, dsj = 0.0f;
        if (i < npairs) {
            const int64_t qh = (u + i / group) * a->nh + (int64_t)g * group + i % group; /* row t, head h */
            const float *st = a->stats + qh * 3;
            p = expf(tr_dot(a->q + qh * hd, ks, hd) * a->scale - st[0]) * st[1];
            dsj = a->scale * p * (tr_dot(a->dout + qh * hd, vs, hd) - st[2]);
        }
        ps[lane] = p;
        ds[lane] = dsj;
        cu_syncwarp(c);
        for (int64_t jj = 0; jj < cn; jj++) {
            const int64_t qh = (u + (i0 + jj) / group) * a->nh + (int64_t)g * group + (i0 + jj) % group;
            for (int e = 0; e < TR_ATTN_DPL && lane + CU_WARP * e < hd; e++) {
                dk[e] += ds[jj] * a->q[qh * hd + lane + CU_WARP * e];
                dv[e] += ps[jj] * a->dout[qh * hd + lane + CU_WARP * e];
            }
        }
        cu_syncwarp(c); /* ps and ds are rewritten by the next chunk */
    }
    for (int e = 0; e < TR_ATTN_DPL && lane + CU_WARP * e < hd; e++) {
        a->dk[task * hd + lane + CU_WARP * e] = dk[e];
        a->dv[task * hd + lane + CU_WARP * e] = dv[e];
    }
}
CU_KERNEL_SYNC(tr_attn_dkv, tr_attn_args)

/* The device's first[] and end[] (2T int32, in the metadata) of host first[]. */
static int tr_attn_ranges(cuda_backend *cb, const int32_t *first, int64_t T, const int32_t **dev) {
    int32_t *h = (int32_t *)cuda_meta_host(cb, (size_t)(2 * T) * sizeof(int32_t));
    if (!h) return FU_ERR_NOMEM;
    memcpy(h, first, (size_t)T * sizeof(int32_t));
    for (int64_t t = T - 1; t >= 0; t--) h[T + t] = t + 1 < T && first[t + 1] == first[t] ? h[T + t + 1] : (int32_t)(t + 1);
    void *d;
    int rc = cuda_meta_upload(cb, (size_t)(2 * T) * sizeof(int32_t), &d);
    *dev = (const int32_t *)d;
    return rc;
}

/* Launches the kernels of cuda_attention_back over checked arguments p. */
static int tr_attn_run(cuda_backend *cb, tr_attn_args *p, int64_t T) {
    const cu_dim3 block = cu_dim(TR_ATTN_WARPS * CU_WARP, 1, 1);
    p->ntasks = T * p->nh;
    int rc = CU_LAUNCH(cb, tr_attn_dq, cu_dim((unsigned)((p->ntasks + TR_ATTN_WARPS - 1) / TR_ATTN_WARPS), 1, 1),
                       block, (size_t)TR_ATTN_WARPS * (size_t)(2 * p->hd + CU_WARP) * sizeof(float), *p);
    if (rc) return rc;
    p->ntasks = T * p->nkv;
    return CU_LAUNCH(cb, tr_attn_dkv, cu_dim((unsigned)((p->ntasks + TR_ATTN_WARPS - 1) / TR_ATTN_WARPS), 1, 1),
                     block, (size_t)TR_ATTN_WARPS * (size_t)(2 * p->hd + 2 * CU_WARP) * sizeof(float), *p);
}

CU_INTERNAL int cuda_attention_back(op_backend *be, const op_attn_train *a, const op_tensor *q,
                                    const op_tensor *k, const op_tensor *v, const op_tensor *out,
                                    const op_tensor *dout, op_tensor *dq, op_tensor *dk, op_tensor *dv) {
    cuda_backend *cb = cuda_be(be);
    if (a->head_dim > CU_ATTN_MAX_HD)
        return fu_errorf(FU_ERR_UNSUPPORTED, "attention_back: head_dim %d above %d", a->head_dim, CU_ATTN_MAX_HD);
    const op_tensor *ts[] = {q, k, v, out, dout, dq, dk, dv};
    int rc = tr_check_f32(cb, "attention_back", 8, ts);
    const int64_t T = q->ne[2] * q->ne[3];
    if (rc || T == 0) return rc;
    if (T * a->n_heads / TR_ATTN_WARPS >= INT32_MAX)
        return fu_errorf(FU_ERR_UNSUPPORTED, "attention_back: %lld rows of %d heads", (long long)T, a->n_heads);
    tr_attn_args p;
    if ((rc = cuda_scratch(cb, &cb->train, &cb->train_cap, (size_t)(T * a->n_heads * 3) * sizeof(float))) ||
        (rc = tr_attn_ranges(cb, a->first, T, &p.first)))
        return rc;
    p.end = p.first + T;
    p.q = (const float *)q->data;
    p.k = (const float *)k->data;
    p.v = (const float *)v->data;
    p.out = (const float *)out->data;
    p.dout = (const float *)dout->data;
    p.dq = (float *)dq->data;
    p.dk = (float *)dk->data;
    p.dv = (float *)dv->data;
    p.stats = (float *)cb->train;
    p.nh = a->n_heads;
    p.nkv = a->n_kv_heads;
    p.hd = a->head_dim;
    p.scale = a->scale;
    return tr_attn_run(cb, &p, T);
}
