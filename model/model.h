/* model.h -- a Llama-family model's configuration and the weights of a span of its blocks.
 *
 * Sources: a Hugging Face directory (config.json + *.safetensors), a GGUF file,
 * or random weights of given dimensions (tests, benchmarks). Weights of files
 * stay memory-mapped and are used in place, quantized ones included; only the
 * small vectors (norms, biases) are converted to f32 copies. A model opened for
 * blocks [first, last) touches no other block's tensors.
 *
 * An mdl_model is immutable once loaded: any number of engines and threads may
 * read it at once. It owns its sources, mappings and converted buffers, and
 * its weights' backend copies; mdl_free() releases them all.
 */
#ifndef FU_MODEL_H
#define FU_MODEL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "ops.h"

typedef enum mdl_arch {
    MDL_ARCH_LLAMA = 0, /* LlamaForCausalLM (Llama 2/3, SmolLM2) */
    MDL_ARCH_MISTRAL,   /* MistralForCausalLM */
    MDL_ARCH_QWEN2,     /* Qwen2ForCausalLM: q/k/v biases */
    MDL_ARCH_QWEN3,     /* Qwen3ForCausalLM: per-head q/k RMSNorm */
} mdl_arch;

typedef enum mdl_rope_scaling {
    MDL_ROPE_SCALING_NONE = 0,
    MDL_ROPE_SCALING_LINEAR, /* positions divided by factor */
    MDL_ROPE_SCALING_LLAMA3, /* Llama 3.1 frequency-dependent scaling */
} mdl_rope_scaling;

typedef struct mdl_config {
    mdl_arch arch;
    int n_layers;       /* L: transformer blocks */
    int dim;            /* D: hidden size */
    int ffn_dim;        /* F: MLP intermediate size */
    int n_heads;        /* H */
    int n_kv_heads;     /* KVH */
    int head_dim;       /* hd (may differ from D / H) */
    int vocab_size;     /* V */
    int max_seq_len;    /* max_position_embeddings / context_length */
    float norm_eps;
    float rope_theta;
    mdl_rope_scaling rope_scaling;
    float rope_factor;             /* linear / llama3 */
    float rope_low_freq_factor;    /* llama3 */
    float rope_high_freq_factor;   /* llama3 */
    int rope_orig_max_pos;         /* llama3: original_max_position_embeddings */
    op_rope_mode rope_mode;        /* NEOX for HF checkpoints, NORM for GGUF llama */
    bool tied_embeddings;
    bool qkv_bias;
    bool qk_norm;
} mdl_config;

typedef struct mdl_layer {
    op_tensor attn_norm; /* (D) f32 */
    op_tensor wq;        /* (H * hd, D) */
    op_tensor wk;        /* (KVH * hd, D) */
    op_tensor wv;        /* (KVH * hd, D) */
    op_tensor wo;        /* (D, H * hd) */
    op_tensor bq;        /* (H * hd) f32, qkv_bias only */
    op_tensor bk;        /* (KVH * hd) f32, qkv_bias only */
    op_tensor bv;        /* (KVH * hd) f32, qkv_bias only */
    op_tensor q_norm;    /* (hd) f32, qk_norm only */
    op_tensor k_norm;    /* (hd) f32, qk_norm only */
    op_tensor ffn_norm;  /* (D) f32 */
    op_tensor w_gate;    /* (F, D) */
    op_tensor w_up;      /* (F, D) */
    op_tensor w_down;    /* (D, F) */
} mdl_layer;

typedef struct mdl_model {
    mdl_config cfg;
    int first, last;     /* blocks [first, last) are loaded */
    bool has_embed;      /* tok_embd loaded */
    bool has_head;       /* out_norm + lm_head loaded */
    op_tensor tok_embd;  /* (V, D) */
    op_tensor out_norm;  /* (D) f32 */
    op_tensor lm_head;   /* (V, D); the same data as tok_embd when tied */
    mdl_layer *layers;   /* (last - first); layers[i] is block first + i */
    float *inv_freq;     /* (rot_dim / 2) rope frequencies, scaling applied */
    int rot_dim;
    char *path;          /* where it came from */
    char *name;          /* a short display name */
    void *impl;          /* sources and owned buffers (model.c) */
} mdl_model;

typedef struct mdl_open_options {
    int first;        /* first block to load */
    int last;         /* one past the last block; -1: all */
    bool embed;       /* load the token embeddings */
    bool head;        /* load the final norm and LM head */
} mdl_open_options;

/* Options for the whole model with embeddings and head. */
mdl_open_options mdl_open_options_all(void);

/* Opens `path` (HF directory, GGUF file, or a directory with one .gguf). On
 * failure returns a negative status; fu_last_error() names the file, tensor and
 * problem. The caller frees *out with mdl_free(). */
int mdl_open(const char *path, const mdl_open_options *opts, mdl_model **out);

/* Reads a Hugging Face config.json of `len` bytes at `json` into *out
 * (`name` is used in messages). Every hyper-parameter is checked: finite, in
 * a sensible range and consistent (heads a multiple of KV heads, even head
 * dim, ...); FU_ERR_FORMAT / FU_ERR_UNSUPPORTED name the key otherwise. */
int mdl_config_read_hf(const char *json, size_t len, const char *name, mdl_config *out);

/* Reads the configuration from a GGUF file's metadata (and its token_embd
 * rows), checked as mdl_config_read_hf; messages name the metadata key. */
struct gguf_file;
int mdl_config_read_gguf(const struct gguf_file *f, mdl_config *out);

/* Builds a model of random weights (normal, std 0.02; norms near 1) of
 * `weight_type` for every matmul weight, deterministic in `seed`. An
 * interleaved type (see op_weight_layout) gives the same numbers as its plain
 * type, already in the layout a backend would repack them into. */
int mdl_random(const mdl_config *cfg, op_type weight_type, uint64_t seed,
               const mdl_open_options *opts, mdl_model **out);

void mdl_free(mdl_model *m); /* NULL is a no-op */

/* Tells the model that t (one of its tensors) has been copied elsewhere, so
 * that the pages of its file mapping can be given back; a later read of t
 * still works (it pages the data in again). A no-op for tensors that are not
 * mapped from a file. */
void mdl_release_tensor(const mdl_model *m, const op_tensor *t);

/* Bytes of matmul weights read per token by blocks [first, last) (+ the LM head
 * if loaded): the numerator of the decode bandwidth bound. */
uint64_t mdl_weight_bytes_per_token(const mdl_model *m);

/* The GGUF file the model came from, or NULL (for the tokenizer). */
struct gguf_file *mdl_gguf(const mdl_model *m);

const char *mdl_arch_name(mdl_arch arch);

#endif
