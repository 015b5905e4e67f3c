/* gw-file-check.c -- fine-tuning JSONL checks in OpenAI's words: keys, roles, special strings, the context. */
#include "gw-file-check.h"

#include <stdlib.h>
#include <string.h>

#include "chat-train.h"
#include "status.h"

int gw_file_check_init(gw_file_check *fc, const tok_tokenizer *tok, const tpl_template *tpl, int ctx) {
    memset(fc, 0, sizeof *fc);
    fc->tok = tok;
    fc->tpl = tpl;
    fc->ctx = ctx;
    int32_t v = tok ? tok_vocab_size(tok) : 0;
    for (int32_t id = 0; id < v; id++) {
        const char *str = tok_is_special(tok, id) ? tok_token_str(tok, id) : NULL;
        if (!str || !str[0]) continue;
        char **grown = realloc(fc->specials, (fc->n_specials + 1) * sizeof *grown);
        if (!grown || !(grown[fc->n_specials] = strdup(str))) {
            if (grown) fc->specials = grown;
            gw_file_check_free(fc);
            return fu_errorf(FU_ERR_NOMEM, "special tokens");
        }
        fc->specials = grown;
        fc->n_specials++;
    }
    return FU_OK;
}

void gw_file_check_free(gw_file_check *fc) {
    for (size_t i = 0; i < fc->n_specials; i++) free(fc->specials[i]);
    free(fc->specials);
    memset(fc, 0, sizeof *fc);
}

/* Fills *err as an invalid file (400, param "file") and returns 400. */
#define GW_BAD_FILE(err, ...) gw_error_set(err, 400, "file", "invalid_file_format", __VA_ARGS__)

/* Whether key is one of the NULL-terminated names. */
static bool gw_key_known(const char *key, const char *const *names) {
    for (; *names; names++)
        if (!strcmp(key, *names)) return true;
    return false;
}

/* The first key of object o not among names, or NULL. */
static const char *gw_unknown_key(const json_t *o, const char *const *names) {
    const char *key;
    json_t *v;
    json_object_foreach((json_t *)o, key, v) {
        if (!gw_key_known(key, names)) return key;
    }
    return NULL;
}

/* The special string that s contains, or NULL. */
static const char *gw_special_in(const gw_file_check *fc, const char *s) {
    for (size_t i = 0; s && i < fc->n_specials; i++)
        if (strstr(s, fc->specials[i])) return fc->specials[i];
    return NULL;
}

/* The special string in a message's content (a string or an array of {"text": ...} parts), or NULL. */
static const char *gw_content_special(const gw_file_check *fc, const json_t *content) {
    if (json_is_string(content)) return gw_special_in(fc, json_string_value(content));
    size_t i;
    json_t *part;
    json_array_foreach(content, i, part) {
        const char *hit = gw_special_in(fc, json_string_value(json_object_get(part, "text")));
        if (hit) return hit;
    }
    return NULL;
}

/* Keys and special strings of example ex (line lineno): 0 or 400 with *err. */
static int gw_check_keys(const gw_file_check *fc, const json_t *ex, size_t lineno, gw_error *err) {
    static const char *const example_keys[] = {"messages", "tools", "parallel_tool_calls", NULL};
    static const char *const message_keys[] = {"role",       "content",      "name",          "weight",
                                               "tool_calls", "tool_call_id", "function_call", NULL};
    const char *bad = gw_unknown_key(ex, example_keys);
    if (bad) return GW_BAD_FILE(err, "Line %zu: Unrecognized key '%.64s' in example.", lineno, bad);
    size_t i;
    json_t *m;
    json_array_foreach(json_object_get(ex, "messages"), i, m) {
        if (!json_is_object(m)) return GW_BAD_FILE(err, "Line %zu: Message %zu is not an object.", lineno, i);
        if ((bad = gw_unknown_key(m, message_keys)))
            return GW_BAD_FILE(err, "Line %zu: Unrecognized key '%.64s' in message %zu.", lineno, bad, i);
        if ((bad = gw_content_special(fc, json_object_get(m, "content"))))
            return GW_BAD_FILE(err, "Line %zu: Message %zu contains the special token '%.64s', which is not allowed.",
                               lineno, i, bad);
    }
    return 0;
}

/* Renders and tokenizes example ex: its format (chat-train's words) and its length. */
static int gw_check_tokens(const gw_file_check *fc, const json_t *ex, size_t lineno, gw_error *err) {
    if (!fc->tpl || !fc->tok)
        return GW_BAD_FILE(err, "Line %zu: the served model has no chat template to train with.", lineno);
    int32_t *ids = NULL;
    uint8_t *train = NULL;
    size_t n = 0;
    int rc = chat_train_example(fc->tpl, fc->tok, ex, &ids, &train, &n);
    free(ids);
    free(train);
    if (rc == FU_ERR_NOMEM) return gw_error_set(err, 500, NULL, NULL, "out of memory");
    if (rc) return GW_BAD_FILE(err, "Line %zu: %s", lineno, fu_last_error());
    if (n > (size_t)fc->ctx)
        return GW_BAD_FILE(err, "Line %zu: Example is %zu tokens long, more than the model's context of %d tokens.",
                           lineno, n, fc->ctx);
    return 0;
}

int gw_file_check_line(const gw_file_check *fc, const char *text, size_t len, size_t lineno, gw_error *err) {
    if (!gw_utf8_valid(text, len)) return GW_BAD_FILE(err, "Line %zu: Invalid file format: not valid UTF-8.", lineno);
    json_error_t jerr;
    json_t *ex = json_loadb(text, len, JSON_REJECT_DUPLICATES, &jerr);
    if (!ex) return GW_BAD_FILE(err, "Line %zu: Invalid JSON: %.200s.", lineno, jerr.text);
    int rc = !json_is_object(ex) ? GW_BAD_FILE(err, "Line %zu: Each line must be a JSON object.", lineno)
             : !json_is_array(json_object_get(ex, "messages")) ? GW_BAD_FILE(err, "Line %zu: Missing 'messages' key.",
                                                                             lineno)
                                                                : gw_check_keys(fc, ex, lineno, err);
    if (!rc) rc = gw_check_tokens(fc, ex, lineno, err);
    json_decref(ex);
    return rc;
}

/* Whether text[0..len) is blank (spaces, tabs, a CR). */
static bool gw_blank(const char *text, size_t len) {
    for (size_t i = 0; i < len; i++)
        if (text[i] != ' ' && text[i] != '\t' && text[i] != '\r') return false;
    return true;
}

/* The number of lines of data[0..len) (a last line without a newline counts). */
static size_t gw_count_lines(const char *data, size_t len) {
    size_t n = 0;
    for (const char *p = data, *end = data + len; p < end; n++) {
        const char *nl = memchr(p, '\n', (size_t)(end - p));
        p = nl ? nl + 1 : end;
    }
    return n;
}

int gw_file_check_text(const gw_file_check *fc, const char *data, size_t len, int max_lines, int64_t *n_examples,
                       gw_error *err) {
    *n_examples = 0;
    size_t lines = gw_count_lines(data, len);
    if (lines > (size_t)max_lines)
        return GW_BAD_FILE(err, "The file has %zu lines: at most %d are accepted.", lines, max_lines);
    size_t lineno = 0;
    for (const char *p = data, *end = data + len; p < end;) {
        const char *nl = memchr(p, '\n', (size_t)(end - p));
        size_t n = (size_t)((nl ? nl : end) - p);
        lineno++;
        if (!gw_blank(p, n)) {
            int rc = gw_file_check_line(fc, p, n, lineno, err);
            if (rc) return rc;
            ++*n_examples;
        }
        p = nl ? nl + 1 : end;
    }
    if (!*n_examples)
        return gw_error_set(err, 400, "file", "invalid_n_examples", "The file has no examples.");
    return 0;
}
