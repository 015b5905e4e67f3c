/* matmul.cu -- matvec kernels for decode, dequantize/convert kernels + cuBLAS for prefill. */
#include "matmul.cuh"

#define MV_WARPS 4 /* output rows (one per warp) per block */

/* ---- matvec: y (T, N) = x (T, K) W (N, K)^T for small T (see cuda_matmul) -------------- */

typedef struct mv_args {
    const uint8_t *w;       /* (N, K) rows of w_stride bytes */
    size_t w_stride;
    const float *row_scale; /* (N), I8 only */
    const float *x;         /* (T, K), row stride ldx floats */
    float *y;               /* (T, N), row stride ldy floats */
    int64_t ldx, ldy, n, k;
    int t;
} mv_args;

/* One warp per output row: lane l takes elements l, l + 32, ... (so the lanes
 * of a quantized block read it together), T partial dot products per lane,
 * then one warp reduction of the T values. `type` is a constant in each
 * kernel below, so the dequantization switch folds away. */
CU_DEV void mv_body(const cu_ctx *c, const mv_args *a, int type) {
    const int64_t row = cu_block(c) * MV_WARPS + cu_warp_id(c);
    if (row >= a->n) return; /* the whole warp leaves */
    const uint8_t *w = a->w + (size_t)row * a->w_stride;
    float acc[CU_MV_MAX_T];
    for (int t = 0; t < CU_MV_MAX_T; t++) acc[t] = 0.0f;
    for (int64_t i = cu_lane(c); i < a->k; i += CU_WARP) {
        const float wv = cu_dequant(type, w, i);
        for (int t = 0; t < CU_MV_MAX_T; t++)
            if (t < a->t) acc[t] += wv * a->x[t * a->ldx + i];
    }
    cu_warp_sum_n(c, acc, CU_MV_MAX_T); /* constant count: acc stays in registers */
    if (cu_lane(c) == 0) {
        const float s = type == OP_TYPE_I8 ? a->row_scale[row] : 1.0f;
        for (int t = 0; t < CU_MV_MAX_T; t++)
            if (t < a->t) a->y[t * a->ldy + row] = acc[t] * s;
    }
}

CU_WEIGHT_KERNELS(mv, mv_args, CU_KERNEL_SYNC)

/* ---- prefill helpers ---------------------------------------------------------------- */

typedef struct mm_cvt_args {
    const float *x; /* (T, K), row stride ldx floats */
    uint16_t *out;  /* (T, K) contiguous f16 or bf16 */
    int64_t ldx, t, k;
    int bf16;
} mm_cvt_args;

CU_DEV void mm_cvt_body(const cu_ctx *c, const mm_cvt_args *a) {
    const int64_t n = a->t * a->k;
    for (int64_t g = cu_gid(c); g < n; g += cu_gstride(c)) {
        const float v = a->x[g / a->k * a->ldx + g % a->k];
        a->out[g] = a->bf16 ? cu_f32_to_bf16(v) : cu_f32_to_f16(v);
    }
}
CU_KERNEL(mm_cvt, mm_cvt_args)

typedef struct mm_dequant_args {
    const uint8_t *w;       /* rows row0 .. row0 + rows of (N, K) */
    size_t w_stride;
    const float *row_scale; /* (N), I8 only */
    uint16_t *out;          /* (rows, K) f16 */
    int64_t row0, rows, k;
    int type;
} mm_dequant_args;

CU_DEV void mm_dequant_body(const cu_ctx *c, const mm_dequant_args *a) {
    const int64_t n = a->rows * a->k;
    for (int64_t g = cu_gid(c); g < n; g += cu_gstride(c)) {
        const int64_t r = a->row0 + g / a->k;
        float v = cu_dequant(a->type, a->w + (size_t)r * a->w_stride, g % a->k);
        if (a->type == OP_TYPE_I8) v *= a->row_scale[r];
        a->out[g] = cu_f32_to_f16(v);
    }
}
CU_KERNEL(mm_dequant, mm_dequant_args)

typedef struct mm_zero_args {
    float *y; /* (T, N), row stride ldy */
    int64_t ldy, t, n;
} mm_zero_args;

CU_DEV void mm_zero_body(const cu_ctx *c, const mm_zero_args *a) {
    for (int64_t g = cu_gid(c); g < a->t * a->n; g += cu_gstride(c)) a->y[g / a->n * a->ldy + g % a->n] = 0.0f;
}
CU_KERNEL(mm_zero, mm_zero_args)

/* ---- host side ------------------------------------------------------------------------ */

static int mm_matvec(cuda_backend *cb, op_type type, const mv_args *a) {
    cu_dim3 grid = cu_dim((unsigned)((a->n + MV_WARPS - 1) / MV_WARPS), 1, 1);
    cu_dim3 block = cu_dim(MV_WARPS * CU_WARP, 1, 1);
    return mv_launch(cb, type, grid, block, 0, a);
}

/* x (T, K) rounded to f16 / bf16 into cb->xh (T, K). */
static int mm_convert_x(cuda_backend *cb, const mv_args *m, int bf16) {
    int rc = cuda_scratch(cb, &cb->xh, &cb->xh_cap, (size_t)(m->t * m->k) * 2);
    if (rc) return rc;
    mm_cvt_args a;
    a.x = m->x;
    a.out = (uint16_t *)cb->xh;
    a.ldx = m->ldx;
    a.t = m->t;
    a.k = m->k;
    a.bf16 = bf16;
    return CU_LAUNCH(cb, mm_cvt, cu_dim(cu_blocks_for(a.t * a.k, 256), 1, 1), cu_dim(256, 1, 1), 0, a);
}

/* Weights cuBLAS takes as they are, with no dequantization: F32, F16, and BF16 where the GPU
 * multiplies bf16 (compute capability 8.0 on). */
static bool mm_direct(const cuda_backend *cb, op_type type) {
    return type == OP_TYPE_F32 || type == OP_TYPE_F16 || (type == OP_TYPE_BF16 && cb->bf16_gemm);
}

/* cuBLAS on f32 / f16 / bf16 operands (see matmul.cuh): every T of a direct type, and
 * T > CU_MV_MAX_T of the others (through dequantized chunks). */
static int mm_gemm(cuda_backend *cb, op_type type, const mv_args *m) {
    cu_gemm g;
    memset(&g, 0, sizeof g);
    g.c = m->y;
    g.ldc = m->ldy;
    g.n = m->t;
    g.k = m->k;
    int rc;
    if (mm_direct(cb, type)) {
        g.type = type;
        g.a = m->w;
        g.lda = (int64_t)(m->w_stride / op_type_block_bytes(type));
        g.m = m->n;
        if (type == OP_TYPE_F32) {
            g.b = m->x;
            g.ldb = m->ldx;
        } else {
            if ((rc = mm_convert_x(cb, m, type == OP_TYPE_BF16))) return rc;
            g.b = cb->xh;
            g.ldb = m->k;
        }
        return cu_rt_gemm(cb, &g);
    }
    if ((rc = mm_convert_x(cb, m, 0))) return rc;
    int64_t rows = (int64_t)(cb->chunk_elems / (size_t)m->k);
    if (rows < 1) rows = 1;
    if (rows > m->n) rows = m->n;
    if ((rc = cuda_scratch(cb, &cb->wh, &cb->wh_cap, (size_t)(rows * m->k) * 2))) return rc;
    g.type = OP_TYPE_F16;
    g.a = cb->wh;
    g.lda = m->k;
    g.b = cb->xh;
    g.ldb = m->k;
    for (int64_t r0 = 0; r0 < m->n; r0 += rows) {
        mm_dequant_args d;
        d.w = m->w;
        d.w_stride = m->w_stride;
        d.row_scale = m->row_scale;
        d.out = (uint16_t *)cb->wh;
        d.row0 = r0;
        d.rows = m->n - r0 < rows ? m->n - r0 : rows;
        d.k = m->k;
        d.type = (int)type;
        rc = CU_LAUNCH(cb, mm_dequant, cu_dim(cu_blocks_for(d.rows * d.k, 256), 1, 1), cu_dim(256, 1, 1), 0, d);
        if (rc) return rc;
        g.c = m->y + r0;
        g.m = d.rows;
        if ((rc = cu_rt_gemm(cb, &g))) return rc;
    }
    return FU_OK;
}

CU_INTERNAL int cuda_weight_check(cuda_backend *cb, const char *op, const op_tensor *w) {
    const char *name = w->name ? w->name : "";
    if (!cuda_rows_ok(w) || w->ne[2] * w->ne[3] != 1)
        return fu_errorf(FU_ERR_INVALID, "%s %s: W must be 2-D with contiguous rows", op, name);
    if (op_type_block_elems(w->type) > 1 && w->ne[0] % OP_QK)
        return fu_errorf(FU_ERR_INVALID, "%s %s: K=%lld is not a multiple of %d", op, name, (long long)w->ne[0],
                         OP_QK);
    if (w->type == OP_TYPE_I8 && !w->row_scale)
        return fu_errorf(FU_ERR_INVALID, "%s %s: i8 weights need row scales", op, name);
    if (!cuda_supports_type(w->type))
        return fu_errorf(FU_ERR_UNSUPPORTED, "%s %s: no %s kernel", op, name, op_type_name(w->type));
    if (w->nb[1] % cuda_type_align(w->type) || (uintptr_t)w->data % cuda_type_align(w->type))
        return fu_errorf(FU_ERR_INVALID, "%s %s: misaligned weight rows", op, name);
    return cuda_mem_check(cb, op, w, NULL, NULL);
}

CU_INTERNAL int cuda_matmul(op_backend *be, const op_tensor *w, const op_tensor *x, op_tensor *y) {
    cuda_backend *cb = cuda_be(be);
    const char *name = w->name ? w->name : "";
    int rc = cuda_weight_check(cb, "matmul", w);
    if (rc) return rc;
    if (!cuda_rows_ok(x) || !cuda_rows_ok(y))
        return fu_errorf(FU_ERR_INVALID, "matmul %s: all rows must be contiguous", name);
    if ((rc = cuda_mem_check(cb, "matmul", x, y, NULL))) return rc;
    if (x->nb[1] % 4 || y->nb[1] % 4 || (uintptr_t)x->data % 4 || (uintptr_t)y->data % 4)
        return fu_errorf(FU_ERR_INVALID, "matmul %s: misaligned rows", name);
    mv_args m;
    m.w = (const uint8_t *)w->data;
    m.w_stride = w->nb[1];
    m.row_scale = w->type == OP_TYPE_I8 ? w->row_scale : NULL;
    m.x = (const float *)x->data;
    m.y = (float *)y->data;
    m.ldx = (int64_t)(x->nb[1] / sizeof(float));
    m.ldy = (int64_t)(y->nb[1] / sizeof(float));
    m.n = w->ne[1];
    m.k = w->ne[0];
    int64_t t = x->ne[1] * x->ne[2] * x->ne[3];
    if (m.n > INT32_MAX || m.k > INT32_MAX || t > INT32_MAX || m.ldx > INT32_MAX || m.ldy > INT32_MAX)
        return fu_errorf(FU_ERR_UNSUPPORTED, "matmul %s: dimensions beyond 2^31", name);
    m.t = (int)t;
    rc = cu_rt_enter(cb);
    if (rc || m.t == 0 || m.n == 0) return rc;
    if (m.k == 0) {
        mm_zero_args z;
        z.y = m.y;
        z.ldy = m.ldy;
        z.t = m.t;
        z.n = m.n;
        return CU_LAUNCH(cb, mm_zero, cu_dim(cu_blocks_for(z.t * z.n, 256), 1, 1), cu_dim(256, 1, 1), 0, z);
    }
    if (m.t <= CU_MV_MAX_T && !mm_direct(cb, w->type)) return mm_matvec(cb, w->type, &m);
    return mm_gemm(cb, w->type, &m);
}
