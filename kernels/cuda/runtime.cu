/* runtime.cu -- the device runtime layer on real CUDA: device checks, stream, memory, cuBLAS.
 *
 * cuBLAS is loaded with dlopen when a backend opens, so that programs linked
 * with fusion start (and fall back to the CPU) on machines without it. Every
 * CUDA and cuBLAS call goes through CU_CHECK / CUBLAS_CHECK, which turn a
 * failure into an fu_errorf status naming the call, file and line. */
#include "cuda-common.cuh"

#include <cublas_v2.h>
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>

/* FU_ERR_NOMEM for allocation failures, FU_ERR_INTERNAL otherwise. */
static int cu_status(cudaError_t e) { return e == cudaErrorMemoryAllocation ? FU_ERR_NOMEM : FU_ERR_INTERNAL; }

#define CU_CHECK(call)                                                                              \
    do {                                                                                            \
        cudaError_t cu_err_ = (call);                                                               \
        if (cu_err_ != cudaSuccess)                                                                 \
            return fu_errorf(cu_status(cu_err_), "%s:%d: %s: %s", __FILE__, __LINE__, #call,        \
                             cudaGetErrorString(cu_err_));                                          \
    } while (0)

typedef cublasStatus_t (*cublas_create_fn)(cublasHandle_t *);
typedef cublasStatus_t (*cublas_destroy_fn)(cublasHandle_t);
typedef cublasStatus_t (*cublas_set_stream_fn)(cublasHandle_t, cudaStream_t);
typedef cublasStatus_t (*cublas_gemm_ex_fn)(cublasHandle_t, cublasOperation_t, cublasOperation_t, int, int, int,
                                            const void *, const void *, cudaDataType, int, const void *,
                                            cudaDataType, int, const void *, void *, cudaDataType, int,
                                            cublasComputeType_t, cublasGemmAlgo_t);
typedef const char *(*cublas_status_string_fn)(cublasStatus_t);

struct cu_rt {
    cudaStream_t stream;
    bool stream_ok;
    void *lib; /* dlopen handle of libcublas */
    cublasHandle_t blas;
    cublas_create_fn create;
    cublas_destroy_fn destroy;
    cublas_set_stream_fn set_stream;
    cublas_gemm_ex_fn gemm_ex;
    cublas_status_string_fn status_string;
};

#define CUBLAS_CHECK(rt, call)                                                                     \
    do {                                                                                           \
        cublasStatus_t cb_st_ = (call);                                                            \
        if (cb_st_ != CUBLAS_STATUS_SUCCESS)                                                       \
            return fu_errorf(cb_st_ == CUBLAS_STATUS_ALLOC_FAILED ? FU_ERR_NOMEM : FU_ERR_INTERNAL, \
                             "%s:%d: %s: %s", __FILE__, __LINE__, #call,                          \
                             (rt)->status_string ? (rt)->status_string(cb_st_) : "cublas error");   \
    } while (0)

static int cu_rt_load_cublas(struct cu_rt *rt) {
    static const char *names[] = {"libcublas.so.13", "libcublas.so.12", "libcublas.so"};
    for (size_t i = 0; i < sizeof names / sizeof names[0] && !rt->lib; i++)
        rt->lib = dlopen(names[i], RTLD_NOW | RTLD_LOCAL);
    if (!rt->lib) return fu_errorf(FU_ERR_UNSUPPORTED, "cuda: cannot load cuBLAS (libcublas.so.13): %s", dlerror());
    rt->create = (cublas_create_fn)dlsym(rt->lib, "cublasCreate_v2");
    rt->destroy = (cublas_destroy_fn)dlsym(rt->lib, "cublasDestroy_v2");
    rt->set_stream = (cublas_set_stream_fn)dlsym(rt->lib, "cublasSetStream_v2");
    rt->gemm_ex = (cublas_gemm_ex_fn)dlsym(rt->lib, "cublasGemmEx");
    rt->status_string = (cublas_status_string_fn)dlsym(rt->lib, "cublasGetStatusString");
    if (!rt->create || !rt->destroy || !rt->set_stream || !rt->gemm_ex)
        return fu_errorf(FU_ERR_UNSUPPORTED, "cuda: cuBLAS lacks cublasGemmEx or cublasCreate_v2");
    return FU_OK;
}

CU_INTERNAL int cu_rt_open(cuda_backend *cb, int device) {
    int n = 0;
    cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess) {
        cudaGetLastError(); /* clear */
        return fu_errorf(FU_ERR_UNSUPPORTED, "cuda: no usable GPU (cudaGetDeviceCount: %s)", cudaGetErrorString(e));
    }
    if (device < 0 || device >= n)
        return fu_errorf(FU_ERR_NOT_FOUND, "cuda: device %d not present (%d GPUs)", device, n);
    struct cu_rt *rt = (struct cu_rt *)calloc(1, sizeof *rt);
    if (!rt) return fu_errorf(FU_ERR_NOMEM, "cuda: out of memory");
    cb->rt = rt;
    CU_CHECK(cudaSetDevice(device));
    int major = 0;
    CU_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
    cb->bf16_gemm = major >= 8;
    cudaDeviceProp prop;
    CU_CHECK(cudaGetDeviceProperties(&prop, device));
    snprintf(cb->device_name, sizeof cb->device_name, "%s", prop.name);
    CU_CHECK(cudaStreamCreateWithFlags(&rt->stream, cudaStreamNonBlocking));
    rt->stream_ok = true;
    cb->stream = rt->stream;
    int rc = cu_rt_load_cublas(rt);
    if (rc) return rc;
    CUBLAS_CHECK(rt, rt->create(&rt->blas));
    CUBLAS_CHECK(rt, rt->set_stream(rt->blas, rt->stream));
    return FU_OK;
}

CU_INTERNAL void cu_rt_close(cuda_backend *cb) {
    struct cu_rt *rt = cb->rt;
    if (!rt) return;
    cudaSetDevice(cb->device);
    if (rt->blas) rt->destroy(rt->blas);
    if (rt->stream_ok) cudaStreamDestroy(rt->stream);
    if (rt->lib) dlclose(rt->lib);
    free(rt);
    cb->rt = NULL;
    cb->stream = NULL;
}

CU_INTERNAL int cu_rt_enter(cuda_backend *cb) {
    int cur = -1;
    CU_CHECK(cudaGetDevice(&cur));
    if (cur != cb->device) CU_CHECK(cudaSetDevice(cb->device));
    return FU_OK;
}

CU_INTERNAL int cu_rt_malloc(cuda_backend *cb, void **p, size_t n) {
    void *q = NULL;
    CU_CHECK(cudaMalloc(&q, n ? n : 1));
    cudaError_t e = cudaMemsetAsync(q, 0, n ? n : 1, (cudaStream_t)cb->stream);
    if (e == cudaSuccess) e = cudaStreamSynchronize((cudaStream_t)cb->stream);
    if (e != cudaSuccess) {
        cudaFree(q);
        return fu_errorf(cu_status(e), "%s:%d: zeroing %zu bytes: %s", __FILE__, __LINE__, n, cudaGetErrorString(e));
    }
    *p = q;
    return FU_OK;
}

CU_INTERNAL void cu_rt_free(cuda_backend *cb, void *p) {
    (void)cb;
    if (p) cudaFree(p); /* synchronizes with queued work */
}

CU_INTERNAL int cu_rt_upload(cuda_backend *cb, void *dst, const void *src, size_t n) {
    /* pageable source: the driver has copied it out when this returns */
    CU_CHECK(cudaMemcpyAsync(dst, src, n, cudaMemcpyHostToDevice, (cudaStream_t)cb->stream));
    return FU_OK;
}

CU_INTERNAL int cu_rt_download(cuda_backend *cb, void *dst, const void *src, size_t n) {
    CU_CHECK(cudaMemcpyAsync(dst, src, n, cudaMemcpyDeviceToHost, (cudaStream_t)cb->stream));
    CU_CHECK(cudaStreamSynchronize((cudaStream_t)cb->stream));
    return FU_OK;
}

CU_INTERNAL int cu_rt_sync(cuda_backend *cb) {
    CU_CHECK(cudaStreamSynchronize((cudaStream_t)cb->stream));
    return FU_OK;
}

CU_INTERNAL int cu_rt_check_launch(cuda_backend *cb, const char *kernel, const char *file, int line) {
    (void)cb;
    cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess)
        return fu_errorf(cu_status(e), "%s:%d: launch of %s: %s", file, line, kernel, cudaGetErrorString(e));
    return FU_OK;
}

CU_INTERNAL int cu_rt_gemm(cuda_backend *cb, const cu_gemm *g) {
    struct cu_rt *rt = cb->rt;
    cudaDataType t = g->type == OP_TYPE_F32 ? CUDA_R_32F : g->type == OP_TYPE_F16 ? CUDA_R_16F : CUDA_R_16BF;
    const float one = 1.0f, zero = 0.0f;
    CUBLAS_CHECK(rt, rt->gemm_ex(rt->blas, CUBLAS_OP_T, CUBLAS_OP_N, (int)g->m, (int)g->n, (int)g->k, &one, g->a, t,
                                 (int)g->lda, g->b, t, (int)g->ldb, &zero, g->c, CUDA_R_32F, (int)g->ldc,
                                 CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    return FU_OK;
}
