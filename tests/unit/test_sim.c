/* test_sim.c -- the serving simulator: step-time profiles (interpolation, limits, JSON
 * errors), batching on one server checked by hand, link and NIC serialisation, KV-bounded
 * admission, Helix's KV feeder, determinism. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "router.h"
#include "status.h"

#define NEAR(a, b, tol) assert_true(fabs((double)(a) - (double)(b)) <= (tol))

static rt_model model(int L) {
    rt_model m;
    memset(&m, 0, sizeof m);
    snprintf(m.name, sizeof m.name, "sim");
    m.n_layers = L;
    m.token_bytes = 2;
    m.act_bytes = 1000;
    m.layer_bytes = 1e9;
    return m;
}

/* One server "G" holding all L blocks, fast links (1e12 B/s, no latency). */
static void one_server(rt_swarm *sw, int L, double kv_tokens) {
    rt_model m = model(L);
    assert_int_equal(rt_swarm_init(sw, &m), FU_OK);
    double tput[8] = {0}, kv[8] = {0};
    for (int k = 0; k < 8; k++) tput[k] = 1000.0 / (k + 1), kv[k] = kv_tokens;
    rt_server d;
    memset(&d, 0, sizeof d);
    snprintf(d.name, sizeof d.name, "g");
    snprintf(d.kind, sizeof d.kind, "G");
    d.state = RT_SERVER_ACTIVE;
    d.n_tput = 8;
    d.tput = tput;
    d.kv_tokens = kv;
    assert_true(rt_swarm_add_server(sw, &d) == 0);
    assert_int_equal(rt_swarm_set_span(sw, 0, 0, L), FU_OK);
    assert_int_equal(rt_swarm_set_link(sw, RT_SOURCE, 0, 1e12, 0), FU_OK);
    assert_int_equal(rt_swarm_set_link(sw, 0, RT_SINK, 1e12, 0), FU_OK);
}

/* Options with the run's length and synthetic requests; no host copy cost. */
static rt_sim_opts opts(double duration, double warmup, int prompt_len, int output_len) {
    rt_sim_opts so;
    memset(&so, 0, sizeof so);
    so.duration_s = duration, so.warmup_s = warmup, so.prompt_len = prompt_len, so.output_len = output_len;
    so.host_s_per_byte = -1;
    return so;
}

/* Profile G: prompt 10 ms per block per 100 tokens, decode 2 ms + 0.1 ms per sequence. */
static const char *PROFILE_JSON =
    "{\"step_profiles\": {\"G\": {\"prompt\": [[0, 0], [100, 10]], \"decode\": [[1, 2.1], [101, 12.1]],"
    " \"decode_max_tokens\": 8}}}";

static void test_profile_interpolation(void **st) {
    (void)st;
    rt_sim_profiles p = {0};
    assert_int_equal(rt_sim_profiles_parse_json(&p, PROFILE_JSON, strlen(PROFILE_JSON)), FU_OK);
    const rt_step_profile *g = rt_sim_profile_find(&p, "G");
    assert_non_null(g);
    assert_null(rt_sim_profile_find(&p, "H"));
    NEAR(rt_step_seconds(g, 50, 0, 0), 0.005, 1e-12);   /* between points */
    NEAR(rt_step_seconds(g, 300, 0, 0), 0.030, 1e-12);  /* extrapolated */
    NEAR(rt_step_seconds(g, 0, 11, 0), 0.0031, 1e-12);
    NEAR(rt_step_seconds(g, 100, 1, 0), 0.0121, 1e-12); /* mixed batch: both parts */
    assert_int_equal(g->decode_max_tokens[0], 8);
    rt_sim_profiles_free(&p);
    /* no section: no profiles */
    assert_int_equal(rt_sim_profiles_parse_json(&p, "{}", 2), FU_OK);
    assert_int_equal(p.n, 0);
}

/* Batch limits by block count (arrays; a number holds for every count) survive a save with the
 * cluster (rt_swarm_save_json_with) and a reload, tables and all. */
static const char *LIMITS_JSON =
    "{\"step_profiles\": {\"G\": {\"prompt\": [[0, 0], [100, 10.5]], \"decode\": [[1, 2.1], [101, 12.1]],"
    " \"single_decode_factor\": 2, \"prompt_max_requests\": [3, 2, 1], \"prompt_max_tokens\": 2048,"
    " \"decode_max_tokens\": [8, 6, 4], \"decode_max_context\": [800, 600, 400.5]}}}";

static void same_profile(const rt_step_profile *a, const rt_step_profile *b) {
    assert_string_equal(a->kind, b->kind);
    assert_int_equal(a->n_prompt, b->n_prompt);
    assert_int_equal(a->n_decode, b->n_decode);
    for (int i = 0; i < a->n_prompt; i++) NEAR(a->prompt_s[i], b->prompt_s[i], 1e-15);
    for (int i = 0; i < a->n_decode; i++) NEAR(a->decode_tokens[i], b->decode_tokens[i], 0);
    NEAR(a->single_decode_factor, b->single_decode_factor, 0);
    assert_int_equal(a->n_limits, b->n_limits);
    for (int k = 0; k < a->n_limits; k++) {
        assert_int_equal(a->prompt_max_requests[k], b->prompt_max_requests[k]);
        assert_int_equal(a->prompt_max_tokens[k], b->prompt_max_tokens[k]);
        assert_int_equal(a->decode_max_tokens[k], b->decode_max_tokens[k]);
        NEAR(a->decode_max_context[k], b->decode_max_context[k], 0);
    }
}

static void test_profile_limits_round_trip(void **st) {
    (void)st;
    rt_sim_profiles p = {0}, back = {0};
    assert_int_equal(rt_sim_profiles_parse_json(&p, LIMITS_JSON, strlen(LIMITS_JSON)), FU_OK);
    const rt_step_profile *g = rt_sim_profile_find(&p, "G");
    assert_int_equal(g->n_limits, 3);
    assert_int_equal(g->prompt_max_requests[2], 1);
    assert_int_equal(g->prompt_max_tokens[1], 2048);
    assert_int_equal(g->decode_max_tokens[1], 6);
    rt_swarm sw;
    one_server(&sw, 4, 1e6);
    char path[64];
    snprintf(path, sizeof path, "/tmp/test-sim-profiles-%d.json", (int)getpid());
    assert_int_equal(rt_swarm_save_json_with(&sw, &p, path), FU_OK);
    assert_int_equal(rt_sim_profiles_load_json(&back, path), FU_OK);
    assert_int_equal(back.n, 1);
    same_profile(g, &back.items[0]);
    rt_sim_profiles_free(&back);
    assert_int_equal(rt_swarm_save_json_with(&sw, NULL, path), FU_OK); /* none: no section */
    assert_int_equal(rt_sim_profiles_load_json(&back, path), FU_OK);
    assert_int_equal(back.n, 0);
    unlink(path);
    rt_swarm_free(&sw);
    rt_sim_profiles_free(&p);
}

static void test_profile_errors(void **st) {
    (void)st;
    const char *bad[] = {
        "{\"step_profiles\": []}",
        "{\"step_profiles\": {\"G\": {\"prompt\": [], \"decode\": [[1, 1]]}}}",
        "{\"step_profiles\": {\"G\": {\"prompt\": [[10, 1], [5, 2]], \"decode\": [[1, 1]]}}}",
        "{\"step_profiles\": {\"G\": {\"prompt\": [[1, -1]], \"decode\": [[1, 1]]}}}",
        "{\"step_profiles\": {\"G\": {\"prompt\": [[1, 1]], \"decode\": [[1, 1]], \"decode_max_tokens\": -3}}}",
        "{\"step_profiles\": {\"G\": {\"prompt\": [[1, 1]], \"decode\": [\"x\"]}}}",
        "{\"step_profiles\": {\"G\": 7}}",
        "{\"step_profiles\": {\"G\": {\"prompt\": [[1, 1]], \"decode\": [[1, 1]], \"decode_max_tokens\": [4, 2],"
        " \"prompt_max_tokens\": [9, 8, 7]}}}",
        "{\"step_profiles\": {\"G\": {\"prompt\": [[1, 1]], \"decode\": [[1, 1]], \"decode_max_tokens\": []}}}",
        "{\"step_profiles\": {\"G\": {\"prompt\": [[1, 1]], \"decode\": [[1, 1]], \"decode_max_tokens\": [4, -1]}}}",
        "{\"step_profiles\": {\"G\": {\"prompt\": [[1, 1]], \"decode\": [[1, 1]], \"decode_max_context\": [\"x\"]}}}",
        "{\"step_profiles\": {\"G\": {\"prompt\": [[1, 1]], \"decode\": [[1, 1]]}, "
        "\"GGGGGGGGGGGGGGGGGGGGGGGGGGGGGGGGGGGGGGGGGGGGGGGGGGGGGGGGGGGGGGGGGGGGGGGGGGGGGGGGGGGG\": {}}}",
        "not json",
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        rt_sim_profiles p = {0};
        assert_int_not_equal(rt_sim_profiles_parse_json(&p, bad[i], strlen(bad[i])), FU_OK);
        assert_int_equal(p.n, 0);
        assert_true(strlen(fu_last_error()) > 0);
    }
}

/*
 * One request at a time (closed loop, concurrency 1), L = 2, prompt 100, output 3, no host
 * cost: the prompt step takes 2 blocks x 10 ms, each decode step 2 x 2.1 ms = 4.2 ms (no
 * one-token factor in this profile). A request lasts 20 + 3 x 4.2 = 32.6 ms, so decode
 * throughput is 3 / 0.0326 tokens/s and TTFT is 20 ms.
 */
static void test_single_server_by_hand(void **st) {
    (void)st;
    rt_swarm sw;
    one_server(&sw, 2, 0);
    rt_sim_profiles p = {0};
    assert_int_equal(rt_sim_profiles_parse_json(&p, PROFILE_JSON, strlen(PROFILE_JSON)), FU_OK);
    rt_sim_opts so = opts(100, 10, 100, 3);
    so.concurrency = 1;
    so.profiles = &p;
    rt_sim_result r;
    assert_int_equal(rt_sim_run(&sw, &so, &r), FU_OK);
    NEAR(r.decode_tps, 3 / 0.0326, 0.5);
    NEAR(r.ttft_p50, 0.020, 1e-9);
    NEAR(r.tpot_p50, 0.0042, 1e-9);
    NEAR(r.mean_hops, 1, 1e-12);
    NEAR(r.mean_in_flight, 1, 1e-3);
    /* with a host copy cost of 1 us per byte: + w x 1000 B x 1e-6 s per step */
    so.host_s_per_byte = 1e-6;
    assert_int_equal(rt_sim_run(&sw, &so, &r), FU_OK);
    NEAR(r.ttft_p50, 0.020 + 100 * 1000 * 1e-6, 1e-9);
    NEAR(r.tpot_p50, 0.0042 + 1000 * 1e-6, 1e-9);
    rt_sim_profiles_free(&p);
    rt_swarm_free(&sw);
}

/* Continuous batching: at most 8 sequences decode together (decode_max_tokens 8), so 16 in
 * flight settle into two alternating batches of 8, each 2 blocks x 2.8 ms. */
static void test_batching_and_limits(void **st) {
    (void)st;
    rt_swarm sw;
    one_server(&sw, 2, 0);
    rt_sim_profiles p = {0};
    assert_int_equal(rt_sim_profiles_parse_json(&p, PROFILE_JSON, strlen(PROFILE_JSON)), FU_OK);
    rt_sim_opts so = opts(200, 20, 1, 1000);
    so.profiles = &p;
    rt_sim_result one, sixteen;
    so.concurrency = 1;
    assert_int_equal(rt_sim_run(&sw, &so, &one), FU_OK);
    so.concurrency = 16;
    assert_int_equal(rt_sim_run(&sw, &so, &sixteen), FU_OK);
    /* one sequence: 2 blocks x 2.1 ms = 4.2 ms a token */
    NEAR(one.decode_tps, 1 / 0.0042, 3);
    /* 16 sequences: batches of 8 take 2 x 2.8 ms = 5.6 ms; two alternate: 8 / 5.6 ms */
    NEAR(sixteen.decode_tps, 8 / 0.0056, 15);
    NEAR(sixteen.tpot_p50, 2 * 0.0056, 3e-4);
    rt_sim_profiles_free(&p);
    rt_swarm_free(&sw);
}

/* Links: 1000-token prompts over a 1e6 B/s link from the coordinator (2 B a token -> 2 ms)
 * and a 0.5 s latency: TTFT = 2 ms + 0.5 s + compute + 0.5 s back. Fluid server (no profile):
 * 1000 tokens at 1000 / 1 tokens/s for one block = 1 s. */
static void test_links_and_fluid_server(void **st) {
    (void)st;
    rt_swarm sw;
    one_server(&sw, 1, 0);
    assert_int_equal(rt_swarm_set_link(&sw, RT_SOURCE, 0, 1e6, 0.5), FU_OK);
    assert_int_equal(rt_swarm_set_link(&sw, 0, RT_SINK, 1e12, 0.5), FU_OK);
    rt_sim_opts so = opts(100, -1, 1000, 1);
    so.concurrency = 1;
    rt_sim_result r;
    assert_int_equal(rt_sim_run(&sw, &so, &r), FU_OK);
    NEAR(r.ttft_p50, 0.002 + 0.5 + 1.0 + 0.5, 1e-6);
    NEAR(r.tpot_p50, 2e-6 + 0.5 + 0.001 + 0.5, 1e-6);
    rt_swarm_free(&sw);
}

/* KV: capacity 10 000 tokens, kv_hwm 0.5 -> 5000 tokens: requests of 1000 + 1000 admit two at
 * a time, however many the closed loop offers; Helix's feeder keeps the block's expected use
 * near feed_hwm. */
static void test_kv_bounds(void **st) {
    (void)st;
    rt_swarm sw;
    one_server(&sw, 2, 10000);
    rt_sim_opts so = opts(300, 30, 1000, 1000);
    so.concurrency = 50;
    so.host_s_per_byte = 0; /* the default copy cost */
    so.kv_hwm = 0.5;
    rt_sim_result r;
    assert_int_equal(rt_sim_run(&sw, &so, &r), FU_OK);
    assert_true(r.mean_in_flight <= 2 + 1e-9 && r.mean_in_flight > 1.9);
    so.kv_hwm = 1;
    so.feed = RT_FEED_KV;
    so.initial_requests = 1;
    so.feed_hwm = 0.6; /* one more while at most 3 of the 5 requests' worth are in use */
    assert_int_equal(rt_sim_run(&sw, &so, &r), FU_OK);
    assert_true(r.mean_in_flight <= 4 + 1e-9 && r.mean_in_flight > 3.5);
    rt_swarm_free(&sw);
}

static void test_deterministic_and_poisson(void **st) {
    (void)st;
    rt_swarm sw;
    one_server(&sw, 2, 0);
    rt_sim_opts so = opts(500, 50, 10, 10);
    so.feed = RT_FEED_POISSON, so.arrival_rate = 0.5, so.seed = 7;
    rt_sim_result a, b;
    assert_int_equal(rt_sim_run(&sw, &so, &a), FU_OK);
    assert_int_equal(rt_sim_run(&sw, &so, &b), FU_OK);
    assert_memory_equal(&a, &b, sizeof a);
    NEAR(a.decode_tps, 5, 1.2); /* light load: throughput follows arrivals, 0.5/s x 10 */
    so.arrival_rate = 0;
    assert_int_not_equal(rt_sim_run(&sw, &so, &a), FU_OK);
    so.feed = RT_FEED_TRACE;
    assert_int_not_equal(rt_sim_run(&sw, &so, &a), FU_OK);
    rt_swarm_free(&sw);
}

/* Drawn lengths stay within their caps (a 100-token cap: no prompt step longer than 20 ms, most
 * shorter), and KV is reserved for kv_output_tokens outputs when set. */
static void test_lengths_and_kv_expectation(void **st) {
    (void)st;
    rt_swarm sw;
    one_server(&sw, 2, 10000);
    rt_sim_profiles p = {0};
    assert_int_equal(rt_sim_profiles_parse_json(&p, PROFILE_JSON, strlen(PROFILE_JSON)), FU_OK);
    rt_sim_opts so = opts(100, 10, 100, 3);
    so.concurrency = 1, so.profiles = &p;
    so.prompt_sigma = 1, so.max_prompt_len = 100;
    rt_sim_result r;
    assert_int_equal(rt_sim_run(&sw, &so, &r), FU_OK);
    assert_true(r.ttft_p99 <= 0.020 + 1e-9 && r.ttft_p50 < 0.019);
    /* 10 000 KV tokens, requests of 1000 + 1000: five at a time; reserving 4000 outputs: two */
    rt_sim_opts kv = opts(300, 30, 1000, 1000);
    kv.concurrency = 50, kv.kv_hwm = 1;
    assert_int_equal(rt_sim_run(&sw, &kv, &r), FU_OK);
    NEAR(r.mean_in_flight, 5, 0.1);
    kv.kv_output_tokens = 4000;
    assert_int_equal(rt_sim_run(&sw, &kv, &r), FU_OK);
    NEAR(r.mean_in_flight, 2, 0.1);
    rt_sim_profiles_free(&p);
    rt_swarm_free(&sw);
}

/* Request files: traces sorted by arrival, length sets, and clear errors naming the line. */
static void test_request_files(void **st) {
    (void)st;
    static const char trace[] = "# arrival prompt output\n2.5 100 4\n\n0.5\t7 0\r\n1 9 9";
    rt_sim_request *v;
    int n;
    assert_int_equal(rt_sim_requests_parse(trace, strlen(trace), 1, &v, &n), FU_OK);
    assert_int_equal(n, 3);
    NEAR(v[0].arrival_s, 0.5, 0), NEAR(v[1].arrival_s, 1, 0), NEAR(v[2].arrival_s, 2.5, 0);
    assert_int_equal(v[0].prompt_len, 7), assert_int_equal(v[0].output_len, 0), assert_int_equal(v[2].prompt_len, 100);
    free(v);
    static const char pairs[] = "374 44\n91 16\n";
    assert_int_equal(rt_sim_requests_parse(pairs, strlen(pairs), 0, &v, &n), FU_OK);
    double pm, om;
    rt_sim_requests_mean(v, n, &pm, &om);
    NEAR(pm, 232.5, 1e-9), NEAR(om, 30, 1e-9);
    rt_sim_opts so = opts(10, 1, 7, 7);
    rt_sim_opts_draw_lengths(&so, v, n);
    assert_ptr_equal(so.lengths, v), assert_int_equal(so.n_lengths, 2);
    assert_int_equal(so.prompt_len, 233), assert_int_equal(so.output_len, 30); /* the means, rounded */
    free(v);
    static const char *bad[] = {"", "# only\n", "1 2 3\n", "0 5\n", "5 -1\n", "5 x\n", "5\n", "1 2\0 3\n"};
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++)
        assert_int_equal(rt_sim_requests_parse(bad[i], i == 7 ? 8 : strlen(bad[i]), 0, &v, &n), FU_ERR_FORMAT);
    static const char blanks[2] = {' ', '\t'}; /* no NUL after the text: the parser stays within len */
    assert_int_equal(rt_sim_requests_parse(blanks, sizeof blanks, 0, &v, &n), FU_ERR_FORMAT);
    assert_int_equal(rt_sim_requests_parse("1 2\n1 2 x\n", 10, 1, &v, &n), FU_ERR_FORMAT);
    assert_non_null(strstr(fu_last_error(), "line 1"));
    assert_int_equal(rt_sim_requests_parse(pairs, strlen(pairs), 1, &v, &n), FU_ERR_FORMAT);
    assert_int_not_equal(rt_sim_requests_load("/nonexistent/lengths.txt", 0, &v, &n), FU_OK);
}

/* One request at a time for 100 s on profile p: prompt/output lengths, or drawn from set[n]. */
static rt_sim_result one_at_a_time(const rt_swarm *sw, const rt_sim_profiles *p, int prompt, int output,
                                   const rt_sim_request *set, int n) {
    rt_sim_opts so = opts(100, 10, prompt, output);
    so.concurrency = 1, so.profiles = p, so.lengths = set, so.n_lengths = n;
    rt_sim_result r;
    assert_int_equal(rt_sim_run(sw, &so, &r), FU_OK);
    return r;
}

/* A length set draws each request's pair: one pair runs as those fixed lengths do (whatever the
 * fixed ones say); two pairs of short and long prompts give prompt latencies of both. */
static void test_length_sets(void **st) {
    (void)st;
    rt_swarm sw;
    one_server(&sw, 2, 0);
    rt_sim_profiles p = {0};
    assert_int_equal(rt_sim_profiles_parse_json(&p, PROFILE_JSON, strlen(PROFILE_JSON)), FU_OK);
    rt_sim_request one = {0, 100, 3}, two[2] = {{0, 10, 3}, {0, 1000, 3}};
    rt_sim_result a = one_at_a_time(&sw, &p, 100, 3, NULL, 0), b = one_at_a_time(&sw, &p, 7, 70, &one, 1);
    NEAR(a.decode_tps, b.decode_tps, 1e-9), NEAR(a.ttft_p50, b.ttft_p50, 1e-12);
    assert_int_equal(a.completed, b.completed);
    rt_sim_result mix = one_at_a_time(&sw, &p, 7, 70, two, 2);
    rt_sim_result lo = one_at_a_time(&sw, &p, 10, 3, NULL, 0), hi = one_at_a_time(&sw, &p, 1000, 3, NULL, 0);
    NEAR(mix.ttft_p99, hi.ttft_p99, 1e-9); /* the longest prompts are the long pair's */
    assert_true(mix.mean_prompt_latency_s > 2 * lo.mean_prompt_latency_s &&
                mix.mean_prompt_latency_s < 0.8 * hi.mean_prompt_latency_s);
    rt_sim_profiles_free(&p);
    rt_swarm_free(&sw);
}

/* Step times of zero over instant links: a batch still takes 1 us, so simulated time advances and
 * the run ends (at most one step per microsecond: 1e6 tokens/s for one sequence). */
static void test_zero_times_advance(void **st) {
    (void)st;
    rt_swarm sw;
    one_server(&sw, 1, 0);
    static const char *zero = "{\"step_profiles\": {\"G\": {\"prompt\": [[0, 0], [10, 0]], \"decode\": [[1, 0]]}}}";
    rt_sim_profiles p = {0};
    assert_int_equal(rt_sim_profiles_parse_json(&p, zero, strlen(zero)), FU_OK);
    rt_sim_opts so = opts(0.5, -1, 4, 1000);
    so.concurrency = 1, so.profiles = &p;
    rt_sim_result r;
    assert_int_equal(rt_sim_run(&sw, &so, &r), FU_OK);
    assert_true(r.decode_tps > 1e5 && r.decode_tps <= 1e6 + 1);
    rt_sim_profiles_free(&p);
    rt_swarm_free(&sw);
}

/* A swarm of fast "G" servers (up to 4 blocks) and slow "S" ones (2 blocks) over 8 blocks. */
static void mixed_swarm(rt_swarm *sw) {
    rt_model m = model(8);
    assert_int_equal(rt_swarm_init(sw, &m), FU_OK);
    for (int i = 0; i < 6; i++) {
        int fast = i < 3, n = fast ? 4 : 2;
        double tput[4], kv[4];
        for (int k = 0; k < n; k++) tput[k] = (fast ? 4000.0 : 1000.0) / (k + 1), kv[k] = 40000.0 / (k + 1);
        rt_server d;
        memset(&d, 0, sizeof d);
        snprintf(d.name, sizeof d.name, "s%d", i);
        snprintf(d.kind, sizeof d.kind, "%s", fast ? "G" : "S");
        d.state = RT_SERVER_ACTIVE;
        d.n_tput = n, d.tput = tput, d.kv_tokens = kv;
        assert_true(rt_swarm_add_server(sw, &d) == i);
    }
    for (int i = 0; i < 6; i++) {
        assert_int_equal(rt_swarm_set_link(sw, RT_SOURCE, i, 1e9, 0.005), FU_OK);
        assert_int_equal(rt_swarm_set_link(sw, i, RT_SINK, 1e9, 0.005), FU_OK);
        for (int j = 0; j < 6; j++)
            if (i != j) assert_int_equal(rt_swarm_set_link(sw, i, j, 1e9, 0.005), FU_OK);
    }
}

static const char *MIXED_PROFILES =
    "{\"step_profiles\": {\"G\": {\"prompt\": [[0, 0], [1000, 5]], \"decode\": [[1, 1], [100, 2]]},"
    " \"S\": {\"prompt\": [[0, 0], [1000, 20]], \"decode\": [[1, 4], [100, 8]]}}}";

/* The throughput placement covers every block, keeps to each server's limit, is at least as good
 * as the best seed it reports, and is the same for the same seed and budget. */
static void test_place_throughput(void **st) {
    (void)st;
    rt_sim_profiles p = {0};
    assert_int_equal(rt_sim_profiles_parse_json(&p, MIXED_PROFILES, strlen(MIXED_PROFILES)), FU_OK);
    rt_tplace_opts o;
    memset(&o, 0, sizeof o);
    o.search.seed = 3, o.search.max_evals = 200; /* no clock: the same placement every run */
    o.sim = opts(120, 20, 200, 50);
    o.sim.feed = RT_FEED_KV, o.sim.profiles = &p;
    o.max_evals = 30, o.seed = 5;
    rt_swarm a, b;
    mixed_swarm(&a);
    rt_tplace_stats sa, sb;
    assert_int_equal(rt_place_throughput(&a, &o, &sa), FU_OK);
    assert_int_equal(rt_swarm_uncovered(&a, NULL), 0);
    for (int i = 0; i < a.n_servers; i++)
        assert_true(a.servers[i].last - a.servers[i].first <= rt_swarm_max_layers(&a, i));
    assert_true(sa.decode_tps >= sa.start_decode_tps * (1 - 1e-9) && sa.decode_tps > 0);
    assert_true(sa.evals > 4 && sa.evals <= 30 + 5);
    assert_non_null(sa.start);
    mixed_swarm(&b);
    assert_int_equal(rt_place_throughput(&b, &o, &sb), FU_OK);
    for (int i = 0; i < a.n_servers; i++) {
        assert_int_equal(a.servers[i].first, b.servers[i].first);
        assert_int_equal(a.servers[i].last, b.servers[i].last);
    }
    NEAR(sa.decode_tps, sb.decode_tps, 1e-9);
    rt_swarm_free(&a), rt_swarm_free(&b), rt_sim_profiles_free(&p);
}

/* Half-model servers a [0, 4), b and c [4, 8), and a spare g of up to 8 blocks; every server holds
 * 2000 KV tokens; server-to-server links have `lat` s of latency. */
static void join_swarm(rt_swarm *sw, double lat) {
    rt_model m = model(8);
    assert_int_equal(rt_swarm_init(sw, &m), FU_OK);
    double half[4] = {800, 400, 266, 200}, whole[8] = {800, 400, 266, 200, 190, 180, 165, 150};
    static const int span[4][2] = {{0, 4}, {4, 8}, {4, 8}, {0, 0}};
    double kv[8] = {2000, 2000, 2000, 2000, 2000, 2000, 2000, 2000};
    for (int i = 0; i < 4; i++) {
        rt_server d;
        memset(&d, 0, sizeof d);
        snprintf(d.name, sizeof d.name, "%c", "abcg"[i]);
        d.state = i < 3 ? RT_SERVER_ACTIVE : RT_SERVER_SPARE;
        d.n_tput = i < 3 ? 4 : 8, d.tput = i < 3 ? half : whole, d.kv_tokens = kv;
        assert_true(rt_swarm_add_server(sw, &d) == i);
        if (i < 3) assert_int_equal(rt_swarm_set_span(sw, i, span[i][0], span[i][1]), FU_OK);
    }
    for (int i = 0; i < 4; i++) {
        assert_int_equal(rt_swarm_set_link(sw, RT_SOURCE, i, 1e9, 0.001), FU_OK);
        assert_int_equal(rt_swarm_set_link(sw, i, RT_SINK, 1e9, 0.001), FU_OK);
        for (int j = 0; j < 4; j++)
            if (i != j) assert_int_equal(rt_swarm_set_link(sw, i, j, 1e9, lat), FU_OK);
    }
}

/* Simulated decode tokens/s of `sw` with server 3 on [f, l). */
static double sim_with(const rt_swarm *sw, const rt_sim_opts *so, int f, int l) {
    rt_swarm t;
    assert_int_equal(rt_swarm_clone(&t, sw), FU_OK);
    assert_int_equal(rt_swarm_set_span(&t, 3, f, l), FU_OK);
    rt_sim_opts o = *so;
    o.duration_s = 300, o.warmup_s = 30, o.feed = RT_FEED_KV;
    rt_sim_result r;
    assert_int_equal(rt_sim_run(&t, &o, &r), FU_OK);
    rt_swarm_free(&t);
    return r.decode_tps;
}

/* The quick estimate reads the spread of a length set: over links slow enough to queue, prompts
 * of 10 and 190 tokens wait longer than prompts all of 100, so it estimates less. */
static void test_estimate_length_spread(void **st) {
    (void)st;
    rt_swarm sw;
    join_swarm(&sw, 0.001);
    for (int j = 1; j < 3; j++) assert_int_equal(rt_swarm_set_link(&sw, 0, j, 2e5, 0.001), FU_OK);
    rt_sim_request set[2] = {{0, 10, 20}, {0, 190, 20}};
    rt_sim_opts so = opts(300, 30, 100, 20);
    double fixed, spread;
    assert_int_equal(rt_estimate_decode_tps(&sw, &so, &fixed), FU_OK);
    so.lengths = set, so.n_lengths = 2;
    assert_int_equal(rt_estimate_decode_tps(&sw, &so, &spread), FU_OK);
    assert_true(fixed > 0 && spread < fixed);
    rt_swarm_free(&sw);
}

/* Swarm's routing on a [0, 4) then b or c [4, 8), 8 requests in flight, fluid servers: max flow
 * needs only b, so IWRR leaves c idle while Swarm's routing uses both and decodes faster. With a
 * 0.5 s link to c, an even split would decode slower than b alone (the slow requests pile up in
 * flight); steering new prompts by the time they took keeps it faster. On the single chain a, b
 * it runs exactly as IWRR does. */
static void test_swarm_routing(void **st) {
    (void)st;
    rt_swarm sw;
    join_swarm(&sw, 0.001);
    rt_sim_opts so = opts(300, 30, 100, 20);
    so.concurrency = 8;
    rt_sim_result iwrr, even, slow, one;
    assert_int_equal(rt_sim_run(&sw, &so, &iwrr), FU_OK);
    so.routing = RT_SIM_ROUTE_SWARM;
    assert_int_equal(rt_sim_run(&sw, &so, &even), FU_OK);
    assert_int_equal(rt_swarm_set_link(&sw, 0, 2, 1e9, 0.5), FU_OK);
    assert_int_equal(rt_sim_run(&sw, &so, &slow), FU_OK);
    assert_int_equal(rt_swarm_set_span(&sw, 2, 0, 0), FU_OK); /* a single chain a, b */
    assert_int_equal(rt_sim_run(&sw, &so, &one), FU_OK);
    so.routing = RT_SIM_ROUTE_IWRR;
    assert_int_equal(rt_sim_run(&sw, &so, &iwrr), FU_OK);
    assert_true(even.decode_tps > 1.3 * iwrr.decode_tps && slow.decode_tps > iwrr.decode_tps);
    assert_true(slow.decode_tps < even.decode_tps);
    NEAR(one.decode_tps, iwrr.decode_tps, 1e-9), NEAR(one.tpot_p50, iwrr.tpot_p50, 1e-12);
    NEAR(even.mean_hops, 2, 1e-9);
    so.routing = RT_SIM_ROUTE_SWARM, so.feed = RT_FEED_KV; /* no KV account to feed by */
    assert_int_equal(rt_sim_run(&sw, &so, &one), FU_ERR_INVALID);
    rt_swarm_free(&sw);
}

/* A join by the estimate: where links are slow, the spare takes the whole model (one-hop chains,
 * less flow) rather than the half the max flow prefers (more flow over two-hop chains), and the
 * simulator agrees; where links are fast, both take the half. */
static void test_join_throughput(void **st) {
    (void)st;
    rt_sim_opts so = opts(0, 0, 200, 50);
    rt_swarm sw;
    join_swarm(&sw, 0.5);
    int f, l, ff, fl;
    double gain = 0, est = 0;
    assert_int_equal(rt_place_join(&sw, 3, NULL, &ff, &fl, &gain), FU_OK);
    assert_int_equal(ff, 0), assert_int_equal(fl, 4); /* max flow 400 against 350 for [0, 8) */
    assert_int_equal(rt_place_join_throughput(&sw, 3, &so, &f, &l, &gain), FU_OK);
    assert_int_equal(f, 0), assert_int_equal(l, 8);
    assert_true(gain > 0);
    assert_true(sim_with(&sw, &so, f, l) > 1.5 * sim_with(&sw, &so, ff, fl));
    assert_int_equal(rt_estimate_decode_tps(&sw, &so, &est), FU_OK);
    assert_true(est > 0);
    rt_swarm_free(&sw);
    join_swarm(&sw, 0.001);
    assert_int_equal(rt_place_join_throughput(&sw, 3, &so, &f, &l, &gain), FU_OK);
    assert_int_equal(f, 0), assert_int_equal(l, 4);
    /* a block uncovered: the estimate is 0, and the join covers it first */
    assert_int_equal(rt_swarm_set_span(&sw, 0, 0, 0), FU_OK);
    assert_int_equal(rt_estimate_decode_tps(&sw, &so, &est), FU_OK);
    NEAR(est, 0, 0);
    assert_int_equal(rt_place_join_throughput(&sw, 3, &so, &f, &l, &gain), FU_OK);
    assert_true(f == 0 && l >= 4);
    rt_swarm_free(&sw);
}

/* With every block covered, a join only weighs windows that meet other spans (or the model's
 * ends) on both sides, as no other carries flow: its pick is one of those, and no such window
 * has a higher estimate. */
static void test_join_aligned_windows(void **st) {
    (void)st;
    rt_sim_opts so = opts(0, 0, 200, 50);
    rt_swarm sw;
    join_swarm(&sw, 0.001);
    int f, l;
    double gain, best = 0, est;
    assert_int_equal(rt_place_join_throughput(&sw, 3, &so, &f, &l, &gain), FU_OK);
    assert_true((f == 0 || f == 4) && (l == 4 || l == 8));
    rt_swarm t;
    assert_int_equal(rt_swarm_clone(&t, &sw), FU_OK);
    assert_int_equal(rt_swarm_set_span(&t, 3, f, l), FU_OK);
    assert_int_equal(rt_estimate_decode_tps(&t, &so, &best), FU_OK);
    static const int aligned[][2] = {{0, 4}, {0, 8}, {4, 8}};
    for (int w = 0; w < 3; w++) {
        assert_int_equal(rt_swarm_set_span(&t, 3, aligned[w][0], aligned[w][1]), FU_OK);
        assert_int_equal(rt_estimate_decode_tps(&t, &so, &est), FU_OK);
        assert_true(est <= best * (1 + 1e-9));
    }
    rt_swarm_free(&t);
    rt_swarm_free(&sw);
}

/* Measured tables added as a profile: copied, checked, refused whole when bad. */
static void test_profiles_add(void **st) {
    (void)st;
    rt_sim_profiles p = {0};
    double pt[2] = {16, 64}, ps[2] = {0.001, 0.003}, dt[2] = {1, 8}, ds[2] = {1e-4, 4e-4};
    assert_int_equal(rt_sim_profiles_add(&p, "m1", 2, pt, ps, 2, dt, ds), FU_OK);
    pt[0] = 99; /* copied */
    const rt_step_profile *q = rt_sim_profile_find(&p, "m1");
    assert_non_null(q);
    NEAR(rt_step_seconds(q, 40, 0, 0), 0.002, 1e-12);
    NEAR(rt_step_seconds(q, 0, 8, 0), 4e-4, 1e-12);
    assert_int_not_equal(rt_sim_profiles_add(&p, "m1", 2, dt, ds, 2, dt, ds), FU_OK); /* duplicate */
    assert_int_not_equal(rt_sim_profiles_add(&p, "m2", 2, pt, ps, 2, dt, ds), FU_OK); /* 99 then 64 */
    assert_int_not_equal(rt_sim_profiles_add(&p, "m3", 0, NULL, NULL, 2, dt, ds), FU_OK);
    assert_int_equal(p.n, 1);
    rt_sim_profiles_free(&p);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_profile_interpolation), cmocka_unit_test(test_profile_errors),
        cmocka_unit_test(test_profile_limits_round_trip),
        cmocka_unit_test(test_single_server_by_hand), cmocka_unit_test(test_batching_and_limits),
        cmocka_unit_test(test_links_and_fluid_server), cmocka_unit_test(test_kv_bounds),
        cmocka_unit_test(test_deterministic_and_poisson), cmocka_unit_test(test_place_throughput),
        cmocka_unit_test(test_lengths_and_kv_expectation), cmocka_unit_test(test_zero_times_advance),
        cmocka_unit_test(test_join_throughput), cmocka_unit_test(test_join_aligned_windows),
        cmocka_unit_test(test_profiles_add), cmocka_unit_test(test_request_files),
        cmocka_unit_test(test_length_sets), cmocka_unit_test(test_swarm_routing),
        cmocka_unit_test(test_estimate_length_spread),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
