/* gw-tools.h -- tool calls: the model's call format, parsing its output into OpenAI tool_calls (whole or streamed).
 *
 * Two output formats are understood:
 *   Hermes / Qwen: <tool_call>{"name": "f", "arguments": {...}}</tool_call>, any
 *     number of them, with text around them;
 *   Llama 3.x JSON: the whole output is {"name": "f", "parameters": {...}},
 *     optionally after <|python_tag|>, several calls separated by ';'.
 * A call whose JSON is malformed (or is not a {"name", "arguments"} object)
 * stays in the content as plain text.
 *
 * Threading: no shared state; a gw_tool_stream belongs to one choice and is
 * used by one thread at a time. Ownership: a stream owns its held text
 * (gw_tool_stream_free); JSON values returned are new references the caller
 * owns, and deltas appended to an array are owned by that array.
 */
#ifndef FU_GW_TOOLS_H
#define FU_GW_TOOLS_H

#include <jansson.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "grammar.h"
#include "gw.h"

typedef enum gw_tool_format {
    GW_TOOL_FORMAT_HERMES = 0, /* <tool_call>...</tool_call> */
    GW_TOOL_FORMAT_LLAMA3,     /* a bare JSON object (after <|python_tag|>) */
} gw_tool_format;

/* The format of a chat template's model, read from the template's text: Llama 3
 * templates mention <|python_tag|> or "parameters" with <|start_header_id|>;
 * anything else (NULL included) is Hermes, the most common format. */
gw_tool_format gw_tool_format_detect(const char *template_src);

/* Whether a request's tools should be parsed out of the output: tools given and
 * tool_choice (NULL when unset) is not "none". */
bool gw_tools_active(const json_t *tools, const json_t *tool_choice);

/* Streams model text, separating tool calls from content. Content that might
 * still turn out to be the start of a call is held back until it cannot. */
typedef struct gw_tool_stream {
    gw_tool_format format;
    uint64_t id_salt;   /* call ids: "call_" + 24 characters derived from it */
    int state;          /* per format, see gw-tools.c */
    fu_buf held;        /* text not yet released or parsed */
    fu_buf ws;          /* Hermes: whitespace after a call, released only before more content */
    int n_calls;        /* calls emitted so far */
} gw_tool_stream;

/* An empty stream for a model writing `format`; call ids derive from id_salt. Allocates nothing. */
void gw_tool_stream_init(gw_tool_stream *t, gw_tool_format format, uint64_t id_salt);
/* Frees the held text; safe on a zeroed or already freed stream. */
void gw_tool_stream_free(gw_tool_stream *t);
/* Feeds text[0..len) (complete UTF-8). Releasable content is appended to *content;
 * each finished call appends to `deltas` (a JSON array) two OpenAI delta objects:
 * {"index", "id", "type": "function", "function": {"name", "arguments": ""}} and
 * {"index", "function": {"arguments": "<the JSON arguments>"}}. Returns FU_OK or
 * FU_ERR_NOMEM. */
int gw_tool_stream_feed(gw_tool_stream *t, const char *text, size_t len, fu_buf *content, json_t *deltas);
/* End of the output: an unterminated call is parsed if its JSON is complete,
 * otherwise released as content; held text is released (whitespace after the
 * last call is dropped). Returns FU_OK or FU_ERR_NOMEM. */
int gw_tool_stream_flush(gw_tool_stream *t, fu_buf *content, json_t *deltas);

/* Parses a whole output. Returns the number of calls (0: plain content, nothing
 * set) with *calls a new JSON array of OpenAI tool_call objects ({"id", "type":
 * "function", "function": {"name", "arguments"}}) and *content a new JSON
 * string of the text around them, or JSON null when that is only whitespace;
 * -1 on allocation failure. */
int gw_tool_parse(gw_tool_format format, uint64_t id_salt, const char *text, size_t len, json_t **calls,
                  json_t **content);

/* The grammar that forces tool calls, for tool_choice "required" (one to four calls of any of
 * the tools) or {"type": "function", "function": {"name"}} (one call of that function), in the
 * model's format: Hermes <tool_call>\n{"name": "f", "arguments": ARGS}\n</tool_call> (calls
 * separated by a newline), Llama 3 {"name": "f", "parameters": ARGS} (separated by "; "), ARGS
 * following the tool's `parameters` schema (json-schema.h; absent: any object). *out stays NULL
 * for any other tool_choice. Returns 0 (*out the caller's), or the HTTP status with *err filled:
 * 400 naming "tool_choice" for a function not among the tools, "tools[i]" for parameters that
 * do not compile. */
int gw_tools_grammar(const json_t *tools, const json_t *tool_choice, gw_tool_format format, gm_grammar **out,
                     gw_error *err);

/* Prepares a chat for the template (messages: the request's normalized array,
 * changed in place; template_src: the template's text). An assistant
 * message's tool_calls with JSON-string arguments get them as objects (as
 * templates expect) and a null content becomes ""; when the template does not handle tool_calls they are
 * written into the content in the model's format, and when it ignores `tools`
 * (with tools given and a Hermes model) a system message describing them is
 * added. Returns 0, or the HTTP status with *err filled. */
int gw_tools_prepare_chat(json_t *messages, const json_t *tools, gw_tool_format format, const char *template_src,
                          gw_error *err);

#endif
