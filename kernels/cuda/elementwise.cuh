/* elementwise.cuh -- swiglu, add and add_row on the CUDA backend (contracts in ops.h). */
#ifndef FU_CUDA_ELEMENTWISE_CUH
#define FU_CUDA_ELEMENTWISE_CUH
#include "cuda-common.cuh"

CU_INTERNAL int cuda_swiglu(op_backend *be, const op_tensor *gate, const op_tensor *up, op_tensor *out);
CU_INTERNAL int cuda_add(op_backend *be, op_tensor *x, const op_tensor *y);
CU_INTERNAL int cuda_add_row(op_backend *be, op_tensor *x, const op_tensor *b);

#endif
