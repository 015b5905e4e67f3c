/* chat-template.c -- fusion-chat-template: renders a chat template from a JSON request on stdin. */
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "chat-template.h"
#include "status.h"

/*
 * Usage: fusion-chat-template [--batch] < request.json
 *
 * A request is a JSON object:
 *   {"template": "...",                       required
 *    "messages": [...], "tools": [...]|null,  rendered as apply_chat_template does
 *    "add_generation_prompt": bool, "bos_token": "...", "eos_token": "...",
 *    "kwargs": {...},                         extra template variables
 *    "context": {...},                        instead of the above: the raw variables
 *    "limits": {"max_output": n, "max_memory": n, "max_work": n, "max_depth": n,
 *               "max_steps": n}}
 *
 * Single mode prints the rendering (exact bytes) to stdout and exits 0; on a
 * template error it prints "error: <status>: <message>" to stderr and exits 1.
 * --batch reads a JSON array of requests and prints a JSON array of results,
 * each {"ok": true, "output": "..."} or {"ok": false, "status": "...",
 * "error": "..."}, exiting 0 unless the input itself is unusable. A chat
 * rendered with "messages" (no "context" or "limits") also gets "spans":
 * [[start, end], ...], the byte ranges of the output that came from the
 * request's data (tpl_apply_chat_spans).
 */

/* Renders one request. On success *out is malloc'd and *spans (NULL when the
 * request gives the raw variables) holds the data ranges; returns a fu_status. */
static int render_request(const json_t *req, char **out, size_t *out_len, json_t **spans) {
    *out = NULL;
    *out_len = 0;
    *spans = NULL;
    if (!json_is_object(req))
        return fu_errorf(FU_ERR_INVALID, "request must be a JSON object");
    const char *src = json_string_value(json_object_get(req, "template"));
    if (!src)
        return fu_errorf(FU_ERR_INVALID, "request needs a \"template\" string");
    tpl_template *tpl = NULL;
    int rc = tpl_compile(src, &tpl);
    if (rc)
        return rc;

    tpl_limits lim = {0};
    json_t *jl = json_object_get(req, "limits");
    if (json_is_object(jl)) {
        lim.max_output = (size_t)json_integer_value(json_object_get(jl, "max_output"));
        lim.max_memory = (size_t)json_integer_value(json_object_get(jl, "max_memory"));
        lim.max_work = (uint64_t)json_integer_value(json_object_get(jl, "max_work"));
        lim.max_depth = (int)json_integer_value(json_object_get(jl, "max_depth"));
        lim.max_steps = (uint64_t)json_integer_value(json_object_get(jl, "max_steps"));
    }
    json_t *ctx = json_object_get(req, "context");
    json_t *messages = json_object_get(req, "messages");
    if (ctx || jl) {
        json_t *built = NULL;
        if (!ctx) {
            /* Same variables as tpl_apply_chat, so limits can be applied. */
            built = json_object();
            json_object_set(built, "messages", messages ? messages : json_array());
            json_t *tools = json_object_get(req, "tools");
            json_object_set_new(built, "tools", tools ? json_incref(tools) : json_null());
            json_object_set_new(built, "documents", json_null());
            json_object_set_new(built, "add_generation_prompt",
                                json_boolean(json_is_true(json_object_get(req, "add_generation_prompt"))));
            const char *keys[] = {"bos_token", "eos_token"};
            for (int i = 0; i < 2; i++) {
                json_t *v = json_object_get(req, keys[i]);
                if (json_is_string(v))
                    json_object_set(built, keys[i], v);
            }
            json_t *kw = json_object_get(req, "kwargs");
            if (json_is_object(kw))
                json_object_update(built, kw);
            ctx = built;
        }
        rc = tpl_render_ex(tpl, ctx, &lim, out, out_len);
        json_decref(built);
    } else {
        if (!json_is_array(messages)) {
            tpl_free(tpl);
            return fu_errorf(FU_ERR_INVALID, "request needs a \"messages\" array or a \"context\" object");
        }
        json_t *tools = json_object_get(req, "tools");
        if (json_is_null(tools))
            tools = NULL;
        json_t *kw = json_object_get(req, "kwargs");
        tpl_span *sp = NULL;
        size_t n = 0;
        rc = tpl_apply_chat_spans(tpl, messages, tools, json_is_true(json_object_get(req, "add_generation_prompt")),
                                  json_string_value(json_object_get(req, "bos_token")),
                                  json_string_value(json_object_get(req, "eos_token")),
                                  json_is_object(kw) ? kw : NULL, out, out_len, &sp, &n);
        if (!rc) {
            *spans = json_array();
            for (size_t i = 0; i < n; i++)
                json_array_append_new(*spans, json_pack("[I,I]", (json_int_t)sp[i].start, (json_int_t)sp[i].end));
        }
        free(sp);
    }
    tpl_free(tpl);
    return rc;
}

int main(int argc, char **argv) {
    int batch = 0;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--batch")) {
            batch = 1;
        } else {
            fprintf(stderr, "usage: %s [--batch] < request.json\n", argv[0]);
            return 2;
        }
    }
    json_error_t jerr;
    json_t *in = json_loadf(stdin, JSON_ALLOW_NUL, &jerr);
    if (!in) {
        fprintf(stderr, "error: invalid JSON on stdin: %s (line %d)\n", jerr.text, jerr.line);
        return 2;
    }
    if (!batch) {
        char *out = NULL;
        size_t len = 0;
        json_t *spans;
        int rc = render_request(in, &out, &len, &spans);
        json_decref(spans);
        json_decref(in);
        if (rc) {
            fprintf(stderr, "error: %s: %s\n", fu_status_str(rc), fu_last_error());
            return 1;
        }
        fwrite(out, 1, len, stdout);
        free(out);
        return 0;
    }
    if (!json_is_array(in)) {
        fprintf(stderr, "error: --batch expects a JSON array of requests\n");
        json_decref(in);
        return 2;
    }
    json_t *results = json_array();
    size_t i;
    json_t *req;
    json_array_foreach(in, i, req) {
        char *out = NULL;
        size_t len = 0;
        json_t *spans;
        fu_error_clear();
        int rc = render_request(req, &out, &len, &spans);
        json_t *r;
        if (rc) {
            r = json_pack("{s:b, s:s, s:s}", "ok", 0, "status", fu_status_str(rc), "error", fu_last_error());
        } else {
            r = json_pack("{s:b, s:s%}", "ok", 1, "output", out, len);
            if (!r) /* not valid UTF-8 */
                r = json_pack("{s:b, s:s, s:s}", "ok", 0, "status", "invalid output", "error", "output is not UTF-8");
            else if (spans)
                json_object_set(r, "spans", spans);
        }
        json_decref(spans);
        free(out);
        json_array_append_new(results, r);
    }
    json_decref(in);
    char *dump = json_dumps(results, JSON_ENSURE_ASCII | JSON_COMPACT);
    json_decref(results);
    if (!dump) {
        fprintf(stderr, "error: out of memory\n");
        return 1;
    }
    fputs(dump, stdout);
    free(dump);
    return 0;
}
