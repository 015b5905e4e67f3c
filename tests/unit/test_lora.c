/* test_lora.c -- LoRA adapters: PEFT's initialisation (deterministic, in range), save -> load
 * round trips (bit-exact f32; bf16 / f16 converted; the ".default" infix), span slicing and
 * assembling a whole adapter from spans, each refusal of lora_load() with its message, and
 * atomic writes that leave nothing behind when they fail. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <dirent.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "lora.h"
#include "ops.h"
#include "safetensors.h"
#include "status.h"
#include "test-files.h"

/* ---- helpers ------------------------------------------------------------------------ */

/* 3 blocks, D 64, F 160, H 4, KVH 2, hd 16 (q 64 wide, k/v 32). */
static mdl_config model_cfg(void) {
    return (mdl_config){.n_layers = 3, .dim = 64, .ffn_dim = 160, .n_heads = 4, .n_kv_heads = 2,
                        .head_dim = 16};
}

static lora_config small_cfg(uint32_t targets) {
    lora_config c = lora_config_default();
    c.r = 4;
    c.alpha = 8;
    c.dropout = 0.05f;
    c.targets = targets;
    snprintf(c.base_model, sizeof c.base_model, "tiny-llama");
    return c;
}

static const uint32_t QV = LORA_TARGET_BIT(LORA_TARGET_Q) | LORA_TARGET_BIT(LORA_TARGET_V);

/* A saved adapter (targets q, v; B random) in tmpdir/rel; returns it (caller frees). */
static lora_adapter *saved(const char *rel, uint32_t targets) {
    mdl_config m = model_cfg();
    lora_config c = small_cfg(targets);
    lora_adapter *ad;
    assert_int_equal(lora_new(&c, &m, 0, 3, 7, &ad), FU_OK);
    lora_randomize_b(ad, 8, 0.5f);
    char dir[512];
    tmp_path(dir, sizeof dir, rel);
    mkdir(dir, 0755);
    assert_int_equal(lora_save(ad, dir), FU_OK);
    return ad;
}

static void expect_load_fail(const char *rel, int max_rank, int want, const char *sub, int line) {
    char dir[512];
    tmp_path(dir, sizeof dir, rel);
    mdl_config m = model_cfg();
    lora_adapter *ad = (lora_adapter *)1;
    int rc = lora_load(dir, &m, 0, -1, max_rank, &ad);
    const char *msg = fu_last_error();
    if (rc != want || !strstr(msg, sub) || ad)
        fail_msg("line %d: rc %d (want %d), message '%s' (want '%s')", line, rc, want, msg, sub);
}
#define EXPECT_LOAD_FAIL(rel, want, sub) expect_load_fail((rel), 64, (want), (sub), __LINE__)

static void assert_same_weights(const lora_adapter *a, const lora_adapter *b) {
    assert_int_equal(a->first, b->first);
    assert_int_equal(a->last, b->last);
    assert_int_equal(a->n_floats, b->n_floats);
    assert_memory_equal(a->data, b->data, a->n_floats * sizeof(float));
}

/* ---- initialisation ------------------------------------------------------------------- */

static void test_scale_and_dims(void **state) {
    (void)state;
    lora_config c = small_cfg(QV);
    assert_true(lora_scale(&c) == 2.0f);
    c.use_rslora = true;
    assert_true(lora_scale(&c) == 4.0f); /* 8 / sqrt(4) */
    mdl_config m = model_cfg();
    lora_shape s = lora_shape_of(&m);
    static const int want[LORA_N_TARGETS][2] = {{64, 64}, {64, 32}, {64, 32}, {64, 64},
                                                {64, 160}, {64, 160}, {160, 64}};
    for (int t = 0; t < LORA_N_TARGETS; t++) {
        int in, out;
        lora_target_dims(&s, (lora_target)t, &in, &out);
        assert_int_equal(in, want[t][0]);
        assert_int_equal(out, want[t][1]);
        lora_target back;
        assert_int_equal(lora_target_parse(lora_target_name((lora_target)t), &back), FU_OK);
        assert_int_equal(back, t);
    }
}

/* Same seed, same numbers; A within +-1/sqrt(in) and spread over it; B zero; a span adapter
 * holds the very numbers of the whole one's blocks. */
static void test_init(void **state) {
    (void)state;
    mdl_config m = model_cfg();
    lora_config c = small_cfg(LORA_TARGETS_ALL);
    lora_adapter *a, *b, *other, *span;
    assert_int_equal(lora_new(&c, &m, 0, 3, 1, &a), FU_OK);
    assert_int_equal(lora_new(&c, &m, 0, 3, 1, &b), FU_OK);
    assert_int_equal(lora_new(&c, &m, 0, 3, 2, &other), FU_OK);
    assert_int_equal(lora_new(&c, &m, 1, 2, 1, &span), FU_OK);
    assert_memory_equal(a->data, b->data, a->n_floats * sizeof(float));
    assert_memory_not_equal(a->data, other->data, a->n_floats * sizeof(float));
    for (int blk = 0; blk < 3; blk++)
        for (int t = 0; t < LORA_N_TARGETS; t++) {
            const lora_pair *p = lora_at(a, blk, (lora_target)t);
            int in, out;
            lora_target_dims(&a->shape, (lora_target)t, &in, &out);
            float bound = 1.0f / sqrtf((float)in), max_abs = 0;
            for (int i = 0; i < c.r * in; i++) max_abs = fmaxf(max_abs, fabsf(p->a[i]));
            assert_true(max_abs <= bound && max_abs > 0.8f * bound);
            for (int i = 0; i < out * c.r; i++) assert_true(p->b[i] == 0.0f);
        }
    const lora_pair *ps = lora_at(span, 1, LORA_TARGET_DOWN), *pa = lora_at(a, 1, LORA_TARGET_DOWN);
    assert_memory_equal(ps->a, pa->a, (size_t)c.r * 160 * sizeof(float));
    lora_adapter *bad;
    assert_int_equal(lora_new(&c, &m, 2, 4, 1, &bad), FU_ERR_INVALID);
    c.r = 0;
    assert_int_equal(lora_new(&c, &m, 0, 3, 1, &bad), FU_ERR_INVALID);
    lora_free(a);
    lora_free(b);
    lora_free(other);
    lora_free(span);
}

/* ---- files ---------------------------------------------------------------------------------- */

static void test_round_trip(void **state) {
    (void)state;
    lora_adapter *ad = saved("rt", LORA_TARGETS_ALL), *back;
    char dir[512];
    tmp_path(dir, sizeof dir, "rt");
    mdl_config m = model_cfg();
    assert_int_equal(lora_load(dir, &m, 0, -1, 64, &back), FU_OK);
    assert_same_weights(ad, back);
    assert_int_equal(back->cfg.r, 4);
    assert_true(back->cfg.alpha == 8.0f && back->cfg.dropout == 0.05f && !back->cfg.use_rslora);
    assert_int_equal(back->cfg.targets, LORA_TARGETS_ALL);
    assert_string_equal(back->cfg.base_model, "tiny-llama");
    lora_free(back);
    lora_free(ad);
}

/* A span loads only its blocks; span adapters saved apart merge into the whole adapter. */
static void test_spans(void **state) {
    (void)state;
    lora_adapter *ad = saved("whole", QV), *s1, *s2, *whole;
    char dir[512], d1[512], d2[512];
    tmp_path(dir, sizeof dir, "whole");
    mdl_config m = model_cfg();
    assert_int_equal(lora_load(dir, &m, 1, 3, 64, &s1), FU_OK);
    assert_int_equal(s1->first, 1);
    assert_memory_equal(lora_at(s1, 1, LORA_TARGET_Q)->a, lora_at(ad, 1, LORA_TARGET_Q)->a,
                        s1->n_floats * sizeof(float));
    assert_int_equal(lora_load(dir, &m, 0, 1, 64, &s2), FU_OK);
    tmp_path(d1, sizeof d1, "span-1-3");
    tmp_path(d2, sizeof d2, "span-0-1");
    mkdir(d1, 0755);
    mkdir(d2, 0755);
    assert_int_equal(lora_save(s1, d1), FU_OK);
    assert_int_equal(lora_save(s2, d2), FU_OK);
    /* a span file holds its blocks only: loading it as the whole model's adapter fails */
    EXPECT_LOAD_FAIL("span-1-3", FU_ERR_FORMAT, "layers.0.self_attn.q_proj.lora_A.weight' is missing");
    assert_int_equal(lora_new(&ad->cfg, &m, 0, 3, 99, &whole), FU_OK);
    assert_int_equal(lora_merge_span(whole, s1), FU_OK);
    assert_int_equal(lora_merge_span(whole, s2), FU_OK);
    assert_same_weights(ad, whole);
    assert_int_equal(lora_merge_span(s2, s1), FU_ERR_INVALID);
    lora_free(s1);
    lora_free(s2);
    lora_free(whole);
    lora_free(ad);
}

/* ---- refusals ------------------------------------------------------------------------------ */

#define MAX_T 64
typedef void (*edit_fn)(st_write_tensor *ts, size_t *n);

static void write_text(const char *rel, const char *file, const char *text) {
    char path[800];
    snprintf(path, sizeof path, "%s/%s/%s", tmpdir, rel, file);
    write_file(path, text, strlen(text));
}

/* tmpdir/rel: the config `config` (NULL: the valid q/v one) and the tensors of the valid
 * adapter "good" passed through `edit` (NULL: unchanged). */
static void remake(const char *rel, const char *config, edit_fn edit) {
    char dir[512], path[600], good[512];
    tmp_path(dir, sizeof dir, rel);
    mkdir(dir, 0755);
    write_text(rel, "adapter_config.json",
               config ? config : "{\"peft_type\":\"LORA\",\"r\":4,\"lora_alpha\":8,\"bias\":\"none\","
                                 "\"target_modules\":[\"v_proj\",\"q_proj\"]}");
    tmp_path(good, sizeof good, "good/adapter_model.safetensors");
    st_model *st;
    assert_int_equal(st_model_open(good, &st), FU_OK);
    st_write_tensor ts[MAX_T];
    size_t n = (size_t)st_model_n_tensors(st);
    for (size_t i = 0; i < n; i++) {
        st_tensor_info ti;
        assert_int_equal(st_model_tensor_info(st, (int64_t)i, &ti), FU_OK);
        ts[i] = (st_write_tensor){ti.name, ti.dtype, ti.rank, ti.shape, ti.data};
    }
    if (edit) edit(ts, &n);
    snprintf(path, sizeof path, "%s/adapter_model.safetensors", dir);
    assert_int_equal(st_write(path, ts, n), FU_OK);
    st_model_close(st);
}

static void drop_last(st_write_tensor *ts, size_t *n) { (void)ts; (*n)--; }

static void add_k(st_write_tensor *ts, size_t *n) {
    ts[*n] = ts[0];
    ts[(*n)++].name = "base_model.model.model.layers.0.self_attn.k_proj.lora_A.weight";
}

static void add_block_3(st_write_tensor *ts, size_t *n) {
    ts[*n] = ts[0];
    ts[(*n)++].name = "base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight";
}

static void misname(st_write_tensor *ts, size_t *n) {
    (void)n;
    ts[0].name = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weights";
}

static void reshape(st_write_tensor *ts, size_t *n) {
    static const int64_t shape[2] = {4, 32};
    for (size_t i = 0; i < *n; i++)
        if (strcmp(ts[i].name, "base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight") == 0)
            ts[i].shape = shape;
}

static void to_i32(st_write_tensor *ts, size_t *n) { (void)n; ts[2].dtype = "I32"; }

static void put_nan(st_write_tensor *ts, size_t *n) {
    static float x[4 * 64];
    (void)n;
    memcpy(x, ts[0].data, sizeof x); /* ts[0]: block 0 q_proj lora_A (4, 64) */
    x[77] = NAN;
    ts[0].data = x;
}

/* Every tensor as BF16 (even ones) or F16 (odd ones), with PEFT's ".default" infix. */
static void to_half_default(st_write_tensor *ts, size_t *n) {
    static uint16_t buf[1 << 16];
    static char names[MAX_T][160];
    size_t used = 0;
    for (size_t i = 0; i < *n; i++) {
        size_t k = (size_t)(ts[i].shape[0] * ts[i].shape[1]);
        const float *src = ts[i].data;
        for (size_t j = 0; j < k; j++)
            buf[used + j] = i % 2 ? op_f32_to_f16(src[j]) : op_f32_to_bf16(src[j]);
        const char *dot = strstr(ts[i].name, ".weight");
        snprintf(names[i], sizeof names[i], "%.*s.default.weight", (int)(dot - ts[i].name), ts[i].name);
        ts[i] = (st_write_tensor){names[i], i % 2 ? "F16" : "BF16", 2, ts[i].shape, buf + used};
        used += k;
    }
}

static void test_refusals_tensors(void **state) {
    (void)state;
    lora_free(saved("good", QV));
    remake("missing", NULL, drop_last);
    EXPECT_LOAD_FAIL("missing", FU_ERR_FORMAT, "layers.2.self_attn.v_proj.lora_B.weight' is missing");
    remake("extra", NULL, add_k);
    EXPECT_LOAD_FAIL("extra", FU_ERR_FORMAT, "k_proj.lora_A.weight': k_proj is not in target_modules");
    remake("blocks", NULL, add_block_3);
    EXPECT_LOAD_FAIL("blocks", FU_ERR_FORMAT, "block 3, but the model has 3 blocks");
    remake("misnamed", NULL, misname);
    EXPECT_LOAD_FAIL("misnamed", FU_ERR_FORMAT, "q_proj.lora_A.weights': not a LoRA weight");
    remake("shape", NULL, reshape);
    EXPECT_LOAD_FAIL("shape", FU_ERR_FORMAT,
                     "layers.1.self_attn.q_proj.lora_A.weight': shape [4, 32], expected [4, 64]");
    remake("dtype", NULL, to_i32);
    EXPECT_LOAD_FAIL("dtype", FU_ERR_UNSUPPORTED, "v_proj.lora_A.weight': dtype I32");
    remake("nan", NULL, put_nan);
    EXPECT_LOAD_FAIL("nan", FU_ERR_FORMAT, "q_proj.lora_A.weight': element 77 is not finite");
}

static void test_refusals_config(void **state) {
    (void)state;
    lora_free(saved("good", QV));
    static const struct {
        const char *config, *sub;
        int rc;
    } cases[] = {
        {"{\"peft_type\":\"LORA\",\"r\":0,\"lora_alpha\":8,\"target_modules\":[\"q_proj\",\"v_proj\"]}",
         "\"r\" must be an integer in [1, 64]", FU_ERR_FORMAT},
        {"{\"peft_type\":\"LORA\",\"r\":128,\"lora_alpha\":8,\"target_modules\":[\"q_proj\",\"v_proj\"]}",
         "\"r\" must be an integer in [1, 64]", FU_ERR_FORMAT},
        {"{\"peft_type\":\"LORA\",\"r\":4,\"lora_alpha\":8,\"target_modules\":[\"q_proj\",\"foo_proj\"]}",
         "unknown target 'foo_proj'", FU_ERR_UNSUPPORTED},
        {"{\"peft_type\":\"LORA\",\"r\":4,\"lora_alpha\":8,\"target_modules\":\".*proj\"}",
         "patterns are not supported", FU_ERR_UNSUPPORTED},
        {"{\"peft_type\":\"LORA\",\"r\":4,\"lora_alpha\":8,\"bias\":\"all\",\"target_modules\":[\"q_proj\"]}",
         "\"bias\" must be \"none\" (got all)", FU_ERR_UNSUPPORTED},
        {"{\"peft_type\":\"LORA\",\"r\":4,\"lora_alpha\":8,\"use_dora\":true,\"target_modules\":[\"q_proj\"]}",
         "\"use_dora\" is not supported", FU_ERR_UNSUPPORTED},
        {"{\"peft_type\":\"LORA\",\"r\":4,\"lora_alpha\":8,\"rank_pattern\":{\"q_proj\":2},"
         "\"target_modules\":[\"q_proj\"]}", "\"rank_pattern\" is not supported", FU_ERR_UNSUPPORTED},
        {"{\"peft_type\":\"LOHA\",\"r\":4}", "\"peft_type\" must be \"LORA\"", FU_ERR_UNSUPPORTED},
        {"{\"peft_type\":\"LORA\",\"r\":4,\"lora_alpha\":\"8\",\"target_modules\":[\"q_proj\"]}",
         "\"lora_alpha\" must be a finite number", FU_ERR_FORMAT},
        {"{\"peft_type\":\"LORA\",\"r\":4,\"lora_alpha\":8,\"lora_dropout\":1.5,\"target_modules\":[\"q_proj\"]}",
         "lora_dropout = 1.5", FU_ERR_FORMAT},
        {"{\"peft_type\": \"LORA\", \"r\": 4,", "adapter_config.json:1: not a JSON object", FU_ERR_FORMAT},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        remake("config", cases[i].config, NULL);
        expect_load_fail("config", 64, cases[i].rc, cases[i].sub, (int)(1000 + i));
    }
}

/* Files that are not regular files, or absent, are refused by name without blocking. */
static void test_refusals_files(void **state) {
    (void)state;
    lora_free(saved("good", QV));
    char p[512];
    remake("dir-weights", NULL, NULL);
    tmp_path(p, sizeof p, "dir-weights/adapter_model.safetensors");
    assert_int_equal(unlink(p), 0);
    assert_int_equal(mkdir(p, 0755), 0);
    EXPECT_LOAD_FAIL("dir-weights", FU_ERR_IO, "dir-weights/adapter_model.safetensors");
    remake("fifo-config", NULL, NULL);
    tmp_path(p, sizeof p, "fifo-config/adapter_config.json");
    assert_int_equal(unlink(p), 0);
    assert_int_equal(mkfifo(p, 0600), 0);
    EXPECT_LOAD_FAIL("fifo-config", FU_ERR_IO, "fifo-config/adapter_config.json");
    tmp_path(p, sizeof p, "empty");
    mkdir(p, 0755);
    EXPECT_LOAD_FAIL("empty", FU_ERR_NOT_FOUND, "empty/adapter_config.json");
}

/* BF16 and F16 tensors load as their f32 values; PEFT's ".default" infix is accepted. */
static void test_half_and_default_infix(void **state) {
    (void)state;
    lora_adapter *ad = saved("good", QV), *back;
    remake("half", NULL, to_half_default);
    char dir[512];
    tmp_path(dir, sizeof dir, "half");
    mdl_config m = model_cfg();
    assert_int_equal(lora_load(dir, &m, 0, -1, 64, &back), FU_OK);
    const lora_pair *p = lora_at(ad, 0, LORA_TARGET_Q), *q = lora_at(back, 0, LORA_TARGET_Q);
    for (int i = 0; i < 4 * 64; i++) /* q_proj A: BF16; q_proj B: F16 */
        assert_true(q->a[i] == op_bf16_to_f32(op_f32_to_bf16(p->a[i])));
    for (int i = 0; i < 64 * 4; i++) assert_true(q->b[i] == op_f16_to_f32(op_f32_to_f16(p->b[i])));
    lora_free(back);
    lora_free(ad);
}

/* ---- atomic writes ------------------------------------------------------------------------------ */

/* Names in tmpdir/rel other than "." and "..", for checking nothing was left. */
static int count_entries(const char *rel) {
    char dir[512];
    tmp_path(dir, sizeof dir, rel);
    DIR *d = opendir(dir);
    assert_non_null(d);
    int n = 0;
    for (struct dirent *e; (e = readdir(d));)
        n += strcmp(e->d_name, ".") && strcmp(e->d_name, "..");
    closedir(d);
    return n;
}

static void test_atomic_save(void **state) {
    (void)state;
    lora_adapter *ad = saved("good", QV);
    char dir[512], p[512];
    tmp_path(dir, sizeof dir, "readonly");
    assert_int_equal(mkdir(dir, 0555), 0);
    if (geteuid() != 0) { /* root writes anyway */
        assert_int_equal(lora_save(ad, dir), FU_ERR_IO);
        assert_int_equal(count_entries("readonly"), 0);
    }
    /* a rename that fails (the target name is a directory) leaves no temporary file */
    tmp_path(dir, sizeof dir, "blocked");
    tmp_path(p, sizeof p, "blocked/adapter_model.safetensors");
    assert_int_equal(mkdir(dir, 0755), 0);
    assert_int_equal(mkdir(p, 0755), 0);
    assert_int_equal(lora_save(ad, dir), FU_ERR_IO);
    assert_non_null(strstr(fu_last_error(), "adapter_model.safetensors"));
    assert_int_equal(count_entries("blocked"), 1);
    tmp_path(dir, sizeof dir, "no-such-dir");
    assert_int_equal(lora_save(ad, dir), FU_ERR_IO);
    lora_free(ad);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_scale_and_dims),
        cmocka_unit_test(test_init),
        cmocka_unit_test(test_round_trip),
        cmocka_unit_test(test_spans),
        cmocka_unit_test(test_refusals_tensors),
        cmocka_unit_test(test_refusals_config),
        cmocka_unit_test(test_refusals_files),
        cmocka_unit_test(test_half_and_default_infix),
        cmocka_unit_test(test_atomic_save),
    };
    return cmocka_run_group_tests(tests, tf_setup, tf_teardown);
}
