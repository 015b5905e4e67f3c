/* train.h -- LoRA fine-tuning over a span of blocks: the training forward and backward, the loss at the head, AdamW.
 *
 * A trainer (trn_span) trains one LoRA adapter, in place, over the span of an
 * engine (eng_engine), whose prepared base weights stay frozen in the type
 * they are held in. A micro-batch is T rows of examples packed back to back:
 * first[t] is the row of the first token of row t's example, and each example
 * is causal within itself (padding is an example of its own, or rows whose
 * target is -1).
 *
 * trn_forward() runs the span on a micro-batch and keeps what the backward
 * pass needs in a slot; several slots let micro-batches be in flight at once
 * (a pipeline over shards). On the span that holds the LM head it also
 * computes the loss of the rows' targets and the gradient of the span's
 * output, chunk by chunk, so that full-vocabulary logits never leave it.
 * trn_backward() takes the gradient of the span's output (the head's own at
 * the last span), returns the gradient of its input and adds the adapter's
 * gradients into the trainer's accumulators; gradient accumulation over
 * micro-batches is just several backwards before a step. trn_step() applies
 * AdamW (PyTorch's torch.optim.AdamW, decoupled weight decay) to the adapter
 * and clears the gradients.
 *
 * Memory (trn_options.memory):
 *   - TRN_RECOMPUTE (the default): a slot keeps each block's input (T x D
 *     floats per block) and the backward pass runs each block's forward again
 *     to rebuild its internals (activation checkpointing per block: about a
 *     third more compute, a fifteenth of the activations);
 *   - TRN_KEEP: a slot keeps every block's internals as well (no
 *     recomputation; for spans and micro-batches that fit).
 * trn_new() adds up the slots, the scratch, the gradients and the optimizer
 * state and refuses (FU_ERR_EXHAUSTED, with the figures) a configuration over
 * trn_options.budget_bytes.
 *
 * Dropout (lora_dropout) masks are a function of the micro-batch's seed, the
 * block and the target only (op_dropout), so a span computes the same masks
 * as one process running every block, and the backward pass recomputes them.
 *
 * Yielding: a trainer may be given a yield hook (trn_set_yield), which it
 * calls on its own thread before each matmul through the frozen weights
 * (the projections and the LM head: the ops that take the time, 4 per block
 * forward, 11 backward with recomputation). The hook may block (a server
 * that shares the backend with inference makes training wait there while
 * inference has work); it only delays the next ops, so the results are the
 * same, bit for bit, with or without one.
 *
 * Threading: a trainer is used by one thread at a time. Ownership: it borrows
 * its engine and adapter (both must outlive it; the adapter's weights change
 * at each trn_step) and frees its own buffers in trn_free().
 */
#ifndef FU_TRAIN_H
#define FU_TRAIN_H

#include <stdint.h>

#include "engine.h"
#include "lora.h"

typedef struct trn_span trn_span;

typedef enum trn_memory {
    TRN_RECOMPUTE = 0, /* keep block inputs, recompute internals in backward */
    TRN_KEEP,          /* keep every block's internals */
} trn_memory;

typedef struct trn_options {
    int max_tokens;        /* rows of the largest micro-batch (default 1024) */
    int slots;             /* micro-batches in flight at once (default 1) */
    trn_memory memory;     /* default TRN_RECOMPUTE */
    uint64_t budget_bytes; /* 0: no limit */
} trn_options;

/* Creates a trainer of adapter `ad` over engine `e`'s span. The adapter must
 * hold exactly the span's blocks and the model's shape (FU_ERR_INVALID
 * naming the difference); the backend must run the training ops
 * (FU_ERR_UNSUPPORTED otherwise). opts may be NULL. FU_ERR_EXHAUSTED when the
 * memory it needs is over the budget, FU_ERR_NOMEM. */
int trn_new(eng_engine *e, lora_adapter *ad, const trn_options *opts, trn_span **out);
void trn_free(trn_span *s); /* NULL is a no-op */

/* Called before each long op of trn_forward and trn_backward on the
 * trainer's thread, with `arg`; it may block, and it cannot fail. */
typedef void (*trn_yield_fn)(void *arg);

/* Sets the trainer's yield hook (fn NULL: none, the default); arg is
 * borrowed and must outlive the hook's use. */
void trn_set_yield(trn_span *s, trn_yield_fn fn, void *arg);

/* The adapter it trains (borrowed). */
const lora_adapter *trn_adapter(const trn_span *s);

/* Bytes the trainer holds (slots, scratch, gradients, optimizer state). */
uint64_t trn_bytes(const trn_span *s);

typedef struct trn_batch {
    int n_tokens;           /* T, 1..max_tokens */
    const int32_t *tokens;  /* (T) ids, when the span starts at the embeddings */
    const float *embd;      /* (T, D) input hidden states otherwise */
    const int32_t *first;   /* (T) row of the first token of row t's example */
    const int32_t *targets; /* (T) at the head: the token row t predicts, or -1 (no loss) */
    float loss_scale;       /* at the head: the gradient is of loss_scale * sum of the losses */
    uint64_t seed;          /* dropout masks of this micro-batch */
} trn_batch;

typedef struct trn_loss {
    double sum;        /* sum of the rows' cross-entropies (nats) */
    int64_t n_tokens;  /* rows with a target */
    int64_t n_correct; /* of which the largest logit is the target */
} trn_loss;

/* Runs the span's forward on micro-batch b into slot `slot` (0..slots-1,
 * which must be free). Writes the span's output hidden states (T, D) to out
 * (host memory; may be NULL at the head), and at the head the loss of the
 * rows with targets to *loss (may be NULL elsewhere). FU_ERR_INVALID or
 * FU_ERR_RANGE for a bad batch (sizes, ids, first[], targets), nothing kept. */
int trn_forward(trn_span *s, int slot, const trn_batch *b, float *out, trn_loss *loss);

/* The backward pass of the micro-batch in `slot`: dy (T, D) host memory is
 * the gradient of the span's output (ignored at the head, which uses the
 * loss's own); writes the gradient of the span's input hidden states (T, D)
 * to dx (host memory; NULL: not wanted) and adds the adapter's gradients to
 * the accumulators. Frees the slot, also on error. */
int trn_backward(trn_span *s, int slot, const float *dy, float *dx);

/* Forgets the micro-batch in `slot` (a step abandoned); a free slot is a no-op. */
void trn_drop(trn_span *s, int slot);

/* The squared L2 norm of the accumulated gradients (NaN or Inf when one is
 * not finite), for global clipping across spans. */
double trn_grad_sqnorm(const trn_span *s);

/* Clears the accumulated gradients. */
void trn_zero_grad(trn_span *s);

typedef struct trn_adamw {
    float beta1, beta2, eps, weight_decay;
} trn_adamw;

/* PyTorch's defaults: 0.9, 0.999, 1e-8, 0.01. */
trn_adamw trn_adamw_default(void);

/* One AdamW step (number `t` >= 1, for bias correction) with learning rate
 * lr on the gradients times grad_scale (the clip factor, and 1/n for a mean
 * over n micro-batches if the loss scale did not already divide), then clears
 * the gradients. FU_ERR_RANGE when a gradient is not finite: nothing changes
 * (the gradients are kept, for the caller to inspect or clear). */
int trn_step(trn_span *s, const trn_adamw *h, float lr, float grad_scale, int64_t t);

/* The optimizer state, laid out as the adapter's data (lora_adapter.data):
 * AdamW's first and second moments, n_floats each, for snapshots; writable
 * (a snapshot is put back by writing them and the adapter's data). */
float *trn_moment1(trn_span *s);
float *trn_moment2(trn_span *s);
/* The accumulated gradients, laid out likewise. */
const float *trn_grads(const trn_span *s);

/* Rows of the micro-batch in `slot`, 0 when the slot is free or out of range. */
int trn_slot_tokens(const trn_span *s, int slot);

/* The span's adapter weights and AdamW moments in PEFT's order (lora_save's:
 * q_proj / k_proj rows as PEFT holds them, whatever the model's layout), each
 * ad->n_floats floats, into params, m1 and m2 (any may be NULL); the form
 * snapshots and other servers exchange. */
int trn_export(const trn_span *s, float *params, float *m1, float *m2);

/* Puts back what trn_export gave (m1, m2 NULL: zeros), clearing the
 * gradients and every slot. FU_ERR_NOMEM, nothing changed. */
int trn_import(trn_span *s, const float *params, const float *m1, const float *m2);

typedef enum trn_decay {
    TRN_DECAY_LINEAR = 0, /* to 0 at `total` */
    TRN_DECAY_COSINE,     /* half a cosine to 0 at `total` */
    TRN_DECAY_CONSTANT,
} trn_decay;

typedef struct trn_schedule {
    float lr;       /* peak learning rate */
    int64_t warmup; /* steps of linear warm-up from 0 */
    int64_t total;  /* steps in the run */
    trn_decay decay;
} trn_schedule;

/* The learning rate of the step after `done` steps (0 for the first), as
 * transformers' get_{linear,cosine,constant}_schedule_with_warmup give it. */
float trn_lr_at(const trn_schedule *sc, int64_t done);

#endif
