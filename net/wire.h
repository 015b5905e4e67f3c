/* wire.h -- activations on the wire: f32, bf16, f16 or int8 blockwise absmax, to and from floats.
 *
 * Stateless and thread-safe. Callers own every buffer: encode writes into
 * the caller's data / scales, decode into the caller's floats. A wire_tensor
 * is a view: it points at bytes someone else owns (a received message, an
 * encoder's buffer) and is valid as long as they are.
 */
#ifndef FU_WIRE_H
#define FU_WIRE_H

#include <stddef.h>
#include <stdint.h>

/* Numbered as net/proto/fusion.proto's Dtype. */
typedef enum wire_dtype {
    WIRE_F32 = 1,
    WIRE_BF16 = 2,
    WIRE_F16 = 3,
    WIRE_INT8_BLOCK = 4, /* int8 q with one f32 scale per block: x = q * absmax(block) / 127 */
} wire_dtype;

#define WIRE_DEFAULT_BLOCK 64

/* A dense row-major tensor as it travels (fusion.proto's Tensor). Received
 * ones are unchecked: dtype may be 0 or unknown and the shape anything; the
 * receiver validates before decoding. */
typedef struct wire_tensor {
    int dtype;              /* WIRE_*; 0: unspecified */
    size_t n_shape;
    const int64_t *shape;   /* (n_shape) */
    const uint8_t *data;    /* (data_len) prod(shape) values of dtype */
    size_t data_len;
    const uint8_t *scales;  /* (scales_len) INT8_BLOCK only: one scale per block */
    size_t scales_len;
    int block_size;         /* INT8_BLOCK only: elements per block */
    int scale_dtype;        /* INT8_BLOCK only: WIRE_F32 (0: unspecified, read as f32) */
} wire_tensor;

/* The dtype's name ("bf16"); "invalid" for an unknown value. Static. */
const char *wire_dtype_name(int dtype);
/* Nonzero if dtype is one of WIRE_*. */
int wire_dtype_valid(int dtype);

/* Bytes of data (and of scales, for INT8_BLOCK) that n values take. */
size_t wire_data_bytes(int dtype, size_t n);
size_t wire_scale_bytes(int dtype, size_t n, int block);

/* Encodes n values into data (wire_data_bytes) and scales (wire_scale_bytes,
 * INT8_BLOCK only). n must be a multiple of block for INT8_BLOCK. */
int wire_encode(const float *x, size_t n, int dtype, int block, uint8_t *data, uint8_t *scales);

/* Decodes n values, checking that the byte counts match exactly; non-finite
 * results are rejected (FU_ERR_INVALID naming `what`). */
int wire_decode(const uint8_t *data, size_t data_len, const uint8_t *scales, size_t scales_len,
                int dtype, int block, size_t n, float *out, const char *what);

#endif
