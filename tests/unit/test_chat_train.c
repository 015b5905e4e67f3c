/* test_chat_train.c -- fine-tuning examples as tokens and loss masks (chat_train_example,
 * chat_train_line) with a ChatML template and the Qwen3 tokenizer of shared/tokenizers: the loss
 * is taken on exactly the assistant messages' tokens and their end-of-turn markers, not on
 * weight-0 ones, prompts or the template's markers; a marker written inside a message stays
 * text; malformed examples are refused in OpenAI's words; token-id lines shift their labels. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "chat-train.h"
#include "status.h"

static tok_tokenizer *tok;
static tpl_template *tpl;

static const char chatml[] =
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";

static int setup(void **state) {
    (void)state;
    const char *src = getenv("FUSION_SOURCE_DIR");
    char path[4096];
    snprintf(path, sizeof path, "%s/../shared/tokenizers/qwen3/tokenizer.json", src ? src : ".");
    if (tok_load_hf(path, &tok)) return -1;
    return tpl_compile(chatml, &tpl);
}

static int teardown(void **state) {
    (void)state;
    tpl_free(tpl);
    tok_free(tok);
    return 0;
}

/* The text of the trained tokens of `json`, in order. */
static char *trained_text(const char *json, int *rc) {
    json_t *ex = json_loads(json, 0, NULL);
    int32_t *ids = NULL, *kept = NULL;
    uint8_t *train = NULL;
    size_t n = 0, k = 0;
    *rc = chat_train_example(tpl, tok, ex, &ids, &train, &n);
    char *text = NULL;
    if (!*rc) {
        kept = malloc(n * sizeof *kept);
        for (size_t t = 0; t < n; t++)
            if (train[t]) kept[k++] = ids[t];
        assert_int_equal(tok_decode(tok, kept, k, false, &text, NULL), FU_OK);
    }
    json_decref(ex);
    free(ids), free(train), free(kept);
    return text;
}

static void test_assistant_tokens_train(void **state) {
    (void)state;
    int rc;
    char *t = trained_text("{\"messages\": [{\"role\": \"system\", \"content\": \"Be brief.\"},"
                           "{\"role\": \"user\", \"content\": \"2+2?\"}, {\"role\": \"assistant\", \"content\": \"4\"},"
                           "{\"role\": \"user\", \"content\": \"Sure?\"},"
                           "{\"role\": \"assistant\", \"content\": \"Yes, 4.\"}]}",
                           &rc);
    assert_int_equal(rc, FU_OK);
    assert_string_equal(t, "4<|im_end|>\nYes, 4.<|im_end|>\n");
    free(t);
    t = trained_text("{\"messages\": [{\"role\": \"user\", \"content\": \"a\"},"
                     "{\"role\": \"assistant\", \"content\": \"wrong\", \"weight\": 0},"
                     "{\"role\": \"user\", \"content\": \"b\"}, {\"role\": \"assistant\", \"content\": \"right\", "
                     "\"weight\": 1}]}",
                     &rc);
    assert_string_equal(t, "right<|im_end|>\n");
    free(t);
}

static void test_markers_in_messages_stay_text(void **state) {
    (void)state;
    json_t *ex = json_loads("{\"messages\": [{\"role\": \"user\", \"content\": \"<|im_end|>\"},"
                            "{\"role\": \"assistant\", \"content\": \"<|im_start|>\"}]}",
                            0, NULL);
    int32_t *ids;
    uint8_t *train;
    size_t n;
    assert_int_equal(chat_train_example(tpl, tok, ex, &ids, &train, &n), FU_OK);
    int32_t im_start = -1;
    int specials = 0;
    for (size_t t = 0; t < n; t++) {
        char *piece = NULL;
        tok_decode(tok, &ids[t], 1, false, &piece, NULL);
        if (!strcmp(piece, "<|im_start|>") || !strcmp(piece, "<|im_end|>")) {
            specials++;
            if (im_start < 0) im_start = ids[t];
        }
        free(piece);
    }
    assert_int_equal(specials, 4); /* the template's two turns only */
    json_decref(ex);
    free(ids), free(train);
}

static void test_refusals(void **state) {
    (void)state;
    static const struct {
        const char *json, *msg;
    } bad[] = {
        {"{\"prompt\": \"x\"}", "Missing 'messages' key."},
        {"{\"messages\": [{\"role\": \"wizard\", \"content\": \"x\"}]}", "Invalid 'role' in message 0."},
        {"{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}]}", "no assistant messages"},
        {"{\"messages\": [{\"role\": \"user\", \"content\": \"x\"}, {\"role\": \"assistant\", \"content\": \"y\", "
         "\"weight\": 2}]}",
         "Invalid 'weight' in message 1"},
        {"{\"messages\": [{\"role\": \"user\", \"content\": \"x\", \"weight\": 0}, {\"role\": \"assistant\", "
         "\"content\": \"y\"}]}",
         "only allowed on assistant"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        int rc;
        char *t = trained_text(bad[i].json, &rc);
        assert_int_equal(rc, FU_ERR_FORMAT);
        assert_non_null(strstr(fu_last_error(), bad[i].msg));
        assert_null(t);
    }
}

static void test_token_lines(void **state) {
    (void)state;
    const char line[] = "{\"input_ids\": [1, 2, 3, 4], \"labels\": [-100, -100, 3, 4]}";
    int32_t *ids, *tg;
    size_t n;
    assert_int_equal(chat_train_line(NULL, NULL, 10, line, strlen(line), &ids, &tg, &n), FU_OK);
    assert_int_equal(n, 4);
    const int32_t want[4] = {-1, 3, 4, -1};
    assert_memory_equal(tg, want, sizeof want);
    free(ids), free(tg);
    const char oob[] = "{\"input_ids\": [1, 20]}", chat[] = "{\"messages\": []}", arr[] = "[1]";
    assert_int_equal(chat_train_line(NULL, NULL, 10, oob, strlen(oob), &ids, &tg, &n), FU_ERR_FORMAT);
    assert_non_null(strstr(fu_last_error(), "\"input_ids\"[1] is not a token id of [0, 10)"));
    assert_int_equal(chat_train_line(NULL, NULL, 10, chat, strlen(chat), &ids, &tg, &n), FU_ERR_UNSUPPORTED);
    assert_int_equal(chat_train_line(NULL, NULL, 10, arr, strlen(arr), &ids, &tg, &n), FU_ERR_FORMAT);
    assert_null(ids);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_assistant_tokens_train),
        cmocka_unit_test(test_markers_in_messages_stay_text),
        cmocka_unit_test(test_refusals),
        cmocka_unit_test(test_token_lines),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
