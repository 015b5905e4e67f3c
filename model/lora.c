/* lora.c -- LoRA adapters: PEFT's configuration and tensor files, initialisation, spans. */
#include "lora.h"

#include <errno.h>
#include <inttypes.h>
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "atomic-file.h"
#include "mapped-file.h"
#include "safetensors.h"
#include "status.h"

#define LORA_CONFIG_MAX ((size_t)1 << 20)
#define LORA_PREFIX "base_model.model.model.layers."

/* ---- targets and shapes ------------------------------------------------------ */

static const char *const lora_names[LORA_N_TARGETS] = {
    "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
};

const char *lora_target_name(lora_target t) { return lora_names[t]; }

const char *lora_target_parent(lora_target t) { return t <= LORA_TARGET_O ? "self_attn" : "mlp"; }

int lora_target_parse(const char *name, lora_target *t) {
    for (int i = 0; i < LORA_N_TARGETS; i++)
        if (strcmp(name, lora_names[i]) == 0) {
            *t = (lora_target)i;
            return FU_OK;
        }
    return FU_ERR_NOT_FOUND;
}

int lora_targets_parse(const char *list, uint32_t *out) {
    *out = 0;
    if (strcmp(list, "all-linear") == 0) {
        *out = LORA_TARGETS_ALL;
        return FU_OK;
    }
    for (const char *p = list; *p;) {
        size_t n = strcspn(p, ",");
        char name[32];
        lora_target t;
        if (n == 0 || n >= sizeof name) return fu_errorf(FU_ERR_INVALID, "LoRA targets '%s': empty or overlong name", list);
        memcpy(name, p, n);
        name[n] = 0;
        if (lora_target_parse(name, &t)) return fu_errorf(FU_ERR_INVALID, "LoRA targets: unknown target '%s'", name);
        *out |= LORA_TARGET_BIT(t);
        p += n + (p[n] == ',');
    }
    return *out ? FU_OK : fu_errorf(FU_ERR_INVALID, "LoRA targets: none given");
}

lora_shape lora_shape_of(const mdl_config *m) {
    return (lora_shape){m->n_layers, m->dim, m->ffn_dim, m->n_heads, m->n_kv_heads, m->head_dim};
}

void lora_target_dims(const lora_shape *s, lora_target t, int *in, int *out) {
    int q = s->n_heads * s->head_dim, kv = s->n_kv_heads * s->head_dim;
    *in = t == LORA_TARGET_O ? q : t == LORA_TARGET_DOWN ? s->ffn_dim : s->dim;
    switch (t) {
    case LORA_TARGET_Q: *out = q; break;
    case LORA_TARGET_K:
    case LORA_TARGET_V: *out = kv; break;
    case LORA_TARGET_GATE:
    case LORA_TARGET_UP: *out = s->ffn_dim; break;
    default: *out = s->dim; break;
    }
}

lora_config lora_config_default(void) {
    return (lora_config){.r = 8, .alpha = 8.0f, .dropout = 0.0f, .use_rslora = false,
                         .targets = LORA_TARGET_BIT(LORA_TARGET_Q) | LORA_TARGET_BIT(LORA_TARGET_V)};
}

float lora_scale(const lora_config *cfg) {
    return cfg->use_rslora ? cfg->alpha / sqrtf((float)cfg->r) : cfg->alpha / (float)cfg->r;
}

int lora_config_check(const lora_config *cfg) {
    if (cfg->r < 1) return fu_errorf(FU_ERR_INVALID, "lora: r = %d (must be >= 1)", cfg->r);
    if (!isfinite(cfg->alpha)) return fu_errorf(FU_ERR_INVALID, "lora: lora_alpha is not finite");
    if (!(cfg->dropout >= 0.0f && cfg->dropout < 1.0f))
        return fu_errorf(FU_ERR_INVALID, "lora: lora_dropout = %g (must be in [0, 1))",
                         (double)cfg->dropout);
    if (!cfg->targets || (cfg->targets & ~LORA_TARGETS_ALL))
        return fu_errorf(FU_ERR_INVALID, "lora: target set 0x%x (a non-empty subset of the seven)",
                         cfg->targets);
    if (!memchr(cfg->base_model, '\0', sizeof cfg->base_model))
        return fu_errorf(FU_ERR_INVALID, "lora: base_model_name_or_path is not terminated");
    return FU_OK;
}

/* ---- adapters ------------------------------------------------------------------- */

/* Floats of one block's A and B matrices over the targets of cfg. */
static size_t lora_block_floats(const lora_config *cfg, const lora_shape *s) {
    size_t n = 0;
    for (int t = 0; t < LORA_N_TARGETS; t++) {
        if (!(cfg->targets & LORA_TARGET_BIT(t))) continue;
        int in, out;
        lora_target_dims(s, (lora_target)t, &in, &out);
        n += (size_t)cfg->r * ((size_t)in + (size_t)out);
    }
    return n;
}

/* An adapter of zeros for blocks [first, last) of shape s. */
static int lora_alloc(const lora_config *cfg, const lora_shape *s, int first, int last,
                      lora_adapter **out) {
    *out = NULL;
    int rc = lora_config_check(cfg);
    if (rc) return rc;
    if (first < 0 || last <= first || last > s->n_layers)
        return fu_errorf(FU_ERR_INVALID, "lora: span [%d, %d) is not inside the model's %d blocks",
                         first, last, s->n_layers);
    lora_adapter *ad = calloc(1, sizeof *ad);
    size_t n_pairs = (size_t)(last - first) * LORA_N_TARGETS;
    if (ad) {
        ad->n_floats = (size_t)(last - first) * lora_block_floats(cfg, s);
        ad->pairs = calloc(n_pairs, sizeof *ad->pairs);
        ad->data = calloc(ad->n_floats ? ad->n_floats : 1, sizeof *ad->data);
    }
    if (!ad || !ad->pairs || !ad->data) {
        lora_free(ad);
        return fu_errorf(FU_ERR_NOMEM, "lora: out of memory for %d blocks", last - first);
    }
    ad->cfg = *cfg;
    ad->shape = *s;
    ad->first = first;
    ad->last = last;
    float *p = ad->data;
    for (size_t i = 0; i < n_pairs; i++) {
        lora_target t = (lora_target)(i % LORA_N_TARGETS);
        if (!(cfg->targets & LORA_TARGET_BIT(t))) continue;
        int in, o;
        lora_target_dims(s, t, &in, &o);
        ad->pairs[i].a = p;
        p += (size_t)cfg->r * (size_t)in;
        ad->pairs[i].b = p;
        p += (size_t)o * (size_t)cfg->r;
    }
    *out = ad;
    return FU_OK;
}

void lora_free(lora_adapter *ad) {
    if (!ad) return;
    if (ad->dev && ad->dev != ad->data) op_buffer_free(ad->dev_be, ad->dev);
    free(ad->pairs);
    free(ad->data);
    free(ad);
}

int lora_upload(lora_adapter *ad, op_backend *be) {
    const size_t bytes = ad->n_floats * sizeof(float);
    if (ad->dev_be && ad->dev_be != be)
        return fu_errorf(FU_ERR_INVALID, "lora: the adapter is already on the %s backend", op_backend_name(ad->dev_be));
    if (ad->dev) return ad->dev == ad->data ? FU_OK : op_buffer_set(be, ad->dev, ad->data, bytes);
    op_tensor host = op_tensor_1d(OP_TYPE_F32, ad->data, (int64_t)ad->n_floats), out;
    int rc = op_tensor_upload(be, &host, &out);
    if (rc < 0) return rc;
    ad->dev = out.data;
    ad->dev_be = be;
    return FU_OK;
}

/* splitmix64: the generator of every random value here. */
static uint64_t lora_rng_next(uint64_t *s) {
    uint64_t z = (*s += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}

/* uniform(-bound, bound) */
static float lora_rng_uniform(uint64_t *s, float bound) {
    double u = (double)(lora_rng_next(s) >> 11) * (1.0 / 9007199254740992.0); /* [0, 1) */
    return (float)((2.0 * u - 1.0) * bound);
}

/* The generator state of one (block, target, matrix), independent of the span held. */
static uint64_t lora_rng_seed(uint64_t seed, int block, int t, int is_b) {
    uint64_t s = seed ^ 0x6c6f7261ULL; /* "lora" */
    uint64_t key = ((uint64_t)block << 8) | ((uint64_t)t << 1) | (uint64_t)is_b;
    s += key * 0xd1b54a32d192ed03ULL;
    lora_rng_next(&s);
    return s;
}

/* Fills every A (is_b 0) with uniform(-1/sqrt(in), 1/sqrt(in)), or every B (is_b 1)
 * with uniform(-b_bound, b_bound). */
static void lora_fill(lora_adapter *ad, uint64_t seed, int is_b, float b_bound) {
    for (int blk = ad->first; blk < ad->last; blk++)
        for (int t = 0; t < LORA_N_TARGETS; t++) {
            lora_pair *p = lora_at(ad, blk, (lora_target)t);
            if (!p->a) continue;
            int in, out;
            lora_target_dims(&ad->shape, (lora_target)t, &in, &out);
            uint64_t s = lora_rng_seed(seed, blk, t, is_b);
            size_t n = (size_t)ad->cfg.r * (size_t)(is_b ? out : in);
            float bound = is_b ? b_bound : 1.0f / sqrtf((float)in);
            float *x = is_b ? p->b : p->a;
            for (size_t i = 0; i < n; i++) x[i] = lora_rng_uniform(&s, bound);
        }
}

int lora_new(const lora_config *cfg, const mdl_config *m, int first, int last, uint64_t seed,
             lora_adapter **out) {
    lora_shape s = lora_shape_of(m);
    int rc = lora_alloc(cfg, &s, first, last, out);
    if (rc) return rc;
    lora_fill(*out, seed, 0, 0.0f); /* kaiming_uniform(a = sqrt(5)): bound 1 / sqrt(in); B = 0 */
    (*out)->qk_interleaved = m->rope_mode == OP_ROPE_NORM;
    return FU_OK;
}

/* Permutes the rows of b (heads x hd rows of r floats) from PEFT's order to
 * the interleaved one (to_interleaved) or back: within a head, PEFT's row
 * j * hd/2 + i is interleaved row 2i + j. */
static void lora_permute_rows(float *b, int heads, int hd, int r, bool to_interleaved, float *tmp) {
    const size_t row = (size_t)r * sizeof *b;
    for (int h = 0; h < heads; h++) {
        float *head = b + (size_t)h * (size_t)hd * (size_t)r;
        memcpy(tmp, head, (size_t)hd * row);
        for (int i = 0; i < hd / 2; i++)
            for (int j = 0; j < 2; j++) {
                size_t peft = (size_t)(j * (hd / 2) + i), inter = (size_t)(2 * i + j);
                memcpy(head + (to_interleaved ? inter : peft) * (size_t)r,
                       tmp + (to_interleaved ? peft : inter) * (size_t)r, row);
            }
    }
}

int lora_set_qk_order(lora_adapter *ad, bool interleaved) {
    if (ad->qk_interleaved == interleaved) return FU_OK;
    const lora_shape *s = &ad->shape;
    float *tmp = malloc((size_t)s->head_dim * (size_t)ad->cfg.r * sizeof *tmp);
    if (!tmp) return fu_errorf(FU_ERR_NOMEM, "lora: q/k row order");
    for (int blk = ad->first; blk < ad->last; blk++)
        for (int t = LORA_TARGET_Q; t <= LORA_TARGET_K; t++) {
            const lora_pair *p = lora_at(ad, blk, (lora_target)t);
            if (p->b)
                lora_permute_rows(p->b, t == LORA_TARGET_Q ? s->n_heads : s->n_kv_heads, s->head_dim, ad->cfg.r,
                                  interleaved, tmp);
        }
    free(tmp);
    ad->qk_interleaved = interleaved;
    return FU_OK;
}

void lora_randomize_b(lora_adapter *ad, uint64_t seed, float bound) { lora_fill(ad, seed, 1, bound); }

int lora_merge_span(lora_adapter *whole, const lora_adapter *span) {
    if (whole->cfg.r != span->cfg.r || whole->cfg.targets != span->cfg.targets ||
        memcmp(&whole->shape, &span->shape, sizeof whole->shape) != 0)
        return fu_errorf(FU_ERR_INVALID,
                         "lora: span adapter (r %d, targets 0x%x) does not match the whole "
                         "adapter (r %d, targets 0x%x) or its model shape",
                         span->cfg.r, span->cfg.targets, whole->cfg.r, whole->cfg.targets);
    if (whole->qk_interleaved != span->qk_interleaved)
        return fu_errorf(FU_ERR_INVALID, "lora: span adapter and whole adapter hold q/k rows in different orders");
    if (span->first < whole->first || span->last > whole->last)
        return fu_errorf(FU_ERR_INVALID, "lora: span [%d, %d) is not inside the adapter's [%d, %d)",
                         span->first, span->last, whole->first, whole->last);
    /* both buffers hold their blocks back to back, each block laid out alike */
    size_t per_block = lora_block_floats(&whole->cfg, &whole->shape);
    memcpy(whole->data + (size_t)(span->first - whole->first) * per_block, span->data,
           span->n_floats * sizeof *span->data);
    return FU_OK;
}

/* ---- adapter_config.json ---------------------------------------------------------- */

/* target_modules: a list of PEFT names, or "all-linear". */
static int lora_read_targets(const json_t *v, const char *path, uint32_t *out) {
    *out = 0;
    if (json_is_string(v) && strcmp(json_string_value(v), "all-linear") == 0) {
        *out = LORA_TARGETS_ALL;
        return FU_OK;
    }
    if (!json_is_array(v) || json_array_size(v) == 0)
        return fu_errorf(FU_ERR_UNSUPPORTED,
                         "%s: \"target_modules\" must be a non-empty list of names or "
                         "\"all-linear\" (patterns are not supported)", path);
    size_t i;
    const json_t *e;
    json_array_foreach(v, i, e) {
        lora_target t;
        if (!json_is_string(e) || lora_target_parse(json_string_value(e), &t) != FU_OK)
            return fu_errorf(FU_ERR_UNSUPPORTED,
                             "%s: \"target_modules\"[%zu]: unknown target '%s' (known: q_proj "
                             "k_proj v_proj o_proj gate_proj up_proj down_proj)",
                             path, i, json_is_string(e) ? json_string_value(e) : "(not a string)");
        *out |= LORA_TARGET_BIT(t);
    }
    return FU_OK;
}

/* Refuses the PEFT options fusion does not implement. */
static int lora_check_unsupported(const json_t *root, const char *path) {
    const json_t *bias = json_object_get(root, "bias");
    if (bias && !(json_is_string(bias) && strcmp(json_string_value(bias), "none") == 0))
        return fu_errorf(FU_ERR_UNSUPPORTED, "%s: \"bias\" must be \"none\" (got %s)", path,
                         json_is_string(bias) ? json_string_value(bias) : "a non-string");
    static const char *const off[] = {"use_dora", "fan_in_fan_out"};
    for (size_t i = 0; i < sizeof off / sizeof off[0]; i++)
        if (json_is_true(json_object_get(root, off[i])))
            return fu_errorf(FU_ERR_UNSUPPORTED, "%s: \"%s\" is not supported", path, off[i]);
    static const char *const empty[] = {"rank_pattern", "alpha_pattern", "layers_to_transform",
                                        "modules_to_save", "layer_replication"};
    for (size_t i = 0; i < sizeof empty / sizeof empty[0]; i++) {
        const json_t *v = json_object_get(root, empty[i]);
        if (v && !json_is_null(v) && !((json_is_object(v) && json_object_size(v) == 0) ||
                                       (json_is_array(v) && json_array_size(v) == 0)))
            return fu_errorf(FU_ERR_UNSUPPORTED, "%s: \"%s\" is not supported", path, empty[i]);
    }
    return FU_OK;
}

/* r, lora_alpha, lora_dropout, use_rslora, base_model_name_or_path. */
static int lora_read_numbers(const json_t *root, const char *path, int max_rank, lora_config *c) {
    const json_t *r = json_object_get(root, "r"), *alpha = json_object_get(root, "lora_alpha");
    const json_t *drop = json_object_get(root, "lora_dropout");
    const json_t *rs = json_object_get(root, "use_rslora");
    const json_t *base = json_object_get(root, "base_model_name_or_path");
    if (!json_is_integer(r) || json_integer_value(r) < 1 || json_integer_value(r) > max_rank)
        return fu_errorf(FU_ERR_FORMAT, "%s: \"r\" must be an integer in [1, %d]", path, max_rank);
    if (!json_is_number(alpha) || !isfinite(json_number_value(alpha)))
        return fu_errorf(FU_ERR_FORMAT, "%s: \"lora_alpha\" must be a finite number", path);
    if (drop && !json_is_null(drop) && !json_is_number(drop))
        return fu_errorf(FU_ERR_FORMAT, "%s: \"lora_dropout\" must be a number", path);
    if (rs && !json_is_boolean(rs))
        return fu_errorf(FU_ERR_FORMAT, "%s: \"use_rslora\" must be true or false", path);
    if (base && !json_is_null(base) &&
        (!json_is_string(base) || json_string_length(base) >= sizeof c->base_model))
        return fu_errorf(FU_ERR_FORMAT, "%s: \"base_model_name_or_path\" must be a string of "
                         "fewer than %d bytes", path, LORA_MAX_NAME);
    c->r = (int)json_integer_value(r);
    c->alpha = (float)json_number_value(alpha);
    c->dropout = drop ? (float)json_number_value(drop) : 0.0f;
    c->use_rslora = json_is_true(rs);
    if (json_is_string(base)) snprintf(c->base_model, sizeof c->base_model, "%s", json_string_value(base));
    return FU_OK;
}

/* Reads and checks DIR/adapter_config.json into *c. */
static int lora_read_config(const char *path, int max_rank, lora_config *c) {
    char *text;
    size_t len;
    int rc = mf_read(path, LORA_CONFIG_MAX, &text, &len);
    if (rc) return rc;
    json_error_t err;
    json_t *root = json_loadb(text, len, 0, &err);
    free(text);
    if (!json_is_object(root)) {
        json_decref(root);
        return fu_errorf(FU_ERR_FORMAT, "%s:%d: not a JSON object (%s)", path, err.line, err.text);
    }
    memset(c, 0, sizeof *c);
    const json_t *type = json_object_get(root, "peft_type");
    if (!json_is_string(type) || strcmp(json_string_value(type), "LORA") != 0)
        rc = fu_errorf(FU_ERR_UNSUPPORTED, "%s: \"peft_type\" must be \"LORA\"", path);
    if (!rc) rc = lora_check_unsupported(root, path);
    if (!rc) rc = lora_read_numbers(root, path, max_rank, c);
    if (!rc) rc = lora_read_targets(json_object_get(root, "target_modules"), path, &c->targets);
    if (!rc && lora_config_check(c))
        rc = fu_errorf(FU_ERR_FORMAT, "%s: %s", path, fu_last_error());
    json_decref(root);
    return rc;
}

/* The adapter_config.json PEFT writes for cfg (a new reference). */
static json_t *lora_config_json(const lora_config *c) {
    json_t *targets = json_array();
    for (int t = 0; targets && t < LORA_N_TARGETS; t++)
        if (c->targets & LORA_TARGET_BIT(t)) json_array_append_new(targets, json_string(lora_names[t]));
    json_t *alpha = c->alpha == floorf(c->alpha) && fabsf(c->alpha) < 1e9f
                        ? json_integer((json_int_t)c->alpha)
                        : json_real(c->alpha);
    json_t *base = c->base_model[0] ? json_string(c->base_model) : json_null();
    return json_pack("{s:o,s:s,s:b,s:f,s:o,s:s,s:i,s:o,s:s,s:b,s:b}", "base_model_name_or_path",
                     base, "bias", "none", "fan_in_fan_out", 0, "lora_dropout", (double)c->dropout,
                     "lora_alpha", alpha, "peft_type", "LORA", "r", c->r, "target_modules",
                     targets, "task_type", "CAUSAL_LM", "use_dora", 0, "use_rslora",
                     (int)c->use_rslora);
}

/* ---- adapter_model.safetensors ------------------------------------------------------- */

/* A tensor name parsed: block, target and matrix (0: lora_A, 1: lora_B). */
typedef struct lora_key {
    int block;
    lora_target target;
    int is_b;
} lora_key;

/* Parses "base_model.model.model.layers.N.PARENT.TARGET.lora_X[.default].weight".
 * FU_ERR_NOT_FOUND if the name is not of that form. */
static int lora_parse_name(const char *name, lora_key *k) {
    size_t pl = strlen(LORA_PREFIX);
    if (strncmp(name, LORA_PREFIX, pl) != 0) return FU_ERR_NOT_FOUND;
    const char *p = name + pl;
    long block = 0;
    if (*p < '0' || *p > '9' || (p[0] == '0' && p[1] != '.')) return FU_ERR_NOT_FOUND;
    for (; *p >= '0' && *p <= '9'; p++) {
        block = block * 10 + (*p - '0');
        if (block > 1000000) return FU_ERR_NOT_FOUND;
    }
    char want[128];
    for (int t = 0; t < LORA_N_TARGETS; t++)
        for (int i = 0; i < 4; i++) {
            snprintf(want, sizeof want, ".%s.%s.lora_%c%s.weight", lora_target_parent((lora_target)t),
                     lora_names[t], i & 1 ? 'B' : 'A', i & 2 ? ".default" : "");
            if (strcmp(p, want) == 0) {
                *k = (lora_key){(int)block, (lora_target)t, i & 1};
                return FU_OK;
            }
        }
    return FU_ERR_NOT_FOUND;
}

/* Converts n elements of `dtype` at src (any alignment) into dst, checking they are finite. */
static int lora_convert(const st_tensor_info *ti, float *dst, size_t n, const char *path) {
    const uint8_t *src = ti->data;
    int f32 = strcmp(ti->dtype, "F32") == 0, bf16 = strcmp(ti->dtype, "BF16") == 0;
    for (size_t i = 0; i < n; i++) {
        if (f32) {
            memcpy(&dst[i], src + 4 * i, 4);
        } else {
            uint16_t h;
            memcpy(&h, src + 2 * i, 2);
            dst[i] = bf16 ? op_bf16_to_f32(h) : op_f16_to_f32(h);
        }
        if (!isfinite(dst[i]))
            return fu_errorf(FU_ERR_FORMAT, "%s: tensor '%s': element %zu is not finite", path,
                             ti->name, i);
    }
    return FU_OK;
}

/* Checks dtype and shape of tensor ti, which holds key k. */
static int lora_check_tensor(const lora_adapter *ad, const st_tensor_info *ti, const lora_key *k,
                             const char *path) {
    if (strcmp(ti->dtype, "F32") && strcmp(ti->dtype, "BF16") && strcmp(ti->dtype, "F16"))
        return fu_errorf(FU_ERR_UNSUPPORTED, "%s: tensor '%s': dtype %s (F32, BF16 or F16 expected)",
                         path, ti->name, ti->dtype);
    int in, out;
    lora_target_dims(&ad->shape, k->target, &in, &out);
    int64_t want0 = k->is_b ? out : ad->cfg.r, want1 = k->is_b ? ad->cfg.r : in;
    if (ti->rank != 2 || ti->shape[0] != want0 || ti->shape[1] != want1) {
        char got[64] = "";
        for (int d = 0, o = 0; d < ti->rank && o < (int)sizeof got - 24; d++)
            o += snprintf(got + o, sizeof got - (size_t)o, "%s%" PRId64, d ? ", " : "", ti->shape[d]);
        return fu_errorf(FU_ERR_FORMAT, "%s: tensor '%s': shape [%s], expected [%" PRId64 ", %" PRId64 "]",
                         path, ti->name, got, want0, want1);
    }
    return FU_OK;
}

/* Checks tensor i of the file and, when its block is held, converts it into ad. seen
 * marks each (block, target, matrix) found. */
static int lora_take_tensor(lora_adapter *ad, const st_model *st, int64_t i, uint8_t *seen,
                            const char *path) {
    st_tensor_info ti;
    lora_key k;
    st_model_tensor_info(st, i, &ti);
    if (lora_parse_name(ti.name, &k) != FU_OK)
        return fu_errorf(FU_ERR_FORMAT, "%s: tensor '%s': not a LoRA weight of a Llama block "
                         "(" LORA_PREFIX "N.self_attn|mlp.TARGET.lora_A|lora_B.weight)", path, ti.name);
    if (k.block >= ad->shape.n_layers)
        return fu_errorf(FU_ERR_FORMAT, "%s: tensor '%s': block %d, but the model has %d blocks",
                         path, ti.name, k.block, ad->shape.n_layers);
    if (!(ad->cfg.targets & LORA_TARGET_BIT(k.target)))
        return fu_errorf(FU_ERR_FORMAT, "%s: tensor '%s': %s is not in target_modules", path,
                         ti.name, lora_names[k.target]);
    size_t slot = ((size_t)k.block * LORA_N_TARGETS + k.target) * 2 + (size_t)k.is_b;
    if (seen[slot]++)
        return fu_errorf(FU_ERR_FORMAT, "%s: tensor '%s': given twice (with and without "
                         "\".default\")", path, ti.name);
    int rc = lora_check_tensor(ad, &ti, &k, path);
    if (rc || k.block < ad->first || k.block >= ad->last) return rc;
    lora_pair *p = lora_at(ad, k.block, k.target);
    return lora_convert(&ti, k.is_b ? p->b : p->a, (size_t)(ti.shape[0] * ti.shape[1]), path);
}

/* The first (block, target, matrix) of cfg's targets not marked in seen, as a tensor name. */
static int lora_check_missing(const lora_adapter *ad, const uint8_t *seen, const char *path) {
    for (int blk = 0; blk < ad->shape.n_layers; blk++)
        for (int t = 0; t < LORA_N_TARGETS; t++)
            for (int m = 0; m < 2 && (ad->cfg.targets & LORA_TARGET_BIT(t)); m++)
                if (!seen[((size_t)blk * LORA_N_TARGETS + (size_t)t) * 2 + (size_t)m])
                    return fu_errorf(FU_ERR_FORMAT, "%s: tensor '" LORA_PREFIX "%d.%s.%s.lora_%c.weight' "
                                     "is missing", path, blk, lora_target_parent((lora_target)t),
                                     lora_names[t], m ? 'B' : 'A');
    return FU_OK;
}

/* Reads every tensor of the file at `path` into ad (its held blocks). */
static int lora_read_tensors(lora_adapter *ad, const char *path) {
    struct stat sb;
    if (stat(path, &sb) != 0)
        return fu_errorf(errno == ENOENT ? FU_ERR_NOT_FOUND : FU_ERR_IO, "%s: %s", path, strerror(errno));
    if (!S_ISREG(sb.st_mode)) return fu_errorf(FU_ERR_IO, "%s: not a regular file", path);
    st_model *st;
    int rc = st_model_open(path, &st);
    if (rc) return rc;
    uint8_t *seen = calloc((size_t)ad->shape.n_layers * LORA_N_TARGETS * 2, 1);
    if (!seen) rc = fu_errorf(FU_ERR_NOMEM, "out of memory");
    for (int64_t i = 0; rc == FU_OK && i < st_model_n_tensors(st); i++)
        rc = lora_take_tensor(ad, st, i, seen, path);
    if (rc == FU_OK) rc = lora_check_missing(ad, seen, path);
    free(seen);
    st_model_close(st);
    return rc;
}

static char *lora_join(const char *dir, const char *name) {
    size_t n = strlen(dir) + strlen(name) + 2;
    char *p = malloc(n);
    if (p) snprintf(p, n, "%s/%s", dir, name);
    return p;
}

int lora_load(const char *dir, const mdl_config *m, int first, int last, int max_rank,
              lora_adapter **out) {
    *out = NULL;
    char *cpath = lora_join(dir, LORA_CONFIG_FILE), *wpath = lora_join(dir, LORA_WEIGHTS_FILE);
    lora_config cfg;
    lora_shape s = lora_shape_of(m);
    int rc = cpath && wpath ? FU_OK : fu_errorf(FU_ERR_NOMEM, "out of memory");
    if (!rc) rc = lora_read_config(cpath, max_rank, &cfg);
    if (!rc) rc = lora_alloc(&cfg, &s, first, last < 0 ? s.n_layers : last, out);
    if (!rc) rc = lora_read_tensors(*out, wpath);
    if (!rc) rc = lora_set_qk_order(*out, m->rope_mode == OP_ROPE_NORM);
    if (rc) {
        lora_free(*out);
        *out = NULL;
    }
    free(cpath);
    free(wpath);
    return rc;
}

/* ---- saving ---------------------------------------------------------------------------- */

int lora_foreach(const lora_adapter *ad, int (*fn)(const lora_matrix *m, void *user), void *user) {
    char name[160];
    for (int blk = ad->first; blk < ad->last; blk++)
        for (int t = 0; t < LORA_N_TARGETS; t++) {
            const lora_pair *p = lora_at(ad, blk, (lora_target)t);
            int in, out;
            if (!p->a) continue;
            lora_target_dims(&ad->shape, (lora_target)t, &in, &out);
            for (int mtx = 0; mtx < 2; mtx++) {
                snprintf(name, sizeof name, LORA_PREFIX "%d.%s.%s.lora_%c.weight", blk,
                         lora_target_parent((lora_target)t), lora_names[t], mtx ? 'B' : 'A');
                lora_matrix m = {blk, (lora_target)t, mtx, name, mtx ? p->b : p->a,
                                 mtx ? out : ad->cfg.r, mtx ? ad->cfg.r : in};
                int rc = fn(&m, user);
                if (rc) return rc;
            }
        }
    return 0;
}

/* The held tensors of ad as st_write() takes them, in lora_foreach() order. */
typedef struct lora_file_tensors {
    st_write_tensor *ts;
    char (*names)[160];
    int64_t (*shapes)[2];
    size_t n;
} lora_file_tensors;

static int lora_file_tensor_add(const lora_matrix *m, void *user) {
    lora_file_tensors *f = user;
    snprintf(f->names[f->n], sizeof f->names[f->n], "%s", m->name);
    f->shapes[f->n][0] = m->rows;
    f->shapes[f->n][1] = m->cols;
    f->ts[f->n] = (st_write_tensor){f->names[f->n], "F32", 2, f->shapes[f->n], m->data};
    f->n++;
    return 0;
}

static int lora_file_tensors_make(const lora_adapter *ad, lora_file_tensors *f) {
    size_t cap = (size_t)(ad->last - ad->first) * LORA_N_TARGETS * 2 + 1;
    f->ts = calloc(cap, sizeof *f->ts);
    f->names = calloc(cap, sizeof *f->names);
    f->shapes = calloc(cap, sizeof *f->shapes);
    f->n = 0;
    if (!f->ts || !f->names || !f->shapes) return fu_errorf(FU_ERR_NOMEM, "out of memory");
    return lora_foreach(ad, lora_file_tensor_add, f);
}

static void lora_file_tensors_free(lora_file_tensors *f) {
    free(f->ts);
    free(f->names);
    free(f->shapes);
}

static int lora_save_peft_order(const lora_adapter *ad, const char *dir);

int lora_save(const lora_adapter *ad, const char *dir) {
    if (!ad->qk_interleaved) return lora_save_peft_order(ad, dir);
    lora_adapter *copy = NULL;
    int rc = lora_alloc(&ad->cfg, &ad->shape, ad->first, ad->last, &copy);
    if (rc) return rc;
    memcpy(copy->data, ad->data, ad->n_floats * sizeof *ad->data);
    copy->qk_interleaved = true;
    if (!(rc = lora_set_qk_order(copy, false))) rc = lora_save_peft_order(copy, dir);
    lora_free(copy);
    return rc;
}

/* lora_save() of an adapter in PEFT's row order. */
static int lora_save_peft_order(const lora_adapter *ad, const char *dir) {
    lora_file_tensors f;
    char *cpath = lora_join(dir, LORA_CONFIG_FILE), *wpath = lora_join(dir, LORA_WEIGHTS_FILE);
    json_t *cj = lora_config_json(&ad->cfg);
    char *ctext = cj ? json_dumps(cj, JSON_INDENT(2) | JSON_PRESERVE_ORDER | JSON_REAL_PRECISION(7)) : NULL;
    int rc = lora_file_tensors_make(ad, &f);
    if (!rc && !(cpath && wpath && ctext)) rc = fu_errorf(FU_ERR_NOMEM, "out of memory");
    if (!rc) rc = st_write(wpath, f.ts, f.n);
    af_piece cp[2] = {{ctext, ctext ? strlen(ctext) : 0}, {"\n", 1}};
    if (!rc) rc = af_write(cpath, cp, 2);
    free(ctext);
    json_decref(cj);
    free(cpath);
    free(wpath);
    lora_file_tensors_free(&f);
    return rc;
}
