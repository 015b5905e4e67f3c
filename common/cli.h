/* cli.h -- parsing command-line and config values: strict numbers, id lists, devices. */
#ifndef FU_CLI_H
#define FU_CLI_H

#include <stddef.h>
#include <stdint.h>

#include "ops.h"

/* A whole decimal integer in [lo, hi] (no trailing characters). Returns
 * FU_OK or FU_ERR_INVALID (fu_last_error() quotes the value). */
int fu_parse_long(const char *s, long lo, long hi, long *out);

/* A whole floating-point number. FU_OK or FU_ERR_INVALID. */
int fu_parse_float(const char *s, float *out);

/* "1,2,3" -> a malloc'd array of non-negative int32 ids (caller frees *ids).
 * FU_OK, FU_ERR_INVALID (empty or malformed list) or FU_ERR_NOMEM. */
int fu_parse_ids(const char *s, int32_t **ids, size_t *n);

/* Opens the backend a --device value names into *out: "cpu" (n_threads CPU
 * threads, 0 for all, with `isa`), "cuda" (GPU 0) or "cuda:N". Writes a
 * one-line description to desc ("cpu (avx512, 2 threads)", "cuda:0 (NVIDIA
 * H100 80GB HBM3)"). FU_OK, FU_ERR_INVALID (no such device name) or the
 * backend's failure (FU_ERR_UNSUPPORTED where no GPU can be used). */
int fu_backend_open(const char *device, int n_threads, op_cpu_isa isa, op_backend **out, char *desc,
                    size_t desc_size);

#endif
