/* shard-rpc.c -- fusion.Shard over the RPC layer: translates messages to shard-core calls. */
#include "shard-rpc.h"

#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "clock.h"
#include "fusion.pb-c.h"
#include "log.h"
#include "rpc.h"
#include "status.h"
#include "wire.h"

#define SHARD_VERSION "fusion 0.1.0"
#define SHARD_MAX_CHAIN 64

/* A span's core and the handlers using it. */
typedef struct core_slot {
    shard_core *core;
    int users;
} core_slot;

struct shard_server {
    shard_core *_Atomic core; /* the current span's; NULL while a spare (shard_server_set_core) */
    pthread_mutex_t cmu;      /* guards slot[] */
    core_slot slot[2];        /* [0]: current, [1]: the span given up by the last move (drains) */
    atomic_bool old_closing;  /* the old span's drain time is over: its sessions end */
    shard_server_config cfg;
    char *advertise;
    rpc_server *rpc;
    atomic_bool draining;
    atomic_uint_fast64_t fwd_counter;
};

/* A growable byte/float buffer reused across a session's steps. */
typedef struct sbuf {
    void *p;
    size_t cap;
} sbuf;

static void *sbuf_get(sbuf *b, size_t bytes) {
    if (bytes > b->cap) {
        size_t cap = b->cap ? b->cap : 4096;
        while (cap < bytes) cap *= 2;
        void *q = realloc(b->p, cap);
        if (!q) return NULL;
        b->p = q;
        b->cap = cap;
    }
    return b->p;
}

/* ---- tensors ------------------------------------------------------------------ */

/* Decodes a hidden-state tensor (n, D) into floats (buffer from `buf`). */
static int decode_hidden(const Fusion__Tensor *t, int D, int *n_out, sbuf *buf, const float **out,
                         rpc_status *st) {
    if (t->n_shape != 2 || t->shape[1] != D || t->shape[0] <= 0 || t->shape[0] > (1 << 20))
        return rpc_status_setf(st, RPC_INVALID_ARGUMENT,
                               "input.hidden: shape must be (n, %d) with n >= 1", D);
    int dtype = (int)t->dtype, block = t->block_size;
    if (!wire_dtype_valid(dtype))
        return rpc_status_setf(st, RPC_INVALID_ARGUMENT, "input.hidden: unknown dtype %d", dtype);
    if (dtype == WIRE_INT8_BLOCK && t->scale_dtype != FUSION__DTYPE__DTYPE_F32 &&
        t->scale_dtype != FUSION__DTYPE__DTYPE_UNSPECIFIED)
        return rpc_status_setf(st, RPC_INVALID_ARGUMENT, "input.hidden: int8 scales must be f32");
    size_t n = (size_t)t->shape[0] * (size_t)D;
    float *f = sbuf_get(buf, n * sizeof(float));
    if (!f) return rpc_status_setf(st, RPC_RESOURCE_EXHAUSTED, "out of memory");
    int rc = wire_decode(t->data.data, t->data.len, t->scales.data, t->scales.len, dtype, block, n, f,
                         "input.hidden");
    if (rc) return rpc_status_from_fu(st, rc);
    *n_out = (int)t->shape[0];
    *out = f;
    return RPC_OK;
}

/* Fills t with x (rows, cols) encoded as dtype into bytes from `buf`. */
static int encode_tensor(Fusion__Tensor *t, int64_t *shape, const float *x, int64_t rows, int64_t cols,
                         int dtype, int block, sbuf *buf) {
    size_t n = (size_t)(rows * cols);
    size_t db = wire_data_bytes(dtype, n), sb = wire_scale_bytes(dtype, n, block);
    uint8_t *p = sbuf_get(buf, db + sb + 1);
    if (!p) return fu_errorf(FU_ERR_NOMEM, "reply tensor");
    int rc = wire_encode(x, n, dtype, block, p, p + db);
    if (rc) return rc;
    fusion__tensor__init(t);
    shape[0] = rows;
    shape[1] = cols;
    t->dtype = (Fusion__Dtype)dtype;
    t->n_shape = 2;
    t->shape = shape;
    t->data.data = p;
    t->data.len = db;
    if (dtype == WIRE_INT8_BLOCK) {
        t->scales.data = p + db;
        t->scales.len = sb;
        t->block_size = block;
        t->scale_dtype = FUSION__DTYPE__DTYPE_F32;
    }
    return FU_OK;
}

/* ---- steps ---------------------------------------------------------------------- */

/* Translates an Input + OutputSpec into a shard_step. */
static int step_from_msg(shard_core *core, const Fusion__Input *in, const Fusion__OutputSpec *spec,
                         int64_t start, shard_step *step, sbuf *hbuf, rpc_status *st) {
    const mdl_model *m = shard_core_model(core);
    memset(step, 0, sizeof *step);
    step->start_pos = start;
    if (!in) return rpc_status_setf(st, RPC_INVALID_ARGUMENT, "input: missing");
    int n = 0;
    if (in->hidden) {
        int rc = decode_hidden(in->hidden, m->cfg.dim, &n, hbuf, &step->hidden, st);
        if (rc) return rc;
        if (in->n_tokens && in->n_tokens != (size_t)n)
            return rpc_status_setf(st, RPC_INVALID_ARGUMENT,
                                   "input.tokens: %zu ids for %d hidden positions", in->n_tokens, n);
    } else {
        if (in->n_tokens == 0 || in->n_tokens > (1u << 20))
            return rpc_status_setf(st, RPC_INVALID_ARGUMENT, "input: no tokens and no hidden states");
        n = (int)in->n_tokens;
    }
    step->n = n;
    step->tokens = in->n_tokens ? in->tokens : NULL;
    if (spec) {
        step->want_logits = spec->want_logits;
        step->all_positions = spec->all_positions;
        step->top_logprobs = spec->top_logprobs;
        if (spec->sampling) {
            const Fusion__Sampling *sp = spec->sampling;
            if (sp->n_logit_bias > 300)
                return rpc_status_setf(st, RPC_INVALID_ARGUMENT, "sampling.logit_bias: at most 300 entries");
            step->sample = true;
            smp_params p = smp_params_default();
            p.temperature = sp->temperature;
            p.top_p = sp->top_p == 0 ? 1.0f : sp->top_p;
            p.top_k = sp->top_k;
            p.min_p = sp->min_p;
            p.seed = sp->seed;
            p.presence_penalty = sp->presence_penalty;
            p.frequency_penalty = sp->frequency_penalty;
            p.repetition_penalty = sp->repetition_penalty == 0 ? 1.0f : sp->repetition_penalty;
            static _Thread_local smp_bias bias[300];
            for (size_t i = 0; i < sp->n_logit_bias; i++) {
                bias[i].token = sp->logit_bias[i]->token;
                bias[i].bias = sp->logit_bias[i]->bias;
            }
            p.bias = bias;
            p.n_bias = (int)sp->n_logit_bias;
            step->sampling = p;
            step->penalty_start = sp->penalty_start;
        }
    }
    return RPC_OK;
}

/* Builds an Output message for a finished step; storage from bufs/arrays the
 * caller keeps alive until the message is sent. */
typedef struct out_storage {
    Fusion__Output out;
    Fusion__Tensor hidden, logits;
    int64_t hshape[2], lshape[2];
    Fusion__TopLogprobs *tops;       /* (n_out) */
    Fusion__TopLogprobs **top_ptrs;  /* (n_out) */
    Fusion__TokenLogprob *entries;   /* (n_out * k) */
    Fusion__TokenLogprob **entry_ptrs;
    sbuf hbuf, lbuf;
} out_storage;

static void out_storage_free(out_storage *o) {
    free(o->tops);
    free(o->top_ptrs);
    free(o->entries);
    free(o->entry_ptrs);
    free(o->hbuf.p);
    free(o->lbuf.p);
}

static int output_to_msg(shard_core *core, const shard_step *step, int wire_dtype, int block,
                         out_storage *o) {
    const mdl_model *m = shard_core_model(core);
    fusion__output__init(&o->out);
    int rc;
    if (step->out_hidden) {
        if ((rc = encode_tensor(&o->hidden, o->hshape, step->out_hidden, step->n, m->cfg.dim, wire_dtype,
                                block, &o->hbuf)))
            return rc;
        o->out.hidden = &o->hidden;
    }
    if (step->out_logits) {
        if ((rc = encode_tensor(&o->logits, o->lshape, step->out_logits, step->n_out, m->cfg.vocab_size,
                                WIRE_F32, 0, &o->lbuf)))
            return rc;
        o->out.logits = &o->logits;
    }
    if (step->out_tokens) {
        o->out.n_tokens = (size_t)step->n_out;
        o->out.tokens = (int32_t *)step->out_tokens;
        o->out.n_logprobs = (size_t)step->n_out;
        o->out.logprobs = (float *)step->out_logprobs;
        int k = step->top_logprobs;
        if (k > 0 && step->out_top_ids) {
            size_t n = (size_t)step->n_out;
            free(o->tops);
            free(o->top_ptrs);
            free(o->entries);
            free(o->entry_ptrs);
            o->tops = calloc(n, sizeof *o->tops);
            o->top_ptrs = calloc(n, sizeof *o->top_ptrs);
            o->entries = calloc(n * (size_t)k, sizeof *o->entries);
            o->entry_ptrs = calloc(n * (size_t)k, sizeof *o->entry_ptrs);
            if (!o->tops || !o->top_ptrs || !o->entries || !o->entry_ptrs)
                return fu_errorf(FU_ERR_NOMEM, "top logprobs");
            for (size_t i = 0; i < n; i++) {
                fusion__top_logprobs__init(&o->tops[i]);
                for (int j = 0; j < k; j++) {
                    Fusion__TokenLogprob *e = &o->entries[i * (size_t)k + (size_t)j];
                    fusion__token_logprob__init(e);
                    e->token = step->out_top_ids[i * (size_t)k + (size_t)j];
                    e->logprob = step->out_top_lp[i * (size_t)k + (size_t)j];
                    o->entry_ptrs[i * (size_t)k + (size_t)j] = e;
                }
                o->tops[i].n_entries = (size_t)k;
                o->tops[i].entries = &o->entry_ptrs[i * (size_t)k];
                o->top_ptrs[i] = &o->tops[i];
            }
            o->out.n_top_logprobs = n;
            o->out.top_logprobs = o->top_ptrs;
        }
    }
    return FU_OK;
}

/* ---- sessions -------------------------------------------------------------------- */

typedef struct downstream {
    rpc_channel *ch;
    rpc_stream *s;
} downstream;

static void downstream_close(downstream *d) {
    if (d->s) {
        rpc_status st;
        rpc_stream_close_send(d->s, &st);
        rpc_stream_free(d->s);
    }
    rpc_channel_free(d->ch);
    memset(d, 0, sizeof *d);
}

/* Opens the rest of the chain on chain[0], passing chain[1..]. */
static int downstream_open(shard_server *srv, const Fusion__OpenSession *open, downstream *d,
                           rpc_status *st) {
    const Fusion__Hop *hop = open->chain[0];
    rpc_channel_options co = {srv->cfg.tls_ca, srv->cfg.allow_insecure, srv->cfg.secret,
                              srv->cfg.max_message_bytes,
                              hop->tls_server_name && hop->tls_server_name[0] ? hop->tls_server_name : NULL};
    if (!hop->address || !hop->address[0])
        return rpc_status_setf(st, RPC_INVALID_ARGUMENT, "open.chain[0].address: empty");
    if (rpc_channel_new(hop->address, &co, &d->ch))
        return rpc_status_setf(st, RPC_UNAVAILABLE, "next hop %s: %s", hop->address, fu_last_error());
    int rc = rpc_stream_open(d->ch, RPC_SHARD_SESSION, 0, &d->s, st);
    if (rc) return rc;
    Fusion__OpenSession next = *open;
    next.base = open->base;
    next.chain = open->chain + 1;
    next.n_chain = open->n_chain - 1;
    next.first_block = hop->first_block;
    next.last_block = hop->last_block;
    Fusion__SessionRequest req = FUSION__SESSION_REQUEST__INIT;
    req.kind_case = FUSION__SESSION_REQUEST__KIND_OPEN;
    req.open = &next;
    if ((rc = rpc_stream_send(d->s, &req.base, st))) goto fail;
    ProtobufCMessage *msg = NULL;
    if ((rc = rpc_stream_recv(d->s, &fusion__session_reply__descriptor, &msg, -1, st))) goto fail;
    Fusion__SessionReply *rep = (Fusion__SessionReply *)msg;
    bool ok = rep->kind_case == FUSION__SESSION_REPLY__KIND_OPENED;
    rpc_msg_free(msg);
    if (!ok) return rpc_status_setf(st, RPC_INTERNAL, "next hop %s: no open reply", hop->address);
    return RPC_OK;
fail:
    {
        char m[256];
        snprintf(m, sizeof m, "%s", st->message);
        return rpc_status_setf(st, rc == RPC_END_OF_STREAM ? RPC_UNAVAILABLE : rc, "next hop %s: %s",
                               hop->address, m);
    }
}

/* The core for a call naming blocks [first, last) (0, 0: the current span): the old span's while
 * it drains, else the current one (check_open then names the mismatch). NULL: no span. Release it. */
static shard_core *core_acquire(shard_server *srv, int first, int last) {
    pthread_mutex_lock(&srv->cmu);
    core_slot *sl = &srv->slot[0];
    const mdl_model *om = srv->slot[1].core ? shard_core_model(srv->slot[1].core) : NULL;
    if ((first || last) && om && om->first == first && om->last == last && !atomic_load(&srv->old_closing)) {
        const mdl_model *cm = sl->core ? shard_core_model(sl->core) : NULL;
        if (!cm || cm->first != first || cm->last != last) sl = &srv->slot[1];
    }
    shard_core *c = sl->core;
    if (c) sl->users++;
    pthread_mutex_unlock(&srv->cmu);
    return c;
}

static void core_release(shard_server *srv, shard_core *c) {
    if (!c) return;
    pthread_mutex_lock(&srv->cmu);
    for (int i = 0; i < 2; i++)
        if (srv->slot[i].core == c) srv->slot[i].users--;
    pthread_mutex_unlock(&srv->cmu);
}

/* Whether core c is a span given up whose drain time is over. */
static bool core_closing(shard_server *srv, shard_core *c) {
    if (!atomic_load(&srv->old_closing)) return false;
    pthread_mutex_lock(&srv->cmu);
    bool closing = srv->slot[1].core == c;
    pthread_mutex_unlock(&srv->cmu);
    return closing;
}

/* Validates an OpenSession against this server. */
static int check_open(shard_core *core, const Fusion__OpenSession *o, rpc_status *st) {
    const mdl_model *m = shard_core_model(core);
    if (o->adapter_id && o->adapter_id[0])
        return rpc_status_setf(st, RPC_NOT_FOUND, "open.adapter_id: no adapter '%.64s' on this server",
                               o->adapter_id);
    if ((o->first_block || o->last_block) && (o->first_block != m->first || o->last_block != m->last))
        return rpc_status_setf(st, RPC_FAILED_PRECONDITION,
                               "open: expected blocks [%d, %d), this server holds [%d, %d)", o->first_block,
                               o->last_block, m->first, m->last);
    int dt = o->wire_dtype == FUSION__DTYPE__DTYPE_UNSPECIFIED ? WIRE_BF16 : (int)o->wire_dtype;
    if (!wire_dtype_valid(dt)) return rpc_status_setf(st, RPC_INVALID_ARGUMENT, "open.wire_dtype: unknown");
    if (dt == WIRE_INT8_BLOCK && o->int8_block_size &&
        (o->int8_block_size < 8 || m->cfg.dim % o->int8_block_size))
        return rpc_status_setf(st, RPC_INVALID_ARGUMENT,
                               "open.int8_block_size: %d must divide the hidden size %d", o->int8_block_size,
                               m->cfg.dim);
    if (o->n_chain > SHARD_MAX_CHAIN) return rpc_status_setf(st, RPC_INVALID_ARGUMENT, "open.chain: too long");
    for (size_t i = 0; i < o->n_chain; i++)
        if (!o->chain[i]) return rpc_status_setf(st, RPC_INVALID_ARGUMENT, "open.chain[%zu]: missing", i);
    if (o->n_chain && m->has_head)
        return rpc_status_setf(st, RPC_INVALID_ARGUMENT, "open.chain: this server holds the LM head");
    if (o->idle_timeout_ms < 0)
        return rpc_status_setf(st, RPC_INVALID_ARGUMENT, "open.idle_timeout_ms: negative");
    return RPC_OK;
}

/* The refusal of a server that holds no span yet (a spare waiting for the gateway). */
static int no_span(rpc_status *st) {
    return rpc_status_setf(st, RPC_UNAVAILABLE, "this server holds no span yet (a spare)");
}

static int session_handler(void *ctx, rpc_stream *s, rpc_status *st) {
    shard_server *srv = ctx;
    if (!srv->core) return no_span(st);
    shard_core *core = NULL; /* the span's core, held for the session */
    const mdl_model *m = NULL;
    ProtobufCMessage *msg = NULL;
    shard_session *sess = NULL;
    downstream ds = {0};
    sbuf hbuf = {0};
    out_storage os;
    memset(&os, 0, sizeof os);
    int rc;

    int idle = srv->cfg.idle_timeout_ms > 0 ? srv->cfg.idle_timeout_ms : 120000;
    if ((rc = rpc_stream_recv(s, NULL, &msg, idle, st))) {
        if (rc == RPC_END_OF_STREAM || rc == RPC_CANCELLED) return RPC_OK;
        return rc;
    }
    Fusion__SessionRequest *req = (Fusion__SessionRequest *)msg;
    if (req->kind_case != FUSION__SESSION_REQUEST__KIND_OPEN || !req->open) {
        rc = rpc_status_setf(st, RPC_INVALID_ARGUMENT, "the first message of a session must be open");
        goto done;
    }
    if (atomic_load(&srv->draining)) {
        rc = rpc_status_setf(st, RPC_UNAVAILABLE, "the server is draining: no new sessions");
        goto done;
    }
    const Fusion__OpenSession *open = req->open;
    if (!(core = core_acquire(srv, open->first_block, open->last_block))) {
        rc = no_span(st);
        goto done;
    }
    m = shard_core_model(core);
    if ((rc = check_open(core, open, st))) goto done;
    int wire = open->wire_dtype == FUSION__DTYPE__DTYPE_UNSPECIFIED ? WIRE_BF16 : (int)open->wire_dtype;
    int block = open->int8_block_size ? open->int8_block_size : WIRE_DEFAULT_BLOCK;
    if (wire == WIRE_INT8_BLOCK && m->cfg.dim % block) block = m->cfg.dim;
    if (open->idle_timeout_ms > 0) idle = open->idle_timeout_ms;
    if ((rc = shard_session_open(core, open->session_id, open->max_length, &sess))) {
        rc = rpc_status_from_fu(st, rc);
        goto done;
    }
    if (open->n_chain && (rc = downstream_open(srv, open, &ds, st))) goto done;
    FU_LOG(FU_LOG_LEVEL_DEBUG, open->session_id, "opened: max_length %d, wire %s%s", open->max_length,
           wire_dtype_name(wire), open->n_chain ? ", forwarding" : "");
    {
        shard_core_stats stats;
        shard_core_get_stats(core, &stats);
        Fusion__OpenReply orep = FUSION__OPEN_REPLY__INIT;
        orep.session_id = open->session_id;
        orep.first_block = m->first;
        orep.last_block = m->last;
        orep.max_length = open->max_length;
        orep.wire_dtype = (Fusion__Dtype)wire;
        orep.kv_bytes = (int64_t)(stats.kv_bytes_per_pos * (uint64_t)open->max_length);
        Fusion__SessionReply rep = FUSION__SESSION_REPLY__INIT;
        rep.kind_case = FUSION__SESSION_REPLY__KIND_OPENED;
        rep.opened = &orep;
        if ((rc = rpc_stream_send(s, &rep.base, st))) goto done;
    }
    rpc_msg_free(msg);
    msg = NULL;

    for (;;) {
        rc = rpc_stream_recv(s, NULL, &msg, idle, st);
        if (rc == RPC_DEADLINE_EXCEEDED) {
            FU_LOG(FU_LOG_LEVEL_INFO, shard_session_id(sess), "idle for %d ms: expired", idle);
            rc = rpc_status_setf(st, RPC_DEADLINE_EXCEEDED, "session idle for %d ms: expired", idle);
            goto done;
        }
        if (rc == RPC_END_OF_STREAM || rc == RPC_CANCELLED) {
            rc = RPC_OK;
            goto done;
        }
        if (rc) goto done;
        req = (Fusion__SessionRequest *)msg;
        if (req->kind_case == FUSION__SESSION_REQUEST__KIND_CLOSE) {
            rc = RPC_OK;
            goto done;
        }
        if (req->kind_case != FUSION__SESSION_REQUEST__KIND_STEP || !req->step) {
            rc = rpc_status_setf(st, RPC_INVALID_ARGUMENT, "expected a step");
            goto done;
        }
        const Fusion__StepRequest *sr = req->step;
        if (core_closing(srv, core)) {
            rc = rpc_status_setf(st, RPC_UNAVAILABLE, "blocks [%d, %d) moved away from this server", m->first,
                                 m->last);
            goto done;
        }
        int64_t t_start = fu_now_us();
        if (sr->rollback_case == FUSION__STEP_REQUEST__ROLLBACK_ROLLBACK_TO) {
            if (sr->rollback_to < 0 || sr->rollback_to > shard_session_len(sess)) {
                rc = rpc_status_setf(st, RPC_OUT_OF_RANGE, "step.rollback_to %lld outside [0, %d]",
                                     (long long)sr->rollback_to, shard_session_len(sess));
                goto done;
            }
            shard_session_rollback(sess, (int)sr->rollback_to);
        }
        shard_step step;
        if ((rc = step_from_msg(core, sr->input, sr->output, sr->start_position, &step, &hbuf, st))) goto done;
        if ((rc = shard_session_step(core, sess, &step))) {
            rc = rpc_status_from_fu(st, rc);
            goto done;
        }
        if ((rc = output_to_msg(core, &step, wire, block, &os))) {
            rc = rpc_status_from_fu(st, rc);
            goto done;
        }
        Fusion__ServerTiming mine = FUSION__SERVER_TIMING__INIT;
        mine.server = srv->advertise;
        mine.first_block = m->first;
        mine.last_block = m->last;
        mine.queue_us = step.queue_us;
        mine.compute_us = step.compute_us;
        Fusion__StepReply srep = FUSION__STEP_REPLY__INIT;
        srep.request_id = sr->request_id;
        srep.position = shard_session_len(sess);
        Fusion__ServerTiming *timings[SHARD_MAX_CHAIN + 1];
        timings[0] = &mine;
        srep.n_timing = 1;
        srep.timing = timings;
        ProtobufCMessage *down_msg = NULL;
        if (ds.s) { /* forward our hidden states to the next hop and relay its reply */
            Fusion__Input nin = FUSION__INPUT__INIT;
            nin.hidden = os.out.hidden;
            nin.n_tokens = sr->input->n_tokens;
            nin.tokens = sr->input->tokens;
            Fusion__StepRequest nsr = *sr;
            nsr.input = &nin;
            Fusion__SessionRequest nreq = FUSION__SESSION_REQUEST__INIT;
            nreq.kind_case = FUSION__SESSION_REQUEST__KIND_STEP;
            nreq.step = &nsr;
            if ((rc = rpc_stream_send(ds.s, &nreq.base, st)) ||
                (rc = rpc_stream_recv(ds.s, &fusion__session_reply__descriptor, &down_msg, -1, st))) {
                char m2[256];
                snprintf(m2, sizeof m2, "%s", st->message);
                rc = rpc_status_setf(st, rc == RPC_END_OF_STREAM ? RPC_UNAVAILABLE : rc,
                                     "next hop %s: %s", ds.s ? open->chain[0]->address : "", m2);
                goto done;
            }
            Fusion__SessionReply *drep = (Fusion__SessionReply *)down_msg;
            if (drep->kind_case != FUSION__SESSION_REPLY__KIND_STEP || !drep->step) {
                rpc_msg_free(down_msg);
                rc = rpc_status_setf(st, RPC_INTERNAL, "next hop: no step reply");
                goto done;
            }
            srep.output = drep->step->output;
            srep.position = drep->step->position;
            for (size_t i = 0; i < drep->step->n_timing && srep.n_timing <= SHARD_MAX_CHAIN; i++)
                timings[srep.n_timing++] = drep->step->timing[i];
        } else {
            srep.output = &os.out;
        }
        mine.total_us = fu_now_us() - t_start;
        Fusion__SessionReply rep = FUSION__SESSION_REPLY__INIT;
        rep.kind_case = FUSION__SESSION_REPLY__KIND_STEP;
        rep.step = &srep;
        rc = rpc_stream_send(s, &rep.base, st);
        rpc_msg_free(down_msg);
        rpc_msg_free(msg);
        msg = NULL;
        if (rc) {
            if (rc == RPC_CANCELLED) rc = RPC_OK; /* the client went away */
            goto done;
        }
    }
done:
    if (sess) FU_LOG(FU_LOG_LEVEL_DEBUG, shard_session_id(sess), "closed (%s)", rpc_code_str(rc));
    rpc_msg_free(msg);
    downstream_close(&ds);
    if (core) shard_session_close(core, sess);
    core_release(srv, core);
    free(hbuf.p);
    out_storage_free(&os);
    return rc;
}

/* ---- stateless forward ----------------------------------------------------------------- */

typedef struct fwd_reply {
    Fusion__ForwardReply rep;
    Fusion__Output **outs;
    out_storage *store;
    Fusion__ServerTiming timing, *timing_ptr;
    size_t n;
    shard_session **sess;
    shard_server *srv;
    shard_core *core;
} fwd_reply;

static void forward_reply_free(void *ctx, ProtobufCMessage *msg) {
    fwd_reply *f = (fwd_reply *)msg; /* rep is the first member */
    for (size_t i = 0; i < f->n; i++) {
        out_storage_free(&f->store[i]);
        shard_session_close(f->core, f->sess[i]);
    }
    core_release(f->srv, f->core);
    free(f->outs);
    free(f->store);
    free(f->sess);
    free(f);
}

static int forward_handler(void *ctx, const ProtobufCMessage *req_msg, ProtobufCMessage **reply,
                           rpc_status *st) {
    shard_server *srv = ctx;
    const Fusion__ForwardRequest *req = (const Fusion__ForwardRequest *)req_msg;
    shard_core *core = core_acquire(srv, req->first_block, req->last_block);
    if (!core) return no_span(st);
    const mdl_model *m = shard_core_model(core);
    int code = RPC_OK;
    if (req->n_sequences == 0 || req->n_sequences > 256)
        code = rpc_status_setf(st, RPC_INVALID_ARGUMENT, "sequences: 1..256 required");
    else if (req->adapter_id && req->adapter_id[0])
        code = rpc_status_setf(st, RPC_NOT_FOUND, "adapter_id: no adapter '%.64s'", req->adapter_id);
    else if ((req->first_block || req->last_block) && (req->first_block != m->first || req->last_block != m->last))
        code = rpc_status_setf(st, RPC_FAILED_PRECONDITION, "expected blocks [%d, %d), this server holds [%d, %d)",
                               req->first_block, req->last_block, m->first, m->last);
    fwd_reply *f = code ? NULL : calloc(1, sizeof *f);
    if (!code && !f) code = rpc_status_setf(st, RPC_RESOURCE_EXHAUSTED, "out of memory");
    if (code) {
        core_release(srv, core);
        return code;
    }
    f->srv = srv;
    f->core = core;
    f->n = req->n_sequences;
    f->outs = calloc(f->n, sizeof *f->outs);
    f->store = calloc(f->n, sizeof *f->store);
    f->sess = calloc(f->n, sizeof *f->sess);
    fusion__forward_reply__init(&f->rep);
    int rc = RPC_OK;
    if (!f->outs || !f->store || !f->sess) {
        rc = rpc_status_setf(st, RPC_RESOURCE_EXHAUSTED, "out of memory");
        goto fail;
    }
    uint64_t fid = atomic_fetch_add(&srv->fwd_counter, 1);
    int64_t queue = 0, compute = 0, t0 = fu_now_us();
    sbuf hbuf = {0};
    for (size_t i = 0; i < f->n && !rc; i++) {
        shard_step step;
        const Fusion__Input *in = req->sequences[i];
        if ((rc = step_from_msg(core, in, req->output, 0, &step, &hbuf, st))) break;
        char id[64];
        snprintf(id, sizeof id, "forward-%llu-%zu", (unsigned long long)fid, i);
        int frc = shard_session_open(core, id, step.n, &f->sess[i]);
        if (!frc) frc = shard_session_step(core, f->sess[i], &step);
        int dt = req->wire_dtype != FUSION__DTYPE__DTYPE_UNSPECIFIED ? (int)req->wire_dtype
                 : in->hidden                                        ? (int)in->hidden->dtype
                                                                     : WIRE_BF16;
        if (!wire_dtype_valid(dt)) {
            rc = rpc_status_setf(st, RPC_INVALID_ARGUMENT, "wire_dtype: unknown");
            break;
        }
        int block = in->hidden && in->hidden->block_size > 0 ? in->hidden->block_size : WIRE_DEFAULT_BLOCK;
        if (dt == WIRE_INT8_BLOCK && m->cfg.dim % block) block = m->cfg.dim;
        if (!frc) frc = output_to_msg(core, &step, dt, block, &f->store[i]);
        if (frc) {
            rc = rpc_status_from_fu(st, frc);
            char m2[256];
            snprintf(m2, sizeof m2, "%s", st->message);
            rpc_status_setf(st, rc, "sequences[%zu]: %s", i, m2);
            break;
        }
        f->outs[i] = &f->store[i].out;
        queue += step.queue_us;
        compute += step.compute_us;
    }
    free(hbuf.p);
    if (rc) goto fail;
    f->rep.request_id = req->request_id;
    f->rep.n_outputs = f->n;
    f->rep.outputs = f->outs;
    fusion__server_timing__init(&f->timing);
    f->timing.server = srv->advertise;
    f->timing.first_block = m->first;
    f->timing.last_block = m->last;
    f->timing.queue_us = queue;
    f->timing.compute_us = compute;
    f->timing.total_us = fu_now_us() - t0;
    f->timing_ptr = &f->timing;
    f->rep.n_timing = 1;
    f->rep.timing = &f->timing_ptr;
    *reply = &f->rep.base;
    return RPC_OK;
fail:
    forward_reply_free(srv, &f->rep.base);
    return rc;
}

/* ---- info and health ----------------------------------------------------------------- */

typedef struct info_reply {
    Fusion__InfoReply rep;
    Fusion__Dtype dtypes[4];
} info_reply;

static void info_reply_free(void *ctx, ProtobufCMessage *msg) { free(msg); }

static int info_handler(void *ctx, const ProtobufCMessage *req, ProtobufCMessage **reply, rpc_status *st) {
    shard_server *srv = ctx;
    shard_core *core = core_acquire(srv, 0, 0);
    if (!core) return no_span(st);
    const mdl_model *m = shard_core_model(core);
    info_reply *r = calloc(1, sizeof *r);
    if (!r) {
        core_release(srv, core);
        return rpc_status_setf(st, RPC_RESOURCE_EXHAUSTED, "out of memory");
    }
    fusion__info_reply__init(&r->rep);
    shard_core_stats stats;
    shard_core_get_stats(core, &stats);
    r->rep.model_name = (char *)(srv->cfg.model_name ? srv->cfg.model_name : m->name);
    r->rep.n_layers = m->cfg.n_layers;
    r->rep.first_block = m->first;
    r->rep.last_block = m->last;
    r->rep.has_embeddings = m->has_embed;
    r->rep.has_head = m->has_head;
    r->rep.dtype = (char *)(m->last > m->first ? op_type_name(m->layers[0].wq.type)
                                               : op_type_name(m->has_head ? m->lm_head.type : m->tok_embd.type));
    r->rep.device = (char *)(srv->cfg.device ? srv->cfg.device : "cpu");
    r->rep.tokens_per_s = srv->cfg.tokens_per_s;
    r->rep.free_kv_bytes = (int64_t)stats.kv_free_bytes;
    r->rep.total_kv_bytes = (int64_t)stats.kv_total_bytes;
    r->rep.active_sessions = stats.active_sessions;
    r->rep.version = (char *)SHARD_VERSION;
    r->rep.hidden_size = m->cfg.dim;
    r->rep.vocab_size = m->cfg.vocab_size;
    r->rep.max_length = m->cfg.max_seq_len;
    for (int i = 0; i < 4; i++) r->dtypes[i] = (Fusion__Dtype)(WIRE_F32 + i);
    r->rep.n_wire_dtypes = 4;
    r->rep.wire_dtypes = r->dtypes;
    r->rep.max_message_bytes = (int64_t)(srv->cfg.max_message_bytes ? srv->cfg.max_message_bytes
                                                                    : RPC_DEFAULT_MAX_MESSAGE);
    r->rep.kv_bytes_per_position = (int64_t)stats.kv_bytes_per_pos;
    core_release(srv, core);
    *reply = &r->rep.base;
    return RPC_OK;
}

static void health_reply_free(void *ctx, ProtobufCMessage *msg) { free(msg); }

static int health_handler(void *ctx, const ProtobufCMessage *req, ProtobufCMessage **reply,
                          rpc_status *st) {
    shard_server *srv = ctx;
    Fusion__HealthReply *r = malloc(sizeof *r);
    if (!r) return rpc_status_setf(st, RPC_RESOURCE_EXHAUSTED, "out of memory");
    fusion__health_reply__init(r);
    bool draining = atomic_load(&srv->draining);
    r->status = draining ? FUSION__HEALTH_REPLY__SERVING_STATUS__SERVING_STATUS_DRAINING
                         : FUSION__HEALTH_REPLY__SERVING_STATUS__SERVING_STATUS_SERVING;
    r->message = (char *)(draining ? "draining" : "serving");
    *reply = &r->base;
    return RPC_OK;
}

#define SHARD_ECHO_MAX (4 << 20)

static void echo_reply_free(void *ctx, ProtobufCMessage *msg) {
    (void)ctx;
    Fusion__EchoReply *r = (Fusion__EchoReply *)msg;
    free(r->payload.data);
    free(r);
}

static int echo_handler(void *ctx, const ProtobufCMessage *req_msg, ProtobufCMessage **reply, rpc_status *st) {
    (void)ctx;
    const Fusion__EchoRequest *req = (const Fusion__EchoRequest *)req_msg;
    if (req->reply_bytes < 0 || req->reply_bytes > SHARD_ECHO_MAX)
        return rpc_status_setf(st, RPC_INVALID_ARGUMENT, "reply_bytes: 0..%d required, got %d", SHARD_ECHO_MAX,
                               req->reply_bytes);
    Fusion__EchoReply *r = malloc(sizeof *r);
    if (!r) return rpc_status_setf(st, RPC_RESOURCE_EXHAUSTED, "out of memory");
    fusion__echo_reply__init(r);
    if (req->reply_bytes > 0) {
        if (!(r->payload.data = calloc(1, (size_t)req->reply_bytes))) {
            free(r);
            return rpc_status_setf(st, RPC_RESOURCE_EXHAUSTED, "out of memory");
        }
        r->payload.len = (size_t)req->reply_bytes;
    }
    *reply = &r->base;
    return RPC_OK;
}

/* ---- server ---------------------------------------------------------------------------- */

int shard_server_new(shard_core *core, const shard_server_config *cfg, shard_server **out) {
    *out = NULL;
    shard_server *s = calloc(1, sizeof *s);
    if (!s) return fu_errorf(FU_ERR_NOMEM, "server");
    s->core = core;
    s->slot[0].core = core;
    pthread_mutex_init(&s->cmu, NULL);
    s->cfg = *cfg;
    s->advertise = strdup(cfg->advertise ? cfg->advertise : cfg->listen);
    if (!s->advertise) {
        free(s);
        return fu_errorf(FU_ERR_NOMEM, "server");
    }
    rpc_server_options ro = {cfg->listen, cfg->tls_cert, cfg->tls_key, cfg->allow_insecure, cfg->secret,
                             cfg->max_message_bytes, cfg->n_workers > 0 ? cfg->n_workers : 4};
    int rc = rpc_server_new(&ro, &s->rpc);
    if (!rc && !cfg->advertise) { /* name ourselves by the port actually bound */
        const char *colon = strrchr(cfg->listen, ':');
        char name[300];
        snprintf(name, sizeof name, "%.*s:%d", colon ? (int)(colon - cfg->listen) : 0, cfg->listen,
                 rpc_server_port(s->rpc));
        free(s->advertise);
        if (!(s->advertise = strdup(name))) rc = fu_errorf(FU_ERR_NOMEM, "server");
    }
    if (!rc) rc = rpc_server_add_stream(s->rpc, RPC_SHARD_SESSION, &fusion__session_request__descriptor,
                                        session_handler, s);
    if (!rc) rc = rpc_server_add_unary(s->rpc, RPC_SHARD_FORWARD, &fusion__forward_request__descriptor,
                                       forward_handler, forward_reply_free, s);
    if (!rc) rc = rpc_server_add_unary(s->rpc, RPC_SHARD_INFO, &fusion__info_request__descriptor,
                                       info_handler, info_reply_free, s);
    if (!rc) rc = rpc_server_add_unary(s->rpc, RPC_SHARD_HEALTH, &fusion__health_request__descriptor,
                                       health_handler, health_reply_free, s);
    if (!rc) rc = rpc_server_add_unary(s->rpc, RPC_SHARD_ECHO, &fusion__echo_request__descriptor, echo_handler,
                                       echo_reply_free, s);
    if (rc) {
        shard_server_free(s);
        return rc;
    }
    *out = s;
    return FU_OK;
}

int shard_server_start(shard_server *s) { return rpc_server_start(s->rpc); }

int shard_server_set_core(shard_server *s, shard_core *core, double tokens_per_s) {
    if (!core) return fu_errorf(FU_ERR_INVALID, "server: no core");
    if (s->core) return fu_errorf(FU_ERR_INVALID, "server: already serving a span");
    pthread_mutex_lock(&s->cmu);
    s->cfg.tokens_per_s = tokens_per_s;
    s->slot[0].core = core;
    s->core = core;
    pthread_mutex_unlock(&s->cmu);
    return FU_OK;
}

int shard_server_move(shard_server *s, shard_core *core, double tokens_per_s) {
    if (!core) return fu_errorf(FU_ERR_INVALID, "server: no core");
    pthread_mutex_lock(&s->cmu);
    int rc = FU_OK;
    if (!s->slot[0].core) rc = fu_errorf(FU_ERR_INVALID, "server: no span to move from");
    else if (s->slot[1].core) rc = fu_errorf(FU_ERR_INVALID, "server: the span given up by the last move still drains");
    if (!rc) {
        s->slot[1] = s->slot[0];
        s->slot[0] = (core_slot){core, 0};
        atomic_store(&s->old_closing, false);
        s->cfg.tokens_per_s = tokens_per_s;
        s->core = core;
    }
    pthread_mutex_unlock(&s->cmu);
    return rc;
}

shard_core *shard_server_old_core(shard_server *s, bool close) {
    pthread_mutex_lock(&s->cmu);
    shard_core *c = NULL;
    if (s->slot[1].core && s->slot[1].users == 0) {
        c = s->slot[1].core;
        s->slot[1] = (core_slot){NULL, 0};
        atomic_store(&s->old_closing, false);
    } else if (s->slot[1].core && close) {
        atomic_store(&s->old_closing, true);
    }
    pthread_mutex_unlock(&s->cmu);
    return c;
}

const char *shard_server_address(const shard_server *s) { return s->advertise; }

int shard_server_port(const shard_server *s) { return rpc_server_port(s->rpc); }

int shard_server_drain(shard_server *s, int grace_ms) {
    atomic_store(&s->draining, true);
    return rpc_server_shutdown(s->rpc, grace_ms);
}

void shard_server_free(shard_server *s) {
    if (!s) return;
    rpc_server_free(s->rpc);
    pthread_mutex_destroy(&s->cmu);
    free(s->advertise);
    free(s);
}

/* ---- fuzzing hook ---------------------------------------------------------------------- */

int shard_rpc_fuzz_one(shard_core *core, shard_session *scratch, const void *data, size_t len) {
    rpc_status st = {0};
    ProtobufCMessage *msg = NULL;
    int rc = rpc_msg_unpack(&fusion__session_request__descriptor, data, len, 1u << 20, &msg, &st);
    if (rc) return rc;
    const Fusion__SessionRequest *req = (const Fusion__SessionRequest *)msg;
    if (req->kind_case == FUSION__SESSION_REQUEST__KIND_OPEN && req->open) {
        rc = check_open(core, req->open, &st);
    } else if (req->kind_case == FUSION__SESSION_REQUEST__KIND_STEP && req->step) {
        const Fusion__StepRequest *sr = req->step;
        sbuf hbuf = {0};
        shard_step step;
        int64_t start = shard_session_len(scratch);
        rc = step_from_msg(core, sr->input, sr->output, start, &step, &hbuf, &st);
        if (!rc) {
            rc = shard_session_step(core, scratch, &step);
            if (!rc) {
                out_storage os;
                memset(&os, 0, sizeof os);
                rc = output_to_msg(core, &step, WIRE_INT8_BLOCK, shard_core_model(core)->cfg.dim, &os);
                out_storage_free(&os);
            }
            shard_session_rollback(scratch, 0);
        }
        free(hbuf.p);
    }
    rpc_msg_free(msg);
    return rc;
}
