/* test_shard_join.c -- the shard's membership thread against a stand-in gateway (a fusion.Swarm
 * server on loopback): heartbeats go on while an assigned span loads, the load's result is reported
 * once it ends (the span served, or the failure and its message), and stopping waits for a load. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "fusion.pb-c.h"
#include "rpc.h"
#include "shard-join.h"
#include "status.h"

#define SECRET "test-swarm-secret"
#define WAIT_S 20 /* bound on every wait: a broken thread fails the test instead of hanging it */

/* ---- the stand-in gateway: assigns [0, 4), records what the heartbeats say ---- */

typedef struct gw {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int joins, beats;
    int first, last;               /* the span the last heartbeat reported */
    int failed_first, failed_last; /* and the failure it reported */
    char load_error[200];
    bool leaving;
} gw;

/* ---- the stand-in shard: a load that waits for the test ---- */

typedef struct shard {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    gw *g;
    int first, last;    /* served */
    bool in_load;       /* load() was called and has not returned */
    int beats_at_start; /* g->beats when it was */
    bool release;       /* the test lets it return */
    int rc;             /* what it returns */
    int loads;
} shard;

static void deadline_in(struct timespec *ts, int s) {
    clock_gettime(CLOCK_REALTIME, ts);
    ts->tv_sec += s;
}

static Fusion__SpanAssignment *assignment(void) {
    Fusion__SpanAssignment *sa = malloc(sizeof *sa);
    assert_non_null(sa);
    fusion__span_assignment__init(sa);
    sa->first_block = 0;
    sa->last_block = 4;
    return sa;
}

static int gw_join(void *ctx, const ProtobufCMessage *req, ProtobufCMessage **reply, rpc_status *st) {
    (void)req;
    (void)st;
    gw *g = ctx;
    pthread_mutex_lock(&g->mu);
    g->joins++;
    pthread_cond_broadcast(&g->cv);
    pthread_mutex_unlock(&g->mu);
    Fusion__JoinReply *r = malloc(sizeof *r);
    assert_non_null(r);
    fusion__join_reply__init(r);
    r->member_id = 7;
    r->heartbeat_ms = 50;
    r->span = assignment();
    *reply = &r->base;
    return RPC_OK;
}

static int gw_heartbeat(void *ctx, const ProtobufCMessage *req, ProtobufCMessage **reply, rpc_status *st) {
    gw *g = ctx;
    const Fusion__HeartbeatRequest *h = (const Fusion__HeartbeatRequest *)req;
    if (h->member_id != 7) return rpc_status_setf(st, RPC_NOT_FOUND, "no member %llu", (unsigned long long)h->member_id);
    pthread_mutex_lock(&g->mu);
    g->beats++;
    if (h->status) {
        g->first = h->status->first_block;
        g->last = h->status->last_block;
        g->failed_first = h->status->failed_first;
        g->failed_last = h->status->failed_last;
        snprintf(g->load_error, sizeof g->load_error, "%s", h->status->load_error ? h->status->load_error : "");
    }
    g->leaving = g->leaving || h->leaving;
    pthread_cond_broadcast(&g->cv);
    pthread_mutex_unlock(&g->mu);
    Fusion__HeartbeatReply *r = malloc(sizeof *r);
    assert_non_null(r);
    fusion__heartbeat_reply__init(r);
    r->span = assignment();
    *reply = &r->base;
    return RPC_OK;
}

static int sh_load(void *ctx, int first, int last) {
    shard *s = ctx;
    pthread_mutex_lock(&s->g->mu);
    const int beats = s->g->beats;
    pthread_mutex_unlock(&s->g->mu);
    pthread_mutex_lock(&s->mu);
    s->loads++;
    s->in_load = true;
    s->beats_at_start = beats;
    pthread_cond_broadcast(&s->cv);
    struct timespec ts;
    deadline_in(&ts, WAIT_S);
    while (!s->release && pthread_cond_timedwait(&s->cv, &s->mu, &ts) == 0) {
    }
    int rc = s->rc;
    if (!rc) {
        s->first = first;
        s->last = last;
    }
    s->in_load = false;
    s->release = false;
    pthread_mutex_unlock(&s->mu);
    return rc ? fu_errorf(rc, "no memory for blocks [%d, %d)", first, last) : FU_OK;
}

static void sh_status(void *ctx, shard_join_status *st) {
    shard *s = ctx;
    pthread_mutex_lock(&s->mu);
    st->first = s->first;
    st->last = s->last;
    pthread_mutex_unlock(&s->mu);
}

typedef struct fixture {
    gw g;
    shard s;
    rpc_server *srv;
    char gateway[64];
} fixture;

static fixture *fixture_new(void) {
    fixture *f = calloc(1, sizeof *f);
    assert_non_null(f);
    pthread_mutex_init(&f->g.mu, NULL);
    pthread_cond_init(&f->g.cv, NULL);
    pthread_mutex_init(&f->s.mu, NULL);
    pthread_cond_init(&f->s.cv, NULL);
    f->s.g = &f->g;
    rpc_server_options o = {.address = "127.0.0.1:0", .secret = SECRET, .allow_insecure = true, .n_workers = 2};
    assert_int_equal(rpc_server_new(&o, &f->srv), FU_OK);
    assert_int_equal(rpc_server_add_unary(f->srv, RPC_SWARM_JOIN, &fusion__join_request__descriptor, gw_join, NULL,
                                          &f->g),
                     FU_OK);
    assert_int_equal(rpc_server_add_unary(f->srv, RPC_SWARM_HEARTBEAT, &fusion__heartbeat_request__descriptor,
                                          gw_heartbeat, NULL, &f->g),
                     FU_OK);
    assert_int_equal(rpc_server_start(f->srv), FU_OK);
    snprintf(f->gateway, sizeof f->gateway, "127.0.0.1:%d", rpc_server_port(f->srv));
    return f;
}

static void fixture_free(fixture *f) {
    rpc_server_free(f->srv);
    pthread_cond_destroy(&f->g.cv);
    pthread_mutex_destroy(&f->g.mu);
    pthread_cond_destroy(&f->s.cv);
    pthread_mutex_destroy(&f->s.mu);
    free(f);
}

static shard_join *join_start(fixture *f) {
    shard_join_config cfg = {.gateway = f->gateway,
                             .insecure = true,
                             .secret = SECRET,
                             .address = "127.0.0.1:1",
                             .model_name = "test",
                             .n_layers = 8,
                             .load = sh_load,
                             .status = sh_status,
                             .ctx = &f->s};
    shard_join *j = NULL;
    assert_int_equal(shard_join_start(&cfg, &j), FU_OK);
    return j;
}

/* Waits until the load has started; true if it did within WAIT_S. */
static bool wait_in_load(shard *s) {
    struct timespec ts;
    deadline_in(&ts, WAIT_S);
    pthread_mutex_lock(&s->mu);
    while (!s->in_load && pthread_cond_timedwait(&s->cv, &s->mu, &ts) == 0) {
    }
    bool ok = s->in_load;
    pthread_mutex_unlock(&s->mu);
    return ok;
}

/* Waits until at least `beats` heartbeats arrived; true if they did within WAIT_S. */
static bool wait_beats(gw *g, int beats) {
    struct timespec ts;
    deadline_in(&ts, WAIT_S);
    pthread_mutex_lock(&g->mu);
    while (g->beats < beats && pthread_cond_timedwait(&g->cv, &g->mu, &ts) == 0) {
    }
    bool ok = g->beats >= beats;
    pthread_mutex_unlock(&g->mu);
    return ok;
}

static void release_load(shard *s, int rc) {
    pthread_mutex_lock(&s->mu);
    s->rc = rc;
    s->release = true;
    pthread_cond_broadcast(&s->cv);
    pthread_mutex_unlock(&s->mu);
}

/* Waits until a heartbeat reports the span [first, last) or the failure of [ff, fl); true if one did. */
static bool wait_reported(gw *g, int first, int last, int ff, int fl) {
    struct timespec ts;
    deadline_in(&ts, WAIT_S);
    pthread_mutex_lock(&g->mu);
    while (!(g->first == first && g->last == last && g->failed_first == ff && g->failed_last == fl) &&
           pthread_cond_timedwait(&g->cv, &g->mu, &ts) == 0) {
    }
    bool ok = g->first == first && g->last == last && g->failed_first == ff && g->failed_last == fl;
    pthread_mutex_unlock(&g->mu);
    return ok;
}

/* A stand-in gateway and a membership thread joined to it, its first load under way. */
static fixture *started(shard_join **j) {
    fixture *f = fixture_new();
    *j = join_start(f);
    assert_true(wait_in_load(&f->s));
    return f;
}

/* Three more heartbeats (the assignment repeated in each reply) and still one load. */
static void assert_loaded_once(fixture *f) {
    pthread_mutex_lock(&f->g.mu);
    const int beats = f->g.beats;
    pthread_mutex_unlock(&f->g.mu);
    assert_true(wait_beats(&f->g, beats + 3));
    pthread_mutex_lock(&f->s.mu);
    assert_int_equal(f->s.loads, 1);
    pthread_mutex_unlock(&f->s.mu);
}

/* A load that lasts: the heartbeats go on meanwhile, saying the shard serves nothing yet; once it
 * returns, the next says it serves the span, and the assignment repeated in every reply is not
 * loaded again. */
static void test_heartbeats_while_loading(void **state) {
    (void)state;
    shard_join *j;
    fixture *f = started(&j);
    const int at = f->s.beats_at_start;
    assert_true(wait_beats(&f->g, at + 3)); /* three heartbeats while load() has not returned */
    pthread_mutex_lock(&f->g.mu);
    assert_int_equal(f->g.last, f->g.first); /* nothing served yet */
    pthread_mutex_unlock(&f->g.mu);
    release_load(&f->s, FU_OK);
    assert_true(wait_reported(&f->g, 0, 4, 0, 0));
    assert_loaded_once(f);
    shard_join_stop(j);
    pthread_mutex_lock(&f->g.mu);
    assert_true(f->g.leaving);
    assert_int_equal(f->g.joins, 1);
    pthread_mutex_unlock(&f->g.mu);
    fixture_free(f);
}

/* A load that fails: the heartbeats after it carry the span and the message, and the same
 * assignment is not tried again. */
static void test_failed_load_reported(void **state) {
    (void)state;
    shard_join *j;
    fixture *f = started(&j);
    release_load(&f->s, FU_ERR_NOMEM);
    assert_true(wait_reported(&f->g, 0, 0, 0, 4));
    pthread_mutex_lock(&f->g.mu);
    assert_non_null(strstr(f->g.load_error, "no memory for blocks [0, 4)"));
    pthread_mutex_unlock(&f->g.mu);
    assert_loaded_once(f);
    shard_join_stop(j);
    fixture_free(f);
}

/* Stopping while a span loads waits for the load, then says the shard leaves. */
typedef struct stopper {
    shard_join *j;
    fixture *f;
} stopper;

static void *stop_run(void *arg) {
    stopper *st = arg;
    shard_join_stop(st->j);
    return NULL;
}

static void test_stop_during_load(void **state) {
    (void)state;
    shard_join *j;
    fixture *f = started(&j);
    stopper st = {j, f};
    pthread_t th;
    assert_int_equal(pthread_create(&th, NULL, stop_run, &st), 0);
    release_load(&f->s, FU_OK);
    pthread_join(th, NULL);
    pthread_mutex_lock(&f->g.mu);
    assert_true(f->g.leaving);
    pthread_mutex_unlock(&f->g.mu);
    pthread_mutex_lock(&f->s.mu);
    assert_int_equal(f->s.last, 4); /* the load was not cut short */
    pthread_mutex_unlock(&f->s.mu);
    fixture_free(f);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_heartbeats_while_loading),
        cmocka_unit_test(test_failed_load_reported),
        cmocka_unit_test(test_stop_during_load),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
