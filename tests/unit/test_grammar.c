/* test_grammar.c -- GBNF parsing, JSON Schema compilation, the matcher on strings, token masks
 * on a small vocabulary, and the errors (malformed input, $ref loops, size and depth bounds,
 * grammars without a finite string, unsupported keywords named). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "buf.h"
#include "grammar.h"
#include "json-schema.h"
#include "status.h"

/* A one-byte-per-token vocabulary over printable ASCII (id = byte - 32), plus multi-byte
 * tokens and an end-of-generation id (the last). */
static const char *extra_toks[] = {"{\"", "\":", "true", "null", "12", "\xc3\xa9", "\xc3", "\xa9", "  ", "\n"};
#define N_EXTRA (int)(sizeof extra_toks / sizeof *extra_toks)
#define N_VOCAB (95 + N_EXTRA + 1)
#define EOG (N_VOCAB - 1)

static gm_vocab *small_vocab(void) {
    const char *toks[N_VOCAB];
    size_t lens[N_VOCAB];
    static char bytes[95];
    for (int i = 0; i < 95; i++) bytes[i] = (char)(32 + i), toks[i] = &bytes[i], lens[i] = 1;
    for (int i = 0; i < N_EXTRA; i++) toks[95 + i] = extra_toks[i], lens[95 + i] = strlen(extra_toks[i]);
    toks[EOG] = "</s>", lens[EOG] = 4;
    int32_t eog = EOG;
    gm_vocab *v;
    assert_int_equal(gm_vocab_new(toks, lens, N_VOCAB, &eog, 1, &v), FU_OK);
    return v;
}

static gm_grammar *gbnf(const char *text) {
    gm_grammar *g = NULL;
    int rc = gm_grammar_parse(text, strlen(text), NULL, &g);
    if (rc) fail_msg("grammar: %s\n%s", fu_last_error(), text);
    return g;
}

/* Whether g accepts exactly the string s (complete). */
static int accepts(const gm_grammar *g, const gm_vocab *v, const char *s) {
    gm_matcher *m;
    assert_int_equal(gm_matcher_new(g, v, &m), FU_OK);
    int ok = gm_matcher_accept_bytes(m, s, strlen(s)) == FU_OK && gm_matcher_accepting(m);
    gm_matcher_free(m);
    return ok;
}

static int schema_accepts(const char *schema, const char *s) {
    gm_grammar *g;
    if (js_schema_grammar_text(schema, strlen(schema), &g)) fail_msg("schema: %s", fu_last_error());
    gm_vocab *v = small_vocab();
    int ok = accepts(g, v, s);
    gm_vocab_free(v);
    gm_grammar_free(g);
    return ok;
}

static void test_gbnf_parse_and_match(void **state) {
    (void)state;
    gm_vocab *v = small_vocab();
    gm_grammar *g = gbnf("root ::= greet (\" \" name)? \"!\"{1,3}\n"
                         "greet ::= \"hi\" | \"hello\"  # a comment\n"
                         "name ::= [A-Z] [a-z]* | (\"x\" | \"y\")+\n");
    assert_true(accepts(g, v, "hi!"));
    assert_true(accepts(g, v, "hello Bob!!!"));
    assert_true(accepts(g, v, "hi xyx!"));
    assert_false(accepts(g, v, "hi!!!!"));
    assert_false(accepts(g, v, "hi bob!"));
    assert_false(accepts(g, v, "hi"));
    gm_grammar_free(g);
    g = gbnf("root ::= [^\\x00-\\x7f]+ \".\"\n");
    assert_true(accepts(g, v, "\xc3\xa9\xe2\x82\xac."));
    assert_false(accepts(g, v, "e."));
    gm_grammar_free(g);
    g = gbnf("root ::= (\n  \"a\"\n  | \"b\"\n) \"c\"\n");
    assert_true(accepts(g, v, "bc"));
    gm_grammar_free(g);
    gm_vocab_free(v);
}

static void test_gbnf_errors(void **state) {
    (void)state;
    struct { const char *text, *msg; } bad[] = {
        {"root ::= foo\n", "'foo' is used but not defined"},
        {"root ::= \"a\" root | \"b\"\nroot ::= \"c\"\n", "defined twice"},
        {"root ::= root \"a\" | \"b\"\n", "left-recursive"},
        {"root ::= x? root | \"b\"\nx ::= \"\"\n", "left-recursive"},
        {"root ::= \"a\" root\n", "no finite string"},
        {"root ::= [b-a]\n", "out of order"},
        {"root ::= \"abc\n", "unterminated"},
        {"root ::= \"a\"{3,1}\n", "out of order"},
        {"root ::= \"a\"{5000}\n", "over 1000"},
        {"root = \"a\"\n", "expected '::='"},
        {"other ::= \"a\"\n", "no rule 'root'"},
        {"root ::= \"\\q\"\n", "unknown escape"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        gm_grammar *g = NULL;
        int rc = gm_grammar_parse(bad[i].text, strlen(bad[i].text), NULL, &g);
        if (!rc || !strstr(fu_last_error(), bad[i].msg))
            fail_msg("%s: rc %d, '%s' (wanted '%s')", bad[i].text, rc, rc ? fu_last_error() : "", bad[i].msg);
        assert_null(g);
    }
}

static void test_schema_types(void **state) {
    (void)state;
    const char *s = "{\"type\":\"object\",\"properties\":{\"name\":{\"type\":\"string\"},\"age\":{\"type\":\"integer\"},"
                    "\"tags\":{\"type\":\"array\",\"items\":{\"type\":\"string\"},\"maxItems\":2},"
                    "\"ok\":{\"type\":\"boolean\"},\"x\":{\"type\":[\"number\",\"null\"]}},"
                    "\"required\":[\"name\",\"age\"],\"additionalProperties\":false}";
    assert_true(schema_accepts(s, "{\"name\":\"Bob\",\"age\":42}"));
    assert_true(schema_accepts(s, "{\"name\": \"B\\\"o\", \"age\": -3, \"tags\": [\"a\", \"b\"], \"x\": 1.5e3}"));
    assert_true(schema_accepts(s, "{\n  \"name\": \"\", \"age\": 0, \"ok\": true, \"x\": null}"));
    assert_false(schema_accepts(s, "{\"age\":42}"));
    assert_false(schema_accepts(s, "{\"name\":\"Bob\",\"age\":4.2}"));
    assert_false(schema_accepts(s, "{\"name\":\"Bob\",\"age\":1,\"tags\":[\"a\",\"b\",\"c\"]}"));
    assert_false(schema_accepts(s, "{\"name\":\"Bob\",\"age\":1,\"zzz\":1}"));
    assert_false(schema_accepts(s, "{\"name\":\"Bob\",\"age\":01}"));
    assert_false(schema_accepts(s, "{\"name\":\"Bob\",\"age\":1}   "));
    assert_false(schema_accepts(s, "{\"name\":                 \"Bob\",\"age\":1}"));
    const char *open = "{\"type\":\"object\",\"properties\":{\"a\":{\"type\":\"integer\"}}}";
    assert_true(schema_accepts(open, "{}"));
    assert_true(schema_accepts(open, "{\"a\":1,\"b\":[1,{\"c\":null}]}"));
    assert_true(schema_accepts(open, "{\"b\":\"x\"}"));
    assert_false(schema_accepts(open, "{\"a\":\"x\"}"));
}

static void test_schema_enum_const_anyof_refs(void **state) {
    (void)state;
    const char *s = "{\"$defs\":{\"color\":{\"enum\":[\"red\",\"green\",7]},"
                    "\"node\":{\"type\":\"object\",\"properties\":{\"v\":{\"type\":\"integer\"},"
                    "\"next\":{\"anyOf\":[{\"$ref\":\"#/$defs/node\"},{\"type\":\"null\"}]}},\"required\":[\"v\",\"next\"]}},"
                    "\"type\":\"object\",\"properties\":{\"c\":{\"$ref\":\"#/$defs/color\"},\"k\":{\"const\":\"fixed\"},"
                    "\"list\":{\"$ref\":\"#/$defs/node\"}},\"required\":[\"c\",\"k\",\"list\"]}";
    assert_true(schema_accepts(s, "{\"c\":\"red\",\"k\":\"fixed\",\"list\":{\"v\":1,\"next\":{\"v\":2,\"next\":null}}}"));
    assert_true(schema_accepts(s, "{\"c\":7,\"k\":\"fixed\",\"list\":{\"v\":1,\"next\":null}}"));
    assert_false(schema_accepts(s, "{\"c\":\"blue\",\"k\":\"fixed\",\"list\":{\"v\":1,\"next\":null}}"));
    assert_false(schema_accepts(s, "{\"c\":\"red\",\"k\":\"other\",\"list\":{\"v\":1,\"next\":null}}"));
    const char *arr = "{\"type\":\"array\",\"items\":{\"oneOf\":[{\"type\":\"integer\"},{\"type\":\"boolean\"}]},"
                      "\"minItems\":2,\"maxItems\":3}";
    assert_true(schema_accepts(arr, "[1,true]"));
    assert_true(schema_accepts(arr, "[1, 2, false]"));
    assert_false(schema_accepts(arr, "[1]"));
    assert_false(schema_accepts(arr, "[1,2,3,4]"));
    assert_false(schema_accepts(arr, "[1,\"a\"]"));
}

static void test_schema_strings(void **state) {
    (void)state;
    const char *pat = "{\"type\":\"string\",\"pattern\":\"^[A-Z]{2}-\\\\d{3,4}(x|yz)?$\"}";
    assert_true(schema_accepts(pat, "\"AB-123\""));
    assert_true(schema_accepts(pat, "\"AB-1234yz\""));
    assert_false(schema_accepts(pat, "\"ab-123\""));
    assert_false(schema_accepts(pat, "\"AB-12\""));
    const char *unanchored = "{\"type\":\"string\",\"pattern\":\"q[^0-9]\"}";
    assert_true(schema_accepts(unanchored, "\"xxqa yy\""));
    assert_true(schema_accepts(unanchored, "\"q\\\"\""));
    assert_false(schema_accepts(unanchored, "\"xxq1\""));
    /* an empty negated class is any character: its complement is cut around '"' and '\\' */
    const char *any = "{\"type\":\"string\",\"pattern\":\"^[^]$\"}";
    assert_true(schema_accepts(any, "\"a\""));
    assert_true(schema_accepts(any, "\"\\\"\""));
    assert_false(schema_accepts(any, "\"ab\""));
    const char *len = "{\"type\":\"string\",\"minLength\":2,\"maxLength\":3}";
    assert_true(schema_accepts(len, "\"ab\""));
    assert_true(schema_accepts(len, "\"a\\nc\""));
    assert_false(schema_accepts(len, "\"abcd\""));
    assert_true(schema_accepts("{\"type\":\"string\",\"format\":\"date\"}", "\"2024-02-29\""));
    assert_false(schema_accepts("{\"type\":\"string\",\"format\":\"date\"}", "\"2024-13-01\""));
    assert_true(schema_accepts("{\"type\":\"string\",\"format\":\"date-time\"}", "\"2024-02-29T10:00:00Z\""));
    assert_true(schema_accepts("{\"type\":\"string\",\"format\":\"uuid\"}", "\"123e4567-e89b-12d3-a456-426614174000\""));
}

static void test_schema_errors(void **state) {
    (void)state;
    struct { const char *schema, *msg; } bad[] = {
        {"{\"type\":\"integer\",\"minimum\":3}", "unsupported keyword 'minimum'"},
        {"{\"type\":\"object\",\"properties\":{\"a\":{\"not\":{}}}}", "unsupported keyword 'not' at '#/properties/a'"},
        {"{\"type\":\"bogus\"}", "unknown type 'bogus'"},
        {"{\"$defs\":{\"a\":{\"$ref\":\"#/$defs/b\"},\"b\":{\"$ref\":\"#/$defs/a\"}},\"$ref\":\"#/$defs/a\"}", "$ref loop"},
        {"{\"$ref\":\"#/$defs/missing\"}", "resolves to nothing"},
        {"{\"type\":\"object\",\"properties\":{\"n\":{\"$ref\":\"#\"}},\"required\":[\"n\"]}", "no finite value"},
        {"{\"type\":\"string\",\"format\":\"hostname\"}", "'format'"},
        {"{\"type\":\"string\",\"pattern\":\"(?=a)\"}", "'pattern'"},
        {"{\"type\":\"string\",\"pattern\":\"a\\\\1\"}", "unsupported escape"},
        {"{\"type\":\"array\",\"minItems\":3,\"maxItems\":1}", "maxItems < minItems"},
        {"[1,2]", "must be an object"},
        {"{\"type\":", "malformed JSON"},
        {"{\"enum\":[]}", "non-empty array"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        gm_grammar *g = NULL;
        int rc = js_schema_grammar_text(bad[i].schema, strlen(bad[i].schema), &g);
        if (!rc || !strstr(fu_last_error(), bad[i].msg))
            fail_msg("%s: rc %d, '%s' (wanted '%s')", bad[i].schema, rc, rc ? fu_last_error() : "", bad[i].msg);
        assert_null(g);
    }
}

static void test_schema_bounds(void **state) {
    (void)state;
    size_t n = (1u << 20) + 100;
    char *big = malloc(n + 64);
    int k = snprintf(big, n + 64, "{\"description\":\"");
    memset(big + k, 'x', n);
    strcpy(big + k + n, "\"}");
    gm_grammar *g = NULL;
    assert_int_equal(js_schema_grammar_text(big, strlen(big), &g), FU_ERR_EXHAUSTED);
    assert_non_null(strstr(fu_last_error(), "over"));
    free(big);
    fu_buf deep = {0};
    for (int i = 0; i < 100; i++) fu_buf_appendf(&deep, "{\"type\":\"array\",\"items\":");
    fu_buf_appendf(&deep, "{\"type\":\"null\"}");
    for (int i = 0; i < 100; i++) fu_buf_appendf(&deep, "}");
    assert_int_equal(js_schema_grammar_text(deep.data, deep.len, &g), FU_ERR_EXHAUSTED);
    assert_non_null(strstr(fu_last_error(), "nested deeper"));
    fu_buf_free(&deep);
    assert_int_equal(js_object_grammar(&g), FU_OK);
    gm_vocab *v = small_vocab();
    assert_true(accepts(g, v, "{\"a\": [1, 2.5, \"x\"], \"b\": {}}"));
    assert_false(accepts(g, v, "[1]"));
    gm_vocab_free(v);
    gm_grammar_free(g);
}

/* Whether token id is set in mask. */
static int allowed(const uint8_t *mask, int id) { return (mask[id >> 3] >> (id & 7)) & 1; }
static int tok(char c) { return c - 32; }

static void test_masks(void **state) {
    (void)state;
    gm_vocab *v = small_vocab();
    gm_grammar *g = gbnf("root ::= \"{\\\"\" [a-z]+ \"\\\": \" (\"true\" | \"12\" | [\\u00e9]) \"}\"\n");
    gm_matcher *m;
    assert_int_equal(gm_matcher_new(g, v, &m), FU_OK);
    size_t mb = gm_vocab_mask_bytes(v);
    uint8_t mask[32];
    assert_int_equal(mb, (N_VOCAB + 7) / 8);
    int n = gm_matcher_mask(m, mask, mb);
    assert_int_equal(n, 2); /* "{" and "{\"" */
    assert_true(allowed(mask, tok('{')) && allowed(mask, 95));
    assert_false(allowed(mask, EOG));
    assert_int_equal(gm_matcher_accept_token(m, 95), FU_OK);
    n = gm_matcher_mask(m, mask, mb);
    assert_int_equal(n, 28); /* a-z, "true", "null" */
    assert_int_equal(gm_matcher_accept_bytes(m, "ab", 2), FU_OK);
    gm_matcher_mask(m, mask, mb);
    assert_true(allowed(mask, tok('c')) && allowed(mask, tok('"')) && allowed(mask, 96));
    assert_false(allowed(mask, tok('A')));
    assert_int_equal(gm_matcher_accept_bytes(m, "\": ", 3), FU_OK);
    gm_matcher_mask(m, mask, mb);
    assert_true(allowed(mask, 97) && allowed(mask, 99) && allowed(mask, 100) && allowed(mask, 101));
    assert_false(allowed(mask, 98) || allowed(mask, 102) || allowed(mask, tok('n')));
    assert_int_equal(gm_matcher_accept_token(m, 101), FU_OK); /* half of é */
    gm_matcher_mask(m, mask, mb);
    assert_true(allowed(mask, 102));
    assert_int_equal(gm_matcher_mask(m, mask, mb), 1); /* cached */
    assert_int_equal(gm_matcher_accept_token(m, 102), FU_OK);
    assert_int_equal(gm_matcher_accept_token(m, EOG), FU_ERR_INVALID);
    assert_int_equal(gm_matcher_accept_bytes(m, "}", 1), FU_OK);
    assert_int_equal(gm_matcher_mask(m, mask, mb), 1);
    assert_true(allowed(mask, EOG));
    assert_int_equal(gm_matcher_accept_token(m, tok('x')), FU_ERR_INVALID);
    assert_int_equal(gm_matcher_accept_token(m, EOG), FU_OK);
    assert_true(gm_matcher_finished(m));
    assert_int_equal(gm_matcher_mask(m, mask, mb - 1), FU_ERR_INVALID);
    gm_matcher_free(m);
    gm_grammar_free(g);
    gm_vocab_free(v);
}

static void test_whitespace_bounded(void **state) {
    (void)state;
    gm_grammar *g;
    assert_int_equal(js_object_grammar(&g), FU_OK);
    gm_vocab *v = small_vocab();
    gm_matcher *m;
    assert_int_equal(gm_matcher_new(g, v, &m), FU_OK);
    assert_int_equal(gm_matcher_accept_bytes(m, "{\n", 2), FU_OK);
    int spaces = 0;
    while (gm_matcher_accept_bytes(m, " ", 1) == FU_OK) spaces++;
    assert_int_equal(spaces, 12);
    gm_matcher_free(m);
    gm_vocab_free(v);
    gm_grammar_free(g);
}

/* Rules whose two alternatives are the same rule, `levels` deep: 2^levels expansions that all
 * end in the same stack. */
static gm_grammar *doubling(int levels) {
    char text[4096];
    size_t at = (size_t)snprintf(text, sizeof text, "root ::= a0\n");
    for (int i = 0; i < levels; i++) at += (size_t)snprintf(text + at, sizeof text - at, "a%d ::= a%d | a%d\n", i, i + 1, i + 1);
    snprintf(text + at, sizeof text - at, "a%d ::= \"x\"\n", levels);
    return gbnf(text);
}

/* A grammar that forks at every level stops with FU_ERR_EXHAUSTED in bounded time, not after
 * 2^40 expansions; a shallow one (2^10) still matches. */
static void test_expansion_budget(void **state) {
    (void)state;
    gm_vocab *v = small_vocab();
    gm_grammar *shallow = doubling(10), *deep = doubling(40);
    assert_true(accepts(shallow, v, "x"));
    gm_matcher *m = NULL;
    assert_int_equal(gm_matcher_new(deep, v, &m), FU_ERR_EXHAUSTED);
    assert_null(m);
    assert_non_null(strstr(fu_last_error(), "too ambiguous"));
    gm_grammar_free(shallow), gm_grammar_free(deep);
    gm_vocab_free(v);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_gbnf_parse_and_match),
        cmocka_unit_test(test_gbnf_errors),
        cmocka_unit_test(test_schema_types),
        cmocka_unit_test(test_schema_enum_const_anyof_refs),
        cmocka_unit_test(test_schema_strings),
        cmocka_unit_test(test_schema_errors),
        cmocka_unit_test(test_schema_bounds),
        cmocka_unit_test(test_masks),
        cmocka_unit_test(test_whitespace_bounded),
        cmocka_unit_test(test_expansion_budget),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
