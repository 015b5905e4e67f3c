/* engine.h -- the transformer forward pass over a model's span of blocks, for a batch of sequences.
 *
 * An engine binds a model (mdl_model) to a backend (op_backend) and owns the
 * scratch activations for its largest batch, so eng_forward() never allocates.
 * Each sequence (eng_seq) owns its KV cache for the span's blocks. A batch may
 * mix sequences and mix prefill (many positions of one sequence) with decode
 * (one position each): this is what continuous batching runs.
 *
 * A sequence may carry a LoRA adapter (eng_seq_set_adapter): its rows of a
 * batch then get scale * B (A x) added to the output of each targeted linear
 * layer, as PEFT adds it to the Linear's output: q/k/v before their bias,
 * q/k norm and RoPE; o and down before the residual add; gate and up before
 * SwiGLU. A batch groups its rows by adapter; rows without one are untouched.
 *
 * Threads: an engine and its sequences are used by one thread at a time (the
 * shard's batcher); the model it reads is shared. The caller owns engines and
 * sequences and frees them (sequences before their engine).
 */
#ifndef FU_ENGINE_H
#define FU_ENGINE_H

#include <stdbool.h>
#include <stdint.h>

#include "lora.h"
#include "model.h"
#include "ops.h"

typedef struct eng_engine eng_engine;
typedef struct eng_seq eng_seq;

typedef struct eng_options {
    int max_batch_tokens; /* tokens per internal forward chunk (default 256) */
    op_type kv_type;      /* OP_TYPE_F32 (default) or OP_TYPE_F16 */
} eng_options;

/* Creates an engine over `m` (borrowed: must outlive the engine) on `be`
 * (borrowed). opts may be NULL. */
int eng_new(const mdl_model *m, op_backend *be, const eng_options *opts, eng_engine **out);
void eng_free(eng_engine *e); /* NULL is a no-op */

const mdl_model *eng_model(const eng_engine *e);

/* Bytes of KV cache one position takes in this engine's span. */
uint64_t eng_kv_bytes_per_pos(const eng_engine *e);

/* Allocates a sequence with room for max_len positions (<= the model's
 * context). The caller frees it with eng_seq_free(). */
int eng_seq_new(eng_engine *e, int max_len, eng_seq **out);
void eng_seq_free(eng_engine *e, eng_seq *s); /* NULL is a no-op */

/* Positions held in the cache. */
int eng_seq_len(const eng_seq *s);
int eng_seq_max_len(const eng_seq *s);
/* Rolls the sequence back to its first `len` positions (len <= current). */
int eng_seq_truncate(eng_seq *s, int len);

/* ---- KV export and import (prefix caching) --------------------------------------------
 * A run of positions' KV as host bytes in the engine's KV type, laid out
 * (n_span, {K, V}, KVH, n, hd): eng_kv_bytes_per_pos(e) * n bytes. What one
 * sequence exports, another of the same engine imports at the same positions,
 * after which its forwards give exactly what they would had it computed them. */

/* Copies positions [pos, pos + n) of s's cache (pos + n <= its length) into
 * dst (host, caller's; eng_kv_bytes_per_pos * n bytes). FU_ERR_RANGE outside
 * the held positions; a backend copy's status otherwise. */
int eng_seq_kv_export(eng_seq *s, int pos, int n, void *dst);

/* Appends the first n positions of src (host; an export of src_n >= n
 * positions) at s's current length `pos`, which then grows by n. FU_ERR_RANGE
 * when pos is not the length, n > src_n or the positions do not fit max_len. */
int eng_seq_kv_import(eng_seq *s, int pos, int n, const void *src, int src_n);

/* Sets the LoRA adapter of sequence s (borrowed: it must outlive its use by
 * the sequence; NULL: none) for the forwards that follow; the cache already
 * held is kept as it is. The adapter must hold exactly the engine's span
 * [first, last) of blocks and have the model's shape (FU_ERR_INVALID naming
 * the difference); the backend must have op_add_rows (FU_ERR_UNSUPPORTED
 * otherwise). Puts the adapter where the backend reads it (lora_upload, once)
 * and sizes the engine's LoRA scratch for its rank (FU_ERR_NOMEM), so that
 * forwards do not allocate. */
int eng_seq_set_adapter(eng_seq *s, lora_adapter *a);

typedef struct eng_batch {
    int n_tokens;             /* T */
    const int32_t *tokens;    /* (T) token ids; used when the model has embeddings */
    const float *embd;        /* (T, D) input hidden states; used otherwise */
    eng_seq *const *seqs;     /* (T) sequence of each token; a sequence's tokens appear
                                 in order and are appended at its current length */
    const uint8_t *want;      /* (T) nonzero: produce output for this token; NULL: all */
} eng_batch;

/* Runs the span on a batch and appends the batch's positions to each
 * sequence's cache. Output, in token order over the wanted tokens:
 *   - the model has its head: logits (n_want, V) into out;
 *   - otherwise: hidden states after the span's last block (n_want, D).
 * On error no sequence's length changes (its cache contents past that length
 * are unspecified). */
int eng_forward(eng_engine *e, const eng_batch *b, float *out);

/* eng_forward for a model with its head, writing instead of logits the
 * hidden states after the output norm (n_want, D): the rows the LM head
 * would read (embeddings). FU_ERR_UNSUPPORTED without the head. */
int eng_forward_final_hidden(eng_engine *e, const eng_batch *b, float *out);

#endif
