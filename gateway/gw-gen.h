/* gw-gen.h -- generation jobs: worker threads drive each choice through a chain of shard servers.
 *
 * A job is one HTTP generation request (chat or completions). Each of its
 * choices (prompts x n) runs on a worker thread with its own chain session, so
 * concurrent choices and requests are decoded together by the shards. The
 * first worker to reach a job prepares it (template, tokenization, context
 * check). Results flow back under the job's mutex: SSE bytes for streaming
 * jobs, one JSON body for the others; the HTTP side registers a wake callback
 * that is called (with the job locked) whenever there is something new.
 *
 * Threading: the engine's queue and each job's response state have their own
 * mutexes. gw_job_submit, gw_job_cancel and gw_job_release may be called from
 * any thread; the accessors after gw_job_lock() need the job locked. A
 * choice's running state belongs to the worker thread that runs it.
 * Ownership: the engine borrows its config, model and metrics. A job owns its
 * request, its prompt tokens and its output; it is reference-counted (the
 * creator's reference plus one per queued choice) and freed with the last.
 */
#ifndef FU_GW_GEN_H
#define FU_GW_GEN_H

#include <stdbool.h>
#include <stddef.h>

#include "chat-template.h"
#include "gw-lora.h"
#include "gw-tools.h"
#include "gw.h"
#include "tokenizer.h"

typedef struct gw_model {
    tok_tokenizer *tok; /* borrowed */
    tpl_template *tpl;  /* borrowed; NULL: no chat template */
    const char *name;   /* the served model id */
    int vocab;          /* V */
    int ctx;            /* the model's context length */
    int n_layers;       /* transformer blocks (routing over a swarm); 0: unknown */
    gw_tool_format tool_format; /* how the chat template's model writes tool calls (gw_tool_format_detect) */
    gw_lora_set *loras; /* the LoRA adapters served besides the base model, borrowed; NULL: none */
    const mdl_config *mdl; /* the model's shape (fine-tuning assembles adapters for it), borrowed; NULL: unknown */
} gw_model;

typedef struct gw_engine gw_engine;
typedef struct gw_job gw_job;

typedef enum gw_job_phase {
    GW_JOB_PENDING = 0, /* queued or preparing: no response yet */
    GW_JOB_STREAMING,   /* streaming: SSE bytes accumulate in the job */
    GW_JOB_DONE,        /* non-streaming: the body is ready */
    GW_JOB_FAILED,      /* an error before any response: gw_job_error() */
} gw_job_phase;

/* Starts the workers. cfg, model and metrics are borrowed and must outlive the engine.
 * With cfg->shards the engine routes each choice over the swarm (gw-swarm.h) and
 * fails over to another path when a shard dies mid-generation. */
int gw_engine_new(const gw_config *cfg, const gw_model *model, gw_metrics *metrics, gw_engine **out);
/* Waits for queued and running choices (cancel their jobs first for a quick exit),
 * joins the workers and frees the engine. NULL is a no-op. */
void gw_engine_free(gw_engine *e);
/* Choices queued and not yet taken by a worker (thread-safe). */
int gw_engine_queue_depth(gw_engine *e);
/* The routed swarm (borrowed, for fine-tuning chains), or NULL with a static chain. */
struct gw_swarm *gw_engine_swarm(gw_engine *e);
/* The /v1/swarm document (new reference): the routed swarm's servers and flow,
 * or the static chain's hops. NULL on allocation failure. */
json_t *gw_engine_swarm_json(gw_engine *e);

/* Renders a chat request's messages (and tools) through the model's chat template:
 * tool calls in the history are prepared for the template first (gw-tools.h; this
 * changes r->messages). On success *out is a malloc'd string the caller frees;
 * on failure returns the HTTP status with *err filled. */
int gw_render_chat(const gw_model *m, gw_request *r, char **out, gw_error *err);

/* Creates a job for a parsed request, taking ownership of *req (zeroed). The
 * caller holds one reference. */
int gw_job_new(gw_engine *e, gw_request *req, gw_job **out);
/* Has the job's sessions open with LoRA adapter l (the job takes the reference,
 * which it returns with gw_lora_put when it is freed). Before gw_job_submit. */
void gw_job_set_lora(gw_job *j, gw_lora *l);
/* The engine's chain client (its channels to the shards), for adapter loads. */
chain_client *gw_engine_chain(gw_engine *e);
/* Queues every choice of the job. FU_ERR_EXHAUSTED when the queue has no room
 * (nothing is queued then). */
int gw_job_submit(gw_job *j);
void gw_job_release(gw_job *j); /* drops a reference; NULL is a no-op */
/* What the access log tells of a job (thread-safe): its id and model (owned by the job), the
 * tokens counted so far, and the seconds from its arrival to its first token (-1: none yet). */
typedef struct gw_job_summary {
    const char *id, *model;
    int64_t prompt_tokens, completion_tokens;
    double ttft_s;
} gw_job_summary;
void gw_job_summarize(gw_job *j, gw_job_summary *out);
/* Asks the job's choices to stop and close their sessions (thread-safe). */
void gw_job_cancel(gw_job *j);

typedef void (*gw_wake_fn)(void *arg);

/* Lock / unlock the job's response state (not recursive). */
void gw_job_lock(gw_job *j);
void gw_job_unlock(gw_job *j);
/* The following require the job's lock. */
/* Registers fn(arg), called with the job locked whenever the phase changes or
 * output is added; fn NULL detaches (before the caller lets go of arg). */
void gw_job_set_wake(gw_job *j, gw_wake_fn fn, void *arg);
gw_job_phase gw_job_phase_get(const gw_job *j); /* the response's phase */
bool gw_job_is_stream(const gw_job *j);         /* the request asked for a stream */
const gw_error *gw_job_error(const gw_job *j); /* with GW_JOB_FAILED */
const char *gw_job_body(const gw_job *j);      /* with GW_JOB_DONE: the JSON body */
/* Streaming: copies up to max pending SSE bytes into buf and returns how many. */
size_t gw_job_take(gw_job *j, char *buf, size_t max);
/* Streaming: every byte has been produced (and, once taken, sent). */
bool gw_job_finished(const gw_job *j);
/* gw_job_cancel() was called, or a choice failed before any response. */
bool gw_job_cancelled(const gw_job *j);

#endif
