/* emu.h -- the CPU emulator of CUDA grids: runs a kernel body for every thread of every block.
 *
 * A kernel declared barrier-free (CU_KERNEL) runs its threads one after the
 * other on the calling thread. A kernel that uses barriers or warp exchanges
 * (CU_KERNEL_SYNC) runs each thread of a block on its own host thread; the
 * blocks of the grid run one after the other. __syncthreads and __syncwarp are
 * barriers over the block's / the warp's host threads, a warp shuffle is a
 * write to a per-thread slot, a warp barrier, a read of the partner's slot and
 * a second barrier; warp reductions compute the device's butterfly order
 * exactly. Launch limits of real GPUs (1024 threads, 48 KiB of dynamic shared
 * memory, grid y/z <= 65535) are enforced, shared memory starts each block
 * filled with 0xff bytes (NaN floats), and a barrier used by a barrier-free
 * kernel, a shuffle in a partial warp, or a barrier that not every thread
 * reaches (detected by a timeout) makes the launch fail.
 */
#ifndef FU_CUDA_EMU_H
#define FU_CUDA_EMU_H

#include <stddef.h>

#include "../cu-ctx.h"

typedef struct cu_emu_kernel {
    const char *name;
    void (*fn)(const cu_ctx *c, const void *args); /* the body of one thread */
    int sync;                                      /* 1: uses barriers or warp exchanges */
} cu_emu_kernel;

/* Runs kernel k over grid x block with smem bytes of dynamic shared memory;
 * args is passed to every thread. Returns FU_OK or an error (fu_errorf names
 * file:line of the launch). */
int cu_emu_launch(const cu_emu_kernel *k, cu_dim3 grid, cu_dim3 block, size_t smem, const void *args,
                  const char *file, int line);

void cu_emu_syncthreads(const cu_ctx *c);
void cu_emu_syncwarp(const cu_ctx *c);
/* __shfl_xor_sync(0xffffffff, v, mask) over the caller's warp. */
float cu_emu_shfl_xor(const cu_ctx *c, float v, int mask);

typedef enum cu_emu_reduce_op {
    CU_EMU_REDUCE_SUM = 0,
    CU_EMU_REDUCE_MAX = 1,
} cu_emu_reduce_op;

/* Butterfly all-reduce of v[0..n) over the caller's warp (n <= CU_EMU_SLOTS),
 * bit-exact with `for (m = 16; m; m >>= 1) v = op(v, __shfl_xor_sync(.., v, m))`. */
#define CU_EMU_SLOTS 16
void cu_emu_warp_reduce(const cu_ctx *c, float *v, int n, cu_emu_reduce_op op);

#endif
