/* generate.c -- fusion-generate: one process, all blocks, generates from a prompt (text, chat or token ids). */
#include <errno.h>
#include <getopt.h>
#include <inttypes.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "engine.h"
#include "log.h"
#include "model.h"
#include "ops.h"
#include "sampler.h"
#include "status.h"

typedef struct gen_args {
    const char *model;
    const char *prompt_ids;
    const char *logits_out;
    int max_tokens;
    int threads;
    int batch;
    op_cpu_isa isa;
    op_type kv_type;
    int recompute;
    int json;
    smp_params sp;
} gen_args;

static void usage(FILE *f) {
    fprintf(f,
            "usage: fusion-generate --model PATH (--prompt-ids 1,2,3) [options]\n"
            "  --max-tokens N        tokens to generate (default 32)\n"
            "  --temperature T       0 = greedy (default 0)\n"
            "  --top-k K --top-p P --min-p P --seed S\n"
            "  --threads N           CPU threads (default: all)\n"
            "  --isa auto|portable|avx2|avx512\n"
            "  --kv f32|f16          KV cache type (default f32)\n"
            "  --batch N             tokens per forward chunk (default 256)\n"
            "  --recompute           recompute the whole sequence each step (no KV reuse)\n"
            "  --logits-out FILE     write f32 logits of every position (prompt and generated)\n"
            "  --json                print the result as JSON\n");
}

static int parse_int(const char *s, long lo, long hi, long *out) {
    char *end;
    errno = 0;
    long v = strtol(s, &end, 10);
    if (errno || end == s || *end || v < lo || v > hi) return -1;
    *out = v;
    return 0;
}

static int parse_float(const char *s, float *out) {
    char *end;
    errno = 0;
    float v = strtof(s, &end);
    if (errno || end == s || *end) return -1;
    *out = v;
    return 0;
}

/* Parses "1,2,3" into a malloc'd array. */
static int parse_ids(const char *s, int32_t **ids, int *n) {
    int cap = 16, count = 0;
    int32_t *v = malloc((size_t)cap * sizeof *v);
    if (!v) return -1;
    while (*s) {
        char *end;
        errno = 0;
        long x = strtol(s, &end, 10);
        if (errno || end == s || x < 0 || x > INT32_MAX) {
            free(v);
            return -1;
        }
        if (count == cap) {
            cap *= 2;
            int32_t *nv = realloc(v, (size_t)cap * sizeof *v);
            if (!nv) {
                free(v);
                return -1;
            }
            v = nv;
        }
        v[count++] = (int32_t)x;
        s = end;
        if (*s == ',') s++;
        else if (*s) {
            free(v);
            return -1;
        }
    }
    *ids = v;
    *n = count;
    return 0;
}

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

int main(int argc, char **argv) {
    gen_args a = {.max_tokens = 32, .isa = OP_CPU_ISA_AUTO, .kv_type = OP_TYPE_F32};
    a.sp = smp_params_default();
    a.sp.temperature = 0;
    static const struct option opts[] = {
        {"model", required_argument, 0, 'm'},       {"prompt-ids", required_argument, 0, 'i'},
        {"max-tokens", required_argument, 0, 'n'},  {"temperature", required_argument, 0, 't'},
        {"top-k", required_argument, 0, 'k'},       {"top-p", required_argument, 0, 'p'},
        {"min-p", required_argument, 0, 'M'},       {"seed", required_argument, 0, 's'},
        {"threads", required_argument, 0, 'T'},     {"isa", required_argument, 0, 'I'},
        {"kv", required_argument, 0, 'K'},          {"batch", required_argument, 0, 'b'},
        {"recompute", no_argument, 0, 'r'},         {"logits-out", required_argument, 0, 'L'},
        {"json", no_argument, 0, 'j'},              {"help", no_argument, 0, 'h'},
        {0, 0, 0, 0}};
    int c;
    long v;
    while ((c = getopt_long(argc, argv, "m:i:n:t:k:p:M:s:T:I:K:b:rL:jh", opts, NULL)) != -1) {
        switch (c) {
        case 'm': a.model = optarg; break;
        case 'i': a.prompt_ids = optarg; break;
        case 'n':
            if (parse_int(optarg, 0, 1 << 20, &v)) goto bad;
            a.max_tokens = (int)v;
            break;
        case 't': if (parse_float(optarg, &a.sp.temperature)) goto bad; break;
        case 'k':
            if (parse_int(optarg, 0, INT32_MAX, &v)) goto bad;
            a.sp.top_k = (int)v;
            break;
        case 'p': if (parse_float(optarg, &a.sp.top_p)) goto bad; break;
        case 'M': if (parse_float(optarg, &a.sp.min_p)) goto bad; break;
        case 's':
            if (parse_int(optarg, 0, LONG_MAX, &v)) goto bad;
            a.sp.seed = (uint64_t)v;
            break;
        case 'T':
            if (parse_int(optarg, 0, 1024, &v)) goto bad;
            a.threads = (int)v;
            break;
        case 'I':
            if (!strcmp(optarg, "auto")) a.isa = OP_CPU_ISA_AUTO;
            else if (!strcmp(optarg, "portable")) a.isa = OP_CPU_ISA_PORTABLE;
            else if (!strcmp(optarg, "avx2")) a.isa = OP_CPU_ISA_AVX2;
            else if (!strcmp(optarg, "avx512")) a.isa = OP_CPU_ISA_AVX512;
            else goto bad;
            break;
        case 'K':
            if (!strcmp(optarg, "f32")) a.kv_type = OP_TYPE_F32;
            else if (!strcmp(optarg, "f16")) a.kv_type = OP_TYPE_F16;
            else goto bad;
            break;
        case 'b':
            if (parse_int(optarg, 1, 1 << 16, &v)) goto bad;
            a.batch = (int)v;
            break;
        case 'r': a.recompute = 1; break;
        case 'L': a.logits_out = optarg; break;
        case 'j': a.json = 1; break;
        case 'h': usage(stdout); return 0;
        default:
        bad:
            fprintf(stderr, "fusion-generate: bad option or value near '%s'\n", optarg ? optarg : argv[optind - 1]);
            usage(stderr);
            return 2;
        }
    }
    if (!a.model || !a.prompt_ids) {
        usage(stderr);
        return 2;
    }

    int32_t *prompt = NULL;
    int n_prompt = 0;
    if (parse_ids(a.prompt_ids, &prompt, &n_prompt) || n_prompt == 0) {
        fprintf(stderr, "fusion-generate: --prompt-ids must be a comma-separated list of token ids\n");
        return 2;
    }

    int rc, status = 1;
    mdl_model *m = NULL;
    op_backend *be = NULL;
    eng_engine *e = NULL;
    eng_seq *seq = NULL;
    smp_sampler *smp = NULL;
    float *logits = NULL;
    FILE *lf = NULL;
    int32_t *tokens = NULL;

    mdl_open_options mo = mdl_open_options_all();
    if ((rc = mdl_open(a.model, &mo, &m))) goto fail;
    op_cpu_options co = {a.threads, a.isa};
    if (!(be = op_backend_cpu_new(&co))) {
        rc = FU_ERR_INTERNAL;
        goto fail;
    }
    eng_options eo = {a.batch, a.kv_type};
    if ((rc = eng_new(m, be, &eo, &e))) goto fail;
    const int V = m->cfg.vocab_size;
    int total = n_prompt + a.max_tokens;
    if (total > m->cfg.max_seq_len) {
        rc = fu_errorf(FU_ERR_RANGE, "prompt (%d) + max tokens (%d) exceed the context (%d)", n_prompt,
                       a.max_tokens, m->cfg.max_seq_len);
        goto fail;
    }
    if ((rc = smp_new(&a.sp, V, &smp))) goto fail;
    logits = malloc((size_t)total * (size_t)V * sizeof *logits);
    tokens = malloc((size_t)total * sizeof *tokens);
    eng_seq **seqs = malloc((size_t)total * sizeof *seqs);
    if (!logits || !tokens || !seqs) {
        free(seqs);
        rc = fu_errorf(FU_ERR_NOMEM, "buffers");
        goto fail;
    }
    memcpy(tokens, prompt, (size_t)n_prompt * sizeof *tokens);
    if (a.logits_out && !(lf = fopen(a.logits_out, "wb"))) {
        free(seqs);
        rc = fu_errorf(FU_ERR_IO, "%s: %s", a.logits_out, strerror(errno));
        goto fail;
    }
    if ((rc = eng_seq_new(e, total, &seq))) {
        free(seqs);
        goto fail;
    }
    for (int i = 0; i < total; i++) seqs[i] = seq;

    double t0 = now_s();
    eng_batch b = {n_prompt, tokens, NULL, seqs, NULL};
    if ((rc = eng_forward(e, &b, logits))) {
        free(seqs);
        goto fail;
    }
    double t_prefill = now_s() - t0;
    if (lf) fwrite(logits, sizeof(float), (size_t)n_prompt * V, lf);
    const float *last = logits + (size_t)(n_prompt - 1) * V;
    int n = n_prompt;
    double t1 = now_s();
    for (int step = 0; step < a.max_tokens; step++) {
        float *row = logits + (size_t)n * V; /* scratch row for the sampler */
        memcpy(row, last, (size_t)V * sizeof(float));
        int32_t tok = smp_sample(smp, row);
        smp_accept(smp, tok);
        tokens[n++] = tok;
        if (step + 1 == a.max_tokens) break;
        float *out = logits + (size_t)(n - 1) * V;
        if (a.recompute) {
            /* recompute the whole sequence from scratch: no cache reuse */
            if ((rc = eng_seq_truncate(seq, 0))) break;
            uint8_t *want = calloc((size_t)n, 1);
            if (!want) {
                rc = fu_errorf(FU_ERR_NOMEM, "want");
                break;
            }
            want[n - 1] = 1;
            eng_batch rb = {n, tokens, NULL, seqs, want};
            rc = eng_forward(e, &rb, out);
            free(want);
        } else {
            eng_batch db = {1, tokens + n - 1, NULL, seqs, NULL};
            rc = eng_forward(e, &db, out);
        }
        if (rc) break;
        if (lf) fwrite(out, sizeof(float), (size_t)V, lf);
        last = out;
    }
    double t_decode = now_s() - t1;
    free(seqs);
    if (rc) goto fail;

    int n_gen = n - n_prompt;
    if (a.json) {
        printf("{\"prompt_tokens\": %d, \"tokens\": [", n_prompt);
        for (int i = n_prompt; i < n; i++) printf("%s%d", i > n_prompt ? ", " : "", tokens[i]);
        printf("], \"prefill_s\": %.6f, \"decode_s\": %.6f}\n", t_prefill, t_decode);
    } else {
        for (int i = n_prompt; i < n; i++) printf("%s%d", i > n_prompt ? "," : "", tokens[i]);
        printf("\n");
        fprintf(stderr, "prefill %d tokens %.1f tok/s, decode %d tokens %.1f tok/s\n", n_prompt,
                n_prompt / t_prefill, n_gen, n_gen > 1 ? (n_gen - 1) / t_decode : 0.0);
    }
    status = 0;
fail:
    if (status) fprintf(stderr, "fusion-generate: %s: %s\n", fu_status_str(rc), fu_last_error());
    if (lf && fclose(lf) && !status) {
        fprintf(stderr, "fusion-generate: writing %s failed\n", a.logits_out);
        status = 1;
    }
    free(prompt);
    free(tokens);
    free(logits);
    smp_free(smp);
    eng_seq_free(e, seq);
    eng_free(e);
    op_backend_free(be);
    mdl_free(m);
    return status;
}
