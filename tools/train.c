/* train.c -- fusion-train: LoRA fine-tuning of a local model, its blocks split into one or more spans in this process. */
#include <errno.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "log.h"
#include "chat-train.h"
#include "clock.h"
#include "gguf.h"
#include "lora.h"
#include "mapped-file.h"
#include "model.h"
#include "options.h"
#include "safetensors.h"
#include "status.h"
#include "tokenizer.h"
#include "rpc-base.h"
#include "train-remote.h"
#include "train-run.h"
#include "wire.h"

#define TRAIN_MAX_SPANS 16

typedef struct train_args {
    char *model, *data, *adapter, *out, *check, *targets, *device;
    int spans, max_tokens, batch_size, steps, epochs, r, threads, isa, memory, schedule, warmup;
    double alpha, dropout, lr, weight_decay, beta1, beta2, adam_eps, clip;
    bool rslora, insecure;
    long seed, init_seed;
    fu_opt_list hops, spares;
    char *secret, *tls_ca, *job;
    int wire, snapshot_every, timeout_s, pipeline;
} train_args;

static train_args args;

static const fu_opt_choice wire_choices[] = {{"bf16", WIRE_BF16}, {"f32", WIRE_F32}, {NULL, 0}};
static const fu_opt_choice memory_choices[] = {{"recompute", TRN_RECOMPUTE}, {"keep", TRN_KEEP}, {NULL, 0}};
static const fu_opt_choice schedule_choices[] = {
    {"linear", TRN_DECAY_LINEAR}, {"cosine", TRN_DECAY_COSINE}, {"constant", TRN_DECAY_CONSTANT}, {NULL, 0}};

static const fu_opt train_options[] = {
    {"model", 'm', FU_OPT_PATH, FU_OPT_TO(args.model), "PATH", "the base model: a Hugging Face directory or a GGUF"},
    {"data", 'd', FU_OPT_PATH, FU_OPT_TO(args.data), "FILE",
     "JSONL, one example per line: OpenAI's chat format {\"messages\": [...]} (the loss on assistant "
     "messages without \"weight\": 0), or {\"input_ids\": [...], \"labels\": [...]} (labels as Hugging "
     "Face's: aligned with input_ids, -100 for no loss; default: input_ids)"},
    {"adapter", 'a', FU_OPT_PATH, FU_OPT_TO(args.adapter), "DIR", "start from this PEFT adapter (default: a fresh one)"},
    {"out", 'o', FU_OPT_PATH, FU_OPT_TO(args.out), "DIR", "write the trained adapter here (PEFT's format)"},
    {"check", 0, FU_OPT_PATH, FU_OPT_TO(args.check), "FILE",
     "one forward and backward of the first batch, no step: write the loss, each span's input gradient "
     "and every LoRA gradient to FILE (safetensors)"},
    {"spans", 0, FU_OPT_INT, FU_OPT_TO(args.spans), "N", "split the blocks into N spans", "1", .lo = 1, .hi = TRAIN_MAX_SPANS},
    {"max-tokens", 0, FU_OPT_INT, FU_OPT_TO(args.max_tokens), "N", "rows per micro-batch", "1024", .lo = 1, .hi = 1 << 20},
    {"batch-size", 'b', FU_OPT_INT, FU_OPT_TO(args.batch_size), "N", "examples per optimizer step", "8", .lo = 1, .hi = 1 << 20},
    {"steps", 0, FU_OPT_INT, FU_OPT_TO(args.steps), "N", "optimizer steps (0: --epochs over the data)", "0", .lo = 0, .hi = 1 << 30},
    {"epochs", 0, FU_OPT_INT, FU_OPT_TO(args.epochs), "N", "passes over the data when --steps is 0", "1", .lo = 1, .hi = 1 << 20},
    {"r", 'r', FU_OPT_INT, FU_OPT_TO(args.r), "N", "fresh adapter: rank", "16", .lo = 1, .hi = 4096},
    {"alpha", 0, FU_OPT_FLOAT, FU_OPT_TO(args.alpha), "X", "fresh adapter: lora_alpha", "32"},
    {"dropout", 0, FU_OPT_FLOAT, FU_OPT_TO(args.dropout), "P", "fresh adapter: lora_dropout", "0"},
    {"rslora", 0, FU_OPT_FLAG, FU_OPT_TO(args.rslora), .help = "fresh adapter: scale alpha / sqrt(r)"},
    {"targets", 't', FU_OPT_STRING, FU_OPT_TO(args.targets), "LIST", "fresh adapter: PEFT module names or all-linear",
     "all-linear"},
    {"init-seed", 0, FU_OPT_INT, FU_OPT_TO(args.init_seed), "N", "fresh adapter: seed of A's initialisation", "0"},
    {"lr", 0, FU_OPT_FLOAT, FU_OPT_TO(args.lr), "X", "peak learning rate", "1e-4"},
    {"warmup", 0, FU_OPT_INT, FU_OPT_TO(args.warmup), "N", "steps of linear warm-up", "0", .lo = 0, .hi = 1 << 30},
    {"schedule", 0, FU_OPT_CHOICE, FU_OPT_TO(args.schedule), .help = "decay after warm-up", .def = "linear",
     .choices = schedule_choices},
    {"weight-decay", 0, FU_OPT_FLOAT, FU_OPT_TO(args.weight_decay), "X", "AdamW weight decay", "0"},
    {"beta1", 0, FU_OPT_FLOAT, FU_OPT_TO(args.beta1), "X", "AdamW beta1", "0.9"},
    {"beta2", 0, FU_OPT_FLOAT, FU_OPT_TO(args.beta2), "X", "AdamW beta2", "0.999"},
    {"adam-eps", 0, FU_OPT_FLOAT, FU_OPT_TO(args.adam_eps), "X", "AdamW epsilon", "1e-8"},
    {"clip", 0, FU_OPT_FLOAT, FU_OPT_TO(args.clip), "X", "global gradient-norm bound (0: none)", "1"},
    {"seed", 's', FU_OPT_INT, FU_OPT_TO(args.seed), "N", "seed of dropout", "0"},
    {"memory", 0, FU_OPT_CHOICE, FU_OPT_TO(args.memory), .help = "activations: recompute per block, or keep",
     .def = "recompute", .choices = memory_choices},
    {"device", 'D', FU_OPT_STRING, FU_OPT_TO(args.device), "cpu", "where the spans run", .def = "cpu"},
    {"threads", 'T', FU_OPT_INT, FU_OPT_TO(args.threads), .help = "CPU threads (default: all)", .lo = 0, .hi = 1024},
    {"isa", 'I', FU_OPT_CHOICE, FU_OPT_TO(args.isa), .help = "CPU kernels", .def = "auto", .choices = op_cpu_isa_choices},
    {"hop", 0, FU_OPT_LIST, FU_OPT_TO(args.hops), "HOST:PORT:A:B",
     "train through the shard server at HOST:PORT, serving blocks [A, B); in chain order (instead of --spans)"},
    {"spare", 0, FU_OPT_LIST, FU_OPT_TO(args.spares), "HOST:PORT:A:B",
     "a server that takes over blocks [A, B) when a --hop of that span dies"},
    {"secret", 0, FU_OPT_STRING, FU_OPT_TO(args.secret), "S", "the swarm secret (default: $FUSION_SECRET)"},
    {"tls-ca", 0, FU_OPT_STRING, FU_OPT_TO(args.tls_ca), "PEM", "CA to verify the servers (TLS)"},
    {"insecure", 0, FU_OPT_FLAG, FU_OPT_TO(args.insecure), .help = "plaintext to loopback servers"},
    {"wire", 0, FU_OPT_CHOICE, FU_OPT_TO(args.wire), .help = "hidden states and gradients on the wire",
     .def = "bf16", .choices = wire_choices},
    {"snapshot-every", 0, FU_OPT_INT, FU_OPT_TO(args.snapshot_every), "N",
     "pull every span's adapter and optimizer state after every N steps (failover)", "1", .lo = 1, .hi = 1 << 20},
    {"job", 0, FU_OPT_STRING, FU_OPT_TO(args.job), "ID", "the job's id on the servers (default: random)"},
    {"pipeline", 0, FU_OPT_INT, FU_OPT_TO(args.pipeline), "N",
     "micro-batches in flight at once (GPipe): the spans work on different ones together", "1", .lo = 1, .hi = 64},
    {"timeout", 0, FU_OPT_INT, FU_OPT_TO(args.timeout_s), "S", "bound on each call to a server", "600", .lo = 1,
     .hi = 86400},
    FU_OPT_END,
};

static const fu_opt_spec train_spec = {
    "fusion-train",
    "usage: fusion-train --model PATH --data FILE.jsonl [--out DIR] [--spans N | --hop HOST:PORT:A:B ...] [options]\n"
    "Fine-tunes a LoRA adapter on the examples with AdamW, printing one JSON line per step: in this\n"
    "process (its blocks in --spans spans), or through shard servers (--hop), each training the\n"
    "adapter of its own blocks, with --spare servers taking over a dead one's span.\n",
    train_options, NULL};

/* ---- data ------------------------------------------------------------------------------- */

typedef struct train_data {
    trn_example *ex;
    int n, cap;
    int vocab;
    const char *model;     /* where the tokenizer comes from */
    const mdl_model *m;
    tok_tokenizer *tok;    /* loaded for the first chat example */
    tpl_template *tpl;
} train_data;

static void data_free(train_data *d) {
    for (int i = 0; i < d->n; i++) {
        free((void *)d->ex[i].tokens);
        free((void *)d->ex[i].target);
    }
    free(d->ex);
    tpl_free(d->tpl);
    tok_free(d->tok);
}

/* The tokenizer and chat template of the model, loaded once. */
static int data_chat_setup(train_data *d) {
    if (d->tpl) return FU_OK;
    gguf_file *gf = mdl_gguf(d->m);
    int rc = d->tok ? FU_OK : gf ? tok_load_gguf(gf, &d->tok) : tok_load_hf(d->model, &d->tok);
    if (rc) return rc;
    const char *src = tok_chat_template(d->tok);
    return src ? tpl_compile(src, &d->tpl) : fu_errorf(FU_ERR_NOT_FOUND, "the model has no chat template");
}

/* One line: a chat example (the template loaded for the first) or token ids. */
static int data_line(train_data *d, const char *text, size_t len, int line) {
    int32_t *tok = NULL, *tg = NULL;
    size_t n = 0;
    int rc = FU_OK;
    if (memmem(text, len, "\"messages\"", 10)) rc = data_chat_setup(d);
    if (!rc) rc = chat_train_line(d->tpl, d->tok, d->vocab, text, len, &tok, &tg, &n);
    if (!rc && d->n == d->cap) {
        int cap = d->cap ? 2 * d->cap : 64;
        trn_example *p = realloc(d->ex, (size_t)cap * sizeof *p);
        rc = p ? (d->ex = p, d->cap = cap, FU_OK) : fu_errorf(FU_ERR_NOMEM, "out of memory");
    }
    if (rc) {
        free(tok), free(tg);
        return fu_errorf(rc, "line %d: %s", line, fu_last_error());
    }
    d->ex[d->n++] = (trn_example){(int)n, tok, tg};
    return FU_OK;
}

static int data_read(const char *path, train_data *d) {
    char *text;
    size_t len;
    int rc = mf_read(path, (size_t)1 << 32, &text, &len);
    if (rc) return rc;
    int line = 0;
    for (size_t at = 0; at < len && !rc;) {
        const char *nl = memchr(text + at, '\n', len - at);
        size_t n = nl ? (size_t)(nl - (text + at)) : len - at;
        line++;
        if (strspn(text + at, " \t\r") < n) rc = data_line(d, text + at, n, line);
        at += n + 1;
    }
    free(text);
    if (!rc && d->n == 0) rc = fu_errorf(FU_ERR_FORMAT, "%s: no examples", path);
    return rc ? fu_errorf(rc, "%s: %s", path, fu_last_error()) : FU_OK;
}

/* ---- stages ------------------------------------------------------------------------------ */

/* A span in this process. */
typedef struct train_span {
    mdl_model *m;
    eng_engine *e;
    lora_adapter *ad;
    trn_span *t;
} train_span;

/* A span on a shard server (--hop or --spare). */
typedef struct train_hop {
    char *addr;
    int span[2];
    rpc_channel *ch;
    trn_remote *rem;
    bool used;          /* a spare already taken */
} train_hop;

typedef struct train_ctx {
    op_backend *be;
    mdl_model *cfg;     /* the model's configuration (no blocks loaded) */
    int n, n_layers;
    train_span sp[TRAIN_MAX_SPANS];
    train_hop hop[TRAIN_MAX_SPANS], spare[TRAIN_MAX_SPANS];
    int n_spares;
    trn_remote *dead[4 * TRAIN_MAX_SPANS]; /* replaced stages, closed at the end */
    int n_dead;
    trn_stage stages[TRAIN_MAX_SPANS];
    lora_config lora;
    char job[64];
    train_data data;
} train_ctx;

static int train_lora_config(lora_config *c) {
    *c = lora_config_default();
    c->r = args.r;
    c->alpha = (float)args.alpha;
    c->dropout = (float)args.dropout;
    c->use_rslora = args.rslora;
    snprintf(c->base_model, sizeof c->base_model, "%s", args.model);
    return lora_targets_parse(args.targets, &c->targets);
}

/* Span i of n over the model's blocks in this process: model, engine, adapter and trainer. */
static int span_open(train_ctx *c, int i) {
    train_span *s = &c->sp[i];
    const int first = i * c->n_layers / c->n, last = (i + 1) * c->n_layers / c->n;
    mdl_open_options mo = {first, last, first == 0, last == c->n_layers};
    eng_options eo = {1, OP_TYPE_F32};
    trn_options to = {.max_tokens = args.max_tokens, .slots = args.pipeline, .memory = (trn_memory)args.memory};
    int rc = mdl_open(args.model, &mo, &s->m);
    if (!rc) rc = eng_new(s->m, c->be, &eo, &s->e);
    if (!rc && args.adapter) rc = lora_load(args.adapter, &s->m->cfg, first, last, 4096, &s->ad);
    else if (!rc) rc = lora_new(&c->lora, &s->m->cfg, first, last, (uint64_t)args.init_seed, &s->ad);
    if (!rc) rc = trn_new(s->e, s->ad, &to, &s->t);
    if (!rc) c->stages[i] = trn_stage_local(s->t);
    return rc;
}

/* "HOST:PORT:A:B" into h, with a channel to it. */
static int hop_parse(train_ctx *c, const char *spec, train_hop *h) {
    int rc = fu_opt_split_span(spec, c->n_layers, &h->addr, h->span);
    if (rc) return fu_errorf(rc, "--hop/--spare %s: %s", spec, fu_last_error());
    const char *secret = args.secret ? args.secret : getenv("FUSION_SECRET");
    rpc_channel_options co = {.tls_ca = args.tls_ca, .insecure = args.insecure, .secret = secret};
    return rpc_channel_new(h->addr, &co, &h->ch);
}

/* The remote options of blocks span[0..1) for this run's job. */
static trn_remote_options hop_options(const train_ctx *c, const int span[2], const char *job) {
    return (trn_remote_options){
        .job_id = job, .first_block = span[0], .last_block = span[1], .embed = span[0] == 0,
        .head = span[1] == c->n_layers, .lora = &c->lora, .init_seed = (uint64_t)args.init_seed,
        .max_tokens = args.max_tokens, .slots = args.pipeline, .keep_activations = args.memory == TRN_KEEP,
        .dim = c->cfg->cfg.dim, .wire_dtype = args.wire, .timeout_ms = args.timeout_s * 1000};
}

/* Hop i: its job opened on the server. */
static int hop_open(train_ctx *c, int i) {
    train_hop *h = &c->hop[i];
    trn_state st = {0};
    int rc = hop_parse(c, args.hops.items[i], h);
    if (!rc && (i ? c->hop[i - 1].span[1] : 0) != h->span[0])
        rc = fu_errorf(FU_ERR_INVALID, "--hop %s does not continue the chain at block %d", args.hops.items[i],
                       i ? c->hop[i - 1].span[1] : 0);
    if (!rc && i == c->n - 1 && h->span[1] != c->n_layers)
        rc = fu_errorf(FU_ERR_INVALID, "the chain ends at block %d of %d", h->span[1], c->n_layers);
    if (!rc && args.adapter) rc = trn_state_load(args.adapter, &c->cfg->cfg, h->span[0], h->span[1], 4096, &st);
    trn_remote_options o = hop_options(c, h->span, c->job);
    if (!rc) rc = trn_remote_open(h->ch, &o, args.adapter ? &st : NULL, &h->rem);
    if (!rc) c->stages[i] = trn_remote_stage(h->rem);
    trn_state_clear(&st);
    return rc;
}

/* trn_replace_fn: an unused --spare of the same span takes over stage `index`. */
static int hop_replace(void *arg, int index, const trn_state *snap, trn_stage *out) {
    train_ctx *c = arg;
    train_hop *dead = &c->hop[index];
    for (int i = 0; i < c->n_spares; i++) {
        train_hop *sp = &c->spare[i];
        if (sp->used || sp->span[0] != dead->span[0] || sp->span[1] != dead->span[1]) continue;
        sp->used = true;
        trn_remote_options o = hop_options(c, sp->span, c->job);
        int rc = trn_remote_open(sp->ch, &o, snap, &sp->rem);
        if (rc) {
            FU_WARN("spare %s: %s", sp->addr, fu_last_error());
            continue;
        }
        FU_INFO("blocks [%d, %d): %s takes over from %s", sp->span[0], sp->span[1], sp->addr, dead->addr);
        if (c->n_dead < (int)(sizeof c->dead / sizeof c->dead[0])) c->dead[c->n_dead++] = dead->rem;
        else trn_remote_close(dead->rem);
        dead->rem = NULL;
        *out = trn_remote_stage(sp->rem);
        return FU_OK;
    }
    return fu_errorf(FU_ERR_NETWORK, "no spare left for blocks [%d, %d)", dead->span[0], dead->span[1]);
}

static void hop_free(train_hop *h) {
    trn_remote_close(h->rem);
    rpc_channel_free(h->ch);
    free(h->addr);
}

static void ctx_free(train_ctx *c) {
    for (int i = 0; i < c->n_dead; i++) trn_remote_close(c->dead[i]);
    for (int i = 0; i < c->n_spares; i++) trn_remote_close(c->spare[i].rem), c->spare[i].rem = NULL;
    for (int i = 0; i < TRAIN_MAX_SPANS; i++) {
        trn_free(c->sp[i].t);
        lora_free(c->sp[i].ad);
        eng_free(c->sp[i].e);
        mdl_free(c->sp[i].m);
        hop_free(&c->hop[i]);
        hop_free(&c->spare[i]);
    }
    mdl_free(c->cfg);
    op_backend_free(c->be);
    data_free(&c->data);
}

/* A random job id. */
static void job_id(char *out, size_t size) {
    uint64_t r = (uint64_t)fu_now_us() ^ ((uint64_t)getpid() << 40);
    FILE *f = fopen("/dev/urandom", "rb");
    if (f) {
        if (fread(&r, sizeof r, 1, f) != 1) r ^= 0x9e3779b97f4a7c15ull;
        fclose(f);
    }
    snprintf(out, size, "%s", args.job ? args.job : "");
    if (!args.job) snprintf(out, size, "train-%016llx", (unsigned long long)r);
}

/* The stages: --hop servers, or --spans spans in this process. */
static int ctx_stages(train_ctx *c) {
    int rc = FU_OK;
    if (!args.hops.n) {
        char desc[300];
        if (args.spans > c->n_layers)
            return fu_errorf(FU_ERR_INVALID, "--spans %d: the model has %d blocks", args.spans, c->n_layers);
        c->n = args.spans;
        rc = op_backend_open(args.device, args.threads, (op_cpu_isa)args.isa, &c->be, desc, sizeof desc);
        for (int i = 0; i < c->n && !rc; i++) rc = span_open(c, i);
        if (!rc) FU_INFO("training on %s, %d span(s)", desc, c->n);
        return rc;
    }
    if (args.hops.n > TRAIN_MAX_SPANS || args.spares.n > TRAIN_MAX_SPANS)
        return fu_errorf(FU_ERR_INVALID, "at most %d --hop and --spare servers", TRAIN_MAX_SPANS);
    job_id(c->job, sizeof c->job);
    c->n = (int)args.hops.n;
    for (int i = 0; i < c->n && !rc; i++) rc = hop_open(c, i);
    for (size_t i = 0; i < args.spares.n && !rc; i++, c->n_spares++) rc = hop_parse(c, args.spares.items[i], &c->spare[i]);
    if (!rc) FU_INFO("training job %s on %d server(s), %d spare(s)", c->job, c->n, c->n_spares);
    return rc;
}

static int ctx_open(train_ctx *c) {
    mdl_open_options probe = {0, 1, false, false};
    int rc = train_lora_config(&c->lora);
    if (!rc) rc = mdl_open(args.model, &probe, &c->cfg);
    if (rc) return rc;
    c->n_layers = c->cfg->cfg.n_layers;
    c->data.vocab = c->cfg->cfg.vocab_size;
    c->data.model = args.model;
    c->data.m = c->cfg;
    if (!(rc = data_read(args.data, &c->data))) rc = ctx_stages(c);
    return rc;
}
/* ---- the gradient check --------------------------------------------------------------- */

typedef struct check_out {
    st_write_tensor *t;
    int64_t (*shape)[2];
    size_t n, cap;
} check_out;

static int check_add(check_out *o, const char *name, const float *data, int64_t rows, int64_t cols) {
    if (o->n == o->cap) {
        size_t cap = o->cap ? 2 * o->cap : 64;
        st_write_tensor *t = realloc(o->t, cap * sizeof *t);
        if (t) o->t = t;
        int64_t(*s)[2] = realloc(o->shape, cap * sizeof *s);
        if (s) o->shape = s;
        if (!t || !s) return FU_ERR_NOMEM;
        o->cap = cap;
    }
    o->shape[o->n][0] = rows;
    o->shape[o->n][1] = cols;
    o->t[o->n] = (st_write_tensor){strdup(name), "F32", 2, NULL, data};
    return o->t[o->n++].name ? FU_OK : FU_ERR_NOMEM;
}

static int check_matrix(const lora_matrix *m, void *user) {
    return check_add(user, m->name, m->data, m->rows, m->cols);
}

/* Span s's gradients as an adapter in PEFT's row order (*out, the caller frees it). */
static int check_grads(const train_span *s, lora_adapter **out) {
    const lora_adapter *ad = s->ad;
    int rc = lora_new(&ad->cfg, &s->m->cfg, ad->first, ad->last, 0, out);
    if (rc) return rc;
    memcpy((*out)->data, trn_grads(s->t), ad->n_floats * sizeof(float));
    (*out)->qk_interleaved = ad->qk_interleaved;
    return lora_set_qk_order(*out, false);
}

/* Forward and backward of the first micro-batch through every span; writes
 * loss, input gradients and LoRA gradients. */
static int run_check(train_ctx *c) {
    const int T = args.max_tokens, D = c->cfg->cfg.dim;
    int32_t *tok = calloc((size_t)T, 4), *tgt = calloc((size_t)T, 4), *first = calloc((size_t)T, 4);
    float *h = calloc((size_t)(c->n + 1) * (size_t)T * (size_t)D, sizeof(float));
    float *g = calloc((size_t)(c->n + 1) * (size_t)T * (size_t)D, sizeof(float));
    check_out o = {0};
    int rc = !tok || !tgt || !first || !h || !g ? FU_ERR_NOMEM : FU_OK;
    int rows = 0, count = 0;
    for (int i = 0; i < c->data.n && i < args.batch_size && !rc; i++) {
        const trn_example *e = &c->data.ex[i];
        if (rows + e->n > T) break;
        for (int t = 0; t < e->n; t++, rows++) {
            tok[rows] = e->tokens[t], tgt[rows] = e->target[t], first[rows] = rows - t;
            count += e->target[t] >= 0;
        }
    }
    if (!rc && (!rows || !count)) rc = fu_errorf(FU_ERR_RANGE, "--check: the first examples have no target tokens");
    trn_loss loss = {0};
    const size_t hs = (size_t)T * (size_t)D;
    for (int s = 0; s < c->n && !rc; s++) {
        trn_batch b = {rows, tok, s ? h + (size_t)s * hs : NULL, first, tgt, 1.0f / (float)count, (uint64_t)args.seed};
        rc = trn_forward(c->sp[s].t, 0, &b, h + (size_t)(s + 1) * hs, &loss);
    }
    for (int s = c->n - 1; s >= 0 && !rc; s--)
        rc = trn_backward(c->sp[s].t, 0, g + (size_t)(s + 1) * hs, s ? g + (size_t)s * hs : NULL);
    float lv = (float)(loss.sum / (double)count);
    char name[64];
    if (!rc) rc = check_add(&o, "loss", &lv, 1, 1);
    for (int s = 1; s < c->n && !rc; s++) {
        snprintf(name, sizeof name, "input_grad.%d", c->sp[s].m->first);
        rc = check_add(&o, name, g + (size_t)s * hs, rows, D);
    }
    lora_adapter *gr[TRAIN_MAX_SPANS] = {0};
    for (int s = 0; s < c->n && !rc; s++) rc = check_grads(&c->sp[s], &gr[s]);
    for (int s = 0; s < c->n && !rc; s++) rc = lora_foreach(gr[s], check_matrix, &o);
    for (size_t i = 0; i < o.n; i++) o.t[i].shape = o.shape[i];
    if (!rc) rc = st_write(args.check, o.t, o.n);
    for (size_t i = 0; i < o.n; i++) free((void *)o.t[i].name);
    for (int s = 0; s < c->n; s++) lora_free(gr[s]);
    free(o.t), free(o.shape), free(tok), free(tgt), free(first), free(h), free(g);
    return rc;
}

/* ---- training --------------------------------------------------------------------------- */

/* The whole adapter, assembled from the stages' states (PEFT's order), written to --out. */
static int save_adapter(train_ctx *c, trn_run *r) {
    if (mkdir(args.out, 0755) != 0 && errno != EEXIST)
        return fu_errorf(FU_ERR_IO, "cannot create %s: %s", args.out, strerror(errno));
    lora_adapter *whole = NULL;
    int rc = lora_new(&c->lora, &c->cfg->cfg, 0, c->n_layers, 0, &whole);
    if (!rc && args.adapter) {
        lora_adapter *file = NULL; /* the file's config (rank, targets) is the run's */
        if (!(rc = lora_load(args.adapter, &c->cfg->cfg, 0, 1, 4096, &file))) {
            lora_free(whole);
            whole = NULL;
            rc = lora_new(&file->cfg, &c->cfg->cfg, 0, c->n_layers, 0, &whole);
        }
        lora_free(file);
    }
    if (!rc) rc = trn_run_params(r, whole->data, NULL, NULL, whole->n_floats);
    if (!rc) {
        whole->qk_interleaved = false; /* the states are in PEFT's order */
        rc = lora_save(whole, args.out);
    }
    lora_free(whole);
    return rc;
}

static void print_step(const trn_step_result *r, double seconds) {
    printf("{\"step\": %lld, \"loss\": %.6f, \"accuracy\": %.4f, \"lr\": %.6g, \"grad_norm\": %.6g, \"tokens\": %lld, "
           "\"micro_batches\": %d, \"seconds\": %.3f}\n",
           (long long)r->step, r->loss, r->accuracy, r->lr, r->grad_norm, (long long)r->n_tokens, r->micro_batches,
           seconds);
    fflush(stdout);
}

static int run_train(train_ctx *c) {
    const int n = c->data.n, bs = args.batch_size < n ? args.batch_size : n;
    const int per_epoch = (n + bs - 1) / bs, steps = args.steps ? args.steps : per_epoch * args.epochs;
    trn_run_options ro = {
        .max_tokens = args.max_tokens,
        .pipeline = args.pipeline,
        .dim = c->cfg->cfg.dim,
        .clip = (float)args.clip,
        .adamw = {(float)args.beta1, (float)args.beta2, (float)args.adam_eps, (float)args.weight_decay},
        .sched = {(float)args.lr, args.warmup, steps, (trn_decay)args.schedule},
        .seed = (uint64_t)args.seed,
        .replace = c->n_spares ? hop_replace : NULL,
        .replace_arg = c,
        .snapshot_every = args.snapshot_every,
        .max_replacements = c->n_spares,
    };
    trn_run *r = NULL;
    int rc = trn_run_new(c->stages, c->n, &ro, &r);
    for (int s = 0; s < steps && !rc; s++) {
        const int at = s % per_epoch * bs, k = n - at < bs ? n - at : bs;
        trn_step_result res;
        const double t0 = fu_now_s();
        if (!(rc = trn_run_step(r, c->data.ex + at, k, &res))) print_step(&res, fu_now_s() - t0);
    }
    if (!rc && args.out) rc = save_adapter(c, r);
    trn_run_free(r);
    return rc;
}

int main(int argc, char **argv) {
    int rc = fu_opt_main(&train_spec, argc, argv, NULL);
    if (rc >= 0) return rc;
    if (!args.model || !args.data) return fu_opt_fail(&train_spec, "--model and --data are required");
    train_ctx c = {0};
    rc = ctx_open(&c);
    if (!rc && args.check && args.hops.n) rc = fu_errorf(FU_ERR_INVALID, "--check runs in this process only (--spans)");
    if (!rc) rc = args.check ? run_check(&c) : run_train(&c);
    if (rc) fprintf(stderr, "fusion-train: %s\n", fu_last_error());
    ctx_free(&c);
    fu_opt_free(train_options);
    return rc ? 1 : 0;
}
