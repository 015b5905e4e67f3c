/* chat-template.h -- a Jinja subset that renders Hugging Face chat templates like transformers does.
 *
 * tpl_compile parses a template once into an immutable tree; tpl_render and
 * tpl_apply_chat run it over JSON variables, each render bounded by
 * tpl_limits. Thread-safe: any number of threads may render one compiled
 * template at once (a render keeps all its state to itself); tpl_free must
 * wait until none is rendering. The caller owns the compiled template
 * (tpl_free) and every rendered string (free); JSON arguments are borrowed
 * for the duration of the call.
 */
#ifndef FU_CHAT_TEMPLATE_H
#define FU_CHAT_TEMPLATE_H

#include <jansson.h>
#include <stddef.h>
#include <stdint.h>

#include "status.h"

/*
 * Templates are interpreted with the semantics of jinja2 as configured by
 * transformers' apply_chat_template: ImmutableSandboxedEnvironment with
 * trim_blocks, lstrip_blocks and loop controls, a `tojson` filter that keeps
 * non-ASCII text, and the globals raise_exception() and strftime_now().
 *
 * Each render is bounded by tpl_limits so that a hostile template can
 * neither hang nor exhaust memory.
 *
 * Errors: syntax errors from tpl_compile and runtime errors from rendering
 * (raise_exception, undefined values used wrongly, type errors) return
 * FU_ERR_TEMPLATE with "line N: message" in fu_last_error(); a render that
 * exceeds its limits returns FU_ERR_EXHAUSTED; bad arguments FU_ERR_INVALID;
 * allocation failure FU_ERR_NOMEM.
 *
 * Supported: {{ }}, {% %}, {# #}, whitespace control (-, +, trim_blocks,
 * lstrip_blocks), raw, if/elif/else, for/else (loop filters, unpacking,
 * loop.index/index0/revindex/revindex0/first/last/length/previtem/nextitem/
 * cycle/changed), break/continue, set (also block set and namespace
 * attributes), with, macros (positional/keyword/default arguments), filter
 * blocks, print, generation; jinja2's filters except filesizeformat, groupby,
 * pprint, random, striptags, urlencode, urlize, wordwrap and xmlattr; all of
 * its tests; common str/dict/list methods; the globals range, namespace, dict,
 * raise_exception and strftime_now.
 *
 * Known differences from jinja2 (none affects real chat templates we know):
 * integers are 64-bit (overflow is an error, not a bignum); reprs of Python
 * objects (bound methods, range(), dict views, generators) print differently;
 * Markup is not modelled (|safe and |escape return plain strings); recursive
 * for loops, call blocks, include/import/extends are rejected; slicing a
 * literal that is not a sequence is an error where jinja2's constant folding
 * yields Undefined; storing a namespace inside itself is an error.
 */

typedef struct tpl_template tpl_template;

/* A byte range [start, end) of rendered text. */
typedef struct tpl_span {
    size_t start, end;
} tpl_span;

/* Per-render resource limits; zero fields take the defaults below. */
typedef struct tpl_limits {
    size_t max_output;  /* bytes of output, including captured blocks (default 16 MiB) */
    size_t max_memory;  /* bytes held by live template values (default 256 MiB) */
    uint64_t max_work;  /* work units: ~1 per evaluated node + 1 per 32 bytes copied (default 50M) */
    int max_depth;      /* nested macro calls (default 64) */
    uint64_t max_steps; /* steps: evaluated statements, expression nodes and loop iterations, plus
                           1 per 8 variables scanned by name lookups (default 5M; each step also
                           costs 1 work unit, so max_work bounds the steps and copying together) */
} tpl_limits;

#define TPL_DEFAULT_MAX_OUTPUT ((size_t)16 << 20)
#define TPL_DEFAULT_MAX_MEMORY ((size_t)256 << 20)
#define TPL_DEFAULT_MAX_WORK ((uint64_t)50000000)
#define TPL_DEFAULT_MAX_DEPTH 64
#define TPL_DEFAULT_MAX_STEPS ((uint64_t)5000000)

/* Compiles `src` (NUL-terminated UTF-8). On success *out owns a template to
 * release with tpl_free(); on failure *out is NULL and the error names the
 * line. */
int tpl_compile(const char *src, tpl_template **out);

/* Releases a template; NULL is a no-op. No render may be in progress. */
void tpl_free(tpl_template *tpl);

/* Renders with `context` (a JSON object whose members become the template's
 * variables) under the default limits. On success *out is a NUL-terminated
 * malloc'd string the caller frees; on failure *out is NULL. */
int tpl_render(const tpl_template *tpl, const json_t *context, char **out);

/* As tpl_render with explicit limits (NULL: defaults); *out_len (may be NULL)
 * receives the output length, which matters if the output holds NUL bytes. */
int tpl_render_ex(const tpl_template *tpl, const json_t *context, const tpl_limits *limits,
                  char **out, size_t *out_len);

/* Renders a chat the way transformers' apply_chat_template does: the
 * variables are `messages` (a JSON array), `tools` (the array, or None when
 * tools is NULL), `documents` (None), `add_generation_prompt`, `bos_token`
 * and `eos_token` (left undefined when NULL), then every member of
 * `extra_kwargs` (a JSON object or NULL, e.g. {"enable_thinking": false}),
 * which overrides the rest. *out as in tpl_render. */
int tpl_apply_chat(const tpl_template *tpl, const json_t *messages, const json_t *tools,
                   int add_generation_prompt, const char *bos_token, const char *eos_token,
                   const json_t *extra_kwargs, char **out);

/* As tpl_apply_chat, but also says which bytes of the text came from the
 * request's data rather than from the template: every string inside
 * `messages`, `tools` and `extra_kwargs` is data; the template's literals,
 * bos_token, eos_token and add_generation_prompt are not. Concatenation
 * (+, ~, join, %, str.format, output captured by macros and blocks) keeps
 * the ranges of its parts exactly; any other operation on data (a filter,
 * a method, slicing...) makes its whole result data. On success *out (length
 * *out_len, may be NULL) and *spans (*n_spans sorted, disjoint, non-adjacent
 * ranges; NULL when none) are malloc'd for the caller. The text is that of
 * tpl_apply_chat. Tokenize it with special tokens parsed only outside the
 * ranges (tok_encode_spans), so that markers written in a message stay text. */
int tpl_apply_chat_spans(const tpl_template *tpl, const json_t *messages, const json_t *tools,
                         int add_generation_prompt, const char *bos_token, const char *eos_token,
                         const json_t *extra_kwargs, char **out, size_t *out_len, tpl_span **spans,
                         size_t *n_spans);

#endif
