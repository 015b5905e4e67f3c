/* wire.c -- activation encodings for the wire. */
#include "wire.h"

#include <math.h>
#include <string.h>

#include "ops.h"
#include "status.h"

const char *wire_dtype_name(int dtype) {
    switch (dtype) {
    case WIRE_F32: return "f32";
    case WIRE_BF16: return "bf16";
    case WIRE_F16: return "f16";
    case WIRE_INT8_BLOCK: return "int8-block";
    }
    return "invalid";
}

int wire_dtype_valid(int dtype) { return dtype >= WIRE_F32 && dtype <= WIRE_INT8_BLOCK; }

size_t wire_data_bytes(int dtype, size_t n) {
    switch (dtype) {
    case WIRE_F32: return n * 4;
    case WIRE_BF16:
    case WIRE_F16: return n * 2;
    case WIRE_INT8_BLOCK: return n;
    }
    return 0;
}

size_t wire_scale_bytes(int dtype, size_t n, int block) {
    return dtype == WIRE_INT8_BLOCK && block > 0 ? n / (size_t)block * sizeof(float) : 0;
}

int wire_encode(const float *x, size_t n, int dtype, int block, uint8_t *data, uint8_t *scales) {
    switch (dtype) {
    case WIRE_F32:
        memcpy(data, x, n * sizeof(float));
        return FU_OK;
    case WIRE_BF16:
    case WIRE_F16:
        for (size_t i = 0; i < n; i++) {
            uint16_t h = dtype == WIRE_BF16 ? op_f32_to_bf16(x[i]) : op_f32_to_f16(x[i]);
            memcpy(data + 2 * i, &h, 2);
        }
        return FU_OK;
    case WIRE_INT8_BLOCK:
        if (block <= 0 || n % (size_t)block)
            return fu_errorf(FU_ERR_INVALID, "int8 blocks of %d do not divide %zu values", block, n);
        for (size_t b = 0; b < n / (size_t)block; b++) {
            const float *xb = x + b * (size_t)block;
            float amax = 0;
            for (int j = 0; j < block; j++) amax = fmaxf(amax, fabsf(xb[j]));
            float scale = amax / 127.0f, inv = scale > 0 ? 1.0f / scale : 0.0f;
            for (int j = 0; j < block; j++) ((int8_t *)data)[b * (size_t)block + j] = (int8_t)lrintf(xb[j] * inv);
            memcpy(scales + b * sizeof scale, &scale, sizeof scale);
        }
        return FU_OK;
    }
    return fu_errorf(FU_ERR_INVALID, "unknown wire dtype %d", dtype);
}

int wire_decode(const uint8_t *data, size_t data_len, const uint8_t *scales, size_t scales_len,
                int dtype, int block, size_t n, float *out, const char *what) {
    if (!wire_dtype_valid(dtype)) return fu_errorf(FU_ERR_INVALID, "%s: unknown dtype %d", what, dtype);
    if (dtype == WIRE_INT8_BLOCK && (block <= 0 || n % (size_t)block))
        return fu_errorf(FU_ERR_INVALID, "%s: int8 block size %d does not divide the last dimension", what,
                         block);
    if (data_len != wire_data_bytes(dtype, n))
        return fu_errorf(FU_ERR_INVALID, "%s: %zu bytes of data for %zu %s values (expected %zu)", what,
                         data_len, n, wire_dtype_name(dtype), wire_data_bytes(dtype, n));
    if (scales_len != wire_scale_bytes(dtype, n, block))
        return fu_errorf(FU_ERR_INVALID, "%s: %zu bytes of scales (expected %zu)", what, scales_len,
                         wire_scale_bytes(dtype, n, block));
    switch (dtype) {
    case WIRE_F32:
        memcpy(out, data, n * sizeof(float));
        break;
    case WIRE_BF16:
    case WIRE_F16:
        for (size_t i = 0; i < n; i++) {
            uint16_t h;
            memcpy(&h, data + 2 * i, 2);
            out[i] = dtype == WIRE_BF16 ? op_bf16_to_f32(h) : op_f16_to_f32(h);
        }
        break;
    case WIRE_INT8_BLOCK:
        for (size_t b = 0; b < n / (size_t)block; b++) {
            float scale;
            memcpy(&scale, scales + b * sizeof scale, sizeof scale);
            for (int j = 0; j < block; j++)
                out[b * (size_t)block + j] = scale * (float)((const int8_t *)data)[b * (size_t)block + j];
        }
        break;
    }
    for (size_t i = 0; i < n; i++)
        if (!isfinite(out[i])) return fu_errorf(FU_ERR_INVALID, "%s: non-finite value at %zu", what, i);
    return FU_OK;
}
