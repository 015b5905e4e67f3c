/* test_gw_store.c -- the gateway's SQLite store: files CRUD, the owner filter, paging (after, limit,
 * order), persistence across a reopen, the schema version, and that a failed insert keeps nothing. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "gw-store.h"
#include "status.h"

/* A fresh database path in a new temporary directory (path[256]). */
static void temp_db(char *path) {
    char dir[] = "/tmp/gw-store-XXXXXX";
    assert_non_null(mkdtemp(dir));
    snprintf(path, 256, "%s/fusion.db", dir);
}

/* A file row "file-<n as 24 hex digits>" of owner. */
static gw_file row(int n, const char *owner) {
    gw_file f = {0};
    snprintf(f.id, sizeof f.id, "file-%024x", n);
    snprintf(f.owner, sizeof f.owner, "%s", owner);
    snprintf(f.filename, sizeof f.filename, "data-%d.jsonl", n);
    snprintf(f.purpose, sizeof f.purpose, "fine-tune");
    snprintf(f.status, sizeof f.status, "processed");
    f.bytes = 100 + n;
    f.created_at = 1700000000 + n;
    f.n_examples = 10 + n;
    return f;
}

/* The ids of a listing of q, joined by ','. */
static void list_ids(gw_store *s, const gw_file_query *q, char *out, size_t cap, bool *more) {
    gw_file *rows;
    size_t n;
    assert_int_equal(gw_store_file_list(s, q, &rows, &n, more), FU_OK);
    out[0] = '\0';
    for (size_t i = 0; i < n; i++)
        snprintf(out + strlen(out), cap - strlen(out), "%s%d", i ? "," : "", (int)strtol(rows[i].id + 5, NULL, 16));
    free(rows);
}

static void test_crud_and_owner(void **state) {
    (void)state;
    char path[256];
    temp_db(path);
    gw_store *s;
    assert_int_equal(gw_store_open(path, &s), FU_OK);
    gw_file a = row(1, "alice"), b = row(2, "bob"), got;
    assert_int_equal(gw_store_file_insert(s, &a), FU_OK);
    assert_int_equal(gw_store_file_insert(s, &b), FU_OK);
    assert_int_equal(gw_store_file_get(s, a.id, "alice", &got), FU_OK);
    assert_string_equal(got.filename, "data-1.jsonl");
    assert_int_equal(got.bytes, 101);
    assert_int_equal(got.n_examples, 11);
    assert_int_equal(gw_store_file_get(s, a.id, "bob", &got), FU_ERR_NOT_FOUND); /* another owner's */
    assert_int_equal(gw_store_file_get(s, a.id, NULL, &got), FU_OK);               /* an admin sees it */
    assert_int_equal(gw_store_file_delete(s, a.id, "bob"), FU_ERR_NOT_FOUND);
    assert_int_equal(gw_store_file_delete(s, a.id, "alice"), FU_OK);
    assert_int_equal(gw_store_file_get(s, a.id, NULL, &got), FU_ERR_NOT_FOUND);
    assert_int_equal(gw_store_file_delete(s, a.id, NULL), FU_ERR_NOT_FOUND);
    gw_store_close(s);
}

static void test_paging(void **state) {
    (void)state;
    char path[256], ids[256];
    temp_db(path);
    gw_store *s;
    bool more;
    assert_int_equal(gw_store_open(path, &s), FU_OK);
    for (int i = 1; i <= 5; i++) {
        gw_file f = row(i, i == 3 ? "bob" : "alice");
        assert_int_equal(gw_store_file_insert(s, &f), FU_OK);
    }
    gw_file_query q = {.owner = "alice", .limit = 10};
    list_ids(s, &q, ids, sizeof ids, &more); /* newest first */
    assert_string_equal(ids, "5,4,2,1");
    assert_false(more);
    q.limit = 2;
    list_ids(s, &q, ids, sizeof ids, &more);
    assert_string_equal(ids, "5,4");
    assert_true(more);
    gw_file four = row(4, "alice");
    q.after = four.id;
    list_ids(s, &q, ids, sizeof ids, &more);
    assert_string_equal(ids, "2,1");
    assert_false(more);
    q = (gw_file_query){.owner = NULL, .limit = 3, .asc = true};
    list_ids(s, &q, ids, sizeof ids, &more); /* an admin: everyone's, oldest first */
    assert_string_equal(ids, "1,2,3");
    assert_true(more);
    gw_file three = row(3, "bob");
    q = (gw_file_query){.owner = "alice", .limit = 3, .after = three.id};
    gw_file *rows;
    size_t n;
    assert_int_equal(gw_store_file_list(s, &q, &rows, &n, &more), FU_ERR_NOT_FOUND); /* bob's file as a cursor */
    q = (gw_file_query){.owner = "alice", .purpose = "batch", .limit = 3};
    list_ids(s, &q, ids, sizeof ids, &more);
    assert_string_equal(ids, "");
    gw_store_close(s);
}

static void test_reopen_and_version(void **state) {
    (void)state;
    char path[256];
    temp_db(path);
    gw_store *s;
    assert_int_equal(gw_store_open(path, &s), FU_OK);
    gw_file a = row(7, "alice"), got;
    assert_int_equal(gw_store_file_insert(s, &a), FU_OK);
    gw_store_close(s);
    assert_int_equal(gw_store_open(path, &s), FU_OK); /* the migrations are not run twice */
    assert_int_equal(gw_store_file_get(s, a.id, "alice", &got), FU_OK);
    assert_string_equal(got.status, "processed");
    gw_store_close(s);
    char cmd[512];
    snprintf(cmd, sizeof cmd, "sqlite3 %s 'PRAGMA user_version = %d' 2>/dev/null", path, gw_store_schema_version() + 1);
    if (system(cmd) == 0) { /* the sqlite3 shell is there: a newer schema is refused */
        assert_int_equal(gw_store_open(path, &s), FU_ERR_UNSUPPORTED);
        assert_null(s);
    }
}

static void test_failed_insert_keeps_nothing(void **state) {
    (void)state;
    char path[256], ids[256];
    temp_db(path);
    gw_store *s;
    bool more;
    assert_int_equal(gw_store_open(path, &s), FU_OK);
    gw_file a = row(1, "alice");
    assert_int_equal(gw_store_file_insert(s, &a), FU_OK);
    gw_file dup = row(1, "alice");
    snprintf(dup.filename, sizeof dup.filename, "other.jsonl");
    assert_int_equal(gw_store_file_insert(s, &dup), FU_ERR_INVALID); /* the id is taken */
    gw_file bad = row(2, "alice");
    bad.bytes = -1; /* refused by the schema */
    assert_int_equal(gw_store_file_insert(s, &bad), FU_ERR_INVALID);
    gw_file bad_status = row(3, "alice");
    snprintf(bad_status.status, sizeof bad_status.status, "weird");
    assert_int_equal(gw_store_file_insert(s, &bad_status), FU_ERR_INVALID);
    gw_file_query q = {.limit = 10};
    list_ids(s, &q, ids, sizeof ids, &more);
    assert_string_equal(ids, "1");
    gw_file got;
    assert_int_equal(gw_store_file_get(s, a.id, NULL, &got), FU_OK);
    assert_string_equal(got.filename, "data-1.jsonl");
    gw_file ok = row(4, "alice"); /* the store still takes writes after a failed one */
    assert_int_equal(gw_store_file_insert(s, &ok), FU_OK);
    gw_store_close(s);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_crud_and_owner),
        cmocka_unit_test(test_paging),
        cmocka_unit_test(test_reopen_and_version),
        cmocka_unit_test(test_failed_insert_keeps_nothing),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
