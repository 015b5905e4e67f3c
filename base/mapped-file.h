/* mapped-file.h -- read-only, private memory mappings of whole files (model weights).
 *
 * An mf_file owns its mapping until mf_close(); the mapped bytes never change,
 * so any number of threads may read them at once.
 */
#ifndef FU_MAPPED_FILE_H
#define FU_MAPPED_FILE_H

#include <stddef.h>
#include <stdint.h>

/* A file mapped PROT_READ / MAP_PRIVATE. Pages are only read in when touched,
 * so a process that uses a few tensors of a large file only pages in those. */
typedef struct mf_file {
    char *path;          /* owned copy of the path given to mf_open */
    const uint8_t *data; /* the mapping; NULL when size == 0 */
    size_t size;         /* file size in bytes */
} mf_file;

/* Maps `path` read-only into *mf (which the caller provides; its previous
 * contents are ignored). Fails with FU_ERR_IO (missing/unreadable file, a
 * directory, FIFO, socket or device: never blocks on one) naming the path; a
 * zero-length file succeeds with data == NULL and size == 0 (format readers
 * reject it with their own message). On failure
 * *mf is left zeroed, so mf_close() on it is a no-op. */
int mf_open(mf_file *mf, const char *path);

/* Opens `path` for reading, only if it is a regular file of at most `max`
 * bytes: never blocks on a FIFO or device (it is opened O_NONBLOCK and
 * checked with fstat). On success *fd (the caller closes it) and *size are
 * set; else *fd = -1 and the status is FU_ERR_NOT_FOUND (absent) or
 * FU_ERR_IO (unreadable, a directory, FIFO, socket or device, too large),
 * with a message naming the path. */
int mf_open_regular(const char *path, uint64_t max, int *fd, uint64_t *size);

/* Reads a whole regular file of at most `max` bytes (config files,
 * tokenizer.json) into a malloc'ed, NUL-terminated buffer (*out, freed by the
 * caller; *len excludes the NUL). Statuses as mf_open_regular; on failure
 * *out = NULL. */
int mf_read(const char *path, size_t max, char **out, size_t *len);

/* Unmaps and frees what mf_open() set up, and zeroes *mf. NULL, a zeroed or
 * an already closed mf_file are no-ops. */
void mf_close(mf_file *mf);

/* Advises the kernel that [off, off + len) of the mapping will be needed soon
 * (MADV_WILLNEED), clipped to the file. Purely a hint: errors are ignored. */
void mf_prefetch(const mf_file *mf, uint64_t off, uint64_t len);

/* Gives back the resident pages of [p, p + n), where that lies inside the
 * mapping (only whole pages; anything else is left alone). The mapping is
 * read-only, so nothing is lost: a later read pages the data in again. Used
 * once a tensor has been copied elsewhere (repacked weights). */
void mf_release(const mf_file *mf, const void *p, size_t n);

/* A half-open byte range [begin, end) of a file with the caller's id. */
typedef struct mf_range {
    uint64_t begin, end;
    int64_t id;
} mf_range;

/* Sorts `ranges` by begin and looks for two non-empty ranges that overlap.
 * Returns 1 and sets *a, *b to the ids of the first such pair found, or 0 if
 * all non-empty ranges are disjoint. Empty ranges (begin == end) never overlap. */
int mf_ranges_overlap(mf_range *ranges, size_t n, int64_t *a, int64_t *b);

/* Overflow-checked arithmetic on sizes: return 0 and store the result, or
 * return -1 (leaving *out unchanged) when it does not fit in 64 bits. */
static inline int mf_add_u64(uint64_t a, uint64_t b, uint64_t *out) {
    return __builtin_add_overflow(a, b, out) ? -1 : 0;
}
static inline int mf_mul_u64(uint64_t a, uint64_t b, uint64_t *out) {
    return __builtin_mul_overflow(a, b, out) ? -1 : 0;
}

#endif
