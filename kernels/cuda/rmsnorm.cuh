/* rmsnorm.cuh -- RMS normalisation on the CUDA backend (contract in ops.h). */
#ifndef FU_CUDA_RMSNORM_CUH
#define FU_CUDA_RMSNORM_CUH
#include "cuda-common.cuh"

CU_INTERNAL int cuda_rmsnorm(op_backend *be, const op_tensor *x, const op_tensor *w, float eps, op_tensor *y);

#endif
