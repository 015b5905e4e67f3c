/* backend.cu -- the CUDA backend's vtable: construction, device buffers, scratch and metadata.
 *
 * Memory: op_buffer_alloc gives zeroed device memory (cudaMalloc); callers
 * upload weights, caches and activations with op_buffer_set and read results
 * with op_buffer_get (which waits for all queued work). op_tensor.data and
 * .row_scale must point into such buffers. Host arrays that ops take (ids,
 * positions, sequence indices, inv_freq, cache descriptors) are packed into a
 * host staging buffer and uploaded per call. Every op is queued on the
 * backend's own stream and returns without waiting. */
#include "attention.cuh"
#include "elementwise.cuh"
#include "get-rows.cuh"
#include "kv-store.cuh"
#include "matmul.cuh"
#include "rmsnorm.cuh"
#include "rope.cuh"
#include "softmax.cuh"

#include <stdlib.h>

/* ---- helpers shared by the op files ------------------------------------------------------ */

CU_INTERNAL bool cuda_rows_ok(const op_tensor *t) {
    if (t->nb[0] != op_type_block_bytes(t->type) || t->data == NULL) return false;
    for (int i = 2; i < 4; i++)
        if (t->ne[i] > 1 && t->nb[i] != t->nb[i - 1] * (size_t)t->ne[i - 1]) return false;
    return true;
}

CU_INTERNAL bool cuda_f32_contig(const op_tensor *t) {
    return t->type == OP_TYPE_F32 && t->data && op_tensor_is_contiguous(t) && (uintptr_t)t->data % 4 == 0;
}

CU_INTERNAL int cuda_scratch(cuda_backend *cb, void **p, size_t *cap, size_t n) {
    if (n <= *cap && *p) return FU_OK;
    void *q = NULL;
    int rc = cu_rt_malloc(cb, &q, n);
    if (rc) return rc;
    cu_rt_free(cb, *p); /* waits for queued work that may still read it */
    *p = q;
    *cap = n;
    return FU_OK;
}

CU_INTERNAL void *cuda_meta_host(cuda_backend *cb, size_t n) {
    if (n > cb->meta_host_cap) {
        void *p = realloc(cb->meta_host, n);
        if (!p) {
            fu_errorf(FU_ERR_NOMEM, "cuda: no host memory for %zu bytes of metadata", n);
            return NULL;
        }
        cb->meta_host = p;
        cb->meta_host_cap = n;
    }
    return cb->meta_host;
}

CU_INTERNAL int cuda_meta_upload(cuda_backend *cb, size_t n, void **dev) {
    int rc = cuda_scratch(cb, &cb->meta, &cb->meta_cap, n);
    if (rc) return rc;
    *dev = cb->meta;
    return cu_rt_upload(cb, cb->meta, cb->meta_host, n);
}

/* ---- vtable ------------------------------------------------------------------------------ */

static void cuda_free(op_backend *be) {
    cuda_backend *cb = cuda_be(be);
    if (cb->rt && cu_rt_enter(cb) == FU_OK) cu_rt_sync(cb);
    cu_rt_free(cb, cb->meta);
    cu_rt_free(cb, cb->xh);
    cu_rt_free(cb, cb->wh);
    cu_rt_close(cb);
    free(cb->meta_host);
    free(cb);
}

static bool cuda_supports(const op_backend *be, op_type type) {
    (void)be;
    return cuda_supports_type(type);
}

static void *cuda_buffer_alloc(op_backend *be, size_t nbytes) {
    cuda_backend *cb = cuda_be(be);
    void *p = NULL;
    if (cu_rt_enter(cb) || cu_rt_malloc(cb, &p, nbytes)) return NULL;
    return p;
}

static void cuda_buffer_free(op_backend *be, void *ptr) {
    cuda_backend *cb = cuda_be(be);
    if (cu_rt_enter(cb) == FU_OK) cu_rt_free(cb, ptr);
}

static int cuda_buffer_set(op_backend *be, void *dst, const void *src, size_t nbytes) {
    cuda_backend *cb = cuda_be(be);
    int rc = cu_rt_enter(cb);
    if (rc || nbytes == 0) return rc;
    return cu_rt_upload(cb, dst, src, nbytes);
}

static int cuda_buffer_get(op_backend *be, void *dst, const void *src, size_t nbytes) {
    cuda_backend *cb = cuda_be(be);
    int rc = cu_rt_enter(cb);
    if (rc) return rc;
    if (nbytes == 0) return cu_rt_sync(cb);
    return cu_rt_download(cb, dst, src, nbytes);
}

/* Pre-sizes the metadata buffers for max_tokens tokens (the largest per-token
 * record is attention's) and, when max_tokens takes the cuBLAS path, the
 * rounded activations (max_tokens, max_k) and one chunk of dequantized weights.
 * Later calls beyond these sizes grow the buffers (and wait for the stream). */
static int cuda_reserve(op_backend *be, int64_t max_tokens, int64_t max_k) {
    cuda_backend *cb = cuda_be(be);
    if (max_tokens < 0 || max_k < 0) return fu_errorf(FU_ERR_INVALID, "cuda reserve: negative size");
    int rc = cu_rt_enter(cb);
    if (rc) return rc;
    size_t meta = (size_t)(max_tokens > 0 ? max_tokens : 1) * 64 + 4096;
    if (!cuda_meta_host(cb, meta)) return FU_ERR_NOMEM;
    if ((rc = cuda_scratch(cb, &cb->meta, &cb->meta_cap, meta))) return rc;
    if (max_tokens <= CU_MV_MAX_T || max_k == 0) return FU_OK;
    if ((rc = cuda_scratch(cb, &cb->xh, &cb->xh_cap, (size_t)max_tokens * (size_t)max_k * 2))) return rc;
    size_t rows = cb->chunk_elems / (size_t)max_k;
    return cuda_scratch(cb, &cb->wh, &cb->wh_cap, (rows ? rows : 1) * (size_t)max_k * 2);
}

static int cuda_synchronize(op_backend *be) {
    cuda_backend *cb = cuda_be(be);
    int rc = cu_rt_enter(cb);
    return rc ? rc : cu_rt_sync(cb);
}

#ifdef FUSION_CUDA_EMU
#define CUDA_BACKEND_NAME "cuda-emu"
#else
#define CUDA_BACKEND_NAME "cuda"
#endif

static const op_backend_vtbl cuda_vtbl = {
    CUDA_BACKEND_NAME,
    cuda_free,
    NULL, /* isa: the backend name */
    cuda_supports,
    cuda_buffer_alloc,
    cuda_buffer_free,
    cuda_buffer_set,
    cuda_buffer_get,
    cuda_reserve,
    NULL, /* weight_prepare: weights are used as they are */
    NULL, /* weight_layout */
    cuda_synchronize,
    cuda_matmul,
    NULL, /* matmul_n: op_matmul_n runs the matmuls one by one */
    cuda_rmsnorm,
    cuda_rope,
    cuda_attention,
    cuda_kv_store,
    cuda_swiglu,
    cuda_add,
    cuda_add_row,
    cuda_get_rows,
    cuda_softmax,
    cuda_log_softmax,
};

/* A backend on `device` dequantizing chunk_elems weight elements per cuBLAS
 * call, or NULL (fu_last_error() says why). */
static op_backend *cuda_backend_new(int device, size_t chunk_elems) {
    cuda_backend *cb = (cuda_backend *)calloc(1, sizeof *cb);
    if (!cb) {
        fu_errorf(FU_ERR_NOMEM, "cuda backend: out of memory");
        return NULL;
    }
    op_backend_base_init(&cb->base, &cuda_vtbl, 1);
    cb->device = device;
    cb->chunk_elems = chunk_elems ? chunk_elems : CU_GEMM_CHUNK_ELEMS;
    if (cu_rt_open(cb, device)) {
        cu_rt_close(cb);
        free(cb);
        return NULL;
    }
    return &cb->base;
}

#ifdef FUSION_CUDA_EMU
op_backend *op_backend_cuda_emu_new(size_t chunk_elems) { return cuda_backend_new(0, chunk_elems); }
#else
op_backend *op_backend_cuda_new(int device) { return cuda_backend_new(device, 0); }
#endif
