/* gw-store.h -- the gateway's durable metadata in SQLite: uploaded files, fine-tuning jobs, their events and checkpoints.
 *
 * One database file (WAL journal) under the data directory. Its schema is
 * versioned with PRAGMA user_version: opening applies the migrations a file
 * lacks, each in its own transaction, and refuses a file written by a newer
 * gateway. Every write runs in a transaction: a write that fails leaves
 * nothing behind.
 *
 * Threading: one connection guarded by one mutex; every gw_store_* call may be
 * made from any thread. Ownership: the store owns its connection; records are
 * copied in and out (a list is malloc'd for the caller).
 */
#ifndef FU_GW_STORE_H
#define FU_GW_STORE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* The owner of a record: the SHA-256 of an API key as 64 hex digits, or a short name such as
 * "anonymous" (a gateway without keys). Never the key itself. */
#define GW_OWNER_MAX 65
#define GW_FILE_ID_MAX 48

typedef struct gw_store gw_store;

/* One uploaded file (OpenAI's file object, plus what the gateway keeps about it). */
typedef struct gw_file {
    char id[GW_FILE_ID_MAX];   /* "file-" + hex */
    char owner[GW_OWNER_MAX];
    char filename[256];        /* the client's base name, sanitized: never used as a path */
    char purpose[32];          /* "fine-tune" */
    int64_t bytes;
    int64_t created_at;        /* Unix seconds */
    char status[16];           /* "processed" or "error" */
    int64_t n_examples;
    char error[512];           /* status_details; "" when none */
} gw_file;

/* A listing: the files of `owner` (NULL: everyone's) with `purpose` (NULL: any), in upload
 * order (asc) or its reverse, starting after file `after` (NULL: from the first), at most limit. */
typedef struct gw_file_query {
    const char *owner;
    const char *purpose;
    const char *after;
    int limit;
    bool asc;
} gw_file_query;

/* Opens (creating, mode 0600) the database at path and brings its schema up to date.
 * FU_OK; FU_ERR_IO naming the file; FU_ERR_UNSUPPORTED for a schema newer than this
 * gateway's; FU_ERR_NOMEM. *out is NULL on failure. */
int gw_store_open(const char *path, gw_store **out);
/* Closes the database and frees the store. NULL is a no-op. */
void gw_store_close(gw_store *s);
/* The schema version this gateway writes (PRAGMA user_version). */
int gw_store_schema_version(void);

/* Inserts f (copied). FU_OK; FU_ERR_INVALID for a duplicate id or a field the schema refuses;
 * FU_ERR_IO. Nothing is kept on failure. */
int gw_store_file_insert(gw_store *s, const gw_file *f);
/* The file `id` if it belongs to `owner` (NULL: anyone) into *out. FU_OK or FU_ERR_NOT_FOUND
 * (absent, or another owner's); FU_ERR_IO. */
int gw_store_file_get(gw_store *s, const char *id, const char *owner, gw_file *out);
/* Deletes the file `id` if it belongs to `owner` (NULL: anyone). FU_OK, FU_ERR_NOT_FOUND, FU_ERR_IO. */
int gw_store_file_delete(gw_store *s, const char *id, const char *owner);
/* The files q selects: *out (malloc'd, *n entries; NULL when none) and whether more follow.
 * An `after` that q's owner cannot see is FU_ERR_NOT_FOUND. FU_OK, FU_ERR_IO, FU_ERR_NOMEM. */
int gw_store_file_list(gw_store *s, const gw_file_query *q, gw_file **out, size_t *n, bool *has_more);

/* ---- fine-tuning jobs ------------------------------------------------------------------------ */

#define GW_JOB_ID_MAX 48

/* One fine-tuning job (OpenAI's FineTuningJob, plus its owner and LoRA settings). JSON fields hold
 * compact JSON text ("" where none). */
typedef struct gw_ftjob {
    char id[GW_JOB_ID_MAX];            /* "ftjob-" + hex */
    char owner[GW_OWNER_MAX];
    char model[256];                   /* the base model's served id */
    char training_file[GW_FILE_ID_MAX];
    char validation_file[GW_FILE_ID_MAX]; /* "" when none */
    char suffix[72];
    int64_t seed;
    char hyperparameters[512];         /* {"n_epochs", "batch_size", "learning_rate_multiplier"} as resolved */
    char lora[1024];                   /* {"r", "alpha", "dropout", "target_modules"} */
    char status[24];                   /* validating_files, queued, running, succeeded, failed, cancelled */
    char fine_tuned_model[512];        /* "" until it succeeds */
    char error[1024];                  /* {"code", "message", "param"}; "" when none */
    int64_t created_at, finished_at;   /* Unix seconds; finished_at 0: not finished */
    int64_t trained_tokens;
    char result_files[256];            /* a JSON array of file ids */
    char metadata[12288];              /* a JSON object; "" when none */
    int64_t estimated_finish;          /* Unix seconds the runner expects it to end; 0: unknown */
} gw_ftjob;

/* One event of a job (fine_tuning.job.event). */
typedef struct gw_ftevent {
    char id[GW_JOB_ID_MAX];    /* "ftevent-" + hex */
    char job_id[GW_JOB_ID_MAX];
    int64_t created_at;
    char level[8];             /* info, warn, error */
    char type[16];             /* message or metrics */
    char message[512];
    char data[1024];           /* JSON object text; "" when none */
} gw_ftevent;

/* One checkpoint of a job (fine_tuning.job.checkpoint). */
typedef struct gw_ftckpt {
    char id[GW_JOB_ID_MAX];    /* "ftckpt-" + hex */
    char job_id[GW_JOB_ID_MAX];
    int64_t step_number;
    char metrics[1024];        /* JSON object text */
    char model[640];           /* fine_tuned_model_checkpoint */
    int64_t created_at;
} gw_ftckpt;

/* A page of a listing, newest first: records of `key` (a job's owner, NULL: everyone's; an
 * event's or checkpoint's job id) after record `after` (NULL: from the newest), at most limit. */
typedef struct gw_page_query {
    const char *key;
    const char *after;
    int limit;
} gw_page_query;

/* Inserts job j (copied). FU_OK; FU_ERR_INVALID (duplicate id, a value the schema refuses); FU_ERR_IO. */
int gw_store_job_insert(gw_store *s, const gw_ftjob *j);
/* Job `id` if it belongs to owner (NULL: anyone) into *out. FU_OK, FU_ERR_NOT_FOUND, FU_ERR_IO. */
int gw_store_job_get(gw_store *s, const char *id, const char *owner, gw_ftjob *out);
/* Writes j's status, fine_tuned_model, error, finished_at, trained_tokens, result_files and
 * estimated_finish, unless
 * the stored job has already ended (cancelled meanwhile): then FU_ERR_NOT_FOUND, nothing written. */
int gw_store_job_update(gw_store *s, const gw_ftjob *j);
/* Cancels job `id` of owner (NULL: anyone) unless it has ended (an ended job is left as it is);
 * *out: the job as it is now. FU_OK, FU_ERR_NOT_FOUND (no such job), FU_ERR_IO. */
int gw_store_job_cancel(gw_store *s, const char *id, const char *owner, gw_ftjob *out);
/* The oldest job not yet ended (validating_files, queued or running) whose id is not in
 * skip[0..n_skip) into *out: FU_OK, or FU_ERR_NOT_FOUND when there is none; FU_ERR_IO. */
int gw_store_job_next(gw_store *s, const char *const *skip, int n_skip, gw_ftjob *out);
/* The jobs q selects (q->key: the owner): *out (malloc'd, *n entries) and whether more follow. */
int gw_store_job_list(gw_store *s, const gw_page_query *q, gw_ftjob **out, size_t *n, bool *has_more);

/* Inserts event e (copied). FU_OK, FU_ERR_INVALID, FU_ERR_IO. */
int gw_store_event_insert(gw_store *s, const gw_ftevent *e);
/* The largest data.step of job_id's metrics events into *out (0: none). FU_OK, FU_ERR_IO. */
int gw_store_event_last_step(gw_store *s, const char *job_id, int64_t *out);
/* The events q selects (q->key: the job id), newest first. */
int gw_store_event_list(gw_store *s, const gw_page_query *q, gw_ftevent **out, size_t *n, bool *has_more);
/* Inserts checkpoint c (copied). FU_OK, FU_ERR_INVALID, FU_ERR_IO. */
int gw_store_ckpt_insert(gw_store *s, const gw_ftckpt *c);
/* The checkpoints q selects (q->key: the job id), newest first. */
int gw_store_ckpt_list(gw_store *s, const gw_page_query *q, gw_ftckpt **out, size_t *n, bool *has_more);

#endif
