/* shard-svc.c -- fusion.Shard's messages packed from and unpacked into the plain structs of shard-svc.h. */
#include "shard-svc.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "clock.h"
#include "fusion.pb-c.h"
#include "grow.h"
#include "rpc.h"
#include "status.h"
#include "svc-impl.h"

/* ---- scratch ---------------------------------------------------------------------------- */

/* Arrays a stream or session reuses from message to message, grown on demand
 * (so a warm one packs and unpacks without allocating). Packing and views
 * use different kinds: a reply may be packed while request views live. */
enum {
    SC_BIAS, SC_BIAS_PTRS, SC_HOPS, SC_HOP_PTRS, SC_TOKENS, SC_PREFIX, /* packing requests */
    SC_OUTS, SC_OUT_PTRS, SC_TENSORS, SC_TOPS, SC_TOP_PTRS,      /* packing outputs */
    SC_ENTRIES, SC_ENTRY_PTRS, SC_TIMING, SC_TIMING_PTRS, SC_OUT_TOKENS,
    SC_V_BIAS, SC_V_HOPS, SC_V_INPUTS, SC_V_TENSORS, SC_V_TOKENS, SC_V_ID, SC_V_PREFIX, /* views of requests */
    SC_V_TOP, SC_V_TOP_TOKENS, SC_V_TOP_LP, SC_V_TIMING, SC_V_OUT_TOKENS, /* views of replies */
    SC_KINDS
};

typedef struct svc_scratch {
    void *p[SC_KINDS];
    size_t cap[SC_KINDS];
} svc_scratch;

/* Room for n elements of `size` bytes in array `kind` (contents not kept
 * meaningful across calls); NULL when out of memory. */
static void *scratch(svc_scratch *sc, int kind, size_t n, size_t size) {
    if (fu_grow(&sc->p[kind], &sc->cap[kind], n ? n : 1, size)) return NULL;
    return sc->p[kind];
}

/* Frees every array (the scratch is empty and reusable after). */
static void scratch_free(svc_scratch *sc) {
    for (int k = 0; k < SC_KINDS; k++) free(sc->p[k]);
    memset(sc, 0, sizeof *sc);
}

/* ---- packing: plain structs -> messages (pointing into the structs) ------------------------- */

/* An Input with v's tokens (widened to the wire's int64 in scratch) and its hidden tensor in
 * *hidden. -1 when out of memory. */
static int input_pack(const shard_svc_input *v, Fusion__Input *m, Fusion__Tensor *hidden, svc_scratch *sc) {
    int64_t *tokens = scratch(sc, SC_TOKENS, v->n_tokens, sizeof *tokens);
    if (!tokens) return -1;
    svc_input_pack(v, tokens, m, hidden);
    return 0;
}

/* The OutputSpec (and its Sampling in *samp); -1 when out of memory. */
static int spec_pack(const shard_svc_output_spec *v, Fusion__OutputSpec *m, Fusion__Sampling *samp,
                     svc_scratch *sc) {
    fusion__output_spec__init(m);
    m->want_logits = v->want_logits;
    m->all_positions = v->all_positions;
    m->score_inputs = v->score_inputs;
    m->want_hidden = v->want_hidden;
    m->top_logprobs = v->top_logprobs;
    const shard_svc_sampling *w = v->sampling;
    if (!w) return 0;
    fusion__sampling__init(samp);
    samp->temperature = w->temperature;
    samp->top_p = w->top_p;
    samp->top_k = w->top_k;
    samp->min_p = w->min_p;
    samp->seed = w->seed;
    samp->presence_penalty = w->presence_penalty;
    samp->frequency_penalty = w->frequency_penalty;
    samp->repetition_penalty = w->repetition_penalty;
    samp->penalty_start = w->penalty_start;
    size_t n = w->n_logit_bias;
    Fusion__LogitBias *bias = scratch(sc, SC_BIAS, n, sizeof *bias);
    Fusion__LogitBias **ptrs = scratch(sc, SC_BIAS_PTRS, n, sizeof *ptrs);
    if (!bias || !ptrs) return -1;
    for (size_t i = 0; i < n; i++) {
        fusion__logit_bias__init(&bias[i]);
        bias[i].token = w->logit_bias[i].token;
        bias[i].bias = w->logit_bias[i].bias;
        ptrs[i] = &bias[i];
    }
    samp->n_logit_bias = n;
    samp->logit_bias = n ? ptrs : NULL;
    samp->allowed_tokens = (ProtobufCBinaryData){w->n_allowed_tokens, (uint8_t *)w->allowed_tokens};
    m->sampling = samp;
    return 0;
}

/* A StepRequest with the sub-messages it points to. */
typedef struct step_msg {
    Fusion__StepRequest sr;
    Fusion__Input in;
    Fusion__Tensor hidden;
    Fusion__OutputSpec os;
    Fusion__Sampling samp;
} step_msg;

/* The chain protocol's step request: the one place it is built, for the gateway's hops and for a
 * shard forwarding to its next hop. -1 when out of memory. */
static int step_pack(const shard_svc_step *v, step_msg *m, svc_scratch *sc) {
    fusion__step_request__init(&m->sr);
    m->sr.request_id = v->request_id;
    m->sr.start_position = v->start_position;
    if (v->input) {
        if (input_pack(v->input, &m->in, &m->hidden, sc)) return -1;
        m->sr.input = &m->in;
    }
    if (v->output) {
        if (spec_pack(v->output, &m->os, &m->samp, sc)) return -1;
        m->sr.output = &m->os;
    }
    if (v->has_rollback) {
        m->sr.rollback_case = FUSION__STEP_REQUEST__ROLLBACK_ROLLBACK_TO;
        m->sr.rollback_to = v->rollback_to;
    }
    m->sr.prefix_reuse = v->prefix_reuse;
    return 0;
}

/* The chain protocol's open request (hops in scratch). -1 when out of memory. */
static int open_pack(const shard_svc_open *v, Fusion__OpenSession *m, svc_scratch *sc) {
    fusion__open_session__init(m);
    m->session_id.data = (uint8_t *)svc_str(v->session_id);
    m->session_id.len = strlen((const char *)m->session_id.data);
    m->max_length = v->max_length;
    m->wire_dtype = (Fusion__Dtype)v->wire_dtype;
    m->int8_block_size = v->int8_block_size;
    m->adapter_id = svc_str(v->adapter_id);
    m->first_block = v->first_block;
    m->last_block = v->last_block;
    m->idle_timeout_ms = v->idle_timeout_ms;
    int64_t *prefix = scratch(sc, SC_PREFIX, v->n_prefix_tokens, sizeof *prefix); /* widened to int64 */
    if (!prefix) return -1;
    for (size_t i = 0; i < v->n_prefix_tokens; i++) prefix[i] = v->prefix_tokens[i];
    m->n_prefix_tokens = v->n_prefix_tokens;
    m->prefix_tokens = v->n_prefix_tokens ? prefix : NULL;
    size_t n = v->n_chain;
    Fusion__Hop *hops = scratch(sc, SC_HOPS, n, sizeof *hops);
    Fusion__Hop **ptrs = scratch(sc, SC_HOP_PTRS, n, sizeof *ptrs);
    if (!hops || !ptrs) return -1;
    for (size_t i = 0; i < n; i++) {
        fusion__hop__init(&hops[i]);
        hops[i].address = svc_str(v->chain[i].address);
        hops[i].first_block = v->chain[i].first_block;
        hops[i].last_block = v->chain[i].last_block;
        hops[i].tls_server_name = svc_str(v->chain[i].tls_server_name);
        ptrs[i] = &hops[i];
    }
    m->n_chain = n;
    m->chain = n ? ptrs : NULL;
    return 0;
}

/* Totals over outputs v[0..n): top-logprob rows, their entries, sampled ids. */
static void outputs_count(const shard_svc_output *v, size_t n, size_t *n_top, size_t *n_ent, size_t *n_tok) {
    *n_top = *n_ent = *n_tok = 0;
    for (size_t i = 0; i < n; i++) {
        *n_top += v[i].n_top;
        *n_tok += v[i].n_tokens;
        for (size_t j = 0; j < v[i].n_top; j++) *n_ent += v[i].top[j].n;
    }
}

/* Outputs v[0..n) as messages in scratch; *out: their pointer array. -1 when out of memory. */
static int outputs_pack(const shard_svc_output *v, size_t n, Fusion__Output ***out, svc_scratch *sc) {
    size_t n_top, n_ent, n_tok;
    outputs_count(v, n, &n_top, &n_ent, &n_tok);
    int64_t *toks = scratch(sc, SC_OUT_TOKENS, n_tok, sizeof *toks); /* widened to the wire's int64 */
    Fusion__Output *outs = scratch(sc, SC_OUTS, n, sizeof *outs);
    Fusion__Output **out_ptrs = scratch(sc, SC_OUT_PTRS, n, sizeof *out_ptrs);
    Fusion__Tensor *tensors = scratch(sc, SC_TENSORS, 2 * n, sizeof *tensors);
    Fusion__TopLogprobs *tops = scratch(sc, SC_TOPS, n_top, sizeof *tops);
    Fusion__TopLogprobs **top_ptrs = scratch(sc, SC_TOP_PTRS, n_top, sizeof *top_ptrs);
    Fusion__TokenLogprob *ents = scratch(sc, SC_ENTRIES, n_ent, sizeof *ents);
    Fusion__TokenLogprob **ent_ptrs = scratch(sc, SC_ENTRY_PTRS, n_ent, sizeof *ent_ptrs);
    if (!outs || !out_ptrs || !tensors || !tops || !top_ptrs || !ents || !ent_ptrs || !toks) return -1;
    size_t t = 0, e = 0;
    for (size_t i = 0; i < n; i++) {
        Fusion__Output *o = &outs[i];
        fusion__output__init(o);
        if (v[i].hidden) {
            svc_tensor_pack(v[i].hidden, &tensors[2 * i]);
            o->hidden = &tensors[2 * i];
        }
        if (v[i].logits) {
            svc_tensor_pack(v[i].logits, &tensors[2 * i + 1]);
            o->logits = &tensors[2 * i + 1];
        }
        o->n_tokens = v[i].n_tokens;
        o->tokens = v[i].n_tokens ? toks : NULL;
        for (size_t k = 0; k < v[i].n_tokens; k++) *toks++ = v[i].tokens[k];
        o->n_logprobs = v[i].n_logprobs;
        o->logprobs = (float *)v[i].logprobs;
        o->n_top_logprobs = v[i].n_top;
        o->top_logprobs = v[i].n_top ? &top_ptrs[t] : NULL;
        for (size_t j = 0; j < v[i].n_top; j++) {
            const shard_svc_top *tv = &v[i].top[j];
            Fusion__TopLogprobs *tl = &tops[t];
            fusion__top_logprobs__init(tl);
            tl->n_entries = tv->n;
            tl->entries = tv->n ? &ent_ptrs[e] : NULL;
            for (size_t k = 0; k < tv->n; k++, e++) {
                fusion__token_logprob__init(&ents[e]);
                ents[e].token = tv->tokens[k];
                ents[e].logprob = tv->logprobs[k];
                ent_ptrs[e] = &ents[e];
            }
            top_ptrs[t++] = tl;
        }
        out_ptrs[i] = o;
    }
    *out = out_ptrs;
    return 0;
}

/* Timings v[0..n) as messages in scratch; *out: their pointer array. -1 when out of memory. */
static int timing_pack(const shard_svc_timing *v, size_t n, Fusion__ServerTiming ***out, svc_scratch *sc) {
    Fusion__ServerTiming *t = scratch(sc, SC_TIMING, n, sizeof *t);
    Fusion__ServerTiming **ptrs = scratch(sc, SC_TIMING_PTRS, n, sizeof *ptrs);
    if (!t || !ptrs) return -1;
    for (size_t i = 0; i < n; i++) {
        fusion__server_timing__init(&t[i]);
        t[i].server = svc_str(v[i].server);
        t[i].first_block = v[i].first_block;
        t[i].last_block = v[i].last_block;
        t[i].queue_us = v[i].queue_us;
        t[i].compute_us = v[i].compute_us;
        t[i].total_us = v[i].total_us;
        t[i].prefix_hit_tokens = v[i].prefix_hit_tokens;
        ptrs[i] = &t[i];
    }
    *out = n ? ptrs : NULL;
    return 0;
}

/* A StepReply pointing into v and scratch. -1 when out of memory. */
static int step_reply_pack(const shard_svc_step_reply *v, Fusion__StepReply *m, svc_scratch *sc) {
    fusion__step_reply__init(m);
    m->request_id = v->request_id;
    m->position = v->position;
    Fusion__Output **outs = NULL;
    if (v->output && outputs_pack(v->output, 1, &outs, sc)) return -1;
    m->output = outs ? outs[0] : NULL;
    if (timing_pack(v->timing, v->n_timing, &m->timing, sc)) return -1;
    m->n_timing = v->n_timing;
    return 0;
}

/* ---- views: messages -> plain structs (pointing into the messages) -------------------------- */

/* The views of n received Inputs m[0..n) in v[0..n) (hidden tensors in hidden[0..n), token ids
 * narrowed to int32 in scratch). Ids that do not fit int32 and tensors' block sizes beyond int32
 * are refused here, before narrowing (the vocabulary bound is the receiver's): INVALID_ARGUMENT
 * naming `what` (with the input's index when `indexed`) and the entry. */
static int inputs_view(Fusion__Input *const *m, size_t n, shard_svc_input *v, wire_tensor *hidden, const char *what,
                       bool indexed, svc_scratch *sc, rpc_status *st) {
    size_t total = 0;
    for (size_t i = 0; i < n; i++) total += m[i]->n_tokens;
    int32_t *tokens = scratch(sc, SC_V_TOKENS, total, sizeof *tokens);
    if (!tokens) return svc_no_memory(st);
    for (size_t i = 0; i < n; i++) {
        char label[48];
        if (indexed) snprintf(label, sizeof label, "%s[%zu]", what, i);
        else snprintf(label, sizeof label, "%s", what);
        int rc = svc_input_view(m[i], tokens, &v[i], &hidden[i], label, st);
        if (rc) return rc;
        tokens += m[i]->n_tokens;
    }
    return RPC_OK;
}

/* The OutputSpec's view (its sampling in *samp, logit_bias copied to scratch). Bias token ids
 * that do not fit int32 are refused (INVALID_ARGUMENT). */
static int spec_view(const Fusion__OutputSpec *m, shard_svc_output_spec *v, shard_svc_sampling *samp,
                     svc_scratch *sc, rpc_status *st) {
    v->want_logits = m->want_logits;
    v->all_positions = m->all_positions;
    v->score_inputs = m->score_inputs;
    v->want_hidden = m->want_hidden;
    v->sampling = NULL;
    const Fusion__Sampling *w = m->sampling;
    int32_t top_k = 0;
    svc_i32 f[] = {{"output.top_logprobs", m->top_logprobs, &v->top_logprobs},
                   {"output.sampling.top_k", w ? w->top_k : 0, &top_k}};
    int rc = svc_narrow(f, 2, "", st);
    if (rc || !w) return rc;
    smp_bias *bias = scratch(sc, SC_V_BIAS, w->n_logit_bias, sizeof *bias);
    if (!bias) return svc_no_memory(st);
    for (size_t i = 0; i < w->n_logit_bias; i++) {
        int64_t tok = w->logit_bias[i]->token;
        if (tok < 0 || tok > INT32_MAX)
            return rpc_status_setf(st, RPC_INVALID_ARGUMENT, "sampling.logit_bias[%zu].token: %lld is not a valid id",
                                   i, (long long)tok);
        bias[i].token = (int32_t)tok;
        bias[i].bias = w->logit_bias[i]->bias;
    }
    *samp = (shard_svc_sampling){w->temperature, w->top_p, top_k, w->min_p, w->seed, w->presence_penalty,
                                 w->frequency_penalty, w->repetition_penalty, bias, w->n_logit_bias,
                                 w->penalty_start, w->allowed_tokens.len ? w->allowed_tokens.data : NULL,
                                 w->allowed_tokens.len};
    v->sampling = samp;
    return RPC_OK;
}

/* The views of received hops m[0..n) in v[0..n): names and blocks checked (INVALID_ARGUMENT). */
static int hops_view(Fusion__Hop *const *m, size_t n, shard_svc_hop *v, rpc_status *st) {
    for (size_t i = 0; i < n; i++) {
        const Fusion__Hop *h = m[i];
        v[i] = (shard_svc_hop){.address = svc_str(h->address),
                               .tls_server_name = svc_str(h->tls_server_name)};
        svc_i32 f[] = {{"first_block", h->first_block, &v[i].first_block},
                       {"last_block", h->last_block, &v[i].last_block}};
        int rc = svc_name_check(v[i].address, SHARD_SVC_MAX_NAME, "open.chain.address", st);
        if (!rc) rc = svc_name_check(v[i].tls_server_name, SHARD_SVC_MAX_NAME, "open.chain.tls_server_name", st);
        if (!rc) rc = svc_narrow(f, 2, "open.chain.", st);
        if (rc) return rc;
    }
    return RPC_OK;
}

/* The OpenSession's view (session id and hops in scratch). The session id (bytes on the wire)
 * is refused with an embedded NUL, a control character or beyond SHARD_SVC_MAX_ID bytes; the
 * other names with a control character or beyond SHARD_SVC_MAX_NAME bytes (INVALID_ARGUMENT). */
static int open_view(const Fusion__OpenSession *m, shard_svc_open *v, svc_scratch *sc, rpc_status *st) {
    const ProtobufCBinaryData *sid = &m->session_id;
    if (sid->len > SHARD_SVC_MAX_ID)
        return rpc_status_setf(st, RPC_INVALID_ARGUMENT, "open.session_id: longer than %d bytes", SHARD_SVC_MAX_ID);
    if (sid->len && memchr(sid->data, '\0', sid->len))
        return rpc_status_setf(st, RPC_INVALID_ARGUMENT, "open.session_id: embedded NUL byte");
    char *id = scratch(sc, SC_V_ID, sid->len + 1, 1);
    shard_svc_hop *hops = scratch(sc, SC_V_HOPS, m->n_chain, sizeof *hops);
    int32_t *prefix = scratch(sc, SC_V_PREFIX, m->n_prefix_tokens, sizeof *prefix);
    if (!id || !hops || !prefix) return svc_no_memory(st);
    if (sid->len) memcpy(id, sid->data, sid->len);
    id[sid->len] = '\0';
    *v = (shard_svc_open){.session_id = id, .wire_dtype = (int)m->wire_dtype, .adapter_id = svc_str(m->adapter_id),
                          .chain = hops, .n_chain = m->n_chain, .prefix_tokens = prefix,
                          .n_prefix_tokens = m->n_prefix_tokens};
    svc_i32 f[] = {{"open.max_length", m->max_length, &v->max_length},
                   {"open.int8_block_size", m->int8_block_size, &v->int8_block_size},
                   {"open.first_block", m->first_block, &v->first_block},
                   {"open.last_block", m->last_block, &v->last_block},
                   {"open.idle_timeout_ms", m->idle_timeout_ms, &v->idle_timeout_ms}};
    int rc = svc_name_check(id, SHARD_SVC_MAX_ID, "open.session_id", st);
    if (!rc) rc = svc_name_check(v->adapter_id, SHARD_SVC_MAX_NAME, "open.adapter_id", st);
    if (!rc) rc = svc_narrow(f, sizeof f / sizeof f[0], "", st);
    if (!rc) rc = svc_ids_view(m->prefix_tokens, m->n_prefix_tokens, prefix, "open.prefix_tokens", st);
    return rc ? rc : hops_view(m->chain, m->n_chain, hops, st);
}

/* The TopLogprobs of a received Output, flattened into scratch, in *top (n: m->n_top_logprobs). */
static int tops_view(const Fusion__Output *m, shard_svc_top **top_out, svc_scratch *sc, rpc_status *st) {
    size_t n_ent = 0;
    for (size_t i = 0; i < m->n_top_logprobs; i++) n_ent += m->top_logprobs[i]->n_entries;
    shard_svc_top *top = scratch(sc, SC_V_TOP, m->n_top_logprobs, sizeof *top);
    int32_t *tokens = scratch(sc, SC_V_TOP_TOKENS, n_ent, sizeof *tokens);
    float *lp = scratch(sc, SC_V_TOP_LP, n_ent, sizeof *lp);
    if (!top || !tokens || !lp) return svc_no_memory(st);
    size_t e = 0;
    for (size_t i = 0; i < m->n_top_logprobs; i++) {
        const Fusion__TopLogprobs *tl = m->top_logprobs[i];
        top[i] = (shard_svc_top){&tokens[e], &lp[e], tl->n_entries};
        for (size_t k = 0; k < tl->n_entries; k++, e++) {
            int rc = svc_ids_view(&tl->entries[k]->token, 1, &tokens[e], "output.top_logprobs.entries.token", st);
            if (rc) return rc;
            lp[e] = tl->entries[k]->logprob;
        }
    }
    *top_out = top;
    return RPC_OK;
}

/* An Output's view (sampled ids and top logprobs in scratch); INVALID_ARGUMENT for a value its
 * view cannot hold. */
static int output_view(const Fusion__Output *m, shard_svc_output *v, wire_tensor *hidden, wire_tensor *logits,
                       svc_scratch *sc, rpc_status *st) {
    memset(v, 0, sizeof *v);
    int32_t *tokens = scratch(sc, SC_V_OUT_TOKENS, m->n_tokens, sizeof *tokens);
    if (!tokens) return svc_no_memory(st);
    int rc = m->hidden ? svc_tensor_view(m->hidden, hidden, "output.hidden", st) : RPC_OK;
    if (!rc && m->logits) rc = svc_tensor_view(m->logits, logits, "output.logits", st);
    if (!rc) rc = svc_ids_view(m->tokens, m->n_tokens, tokens, "output.tokens", st);
    shard_svc_top *top = NULL;
    if (!rc) rc = tops_view(m, &top, sc, st);
    if (rc) return rc;
    v->hidden = m->hidden ? hidden : NULL;
    v->logits = m->logits ? logits : NULL;
    v->tokens = m->n_tokens ? tokens : NULL;
    v->n_tokens = m->n_tokens;
    v->logprobs = m->logprobs;
    v->n_logprobs = m->n_logprobs;
    v->top = top;
    v->n_top = m->n_top_logprobs;
    return RPC_OK;
}

/* A Session request and the views into it (the message is owned). */
typedef struct req_view {
    shard_svc_request req; /* first: shard_svc_request_free casts back */
    ProtobufCMessage *msg;
    shard_svc_open open;
    shard_svc_step step;
    shard_svc_input in;
    wire_tensor hidden;
    shard_svc_output_spec spec;
    shard_svc_sampling samp;
    svc_scratch sc;
} req_view;

/* Frees the message and forgets the views (the scratch is kept for the next one). */
static void req_view_clear(req_view *rv) {
    rpc_msg_free(rv->msg);
    rv->msg = NULL;
    memset(&rv->req, 0, sizeof rv->req);
}

/* Takes msg (a SessionRequest) and makes rv's views of it. */
static int req_view_set(req_view *rv, ProtobufCMessage *msg, rpc_status *st) {
    req_view_clear(rv);
    rv->msg = msg;
    const Fusion__SessionRequest *m = (const Fusion__SessionRequest *)msg;
    shard_svc_request *r = &rv->req;
    if (m->kind_case == FUSION__SESSION_REQUEST__KIND_OPEN && m->open) {
        int rc = open_view(m->open, &rv->open, &rv->sc, st);
        if (rc) return rc;
        r->kind = SHARD_SVC_OPEN;
        r->open = &rv->open;
    } else if (m->kind_case == FUSION__SESSION_REQUEST__KIND_STEP && m->step) {
        const Fusion__StepRequest *s = m->step;
        rv->step = (shard_svc_step){s->request_id, s->start_position, NULL, NULL,
                                    s->rollback_case == FUSION__STEP_REQUEST__ROLLBACK_ROLLBACK_TO,
                                    s->rollback_to, s->prefix_reuse};
        int rc;
        if (s->input) {
            if ((rc = inputs_view(&s->input, 1, &rv->in, &rv->hidden, "input", false, &rv->sc, st))) return rc;
            rv->step.input = &rv->in;
        }
        if (s->output) {
            if ((rc = spec_view(s->output, &rv->spec, &rv->samp, &rv->sc, st))) return rc;
            rv->step.output = &rv->spec;
        }
        r->kind = SHARD_SVC_STEP;
        r->step = &rv->step;
    } else if (m->kind_case == FUSION__SESSION_REQUEST__KIND_CLOSE) {
        r->kind = SHARD_SVC_CLOSE;
        r->close_reason = m->close && m->close->reason ? m->close->reason : "";
    }
    return RPC_OK;
}

/* ---- sampling --------------------------------------------------------------------------- */

shard_svc_sampling shard_svc_sampling_from_params(const smp_params *p, int64_t penalty_start) {
    return (shard_svc_sampling){p->temperature, p->top_p, p->top_k, p->min_p, p->seed, p->presence_penalty,
                                p->frequency_penalty, p->repetition_penalty, p->bias,
                                p->n_bias > 0 ? (size_t)p->n_bias : 0, penalty_start, p->allowed,
                                p->allowed ? p->n_allowed : 0};
}

smp_params shard_svc_sampling_to_params(const shard_svc_sampling *w) {
    smp_params p = smp_params_default();
    p.temperature = w->temperature;
    p.top_p = w->top_p == 0 ? 1.0f : w->top_p;
    p.top_k = w->top_k;
    p.min_p = w->min_p;
    p.seed = w->seed;
    p.presence_penalty = w->presence_penalty;
    p.frequency_penalty = w->frequency_penalty;
    p.repetition_penalty = w->repetition_penalty == 0 ? 1.0f : w->repetition_penalty;
    p.bias = w->logit_bias;
    p.n_bias = (int)w->n_logit_bias;
    p.allowed = w->allowed_tokens;
    p.n_allowed = w->n_allowed_tokens;
    return p;
}

/* ---- server: Session streams ---------------------------------------------------------------- */

struct shard_svc_stream {
    rpc_stream *s;
    req_view rv;    /* the last request received */
    svc_scratch sc; /* packing replies */
};

bool shard_svc_stream_cancelled(shard_svc_stream *s) { return rpc_stream_cancelled(s->s); }

/* A Session stream: the handler runs on a shard_svc_stream wrapping it, freed when it returns. */
static int session_entry(void *ctx, rpc_stream *rs, rpc_status *st) {
    const shard_svc_handlers *h = ctx;
    shard_svc_stream *s = calloc(1, sizeof *s);
    if (!s) return svc_no_memory(st);
    s->s = rs;
    int rc = h->session(h->ctx, s, st);
    req_view_clear(&s->rv);
    scratch_free(&s->rv.sc);
    scratch_free(&s->sc);
    free(s);
    return rc;
}

int shard_svc_stream_recv(shard_svc_stream *s, const shard_svc_request **req, int timeout_ms, rpc_status *st) {
    *req = NULL;
    req_view_clear(&s->rv);
    ProtobufCMessage *msg = NULL;
    int rc = rpc_stream_recv(s->s, NULL, &msg, timeout_ms, st);
    if (!rc) rc = req_view_set(&s->rv, msg, st);
    if (!rc) *req = &s->rv.req;
    return rc;
}

int shard_svc_stream_send_opened(shard_svc_stream *s, const shard_svc_opened *o, rpc_status *st) {
    Fusion__OpenReply orep = FUSION__OPEN_REPLY__INIT;
    orep.session_id = svc_str(o->session_id);
    orep.first_block = o->first_block;
    orep.last_block = o->last_block;
    orep.max_length = o->max_length;
    orep.wire_dtype = (Fusion__Dtype)o->wire_dtype;
    orep.kv_bytes = o->kv_bytes;
    orep.cached_tokens = o->cached_tokens;
    Fusion__SessionReply rep = FUSION__SESSION_REPLY__INIT;
    rep.kind_case = FUSION__SESSION_REPLY__KIND_OPENED;
    rep.opened = &orep;
    return rpc_stream_send(s->s, &rep.base, st);
}

int shard_svc_stream_send_step(shard_svc_stream *s, const shard_svc_step_reply *r, rpc_status *st) {
    Fusion__StepReply srep;
    if (step_reply_pack(r, &srep, &s->sc)) return svc_no_memory(st);
    Fusion__SessionReply rep = FUSION__SESSION_REPLY__INIT;
    rep.kind_case = FUSION__SESSION_REPLY__KIND_STEP;
    rep.step = &srep;
    return rpc_stream_send(s->s, &rep.base, st);
}

int shard_svc_request_decode(const void *data, size_t len, size_t max_bytes, const shard_svc_request **req,
                             rpc_status *st) {
    *req = NULL;
    req_view *rv = calloc(1, sizeof *rv);
    if (!rv) return svc_no_memory(st);
    ProtobufCMessage *msg = NULL;
    int rc = rpc_msg_unpack(&fusion__session_request__descriptor, data, len, max_bytes, &msg, st);
    if (!rc) rc = req_view_set(rv, msg, st);
    if (rc) {
        shard_svc_request_free(&rv->req);
        return rc;
    }
    *req = &rv->req;
    return RPC_OK;
}

void shard_svc_request_free(const shard_svc_request *req) {
    if (!req) return;
    req_view *rv = (req_view *)req;
    req_view_clear(rv);
    scratch_free(&rv->sc);
    free(rv);
}

int shard_svc_step_reply_size(const shard_svc_step_reply *r, size_t *bytes, rpc_status *st) {
    svc_scratch sc = {0};
    Fusion__StepReply srep;
    int rc = step_reply_pack(r, &srep, &sc) ? svc_no_memory(st) : RPC_OK;
    Fusion__SessionReply rep = FUSION__SESSION_REPLY__INIT;
    rep.kind_case = FUSION__SESSION_REPLY__KIND_STEP;
    rep.step = &srep;
    *bytes = rc ? 0 : protobuf_c_message_get_packed_size(&rep.base);
    scratch_free(&sc);
    return rc;
}

/* ---- server: unary methods ---------------------------------------------------------------- */

/* A Forward reply in flight: packed messages pointing into the handler's memory (hold). */
typedef struct fwd_call {
    Fusion__ForwardReply rep; /* first: the layer frees it through forward_free */
    const shard_svc_handlers *h;
    void *hold;
    svc_scratch sc;
} fwd_call;

/* Releases a Forward reply after it was sent: the handler's hold, then the packing. */
static void forward_free(void *ctx, ProtobufCMessage *msg) {
    (void)ctx;
    fwd_call *c = (fwd_call *)msg;
    if (c->h->forward_done) c->h->forward_done(c->h->ctx, c->hold);
    scratch_free(&c->sc);
    free(c);
}

/* The ForwardRequest's view; sequences, tensors and logit_bias in scratch. Refuses what the
 * views cannot carry, as the Session views do. */
static int forward_view(const Fusion__ForwardRequest *m, shard_svc_forward *v, shard_svc_output_spec *spec,
                        shard_svc_sampling *samp, svc_scratch *sc, rpc_status *st) {
    shard_svc_input *seq = scratch(sc, SC_V_INPUTS, m->n_sequences, sizeof *seq);
    wire_tensor *hidden = scratch(sc, SC_V_TENSORS, m->n_sequences, sizeof *hidden);
    if (!seq || !hidden) return svc_no_memory(st);
    *v = (shard_svc_forward){m->request_id, seq, m->n_sequences, NULL, (int)m->wire_dtype, svc_str(m->adapter_id),
                             0, 0};
    svc_i32 f[] = {{"first_block", m->first_block, &v->first_block}, {"last_block", m->last_block, &v->last_block}};
    int rc = inputs_view(m->sequences, m->n_sequences, seq, hidden, "sequences", true, sc, st);
    if (!rc) rc = svc_name_check(v->adapter_id, SHARD_SVC_MAX_NAME, "adapter_id", st);
    if (!rc) rc = svc_narrow(f, 2, "", st);
    if (rc) return rc;
    if (m->output) {
        if ((rc = spec_view(m->output, spec, samp, sc, st))) return rc;
        v->output = spec;
    }
    return RPC_OK;
}

/* Forward: the request's view to the handler, its reply packed (released by forward_free). */
static int forward_entry(void *ctx, const ProtobufCMessage *req_msg, ProtobufCMessage **reply, rpc_status *st) {
    const shard_svc_handlers *h = ctx;
    svc_scratch vs = {0};
    shard_svc_forward req;
    shard_svc_output_spec spec;
    shard_svc_sampling samp;
    shard_svc_forward_reply r = {0};
    void *hold = NULL;
    int rc = forward_view((const Fusion__ForwardRequest *)req_msg, &req, &spec, &samp, &vs, st);
    if (!rc) rc = h->forward(h->ctx, &req, &r, &hold, st);
    scratch_free(&vs);
    if (rc) return rc;
    fwd_call *c = calloc(1, sizeof *c);
    Fusion__Output **outs = NULL;
    if (c) {
        fusion__forward_reply__init(&c->rep);
        c->h = h;
        c->hold = hold;
    }
    if (!c || outputs_pack(r.outputs, r.n_outputs, &outs, &c->sc) ||
        timing_pack(r.timing, r.n_timing, &c->rep.timing, &c->sc)) {
        if (c) forward_free(NULL, &c->rep.base);
        else if (h->forward_done) h->forward_done(h->ctx, hold);
        return svc_no_memory(st);
    }
    c->rep.request_id = r.request_id;
    c->rep.n_outputs = r.n_outputs;
    c->rep.outputs = r.n_outputs ? outs : NULL;
    c->rep.n_timing = r.n_timing;
    *reply = &c->rep.base;
    return RPC_OK;
}

/* An Info reply, the handler's reply it points into, and its dtype array. */
typedef struct info_msg {
    Fusion__InfoReply rep; /* first: info_free casts back */
    shard_svc_info v;
    Fusion__Dtype dtypes[];
} info_msg;

/* Frees a reply allocated as one block. */
static void free_msg(void *ctx, ProtobufCMessage *msg) {
    (void)ctx;
    free(msg);
}

/* Frees an Info reply once sent, after the handler's info_done (if any) released its reply. */
static void info_free(void *ctx, ProtobufCMessage *msg) {
    const shard_svc_handlers *h = ctx;
    info_msg *m = (info_msg *)msg;
    if (h->info_done) h->info_done(h->ctx, &m->v);
    free(m);
}

/* The InfoReply of the handler's figures v, pointing into v. */
static void info_pack(const shard_svc_info *v, Fusion__InfoReply *r, Fusion__Dtype *dtypes) {
    fusion__info_reply__init(r);
    r->model_name = svc_str(v->model_name);
    r->n_layers = v->n_layers;
    r->first_block = v->first_block;
    r->last_block = v->last_block;
    r->has_embeddings = v->has_embeddings;
    r->has_head = v->has_head;
    r->dtype = svc_str(v->dtype);
    r->device = svc_str(v->device);
    r->tokens_per_s = v->tokens_per_s;
    r->free_kv_bytes = v->free_kv_bytes;
    r->total_kv_bytes = v->total_kv_bytes;
    r->active_sessions = v->active_sessions;
    r->version = svc_str(v->version);
    r->hidden_size = v->hidden_size;
    r->vocab_size = v->vocab_size;
    r->max_length = v->max_length;
    for (size_t i = 0; i < v->n_wire_dtypes; i++) dtypes[i] = (Fusion__Dtype)v->wire_dtypes[i];
    r->n_wire_dtypes = v->n_wire_dtypes;
    r->wire_dtypes = v->n_wire_dtypes ? dtypes : NULL;
    r->n_adapters = v->n_adapters;
    r->adapters = (char **)v->adapters;
    r->max_message_bytes = v->max_message_bytes;
    r->kv_bytes_per_position = v->kv_bytes_per_position;
    r->prefix_cached_blocks = v->prefix_cached_blocks;
    r->prefix_hit_tokens = v->prefix_hit_tokens;
    r->prefix_prompt_tokens = v->prefix_prompt_tokens;
    r->n_prompt_step_tokens = r->n_prompt_step_s = v->n_prompt_steps;
    r->prompt_step_tokens = (double *)v->prompt_step_tokens, r->prompt_step_s = (double *)v->prompt_step_s;
    r->n_decode_step_tokens = r->n_decode_step_s = v->n_decode_steps;
    r->decode_step_tokens = (double *)v->decode_step_tokens, r->decode_step_s = (double *)v->decode_step_s;
}

/* Info: the handler's figures packed (released by info_free). */
static int info_entry(void *ctx, const ProtobufCMessage *req_msg, ProtobufCMessage **reply, rpc_status *st) {
    (void)req_msg;
    const shard_svc_handlers *h = ctx;
    shard_svc_info v = {0};
    int rc = h->info(h->ctx, &v, st);
    if (rc) return rc;
    info_msg *m = malloc(sizeof *m + v.n_wire_dtypes * sizeof m->dtypes[0]);
    if (!m) {
        if (h->info_done) h->info_done(h->ctx, &v);
        return svc_no_memory(st);
    }
    m->v = v;
    info_pack(&m->v, &m->rep, m->dtypes);
    *reply = &m->rep.base;
    return RPC_OK;
}

/* Health: the handler's status packed. */
static int health_entry(void *ctx, const ProtobufCMessage *req_msg, ProtobufCMessage **reply, rpc_status *st) {
    (void)req_msg;
    const shard_svc_handlers *h = ctx;
    shard_svc_health v = {0};
    int rc = h->health(h->ctx, &v, st);
    if (rc) return rc;
    Fusion__HealthReply *r = malloc(sizeof *r);
    if (!r) return svc_no_memory(st);
    fusion__health_reply__init(r);
    r->status = (Fusion__HealthReply__ServingStatus)v.status;
    r->message = svc_str(v.message);
    *reply = &r->base;
    return RPC_OK;
}

/* Frees an Echo reply and its payload. */
static void echo_free(void *ctx, ProtobufCMessage *msg) {
    (void)ctx;
    Fusion__EchoReply *r = (Fusion__EchoReply *)msg;
    free(r->payload.data);
    free(r);
}

/* Echo: reply_bytes zeros back (a link measurement; no handler of the component's). */
static int echo_entry(void *ctx, const ProtobufCMessage *req_msg, ProtobufCMessage **reply, rpc_status *st) {
    (void)ctx;
    const Fusion__EchoRequest *req = (const Fusion__EchoRequest *)req_msg;
    if (req->reply_bytes < 0 || req->reply_bytes > SHARD_SVC_ECHO_MAX)
        return rpc_status_setf(st, RPC_INVALID_ARGUMENT, "reply_bytes: 0..%d required, got %lld", SHARD_SVC_ECHO_MAX,
                               (long long)req->reply_bytes);
    Fusion__EchoReply *r = malloc(sizeof *r);
    if (!r) return svc_no_memory(st);
    fusion__echo_reply__init(r);
    if (req->reply_bytes > 0) {
        if (!(r->payload.data = calloc(1, (size_t)req->reply_bytes))) {
            free(r);
            return svc_no_memory(st);
        }
        r->payload.len = (size_t)req->reply_bytes;
    }
    *reply = &r->base;
    return RPC_OK;
}

int shard_svc_serve(rpc_server *srv, const shard_svc_handlers *h) {
    int rc = FU_OK;
    if (h->session)
        rc = rpc_server_add_stream(srv, RPC_SHARD_SESSION, &fusion__session_request__descriptor, session_entry,
                                   (void *)h);
    if (!rc && h->forward)
        rc = rpc_server_add_unary(srv, RPC_SHARD_FORWARD, &fusion__forward_request__descriptor, forward_entry,
                                  forward_free, (void *)h);
    if (!rc && h->info)
        rc = rpc_server_add_unary(srv, RPC_SHARD_INFO, &fusion__info_request__descriptor, info_entry, info_free,
                                  (void *)h);
    if (!rc && h->health)
        rc = rpc_server_add_unary(srv, RPC_SHARD_HEALTH, &fusion__health_request__descriptor, health_entry, free_msg,
                                  (void *)h);
    if (!rc)
        rc = rpc_server_add_unary(srv, RPC_SHARD_ECHO, &fusion__echo_request__descriptor, echo_entry, echo_free,
                                  NULL);
    if (!rc) rc = svc_adapter_serve(srv, h);
    return rc;
}

/* ---- client: sessions ----------------------------------------------------------------------- */

struct shard_svc_session {
    rpc_stream *s;
    int timeout_ms;            /* for each reply */
    shard_svc_watch_fn watch;  /* NULL: none */
    void *watch_arg;
    ProtobufCMessage *msg;     /* the last step reply; the views point into it */
    shard_svc_step_reply rep;
    shard_svc_output out;
    wire_tensor hidden, logits;
    svc_scratch sc;            /* packing requests, views of replies */
    int64_t cached_tokens;     /* the open reply's */
};

/* Sends one SessionRequest of the given kind. */
static int session_send(shard_svc_session *s, Fusion__SessionRequest__KindCase kind, void *body, rpc_status *st) {
    Fusion__SessionRequest req = FUSION__SESSION_REQUEST__INIT;
    req.kind_case = kind;
    if (kind == FUSION__SESSION_REQUEST__KIND_OPEN) req.open = body;
    else if (kind == FUSION__SESSION_REQUEST__KIND_STEP) req.step = body;
    else req.close = body;
    return rpc_stream_send(s->s, &req.base, st);
}

/* Slices of a wait for a reply between two polls of the session's cancel function. */
#define SVC_CANCEL_POLL_MS 50

/* Waits up to the session's timeout for its next reply message, asking its watch (if any)
 * between slices whether to go on. */
static int session_wait(shard_svc_session *s, ProtobufCMessage **msg, rpc_status *st) {
    const ProtobufCMessageDescriptor *d = &fusion__session_reply__descriptor;
    if (!s->watch) return rpc_stream_recv(s->s, d, msg, s->timeout_ms, st);
    int64_t t0 = fu_now_us(), end = s->timeout_ms < 0 ? INT64_MAX : t0 + (int64_t)s->timeout_ms * 1000;
    for (;;) {
        int64_t waited_ms = (fu_now_us() - t0) / 1000;
        int verdict = s->watch(s->watch_arg, waited_ms);
        if (verdict == SHARD_SVC_CANCEL) {
            rpc_stream_cancel(s->s);
            return rpc_status_setf(st, RPC_CANCELLED, "the reply is no longer wanted");
        }
        if (verdict == SHARD_SVC_GIVE_UP)
            return rpc_status_setf(st, RPC_DEADLINE_EXCEEDED, "no reply after %lld ms", (long long)waited_ms);
        int64_t left_ms = (end - fu_now_us()) / 1000;
        if (left_ms <= 0) return rpc_status_setf(st, RPC_DEADLINE_EXCEEDED, "no reply within %d ms", s->timeout_ms);
        int rc = rpc_stream_recv(s->s, d, msg, left_ms < SVC_CANCEL_POLL_MS ? (int)left_ms : SVC_CANCEL_POLL_MS, st);
        if (rc != RPC_DEADLINE_EXCEEDED) return rc;
    }
}

/* Receives one SessionReply of the expected kind into *msg (the caller frees it). */
static int session_recv(shard_svc_session *s, Fusion__SessionReply__KindCase kind, ProtobufCMessage **msg,
                        rpc_status *st) {
    int rc = session_wait(s, msg, st);
    if (rc) return rc;
    const Fusion__SessionReply *rep = (const Fusion__SessionReply *)*msg;
    bool ok = rep->kind_case == kind && (kind == FUSION__SESSION_REPLY__KIND_OPENED ? rep->opened != NULL
                                                                                    : rep->step != NULL);
    if (!ok)
        return rpc_status_setf(st, RPC_UNEXPECTED_REPLY, "expected %s reply",
                               kind == FUSION__SESSION_REPLY__KIND_OPENED ? "an open" : "a step");
    return RPC_OK;
}

int shard_svc_session_open(rpc_channel *ch, const shard_svc_open *open, int timeout_ms, shard_svc_session **out,
                           rpc_status *st) {
    *out = NULL;
    shard_svc_session *s = calloc(1, sizeof *s);
    if (!s) return svc_no_memory(st);
    s->timeout_ms = timeout_ms;
    Fusion__OpenSession m;
    ProtobufCMessage *msg = NULL;
    int rc = rpc_stream_open(ch, RPC_SHARD_SESSION, 0, &s->s, st);
    if (!rc && open_pack(open, &m, &s->sc)) rc = svc_no_memory(st);
    if (!rc) rc = session_send(s, FUSION__SESSION_REQUEST__KIND_OPEN, &m, st);
    if (!rc) rc = session_recv(s, FUSION__SESSION_REPLY__KIND_OPENED, &msg, st);
    if (!rc) s->cached_tokens = ((const Fusion__SessionReply *)msg)->opened->cached_tokens;
    rpc_msg_free(msg);
    if (rc) {
        shard_svc_session_close(s, NULL);
        return rc;
    }
    *out = s;
    return RPC_OK;
}

int64_t shard_svc_session_cached(const shard_svc_session *s) { return s->cached_tokens; }

void shard_svc_session_set_wait(shard_svc_session *s, int timeout_ms, shard_svc_watch_fn fn, void *arg) {
    s->timeout_ms = timeout_ms;
    s->watch = fn;
    s->watch_arg = arg;
}

void shard_svc_session_drop_reply(shard_svc_session *s) {
    rpc_msg_free(s->msg);
    s->msg = NULL;
}

/* The views of received timings m[0..n) in v[0..n) (INVALID_ARGUMENT: a block beyond int32). */
static int timing_view(Fusion__ServerTiming *const *m, size_t n, shard_svc_timing *v, rpc_status *st) {
    for (size_t i = 0; i < n; i++) {
        v[i] = (shard_svc_timing){.server = svc_str(m[i]->server), .queue_us = m[i]->queue_us,
                                  .compute_us = m[i]->compute_us, .total_us = m[i]->total_us,
                                  .prefix_hit_tokens = m[i]->prefix_hit_tokens};
        svc_i32 f[] = {{"first_block", m[i]->first_block, &v[i].first_block},
                       {"last_block", m[i]->last_block, &v[i].last_block}};
        int rc = svc_narrow(f, 2, "timing.", st);
        if (rc) return rc;
    }
    return RPC_OK;
}

int shard_svc_session_step(shard_svc_session *s, const shard_svc_step *step, const shard_svc_step_reply **reply,
                           rpc_status *st) {
    *reply = NULL;
    step_msg m;
    int rc = step_pack(step, &m, &s->sc) ? svc_no_memory(st) : RPC_OK;
    if (!rc) rc = session_send(s, FUSION__SESSION_REQUEST__KIND_STEP, &m.sr, st);
    shard_svc_session_drop_reply(s); /* only now: `step` may point into it */
    if (!rc) rc = session_recv(s, FUSION__SESSION_REPLY__KIND_STEP, &s->msg, st);
    if (rc) return rc;
    const Fusion__StepReply *r = ((const Fusion__SessionReply *)s->msg)->step;
    shard_svc_timing *t = scratch(&s->sc, SC_V_TIMING, r->n_timing, sizeof *t);
    if (!t) return svc_no_memory(st);
    if (r->output && (rc = output_view(r->output, &s->out, &s->hidden, &s->logits, &s->sc, st))) return rc;
    if ((rc = timing_view(r->timing, r->n_timing, t, st))) return rc;
    s->rep = (shard_svc_step_reply){r->request_id, r->position, r->output ? &s->out : NULL, t, r->n_timing};
    *reply = &s->rep;
    return RPC_OK;
}

void shard_svc_session_close(shard_svc_session *s, const char *reason) {
    if (!s) return;
    if (s->s) {
        rpc_status st;
        if (reason) {
            Fusion__CloseSession cl = FUSION__CLOSE_SESSION__INIT;
            cl.reason = (char *)reason;
            session_send(s, FUSION__SESSION_REQUEST__KIND_CLOSE, &cl, &st);
        }
        rpc_stream_close_send(s->s, &st);
        rpc_stream_free(s->s);
    }
    rpc_msg_free(s->msg);
    scratch_free(&s->sc);
    free(s);
}

/* ---- client: unary calls ------------------------------------------------------------------- */

/* An Info reply held for its view. */
typedef struct info_held {
    shard_svc_info info; /* first: shard_svc_info_free casts back */
    ProtobufCMessage *msg;
    int dtypes[];
} info_held;

/* The view of a received Info reply but its wire dtypes (INVALID_ARGUMENT: a count beyond int32). */
static int info_view(const Fusion__InfoReply *r, shard_svc_info *v, rpc_status *st) {
    *v = (shard_svc_info){.model_name = svc_str(r->model_name), .has_embeddings = r->has_embeddings,
                          .has_head = r->has_head, .dtype = svc_str(r->dtype), .device = svc_str(r->device),
                          .tokens_per_s = r->tokens_per_s, .free_kv_bytes = r->free_kv_bytes,
                          .total_kv_bytes = r->total_kv_bytes, .version = svc_str(r->version),
                          .n_wire_dtypes = r->n_wire_dtypes, .adapters = (const char *const *)r->adapters,
                          .n_adapters = r->n_adapters, .max_message_bytes = r->max_message_bytes,
                          .kv_bytes_per_position = r->kv_bytes_per_position,
                          .prefix_cached_blocks = r->prefix_cached_blocks,
                          .prefix_hit_tokens = r->prefix_hit_tokens,
                          .prefix_prompt_tokens = r->prefix_prompt_tokens,
                          .prompt_step_tokens = r->prompt_step_tokens, .prompt_step_s = r->prompt_step_s,
                          .decode_step_tokens = r->decode_step_tokens, .decode_step_s = r->decode_step_s,
                          .n_prompt_steps = r->n_prompt_step_s, .n_decode_steps = r->n_decode_step_s};
    if (r->n_prompt_step_tokens != r->n_prompt_step_s || r->n_decode_step_tokens != r->n_decode_step_s ||
        r->n_prompt_step_s > SHARD_SVC_MAX_STEPS || r->n_decode_step_s > SHARD_SVC_MAX_STEPS)
        return rpc_status_setf(st, RPC_INVALID_ARGUMENT,
                               "info: step tables need as many times as token counts, at most %d of each",
                               SHARD_SVC_MAX_STEPS);
    svc_i32 f[] = {{"n_layers", r->n_layers, &v->n_layers},
                   {"first_block", r->first_block, &v->first_block},
                   {"last_block", r->last_block, &v->last_block},
                   {"active_sessions", r->active_sessions, &v->active_sessions},
                   {"hidden_size", r->hidden_size, &v->hidden_size},
                   {"vocab_size", r->vocab_size, &v->vocab_size},
                   {"max_length", r->max_length, &v->max_length}};
    return svc_narrow(f, sizeof f / sizeof f[0], "info.", st);
}

/* The view of the received Info reply msg (taken: freed with the view, or here on failure). */
static int info_hold(ProtobufCMessage *msg, shard_svc_info **out, rpc_status *st) {
    const Fusion__InfoReply *r = (const Fusion__InfoReply *)msg;
    info_held *h = malloc(sizeof *h + r->n_wire_dtypes * sizeof h->dtypes[0]);
    if (!h) {
        rpc_msg_free(msg);
        return svc_no_memory(st);
    }
    for (size_t i = 0; i < r->n_wire_dtypes; i++) h->dtypes[i] = (int)r->wire_dtypes[i];
    h->msg = msg;
    int rc = info_view(r, &h->info, st);
    if (rc) {
        shard_svc_info_free(&h->info);
        return rc;
    }
    h->info.wire_dtypes = h->dtypes;
    *out = &h->info;
    return RPC_OK;
}

int shard_svc_info_get(rpc_channel *ch, int timeout_ms, shard_svc_info **out, rpc_status *st) {
    *out = NULL;
    Fusion__InfoRequest req = FUSION__INFO_REQUEST__INIT;
    ProtobufCMessage *msg = NULL;
    int rc = rpc_call_unary(ch, RPC_SHARD_INFO, &req.base, &fusion__info_reply__descriptor, &msg, timeout_ms, st);
    return rc ? rc : info_hold(msg, out, st);
}

int shard_svc_info_fuzz_one(const void *data, size_t len, shard_svc_info **out) {
    *out = NULL;
    ProtobufCMessage *msg = NULL;
    rpc_status st = {0};
    int rc = rpc_msg_unpack(&fusion__info_reply__descriptor, data, len, RPC_DEFAULT_MAX_MESSAGE, &msg, &st);
    return rc ? rc : info_hold(msg, out, &st);
}

void shard_svc_info_free(shard_svc_info *info) {
    if (!info) return;
    info_held *h = (info_held *)info;
    rpc_msg_free(h->msg);
    free(h);
}

struct shard_svc_forward_held {
    ProtobufCMessage *msg;
    shard_svc_output out;
    wire_tensor hidden, logits;
    svc_scratch sc;
};

void shard_svc_forward_free(shard_svc_forward_held *h) {
    if (!h) return;
    rpc_msg_free(h->msg);
    scratch_free(&h->sc);
    free(h);
}

int shard_svc_forward_one(rpc_channel *ch, const shard_svc_input *in, const shard_svc_output_spec *spec, int32_t first,
                          int32_t last, int wire_dtype, int timeout_ms, shard_svc_forward_held **held,
                          const shard_svc_output **out, rpc_status *st) {
    *held = NULL, *out = NULL;
    shard_svc_forward_held *h = calloc(1, sizeof *h);
    Fusion__ForwardRequest m = FUSION__FORWARD_REQUEST__INIT;
    Fusion__Input fin, *seqs[1] = {&fin};
    Fusion__Tensor ft;
    Fusion__OutputSpec os;
    Fusion__Sampling samp;
    int rc = !h || input_pack(in, &fin, &ft, &h->sc) || spec_pack(spec, &os, &samp, &h->sc) ? svc_no_memory(st) : RPC_OK;
    m.n_sequences = 1, m.sequences = seqs, m.output = &os;
    m.first_block = first, m.last_block = last, m.wire_dtype = (Fusion__Dtype)wire_dtype;
    if (!rc) rc = rpc_call_unary(ch, RPC_SHARD_FORWARD, &m.base, &fusion__forward_reply__descriptor, &h->msg, timeout_ms, st);
    const Fusion__ForwardReply *r = rc ? NULL : (const Fusion__ForwardReply *)h->msg;
    if (r && r->n_outputs != 1) rc = rpc_status_setf(st, RPC_UNEXPECTED_REPLY, "Forward: %zu outputs for one sequence", r->n_outputs);
    if (r && !rc) rc = output_view(r->outputs[0], &h->out, &h->hidden, &h->logits, &h->sc, st);
    if (rc) {
        shard_svc_forward_free(h);
        return rc;
    }
    *held = h, *out = &h->out;
    return RPC_OK;
}

int shard_svc_echo(rpc_channel *ch, int reply_bytes, int timeout_ms, rpc_status *st) {
    Fusion__EchoRequest req = FUSION__ECHO_REQUEST__INIT;
    req.reply_bytes = reply_bytes;
    ProtobufCMessage *rep = NULL;
    int rc = rpc_call_unary(ch, RPC_SHARD_ECHO, &req.base, &fusion__echo_reply__descriptor, &rep, timeout_ms, st);
    rpc_msg_free(rep);
    return rc;
}

/* Seconds one Echo of reply_bytes takes, or -1 (*code says why). */
static double echo_seconds(rpc_channel *ch, int reply_bytes, int timeout_ms, int *code, rpc_status *st) {
    double t0 = fu_now_s();
    *code = shard_svc_echo(ch, reply_bytes, timeout_ms, st);
    return *code ? -1 : fu_now_s() - t0;
}

int shard_svc_measure_link(rpc_channel *ch, int big_bytes, int timeout_ms, double *rtt_s, double *bandwidth,
                           rpc_status *st) {
    *rtt_s = *bandwidth = 0;
    int code = RPC_OK;
    double a = echo_seconds(ch, 0, timeout_ms, &code, st);
    double b = a >= 0 ? echo_seconds(ch, 0, timeout_ms, &code, st) : -1;
    double big = b >= 0 ? echo_seconds(ch, big_bytes, timeout_ms, &code, st) : -1;
    if (big < 0) return code;
    double rtt = a < b ? a : b, t = big - rtt;
    *rtt_s = rtt;
    *bandwidth = big_bytes / (t > 1e-6 ? t : 1e-6);
    return RPC_OK;
}
