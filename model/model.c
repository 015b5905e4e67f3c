/* model.c -- model configuration and span weights from HF safetensors, GGUF or random numbers. */
#include "model.h"

#include <dirent.h>
#include <errno.h>
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "gguf.h"
#include "log.h"
#include "mapped-file.h"
#include "safetensors.h"
#include "status.h"

/* Largest config.json read (real ones are a few KiB). */
#define MDL_CONFIG_MAX (16u << 20)

/* What a model owns besides its struct: the open sources and converted copies. */
typedef struct mdl_impl {
    gguf_file *gguf;
    st_model *st;
    void **bufs;   /* owned allocations (f32 norms, random weights) */
    size_t n_bufs, cap_bufs;
} mdl_impl;

static const char *const mdl_arch_names[] = {"llama", "mistral", "qwen2", "qwen3"};

const char *mdl_arch_name(mdl_arch arch) {
    return (unsigned)arch < sizeof mdl_arch_names / sizeof mdl_arch_names[0] ? mdl_arch_names[arch]
                                                                             : "unknown";
}

mdl_open_options mdl_open_options_all(void) {
    mdl_open_options o = {.first = 0, .last = -1, .embed = true, .head = true};
    return o;
}

/* Takes ownership of p (freed with the model); returns p or NULL on OOM (p freed). */
static void *mdl_own(mdl_model *m, void *p) {
    mdl_impl *impl = m->impl;
    if (!p) return NULL;
    if (impl->n_bufs == impl->cap_bufs) {
        size_t cap = impl->cap_bufs ? impl->cap_bufs * 2 : 64;
        void **nb = realloc(impl->bufs, cap * sizeof *nb);
        if (!nb) {
            free(p);
            return NULL;
        }
        impl->bufs = nb;
        impl->cap_bufs = cap;
    }
    impl->bufs[impl->n_bufs++] = p;
    return p;
}

/* ---- rope frequencies ---------------------------------------------------- */

/* Fills m->inv_freq (rot_dim / 2) from the config; `factors` (may be NULL) are
 * GGUF rope_freqs divisors (Llama 3 scaling stored in the file). */
static int mdl_rope_init(mdl_model *m, const float *factors) {
    const mdl_config *c = &m->cfg;
    int half = m->rot_dim / 2;
    float *f = mdl_own(m, malloc((size_t)half * sizeof *f));
    if (!f) return fu_errorf(FU_ERR_NOMEM, "rope table");
    for (int i = 0; i < half; i++) {
        /* as Hugging Face computes it: in float32, 1 / base ** (2i / d) */
        float exponent = (float)(2 * i) / (float)m->rot_dim;
        float inv = 1.0f / powf(c->rope_theta, exponent);
        if (factors) {
            inv /= factors[i];
        } else if (c->rope_scaling == MDL_ROPE_SCALING_LINEAR) {
            inv /= c->rope_factor;
        } else if (c->rope_scaling == MDL_ROPE_SCALING_LLAMA3) {
            float low_wavelen = (float)c->rope_orig_max_pos / c->rope_low_freq_factor;
            float high_wavelen = (float)c->rope_orig_max_pos / c->rope_high_freq_factor;
            float wavelen = 2.0f * (float)M_PI / inv;
            if (wavelen > low_wavelen) {
                inv = inv / c->rope_factor;
            } else if (wavelen >= high_wavelen) {
                float smooth = ((float)c->rope_orig_max_pos / wavelen - c->rope_low_freq_factor) /
                               (c->rope_high_freq_factor - c->rope_low_freq_factor);
                inv = (1.0f - smooth) * inv / c->rope_factor + smooth * inv;
            }
        }
        f[i] = inv;
    }
    m->inv_freq = f;
    return FU_OK;
}

/* ---- config validation ----------------------------------------------------- */

/* Range checks of one hyper-parameter: `key` is the name in the source
 * (config.json key or GGUF metadata key) so the message names it. */
static int mdl_check_int(const char *path, const char *pre, const char *key, int v, int lo, int hi) {
    if (v < lo || v > hi)
        return fu_errorf(FU_ERR_FORMAT, "%s: %s%s = %d outside [%d, %d]", path, pre, key, v, lo, hi);
    return FU_OK;
}

/* A float must be finite and in (lo, hi) (exclusive bounds). */
static int mdl_check_float(const char *path, const char *pre, const char *key, float v, float lo, float hi) {
    if (!isfinite(v) || !(v > lo) || !(v < hi))
        return fu_errorf(FU_ERR_FORMAT, "%s: %s%s = %g must be finite and in (%g, %g)", path, pre, key, (double)v,
                         (double)lo, (double)hi);
    return FU_OK;
}

/* Names of the hyper-parameters in one source, for messages. */
typedef struct mdl_keys {
    const char *n_layers, *dim, *ffn_dim, *n_heads, *n_kv_heads, *head_dim, *vocab_size, *max_seq_len,
        *norm_eps, *rope_theta, *rope_factor, *rope_low, *rope_high, *rope_orig;
} mdl_keys;

static const mdl_keys mdl_keys_hf = {
    "num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
    "head_dim", "vocab_size", "max_position_embeddings", "rms_norm_eps", "rope_theta", "rope_scaling.factor",
    "rope_scaling.low_freq_factor", "rope_scaling.high_freq_factor",
    "rope_scaling.original_max_position_embeddings",
};

static const mdl_keys mdl_keys_gguf = {
    "block_count", "embedding_length", "feed_forward_length", "attention.head_count",
    "attention.head_count_kv", "attention.key_length", "vocab_size", "context_length",
    "attention.layer_norm_rms_epsilon", "rope.freq_base", "rope.scaling.factor", "-", "-", "-",
};

/* Every hyper-parameter finite, positive, in a sensible range and consistent
 * with the others; the message names the offending key (`pre` + its name). */
static int mdl_config_check_keys(const mdl_config *c, const char *path, const char *pre, const mdl_keys *k) {
    int rc;
    if ((rc = mdl_check_int(path, pre, k->n_layers, c->n_layers, 1, 4096)) ||
        (rc = mdl_check_int(path, pre, k->dim, c->dim, 1, 1 << 20)) ||
        (rc = mdl_check_int(path, pre, k->ffn_dim, c->ffn_dim, 1, 1 << 22)) ||
        (rc = mdl_check_int(path, pre, k->n_heads, c->n_heads, 1, 4096)) ||
        (rc = mdl_check_int(path, pre, k->n_kv_heads, c->n_kv_heads, 1, c->n_heads)) ||
        (rc = mdl_check_int(path, pre, k->head_dim, c->head_dim, 2, 4096)) ||
        (rc = mdl_check_int(path, pre, k->vocab_size, c->vocab_size, 1, 1 << 24)) ||
        (rc = mdl_check_int(path, pre, k->max_seq_len, c->max_seq_len, 1, 1 << 24)) ||
        (rc = mdl_check_float(path, pre, k->norm_eps, c->norm_eps, 0.0f, 1.0f)) ||
        (rc = mdl_check_float(path, pre, k->rope_theta, c->rope_theta, 0.0f, 1e12f)))
        return rc;
    if (c->n_heads % c->n_kv_heads)
        return fu_errorf(FU_ERR_FORMAT, "%s: %s%s = %d is not a multiple of %s%s = %d", path, pre, k->n_heads,
                         c->n_heads, pre, k->n_kv_heads, c->n_kv_heads);
    if (c->head_dim % 2)
        return fu_errorf(FU_ERR_FORMAT, "%s: %s%s = %d must be even (rotary pairs)", path, pre, k->head_dim,
                         c->head_dim);
    if ((int64_t)c->n_heads * c->head_dim > (1 << 20))
        return fu_errorf(FU_ERR_FORMAT, "%s: %s%s x %s%s = %lld is too large", path, pre, k->n_heads, pre,
                         k->head_dim, (long long)c->n_heads * c->head_dim);
    if (c->rope_scaling != MDL_ROPE_SCALING_NONE && (rc = mdl_check_float(path, pre, k->rope_factor, c->rope_factor,
                                                                          0.0f, 1e6f)))
        return rc;
    if (c->rope_scaling == MDL_ROPE_SCALING_LLAMA3) {
        if ((rc = mdl_check_float(path, pre, k->rope_low, c->rope_low_freq_factor, 0.0f, 1e6f)) ||
            (rc = mdl_check_float(path, pre, k->rope_high, c->rope_high_freq_factor, 0.0f, 1e6f)) ||
            (rc = mdl_check_int(path, pre, k->rope_orig, c->rope_orig_max_pos, 1, 1 << 24)))
            return rc;
        if (!(c->rope_high_freq_factor > c->rope_low_freq_factor))
            return fu_errorf(FU_ERR_FORMAT, "%s: %s%s must be greater than %s%s", path, pre, k->rope_high, pre,
                             k->rope_low);
    }
    return FU_OK;
}

static int mdl_config_check(const mdl_config *c, const char *name) {
    static const mdl_keys plain = {
        "n_layers", "dim", "ffn_dim", "n_heads", "n_kv_heads", "head_dim", "vocab_size", "max_seq_len",
        "norm_eps", "rope_theta", "rope_factor", "rope_low_freq_factor", "rope_high_freq_factor",
        "rope_orig_max_pos",
    };
    return mdl_config_check_keys(c, name, "", &plain);
}

/* ---- Hugging Face config.json ---------------------------------------------- */

static int json_int(json_t *o, const char *key, int def, int *out, const char *path) {
    json_t *v = json_object_get(o, key);
    if (!v || json_is_null(v)) {
        if (def == INT32_MIN) return fu_errorf(FU_ERR_FORMAT, "%s: missing \"%s\"", path, key);
        *out = def;
        return FU_OK;
    }
    if (!json_is_integer(v) || json_integer_value(v) < INT32_MIN + 1 ||
        json_integer_value(v) > INT32_MAX)
        return fu_errorf(FU_ERR_FORMAT, "%s: \"%s\" must be an integer", path, key);
    *out = (int)json_integer_value(v);
    return FU_OK;
}

static int json_float(json_t *o, const char *key, float def, float *out, const char *path) {
    json_t *v = json_object_get(o, key);
    if (!v || json_is_null(v)) {
        *out = def;
        return FU_OK;
    }
    if (!json_is_number(v)) return fu_errorf(FU_ERR_FORMAT, "%s: \"%s\" must be a number", path, key);
    *out = (float)json_number_value(v);
    return FU_OK;
}

int mdl_config_read_hf(const char *json, size_t len, const char *cfg_path, mdl_config *c) {
    memset(c, 0, sizeof *c);
    json_error_t jerr;
    json_t *root = json_loadb(json, len, JSON_REJECT_DUPLICATES, &jerr);
    if (!root)
        return fu_errorf(FU_ERR_FORMAT, "%s: invalid JSON at line %d: %s", cfg_path, jerr.line,
                         jerr.text);
    int rc = FU_OK;
    if (!json_is_object(root)) {
        rc = fu_errorf(FU_ERR_FORMAT, "%s: not a JSON object", cfg_path);
        goto done;
    }
    json_t *archs = json_object_get(root, "architectures");
    const char *arch = json_string_value(json_array_get(archs, 0));
    const char *model_type = json_string_value(json_object_get(root, "model_type"));
    if (!arch && !model_type) {
        rc = fu_errorf(FU_ERR_FORMAT, "%s: no \"architectures\" or \"model_type\"", cfg_path);
        goto done;
    }
    if ((arch && strcmp(arch, "LlamaForCausalLM") == 0) || (!arch && strcmp(model_type, "llama") == 0))
        c->arch = MDL_ARCH_LLAMA;
    else if ((arch && strcmp(arch, "MistralForCausalLM") == 0) ||
             (!arch && strcmp(model_type, "mistral") == 0))
        c->arch = MDL_ARCH_MISTRAL;
    else if ((arch && strcmp(arch, "Qwen2ForCausalLM") == 0) || (!arch && strcmp(model_type, "qwen2") == 0))
        c->arch = MDL_ARCH_QWEN2;
    else if ((arch && strcmp(arch, "Qwen3ForCausalLM") == 0) || (!arch && strcmp(model_type, "qwen3") == 0))
        c->arch = MDL_ARCH_QWEN3;
    else {
        rc = fu_errorf(FU_ERR_UNSUPPORTED,
                       "%s: unsupported architecture \"%s\" (supported: LlamaForCausalLM, "
                       "MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM)",
                       cfg_path, arch ? arch : model_type);
        goto done;
    }
    if ((rc = json_int(root, "num_hidden_layers", INT32_MIN, &c->n_layers, cfg_path)) ||
        (rc = json_int(root, "hidden_size", INT32_MIN, &c->dim, cfg_path)) ||
        (rc = json_int(root, "intermediate_size", INT32_MIN, &c->ffn_dim, cfg_path)) ||
        (rc = json_int(root, "num_attention_heads", INT32_MIN, &c->n_heads, cfg_path)) ||
        (rc = json_int(root, "num_key_value_heads", c->n_heads, &c->n_kv_heads, cfg_path)) ||
        (rc = json_int(root, "vocab_size", INT32_MIN, &c->vocab_size, cfg_path)) ||
        (rc = json_int(root, "max_position_embeddings", 2048, &c->max_seq_len, cfg_path)) ||
        (rc = json_float(root, "rms_norm_eps", 1e-6f, &c->norm_eps, cfg_path)) ||
        (rc = json_float(root, "rope_theta", 10000.0f, &c->rope_theta, cfg_path)))
        goto done;
    if (c->n_heads <= 0) {
        rc = fu_errorf(FU_ERR_FORMAT, "%s: num_attention_heads must be positive", cfg_path);
        goto done;
    }
    if ((rc = json_int(root, "head_dim", c->dim / c->n_heads, &c->head_dim, cfg_path))) goto done;
    json_t *tie = json_object_get(root, "tie_word_embeddings");
    c->tied_embeddings = tie ? json_is_true(tie) : false;
    c->qkv_bias = c->arch == MDL_ARCH_QWEN2;
    c->qk_norm = c->arch == MDL_ARCH_QWEN3;
    c->rope_mode = OP_ROPE_NEOX;
    if (json_is_true(json_object_get(root, "attention_bias")) && c->arch != MDL_ARCH_QWEN2) {
        rc = fu_errorf(FU_ERR_UNSUPPORTED, "%s: attention_bias=true is not supported", cfg_path);
        goto done;
    }
    if (json_is_true(json_object_get(root, "mlp_bias"))) {
        rc = fu_errorf(FU_ERR_UNSUPPORTED, "%s: mlp_bias=true is not supported", cfg_path);
        goto done;
    }
    const char *act = json_string_value(json_object_get(root, "hidden_act"));
    if (act && strcmp(act, "silu") != 0) {
        rc = fu_errorf(FU_ERR_UNSUPPORTED, "%s: hidden_act \"%s\" (only silu)", cfg_path, act);
        goto done;
    }
    /* A sliding window bounds the context: within it attention is exact. */
    int window = 0;
    json_t *sw = json_object_get(root, "sliding_window");
    bool use_sw = c->arch != MDL_ARCH_QWEN2 && c->arch != MDL_ARCH_QWEN3
                      ? true
                      : json_is_true(json_object_get(root, "use_sliding_window"));
    if (use_sw && json_is_integer(sw)) window = (int)json_integer_value(sw);
    if (window > 0 && window < c->max_seq_len) c->max_seq_len = window;

    json_t *rs = json_object_get(root, "rope_scaling");
    if (rs && json_is_object(rs)) {
        const char *type = json_string_value(json_object_get(rs, "rope_type"));
        if (!type) type = json_string_value(json_object_get(rs, "type"));
        if (!type || strcmp(type, "default") == 0) {
            c->rope_scaling = MDL_ROPE_SCALING_NONE;
        } else if (strcmp(type, "linear") == 0) {
            c->rope_scaling = MDL_ROPE_SCALING_LINEAR;
        } else if (strcmp(type, "llama3") == 0) {
            c->rope_scaling = MDL_ROPE_SCALING_LLAMA3;
        } else {
            rc = fu_errorf(FU_ERR_UNSUPPORTED, "%s: rope_scaling type \"%s\" (supported: linear, llama3)",
                           cfg_path, type);
            goto done;
        }
        if ((rc = json_float(rs, "factor", 1.0f, &c->rope_factor, cfg_path)) ||
            (rc = json_float(rs, "low_freq_factor", 1.0f, &c->rope_low_freq_factor, cfg_path)) ||
            (rc = json_float(rs, "high_freq_factor", 4.0f, &c->rope_high_freq_factor, cfg_path)) ||
            (rc = json_int(rs, "original_max_position_embeddings", 8192, &c->rope_orig_max_pos, cfg_path)))
            goto done;
    } else if (rs && !json_is_null(rs)) {
        rc = fu_errorf(FU_ERR_FORMAT, "%s: rope_scaling must be an object", cfg_path);
        goto done;
    }
    rc = mdl_config_check_keys(c, cfg_path, "", &mdl_keys_hf);
done:
    json_decref(root);
    return rc;
}

/* Reads config.json (a regular file of at most MDL_CONFIG_MAX bytes) into *c. */
static int mdl_config_from_hf(const char *cfg_path, mdl_config *c) {
    char *text;
    size_t len;
    int rc = mf_read(cfg_path, MDL_CONFIG_MAX, &text, &len);
    if (rc) return rc;
    rc = mdl_config_read_hf(text, len, cfg_path, c);
    free(text);
    return rc;
}

/* ---- tensor binding ---------------------------------------------------------- */

/* Checks that t has shape (ne1, ne0) (ne1 = 0 for a vector). */
static int mdl_check_shape(const op_tensor *t, const char *name, int64_t ne0, int64_t ne1,
                           const char *path) {
    bool ok = ne1 ? (t->ndim == 2 && t->ne[0] == ne0 && t->ne[1] == ne1)
                  : (t->ndim == 1 && t->ne[0] == ne0);
    if (!ok) {
        if (ne1)
            return fu_errorf(FU_ERR_FORMAT, "%s: tensor '%s' has shape [%lld, %lld], expected [%lld, %lld]",
                             path, name, (long long)t->ne[1], (long long)t->ne[0], (long long)ne1,
                             (long long)ne0);
        return fu_errorf(FU_ERR_FORMAT, "%s: tensor '%s' has %d dims [%lld...], expected [%lld]", path,
                         name, t->ndim, (long long)t->ne[0], (long long)ne0);
    }
    if (!op_type_is_weight(t->type))
        return fu_errorf(FU_ERR_UNSUPPORTED, "%s: tensor '%s' has unsupported type %s", path, name,
                         op_type_name(t->type));
    return FU_OK;
}

/* Looks `name` up in whichever source the model has. */
static int mdl_find(mdl_model *m, const char *name, op_tensor *out) {
    mdl_impl *impl = m->impl;
    if (impl->st) return st_model_find(impl->st, name, out);
    int64_t i = gguf_find_tensor(impl->gguf, name);
    if (i < 0) return FU_ERR_NOT_FOUND;
    return gguf_tensor_as_op(impl->gguf, i, out);
}

/* Binds a matrix weight (ne1 rows of ne0). */
static int mdl_bind_matrix(mdl_model *m, op_tensor *dst, const char *name, int64_t ne0, int64_t ne1) {
    int rc = mdl_find(m, name, dst);
    if (rc == FU_ERR_NOT_FOUND) return fu_errorf(rc, "%s: missing tensor '%s'", m->path, name);
    if (rc) return rc;
    if ((rc = mdl_check_shape(dst, name, ne0, ne1, m->path))) return rc;
    dst->name = mdl_own(m, strdup(name));
    if (!dst->name) return fu_errorf(FU_ERR_NOMEM, "tensor name");
    return FU_OK;
}

/* Binds a vector as an f32 tensor, converting (copying) unless already f32. */
static int mdl_bind_vector(mdl_model *m, op_tensor *dst, const char *name, int64_t n) {
    op_tensor src;
    int rc = mdl_find(m, name, &src);
    if (rc == FU_ERR_NOT_FOUND) return fu_errorf(rc, "%s: missing tensor '%s'", m->path, name);
    if (rc) return rc;
    if ((rc = mdl_check_shape(&src, name, n, 0, m->path))) return rc;
    if (src.type == OP_TYPE_F32) {
        *dst = src;
    } else {
        float *f = mdl_own(m, malloc((size_t)n * sizeof *f));
        if (!f) return fu_errorf(FU_ERR_NOMEM, "tensor '%s'", name);
        op_dequantize_row(&src, 0, f);
        *dst = op_tensor_1d(OP_TYPE_F32, f, n);
    }
    dst->name = mdl_own(m, strdup(name));
    if (!dst->name) return fu_errorf(FU_ERR_NOMEM, "tensor name");
    return FU_OK;
}

typedef struct mdl_names {
    const char *embed, *out_norm, *lm_head;
    /* per layer, formatted with the block index */
    const char *attn_norm, *wq, *wk, *wv, *wo, *bq, *bk, *bv, *q_norm, *k_norm, *ffn_norm, *w_gate,
        *w_up, *w_down;
} mdl_names;

static const mdl_names mdl_names_hf = {
    "model.embed_tokens.weight", "model.norm.weight", "lm_head.weight",
    "model.layers.%d.input_layernorm.weight", "model.layers.%d.self_attn.q_proj.weight",
    "model.layers.%d.self_attn.k_proj.weight", "model.layers.%d.self_attn.v_proj.weight",
    "model.layers.%d.self_attn.o_proj.weight", "model.layers.%d.self_attn.q_proj.bias",
    "model.layers.%d.self_attn.k_proj.bias", "model.layers.%d.self_attn.v_proj.bias",
    "model.layers.%d.self_attn.q_norm.weight", "model.layers.%d.self_attn.k_norm.weight",
    "model.layers.%d.post_attention_layernorm.weight", "model.layers.%d.mlp.gate_proj.weight",
    "model.layers.%d.mlp.up_proj.weight", "model.layers.%d.mlp.down_proj.weight",
};

static const mdl_names mdl_names_gguf = {
    "token_embd.weight", "output_norm.weight", "output.weight",
    "blk.%d.attn_norm.weight", "blk.%d.attn_q.weight", "blk.%d.attn_k.weight",
    "blk.%d.attn_v.weight", "blk.%d.attn_output.weight", "blk.%d.attn_q.bias",
    "blk.%d.attn_k.bias", "blk.%d.attn_v.bias", "blk.%d.attn_q_norm.weight",
    "blk.%d.attn_k_norm.weight", "blk.%d.ffn_norm.weight", "blk.%d.ffn_gate.weight",
    "blk.%d.ffn_up.weight", "blk.%d.ffn_down.weight",
};

static int mdl_bind_all(mdl_model *m, const mdl_names *nm) {
    const mdl_config *c = &m->cfg;
    const int64_t D = c->dim, F = c->ffn_dim, QD = (int64_t)c->n_heads * c->head_dim,
                  KD = (int64_t)c->n_kv_heads * c->head_dim, V = c->vocab_size;
    int rc;
    char name[256];
    if (m->has_embed || (m->has_head && c->tied_embeddings)) {
        op_tensor embd;
        if ((rc = mdl_bind_matrix(m, &embd, nm->embed, D, V))) return rc;
        if (m->has_embed) m->tok_embd = embd;
        if (m->has_head && c->tied_embeddings) m->lm_head = embd;
    }
    if (m->has_head) {
        if ((rc = mdl_bind_vector(m, &m->out_norm, nm->out_norm, D))) return rc;
        if (!c->tied_embeddings && (rc = mdl_bind_matrix(m, &m->lm_head, nm->lm_head, D, V)))
            return rc;
    }
    for (int l = m->first; l < m->last; l++) {
        mdl_layer *L = &m->layers[l - m->first];
#define MDL_NAME_(fmt) (snprintf(name, sizeof name, (fmt), l), name)
        if ((rc = mdl_bind_vector(m, &L->attn_norm, MDL_NAME_(nm->attn_norm), D)) ||
            (rc = mdl_bind_matrix(m, &L->wq, MDL_NAME_(nm->wq), D, QD)) ||
            (rc = mdl_bind_matrix(m, &L->wk, MDL_NAME_(nm->wk), D, KD)) ||
            (rc = mdl_bind_matrix(m, &L->wv, MDL_NAME_(nm->wv), D, KD)) ||
            (rc = mdl_bind_matrix(m, &L->wo, MDL_NAME_(nm->wo), QD, D)) ||
            (rc = mdl_bind_vector(m, &L->ffn_norm, MDL_NAME_(nm->ffn_norm), D)) ||
            (rc = mdl_bind_matrix(m, &L->w_gate, MDL_NAME_(nm->w_gate), D, F)) ||
            (rc = mdl_bind_matrix(m, &L->w_up, MDL_NAME_(nm->w_up), D, F)) ||
            (rc = mdl_bind_matrix(m, &L->w_down, MDL_NAME_(nm->w_down), F, D)))
            return rc;
        if (c->qkv_bias &&
            ((rc = mdl_bind_vector(m, &L->bq, MDL_NAME_(nm->bq), QD)) ||
             (rc = mdl_bind_vector(m, &L->bk, MDL_NAME_(nm->bk), KD)) ||
             (rc = mdl_bind_vector(m, &L->bv, MDL_NAME_(nm->bv), KD))))
            return rc;
        if (c->qk_norm && ((rc = mdl_bind_vector(m, &L->q_norm, MDL_NAME_(nm->q_norm), c->head_dim)) ||
                           (rc = mdl_bind_vector(m, &L->k_norm, MDL_NAME_(nm->k_norm), c->head_dim))))
            return rc;
#undef MDL_NAME_
    }
    return FU_OK;
}

/* ---- GGUF metadata -------------------------------------------------------------- */

static int gguf_arch_u32(const gguf_file *f, const char *arch, const char *suffix, bool required,
                         uint32_t def, int *out) {
    char key[128];
    snprintf(key, sizeof key, "%s.%s", arch, suffix);
    uint32_t v = def;
    int rc = gguf_get_u32(f, key, &v);
    if (rc == FU_ERR_NOT_FOUND && !required) rc = FU_OK;
    else if (rc == FU_ERR_NOT_FOUND)
        return fu_errorf(FU_ERR_FORMAT, "%s: missing metadata key '%s'", gguf_path(f), key);
    if (rc) return rc;
    if (v > INT32_MAX) return fu_errorf(FU_ERR_FORMAT, "%s: '%s' out of range", gguf_path(f), key);
    *out = (int)v;
    return FU_OK;
}

static int gguf_arch_f32(const gguf_file *f, const char *arch, const char *suffix, float def,
                         float *out) {
    char key[128];
    snprintf(key, sizeof key, "%s.%s", arch, suffix);
    *out = def;
    int rc = gguf_get_f32(f, key, out);
    return rc == FU_ERR_NOT_FOUND ? FU_OK : rc;
}

int mdl_config_read_gguf(const gguf_file *f, mdl_config *c) {
    const char *path = gguf_path(f);
    memset(c, 0, sizeof *c);
    char arch[32];
    const char *s;
    size_t len;
    int rc = gguf_get_str(f, "general.architecture", &s, &len);
    if (rc == FU_ERR_NOT_FOUND) return fu_errorf(FU_ERR_FORMAT, "%s: no general.architecture", path);
    if (rc) return rc;
    if (len >= sizeof arch) len = sizeof arch - 1;
    memcpy(arch, s, len);
    arch[len] = '\0';
    if (strcmp(arch, "llama") == 0) {
        c->arch = MDL_ARCH_LLAMA;
        c->rope_mode = OP_ROPE_NORM; /* convert_hf_to_gguf permutes Q/K rows for this mode */
    } else if (strcmp(arch, "qwen2") == 0) {
        c->arch = MDL_ARCH_QWEN2;
        c->rope_mode = OP_ROPE_NEOX;
        c->qkv_bias = true;
    } else if (strcmp(arch, "qwen3") == 0) {
        c->arch = MDL_ARCH_QWEN3;
        c->rope_mode = OP_ROPE_NEOX;
        c->qk_norm = true;
    } else {
        return fu_errorf(FU_ERR_UNSUPPORTED,
                         "%s: unsupported GGUF architecture \"%s\" (supported: llama, qwen2, qwen3)",
                         path, arch);
    }
    if ((rc = gguf_arch_u32(f, arch, "block_count", true, 0, &c->n_layers)) ||
        (rc = gguf_arch_u32(f, arch, "embedding_length", true, 0, &c->dim)) ||
        (rc = gguf_arch_u32(f, arch, "feed_forward_length", true, 0, &c->ffn_dim)) ||
        (rc = gguf_arch_u32(f, arch, "attention.head_count", true, 0, &c->n_heads)) ||
        (rc = gguf_arch_u32(f, arch, "attention.head_count_kv", false, (uint32_t)c->n_heads,
                            &c->n_kv_heads)) ||
        (rc = gguf_arch_u32(f, arch, "context_length", false, 2048, &c->max_seq_len)) ||
        (rc = gguf_arch_f32(f, arch, "attention.layer_norm_rms_epsilon", 1e-5f, &c->norm_eps)) ||
        (rc = gguf_arch_f32(f, arch, "rope.freq_base", 10000.0f, &c->rope_theta)))
        return rc;
    if (c->n_heads <= 0) return fu_errorf(FU_ERR_FORMAT, "%s: head_count must be positive", path);
    if ((rc = gguf_arch_u32(f, arch, "attention.key_length", false, (uint32_t)(c->dim / c->n_heads),
                            &c->head_dim)))
        return rc;
    int rot = c->head_dim;
    if ((rc = gguf_arch_u32(f, arch, "rope.dimension_count", false, (uint32_t)c->head_dim, &rot)))
        return rc;
    if (rot != c->head_dim)
        return fu_errorf(FU_ERR_UNSUPPORTED, "%s: partial rotary embeddings (%d of %d dims)", path,
                         rot, c->head_dim);
    /* vocabulary: explicit key, else the embedding table's rows */
    int64_t ti = gguf_find_tensor(f, "token_embd.weight");
    if (ti < 0) return fu_errorf(FU_ERR_FORMAT, "%s: missing tensor 'token_embd.weight'", path);
    int64_t rows = gguf_tensor(f, ti)->ne[1];
    if ((rc = gguf_arch_u32(f, arch, "vocab_size", false, rows > INT32_MAX ? 0 : (uint32_t)rows,
                            &c->vocab_size)))
        return rc;
    c->tied_embeddings = gguf_find_tensor(f, "output.weight") < 0;

    char key[128];
    snprintf(key, sizeof key, "%s.rope.scaling.type", arch);
    if (gguf_get_str(f, key, &s, &len) == FU_OK) {
        if (len == 6 && memcmp(s, "linear", 6) == 0) {
            c->rope_scaling = MDL_ROPE_SCALING_LINEAR;
            if ((rc = gguf_arch_f32(f, arch, "rope.scaling.factor", 1.0f, &c->rope_factor))) return rc;
        } else if (!(len == 4 && memcmp(s, "none", 4) == 0)) {
            return fu_errorf(FU_ERR_UNSUPPORTED, "%s: rope scaling type \"%.*s\"", path, (int)len, s);
        }
    }
    char pre[40];
    snprintf(pre, sizeof pre, "%s.", arch);
    return mdl_config_check_keys(c, path, pre, &mdl_keys_gguf);
}

/* ---- opening ---------------------------------------------------------------------- */

static bool mdl_is_dir(const char *p) {
    struct stat st;
    return stat(p, &st) == 0 && S_ISDIR(st.st_mode);
}

static bool mdl_is_file(const char *p) {
    struct stat st;
    return stat(p, &st) == 0 && S_ISREG(st.st_mode);
}

/* If dir holds no config.json but exactly one *.gguf, returns its path (malloc'd). */
static char *mdl_single_gguf(const char *dir) {
    DIR *d = opendir(dir);
    if (!d) return NULL;
    char *found = NULL;
    int count = 0;
    struct dirent *e;
    while ((e = readdir(d))) {
        size_t n = strlen(e->d_name);
        if (n > 5 && strcmp(e->d_name + n - 5, ".gguf") == 0) {
            count++;
            free(found);
            size_t sz = strlen(dir) + n + 2;
            found = malloc(sz);
            if (found) snprintf(found, sz, "%s/%s", dir, e->d_name);
        }
    }
    closedir(d);
    if (count != 1) {
        free(found);
        return NULL;
    }
    return found;
}

static int mdl_alloc(const mdl_config *cfg, const mdl_open_options *opts, const char *path,
                     mdl_model **out) {
    mdl_model *m = calloc(1, sizeof *m);
    if (!m) return fu_errorf(FU_ERR_NOMEM, "model");
    m->impl = calloc(1, sizeof(mdl_impl));
    m->path = strdup(path);
    if (!m->impl || !m->path) {
        mdl_free(m);
        return fu_errorf(FU_ERR_NOMEM, "model");
    }
    const char *base = strrchr(path, '/');
    m->name = strdup(base && base[1] ? base + 1 : path);
    m->cfg = *cfg;
    mdl_open_options o = opts ? *opts : mdl_open_options_all();
    int last = o.last < 0 ? cfg->n_layers : o.last;
    if (o.first < 0 || o.first > last || last > cfg->n_layers) {
        int L = cfg->n_layers;
        mdl_free(m);
        return fu_errorf(FU_ERR_RANGE, "%s: blocks [%d, %d) outside the model's %d blocks", path,
                         o.first, last, L);
    }
    m->first = o.first;
    m->last = last;
    m->has_embed = o.embed;
    m->has_head = o.head;
    m->layers = calloc((size_t)(last - o.first) + 1, sizeof *m->layers);
    m->rot_dim = cfg->head_dim;
    if (!m->layers || !m->name) {
        mdl_free(m);
        return fu_errorf(FU_ERR_NOMEM, "model");
    }
    *out = m;
    return FU_OK;
}

int mdl_open(const char *path, const mdl_open_options *opts, mdl_model **out) {
    *out = NULL;
    mdl_config cfg;
    gguf_file *gf = NULL;
    st_model *st = NULL;
    char *gguf_path_buf = NULL;
    int rc;

    if (mdl_is_dir(path)) {
        char cfg_path[4096];
        snprintf(cfg_path, sizeof cfg_path, "%s/config.json", path);
        if (!mdl_is_file(cfg_path)) {
            gguf_path_buf = mdl_single_gguf(path);
            if (!gguf_path_buf)
                return fu_errorf(FU_ERR_NOT_FOUND,
                                 "%s: neither a Hugging Face model directory (no config.json) nor a "
                                 "directory with one .gguf file",
                                 path);
        } else {
            if ((rc = mdl_config_from_hf(cfg_path, &cfg))) return rc;
            if ((rc = st_model_open(path, &st))) return rc;
        }
    } else if (!mdl_is_file(path)) {
        return fu_errorf(FU_ERR_NOT_FOUND, "%s: no such model file or directory", path);
    }
    if (!st) {
        const char *gp = gguf_path_buf ? gguf_path_buf : path;
        rc = gguf_open(gp, &gf);
        if (rc == FU_OK) rc = mdl_config_read_gguf(gf, &cfg);
        if (rc) {
            gguf_close(gf);
            free(gguf_path_buf);
            return rc;
        }
    }
    mdl_model *m = NULL;
    rc = mdl_alloc(&cfg, opts, gguf_path_buf ? gguf_path_buf : path, &m);
    free(gguf_path_buf);
    if (rc) {
        gguf_close(gf);
        st_model_close(st);
        return rc;
    }
    mdl_impl *impl = m->impl;
    impl->gguf = gf;
    impl->st = st;
    if ((rc = mdl_bind_all(m, st ? &mdl_names_hf : &mdl_names_gguf))) goto err;

    const float *factors = NULL;
    if (gf) {
        op_tensor rf;
        int64_t fi = gguf_find_tensor(gf, "rope_freqs.weight");
        if (fi >= 0) {
            if ((rc = gguf_tensor_as_op(gf, fi, &rf))) goto err;
            if (rf.type != OP_TYPE_F32 || rf.ne[0] != m->rot_dim / 2) {
                rc = fu_errorf(FU_ERR_FORMAT, "%s: tensor 'rope_freqs.weight' must be f32 [%d]",
                               m->path, m->rot_dim / 2);
                goto err;
            }
            float *copy = mdl_own(m, malloc((size_t)(m->rot_dim / 2) * sizeof(float)));
            if (!copy) {
                rc = fu_errorf(FU_ERR_NOMEM, "rope_freqs");
                goto err;
            }
            memcpy(copy, rf.data, (size_t)(m->rot_dim / 2) * sizeof(float));
            factors = copy;
        }
    }
    if ((rc = mdl_rope_init(m, factors))) goto err;
    FU_INFO("model %s: %s, %d blocks (loaded [%d, %d)%s%s), hidden %d, heads %d/%d x %d, vocab %d",
            m->path, mdl_arch_name(cfg.arch), cfg.n_layers, m->first, m->last,
            m->has_embed ? ", embeddings" : "", m->has_head ? ", head" : "", cfg.dim, cfg.n_heads,
            cfg.n_kv_heads, cfg.head_dim, cfg.vocab_size);
    *out = m;
    return FU_OK;
err:
    mdl_free(m);
    return rc;
}

/* ---- random weights ------------------------------------------------------------------ */

typedef struct mdl_rng {
    uint64_t s;
} mdl_rng;

static uint64_t mdl_rng_next(mdl_rng *r) { /* splitmix64 */
    uint64_t z = (r->s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/* Approximately normal(0, std): sum of four uniforms, rescaled. */
static float mdl_rng_normal(mdl_rng *r, float std) {
    uint64_t v = mdl_rng_next(r);
    float s = 0;
    for (int i = 0; i < 4; i++) s += (float)((v >> (16 * i)) & 0xffff) / 65535.0f;
    return (s - 2.0f) * 1.7320508f * std;
}

/* Each tensor draws from its own stream, keyed by (seed, block, which), so a
 * span of a random model holds exactly the whole model's numbers. */
static mdl_rng mdl_rng_for(uint64_t seed, int block, int which) {
    mdl_rng r = {seed ^ ((uint64_t)(block + 1) << 32) ^ ((uint64_t)which << 8)};
    mdl_rng_next(&r);
    return r;
}

/* An interleaved type is drawn as its plain type and repacked (a matrix whose
 * rows are not a multiple of the group stays plain). */
static int mdl_random_matrix(mdl_model *m, op_tensor *dst, op_type type, int64_t ne0, int64_t ne1,
                             mdl_rng rng_val, float std) {
    mdl_rng *rng = &rng_val;
    const op_type plain = op_type_plain(type);
    const bool repack = plain != type && ne1 % op_type_row_group(type) == 0;
    size_t row_bytes = op_row_bytes(plain, ne0);
    void *data = malloc(row_bytes * (size_t)ne1);
    if (!repack) data = mdl_own(m, data);
    float *scales = plain == OP_TYPE_I8 ? mdl_own(m, malloc((size_t)ne1 * sizeof(float))) : NULL;
    float *row = malloc((size_t)ne0 * sizeof *row);
    if (!data || !row || (plain == OP_TYPE_I8 && !scales)) {
        free(row);
        if (repack) free(data);
        return fu_errorf(FU_ERR_NOMEM, "random weights");
    }
    for (int64_t r = 0; r < ne1; r++) {
        for (int64_t i = 0; i < ne0; i++) row[i] = mdl_rng_normal(rng, std);
        op_quantize_row(plain, row, ne0, (uint8_t *)data + (size_t)r * row_bytes, scales ? scales + r : NULL);
    }
    free(row);
    *dst = op_tensor_2d(plain, data, ne0, ne1);
    dst->row_scale = scales;
    if (repack) {
        /* 64-byte aligned: the kernels load whole cache lines of it */
        void *packed = NULL;
        if (posix_memalign(&packed, 64, row_bytes * (size_t)ne1)) packed = NULL;
        packed = mdl_own(m, packed);
        int rc = packed ? op_repack_weight(dst, type, packed) : fu_errorf(FU_ERR_NOMEM, "random weights");
        free(data);
        if (rc) return rc;
        dst->type = type;
        dst->data = packed;
    }
    return FU_OK;
}

static int mdl_random_vector(mdl_model *m, op_tensor *dst, int64_t n, mdl_rng rng_val, float mean,
                             float std) {
    mdl_rng *rng = &rng_val;
    float *f = mdl_own(m, malloc((size_t)n * sizeof *f));
    if (!f) return fu_errorf(FU_ERR_NOMEM, "random weights");
    for (int64_t i = 0; i < n; i++) f[i] = mean + mdl_rng_normal(rng, std);
    *dst = op_tensor_1d(OP_TYPE_F32, f, n);
    return FU_OK;
}

void mdl_release_tensor(const mdl_model *m, const op_tensor *t) {
    const mdl_impl *impl = m->impl;
    size_t n = op_tensor_nbytes(t);
    if (impl->gguf) gguf_release(impl->gguf, t->data, n);
    if (impl->st) st_model_release(impl->st, t->data, n);
}

int mdl_random(const mdl_config *cfg, op_type weight_type, uint64_t seed,
               const mdl_open_options *opts, mdl_model **out) {
    *out = NULL;
    int rc = mdl_config_check(cfg, "random model");
    if (rc) return rc;
    if (!op_type_is_weight(weight_type))
        return fu_errorf(FU_ERR_INVALID, "random model: %s is not a weight type", op_type_name(weight_type));
    if (op_type_block_elems(weight_type) > 1 &&
        (cfg->dim % OP_QK || cfg->ffn_dim % OP_QK || (cfg->n_heads * cfg->head_dim) % OP_QK))
        return fu_errorf(FU_ERR_INVALID, "random model: %s needs dimensions that are multiples of %d",
                         op_type_name(weight_type), OP_QK);
    mdl_model *m;
    if ((rc = mdl_alloc(cfg, opts, "random", &m))) return rc;
    const mdl_config *c = &m->cfg;
    const int64_t D = c->dim, F = c->ffn_dim, QD = (int64_t)c->n_heads * c->head_dim,
                  KD = (int64_t)c->n_kv_heads * c->head_dim, V = c->vocab_size;
#define MDL_R_(block, which) mdl_rng_for(seed, (block), (which))
    if (m->has_embed || (m->has_head && c->tied_embeddings)) {
        op_tensor e;
        if ((rc = mdl_random_matrix(m, &e, weight_type, D, V, MDL_R_(-1, 0), 0.5f))) goto err;
        if (m->has_embed) m->tok_embd = e;
        if (m->has_head && c->tied_embeddings) m->lm_head = e;
    }
    if (m->has_head) {
        if ((rc = mdl_random_vector(m, &m->out_norm, D, MDL_R_(-1, 1), 1.0f, 0.1f))) goto err;
        if (!c->tied_embeddings &&
            (rc = mdl_random_matrix(m, &m->lm_head, weight_type, D, V, MDL_R_(-1, 2), 0.05f)))
            goto err;
    }
    for (int l = m->first; l < m->last; l++) {
        mdl_layer *L = &m->layers[l - m->first];
        if ((rc = mdl_random_vector(m, &L->attn_norm, D, MDL_R_(l, 0), 1.0f, 0.1f)) ||
            (rc = mdl_random_matrix(m, &L->wq, weight_type, D, QD, MDL_R_(l, 1), 0.05f)) ||
            (rc = mdl_random_matrix(m, &L->wk, weight_type, D, KD, MDL_R_(l, 2), 0.05f)) ||
            (rc = mdl_random_matrix(m, &L->wv, weight_type, D, KD, MDL_R_(l, 3), 0.05f)) ||
            (rc = mdl_random_matrix(m, &L->wo, weight_type, QD, D, MDL_R_(l, 4), 0.05f)) ||
            (rc = mdl_random_vector(m, &L->ffn_norm, D, MDL_R_(l, 5), 1.0f, 0.1f)) ||
            (rc = mdl_random_matrix(m, &L->w_gate, weight_type, D, F, MDL_R_(l, 6), 0.05f)) ||
            (rc = mdl_random_matrix(m, &L->w_up, weight_type, D, F, MDL_R_(l, 7), 0.05f)) ||
            (rc = mdl_random_matrix(m, &L->w_down, weight_type, F, D, MDL_R_(l, 8), 0.05f)))
            goto err;
        if (c->qkv_bias && ((rc = mdl_random_vector(m, &L->bq, QD, MDL_R_(l, 9), 0.0f, 0.1f)) ||
                            (rc = mdl_random_vector(m, &L->bk, KD, MDL_R_(l, 10), 0.0f, 0.1f)) ||
                            (rc = mdl_random_vector(m, &L->bv, KD, MDL_R_(l, 11), 0.0f, 0.1f))))
            goto err;
        if (c->qk_norm &&
            ((rc = mdl_random_vector(m, &L->q_norm, c->head_dim, MDL_R_(l, 12), 1.0f, 0.1f)) ||
             (rc = mdl_random_vector(m, &L->k_norm, c->head_dim, MDL_R_(l, 13), 1.0f, 0.1f))))
            goto err;
    }
#undef MDL_R_
    if ((rc = mdl_rope_init(m, NULL))) goto err;
    *out = m;
    return FU_OK;
err:
    mdl_free(m);
    return rc;
}

void mdl_free(mdl_model *m) {
    if (!m) return;
    mdl_impl *impl = m->impl;
    if (impl) {
        for (size_t i = 0; i < impl->n_bufs; i++) free(impl->bufs[i]);
        free(impl->bufs);
        gguf_close(impl->gguf);
        st_model_close(impl->st);
        free(impl);
    }
    free(m->layers);
    free(m->path);
    free(m->name);
    free(m);
}

uint64_t mdl_weight_bytes_per_token(const mdl_model *m) {
    uint64_t total = 0;
    for (int l = 0; l < m->last - m->first; l++) {
        const mdl_layer *L = &m->layers[l];
        const op_tensor *ws[] = {&L->wq, &L->wk, &L->wv, &L->wo, &L->w_gate, &L->w_up, &L->w_down};
        for (size_t i = 0; i < sizeof ws / sizeof ws[0]; i++) total += op_tensor_nbytes(ws[i]);
    }
    if (m->has_head) total += op_tensor_nbytes(&m->lm_head);
    return total;
}

struct gguf_file *mdl_gguf(const mdl_model *m) {
    return m && m->impl ? ((mdl_impl *)m->impl)->gguf : NULL;
}
