/* fuzz_file_check.c -- libFuzzer target: arbitrary bytes as an uploaded fine-tuning file, checked as
 * POST /v1/files checks one (gw_file_check_text: lines, UTF-8, JSON, OpenAI's keys, special strings,
 * the chat template and the context) with a ChatML template and the Qwen3 tokenizer of
 * shared/tokenizers beside the checkout ($FUSION_TOKENIZERS overrides; without it every line is
 * refused after its keys are checked). */
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fuzz-chatml.h"
#include "gw-file-check.h"
#include "log.h"

/* A small context, so that long examples are reached too. */
#define FUZZ_CTX 256
#define FUZZ_MAX_LINES 1000

static tok_tokenizer *tok;
static tpl_template *tpl;
static gw_file_check check;

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    (void)argc;
    (void)argv;
    fu_log_set_level(FU_LOG_LEVEL_OFF);
    fuzz_chatml_load(&tok, &tpl);
    if (gw_file_check_init(&check, tok, tpl, FUZZ_CTX)) abort();
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    int64_t n = -1;
    gw_error err = {0};
    int rc = gw_file_check_text(&check, (const char *)data, size, FUZZ_MAX_LINES, &n, &err);
    /* accepted: at least one example; refused: a client error about the file, or out of memory */
    if (rc == 0 && n < 1) abort();
    if (rc != 0 && rc != 400 && rc != 500) abort();
    if (rc == 400 && strcmp(err.param, "file")) abort();
    return 0;
}
