/* gguf.h -- read-only, memory-mapped GGUF files (v2/v3): metadata and tensors.
 *
 * gguf_open() validates everything it can up front -- magic, version, counts,
 * string lengths, value types, array sizes, tensor dims, types, alignment and
 * that every tensor's data lies inside the file -- so later getters never read
 * out of bounds. Tensor data is not touched until a caller reads it.
 *
 * A gguf_file is immutable once open: any number of threads may read it at
 * once. Strings and tensor data returned point into the mapping and live as
 * long as the file; the caller owns what *_dup functions return.
 */
#ifndef FU_GGUF_H
#define FU_GGUF_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "ops.h"

typedef enum gguf_vtype {
    GGUF_VTYPE_UINT8 = 0,
    GGUF_VTYPE_INT8 = 1,
    GGUF_VTYPE_UINT16 = 2,
    GGUF_VTYPE_INT16 = 3,
    GGUF_VTYPE_UINT32 = 4,
    GGUF_VTYPE_INT32 = 5,
    GGUF_VTYPE_FLOAT32 = 6,
    GGUF_VTYPE_BOOL = 7,
    GGUF_VTYPE_STRING = 8,
    GGUF_VTYPE_ARRAY = 9,
    GGUF_VTYPE_UINT64 = 10,
    GGUF_VTYPE_INT64 = 11,
    GGUF_VTYPE_FLOAT64 = 12,
} gguf_vtype;

typedef struct gguf_file gguf_file;

typedef struct gguf_tensor_info {
    const char *name;    /* NUL-terminated, owned by the gguf_file */
    uint32_t ggml_type;  /* GGML type id as stored */
    int n_dims;
    int64_t ne[4];       /* ne[0] innermost, unused dims 1 */
    uint64_t offset;     /* relative to the data section */
    size_t nbytes;
    const void *data;    /* inside the mapping */
} gguf_tensor_info;

/* Opens and validates `path`. On success *out owns the mapping; free it with
 * gguf_close(). On failure returns a negative status and fu_last_error() names
 * the file and what is wrong (e.g. "x.gguf: tensor 'blk.3.attn_q.weight' data
 * [..) beyond end of file (size ...)"). */
int gguf_open(const char *path, gguf_file **out);
void gguf_close(gguf_file *f); /* NULL is a no-op */

/* Like gguf_open() over `size` bytes at `data` (not copied: they must outlive
 * the gguf_file); `name` is used in messages. For headers received in memory,
 * and for tests that want every out-of-bounds read caught by ASan. */
int gguf_open_mem(const void *data, size_t size, const char *name, gguf_file **out);

const char *gguf_path(const gguf_file *f);
uint32_t gguf_version(const gguf_file *f);
uint32_t gguf_alignment(const gguf_file *f);   /* general.alignment, default 32 */
uint64_t gguf_data_offset(const gguf_file *f); /* file offset of the data section */

/* Lower-case GGML type name ("q4_1", "q5_k"), "unknown" for unknown ids. */
const char *gguf_type_name(uint32_t ggml_type);
/* Maps a GGML type id to its op_type: F32, F16, BF16, Q8_0, Q4_0, Q4_1.
 * FU_ERR_UNSUPPORTED (no message set) for the others. */
int gguf_ggml_type_to_op(uint32_t ggml_type, op_type *out);
/* "uint8", ..., "float64"; "invalid" out of range. */
const char *gguf_vtype_name(gguf_vtype t);

/* ---- metadata ---- */
/* Keys are unique (duplicates are rejected at open) and kept in file order.
 * Out-of-range indices give NULL / (gguf_vtype)-1. */
int64_t gguf_n_keys(const gguf_file *f);
const char *gguf_key_name(const gguf_file *f, int64_t i); /* NUL-terminated */
int64_t gguf_find_key(const gguf_file *f, const char *key); /* -1 if absent */
gguf_vtype gguf_key_type(const gguf_file *f, int64_t i);

/* Typed getters. Return FU_OK, FU_ERR_NOT_FOUND (key absent) or FU_ERR_FORMAT
 * (wrong type / value does not fit; fu_last_error() names the key). Integer
 * getters accept any integer type whose value fits; float getters accept
 * FLOAT32/FLOAT64. */
int gguf_get_u32(const gguf_file *f, const char *key, uint32_t *out);
int gguf_get_u64(const gguf_file *f, const char *key, uint64_t *out);
int gguf_get_i32(const gguf_file *f, const char *key, int32_t *out);
int gguf_get_i64(const gguf_file *f, const char *key, int64_t *out);
int gguf_get_f32(const gguf_file *f, const char *key, float *out);
int gguf_get_f64(const gguf_file *f, const char *key, double *out);
int gguf_get_bool(const gguf_file *f, const char *key, bool *out);
/* String value: *s points into the mapping and is NOT NUL-terminated. */
int gguf_get_str(const gguf_file *f, const char *key, const char **s, size_t *len);
/* Convenience: a malloc'd NUL-terminated copy (caller frees). */
int gguf_get_str_dup(const gguf_file *f, const char *key, char **out);

/* Arrays. gguf_get_arr gives the element type and count. For numeric element
 * types *data points at the packed little-endian values inside the mapping
 * (possibly unaligned: read with memcpy). For string arrays use
 * gguf_get_arr_str, O(1) per element (FU_ERR_RANGE if i >= n). Arrays of
 * arrays are validated at open; *data then points at the first nested array
 * (its u32 element type, u64 count, elements). */
int gguf_get_arr(const gguf_file *f, const char *key, gguf_vtype *elem_type, uint64_t *n,
                 const void **data);
int gguf_get_arr_str(const gguf_file *f, const char *key, uint64_t i, const char **s, size_t *len);

/* ---- tensors ---- */
/* Tensors are in file order with unique names. Every tensor's
 * [offset, offset + nbytes) lies inside the data section, its offset is a
 * multiple of the alignment, and no two tensors' data overlap. */
int64_t gguf_n_tensors(const gguf_file *f);
const gguf_tensor_info *gguf_tensor(const gguf_file *f, int64_t i); /* NULL out of range */
int64_t gguf_find_tensor(const gguf_file *f, const char *name); /* -1 if absent */

/* Gives back the resident pages of [p, p + n) if they are in f's mapping (see
 * mf_release); a no-op for gguf_open_mem files. */
void gguf_release(const gguf_file *f, const void *p, size_t n);

/* Describes tensor i as an op_tensor over the mapping (data not copied; the
 * mapping is read-only, so the data must not be written).
 * FU_ERR_UNSUPPORTED (naming tensor and type) if its GGML type has no op_type. */
int gguf_tensor_as_op(const gguf_file *f, int64_t i, op_tensor *out);

#endif
