/* fuzz_gguf.c -- libFuzzer target: arbitrary bytes as a GGUF file, opened from memory; every key,
 * array and tensor is then read through the public getters, and the model configuration and the
 * tokenizer are read from the metadata. */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

#include "gguf.h"
#include "log.h"
#include "model.h"
#include "tokenizer.h"

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    (void)argc;
    (void)argv;
    fu_log_set_level(FU_LOG_LEVEL_OFF);
    return 0;
}

/* Reads key i through every getter that applies. */
static void walk_key(const gguf_file *f, int64_t i) {
    const char *key = gguf_key_name(f, i);
    if (!key) abort();
    (void)gguf_find_key(f, key);
    uint32_t u32;
    uint64_t u64;
    int32_t i32;
    int64_t i64;
    float f32;
    double f64;
    bool b;
    const char *s;
    size_t len;
    (void)gguf_get_u32(f, key, &u32);
    (void)gguf_get_u64(f, key, &u64);
    (void)gguf_get_i32(f, key, &i32);
    (void)gguf_get_i64(f, key, &i64);
    (void)gguf_get_f32(f, key, &f32);
    (void)gguf_get_f64(f, key, &f64);
    (void)gguf_get_bool(f, key, &b);
    char *dup = NULL;
    if (gguf_get_str(f, key, &s, &len) == 0 && gguf_get_str_dup(f, key, &dup) == 0) free(dup);
    gguf_vtype et;
    uint64_t n;
    const void *data;
    if (gguf_get_arr(f, key, &et, &n, &data) == 0 && et == GGUF_VTYPE_STRING)
        for (uint64_t k = 0; k < n && k < 64; k++) (void)gguf_get_arr_str(f, key, k, &s, &len);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    gguf_file *f = NULL;
    if (gguf_open_mem(data, size, "fuzz.gguf", &f)) return 0;
    (void)gguf_version(f);
    (void)gguf_alignment(f);
    (void)gguf_data_offset(f);
    for (int64_t i = 0; i < gguf_n_keys(f); i++) walk_key(f, i);
    for (int64_t i = 0; i < gguf_n_tensors(f); i++) {
        const gguf_tensor_info *t = gguf_tensor(f, i);
        if (!t || gguf_find_tensor(f, t->name) != i) abort();
        op_tensor ot;
        if (gguf_tensor_as_op(f, i, &ot) == 0 && t->nbytes) {
            volatile uint8_t sink = ((const uint8_t *)t->data)[0] ^ ((const uint8_t *)t->data)[t->nbytes - 1];
            (void)sink;
        }
    }
    mdl_config c;
    (void)mdl_config_read_gguf(f, &c);
    tok_tokenizer *tok = NULL;
    if (tok_load_gguf(f, &tok) == 0) {
        int32_t *ids = NULL;
        size_t n = 0;
        if (tok_encode(tok, "Hello, world! 123", 17, true, true, &ids, &n) == 0) {
            char *text = NULL;
            if (tok_decode(tok, ids, n, false, &text, NULL) == 0) free(text);
            free(ids);
        }
    }
    tok_free(tok);
    gguf_close(f);
    return 0;
}
