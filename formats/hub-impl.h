/* hub-impl.h -- hub.c internals exposed for unit tests: the file listing and the download plan.
 *
 * Internal to formats/ (and its tests). Listings and plans are plain values
 * owned by their caller (hub_listing_free, hub_plan_free); no shared state.
 */
#ifndef FU_HUB_IMPL_H
#define FU_HUB_IMPL_H

#include <stddef.h>
#include <stdint.h>

/* One file of a repo as the hub lists it. */
typedef struct hub_file {
    char *path;        /* repo-relative, passed hub_validate_filename() */
    int64_t size;      /* bytes; -1 if the listing did not say */
    char sha256[65];   /* LFS content sha256, lowercase hex; "" for non-LFS files */
} hub_file;

/* The answer of GET /api/models/{repo}/revision/{rev}?blobs=true. */
typedef struct hub_listing {
    char commit[65];   /* "sha": the commit the revision resolved to */
    hub_file *files;   /* "siblings" */
    size_t n_files;
} hub_listing;

/* Parses and validates a listing: "sha" must be a commit id, every sibling's
 * "rfilename" a safe path (one unsafe name rejects the whole answer), sizes
 * non-negative, lfs.sha256 64 hex digits, no duplicates. FU_ERR_FORMAT with a
 * message otherwise. On success `out` owns its memory (hub_listing_free()). */
int hub_listing_parse(const char *json, size_t len, hub_listing *out);
void hub_listing_free(hub_listing *l); /* NULL or zeroed: no-op */

/* The listed file with this exact path, or NULL. */
const hub_file *hub_listing_find(const hub_listing *l, const char *path);

typedef enum hub_weights {
    HUB_WEIGHTS_SAFETENSORS = 0,
    HUB_WEIGHTS_GGUF = 1,
} hub_weights;

/* Which files to fetch, in order. Paths are owned copies. */
typedef struct hub_plan {
    hub_weights weights;
    char **paths;
    size_t n_paths;
    const char *index_path; /* model.safetensors.index.json if its shards are still
                               to be added (points into `paths`), else NULL */
} hub_plan;

/* First-phase plan from a listing and the explicitly requested files (see
 * hub_resolve() for the rules). Requested files must be listed
 * (FU_ERR_NOT_FOUND). FU_ERR_UNSUPPORTED when the repo has neither safetensors
 * nor GGUF weights; FU_ERR_INVALID when several GGUF models need a choice. */
int hub_plan_init(hub_plan *p, const hub_listing *l, const char *const *files,
                  size_t n_files);

/* Adds the shards named by a safetensors index (its "weight_map" values) to the
 * plan and clears p->index_path. Each must be a safe, listed path
 * (FU_ERR_FORMAT otherwise). */
int hub_plan_add_index(hub_plan *p, const hub_listing *l, const char *json, size_t len);

void hub_plan_free(hub_plan *p); /* NULL or zeroed: no-op */

/* Lowercase hex sha256 of a file's contents into hex[65]. FU_ERR_IO on failure. */
int hub_sha256_file(const char *path, char hex[65]);

#endif
