/* gw-store.h -- the gateway's durable metadata in SQLite: uploaded files (later: fine-tuning jobs, events, checkpoints).
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

#endif
