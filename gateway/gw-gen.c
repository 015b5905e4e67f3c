/* gw-gen.c -- generation jobs: a worker pool runs each choice through a chain session and formats the results. */
#include "gw-gen.h"

#include <fcntl.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "chain.h"
#include "clock.h"
#include "gw-pace.h"
#include "gw-swarm.h"
#include "gw-tools.h"
#include "log.h"
#include "rpc-base.h"
#include "sampler.h"
#include "status.h"

/* ---- types ---------------------------------------------------------------------------- */

typedef struct gw_choice {
    int index;         /* in the response */
    int prompt;        /* which prompt */
    int n_gen;         /* tokens generated (EOG included) */
    const char *finish;
    fu_buf text;       /* non-streaming: the whole text */
    json_t *lp;        /* non-streaming logprobs: chat array / completions object */
    size_t text_off;   /* completions text_offset of the next token */
    gw_tool_stream tools; /* streaming chat with tools: calls split from the content */
} gw_choice;

typedef struct gw_task {
    gw_job *job;
    int choice;
} gw_task;

struct gw_engine {
    const gw_config *cfg;
    const gw_model *model;
    gw_metrics *metrics;
    chain_client *chain;
    chain_hop hops[GW_MAX_HOPS];
    int n_hops;
    gw_swarm *swarm;    /* routed mode (cfg->shards); NULL: the static chain above */
    gw_pace *pace;      /* routed mode: step deadlines from the members' measured step times */
    pthread_t *threads;
    int n_threads;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    gw_task *q; /* ring */
    int q_head, q_len, q_cap;
    int idle;
    bool stopping;
    atomic_uint_fast64_t next_id;
    pthread_mutex_t gm_mu;      /* builds gm_vocab once */
    gm_vocab *gm_vocab;         /* the model's tokens for grammar masks; NULL until a grammar is used */
};

struct gw_job {
    gw_engine *e;
    gw_request req;
    char id[48];
    long long created;          /* unix seconds */
    double t_arrival;           /* monotonic seconds */
    uint64_t seed;              /* request seed, or a random one */
    bool tools_on;              /* chat with tools: calls are parsed out of the output */
    uint64_t call_salt;         /* random: tool call ids */
    gw_lora *lora;              /* the sessions' adapter (a reference), NULL: the base model */
    pthread_mutex_t mu;         /* everything below the prep fields */
    int refs;
    /* prepared once, by the first worker (prep_mu) */
    pthread_mutex_t prep_mu;
    bool prepared;
    bool prep_failed;
    int n_prompts;
    int32_t **pids;             /* per prompt */
    size_t *pn;
    int max_tokens;
    /* choices */
    gw_choice *choices;
    int n_choices, n_done;
    atomic_bool cancelled;
    /* response state (mu) */
    gw_job_phase phase;
    gw_error err;
    fu_buf out;                 /* streaming: SSE bytes not yet taken */
    bool finished;
    char *body;
    gw_wake_fn wake;
    void *wake_arg;
    int64_t prompt_tokens, completion_tokens;
    double t_first;             /* monotonic seconds of the first token of any choice; 0: none yet */
};

/* ---- job bookkeeping ---------------------------------------------------------------------- */

void gw_job_lock(gw_job *j) { pthread_mutex_lock(&j->mu); }

void gw_job_summarize(gw_job *j, gw_job_summary *out) {
    pthread_mutex_lock(&j->mu);
    *out = (gw_job_summary){j->id, j->req.model ? j->req.model : "", j->prompt_tokens, j->completion_tokens,
                            j->t_first > 0 ? j->t_first - j->t_arrival : -1};
    pthread_mutex_unlock(&j->mu);
}
void gw_job_unlock(gw_job *j) { pthread_mutex_unlock(&j->mu); }
void gw_job_set_wake(gw_job *j, gw_wake_fn fn, void *arg) {
    j->wake = fn;
    j->wake_arg = arg;
}
gw_job_phase gw_job_phase_get(const gw_job *j) { return j->phase; }
bool gw_job_is_stream(const gw_job *j) { return j->req.stream; }
const gw_error *gw_job_error(const gw_job *j) { return &j->err; }
const char *gw_job_body(const gw_job *j) { return j->body; }
bool gw_job_finished(const gw_job *j) { return j->finished && j->out.len == 0; }
bool gw_job_cancelled(const gw_job *j) { return atomic_load(&j->cancelled); }

size_t gw_job_take(gw_job *j, char *buf, size_t max) {
    size_t n = j->out.len < max ? j->out.len : max;
    if (n) {
        memcpy(buf, j->out.data, n);
        fu_buf_consume(&j->out, n);
    }
    return n;
}

void gw_job_cancel(gw_job *j) { atomic_store(&j->cancelled, true); }

static void gw_job_wake_locked(gw_job *j) {
    if (j->wake) j->wake(j->wake_arg);
}

static void gw_job_free(gw_job *j) {
    for (int i = 0; i < j->n_choices; i++) {
        fu_buf_free(&j->choices[i].text);
        json_decref(j->choices[i].lp);
        gw_tool_stream_free(&j->choices[i].tools);
    }
    free(j->choices);
    if (j->pids)
        for (int i = 0; i < j->n_prompts; i++) free(j->pids[i]);
    free(j->pids);
    free(j->pn);
    fu_buf_free(&j->out);
    free(j->body);
    gw_request_free(&j->req);
    if (j->lora) gw_lora_put(j->e->model->loras, j->lora);
    pthread_mutex_destroy(&j->mu);
    pthread_mutex_destroy(&j->prep_mu);
    free(j);
}

void gw_job_set_lora(gw_job *j, gw_lora *l) { j->lora = l; }

chain_client *gw_engine_chain(gw_engine *e) { return e->chain; }

void gw_job_release(gw_job *j) {
    if (!j) return;
    pthread_mutex_lock(&j->mu);
    int left = --j->refs;
    pthread_mutex_unlock(&j->mu);
    if (left == 0) gw_job_free(j);
}

static uint64_t random_seed(void) {
    uint64_t s = 0;
    int fd = open("/dev/urandom", O_RDONLY | O_CLOEXEC);
    if (fd >= 0) {
        if (read(fd, &s, sizeof s) != (ssize_t)sizeof s) s = 0;
        close(fd);
    }
    return s ^ (uint64_t)(fu_now_s() * 1e9);
}

int gw_job_new(gw_engine *e, gw_request *req, gw_job **out) {
    *out = NULL;
    gw_job *j = calloc(1, sizeof *j);
    if (!j) return fu_errorf(FU_ERR_NOMEM, "job");
    j->e = e;
    j->req = *req;
    memset(req, 0, sizeof *req);
    pthread_mutex_init(&j->mu, NULL);
    pthread_mutex_init(&j->prep_mu, NULL);
    j->refs = 1;
    uint64_t id = atomic_fetch_add(&e->next_id, 1);
    snprintf(j->id, sizeof j->id, "%s-%llx%06llu", j->req.kind == GW_KIND_CHAT ? "chatcmpl" : "cmpl",
             (unsigned long long)time(NULL), (unsigned long long)id);
    j->created = (long long)time(NULL);
    j->t_arrival = fu_now_s();
    j->seed = j->req.has_seed ? j->req.seed : random_seed();
    j->tools_on = j->req.kind == GW_KIND_CHAT && gw_tools_active(j->req.tools, j->req.tool_choice);
    j->call_salt = random_seed();
    int n_prompts = j->req.kind == GW_KIND_CHAT ? 1 : j->req.n_prompts;
    j->n_prompts = n_prompts;
    j->n_choices = n_prompts * j->req.n;
    j->choices = calloc((size_t)j->n_choices, sizeof *j->choices);
    j->pids = calloc((size_t)n_prompts, sizeof *j->pids);
    j->pn = calloc((size_t)n_prompts, sizeof *j->pn);
    if (!j->choices || !j->pids || !j->pn) {
        gw_job_free(j);
        return fu_errorf(FU_ERR_NOMEM, "job");
    }
    for (int i = 0; i < j->n_choices; i++) {
        j->choices[i].index = i;
        j->choices[i].prompt = i / j->req.n;
        gw_tool_stream_init(&j->choices[i].tools, j->e->model->tool_format, j->call_salt + (uint64_t)i * 0x9E3779B97F4A7C15ull);
    }
    *out = j;
    return FU_OK;
}

/* ---- preparation: template, tokens, context ------------------------------------------------- */

/* Fails the job before any response (job unlocked). */
static void gw_job_fail(gw_job *j, const gw_error *err) {
    pthread_mutex_lock(&j->mu);
    if (j->phase == GW_JOB_PENDING) {
        j->err = *err;
        j->phase = GW_JOB_FAILED;
        gw_job_wake_locked(j);
    }
    pthread_mutex_unlock(&j->mu);
}

/* gw_render_chat that also gives the text's data ranges (spans NULL: not wanted). */
static int gw_render_chat_spans(const gw_model *m, gw_request *r, char **out, size_t *len, tpl_span **spans,
                                size_t *n_spans, gw_error *err) {
    *out = NULL;
    if (!m->tpl)
        return gw_error_set(err, 400, "messages", NULL, "the model has no chat template: use /v1/completions");
    if (gw_tools_prepare_chat(r->messages, r->tools, m->tool_format, tok_chat_template(m->tok), err)) return err->http;
    if (tpl_apply_chat_spans(m->tpl, r->messages, r->tools, 1, tok_bos_str(m->tok), tok_eos_str(m->tok), NULL, out,
                             len, spans, n_spans))
        return gw_error_set(err, 400, "messages", NULL, "chat template: %s", fu_last_error());
    return 0;
}

int gw_render_chat(const gw_model *m, gw_request *r, char **out, gw_error *err) {
    return gw_render_chat_spans(m, r, out, NULL, NULL, NULL, err);
}

/* Tokenizes a rendered chat: the template's markers are special tokens, while
 * markers written inside the messages (the data ranges) stay plain text. */
static int gw_encode_chat(const gw_model *m, gw_request *r, int32_t **ids, size_t *n, gw_error *err) {
    char *text = NULL;
    size_t len = 0, n_spans = 0;
    tpl_span *spans = NULL;
    if (gw_render_chat_spans(m, r, &text, &len, &spans, &n_spans, err)) return err->http;
    tok_span *plain = n_spans ? malloc(n_spans * sizeof *plain) : NULL;
    int rc = n_spans && !plain ? fu_errorf(FU_ERR_NOMEM, "out of memory") : FU_OK;
    for (size_t i = 0; i < n_spans && plain; i++) plain[i] = (tok_span){spans[i].start, spans[i].end};
    if (!rc) rc = tok_encode_spans(m->tok, text, len, false, plain, n_spans, ids, n);
    free(plain);
    free(spans);
    free(text);
    if (rc) return gw_error_set(err, 400, "messages", NULL, "tokenizer: %s", fu_last_error());
    return 0;
}

/* The request's positions -- (prompt + max_tokens) x choices over its prompts, total_prompt
 * prompt tokens in all -- against --max-request-tokens: 400 request_too_large over it. */
static int gw_job_check_budget(const gw_job *j, int64_t total_prompt, int n_prompts, gw_error *err) {
    const int64_t limit = j->e->cfg->limits.max_request_tokens, n = j->req.n > 0 ? j->req.n : 1;
    const int64_t need = (total_prompt + (int64_t)j->max_tokens * n_prompts) * n;
    if (limit <= 0 || need <= limit) return 0;
    return gw_error_set(err, 400, NULL, "request_too_large",
                        "the request needs %lld positions computed ((%lld prompt tokens + %d max_tokens per prompt) "
                        "x %lld choices), over this server's limit of %lld; reduce the prompt, max_tokens or n",
                        (long long)need, (long long)total_prompt, j->max_tokens, (long long)n, (long long)limit);
}

static int gw_job_prepare_locked(gw_job *j, gw_error *err) {
    const gw_model *m = j->e->model;
    gw_request *r = &j->req;
    int n_prompts = r->kind == GW_KIND_CHAT ? 1 : r->n_prompts;
    const char *param = r->kind == GW_KIND_CHAT ? "messages" : "prompt";
    for (int p = 0; p < n_prompts; p++) {
        if (r->kind == GW_KIND_CHAT) {
            if (gw_encode_chat(m, r, &j->pids[p], &j->pn[p], err)) return err->http;
        } else if (r->prompts[p].ids) {
            j->pids[p] = malloc(r->prompts[p].n_ids * sizeof(int32_t));
            if (!j->pids[p]) return gw_error_set(err, 500, NULL, NULL, "out of memory");
            memcpy(j->pids[p], r->prompts[p].ids, r->prompts[p].n_ids * sizeof(int32_t));
            j->pn[p] = r->prompts[p].n_ids;
        } else { /* a raw prompt is the caller's own text: special tokens in it are parsed */
            int rc = tok_encode(m->tok, r->prompts[p].text, r->prompts[p].text_len, true, true, &j->pids[p],
                                &j->pn[p]);
            if (rc) return gw_error_set(err, 400, "prompt", NULL, "tokenizer: %s", fu_last_error());
        }
        if (j->pn[p] == 0) return gw_error_set(err, 400, param, "invalid_value", "the prompt is empty");
    }
    /* the context: prompt + max_tokens must fit (OpenAI's context_length_exceeded) */
    size_t longest = 0;
    for (int p = 0; p < n_prompts; p++)
        if (j->pn[p] > longest) longest = j->pn[p];
    int64_t max_tokens = r->max_tokens;
    if (max_tokens < 0) {
        max_tokens = (int64_t)m->ctx - (int64_t)longest;
        if (max_tokens > j->e->cfg->default_max_tokens) max_tokens = j->e->cfg->default_max_tokens;
        if (max_tokens < 1) max_tokens = 1;
    }
    if ((int64_t)longest + max_tokens > m->ctx) {
        const char *what = r->kind == GW_KIND_CHAT ? "messages" : "prompt";
        return gw_error_set(err, 400, param, "context_length_exceeded",
                            "This model's maximum context length is %d tokens. However, you requested %lld tokens "
                            "(%zu in the %s, %lld in the completion). Please reduce the length of the %s or "
                            "completion.",
                            m->ctx, (long long)((int64_t)longest + max_tokens), longest, what,
                            (long long)max_tokens, what);
    }
    j->max_tokens = (int)max_tokens;
    if (j->tools_on && !r->grammar && gw_tools_grammar(r->tools, r->tool_choice, m->tool_format, &r->grammar, err))
        return err->http;
    int64_t total = 0;
    for (int p = 0; p < n_prompts; p++) total += (int64_t)j->pn[p];
    if (gw_job_check_budget(j, total, n_prompts, err)) return err->http;
    pthread_mutex_lock(&j->mu);
    j->prompt_tokens = total;
    pthread_mutex_unlock(&j->mu);
    return 0;
}

/* Reports an error of one choice (job unlocked): before any response it fails the
 * job (and cancels its other choices); in a running stream it becomes an error event. */
static void gw_job_report_error(gw_job *j, const gw_error *err) {
    gw_error pub = *err; /* what the client sees: no internal addresses (the log keeps them) */
    gw_error_public(&pub, j->id);
    pthread_mutex_lock(&j->mu);
    if (j->phase == GW_JOB_PENDING) {
        j->err = pub;
        j->phase = GW_JOB_FAILED;
        atomic_store(&j->cancelled, true);
        gw_job_wake_locked(j);
    } else if (j->phase == GW_JOB_STREAMING) {
        json_t *o = gw_error_object(&pub);
        if (o && gw_sse_event(&j->out, o) == FU_OK) gw_job_wake_locked(j);
        json_decref(o);
    }
    pthread_mutex_unlock(&j->mu);
}

/* Prepares the job once; returns false if it failed (now or earlier). */
static bool gw_job_prepare(gw_job *j) {
    pthread_mutex_lock(&j->prep_mu);
    if (!j->prepared) {
        gw_error err = {0};
        if (gw_job_prepare_locked(j, &err)) {
            j->prep_failed = true;
            gw_job_fail(j, &err);
        }
        j->prepared = true;
    }
    bool ok = !j->prep_failed;
    pthread_mutex_unlock(&j->prep_mu);
    return ok;
}

/* ---- JSON pieces -------------------------------------------------------------------------------- */

/* The display string of a token (new reference; NULL on allocation failure). */
static json_t *gw_token_json(const gw_job *j, int32_t id) {
    if (j->req.tokens_as_ids) {
        char buf[32];
        snprintf(buf, sizeof buf, "token_id:%d", (int)id);
        return json_string(buf);
    }
    const char *b = NULL;
    size_t len = 0;
    if (tok_token_piece(j->e->model->tok, id, &b, &len)) return json_string("");
    return gw_json_string_lossy(b, len);
}

/* The bytes of a token as an array of integers, empty for a token without text (new
 * reference; NULL on allocation failure). */
static json_t *gw_token_bytes(const gw_job *j, int32_t id) {
    const char *b = NULL;
    size_t len = 0;
    json_t *a = json_array();
    if (!a || tok_token_piece(j->e->model->tok, id, &b, &len)) return a;
    for (size_t i = 0; i < len; i++)
        if (json_array_append_new(a, json_integer((unsigned char)b[i]))) {
            json_decref(a);
            return NULL;
        }
    return a;
}

/* Chat: one entry of logprobs.content (new reference; NULL on allocation failure). */
static json_t *gw_chat_lp_entry(const gw_job *j, int32_t tok, float lp, const int32_t *top_ids, const float *top_lp,
                                int k) {
    json_t *tops = json_array();
    for (int i = 0; tops && i < k; i++)
        if (json_array_append_new(tops, json_pack("{s:o, s:f, s:o}", "token", gw_token_json(j, top_ids[i]), "logprob",
                                                  (double)top_lp[i], "bytes", gw_token_bytes(j, top_ids[i])))) {
            json_decref(tops);
            tops = NULL;
        }
    return json_pack("{s:o, s:f, s:o, s:o}", "token", gw_token_json(j, tok), "logprob", (double)lp, "bytes",
                     gw_token_bytes(j, tok), "top_logprobs", tops);
}

/* Completions: a fresh {"tokens", "token_logprobs", "top_logprobs", "text_offset"} object
 * (new reference; NULL on allocation failure). */
static json_t *gw_cmpl_lp_new(void) {
    return json_pack("{s:[], s:[], s:[], s:[]}", "tokens", "token_logprobs", "top_logprobs", "text_offset");
}

/* Completions: the {token: logprob} map of a token's alternatives (new reference; NULL on
 * allocation failure). */
static json_t *gw_cmpl_top_map(const gw_job *j, const int32_t *top_ids, const float *top_lp, int k) {
    json_t *tops = json_object();
    for (int i = 0; tops && i < k; i++) {
        json_t *s = gw_token_json(j, top_ids[i]);
        int bad = !s || json_object_set_new(tops, json_string_value(s), json_real(top_lp[i]));
        json_decref(s);
        if (bad) {
            json_decref(tops);
            tops = NULL;
        }
    }
    return tops;
}

/* Appends one token to a completions logprobs object o; `has_lp` false gives nulls (the
 * first echoed token). Returns FU_OK or FU_ERR_NOMEM (o is then incomplete). */
static int gw_cmpl_lp_add(const gw_job *j, json_t *o, int32_t tok, bool has_lp, float lp, const int32_t *top_ids,
                          const float *top_lp, int k, size_t offset) {
    int bad = json_array_append_new(json_object_get(o, "tokens"), gw_token_json(j, tok));
    bad |= json_array_append_new(json_object_get(o, "token_logprobs"), has_lp ? json_real(lp) : json_null());
    bad |= json_array_append_new(json_object_get(o, "top_logprobs"),
                                 has_lp ? gw_cmpl_top_map(j, top_ids, top_lp, k) : json_null());
    bad |= json_array_append_new(json_object_get(o, "text_offset"), json_integer((json_int_t)offset));
    return bad ? fu_errorf(FU_ERR_NOMEM, "logprobs") : FU_OK;
}

/* A streaming chunk with one choice; `delta_or_text` (the chat delta object or the
 * completions text) and `logprobs` (NULL: none) are stolen, even on failure. New
 * reference; NULL on allocation failure. */
static json_t *gw_chunk(const gw_job *j, int index, json_t *delta_or_text, json_t *logprobs, const char *finish) {
    bool chat = j->req.kind == GW_KIND_CHAT;
    json_t *ch = json_pack("{s:i, s:o, s:o, s:o}", "index", index, chat ? "delta" : "text", delta_or_text,
                           "logprobs", logprobs ? logprobs : json_null(), "finish_reason",
                           finish ? json_string(finish) : json_null());
    json_t *o = json_pack("{s:s, s:s, s:I, s:s, s:[o]}", "id", j->id, "object",
                          chat ? "chat.completion.chunk" : "text_completion", "created", (json_int_t)j->created,
                          "model", j->e->model->name, "choices", ch);
    if (o && j->req.include_usage && json_object_set_new(o, "usage", json_null())) {
        json_decref(o);
        return NULL;
    }
    return o;
}

/* The usage object (new reference; NULL on allocation failure). */
static json_t *gw_usage(const gw_job *j) {
    return json_pack("{s:I, s:I, s:I}", "prompt_tokens", (json_int_t)j->prompt_tokens, "completion_tokens",
                     (json_int_t)j->completion_tokens, "total_tokens",
                     (json_int_t)(j->prompt_tokens + j->completion_tokens));
}

/* Appends an SSE event to the job's output and wakes the HTTP side (job unlocked). Steals
 * obj; NULL (its construction failed) gives FU_ERR_NOMEM. Returns FU_OK or FU_ERR_NOMEM. */
static int gw_job_emit(gw_job *j, json_t *obj) {
    if (!obj) return fu_errorf(FU_ERR_NOMEM, "stream chunk");
    pthread_mutex_lock(&j->mu);
    int rc = gw_sse_event(&j->out, obj);
    if (!rc) gw_job_wake_locked(j);
    pthread_mutex_unlock(&j->mu);
    json_decref(obj);
    return rc;
}

/* ---- finishing ----------------------------------------------------------------------------------- */

/* Builds the non-streaming body (job locked). */
static void gw_job_build_body(gw_job *j) {
    bool chat = j->req.kind == GW_KIND_CHAT;
    json_t *choices = json_array();
    for (int i = 0; i < j->n_choices; i++) {
        gw_choice *c = &j->choices[i];
        json_t *ch = json_object();
        json_object_set_new(ch, "index", json_integer(i));
        json_t *text = NULL, *calls = NULL;
        const char *finish = c->finish ? c->finish : "length";
        if (j->tools_on && gw_tool_parse(j->e->model->tool_format, j->choices[i].tools.id_salt, c->text.data ? c->text.data : "",
                                         c->text.len, &calls, &text) > 0)
            finish = "tool_calls";
        if (!text) text = gw_json_string_lossy(c->text.data ? c->text.data : "", c->text.len);
        if (chat) {
            json_t *msg = json_pack("{s:s, s:o}", "role", "assistant", "content", text);
            if (calls) json_object_set_new(msg, "tool_calls", calls);
            json_object_set_new(ch, "message", msg);
        } else {
            json_object_set_new(ch, "text", text);
        }
        json_t *lp = json_null();
        if (c->lp) lp = chat ? json_pack("{s:O, s:n}", "content", c->lp, "refusal") : json_incref(c->lp);
        json_object_set_new(ch, "logprobs", lp);
        json_object_set_new(ch, "finish_reason", json_string(finish));
        json_array_append_new(choices, ch);
    }
    json_t *o = json_pack("{s:s, s:s, s:I, s:s, s:o, s:o, s:n}", "id", j->id, "object",
                          chat ? "chat.completion" : "text_completion", "created", (json_int_t)j->created, "model",
                          j->e->model->name, "choices", choices, "usage", gw_usage(j), "system_fingerprint");
    j->body = o ? json_dumps(o, JSON_COMPACT) : NULL;
    json_decref(o);
    if (!j->body) {
        gw_error_set(&j->err, 500, NULL, NULL, "out of memory building the response");
        j->phase = GW_JOB_FAILED;
    } else {
        j->phase = GW_JOB_DONE;
    }
}

/* Streaming, after the last choice (job locked): the usage chunk (include_usage), then
 * [DONE]. Out of memory, the stream ends short (logged: nothing else can be sent). */
static void gw_job_end_stream_locked(gw_job *j) {
    int rc = FU_OK;
    if (j->req.include_usage) {
        json_t *u = json_pack("{s:s, s:s, s:I, s:s, s:[], s:o}", "id", j->id, "object",
                              j->req.kind == GW_KIND_CHAT ? "chat.completion.chunk" : "text_completion", "created",
                              (json_int_t)j->created, "model", j->e->model->name, "choices", "usage", gw_usage(j));
        rc = u ? gw_sse_event(&j->out, u) : fu_errorf(FU_ERR_NOMEM, "usage chunk");
        json_decref(u);
    }
    if (!rc) rc = gw_sse_done(&j->out);
    if (rc) FU_LOG(FU_LOG_LEVEL_WARN, j->id, "ending the stream: %s", fu_last_error());
}

/* A job still without a response after its last choice (job locked): cancelled (499), an
 * empty stream (nothing was generated, e.g. max_tokens 0) or the non-streaming body. */
static void gw_job_settle_locked(gw_job *j) {
    if (atomic_load(&j->cancelled)) {
        gw_error_set(&j->err, 499, NULL, NULL, "the request was cancelled");
        j->phase = GW_JOB_FAILED;
    } else if (j->req.stream) {
        j->phase = GW_JOB_STREAMING;
        if (gw_sse_done(&j->out)) FU_LOG(FU_LOG_LEVEL_WARN, j->id, "ending the stream: %s", fu_last_error());
    } else {
        gw_job_build_body(j);
    }
}

/* Marks one choice done (job unlocked); the last one completes the job: metrics, then the
 * end of the stream or the response. */
static void gw_choice_done(gw_job *j, const gw_choice *c) {
    gw_engine *e = j->e;
    pthread_mutex_lock(&j->mu);
    j->completion_tokens += c->n_gen;
    if (++j->n_done == j->n_choices) {
        gw_metrics_tokens(e->metrics, j->phase == GW_JOB_FAILED ? 0 : j->prompt_tokens, j->completion_tokens);
        gw_metrics_e2e(e->metrics, fu_now_s() - j->t_arrival);
        gw_metrics_running(e->metrics, -1);
        if (e->swarm && j->phase != GW_JOB_FAILED)
            gw_swarm_note_request(e->swarm, (int)(j->prompt_tokens / j->n_choices),
                                  (int)(j->completion_tokens / j->n_choices));
        if (j->phase == GW_JOB_STREAMING) gw_job_end_stream_locked(j);
        else if (j->phase == GW_JOB_PENDING) gw_job_settle_locked(j);
        j->finished = true;
        gw_job_wake_locked(j);
    }
    pthread_mutex_unlock(&j->mu);
}

/* ---- output of one choice -------------------------------------------------------------------------- */

/* Streaming chat with tools: the text goes through the choice's tool stream; content
 * and tool_calls deltas go out as chunks, and the finish says "tool_calls" when
 * the model called any. Steals lp_chunk. Returns FU_OK or FU_ERR_NOMEM. */
static int gw_choice_output_tools(gw_job *j, gw_choice *c, const char *text, size_t len, json_t *lp_chunk,
                                  const char *finish) {
    fu_buf content = {0};
    json_t *deltas = json_array();
    int rc = deltas ? gw_tool_stream_feed(&c->tools, text ? text : "", len, &content, deltas)
                    : fu_errorf(FU_ERR_NOMEM, "tool calls");
    if (!rc && finish) rc = gw_tool_stream_flush(&c->tools, &content, deltas);
    if (!rc && (content.len || lp_chunk)) {
        json_t *d = json_pack("{s:o}", "content", gw_json_string_lossy(content.data ? content.data : "", content.len));
        rc = gw_job_emit(j, gw_chunk(j, c->index, d, lp_chunk, NULL));
        lp_chunk = NULL;
    }
    for (size_t i = 0; !rc && i < json_array_size(deltas); i++)
        rc = gw_job_emit(j, gw_chunk(j, c->index, json_pack("{s:[O]}", "tool_calls", json_array_get(deltas, i)),
                                     NULL, NULL));
    if (!rc && finish)
        rc = gw_job_emit(j, gw_chunk(j, c->index, json_object(), NULL, c->tools.n_calls ? "tool_calls" : finish));
    json_decref(lp_chunk);
    json_decref(deltas);
    fu_buf_free(&content);
    return rc;
}

/* Emits text and the streamed logprobs lp_chunk (stolen; NULL: none) for a choice:
 * streaming sends a chunk (finish: its finish reason, NULL: none), otherwise the text
 * accumulates in c->text. Returns FU_OK or FU_ERR_NOMEM. */
static int gw_choice_output(gw_job *j, gw_choice *c, const char *text, size_t len, json_t *lp_chunk,
                            const char *finish) {
    if (!j->req.stream) {
        json_decref(lp_chunk);
        return fu_buf_append(&c->text, text, len);
    }
    if (j->tools_on) return gw_choice_output_tools(j, c, text, len, lp_chunk, finish);
    if (!len && !lp_chunk && !finish) return FU_OK;
    bool chat = j->req.kind == GW_KIND_CHAT, bare = chat && !len && finish; /* chat's last delta: {} */
    json_t *payload = bare ? json_object() : gw_json_string_lossy(text ? text : "", len);
    if (chat && !bare) payload = json_pack("{s:o}", "content", payload);
    return gw_job_emit(j, gw_chunk(j, c->index, payload, lp_chunk, finish));
}

/* ---- one choice ------------------------------------------------------------------------------------ */

/* A shard's message without the "shard HOST:PORT: ", "next hop HOST:PORT: " and code prefixes
 * that chain errors carry (clients are not told internal addresses). */
static const char *gw_shard_detail(const char *msg) {
    static const char *const prefixes[] = {"shard ", "next hop "};
    for (bool again = true; again;) {
        again = false;
        for (size_t i = 0; i < sizeof prefixes / sizeof prefixes[0]; i++) {
            const char *colon = strstr(msg, ": ");
            if (!strncmp(msg, prefixes[i], strlen(prefixes[i])) && colon) msg = colon + 2, again = true;
        }
        const char *code = rpc_code_str(RPC_RESOURCE_EXHAUSTED); /* chain_fail's code name */
        if (!strncmp(msg, code, strlen(code)) && !strncmp(msg + strlen(code), ": ", 2))
            msg += strlen(code) + 2, again = true;
    }
    return msg;
}

/* Maps a chain failure to an HTTP error. */
static void gw_chain_error(gw_error *err, int rc) {
    if (rc == FU_ERR_EXHAUSTED)
        gw_error_set(err, 503, NULL, "overloaded", "the shard servers are at capacity, retry later: %s",
                     fu_last_error());
    else
        gw_error_set(err, 503, NULL, "shard_unavailable", "generation failed: %s: %s", fu_status_str(rc),
                     fu_last_error());
}

/* Maps a failure of a step (the session was open) to an HTTP error: a request too big for
 * the shards' limits is the client's 400 (with the shard's figures, without its address). */
static void gw_step_error(gw_error *err, int rc) {
    if (rc == FU_ERR_EXHAUSTED)
        gw_error_set(err, 400, NULL, "request_too_large", "the request exceeds a shard server's limits: %s",
                     gw_shard_detail(fu_last_error()));
    else
        gw_chain_error(err, rc);
}

/* Failovers one choice may make (each a dead hop, a failed open or a failed replay). */
#define GW_MAX_FAILOVERS 3

/* Whether a chain failure may be cured by another path (the request itself is fine). */
static bool gw_retryable(int rc) {
    return rc != FU_ERR_INVALID && rc != FU_ERR_NOMEM && rc != FU_ERR_AUTH && rc != FU_ERR_RANGE &&
           rc != FU_ERR_UNSUPPORTED && rc != FU_ERR_CANCELLED;
}

/* Whether a chain failure says a hop is dead or hung (it is retired), rather than busy or
 * full (FU_ERR_EXHAUSTED: another path is tried, the member stays). */
static bool gw_hop_dead(int rc) {
    return rc != FU_ERR_EXHAUSTED && gw_retryable(rc);
}

/* One choice while a worker runs it, through the stages of gw_run_choice: prepare ->
 * open -> echo -> generate (step, decode, emit; then finish) -> close. A stage returns
 * FU_OK or a failure status with `err` filled; a stage that ends the choice without a
 * failure (finished, cancelled, the job failed elsewhere) clears `live`. Owned by the
 * worker thread; everything here is freed by gw_run_close. */
typedef struct gw_run {
    gw_job *j;
    gw_choice *c;
    int ci;                 /* the choice's index in the job */
    bool live;              /* false: no further stage runs (gw_run_end) */
    char sid[96];           /* session id: "<job id>-<choice>" */
    const int32_t *prompt;  /* (n_prompt) borrowed from the job */
    size_t n_prompt;
    int request_len;        /* prompt + max_tokens: what a routed path must hold */
    int max_length;         /* positions the sessions are opened for */
    int32_t *hist;          /* (max_length) prompt + sampled tokens: replayed on failover */
    int n_hist;
    int n_in;               /* the next step's input: hist[n_hist - n_in, n_hist) */
    int step;               /* steps done */
    int failovers;
    gw_lease lease;         /* routed mode: the path held */
    chain_session *s;
    int64_t wait_ms;        /* the step in flight: its measured deadline (gw-pace.h) */
    int64_t next_check_ms;  /* when its hops are probed next (alive: waiting goes on) */
    int64_t cap_ms;         /* when it is given up even though its hops answer */
    int silent_hop;         /* the hop that answered no probe (-1: none) */
    bool hop_retired;       /* ...or that the swarm retired while the step waited */
    bool capped;            /* the step was given up at cap_ms, its hops answering: busy, not dead */
    bool counted;           /* the choice counts in the open-sessions metric */
    chain_spec spec;
    bool echo_lp;           /* completions echo + logprobs: the prompt's logprobs come with step 0 */
    double t_prev;          /* when the previous step's token arrived */
    tok_decoder *dec;
    gw_stop stop;
    fu_buf piece;           /* text released for the current token */
    json_t *lp_chunk;       /* streaming: logprobs not yet sent */
    gm_matcher *gm;         /* constrained output: the grammar's state after the tokens so far */
    uint8_t *mask;          /* (mask_bytes) the tokens allowed at the next step */
    size_t mask_bytes;
    gw_error err;
} gw_run;

/* Ends the choice without a failure: no further stage runs; `finish` is its finish reason
 * (NULL: none, e.g. cancelled). Returns FU_OK. */
static int gw_run_end(gw_run *r, const char *finish) {
    r->c->finish = finish;
    r->live = false;
    return FU_OK;
}

/* Fills r->err with a 500 "<what>: <last error>". Returns rc (a failure status). */
static int gw_run_fail(gw_run *r, int rc, const char *what) {
    gw_error_set(&r->err, 500, NULL, NULL, "%s: %s", what, fu_last_error());
    return rc;
}

/* Gives up the current path after a failure described by msg (swarm): closes the session,
 * reports the failure (the swarm retires the dead hop) and releases the lease. */
static void gw_run_drop_path(gw_run *r, int rc, const char *msg) {
    gw_swarm *sw = r->j->e->swarm;
    chain_session_close(r->s);
    r->s = NULL;
    if (gw_hop_dead(rc)) gw_swarm_report_failure(sw, &r->lease, rc, msg);
    gw_swarm_release(sw, &r->lease);
}

/* Whether the job has run past --max-request-seconds. */
static bool gw_job_over_time(const gw_job *j) {
    int limit = j->e->cfg->max_request_seconds;
    return limit > 0 && fu_now_s() - j->t_arrival > limit;
}

/* Fails the choice with 408: the job ran past --max-request-seconds. Returns a failure status. */
static int gw_run_over_time(gw_run *r) {
    gw_error_set(&r->err, 408, NULL, "request_timeout",
                 "the request ran past this server's limit of %d s per request (--max-request-seconds)",
                 r->j->e->cfg->max_request_seconds);
    return fu_errorf(FU_ERR_CANCELLED, "%s", r->err.message);
}

/* How long a probe of a step's hops waits for each Echo. */
#define GW_PROBE_MS 1000

/* After this long a waiting step asks the swarm whether one of its hops was retired meanwhile. */
#define GW_RETIRED_CHECK_MS 200

/* The watch of a step in flight: cancels it when the job's client has gone; gives it up when the
 * swarm has retired one of its hops (r->silent_hop names it); once the step is past its
 * measured deadline, probes its hops: one that does not answer is hung or dead (given up, named
 * the same way), else the step is busy, not stuck, and waiting goes on for another deadline, up
 * to r->cap_ms. */
static int gw_run_watch(void *arg, int64_t waited_ms) {
    gw_run *r = arg;
    gw_swarm *sw = r->j->e->swarm;
    if (atomic_load(&r->j->cancelled) || gw_job_over_time(r->j)) return CHAIN_CANCEL;
    if (sw && waited_ms >= GW_RETIRED_CHECK_MS && (r->silent_hop = gw_swarm_lease_retired(sw, &r->lease)) >= 0) {
        r->hop_retired = true;
        return CHAIN_GIVE_UP;
    }
    if (waited_ms < r->next_check_ms) return CHAIN_WAIT;
    if (waited_ms >= r->cap_ms) {
        r->capped = true;
        return CHAIN_GIVE_UP;
    }
    r->silent_hop = chain_session_probe(r->s, GW_PROBE_MS);
    if (r->silent_hop >= 0) return CHAIN_GIVE_UP;
    FU_LOG(FU_LOG_LEVEL_INFO, r->sid, "a step is past its %lld ms deadline after %lld ms; its shards answer: waiting",
           (long long)r->wait_ms, (long long)waited_ms);
    r->next_check_ms = waited_ms + r->wait_ms;
    return CHAIN_WAIT;
}

/* Runs one step of n positions from `in` on the open session with `spec`. Routed, it waits
 * for the leased hops' measured deadline (gw-pace.h), then as long as they answer probes (up
 * to the step timeout, scaled by n), and records the step's timings. A hop that answers no
 * probe is named in the failure's message, so that it is the one retired. */
static int gw_run_timed_step(gw_run *r, const int32_t *in, int n, const chain_spec *spec, const chain_result **res) {
    gw_pace *pace = r->j->e->pace;
    const gw_config *cfg = r->j->e->cfg;
    r->wait_ms = pace ? gw_pace_deadline_ms(pace, r->lease.hops, r->lease.n_hops, n) : cfg->step_timeout_ms;
    r->next_check_ms = r->wait_ms;
    r->cap_ms = gw_pace_cap_ms(cfg->step_timeout_ms, n); /* the same bound as the deadline's */
    r->silent_hop = -1;
    r->hop_retired = r->capped = false;
    chain_spec sp = *spec;
    sp.timeout_ms = (int)(r->cap_ms + GW_PROBE_MS * (int64_t)GW_MAX_HOPS);
    const bool first = chain_session_len(r->s) == 0;
    int rc = chain_session_step(r->s, in, n, -1, &sp, res);
    if (!rc && pace) gw_pace_record(pace, r->lease.hops, r->lease.n_hops, n, *res);
    if (!rc && first) gw_metrics_prefix(r->j->e->metrics, n, (*res)->prefix_reused);
    const char *silent = rc && r->silent_hop >= 0 && r->silent_hop < r->lease.n_hops
                             ? r->lease.hops[r->silent_hop].address : NULL;
    if (silent && r->hop_retired)
        rc = fu_errorf(FU_ERR_NETWORK, "shard %s: retired while a step waited for it", silent);
    else if (silent)
        rc = fu_errorf(FU_ERR_NETWORK, "shard %s: no reply to a step within %lld ms, nor to a probe", silent,
                       (long long)r->wait_ms);
    else if (rc && r->capped)
        rc = fu_errorf(FU_ERR_EXHAUSTED, "the shard servers, though answering, did not finish a step of %d positions "
                       "within %lld ms", n, (long long)r->cap_ms);
    return rc;
}

/* Opens a chain session `id` on hops[0..n) into *out with the job's adapter,
 * sending the hops its slices first; a hop that answers it holds none (it
 * restarted) is sent them again and the open tried once more. */
static int gw_open_chain(gw_run *r, const chain_hop *hops, int n, const char *id, chain_session **out) {
    gw_engine *e = r->j->e;
    gw_lora *l = r->j->lora;
    int rc = l ? gw_lora_ensure(e->model->loras, e->chain, l, hops, n, false) : FU_OK;
    if (!rc)
        rc = chain_session_open_prefix(e->chain, hops, n, id, r->max_length, l ? l->shard_id : NULL, r->hist,
                                       r->n_hist, out);
    if (rc == FU_ERR_NOT_FOUND && l && !(rc = gw_lora_ensure(e->model->loras, e->chain, l, hops, n, true)))
        rc = chain_session_open_prefix(e->chain, hops, n, id, r->max_length, l->shard_id, r->hist, r->n_hist, out);
    return rc;
}

/* Opens a session on the leased path (swarm) into r->s and, when n_replay > 0, replays
 * hist[0..n_replay) as one prefill step without output, so that every hop's cache holds
 * those positions from 0. On failure r->s may be left open (gw_run_drop_path closes it). */
static int gw_run_open_path(gw_run *r, int n_replay) {
    char id[128];
    snprintf(id, sizeof id, "%s.%d", r->sid, r->failovers);
    int rc = gw_open_chain(r, r->lease.hops, r->lease.n_hops, id, &r->s);
    if (rc) return rc;
    chain_session_set_watch(r->s, gw_run_watch, r);
    if (n_replay == 0) return FU_OK;
    chain_spec none = {0};
    const chain_result *res = NULL;
    return gw_run_timed_step(r, r->hist, n_replay, &none, &res);
}

/* Opens the choice's chain session into r->s. Static chain: one try. Swarm: routes a
 * path (into r->lease) and opens it with hist[0..n_replay) replayed (gw_run_open_path);
 * a dead hop is retired and another path tried, each retry counting in r->failovers (at
 * most GW_MAX_FAILOVERS). On failure r->err is a 503 and nothing is held. */
static int gw_run_open_session(gw_run *r, int n_replay) {
    gw_engine *e = r->j->e;
    if (!e->swarm) {
        int rc = gw_open_chain(r, e->hops, e->n_hops, r->sid, &r->s);
        if (rc) gw_chain_error(&r->err, rc);
        else chain_session_set_watch(r->s, gw_run_watch, r);
        return rc;
    }
    for (;;) {
        int rc = gw_swarm_route_prefix(e->swarm, r->request_len, r->hist, r->n_hist, &r->lease, &r->err);
        if (rc) return rc;
        rc = gw_run_open_path(r, n_replay);
        if (!rc) return FU_OK;
        char msg[512];
        snprintf(msg, sizeof msg, "%s", fu_last_error());
        FU_LOG(FU_LOG_LEVEL_WARN, r->sid, "opening a session on a routed chain failed: %s", msg);
        gw_run_drop_path(r, rc, msg);
        if (!gw_retryable(rc) || ++r->failovers > GW_MAX_FAILOVERS) {
            fu_errorf(rc, "%s", msg);
            gw_chain_error(&r->err, rc);
            return rc;
        }
    }
}

/* Runs the step's input hist[n_hist - n_in, n_hist) through the chain into *res. In a
 * swarm a retryable failure fails over: the dead path is dropped, a new one opened with
 * the history before the input replayed, and the step retried with the same spec (same
 * seed), at most GW_MAX_FAILOVERS times per choice. On failure r->err is a 503. */
static int gw_run_chain_step(gw_run *r, const chain_result **res) {
    gw_job *j = r->j;
    const int32_t *in = r->hist + r->n_hist - r->n_in;
    for (;;) {
        int rc = gw_run_timed_step(r, in, r->n_in, &r->spec, res);
        if (!rc) return FU_OK;
        if (!j->e->swarm || !gw_hop_dead(rc) || r->failovers >= GW_MAX_FAILOVERS || atomic_load(&j->cancelled)) {
            if (r->capped)
                gw_error_set(&r->err, 503, NULL, "overloaded", "the shard servers are too busy: %s", fu_last_error());
            else
                gw_step_error(&r->err, rc);
            FU_LOG(FU_LOG_LEVEL_WARN, r->sid, "step failed: %s", r->err.message);
            return rc;
        }
        char msg[512];
        snprintf(msg, sizeof msg, "%s", fu_last_error());
        r->failovers++;
        FU_LOG(FU_LOG_LEVEL_WARN, r->sid, "step failed (%s), failing over (%d of %d)", msg, r->failovers,
               GW_MAX_FAILOVERS);
        gw_run_drop_path(r, rc, msg);
        rc = gw_run_open_session(r, r->n_hist - r->n_in);
        if (rc) return rc;
    }
}

/* Enters the streaming phase of a streaming job still pending (job unlocked). Returns
 * false when the job has already failed (another choice's error). */
static bool gw_job_start_stream(gw_job *j) {
    pthread_mutex_lock(&j->mu);
    bool failed = j->phase == GW_JOB_FAILED;
    if (j->req.stream && j->phase == GW_JOB_PENDING) {
        j->phase = GW_JOB_STREAMING;
        gw_job_wake_locked(j);
    }
    pthread_mutex_unlock(&j->mu);
    return !failed;
}

/* Emits the text released for the current token (r->piece) with the pending logprobs,
 * when there is either, and empties both. */
static int gw_run_emit_piece(gw_run *r) {
    if (!r->piece.len && !r->lp_chunk) return FU_OK;
    int rc = gw_choice_output(r->j, r->c, r->piece.data, r->piece.len, r->lp_chunk, NULL);
    r->lp_chunk = NULL;
    r->piece.len = 0;
    return rc ? gw_run_fail(r, rc, "out of memory") : FU_OK;
}

/* Echo + logprobs: the prompt's text held in c->text goes out with its logprobs lp
 * (stolen; NULL: none): streaming as one chunk, otherwise lp becomes the choice's
 * logprobs and the text stays for the body. */
static int gw_run_release_echo(gw_run *r, json_t *lp) {
    gw_choice *c = r->c;
    if (!r->j->req.stream) {
        if (lp) {
            json_decref(c->lp);
            c->lp = lp;
        }
        return FU_OK;
    }
    int rc = gw_choice_output(r->j, c, c->text.data, c->text.len, lp, NULL);
    fu_buf_free(&c->text);
    return rc ? gw_run_fail(r, rc, "out of memory") : FU_OK;
}

/* Echo + logprobs, on the first step: the prompt tokens' logprobs, scored by the last shard
 * (row i - 1 holds token i's; the first token has none), go out with the prompt's text;
 * c->text_off moves past the prompt. */
static int gw_run_prompt_logprobs(gw_run *r, const chain_result *res) {
    const gw_job *j = r->j;
    int k = res->top_k;
    size_t off = 0;
    json_t *lp = gw_cmpl_lp_new();
    int rc = lp ? FU_OK : fu_errorf(FU_ERR_NOMEM, "logprobs");
    for (size_t i = 0; !rc && i < r->n_prompt; i++) {
        bool has = i > 0 && (int)i < res->n_out && res->tokens[i - 1] == r->prompt[i];
        const int32_t *ids = has && k ? res->top_ids + (i - 1) * (size_t)k : NULL;
        const float *lps = has && k ? res->top_logprobs + (i - 1) * (size_t)k : NULL;
        rc = gw_cmpl_lp_add(j, lp, r->prompt[i], has, has ? res->logprobs[i - 1] : 0.0f, ids, lps, has ? k : 0, off);
        const char *b;
        size_t len;
        if (!tok_token_piece(j->e->model->tok, r->prompt[i], &b, &len)) off += len;
    }
    if (rc) {
        json_decref(lp);
        return gw_run_fail(r, rc, "out of memory");
    }
    r->c->text_off = off;
    return gw_run_release_echo(r, lp);
}

/* Where the logprobs of a sampled token go: the choice's own (non-streaming), else the
 * pending chunk's, made on first use: its "content" array (chat) or the object itself
 * (completions). NULL on allocation failure. */
static json_t *gw_run_lp_dest(gw_run *r) {
    bool chat = r->j->req.kind == GW_KIND_CHAT;
    if (!r->j->req.stream) return r->c->lp;
    if (!r->lp_chunk) r->lp_chunk = chat ? json_pack("{s:[]}", "content") : gw_cmpl_lp_new();
    return chat ? json_object_get(r->lp_chunk, "content") : r->lp_chunk;
}

/* Adds the logprobs of the token sampled in row o of res (with its alternatives). */
static int gw_run_token_logprobs(gw_run *r, const chain_result *res, int o) {
    const gw_job *j = r->j;
    const int32_t *ti = res->top_ids ? res->top_ids + (size_t)o * res->top_k : NULL;
    const float *tl = res->top_logprobs ? res->top_logprobs + (size_t)o * res->top_k : NULL;
    int k = ti ? res->top_k : 0;
    int32_t tok = res->tokens[o];
    json_t *dest = gw_run_lp_dest(r);
    int rc = dest ? FU_OK : fu_errorf(FU_ERR_NOMEM, "logprobs");
    if (!rc && j->req.kind == GW_KIND_CHAT) {
        if (json_array_append_new(dest, gw_chat_lp_entry(j, tok, res->logprobs[o], ti, tl, k)))
            rc = fu_errorf(FU_ERR_NOMEM, "logprobs");
    } else if (!rc) {
        rc = gw_cmpl_lp_add(j, dest, tok, true, res->logprobs[o], ti, tl, k, r->c->text_off);
    }
    return rc ? gw_run_fail(r, rc, "out of memory") : FU_OK;
}

/* Decodes a sampled token and emits what the stop strings release, with the pending
 * logprobs; a stop string ends the choice with "stop". */
static int gw_run_emit_token(gw_run *r, int32_t tok) {
    const char *txt;
    size_t tl;
    int rc = tok_decoder_push(r->dec, tok, &txt, &tl);
    if (rc) return gw_run_fail(r, rc, "decoder");
    r->c->text_off += tl;
    r->piece.len = 0;
    rc = gw_stop_feed(&r->stop, txt, tl, &r->piece);
    if (rc) return gw_run_fail(r, rc, "out of memory");
    rc = gw_run_emit_piece(r);
    if (rc || !r->stop.matched) return rc;
    return gw_run_end(r, "stop");
}

/* Step latency: the time to the first token from the request's arrival, then between tokens. */
static void gw_run_step_metrics(gw_run *r) {
    double t = fu_now_s();
    if (r->step == 0) {
        gw_metrics_ttft(r->j->e->metrics, t - r->j->t_arrival);
        pthread_mutex_lock(&r->j->mu);
        if (r->j->t_first == 0) r->j->t_first = t;
        pthread_mutex_unlock(&r->j->mu);
    }
    else gw_metrics_itl(r->j->e->metrics, t - r->t_prev);
    r->t_prev = t;
}

/* ---- constrained output ----------------------------------------------------------------------- */

/* The grammar vocabulary of the engine's model, built on first use: every token's bytes
 * (special tokens never allowed: their text is not output), the end-of-generation ids allowed
 * where the grammar accepts. NULL (error set) when it cannot be built. */
static const gm_vocab *gw_engine_gm_vocab(gw_engine *e) {
    pthread_mutex_lock(&e->gm_mu);
    const gw_model *m = e->model;
    int n = m->vocab, nt = tok_vocab_size(m->tok);
    const char **toks = e->gm_vocab ? NULL : calloc((size_t)n, sizeof *toks);
    size_t *lens = e->gm_vocab ? NULL : calloc((size_t)n, sizeof *lens);
    for (int i = 0; toks && lens && i < n && i < nt; i++)
        if (tok_is_special(m->tok, i) || tok_token_piece(m->tok, i, &toks[i], &lens[i])) toks[i] = NULL;
    const int32_t *eog;
    int n_eog = (int)tok_eog_ids(m->tok, &eog);
    if (!e->gm_vocab && (!toks || !lens || gm_vocab_new(toks, lens, n, eog, n_eog, &e->gm_vocab)))
        fu_errorf(FU_ERR_NOMEM, "grammar vocabulary");
    free(toks);
    free(lens);
    const gm_vocab *v = e->gm_vocab;
    pthread_mutex_unlock(&e->gm_mu);
    return v;
}

/* Fails the choice over its grammar: 400 when a step forks past the matcher's bounds (a
 * grammar too ambiguous to follow is the request's), else 500. Returns rc. */
static int gw_run_grammar_fail(gw_run *r, int rc) {
    if (rc != FU_ERR_EXHAUSTED) return gw_run_fail(r, rc, "grammar");
    gw_error_set(&r->err, 400, NULL, "invalid_value", "the grammar cannot be followed: %s", fu_last_error());
    return rc;
}

/* Starts the choice's matcher at the grammar's start, with its mask buffer. */
static int gw_run_grammar_init(gw_run *r) {
    const gm_vocab *v = gw_engine_gm_vocab(r->j->e);
    int rc = v ? gm_matcher_new(r->j->req.grammar, v, &r->gm) : FU_ERR_NOMEM;
    r->mask_bytes = v ? gm_vocab_mask_bytes(v) : 0;
    if (!rc && !(r->mask = malloc(r->mask_bytes))) rc = FU_ERR_NOMEM;
    return rc ? gw_run_grammar_fail(r, rc) : FU_OK;
}

/* Sets the next step's allowed tokens from the grammar's state. A state that allows nothing
 * (the grammar is complete and the model has no end-of-generation token) ends the choice. */
static int gw_run_grammar_mask(gw_run *r) {
    int n = gm_matcher_mask(r->gm, r->mask, r->mask_bytes);
    if (n < 0) return gw_run_grammar_fail(r, n);
    if (n == 0) return gw_run_end(r, "stop");
    r->spec.sampling.allowed = r->mask;
    r->spec.sampling.n_allowed = r->mask_bytes;
    return FU_OK;
}

/* Stage 1: prepares the job (the first of its workers does) and the choice: its prompt,
 * session id, history and step spec. Ends the choice quietly when the job is cancelled
 * or failed to prepare (that failed the job), with "length" when there is nothing to
 * generate or echo. */
static int gw_run_prepare(gw_run *r) {
    gw_job *j = r->j;
    if (atomic_load(&j->cancelled) || !gw_job_prepare(j)) return gw_run_end(r, NULL);
    r->prompt = j->pids[r->c->prompt];
    r->n_prompt = j->pn[r->c->prompt];
    if (j->max_tokens == 0 && !j->req.echo) return gw_run_end(r, "length");
    snprintf(r->sid, sizeof r->sid, "%s-%d", j->id, r->ci);
    r->request_len = (int)r->n_prompt + j->max_tokens;
    /* hist holds the prompt and every sampled token; the sessions hold all but the last one */
    r->max_length = r->request_len;
    r->hist = malloc((size_t)r->max_length * sizeof *r->hist);
    if (!r->hist) return gw_run_fail(r, fu_errorf(FU_ERR_NOMEM, "token history"), "out of memory");
    memcpy(r->hist, r->prompt, r->n_prompt * sizeof *r->hist);
    r->n_hist = r->n_in = (int)r->n_prompt;
    r->echo_lp = j->req.kind != GW_KIND_CHAT && j->req.echo && j->req.logprobs;
    r->spec = (chain_spec){.sample = true, .sampling = j->req.sampling, .penalty_start = (int64_t)r->n_prompt,
                           .top_logprobs = j->req.logprobs ? j->req.top_logprobs : 0};
    return j->req.grammar ? gw_run_grammar_init(r) : FU_OK;
}

/* Stage 2: opens the chain session (counted in the metrics), moves a streaming job to its
 * streaming phase (ending quietly when another choice has failed the job), makes the
 * decoder, the stop matcher and the logprobs holder, and starts a streaming chat with
 * the role chunk. */
static int gw_run_open(gw_run *r) {
    gw_job *j = r->j;
    int rc = gw_run_open_session(r, 0);
    if (rc) {
        FU_LOG(FU_LOG_LEVEL_WARN, r->sid, "session open failed: %s", r->err.message);
        return rc;
    }
    r->counted = true;
    gw_metrics_sessions(j->e->metrics, 1);
    if (!gw_job_start_stream(j)) return gw_run_end(r, NULL);
    rc = tok_decoder_init(j->e->model->tok, true, &r->dec);
    if (!rc) rc = gw_stop_init(&r->stop, j->req.stop, j->req.n_stop);
    if (rc) return gw_run_fail(r, rc, "decoder");
    bool chat = j->req.kind == GW_KIND_CHAT;
    if (j->req.logprobs && !j->req.stream) {
        r->c->lp = chat ? json_array() : gw_cmpl_lp_new();
        if (!r->c->lp) return gw_run_fail(r, fu_errorf(FU_ERR_NOMEM, "logprobs"), "out of memory");
    }
    if (!j->req.stream || !chat) return FU_OK;
    json_t *d = json_pack("{s:s, s:s}", "role", "assistant", "content", "");
    rc = gw_job_emit(j, gw_chunk(j, r->c->index, d, NULL, NULL));
    return rc ? gw_run_fail(r, rc, "out of memory") : FU_OK;
}

/* Stage 3, completions with echo: the prompt's text goes first; with logprobs it waits
 * in c->text for the prompt's logprobs from the first step. With max_tokens 0 the choice
 * ends here with "length" (streaming: without a finish chunk). */
static int gw_run_echo(gw_run *r) {
    gw_job *j = r->j;
    gw_choice *c = r->c;
    if (j->req.kind == GW_KIND_CHAT || !j->req.echo) return FU_OK;
    const gw_prompt *p = &j->req.prompts[c->prompt];
    char *txt = p->text;
    size_t tl = p->text_len;
    int rc = txt ? FU_OK : tok_decode(j->e->model->tok, r->prompt, r->n_prompt, false, &txt, &tl);
    if (rc) return gw_run_fail(r, rc, "decoder");
    rc = r->echo_lp ? fu_buf_append(&c->text, txt, tl) : gw_choice_output(j, c, txt, tl, NULL, NULL);
    c->text_off = tl;
    if (txt != p->text) free(txt);
    if (rc) return gw_run_fail(r, rc, "out of memory");
    if (j->max_tokens > 0) return FU_OK;
    rc = r->echo_lp ? gw_run_release_echo(r, NULL) : FU_OK;
    return rc ? rc : gw_run_end(r, "length");
}

/* Stage 4, once per token: runs the step through the chain, then takes the sampled
 * token: latency metrics, the prompt's logprobs (first step of echo + logprobs), the
 * token's logprobs, then the end of generation ("stop") or the token's text. Ends
 * quietly when the job is cancelled. */
static int gw_run_step(gw_run *r) {
    gw_job *j = r->j;
    if (atomic_load(&j->cancelled)) return gw_run_end(r, NULL);
    if (gw_job_over_time(j)) return gw_run_over_time(r);
    if (r->gm) {
        int rc = gw_run_grammar_mask(r);
        if (rc || !r->live) return rc;
    }
    bool prompt_lp = r->echo_lp && r->step == 0;
    r->spec.all_positions = r->spec.score_inputs = prompt_lp;
    /* the seed of the step's last position, the one whose token is sampled (fusion.proto) */
    r->spec.sampling.seed = gw_step_seed(j->seed, r->ci, (int64_t)r->n_prompt + r->step);
    const chain_result *res = NULL;
    int rc = gw_run_chain_step(r, &res);
    if (rc && gw_job_over_time(j) && !atomic_load(&j->cancelled)) return gw_run_over_time(r);
    if (rc) return atomic_load(&j->cancelled) ? gw_run_end(r, NULL) : rc;
    gw_run_step_metrics(r);
    int o = res->n_out - 1;
    int32_t tok = res->tokens[o];
    if (r->gm && gm_matcher_accept_token(r->gm, tok)) return gw_run_fail(r, FU_ERR_INTERNAL, "grammar");
    r->c->n_gen++;
    r->step++;
    r->hist[r->n_hist++] = tok;
    r->n_in = 1;
    if (prompt_lp) rc = gw_run_prompt_logprobs(r, res);
    if (!rc && j->req.logprobs) rc = gw_run_token_logprobs(r, res, o);
    if (rc) return rc;
    if (!j->req.ignore_eos && tok_is_eog(j->e->model->tok, tok)) return gw_run_end(r, "stop");
    return gw_run_emit_token(r, tok);
}

/* Stage 5, a finished choice: the decoder's and the stop matcher's held-back text goes
 * out (unless a stop string matched), then, streaming, the chunk with the finish reason. */
static int gw_run_finish(gw_run *r) {
    r->piece.len = 0;
    if (!r->stop.matched) {
        const char *txt;
        size_t tl;
        int rc = tok_decoder_flush(r->dec, &txt, &tl);
        if (rc) return gw_run_fail(r, rc, "decoder");
        if (tl) rc = gw_stop_feed(&r->stop, txt, tl, &r->piece);
        if (!rc) rc = gw_stop_flush(&r->stop, &r->piece);
        if (rc) return gw_run_fail(r, rc, "out of memory");
    }
    int rc = gw_run_emit_piece(r);
    if (rc || !r->j->req.stream) return rc;
    rc = gw_choice_output(r->j, r->c, NULL, 0, NULL, r->c->finish);
    return rc ? gw_run_fail(r, rc, "out of memory") : FU_OK;
}

/* Stages 4 and 5: steps until max_tokens ("length"), the end of generation or a stop
 * string ("stop"), a cancel or a failure; a finished choice then finishes. */
static int gw_run_generate(gw_run *r) {
    r->c->finish = "length";
    int rc = FU_OK;
    while (!rc && r->live && r->step < r->j->max_tokens) rc = gw_run_step(r);
    if (rc || !r->c->finish) return rc;
    return gw_run_finish(r);
}

/* The last stage, always: a failure (rc) becomes an error of the job (before any
 * response it fails the job, in a stream it is an error event); the session, the lease
 * and the buffers are released and the choice is counted done. */
static void gw_run_close(gw_run *r, int rc) {
    gw_job *j = r->j;
    if (rc) {
        if (!r->err.http) gw_error_set(&r->err, 500, NULL, NULL, "generation failed: %s", fu_status_str(rc));
        r->c->finish = NULL;
        gw_job_report_error(j, &r->err);
    }
    json_decref(r->lp_chunk);
    fu_buf_free(&r->piece);
    gw_stop_free(&r->stop);
    tok_decoder_free(r->dec);
    chain_session_close(r->s);
    if (r->counted) gw_metrics_sessions(j->e->metrics, -1);
    if (j->e->swarm) gw_swarm_release(j->e->swarm, &r->lease);
    free(r->hist);
    gm_matcher_free(r->gm);
    free(r->mask);
    gw_choice_done(j, r->c);
}

/* Runs choice ci of job j on the calling worker thread, from preparation to done. */
static void gw_run_choice(gw_job *j, int ci) {
    gw_run r = {.j = j, .c = &j->choices[ci], .ci = ci, .live = true};
    int rc = gw_run_prepare(&r);
    if (!rc && r.live) rc = gw_run_open(&r);
    if (!rc && r.live) rc = gw_run_echo(&r);
    if (!rc && r.live) rc = gw_run_generate(&r);
    gw_run_close(&r, rc);
}

/* ---- the worker pool ---------------------------------------------------------------------------------- */

static void *gw_worker(void *arg) {
    gw_engine *e = arg;
    pthread_mutex_lock(&e->mu);
    for (;;) {
        e->idle++;
        while (e->q_len == 0 && !e->stopping) pthread_cond_wait(&e->cv, &e->mu);
        e->idle--;
        if (e->q_len == 0) break;
        gw_task t = e->q[e->q_head];
        e->q_head = (e->q_head + 1) % e->q_cap;
        e->q_len--;
        pthread_mutex_unlock(&e->mu);
        gw_metrics_queue_wait(e->metrics, fu_now_s() - t.job->t_arrival);
        gw_run_choice(t.job, t.choice);
        gw_job_release(t.job);
        pthread_mutex_lock(&e->mu);
    }
    pthread_mutex_unlock(&e->mu);
    return NULL;
}

int gw_job_submit(gw_job *j) {
    gw_engine *e = j->e;
    pthread_mutex_lock(&e->mu);
    /* room: idle workers take tasks at once; beyond them, max_queue may wait */
    int waiting_after = e->q_len + j->n_choices - e->idle;
    if (e->stopping || waiting_after > e->cfg->max_queue || e->q_len + j->n_choices > e->q_cap) {
        pthread_mutex_unlock(&e->mu);
        return fu_errorf(FU_ERR_EXHAUSTED, "the generation queue is full");
    }
    pthread_mutex_lock(&j->mu);
    j->refs += j->n_choices;
    pthread_mutex_unlock(&j->mu);
    for (int i = 0; i < j->n_choices; i++) {
        e->q[(e->q_head + e->q_len) % e->q_cap] = (gw_task){j, i};
        e->q_len++;
    }
    gw_metrics_running(e->metrics, 1);
    pthread_cond_broadcast(&e->cv);
    pthread_mutex_unlock(&e->mu);
    return FU_OK;
}

int gw_engine_queue_depth(gw_engine *e) {
    pthread_mutex_lock(&e->mu);
    int n = e->q_len;
    pthread_mutex_unlock(&e->mu);
    return n;
}

int gw_engine_new(const gw_config *cfg, const gw_model *model, gw_metrics *metrics, gw_engine **out) {
    *out = NULL;
    gw_engine *e = calloc(1, sizeof *e);
    if (!e) return fu_errorf(FU_ERR_NOMEM, "engine");
    e->cfg = cfg;
    e->model = model;
    e->metrics = metrics;
    pthread_mutex_init(&e->mu, NULL);
    pthread_mutex_init(&e->gm_mu, NULL);
    pthread_cond_init(&e->cv, NULL);
    e->n_hops = cfg->n_hops;
    for (int i = 0; i < cfg->n_hops; i++)
        e->hops[i] = (chain_hop){cfg->hops[i].address, cfg->hops[i].first, cfg->hops[i].last, NULL};
    chain_options co = {.secret = cfg->secret, .tls_ca = cfg->tls_ca, .insecure = cfg->insecure,
                        .forward = cfg->forward, .timeout_ms = cfg->step_timeout_ms};
    gw_client_pair(cfg, &co.tls_client_cert, &co.tls_client_key);
    int rc = chain_client_new(&co, &e->chain);
    if (!rc && (cfg->n_shards > 0 || cfg->swarm_listen)) rc = gw_swarm_new(cfg, model->n_layers, &e->swarm);
    gw_pace_options po = {.floor_ms = cfg->step_deadline_floor_ms, .fallback_ms = cfg->step_timeout_ms};
    if (!rc && e->swarm && !(e->pace = gw_pace_new(&po))) rc = fu_errorf(FU_ERR_NOMEM, "engine");
    if (rc) {
        gw_engine_free(e);
        return rc;
    }
    e->q_cap = cfg->max_queue + cfg->workers + cfg->limits.max_choices;
    e->q = calloc((size_t)e->q_cap, sizeof *e->q);
    e->threads = calloc((size_t)cfg->workers, sizeof *e->threads);
    if (!e->q || !e->threads) {
        gw_engine_free(e);
        return fu_errorf(FU_ERR_NOMEM, "engine");
    }
    for (int i = 0; i < cfg->workers; i++) {
        if (pthread_create(&e->threads[i], NULL, gw_worker, e)) {
            gw_engine_free(e);
            return fu_errorf(FU_ERR_INTERNAL, "cannot start worker threads");
        }
        e->n_threads++;
    }
    *out = e;
    return FU_OK;
}

void gw_engine_free(gw_engine *e) {
    if (!e) return;
    pthread_mutex_lock(&e->mu);
    e->stopping = true;
    pthread_cond_broadcast(&e->cv);
    pthread_mutex_unlock(&e->mu);
    for (int i = 0; i < e->n_threads; i++) pthread_join(e->threads[i], NULL);
    gw_swarm_free(e->swarm);
    gw_pace_free(e->pace);
    chain_client_free(e->chain);
    free(e->threads);
    free(e->q);
    gm_vocab_free(e->gm_vocab);
    pthread_mutex_destroy(&e->gm_mu);
    pthread_cond_destroy(&e->cv);
    pthread_mutex_destroy(&e->mu);
    free(e);
}

struct gw_swarm *gw_engine_swarm(gw_engine *e) { return e->swarm; }

json_t *gw_engine_swarm_json(gw_engine *e) {
    if (e->swarm) return gw_swarm_json(e->swarm);
    json_t *servers = json_array();
    for (int i = 0; i < e->n_hops; i++)
        json_array_append_new(servers, json_pack("{s:s, s:[i, i], s:s}", "address", e->hops[i].address, "span",
                                                 e->hops[i].first_block, e->hops[i].last_block, "state", "static"));
    return json_pack("{s:s, s:s, s:o}", "object", "swarm", "mode", "static", "servers", servers);
}
