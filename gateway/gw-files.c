/* gw-files.c -- /v1/files: the data directory, multipart uploads streamed to disk, checks, listing and content. */
#include "gw-files.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <openssl/evp.h>
#include <openssl/rand.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "atomic-file.h"
#include "gw-file-check.h"
#include "log.h"
#include "mapped-file.h"
#include "parse.h"
#include "status.h"

/* Bytes of a multipart body beyond its file: the framing and the other fields. */
#define GW_UPLOAD_SLACK (64 * 1024)
/* The prefix of temporary upload files in DIR/files. */
#define GW_UPLOAD_PREFIX ".upload-"
/* An orphan file (renamed, never recorded) older than this is removed at start-up. */
#define GW_ORPHAN_AGE_S 60

struct gw_files {
    char data[PATH_MAX - 256]; /* DATA_DIR */
    char dir[PATH_MAX - 128]; /* DATA_DIR/files (room left for a file name) */
    gw_store *store;
    gw_file_check check;
    int64_t max_file_bytes;
    int max_file_lines;
};

struct gw_upload {
    gw_files *files;
    struct MHD_PostProcessor *pp;
    int fd;                  /* the temporary file; -1 before the file part (or after a failure) */
    bool has_file;           /* a file part began */
    char tmp[PATH_MAX];
    char filename[256];      /* sanitized */
    char purpose[32];
    bool purpose_long;
    int64_t bytes;           /* of the file part */
    int64_t body;            /* of the whole body */
    gw_error err;            /* the first problem; http 0: none */
};

/* ---- owners, ids, names ---------------------------------------------------------------------------- */

void gw_files_owner(const char *key, size_t len, char out[GW_OWNER_MAX]) {
    if (!key) {
        snprintf(out, GW_OWNER_MAX, "anonymous");
        return;
    }
    unsigned char md[32];
    unsigned int mdlen = 0;
    if (!EVP_Digest(key, len, md, &mdlen, EVP_sha256(), NULL)) memset(md, 0, sizeof md);
    for (int i = 0; i < 32; i++) snprintf(out + 2 * i, 3, "%02x", md[i]);
}

/* A new file id, "file-" and 24 random hex digits. FU_OK or FU_ERR_INTERNAL. */
static int gw_file_id_new(char id[GW_FILE_ID_MAX]) {
    unsigned char r[12];
    if (RAND_bytes(r, sizeof r) != 1) return fu_errorf(FU_ERR_INTERNAL, "no random bytes for a file id");
    memcpy(id, "file-", 6);
    for (size_t i = 0; i < sizeof r; i++) snprintf(id + 5 + 2 * i, 3, "%02x", r[i]);
    return FU_OK;
}

/* Whether id has the shape of a file id (so that it may name a path). */
static bool gw_file_id_valid(const char *id) {
    size_t n = strlen(id);
    return n == 29 && !strncmp(id, "file-", 5) && strspn(id + 5, "0123456789abcdef") == 24;
}

/* The client's filename as stored: its base name (after the last '/' or '\'), control bytes and
 * invalid UTF-8 as '_', at most cap - 1 bytes; "upload.jsonl" when nothing is left. */
static void gw_filename_clean(const char *name, char *out, size_t cap) {
    const char *base = name ? name : "";
    for (const char *p = base; *p; p++)
        if (*p == '/' || *p == '\\') base = p + 1;
    size_t n = 0, len = strlen(base);
    for (size_t i = 0; i < len && n + 1 < cap; i++) {
        unsigned char b = (unsigned char)base[i];
        out[n++] = b < 0x20 || b == 0x7f ? '_' : (char)b;
    }
    out[n] = '\0';
    if (!gw_utf8_valid(out, n))
        for (size_t i = 0; i < n; i++) out[i] = (unsigned char)out[i] >= 0x80 ? '_' : out[i];
    n = gw_utf8_complete_prefix(out, n);
    out[n] = '\0';
    if (!n || !strcmp(out, ".") || !strcmp(out, "..")) snprintf(out, cap, "upload.jsonl");
}

/* DIR/files/<id>.jsonl into path[PATH_MAX]. */
static void gw_file_path(const gw_files *f, const char *id, char *path) {
    snprintf(path, PATH_MAX, "%s/%s.jsonl", f->dir, id);
}

/* ---- the data directory ----------------------------------------------------------------------------- */

/* Creates every missing directory of path (the last one 0700, the others 0755). FU_OK or FU_ERR_IO. */
static int gw_mkdirs(const char *path) {
    char p[PATH_MAX];
    if (snprintf(p, sizeof p, "%s", path) >= (int)sizeof p) return fu_errorf(FU_ERR_IO, "path too long: %.200s", path);
    for (char *s = p + 1; *s; s++) {
        if (*s != '/') continue;
        *s = '\0';
        if (mkdir(p, 0755) && errno != EEXIST) return fu_errorf(FU_ERR_IO, "mkdir %s: %s", p, strerror(errno));
        *s = '/';
    }
    if (mkdir(p, 0700) && errno != EEXIST) return fu_errorf(FU_ERR_IO, "mkdir %s: %s", p, strerror(errno));
    struct stat st;
    if (stat(p, &st) || !S_ISDIR(st.st_mode)) return fu_errorf(FU_ERR_IO, "%s is not a directory", p);
    return FU_OK;
}

/* The data directory: cfg->data_dir, $XDG_DATA_HOME/fusion, else $HOME/.local/share/fusion. */
static int gw_data_dir(const gw_config *cfg, char *out) {
    const char *xdg = getenv("XDG_DATA_HOME"), *home = getenv("HOME");
    int n = cfg->data_dir             ? snprintf(out, PATH_MAX, "%s", cfg->data_dir)
            : xdg && xdg[0] == '/'    ? snprintf(out, PATH_MAX, "%s/fusion", xdg)
            : home && home[0] == '/'  ? snprintf(out, PATH_MAX, "%s/.local/share/fusion", home)
                                      : -1;
    if (n < 0) return fu_errorf(FU_ERR_INVALID, "no data directory: give --data-dir (HOME is not set)");
    return n < PATH_MAX ? FU_OK : fu_errorf(FU_ERR_INVALID, "the data directory's path is too long");
}

/* Whether directory entry `name` of f->dir is left over: the temporary file of a gateway no
 * longer running, or a file older than GW_ORPHAN_AGE_S that the database does not know. */
static bool gw_leftover(gw_files *f, const char *name, const struct stat *st) {
    if (!strncmp(name, GW_UPLOAD_PREFIX, strlen(GW_UPLOAD_PREFIX))) {
        long pid = strtol(name + strlen(GW_UPLOAD_PREFIX), NULL, 10);
        return pid <= 0 || pid == (long)getpid() || (kill((pid_t)pid, 0) && errno == ESRCH);
    }
    size_t n = strlen(name);
    if (n != 35 || strcmp(name + 29, ".jsonl") || time(NULL) - st->st_mtime < GW_ORPHAN_AGE_S) return false;
    char id[GW_FILE_ID_MAX];
    snprintf(id, sizeof id, "%.29s", name);
    gw_file row;
    return gw_file_id_valid(id) && gw_store_file_get(f->store, id, NULL, &row) == FU_ERR_NOT_FOUND;
}

/* Removes what gw_leftover finds in f->dir. */
static void gw_files_sweep(gw_files *f) {
    DIR *d = opendir(f->dir);
    struct dirent *e;
    while (d && (e = readdir(d))) {
        struct stat st;
        if (fstatat(dirfd(d), e->d_name, &st, AT_SYMLINK_NOFOLLOW) || !S_ISREG(st.st_mode)) continue;
        if (!gw_leftover(f, e->d_name, &st)) continue;
        FU_INFO("removing %s/%s, left by an upload that did not finish", f->dir, e->d_name);
        unlinkat(dirfd(d), e->d_name, 0);
    }
    if (d) closedir(d);
}

int gw_files_open(const gw_config *cfg, const gw_model *m, gw_files **out) {
    *out = NULL;
    gw_files *f = calloc(1, sizeof *f);
    if (!f) return fu_errorf(FU_ERR_NOMEM, "files");
    char data[PATH_MAX], db[PATH_MAX + 16];
    f->max_file_bytes = cfg->max_file_bytes;
    f->max_file_lines = cfg->max_file_lines;
    int rc = gw_data_dir(cfg, data);
    if (!rc) rc = gw_mkdirs(data);
    if (!rc && snprintf(f->data, sizeof f->data, "%s", data) >= (int)sizeof f->data) rc = fu_errorf(FU_ERR_IO, "path");
    if (!rc && snprintf(f->dir, sizeof f->dir, "%s/files", data) >= (int)sizeof f->dir) rc = fu_errorf(FU_ERR_IO, "path");
    if (!rc) rc = gw_mkdirs(f->dir);
    snprintf(db, sizeof db, "%s/fusion.db", data);
    if (!rc) rc = gw_store_open(db, &f->store);
    if (!rc) rc = gw_file_check_init(&f->check, m->tok, m->tpl, m->ctx);
    if (rc) {
        gw_files_close(f);
        return rc;
    }
    gw_files_sweep(f);
    *out = f;
    return FU_OK;
}

void gw_files_close(gw_files *f) {
    if (!f) return;
    gw_store_close(f->store);
    gw_file_check_free(&f->check);
    free(f);
}

gw_store *gw_files_store(gw_files *f) { return f->store; }

const char *gw_files_data_dir(const gw_files *f) { return f->data; }

int gw_files_path(const gw_files *f, const char *id, char path[PATH_MAX]) {
    if (!gw_file_id_valid(id)) return fu_errorf(FU_ERR_INVALID, "not a file id: %.64s", id);
    gw_file_path(f, id, path);
    return FU_OK;
}

int gw_files_add(gw_files *f, const char *owner, const char *filename, const char *purpose, const void *data,
                 size_t len, gw_file *out) {
    memset(out, 0, sizeof *out);
    char path[PATH_MAX];
    int rc = gw_file_id_new(out->id);
    gw_file_path(f, out->id, path);
    if (!rc) rc = af_write_buf(path, data, len);
    snprintf(out->owner, sizeof out->owner, "%s", owner);
    gw_filename_clean(filename, out->filename, sizeof out->filename);
    snprintf(out->purpose, sizeof out->purpose, "%s", purpose);
    snprintf(out->status, sizeof out->status, "processed");
    out->bytes = (int64_t)len;
    out->created_at = (int64_t)time(NULL);
    if (!rc && (rc = gw_store_file_insert(f->store, out))) unlink(path);
    return rc;
}

/* ---- uploads ------------------------------------------------------------------------------------------ */

/* Closes and removes u's temporary file, if any. */
static void gw_upload_drop(gw_upload *u) {
    if (u->fd >= 0) close(u->fd);
    u->fd = -1;
    if (u->tmp[0]) unlink(u->tmp);
    u->tmp[0] = '\0';
}

/* Keeps the upload's first problem (the temporary file goes at once); returns MHD_NO. */
static enum MHD_Result gw_upload_fail(gw_upload *u, int http, const char *param, const char *code, const char *fmt, ...)
    __attribute__((format(printf, 5, 6)));
static enum MHD_Result gw_upload_fail(gw_upload *u, int http, const char *param, const char *code, const char *fmt, ...) {
    gw_upload_drop(u);
    if (u->err.http) return MHD_NO;
    gw_error_set(&u->err, http, param, code, "%s", "");
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(u->err.message, sizeof u->err.message, fmt, ap);
    va_end(ap);
    return MHD_NO;
}

/* The start of the file part: its temporary file, its name. */
static enum MHD_Result gw_upload_begin(gw_upload *u, const char *filename) {
    if (u->has_file) return gw_upload_fail(u, 400, "file", "invalid_request", "only one 'file' may be uploaded");
    u->has_file = true;
    gw_filename_clean(filename, u->filename, sizeof u->filename);
    snprintf(u->tmp, sizeof u->tmp, "%s/" GW_UPLOAD_PREFIX "%ld-XXXXXX", u->files->dir, (long)getpid());
    u->fd = mkostemp(u->tmp, O_CLOEXEC); /* 0600 */
    if (u->fd < 0) {
        FU_ERROR("cannot create a file in %s: %s", u->files->dir, strerror(errno));
        u->tmp[0] = '\0';
        return gw_upload_fail(u, 500, NULL, NULL, "cannot store the file");
    }
    return MHD_YES;
}

/* The file part's next bytes, data[0..size) at offset off, to the temporary file. */
static enum MHD_Result gw_upload_data(gw_upload *u, const char *filename, const char *data, uint64_t off, size_t size) {
    if ((!u->has_file || (off == 0 && u->bytes > 0)) && gw_upload_begin(u, filename) != MHD_YES) return MHD_NO;
    if (u->fd < 0) return MHD_NO;
    u->bytes += (int64_t)size;
    if (u->bytes > u->files->max_file_bytes)
        return gw_upload_fail(u, 413, "file", "file_too_large", "the file exceeds %lld bytes",
                              (long long)u->files->max_file_bytes);
    if (size && af_write_all(u->fd, data, size)) {
        FU_ERROR("cannot write %s: %s", u->tmp, strerror(errno));
        return gw_upload_fail(u, 500, NULL, NULL, "cannot store the file");
    }
    return MHD_YES;
}

/* The purpose field's next bytes. */
static enum MHD_Result gw_upload_purpose(gw_upload *u, const char *data, uint64_t off, size_t size) {
    if (off + size >= sizeof u->purpose) {
        u->purpose_long = true;
        return MHD_YES;
    }
    memcpy(u->purpose + off, data, size);
    u->purpose[off + size] = '\0';
    return MHD_YES;
}

/* libmicrohttpd's multipart iterator: "file" and "purpose"; other fields are ignored. */
static enum MHD_Result gw_upload_part(void *cls, enum MHD_ValueKind kind, const char *key, const char *filename,
                                      const char *ctype, const char *encoding, const char *data, uint64_t off,
                                      size_t size) {
    gw_upload *u = cls;
    if (u->err.http) return MHD_NO;
    if (!strcmp(key, "file")) return gw_upload_data(u, filename, data, off, size);
    if (!strcmp(key, "purpose")) return gw_upload_purpose(u, data, off, size);
    return MHD_YES;
}

int gw_upload_new(gw_files *f, struct MHD_Connection *mc, gw_upload **out, gw_error *err) {
    *out = NULL;
    gw_upload *u = calloc(1, sizeof *u);
    if (!u) return gw_error_set(err, 500, NULL, NULL, "out of memory");
    u->files = f;
    u->fd = -1;
    if (!(u->pp = MHD_create_post_processor(mc, 64 * 1024, gw_upload_part, u))) {
        free(u);
        return gw_error_set(err, 400, NULL, "invalid_request",
                            "the body must be multipart/form-data with a boundary, holding 'file' and 'purpose'");
    }
    *out = u;
    return 0;
}

void gw_upload_feed(gw_upload *u, const char *data, size_t n) {
    u->body += (int64_t)n;
    if (u->err.http) return;
    if (u->body > u->files->max_file_bytes + GW_UPLOAD_SLACK) {
        gw_upload_fail(u, 413, "file", "file_too_large", "the file exceeds %lld bytes",
                       (long long)u->files->max_file_bytes);
        return;
    }
    if (MHD_post_process(u->pp, data, n) != MHD_YES)
        gw_upload_fail(u, 400, NULL, "invalid_request", "the multipart/form-data body is malformed");
}

void gw_upload_free(gw_upload *u) {
    if (!u) return;
    if (u->pp) MHD_destroy_post_processor(u->pp);
    gw_upload_drop(u);
    free(u);
}

/* OpenAI's file object for f (new reference). */
static json_t *gw_file_json(const gw_file *f) {
    return json_pack("{s:s, s:s, s:I, s:I, s:s, s:s, s:s, s:o, s:n}", "id", f->id, "object", "file", "bytes",
                     (json_int_t)f->bytes, "created_at", (json_int_t)f->created_at, "filename", f->filename,
                     "purpose", f->purpose, "status", f->status, "status_details",
                     f->error[0] ? json_string(f->error) : json_null(), "expires_at");
}

/* The body is in: the multipart ended properly, a file and purpose "fine-tune" came. */
static int gw_upload_complete(gw_upload *u, gw_error *err) {
    enum MHD_Result done = MHD_destroy_post_processor(u->pp);
    u->pp = NULL;
    if (!u->err.http && done != MHD_YES)
        gw_upload_fail(u, 400, NULL, "invalid_request", "the multipart/form-data body is incomplete");
    if (u->err.http) {
        *err = u->err;
        return err->http;
    }
    if (!u->has_file)
        return gw_error_set(err, 400, "file", "missing_required_parameter", "'file' is required (a JSONL file)");
    if (u->purpose_long || strcmp(u->purpose, "fine-tune"))
        return gw_error_set(err, 400, "purpose", u->purpose[0] || u->purpose_long ? "invalid_value" : "missing_required_parameter",
                            "'purpose' must be 'fine-tune'");
    return 0;
}

/* Checks the temporary file's lines; *n_examples on success. */
static int gw_upload_check(gw_upload *u, int64_t *n_examples, gw_error *err) {
    mf_file mf;
    if (mf_open(&mf, u->tmp)) {
        FU_ERROR("cannot read back %s: %s", u->tmp, fu_last_error());
        return gw_error_set(err, 500, NULL, NULL, "cannot read the file back");
    }
    int rc = gw_file_check_text(&u->files->check, (const char *)mf.data, mf.size, u->files->max_file_lines, n_examples,
                                err);
    mf_close(&mf);
    return rc;
}

/* Makes the temporary file durable under its final name (row->id) and records row. */
static int gw_upload_commit(gw_upload *u, gw_file *row, gw_error *err) {
    char path[PATH_MAX];
    int rc = fsync(u->fd) || close(u->fd) ? fu_errorf(FU_ERR_IO, "fsync %s: %s", u->tmp, strerror(errno)) : FU_OK;
    u->fd = -1;
    if (!rc) rc = gw_file_id_new(row->id);
    gw_file_path(u->files, row->id, path);
    if (!rc && rename(u->tmp, path)) rc = fu_errorf(FU_ERR_IO, "rename %s: %s", u->tmp, strerror(errno));
    if (!rc) u->tmp[0] = '\0'; /* it is the final file now */
    if (!rc) rc = af_sync_parent(path);
    if (!rc && (rc = gw_store_file_insert(u->files->store, row))) unlink(path);
    if (!rc) return 0;
    FU_ERROR("cannot store an upload: %s", fu_last_error());
    return gw_error_set(err, 500, NULL, NULL, "cannot store the file");
}

int gw_upload_finish(gw_upload *u, const char *owner, json_t **out, gw_error *err) {
    *out = NULL;
    gw_file row = {0};
    int rc = gw_upload_complete(u, err);
    if (!rc) rc = gw_upload_check(u, &row.n_examples, err);
    if (rc) {
        gw_upload_drop(u);
        return rc;
    }
    snprintf(row.owner, sizeof row.owner, "%s", owner);
    snprintf(row.filename, sizeof row.filename, "%s", u->filename);
    snprintf(row.purpose, sizeof row.purpose, "%s", u->purpose);
    snprintf(row.status, sizeof row.status, "processed");
    row.bytes = u->bytes;
    row.created_at = (int64_t)time(NULL);
    if ((rc = gw_upload_commit(u, &row, err))) {
        gw_upload_drop(u);
        return rc;
    }
    if (!(*out = gw_file_json(&row))) return gw_error_set(err, 500, NULL, NULL, "out of memory");
    return 0;
}

/* ---- the other routes --------------------------------------------------------------------------------- */

/* 404 for a file owner cannot see. */
static int gw_file_missing(const char *id, gw_error *err) {
    return gw_error_set(err, 404, "id", "file_not_found", "No such File object: %.64s", id);
}

/* The row of file id that owner (NULL: anyone) sees into *row: 0, 404 or 500 with *err. */
static int gw_file_find(gw_files *f, const char *owner, const char *id, gw_file *row, gw_error *err) {
    int rc = gw_file_id_valid(id) ? gw_store_file_get(f->store, id, owner, row) : FU_ERR_NOT_FOUND;
    if (rc == FU_ERR_NOT_FOUND) return gw_file_missing(id, err);
    if (rc) {
        FU_ERROR("files: %s", fu_last_error());
        return gw_error_set(err, 500, NULL, NULL, "the file database failed");
    }
    return 0;
}

int gw_files_get(gw_files *f, const char *owner, const char *id, json_t **out, gw_error *err) {
    gw_file row;
    int rc = gw_file_find(f, owner, id, &row, err);
    if (rc) return rc;
    return (*out = gw_file_json(&row)) ? 0 : gw_error_set(err, 500, NULL, NULL, "out of memory");
}

int gw_files_delete(gw_files *f, const char *owner, const char *id, json_t **out, gw_error *err) {
    gw_file row;
    char path[PATH_MAX];
    int rc = gw_file_find(f, owner, id, &row, err);
    if (rc) return rc;
    rc = gw_store_file_delete(f->store, row.id, owner);
    if (rc == FU_ERR_NOT_FOUND) return gw_file_missing(id, err); /* deleted meanwhile */
    if (rc) return gw_error_set(err, 500, NULL, NULL, "the file database failed");
    gw_file_path(f, row.id, path);
    if (unlink(path) && errno != ENOENT) FU_WARN("cannot remove %s: %s", path, strerror(errno));
    *out = json_pack("{s:s, s:s, s:b}", "id", row.id, "object", "file", "deleted", 1);
    return *out ? 0 : gw_error_set(err, 500, NULL, NULL, "out of memory");
}

/* The media type of a stored file, by its name's extension: results are CSV, SVG, JSON or
 * safetensors, uploads JSONL. */
static const char *gw_file_type(const char *filename) {
    static const char *const types[][2] = {{".csv", "text/csv"},
                                           {".svg", "image/svg+xml"},
                                           {".json", "application/json"},
                                           {".safetensors", "application/octet-stream"}};
    const char *dot = strrchr(filename, '.');
    for (size_t i = 0; dot && i < sizeof types / sizeof types[0]; i++)
        if (!strcmp(dot, types[i][0])) return types[i][1];
    return "application/jsonl";
}

int gw_files_content(gw_files *f, const char *owner, const char *id, int *fd, uint64_t *size, const char **type,
                     gw_error *err) {
    gw_file row;
    char path[PATH_MAX];
    *fd = -1;
    int rc = gw_file_find(f, owner, id, &row, err);
    if (rc) return rc;
    *type = gw_file_type(row.filename);
    gw_file_path(f, row.id, path);
    if (mf_open_regular(path, (uint64_t)INT64_MAX, fd, size)) {
        FU_ERROR("files: %s", fu_last_error());
        return gw_error_set(err, 500, NULL, NULL, "the file's content is unavailable");
    }
    return 0;
}

/* The listing's query from a: 0, or 400 naming the parameter. */
static int gw_files_query(const gw_files_args *a, gw_file_query *q, gw_error *err) {
    long limit = 10000;
    if (a->limit && fu_parse_long(a->limit, 1, 10000, &limit))
        return gw_error_set(err, 400, "limit", "invalid_value", "'limit' must be an integer in [1, 10000]");
    if (a->order && strcmp(a->order, "asc") && strcmp(a->order, "desc"))
        return gw_error_set(err, 400, "order", "invalid_value", "'order' must be 'asc' or 'desc'");
    q->limit = (int)limit;
    q->asc = a->order && !strcmp(a->order, "asc");
    q->purpose = a->purpose && a->purpose[0] ? a->purpose : NULL;
    q->after = a->after && a->after[0] ? a->after : NULL;
    return 0;
}

/* {object: "list", data, first_id, last_id, has_more} over rows[0..n) (new reference). */
static json_t *gw_files_page(const gw_file *rows, size_t n, bool has_more) {
    json_t *data = json_array();
    for (size_t i = 0; data && i < n; i++) json_array_append_new(data, gw_file_json(&rows[i]));
    return json_pack("{s:s, s:o, s:o, s:o, s:b}", "object", "list", "data", data ? data : json_null(), "first_id",
                     n ? json_string(rows[0].id) : json_null(), "last_id", n ? json_string(rows[n - 1].id) : json_null(),
                     "has_more", has_more);
}

int gw_files_list(gw_files *f, const char *owner, const gw_files_args *a, json_t **out, gw_error *err) {
    gw_file_query q = {.owner = owner};
    int rc = gw_files_query(a, &q, err);
    if (rc) return rc;
    if (q.after && !gw_file_id_valid(q.after)) return gw_file_missing(q.after, err);
    gw_file *rows = NULL;
    size_t n = 0;
    bool more = false;
    rc = gw_store_file_list(f->store, &q, &rows, &n, &more);
    if (rc == FU_ERR_NOT_FOUND) return gw_file_missing(q.after, err);
    if (rc) return gw_error_set(err, 500, NULL, NULL, "the file database failed");
    *out = gw_files_page(rows, n, more);
    free(rows);
    return *out ? 0 : gw_error_set(err, 500, NULL, NULL, "out of memory");
}
