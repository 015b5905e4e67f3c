/* test_gw_store.c -- the gateway's SQLite store: files CRUD, the owner filter, paging (after, limit,
 * order), persistence across a reopen, the schema version, and that a failed insert keeps nothing;
 * fine-tuning jobs (owner filter, the runner's next job, an update refused once cancelled, newest-first
 * paging) with their events and checkpoints. */
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

/* A job "ftjob-<n as 24 hex digits>" of owner in status. */
static gw_ftjob *job(int n, const char *owner, const char *status) {
    gw_ftjob *j = calloc(1, sizeof *j);
    assert_non_null(j);
    snprintf(j->id, sizeof j->id, "ftjob-%024x", n);
    snprintf(j->owner, sizeof j->owner, "%s", owner);
    snprintf(j->model, sizeof j->model, "base");
    snprintf(j->training_file, sizeof j->training_file, "file-%024x", n);
    snprintf(j->hyperparameters, sizeof j->hyperparameters, "{\"n_epochs\":3}");
    snprintf(j->lora, sizeof j->lora, "{\"r\":16}");
    snprintf(j->status, sizeof j->status, "%s", status);
    snprintf(j->result_files, sizeof j->result_files, "[]");
    j->created_at = 1700000000 + n;
    return j;
}

static void test_jobs(void **state) {
    (void)state;
    char path[256];
    temp_db(path);
    gw_store *s;
    assert_int_equal(gw_store_open(path, &s), FU_OK);
    gw_ftjob *a = job(1, "alice", "succeeded"), *b = job(2, "alice", "queued"), *c = job(3, "bob", "queued");
    gw_ftjob *got = job(0, "x", "queued");
    assert_int_equal(gw_store_job_insert(s, a), FU_OK);
    assert_int_equal(gw_store_job_insert(s, b), FU_OK);
    assert_int_equal(gw_store_job_insert(s, c), FU_OK);
    assert_int_equal(gw_store_job_insert(s, c), FU_ERR_INVALID); /* a duplicate id */
    assert_int_equal(gw_store_job_get(s, c->id, "alice", got), FU_ERR_NOT_FOUND);
    assert_int_equal(gw_store_job_next(s, NULL, 0, got), FU_OK); /* the oldest job not ended */
    assert_string_equal(got->id, b->id);
    assert_int_equal(gw_store_job_cancel(s, b->id, "bob", got), FU_ERR_NOT_FOUND);
    assert_int_equal(gw_store_job_cancel(s, b->id, "alice", got), FU_OK);
    assert_string_equal(got->status, "cancelled");
    assert_true(got->finished_at > 0);
    snprintf(b->status, sizeof b->status, "succeeded");
    assert_int_equal(gw_store_job_update(s, b), FU_ERR_NOT_FOUND); /* the runner loses to the cancel */
    assert_int_equal(gw_store_job_next(s, NULL, 0, got), FU_OK);
    assert_string_equal(got->id, c->id);
    const char *running[] = {c->id};
    assert_int_equal(gw_store_job_next(s, running, 1, got), FU_ERR_NOT_FOUND); /* another runner has it */
    snprintf(c->status, sizeof c->status, "running");
    c->trained_tokens = 42;
    c->estimated_finish = 1700000000;
    assert_int_equal(gw_store_job_update(s, c), FU_OK);
    assert_int_equal(gw_store_job_get(s, c->id, NULL, got), FU_OK);
    assert_int_equal(got->trained_tokens, 42);
    assert_int_equal(got->estimated_finish, 1700000000);
    gw_page_query q = {"alice", NULL, 1};
    gw_ftjob *rows;
    size_t n;
    bool more;
    assert_int_equal(gw_store_job_list(s, &q, &rows, &n, &more), FU_OK);
    assert_true(n == 1 && more && !strcmp(rows[0].id, b->id)); /* newest first */
    char cursor[sizeof rows[0].id];
    snprintf(cursor, sizeof cursor, "%s", rows[0].id);
    q.after = cursor;
    free(rows);
    assert_int_equal(gw_store_job_list(s, &q, &rows, &n, &more), FU_OK);
    assert_true(n == 1 && !more && !strcmp(rows[0].id, a->id));
    free(rows);
    q = (gw_page_query){"alice", c->id, 10}; /* another owner's job as the cursor */
    assert_int_equal(gw_store_job_list(s, &q, &rows, &n, &more), FU_ERR_NOT_FOUND);
    free(a), free(b), free(c), free(got);
    gw_store_close(s);
}

static void test_events_and_checkpoints(void **state) {
    (void)state;
    char path[256];
    temp_db(path);
    gw_store *s;
    assert_int_equal(gw_store_open(path, &s), FU_OK);
    gw_ftjob *j = job(1, "alice", "running");
    assert_int_equal(gw_store_job_insert(s, j), FU_OK);
    for (int i = 0; i < 3; i++) {
        gw_ftevent e = {.created_at = i};
        snprintf(e.id, sizeof e.id, "ftevent-%d", i);
        snprintf(e.job_id, sizeof e.job_id, "%s", j->id);
        snprintf(e.level, sizeof e.level, "info");
        snprintf(e.type, sizeof e.type, i ? "metrics" : "message");
        snprintf(e.message, sizeof e.message, "step %d", i);
        if (i) snprintf(e.data, sizeof e.data, "{\"step\": %d, \"train_loss\": 1.5}", 10 * i);
        assert_int_equal(gw_store_event_insert(s, &e), FU_OK);
    }
    int64_t last = -1;
    assert_int_equal(gw_store_event_last_step(s, j->id, &last), FU_OK);
    assert_int_equal(last, 20); /* the metrics events' largest step */
    assert_int_equal(gw_store_event_last_step(s, "ftjob-none", &last), FU_OK);
    assert_int_equal(last, 0);
    gw_ftevent bad = {0};
    snprintf(bad.id, sizeof bad.id, "ftevent-x");
    snprintf(bad.job_id, sizeof bad.job_id, "ftjob-none"); /* no such job: the foreign key */
    snprintf(bad.type, sizeof bad.type, "message");
    assert_int_equal(gw_store_event_insert(s, &bad), FU_ERR_INVALID);
    gw_ftckpt c = {.step_number = 4, .created_at = 5};
    snprintf(c.id, sizeof c.id, "ftckpt-1");
    snprintf(c.job_id, sizeof c.job_id, "%s", j->id);
    snprintf(c.metrics, sizeof c.metrics, "{}");
    snprintf(c.model, sizeof c.model, "ft:base:fusion::%s:ckpt-step-4", j->id);
    assert_int_equal(gw_store_ckpt_insert(s, &c), FU_OK);
    gw_page_query q = {j->id, NULL, 2};
    gw_ftevent *ev;
    gw_ftckpt *ck;
    size_t n;
    bool more;
    assert_int_equal(gw_store_event_list(s, &q, &ev, &n, &more), FU_OK);
    assert_true(n == 2 && more && !strcmp(ev[0].id, "ftevent-2") && !strcmp(ev[1].type, "metrics"));
    free(ev);
    assert_int_equal(gw_store_ckpt_list(s, &q, &ck, &n, &more), FU_OK);
    assert_true(n == 1 && !more && ck[0].step_number == 4);
    free(ck);
    free(j);
    gw_store_close(s);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_crud_and_owner),
        cmocka_unit_test(test_paging),
        cmocka_unit_test(test_reopen_and_version),
        cmocka_unit_test(test_failed_insert_keeps_nothing),
        cmocka_unit_test(test_jobs),
        cmocka_unit_test(test_events_and_checkpoints),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
