/* test_shard_prefix.c -- the prefix cache: chained block hashes, pins, LRU eviction, the adapter
 * in the key; and through the shard core, that a session started from cached blocks computes
 * exactly what one computed from scratch, that it never writes into a cached block, and that
 * cached blocks give way to sessions within the KV budget. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "lora.h"
#include "model.h"
#include "shard-core.h"
#include "shard-prefix.h"
#include "status.h"
#include "test-lora.h"
#include "test-model.h"

#define B 4

/* Puts block k of tokens (B each) under parent, its data filled with byte v; returns its hash. */
static uint64_t put_block(pfx_cache *c, uint64_t parent, const int32_t *tokens, uint8_t v) {
    pfx_block *b = pfx_cache_reserve(c, parent, tokens);
    assert_non_null(b);
    memset(pfx_block_fill(b), v, 16);
    pfx_cache_publish(c, b);
    return pfx_hash(parent, tokens, B);
}

static void test_hash_chains_and_covers_tokens(void **state) {
    (void)state;
    const int32_t a[B] = {1, 2, 3, 4}, b[B] = {1, 2, 3, 5};
    uint64_t s0 = pfx_seed(NULL, 0, 0, 2), s1 = pfx_seed("ad", 0, 0, 2), s2 = pfx_seed(NULL, 0, 2, 4);
    assert_true(s0 == pfx_seed("", 0, 0, 2));
    assert_true(s0 != s1 && s0 != s2 && s1 != s2);
    assert_true(s1 != pfx_seed("ad", 1, 0, 2)); /* the same id loaded again: another adapter */
    assert_true(pfx_hash(s0, a, B) == pfx_hash(s0, a, B));
    assert_true(pfx_hash(s0, a, B) != pfx_hash(s0, b, B));
    assert_true(pfx_hash(s0, a, B) != pfx_hash(s1, a, B));
    /* the same block after different parents is a different block */
    assert_true(pfx_hash(pfx_hash(s0, a, B), b, B) != pfx_hash(pfx_hash(s0, b, B), b, B));
}

static void test_acquire_longest_prefix_and_pins(void **state) {
    (void)state;
    pfx_cache *c;
    assert_int_equal(pfx_cache_new(B, 16, &c), FU_OK);
    const int32_t t[3 * B] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12};
    uint64_t seed = pfx_seed(NULL, 0, 0, 1);
    uint64_t h0 = put_block(c, seed, t, 0xA0);
    put_block(c, h0, t + B, 0xA1);
    assert_null(pfx_cache_reserve(c, seed, t)); /* already there */
    assert_int_equal(pfx_cache_blocks(c), 2);
    assert_int_equal((int)pfx_cache_bytes(c), 32);

    pfx_block *got[3];
    assert_int_equal(pfx_cache_acquire(c, seed, t, 3 * B, 3, got), 2);
    assert_int_equal(((const uint8_t *)pfx_block_data(got[1]))[0], 0xA1);
    assert_memory_equal(pfx_block_tokens(got[1]), t + B, B * sizeof(int32_t));
    /* pinned blocks are not evicted */
    assert_int_equal((int)pfx_cache_evict(c, 1000), 0);
    pfx_cache_release(c, got, 2);
    /* at most max_blocks, and only whole blocks of the tokens given */
    assert_int_equal(pfx_cache_acquire(c, seed, t, 3 * B, 1, got), 1);
    pfx_cache_release(c, got, 1);
    assert_int_equal(pfx_cache_acquire(c, seed, t, 2 * B - 1, 3, got), 1);
    pfx_cache_release(c, got, 1);
    /* another first block: nothing, even though the second block's tokens match */
    const int32_t u[2 * B] = {0, 2, 3, 4, 5, 6, 7, 8};
    assert_int_equal(pfx_cache_acquire(c, seed, u, 2 * B, 2, got), 0);
    /* another adapter: nothing */
    assert_int_equal(pfx_cache_acquire(c, pfx_seed("x", 0, 0, 1), t, 2 * B, 2, got), 0);
    /* a reserved block is invisible until published, and abandoning it frees it */
    pfx_block *r = pfx_cache_reserve(c, pfx_hash(h0, t + B, B), t + 2 * B);
    assert_non_null(r);
    assert_int_equal(pfx_cache_acquire(c, seed, t, 3 * B, 3, got), 2);
    pfx_cache_release(c, got, 2);
    pfx_cache_abandon(c, r);
    assert_int_equal(pfx_cache_blocks(c), 2);
    pfx_cache_free(c);
}

static void test_lru_eviction(void **state) {
    (void)state;
    pfx_cache *c;
    assert_int_equal(pfx_cache_new(B, 16, &c), FU_OK);
    const int32_t p[B] = {1, 1, 1, 1}, q[B] = {2, 2, 2, 2}, r[B] = {3, 3, 3, 3};
    uint64_t seed = pfx_seed(NULL, 0, 0, 1);
    put_block(c, seed, p, 1);
    put_block(c, seed, q, 2);
    put_block(c, seed, r, 3);
    pfx_block *got[1];
    assert_int_equal(pfx_cache_acquire(c, seed, p, B, 1, got), 1); /* p: most recently used */
    pfx_cache_release(c, got, 1);
    assert_int_equal((int)pfx_cache_evict(c, 16), 16); /* q goes: least recently used */
    assert_int_equal(pfx_cache_acquire(c, seed, q, B, 1, got), 0);
    assert_int_equal(pfx_cache_acquire(c, seed, r, B, 1, got), 1);
    assert_int_equal((int)pfx_cache_evict(c, 100), 16); /* p goes; r is pinned */
    assert_int_equal(pfx_cache_blocks(c), 1);
    pfx_cache_release(c, got, 1);
    assert_int_equal((int)pfx_cache_evict(c, 1), 16);
    assert_int_equal(pfx_cache_blocks(c), 0);
    pfx_cache_free(c);
}

/* ---- through the shard core ---------------------------------------------------------------- */

typedef struct core_fixture {
    mdl_model *m;
    op_backend *be;
    shard_core *core;
} core_fixture;

static void core_open(core_fixture *f, op_type kv, uint64_t budget, bool off) {
    mdl_config cfg = test_small_config(MDL_ARCH_LLAMA);
    assert_int_equal(mdl_random(&cfg, OP_TYPE_F32, 7, NULL, &f->m), FU_OK);
    op_cpu_options co = {.n_threads = 2, .isa = OP_CPU_ISA_AUTO};
    f->be = op_backend_cpu_new(&co);
    shard_core_options o = {.kv_budget_bytes = budget, .max_batch_tokens = 8, .kv_type = kv,
                            .prefix_cache_off = off, .kv_block_tokens = B};
    assert_int_equal(shard_core_new(f->m, f->be, &o, &f->core), FU_OK);
}

static void core_close(core_fixture *f) {
    shard_core_free(f->core);
    op_backend_free(f->be);
    mdl_free(f->m);
}

/* Runs prompt[0..n) on a new session (reusing what the cache holds when `reuse`) and returns the
 * last position's logits in out (V) and how many positions came from the cache. */
static int run_prompt_with(core_fixture *f, const char *id, const char *adapter, const int32_t *prompt, int n,
                           bool reuse, float *out) {
    shard_session *s;
    assert_int_equal(shard_session_open(f->core, id, 64, adapter, &s), FU_OK);
    int cached = reuse ? shard_session_pin_prefix(f->core, s, prompt, n) : 0;
    assert_true(cached % B == 0 && cached < n);
    assert_int_equal(shard_session_reuse_prefix(f->core, s, cached), FU_OK);
    assert_int_equal(shard_session_len(s), cached);
    shard_step st = {.n = n - cached, .start_pos = cached, .tokens = prompt + cached, .want_logits = true};
    assert_int_equal(shard_session_step(f->core, s, &st), FU_OK);
    memcpy(out, st.out_logits, (size_t)f->m->cfg.vocab_size * sizeof *out);
    shard_session_close(f->core, s);
    return cached;
}

static int run_prompt(core_fixture *f, const char *id, const int32_t *prompt, int n, bool reuse, float *out) {
    return run_prompt_with(f, id, NULL, prompt, n, reuse, out);
}

/* A session from cached blocks gives the logits of one from scratch: bit-identical when its
 * computed positions run in the same chunks as there (the prefix a multiple of the batch), else
 * to the last bits (the CPU kernels are not batch-invariant, as with any batching). */
static void check_reuse_bit_identical(op_type kv) {
    core_fixture f;
    core_open(&f, kv, 64u << 20, false);
    const int V = f.m->cfg.vocab_size, n = 17;
    int32_t prompt[17], other[17];
    for (int i = 0; i < n; i++) prompt[i] = other[i] = (i * 29 + 5) % V;
    other[n - 1] = (other[n - 1] + 1) % V; /* the same history, another question */
    float *a = malloc((size_t)V * sizeof *a), *b = malloc((size_t)V * sizeof *b);
    assert_int_equal(run_prompt(&f, "first", prompt, n, true, a), 0);
    shard_core_stats st;
    shard_core_get_stats(f.core, &st);
    assert_int_equal(st.prefix_cached_blocks, n / B); /* every whole block of the prompt */
    assert_int_equal(run_prompt(&f, "again", prompt, n, true, b), (n - 1) / B * B);
    assert_memory_equal(a, b, (size_t)V * sizeof *a);
    /* the other question: the shared history comes from the cache, the logits are computed */
    float *c = malloc((size_t)V * sizeof *c), *d = malloc((size_t)V * sizeof *d);
    assert_int_equal(run_prompt(&f, "other", other, n, true, c), (n - 1) / B * B);
    core_fixture g;
    core_open(&g, kv, 64u << 20, true);
    assert_int_equal(run_prompt(&g, "fresh", other, n, true, d), 0); /* cache off: nothing pinned */
    assert_memory_equal(c, d, (size_t)V * sizeof *c);
    int32_t longer[23]; /* 20 positions from the cache, 3 computed in one chunk, not 7 */
    for (int i = 0; i < 23; i++) longer[i] = (i * 29 + 5) % V;
    run_prompt(&f, "long1", longer, 23, true, c);
    assert_int_equal(run_prompt(&f, "long2", longer, 23, true, d), 20);
    for (int i = 0; i < V; i++) assert_true(fabsf(c[i] - d[i]) < 1e-4f);
    shard_core_get_stats(f.core, &st);
    assert_int_equal((int)st.prefix_hit_tokens, 2 * ((n - 1) / B * B) + 16 + 20);
    assert_int_equal((int)st.prefix_prompt_tokens, 3 * n + 2 * 23);
    assert_int_equal(st.kv_free_bytes, st.kv_total_bytes); /* cached blocks count as free */
    free(a), free(b), free(c), free(d);
    core_close(&f);
    core_close(&g);
}

static void test_reuse_bit_identical_f32(void **state) { (void)state, check_reuse_bit_identical(OP_TYPE_F32); }
static void test_reuse_bit_identical_f16(void **state) { (void)state, check_reuse_bit_identical(OP_TYPE_F16); }

/* A session that took cached blocks and then rolls back into them and writes other tokens
 * leaves the cached blocks as they were: a third session still gets the original prefix. */
static void test_no_write_into_shared_block(void **state) {
    (void)state;
    core_fixture f;
    core_open(&f, OP_TYPE_F32, 64u << 20, false);
    const int V = f.m->cfg.vocab_size, n = 13;
    int32_t prompt[13], junk[13];
    for (int i = 0; i < n; i++) prompt[i] = (i * 7 + 1) % V, junk[i] = (i * 11 + 3) % V;
    float *a = malloc((size_t)V * sizeof *a), *b = malloc((size_t)V * sizeof *b);
    run_prompt(&f, "a", prompt, n, true, a);
    shard_session *s;
    assert_int_equal(shard_session_open(f.core, "writer", 64, NULL, &s), FU_OK);
    int cached = shard_session_pin_prefix(f.core, s, prompt, n);
    assert_int_equal(cached, 12);
    assert_int_equal(shard_session_reuse_prefix(f.core, s, cached), FU_OK);
    assert_int_equal(shard_session_rollback(s, 2), FU_OK);
    shard_step st = {.n = n - 2, .start_pos = 2, .tokens = junk};
    assert_int_equal(shard_session_step(f.core, s, &st), FU_OK);
    shard_session_close(f.core, s);
    assert_int_equal(run_prompt(&f, "b", prompt, n, true, b), 12);
    assert_memory_equal(a, b, (size_t)V * sizeof *a);
    free(a), free(b);
    core_close(&f);
}

/* A session that pins nothing can still reuse 0, and reusing more than it pinned is refused. */
static void test_reuse_limits(void **state) {
    (void)state;
    core_fixture f;
    core_open(&f, OP_TYPE_F32, 64u << 20, false);
    shard_session *s;
    assert_int_equal(shard_session_open(f.core, "s", 64, NULL, &s), FU_OK);
    const int32_t t[9] = {1, 2, 3, 4, 5, 6, 7, 8, 9};
    assert_int_equal(shard_session_pin_prefix(f.core, s, t, 9), 0);
    assert_int_equal(shard_session_reuse_prefix(f.core, s, 4), FU_ERR_RANGE);
    shard_session_close(f.core, s);
    core_close(&f);
}

/* The adapter is part of the key: a session with an adapter gets none of the base model's
 * blocks, its own blocks serve its next session, and the same id loaded again is another
 * adapter. */
static void test_adapter_in_key(void **state) {
    (void)state;
    core_fixture f;
    core_open(&f, OP_TYPE_F32, 64u << 20, false);
    const mdl_config *c = &f.m->cfg;
    assert_int_equal(shard_core_adapter_load(f.core, "ad", test_random_adapter(c, 0, c->n_layers, LORA_TARGETS_ALL, 4, 3)), FU_OK);
    const int V = c->vocab_size, n = 13;
    int32_t prompt[13];
    for (int i = 0; i < n; i++) prompt[i] = (i * 5 + 2) % V;
    float *a = malloc((size_t)V * sizeof *a), *b = malloc((size_t)V * sizeof *b);
    assert_int_equal(run_prompt_with(&f, "base", NULL, prompt, n, true, a), 0);
    assert_int_equal(run_prompt_with(&f, "lora1", "ad", prompt, n, true, a), 0); /* not the base's blocks */
    assert_int_equal(run_prompt_with(&f, "lora2", "ad", prompt, n, true, b), 12);
    assert_memory_equal(a, b, (size_t)V * sizeof *a);
    assert_int_equal(shard_core_adapter_load(f.core, "ad", test_random_adapter(c, 0, c->n_layers, LORA_TARGETS_ALL, 4, 9)), FU_OK);
    assert_int_equal(run_prompt_with(&f, "lora3", "ad", prompt, n, true, b), 0); /* replaced: another adapter */
    free(a), free(b);
    core_close(&f);
}

/* Cached blocks live within the KV budget and give way to sessions: a budget that holds one
 * session of 64 positions admits the next one after the first's blocks were cached. */
static void test_cached_blocks_evicted_for_admission(void **state) {
    (void)state;
    core_fixture f;
    core_open(&f, OP_TYPE_F32, 0, false);
    shard_core_stats st;
    shard_core_get_stats(f.core, &st);
    shard_core_free(f.core);
    shard_core_options o = {.kv_budget_bytes = st.kv_bytes_per_pos * 64, .max_batch_tokens = 8,
                            .kv_type = OP_TYPE_F32, .kv_block_tokens = B};
    assert_int_equal(shard_core_new(f.m, f.be, &o, &f.core), FU_OK);
    const int V = f.m->cfg.vocab_size;
    int32_t prompt[40];
    for (int i = 0; i < 40; i++) prompt[i] = (i * 3 + 2) % V;
    float *a = malloc((size_t)V * sizeof *a);
    shard_session *s;
    assert_int_equal(shard_session_open(f.core, "x", 48, NULL, &s), FU_OK);
    shard_step step = {.n = 40, .start_pos = 0, .tokens = prompt};
    assert_int_equal(shard_session_step(f.core, s, &step), FU_OK);
    shard_core_get_stats(f.core, &st);
    assert_int_equal(st.prefix_cached_blocks, 16 / B); /* what the 16 positions left held */
    shard_session_close(f.core, s);
    assert_int_equal(run_prompt(&f, "y", prompt, 40, false, a), 0); /* 64 positions: evicts them all */
    shard_core_get_stats(f.core, &st);
    assert_int_equal(st.prefix_cached_blocks, 0); /* and no room for y's */
    free(a);
    core_close(&f);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_hash_chains_and_covers_tokens),
        cmocka_unit_test(test_acquire_longest_prefix_and_pins),
        cmocka_unit_test(test_lru_eviction),
        cmocka_unit_test(test_reuse_bit_identical_f32),
        cmocka_unit_test(test_reuse_bit_identical_f16),
        cmocka_unit_test(test_no_write_into_shared_block),
        cmocka_unit_test(test_reuse_limits),
        cmocka_unit_test(test_adapter_in_key),
        cmocka_unit_test(test_cached_blocks_evicted_for_admission),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
