/* train-remote.h -- a training stage on a shard server: the coordinator's side of fusion.Train.
 *
 * trn_remote_open() opens a job on the server behind a channel; its
 * trn_stage (model/train-run.h) turns the coordinator's calls into the
 * service's RPCs: hidden states out and gradients back in the wire dtype
 * asked for (BF16 by default, F32 for results equal to one process), the
 * loss from the head, the gradient norm, AdamW steps and state get/put. A
 * call whose server is gone (UNAVAILABLE, DEADLINE_EXCEEDED, CANCELLED,
 * ABORTED, or NOT_FOUND for the job: the server restarted) fails with
 * FU_ERR_NETWORK, which a run answers by replacing the stage; every other
 * refusal keeps its meaning (FU_ERR_INVALID, FU_ERR_EXHAUSTED, ...), with
 * the server's message.
 *
 * Threads: a stage is driven by one thread at a time. Ownership: it borrows
 * its channel (which must outlive it) and owns its buffers; trn_remote_close
 * ends the job and frees it.
 */
#ifndef FU_TRAIN_REMOTE_H
#define FU_TRAIN_REMOTE_H

#include <stdbool.h>
#include <stdint.h>

#include "lora.h"
#include "rpc-base.h"
#include "train-run.h"

typedef struct trn_remote_options {
    const char *job_id;      /* unique on the server, 1..128 bytes */
    int first_block, last_block;
    bool embed, head;        /* the span starts at the embeddings / holds the head */
    const lora_config *lora; /* rank, alpha, dropout, rslora, targets */
    uint64_t init_seed;      /* a fresh adapter's A */
    int max_tokens, slots;
    bool keep_activations;
    int dim;                 /* D: hidden size */
    int wire_dtype;          /* hidden states and gradients: WIRE_BF16 (0) or WIRE_F32 */
    int timeout_ms;          /* bound on each call (0: 10 minutes) */
    int idle_timeout_ms;     /* the job's expiry on the server (0: its default) */
} trn_remote_options;

typedef struct trn_remote trn_remote;

/* Opens the job on the server behind ch (borrowed), fresh or from `state`
 * (NULL: fresh). FU_OK with *out set; FU_ERR_NETWORK when the server cannot
 * be reached, else the server's refusal. */
int trn_remote_open(rpc_channel *ch, const trn_remote_options *o, const trn_state *state, trn_remote **out);

/* The stage that drives it (valid until trn_remote_close). */
trn_stage trn_remote_stage(trn_remote *r);

/* Memory the job holds on its server, as it reported at open. */
int64_t trn_remote_bytes(const trn_remote *r);

/* Ends the job on its server (best effort, without waiting for a dead one
 * longer than a second) and frees r. NULL is a no-op. */
void trn_remote_close(trn_remote *r);

#endif
