/* train-svc.h -- the fusion.Train service in plain C: fine-tuning a LoRA adapter through shard servers.
 *
 * Role: the one place that knows fusion.Train's messages (net/proto/fusion.proto,
 * "Fine-tuning"). The shard server answers them with a trainer per job
 * (model/train.h); the coordinator's remote stages (net/train-remote.h) call
 * them. Every struct mirrors the proto message of the same name (TrainOpen ->
 * train_svc_open, ...), with the same meanings; see the proto. Sub-messages
 * are pointers, NULL when absent; repeated fields a pointer and a count.
 *
 * Received values are checked here only for what the structs cannot carry,
 * refused with INVALID_ARGUMENT naming the field: integers (int64 on the
 * wire) outside int32 (token ids outside 0..INT32_MAX; `first` and `targets`
 * entries outside int32), a job id that is empty, over TRAIN_SVC_MAX_ID bytes
 * or holds a control character (a string ends at its first NUL), target
 * module names over TRAIN_SVC_MAX_NAME bytes or with a control character,
 * more than TRAIN_SVC_MAX_TARGETS of them. Everything else (spans, shapes,
 * dtypes, finite values) is the receiver's to validate.
 *
 * Ownership: structs passed in are borrowed and packed before the call
 * returns. Structs handed out are views into a received message owned by
 * this module: a server handler's request lives for the handler's call; a
 * client's reply lives until train_svc_reply_free(). Threads: stateless and
 * thread-safe; handlers run on the RPC server's worker threads, several at
 * once (jobs are the handler's to serialize).
 */
#ifndef FU_TRAIN_SVC_H
#define FU_TRAIN_SVC_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "rpc-base.h"
#include "shard-svc.h"
#include "wire.h"

#define TRAIN_SVC_MAX_ID 128     /* longest job id, bytes */
#define TRAIN_SVC_MAX_NAME SHARD_SVC_MAX_TARGET_NAME /* longest target module name, bytes */
#define TRAIN_SVC_MAX_TARGETS SHARD_SVC_MAX_TARGETS  /* most target module names */

/* ---- messages --------------------------------------------------------------------------- */

/* LoraSpec and AdapterState: the Shard service's views (LoadAdapter carries them too). */
typedef shard_svc_lora train_svc_lora;
typedef shard_svc_state train_svc_state;

/* TrainOpen. */
typedef struct train_svc_open {
    const char *job_id;
    int32_t first_block, last_block;
    const train_svc_lora *lora;       /* NULL: absent (refused by servers) */
    const train_svc_state *state;     /* NULL: a fresh adapter */
    int32_t max_tokens, slots;
    bool keep_activations;
    int32_t idle_timeout_ms;
} train_svc_open;

/* TrainOpened. */
typedef struct train_svc_opened {
    const char *job_id;
    int64_t n_params, bytes;
} train_svc_opened;

/* TrainForward. */
typedef struct train_svc_forward {
    const char *job_id;
    int32_t slot;
    const shard_svc_input *input;     /* NULL: absent (refused by servers) */
    const int32_t *first;             /* (n_first) */
    size_t n_first;
    const int32_t *targets;           /* (n_targets) */
    size_t n_targets;
    float loss_scale;
    uint64_t seed;
    int wire_dtype;                   /* WIRE_*; 0: BF16 */
} train_svc_forward;

/* TrainForwardReply. */
typedef struct train_svc_forward_reply {
    const wire_tensor *hidden;        /* NULL: none (the head) */
    double loss_sum;
    int64_t n_tokens, n_correct;
} train_svc_forward_reply;

/* TrainBackward. */
typedef struct train_svc_backward {
    const char *job_id;
    int32_t slot;
    const wire_tensor *grad;          /* NULL: none (the head) */
    bool want_input_grad;
    int wire_dtype;                   /* WIRE_*; 0: BF16 */
} train_svc_backward;

/* TrainBackwardReply. */
typedef struct train_svc_backward_reply {
    const wire_tensor *grad;          /* NULL: not asked for */
} train_svc_backward_reply;

/* TrainStep. */
typedef struct train_svc_step {
    const char *job_id;
    int64_t step;
    float lr, grad_scale, beta1, beta2, eps, weight_decay;
    bool discard;
} train_svc_step;

/* ---- server ------------------------------------------------------------------------------- */

/* Handlers of the Train service; each returns RPC_OK or a code with the reason in st
 * (`return rpc_status_setf(st, RPC_NOT_FOUND, ...)`). A NULL handler leaves its method
 * unimplemented. Replies are zeroed before the call; a reply's pointers (tensors, strings)
 * must stay valid until done(ctx, *hold) runs after it was packed, which happens only when
 * the handler returned RPC_OK (on failure the handler keeps nothing). */
typedef struct train_svc_handlers {
    void *ctx;
    int (*open)(void *ctx, const train_svc_open *req, train_svc_opened *reply, void **hold, rpc_status *st);
    int (*forward)(void *ctx, const train_svc_forward *req, train_svc_forward_reply *reply, void **hold,
                   rpc_status *st);
    int (*backward)(void *ctx, const train_svc_backward *req, train_svc_backward_reply *reply, void **hold,
                    rpc_status *st);
    int (*norm)(void *ctx, const char *job_id, double *sqnorm, rpc_status *st);
    int (*step)(void *ctx, const train_svc_step *req, rpc_status *st);
    int (*get_state)(void *ctx, const char *job_id, train_svc_state *reply, void **hold, rpc_status *st);
    int (*put_state)(void *ctx, const char *job_id, const train_svc_state *state, rpc_status *st);
    int (*close)(void *ctx, const char *job_id, rpc_status *st);
    void (*done)(void *ctx, void *hold); /* NULL: nothing to release */
} train_svc_handlers;

/* Registers the Train service's methods on srv (before rpc_server_start); h is borrowed,
 * with its ctx, until rpc_server_free. FU_OK or a status. */
int train_svc_serve(rpc_server *srv, const train_svc_handlers *h);

/* ---- client ------------------------------------------------------------------------------- */

/* A received reply; its views live until train_svc_reply_free. */
typedef struct train_svc_reply train_svc_reply;
void train_svc_reply_free(train_svc_reply *r); /* NULL is a no-op */

/* Each call sends its request on ch and waits up to timeout_ms (<= 0: no deadline): RPC_OK
 * with the reply's view set (and, where there is one, *held owning it), else the transport's
 * or the server's code with the server's message in st, and nothing held. Open holds nothing:
 * out->job_id is NULL (the id is the request's). */
int train_svc_call_open(rpc_channel *ch, const train_svc_open *req, int timeout_ms, train_svc_opened *out,
                        rpc_status *st);
int train_svc_call_forward(rpc_channel *ch, const train_svc_forward *req, int timeout_ms,
                           const train_svc_forward_reply **out, train_svc_reply **held, rpc_status *st);
int train_svc_call_backward(rpc_channel *ch, const train_svc_backward *req, int timeout_ms,
                            const train_svc_backward_reply **out, train_svc_reply **held, rpc_status *st);
int train_svc_call_norm(rpc_channel *ch, const char *job_id, int timeout_ms, double *sqnorm, rpc_status *st);
int train_svc_call_step(rpc_channel *ch, const train_svc_step *req, int timeout_ms, rpc_status *st);
int train_svc_call_get_state(rpc_channel *ch, const char *job_id, int timeout_ms, const train_svc_state **out,
                             train_svc_reply **held, rpc_status *st);
int train_svc_call_put_state(rpc_channel *ch, const char *job_id, const train_svc_state *state, int timeout_ms,
                             rpc_status *st);
int train_svc_call_close(rpc_channel *ch, const char *job_id, int timeout_ms, rpc_status *st);

/* ---- decoding without a transport (fuzzing, tests) ---------------------------------------- */

/* Which request train_svc_request_decode reads. */
typedef enum train_svc_method {
    TRAIN_SVC_OPEN = 0,
    TRAIN_SVC_FORWARD,
    TRAIN_SVC_BACKWARD,
    TRAIN_SVC_NORM,
    TRAIN_SVC_STEP,
    TRAIN_SVC_GET_STATE,
    TRAIN_SVC_PUT_STATE,
    TRAIN_SVC_CLOSE,
    TRAIN_SVC_N_METHODS,
} train_svc_method;

/* Decodes wire bytes as the request of `method` and builds its view as the server would,
 * then frees both: RPC_OK, or the code the server would answer (INVALID_ARGUMENT for
 * malformed bytes or a field refused above, RESOURCE_EXHAUSTED past max_bytes). */
int train_svc_request_check(train_svc_method method, const void *data, size_t len, size_t max_bytes,
                            rpc_status *st);

#endif
