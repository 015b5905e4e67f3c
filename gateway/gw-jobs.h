/* gw-jobs.h -- OpenAI's fine-tuning jobs (/v1/fine_tuning/jobs): creation, listing, cancel, events, checkpoints, and the runners that train them through the chain.
 *
 * A job is a LoRA fine-tune of the served base model on an uploaded file
 * (gw-files.h), recorded in the gateway's database (gw-store.h) with its
 * events and checkpoints. cfg->max_ft_jobs runner threads (1 by default: one
 * job after another) each take the oldest job not yet ended that no other
 * runner has (validating_files -> queued -> running -> succeeded | failed |
 * cancelled). A runner tokenizes the training and validation files with the
 * model's chat template (chat_train_line), opens one fusion.Train stage per
 * hop -- the static chain's, or on a routed swarm the members whose whole
 * spans tile the model (gw_swarm_train_chain) -- and runs n_epochs of AdamW
 * steps (train-run.h). It records a metrics event per step (with the
 * validation loss over the whole validation file at the end of each epoch),
 * the job's trained tokens and estimated_finish, a checkpoint per epoch
 * (DATA_DIR/jobs/<id>/ckpt-step-N: the adapter in PEFT's format plus its AdamW
 * moments, served as "ft:BASE:ORG:SUFFIX:JOB:ckpt-step-N") and at the end the
 * final adapter (DATA_DIR/jobs/<id>/final, served as "ft:BASE:ORG:SUFFIX:JOB")
 * and two "fine-tune-results" files: step_metrics.csv and loss_curve.svg.
 * A cancel is seen between steps. Jobs found unfinished at start are run
 * again from their last checkpoint, exactly (weights and moments), without
 * recording again the metrics events of steps already recorded; the adapters
 * of every checkpoint and finished job are served again. On a swarm, a chain
 * that loses a server is reported to the swarm and replaced by another, the
 * job going on from its last checkpoint (at most 3 times).
 *
 * Defaults ("auto"): n_epochs 3, batch_size min(8, examples), learning rate
 * 2e-4 x learning_rate_multiplier (1), linear warm-up over the first 10% of
 * the steps then cosine decay to 0, gradient-norm clip 1, no weight decay;
 * LoRA r 16, alpha 32, dropout 0, every linear layer.
 *
 * Threading: every gw_jobs_* route may be called from any thread (the store
 * locks itself); a job's runner is the only writer of its progress.
 * Ownership: gw_jobs borrows the config, model, files and swarm, which must
 * outlive it; results are new JSON references for the caller.
 */
#ifndef FU_GW_JOBS_H
#define FU_GW_JOBS_H

#include <jansson.h>

#include "gw-files.h"
#include "gw-gen.h"
#include "gw.h"

typedef struct gw_jobs gw_jobs;

/* Serves again the adapters of earlier jobs and starts the runners. cfg, m, files and swarm
 * (NULL: train on the static chain cfg->hops) are borrowed. FU_OK, or an error with fu_last_error() saying why. */
int gw_jobs_open(const gw_config *cfg, const gw_model *m, gw_files *files, struct gw_swarm *swarm, gw_jobs **out);
/* Stops the runners (a running job stops between steps and stays "running", to be resumed at the
 * next start) and frees j. NULL is a no-op. */
void gw_jobs_close(gw_jobs *j);

/* The routes; owner is the caller's (gw_files_owner), admin: sees every owner's jobs. Each
 * returns 0 with *out (a new reference), or the HTTP status with *err. */

/* POST /v1/fine_tuning/jobs: validates body, records the job (validating_files), wakes the runner. */
int gw_jobs_create(gw_jobs *j, const char *owner, bool admin, const json_t *body, json_t **out, gw_error *err);
/* GET /v1/fine_tuning/jobs?after&limit: {object: "list", data, has_more}, newest first. */
int gw_jobs_list(gw_jobs *j, const char *owner, bool admin, const char *after, const char *limit, json_t **out,
                 gw_error *err);
/* GET /v1/fine_tuning/jobs/{id}; 404 for a job the caller cannot see. */
int gw_jobs_get(gw_jobs *j, const char *owner, bool admin, const char *id, json_t **out, gw_error *err);
/* POST /v1/fine_tuning/jobs/{id}/cancel: the job, cancelled unless it had ended. */
int gw_jobs_cancel(gw_jobs *j, const char *owner, bool admin, const char *id, json_t **out, gw_error *err);
/* GET .../events?after&limit and .../checkpoints?after&limit: lists, newest first. */
int gw_jobs_events(gw_jobs *j, const char *owner, bool admin, const char *id, const char *after, const char *limit,
                   json_t **out, gw_error *err);
int gw_jobs_checkpoints(gw_jobs *j, const char *owner, bool admin, const char *id, const char *after,
                        const char *limit, json_t **out, gw_error *err);

#endif
