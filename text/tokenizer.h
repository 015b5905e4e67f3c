/* tokenizer.h -- BPE tokenizers (byte-level and SentencePiece-style) from tokenizer.json or GGUF.
 *
 * A tok_tokenizer is immutable after loading: any number of threads may
 * encode and decode with one at the same time. The loader's caller owns it
 * (tok_free); encode and decode results are malloc'd for the caller.
 *
 * Encoding follows Hugging Face `tokenizers` (added tokens split out first,
 * normalizer, pre-tokenizer, BPE model, post-processor); GGUF "llama"
 * vocabularies use llama.cpp's score-based SentencePiece merge.
 *
 * Invalid UTF-8 in the text to encode is not an error: each maximal invalid
 * subsequence becomes U+FFFD first (what Python's bytes.decode("utf-8",
 * "replace") does), so the ids are those of the repaired text.
 *
 * Known differences from Hugging Face (tests/oracle/test_tokenizer.py checks
 * the rest): decoding bytes that are not valid UTF-8 gives one U+FFFD per
 * maximal invalid subsequence everywhere (HF's ByteFallback decoder gives one
 * per byte token of the whole run); transformers' clean_up_tokenization_spaces
 * is not applied; pre-tokenizer regexes run on PCRE2 rather than Oniguruma
 * (same results on every tested script and white-space character). GGUF
 * vocabularies follow llama.cpp where it and HF disagree: characters a
 * byte-level vocabulary cannot spell are dropped (no <unk>), and special tokens
 * are found leftmost-longest like HF (llama.cpp tries the longest token first).
 */
#ifndef FU_TOKENIZER_H
#define FU_TOKENIZER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

typedef struct tok_tokenizer tok_tokenizer;
typedef struct tok_decoder tok_decoder;
typedef struct gguf_file gguf_file;

/* ---- loading ---- */

/* Loads a Hugging Face tokenizer. `path` is a model directory (reads
 * tokenizer.json) or a tokenizer.json file; tokenizer_config.json,
 * chat_template.jinja and generation_config.json beside it are read when
 * present (special-token strings, add_bos_token / add_eos_token, chat
 * template, extra end-of-generation ids). On success *out is owned by the
 * caller (tok_free). Errors: FU_ERR_IO / FU_ERR_NOT_FOUND (file),
 * FU_ERR_FORMAT (malformed JSON, bad vocabulary or merges),
 * FU_ERR_UNSUPPORTED (model, normalizer, pre-tokenizer or decoder type this
 * module does not implement); fu_last_error() says which. */
int tok_load_hf(const char *path, tok_tokenizer **out);

/* Like tok_load_hf over the text of a tokenizer.json held in memory (`len`
 * bytes, not NUL-terminated; no side files are read). For tests and fuzzing. */
int tok_load_hf_mem(const char *json, size_t len, tok_tokenizer **out);

/* Loads the tokenizer stored in a GGUF file's metadata (tokenizer.ggml.*:
 * model "gpt2" or "llama", pre, tokens, scores, token_type, merges, special
 * ids, add_bos/eos_token, chat_template). Copies what it needs: `f` may be
 * closed afterwards. Errors as tok_load_hf. */
int tok_load_gguf(const gguf_file *f, tok_tokenizer **out);

void tok_free(tok_tokenizer *t); /* NULL is a no-op */

/* ---- encoding ---- */

/* Encodes text[0..len). `add_special` adds what the tokenizer adds around a
 * single sequence (BOS/EOS per tokenizer_config.json's add_bos_token /
 * add_eos_token, else the post-processor's template; GGUF: add_bos_token /
 * add_eos_token). `parse_special`: special tokens written in the text become
 * their ids; otherwise they are encoded as plain text (non-special added
 * tokens are always recognised, as in Hugging Face). On success *ids is a
 * malloc'd array of *n ids (NULL when *n is 0); the caller frees it. */
int tok_encode(const tok_tokenizer *t, const char *text, size_t len, bool add_special,
               bool parse_special, int32_t **ids, size_t *n);

/* A byte range [start, end) of the text to encode. */
typedef struct tok_span {
    size_t start, end;
} tok_span;

/* As tok_encode with parse_special, except that a special token whose text
 * overlaps one of the ranges `plain` (sorted, disjoint) is not taken: that
 * text is encoded as tok_encode with parse_special=false would (non-special
 * added tokens are still recognised). Outside the ranges the ids are those of
 * tok_encode(parse_special=true). Use it for a rendered chat whose messages
 * must not forge the template's markers (tpl_apply_chat_spans gives the
 * ranges). Special tokens that the tokenizer matches after normalization are
 * not taken in a stretch between raw-matched tokens that overlaps a range;
 * text that needs its invalid UTF-8 repaired parses no special token at all
 * when ranges are given (the ranges would no longer line up). */
int tok_encode_spans(const tok_tokenizer *t, const char *text, size_t len, bool add_special, const tok_span *plain,
                     size_t n_plain, int32_t **ids, size_t *n);

/* ---- decoding ---- */

/* Decodes ids[0..n) to text: *text is malloc'd, NUL-terminated, *len bytes
 * (len may be NULL); the caller frees it. `skip_special` drops special
 * tokens. Bytes that do not form valid UTF-8 come out as U+FFFD (one per
 * maximal invalid subsequence). FU_ERR_RANGE for an id outside the vocabulary. */
int tok_decode(const tok_tokenizer *t, const int32_t *ids, size_t n, bool skip_special,
               char **text, size_t *len);

/* Streaming decoder: ids go in one at a time, only complete UTF-8 comes
 * out; bytes of a character split across tokens are held back until it is
 * complete. The concatenation of every push and the final flush equals
 * tok_decode() of the same ids. One decoder per stream; it borrows `t`. */
int tok_decoder_init(const tok_tokenizer *t, bool skip_special, tok_decoder **out);
void tok_decoder_free(tok_decoder *d); /* NULL is a no-op */
/* Forgets held-back bytes and starts a new stream. */
void tok_decoder_reset(tok_decoder *d);
/* Feeds one id. *text / *len: the new complete text (possibly empty), owned
 * by the decoder and valid until its next call. FU_ERR_RANGE for a bad id. */
int tok_decoder_push(tok_decoder *d, int32_t id, const char **text, size_t *len);
/* Ends the stream: held-back bytes come out as U+FFFD. Same ownership. */
int tok_decoder_flush(tok_decoder *d, const char **text, size_t *len);

/* ---- vocabulary ---- */

int32_t tok_vocab_size(const tok_tokenizer *t); /* ids are 0 .. size-1 */
/* The token's vocabulary text (e.g. "Ġhello", "▁the", "<0x0A>"), NUL-terminated,
 * owned by t; NULL for an id outside the vocabulary or a hole. */
const char *tok_token_str(const tok_tokenizer *t, int32_t id);
/* The bytes the token decodes to on its own (no leading-space stripping;
 * may be a partial UTF-8 character). FU_ERR_RANGE for a bad id. */
int tok_token_piece(const tok_tokenizer *t, int32_t id, const char **bytes, size_t *len);
/* Id of the token with exactly this text, or -1. */
int32_t tok_token_id(const tok_tokenizer *t, const char *text, size_t len);

/* ---- special tokens ---- */

int32_t tok_bos(const tok_tokenizer *t); /* -1 if none */
int32_t tok_eos(const tok_tokenizer *t); /* -1 if none */
int32_t tok_unk(const tok_tokenizer *t); /* -1 if none */
int32_t tok_pad(const tok_tokenizer *t); /* -1 if none */
bool tok_add_bos(const tok_tokenizer *t); /* encode(add_special) starts with BOS */
bool tok_add_eos(const tok_tokenizer *t); /* encode(add_special) ends with EOS */
bool tok_is_special(const tok_tokenizer *t, int32_t id); /* special added / control token */
/* Whether generating id ends a generation (EOS, <|eot_id|>, <|im_end|>,
 * generation_config's eos ids, ...). */
bool tok_is_eog(const tok_tokenizer *t, int32_t id);
/* The EOG ids: *ids owned by t. Returns their count. */
size_t tok_eog_ids(const tok_tokenizer *t, const int32_t **ids);

/* Strings for the chat-template module, owned by t; NULL if absent. */
const char *tok_chat_template(const tok_tokenizer *t);
const char *tok_bos_str(const tok_tokenizer *t);
const char *tok_eos_str(const tok_tokenizer *t);

/* What kind of tokenizer this is: "bpe-bytelevel", "bpe-spm" or "spm-scores". */
const char *tok_kind(const tok_tokenizer *t);

#endif
