/* kv-store.cuh -- writing token rows into per-sequence KV caches on the CUDA backend (contract in ops.h). */
#ifndef FU_CUDA_KV_STORE_CUH
#define FU_CUDA_KV_STORE_CUH
#include "cuda-common.cuh"

/* seq and pos are host memory (T); every cache is validated before anything is written. */
CU_INTERNAL int cuda_kv_store(op_backend *be, const op_tensor *src, op_tensor *const *dst, const int32_t *seq,
                              const int32_t *pos);

#endif
