/* train-svc.c -- fusion.Train's messages packed from and unpacked into the plain structs of train-svc.h. */
#include "train-svc.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fusion.pb-c.h"
#include "rpc.h"
#include "status.h"
#include "svc-impl.h"

/* ---- methods ---------------------------------------------------------------------------- */

/* Each method's path and message types, and whether its handler holds its reply (done owed). */
static const struct {
    const char *path;
    const ProtobufCMessageDescriptor *req, *rep;
    bool holds;
} methods[TRAIN_SVC_N_METHODS] = {
    [TRAIN_SVC_OPEN] = {RPC_TRAIN_OPEN, &fusion__train_open__descriptor, &fusion__train_opened__descriptor, true},
    [TRAIN_SVC_FORWARD] = {RPC_TRAIN_FORWARD, &fusion__train_forward__descriptor,
                           &fusion__train_forward_reply__descriptor, true},
    [TRAIN_SVC_BACKWARD] = {RPC_TRAIN_BACKWARD, &fusion__train_backward__descriptor,
                            &fusion__train_backward_reply__descriptor, true},
    [TRAIN_SVC_NORM] = {RPC_TRAIN_NORM, &fusion__train_norm__descriptor, &fusion__train_norm_reply__descriptor,
                        false},
    [TRAIN_SVC_STEP] = {RPC_TRAIN_STEP, &fusion__train_step__descriptor, &fusion__train_step_reply__descriptor,
                        false},
    [TRAIN_SVC_GET_STATE] = {RPC_TRAIN_GET_STATE, &fusion__train_state_request__descriptor,
                             &fusion__adapter_state__descriptor, true},
    [TRAIN_SVC_PUT_STATE] = {RPC_TRAIN_PUT_STATE, &fusion__train_put_state__descriptor,
                             &fusion__train_step_reply__descriptor, false},
    [TRAIN_SVC_CLOSE] = {RPC_TRAIN_CLOSE, &fusion__train_close__descriptor, &fusion__train_closed__descriptor,
                         false},
};

/* ---- packing: plain structs -> messages (pointing into the structs) ------------------------- */

/* src[0..n) widened into dst[0..n) (the wire's int64); returns dst, or NULL when n is 0. */
static int64_t *widen(const int32_t *src, size_t n, int64_t *dst) {
    for (size_t i = 0; i < n; i++) dst[i] = src[i];
    return n ? dst : NULL;
}

/* ---- views: messages -> plain structs (pointing into the messages) -------------------------- */

/* Refuses a received job id that is empty, beyond TRAIN_SVC_MAX_ID bytes or holds a control
 * character (INVALID_ARGUMENT naming `what`). A string ends at its first NUL byte. */
static int id_check(const char *id, const char *what, rpc_status *st) {
    if (!*id) return rpc_status_setf(st, RPC_INVALID_ARGUMENT, "%s: empty", what);
    return svc_name_check(id, TRAIN_SVC_MAX_ID, what, st);
}

/* ---- views of requests ---------------------------------------------------------------------- */

/* A received request's views (whichever its method) and the arrays they point to. */
typedef struct req_view {
    const char *job_id;   /* every method's */
    train_svc_open open;
    train_svc_forward fwd;
    train_svc_backward bwd;
    train_svc_step step;
    const train_svc_state *put; /* PutState's; NULL: absent */
    svc_state_view state;     /* Open's or PutState's */
    train_svc_lora lora;  /* Open's */
    shard_svc_input in;   /* Forward's */
    wire_tensor tensor;   /* Forward's input hidden or Backward's grad */
    int32_t *ints;        /* (n_tokens + n_first + n_targets) Forward's, malloc()ed */
} req_view;

/* The TrainOpen's view. */
static int open_view(const Fusion__TrainOpen *m, req_view *rv, rpc_status *st) {
    train_svc_open *v = &rv->open;
    *v = (train_svc_open){.job_id = m->job_id, .keep_activations = m->keep_activations};
    rv->job_id = m->job_id;
    svc_i32 f[] = {{"first_block", m->first_block, &v->first_block},
                   {"last_block", m->last_block, &v->last_block},
                   {"max_tokens", m->max_tokens, &v->max_tokens},
                   {"slots", m->slots, &v->slots},
                   {"idle_timeout_ms", m->idle_timeout_ms, &v->idle_timeout_ms}};
    int rc = id_check(m->job_id, "open.job_id", st);
    if (!rc) rc = svc_narrow(f, sizeof f / sizeof f[0], "open.", st);
    if (!rc && m->lora) {
        rc = svc_lora_view(m->lora, &rv->lora, "open.lora", st);
        v->lora = &rv->lora;
    }
    if (!rc && m->state) {
        rc = svc_state_view_set(m->state, &rv->state, "open.state", st);
        v->state = &rv->state.state;
    }
    return rc;
}

/* The TrainForward's view: tokens, first and targets narrowed into rv->ints. */
static int forward_view(const Fusion__TrainForward *m, req_view *rv, rpc_status *st) {
    train_svc_forward *v = &rv->fwd;
    *v = (train_svc_forward){.job_id = m->job_id, .n_first = m->n_first, .n_targets = m->n_targets,
                             .loss_scale = m->loss_scale, .seed = m->seed, .wire_dtype = (int)m->wire_dtype};
    rv->job_id = m->job_id;
    svc_i32 f[] = {{"slot", m->slot, &v->slot}};
    int rc = id_check(m->job_id, "forward.job_id", st);
    if (!rc) rc = svc_narrow(f, 1, "forward.", st);
    if (rc) return rc;
    size_t n_tok = m->input ? m->input->n_tokens : 0;
    int32_t *ints = malloc((n_tok + m->n_first + m->n_targets + 1) * sizeof *ints);
    if (!ints) return svc_no_memory(st);
    rv->ints = ints;
    if (m->input) {
        rc = svc_input_view(m->input, ints, &rv->in, &rv->tensor, "forward.input", st);
        v->input = &rv->in;
    }
    if (!rc) rc = svc_i32s_view(m->first, m->n_first, ints + n_tok, "forward.first", st);
    if (!rc) rc = svc_i32s_view(m->targets, m->n_targets, ints + n_tok + m->n_first, "forward.targets", st);
    v->first = m->n_first ? ints + n_tok : NULL;
    v->targets = m->n_targets ? ints + n_tok + m->n_first : NULL;
    return rc;
}

/* The TrainBackward's view. */
static int backward_view(const Fusion__TrainBackward *m, req_view *rv, rpc_status *st) {
    train_svc_backward *v = &rv->bwd;
    *v = (train_svc_backward){.job_id = m->job_id, .want_input_grad = m->want_input_grad,
                              .wire_dtype = (int)m->wire_dtype};
    rv->job_id = m->job_id;
    svc_i32 f[] = {{"slot", m->slot, &v->slot}};
    int rc = id_check(m->job_id, "backward.job_id", st);
    if (!rc) rc = svc_narrow(f, 1, "backward.", st);
    if (!rc) rc = svc_tensor_opt_view(m->grad, &rv->tensor, &v->grad, "backward", ".grad", st);
    return rc;
}

/* The TrainStep's view. */
static int step_view(const Fusion__TrainStep *m, req_view *rv, rpc_status *st) {
    rv->step = (train_svc_step){m->job_id, m->step, m->lr, m->grad_scale, m->beta1, m->beta2, m->eps,
                                m->weight_decay, m->discard};
    rv->job_id = m->job_id;
    return id_check(m->job_id, "step.job_id", st);
}

/* The TrainPutState's view. */
static int put_view(const Fusion__TrainPutState *m, req_view *rv, rpc_status *st) {
    rv->job_id = m->job_id;
    int rc = id_check(m->job_id, "put_state.job_id", st);
    if (!rc && m->state) {
        rc = svc_state_view_set(m->state, &rv->state, "put_state.state", st);
        rv->put = &rv->state.state;
    }
    return rc;
}

/* The view of a request that carries only its job id (`what` names it). */
static int id_view(const char *job_id, req_view *rv, const char *what, rpc_status *st) {
    rv->job_id = job_id;
    return id_check(job_id, what, st);
}

/* The views of msg, a received request of method m, in rv (zeroed first; release with
 * req_view_free whatever this returns). RPC_OK or INVALID_ARGUMENT / RESOURCE_EXHAUSTED. */
static int req_view_set(train_svc_method m, const ProtobufCMessage *msg, req_view *rv, rpc_status *st) {
    memset(rv, 0, sizeof *rv);
    switch (m) {
    case TRAIN_SVC_OPEN: return open_view((const Fusion__TrainOpen *)msg, rv, st);
    case TRAIN_SVC_FORWARD: return forward_view((const Fusion__TrainForward *)msg, rv, st);
    case TRAIN_SVC_BACKWARD: return backward_view((const Fusion__TrainBackward *)msg, rv, st);
    case TRAIN_SVC_NORM: return id_view(((const Fusion__TrainNorm *)msg)->job_id, rv, "norm.job_id", st);
    case TRAIN_SVC_STEP: return step_view((const Fusion__TrainStep *)msg, rv, st);
    case TRAIN_SVC_GET_STATE:
        return id_view(((const Fusion__TrainStateRequest *)msg)->job_id, rv, "get_state.job_id", st);
    case TRAIN_SVC_PUT_STATE: return put_view((const Fusion__TrainPutState *)msg, rv, st);
    case TRAIN_SVC_CLOSE: return id_view(((const Fusion__TrainClose *)msg)->job_id, rv, "close.job_id", st);
    default: return rpc_status_setf(st, RPC_INVALID_ARGUMENT, "no Train method %d", (int)m);
    }
}

/* Frees what rv's views allocated. */
static void req_view_free(req_view *rv) {
    free(rv->ints);
    rv->ints = NULL;
}

int train_svc_request_check(train_svc_method method, const void *data, size_t len, size_t max_bytes,
                            rpc_status *st) {
    if ((unsigned)method >= TRAIN_SVC_N_METHODS)
        return rpc_status_setf(st, RPC_INVALID_ARGUMENT, "no Train method %d", (int)method);
    ProtobufCMessage *msg = NULL;
    int rc = rpc_msg_unpack(methods[method].req, data, len, max_bytes, &msg, st);
    if (!rc) {
        req_view rv;
        rc = req_view_set(method, msg, &rv, st);
        req_view_free(&rv);
    }
    rpc_msg_free(msg);
    return rc;
}

/* ---- server --------------------------------------------------------------------------------- */

/* A reply in flight: its message and the sub-messages that point into the handler's reply,
 * which the handler's hold keeps alive until reply_free. */
typedef struct reply_msg {
    union {
        ProtobufCMessage base; /* first: reply_free casts back */
        Fusion__TrainOpened opened;
        Fusion__TrainForwardReply fwd;
        Fusion__TrainBackwardReply bwd;
        Fusion__TrainNormReply norm;
        Fusion__TrainStepReply step;
        Fusion__TrainClosed closed;
        svc_state_msg state;
    } m;
    Fusion__Tensor tensor; /* Forward's hidden or Backward's grad */
    union {
        train_svc_opened opened;
        train_svc_forward_reply fwd;
        train_svc_backward_reply bwd;
        double sqnorm;
        train_svc_state state;
    } v; /* the handler's reply */
    const train_svc_handlers *h;
    void *hold;
    bool held; /* the handler returned RPC_OK holding the reply: done(ctx, hold) is owed */
} reply_msg;

/* Releases a reply after the layer packed (and sent) it: the handler's hold, then the message. */
static void reply_free(void *ctx, ProtobufCMessage *msg) {
    (void)ctx;
    reply_msg *r = (reply_msg *)msg;
    if (r->held && r->h->done) r->h->done(r->h->ctx, r->hold);
    free(r);
}

/* Runs method m's handler on the request's views; its reply in r->v, what it holds in r->hold. */
static int handle(const train_svc_handlers *h, train_svc_method m, const req_view *rv, reply_msg *r,
                  rpc_status *st) {
    void *c = h->ctx;
    switch (m) {
    case TRAIN_SVC_OPEN: return h->open(c, &rv->open, &r->v.opened, &r->hold, st);
    case TRAIN_SVC_FORWARD: return h->forward(c, &rv->fwd, &r->v.fwd, &r->hold, st);
    case TRAIN_SVC_BACKWARD: return h->backward(c, &rv->bwd, &r->v.bwd, &r->hold, st);
    case TRAIN_SVC_NORM: return h->norm(c, rv->job_id, &r->v.sqnorm, st);
    case TRAIN_SVC_STEP: return h->step(c, &rv->step, st);
    case TRAIN_SVC_GET_STATE: return h->get_state(c, rv->job_id, &r->v.state, &r->hold, st);
    case TRAIN_SVC_PUT_STATE: return h->put_state(c, rv->job_id, rv->put, st);
    case TRAIN_SVC_CLOSE: return h->close(c, rv->job_id, st);
    default: return rpc_status_setf(st, RPC_UNIMPLEMENTED, "no Train method %d", (int)m);
    }
}

/* The reply message of method m packed from the handler's reply r->v (pointing into it). */
static void reply_pack(train_svc_method m, reply_msg *r) {
    if (m == TRAIN_SVC_OPEN) {
        fusion__train_opened__init(&r->m.opened);
        r->m.opened.job_id = svc_str(r->v.opened.job_id);
        r->m.opened.n_params = r->v.opened.n_params;
        r->m.opened.bytes = r->v.opened.bytes;
    } else if (m == TRAIN_SVC_FORWARD) {
        fusion__train_forward_reply__init(&r->m.fwd);
        r->m.fwd.hidden = svc_tensor_opt_pack(r->v.fwd.hidden, &r->tensor);
        r->m.fwd.loss_sum = r->v.fwd.loss_sum;
        r->m.fwd.n_tokens = r->v.fwd.n_tokens;
        r->m.fwd.n_correct = r->v.fwd.n_correct;
    } else if (m == TRAIN_SVC_BACKWARD) {
        fusion__train_backward_reply__init(&r->m.bwd);
        r->m.bwd.grad = svc_tensor_opt_pack(r->v.bwd.grad, &r->tensor);
    } else if (m == TRAIN_SVC_NORM) {
        fusion__train_norm_reply__init(&r->m.norm);
        r->m.norm.sqnorm = r->v.sqnorm;
    } else if (m == TRAIN_SVC_GET_STATE) {
        svc_state_pack(&r->v.state, &r->m.state);
    } else if (m == TRAIN_SVC_CLOSE) {
        fusion__train_closed__init(&r->m.closed);
    } else { /* Step, PutState */
        fusion__train_step_reply__init(&r->m.step);
    }
}

/* Method m of the service: the request's views to its handler, whose reply is packed into a
 * reply_msg (released by reply_free, which runs done once the layer has packed it). */
static int entry(const train_svc_handlers *h, train_svc_method m, const ProtobufCMessage *req,
                 ProtobufCMessage **reply, rpc_status *st) {
    reply_msg *r = calloc(1, sizeof *r);
    if (!r) return svc_no_memory(st);
    r->h = h;
    req_view rv;
    int rc = req_view_set(m, req, &rv, st);
    if (!rc) rc = handle(h, m, &rv, r, st);
    req_view_free(&rv);
    if (rc) {
        free(r);
        return rc;
    }
    r->held = methods[m].holds;
    reply_pack(m, r);
    *reply = &r->m.base;
    return RPC_OK;
}

/* One rpc_unary_fn per method: NAME_entry runs entry() for METHOD. */
#define TRAIN_ENTRY(name, method)                                                                    \
    static int name##_entry(void *ctx, const ProtobufCMessage *req, ProtobufCMessage **reply,          \
                            rpc_status *st) {                                                          \
        return entry(ctx, method, req, reply, st);                                                     \
    }
TRAIN_ENTRY(open, TRAIN_SVC_OPEN)
TRAIN_ENTRY(forward, TRAIN_SVC_FORWARD)
TRAIN_ENTRY(backward, TRAIN_SVC_BACKWARD)
TRAIN_ENTRY(norm, TRAIN_SVC_NORM)
TRAIN_ENTRY(step, TRAIN_SVC_STEP)
TRAIN_ENTRY(get_state, TRAIN_SVC_GET_STATE)
TRAIN_ENTRY(put_state, TRAIN_SVC_PUT_STATE)
TRAIN_ENTRY(close, TRAIN_SVC_CLOSE)
#undef TRAIN_ENTRY

int train_svc_serve(rpc_server *srv, const train_svc_handlers *h) {
    const struct {
        bool on;
        rpc_unary_fn fn;
    } e[TRAIN_SVC_N_METHODS] = {
        [TRAIN_SVC_OPEN] = {h->open != NULL, open_entry},
        [TRAIN_SVC_FORWARD] = {h->forward != NULL, forward_entry},
        [TRAIN_SVC_BACKWARD] = {h->backward != NULL, backward_entry},
        [TRAIN_SVC_NORM] = {h->norm != NULL, norm_entry},
        [TRAIN_SVC_STEP] = {h->step != NULL, step_entry},
        [TRAIN_SVC_GET_STATE] = {h->get_state != NULL, get_state_entry},
        [TRAIN_SVC_PUT_STATE] = {h->put_state != NULL, put_state_entry},
        [TRAIN_SVC_CLOSE] = {h->close != NULL, close_entry},
    };
    for (int m = 0; m < TRAIN_SVC_N_METHODS; m++) {
        if (!e[m].on) continue;
        int rc = rpc_server_add_unary(srv, methods[m].path, methods[m].req, e[m].fn, reply_free, (void *)h);
        if (rc) return rc;
    }
    return FU_OK;
}

/* ---- client --------------------------------------------------------------------------------- */

struct train_svc_reply {
    ProtobufCMessage *msg; /* the received reply; the views point into it */
    train_svc_forward_reply fwd;
    train_svc_backward_reply bwd;
    wire_tensor tensor;    /* Forward's hidden or Backward's grad */
    svc_state_view state;      /* GetState's */
};

void train_svc_reply_free(train_svc_reply *r) {
    if (!r) return;
    rpc_msg_free(r->msg);
    free(r);
}

/* Sends req as method m and waits for its reply, a new message in *rep (rpc_msg_free). */
static int call(rpc_channel *ch, train_svc_method m, const ProtobufCMessage *req, int timeout_ms,
                ProtobufCMessage **rep, rpc_status *st) {
    *rep = NULL;
    return rpc_call_unary(ch, methods[m].path, req, methods[m].rep, rep, timeout_ms, st);
}

/* The same for a reply with nothing to read but its code. */
static int call_void(rpc_channel *ch, train_svc_method m, const ProtobufCMessage *req, int timeout_ms,
                     rpc_status *st) {
    ProtobufCMessage *rep;
    int rc = call(ch, m, req, timeout_ms, &rep, st);
    rpc_msg_free(rep);
    return rc;
}

/* The views of r->msg, the reply of method m (Forward, Backward or GetState). */
static int reply_view(train_svc_method m, train_svc_reply *r, rpc_status *st) {
    if (m == TRAIN_SVC_FORWARD) {
        const Fusion__TrainForwardReply *f = (const Fusion__TrainForwardReply *)r->msg;
        r->fwd = (train_svc_forward_reply){NULL, f->loss_sum, f->n_tokens, f->n_correct};
        return svc_tensor_opt_view(f->hidden, &r->tensor, &r->fwd.hidden, "forward", ".hidden", st);
    }
    if (m == TRAIN_SVC_BACKWARD) {
        const Fusion__TrainBackwardReply *b = (const Fusion__TrainBackwardReply *)r->msg;
        return svc_tensor_opt_view(b->grad, &r->tensor, &r->bwd.grad, "backward", ".grad", st);
    }
    return svc_state_view_set((const Fusion__AdapterState *)r->msg, &r->state, "state", st);
}

/* Sends req as method m and holds its reply for the views in a new *held (RPC_OK), else NULL. */
static int call_held(rpc_channel *ch, train_svc_method m, const ProtobufCMessage *req, int timeout_ms,
                     train_svc_reply **held, rpc_status *st) {
    *held = NULL;
    ProtobufCMessage *msg;
    int rc = call(ch, m, req, timeout_ms, &msg, st);
    if (rc) return rc;
    train_svc_reply *r = calloc(1, sizeof *r);
    if (!r) {
        rpc_msg_free(msg);
        return svc_no_memory(st);
    }
    r->msg = msg;
    rc = reply_view(m, r, st);
    if (rc) {
        train_svc_reply_free(r);
        return rc;
    }
    *held = r;
    return RPC_OK;
}

int train_svc_call_open(rpc_channel *ch, const train_svc_open *req, int timeout_ms, train_svc_opened *out,
                        rpc_status *st) {
    *out = (train_svc_opened){0};
    Fusion__TrainOpen m = FUSION__TRAIN_OPEN__INIT;
    Fusion__LoraSpec lora;
    svc_state_msg state;
    m.job_id = svc_str(req->job_id);
    m.first_block = req->first_block;
    m.last_block = req->last_block;
    if (req->lora) {
        svc_lora_pack(req->lora, &lora);
        m.lora = &lora;
    }
    m.state = svc_state_opt_pack(req->state, &state);
    m.max_tokens = req->max_tokens;
    m.slots = req->slots;
    m.keep_activations = req->keep_activations;
    m.idle_timeout_ms = req->idle_timeout_ms;
    ProtobufCMessage *rep;
    int rc = call(ch, TRAIN_SVC_OPEN, &m.base, timeout_ms, &rep, st);
    if (rc) return rc;
    const Fusion__TrainOpened *o = (const Fusion__TrainOpened *)rep;
    *out = (train_svc_opened){NULL, o->n_params, o->bytes};
    rpc_msg_free(rep);
    return RPC_OK;
}

int train_svc_call_forward(rpc_channel *ch, const train_svc_forward *req, int timeout_ms,
                           const train_svc_forward_reply **out, train_svc_reply **held, rpc_status *st) {
    *out = NULL;
    *held = NULL;
    size_t n_tok = req->input ? req->input->n_tokens : 0;
    int64_t *wide = malloc((n_tok + req->n_first + req->n_targets + 1) * sizeof *wide);
    if (!wide) return svc_no_memory(st);
    Fusion__TrainForward m = FUSION__TRAIN_FORWARD__INIT;
    Fusion__Input in;
    Fusion__Tensor hidden;
    m.job_id = svc_str(req->job_id);
    m.slot = req->slot;
    if (req->input) {
        svc_input_pack(req->input, wide, &in, &hidden);
        m.input = &in;
    }
    m.n_first = req->n_first;
    m.first = widen(req->first, req->n_first, wide + n_tok);
    m.n_targets = req->n_targets;
    m.targets = widen(req->targets, req->n_targets, wide + n_tok + req->n_first);
    m.loss_scale = req->loss_scale;
    m.seed = req->seed;
    m.wire_dtype = (Fusion__Dtype)req->wire_dtype;
    int rc = call_held(ch, TRAIN_SVC_FORWARD, &m.base, timeout_ms, held, st);
    free(wide);
    if (!rc) *out = &(*held)->fwd;
    return rc;
}

int train_svc_call_backward(rpc_channel *ch, const train_svc_backward *req, int timeout_ms,
                            const train_svc_backward_reply **out, train_svc_reply **held, rpc_status *st) {
    *out = NULL;
    Fusion__TrainBackward m = FUSION__TRAIN_BACKWARD__INIT;
    Fusion__Tensor grad;
    m.job_id = svc_str(req->job_id);
    m.slot = req->slot;
    m.grad = svc_tensor_opt_pack(req->grad, &grad);
    m.want_input_grad = req->want_input_grad;
    m.wire_dtype = (Fusion__Dtype)req->wire_dtype;
    int rc = call_held(ch, TRAIN_SVC_BACKWARD, &m.base, timeout_ms, held, st);
    if (!rc) *out = &(*held)->bwd;
    return rc;
}

int train_svc_call_norm(rpc_channel *ch, const char *job_id, int timeout_ms, double *sqnorm, rpc_status *st) {
    *sqnorm = 0;
    Fusion__TrainNorm m = FUSION__TRAIN_NORM__INIT;
    m.job_id = svc_str(job_id);
    ProtobufCMessage *rep;
    int rc = call(ch, TRAIN_SVC_NORM, &m.base, timeout_ms, &rep, st);
    if (rc) return rc;
    *sqnorm = ((const Fusion__TrainNormReply *)rep)->sqnorm;
    rpc_msg_free(rep);
    return RPC_OK;
}

int train_svc_call_step(rpc_channel *ch, const train_svc_step *req, int timeout_ms, rpc_status *st) {
    Fusion__TrainStep m = FUSION__TRAIN_STEP__INIT;
    m.job_id = svc_str(req->job_id);
    m.step = req->step;
    m.lr = req->lr;
    m.grad_scale = req->grad_scale;
    m.beta1 = req->beta1;
    m.beta2 = req->beta2;
    m.eps = req->eps;
    m.weight_decay = req->weight_decay;
    m.discard = req->discard;
    return call_void(ch, TRAIN_SVC_STEP, &m.base, timeout_ms, st);
}

int train_svc_call_get_state(rpc_channel *ch, const char *job_id, int timeout_ms, const train_svc_state **out,
                             train_svc_reply **held, rpc_status *st) {
    *out = NULL;
    Fusion__TrainStateRequest m = FUSION__TRAIN_STATE_REQUEST__INIT;
    m.job_id = svc_str(job_id);
    int rc = call_held(ch, TRAIN_SVC_GET_STATE, &m.base, timeout_ms, held, st);
    if (!rc) *out = &(*held)->state.state;
    return rc;
}

int train_svc_call_put_state(rpc_channel *ch, const char *job_id, const train_svc_state *state, int timeout_ms,
                             rpc_status *st) {
    Fusion__TrainPutState m = FUSION__TRAIN_PUT_STATE__INIT;
    svc_state_msg sm;
    m.job_id = svc_str(job_id);
    m.state = svc_state_opt_pack(state, &sm);
    return call_void(ch, TRAIN_SVC_PUT_STATE, &m.base, timeout_ms, st);
}

int train_svc_call_close(rpc_channel *ch, const char *job_id, int timeout_ms, rpc_status *st) {
    Fusion__TrainClose m = FUSION__TRAIN_CLOSE__INIT;
    m.job_id = svc_str(job_id);
    return call_void(ch, TRAIN_SVC_CLOSE, &m.base, timeout_ms, st);
}
