/* json-schema.h -- JSON Schema compiled to a grammar (GBNF) for structured output.
 *
 * Pure functions, safe from any thread; the caller owns what they return (free() the text,
 * gm_grammar_free the grammar) and keeps ownership of the schema it passes.
 *
 * Supported: type (object, array, string, number, integer, boolean, null, or a list of them),
 * properties, required, additionalProperties (false: no other keys; true, absent or a schema:
 * other keys allowed), enum, const, items, minItems, maxItems, $ref into $defs / definitions
 * or "#" (recursion is fine while it terminates), anyOf and oneOf (both as anyOf), allOf of one
 * schema, string pattern (a regex subset: literals, classes, `.`, escapes \d \w \s, ? * +
 * {m,n}, groups, alternation, ^ and $ at the ends), format (date, time, date-time, uuid,
 * email), minLength, maxLength; annotations (title, description, default, examples, ...) are
 * ignored. Properties come out in the schema's order; optional ones may be left out. Any other
 * keyword is an error naming it. Whitespace between tokens is bounded (one space, or a newline
 * and up to 12 spaces), numbers have at most 16 digits before and after the point.
 */
#ifndef FU_JSON_SCHEMA_H
#define FU_JSON_SCHEMA_H

#include <jansson.h>
#include <stddef.h>

#include "buf.h"
#include "grammar.h"

#define JS_MAX_SCHEMA_BYTES (1u << 20) /* the schema's compact JSON text */
#define JS_MAX_DEPTH 64                 /* nested schemas */

/* Writes the GBNF of `schema` (start rule "root") into *text (malloc'd, NUL-terminated, *len
 * bytes). FU_ERR_INVALID with fu_last_error() naming the keyword and its JSON pointer for an
 * unsupported keyword, a malformed schema, a $ref that resolves nowhere or loops; FU_ERR_EXHAUSTED
 * for a schema over JS_MAX_SCHEMA_BYTES or nested deeper than JS_MAX_DEPTH. */
int js_schema_gbnf(const json_t *schema, char **text, size_t *len);

/* Appends the rules of `schema` to out (the caller's), every name starting with `prefix`
 * (at most 12 letters, digits or '-'), the start rule named "<prefix>root"; the shared rules
 * (js_base_rules) are left out, for grammars that hold several schemas. Errors as js_schema_gbnf;
 * on failure out may hold a partial text. */
int js_schema_rules(const json_t *schema, const char *prefix, fu_buf *out);

/* js_schema_gbnf, then gm_grammar_parse: also FU_ERR_INVALID when the schema admits no finite
 * value. On success *out is the caller's. */
int js_schema_grammar(const json_t *schema, gm_grammar **out);

/* Parses schema text[0..len) (JSON) and compiles it as js_schema_grammar. */
int js_schema_grammar_text(const char *text, size_t len, gm_grammar **out);

/* Appends s[0..n) (UTF-8) as a quoted GBNF literal; FU_OK or FU_ERR_NOMEM. */
int js_gbnf_literal(fu_buf *out, const char *s, size_t n);

/* The grammar of any JSON object (response_format "json_object"). */
int js_object_grammar(gm_grammar **out);

/* The shared rules (ws, string, number, integer, boolean, null, value, object, array) as GBNF
 * text, for grammars built elsewhere that embed JSON values. Static storage. */
const char *js_base_rules(void);

#endif
