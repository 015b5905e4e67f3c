/* shard-rpc.c -- fusion.Shard for a shard server: the service's typed requests become shard-core calls. */
#include "shard-rpc.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "clock.h"
#include "grow.h"
#include "log.h"
#include "rpc-base.h"
#include "shard-lora.h"
#include "shard-svc.h"
#include "shard-tensor.h"
#include "shard-train.h"
#include "status.h"
#include "wire.h"

#define SHARD_VERSION "fusion 0.1.0"
#define SHARD_MAX_CHAIN 64
#define SHARD_MAX_SEQUENCES 256   /* sequences of one Forward */

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
    shard_svc_handlers handlers; /* registered on rpc; borrowed by it until rpc_server_free */
    shard_train *train;          /* fusion.Train's jobs over the current core */
    atomic_bool draining;
    atomic_uint_fast64_t fwd_counter;
};

/* ---- steps ---------------------------------------------------------------------- */

/* The positions an Input feeds in: its hidden states' rows, else its token ids. */
static int64_t input_positions(const shard_svc_input *in) {
    if (in->hidden && in->hidden->n_shape >= 1) return in->hidden->shape[0] > 0 ? in->hidden->shape[0] : 0;
    return (int64_t)in->n_tokens;
}

/* Refuses a Session step over the server's budget per step (RESOURCE_EXHAUSTED with the figures). */
static int step_budget_check(const shard_server_config *cfg, const shard_svc_input *in, rpc_status *st) {
    int64_t n = in ? input_positions(in) : 0;
    if (cfg->max_step_tokens > 0 && n > cfg->max_step_tokens)
        return rpc_status_setf(st, RPC_RESOURCE_EXHAUSTED,
                               "step of %lld positions is over this server's budget of %d positions per step",
                               (long long)n, cfg->max_step_tokens);
    return RPC_OK;
}

/* Reads an OutputSpec into step's output options and sampling (logit_bias and the allowed-token
 * mask borrowed from spec; a mask not of (vocab + 7) / 8 bytes is refused). */
static int step_spec(const shard_svc_output_spec *spec, int vocab, shard_step *step, rpc_status *st) {
    step->want_logits = spec->want_logits;
    step->all_positions = spec->all_positions;
    step->score_inputs = spec->score_inputs;
    step->top_logprobs = spec->top_logprobs;
    const shard_svc_sampling *sp = spec->sampling;
    if (!sp) return RPC_OK;
    if (sp->n_logit_bias > SMP_MAX_LOGIT_BIAS)
        return rpc_status_setf(st, RPC_INVALID_ARGUMENT, "sampling.logit_bias: at most %d entries",
                               SMP_MAX_LOGIT_BIAS);
    if (sp->allowed_tokens && sp->n_allowed_tokens != ((size_t)vocab + 7) / 8)
        return rpc_status_setf(st, RPC_INVALID_ARGUMENT, "sampling.allowed_tokens: %zu bytes for a vocabulary of %d tokens (want %zu)",
                               sp->n_allowed_tokens, vocab, ((size_t)vocab + 7) / 8);
    step->sample = true;
    step->sampling = shard_svc_sampling_to_params(sp);
    step->penalty_start = sp->penalty_start;
    return RPC_OK;
}

/* Translates an Input + OutputSpec into a shard_step (hidden states decoded into hbuf; tokens
 * and logit_bias borrowed from the request). */
static int step_from_req(shard_core *core, const shard_svc_input *in, const shard_svc_output_spec *spec,
                         int64_t start, shard_step *step, grow_buf *hbuf, rpc_status *st) {
    const mdl_model *m = shard_core_model(core);
    memset(step, 0, sizeof *step);
    step->start_pos = start;
    if (!in) return rpc_status_setf(st, RPC_INVALID_ARGUMENT, "input: missing");
    int n = 0;
    if (in->hidden) {
        int rc = shard_decode_hidden(in->hidden, m->cfg.dim, "input.hidden", &n, hbuf, &step->hidden, st);
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
    return spec ? step_spec(spec, m->cfg.vocab_size, step, st) : RPC_OK;
}

/* The outputs of a finished step as the service sends them; the tensors' bytes live in hbuf /
 * lbuf, the rest in the step (both valid until the session's next step). */
typedef struct out_storage {
    shard_svc_output out;
    wire_tensor hidden, logits;
    int64_t hshape[2], lshape[2];
    grow_buf tops; /* (n_out) shard_svc_top */
    grow_buf hbuf, lbuf;
} out_storage;

/* Frees the buffers (the struct itself is the caller's). */
static void out_storage_free(out_storage *o) {
    free(o->tops.p);
    free(o->hbuf.p);
    free(o->lbuf.p);
}

/* Fills o->out from a finished step: hidden states in the session's wire dtype, logits in f32,
 * sampled tokens, log-probs and top alternatives. */
static int output_from_step(shard_core *core, const shard_step *step, int wire_dtype, int block, out_storage *o) {
    const mdl_model *m = shard_core_model(core);
    memset(&o->out, 0, sizeof o->out);
    int rc;
    if (step->out_hidden) {
        if ((rc = shard_encode_tensor(&o->hidden, o->hshape, step->out_hidden, step->n, m->cfg.dim, wire_dtype, block,
                                &o->hbuf)))
            return rc;
        o->out.hidden = &o->hidden;
    }
    if (step->out_logits) {
        if ((rc = shard_encode_tensor(&o->logits, o->lshape, step->out_logits, step->n_out, m->cfg.vocab_size, WIRE_F32,
                                0, &o->lbuf)))
            return rc;
        o->out.logits = &o->logits;
    }
    if (!step->out_tokens) return FU_OK;
    size_t n = (size_t)step->n_out;
    o->out.tokens = step->out_tokens;
    o->out.n_tokens = n;
    o->out.logprobs = step->out_logprobs;
    o->out.n_logprobs = n;
    int k = step->top_logprobs;
    if (k <= 0 || !step->out_top_ids) return FU_OK;
    if (fu_grow(&o->tops.p, &o->tops.cap, n, sizeof(shard_svc_top))) return fu_errorf(FU_ERR_NOMEM, "top logprobs");
    shard_svc_top *tops = o->tops.p;
    for (size_t i = 0; i < n; i++)
        tops[i] = (shard_svc_top){&step->out_top_ids[i * (size_t)k], &step->out_top_lp[i * (size_t)k], (size_t)k};
    o->out.top = tops;
    o->out.n_top = n;
    return FU_OK;
}

/* ---- spans ------------------------------------------------------------------------- */

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

/* Gives back a core from core_acquire (NULL is a no-op). */
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
static int check_open(shard_core *core, const shard_svc_open *o, rpc_status *st) {
    const mdl_model *m = shard_core_model(core);
    if ((o->first_block || o->last_block) && (o->first_block != m->first || o->last_block != m->last))
        return rpc_status_setf(st, RPC_FAILED_PRECONDITION,
                               "open: expected blocks [%d, %d), this server holds [%d, %d)", o->first_block,
                               o->last_block, m->first, m->last);
    int dt = o->wire_dtype == 0 ? WIRE_BF16 : o->wire_dtype;
    if (!wire_dtype_valid(dt)) return rpc_status_setf(st, RPC_INVALID_ARGUMENT, "open.wire_dtype: unknown");
    if (dt == WIRE_INT8_BLOCK && o->int8_block_size &&
        (o->int8_block_size < 8 || m->cfg.dim % o->int8_block_size))
        return rpc_status_setf(st, RPC_INVALID_ARGUMENT,
                               "open.int8_block_size: %d must divide the hidden size %d", o->int8_block_size,
                               m->cfg.dim);
    if (o->n_chain > SHARD_MAX_CHAIN) return rpc_status_setf(st, RPC_INVALID_ARGUMENT, "open.chain: too long");
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

/* ---- sessions: the next hop ------------------------------------------------------------ */

/* With forwarding: the session this server holds on the next hop, over a channel of its own. */
typedef struct downstream {
    rpc_channel *ch;
    shard_svc_session *sess;
    char *address; /* the next hop's, for messages */
} downstream;

/* Closes the next hop's session (a half-close) and its channel; a closed one is a no-op. */
static void downstream_close(downstream *d) {
    shard_svc_session_close(d->sess, NULL);
    rpc_channel_free(d->ch);
    free(d->address);
    memset(d, 0, sizeof *d);
}

/* A failure of the next hop as this server's status: "next hop ADDRESS: ..." (its end of stream
 * reads as UNAVAILABLE). */
static int downstream_fail(const downstream *d, int code, rpc_status *st) {
    char m[256];
    snprintf(m, sizeof m, "%s", st->message);
    return rpc_status_setf(st, code == RPC_END_OF_STREAM ? RPC_UNAVAILABLE : code, "next hop %s: %s", d->address,
                           m);
}

/* Opens the rest of the chain on chain[0], passing chain[1..]. */
static int downstream_open(shard_server *srv, const shard_svc_open *open, downstream *d, rpc_status *st) {
    const shard_svc_hop *hop = &open->chain[0];
    const shard_server_config *c = &srv->cfg;
    const char *name = hop->tls_server_name && hop->tls_server_name[0] ? hop->tls_server_name : NULL;
    rpc_channel_options co = {.tls_ca = c->tls_ca, .insecure = c->allow_insecure, .secret = c->secret,
                              .max_message_bytes = c->max_message_bytes, .tls_server_name = name,
                              .tls_client_cert = c->tls_client_cert, .tls_client_key = c->tls_client_key};
    if (!hop->address || !hop->address[0])
        return rpc_status_setf(st, RPC_INVALID_ARGUMENT, "open.chain[0].address: empty");
    if (rpc_channel_new(hop->address, &co, &d->ch))
        return rpc_status_setf(st, RPC_UNAVAILABLE, "next hop %s: %s", hop->address, fu_last_error());
    if (!(d->address = strdup(hop->address))) return rpc_status_setf(st, RPC_RESOURCE_EXHAUSTED, "out of memory");
    shard_svc_open next = *open;
    next.chain = open->chain + 1;
    next.n_chain = open->n_chain - 1;
    next.first_block = hop->first_block;
    next.last_block = hop->last_block;
    int rc = shard_svc_session_open(d->ch, &next, -1, &d->sess, st);
    if (rc == RPC_UNEXPECTED_REPLY) return rpc_status_setf(st, RPC_INTERNAL, "next hop %s: no open reply", d->address);
    return rc ? downstream_fail(d, rc, st) : RPC_OK;
}

/* Sends the step on to the next hop with this server's hidden states as input (the token ids
 * ride along) and returns its reply (*reply: valid until downstream's next step). */
static int downstream_step(downstream *d, const shard_svc_step *sr, const wire_tensor *hidden,
                           const shard_svc_step_reply **reply, rpc_status *st) {
    shard_svc_input in = {sr->input->tokens, sr->input->n_tokens, hidden};
    shard_svc_step next = *sr;
    next.input = &in;
    int rc = shard_svc_session_step(d->sess, &next, reply, st);
    if (rc == RPC_UNEXPECTED_REPLY) return rpc_status_setf(st, RPC_INTERNAL, "next hop: no step reply");
    return rc ? downstream_fail(d, rc, st) : RPC_OK;
}

/* ---- sessions ------------------------------------------------------------------------------ */

/* One Session stream on this server, from its open to its end. */
typedef struct session {
    shard_server *srv;
    shard_svc_stream *s;
    shard_core *core;   /* the span's, held (core_acquire) until the end */
    const mdl_model *m;
    shard_session *sess;
    downstream ds;      /* with forwarding */
    int wire, block;    /* hidden states' wire dtype and int8 block */
    int idle_ms;        /* expiry without a message */
    grow_buf hbuf;      /* decoded input hidden states */
    out_storage os;     /* the step's outputs as sent */
} session;

/* Whether the session's client has gone (cancelled or dropped): polled on the stream's thread
 * while a step computes or waits for the next hop, so that a prefill stops early. */
static bool session_gone(void *arg) {
    session *c = arg;
    return shard_svc_stream_cancelled(c->s);
}

/* The watch of the next hop's replies: the call is cancelled once this session's client has gone. */
static int session_watch(void *arg, int64_t waited_ms) {
    (void)waited_ms;
    return session_gone(arg) ? SHARD_SVC_CANCEL : SHARD_SVC_WAIT;
}

/* Takes the open message: checks it, holds the span's core, opens the session in it (and on
 * the next hop when forwarding) and answers. RPC_OK once open. */
static int session_start(session *c, const shard_svc_open *open, rpc_status *st) {
    shard_server *srv = c->srv;
    if (atomic_load(&srv->draining))
        return rpc_status_setf(st, RPC_UNAVAILABLE, "the server is draining: no new sessions");
    if (!(c->core = core_acquire(srv, open->first_block, open->last_block))) return no_span(st);
    c->m = shard_core_model(c->core);
    int rc = check_open(c->core, open, st);
    if (rc) return rc;
    c->wire = open->wire_dtype == 0 ? WIRE_BF16 : open->wire_dtype;
    c->block = open->int8_block_size ? open->int8_block_size : WIRE_DEFAULT_BLOCK;
    if (c->wire == WIRE_INT8_BLOCK && c->m->cfg.dim % c->block) c->block = c->m->cfg.dim;
    if (open->idle_timeout_ms > 0) c->idle_ms = open->idle_timeout_ms;
    if ((rc = shard_session_open(c->core, open->session_id, open->max_length, open->adapter_id, &c->sess)))
        return rpc_status_from_fu(st, rc);
    int64_t cached = shard_session_pin_prefix(c->core, c->sess, open->prefix_tokens, (int)open->n_prefix_tokens);
    if (open->n_chain && (rc = downstream_open(srv, open, &c->ds, st))) return rc;
    if (c->ds.sess && shard_svc_session_cached(c->ds.sess) < cached) cached = shard_svc_session_cached(c->ds.sess);
    if (c->ds.sess) shard_svc_session_set_wait(c->ds.sess, -1, session_watch, c);
    FU_LOG(FU_LOG_LEVEL_DEBUG, open->session_id, "opened: max_length %d, wire %s%s", open->max_length,
           wire_dtype_name(c->wire), open->n_chain ? ", forwarding" : "");
    shard_core_stats stats;
    shard_core_get_stats(c->core, &stats);
    shard_svc_opened o = {open->session_id, c->m->first, c->m->last, open->max_length, c->wire,
                          (int64_t)(stats.kv_bytes_per_pos * (uint64_t)open->max_length), cached};
    return shard_svc_stream_send_opened(c->s, &o, st);
}

/* Runs one step: rollback, the core's forward, the outputs; with forwarding the next hop's
 * reply goes back instead of ours, its timings after ours. Sends the reply. */
static int session_step(session *c, const shard_svc_step *sr, rpc_status *st) {
    if (core_closing(c->srv, c->core))
        return rpc_status_setf(st, RPC_UNAVAILABLE, "blocks [%d, %d) moved away from this server", c->m->first,
                               c->m->last);
    int budget = step_budget_check(&c->srv->cfg, sr->input, st);
    if (budget) return budget;
    int64_t t_start = fu_now_us();
    int rc_reuse;
    if (sr->has_rollback) {
        if (sr->rollback_to < 0 || sr->rollback_to > shard_session_len(c->sess))
            return rpc_status_setf(st, RPC_OUT_OF_RANGE, "step.rollback_to %lld outside [0, %d]",
                                   (long long)sr->rollback_to, shard_session_len(c->sess));
        shard_session_rollback(c->sess, (int)sr->rollback_to);
    }
    if (sr->prefix_reuse && (rc_reuse = shard_session_reuse_prefix(c->core, c->sess, (int)sr->prefix_reuse)))
        return rpc_status_from_fu(st, rc_reuse);
    shard_step step;
    int rc = step_from_req(c->core, sr->input, sr->output, sr->start_position, &step, &c->hbuf, st);
    if (rc) return rc;
    step.cancelled = session_gone;
    step.cancel_arg = c;
    if ((rc = shard_session_step(c->core, c->sess, &step)) ||
        (rc = output_from_step(c->core, &step, c->wire, c->block, &c->os)))
        return rpc_status_from_fu(st, rc);
    shard_svc_timing timings[SHARD_MAX_CHAIN + 1];
    timings[0] = (shard_svc_timing){c->srv->advertise, c->m->first, c->m->last, step.queue_us, step.compute_us, 0,
                                    sr->prefix_reuse};
    shard_svc_step_reply rep = {sr->request_id, shard_session_len(c->sess), &c->os.out, timings, 1};
    if (c->ds.sess) {
        const shard_svc_step_reply *down;
        if ((rc = downstream_step(&c->ds, sr, c->os.out.hidden, &down, st))) return rc;
        rep.output = down->output;
        rep.position = down->position;
        for (size_t i = 0; i < down->n_timing && rep.n_timing <= SHARD_MAX_CHAIN; i++)
            timings[rep.n_timing++] = down->timing[i];
    }
    timings[0].total_us = fu_now_us() - t_start;
    rc = shard_svc_stream_send_step(c->s, &rep, st);
    if (c->ds.sess) shard_svc_session_drop_reply(c->ds.sess);
    return rc == RPC_CANCELLED ? RPC_END_OF_STREAM : rc; /* cancelled: the client went away */
}

/* Waits for the client's next message and runs it. RPC_OK after a step; RPC_END_OF_STREAM once
 * the client closed, half-closed or went away; else the code that ends the stream. */
static int session_next(session *c, rpc_status *st) {
    const shard_svc_request *req;
    int rc = shard_svc_stream_recv(c->s, &req, c->idle_ms, st);
    if (rc == RPC_DEADLINE_EXCEEDED) {
        FU_LOG(FU_LOG_LEVEL_INFO, shard_session_id(c->sess), "idle for %d ms: expired", c->idle_ms);
        return rpc_status_setf(st, RPC_DEADLINE_EXCEEDED, "session idle for %d ms: expired", c->idle_ms);
    }
    if (rc == RPC_CANCELLED) return RPC_END_OF_STREAM;
    if (rc) return rc;
    if (req->kind == SHARD_SVC_CLOSE) return RPC_END_OF_STREAM;
    if (req->kind != SHARD_SVC_STEP) return rpc_status_setf(st, RPC_INVALID_ARGUMENT, "expected a step");
    return session_step(c, req->step, st);
}

/* The Session stream handler: an open, then steps until the client closes, goes away, stays idle
 * too long or sends something wrong; the session is freed on every way out. */
static int session_handler(void *ctx, shard_svc_stream *s, rpc_status *st) {
    shard_server *srv = ctx;
    if (!srv->core) return no_span(st);
    session c = {.srv = srv, .s = s, .idle_ms = srv->cfg.idle_timeout_ms > 0 ? srv->cfg.idle_timeout_ms : 120000};
    const shard_svc_request *req;
    int rc = shard_svc_stream_recv(s, &req, c.idle_ms, st);
    if (rc == RPC_CANCELLED) rc = RPC_END_OF_STREAM;
    if (!rc && req->kind != SHARD_SVC_OPEN)
        rc = rpc_status_setf(st, RPC_INVALID_ARGUMENT, "the first message of a session must be open");
    if (!rc) rc = session_start(&c, req->open, st);
    while (!rc) rc = session_next(&c, st);
    if (rc == RPC_END_OF_STREAM) rc = RPC_OK;
    if (c.sess) FU_LOG(FU_LOG_LEVEL_DEBUG, shard_session_id(c.sess), "closed (%s)", rpc_code_str(rc));
    downstream_close(&c.ds);
    if (c.core) shard_session_close(c.core, c.sess);
    core_release(srv, c.core);
    free(c.hbuf.p);
    out_storage_free(&c.os);
    return rc;
}

/* ---- stateless forward ----------------------------------------------------------------- */

/* What a Forward reply points into: one scratch session and its outputs per sequence, and the
 * span's core, held until forward_done. */
typedef struct fwd_state {
    shard_server *srv;
    shard_core *core;
    size_t n;
    shard_session **sess;   /* (n) */
    out_storage *store;     /* (n) */
    shard_svc_output *outs; /* (n) */
    shard_svc_timing timing;
} fwd_state;

/* Releases a Forward's state once its reply was sent (or it failed): sessions, buffers, core. */
static void forward_done(void *ctx, void *hold) {
    (void)ctx;
    fwd_state *f = hold;
    if (!f) return;
    for (size_t i = 0; i < f->n; i++) {
        if (f->store) out_storage_free(&f->store[i]);
        if (f->sess) shard_session_close(f->core, f->sess[i]);
    }
    core_release(f->srv, f->core);
    free(f->sess);
    free(f->store);
    free(f->outs);
    free(f);
}

/* Checks a Forward request against the span of `core` and the server's budget per call. */
static int forward_check(const shard_server *srv, const mdl_model *m, const shard_svc_forward *req,
                         rpc_status *st) {
    if (req->n_sequences == 0 || req->n_sequences > SHARD_MAX_SEQUENCES)
        return rpc_status_setf(st, RPC_INVALID_ARGUMENT, "sequences: 1..%d required", SHARD_MAX_SEQUENCES);
    int64_t total = 0;
    for (size_t i = 0; i < req->n_sequences; i++) total += input_positions(&req->sequences[i]);
    int budget = srv->cfg.max_forward_tokens > 0 ? srv->cfg.max_forward_tokens : SHARD_DEFAULT_FORWARD_TOKENS;
    if (total > budget)
        return rpc_status_setf(st, RPC_RESOURCE_EXHAUSTED,
                               "Forward of %lld positions in %zu sequences is over this server's budget of %d "
                               "positions per call", (long long)total, req->n_sequences, budget);
    if ((req->first_block || req->last_block) && (req->first_block != m->first || req->last_block != m->last))
        return rpc_status_setf(st, RPC_FAILED_PRECONDITION, "expected blocks [%d, %d), this server holds [%d, %d)",
                               req->first_block, req->last_block, m->first, m->last);
    return RPC_OK;
}

/* Runs sequence i of the request from position 0 in a session of its own and encodes its
 * outputs into f->outs[i]; adds its times to *queue / *compute. */
static int forward_one(fwd_state *f, const shard_svc_forward *req, size_t i, uint64_t fid, grow_buf *hbuf,
                       int64_t *queue, int64_t *compute, rpc_status *st) {
    const mdl_model *m = shard_core_model(f->core);
    const shard_svc_input *in = &req->sequences[i];
    shard_step step;
    int rc = step_from_req(f->core, in, req->output, 0, &step, hbuf, st);
    if (rc) return rc;
    int dt = req->wire_dtype != 0 ? req->wire_dtype : in->hidden ? in->hidden->dtype : WIRE_BF16;
    if (!wire_dtype_valid(dt)) return rpc_status_setf(st, RPC_INVALID_ARGUMENT, "wire_dtype: unknown");
    int block = in->hidden && in->hidden->block_size > 0 ? in->hidden->block_size : WIRE_DEFAULT_BLOCK;
    if (dt == WIRE_INT8_BLOCK && m->cfg.dim % block) block = m->cfg.dim;
    char id[64];
    snprintf(id, sizeof id, "forward-%llu-%zu", (unsigned long long)fid, i);
    int frc = shard_session_open(f->core, id, step.n, req->adapter_id, &f->sess[i]);
    float *final = NULL; /* embeddings: the head's normed hidden states */
    if (!frc && req->output && req->output->want_hidden && m->has_head) {
        if (!(final = malloc((size_t)step.n * (size_t)m->cfg.dim * sizeof *final + 1)))
            frc = fu_errorf(FU_ERR_NOMEM, "embeddings");
        if (!frc) frc = shard_session_final_hidden(f->core, f->sess[i], step.tokens, step.hidden, step.n, final);
        step.out_hidden = final, step.out_logits = NULL, step.out_tokens = NULL;
    } else if (!frc) {
        frc = shard_session_step(f->core, f->sess[i], &step);
    }
    if (!frc) frc = output_from_step(f->core, &step, dt, block, &f->store[i]);
    free(final);
    if (frc) {
        rc = rpc_status_from_fu(st, frc);
        char m2[256];
        snprintf(m2, sizeof m2, "%s", st->message);
        return rpc_status_setf(st, rc, "sequences[%zu]: %s", i, m2);
    }
    f->outs[i] = f->store[i].out;
    *queue += step.queue_us;
    *compute += step.compute_us;
    return RPC_OK;
}

/* Forward: every sequence through this span, keeping nothing once the reply is sent. */
static int forward_handler(void *ctx, const shard_svc_forward *req, shard_svc_forward_reply *reply, void **hold,
                           rpc_status *st) {
    shard_server *srv = ctx;
    shard_core *core = core_acquire(srv, req->first_block, req->last_block);
    if (!core) return no_span(st);
    const mdl_model *m = shard_core_model(core);
    int rc = forward_check(srv, m, req, st);
    fwd_state *f = rc ? NULL : calloc(1, sizeof *f);
    if (!rc && !f) rc = rpc_status_setf(st, RPC_RESOURCE_EXHAUSTED, "out of memory");
    if (rc) {
        core_release(srv, core);
        return rc;
    }
    *f = (fwd_state){.srv = srv, .core = core, .n = req->n_sequences};
    f->sess = calloc(f->n, sizeof *f->sess);
    f->store = calloc(f->n, sizeof *f->store);
    f->outs = calloc(f->n, sizeof *f->outs);
    if (!f->sess || !f->store || !f->outs) rc = rpc_status_setf(st, RPC_RESOURCE_EXHAUSTED, "out of memory");
    uint64_t fid = atomic_fetch_add(&srv->fwd_counter, 1);
    int64_t queue = 0, compute = 0, t0 = fu_now_us();
    grow_buf hbuf = {0};
    for (size_t i = 0; i < f->n && !rc; i++) rc = forward_one(f, req, i, fid, &hbuf, &queue, &compute, st);
    free(hbuf.p);
    if (rc) {
        forward_done(srv, f);
        return rc;
    }
    f->timing = (shard_svc_timing){srv->advertise, m->first, m->last, queue, compute, fu_now_us() - t0, 0};
    *reply = (shard_svc_forward_reply){req->request_id, f->outs, f->n, &f->timing, 1};
    *hold = f;
    return RPC_OK;
}

/* ---- info and health ----------------------------------------------------------------- */

static const int shard_wire_dtypes[] = {WIRE_F32, WIRE_BF16, WIRE_F16, WIRE_INT8_BLOCK};

/* Info: the span held and the server's figures. */
static int info_handler(void *ctx, shard_svc_info *r, rpc_status *st) {
    shard_server *srv = ctx;
    shard_core *core = core_acquire(srv, 0, 0);
    if (!core) return no_span(st);
    const mdl_model *m = shard_core_model(core);
    shard_core_stats stats;
    shard_core_get_stats(core, &stats);
    r->model_name = srv->cfg.model_name ? srv->cfg.model_name : m->name;
    r->n_layers = m->cfg.n_layers;
    r->first_block = m->first;
    r->last_block = m->last;
    r->has_embeddings = m->has_embed;
    r->has_head = m->has_head;
    r->dtype = m->last > m->first ? op_type_name(m->layers[0].wq.type)
                                  : op_type_name(m->has_head ? m->lm_head.type : m->tok_embd.type);
    r->device = srv->cfg.device ? srv->cfg.device : "cpu";
    r->tokens_per_s = srv->cfg.tokens_per_s;
    r->free_kv_bytes = (int64_t)stats.kv_free_bytes;
    r->total_kv_bytes = (int64_t)stats.kv_total_bytes;
    r->active_sessions = stats.active_sessions;
    r->version = SHARD_VERSION;
    r->hidden_size = m->cfg.dim;
    r->vocab_size = m->cfg.vocab_size;
    r->max_length = m->cfg.max_seq_len;
    r->wire_dtypes = shard_wire_dtypes;
    r->n_wire_dtypes = sizeof shard_wire_dtypes / sizeof shard_wire_dtypes[0];
    r->max_message_bytes = (int64_t)(srv->cfg.max_message_bytes ? srv->cfg.max_message_bytes
                                                                : RPC_DEFAULT_MAX_MESSAGE);
    r->kv_bytes_per_position = (int64_t)stats.kv_bytes_per_pos;
    r->prefix_cached_blocks = stats.prefix_cached_blocks;
    r->prefix_hit_tokens = (int64_t)stats.prefix_hit_tokens;
    r->prefix_prompt_tokens = (int64_t)stats.prefix_prompt_tokens;
    r->prompt_step_tokens = srv->cfg.prompt_step_tokens, r->prompt_step_s = srv->cfg.prompt_step_s;
    r->decode_step_tokens = srv->cfg.decode_step_tokens, r->decode_step_s = srv->cfg.decode_step_s;
    r->n_prompt_steps = (size_t)srv->cfg.n_prompt_steps, r->n_decode_steps = (size_t)srv->cfg.n_decode_steps;
    char **ids = NULL;
    int n_ids = 0, rc = shard_core_adapter_ids(core, &ids, &n_ids);
    core_release(srv, core);
    if (rc) return rpc_status_from_fu(st, rc);
    r->adapters = (const char *const *)ids;
    r->n_adapters = (size_t)n_ids;
    return RPC_OK;
}

/* Releases what an Info reply pointed at once it was sent: the adapter ids. */
static void info_done(void *ctx, shard_svc_info *r) {
    (void)ctx;
    free((void *)r->adapters);
}

/* Health: serving, or draining once shard_server_drain began. */
static int health_handler(void *ctx, shard_svc_health *r, rpc_status *st) {
    (void)st;
    shard_server *srv = ctx;
    bool draining = atomic_load(&srv->draining);
    r->status = draining ? SHARD_SVC_SERVING_DRAINING : SHARD_SVC_SERVING_SERVING;
    r->message = draining ? "draining" : "serving";
    return RPC_OK;
}

/* ---- adapters ------------------------------------------------------------------------- */

/* LoadAdapter: the state's adapter into the current span's core as `id` (*bytes: its floats'
 * memory). INVALID_ARGUMENT naming the field for a state that does not fit this server,
 * RESOURCE_EXHAUSTED past the core's adapter limit. */
static int load_adapter_handler(void *ctx, const char *id, const shard_svc_state *state, int64_t *bytes,
                                rpc_status *st) {
    shard_server *srv = ctx;
    shard_core *core = core_acquire(srv, 0, 0);
    if (!core) return no_span(st);
    int max_rank = srv->cfg.max_lora_rank > 0 ? srv->cfg.max_lora_rank : SHARD_DEFAULT_LORA_RANK;
    lora_adapter *ad = NULL;
    int rc = shard_lora_from_state(shard_core_model(core), state, max_rank, &ad, st);
    if (!rc) {
        *bytes = (int64_t)(ad->n_floats * sizeof *ad->data);
        int frc = shard_core_adapter_load(core, id, ad);
        if (frc) {
            rc = rpc_status_from_fu(st, frc);
            lora_free(ad);
        }
    }
    core_release(srv, core);
    return rc;
}

/* UnloadAdapter: NOT_FOUND when the current span holds no adapter `id`. */
static int unload_adapter_handler(void *ctx, const char *id, rpc_status *st) {
    shard_server *srv = ctx;
    shard_core *core = core_acquire(srv, 0, 0);
    if (!core) return no_span(st);
    int frc = shard_core_adapter_unload(core, id);
    core_release(srv, core);
    return frc ? rpc_status_from_fu(st, frc) : RPC_OK;
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
    s->handlers = (shard_svc_handlers){s, session_handler, forward_handler, forward_done, info_handler,
                                       health_handler, load_adapter_handler, unload_adapter_handler, info_done};
    rpc_server_options ro = {cfg->listen, cfg->tls_cert, cfg->tls_key, cfg->allow_insecure, cfg->secret,
                             cfg->max_message_bytes, cfg->n_workers > 0 ? cfg->n_workers : 4, cfg->tls_client_ca,
                             cfg->max_sessions};
    int rc = rpc_server_new(&ro, &s->rpc);
    if (!rc && !cfg->advertise) { /* name ourselves by the port actually bound */
        const char *colon = strrchr(cfg->listen, ':');
        char name[300];
        snprintf(name, sizeof name, "%.*s:%d", colon ? (int)(colon - cfg->listen) : 0, cfg->listen,
                 rpc_server_port(s->rpc));
        free(s->advertise);
        if (!(s->advertise = strdup(name))) rc = fu_errorf(FU_ERR_NOMEM, "server");
    }
    if (!rc) rc = shard_svc_serve(s->rpc, &s->handlers);
    shard_train_config tc = {cfg->train_budget_bytes, cfg->max_train_jobs, cfg->max_lora_rank, 0, 0,
                             cfg->train_priority};
    if (!rc) rc = shard_train_new(&tc, &s->train);
    if (!rc) {
        shard_train_set_core(s->train, core);
        rc = shard_train_serve(s->train, s->rpc);
    }
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
    shard_train_set_core(s->train, core);
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
    if (!rc) shard_train_set_core(s->train, core);
    return rc;
}

shard_core *shard_server_old_core(shard_server *s, bool close) {
    pthread_mutex_lock(&s->cmu);
    shard_core *c = NULL;
    if (s->slot[1].core && s->slot[1].users == 0 && !shard_train_uses(s->train, s->slot[1].core)) {
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
    shard_train_free(s->train);
    pthread_mutex_destroy(&s->cmu);
    free(s->advertise);
    free(s);
}

/* ---- fuzzing hook ---------------------------------------------------------------------- */

int shard_rpc_fuzz_one(shard_core *core, shard_session *scratch, const void *data, size_t len) {
    rpc_status st = {0};
    const shard_svc_request *req = NULL;
    int rc = shard_svc_request_decode(data, len, 1u << 20, &req, &st);
    if (rc) return rc;
    if (req->kind == SHARD_SVC_OPEN) {
        rc = check_open(core, req->open, &st);
    } else if (req->kind == SHARD_SVC_STEP) {
        const shard_svc_step *sr = req->step;
        grow_buf hbuf = {0};
        shard_step step;
        int64_t start = shard_session_len(scratch);
        rc = step_from_req(core, sr->input, sr->output, start, &step, &hbuf, &st);
        if (!rc) {
            rc = shard_session_step(core, scratch, &step);
            if (!rc) {
                out_storage os;
                memset(&os, 0, sizeof os);
                rc = output_from_step(core, &step, WIRE_INT8_BLOCK, shard_core_model(core)->cfg.dim, &os);
                shard_svc_step_reply rep = {sr->request_id, shard_session_len(scratch), &os.out, NULL, 0};
                size_t bytes;
                if (!rc) rc = shard_svc_step_reply_size(&rep, &bytes, &st);
                out_storage_free(&os);
            }
            shard_session_rollback(scratch, 0);
        }
        free(hbuf.p);
    }
    shard_svc_request_free(req);
    return rc;
}
