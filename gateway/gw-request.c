/* gw-request.c -- parses and validates OpenAI chat and completions request bodies. */
#include <errno.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gw.h"
#include "json-schema.h"
#include "status.h"

void gw_limits_default(gw_limits *l) {
    l->max_n = 16;
    l->max_choices = 64;
    l->max_prompts = 64;
    l->max_stop = 16;
    l->max_stop_bytes = 256;
    l->max_logit_bias = SMP_MAX_LOGIT_BIAS;
    l->max_top_logprobs = 20;
    l->max_messages = 4096;
}

void gw_request_free(gw_request *r) {
    free(r->model);
    json_decref(r->messages);
    json_decref(r->tools);
    json_decref(r->tool_choice);
    for (int i = 0; i < r->n_prompts; i++) {
        free(r->prompts[i].text);
        free(r->prompts[i].ids);
    }
    free(r->prompts);
    for (int i = 0; i < r->n_stop; i++) free(r->stop[i]);
    free(r->stop);
    free(r->bias);
    free(r->user);
    gm_grammar_free(r->grammar);
    memset(r, 0, sizeof *r);
}

/* ---- typed getters: each returns 0 when absent or null (value untouched), 1 when
 * set, or -1 after filling *err --------------------------------------------------- */

static int get_number(const json_t *body, const char *key, double lo, double hi, double *out, gw_error *err) {
    const json_t *v = json_object_get(body, key);
    if (!v || json_is_null(v)) return 0;
    if (!json_is_number(v)) {
        gw_error_set(err, 400, key, "invalid_type", "'%s' must be a number", key);
        return -1;
    }
    double x = json_number_value(v);
    if (!isfinite(x) || x < lo || x > hi) {
        gw_error_set(err, 400, key, "invalid_value", "'%s' must be between %g and %g", key, lo, hi);
        return -1;
    }
    *out = x;
    return 1;
}

static int get_int(const json_t *body, const char *key, json_int_t lo, json_int_t hi, json_int_t *out,
                   gw_error *err) {
    const json_t *v = json_object_get(body, key);
    if (!v || json_is_null(v)) return 0;
    json_int_t x;
    if (json_is_integer(v)) x = json_integer_value(v);
    else if (json_is_real(v) && floor(json_real_value(v)) == json_real_value(v) &&
             fabs(json_real_value(v)) < 9.0e15)
        x = (json_int_t)json_real_value(v);
    else {
        gw_error_set(err, 400, key, "invalid_type", "'%s' must be an integer", key);
        return -1;
    }
    if (x < lo || x > hi) {
        gw_error_set(err, 400, key, "invalid_value", "'%s' must be between %lld and %lld", key, (long long)lo,
                     (long long)hi);
        return -1;
    }
    *out = x;
    return 1;
}

static int get_bool(const json_t *body, const char *key, bool *out, gw_error *err) {
    const json_t *v = json_object_get(body, key);
    if (!v || json_is_null(v)) return 0;
    if (!json_is_boolean(v)) {
        gw_error_set(err, 400, key, "invalid_type", "'%s' must be a boolean", key);
        return -1;
    }
    *out = json_is_true(v);
    return 1;
}

static int get_string(const json_t *body, const char *key, char **out, gw_error *err) {
    const json_t *v = json_object_get(body, key);
    if (!v || json_is_null(v)) return 0;
    if (!json_is_string(v)) {
        gw_error_set(err, 400, key, "invalid_type", "'%s' must be a string", key);
        return -1;
    }
    *out = strndup(json_string_value(v), json_string_length(v));
    if (!*out) {
        gw_error_set(err, 500, NULL, NULL, "out of memory");
        return -1;
    }
    return 1;
}

/* ---- chat messages --------------------------------------------------------------- */

/* A message's content as the chat template expects it: a string (text parts of
 * an array joined), or null for assistant messages with tool calls. */
static int normalize_content(json_t *msg, int idx, gw_error *err) {
    json_t *c = json_object_get(msg, "content");
    if (!c || json_is_null(c) || json_is_string(c)) {
        if (!c) json_object_set_new(msg, "content", json_null());
        return 0;
    }
    char param[64];
    snprintf(param, sizeof param, "messages[%d].content", idx);
    if (!json_is_array(c)) {
        gw_error_set(err, 400, param, "invalid_type", "'%s' must be a string or an array of content parts", param);
        return -1;
    }
    fu_buf b = {0};
    size_t i;
    json_t *part;
    json_array_foreach(c, i, part) {
        const json_t *type = json_object_get(part, "type");
        const json_t *text = json_object_get(part, "text");
        if (!json_is_object(part) || !json_is_string(type) || strcmp(json_string_value(type), "text") ||
            !json_is_string(text)) {
            fu_buf_free(&b);
            gw_error_set(err, 400, param, "invalid_value",
                         "'%s' parts must be {\"type\": \"text\", \"text\": ...}: only text is supported", param);
            return -1;
        }
        if (fu_buf_append(&b, json_string_value(text), json_string_length(text))) {
            fu_buf_free(&b);
            gw_error_set(err, 500, NULL, NULL, "out of memory");
            return -1;
        }
    }
    json_object_set_new(msg, "content", json_stringn(b.data ? b.data : "", b.len));
    fu_buf_free(&b);
    return 0;
}

/* tools: [{"type": "function", "function": {"name", "description", "parameters"}}, ...];
 * tool_choice: "none", "auto", "required" or {"type": "function", "function": {"name"}}. */
static int parse_tools(const json_t *body, gw_request *r, gw_error *err) {
    const json_t *tools = json_object_get(body, "tools");
    if (tools && !json_is_null(tools)) {
        if (!json_is_array(tools)) return gw_error_set(err, 400, "tools", "invalid_type", "'tools' must be an array");
        size_t i;
        const json_t *t;
        json_array_foreach(tools, i, t) {
            const json_t *type = json_object_get(t, "type"), *fn = json_object_get(t, "function");
            const json_t *name = json_object_get(fn, "name");
            if (!json_is_object(t) || !json_is_string(type) || strcmp(json_string_value(type), "function") ||
                !json_is_object(fn) || !json_is_string(name) || json_string_length(name) == 0) {
                char param[32];
                snprintf(param, sizeof param, "tools[%zu]", i);
                return gw_error_set(err, 400, param, "invalid_value",
                                    "'%s' must be {\"type\": \"function\", \"function\": {\"name\": ...}}", param);
            }
        }
        if (json_array_size(tools) && !(r->tools = json_deep_copy(tools)))
            return gw_error_set(err, 500, NULL, NULL, "out of memory");
    }
    const json_t *tc = json_object_get(body, "tool_choice");
    if (!tc || json_is_null(tc)) return 0;
    const char *bad = "'tool_choice' must be \"none\", \"auto\", \"required\" or "
                      "{\"type\": \"function\", \"function\": {\"name\": ...}}";
    bool is_auto_or_none = false;
    if (json_is_string(tc)) {
        const char *v = json_string_value(tc);
        is_auto_or_none = !strcmp(v, "none") || !strcmp(v, "auto");
        if (!is_auto_or_none && strcmp(v, "required"))
            return gw_error_set(err, 400, "tool_choice", "invalid_value", "%s", bad);
    } else {
        const json_t *name = json_object_get(json_object_get(tc, "function"), "name");
        if (!json_is_object(tc) || !json_is_string(name))
            return gw_error_set(err, 400, "tool_choice", "invalid_value", "%s", bad);
    }
    if (!is_auto_or_none && !r->tools)
        return gw_error_set(err, 400, "tool_choice", "invalid_value", "'tool_choice' requires 'tools'");
    r->tool_choice = json_deep_copy(tc);
    return r->tool_choice ? 0 : gw_error_set(err, 500, NULL, NULL, "out of memory");
}

/* Whether a chat message may have this role (OpenAI's, with the deprecated "function"). */
static bool known_role(const char *role) {
    static const char *roles[] = {"system", "developer", "user", "assistant", "tool", "function"};
    for (size_t i = 0; i < sizeof roles / sizeof *roles; i++)
        if (!strcmp(role, roles[i])) return true;
    return false;
}

static int parse_messages(const json_t *body, const gw_limits *lim, gw_request *r, gw_error *err) {
    const json_t *m = json_object_get(body, "messages");
    if (!m) return gw_error_set(err, 400, "messages", "missing_required_parameter",
                                "'messages' is a required property");
    if (!json_is_array(m) || json_array_size(m) == 0)
        return gw_error_set(err, 400, "messages", "invalid_value", "'messages' must be a non-empty array");
    if (json_array_size(m) > (size_t)lim->max_messages)
        return gw_error_set(err, 400, "messages", "invalid_value", "'messages' holds more than %d messages",
                            lim->max_messages);
    r->messages = json_deep_copy(m);
    if (!r->messages) return gw_error_set(err, 500, NULL, NULL, "out of memory");
    size_t i;
    json_t *msg;
    json_array_foreach(r->messages, i, msg) {
        char param[64];
        snprintf(param, sizeof param, "messages[%zu]", i);
        if (!json_is_object(msg)) return gw_error_set(err, 400, param, "invalid_type", "'%s' must be an object", param);
        const json_t *role = json_object_get(msg, "role");
        if (!json_is_string(role) || !known_role(json_string_value(role))) {
            snprintf(param, sizeof param, "messages[%zu].role", i);
            return gw_error_set(err, 400, param, json_is_string(role) ? "invalid_value" : "invalid_type",
                                "'%s' must be one of 'system', 'developer', 'user', 'assistant', 'tool' or 'function'",
                                param);
        }
        if (normalize_content(msg, (int)i, err)) return err->http;
    }
    return parse_tools(body, r, err);
}

/* ---- completions prompts ------------------------------------------------------------ */

static int parse_ids(const json_t *arr, int vocab, const char *param, gw_prompt *p, gw_error *err) {
    size_t n = json_array_size(arr);
    if (n == 0) return gw_error_set(err, 400, param, "invalid_value", "'%s' is an empty token list", param);
    p->ids = malloc(n * sizeof *p->ids);
    if (!p->ids) return gw_error_set(err, 500, NULL, NULL, "out of memory");
    for (size_t i = 0; i < n; i++) {
        const json_t *v = json_array_get(arr, i);
        json_int_t x = json_is_integer(v) ? json_integer_value(v) : -1;
        if (!json_is_integer(v) || x < 0 || x > INT32_MAX || (vocab > 0 && x >= vocab))
            return gw_error_set(err, 400, param, "invalid_value",
                                "'%s' holds %s at index %zu: token ids must be integers in [0, %d)", param,
                                json_is_integer(v) ? "an out-of-range id" : "a non-integer", i,
                                vocab > 0 ? vocab : INT32_MAX);
        p->ids[i] = (int32_t)x;
    }
    p->n_ids = n;
    return 0;
}

static int parse_prompt(const json_t *body, const gw_limits *lim, int vocab, gw_request *r, gw_error *err) {
    const json_t *p = json_object_get(body, "prompt");
    if (!p || json_is_null(p))
        return gw_error_set(err, 400, "prompt", "missing_required_parameter", "'prompt' is a required property");
    const char *bad = "'prompt' must be a string, a list of strings, a list of token ids or a list of such lists";
    if (json_is_string(p)) {
        r->prompts = calloc(1, sizeof *r->prompts);
        if (!r->prompts) return gw_error_set(err, 500, NULL, NULL, "out of memory");
        r->n_prompts = 1;
        r->prompts[0].text = strndup(json_string_value(p), json_string_length(p));
        r->prompts[0].text_len = json_string_length(p);
        if (!r->prompts[0].text) return gw_error_set(err, 500, NULL, NULL, "out of memory");
        return 0;
    }
    if (!json_is_array(p) || json_array_size(p) == 0) return gw_error_set(err, 400, "prompt", "invalid_type", "%s", bad);
    const json_t *first = json_array_get(p, 0);
    if (json_is_integer(first)) { /* one token-id prompt */
        r->prompts = calloc(1, sizeof *r->prompts);
        if (!r->prompts) return gw_error_set(err, 500, NULL, NULL, "out of memory");
        r->n_prompts = 1;
        return parse_ids(p, vocab, "prompt", &r->prompts[0], err);
    }
    size_t n = json_array_size(p);
    if (n > (size_t)lim->max_prompts)
        return gw_error_set(err, 400, "prompt", "invalid_value", "'prompt' holds more than %d prompts", lim->max_prompts);
    r->prompts = calloc(n, sizeof *r->prompts);
    if (!r->prompts) return gw_error_set(err, 500, NULL, NULL, "out of memory");
    r->n_prompts = (int)n;
    for (size_t i = 0; i < n; i++) {
        const json_t *e = json_array_get(p, i);
        char param[48];
        snprintf(param, sizeof param, "prompt[%zu]", i);
        if (json_is_string(e)) {
            r->prompts[i].text = strndup(json_string_value(e), json_string_length(e));
            r->prompts[i].text_len = json_string_length(e);
            if (!r->prompts[i].text) return gw_error_set(err, 500, NULL, NULL, "out of memory");
        } else if (json_is_array(e)) {
            if (parse_ids(e, vocab, param, &r->prompts[i], err)) return err->http;
        } else {
            return gw_error_set(err, 400, "prompt", "invalid_type", "%s", bad);
        }
    }
    return 0;
}

/* ---- the rest -------------------------------------------------------------------------- */

static int parse_stop(const json_t *body, const gw_limits *lim, gw_request *r, gw_error *err) {
    const json_t *s = json_object_get(body, "stop");
    if (!s || json_is_null(s)) return 0;
    size_t n = json_is_string(s) ? 1 : json_is_array(s) ? json_array_size(s) : 0;
    if (!json_is_string(s) && !json_is_array(s))
        return gw_error_set(err, 400, "stop", "invalid_type", "'stop' must be a string or an array of strings");
    if (n > (size_t)lim->max_stop)
        return gw_error_set(err, 400, "stop", "invalid_value", "'stop' holds more than %d strings", lim->max_stop);
    r->stop = calloc(n ? n : 1, sizeof *r->stop);
    if (!r->stop) return gw_error_set(err, 500, NULL, NULL, "out of memory");
    for (size_t i = 0; i < n; i++) {
        const json_t *e = json_is_string(s) ? s : json_array_get(s, i);
        if (!json_is_string(e))
            return gw_error_set(err, 400, "stop", "invalid_type", "'stop' must be a string or an array of strings");
        size_t len = json_string_length(e);
        if (len > (size_t)lim->max_stop_bytes)
            return gw_error_set(err, 400, "stop", "invalid_value", "stop strings are limited to %d bytes",
                                lim->max_stop_bytes);
        if (len == 0 || memchr(json_string_value(e), '\0', len)) continue; /* an empty string never matches */
        if (!(r->stop[r->n_stop] = strdup(json_string_value(e))))
            return gw_error_set(err, 500, NULL, NULL, "out of memory");
        r->n_stop++;
    }
    return 0;
}

static int parse_bias(const json_t *body, const gw_limits *lim, int vocab, gw_request *r, gw_error *err) {
    const json_t *b = json_object_get(body, "logit_bias");
    if (!b || json_is_null(b)) return 0;
    if (!json_is_object(b))
        return gw_error_set(err, 400, "logit_bias", "invalid_type", "'logit_bias' must be an object of token id -> bias");
    size_t n = json_object_size(b);
    if (n > (size_t)lim->max_logit_bias)
        return gw_error_set(err, 400, "logit_bias", "invalid_value", "'logit_bias' holds more than %d entries",
                            lim->max_logit_bias);
    r->bias = calloc(n ? n : 1, sizeof *r->bias);
    if (!r->bias) return gw_error_set(err, 500, NULL, NULL, "out of memory");
    const char *key;
    json_t *v;
    json_object_foreach((json_t *)b, key, v) {
        char *end;
        errno = 0;
        long id = strtol(key, &end, 10);
        if (errno || end == key || *end || id < 0 || id > INT32_MAX || (vocab > 0 && id >= vocab))
            return gw_error_set(err, 400, "logit_bias", "invalid_value",
                                "'logit_bias' keys must be token ids in [0, %d)", vocab > 0 ? vocab : INT32_MAX);
        if (!json_is_number(v) || !isfinite(json_number_value(v)) || json_number_value(v) < -100 ||
            json_number_value(v) > 100)
            return gw_error_set(err, 400, "logit_bias", "invalid_value",
                                "'logit_bias' values must be numbers between -100 and 100");
        r->bias[r->n_bias].token = (int32_t)id;
        r->bias[r->n_bias].bias = (float)json_number_value(v);
        r->n_bias++;
    }
    return 0;
}

/* A number in [lo, hi] stored as a float: 0 absent, 1 set, -1 after filling *err. */
static int get_float(const json_t *body, const char *key, double lo, double hi, float *out, gw_error *err) {
    double x;
    int got = get_number(body, key, lo, hi, &x, err);
    if (got > 0) *out = (float)x;
    return got;
}

/* max_tokens (or max_completion_tokens, which wins): at least 1 for chat, 0 for
 * completions (echo only). Returns 0 or -1 after filling *err. */
static int parse_max_tokens(const json_t *body, gw_kind kind, gw_request *r, gw_error *err) {
    const json_t *mct = json_object_get(body, "max_completion_tokens");
    const char *key = mct && !json_is_null(mct) ? "max_completion_tokens" : "max_tokens";
    json_int_t v;
    int got = get_int(body, key, kind == GW_KIND_COMPLETION ? 0 : 1, INT32_MAX, &v, err);
    if (got > 0) r->max_tokens = (int)v;
    return got < 0 ? -1 : 0;
}

/* The sampling knobs (temperature, top_p, top_k, min_p, the penalties) and the seed,
 * checked in that order. Returns 0 or -1 after filling *err. */
static int parse_sampling(const json_t *body, gw_request *r, gw_error *err) {
    smp_params *p = &r->sampling;
    double top_p;
    json_int_t top_k, seed;
    if (get_float(body, "temperature", 0, 2, &p->temperature, err) < 0) return -1;
    int got = get_number(body, "top_p", 0, 1, &top_p, err);
    if (got < 0) return -1;
    if (got) p->top_p = top_p <= 0 ? 1e-6f : (float)top_p; /* 0: the most likely token only */
    got = get_int(body, "top_k", -1, INT32_MAX, &top_k, err);
    if (got < 0) return -1;
    if (got) p->top_k = top_k < 0 ? 0 : (int)top_k; /* -1: off, as 0 */
    if (get_float(body, "min_p", 0, 1, &p->min_p, err) < 0 ||
        get_float(body, "presence_penalty", -2, 2, &p->presence_penalty, err) < 0 ||
        get_float(body, "frequency_penalty", -2, 2, &p->frequency_penalty, err) < 0 ||
        get_float(body, "repetition_penalty", 0.01, 10, &p->repetition_penalty, err) < 0)
        return -1;
    got = get_int(body, "seed", INT64_MIN, INT64_MAX, &seed, err);
    if (got > 0) {
        r->has_seed = true;
        r->seed = (uint64_t)seed;
    }
    return got < 0 ? -1 : 0;
}

/* n, bounded by lim->max_n and, times the prompts, by lim->max_choices. Returns 0 or
 * -1 after filling *err. */
static int parse_n(const json_t *body, const gw_limits *lim, gw_request *r, gw_error *err) {
    json_int_t n;
    int got = get_int(body, "n", 1, lim->max_n, &n, err);
    if (got < 0) return -1;
    if (got) r->n = (int)n;
    int n_prompts = r->kind == GW_KIND_CHAT ? 1 : r->n_prompts;
    if (r->n * n_prompts > lim->max_choices) {
        gw_error_set(err, 400, "n", "invalid_value", "n x prompts = %d exceeds the limit of %d choices",
                     r->n * n_prompts, lim->max_choices);
        return -1;
    }
    return 0;
}

/* Chat: logprobs (a boolean) and top_logprobs (which needs it). Completions:
 * logprobs is the number of alternatives, and echo. Returns 0 or -1 after filling *err. */
static int parse_logprobs(const json_t *body, const gw_limits *lim, gw_request *r, gw_error *err) {
    json_int_t k;
    if (r->kind != GW_KIND_CHAT) {
        int got = get_int(body, "logprobs", 0, lim->max_top_logprobs, &k, err);
        if (got < 0) return -1;
        if (got) {
            r->logprobs = true;
            r->top_logprobs = (int)k;
        }
        return get_bool(body, "echo", &r->echo, err) < 0 ? -1 : 0;
    }
    if (get_bool(body, "logprobs", &r->logprobs, err) < 0) return -1;
    int got = get_int(body, "top_logprobs", 0, lim->max_top_logprobs, &k, err);
    if (got <= 0) return got;
    if (!r->logprobs && k > 0) {
        gw_error_set(err, 400, "top_logprobs", "invalid_value", "'top_logprobs' requires 'logprobs' to be true");
        return -1;
    }
    r->top_logprobs = (int)k;
    return 0;
}

/* stream, and stream_options (only with it): include_usage. Returns 0 or -1 after
 * filling *err. */
static int parse_stream(const json_t *body, gw_request *r, gw_error *err) {
    if (get_bool(body, "stream", &r->stream, err) < 0) return -1;
    const json_t *so = json_object_get(body, "stream_options");
    if (!so || json_is_null(so)) return 0;
    if (!json_is_object(so)) {
        gw_error_set(err, 400, "stream_options", "invalid_type", "'stream_options' must be an object");
        return -1;
    }
    if (!r->stream) {
        gw_error_set(err, 400, "stream_options", "invalid_value",
                     "'stream_options' is only allowed when 'stream' is true");
        return -1;
    }
    if (get_bool(so, "include_usage", &r->include_usage, err) < 0) {
        snprintf(err->param, sizeof err->param, "stream_options.include_usage");
        return -1;
    }
    return 0;
}

/* ---- structured output ------------------------------------------------------------------ */

/* A 400 naming `param` for a grammar or schema that did not compile (500 when out of memory). */
static int grammar_error(gw_error *err, const char *param, int rc) {
    if (rc == FU_ERR_NOMEM) return gw_error_set(err, 500, NULL, NULL, "out of memory");
    return gw_error_set(err, 400, param, "invalid_value", "Invalid '%s': %s", param, fu_last_error());
}

/* After building r->grammar (rc its status): the error for `param`, or, when it was built, one
 * if a matcher cannot start on it (a grammar too ambiguous to follow: FU_ERR_EXHAUSTED). */
static int grammar_ready(gw_request *r, gw_error *err, const char *param, int rc) {
    if (rc) return grammar_error(err, param, rc);
    gm_matcher *m = NULL;
    rc = gm_matcher_new(r->grammar, NULL, &m); /* the start state needs no vocabulary */
    gm_matcher_free(m);
    return rc ? grammar_error(err, param, rc) : 0;
}

/* response_format {"type": "json_schema", "json_schema": {"name", "schema", "strict"}}. */
static int parse_json_schema_format(const json_t *rf, gw_request *r, gw_error *err) {
    const json_t *js = json_object_get(rf, "json_schema");
    if (!json_is_object(js))
        return gw_error_set(err, 400, "response_format", "invalid_value",
                            "'response_format.json_schema' must be an object with 'name' and 'schema'");
    const json_t *name = json_object_get(js, "name"), *strict = json_object_get(js, "strict");
    const json_t *schema = json_object_get(js, "schema");
    if ((name && !json_is_string(name)) || (strict && !json_is_boolean(strict) && !json_is_null(strict)))
        return gw_error_set(err, 400, "response_format", "invalid_type",
                            "'response_format.json_schema': 'name' must be a string and 'strict' a boolean");
    if (!schema) return gw_error_set(err, 400, "response_format", "invalid_value", "'response_format.json_schema.schema' is required");
    return grammar_ready(r, err, "response_format", js_schema_grammar(schema, &r->grammar));
}

/* response_format: {"type": "text" | "json_object" | "json_schema", ...}. */
static int parse_response_format(const json_t *body, gw_request *r, gw_error *err) {
    const json_t *rf = json_object_get(body, "response_format");
    if (!rf || json_is_null(rf)) return 0;
    const json_t *type = json_object_get(rf, "type");
    if (!json_is_object(rf) || !json_is_string(type))
        return gw_error_set(err, 400, "response_format", "invalid_type",
                            "'response_format' must be an object with a string 'type'");
    const char *t = json_string_value(type);
    if (!strcmp(t, "text")) return 0;
    if (!strcmp(t, "json_schema")) return parse_json_schema_format(rf, r, err);
    if (strcmp(t, "json_object"))
        return gw_error_set(err, 400, "response_format", "invalid_value",
                            "Invalid value: '%.100s'. Supported values are: 'text', 'json_object', and 'json_schema'.", t);
    return grammar_ready(r, err, "response_format", js_object_grammar(&r->grammar));
}

/* llama.cpp's `grammar` (GBNF text) and `json_schema` (a schema), each exclusive with response_format. */
static int parse_grammar(const json_t *body, gw_request *r, gw_error *err) {
    const char *keys[] = {"grammar", "json_schema"};
    for (int k = 0; k < 2; k++) {
        const json_t *v = json_object_get(body, keys[k]);
        if (!v || json_is_null(v)) continue;
        if (r->grammar)
            return gw_error_set(err, 400, keys[k], "invalid_value",
                                "'%s' cannot be combined with 'response_format' or another grammar", keys[k]);
        if (k == 0 && !json_is_string(v))
            return gw_error_set(err, 400, "grammar", "invalid_type", "'grammar' must be a string (GBNF)");
        int rc = k == 0 ? gm_grammar_parse(json_string_value(v), json_string_length(v), "root", &r->grammar)
                        : js_schema_grammar(v, &r->grammar);
        if ((rc = grammar_ready(r, err, keys[k], rc))) return rc;
    }
    return 0;
}

/* ---- strictness ------------------------------------------------------------------------------ */

/* The top-level keys a request may hold: what this file reads, plus OpenAI's bookkeeping
 * fields that do not change the output (accepted and ignored). */
static bool known_key(const char *key, gw_kind kind) {
    static const char *common[] = {
        "model", "max_tokens", "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
        "repetition_penalty", "seed", "n", "stop", "logit_bias", "logprobs", "stream", "stream_options", "ignore_eos",
        "return_tokens_as_token_ids", "user", "grammar", "json_schema", "response_format", "metadata", "store", "service_tier"};
    static const char *chat[] = {"messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice",
                                 "parallel_tool_calls"};
    static const char *completion[] = {"prompt", "echo"};
    for (size_t i = 0; i < sizeof common / sizeof *common; i++)
        if (!strcmp(key, common[i])) return true;
    const char **extra = kind == GW_KIND_COMPLETION ? completion : chat;
    size_t n = kind == GW_KIND_COMPLETION ? sizeof completion / sizeof *completion : sizeof chat / sizeof *chat;
    for (size_t i = 0; i < n; i++)
        if (!strcmp(key, extra[i])) return true;
    return false;
}

/* OpenAI's refusal of unknown arguments, and its missing `model`. Returns 0 or the HTTP status. */
static int check_strict(const json_t *body, gw_kind kind, const gw_request *r, gw_error *err) {
    const char *key;
    json_t *v;
    json_object_foreach((json_t *)body, key, v) {
        if (!known_key(key, kind))
            return gw_error_set(err, 400, key, "unrecognized_argument", "Unrecognized request argument supplied: %.100s", key);
    }
    const json_t *tc = r->tool_choice;
    if (r->grammar && tc && !(json_is_string(tc) && (!strcmp(json_string_value(tc), "auto") || !strcmp(json_string_value(tc), "none"))))
        return gw_error_set(err, 400, "tool_choice", "invalid_value",
                            "a forced 'tool_choice' cannot be combined with 'response_format' or a grammar");
    if (kind != GW_KIND_TEMPLATE && (!r->model || !*r->model))
        return gw_error_set(err, 400, "model", "missing_required_parameter", "you must provide a model parameter");
    return 0;
}

int gw_request_parse(const json_t *body, gw_kind kind, const gw_limits *lim, int vocab, gw_request *r,
                     gw_error *err) {
    memset(r, 0, sizeof *r);
    memset(err, 0, sizeof *err);
    gw_kind strict_kind = kind;
    if (kind == GW_KIND_TEMPLATE) kind = GW_KIND_CHAT;
    r->kind = kind;
    r->max_tokens = -1;
    r->n = 1;
    r->sampling = smp_params_default();
    if (!json_is_object(body)) {
        gw_error_set(err, 400, NULL, "invalid_type", "the request body must be a JSON object");
        goto fail;
    }
    if (get_string(body, "model", &r->model, err) < 0) goto fail;
    if (kind == GW_KIND_CHAT ? parse_messages(body, lim, r, err) : parse_prompt(body, lim, vocab, r, err)) goto fail;
    if (parse_max_tokens(body, kind, r, err) || parse_sampling(body, r, err) || parse_n(body, lim, r, err) ||
        parse_stop(body, lim, r, err) || parse_bias(body, lim, vocab, r, err))
        goto fail;
    r->sampling.bias = r->bias;
    r->sampling.n_bias = r->n_bias;
    if (parse_logprobs(body, lim, r, err) || parse_stream(body, r, err) ||
        get_bool(body, "ignore_eos", &r->ignore_eos, err) < 0 ||
        get_bool(body, "return_tokens_as_token_ids", &r->tokens_as_ids, err) < 0 ||
        get_string(body, "user", &r->user, err) < 0)
        goto fail;
    if (parse_response_format(body, r, err) || parse_grammar(body, r, err) ||
        check_strict(body, strict_kind, r, err))
        goto fail;
    return 0;
fail:
    if (!err->http) gw_error_set(err, 400, NULL, NULL, "invalid request");
    gw_request_free(r);
    return err->http;
}
