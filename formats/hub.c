/* hub.c -- Hugging Face hub client: repo listing, download plan, verified resumable downloads, cache. */
#include "hub.h"
#include "clock.h"
#include "hub-impl.h"

#include <curl/curl.h>
#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <limits.h>
#include <openssl/evp.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "atomic-file.h"
#include "format.h"
#include "log.h"
#include "mapped-file.h"
#include "status.h"

#define HUB_LISTING_MAX (64u << 20) /* bytes of API answer we accept */
#define HUB_INDEX_MAX (64u << 20)   /* bytes of a safetensors index we read */
#define HUB_MAX_REDIRECTS 10
#define HUB_BACKOFF_CAP_MS 30000
#define HUB_RETRY_AFTER_CAP_S 60

/* ------------------------------------------------------------------------ */
/* Small helpers                                                            */
/* ------------------------------------------------------------------------ */

/* malloc'ed formatted string, NULL when out of memory. */
static char *str_printf(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static char *str_printf(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    char *s = NULL;
    int n = vasprintf(&s, fmt, ap);
    va_end(ap);
    return n < 0 ? NULL : s;
}

static int ends_with(const char *s, const char *suffix) {
    size_t n = strlen(s), m = strlen(suffix);
    return n >= m && memcmp(s + n - m, suffix, m) == 0;
}

static int is_hex_lower(const char *s, size_t n) {
    for (size_t i = 0; i < n; i++)
        if (!((s[i] >= '0' && s[i] <= '9') || (s[i] >= 'a' && s[i] <= 'f'))) return 0;
    return 1;
}

/* ------------------------------------------------------------------------ */
/* Names and validation                                                     */
/* ------------------------------------------------------------------------ */

/* One part of a repo id ("org" or "name"), `n` bytes. */
static int repo_part_ok(const char *s, size_t n) {
    if (n == 0 || n > HUB_REPO_PART_MAX) return 0;
    if (s[0] == '-' || s[0] == '.' || s[n - 1] == '-' || s[n - 1] == '.') return 0;
    for (size_t i = 0; i < n; i++) {
        char c = s[i];
        int ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                 c == '-' || c == '_' || c == '.';
        if (!ok) return 0;
        if (i > 0 && (c == '-' || c == '.') && s[i - 1] == c) return 0; /* "--", ".." */
    }
    return 1;
}

int hub_validate_repo_id(const char *repo_id) {
    if (!repo_id) return fu_errorf(FU_ERR_INVALID, "repo id is NULL");
    const char *slash = strchr(repo_id, '/');
    if (!slash || !repo_part_ok(repo_id, (size_t)(slash - repo_id)) ||
        !repo_part_ok(slash + 1, strlen(slash + 1)))
        return fu_errorf(FU_ERR_INVALID,
                         "invalid repo id '%.300s': expected org/name, each part 1-%d of "
                         "[A-Za-z0-9._-], not starting or ending with '.' or '-', without "
                         "'--' or '..'",
                         repo_id, HUB_REPO_PART_MAX);
    return FU_OK;
}

int hub_validate_revision(const char *rev) {
    if (!rev) return fu_errorf(FU_ERR_INVALID, "revision is NULL");
    size_t n = strlen(rev);
    int ok = n > 0 && n < HUB_REVISION_MAX && rev[0] != '/' && rev[n - 1] != '/';
    size_t seg = 0; /* start of the current segment */
    for (size_t i = 0; ok && i <= n; i++) {
        char c = rev[i];
        if (c == '/' || c == '\0') {
            size_t len = i - seg;
            if (len == 0 || (len == 1 && rev[seg] == '.') ||
                (len == 2 && rev[seg] == '.' && rev[seg + 1] == '.'))
                ok = 0;
            seg = i + 1;
            continue;
        }
        ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
             c == '-' || c == '_' || c == '.';
    }
    if (!ok)
        return fu_errorf(FU_ERR_INVALID,
                         "invalid revision '%.300s': expected 1-%d chars of [A-Za-z0-9._/-] "
                         "without empty, '.' or '..' path segments",
                         rev, HUB_REVISION_MAX - 1);
    return FU_OK;
}

int hub_validate_filename(const char *path) {
    if (!path) return fu_errorf(FU_ERR_INVALID, "file name is NULL");
    size_t n = strlen(path);
    const char *why = NULL;
    if (n == 0) why = "empty";
    else if (n >= HUB_PATH_MAX) why = "too long";
    else if (path[0] == '/') why = "absolute path";
    for (size_t i = 0; !why && i < n; i++) {
        unsigned char c = (unsigned char)path[i];
        if (c < 0x20 || c == 0x7f) why = "control character";
        else if (c == '\\') why = "backslash";
    }
    size_t seg = 0;
    for (size_t i = 0; !why && i <= n; i++) {
        if (path[i] != '/' && path[i] != '\0') continue;
        size_t len = i - seg;
        const char *s = path + seg;
        if (len == 0) why = "empty path segment";
        else if ((len == 1 && s[0] == '.') || (len == 2 && s[0] == '.' && s[1] == '.'))
            why = "'.' or '..' segment";
        else if (len >= 11 && memcmp(s + len - 11, ".incomplete", 11) == 0)
            why = "reserved '.incomplete' suffix";
        seg = i + 1;
    }
    if (why) {
        /* Print only the safe prefix: the name may hold terminal escapes. */
        char shown[80];
        size_t k = 0;
        for (size_t i = 0; i < n && k + 5 < sizeof shown; i++) {
            unsigned char c = (unsigned char)path[i];
            if (c < 0x20 || c == 0x7f || c == '\\') {
                k += (size_t)snprintf(shown + k, sizeof shown - k, "\\x%02x", c);
            } else {
                shown[k++] = (char)c;
            }
        }
        shown[k] = '\0';
        return fu_errorf(FU_ERR_INVALID, "unsafe file name '%s%s': %s", shown,
                         k < n ? "..." : "", why);
    }
    return FU_OK;
}

int hub_is_commit(const char *s) {
    if (!s) return 0;
    size_t n = strlen(s);
    return (n == 40 || n == 64) && is_hex_lower(s, n);
}

int hub_parse_name(const char *name, hub_ref *out) {
    if (!name || !out) return fu_errorf(FU_ERR_INVALID, "hub_parse_name: NULL argument");
    memset(out, 0, sizeof *out);
    const char *at = strchr(name, '@');
    size_t id_len = at ? (size_t)(at - name) : strlen(name);
    if (id_len >= HUB_REPO_ID_MAX)
        return fu_errorf(FU_ERR_INVALID, "repo id in '%.300s' is too long", name);
    memcpy(out->repo_id, name, id_len);
    out->repo_id[id_len] = '\0';
    int rc = hub_validate_repo_id(out->repo_id);
    if (rc != FU_OK) return rc;
    const char *rev = at ? at + 1 : HUB_DEFAULT_REVISION;
    if (at && *rev == '\0') return fu_errorf(FU_ERR_INVALID, "empty revision after '@' in '%.300s'", name);
    rc = hub_validate_revision(rev);
    if (rc != FU_OK) return rc;
    memcpy(out->revision, rev, strlen(rev) + 1);
    return FU_OK;
}

int hub_is_repo_name(const char *name) {
    char saved[1024];
    snprintf(saved, sizeof saved, "%s", fu_last_error());
    hub_ref ref;
    int rc = hub_parse_name(name, &ref);
    fu_errorf(FU_OK, "%s", saved); /* a predicate leaves the last error alone */
    return rc == FU_OK;
}

/* ------------------------------------------------------------------------ */
/* Options, environment and cache paths                                     */
/* ------------------------------------------------------------------------ */

void hub_options_init(hub_options *o) {
    memset(o, 0, sizeof *o);
    o->offline = -1;
    o->progress_interval_ms = 250;
    o->max_retries = 5;
    o->retry_base_ms = 1000;
    o->connect_timeout_s = 15;
    o->low_speed_time_s = 60;
    o->low_speed_limit = 1024;
}

static const char *env_nonempty(const char *name) {
    const char *v = getenv(name);
    return v && *v ? v : NULL;
}

/* Copy of `s` without trailing '/' (keeps a lone "/"). */
static char *strip_slashes(const char *s) {
    size_t n = strlen(s);
    while (n > 1 && s[n - 1] == '/') n--;
    return strndup(s, n);
}

int hub_cache_root(const hub_options *opts, char **out) {
    *out = NULL;
    const char *v;
    char *s = NULL;
    if (opts && opts->cache_dir && *opts->cache_dir) {
        s = strip_slashes(opts->cache_dir);
    } else if ((v = env_nonempty("FUSION_CACHE"))) {
        char *base = strip_slashes(v);
        s = base ? str_printf("%s/hub", strcmp(base, "/") == 0 ? "" : base) : NULL;
        free(base);
    } else if ((v = env_nonempty("XDG_CACHE_HOME")) && v[0] == '/') {
        char *base = strip_slashes(v);
        s = base ? str_printf("%s/fusion/hub", strcmp(base, "/") == 0 ? "" : base) : NULL;
        free(base);
    } else if ((v = env_nonempty("HOME"))) {
        char *base = strip_slashes(v);
        s = base ? str_printf("%s/.cache/fusion/hub", strcmp(base, "/") == 0 ? "" : base) : NULL;
        free(base);
    } else {
        return fu_errorf(FU_ERR_INVALID,
                         "no cache directory: set FUSION_CACHE, XDG_CACHE_HOME or HOME");
    }
    if (!s) return fu_errorf(FU_ERR_NOMEM, "out of memory");
    *out = s;
    return FU_OK;
}

int hub_endpoint(const hub_options *opts, char **out) {
    *out = NULL;
    const char *e = opts && opts->endpoint && *opts->endpoint ? opts->endpoint
                                                              : env_nonempty("HF_ENDPOINT");
    if (!e) e = HUB_DEFAULT_ENDPOINT;
    if (strncasecmp(e, "http://", 7) != 0 && strncasecmp(e, "https://", 8) != 0)
        return fu_errorf(FU_ERR_INVALID, "hub endpoint '%.300s' is not an http(s) URL", e);
    for (const char *p = e; *p; p++)
        if ((unsigned char)*p <= 0x20 || *p == 0x7f)
            return fu_errorf(FU_ERR_INVALID, "hub endpoint '%.300s' contains a space or control character", e);
    char *s = strip_slashes(e);
    if (!s) return fu_errorf(FU_ERR_NOMEM, "out of memory");
    *out = s;
    return FU_OK;
}

int hub_repo_dir(const char *cache_root, const char *repo_id, char **out) {
    *out = NULL;
    int rc = hub_validate_repo_id(repo_id);
    if (rc != FU_OK) return rc;
    const char *slash = strchr(repo_id, '/');
    char *s = str_printf("%s/%.*s--%s", cache_root, (int)(slash - repo_id), repo_id, slash + 1);
    if (!s) return fu_errorf(FU_ERR_NOMEM, "out of memory");
    *out = s;
    return FU_OK;
}

int hub_snapshot_dir(const char *cache_root, const char *repo_id, const char *commit,
                     char **out) {
    *out = NULL;
    if (!hub_is_commit(commit))
        return fu_errorf(FU_ERR_INVALID, "'%.100s' is not a commit id", commit ? commit : "(null)");
    char *repo = NULL;
    int rc = hub_repo_dir(cache_root, repo_id, &repo);
    if (rc != FU_OK) return rc;
    *out = str_printf("%s/snapshots/%s", repo, commit);
    free(repo);
    return *out ? FU_OK : fu_errorf(FU_ERR_NOMEM, "out of memory");
}

int hub_is_offline(const hub_options *opts) {
    if (opts && (opts->offline == 0 || opts->offline == 1)) return opts->offline;
    const char *v = getenv("HF_HUB_OFFLINE");
    if (!v) return 0;
    return strcasecmp(v, "1") == 0 || strcasecmp(v, "true") == 0 ||
           strcasecmp(v, "yes") == 0 || strcasecmp(v, "on") == 0;
}

/* "<repo_dir>/refs/<revision>" with '/' in the revision written as "%2F". */
static char *refs_path(const char *repo_dir, const char *rev) {
    char enc[HUB_REVISION_MAX * 3];
    size_t k = 0;
    for (const char *p = rev; *p && k + 4 < sizeof enc; p++) {
        if (*p == '/') {
            memcpy(enc + k, "%2F", 3);
            k += 3;
        } else {
            enc[k++] = *p;
        }
    }
    enc[k] = '\0';
    return str_printf("%s/refs/%s", repo_dir, enc);
}

/* ------------------------------------------------------------------------ */
/* Files on disk                                                            */
/* ------------------------------------------------------------------------ */

/* mkdir -p; each existing component must be a directory. */
static int mkdir_p(const char *path) {
    char *p = strdup(path);
    if (!p) return fu_errorf(FU_ERR_NOMEM, "out of memory");
    size_t n = strlen(p);
    for (size_t i = 1; i <= n; i++) {
        if (p[i] != '/' && p[i] != '\0') continue;
        char saved = p[i];
        p[i] = '\0';
        if (mkdir(p, 0755) != 0 && errno != EEXIST) {
            int e = errno;
            int rc = fu_errorf(FU_ERR_IO, "cannot create directory %s: %s", p, strerror(e));
            free(p);
            return rc;
        }
        struct stat st;
        if (stat(p, &st) != 0 || !S_ISDIR(st.st_mode)) {
            int rc = fu_errorf(FU_ERR_IO, "%s exists and is not a directory", p);
            free(p);
            return rc;
        }
        p[i] = saved;
    }
    free(p);
    return FU_OK;
}

static void hex_encode(const unsigned char *d, size_t n, char *hex) {
    static const char digits[] = "0123456789abcdef";
    for (size_t i = 0; i < n; i++) {
        hex[2 * i] = digits[d[i] >> 4];
        hex[2 * i + 1] = digits[d[i] & 15];
    }
    hex[2 * n] = '\0';
}

/* Feeds the first `n` bytes of fd (from offset 0) into `md`. */
static int hash_prefix(int fd, int64_t n, EVP_MD_CTX *md, const char *what) {
    static const size_t chunk = 1 << 20;
    char *buf = malloc(chunk);
    if (!buf) return fu_errorf(FU_ERR_NOMEM, "out of memory");
    int64_t off = 0;
    int rc = FU_OK;
    while (off < n) {
        size_t want = (size_t)(n - off) < chunk ? (size_t)(n - off) : chunk;
        ssize_t r = pread(fd, buf, want, off);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) {
            rc = fu_errorf(FU_ERR_IO, "cannot read %s: %s", what, r < 0 ? strerror(errno) : "unexpected end of file");
            break;
        }
        if (EVP_DigestUpdate(md, buf, (size_t)r) != 1) {
            rc = fu_errorf(FU_ERR_INTERNAL, "sha256 update failed");
            break;
        }
        off += r;
    }
    free(buf);
    return rc;
}

int hub_sha256_file(const char *path, char hex[65]) {
    hex[0] = '\0';
    int fd;
    uint64_t size;
    int rc = mf_open_regular(path, (uint64_t)INT64_MAX, &fd, &size);
    if (rc) return rc == FU_ERR_NOT_FOUND ? FU_ERR_IO : rc;
    EVP_MD_CTX *md = EVP_MD_CTX_new();
    if (!md || EVP_DigestInit_ex(md, EVP_sha256(), NULL) != 1) rc = fu_errorf(FU_ERR_INTERNAL, "sha256 init failed");
    else rc = hash_prefix(fd, (int64_t)size, md, path);
    unsigned char d[EVP_MAX_MD_SIZE];
    unsigned int dn = 0;
    if (rc == FU_OK && EVP_DigestFinal_ex(md, d, &dn) != 1) rc = fu_errorf(FU_ERR_INTERNAL, "sha256 final failed");
    if (rc == FU_OK) hex_encode(d, dn, hex);
    EVP_MD_CTX_free(md);
    close(fd);
    return rc;
}

/* ------------------------------------------------------------------------ */
/* The listing                                                              */
/* ------------------------------------------------------------------------ */

static int cmp_file_path(const void *a, const void *b) {
    return strcmp(((const hub_file *)a)->path, ((const hub_file *)b)->path);
}

static int json_size(json_t *v, int64_t *out) {
    if (!json_is_integer(v) || json_integer_value(v) < 0) return 0;
    *out = (int64_t)json_integer_value(v);
    return 1;
}

int hub_listing_parse(const char *text, size_t len, hub_listing *out) {
    memset(out, 0, sizeof *out);
    json_error_t jerr;
    json_t *root = json_loadb(text, len, JSON_REJECT_DUPLICATES, &jerr);
    if (!root)
        return fu_errorf(FU_ERR_FORMAT, "hub listing is not valid JSON: %s (line %d)", jerr.text, jerr.line);
    int rc = FU_OK;
    json_t *sha = json_object_get(root, "sha");
    json_t *sib = json_object_get(root, "siblings");
    if (!json_is_object(root)) {
        rc = fu_errorf(FU_ERR_FORMAT, "hub listing is not a JSON object");
    } else if (!json_is_string(sha) || !hub_is_commit(json_string_value(sha))) {
        rc = fu_errorf(FU_ERR_FORMAT, "hub listing has no valid commit \"sha\"");
    } else if (!json_is_array(sib)) {
        rc = fu_errorf(FU_ERR_FORMAT, "hub listing has no \"siblings\" array");
    }
    if (rc != FU_OK) goto done;
    memcpy(out->commit, json_string_value(sha), strlen(json_string_value(sha)) + 1);
    size_t n = json_array_size(sib);
    out->files = calloc(n ? n : 1, sizeof *out->files);
    if (!out->files) {
        rc = fu_errorf(FU_ERR_NOMEM, "out of memory");
        goto done;
    }
    for (size_t i = 0; i < n; i++) {
        json_t *s = json_array_get(sib, i);
        json_t *name = json_object_get(s, "rfilename");
        if (!json_is_object(s) || !json_is_string(name)) {
            rc = fu_errorf(FU_ERR_FORMAT, "hub listing: siblings[%zu] has no \"rfilename\" string", i);
            goto done;
        }
        const char *path = json_string_value(name);
        if (strlen(path) != json_string_length(name) || hub_validate_filename(path) != FU_OK) {
            char why[512];
            snprintf(why, sizeof why, "%s", strlen(path) != json_string_length(name) ? "embedded NUL" : fu_last_error());
            rc = fu_errorf(FU_ERR_FORMAT, "hub listing rejected: siblings[%zu]: %s", i, why);
            goto done;
        }
        hub_file *f = &out->files[out->n_files];
        f->size = -1;
        json_t *size = json_object_get(s, "size");
        if (size && !json_is_null(size) && !json_size(size, &f->size)) {
            rc = fu_errorf(FU_ERR_FORMAT, "hub listing: bad size for %s", path);
            goto done;
        }
        json_t *lfs = json_object_get(s, "lfs");
        if (lfs && !json_is_null(lfs)) {
            json_t *h = json_object_get(lfs, "sha256");
            json_t *lsize = json_object_get(lfs, "size");
            int64_t ls = -1;
            if (!json_is_object(lfs) || !json_is_string(h) || json_string_length(h) != 64 ||
                !is_hex_lower(json_string_value(h), 64) || (lsize && !json_size(lsize, &ls))) {
                rc = fu_errorf(FU_ERR_FORMAT, "hub listing: bad lfs info for %s", path);
                goto done;
            }
            if (ls >= 0 && f->size >= 0 && ls != f->size) {
                rc = fu_errorf(FU_ERR_FORMAT, "hub listing: size %lld and lfs size %lld disagree for %s",
                               (long long)f->size, (long long)ls, path);
                goto done;
            }
            if (ls >= 0) f->size = ls;
            memcpy(f->sha256, json_string_value(h), 65);
        }
        f->path = strdup(path);
        if (!f->path) {
            rc = fu_errorf(FU_ERR_NOMEM, "out of memory");
            goto done;
        }
        out->n_files++;
    }
    if (out->n_files > 1) {
        hub_file *sorted = malloc(out->n_files * sizeof *sorted);
        if (!sorted) {
            rc = fu_errorf(FU_ERR_NOMEM, "out of memory");
            goto done;
        }
        memcpy(sorted, out->files, out->n_files * sizeof *sorted);
        qsort(sorted, out->n_files, sizeof *sorted, cmp_file_path);
        for (size_t i = 1; i < out->n_files && rc == FU_OK; i++)
            if (strcmp(sorted[i - 1].path, sorted[i].path) == 0)
                rc = fu_errorf(FU_ERR_FORMAT, "hub listing names %s twice", sorted[i].path);
        free(sorted);
    }
done:
    json_decref(root);
    if (rc != FU_OK) hub_listing_free(out);
    return rc;
}

void hub_listing_free(hub_listing *l) {
    if (!l) return;
    for (size_t i = 0; i < l->n_files; i++) free(l->files[i].path);
    free(l->files);
    memset(l, 0, sizeof *l);
}

const hub_file *hub_listing_find(const hub_listing *l, const char *path) {
    for (size_t i = 0; i < l->n_files; i++)
        if (strcmp(l->files[i].path, path) == 0) return &l->files[i];
    return NULL;
}

/* ------------------------------------------------------------------------ */
/* The plan                                                                 */
/* ------------------------------------------------------------------------ */

static int plan_has(const hub_plan *p, const char *path) {
    for (size_t i = 0; i < p->n_paths; i++)
        if (strcmp(p->paths[i], path) == 0) return 1;
    return 0;
}

/* Appends a copy of `path` unless already planned. */
static int plan_add(hub_plan *p, const char *path) {
    if (plan_has(p, path)) return FU_OK;
    char **grown = realloc(p->paths, (p->n_paths + 1) * sizeof *grown);
    if (!grown) return fu_errorf(FU_ERR_NOMEM, "out of memory");
    p->paths = grown;
    if (!(p->paths[p->n_paths] = strdup(path))) return fu_errorf(FU_ERR_NOMEM, "out of memory");
    p->n_paths++;
    return FU_OK;
}

/* Split GGUF "<stem>-0000k-of-0000n.gguf": 1 with the stem length and n. */
static int gguf_split(const char *path, size_t *stem_len, int *count) {
    static const size_t tail = 20; /* "-00001-of-00003.gguf" */
    size_t n = strlen(path);
    if (n <= tail || !ends_with(path, ".gguf")) return 0;
    const char *t = path + n - tail;
    if (t[0] != '-' || memcmp(t + 6, "-of-", 4) != 0) return 0;
    int k = 0, m = 0;
    for (int i = 0; i < 5; i++) {
        if (t[1 + i] < '0' || t[1 + i] > '9' || t[10 + i] < '0' || t[10 + i] > '9') return 0;
        k = k * 10 + (t[1 + i] - '0');
        m = m * 10 + (t[10 + i] - '0');
    }
    if (k < 1 || m < 1 || k > m) return 0;
    *stem_len = n - tail;
    *count = m;
    return 1;
}

/* Adds a GGUF file and, for a split one, all its parts (each must be listed). */
static int plan_add_gguf(hub_plan *p, const hub_listing *l, const char *path) {
    size_t stem = 0;
    int count = 0;
    if (!gguf_split(path, &stem, &count)) return plan_add(p, path);
    for (int k = 1; k <= count; k++) {
        char part[HUB_PATH_MAX + 32];
        snprintf(part, sizeof part, "%.*s-%05d-of-%05d.gguf", (int)stem, path, k, count);
        if (!hub_listing_find(l, part))
            return fu_errorf(FU_ERR_NOT_FOUND, "GGUF split part %s is not in the repo", part);
        int rc = plan_add(p, part);
        if (rc != FU_OK) return rc;
    }
    return FU_OK;
}

/* Same GGUF model: equal paths, or parts of one split set. */
static int gguf_same_model(const char *a, const char *b) {
    size_t sa, sb;
    int ca, cb;
    if (gguf_split(a, &sa, &ca) && gguf_split(b, &sb, &cb))
        return sa == sb && ca == cb && memcmp(a, b, sa) == 0;
    return strcmp(a, b) == 0;
}

int hub_plan_init(hub_plan *p, const hub_listing *l, const char *const *files, size_t n_files) {
    memset(p, 0, sizeof *p);
    int rc = FU_OK;
    int want_gguf = 0;
    for (size_t i = 0; i < n_files; i++) {
        if ((rc = hub_validate_filename(files[i])) != FU_OK) return rc;
        if (!hub_listing_find(l, files[i]))
            return fu_errorf(FU_ERR_NOT_FOUND, "file %s is not in the repo (commit %s)", files[i], l->commit);
        if (ends_with(files[i], ".gguf")) want_gguf = 1;
    }
    int has_st = 0;
    const char *gguf_first = NULL, *gguf_other = NULL;
    size_t n_gguf = 0;
    for (size_t i = 0; i < l->n_files; i++) {
        const char *path = l->files[i].path;
        if (!strchr(path, '/') && ends_with(path, ".safetensors")) has_st = 1;
        if (ends_with(path, ".gguf")) {
            n_gguf++;
            if (!gguf_first) gguf_first = path;
            else if (!gguf_other && !gguf_same_model(gguf_first, path)) gguf_other = path;
        }
    }

    if (want_gguf || !has_st) {
        p->weights = HUB_WEIGHTS_GGUF;
        if (!want_gguf) {
            if (n_gguf == 0) {
                rc = fu_errorf(FU_ERR_UNSUPPORTED,
                               "repo has no top-level *.safetensors and no *.gguf weights "
                               "(fusion loads safetensors or GGUF)");
                goto fail;
            }
            if (gguf_other) {
                char names[600];
                size_t k = 0, shown = 0;
                names[0] = '\0';
                for (size_t i = 0; i < l->n_files && shown < 8; i++) {
                    if (!ends_with(l->files[i].path, ".gguf")) continue;
                    int w = snprintf(names + k, sizeof names - k, "%s%s", shown ? ", " : "", l->files[i].path);
                    if (w < 0 || (size_t)w >= sizeof names - k) break;
                    k += (size_t)w;
                    shown++;
                }
                rc = fu_errorf(FU_ERR_INVALID,
                               "repo has %zu GGUF files; choose one with --file (e.g. %s%s)", n_gguf,
                               names, shown < n_gguf ? ", ..." : "");
                goto fail;
            }
            if ((rc = plan_add_gguf(p, l, gguf_first)) != FU_OK) goto fail;
        }
        for (size_t i = 0; i < n_files; i++) {
            rc = ends_with(files[i], ".gguf") ? plan_add_gguf(p, l, files[i]) : plan_add(p, files[i]);
            if (rc != FU_OK) goto fail;
        }
        return FU_OK;
    }

    p->weights = HUB_WEIGHTS_SAFETENSORS;
    static const char *const required[] = {"config.json", "tokenizer.json", "tokenizer_config.json"};
    static const char *const optional[] = {"generation_config.json", "special_tokens_map.json"};
    for (size_t i = 0; i < 3; i++) {
        if (!hub_listing_find(l, required[i])) {
            rc = fu_errorf(FU_ERR_NOT_FOUND, "repo has safetensors weights but no %s (required)", required[i]);
            goto fail;
        }
        if ((rc = plan_add(p, required[i])) != FU_OK) goto fail;
    }
    for (size_t i = 0; i < 2; i++)
        if (hub_listing_find(l, optional[i]) && (rc = plan_add(p, optional[i])) != FU_OK) goto fail;
    for (size_t i = 0; i < n_files; i++)
        if ((rc = plan_add(p, files[i])) != FU_OK) goto fail;
    if (hub_listing_find(l, "model.safetensors.index.json")) {
        if ((rc = plan_add(p, "model.safetensors.index.json")) != FU_OK) goto fail;
        for (size_t i = 0; i < p->n_paths; i++)
            if (strcmp(p->paths[i], "model.safetensors.index.json") == 0) p->index_path = p->paths[i];
    } else if (hub_listing_find(l, "model.safetensors")) {
        if ((rc = plan_add(p, "model.safetensors")) != FU_OK) goto fail;
    } else {
        for (size_t i = 0; i < l->n_files; i++) {
            const char *path = l->files[i].path;
            if (!strchr(path, '/') && ends_with(path, ".safetensors") && (rc = plan_add(p, path)) != FU_OK)
                goto fail;
        }
    }
    return FU_OK;
fail:
    hub_plan_free(p);
    return rc;
}

int hub_plan_add_index(hub_plan *p, const hub_listing *l, const char *text, size_t len) {
    json_error_t jerr;
    json_t *root = json_loadb(text, len, 0, &jerr);
    if (!root)
        return fu_errorf(FU_ERR_FORMAT, "model.safetensors.index.json is not valid JSON: %s (line %d)",
                         jerr.text, jerr.line);
    int rc = FU_OK;
    json_t *map = json_object_get(root, "weight_map");
    if (!json_is_object(map) || json_object_size(map) == 0) {
        rc = fu_errorf(FU_ERR_FORMAT, "model.safetensors.index.json has no \"weight_map\" object");
        goto done;
    }
    const char *key;
    json_t *val;
    json_object_foreach(map, key, val) {
        const char *shard = json_string_value(val);
        if (!shard || strlen(shard) != json_string_length(val) || hub_validate_filename(shard) != FU_OK) {
            rc = fu_errorf(FU_ERR_FORMAT, "model.safetensors.index.json: tensor '%.200s' has an unsafe or non-string shard name",
                           key);
            goto done;
        }
        if (!hub_listing_find(l, shard)) {
            rc = fu_errorf(FU_ERR_FORMAT, "model.safetensors.index.json names shard %s, which is not in the repo", shard);
            goto done;
        }
        if ((rc = plan_add(p, shard)) != FU_OK) goto done;
    }
    p->index_path = NULL;
done:
    json_decref(root);
    return rc;
}

void hub_plan_free(hub_plan *p) {
    if (!p) return;
    for (size_t i = 0; i < p->n_paths; i++) free(p->paths[i]);
    free(p->paths);
    memset(p, 0, sizeof *p);
}

/* ------------------------------------------------------------------------ */
/* HTTP                                                                     */
/* ------------------------------------------------------------------------ */

typedef enum xfer_abort {
    XFER_ABORT_NONE = 0,
    XFER_ABORT_IO,      /* write to disk failed (abort_errno) */
    XFER_ABORT_TOO_BIG, /* more bytes than the listing promised / buffer cap */
    XFER_ABORT_RANGE,   /* 206 for a range we did not ask for */
} xfer_abort;

/* The per-session HTTP client. */
typedef struct hub_http {
    CURL *curl;
    const hub_options *o;
    const char *endpoint;
    char *auth;          /* "Authorization: Bearer <token>", NULL without token */
    int token_from_env;  /* for messages: where the token came from */
    char curl_err[CURL_ERROR_SIZE];
} hub_http;

/* One transfer: response state (reset at each status line) plus its sink. */
typedef struct hub_xfer {
    long status;
    int64_t cr_start;    /* first byte of Content-Range, -1 if none */
    long retry_after;    /* Retry-After seconds, -1 if none */
    char err_code[64];   /* X-Error-Code */
    char err_msg[256];   /* X-Error-Message */
    int body_started;
    char err_body[512];  /* start of a non-2xx body */
    size_t err_body_len;
    /* memory sink, when fd < 0 */
    char *buf;
    size_t len, cap, max;
    /* file sink */
    int fd;
    int64_t offset;      /* bytes on disk when the request was sent */
    int64_t done;        /* bytes on disk now */
    int64_t expected;    /* listed size, -1 unknown */
    EVP_MD_CTX *md;      /* sha256 of the bytes on disk, NULL when not checked */
    int64_t hashed;      /* bytes fed to md */
    xfer_abort abort_reason;
    int abort_errno;
    /* progress */
    const hub_options *o;
    hub_progress prog;
    double t_start, t_last;
    int64_t start_done;
} hub_xfer;

static void progress_report(hub_xfer *x, int finished) {
    const hub_options *o = x->o;
    if (!o || o->quiet) return;
    double t = fu_now_s();
    if (!finished) { /* the first report comes one interval after the start */
        double ref = x->t_last > 0 ? x->t_last : x->t_start;
        double interval = o->progress ? (o->progress_interval_ms > 0 ? o->progress_interval_ms : 250) / 1000.0 : 10.0;
        if (t - ref < interval) return;
    }
    x->t_last = t;
    double dt = t - x->t_start;
    x->prog.done = x->done;
    x->prog.total = x->expected;
    x->prog.rate = dt > 0.05 ? (double)(x->done - x->start_done) / dt : 0.0;
    x->prog.finished = finished;
    if (o->progress) {
        o->progress(&x->prog, o->progress_user);
    } else if (!finished) {
        char a[32], b[32], r[32];
        FU_INFO("downloading %s: %s / %s (%s/s)", x->prog.path, fu_format_bytes((double)x->done, a, sizeof a),
                x->expected >= 0 ? fu_format_bytes((double)x->expected, b, sizeof b) : "?",
                fu_format_bytes(x->prog.rate, r, sizeof r));
    }
}

static int header_is(const char *line, size_t n, const char *name, const char **value, size_t *vlen) {
    size_t k = strlen(name);
    if (n <= k || strncasecmp(line, name, k) != 0 || line[k] != ':') return 0;
    const char *v = line + k + 1;
    const char *end = line + n;
    while (v < end && (*v == ' ' || *v == '\t')) v++;
    while (end > v && (end[-1] == '\r' || end[-1] == '\n' || end[-1] == ' ' || end[-1] == '\t')) end--;
    *value = v;
    *vlen = (size_t)(end - v);
    return 1;
}

static void copy_header(char *dst, size_t cap, const char *v, size_t n) {
    size_t k = 0;
    for (size_t i = 0; i < n && k + 1 < cap; i++)
        dst[k++] = ((unsigned char)v[i] < 0x20 || v[i] == 0x7f) ? '?' : v[i];
    dst[k] = '\0';
}

static size_t on_header(char *line, size_t size, size_t nitems, void *ud) {
    hub_xfer *x = ud;
    size_t n = size * nitems;
    const char *v;
    size_t vn;
    char tmp[64];
    if (n > 5 && memcmp(line, "HTTP/", 5) == 0) {
        const char *sp = memchr(line, ' ', n);
        x->status = 0;
        if (sp && (size_t)(line + n - sp) > 3)
            for (int i = 1; i <= 3 && sp[i] >= '0' && sp[i] <= '9'; i++) x->status = x->status * 10 + (sp[i] - '0');
        x->cr_start = -1;
        x->retry_after = -1;
        x->err_code[0] = x->err_msg[0] = '\0';
        x->err_body_len = 0;
        x->body_started = 0;
    } else if (header_is(line, n, "Content-Range", &v, &vn)) {
        copy_header(tmp, sizeof tmp, v, vn);
        long long a, b;
        if (sscanf(tmp, "bytes %lld-%lld", &a, &b) == 2 && a >= 0 && b >= a) x->cr_start = a;
    } else if (header_is(line, n, "Retry-After", &v, &vn)) {
        copy_header(tmp, sizeof tmp, v, vn);
        char *end;
        long s = strtol(tmp, &end, 10);
        if (end != tmp && *end == '\0' && s >= 0) x->retry_after = s;
    } else if (header_is(line, n, "X-Error-Code", &v, &vn)) {
        copy_header(x->err_code, sizeof x->err_code, v, vn);
    } else if (header_is(line, n, "X-Error-Message", &v, &vn)) {
        copy_header(x->err_msg, sizeof x->err_msg, v, vn);
    }
    return n;
}

static void xfer_reset_hash(hub_xfer *x) {
    if (!x->md) return;
    EVP_DigestInit_ex(x->md, EVP_sha256(), NULL);
    x->hashed = 0;
}

static size_t on_body(char *data, size_t size, size_t nmemb, void *ud) {
    hub_xfer *x = ud;
    size_t n = size * nmemb;
    if (x->status < 200 || x->status >= 300) {
        size_t room = sizeof x->err_body - 1 - x->err_body_len;
        size_t k = n < room ? n : room;
        memcpy(x->err_body + x->err_body_len, data, k);
        x->err_body_len += k;
        x->err_body[x->err_body_len] = '\0';
        return n;
    }
    if (x->fd < 0) { /* memory sink */
        if (x->len + n > x->max) {
            x->abort_reason = XFER_ABORT_TOO_BIG;
            return 0;
        }
        if (x->len + n + 1 > x->cap) {
            size_t cap = x->cap ? x->cap : 65536;
            while (cap < x->len + n + 1) cap *= 2;
            char *b = realloc(x->buf, cap);
            if (!b) {
                x->abort_reason = XFER_ABORT_IO;
                x->abort_errno = ENOMEM;
                return 0;
            }
            x->buf = b;
            x->cap = cap;
        }
        memcpy(x->buf + x->len, data, n);
        x->len += n;
        x->buf[x->len] = '\0';
        return n;
    }
    if (!x->body_started) {
        x->body_started = 1;
        if (x->status == 206) {
            if (x->cr_start != x->offset) {
                x->abort_reason = XFER_ABORT_RANGE;
                return 0;
            }
        } else if (x->offset > 0) { /* the server ignored Range: start over */
            if (ftruncate(x->fd, 0) != 0 || lseek(x->fd, 0, SEEK_SET) != 0) {
                x->abort_reason = XFER_ABORT_IO;
                x->abort_errno = errno;
                return 0;
            }
            FU_DEBUG("server ignored Range for %s; downloading from the start", x->prog.path);
            x->offset = x->done = x->start_done = 0;
            xfer_reset_hash(x);
        }
    }
    if (x->expected >= 0 && x->done + (int64_t)n > x->expected) {
        x->abort_reason = XFER_ABORT_TOO_BIG;
        return 0;
    }
    if (af_write_all(x->fd, data, n) != 0) {
        x->abort_reason = XFER_ABORT_IO;
        x->abort_errno = errno;
        return 0;
    }
    x->done += (int64_t)n;
    if (x->md && x->hashed + (int64_t)n == x->done) {
        EVP_DigestUpdate(x->md, data, n);
        x->hashed += (int64_t)n;
    }
    progress_report(x, 0);
    return n;
}

static pthread_once_t curl_once = PTHREAD_ONCE_INIT;
static CURLcode curl_init_rc = CURLE_OK;
static void curl_init_once(void) { curl_init_rc = curl_global_init(CURL_GLOBAL_DEFAULT); }

static void http_free(hub_http *h) {
    if (!h) return;
    if (h->curl) curl_easy_cleanup(h->curl);
    if (h->auth) {
        memset(h->auth, 0, strlen(h->auth));
        free(h->auth);
    }
    memset(h, 0, sizeof *h);
}

static int http_init(hub_http *h, const hub_options *o, const char *endpoint) {
    memset(h, 0, sizeof *h);
    h->o = o;
    h->endpoint = endpoint;
    pthread_once(&curl_once, curl_init_once);
    if (curl_init_rc != CURLE_OK)
        return fu_errorf(FU_ERR_NETWORK, "libcurl initialisation failed: %s", curl_easy_strerror(curl_init_rc));
    const char *token = o->token && *o->token ? o->token : NULL;
    if (!token) {
        token = env_nonempty("HF_TOKEN");
        h->token_from_env = token != NULL;
    }
    if (token) {
        for (const char *p = token; *p; p++)
            if ((unsigned char)*p <= 0x20 || (unsigned char)*p >= 0x7f)
                return fu_errorf(FU_ERR_INVALID, "the hub token%s contains spaces or control characters",
                                 h->token_from_env ? " in HF_TOKEN" : "");
        if (!(h->auth = str_printf("Authorization: Bearer %s", token))) return fu_errorf(FU_ERR_NOMEM, "out of memory");
    }
    if (!(h->curl = curl_easy_init())) {
        http_free(h);
        return fu_errorf(FU_ERR_NETWORK, "curl_easy_init failed");
    }
    CURL *c = h->curl;
    curl_easy_setopt(c, CURLOPT_NOSIGNAL, 1L);
    curl_easy_setopt(c, CURLOPT_FOLLOWLOCATION, 0L); /* redirects are followed by hand */
    curl_easy_setopt(c, CURLOPT_UNRESTRICTED_AUTH, 0L);
#if LIBCURL_VERSION_NUM >= 0x075500
    curl_easy_setopt(c, CURLOPT_PROTOCOLS_STR, "http,https");
#else
    curl_easy_setopt(c, CURLOPT_PROTOCOLS, (long)(CURLPROTO_HTTP | CURLPROTO_HTTPS));
#endif
    curl_easy_setopt(c, CURLOPT_CONNECTTIMEOUT, o->connect_timeout_s > 0 ? o->connect_timeout_s : 15L);
    curl_easy_setopt(c, CURLOPT_LOW_SPEED_LIMIT, o->low_speed_limit > 0 ? o->low_speed_limit : 1L);
    curl_easy_setopt(c, CURLOPT_LOW_SPEED_TIME, o->low_speed_time_s > 0 ? o->low_speed_time_s : 60L);
    curl_easy_setopt(c, CURLOPT_TCP_KEEPALIVE, 1L);
    curl_easy_setopt(c, CURLOPT_USERAGENT, "fusion-hub/0.1 (libcurl)");
    curl_easy_setopt(c, CURLOPT_ERRORBUFFER, h->curl_err);
    curl_easy_setopt(c, CURLOPT_HEADERFUNCTION, on_header);
    curl_easy_setopt(c, CURLOPT_WRITEFUNCTION, on_body);
    return FU_OK;
}

/* Scheme, host and port of a URL, for same-origin checks. */
typedef struct url_origin {
    char scheme[16];
    char host[256];
    long port;
} url_origin;

static int origin_of(const char *url, url_origin *o) {
    memset(o, 0, sizeof *o);
    CURLU *u = curl_url();
    char *scheme = NULL, *host = NULL, *port = NULL;
    int ok = u && curl_url_set(u, CURLUPART_URL, url, 0) == CURLUE_OK &&
             curl_url_get(u, CURLUPART_SCHEME, &scheme, 0) == CURLUE_OK &&
             curl_url_get(u, CURLUPART_HOST, &host, 0) == CURLUE_OK &&
             curl_url_get(u, CURLUPART_PORT, &port, CURLU_DEFAULT_PORT) == CURLUE_OK &&
             strlen(scheme) < sizeof o->scheme && strlen(host) < sizeof o->host;
    if (ok) {
        memcpy(o->scheme, scheme, strlen(scheme) + 1);
        memcpy(o->host, host, strlen(host) + 1);
        o->port = strtol(port, NULL, 10);
    }
    curl_free(scheme);
    curl_free(host);
    curl_free(port);
    curl_url_cleanup(u);
    return ok;
}

static int same_origin(const url_origin *a, const url_origin *b) {
    return strcasecmp(a->scheme, b->scheme) == 0 && strcasecmp(a->host, b->host) == 0 && a->port == b->port;
}

/* Transient curl failures worth a retry. */
static int curl_transient(CURLcode rc) {
    switch (rc) {
    case CURLE_COULDNT_RESOLVE_HOST:
    case CURLE_COULDNT_RESOLVE_PROXY:
    case CURLE_COULDNT_CONNECT:
    case CURLE_OPERATION_TIMEDOUT:
    case CURLE_PARTIAL_FILE:
    case CURLE_RECV_ERROR:
    case CURLE_SEND_ERROR:
    case CURLE_GOT_NOTHING:
    case CURLE_SSL_CONNECT_ERROR:
    case CURLE_HTTP2:
    case CURLE_HTTP2_STREAM:
        return 1;
    default:
        return 0;
    }
}

/* GET `url` into `x`, following up to HUB_MAX_REDIRECTS redirects by hand so that
 * the Authorization header goes only to the endpoint's origin (and never again
 * once a redirect has left it), and https is never downgraded to http.
 * FU_OK with x->status holding the final status (any value); FU_ERR_NETWORK for
 * transport failures (*transient says whether a retry may help); FU_ERR_IO /
 * FU_ERR_CHECKSUM / FU_ERR_RANGE when the sink aborted (x->abort_reason). */
static int http_get(hub_http *h, const char *url, hub_xfer *x, int *transient) {
    *transient = 0;
    url_origin home, cur, next;
    if (!origin_of(h->endpoint, &home) || !origin_of(url, &cur))
        return fu_errorf(FU_ERR_INVALID, "cannot parse URL %.300s", url);
    int send_auth = h->auth && same_origin(&home, &cur);
    char *cur_url = strdup(url);
    if (!cur_url) return fu_errorf(FU_ERR_NOMEM, "out of memory");
    int rc = FU_OK;
    CURL *c = h->curl;
    curl_easy_setopt(c, CURLOPT_HEADERDATA, x);
    curl_easy_setopt(c, CURLOPT_WRITEDATA, x);
    /* Compressed bodies only for the API; Range on a file needs identity. */
    curl_easy_setopt(c, CURLOPT_ACCEPT_ENCODING, x->fd < 0 ? "" : NULL);
    for (int hop = 0;; hop++) {
        struct curl_slist *hdrs = NULL, *t;
        char range[64];
        if (send_auth) {
            if (!(t = curl_slist_append(hdrs, h->auth))) goto nomem;
            hdrs = t;
        }
        if (x->fd >= 0 && x->offset > 0) {
            snprintf(range, sizeof range, "Range: bytes=%lld-", (long long)x->offset);
            if (!(t = curl_slist_append(hdrs, range))) {
                curl_slist_free_all(hdrs);
                goto nomem;
            }
            hdrs = t;
        }
        x->status = 0;
        x->body_started = 0;
        x->err_body_len = 0;
        h->curl_err[0] = '\0';
        curl_easy_setopt(c, CURLOPT_URL, cur_url);
        curl_easy_setopt(c, CURLOPT_HTTPGET, 1L);
        curl_easy_setopt(c, CURLOPT_HTTPHEADER, hdrs);
        CURLcode cr = curl_easy_perform(c);
        curl_easy_setopt(c, CURLOPT_HTTPHEADER, NULL);
        curl_slist_free_all(hdrs);
        if (cr != CURLE_OK) {
            if (x->abort_reason == XFER_ABORT_IO) {
                rc = fu_errorf(x->abort_errno == ENOMEM ? FU_ERR_NOMEM : FU_ERR_IO, "%s",
                               strerror(x->abort_errno));
            } else if (x->abort_reason == XFER_ABORT_TOO_BIG) {
                rc = fu_errorf(FU_ERR_CHECKSUM, "the server sent more bytes than expected");
            } else if (x->abort_reason == XFER_ABORT_RANGE) {
                rc = fu_errorf(FU_ERR_RANGE, "the server answered with an unexpected Content-Range");
            } else {
                *transient = curl_transient(cr);
                rc = fu_errorf(FU_ERR_NETWORK, "%s", h->curl_err[0] ? h->curl_err : curl_easy_strerror(cr));
            }
            break;
        }
        if (x->status < 300 || x->status >= 400 || x->status == 304) break;
        char *loc = NULL;
        if (curl_easy_getinfo(c, CURLINFO_REDIRECT_URL, &loc) != CURLE_OK || !loc) {
            rc = fu_errorf(FU_ERR_NETWORK, "HTTP %ld redirect without a Location", x->status);
            break;
        }
        if (hop + 1 >= HUB_MAX_REDIRECTS) {
            rc = fu_errorf(FU_ERR_NETWORK, "too many redirects (more than %d)", HUB_MAX_REDIRECTS);
            break;
        }
        if (!origin_of(loc, &next) || (strcasecmp(next.scheme, "http") != 0 && strcasecmp(next.scheme, "https") != 0)) {
            rc = fu_errorf(FU_ERR_NETWORK, "redirect to an unsupported URL %.300s", loc);
            break;
        }
        if (strcasecmp(cur.scheme, "https") == 0 && strcasecmp(next.scheme, "http") == 0) {
            rc = fu_errorf(FU_ERR_NETWORK, "refusing a redirect from https to http (%.300s)", loc);
            break;
        }
        if (!same_origin(&home, &next)) send_auth = 0; /* never re-armed */
        FU_DEBUG("redirect %ld -> %s://%s:%ld%s", x->status, next.scheme, next.host, next.port,
                 send_auth ? "" : " (no Authorization)");
        char *dup = strdup(loc);
        if (!dup) goto nomem;
        free(cur_url);
        cur_url = dup;
        cur = next;
    }
    free(cur_url);
    return rc;
nomem:
    free(cur_url);
    return fu_errorf(FU_ERR_NOMEM, "out of memory");
}

/* The error for a final non-2xx status. `what` names the object ("repository
 * x@main", "file config.json of x"). Sets *transient for 408/429/5xx. */
static int http_status_error(const hub_http *h, const hub_xfer *x, const char *url, const char *what,
                             int *transient) {
    *transient = x->status == 408 || x->status == 429 || x->status >= 500;
    char msg[256];
    snprintf(msg, sizeof msg, "%s", x->err_msg);
    if (!msg[0] && x->err_body_len > 0 && x->err_body[0] == '{') { /* {"error": "..."} */
        json_t *body = json_loadb(x->err_body, x->err_body_len, 0, NULL);
        const char *e = json_string_value(json_object_get(body, "error"));
        if (e) copy_header(msg, sizeof msg, e, strlen(e));
        json_decref(body);
    }
    char detail[400] = "";
    if (msg[0] || x->err_code[0])
        snprintf(detail, sizeof detail, " [%s%s%s]", x->err_code, x->err_code[0] && msg[0] ? ": " : "", msg);
    const char *tok_hint = !h->auth ? "no token was sent; set HF_TOKEN to a token with access to it"
                           : h->token_from_env ? "the token in HF_TOKEN was rejected or has no access to it"
                                               : "the token given was rejected or has no access to it";
    switch (x->status) {
    case 401:
        return fu_errorf(FU_ERR_AUTH, "401 Unauthorized for %s (%s): it is private, gated or does not exist; %s%s",
                         what, url, tok_hint, detail);
    case 403:
        return fu_errorf(FU_ERR_AUTH,
                         "403 Forbidden for %s (%s): access denied (a gated repo needs its terms accepted on the "
                         "hub); %s%s",
                         what, url, tok_hint, detail);
    case 404:
        if (strcmp(x->err_code, "RevisionNotFound") == 0)
            return fu_errorf(FU_ERR_NOT_FOUND, "revision not found for %s (%s)%s", what, url, detail);
        if (strcmp(x->err_code, "EntryNotFound") == 0)
            return fu_errorf(FU_ERR_NOT_FOUND, "%s not found (%s)%s", what, url, detail);
        return fu_errorf(FU_ERR_NOT_FOUND, "404 Not Found: %s does not exist (repository or revision not found; %s)%s",
                         what, url, detail);
    default:
        return fu_errorf(FU_ERR_NETWORK, "HTTP %ld for %s (%s)%s", x->status, what, url, detail);
    }
}

/* Sleeps before retry number `attempt` (0-based). */
static void backoff(const hub_options *o, int attempt, long retry_after_s) {
    long base = o->retry_base_ms >= 0 ? o->retry_base_ms : 1000;
    long ms = base;
    for (int i = 0; i < attempt && ms < HUB_BACKOFF_CAP_MS; i++) ms *= 2;
    if (ms > HUB_BACKOFF_CAP_MS) ms = HUB_BACKOFF_CAP_MS;
    if (retry_after_s > 0) {
        long ra = (retry_after_s < HUB_RETRY_AFTER_CAP_S ? retry_after_s : HUB_RETRY_AFTER_CAP_S) * 1000;
        if (ra > ms) ms = ra;
    }
    if (ms > 0) fu_sleep_ms(ms);
}

/* URL-escapes `s` into a malloc'ed string; '/' is kept when keep_slash. */
static char *url_escape(const char *s, int keep_slash) {
    size_t n = strlen(s);
    char *out = malloc(3 * n + 1);
    if (!out) return NULL;
    size_t k = 0;
    for (size_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)s[i];
        if ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '-' || c == '.' ||
            c == '_' || c == '~' || (keep_slash && c == '/')) {
            out[k++] = (char)c;
        } else {
            snprintf(out + k, 4, "%%%02X", c);
            k += 3;
        }
    }
    out[k] = '\0';
    return out;
}

/* GET the repo listing for `ref` into a malloc'ed buffer, with retries. */
static int fetch_listing(hub_http *h, const hub_ref *ref, char **out, size_t *out_len) {
    *out = NULL;
    *out_len = 0;
    char *rev = url_escape(ref->revision, 0);
    char *url = rev ? str_printf("%s/api/models/%s/revision/%s?blobs=True", h->endpoint, ref->repo_id, rev) : NULL;
    free(rev);
    if (!url) return fu_errorf(FU_ERR_NOMEM, "out of memory");
    char what[HUB_REPO_ID_MAX + HUB_REVISION_MAX + 32];
    snprintf(what, sizeof what, "repository %s at revision '%s'", ref->repo_id, ref->revision);
    int rc = FU_OK;
    for (int attempt = 0;; attempt++) {
        hub_xfer x = {.fd = -1, .max = HUB_LISTING_MAX, .cr_start = -1, .retry_after = -1};
        int transient = 0;
        rc = http_get(h, url, &x, &transient);
        if (rc == FU_OK && x.status >= 200 && x.status < 300) {
            *out = x.buf ? x.buf : strdup("");
            *out_len = x.len;
            if (!*out) rc = fu_errorf(FU_ERR_NOMEM, "out of memory");
            break;
        }
        free(x.buf);
        if (rc == FU_OK) {
            rc = http_status_error(h, &x, url, what, &transient);
        } else if (rc == FU_ERR_CHECKSUM) {
            rc = fu_errorf(FU_ERR_FORMAT, "the listing of %s is larger than %u bytes", what, HUB_LISTING_MAX);
        } else if (rc == FU_ERR_NETWORK) {
            char msg[512];
            snprintf(msg, sizeof msg, "%s", fu_last_error());
            rc = fu_errorf(FU_ERR_NETWORK, "cannot reach the hub at %s: %s", url, msg);
        }
        if (!transient || attempt >= h->o->max_retries) break;
        FU_WARN("%s; retrying (%d/%d)", fu_last_error(), attempt + 1, h->o->max_retries);
        backoff(h->o, attempt, x.retry_after);
    }
    free(url);
    return rc;
}

/* ------------------------------------------------------------------------ */
/* Downloading one file                                                     */
/* ------------------------------------------------------------------------ */

/* 1 if `final` holds a complete copy of `f` (size as listed; sha256 too if
 * verify). A bad copy is left for the download's rename to replace. */
static int cached_ok(const char *final, const hub_file *f, int verify) {
    struct stat st;
    if (stat(final, &st) != 0 || !S_ISREG(st.st_mode)) return 0;
    if (f->size >= 0 && st.st_size != f->size) {
        FU_WARN("cached %s has %lld bytes, %lld expected", final, (long long)st.st_size, (long long)f->size);
        return 0;
    }
    if (verify && f->sha256[0]) {
        char hex[65];
        if (hub_sha256_file(final, hex) != FU_OK || strcmp(hex, f->sha256) != 0) {
            FU_WARN("cached %s fails its sha256 check", final);
            return 0;
        }
    }
    return 1;
}

typedef struct hub_session {
    const hub_options *o;
    hub_http http;
    const hub_ref *ref;
    const hub_listing *listing;
    const char *snap;
} hub_session;

/* One file's download into `final`: the partial file beside it, the URL, and
 * the transfer with its running hash. */
typedef struct hub_dl {
    hub_session *s;
    const hub_file *f;
    const char *final;
    char *tmp; /* final + ".incomplete" */
    char *url;
    char what[HUB_PATH_MAX + HUB_REPO_ID_MAX + 32]; /* "file P of REPO", for messages */
    hub_xfer x;
    int resumed;     /* the first attempt found a partial file to resume */
    int fresh_retry; /* the one fresh start after a resumed download failed its hash */
    int attempt;     /* retries so far */
} hub_dl;

/* Sets up d and opens (or creates) the partial file. FU_OK, FU_ERR_NOMEM or
 * FU_ERR_IO; dl_close() cleans up either way. */
static int dl_open(hub_dl *d, hub_session *s, const hub_file *f, const char *final, int index, int n_files) {
    *d = (hub_dl){.s = s, .f = f, .final = final};
    d->x = (hub_xfer){.fd = -1, .expected = f->size, .cr_start = -1, .retry_after = -1, .o = s->o};
    d->x.prog.path = f->path;
    d->x.prog.file_index = index;
    d->x.prog.n_files = n_files;
    snprintf(d->what, sizeof d->what, "file %s of %s", f->path, s->ref->repo_id);
    d->tmp = str_printf("%s.incomplete", final);
    char *path_esc = url_escape(f->path, 1);
    if (path_esc)
        d->url = str_printf("%s/%s/resolve/%s/%s", s->http.endpoint, s->ref->repo_id, s->listing->commit, path_esc);
    free(path_esc);
    if (!d->tmp || !d->url || (f->sha256[0] && !(d->x.md = EVP_MD_CTX_new())))
        return fu_errorf(FU_ERR_NOMEM, "out of memory");
    xfer_reset_hash(&d->x);
    d->x.fd = open(d->tmp, O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0644);
    if (d->x.fd < 0) return fu_errorf(FU_ERR_IO, "cannot open %s: %s", d->tmp, strerror(errno));
    d->x.t_start = fu_now_s();
    return FU_OK;
}

/* Empties the partial file. FU_OK or FU_ERR_IO. */
static int dl_truncate(hub_dl *d) {
    if (ftruncate(d->x.fd, 0) != 0) return fu_errorf(FU_ERR_IO, "cannot truncate %s: %s", d->tmp, strerror(errno));
    return FU_OK;
}

/* Before each attempt: takes the partial file as it is (dropping one larger
 * than the listed size), brings the hash up to its end and seeks there.
 * FU_OK or FU_ERR_IO. */
static int dl_rewind(hub_dl *d) {
    hub_xfer *x = &d->x;
    struct stat st;
    if (fstat(x->fd, &st) != 0) return fu_errorf(FU_ERR_IO, "cannot stat %s: %s", d->tmp, strerror(errno));
    int64_t have = st.st_size;
    if (d->f->size >= 0 && have > d->f->size) { /* stale partial larger than the file */
        int rc = dl_truncate(d);
        if (rc) return rc;
        have = 0;
    }
    if (x->md && x->hashed != have) {
        xfer_reset_hash(x);
        int rc = hash_prefix(x->fd, have, x->md, d->tmp);
        if (rc) return rc;
        x->hashed = have;
    }
    if (d->attempt == 0 && have > 0) {
        d->resumed = 1;
        if (!d->s->o->quiet) FU_INFO("resuming %s at byte %lld", d->f->path, (long long)have);
    }
    if (lseek(x->fd, have, SEEK_SET) < 0) return fu_errorf(FU_ERR_IO, "cannot seek in %s: %s", d->tmp, strerror(errno));
    x->offset = x->done = x->start_done = have;
    x->abort_reason = XFER_ABORT_NONE;
    x->t_start = fu_now_s();
    return FU_OK;
}

/* Turns the outcome `rc` of one GET into a status with a message: FU_OK (the
 * bytes are on disk), an error worth retrying (*transient, or *retry_now for
 * one whose partial file must start over) or a final one (*fatal). */
static int dl_classify(hub_dl *d, int rc, int *transient, int *retry_now, int *fatal) {
    hub_xfer *x = &d->x;
    if (rc == FU_OK && x->status == 416) { /* our partial is no prefix of the file */
        *retry_now = 1;
        return fu_errorf(FU_ERR_RANGE, "416 Range Not Satisfiable for %s", d->url);
    }
    if (rc == FU_OK && (x->status < 200 || x->status >= 300))
        return http_status_error(&d->s->http, x, d->url, d->what, transient);
    if (rc == FU_OK && x->status != 206 && !x->body_started && x->offset > 0) {
        /* An empty full answer to a Range request: the file is empty. */
        if ((rc = dl_truncate(d)) != FU_OK) {
            *fatal = 1;
            return rc;
        }
        x->done = 0;
        xfer_reset_hash(x);
        return FU_OK;
    }
    char msg[512];
    snprintf(msg, sizeof msg, "%s", fu_last_error());
    switch (rc) {
    case FU_ERR_RANGE: *retry_now = 1; return rc;
    case FU_ERR_IO: /* the partial file stays for a later resume */
    case FU_ERR_NOMEM: *fatal = 1; return fu_errorf(rc, "writing %s: %s", d->tmp, msg);
    case FU_ERR_CHECKSUM:
        *fatal = 1;
        unlink(d->tmp);
        return fu_errorf(FU_ERR_CHECKSUM, "%s: the server sent more than the %lld bytes listed; removed %s", d->what,
                         (long long)d->f->size, d->tmp);
    case FU_ERR_NETWORK: return fu_errorf(FU_ERR_NETWORK, "downloading %s from %s: %s", d->what, d->url, msg);
    default: return rc;
    }
}

/* One attempt at the missing bytes. FU_OK when they are on disk (or none were
 * missing); FU_OK with *again set when the caller should try once more (the
 * backoff is done); otherwise the final error. */
static int dl_transfer(hub_dl *d, int *again) {
    hub_xfer *x = &d->x;
    const hub_options *o = d->s->o;
    if (d->f->size >= 0 && x->done >= d->f->size) return FU_OK;
    int transient = 0, retry_now = 0, fatal = 0;
    int rc = dl_classify(d, http_get(&d->s->http, d->url, x, &transient), &transient, &retry_now, &fatal);
    if (fatal) return rc;
    if (rc == FU_OK && d->f->size >= 0 && x->done < d->f->size) {
        transient = 1;
        rc = fu_errorf(FU_ERR_NETWORK, "downloading %s: the transfer ended at byte %lld of %lld", d->what,
                       (long long)x->done, (long long)d->f->size);
    }
    if (rc == FU_OK) return FU_OK;
    if (x->status == 416 || rc == FU_ERR_RANGE) {
        int trc = dl_truncate(d);
        if (trc) return trc;
    }
    if (!(transient || retry_now) || d->attempt >= o->max_retries) return rc;
    if (!o->quiet) FU_WARN("%s; retrying (%d/%d)", fu_last_error(), d->attempt + 1, o->max_retries);
    if (!retry_now) backoff(o, d->attempt, x->retry_after);
    d->attempt++;
    *again = 1;
    return FU_OK;
}

/* Compares the sha256 of the `size` bytes on disk with the listed one. On a
 * mismatch after a resume, starts once afresh (FU_OK with *again set);
 * otherwise a mismatch removes the download (FU_ERR_CHECKSUM). */
static int dl_check_sha(hub_dl *d, int64_t size, int *again) {
    hub_xfer *x = &d->x;
    if (x->hashed != size) { /* defensive: rehash what is on disk */
        xfer_reset_hash(x);
        int rc = hash_prefix(x->fd, size, x->md, d->tmp);
        if (rc) return rc;
        x->hashed = size;
    }
    unsigned char dg[EVP_MAX_MD_SIZE];
    unsigned int dn = 0;
    char hex[2 * EVP_MAX_MD_SIZE + 1];
    if (EVP_DigestFinal_ex(x->md, dg, &dn) != 1) return fu_errorf(FU_ERR_INTERNAL, "sha256 final failed");
    hex_encode(dg, dn, hex);
    x->hashed = -1; /* context finished */
    if (!strcmp(hex, d->f->sha256)) return FU_OK;
    unlink(d->tmp);
    if (!d->resumed || d->fresh_retry)
        return fu_errorf(FU_ERR_CHECKSUM, "%s: sha256 mismatch (got %s, the hub lists %s); removed the download",
                         d->what, hex, d->f->sha256);
    /* The resumed prefix may be what is bad: one fresh try. */
    d->fresh_retry = 1;
    d->resumed = 0;
    FU_WARN("%s: sha256 mismatch after resuming; downloading it again from the start", d->what);
    close(x->fd);
    x->fd = open(d->tmp, O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC | O_NOFOLLOW, 0644);
    if (x->fd < 0) return fu_errorf(FU_ERR_IO, "cannot open %s: %s", d->tmp, strerror(errno));
    xfer_reset_hash(x);
    *again = 1;
    return FU_OK;
}

/* Checks the complete download's size and hash (see dl_check_sha for *again). */
static int dl_verify(hub_dl *d, int *again) {
    struct stat st;
    if (fstat(d->x.fd, &st) != 0) return fu_errorf(FU_ERR_IO, "cannot stat %s: %s", d->tmp, strerror(errno));
    d->x.done = st.st_size;
    if (d->f->size >= 0 && st.st_size != d->f->size) {
        unlink(d->tmp);
        return fu_errorf(FU_ERR_CHECKSUM, "%s: size mismatch (%lld bytes, %lld listed); removed the download", d->what,
                         (long long)st.st_size, (long long)d->f->size);
    }
    return d->x.md ? dl_check_sha(d, st.st_size, again) : FU_OK;
}

/* Makes the verified download the final file: sync, close, rename, sync the
 * folder. FU_OK or FU_ERR_IO. */
static int dl_commit(hub_dl *d) {
    if (fsync(d->x.fd) != 0) return fu_errorf(FU_ERR_IO, "cannot sync %s: %s", d->tmp, strerror(errno));
    int closed = close(d->x.fd);
    d->x.fd = -1;
    if (closed != 0) return fu_errorf(FU_ERR_IO, "cannot write %s: %s", d->tmp, strerror(errno));
    if (rename(d->tmp, d->final) != 0)
        return fu_errorf(FU_ERR_IO, "cannot rename %s to %s: %s", d->tmp, d->final, strerror(errno));
    return af_sync_parent(d->final);
}

/* Reports the outcome `rc` and frees d; an empty partial file is removed. */
static void dl_close(hub_dl *d, int rc) {
    const hub_options *o = d->s->o;
    d->x.prog.status = rc;
    progress_report(&d->x, 1);
    if (!o->quiet && !o->progress && rc == FU_OK) {
        char a[32];
        FU_INFO("downloaded %s (%s)", d->f->path, fu_format_bytes((double)d->x.done, a, sizeof a));
    }
    if (d->x.fd >= 0) {
        struct stat st;
        if (rc != FU_OK && fstat(d->x.fd, &st) == 0 && st.st_size == 0) unlink(d->tmp); /* nothing to resume */
        close(d->x.fd);
    }
    EVP_MD_CTX_free(d->x.md);
    free(d->tmp);
    free(d->url);
}

/* Downloads file f (index of n_files, for progress) into `final` through
 * "<final>.incomplete", resuming a partial download, retrying transient
 * failures, verifying size and sha256, then fsync + rename. FU_OK or the
 * final error. */
static int download_file(hub_session *s, const hub_file *f, const char *final, int index, int n_files) {
    hub_dl d;
    int rc = dl_open(&d, s, f, final, index, n_files);
    while (rc == FU_OK) {
        int again = 0;
        if ((rc = dl_rewind(&d)) != FU_OK) break;
        if ((rc = dl_transfer(&d, &again)) != FU_OK || again) continue;
        if ((rc = dl_verify(&d, &again)) != FU_OK || again) continue;
        rc = dl_commit(&d);
        break;
    }
    dl_close(&d, rc);
    return rc;
}

/* ------------------------------------------------------------------------ */
/* Resolving                                                                */
/* ------------------------------------------------------------------------ */

/* Brings the plan's files [from, to) into the snapshot: checks them in offline
 * mode (s->http.curl NULL), downloads what is missing otherwise. */
static int plan_apply(hub_session *s, const hub_plan *p, size_t from, size_t to) {
    int offline = s->http.curl == NULL;
    int n_missing = 0;
    int rc = FU_OK;
    char **finals = calloc(to - from + 1, sizeof *finals);
    int *missing = calloc(to - from + 1, sizeof *missing);
    if (!finals || !missing) {
        rc = fu_errorf(FU_ERR_NOMEM, "out of memory");
        goto done;
    }
    for (size_t i = from; i < to; i++) {
        const hub_file *f = hub_listing_find(s->listing, p->paths[i]);
        if (!f) {
            rc = fu_errorf(FU_ERR_INTERNAL, "planned file %s is not listed", p->paths[i]);
            goto done;
        }
        if (!(finals[i - from] = str_printf("%s/%s", s->snap, f->path))) {
            rc = fu_errorf(FU_ERR_NOMEM, "out of memory");
            goto done;
        }
        if (!cached_ok(finals[i - from], f, !offline && s->o->verify_existing)) {
            if (offline) {
                rc = fu_errorf(FU_ERR_NOT_FOUND, "%s of %s@%s is not in the cache (%s)", f->path,
                               s->ref->repo_id, s->ref->revision, finals[i - from]);
                goto done;
            }
            missing[i - from] = 1;
            n_missing++;
        }
    }
    int k = 0;
    for (size_t i = from; i < to && rc == FU_OK; i++) {
        if (!missing[i - from]) continue;
        const hub_file *f = hub_listing_find(s->listing, p->paths[i]);
        const char *slash = strrchr(finals[i - from], '/');
        char *dir = strndup(finals[i - from], (size_t)(slash - finals[i - from]));
        if (!dir) {
            rc = fu_errorf(FU_ERR_NOMEM, "out of memory");
            break;
        }
        rc = mkdir_p(dir);
        free(dir);
        if (rc == FU_OK) rc = download_file(s, f, finals[i - from], k++, n_missing);
    }
done:
    if (finals)
        for (size_t i = 0; i < to - from; i++) free(finals[i]);
    free(finals);
    free(missing);
    return rc;
}

/* Runs the whole plan: first phase, then the shards of a safetensors index. */
static int plan_run(hub_session *s) {
    hub_plan plan;
    int rc = hub_plan_init(&plan, s->listing, s->o->files, s->o->n_files);
    if (rc != FU_OK) return rc;
    rc = plan_apply(s, &plan, 0, plan.n_paths);
    if (rc == FU_OK && plan.index_path) {
        char *path = str_printf("%s/%s", s->snap, plan.index_path);
        char *text = NULL;
        size_t len = 0;
        size_t before = plan.n_paths;
        rc = path ? mf_read(path, HUB_INDEX_MAX, &text, &len) : fu_errorf(FU_ERR_NOMEM, "out of memory");
        if (rc == FU_OK) rc = hub_plan_add_index(&plan, s->listing, text, len);
        if (rc == FU_OK) rc = plan_apply(s, &plan, before, plan.n_paths);
        free(text);
        free(path);
    }
    hub_plan_free(&plan);
    return rc;
}

/* Takes the repo's lock file (blocking); *fd_out to close() to release it. */
static int lock_repo(const char *repo_dir, const hub_options *o, int *fd_out) {
    *fd_out = -1;
    char *path = str_printf("%s/.lock", repo_dir);
    if (!path) return fu_errorf(FU_ERR_NOMEM, "out of memory");
    int fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0644);
    if (fd < 0) {
        int rc = fu_errorf(FU_ERR_IO, "cannot open lock file %s: %s", path, strerror(errno));
        free(path);
        return rc;
    }
    int r = flock(fd, LOCK_EX | LOCK_NB);
    if (r != 0 && errno == EWOULDBLOCK) {
        if (!o->quiet) FU_INFO("waiting for another process that is downloading into %s", repo_dir);
        while ((r = flock(fd, LOCK_EX)) != 0 && errno == EINTR) {
        }
    }
    if (r != 0) {
        int rc = fu_errorf(FU_ERR_IO, "cannot lock %s: %s", path, strerror(errno));
        close(fd);
        free(path);
        return rc;
    }
    free(path);
    *fd_out = fd;
    return FU_OK;
}

/* Offline: the revision's commit from refs/ (or the revision itself), its saved
 * listing, and a check that every planned file is in the snapshot. */
static int resolve_cached(const hub_options *o, const hub_ref *ref, const char *root, char **out) {
    char *repo_dir = NULL, *refp = NULL, *meta = NULL, *snap = NULL, *text = NULL;
    size_t len = 0;
    char commit[65];
    hub_listing listing = {0};
    int rc = hub_repo_dir(root, ref->repo_id, &repo_dir);
    if (rc != FU_OK) goto done;
    if (hub_is_commit(ref->revision)) {
        memcpy(commit, ref->revision, strlen(ref->revision) + 1);
    } else {
        if (!(refp = refs_path(repo_dir, ref->revision))) {
            rc = fu_errorf(FU_ERR_NOMEM, "out of memory");
            goto done;
        }
        rc = mf_read(refp, 256, &text, &len);
        while (rc == FU_OK && len > 0 && (text[len - 1] == '\n' || text[len - 1] == '\r')) text[--len] = '\0';
        if (rc != FU_OK || !hub_is_commit(text)) {
            rc = fu_errorf(FU_ERR_NOT_FOUND, "%s@%s is not in the cache (%s): %s", ref->repo_id, ref->revision, refp,
                           rc != FU_OK ? "no record of that revision" : "corrupt ref file");
            goto done;
        }
        memcpy(commit, text, len + 1);
        free(text);
        text = NULL;
    }
    if (!(meta = str_printf("%s/meta/%s.json", repo_dir, commit))) {
        rc = fu_errorf(FU_ERR_NOMEM, "out of memory");
        goto done;
    }
    if ((rc = mf_read(meta, HUB_LISTING_MAX, &text, &len)) != FU_OK) {
        rc = fu_errorf(FU_ERR_NOT_FOUND, "%s@%s (commit %s) is not in the cache: no listing at %s", ref->repo_id,
                       ref->revision, commit, meta);
        goto done;
    }
    if ((rc = hub_listing_parse(text, len, &listing)) != FU_OK) goto done;
    if (strcmp(listing.commit, commit) != 0) {
        rc = fu_errorf(FU_ERR_FORMAT, "cached listing %s is for commit %s", meta, listing.commit);
        goto done;
    }
    if ((rc = hub_snapshot_dir(root, ref->repo_id, commit, &snap)) != FU_OK) goto done;
    hub_session s = {.o = o, .ref = ref, .listing = &listing, .snap = snap};
    if ((rc = plan_run(&s)) != FU_OK) goto done;
    *out = snap;
    snap = NULL;
done:
    hub_listing_free(&listing);
    free(repo_dir);
    free(refp);
    free(meta);
    free(snap);
    free(text);
    return rc;
}

/* Online: list the revision, save the listing, fetch what is missing under the
 * repo lock, record refs/<revision>. */
static int resolve_online(const hub_options *o, const hub_ref *ref, const char *root, char **out) {
    char *endpoint = NULL, *repo_dir = NULL, *snap = NULL, *json = NULL, *path = NULL;
    size_t json_len = 0;
    hub_listing listing = {0};
    hub_session s = {.o = o, .ref = ref, .listing = &listing};
    int lock_fd = -1;
    int rc = hub_endpoint(o, &endpoint);
    if (rc != FU_OK) goto done;
    if ((rc = http_init(&s.http, o, endpoint)) != FU_OK) goto done;
    rc = fetch_listing(&s.http, ref, &json, &json_len);
    if (rc == FU_ERR_NETWORK) {
        char msg[1024];
        snprintf(msg, sizeof msg, "%s", fu_last_error());
        if (resolve_cached(o, ref, root, out) == FU_OK) {
            FU_WARN("%s; using the cached snapshot %s", msg, *out);
            rc = FU_OK;
            goto done;
        }
        rc = fu_errorf(FU_ERR_NETWORK, "%s", msg);
    }
    if (rc != FU_OK) goto done;
    if ((rc = hub_listing_parse(json, json_len, &listing)) != FU_OK) goto done;
    if (hub_is_commit(ref->revision) && strcmp(ref->revision, listing.commit) != 0) {
        rc = fu_errorf(FU_ERR_FORMAT, "asked for commit %s, the hub answered for %s", ref->revision, listing.commit);
        goto done;
    }
    if ((rc = hub_repo_dir(root, ref->repo_id, &repo_dir)) != FU_OK) goto done;
    if ((rc = hub_snapshot_dir(root, ref->repo_id, listing.commit, &snap)) != FU_OK) goto done;
    if ((rc = mkdir_p(repo_dir)) != FU_OK) goto done;
    if ((rc = lock_repo(repo_dir, o, &lock_fd)) != FU_OK) goto done;
    if (!(path = str_printf("%s/meta", repo_dir))) goto nomem;
    if ((rc = mkdir_p(path)) != FU_OK) goto done;
    free(path);
    if (!(path = str_printf("%s/meta/%s.json", repo_dir, listing.commit))) goto nomem;
    if ((rc = af_write_buf(path, json, json_len)) != FU_OK) goto done;
    if ((rc = mkdir_p(snap)) != FU_OK) goto done;
    s.snap = snap;
    if (!o->quiet) FU_INFO("%s@%s is commit %s", ref->repo_id, ref->revision, listing.commit);
    if ((rc = plan_run(&s)) != FU_OK) goto done;
    if (!hub_is_commit(ref->revision)) {
        free(path);
        if (!(path = str_printf("%s/refs", repo_dir))) goto nomem;
        if ((rc = mkdir_p(path)) != FU_OK) goto done;
        free(path);
        if (!(path = refs_path(repo_dir, ref->revision))) goto nomem;
        if ((rc = af_write_buf(path, listing.commit, strlen(listing.commit))) != FU_OK) goto done;
    }
    *out = snap;
    snap = NULL;
    goto done;
nomem:
    rc = fu_errorf(FU_ERR_NOMEM, "out of memory");
done:
    if (lock_fd >= 0) close(lock_fd);
    http_free(&s.http);
    hub_listing_free(&listing);
    free(endpoint);
    free(repo_dir);
    free(snap);
    free(json);
    free(path);
    return rc;
}

int hub_resolve(const char *name, const hub_options *opts, char **local_path) {
    if (!local_path) return fu_errorf(FU_ERR_INVALID, "hub_resolve: local_path is NULL");
    *local_path = NULL;
    if (!name || !*name) return fu_errorf(FU_ERR_INVALID, "empty model name");
    struct stat st;
    if (stat(name, &st) == 0) {
        if (!(*local_path = strdup(name))) return fu_errorf(FU_ERR_NOMEM, "out of memory");
        return FU_OK;
    }
    hub_options defaults;
    if (!opts) {
        hub_options_init(&defaults);
        opts = &defaults;
    }
    hub_ref ref;
    int rc = hub_parse_name(name, &ref);
    if (rc != FU_OK) {
        char why[512];
        snprintf(why, sizeof why, "%s", fu_last_error());
        return fu_errorf(FU_ERR_NOT_FOUND, "'%.300s' is not an existing path, nor a hub repo id: %s", name, why);
    }
    for (size_t i = 0; i < opts->n_files; i++)
        if ((rc = hub_validate_filename(opts->files[i])) != FU_OK) return rc;
    char *root = NULL;
    if ((rc = hub_cache_root(opts, &root)) != FU_OK) return rc;
    if (hub_is_offline(opts)) {
        rc = resolve_cached(opts, &ref, root, local_path);
        if (rc != FU_OK) {
            char msg[1024];
            snprintf(msg, sizeof msg, "%s", fu_last_error());
            rc = fu_errorf(rc == FU_ERR_NOMEM ? rc : FU_ERR_NOT_FOUND,
                           "offline mode (HF_HUB_OFFLINE=1) uses the cache only: %s; fetch it online first "
                           "(fusion-fetch %s@%s)",
                           msg, ref.repo_id, ref.revision);
        }
    } else {
        rc = resolve_online(opts, &ref, root, local_path);
    }
    free(root);
    return rc;
}
