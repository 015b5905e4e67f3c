/* fuzz_tokenizer.c -- libFuzzer target: arbitrary bytes as a tokenizer.json, loaded from memory;
 * a loaded tokenizer then encodes and decodes a few strings (ASCII, UTF-8, special-looking text). */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "log.h"
#include "tokenizer.h"

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    (void)argc;
    (void)argv;
    fu_log_set_level(FU_LOG_LEVEL_OFF);
    return 0;
}

static void round_trip(const tok_tokenizer *t, const char *s, size_t len) {
    int32_t *ids = NULL;
    size_t n = 0;
    if (tok_encode(t, s, len, true, true, &ids, &n)) return;
    char *text = NULL;
    if (tok_decode(t, ids, n, false, &text, NULL) == 0) free(text);
    tok_decoder *d = NULL;
    if (tok_decoder_init(t, true, &d) == 0) {
        const char *out;
        size_t olen;
        for (size_t i = 0; i < n; i++) (void)tok_decoder_push(d, ids[i], &out, &olen);
        (void)tok_decoder_flush(d, &out, &olen);
        tok_decoder_free(d);
    }
    free(ids);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    tok_tokenizer *t = NULL;
    if (tok_load_hf_mem((const char *)data, size, &t)) return 0;
    static const char *const texts[] = {
        "Hello, world! 123",
        "  leading spaces\tand\ttabs\n\nnew lines",
        "caf\xc3\xa9 \xe2\x82\xac \xf0\x9f\x98\x80 \xe4\xb8\xad\xe6\x96\x87",
        "<s><|im_start|>user\n\xff\xfe broken utf-8</s>",
    };
    for (size_t i = 0; i < sizeof texts / sizeof texts[0]; i++) round_trip(t, texts[i], strlen(texts[i]));
    int32_t v = tok_vocab_size(t);
    int32_t ids[4] = {0, v - 1, v / 2, v > 3 ? 3 : 0};
    char *text = NULL;
    if (v > 0 && tok_decode(t, ids, 4, true, &text, NULL) == 0) free(text);
    tok_free(t);
    return 0;
}
