/* gw-store.c -- the gateway's SQLite metadata: schema migrations, files CRUD, paging. */
#include "gw-store.h"

#include <fcntl.h>
#include <jansson.h>
#include <pthread.h>
#include <sqlite3.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "status.h"

struct gw_store {
    sqlite3 *db;
    pthread_mutex_t mu; /* the connection and its statements */
};

/* A table of records with ids, paged by insertion order: its name, the column a page is keyed on, its columns, its row. */
typedef struct gw_table {
    const char *name, *key, *columns;
    size_t size;                                   /* bytes of one record */
    void (*row)(sqlite3_stmt *st, void *out);      /* the row st is on (columns) into *out */
} gw_table;

/* The migrations: migrations[i] takes a database from user_version i to i + 1. */
static const char *const migrations[] = {
    "CREATE TABLE files ("
    " seq INTEGER PRIMARY KEY AUTOINCREMENT,"
    " id TEXT NOT NULL UNIQUE CHECK (length(id) > 5 AND substr(id, 1, 5) = 'file-'),"
    " owner TEXT NOT NULL CHECK (length(owner) > 0),"
    " filename TEXT NOT NULL,"
    " purpose TEXT NOT NULL,"
    " bytes INTEGER NOT NULL CHECK (bytes >= 0),"
    " created_at INTEGER NOT NULL,"
    " status TEXT NOT NULL CHECK (status IN ('uploaded', 'processed', 'error')),"
    " n_examples INTEGER NOT NULL DEFAULT 0,"
    " error TEXT NOT NULL DEFAULT '');"
    "CREATE INDEX files_owner ON files (owner, seq);",
    "CREATE TABLE jobs ("
    " seq INTEGER PRIMARY KEY AUTOINCREMENT,"
    " id TEXT NOT NULL UNIQUE CHECK (substr(id, 1, 6) = 'ftjob-'),"
    " owner TEXT NOT NULL CHECK (length(owner) > 0),"
    " model TEXT NOT NULL, training_file TEXT NOT NULL, validation_file TEXT NOT NULL DEFAULT '',"
    " suffix TEXT NOT NULL DEFAULT '', seed INTEGER NOT NULL, hyperparameters TEXT NOT NULL,"
    " lora TEXT NOT NULL, status TEXT NOT NULL CHECK (status IN ('validating_files', 'queued', 'running',"
    " 'succeeded', 'failed', 'cancelled')),"
    " fine_tuned_model TEXT NOT NULL DEFAULT '', error TEXT NOT NULL DEFAULT '', created_at INTEGER NOT NULL,"
    " finished_at INTEGER NOT NULL DEFAULT 0, trained_tokens INTEGER NOT NULL DEFAULT 0,"
    " result_files TEXT NOT NULL DEFAULT '[]', metadata TEXT NOT NULL DEFAULT '');"
    "CREATE INDEX jobs_owner ON jobs (owner, seq);"
    "CREATE TABLE job_events ("
    " seq INTEGER PRIMARY KEY AUTOINCREMENT,"
    " id TEXT NOT NULL UNIQUE CHECK (substr(id, 1, 8) = 'ftevent-'),"
    " job_id TEXT NOT NULL REFERENCES jobs (id) ON DELETE CASCADE, created_at INTEGER NOT NULL,"
    " level TEXT NOT NULL, type TEXT NOT NULL CHECK (type IN ('message', 'metrics')), message TEXT NOT NULL,"
    " data TEXT NOT NULL DEFAULT '');"
    "CREATE INDEX job_events_job ON job_events (job_id, seq);"
    "CREATE TABLE job_checkpoints ("
    " seq INTEGER PRIMARY KEY AUTOINCREMENT,"
    " id TEXT NOT NULL UNIQUE CHECK (substr(id, 1, 7) = 'ftckpt-'),"
    " job_id TEXT NOT NULL REFERENCES jobs (id) ON DELETE CASCADE, step_number INTEGER NOT NULL,"
    " metrics TEXT NOT NULL, fine_tuned_model_checkpoint TEXT NOT NULL, created_at INTEGER NOT NULL);"
    "CREATE INDEX job_checkpoints_job ON job_checkpoints (job_id, seq);",
    "ALTER TABLE jobs ADD COLUMN estimated_finish INTEGER NOT NULL DEFAULT 0;",
};

#define GW_STORE_VERSION ((int)(sizeof migrations / sizeof migrations[0]))

int gw_store_schema_version(void) {
    return GW_STORE_VERSION;
}

/* fu_errorf with SQLite's message for the connection's last error. */
static int gw_store_fail(gw_store *s, int status, const char *what) {
    return fu_errorf(status, "database: %s: %s", what, sqlite3_errmsg(s->db));
}

/* Runs sql (no results). FU_OK or FU_ERR_IO. */
static int gw_store_exec(gw_store *s, const char *sql) {
    return sqlite3_exec(s->db, sql, NULL, NULL, NULL) == SQLITE_OK ? FU_OK : gw_store_fail(s, FU_ERR_IO, sql);
}

/* The database's PRAGMA user_version into *v. FU_OK or FU_ERR_IO. */
static int gw_store_version(gw_store *s, int *v) {
    sqlite3_stmt *st = NULL;
    int rc = sqlite3_prepare_v2(s->db, "PRAGMA user_version", -1, &st, NULL);
    if (rc == SQLITE_OK && sqlite3_step(st) == SQLITE_ROW) *v = sqlite3_column_int(st, 0);
    else rc = SQLITE_ERROR;
    sqlite3_finalize(st);
    return rc == SQLITE_OK ? FU_OK : gw_store_fail(s, FU_ERR_IO, "user_version");
}

/* Applies migration v (to version v + 1) in one transaction. */
static int gw_store_migrate(gw_store *s, int v) {
    char bump[64];
    snprintf(bump, sizeof bump, "PRAGMA user_version = %d", v + 1);
    int rc = gw_store_exec(s, "BEGIN IMMEDIATE");
    if (!rc && !(rc = gw_store_exec(s, migrations[v])) && !(rc = gw_store_exec(s, bump)))
        return gw_store_exec(s, "COMMIT");
    if (sqlite3_get_autocommit(s->db) == 0) sqlite3_exec(s->db, "ROLLBACK", NULL, NULL, NULL);
    return rc;
}

/* WAL, foreign keys, a busy timeout, then every migration the file lacks. */
static int gw_store_setup(gw_store *s) {
    int v = 0, rc = gw_store_exec(s, "PRAGMA journal_mode = WAL");
    if (!rc) rc = gw_store_exec(s, "PRAGMA synchronous = FULL");
    if (!rc) rc = gw_store_exec(s, "PRAGMA foreign_keys = ON");
    if (!rc) rc = gw_store_version(s, &v);
    if (!rc && v > GW_STORE_VERSION)
        return fu_errorf(FU_ERR_UNSUPPORTED, "database: schema version %d is newer than this gateway's (%d)", v,
                         GW_STORE_VERSION);
    for (; !rc && v < GW_STORE_VERSION; v++) rc = gw_store_migrate(s, v);
    return rc;
}

int gw_store_open(const char *path, gw_store **out) {
    *out = NULL;
    gw_store *s = calloc(1, sizeof *s);
    if (!s) return fu_errorf(FU_ERR_NOMEM, "store");
    pthread_mutex_init(&s->mu, NULL);
    int fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0600); /* created private */
    if (fd >= 0) close(fd);
    int rc = sqlite3_open_v2(path, &s->db, SQLITE_OPEN_READWRITE | SQLITE_OPEN_NOMUTEX, NULL);
    rc = rc == SQLITE_OK ? FU_OK : fu_errorf(FU_ERR_IO, "database %s: %s", path, s->db ? sqlite3_errmsg(s->db) : "?");
    if (!rc) sqlite3_busy_timeout(s->db, 5000);
    if (!rc) rc = gw_store_setup(s);
    if (rc) {
        gw_store_close(s);
        return rc;
    }
    *out = s;
    return FU_OK;
}

void gw_store_close(gw_store *s) {
    if (!s) return;
    sqlite3_close(s->db);
    pthread_mutex_destroy(&s->mu);
    free(s);
}

/* ---- files ------------------------------------------------------------------------------------ */

#define GW_FILE_COLUMNS "id, owner, filename, purpose, bytes, created_at, status, n_examples, error"

/* Copies text column i of st into dst[cap] (truncated, NUL-terminated). */
static void gw_column_text(sqlite3_stmt *st, int i, char *dst, size_t cap) {
    const unsigned char *t = sqlite3_column_text(st, i);
    snprintf(dst, cap, "%s", t ? (const char *)t : "");
}

/* The row st is on (GW_FILE_COLUMNS) into *f. */
static void gw_file_row(sqlite3_stmt *st, gw_file *f) {
    memset(f, 0, sizeof *f);
    gw_column_text(st, 0, f->id, sizeof f->id);
    gw_column_text(st, 1, f->owner, sizeof f->owner);
    gw_column_text(st, 2, f->filename, sizeof f->filename);
    gw_column_text(st, 3, f->purpose, sizeof f->purpose);
    f->bytes = sqlite3_column_int64(st, 4);
    f->created_at = sqlite3_column_int64(st, 5);
    gw_column_text(st, 6, f->status, sizeof f->status);
    f->n_examples = sqlite3_column_int64(st, 7);
    gw_column_text(st, 8, f->error, sizeof f->error);
}

static void gw_file_row_any(sqlite3_stmt *st, void *out) { gw_file_row(st, out); }

static const gw_table gw_files_table = {"files", "owner", GW_FILE_COLUMNS, sizeof(gw_file), gw_file_row_any};

/* Binds f's fields to the INSERT's parameters 1..9. */
static int gw_file_bind(sqlite3_stmt *st, const gw_file *f) {
    int rc = sqlite3_bind_text(st, 1, f->id, -1, SQLITE_STATIC);
    if (!rc) rc = sqlite3_bind_text(st, 2, f->owner, -1, SQLITE_STATIC);
    if (!rc) rc = sqlite3_bind_text(st, 3, f->filename, -1, SQLITE_STATIC);
    if (!rc) rc = sqlite3_bind_text(st, 4, f->purpose, -1, SQLITE_STATIC);
    if (!rc) rc = sqlite3_bind_int64(st, 5, f->bytes);
    if (!rc) rc = sqlite3_bind_int64(st, 6, f->created_at);
    if (!rc) rc = sqlite3_bind_text(st, 7, f->status, -1, SQLITE_STATIC);
    if (!rc) rc = sqlite3_bind_int64(st, 8, f->n_examples);
    if (!rc) rc = sqlite3_bind_text(st, 9, f->error, -1, SQLITE_STATIC);
    return rc;
}

/* Runs one prepared write statement in a transaction (under s->mu); *changes gets the rows
 * it changed. A constraint is FU_ERR_INVALID; nothing is kept on failure. */
static int gw_store_write(gw_store *s, sqlite3_stmt *st, int *changes) {
    int rc = gw_store_exec(s, "BEGIN IMMEDIATE");
    if (rc) return rc;
    int step = sqlite3_step(st);
    if (step != SQLITE_DONE) {
        rc = gw_store_fail(s, (step & 0xff) == SQLITE_CONSTRAINT ? FU_ERR_INVALID : FU_ERR_IO, "write");
        sqlite3_exec(s->db, "ROLLBACK", NULL, NULL, NULL);
        return rc;
    }
    *changes = sqlite3_changes(s->db);
    rc = gw_store_exec(s, "COMMIT");
    if (rc) sqlite3_exec(s->db, "ROLLBACK", NULL, NULL, NULL);
    return rc;
}

int gw_store_file_insert(gw_store *s, const gw_file *f) {
    pthread_mutex_lock(&s->mu);
    sqlite3_stmt *st = NULL;
    int changes = 0, rc = sqlite3_prepare_v2(s->db, "INSERT INTO files (" GW_FILE_COLUMNS ") VALUES (?,?,?,?,?,?,?,?,?)",
                                             -1, &st, NULL);
    rc = rc || gw_file_bind(st, f) ? gw_store_fail(s, FU_ERR_IO, "insert") : gw_store_write(s, st, &changes);
    sqlite3_finalize(st);
    pthread_mutex_unlock(&s->mu);
    return rc;
}

/* Binds id (1) and owner (2, NULL: anyone) to a statement whose WHERE reads
 * "id = ?1 AND (?2 IS NULL OR owner = ?2)". */
static int gw_bind_id_owner(sqlite3_stmt *st, const char *id, const char *owner) {
    int rc = sqlite3_bind_text(st, 1, id, -1, SQLITE_STATIC);
    return rc ? rc : owner ? sqlite3_bind_text(st, 2, owner, -1, SQLITE_STATIC) : sqlite3_bind_null(st, 2);
}

/* ---- tables: what files, jobs, events and checkpoints share ------------------------------------- */


/* Binds text values v[0..n) to parameters 1..n (NULL: SQL NULL). */
static int gw_bind_texts(sqlite3_stmt *st, const char *const *v, int n) {
    int rc = SQLITE_OK;
    for (int i = 0; i < n && rc == SQLITE_OK; i++)
        rc = v[i] ? sqlite3_bind_text(st, i + 1, v[i], -1, SQLITE_STATIC) : sqlite3_bind_null(st, i + 1);
    return rc;
}

/* Prepares sql, lets bind() bind it, runs it as one write transaction (under s->mu). */
static int gw_store_run(gw_store *s, const char *sql, int (*bind)(sqlite3_stmt *, const void *), const void *arg,
                        int *changes) {
    pthread_mutex_lock(&s->mu);
    sqlite3_stmt *st = NULL;
    int rc = sqlite3_prepare_v2(s->db, sql, -1, &st, NULL);
    rc = rc || bind(st, arg) ? gw_store_fail(s, FU_ERR_IO, "write") : gw_store_write(s, st, changes);
    sqlite3_finalize(st);
    pthread_mutex_unlock(&s->mu);
    return rc;
}

/* The one record of table t with id (and key, NULL: any) into out. FU_OK, FU_ERR_NOT_FOUND, FU_ERR_IO. */
static int gw_store_get(gw_store *s, const gw_table *t, const char *id, const char *key, void *out) {
    char sql[512];
    snprintf(sql, sizeof sql, "SELECT %s FROM %s WHERE id = ?1 AND (?2 IS NULL OR %s = ?2)", t->columns, t->name,
             t->key);
    pthread_mutex_lock(&s->mu);
    sqlite3_stmt *st = NULL;
    int rc = sqlite3_prepare_v2(s->db, sql, -1, &st, NULL);
    if (rc || gw_bind_id_owner(st, id, key)) rc = gw_store_fail(s, FU_ERR_IO, "get");
    else if ((rc = sqlite3_step(st)) == SQLITE_ROW) {
        t->row(st, out);
        rc = FU_OK;
    } else {
        rc = rc == SQLITE_DONE ? fu_errorf(FU_ERR_NOT_FOUND, "no such record: %.64s", id) : gw_store_fail(s, FU_ERR_IO, "get");
    }
    sqlite3_finalize(st);
    pthread_mutex_unlock(&s->mu);
    return rc;
}

/* The seq of record q->after of table t (with q->key) into *seq (under s->mu). */
static int gw_store_page_after(gw_store *s, const gw_table *t, const gw_page_query *q, sqlite3_int64 *seq) {
    char sql[256];
    snprintf(sql, sizeof sql, "SELECT seq FROM %s WHERE id = ?1 AND (?2 IS NULL OR %s = ?2)", t->name, t->key);
    sqlite3_stmt *st = NULL;
    int rc = sqlite3_prepare_v2(s->db, sql, -1, &st, NULL);
    if (rc || gw_bind_id_owner(st, q->after, q->key)) rc = gw_store_fail(s, FU_ERR_IO, "list");
    else if ((rc = sqlite3_step(st)) == SQLITE_ROW) {
        *seq = sqlite3_column_int64(st, 0);
        rc = FU_OK;
    } else {
        rc = rc == SQLITE_DONE ? fu_errorf(FU_ERR_NOT_FOUND, "no such record: %.64s", q->after)
                               : gw_store_fail(s, FU_ERR_IO, "list");
    }
    sqlite3_finalize(st);
    return rc;
}

/* Steps st's rows of table t into *out (at most limit; one more sets *has_more). */
static int gw_store_page_collect(const gw_table *t, sqlite3_stmt *st, int limit, void **out, size_t *n,
                                 bool *has_more) {
    int step;
    while ((step = sqlite3_step(st)) == SQLITE_ROW) {
        if (*n == (size_t)limit) {
            *has_more = true;
            return FU_OK;
        }
        char *grown = realloc(*out, (*n + 1) * t->size);
        if (!grown) return fu_errorf(FU_ERR_NOMEM, "list");
        *out = grown;
        t->row(st, grown + (*n)++ * t->size);
    }
    return step == SQLITE_DONE ? FU_OK : fu_errorf(FU_ERR_IO, "database: list: step %d", step);
}


int gw_store_file_get(gw_store *s, const char *id, const char *owner, gw_file *out) {
    return gw_store_get(s, &gw_files_table, id, owner, out);
}

int gw_store_file_delete(gw_store *s, const char *id, const char *owner) {
    pthread_mutex_lock(&s->mu);
    sqlite3_stmt *st = NULL;
    int changes = 0, rc = sqlite3_prepare_v2(s->db, "DELETE FROM files WHERE id = ?1 AND (?2 IS NULL OR owner = ?2)",
                                             -1, &st, NULL);
    rc = rc || gw_bind_id_owner(st, id, owner) ? gw_store_fail(s, FU_ERR_IO, "delete") : gw_store_write(s, st, &changes);
    if (!rc && !changes) rc = fu_errorf(FU_ERR_NOT_FOUND, "no such file: %.64s", id);
    sqlite3_finalize(st);
    pthread_mutex_unlock(&s->mu);
    return rc;
}

/* The listing's statement: owner ?1, purpose ?2, the `after` file's seq ?3 (NULL: none), limit ?4. */
static const char *gw_list_sql(bool asc) {
    return asc ? "SELECT " GW_FILE_COLUMNS " FROM files WHERE (?1 IS NULL OR owner = ?1) AND (?2 IS NULL OR "
                 "purpose = ?2) AND (?3 IS NULL OR seq > ?3) ORDER BY seq ASC LIMIT ?4"
               : "SELECT " GW_FILE_COLUMNS " FROM files WHERE (?1 IS NULL OR owner = ?1) AND (?2 IS NULL OR "
                 "purpose = ?2) AND (?3 IS NULL OR seq < ?3) ORDER BY seq DESC LIMIT ?4";
}

/* gw_store_file_list under s->mu. */
static int gw_store_list_locked(gw_store *s, const gw_file_query *q, gw_file **out, size_t *n, bool *has_more) {
    sqlite3_int64 after = 0;
    gw_page_query pq = {q->owner, q->after, q->limit};
    int rc = q->after ? gw_store_page_after(s, &gw_files_table, &pq, &after) : FU_OK;
    if (rc) return rc;
    sqlite3_stmt *st = NULL;
    rc = sqlite3_prepare_v2(s->db, gw_list_sql(q->asc), -1, &st, NULL);
    if (!rc) rc = q->owner ? sqlite3_bind_text(st, 1, q->owner, -1, SQLITE_STATIC) : sqlite3_bind_null(st, 1);
    if (!rc) rc = q->purpose ? sqlite3_bind_text(st, 2, q->purpose, -1, SQLITE_STATIC) : sqlite3_bind_null(st, 2);
    if (!rc) rc = q->after ? sqlite3_bind_int64(st, 3, after) : sqlite3_bind_null(st, 3);
    if (!rc) rc = sqlite3_bind_int64(st, 4, (sqlite3_int64)q->limit + 1);
    rc = rc ? gw_store_fail(s, FU_ERR_IO, "list")
            : gw_store_page_collect(&gw_files_table, st, q->limit, (void **)out, n, has_more);
    sqlite3_finalize(st);
    return rc;
}

int gw_store_file_list(gw_store *s, const gw_file_query *q, gw_file **out, size_t *n, bool *has_more) {
    *out = NULL;
    *n = 0;
    *has_more = false;
    pthread_mutex_lock(&s->mu);
    int rc = gw_store_list_locked(s, q, out, n, has_more);
    pthread_mutex_unlock(&s->mu);
    if (rc) {
        free(*out);
        *out = NULL;
        *n = 0;
    }
    return rc;
}

/* ---- fine-tuning jobs, events, checkpoints ------------------------------------------------------ */

#define GW_JOB_COLUMNS                                                                                        \
    "id, owner, model, training_file, validation_file, suffix, seed, hyperparameters, lora, status, "         \
    "fine_tuned_model, error, created_at, finished_at, trained_tokens, result_files, metadata, estimated_finish"
#define GW_EVENT_COLUMNS "id, job_id, created_at, level, type, message, data"
#define GW_CKPT_COLUMNS "id, job_id, step_number, metrics, fine_tuned_model_checkpoint, created_at"
#define GW_JOB_LIVE "('validating_files', 'queued', 'running')"

static void gw_job_row(sqlite3_stmt *st, void *out) {
    gw_ftjob *j = out;
    memset(j, 0, sizeof *j);
    gw_column_text(st, 0, j->id, sizeof j->id);
    gw_column_text(st, 1, j->owner, sizeof j->owner);
    gw_column_text(st, 2, j->model, sizeof j->model);
    gw_column_text(st, 3, j->training_file, sizeof j->training_file);
    gw_column_text(st, 4, j->validation_file, sizeof j->validation_file);
    gw_column_text(st, 5, j->suffix, sizeof j->suffix);
    j->seed = sqlite3_column_int64(st, 6);
    gw_column_text(st, 7, j->hyperparameters, sizeof j->hyperparameters);
    gw_column_text(st, 8, j->lora, sizeof j->lora);
    gw_column_text(st, 9, j->status, sizeof j->status);
    gw_column_text(st, 10, j->fine_tuned_model, sizeof j->fine_tuned_model);
    gw_column_text(st, 11, j->error, sizeof j->error);
    j->created_at = sqlite3_column_int64(st, 12);
    j->finished_at = sqlite3_column_int64(st, 13);
    j->trained_tokens = sqlite3_column_int64(st, 14);
    gw_column_text(st, 15, j->result_files, sizeof j->result_files);
    gw_column_text(st, 16, j->metadata, sizeof j->metadata);
    j->estimated_finish = sqlite3_column_int64(st, 17);
}

static void gw_event_row(sqlite3_stmt *st, void *out) {
    gw_ftevent *e = out;
    memset(e, 0, sizeof *e);
    gw_column_text(st, 0, e->id, sizeof e->id);
    gw_column_text(st, 1, e->job_id, sizeof e->job_id);
    e->created_at = sqlite3_column_int64(st, 2);
    gw_column_text(st, 3, e->level, sizeof e->level);
    gw_column_text(st, 4, e->type, sizeof e->type);
    gw_column_text(st, 5, e->message, sizeof e->message);
    gw_column_text(st, 6, e->data, sizeof e->data);
}

static void gw_ckpt_row(sqlite3_stmt *st, void *out) {
    gw_ftckpt *c = out;
    memset(c, 0, sizeof *c);
    gw_column_text(st, 0, c->id, sizeof c->id);
    gw_column_text(st, 1, c->job_id, sizeof c->job_id);
    c->step_number = sqlite3_column_int64(st, 2);
    gw_column_text(st, 3, c->metrics, sizeof c->metrics);
    gw_column_text(st, 4, c->model, sizeof c->model);
    c->created_at = sqlite3_column_int64(st, 5);
}

static const gw_table gw_jobs_table = {"jobs", "owner", GW_JOB_COLUMNS, sizeof(gw_ftjob), gw_job_row};
static const gw_table gw_events_table = {"job_events", "job_id", GW_EVENT_COLUMNS, sizeof(gw_ftevent), gw_event_row};
static const gw_table gw_ckpts_table = {"job_checkpoints", "job_id", GW_CKPT_COLUMNS, sizeof(gw_ftckpt), gw_ckpt_row};

static int gw_job_bind(sqlite3_stmt *st, const void *arg) {
    const gw_ftjob *j = arg;
    const char *t[] = {j->id, j->owner, j->model, j->training_file, j->validation_file, j->suffix};
    int rc = gw_bind_texts(st, t, 6);
    if (!rc) rc = sqlite3_bind_int64(st, 7, j->seed);
    const char *u[] = {j->hyperparameters, j->lora, j->status, j->fine_tuned_model, j->error};
    for (int i = 0; i < 5 && !rc; i++) rc = sqlite3_bind_text(st, 8 + i, u[i], -1, SQLITE_STATIC);
    if (!rc) rc = sqlite3_bind_int64(st, 13, j->created_at);
    if (!rc) rc = sqlite3_bind_int64(st, 14, j->finished_at);
    if (!rc) rc = sqlite3_bind_int64(st, 15, j->trained_tokens);
    if (!rc) rc = sqlite3_bind_text(st, 16, j->result_files, -1, SQLITE_STATIC);
    if (!rc) rc = sqlite3_bind_text(st, 17, j->metadata, -1, SQLITE_STATIC);
    if (!rc) rc = sqlite3_bind_int64(st, 18, j->estimated_finish);
    return rc;
}

int gw_store_job_insert(gw_store *s, const gw_ftjob *j) {
    int changes = 0;
    return gw_store_run(s, "INSERT INTO jobs (" GW_JOB_COLUMNS ") VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
                        gw_job_bind, j, &changes);
}

int gw_store_job_get(gw_store *s, const char *id, const char *owner, gw_ftjob *out) {
    return gw_store_get(s, &gw_jobs_table, id, owner, out);
}

static int gw_job_update_bind(sqlite3_stmt *st, const void *arg) {
    const gw_ftjob *j = arg;
    const char *t[] = {j->id, j->status, j->fine_tuned_model, j->error, j->result_files};
    int rc = gw_bind_texts(st, t, 5);
    if (!rc) rc = sqlite3_bind_int64(st, 6, j->finished_at);
    if (!rc) rc = sqlite3_bind_int64(st, 7, j->trained_tokens);
    if (!rc) rc = sqlite3_bind_int64(st, 8, j->estimated_finish);
    return rc;
}

int gw_store_job_update(gw_store *s, const gw_ftjob *j) {
    int changes = 0;
    int rc = gw_store_run(s, "UPDATE jobs SET status = ?2, fine_tuned_model = ?3, error = ?4, result_files = ?5, "
                             "finished_at = ?6, trained_tokens = ?7, estimated_finish = ?8 WHERE id = ?1 AND status IN " GW_JOB_LIVE,
                          gw_job_update_bind, j, &changes);
    return !rc && !changes ? fu_errorf(FU_ERR_NOT_FOUND, "job %s has ended", j->id) : rc;
}

typedef struct gw_cancel_arg {
    const char *id, *owner;
} gw_cancel_arg;

static int gw_cancel_bind(sqlite3_stmt *st, const void *arg) {
    const gw_cancel_arg *a = arg;
    int rc = gw_bind_id_owner(st, a->id, a->owner);
    return rc ? rc : sqlite3_bind_int64(st, 3, (sqlite3_int64)time(NULL));
}

int gw_store_job_cancel(gw_store *s, const char *id, const char *owner, gw_ftjob *out) {
    gw_cancel_arg a = {id, owner};
    int changes = 0;
    int rc = gw_store_run(s, "UPDATE jobs SET status = 'cancelled', finished_at = ?3 WHERE id = ?1 AND (?2 IS NULL "
                             "OR owner = ?2) AND status IN " GW_JOB_LIVE,
                          gw_cancel_bind, &a, &changes);
    return rc ? rc : gw_store_job_get(s, id, owner, out);
}

/* The ids skip[0..n) as a JSON array's text (malloc'd; NULL when out of memory). */
static char *gw_ids_json(const char *const *skip, int n) {
    json_t *a = json_array();
    for (int i = 0; i < n && a; i++) json_array_append_new(a, json_string(skip[i]));
    char *text = a ? json_dumps(a, JSON_COMPACT) : NULL;
    json_decref(a);
    return text;
}

int gw_store_job_next(gw_store *s, const char *const *skip, int n_skip, gw_ftjob *out) {
    char *ids = gw_ids_json(skip, n_skip);
    if (!ids) return fu_errorf(FU_ERR_NOMEM, "next job");
    pthread_mutex_lock(&s->mu);
    sqlite3_stmt *st = NULL;
    int rc = sqlite3_prepare_v2(s->db, "SELECT " GW_JOB_COLUMNS " FROM jobs WHERE status IN " GW_JOB_LIVE
                                       " AND id NOT IN (SELECT value FROM json_each(?1)) ORDER BY seq ASC LIMIT 1",
                                -1, &st, NULL);
    if (rc || sqlite3_bind_text(st, 1, ids, -1, SQLITE_STATIC)) rc = gw_store_fail(s, FU_ERR_IO, "next job");
    else if ((rc = sqlite3_step(st)) == SQLITE_ROW) {
        gw_job_row(st, out);
        rc = FU_OK;
    } else {
        rc = rc == SQLITE_DONE ? FU_ERR_NOT_FOUND : gw_store_fail(s, FU_ERR_IO, "next job");
    }
    sqlite3_finalize(st);
    pthread_mutex_unlock(&s->mu);
    free(ids);
    return rc;
}

/* A page of table t, newest first (under s->mu). */
static int gw_store_page_locked(gw_store *s, const gw_table *t, const gw_page_query *q, void **out, size_t *n,
                                bool *has_more) {
    sqlite3_int64 after = 0;
    int rc = q->after ? gw_store_page_after(s, t, q, &after) : FU_OK;
    if (rc) return rc;
    char sql[512];
    snprintf(sql, sizeof sql, "SELECT %s FROM %s WHERE (?1 IS NULL OR %s = ?1) AND (?2 IS NULL OR seq < ?2) "
                              "ORDER BY seq DESC LIMIT ?3", t->columns, t->name, t->key);
    sqlite3_stmt *st = NULL;
    rc = sqlite3_prepare_v2(s->db, sql, -1, &st, NULL);
    if (!rc) rc = q->key ? sqlite3_bind_text(st, 1, q->key, -1, SQLITE_STATIC) : sqlite3_bind_null(st, 1);
    if (!rc) rc = q->after ? sqlite3_bind_int64(st, 2, after) : sqlite3_bind_null(st, 2);
    if (!rc) rc = sqlite3_bind_int64(st, 3, (sqlite3_int64)q->limit + 1);
    rc = rc ? gw_store_fail(s, FU_ERR_IO, "list") : gw_store_page_collect(t, st, q->limit, out, n, has_more);
    sqlite3_finalize(st);
    return rc;
}

/* A page of table t: *out malloc'd (NULL and *n 0 on failure). */
static int gw_store_page(gw_store *s, const gw_table *t, const gw_page_query *q, void **out, size_t *n,
                         bool *has_more) {
    *out = NULL;
    *n = 0;
    *has_more = false;
    pthread_mutex_lock(&s->mu);
    int rc = gw_store_page_locked(s, t, q, out, n, has_more);
    pthread_mutex_unlock(&s->mu);
    if (rc) {
        free(*out);
        *out = NULL;
        *n = 0;
    }
    return rc;
}

int gw_store_job_list(gw_store *s, const gw_page_query *q, gw_ftjob **out, size_t *n, bool *has_more) {
    return gw_store_page(s, &gw_jobs_table, q, (void **)out, n, has_more);
}

static int gw_event_bind(sqlite3_stmt *st, const void *arg) {
    const gw_ftevent *e = arg;
    const char *t[] = {e->id, e->job_id};
    int rc = gw_bind_texts(st, t, 2);
    if (!rc) rc = sqlite3_bind_int64(st, 3, e->created_at);
    const char *u[] = {e->level, e->type, e->message, e->data};
    for (int i = 0; i < 4 && !rc; i++) rc = sqlite3_bind_text(st, 4 + i, u[i], -1, SQLITE_STATIC);
    return rc;
}

int gw_store_event_insert(gw_store *s, const gw_ftevent *e) {
    int changes = 0;
    return gw_store_run(s, "INSERT INTO job_events (" GW_EVENT_COLUMNS ") VALUES (?,?,?,?,?,?,?)", gw_event_bind, e,
                        &changes);
}

int gw_store_event_last_step(gw_store *s, const char *job_id, int64_t *out) {
    *out = 0;
    pthread_mutex_lock(&s->mu);
    sqlite3_stmt *st = NULL;
    int rc = sqlite3_prepare_v2(s->db, "SELECT COALESCE(MAX(json_extract(data, '$.step')), 0) FROM job_events "
                                       "WHERE job_id = ?1 AND type = 'metrics' AND json_valid(data)", -1, &st, NULL);
    if (!rc) rc = sqlite3_bind_text(st, 1, job_id, -1, SQLITE_STATIC);
    if (!rc && sqlite3_step(st) == SQLITE_ROW) *out = sqlite3_column_int64(st, 0);
    else rc = gw_store_fail(s, FU_ERR_IO, "last step");
    sqlite3_finalize(st);
    pthread_mutex_unlock(&s->mu);
    return rc;
}

int gw_store_event_list(gw_store *s, const gw_page_query *q, gw_ftevent **out, size_t *n, bool *has_more) {
    return gw_store_page(s, &gw_events_table, q, (void **)out, n, has_more);
}

static int gw_ckpt_bind(sqlite3_stmt *st, const void *arg) {
    const gw_ftckpt *c = arg;
    const char *t[] = {c->id, c->job_id};
    int rc = gw_bind_texts(st, t, 2);
    if (!rc) rc = sqlite3_bind_int64(st, 3, c->step_number);
    if (!rc) rc = sqlite3_bind_text(st, 4, c->metrics, -1, SQLITE_STATIC);
    if (!rc) rc = sqlite3_bind_text(st, 5, c->model, -1, SQLITE_STATIC);
    if (!rc) rc = sqlite3_bind_int64(st, 6, c->created_at);
    return rc;
}

int gw_store_ckpt_insert(gw_store *s, const gw_ftckpt *c) {
    int changes = 0;
    return gw_store_run(s, "INSERT INTO job_checkpoints (" GW_CKPT_COLUMNS ") VALUES (?,?,?,?,?,?)", gw_ckpt_bind, c,
                        &changes);
}

int gw_store_ckpt_list(gw_store *s, const gw_page_query *q, gw_ftckpt **out, size_t *n, bool *has_more) {
    return gw_store_page(s, &gw_ckpts_table, q, (void **)out, n, has_more);
}
