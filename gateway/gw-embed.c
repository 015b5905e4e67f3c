/* gw-embed.c -- /v1/embeddings: inputs, the chain of Forward calls, pooling, the response. */
#include "gw-embed.h"

#include <math.h>
#include <openssl/evp.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "gw-swarm.h"
#include "log.h"
#include "rpc-base.h"
#include "shard-svc.h"
#include "status.h"
#include "tokenizer.h"
#include "wire.h"

#define GW_EMBED_MAX_INPUTS 2048 /* OpenAI's limit */
#define GW_EMBED_CHANNELS 64     /* channels kept, by address */
#define GW_EMBED_TIMEOUT_MS 120000

typedef struct gw_embed_channel {
    char address[128];
    rpc_channel *ch;
} gw_embed_channel;

struct gw_embed {
    const gw_config *cfg;
    const gw_model *m;
    gw_swarm *swarm;
    pthread_mutex_t mu; /* guards ch[] */
    gw_embed_channel ch[GW_EMBED_CHANNELS];
    int n_ch;
};

/* One input as token ids. */
typedef struct gw_embed_input {
    int32_t *ids;
    size_t n;
} gw_embed_input;

int gw_embed_new(const gw_config *cfg, const gw_model *m, gw_swarm *swarm, gw_embed **out) {
    gw_embed *e = calloc(1, sizeof *e);
    if (!e) return fu_errorf(FU_ERR_NOMEM, "embeddings");
    e->cfg = cfg, e->m = m, e->swarm = swarm;
    pthread_mutex_init(&e->mu, NULL);
    *out = e;
    return FU_OK;
}

void gw_embed_free(gw_embed *e) {
    if (!e) return;
    for (int i = 0; i < e->n_ch; i++) rpc_channel_free(e->ch[i].ch);
    pthread_mutex_destroy(&e->mu);
    free(e);
}

/* The channel to `address`, made on first use and kept (NULL when it cannot be made). */
static rpc_channel *gw_embed_channel_get(gw_embed *e, const char *address) {
    pthread_mutex_lock(&e->mu);
    rpc_channel *ch = NULL;
    for (int i = 0; i < e->n_ch && !ch; i++)
        if (!strcmp(e->ch[i].address, address)) ch = e->ch[i].ch;
    if (!ch && e->n_ch < GW_EMBED_CHANNELS) {
        if (!gw_channel_new(e->cfg, address, &ch)) {
            snprintf(e->ch[e->n_ch].address, sizeof e->ch[e->n_ch].address, "%s", address);
            e->ch[e->n_ch++].ch = ch;
        }
    }
    pthread_mutex_unlock(&e->mu);
    return ch;
}

/* ---- inputs -------------------------------------------------------------------------------------- */

/* Token ids from a JSON array of integers (param names it in errors). */
static int gw_embed_ids(const gw_embed *e, const json_t *a, const char *param, gw_embed_input *in, gw_error *err) {
    size_t n = json_array_size(a), i;
    const json_t *v;
    if (!n) return gw_error_set(err, 400, param, "invalid_value", "'%s' is empty", param);
    if (!(in->ids = malloc(n * sizeof *in->ids))) return gw_error_set(err, 500, NULL, NULL, "out of memory");
    json_array_foreach(a, i, v) {
        json_int_t id = json_is_integer(v) ? json_integer_value(v) : -1;
        if (id < 0 || id >= e->m->vocab)
            return gw_error_set(err, 400, param, "invalid_value", "'%s[%zu]' is not a token id in [0, %d)", param, i,
                                e->m->vocab);
        in->ids[i] = (int32_t)id;
    }
    in->n = n;
    return 0;
}

/* One input (a string or a list of ids) into in, within the context. */
static int gw_embed_one(const gw_embed *e, const json_t *v, const char *param, gw_embed_input *in, gw_error *err) {
    int rc = 0;
    if (json_is_array(v)) rc = gw_embed_ids(e, v, param, in, err);
    else if (!json_is_string(v)) rc = gw_error_set(err, 400, param, "invalid_type", "'%s' must be a string or a list of token ids", param);
    else if (!json_string_length(v)) rc = gw_error_set(err, 400, param, "invalid_value", "'%s' is an empty string", param);
    else if (tok_encode(e->m->tok, json_string_value(v), json_string_length(v), true, false, &in->ids, &in->n))
        rc = gw_error_set(err, 400, param, NULL, "tokenizer: %s", fu_last_error());
    if (!rc && in->n > (size_t)e->m->ctx)
        rc = gw_error_set(err, 400, param, "context_length_exceeded",
                          "This model's maximum context length is %d tokens, however you requested %zu tokens.",
                          e->m->ctx, in->n);
    return rc;
}

/* Whether v is a list of token ids (a single input) rather than a list of inputs. */
static bool gw_embed_is_ids(const json_t *v) {
    return json_is_array(v) && json_array_size(v) && json_is_integer(json_array_get(v, 0));
}

/* The body's inputs into *in (*n of them, malloc'd). */
static int gw_embed_inputs(const gw_embed *e, const json_t *input, gw_embed_input **in, size_t *n, gw_error *err) {
    bool list = json_is_array(input) && !gw_embed_is_ids(input);
    *n = list ? json_array_size(input) : 1;
    if (!input || (list && !*n)) return gw_error_set(err, 400, "input", "missing_required_parameter", "'input' is required and must not be empty");
    if (*n > GW_EMBED_MAX_INPUTS)
        return gw_error_set(err, 400, "input", "invalid_value", "'input' holds %zu items, at most %d", *n, GW_EMBED_MAX_INPUTS);
    if (!(*in = calloc(*n, sizeof **in))) return gw_error_set(err, 500, NULL, NULL, "out of memory");
    int rc = 0;
    for (size_t i = 0; i < *n && !rc; i++) {
        char param[32];
        snprintf(param, sizeof param, list ? "input[%zu]" : "input", i);
        rc = gw_embed_one(e, list ? json_array_get(input, i) : input, param, &(*in)[i], err);
    }
    return rc;
}

/* ---- the chain ----------------------------------------------------------------------------------- */

/* The hops to run len positions on: the static chain, or a route leased from the swarm. */
static int gw_embed_chain(gw_embed *e, int len, gw_lease *l, gw_error *err) {
    if (e->swarm) return gw_swarm_route(e->swarm, len, l, err) ? err->http : 0;
    const gw_config *cfg = e->cfg;
    *l = (gw_lease){.n_hops = cfg->n_hops};
    for (int i = 0; i < cfg->n_hops; i++)
        l->hops[i] = (chain_hop){cfg->hops[i].address, cfg->hops[i].first, cfg->hops[i].last, NULL};
    return cfg->n_hops ? 0 : gw_error_set(err, 503, NULL, "shard_unavailable", "no chain is configured");
}

/* The mean of the n rows of hidden states t (n, D) scaled to unit length, into vec (D). */
static int gw_embed_pool(const wire_tensor *t, size_t n, int D, float *vec, gw_error *err) {
    float *rows = t->n_shape == 2 && t->shape[0] == (int64_t)n && t->shape[1] == D ? malloc(n * (size_t)D * sizeof *rows) : NULL;
    int rc = rows ? wire_decode(t->data, t->data_len, t->scales, t->scales_len, t->dtype, t->block_size, n * (size_t)D,
                                rows, "embedding")
                  : FU_ERR_INVALID;
    if (!rc) {
        double norm = 0;
        for (int d = 0; d < D; d++) {
            double sum = 0;
            for (size_t i = 0; i < n; i++) sum += rows[i * (size_t)D + (size_t)d];
            vec[d] = (float)(sum / (double)n);
            norm += (double)vec[d] * vec[d];
        }
        for (int d = 0; d < D && norm > 0; d++) vec[d] = (float)(vec[d] / sqrt(norm));
    }
    free(rows);
    return rc ? gw_error_set(err, 502, NULL, "shard_error", "the chain returned malformed hidden states") : 0;
}

/* One input through every hop of l (token ids in, hidden states between hops, the head's final
 * normed states out), pooled into vec (D). */
static int gw_embed_forward(gw_embed *e, const gw_lease *l, const gw_embed_input *in, float *vec, gw_error *err) {
    shard_svc_forward_held *held = NULL, *prev = NULL;
    const shard_svc_output *out = NULL;
    shard_svc_input x = {in->ids, in->n, NULL};
    int rc = 0;
    for (int h = 0; h < l->n_hops && !rc; h++) {
        const chain_hop *hop = &l->hops[h];
        rpc_channel *ch = gw_embed_channel_get(e, hop->address);
        shard_svc_output_spec spec = {.all_positions = true, .want_hidden = h == l->n_hops - 1};
        rpc_status st = {0};
        int code = ch ? shard_svc_forward_one(ch, &x, &spec, hop->first_block, hop->last_block, WIRE_F32,
                                              GW_EMBED_TIMEOUT_MS, &held, &out, &st)
                      : RPC_UNAVAILABLE;
        shard_svc_forward_free(prev); /* x.hidden pointed into it */
        prev = held, held = NULL;
        if (code || !out->hidden) {
            FU_WARN("embeddings: blocks [%d, %d): %s", hop->first_block, hop->last_block, code ? st.message : "no hidden states");
            rc = gw_error_set(err, code == RPC_RESOURCE_EXHAUSTED ? 503 : 502, NULL, "shard_unavailable",
                              "a server of the chain (blocks [%d, %d)) failed to compute the embedding",
                              hop->first_block, hop->last_block);
        } else {
            x.hidden = out->hidden;
        }
    }
    if (!rc) rc = gw_embed_pool(out->hidden, in->n, e->m->mdl ? e->m->mdl->dim : e->cfg->hidden_size, vec, err);
    shard_svc_forward_free(prev);
    return rc;
}

/* ---- the request --------------------------------------------------------------------------------- */

/* Checks model, encoding_format, dimensions and unknown keys; *base64 for encoding_format "base64". */
static int gw_embed_params(const gw_embed *e, const json_t *body, bool *base64, gw_error *err) {
    static const char *const known[] = {"model", "input", "encoding_format", "dimensions", "user"};
    const char *key;
    const json_t *v;
    json_object_foreach((json_t *)body, key, v) {
        size_t k = 0;
        while (k < sizeof known / sizeof known[0] && strcmp(key, known[k])) k++;
        if (k == sizeof known / sizeof known[0])
            return gw_error_set(err, 400, key, "unknown_parameter", "Unrecognized request argument supplied: %.64s", key);
    }
    const json_t *model = json_object_get(body, "model"), *fmt = json_object_get(body, "encoding_format");
    const json_t *dims = json_object_get(body, "dimensions");
    const int D = e->m->mdl ? e->m->mdl->dim : e->cfg->hidden_size;
    if (!json_is_string(model)) return gw_error_set(err, 400, "model", "missing_required_parameter", "'model' is required");
    if (strcmp(json_string_value(model), e->m->name))
        return gw_error_set(err, 404, "model", "model_not_found", "The model '%.128s' does not exist", json_string_value(model));
    *base64 = json_is_string(fmt) && !strcmp(json_string_value(fmt), "base64");
    if (fmt && !json_is_null(fmt) && !*base64 && !(json_is_string(fmt) && !strcmp(json_string_value(fmt), "float")))
        return gw_error_set(err, 400, "encoding_format", "invalid_value", "'encoding_format' must be 'float' or 'base64'");
    if (dims && !json_is_null(dims) && json_integer_value(dims) != D)
        return gw_error_set(err, 400, "dimensions", "invalid_value",
                            "'dimensions' is not supported: this model's embeddings have %d dimensions", D);
    return 0;
}

/* One data entry: the vector as a list of floats or as base64 of its little-endian float32 bytes. */
static json_t *gw_embed_entry(const float *vec, int D, size_t index, bool base64) {
    json_t *emb = NULL;
    if (base64) {
        char *b64 = malloc(4 * (((size_t)D * 4 + 2) / 3) + 1);
        if (b64) EVP_EncodeBlock((unsigned char *)b64, (const unsigned char *)vec, D * 4), emb = json_string(b64);
        free(b64);
    } else if ((emb = json_array())) {
        for (int d = 0; d < D; d++) json_array_append_new(emb, json_real(vec[d]));
    }
    return emb ? json_pack("{s:s, s:I, s:o}", "object", "embedding", "index", (json_int_t)index, "embedding", emb) : NULL;
}

/* Every input through the chain: the response's data and the tokens counted. */
static int gw_embed_all(gw_embed *e, const gw_embed_input *in, size_t n, bool base64, json_t *data, size_t *tokens,
                        gw_error *err) {
    const int D = e->m->mdl ? e->m->mdl->dim : e->cfg->hidden_size;
    float *vec = malloc((size_t)D * sizeof *vec);
    int rc = vec ? 0 : gw_error_set(err, 500, NULL, NULL, "out of memory");
    for (size_t i = 0; i < n && !rc; i++) {
        gw_lease l;
        if ((rc = gw_embed_chain(e, (int)in[i].n, &l, err))) break;
        rc = gw_embed_forward(e, &l, &in[i], vec, err);
        if (e->swarm) gw_swarm_release(e->swarm, &l);
        if (!rc && json_array_append_new(data, gw_embed_entry(vec, D, i, base64)))
            rc = gw_error_set(err, 500, NULL, NULL, "out of memory");
        *tokens += in[i].n;
    }
    free(vec);
    return rc;
}

int gw_embed_run(gw_embed *e, const json_t *body, json_t **out, gw_error *err) {
    *out = NULL;
    bool base64 = false;
    gw_embed_input *in = NULL;
    size_t n = 0, tokens = 0;
    json_t *data = json_array();
    int rc = data ? gw_embed_params(e, body, &base64, err) : gw_error_set(err, 500, NULL, NULL, "out of memory");
    if (!rc) rc = gw_embed_inputs(e, json_object_get(body, "input"), &in, &n, err);
    if (!rc) rc = gw_embed_all(e, in, n, base64, data, &tokens, err);
    if (!rc)
        *out = json_pack("{s:s, s:O, s:s, s:{s:I, s:I}}", "object", "list", "data", data, "model", e->m->name, "usage",
                         "prompt_tokens", (json_int_t)tokens, "total_tokens", (json_int_t)tokens);
    if (!rc && !*out) rc = gw_error_set(err, 500, NULL, NULL, "out of memory");
    for (size_t i = 0; in && i < n; i++) free(in[i].ids);
    free(in);
    json_decref(data);
    return rc;
}
