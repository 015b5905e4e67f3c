/* fuzz_json_schema.c -- libFuzzer target: arbitrary bytes as a JSON Schema compiled to a grammar; a
 * schema that compiles is walked by its matcher with the input's bytes picking the tokens, and
 * its first bytes also serve as a `pattern` of a string schema. */
#include <jansson.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "fuzz-grammar.h"
#include "json-schema.h"
#include "log.h"

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    (void)argc;
    (void)argv;
    fu_log_set_level(FU_LOG_LEVEL_OFF);
    return 0;
}

/* The input's first bytes (up to a NUL, at most 64) as a string schema's pattern. */
static void fuzz_pattern(const uint8_t *data, size_t size) {
    char pat[65];
    size_t n = size < 64 ? size : 64;
    memcpy(pat, data, n);
    pat[n] = 0;
    json_t *s = json_pack("{s:s, s:s}", "type", "string", "pattern", pat);
    gm_grammar *g = NULL;
    if (s && !js_schema_grammar(s, &g)) fuzz_grammar_walk(g, data, size);
    gm_grammar_free(g);
    json_decref(s);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    gm_grammar *g = NULL;
    if (!js_schema_grammar_text((const char *)data, size, &g)) {
        fuzz_grammar_walk(g, data, size);
        gm_grammar_free(g);
    }
    fuzz_pattern(data, size);
    return 0;
}
