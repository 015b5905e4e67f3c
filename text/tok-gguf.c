/* tok-gguf.c -- loads a tokenizer from GGUF metadata (tokenizer.ggml.*), as llama.cpp reads it. */
#include "tok-impl.h"

#include <stdlib.h>
#include <string.h>

#include "gguf.h"
#include "log.h"
#include "status.h"

/* llama.cpp's token types (tokenizer.ggml.token_type) */
enum {
    TOK_GGUF_NORMAL = 1,
    TOK_GGUF_UNKNOWN = 2,
    TOK_GGUF_CONTROL = 3,
    TOK_GGUF_USER_DEFINED = 4,
    TOK_GGUF_UNUSED = 5,
    TOK_GGUF_BYTE = 6,
};

#define TOK_RE_LLAMA3                                                                        \
    "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|" \
    "\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"
#define TOK_RE_QWEN2                                                                         \
    "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|" \
    "\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"
#define TOK_RE_GPT2_NOWS "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)"

/* tokenizer.ggml.pre -> the regexes llama.cpp splits with, applied in turn
 * (each one splits the pieces of the previous, keeping matches and gaps). */
static const struct tok_pre_map {
    const char *names; /* '|'-separated */
    const char *re[4];
    bool nfc, ignore_merges, add_bos;
} tok_pre_maps[] = {
    {"llama3|llama-v3|llama-bpe|falcon3", {TOK_RE_LLAMA3}, false, true, true},
    {"dbrx|smaug-bpe", {TOK_RE_LLAMA3}, false, false, false},
    {"qwen2|deepseek-r1-qwen", {TOK_RE_QWEN2}, true, false, false},
    {"stablelm2", {TOK_RE_QWEN2}, false, false, false},
    {"starcoder|refact|command-r|smollm|codeshell|exaone|minerva-7b",
     {"\\p{N}", tok__gpt2_pattern}, false, false, false},
    {"gpt2|mpt|olmo|jais", {tok__gpt2_pattern}, false, false, false},
    {"default",
     {"[\\p{P}\\$\\+<=>\\^~\\|]+", TOK_RE_GPT2_NOWS, "\\p{N}+", "[0-9][0-9][0-9]"}, false, false, false},
};

static const struct tok_pre_map *find_pre(const char *name, size_t len) {
    for (size_t i = 0; i < sizeof tok_pre_maps / sizeof *tok_pre_maps; i++) {
        const char *p = tok_pre_maps[i].names;
        while (*p) {
            const char *bar = strchr(p, '|');
            size_t n = bar ? (size_t)(bar - p) : strlen(p);
            if (n == len && memcmp(p, name, len) == 0) return &tok_pre_maps[i];
            p += n + (bar ? 1 : 0);
        }
    }
    return NULL;
}

/* Reads element i of a numeric array as int32 / float. */
static int32_t arr_i32(gguf_vtype et, const void *data, uint64_t i) {
    const unsigned char *p = data;
    switch (et) {
    case GGUF_VTYPE_INT32:
    case GGUF_VTYPE_UINT32: {
        int32_t v;
        memcpy(&v, p + i * 4, 4);
        return v;
    }
    case GGUF_VTYPE_INT8:
    case GGUF_VTYPE_UINT8:
        return (int32_t)p[i];
    case GGUF_VTYPE_INT16:
    case GGUF_VTYPE_UINT16: {
        int16_t v;
        memcpy(&v, p + i * 2, 2);
        return v;
    }
    default:
        return TOK_GGUF_NORMAL;
    }
}

/* An optional special-token id key: -1 if absent or out of range. */
static int32_t opt_id(const gguf_file *f, const char *key, int32_t n_vocab) {
    uint32_t v;
    if (gguf_get_u32(f, key, &v) != 0) return -1;
    if (v >= (uint32_t)n_vocab) {
        FU_WARN("tokenizer: %s = %u is outside the vocabulary (%d); ignored", key, v, (int)n_vocab);
        return -1;
    }
    return (int32_t)v;
}

/* Reads tokens, token types and scores into a new tokenizer (*out, caller
 * frees); control / unknown / user-defined tokens become added tokens. */
static int load_tokens(const gguf_file *f, tok_tokenizer **out) {
    const char *kt = "tokenizer.ggml.tokens";
    gguf_vtype et;
    uint64_t n;
    const void *data;
    int rc = gguf_get_arr(f, kt, &et, &n, &data);
    if (rc == FU_ERR_NOT_FOUND) return fu_errorf(FU_ERR_FORMAT, "GGUF has no %s", kt);
    if (rc) return rc;
    if (et != GGUF_VTYPE_STRING || n == 0 || n > (1u << 24))
        return fu_errorf(FU_ERR_FORMAT, "GGUF %s: need 1..2^24 strings", kt);
    gguf_vtype tt = GGUF_VTYPE_INT32, st = GGUF_VTYPE_FLOAT32;
    uint64_t tn = 0, sn = 0;
    const void *types = NULL, *scores = NULL;
    rc = gguf_get_arr(f, "tokenizer.ggml.token_type", &tt, &tn, &types);
    if (rc == FU_OK && (tn != n || (tt != GGUF_VTYPE_INT32 && tt != GGUF_VTYPE_UINT32 && tt != GGUF_VTYPE_INT8 &&
                                    tt != GGUF_VTYPE_UINT8 && tt != GGUF_VTYPE_INT16 && tt != GGUF_VTYPE_UINT16)))
        return fu_errorf(FU_ERR_FORMAT, "GGUF tokenizer.ggml.token_type: %llu integers expected", (unsigned long long)n);
    if (rc != FU_OK && rc != FU_ERR_NOT_FOUND) return rc;
    if (rc) types = NULL;
    rc = gguf_get_arr(f, "tokenizer.ggml.scores", &st, &sn, &scores);
    if (rc == FU_OK && (sn != n || st != GGUF_VTYPE_FLOAT32))
        return fu_errorf(FU_ERR_FORMAT, "GGUF tokenizer.ggml.scores: %llu float32 expected", (unsigned long long)n);
    if (rc != FU_OK && rc != FU_ERR_NOT_FOUND) return rc;
    if (rc) scores = NULL;

    tok_tokenizer *t;
    if ((rc = tok__new((int32_t)n, &t))) return rc;
    if (scores) {
        t->scores = malloc(n * sizeof *t->scores);
        if (!t->scores) {
            rc = fu_errorf(FU_ERR_NOMEM, "tokenizer scores");
            goto err;
        }
        memcpy(t->scores, scores, n * sizeof *t->scores);
    }
    for (uint64_t i = 0; i < n; i++) {
        const char *s;
        size_t len;
        if ((rc = gguf_get_arr_str(f, kt, i, &s, &len))) goto err;
        int32_t type = types ? arr_i32(tt, types, i) : TOK_GGUF_NORMAL;
        /* control and unknown tokens are never produced by merging text */
        unsigned flags = (type == TOK_GGUF_CONTROL || type == TOK_GGUF_UNKNOWN) ? 0 : TOK_F_MODEL;
        if ((rc = tok__set_token(t, (int32_t)i, s, len, flags))) goto err;
    }
    if ((rc = tok__build_vocab(t))) goto err;
    for (uint64_t i = 0; i < n && types; i++) {
        int32_t type = arr_i32(tt, types, i);
        if (type != TOK_GGUF_CONTROL && type != TOK_GGUF_UNKNOWN && type != TOK_GGUF_USER_DEFINED) continue;
        tok_added a = {.id = (int32_t)i,
                       .content = t->text[i],
                       .len = t->text_len[i],
                       .special = type != TOK_GGUF_USER_DEFINED};
        if ((rc = tok__add_added(t, &a))) goto err;
    }
    *out = t;
    return FU_OK;
err:
    tok_free(t);
    return rc;
}

/* "gpt2": merges, the pre-tokenizer regexes for tokenizer.ggml.pre, byte-level map. */
static int load_bpe(const gguf_file *f, tok_tokenizer *t) {
    const char *km = "tokenizer.ggml.merges";
    gguf_vtype et;
    uint64_t n;
    const void *data;
    int rc = gguf_get_arr(f, km, &et, &n, &data);
    if (rc == FU_ERR_NOT_FOUND) return fu_errorf(FU_ERR_FORMAT, "GGUF gpt2 tokenizer has no %s", km);
    if (rc) return rc;
    if (et != GGUF_VTYPE_STRING || n > INT32_MAX) return fu_errorf(FU_ERR_FORMAT, "GGUF %s: strings expected", km);
    for (uint64_t i = 0; i < n; i++) {
        const char *s;
        size_t len;
        if ((rc = gguf_get_arr_str(f, km, i, &s, &len))) return rc;
        /* llama.cpp splits at the first space after the first byte */
        const char *sp = len > 1 ? memchr(s + 1, ' ', len - 1) : NULL;
        if (!sp)
            return fu_errorf(FU_ERR_FORMAT, "GGUF merge %llu ('%.*s') is not two tokens separated by a space",
                             (unsigned long long)i, (int)(len > 64 ? 64 : len), s);
        if ((rc = tok__add_merge(t, s, (size_t)(sp - s), sp + 1, len - (size_t)(sp - s) - 1, (int32_t)i)))
            return rc;
    }

    const char *pre = "default";
    size_t plen = strlen(pre);
    rc = gguf_get_str(f, "tokenizer.ggml.pre", &pre, &plen);
    if (rc == FU_ERR_NOT_FOUND) {
        pre = "default";
        plen = strlen(pre);
    } else if (rc) {
        return rc;
    }
    const struct tok_pre_map *pm = find_pre(pre, plen);
    if (!pm)
        return fu_errorf(FU_ERR_UNSUPPORTED, "GGUF tokenizer.ggml.pre '%.*s' is not supported",
                         (int)(plen > 64 ? 64 : plen), pre);
    if (pm->nfc && (rc = tok__add_norm(t, TOK_NORM_NFC, NULL, 0, NULL, 0, 0))) return rc;
    for (int k = 0; k < 4 && pm->re[k]; k++)
        if ((rc = tok__add_split(t, pm->re[k], strlen(pm->re[k]), false, TOK_SPLIT_ISOLATED, false))) return rc;
    tok_pre bl = {.kind = TOK_PRE_BYTELEVEL};
    if ((rc = tok__add_pre(t, &bl))) return rc;
    tok_dec d = {.kind = TOK_DEC_BYTELEVEL};
    if ((rc = tok__add_dec(t, &d))) return rc;
    t->algo = TOK_ALGO_BPE;
    t->ignore_merges = pm->ignore_merges;
    t->add_bos = pm->add_bos;
    t->kind_name = "bpe-bytelevel";
    return FU_OK;
}

/* "llama": "▁" for spaces (and in front, per add_space_prefix), merge by score. */
static int load_spm(const gguf_file *f, tok_tokenizer *t) {
    bool space_prefix = true;
    int rc = gguf_get_bool(f, "tokenizer.ggml.add_space_prefix", &space_prefix);
    if (rc && rc != FU_ERR_NOT_FOUND) return rc;
    static const char ws[] = "\xe2\x96\x81"; /* U+2581 */
    if ((rc = tok__add_norm(t, TOK_NORM_REPLACE, " ", 1, ws, 3, 0))) return rc;
    if (space_prefix && (rc = tok__add_norm(t, TOK_NORM_PREPEND, ws, 3, NULL, 0, 0))) return rc;
    tok_dec r = {.kind = TOK_DEC_REPLACE, .a = (char *)ws, .alen = 3, .b = " ", .blen = 1};
    tok_dec b = {.kind = TOK_DEC_BYTEFALLBACK};
    if ((rc = tok__add_dec(t, &r)) || (rc = tok__add_dec(t, &b))) return rc;
    t->dec_strip = space_prefix ? 1 : 0;
    t->algo = TOK_ALGO_SPM;
    t->byte_fallback = true;
    t->add_bos = true;
    t->kind_name = "spm-scores";
    return FU_OK;
}

int tok_load_gguf(const gguf_file *f, tok_tokenizer **out) {
    if (!out) return fu_errorf(FU_ERR_INVALID, "tok_load_gguf: no output");
    *out = NULL;
    if (!f) return fu_errorf(FU_ERR_INVALID, "tok_load_gguf: no file");
    const char *model;
    size_t mlen;
    int rc = gguf_get_str(f, "tokenizer.ggml.model", &model, &mlen);
    if (rc == FU_ERR_NOT_FOUND) return fu_errorf(FU_ERR_NOT_FOUND, "%s: no tokenizer.ggml.model", gguf_path(f));
    if (rc) return rc;
    bool spm = mlen == 5 && memcmp(model, "llama", 5) == 0;
    bool bpe = mlen == 4 && memcmp(model, "gpt2", 4) == 0;
    if (!spm && !bpe)
        return fu_errorf(FU_ERR_UNSUPPORTED, "%s: tokenizer.ggml.model '%.*s' is not supported (gpt2, llama)",
                         gguf_path(f), (int)(mlen > 64 ? 64 : mlen), model);
    tok_tokenizer *t = NULL;
    if ((rc = load_tokens(f, &t))) goto err;
    if ((rc = spm ? load_spm(f, t) : load_bpe(f, t))) goto err;

    int32_t n = t->n_vocab;
    t->bos_id = opt_id(f, "tokenizer.ggml.bos_token_id", n);
    t->eos_id = opt_id(f, "tokenizer.ggml.eos_token_id", n);
    t->unk_id = opt_id(f, "tokenizer.ggml.unknown_token_id", n);
    t->pad_id = opt_id(f, "tokenizer.ggml.padding_token_id", n);
    t->eot_id = opt_id(f, "tokenizer.ggml.eot_token_id", n);
    if (spm && t->unk_id < 0 && (t->flags[0] & TOK_F_PRESENT) && !(t->flags[0] & TOK_F_MODEL))
        t->unk_id = 0; /* llama.cpp's SentencePiece default */
    /* llama.cpp's BPE drops what it cannot encode; SentencePiece falls back to <unk> */
    t->model_unk = spm ? t->unk_id : -1;
    bool v;
    if (gguf_get_bool(f, "tokenizer.ggml.add_bos_token", &v) == FU_OK) t->add_bos = v;
    if (gguf_get_bool(f, "tokenizer.ggml.add_eos_token", &v) == FU_OK) t->add_eos = v;
    if (t->add_bos && t->bos_id < 0) t->add_bos = false;
    if (t->add_eos && t->eos_id < 0) t->add_eos = false;
    if (t->add_bos) {
        if (!(t->prefix_ids = malloc(sizeof *t->prefix_ids))) goto nomem;
        t->prefix_ids[t->n_prefix++] = t->bos_id;
    }
    if (t->add_eos) {
        if (!(t->suffix_ids = malloc(sizeof *t->suffix_ids))) goto nomem;
        t->suffix_ids[t->n_suffix++] = t->eos_id;
    }
    if (t->bos_id >= 0 && !(t->bos_str = strdup(t->text[t->bos_id]))) goto nomem;
    if (t->eos_id >= 0 && !(t->eos_str = strdup(t->text[t->eos_id]))) goto nomem;
    if ((rc = tok__add_eog(t, opt_id(f, "tokenizer.ggml.eom_token_id", n)))) goto err;
    rc = gguf_get_str_dup(f, "tokenizer.chat_template", &t->chat_template);
    if (rc && rc != FU_ERR_NOT_FOUND) goto err;
    if ((rc = tok__finalize(t))) goto err;
    FU_DEBUG("tokenizer: %s: %d tokens, %zu merges, %zu added, %s", gguf_path(f), (int)t->n_vocab,
             t->merges.n, t->n_added, t->kind_name);
    *out = t;
    return FU_OK;
nomem:
    rc = fu_errorf(FU_ERR_NOMEM, "tokenizer");
err:
    tok_free(t);
    return rc;
}
