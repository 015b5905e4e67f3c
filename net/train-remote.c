/* train-remote.c -- a trn_stage whose span runs on a shard server, through fusion.Train. */
#include "train-remote.h"

#include <stdlib.h>
#include <string.h>

#include "grow.h"
#include "status.h"
#include "train-svc.h"
#include "wire.h"

#define TRN_REMOTE_TIMEOUT_MS 600000
#define TRN_REMOTE_MAX_SLOTS 64

struct trn_remote {
    rpc_channel *ch;
    trn_remote_options o;
    char job_id[TRAIN_SVC_MAX_ID + 1];
    int64_t bytes;
    uint8_t *enc;      /* encoded hidden states / gradients / state */
    size_t enc_cap;
    int rows[TRN_REMOTE_MAX_SLOTS]; /* rows of the forward each slot holds, 0: none */
};

/* ---- status -------------------------------------------------------------------------------- */

/* The fu status of a failed call: FU_ERR_NETWORK when the server (or its job) is gone. */
static int remote_fail(const trn_remote *r, const char *what, int code, const rpc_status *st) {
    const bool gone = code == RPC_UNAVAILABLE || code == RPC_DEADLINE_EXCEEDED || code == RPC_CANCELLED ||
                      code == RPC_ABORTED || code == RPC_NOT_FOUND;
    return fu_errorf(gone ? FU_ERR_NETWORK : rpc_code_to_fu(code), "training stage [%d, %d) %s: %s%s%s",
                     r->o.first_block, r->o.last_block, what, rpc_code_str(code), st->message[0] ? ": " : "",
                     st->message);
}

static int remote_timeout(const trn_remote *r) { return r->o.timeout_ms > 0 ? r->o.timeout_ms : TRN_REMOTE_TIMEOUT_MS; }

/* ---- tensors --------------------------------------------------------------------------------- */

/* x (rows, cols) encoded into r->enc as dtype, viewed by t (shape: 2 entries of t's). */
static int remote_encode(trn_remote *r, const float *x, int64_t rows, int64_t cols, int dtype, wire_tensor *t,
                         int64_t *shape) {
    const size_t n = (size_t)rows * (size_t)cols, bytes = wire_data_bytes(dtype, n);
    if (fu_grow((void **)&r->enc, &r->enc_cap, bytes + 1, 1)) return fu_errorf(FU_ERR_NOMEM, "training wire buffer");
    int rc = wire_encode(x, n, dtype, 0, r->enc, NULL);
    if (rc) return rc;
    shape[0] = rows;
    shape[1] = cols;
    *t = (wire_tensor){.dtype = dtype, .n_shape = cols ? 2 : 1, .shape = shape, .data = r->enc, .data_len = bytes};
    return FU_OK;
}

/* Decodes a received (rows, D) tensor into out, refusing another shape. */
static int remote_decode(const trn_remote *r, const wire_tensor *t, int rows, const char *what, float *out) {
    if (!t || t->n_shape != 2 || t->shape[0] != rows || t->shape[1] != r->o.dim)
        return fu_errorf(FU_ERR_FORMAT, "training stage [%d, %d): %s is not (%d, %d)", r->o.first_block,
                         r->o.last_block, what, rows, r->o.dim);
    return wire_decode(t->data, t->data_len, t->scales, t->scales_len, t->dtype, t->block_size,
                       (size_t)rows * (size_t)r->o.dim, out, what);
}

static int remote_dtype(const trn_remote *r) { return r->o.wire_dtype ? r->o.wire_dtype : WIRE_BF16; }

/* ---- the stage ------------------------------------------------------------------------------- */

static int remote_forward(void *p, int slot, const trn_batch *b, float *out, trn_loss *loss) {
    trn_remote *r = p;
    if (slot < 0 || slot >= TRN_REMOTE_MAX_SLOTS) return fu_errorf(FU_ERR_INVALID, "training stage: slot %d", slot);
    wire_tensor ht;
    int64_t shape[2];
    shard_svc_input in = {b->tokens, b->tokens ? (size_t)b->n_tokens : 0, NULL};
    int rc = FU_OK;
    if (!r->o.embed && (rc = remote_encode(r, b->embd, b->n_tokens, r->o.dim, remote_dtype(r), &ht, shape))) return rc;
    if (!r->o.embed) in = (shard_svc_input){NULL, 0, &ht};
    train_svc_forward req = {r->job_id, slot, &in, b->first, (size_t)b->n_tokens, r->o.head ? b->targets : NULL,
                             r->o.head ? (size_t)b->n_tokens : 0, b->loss_scale, b->seed, remote_dtype(r)};
    const train_svc_forward_reply *rep;
    train_svc_reply *held = NULL;
    rpc_status st = {0};
    int code = train_svc_call_forward(r->ch, &req, remote_timeout(r), &rep, &held, &st);
    if (code) return remote_fail(r, "forward", code, &st);
    if (r->o.head && loss) {
        loss->sum += rep->loss_sum;
        loss->n_tokens += rep->n_tokens;
        loss->n_correct += rep->n_correct;
    }
    if (out && !r->o.head) rc = remote_decode(r, rep->hidden, b->n_tokens, "the forward's hidden states", out);
    train_svc_reply_free(held);
    if (!rc) r->rows[slot] = b->n_tokens;
    return rc;
}

static int remote_backward(void *p, int slot, const float *dy, float *dx) {
    trn_remote *r = p;
    if (slot < 0 || slot >= TRN_REMOTE_MAX_SLOTS || !r->rows[slot])
        return fu_errorf(FU_ERR_INVALID, "training stage: slot %d holds no forward", slot);
    const int T = r->rows[slot];
    r->rows[slot] = 0;
    wire_tensor gt;
    int64_t shape[2];
    int rc = r->o.head ? FU_OK : remote_encode(r, dy, T, r->o.dim, remote_dtype(r), &gt, shape);
    if (rc) return rc;
    train_svc_backward req = {r->job_id, slot, r->o.head ? NULL : &gt, dx != NULL, remote_dtype(r)};
    const train_svc_backward_reply *rep;
    train_svc_reply *held = NULL;
    rpc_status st = {0};
    int code = train_svc_call_backward(r->ch, &req, remote_timeout(r), &rep, &held, &st);
    if (code) return remote_fail(r, "backward", code, &st);
    if (dx) rc = remote_decode(r, rep->grad, T, "the input gradient", dx);
    train_svc_reply_free(held);
    return rc;
}

static int remote_sqnorm(void *p, double *out) {
    trn_remote *r = p;
    rpc_status st = {0};
    int code = train_svc_call_norm(r->ch, r->job_id, remote_timeout(r), out, &st);
    return code ? remote_fail(r, "norm", code, &st) : FU_OK;
}

/* A Step call: AdamW, or (discard) clearing the gradients. */
static int remote_step_call(trn_remote *r, const trn_adamw *h, float lr, float grad_scale, int64_t t, bool discard) {
    train_svc_step req = {r->job_id, t, lr, grad_scale, h ? h->beta1 : 0, h ? h->beta2 : 0, h ? h->eps : 0,
                          h ? h->weight_decay : 0, discard};
    rpc_status st = {0};
    int code = train_svc_call_step(r->ch, &req, remote_timeout(r), &st);
    return code ? remote_fail(r, discard ? "discard" : "step", code, &st) : FU_OK;
}

static int remote_step(void *p, const trn_adamw *h, float lr, float grad_scale, int64_t t) {
    return remote_step_call(p, h, lr, grad_scale, t, false);
}

static int remote_zero_grad(void *p) { return remote_step_call(p, NULL, 0, 0, 0, true); }

/* The server drops a slot's forward when the slot is used again. */
static void remote_drop(void *p, int slot) {
    trn_remote *r = p;
    if (slot >= 0 && slot < TRN_REMOTE_MAX_SLOTS) r->rows[slot] = 0;
}

/* Decodes a flat F32 tensor of n floats into a new array *out. */
static int state_array(const wire_tensor *t, size_t n, const char *what, float **out) {
    if (!t || t->n_shape != 1 || t->shape[0] != (int64_t)n || t->dtype != WIRE_F32)
        return fu_errorf(FU_ERR_FORMAT, "training state: %s is not F32 (%zu)", what, n);
    if (!(*out = malloc(n * sizeof(float) + 1))) return fu_errorf(FU_ERR_NOMEM, "training state");
    return wire_decode(t->data, t->data_len, NULL, 0, WIRE_F32, 0, n, *out, what);
}

static int remote_get_state(void *p, trn_state *out) {
    trn_remote *r = p;
    const train_svc_state *rep;
    train_svc_reply *held = NULL;
    rpc_status st = {0};
    int code = train_svc_call_get_state(r->ch, r->job_id, remote_timeout(r), &rep, &held, &st);
    if (code) return remote_fail(r, "state", code, &st);
    *out = (trn_state){.first = rep->first_block, .last = rep->last_block};
    if (rep->params && rep->params->n_shape == 1 && rep->params->shape[0] > 0) out->n = (size_t)rep->params->shape[0];
    int rc = out->n ? FU_OK : fu_errorf(FU_ERR_FORMAT, "training state: no params");
    if (!rc) rc = state_array(rep->params, out->n, "params", &out->params);
    if (!rc) rc = state_array(rep->moment1, out->n, "moment1", &out->m1);
    if (!rc) rc = state_array(rep->moment2, out->n, "moment2", &out->m2);
    train_svc_reply_free(held);
    if (rc) trn_state_clear(out);
    return rc;
}

/* s as an AdapterState of flat F32 tensors (t, shape: 3 each), encoded into one buffer of r. */
static int remote_state_msg(trn_remote *r, const trn_state *s, wire_tensor *t, int64_t (*shape)[2],
                            train_svc_state *msg) {
    const float *arr[3] = {s->params, s->m1, s->m2};
    const size_t bytes = s->n * sizeof(float);
    if (fu_grow((void **)&r->enc, &r->enc_cap, 3 * bytes + 1, 1)) return fu_errorf(FU_ERR_NOMEM, "training state");
    for (int i = 0; i < 3; i++) {
        if (!arr[i]) continue;
        wire_encode(arr[i], s->n, WIRE_F32, 0, r->enc + (size_t)i * bytes, NULL);
        shape[i][0] = (int64_t)s->n;
        t[i] = (wire_tensor){.dtype = WIRE_F32, .n_shape = 1, .shape = shape[i], .data = r->enc + (size_t)i * bytes,
                             .data_len = bytes};
    }
    *msg = (train_svc_state){s->first, s->last, NULL, &t[0], s->m1 ? &t[1] : NULL, s->m2 ? &t[2] : NULL};
    return FU_OK;
}

static int remote_put_state(void *p, const trn_state *s) {
    trn_remote *r = p;
    wire_tensor t[3];
    int64_t shape[3][2];
    train_svc_state msg;
    int rc = remote_state_msg(r, s, t, shape, &msg);
    if (rc) return rc;
    rpc_status st = {0};
    int code = train_svc_call_put_state(r->ch, r->job_id, &msg, remote_timeout(r), &st);
    if (code) return remote_fail(r, "put state", code, &st);
    memset(r->rows, 0, sizeof r->rows);
    return FU_OK;
}

static const trn_stage_vt remote_vt = {remote_forward, remote_backward,  remote_sqnorm,    remote_step,
                                       remote_drop,    remote_zero_grad, remote_get_state, remote_put_state};

trn_stage trn_remote_stage(trn_remote *r) { return (trn_stage){&remote_vt, r}; }

int64_t trn_remote_bytes(const trn_remote *r) { return r->bytes; }

/* ---- open and close ----------------------------------------------------------------------------- */

/* The LoraSpec of a config (names: LORA_N_TARGETS entries). */
static train_svc_lora remote_lora(const trn_remote_options *o, const char **names) {
    size_t n = 0;
    for (int t = 0; t < LORA_N_TARGETS; t++)
        if (o->lora->targets & LORA_TARGET_BIT(t)) names[n++] = lora_target_name((lora_target)t);
    return (train_svc_lora){o->lora->r, o->lora->alpha, o->lora->dropout, o->lora->use_rslora, names, n, o->init_seed};
}

int trn_remote_open(rpc_channel *ch, const trn_remote_options *o, const trn_state *state, trn_remote **out) {
    *out = NULL;
    if (!o->job_id || !o->lora || o->slots < 1 || o->slots > TRN_REMOTE_MAX_SLOTS || o->dim < 1)
        return fu_errorf(FU_ERR_INVALID, "training stage: bad options (job id, LoRA config, slots 1..%d, dim)",
                         TRN_REMOTE_MAX_SLOTS);
    trn_remote *r = calloc(1, sizeof *r);
    if (!r) return fu_errorf(FU_ERR_NOMEM, "training stage");
    r->ch = ch;
    r->o = *o;
    snprintf(r->job_id, sizeof r->job_id, "%s", o->job_id);
    r->o.job_id = r->job_id;
    const char *names[LORA_N_TARGETS];
    train_svc_lora lora = remote_lora(o, names);
    wire_tensor t[3];
    int64_t shape[3][2];
    train_svc_state sm;
    int rc = state ? remote_state_msg(r, state, t, shape, &sm) : FU_OK;
    if (state) sm.lora = &lora;
    train_svc_open req = {r->job_id, o->first_block, o->last_block, &lora, state ? &sm : NULL, o->max_tokens,
                          o->slots, o->keep_activations, o->idle_timeout_ms};
    train_svc_opened rep = {0};
    rpc_status st = {0};
    int code = rc ? RPC_OK : train_svc_call_open(ch, &req, remote_timeout(r), &rep, &st);
    if (!rc && code) rc = remote_fail(r, "open", code, &st);
    if (rc) {
        free(r->enc);
        free(r);
        return rc;
    }
    r->bytes = rep.bytes;
    *out = r;
    return FU_OK;
}

void trn_remote_close(trn_remote *r) {
    if (!r) return;
    rpc_status st;
    train_svc_call_close(r->ch, r->job_id, 1000, &st);
    free(r->enc);
    free(r);
}
