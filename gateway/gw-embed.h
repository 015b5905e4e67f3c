/* gw-embed.h -- OpenAI's /v1/embeddings over the chain: each input through every hop's span, pooled.
 *
 * An input (a string, a list of strings, a list of token ids or a list of such
 * lists) is tokenized as given (special tokens in the text are plain text) and
 * run through the chain with stateless Forward calls: token ids into the first
 * hop, its hidden states (f32 on the wire) into the next, and at the head the
 * hidden states after the model's output norm -- the rows its LM head reads --
 * instead of logits. The embedding is their mean over the input's positions,
 * scaled to unit length (cosine similarity is then a dot product), of the
 * model's hidden size; `dimensions` other than that is refused. The chain is
 * the static one (cfg->hops) or, on a swarm, a route leased for the call.
 *
 * Threading: gw_embed_run may be called from many threads at once (a mutex
 * guards the cache of channels, which are thread-safe). Ownership: the
 * config, model and swarm are borrowed and must outlive the module; results
 * are new JSON references for the caller.
 */
#ifndef FU_GW_EMBED_H
#define FU_GW_EMBED_H

#include <jansson.h>

#include "gw-gen.h"
#include "gw.h"

struct gw_swarm;
typedef struct gw_embed gw_embed;

/* The module over cfg's static chain or swarm (NULL: static). FU_OK or FU_ERR_NOMEM. */
int gw_embed_new(const gw_config *cfg, const gw_model *m, struct gw_swarm *swarm, gw_embed **out);
void gw_embed_free(gw_embed *e); /* NULL is a no-op */

/* POST /v1/embeddings with body: 0 with *out ({object: "list", data: [{object: "embedding",
 * index, embedding}], model, usage}), or the HTTP status with *err -- 400 naming the param (a
 * missing or empty input, more than 2048 inputs, an input beyond the context, a token id out of
 * range, an unknown encoding_format, unsupported dimensions, an unknown parameter), 404 for
 * another model, 503 when the chain fails (no address in the message). */
int gw_embed_run(gw_embed *e, const json_t *body, json_t **out, gw_error *err);

#endif
