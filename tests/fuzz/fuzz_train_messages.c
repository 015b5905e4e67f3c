/* fuzz_train_messages.c -- libFuzzer target: arbitrary bytes as the fusion.Train requests a
 * coordinator sends a shard server, and the adapter requests of fusion.Shard that carry the same
 * AdapterState, decoded and viewed by net/ exactly as the server's entries do before a handler
 * runs (train_svc_request_check, shard_svc_adapter_request_check).
 *
 * Input: the first byte picks the method (byte % (TRAIN_SVC_N_METHODS + 2): train_svc_method's
 * order, then LoadAdapter and UnloadAdapter); the rest is the message. */
#include <stdint.h>
#include <stdlib.h>

#include "rpc-base.h"
#include "shard-svc.h"
#include "train-svc.h"

/* The bound on one message, as a server's default. */
#define FUZZ_MAX_BYTES RPC_DEFAULT_MAX_MESSAGE

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 1) return 0;
    int m = data[0] % (TRAIN_SVC_N_METHODS + 2);
    rpc_status st;
    int rc = m < TRAIN_SVC_N_METHODS
                 ? train_svc_request_check((train_svc_method)m, data + 1, size - 1, FUZZ_MAX_BYTES, &st)
                 : shard_svc_adapter_request_check((shard_svc_adapter_call)(m - TRAIN_SVC_N_METHODS), data + 1,
                                                   size - 1, FUZZ_MAX_BYTES, &st);
    /* a verdict is one of the codes a server answers before its handler */
    if (rc != RPC_OK && rc != RPC_INVALID_ARGUMENT && rc != RPC_RESOURCE_EXHAUSTED) abort();
    return 0;
}
