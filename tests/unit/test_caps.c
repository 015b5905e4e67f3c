/* test_caps.c -- what one holder of the swarm secret may cost: a shard's cap on concurrent Session
 * streams and its token budgets for Forward and a step, the gateway's reading of such a refusal (it
 * retires no one), its cap on joined members, and that a joined member carries no request before it
 * has answered the gateway's probe. Real servers on loopback, a random-weight model. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "fusion.pb-c.h"
#include "gw-swarm.h"
#include "gw.h"
#include "model.h"
#include "rpc.h"
#include "shard-core.h"
#include "shard-rpc.h"
#include "status.h"
#include "swarm-svc.h"
#include "test-model.h"
#include "test-shard.h"

#define SECRET "unit-secret-caps"
#define N_LAYERS 4

typedef shard_fixture fixture;

/* A server for the whole random model with the given caps (0: defaults). */
static void start(fixture *f, int max_sessions, int max_forward, int max_step) {
    mdl_config c = test_small_config(MDL_ARCH_LLAMA);
    c.n_layers = N_LAYERS;
    shard_server_config sc = {.listen = "127.0.0.1:0", .allow_insecure = true, .secret = SECRET,
                              .idle_timeout_ms = 5000, .n_workers = 2, .model_name = "random", .device = "cpu",
                              .tokens_per_s = 1.0, .max_sessions = max_sessions,
                              .max_forward_tokens = max_forward, .max_step_tokens = max_step};
    shard_fixture_start(f, &c, (mdl_open_options){0, N_LAYERS, true, true}, 4u << 20, &sc);
}

static void stop(fixture *f) { shard_fixture_stop(f); }

static void nap_ms(int ms) {
    struct timespec ts = {0, ms * 1000000L};
    nanosleep(&ts, NULL);
}

static void expect_code(int rc, int code, const rpc_status *st, const char *needle) {
    if (rc != code || !strstr(st->message, needle))
        fail_msg("expected %s containing '%s', got %s: %s", rpc_code_str(code), needle, rpc_code_str(rc),
                 st->message);
}

/* Opens a Session stream with an open for `id` and returns the reply's code. */
static int open_session(fixture *f, const char *id, rpc_stream **s, rpc_status *st) {
    assert_int_equal(rpc_stream_open(f->ch, RPC_SHARD_SESSION, 10000, s, st), RPC_OK);
    Fusion__OpenSession o = FUSION__OPEN_SESSION__INIT;
    o.session_id.data = (uint8_t *)id;
    o.session_id.len = strlen(id);
    o.max_length = 32;
    o.wire_dtype = FUSION__DTYPE__DTYPE_F32;
    Fusion__SessionRequest req = FUSION__SESSION_REQUEST__INIT;
    req.kind_case = FUSION__SESSION_REQUEST__KIND_OPEN;
    req.open = &o;
    int rc = rpc_stream_send(*s, &req.base, st);
    ProtobufCMessage *msg = NULL;
    if (!rc) rc = rpc_stream_recv(*s, &fusion__session_reply__descriptor, &msg, 10000, st);
    rpc_msg_free(msg);
    return rc;
}

/* Sends one step of n token ids from position 0 and returns the reply's code. */
static int step_tokens(rpc_stream *s, int n, rpc_status *st) {
    int64_t tokens[64];
    for (int i = 0; i < n; i++) tokens[i] = 1 + i % 40;
    Fusion__Input in = FUSION__INPUT__INIT;
    in.tokens = tokens;
    in.n_tokens = (size_t)n;
    Fusion__StepRequest sr = FUSION__STEP_REQUEST__INIT;
    sr.input = &in;
    Fusion__SessionRequest req = FUSION__SESSION_REQUEST__INIT;
    req.kind_case = FUSION__SESSION_REQUEST__KIND_STEP;
    req.step = &sr;
    int rc = rpc_stream_send(s, &req.base, st);
    ProtobufCMessage *msg = NULL;
    if (!rc) rc = rpc_stream_recv(s, &fusion__session_reply__descriptor, &msg, 10000, st);
    rpc_msg_free(msg);
    return rc;
}

/* ---- the shard's caps --------------------------------------------------------------------- */

/* With --max-sessions 2, a third concurrent Session stream is refused with RESOURCE_EXHAUSTED
 * naming the cap (no thread is started for it); once a stream ends, a new one is served. */
static void test_session_stream_cap(void **state) {
    (void)state;
    fixture f;
    start(&f, 2, 0, 0);
    rpc_stream *a, *b, *c;
    rpc_status st;
    assert_int_equal(open_session(&f, "a", &a, &st), RPC_OK);
    assert_int_equal(open_session(&f, "b", &b, &st), RPC_OK);
    expect_code(open_session(&f, "c", &c, &st), RPC_RESOURCE_EXHAUSTED, &st, "cap of 2 concurrent streams");
    rpc_stream_free(c);
    assert_int_equal(step_tokens(a, 3, &st), RPC_OK); /* the two held go on */
    rpc_stream_free(a);
    int rc = RPC_RESOURCE_EXHAUSTED;
    for (int i = 0; i < 400 && rc == RPC_RESOURCE_EXHAUSTED; i++) { /* a's thread ends soon after */
        rc = open_session(&f, "d", &c, &st);
        if (rc == RPC_RESOURCE_EXHAUSTED) {
            rpc_stream_free(c);
            nap_ms(10);
        }
    }
    assert_int_equal(rc, RPC_OK);
    rpc_stream_free(c);
    rpc_stream_free(b);
    stop(&f);
}

/* Calls Forward with sequences of the given lengths (token ids). */
static int forward(fixture *f, const int *lens, size_t n, rpc_status *st) {
    static int64_t tokens[64];
    for (int i = 0; i < 64; i++) tokens[i] = 1 + i % 40;
    Fusion__Input in[300], *ptrs[300];
    assert_true(n <= 300);
    for (size_t i = 0; i < n; i++) {
        fusion__input__init(&in[i]);
        in[i].tokens = tokens;
        in[i].n_tokens = (size_t)lens[i];
        ptrs[i] = &in[i];
    }
    Fusion__ForwardRequest req = FUSION__FORWARD_REQUEST__INIT;
    req.sequences = ptrs;
    req.n_sequences = n;
    ProtobufCMessage *rep = NULL;
    int rc = rpc_call_unary(f->ch, RPC_SHARD_FORWARD, &req.base, &fusion__forward_reply__descriptor, &rep, 20000, st);
    rpc_msg_free(rep);
    return rc;
}

/* Forward counts the positions of all its sequences against --max-forward-tokens (default 2048):
 * over it, RESOURCE_EXHAUSTED with the figures, before anything runs; within it, served. */
static void test_forward_budget(void **state) {
    (void)state;
    fixture f;
    start(&f, 0, 6, 0);
    rpc_status st;
    int two[2] = {4, 3};
    expect_code(forward(&f, two, 2, &st), RPC_RESOURCE_EXHAUSTED, &st, "7 positions in 2 sequences");
    assert_non_null(strstr(st.message, "budget of 6"));
    int fits[2] = {3, 3};
    assert_int_equal(forward(&f, fits, 2, &st), RPC_OK);
    stop(&f);
    /* the default: 65 sequences of 32 tokens (2080 positions) are over 2048 */
    start(&f, 0, 0, 0);
    int many[65];
    for (int i = 0; i < 65; i++) many[i] = 32;
    expect_code(forward(&f, many, 65, &st), RPC_RESOURCE_EXHAUSTED, &st, "budget of 2048");
    assert_int_equal(forward(&f, many, 64, &st), RPC_OK);
    stop(&f);
}

/* With --max-step-tokens 4, a step of 5 positions is refused with RESOURCE_EXHAUSTED and the
 * figures; a step of 4 is served; without the flag, any step within the session's length is. */
static void test_step_budget(void **state) {
    (void)state;
    fixture f;
    start(&f, 0, 0, 4);
    rpc_stream *s;
    rpc_status st;
    assert_int_equal(open_session(&f, "big", &s, &st), RPC_OK);
    expect_code(step_tokens(s, 5, &st), RPC_RESOURCE_EXHAUSTED, &st, "step of 5 positions");
    assert_non_null(strstr(st.message, "budget of 4"));
    rpc_stream_free(s);
    assert_int_equal(open_session(&f, "fits", &s, &st), RPC_OK);
    assert_int_equal(step_tokens(s, 4, &st), RPC_OK);
    rpc_stream_free(s);
    stop(&f);
    start(&f, 0, 0, 0);
    assert_int_equal(open_session(&f, "long", &s, &st), RPC_OK);
    assert_int_equal(step_tokens(s, 32, &st), RPC_OK);
    rpc_stream_free(s);
    stop(&f);
}

/* ---- the gateway -------------------------------------------------------------------------- */

/* A member's report: span [first, last) of N_LAYERS (fixed), tps tokens/s. */
static gw_member_report report(const char *address, int first, int last, double tps) {
    gw_member_report r;
    memset(&r, 0, sizeof r);
    snprintf(r.address, sizeof r.address, "%s", address);
    r.n_layers = N_LAYERS;
    r.first = first;
    r.last = last;
    r.fixed_span = true;
    snprintf(r.device, sizeof r.device, "cpu");
    snprintf(r.dtype, sizeof r.dtype, "f32");
    r.tokens_per_s = r.block_tokens_per_s = tps;
    r.total_kv = r.free_kv = 1 << 20;
    r.kv_per_pos = 64;
    return r;
}

/* The state /v1/swarm shows for the member at `address` (a copy; NULL: not listed). */
static char *state_of(gw_swarm *s, const char *address) {
    json_t *doc = gw_swarm_json(s), *sv;
    size_t i;
    char *state = NULL;
    json_array_foreach(json_object_get(doc, "servers"), i, sv) {
        if (!strcmp(json_string_value(json_object_get(sv, "address")), address))
            state = strdup(json_string_value(json_object_get(sv, "state")));
    }
    json_decref(doc);
    return state;
}

static void expect_state(gw_swarm *s, const char *address, const char *want) {
    char *state = state_of(s, address);
    if (!state || strcmp(state, want)) fail_msg("%s: state %s, expected %s", address, state ? state : "-", want);
    free(state);
}

/* A shard's RESOURCE_EXHAUSTED (a request over its budget, its session cap) retires no one, named
 * or not; a dead named hop still is retired. */
static void test_exhausted_retires_no_one(void **state) {
    (void)state;
    gw_config cfg;
    gw_config_init(&cfg);
    cfg.route_wait_ms = 0;
    cfg.heartbeat_timeout_ms = 600000;
    gw_swarm *s;
    assert_int_equal(gw_swarm_new_manual(&cfg, N_LAYERS, &s), FU_OK);
    gw_member_reply out;
    gw_member_report r = report("10.0.0.1:1", 0, N_LAYERS, 100);
    assert_int_equal(gw_swarm_member_join(s, &r, 0.0, &out), FU_OK);
    gw_lease lease;
    gw_error err = {0};
    assert_int_equal(gw_swarm_route(s, 8, &lease, &err), FU_OK);
    gw_swarm_report_failure(s, &lease, FU_ERR_EXHAUSTED,
                            "shard 10.0.0.1:1: resource exhausted: step of 9000 positions is over this server's "
                            "budget of 2048 positions per step");
    gw_swarm_report_failure(s, &lease, FU_ERR_EXHAUSTED, "resource exhausted: the server is at its cap");
    gw_swarm_release(s, &lease);
    expect_state(s, "10.0.0.1:1", "active");
    assert_int_equal(gw_swarm_route(s, 8, &lease, &err), FU_OK);
    gw_swarm_report_failure(s, &lease, FU_ERR_NETWORK, "shard 10.0.0.1:1: unavailable: connection refused");
    gw_swarm_release(s, &lease);
    expect_state(s, "10.0.0.1:1", "gone");
    gw_swarm_free(s);
    gw_config_free(&cfg);
}

/* --max-members: a Join beyond the cap is refused with FU_ERR_EXHAUSTED naming it; a member joining
 * again is not counted twice; once one leaves, another may join. */
static void test_member_cap(void **state) {
    (void)state;
    gw_config cfg;
    gw_config_init(&cfg);
    assert_int_equal(gw_config_set(&cfg, "max-members", "2"), FU_OK);
    cfg.heartbeat_timeout_ms = 600000;
    gw_swarm *s;
    assert_int_equal(gw_swarm_new_manual(&cfg, N_LAYERS, &s), FU_OK);
    gw_member_reply a, b, out;
    gw_member_report r = report("10.0.0.1:1", 0, N_LAYERS, 100);
    assert_int_equal(gw_swarm_member_join(s, &r, 0.0, &a), FU_OK);
    r = report("10.0.0.2:1", 0, N_LAYERS, 100);
    assert_int_equal(gw_swarm_member_join(s, &r, 0.0, &b), FU_OK);
    r = report("10.0.0.3:1", 0, N_LAYERS, 100);
    assert_int_equal(gw_swarm_member_join(s, &r, 0.0, &out), FU_ERR_EXHAUSTED);
    assert_non_null(strstr(fu_last_error(), "--max-members"));
    r = report("10.0.0.2:1", 0, N_LAYERS, 100); /* joins again (e.g. after a restart) */
    assert_int_equal(gw_swarm_member_join(s, &r, 0.1, &b), FU_OK);
    assert_int_equal(gw_swarm_member_heartbeat(s, a.member_id, NULL, true, 0.2, &out), FU_OK); /* leaves */
    r = report("10.0.0.3:1", 0, N_LAYERS, 100);
    assert_int_equal(gw_swarm_member_join(s, &r, 0.3, &out), FU_OK);
    gw_swarm_free(s);
    gw_config_free(&cfg);
}

/* A TCP listener that accepts connections and never answers: a member address whose probes hang. */
static int silent_listener(int *port) {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    assert_true(fd >= 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_ANY)};
    assert_int_equal(bind(fd, (struct sockaddr *)&a, sizeof a), 0);
    assert_int_equal(listen(fd, 64), 0);
    socklen_t len = sizeof a;
    assert_int_equal(getsockname(fd, (struct sockaddr *)&a, &len), 0);
    *port = ntohs(a.sin_port);
    return fd;
}

/* Joins over fusion.Swarm as a member at `address` claiming every block at tps tokens/s. */
static int join_rpc(rpc_channel *ch, const char *address, double tps, rpc_status *st) {
    swarm_svc_member m = {.address = address, .model_name = "random", .n_layers = N_LAYERS, .first_block = 0,
                          .last_block = N_LAYERS, .device = "cpu", .dtype = "f32", .tokens_per_s = tps,
                          .block_tokens_per_s = tps, .free_kv_bytes = 1 << 20, .total_kv_bytes = 1 << 20,
                          .kv_bytes_per_position = 64, .fixed_span = true};
    swarm_svc_join_reply jr;
    return swarm_svc_join(ch, &m, 5000, &jr, st);
}

/* Waits (up to 5 s) until swarm s shows `address` active. */
static void wait_active(gw_swarm *s, const char *address) {
    char *state = NULL;
    for (int i = 0; i < 500 && !(state && !strcmp(state, "active")); i++) {
        free(state);
        state = state_of(s, address);
        if (!state || strcmp(state, "active")) nap_ms(10);
    }
    assert_string_equal(state, "active");
    free(state);
}

/* A real member of swarm s, joined over ch: a spare server (it answers Echo) claiming every block;
 * returns once the gateway has probed it and routes over it. */
static shard_server *real_member(gw_swarm *s, rpc_channel *ch) {
    shard_server_config sc = {.listen = "127.0.0.1:0", .allow_insecure = true, .secret = SECRET, .n_workers = 2};
    shard_server *srv;
    assert_int_equal(shard_server_new(NULL, &sc, &srv), FU_OK);
    assert_int_equal(shard_server_start(srv), FU_OK);
    rpc_status st;
    assert_int_equal(join_rpc(ch, shard_server_address(srv), 1.0, &st), RPC_OK);
    wait_active(s, shard_server_address(srv));
    return srv;
}

/* Members that joined (they hold the secret) but have not answered the gateway's probe carry no
 * request, however fast they claim to be; the excess beyond --max-members gets RESOURCE_EXHAUSTED
 * over the wire. Here the fake members' probes hang, so they stay unprobed through the test. */
static void test_unprobed_members_not_routed(void **state) {
    (void)state;
    gw_config cfg;
    gw_config_init(&cfg);
    assert_int_equal(gw_config_set(&cfg, "swarm-listen", "127.0.0.1:0"), FU_OK);
    assert_int_equal(gw_config_set(&cfg, "insecure", "true"), FU_OK);
    assert_int_equal(gw_config_set(&cfg, "secret", SECRET), FU_OK);
    assert_int_equal(gw_config_set(&cfg, "heartbeat-timeout-ms", "600000"), FU_OK);
    assert_int_equal(gw_config_set(&cfg, "max-members", "4"), FU_OK);
    assert_int_equal(gw_config_set(&cfg, "measure-links", "false"), FU_OK);
    cfg.route_wait_ms = 0;
    gw_swarm *s;
    assert_int_equal(gw_swarm_new(&cfg, N_LAYERS, &s), FU_OK);
    char gw_addr[64];
    snprintf(gw_addr, sizeof gw_addr, "127.0.0.1:%d", gw_swarm_port(s));
    rpc_channel_options cho = {.insecure = true, .secret = SECRET};
    rpc_channel *ch;
    assert_int_equal(rpc_channel_new(gw_addr, &cho, &ch), FU_OK);
    shard_server *srv = real_member(s, ch);
    const char *real = shard_server_address(srv);
    rpc_status st;
    /* three fake members, a million times faster on paper */
    int port, fd = silent_listener(&port);
    char fake[4][64];
    for (int i = 0; i < 4; i++) snprintf(fake[i], sizeof fake[i], "127.0.0.%d:%d", i + 2, port);
    for (int i = 0; i < 3; i++) assert_int_equal(join_rpc(ch, fake[i], 1e6, &st), RPC_OK);
    expect_code(join_rpc(ch, fake[3], 1e6, &st), RPC_RESOURCE_EXHAUSTED, &st, "--max-members");
    for (int i = 0; i < 50; i++) {
        gw_lease lease;
        gw_error err = {0};
        assert_int_equal(gw_swarm_route(s, 8, &lease, &err), FU_OK);
        assert_int_equal(lease.n_hops, 1);
        assert_string_equal(lease.addr[0], real);
        gw_swarm_release(s, &lease);
    }
    for (int i = 0; i < 3; i++) expect_state(s, fake[i], "joining");
    rpc_channel_free(ch);
    gw_swarm_free(s);
    close(fd);
    shard_server_free(srv);
    gw_config_free(&cfg);
}

/* The step tables a static --shard reports in Info: kept as its profile in the planner when they
 * pass the checks a joined member's do, left out when not (tokens descending here), the member
 * serving either way. */
static void test_static_member_step_tables(void **state) {
    (void)state;
    static const double pt[2] = {16, 64}, bad[2] = {64, 16}, ps[2] = {1e-3, 3e-3}, dt[2] = {1, 8}, ds[2] = {1e-4, 4e-4};
    for (int k = 0; k < 2; k++) {
        mdl_config c = test_small_config(MDL_ARCH_LLAMA);
        c.n_layers = N_LAYERS;
        shard_server_config sc = {.listen = "127.0.0.1:0", .allow_insecure = true, .secret = SECRET, .n_workers = 2,
                                  .model_name = "random", .device = "cpu", .tokens_per_s = 10.0,
                                  .prompt_step_tokens = k ? bad : pt, .prompt_step_s = ps, .decode_step_tokens = dt,
                                  .decode_step_s = ds, .n_prompt_steps = 2, .n_decode_steps = 2};
        fixture f;
        shard_fixture_start(&f, &c, (mdl_open_options){0, N_LAYERS, true, true}, 4u << 20, &sc);
        const char *addr = shard_server_address(f.srv);
        gw_config cfg;
        gw_config_init(&cfg);
        assert_int_equal(gw_config_set(&cfg, "insecure", "true"), FU_OK);
        assert_int_equal(gw_config_set(&cfg, "secret", SECRET), FU_OK);
        assert_int_equal(gw_config_set(&cfg, "shard", addr), FU_OK);
        gw_swarm *s;
        assert_int_equal(gw_swarm_new(&cfg, N_LAYERS, &s), FU_OK);
        wait_active(s, addr);
        json_t *doc = gw_swarm_json(s), *sv = json_array_get(json_object_get(doc, "servers"), 0);
        json_t *decode = json_object_get(json_object_get(sv, "step_ms"), "decode");
        assert_int_equal(json_array_size(decode), k ? 0 : 2);
        json_t *planner = json_object_get(doc, "planner");
        assert_int_equal(json_integer_value(json_object_get(planner, "profiled_members")), k ? 0 : 1);
        json_decref(doc);
        gw_swarm_free(s);
        gw_config_free(&cfg);
        stop(&f);
    }
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_session_stream_cap),
        cmocka_unit_test(test_static_member_step_tables),
        cmocka_unit_test(test_forward_budget),
        cmocka_unit_test(test_step_budget),
        cmocka_unit_test(test_exhausted_retires_no_one),
        cmocka_unit_test(test_member_cap),
        cmocka_unit_test(test_unprobed_members_not_routed),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
