/* gw-jobs-impl.h -- what gw-jobs.c (the routes) and gw-jobs-run.c (the runner) share.
 *
 * Threading: the runners' flags and slots are under gw_jobs.mu. Ownership: as gw-jobs.h.
 */
#ifndef FU_GW_JOBS_IMPL_H
#define FU_GW_JOBS_IMPL_H

#include <pthread.h>
#include <stdbool.h>

#include "gw-jobs.h"
#include "gw-store.h"
#include "gw-swarm.h"

/* A runner thread and the job it trains. */
typedef struct gw_jobs_slot {
    struct gw_jobs *j;
    pthread_t thread;
    bool started;
    char id[GW_JOB_ID_MAX]; /* the job it trains; "" when idle (under gw_jobs.mu) */
} gw_jobs_slot;

struct gw_jobs {
    const gw_config *cfg;
    const gw_model *model;
    gw_files *files;
    gw_store *store;      /* the files' database, borrowed */
    gw_swarm *swarm;      /* the routed swarm, borrowed; NULL: the static chain (cfg->hops) */
    gw_jobs_slot slots[GW_MAX_FT_JOBS]; /* cfg->max_ft_jobs runners */
    int n_slots;
    pthread_mutex_t mu;
    pthread_cond_t cv;    /* a new job, a cancel, or the stop */
    unsigned gen;         /* bumped by each wake (under mu) */
    bool stopping;        /* under mu */
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
/* A runner thread's body (arg: its gw_jobs_slot): it trains the oldest job no other runner has,
 * one after another, until the stop. */
void *gw_jobs_runner(void *arg);
/* Wakes the runner (a new job, a cancel). */
void gw_jobs_wake(gw_jobs *j);

#endif
