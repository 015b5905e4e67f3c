/* parse.h -- strict parsing of command-line and config values: numbers and id lists.
 *
 * Stateless and thread-safe; the only allocation is fu_parse_ids' array, which
 * the caller owns. Errors set fu_last_error() (status.h) with the offending value.
 */
#ifndef FU_PARSE_H
#define FU_PARSE_H

#include <stddef.h>
#include <stdint.h>

/* A whole decimal integer in [lo, hi] (no trailing characters). Returns
 * FU_OK or FU_ERR_INVALID (fu_last_error() quotes the value). */
int fu_parse_long(const char *s, long lo, long hi, long *out);

/* A whole floating-point number that a float holds. FU_OK or FU_ERR_INVALID. */
int fu_parse_float(const char *s, float *out);

/* A whole floating-point number (a double). FU_OK or FU_ERR_INVALID. */
int fu_parse_double(const char *s, double *out);

/* "A:B", two whole integers with lo <= A <= B <= hi. FU_OK or FU_ERR_INVALID. */
int fu_parse_range(const char *s, long lo, long hi, long *a, long *b);

/* "1,2,3" -> a malloc'd array of non-negative int32 ids (caller frees *ids).
 * FU_OK, FU_ERR_INVALID (empty or malformed list) or FU_ERR_NOMEM. */
int fu_parse_ids(const char *s, int32_t **ids, size_t *n);

#endif
