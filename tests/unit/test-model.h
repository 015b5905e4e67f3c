/* test-model.h -- the small model configuration that the engine's tests draw
 * random weights for (mdl_random): 2 blocks, grouped-query heads, each
 * architecture's extras (qkv bias for Qwen2, q/k norms for Qwen3). */
#ifndef FU_TEST_MODEL_H
#define FU_TEST_MODEL_H

#include <string.h>

#include "model.h"

static inline mdl_config test_small_config(mdl_arch arch) {
    mdl_config c;
    memset(&c, 0, sizeof c);
    c.arch = arch;
    c.n_layers = 2;
    c.dim = 64;
    c.ffn_dim = 96;
    c.n_heads = 4;
    c.n_kv_heads = 2;
    c.head_dim = 16;
    c.vocab_size = 100;
    c.max_seq_len = 64;
    c.norm_eps = 1e-5f;
    c.rope_theta = 10000.0f;
    c.rope_mode = OP_ROPE_NEOX;
    c.qkv_bias = arch == MDL_ARCH_QWEN2;
    c.qk_norm = arch == MDL_ARCH_QWEN3;
    return c;
}

#endif
