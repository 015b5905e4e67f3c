/* chat-train.c -- chat fine-tuning examples: the template's rendering, tokens, and which of them train. */
#include "chat-train.h"

#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#include "status.h"

/* Renders messages[0..n) (with the generation prompt when gen) and tokenizes it. */
static int render_prefix(const tpl_template *tpl, const tok_tokenizer *tok, const json_t *msgs, size_t n,
                         const json_t *tools, int gen, int32_t **ids, size_t *n_ids) {
    json_t *part = json_array();
    for (size_t i = 0; part && i < n; i++) json_array_append(part, json_array_get(msgs, i));
    char *text = NULL;
    size_t len = 0, n_spans = 0;
    tpl_span *spans = NULL;
    int rc = part ? tpl_apply_chat_spans(tpl, part, tools, gen, tok_bos_str(tok), tok_eos_str(tok), NULL, &text, &len,
                                         &spans, &n_spans)
                  : fu_errorf(FU_ERR_NOMEM, "out of memory");
    tok_span *plain = n_spans ? malloc(n_spans * sizeof *plain) : NULL;
    if (!rc && n_spans && !plain) rc = fu_errorf(FU_ERR_NOMEM, "out of memory");
    for (size_t i = 0; !rc && i < n_spans; i++) plain[i] = (tok_span){spans[i].start, spans[i].end};
    if (!rc) rc = tok_encode_spans(tok, text, len, false, plain, n_spans, ids, n_ids);
    free(plain);
    free(spans);
    free(text);
    json_decref(part);
    return rc;
}

/* Checks the example's shape; *n_assistant counts the assistant messages that train. */
static int check_example(const json_t *ex, const json_t **msgs, size_t *n_assistant) {
    static const char *const roles[] = {"system", "developer", "user", "assistant", "tool", "function"};
    *msgs = json_is_object(ex) ? json_object_get(ex, "messages") : NULL;
    if (!json_is_array(*msgs) || !json_array_size(*msgs)) return fu_errorf(FU_ERR_FORMAT, "Missing 'messages' key.");
    *n_assistant = 0;
    size_t i;
    const json_t *m;
    json_array_foreach(*msgs, i, m) {
        const char *role = json_string_value(json_object_get(m, "role"));
        size_t r = 0;
        while (role && r < sizeof roles / sizeof roles[0] && strcmp(role, roles[r])) r++;
        if (!role || r == sizeof roles / sizeof roles[0])
            return fu_errorf(FU_ERR_FORMAT, "Invalid 'role' in message %zu.", i);
        const json_t *w = json_object_get(m, "weight");
        if (w && (!json_is_integer(w) || (json_integer_value(w) != 0 && json_integer_value(w) != 1)))
            return fu_errorf(FU_ERR_FORMAT, "Invalid 'weight' in message %zu: must be 0 or 1.", i);
        if (w && strcmp(role, "assistant"))
            return fu_errorf(FU_ERR_FORMAT, "'weight' is only allowed on assistant messages (message %zu).", i);
        *n_assistant += !strcmp(role, "assistant") && (!w || json_integer_value(w) == 1);
    }
    return *n_assistant ? FU_OK : fu_errorf(FU_ERR_FORMAT, "Example has no assistant messages that train.");
}

/* Marks the tokens of assistant message i in train (ids of the whole conversation). */
static int mark_assistant(const tpl_template *tpl, const tok_tokenizer *tok, const json_t *msgs, const json_t *tools,
                          size_t i, const int32_t *ids, size_t n, uint8_t *train) {
    int32_t *pre = NULL, *upto = NULL;
    size_t n_pre = 0, n_upto = 0;
    int rc = render_prefix(tpl, tok, msgs, i, tools, 1, &pre, &n_pre);
    if (!rc) rc = render_prefix(tpl, tok, msgs, i + 1, tools, 0, &upto, &n_upto);
    if (!rc && (n_pre > n_upto || n_upto > n || memcmp(pre, upto, n_pre * sizeof *pre) ||
                memcmp(upto, ids, n_upto * sizeof *ids)))
        rc = fu_errorf(FU_ERR_TEMPLATE, "the chat template does not render message %zu as a continuation of the "
                       "messages before it", i);
    for (size_t t = n_pre; !rc && t < n_upto; t++) train[t] = 1;
    free(pre);
    free(upto);
    return rc;
}

int chat_train_example(const tpl_template *tpl, const tok_tokenizer *tok, const json_t *ex, int32_t **ids,
                       uint8_t **train, size_t *n) {
    *ids = NULL;
    *train = NULL;
    *n = 0;
    const json_t *msgs, *tools = json_object_get(ex, "tools");
    size_t n_assistant;
    int rc = check_example(ex, &msgs, &n_assistant);
    if (!rc) rc = render_prefix(tpl, tok, msgs, json_array_size(msgs), tools, 0, ids, n);
    if (!rc && !(*train = calloc(*n ? *n : 1, 1))) rc = fu_errorf(FU_ERR_NOMEM, "out of memory");
    for (size_t i = 0; !rc && i < json_array_size(msgs); i++) {
        const json_t *m = json_array_get(msgs, i), *w = json_object_get(m, "weight");
        if (strcmp(json_string_value(json_object_get(m, "role")), "assistant") || (w && !json_integer_value(w)))
            continue;
        rc = mark_assistant(tpl, tok, msgs, tools, i, *ids, *n, *train);
    }
    if (rc) {
        free(*ids), free(*train);
        *ids = NULL, *train = NULL, *n = 0;
    }
    return rc;
}

/* An array of n ints of `a` (token ids, or labels with -100 read as -1), or the error naming the key. */
static int line_ids(const json_t *a, const char *key, int vocab, bool labels, int32_t *out, size_t n) {
    if (!json_is_array(a) || json_array_size(a) != n)
        return fu_errorf(FU_ERR_FORMAT, "\"%s\" must be an array of %zu ints", key, n);
    for (size_t i = 0; i < n; i++) {
        json_t *v = json_array_get(a, i);
        json_int_t x = json_is_integer(v) ? json_integer_value(v) : -2;
        if (labels && x == -100) x = -1;
        if (x < (labels ? -1 : 0) || x >= vocab)
            return fu_errorf(FU_ERR_FORMAT, "\"%s\"[%zu] is not a token id of [0, %d)%s", key, i, vocab,
                             labels ? " or -100" : "");
        out[i] = (int32_t)x;
    }
    return FU_OK;
}

/* {"input_ids": [...], "labels": [...]}: ids and labels (aligned with the ids). */
static int line_tokens(int vocab, const json_t *j, int32_t **ids, int32_t **lb, size_t *n) {
    const json_t *in = json_object_get(j, "input_ids"), *lab = json_object_get(j, "labels");
    *n = json_array_size(in);
    if (!*n) return fu_errorf(FU_ERR_FORMAT, "no \"input_ids\"");
    *ids = malloc(*n * sizeof **ids);
    *lb = malloc(*n * sizeof **lb);
    if (!*ids || !*lb) return fu_errorf(FU_ERR_NOMEM, "out of memory");
    int rc = line_ids(in, "input_ids", vocab, false, *ids, *n);
    if (!rc && lab) rc = line_ids(lab, "labels", vocab, true, *lb, *n);
    else if (!rc) memcpy(*lb, *ids, *n * sizeof **lb);
    return rc;
}

/* A chat example: ids and labels (the ids the loss is taken on, else -1). */
static int line_chat(const tpl_template *tpl, const tok_tokenizer *tok, int vocab, const json_t *j, int32_t **ids,
                     int32_t **lb, size_t *n) {
    uint8_t *train = NULL;
    if (!tpl || !tok) return fu_errorf(FU_ERR_UNSUPPORTED, "chat examples need the model's tokenizer and chat template");
    int rc = chat_train_example(tpl, tok, j, ids, &train, n);
    if (!rc && !(*lb = malloc((*n ? *n : 1) * sizeof **lb))) rc = fu_errorf(FU_ERR_NOMEM, "out of memory");
    for (size_t t = 0; !rc && t < *n; t++) {
        if ((*ids)[t] < 0 || (*ids)[t] >= vocab)
            rc = fu_errorf(FU_ERR_FORMAT, "token id %d outside the model's vocabulary of %d", (*ids)[t], vocab);
        (*lb)[t] = train[t] ? (*ids)[t] : -1;
    }
    free(train);
    return rc;
}

int chat_train_line(const tpl_template *tpl, const tok_tokenizer *tok, int vocab, const char *line, size_t len,
                    int32_t **ids, int32_t **targets, size_t *n) {
    *ids = *targets = NULL;
    *n = 0;
    json_error_t err;
    json_t *j = json_loadb(line, len, 0, &err);
    int rc = !json_is_object(j) ? fu_errorf(FU_ERR_FORMAT, "not a JSON object (%s)", j ? "another value" : err.text)
             : json_object_get(j, "messages") ? line_chat(tpl, tok, vocab, j, ids, targets, n)
             : json_object_get(j, "input_ids") ? line_tokens(vocab, j, ids, targets, n)
                                               : fu_errorf(FU_ERR_FORMAT, "Missing 'messages' key.");
    json_decref(j);
    if (rc) {
        free(*ids), free(*targets);
        *ids = *targets = NULL, *n = 0;
        return rc;
    }
    for (size_t t = 0; t < *n; t++) (*targets)[t] = t + 1 < *n ? (*targets)[t + 1] : -1;
    return FU_OK;
}
