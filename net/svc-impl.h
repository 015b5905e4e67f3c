/* svc-impl.h -- helpers the typed services (shard-svc.c, swarm-svc.c, train-svc.c) share to pack and read messages.
 *
 * Not for use outside net/. Integer fields are int64 on the wire (net/proto/fusion.proto) so that
 * a peer's out-of-range value reaches the receiver intact; the plain structs of the service
 * headers hold them as int32, and these helpers narrow them, refusing (never truncating) a value
 * that does not fit. Received names are refused with control characters or beyond a length.
 * Tensors, Inputs and adapter states are viewed (and packed) here once for every service. Threads: stateless.
 * Ownership: nothing is kept; views point into the message they were made from, packed messages
 * into the structs they were packed from.
 */
#ifndef FU_SVC_IMPL_H
#define FU_SVC_IMPL_H

#include <stddef.h>
#include <stdint.h>

#include "fusion.pb-c.h"
#include "rpc-base.h"
#include "shard-svc.h"
#include "wire.h"

/* One received int64 field and the int32 of its view. */
typedef struct svc_i32 {
    const char *name; /* as the proto names it, for the message: "open.max_length" */
    int64_t v;
    int32_t *out;
} svc_i32;

/* Narrows f[0..n) into their views in order. RPC_OK, or RPC_INVALID_ARGUMENT naming the first
 * field outside int32 ("<prefix><name>: 1099511627776 is out of range"; prefix may be ""), with
 * the views from that one on left unset. */
static inline int svc_narrow(const svc_i32 *f, size_t n, const char *prefix, rpc_status *st) {
    for (size_t i = 0; i < n; i++) {
        if (f[i].v < INT32_MIN || f[i].v > INT32_MAX)
            return rpc_status_setf(st, RPC_INVALID_ARGUMENT, "%s%s: %lld is out of range", prefix, f[i].name,
                                   (long long)f[i].v);
        *f[i].out = (int32_t)f[i].v;
    }
    return RPC_OK;
}

/* A string for a message (NULL packs as "") or from one (never NULL in a view). */
static inline char *svc_str(const char *s) { return (char *)(s ? s : ""); }

/* The status of an allocation that failed. */
static inline int svc_no_memory(rpc_status *st) {
    return rpc_status_setf(st, RPC_RESOURCE_EXHAUSTED, "out of memory");
}

/* Refuses a received name (`what`, for the message) longer than `max` bytes or holding control
 * characters (INVALID_ARGUMENT). */
int svc_name_check(const char *s, size_t max, const char *what, rpc_status *st);

/* Token ids src[0..n) (int64 on the wire) narrowed into dst[0..n). An id outside 0..INT32_MAX is
 * refused with INVALID_ARGUMENT naming `what`[k] (the vocabulary bound is the receiver's). */
int svc_ids_view(const int64_t *src, size_t n, int32_t *dst, const char *what, rpc_status *st);

/* Entries src[0..n) (int64 on the wire) narrowed into dst[0..n); one outside int32 is refused
 * with INVALID_ARGUMENT naming `what`[k]. */
int svc_i32s_view(const int64_t *src, size_t n, int32_t *dst, const char *what, rpc_status *st);

/* A Tensor pointing at v's shape and bytes. */
void svc_tensor_pack(const wire_tensor *v, Fusion__Tensor *m);

/* The view of a received Tensor, named `what` in a refusal (a block_size beyond int32). */
int svc_tensor_view(const Fusion__Tensor *m, wire_tensor *v, const char *what, rpc_status *st);

/* An Input with v's tokens widened into tokens[0..v->n_tokens) (the caller's) and its hidden
 * tensor, if any, in *hidden. */
void svc_input_pack(const shard_svc_input *v, int64_t *tokens, Fusion__Input *m, Fusion__Tensor *hidden);

/* The view of a received Input in *v: token ids narrowed into tokens[0..m->n_tokens) (the
 * caller's), the hidden tensor's view in *hidden. Ids outside 0..INT32_MAX and a block size
 * beyond int32 are refused (INVALID_ARGUMENT naming "<what>.tokens" / "<what>.hidden"). */
int svc_input_view(const Fusion__Input *m, int32_t *tokens, shard_svc_input *v, wire_tensor *hidden,
                   const char *what, rpc_status *st);

/* v packed into *m and returned; NULL (nothing packed) for an absent tensor. */
Fusion__Tensor *svc_tensor_opt_pack(const wire_tensor *v, Fusion__Tensor *m);

/* The view of a received optional Tensor in *v, with *out = v, or *out = NULL when absent; named
 * what + field in a refusal. */
int svc_tensor_opt_view(const Fusion__Tensor *m, wire_tensor *v, const wire_tensor **out, const char *what,
                        const char *field, rpc_status *st);

/* A LoraSpec with v's values, its target names borrowed. */
void svc_lora_pack(const shard_svc_lora *v, Fusion__LoraSpec *m);

/* An AdapterState with the sub-messages it points to. */
typedef struct svc_state_msg {
    Fusion__AdapterState s; /* first: a reply casts back */
    Fusion__LoraSpec lora;
    Fusion__Tensor params, moment1, moment2;
} svc_state_msg;

/* The AdapterState of v in *m, pointing into v. */
void svc_state_pack(const shard_svc_state *v, svc_state_msg *m);

/* v packed into *m and its message returned; NULL (nothing packed) for an absent state. */
Fusion__AdapterState *svc_state_opt_pack(const shard_svc_state *v, svc_state_msg *m);

/* A received AdapterState's view and the views it points to. */
typedef struct svc_state_view {
    shard_svc_state state;
    shard_svc_lora lora;
    wire_tensor params, moment1, moment2;
} svc_state_view;

/* The view of a received AdapterState named `what` in b->state: blocks narrowed, its LoraSpec's r
 * narrowed and at most SHARD_SVC_MAX_TARGETS target names of at most SHARD_SVC_MAX_TARGET_NAME
 * bytes without control characters (else INVALID_ARGUMENT naming the field). */
int svc_state_view_set(const Fusion__AdapterState *m, svc_state_view *b, const char *what, rpc_status *st);

/* The view of a received LoraSpec named `what` (checked as in svc_state_view_set). */
int svc_lora_view(const Fusion__LoraSpec *m, shard_svc_lora *v, const char *what, rpc_status *st);

/* Registers LoadAdapter / UnloadAdapter (those of h's handlers that are set) on srv. */
int svc_adapter_serve(rpc_server *srv, const shard_svc_handlers *h);

#endif
