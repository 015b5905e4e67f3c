/* hub.h -- resolve "org/name[@revision]" to a local snapshot of a Hugging Face model repo.
 *
 * hub_resolve() turns a model name into a directory: an existing local path is
 * returned as is; a repo id is looked up on the hub (or its mirror), the files a
 * model needs are downloaded into a content-verified cache and the snapshot
 * directory is returned. Downloads go to "<file>.incomplete", resume with HTTP
 * Range, are checked against the hub's size and LFS sha256, fsynced and renamed
 * into place; a per-repo lock file (flock) serializes concurrent processes.
 *
 * Cache layout, under the cache root (see hub_cache_root()):
 *   <org>--<name>/.lock                  flock()ed while a process writes
 *   <org>--<name>/refs/<revision>        commit sha the revision resolved to
 *                                        ('/' in a revision stored as "%2F")
 *   <org>--<name>/meta/<commit>.json     the hub's file listing for that commit
 *   <org>--<name>/snapshots/<commit>/    the model files (what hub_resolve returns)
 * Only verified files are ever renamed into a snapshot, so a file there with the
 * listed size is trusted without rehashing (unless hub_options.verify_existing).
 *
 * Threads and processes: hub_resolve() may run in several threads and
 * processes at once (the lock file orders writers); progress callbacks run on
 * the calling thread. Returned paths are malloc'd and owned by the caller.
 */
#ifndef FU_HUB_H
#define FU_HUB_H

#include <stddef.h>
#include <stdint.h>

#define HUB_DEFAULT_ENDPOINT "https://huggingface.co"
#define HUB_DEFAULT_REVISION "main"
#define HUB_REPO_PART_MAX 96                        /* org or name, like the hub */
#define HUB_REPO_ID_MAX (2 * HUB_REPO_PART_MAX + 2) /* "org/name" + NUL */
#define HUB_REVISION_MAX 256                        /* incl. NUL */
#define HUB_PATH_MAX 1024                           /* repo-relative file path, incl. NUL */

/* One progress report for the file being downloaded. */
typedef struct hub_progress {
    const char *path; /* repo-relative path of the file */
    int file_index;   /* 0-based index among the files this call downloads */
    int n_files;      /* files this call downloads (not counting cached ones) */
    int64_t done;     /* bytes of the file on disk, resumed prefix included */
    int64_t total;    /* expected size, -1 if unknown */
    double rate;      /* bytes/s received in this transfer so far */
    int finished;     /* 1 on the last report for this file (success or not) */
    int status;       /* with finished: FU_OK, or the error that stopped the file */
} hub_progress;

/* Called from inside hub_resolve(), at most every progress_interval_ms per file
 * plus once with finished = 1. `p` is valid only during the call. */
typedef void (*hub_progress_fn)(const hub_progress *p, void *user);

typedef struct hub_options {
    const char *cache_dir; /* cache root; NULL: see hub_cache_root() */
    const char *endpoint;  /* NULL: $HF_ENDPOINT, else HUB_DEFAULT_ENDPOINT */
    const char *token;     /* NULL: $HF_TOKEN; sent as "Authorization: Bearer" to the
                              endpoint's origin only, never across a redirect to another
                              scheme/host/port */
    int offline;           /* -1: $HF_HUB_OFFLINE decides (1/true/yes/on); 0: online;
                              1: cache only, no network */
    const char *const *files; /* extra/explicit repo files (e.g. the .gguf to take) */
    size_t n_files;
    int quiet;                /* 1: no progress, no info logs */
    hub_progress_fn progress; /* NULL: FU_INFO lines per file unless quiet */
    void *progress_user;
    int progress_interval_ms; /* throttle for `progress` */
    int max_retries;          /* retries of a transient failure (5xx, 429, reset, timeout) */
    int retry_base_ms;        /* first backoff; doubles per retry, capped at 30 s */
    long connect_timeout_s;
    long low_speed_time_s;    /* abort a transfer slower than low_speed_limit B/s for */
    long low_speed_limit;     /* this many seconds */
    int verify_existing;      /* 1: rehash (sha256) cached LFS files before trusting them */
} hub_options;

/* Fills `o` with the defaults: everything from the environment, offline -1,
 * 5 retries from 1 s, connect timeout 15 s, abort below 1 KiB/s for 60 s,
 * progress every 250 ms. */
void hub_options_init(hub_options *o);

/* A parsed "org/name[@revision]". */
typedef struct hub_ref {
    char repo_id[HUB_REPO_ID_MAX];   /* "org/name" */
    char revision[HUB_REVISION_MAX]; /* "main" when not given */
} hub_ref;

/* Resolves a model name to a local directory.
 *  - `name` that exists on disk: *local_path = a copy of `name`.
 *  - `name` of the form org/name[@revision]: the snapshot directory, after
 *    downloading what is missing (online) or checking the cache (offline).
 *    What is fetched: config.json, tokenizer.json, tokenizer_config.json
 *    (required), generation_config.json and special_tokens_map.json (if listed),
 *    model.safetensors.index.json and the shards it names, else model.safetensors,
 *    else every top-level *.safetensors; plus opts->files. A repo without
 *    top-level safetensors, or a request naming a .gguf, is fetched in GGUF mode:
 *    the requested .gguf files (with their -0000k-of-0000n siblings), or the
 *    single GGUF model in the repo.
 *  - anything else: FU_ERR_NOT_FOUND.
 * If the listing request fails for network reasons and the revision is cached
 * completely, the cached snapshot is used (with a warning).
 * `opts` may be NULL (defaults). On success *local_path is malloc'ed and owned by
 * the caller. On failure *local_path is NULL and fu_last_error() explains:
 * FU_ERR_AUTH (401/403; mentions HF_TOKEN), FU_ERR_NOT_FOUND (repo, revision or
 * file missing, or not cached in offline mode), FU_ERR_NETWORK, FU_ERR_CHECKSUM
 * (the bad partial file is removed), FU_ERR_IO (disk), FU_ERR_FORMAT (malformed or
 * unsafe hub answer), FU_ERR_INVALID (bad name or options). */
int hub_resolve(const char *name, const hub_options *opts, char **local_path);

/* 1 if `name` is syntactically a repo id with optional "@revision" (it may still
 * also exist as a local path; hub_resolve() checks the disk first), else 0. */
int hub_is_repo_name(const char *name);

/* Parses "org/name[@revision]" into `out`. FU_ERR_INVALID (with a message) for
 * anything that fails hub_validate_repo_id() / hub_validate_revision(). */
int hub_parse_name(const char *name, hub_ref *out);

/* Repo id rules (as the hub's): "org/name", each part 1..96 chars of
 * [A-Za-z0-9._-], not starting or ending with '.' or '-', no "--" or "..".
 * FU_OK or FU_ERR_INVALID. */
int hub_validate_repo_id(const char *repo_id);

/* Revision rules: 1..255 chars of [A-Za-z0-9._/-] (branch, tag, "refs/pr/N",
 * commit sha); no empty, "." or ".." segment, no leading/trailing '/'.
 * FU_OK or FU_ERR_INVALID. */
int hub_validate_revision(const char *revision);

/* Repo-relative file path rules: 1..1023 bytes, '/'-separated segments, none
 * empty, "." or ".."; no leading '/', no '\\', no control characters (< 0x20,
 * 0x7f), no segment ending in ".incomplete". FU_OK or FU_ERR_INVALID. */
int hub_validate_filename(const char *path);

/* 1 for a full commit id (40 or 64 lowercase hex digits), else 0. */
int hub_is_commit(const char *s);

/* The cache root: opts->cache_dir, else $FUSION_CACHE/hub, else
 * $XDG_CACHE_HOME/fusion/hub, else $HOME/.cache/fusion/hub. Trailing '/' removed.
 * *out is malloc'ed (caller frees). FU_ERR_INVALID if none can be determined. */
int hub_cache_root(const hub_options *opts, char **out);

/* The endpoint without trailing '/': opts->endpoint, else $HF_ENDPOINT, else
 * HUB_DEFAULT_ENDPOINT. Must be http:// or https://. *out malloc'ed. */
int hub_endpoint(const hub_options *opts, char **out);

/* "<cache_root>/<org>--<name>" for a valid repo id; *out malloc'ed. */
int hub_repo_dir(const char *cache_root, const char *repo_id, char **out);

/* "<cache_root>/<org>--<name>/snapshots/<commit>"; *out malloc'ed. */
int hub_snapshot_dir(const char *cache_root, const char *repo_id, const char *commit,
                     char **out);

/* 1 when offline: opts->offline if 0/1, else $HF_HUB_OFFLINE in 1/true/yes/on. */
int hub_is_offline(const hub_options *opts);

#endif
