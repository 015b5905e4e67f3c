/* train.cuh -- add_rows and the training (backward) ops on the CUDA backend (contracts in ops.h).
 *
 * ops.c has checked shapes, f32 contiguity, beta, first[] and target ranges;
 * these entries check that every tensor lies in this backend's memory, queue
 * their kernels on the backend's stream and return without waiting, except
 * cross_entropy when it is asked for loss or correct (host memory), which
 * waits for them. Host index arrays (rows, first, target) are copied to the
 * device per call. head_dim of attention_back is limited to CU_ATTN_MAX_HD. */
#ifndef FU_CUDA_TRAIN_CUH
#define FU_CUDA_TRAIN_CUH
#include "cuda-common.cuh"

CU_INTERNAL int cuda_add_rows(op_backend *be, op_tensor *x, const int32_t *rows, const op_tensor *y, float scale);
CU_INTERNAL int cuda_matmul_back(op_backend *be, const op_tensor *w, const op_tensor *dy, op_tensor *dx,
                                 float beta);
CU_INTERNAL int cuda_outer_acc(op_backend *be, op_tensor *dw, const op_tensor *dy, const op_tensor *x,
                               float alpha);
CU_INTERNAL int cuda_rmsnorm_back(op_backend *be, const op_tensor *x, const op_tensor *w, float eps,
                                  const op_tensor *dy, op_tensor *dx, float beta);
CU_INTERNAL int cuda_swiglu_back(op_backend *be, const op_tensor *gate, const op_tensor *up,
                                 const op_tensor *dout, op_tensor *dgate, op_tensor *dup);
CU_INTERNAL int cuda_attention_back(op_backend *be, const op_attn_train *a, const op_tensor *q,
                                    const op_tensor *k, const op_tensor *v, const op_tensor *out,
                                    const op_tensor *dout, op_tensor *dq, op_tensor *dk, op_tensor *dv);
CU_INTERNAL int cuda_cross_entropy(op_backend *be, op_tensor *logits, const int32_t *target, float weight,
                                   float *loss, uint8_t *correct);
CU_INTERNAL int cuda_dropout(op_backend *be, op_tensor *x, float p, uint64_t seed, int64_t row0);

#endif
