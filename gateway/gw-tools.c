/* gw-tools.c -- tool calls: Hermes and Llama 3 outputs parsed into OpenAI tool_calls; chats prepared for templates. */
#include "gw-tools.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "json-schema.h"
#include "status.h"

#define HERMES_OPEN "<tool_call>"
#define HERMES_CLOSE "</tool_call>"
#define PYTHON_TAG "<|python_tag|>"

enum { HERMES_OUTSIDE = 0, HERMES_INSIDE };
enum { LLAMA3_UNDECIDED = 0, LLAMA3_CONTENT, LLAMA3_JSON };

gw_tool_format gw_tool_format_detect(const char *src) {
    if (!src) return GW_TOOL_FORMAT_HERMES;
    if (strstr(src, HERMES_OPEN)) return GW_TOOL_FORMAT_HERMES;
    if (strstr(src, PYTHON_TAG) || (strstr(src, "<|start_header_id|>") && strstr(src, "tools")))
        return GW_TOOL_FORMAT_LLAMA3;
    return GW_TOOL_FORMAT_HERMES;
}

bool gw_tools_active(const json_t *tools, const json_t *tool_choice) {
    if (!json_is_array(tools) || json_array_size(tools) == 0) return false;
    return !(json_is_string(tool_choice) && !strcmp(json_string_value(tool_choice), "none"));
}

static bool is_space(char ch) { return ch == ' ' || ch == '\t' || ch == '\n' || ch == '\r'; }

static bool all_space(const char *s, size_t n) {
    for (size_t i = 0; i < n; i++)
        if (!is_space(s[i])) return false;
    return true;
}

/* ---- calls ------------------------------------------------------------------------------- */

static uint64_t mix64(uint64_t x) {
    x += 0x9E3779B97F4A7C15ull;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    return x ^ (x >> 31);
}

/* Appends a call's two deltas if o is {"name": "...", "arguments" | "parameters": {...}};
 * returns 1 when it was a call, 0 when not, -1 on allocation failure. */
static int emit_call(gw_tool_stream *t, const json_t *o, json_t *deltas) {
    const json_t *name = json_object_get(o, "name");
    if (!json_is_object(o) || !json_is_string(name) || json_string_length(name) == 0) return 0;
    const json_t *args = json_object_get(o, "arguments");
    if (!args) args = json_object_get(o, "parameters");
    char *a = NULL;
    if (!args || json_is_null(args)) a = strdup("{}");
    else if (json_is_object(args)) a = json_dumps(args, JSON_COMPACT);
    else if (json_is_string(args)) a = strdup(json_string_value(args)); /* already a JSON string */
    else return 0;
    if (!a) return -1;
    static const char alphabet[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789";
    char id[5 + 24 + 1] = "call_";
    uint64_t h = mix64(t->id_salt ^ mix64((uint64_t)t->n_calls));
    for (int i = 0; i < 24; i++) {
        h = mix64(h + (uint64_t)i);
        id[5 + i] = alphabet[h % 62];
    }
    id[29] = '\0';
    json_t *first = json_pack("{s:i, s:s, s:s, s:{s:O, s:s}}", "index", t->n_calls, "id", id, "type", "function",
                              "function", "name", name, "arguments", "");
    json_t *second = json_pack("{s:i, s:{s:s}}", "index", t->n_calls, "function", "arguments", a);
    free(a);
    if (!first || !second || json_array_append_new(deltas, first) || json_array_append_new(deltas, second)) {
        json_decref(second);
        return -1;
    }
    t->n_calls++;
    return 1;
}

/* ---- releasing content --------------------------------------------------------------------- */

/* Releases text as content. Whitespace alone waits in t->ws: between or after calls
 * it is noise, and it goes out with the next real content. */
static int release(gw_tool_stream *t, const char *s, size_t n, fu_buf *content) {
    if (n == 0) return FU_OK;
    if (all_space(s, n)) return fu_buf_append(&t->ws, s, n);
    if (t->ws.len && fu_buf_append(content, t->ws.data, t->ws.len)) return FU_ERR_NOMEM;
    t->ws.len = 0;
    return fu_buf_append(content, s, n);
}

/* Length of the longest proper suffix of s[0..n) that is a prefix of tag. */
static size_t partial_tag(const char *s, size_t n, const char *tag) {
    size_t tl = strlen(tag);
    for (size_t k = tl - 1 < n ? tl - 1 : n; k > 0; k--)
        if (!memcmp(s + n - k, tag, k)) return k;
    return 0;
}

/* ---- Hermes ------------------------------------------------------------------------------------ */

/* Parses the JSON of one <tool_call> body; 1: emitted, 0: not a call, -1: no memory. */
static int hermes_call(gw_tool_stream *t, const char *s, size_t n, json_t *deltas) {
    json_error_t jerr;
    json_t *o = json_loadb(s, n, 0, &jerr);
    int rc = o ? emit_call(t, o, deltas) : 0;
    json_decref(o);
    return rc;
}

static int hermes_feed(gw_tool_stream *t, fu_buf *content, json_t *deltas) {
    const size_t ol = strlen(HERMES_OPEN), cl = strlen(HERMES_CLOSE);
    for (;;) {
        const char *h = t->held.data;
        size_t hl = t->held.len;
        if (!hl) return FU_OK;
        if (t->state == HERMES_OUTSIDE) {
            const char *p = memmem(h, hl, HERMES_OPEN, ol);
            size_t cut = p ? (size_t)(p - h) : hl - partial_tag(h, hl, HERMES_OPEN);
            if (release(t, h, cut, content)) return FU_ERR_NOMEM;
            if (!p) {
                fu_buf_consume(&t->held, cut);
                return FU_OK;
            }
            fu_buf_consume(&t->held, cut + ol);
            t->state = HERMES_INSIDE;
            continue;
        }
        const char *p = memmem(h, hl, HERMES_CLOSE, cl);
        if (!p) return FU_OK;
        size_t body = (size_t)(p - h);
        int rc = hermes_call(t, h, body, deltas);
        if (rc < 0) return FU_ERR_NOMEM;
        if (rc == 0) { /* malformed: the text stays content, tags and all */
            if (release(t, HERMES_OPEN, ol, content) || release(t, h, body + cl, content)) return FU_ERR_NOMEM;
        }
        fu_buf_consume(&t->held, body + cl);
        t->state = HERMES_OUTSIDE;
    }
}

static int hermes_flush(gw_tool_stream *t, fu_buf *content, json_t *deltas) {
    if (t->state == HERMES_INSIDE) { /* unterminated: a call if its JSON is complete */
        int rc = hermes_call(t, t->held.data ? t->held.data : "", t->held.len, deltas);
        if (rc < 0) return FU_ERR_NOMEM;
        if (rc == 0 && (release(t, HERMES_OPEN, strlen(HERMES_OPEN), content) ||
                        release(t, t->held.data ? t->held.data : "", t->held.len, content)))
            return FU_ERR_NOMEM;
    } else if (release(t, t->held.data ? t->held.data : "", t->held.len, content)) {
        return FU_ERR_NOMEM;
    }
    t->held.len = 0;
    t->state = HERMES_OUTSIDE;
    return FU_OK;
}

/* ---- Llama 3 JSON ------------------------------------------------------------------------------- */

/* Releases everything held as content from now on. */
static int llama3_to_content(gw_tool_stream *t, size_t from, fu_buf *content) {
    t->state = LLAMA3_CONTENT;
    if (t->ws.len && fu_buf_append(content, t->ws.data, t->ws.len)) return FU_ERR_NOMEM;
    t->ws.len = 0;
    int rc = fu_buf_append(content, t->held.data + from, t->held.len - from);
    t->held.len = 0;
    return rc;
}

/* Takes complete calls off the front of t->held; `final`: no more text comes. */
static int llama3_parse(gw_tool_stream *t, bool final, fu_buf *content, json_t *deltas) {
    for (;;) {
        size_t i = 0;
        const char *h = t->held.data;
        while (i < t->held.len && (is_space(h[i]) || (t->n_calls > 0 && h[i] == ';'))) i++;
        if (i == t->held.len) {
            t->held.len = 0;
            return FU_OK;
        }
        if (h[i] != '{') return llama3_to_content(t, i, content);
        json_error_t jerr;
        json_t *o = json_loadb(h + i, t->held.len - i, JSON_DISABLE_EOF_CHECK, &jerr);
        if (!o) {
            if (!final && json_error_code(&jerr) == json_error_premature_end_of_input) return FU_OK;
            return llama3_to_content(t, i, content);
        }
        int rc = emit_call(t, o, deltas);
        json_decref(o);
        if (rc < 0) return FU_ERR_NOMEM;
        if (rc == 0) return llama3_to_content(t, i, content);
        fu_buf_consume(&t->held, i + (size_t)jerr.position);
    }
}

static int llama3_feed(gw_tool_stream *t, bool has_brace, fu_buf *content, json_t *deltas) {
    if (t->state == LLAMA3_CONTENT) return llama3_to_content(t, 0, content);
    if (t->state == LLAMA3_UNDECIDED) {
        const char *h = t->held.data;
        size_t i = 0, pl = strlen(PYTHON_TAG);
        while (i < t->held.len && is_space(h[i])) i++;
        size_t rest = t->held.len - i;
        if (rest == 0) return FU_OK;
        if (rest >= pl && !memcmp(h + i, PYTHON_TAG, pl)) {
            fu_buf_consume(&t->held, i + pl);
            t->state = LLAMA3_JSON;
        } else if (rest < pl && !memcmp(h + i, PYTHON_TAG, rest)) {
            return FU_OK;
        } else if (h[i] == '{') {
            t->state = LLAMA3_JSON;
        } else {
            return llama3_to_content(t, 0, content);
        }
        has_brace = true;
    }
    return has_brace ? llama3_parse(t, false, content, deltas) : FU_OK;
}

/* ---- the stream ------------------------------------------------------------------------------------ */

void gw_tool_stream_init(gw_tool_stream *t, gw_tool_format format, uint64_t id_salt) {
    memset(t, 0, sizeof *t);
    t->format = format;
    t->id_salt = id_salt;
}

void gw_tool_stream_free(gw_tool_stream *t) {
    fu_buf_free(&t->held);
    fu_buf_free(&t->ws);
}

int gw_tool_stream_feed(gw_tool_stream *t, const char *text, size_t len, fu_buf *content, json_t *deltas) {
    if (len == 0) return FU_OK;
    if (fu_buf_append(&t->held, text, len)) return FU_ERR_NOMEM;
    if (t->format == GW_TOOL_FORMAT_LLAMA3) return llama3_feed(t, memchr(text, '}', len) != NULL, content, deltas);
    return hermes_feed(t, content, deltas);
}

int gw_tool_stream_flush(gw_tool_stream *t, fu_buf *content, json_t *deltas) {
    int rc;
    if (t->format == GW_TOOL_FORMAT_LLAMA3) {
        if (t->state == LLAMA3_JSON) rc = llama3_parse(t, true, content, deltas);
        else rc = llama3_to_content(t, 0, content);
    } else {
        rc = hermes_flush(t, content, deltas);
    }
    if (rc) return rc;
    if (t->n_calls == 0 && t->ws.len && fu_buf_append(content, t->ws.data, t->ws.len)) return FU_ERR_NOMEM;
    t->ws.len = 0;
    return FU_OK;
}

int gw_tool_parse(gw_tool_format format, uint64_t id_salt, const char *text, size_t len, json_t **calls,
                  json_t **content) {
    *calls = *content = NULL;
    gw_tool_stream t;
    gw_tool_stream_init(&t, format, id_salt);
    fu_buf out = {0};
    json_t *deltas = json_array();
    int rc = deltas ? gw_tool_stream_feed(&t, text, len, &out, deltas) : FU_ERR_NOMEM;
    if (!rc) rc = gw_tool_stream_flush(&t, &out, deltas);
    int n = rc ? -1 : t.n_calls;
    gw_tool_stream_free(&t);
    if (n > 0) {
        /* each call is two deltas: the id and name, then the arguments */
        json_t *arr = json_array();
        for (int i = 0; arr && i < n; i++) {
            const json_t *first = json_array_get(deltas, (size_t)(2 * i));
            const json_t *second = json_array_get(deltas, (size_t)(2 * i + 1));
            json_t *fn = json_object_get(second, "function");
            json_t *call = json_pack("{s:O, s:s, s:{s:O, s:O}}", "id", json_object_get(first, "id"), "type",
                                     "function", "function", "name",
                                     json_object_get(json_object_get(first, "function"), "name"), "arguments",
                                     json_object_get(fn, "arguments"));
            if (!call || json_array_append_new(arr, call)) {
                json_decref(arr);
                arr = NULL;
            }
        }
        json_t *c = all_space(out.data ? out.data : "", out.len) ? json_null()
                                                                 : gw_json_string_lossy(out.data, out.len);
        if (!arr || !c) {
            json_decref(arr);
            json_decref(c);
            n = -1;
        } else {
            *calls = arr;
            *content = c;
        }
    }
    json_decref(deltas);
    fu_buf_free(&out);
    return n;
}

/* ---- the request side ---------------------------------------------------------------------------- */

/* Appends one call to *b in the model's own format. */
static int write_call(fu_buf *b, gw_tool_format format, const char *name, const json_t *args) {
    char *a = json_is_string(args) ? strdup(json_string_value(args))
              : json_is_object(args) ? json_dumps(args, JSON_COMPACT)
                                     : strdup("{}");
    if (!a) return FU_ERR_NOMEM;
    json_t *n = json_string(name);
    char *nq = n ? json_dumps(n, JSON_ENCODE_ANY) : NULL;
    json_decref(n);
    int rc = nq ? FU_OK : FU_ERR_NOMEM;
    if (!rc && format == GW_TOOL_FORMAT_HERMES)
        rc = fu_buf_appendf(b, "%s<tool_call>\n{\"name\": %s, \"arguments\": %s}\n</tool_call>", b->len ? "\n" : "",
                            nq, a);
    else if (!rc)
        rc = fu_buf_appendf(b, "%s{\"name\": %s, \"parameters\": %s}", b->len ? "; " : "", nq, a);
    free(nq);
    free(a);
    return rc;
}

/* Checks an assistant message's tool_calls; turns JSON-string arguments into objects;
 * when `inline_calls`, writes them into the content instead. */
static int prepare_tool_calls(json_t *msg, size_t idx, gw_tool_format format, bool inline_calls, gw_error *err) {
    json_t *calls = json_object_get(msg, "tool_calls");
    char param[64];
    snprintf(param, sizeof param, "messages[%zu].tool_calls", idx);
    if (!calls || json_is_null(calls)) return 0;
    if (!json_is_array(calls))
        return gw_error_set(err, 400, param, "invalid_type", "'%s' must be an array", param);
    fu_buf text = {0};
    const json_t *content = json_object_get(msg, "content");
    if (json_is_string(content) && fu_buf_append(&text, json_string_value(content), json_string_length(content)))
        return gw_error_set(err, 500, NULL, NULL, "out of memory");
    size_t i;
    json_t *call;
    json_array_foreach(calls, i, call) {
        json_t *fn = json_object_get(call, "function");
        const json_t *name = json_object_get(fn, "name");
        if (!json_is_object(call) || !json_is_object(fn) || !json_is_string(name)) {
            fu_buf_free(&text);
            return gw_error_set(err, 400, param, "invalid_value",
                                "'%s[%zu]' must be {\"type\": \"function\", \"function\": {\"name\", \"arguments\"}}",
                                param, i);
        }
        json_t *args = json_object_get(fn, "arguments");
        if (json_is_string(args)) {
            json_t *parsed = json_loads(json_string_value(args), 0, NULL);
            if (json_is_object(parsed)) json_object_set_new(fn, "arguments", parsed);
            else json_decref(parsed);
            args = json_object_get(fn, "arguments");
        }
        if (inline_calls && write_call(&text, format, json_string_value(name), args)) {
            fu_buf_free(&text);
            return gw_error_set(err, 500, NULL, NULL, "out of memory");
        }
    }
    if (inline_calls) {
        json_object_set_new(msg, "content", json_stringn(text.data ? text.data : "", text.len));
        json_object_del(msg, "tool_calls");
    } else if (!json_is_string(content)) {
        json_object_set_new(msg, "content", json_string("")); /* templates concatenate it */
    }
    fu_buf_free(&text);
    return 0;
}

/* The Hermes function-calling system prompt for a template that ignores `tools`. */
static int hermes_system_prompt(const json_t *tools, fu_buf *b) {
    int rc = fu_buf_appendf(b, "You are a function calling AI model. You are provided with function signatures within "
                               "<tools></tools> XML tags. You may call one or more functions to assist with the user "
                               "query. Don't make assumptions about what values to plug into functions. Here are the "
                               "available tools: <tools>");
    size_t i;
    const json_t *tool;
    json_array_foreach(tools, i, tool) {
        char *s = json_dumps(tool, JSON_COMPACT);
        if (!s) return FU_ERR_NOMEM;
        rc = rc ? rc : fu_buf_appendf(b, "\n%s", s);
        free(s);
    }
    if (!rc)
        rc = fu_buf_appendf(b, "\n</tools>\nFor each function call return a JSON object with the function name and "
                               "arguments within <tool_call></tool_call> XML tags as follows:\n<tool_call>\n{\"name\": "
                               "<function-name>, \"arguments\": <args-json-object>}\n</tool_call>");
    return rc;
}

int gw_tools_prepare_chat(json_t *messages, const json_t *tools, gw_tool_format format, const char *src,
                          gw_error *err) {
    bool tpl_calls = src && strstr(src, "tool_calls"), tpl_tools = src && strstr(src, "tools");
    size_t i;
    json_t *msg;
    json_array_foreach(messages, i, msg) {
        if (prepare_tool_calls(msg, i, format, !tpl_calls, err)) return err->http;
        /* a tool result without content renders as an empty one */
        const json_t *role = json_object_get(msg, "role");
        if (json_is_string(role) && !strcmp(json_string_value(role), "tool") &&
            !json_is_string(json_object_get(msg, "content")))
            json_object_set_new(msg, "content", json_string(""));
    }
    if (tpl_tools || format != GW_TOOL_FORMAT_HERMES || !json_is_array(tools) || json_array_size(tools) == 0)
        return 0;
    fu_buf sys = {0};
    json_t *first = json_array_get(messages, 0);
    const json_t *role = json_object_get(first, "role");
    const json_t *content = json_object_get(first, "content");
    bool merge = json_is_string(role) && !strcmp(json_string_value(role), "system") && json_is_string(content);
    int rc = merge ? fu_buf_append(&sys, json_string_value(content), json_string_length(content)) : FU_OK;
    if (!rc && merge) rc = fu_buf_append(&sys, "\n\n", 2);
    if (!rc) rc = hermes_system_prompt(tools, &sys);
    json_t *text = rc ? NULL : json_stringn(sys.data, sys.len);
    fu_buf_free(&sys);
    if (!text) return gw_error_set(err, 500, NULL, NULL, "out of memory");
    if (merge) json_object_set_new(first, "content", text);
    else if (json_array_insert_new(messages, 0, json_pack("{s:s, s:o}", "role", "system", "content", text)))
        return gw_error_set(err, 500, NULL, NULL, "out of memory");
    return 0;
}

/* ---- forced calls: the grammar ----------------------------------------------------------------- */

/* Appends rule "t<i>-call": one call of tools[i] with its parameters' rules. */
static int tool_call_rules(fu_buf *b, size_t i, const json_t *tool, gw_tool_format format, gw_error *err) {
    const json_t *fn = json_object_get(tool, "function"), *params = json_object_get(fn, "parameters");
    char prefix[24], param[32];
    snprintf(prefix, sizeof prefix, "t%zu-", i);
    snprintf(param, sizeof param, "tools[%zu]", i);
    json_t *any = params ? NULL : json_pack("{s:s}", "type", "object");
    int rc = js_schema_rules(params ? params : any, prefix, b);
    json_decref(any);
    if (rc) return rc == FU_ERR_NOMEM ? gw_error_set(err, 500, NULL, NULL, "out of memory")
                                      : gw_error_set(err, 400, param, "invalid_value", "Invalid '%s' parameters: %s", param,
                                                     fu_last_error());
    json_t *name = json_object_get(fn, "name");
    char *nq = json_dumps(name, JSON_ENCODE_ANY);
    fu_buf head = {0};
    rc = !nq || fu_buf_appendf(&head, "{\"name\": %s, \"%s\": ", nq, format == GW_TOOL_FORMAT_HERMES ? "arguments" : "parameters") ||
         fu_buf_appendf(b, "t%zu-call ::= ", i) || js_gbnf_literal(b, head.data, head.len) ||
         fu_buf_appendf(b, " t%zu-root \"}\"\n", i);
    free(nq);
    fu_buf_free(&head);
    return rc ? gw_error_set(err, 500, NULL, NULL, "out of memory") : 0;
}

/* The index of the tool tool_choice names, -1 when it is "required", -2 when not among them. */
static long forced_tool(const json_t *tools, const json_t *tool_choice) {
    if (json_is_string(tool_choice)) return -1;
    const char *want = json_string_value(json_object_get(json_object_get(tool_choice, "function"), "name"));
    for (size_t i = 0; want && i < json_array_size(tools); i++) {
        const json_t *n = json_object_get(json_object_get(json_array_get(tools, i), "function"), "name");
        if (json_is_string(n) && !strcmp(json_string_value(n), want)) return (long)i;
    }
    return -2;
}

/* The rules of the calls allowed (one tool, or all) and the root over them. */
static int tools_gbnf(const json_t *tools, long only, gw_tool_format format, fu_buf *b, gw_error *err) {
    fu_buf alts = {0};
    int rc = 0;
    for (size_t i = 0; !rc && i < json_array_size(tools); i++) {
        if (only >= 0 && (long)i != only) continue;
        rc = tool_call_rules(b, i, json_array_get(tools, i), format, err);
        if (!rc && fu_buf_appendf(&alts, "%st%zu-call", alts.len ? " | " : "", i)) rc = gw_error_set(err, 500, NULL, NULL, "out of memory");
    }
    const char *sep = format == GW_TOOL_FORMAT_HERMES ? "\"\\n\"" : "\"; \"";
    if (!rc && (format == GW_TOOL_FORMAT_HERMES
                    ? fu_buf_appendf(b, "call ::= \"<tool_call>\\n\" (%s) \"\\n</tool_call>\"\n", alts.data)
                    : fu_buf_appendf(b, "call ::= %s\n", alts.data)))
        rc = gw_error_set(err, 500, NULL, NULL, "out of memory");
    if (!rc && fu_buf_appendf(b, "root ::= call%s%s%s\n%s", only >= 0 ? "" : " (", only >= 0 ? "" : sep,
                              only >= 0 ? "" : " call){0,3}", js_base_rules()))
        rc = gw_error_set(err, 500, NULL, NULL, "out of memory");
    fu_buf_free(&alts);
    return rc;
}

int gw_tools_grammar(const json_t *tools, const json_t *tool_choice, gw_tool_format format, gm_grammar **out,
                     gw_error *err) {
    *out = NULL;
    if (!json_is_array(tools) || !json_array_size(tools) || !tool_choice ||
        (json_is_string(tool_choice) && strcmp(json_string_value(tool_choice), "required")))
        return 0;
    long only = forced_tool(tools, tool_choice);
    if (only == -2) return gw_error_set(err, 400, "tool_choice", "invalid_value", "'tool_choice' names a function not among 'tools'");
    fu_buf b = {0};
    int rc = tools_gbnf(tools, only, format, &b, err);
    if (!rc && gm_grammar_parse(b.data, b.len, "root", out))
        rc = gw_error_set(err, 400, "tools", "invalid_value", "the tools' call grammar: %s", fu_last_error());
    fu_buf_free(&b);
    return rc;
}
