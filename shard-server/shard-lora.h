/* shard-lora.h -- a shard server's LoRA adapters from the wire: a LoraSpec as a config, an AdapterState as an adapter.
 *
 * Shared by the training service (shard-train.c: a job's config and state) and
 * the inference one (shard-rpc.c: LoadAdapter). Refusals are INVALID_ARGUMENT
 * naming the field. Stateless and thread-safe; what is returned is the
 * caller's.
 */
#ifndef FU_SHARD_LORA_H
#define FU_SHARD_LORA_H

#include <stddef.h>

#include "lora.h"
#include "model.h"
#include "rpc-base.h"
#include "shard-svc.h"
#include "wire.h"

/* LoraSpec l (named `what`, e.g. "lora") as a lora_config in *c: r in [1, max_rank], known
 * target names (or "all-linear"), a config lora_config_check accepts. NULL l: "missing". */
int shard_lora_config(const shard_svc_lora *l, int max_rank, const char *what, lora_config *c, rpc_status *st);

/* Decodes w, a flat F32 tensor of exactly n finite floats named `what`, into out[0..n). */
int shard_lora_floats(const wire_tensor *w, size_t n, const char *what, float *out, rpc_status *st);

/* The adapter of AdapterState s (named "state") for model m's span: exactly m's blocks, its
 * LoraSpec within max_rank, params F32 (n) in PEFT's order, held in m's q/k row order. On
 * RPC_OK *out is the caller's (lora_free). */
int shard_lora_from_state(const mdl_model *m, const shard_svc_state *s, int max_rank, lora_adapter **out,
                          rpc_status *st);

#endif
