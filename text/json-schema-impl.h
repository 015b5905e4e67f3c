/* json-schema-impl.h -- pieces of the JSON Schema compiler shared by its files (internal to text/).
 *
 * Pure functions; the caller owns the buffers it passes.
 */
#ifndef FU_JSON_SCHEMA_IMPL_H
#define FU_JSON_SCHEMA_IMPL_H

#include <stdint.h>

#include "buf.h"

/* Appends a GBNF expression matching the JSON string contents (escaped as JSON, without the
 * quotes) that regex `pattern` matches (the subset json-schema.h lists; unanchored ends match
 * any characters). FU_ERR_INVALID naming what is unsupported or malformed. */
int js_regex_gbnf(const char *pattern, fu_buf *out);

/* Appends code point c as GBNF literal text (without quotes) or, with in_class, as a class member. */
int js_gbnf_char(fu_buf *out, uint32_t c, int in_class);


#endif
