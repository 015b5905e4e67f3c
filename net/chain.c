/* chain.c -- a session across a chain of shard servers, directly or with server-to-server forwarding. */
#include "chain.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "clock.h"
#include "fusion.pb-c.h"
#include "grow.h"
#include "rpc.h"
#include "status.h"
#include "wire.h"

#define CHAIN_MAX_HOPS 64

typedef struct chain_conn {
    char *address;
    rpc_channel *ch;
} chain_conn;

struct chain_client {
    chain_options o;
    char *secret, *tls_ca;
    pthread_mutex_t mu;
    chain_conn *conns;
    int n_conns, cap_conns;
};

typedef struct chain_link {
    chain_hop hop;
    char *address, *tls_name;
    rpc_stream *s;
} chain_link;

struct chain_session {
    chain_client *c;
    char *id;
    chain_link *links;
    int n_links;       /* streams opened: 1 with forwarding, else the hops */
    int n_hops;
    int64_t len;
    uint64_t next_request;
    /* result storage */
    chain_result res;
    float *logits;
    size_t cap_logits;
    int32_t *tokens, *top_ids;
    float *logprobs, *top_lp;
    size_t cap_tokens, cap_lp, cap_top_ids, cap_top_lp;
    chain_timing timing[CHAIN_MAX_HOPS];
};

/* Maps an RPC outcome to a project status with a message naming the hop. */
static int chain_fail(const char *address, int code, const rpc_status *st) {
    int fu = code == RPC_END_OF_STREAM ? FU_ERR_NETWORK : rpc_code_to_fu(code);
    return fu_errorf(fu, "shard %s: %s%s%s", address, rpc_code_str(code), st->message[0] ? ": " : "",
                     st->message);
}

int chain_client_new(const chain_options *o, chain_client **out) {
    *out = NULL;
    if (!o->secret || !o->secret[0]) return fu_errorf(FU_ERR_INVALID, "chain: a swarm secret is required");
    if (o->wire_dtype && !wire_dtype_valid(o->wire_dtype))
        return fu_errorf(FU_ERR_INVALID, "chain: unknown wire dtype %d", o->wire_dtype);
    chain_client *c = calloc(1, sizeof *c);
    if (!c) return fu_errorf(FU_ERR_NOMEM, "chain client");
    c->o = *o;
    c->secret = strdup(o->secret);
    c->tls_ca = o->tls_ca ? strdup(o->tls_ca) : NULL;
    if (!c->secret || (o->tls_ca && !c->tls_ca)) {
        chain_client_free(c);
        return fu_errorf(FU_ERR_NOMEM, "chain client");
    }
    c->o.secret = c->secret;
    c->o.tls_ca = c->tls_ca;
    if (!c->o.wire_dtype) c->o.wire_dtype = WIRE_BF16;
    if (c->o.timeout_ms <= 0) c->o.timeout_ms = 60000;
    pthread_mutex_init(&c->mu, NULL);
    *out = c;
    return FU_OK;
}

void chain_client_free(chain_client *c) {
    if (!c) return;
    for (int i = 0; i < c->n_conns; i++) {
        rpc_channel_free(c->conns[i].ch);
        free(c->conns[i].address);
    }
    free(c->conns);
    free(c->secret);
    free(c->tls_ca);
    pthread_mutex_destroy(&c->mu);
    free(c);
}

/* The shared channel to a hop (created on first use). */
static int chain_channel(chain_client *c, const chain_hop *hop, rpc_channel **out) {
    pthread_mutex_lock(&c->mu);
    for (int i = 0; i < c->n_conns; i++)
        if (!strcmp(c->conns[i].address, hop->address)) {
            *out = c->conns[i].ch;
            pthread_mutex_unlock(&c->mu);
            return FU_OK;
        }
    int rc = FU_OK;
    if (c->n_conns == c->cap_conns) {
        int cap = c->cap_conns ? c->cap_conns * 2 : 8;
        chain_conn *n = realloc(c->conns, (size_t)cap * sizeof *n);
        if (!n) rc = fu_errorf(FU_ERR_NOMEM, "chain channels");
        else {
            c->conns = n;
            c->cap_conns = cap;
        }
    }
    if (!rc) {
        rpc_channel_options co = {c->o.tls_ca, c->o.insecure, c->o.secret, c->o.max_message_bytes,
                                  hop->tls_server_name};
        chain_conn *cn = &c->conns[c->n_conns];
        cn->address = strdup(hop->address);
        if (!cn->address) rc = fu_errorf(FU_ERR_NOMEM, "chain channels");
        else if ((rc = rpc_channel_new(hop->address, &co, &cn->ch))) free(cn->address);
        else {
            c->n_conns++;
            *out = cn->ch;
        }
    }
    pthread_mutex_unlock(&c->mu);
    return rc;
}

void chain_session_close(chain_session *s) {
    if (!s) return;
    for (int i = 0; i < s->n_links; i++) {
        if (s->links[i].s) {
            rpc_status st;
            Fusion__CloseSession cl = FUSION__CLOSE_SESSION__INIT;
            cl.reason = (char *)"client closed";
            Fusion__SessionRequest req = FUSION__SESSION_REQUEST__INIT;
            req.kind_case = FUSION__SESSION_REQUEST__KIND_CLOSE;
            req.close = &cl;
            rpc_stream_send(s->links[i].s, &req.base, &st);
            rpc_stream_close_send(s->links[i].s, &st);
            rpc_stream_free(s->links[i].s);
        }
        free(s->links[i].address);
        free(s->links[i].tls_name);
    }
    free(s->links);
    free(s->id);
    free(s->logits);
    free(s->tokens);
    free(s->top_ids);
    free(s->logprobs);
    free(s->top_lp);
    free(s);
}

int chain_session_open(chain_client *c, const chain_hop *hops, int n_hops, const char *session_id,
                       int max_length, chain_session **out) {
    *out = NULL;
    if (n_hops <= 0 || n_hops > CHAIN_MAX_HOPS)
        return fu_errorf(FU_ERR_INVALID, "chain: 1..%d hops required", CHAIN_MAX_HOPS);
    if (hops[0].first_block != 0) return fu_errorf(FU_ERR_INVALID, "chain: the first hop must start at block 0");
    for (int i = 0; i < n_hops; i++) {
        if (!hops[i].address || hops[i].last_block <= hops[i].first_block)
            return fu_errorf(FU_ERR_INVALID, "chain: hop %d has no address or an empty span", i);
        if (i && hops[i].first_block != hops[i - 1].last_block)
            return fu_errorf(FU_ERR_INVALID, "chain: hop %d starts at block %d, the previous ends at %d", i,
                             hops[i].first_block, hops[i - 1].last_block);
    }
    chain_session *s = calloc(1, sizeof *s);
    if (!s) return fu_errorf(FU_ERR_NOMEM, "chain session");
    s->c = c;
    s->n_hops = n_hops;
    s->n_links = c->o.forward ? 1 : n_hops;
    s->id = strdup(session_id);
    s->links = calloc((size_t)n_hops, sizeof *s->links);
    if (!s->id || !s->links) {
        chain_session_close(s);
        return fu_errorf(FU_ERR_NOMEM, "chain session");
    }
    int rc = FU_OK;
    for (int i = 0; i < n_hops; i++) {
        chain_link *l = &s->links[i];
        l->address = strdup(hops[i].address);
        l->tls_name = hops[i].tls_server_name ? strdup(hops[i].tls_server_name) : NULL;
        if (!l->address || (hops[i].tls_server_name && !l->tls_name)) {
            chain_session_close(s);
            return fu_errorf(FU_ERR_NOMEM, "chain session");
        }
        l->hop = hops[i];
        l->hop.address = l->address;
        l->hop.tls_server_name = l->tls_name;
    }
    /* forwarding: hop 0 gets the rest of the chain */
    Fusion__Hop rest[CHAIN_MAX_HOPS], *rest_ptrs[CHAIN_MAX_HOPS];
    for (int i = 1; i < n_hops; i++) {
        fusion__hop__init(&rest[i]);
        rest[i].address = s->links[i].address;
        rest[i].first_block = hops[i].first_block;
        rest[i].last_block = hops[i].last_block;
        rest[i].tls_server_name = s->links[i].tls_name ? s->links[i].tls_name : (char *)"";
        rest_ptrs[i - 1] = &rest[i];
    }
    for (int i = 0; i < s->n_links && !rc; i++) {
        chain_link *l = &s->links[i];
        rpc_channel *ch = NULL;
        rpc_status st = {0};
        if ((rc = chain_channel(c, &l->hop, &ch))) break;
        int code = rpc_stream_open(ch, RPC_SHARD_SESSION, 0, &l->s, &st);
        Fusion__OpenSession open = FUSION__OPEN_SESSION__INIT;
        open.session_id = s->id;
        open.max_length = max_length;
        open.wire_dtype = (Fusion__Dtype)c->o.wire_dtype;
        open.int8_block_size = c->o.int8_block;
        open.first_block = l->hop.first_block;
        open.last_block = l->hop.last_block;
        if (c->o.forward) {
            open.n_chain = (size_t)(n_hops - 1);
            open.chain = rest_ptrs;
        }
        Fusion__SessionRequest req = FUSION__SESSION_REQUEST__INIT;
        req.kind_case = FUSION__SESSION_REQUEST__KIND_OPEN;
        req.open = &open;
        ProtobufCMessage *msg = NULL;
        if (!code) code = rpc_stream_send(l->s, &req.base, &st);
        if (!code) code = rpc_stream_recv(l->s, &fusion__session_reply__descriptor, &msg, c->o.timeout_ms, &st);
        if (code) {
            rc = chain_fail(l->address, code, &st);
            break;
        }
        Fusion__SessionReply *rep = (Fusion__SessionReply *)msg;
        if (rep->kind_case != FUSION__SESSION_REPLY__KIND_OPENED)
            rc = fu_errorf(FU_ERR_FORMAT, "shard %s: expected an open reply", l->address);
        rpc_msg_free(msg);
    }
    if (rc) {
        chain_session_close(s);
        return rc;
    }
    *out = s;
    return FU_OK;
}

int64_t chain_session_len(const chain_session *s) { return s->len; }

/* Sends one step on link i and receives its reply (*reply: free with rpc_msg_free). */
static int chain_link_step(chain_session *s, int i, const Fusion__StepRequest *sr,
                           Fusion__StepReply **reply, ProtobufCMessage **msg) {
    chain_link *l = &s->links[i];
    rpc_status st = {0};
    Fusion__SessionRequest req = FUSION__SESSION_REQUEST__INIT;
    req.kind_case = FUSION__SESSION_REQUEST__KIND_STEP;
    req.step = (Fusion__StepRequest *)sr;
    int code = rpc_stream_send(l->s, &req.base, &st);
    if (!code) code = rpc_stream_recv(l->s, &fusion__session_reply__descriptor, msg, s->c->o.timeout_ms, &st);
    if (code) return chain_fail(l->address, code, &st);
    Fusion__SessionReply *rep = (Fusion__SessionReply *)*msg;
    if (rep->kind_case != FUSION__SESSION_REPLY__KIND_STEP || !rep->step || !rep->step->output)
        return fu_errorf(FU_ERR_FORMAT, "shard %s: expected a step reply", l->address);
    *reply = rep->step;
    return FU_OK;
}


/* Copies the last hop's output into the session's result. */
static int chain_take_output(chain_session *s, const Fusion__StepReply *rep, const chain_spec *spec, int n) {
    const Fusion__Output *o = rep->output;
    chain_result *r = &s->res;
    memset(r, 0, sizeof *r);
    r->position = rep->position;
    int expect = spec->all_positions ? n : 1;
    if (spec->want_logits) {
        const Fusion__Tensor *t = o->logits;
        if (!t || t->dtype != FUSION__DTYPE__DTYPE_F32 || t->n_shape != 2 || t->shape[0] != expect ||
            t->shape[1] <= 0 || t->shape[1] > (1 << 24))
            return fu_errorf(FU_ERR_FORMAT, "chain: the last hop returned no logits of the expected shape");
        size_t cnt = (size_t)t->shape[0] * (size_t)t->shape[1];
        if (fu_grow((void **)&s->logits, &s->cap_logits, cnt, sizeof(float)))
            return fu_errorf(FU_ERR_NOMEM, "logits");
        int rc = wire_decode(t->data.data, t->data.len, NULL, 0, WIRE_F32, 0, cnt, s->logits, "logits");
        if (rc) return rc;
        r->logits = s->logits;
        r->vocab = (int)t->shape[1];
    }
    if (spec->sample) {
        if (o->n_tokens != (size_t)expect || o->n_logprobs != (size_t)expect)
            return fu_errorf(FU_ERR_FORMAT, "chain: the last hop returned %zu tokens for %d outputs",
                             o->n_tokens, expect);
        int k = spec->top_logprobs;
        size_t n_top = (size_t)expect * (size_t)k + 1;
        if (fu_grow((void **)&s->tokens, &s->cap_tokens, (size_t)expect, sizeof(int32_t)) ||
            fu_grow((void **)&s->logprobs, &s->cap_lp, (size_t)expect, sizeof(float)) ||
            fu_grow((void **)&s->top_ids, &s->cap_top_ids, n_top, sizeof(int32_t)) ||
            fu_grow((void **)&s->top_lp, &s->cap_top_lp, n_top, sizeof(float)))
            return fu_errorf(FU_ERR_NOMEM, "tokens");
        memcpy(s->tokens, o->tokens, (size_t)expect * sizeof(int32_t));
        memcpy(s->logprobs, o->logprobs, (size_t)expect * sizeof(float));
        if (k) {
            if (o->n_top_logprobs != (size_t)expect)
                return fu_errorf(FU_ERR_FORMAT, "chain: top logprobs missing");
            for (int i = 0; i < expect; i++) {
                const Fusion__TopLogprobs *tl = o->top_logprobs[i];
                if (!tl || tl->n_entries != (size_t)k) return fu_errorf(FU_ERR_FORMAT, "chain: top logprobs");
                for (int j = 0; j < k; j++) {
                    s->top_ids[i * k + j] = tl->entries[j]->token;
                    s->top_lp[i * k + j] = tl->entries[j]->logprob;
                }
            }
            r->top_ids = s->top_ids;
            r->top_logprobs = s->top_lp;
            r->top_k = k;
        }
        r->tokens = s->tokens;
        r->logprobs = s->logprobs;
    }
    r->n_out = spec->want_logits || spec->sample ? expect : 0;
    return FU_OK;
}

static void chain_add_timing(chain_session *s, const Fusion__StepReply *rep) {
    for (size_t i = 0; i < rep->n_timing && s->res.n_timing < CHAIN_MAX_HOPS; i++) {
        const Fusion__ServerTiming *t = rep->timing[i];
        chain_timing *d = &s->timing[s->res.n_timing++];
        snprintf(d->server, sizeof d->server, "%s", t->server ? t->server : "");
        d->first_block = t->first_block;
        d->last_block = t->last_block;
        d->queue_us = t->queue_us;
        d->compute_us = t->compute_us;
        d->total_us = t->total_us;
    }
    s->res.timing = s->timing;
}

int chain_session_step(chain_session *s, const int32_t *tokens, int n, int64_t rollback_to,
                       const chain_spec *spec, const chain_result **out) {
    *out = NULL;
    if (n <= 0) return fu_errorf(FU_ERR_INVALID, "chain step: no tokens");
    if (rollback_to > s->len) return fu_errorf(FU_ERR_RANGE, "chain step: rollback beyond the session");
    int64_t t0 = fu_now_us();
    int64_t start = rollback_to >= 0 ? rollback_to : s->len;

    Fusion__Sampling samp = FUSION__SAMPLING__INIT;
    Fusion__LogitBias *bias_ptrs[SMP_MAX_LOGIT_BIAS], bias[SMP_MAX_LOGIT_BIAS];
    Fusion__OutputSpec os = FUSION__OUTPUT_SPEC__INIT;
    os.want_logits = spec->want_logits;
    os.all_positions = spec->all_positions;
    os.top_logprobs = spec->top_logprobs;
    if (spec->sample) {
        const smp_params *p = &spec->sampling;
        if (p->n_bias > SMP_MAX_LOGIT_BIAS)
            return fu_errorf(FU_ERR_INVALID, "logit_bias: at most %d entries", SMP_MAX_LOGIT_BIAS);
        samp.temperature = p->temperature;
        samp.top_p = p->top_p;
        samp.top_k = p->top_k;
        samp.min_p = p->min_p;
        samp.seed = p->seed;
        samp.presence_penalty = p->presence_penalty;
        samp.frequency_penalty = p->frequency_penalty;
        samp.repetition_penalty = p->repetition_penalty;
        samp.penalty_start = spec->penalty_start;
        for (int i = 0; i < p->n_bias; i++) {
            fusion__logit_bias__init(&bias[i]);
            bias[i].token = p->bias[i].token;
            bias[i].bias = p->bias[i].bias;
            bias_ptrs[i] = &bias[i];
        }
        samp.n_logit_bias = (size_t)p->n_bias;
        samp.logit_bias = bias_ptrs;
        os.sampling = &samp;
    }
    Fusion__Input in = FUSION__INPUT__INIT;
    in.n_tokens = (size_t)n;
    in.tokens = (int32_t *)tokens;
    Fusion__StepRequest sr = FUSION__STEP_REQUEST__INIT;
    sr.request_id = ++s->next_request;
    sr.start_position = start;
    sr.input = &in;
    sr.output = &os;
    if (rollback_to >= 0) {
        sr.rollback_case = FUSION__STEP_REQUEST__ROLLBACK_ROLLBACK_TO;
        sr.rollback_to = rollback_to;
    }
    s->res.n_timing = 0;
    ProtobufCMessage *prev = NULL;
    Fusion__StepReply *rep = NULL;
    int rc = FU_OK;
    for (int i = 0; i < s->n_links; i++) {
        ProtobufCMessage *msg = NULL;
        rc = chain_link_step(s, i, &sr, &rep, &msg);
        rpc_msg_free(prev); /* the previous hop's hidden states have been sent */
        prev = msg;
        if (rc) break;
        chain_add_timing(s, rep);
        if (i + 1 < s->n_links) {
            if (!rep->output->hidden) {
                rc = fu_errorf(FU_ERR_FORMAT, "shard %s: returned no hidden states", s->links[i].address);
                break;
            }
            in.hidden = rep->output->hidden; /* relayed as received */
        }
    }
    if (!rc) {
        int n_timing = s->res.n_timing;
        rc = chain_take_output(s, rep, spec, n);
        s->res.n_timing = n_timing;
        s->res.timing = s->timing;
    }
    rpc_msg_free(prev);
    if (rc) return rc;
    s->len = start + n;
    s->res.total_us = fu_now_us() - t0;
    *out = &s->res;
    return FU_OK;
}
