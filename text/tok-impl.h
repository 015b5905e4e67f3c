/* tok-impl.h -- tokenizer internals shared by tokenizer.c and its loaders (tok-hf.c, tok-gguf.c).
 *
 * Internal to text/. A loader fills a tok_tokenizer once; after that nothing
 * in it changes, which is what makes concurrent encoding safe (per-call PCRE2
 * match data is allocated by each call). The tokenizer owns every table here.
 */
#ifndef FU_TOK_IMPL_H
#define FU_TOK_IMPL_H

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "tokenizer.h"

/* ---- per-token flags (tok_tokenizer.flags[id]) ---- */
#define TOK_F_PRESENT 0x01u /* id has a text (vocabularies may have holes) */
#define TOK_F_MODEL 0x02u   /* part of the model's vocabulary (BPE lookups see it) */
#define TOK_F_ADDED 0x04u   /* added token: split out of the raw text before the model */
#define TOK_F_SPECIAL 0x08u /* special: skipped by skip_special, matched only with parse_special */
#define TOK_F_BYTE 0x10u    /* byte-fallback token <0xXX> */
#define TOK_F_EOG 0x20u     /* ends a generation */

/* Encoding algorithm of the model. */
typedef enum tok_algo {
    TOK_ALGO_BPE = 0, /* merges by rank (Hugging Face BPE; also llama.cpp's "gpt2") */
    TOK_ALGO_SPM = 1, /* bigrams by vocabulary score (llama.cpp's "llama" SentencePiece) */
} tok_algo;

/* Normalizer steps (applied in order to each text fragment between added tokens). */
typedef enum tok_norm_kind {
    TOK_NORM_NFC,
    TOK_NORM_NFD,
    TOK_NORM_NFKC,
    TOK_NORM_NFKD,
    TOK_NORM_PREPEND,   /* a: text to put in front of a non-empty fragment */
    TOK_NORM_REPLACE,   /* a -> b, every non-overlapping occurrence, left to right */
    TOK_NORM_LOWERCASE, /* per code point */
    TOK_NORM_STRIP,     /* strip Unicode white space; flags: 1 left, 2 right */
} tok_norm_kind;

typedef struct tok_norm {
    tok_norm_kind kind;
    char *a, *b; /* owned, NUL-terminated */
    size_t alen, blen;
    int flags;
} tok_norm;

/* How a Split step treats the pieces its pattern matches (HF SplitDelimiterBehavior). */
typedef enum tok_split_behavior {
    TOK_SPLIT_ISOLATED,
    TOK_SPLIT_REMOVED,
    TOK_SPLIT_MERGED_PREV,
    TOK_SPLIT_MERGED_NEXT,
    TOK_SPLIT_CONTIGUOUS,
} tok_split_behavior;

/* Pre-tokenizer steps (applied in order to the pieces of each fragment). */
typedef enum tok_pre_kind {
    TOK_PRE_SPLIT,        /* re, behavior, invert */
    TOK_PRE_PREFIX_SPACE, /* ByteLevel add_prefix_space: " " before pieces not starting with one */
    TOK_PRE_BYTELEVEL,    /* map every byte to its GPT-2 code point */
    TOK_PRE_METASPACE,    /* ' ' -> repl; prepend_scheme 0 never, 1 first, 2 always; split */
} tok_pre_kind;

typedef struct tok_pre {
    tok_pre_kind kind;
    pcre2_code *re; /* TOK_PRE_SPLIT, owned */
    tok_split_behavior behavior;
    bool invert;
    char repl[8]; /* TOK_PRE_METASPACE replacement, UTF-8, NUL-terminated */
    size_t repl_len;
    int prepend_scheme;
    bool split;
} tok_pre;

/* Decoder steps, applied to each token's text to give its decoded bytes. */
typedef enum tok_dec_kind {
    TOK_DEC_BYTELEVEL,    /* GPT-2 code points -> bytes (text kept if any is unmapped) */
    TOK_DEC_BYTEFALLBACK, /* "<0xXX>" -> that byte */
    TOK_DEC_REPLACE,      /* a -> b */
    TOK_DEC_STRIP,        /* per token: up to `start` leading / `stop` trailing `ch` */
} tok_dec_kind;

typedef struct tok_dec {
    tok_dec_kind kind;
    char *a, *b; /* owned */
    size_t alen, blen;
    int start, stop;
    char ch;
} tok_dec;

/* An added token as Hugging Face's AddedVocabulary sees it. */
typedef struct tok_added {
    int32_t id;
    char *content; /* owned, NUL-terminated; for normalized tokens the normalized form */
    size_t len;
    bool special, lstrip, rstrip, single_word, normalized;
} tok_added;

/* Leftmost-longest matcher over a set of added tokens: indexes into
 * tok_tokenizer.added, bucketed by first byte, longest first. */
typedef struct tok_matcher {
    uint32_t *idx;
    uint32_t start[257]; /* bucket b is idx[start[b] .. start[b+1]) */
} tok_matcher;

/* Open-addressing map from token text to id (slots hold id+1, 0 is empty);
 * keys are the texts of the tokenizer itself. */
typedef struct tok_strmap {
    uint32_t *slots;
    size_t cap; /* power of two */
    size_t n;
} tok_strmap;

/* Open-addressing map from a pair of ids to a merge (rank, result id). */
typedef struct tok_pairmap {
    uint64_t *keys; /* (a << 32) | b; UINT64_MAX is empty */
    int32_t *rank;
    int32_t *result;
    size_t cap;
    size_t n;
} tok_pairmap;

struct tok_tokenizer {
    tok_algo algo;
    int32_t n_vocab;
    char **text;        /* [n_vocab] token text (NUL-terminated, owned) or NULL for a hole */
    uint32_t *text_len; /* [n_vocab] */
    uint8_t *flags;     /* [n_vocab] TOK_F_* */
    float *scores;      /* [n_vocab] SPM scores, or NULL */
    char **piece;       /* [n_vocab] decoded bytes of each token (owned) */
    uint32_t *piece_len;
    tok_strmap vocab;   /* text -> id, model tokens first */
    tok_pairmap merges; /* BPE only */
    int32_t byte_tok[256]; /* ids of <0xXX> tokens, -1 if absent */

    /* model options */
    bool byte_fallback, fuse_unk, ignore_merges;
    int32_t unk_id;    /* the unknown token (reported by tok_unk) or -1 */
    int32_t model_unk; /* what the model emits for text it cannot encode, or -1 to drop it */

    /* added tokens */
    tok_added *added;
    size_t n_added;
    tok_matcher match_raw, match_norm;
    bool has_norm_added;

    tok_norm *norm;
    size_t n_norm;
    tok_pre *pre;
    size_t n_pre;

    /* decoder */
    tok_dec *dec;
    size_t n_dec;
    int dec_strip;        /* leading ' ' to strip from the start of a decoded stream */
    bool dec_join_space;  /* no decoder: tokens joined with ' ' (HF default) */

    /* specials */
    int32_t bos_id, eos_id, pad_id, eot_id;
    int32_t *prefix_ids, *suffix_ids; /* added by tok_encode(add_special) */
    size_t n_prefix, n_suffix;
    bool add_bos, add_eos;
    int32_t *eog_ids;
    size_t n_eog;
    char *bos_str, *eos_str, *unk_str, *pad_str, *chat_template;
    const char *kind_name; /* static description, e.g. "bpe-bytelevel" */
};

/* ---- helpers for the loaders (tokenizer.c) ---- */

/* Allocates an empty tokenizer for n_vocab ids (all holes). */
int tok__new(int32_t n_vocab, tok_tokenizer **out);

/* Gives id the text s[0..len) (copied); FU_ERR_FORMAT if id is out of range
 * or already has a different text. `flags` are ORed in (TOK_F_PRESENT is implied). */
int tok__set_token(tok_tokenizer *t, int32_t id, const char *s, size_t len, unsigned flags);

/* Builds the text -> id map; call once every token is set. Tokens with
 * TOK_F_MODEL win over added-only tokens of the same text. */
int tok__build_vocab(tok_tokenizer *t);

/* Looks up a text: the id or -1. `model_only` ignores tokens without TOK_F_MODEL. */
int32_t tok__lookup(const tok_tokenizer *t, const char *s, size_t len, bool model_only);

/* Adds the merge (a, b) -> a+b with `rank` (lower merges first); a later
 * merge of the same pair replaces an earlier one, as in Hugging Face.
 * FU_ERR_FORMAT naming the merge if a, b or a+b is not a token. */
int tok__add_merge(tok_tokenizer *t, const char *a, size_t alen, const char *b, size_t blen,
                   int32_t rank);

/* Appends an added token (content copied). */
int tok__add_added(tok_tokenizer *t, const tok_added *a);

/* Appends a normalizer step (a/b copied, may be NULL). */
int tok__add_norm(tok_tokenizer *t, tok_norm_kind kind, const char *a, size_t alen,
                  const char *b, size_t blen, int flags);

/* Appends a Split pre-tokenizer step with a PCRE2 pattern (`literal`: plain
 * string). FU_ERR_FORMAT with PCRE2's message if the pattern does not compile. */
int tok__add_split(tok_tokenizer *t, const char *pattern, size_t len, bool literal,
                   tok_split_behavior behavior, bool invert);

/* Appends a pre-tokenizer step without a pattern. */
int tok__add_pre(tok_tokenizer *t, const tok_pre *p);

/* The GPT-2 ByteLevel regex. */
extern const char tok__gpt2_pattern[];

/* Finishes loading: byte tokens, decoded pieces, added-token matchers,
 * EOG set, prefix/suffix ids. Call after every setter. */
int tok__finalize(tok_tokenizer *t);

/* Runs the normalizer steps on s[0..len): *out is malloc'd (caller frees). */
int tok__normalize(const tok_tokenizer *t, const char *s, size_t len, char **out, size_t *outlen);

/* Appends a decoder step (a/b copied). */
int tok__add_dec(tok_tokenizer *t, const tok_dec *d);

/* The merge of ids (a, b): true with its rank and result id. */
bool tok__merge_get(const tok_tokenizer *t, int32_t a, int32_t b, int32_t *rank, int32_t *result);

/* Examines the UTF-8 character at s[0..n), n >= 1: 1 = valid (*adv bytes,
 * *cp the code point if cp is not NULL), 0 = a valid but truncated prefix
 * (*adv = n), -1 = invalid (*adv = length of the maximal invalid subpart). */
int tok__utf8_next(const uint8_t *s, size_t n, size_t *adv, uint32_t *cp);

/* Writes cp as UTF-8 to out (4 bytes room); returns the length. */
size_t tok__utf8_put(uint32_t cp, char *out);

/* The code point GPT-2's byte-level map gives byte b. */
uint32_t tok__byte_to_cp(uint8_t b);

/* Appends id to the EOG set (ignores duplicates and bad ids). */
int tok__add_eog(tok_tokenizer *t, int32_t id);

/* Duplicates s[0..len) as a NUL-terminated string; NULL when out of memory. */
char *tok__strndup(const char *s, size_t len);

#endif
