/* cuda-emu.c -- the CUDA backend compiled as host C11: every .cu file of kernels/cuda in one
 * translation unit, with the runtime layer over host memory and a reference GEMM for cuBLAS. */
#define FUSION_CUDA_EMU 1

#include "../cuda-common.cuh"

#include <stdio.h>
#include <stdlib.h>

#include "../cuda-emu.h"

#include "../attention.cu"
#include "../backend.cu"
#include "../elementwise.cu"
#include "../get-rows.cu"
#include "../kv-store.cu"
#include "../matmul.cu"
#include "../rmsnorm.cu"
#include "../rope.cu"
#include "../softmax.cu"
#include "../train.cu"

/* ---- runtime layer over host memory ------------------------------------------------------- */

CU_INTERNAL int cu_rt_open(cuda_backend *cb, int device) {
    if (device != 0) return fu_errorf(FU_ERR_NOT_FOUND, "cuda emulator: device %d not present", device);
    cb->bf16_gemm = true;
    snprintf(cb->device_name, sizeof cb->device_name, "CPU emulator");
    return FU_OK;
}

CU_INTERNAL void cu_rt_close(cuda_backend *cb) { (void)cb; }

CU_INTERNAL int cu_rt_enter(cuda_backend *cb) {
    (void)cb;
    return FU_OK;
}

/* 256-byte aligned like cudaMalloc. */
CU_INTERNAL int cu_rt_malloc(cuda_backend *cb, void **p, size_t n) {
    (void)cb;
    size_t sz = (n + 255) / 256 * 256;
    void *q = aligned_alloc(256, sz ? sz : 256);
    if (!q) return fu_errorf(FU_ERR_NOMEM, "cuda emulator: cannot allocate %zu bytes", n);
    memset(q, 0, sz ? sz : 256);
    *p = q;
    return FU_OK;
}

CU_INTERNAL void cu_rt_free(cuda_backend *cb, void *p) {
    (void)cb;
    free(p);
}

CU_INTERNAL int cu_rt_upload(cuda_backend *cb, void *dst, const void *src, size_t n) {
    (void)cb;
    memcpy(dst, src, n);
    return FU_OK;
}

CU_INTERNAL int cu_rt_download(cuda_backend *cb, void *dst, const void *src, size_t n) {
    (void)cb;
    memcpy(dst, src, n);
    return FU_OK;
}

CU_INTERNAL int cu_rt_sync(cuda_backend *cb) {
    (void)cb;
    return FU_OK;
}

static float emu_gemm_elem(op_type type, const void *p, int64_t i) {
    switch (type) {
    case OP_TYPE_F32:
        return ((const float *)p)[i];
    case OP_TYPE_F16:
        return op_f16_to_f32(((const uint16_t *)p)[i]);
    default:
        return op_bf16_to_f32(((const uint16_t *)p)[i]);
    }
}

/* cublasGemmEx(CUBLAS_OP_T, CUBLAS_OP_N, m, n, k, 1, A, lda, B, ldb, 0, C, ldc),
 * f32 accumulation, with cuBLAS's argument checks. */
CU_INTERNAL int cu_rt_gemm(cuda_backend *cb, const cu_gemm *g) {
    (void)cb;
    if (g->type != OP_TYPE_F32 && g->type != OP_TYPE_F16 && g->type != OP_TYPE_BF16)
        return fu_errorf(FU_ERR_INTERNAL, "cuda emulator: gemm of type %s", op_type_name(g->type));
    if (g->m < 0 || g->n < 0 || g->k < 0 || g->m > INT32_MAX || g->n > INT32_MAX || g->k > INT32_MAX ||
        g->lda < (g->k > 1 ? g->k : 1) || g->ldb < (g->k > 1 ? g->k : 1) || g->ldc < (g->m > 1 ? g->m : 1))
        return fu_errorf(FU_ERR_INTERNAL, "cuda emulator: cublasGemmEx: invalid value (m %lld n %lld k %lld "
                         "lda %lld ldb %lld ldc %lld)", (long long)g->m, (long long)g->n, (long long)g->k,
                         (long long)g->lda, (long long)g->ldb, (long long)g->ldc);
    for (int64_t j = 0; j < g->n; j++)
        for (int64_t i = 0; i < g->m; i++) {
            float s = 0.0f;
            for (int64_t l = 0; l < g->k; l++)
                s += emu_gemm_elem(g->type, g->a, i * g->lda + l) * emu_gemm_elem(g->type, g->b, j * g->ldb + l);
            g->c[j * g->ldc + i] = s;
        }
    return FU_OK;
}
