/* cu-ctx.h -- the kernel context: what a CUDA thread knows about itself, on the GPU or in the emulator. */
#ifndef FU_CU_CTX_H
#define FU_CU_CTX_H

/* A grid or block extent (CUDA's dim3). */
typedef struct cu_dim3 {
    unsigned x, y, z;
} cu_dim3;

struct cu_emu_launch;

/* Passed to every kernel body. On the GPU it is filled from blockIdx/threadIdx/
 * blockDim/gridDim and the dynamic shared memory; the emulator fills it per
 * emulated thread. Bodies only use 1-D blocks (thread_idx.x). */
typedef struct cu_ctx {
    cu_dim3 block_idx, thread_idx, block_dim, grid_dim;
    unsigned char *smem;       /* the block's dynamic shared memory (16-byte aligned) */
    struct cu_emu_launch *emu; /* emulator state for barriers and shuffles; NULL on the GPU */
} cu_ctx;

#endif
