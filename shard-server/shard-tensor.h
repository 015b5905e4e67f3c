/* shard-tensor.h -- a shard server's tensors on the wire: received hidden states and gradients decoded, replies encoded.
 *
 * Shared by the inference service (shard-rpc.c) and the training one
 * (shard-train.c). Stateless and thread-safe; buffers are the caller's
 * (grow_buf, reused across calls, freed with free(buf.p)).
 */
#ifndef FU_SHARD_TENSOR_H
#define FU_SHARD_TENSOR_H

#include <stddef.h>
#include <stdint.h>

#include "rpc-base.h"
#include "wire.h"

/* An array reused across calls, grown with fu_grow. */
typedef struct grow_buf {
    void *p;
    size_t cap; /* elements */
} grow_buf;

/* Decodes a tensor of shape (n, D), n >= 1, into floats in `buf`: *out points
 * there, *n_out = n. INVALID_ARGUMENT naming `what` for a bad shape, dtype or
 * byte count and for non-finite values; RESOURCE_EXHAUSTED without memory. */
int shard_decode_hidden(const wire_tensor *t, int D, const char *what, int *n_out, grow_buf *buf,
                        const float **out, rpc_status *st);

/* Fills t with x (rows, cols) encoded as dtype (block: INT8_BLOCK's) into
 * bytes from `buf`; shape (2 entries) is t's. FU_OK or FU_ERR_NOMEM. */
int shard_encode_tensor(wire_tensor *t, int64_t *shape, const float *x, int64_t rows, int64_t cols, int dtype,
                        int block, grow_buf *buf);

#endif
