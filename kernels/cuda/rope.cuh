/* rope.cuh -- rotary position embedding on the CUDA backend (contract in ops.h). */
#ifndef FU_CUDA_ROPE_CUH
#define FU_CUDA_ROPE_CUH
#include "cuda-common.cuh"

/* pos and p->inv_freq are host memory; they are uploaded with the call. */
CU_INTERNAL int cuda_rope(op_backend *be, op_tensor *x, const int32_t *pos, const op_rope_params *p);

#endif
