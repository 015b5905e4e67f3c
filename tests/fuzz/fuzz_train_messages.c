/* fuzz_train_messages.c -- libFuzzer target: arbitrary bytes as the fusion.Train requests a
 * coordinator sends a shard server, decoded and viewed by net/ (train-svc.c) exactly as the
 * server's entries do before a handler runs (train_svc_request_check).
 *
 * Input: the first byte picks the method (byte % TRAIN_SVC_N_METHODS, in train_svc_method's
 * order); the rest is the message. */
#include <stdint.h>
#include <stdlib.h>

#include "rpc-base.h"
#include "train-svc.h"

/* The bound on one message, as a server's default. */
#define FUZZ_MAX_BYTES RPC_DEFAULT_MAX_MESSAGE

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 1) return 0;
    train_svc_method m = (train_svc_method)(data[0] % TRAIN_SVC_N_METHODS);
    rpc_status st;
    int rc = train_svc_request_check(m, data + 1, size - 1, FUZZ_MAX_BYTES, &st);
    /* a verdict is one of the codes a server answers before its handler */
    if (rc != RPC_OK && rc != RPC_INVALID_ARGUMENT && rc != RPC_RESOURCE_EXHAUSTED) abort();
    return 0;
}
