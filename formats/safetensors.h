/* safetensors.h -- memory-mapped safetensors checkpoints, single-file or sharded, and a writer of single files.
 *
 * A checkpoint is validated when opened and immutable afterwards: any number
 * of threads may look tensors up and read them at once. Tensor data points
 * into the mapping and lives as long as the checkpoint. st_write() is
 * stateless and borrows what it is given.
 */
#ifndef FU_SAFETENSORS_H
#define FU_SAFETENSORS_H

#include <stddef.h>
#include <stdint.h>

#include "ops.h"

typedef struct st_model st_model;

/* Opens a checkpoint: `path` is a directory holding model.safetensors, or
 * model.safetensors.index.json plus its shards (model.safetensors wins when
 * both exist, as in transformers), an index file (a path ending in ".json"),
 * or a single .safetensors file. Each shard is mapped once; shard names in the
 * index must be plain file names (no '/' or ".."), and every weight_map entry
 * must be found in the shard it names.
 * Headers are parsed and validated (JSON, dtypes, shapes, data_offsets inside the
 * file and consistent with shape * dtype size); tensor data is only mapped.
 * On failure fu_last_error() names the file and tensor. *out is freed with
 * st_model_close(). */
int st_model_open(const char *path, st_model **out);
void st_model_close(st_model *m); /* NULL is a no-op */

/* Like st_model_open() for one safetensors file held in memory: `size` bytes
 * at `data` (not copied: they must outlive the model), `name` used in
 * messages. Parsed and validated exactly as a mapped file. For tests and
 * fuzzing. */
int st_model_open_mem(const void *data, size_t size, const char *name, st_model **out);

/* The path given to st_model_open() and the number of files mapped. */
const char *st_model_path(const st_model *m);
int st_model_n_shards(const st_model *m);

/* Tensors of all shards, sorted by name (names are unique across shards).
 * st_model_tensor_name gives NULL out of range. */
int64_t st_model_n_tensors(const st_model *m);
const char *st_model_tensor_name(const st_model *m, int64_t i);
int64_t st_model_find_index(const st_model *m, const char *name); /* -1 if absent */

/* What the header says about a tensor, for any dtype (including ones fusion
 * cannot compute with). Pointers are owned by the model. */
typedef struct st_tensor_info {
    const char *name;
    const char *dtype;    /* as written: "F32", "BF16", "I8", ... */
    int rank;             /* number of dims (0 for a scalar) */
    const int64_t *shape; /* (rank) safetensors order, outermost first */
    const char *file;     /* path of the shard holding it */
    uint64_t file_offset; /* of its first byte in that file */
    uint64_t nbytes;
    const void *data;     /* inside the read-only mapping */
} st_tensor_info;

/* Fills *out for tensor i; FU_ERR_RANGE out of range. */
int st_model_tensor_info(const st_model *m, int64_t i, st_tensor_info *out);

/* Gives back the resident pages of [p, p + n) in whichever shard's mapping
 * holds them (see mf_release). */
void st_model_release(const st_model *m, const void *p, size_t n);

/* Describes the named tensor as an op_tensor over the mapping. Shapes are
 * reversed into op order (safetensors (rows, cols) -> ne[0] = cols).
 * FU_ERR_NOT_FOUND if absent; FU_ERR_UNSUPPORTED for dtypes other than F32,
 * F16, BF16 (the message names the tensor and dtype) and for tensors of more
 * than 4 dims. The data is a read-only mapping: callers must not write it.
 * Unknown dtypes are accepted at open (their size cannot be checked, only
 * that data_offsets lie inside the file) and reported here. */
int st_model_find(const st_model *m, const char *name, op_tensor *out);

/* ---- writing ---------------------------------------------------------------- */

/* One tensor for st_write(): its name, dtype as safetensors spells it ("F32",
 * "BF16", ...), shape (rank dims, outermost first) and data (the product of
 * the dims times the dtype's size bytes, row-major). All borrowed. */
typedef struct st_write_tensor {
    const char *name;
    const char *dtype;
    int rank;
    const int64_t *shape;
    const void *data;
} st_write_tensor;

/* Writes the `n` tensors as one safetensors file at `path`, atomically
 * (af_write: temporary file, fsync, rename): an 8-byte little-endian header
 * length, the header JSON ({"__metadata__": {"format": "pt"}, then each
 * tensor's dtype, shape and data_offsets, in the order given}) padded with
 * spaces to a multiple of 8, then the tensors' data back to back in that
 * order. FU_ERR_INVALID (naming the tensor) for an empty or repeated name, an
 * unknown dtype, a negative dim or more than 8 dims; FU_ERR_IO / FU_ERR_NOMEM
 * as af_write(). */
int st_write(const char *path, const st_write_tensor *tensors, size_t n);

#endif
