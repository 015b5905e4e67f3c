/* chat-train.c -- chat fine-tuning examples: the template's rendering, tokens, and which of them train. */
#include "chat-train.h"

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
