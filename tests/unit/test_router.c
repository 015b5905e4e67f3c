/* test_router.c -- router core: max flow on hand-checked graphs, the swarm's flow network,
 * placement invariants, IWRR proportions and KV admission, join/leave coverage, loaders, sim. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "router-impl.h"
#include "router.h"
#include "status.h"

#define NEAR(a, b, tol) assert_true(fabs((double)(a) - (double)(b)) <= (tol))

/* --- max flow ----------------------------------------------------------------------------- */

/* s=0 a=1 b=2 t=3: greedy s-a-b-t first gets 1; the optimum 2 needs the reverse edge b->a. */
static void test_maxflow_greedy_trap(void **st) {
    (void)st;
    rt_graph *g;
    assert_int_equal(rt_graph_init(&g, 4), FU_OK);
    int sa = rt_graph_add_edge(g, 0, 1, 1), sb = rt_graph_add_edge(g, 0, 2, 1);
    int ab = rt_graph_add_edge(g, 1, 2, 1), at = rt_graph_add_edge(g, 1, 3, 1);
    int bt = rt_graph_add_edge(g, 2, 3, 1);
    NEAR(rt_graph_max_flow(g, 0, 3), 2.0, 1e-12);
    NEAR(rt_graph_edge_flow(g, sa), 1, 1e-12);
    NEAR(rt_graph_edge_flow(g, sb), 1, 1e-12);
    NEAR(rt_graph_edge_flow(g, ab), 0, 1e-12); /* the trap edge ends unused */
    NEAR(rt_graph_edge_flow(g, at) + rt_graph_edge_flow(g, bt), 2, 1e-12);
    /* recomputation resets the previous flow */
    NEAR(rt_graph_max_flow(g, 0, 3), 2.0, 1e-12);
    NEAR(rt_graph_max_flow(g, 3, 0), 0.0, 1e-12);
    assert_true(rt_graph_max_flow(g, 0, 9) < 0);
    assert_true(rt_graph_add_edge(g, 0, 7, 1) < 0);
    assert_true(rt_graph_add_edge(g, 0, 1, -1) < 0);
    assert_true(rt_graph_add_edge(g, 0, 1, NAN) < 0);
    rt_graph_free(g);
    rt_graph_free(NULL);
}

/* CLRS figure 26.1 (max flow 23) with fractional scaling, plus flow conservation. */
static void test_maxflow_clrs(void **st) {
    (void)st;
    rt_graph *g;
    assert_int_equal(rt_graph_init(&g, 6), FU_OK);
    static const int e[][2] = {{0, 1}, {0, 2}, {1, 3}, {2, 1}, {2, 4}, {3, 2}, {3, 5}, {4, 3}, {4, 5}};
    static const double c[] = {16, 13, 12, 4, 14, 9, 20, 7, 4};
    int id[9];
    for (int i = 0; i < 9; i++) id[i] = rt_graph_add_edge(g, e[i][0], e[i][1], c[i] * 0.37);
    NEAR(rt_graph_max_flow(g, 0, 5), 23 * 0.37, 1e-9);
    double bal[6] = {0};
    for (int i = 0; i < 9; i++) {
        double f = rt_graph_edge_flow(g, id[i]);
        assert_true(f >= -1e-12 && f <= c[i] * 0.37 + 1e-9);
        bal[e[i][0]] -= f;
        bal[e[i][1]] += f;
    }
    for (int v = 1; v < 5; v++) NEAR(bal[v], 0, 1e-9);
    rt_graph_free(g);
}

/* --- tiny swarm helpers -------------------------------------------------------------------- */

static rt_model tiny_model(int L) {
    rt_model m;
    memset(&m, 0, sizeof m);
    snprintf(m.name, sizeof m.name, "tiny");
    m.n_layers = L;
    m.token_bytes = 2;
    m.act_bytes = 8;
    m.layer_bytes = 1e9;
    m.weight_vram_fraction = 0.5;
    return m;
}

/* Adds a server whose throughput holding k blocks is tputs[k-1]. */
static int add(rt_swarm *sw, const char *name, int n, const double *tputs, int first, int last) {
    rt_server d;
    memset(&d, 0, sizeof d);
    snprintf(d.name, sizeof d.name, "%s", name);
    d.n_tput = n;
    d.tput = (double *)tputs;
    d.first = first;
    d.last = last;
    int id = rt_swarm_add_server(sw, &d);
    assert_true(id >= 0);
    return id;
}

static void link_all(rt_swarm *sw, double bw) {
    for (int i = 0; i < sw->n_servers; i++) {
        assert_int_equal(rt_swarm_set_link(sw, RT_SOURCE, i, bw, 0.001), FU_OK);
        assert_int_equal(rt_swarm_set_link(sw, i, RT_SINK, bw, 0.001), FU_OK);
        for (int j = 0; j < sw->n_servers; j++)
            if (i != j) assert_int_equal(rt_swarm_set_link(sw, i, j, bw, 0.001), FU_OK);
    }
}

/* Among max flows, the least busy: A [0,2) feeds a slow S [2,4) (100 tok/s) or a fast F [2,4)
 * (1000); A's 100 go all to F (100 / 1000 busy, not 100 / 100). At 300 through A (A2),
 * F takes what it can (250 of its 250 here) and S the rest. */
static void test_flow_least_busy(void **st) {
    (void)st;
    rt_model m = tiny_model(4);
    rt_swarm sw;
    assert_int_equal(rt_swarm_init(&sw, &m), FU_OK);
    double ta[] = {200, 100}, ts[] = {200, 100}, tf[] = {2000, 1000};
    int f = add(&sw, "F", 2, tf, 2, 4), s = add(&sw, "S", 2, ts, 2, 4), a = add(&sw, "A", 2, ta, 0, 2);
    link_all(&sw, 1e9);
    rt_flow_opts rto = {RT_CONV_RUNTIME, 0};
    rt_flow fl = {0};
    double v;
    assert_int_equal(rt_flow_compute(&sw, &rto, &fl, &v), FU_OK);
    NEAR(v, 100, 1e-9);
    NEAR(fl.server_flow[f], 100, 1e-6);
    NEAR(fl.server_flow[s], 0, 1e-6);
    NEAR(rt_flow_hop_value(&fl, a, f), 100, 1e-6);
    /* F capped at 250: the 300 of a faster head fill F, then S */
    double ta2[] = {600, 300}, tf2[] = {500, 250};
    rt_swarm_remove_server(&sw, a);
    memcpy(sw.servers[f].tput, tf2, sizeof tf2);
    int a2 = add(&sw, "A2", 2, ta2, 0, 2);
    link_all(&sw, 1e9);
    assert_int_equal(rt_flow_compute(&sw, &rto, &fl, &v), FU_OK);
    NEAR(v, 300, 1e-9);
    NEAR(rt_flow_hop_value(&fl, a2, f), 250, 1e-6);
    NEAR(rt_flow_hop_value(&fl, a2, s), 50, 1e-6);
    rt_flow_free(&fl);
    rt_swarm_free(&sw);
}

/*
 * L = 4, tok = 2, act = 8. A [0,2) 100 tok/s; B [2,4) 60; C [2,4) 30; D [0,4) 10 with
 * inbound NIC 10 B/s. Links: A->B 500 B/s, A->C 400 B/s, others 1e6.
 * Runtime convention: A->B 500/10 = 50, A->C 400/10 = 40 -> 50 + 30 = 80 through A; D is
 * capped by its NIC at 10/2 = 5 (its only predecessor is the source) -> 85.
 * MILP convention: A->B 500/8 = 62.5 -> 60, A->C 50 -> 30, A carries 90 <= 100; D's node
 * capacity is min(10, min(NIC)/act) = 10/8 = 1.25 -> 91.25.
 */
static void test_flow_network_tiny(void **st) {
    (void)st;
    rt_model m = tiny_model(4);
    rt_swarm sw;
    assert_int_equal(rt_swarm_init(&sw, &m), FU_OK);
    double ta[] = {200, 100}, tb[] = {120, 60}, tc[] = {60, 30}, td[] = {40, 30, 20, 10};
    int a = add(&sw, "A", 2, ta, 0, 2), b = add(&sw, "B", 2, tb, 2, 4), c = add(&sw, "C", 2, tc, 2, 4);
    int d = add(&sw, "D", 4, td, 0, 4);
    link_all(&sw, 1e6);
    sw.servers[d].nic_in = 10;
    rt_swarm_set_link(&sw, a, b, 500, 0.001);
    rt_swarm_set_link(&sw, a, c, 400, 0.001);
    rt_flow_opts rto = {RT_CONV_RUNTIME, 0}, ilp = {RT_CONV_ILP, 0};
    rt_flow fl = {0};
    double v;
    assert_int_equal(rt_flow_compute(&sw, &rto, &fl, &v), FU_OK);
    NEAR(v, 85, 1e-9);
    NEAR(fl.server_flow[a], 80, 1e-9);
    NEAR(fl.server_flow[b], 50, 1e-9);
    NEAR(fl.server_flow[c], 30, 1e-9);
    NEAR(fl.server_flow[d], 5, 1e-9);
    NEAR(rt_flow_hop_value(&fl, a, b), 50, 1e-9);
    NEAR(rt_flow_hop_value(&fl, RT_SOURCE, a), 80, 1e-9); /* source -> A */
    NEAR(rt_flow_hop_value(&fl, d, RT_SINK), 5, 1e-9);    /* D -> sink */
    NEAR(rt_max_flow(&sw, &ilp), 91.25, 1e-9);
    /* exact boundaries only: no B -> C hop, and partial execution adds none here */
    assert_false(rt__hop_valid(&sw, b, c, 1));
    assert_true(rt__hop_valid(&sw, a, b, 0));
    /* partial execution: E [1,3) can take over from A (ends at 2, inside E's span) */
    double te[] = {500, 500};
    int e = add(&sw, "E", 2, te, 1, 3);
    assert_false(rt__hop_valid(&sw, a, e, 0));
    assert_true(rt__hop_valid(&sw, a, e, 1));
    assert_true(rt__hop_valid(&sw, e, d, 0) == 0);
    /* removing a server removes its flow */
    assert_int_equal(rt_swarm_remove_server(&sw, c), FU_OK);
    NEAR(rt_max_flow(&sw, &rto), 55, 1e-9);
    rt_flow_free(&fl);
    rt_flow_free(&fl);
    rt_swarm_free(&sw);
}

/* --- placement ------------------------------------------------------------------------------ */

/* A heterogeneous swarm: 12 servers of 3 kinds, VRAM limiting one kind below its table. */
static void make_hetero(rt_swarm *sw, int L) {
    rt_model m = tiny_model(L);
    assert_int_equal(rt_swarm_init(sw, &m), FU_OK);
    double big[12], mid[8], small[6];
    for (int k = 1; k <= 12; k++) big[k - 1] = 9000.0 / (k + 0.5);
    for (int k = 1; k <= 8; k++) mid[k - 1] = 3000.0 / (k + 0.3);
    for (int k = 1; k <= 6; k++) small[k - 1] = 2000.0 / (k + 1);
    for (int i = 0; i < 12; i++) {
        char name[16];
        snprintf(name, sizeof name, "s%d", i);
        int id = i % 3 == 0 ? add(sw, name, 12, big, 0, 0)
                            : i % 3 == 1 ? add(sw, name, 8, mid, 0, 0) : add(sw, name, 6, small, 0, 0);
        if (i % 3 == 0) sw->servers[id].vram_bytes = 20e9; /* 0.5 * 20e9 / 1e9 = 10 blocks */
    }
    link_all(sw, 1e9);
}

static void check_valid(const rt_swarm *sw) {
    assert_int_equal(rt_swarm_uncovered(sw, NULL), 0);
    for (int i = 0; i < sw->n_servers; i++) {
        const rt_server *s = &sw->servers[i];
        if (!rt_swarm_serving(sw, i)) continue;
        assert_true(s->first >= 0 && s->last <= sw->model.n_layers && s->last > s->first);
        assert_true(s->last - s->first <= rt_swarm_max_layers(sw, i));
    }
}

static void test_vram_limit(void **st) {
    (void)st;
    rt_swarm sw;
    make_hetero(&sw, 40);
    assert_int_equal(rt_swarm_max_layers(&sw, 0), 10);
    assert_int_equal(rt_swarm_max_layers(&sw, 1), 8);
    assert_int_equal(rt_swarm_set_span(&sw, 0, 0, 11), FU_ERR_RANGE);
    assert_int_equal(rt_swarm_set_span(&sw, 0, 35, 45), FU_ERR_RANGE);
    assert_int_equal(rt_swarm_set_span(&sw, 0, 30, 40), FU_OK);
    assert_int_equal(rt_swarm_set_span(&sw, 99, 0, 1), FU_ERR_INVALID);
    rt_swarm_free(&sw);
}

static void test_placements(void **st) {
    (void)st;
    rt_swarm sw;
    make_hetero(&sw, 40);
    rt_flow_opts fo = {RT_CONV_RUNTIME, 0}, fp = {RT_CONV_RUNTIME, 1};
    assert_int_equal(rt_place_petals(&sw), FU_OK);
    check_valid(&sw);
    double petals = rt_max_flow(&sw, &fp), petals_exact = rt_max_flow(&sw, &fo);
    assert_true(petals > 0);
    assert_int_equal(rt_place_swarm(&sw), FU_OK);
    check_valid(&sw);
    double swarm = rt_max_flow(&sw, &fo);
    rt_search_opts so = {0.5, 7, fo, 0, 0};
    rt_search_stats ss;
    assert_int_equal(rt_place_search(&sw, &so, &ss), FU_OK);
    check_valid(&sw);
    double search = rt_max_flow(&sw, &fo);
    NEAR(ss.flow, search, 1e-6);
    assert_true(search >= swarm - 1e-9);
    assert_true(search >= petals_exact - 1e-9);
    assert_true(search >= petals * 0.999);
    assert_true(ss.evaluations > 0 && ss.seconds < 5);
    /* the flow cannot beat the per-block capacity bound sum_i max_k k tput_i(k) / L */
    double bound = 0;
    for (int i = 0; i < sw.n_servers; i++) {
        double b = 0;
        for (int k = 1; k <= rt_swarm_max_layers(&sw, i); k++)
            if (k * rt_swarm_tput(&sw, i, k) > b) b = k * rt_swarm_tput(&sw, i, k);
        bound += b / 40;
    }
    assert_true(search <= bound + 1e-6);
    /* too little capacity to cover the model: a clear error, not a crash */
    rt_swarm few;
    rt_model m = tiny_model(40);
    assert_int_equal(rt_swarm_init(&few, &m), FU_OK);
    double t[3] = {10, 5, 3};
    add(&few, "x", 3, t, 0, 0);
    assert_int_equal(rt_place_petals(&few), FU_ERR_EXHAUSTED);
    assert_int_equal(rt_place_search(&few, &so, NULL), FU_ERR_EXHAUSTED);
    rt_swarm_free(&few);
    rt_swarm_free(&sw);
}

/* Join a spare, then a server leaves; rebalancing restores coverage, and replaying its moves
 * one by one on the pre-rebalance swarm never uncovers a block that was covered. */
static void test_join_leave(void **st) {
    (void)st;
    rt_swarm sw;
    make_hetero(&sw, 40);
    rt_flow_opts fo = {RT_CONV_RUNTIME, 0};
    assert_int_equal(rt_place_swarm(&sw), FU_OK);
    double before = rt_max_flow(&sw, &fo);
    double tn[6];
    for (int k = 1; k <= 6; k++) tn[k - 1] = 5000.0 / k;
    int nid = add(&sw, "new", 6, tn, 0, 0);
    for (int i = 0; i < sw.n_servers; i++) {
        rt_swarm_set_link(&sw, i, nid, 1e9, 0.001);
        rt_swarm_set_link(&sw, nid, i, 1e9, 0.001);
    }
    rt_swarm_set_link(&sw, RT_SOURCE, nid, 1e9, 0.001);
    rt_swarm_set_link(&sw, nid, RT_SINK, 1e9, 0.001);
    int f, l;
    double gain;
    assert_int_equal(rt_place_join(&sw, nid, &fo, &f, &l, &gain), FU_OK);
    assert_true(f >= 0 && l > f && l - f <= 6 && l <= 40);
    assert_int_equal(rt_swarm_set_span(&sw, nid, f, l), FU_OK);
    double after = rt_max_flow(&sw, &fo);
    NEAR(after - before, gain, 1e-6);
    assert_true(after >= before - 1e-9);
    /* a server leaves: its stage may lose coverage */
    int victim = -1;
    for (int i = 0; i < sw.n_servers && victim < 0; i++) {
        rt_swarm probe;
        assert_int_equal(rt_swarm_clone(&probe, &sw), FU_OK);
        rt_swarm_remove_server(&probe, i);
        if (rt_swarm_uncovered(&probe, NULL)) victim = i;
        rt_swarm_free(&probe);
    }
    assert_true(victim >= 0);
    rt_swarm_remove_server(&sw, victim);
    assert_true(rt_swarm_uncovered(&sw, NULL) > 0);
    assert_true(rt_max_flow(&sw, &fo) == 0);
    rt_swarm pre;
    assert_int_equal(rt_swarm_clone(&pre, &sw), FU_OK);
    rt_move mv[64];
    int nm = 0;
    assert_int_equal(rt_place_rebalance(&sw, &fo, 0.02, 64, mv, &nm), FU_OK);
    assert_true(nm > 0);
    check_valid(&sw);
    assert_true(rt_max_flow(&sw, &fo) > 0);
    int unc = rt_swarm_uncovered(&pre, NULL);
    for (int i = 0; i < nm; i++) {
        assert_int_equal(pre.servers[mv[i].server].first, mv[i].old_first);
        assert_int_equal(rt_swarm_set_span(&pre, mv[i].server, mv[i].new_first, mv[i].new_last), FU_OK);
        int u = rt_swarm_uncovered(&pre, NULL);
        assert_true(u <= unc);
        unc = u;
    }
    assert_int_equal(unc, 0);
    rt_swarm_free(&pre);
    rt_swarm_free(&sw);
}

/* --- routing ------------------------------------------------------------------------------ */

/* Routes `n` requests of 10 tokens, each released at once; counts the first server chosen. */
static void route_released(rt_router *r, int n, int *cnt) {
    for (int i = 0; i < n; i++) {
        rt_path *p;
        assert_int_equal(rt_route_request(r, 10, 10, NULL, &p), FU_OK);
        cnt[p->servers[0]]++;
        rt_release(p);
    }
}

/* A [0,2) 300 and B [0,2) 100 feed C [2,4): live load forgets a released request, cumulative
 * load keeps every token (prompts and decode steps), so the split follows the flow 3:1. */
static void test_iwrr_cumulative(void **st) {
    (void)st;
    rt_model m = tiny_model(4);
    rt_swarm sw;
    assert_int_equal(rt_swarm_init(&sw, &m), FU_OK);
    double ta[] = {600, 300}, tb[] = {200, 100}, tc[] = {2000, 1000};
    int a = add(&sw, "A", 2, ta, 0, 2), b = add(&sw, "B", 2, tb, 0, 2);
    add(&sw, "C", 2, tc, 2, 4);
    link_all(&sw, 1e9);
    for (int mode = RT_IWRR_LIVE; mode <= RT_IWRR_CUMULATIVE; mode++) {
        rt_route_opts ro = {{RT_CONV_RUNTIME, 0}, 0, (rt_iwrr_load)mode};
        rt_router *r;
        assert_int_equal(rt_router_init(&r, &sw, &ro), FU_OK);
        int cnt[3] = {0};
        route_released(r, 40, cnt);
        assert_int_equal(cnt[a], mode == RT_IWRR_LIVE ? 40 : 30);
        assert_int_equal(cnt[b], mode == RT_IWRR_LIVE ? 0 : 10);
        rt_router_free(r);
        /* decode steps: 50 one-token steps on A's request count only when cumulative */
        assert_int_equal(rt_router_init(&r, &sw, &ro), FU_OK);
        rt_path *p, *q;
        assert_int_equal(rt_route_request(r, 10, 250, NULL, &p), FU_OK);
        assert_int_equal(p->servers[0], a);
        for (int i = 0; i < 50; i++) assert_int_equal(rt_path_step(p, 1), FU_OK);
        /* live: A holds 250 ((250 + 250) / 300 < 250 / 100); cumulative: A counts 60 tokens
         * ((60 + 10) / 300 > 10 / 100) */
        assert_int_equal(rt_route_request(r, 10, 250, NULL, &q), FU_OK);
        assert_int_equal(q->servers[0], mode == RT_IWRR_LIVE ? a : b);
        NEAR(rt_router_load(r, a), mode == RT_IWRR_LIVE ? 500 : 250, 1e-9); /* server load stays live */
        rt_release(p), rt_release(q);
        assert_int_equal(rt_route_request(r, 0, 10, NULL, &p), FU_ERR_INVALID);
        assert_int_equal(rt_route_request(r, 11, 10, NULL, &p), FU_ERR_INVALID);
        assert_int_equal(rt_path_step(NULL, 1), FU_OK);
        rt_router_free(r);
    }
    rt_swarm_free(&sw);
}

/* A [0,2) 300 and B [0,2) 100 feed C [2,4) 1000; W [0,2) carries 1% of the flow (skipped). */
static void test_iwrr(void **st) {
    (void)st;
    rt_model m = tiny_model(4);
    rt_swarm sw;
    assert_int_equal(rt_swarm_init(&sw, &m), FU_OK);
    double ta[] = {600, 300}, tb[] = {200, 100}, tw[] = {8, 4}, tc[] = {2000, 1000};
    double kvc[] = {1e9, 1e9};
    int a = add(&sw, "A", 2, ta, 0, 2), b = add(&sw, "B", 2, tb, 0, 2), w = add(&sw, "W", 2, tw, 0, 2);
    int c = add(&sw, "C", 2, tc, 2, 4);
    memcpy(sw.servers[c].kv_tokens, kvc, sizeof kvc); /* the swarm's own copy of the table */
    link_all(&sw, 1e9);
    rt_router *r;
    rt_route_opts ro = {{RT_CONV_RUNTIME, 0}, 0, RT_IWRR_LIVE};
    assert_int_equal(rt_router_init(&r, &sw, &ro), FU_OK);
    NEAR(rt_router_flow(r)->value, 404, 1e-9);
    rt_path *paths[400];
    int cnt[4] = {0};
    for (int i = 0; i < 400; i++) {
        assert_int_equal(rt_route(r, 10, &paths[i]), FU_OK);
        assert_int_equal(paths[i]->n_hops, 2);
        assert_int_equal(paths[i]->servers[1], c);
        assert_int_equal(paths[i]->first[0], 0);
        assert_int_equal(paths[i]->last[0], 2);
        assert_int_equal(paths[i]->first[1], 2);
        assert_int_equal(paths[i]->last[1], 4);
        cnt[paths[i]->servers[0]]++;
        if (i == 39) { /* interleaved: proportions hold early too */
            assert_true(abs(cnt[a] - 30) <= 1 && abs(cnt[b] - 10) <= 1);
        }
    }
    assert_int_equal(cnt[w], 0);
    assert_true(abs(cnt[a] - 300) <= 1);
    assert_true(abs(cnt[b] - 100) <= 1);
    NEAR(rt_router_load(r, c), 4000, 1e-9);
    for (int i = 0; i < 400; i++) rt_release(paths[i]);
    NEAR(rt_router_load(r, c), 0, 1e-9);
    NEAR(rt_router_load(r, a), 0, 1e-9);
    rt_release(NULL);
    /* KV admission: C admits 25 requests of 40 tokens, then the swarm is full */
    sw.servers[c].kv_tokens[1] = 1000;
    for (int i = 0; i < 25; i++) assert_int_equal(rt_route(r, 40, &paths[i]), FU_OK);
    rt_path *extra = NULL;
    assert_int_equal(rt_route(r, 40, &extra), FU_ERR_EXHAUSTED);
    assert_null(extra);
    rt_release(paths[3]);
    assert_int_equal(rt_route(r, 40, &paths[3]), FU_OK);
    for (int i = 0; i < 25; i++) rt_release(paths[i]);
    /* no chain: the only last-stage server leaves */
    rt_swarm_remove_server(&sw, c);
    assert_int_equal(rt_router_update(r), FU_OK);
    assert_int_equal(rt_route(r, 10, &extra), FU_ERR_NOT_FOUND);
    assert_int_equal(rt_route(r, 0, &extra), FU_ERR_INVALID);
    rt_router_free(r);
    rt_router_free(NULL);
    rt_swarm_free(&sw);
}

/* --- simulator ---------------------------------------------------------------------------- */

static void test_sim(void **st) {
    (void)st;
    rt_model m = tiny_model(4);
    rt_swarm sw;
    assert_int_equal(rt_swarm_init(&sw, &m), FU_OK);
    double ta[] = {600, 300}, tc[] = {800, 400};
    add(&sw, "A", 2, ta, 0, 2);
    add(&sw, "C", 2, tc, 2, 4);
    link_all(&sw, 1e9);
    rt_sim_opts so;
    memset(&so, 0, sizeof so);
    so.duration_s = 200;
    so.warmup_s = 20;
    so.concurrency = 64;
    so.prompt_len = 30;
    so.output_len = 10;
    rt_sim_result res;
    assert_int_equal(rt_sim_run(&sw, &so, &res), FU_OK);
    NEAR(res.max_flow, 300, 1e-9);
    /* saturated: tokens processed = prompt + decode ~ the bottleneck's 300 tokens/s */
    double total = res.decode_tps + res.prompt_tps;
    assert_true(total <= 300 * 1.02 && total >= 300 * 0.9);
    NEAR(res.decode_tps / total, 10.0 / 40.0, 0.03);
    assert_true(res.completed > 0 && res.rejected == 0);
    /* open loop at a light rate: throughput follows the arrivals */
    so.concurrency = 0;
    so.feed = RT_FEED_POISSON;
    so.arrival_rate = 2; /* 2 requests/s x 10 decode tokens */
    assert_int_equal(rt_sim_run(&sw, &so, &res), FU_OK);
    NEAR(res.decode_tps, 20, 3);
    assert_true(res.mean_decode_latency_s < 0.05);
    rt_swarm_free(&sw);
}

/* --- loaders ------------------------------------------------------------------------------ */

static void test_ini_and_exprs(void **st) {
    (void)st;
    double v;
    assert_int_equal(rt__eval_expr("12.5 * mbps", &v), FU_OK);
    NEAR(v, 12.5e6, 1e-6);
    assert_int_equal(rt__eval_expr("1 * MilliSec", &v), FU_OK);
    NEAR(v, 1e-3, 1e-15);
    assert_int_equal(rt__eval_expr("16*GB", &v), FU_OK);
    NEAR(v, 16e9, 1);
    assert_int_equal(rt__eval_expr("3 * parsecs", &v), FU_ERR_FORMAT);
    assert_int_equal(rt__eval_expr("", &v), FU_ERR_FORMAT);
    assert_int_equal(rt__eval_expr("1 *", &v), FU_ERR_FORMAT);
    int *l, n;
    assert_int_equal(rt__parse_int_list("['source', 1, 22, 'sink']", &l, &n), FU_OK);
    assert_int_equal(n, 4);
    assert_int_equal(l[0], RT_SOURCE);
    assert_int_equal(l[2], 22);
    assert_int_equal(l[3], RT_SINK);
    free(l);
    assert_int_equal(rt__parse_int_list("[1, 2", &l, &n), FU_ERR_FORMAT);
    assert_int_equal(rt__parse_int_list("[1, 'x']", &l, &n), FU_ERR_FORMAT);
    assert_int_equal(rt__parse_int_list("1, 2]", &l, &n), FU_ERR_FORMAT);
    rt_ini ini;
    const char *t = "# c\n[A]\nx = 1 * gbps\n[B]\ny=2\n";
    assert_int_equal(rt__ini_parse(&ini, t, strlen(t)), FU_OK);
    assert_string_equal(rt__ini_get(&ini, "A", "x"), "1 * gbps");
    assert_null(rt__ini_get(&ini, "A", "y"));
    rt__ini_free(&ini);
    const char *bad = "[A\nx=1\n";
    assert_int_equal(rt__ini_parse(&ini, bad, strlen(bad)), FU_ERR_FORMAT);
    const char *bad2 = "[A]\nnovalue\n";
    assert_int_equal(rt__ini_parse(&ini, bad2, strlen(bad2)), FU_ERR_FORMAT);
}

static void test_json_format(void **st) {
    (void)st;
    const char *ok =
        "{\"model\": {\"name\": \"m\", \"n_layers\": 4, \"token_bytes\": 2, \"activation_bytes\": 8},"
        " \"default_link\": {\"bandwidth\": 1e9, \"latency\": 0.001},"
        " \"servers\": [{\"name\": \"a\", \"layer_tokens_per_s\": 400, \"max_layers\": 4, \"span\": [0, 2]},"
        "               {\"name\": \"b\", \"tokens_per_s_by_layers\": [500, 250], \"span\": [2, 4],"
        "                \"kv_tokens_by_layers\": [100, 50]},"
        "               {\"name\": \"c\", \"tokens_per_s_by_layers\": [1], \"state\": \"spare\"}],"
        " \"links\": [{\"from\": \"a\", \"to\": \"b\", \"bandwidth\": 1000, \"latency\": 0.01,"
        "              \"bidirectional\": false}]}";
    rt_swarm sw;
    assert_int_equal(rt_swarm_parse_json(&sw, ok, strlen(ok)), FU_OK);
    assert_int_equal(sw.n_servers, 3);
    assert_int_equal(sw.servers[2].state, RT_SERVER_SPARE);
    NEAR(rt_swarm_tput(&sw, 0, 2), 200, 1e-9);
    NEAR(rt_swarm_kv_tokens(&sw, 1, 2), 50, 1e-9);
    /* a (200) -> b (250) over a 1000 B/s link: 1000 / 10 = 100 tokens/s */
    NEAR(rt_max_flow(&sw, NULL), 100, 1e-9);
    NEAR(rt_swarm_link(&sw, 1, 0).bandwidth, 1e9, 1); /* not bidirectional: default stays */
    char path[] = "/tmp/test_router_XXXXXX";
    int fd = mkstemp(path);
    assert_true(fd >= 0);
    close(fd);
    assert_int_equal(rt_swarm_save_json(&sw, path), FU_OK);
    rt_swarm back;
    assert_int_equal(rt_swarm_load_json(&back, path), FU_OK);
    unlink(path);
    NEAR(rt_max_flow(&back, NULL), 100, 1e-9);
    assert_int_equal(back.servers[1].last, 4);
    rt_swarm_free(&back);
    rt_swarm_free(&sw);
    static const char *bad[] = {
        "", "[]", "{\"model\": {}}", "{\"model\": {\"n_layers\": 4}, \"servers\": []}",
        "{\"model\": {\"n_layers\": 4, \"activation_bytes\": 8}, \"servers\": [{\"name\": \"a\"}]}",
        "{\"model\": {\"n_layers\": 4, \"activation_bytes\": 8}, \"servers\": [{\"name\": \"a\","
        " \"layer_tokens_per_s\": 1, \"max_layers\": 2, \"span\": [0, 3]}]}",
        "{\"model\": {\"n_layers\": 4, \"activation_bytes\": 8}, \"servers\": [{\"name\": \"a\","
        " \"tokens_per_s_by_layers\": [1, -2]}]}",
        "{\"model\": {\"n_layers\": 4, \"activation_bytes\": 8}, \"servers\": [{\"name\": \"a\","
        " \"tokens_per_s_by_layers\": [1]}], \"links\": [{\"from\": \"a\", \"to\": \"zz\"}]}",
        "{\"model\": {\"n_layers\": 4, \"activation_bytes\": 8}, \"servers\": [{\"name\": \"a\","
        " \"tokens_per_s_by_layers\": [1]}, {\"name\": \"a\", \"tokens_per_s_by_layers\": [1]}]}",
        "{\"model\": {\"n_layers\": 4, \"activation_bytes\": 8}, \"servers\": [{\"name\": \"a\","
        " \"tokens_per_s_by_layers\": [1], \"state\": \"zombie\"}]}",
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        int rc = rt_swarm_parse_json(&sw, bad[i], strlen(bad[i]));
        assert_true(rc == FU_ERR_FORMAT || rc == FU_ERR_RANGE || rc == FU_ERR_INVALID);
        rt_swarm_free(&sw);
    }
}

/* Helix's single-region cluster and its published MILP placement (1289.6 tokens/s). */
static void test_helix_files(void **st) {
    (void)st;
    const char *src = getenv("FUSION_SOURCE_DIR");
    char H[400];
    snprintf(H, sizeof H, "%s/../shared/anchors/helix", src ? src : ".");
    if (access(H, R_OK)) skip();
    char a[512], b[512], c[512], d[512], e[512];
    snprintf(a, sizeof a, "%s/derived/model_constants.json", H);
    snprintf(b, sizeof b, "%s/artifact_evaluation/single_cluster/config/cluster24.ini", H);
    snprintf(c, sizeof c, "%s/simulator/model_manager/google_machine_profiles.ini", H);
    snprintf(d, sizeof d, "%s/derived/node_capacity_by_layers.csv", H);
    snprintf(e, sizeof e, "%s/artifact_evaluation/single_cluster/layout_llama70b/ilp/ilp_sol.ini", H);
    rt_model m;
    assert_int_equal(rt_helix_load_model(&m, a, "llama2_70b"), FU_OK);
    assert_int_equal(m.n_layers, 80);
    NEAR(m.act_bytes, 16384, 0);
    NEAR(m.layer_bytes, 1.53e9, 1);
    NEAR(m.kv_bytes_per_token_layer, 4096, 0);
    assert_int_equal(rt_helix_load_model(&m, a, "gpt5"), FU_ERR_NOT_FOUND);
    assert_int_equal(rt_helix_load_model(&m, a, "llama2_70b"), FU_OK);
    rt_swarm sw;
    assert_int_equal(rt_swarm_init(&sw, &m), FU_OK);
    assert_int_equal(rt_helix_load_cluster(&sw, b, c, d), FU_OK);
    assert_int_equal(sw.n_servers, 24);
    assert_string_equal(sw.servers[6].kind, "A100");
    assert_int_equal(rt_swarm_max_layers(&sw, 6), 12);
    assert_int_equal(rt_swarm_max_layers(&sw, 1), 4); /* T4 */
    NEAR(rt_swarm_tput(&sw, 1, 4), 757.853, 1e-3);
    NEAR(rt_swarm_kv_tokens(&sw, 6, 11), 3795264.0 / 11, 1e-6);
    assert_int_equal(rt_helix_load_placement(&sw, e), FU_OK);
    rt_flow_opts ilp = {RT_CONV_ILP, 0};
    NEAR(rt_max_flow(&sw, &ilp), 1289.6, 0.05);
    NEAR(rt_max_flow(&sw, NULL), 1289.6, 0.05);
    assert_int_equal(rt_helix_load_placement(&sw, "/nonexistent.ini"), FU_ERR_IO);
    rt_swarm_free(&sw);
}

/* Slots of GONE servers are reused by rt_swarm_add_server_at, so churn keeps the swarm (and a
 * router over it) bounded; a slot a path still holds is reported busy. */
static void test_slot_reuse(void **st) {
    (void)st;
    rt_model m = tiny_model(4);
    rt_swarm sw;
    assert_int_equal(rt_swarm_init(&sw, &m), FU_OK);
    double t[] = {100, 50, 30, 20};
    int a = add(&sw, "A", 4, t, 0, 4);
    link_all(&sw, 1e9);
    rt_router *r;
    assert_int_equal(rt_router_init(&r, &sw, NULL), FU_OK);
    rt_path *p;
    assert_int_equal(rt_route(r, 10, &p), FU_OK);
    assert_int_equal(rt_router_busy(r, a), 1);
    /* a slot that is not GONE cannot be reused */
    rt_server d;
    memset(&d, 0, sizeof d);
    d.n_tput = 4;
    d.tput = t;
    d.first = 0;
    d.last = 4;
    assert_true(rt_swarm_add_server_at(&sw, a, &d) < 0);
    for (int i = 0; i < 1000; i++) {
        snprintf(d.name, sizeof d.name, "churn-%d", i);
        int slot = -1;
        for (int k = 0; k < sw.n_servers && slot < 0; k++)
            if (sw.servers[k].state == RT_SERVER_GONE && !rt_router_busy(r, k)) slot = k;
        int id = rt_swarm_add_server_at(&sw, slot, &d);
        assert_true(id >= 0);
        assert_true(id != a);
        assert_string_equal(sw.servers[id].name, d.name);
        assert_int_equal(sw.servers[id].first, 0);
        assert_int_equal(rt_swarm_link(&sw, RT_SOURCE, id).bandwidth, 0); /* links start absent */
        link_all(&sw, 1e9);
        assert_int_equal(rt_router_update(r), FU_OK);
        NEAR(rt_router_flow(r)->value, 40, 1e-6); /* A and the newcomer, 20 each with four blocks */
        assert_int_equal(rt_swarm_remove_server(&sw, id), FU_OK);
        assert_int_equal(rt_router_update(r), FU_OK);
    }
    assert_true(sw.n_servers <= 2);
    assert_int_equal(rt_router_busy(r, a), 1);
    rt_release(p);
    assert_int_equal(rt_router_busy(r, a), 0);
    /* A leaves; its slot is free once no path holds it */
    assert_int_equal(rt_swarm_remove_server(&sw, a), FU_OK);
    assert_int_equal(rt_swarm_add_server_at(&sw, a, &d), a);
    rt_router_free(r);
    rt_swarm_free(&sw);
}

/* Training chains: whole spans that tile the model, fewest hops, then the fastest bottleneck;
 * overlapping or partial spans never join one, lost servers are avoided. */
static void test_train_chain(void **st) {
    (void)st;
    rt_model m = tiny_model(6);
    rt_swarm sw;
    assert_int_equal(rt_swarm_init(&sw, &m), FU_OK);
    double t[] = {60, 30, 20, 15, 12, 10}, fast[] = {120, 60, 40, 30, 24, 20};
    int ids[8], n = -1;
    assert_int_equal(rt_train_chain(&sw, NULL, 0, 8, ids, &n), FU_ERR_NOT_FOUND); /* nobody */
    int a = add(&sw, "A", 6, fast, 0, 3), b = add(&sw, "B", 6, t, 2, 6); /* overlap: no tiling */
    assert_int_equal(rt_train_chain(&sw, NULL, 0, 8, ids, &n), FU_ERR_NOT_FOUND);
    int c = add(&sw, "C", 6, t, 3, 6), d = add(&sw, "D", 6, fast, 3, 6);
    assert_int_equal(rt_train_chain(&sw, NULL, 0, 8, ids, &n), FU_OK);
    assert_int_equal(n, 2);
    assert_int_equal(ids[0], a);
    assert_int_equal(ids[1], d); /* D is faster for the same span */
    int e = add(&sw, "E", 6, t, 0, 6);            /* one hop beats two */
    assert_int_equal(rt_train_chain(&sw, NULL, 0, 8, ids, &n), FU_OK);
    assert_true(n == 1 && ids[0] == e);
    const int lost[] = {e, d};
    assert_int_equal(rt_train_chain(&sw, lost, 2, 8, ids, &n), FU_OK);
    assert_true(n == 2 && ids[0] == a && ids[1] == c);
    assert_int_equal(rt_train_chain(&sw, lost, 2, 1, ids, &n), FU_ERR_NOT_FOUND); /* more hops than max */
    assert_int_equal(rt_swarm_remove_server(&sw, c), FU_OK);
    assert_int_equal(rt_train_chain(&sw, lost, 2, 8, ids, &n), FU_ERR_NOT_FOUND);
    (void)b;
    rt_swarm_free(&sw);
}

/* Cache affinity: among two equal servers of the first span, one that holds the request's prefix
 * gets it while the load is even, and the other takes over once the first is a request ahead:
 * a hit never offsets more than one request's work. */
static void test_iwrr_cache_affinity(void **st) {
    (void)st;
    rt_model m = tiny_model(4);
    rt_swarm sw;
    assert_int_equal(rt_swarm_init(&sw, &m), FU_OK);
    double t[] = {400, 200}, tc[] = {2000, 1000};
    int a = add(&sw, "A", 2, t, 0, 2), b = add(&sw, "B", 2, t, 0, 2), c = add(&sw, "C", 2, tc, 2, 4);
    link_all(&sw, 1e9);
    rt_router *r;
    rt_route_opts ro = {{RT_CONV_RUNTIME, 0}, 0, RT_IWRR_LIVE};
    assert_int_equal(rt_router_init(&r, &sw, &ro), FU_OK);
    int cached[3] = {0, 0, 0};
    cached[b] = 60;
    rt_path *p[4];
    assert_int_equal(rt_route_cached(r, 100, cached, &p[0]), FU_OK);
    assert_int_equal(p[0]->servers[0], b); /* even load: the server with the prefix */
    assert_int_equal(rt_route_cached(r, 100, cached, &p[1]), FU_OK);
    assert_int_equal(p[1]->servers[0], a); /* b is a request ahead: 60 cached tokens do not outweigh it */
    cached[b] = 100000;                    /* however much is cached, at most one request's work */
    assert_int_equal(rt_route_cached(r, 100, cached, &p[2]), FU_OK);
    assert_int_equal(p[2]->servers[0], b);
    assert_int_equal(rt_route_cached(r, 100, cached, &p[3]), FU_OK);
    assert_int_equal(p[3]->servers[0], a);
    assert_int_equal(p[3]->servers[1], c);
    for (int i = 0; i < 4; i++) rt_release(p[i]);
    rt_router_free(r);
    rt_swarm_free(&sw);
}

/* --- scale: sparse links, pruning, compact files, deterministic search, wide fan-out ------- */

/* A complete swarm of n one-block-table servers whose link i -> j has a distinct bandwidth. */
static void make_ranked(rt_swarm *sw, int n) {
    rt_model m = tiny_model(4);
    assert_int_equal(rt_swarm_init(sw, &m), FU_OK);
    double t[] = {100, 50, 30, 20};
    for (int i = 0; i < n; i++) {
        char name[16];
        snprintf(name, sizeof name, "r%d", i);
        add(sw, name, 4, t, 0, 0);
    }
    for (int i = 0; i < n; i++)
        for (int j = 0; j < n; j++)
            if (i != j) assert_int_equal(rt_swarm_set_link(sw, i, j, 1000 + 37 * ((i * 7 + j * 13) % 31) + j, 0.001), FU_OK);
}

/* 1 if the link i -> j is among the k fastest out-links of i in `full` (ties: lower id). */
static int in_top_out(const rt_swarm *full, int i, int j, int k) {
    double bw = rt_swarm_link(full, i, j).bandwidth;
    int better = 0;
    for (int x = 0; x < full->n_servers; x++) {
        double b = rt_swarm_link(full, i, x).bandwidth;
        better += x != i && x != j && (b > bw || (b == bw && x < j));
    }
    return better < k;
}

static int in_top_in(const rt_swarm *full, int i, int j, int k) {
    double bw = rt_swarm_link(full, i, j).bandwidth;
    int better = 0;
    for (int x = 0; x < full->n_servers; x++) {
        double b = rt_swarm_link(full, x, j).bandwidth;
        better += x != i && x != j && (b > bw || (b == bw && x < i));
    }
    return better < k;
}

/* Pruning keeps exactly the links among the k fastest of their source's out-links or of their
 * destination's in-links, with their values; a default link becomes k explicit ones. */
static void test_prune_links(void **st) {
    (void)st;
    rt_swarm sw, full;
    make_ranked(&sw, 9);
    assert_int_equal(rt_swarm_clone(&full, &sw), FU_OK);
    assert_int_equal(rt_swarm_out_degree(&sw, 0), 8);
    assert_int_equal(rt_swarm_prune_links(&sw, 0), FU_ERR_INVALID);
    assert_int_equal(rt_swarm_prune_links(&sw, 2), FU_OK);
    int kept = 0;
    for (int i = 0; i < 9; i++)
        for (int j = 0; j < 9; j++) {
            if (i == j) continue;
            int want = in_top_out(&full, i, j, 2) || in_top_in(&full, i, j, 2);
            double bw = rt_swarm_link(&sw, i, j).bandwidth;
            if (want) NEAR(bw, rt_swarm_link(&full, i, j).bandwidth, 0);
            else NEAR(bw, 0, 0);
            kept += want;
        }
    int deg = 0;
    for (int i = 0; i < 9; i++) deg += rt_swarm_out_degree(&sw, i);
    assert_int_equal(deg, kept);
    assert_true(kept <= 2 * 2 * 9 && kept >= 2 * 9);
    int to = -1;
    rt_link l = rt_swarm_out_link(&sw, 0, 0, &to);
    assert_true(to > 0 && l.bandwidth > 0);
    rt_swarm_free(&full);
    rt_swarm_free(&sw);
    /* the default link: every pair reads it until pruning keeps the lowest ids */
    const char *js = "{\"model\": {\"name\": \"m\", \"n_layers\": 4, \"activation_bytes\": 8},"
                     " \"default_link\": {\"bandwidth\": 500, \"latency\": 0.002}, \"servers\": ["
                     "{\"name\": \"a\", \"layer_tokens_per_s\": 100, \"max_layers\": 4},"
                     "{\"name\": \"b\", \"layer_tokens_per_s\": 100, \"max_layers\": 4},"
                     "{\"name\": \"c\", \"layer_tokens_per_s\": 100, \"max_layers\": 4},"
                     "{\"name\": \"d\", \"layer_tokens_per_s\": 100, \"max_layers\": 4}],"
                     " \"links\": [[3, 2, 900, 0.001]]}";
    assert_int_equal(rt_swarm_parse_json(&sw, js, strlen(js)), FU_OK);
    assert_int_equal(rt_swarm_out_degree(&sw, 0), 0);
    NEAR(rt_swarm_link(&sw, 0, 3).bandwidth, 500, 0);
    assert_int_equal(rt_swarm_prune_links(&sw, 1), FU_OK);
    NEAR(sw.default_link.bandwidth, 0, 0);
    NEAR(rt_swarm_link(&sw, 0, 1).bandwidth, 500, 0); /* a's best out (tie: lowest id) */
    NEAR(rt_swarm_link(&sw, 1, 0).bandwidth, 500, 0); /* b's best out, a's best in */
    NEAR(rt_swarm_link(&sw, 3, 2).bandwidth, 900, 0); /* d's fastest */
    NEAR(rt_swarm_link(&sw, 0, 3).bandwidth, 500, 0); /* d's best in */
    NEAR(rt_swarm_link(&sw, 2, 3).bandwidth, 0, 0);   /* nobody's best */
    NEAR(rt_swarm_link(&sw, RT_SOURCE, 3).bandwidth, 500, 0); /* coordinator links stay */
    rt_swarm_free(&sw);
}

/* A reused slot starts with no links either way, in its lists and in its neighbours'. */
static void test_links_slot_reuse(void **st) {
    (void)st;
    rt_model m = tiny_model(4);
    rt_swarm sw;
    assert_int_equal(rt_swarm_init(&sw, &m), FU_OK);
    double t[] = {100, 50, 30, 20}, ta[] = {400, 200};
    int a = add(&sw, "A", 2, ta, 0, 2), b = add(&sw, "B", 4, t, 2, 4), c = add(&sw, "C", 4, t, 2, 4);
    link_all(&sw, 1e6);
    assert_int_equal(rt_swarm_out_degree(&sw, a), 2);
    NEAR(rt_max_flow(&sw, NULL), 50 + 50, 1e-9);
    assert_int_equal(rt_swarm_remove_server(&sw, b), FU_OK);
    NEAR(rt_swarm_link(&sw, a, b).bandwidth, 1e6, 0); /* a GONE server keeps its links */
    NEAR(rt_max_flow(&sw, NULL), 50, 1e-9);
    rt_server d;
    memset(&d, 0, sizeof d);
    snprintf(d.name, sizeof d.name, "B2");
    d.n_tput = 4;
    d.tput = t;
    d.first = 2;
    d.last = 4;
    assert_int_equal(rt_swarm_add_server_at(&sw, b, &d), b);
    NEAR(rt_swarm_link(&sw, a, b).bandwidth, 0, 0);
    NEAR(rt_swarm_link(&sw, b, c).bandwidth, 0, 0);
    NEAR(rt_swarm_link(&sw, RT_SOURCE, b).bandwidth, 0, 0);
    assert_int_equal(rt_swarm_out_degree(&sw, a), 1);
    assert_int_equal(rt_swarm_out_degree(&sw, b), 0);
    assert_int_equal(rt_swarm_out_degree(&sw, c), 1);
    NEAR(rt_max_flow(&sw, NULL), 50, 1e-9); /* B2 is not linked yet */
    assert_int_equal(rt_swarm_set_link(&sw, a, b, 300, 0.001), FU_OK);
    assert_int_equal(rt_swarm_set_link(&sw, b, RT_SINK, 1e6, 0.001), FU_OK);
    NEAR(rt_max_flow(&sw, NULL), 50 + 30, 1e-9); /* 300 B/s / 10 bytes per token */
    assert_int_equal(rt_swarm_set_link(&sw, a, b, 0, 0), FU_OK); /* absent again */
    assert_int_equal(rt_swarm_out_degree(&sw, a), 1);
    assert_int_equal(rt_swarm_prune_links(&sw, 1), FU_OK);
    NEAR(rt_max_flow(&sw, NULL), 50, 1e-9);
    rt_swarm free_me;
    assert_int_equal(rt_swarm_clone(&free_me, &sw), FU_OK);
    NEAR(rt_swarm_link(&free_me, a, c).bandwidth, 1e6, 0);
    rt_swarm_free(&free_me);
    rt_swarm_free(&sw);
}

/* Same servers, spans, tables and links, and so the same flow. */
static void assert_same_swarm(const rt_swarm *x, const rt_swarm *y) {
    assert_int_equal(x->n_servers, y->n_servers);
    for (int i = 0; i < x->n_servers; i++) {
        const rt_server *a = &x->servers[i], *b = &y->servers[i];
        assert_string_equal(a->name, b->name);
        assert_string_equal(a->kind, b->kind);
        assert_int_equal(a->state, b->state);
        assert_int_equal(a->first, b->first);
        assert_int_equal(a->last, b->last);
        assert_int_equal(a->n_tput, b->n_tput);
        for (int k = 1; k <= a->n_tput; k++) NEAR(rt_swarm_tput(x, i, k), rt_swarm_tput(y, i, k), 0);
        for (int k = 1; k <= a->n_tput; k++) NEAR(rt_swarm_kv_tokens(x, i, k), rt_swarm_kv_tokens(y, i, k), 0);
        NEAR(a->vram_bytes, b->vram_bytes, 0);
        for (int j = -2; j < x->n_servers; j++) {
            NEAR(rt_swarm_link(x, i, j).bandwidth, rt_swarm_link(y, i, j).bandwidth, 0);
            NEAR(rt_swarm_link(x, j, i).latency, rt_swarm_link(y, j, i).latency, 0);
        }
    }
    NEAR(rt_max_flow(x, NULL), rt_max_flow(y, NULL), 0);
}

static char *slurp(const char *path, size_t *len) {
    FILE *f = fopen(path, "rb");
    assert_non_null(f);
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *b = malloc((size_t)n + 1);
    assert_int_equal(fread(b, 1, (size_t)n, f), (size_t)n);
    b[n] = '\0';
    fclose(f);
    *len = (size_t)n;
    return b;
}

/* The compact file: profiles once per kind, links as arrays, no indentation; it reads back to
 * the same swarm (a default link included), and so does the old object form. */
static void test_json_compact_round_trip(void **st) {
    (void)st;
    rt_swarm sw, back;
    make_hetero(&sw, 40);
    assert_int_equal(rt_place_swarm(&sw), FU_OK);
    assert_int_equal(rt_swarm_prune_links(&sw, 3), FU_OK);
    sw.servers[4].state = RT_SERVER_SPARE;
    sw.servers[4].first = sw.servers[4].last = 0;
    snprintf(sw.servers[0].kind, sizeof sw.servers[0].kind, "A100");
    snprintf(sw.servers[3].kind, sizeof sw.servers[3].kind, "A100");
    sw.servers[3].tput[0] *= 2; /* same kind, another profile */
    char path[] = "/tmp/test_router_XXXXXX";
    int fd = mkstemp(path);
    assert_true(fd >= 0);
    close(fd);
    assert_int_equal(rt_swarm_save_json(&sw, path), FU_OK);
    size_t len;
    char *text = slurp(path, &len);
    assert_non_null(strstr(text, "\"kinds\":{"));
    assert_non_null(strstr(text, "\"A100#1\""));
    assert_null(strstr(text, "\n "));            /* not pretty-printed */
    assert_null(strstr(text, "\"from\""));       /* links as arrays */
    assert_int_equal(rt_swarm_load_json(&back, path), FU_OK);
    assert_same_swarm(&sw, &back);
    rt_swarm_free(&back);
    /* unknown top-level keys (the simulator's step_profiles) are ignored */
    char *more = malloc(len + 64);
    snprintf(more, len + 64, "{\"step_profiles\": {\"x\": [1, 2]}, %s", text + 1);
    assert_int_equal(rt_swarm_parse_json(&back, more, strlen(more)), FU_OK);
    assert_same_swarm(&sw, &back);
    rt_swarm_free(&back);
    free(more);
    free(text);
    rt_swarm_free(&sw);
    /* the old object form, a default link and an override of it, saved compactly and read back */
    const char *old = "{\"model\": {\"name\": \"m\", \"n_layers\": 4, \"activation_bytes\": 8},"
                      " \"default_link\": {\"bandwidth\": 1e9, \"latency\": 0.001}, \"servers\": ["
                      "{\"name\": \"a\", \"layer_tokens_per_s\": 400, \"max_layers\": 4, \"span\": [0, 2]},"
                      "{\"name\": \"b\", \"tokens_per_s_by_layers\": [500, 250], \"span\": [2, 4]},"
                      "{\"name\": \"c\", \"tokens_per_s_by_layers\": [300, 150], \"span\": [2, 4]}],"
                      " \"links\": [{\"from\": \"a\", \"to\": \"b\", \"bandwidth\": 1000, \"latency\": 0.01},"
                      "             {\"from\": \"a\", \"to\": \"c\", \"bandwidth\": 0, \"bidirectional\": false},"
                      "             [0, -2, 0, 0]]}";
    assert_int_equal(rt_swarm_parse_json(&sw, old, strlen(old)), FU_OK);
    NEAR(rt_max_flow(&sw, NULL), 100, 1e-9); /* a -> b only: 1000 B/s / 10; a -> c overridden */
    NEAR(rt_swarm_link(&sw, 2, 0).bandwidth, 1e9, 0); /* c -> a: the default */
    double td[] = {50, 25};
    int d = add(&sw, "d", 2, td, 2, 4); /* joins after the file: off the default */
    assert_int_equal(rt_swarm_set_link(&sw, 0, d, 2000, 0.001), FU_OK);
    assert_int_equal(rt_swarm_set_link(&sw, d, RT_SINK, 1e9, 0.001), FU_OK);
    NEAR(rt_max_flow(&sw, NULL), 125, 1e-9);
    assert_int_equal(rt_swarm_save_json(&sw, path), FU_OK);
    assert_int_equal(rt_swarm_load_json(&back, path), FU_OK);
    assert_same_swarm(&sw, &back);
    NEAR(rt_swarm_link(&back, 3, 0).bandwidth, 0, 0); /* joined after the default: not on it */
    rt_swarm_free(&back);
    unlink(path);
    assert_int_equal(rt_swarm_save_json(&sw, path), FU_OK); /* a new file: readable by all */
    struct stat stt;
    assert_int_equal(stat(path, &stt), 0);
    assert_int_equal(stt.st_mode & 0777, 0644);
    rt_swarm_free(&sw);
    unlink(path);
    assert_int_equal(rt_swarm_save_json(&sw, "/nonexistent-dir/x.json"), FU_ERR_IO);
    static const char *bad[] = {
        "{\"model\": {\"n_layers\": 4, \"activation_bytes\": 8}, \"servers\": [{\"name\": \"a\","
        " \"tokens_per_s_by_layers\": [1]}], \"links\": [[0, 5, 1, 0]]}",
        "{\"model\": {\"n_layers\": 4, \"activation_bytes\": 8}, \"servers\": [{\"name\": \"a\","
        " \"tokens_per_s_by_layers\": [1]}], \"links\": [[0, 0, 1]]}",
        "{\"model\": {\"n_layers\": 4, \"activation_bytes\": 8}, \"kinds\": [],"
        " \"servers\": [{\"name\": \"a\", \"tokens_per_s_by_layers\": [1]}]}",
        "{\"model\": {\"n_layers\": 4, \"activation_bytes\": 8}, \"kinds\": {\"X\": {\"vram\": 1}},"
        " \"servers\": [{\"name\": \"a\", \"kind\": \"X\"}]}",
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        int rc = rt_swarm_parse_json(&sw, bad[i], strlen(bad[i]));
        assert_true(rc == FU_ERR_FORMAT || rc == FU_ERR_INVALID);
        rt_swarm_free(&sw);
    }
}
/* Cluster files over the old 64 MiB limit load (a 10,000-server swarm's file may be large). */
static void test_json_large_file(void **st) {
    (void)st;
    char path[] = "/tmp/test_router_big_XXXXXX";
    int fd = mkstemp(path);
    assert_true(fd >= 0);
    FILE *f = fdopen(fd, "w");
    assert_non_null(f);
    fputs("{\"model\": {\"name\": \"m\", \"n_layers\": 4, \"activation_bytes\": 8},", f);
    static char pad[1 << 20];
    memset(pad, ' ', sizeof pad);
    for (int i = 0; i < 65; i++) assert_int_equal(fwrite(pad, 1, sizeof pad, f), sizeof pad);
    fputs("\"servers\": [{\"name\": \"a\", \"tokens_per_s_by_layers\": [1]}]}", f);
    assert_int_equal(fclose(f), 0);
    rt_swarm sw;
    assert_int_equal(rt_swarm_load_json(&sw, path), FU_OK);
    assert_int_equal(sw.n_servers, 1);
    rt_swarm_free(&sw);
    unlink(path);
}

/* A sparse swarm of n servers in regions of 50 (fast links inside, slow across), k links kept. */
static void make_sparse(rt_swarm *sw, int n, int k) {
    rt_model m = tiny_model(24);
    assert_int_equal(rt_swarm_init(sw, &m), FU_OK);
    double big[8], small[4];
    for (int q = 1; q <= 8; q++) big[q - 1] = 9000.0 / (q + 0.5);
    for (int q = 1; q <= 4; q++) small[q - 1] = 3000.0 / (q + 0.3);
    uint64_t rng = 42;
    for (int i = 0; i < n; i++) {
        char name[16];
        snprintf(name, sizeof name, "s%d", i);
        if (i % 3) add(sw, name, 4, small, 0, 0);
        else add(sw, name, 8, big, 0, 0);
    }
    for (int i = 0; i < n; i++) {
        int lo = i / 50 * 50, hi = lo + 50 < n ? lo + 50 : n;
        for (int t = 0; t < 12; t++) {
            int in = t < 9, j = in ? lo + rt__rng_int(&rng, hi - lo) : rt__rng_int(&rng, n);
            double bw = in ? 1e9 * (1 + rt__rng_unit(&rng)) : 1e7;
            if (j == i) continue;
            assert_int_equal(rt_swarm_set_link(sw, i, j, bw, 0.001), FU_OK);
            assert_int_equal(rt_swarm_set_link(sw, j, i, bw, 0.001), FU_OK);
        }
        assert_int_equal(rt_swarm_set_link(sw, RT_SOURCE, i, 1e9, 0.001), FU_OK);
        assert_int_equal(rt_swarm_set_link(sw, i, RT_SINK, 1e9, 0.001), FU_OK);
    }
    assert_int_equal(rt_swarm_prune_links(sw, k), FU_OK);
}

/* Runs the clock-free search on a copy of `base`; spans into first/last. */
static void search_copy(const rt_swarm *base, long evals, uint64_t seed, int *first, int *last, rt_search_stats *ss) {
    rt_swarm sw;
    assert_int_equal(rt_swarm_clone(&sw, base), FU_OK);
    rt_search_opts so = {0, seed, {RT_CONV_RUNTIME, 0}, 0, evals};
    assert_int_equal(rt_place_search(&sw, &so, ss), FU_OK);
    check_valid(&sw);
    for (int i = 0; i < sw.n_servers; i++) first[i] = sw.servers[i].first, last[i] = sw.servers[i].last;
    rt_swarm_free(&sw);
}

/* max_evals without a clock: the same seed and count give the same spans, whatever the
 * machine's speed; the count bounds the evaluations, on a small swarm and a sparse larger one. */
static void test_search_max_evals(void **st) {
    (void)st;
    int f1[400], l1[400], f2[400], l2[400];
    rt_search_stats s1, s2;
    rt_swarm sw;
    make_hetero(&sw, 40);
    search_copy(&sw, 60, 7, f1, l1, &s1);
    search_copy(&sw, 60, 7, f2, l2, &s2);
    assert_memory_equal(f1, f2, sizeof(int) * 12);
    assert_memory_equal(l1, l2, sizeof(int) * 12);
    assert_true(s1.evaluations <= 60 && s1.evaluations >= 50);
    assert_int_equal(s1.evaluations, s2.evaluations);
    NEAR(s1.flow, s2.flow, 0);
    rt_swarm_free(&sw);
    make_sparse(&sw, 400, 8); /* past the size where the search takes fewer seeds */
    search_copy(&sw, 40, 3, f1, l1, &s1);
    search_copy(&sw, 40, 3, f2, l2, &s2);
    assert_memory_equal(f1, f2, sizeof(int) * 400);
    assert_memory_equal(l1, l2, sizeof(int) * 400);
    assert_true(s1.flow > 0 && s1.evaluations <= 40);
    NEAR(s1.flow, s2.flow, 0);
    rt_swarm_free(&sw);
}

/* The flow fans out from the coordinator over 40 equal one-server chains, each 2.5% of it:
 * below min_share of the out-flow, so the share of the strongest hop decides, and requests
 * spread evenly instead of finding no chain. */
static void test_route_wide_fanout(void **st) {
    (void)st;
    rt_model m = tiny_model(4);
    rt_swarm sw;
    assert_int_equal(rt_swarm_init(&sw, &m), FU_OK);
    double t[] = {400, 200, 100, 50};
    for (int i = 0; i < 40; i++) {
        char name[16];
        snprintf(name, sizeof name, "w%d", i);
        int id = add(&sw, name, 4, t, 0, 4);
        assert_int_equal(rt_swarm_set_link(&sw, RT_SOURCE, id, 1e9, 0.001), FU_OK);
        assert_int_equal(rt_swarm_set_link(&sw, id, RT_SINK, 1e9, 0.001), FU_OK);
    }
    rt_router *r;
    assert_int_equal(rt_router_init(&r, &sw, NULL), FU_OK);
    NEAR(rt_router_flow(r)->value, 40 * 50, 1e-9);
    rt_path *p[80];
    int cnt[40] = {0};
    for (int i = 0; i < 80; i++) {
        assert_int_equal(rt_route(r, 10, &p[i]), FU_OK);
        assert_int_equal(p[i]->n_hops, 1);
        cnt[p[i]->servers[0]]++;
    }
    for (int i = 0; i < 40; i++) assert_int_equal(cnt[i], 2);
    for (int i = 0; i < 80; i++) rt_release(p[i]);
    for (int i = 0; i < 40; i++) assert_int_equal(rt_router_busy(r, i), 0);
    rt_router_free(r);
    rt_swarm_free(&sw);
}

/* --- stripe placements --------------------------------------------------------------------- */

/* Adds an active server of `kind` that holds at most n blocks. */
static int add_kind(rt_swarm *sw, const char *name, const char *kind, int n) {
    static const double tputs[8] = {80, 40, 27, 20, 16, 13, 11, 10};
    rt_server d;
    memset(&d, 0, sizeof d);
    snprintf(d.name, sizeof d.name, "%s", name);
    snprintf(d.kind, sizeof d.kind, "%s", kind);
    d.state = RT_SERVER_ACTIVE;
    d.n_tput = n, d.tput = (double *)tputs;
    int id = rt_swarm_add_server(sw, &d);
    assert_true(id >= 0);
    return id;
}

/* Prefers kind X holding 4 blocks and no Y server on blocks [0, 4): score 100 less 10 a block
 * away from 4, less 5 a Y server in the head; -1 when a block is uncovered. */
static int stripe_test_score(void *ctx, const rt_swarm *sw, double *out) {
    ++*(int *)ctx;
    int x = 0, y_head = 0;
    for (int i = 0; i < sw->n_servers; i++) {
        const rt_server *v = &sw->servers[i];
        if (!rt_swarm_serving(sw, i)) continue;
        if (!strcmp(v->kind, "X")) x += v->last - v->first;
        else y_head += v->first < 4;
    }
    *out = rt_swarm_uncovered(sw, NULL) ? -1 : 100 - 10 * abs(x - 4) - 5 * y_head;
    return FU_OK;
}

/*
 * L = 8. Site A: x0, x1 of kind X (up to 4 blocks each); site B: y2, y3, y4 of kind Y (up to 3);
 * 1 ms within a site, 50 ms across. Across, x0 -> y3 is the fastest link and x1 -> y2 the
 * slowest; the coordinator reaches x1 best. The best stripes by the score: X on the head [0, 4)
 * as x1 then x0 (x1 best reached, x0 best linked out), Y on the tail [4, 8) from y3 (best
 * linked in), then y2, y4 in id order: 4 blocks over three of 3 give 2, 1, 1.
 */
static void stripe_swarm(rt_swarm *sw) {
    rt_model m = tiny_model(8);
    assert_int_equal(rt_swarm_init(sw, &m), FU_OK);
    add_kind(sw, "x0", "X", 4), add_kind(sw, "x1", "X", 4);
    add_kind(sw, "y2", "Y", 3), add_kind(sw, "y3", "Y", 3), add_kind(sw, "y4", "Y", 3);
    for (int i = 0; i < 5; i++) {
        assert_int_equal(rt_swarm_set_link(sw, RT_SOURCE, i, i == 1 ? 1e9 : 1e5, 0.01), FU_OK);
        assert_int_equal(rt_swarm_set_link(sw, i, RT_SINK, 1e9, 0.01), FU_OK);
        for (int j = 0; j < 5; j++) {
            int cross = (i < 2) != (j < 2);
            double bw = !cross ? 1e9 : i == 0 && j == 3 ? 1e8 : i == 1 && j == 2 ? 1e4 : 1e6;
            if (i != j) assert_int_equal(rt_swarm_set_link(sw, i, j, bw, cross ? 0.05 : 0.001), FU_OK);
        }
    }
}

/* Servers 0 .. n-1 of sw hold want[i] = [first, last). */
static void expect_spans(const rt_swarm *sw, const int (*want)[2], int n) {
    for (int i = 0; i < n; i++) {
        assert_int_equal(sw->servers[i].first, want[i][0]);
        assert_int_equal(sw->servers[i].last, want[i][1]);
    }
}

static void test_stripes(void **st) {
    (void)st;
    rt_swarm sw, out[3];
    stripe_swarm(&sw);
    int n = 0, calls = 0;
    assert_int_equal(rt__stripe_best(&sw, RT__STRIPE_KIND_SITE, stripe_test_score, &calls, 3, out, &n), FU_OK);
    assert_int_equal(n, 3);
    assert_true(calls > 3);
    static const int want[5][2] = {{2, 4}, {0, 2}, {6, 7}, {4, 6}, {7, 8}};
    expect_spans(&out[0], want, 5);
    double score[3];
    for (int k = 0; k < n; k++) { /* best first, each within every server's limit */
        assert_int_equal(stripe_test_score(&calls, &out[k], &score[k]), FU_OK);
        assert_true(score[k] >= 0 && (k == 0 || score[k - 1] >= score[k]));
        for (int i = 0; i < 5; i++)
            assert_true(out[k].servers[i].last - out[k].servers[i].first <= rt_swarm_max_layers(&out[k], i));
        rt_swarm_free(&out[k]);
    }
    /* a server that left is not placed; seven groups take the descent, seventeen no stripes */
    assert_int_equal(rt_swarm_remove_server(&sw, 4), FU_OK);
    assert_int_equal(rt__stripe_best(&sw, RT__STRIPE_KIND_SITE, stripe_test_score, &calls, 1, out, &n), FU_OK);
    assert_int_equal(n, 1);
    assert_int_equal(out[0].servers[4].last - out[0].servers[4].first, 0);
    rt_swarm_free(&out[0]);
    static const char *more[15] = {"a", "b", "c", "d", "e", "f", "g", "h", "i", "j", "k", "l", "m", "n", "o"};
    for (int i = 0; i < 5; i++) add_kind(&sw, more[i], more[i], 2);
    assert_int_equal(rt__stripe_best(&sw, RT__STRIPE_KIND_SITE, stripe_test_score, &calls, 1, out, &n), FU_OK);
    assert_int_equal(n, 1);
    double v;
    assert_int_equal(stripe_test_score(&calls, &out[0], &v), FU_OK);
    NEAR(v, 100, 0); /* X on [0, 4) and no other kind in the head, found by the descent */
    rt_swarm_free(&out[0]);
    for (int i = 5; i < 15; i++) add_kind(&sw, more[i], more[i], 2);
    assert_int_equal(rt__stripe_best(&sw, RT__STRIPE_KIND_SITE, stripe_test_score, &calls, 1, out, &n), FU_OK);
    assert_int_equal(n, 0);
    rt_swarm_free(&sw);
}

/*
 * L = 8, three sites 50 ms apart (1 ms within): a0, a1 of kind A (4 blocks each); b2 of kind B
 * (3) with b3, b4 of kind C (2); c5 of kind B (3) with c6, c7 of kind C (2). Links across sites
 * and from and to the coordinator are alike, but for c5 -> a0, the best.
 */
static void site_swarm(rt_swarm *sw) {
    rt_model m = tiny_model(8);
    assert_int_equal(rt_swarm_init(sw, &m), FU_OK);
    static const char *names[8] = {"a0", "a1", "b2", "b3", "b4", "c5", "c6", "c7"};
    static const char *kinds[8] = {"A", "A", "B", "C", "C", "B", "C", "C"};
    static const int blocks[8] = {4, 4, 3, 2, 2, 3, 2, 2};
    for (int i = 0; i < 8; i++) add_kind(sw, names[i], kinds[i], blocks[i]);
    for (int i = 0; i < 8; i++) {
        assert_int_equal(rt_swarm_set_link(sw, RT_SOURCE, i, 1e6, 0.05), FU_OK);
        assert_int_equal(rt_swarm_set_link(sw, i, RT_SINK, 1e6, 0.05), FU_OK);
        for (int j = 0; j < 8; j++) {
            int near = names[i][0] == names[j][0];
            double bw = near ? 1e9 : i == 5 && j == 0 ? 1e8 : 1e6;
            if (i != j) assert_int_equal(rt_swarm_set_link(sw, i, j, bw, near ? 0.001 : 0.05), FU_OK);
        }
    }
}

/* Prefers kind A on 4 blocks, block 0 at two sites, and few servers: 100 less 10 a block of A
 * away from 4, less 1 a serving server, less 20 when one site alone holds block 0; -1 when a
 * block is uncovered. */
static int site_test_score(void *ctx, const rt_swarm *sw, double *out) {
    ++*(int *)ctx;
    int a = 0, serving = 0;
    char first_site = 0, two_sites = 0;
    for (int i = 0; i < sw->n_servers; i++) {
        const rt_server *v = &sw->servers[i];
        if (!rt_swarm_serving(sw, i)) continue;
        serving++;
        if (!strcmp(v->kind, "A")) a += v->last - v->first;
        if (v->first == 0 && first_site && first_site != v->name[0]) two_sites = 1;
        if (v->first == 0) first_site = v->name[0];
    }
    *out = rt_swarm_uncovered(sw, NULL) ? -1 : 100 - 10 * abs(a - 4) - serving - (two_sites ? 0 : 20);
    return FU_OK;
}

/* By site, the best stripes are a fan-in: sites b and c each hold the head [0, 4) with their
 * fewest members (the kind B server, which holds the most, and one of kind C), and a0 alone
 * holds the tail [4, 8). b's pipeline splits 4 blocks 2 + 2 in proportion to 3 and 2; c's ends
 * with c5, best linked into a0, and its boundary moves off b's at 2 to 1. */
static void test_stripes_by_site(void **st) {
    (void)st;
    rt_swarm sw, out[2];
    site_swarm(&sw);
    int n = 0, calls = 0;
    assert_int_equal(rt__stripe_best(&sw, RT__STRIPE_SITE, site_test_score, &calls, 2, out, &n), FU_OK);
    assert_int_equal(n, 2);
    static const int want[8][2] = {{4, 8}, {0, 0}, {0, 2}, {2, 4}, {0, 0}, {1, 4}, {0, 1}, {0, 0}};
    expect_spans(&out[0], want, 8);
    double v[2];
    for (int k = 0; k < n; k++) assert_int_equal(site_test_score(&calls, &out[k], &v[k]), FU_OK);
    NEAR(v[0], 95, 0);
    assert_true(v[1] <= v[0]);
    int same = 1; /* the same spans are kept once */
    for (int i = 0; i < 8; i++) same &= out[0].servers[i].first == out[1].servers[i].first;
    assert_false(same);
    for (int k = 0; k < n; k++) rt_swarm_free(&out[k]);
    rt_swarm_free(&sw);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_maxflow_greedy_trap), cmocka_unit_test(test_maxflow_clrs),
        cmocka_unit_test(test_flow_network_tiny),   cmocka_unit_test(test_flow_least_busy),
        cmocka_unit_test(test_vram_limit),
        cmocka_unit_test(test_placements),          cmocka_unit_test(test_join_leave),
        cmocka_unit_test(test_iwrr),                cmocka_unit_test(test_sim),
        cmocka_unit_test(test_iwrr_cumulative),
        cmocka_unit_test(test_iwrr_cache_affinity),
        cmocka_unit_test(test_ini_and_exprs),       cmocka_unit_test(test_json_format),
        cmocka_unit_test(test_helix_files),         cmocka_unit_test(test_slot_reuse),
        cmocka_unit_test(test_train_chain),         cmocka_unit_test(test_prune_links),
        cmocka_unit_test(test_links_slot_reuse),    cmocka_unit_test(test_json_compact_round_trip),
        cmocka_unit_test(test_json_large_file),     cmocka_unit_test(test_search_max_evals),
        cmocka_unit_test(test_route_wide_fanout),   cmocka_unit_test(test_stripes),
        cmocka_unit_test(test_stripes_by_site),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
