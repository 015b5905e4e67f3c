/* shard-svc.h -- the fusion.Shard service in plain C: Session streams, Forward, Info, Health, Echo, adapters.
 *
 * Role: the one place that knows fusion.Shard's messages (net/proto/fusion.proto).
 * Components describe requests and replies with the structs below; this module
 * packs them into protobuf messages and unpacks received ones into the same
 * structs, so nothing above net/ sees generated code. It also holds the client
 * side of the chain protocol once (shard_svc_session_*): the Session stream the
 * gateway opens on each hop and the one a shard opens on its next hop when it
 * forwards, so both build the same open and step requests. LoadAdapter and
 * UnloadAdapter (shard-svc-adapter.c) put LoRA adapters on a server by id.
 *
 * Every struct mirrors the proto message of the same name (OpenSession ->
 * shard_svc_open, StepRequest -> shard_svc_step, ...), with the same field
 * meanings, units and rules; see the proto for those. Sub-messages are
 * pointers, NULL when absent; repeated fields are a pointer and a count.
 * Received values are unchecked beyond what the protobuf decoder guarantees
 * (strings are never NULL): the receiver validates them. The exception is
 * what these structs cannot carry, refused here with INVALID_ARGUMENT naming
 * the field: token ids (int64 on the wire) outside 0..INT32_MAX, any other
 * integer field (int64 on the wire: counts, sizes, block numbers, top_k, ...)
 * outside int32, a session id with an embedded NUL, a control character or
 * over SHARD_SVC_MAX_ID bytes, and addresses, TLS names and adapter ids with a
 * control character or over SHARD_SVC_MAX_NAME bytes. Replies a client
 * receives (step outputs and timings, Info) are read the same way.
 *
 * Ownership: structs passed in are borrowed; they are packed before the call
 * returns (a handler's reply: when the handler returns, or for Forward before
 * forward_done). Structs handed out are views into a received message that
 * this module owns; each function says how long they last. Copy what must
 * live longer.
 *
 * Threads: one shard_svc_stream (server) or shard_svc_session (client) is
 * used by one thread at a time; everything else is thread-safe. Handlers run
 * as the RPC layer runs them: Session on a thread per stream, the unary ones
 * on the server's worker threads, several at once.
 */
#ifndef FU_SHARD_SVC_H
#define FU_SHARD_SVC_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "rpc-base.h"
#include "sampler.h"
#include "wire.h"

/* Longest session id (OpenSession.session_id) and other received name (addresses, TLS names,
 * adapter ids), in bytes. */
#define SHARD_SVC_MAX_ID 128
#define SHARD_SVC_MAX_NAME 256

/* Most target module names of a LoraSpec, and the longest one, in bytes. */
#define SHARD_SVC_MAX_TARGETS 16
#define SHARD_SVC_MAX_TARGET_NAME 64

/* Longest Echo reply a server sends (EchoRequest.reply_bytes). */
#define SHARD_SVC_ECHO_MAX (4 << 20)

/* ---- messages ------------------------------------------------------------------------- */

/* Input: token ids, hidden states, or both. */
typedef struct shard_svc_input {
    const int32_t *tokens;     /* (n_tokens) */
    size_t n_tokens;
    const wire_tensor *hidden; /* (n, hidden_size); NULL: none */
} shard_svc_input;

/* Sampling, as on the wire (0 means "off" where the proto says so; see
 * shard_svc_sampling_to_params for the sampler's reading). */
typedef struct shard_svc_sampling {
    float temperature, top_p;
    int32_t top_k;
    float min_p;
    uint64_t seed;
    float presence_penalty, frequency_penalty, repetition_penalty;
    const smp_bias *logit_bias; /* (n_logit_bias) */
    size_t n_logit_bias;
    int64_t penalty_start;
    const uint8_t *allowed_tokens; /* (n_allowed_tokens) packed mask; NULL: every token */
    size_t n_allowed_tokens;
} shard_svc_sampling;

/* OutputSpec: what the server holding the LM head returns. */
typedef struct shard_svc_output_spec {
    bool want_logits, all_positions;
    const shard_svc_sampling *sampling; /* NULL: do not sample */
    int32_t top_logprobs;
    bool score_inputs;                  /* rows but the last: the next input token's log-prob */
    bool want_hidden;                   /* Forward at the head: the final normed hidden states */
} shard_svc_output_spec;

/* TopLogprobs of one output position: n alternatives, most likely first. */
typedef struct shard_svc_top {
    const int32_t *tokens; /* (n) */
    const float *logprobs; /* (n) */
    size_t n;
} shard_svc_top;

/* Output of one step or one sequence. */
typedef struct shard_svc_output {
    const wire_tensor *hidden; /* (n_positions, hidden_size); NULL: none */
    const wire_tensor *logits; /* (n_out, vocab) F32; NULL: none */
    const int32_t *tokens;     /* (n_tokens) sampled */
    size_t n_tokens;
    const float *logprobs;     /* (n_logprobs) */
    size_t n_logprobs;
    const shard_svc_top *top;  /* (n_top) */
    size_t n_top;
} shard_svc_output;

/* ServerTiming: one server's time on one request, microseconds. */
typedef struct shard_svc_timing {
    const char *server;
    int32_t first_block, last_block;
    int64_t queue_us, compute_us, total_us;
    int64_t prefix_hit_tokens;
} shard_svc_timing;

/* Hop: one server of a chain, for server-to-server forwarding. */
typedef struct shard_svc_hop {
    const char *address;
    int32_t first_block, last_block;
    const char *tls_server_name; /* NULL or "": from the address */
} shard_svc_hop;

/* OpenSession. */
typedef struct shard_svc_open {
    const char *session_id;
    int32_t max_length;
    int wire_dtype;              /* WIRE_*; 0: BF16 */
    int32_t int8_block_size;
    const char *adapter_id;      /* NULL or "": the base model */
    int32_t first_block, last_block;
    const shard_svc_hop *chain;  /* (n_chain) the rest of the chain after this server */
    size_t n_chain;
    int32_t idle_timeout_ms;
    const int32_t *prefix_tokens; /* (n_prefix_tokens) the first step's prompt, for the prefix cache */
    size_t n_prefix_tokens;
} shard_svc_open;

/* OpenReply. */
typedef struct shard_svc_opened {
    const char *session_id;
    int32_t first_block, last_block, max_length;
    int wire_dtype;
    int64_t kv_bytes;
    int64_t cached_tokens;       /* positions of the prefix pinned in the prefix cache(s) */
} shard_svc_opened;

/* StepRequest. */
typedef struct shard_svc_step {
    uint64_t request_id;
    int64_t start_position;
    const shard_svc_input *input;        /* NULL: missing (refused by servers) */
    const shard_svc_output_spec *output; /* NULL: none */
    bool has_rollback;
    int64_t rollback_to;                 /* with has_rollback */
    int64_t prefix_reuse;                /* first step: positions taken from the prefix cache */
} shard_svc_step;

/* StepReply. */
typedef struct shard_svc_step_reply {
    uint64_t request_id;
    int64_t position;
    const shard_svc_output *output;  /* NULL: none */
    const shard_svc_timing *timing;  /* (n_timing) one per hop, in chain order */
    size_t n_timing;
} shard_svc_step_reply;

/* One message of a Session stream from the client. */
typedef enum shard_svc_kind {
    SHARD_SVC_NONE = 0, /* no kind set */
    SHARD_SVC_OPEN,
    SHARD_SVC_STEP,
    SHARD_SVC_CLOSE,
} shard_svc_kind;

typedef struct shard_svc_request {
    shard_svc_kind kind;
    const shard_svc_open *open; /* kind OPEN */
    const shard_svc_step *step; /* kind STEP */
    const char *close_reason;   /* kind CLOSE */
} shard_svc_request;

/* ForwardRequest. */
typedef struct shard_svc_forward {
    uint64_t request_id;
    const shard_svc_input *sequences;    /* (n_sequences) */
    size_t n_sequences;
    const shard_svc_output_spec *output; /* NULL: none */
    int wire_dtype;                      /* 0: as the input's */
    const char *adapter_id;
    int32_t first_block, last_block;
} shard_svc_forward;

/* ForwardReply. */
typedef struct shard_svc_forward_reply {
    uint64_t request_id;
    const shard_svc_output *outputs; /* (n_outputs) one per sequence */
    size_t n_outputs;
    const shard_svc_timing *timing;  /* (n_timing) */
    size_t n_timing;
} shard_svc_forward_reply;

/* InfoReply. */
typedef struct shard_svc_info {
    const char *model_name;
    int32_t n_layers, first_block, last_block;
    bool has_embeddings, has_head;
    const char *dtype, *device;
    double tokens_per_s;
    int64_t free_kv_bytes, total_kv_bytes;
    int32_t active_sessions;
    const char *version;
    int32_t hidden_size, vocab_size, max_length;
    const int *wire_dtypes;          /* (n_wire_dtypes) WIRE_* */
    size_t n_wire_dtypes;
    const char *const *adapters;     /* (n_adapters) */
    size_t n_adapters;
    int64_t max_message_bytes, kv_bytes_per_position;
    int64_t prefix_cached_blocks, prefix_hit_tokens, prefix_prompt_tokens;
    /* one block's measured step times: prompt_step_s[i] for a prompt of prompt_step_tokens[i]
     * tokens, decode_step_s[i] for a decode step of decode_step_tokens[i] sequences (n 0: none;
     * a received reply holds at most SHARD_SVC_MAX_STEPS each, the lists of a table equally long) */
    const double *prompt_step_tokens, *prompt_step_s, *decode_step_tokens, *decode_step_s;
    size_t n_prompt_steps, n_decode_steps;
} shard_svc_info;

#define SHARD_SVC_MAX_STEPS 16

/* LoraSpec (fusion.Train's, also LoadAdapter's). */
typedef struct shard_svc_lora {
    int32_t r;
    float alpha, dropout;
    bool use_rslora;
    const char *const *targets; /* (n_targets) PEFT's names, or the one name "all-linear" */
    size_t n_targets;
    uint64_t init_seed;
} shard_svc_lora;

/* AdapterState (fusion.Train's, also LoadAdapter's): a span's adapter, params flat in PEFT's order. */
typedef struct shard_svc_state {
    int32_t first_block, last_block;
    const shard_svc_lora *lora;       /* NULL: absent */
    const wire_tensor *params;        /* NULL: absent */
    const wire_tensor *moment1;       /* NULL: zeros */
    const wire_tensor *moment2;       /* NULL: zeros */
} shard_svc_state;

/* HealthReply.ServingStatus. */
typedef enum shard_svc_serving {
    SHARD_SVC_SERVING_UNKNOWN = 0,
    SHARD_SVC_SERVING_SERVING = 1,
    SHARD_SVC_SERVING_DRAINING = 2, /* finishing sessions, accepting none */
    SHARD_SVC_SERVING_NOT_SERVING = 3,
} shard_svc_serving;

/* HealthReply. */
typedef struct shard_svc_health {
    shard_svc_serving status;
    const char *message;
} shard_svc_health;

/* ---- sampling ------------------------------------------------------------------------- */

/* The wire form of sampler parameters p (logit_bias and the allowed mask borrowed from p). */
shard_svc_sampling shard_svc_sampling_from_params(const smp_params *p, int64_t penalty_start);

/* The sampler's parameters for wire sampling w: smp_params_default() with w's
 * values, top_p and repetition_penalty 0 read as 1 (off); p->bias borrows
 * w->logit_bias, p->allowed w->allowed_tokens. */
smp_params shard_svc_sampling_to_params(const shard_svc_sampling *w);

/* The LoraSpec of adapter config `cfg` (r, alpha, dropout, rslora; init_seed 0), its targets'
 * PEFT names written into names[0..LORA_N_TARGETS) (the caller's; the spec points at them). */
struct lora_config;
shard_svc_lora shard_svc_lora_of(const struct lora_config *cfg, const char **names);

/* ---- server ----------------------------------------------------------------------------- */

/* The server side of one Session stream. */
typedef struct shard_svc_stream shard_svc_stream;

/* Handlers of the Shard service. NULL handlers leave their method
 * unimplemented, except Echo, which this module answers itself (reply_bytes
 * 0..SHARD_SVC_ECHO_MAX zeros; INVALID_ARGUMENT beyond). Every handler returns
 * RPC_OK or a code with the reason in st->message
 * (`return rpc_status_setf(st, RPC_NOT_FOUND, ...)`). */
typedef struct shard_svc_handlers {
    void *ctx; /* passed to every handler */
    /* A Session stream, on its own thread: loops shard_svc_stream_recv / _send and returns
     * the final code, which ends the call. */
    int (*session)(void *ctx, shard_svc_stream *s, rpc_status *st);
    /* Forward: `req` (views valid during the call) -> *reply. On RPC_OK the reply's pointers
     * must stay valid until forward_done(ctx, *hold) runs after it was packed; on failure the
     * handler keeps nothing (forward_done is not called). */
    int (*forward)(void *ctx, const shard_svc_forward *req, shard_svc_forward_reply *reply, void **hold,
                   rpc_status *st);
    void (*forward_done)(void *ctx, void *hold);
    /* Info / Health: fill *reply (zeroed); its strings must outlive the call (they are packed
     * after it returns): point them at the server's configuration or static text, or, for
     * Info, at memory that info_done (NULL: none) releases once the reply was sent; info_done
     * runs after every successful info call. */
    int (*info)(void *ctx, shard_svc_info *reply, rpc_status *st);
    int (*health)(void *ctx, shard_svc_health *reply, rpc_status *st);
    /* LoadAdapter: adapter `id` (1..SHARD_SVC_MAX_NAME bytes, no control characters) from
     * `state` (views valid during the call; its lora and params checked present); *bytes: the
     * memory it holds. UnloadAdapter: adapter `id` (checked alike). */
    int (*load_adapter)(void *ctx, const char *id, const shard_svc_state *state, int64_t *bytes, rpc_status *st);
    int (*unload_adapter)(void *ctx, const char *id, rpc_status *st);
    void (*info_done)(void *ctx, shard_svc_info *reply);
} shard_svc_handlers;

/* Registers the Shard service's methods on srv (before rpc_server_start); h is
 * borrowed, with its ctx, until rpc_server_free. FU_OK or a status. */
int shard_svc_serve(rpc_server *srv, const shard_svc_handlers *h);

/* Receives the next message of the stream, waiting up to timeout_ms (< 0: forever), as
 * *req: a view valid until the next receive on s or the handler's return. Codes as the RPC
 * layer's stream receive: RPC_END_OF_STREAM (half-closed), RPC_CANCELLED (the client went
 * away), RPC_DEADLINE_EXCEEDED (nothing came; call again), RPC_INVALID_ARGUMENT (a malformed
 * message; the stream stays usable), RPC_RESOURCE_EXHAUSTED (no memory for the view). */
int shard_svc_stream_recv(shard_svc_stream *s, const shard_svc_request **req, int timeout_ms,
                          rpc_status *st);

/* Sends an open reply / a step reply (packed at once; borrowed for the call). RPC_CANCELLED:
 * the client went away. */
/* Non-blocking: true once the stream's client cancelled or went away. On the stream's thread. */
bool shard_svc_stream_cancelled(shard_svc_stream *s);
int shard_svc_stream_send_opened(shard_svc_stream *s, const shard_svc_opened *o, rpc_status *st);
int shard_svc_stream_send_step(shard_svc_stream *s, const shard_svc_step_reply *r, rpc_status *st);

/* Decodes wire bytes as one Session message, as shard_svc_stream_recv would,
 * without a transport (fuzzing, tests). On RPC_OK *req is a new view; free it
 * with shard_svc_request_free. Malformed bytes or len > max_bytes:
 * RPC_INVALID_ARGUMENT / RPC_RESOURCE_EXHAUSTED and *req = NULL. */
int shard_svc_request_decode(const void *data, size_t len, size_t max_bytes, const shard_svc_request **req,
                             rpc_status *st);
/* Frees a request from shard_svc_request_decode. NULL is a no-op. */
void shard_svc_request_free(const shard_svc_request *req);

/* The unary requests shard_svc_adapter_request_check reads. */
typedef enum shard_svc_adapter_call {
    SHARD_SVC_LOAD_ADAPTER = 0,
    SHARD_SVC_UNLOAD_ADAPTER,
} shard_svc_adapter_call;

/* Decodes wire bytes as a LoadAdapterRequest / UnloadAdapterRequest and builds its view as the
 * server would, then frees both (fuzzing, tests): RPC_OK, or the code the server would answer
 * (INVALID_ARGUMENT for malformed bytes or a refused field, RESOURCE_EXHAUSTED past max_bytes). */
int shard_svc_adapter_request_check(shard_svc_adapter_call call, const void *data, size_t len, size_t max_bytes,
                                    rpc_status *st);

/* Packs a step reply as the stream would send it and returns its size in
 * bytes in *bytes (fuzzing, tests). RPC_OK or RPC_RESOURCE_EXHAUSTED. */
int shard_svc_step_reply_size(const shard_svc_step_reply *r, size_t *bytes, rpc_status *st);

/* ---- client: sessions (the chain protocol) ----------------------------------------------- */

/* The client side of one Session stream. */
typedef struct shard_svc_session shard_svc_session;

/* Opens a Session stream on ch (borrowed; it must outlive the session), sends `open` and
 * waits up to timeout_ms (< 0: forever; also the wait for every step reply) for the open
 * reply. RPC_OK with *out set; else the stream's or the server's code (RPC_END_OF_STREAM: the
 * server ended the stream without a reply), or RPC_UNEXPECTED_REPLY when it answered with
 * something other than an open reply, and *out NULL. */
int shard_svc_session_open(rpc_channel *ch, const shard_svc_open *open, int timeout_ms, shard_svc_session **out,
                           rpc_status *st);

/* OpenReply.cached_tokens of s's open: the prefix positions the server(s) pinned. */
int64_t shard_svc_session_cached(const shard_svc_session *s);

/* Sends one step and waits for its reply: RPC_OK with *reply a view valid until the next step,
 * shard_svc_session_drop_reply or close on s; else a code as for open (RPC_UNEXPECTED_REPLY:
 * not a step reply) and *reply NULL. `step` may point into another session's reply. */
int shard_svc_session_step(shard_svc_session *s, const shard_svc_step *step, const shard_svc_step_reply **reply,
                           rpc_status *st);

/* What a watch says about a reply still awaited. */
enum {
    SHARD_SVC_WAIT = 0,    /* go on waiting */
    SHARD_SVC_CANCEL = 1,  /* the reply is no longer wanted: cancel the call (RPC_CANCELLED) */
    SHARD_SVC_GIVE_UP = 2, /* stop waiting (RPC_DEADLINE_EXCEEDED) */
};
/* Called on the waiting thread about every 50 ms while a reply is awaited, with the time waited
 * so far; returns one of the above. */
typedef int (*shard_svc_watch_fn)(void *arg, int64_t waited_ms);

/* Sets how long each next reply of s is waited for at most (< 0: forever) and a watch (NULL:
 * none). A cancelled call is seen by the server as its client going away. */
void shard_svc_session_set_wait(shard_svc_session *s, int timeout_ms, shard_svc_watch_fn fn, void *arg);

/* Frees the last step reply now (its view ends) instead of at the next step. */
void shard_svc_session_drop_reply(shard_svc_session *s);

/* Ends the session: sends a close with `reason` (NULL: none, a half-close only, which
 * servers read the same), half-closes and frees, without waiting. NULL is a no-op. */
void shard_svc_session_close(shard_svc_session *s, const char *reason);

/* ---- client: unary calls ----------------------------------------------------------------- */

/* Calls Info: RPC_OK with *out a new reply (free with shard_svc_info_free), else a code and
 * *out NULL. timeout_ms <= 0: no deadline. */
int shard_svc_info_get(rpc_channel *ch, int timeout_ms, shard_svc_info **out, rpc_status *st);
/* Frees a reply of shard_svc_info_get. NULL is a no-op. */
void shard_svc_info_free(shard_svc_info *info);
/* For fuzzing: `data` as a received Info reply (an RPC_* code as shard_svc_info_get gives for
 * it; on RPC_OK *out is its view, freed with shard_svc_info_free). */
int shard_svc_info_fuzz_one(const void *data, size_t len, shard_svc_info **out);

/* Calls LoadAdapter: adapter `id` from `state` (borrowed for the call); RPC_OK with *bytes the
 * memory the server holds for it, else the transport's or the server's code (message in st). */
int shard_svc_adapter_load(rpc_channel *ch, const char *id, const shard_svc_state *state, int timeout_ms,
                           int64_t *bytes, rpc_status *st);
/* Calls UnloadAdapter for adapter `id`: RPC_OK, or a code (RPC_NOT_FOUND: the server holds none). */
int shard_svc_adapter_unload(rpc_channel *ch, const char *id, int timeout_ms, rpc_status *st);

/* A Forward call's reply, held for the views into it. */
typedef struct shard_svc_forward_held shard_svc_forward_held;

/* Calls Forward with one sequence `in`, output spec `spec` (want_hidden at the head gives the
 * final normed hidden states), no adapter, the span [first, last) the caller expects and the
 * returned hidden states in wire dtype `wire_dtype`: RPC_OK with *out viewing the sequence's
 * output (valid until shard_svc_forward_free(*held)), else the transport's or the server's code
 * (UNEXPECTED_REPLY for a reply without exactly one output). */
int shard_svc_forward_one(rpc_channel *ch, const shard_svc_input *in, const shard_svc_output_spec *spec, int32_t first,
                          int32_t last, int wire_dtype, int timeout_ms, shard_svc_forward_held **held,
                          const shard_svc_output **out, rpc_status *st);
/* Frees a held Forward reply. NULL is a no-op. */
void shard_svc_forward_free(shard_svc_forward_held *h);

/* Calls Echo asking reply_bytes back; RPC_OK or a code. */
int shard_svc_echo(rpc_channel *ch, int reply_bytes, int timeout_ms, rpc_status *st);

/* Measures the link to the server on ch: two small Echo round trips (the faster is the RTT)
 * then one of big_bytes (its extra time gives the bandwidth), each bounded by timeout_ms.
 * RPC_OK with *rtt_s (seconds) and *bandwidth (bytes/s); else the failed call's code. */
int shard_svc_measure_link(rpc_channel *ch, int big_bytes, int timeout_ms, double *rtt_s, double *bandwidth,
                           rpc_status *st);

#endif
