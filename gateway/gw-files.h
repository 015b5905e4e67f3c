/* gw-files.h -- OpenAI's /v1/files for fine-tuning: the data directory, streamed uploads, their checks, the file routes.
 *
 * Files live in DATA_DIR/files/<id>.jsonl and their metadata in DATA_DIR/fusion.db
 * (gw-store.h). An upload streams, as libmicrohttpd hands the body over, through a
 * multipart parser into a temporary file of that directory (".upload-PID-XXXXXX"); once the
 * body is in, it is checked (gw-file-check.h), fsync'd, renamed to its final name and only
 * then recorded. An upload that fails at any point leaves nothing: its temporary file is
 * removed, and start-up removes those a killed gateway left.
 *
 * Owners: each API key owns what it uploads, named by the SHA-256 of the key; admin keys see
 * every owner's files (owner NULL below); a gateway without keys has one anonymous owner.
 *
 * Threading: a gw_files is shared by every thread (the store locks itself; the rest is read
 * only). An upload belongs to one connection: fed on libmicrohttpd's thread, finished on a
 * body thread, never both at once. Ownership: gw_files borrows the config's and the
 * model's objects; an upload owns its temporary file until it is finished or freed.
 */
#ifndef FU_GW_FILES_H
#define FU_GW_FILES_H

#include <jansson.h>
#include <limits.h>
#include <microhttpd.h>
#include <stdint.h>

#include "gw-gen.h"
#include "gw-store.h"
#include "gw.h"

typedef struct gw_files gw_files;
typedef struct gw_upload gw_upload;

/* The owner named by an API key: the SHA-256 of key[0..len) in hex; key NULL: "anonymous". */
void gw_files_owner(const char *key, size_t len, char out[GW_OWNER_MAX]);

/* Opens the data directory (cfg->data_dir, else the default; created 0700), removes the
 * temporary files of gateways no longer running and opens the database. cfg and m are
 * borrowed. FU_OK, or an error with fu_last_error() naming the path. */
int gw_files_open(const gw_config *cfg, const gw_model *m, gw_files **out);
void gw_files_close(gw_files *f); /* NULL is a no-op */

/* The database (shared with the fine-tuning jobs, gw-jobs.h); borrowed. */
gw_store *gw_files_store(gw_files *f);
/* DATA_DIR (borrowed). */
const char *gw_files_data_dir(const gw_files *f);
/* Where file `id`'s bytes are, into path. FU_OK, or FU_ERR_INVALID for a malformed id. */
int gw_files_path(const gw_files *f, const char *id, char path[PATH_MAX]);
/* Stores data[0..len) as a new file of owner (written atomically, then recorded; nothing kept on
 * failure) and fills *out with its record. FU_OK, FU_ERR_IO, FU_ERR_INVALID. */
int gw_files_add(gw_files *f, const char *owner, const char *filename, const char *purpose, const void *data,
                 size_t len, gw_file *out);

/* ---- uploads (POST /v1/files, multipart/form-data: file, purpose) ---- */

/* Starts an upload of connection mc's body (its Content-Type gives the multipart boundary).
 * 0 with *out, or the HTTP status with *err (400: not multipart, no boundary). */
int gw_upload_new(gw_files *f, struct MHD_Connection *mc, gw_upload **out, gw_error *err);
/* Feeds the next data[0..n) of the body (libmicrohttpd's thread). The first problem (too
 * large: 413; malformed: 400; the disk: 500) is kept, the temporary file removed, and the
 * rest of the body is only counted. */
void gw_upload_feed(gw_upload *u, const char *data, size_t n);
/* Once the whole body is in (a body thread): checks the file, stores it as owner's and makes
 * *out its file object (new reference). 0, or the HTTP status with *err (nothing kept). */
int gw_upload_finish(gw_upload *u, const char *owner, json_t **out, gw_error *err);
/* Frees an upload, removing its temporary file if it has one. NULL is a no-op. */
void gw_upload_free(gw_upload *u);

/* ---- the other routes; owner NULL: an admin, who sees everyone's ---- */

/* The query of GET /v1/files as given (each NULL when absent). */
typedef struct gw_files_args {
    const char *purpose, *limit, *order, *after;
} gw_files_args;

/* GET /v1/files: {object: "list", data, first_id, last_id, has_more}. 0 or the HTTP status with *err. */
int gw_files_list(gw_files *f, const char *owner, const gw_files_args *a, json_t **out, gw_error *err);
/* GET /v1/files/{id}: the file object. 0, or 404 with *err. */
int gw_files_get(gw_files *f, const char *owner, const char *id, json_t **out, gw_error *err);
/* DELETE /v1/files/{id}: {id, object: "file", deleted: true}; the file is removed. */
int gw_files_delete(gw_files *f, const char *owner, const char *id, json_t **out, gw_error *err);
/* GET /v1/files/{id}/content: an open descriptor of its bytes (*fd, which the caller closes),
 * their count and their media type (*type, static: by the name's extension for results -- .csv,
 * .svg, .json, .safetensors -- else application/jsonl). 0, or the HTTP status with *err. */
int gw_files_content(gw_files *f, const char *owner, const char *id, int *fd, uint64_t *size, const char **type,
                     gw_error *err);

#endif
