/* cuda-emu.h -- the CUDA backend with every kernel run by the CPU emulator (tests only).
 *
 * Threads and ownership as for any backend (ops.h): ops are serialized by the
 * backend's lock, and the emulator runs a block's threads on host threads of
 * its own within one op. The caller owns the backend.
 */
#ifndef FU_CUDA_EMU_PUBLIC_H
#define FU_CUDA_EMU_PUBLIC_H

#include <stddef.h>

#include "ops.h"

/* Creates the CUDA backend over host memory: the same host code, kernels and
 * launch configurations as op_backend_cuda_new, with kernels run by the grid
 * emulator (emu/emu.h) and cuBLAS replaced by a reference GEMM of the same
 * contract. chunk_elems: weight elements dequantized per GEMM call (0: the
 * default; tests pass small values to cover chunking). Never NULL except on
 * out of memory. Free with op_backend_free(). */
op_backend *op_backend_cuda_emu_new(size_t chunk_elems);

#endif
