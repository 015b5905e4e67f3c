/* test-shard.h -- the tests' shard server on loopback: a random-weight span of a config, its
 * core and server (fusion.Shard and fusion.Train), and a client channel to it. Include after
 * cmocka.h. */
#ifndef FU_TEST_SHARD_H
#define FU_TEST_SHARD_H

#include <string.h>

#include "model.h"
#include "rpc.h"
#include "shard-core.h"
#include "shard-rpc.h"
#include "status.h"

typedef struct shard_fixture {
    mdl_model *m;
    op_backend *be;
    shard_core *core;
    shard_server *srv;
    rpc_channel *ch;
} shard_fixture;

/* Starts a server (config sc, its secret and message limit also the channel's) for blocks o of a random model of
 * config c (seed 1, f32), on a one-thread CPU backend with a core of kv_bytes of KV cache. */
static inline void shard_fixture_start(shard_fixture *f, const mdl_config *c, mdl_open_options o,
                                       uint64_t kv_bytes, const shard_server_config *sc) {
    memset(f, 0, sizeof *f);
    assert_int_equal(mdl_random(c, OP_TYPE_F32, 1, &o, &f->m), FU_OK);
    op_cpu_options co = {.n_threads = 1, .isa = OP_CPU_ISA_AUTO};
    f->be = op_backend_cpu_new(&co);
    shard_core_options so = {.kv_budget_bytes = kv_bytes, .max_batch_tokens = 64, .kv_type = OP_TYPE_F32};
    assert_int_equal(shard_core_new(f->m, f->be, &so, &f->core), FU_OK);
    assert_int_equal(shard_server_new(f->core, sc, &f->srv), FU_OK);
    assert_int_equal(shard_server_start(f->srv), FU_OK);
    rpc_channel_options cho = {.insecure = true, .secret = sc->secret, .max_message_bytes = sc->max_message_bytes};
    assert_int_equal(rpc_channel_new(shard_server_address(f->srv), &cho, &f->ch), FU_OK);
}

static inline void shard_fixture_stop(shard_fixture *f) {
    rpc_channel_free(f->ch);
    shard_server_drain(f->srv, 0);
    shard_server_free(f->srv);
    shard_core_free(f->core);
    op_backend_free(f->be);
    mdl_free(f->m);
}

#endif
