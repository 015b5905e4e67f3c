/* get-rows.cuh -- embedding lookup for every weight type on the CUDA backend (contract in ops.h). */
#ifndef FU_CUDA_GET_ROWS_CUH
#define FU_CUDA_GET_ROWS_CUH
#include "cuda-common.cuh"

/* ids are host memory (T), already range-checked by op_get_rows. */
CU_INTERNAL int cuda_get_rows(op_backend *be, const op_tensor *table, const int32_t *ids, op_tensor *out);

#endif
