/* generate.c -- fusion-generate: one process, all blocks, generates from a prompt (text, chat or token ids). */
#include <errno.h>
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
#include "lora.h"
#include "model.h"
#include "ops.h"
#include "options.h"
#include "parse.h"
#include "sampler.h"
#include "status.h"
#include "tokenizer.h"

typedef struct gen_args {
    char *model;
    char *prompt;     /* raw text */
    char *chat;       /* a user message, rendered with the chat template */
    char *system;     /* optional system message for --chat */
    char *prompt_ids; /* "1,2,3" */
    char *logits_out;
    char *lora;       /* a PEFT adapter directory */
    int max_rank;     /* the largest LoRA rank accepted */
    int max_tokens;
    int threads;
    int batch;
    char *device;
    int isa;          /* op_cpu_isa */
    int kv_type;      /* op_type */
    bool recompute;
    bool json;
    bool ignore_eos;
    smp_params sp;
} gen_args;

static gen_args args;


static const fu_opt gen_options[] = {
    {"model", 'm', FU_OPT_STRING, FU_OPT_TO(args.model), "PATH|REPO", "a local model or a hub repo id"},
    {"chat", 'c', FU_OPT_STRING, FU_OPT_TO(args.chat), "TEXT", "a user message, rendered with the chat template"},
    {"system", 'S', FU_OPT_STRING, FU_OPT_TO(args.system), "TEXT", "system message for --chat"},
    {"prompt", 'P', FU_OPT_STRING, FU_OPT_TO(args.prompt), "TEXT", "raw prompt text"},
    {"prompt-ids", 'i', FU_OPT_STRING, FU_OPT_TO(args.prompt_ids), "1,2,3", "prompt token ids"},
    {"max-tokens", 'n', FU_OPT_INT, FU_OPT_TO(args.max_tokens), .help = "tokens to generate", .def = "128",
     .lo = 0, .hi = 1 << 20},
    {"temperature", 't', FU_OPT_FLOAT, FU_OPT_TO(args.sp.temperature), "T", "0 = greedy", .def = "0"},
    {"top-k", 'k', FU_OPT_INT, FU_OPT_TO(args.sp.top_k), "K", "0: off", .lo = 0, .hi = INT32_MAX},
    {"top-p", 'p', FU_OPT_FLOAT, FU_OPT_TO(args.sp.top_p), "P", "1: off"},
    {"min-p", 'M', FU_OPT_FLOAT, FU_OPT_TO(args.sp.min_p), "P", "0: off"},
    {"seed", 's', FU_OPT_INT, FU_OPT_TO(args.sp.seed), "S", "sampling seed", .lo = 0, .hi = LONG_MAX},
    {"ignore-eos", 'E', FU_OPT_FLAG, FU_OPT_TO(args.ignore_eos),
     .help = "keep going past end-of-generation tokens"},
    {"device", 'D', FU_OPT_STRING, FU_OPT_TO(args.device), "cpu|cuda|cuda:N", "where the model runs",
     .def = "cpu"},
    {"threads", 'T', FU_OPT_INT, FU_OPT_TO(args.threads), .help = "CPU threads (default: all)", .lo = 0,
     .hi = 1024},
    {"isa", 'I', FU_OPT_CHOICE, FU_OPT_TO(args.isa), .help = "CPU kernels", .def = "auto",
     .choices = op_cpu_isa_choices},
    {"kv", 'K', FU_OPT_CHOICE, FU_OPT_TO(args.kv_type), .help = "KV cache type", .def = "f32",
     .choices = op_kv_type_choices},
    {"batch", 'b', FU_OPT_INT, FU_OPT_TO(args.batch), .help = "tokens per forward chunk (default 256)", .lo = 1,
     .hi = 1 << 16},
    {"recompute", 'r', FU_OPT_FLAG, FU_OPT_TO(args.recompute),
     .help = "recompute the whole sequence each step (no KV reuse)"},
    {"logits-out", 'L', FU_OPT_STRING, FU_OPT_TO(args.logits_out), "FILE",
     "write f32 logits of every position (prompt and generated)"},
    {"lora", 'l', FU_OPT_STRING, FU_OPT_TO(args.lora), "DIR",
     "apply the PEFT LoRA adapter in DIR (adapter_config.json, adapter_model.safetensors)"},
    {"max-rank", 0, FU_OPT_INT, FU_OPT_TO(args.max_rank), "N", "the largest LoRA rank --lora accepts",
     .def = "1024", .lo = 1, .hi = 1 << 20},
    {"json", 'j', FU_OPT_FLAG, FU_OPT_TO(args.json), .help = "print the result as JSON"},
    FU_OPT_END,
};

static const fu_opt_spec gen_spec = {
    "fusion-generate",
    "usage: fusion-generate --model PATH|ORG/NAME[@REV] (--chat TEXT | --prompt TEXT | --prompt-ids 1,2,3)",
    gen_options, NULL};

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

/* One generation: what it holds (gen_run_free releases it) and what it measured. */
typedef struct gen_run {
    char *model_path, *rendered;
    mdl_model *m;
    int vocab;
    tok_tokenizer *tok;
    tok_decoder *dec;        /* NULL: no tokenizer, ids are printed */
    op_backend *be;
    char device[300];
    eng_engine *e;
    eng_seq *seq;
    lora_adapter *ad;        /* --lora, set on seq */
    smp_sampler *smp;
    int32_t *prompt;         /* (n_prompt,) */
    size_t n_prompt, total;  /* total: n_prompt + max tokens */
    int32_t *tokens;         /* (total,): the prompt, then what is generated */
    size_t n;                /* tokens so far */
    eng_seq **seqs;          /* (total,): all the one sequence */
    uint8_t *want;           /* (total,): positions whose logits are wanted */
    float *logits;           /* (total + 1, vocab): every position's row; the last row the sampler's */
    FILE *lf;                /* --logits-out */
    json_t *text;            /* the decoded text */
    const char *finish;      /* "length" or "stop" */
    double t_prefill, t_decode;
} gen_run;

/* The prompt's token ids, from --prompt-ids, --chat or --prompt. */
static int gen_prompt(gen_run *r, const gen_args *a) {
    if (a->prompt_ids && fu_parse_ids(a->prompt_ids, &r->prompt, &r->n_prompt))
        return fu_errorf(FU_ERR_INVALID, "--prompt-ids must be a comma-separated list of token ids");
    int rc = FU_OK;
    if (a->chat && !(rc = render_chat(r->tok, a->system, a->chat, &r->rendered)))
        rc = tok_encode(r->tok, r->rendered, strlen(r->rendered), false, true, &r->prompt, &r->n_prompt);
    else if (a->prompt)
        rc = tok_encode(r->tok, a->prompt, strlen(a->prompt), true, true, &r->prompt, &r->n_prompt);
    if (!rc && r->n_prompt == 0) rc = fu_errorf(FU_ERR_INVALID, "the prompt is empty");
    return rc;
}

/* Resolves and opens the model and its tokenizer, and tokenizes the prompt. */
static int gen_open(gen_run *r, const gen_args *a) {
    /* a local path, or a Hugging Face repo id fetched into the cache */
    hub_options ho;
    hub_options_init(&ho);
    mdl_open_options mo = mdl_open_options_all();
    int rc = hub_resolve(a->model, &ho, &r->model_path);
    if (rc || (rc = mdl_open(r->model_path, &mo, &r->m))) return rc;
    r->vocab = r->m->cfg.vocab_size;
    if ((rc = load_tokenizer(r->m, r->model_path, &r->tok)) && !a->prompt_ids) return rc;
    if (rc) FU_WARN("no tokenizer (%s): printing token ids only", fu_last_error());
    if ((rc = gen_prompt(r, a))) return rc;
    r->total = r->n_prompt + (size_t)a->max_tokens;
    if (r->total > (size_t)r->m->cfg.max_seq_len)
        return fu_errorf(FU_ERR_RANGE, "prompt (%zu tokens) + max tokens (%d) exceed the context (%d)",
                         r->n_prompt, a->max_tokens, r->m->cfg.max_seq_len);
    return FU_OK;
}

/* The backend, the engine, the sampler and every buffer of the run. */
static int gen_prepare(gen_run *r, const gen_args *a) {
    int rc = op_backend_open(a->device, a->threads, a->isa, &r->be, r->device, sizeof r->device);
    eng_options eo = {a->batch, a->kv_type};
    if (rc || (rc = eng_new(r->m, r->be, &eo, &r->e)) || (rc = smp_new(&a->sp, r->vocab, &r->smp)) ||
        (rc = eng_seq_new(r->e, (int)r->total, &r->seq)))
        return rc;
    if (a->lora && ((rc = lora_load(a->lora, &r->m->cfg, r->m->first, r->m->last, a->max_rank, &r->ad)) ||
                    (rc = eng_seq_set_adapter(r->seq, r->ad))))
        return rc;
    r->logits = malloc((r->total + 1) * (size_t)r->vocab * sizeof *r->logits);
    r->tokens = malloc(r->total * sizeof *r->tokens);
    r->seqs = malloc(r->total * sizeof *r->seqs);
    r->want = calloc(r->total, 1);
    r->text = json_string("");
    if (!r->logits || !r->tokens || !r->seqs || !r->want || !r->text) return fu_errorf(FU_ERR_NOMEM, "buffers");
    if (r->tok && (rc = tok_decoder_init(r->tok, true, &r->dec))) return rc;
    memcpy(r->tokens, r->prompt, r->n_prompt * sizeof *r->tokens);
    r->n = r->n_prompt;
    for (size_t i = 0; i < r->total; i++) r->seqs[i] = r->seq;
    if (a->logits_out && !(r->lf = fopen(a->logits_out, "wb")))
        return fu_errorf(FU_ERR_IO, "%s: %s", a->logits_out, strerror(errno));
    return FU_OK;
}

/* The prompt's forward; *last: the logits row to sample the first token from. The logits of
 * every prompt position are computed only when they are written out. */
static int gen_prefill(gen_run *r, const float **last) {
    double t0 = fu_now_s();
    eng_batch b = {(int)r->n_prompt, r->tokens, NULL, r->seqs, NULL};
    if (!r->lf) {
        r->want[r->n_prompt - 1] = 1;
        b.want = r->want;
    }
    int rc = eng_forward(r->e, &b, r->logits);
    r->t_prefill = fu_now_s() - t0;
    if (rc) return rc;
    if (r->lf) fwrite(r->logits, sizeof(float), r->n_prompt * (size_t)r->vocab, r->lf);
    *last = r->logits + (r->lf ? r->n_prompt - 1 : 0) * (size_t)r->vocab;
    return FU_OK;
}

/* Decodes token t: printed as it comes (unless --json) and added to the text. */
static int gen_emit(gen_run *r, const gen_args *a, int32_t t) {
    const char *piece;
    size_t len;
    int rc = tok_decoder_push(r->dec, t, &piece, &len);
    if (rc || !len) return rc;
    if (!a->json) {
        fwrite(piece, 1, len, stdout);
        fflush(stdout);
    }
    char *joined;
    if (asprintf(&joined, "%s%.*s", json_string_value(r->text), (int)len, piece) < 0)
        return fu_errorf(FU_ERR_NOMEM, "text");
    json_string_set(r->text, joined);
    free(joined);
    return FU_OK;
}

/* The next position's logits into out: the last token's forward, or with --recompute the whole
 * sequence from scratch (no cache reuse). */
static int gen_step(gen_run *r, const gen_args *a, float *out) {
    if (!a->recompute) {
        eng_batch db = {1, r->tokens + r->n - 1, NULL, r->seqs, NULL};
        return eng_forward(r->e, &db, out);
    }
    int rc = eng_seq_truncate(r->seq, 0);
    if (rc) return rc;
    memset(r->want, 0, r->n);
    r->want[r->n - 1] = 1;
    eng_batch rb = {(int)r->n, r->tokens, NULL, r->seqs, r->want};
    return eng_forward(r->e, &rb, out);
}

/* Samples up to --max-tokens tokens after the prompt. */
static int gen_decode(gen_run *r, const gen_args *a, const float *last) {
    float *scratch = r->logits + r->total * (size_t)r->vocab; /* the sampler's row */
    double t1 = fu_now_s();
    r->finish = "length";
    for (int step = 0; step < a->max_tokens; step++) {
        memcpy(scratch, last, (size_t)r->vocab * sizeof(float));
        int32_t t = smp_sample(r->smp, scratch);
        smp_accept(r->smp, t);
        r->tokens[r->n++] = t;
        if (r->tok && !a->ignore_eos && tok_is_eog(r->tok, t)) {
            r->finish = "stop";
            break;
        }
        int rc = r->dec ? gen_emit(r, a, t) : FU_OK;
        if (rc) return rc;
        if (step + 1 == a->max_tokens) break;
        float *out = r->logits + (r->n - 1) * (size_t)r->vocab;
        if ((rc = gen_step(r, a, out))) return rc;
        if (r->lf) fwrite(out, sizeof(float), (size_t)r->vocab, r->lf);
        last = out;
    }
    r->t_decode = fu_now_s() - t1;
    return FU_OK;
}

/* Prints the result: JSON, or the ids (without a tokenizer) and the rates on stderr. */
static void gen_print(const gen_run *r, const gen_args *a) {
    size_t n_gen = r->n - r->n_prompt;
    if (a->json) {
        json_t *ids = json_array();
        for (size_t i = r->n_prompt; i < r->n; i++) json_array_append_new(ids, json_integer(r->tokens[i]));
        json_t *res = json_pack("{s:I, s:o, s:O, s:s, s:f, s:f, s:s}", "prompt_tokens", (json_int_t)r->n_prompt,
                                "tokens", ids, "text", r->text, "finish_reason", r->finish, "prefill_s",
                                r->t_prefill, "decode_s", r->t_decode, "device", r->device);
        char *s = json_dumps(res, JSON_COMPACT);
        printf("%s\n", s);
        free(s);
        json_decref(res);
        return;
    }
    for (size_t i = r->n_prompt; !r->dec && i < r->n; i++) printf("%s%d", i > r->n_prompt ? "," : "", r->tokens[i]);
    printf("\n");
    fprintf(stderr, "[%s] prompt %zu tokens %.1f tok/s, generated %zu tokens %.1f tok/s on %s\n", r->finish,
            r->n_prompt, r->n_prompt / r->t_prefill, n_gen,
            n_gen > 1 ? (double)(n_gen - 1) / r->t_decode : 0.0, r->device);
}

/* Releases what the run holds; closing the logits file may fail: FU_ERR_IO then. */
static int gen_run_free(gen_run *r) {
    int rc = r->lf && fclose(r->lf) ? FU_ERR_IO : FU_OK;
    json_decref(r->text);
    free(r->model_path);
    free(r->rendered);
    free(r->prompt);
    free(r->tokens);
    free(r->seqs);
    free(r->want);
    free(r->logits);
    smp_free(r->smp);
    eng_seq_free(r->e, r->seq);
    lora_free(r->ad);
    eng_free(r->e);
    op_backend_free(r->be);
    tok_decoder_free(r->dec);
    tok_free(r->tok);
    mdl_free(r->m);
    return rc;
}

/* Generates as `a` asks; the exit status. */
static int generate(const gen_args *a) {
    gen_run r = {0};
    const float *last = NULL;
    int rc = gen_open(&r, a);
    if (!rc) rc = gen_prepare(&r, a);
    if (!rc) rc = gen_prefill(&r, &last);
    if (!rc) rc = gen_decode(&r, a, last);
    if (!rc) gen_print(&r, a);
    if (rc) fprintf(stderr, "fusion-generate: %s: %s\n", fu_status_str(rc), fu_last_error());
    if (gen_run_free(&r) && !rc) {
        fprintf(stderr, "fusion-generate: writing %s failed\n", a->logits_out);
        rc = FU_ERR_IO;
    }
    return rc ? 1 : 0;
}

int main(int argc, char **argv) {
    args.sp = smp_params_default();
    int status = fu_opt_main(&gen_spec, argc, argv, NULL);
    if (status < 0 && (!args.model || (!!args.prompt + !!args.chat + !!args.prompt_ids) != 1))
        status = fu_opt_fail(&gen_spec, "give --model and one of --chat, --prompt and --prompt-ids");
    if (status < 0) status = generate(&args);
    fu_opt_free(gen_options);
    return status;
}
