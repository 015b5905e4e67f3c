/* generate.c -- fusion-bench-generate: prefill and decode tokens/s of the engine, next to the
 * machine's measured memory bandwidth (decode as a fraction of its bandwidth bound; on the CPU
 * backend, whose bandwidth it can measure). */
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench-util.h"
#include "engine.h"
#include "model.h"
#include "ops.h"
#include "options.h"
#include "status.h"

/* Dimensions of well-known models, for random-weight runs (--random picks one by index). */
static const fu_opt_choice preset_names[] = {
    {"llama-3.2-1b", 0}, {"smollm2-135m", 1}, {"qwen3-0.6b", 2}, {NULL, 0}};
static const mdl_config presets[] = {
    {MDL_ARCH_LLAMA, 16, 2048, 8192, 32, 8, 64, 128256, 4096, 1e-5f, 500000.0f, MDL_ROPE_SCALING_NONE, 0, 0, 0, 0,
     OP_ROPE_NEOX, true, false, false},
    {MDL_ARCH_LLAMA, 30, 576, 1536, 9, 3, 64, 49152, 2048, 1e-5f, 100000.0f, MDL_ROPE_SCALING_NONE, 0, 0, 0, 0,
     OP_ROPE_NEOX, true, false, false},
    {MDL_ARCH_QWEN3, 28, 1024, 3072, 16, 8, 128, 151936, 4096, 1e-6f, 1000000.0f, MDL_ROPE_SCALING_NONE, 0, 0, 0,
     0, OP_ROPE_NEOX, true, false, true},
};

typedef struct bench_args {
    char *model;
    int preset;          /* index into presets; -1: --model */
    int dtype;           /* op_type of random weights */
    char *device;
    int threads, isa;
    int n_prompt, n_decode;
    int kv_type;         /* op_type */
    bool no_head;
    int span[2];         /* --blocks [first, last); last -1: all */
} bench_args;

static bench_args args = {.preset = -1, .dtype = OP_TYPE_F16, .span = {0, -1}};

/* --dtype: a weight type whose rows stand alone (f32, f16, bf16, q8_0, ...). */
static int parse_type(void *ctx, const char *s) {
    for (int i = 0; i < OP_TYPE_COUNT; i++)
        if (op_type_is_weight((op_type)i) && op_type_row_group((op_type)i) == 1 &&
            strcmp(s, op_type_name((op_type)i)) == 0) {
            *(int *)ctx = i;
            return FU_OK;
        }
    return fu_errorf(FU_ERR_INVALID, "no weight type '%s'", s);
}


static const fu_opt bench_options[] = {
    {"model", 'm', FU_OPT_STRING, FU_OPT_TO(args.model), "PATH", "a model file or directory"},
    {"random", 'r', FU_OPT_CHOICE, FU_OPT_TO(args.preset), .help = "random weights of these dimensions",
     .choices = preset_names},
    {"dtype", 'd', FU_OPT_CALL, .dest = &args.dtype, .fn = parse_type, .arg = "f32|f16|bf16|q8_0|q4_0|q4_1|i8",
     .help = "random weights' type (default f16)"},
    {"device", 'D', FU_OPT_STRING, FU_OPT_TO(args.device), "cpu|cuda|cuda:N",
     "the bandwidth bound is for the CPU only", .def = "cpu"},
    {"threads", 't', FU_OPT_INT, FU_OPT_TO(args.threads), .help = "(default: all CPUs)", .lo = 0, .hi = INT32_MAX},
    {"isa", 'i', FU_OPT_CHOICE, FU_OPT_TO(args.isa), .help = "CPU kernels", .def = "auto",
     .choices = op_cpu_isa_choices},
    {"prompt", 'p', FU_OPT_INT, FU_OPT_TO(args.n_prompt), .help = "prefill tokens", .def = "128", .lo = 1,
     .hi = INT32_MAX},
    {"decode", 'n', FU_OPT_INT, FU_OPT_TO(args.n_decode), .help = "decode steps", .def = "32", .lo = 2,
     .hi = INT32_MAX},
    {"kv", 'k', FU_OPT_CHOICE, FU_OPT_TO(args.kv_type), .def = "f32", .choices = op_kv_type_choices,
     .help = "KV cache type, as in fusion-generate and fusion-shard"},
    {"no-head", 'H', FU_OPT_FLAG, FU_OPT_TO(args.no_head), .help = "leave out the LM head (span-only figures)"},
    {"blocks", 'b', FU_OPT_SPAN, FU_OPT_TO(args.span),
     .help = "load only blocks [A, B) (embeddings if A = 0, head if B = all)"},
    FU_OPT_END,
};

static const fu_opt_spec bench_spec = {"fusion-bench-generate",
                                       "usage: fusion-bench-generate (--model PATH | --random PRESET) [options]",
                                       bench_options, NULL};

/* decode is also timed in rounds of BENCH_ROUND tokens, and BENCH_PAIRS more tokens follow
 * it, each right after a read of as many bytes as a token's weights: on a shared machine
 * whose bandwidth drifts, those pairs set each token against the bandwidth of its own moment */
enum { BENCH_ROUND = 8, BENCH_PAIRS = 24 };

/* One benchmark: what it holds (bench_run_free releases it) and what it measured. */
typedef struct bench_run {
    op_backend *be;
    char device[300];
    bool on_cpu;         /* the read bandwidth measured is host memory's: the bound is the CPU's */
    mdl_model *m;
    eng_engine *e;
    eng_seq *s;
    int n_prompt, max_len;
    int32_t *ids;        /* (max_len,) token ids, when the span holds the embeddings */
    eng_seq **seqs;      /* (max_len,) */
    float *out;          /* (max_len, vocab or dim) */
    float *hidden;       /* (max_len, dim) inputs of a span without embeddings; else NULL */
    double t_load, t_prefill, t_decode, best_round, peak_rss, bw;
    uint64_t wbytes;     /* weight bytes read per token */
    size_t pbytes;       /* bytes of each paired read */
    double pair[BENCH_PAIRS]; /* time to read a token's weight bytes / time per token */
    bool paired;
} bench_run;

/* Opens the model file, or draws random weights of the preset in the layout the engine would
 * repack them into (so that the model holds no second copy). */
static int bench_open_model(bench_run *r, const bench_args *a) {
    mdl_open_options mo = {a->span[0], a->span[1], a->span[0] == 0, !a->no_head};
    if (a->preset >= 0) {
        const mdl_config *p = &presets[a->preset];
        const int last = mo.last > p->n_layers ? p->n_layers : mo.last;
        mo.head = mo.head && (last < 0 || last == p->n_layers);
        return mdl_random(p, op_weight_layout(r->be, (op_type)a->dtype, OP_R16_ROWS), 1, &mo, &r->m);
    }
    int rc = mdl_open(a->model, &mo, &r->m);
    if (rc == FU_OK && mo.head && r->m->last != r->m->cfg.n_layers) { /* a span that ends early */
        mdl_free(r->m);
        mo.head = false;
        rc = mdl_open(a->model, &mo, &r->m);
    }
    return rc;
}

/* The backend, the model, the engine and the buffers; 2 (a usage error) or 1 on failure. */
static int bench_open(bench_run *r, const bench_args *a) {
    if (op_backend_open(a->device, a->threads, a->isa, &r->be, r->device, sizeof r->device)) return 1;
    r->on_cpu = !strcmp(op_backend_name(r->be), "cpu");
    r->t_load = fu_now_s();
    if (bench_open_model(r, a)) return 1;
    const mdl_config *cfg = &r->m->cfg;
    r->max_len = a->n_prompt + a->n_decode + BENCH_PAIRS;
    if (r->max_len > cfg->max_seq_len) r->max_len = cfg->max_seq_len;
    r->n_prompt = a->n_prompt;
    if (r->n_prompt + a->n_decode + BENCH_PAIRS > r->max_len) r->n_prompt = r->max_len - a->n_decode - BENCH_PAIRS;
    if (r->n_prompt < 1) {
        fu_errorf(FU_ERR_INVALID, "--decode %d leaves no room for a prompt in %d positions", a->n_decode,
                  cfg->max_seq_len);
        return 2;
    }
    eng_options eo = {r->n_prompt < 512 ? r->n_prompt : 512, a->kv_type};
    r->ids = malloc((size_t)r->max_len * sizeof *r->ids);
    r->seqs = malloc((size_t)r->max_len * sizeof *r->seqs);
    r->out = malloc((size_t)(r->m->has_head ? cfg->vocab_size : cfg->dim) * (size_t)r->max_len * sizeof(float));
    r->hidden = r->m->has_embed ? NULL : malloc((size_t)cfg->dim * (size_t)r->max_len * sizeof(float));
    if (!r->ids || !r->seqs || !r->out || (!r->m->has_embed && !r->hidden)) {
        fu_errorf(FU_ERR_NOMEM, "out of memory");
        return 1;
    }
    if (eng_new(r->m, r->be, &eo, &r->e) || eng_seq_new(r->e, r->max_len, &r->s)) return 1;
    r->t_load = fu_now_s() - r->t_load; /* the engine's repacking included */
    for (int i = 0; i < r->max_len; i++) {
        r->ids[i] = (int32_t)((i * 7919 + 13) % cfg->vocab_size);
        r->seqs[i] = r->s;
    }
    for (size_t i = 0; r->hidden && i < (size_t)cfg->dim * (size_t)r->max_len; i++)
        r->hidden[i] = (float)((i * 2654435761u) % 2001) / 1000.0f - 1.0f;
    return 0;
}

/* The forward of positions [at, at + n) (want: NULL or which logits to compute). */
static int bench_forward(bench_run *r, int at, int n, const uint8_t *want) {
    eng_batch b = {n, r->m->has_embed ? r->ids + at : NULL,
                   r->hidden ? r->hidden + (size_t)at * r->m->cfg.dim : NULL, r->seqs, want};
    return eng_forward(r->e, &b, r->out);
}

/* Warm-up, prefill, and decode timed whole and in rounds (the best round is the figure
 * comparable with the best of several bandwidth reads). */
static int bench_time(bench_run *r, int n_decode) {
    int rc = bench_forward(r, 0, 1, NULL); /* touches the weights once */
    if (rc || (rc = eng_seq_truncate(r->s, 0))) return rc;
    uint8_t *want = calloc((size_t)r->n_prompt, 1);
    if (!want) return fu_errorf(FU_ERR_NOMEM, "out of memory");
    want[r->n_prompt - 1] = 1;
    double t0 = fu_now_s();
    rc = bench_forward(r, 0, r->n_prompt, want);
    r->t_prefill = fu_now_s() - t0;
    free(want);
    double t_round = fu_now_s();
    t0 = t_round;
    for (int i = 0; !rc && i < n_decode; i++) {
        rc = bench_forward(r, r->n_prompt + i, 1, NULL);
        if ((i + 1) % BENCH_ROUND == 0) {
            double now = fu_now_s(), tps = BENCH_ROUND / (now - t_round);
            if (tps > r->best_round) r->best_round = tps;
            t_round = now;
        }
    }
    r->t_decode = fu_now_s() - t0;
    return rc;
}

/* The pairs (CPU only): each token right after a read of as many bytes as its weights. */
static int bench_pairs(bench_run *r, int n_decode) {
    r->pbytes = ((size_t)r->wbytes + 63) / 64 * 64;
    uint8_t *pbuf = r->on_cpu ? bench_read_buffer(r->pbytes) : NULL;
    r->paired = pbuf != NULL;
    int rc = FU_OK;
    for (int i = 0; r->paired && !rc && i < BENCH_PAIRS; i++) {
        const double gbs = bench_read_once(pbuf, r->pbytes, op_backend_n_threads(r->be));
        const double t = fu_now_s();
        rc = bench_forward(r, r->n_prompt + n_decode + i, 1, NULL);
        r->pair[i] = (double)r->pbytes / (gbs * 1e9) / (fu_now_s() - t);
    }
    free(pbuf);
    return rc;
}

/* Matmul flops per token: 2 x the blocks' weight elements (the head only for the last token). */
static double bench_block_params(const mdl_model *m) {
    double params = 0;
    for (int l = 0; l < m->last - m->first; l++) {
        const mdl_layer *L = &m->layers[l];
        const op_tensor *ws[] = {&L->wq, &L->wk, &L->wv, &L->wo, &L->w_gate, &L->w_up, &L->w_down};
        for (size_t i = 0; i < sizeof ws / sizeof ws[0]; i++) params += (double)op_tensor_nelems(ws[i]);
    }
    return params;
}

/* The figures against the bandwidth bound (CPU) or as the bandwidth the decode rate implies. */
static void bench_print_bound(const bench_run *r, double decode_tps) {
    double bound_tps = r->bw * 1e9 / (double)r->wbytes;
    if (r->on_cpu) {
        printf("bound        %.1f MB of weights per token -> %.2f tokens/s at the measured bandwidth\n",
               (double)r->wbytes / 1e6, bound_tps);
        printf("ratio        decode / bandwidth bound = %.3f over all tokens", decode_tps / bound_tps);
        if (r->best_round > 0)
            printf(", %.3f for the best round (best read vs best round)", r->best_round / bound_tps);
        printf("\n");
    } else {
        printf("weights      %.1f MB read per token: %.1f GB/s at the decode rate\n", (double)r->wbytes / 1e6,
               (double)r->wbytes * decode_tps / 1e9);
    }
    if (r->paired) {
        double pair[BENCH_PAIRS];
        memcpy(pair, r->pair, sizeof pair);
        qsort(pair, BENCH_PAIRS, sizeof pair[0], bench_cmp_double);
        printf("paired       %d tokens, each right after a read of %.1f MB: decode / bound = %.3f median, "
               "%.3f - %.3f middle half, %.3f - %.3f all\n",
               BENCH_PAIRS, (double)r->pbytes / 1e6, (pair[(BENCH_PAIRS - 1) / 2] + pair[BENCH_PAIRS / 2]) / 2,
               pair[BENCH_PAIRS / 4], pair[BENCH_PAIRS - 1 - BENCH_PAIRS / 4], pair[0], pair[BENCH_PAIRS - 1]);
    } else if (r->on_cpu) {
        printf("paired       no memory for a %.1f MB read buffer\n", (double)r->pbytes / 1e6);
    }
}

static void bench_print(const bench_run *r, const bench_args *a) {
    const mdl_model *m = r->m;
    const mdl_config *cfg = &m->cfg;
    const op_type wtype = a->model ? m->layers[0].wq.type : (op_type)a->dtype;
    double prefill_tps = r->n_prompt / r->t_prefill, decode_tps = a->n_decode / r->t_decode;
    printf("model        %s (%s, blocks [%d, %d) of %d, hidden %d, ffn %d, heads %d/%d, vocab %d), weights %s\n",
           a->model ? a->model : preset_names[a->preset].name, mdl_arch_name(cfg->arch), m->first, m->last,
           cfg->n_layers, cfg->dim, cfg->ffn_dim, cfg->n_heads, cfg->n_kv_heads, cfg->vocab_size,
           op_type_name(wtype));
    printf("backend      %s, %s weights run as %s; load %.2f s\n", r->device, op_type_name(wtype),
           op_type_name(op_weight_layout(r->be, wtype, m->layers[0].wq.ne[1])), r->t_load);
    if (r->on_cpu) printf("bandwidth    %.2f GB/s measured (read, %d threads)\n", r->bw, op_backend_n_threads(r->be));
    printf("prefill      %d tokens in %.3f s: %.1f tokens/s, %.1f GFLOP/s in block matmuls\n", r->n_prompt,
           r->t_prefill, prefill_tps, 2.0 * bench_block_params(m) * r->n_prompt / r->t_prefill / 1e9);
    printf("decode       %d tokens in %.3f s: %.2f tokens/s (%.2f ms/token)", a->n_decode, r->t_decode, decode_tps,
           1e3 / decode_tps);
    if (r->best_round > 0) printf("; best round of %d: %.2f tokens/s", BENCH_ROUND, r->best_round);
    printf("\n");
    bench_print_bound(r, decode_tps);
    printf("memory       peak RSS %.0f MiB (weights %.0f MiB, KV cache %.1f MiB %s)\n", r->peak_rss,
           (double)r->wbytes / 1048576.0, (double)eng_kv_bytes_per_pos(r->e) * r->max_len / 1048576.0,
           op_type_name((op_type)a->kv_type));
}

static void bench_run_free(bench_run *r) {
    eng_seq_free(r->e, r->s);
    eng_free(r->e);
    op_backend_free(r->be);
    mdl_free(r->m);
    free(r->ids);
    free(r->seqs);
    free(r->out);
    free(r->hidden);
}

/* Runs the benchmark `a` asks for; the exit status. */
static int bench(const bench_args *a) {
    bench_run r = {0};
    int status = bench_open(&r, a);
    if (!status && bench_time(&r, a->n_decode)) status = 1;
    if (!status) {
        r.peak_rss = bench_peak_rss_mib(); /* before the bandwidth buffers */
        r.wbytes = mdl_weight_bytes_per_token(r.m);
        status = bench_pairs(&r, a->n_decode) ? 1 : 0;
    }
    if (!status) {
        r.bw = r.on_cpu ? bench_read_bandwidth(op_backend_n_threads(r.be), (size_t)1 << 30, 5) : 0;
        bench_print(&r, a);
    }
    if (status) fprintf(stderr, "fusion-bench-generate: %s\n", fu_last_error());
    bench_run_free(&r);
    return status;
}

int main(int argc, char **argv) {
    int status = fu_opt_main(&bench_spec, argc, argv, NULL);
    if (status < 0 && !args.model == (args.preset < 0))
        status = fu_opt_fail(&bench_spec, "give --model or --random");
    if (status < 0) status = bench(&args);
    fu_opt_free(bench_options);
    return status;
}
