/* lora.h -- LoRA adapters in PEFT's format: configuration, f32 weights of a span of blocks, files.
 *
 * An adapter adds to each targeted linear layer W (out, in) of a block the
 * low-rank update scale * B @ A, with A (r, in) and B (out, r) and scale =
 * lora_alpha / r (lora_alpha / sqrt(r) with use_rslora). Files are PEFT's: a
 * directory with adapter_config.json and adapter_model.safetensors holding
 * base_model.model.model.layers.N.{self_attn,mlp}.TARGET.lora_{A,B}.weight.
 *
 * A shard holds the adapter of its span [first, last) only: lora_load() reads
 * just those blocks' tensors, and lora_save() of a span adapter writes just
 * those. A whole-model adapter is assembled from spans by lora_new() over
 * [0, n_layers) and one lora_merge_span() per span; its lora_save() is then
 * the complete PEFT adapter.
 *
 * Ownership: an adapter owns its weights (one contiguous f32 buffer) and is
 * freed with lora_free(). Threading: none inside; an adapter may be read by
 * any number of threads at once, written by one at a time.
 */
#ifndef FU_LORA_H
#define FU_LORA_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "model.h"

/* The linear layers of a block an adapter may target, by PEFT's names. */
typedef enum lora_target {
    LORA_TARGET_Q = 0, /* self_attn.q_proj:  D -> H * hd */
    LORA_TARGET_K,     /* self_attn.k_proj:  D -> KVH * hd */
    LORA_TARGET_V,     /* self_attn.v_proj:  D -> KVH * hd */
    LORA_TARGET_O,     /* self_attn.o_proj:  H * hd -> D */
    LORA_TARGET_GATE,  /* mlp.gate_proj:     D -> F */
    LORA_TARGET_UP,    /* mlp.up_proj:       D -> F */
    LORA_TARGET_DOWN,  /* mlp.down_proj:     F -> D */
    LORA_N_TARGETS,
} lora_target;

#define LORA_TARGET_BIT(t) (1u << (t))
#define LORA_TARGETS_ALL ((1u << LORA_N_TARGETS) - 1u) /* PEFT's "all-linear" */

#define LORA_MAX_NAME 1024 /* base_model_name_or_path, NUL included */

typedef struct lora_config {
    int r;                  /* rank, >= 1 */
    float alpha;            /* lora_alpha */
    float dropout;          /* lora_dropout, in [0, 1) (training only) */
    bool use_rslora;        /* scale alpha / sqrt(r) instead of alpha / r */
    uint32_t targets;       /* LORA_TARGET_BIT()s, non-zero */
    char base_model[LORA_MAX_NAME]; /* base_model_name_or_path; "" when unknown */
} lora_config;

/* The model shape an adapter is for (from mdl_config). */
typedef struct lora_shape {
    int n_layers; /* L */
    int dim;      /* D */
    int ffn_dim;  /* F */
    int n_heads;  /* H */
    int n_kv_heads; /* KVH */
    int head_dim; /* hd */
} lora_shape;

/* One target's matrices in one block; both NULL for a target not adapted. */
typedef struct lora_pair {
    float *a; /* (r, in) row-major, as PEFT stores lora_A.weight */
    float *b; /* (out, r) row-major, as PEFT stores lora_B.weight */
} lora_pair;

typedef struct lora_adapter {
    lora_config cfg;
    lora_shape shape;
    int first, last;   /* blocks [first, last) are held */
    lora_pair *pairs;  /* ((last - first) * LORA_N_TARGETS): block first + i, target t at
                          [i * LORA_N_TARGETS + t] */
    float *data;       /* (n_floats) every A and B, block by block, target by target, A then B */
    size_t n_floats;
    bool qk_interleaved; /* q_proj / k_proj B rows in GGUF llama's order (pairs (i, i + hd/2) of
                            each head interleaved, as convert_hf_to_gguf permutes Q and K for
                            OP_ROPE_NORM), to match a model held that way; files hold PEFT's order */
    op_backend *dev_be;  /* the backend of dev (lora_upload), NULL: none yet */
    float *dev;          /* data as that backend's ops read it: data itself on a backend that reads
                            host memory (the CPU), else a copy in its memory that the adapter owns */
} lora_adapter;

/* A config with PEFT's defaults: r 8, lora_alpha 8, dropout 0, no rslora,
 * targets q_proj and v_proj, no base model name. */
lora_config lora_config_default(void);

/* The scale of B @ A: alpha / r, or alpha / sqrt(r) with use_rslora. */
float lora_scale(const lora_config *cfg);

/* PEFT's module name of a target ("q_proj"), and its parent ("self_attn" or "mlp"). */
const char *lora_target_name(lora_target t);
const char *lora_target_parent(lora_target t);

/* Parses a PEFT target name ("q_proj") into *t; FU_ERR_NOT_FOUND if unknown. */
int lora_target_parse(const char *name, lora_target *t);

/* Parses a comma-separated list of PEFT target names ("q_proj,v_proj") or
 * "all-linear" into a set of LORA_TARGET_BIT()s; FU_ERR_INVALID naming an
 * unknown name or an empty list. */
int lora_targets_parse(const char *list, uint32_t *out);

/* The shape of a model config. */
lora_shape lora_shape_of(const mdl_config *m);

/* The in and out features of target t (see lora_target). */
void lora_target_dims(const lora_shape *s, lora_target t, int *in, int *out);

/* Checks a config: r >= 1, finite alpha, dropout in [0, 1), targets a
 * non-empty subset of LORA_TARGETS_ALL. FU_ERR_INVALID naming the field. */
int lora_config_check(const lora_config *cfg);

/* The pair of block `block` (in [first, last)) and target t. */
static inline lora_pair *lora_at(const lora_adapter *ad, int block, lora_target t) {
    return &ad->pairs[(size_t)(block - ad->first) * LORA_N_TARGETS + (size_t)t];
}

/* One matrix of an adapter, as lora_foreach() presents it. */
typedef struct lora_matrix {
    int block;
    lora_target target;
    int is_b;           /* 0: lora_A (r, in); 1: lora_B (out, r) */
    const char *name;   /* PEFT's tensor name, "base_model.model.model.layers.N.PARENT.TARGET.lora_A.weight" */
    float *data;        /* (rows, cols) row-major, owned by the adapter */
    int rows, cols;
} lora_matrix;

/* Calls fn on every held matrix, block by block, target by target, A before B
 * (the order of the file lora_save() writes); stops at the first non-zero
 * return of fn and returns it. `m` is valid during the call only. */
int lora_foreach(const lora_adapter *ad, int (*fn)(const lora_matrix *m, void *user), void *user);

/* Adapters live in memory in the row order of the model they were made or
 * loaded for: lora_new() and lora_load() for a model with OP_ROPE_NORM (a
 * GGUF llama) set qk_interleaved and hold q_proj / k_proj B rows interleaved;
 * lora_save() writes PEFT's order whatever the adapter holds. */

/* Puts the q_proj / k_proj B rows of every held block into GGUF llama's
 * interleaved order (interleaved true) or PEFT's, and sets qk_interleaved.
 * FU_ERR_NOMEM (nothing changed). */
int lora_set_qk_order(lora_adapter *ad, bool interleaved);

/* A fresh adapter of config `cfg` for model `m`, holding blocks [first, last)
 * (0 <= first < last <= n_layers), initialised as PEFT does: A kaiming-uniform
 * with a = sqrt(5), i.e. uniform(-1/sqrt(in), 1/sqrt(in)), B zero. The
 * numbers are a function of `seed` and of the block index alone, so a span
 * adapter holds the same values as the same blocks of a whole one. The
 * caller frees *out with lora_free(). FU_ERR_INVALID for a bad config or span,
 * FU_ERR_NOMEM. */
int lora_new(const lora_config *cfg, const mdl_config *m, int first, int last, uint64_t seed,
             lora_adapter **out);

/* Fills every B with uniform(-bound, bound) from `seed` (by block, as
 * lora_new()): an adapter whose update is not zero, for tests. */
void lora_randomize_b(lora_adapter *ad, uint64_t seed, float bound);

/* Reads the PEFT adapter in directory `dir` for model `m`, keeping blocks
 * [first, last) (last = -1: all). Tensors may be F32, BF16 or F16 (converted
 * to f32); names may carry PEFT's ".default" adapter infix
 * ("...q_proj.lora_A.default.weight"). Refused, with a message naming the
 * file, key or tensor: files that are missing or not regular files, malformed
 * JSON, peft_type other than LORA, r < 1 or r > max_rank, unknown target
 * names, bias other than "none", use_dora, rank or alpha patterns, tensors
 * missing, extra or misnamed, of a wrong shape (expected vs got) or dtype,
 * non-finite values, and blocks past the model's n_layers. The caller frees
 * *out with lora_free(). */
int lora_load(const char *dir, const mdl_config *m, int first, int last, int max_rank,
              lora_adapter **out);

/* The two files of a PEFT adapter directory. */
#define LORA_CONFIG_FILE "adapter_config.json"
#define LORA_WEIGHTS_FILE "adapter_model.safetensors"

/* Writes the adapter into directory `dir` (which must exist) as PEFT does:
 * adapter_config.json and adapter_model.safetensors (f32, the held blocks
 * only), each written atomically. FU_ERR_IO naming the file, FU_ERR_NOMEM. */
int lora_save(const lora_adapter *ad, const char *dir);

/* Copies the blocks of span adapter `span` into `whole` (which holds them:
 * its span contains span's), for assembling a whole-model adapter from the
 * shards' spans. FU_ERR_INVALID unless both have the same config (r,
 * targets) and shape and span's blocks lie within whole's. */
int lora_merge_span(lora_adapter *whole, const lora_adapter *span);

/* Makes the adapter's weights readable by backend be's ops (ad->dev): the
 * first call picks host memory or a copy in be's memory; later calls copy
 * data there again (after it changed: an optimizer step). FU_ERR_INVALID when
 * it was uploaded to another backend, FU_ERR_NOMEM. */
int lora_upload(lora_adapter *ad, op_backend *be);

/* Where host pointer p (into ad->data) is in ad->dev. */
static inline float *lora_dev(const lora_adapter *ad, const float *p) { return ad->dev + (p - ad->data); }

void lora_free(lora_adapter *ad); /* NULL is a no-op; frees a device copy too */

#endif
