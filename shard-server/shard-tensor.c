/* shard-tensor.c -- hidden states and gradients to and from the wire for the shard's services. */
#include "shard-tensor.h"

#include "grow.h"
#include "status.h"

int shard_decode_hidden(const wire_tensor *t, int D, const char *what, int *n_out, grow_buf *buf,
                        const float **out, rpc_status *st) {
    if (t->n_shape != 2 || t->shape[1] != D || t->shape[0] <= 0 || t->shape[0] > (1 << 20))
        return rpc_status_setf(st, RPC_INVALID_ARGUMENT, "%s: shape must be (n, %d) with n >= 1", what, D);
    int dtype = t->dtype, block = t->block_size;
    if (!wire_dtype_valid(dtype))
        return rpc_status_setf(st, RPC_INVALID_ARGUMENT, "%s: unknown dtype %d", what, dtype);
    if (dtype == WIRE_INT8_BLOCK && t->scale_dtype != WIRE_F32 && t->scale_dtype != 0)
        return rpc_status_setf(st, RPC_INVALID_ARGUMENT, "%s: int8 scales must be f32", what);
    size_t n = (size_t)t->shape[0] * (size_t)D;
    if (fu_grow(&buf->p, &buf->cap, n, sizeof(float)))
        return rpc_status_setf(st, RPC_RESOURCE_EXHAUSTED, "out of memory");
    int rc = wire_decode(t->data, t->data_len, t->scales, t->scales_len, dtype, block, n, buf->p, what);
    if (rc) return rpc_status_from_fu(st, rc);
    *n_out = (int)t->shape[0];
    *out = buf->p;
    return RPC_OK;
}

int shard_encode_tensor(wire_tensor *t, int64_t *shape, const float *x, int64_t rows, int64_t cols, int dtype,
                        int block, grow_buf *buf) {
    size_t n = (size_t)(rows * cols);
    size_t db = wire_data_bytes(dtype, n), sb = wire_scale_bytes(dtype, n, block);
    if (fu_grow(&buf->p, &buf->cap, db + sb + 1, 1)) return fu_errorf(FU_ERR_NOMEM, "reply tensor");
    uint8_t *p = buf->p;
    int rc = wire_encode(x, n, dtype, block, p, p + db);
    if (rc) return rc;
    shape[0] = rows;
    shape[1] = cols;
    *t = (wire_tensor){.dtype = dtype, .n_shape = 2, .shape = shape, .data = p, .data_len = db};
    if (dtype == WIRE_INT8_BLOCK) {
        t->scales = p + db;
        t->scales_len = sb;
        t->block_size = block;
        t->scale_dtype = WIRE_F32;
    }
    return FU_OK;
}
