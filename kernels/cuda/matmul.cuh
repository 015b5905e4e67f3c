/* matmul.cuh -- y = x W^T for every weight type on the CUDA backend (contract in ops.h).
 *
 * F32, F16 and BF16 weights (BF16 from compute capability 8.0), at every T:
 * cuBLAS (cublasGemmEx, f32 compute), F32 with f32 activations, F16 / BF16
 * with the activations rounded to f16 / bf16; cuBLAS streams such weights at
 * 0.8 of an H100's memory bandwidth from T = 1, where the matvec kernel below
 * reaches 0.2 at T = 1 and 0.08 at T = 8. The other weights, T <= CU_MV_MAX_T:
 * a matvec kernel per weight type, f32 math on the dequantized weights; beyond
 * CU_MV_MAX_T, Q8_0 / Q4_0 / Q4_1 / I8
 * weights (and BF16 ones on GPUs before compute capability 8.0) dequantized to f16 in chunks of rows
 * (cuda_backend.chunk_elems) with f16 activations. Activations beyond the f16
 * range (65504) become infinite on the f16 paths, as in llama.cpp's cuBLAS path. */
#ifndef FU_CUDA_MATMUL_CUH
#define FU_CUDA_MATMUL_CUH
#include "cuda-common.cuh"

CU_INTERNAL int cuda_matmul(op_backend *be, const op_tensor *w, const op_tensor *x, op_tensor *y);

/* FU_OK when w can be a weight of this backend's kernels (cu_dequant): a 2-D
 * tensor of a supported type with contiguous, aligned rows (K a multiple of 32
 * for the block types), row scales for I8, all in this backend's memory; else
 * the error, naming op and w. */
CU_INTERNAL int cuda_weight_check(cuda_backend *cb, const char *op, const op_tensor *w);

#endif
