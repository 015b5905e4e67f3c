/* gw-jobs-impl.h -- what gw-jobs.c (the routes) and gw-jobs-run.c (the runner) share.
 *
 * Threading: the runner's flags are under gw_jobs.mu. Ownership: as gw-jobs.h.
 */
#ifndef FU_GW_JOBS_IMPL_H
#define FU_GW_JOBS_IMPL_H

#include <pthread.h>
#include <stdbool.h>

#include "gw-jobs.h"
#include "gw-store.h"

struct gw_jobs {
    const gw_config *cfg;
    const gw_model *model;
    gw_files *files;
    gw_store *store;      /* the files' database, borrowed */
    pthread_t runner;
    bool runner_started;
    pthread_mutex_t mu;
    pthread_cond_t cv;    /* a new job, a cancel, or the stop */
    bool wake, stopping;  /* under mu */
};

/* A new id: prefix and 24 random hex digits into out[GW_JOB_ID_MAX]. FU_OK or FU_ERR_INTERNAL. */
int gw_jobs_new_id(const char *prefix, char out[GW_JOB_ID_MAX]);
/* Records an event of job `id` (data: a JSON object or NULL, not taken). Failures are logged. */
void gw_jobs_event(gw_jobs *j, const char *id, const char *level, const char *type, const json_t *data,
                   const char *fmt, ...) __attribute__((format(printf, 6, 7)));
/* The served name of job jb's adapter: "ft:BASE:ORG:SUFFIX:JOB", with ":ckpt-step-N" when step > 0. */
void gw_jobs_model_name(const gw_jobs *j, const gw_ftjob *jb, int64_t step, char *out, size_t cap);
/* DATA_DIR/jobs/<id>/<leaf> into out[cap] (leaf NULL: the job's directory). */
void gw_jobs_dir(const gw_jobs *j, const char *id, const char *leaf, char *out, size_t cap);

/* Serves again every checkpoint and finished job's adapter (at open). */
void gw_jobs_reserve(gw_jobs *j);
/* The runner thread's body (arg: the gw_jobs). */
void *gw_jobs_runner(void *arg);
/* Wakes the runner (a new job, a cancel). */
void gw_jobs_wake(gw_jobs *j);

#endif
