/* swarm-svc.c -- fusion.Swarm's messages packed from and unpacked into the plain structs of swarm-svc.h. */
#include "swarm-svc.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fusion.pb-c.h"
#include "rpc.h"
#include "status.h"
#include "svc-impl.h"

/* ---- MemberStatus ------------------------------------------------------------------------------ */

/* A MemberStatus with the link figures it points to, in one block (free()). */
typedef struct member_msg {
    Fusion__MemberStatus ms;
    Fusion__LinkFigure **fig_ptrs; /* (n_links), then the figures themselves */
} member_msg;

/* A new MemberStatus pointing into v (free() it); NULL when out of memory. */
static member_msg *member_pack(const swarm_svc_member *v) {
    size_t n = v->n_links;
    member_msg *m = malloc(sizeof *m + n * (sizeof(Fusion__LinkFigure *) + sizeof(Fusion__LinkFigure)));
    if (!m) return NULL;
    m->fig_ptrs = (Fusion__LinkFigure **)(m + 1);
    Fusion__LinkFigure *figs = (Fusion__LinkFigure *)(m->fig_ptrs + n);
    Fusion__MemberStatus *ms = &m->ms;
    fusion__member_status__init(ms);
    ms->address = svc_str(v->address);
    ms->model_name = svc_str(v->model_name);
    ms->n_layers = v->n_layers;
    ms->first_block = v->first_block;
    ms->last_block = v->last_block;
    ms->device = svc_str(v->device);
    ms->dtype = svc_str(v->dtype);
    ms->tokens_per_s = v->tokens_per_s;
    ms->block_tokens_per_s = v->block_tokens_per_s;
    ms->max_blocks = v->max_blocks;
    ms->free_kv_bytes = v->free_kv_bytes;
    ms->total_kv_bytes = v->total_kv_bytes;
    ms->kv_bytes_per_position = v->kv_bytes_per_position;
    ms->active_sessions = v->active_sessions;
    ms->fixed_span = v->fixed_span;
    ms->failed_first = v->failed_first;
    ms->failed_last = v->failed_last;
    ms->load_error = svc_str(v->load_error);
    ms->draining_first = v->draining_first;
    ms->draining_last = v->draining_last;
    ms->draining_sessions = v->draining_sessions;
    ms->hidden_size = v->hidden_size;
    ms->n_prompt_step_tokens = ms->n_prompt_step_s = v->prompt_steps.n;
    ms->prompt_step_tokens = (double *)v->prompt_steps.tokens, ms->prompt_step_s = (double *)v->prompt_steps.seconds;
    ms->n_decode_step_tokens = ms->n_decode_step_s = v->decode_steps.n;
    ms->decode_step_tokens = (double *)v->decode_steps.tokens, ms->decode_step_s = (double *)v->decode_steps.seconds;
    for (size_t i = 0; i < n; i++) {
        fusion__link_figure__init(&figs[i]);
        figs[i].address = svc_str(v->links[i].address);
        figs[i].rtt_s = v->links[i].rtt_s;
        figs[i].bandwidth_bytes_per_s = v->links[i].bandwidth_bytes_per_s;
        m->fig_ptrs[i] = &figs[i];
    }
    ms->n_links = n;
    ms->links = n ? m->fig_ptrs : NULL;
    return m;
}

/* Narrows a received MemberStatus's counts and blocks into v (INVALID_ARGUMENT naming the first
 * beyond int32). */
static int member_narrow(const Fusion__MemberStatus *ms, swarm_svc_member *v, rpc_status *st) {
    svc_i32 f[] = {{"n_layers", ms->n_layers, &v->n_layers},
                   {"first_block", ms->first_block, &v->first_block},
                   {"last_block", ms->last_block, &v->last_block},
                   {"max_blocks", ms->max_blocks, &v->max_blocks},
                   {"active_sessions", ms->active_sessions, &v->active_sessions},
                   {"failed_first", ms->failed_first, &v->failed_first},
                   {"failed_last", ms->failed_last, &v->failed_last},
                   {"draining_first", ms->draining_first, &v->draining_first},
                   {"draining_last", ms->draining_last, &v->draining_last},
                   {"draining_sessions", ms->draining_sessions, &v->draining_sessions},
                   {"hidden_size", ms->hidden_size, &v->hidden_size}};
    return svc_narrow(f, sizeof f / sizeof f[0], "status.", st);
}

/* The view of a received MemberStatus; *links: a new array of its link figures (free()), or
 * NULL with none. RPC_OK, RPC_RESOURCE_EXHAUSTED (out of memory) or INVALID_ARGUMENT (a count or
 * block beyond int32; *links NULL). */
static int member_view(const Fusion__MemberStatus *ms, swarm_svc_member *v, swarm_svc_link **links,
                       rpc_status *st) {
    *links = NULL;
    *v = (swarm_svc_member){.address = svc_str(ms->address), .model_name = svc_str(ms->model_name),
                            .device = svc_str(ms->device), .dtype = svc_str(ms->dtype),
                            .tokens_per_s = ms->tokens_per_s, .block_tokens_per_s = ms->block_tokens_per_s,
                            .free_kv_bytes = ms->free_kv_bytes, .total_kv_bytes = ms->total_kv_bytes,
                            .kv_bytes_per_position = ms->kv_bytes_per_position, .fixed_span = ms->fixed_span,
                            .n_links = ms->n_links, .load_error = svc_str(ms->load_error)};
    int rc = member_narrow(ms, v, st);
    if (rc) return rc;
    if (ms->n_prompt_step_tokens != ms->n_prompt_step_s || ms->n_decode_step_tokens != ms->n_decode_step_s ||
        ms->n_prompt_step_s > SWARM_SVC_MAX_STEPS || ms->n_decode_step_s > SWARM_SVC_MAX_STEPS)
        return rpc_status_setf(st, RPC_INVALID_ARGUMENT,
                               "status: step tables need as many times as token counts, at most %d of each",
                               SWARM_SVC_MAX_STEPS);
    v->prompt_steps = (swarm_svc_steps){ms->n_prompt_step_s, ms->prompt_step_tokens, ms->prompt_step_s};
    v->decode_steps = (swarm_svc_steps){ms->n_decode_step_s, ms->decode_step_tokens, ms->decode_step_s};
    if (ms->n_links && !(*links = calloc(ms->n_links, sizeof **links)))
        return rpc_status_setf(st, RPC_RESOURCE_EXHAUSTED, "out of memory");
    for (size_t i = 0; i < ms->n_links; i++) {
        const Fusion__LinkFigure *lf = ms->links[i];
        (*links)[i] = (swarm_svc_link){svc_str(lf->address), lf->rtt_s, lf->bandwidth_bytes_per_s};
    }
    v->links = *links;
    return RPC_OK;
}

/* ---- client ---------------------------------------------------------------------------------- */

/* A received SpanAssignment (NULL: none) as has_span, first, last (INVALID_ARGUMENT: a block beyond
 * int32). */
static int span_read(const Fusion__SpanAssignment *span, bool *has_span, int32_t *first, int32_t *last,
                     rpc_status *st) {
    *has_span = span != NULL;
    svc_i32 f[] = {{"first_block", span ? span->first_block : 0, first},
                   {"last_block", span ? span->last_block : 0, last}};
    return svc_narrow(f, 2, "span.", st);
}

int swarm_svc_join(rpc_channel *ch, const swarm_svc_member *status, int timeout_ms, swarm_svc_join_reply *out,
                   rpc_status *st) {
    memset(out, 0, sizeof *out);
    member_msg *m = member_pack(status);
    if (!m) return rpc_status_setf(st, RPC_RESOURCE_EXHAUSTED, "out of memory");
    Fusion__JoinRequest req = FUSION__JOIN_REQUEST__INIT;
    req.status = &m->ms;
    ProtobufCMessage *msg = NULL;
    int rc = rpc_call_unary(ch, RPC_SWARM_JOIN, &req.base, &fusion__join_reply__descriptor, &msg, timeout_ms, st);
    free(m);
    if (rc) return rc;
    const Fusion__JoinReply *r = (const Fusion__JoinReply *)msg;
    out->member_id = r->member_id;
    svc_i32 f[] = {{"heartbeat_ms", r->heartbeat_ms, &out->heartbeat_ms}};
    rc = svc_narrow(f, 1, "", st);
    if (!rc) rc = span_read(r->span, &out->has_span, &out->first_block, &out->last_block, st);
    rpc_msg_free(msg);
    if (rc) memset(out, 0, sizeof *out);
    return rc;
}

int swarm_svc_heartbeat(rpc_channel *ch, const swarm_svc_heartbeat_request *req, int timeout_ms,
                        swarm_svc_heartbeat_reply *out, rpc_status *st) {
    memset(out, 0, sizeof *out);
    member_msg *m = req->status ? member_pack(req->status) : NULL;
    if (req->status && !m) return rpc_status_setf(st, RPC_RESOURCE_EXHAUSTED, "out of memory");
    Fusion__HeartbeatRequest hb = FUSION__HEARTBEAT_REQUEST__INIT;
    hb.member_id = req->member_id;
    hb.leaving = req->leaving;
    hb.status = m ? &m->ms : NULL;
    ProtobufCMessage *msg = NULL;
    int rc = rpc_call_unary(ch, RPC_SWARM_HEARTBEAT, &hb.base, &fusion__heartbeat_reply__descriptor, &msg,
                            timeout_ms, st);
    free(m);
    if (rc) return rc;
    const Fusion__HeartbeatReply *r = (const Fusion__HeartbeatReply *)msg;
    if ((rc = span_read(r->span, &out->has_span, &out->first_block, &out->last_block, st))) {
        rpc_msg_free(msg);
        memset(out, 0, sizeof *out);
        return rc;
    }
    for (size_t i = 0; i < r->n_peers && out->n_peers < SWARM_SVC_MAX_PEERS; i++) {
        const char *a = r->peers[i];
        if (a && a[0] && strlen(a) < SWARM_SVC_ADDRESS_LEN)
            snprintf(out->peers[out->n_peers++], SWARM_SVC_ADDRESS_LEN, "%s", a);
    }
    rpc_msg_free(msg);
    return RPC_OK;
}

/* ---- server ---------------------------------------------------------------------------------- */

/* A reply in flight with what it points to. */
typedef struct join_msg {
    Fusion__JoinReply rep; /* first: freed as one block */
    Fusion__SpanAssignment span;
} join_msg;

typedef struct heartbeat_msg {
    Fusion__HeartbeatReply rep; /* first: freed as one block */
    Fusion__SpanAssignment span;
    swarm_svc_heartbeat_reply out;
    char *peers[SWARM_SVC_MAX_PEERS];
} heartbeat_msg;

/* Frees a reply allocated as one block. */
static void free_msg(void *ctx, ProtobufCMessage *msg) {
    (void)ctx;
    free(msg);
}

/* A handler call's start: a zeroed reply block of `size` bytes, and the view of the request's
 * status ms (if any; *links: free() after the call). NULL with st set: out of memory, or a
 * status its view cannot hold. */
static void *entry_start(size_t size, const Fusion__MemberStatus *ms, swarm_svc_member *status,
                         swarm_svc_link **links, rpc_status *st) {
    *links = NULL;
    void *m = calloc(1, size);
    if (!m) {
        rpc_status_setf(st, RPC_RESOURCE_EXHAUSTED, "out of memory");
        return NULL;
    }
    if (ms && member_view(ms, status, links, st)) {
        free(m);
        return NULL;
    }
    return m;
}

/* The SpanAssignment in *span, or NULL without one. */
static Fusion__SpanAssignment *span_pack(bool has_span, int first, int last, Fusion__SpanAssignment *span) {
    fusion__span_assignment__init(span);
    span->first_block = first;
    span->last_block = last;
    return has_span ? span : NULL;
}

/* Join: the handler's reply to the request's status. */
static int join_entry(void *ctx, const ProtobufCMessage *req_msg, ProtobufCMessage **reply, rpc_status *st) {
    const swarm_svc_handlers *h = ctx;
    const Fusion__JoinRequest *req = (const Fusion__JoinRequest *)req_msg;
    swarm_svc_member status;
    swarm_svc_link *links;
    join_msg *m = entry_start(sizeof *m, req->status, &status, &links, st);
    if (!m) return st->code;
    swarm_svc_join_reply out = {0};
    int rc = h->join(h->ctx, req->status ? &status : NULL, &out, st);
    free(links);
    if (rc) {
        free(m);
        return rc;
    }
    fusion__join_reply__init(&m->rep);
    m->rep.member_id = out.member_id;
    m->rep.heartbeat_ms = out.heartbeat_ms;
    m->rep.span = span_pack(out.has_span, out.first_block, out.last_block, &m->span);
    *reply = &m->rep.base;
    return RPC_OK;
}

/* Heartbeat: the handler's reply (span, peers) to the member's beat. */
static int heartbeat_entry(void *ctx, const ProtobufCMessage *req_msg, ProtobufCMessage **reply, rpc_status *st) {
    const swarm_svc_handlers *h = ctx;
    const Fusion__HeartbeatRequest *req = (const Fusion__HeartbeatRequest *)req_msg;
    swarm_svc_member status;
    swarm_svc_link *links;
    heartbeat_msg *m = entry_start(sizeof *m, req->status, &status, &links, st);
    if (!m) return st->code;
    swarm_svc_heartbeat_request hb = {req->member_id, req->status ? &status : NULL, req->leaving};
    int rc = h->heartbeat(h->ctx, &hb, &m->out, st);
    free(links);
    if (rc) {
        free(m);
        return rc;
    }
    fusion__heartbeat_reply__init(&m->rep);
    m->rep.span = span_pack(m->out.has_span, m->out.first_block, m->out.last_block, &m->span);
    int n = m->out.n_peers < SWARM_SVC_MAX_PEERS ? m->out.n_peers : SWARM_SVC_MAX_PEERS;
    for (int i = 0; i < n; i++) m->peers[i] = m->out.peers[i];
    m->rep.n_peers = n > 0 ? (size_t)n : 0;
    m->rep.peers = n > 0 ? m->peers : NULL;
    *reply = &m->rep.base;
    return RPC_OK;
}

int swarm_svc_fuzz_one(const swarm_svc_handlers *h, bool heartbeat, const void *data, size_t len) {
    const ProtobufCMessageDescriptor *d =
        heartbeat ? &fusion__heartbeat_request__descriptor : &fusion__join_request__descriptor;
    ProtobufCMessage *req = NULL, *reply = NULL;
    rpc_status st = {0};
    int rc = rpc_msg_unpack(d, data, len, RPC_DEFAULT_MAX_MESSAGE, &req, &st);
    if (!rc) rc = (heartbeat ? heartbeat_entry : join_entry)((void *)h, req, &reply, &st);
    if (!rc) {
        size_t n = protobuf_c_message_get_packed_size(reply);
        uint8_t *buf = malloc(n ? n : 1);
        if (buf && protobuf_c_message_pack(reply, buf) != n) abort();
        free(buf);
        free_msg(NULL, reply);
    }
    rpc_msg_free(req);
    return rc;
}

int swarm_svc_serve(rpc_server *srv, const swarm_svc_handlers *h) {
    int rc = rpc_server_add_unary(srv, RPC_SWARM_JOIN, &fusion__join_request__descriptor, join_entry, free_msg,
                                  (void *)h);
    if (!rc)
        rc = rpc_server_add_unary(srv, RPC_SWARM_HEARTBEAT, &fusion__heartbeat_request__descriptor,
                                  heartbeat_entry, free_msg, (void *)h);
    return rc;
}
