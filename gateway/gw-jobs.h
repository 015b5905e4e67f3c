/* gw-jobs.h -- OpenAI's fine-tuning jobs (/v1/fine_tuning/jobs): creation, listing, cancel, events, checkpoints, and the runner that trains them through the chain.
 *
 * A job is a LoRA fine-tune of the served base model on an uploaded file
 * (gw-files.h), recorded in the gateway's database (gw-store.h) with its
 * events and checkpoints. One runner thread takes the jobs not yet ended one
 * after another, oldest first (validating_files -> queued -> running ->
 * succeeded | failed | cancelled): it tokenizes the training file with the
 * model's chat template (chat_train_line), opens one fusion.Train stage per
 * hop of the static chain (train-remote.h) and runs n_epochs of AdamW steps
 * (train-run.h), writing a metrics event per step, a checkpoint per epoch
 * (DATA_DIR/jobs/<id>/ckpt-step-N, served as "ft:BASE:ORG:SUFFIX:JOB:ckpt-step-N")
 * and at the end the final adapter (DATA_DIR/jobs/<id>/final, served as
 * "ft:BASE:ORG:SUFFIX:JOB") and a metrics CSV as a "fine-tune-results" file.
 * A cancel is seen between steps. Jobs found unfinished at start are run
 * again, from their last checkpoint when they have one; the adapters of
 * every checkpoint and finished job are served again.
 *
 * Defaults ("auto"): n_epochs 3, batch_size min(8, examples), learning rate
 * 2e-4 x learning_rate_multiplier (1), linear warm-up over the first 10% of
 * the steps then cosine decay to 0, gradient-norm clip 1, no weight decay;
 * LoRA r 16, alpha 32, dropout 0, every linear layer.
 *
 * Threading: every gw_jobs_* route may be called from any thread (the store
 * locks itself); the runner is the only writer of a running job's progress.
 * Ownership: gw_jobs borrows the config, model and files, which must outlive
 * it; results are new JSON references for the caller.
 */
#ifndef FU_GW_JOBS_H
#define FU_GW_JOBS_H

#include <jansson.h>

#include "gw-files.h"
#include "gw-gen.h"
#include "gw.h"

typedef struct gw_jobs gw_jobs;

/* Serves again the adapters of earlier jobs and starts the runner. cfg, m and files are
 * borrowed. FU_OK, or an error with fu_last_error() saying why. */
int gw_jobs_open(const gw_config *cfg, const gw_model *m, gw_files *files, gw_jobs **out);
/* Stops the runner (a running job stops between steps and stays "running", to be resumed at the
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
