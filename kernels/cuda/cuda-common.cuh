/* cuda-common.cuh -- what every CUDA op file shares: host/device portability, kernel
 * declaration and launch macros, warp/block reductions, the backend struct and the
 * device runtime layer (real CUDA in runtime.cu, host memory in emu/cuda-emu.c).
 *
 * Every .cu file of this directory is written so that it also compiles as C11
 * with FUSION_CUDA_EMU defined (emu/cuda-emu.c includes them all into one
 * translation unit): kernels are `CU_DEV` body functions of (cu_ctx, args)
 * wrapped by CU_KERNEL / CU_KERNEL_SYNC, which make a `static __global__`
 * kernel on the GPU and an emulator entry (emu/emu.h) on the host; launches go
 * through CU_LAUNCH; barriers and shuffles through cu_syncthreads / cu_syncwarp /
 * cu_warp_reduce. So: no templates, no C++-only syntax, explicit casts from
 * void *, all shared memory dynamic.
 */
#ifndef FU_CUDA_COMMON_CUH
#define FU_CUDA_COMMON_CUH

#include <math.h>
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#ifdef __cplusplus
extern "C" {
#endif
#include "ops-impl.h"
#include "status.h"
#ifdef __cplusplus
}
#endif

#include "cu-ctx.h"

#ifdef FUSION_CUDA_EMU
#include "emu/emu.h"
#define CU_INTERNAL static /* one translation unit: everything stays file-local */
#define CU_DEV static inline
#define CU_HD static inline
#else
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#define CU_INTERNAL __attribute__((visibility("hidden")))
#define CU_DEV static __device__ __forceinline__
#define CU_HD static __host__ __device__ __forceinline__
#endif

#define CU_WARP 32
#define CU_MV_MAX_T 8       /* largest T of the matvec path (see matmul.cuh); above it, cuBLAS */
#define CU_ATTN_MAX_HD 256  /* head_dim limit of the attention kernel */
#define CU_GEMM_CHUNK_ELEMS ((size_t)1 << 24) /* dequantized weight elements per cuBLAS call */

/* ---- backend state ---------------------------------------------------------- */

struct cu_rt; /* runtime-private state (CUDA stream handle's owner, cuBLAS) */

typedef struct cuda_buf {
    uintptr_t base;
    size_t size;
} cuda_buf;

typedef struct cuda_backend {
    op_backend base;
    int device;
    void *stream;         /* cudaStream_t of this backend (NULL in the emulator) */
    struct cu_rt *rt;     /* runtime-private */
    void *meta;           /* device: per-call host arrays (ids, positions, cache rows) */
    size_t meta_cap;      /* bytes */
    void *meta_host;      /* host staging of meta */
    size_t meta_host_cap; /* bytes */
    void *xh;             /* device: activations rounded to f16/bf16 for cuBLAS (T, K) */
    size_t xh_cap;        /* bytes */
    void *wh;             /* device: a chunk of dequantized f16 weight rows (rows, K) */
    size_t wh_cap;        /* bytes */
    void *train;          /* device: training ops' scratch (attention_back's softmax statistics) */
    size_t train_cap;     /* bytes */
    void *attn;           /* device: attention's partial results of split positions */
    size_t attn_cap;      /* bytes */
    size_t chunk_elems;   /* weight elements dequantized per cuBLAS call */
    bool bf16_gemm;       /* cuBLAS takes bf16 operands (compute capability >= 8.0) */
    char device_name[256]; /* e.g. "NVIDIA H100 80GB HBM3" */
    /* the op_buffer_alloc buffers, sorted by address, so that every op can
     * refuse tensors outside them (host memory would fault on the GPU); under
     * their own lock, since buffers come and go outside the op lock */
    cuda_buf *bufs;
    size_t n_bufs, bufs_cap;
    pthread_mutex_t bufs_mu;
} cuda_backend;

static inline cuda_backend *cuda_be(op_backend *be) { return (cuda_backend *)be; }

/* ---- runtime layer (runtime.cu / emu/cuda-emu.c) ---------------------------------- */

/* Opens `device`: checks it exists, makes the stream and the cuBLAS handle. */
CU_INTERNAL int cu_rt_open(cuda_backend *cb, int device);
CU_INTERNAL void cu_rt_close(cuda_backend *cb); /* safe on a half-opened backend */
/* Makes the backend's device current for the calling host thread. */
CU_INTERNAL int cu_rt_enter(cuda_backend *cb);
/* Zeroed device memory of n bytes into *p (NULL for n == 0 is not returned: n is raised to 1). */
CU_INTERNAL int cu_rt_malloc(cuda_backend *cb, void **p, size_t n);
CU_INTERNAL void cu_rt_free(cuda_backend *cb, void *p); /* NULL is a no-op */
/* Queues a host -> device copy on the stream; src may be reused on return. */
CU_INTERNAL int cu_rt_upload(cuda_backend *cb, void *dst, const void *src, size_t n);
/* Device -> host after all queued work. */
CU_INTERNAL int cu_rt_download(cuda_backend *cb, void *dst, const void *src, size_t n);
CU_INTERNAL int cu_rt_sync(cuda_backend *cb);
#ifndef FUSION_CUDA_EMU
/* After a kernel launch: turns a launch error into a status naming kernel, file and line. */
CU_INTERNAL int cu_rt_check_launch(cuda_backend *cb, const char *kernel, const char *file, int line);
#endif

/* C (col-major m x n, ldc) f32 = A^T B with A col-major (k x m, lda) and B
 * col-major (k x n, ldb), both of `type` (F32, F16 or BF16), f32 compute
 * (cublasGemmEx(T, N)). In row-major terms: C rows j = B row j . A rows i. */
typedef struct cu_gemm {
    op_type type;
    const void *a;
    int64_t lda;
    const void *b;
    int64_t ldb;
    float *c;
    int64_t ldc;
    int64_t m, n, k;
} cu_gemm;
CU_INTERNAL int cu_rt_gemm(cuda_backend *cb, const cu_gemm *g);

/* ---- backend helpers (backend.cu) ------------------------------------------------------ */

/* Host staging of at least n bytes for per-call metadata (grown as needed), or NULL. */
CU_INTERNAL void *cuda_meta_host(cuda_backend *cb, size_t n);
/* Uploads the first n bytes of the staging; *dev gets their device address. */
CU_INTERNAL int cuda_meta_upload(cuda_backend *cb, size_t n, void **dev);
/* Grows device scratch *p (capacity *cap bytes) to at least n bytes. */
CU_INTERNAL int cuda_scratch(cuda_backend *cb, void **p, size_t *cap, size_t n);
/* True if t is a set of rows: contiguous along ne[0] and dims 2, 3 continuing nb[1]. */
CU_INTERNAL bool cuda_rows_ok(const op_tensor *t);
CU_INTERNAL bool cuda_f32_contig(const op_tensor *t);
/* FU_OK when every byte op `op` may read or write of a, b and c (and of an
 * I8 tensor's row scales) lies in one buffer of this backend; else
 * FU_ERR_INVALID saying so. NULL tensors and ones without elements pass. */
CU_INTERNAL int cuda_mem_check(cuda_backend *cb, const char *op, const op_tensor *a, const op_tensor *b,
                               const op_tensor *c);
/* Alignment the element loads of a weight type need (bytes). */
static inline size_t cuda_type_align(op_type type) {
    return type == OP_TYPE_F32 ? 4 : type == OP_TYPE_I8 ? 1 : 2;
}
/* The weight types this backend has kernels for: all but the CPU's interleaved layouts. */
static inline bool cuda_supports_type(op_type type) {
    return op_type_is_weight(type) && op_type_row_group(type) == 1;
}
/* Rounds n up to a multiple of 16 (packing of metadata arrays). */
static inline size_t cuda_align16(size_t n) { return (n + 15) & ~(size_t)15; }

/* ---- kernels: declaration and launch ---------------------------------------------------- */

CU_HD cu_dim3 cu_dim(unsigned x, unsigned y, unsigned z) {
    cu_dim3 d;
    d.x = x;
    d.y = y;
    d.z = z;
    return d;
}

/* Blocks of `threads` covering n items, at most 2^20 (kernels loop over the rest). */
static inline unsigned cu_blocks_for(int64_t n, unsigned threads) {
    int64_t b = (n + threads - 1) / threads;
    return b < 1 ? 1u : b > (1 << 20) ? (1u << 20) : (unsigned)b;
}

#ifdef FUSION_CUDA_EMU
#define CU_KERNEL_DEF_(name, args_t, sync)                                                 \
    static void name##_thunk(const cu_ctx *c, const void *a) { name##_body(c, (const args_t *)a); } \
    static const cu_emu_kernel name##_kernel = {#name, name##_thunk, sync};
/* CU_KERNEL(name, args_t): kernel `name` running name##_body; no barriers or shuffles. */
#define CU_KERNEL(name, args_t) CU_KERNEL_DEF_(name, args_t, 0)
/* CU_KERNEL_SYNC: the same for a body that uses barriers or warp exchanges. */
#define CU_KERNEL_SYNC(name, args_t) CU_KERNEL_DEF_(name, args_t, 1)
/* CU_LAUNCH(cb, name, grid, block, smem, args): an int status expression. */
#define CU_LAUNCH(cb, name, grid, block, smem, args) \
    ((void)(cb), cu_emu_launch(&name##_kernel, (grid), (block), (smem), &(args), __FILE__, __LINE__))
#else
extern __shared__ __align__(16) unsigned char cu_smem[];

static __device__ __forceinline__ void cu_ctx_init(cu_ctx *c) {
    c->block_idx = cu_dim(blockIdx.x, blockIdx.y, blockIdx.z);
    c->thread_idx = cu_dim(threadIdx.x, threadIdx.y, threadIdx.z);
    c->block_dim = cu_dim(blockDim.x, blockDim.y, blockDim.z);
    c->grid_dim = cu_dim(gridDim.x, gridDim.y, gridDim.z);
    c->smem = cu_smem;
    c->emu = NULL;
}
static inline dim3 cu_dim3_to(cu_dim3 d) { return dim3(d.x, d.y, d.z); }
#define CU_KERNEL(name, args_t)                        \
    static __global__ void name##_kernel(const __grid_constant__ args_t a) { \
        cu_ctx c;                                      \
        cu_ctx_init(&c);                               \
        name##_body(&c, &a);                           \
    }
#define CU_KERNEL_SYNC(name, args_t) CU_KERNEL(name, args_t)
#define CU_LAUNCH(cb, name, grid, block, smem, args)                                             \
    (name##_kernel<<<cu_dim3_to(grid), cu_dim3_to(block), (smem), (cudaStream_t)(cb)->stream>>>(args), \
     cu_rt_check_launch((cb), #name, __FILE__, __LINE__))
#endif

/* CU_WEIGHT_KERNELS(name, args_t, KERNEL): for a body `name##_body(c, a, type)`
 * (type an int weight type), the kernels name_f32, name_f16, name_bf16,
 * name_q8_0, name_q4_0, name_q4_1 and name_i8 made by KERNEL (CU_KERNEL or
 * CU_KERNEL_SYNC), each with its type a constant so that cu_dequant's switch
 * folds away, and `static int name##_launch(cb, type, grid, block, smem,
 * const args_t *a)`, the launch of the kernel of `type` (FU_ERR_UNSUPPORTED
 * for the types without one). */
#define CU_WEIGHT_BODY_(name, args_t, sfx, type) \
    CU_DEV void name##_##sfx##_body(const cu_ctx *c, const args_t *a) { name##_body(c, a, type); }
#define CU_WEIGHT_CASE_(name, sfx, type) \
    case type:                           \
        return CU_LAUNCH(cb, name##_##sfx, grid, block, smem, *a);
#define CU_WEIGHT_KERNELS(name, args_t, KERNEL)                                                        \
    CU_WEIGHT_BODY_(name, args_t, f32, OP_TYPE_F32)                                                    \
    CU_WEIGHT_BODY_(name, args_t, f16, OP_TYPE_F16)                                                    \
    CU_WEIGHT_BODY_(name, args_t, bf16, OP_TYPE_BF16)                                                  \
    CU_WEIGHT_BODY_(name, args_t, q8_0, OP_TYPE_Q8_0)                                                  \
    CU_WEIGHT_BODY_(name, args_t, q4_0, OP_TYPE_Q4_0)                                                  \
    CU_WEIGHT_BODY_(name, args_t, q4_1, OP_TYPE_Q4_1)                                                  \
    CU_WEIGHT_BODY_(name, args_t, i8, OP_TYPE_I8)                                                      \
    KERNEL(name##_f32, args_t)                                                                         \
    KERNEL(name##_f16, args_t)                                                                         \
    KERNEL(name##_bf16, args_t)                                                                        \
    KERNEL(name##_q8_0, args_t)                                                                        \
    KERNEL(name##_q4_0, args_t)                                                                        \
    KERNEL(name##_q4_1, args_t)                                                                        \
    KERNEL(name##_i8, args_t)                                                                          \
    static int name##_launch(cuda_backend *cb, op_type type, cu_dim3 grid, cu_dim3 block, size_t smem, \
                             const args_t *a) {                                                        \
        switch (type) {                                                                                \
            CU_WEIGHT_CASE_(name, f32, OP_TYPE_F32)                                                    \
            CU_WEIGHT_CASE_(name, f16, OP_TYPE_F16)                                                    \
            CU_WEIGHT_CASE_(name, bf16, OP_TYPE_BF16)                                                  \
            CU_WEIGHT_CASE_(name, q8_0, OP_TYPE_Q8_0)                                                  \
            CU_WEIGHT_CASE_(name, q4_0, OP_TYPE_Q4_0)                                                  \
            CU_WEIGHT_CASE_(name, q4_1, OP_TYPE_Q4_1)                                                  \
            CU_WEIGHT_CASE_(name, i8, OP_TYPE_I8)                                                      \
        default:                                                                                       \
            return fu_errorf(FU_ERR_UNSUPPORTED, "%s: no kernel for %s weights", #name,                \
                             op_type_name(type));                                                      \
        }                                                                                              \
    }

/* ---- device helpers --------------------------------------------------------------------- */

CU_DEV unsigned cu_tid(const cu_ctx *c) { return c->thread_idx.x; }
CU_DEV unsigned cu_lane(const cu_ctx *c) { return c->thread_idx.x % CU_WARP; }
CU_DEV unsigned cu_warp_id(const cu_ctx *c) { return c->thread_idx.x / CU_WARP; }
/* Linear block index over a 2-D grid. */
CU_DEV int64_t cu_block(const cu_ctx *c) { return (int64_t)c->block_idx.y * c->grid_dim.x + c->block_idx.x; }
/* Grid-stride loop start and step over 1-D grids of 1-D blocks. */
CU_DEV int64_t cu_gid(const cu_ctx *c) { return (int64_t)c->block_idx.x * c->block_dim.x + c->thread_idx.x; }
CU_DEV int64_t cu_gstride(const cu_ctx *c) { return (int64_t)c->grid_dim.x * c->block_dim.x; }

#ifdef FUSION_CUDA_EMU
#define cu_syncthreads(c) cu_emu_syncthreads(c)
#define cu_syncwarp(c) cu_emu_syncwarp(c)
CU_DEV float cu_shfl_xor(const cu_ctx *c, float v, int mask) { return cu_emu_shfl_xor(c, v, mask); }
/* v[0..n) = sum (or max) over the warp of every lane's v[0..n); all 32 lanes must call. */
CU_DEV void cu_warp_sum_n(const cu_ctx *c, float *v, int n) { cu_emu_warp_reduce(c, v, n, CU_EMU_REDUCE_SUM); }
CU_DEV void cu_warp_max_n(const cu_ctx *c, float *v, int n) { cu_emu_warp_reduce(c, v, n, CU_EMU_REDUCE_MAX); }
CU_DEV float cu_f16_to_f32(uint16_t h) { return op_f16_to_f32(h); }
CU_DEV uint16_t cu_f32_to_f16(float f) { return op_f32_to_f16(f); }
CU_DEV float cu_bits_to_f32(uint32_t u) {
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}
CU_DEV uint32_t cu_f32_to_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}
#else
#define cu_syncthreads(c) __syncthreads()
#define cu_syncwarp(c) __syncwarp()
CU_DEV float cu_shfl_xor(const cu_ctx *c, float v, int mask) { return __shfl_xor_sync(0xffffffffu, v, mask); }
CU_DEV void cu_warp_sum_n(const cu_ctx *c, float *v, int n) {
    for (int m = 16; m > 0; m >>= 1)
        for (int i = 0; i < n; i++) v[i] += __shfl_xor_sync(0xffffffffu, v[i], m);
}
CU_DEV void cu_warp_max_n(const cu_ctx *c, float *v, int n) {
    for (int m = 16; m > 0; m >>= 1)
        for (int i = 0; i < n; i++) v[i] = fmaxf(v[i], __shfl_xor_sync(0xffffffffu, v[i], m));
}
CU_DEV float cu_f16_to_f32(uint16_t h) { return __half2float(__ushort_as_half(h)); }
CU_DEV uint16_t cu_f32_to_f16(float f) { return __half_as_ushort(__float2half_rn(f)); }
CU_DEV float cu_bits_to_f32(uint32_t u) { return __uint_as_float(u); }
CU_DEV uint32_t cu_f32_to_bits(float f) { return __float_as_uint(f); }
#endif

CU_DEV float cu_bf16_to_f32(uint16_t h) { return cu_bits_to_f32((uint32_t)h << 16); }
/* Round to nearest even, NaN kept quiet (as op_f32_to_bf16). */
CU_DEV uint16_t cu_f32_to_bf16(float f) {
    uint32_t x = cu_f32_to_bits(f);
    if ((x & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((x >> 16) | 0x40);
    x += 0x7fffu + ((x >> 16) & 1u);
    return (uint16_t)(x >> 16);
}

/* Block-wide sum / max of v; `red` is (32) floats of shared memory; every
 * thread of the block must call; blockDim.x a multiple of 32. */
CU_DEV float cu_block_reduce(const cu_ctx *c, float v, float *red, int is_max) {
    if (is_max)
        cu_warp_max_n(c, &v, 1);
    else
        cu_warp_sum_n(c, &v, 1);
    if (cu_lane(c) == 0) red[cu_warp_id(c)] = v;
    cu_syncthreads(c);
    const unsigned nw = c->block_dim.x / CU_WARP;
    float r = red[0];
    for (unsigned i = 1; i < nw; i++) r = is_max ? fmaxf(r, red[i]) : r + red[i];
    cu_syncthreads(c); /* red may be reused */
    return r;
}

/* Element i of a row of a weight type (I8 without its row scale). */
CU_DEV float cu_dequant(int type, const uint8_t *row, int64_t i) {
    switch (type) {
    case OP_TYPE_F32:
        return ((const float *)row)[i];
    case OP_TYPE_F16:
        return cu_f16_to_f32(((const uint16_t *)row)[i]);
    case OP_TYPE_BF16:
        return cu_bf16_to_f32(((const uint16_t *)row)[i]);
    case OP_TYPE_Q8_0: {
        const uint8_t *b = row + (i / OP_QK) * (int64_t)sizeof(op_block_q8_0);
        return cu_f16_to_f32(*(const uint16_t *)b) * (float)((const int8_t *)(b + 2))[i % OP_QK];
    }
    case OP_TYPE_Q4_0: {
        const uint8_t *b = row + (i / OP_QK) * (int64_t)sizeof(op_block_q4_0);
        int j = (int)(i % OP_QK), q = b[2 + (j & 15)];
        int nib = j < 16 ? (q & 15) : (q >> 4);
        return cu_f16_to_f32(*(const uint16_t *)b) * (float)(nib - 8);
    }
    case OP_TYPE_Q4_1: {
        const uint8_t *b = row + (i / OP_QK) * (int64_t)sizeof(op_block_q4_1);
        int j = (int)(i % OP_QK), q = b[4 + (j & 15)];
        int nib = j < 16 ? (q & 15) : (q >> 4);
        return cu_f16_to_f32(*(const uint16_t *)b) * (float)nib + cu_f16_to_f32(*(const uint16_t *)(b + 2));
    }
    case OP_TYPE_I8:
        return (float)((const int8_t *)row)[i];
    default:
        return 0.0f;
    }
}

#endif
