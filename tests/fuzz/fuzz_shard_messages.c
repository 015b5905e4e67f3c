/* fuzz_shard_messages.c -- libFuzzer target: arbitrary bytes as fusion.Shard session messages,
 * decoded, validated and (when valid) run on a small random-weight span. */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

#include "log.h"
#include "model.h"
#include "shard-core.h"
#include "shard-rpc.h"

static shard_core *core;
static shard_session *scratch;

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    (void)argc;
    (void)argv;
    fu_log_set_level(FU_LOG_LEVEL_OFF);
    mdl_config c = {0};
    c.arch = MDL_ARCH_QWEN2;
    c.n_layers = 2;
    c.dim = 32;
    c.ffn_dim = 64;
    c.n_heads = 2;
    c.n_kv_heads = 1;
    c.head_dim = 16;
    c.vocab_size = 40;
    c.max_seq_len = 64;
    c.norm_eps = 1e-5f;
    c.rope_theta = 10000.0f;
    c.qkv_bias = true;
    /* blocks [1, 2) with the head: takes hidden states, samples tokens */
    mdl_open_options o = {1, 2, false, true};
    static mdl_model *m;
    op_cpu_options co = {.n_threads = 1, .isa = OP_CPU_ISA_AUTO};
    shard_core_options so = {1u << 20, 64, OP_TYPE_F32};
    if (mdl_random(&c, OP_TYPE_F32, 1, &o, &m) || shard_core_new(m, op_backend_cpu_new(&co), &so, &core) ||
        shard_session_open(core, "fuzz", 64, NULL, &scratch))
        abort();
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    shard_rpc_fuzz_one(core, scratch, data, size);
    return 0;
}
