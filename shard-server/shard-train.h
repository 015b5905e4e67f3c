/* shard-train.h -- a shard server's fusion.Train service: LoRA training jobs over its span.
 *
 * Each job (TrainOpen) holds an adapter of the span's blocks, its gradients
 * and AdamW state, and a trainer (model/train.h) over the core's engine: the
 * frozen base weights are the ones the server serves from, shared. The calls
 * of one job run one at a time; jobs run side by side, and beside inference
 * (the backend serializes their ops). All jobs together hold at most the
 * configured memory; a job that would pass it is refused with
 * RESOURCE_EXHAUSTED and the figures. A job ends with Close, when its
 * coordinator stops calling for idle_timeout_ms, or when the server's span
 * changes.
 *
 * Priority: with SHARD_TRAIN_PRIORITY_INFERENCE (the default) a job's trainer
 * yields to inference before each of its matmuls through the base weights
 * (trn_set_yield): it waits while the core's batcher has steps queued or
 * running (shard_core_wait_idle), so that a step that arrives meanwhile
 * waits for one training op at most. So that training still advances under
 * a batcher that never rests, a wait lasts SHARD_TRAIN_YIELD_MAX_MS at most,
 * and one that runs that long gives the job a turn of SHARD_TRAIN_TURN_MS
 * without waits (its ops and the batcher's then alternate): training keeps
 * about a sixth of a saturated shard. With
 * SHARD_TRAIN_PRIORITY_FAIR it does not wait, and its ops and the batcher's
 * take turns on the backend's lock. Either way a call computes the same
 * results, bit for bit: the rule only moves training in time.
 *
 * Threads: the service's handlers run on the RPC server's workers; every
 * function here is thread-safe except _free, which must come after the RPC
 * server has stopped. Ownership: the service borrows its core and owns its
 * jobs.
 */
#ifndef FU_SHARD_TRAIN_H
#define FU_SHARD_TRAIN_H

#include <stdbool.h>
#include <stdint.h>

#include "rpc.h"
#include "shard-core.h"

typedef struct shard_train shard_train;

/* Whether training yields to inference on the shard (see above). */
typedef enum shard_train_priority {
    SHARD_TRAIN_PRIORITY_INFERENCE = 0, /* training waits while the batcher has work */
    SHARD_TRAIN_PRIORITY_FAIR,          /* training and inference take turns op by op */
} shard_train_priority;

/* The longest a trainer waits for an idle batcher before one op, and the turn it then takes. */
#define SHARD_TRAIN_YIELD_MAX_MS 100
#define SHARD_TRAIN_TURN_MS 20

typedef struct shard_train_config {
    uint64_t budget_bytes; /* memory of all jobs together (0: 2 GiB) */
    int max_jobs;          /* jobs at once (0: 4) */
    int max_rank;          /* largest LoRA rank (0: 256) */
    int max_tokens;        /* rows of one micro-batch (0: 4096) */
    int idle_timeout_ms;   /* a job's default idle expiry (0: 10 minutes) */
    shard_train_priority priority; /* default: SHARD_TRAIN_PRIORITY_INFERENCE */
} shard_train_config;

/* A service with no core yet (calls are refused with UNAVAILABLE until
 * shard_train_set_core). FU_OK or FU_ERR_NOMEM. */
int shard_train_new(const shard_train_config *cfg, shard_train **out);
/* Frees every job. NULL is a no-op. */
void shard_train_free(shard_train *t);

/* The core new jobs train over (borrowed; NULL: none). The jobs of the
 * previous core end (their next call gets NOT_FOUND), once their running
 * calls return. */
void shard_train_set_core(shard_train *t, shard_core *core);

/* True while a job (or a call of a closed one) still uses `core`: the core
 * may be freed only after this turns false. */
bool shard_train_uses(shard_train *t, const shard_core *core);

/* Registers fusion.Train's methods on srv (before rpc_server_start). */
int shard_train_serve(shard_train *t, rpc_server *srv);

/* Jobs open now. */
int shard_train_jobs(shard_train *t);

#endif
