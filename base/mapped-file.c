/* mapped-file.c -- read-only, private memory mappings of whole files. */
#include "mapped-file.h"

#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "status.h"

int mf_open_regular(const char *path, uint64_t max, int *fd_out, uint64_t *size) {
    *fd_out = -1;
    *size = 0;
    /* O_NONBLOCK: opening a FIFO for reading would otherwise wait for a writer */
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOCTTY);
    if (fd < 0)
        return fu_errorf(errno == ENOENT ? FU_ERR_NOT_FOUND : FU_ERR_IO, "%s: cannot open: %s", path,
                         strerror(errno));
    struct stat st;
    int rc = FU_OK;
    if (fstat(fd, &st) != 0)
        rc = fu_errorf(FU_ERR_IO, "%s: cannot stat: %s", path, strerror(errno));
    else if (S_ISDIR(st.st_mode))
        rc = fu_errorf(FU_ERR_IO, "%s: is a directory, not a file", path);
    else if (!S_ISREG(st.st_mode))
        rc = fu_errorf(FU_ERR_IO, "%s: not a regular file (a FIFO, socket or device)", path);
    else if (st.st_size < 0 || (uint64_t)st.st_size > max)
        rc = fu_errorf(FU_ERR_IO, "%s: file too large (%lld bytes, at most %llu)", path,
                       (long long)st.st_size, (unsigned long long)max);
    else if (fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) & ~O_NONBLOCK) != 0)
        rc = fu_errorf(FU_ERR_IO, "%s: cannot clear O_NONBLOCK: %s", path, strerror(errno));
    if (rc) {
        close(fd);
        return rc;
    }
    *fd_out = fd;
    *size = (uint64_t)st.st_size;
    return FU_OK;
}

int mf_read(const char *path, size_t max, char **out, size_t *len) {
    *out = NULL;
    *len = 0;
    int fd;
    uint64_t size;
    int rc = mf_open_regular(path, max, &fd, &size);
    if (rc) return rc;
    char *buf = malloc((size_t)size + 1);
    if (!buf) {
        close(fd);
        return fu_errorf(FU_ERR_NOMEM, "%s: out of memory", path);
    }
    size_t got = 0;
    while (got < (size_t)size) {
        ssize_t r = read(fd, buf + got, (size_t)size - got);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) {
            int e = r < 0 ? errno : EIO;
            close(fd);
            free(buf);
            return fu_errorf(FU_ERR_IO, "%s: cannot read: %s", path, strerror(e));
        }
        got += (size_t)r;
    }
    close(fd);
    buf[got] = '\0';
    *out = buf;
    *len = got;
    return FU_OK;
}

int mf_open(mf_file *mf, const char *path) {
    memset(mf, 0, sizeof *mf);
    int fd;
    uint64_t size;
    int rc = mf_open_regular(path, (uint64_t)SIZE_MAX, &fd, &size);
    if (rc == FU_ERR_NOT_FOUND) return FU_ERR_IO; /* the message is set; callers expect FU_ERR_IO */
    if (rc) return rc;
    mf->path = strdup(path);
    if (!mf->path) {
        rc = fu_errorf(FU_ERR_NOMEM, "%s: out of memory", path);
        goto err;
    }
    mf->size = (size_t)size;
    if (mf->size > 0) {
        void *p = mmap(NULL, mf->size, PROT_READ, MAP_PRIVATE, fd, 0);
        if (p == MAP_FAILED) {
            rc = fu_errorf(FU_ERR_IO, "%s: cannot map %zu bytes: %s", path, mf->size,
                           strerror(errno));
            goto err;
        }
        mf->data = p;
    }
    close(fd); /* the mapping keeps the file alive */
    return FU_OK;
err:
    close(fd);
    free(mf->path);
    memset(mf, 0, sizeof *mf);
    return rc;
}

void mf_close(mf_file *mf) {
    if (!mf) return;
    if (mf->data) munmap((void *)mf->data, mf->size);
    free(mf->path);
    memset(mf, 0, sizeof *mf);
}

void mf_prefetch(const mf_file *mf, uint64_t off, uint64_t len) {
    if (!mf || !mf->data || off >= mf->size) return;
    if (len > mf->size - off) len = mf->size - off;
    long page = sysconf(_SC_PAGESIZE);
    uint64_t start = off - off % (uint64_t)(page > 0 ? page : 4096);
    (void)madvise((void *)(mf->data + start), (size_t)(off + len - start), MADV_WILLNEED);
}

void mf_release(const mf_file *mf, const void *p, size_t n) {
    if (!mf || !mf->data || !p) return;
    uintptr_t lo = (uintptr_t)p, hi = lo + n, mlo = (uintptr_t)mf->data, mhi = mlo + mf->size;
    if (hi < lo || lo < mlo || hi > mhi) return;
    long ps = sysconf(_SC_PAGESIZE);
    uintptr_t page = ps > 0 ? (uintptr_t)ps : 4096;
    lo = (lo + page - 1) / page * page;
    hi = hi / page * page;
    if (hi > lo) (void)madvise((void *)lo, hi - lo, MADV_DONTNEED);
}

static int mf_range_cmp(const void *pa, const void *pb) {
    const mf_range *a = pa, *b = pb;
    if (a->begin != b->begin) return a->begin < b->begin ? -1 : 1;
    if (a->end != b->end) return a->end < b->end ? -1 : 1;
    return 0;
}

int mf_ranges_overlap(mf_range *ranges, size_t n, int64_t *a, int64_t *b) {
    if (n < 2) return 0;
    qsort(ranges, n, sizeof *ranges, mf_range_cmp);
    /* `far` is the non-empty range seen so far that ends last. */
    const mf_range *far = NULL;
    for (size_t i = 0; i < n; i++) {
        const mf_range *r = &ranges[i];
        if (r->begin == r->end) continue;
        if (far && r->begin < far->end) {
            *a = far->id;
            *b = r->id;
            return 1;
        }
        if (!far || r->end > far->end) far = r;
    }
    return 0;
}
