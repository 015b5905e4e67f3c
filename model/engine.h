/* engine.h -- the transformer forward pass over a model's span of blocks, for a batch of sequences.
 *
 * An engine binds a model (mdl_model) to a backend (op_backend) and owns the
 * scratch activations for its largest batch, so eng_forward() never allocates.
 * Each sequence (eng_seq) owns its KV cache for the span's blocks. A batch may
 * mix sequences and mix prefill (many positions of one sequence) with decode
 * (one position each): this is what continuous batching runs.
 *
 * Threads: an engine and its sequences are used by one thread at a time (the
 * shard's batcher); the model it reads is shared. The caller owns engines and
 * sequences and frees them (sequences before their engine).
 */
#ifndef FU_ENGINE_H
#define FU_ENGINE_H

#include <stdint.h>

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

#endif
