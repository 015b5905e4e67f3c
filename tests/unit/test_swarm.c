/* test_swarm.c -- the gateway's membership decisions: join placement, spare selection, promotion of a spare when
 * a server leaves, retirement on missed heartbeats, link figures, and the /v1/swarm document (no network). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <math.h>
#include <stdio.h>
#include <string.h>

#include <pthread.h>
#include <time.h>

#include "fusion.pb-c.h"
#include "gw-swarm.h"
#include "gw.h"
#include "router.h"
#include "rpc.h"
#include "shard-join.h"
#include "shard-rpc.h"
#include "status.h"

/* A server of `maxk` blocks running block_tps / k tokens/s with k blocks, span [first, last). */
static int add_server(rt_swarm *sw, const char *name, int maxk, double block_tps, int first, int last) {
    double tput[64];
    for (int k = 1; k <= maxk; k++) tput[k - 1] = block_tps / k;
    rt_server d = {0};
    snprintf(d.name, sizeof d.name, "%s", name);
    snprintf(d.address, sizeof d.address, "%s", name);
    d.state = first == last ? RT_SERVER_SPARE : RT_SERVER_ACTIVE;
    d.first = first;
    d.last = last;
    d.n_tput = maxk;
    d.tput = tput;
    int id = rt_swarm_add_server(sw, &d);
    assert_true(id >= 0);
    return id;
}

/* Every link present and fast, so compute bounds the flow. */
static void link_all(rt_swarm *sw) {
    for (int i = 0; i < sw->n_servers; i++) {
        rt_swarm_set_link(sw, RT_SOURCE, i, 1e12, 1e-4);
        rt_swarm_set_link(sw, i, RT_SINK, 1e12, 1e-4);
        for (int j = 0; j < sw->n_servers; j++)
            if (i != j) rt_swarm_set_link(sw, i, j, 1e12, 1e-4);
    }
}

static void test_pick_spare(void **st) {
    (void)st;
    rt_model model = {.name = "t", .n_layers = 10, .token_bytes = 2, .act_bytes = 2};
    rt_swarm sw;
    assert_int_equal(rt_swarm_init(&sw, &model), FU_OK);
    int a = add_server(&sw, "a", 5, 50, 0, 5); /* 10 tokens/s: the bottleneck (b runs 20) */
    int b = add_server(&sw, "b", 5, 100, 5, 10);
    int small = add_server(&sw, "small", 3, 100, 0, 0);
    int big = add_server(&sw, "big", 5, 100, 0, 0);
    link_all(&sw);
    (void)a;
    int spares[2] = {small, big}, f = -1, l = -1;
    /* covered, and no more spares than wanted: they wait */
    assert_int_equal(gw_pick_spare(&sw, spares, 2, 2, 0.05, NULL, &f, &l), -1);
    assert_int_equal(gw_pick_spare(&sw, spares, 0, 0, 0.05, NULL, &f, &l), -1);
    /* one spare too many: the one adding the most flow serves, beside the bottleneck a */
    assert_int_equal(gw_pick_spare(&sw, spares, 2, 1, 0.05, NULL, &f, &l), 1);
    assert_int_equal(f, 0);
    assert_int_equal(l, 5);
    /* ... unless the gain is under the threshold */
    assert_int_equal(gw_pick_spare(&sw, spares, 2, 1, 10.0, NULL, &f, &l), -1);
    /* b leaves: [5, 10) is uncovered; the spare covering all of it goes, whatever the spare count */
    assert_int_equal(rt_swarm_remove_server(&sw, b), FU_OK);
    assert_int_equal(gw_pick_spare(&sw, spares, 2, 5, 0.05, NULL, &f, &l), 1);
    assert_int_equal(f, 5);
    assert_int_equal(l, 10);
    /* only the small one: it covers what it can of the gap */
    assert_int_equal(gw_pick_spare(&sw, spares, 1, 5, 0.05, NULL, &f, &l), 0);
    assert_int_equal(l - f, 3);
    assert_true(f >= 5 && l <= 10);
    rt_swarm_free(&sw);
}

/* A crowd of spares: only the most capable few are weighed (each costs a max flow per window, under
 * the swarm's lock), so the most capable one is found wherever it stands in the list, and a
 * decision among 200 spares costs what one among 4 does. */
static void test_pick_spare_among_many(void **st) {
    (void)st;
    rt_model model = {.name = "t", .n_layers = 10, .token_bytes = 2, .act_bytes = 2};
    rt_swarm sw;
    assert_int_equal(rt_swarm_init(&sw, &model), FU_OK);
    add_server(&sw, "a", 5, 100, 0, 5);
    enum { N = 200 };
    int spares[N], f = -1, l = -1;
    char name[32];
    for (int i = 0; i < N; i++) {
        snprintf(name, sizeof name, "s%d", i);
        spares[i] = add_server(&sw, name, i == 150 ? 5 : 2, i == 120 ? 500 : 100, 0, 0);
    }
    link_all(&sw);
    /* [5, 10) uncovered: s150, the only spare holding 5 blocks, covers it all */
    assert_int_equal(gw_pick_spare(&sw, spares, N, 0, 0.05, NULL, &f, &l), 150);
    assert_int_equal(f, 5);
    assert_int_equal(l, 10);
    /* without s150, the fastest of the 2-block spares (s120) is weighed and goes */
    spares[150] = spares[0];
    assert_int_equal(gw_pick_spare(&sw, spares, N, 0, 0.05, NULL, &f, &l), 120);
    assert_int_equal(l - f, 2);
    rt_swarm_free(&sw);
}

static gw_member_report report(const char *address, int max_blocks, int first, int last) {
    gw_member_report r;
    memset(&r, 0, sizeof r);
    snprintf(r.address, sizeof r.address, "%s", address);
    r.n_layers = 30;
    r.first = first;
    r.last = last;
    snprintf(r.device, sizeof r.device, "cpu");
    snprintf(r.dtype, sizeof r.dtype, "q4_1");
    r.block_tokens_per_s = 600;
    r.tokens_per_s = last > first ? 600.0 / (last - first) : 0;
    r.max_blocks = max_blocks;
    r.total_kv = last > first ? 1 << 20 : 0;
    r.free_kv = r.total_kv;
    r.kv_per_pos = last > first ? 64 : 0;
    return r;
}

/* The span of the server at `address` in the /v1/swarm document, and its state. */
static const char *server_state(json_t *doc, const char *address, json_t **span) {
    size_t i;
    json_t *sv;
    json_array_foreach(json_object_get(doc, "servers"), i, sv) {
        if (!strcmp(json_string_value(json_object_get(sv, "address")), address)) {
            if (span) *span = json_object_get(sv, "span");
            return json_string_value(json_object_get(sv, "state"));
        }
    }
    return NULL;
}

/* Rule 6's choice: a move raising the flow by min_gain, never one that uncovers a block. */
static void test_pick_move(void **st) {
    (void)st;
    rt_model model = {.name = "t", .n_layers = 10, .token_bytes = 2, .act_bytes = 2};
    rt_swarm sw;
    assert_int_equal(rt_swarm_init(&sw, &model), FU_OK);
    int f1 = add_server(&sw, "f1", 5, 100, 0, 5), f1b = add_server(&sw, "f1b", 5, 100, 0, 5);
    int f2 = add_server(&sw, "f2", 5, 100, 5, 10);
    int j = add_server(&sw, "j", 5, 100, 0, 5); /* three on [0, 5), one on [5, 10): flow 20 */
    link_all(&sw);
    double flow = rt_max_flow(&sw, NULL);
    assert_true(fabs(flow - 20) < 1e-6);
    int movable[2] = {j, f2}, f = -1, l = -1;
    assert_int_equal(gw_pick_move(&sw, movable, 1, 0.05, NULL, &f, &l), 0);
    assert_int_equal(f, 5);
    assert_int_equal(l, 10);
    rt_swarm moved;
    assert_int_equal(rt_swarm_clone(&moved, &sw), FU_OK);
    assert_int_equal(rt_swarm_set_span(&moved, j, f, l), FU_OK);
    assert_int_equal(rt_swarm_uncovered(&moved, NULL), 0);
    assert_true(rt_max_flow(&moved, NULL) >= 1.05 * flow);
    rt_swarm_free(&moved);
    /* f2 alone covers [5, 10): it is never moved, whatever it would gain */
    movable[0] = f2;
    assert_int_equal(gw_pick_move(&sw, movable, 1, 0.0, NULL, &f, &l), -1);
    /* a threshold above the gain (100%) keeps everyone in place */
    movable[0] = j;
    assert_int_equal(gw_pick_move(&sw, movable, 2, 1.5, NULL, &f, &l), -1);
    /* once balanced (two and two), nothing moves */
    assert_int_equal(rt_swarm_set_span(&sw, j, 5, 10), FU_OK);
    assert_int_equal(gw_pick_move(&sw, movable, 2, 0.0, NULL, &f, &l), -1);
    (void)f1, (void)f1b;
    rt_swarm_free(&sw);
}

static gw_member_report fixed_report(const char *address, int first, int last) {
    gw_member_report r = report(address, 0, first, last);
    r.fixed_span = true;
    return r;
}

static const char *member_state(gw_swarm *s, const char *address, json_t **doc_out) {
    json_t *doc = gw_swarm_json(s);
    *doc_out = doc;
    return server_state(doc, address, NULL);
}

/* A joined member serving where it is least needed moves (once) beside the bottleneck; the fixed
 * ones never move; the old span stays routed until the new one is reported. */
static void test_rebalance_move(void **st) {
    (void)st;
    gw_config cfg;
    gw_config_init(&cfg);
    cfg.route_wait_ms = 0;
    cfg.rebalance_interval_ms = 60000;
    cfg.heartbeat_timeout_ms = 600000; /* ticks far apart retire no one here */
    gw_swarm *s;
    assert_int_equal(gw_swarm_new_manual(&cfg, 30, &s), FU_OK);
    gw_member_reply rf2, rj, rf1, rf1b, hb;
    gw_member_report r = fixed_report("10.0.0.2:1", 15, 30);
    assert_int_equal(gw_swarm_member_join(s, &r, 0.0, &rf2), FU_OK);
    r = report("10.0.0.9:1", 15, 0, 0);
    assert_int_equal(gw_swarm_member_join(s, &r, 0.0, &rj), FU_OK);
    assert_int_equal(rj.first, 0); /* the gap */
    assert_int_equal(rj.last, 15);
    r = report("10.0.0.9:1", 15, 0, 15);
    assert_int_equal(gw_swarm_member_heartbeat(s, rj.member_id, &r, false, 0.5, &hb), FU_OK);
    r = fixed_report("10.0.0.1:1", 0, 15);
    assert_int_equal(gw_swarm_member_join(s, &r, 0.5, &rf1), FU_OK);
    r = fixed_report("10.0.0.3:1", 0, 15);
    assert_int_equal(gw_swarm_member_join(s, &r, 0.5, &rf1b), FU_OK);
    json_t *doc = gw_swarm_json(s);
    double flow0 = json_real_value(json_object_get(doc, "max_flow"));
    json_decref(doc);
    /* not while it has served its span for less than the interval */
    gw_swarm_tick(s, 30.0);
    assert_string_equal(member_state(s, "10.0.0.9:1", &doc), "active");
    json_decref(doc);
    /* then a tick orders the move of the joined member, not of a fixed one */
    gw_swarm_tick(s, 100.0);
    assert_string_equal(member_state(s, "10.0.0.9:1", &doc), "moving");
    assert_string_equal(server_state(doc, "10.0.0.1:1", NULL), "active");
    assert_int_equal(json_integer_value(json_object_get(doc, "moves")), 1);
    assert_true(fabs(json_real_value(json_object_get(doc, "max_flow")) - flow0) < 1e-9); /* not moved yet */
    json_decref(doc);
    r = report("10.0.0.9:1", 15, 0, 15);
    assert_int_equal(gw_swarm_member_heartbeat(s, rj.member_id, &r, false, 100.2, &hb), FU_OK);
    assert_int_equal(hb.first, 15);
    assert_int_equal(hb.last, 30);
    /* meanwhile requests still route over its old span */
    gw_lease lease;
    gw_error err = {0};
    assert_int_equal(gw_swarm_route(s, 8, &lease, &err), FU_OK);
    gw_swarm_release(s, &lease);
    /* it serves the new span while the old one drains its sessions */
    r = report("10.0.0.9:1", 15, 15, 30);
    r.dr_first = 0, r.dr_last = 15, r.dr_sessions = 2;
    assert_int_equal(gw_swarm_member_heartbeat(s, rj.member_id, &r, false, 100.5, &hb), FU_OK);
    assert_int_equal(hb.last, hb.first);
    json_t *span = NULL;
    doc = gw_swarm_json(s);
    assert_string_equal(server_state(doc, "10.0.0.9:1", &span), "active");
    assert_int_equal(json_integer_value(json_array_get(span, 0)), 15);
    assert_true(json_real_value(json_object_get(doc, "max_flow")) >= 1.9 * flow0);
    assert_int_equal(json_integer_value(json_object_get(doc, "uncovered_blocks")), 0);
    size_t i;
    json_t *sv;
    json_array_foreach(json_object_get(doc, "servers"), i, sv) {
        if (strcmp(json_string_value(json_object_get(sv, "address")), "10.0.0.9:1")) continue;
        json_t *dr = json_object_get(sv, "draining");
        assert_int_equal(json_integer_value(json_array_get(json_object_get(dr, "span"), 1)), 15);
        assert_int_equal(json_integer_value(json_object_get(dr, "sessions")), 2);
    }
    json_decref(doc);
    /* balanced now, and within the interval anyway: no further move */
    r.dr_first = r.dr_last = r.dr_sessions = 0;
    assert_int_equal(gw_swarm_member_heartbeat(s, rj.member_id, &r, false, 101.0, &hb), FU_OK);
    gw_swarm_tick(s, 101.0);
    doc = gw_swarm_json(s);
    assert_int_equal(json_integer_value(json_object_get(doc, "moves")), 1);
    json_decref(doc);
    gw_swarm_free(s);
    gw_config_free(&cfg);
}

/* A failed load is withdrawn and shown, another spare takes the span, and it is not asked again. */
static void test_failed_load(void **st) {
    (void)st;
    gw_config cfg;
    gw_config_init(&cfg);
    cfg.route_wait_ms = 0;
    gw_swarm *s;
    assert_int_equal(gw_swarm_new_manual(&cfg, 30, &s), FU_OK);
    gw_member_reply ra, rb, hb;
    gw_member_report r = report("10.0.1.1:1", 0, 0, 0);
    assert_int_equal(gw_swarm_member_join(s, &r, 0.0, &ra), FU_OK);
    assert_int_equal(ra.last - ra.first, 30);
    r = report("10.0.1.2:1", 0, 0, 0);
    assert_int_equal(gw_swarm_member_join(s, &r, 0.0, &rb), FU_OK);
    assert_int_equal(rb.last, rb.first); /* covered (being loaded): b waits */
    /* a cannot load it and says so */
    r = report("10.0.1.1:1", 0, 0, 0);
    r.fail_first = 0, r.fail_last = 30;
    snprintf(r.load_error, sizeof r.load_error, "malformed input: tensor 'blk.3.attn_q.weight' beyond end of file");
    for (int k = 0; k < 3; k++) { /* reported in every heartbeat: counted once */
        assert_int_equal(gw_swarm_member_heartbeat(s, ra.member_id, &r, false, 0.5 + k * 0.1, &hb), FU_OK);
        assert_int_equal(hb.last, hb.first); /* not asked again */
    }
    json_t *doc;
    assert_string_equal(member_state(s, "10.0.1.1:1", &doc), "spare");
    size_t i;
    json_t *sv;
    json_array_foreach(json_object_get(doc, "servers"), i, sv) {
        if (strcmp(json_string_value(json_object_get(sv, "address")), "10.0.1.1:1")) continue;
        assert_non_null(strstr(json_string_value(json_object_get(sv, "error")), "beyond end of file"));
        assert_int_equal(json_integer_value(json_object_get(sv, "failed_loads")), 1);
        json_t *fs = json_array_get(json_object_get(sv, "failed_spans"), 0);
        assert_int_equal(json_array_size(json_object_get(sv, "failed_spans")), 1);
        assert_int_equal(json_integer_value(json_array_get(fs, 1)), 30);
    }
    /* the other spare is asked instead */
    assert_string_equal(server_state(doc, "10.0.1.2:1", NULL), "loading");
    json_decref(doc);
    r = report("10.0.1.2:1", 0, 0, 0);
    assert_int_equal(gw_swarm_member_heartbeat(s, rb.member_id, &r, false, 0.6, &hb), FU_OK);
    assert_int_equal(hb.first, 0);
    assert_int_equal(hb.last, 30);
    r = report("10.0.1.2:1", 0, 0, 30);
    assert_int_equal(gw_swarm_member_heartbeat(s, rb.member_id, &r, false, 0.7, &hb), FU_OK);
    gw_lease lease;
    gw_error err = {0};
    assert_int_equal(gw_swarm_route(s, 8, &lease, &err), FU_OK);
    assert_string_equal(lease.addr[0], "10.0.1.2:1");
    gw_swarm_release(s, &lease);
    /* b leaves: the gap is not offered to a again for the span it failed on */
    assert_int_equal(gw_swarm_member_heartbeat(s, rb.member_id, NULL, true, 0.8, &hb), FU_OK);
    r = report("10.0.1.1:1", 0, 0, 0);
    assert_int_equal(gw_swarm_member_heartbeat(s, ra.member_id, &r, false, 0.9, &hb), FU_OK);
    assert_int_equal(hb.last, hb.first);
    assert_int_not_equal(gw_swarm_route(s, 8, &lease, &err), FU_OK);
    assert_int_equal(err.http, 503);
    gw_swarm_free(s);
    gw_config_free(&cfg);
}

/* A member whose loads fail three times (three different spans) is not asked again: "failed". */
static void test_failed_thrice(void **st) {
    (void)st;
    gw_config cfg;
    gw_config_init(&cfg);
    cfg.route_wait_ms = 0;
    gw_swarm *s;
    assert_int_equal(gw_swarm_new_manual(&cfg, 30, &s), FU_OK);
    gw_member_reply rx, rf, hb;
    gw_member_report r = report("10.0.5.1:1", 10, 0, 0);
    assert_int_equal(gw_swarm_member_join(s, &r, 0.0, &rx), FU_OK);
    assert_int_equal(rx.last - rx.first, 10);
    /* fixed members around each gap it is given; it fails every load */
    const int gaps[3][2] = {{0, 10}, {20, 30}, {10, 20}};
    const char *fixed[3] = {"10.0.5.2:1", "10.0.5.3:1", "10.0.5.4:1"};
    int as_first = rx.first, as_last = rx.last;
    for (int k = 0; k < 3; k++) {
        /* the others cover everything but gaps[k] */
        int a = gaps[k][0], b = gaps[k][1];
        r = fixed_report(fixed[k], a == 0 ? b : 0, a == 0 ? 30 : a);
        assert_int_equal(gw_swarm_member_join(s, &r, 0.1, &rf), FU_OK);
        if (b < 30 && a > 0) { /* a middle gap: one more fixed member after it */
            gw_member_reply r2;
            gw_member_report t = fixed_report("10.0.5.9:1", b, 30);
            assert_int_equal(gw_swarm_member_join(s, &t, 0.1, &r2), FU_OK);
        }
        r = report("10.0.5.1:1", 10, 0, 0);
        assert_int_equal(gw_swarm_member_heartbeat(s, rx.member_id, &r, false, 0.2, &hb), FU_OK);
        if (k > 0) {
            as_first = hb.first, as_last = hb.last;
            assert_int_equal(as_first, a);
            assert_int_equal(as_last, b);
        }
        r.fail_first = as_first, r.fail_last = as_last;
        snprintf(r.load_error, sizeof r.load_error, "out of memory");
        assert_int_equal(gw_swarm_member_heartbeat(s, rx.member_id, &r, false, 0.3, &hb), FU_OK);
        assert_int_equal(hb.last, hb.first);
        /* the fixed members of this round leave (a new gap for the next round) */
        assert_int_equal(gw_swarm_member_heartbeat(s, rf.member_id, NULL, true, 0.4, &hb), FU_OK);
    }
    json_t *doc;
    assert_string_equal(member_state(s, "10.0.5.1:1", &doc), "failed");
    json_decref(doc);
    r = report("10.0.5.1:1", 10, 0, 0);
    assert_int_equal(gw_swarm_member_heartbeat(s, rx.member_id, &r, false, 0.5, &hb), FU_OK);
    assert_int_equal(hb.last, hb.first);
    gw_swarm_free(s);
    gw_config_free(&cfg);
}

/* Rules 4 and 5: a spare within the count is promoted when a serving member leaves, and when
 * requests are refused for want of KV room. */
static void test_promotion(void **st) {
    (void)st;
    gw_config cfg;
    gw_config_init(&cfg);
    cfg.route_wait_ms = 0;
    cfg.spares = 2;
    gw_swarm *s;
    assert_int_equal(gw_swarm_new_manual(&cfg, 30, &s), FU_OK);
    const char *addr[4] = {"10.0.2.1:1", "10.0.2.2:1", "10.0.2.3:1", "10.0.2.4:1"};
    gw_member_reply rep[4], hb;
    for (int i = 0; i < 4; i++) { /* two serving all blocks (KV room for 100 tokens each), two spares */
        gw_member_report r = i < 2 ? fixed_report(addr[i], 0, 30) : report(addr[i], 0, 0, 0);
        if (i < 2) r.total_kv = 64 * 100;
        assert_int_equal(gw_swarm_member_join(s, &r, 0.0, &rep[i]), FU_OK);
        assert_int_equal(rep[i].last, rep[i].first);
    }
    /* an ordinary heartbeat: the spares wait */
    gw_member_report sp = report(addr[2], 0, 0, 0);
    assert_int_equal(gw_swarm_member_heartbeat(s, rep[2].member_id, &sp, false, 0.2, &hb), FU_OK);
    assert_int_equal(hb.last, hb.first);
    /* a serving member leaves: one spare restores the flow */
    assert_int_equal(gw_swarm_member_heartbeat(s, rep[1].member_id, NULL, true, 0.3, &hb), FU_OK);
    int promoted = -1;
    for (int i = 2; i < 4; i++) {
        gw_member_report r = report(addr[i], 0, 0, 0);
        assert_int_equal(gw_swarm_member_heartbeat(s, rep[i].member_id, &r, false, 0.4, &hb), FU_OK);
        if (hb.last > hb.first) {
            assert_int_equal(promoted, -1); /* only one */
            assert_int_equal(hb.last - hb.first, 30);
            promoted = i;
        }
    }
    assert_true(promoted >= 2);
    int other = promoted == 2 ? 3 : 2;
    gw_member_report r = report(addr[promoted], 0, 0, 30);
    r.total_kv = 64 * 100;
    assert_int_equal(gw_swarm_member_heartbeat(s, rep[promoted].member_id, &r, false, 0.5, &hb), FU_OK);
    json_t *doc = gw_swarm_json(s);
    assert_false(json_is_true(json_object_get(doc, "loaded")));
    json_decref(doc);
    /* the last spare waits ... until a request finds no KV room anywhere */
    r = report(addr[other], 0, 0, 0);
    assert_int_equal(gw_swarm_member_heartbeat(s, rep[other].member_id, &r, false, 0.6, &hb), FU_OK);
    assert_int_equal(hb.last, hb.first);
    gw_lease lease;
    gw_error err = {0};
    assert_int_equal(gw_swarm_route(s, 500, &lease, &err), FU_ERR_EXHAUSTED);
    assert_int_equal(err.http, 503);
    doc = gw_swarm_json(s);
    assert_true(json_is_true(json_object_get(doc, "loaded")));
    assert_string_equal(server_state(doc, addr[other], NULL), "loading");
    json_decref(doc);
    assert_int_equal(gw_swarm_member_heartbeat(s, rep[other].member_id, &r, false, 0.7, &hb), FU_OK);
    assert_int_equal(hb.last - hb.first, 30);
    gw_swarm_free(s);
    gw_config_free(&cfg);
}

/* Members joining and leaving many times keep the router and the member list bounded. */
static void test_churn_bounded(void **st) {
    (void)st;
    gw_config cfg;
    gw_config_init(&cfg);
    cfg.route_wait_ms = 0;
    gw_swarm *s;
    assert_int_equal(gw_swarm_new_manual(&cfg, 30, &s), FU_OK);
    gw_member_reply keep, rep, hb;
    gw_member_report r = report("10.0.3.1:1", 0, 0, 0);
    assert_int_equal(gw_swarm_member_join(s, &r, 0.0, &keep), FU_OK);
    r = report("10.0.3.1:1", 0, 0, 30);
    assert_int_equal(gw_swarm_member_heartbeat(s, keep.member_id, &r, false, 0.0, &hb), FU_OK);
    gw_lease lease;
    gw_error err = {0};
    for (int i = 0; i < 1000; i++) {
        char a[64];
        snprintf(a, sizeof a, "10.1.%d.%d:%d", i / 250, i % 250, 1 + i % 3);
        r = report(a, 0, 0, 0);
        assert_int_equal(gw_swarm_member_join(s, &r, 0.0, &rep), FU_OK);
        r = report(a, 0, 0, 30);
        assert_int_equal(gw_swarm_member_heartbeat(s, rep.member_id, &r, false, 0.0, &hb), FU_OK);
        bool held = i % 7 == 0; /* a lease over it while it leaves: its slot waits for the release */
        if (held) assert_int_equal(gw_swarm_route(s, 8, &lease, &err), FU_OK);
        assert_int_equal(gw_swarm_member_heartbeat(s, rep.member_id, NULL, true, 0.0, &hb), FU_OK);
        if (held) gw_swarm_release(s, &lease);
    }
    json_t *doc = gw_swarm_json(s);
    assert_true(json_integer_value(json_object_get(doc, "router_slots")) <= 4);
    assert_true(json_array_size(json_object_get(doc, "servers")) <= 64 + 2);
    assert_int_equal(json_integer_value(json_object_get(doc, "active")), 1);
    json_decref(doc);
    assert_int_equal(gw_swarm_route(s, 8, &lease, &err), FU_OK);
    assert_string_equal(lease.addr[0], "10.0.3.1:1");
    gw_swarm_release(s, &lease);
    gw_swarm_free(s);
    gw_config_free(&cfg);
}

/* The flow network's bytes per token between servers: hidden size x 2 (bf16). */
static void test_act_bytes(void **st) {
    (void)st;
    gw_config cfg;
    gw_config_init(&cfg);
    cfg.hidden_size = 576;
    gw_swarm *s;
    assert_int_equal(gw_swarm_new_manual(&cfg, 30, &s), FU_OK);
    json_t *doc = gw_swarm_json(s);
    assert_true(fabs(json_real_value(json_object_get(doc, "act_bytes_per_token")) - 1152) < 1e-9);
    json_decref(doc);
    /* a member of another model is refused */
    gw_member_report r = report("10.0.4.1:1", 0, 0, 0);
    r.hidden_size = 2048;
    gw_member_reply rep;
    assert_int_equal(gw_swarm_member_join(s, &r, 0.0, &rep), FU_ERR_INVALID);
    gw_swarm_free(s);
    gw_config_free(&cfg);
}

static void test_membership(void **st) {
    (void)st;
    gw_config cfg;
    gw_config_init(&cfg);
    cfg.route_wait_ms = 0;
    assert_int_equal(gw_config_set(&cfg, "shard", "127.0.0.1:9"), FU_OK);
    assert_int_equal(gw_config_set(&cfg, "link", "gateway,10.0.0.1:1,5e8,0.002"), FU_OK);
    assert_int_not_equal(gw_config_set(&cfg, "link", "gateway,10.0.0.1:1,fast,0.002"), FU_OK);
    gw_swarm *s;
    assert_int_equal(gw_swarm_new_manual(&cfg, 30, &s), FU_OK);

    /* three 12-block members: each gets a span over uncovered blocks; together they cover all 30 */
    const char *addr[5] = {"10.0.0.1:1", "10.0.0.2:1", "10.0.0.3:1", "10.0.0.4:1", "10.0.0.5:1"};
    gw_member_reply rep[5];
    char covered[30] = {0};
    for (int i = 0; i < 3; i++) {
        gw_member_report r = report(addr[i], 12, 0, 0);
        assert_int_equal(gw_swarm_member_join(s, &r, 0.0, &rep[i]), FU_OK);
        assert_true(rep[i].member_id > 0);
        assert_true(rep[i].last - rep[i].first >= 6 && rep[i].last - rep[i].first <= 12);
        int fresh = 0;
        for (int b = rep[i].first; b < rep[i].last; b++) fresh += !covered[b], covered[b] = 1;
        assert_true(fresh >= 6); /* every join covers new blocks */
    }
    for (int b = 0; b < 30; b++) assert_true(covered[b]);
    json_t *doc0 = gw_swarm_json(s);
    assert_string_equal(server_state(doc0, addr[0], NULL), "loading");
    json_decref(doc0);

    /* a fourth waits as the spare (1 wanted); so does a fifth: no single server lifts the flow, as
     * the two 12-block spans are equal bottlenecks */
    for (int i = 3; i < 5; i++) {
        gw_member_report r = report(addr[i], 12, 0, 0);
        assert_int_equal(gw_swarm_member_join(s, &r, 0.0, &rep[i]), FU_OK);
        assert_int_equal(rep[i].last, rep[i].first);
    }

    /* routing waits for nothing while spans load: no server serves yet */
    gw_lease lease;
    gw_error err = {0};
    assert_int_not_equal(gw_swarm_route(s, 16, &lease, &err), FU_OK);
    assert_int_equal(err.http, 503);
    assert_non_null(strstr(err.message, "no server covers blocks [0, 30)"));

    /* the members load their spans and say so */
    for (int i = 0; i < 5; i++) {
        gw_member_report r = report(addr[i], 12, rep[i].first, rep[i].last);
        gw_member_reply hb;
        assert_int_equal(gw_swarm_member_heartbeat(s, rep[i].member_id, &r, false, 1.0, &hb), FU_OK);
        assert_int_equal(hb.last, hb.first); /* nothing (more) to load */
        if (i >= 2) assert_true(hb.n_peers >= 2); /* the serving members, itself excluded */
    }
    json_t *doc = gw_swarm_json(s);
    json_t *span = NULL;
    assert_string_equal(server_state(doc, addr[0], &span), "active");
    assert_int_equal(json_integer_value(json_array_get(span, 0)), rep[0].first);
    assert_string_equal(server_state(doc, addr[3], &span), "spare");
    assert_string_equal(json_string_value(span), "spare");
    assert_int_equal(json_integer_value(json_object_get(doc, "uncovered_blocks")), 0);
    assert_int_equal(json_integer_value(json_object_get(doc, "spares")), 2);
    assert_true(json_real_value(json_object_get(doc, "max_flow")) > 0);
    assert_true(json_array_size(json_object_get(doc, "flow")) >= 4); /* gateway -> a -> b -> c -> gateway */
    assert_string_equal(server_state(doc, "127.0.0.1:9", NULL), "unreachable"); /* static, never polled here */
    /* a configured link shows as such */
    size_t i;
    json_t *sv;
    json_array_foreach(json_object_get(doc, "servers"), i, sv) {
        if (!strcmp(json_string_value(json_object_get(sv, "address")), addr[0])) {
            json_t *link = json_object_get(sv, "link");
            assert_string_equal(json_string_value(json_object_get(link, "source")), "config");
            assert_true(fabs(json_real_value(json_object_get(link, "bandwidth_bytes_per_s")) - 5e8) < 1);
        }
    }
    json_decref(doc);
    /* a measured one as measured, and a slow measured link bounds the flow */
    doc = gw_swarm_json(s);
    double flow0 = json_real_value(json_object_get(doc, "max_flow"));
    json_decref(doc);
    assert_int_equal(gw_swarm_member_link(s, rep[1].member_id, 0.004, 20.0), FU_OK); /* 20 B/s: 5 tokens/s */
    doc = gw_swarm_json(s);
    assert_true(json_real_value(json_object_get(doc, "max_flow")) <= flow0);
    json_array_foreach(json_object_get(doc, "servers"), i, sv) {
        if (!strcmp(json_string_value(json_object_get(sv, "address")), addr[1])) {
            json_t *link = json_object_get(sv, "link");
            assert_string_equal(json_string_value(json_object_get(link, "source")), "measured");
            assert_true(fabs(json_real_value(json_object_get(link, "rtt_s")) - 0.004) < 1e-9);
        }
    }
    json_decref(doc);
    assert_int_equal(gw_swarm_route(s, 16, &lease, &err), FU_OK);
    assert_true(lease.n_hops >= 1);
    assert_int_equal(lease.hops[0].first_block, 0);
    assert_int_equal(lease.hops[lease.n_hops - 1].last_block, 30);
    gw_swarm_release(s, &lease);

    /* bad reports are refused */
    gw_member_reply junk;
    gw_member_report bad = report("10.0.0.9:1", 12, 0, 0);
    bad.n_layers = 31;
    assert_int_equal(gw_swarm_member_join(s, &bad, 1.0, &junk), FU_ERR_INVALID);
    bad = report("10.0.0.9:1", 12, 20, 40);
    assert_int_equal(gw_swarm_member_join(s, &bad, 1.0, &junk), FU_ERR_INVALID);
    bad = report("127.0.0.1:9", 12, 0, 0);
    assert_int_equal(gw_swarm_member_join(s, &bad, 1.0, &junk), FU_ERR_INVALID);
    bad = report("", 12, 0, 0);
    assert_int_equal(gw_swarm_member_join(s, &bad, 1.0, &junk), FU_ERR_INVALID);
    bad = report("10.0.0.9:1", 12, 0, 0); /* step tokens not ascending */
    bad.prompt_steps = (gw_step_table){2, {64, 16}, {0.002, 0.001}};
    bad.decode_steps = (gw_step_table){1, {1}, {0.001}};
    assert_int_equal(gw_swarm_member_join(s, &bad, 1.0, &junk), FU_ERR_INVALID);
    bad.prompt_steps = (gw_step_table){1, {16}, {NAN}}; /* a time not a number */
    assert_int_equal(gw_swarm_member_join(s, &bad, 1.0, &junk), FU_ERR_INVALID);
    bad.prompt_steps.n = 0; /* decode without prompt */
    assert_int_equal(gw_swarm_member_join(s, &bad, 1.0, &junk), FU_ERR_INVALID);
    assert_int_equal(gw_swarm_member_heartbeat(s, 999, &bad, false, 1.0, &junk), FU_ERR_NOT_FOUND);

    /* the member holding block 0 stops heartbeating: past the timeout it is retired, and a spare
     * is told to load the gap */
    int dead = rep[0].first == 0 ? 0 : rep[1].first == 0 ? 1 : 2;
    assert_int_equal(rep[dead].first, 0);
    for (int k = 0; k < 5; k++) {
        if (k == dead) continue;
        gw_member_report r = report(addr[k], 12, rep[k].first, rep[k].last);
        assert_int_equal(gw_swarm_member_heartbeat(s, rep[k].member_id, &r, false, 3.5, &junk), FU_OK);
    }
    gw_swarm_tick(s, 3.9); /* 2.9 s since its last heartbeat: not yet */
    doc = gw_swarm_json(s);
    assert_string_equal(server_state(doc, addr[dead], NULL), "active");
    json_decref(doc);
    gw_swarm_tick(s, 4.5);
    doc = gw_swarm_json(s);
    assert_string_equal(server_state(doc, addr[dead], NULL), "gone");
    assert_int_equal(json_integer_value(json_object_get(doc, "uncovered_blocks")), rep[dead].last);
    int loading = !strcmp(server_state(doc, addr[3], NULL), "loading") ? 3 : 4;
    assert_string_equal(server_state(doc, addr[loading], NULL), "loading");
    assert_string_equal(server_state(doc, addr[7 - loading], NULL), "spare"); /* one gap, one spare */
    json_decref(doc);
    gw_member_reply hb;
    gw_member_report r = report(addr[dead], 12, rep[dead].first, rep[dead].last);
    assert_int_equal(gw_swarm_member_heartbeat(s, rep[dead].member_id, &r, false, 4.6, &hb), FU_ERR_NOT_FOUND);
    r = report(addr[loading], 12, 0, 0);
    assert_int_equal(gw_swarm_member_heartbeat(s, rep[loading].member_id, &r, false, 4.6, &hb), FU_OK);
    assert_int_equal(hb.first, 0);
    assert_int_equal(hb.last, rep[dead].last);
    r = report(addr[loading], 12, hb.first, hb.last);
    assert_int_equal(gw_swarm_member_heartbeat(s, rep[loading].member_id, &r, false, 4.7, &hb), FU_OK);
    assert_int_equal(hb.last, hb.first);
    doc = gw_swarm_json(s);
    assert_int_equal(json_integer_value(json_object_get(doc, "uncovered_blocks")), 0);
    assert_string_equal(server_state(doc, addr[loading], NULL), "active");
    json_decref(doc);

    /* a member that leaves is retired at once; its id is then unknown */
    int other = 7 - loading;
    assert_int_equal(gw_swarm_member_heartbeat(s, rep[other].member_id, NULL, true, 5.0, &junk), FU_OK);
    r = report(addr[other], 12, 0, 0);
    assert_int_equal(gw_swarm_member_heartbeat(s, rep[other].member_id, &r, false, 5.1, &junk), FU_ERR_NOT_FOUND);
    /* it may join again under a new id, here with a span of its own */
    gw_member_reply again;
    r = report(addr[other], 12, 0, 12);
    r.fixed_span = true;
    assert_int_equal(gw_swarm_member_join(s, &r, 5.2, &again), FU_OK);
    assert_true(again.member_id > rep[4].member_id);
    assert_int_equal(again.last, again.first); /* it holds a span: nothing to load */
    doc = gw_swarm_json(s);
    assert_string_equal(server_state(doc, addr[other], NULL), "active");
    json_decref(doc);

    gw_swarm_free(s);
    gw_config_free(&cfg);
}

/* A shard server without a span: Info and sessions are refused, Echo answers. */
static void test_spare_server(void **st) {
    (void)st;
    shard_server_config cfg = {.listen = "127.0.0.1:0", .allow_insecure = true, .secret = "unit-secret", .n_workers = 2,
                               .model_name = "m", .device = "cpu"};
    shard_server *srv;
    assert_int_equal(shard_server_new(NULL, &cfg, &srv), FU_OK);
    assert_int_equal(shard_server_start(srv), FU_OK);
    char addr[64];
    snprintf(addr, sizeof addr, "127.0.0.1:%d", shard_server_port(srv));
    assert_string_equal(shard_server_address(srv), addr);
    rpc_channel_options co = {.insecure = true, .secret = "unit-secret"};
    rpc_channel *ch;
    assert_int_equal(rpc_channel_new(addr, &co, &ch), FU_OK);
    Fusion__InfoRequest info = FUSION__INFO_REQUEST__INIT;
    ProtobufCMessage *rep = NULL;
    rpc_status rs;
    assert_int_equal(rpc_call_unary(ch, RPC_SHARD_INFO, &info.base, &fusion__info_reply__descriptor, &rep, 5000, &rs),
                     RPC_UNAVAILABLE);
    assert_non_null(strstr(rs.message, "spare"));
    Fusion__EchoRequest echo = FUSION__ECHO_REQUEST__INIT;
    echo.reply_bytes = 1000;
    assert_int_equal(rpc_call_unary(ch, RPC_SHARD_ECHO, &echo.base, &fusion__echo_reply__descriptor, &rep, 5000, &rs),
                     RPC_OK);
    assert_int_equal(((Fusion__EchoReply *)rep)->payload.len, 1000);
    rpc_msg_free(rep);
    echo.reply_bytes = -1;
    assert_int_equal(rpc_call_unary(ch, RPC_SHARD_ECHO, &echo.base, &fusion__echo_reply__descriptor, &rep, 5000, &rs),
                     RPC_INVALID_ARGUMENT);
    echo.reply_bytes = 5 << 20;
    assert_int_equal(rpc_call_unary(ch, RPC_SHARD_ECHO, &echo.base, &fusion__echo_reply__descriptor, &rep, 5000, &rs),
                     RPC_INVALID_ARGUMENT);
    assert_int_equal(shard_server_set_core(srv, NULL, 0), FU_ERR_INVALID);
    rpc_channel_free(ch);
    shard_server_free(srv);
}

/* A fake member for shard_join: "loading" a span just records it. */
typedef struct fake_member {
    pthread_mutex_t mu;
    int first, last, loads;
} fake_member;

static int fake_load(void *ctx, int first, int last) {
    fake_member *f = ctx;
    pthread_mutex_lock(&f->mu);
    f->first = first;
    f->last = last;
    f->loads++;
    pthread_mutex_unlock(&f->mu);
    return FU_OK;
}

static void fake_status(void *ctx, shard_join_status *st) {
    fake_member *f = ctx;
    pthread_mutex_lock(&f->mu);
    st->first = f->first;
    st->last = f->last;
    st->tokens_per_s = f->last > f->first ? 100 : 0;
    st->total_kv_bytes = st->free_kv_bytes = 1 << 20;
    st->kv_bytes_per_position = 64;
    snprintf(st->dtype, sizeof st->dtype, "f32");
    pthread_mutex_unlock(&f->mu);
}

/* The state of the only server in /v1/swarm, NULL while none is listed. */
static char *only_state(gw_swarm *s, json_t **span_out) {
    json_t *doc = gw_swarm_json(s);
    json_t *sv = json_array_get(json_object_get(doc, "servers"), 0);
    char *state = sv ? strdup(json_string_value(json_object_get(sv, "state"))) : NULL;
    if (span_out) *span_out = sv ? json_incref(json_object_get(sv, "span")) : NULL;
    json_decref(doc);
    return state;
}

static bool wait_state(gw_swarm *s, const char *want) {
    for (int i = 0; i < 200; i++) {
        char *state = only_state(s, NULL);
        bool ok = state && !strcmp(state, want);
        free(state);
        if (ok) return true;
        struct timespec ts = {0, 25 * 1000000L};
        nanosleep(&ts, NULL);
    }
    return false;
}

/* Join, assignment, heartbeats, link measurement and leaving over real gRPC on loopback. */
static void test_join_over_rpc(void **st) {
    (void)st;
    gw_config cfg;
    gw_config_init(&cfg);
    assert_int_equal(gw_config_set(&cfg, "swarm-listen", "127.0.0.1:0"), FU_OK);
    assert_int_equal(gw_config_set(&cfg, "insecure", "true"), FU_OK);
    assert_int_equal(gw_config_set(&cfg, "secret", "unit-secret"), FU_OK);
    assert_int_equal(gw_config_set(&cfg, "heartbeat-ms", "100"), FU_OK);
    assert_int_equal(gw_config_set(&cfg, "measure-interval-ms", "200"), FU_OK);
    gw_swarm *s;
    assert_int_equal(gw_swarm_new(&cfg, 30, &s), FU_OK);
    char gw_addr[64];
    snprintf(gw_addr, sizeof gw_addr, "127.0.0.1:%d", gw_swarm_port(s));
    /* the member's own server answers the gateway's Echo probes */
    shard_server_config sc = {.listen = "127.0.0.1:0", .allow_insecure = true, .secret = "unit-secret", .n_workers = 2,
                              .model_name = "m", .device = "cpu"};
    shard_server *srv;
    assert_int_equal(shard_server_new(NULL, &sc, &srv), FU_OK);
    assert_int_equal(shard_server_start(srv), FU_OK);
    fake_member fm = {.first = 0, .last = 0};
    pthread_mutex_init(&fm.mu, NULL);
    static const double pt[] = {16, 64}, ps[] = {1e-3, 3e-3}, dt[] = {1, 8}, ds[] = {1e-4, 4e-4};
    shard_join_config jc = {gw_addr, NULL, true, "unit-secret", shard_server_address(srv), "m", 30, "cpu", 3000, 0,
                            false, 0, fake_load, fake_status, &fm, NULL, NULL, NULL, {2, pt, ps}, {2, dt, ds}};
    shard_join *j;
    assert_int_equal(shard_join_start(&jc, &j), FU_OK);
    /* the only member is given every block, loads them and serves */
    assert_true(wait_state(s, "active"));
    json_t *span = NULL;
    free(only_state(s, &span));
    assert_int_equal(json_integer_value(json_array_get(span, 0)), 0);
    assert_int_equal(json_integer_value(json_array_get(span, 1)), 30);
    json_decref(span);
    pthread_mutex_lock(&fm.mu);
    int loads = fm.loads;
    pthread_mutex_unlock(&fm.mu);
    assert_int_equal(loads, 1);
    /* its step times are its profile in the planner */
    json_t *doc0 = gw_swarm_json(s), *sv0 = json_array_get(json_object_get(doc0, "servers"), 0);
    json_t *decode = json_object_get(json_object_get(sv0, "step_ms"), "decode");
    assert_int_equal(json_array_size(decode), 2);
    assert_true(fabs(json_real_value(json_array_get(json_array_get(decode, 1), 1)) - 0.4) < 1e-9);
    json_t *planner = json_object_get(doc0, "planner");
    assert_int_equal(json_integer_value(json_object_get(planner, "profiled_members")), 1);
    assert_true(json_real_value(json_object_get(planner, "decode_tokens_per_s")) > 0);
    json_decref(doc0);
    /* the gateway measures its link */
    bool measured = false;
    for (int i = 0; i < 200 && !measured; i++) {
        json_t *doc = gw_swarm_json(s);
        json_t *link = json_object_get(json_array_get(json_object_get(doc, "servers"), 0), "link");
        measured = !strcmp(json_string_value(json_object_get(link, "source")), "measured") &&
                   json_real_value(json_object_get(link, "bandwidth_bytes_per_s")) > 0;
        json_decref(doc);
        struct timespec ts = {0, 25 * 1000000L};
        if (!measured) nanosleep(&ts, NULL);
    }
    assert_true(measured);
    /* a request routes over it */
    gw_lease lease;
    gw_error err = {0};
    assert_int_equal(gw_swarm_route(s, 8, &lease, &err), FU_OK);
    assert_int_equal(lease.n_hops, 1);
    assert_string_equal(lease.addr[0], shard_server_address(srv));
    gw_swarm_release(s, &lease);
    /* leaving: retired at once */
    shard_join_stop(j);
    assert_true(wait_state(s, "gone"));
    shard_server_free(srv);
    gw_swarm_free(s);
    gw_config_free(&cfg);
    pthread_mutex_destroy(&fm.mu);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_pick_spare),
        cmocka_unit_test(test_pick_spare_among_many),
        cmocka_unit_test(test_membership),
        cmocka_unit_test(test_spare_server),
        cmocka_unit_test(test_join_over_rpc),
        cmocka_unit_test(test_pick_move),
        cmocka_unit_test(test_rebalance_move),
        cmocka_unit_test(test_failed_load),
        cmocka_unit_test(test_failed_thrice),
        cmocka_unit_test(test_promotion),
        cmocka_unit_test(test_churn_bounded),
        cmocka_unit_test(test_act_bytes),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
