/* svc-impl.h -- helpers the typed services (shard-svc.c, swarm-svc.c) share to read received messages.
 *
 * Not for use outside net/. Integer fields are int64 on the wire (net/proto/fusion.proto) so that
 * a peer's out-of-range value reaches the receiver intact; the plain structs of the service
 * headers hold them as int32, and these helpers narrow them, refusing (never truncating) a value
 * that does not fit. Threads: stateless. Ownership: nothing is kept.
 */
#ifndef FU_SVC_IMPL_H
#define FU_SVC_IMPL_H

#include <stddef.h>
#include <stdint.h>

#include "rpc-base.h"

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

#endif
