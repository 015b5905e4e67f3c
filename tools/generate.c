/* generate.c -- fusion-generate: one process, all blocks, generates from a prompt (text, chat or token ids). */
#include <errno.h>
#include <getopt.h>
#include <inttypes.h>
#include <jansson.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "chat-template.h"
#include "clock.h"
#include "engine.h"
#include "gguf.h"
#include "hub.h"
#include "log.h"
#include "model.h"
#include "ops.h"
#include "parse.h"
#include "sampler.h"
#include "status.h"
#include "tokenizer.h"

typedef struct gen_args {
    const char *model;
    const char *prompt;     /* raw text */
    const char *chat;       /* a user message, rendered with the chat template */
    const char *system;     /* optional system message for --chat */
    const char *prompt_ids; /* "1,2,3" */
    const char *logits_out;
    int max_tokens;
    int threads;
    int batch;
    const char *device;
    op_cpu_isa isa;
    op_type kv_type;
    int recompute;
    int json;
    int ignore_eos;
    smp_params sp;
} gen_args;

static void usage(FILE *f) {
    fprintf(f,
            "usage: fusion-generate --model PATH|ORG/NAME[@REV] (--chat TEXT | --prompt TEXT | --prompt-ids 1,2,3)\n"
            "  --system TEXT         system message for --chat\n"
            "  --max-tokens N        tokens to generate (default 128)\n"
            "  --temperature T       0 = greedy (default 0)\n"
            "  --top-k K --top-p P --min-p P --seed S\n"
            "  --ignore-eos          keep going past end-of-generation tokens\n"
            "  --device cpu|cuda|cuda:N   where the model runs (default cpu)\n"
            "  --threads N           CPU threads (default: all)\n"
            "  --isa auto|portable|avx2|avx512\n"
            "  --kv f32|f16          KV cache type (default f32)\n"
            "  --batch N             tokens per forward chunk (default 256)\n"
            "  --recompute           recompute the whole sequence each step (no KV reuse)\n"
            "  --logits-out FILE     write f32 logits of every position (prompt and generated)\n"
            "  --json                print the result as JSON\n");
}

/* Loads the tokenizer that comes with the model: its GGUF metadata, or the
 * tokenizer.json beside config.json. */
static int load_tokenizer(const mdl_model *m, const char *model_dir, tok_tokenizer **out) {
    gguf_file *gf = mdl_gguf(m);
    return gf ? tok_load_gguf(gf, out) : tok_load_hf(model_dir, out);
}

/* Renders the chat prompt with the model's template. *out is malloc'd. */
static int render_chat(const tok_tokenizer *tok, const char *system, const char *user, char **out) {
    const char *src = tok_chat_template(tok);
    if (!src) return fu_errorf(FU_ERR_NOT_FOUND, "the model has no chat template; use --prompt");
    tpl_template *tpl = NULL;
    int rc = tpl_compile(src, &tpl);
    if (rc) return rc;
    json_t *msgs = json_array();
    if (system) json_array_append_new(msgs, json_pack("{s:s, s:s}", "role", "system", "content", system));
    json_array_append_new(msgs, json_pack("{s:s, s:s}", "role", "user", "content", user));
    rc = tpl_apply_chat(tpl, msgs, NULL, 1, tok_bos_str(tok), tok_eos_str(tok), NULL, out);
    json_decref(msgs);
    tpl_free(tpl);
    return rc;
}

int main(int argc, char **argv) {
    gen_args a = {.max_tokens = 128, .device = "cpu", .isa = OP_CPU_ISA_AUTO, .kv_type = OP_TYPE_F32};
    a.sp = smp_params_default();
    a.sp.temperature = 0;
    static const struct option opts[] = {
        {"model", required_argument, 0, 'm'},      {"prompt-ids", required_argument, 0, 'i'},
        {"prompt", required_argument, 0, 'P'},     {"chat", required_argument, 0, 'c'},
        {"system", required_argument, 0, 'S'},     {"ignore-eos", no_argument, 0, 'E'},
        {"max-tokens", required_argument, 0, 'n'}, {"temperature", required_argument, 0, 't'},
        {"top-k", required_argument, 0, 'k'},      {"top-p", required_argument, 0, 'p'},
        {"min-p", required_argument, 0, 'M'},      {"seed", required_argument, 0, 's'},
        {"threads", required_argument, 0, 'T'},    {"isa", required_argument, 0, 'I'},
        {"kv", required_argument, 0, 'K'},         {"batch", required_argument, 0, 'b'},
        {"recompute", no_argument, 0, 'r'},        {"logits-out", required_argument, 0, 'L'},
        {"json", no_argument, 0, 'j'},             {"help", no_argument, 0, 'h'},
        {"device", required_argument, 0, 'D'},     {0, 0, 0, 0}};
    int c;
    long v;
    while ((c = getopt_long(argc, argv, "m:i:P:c:S:En:t:k:p:M:s:T:I:K:b:rL:jhD:", opts, NULL)) != -1) {
        switch (c) {
        case 'm': a.model = optarg; break;
        case 'i': a.prompt_ids = optarg; break;
        case 'P': a.prompt = optarg; break;
        case 'c': a.chat = optarg; break;
        case 'S': a.system = optarg; break;
        case 'E': a.ignore_eos = 1; break;
        case 'n':
            if (fu_parse_long(optarg, 0, 1 << 20, &v)) goto bad;
            a.max_tokens = (int)v;
            break;
        case 't': if (fu_parse_float(optarg, &a.sp.temperature)) goto bad; break;
        case 'k':
            if (fu_parse_long(optarg, 0, INT32_MAX, &v)) goto bad;
            a.sp.top_k = (int)v;
            break;
        case 'p': if (fu_parse_float(optarg, &a.sp.top_p)) goto bad; break;
        case 'M': if (fu_parse_float(optarg, &a.sp.min_p)) goto bad; break;
        case 's':
            if (fu_parse_long(optarg, 0, LONG_MAX, &v)) goto bad;
            a.sp.seed = (uint64_t)v;
            break;
        case 'T':
            if (fu_parse_long(optarg, 0, 1024, &v)) goto bad;
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
            if (fu_parse_long(optarg, 1, 1 << 16, &v)) goto bad;
            a.batch = (int)v;
            break;
        case 'r': a.recompute = 1; break;
        case 'D': a.device = optarg; break;
        case 'L': a.logits_out = optarg; break;
        case 'j': a.json = 1; break;
        case 'h': usage(stdout); return 0;
        default:
        bad:
            fprintf(stderr, "fusion-generate: bad option or value near '%s'\n",
                    optarg ? optarg : argv[optind - 1]);
            usage(stderr);
            return 2;
        }
    }
    if (!a.model || (!!a.prompt + !!a.chat + !!a.prompt_ids) != 1) {
        usage(stderr);
        return 2;
    }

    int rc = FU_OK, status = 1;
    char *model_path = NULL, *rendered = NULL;
    mdl_model *m = NULL;
    tok_tokenizer *tok = NULL;
    tok_decoder *dec = NULL;
    op_backend *be = NULL;
    eng_engine *e = NULL;
    eng_seq *seq = NULL;
    smp_sampler *smp = NULL;
    float *logits = NULL;
    FILE *lf = NULL;
    int32_t *prompt = NULL, *tokens = NULL;
    eng_seq **seqs = NULL;
    uint8_t *want = NULL;
    size_t n_prompt = 0;
    json_t *text_out = NULL;

    /* a local path, or a Hugging Face repo id fetched into the cache */
    hub_options ho;
    hub_options_init(&ho);
    if ((rc = hub_resolve(a.model, &ho, &model_path))) goto done;
    mdl_open_options mo = mdl_open_options_all();
    if ((rc = mdl_open(model_path, &mo, &m))) goto done;
    const int V = m->cfg.vocab_size;

    rc = load_tokenizer(m, model_path, &tok);
    if (rc && !a.prompt_ids) goto done;
    if (rc) FU_WARN("no tokenizer (%s): printing token ids only", fu_last_error());
    if (a.prompt_ids) {
        if (fu_parse_ids(a.prompt_ids, &prompt, &n_prompt)) {
            rc = fu_errorf(FU_ERR_INVALID, "--prompt-ids must be a comma-separated list of token ids");
            goto done;
        }
    } else if (a.chat) {
        if ((rc = render_chat(tok, a.system, a.chat, &rendered))) goto done;
        if ((rc = tok_encode(tok, rendered, strlen(rendered), false, true, &prompt, &n_prompt))) goto done;
    } else {
        if ((rc = tok_encode(tok, a.prompt, strlen(a.prompt), true, true, &prompt, &n_prompt))) goto done;
    }
    if (n_prompt == 0) {
        rc = fu_errorf(FU_ERR_INVALID, "the prompt is empty");
        goto done;
    }
    size_t total = n_prompt + (size_t)a.max_tokens;
    if (total > (size_t)m->cfg.max_seq_len) {
        rc = fu_errorf(FU_ERR_RANGE, "prompt (%zu tokens) + max tokens (%d) exceed the context (%d)",
                       n_prompt, a.max_tokens, m->cfg.max_seq_len);
        goto done;
    }

    char device[300];
    if ((rc = op_backend_open(a.device, a.threads, a.isa, &be, device, sizeof device))) goto done;
    eng_options eo = {a.batch, a.kv_type};
    if ((rc = eng_new(m, be, &eo, &e))) goto done;
    if ((rc = smp_new(&a.sp, V, &smp))) goto done;
    if ((rc = eng_seq_new(e, (int)total, &seq))) goto done;
    logits = malloc((total + 1) * (size_t)V * sizeof *logits);
    tokens = malloc(total * sizeof *tokens);
    seqs = malloc(total * sizeof *seqs);
    want = calloc(total, 1);
    text_out = json_string("");
    if (!logits || !tokens || !seqs || !want || !text_out) {
        rc = fu_errorf(FU_ERR_NOMEM, "buffers");
        goto done;
    }
    if (tok && (rc = tok_decoder_init(tok, true, &dec))) goto done;
    memcpy(tokens, prompt, n_prompt * sizeof *tokens);
    for (size_t i = 0; i < total; i++) seqs[i] = seq;
    if (a.logits_out && !(lf = fopen(a.logits_out, "wb"))) {
        rc = fu_errorf(FU_ERR_IO, "%s: %s", a.logits_out, strerror(errno));
        goto done;
    }

    double t0 = fu_now_s();
    /* logits of every prompt position only when they are written out */
    eng_batch b = {(int)n_prompt, tokens, NULL, seqs, NULL};
    if (!lf) {
        want[n_prompt - 1] = 1;
        b.want = want;
    }
    if ((rc = eng_forward(e, &b, logits))) goto done;
    double t_prefill = fu_now_s() - t0;
    if (lf) fwrite(logits, sizeof(float), n_prompt * (size_t)V, lf);
    const float *last = logits + (lf ? n_prompt - 1 : 0) * (size_t)V;
    float *scratch = logits + total * (size_t)V; /* the sampler's row */
    size_t n = n_prompt;
    const char *finish = "length";
    double t1 = fu_now_s();
    for (int step = 0; step < a.max_tokens; step++) {
        memcpy(scratch, last, (size_t)V * sizeof(float));
        int32_t t = smp_sample(smp, scratch);
        smp_accept(smp, t);
        tokens[n++] = t;
        if (tok && !a.ignore_eos && tok_is_eog(tok, t)) {
            finish = "stop";
            break;
        }
        if (dec) {
            const char *piece;
            size_t len;
            if ((rc = tok_decoder_push(dec, t, &piece, &len))) goto done;
            if (len && !a.json) {
                fwrite(piece, 1, len, stdout);
                fflush(stdout);
            }
            if (len) {
                char *joined;
                if (asprintf(&joined, "%s%.*s", json_string_value(text_out), (int)len, piece) < 0) {
                    rc = fu_errorf(FU_ERR_NOMEM, "text");
                    goto done;
                }
                json_string_set(text_out, joined);
                free(joined);
            }
        }
        if (step + 1 == a.max_tokens) break;
        float *out = logits + (n - 1) * (size_t)V;
        if (a.recompute) { /* the whole sequence from scratch: no cache reuse */
            if ((rc = eng_seq_truncate(seq, 0))) goto done;
            memset(want, 0, n);
            want[n - 1] = 1;
            eng_batch rb = {(int)n, tokens, NULL, seqs, want};
            rc = eng_forward(e, &rb, out);
        } else {
            eng_batch db = {1, tokens + n - 1, NULL, seqs, NULL};
            rc = eng_forward(e, &db, out);
        }
        if (rc) goto done;
        if (lf) fwrite(out, sizeof(float), (size_t)V, lf);
        last = out;
    }
    double t_decode = fu_now_s() - t1;

    size_t n_gen = n - n_prompt;
    if (a.json) {
        json_t *ids = json_array();
        for (size_t i = n_prompt; i < n; i++) json_array_append_new(ids, json_integer(tokens[i]));
        json_t *res = json_pack("{s:I, s:o, s:O, s:s, s:f, s:f, s:s}", "prompt_tokens", (json_int_t)n_prompt,
                                "tokens", ids, "text", text_out, "finish_reason", finish,
                                "prefill_s", t_prefill, "decode_s", t_decode, "device", device);
        char *s = json_dumps(res, JSON_COMPACT);
        printf("%s\n", s);
        free(s);
        json_decref(res);
    } else {
        if (!dec) {
            for (size_t i = n_prompt; i < n; i++) printf("%s%d", i > n_prompt ? "," : "", tokens[i]);
        }
        printf("\n");
        fprintf(stderr, "[%s] prompt %zu tokens %.1f tok/s, generated %zu tokens %.1f tok/s on %s\n", finish,
                n_prompt, n_prompt / t_prefill, n_gen, n_gen > 1 ? (double)(n_gen - 1) / t_decode : 0.0, device);
    }
    status = 0;
done:
    if (status) fprintf(stderr, "fusion-generate: %s: %s\n", fu_status_str(rc), fu_last_error());
    if (lf && fclose(lf) && !status) {
        fprintf(stderr, "fusion-generate: writing %s failed\n", a.logits_out);
        status = 1;
    }
    json_decref(text_out);
    free(model_path);
    free(rendered);
    free(prompt);
    free(tokens);
    free(seqs);
    free(want);
    free(logits);
    smp_free(smp);
    eng_seq_free(e, seq);
    eng_free(e);
    op_backend_free(be);
    tok_decoder_free(dec);
    tok_free(tok);
    mdl_free(m);
    return status;
}
