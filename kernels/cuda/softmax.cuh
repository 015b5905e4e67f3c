/* softmax.cuh -- softmax and log-softmax over rows on the CUDA backend (contracts in ops.h). */
#ifndef FU_CUDA_SOFTMAX_CUH
#define FU_CUDA_SOFTMAX_CUH
#include "cuda-common.cuh"

CU_INTERNAL int cuda_softmax(op_backend *be, op_tensor *x);
CU_INTERNAL int cuda_log_softmax(op_backend *be, op_tensor *x);

#endif
