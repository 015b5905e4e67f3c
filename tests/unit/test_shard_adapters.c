/* test_shard_adapters.c -- LoRA adapters served by shard servers: the core's registry (sessions
 * with different adapters and none batched together, each computing what a lone engine sequence
 * with its adapter computes; unload while in use; limits) and the same over RPC (adapters sliced
 * to a chain's hops by chain_adapter_load, sessions direct and forwarded, refusals, Info). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "chain.h"
#include "engine.h"
#include "lora.h"
#include "model.h"
#include "rpc.h"
#include "shard-core.h"
#include "shard-rpc.h"
#include "shard-svc.h"
#include "status.h"
#include "test-lora.h"
#include "test-model.h"
#include "wire.h"

#define SECRET "unit-adapter-secret"
#define N_PROMPT 6
#define N_GEN 8
#define VOCAB 61
#define N_STEPS (N_GEN + 1) /* logits rows kept: the prompt's last, then each decode step's */

static const int32_t prompt[N_PROMPT] = {3, 17, 42, 5, 9, 30};

/* A small llama; rope_mode NORM holds q/k rows interleaved (adapters are reordered to match). */
static mdl_config test_config(int n_layers, op_rope_mode rope) {
    mdl_config c = test_small_config(MDL_ARCH_LLAMA);
    c.n_layers = n_layers;
    c.vocab_size = VOCAB;
    c.rope_mode = rope;
    return c;
}

/* Greedy reference on a private engine with adapter ad (NULL: none): the logits after the prompt
 * and after each generated token (rows of VOCAB) and the tokens generated. */
static void reference_run(const mdl_model *m, op_backend *be, lora_adapter *ad, float *logits,
                          int32_t *gen) {
    eng_engine *e;
    eng_seq *s;
    assert_int_equal(eng_new(m, be, NULL, &e), FU_OK);
    assert_int_equal(eng_seq_new(e, 32, &s), FU_OK);
    assert_int_equal(eng_seq_set_adapter(s, ad), FU_OK);
    eng_seq *seqs[N_PROMPT];
    for (int i = 0; i < N_PROMPT; i++) seqs[i] = s;
    uint8_t want[N_PROMPT] = {0};
    want[N_PROMPT - 1] = 1;
    eng_batch b = {N_PROMPT, prompt, NULL, seqs, want};
    assert_int_equal(eng_forward(e, &b, logits), FU_OK);
    for (int i = 0; i < N_GEN; i++) {
        gen[i] = smp_argmax(logits + (size_t)i * VOCAB, VOCAB);
        eng_batch d = {1, &gen[i], NULL, seqs, NULL};
        assert_int_equal(eng_forward(e, &d, logits + (size_t)(i + 1) * VOCAB), FU_OK);
    }
    eng_seq_free(e, s);
    eng_free(e);
}

/* ---- the core ------------------------------------------------------------------------------ */

typedef struct core_fixture {
    mdl_config cfg;
    mdl_model *m;
    op_backend *be;
    shard_core *core;
} core_fixture;

static void core_open(core_fixture *f, const shard_core_options *o) {
    f->cfg = test_config(3, OP_ROPE_NEOX);
    assert_int_equal(mdl_random(&f->cfg, OP_TYPE_F32, 5, NULL, &f->m), FU_OK);
    op_cpu_options co = {.n_threads = 1, .isa = OP_CPU_ISA_AUTO};
    assert_non_null(f->be = op_backend_cpu_new(&co));
    assert_int_equal(shard_core_new(f->m, f->be, o, &f->core), FU_OK);
}

static void core_close(core_fixture *f) {
    shard_core_free(f->core);
    op_backend_free(f->be);
    mdl_free(f->m);
}

/* One session's greedy run on the core, on its own thread. */
typedef struct worker {
    shard_core *core;
    const char *id, *adapter;
    float logits[N_STEPS * VOCAB];
    int32_t gen[N_GEN];
    int rc;
} worker;

/* One step of positions tokens[0..n) wanting the last position's logits into out. */
static int worker_step(worker *w, shard_session *s, const int32_t *tokens, int n, float *out) {
    shard_step st = {.n = n, .start_pos = shard_session_len(s), .tokens = tokens, .want_logits = true};
    int rc = shard_session_step(w->core, s, &st);
    if (!rc) memcpy(out, st.out_logits, VOCAB * sizeof(float));
    return rc;
}

static void *worker_run(void *arg) {
    worker *w = arg;
    shard_session *s;
    if ((w->rc = shard_session_open(w->core, w->id, 32, w->adapter, &s))) return NULL;
    w->rc = worker_step(w, s, prompt, N_PROMPT, w->logits);
    for (int i = 0; i < N_GEN && !w->rc; i++) {
        w->gen[i] = smp_argmax(w->logits + (size_t)i * VOCAB, VOCAB);
        w->rc = worker_step(w, s, &w->gen[i], 1, w->logits + (size_t)(i + 1) * VOCAB);
    }
    shard_session_close(w->core, s);
    return NULL;
}

/* Sessions with adapter A, adapter B and none, stepped at once, share batched forwards and each
 * computes what a lone engine sequence with its adapter computes. */
static void test_core_mixed_adapters_batch(void **state) {
    (void)state;
    core_fixture f;
    core_open(&f, NULL);
    const uint32_t all = LORA_TARGETS_ALL, qv = LORA_TARGET_BIT(LORA_TARGET_Q) | LORA_TARGET_BIT(LORA_TARGET_V);
    lora_adapter *ref[2] = {test_random_adapter(&f.cfg, 0, 3, all, 4, 21), test_random_adapter(&f.cfg, 0, 3, qv, 2, 33)};
    assert_int_equal(shard_core_adapter_load(f.core, "A", test_random_adapter(&f.cfg, 0, 3, all, 4, 21)), FU_OK);
    assert_int_equal(shard_core_adapter_load(f.core, "B", test_random_adapter(&f.cfg, 0, 3, qv, 2, 33)), FU_OK);
    char **ids;
    int n_ids;
    assert_int_equal(shard_core_adapter_ids(f.core, &ids, &n_ids), FU_OK);
    assert_int_equal(n_ids, 2);
    assert_true((!strcmp(ids[0], "A") && !strcmp(ids[1], "B")) || (!strcmp(ids[0], "B") && !strcmp(ids[1], "A")));
    free(ids);

    static worker w[6];
    const char *names[6] = {"A", "B", NULL, "A", "B", ""};
    pthread_t th[6];
    for (int i = 0; i < 6; i++) {
        char *id = malloc(16);
        snprintf(id, 16, "s%d", i);
        w[i] = (worker){.core = f.core, .id = id, .adapter = names[i]};
        assert_int_equal(pthread_create(&th[i], NULL, worker_run, &w[i]), 0);
    }
    for (int i = 0; i < 6; i++) pthread_join(th[i], NULL);
    float want[N_STEPS * VOCAB];
    int32_t gen[N_GEN];
    for (int i = 0; i < 6; i++) {
        assert_int_equal(w[i].rc, FU_OK);
        lora_adapter *ad = i % 3 == 2 ? NULL : ref[i % 3];
        reference_run(f.m, f.be, ad, want, gen);
        test_assert_close(w[i].id, w[i].logits, want, N_STEPS * VOCAB, 1e-4);
        assert_memory_equal(w[i].gen, gen, sizeof gen);
        free((void *)w[i].id);
    }
    float base[N_STEPS * VOCAB];
    reference_run(f.m, f.be, NULL, base, gen);
    assert_true(fabsf(w[0].logits[0] - base[0]) + fabsf(w[1].logits[1] - base[1]) > 1e-6f); /* adapters matter */
    shard_core_stats st;
    shard_core_get_stats(f.core, &st);
    assert_true(st.batched_steps > st.batches); /* some forwards carried several sessions */
    lora_free(ref[0]);
    lora_free(ref[1]);
    core_close(&f);
}

/* One decode step of session s (greedy token `tok`); the step's code. */
static int one_step(shard_core *core, shard_session *s, int32_t tok) {
    shard_step st = {.n = 1, .start_pos = shard_session_len(s), .tokens = &tok, .want_logits = true};
    return shard_session_step(core, s, &st);
}

/* Unloading an adapter a session uses: the session keeps working, new opens are refused, and the
 * adapter is freed after the close (ASan checks both). Replacing one keeps old sessions on the
 * old one. */
static void test_core_unload_while_used(void **state) {
    (void)state;
    core_fixture f;
    core_open(&f, NULL);
    const uint32_t qv = LORA_TARGET_BIT(LORA_TARGET_Q) | LORA_TARGET_BIT(LORA_TARGET_V);
    assert_int_equal(shard_core_adapter_load(f.core, "A", test_random_adapter(&f.cfg, 0, 3, qv, 2, 7)), FU_OK);
    shard_session *s1, *s2, *s3;
    assert_int_equal(shard_session_open(f.core, "one", 16, "A", &s1), FU_OK);
    assert_int_equal(one_step(f.core, s1, 4), FU_OK);
    assert_int_equal(shard_core_adapter_load(f.core, "A", test_random_adapter(&f.cfg, 0, 3, qv, 2, 8)), FU_OK); /* replace */
    assert_int_equal(shard_session_open(f.core, "two", 16, "A", &s2), FU_OK);
    assert_int_equal(shard_core_adapter_unload(f.core, "A"), FU_OK);
    assert_int_equal(shard_session_open(f.core, "three", 16, "A", &s3), FU_ERR_NOT_FOUND);
    assert_non_null(strstr(fu_last_error(), "adapter 'A' is not loaded on this server"));
    assert_int_equal(shard_core_adapter_unload(f.core, "A"), FU_ERR_NOT_FOUND);
    assert_int_equal(one_step(f.core, s1, 5), FU_OK);
    assert_int_equal(one_step(f.core, s2, 6), FU_OK);
    shard_session_close(f.core, s1);
    assert_int_equal(one_step(f.core, s2, 7), FU_OK);
    shard_session_close(f.core, s2);
    char **ids;
    int n;
    assert_int_equal(shard_core_adapter_ids(f.core, &ids, &n), FU_OK);
    assert_int_equal(n, 0);
    assert_null(ids);
    core_close(&f);
}

/* The core's limits: adapters at once, rank, span, id; a session with an adapter left open is
 * freed with the core. */
static void test_core_limits(void **state) {
    (void)state;
    core_fixture f;
    shard_core_options o = {.max_adapters = 2, .max_lora_rank = 4};
    core_open(&f, &o);
    const uint32_t q = LORA_TARGET_BIT(LORA_TARGET_Q);
    assert_int_equal(shard_core_adapter_load(f.core, "a", test_random_adapter(&f.cfg, 0, 3, q, 4, 1)), FU_OK);
    assert_int_equal(shard_core_adapter_load(f.core, "b", test_random_adapter(&f.cfg, 0, 3, q, 1, 2)), FU_OK);
    lora_adapter *c = test_random_adapter(&f.cfg, 0, 3, q, 1, 3);
    assert_int_equal(shard_core_adapter_load(f.core, "c", c), FU_ERR_EXHAUSTED);
    assert_non_null(strstr(fu_last_error(), "2 adapters"));
    assert_int_equal(shard_core_adapter_load(f.core, "b", c), FU_OK); /* a replacement is not one more */
    lora_adapter *big = test_random_adapter(&f.cfg, 0, 3, q, 8, 4);
    assert_int_equal(shard_core_adapter_unload(f.core, "a"), FU_OK);
    assert_int_equal(shard_core_adapter_load(f.core, "big", big), FU_ERR_INVALID);
    assert_non_null(strstr(fu_last_error(), "[1, 4]"));
    lora_free(big);
    lora_adapter *part = test_random_adapter(&f.cfg, 1, 3, q, 2, 5);
    assert_int_equal(shard_core_adapter_load(f.core, "part", part), FU_ERR_INVALID);
    assert_int_equal(shard_core_adapter_load(f.core, "", part), FU_ERR_INVALID);
    assert_int_equal(shard_core_adapter_load(f.core, "bad\nid", part), FU_ERR_INVALID);
    lora_free(part);
    shard_session *s;
    assert_int_equal(shard_session_open(f.core, "kept", 16, "b", &s), FU_OK);
    shard_session *none;
    assert_int_equal(shard_session_open(f.core, "none", 16, "zz", &none), FU_ERR_NOT_FOUND);
    core_close(&f); /* frees "kept" and adapter b */
}

/* ---- over RPC -------------------------------------------------------------------------------- */

#define RPC_MAX_RANK 8

/* Two shard servers holding blocks [0, 1) and [1, 2) of a random 2-block model (q/k rows
 * interleaved), a whole model for reference, a direct and a forwarding chain client. */
typedef struct rpc_fixture {
    mdl_config cfg;
    mdl_model *m[2], *whole;
    op_backend *be;
    shard_core *core[2];
    shard_server *srv[2];
    char addr[2][64];
    chain_hop hops[2];
    chain_client *direct, *fwd;
} rpc_fixture;

/* The server of blocks [i, i + 1). */
static void rpc_server_up(rpc_fixture *f, int i) {
    mdl_open_options o = {i, i + 1, i == 0, i == 1};
    assert_int_equal(mdl_random(&f->cfg, OP_TYPE_F32, 9, &o, &f->m[i]), FU_OK);
    shard_core_options so = {.kv_budget_bytes = 1u << 20, .max_batch_tokens = 64, .max_lora_rank = RPC_MAX_RANK};
    assert_int_equal(shard_core_new(f->m[i], f->be, &so, &f->core[i]), FU_OK);
    shard_server_config sc = {.listen = "127.0.0.1:0", .allow_insecure = true, .secret = SECRET,
                              .max_message_bytes = 1u << 20, .idle_timeout_ms = 5000, .n_workers = 2,
                              .model_name = "random", .device = "cpu", .max_lora_rank = RPC_MAX_RANK};
    assert_int_equal(shard_server_new(f->core[i], &sc, &f->srv[i]), FU_OK);
    assert_int_equal(shard_server_start(f->srv[i]), FU_OK);
    snprintf(f->addr[i], sizeof f->addr[i], "127.0.0.1:%d", shard_server_port(f->srv[i]));
    f->hops[i] = (chain_hop){f->addr[i], i, i + 1, NULL};
}

static void rpc_open(rpc_fixture *f) {
    memset(f, 0, sizeof *f);
    f->cfg = test_config(2, OP_ROPE_NORM);
    op_cpu_options co = {.n_threads = 1, .isa = OP_CPU_ISA_AUTO};
    assert_non_null(f->be = op_backend_cpu_new(&co));
    rpc_server_up(f, 0);
    rpc_server_up(f, 1);
    assert_int_equal(mdl_random(&f->cfg, OP_TYPE_F32, 9, NULL, &f->whole), FU_OK);
    chain_options o = {.secret = SECRET, .insecure = true, .wire_dtype = WIRE_F32, .timeout_ms = 10000};
    assert_int_equal(chain_client_new(&o, &f->direct), FU_OK);
    o.forward = true;
    assert_int_equal(chain_client_new(&o, &f->fwd), FU_OK);
}

static void rpc_close(rpc_fixture *f) {
    chain_client_free(f->direct);
    chain_client_free(f->fwd);
    for (int i = 0; i < 2; i++) {
        shard_server_drain(f->srv[i], 0);
        shard_server_free(f->srv[i]);
        shard_core_free(f->core[i]);
        mdl_free(f->m[i]);
    }
    mdl_free(f->whole);
    op_backend_free(f->be);
}

/* A greedy run through the chain with adapter `id`: the logits rows as reference_run's. */
static void chain_run(chain_client *c, const chain_hop *hops, const char *sid, const char *id, float *logits) {
    chain_session *s;
    assert_int_equal(chain_session_open(c, hops, 2, sid, 32, id, &s), FU_OK);
    chain_spec spec = {.want_logits = true};
    const chain_result *r;
    assert_int_equal(chain_session_step(s, prompt, N_PROMPT, -1, &spec, &r), FU_OK);
    memcpy(logits, r->logits, VOCAB * sizeof(float));
    for (int i = 0; i < N_GEN; i++) {
        int32_t tok = smp_argmax(logits + (size_t)i * VOCAB, VOCAB);
        assert_int_equal(chain_session_step(s, &tok, 1, -1, &spec, &r), FU_OK);
        memcpy(logits + (size_t)(i + 1) * VOCAB, r->logits, VOCAB * sizeof(float));
    }
    chain_session_close(s);
}

/* A whole adapter sliced to each hop: sessions through the chain, direct and forwarded, compute
 * what the whole model with the whole adapter computes; Info lists it; unload ends it. */
static void test_rpc_chain_with_adapter(void **state) {
    (void)state;
    rpc_fixture f;
    rpc_open(&f);
    lora_adapter *whole = test_random_adapter(&f.cfg, 0, 2, LORA_TARGETS_ALL, 4, 44);
    assert_true(whole->qk_interleaved);
    assert_int_equal(lora_set_qk_order(whole, false), FU_OK); /* PEFT's order, as the chain sends it */
    for (int i = 0; i < 2; i++) assert_int_equal(chain_adapter_load(f.direct, &f.hops[i], "ad", whole), FU_OK);
    assert_int_equal(lora_set_qk_order(whole, true), FU_OK);
    float want[N_STEPS * VOCAB], got[N_STEPS * VOCAB], base[N_STEPS * VOCAB];
    int32_t gen[N_GEN];
    reference_run(f.whole, f.be, whole, want, gen);
    reference_run(f.whole, f.be, NULL, base, gen);
    chain_run(f.direct, f.hops, "direct", "ad", got);
    test_assert_close("direct", got, want, N_STEPS * VOCAB, 1e-4);
    chain_run(f.fwd, f.hops, "fwd", "ad", got);
    test_assert_close("forwarded", got, want, N_STEPS * VOCAB, 1e-4);
    chain_run(f.direct, f.hops, "base", NULL, got);
    test_assert_close("base", got, base, N_STEPS * VOCAB, 1e-4);

    rpc_channel_options co = {.insecure = true, .secret = SECRET};
    rpc_channel *ch;
    assert_int_equal(rpc_channel_new(f.addr[1], &co, &ch), FU_OK);
    shard_svc_info *info;
    rpc_status st;
    assert_int_equal(shard_svc_info_get(ch, 5000, &info, &st), RPC_OK);
    assert_int_equal(info->n_adapters, 1);
    assert_string_equal(info->adapters[0], "ad");
    shard_svc_info_free(info);
    rpc_channel_free(ch);

    assert_int_equal(chain_adapter_unload(f.direct, &f.hops[1], "ad"), FU_OK);
    chain_session *s;
    assert_int_equal(chain_session_open(f.fwd, f.hops, 2, "gone", 32, "ad", &s), FU_ERR_NOT_FOUND);
    assert_non_null(strstr(fu_last_error(), "not loaded"));
    lora_free(whole);
    rpc_close(&f);
}

/* LoadAdapter with a hand-made state on server i: the call's code, the server's message in st. */
static int load_state(rpc_fixture *f, int i, const char *id, const shard_svc_state *state, rpc_status *st) {
    rpc_channel_options co = {.insecure = true, .secret = SECRET, .max_message_bytes = 1u << 20};
    rpc_channel *ch;
    assert_int_equal(rpc_channel_new(f->addr[i], &co, &ch), FU_OK);
    int64_t bytes;
    int rc = shard_svc_adapter_load(ch, id, state, 5000, &bytes, st);
    rpc_channel_free(ch);
    return rc;
}

/* Refusals: a slice of the wrong span, a rank over the server's limit, an unknown target, a wrong
 * count, non-finite values, bad ids; unknown ids at open and unload are NOT_FOUND. */
static void test_rpc_refusals(void **state) {
    (void)state;
    rpc_fixture f;
    rpc_open(&f);
    lora_adapter *whole = test_random_adapter(&f.cfg, 0, 2, LORA_TARGET_BIT(LORA_TARGET_V), 2, 5);
    assert_int_equal(lora_set_qk_order(whole, false), FU_OK);
    chain_hop wrong = {f.addr[0], 0, 2, NULL}; /* server 0 holds [0, 1) */
    assert_int_equal(chain_adapter_load(f.direct, &wrong, "ad", whole), FU_ERR_INVALID);
    assert_non_null(strstr(fu_last_error(), f.addr[0]));
    assert_non_null(strstr(fu_last_error(), "state: blocks [0, 2)"));
    lora_adapter *big = test_random_adapter(&f.cfg, 0, 2, LORA_TARGET_BIT(LORA_TARGET_V), RPC_MAX_RANK * 2, 6);
    assert_int_equal(lora_set_qk_order(big, false), FU_OK);
    assert_int_equal(chain_adapter_load(f.direct, &f.hops[0], "big", big), FU_ERR_INVALID);
    assert_non_null(strstr(fu_last_error(), "state.lora.r"));
    lora_free(big);

    size_t n = whole->n_floats / 2;
    float *x = calloc(n, sizeof *x);
    int64_t shape[1] = {(int64_t)n};
    wire_tensor params = {.dtype = WIRE_F32, .n_shape = 1, .shape = shape, .data = (const uint8_t *)x,
                          .data_len = n * sizeof *x};
    const char *names[1] = {"v_proj"};
    shard_svc_lora spec = {2, 4.0f, 0, false, names, 1, 0};
    shard_svc_state good = {0, 1, &spec, &params, NULL, NULL};
    rpc_status st;
    assert_int_equal(load_state(&f, 0, "zeros", &good, &st), RPC_OK);
    x[3] = NAN;
    assert_int_equal(load_state(&f, 0, "nan", &good, &st), RPC_INVALID_ARGUMENT);
    assert_non_null(strstr(st.message, "state.params"));
    x[3] = 0;
    shape[0] = (int64_t)n - 1;
    params.data_len -= sizeof *x;
    assert_int_equal(load_state(&f, 0, "short", &good, &st), RPC_INVALID_ARGUMENT);
    assert_non_null(strstr(st.message, "state.params"));
    const char *bad_names[1] = {"w_proj"};
    spec.targets = bad_names;
    assert_int_equal(load_state(&f, 0, "target", &good, &st), RPC_INVALID_ARGUMENT);
    assert_non_null(strstr(st.message, "state.lora.target_modules"));
    spec.targets = names;
    spec.r = 0;
    assert_int_equal(load_state(&f, 0, "rank0", &good, &st), RPC_INVALID_ARGUMENT);
    spec.r = 2;
    assert_int_equal(load_state(&f, 0, "", &good, &st), RPC_INVALID_ARGUMENT);
    assert_int_equal(load_state(&f, 0, "bad\tid", &good, &st), RPC_INVALID_ARGUMENT);
    shard_svc_state no_params = {0, 1, &spec, NULL, NULL, NULL};
    assert_int_equal(load_state(&f, 0, "np", &no_params, &st), RPC_INVALID_ARGUMENT);
    free(x);

    chain_session *s;
    assert_int_equal(chain_session_open(f.direct, f.hops, 2, "unknown", 32, "nope", &s), FU_ERR_NOT_FOUND);
    assert_int_equal(chain_session_open(f.fwd, f.hops, 2, "unknown2", 32, "zeros", &s), FU_ERR_NOT_FOUND);
    assert_int_equal(chain_adapter_unload(f.direct, &f.hops[1], "nope"), FU_ERR_NOT_FOUND);
    lora_free(whole);
    rpc_close(&f);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_core_mixed_adapters_batch),
        cmocka_unit_test(test_core_unload_while_used),
        cmocka_unit_test(test_core_limits),
        cmocka_unit_test(test_rpc_chain_with_adapter),
        cmocka_unit_test(test_rpc_refusals),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
