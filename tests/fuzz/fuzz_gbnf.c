/* fuzz_gbnf.c -- libFuzzer target: arbitrary bytes as GBNF; a grammar that parses is walked by its
 * matcher (token masks, tokens the mask allows taken) with the input's bytes picking the tokens. */
#include <stddef.h>
#include <stdint.h>

#include "fuzz-grammar.h"
#include "grammar.h"
#include "log.h"

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    (void)argc;
    (void)argv;
    fu_log_set_level(FU_LOG_LEVEL_OFF);
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    gm_grammar *g = NULL;
    if (gm_grammar_parse((const char *)data, size, NULL, &g)) return 0;
    fuzz_grammar_walk(g, data, size);
    gm_grammar_free(g);
    return 0;
}
