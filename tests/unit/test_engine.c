/* test_engine.c -- the engine on random weights: batching across sequences equals
 * running each alone, chunked prefill equals one pass, rollback, and bad input. */
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

#include "engine.h"
#include "model.h"
#include "status.h"
#include "test-engine.h"
#include "test-model.h"

static void fixture_open(fixture *f, mdl_arch arch, op_type wt, int max_batch) {
    mdl_config c = test_small_config(arch);
    fixture_open_config(f, &c, wt, max_batch);
}

static float max_abs_diff(const float *a, const float *b, size_t n) {
    float d = 0;
    for (size_t i = 0; i < n; i++) d = fmaxf(d, fabsf(a[i] - b[i]));
    return d;
}

/* Runs `n` tokens of one sequence alone; returns logits of every position. */
static void run_alone(fixture *f, const int32_t *ids, int n, float *out) {
    eng_seq *s;
    assert_int_equal(eng_seq_new(f->e, 64, &s), FU_OK);
    eng_seq **seqs = malloc((size_t)n * sizeof *seqs);
    for (int i = 0; i < n; i++) seqs[i] = s;
    eng_batch b = {n, ids, NULL, seqs, NULL};
    assert_int_equal(eng_forward(f->e, &b, out), FU_OK);
    assert_int_equal(eng_seq_len(s), n);
    free(seqs);
    eng_seq_free(f->e, s);
}

static void check_batched_equals_alone(mdl_arch arch, op_type wt) {
    fixture f;
    fixture_open(&f, arch, wt, 256);
    const int V = f.m->cfg.vocab_size;
    const int32_t a_ids[] = {1, 5, 9, 13, 17, 21, 25, 29, 33, 37};
    const int32_t b_ids[] = {2, 4, 8, 16, 32, 64};
    float *la = malloc(10 * (size_t)V * sizeof(float)), *lb = malloc(6 * (size_t)V * sizeof(float));
    run_alone(&f, a_ids, 10, la);
    run_alone(&f, b_ids, 6, lb);

    /* now interleaved: prefill A[0..7) with B[0..3), then decode A and B
     * one token each per batch, mixed with B's remaining prefill */
    eng_seq *sa, *sb;
    assert_int_equal(eng_seq_new(f.e, 64, &sa), FU_OK);
    assert_int_equal(eng_seq_new(f.e, 64, &sb), FU_OK);
    float *out = malloc(16 * (size_t)V * sizeof(float));
    int32_t t1[] = {1, 2, 5, 4, 9, 13, 8, 17, 21};
    eng_seq *s1[] = {sa, sb, sa, sb, sa, sa, sb, sa, sa};
    eng_batch b1 = {9, t1, NULL, s1, NULL};
    assert_int_equal(eng_forward(f.e, &b1, out), FU_OK);
    const int a_pos1[] = {0, 2, 4, 5, 7, 8}, b_pos1[] = {1, 3, 6};
    for (int i = 0; i < 6; i++)
        assert_true(max_abs_diff(out + (size_t)a_pos1[i] * V, la + (size_t)i * V, (size_t)V) < 1e-4f);
    for (int i = 0; i < 3; i++)
        assert_true(max_abs_diff(out + (size_t)b_pos1[i] * V, lb + (size_t)i * V, (size_t)V) < 1e-4f);
    int32_t t2[] = {25, 16, 32, 64};
    eng_seq *s2[] = {sa, sb, sb, sb};
    uint8_t want[] = {1, 0, 0, 1};
    eng_batch b2 = {4, t2, NULL, s2, want};
    assert_int_equal(eng_forward(f.e, &b2, out), FU_OK);
    assert_true(max_abs_diff(out, la + 6 * (size_t)V, (size_t)V) < 1e-4f);
    assert_true(max_abs_diff(out + V, lb + 5 * (size_t)V, (size_t)V) < 1e-4f);
    assert_int_equal(eng_seq_len(sa), 7);
    assert_int_equal(eng_seq_len(sb), 6);

    /* rollback A to 5 positions and replay: same logits as before */
    assert_int_equal(eng_seq_truncate(sa, 5), FU_OK);
    eng_seq *s3[] = {sa, sa};
    eng_batch b3 = {2, a_ids + 5, NULL, s3, NULL};
    assert_int_equal(eng_forward(f.e, &b3, out), FU_OK);
    assert_true(max_abs_diff(out, la + 5 * (size_t)V, 2 * (size_t)V) < 1e-4f);
    assert_int_equal(eng_seq_truncate(sa, 8), FU_ERR_RANGE);

    eng_seq_free(f.e, sa);
    eng_seq_free(f.e, sb);
    free(out);
    free(la);
    free(lb);
    fixture_close(&f);
}

static void test_batched_llama_f32(void **state) { check_batched_equals_alone(MDL_ARCH_LLAMA, OP_TYPE_F32); }
static void test_batched_qwen2_bf16(void **state) { check_batched_equals_alone(MDL_ARCH_QWEN2, OP_TYPE_BF16); }
static void test_batched_qwen3_q8(void **state) { check_batched_equals_alone(MDL_ARCH_QWEN3, OP_TYPE_Q8_0); }
static void test_batched_llama_q4_1(void **state) { check_batched_equals_alone(MDL_ARCH_LLAMA, OP_TYPE_Q4_1); }

static void test_chunked_prefill_equals_single_pass(void **state) {
    fixture big, small;
    fixture_open(&big, MDL_ARCH_LLAMA, OP_TYPE_F16, 64);
    fixture_open(&small, MDL_ARCH_LLAMA, OP_TYPE_F16, 3);
    const int V = big.m->cfg.vocab_size, n = 20;
    int32_t ids[20];
    for (int i = 0; i < n; i++) ids[i] = (i * 37 + 3) % V;
    float *a = malloc((size_t)n * V * sizeof(float)), *b = malloc((size_t)n * V * sizeof(float));
    run_alone(&big, ids, n, a);
    run_alone(&small, ids, n, b);
    assert_true(max_abs_diff(a, b, (size_t)n * V) < 1e-4f);
    free(a);
    free(b);
    fixture_close(&big);
    fixture_close(&small);
}

/* Logits of `ids` (one sequence) through an engine on m and be. */
static void forward_logits(const mdl_model *m, op_backend *be, const int32_t *ids, int n, float *out) {
    eng_engine *e;
    eng_seq *s;
    assert_int_equal(eng_new(m, be, NULL, &e), FU_OK);
    assert_int_equal(eng_seq_new(e, 16, &s), FU_OK);
    eng_seq *ss[8];
    for (int i = 0; i < n; i++) ss[i] = s;
    eng_batch b = {n, ids, NULL, ss, NULL};
    assert_int_equal(eng_forward(e, &b, out), FU_OK);
    eng_seq_free(e, s);
    eng_free(e);
}

/* Weights run in whichever layout the backend prepares (interleaved rows
 * on AVX-512, as they are elsewhere) give the same logits; a model drawn in
 * the interleaved layout holds the same numbers; engines that repack and give
 * back a model's pages leave the model usable by the next one. */
static void test_weights_prepared_for_the_backend(void **state) {
    (void)state;
    mdl_config c = test_small_config(MDL_ARCH_LLAMA);
    c.vocab_size = 112; /* the head repacks too (whole groups of 16 rows) */
    mdl_open_options all = mdl_open_options_all();
    static const op_type types[][2] = {{OP_TYPE_Q8_0, OP_TYPE_Q8_0_R16},
                                       {OP_TYPE_Q4_0, OP_TYPE_Q4_0_R16},
                                       {OP_TYPE_Q4_1, OP_TYPE_Q4_1_R16},
                                       {OP_TYPE_F16, OP_TYPE_F16_R16},
                                       {OP_TYPE_BF16, OP_TYPE_BF16_R16}};
    op_backend *portable = op_backend_cpu_new(&(op_cpu_options){.n_threads = 2, .isa = OP_CPU_ISA_PORTABLE});
    op_backend *best = op_backend_cpu_new(&(op_cpu_options){.n_threads = 2, .isa = OP_CPU_ISA_AUTO});
    assert_true(portable && best);
    const int32_t ids[] = {3, 17, 111, 5, 64, 2};
    enum { N = sizeof ids / sizeof ids[0], V = 112 };
    float *ref = malloc(N * V * sizeof(float)), *got = malloc(N * V * sizeof(float));
    assert_true(ref && got);
    for (size_t i = 0; i < sizeof types / sizeof types[0]; i++) {
        mdl_model *plain, *packed;
        assert_int_equal(mdl_random(&c, types[i][0], 9, &all, &plain), FU_OK);
        assert_int_equal(mdl_random(&c, types[i][1], 9, &all, &packed), FU_OK);
        assert_int_equal(packed->layers[0].w_up.type, types[i][1]);
        assert_int_equal(packed->lm_head.type, types[i][1]);
        assert_int_equal(op_weight_layout(portable, types[i][0], 16), types[i][0]);
        forward_logits(plain, portable, ids, N, ref);
        forward_logits(plain, best, ids, N, got);
        assert_true(max_abs_diff(ref, got, N * V) < 1e-4f);
        forward_logits(plain, best, ids, N, ref); /* a second engine on the same model */
        assert_memory_equal(ref, got, N * V * sizeof(float));
        forward_logits(packed, best, ids, N, ref);
        assert_memory_equal(ref, got, N * V * sizeof(float));
        forward_logits(packed, portable, ids, N, ref);
        assert_true(max_abs_diff(ref, got, N * V) < 1e-4f);
        mdl_free(plain);
        mdl_free(packed);
    }
    free(ref);
    free(got);
    op_backend_free(portable);
    op_backend_free(best);
}

static void test_span_without_embeddings_takes_hidden_states(void **state) {
    /* blocks [0, 1) with embeddings then [1, 2) with the head equal the whole model */
    mdl_config c = test_small_config(MDL_ARCH_LLAMA);
    mdl_open_options all = mdl_open_options_all();
    mdl_open_options first = {0, 1, true, false}, second = {1, 2, false, true};
    mdl_model *mw, *m1, *m2;
    assert_int_equal(mdl_random(&c, OP_TYPE_F32, 7, &all, &mw), FU_OK);
    assert_int_equal(mdl_random(&c, OP_TYPE_F32, 7, &first, &m1), FU_OK);
    op_cpu_options co = {.n_threads = 1, .isa = OP_CPU_ISA_AUTO};
    op_backend *be = op_backend_cpu_new(&co);
    eng_engine *ew, *e1;
    assert_int_equal(eng_new(mw, be, NULL, &ew), FU_OK);
    assert_int_equal(eng_new(m1, be, NULL, &e1), FU_OK);
    int32_t ids[] = {3, 4, 5};
    eng_seq *s1;
    assert_int_equal(eng_seq_new(e1, 16, &s1), FU_OK);
    eng_seq *ss[] = {s1, s1, s1};
    float hidden[3 * 64];
    eng_batch b = {3, ids, NULL, ss, NULL};
    assert_int_equal(eng_forward(e1, &b, hidden), FU_OK);
    for (int i = 0; i < 3 * 64; i++) assert_true(isfinite(hidden[i]));
    assert_int_equal(mdl_random(&c, OP_TYPE_F32, 7, &second, &m2), FU_OK);
    eng_engine *e2;
    assert_int_equal(eng_new(m2, be, NULL, &e2), FU_OK);
    eng_seq *s2;
    assert_int_equal(eng_seq_new(e2, 16, &s2), FU_OK);
    eng_seq *ss2[] = {s2, s2, s2};
    eng_batch bad = {3, ids, NULL, ss2, NULL}; /* token ids into a span without embeddings */
    float *logits = malloc(3 * 100 * sizeof(float));
    assert_int_equal(eng_forward(e2, &bad, logits), FU_ERR_INVALID);
    eng_batch good = {3, NULL, hidden, ss2, NULL};
    assert_int_equal(eng_forward(e2, &good, logits), FU_OK);
    assert_int_equal(eng_seq_len(s2), 3);
    /* the two spans chained compute what the whole model computes */
    eng_seq *sw;
    assert_int_equal(eng_seq_new(ew, 16, &sw), FU_OK);
    eng_seq *ssw[] = {sw, sw, sw};
    float *whole = malloc(3 * 100 * sizeof(float));
    eng_batch wb = {3, ids, NULL, ssw, NULL};
    assert_int_equal(eng_forward(ew, &wb, whole), FU_OK);
    assert_true(max_abs_diff(whole, logits, 300) < 1e-5f);
    eng_seq_free(ew, sw);
    free(whole);
    free(logits);
    eng_seq_free(e2, s2);
    eng_seq_free(e1, s1);
    eng_free(e2);
    eng_free(e1);
    eng_free(ew);
    op_backend_free(be);
    mdl_free(m2);
    mdl_free(m1);
    mdl_free(mw);
}

static void test_bad_input(void **state) {
    fixture f;
    fixture_open(&f, MDL_ARCH_LLAMA, OP_TYPE_F32, 16);
    eng_seq *s;
    assert_int_equal(eng_seq_new(f.e, 0, &s), FU_ERR_RANGE);
    assert_int_equal(eng_seq_new(f.e, 65, &s), FU_ERR_RANGE);
    assert_int_equal(eng_seq_new(f.e, 4, &s), FU_OK);
    float out[5 * 100];
    int32_t ids[5] = {1, 2, 3, 4, 5};
    eng_seq *ss[5] = {s, s, s, s, s};
    eng_batch over = {5, ids, NULL, ss, NULL}; /* 5 positions into a 4-position cache */
    assert_int_equal(eng_forward(f.e, &over, out), FU_ERR_RANGE);
    assert_int_equal(eng_seq_len(s), 0);
    int32_t bad_ids[2] = {1, 100};
    eng_batch bad_tok = {2, bad_ids, NULL, ss, NULL};
    assert_int_equal(eng_forward(f.e, &bad_tok, out), FU_ERR_RANGE);
    assert_int_equal(eng_seq_len(s), 0);
    eng_batch empty = {0, ids, NULL, ss, NULL};
    assert_int_equal(eng_forward(f.e, &empty, out), FU_ERR_INVALID);
    eng_seq_free(f.e, s);
    fixture_close(&f);

    mdl_config c = test_small_config(MDL_ARCH_LLAMA);
    c.n_kv_heads = 3; /* 4 heads are not a multiple of 3 kv heads */
    mdl_model *m;
    assert_int_equal(mdl_random(&c, OP_TYPE_F32, 1, NULL, &m), FU_ERR_FORMAT);
    c = test_small_config(MDL_ARCH_LLAMA);
    mdl_open_options o = {1, 5, false, false};
    assert_int_equal(mdl_random(&c, OP_TYPE_F32, 1, &o, &m), FU_ERR_RANGE);
    assert_int_equal(mdl_open("/nonexistent/model", NULL, &m), FU_ERR_NOT_FOUND);
}

/* ---- hyper-parameters read from files ------------------------------------------------------ */

/* Writes `text` as dir/config.json and opens dir; the status (fu_last_error says why). */
static int open_hf_config(const char *dir, const char *text) {
    char path[512];
    snprintf(path, sizeof path, "%s/config.json", dir);
    FILE *fp = fopen(path, "wb");
    assert_non_null(fp);
    fputs(text, fp);
    assert_int_equal(fclose(fp), 0);
    mdl_model *m = NULL;
    int rc = mdl_open(dir, NULL, &m);
    mdl_free(m);
    return rc;
}

static void expect_config_refused(int rc, const char *key) {
    if (rc != FU_ERR_FORMAT || !strstr(fu_last_error(), key))
        fail_msg("expected FU_ERR_FORMAT naming %s, got %s: %s", key, fu_status_str(rc), fu_last_error());
}

/* config.json values that parse as numbers but are not usable are refused naming the key, before
 * any weights are looked at (float overflow gives inf; eps must lie in (0, 1)). */
static void test_hf_config_values_checked(void **state) {
    char dir[] = "/tmp/fusion-config-XXXXXX";
    assert_non_null(mkdtemp(dir));
    static const char *const base =
        "{\"architectures\": [\"LlamaForCausalLM\"], \"num_hidden_layers\": 2, \"hidden_size\": 64, "
        "\"intermediate_size\": 96, \"num_attention_heads\": 4, "
        "\"vocab_size\": 50, %s}";
    static const struct {
        const char *extra, *key;
    } bad[] = {
        {"\"rope_theta\": 1e39", "rope_theta"},
        {"\"rope_theta\": -5", "rope_theta"},
        {"\"rms_norm_eps\": 1e39", "rms_norm_eps"},
        {"\"rms_norm_eps\": 2", "rms_norm_eps"},
        {"\"rope_scaling\": {\"rope_type\": \"linear\", \"factor\": 1e39}", "factor"},
        {"\"rope_scaling\": {\"rope_type\": \"llama3\", \"factor\": 8, \"low_freq_factor\": 1e39}",
         "low_freq_factor"},
        {"\"max_position_embeddings\": -1", "max_position_embeddings"},
        {"\"head_dim\": 15", "head_dim"},
        {"\"num_key_value_heads\": 3", "num_key_value_heads"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        char text[1024];
        snprintf(text, sizeof text, base, bad[i].extra);
        expect_config_refused(open_hf_config(dir, text), bad[i].key);
    }
    char path[512];
    snprintf(path, sizeof path, "%s/config.json", dir);
    unlink(path);
    rmdir(dir);
}

/* A GGUF writer for metadata-only files with one tiny token_embd tensor. */
typedef struct gw {
    uint8_t b[4096];
    size_t n;
} gw;

static void gw_put(gw *w, const void *p, size_t n) {
    assert_true(w->n + n <= sizeof w->b);
    memcpy(w->b + w->n, p, n);
    w->n += n;
}
static void gw_u32(gw *w, uint32_t v) { gw_put(w, &v, 4); }
static void gw_u64(gw *w, uint64_t v) { gw_put(w, &v, 8); }
static void gw_str(gw *w, const char *s) {
    gw_u64(w, strlen(s));
    gw_put(w, s, strlen(s));
}
static void gw_key_u32(gw *w, const char *k, uint32_t v) {
    gw_str(w, k);
    gw_u32(w, 4); /* UINT32 */
    gw_u32(w, v);
}
static void gw_key_f32(gw *w, const char *k, float v) {
    gw_str(w, k);
    gw_u32(w, 6); /* FLOAT32 */
    gw_put(w, &v, 4);
}

/* A llama GGUF whose `key` (a float) is `value`; written to `path`. */
static void write_gguf(const char *path, const char *key, float value) {
    gw w = {0};
    gw_put(&w, "GGUF", 4);
    gw_u32(&w, 3);
    gw_u64(&w, 1); /* tensors */
    gw_u64(&w, 8); /* keys */
    gw_str(&w, "general.architecture");
    gw_u32(&w, 8); /* STRING */
    gw_str(&w, "llama");
    gw_key_u32(&w, "llama.block_count", 2);
    gw_key_u32(&w, "llama.embedding_length", 64);
    gw_key_u32(&w, "llama.feed_forward_length", 96);
    gw_key_u32(&w, "llama.attention.head_count", 4);
    gw_key_u32(&w, "llama.attention.head_count_kv", 2);
    gw_key_f32(&w, "llama.attention.layer_norm_rms_epsilon",
               strcmp(key, "llama.attention.layer_norm_rms_epsilon") ? 1e-5f : value);
    gw_key_f32(&w, "llama.rope.freq_base", strcmp(key, "llama.rope.freq_base") ? 10000.0f : value);
    gw_str(&w, "token_embd.weight");
    gw_u32(&w, 2);
    gw_u64(&w, 64);
    gw_u64(&w, 50);
    gw_u32(&w, 0); /* F32 */
    gw_u64(&w, 0);
    while (w.n % 32) gw_put(&w, "", 1);
    FILE *fp = fopen(path, "wb");
    assert_non_null(fp);
    assert_int_equal(fwrite(w.b, 1, w.n, fp), w.n);
    static float embd[50 * 64];
    assert_int_equal(fwrite(embd, 1, sizeof embd, fp), sizeof embd);
    assert_int_equal(fclose(fp), 0);
}

/* GGUF float metadata that is infinite, NaN or out of range is refused naming the key. */
static void test_gguf_config_values_checked(void **state) {
    char dir[] = "/tmp/fusion-gguf-XXXXXX";
    assert_non_null(mkdtemp(dir));
    char path[512];
    snprintf(path, sizeof path, "%s/m.gguf", dir);
    static const struct {
        const char *key;
        float v;
    } bad[] = {
        {"llama.rope.freq_base", INFINITY},
        {"llama.rope.freq_base", NAN},
        {"llama.rope.freq_base", 0},
        {"llama.attention.layer_norm_rms_epsilon", INFINITY},
        {"llama.attention.layer_norm_rms_epsilon", 1.5f},
        {"llama.attention.layer_norm_rms_epsilon", -1e-5f},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        write_gguf(path, bad[i].key, bad[i].v);
        mdl_model *m = NULL;
        int rc = mdl_open(path, NULL, &m);
        mdl_free(m);
        expect_config_refused(rc, bad[i].key);
    }
    unlink(path);
    rmdir(dir);
}

/* The same checks guard configurations built in code. */
static void test_random_config_values_checked(void **state) {
    mdl_config c = test_small_config(MDL_ARCH_LLAMA);
    mdl_model *m = NULL;
    c.rope_theta = INFINITY;
    assert_int_not_equal(mdl_random(&c, OP_TYPE_F32, 1, NULL, &m), FU_OK);
    c = test_small_config(MDL_ARCH_LLAMA);
    c.norm_eps = INFINITY;
    assert_int_not_equal(mdl_random(&c, OP_TYPE_F32, 1, NULL, &m), FU_OK);
    assert_null(m);
}

/* Runs ids[0..n) on a new sequence of f's engine, first importing kv's first k positions when
 * kv is not NULL; returns the last position's logits in out. */
static void run_from(fixture *f, const int32_t *ids, int n, const void *kv, int k, float *out) {
    eng_seq *s, *seqs[32];
    assert_int_equal(eng_seq_new(f->e, 32, &s), FU_OK);
    if (kv) assert_int_equal(eng_seq_kv_import(s, 0, k, kv, 20), FU_OK);
    else k = 0;
    for (int i = 0; i < 32; i++) seqs[i] = s;
    uint8_t want[32] = {0};
    want[n - k - 1] = 1;
    eng_batch b = {n - k, ids + k, NULL, seqs, want};
    assert_int_equal(eng_forward(f->e, &b, out), FU_OK);
    eng_seq_free(f->e, s);
}

/* Prefix caching's premise: a sequence that imports another's exported KV for its first k
 * positions and computes the rest gives bit-identical logits to one that computed them all,
 * when the computed positions run in the same chunks (k a multiple of the chunk size). The
 * CPU kernels are not batch-invariant, so a suffix cut elsewhere (as when batched with other
 * sessions) differs in the last bits only. */
static void check_kv_import_bit_identical(op_type kv) {
    fixture f;
    mdl_config c = test_small_config(MDL_ARCH_LLAMA);
    mdl_open_options o = mdl_open_options_all();
    assert_int_equal(mdl_random(&c, OP_TYPE_F32, 7, &o, &f.m), FU_OK);
    op_cpu_options co = {.n_threads = 2, .isa = OP_CPU_ISA_AUTO};
    f.be = op_backend_cpu_new(&co);
    eng_options eo = {8, kv};
    assert_int_equal(eng_new(f.m, f.be, &eo, &f.e), FU_OK);
    const int V = f.m->cfg.vocab_size, n = 23;
    int32_t ids[23];
    for (int i = 0; i < n; i++) ids[i] = (i * 29 + 5) % V;
    eng_seq *a, *seqs[23];
    assert_int_equal(eng_seq_new(f.e, 32, &a), FU_OK);
    for (int i = 0; i < n; i++) seqs[i] = a;
    uint8_t want[23] = {0};
    want[n - 1] = 1;
    eng_batch ba = {n, ids, NULL, seqs, want};
    float *la = malloc((size_t)V * sizeof *la), *lb = malloc((size_t)V * sizeof *lb);
    assert_int_equal(eng_forward(f.e, &ba, la), FU_OK);
    const size_t pp = eng_kv_bytes_per_pos(f.e);
    uint8_t *kva = malloc(pp * 20), *kvb = malloc(pp * 20);
    assert_int_equal(eng_seq_kv_export(a, 0, 20, kva), FU_OK);
    assert_int_equal(eng_seq_kv_export(a, 10, n, kva), FU_ERR_RANGE);
    /* the imported KV is the exported one, bit for bit */
    eng_seq *b;
    assert_int_equal(eng_seq_new(f.e, 32, &b), FU_OK);
    assert_int_equal(eng_seq_kv_import(b, 1, 16, kva, 20), FU_ERR_RANGE); /* only at its length */
    assert_int_equal(eng_seq_kv_import(b, 0, 21, kva, 20), FU_ERR_RANGE); /* not beyond the export */
    assert_int_equal(eng_seq_kv_import(b, 0, 20, kva, 20), FU_OK);
    assert_int_equal(eng_seq_len(b), 20);
    assert_int_equal(eng_seq_kv_export(b, 0, 20, kvb), FU_OK);
    assert_memory_equal(kva, kvb, pp * 20);
    eng_seq_free(f.e, b);
    run_from(&f, ids, n, kva, 16, lb);
    assert_memory_equal(la, lb, (size_t)V * sizeof *lb);
    run_from(&f, ids, n, kva, 20, lb);
    assert_true(max_abs_diff(la, lb, (size_t)V) < 1e-4f);
    free(kva);
    free(kvb);
    free(la);
    free(lb);
    eng_seq_free(f.e, a);
    fixture_close(&f);
}

static void test_kv_import_bit_identical_f32(void **state) { (void)state, check_kv_import_bit_identical(OP_TYPE_F32); }
static void test_kv_import_bit_identical_f16(void **state) { (void)state, check_kv_import_bit_identical(OP_TYPE_F16); }

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_batched_llama_f32),
        cmocka_unit_test(test_batched_qwen2_bf16),
        cmocka_unit_test(test_batched_qwen3_q8),
        cmocka_unit_test(test_batched_llama_q4_1),
        cmocka_unit_test(test_chunked_prefill_equals_single_pass),
        cmocka_unit_test(test_kv_import_bit_identical_f32),
        cmocka_unit_test(test_kv_import_bit_identical_f16),
        cmocka_unit_test(test_weights_prepared_for_the_backend),
        cmocka_unit_test(test_span_without_embeddings_takes_hidden_states),
        cmocka_unit_test(test_bad_input),
        cmocka_unit_test(test_hf_config_values_checked),
        cmocka_unit_test(test_gguf_config_values_checked),
        cmocka_unit_test(test_random_config_values_checked),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
