/* attention.cuh -- causal grouped-query attention over per-sequence KV caches on the CUDA backend
 * (contract in ops.h). */
#ifndef FU_CUDA_ATTENTION_CUH
#define FU_CUDA_ATTENTION_CUH
#include "cuda-common.cuh"

/* a->seq, a->pos and the a->k / a->v descriptors are host memory (the caches
 * they point to are device memory); head_dim is limited to CU_ATTN_MAX_HD. */
CU_INTERNAL int cuda_attention(op_backend *be, const op_tensor *q, const op_attn *a, op_tensor *out);

#endif
