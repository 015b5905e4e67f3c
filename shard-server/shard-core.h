/* shard-core.h -- a shard server's state: one span's engine, its sessions, and the batcher
 * that merges the ready steps of all sessions into one forward (continuous batching).
 *
 * Transport-free: the RPC handlers (shard-rpc.c) and the tests drive it
 * through these calls. Thread-safe: any number of threads may open, step and
 * close sessions, load and unload adapters and wait for the batcher to be
 * idle (trainers) at once; one session is stepped (and closed) by one thread
 * at a time. Ownership: the core borrows its model and backend and owns its
 * sessions (closing one frees its KV cache and output buffers) and its
 * adapters; step outputs point into buffers of the session.
 */
#ifndef FU_SHARD_CORE_H
#define FU_SHARD_CORE_H

#include <stdbool.h>
#include <stdint.h>

#include "model.h"
#include "ops.h"
#include "sampler.h"

typedef struct shard_core shard_core;
typedef struct shard_session shard_session;

typedef struct shard_core_options {
    uint64_t kv_budget_bytes; /* KV cache memory for all sessions (0: 1 GiB) */
    int max_batch_tokens;     /* tokens per batched forward (0: 512); a longer step (a prompt's
                               * prefill) runs in chunks of at most this many, and the other
                               * sessions' steps join the batches between its chunks */
    op_type kv_type;          /* OP_TYPE_F32 (default) or OP_TYPE_F16 */
    uint64_t max_logits_bytes; /* the logits one step may return (0: 64 MiB, an RPC message) */
    int max_adapters;         /* LoRA adapters loaded at once (0: 8) */
    int max_lora_rank;        /* the largest rank of one (0: 256) */
    bool prefix_cache_off;    /* true: no prefix cache (shard-prefix.h) */
    int kv_block_tokens;      /* positions per prefix-cache block (0: 32) */
} shard_core_options;

/* Creates the core over `m` (borrowed, must outlive the core) on `be`
 * (borrowed) and starts its batcher thread. */
int shard_core_new(const mdl_model *m, op_backend *be, const shard_core_options *o, shard_core **out);
/* Stops the batcher (failing queued steps with FU_ERR_CANCELLED) and frees
 * the core; every session must have been closed. NULL is a no-op. */
void shard_core_free(shard_core *c);

/* The model the core serves (borrowed). */
const mdl_model *shard_core_model(const shard_core *c);

/* The core's engine (borrowed), for trainers over the same span (model/train.h):
 * they read its prepared weights, which never change, and run on its backend,
 * whose ops are serialized with the batcher's; they touch none of its scratch. */
struct eng_engine;
struct eng_engine *shard_core_engine(shard_core *c);

typedef struct shard_core_stats {
    uint64_t kv_total_bytes;
    uint64_t kv_free_bytes;
    uint64_t kv_bytes_per_pos;
    int active_sessions;
    uint64_t batches;        /* forwards run */
    uint64_t batched_steps;  /* steps they carried */
    uint64_t tokens;         /* positions computed */
    int prefix_cached_blocks;     /* blocks in the prefix cache (their bytes count as free:
                                   * admission evicts them before refusing) */
    uint64_t prefix_cached_bytes;
    uint64_t prefix_hit_tokens;   /* sessions' first-step positions taken from the cache */
    uint64_t prefix_prompt_tokens; /* sessions' first-step positions in all */
    uint64_t train_waits;    /* times a trainer waited in shard_core_wait_idle */
    uint64_t train_wait_us;  /* and for how long in all */
} shard_core_stats;

/* A consistent snapshot of the core's counters and KV budget (thread-safe). */
void shard_core_get_stats(shard_core *c, shard_core_stats *st);

/* Measures the span's compute throughput: decode steps of a batch of
 * `batch` sequences for about `seconds` seconds. Returns tokens/s (> 0) or a
 * negative status. Call before serving (it uses the engine). */
double shard_core_measure(shard_core *c, int batch, double seconds);

/* Times one forward of the span: a prompt of `tokens` tokens in one sequence (prompt), or a
 * decode step of `tokens` sequences of one token each (!prompt); the best of up to 5 runs
 * within about `seconds`, after an untimed one. Returns seconds (>= 0) or a negative status
 * (FU_ERR_RANGE: more tokens than the model's context or the batch limit). Call before
 * serving (it uses the engine). */
double shard_core_time_step(shard_core *c, int tokens, bool prompt, double seconds);

/* ---- training beside inference ------------------------------------------------------
 * Trainers over the core's engine (shard-train.c) share its backend with the batcher, whose
 * lock interleaves their ops one by one. To keep inference's latency, a trainer may call
 * shard_core_wait_idle before each of its long ops (its yield hook, model/train.h): it waits
 * there while the batcher has work, so that a training op starts only while no step is queued
 * or computing, and training runs in the gaps between batches. The wait is bounded, so that
 * training still advances under a batcher that is never idle. It only delays: a trainer
 * computes the same results whether it waits or not. */

/* Waits, on the caller's thread, while the batcher has steps queued or a batch running, for at
 * most max_wait_us (returning at once when it has none, or when the core stops). Returns the
 * microseconds waited (0: it was idle). Thread-safe; any number of threads may wait at once. */
int64_t shard_core_wait_idle(shard_core *c, int64_t max_wait_us);

/* ---- LoRA adapters ------------------------------------------------------------------
 * The core holds adapters by id (1..SHARD_ADAPTER_MAX_ID bytes, no control characters), each of
 * the core's span of blocks in the model's q/k row order. A session opened with one gets its
 * update in the same batched forwards as sessions with other adapters or none. Each adapter is
 * reference-counted: the registry holds one reference, every session using it another, so that
 * it is freed when it is unloaded (or replaced) and the last session using it closes -- never
 * while a batch uses it. */
#define SHARD_ADAPTER_MAX_ID 256

/* Loads adapter `ad` as `id`, taking ownership on FU_OK (the caller keeps it otherwise). An
 * adapter of the same id is replaced for the sessions opened afterwards. FU_ERR_INVALID for a bad
 * id, a rank over max_lora_rank, or an adapter not of the core's span, model shape or q/k order;
 * FU_ERR_EXHAUSTED when max_adapters others are loaded (the messages give the limits). */
struct lora_adapter;
int shard_core_adapter_load(shard_core *c, const char *id, struct lora_adapter *ad);

/* Unloads adapter `id`: new sessions naming it are refused at once; it is freed when the last
 * session using it closes. FU_ERR_NOT_FOUND if none is loaded under that id. */
int shard_core_adapter_unload(shard_core *c, const char *id);

/* The ids of the adapters loaded now, as *n strings in one block *ids (free() it; NULL when n is
 * 0). FU_OK or FU_ERR_NOMEM. */
int shard_core_adapter_ids(shard_core *c, char ***ids, int *n);

/* ---- sessions ------------------------------------------------------------------------ */

/* Opens a session that can hold max_len positions, with the loaded adapter `adapter_id` (NULL or
 * "": none). Fails with FU_ERR_EXHAUSTED (message: bytes needed and free) when the KV budget
 * cannot admit it, FU_ERR_INVALID for a duplicate id, FU_ERR_RANGE for a length the model does
 * not allow, FU_ERR_NOT_FOUND ("adapter 'X' is not loaded on this server") for an adapter id
 * not loaded. */
int shard_session_open(shard_core *c, const char *id, int max_len, const char *adapter_id, shard_session **out);
/* Frees the session's KV cache at once (and its reference to its adapter). NULL is a no-op. */
void shard_session_close(shard_core *c, shard_session *s);

/* ---- prefix cache --------------------------------------------------------------------
 * With the cache on, each session's full blocks of known token ids go into the core's prefix
 * cache after each step (their KV copied, within the KV budget), and a new session may start
 * from cached blocks instead of computing them: pin them at open, import them before the first
 * step. The imported KV is bit for bit what the session would have computed. */

/* Pins the cached blocks that begin tokens[0..n) (the prompt the session's first step will
 * send) for session s, which holds no position yet, and returns how many leading positions
 * they cover: a multiple of the block size, at most n - 1 and max_len - 1 (0: none, or the
 * cache is off). The pins last until shard_session_reuse_prefix, the first step or close. */
int shard_session_pin_prefix(shard_core *c, shard_session *s, const int32_t *tokens, int n);

/* Imports the first n positions (n <= what shard_session_pin_prefix returned) from the pinned
 * blocks into s, which holds none yet, and unpins them; the first step then starts at n.
 * FU_ERR_RANGE when n exceeds the pinned positions or s holds positions. */
int shard_session_reuse_prefix(shard_core *c, shard_session *s, int n);

/* Positions held, the most it may hold, and its id (owned by the session). */
int shard_session_len(const shard_session *s);
int shard_session_max_len(const shard_session *s);
const char *shard_session_id(const shard_session *s);
/* Rolls back to the first `len` positions. */
int shard_session_rollback(shard_session *s, int len);

/* Polled by a waiting submitter (on its own thread, about every 50 ms): true once the
 * step's client has gone, so that the rest of the step is not computed. */
typedef bool (*shard_cancel_fn)(void *arg);

/* One step of one session. The caller fills the inputs and the output spec;
 * the core fills the outputs into buffers it owns (valid until the session's
 * next step or close). */
typedef struct shard_step {
    /* inputs */
    int n;                      /* positions, >= 1 */
    int64_t start_pos;          /* must equal the session length */
    const int32_t *tokens;      /* (n) ids: required with embeddings; else optional (penalties) */
    const float *hidden;        /* (n, D): required without embeddings */
    /* output spec (servers with the head) */
    bool want_logits;
    bool all_positions;         /* outputs for every position, else the last only */
    bool sample;
    smp_params sampling;        /* with sample; sampling.seed is the seed of the LAST output
                                 * row (the position after the step's last input): with
                                 * all_positions, row i of n_out draws with
                                 * seed - (n_out - 1 - i) */
    int64_t penalty_start;      /* penalties count session tokens at positions >= this */
    int top_logprobs;           /* 0..20 */
    bool score_inputs;          /* with sample and all_positions: row i < n - 1 reports the
                                 * next input token tokens[i + 1] (its log-prob and top
                                 * alternatives) instead of sampling; the last row samples */
    shard_cancel_fn cancelled;  /* NULL: the step always runs to its end */
    void *cancel_arg;

    /* outputs */
    int n_out;                  /* output positions */
    const float *out_hidden;    /* (n, D): servers without the head */
    const float *out_logits;    /* (n_out, V) when want_logits */
    const int32_t *out_tokens;  /* (n_out) when sample */
    const float *out_logprobs;  /* (n_out) when sample */
    const int32_t *out_top_ids; /* (n_out, top_logprobs) */
    const float *out_top_lp;    /* (n_out, top_logprobs) */
    int64_t queue_us;
    int64_t compute_us;
} shard_step;

/* Queues the step for the next batched forward and waits for it. Validates
 * the inputs (FU_ERR_INVALID / FU_ERR_RANGE with a message) before queueing.
 * A step longer than max_batch_tokens runs in chunks, other sessions' steps
 * between them. FU_ERR_CANCELLED when step->cancelled said so before the last
 * chunk ran; a failed or cancelled step leaves the session as it was before it. */
int shard_session_step(shard_core *c, shard_session *s, shard_step *step);

/* Embeddings (servers with the head): runs n positions (tokens with embeddings, else hidden
 * (n, D)) on an empty session outside the batcher -- one engine forward, serialized with the
 * batcher's -- and writes the final hidden states after the output norm, (n, D), into out. The
 * session's cache holds them afterwards. FU_ERR_UNSUPPORTED without the head; FU_ERR_INVALID
 * for a session that is not empty or inputs of the wrong kind; the engine's errors. */
int shard_session_final_hidden(shard_core *c, shard_session *s, const int32_t *tokens, const float *hidden, int n,
                               float *out);

#endif
