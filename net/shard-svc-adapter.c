/* shard-svc-adapter.c -- fusion.Shard's LoadAdapter / UnloadAdapter: views, server entries and client calls. */
#include "shard-svc.h"

#include <stdlib.h>
#include <string.h>

#include "fusion.pb-c.h"
#include "lora.h"
#include "rpc.h"
#include "status.h"
#include "svc-impl.h"

shard_svc_lora shard_svc_lora_of(const lora_config *cfg, const char **names) {
    size_t n = 0;
    for (int t = 0; t < LORA_N_TARGETS; t++)
        if (cfg->targets & LORA_TARGET_BIT(t)) names[n++] = lora_target_name((lora_target)t);
    return (shard_svc_lora){cfg->r, cfg->alpha, cfg->dropout, cfg->use_rslora, names, n, 0};
}

/* ---- views ------------------------------------------------------------------------------ */

/* Refuses a received adapter id that is empty, beyond SHARD_SVC_MAX_NAME bytes or holds a control
 * character (INVALID_ARGUMENT naming `what`). */
static int adapter_id_check(const char *id, const char *what, rpc_status *st) {
    if (!*id) return rpc_status_setf(st, RPC_INVALID_ARGUMENT, "%s: empty", what);
    return svc_name_check(id, SHARD_SVC_MAX_NAME, what, st);
}

/* The LoadAdapterRequest's view in *b: its id checked, its state present with a LoraSpec and
 * params (INVALID_ARGUMENT naming the field). */
static int load_view(const Fusion__LoadAdapterRequest *m, svc_state_view *b, rpc_status *st) {
    int rc = adapter_id_check(m->adapter_id, "adapter_id", st);
    if (rc) return rc;
    if (!m->state) return rpc_status_setf(st, RPC_INVALID_ARGUMENT, "state: missing");
    if ((rc = svc_state_view_set(m->state, b, "state", st))) return rc;
    if (!b->state.lora) return rpc_status_setf(st, RPC_INVALID_ARGUMENT, "state.lora: missing");
    if (!b->state.params) return rpc_status_setf(st, RPC_INVALID_ARGUMENT, "state.params: missing");
    return RPC_OK;
}

/* The views of msg, a received request of `call` (the load's in *b), checked as the server does. */
static int adapter_view(shard_svc_adapter_call call, const ProtobufCMessage *msg, svc_state_view *b,
                        rpc_status *st) {
    if (call == SHARD_SVC_LOAD_ADAPTER) return load_view((const Fusion__LoadAdapterRequest *)msg, b, st);
    return adapter_id_check(((const Fusion__UnloadAdapterRequest *)msg)->adapter_id, "adapter_id", st);
}

int shard_svc_adapter_request_check(shard_svc_adapter_call call, const void *data, size_t len, size_t max_bytes,
                                    rpc_status *st) {
    if (call != SHARD_SVC_LOAD_ADAPTER && call != SHARD_SVC_UNLOAD_ADAPTER)
        return rpc_status_setf(st, RPC_INVALID_ARGUMENT, "no adapter call %d", (int)call);
    const ProtobufCMessageDescriptor *d = call == SHARD_SVC_LOAD_ADAPTER
                                              ? &fusion__load_adapter_request__descriptor
                                              : &fusion__unload_adapter_request__descriptor;
    ProtobufCMessage *msg = NULL;
    int rc = rpc_msg_unpack(d, data, len, max_bytes, &msg, st);
    svc_state_view b;
    if (!rc) rc = adapter_view(call, msg, &b, st);
    rpc_msg_free(msg);
    return rc;
}

/* ---- server ------------------------------------------------------------------------------ */

/* Frees a reply allocated as one block. */
static void adapter_reply_free(void *ctx, ProtobufCMessage *msg) {
    (void)ctx;
    free(msg);
}

/* LoadAdapter: the request's view to the handler, the memory it reports back. */
static int load_entry(void *ctx, const ProtobufCMessage *req, ProtobufCMessage **reply, rpc_status *st) {
    const shard_svc_handlers *h = ctx;
    const Fusion__LoadAdapterRequest *m = (const Fusion__LoadAdapterRequest *)req;
    svc_state_view b;
    int64_t bytes = 0;
    int rc = load_view(m, &b, st);
    if (!rc) rc = h->load_adapter(h->ctx, m->adapter_id, &b.state, &bytes, st);
    if (rc) return rc;
    Fusion__LoadAdapterReply *r = malloc(sizeof *r);
    if (!r) return svc_no_memory(st);
    fusion__load_adapter_reply__init(r);
    r->bytes = bytes;
    *reply = &r->base;
    return RPC_OK;
}

/* UnloadAdapter: the id to the handler. */
static int unload_entry(void *ctx, const ProtobufCMessage *req, ProtobufCMessage **reply, rpc_status *st) {
    const shard_svc_handlers *h = ctx;
    const char *id = ((const Fusion__UnloadAdapterRequest *)req)->adapter_id;
    int rc = adapter_id_check(id, "adapter_id", st);
    if (!rc) rc = h->unload_adapter(h->ctx, id, st);
    if (rc) return rc;
    Fusion__UnloadAdapterReply *r = malloc(sizeof *r);
    if (!r) return svc_no_memory(st);
    fusion__unload_adapter_reply__init(r);
    *reply = &r->base;
    return RPC_OK;
}

int svc_adapter_serve(rpc_server *srv, const shard_svc_handlers *h) {
    int rc = FU_OK;
    if (h->load_adapter)
        rc = rpc_server_add_unary(srv, RPC_SHARD_LOAD_ADAPTER, &fusion__load_adapter_request__descriptor,
                                  load_entry, adapter_reply_free, (void *)h);
    if (!rc && h->unload_adapter)
        rc = rpc_server_add_unary(srv, RPC_SHARD_UNLOAD_ADAPTER, &fusion__unload_adapter_request__descriptor,
                                  unload_entry, adapter_reply_free, (void *)h);
    return rc;
}

/* ---- client ------------------------------------------------------------------------------ */

int shard_svc_adapter_load(rpc_channel *ch, const char *id, const shard_svc_state *state, int timeout_ms,
                           int64_t *bytes, rpc_status *st) {
    *bytes = 0;
    Fusion__LoadAdapterRequest m = FUSION__LOAD_ADAPTER_REQUEST__INIT;
    svc_state_msg sm;
    m.adapter_id = svc_str(id);
    m.state = svc_state_opt_pack(state, &sm);
    ProtobufCMessage *rep = NULL;
    int rc = rpc_call_unary(ch, RPC_SHARD_LOAD_ADAPTER, &m.base, &fusion__load_adapter_reply__descriptor, &rep,
                            timeout_ms, st);
    if (!rc) *bytes = ((const Fusion__LoadAdapterReply *)rep)->bytes;
    rpc_msg_free(rep);
    return rc;
}

int shard_svc_adapter_unload(rpc_channel *ch, const char *id, int timeout_ms, rpc_status *st) {
    Fusion__UnloadAdapterRequest m = FUSION__UNLOAD_ADAPTER_REQUEST__INIT;
    m.adapter_id = svc_str(id);
    ProtobufCMessage *rep = NULL;
    int rc = rpc_call_unary(ch, RPC_SHARD_UNLOAD_ADAPTER, &m.base, &fusion__unload_adapter_reply__descriptor, &rep,
                            timeout_ms, st);
    rpc_msg_free(rep);
    return rc;
}
