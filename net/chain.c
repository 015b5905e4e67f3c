/* chain.c -- a session across a chain of shard servers, directly or with server-to-server forwarding. */
#include "chain.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "clock.h"
#include "grow.h"
#include "lora.h"
#include "rpc-base.h"
#include "shard-svc.h"
#include "status.h"
#include "wire.h"

#define CHAIN_MAX_HOPS 64

typedef struct chain_conn {
    char *address;
    rpc_channel *ch;
} chain_conn;

struct chain_client {
    chain_options o;
    char *secret, *tls_ca, *tls_client_cert, *tls_client_key; /* copies of o's */
    pthread_mutex_t mu;
    chain_conn *conns;
    int n_conns, cap_conns;
};

typedef struct chain_link {
    chain_hop hop;
    char *address, *tls_name;
    shard_svc_session *sess;
} chain_link;

struct chain_session {
    chain_client *c;
    char *id;
    chain_link *links;
    int n_links;       /* streams opened: 1 with forwarding, else the hops */
    int n_hops;
    int64_t len;
    int32_t *prefix;              /* (n_prefix) the open's prefix, until the first step */
    int n_prefix;
    int64_t cached;               /* positions of it every hop pinned */
    uint64_t next_request;
    chain_watch_fn watch;         /* chain_session_set_watch */
    void *watch_arg;
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

/* *out = a copy of s (NULL stays NULL); false when out of memory. */
static bool dup_opt(const char *s, char **out) {
    *out = s ? strdup(s) : NULL;
    return !s || *out;
}

int chain_client_new(const chain_options *o, chain_client **out) {
    *out = NULL;
    if (!o->secret || !o->secret[0]) return fu_errorf(FU_ERR_INVALID, "chain: a swarm secret is required");
    if (o->wire_dtype && !wire_dtype_valid(o->wire_dtype))
        return fu_errorf(FU_ERR_INVALID, "chain: unknown wire dtype %d", o->wire_dtype);
    if (!o->tls_client_cert != !o->tls_client_key)
        return fu_errorf(FU_ERR_INVALID, "chain: a client certificate needs its key, and a key its certificate");
    chain_client *c = calloc(1, sizeof *c);
    if (!c) return fu_errorf(FU_ERR_NOMEM, "chain client");
    c->o = *o;
    bool ok = dup_opt(o->secret, &c->secret) && dup_opt(o->tls_ca, &c->tls_ca) &&
              dup_opt(o->tls_client_cert, &c->tls_client_cert) && dup_opt(o->tls_client_key, &c->tls_client_key);
    if (!ok) {
        chain_client_free(c);
        return fu_errorf(FU_ERR_NOMEM, "chain client");
    }
    c->o.secret = c->secret;
    c->o.tls_ca = c->tls_ca;
    c->o.tls_client_cert = c->tls_client_cert;
    c->o.tls_client_key = c->tls_client_key;
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
    free(c->tls_client_cert);
    free(c->tls_client_key);
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
        rpc_channel_options co = {.tls_ca = c->o.tls_ca, .insecure = c->o.insecure, .secret = c->o.secret,
                                  .max_message_bytes = c->o.max_message_bytes,
                                  .tls_server_name = hop->tls_server_name,
                                  .tls_client_cert = c->o.tls_client_cert, .tls_client_key = c->o.tls_client_key};
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
    for (int i = 0; s->links && i < s->n_hops; i++) { /* with forwarding only link 0 has a stream */
        shard_svc_session_close(s->links[i].sess, "client closed");
        free(s->links[i].address);
        free(s->links[i].tls_name);
    }
    free(s->links);
    free(s->prefix);
    free(s->id);
    free(s->logits);
    free(s->tokens);
    free(s->top_ids);
    free(s->logprobs);
    free(s->top_lp);
    free(s);
}

int chain_session_open(chain_client *c, const chain_hop *hops, int n_hops, const char *session_id,
                       int max_length, const char *adapter_id, chain_session **out) {
    return chain_session_open_prefix(c, hops, n_hops, session_id, max_length, adapter_id, NULL, 0, out);
}

int64_t chain_session_cached(const chain_session *s) { return s->cached; }

/* Checks that hops[0..n) tile the model from block 0 (FU_ERR_INVALID naming the hop). */
static int chain_hops_check(const chain_hop *hops, int n_hops) {
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
    return FU_OK;
}

/* A session not yet open on any hop: its id, a copy of the prefix and of each hop (NULL when out
 * of memory; free it with chain_session_close). */
static chain_session *chain_session_alloc(chain_client *c, const chain_hop *hops, int n_hops, const char *session_id,
                                          const int32_t *prefix, int n_prefix) {
    chain_session *s = calloc(1, sizeof *s);
    if (!s) return NULL;
    s->c = c;
    s->n_hops = n_hops;
    s->n_links = c->o.forward ? 1 : n_hops;
    s->id = strdup(session_id);
    s->links = calloc((size_t)n_hops, sizeof *s->links);
    s->n_prefix = n_prefix > 0 ? n_prefix : 0;
    s->prefix = s->n_prefix ? malloc((size_t)s->n_prefix * sizeof *s->prefix) : NULL;
    bool ok = s->id && s->links && (!s->n_prefix || s->prefix);
    if (s->prefix) memcpy(s->prefix, prefix, (size_t)s->n_prefix * sizeof *s->prefix);
    for (int i = 0; ok && i < n_hops; i++) {
        chain_link *l = &s->links[i];
        l->address = strdup(hops[i].address);
        l->tls_name = hops[i].tls_server_name ? strdup(hops[i].tls_server_name) : NULL;
        ok = l->address && (!hops[i].tls_server_name || l->tls_name);
        l->hop = hops[i];
        l->hop.address = l->address;
        l->hop.tls_server_name = l->tls_name;
    }
    if (ok) return s;
    chain_session_close(s);
    return NULL;
}

/* Opens the session's streams: one per hop, or with forwarding one on hop 0 that gets the rest
 * of the chain; s->cached is the least prefix the hops pinned. */
static int chain_open_links(chain_session *s, int max_length, const char *adapter_id) {
    chain_client *c = s->c;
    shard_svc_hop rest[CHAIN_MAX_HOPS];
    for (int i = 1; i < s->n_hops; i++)
        rest[i - 1] = (shard_svc_hop){s->links[i].address, s->links[i].hop.first_block, s->links[i].hop.last_block,
                                      s->links[i].tls_name};
    int rc = FU_OK;
    for (int i = 0; i < s->n_links && !rc; i++) {
        chain_link *l = &s->links[i];
        rpc_channel *ch = NULL;
        rpc_status st = {0};
        if ((rc = chain_channel(c, &l->hop, &ch))) break;
        shard_svc_open open = {.session_id = s->id,
                               .max_length = max_length,
                               .wire_dtype = c->o.wire_dtype,
                               .int8_block_size = c->o.int8_block,
                               .adapter_id = adapter_id,
                               .first_block = l->hop.first_block,
                               .last_block = l->hop.last_block,
                               .chain = rest,
                               .n_chain = c->o.forward ? (size_t)(s->n_hops - 1) : 0,
                               .prefix_tokens = s->prefix,
                               .n_prefix_tokens = (size_t)s->n_prefix};
        int code = shard_svc_session_open(ch, &open, c->o.timeout_ms, &l->sess, &st);
        if (code == RPC_UNEXPECTED_REPLY) rc = fu_errorf(FU_ERR_FORMAT, "shard %s: expected an open reply", l->address);
        else if (code) rc = chain_fail(l->address, code, &st);
        else if (i == 0 || shard_svc_session_cached(l->sess) < s->cached) s->cached = shard_svc_session_cached(l->sess);
    }
    return rc;
}

int chain_session_open_prefix(chain_client *c, const chain_hop *hops, int n_hops, const char *session_id,
                              int max_length, const char *adapter_id, const int32_t *prefix, int n_prefix,
                              chain_session **out) {
    *out = NULL;
    int rc = chain_hops_check(hops, n_hops);
    if (rc) return rc;
    chain_session *s = chain_session_alloc(c, hops, n_hops, session_id, prefix, n_prefix);
    if (!s) return fu_errorf(FU_ERR_NOMEM, "chain session");
    if ((rc = chain_open_links(s, max_length, adapter_id))) {
        chain_session_close(s);
        return rc;
    }
    *out = s;
    return FU_OK;
}

int64_t chain_session_len(const chain_session *s) { return s->len; }

/* ---- adapters ------------------------------------------------------------------------------- */

/* Checks that whole-model adapter `whole` can be sliced to hop's span: PEFT's row order, the
 * span inside the adapter's blocks. FU_ERR_INVALID naming the hop. */
static int chain_adapter_check(const chain_hop *hop, const lora_adapter *whole) {
    if (!hop->address) return fu_errorf(FU_ERR_INVALID, "chain: the hop has no address");
    if (whole->qk_interleaved)
        return fu_errorf(FU_ERR_INVALID, "shard %s: the adapter must hold q/k rows in PEFT's order", hop->address);
    if (hop->first_block < whole->first || hop->last_block > whole->last || hop->last_block <= hop->first_block)
        return fu_errorf(FU_ERR_INVALID, "shard %s: blocks [%d, %d) are not inside the adapter's [%d, %d)",
                         hop->address, hop->first_block, hop->last_block, whole->first, whole->last);
    return FU_OK;
}

int chain_adapter_load(chain_client *c, const chain_hop *hop, const char *adapter_id, const lora_adapter *whole) {
    int rc = chain_adapter_check(hop, whole);
    rpc_channel *ch = NULL;
    if (rc || (rc = chain_channel(c, hop, &ch))) return rc;
    /* an adapter's floats run block after block, each block's laid out alike: the span's are one slice */
    const size_t per_block = whole->n_floats / (size_t)(whole->last - whole->first);
    const size_t n = per_block * (size_t)(hop->last_block - hop->first_block);
    const float *x = whole->data + per_block * (size_t)(hop->first_block - whole->first);
    uint8_t *bytes = malloc(wire_data_bytes(WIRE_F32, n) + 1);
    if (!bytes) return fu_errorf(FU_ERR_NOMEM, "shard %s: adapter of %zu floats", hop->address, n);
    wire_encode(x, n, WIRE_F32, 0, bytes, NULL);
    const char *names[LORA_N_TARGETS];
    shard_svc_lora spec = shard_svc_lora_of(&whole->cfg, names);
    int64_t shape[1] = {(int64_t)n};
    wire_tensor params = {.dtype = WIRE_F32, .n_shape = 1, .shape = shape, .data = bytes,
                          .data_len = wire_data_bytes(WIRE_F32, n)};
    shard_svc_state state = {hop->first_block, hop->last_block, &spec, &params, NULL, NULL};
    rpc_status st = {0};
    int64_t held = 0;
    int code = shard_svc_adapter_load(ch, adapter_id, &state, c->o.timeout_ms, &held, &st);
    free(bytes);
    return code ? chain_fail(hop->address, code, &st) : FU_OK;
}

int chain_adapter_unload(chain_client *c, const chain_hop *hop, const char *adapter_id) {
    rpc_channel *ch = NULL;
    if (!hop->address) return fu_errorf(FU_ERR_INVALID, "chain: the hop has no address");
    int rc = chain_channel(c, hop, &ch);
    if (rc) return rc;
    rpc_status st = {0};
    int code = shard_svc_adapter_unload(ch, adapter_id, c->o.timeout_ms, &st);
    return code ? chain_fail(hop->address, code, &st) : FU_OK;
}

_Static_assert((int)CHAIN_WAIT == (int)SHARD_SVC_WAIT && (int)CHAIN_CANCEL == (int)SHARD_SVC_CANCEL &&
                   (int)CHAIN_GIVE_UP == (int)SHARD_SVC_GIVE_UP,
               "a chain watch is passed to the Shard service as is");

void chain_session_set_watch(chain_session *s, chain_watch_fn fn, void *arg) {
    s->watch = fn;
    s->watch_arg = arg;
}

int chain_session_probe(chain_session *s, int timeout_ms) {
    for (int i = 0; i < s->n_hops; i++) {
        rpc_channel *ch = NULL;
        rpc_status st = {0};
        if (chain_channel(s->c, &s->links[i].hop, &ch) || shard_svc_echo(ch, 0, timeout_ms, &st)) return i;
    }
    return -1;
}

/* Sends one step on link i and receives its reply (*reply: valid until the link's next step or
 * shard_svc_session_drop_reply). */
static int chain_link_step(chain_session *s, int i, const shard_svc_step *step, const shard_svc_step_reply **reply) {
    chain_link *l = &s->links[i];
    rpc_status st = {0};
    int code = shard_svc_session_step(l->sess, step, reply, &st);
    if (code == RPC_UNEXPECTED_REPLY || (!code && !(*reply)->output))
        return fu_errorf(FU_ERR_FORMAT, "shard %s: expected a step reply", l->address);
    if (code) return chain_fail(l->address, code, &st);
    return FU_OK;
}

/* Copies the last hop's output into the session's result. */
static int chain_take_output(chain_session *s, const shard_svc_step_reply *rep, const chain_spec *spec, int n) {
    const shard_svc_output *o = rep->output;
    chain_result *r = &s->res;
    memset(r, 0, sizeof *r);
    r->position = rep->position;
    int expect = spec->all_positions ? n : 1;
    if (spec->want_logits) {
        const wire_tensor *t = o->logits;
        if (!t || t->dtype != WIRE_F32 || t->n_shape != 2 || t->shape[0] != expect || t->shape[1] <= 0 ||
            t->shape[1] > (1 << 24))
            return fu_errorf(FU_ERR_FORMAT, "chain: the last hop returned no logits of the expected shape");
        size_t cnt = (size_t)t->shape[0] * (size_t)t->shape[1];
        if (fu_grow((void **)&s->logits, &s->cap_logits, cnt, sizeof(float)))
            return fu_errorf(FU_ERR_NOMEM, "logits");
        int rc = wire_decode(t->data, t->data_len, NULL, 0, WIRE_F32, 0, cnt, s->logits, "logits");
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
            if (o->n_top != (size_t)expect)
                return fu_errorf(FU_ERR_FORMAT, "chain: top logprobs missing");
            for (int i = 0; i < expect; i++) {
                const shard_svc_top *tl = &o->top[i];
                if (tl->n != (size_t)k) return fu_errorf(FU_ERR_FORMAT, "chain: top logprobs");
                memcpy(&s->top_ids[i * k], tl->tokens, (size_t)k * sizeof(int32_t));
                memcpy(&s->top_lp[i * k], tl->logprobs, (size_t)k * sizeof(float));
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

static void chain_add_timing(chain_session *s, const shard_svc_step_reply *rep) {
    for (size_t i = 0; i < rep->n_timing && s->res.n_timing < CHAIN_MAX_HOPS; i++) {
        const shard_svc_timing *t = &rep->timing[i];
        chain_timing *d = &s->timing[s->res.n_timing++];
        snprintf(d->server, sizeof d->server, "%s", t->server ? t->server : "");
        d->first_block = t->first_block;
        d->last_block = t->last_block;
        d->queue_us = t->queue_us;
        d->compute_us = t->compute_us;
        d->total_us = t->total_us;
        d->prefix_hit_tokens = t->prefix_hit_tokens;
    }
    s->res.timing = s->timing;
}

/* Runs the step through every link (with forwarding: the one), each hop's hidden states
 * relayed as received to the next; *last: the last reply (valid until the session's next step). */
static int chain_run_links(chain_session *s, shard_svc_step *step, shard_svc_input *in,
                           const shard_svc_step_reply **last) {
    s->res.n_timing = 0;
    const shard_svc_step_reply *rep = NULL;
    int rc = FU_OK;
    for (int i = 0; i < s->n_links && !rc; i++) {
        rc = chain_link_step(s, i, step, &rep);
        if (i > 0) shard_svc_session_drop_reply(s->links[i - 1].sess); /* its hidden states have been sent */
        if (rc) break;
        chain_add_timing(s, rep);
        if (i + 1 < s->n_links) {
            if (!rep->output->hidden)
                rc = fu_errorf(FU_ERR_FORMAT, "shard %s: returned no hidden states", s->links[i].address);
            in->hidden = rep->output->hidden;
        }
    }
    *last = rep;
    return rc;
}

/* The leading positions of a step that the hops take from their prefix caches: on the first
 * step only, when it starts with the open's prefix and wants no output for every position; at
 * least one position is computed. The pins go with the first step either way. */
static int64_t chain_prefix_reuse(chain_session *s, const int32_t *tokens, int n, int64_t rollback_to,
                                  const chain_spec *spec) {
    int64_t reuse = s->cached;
    s->cached = 0;
    if (reuse >= n) reuse = n - 1; /* a hop may take part of a pinned block */
    if (s->len || rollback_to >= 0 || spec->all_positions || reuse <= 0 || reuse > s->n_prefix ||
        memcmp(tokens, s->prefix, (size_t)reuse * sizeof *tokens))
        return 0;
    return reuse;
}

int chain_session_step(chain_session *s, const int32_t *tokens, int n, int64_t rollback_to,
                       const chain_spec *spec, const chain_result **out) {
    *out = NULL;
    if (n <= 0) return fu_errorf(FU_ERR_INVALID, "chain step: no tokens");
    if (rollback_to > s->len) return fu_errorf(FU_ERR_RANGE, "chain step: rollback beyond the session");
    int64_t t0 = fu_now_us();
    int64_t start = rollback_to >= 0 ? rollback_to : s->len;

    shard_svc_sampling samp;
    shard_svc_output_spec os = {.want_logits = spec->want_logits,
                                .all_positions = spec->all_positions,
                                .score_inputs = spec->score_inputs,
                                .top_logprobs = spec->top_logprobs};
    for (int i = 0; i < s->n_links; i++)
        shard_svc_session_set_wait(s->links[i].sess, spec->timeout_ms > 0 ? spec->timeout_ms : s->c->o.timeout_ms,
                                   s->watch, s->watch_arg);
    if (spec->sample) {
        const smp_params *p = &spec->sampling;
        if (p->n_bias > SMP_MAX_LOGIT_BIAS)
            return fu_errorf(FU_ERR_INVALID, "logit_bias: at most %d entries", SMP_MAX_LOGIT_BIAS);
        samp = shard_svc_sampling_from_params(p, spec->penalty_start);
        os.sampling = &samp;
    }
    int64_t reuse = chain_prefix_reuse(s, tokens, n, rollback_to, spec);
    start += reuse;
    shard_svc_input in = {tokens + reuse, (size_t)(n - reuse), NULL};
    shard_svc_step step = {++s->next_request, start, &in, &os, rollback_to >= 0, rollback_to, reuse};
    const shard_svc_step_reply *rep = NULL;
    int rc = chain_run_links(s, &step, &in, &rep);
    if (!rc) {
        int n_timing = s->res.n_timing;
        rc = chain_take_output(s, rep, spec, n);
        s->res.n_timing = n_timing;
        s->res.timing = s->timing;
    }
    for (int i = 0; i < s->n_links; i++) shard_svc_session_drop_reply(s->links[i].sess);
    if (rc) return rc;
    s->len = start + n - reuse;
    s->res.total_us = fu_now_us() - t0;
    s->res.prefix_reused = reuse;
    *out = &s->res;
    return FU_OK;
}
