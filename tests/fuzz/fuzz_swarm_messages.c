/* fuzz_swarm_messages.c -- libFuzzer target: arbitrary bytes as the fusion.Swarm requests a member
 * sends the gateway (Join, Heartbeat), decoded by net/ (swarm-svc.c) and run through the gateway's
 * own handlers on a manual swarm (gateway/gw-swarm.c: membership, placement, the router); the
 * reply is packed. Every 256 inputs the swarm starts afresh, so joins keep reaching the handlers
 * below the member cap. Or as the Info reply a static member sends the gateway, decoded and
 * checked by net/ (shard-svc.c).
 *
 * Input: the first byte's bit 1 picks an Info reply; else its low bit picks Heartbeat (1) or
 * Join (0); the rest is the message. */
#include <stdint.h>
#include <stdlib.h>

#include "gw-swarm.h"
#include "log.h"
#include "shard-svc.h"

/* The model's blocks: few, so that a placement decision (a max flow per window of blocks)
 * leaves time for many inputs a second. */
#define FUZZ_BLOCKS 4

static gw_config cfg;
static gw_swarm *sw;
static unsigned runs;

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    (void)argc;
    (void)argv;
    fu_log_set_level(FU_LOG_LEVEL_OFF);
    gw_config_init(&cfg);
    cfg.insecure = true;
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 1) return 0;
    if (runs++ % 256 == 0) {
        gw_swarm_free(sw);
        sw = NULL;
        if (gw_swarm_new_manual(&cfg, FUZZ_BLOCKS, &sw)) abort();
    }
    if (data[0] & 2) {
        shard_svc_info *info = NULL;
        if (shard_svc_info_fuzz_one(data + 1, size - 1, &info) == RPC_OK) {
            /* a view's step tables are as long as it says */
            volatile double sum = 0;
            for (size_t i = 0; i < info->n_prompt_steps; i++) sum += info->prompt_step_tokens[i] + info->prompt_step_s[i];
            for (size_t i = 0; i < info->n_decode_steps; i++) sum += info->decode_step_tokens[i] + info->decode_step_s[i];
            (void)sum;
            if (info->n_prompt_steps > SHARD_SVC_MAX_STEPS || info->n_decode_steps > SHARD_SVC_MAX_STEPS) abort();
        }
        shard_svc_info_free(info);
        return 0;
    }
    swarm_svc_fuzz_one(gw_swarm_service(sw), data[0] & 1, data + 1, size - 1);
    return 0;
}
