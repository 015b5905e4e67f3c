/* generate.c -- fusion-bench-generate: prefill and decode tokens/s of the engine, next to the
 * machine's measured memory bandwidth (decode as a fraction of its bandwidth bound; on the CPU
 * backend, whose bandwidth it can measure). */
#include <errno.h>
#include <getopt.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench-util.h"
#include "engine.h"
#include "model.h"
#include "ops.h"
#include "parse.h"
#include "status.h"

typedef struct preset {
    const char *name;
    mdl_config cfg;
} preset;

/* Dimensions of well-known models, for random-weight runs. */
static const preset presets[] = {
    {"llama-3.2-1b", {MDL_ARCH_LLAMA, 16, 2048, 8192, 32, 8, 64, 128256, 4096, 1e-5f, 500000.0f,
                      MDL_ROPE_SCALING_NONE, 0, 0, 0, 0, OP_ROPE_NEOX, true, false, false}},
    {"smollm2-135m", {MDL_ARCH_LLAMA, 30, 576, 1536, 9, 3, 64, 49152, 2048, 1e-5f, 100000.0f,
                      MDL_ROPE_SCALING_NONE, 0, 0, 0, 0, OP_ROPE_NEOX, true, false, false}},
    {"qwen3-0.6b", {MDL_ARCH_QWEN3, 28, 1024, 3072, 16, 8, 128, 151936, 4096, 1e-6f, 1000000.0f,
                    MDL_ROPE_SCALING_NONE, 0, 0, 0, 0, OP_ROPE_NEOX, true, false, true}},
};

static int parse_type(const char *s, op_type *t) {
    for (int i = 0; i < OP_TYPE_COUNT; i++)
        if (op_type_is_weight((op_type)i) && op_type_row_group((op_type)i) == 1 &&
            strcmp(s, op_type_name((op_type)i)) == 0) {
            *t = (op_type)i;
            return 0;
        }
    return -1;
}

static void usage(FILE *f) {
    fprintf(f, "usage: fusion-bench-generate (--model PATH | --random PRESET) [options]\n"
               "  --dtype f32|f16|bf16|q8_0|q4_0|q4_1|i8   random weights' type (default f16)\n"
               "  --device cpu|cuda|cuda:N   (default cpu; the bandwidth bound is for the CPU only)\n"
               "  --threads N   (default: all CPUs)     --isa auto|portable|avx2|avx512\n"
               "  --prompt N    prefill tokens (default 128)\n"
               "  --decode N    decode steps (default 32)\n"
               "  --kv f32|f16  KV cache type (default f32, as in fusion-generate and fusion-shard)\n"
               "  --no-head     leave out the LM head (span-only figures)\n"
               "  --blocks A:B  load only blocks [A, B) (embeddings if A = 0, head if B = all)\n"
               "presets:");
    for (size_t i = 0; i < sizeof presets / sizeof presets[0]; i++) fprintf(f, " %s", presets[i].name);
    fprintf(f, "\n");
}

int main(int argc, char **argv) {
    const char *model_path = NULL, *random_name = NULL;
    op_type dtype = OP_TYPE_F16, kv_type = OP_TYPE_F32;
    int threads = 0, n_prompt = 128, n_decode = 32, no_head = 0, first = 0, last = -1;
    op_cpu_isa isa = OP_CPU_ISA_AUTO;
    const char *device = "cpu";
    static const struct option opts[] = {
        {"model", required_argument, 0, 'm'}, {"random", required_argument, 0, 'r'},
        {"dtype", required_argument, 0, 'd'}, {"threads", required_argument, 0, 't'},
        {"prompt", required_argument, 0, 'p'}, {"decode", required_argument, 0, 'n'},
        {"isa", required_argument, 0, 'i'},   {"no-head", no_argument, 0, 'H'},
        {"blocks", required_argument, 0, 'b'}, {"kv", required_argument, 0, 'k'},
        {"device", required_argument, 0, 'D'}, {"help", no_argument, 0, 'h'},
        {0, 0, 0, 0}};
    int c;
    while ((c = getopt_long(argc, argv, "m:r:d:t:p:n:i:b:k:HhD:", opts, NULL)) != -1) {
        char *end = NULL;
        switch (c) {
        case 'm': model_path = optarg; break;
        case 'r': random_name = optarg; break;
        case 'd':
            if (parse_type(optarg, &dtype)) goto bad;
            break;
        case 't': threads = (int)strtol(optarg, &end, 10); if (*end || threads < 0) goto bad; break;
        case 'p': n_prompt = (int)strtol(optarg, &end, 10); if (*end || n_prompt < 1) goto bad; break;
        case 'n': n_decode = (int)strtol(optarg, &end, 10); if (*end || n_decode < 2) goto bad; break;
        case 'i':
            if (!strcmp(optarg, "auto")) isa = OP_CPU_ISA_AUTO;
            else if (!strcmp(optarg, "portable")) isa = OP_CPU_ISA_PORTABLE;
            else if (!strcmp(optarg, "avx2")) isa = OP_CPU_ISA_AVX2;
            else if (!strcmp(optarg, "avx512")) isa = OP_CPU_ISA_AVX512;
            else goto bad;
            break;
        case 'k':
            if (!strcmp(optarg, "f32")) kv_type = OP_TYPE_F32;
            else if (!strcmp(optarg, "f16")) kv_type = OP_TYPE_F16;
            else goto bad;
            break;
        case 'H': no_head = 1; break;
        case 'D': device = optarg; break;
        case 'b':
            if (sscanf(optarg, "%d:%d", &first, &last) != 2 || first < 0 || last <= first) goto bad;
            break;
        case 'h': usage(stdout); return 0;
        default:
        bad:
            usage(stderr);
            return 2;
        }
    }
    if (!model_path == !random_name) {
        usage(stderr);
        return 2;
    }
    mdl_open_options mo = {first, last, first == 0, !no_head};
    mdl_model *m = NULL;
    int rc;
    op_backend *be = NULL;
    char device_desc[300];
    if (op_backend_open(device, threads, isa, &be, device_desc, sizeof device_desc)) {
        fprintf(stderr, "fusion-bench-generate: %s\n", fu_last_error());
        return 1;
    }
    /* the read bandwidth measured is host memory's: the bound applies to the CPU backend */
    const bool on_cpu = !strcmp(op_backend_name(be), "cpu");
    /* the layout the engine runs matrices of whole row groups in */
    const op_type run_type = op_weight_layout(be, dtype, OP_R16_ROWS);
    double t_load = fu_now_s();
    if (model_path) {
        rc = mdl_open(model_path, &mo, &m);
        if (rc == FU_OK && mo.head && m->last != m->cfg.n_layers) { /* a span that ends early */
            mdl_free(m);
            mo.head = false;
            rc = mdl_open(model_path, &mo, &m);
        }
    } else {
        const preset *p = NULL;
        for (size_t i = 0; i < sizeof presets / sizeof presets[0]; i++)
            if (!strcmp(presets[i].name, random_name)) p = &presets[i];
        if (!p) {
            usage(stderr);
            return 2;
        }
        if (last > p->cfg.n_layers) last = p->cfg.n_layers;
        mo.head = mo.head && (last < 0 || last == p->cfg.n_layers);
        /* drawn in the layout the engine would repack them into, so that
         * the model does not hold a second copy of the weights */
        rc = mdl_random(&p->cfg, run_type, 1, &mo, &m);
    }
    if (rc) {
        fprintf(stderr, "fusion-bench-generate: %s\n", fu_last_error());
        op_backend_free(be);
        return 1;
    }
    const mdl_config *cfg = &m->cfg;
    /* decode is also timed in rounds of BENCH_ROUND tokens, and BENCH_PAIRS
     * more tokens follow it, each right after a read of as many bytes as a
     * token's weights: on a shared machine whose bandwidth drifts, those pairs
     * set each token against the bandwidth of its own moment */
    enum { BENCH_ROUND = 8, BENCH_PAIRS = 24 };
    int max_len = n_prompt + n_decode + BENCH_PAIRS;
    if (max_len > cfg->max_seq_len) max_len = cfg->max_seq_len;
    if (n_prompt + n_decode + BENCH_PAIRS > max_len) n_prompt = max_len - n_decode - BENCH_PAIRS;
    if (n_prompt < 1) {
        fprintf(stderr, "fusion-bench-generate: --decode %d leaves no room for a prompt in %d positions\n",
                n_decode, cfg->max_seq_len);
        return 2;
    }
    eng_options eo = {n_prompt < 512 ? n_prompt : 512, kv_type};
    eng_engine *e = NULL;
    eng_seq *s = NULL;
    int32_t *ids = malloc((size_t)max_len * sizeof *ids);
    eng_seq **seqs = malloc((size_t)max_len * sizeof *seqs);
    float *out = malloc((size_t)(m->has_head ? cfg->vocab_size : cfg->dim) * (size_t)max_len * sizeof(float));
    float *hidden = m->has_embed ? NULL : malloc((size_t)cfg->dim * (size_t)max_len * sizeof(float));
    if (!ids || !seqs || !out || (!m->has_embed && !hidden) || (rc = eng_new(m, be, &eo, &e)) || (rc = eng_seq_new(e, max_len, &s))) {
        fprintf(stderr, "fusion-bench-generate: %s\n", rc ? fu_last_error() : "out of memory");
        return 1;
    }
    t_load = fu_now_s() - t_load; /* the engine's repacking included */
    for (int i = 0; i < max_len; i++) {
        ids[i] = (int32_t)((i * 7919 + 13) % cfg->vocab_size);
        seqs[i] = s;
    }
    for (size_t i = 0; hidden && i < (size_t)cfg->dim * (size_t)max_len; i++)
        hidden[i] = (float)((i * 2654435761u) % 2001) / 1000.0f - 1.0f;
    const int32_t *tok_in = m->has_embed ? ids : NULL;
#define BENCH_EMBD_(i) (hidden ? hidden + (size_t)(i) * cfg->dim : NULL)
    /* warm-up: touch the weights once */
    eng_batch wb = {1, tok_in, BENCH_EMBD_(0), seqs, NULL};
    if ((rc = eng_forward(e, &wb, out)) || (rc = eng_seq_truncate(s, 0))) goto fail;

    uint8_t *want = calloc((size_t)n_prompt, 1);
    if (!want) goto fail;
    want[n_prompt - 1] = 1;
    double t0 = fu_now_s();
    eng_batch pb = {n_prompt, tok_in, BENCH_EMBD_(0), seqs, want};
    rc = eng_forward(e, &pb, out);
    double t_prefill = fu_now_s() - t0;
    free(want);
    if (rc) goto fail;
    /* decode; the best round is the figure comparable with the best of
     * several bandwidth reads */
    double best_round = 0, t_round = fu_now_s();
    t0 = t_round;
    for (int i = 0; i < n_decode; i++) {
        eng_batch db = {1, tok_in ? tok_in + n_prompt + i : NULL, BENCH_EMBD_(n_prompt + i), seqs, NULL};
        if ((rc = eng_forward(e, &db, out))) goto fail;
        if ((i + 1) % BENCH_ROUND == 0) {
            double now = fu_now_s(), tps = BENCH_ROUND / (now - t_round);
            if (tps > best_round) best_round = tps;
            t_round = now;
        }
    }
    double t_decode = fu_now_s() - t0;

    double peak_rss = bench_peak_rss_mib(); /* before the bandwidth buffers */
    uint64_t wbytes = mdl_weight_bytes_per_token(m);
    /* the pairs: ratio = time to read a token's weight bytes / time per token */
    double pair[BENCH_PAIRS];
    const size_t pbytes = ((size_t)wbytes + 63) / 64 * 64;
    uint8_t *pbuf = on_cpu ? bench_read_buffer(pbytes) : NULL;
    const bool paired = pbuf != NULL;
    for (int r = 0; paired && r < BENCH_PAIRS; r++) {
        const double gbs = bench_read_once(pbuf, pbytes, op_backend_n_threads(be));
        const double t = fu_now_s();
        const int at = n_prompt + n_decode + r;
        eng_batch db = {1, tok_in ? tok_in + at : NULL, BENCH_EMBD_(at), seqs, NULL};
        if ((rc = eng_forward(e, &db, out))) {
            free(pbuf);
            goto fail;
        }
        pair[r] = (double)pbytes / (gbs * 1e9) / (fu_now_s() - t);
    }
    free(pbuf);
    double bw = on_cpu ? bench_read_bandwidth(op_backend_n_threads(be), (size_t)1 << 30, 5) : 0;
    double prefill_tps = n_prompt / t_prefill, decode_tps = n_decode / t_decode;
    double bound_tps = bw * 1e9 / (double)wbytes;
    /* matmul flops per token: 2 x weights' elements (the head only for the last token) */
    double params = 0;
    for (int l = 0; l < m->last - m->first; l++) {
        const mdl_layer *L = &m->layers[l];
        const op_tensor *ws[] = {&L->wq, &L->wk, &L->wv, &L->wo, &L->w_gate, &L->w_up, &L->w_down};
        for (size_t i = 0; i < sizeof ws / sizeof ws[0]; i++) params += (double)op_tensor_nelems(ws[i]);
    }
    printf("model        %s (%s, blocks [%d, %d) of %d, hidden %d, ffn %d, heads %d/%d, vocab %d), weights %s\n",
           model_path ? model_path : random_name, mdl_arch_name(cfg->arch), m->first, m->last,
           cfg->n_layers, cfg->dim,
           cfg->ffn_dim, cfg->n_heads, cfg->n_kv_heads, cfg->vocab_size,
           model_path ? op_type_name(m->layers[0].wq.type) : op_type_name(dtype));
    const op_type wtype = model_path ? m->layers[0].wq.type : dtype;
    printf("backend      %s, %s weights run as %s; load %.2f s\n", device_desc, op_type_name(wtype),
           op_type_name(op_weight_layout(be, wtype, m->layers[0].wq.ne[1])), t_load);
    if (on_cpu) printf("bandwidth    %.2f GB/s measured (read, %d threads)\n", bw, op_backend_n_threads(be));
    printf("prefill      %d tokens in %.3f s: %.1f tokens/s, %.1f GFLOP/s in block matmuls\n", n_prompt,
           t_prefill, prefill_tps, 2.0 * params * n_prompt / t_prefill / 1e9);
    printf("decode       %d tokens in %.3f s: %.2f tokens/s (%.2f ms/token)", n_decode, t_decode,
           decode_tps, 1e3 / decode_tps);
    if (best_round > 0) printf("; best round of %d: %.2f tokens/s", BENCH_ROUND, best_round);
    printf("\n");
    if (on_cpu) {
        printf("bound        %.1f MB of weights per token -> %.2f tokens/s at the measured bandwidth\n",
               (double)wbytes / 1e6, bound_tps);
        printf("ratio        decode / bandwidth bound = %.3f over all tokens", decode_tps / bound_tps);
        if (best_round > 0) printf(", %.3f for the best round (best read vs best round)", best_round / bound_tps);
        printf("\n");
    } else {
        printf("weights      %.1f MB read per token: %.1f GB/s at the decode rate\n", (double)wbytes / 1e6,
               (double)wbytes * decode_tps / 1e9);
    }
    if (paired) {
        qsort(pair, BENCH_PAIRS, sizeof pair[0], bench_cmp_double);
        printf("paired       %d tokens, each right after a read of %.1f MB: decode / bound = %.3f median, "
               "%.3f - %.3f middle half, %.3f - %.3f all\n",
               BENCH_PAIRS, (double)pbytes / 1e6, (pair[(BENCH_PAIRS - 1) / 2] + pair[BENCH_PAIRS / 2]) / 2,
               pair[BENCH_PAIRS / 4], pair[BENCH_PAIRS - 1 - BENCH_PAIRS / 4], pair[0], pair[BENCH_PAIRS - 1]);
    } else if (on_cpu) {
        printf("paired       no memory for a %.1f MB read buffer\n", (double)pbytes / 1e6);
    }
    printf("memory       peak RSS %.0f MiB (weights %.0f MiB, KV cache %.1f MiB %s)\n", peak_rss,
           (double)wbytes / 1048576.0, (double)eng_kv_bytes_per_pos(e) * max_len / 1048576.0,
           op_type_name(kv_type));
fail:
    if (rc) fprintf(stderr, "fusion-bench-generate: %s\n", fu_last_error());
    eng_seq_free(e, s);
    eng_free(e);
    op_backend_free(be);
    mdl_free(m);
    free(ids);
    free(seqs);
    free(out);
    free(hidden);
    return rc ? 1 : 0;
}
