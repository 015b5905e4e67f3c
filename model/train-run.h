/* train-run.h -- a training run over a chain of spans: packing examples into micro-batches, one optimizer step at a time.
 *
 * The coordinator's core. A run drives stages, one per span of the model in
 * block order, through a small vtable: a stage is a trainer in this process
 * (trn_stage_local) or a shard across the network (the same calls as RPCs).
 * A step takes a batch of examples, packs them into micro-batches of at most
 * max_tokens rows, runs each micro-batch forward through every stage and
 * backward in reverse -- with `pipeline` micro-batches in flight, on GPipe's
 * schedule, so that the stages (servers) work on different micro-batches at
 * once, each call on its own thread -- then clips the gradients by their
 * global norm (every stage reports its squared norm; the clip factor goes out
 * with the step) and has every stage apply AdamW with the schedule's learning
 * rate. The loss is the mean cross-entropy over the step's target tokens: the
 * head's loss scale is 1 / (target tokens of the whole step), so accumulating
 * micro-batches gives the gradient of that mean. Every stage meets the
 * micro-batches in the same order whatever the pipeline's depth, so its
 * gradients, and the run, do not depend on it.
 *
 * Threading: a run is driven by one thread; its pipeline calls each stage
 * from one thread at a time. Ownership: the run copies its
 * stage array (the stages' objects stay the caller's) and owns its
 * snapshots; the caller owns examples and results.
 */
#ifndef FU_TRAIN_RUN_H
#define FU_TRAIN_RUN_H

#include <stdint.h>

#include "train.h"

/* A span's adapter weights and AdamW moments in PEFT's order (trn_export),
 * n floats each: a snapshot. */
typedef struct trn_state {
    int first, last; /* blocks */
    size_t n;
    float *params, *m1, *m2; /* malloc'd; trn_state_clear frees them */
} trn_state;

void trn_state_clear(trn_state *s);

/* The file beside a PEFT adapter that carries its AdamW moments: tensors
 * "exp_avg" and "exp_avg_sq", f32, each the whole adapter's floats in PEFT's
 * order (the order of trn_run_params), so that a run resumed from the
 * directory continues exactly where it stopped. */
#define TRN_OPTIMIZER_FILE "optimizer.safetensors"

/* Writes m1 and m2 (n floats each) as dir/TRN_OPTIMIZER_FILE, atomically.
 * st_write's errors. */
int trn_optimizer_save(const char *dir, const float *m1, const float *m2, size_t n);

/* The state of blocks [first, last) of the PEFT adapter in directory dir
 * (lora_load for model m, ranks up to max_rank): its weights in PEFT's order,
 * and its moments from dir/TRN_OPTIMIZER_FILE when that file exists (else
 * none: zeros). The caller clears *out. lora_load's errors; FU_ERR_FORMAT
 * for an optimizer file whose tensors are missing, of another dtype or not
 * the adapter's size; FU_ERR_NOMEM. */
int trn_state_load(const char *dir, const mdl_config *m, int first, int last, int max_rank, trn_state *out);

/* A span of the chain, as the coordinator drives it; every call returns FU_OK
 * or a negative fu_status with the error set. FU_ERR_NETWORK means the
 * stage's server is gone (the run may replace it); any other error is the
 * call's own. */
typedef struct trn_stage_vt {
    int (*forward)(void *st, int slot, const trn_batch *b, float *out, trn_loss *loss);
    int (*backward)(void *st, int slot, const float *dy, float *dx);
    int (*sqnorm)(void *st, double *out);
    int (*step)(void *st, const trn_adamw *h, float lr, float grad_scale, int64_t t);
    void (*drop)(void *st, int slot);
    int (*zero_grad)(void *st);
    int (*get_state)(void *st, trn_state *out); /* *out filled with new arrays */
    int (*put_state)(void *st, const trn_state *s); /* also clears gradients and slots */
} trn_stage_vt;

typedef struct trn_stage {
    const trn_stage_vt *vt;
    void *st;
} trn_stage;

/* A stage over a trainer in this process (borrowed). */
trn_stage trn_stage_local(trn_span *s);

/* One training example: tokens and, for each, the token it must predict
 * (target[t], -1 where no loss is taken: prompts, padding, weight-0
 * messages). */
typedef struct trn_example {
    int n;
    const int32_t *tokens;
    const int32_t *target;
} trn_example;

/* Replaces stage `index`, whose server is gone, with a new one holding the
 * same blocks and state `snap` (its caller-side object is the callback's to
 * keep and free); FU_OK with *out set, or the error that ends the run. */
typedef int (*trn_replace_fn)(void *arg, int index, const trn_state *snap, trn_stage *out);

#define TRN_MAX_STAGES 64   /* stages of a run */
#define TRN_MAX_PIPELINE 64 /* micro-batches in flight */

typedef struct trn_run_options {
    int max_tokens;      /* rows per micro-batch (the stages' max_tokens) */
    int pipeline;        /* micro-batches in flight at once, GPipe-style (<= the stages' slots;
                            0 or 1: one at a time) */
    int dim;             /* D: hidden size */
    float clip;          /* global gradient-norm bound; <= 0: none */
    trn_adamw adamw;
    trn_schedule sched;
    uint64_t seed;       /* dropout seeds derive from it, the step and the micro-batch */
    /* Failover: with replace set, the run snapshots every stage's state at its
     * start and every snapshot_every steps (0: 1); when a stage's server is
     * gone (FU_ERR_NETWORK) it has the callback replace that stage from the
     * last snapshot, puts every other stage back to it, replays the steps since
     * and runs the interrupted one again, up to max_replacements times in a
     * run. The examples of those steps must stay valid until the next
     * snapshot. */
    trn_replace_fn replace;
    void *replace_arg;
    int snapshot_every;
    int max_replacements;
} trn_run_options;

typedef struct trn_run trn_run;

/* A run over n_stages stages (borrowed, in block order: the first starts at
 * the embeddings, the last holds the head). FU_ERR_INVALID for bad options,
 * FU_ERR_NOMEM. */
int trn_run_new(const trn_stage *stages, int n_stages, const trn_run_options *o, trn_run **out);
/* Frees the run and its snapshots (not its stages). NULL is a no-op. */
void trn_run_free(trn_run *r);

typedef struct trn_step_result {
    int64_t step;        /* the step just taken, from 1 */
    double loss;         /* mean cross-entropy over the step's target tokens */
    double accuracy;     /* share of them whose largest logit was the target */
    int64_t n_tokens;    /* target tokens */
    double grad_norm;    /* global norm before clipping */
    float lr;            /* the learning rate applied */
    int micro_batches;
} trn_step_result;

/* One optimizer step on examples ex[0..n): forward and backward of every
 * micro-batch, clipping, AdamW. FU_ERR_RANGE for an example longer than
 * max_tokens, without target tokens in the whole batch, or with a
 * non-finite gradient (the step is then not applied and the gradients are
 * cleared: the run can go on with the next batch); a stage's error
 * otherwise. */
int trn_run_step(trn_run *r, const trn_example *ex, int n, trn_step_result *res);

/* The mean loss of examples ex[0..n) without training (for validation):
 * forward only. */
int trn_run_eval(trn_run *r, const trn_example *ex, int n, double *loss, double *accuracy);

/* Steps taken so far; trn_run_set_steps() restores it from a snapshot. */
int64_t trn_run_steps(const trn_run *r);
void trn_run_set_steps(trn_run *r, int64_t steps);

/* Stages replaced so far. */
int trn_run_replacements(const trn_run *r);

/* The run's stage `index` now (a replaced one's successor). */
trn_stage trn_run_stage(const trn_run *r, int index);

/* The whole adapter's weights in PEFT's order, the stages' states (get_state)
 * one after another into params, and their AdamW moments into m1 and m2 (each
 * n floats: the whole adapter's n_floats; m1 and m2 may be NULL).
 * FU_ERR_FORMAT unless the states fill exactly n floats; a stage's error. */
int trn_run_params(const trn_run *r, float *params, float *m1, float *m2, size_t n);

#endif
