/* chat-template.c -- public API of the chat-template interpreter: compile once, render many times. */
#include "chat-template.h"

#include <stdlib.h>
#include <string.h>
#include <utf8proc.h>

#include "tpl-impl.h"

int tpl_compile(const char *src, tpl_template **out) {
    if (!out)
        return fu_errorf(FU_ERR_INVALID, "tpl_compile: NULL output");
    *out = NULL;
    if (!src)
        return fu_errorf(FU_ERR_INVALID, "tpl_compile: NULL template");
    size_t len = strlen(src);
    int line = 1;
    for (size_t i = 0; i < len;) {
        utf8proc_int32_t cp;
        utf8proc_ssize_t k = utf8proc_iterate((const utf8proc_uint8_t *)src + i, (utf8proc_ssize_t)(len - i), &cp);
        if (k <= 0)
            return fu_errorf(FU_ERR_TEMPLATE, "template syntax error at line %d: invalid UTF-8 at byte %zu", line, i);
        line += cp == '\n';
        i += (size_t)k;
    }
    tpl_toks toks;
    int rc = tpl_lex(src, len, &toks);
    if (rc)
        return rc;
    tpl_node *root = NULL;
    rc = tpl_parse(&toks, &root);
    tpl_toks_free(&toks);
    if (rc)
        return rc;
    tpl_template *t = calloc(1, sizeof *t);
    if (!t) {
        tpl_node_free(root);
        return fu_errorf(FU_ERR_NOMEM, "out of memory");
    }
    t->root = root;
    *out = t;
    return FU_OK;
}

void tpl_free(tpl_template *tpl) {
    if (!tpl)
        return;
    tpl_node_free(tpl->root);
    free(tpl);
}

/* Renders with the variables of `context` and then those of `data` (which
 * override them); every string inside `data` is data. *spans receives the
 * output's data ranges (the caller frees them). */
static int render(const tpl_template *tpl, const json_t *context, const json_t *data, const tpl_limits *limits,
                  char **out, size_t *out_len, tpl_spans *spans) {
    if (out)
        *out = NULL;
    if (out_len)
        *out_len = 0;
    if (!tpl || !out)
        return fu_errorf(FU_ERR_INVALID, "tpl_render: NULL template or output");
    if (context && !json_is_object(context))
        return fu_errorf(FU_ERR_INVALID, "tpl_render: context must be a JSON object");
    tpl_rt R;
    memset(&R, 0, sizeof R);
    R.tpl = tpl;
    if (limits)
        R.lim = *limits;
    if (!R.lim.max_output)
        R.lim.max_output = TPL_DEFAULT_MAX_OUTPUT;
    if (!R.lim.max_memory)
        R.lim.max_memory = TPL_DEFAULT_MAX_MEMORY;
    if (!R.lim.max_work)
        R.lim.max_work = TPL_DEFAULT_MAX_WORK;
    if (!R.lim.max_depth)
        R.lim.max_depth = TPL_DEFAULT_MAX_DEPTH;
    if (!R.lim.max_steps)
        R.lim.max_steps = TPL_DEFAULT_MAX_STEPS;
    R.fuel = R.lim.max_work;
    R.steps = R.lim.max_steps;
    R.line = 1;

    fu_buf buf = {0};
    tpl_scope root = {0};
    R.out = &buf;
    R.out_spans = spans;
    int rc;
    if (context)
        rc = tpl_from_json(&R, context, &root.vars);
    else
        rc = tpl_dict_new(&R, 0, &root.vars);
    const char *key;
    json_t *value;
    R.taint = 1;
    if (data)
        json_object_foreach((json_t *)data, key, value) {
            tpl_val v;
            if (!rc && !(rc = tpl_from_json(&R, value, &v)))
                rc = tpl_dict_set_cstr(&R, root.vars, key, v);
        }
    R.taint = 0;
    if (!rc) {
        R.root = R.scope = &root;
        rc = tpl_exec_template(&R, tpl->root);
    }
    tpl_drop(&R, root.vars);
    if (rc) {
        fu_buf_free(&buf);
        return rc;
    }
    if (!buf.data) {
        buf.data = calloc(1, 1);
        if (!buf.data)
            return fu_errorf(FU_ERR_NOMEM, "out of memory");
    }
    *out = buf.data;
    if (out_len)
        *out_len = buf.len;
    return FU_OK;
}

int tpl_render_ex(const tpl_template *tpl, const json_t *context, const tpl_limits *limits, char **out,
                  size_t *out_len) {
    tpl_spans spans = {0};
    int rc = render(tpl, context, NULL, limits, out, out_len, &spans);
    tpl_spans_free(&spans);
    return rc;
}

int tpl_render(const tpl_template *tpl, const json_t *context, char **out) {
    return tpl_render_ex(tpl, context, NULL, out, NULL);
}

int tpl_apply_chat_spans(const tpl_template *tpl, const json_t *messages, const json_t *tools,
                         int add_generation_prompt, const char *bos_token, const char *eos_token,
                         const json_t *extra_kwargs, char **out, size_t *out_len, tpl_span **spans,
                         size_t *n_spans) {
    if (out)
        *out = NULL;
    if (out_len)
        *out_len = 0;
    if (spans)
        *spans = NULL;
    if (n_spans)
        *n_spans = 0;
    if (!tpl || !out || !messages)
        return fu_errorf(FU_ERR_INVALID, "tpl_apply_chat: NULL argument");
    if (!json_is_array(messages))
        return fu_errorf(FU_ERR_INVALID, "tpl_apply_chat: messages must be a JSON array");
    if (extra_kwargs && !json_is_object(extra_kwargs))
        return fu_errorf(FU_ERR_INVALID, "tpl_apply_chat: extra kwargs must be a JSON object");
    /* the caller's own variables, then the request's data */
    json_t *ctx = json_object(), *data = json_object();
    if (!ctx || !data) {
        json_decref(ctx);
        json_decref(data);
        return fu_errorf(FU_ERR_NOMEM, "out of memory");
    }
    int bad = json_object_set_new(ctx, "add_generation_prompt", json_boolean(add_generation_prompt));
    if (bos_token)
        bad |= json_object_set_new(ctx, "bos_token", json_string(bos_token));
    if (eos_token)
        bad |= json_object_set_new(ctx, "eos_token", json_string(eos_token));
    bad |= json_object_set(data, "messages", (json_t *)messages);
    bad |= json_object_set_new(data, "tools", tools ? json_incref((json_t *)tools) : json_null());
    bad |= json_object_set_new(data, "documents", json_null());
    if (extra_kwargs)
        bad |= json_object_update(data, (json_t *)extra_kwargs);
    tpl_spans sp = {0};
    int rc = bad ? fu_errorf(FU_ERR_INVALID, "tpl_apply_chat: could not build the context (invalid UTF-8 token?)")
                 : render(tpl, ctx, data, NULL, out, out_len, &sp);
    json_decref(ctx);
    json_decref(data);
    if (!rc && spans && n_spans) {
        *spans = sp.v;
        *n_spans = sp.n;
        sp = (tpl_spans){0};
    }
    tpl_spans_free(&sp);
    return rc;
}

int tpl_apply_chat(const tpl_template *tpl, const json_t *messages, const json_t *tools,
                   int add_generation_prompt, const char *bos_token, const char *eos_token,
                   const json_t *extra_kwargs, char **out) {
    return tpl_apply_chat_spans(tpl, messages, tools, add_generation_prompt, bos_token, eos_token, extra_kwargs,
                                out, NULL, NULL, NULL);
}
