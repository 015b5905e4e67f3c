/* test-files.h -- a scratch directory for a cmocka test group, and small file
 * helpers. Include after <cmocka.h>. The directory lives under $TMPDIR (or
 * /tmp) and is removed with everything in it by the group teardown. */
#ifndef FU_TEST_FILES_H
#define FU_TEST_FILES_H

#include <ftw.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

static char tmpdir[256];

static int tf_rm_one(const char *p, const struct stat *st, int flag, struct FTW *ftw) {
    (void)st;
    (void)flag;
    (void)ftw;
    return remove(p);
}

/* Removes path and everything below it. */
static inline int tf_rm_rf(const char *path) { return nftw(path, tf_rm_one, 16, FTW_DEPTH | FTW_PHYS); }

/* Group setup/teardown: creates and removes tmpdir. */
static inline int tf_setup(void **state) {
    (void)state;
    const char *base = getenv("TMPDIR");
    snprintf(tmpdir, sizeof tmpdir, "%s/fusion-test-XXXXXX", base && *base ? base : "/tmp");
    return mkdtemp(tmpdir) ? 0 : -1;
}

static inline int tf_teardown(void **state) {
    (void)state;
    return tf_rm_rf(tmpdir) == 0 ? 0 : -1;
}

/* out = tmpdir/rel */
static inline void tmp_path(char *out, size_t cap, const char *rel) { snprintf(out, cap, "%s/%s", tmpdir, rel); }

/* Writes n bytes of p to path (created or truncated). */
static inline void write_file(const char *path, const void *p, size_t n) {
    FILE *fp = fopen(path, "wb");
    assert_non_null(fp);
    if (n) assert_int_equal(fwrite(p, 1, n, fp), n);
    assert_int_equal(fclose(fp), 0);
}

#endif
