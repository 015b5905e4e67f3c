/* atomic-file.h -- whole files written atomically: a temporary file, fsync, rename, fsync of the directory.
 *
 * A reader of the final path sees either the old file or the complete new one,
 * never a partial write, and a failed write leaves no temporary file behind.
 * Stateless: any number of threads may write different paths at once (two
 * writers of one path race, and the last rename wins). The caller keeps
 * ownership of everything it passes.
 */
#ifndef FU_ATOMIC_FILE_H
#define FU_ATOMIC_FILE_H

#include <stddef.h>

/* One piece of a file's contents: `len` bytes at `data`. */
typedef struct af_piece {
    const void *data;
    size_t len;
} af_piece;

/* Writes the `n` pieces, in order, as the contents of `path`: to
 * "PATH.tmp.PID" (created 0644, never through a symlink), fsync, rename over
 * `path`, fsync of its directory. FU_OK, FU_ERR_IO with a message naming the
 * file and errno's text (the temporary file is removed then), or
 * FU_ERR_NOMEM. */
int af_write(const char *path, const af_piece *pieces, size_t n);

/* af_write() of one piece. */
int af_write_buf(const char *path, const void *data, size_t len);

/* fsync()s the directory holding `path` (after a rename into it). FU_OK or
 * FU_ERR_IO naming the directory. */
int af_sync_parent(const char *path);

/* Writes all `len` bytes to fd, retrying short writes and EINTR. 0, or -1
 * with errno set. */
int af_write_all(int fd, const void *data, size_t len);

#endif
