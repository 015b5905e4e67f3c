/* fuzz-grammar.h -- what the grammar fuzz targets share: a small vocabulary and a walk of a grammar's
 * matcher driven by the input's bytes (masks, accepted tokens), for tests/fuzz/fuzz_gbnf.c and
 * fuzz_json_schema.c. Single-threaded; everything it makes it frees. */
#ifndef FU_FUZZ_GRAMMAR_H
#define FU_FUZZ_GRAMMAR_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "grammar.h"

#define FUZZ_GM_VOCAB 300 /* the 256 bytes, 43 multi-byte tokens, an end-of-generation id */

/* Runs up to 64 steps of g's matcher: each step computes the mask and takes the allowed token
 * the next input byte picks (or, when none is allowed, stops); checks that a taken token's bytes
 * were allowed. */
static void fuzz_grammar_walk(const gm_grammar *g, const uint8_t *pick, size_t n_pick) {
    static const char *words[] = {"{\"", "\":", "\", \"", "true", "false", "null", "12", "-0.5e3", "[", "]}",
                                  "\\n", "\\u00e9", "\xc3\xa9", "\xe2\x82", "\xac", "  ", "\n  ", "abc", "Name",
                                  "<tool_call>", "</tool_call>", "\"name\"", "\"arguments\"", "x\"}", "0", "9",
                                  "\xf0\x9f\x98\x80", "\xff", "\"\"", "{}", "[]", ",", ":", "\"a\"", "yes", "no",
                                  "2024-01-01", "T10:00:00Z", "-", "e", ".", "ab", "AB-12"};
    static char bytes[256];
    const char *toks[FUZZ_GM_VOCAB];
    size_t lens[FUZZ_GM_VOCAB];
    for (int i = 0; i < 256; i++) bytes[i] = (char)i, toks[i] = &bytes[i], lens[i] = 1;
    for (int i = 0; i < 43; i++) toks[256 + i] = words[i], lens[256 + i] = strlen(words[i]);
    toks[299] = NULL, lens[299] = 0;
    int32_t eog = 299;
    gm_vocab *v = NULL;
    gm_matcher *m = NULL;
    if (gm_vocab_new(toks, lens, FUZZ_GM_VOCAB, &eog, 1, &v) || gm_matcher_new(g, v, &m)) goto out;
    uint8_t mask[(FUZZ_GM_VOCAB + 7) / 8];
    for (size_t step = 0; step < 64 && step < n_pick && !gm_matcher_finished(m); step++) {
        int n = gm_matcher_mask(m, mask, sizeof mask);
        if (n <= 0) break;
        int want = pick[step] % n, id = -1;
        for (int t = 0; t < FUZZ_GM_VOCAB && id < 0; t++)
            if (((mask[t >> 3] >> (t & 7)) & 1) && want-- == 0) id = t;
        if (id < 0 || gm_matcher_accept_token(m, id)) __builtin_trap(); /* the mask allowed it */
    }
out:
    gm_matcher_free(m);
    gm_vocab_free(v);
}

#endif
