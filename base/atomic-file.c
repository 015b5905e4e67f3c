/* atomic-file.c -- whole files written through a temporary file, fsync and rename. */
#include "atomic-file.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "status.h"

int af_sync_parent(const char *path) {
    const char *slash = strrchr(path, '/');
    char *dir = slash ? strndup(path, slash == path ? 1 : (size_t)(slash - path)) : strdup(".");
    if (!dir) return fu_errorf(FU_ERR_NOMEM, "out of memory");
    int fd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    int rc = FU_OK;
    if (fd < 0 || fsync(fd) != 0)
        rc = fu_errorf(FU_ERR_IO, "cannot sync directory %s: %s", dir, strerror(errno));
    if (fd >= 0) close(fd);
    free(dir);
    return rc;
}

int af_write_all(int fd, const void *data, size_t len) {
    const char *p = data;
    while (len > 0) {
        ssize_t w = write(fd, p, len);
        if (w < 0) {
            if (errno == EINTR) continue;
            return -1;
        }
        p += w;
        len -= (size_t)w;
    }
    return 0;
}

/* Writes the pieces to a new file `tmp` and syncs it. */
static int af_write_tmp(const char *tmp, const af_piece *pieces, size_t n) {
    int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_NOFOLLOW, 0644);
    if (fd < 0) return fu_errorf(FU_ERR_IO, "cannot create %s: %s", tmp, strerror(errno));
    int rc = FU_OK;
    for (size_t i = 0; i < n && rc == FU_OK; i++)
        if (af_write_all(fd, pieces[i].data, pieces[i].len) != 0)
            rc = fu_errorf(FU_ERR_IO, "cannot write %s: %s", tmp, strerror(errno));
    if (rc == FU_OK && fsync(fd) != 0)
        rc = fu_errorf(FU_ERR_IO, "cannot sync %s: %s", tmp, strerror(errno));
    if (close(fd) != 0 && rc == FU_OK)
        rc = fu_errorf(FU_ERR_IO, "cannot write %s: %s", tmp, strerror(errno));
    return rc;
}

int af_write(const char *path, const af_piece *pieces, size_t n) {
    size_t cap = strlen(path) + 32;
    char *tmp = malloc(cap);
    if (!tmp) return fu_errorf(FU_ERR_NOMEM, "out of memory");
    snprintf(tmp, cap, "%s.tmp.%ld", path, (long)getpid());
    int rc = af_write_tmp(tmp, pieces, n);
    if (rc == FU_OK && rename(tmp, path) != 0)
        rc = fu_errorf(FU_ERR_IO, "cannot rename %s to %s: %s", tmp, path, strerror(errno));
    if (rc != FU_OK) unlink(tmp);
    else rc = af_sync_parent(path);
    free(tmp);
    return rc;
}

int af_write_buf(const char *path, const void *data, size_t len) {
    af_piece p = {data, len};
    return af_write(path, &p, 1);
}
