/* gw-store.c -- the gateway's SQLite metadata: schema migrations, files CRUD, paging. */
#include "gw-store.h"

#include <fcntl.h>
#include <pthread.h>
#include <sqlite3.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "status.h"

struct gw_store {
    sqlite3 *db;
    pthread_mutex_t mu; /* the connection and its statements */
};

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

int gw_store_file_get(gw_store *s, const char *id, const char *owner, gw_file *out) {
    pthread_mutex_lock(&s->mu);
    sqlite3_stmt *st = NULL;
    int rc = sqlite3_prepare_v2(s->db, "SELECT " GW_FILE_COLUMNS " FROM files WHERE id = ?1 AND (?2 IS NULL OR owner = ?2)",
                                -1, &st, NULL);
    if (rc || gw_bind_id_owner(st, id, owner)) rc = gw_store_fail(s, FU_ERR_IO, "get");
    else if ((rc = sqlite3_step(st)) == SQLITE_ROW) {
        gw_file_row(st, out);
        rc = FU_OK;
    } else {
        rc = rc == SQLITE_DONE ? fu_errorf(FU_ERR_NOT_FOUND, "no such file: %.64s", id) : gw_store_fail(s, FU_ERR_IO, "get");
    }
    sqlite3_finalize(st);
    pthread_mutex_unlock(&s->mu);
    return rc;
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

/* The seq of file `after` that q's owner sees into *seq (under s->mu). */
static int gw_store_after_seq(gw_store *s, const gw_file_query *q, sqlite3_int64 *seq) {
    sqlite3_stmt *st = NULL;
    int rc = sqlite3_prepare_v2(s->db, "SELECT seq FROM files WHERE id = ?1 AND (?2 IS NULL OR owner = ?2)", -1, &st,
                                NULL);
    if (rc || gw_bind_id_owner(st, q->after, q->owner)) rc = gw_store_fail(s, FU_ERR_IO, "list");
    else if ((rc = sqlite3_step(st)) == SQLITE_ROW) {
        *seq = sqlite3_column_int64(st, 0);
        rc = FU_OK;
    } else {
        rc = rc == SQLITE_DONE ? fu_errorf(FU_ERR_NOT_FOUND, "no such file: %.64s", q->after)
                               : gw_store_fail(s, FU_ERR_IO, "list");
    }
    sqlite3_finalize(st);
    return rc;
}

/* Steps st's rows into *out (at most limit; one more sets *has_more). */
static int gw_store_collect(sqlite3_stmt *st, int limit, gw_file **out, size_t *n, bool *has_more) {
    int step;
    while ((step = sqlite3_step(st)) == SQLITE_ROW) {
        if (*n == (size_t)limit) {
            *has_more = true;
            return FU_OK;
        }
        gw_file *grown = realloc(*out, (*n + 1) * sizeof **out);
        if (!grown) return fu_errorf(FU_ERR_NOMEM, "file list");
        *out = grown;
        gw_file_row(st, &(*out)[(*n)++]);
    }
    return step == SQLITE_DONE ? FU_OK : fu_errorf(FU_ERR_IO, "database: list: step %d", step);
}

/* gw_store_file_list under s->mu. */
static int gw_store_list_locked(gw_store *s, const gw_file_query *q, gw_file **out, size_t *n, bool *has_more) {
    sqlite3_int64 after = 0;
    int rc = q->after ? gw_store_after_seq(s, q, &after) : FU_OK;
    if (rc) return rc;
    sqlite3_stmt *st = NULL;
    rc = sqlite3_prepare_v2(s->db, gw_list_sql(q->asc), -1, &st, NULL);
    if (!rc) rc = q->owner ? sqlite3_bind_text(st, 1, q->owner, -1, SQLITE_STATIC) : sqlite3_bind_null(st, 1);
    if (!rc) rc = q->purpose ? sqlite3_bind_text(st, 2, q->purpose, -1, SQLITE_STATIC) : sqlite3_bind_null(st, 2);
    if (!rc) rc = q->after ? sqlite3_bind_int64(st, 3, after) : sqlite3_bind_null(st, 3);
    if (!rc) rc = sqlite3_bind_int64(st, 4, (sqlite3_int64)q->limit + 1);
    rc = rc ? gw_store_fail(s, FU_ERR_IO, "list") : gw_store_collect(st, q->limit, out, n, has_more);
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
