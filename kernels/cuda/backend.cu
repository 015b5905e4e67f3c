/* backend.cu -- the CUDA backend's vtable: construction, device buffers, scratch and metadata.
 *
 * Memory: op_buffer_alloc gives zeroed device memory (cudaMalloc); callers
 * upload weights, caches and activations with op_buffer_set (or
 * op_weight_prepare / op_tensor_upload) and read results with op_buffer_get
 * (which waits for all queued work). op_tensor.data and .row_scale must point
 * into such buffers: every op checks that they do (cuda_mem_check). Host
 * arrays that ops take (ids, positions, sequence indices, inv_freq, cache
 * descriptors) are packed into a host staging buffer and uploaded per call.
 * Every op is queued on the backend's own stream and returns without waiting. */
#include "attention.cuh"
#include "elementwise.cuh"
#include "get-rows.cuh"
#include "kv-store.cuh"
#include "matmul.cuh"
#include "rmsnorm.cuh"
#include "rope.cuh"
#include "softmax.cuh"
#include "train.cuh"

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

/* ---- the buffer registry ----------------------------------------------------------------- */

/* Index of the last buffer starting at or below p, or -1; called under bufs_mu. */
static ptrdiff_t cuda_buf_find(const cuda_backend *cb, uintptr_t p) {
    ptrdiff_t lo = 0, hi = (ptrdiff_t)cb->n_bufs - 1, at = -1;
    while (lo <= hi) {
        ptrdiff_t mid = lo + (hi - lo) / 2;
        if (cb->bufs[mid].base <= p) {
            at = mid;
            lo = mid + 1;
        } else {
            hi = mid - 1;
        }
    }
    return at;
}

static int cuda_buf_add(cuda_backend *cb, void *p, size_t n) {
    int rc = FU_OK;
    pthread_mutex_lock(&cb->bufs_mu);
    if (cb->n_bufs == cb->bufs_cap) {
        size_t cap = cb->bufs_cap ? 2 * cb->bufs_cap : 64;
        cuda_buf *b = (cuda_buf *)realloc(cb->bufs, cap * sizeof *b);
        if (!b) {
            rc = fu_errorf(FU_ERR_NOMEM, "cuda: out of host memory for the buffer list");
        } else {
            cb->bufs = b;
            cb->bufs_cap = cap;
        }
    }
    if (!rc) {
        size_t at = (size_t)(cuda_buf_find(cb, (uintptr_t)p) + 1);
        memmove(cb->bufs + at + 1, cb->bufs + at, (cb->n_bufs - at) * sizeof *cb->bufs);
        cb->bufs[at].base = (uintptr_t)p;
        cb->bufs[at].size = n;
        cb->n_bufs++;
    }
    pthread_mutex_unlock(&cb->bufs_mu);
    return rc;
}

static void cuda_buf_remove(cuda_backend *cb, void *p) {
    pthread_mutex_lock(&cb->bufs_mu);
    ptrdiff_t at = cuda_buf_find(cb, (uintptr_t)p);
    if (at >= 0 && cb->bufs[at].base == (uintptr_t)p) {
        memmove(cb->bufs + at, cb->bufs + at + 1, (cb->n_bufs - (size_t)at - 1) * sizeof *cb->bufs);
        cb->n_bufs--;
    }
    pthread_mutex_unlock(&cb->bufs_mu);
}

/* True if [p, p + n) lies in one registered buffer. */
static bool cuda_buf_holds(cuda_backend *cb, const void *p, size_t n) {
    pthread_mutex_lock(&cb->bufs_mu);
    ptrdiff_t at = cuda_buf_find(cb, (uintptr_t)p);
    bool ok = at >= 0 && (uintptr_t)p - cb->bufs[at].base <= cb->bufs[at].size &&
              n <= cb->bufs[at].size - ((uintptr_t)p - cb->bufs[at].base);
    pthread_mutex_unlock(&cb->bufs_mu);
    return ok;
}

static int cuda_mem_check1(cuda_backend *cb, const char *op, const op_tensor *t) {
    if (!t) return FU_OK;
    for (int i = 0; i < 4; i++)
        if (t->ne[i] <= 0) return FU_OK;
    /* the last byte reached: a whole first row, then each dimension's steps */
    size_t span = op_row_bytes(t->type, t->ne[0]);
    for (int i = 1; i < 4; i++) span += (size_t)(t->ne[i] - 1) * t->nb[i];
    const char *name = t->name ? t->name : "a tensor";
    if (!t->data || !cuda_buf_holds(cb, t->data, span))
        return fu_errorf(FU_ERR_INVALID, "%s: %s is not in this backend's memory (op_buffer_alloc, op_tensor_upload)",
                         op, name);
    if (t->type == OP_TYPE_I8 && t->row_scale &&
        !cuda_buf_holds(cb, t->row_scale, (size_t)(t->ne[1] * t->ne[2] * t->ne[3]) * sizeof(float)))
        return fu_errorf(FU_ERR_INVALID, "%s: the row scales of %s are not in this backend's memory", op, name);
    return FU_OK;
}

CU_INTERNAL int cuda_mem_check(cuda_backend *cb, const char *op, const op_tensor *a, const op_tensor *b,
                               const op_tensor *c) {
    int rc;
    if ((rc = cuda_mem_check1(cb, op, a)) || (rc = cuda_mem_check1(cb, op, b))) return rc;
    return cuda_mem_check1(cb, op, c);
}

/* ---- vtable ------------------------------------------------------------------------------ */

static void cuda_free(op_backend *be) {
    cuda_backend *cb = cuda_be(be);
    if (cb->rt && cu_rt_enter(cb) == FU_OK) cu_rt_sync(cb);
    cu_rt_free(cb, cb->meta);
    cu_rt_free(cb, cb->xh);
    cu_rt_free(cb, cb->wh);
    cu_rt_free(cb, cb->train);
    cu_rt_free(cb, cb->attn);
    cu_rt_close(cb);
    free(cb->meta_host);
    free(cb->bufs);
    pthread_mutex_destroy(&cb->bufs_mu);
    free(cb);
}

static const char *cuda_device_name(const op_backend *be) { return ((const cuda_backend *)be)->device_name; }

static bool cuda_supports(const op_backend *be, op_type type) {
    (void)be;
    return cuda_supports_type(type);
}

static void *cuda_buffer_alloc(op_backend *be, size_t nbytes) {
    cuda_backend *cb = cuda_be(be);
    void *p = NULL;
    if (cu_rt_enter(cb) || cu_rt_malloc(cb, &p, nbytes)) return NULL;
    if (cuda_buf_add(cb, p, nbytes)) {
        cu_rt_free(cb, p);
        return NULL;
    }
    return p;
}

static void cuda_buffer_free(op_backend *be, void *ptr) {
    cuda_backend *cb = cuda_be(be);
    cuda_buf_remove(cb, ptr);
    if (cu_rt_enter(cb) == FU_OK) cu_rt_free(cb, ptr);
}

static int cuda_buffer_set(op_backend *be, void *dst, const void *src, size_t nbytes) {
    cuda_backend *cb = cuda_be(be);
    int rc = cu_rt_enter(cb);
    if (rc || nbytes == 0) return rc;
    if (!cuda_buf_holds(cb, dst, nbytes))
        return fu_errorf(FU_ERR_INVALID,
                         "cuda: buffer_set: %zu bytes at the destination are not in this backend's memory", nbytes);
    return cu_rt_upload(cb, dst, src, nbytes);
}

/* A device copy of host tensor t as it is, with an I8 tensor's row scales
 * after its data in the same buffer (op_weight_prepare, op_tensor_upload). */
static int cuda_upload(op_backend *be, const op_tensor *t, op_tensor *out) {
    cuda_backend *cb = cuda_be(be);
    const char *name = t->name ? t->name : "a tensor";
    if (!t->data || !op_tensor_is_contiguous(t))
        return fu_errorf(FU_ERR_INVALID, "cuda: cannot upload %s: not a contiguous tensor", name);
    if (t->type == OP_TYPE_I8 && !t->row_scale)
        return fu_errorf(FU_ERR_INVALID, "cuda: cannot upload %s: i8 without row scales", name);
    const size_t n = op_tensor_nbytes(t), at = (n + 255) & ~(size_t)255;
    const size_t scales = t->type == OP_TYPE_I8 ? (size_t)(t->ne[1] * t->ne[2] * t->ne[3]) * sizeof(float) : 0;
    uint8_t *p = (uint8_t *)cuda_buffer_alloc(be, scales ? at + scales : n);
    if (!p) return fu_errorf(FU_ERR_NOMEM, "cuda: no device memory for %s (%zu bytes): %s", name, n, fu_last_error());
    int rc = cu_rt_upload(cb, p, t->data, n);
    if (!rc && scales) rc = cu_rt_upload(cb, p + at, t->row_scale, scales);
    if (rc) {
        cuda_buffer_free(be, p);
        return rc;
    }
    *out = *t;
    out->data = p;
    if (scales) out->row_scale = (const float *)(p + at);
    return 1;
}

static int cuda_buffer_get(op_backend *be, void *dst, const void *src, size_t nbytes) {
    cuda_backend *cb = cuda_be(be);
    int rc = cu_rt_enter(cb);
    if (rc) return rc;
    if (nbytes == 0) return cu_rt_sync(cb);
    if (!cuda_buf_holds(cb, src, nbytes))
        return fu_errorf(FU_ERR_INVALID, "cuda: buffer_get: %zu bytes at the source are not in this backend's memory",
                         nbytes);
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
    if (max_tokens == 0 || max_k == 0) return FU_OK;
    if ((rc = cuda_scratch(cb, &cb->xh, &cb->xh_cap, (size_t)max_tokens * (size_t)max_k * 2))) return rc;
    if (max_tokens <= CU_MV_MAX_T) return FU_OK; /* dequantized chunks only beyond the matvec path */
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
    cuda_device_name, /* isa */
    cuda_supports,
    cuda_buffer_alloc,
    cuda_buffer_free,
    cuda_buffer_set,
    cuda_buffer_get,
    cuda_reserve,
    cuda_upload, /* weight_prepare: weights are copied to the device as they are */
    NULL,        /* weight_layout: in their own type */
    cuda_upload,
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
    cuda_add_rows,
    cuda_matmul_back,
    cuda_outer_acc,
    cuda_rmsnorm_back,
    cuda_swiglu_back,
    cuda_attention_back,
    cuda_cross_entropy,
    cuda_dropout,
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
    pthread_mutex_init(&cb->bufs_mu, NULL);
    cb->device = device;
    cb->chunk_elems = chunk_elems ? chunk_elems : CU_GEMM_CHUNK_ELEMS;
    if (cu_rt_open(cb, device)) {
        cu_rt_close(cb);
        pthread_mutex_destroy(&cb->bufs_mu);
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
