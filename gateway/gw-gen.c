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
#include "gw-swarm.h"
#include "gw-tools.h"
#include "log.h"
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
    pthread_t *threads;
    int n_threads;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    gw_task *q; /* ring */
    int q_head, q_len, q_cap;
    int idle;
    bool stopping;
    atomic_uint_fast64_t next_id;
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
};

/* ---- job bookkeeping ---------------------------------------------------------------------- */

void gw_job_lock(gw_job *j) { pthread_mutex_lock(&j->mu); }
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
    pthread_mutex_destroy(&j->mu);
    pthread_mutex_destroy(&j->prep_mu);
    free(j);
}

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

int gw_render_chat(const gw_model *m, gw_request *r, char **out, gw_error *err) {
    *out = NULL;
    if (!m->tpl)
        return gw_error_set(err, 400, "messages", NULL, "the model has no chat template: use /v1/completions");
    if (gw_tools_prepare_chat(r->messages, r->tools, m->tool_format, tok_chat_template(m->tok), err)) return err->http;
    if (tpl_apply_chat(m->tpl, r->messages, r->tools, 1, tok_bos_str(m->tok), tok_eos_str(m->tok), NULL, out))
        return gw_error_set(err, 400, "messages", NULL, "chat template: %s", fu_last_error());
    return 0;
}

static int gw_job_prepare_locked(gw_job *j, gw_error *err) {
    const gw_model *m = j->e->model;
    gw_request *r = &j->req;
    int n_prompts = r->kind == GW_KIND_CHAT ? 1 : r->n_prompts;
    const char *param = r->kind == GW_KIND_CHAT ? "messages" : "prompt";
    for (int p = 0; p < n_prompts; p++) {
        if (r->kind == GW_KIND_CHAT) {
            char *text = NULL;
            if (gw_render_chat(m, r, &text, err)) return err->http;
            int rc = tok_encode(m->tok, text, strlen(text), false, true, &j->pids[p], &j->pn[p]);
            free(text);
            if (rc) return gw_error_set(err, 400, "messages", NULL, "tokenizer: %s", fu_last_error());
        } else if (r->prompts[p].ids) {
            j->pids[p] = malloc(r->prompts[p].n_ids * sizeof(int32_t));
            if (!j->pids[p]) return gw_error_set(err, 500, NULL, NULL, "out of memory");
            memcpy(j->pids[p], r->prompts[p].ids, r->prompts[p].n_ids * sizeof(int32_t));
            j->pn[p] = r->prompts[p].n_ids;
        } else {
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
    int64_t total = 0;
    for (int p = 0; p < n_prompts; p++) total += (int64_t)j->pn[p];
    pthread_mutex_lock(&j->mu);
    j->prompt_tokens = total;
    pthread_mutex_unlock(&j->mu);
    return 0;
}

/* Reports an error of one choice (job unlocked): before any response it fails the
 * job (and cancels its other choices); in a running stream it becomes an error event. */
static void gw_job_report_error(gw_job *j, const gw_error *err) {
    pthread_mutex_lock(&j->mu);
    if (j->phase == GW_JOB_PENDING) {
        j->err = *err;
        j->phase = GW_JOB_FAILED;
        atomic_store(&j->cancelled, true);
        gw_job_wake_locked(j);
    } else if (j->phase == GW_JOB_STREAMING) {
        json_t *o = gw_error_object(err);
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

/* The display string of a token. */
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

static json_t *gw_token_bytes(const gw_job *j, int32_t id) {
    const char *b = NULL;
    size_t len = 0;
    json_t *a = json_array();
    if (!tok_token_piece(j->e->model->tok, id, &b, &len))
        for (size_t i = 0; i < len; i++) json_array_append_new(a, json_integer((unsigned char)b[i]));
    return a;
}

/* Chat: one entry of logprobs.content. */
static json_t *gw_chat_lp_entry(const gw_job *j, int32_t tok, float lp, const int32_t *top_ids, const float *top_lp,
                                int k) {
    json_t *tops = json_array();
    for (int i = 0; i < k; i++)
        json_array_append_new(tops, json_pack("{s:o, s:f, s:o}", "token", gw_token_json(j, top_ids[i]), "logprob",
                                              (double)top_lp[i], "bytes", gw_token_bytes(j, top_ids[i])));
    return json_pack("{s:o, s:f, s:o, s:o}", "token", gw_token_json(j, tok), "logprob", (double)lp, "bytes",
                     gw_token_bytes(j, tok), "top_logprobs", tops);
}

/* Completions: a fresh {"tokens", "token_logprobs", "top_logprobs", "text_offset"} object. */
static json_t *gw_cmpl_lp_new(void) {
    return json_pack("{s:[], s:[], s:[], s:[]}", "tokens", "token_logprobs", "top_logprobs", "text_offset");
}

/* Appends one token to a completions logprobs object; lp NAN-free; `has_lp` false gives nulls (first echo token). */
static void gw_cmpl_lp_add(const gw_job *j, json_t *o, int32_t tok, bool has_lp, float lp, const int32_t *top_ids,
                           const float *top_lp, int k, size_t offset) {
    json_array_append_new(json_object_get(o, "tokens"), gw_token_json(j, tok));
    json_array_append_new(json_object_get(o, "token_logprobs"), has_lp ? json_real(lp) : json_null());
    json_t *tops = json_null();
    if (has_lp) {
        tops = json_object();
        for (int i = 0; i < k; i++) {
            json_t *s = gw_token_json(j, top_ids[i]);
            json_object_set_new(tops, json_string_value(s), json_real(top_lp[i]));
            json_decref(s);
        }
    }
    json_array_append_new(json_object_get(o, "top_logprobs"), tops);
    json_array_append_new(json_object_get(o, "text_offset"), json_integer((json_int_t)offset));
}

/* A streaming chunk with one choice; `delta_or_text` is the chat delta object or the completions text. */
static json_t *gw_chunk(const gw_job *j, int index, json_t *delta_or_text, json_t *logprobs, const char *finish) {
    bool chat = j->req.kind == GW_KIND_CHAT;
    json_t *ch = json_object();
    json_object_set_new(ch, "index", json_integer(index));
    json_object_set_new(ch, chat ? "delta" : "text", delta_or_text);
    json_object_set_new(ch, "logprobs", logprobs ? logprobs : json_null());
    json_object_set_new(ch, "finish_reason", finish ? json_string(finish) : json_null());
    json_t *o = json_pack("{s:s, s:s, s:I, s:s, s:[o]}", "id", j->id, "object",
                          chat ? "chat.completion.chunk" : "text_completion", "created", (json_int_t)j->created,
                          "model", j->e->model->name, "choices", ch);
    if (j->req.include_usage) json_object_set_new(o, "usage", json_null());
    return o;
}

static json_t *gw_usage(const gw_job *j) {
    return json_pack("{s:I, s:I, s:I}", "prompt_tokens", (json_int_t)j->prompt_tokens, "completion_tokens",
                     (json_int_t)j->completion_tokens, "total_tokens",
                     (json_int_t)(j->prompt_tokens + j->completion_tokens));
}

/* Appends an SSE event to the job's output and wakes the HTTP side (job unlocked; steals obj). */
static void gw_job_emit(gw_job *j, json_t *obj) {
    if (!obj) return;
    pthread_mutex_lock(&j->mu);
    if (gw_sse_event(&j->out, obj) == FU_OK) gw_job_wake_locked(j);
    pthread_mutex_unlock(&j->mu);
    json_decref(obj);
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

/* Marks one choice done; the last one completes the job. */
static void gw_choice_done(gw_job *j, gw_choice *c, const gw_error *failure) {
    gw_engine *e = j->e;
    pthread_mutex_lock(&j->mu);
    if (c) j->completion_tokens += c->n_gen;
    if (failure && failure->http && !j->err.http) j->err = *failure;
    bool last = ++j->n_done == j->n_choices;
    if (last) {
        gw_metrics_tokens(e->metrics, j->phase == GW_JOB_FAILED ? 0 : j->prompt_tokens, j->completion_tokens);
        gw_metrics_e2e(e->metrics, fu_now_s() - j->t_arrival);
        gw_metrics_running(e->metrics, -1);
        if (j->phase == GW_JOB_STREAMING) {
            if (j->req.include_usage) {
                json_t *u = json_pack("{s:s, s:s, s:I, s:s, s:[], s:o}", "id", j->id, "object",
                                      j->req.kind == GW_KIND_CHAT ? "chat.completion.chunk" : "text_completion",
                                      "created", (json_int_t)j->created, "model", e->model->name, "choices", "usage",
                                      gw_usage(j));
                gw_sse_event(&j->out, u);
                json_decref(u);
            }
            gw_sse_done(&j->out);
        } else if (j->phase == GW_JOB_PENDING) {
            if (j->err.http) j->phase = GW_JOB_FAILED;
            else if (atomic_load(&j->cancelled)) {
                gw_error_set(&j->err, 499, NULL, NULL, "the request was cancelled");
                j->phase = GW_JOB_FAILED;
            } else if (j->req.stream) {
                j->phase = GW_JOB_STREAMING; /* nothing was generated (e.g. max_tokens 0): an empty stream */
                gw_sse_done(&j->out);
            } else {
                gw_job_build_body(j);
            }
        }
        j->finished = true;
        gw_job_wake_locked(j);
    }
    pthread_mutex_unlock(&j->mu);
}

/* ---- one choice ------------------------------------------------------------------------------------ */

/* Maps a chain failure to an HTTP error. */
static void gw_chain_error(gw_error *err, int rc) {
    if (rc == FU_ERR_EXHAUSTED)
        gw_error_set(err, 503, NULL, "overloaded", "the shard servers are at capacity, retry later: %s",
                     fu_last_error());
    else
        gw_error_set(err, 503, NULL, "shard_unavailable", "generation failed: %s: %s", fu_status_str(rc),
                     fu_last_error());
}

/* Failovers one choice may make (each a dead hop, a failed open or a failed replay). */
#define GW_MAX_FAILOVERS 3

/* Whether a chain failure may be cured by another path (the request itself is fine). */
static bool gw_retryable(int rc) {
    return rc != FU_ERR_INVALID && rc != FU_ERR_NOMEM && rc != FU_ERR_AUTH && rc != FU_ERR_RANGE &&
           rc != FU_ERR_UNSUPPORTED;
}

/* Opens the choice's chain session. Static chain: one try. Swarm: routes a path
 * (into *lease), opens a session on it and, when n_replay > 0, replays
 * hist[0..n_replay) as one prefill step without output so that every hop's cache
 * holds those positions from 0; a dead hop is retired and another path tried,
 * each retry counting in *failovers (at most GW_MAX_FAILOVERS). On failure *err
 * is a 503 and nothing is held. */
static int gw_choice_open(gw_engine *e, const char *sid, int max_length, int request_len, const int32_t *hist,
                          int n_replay, gw_lease *lease, chain_session **out, int *failovers, gw_error *err) {
    *out = NULL;
    if (!e->swarm) {
        int rc = chain_session_open(e->chain, e->hops, e->n_hops, sid, max_length, out);
        if (rc) gw_chain_error(err, rc);
        return rc;
    }
    for (;;) {
        int rc = gw_swarm_route(e->swarm, request_len, lease, err);
        if (rc) return rc;
        char id[128];
        snprintf(id, sizeof id, "%s.%d", sid, *failovers);
        chain_session *s = NULL;
        rc = chain_session_open(e->chain, lease->hops, lease->n_hops, id, max_length, &s);
        if (!rc && n_replay > 0) {
            chain_spec none = {0};
            const chain_result *r = NULL;
            rc = chain_session_step(s, hist, n_replay, -1, &none, &r);
        }
        if (!rc) {
            *out = s;
            return FU_OK;
        }
        char msg[512];
        snprintf(msg, sizeof msg, "%s", fu_last_error());
        chain_session_close(s);
        FU_LOG(FU_LOG_LEVEL_WARN, sid, "opening a session on a routed chain failed: %s", msg);
        gw_swarm_report_failure(e->swarm, lease, msg);
        gw_swarm_release(e->swarm, lease);
        if (!gw_retryable(rc) || ++*failovers > GW_MAX_FAILOVERS) {
            fu_errorf(rc, "%s", msg);
            gw_chain_error(err, rc);
            return rc;
        }
    }
}

/* Streaming chat with tools: the text goes through the choice's tool stream; content
 * and tool_calls deltas go out as chunks, and the finish says "tool_calls" when
 * the model called any. */
static void gw_choice_output_tools(gw_job *j, gw_choice *c, const char *text, size_t len, json_t *lp_chunk,
                                   const char *finish) {
    fu_buf content = {0};
    json_t *deltas = json_array();
    int rc = deltas ? gw_tool_stream_feed(&c->tools, text ? text : "", len, &content, deltas) : FU_ERR_NOMEM;
    if (!rc && finish) rc = gw_tool_stream_flush(&c->tools, &content, deltas);
    if (rc) FU_LOG(FU_LOG_LEVEL_WARN, j->id, "tool call parsing: out of memory");
    if (content.len || lp_chunk) {
        json_t *d = json_object();
        json_object_set_new(d, "content", gw_json_string_lossy(content.data ? content.data : "", content.len));
        gw_job_emit(j, gw_chunk(j, c->index, d, lp_chunk, NULL));
    }
    size_t i;
    json_t *delta;
    json_array_foreach(deltas, i, delta) {
        gw_job_emit(j, gw_chunk(j, c->index, json_pack("{s:[O]}", "tool_calls", delta), NULL, NULL));
    }
    if (finish)
        gw_job_emit(j, gw_chunk(j, c->index, json_object(), NULL, c->tools.n_calls ? "tool_calls" : finish));
    json_decref(deltas);
    fu_buf_free(&content);
}

/* Emits text (and streamed logprobs) for a choice: streaming sends a chunk, otherwise it accumulates. */
static void gw_choice_output(gw_job *j, gw_choice *c, const char *text, size_t len, json_t *lp_chunk,
                             const char *finish) {
    if (!j->req.stream) {
        fu_buf_append(&c->text, text, len);
        json_decref(lp_chunk);
        return;
    }
    if (j->tools_on) {
        gw_choice_output_tools(j, c, text, len, lp_chunk, finish);
        return;
    }
    if (!len && !lp_chunk && !finish) return;
    json_t *t = gw_json_string_lossy(text ? text : "", len);
    json_t *payload = t;
    if (j->req.kind == GW_KIND_CHAT) {
        payload = json_object();
        if (len || !finish) json_object_set_new(payload, "content", t);
        else json_decref(t);
    }
    gw_job_emit(j, gw_chunk(j, c->index, payload, lp_chunk, finish));
}

/* Computes echoed prompt-token logprobs (completions, echo + logprobs) from all-position logits. */
static void gw_echo_logprobs(gw_job *j, gw_choice *c, const int32_t *prompt, size_t n, const chain_result *r,
                             json_t *lp) {
    int k = j->req.top_logprobs;
    int32_t ids[64];
    float lps[64];
    size_t off = 0;
    for (size_t i = 0; i < n; i++) {
        bool has = i > 0 && r->logits && (int)i <= r->n_out;
        float l = 0;
        if (has) l = smp_top_logprobs(r->logits + (i - 1) * (size_t)r->vocab, r->vocab, prompt[i], k, ids, lps);
        gw_cmpl_lp_add(j, lp, prompt[i], has, l, ids, lps, k, off);
        const char *b;
        size_t len;
        if (!tok_token_piece(j->e->model->tok, prompt[i], &b, &len)) off += len;
    }
    c->text_off = off;
}

static void gw_run_choice(gw_job *j, int ci) {
    gw_engine *e = j->e;
    const gw_model *m = e->model;
    gw_choice *c = &j->choices[ci];
    gw_error err = {0};
    chain_session *s = NULL;
    gw_lease lease = {0};
    int32_t *hist = NULL; /* prompt + generated tokens: replayed on failover */
    int n_hist = 0, failovers = 0;
    tok_decoder *dec = NULL;
    gw_stop stop = {0};
    fu_buf piece = {0};
    json_t *lp_chunk = NULL;
    bool stream = j->req.stream, chat = j->req.kind == GW_KIND_CHAT;

    if (atomic_load(&j->cancelled) || !gw_job_prepare(j)) goto done;
    const int32_t *prompt = j->pids[c->prompt];
    const size_t n_prompt = j->pn[c->prompt];
    if (j->max_tokens == 0 && !j->req.echo) {
        c->finish = "length";
        goto done;
    }
    char sid[96];
    snprintf(sid, sizeof sid, "%s-%d", j->id, ci);
    const int max_length = (int)n_prompt + j->max_tokens + 1, request_len = (int)n_prompt + j->max_tokens;
    hist = malloc((size_t)max_length * sizeof *hist);
    if (!hist) {
        gw_error_set(&err, 500, NULL, NULL, "out of memory");
        goto done;
    }
    memcpy(hist, prompt, n_prompt * sizeof *hist);
    n_hist = (int)n_prompt;
    int rc = gw_choice_open(e, sid, max_length, request_len, hist, 0, &lease, &s, &failovers, &err);
    if (rc) {
        FU_LOG(FU_LOG_LEVEL_WARN, sid, "session open failed: %s", err.message);
        gw_job_report_error(j, &err);
        err.http = 0;
        goto done;
    }
    gw_metrics_sessions(e->metrics, 1);
    pthread_mutex_lock(&j->mu);
    bool failed = j->phase == GW_JOB_FAILED;
    if (stream && j->phase == GW_JOB_PENDING) {
        j->phase = GW_JOB_STREAMING;
        gw_job_wake_locked(j);
    }
    pthread_mutex_unlock(&j->mu);
    if (failed) goto done;
    if ((rc = tok_decoder_init(m->tok, true, &dec)) || (rc = gw_stop_init(&stop, j->req.stop, j->req.n_stop))) {
        gw_error_set(&err, 500, NULL, NULL, "decoder: %s", fu_last_error());
        goto done;
    }
    if (j->req.logprobs && !stream) c->lp = chat ? json_array() : gw_cmpl_lp_new();
    if (stream && chat) {
        json_t *d = json_pack("{s:s, s:s}", "role", "assistant", "content", "");
        gw_job_emit(j, gw_chunk(j, c->index, d, NULL, NULL));
    }

    /* echo: the prompt comes first */
    bool echo_lp = !chat && j->req.echo && j->req.logprobs;
    if (!chat && j->req.echo) {
        const gw_prompt *p = &j->req.prompts[c->prompt];
        char *txt = NULL;
        size_t tl = 0;
        if (p->text) {
            txt = p->text;
            tl = p->text_len;
        } else if (tok_decode(m->tok, prompt, n_prompt, false, &txt, &tl)) {
            txt = NULL;
        }
        if (!echo_lp) gw_choice_output(j, c, txt ? txt : "", tl, NULL, NULL);
        else fu_buf_append(&c->text, txt ? txt : "", tl); /* the logprobs follow the prefill */
        c->text_off = tl;
        if (txt != p->text) free(txt);
    }
    if (j->max_tokens == 0) { /* echo only */
        if (echo_lp) {
            if (stream) {
                gw_choice_output(j, c, c->text.data, c->text.len, NULL, NULL);
                fu_buf_free(&c->text);
            }
        }
        c->finish = "length";
        goto done;
    }

    chain_spec spec = {.sample = true, .sampling = j->req.sampling, .penalty_start = (int64_t)n_prompt,
                       .top_logprobs = j->req.logprobs ? j->req.top_logprobs : 0};
    const int32_t *in = hist;
    int n_in = (int)n_prompt;
    int32_t last = 0;
    double t_prev = 0;
    c->finish = "length";
    for (int step = 0; step < j->max_tokens; step++) {
        if (atomic_load(&j->cancelled)) {
            c->finish = NULL;
            break;
        }
        int64_t pos = (int64_t)n_prompt + step; /* the position whose token is sampled */
        spec.want_logits = echo_lp && step == 0;
        spec.all_positions = spec.want_logits;
        spec.sampling.seed = gw_step_seed(j->seed, ci, pos); /* the seed of the step's last position */
        const chain_result *r = NULL;
        while ((rc = chain_session_step(s, in, n_in, -1, &spec, &r)) && e->swarm && gw_retryable(rc) &&
               failovers < GW_MAX_FAILOVERS && !atomic_load(&j->cancelled)) {
            /* failover: retire the dead hop, reopen on a new path, replay the history
             * before this step's input, then retry the step (same seed) */
            char msg[512];
            snprintf(msg, sizeof msg, "%s", fu_last_error());
            failovers++;
            FU_LOG(FU_LOG_LEVEL_WARN, sid, "step failed (%s), failing over (%d of %d)", msg, failovers,
                   GW_MAX_FAILOVERS);
            chain_session_close(s);
            s = NULL;
            gw_swarm_report_failure(e->swarm, &lease, msg);
            gw_swarm_release(e->swarm, &lease);
            if ((rc = gw_choice_open(e, sid, max_length, request_len, hist, n_hist - n_in, &lease, &s, &failovers,
                                     &err)))
                break;
        }
        if (rc && !s) {
            gw_metrics_sessions(e->metrics, -1); /* counted when first opened */
            c->finish = NULL;
            break;
        }
        if (rc) {
            gw_chain_error(&err, rc);
            FU_LOG(FU_LOG_LEVEL_WARN, sid, "step failed: %s", err.message);
            c->finish = NULL;
            break;
        }
        double t = fu_now_s();
        if (step == 0) gw_metrics_ttft(e->metrics, t - j->t_arrival);
        else gw_metrics_itl(e->metrics, t - t_prev);
        t_prev = t;
        int o = r->n_out - 1;
        last = r->tokens[o];
        c->n_gen++;
        if (echo_lp && step == 0) {
            json_t *lp = gw_cmpl_lp_new();
            gw_echo_logprobs(j, c, prompt, n_prompt, r, lp);
            if (stream) {
                gw_choice_output(j, c, c->text.data, c->text.len, lp, NULL);
                fu_buf_free(&c->text);
            } else {
                json_decref(c->lp);
                c->lp = lp;
            }
        }
        bool eog = !j->req.ignore_eos && tok_is_eog(m->tok, last);
        /* logprobs of this token */
        if (j->req.logprobs) {
            const int32_t *ti = r->top_ids ? r->top_ids + (size_t)o * r->top_k : NULL;
            const float *tl = r->top_logprobs ? r->top_logprobs + (size_t)o * r->top_k : NULL;
            int k = ti ? r->top_k : 0;
            json_t *target = stream ? NULL : c->lp;
            if (chat) {
                json_t *entry = gw_chat_lp_entry(j, last, r->logprobs[o], ti, tl, k);
                if (target) json_array_append_new(target, entry);
                else {
                    if (!lp_chunk) lp_chunk = json_pack("{s:[]}", "content");
                    json_array_append_new(json_object_get(lp_chunk, "content"), entry);
                }
            } else {
                if (!target && !lp_chunk) lp_chunk = gw_cmpl_lp_new();
                gw_cmpl_lp_add(j, target ? target : lp_chunk, last, true, r->logprobs[o], ti, tl, k, c->text_off);
            }
        }
        if (eog) {
            c->finish = "stop";
            break;
        }
        const char *txt;
        size_t tl;
        if ((rc = tok_decoder_push(dec, last, &txt, &tl))) {
            gw_error_set(&err, 500, NULL, NULL, "decoder: %s", fu_last_error());
            c->finish = NULL;
            break;
        }
        c->text_off += tl;
        piece.len = 0;
        gw_stop_feed(&stop, txt, tl, &piece);
        if (stop.matched) {
            if (piece.len || lp_chunk) gw_choice_output(j, c, piece.data, piece.len, lp_chunk, NULL);
            lp_chunk = NULL;
            c->finish = "stop";
            break;
        }
        if (piece.len || lp_chunk) {
            gw_choice_output(j, c, piece.data, piece.len, lp_chunk, NULL);
            lp_chunk = NULL;
        }
        piece.len = 0;
        hist[n_hist++] = last;
        in = &hist[n_hist - 1];
        n_in = 1;
    }
    /* the end: held-back bytes and text, then the finish */
    piece.len = 0;
    if (c->finish) {
        if (!stop.matched) {
            const char *txt;
            size_t tl;
            if (!tok_decoder_flush(dec, &txt, &tl) && tl) gw_stop_feed(&stop, txt, tl, &piece);
            gw_stop_flush(&stop, &piece);
        }
        if (!stream) {
            gw_choice_output(j, c, piece.data, piece.len, NULL, NULL);
        } else {
            if (piece.len || lp_chunk) gw_choice_output(j, c, piece.data, piece.len, lp_chunk, NULL);
            lp_chunk = NULL;
            gw_choice_output(j, c, NULL, 0, NULL, c->finish);
        }
        piece.len = 0;
    } else if (err.http) {
        gw_job_report_error(j, &err);
        err.http = 0;
    }
done:
    json_decref(lp_chunk);
    fu_buf_free(&piece);
    gw_stop_free(&stop);
    tok_decoder_free(dec);
    if (s) {
        chain_session_close(s);
        gw_metrics_sessions(e->metrics, -1);
    }
    if (e->swarm) gw_swarm_release(e->swarm, &lease);
    free(hist);
    gw_choice_done(j, c, &err);
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
    pthread_cond_init(&e->cv, NULL);
    e->n_hops = cfg->n_hops;
    for (int i = 0; i < cfg->n_hops; i++)
        e->hops[i] = (chain_hop){cfg->hops[i].address, cfg->hops[i].first, cfg->hops[i].last, NULL};
    chain_options co = {.secret = cfg->secret, .tls_ca = cfg->tls_ca, .insecure = cfg->insecure,
                        .forward = cfg->forward, .timeout_ms = cfg->step_timeout_ms};
    int rc = chain_client_new(&co, &e->chain);
    if (!rc && (cfg->n_shards > 0 || cfg->swarm_listen)) rc = gw_swarm_new(cfg, model->n_layers, &e->swarm);
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
    chain_client_free(e->chain);
    free(e->threads);
    free(e->q);
    pthread_cond_destroy(&e->cv);
    pthread_mutex_destroy(&e->mu);
    free(e);
}

json_t *gw_engine_swarm_json(gw_engine *e) {
    if (e->swarm) return gw_swarm_json(e->swarm);
    json_t *servers = json_array();
    for (int i = 0; i < e->n_hops; i++)
        json_array_append_new(servers, json_pack("{s:s, s:[i, i], s:s}", "address", e->hops[i].address, "span",
                                                 e->hops[i].first_block, e->hops[i].last_block, "state", "static"));
    return json_pack("{s:s, s:s, s:o}", "object", "swarm", "mode", "static", "servers", servers);
}
