/* gw-lora.h -- the LoRA adapters fusion-gateway serves: a registry by name, pushed to the shards on first use.
 *
 * An adapter is read whole from a PEFT directory (--lora NAME=PATH at start,
 * or POST /v1/load_lora_adapter at run time, from within --lora-dir) and
 * served as model NAME, a child of the base model in /v1/models. The shards
 * get it lazily: before a session opens with an adapter on a chain, each hop
 * that has not yet been sent this version of it receives its span's slice
 * (chain_adapter_load); a hop that answers "not loaded" anyway (it
 * restarted) is sent it again. Each load of a name is a new version with its
 * own id on the shards ("NAME@N"), so that a name unloaded and loaded again
 * never reaches a session with the old weights; an unloaded version is
 * unloaded from the shards it was sent to.
 *
 * Threading: every function is thread-safe (one mutex; pushes to shards run
 * outside it). Ownership: the set owns its adapters; gw_lora_get hands out a
 * reference that gw_lora_put returns, so an adapter unloaded while requests
 * use it lives until they finish.
 */
#ifndef FU_GW_LORA_H
#define FU_GW_LORA_H

#include <jansson.h>
#include <stdint.h>

#include "chain.h"
#include "gw.h"
#include "model.h"

typedef struct gw_lora_set gw_lora_set;

/* One loaded adapter (a reference from gw_lora_get). */
typedef struct gw_lora {
    const char *name;     /* the model id it is served as */
    const char *shard_id; /* "NAME@N": its id on the shards */
} gw_lora;

typedef struct gw_lora_options {
    const mdl_config *model; /* the base model's shape, borrowed */
    const char *lora_dir;    /* runtime loads only from within it; NULL: runtime loads refused */
    int max_rank;            /* largest rank accepted */
    int max_loras;           /* adapters at once */
} gw_lora_options;

/* A set of no adapters. FU_OK or FU_ERR_NOMEM. */
int gw_lora_set_new(const gw_lora_options *o, gw_lora_set **out);
void gw_lora_set_free(gw_lora_set *s); /* NULL is a no-op */

/* Loads the PEFT adapter at `path` as model `name`. runtime: a request's load,
 * confined to lora_dir. 0, or the HTTP status with *err: 400 for a name taken
 * (the base model's included) or invalid, an adapter file that is not one or
 * does not fit the base model (the message names the file, tensor or key),
 * a rank over the limit, max_loras already loaded; 403 for a runtime load
 * without --lora-dir or outside it. */
int gw_lora_add(gw_lora_set *s, const char *name, const char *path, const char *base_name, bool runtime,
                gw_error *err);

/* Unloads model `name`: 0, or 404 with *err when no adapter has that name.
 * Requests using it finish with it; the shards that hold it drop it. */
int gw_lora_remove(gw_lora_set *s, chain_client *c, const char *name, gw_error *err);

/* A reference to adapter `name` (NULL: none of that name). */
gw_lora *gw_lora_get(gw_lora_set *s, const char *name);
void gw_lora_put(gw_lora_set *s, gw_lora *l); /* NULL is a no-op */

/* Makes sure every hop of hops[0..n) holds adapter l (sending the slices it
 * lacks), through client c. FU_OK, or the first hop's refusal (fu_last_error
 * names the hop). forget: forget first what was sent to those hops (after a
 * session open found the adapter missing). */
int gw_lora_ensure(gw_lora_set *s, chain_client *c, gw_lora *l, const chain_hop *hops, int n, bool forget);

/* Appends one /v1/models entry per adapter to `data` ({"id", "object": "model",
 * "created", "owned_by": "fusion", "parent": base_name}).
 * FU_OK or FU_ERR_NOMEM. */
int gw_lora_models(gw_lora_set *s, const char *base_name, json_t *data);

/* The /v1/models entry of adapter `name` (new reference), or NULL when none. */
json_t *gw_lora_model(gw_lora_set *s, const char *base_name, const char *name);

#endif
