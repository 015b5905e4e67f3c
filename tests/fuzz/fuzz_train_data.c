/* fuzz_train_data.c -- libFuzzer target: arbitrary bytes as one line of a fine-tuning JSONL file
 * (chat_train_line): OpenAI's chat format through a ChatML template and the Qwen3 tokenizer of
 * shared/tokenizers beside the checkout ($FUSION_TOKENIZERS overrides; without it only the
 * token-id lines are reached), or input_ids / labels. */
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include "chat-train.h"
#include "fuzz-chatml.h"
#include "log.h"

#define VOCAB 151936

static tok_tokenizer *tok;
static tpl_template *tpl;

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    (void)argc;
    (void)argv;
    fu_log_set_level(FU_LOG_LEVEL_OFF);
    fuzz_chatml_load(&tok, &tpl);
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    int32_t *ids = NULL, *targets = NULL;
    size_t n = 0;
    if (chat_train_line(tpl, tok, VOCAB, (const char *)data, size, &ids, &targets, &n) == 0) {
        for (size_t t = 0; t < n; t++)
            if (ids[t] < 0 || ids[t] >= VOCAB || targets[t] < -1 || targets[t] >= VOCAB) abort();
        if (n && targets[n - 1] != -1) abort();
    }
    free(ids);
    free(targets);
    return 0;
}
